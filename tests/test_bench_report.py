"""`pagedserve bench`'s summary (pagedserve/bench_report.py): goodput against objectives
with exact counts, chosen percentiles as keys, the table, and the flags' errors (exit 2,
one line). End to end against a cluster: tests/test_bench_cli.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.bench import build_parser
from pagedserve.bench_report import RequestOutcome, format_table, summarise


def outcome(ttft_ms: float, e2e_ms: float, tokens: int, ok: bool = True) -> RequestOutcome:
    return RequestOutcome(ok=ok, prompt_tokens=10, output_tokens=tokens,
                          ttft_s=ttft_ms / 1000, e2e_s=e2e_ms / 1000,
                          error="" if ok else "DEADLINE_EXCEEDED")


# ttft, e2e, tokens -> tpot: (e2e - ttft) / (tokens - 1)
OUTCOMES = [
    outcome(100, 1000, 10),  # tpot 100
    outcome(300, 1200, 10),  # tpot 100, slow first token
    outcome(50, 2050, 11),   # tpot 200
    outcome(80, 80, 1),      # one token: no gap, meets any tpot
    outcome(10, 20, 5, ok=False),  # failed: never good
]


def test_goodput_counts_the_requests_that_met_every_objective():
    res = summarise(OUTCOMES, 2.0, None, goodput_ms={"ttft": 200})
    assert (res["good_completed"], res["request_goodput_req_per_s"]) == (3, 1.5)
    assert res["goodput_slos_ms"] == {"ttft": 200}
    res = summarise(OUTCOMES, 2.0, None, goodput_ms={"ttft": 200, "tpot": 150})
    assert res["good_completed"] == 2  # the first and the one-token request
    res = summarise(OUTCOMES, 2.0, None, goodput_ms={"e2el": 1000, "tpot": 100})
    assert res["good_completed"] == 2  # an objective met exactly counts
    res = summarise(OUTCOMES, 4.0, None, goodput_ms={"tpot": 99.9})
    assert (res["good_completed"], res["request_goodput_req_per_s"]) == (1, 0.25)
    assert "good_completed" not in summarise(OUTCOMES, 2.0, None)
    assert res["completed"] == 4 and res["failed"] == 1


def test_chosen_percentiles_name_their_keys():
    res = summarise(OUTCOMES, 2.0, None, percentiles=(25.0, 99.9))
    assert res["ttft_ms_p25"] == 72.5 and res["ttft_ms_mean"] == 132.5
    assert {k for k in res if k.startswith("e2e_ms_")} == {"e2e_ms_mean", "e2e_ms_p25",
                                                          "e2e_ms_p99.9"}
    assert "ttft_ms_p50" not in res
    # three requests with more than one token: tpot 100, 100, 200
    assert res["tpot_ms_mean"] == pytest.approx(133.333, abs=1e-3)
    table = format_table(res)
    assert "TTFT ms mean p25 p99.9" in table and "request goodput" not in table


def test_the_table_shows_goodput_and_its_objectives():
    res = summarise(OUTCOMES, 2.0, None, goodput_ms={"ttft": 200, "tpot": 150})
    table = format_table(res)
    assert "request goodput (req/s)" in table
    assert "1.0 (2 of 4 met ttft <= 200 ms, tpot <= 150 ms)" in table
    assert "TTFT ms mean p50 p90 p99" in table


def test_flags_parse_into_objectives_and_percentiles():
    args = build_parser().parse_args(["--goodput", "ttft:500", "tpot:50.5",
                                      "--metric-percentiles", "50,99.9"])
    assert args.goodput == [("ttft", 500.0), ("tpot", 50.5)]
    assert args.metric_percentiles == (50.0, 99.9)
    assert build_parser().parse_args([]).metric_percentiles == (50.0, 90.0, 99.0)


@pytest.mark.parametrize(("flags", "says"), [
    (["--goodput", "itl:50"], "METRIC:MILLISECONDS with METRIC one of ttft, tpot, e2el"),
    (["--goodput", "ttft"], "METRIC:MILLISECONDS"),
    (["--goodput", "ttft:fast"], "must be a number > 0"),
    (["--goodput", "tpot:0"], "must be a number > 0"),
    (["--goodput", "e2el:inf"], "must be a number > 0"),
    (["--goodput", "ttft:5", "ttft:6"], "--goodput names a metric twice"),
    (["--metric-percentiles", "50,abc"], "numbers separated by commas"),
    (["--metric-percentiles", "0,50"], "each percentile once, in (0, 100]"),
    (["--metric-percentiles", "50,50"], "each percentile once, in (0, 100]"),
])
def test_bad_flags_exit_2_with_one_line(flags, says):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
