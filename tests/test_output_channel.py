"""OutputChannel (router/sequence.py): what an edge in the router process reads. Deltas wait
per sample and come out merged, samples in index order, when the consumer falls behind; the
final output carries what was still waiting."""

from __future__ import annotations

import asyncio

import pytest
from pagedserve.router.sequence import OutputChannel
from pagedserve.router.types import CompletionDelta, TokenLogprob, Usage


def _drain(ch: OutputChannel):
    async def main():
        return [out async for out in ch.stream("r")]
    return asyncio.run(main())


def test_one_sample_behind_gets_one_merged_delta_per_read():
    ch = OutputChannel()
    lp = TokenLogprob(7, -0.5, ())
    ch.put(CompletionDelta(0, "a", (5,)))
    ch.put(CompletionDelta(0, "b", (6,)))
    ch.put(CompletionDelta(0, "", (7,), (lp,), finish_reason="stop", stop_token_id=7))
    ch.finish(Usage(3, 3))
    (out,) = _drain(ch)
    assert out.usage == Usage(3, 3)
    assert out.deltas == (CompletionDelta(0, "ab", (5, 6, 7), (lp,), "stop", None, 7),)


def test_samples_come_out_in_index_order_each_merged():
    ch = OutputChannel()
    ch.put(CompletionDelta(1, "x", (1,)))
    ch.put(CompletionDelta(0, "y", (2,)))
    ch.put(CompletionDelta(1, "z", (3,)))
    ch.finish(Usage(1, 3))
    (out,) = _drain(ch)
    assert [(d.index, d.text, d.token_ids) for d in out.deltas] == [(0, "y", (2,)),
                                                                    (1, "xz", (1, 3))]


def test_a_reader_keeping_up_gets_each_delta_as_it_is_put():
    async def main():
        ch = OutputChannel()
        reader = ch.stream("r").__aiter__()
        d0, d1 = CompletionDelta(0, "a", (5,)), CompletionDelta(0, "b", (6,))
        ch.put(d0)
        (got,) = (await reader.__anext__()).deltas
        assert got is d0  # passed on as it is, nothing merged
        ch.put(d1)
        assert (await reader.__anext__()).deltas == (d1,)
        ch.finish(Usage(1, 2))
        last = await reader.__anext__()
        assert last.deltas == () and last.usage == Usage(1, 2)
        with pytest.raises(StopAsyncIteration):
            await reader.__anext__()
    asyncio.run(main())


def test_a_failure_after_waiting_deltas_delivers_them_then_raises():
    async def main():
        ch = OutputChannel()
        ch.put(CompletionDelta(0, "a", (5,)))
        ch.fail(RuntimeError("executor lost"))
        reader = ch.stream("r").__aiter__()
        assert (await reader.__anext__()).deltas == (CompletionDelta(0, "a", (5,)),)
        with pytest.raises(RuntimeError, match="executor lost"):
            await reader.__anext__()
    asyncio.run(main())
