"""Helpers for the executor and model suites (no tests here): a miniature router that plans
steps for an in-process ModelRunner, and the Hugging Face greedy oracle."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from pagedserve.protos.wire import (
    Fork,
    NewRequest,
    SamplingParams,
    StepPlan,
    StepResult,
    int32,
    int64_pairs,
)

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Seq:
    rid: str
    tokens: list[int]  # prompt + outputs
    prompt_len: int
    sampling: SamplingParams
    sample_index: int = 0
    num_computed: int = 0
    table: list[int] = field(default_factory=list)
    synced: int = 0  # table entries the executor holds unchanged
    known: bool = False  # the executor has its state
    cpu_table: list[int] = field(default_factory=list)
    lora: str = ""  # its LoRA adapter ("" = the base model)

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class Driver:
    """Plans steps the way the router does (block tables as changes, slot mapping, new
    requests sent once, swap/copy pairs) with a trivial free-list allocator."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.block_size = runner.cache.block_size
        self.free = list(range(runner.cache.num_gpu_blocks))
        self.free_cpu = list(range(runner.cache.num_cpu_blocks))
        self.seqs: dict[str, Seq] = {}
        self.step_id = 0
        self._forks: list[Fork] = []

    def add(self, rid, prompt, sampling=GREEDY, sample_index=0, outputs=(),
            shared_blocks=(), num_cached=0, lora="") -> Seq:
        """A request; ``shared_blocks`` (full blocks of a cached prefix) cover ``num_cached``
        tokens, which then are not computed again; ``lora``: its adapter's name."""
        seq = Seq(rid, list(prompt) + list(outputs), len(prompt), sampling, sample_index,
                  num_computed=num_cached, table=list(shared_blocks), lora=lora)
        self.seqs[rid] = seq
        return seq

    def fork(self, parent: str, child: str, sample_index: int) -> Seq:
        p = self.seqs[parent]
        seq = Seq(child, list(p.tokens), p.prompt_len, p.sampling, sample_index,
                  p.num_computed, list(p.table), synced=len(p.table), known=True, lora=p.lora)
        self.seqs[child] = seq
        self._forks.append(Fork(parent, child, sample_index))
        return seq

    def cow_last_block(self, rid: str) -> np.ndarray:
        """Give ``rid`` a private copy of its last block; returns the copy pair."""
        seq = self.seqs[rid]
        new = self.free.pop(0)
        pair = (seq.table[-1], new)
        seq.table[-1] = new
        seq.synced = min(seq.synced, len(seq.table) - 1)
        return int64_pairs([pair])

    def swap_out(self, rid: str) -> np.ndarray:
        seq = self.seqs[rid]
        seq.cpu_table = [self.free_cpu.pop(0) for _ in seq.table]
        pairs = int64_pairs(list(zip(seq.table, seq.cpu_table, strict=True)))
        self.free[:0] = seq.table  # handed out again first
        seq.table, seq.synced = [], 0
        return pairs

    def swap_in(self, rid: str) -> np.ndarray:
        seq = self.seqs[rid]
        seq.table = [self.free.pop() for _ in seq.cpu_table]  # other ids than before
        pairs = int64_pairs(list(zip(seq.cpu_table, seq.table, strict=True)))
        self.free_cpu.extend(seq.cpu_table)
        seq.cpu_table, seq.synced = [], 0
        return pairs

    def plan(self, schedule: dict[str, int | None], feed=(), **moves) -> StepPlan:
        """``schedule``: request id -> tokens to compute (None: all that are left).

        ``feed``: requests whose decode input is the token being sampled in the previous
        step, not yet accepted (pipelining): one token each, marked in ``feed_sampled``,
        a -1 placeholder in ``token_ids``."""
        new_requests, rows, tokens, positions, slots, table_ids = [], [], [], [], [], []
        for rid, n in schedule.items():
            seq = self.seqs[rid]
            if not seq.known:
                new_requests.append(NewRequest(
                    request_id=rid, prompt_token_ids=int32(seq.tokens[:seq.prompt_len]),
                    output_token_ids=int32(seq.outputs), sampling=seq.sampling,
                    sample_index=seq.sample_index, lora=seq.lora))
                seq.known, seq.synced = True, 0
            if rid in feed:
                assert seq.num_computed == len(seq.tokens), "feed: the input is in flight"
                n, new_tokens, sample = 1, [-1], 1
            else:
                n = len(seq.tokens) - seq.num_computed if n is None else n
                new_tokens = seq.tokens[seq.num_computed:seq.num_computed + n]
                sample = int(seq.num_computed + n == len(seq.tokens))
            end = seq.num_computed + n
            while len(seq.table) * self.block_size < end:
                seq.table.append(self.free.pop(0))
            pos = np.arange(seq.num_computed, end)
            tokens += new_tokens
            positions += pos.tolist()
            slots += (np.array(seq.table)[pos // self.block_size] * self.block_size
                      + pos % self.block_size).tolist()
            rows.append((seq.num_computed, n, sample, seq.synced, len(seq.table) - seq.synced))
            table_ids += seq.table[seq.synced:]
            seq.synced = len(seq.table)
            seq.num_computed = end
        cols = list(zip(*rows, strict=True)) if rows else [()] * 5
        plan = StepPlan(
            step_id=self.step_id, new_requests=new_requests, forks=self._forks,
            request_ids=list(schedule), num_computed_tokens=int32(cols[0]),
            num_new_tokens=int32(cols[1]), do_sample=np.array(cols[2], np.uint8),
            token_ids=int32(tokens), positions=int32(positions),
            slot_mapping=np.array(slots, np.int64), block_table_starts=int32(cols[3]),
            block_table_lens=int32(cols[4]), block_table_ids=int32(table_ids),
            feed_sampled=np.array([r in feed for r in schedule], np.uint8) if feed else None,
            **moves)
        self._forks = []
        self.step_id += 1
        plan.validate()
        return plan

    def step(self, schedule: dict[str, int | None], **moves) -> StepResult:
        result = self.runner.execute(self.plan(schedule, **moves))
        assert not result.errors, result.errors
        self.accept(result)
        return result

    def accept(self, result: StepResult) -> None:
        tokens = [] if result.token_ids is None else result.token_ids.tolist()
        for rid, token in zip(result.request_ids, tokens, strict=True):
            self.seqs[rid].tokens.append(token)

    def generate(self, rids, num_tokens: int) -> None:
        """Prefill what is left, then decode until each has ``num_tokens`` outputs."""
        while any(len(self.seqs[r].outputs) < num_tokens for r in rids):
            self.step({r: None for r in rids if len(self.seqs[r].outputs) < num_tokens})


def hf_reference(model_dir, prompt: list[int], num_tokens: int, _cache=None):
    """Greedy token ids and raw logits of transformers' generate (fp32, one prompt)."""
    from transformers import AutoModelForCausalLM

    if _cache is None:
        _cache = {}
    key = str(model_dir)
    if key not in _cache:
        _cache.clear()
        _cache[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    model = _cache[key]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def assert_greedy_equal(ours: list[int], ref: list[int], ref_logits) -> None:
    """Equal, or equal up to a first mismatch where the reference had a near tie."""
    for j, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            top2 = ref_logits[j].float().topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < 1e-3, f"token {j}: ours {a}, reference {b} (top-2 gap {gap:.2e})"
            return
    assert len(ours) >= len(ref)


class KVDriver(Driver):
    """Like Driver, but every block decision comes from the router's KVCacheManager
    (prefix lookup, copy-on-write, swap pairs, table changes, slot mapping)."""

    def __init__(self, runner) -> None:
        from pagedserve.kvmanager import KVCacheManager

        super().__init__(runner)
        self.mgr = KVCacheManager(runner.cache.num_gpu_blocks, runner.cache.num_cpu_blocks,
                                  self.block_size, watermark=0.0, debug_checks=True)
        self._admission: dict[str, tuple] = {}

    def add(self, rid, prompt, sampling=GREEDY, sample_index=0, outputs=()) -> Seq:
        seq = Seq(rid, list(prompt) + list(outputs), len(prompt), sampling, sample_index)
        hashes = self.mgr.hash_blocks(seq.tokens)
        hit = self.mgr.lookup(seq.tokens, hashes)
        seq.num_computed = hit.num_tokens
        self._admission[rid] = (hit, hashes)
        self.seqs[rid] = seq
        return seq

    def fork(self, parent: str, child: str, sample_index: int) -> Seq:
        self.mgr.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = Seq(child, list(p.tokens), p.prompt_len, p.sampling, sample_index,
                               p.num_computed, known=True)
        self._forks.append(Fork(parent, child, sample_index))
        return self.seqs[child]

    def plan(self, schedule: dict[str, int | None], swap_out=(), swap_in=()) -> StepPlan:
        mgr = self.mgr
        mgr.begin_step()
        for rid in swap_out:
            assert mgr.swap_out([rid]) is not None
        for rid in swap_in:
            assert mgr.swap_in([rid]) is not None
        new_requests, rows, tokens, positions, slots, table_ids = [], [], [], [], [], []
        for rid, n in schedule.items():
            seq = self.seqs[rid]
            n = len(seq.tokens) - seq.num_computed if n is None else n
            if rid in self._admission:
                hit, hashes = self._admission.pop(rid)
                new = mgr.allocate(rid, seq.tokens, n, hit=hit, block_hashes=hashes)
            else:
                new = mgr.allocate(rid, seq.tokens, n, num_computed_tokens=seq.num_computed)
            assert new is not None, "out of blocks"
            if not seq.known:
                new_requests.append(NewRequest(
                    request_id=rid, prompt_token_ids=int32(seq.tokens[:seq.prompt_len]),
                    output_token_ids=int32(seq.outputs), sampling=seq.sampling,
                    sample_index=seq.sample_index, lora=seq.lora))
                seq.known = True
            end = seq.num_computed + n
            tokens += seq.tokens[seq.num_computed:end]
            positions += range(seq.num_computed, end)
            slots += mgr.slot_mapping(rid, seq.num_computed, n).tolist()
            start, ids = mgr.take_table_change(rid)
            rows.append((seq.num_computed, n, int(end == len(seq.tokens)), start, len(ids)))
            table_ids += ids
            seq.num_computed = end
            seq.table = mgr.block_table(rid)
        ops = mgr.take_block_ops()
        cols = list(zip(*rows, strict=True)) if rows else [()] * 5
        plan = StepPlan(
            step_id=self.step_id, new_requests=new_requests, forks=self._forks,
            request_ids=list(schedule), num_computed_tokens=int32(cols[0]),
            num_new_tokens=int32(cols[1]), do_sample=np.array(cols[2], np.uint8),
            token_ids=int32(tokens), positions=int32(positions),
            slot_mapping=np.array(slots, np.int64), block_table_starts=int32(cols[3]),
            block_table_lens=int32(cols[4]), block_table_ids=int32(table_ids),
            swap_out=ops.swap_out, swap_in=ops.swap_in, copy=ops.copy)
        mgr.end_step()
        self._forks = []
        self.step_id += 1
        plan.validate()
        return plan


def unused_blocks(driver: Driver) -> list[int]:
    """The device blocks no request of ``driver`` holds (a padding row must not write them)."""
    used = {b for s in driver.seqs.values() for b in s.table}
    return [b for b in range(driver.runner.cache.num_gpu_blocks) if b not in used]


def assert_as_eager_and_padding_clean(graphed: Driver, eager: Driver) -> list[int]:
    """The graph tests' common check: every request's outputs equal the eager run's, and no
    padding row wrote a device block that no request holds. Returns those blocks."""
    for rid in eager.seqs:
        assert graphed.seqs[rid].outputs == eager.seqs[rid].outputs, rid
    unused = unused_blocks(graphed)
    assert not graphed.runner.cache.kv_cache[:, :, unused].any()  # padding wrote nothing
    return unused


def small_runner(model_dir, device: str = "cpu", **kw):
    """The graph tests' runner: 8-token blocks, 64-token context, 40 device blocks."""
    from pagedserve.executor.runner_setup import build_runner

    kw.setdefault("num_gpu_blocks", 40)
    return build_runner(str(model_dir), device=device, num_cpu_blocks=0, block_size=8,
                        max_model_len=64, progress=False, **kw)
