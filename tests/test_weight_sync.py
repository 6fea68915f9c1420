"""The router's weight updates and pauses (router/weight_sync.py) over fake executors: what
each executor is sent and when, what an update waits for (the running requests, every
executor's answers), how it ends (a refusal changes nothing; a failed load takes its
executor out), the prefix caches reset, joiners given the cluster's weights before any
request, and pausing by abort or retract."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pagedserve.router.errors import InvalidRequest, NotFound
from pagedserve.router.weight_sync import WeightSync


class _Kv:
    def __init__(self) -> None:
        self.resets = 0

    def reset_prefix_cache(self) -> int:
        self.resets += 1
        return 0


def _handle(name: str, weights: str = ""):
    return SimpleNamespace(
        id=name, healthy=True, weight_ops=[], weights_path="", wakeup=asyncio.Event(),
        hello=SimpleNamespace(weights_path=weights), kv=_Kv(),
        scheduler=SimpleNamespace(hold="", running=[], swapped=[], waiting=[]))


class _Engine(SimpleNamespace):
    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        for handle in self.executors.values():  # its executor forgets it at once
            handle.scheduler.running = [g for g in handle.scheduler.running if g != request_id]
        return self.live.pop(request_id, None) is not None


def _sync(*names: str, enabled: bool = True):
    engine = _Engine(executors={}, live={}, aborted=[], lost=[])
    sync = WeightSync(engine, enabled, version="v0")

    def executor_lost(handle, why):
        handle.healthy = False
        engine.lost.append((handle.id, why))
        sync.executor_lost(handle)

    engine.membership = SimpleNamespace(executor_lost=executor_lost)
    for name in names:
        _join(sync, name)
    return sync, engine


def _join(sync: WeightSync, name: str, weights: str = ""):
    handle = sync.engine.executors[name] = _handle(name, weights)
    sync.executor_joined(handle)
    return handle


def _answer(sync: WeightSync, handle, failed: str = ""):
    """The executor answers the plan carrying its first queued op: (path, load)."""
    op = handle.weight_ops.pop(0)
    sync.answered(handle, op, failed)
    return op.path, op.load


def _run(coro_fn) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 10))  # an update that never ends fails, not hangs


async def _settle(n: int = 3):
    for _ in range(n):
        await asyncio.sleep(0)


async def _until(cond):
    while not cond():
        await asyncio.sleep(0.005)


async def _updating(path: str, *names: str):
    """An update of ``path`` over fresh executors ``names``, once their checks are queued:
    (sync, engine, the handles, the update's task)."""
    sync, engine = _sync(*names)
    handles = list(engine.executors.values())
    update = asyncio.ensure_future(sync.update_from_disk(path))
    await _until(lambda: all(h.weight_ops for h in handles))
    return sync, engine, handles, update


def test_an_update_waits_for_the_running_then_checks_loads_and_resets_everywhere():
    async def run():
        sync, engine = _sync("e0", "e1")
        e0, e1 = engine.executors.values()
        e0.scheduler.running = ["r1"]
        e1.scheduler.waiting = ["r2", "r3"]
        update = asyncio.ensure_future(sync.update_from_disk("/ckpt/7", weight_version="s7"))
        await asyncio.sleep(0.05)
        # held at once; nothing sent while r1 runs
        assert (e0.scheduler.hold, e1.scheduler.hold) == ("hold", "hold")
        assert e0.wakeup.is_set() and not e0.weight_ops and not update.done()
        e0.scheduler.running = []
        await _until(lambda: e0.weight_ops and e1.weight_ops)
        assert _answer(sync, e0) == ("/ckpt/7", False)
        await _settle()
        assert not e1.weight_ops[0].load or not e0.weight_ops  # the load waits for e1's check
        assert _answer(sync, e1) == ("/ckpt/7", False)
        await _until(lambda: e0.weight_ops and e1.weight_ops)
        assert [_answer(sync, h) for h in (e0, e1)] == [("/ckpt/7", True)] * 2
        assert await update == 2  # r2 and r3 waited
        assert (sync.path, sync.version) == ("/ckpt/7", "s7")
        assert (e0.kv.resets, e1.kv.resets) == (1, 1)
        assert (e0.scheduler.hold, e1.scheduler.hold) == ("", "")
        assert sync.ready(e0) and sync.ready(e1) and not engine.lost

    _run(run)


def test_a_refused_check_changes_nothing_and_says_why():
    async def run():
        sync, engine, (e0, e1), update = await _updating("/other", "e0", "e1")
        _answer(sync, e0)
        _answer(sync, e1, failed="weights /other: config.json num_layers is 3, the running "
                                 "model's is 2 (weights of another model)")
        with pytest.raises(InvalidRequest, match=r"executor e1: weights /other: config.json "
                                                 "num_layers is 3"):
            await update
        assert not e0.weight_ops and not e1.weight_ops  # no load went out
        assert (sync.path, sync.version, e0.kv.resets) == ("", "v0", 0)
        assert e0.scheduler.hold == "" and sync.ready(e0) and sync.ready(e1)

    _run(run)


def test_a_failed_load_takes_its_executor_out_and_the_others_update():
    async def run():
        sync, engine, (e0, e1), update = await _updating("/ckpt/8", "e0", "e1")
        _answer(sync, e0), _answer(sync, e1)
        await _until(lambda: e0.weight_ops and e1.weight_ops)
        _answer(sync, e0, failed="weights /ckpt/8 partly loaded: OSError: Input/output error")
        _answer(sync, e1)
        assert await update == 0
        assert engine.lost == [
            ("e0", "new weights: weights /ckpt/8 partly loaded: OSError: Input/output error")]
        assert sync.path == "/ckpt/8" and e1.kv.resets == 1 and sync.ready(e1)

    _run(run)


def test_abort_all_requests_and_pauses():
    async def run():
        sync, engine = _sync("e0")
        (e0,) = engine.executors.values()
        engine.live = {"r1": 1, "r2": 2}
        e0.scheduler.running = ["r1", "r2"]
        update = asyncio.ensure_future(sync.update_from_disk("/c", abort_all_requests=True))
        await _until(lambda: e0.weight_ops)
        assert engine.aborted == ["r1", "r2"]
        _answer(sync, e0)
        await _until(lambda: e0.weight_ops)
        _answer(sync, e0)
        await update
        # pause by retract: returns once the executor's next step carried it out
        e0.scheduler.running = ["r3"]
        pause = asyncio.ensure_future(sync.pause("retract"))
        await asyncio.sleep(0.03)
        assert e0.scheduler.hold == "retract" and sync.has_work(e0) and not pause.done()
        e0.scheduler.running, e0.scheduler.waiting, e0.scheduler.hold = [], ["r3"], "hold"
        await pause
        # paused: an update runs at once and leaves admission held; continue releases it
        update = asyncio.ensure_future(sync.update_from_disk("/d"))
        await _until(lambda: e0.weight_ops)
        _answer(sync, e0)
        await _until(lambda: e0.weight_ops)
        _answer(sync, e0)
        assert await update == 1 and e0.scheduler.hold == "hold"
        await sync.resume()
        assert e0.scheduler.hold == "" and not sync.holds()
        with pytest.raises(InvalidRequest, match="mode: 'freeze' is not one of abort, "
                                                 "retract, wait, keep, in_place"):
            await sync.pause("freeze")

    _run(run)


def test_pause_wait_and_keep_and_an_update_retracts_the_frozen():
    async def run():
        sync, engine = _sync("e0")
        (e0,) = engine.executors.values()
        e0.scheduler.running = ["r1"]
        pause = asyncio.ensure_future(sync.pause("wait"))  # vLLM's: the running finish
        await asyncio.sleep(0.03)
        assert e0.scheduler.hold == "hold" and not pause.done() and not engine.aborted
        e0.scheduler.running = []
        await pause
        assert await sync.is_paused()
        await sync.resume()
        assert e0.scheduler.hold == "" and not await sync.is_paused()
        e0.scheduler.running = ["r2"]
        await sync.pause("in_place")  # SGLang's name of keep: at once, r2 frozen
        assert (sync.paused, e0.scheduler.hold, sync.has_work(e0)) == ("keep", "freeze", False)
        update = asyncio.ensure_future(sync.update_from_disk("/c"))
        await _until(lambda: e0.scheduler.hold == "retract")  # its KV is the old weights'
        assert sync.has_work(e0)
        e0.scheduler.running, e0.scheduler.waiting, e0.scheduler.hold = [], ["r2"], "hold"
        for _ in range(2):  # (the step above retracted it) the check, the load
            await _until(lambda: e0.weight_ops)
            _answer(sync, e0)
        assert await update == 1 and e0.scheduler.hold == "hold"
        await sync.resume()
        assert e0.scheduler.hold == ""
        e0.scheduler.running = ["r3"]
        update = asyncio.ensure_future(sync.update_from_disk("/d"))
        await asyncio.sleep(0.02)
        with pytest.raises(InvalidRequest, match="a weight update is waiting for the running"):
            await sync.pause("keep")
        e0.scheduler.running = []
        for _ in range(2):
            await _until(lambda: e0.weight_ops)
            _answer(sync, e0)
        await update

    _run(run)


def test_joiners_get_the_cluster_weights_before_any_request():
    async def run():
        sync, engine = _sync("e0")
        (e0,) = engine.executors.values()
        update = asyncio.ensure_future(sync.update_from_disk("/ckpt/9"))
        await _until(lambda: e0.weight_ops)
        late = _join(sync, "late")  # joins after the check went out, runs its --model's
        assert late.scheduler.hold == "hold" and sync.ready(late)  # ("" is the router's yet)
        _answer(sync, e0)
        await _until(lambda: e0.weight_ops and late.weight_ops)
        assert [(o.path, o.load) for o in late.weight_ops] == [("/ckpt/9", True)]
        later = _join(sync, "later")  # joins after the loads went out
        _answer(sync, e0), _answer(sync, late)
        await update
        assert sync.ready(late) and late.kv.resets == 1
        # not in the update: it loads the new weights now, and is routed nothing before
        assert [(o.path, o.load) for o in later.weight_ops] == [("/ckpt/9", True)]
        assert not sync.ready(later) and later.scheduler.hold == ""
        _answer(sync, later)
        assert sync.ready(later)
        # after a restart of its own (or of the router) an executor says what it runs
        again = _join(sync, "again", weights="/ckpt/9")
        assert sync.ready(again) and not again.weight_ops
        stale = _join(sync, "stale", weights="?")  # a load cut partway before
        assert not sync.ready(stale)
        _answer(sync, stale, failed="weights /ckpt/9: not a directory this executor can read")
        assert engine.lost[-1] == ("stale", "new weights: weights /ckpt/9: not a directory "
                                            "this executor can read")

    _run(run)


def test_off_without_the_flag():
    async def run():
        sync, _ = _sync("e0", enabled=False)
        with pytest.raises(NotFound, match="start the router with --enable-weight-updates"):
            await sync.update_from_disk("/c")
        with pytest.raises(NotFound):
            await sync.pause("abort")
        assert await sync.flush(idle_only=False) == 0  # always served
        assert sync.engine.executors["e0"].kv.resets == 1
        sync.engine.live["r"] = 1
        with pytest.raises(InvalidRequest, match="Cache not flushed: 1 requests are running"):
            await sync.flush(idle_only=True)
        with pytest.raises(NotFound):
            await sync.current_version()

    _run(run)
