"""Issue 15's targets read from GPU check reports: what each target's latest figure is, which
report, step and case it came from, met or not. Run on the CPU machine after a GPU session
(it reads JSON only):

    python scripts/gpu_targets.py benchmarks/gpu_report-*.json [OUTDIR/gpu_report.json]

Reports are read in the order given; a later report's figure for the same step and case
replaces an earlier one. Both report forms are read: a run's own ``gpu_report.json``
(``stages`` at the top) and a committed session report (``calls``, each with the
``report`` of one device call, in order). Figures are kept apart by the GPU that gave them
(the ``env`` step's ``device``; a ratio to an H100's copy bandwidth says nothing of an
H200's): every target is judged per device. One JSON line per target and device (DESIGN
§8), then a table. The targets (issue 15):

* ``decode_copy``: the decode kernel at batch >= 64 and context >= 1k (kernels_bench's
  ``decode/<shape>/b<B>/ctx<C>`` cases) at >= 0.85 of the measured device-to-device copy
  bandwidth (``copy_bw_ratio``), counted over the shapes;
* ``decode_vs_sdpa``: the same cases' paged / contiguous SDPA time <= 1.10;
* ``end_to_end``: the executor's serve loop at batch 256, context 1k, CUDA graphs
  (executor_bench ``gpu_qwen2.5-0.5b_serve_loop_b256_graphs``) at >= 0.5 of the bandwidth
  bound (``of_bound_ratio``), from every executor step that ran it (the default and each
  A/B switch: ``executor_bench_<switch>``), and its ``_unfed`` twin where present;
* ``throughput``: ``hf_batch_bench``'s ``pagedserve_vs_hf_ratio`` >= 3;
* ``gap``: the executor's gap between decode steps, ``gap_ms_p50`` <= 0.2 of step_overhead's
  real-model runs, per step, stream count and pipeline depth.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

DECODE_CASE = re.compile(r"^decode/(?P<shape>[^/]+)/b(?P<batch>\d+)/ctx(?P<ctx>\d+)$")
E2E_CASE = re.compile(r"^gpu_qwen2\.5-0\.5b_serve_loop_b256_graphs(?P<variant>_unfed)?$")
COPY_TARGET, SDPA_TARGET, E2E_TARGET, HF_TARGET, GAP_TARGET_MS = 0.85, 1.10, 0.5, 3.0, 0.2


def report_stages(report: dict) -> list[dict]:
    """The ``stages`` of each device call in ``report``, in order."""
    if "stages" in report:
        return [report["stages"]]
    return [call["report"]["stages"] for call in report.get("calls", [])]


def stages_device(stages: dict) -> str:
    """The GPU a device call ran on: its first ``env`` record's ``device``."""
    for entry in stages.values():
        for record in entry.get("steps", {}).get("env", {}).get("records") or []:
            if record.get("device"):
                return str(record["device"])
    return "unknown"


def latest_records(paths: list[str]) -> dict[tuple[str, str, str, str], tuple[dict, str]]:
    """(device, stage, step, case) -> (its latest record, the report it came from); the
    cases of a step that ran again on that device replace the earlier run's."""
    latest: dict[tuple[str, str, str, str], tuple[dict, str]] = {}
    for path in paths:
        for stages in report_stages(json.loads(Path(path).read_text())):
            device = stages_device(stages)
            for stage, entry in stages.items():
                for step, result in entry.get("steps", {}).items():
                    for record in result.get("records") or []:
                        key = (device, stage, step, _case(record))
                        latest[key] = (record, Path(path).name)
    return latest


def _case(record: dict) -> str:
    case = str(record.get("case", ""))
    if record.get("bench") == "step_overhead":
        return f"{case}|r{record.get('running')}|d{record.get('depth')}"
    return case


def targets(latest: dict[tuple[str, str, str, str], tuple[dict, str]]) -> list[dict]:
    """One row per target and device (devices in the order first seen): ``target``,
    ``device``, ``met``, the figures and where they came from."""
    devices = list(dict.fromkeys(key[0] for key in latest))
    return [row for device in devices for row in _device_targets(
        device, {key[1:]: value for key, value in latest.items() if key[0] == device})]


def _device_targets(device: str, latest: dict[tuple[str, str, str], tuple[dict, str]]
                    ) -> list[dict]:
    decode_by_case: dict[str, dict] = {}  # whichever step ran the decode cases last
    e2e, hf, gap = [], [], []
    for (stage, step, case), (record, source) in latest.items():
        where = {"report": source, "step": step}
        if (m := DECODE_CASE.match(case)) and stage == "kernels" \
                and int(m["batch"]) >= 64 and int(m["ctx"]) >= 1024 \
                and "copy_bw_ratio" in record:
            decode_by_case.pop(case, None)  # (re-inserted: the dict keeps the latest order)
            decode_by_case[case] = {
                "case": case, **where, "copy_bw_ratio": record["copy_bw_ratio"],
                "paged_vs_contiguous_ratio": record.get("paged_vs_contiguous_ratio")}
        elif (m := E2E_CASE.match(case)) and "of_bound_ratio" in record:
            e2e.append({"case": case, **where, "of_bound_ratio": record["of_bound_ratio"]})
        elif "pagedserve_vs_hf_ratio" in record:
            hf.append({**where, "pagedserve_vs_hf_ratio": record["pagedserve_vs_hf_ratio"]})
        elif record.get("bench") == "step_overhead" and record.get("mode") == "real" \
                and record.get("gap_ms_p50") is not None:
            gap.append({**where, "running": record.get("running"), "depth": record.get("depth"),
                        "gap_ms_p50": record["gap_ms_p50"]})
    decode = sorted(decode_by_case.values(), key=lambda d: d["case"])
    rows = []
    copy_ok = [d for d in decode if d["copy_bw_ratio"] >= COPY_TARGET]
    rows.append({"target": "decode_copy", "met": bool(decode) and len(copy_ok) == len(decode),
                 "passing": len(copy_ok), "of": len(decode),
                 "misses": [d for d in decode if d["copy_bw_ratio"] < COPY_TARGET]})
    sdpa = [d for d in decode if d["paged_vs_contiguous_ratio"] is not None]
    sdpa_ok = [d for d in sdpa if d["paged_vs_contiguous_ratio"] <= SDPA_TARGET]
    rows.append({"target": "decode_vs_sdpa", "met": bool(sdpa) and len(sdpa_ok) == len(sdpa),
                 "passing": len(sdpa_ok), "of": len(sdpa),
                 "misses": [d for d in sdpa if d["paged_vs_contiguous_ratio"] > SDPA_TARGET]})
    default = [r for r in e2e if r["step"] == "executor_bench" and r["case"].endswith("graphs")]
    rows.append({"target": "end_to_end", "met": bool(default) and
                 default[-1]["of_bound_ratio"] >= E2E_TARGET,
                 "default": default[-1] if default else None, "runs": e2e})
    rows.append({"target": "throughput", "met": bool(hf) and
                 max(r["pagedserve_vs_hf_ratio"] for r in hf) >= HF_TARGET, "runs": hf})
    by_streams: dict[int, list[dict]] = {}
    for r in gap:
        by_streams.setdefault(r["running"], []).append(r)
    rows.append({"target": "gap", "met": bool(gap) and all(
        min(r["gap_ms_p50"] for r in runs) <= GAP_TARGET_MS for runs in by_streams.values()),
        "best_by_streams": {str(n): min(runs, key=lambda r: r["gap_ms_p50"])
                            for n, runs in sorted(by_streams.items())},
        "runs": gap})
    return [{"target": row.pop("target"), "device": device, **row} for row in rows]


def table(rows: list[dict]) -> list[str]:
    lines, device = [], None
    for row in rows:
        if row["device"] != device:
            device = row["device"]
            lines.append(f"{device}:")
        mark = "met" if row["met"] else "MISSED"
        name = row["target"]
        if name in ("decode_copy", "decode_vs_sdpa"):
            key = "copy_bw_ratio" if name == "decode_copy" else "paged_vs_contiguous_ratio"
            misses = ", ".join(f"{m['case'].removeprefix('decode/')} {m[key]}"
                               for m in row["misses"])
            lines.append(f"{name:15} {mark:6} {row['passing']}/{row['of']} shapes"
                         + (f"; misses: {misses}" if misses else ""))
        elif name == "end_to_end":
            runs = ", ".join(f"{r['step']}{'(unfed)' if r['case'].endswith('unfed') else ''} "
                             f"{r['of_bound_ratio']}" for r in row["runs"])
            lines.append(f"{name:15} {mark:6} of the bound: {runs or 'no run'}")
        elif name == "throughput":
            runs = ", ".join(f"{r['step']} {r['pagedserve_vs_hf_ratio']}x" for r in row["runs"])
            lines.append(f"{name:15} {mark:6} vs HF: {runs or 'no run'}")
        else:
            best = ", ".join(f"{n} streams {r['gap_ms_p50']} ms ({r['step']}, depth {r['depth']})"
                             for n, r in row["best_by_streams"].items())
            lines.append(f"{name:15} {mark:6} best gap p50: {best or 'no run'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="gpu_report JSON files, oldest first")
    args = ap.parse_args(argv)
    rows = targets(latest_records(args.reports))
    for row in rows:
        print(json.dumps({"bench": "gpu_targets", **row}))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
