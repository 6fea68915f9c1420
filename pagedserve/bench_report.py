"""`pagedserve bench`'s measurements and report: what each request measured
(`RequestOutcome`), the run's summary (`summarise`: throughput, each latency's mean and
percentiles, goodput against objectives) and its table (`format_table`); the flags' parsers
for the percentiles and the objectives. bench.py has the workload's driver."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestOutcome:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    finish_reason: int = 0  # FinishReason of the last sample's last chunk (3 = ABORT)
    last_token_at: float | None = field(default=None, repr=False)  # perf_counter seconds

    def record_tokens(self, n: int, sent_at: float) -> None:
        """`n` tokens arrived now, for a request sent at `sent_at` (perf_counter): the
        first ones give TTFT, later ones n ITL gaps of gap / n each."""
        now = time.perf_counter()
        if self.last_token_at is None:
            self.ttft_s = now - sent_at
        else:
            self.itl_s.extend([(now - self.last_token_at) / n] * n)
        self.last_token_at = now
        self.output_tokens += n


GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's names for --goodput
PERCENTILES = (50.0, 90.0, 99.0)  # of each latency, unless --metric-percentiles says


def percentile_name(p: float) -> str:
    """The key of a percentile: p50, p99.9 (vLLM's form)."""
    return f"p{int(p)}" if p == int(p) else f"p{p:g}"


def _stats(prefix: str, values_s: list[float],
           percentiles: tuple[float, ...] = PERCENTILES) -> dict:
    keys = ["mean", *(percentile_name(p) for p in percentiles)]
    if not values_s:
        return {f"{prefix}_ms_{k}": None for k in keys}
    a = np.asarray(values_s) * 1000.0
    out = {f"{prefix}_ms_mean": round(float(a.mean()), 3)}
    for p in percentiles:
        out[f"{prefix}_ms_{percentile_name(p)}"] = round(float(np.percentile(a, p)), 3)
    return out


def _tpot_s(o: RequestOutcome) -> float:
    """Time per output token after the first (0 for a request of one token or none)."""
    return (o.e2e_s - o.ttft_s) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0


def good_requests(done: list[RequestOutcome], slos_ms: dict[str, float]) -> int:
    """How many of the completed requests met every objective in ``slos_ms``."""
    def latency_ms(o: RequestOutcome, metric: str) -> float:
        return 1000.0 * {"ttft": o.ttft_s, "tpot": _tpot_s(o), "e2el": o.e2e_s}[metric]
    return sum(all(latency_ms(o, m) <= limit for m, limit in slos_ms.items()) for o in done)


def summarise(outcomes: list[RequestOutcome], duration_s: float,
              prefix: tuple[float, float] | None,
              percentiles: tuple[float, ...] = PERCENTILES,
              goodput_ms: dict[str, float] | None = None) -> dict:
    done = [o for o in outcomes if o.ok]
    in_tok = sum(o.prompt_tokens for o in done)
    out_tok = sum(o.output_tokens for o in done)
    res = {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration_s": round(duration_s, 3),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput_req_per_s": round(len(done) / duration_s, 3),
        "output_throughput_tok_per_s": round(out_tok / duration_s, 2),
        "total_token_throughput_tok_per_s": round((in_tok + out_tok) / duration_s, 2),
    }
    if goodput_ms:
        good = good_requests(done, goodput_ms)
        res["goodput_slos_ms"] = dict(goodput_ms)
        res["good_completed"] = good
        res["request_goodput_req_per_s"] = round(good / duration_s, 3)
    res.update(_stats("ttft", [o.ttft_s for o in done], percentiles))
    res.update(_stats("tpot", [_tpot_s(o) for o in done if o.output_tokens > 1], percentiles))
    res.update(_stats("itl", [x for o in done for x in o.itl_s], percentiles))
    res.update(_stats("e2e", [o.e2e_s for o in done], percentiles))
    res["cached_prompt_tokens"] = sum(o.cached_prompt_tokens for o in done)
    if prefix is not None:
        queries, hits = prefix
        res["prefix_cache_queries_tokens"] = int(queries)
        res["prefix_cache_hits_tokens"] = int(hits)
        res["prefix_hit_ratio"] = round(hits / queries, 4) if queries else 0.0
    errors = sorted({o.error for o in outcomes if not o.ok})
    if errors:
        res["errors"] = errors[:5]
    return res


def format_table(res: dict) -> str:
    rows = [("completed / failed", f"{res['completed']} / {res['failed']}"),
            ("duration (s)", res["duration_s"]),
            ("input / output tokens", f"{res['total_input_tokens']} / "
                                      f"{res['total_output_tokens']}"),
            ("request throughput (req/s)", res["request_throughput_req_per_s"]),
            ("output throughput (tok/s)", res["output_throughput_tok_per_s"]),
            ("total token throughput (tok/s)", res["total_token_throughput_tok_per_s"])]
    if "goodput_slos_ms" in res:
        slos = ", ".join(f"{m} <= {v:g} ms" for m, v in res["goodput_slos_ms"].items())
        rows.append(("request goodput (req/s)", f"{res['request_goodput_req_per_s']} "
                     f"({res['good_completed']} of {res['completed']} met {slos})"))
    stats = ["mean"] + [k.rsplit("_", 1)[1] for k in res
                        if k.startswith("ttft_ms_p")]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e")):
        vals = [res[f"{key}_ms_{s}"] for s in stats]
        cells = "  ".join("-" if v is None else f"{v:.1f}" for v in vals)
        rows.append((f"{name} ms {' '.join(stats)}", cells))
    if "prefix_hit_ratio" in res:
        rows.append(("prefix cache hit ratio", f"{res['prefix_hit_ratio']:.3f} "
                     f"({res['prefix_cache_hits_tokens']} of "
                     f"{res['prefix_cache_queries_tokens']} tokens)"))
    rows.append(("cached prompt tokens (usage)", res["cached_prompt_tokens"]))
    width = max(len(r[0]) for r in rows)
    lines = ["=" * 20 + " pagedserve bench " + "=" * 20]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    for err in res.get("errors", []):
        lines.append(f"error: {err}")
    return "\n".join(lines)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``50,90,99.9`` -> (50.0, 90.0, 99.9): each in (0, 100], none twice."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: numbers separated by commas, e.g. "
                                         "50,90,99") from None
    bad = [v for v in values if not 0 < v <= 100]
    if bad or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: each percentile once, in (0, 100]")
    return values


def parse_slo(text: str) -> tuple[str, float]:
    """``ttft:200`` -> ("ttft", 200.0): a --goodput objective in milliseconds."""
    metric, sep, value = text.partition(":")
    if not sep or metric not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: METRIC:MILLISECONDS with METRIC one of {', '.join(GOODPUT_METRICS)}")
    try:
        limit = float(value)
    except ValueError:
        limit = math.nan
    if not limit > 0 or math.isinf(limit):
        raise argparse.ArgumentTypeError(f"{text!r}: the milliseconds must be a number > 0")
    return metric, limit
