"""Stateful property test of the KV-cache manager against a simulated executor.

Every rule is one step: begin_step, the operation, then the executor's part of the plan
(swap-out, swap-in, copy, then writing the new tokens by slot_mapping into simulated
blocks), end_step. After every step: check_invariants(), no block is both a source and a
destination in the plan, and every live request reads back exactly its own tokens through
its block table, so a wrong prefix hit, a missed copy-on-write or a bad swap shows up as
wrong contents. A tiny vocabulary makes prefixes (and, with the weak hash, collisions)
common.

Intended prefixes: a request pinned for later also intends its prompt (as a routed, waiting
request does); admitting it links the intent, which is released once its blocks register.
After every step the intended index is checked (check_invariants), and a probe's intended
tokens are sound: each block counted is one a live intender's own tokens and salt match.
"""

from __future__ import annotations

from collections import defaultdict

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedserve.kvmanager import KVCacheManager

BS = 4
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)
salts = st.sampled_from([None, None, "s"])


class KVMachine(RuleBasedStateMachine):
    hash_fn = None
    offloading = False
    num_blocks = (20, 10)  # device, CPU

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(*self.num_blocks, BS, watermark=0.1, max_pinned_fraction=0.3,
                                hash_fn=self.hash_fn, hash_algo="builtin",
                                enable_offloading=self.offloading)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}  # positions whose K/V the executor wrote
        self.family: dict[str, str] = {}
        self.salt: dict[str, str | None] = {}
        self.pending: dict[str, tuple[list[int], str | None]] = {}  # pinned, not allocated
        self.sim = {"gpu": defaultdict(lambda: [None] * BS), "cpu": defaultdict(lambda: [None] * BS)}
        self.n = 0
        self.writes: list[tuple[str, int, int]] = []  # (rid, start, count) this step
        self.seen: list[tuple[list[int], str | None]] = []  # prompts admitted so far
        self.weights = 0  # weight updates so far: every K/V depends on the weights too
        # export holds (a prefix pull's blocks, kvmanager/transfer.py): key -> (ids, what
        # the simulated device held in them when the hold began)
        self.holds: dict[str, tuple[tuple[int, ...], list]] = {}

    # ------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def _live(self, on_gpu: bool) -> list[str]:
        return sorted(r for r in self.tokens if self.m.is_swapped(r) != on_gpu)

    def _run_step(self, op) -> None:
        self.m.begin_step()
        self.writes = []
        op()
        ops = self.m.take_block_ops()
        gpu_src = set(ops.swap_out[:, 0].tolist()) | set(ops.copy[:, 0].tolist())
        gpu_dst = set(ops.swap_in[:, 1].tolist()) | set(ops.copy[:, 1].tolist())
        assert not gpu_src & gpu_dst, (gpu_src, gpu_dst)
        assert not set(ops.swap_out[:, 1].tolist()) & set(ops.swap_in[:, 0].tolist())
        gpu, cpu = self.sim["gpu"], self.sim["cpu"]
        for g, c in ops.swap_out.tolist():
            cpu[c] = list(gpu[g])
        for c, g in ops.swap_in.tolist():
            gpu[g] = list(cpu[c])
        for s, d in ops.copy.tolist():
            gpu[d] = list(gpu[s])
        for rid, start, count in self.writes:
            slots = self.m.slot_mapping(rid, start, count).tolist()
            for pos, slot in zip(range(start, start + count), slots, strict=True):
                gpu[slot // BS][slot % BS] = self._kv(rid, pos)
        self.m.end_step()

    def _admit(self, rid, prompt, salt, hit) -> bool:
        hashes = self.m.hash_blocks(prompt, cache_salt=salt)
        new = self.m.allocate(rid, prompt, len(prompt) - hit.num_tokens, hit=hit,
                              block_hashes=hashes, cache_salt=salt)
        if new is None:
            return False
        self.tokens[rid] = list(prompt)
        self.seen.append((list(prompt), salt))
        self.computed[rid] = len(prompt)
        self.family[rid] = rid
        self.salt[rid] = salt
        self.writes.append((rid, hit.num_tokens, len(prompt) - hit.num_tokens))
        return True

    def _kv(self, rid, pos):
        # What a position's keys/values depend on: every token up to it (and, by policy,
        # the cache salt), so a hit from another context reads back as wrong.
        return (self.weights, self.salt[rid], tuple(self.tokens[rid][: pos + 1]))

    # ------------------------------------------------------------ rules

    @rule(prompt=prompts, salt=salts)
    def admit(self, prompt, salt):
        def op():
            hit = self.m.lookup(prompt, self.m.hash_blocks(prompt, cache_salt=salt), salt)
            self._check_hit(prompt, hit, salt)
            self._admit(self._new_id(), prompt, salt, hit)

        self._run_step(op)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=5))
    def admit_again(self, data, extra):
        """A prompt seen before comes back, maybe longer (a conversation's next turn)."""
        prompt, salt = data.draw(st.sampled_from(self.seen))
        self.admit(prompt + extra, salt)

    @rule(prompt=prompts, extra=prompts, salt=salts)
    def admit_two_in_one_step(self, prompt, extra, salt):
        def op():
            for toks in (prompt, prompt + extra):
                hit = self.m.lookup(toks, self.m.hash_blocks(toks, cache_salt=salt), salt)
                self._check_hit(toks, hit, salt)
                self._admit(self._new_id(), toks, salt, hit)

        self._run_step(op)

    @rule(prompt=prompts, salt=salts)
    def pin_for_later(self, prompt, salt):
        rid = self._new_id()
        hit = self.m.lookup(prompt, self.m.hash_blocks(prompt, cache_salt=salt), salt)
        self._check_hit(prompt, hit, salt)
        pinned = self.m.pin(rid, hit)
        assert pinned.block_ids == hit.block_ids[: len(pinned.block_ids)]
        self.m.intend(rid, prompt, self.m.hash_blocks(prompt, cache_salt=salt), salt,
                      order=(self.n,))
        self.pending[rid] = (prompt, salt)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def admit_pinned(self, data):
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        prompt, salt = self.pending[rid]

        def op():
            hit = self.m.pinned(rid)
            if hit is None:  # pins were released: look up again
                hit = self.m.lookup(prompt, self.m.hash_blocks(prompt, cache_salt=salt), salt)
            else:
                self._check_hit(prompt, hit, salt)
            if self._admit(rid, prompt, salt, hit):
                del self.pending[rid]
                assert self.m.pinned(rid) is None

        self._run_step(op)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=5),
          first=st.integers(0, 2))
    def hold_for_export(self, data, extra, first):
        """A prefix pull's source: the cached blocks of a prompt seen before, from `first`
        on, are held until the plan exporting them is answered (`export_answered`)."""
        prompt, salt = data.draw(st.sampled_from(self.seen))
        prompt = prompt + extra
        hit = self.m.lookup(prompt, self.m.hash_blocks(prompt, cache_salt=salt), salt)
        self._check_hit(prompt, hit, salt)
        key = self._new_id()
        ids = self.m.hold_export(key, hit, first)
        assert ids == hit.block_ids[first:]
        if ids:
            self.holds[key] = (ids, [list(self.sim["gpu"][b]) for b in ids])

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def export_answered(self, data):
        """The export reads what the blocks held when the hold began: nothing allocated,
        swapped or copied into them since."""
        key = data.draw(st.sampled_from(sorted(self.holds)))
        ids, contents = self.holds.pop(key)
        assert [self.sim["gpu"][b] for b in ids] == contents, ids
        refs = [self.m.gpu.blocks[b].ref_cnt for b in ids]
        assert self.m.release_export(key) and not self.m.release_export(key)
        assert [self.m.gpu.blocks[b].ref_cnt for b in ids] == [r - 1 for r in refs]

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def drop_pending(self, data):
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        del self.pending[rid]
        if self.m.pinned(rid) is not None or self.m.has_intent(rid):
            self.m.free(rid)
        assert not self.m.has_intent(rid)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def drop_intent(self, data):
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        self.m.drop_intent(rid)

    @rule(prompt=prompts, salt=salts, waiting_key=st.integers(0, 30))
    def probe_intended(self, prompt, salt, waiting_key):
        hashes = self.m.hash_blocks(prompt, cache_salt=salt)
        hit = self.m.lookup(prompt, hashes, salt)
        for before in (None, (waiting_key,)):
            n = self.m.intended_tokens(prompt, hashes, salt, len(hit), before=before)
            assert n % BS == 0 and hit.num_tokens + n <= max(0, (len(prompt) - 1) // BS * BS)
            for i in range(len(hit), len(hit) + n // BS):
                hi = (i + 1) * BS
                assert any(
                    self.pending.get(r, (None, None))[1] == salt
                    and list(self.pending[r][0][:hi]) == list(prompt[:hi])
                    for r in self.m.intent_ids()
                ), (prompt, i)

    @rule()
    def release_pins(self):
        self.m.release_pins()
        assert self.m.stats().num_pinned_blocks == 0

    @precondition(lambda self: not self.tokens and not self.holds)
    @rule()
    def update_weights(self):
        """No request runs: new weights, the prefix cache reset (router/weight_sync.py). A
        later hit reading K/V of the old weights fails `_check_hit`; the requests still
        waiting (pinned) look up again."""
        cached = len(self.m.gpu.cached)
        assert self.m.reset_prefix_cache() == 0
        self.weights += 1
        assert not self.m.gpu.cached and not self.m.cpu.cached
        assert self.m.stats().num_pinned_blocks == 0
        assert self.m.stats().gpu.num_evictions >= cached

    @precondition(lambda self: self._live(True))
    @rule(data=st.data(), tok=st.integers(0, 2), lookahead=st.integers(0, 2))
    def append(self, data, tok, lookahead):
        rid = data.draw(st.sampled_from(self._live(True)))

        def op():
            toks = self.tokens[rid]
            toks.append(tok)
            before = self.m.num_tokens(rid)
            start = self.computed[rid]
            n = len(toks) - start
            got = self.m.allocate(rid, toks, n, lookahead=lookahead, num_computed_tokens=start)
            if got is None:
                toks.pop()
                assert self.m.num_tokens(rid) == before
            else:
                self.writes.append((rid, start, n))
                self.computed[rid] = len(toks)

        self._run_step(op)

    @precondition(lambda self: self._live(True))
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(self._live(True)))
        child = self._new_id()
        self.m.fork(rid, child)
        self.tokens[child] = list(self.tokens[rid])
        self.computed[child] = self.computed[rid]
        self.family[child] = self.family[rid]
        self.salt[child] = self.salt[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), in_step=st.booleans())
    def free(self, data, in_step):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))

        def op():
            self.m.free(rid)
            del self.tokens[rid]
            del self.computed[rid]

        if in_step:
            self._run_step(op)
        else:
            op()

    def _group(self, rid) -> list[str]:
        fam = self.family[rid]
        return sorted(r for r in self.tokens if self.family[r] == fam)

    @precondition(lambda self: self._live(True))
    @rule(data=st.data())
    def swap_out(self, data):
        group = self._group(data.draw(st.sampled_from(self._live(True))))

        def op():
            can = self.m.can_swap_out(group)
            pairs = self.m.swap_out(group)
            assert (pairs is not None) == can
            if pairs is not None:
                assert len({c for _, c in pairs}) == len(pairs)

        self._run_step(op)

    @precondition(lambda self: self._live(True))
    @rule(data=st.data(), tok=st.integers(0, 2))
    def append_then_swap_out(self, data, tok):
        """Preemption after the victim was already given its slots in this plan."""
        rid = data.draw(st.sampled_from(self._live(True)))
        group = self._group(rid)

        def op():
            toks = self.tokens[rid]
            toks.append(tok)
            start = self.computed[rid]
            n = len(toks) - start
            if self.m.allocate(rid, toks, n, num_computed_tokens=start) is None:
                toks.pop()
                return
            if self.m.swap_out(group) is None:
                self.writes.append((rid, start, n))
                self.computed[rid] = len(toks)
            # else: the executor never runs it this step; the token is recomputed after
            # swap-in (computed[rid] stays behind the manager's num_tokens)

        self._run_step(op)

    @precondition(lambda self: self._live(False))
    @rule(data=st.data())
    def swap_in(self, data):
        group = self._group(data.draw(st.sampled_from(self._live(False))))

        def op():
            can = self.m.can_swap_in(group)
            pairs = self.m.swap_in(group)
            assert (pairs is not None) == can

        self._run_step(op)

    # ------------------------------------------------------------ checks

    def _check_hit(self, prompt, hit, salt) -> None:
        assert hit.num_tokens < len(prompt) or hit.num_tokens == 0
        # a device block swapped in from the host by the plan being built holds, when the
        # plan's forward reads it, what its CPU source holds now
        pending = {g: c for c, g in self.m._swap_in}
        blocks = [(self.sim["cpu"], pending[bid]) if bid in pending else (self.sim["gpu"], bid)
                  for bid in hit.block_ids]
        blocks += [(self.sim["cpu"], bid) for bid in hit.host_block_ids]
        assert hit.num_tokens == len(blocks) * BS
        if not self.offloading:
            assert not hit.host_block_ids
        for i, (pool, bid) in enumerate(blocks):
            want = [(self.weights, salt, tuple(prompt[: p + 1]))
                    for p in range(i * BS, (i + 1) * BS)]
            assert pool[bid] == want, (bid, prompt)

    @invariant()
    def consistent(self):
        self.m.check_invariants()
        for rid, toks in self.tokens.items():
            device = "cpu" if self.m.is_swapped(rid) else "gpu"
            table = self.m.block_table(rid)
            n = self.computed[rid]
            assert n <= self.m.num_tokens(rid) <= len(toks)
            got = [self.sim[device][table[p // BS]][p % BS] for p in range(n)]
            assert got == [self._kv(rid, p) for p in range(n)], (rid, device, table)
        s = self.m.stats()
        assert s.gpu.num_free_blocks <= s.gpu.num_total_blocks

    def teardown(self):
        for key in list(self.holds):
            self.m.release_export(key)
        for rid in list(self.tokens):
            self.m.free(rid)
        for rid in list(self.pending):
            if self.m.pinned(rid) is not None or self.m.has_intent(rid):
                self.m.free(rid)
        assert self.m.intent_ids() == [] and self.m.num_intended_tokens == 0
        self.m.check_invariants()
        assert self.m.num_free_gpu_blocks == self.m.stats().gpu.num_total_blocks


class WeakHashKVMachine(KVMachine):
    """Same, with a hash that collides all the time (16 values)."""

    @staticmethod
    def hash_fn(parent, token_ids, extra):
        return hash((parent, tuple(token_ids), extra)) % 16


class OffloadKVMachine(KVMachine):
    """Same, with offloading: freed prefix blocks are copied to the CPU pool when the next
    plan is built, and lookups go on there (a host hit is swapped in). Its reads are
    checked like a device hit's, against the simulated CPU blocks."""

    offloading = True
    num_blocks = (6, 12)  # a small device: blocks are evicted, then found on the host


class WeakHashOffloadKVMachine(OffloadKVMachine):
    hash_fn = staticmethod(WeakHashKVMachine.hash_fn)


for machine in (KVMachine, WeakHashKVMachine, OffloadKVMachine, WeakHashOffloadKVMachine):
    machine.TestCase.settings = settings(machine.TestCase.settings, stateful_step_count=25)
TestKVMachine = KVMachine.TestCase
TestWeakHashKVMachine = WeakHashKVMachine.TestCase
TestOffloadKVMachine = OffloadKVMachine.TestCase
TestWeakHashOffloadKVMachine = WeakHashOffloadKVMachine.TestCase
