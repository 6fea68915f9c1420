"""The demo's measuring (pagedserve/demo.py): a record per request, the peak KV blocks sampled
from ClusterStatus, the router's /metrics read per executor, and the summary printed at the
end of `pagedserve demo`; and the helpers that keep random-weight text printable."""

from __future__ import annotations

import contextlib
import math
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .demo_workload import Workload


@dataclass
class RequestRecord:
    phase: str
    tenant: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    stop_token_id: int | None = None
    text: str = ""
    error: str = ""


@dataclass
class PeakSampler:
    """Samples ClusterStatus every `period_s` in a thread: peak blocks in use per executor."""

    stub: object
    period_s: float = 0.05
    peak_used: dict[str, int] = field(default_factory=dict)
    peak_swapped: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        status = self.stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=5)
        for e in status.executors:
            used = e.num_gpu_blocks - e.num_free_gpu_blocks
            self.total[e.id] = e.num_gpu_blocks
            self.peak_used[e.id] = max(self.peak_used.get(e.id, 0), used)
            self.peak_swapped[e.id] = max(self.peak_swapped.get(e.id, 0), e.swapped)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(Exception):
                self.sample()

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def read_metrics(address: str) -> dict[tuple[str, tuple], float]:
    """The router's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def per_executor(metrics: dict, name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (sample, labels), value in metrics.items():
        if sample == name:
            executor = dict(labels).get("executor", "")
            totals[executor] = totals.get(executor, 0.0) + value
    return totals


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def describe_error(exc: Exception) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code is not None else type(exc).__name__}: {details}"


def printable(text: str) -> str:
    """Random-weight text holds control characters; keep the terminal sane."""
    return "".join(c if c.isprintable() or c == "\n" else "\N{REPLACEMENT CHARACTER}"
                   for c in text)


def one_line(text: str, width: int = 96) -> str:
    text = " ".join(printable(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def summary(w: Workload, sampler: PeakSampler, wall_s: float) -> tuple[list[str], dict]:
    m = read_metrics(w.metrics_address)
    queries = per_executor(m, "pagedserve_prefix_cache_queries_total")
    hits = per_executor(m, "pagedserve_prefix_cache_hits_total")
    preempt: dict[str, dict[str, float]] = {}
    for (sample, labels), value in m.items():
        if sample == "pagedserve_preemptions_total":
            d = dict(labels)
            preempt.setdefault(d["executor"], {})[d["mode"]] = value
    done = [r for r in w.records if not r.error]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    out_tokens = sum(r.output_tokens for r in w.records)
    lines = [
        "",
        "== summary ==",
        f"requests            {len(w.records)} ({len(w.records) - len(done)} failed)",
        f"output tokens       {out_tokens} in {wall_s:.1f} s = {out_tokens / wall_s:.0f} tok/s",
        f"TTFT p50 / p90      {percentile(ttfts, 0.5) * 1000:.0f} ms / "
        f"{percentile(ttfts, 0.9) * 1000:.0f} ms",
        "",
        f"{'executor':<10}{'prefix hit rate':>22}{'preemptions':>26}{'peak KV blocks':>18}"
        f"{'peak swapped':>14}",
    ]
    total_preempt = 0
    for eid in sorted(w.aliases, key=w.alias):
        q, h = queries.get(eid, 0.0), hits.get(eid, 0.0)
        rate = f"{h / q:.0%} ({h:.0f}/{q:.0f} tok)" if q else "-"
        modes = preempt.get(eid, {})
        n = int(sum(modes.values()))
        total_preempt += n
        detail = ", ".join(f"{k} {v:.0f}" for k, v in sorted(modes.items()) if v) or "-"
        peak = f"{sampler.peak_used.get(eid, 0)}/{sampler.total.get(eid, 0)}"
        lines.append(f"{w.alias(eid):<10}{rate:>22}{f'{n} ({detail})':>26}{peak:>18}"
                     f"{sampler.peak_swapped.get(eid, 0):>14}")
    swapped_seen = sum(sampler.peak_swapped.values())
    if swapped_seen and not total_preempt:
        lines.append("note: ClusterStatus showed swapped requests but "
                     "pagedserve_preemptions_total stayed 0 (the router does not count a "
                     "preemption in a step that schedules nothing)")
    facts = {"failed": len(w.records) - len(done), "preemptions": total_preempt,
             "swapped_seen": swapped_seen, "prefix_hits": sum(hits.values())}
    return lines, facts

