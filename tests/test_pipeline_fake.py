"""Pipelined steps through a real router and wire fake executors (no model work): late EOS
with plans in flight, cancellation with two plans held, and an executor that keeps
heartbeating but never answers (a hung kernel) being declared dead. The fakes check every
plan against the protocol (marked decodes included) and record violations."""

from __future__ import annotations

import time

import grpc
import pytest
from cluster_harness import request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from wire_fake_executor import fake_cluster

from pagedserve.tinymodels import build_model

EOS_AT = 5  # the fakes sample EOS at output position 5 (unless ignore_eos)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama", num_kv_heads=2)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    c, controls = fake_cluster(
        model_dir, tmp_path_factory.mktemp("fake"), 2,
        # 3 s: test_cancel_with_two_plans_held holds a plan while it polls for it, which
        # took over 1 s once on a loaded 2-core machine (the executor declared dead and
        # the request moved); still well inside test_zz's 30 s.
        router_args=["--step-timeout", "3", "--routing", "round-robin"],
        num_gpu_blocks=64, num_cpu_blocks=0, step_delay_s=0.002, eos_at=EOS_AT)
    c.controls = controls
    with c.running():
        yield c


def _no_violations(cluster) -> None:
    for name, control in cluster.controls.items():
        assert control.state().get("violations", []) == [], (name, cluster.logs())


def _eos(cluster) -> int:
    return cluster.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10).eos_token_ids[0]


def test_late_eos_ends_the_stream_exactly_and_frees_every_block(cluster):
    """The EOS sampled at position 5 reaches the router after plan N+1 (decoding the
    request again) left: the stream ends at the EOS, nothing after it is streamed or
    counted, and every block is free once the last plan is answered."""
    eos = _eos(cluster)
    prompts = [list(range(3 + i, 40 + i)) for i in range(6)]
    chunks = [list(cluster.stub.Stream(request(token_ids=p, max_tokens=30, temperature=0.0),
                                       timeout=60)) for p in prompts]
    for stream in chunks:
        tokens = [t for c in stream for t in c.token_ids]
        assert len(tokens) == EOS_AT + 1 and tokens[-1] == eos
        assert stream[-1].finish_reason == pb.STOP and stream[-1].stop_token_id == eos
        assert stream[-1].usage.completion_tokens == EOS_AT + 1
    status = cluster.wait_blocks_free()
    assert all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in status.executors)
    _no_violations(cluster)


def test_cancel_with_two_plans_held(cluster):
    for control in cluster.controls.values():
        control.pause()
    stream = cluster.stub.Stream(request(token_ids=list(range(10, 60)), max_tokens=40,
                                         temperature=0.0, ignore_eos=True), timeout=60)
    try:
        deadline = time.monotonic() + 20
        found = None
        while found is None:  # whichever executor routing chose (a plan that only drops
            assert time.monotonic() < deadline, cluster.logs()  # ended requests may be
            for c in cluster.controls.values():  # held before it)
                plans = c.unanswered()
                k = next((k for k, p in enumerate(plans) if p["request_ids"]), None)
                if k is not None:
                    found = (c, k, plans[k]["request_ids"][0])
            time.sleep(0.01)
        control, k, rid = found
        control.allow(k + 1)  # up to the prefill's result: the router sends two more plans
        held = control.wait_unanswered(2)
        # N+1 decodes its pending token
        assert [p["marked_ids"] for p in held][-1] == [rid], (held, cluster.logs())
        stream.cancel()
    finally:
        for c in cluster.controls.values():
            c.resume()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    status = cluster.wait_blocks_free()
    assert all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in status.executors)
    _no_violations(cluster)


def test_zz_executor_that_heartbeats_but_never_answers_is_dead(cluster):
    """f0 stops answering (as a stuck GPU kernel looks) with two plans in flight while its
    heartbeats go on: past the plan's deadline (--step-timeout 3 plus the plan's work) the
    router counts it dead and its request finishes on f1."""
    eos = _eos(cluster)
    cluster.controls["f0"].hang()
    t0 = time.monotonic()
    outs = [cluster.stub.Generate.future(request(token_ids=list(range(20 + i, 50 + i)),
                                                 max_tokens=12, temperature=0.0), timeout=60)
            for i in range(4)]
    results = [o.result() for o in outs]
    for r in results:
        tokens = list(r.completions[0].token_ids)
        assert len(tokens) == EOS_AT + 1 and tokens[-1] == eos
    waited = time.monotonic() - t0
    healthy = {e.id: e.healthy for e in cluster.status().executors}
    assert healthy == {"f0": False, "f1": True}, cluster.logs()
    assert "unanswered" in cluster.logs()
    assert waited < 30, waited
    cluster.controls["f0"].resume()
