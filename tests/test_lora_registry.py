"""The router's registry of LoRA adapters loaded while serving (router/lora_registry.py),
over fake executors: which ops each executor is sent and when, what a load waits for and
how it ends (every executor answered; one refused it and the others undo it; executors
lost meanwhile), unloads held back by running requests, joiners loading before they are
routed an adapter's requests, and the prefix-cache salt of each load."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from pagedserve.protos import wire
from pagedserve.router.errors import InvalidRequest, NotFound, Unavailable
from pagedserve.router.lora_registry import LoadedAdapter, LoraRegistry
from pagedserve.router.types import RequestSpec, SamplingSpec


def _handle(name: str):
    return SimpleNamespace(id=name, healthy=True, lora_ops=[], lora_ready=set(), in_flight=[],
                           wakeup=asyncio.Event())


def _registry(*executors: str, static=("sql",), max_loras=3):
    engine = SimpleNamespace(executors={e: _handle(e) for e in executors}, live={})
    return LoraRegistry(engine, static, max_loras), engine


def _answer(registry, handle, failed: dict | None = None):
    """The executor answers the plan that carries its queued ops."""
    ops, handle.lora_ops = handle.lora_ops, []
    registry.answered(handle, ops, [wire.LoraFailure(name=n, message=m)
                                    for n, m in (failed or {}).items()])
    return [(o.name, o.load) for o in ops]


async def _loading(*executors):
    """A registry over ``executors`` with 'rt' being loaded: (registry, handles, the load)."""
    registry, engine = _registry(*executors)
    load = asyncio.ensure_future(registry.load("rt", "/a/rt"))
    await _settle()
    return registry, list(engine.executors.values()), load


async def _loaded(registry, *handles, name="rt", path="/a/rt"):
    """Load ``name`` with every one of ``handles`` answering at once."""
    load = asyncio.ensure_future(registry.load(name, path))
    await _settle()
    for handle in handles:
        _answer(registry, handle)
    await load


def _spec(adapter: str, salt: str = "") -> RequestSpec:
    return RequestSpec(request_id="r", prompt_token_ids=(1, 2), sampling=SamplingSpec(),
                       cache_salt=salt, lora_adapter=adapter)


def _run(coro_fn) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 10))  # a load that never ends fails, not hangs


async def _settle():
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_load_waits_for_every_executor_then_serves():
    async def run():
        registry, (e0, e1), load = await _loading("e0", "e1")
        assert [(o.name, o.load, o.path) for o in e0.lora_ops] == [("rt", True, "/a/rt")]
        assert e0.wakeup.is_set() and e1.lora_ops == e0.lora_ops
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'rt'"):
            registry.admitted(_spec("rt"))  # not before every executor has it
        _answer(registry, e0)
        await _settle()
        assert not load.done() and registry.ready(e0, "rt") and not registry.ready(e1, "rt")
        _answer(registry, e1)
        await load
        assert registry.names == ("sql", "rt")
        assert registry.admitted(_spec("rt", "\x00lora:rt")).cache_salt == "\x00lora:rt\x00gen:1"
        assert registry.admitted(_spec("sql", "s")).cache_salt == "s"
        assert registry.admitted(_spec("")).cache_salt == ""
    _run(run)


def test_one_executor_refusing_undoes_the_load_everywhere():
    async def run():
        registry, (e0, e1), load = await _loading("e0", "e1")
        _answer(registry, e0)
        _answer(registry, e1, {"rt": "LoRA adapter rt: /a/rt is not a directory"})
        await _settle()
        assert _answer(registry, e0) == [("rt", False)]  # undone where it took
        assert e1.lora_ops == []
        with pytest.raises(InvalidRequest) as err:
            await load
        assert err.value.message == ("LoRA adapter 'rt' could not be loaded: executor e1: "
                                     "LoRA adapter rt: /a/rt is not a directory")
        assert registry.loaded == {} and registry.names == ("sql",)
        assert not registry.ready(e0, "rt")
    _run(run)


def test_executors_lost_while_loading():
    async def run():
        registry, (e0, e1), load = await _loading("e0", "e1")
        _answer(registry, e0)
        e1.healthy = False
        registry.executor_lost(e1)  # the one left answered: the load is done
        await load
        assert registry.names == ("sql", "rt")
        registry.unload("rt")
        _answer(registry, e0)
        load = asyncio.ensure_future(registry.load("rt2", "/a/rt2"))
        await _settle()
        e0.healthy = False
        registry.executor_lost(e0)
        with pytest.raises(Unavailable, match="every executor left while loading it"):
            await load
        assert registry.loaded == {}
        with pytest.raises(Unavailable, match="no executor is up"):
            await registry.load("rt3", "/a")
    _run(run)


def test_an_unload_waits_for_the_adapters_requests():
    async def run():
        registry, engine = _registry("e0")
        (e0,) = engine.executors.values()
        await _loaded(registry, e0)
        engine.live["r1"] = SimpleNamespace(spec=_spec("rt"))
        assert registry.unload("rt") == 1
        assert registry.names == ("sql",) and e0.lora_ops == []
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'rt'"):
            registry.admitted(_spec("rt"))
        with pytest.raises(NotFound, match="cannot be found"):
            registry.unload("rt")
        with pytest.raises(InvalidRequest, match="is being unloaded"):
            await registry.load("rt", "/a/rt")  # its request still runs
        del engine.live["r1"]
        registry.request_ended("rt")
        assert [(o.name, o.load) for o in e0.lora_ops] == [("rt", False)]
        again = asyncio.ensure_future(registry.load("rt", "/b/rt"))  # waits for the unload
        await _settle()
        assert [(o.name, o.load) for o in e0.lora_ops] == [("rt", False)]
        assert _answer(registry, e0) == [("rt", False)]
        await _settle()
        assert _answer(registry, e0) == [("rt", True)]
        await again
        assert registry.admitted(_spec("rt")).cache_salt == "\x00gen:2"
    _run(run)


def test_a_joiner_loads_the_adapters_before_it_runs_their_requests():
    async def run():
        registry, engine = _registry("e0")
        (e0,) = engine.executors.values()
        await _loaded(registry, e0)
        e1 = engine.executors["e1"] = _handle("e1")
        registry.executor_joined(e1)
        assert [(o.name, o.load, o.path) for o in e1.lora_ops] == [("rt", True, "/a/rt")]
        assert not registry.ready(e1, "rt") and registry.ready(e1, "sql")
        _answer(registry, e1, {"rt": "its path is not mounted here"})
        assert not registry.ready(e1, "rt") and registry.names == ("sql", "rt")
        e2 = engine.executors["e2"] = _handle("e2")
        registry.executor_joined(e2)
        _answer(registry, e2)
        assert registry.ready(e2, "rt")
    _run(run)


def test_names_slots_and_the_switch():
    async def run():
        registry, engine = _registry("e0", max_loras=2)
        (e0,) = engine.executors.values()
        for name, message in (("", "lora_name: must be"), ("a,b", "lora_name: must be"),
                              ("sql", "'sql' has already been loaded")):
            with pytest.raises(InvalidRequest, match=message):
                await registry.load(name, "/a")
        with pytest.raises(InvalidRequest, match="lora_path"):
            await registry.load("rt", "")
        with pytest.raises(InvalidRequest, match="was given with --lora-modules"):
            registry.unload("sql")
        load = asyncio.ensure_future(registry.load("rt", "/a/rt"))
        await _settle()
        with pytest.raises(InvalidRequest, match="is still loading"):
            registry.unload("rt")
        with pytest.raises(InvalidRequest, match="all 2 LoRA adapter slots are in use"):
            await registry.load("rt2", "/a")
        _answer(registry, e0)
        await load
        off, _ = _registry("e0", max_loras=0)
        with pytest.raises(NotFound, match="start the router and the executors with "
                                           "--max-loras N"):
            await off.load("rt", "/a")
    _run(run)


def test_a_spec_keeps_its_fields_when_salted():
    registry, _ = _registry()
    registry.loaded["rt"] = LoadedAdapter("rt", "/a", 7, state="live")
    spec = _spec("rt", "salt")
    assert registry.admitted(spec) == dataclasses.replace(spec, cache_salt="salt\x00gen:7")


def _lora_dir(tmp_path, *names):
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    return str(tmp_path)


def test_on_demand_loads_once_and_evicts_the_least_recently_used(tmp_path):
    """--lora-dir: a request's unknown adapter found there is loaded (two requests at once:
    one load); a full set unloads the least recently used idle adapter first; when every
    slot runs requests the load waits for one to end; names outside the folder are not."""
    async def run():
        registry, engine = _registry("e0", max_loras=3)
        registry.lora_dir = _lora_dir(tmp_path, "a", "b", "c")
        (e0,) = engine.executors.values()
        assert not await registry.resolve("nope") and not await registry.resolve("../a")
        first = [asyncio.ensure_future(registry.resolve("a")) for _ in range(2)]
        await _settle()
        assert _answer(registry, e0) == [("a", True)]  # one load for both
        assert await asyncio.gather(*first) == [True, True]
        await _loaded(registry, e0, name="b", path="/x/b")
        registry.admitted(_spec("b"))
        registry.admitted(_spec("a"))  # a used after b: b is the least recently used
        third = asyncio.ensure_future(registry.resolve("c"))
        await _settle()
        assert _answer(registry, e0) == [("b", False)]  # the slot freed first
        await _settle()
        assert [(o.name, o.load, o.path) for o in e0.lora_ops] == [
            ("c", True, str(tmp_path / "c"))]
        _answer(registry, e0)
        assert await third and registry.names == ("sql", "a", "c")
        engine.live.update(ra=SimpleNamespace(spec=_spec("a")),
                           rc=SimpleNamespace(spec=_spec("c")))
        waits = asyncio.ensure_future(registry.resolve("b"))  # every slot runs requests
        await _settle()
        assert not waits.done() and e0.lora_ops == []
        del engine.live["ra"]
        registry.request_ended("a")  # a's last request: a is idle, so it goes for b
        await _settle()
        assert _answer(registry, e0) == [("a", False)]
        await _settle()
        assert _answer(registry, e0) == [("b", True)]
        assert await waits and registry.names == ("sql", "c", "b")
        assert await registry.resolve("sql") and await registry.resolve("c")  # served
        full, _ = _registry("e0", max_loras=1)  # the one slot is --lora-modules'
        full.lora_dir = registry.lora_dir
        with pytest.raises(InvalidRequest, match="every slot of --max-loras 1 holds a "
                                                 "--lora-modules adapter"):
            await full.resolve("a")
    _run(run)


def test_an_on_demand_load_waits_for_an_unload_under_way(tmp_path):
    """Every slot taken, one of them being unloaded (its executors' answer not back yet),
    no request running anywhere: the on-demand load goes on once that unload is done (no
    request end to wait for)."""
    async def run():
        registry, engine = _registry("e0", max_loras=2)
        registry.lora_dir = _lora_dir(tmp_path, "a", "b")
        (e0,) = engine.executors.values()
        await _loaded(registry, e0, name="x", path="/x")
        engine.live["r"] = SimpleNamespace(spec=_spec("x"))
        registry.unload("x")  # held by r
        waits = asyncio.ensure_future(registry.resolve("a"))
        await _settle()
        assert not waits.done() and e0.lora_ops == []
        del engine.live["r"]
        registry.request_ended("x")  # the unload goes out; a waits for its answer
        await _settle()
        assert _answer(registry, e0) == [("x", False)]
        await _settle()
        assert _answer(registry, e0) == [("a", True)]
        assert await waits and registry.names == ("sql", "a")
    _run(run)
