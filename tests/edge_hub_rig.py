"""The API workers' hub test rig (tests/test_edge_hub.py): a fake router core (what the hub
needs of RouterEngine), a tokenizer whose tokens are known strings, and a hub with two
connected RemoteEngines over the real ipc socket."""

from __future__ import annotations

import asyncio
import dataclasses

from pagedserve.router.edge_hub import EdgeHub
from pagedserve.router.edge_wire import Outputs
from pagedserve.router.errors import AlreadyExists
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.remote_engine import RemoteEngine
from pagedserve.router.types import (
    ClusterStatusData,
    CompletionDelta,
    ExecutorStatusData,
    ModelInfoData,
    RequestSpec,
    SamplingSpec,
    Usage,
)
from prometheus_client import CollectorRegistry

INFO = ModelInfoData(model="m", architecture="LlamaForCausalLM", max_model_len=64,
                     vocab_size=100, block_size=16, dtype="bfloat16", eos_token_ids=(0,))
PIECES = ["<eos>", "he", "llo", "x", "y", " wor", "ld", "ST", "OP", "z"]


class PieceTokenizer:
    """Token i is the string PIECES[i] (exact text and stop-string expectations)."""

    special_token_ids = frozenset({0})
    eos_token_ids = (0,)

    def is_special(self, t):
        return t in self.special_token_ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(PIECES[i] for i in ids)

    def token_text(self, t):
        return self.decode([t])


def ids(*pieces):
    return tuple(PIECES.index(p) for p in pieces)
STATUS = ClusterStatusData((ExecutorStatusData("e0", "cpu", True, 10, 7, 4, 4, 1, 2, 0),), 30, 12)


class FakeCore:
    """What the hub needs of RouterEngine: admit, abort, status, serving, draining, info."""

    def __init__(self) -> None:
        self.live: dict[str, object] = {}
        self.draining = False
        self.up = True
        self.dtype = "bfloat16"
        self.refuse: Exception | None = None
        self.stopped: list[tuple[str, int]] = []

    def admit(self, spec, reserved=False, channel=None, text=True):
        assert text is False  # the worker assembles the text
        if self.refuse is not None:
            raise self.refuse
        if spec.request_id in self.live:
            raise AlreadyExists(f"request {spec.request_id!r} is already running")
        self.live[spec.request_id] = channel

    def abort(self, request_id: str) -> bool:
        channel = self.live.pop(request_id, None)
        if channel is None:
            return False
        channel.put(CompletionDelta(0, finish_reason="abort"))
        channel.finish(Usage(3, 0))
        return True

    def finish_sample(self, request_id: str, index: int) -> bool:
        self.stopped.append((request_id, index))
        return request_id in self.live

    def cluster_status(self):
        return STATUS

    def is_serving(self) -> bool:
        return self.up and not self.draining

    def model_info(self):
        return dataclasses.replace(INFO, dtype=self.dtype)


def spec(request_id: str, **sampling) -> RequestSpec:
    return RequestSpec(request_id, (5, 6, 7), SamplingSpec(**sampling))


async def settle(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


class Rig:
    """A hub on a FakeCore and two connected RemoteEngines (workers 0 and 1)."""

    async def __aenter__(self) -> Rig:
        self.core = FakeCore()
        self.metrics = RouterMetrics(registry=CollectorRegistry())
        self.hub = EdgeHub(self.core, self.metrics)
        self.hub.start()
        self.sent: list[tuple[int, object]] = []
        send = self.hub._send

        def spy(conn, msg, **kwargs):
            self.sent.append((conn.index, msg))
            send(conn, msg, **kwargs)
        self.hub._send = spy
        self.workers = [RemoteEngine(self.hub.address, i, INFO, PieceTokenizer())
                        for i in range(2)]
        for i, w in enumerate(self.workers):
            w.start(grpc_port=50000, http_port=-1 if i else 8000, pid=1000 + i)
        for w in self.workers:
            await asyncio.wait_for(w.connected.wait(), 5)
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self.workers:
            w.close()
        await self.hub.close()

    def outputs_to(self, index: int) -> list[Outputs]:
        return [m for i, m in self.sent if i == index and isinstance(m, Outputs)]


async def collect(stream) -> list:
    return [out async for out in stream]
