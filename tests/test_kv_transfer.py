"""KV blocks moved between executors (prefill/decode disaggregation): the receiving KV
manager's host tier (kvmanager/transfer.py) with exact block ids, serials and swap-ins;
the executor's export and import byte for byte (executor/cache_engine.py), their checks
(plan_inputs.check_block_moves) and the wire fields (protocol 10)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.executor.cache_engine import CacheEngine
from pagedserve.executor.plan_inputs import PlanLimits, check_block_moves
from pagedserve.kvmanager import KVCacheManager
from pagedserve.protos import wire
from pagedserve.protos.codec import Codec

BS = 4
A = list(range(1, 15))  # three full blocks and two tokens


def manager(num_gpu: int = 8, num_cpu: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(num_gpu, num_cpu, BS, watermark=0, hash_algo="builtin",
                          debug_checks=True, **kw)


def admit(m: KVCacheManager, rid: str, toks: list[int]):
    """One plan admitting `toks`: (the hit, the block ops)."""
    m.begin_step()
    hashes = m.hash_blocks(toks)
    hit = m.lookup(toks, hashes)
    m.allocate(rid, toks, len(toks) - hit.num_tokens, hit=hit, block_hashes=hashes)
    ops = m.take_block_ops()
    m.end_step()
    return hit, ops


def pairs(arr) -> list[tuple[int, int]]:
    return [tuple(p) for p in arr.tolist()]


def test_received_blocks_are_a_host_hit_swapped_in_at_admission():
    m = manager()
    skip, cpu_ids = m.import_blocks(A, m.hash_blocks(A), None, 0, 3)
    assert (skip, cpu_ids) == (0, [0, 1, 2])
    chain = [m.cpu.blocks[c] for c in cpu_ids]
    assert [b.parent_serial for b in chain] == [0, chain[0].serial, chain[1].serial]
    assert [b.token_ids for b in chain] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    assert m.num_imported_blocks == 3 and m.cpu.num_free == 8  # entries, not held
    hit, ops = admit(m, "r", A)
    assert hit.host_block_ids == (0, 1, 2) and hit.num_tokens == 12
    assert m.block_table("r") == [0, 1, 2, 3]
    assert pairs(ops.swap_in) == [(0, 0), (1, 1), (2, 2)]
    # registered on the device under the same entries: a later prompt hits the device
    assert [m.gpu.blocks[g].serial for g in (0, 1, 2)] == [b.serial for b in chain]
    m.check_invariants()


def test_blocks_held_already_are_not_taken_again():
    m = manager()
    admit(m, "a", A[:9])  # the device registers blocks 0 and 1 of A
    m.free("a")
    skip, cpu_ids = m.import_blocks(A, m.hash_blocks(A), None, 0, 3)
    assert (skip, cpu_ids) == (2, [0])  # only the third block is new here
    assert m.cpu.blocks[0].parent_serial == m.gpu.blocks[1].serial
    hit, ops = admit(m, "r", A)
    assert hit.block_ids == (0, 1) and hit.host_block_ids == (0,)
    assert pairs(ops.swap_in) == [(0, m.block_table("r")[2])]
    m.check_invariants()


def test_a_gap_before_the_received_blocks_takes_none():
    m = manager()
    assert m.import_blocks(A, m.hash_blocks(A), None, 1, 2) == (0, [])
    assert not m.cpu.cached and m.num_imported_blocks == 0
    m.check_invariants()


def test_as_many_as_the_cpu_pool_holds_and_the_rest_computed():
    m = manager(num_cpu=2)
    assert m.import_blocks(A, m.hash_blocks(A), None, 0, 3) == (0, [0, 1])
    hit, _ = admit(m, "r", A)
    assert hit.num_tokens == 8  # the third block is computed


def test_a_salted_prompt_chains_from_its_salt():
    m = manager()
    hashes = m.hash_blocks(A, "tenant")
    m.import_blocks(A, hashes, "tenant", 0, 3)
    assert len(m.lookup(A, m.hash_blocks(A))) == 0  # unsalted: another chain
    assert len(m.lookup(A, hashes, "tenant")) == 3


def test_no_cpu_pool_or_no_prefix_caching_takes_none():
    assert manager(num_cpu=0).import_blocks(A, [], None, 0, 3) == (0, [])
    m = manager(enable_prefix_caching=False)
    assert m.import_blocks(A, m.hash_blocks(A), None, 0, 3) == (0, [])


def test_received_entries_are_evicted_like_any_host_entry():
    m = manager(num_cpu=3)
    m.import_blocks(A, m.hash_blocks(A), None, 0, 3)
    other = list(range(50, 64))
    # a second prompt's blocks need the pool: the oldest entries go (A's tail first)
    assert m.import_blocks(other, m.hash_blocks(other), None, 0, 3)[1] == [2, 1, 0]
    assert len(m.lookup(A, m.hash_blocks(A))) == 0
    assert len(m.lookup(other, m.hash_blocks(other))) == 3
    m.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 3),
                          st.booleans()), min_size=1, max_size=12))
def test_imports_admissions_and_frees_keep_the_invariants(ops):
    """Random imports (of four prompts sharing a first block), admissions and frees: the
    invariants hold, and every hit holds exactly the prompt's tokens."""
    prompts = [[7, 7, 7, 7] + [10 * p + i for i in range(13)] for p in range(4)]
    m = manager(num_gpu=10, num_cpu=5)
    live: list[str] = []
    for n, (p, first, count, free) in enumerate(ops):
        toks = prompts[p]
        m.import_blocks(toks, m.hash_blocks(toks), None, first, min(count, 4 - first))
        m.check_invariants()
        if free and live:
            m.free(live.pop(0))
        elif m.num_free_gpu_blocks >= 5:
            hit, _ = admit(m, f"r{n}", toks)
            for k, b in enumerate(hit.block_ids):
                assert m.gpu.blocks[b].token_ids == tuple(toks[k * BS:(k + 1) * BS])
            live.append(f"r{n}")
        m.check_invariants()


# --------------------------------------------------------------------------- executor


def engine(num_gpu=6, num_cpu=4, dtype=torch.float32) -> CacheEngine:
    cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    return CacheEngine(cfg, BS, num_gpu, num_cpu, dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_export_then_import_moves_the_bytes(dtype):
    src, dst = engine(dtype=dtype), engine(dtype=dtype)
    values = torch.randn(src.kv_cache.shape).clamp(-8, 8).to(dtype)
    src.kv_cache.copy_(values)
    data = src.export_blocks(np.array([4, 1]))
    assert data.dtype == np.uint8 and data.shape == (2 * src.block_bytes,)
    assert src.kv_format == f"{str(dtype).removeprefix('torch.')}:2x2x4x2x8"
    dst.apply_moves([("swap_in", np.array([[3, 0], [2, 5]]))], np.array([3, 2]), data)
    for got, want in ((0, 4), (5, 1)):  # imported into cpu 3 and 2, then swapped in
        assert torch.equal(dst.kv_cache[:, :, got].view(torch.uint8),
                           values[:, :, want].view(torch.uint8))
    # the wire's layout: block after block, each in the cache's order (run copies included)
    ids = np.array([2, 3, 4, 0])
    want = values.index_select(2, torch.from_numpy(ids)).movedim(2, 0).contiguous()
    assert np.array_equal(src.export_blocks(ids), want.view(-1).view(torch.uint8).numpy())


def test_no_blocks_export_and_import_nothing():
    """A handoff of a prompt shorter than a block asks for none (a crash here once took
    the prefill executor down)."""
    src = engine()
    data = src.export_blocks(np.array([], dtype=np.int64))
    assert data.dtype == np.uint8 and data.shape == (0,)
    before = src.cpu_cache.clone()
    src.apply_moves([], np.array([], dtype=np.int64), data)
    assert torch.equal(src.cpu_cache, before)


def test_plans_naming_bad_blocks_or_bytes_are_refused():
    limits = PlanLimits(BS, 6, 4, 64, 100, torch.device("cpu"), kv_block_bytes=10)

    def plan(**kw):
        return wire.StepPlan(step_id=1, **kw)

    ok = plan(kv_import=np.array([0, 3]), kv_import_data=np.zeros(20, np.uint8),
              kv_export=np.array([5]))
    assert check_block_moves(ok, limits) == ""
    assert "out of range" in check_block_moves(plan(kv_export=np.array([6])), limits)
    assert "out of range" in check_block_moves(
        plan(kv_import=np.array([4]), kv_import_data=np.zeros(10, np.uint8)), limits)
    assert "twice" in check_block_moves(
        plan(kv_import=np.array([1, 1]), kv_import_data=np.zeros(20, np.uint8)), limits)
    assert "19 bytes" in check_block_moves(
        plan(kv_import=np.array([0, 1]), kv_import_data=np.zeros(19, np.uint8)), limits)


def test_the_wire_carries_and_checks_the_kv_fields():
    codec = Codec()
    data = np.arange(1 << 17, dtype=np.int64).astype(np.uint8)  # a frame of its own
    plan = wire.StepPlan(step_id=3, kv_import=np.array([2, 0], np.int64), kv_import_data=data,
                         kv_export=np.array([1], np.int64))
    back = codec.decode(codec.encode(plan))
    assert back.kv_import.tolist() == [2, 0] and back.kv_export.tolist() == [1]
    assert np.array_equal(back.kv_import_data, data)
    result = wire.StepResult(step_id=3, kv_export_data=data[:64])
    assert np.array_equal(codec.decode(codec.encode(result)).kv_export_data, data[:64])
    with pytest.raises(wire.WireError, match="kv_import_data"):
        codec.decode(codec.encode(wire.StepPlan(step_id=4, kv_import=np.array([1]))))
    with pytest.raises(wire.WireError, match="kv_import_data"):
        codec.decode(codec.encode(wire.StepPlan(step_id=4, kv_import=np.array([1]),
                                                kv_import_data=np.zeros(4, np.int32))))
    with pytest.raises(wire.WireError, match="kv_export_data"):
        codec.decode(codec.encode(wire.StepResult(step_id=4,
                                                  kv_export_data=np.zeros(2, np.int32))))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_export_then_import_moves_the_bytes_on_cuda(dtype):
    """The CUDA path: export reads device blocks back to the host, import writes the pinned
    CPU cache and the device swap-in (cache_ops.swap_blocks_device) brings them in."""
    cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    device = torch.device("cuda")
    src = CacheEngine(cfg, BS, 6, 4, dtype, device)
    dst = CacheEngine(cfg, BS, 6, 4, dtype, device)
    values = torch.randn(src.kv_cache.shape, device=device).clamp(-8, 8).to(dtype)
    src.kv_cache.copy_(values)
    data = src.export_blocks(np.array([4, 1]))
    assert data.shape == (2 * src.block_bytes,)
    dst.apply_moves([("swap_in", np.array([[3, 0], [2, 5]]))], np.array([3, 2]), data)
    for got, want in ((0, 4), (5, 1)):
        assert torch.equal(dst.kv_cache[:, :, got].view(torch.uint8),
                           values[:, :, want].view(torch.uint8))


def test_a_failed_export_sends_no_bytes_and_the_executor_goes_on(tmp_path, monkeypatch):
    """A forward's export (a handoff) and an export-only plan (a pull) that fail: the
    results carry no bytes and no error (the router's import then takes none and the
    receiver computes them), the step's token is sampled, and the next steps run."""
    from pagedserve.executor.runner_setup import build_runner
    from test_executor_support import Driver

    from pagedserve.tinymodels import build_model
    runner = build_runner(str(build_model(tmp_path / "llama", "llama")), num_gpu_blocks=16,
                          num_cpu_blocks=4, block_size=8, progress=False)
    driver = Driver(runner)
    driver.add("a", list(range(3, 20)))  # two full blocks and a token
    good = driver.runner.cache.export_blocks

    def broken(block_ids):
        raise RuntimeError("device lost the blocks")

    monkeypatch.setattr(runner.cache, "export_blocks", broken)
    result = driver.step({"a": None}, kv_export=np.array([0, 1], dtype=np.int64))
    assert result.kv_export_data is None and len(result.token_ids) == 1
    rowless = driver.runner.execute(driver.plan({}, kv_export=np.array([0], dtype=np.int64)))
    assert rowless.kv_export_data is None and not rowless.errors
    monkeypatch.setattr(runner.cache, "export_blocks", good)
    result = driver.step({"a": None}, kv_export=np.array([0, 1], dtype=np.int64))
    assert result.kv_export_data.shape == (2 * runner.cache.block_bytes,)
    assert len(driver.seqs["a"].outputs) == 2
