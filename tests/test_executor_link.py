"""The router's ExecutorLink on its own: receiving on the event loop's reader.

The link's socket is a plain ZeroMQ socket whose descriptor the event loop watches. ZeroMQ's
descriptor is edge-triggered, and a send on the socket can take the signal for messages that
arrived meanwhile: a link that missed either would stall with messages waiting. These tests
push bursts much larger than one drain turn while the link answers every message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq
from pagedserve.protos import wire
from pagedserve.protos.codec import Codec
from pagedserve.router.executor_link import ExecutorLink
from pagedserve.router.zmq_reader import DRAIN_BATCH


def _link(seen: list, errors: list | None = None) -> ExecutorLink:
    return ExecutorLink(
        "tcp://127.0.0.1:0",
        on_hello=lambda rid, hello: wire.Welcome(executor_id=hello.executor_id, accepted=True),
        on_heartbeat=lambda eid: seen.append(eid) or True,
        on_result=lambda eid, result: True,
        on_error=lambda eid, report: (errors if errors is not None else []).append(
            report.message) or True,
    )


@contextlib.asynccontextmanager
async def _linked(num_dealers: int, seen: list, errors: list | None = None):
    """A started link and DEALER sockets connected to it (executors without a model)."""
    link = _link(seen, errors)
    link.start()
    ctx = zmq.Context()
    dealers = [ctx.socket(zmq.DEALER) for _ in range(num_dealers)]
    try:
        for dealer in dealers:
            dealer.connect(link.endpoint)
        yield dealers
    finally:
        for dealer in dealers:
            dealer.close(0)
        ctx.term()
        await link.close()


async def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("rounds", [1, 5])
def test_bursts_are_all_received_and_echoed(rounds):
    count = 10 * DRAIN_BATCH + 3

    async def main() -> None:
        seen: list[str] = []
        codec = Codec()
        async with _linked(2, seen) as dealers:
            expected = 0
            for r in range(rounds):
                for i in range(count):  # two executors interleaved, no waiting
                    for d, dealer in enumerate(dealers):
                        beat = wire.Heartbeat(executor_id=f"e{d}-{r}-{i}", time_s=0.0)
                        dealer.send_multipart(codec.encode(beat))
                expected += 2 * count
                await _wait_for(lambda n=expected: len(seen) >= n)
                assert len(seen) == expected
            # every heartbeat was echoed on the socket it came from, in order
            for d, dealer in enumerate(dealers):
                echoed = []
                while dealer.poll(2000):
                    echoed.append(codec.decode(dealer.recv_multipart()).executor_id)
                    if len(echoed) == rounds * count:
                        break
                assert echoed == [f"e{d}-{r}-{i}" for r in range(rounds) for i in range(count)]

    asyncio.run(main())


def test_a_burst_the_link_does_not_answer_is_all_received():
    """Error reports get no answer, so no send wakes the link: after each turn of
    DRAIN_BATCH messages the drain must come back by itself."""
    count = 5 * DRAIN_BATCH + 1

    async def main() -> None:
        errors: list[str] = []
        codec = Codec()
        async with _linked(1, [], errors) as (dealer,):
            for i in range(count):
                dealer.send_multipart(codec.encode(wire.ErrorReport(message=f"m{i}",
                                                                    executor_id="e")))
            await _wait_for(lambda: len(errors) >= count)
            assert errors == [f"m{i}" for i in range(count)]

    asyncio.run(main())


def test_a_message_that_arrives_while_the_link_sends_is_not_left_waiting():
    """Ping-pong, one message at a time: after each echo (a send on the link's socket) the
    next heartbeat must still wake the link."""

    async def main() -> None:
        seen: list[str] = []
        codec = Codec()
        async with _linked(1, seen) as (dealer,):
            for i in range(300):
                dealer.send_multipart(codec.encode(wire.Heartbeat(executor_id=f"p{i}",
                                                                  time_s=0.0)))
                await _wait_for(lambda n=i + 1: len(seen) >= n, timeout_s=5.0)
                assert len(seen) == i + 1, f"heartbeat {i} was never received"
                while not dealer.poll(0):
                    await asyncio.sleep(0.001)
                assert codec.decode(dealer.recv_multipart()).executor_id == f"p{i}"

    asyncio.run(main())


def test_malformed_frames_are_dropped_and_the_link_keeps_receiving(caplog):
    async def main() -> None:
        seen: list[str] = []
        codec = Codec()
        async with _linked(1, seen) as (dealer,):
            dealer.send_multipart([b"\x00not msgpack"])
            dealer.send_multipart(codec.encode(wire.Heartbeat(executor_id="after",
                                                              time_s=0.0)))
            await _wait_for(lambda: seen == ["after"])
            assert seen == ["after"]

    with caplog.at_level("WARNING", logger="pagedserve.router.link"):
        asyncio.run(main())
    assert "rejected a malformed message" in caplog.text


def test_results_count_only_from_the_connection_an_executor_registered_on(caplog):
    """Two connections claim executor "x": the one whose Hello was accepted last owns its
    results, errors and goodbye; the other's are dropped (logged once)."""
    async def main() -> None:
        results, errors, goodbyes = [], [], []
        link = ExecutorLink(
            "tcp://127.0.0.1:0",
            on_hello=lambda rid, h: wire.Welcome(executor_id=h.executor_id, accepted=True),
            on_heartbeat=lambda eid: True,
            on_result=lambda eid, r: results.append((eid, r.step_id)) or True,
            on_error=lambda eid, e: errors.append((eid, e.message)) or True,
            on_goodbye=lambda eid, why: goodbyes.append((eid, why)))
        link.start()
        codec = Codec()
        ctx = zmq.Context()
        a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        hello = wire.Hello(executor_id="x", model_fingerprint="fp", device="cpu",
                           dtype="float32", block_size=16, num_gpu_blocks=8,
                           num_cpu_blocks=0, max_model_len=64)
        try:
            for sock in (a, b):
                sock.connect(link.endpoint)
            a.send_multipart(codec.encode(hello))
            await _wait_for(lambda: a.poll(0))
            assert isinstance(codec.decode(a.recv_multipart()), wire.Welcome)
            b.send_multipart(codec.encode(wire.StepResult(step_id=1, executor_id="x")))
            b.send_multipart(codec.encode(wire.ErrorReport(message="b", executor_id="x")))
            b.send_multipart(codec.encode(wire.Shutdown(reason="b", executor_id="x")))
            a.send_multipart(codec.encode(wire.StepResult(step_id=2, executor_id="x")))
            await _wait_for(lambda: results)
            await asyncio.sleep(0.05)
            assert results == [("x", 2)] and errors == [] and goodbyes == []
            b.send_multipart(codec.encode(hello))  # b registers "x" now: a's are the stale
            await _wait_for(lambda: b.poll(0))
            a.send_multipart(codec.encode(wire.StepResult(step_id=3, executor_id="x")))
            b.send_multipart(codec.encode(wire.StepResult(step_id=4, executor_id="x")))
            b.send_multipart(codec.encode(wire.Shutdown(reason="bye", executor_id="x")))
            await _wait_for(lambda: goodbyes)
            assert results == [("x", 2), ("x", 4)] and goodbyes == [("x", "bye")]
        finally:
            a.close(0)
            b.close(0)
            ctx.term()
            await link.close()

    with caplog.at_level("ERROR", logger="pagedserve.router.link"):
        asyncio.run(main())
    assert caplog.text.count("came from a connection other than") == 1
