"""The routing simulator's stand-ins (benchmarks/routing_sim.py): the simulated executors'
cost (`Calibration`, `step_s` per plan), the virtual clock the router's modules read during a
run, the cheap tokenizer, and the link that hands a sent plan to its simulated executor.
Imported through routing_sim.py, which points `pagedserve.router` at this tree first."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fake_executor import PipelinedFake
from pagedserve.protos import wire
from routing_workloads import EOS

if TYPE_CHECKING:
    from routing_runner import Simulation


@dataclass(frozen=True)
class Calibration:
    prefill_s_per_token: float
    decode_s_per_row: float
    step_s: float

    def step_time(self, prefill_tokens: int, decode_rows: int) -> float:
        return self.step_s + prefill_tokens * self.prefill_s_per_token \
            + decode_rows * self.decode_s_per_row


CPU_TINY = Calibration(prefill_s_per_token=61e-6, decode_s_per_row=284e-6, step_s=3.8e-3)


class VirtualClock:
    """Stands in for the `time` module inside the router's modules during a run."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def __getattr__(self, name):
        return getattr(time, name)


@contextlib.contextmanager
def virtual_time(clock: VirtualClock):
    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith(("pagedserve.router", "pagedserve.kvmanager")) \
                and getattr(mod, "time", None) is time:
            mod.time = clock
            patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            mod.time = time


class NullTokenizer:
    """Text is one character per token: the text stage runs, cheaply."""

    special_token_ids = frozenset({EOS})
    eos_token_ids = (EOS,)

    def is_special(self, t: int) -> bool:
        return t == EOS

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "x" * len(ids)

    def token_text(self, t: int) -> str:
        return "x"


@dataclass
class SimExecutor:
    handle: object
    fake: PipelinedFake = field(default_factory=PipelinedFake)
    free_at: float = 0.0
    busy_s: float = 0.0
    retry_pending: bool = False


class SimLink:
    """The router's ExecutorLink: a plan sent starts on its simulated executor when the plans
    before it are done and its result is due `step_time` later."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def send(self, routing_id: bytes, msg) -> None:
        if isinstance(msg, wire.StepPlan):
            self.sim.plan_sent(routing_id, msg)

    async def close(self) -> None:
        pass
