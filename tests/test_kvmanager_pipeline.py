"""The KV manager with plans in flight (pipelined steps), against a simulated executor.

A request's token list holds only tokens the "router" has received; a token being sampled by
a plan in flight is pending (a count). A decode of a pending token writes a placeholder into
its slot when the plan is sent; the placeholder becomes the sampled token only when the plan
executes. Checked after every rule:

- no block in the prefix cache holds a placeholder, and every cached block's tokens are what
  the plans sent so far write into it (a lookup can never serve a token the router has not
  seen, nor keys and values no plan computes);
- a block handed out by a plan is not named by any plan still in flight (fences);
- `check_invariants()`; and once every plan is answered and every request freed, every
  block is free again.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedserve.kvmanager import KVCacheManager

BS = 4
DEPTH = 2
NUM_BLOCKS = 7  # few, so freed blocks are soon handed out again
PLACEHOLDER = "P"


def _sample(rid: str, pos: int) -> int:
    """What the simulated executor samples for `rid` at position `pos` (tiny vocabulary, so
    prefixes repeat and get cached)."""
    return (sum(map(ord, rid)) + pos) % 2


class PipelinedKV(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, 0, BS, watermark=0.0, hash_algo="builtin")
        self.tokens: dict[str, list[int]] = {}  # received tokens only
        self.pending: dict[str, int] = {}
        self.in_flight: list[dict] = []  # oldest first
        self.step = 0
        self.n = 0
        self.content: dict[int, list] = {}  # block id -> slots as the sent plans write them
        self.freed: set[str] = set()

    # ------------------------------------------------------------ helpers

    def _named(self) -> set[int]:
        return {b for plan in self.in_flight for b in plan["blocks"]}

    def _send(self, writes: list[tuple[str, int]], sampled: list[str],
              new_blocks: list[int]) -> None:
        """Record the plan: its writes (request, position), the samples it takes."""
        assert not set(new_blocks) & self._named(), "a block of a plan in flight handed out"
        self.step += 1
        blocks: set[int] = set()
        slots = []
        for rid, pos in writes:
            table = self.m.block_table(rid)
            blocks.update(table)
            block, off = table[pos // BS], pos % BS
            known = pos < len(self.tokens[rid])
            value = self.tokens[rid][pos] if known else PLACEHOLDER
            self.content.setdefault(block, [None] * BS)[off] = value
            slots.append((rid, pos, block, off))
        self.m.end_step(self.step)
        for rid in sampled:
            self.pending[rid] += 1
        self.in_flight.append({"step": self.step, "blocks": blocks, "slots": slots,
                               "sampled": sampled})

    # ------------------------------------------------------------ rules

    @precondition(lambda self: len(self.in_flight) < DEPTH)
    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=10))
    def admit(self, prompt: list[int]) -> None:
        self.n += 1
        rid = f"r{self.n}"
        m = self.m
        m.begin_step()
        hashes = m.hash_blocks(prompt)
        hit = m.lookup(prompt, hashes)
        new = m.allocate(rid, prompt, len(prompt) - hit.num_tokens, hit=hit,
                         block_hashes=hashes)
        if new is None:
            m.end_step()
            return
        self.tokens[rid] = list(prompt)
        self.pending[rid] = 0
        self._send([(rid, p) for p in range(hit.num_tokens, len(prompt))], [rid], new)

    @precondition(lambda self: len(self.in_flight) < DEPTH)
    @rule(data=st.data())
    def decode(self, data) -> None:
        ready = sorted(r for r in self.tokens if r not in self.freed and self.pending[r] <= 1
                       and len(self.tokens[r]) + self.pending[r] < 14)
        if not ready:
            return
        rid = data.draw(st.sampled_from(ready))
        m = self.m
        m.begin_step()
        pos = len(self.tokens[rid]) + self.pending[rid] - 1  # the newest token's position
        if m.num_tokens(rid) > pos:  # already computed (its input not sampled yet)
            m.end_step()
            return
        new = m.allocate(rid, self.tokens[rid], 1)
        if new is None:
            m.end_step()
            return
        self._send([(rid, pos)], [rid], new)

    @precondition(lambda self: self.in_flight)
    @rule()
    def answer(self) -> None:
        """The oldest plan's result: its placeholders become the sampled tokens, which the
        router appends (unless the request ended meanwhile: a late stop)."""
        plan = self.in_flight.pop(0)
        for rid, pos, block, off in plan["slots"]:
            toks = self.tokens[rid]
            if self.content.get(block, [None] * BS)[off] == PLACEHOLDER and pos < len(toks):
                self.content[block][off] = toks[pos]
        self.m.plan_answered(plan["step"])
        for rid in plan["sampled"]:
            self.pending[rid] -= 1
            if rid not in self.freed:
                self.tokens[rid].append(_sample(rid, len(self.tokens[rid])))
                # A placeholder of this position in a later plan is now known: it is what
                # the executor feeds.
                pos = len(self.tokens[rid]) - 1
                for later in self.in_flight:
                    for r, p, block, off in later["slots"]:
                        if r == rid and p == pos:
                            self.content[block][off] = self.tokens[rid][pos]

    @rule(data=st.data())
    def finish(self, data) -> None:
        """A stop (EOS, abort) while plans naming the request may be in flight."""
        live = sorted(r for r in self.tokens if r not in self.freed)
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        self.m.free(rid)
        self.freed.add(rid)

    # ------------------------------------------------------------ invariants

    @invariant()
    def cache_holds_only_received_tokens(self) -> None:
        for block in self.m.gpu.cached.values():
            slots = self.content.get(block.block_id)
            assert slots is not None, f"block {block.block_id} cached but never written"
            assert PLACEHOLDER not in slots, f"placeholder in cached block {block.block_id}"
            assert tuple(slots) == block.token_ids, (block.block_id, slots, block.token_ids)

    @invariant()
    def accounting(self) -> None:
        self.m.check_invariants()

    def teardown(self) -> None:
        while self.in_flight:
            self.answer()
        for rid in list(self.tokens):
            if rid not in self.freed:
                self.m.free(rid)
        self.m.check_invariants()
        stats = self.m.stats().gpu
        assert self.m.num_free_gpu_blocks == stats.num_total_blocks == NUM_BLOCKS


TestPipelinedKV = PipelinedKV.TestCase
TestPipelinedKV.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_block_freed_with_a_plan_in_flight_waits_for_its_answer():
    """Exact ids: a request ends (late stop) while plan 2 naming its block is in flight; the
    block goes back to the free queue only when plan 2 is answered."""
    m = KVCacheManager(4, 0, 4, watermark=0.0)
    m.begin_step()
    assert m.allocate("a", [5, 6, 7], 3) == [0]
    m.end_step(1)
    m.begin_step()
    assert m.allocate("a", [5, 6, 7], 1) == []  # decode of the token plan 1 samples
    m.end_step(2)
    m.plan_answered(1)
    m.free("a")  # the token of plan 1 was EOS: the request ends; plan 2 still names block 0
    assert m.num_free_gpu_blocks == 3 and m.stats().gpu.num_free_blocks == 4
    m.begin_step()
    assert m.allocate("b", [1, 2, 3, 4, 5], 5) == [1, 2]  # not block 0
    m.end_step(3)
    assert m.gpu.free_block_ids() == [3]
    m.plan_answered(2)  # the newest plan in flight when a was freed
    assert m.gpu.free_block_ids() == [3, 0]
    m.plan_answered(3)
    m.check_invariants()


def test_block_with_a_pending_token_is_registered_only_once_it_arrives():
    m = KVCacheManager(8, 0, 4, watermark=0.0)
    tokens = [1, 2, 3]
    m.begin_step()
    m.allocate("a", tokens, 3, block_hashes=m.hash_blocks(tokens))
    m.end_step(1)  # samples token 3 (position 3)
    m.begin_step()
    m.allocate("a", tokens, 1)  # position 3: its input is pending; block 0 now has 4 slots
    m.end_step(2)
    assert m.gpu.cached == {}  # its last slot holds a token the router has not seen
    m.plan_answered(1)
    tokens.append(9)
    m.begin_step()
    m.allocate("a", tokens, 1)  # position 4
    m.end_step(3)
    assert [b.token_ids for b in m.gpu.cached.values()] == [(1, 2, 3, 9)]
