"""The serving processes' event loop (pagedserve/event_loop.py)."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve import event_loop


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_serving_runs_on_uvloop_when_installed():
    pytest.importorskip("uvloop")
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_pagedserve_uvloop_0_keeps_asyncios_loop(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_UVLOOP", "0")
    assert event_loop.loop_factory() is None
    assert event_loop.run(_loop_module()).startswith("asyncio")


def test_run_returns_the_result_and_raises_the_error():
    async def fails():
        raise ValueError("boom")

    assert event_loop.run(asyncio.sleep(0, result=7)) == 7
    with pytest.raises(ValueError, match="boom"):
        event_loop.run(fails())
