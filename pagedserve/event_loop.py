"""The serving processes' event loop: uvloop's when it is installed.

The router process (its engine, and the gRPC and HTTP edges when it serves them) and the API
workers run everything on one asyncio loop, so the loop's own cost per callback, future and
socket event is paid for every stream write and every step. uvloop (libuv) does that part in
C. On the CPU machine (benchmarks/step_overhead.py, fake executor) the router's CPU outside
its own phases ("loop other": gRPC aio, the sockets, asyncio) fell 7-10% and its CPU a
step 2-5%; the API workers' CPU a step 14% in the first two runs, inconsistent in two later
ones (benchmarks/README.md, "uvloop"). `PAGEDSERVE_UVLOOP=0` keeps asyncio's own loop;
without uvloop installed (it is a Linux/macOS dependency) that one is used anyway.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory():
    """uvloop's `new_event_loop`, or None (asyncio's default) when it is off or missing."""
    if os.environ.get("PAGEDSERVE_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the serving event loop (module docstring; Python 3.10, which
    has no `asyncio.Runner`, keeps asyncio's)."""
    factory = loop_factory()
    if factory is None or sys.version_info < (3, 11):
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
