"""The router core's hub and two API workers' RemoteEngines in one event loop, over the real
ipc socket, with a fake core engine: outputs of a loop turn leave as one message per worker,
admission errors keep their class and message, aborts (local, from another worker, unknown),
status pushes, the metrics relay, a lost worker's requests aborted, malformed frames, one
store of Responses for every worker (the rig: edge_hub_rig.py)."""

from __future__ import annotations

import asyncio

import grpc
import msgspec
import pytest
import zmq
from edge_hub_rig import INFO, STATUS, PieceTokenizer, Rig, collect, ids, settle, spec
from pagedserve.router.edge_wire import Forget, MetricsBatch, StopSample
from pagedserve.router.errors import (
    AlreadyExists,
    InvalidRequest,
    NotFound,
    QueueFull,
    Unavailable,
)
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.remote_engine import MetricsRelay, RemoteEngine, RemoteResponses
from pagedserve.router.response_store import ResponseStore
from pagedserve.router.types import (
    CompletionDelta,
    Usage,
)


def test_one_outputs_message_per_worker_per_turn_and_streams_in_order():
    async def main():
        async with Rig() as rig:
            w0, w1 = rig.workers
            a, b = await w0.submit(spec("a", max_tokens=2)), await w0.submit(spec("b"))
            c = await w1.submit(spec("c"))
            assert sorted(rig.core.live) == ["a", "b", "c"]
            assert rig.hub.workers[0].requests == {"a", "b"}
            ch = rig.core.live
            # one loop turn of the core's text stage: deltas for three requests
            ch["a"].put(CompletionDelta(0, "", ids("he")))  # the core sends no text
            ch["b"].put(CompletionDelta(0, "", ids("x")))
            ch["a"].put(CompletionDelta(0, "", ids("llo"), finish_reason="length"))
            ch["a"].finish(Usage(3, 2))
            ch["c"].put(CompletionDelta(0, "", ids("y")))
            await settle(lambda: rig.outputs_to(0) and rig.outputs_to(1))
            assert len(rig.outputs_to(0)) == 1 and len(rig.outputs_to(1)) == 1
            assert [it.request_id for it in rig.outputs_to(0)[0].items] == ["a", "b"]
            outs = await asyncio.wait_for(collect(a), 5)
            assert len(outs) == 1 and outs[0].usage == Usage(3, 2)
            (delta,) = outs[0].deltas  # merged by the worker's channel
            assert (delta.text, delta.token_ids, delta.finish_reason) == (
                "hello", ids("he", "llo"), "length")
            assert rig.hub.workers[0].requests == {"b"}
            assert w0.num_streams == 1 and w1.num_streams == 1
            ch["b"].finish(Usage(3, 1))
            ch["c"].fail(Unavailable("the executor died"))
            assert (await asyncio.wait_for(collect(b), 5))[-1].usage == Usage(3, 1)
            with pytest.raises(Unavailable, match="the executor died"):
                await asyncio.wait_for(collect(c), 5)
            assert w0.num_streams == 0 and w1.num_streams == 0
            assert rig.hub.workers[1].requests == set()
    asyncio.run(main())


def test_steady_tokens_go_as_columns_and_every_sample_stays_in_order():
    async def main():
        async with Rig() as rig:
            w0 = rig.workers[0]
            a = await w0.submit(spec("a", n=2, max_tokens=3))
            b = await w0.submit(spec("b", max_tokens=2))
            ch = rig.core.live
            # one loop turn: a#0 and b#0 as columns; then an item for a (a delta with
            # logprobs, say): a#1's later steady token follows it into the item
            ch["a"].push_token(0, ids("he")[0])
            ch["b"].push_token(0, ids("x")[0])
            ch["a"].put(CompletionDelta(1, "", ids("z")))
            ch["a"].push_token(1, ids("y")[0])
            ch["a"].push_token(0, ids("llo")[0])
            await settle(lambda: rig.outputs_to(0))
            (msg,) = rig.outputs_to(0)
            assert (msg.token_request_ids, msg.token_indexes, msg.token_ids) == (
                ["a", "b"], [0, 0], [*ids("he"), *ids("x")])
            (item,) = msg.items
            assert [(d.index, d.token_ids) for d in item.deltas] == [
                (1, ids("z")), (1, ids("y")), (0, ids("llo"))]
            # the next turn: columns again, and the endings
            ch["b"].push_token(0, ids("y")[0])
            ch["b"].put(CompletionDelta(0, "", (), finish_reason="length"))
            ch["b"].finish(Usage(3, 2))
            ch["a"].put(CompletionDelta(0, "", ids("x"), finish_reason="length"))
            ch["a"].put(CompletionDelta(1, "", ids("x"), finish_reason="length"))
            ch["a"].finish(Usage(3, 6))
            outs_a = await asyncio.wait_for(collect(a), 5)
            outs_b = await asyncio.wait_for(collect(b), 5)
            text = {}
            for out in outs_a + outs_b:
                for d in out.deltas:
                    key = (out.request_id, d.index)
                    text[key] = text.get(key, "") + d.text
            assert text == {("a", 0): "hellox", ("a", 1): "zyx", ("b", 0): "xy"}
            assert len(rig.outputs_to(0)) == 2
            assert rig.outputs_to(0)[1].token_request_ids == ["b"]
            assert w0.num_streams == 0 and rig.hub.workers[0].token_ids == []
    asyncio.run(main())


def test_admission_errors_keep_their_class_and_message():
    async def main():
        async with Rig() as rig:
            w0, w1 = rig.workers
            for refusal, cls in ((QueueFull("the waiting queue is full (4 requests)"), QueueFull),
                                 (InvalidRequest("needs 900 tokens"), InvalidRequest),
                                 (Unavailable("no executor is up"), Unavailable)):
                rig.core.refuse = refusal
                with pytest.raises(cls) as err:
                    await w0.submit(spec("r"))
                assert err.value.message == refusal.message
            rig.core.refuse = KeyError("bug")
            with pytest.raises(RuntimeError, match="router core: 'bug'"):
                await w0.submit(spec("r"))
            rig.core.refuse = None
            assert w0.num_streams == 0 and rig.hub.workers[0].requests == set()
            await w0.submit(spec("dup"))
            with pytest.raises(AlreadyExists):  # this worker's own: no round trip
                await w0.submit(spec("dup"))
            with pytest.raises(AlreadyExists):  # another worker's: the core says so
                await w1.submit(spec("dup"))
            assert w1.num_streams == 0
    asyncio.run(main())


def test_aborts_local_from_another_worker_and_unknown():
    async def main():
        async with Rig() as rig:
            w0, w1 = rig.workers
            gone = await w0.submit(spec("gone"))
            assert w0.abort("gone") is True  # the client left: Forget, stream dropped here
            await settle(lambda: "gone" not in rig.core.live)
            assert w0.num_streams == 0 and not w0.abort("gone")
            await gone.aclose()
            kept = await w0.submit(spec("kept"))
            assert await w1.abort_anywhere("kept") is True
            outs = await asyncio.wait_for(collect(kept), 5)
            assert outs[-1].deltas[-1].finish_reason == "abort" and outs[-1].finished
            assert await w1.abort_anywhere("kept") is False
            assert await w0.abort_anywhere("never") is False
    asyncio.run(main())


async def ended_through_the_abort_rpc(rig: Rig, request_id: str):
    """Worker 0's request, ended by the Abort RPC through worker 1: its drained stream."""
    w0, w1 = rig.workers
    stream = await w0.submit(spec(request_id))
    assert await w1.abort_anywhere(request_id) is True
    await asyncio.wait_for(collect(stream), 5)
    return stream


def test_a_late_forget_or_stop_never_touches_a_new_request_under_the_same_id():
    """Worker 0's request "x" is aborted through worker 1, which then submits a new "x";
    worker 0's Forget and StopSample for its "x", sent before it heard, arrive after: the
    new request is neither aborted nor stopped."""
    async def main():
        async with Rig() as rig:
            w0, w1 = rig.workers
            await ended_through_the_abort_rpc(rig, "x")
            new = await w1.submit(spec("x"))
            w0.send(StopSample("x", 0))
            w0.send(Forget("x"))
            await asyncio.sleep(0.1)
            assert "x" in rig.core.live and rig.core.stopped == []
            rig.core.live["x"].finish(Usage(3, 0))
            assert (await asyncio.wait_for(collect(new), 5))[-1].finished
    asyncio.run(main())


def test_a_worker_edge_leaving_an_ended_request_never_aborts_its_successor():
    """On one worker: "x" ended by the Abort RPC, a new "x" submitted there; the old
    session's abort (by its stream) leaves the new one alone; the new one's own aborts it."""
    async def main():
        async with Rig() as rig:
            w0 = rig.workers[0]
            old = await ended_through_the_abort_rpc(rig, "x")
            new = await w0.submit(spec("x"))
            assert w0.abort_stream("x", old) is False
            await asyncio.sleep(0.1)
            assert "x" in rig.core.live
            assert w0.abort_stream("x", new) is True
            await settle(lambda: "x" not in rig.core.live)
    asyncio.run(main())


def test_status_pushes_and_cluster_status():
    async def main():
        async with Rig() as rig:
            w0, w1 = rig.workers
            assert w0.is_serving() and w0.model_info() == INFO
            assert await w1.cluster_status() == STATUS
            rig.core.dtype = "float32"  # a CPU executor registered what it runs
            await settle(lambda: w0.model_info().dtype == "float32")
            assert w0.model_info().vocab_size == INFO.vocab_size
            rig.core.draining = True
            rig.hub.push_status()
            await settle(lambda: w1.status.draining and not w1.is_serving())
    asyncio.run(main())


def test_metrics_relay_replays_known_calls_only():
    async def main():
        async with Rig() as rig:
            relay = MetricsRelay(rig.workers[0])
            relay.observe_ttft(0.25)
            relay.inc_success("stop", api="http")
            relay.inc_failure(grpc.StatusCode.CANCELLED, api="grpc")
            relay.observe_inter_token(0.01)
            rig.workers[1].send(MetricsBatch([("set_executor_gauges", ["e0"], ""),
                                              ("observe_e2e", ["not a number"], ""),
                                              ("observe_e2e", [1.5], "")]))
            relay.flush()
            value = rig.metrics.registry.get_sample_value
            await settle(lambda: value("pagedserve_e2e_request_latency_seconds_count") == 1
                         and value("pagedserve_inter_token_latency_seconds_count") == 1)
            assert value("pagedserve_e2e_request_latency_seconds_sum") == 1.5
            assert value("pagedserve_time_to_first_token_seconds_sum") == 0.25
            assert value("pagedserve_request_success_total",
                         {"finish_reason": "stop", "api": "http"}) == 1
            assert value("pagedserve_request_failure_total",
                         {"code": "CANCELLED", "api": "grpc"}) == 1
            assert value("pagedserve_requests_running", {"executor": "e0"}) is None  # refused


def test_a_lost_worker_aborts_its_requests_only():
    async def main():
        async with Rig() as rig:
            w0, w1 = rig.workers
            await w0.submit(spec("a"))
            await w0.submit(spec("b"))
            await w1.submit(spec("c"))
            assert rig.hub.worker_lost(0) == 2
            assert list(rig.core.live) == ["c"]
            assert rig.hub.workers[0].routing_id == b""
    asyncio.run(main())


def test_malformed_frames_are_dropped():
    async def main():
        async with Rig() as rig:
            ctx = zmq.Context.instance()
            rogue = ctx.socket(zmq.DEALER)
            rogue.connect(rig.hub.address)
            rogue.send(b"\xc1 not msgpack")
            rogue.send_multipart([b"a", b"b"])
            await asyncio.sleep(0.1)
            rogue.close(0)
            stream = await rig.workers[0].submit(spec("ok"))  # the hub still answers
            rig.core.live["ok"].finish(Usage(3, 0))
            assert (await asyncio.wait_for(collect(stream), 5))[-1].finished
    asyncio.run(main())


def test_a_stop_string_is_found_by_the_worker_and_ends_the_sample_in_the_core():
    """The core sends tokens only; the worker's text hits "STOP" mid-delta: the sample ends
    there (text cut, the stopping token kept), the core is told, tokens the core sampled
    meanwhile are dropped, and usage counts what the client got. The other sample goes on."""
    async def main():
        async with Rig() as rig:
            w0 = rig.workers[0]
            stream = await w0.submit(spec("s", n=2, stop=("STOP",)))
            ch = rig.core.live["s"]
            ch.put(CompletionDelta(0, "", ids("he", "ST", "OP", "x")))
            ch.put(CompletionDelta(1, "", ids(" wor", "ST")))  # held: may start "STOP"
            await settle(lambda: rig.core.stopped == [("s", 0)])
            ch.put(CompletionDelta(0, "", ids("y")))  # sampled before the core knew
            ch.put(CompletionDelta(1, "", ids("z"), finish_reason="length"))
            ch.finish(Usage(3, 7))
            outs = await asyncio.wait_for(collect(stream), 5)
            by_index: dict[int, list] = {0: [], 1: []}
            for out in outs:
                for d in out.deltas:
                    by_index[d.index].append(d)
            s0, s1 = by_index[0], by_index[1]
            assert "".join(d.text for d in s0) == "he"
            assert sum((d.token_ids for d in s0), ()) == ids("he", "ST", "OP")
            assert (s0[-1].finish_reason, s0[-1].stop_string) == ("stop", "STOP")
            assert "".join(d.text for d in s1) == " worSTz"
            assert s1[-1].finish_reason == "length"
            assert outs[-1].usage == Usage(3, 3 + 3)
            assert rig.core.stopped == [("s", 0)]
    asyncio.run(main())


def test_a_request_before_the_hello_waits_for_it():
    """The worker's servers listen a moment before its hello is answered; a request in that
    moment waits instead of going to a core that would ignore it."""
    async def main():
        async with Rig() as rig:
            late = RemoteEngine(rig.hub.address, 7, INFO, PieceTokenizer())
            try:
                submit = asyncio.ensure_future(late.submit(spec("early")))
                relay = MetricsRelay(late)
                relay.observe_ttft(0.5)
                await asyncio.sleep(0.1)
                assert not submit.done() and "early" not in rig.core.live
                late.start(grpc_port=50000, http_port=-1, pid=1007)
                stream = await asyncio.wait_for(submit, 5)
                rig.core.live["early"].finish(Usage(3, 0))
                assert (await asyncio.wait_for(collect(stream), 5))[-1].finished
                value = rig.metrics.registry.get_sample_value
                await settle(lambda: value("pagedserve_time_to_first_token_seconds_count") == 1)
            finally:
                late.close()
    asyncio.run(main())


def test_observe_many_counts_as_one_observe_per_value():
    """An API worker's histogram values arrive in bulk (`observe_many`): every bucket, the
    count and the sum equal observing them one by one, values on bucket bounds included."""
    from pagedserve.router.metrics import LATENCY_BUCKETS_S

    values = [0.0, 0.0001, 0.00010001, 0.003, 0.0042, 10.0, 11.0, 0.05, 0.05, 2e-6]
    bulk, single = RouterMetrics(), RouterMetrics()
    bulk.observe_many("observe_inter_token", *values)
    for v in values:
        single.observe_inter_token(v)
    name = "pagedserve_inter_token_latency_seconds"
    for le in (*LATENCY_BUCKETS_S, float("inf")):
        label = {"le": "+Inf" if le == float("inf") else str(le)}
        got = bulk.registry.get_sample_value(f"{name}_bucket", label)
        assert got == single.registry.get_sample_value(f"{name}_bucket", label), le
    assert bulk.registry.get_sample_value(f"{name}_bucket", {"le": "0.0001"}) == 3
    assert bulk.registry.get_sample_value(f"{name}_count") == len(values)
    assert bulk.registry.get_sample_value(f"{name}_sum") == pytest.approx(sum(values))
    with pytest.raises(ValueError, match="not an edge histogram"):
        bulk.observe_many("set_executor_gauges", 1.0)


def _record(status: str) -> bytes:
    return msgspec.json.encode({"response": {"status": status, "error": None},
                                "input_items": []})


def test_stored_responses_are_one_store_for_every_worker():
    """A response stored through worker 0 is read, streamed, cancelled (its request
    aborted in the core) and deleted through worker 1; errors keep their class; a lost
    worker's running background responses fail."""
    async def main():
        async with Rig() as rig:
            rig.hub.responses = store = ResponseStore(1 << 20, abort=rig.core.abort)
            r0, r1 = (RemoteResponses(w, enabled=True) for w in rig.workers)
            await rig.workers[0].submit(spec("resp_a-0"))
            assert await r0.put("resp_a", _record("queued"), background=True,
                                request_ids=("resp_a-0",))
            assert await r1.get("resp_a") == _record("queued")
            assert await r1.get("resp_b") is None
            waiting = asyncio.ensure_future(r1.events("resp_a", -1, 5.0))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # nothing yet: it waits
            await r0.add_events("resp_a", [b"e0", b"e1"])
            assert await asyncio.wait_for(waiting, 5) == ([b"e0", b"e1"], False)
            assert await r1.events("resp_a", 0, 0) == ([b"e1"], False)
            cancelled = await r1.cancel("resp_a")
            assert msgspec.json.decode(cancelled)["response"]["status"] == "cancelled"
            assert "resp_a-0" not in rig.core.live  # aborted in the core
            assert not await r0.put("resp_a", _record("completed"), update=True)
            assert await r1.events("resp_a", 1, 5.0) == ([], True)  # over, at once
            with pytest.raises(NotFound):
                await r1.cancel("resp_b")
            assert await r0.put("resp_c", _record("completed"))
            with pytest.raises(InvalidRequest):
                await r1.cancel("resp_c")  # not a background one
            assert await r1.delete("resp_c") and not await r1.delete("resp_c")
            assert not await r1.put("resp_c", _record("in_progress"), update=True)
            assert await r0.put("resp_d", _record("in_progress"), background=True)
            assert await r1.put("resp_e", _record("in_progress"), background=True)
            rig.hub.worker_lost(0)
            failed = msgspec.json.decode(await store.get("resp_d"))["response"]
            assert failed["status"] == "failed" and "API worker" in failed["error"]["message"]
            assert msgspec.json.decode(await store.get("resp_e"))["response"]["status"] == \
                "in_progress"
    asyncio.run(main())
