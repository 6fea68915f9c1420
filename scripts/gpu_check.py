"""The GPU check (issue 15): stages of CUDA tests and benchmarks, one per device call, each
with its log and a one-screen summary, merged into OUTDIR/gpu_report.json.

    scripts/gpu_check.sh OUTDIR [--stage NAME] [--steps NAME[,NAME]] [--dry-run] [--small]
                         [--seed-report FILE]

Run from the repository root on the CUDA machine with `.whl/` (`make gpu-wheels`) beside it.
Before a stage it installs the wheels and then the project into one target folder
(`pip install --no-index --no-deps --target`, the project with `--no-build-isolation`) and
runs every step with that folder on PYTHONPATH, PYTHONSAFEPATH=1 and the work folder as the
current directory: the repository's own `pagedserve/` folder holds only part of the package
(pyproject maps the other top-level folders into it) and must not shadow the installed one.

Stages (STAGES; each fits one 10-minute call, `--budget-s` caps its steps):
  kernels     pytest -m gpu (every kernel against its torch twin), benchmarks/kernels_bench.py
              (every case: the grid, the launch sweep `tune`, the fused layer kernels `layer`)
  executor    a random-weight Qwen2.5-0.5B-shape model built there, executor_bench on it,
              memory profiling (blocks from --gpu-memory-utilization, pinned swap space)
  cluster     `pagedserve serve` on CUDA: HF equivalence (bf16 with 2 executors at
              --gpu-memory-utilization 0.4, then SIGKILL of one: migration; fp32 exact),
              swap and recompute preemption under a small --num-gpu-blocks
  throughput  benchmarks/steady_serving.py (streams ending and starting steadily: graph
              pieces vs eager), benchmarks/hf_batch_bench.py (transformers' generate_batch
              on the same GPU, model and requests) and benchmarks/step_overhead.py, each
              also with the API edges in 2 worker processes (--api-workers 2)
Without --stage the first stage the report does not record as run (passed or failed).

`--steps NAME[,NAME]` runs only those steps of the stage (its set-up steps too) and keeps
the other steps' records from an earlier run (`--seed-report`): a stage filled in over
several calls; it stays 'partial' (not done) until every step has passed.

Bookkeeping: the report holds, per stage, its status (running, passed, failed, partial, dry-run),
times, and per step its argv, exit code, wall time, status, and what it printed that is
read back: benchmark JSON lines (DESIGN §8: "bench" and "case") and pytest's counts. It is
rewritten after every step, so a call cut off at its limit still returns what ran.
`--dry-run` runs nothing and records what would run; `--small` runs every step on a tiny
model with small sizes (works on CPU: checks the steps themselves, not the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_stages, also PYTHONSAFEPATH
from gpu_stages import ROOT, STAGES, Context, Step, plan_stage  # noqa: E402

REPORT = "gpu_report.json"
DONE = ("passed", "failed")
DEFAULT_WORK = "/tmp/pagedserve-gpu-check"
SUMMARY_RECORDS = 28  # benchmark lines in a stage's one-screen summary
# Figures shown in the summary, in this order, when a record has them.
SUMMARY_KEYS = (
    "ok", "skipped", "latency_us_p50", "gb_per_s", "copy_bw_ratio", "paged_vs_contiguous_ratio",
    "split_k_speedup_ratio", "decode_tok_per_s", "of_bound_ratio", "num_gpu_blocks",
    "num_cpu_blocks", "output_tok_per_s", "pagedserve_vs_hf_ratio", "matched", "mismatched",
    "preemptions", "migrated", "itl_ms_p50", "gap_ms_p50", "forward_ms_p50", "wall_s", "error",
    "kernels_per_step", "kernel_us_per_step", "wall_us_per_step", "fused_speedup_ratio",
    "best_copy_bw_ratio", "drift_vs_hf_ratio", "engine_us_per_step_p50",
)


# --- the report ---------------------------------------------------------------------------

def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def load_report(path: Path, seed: Path | None = None) -> dict:
    """The report in OUTDIR, else the seed (a report from an earlier call), else empty. An
    unreadable file is moved aside (`.corrupt`) rather than lost or fatal."""
    for source in (path, seed):
        if source is None or not source.is_file():
            continue
        try:
            data = json.loads(source.read_text())
            if isinstance(data, dict) and isinstance(data.get("stages"), dict):
                return data
            raise ValueError("not a gpu_check report")
        except ValueError as exc:
            if source == path:
                path.replace(path.with_suffix(".json.corrupt"))
            print(f"gpu_check: ignoring {source}: {exc}", file=sys.stderr)
    return {"version": 1, "stages": {}}


def merge_stage(report: dict, stage: str, entry: dict, env: dict | None = None) -> dict:
    """The report with `stage` replaced by `entry` (other stages kept), env updated."""
    out = {**report, "version": 1, "updated": now(), "stages": {**report.get("stages", {})}}
    out["stages"][stage] = entry
    if env:
        out["env"] = {**report.get("env", {}), **env}
    return out


def write_report(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def next_stage(report: dict) -> str | None:
    """The first stage not yet run to its end (a dry run or an interrupted run is not)."""
    stages = report.get("stages", {})
    for name in STAGES:
        if stages.get(name, {}).get("status") not in DONE:
            return name
    return None


# --- running a step -----------------------------------------------------------------------

PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
PYTEST_DURATION = re.compile(r"\s*\d+(\.\d+)?s (call|setup|teardown) +\S")


def read_output(kind: str, lines: list[str]) -> dict:
    """What a step printed that the report keeps."""
    records = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "bench" in obj and "case" in obj:
                records.append(obj)
    out: dict = {"records": records} if records else {}
    if kind == "pytest":
        counts: dict[str, int] = {}
        for line in reversed(lines):
            found = PYTEST_COUNTS.findall(line)
            if found and re.search(r"\bin [\d.]+s", line):
                counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
                          for n, k in found}
                break
        out["pytest"] = counts
        out["failures"] = [x.strip() for x in lines
                           if x.startswith(("FAILED ", "ERROR "))][:20]
        slowest = [x.strip() for x in lines if PYTEST_DURATION.match(x)][:15]
        if slowest:  # --durations: "12.34s call     tests/test_x.py::test_y[...]"
            out["slowest"] = slowest
    return out


def run_step(step: Step, ctx: Context, log, timeout_s: float) -> dict:
    """Run one step (its own process group), its output appended to `log`; killed with its
    group at `timeout_s`."""
    log.write(f"\n=== {step.name}: {shlex.join(step.argv)}\n")
    log.flush()
    start = time.monotonic()
    lines: list[str] = []
    env = {**os.environ, **ctx.env, **step.env}
    try:
        proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=env, cwd=ctx.work_dir,
                                start_new_session=True)
    except OSError as exc:
        log.write(f"=== {step.name}: could not start: {exc}\n")
        return {"status": "failed", "rc": None, "wall_s": 0.0, "error": str(exc)}

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(10)
    wall = time.monotonic() - start
    status = "timeout" if timed_out else ("passed" if proc.returncode == 0 else "failed")
    log.write(f"=== {step.name}: {status} (exit {proc.returncode}) in {wall:.1f} s\n")
    log.flush()
    result = {"status": status, "rc": proc.returncode, "wall_s": round(wall, 1),
              **read_output(step.reads, lines)}
    if status != "passed":
        result["tail"] = [x.rstrip("\n") for x in lines[-15:]]
    return result


def install(ctx: Context, log) -> dict:
    """The carried wheels (once per set of wheel files) and then the project (every time:
    the tree may have changed) into ctx.site."""
    assert ctx.site is not None
    ctx.site.mkdir(parents=True, exist_ok=True)
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    pip = [ctx.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target",
           str(ctx.site)]
    stamp = ctx.site / ".wheels"
    names = "\n".join(p.name for p in wheels)
    steps = []
    if wheels and (not stamp.is_file() or stamp.read_text() != names):
        steps.append(Step("install_wheels", [*pip, *map(str, wheels)], 300))
    steps.append(Step("install_project", [*pip, "--no-build-isolation", str(ROOT)], 300))
    result: dict = {"wheels": [p.name for p in wheels]}
    for step in steps:
        r = run_step(step, ctx, log, step.timeout_s)
        result[step.name] = r["status"]
        if r["status"] != "passed":
            result["status"], result["tail"] = "failed", r.get("tail", [])
            return result
        if step.name == "install_wheels":
            stamp.write_text(names)
    if not wheels:
        result["note"] = "no .whl/ folder: only the project was installed (make gpu-wheels)"
    result["status"] = "passed"
    return result


# --- a stage ------------------------------------------------------------------------------

def select_steps(stage: str, steps: list[Step], names: str | None) -> set[str] | None:
    """The step names `--steps` picks in `stage` (None: every step); a name the stage
    lacks is an error that lists the stage's steps."""
    if not names:
        return None
    picked = {n.strip() for n in names.split(",") if n.strip()}
    unknown = picked - {s.name for s in steps}
    if unknown:
        raise SystemExit(f"gpu_check: stage {stage} has no step {', '.join(sorted(unknown))} "
                         f"(its steps: {', '.join(s.name for s in steps)})")
    return picked


def run_stage(stage: str, ctx: Context, args, report_path: Path, report: dict) -> dict:
    steps = plan_stage(stage, ctx)
    picked = select_steps(stage, steps, args.steps)
    # --steps: the other steps keep what an earlier run recorded (a stage filled in over
    # several calls or sessions); required set-up steps (env, the model) always run.
    earlier = report.get("stages", {}).get(stage, {}).get("steps", {}) if picked else {}
    entry: dict = {"status": "dry-run" if args.dry_run else "running", "started": now(),
                   "small": ctx.small, "steps": {}}
    if args.dry_run:
        for step in steps:
            if picked is not None and step.name not in picked and not step.required:
                continue
            entry["steps"][step.name] = {"status": "dry-run", "argv": step.argv,
                                         "timeout_s": step.timeout_s,
                                         **({"env": step.env} if step.env else {})}
        entry["env"] = {k: ctx.env[k] for k in sorted(ctx.env)}
        return merge_stage(report, stage, entry)

    start = time.monotonic()
    log_path = ctx.out_dir / f"{stage}.log"
    with open(log_path, "a") as log:
        log.write(f"\n##### stage {stage} at {now()} (small={ctx.small})\n")
        report = merge_stage(report, stage, entry)
        write_report(report_path, report)
        if ctx.site is not None:
            entry["install"] = install(ctx, log)
            if entry["install"]["status"] != "passed":
                entry["status"] = "failed"
        for step in steps:
            left = args.budget_s - (time.monotonic() - start)
            record: dict = {"argv": step.argv, **({"env": step.env} if step.env else {})}
            if picked is not None and step.name not in picked and not step.required:
                record = earlier.get(step.name) or {
                    **record, "status": "not-run", "error": "not selected (--steps)"}
            elif entry.get("stopped") or entry.get("install", {}).get("status") == "failed":
                record["status"] = "not-run"
            elif left < 5:
                record["status"] = "not-run"
                record["error"] = "stage budget spent"
                entry["status"] = "failed"
            else:
                print(f"[{stage}] {step.name} ...", flush=True)
                record.update(run_step(step, ctx, log, min(step.timeout_s, left)))
                if record["status"] == "timeout" and left < step.timeout_s:
                    # cut by what the stage had left (its set-up steps count), not by the
                    # step's own limit: not a hang
                    record["error"] = (f"cut by the stage budget (--budget-s): {left:.0f} s "
                                       f"were left, the step may take {step.timeout_s:.0f}")
                    log.write(f"=== {step.name}: {record['error']}\n")
                print(f"[{stage}] {step.name}: {record['status']} in {record['wall_s']} s",
                      flush=True)
                if record["status"] != "passed":
                    entry["status"] = "failed"
                    if step.required:
                        entry["stopped"] = step.name
            entry["steps"][step.name] = record
            env = _env_record(record) if step.name == "env" else None
            report = merge_stage(report, stage, entry, env)
            write_report(report_path, report)
        if entry["status"] == "running":
            entry["status"] = "passed" if all(
                r["status"] == "passed" for r in entry["steps"].values()) else "partial"
        entry["wall_s"] = round(time.monotonic() - start, 1)
        entry["summary"] = summary_lines(stage, entry)
        log.write("\n".join(entry["summary"]) + "\n")
    return merge_stage(report, stage, entry)


def _env_record(record: dict) -> dict | None:
    for r in record.get("records", []):
        if r.get("case") == "env":
            return {k: v for k, v in r.items() if k not in ("bench", "case")}
    return None


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return str(value)


def summary_lines(stage: str, entry: dict) -> list[str]:
    """The stage on one screen: its status, each step's, pytest counts, benchmark figures."""
    lines = [f"== {stage}: {entry['status'].upper()} in {entry.get('wall_s', 0)} s"
             + (" (small)" if entry.get("small") else "")]
    if entry.get("install", {}).get("status") == "failed":
        lines.append("   install failed: " + " | ".join(entry["install"].get("tail", [])[-3:]))
    records = []
    for name, step in entry["steps"].items():
        extra = ""
        if "pytest" in step:
            extra = " " + ", ".join(f"{n} {k}" for k, n in step["pytest"].items())
        if step.get("error"):
            extra += f" ({step['error']})"
        wall = f"{step['wall_s']:7.1f} s" if "wall_s" in step else "      -  "
        lines.append(f"   {name:18s} {step['status']:8s} {wall}{extra}")
        lines += [f"      {x[:150]}" for x in step.get("failures", [])[:5]]
        if step["status"] in ("failed", "timeout"):
            lines += [f"      | {x[:150]}" for x in step.get("tail", [])[-4:]]
        records += [r for r in step.get("records", []) if r.get("case") != "env"]
    for r in records[:SUMMARY_RECORDS]:
        figures = [f"{k}={_fmt(r[k])}" for k in SUMMARY_KEYS if k in r]
        lines.append(f"   {r['bench'][:14]:14s} {str(r['case'])[:34]:34s} {' '.join(figures)}")
    if len(records) > SUMMARY_RECORDS:
        lines.append(f"   (+{len(records) - SUMMARY_RECORDS} more records in {REPORT})")
    return lines


# --- entry point --------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", metavar="OUTDIR", help="logs and gpu_report.json go here")
    ap.add_argument("--stage", choices=STAGES, help="default: the next one not yet run")
    ap.add_argument("--dry-run", action="store_true", help="record what would run, run nothing")
    ap.add_argument("--small", action="store_true",
                    help="tiny model and sizes (runs on CPU: checks the steps, not the GPU)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="time for the stage's steps (a device call allows 600 s in all)")
    ap.add_argument("--work-dir", default=DEFAULT_WORK,
                    help="models and server logs (kept between stages on a warm machine)")
    ap.add_argument("--site", default=None,
                    help="install target (default WORK/site); 'none': use the environment as is")
    ap.add_argument("--seed-report", default=None,
                    help="an earlier call's gpu_report.json, merged into when OUTDIR has none")
    ap.add_argument("--steps", default=None, metavar="NAME[,NAME]",
                    help="only these steps of the stage (and its set-up steps); the others "
                         "keep what an earlier run recorded; the stage is 'partial' until "
                         "every step has passed")
    ap.add_argument("--list", action="store_true", help="print the stages and their status")
    return ap.parse_args(argv)


def make_context(args) -> Context:
    out_dir = Path(args.out_dir).resolve()
    work_dir = Path(args.work_dir).resolve()
    site = None if args.site == "none" or args.dry_run else Path(
        args.site or work_dir / "site").resolve()
    env = {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PAGEDSERVE_HTTP_PORT": "-1", "TOKENIZERS_PARALLELISM": "false"}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return Context(out_dir=out_dir, work_dir=work_dir, small=args.small, site=site, env=env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = make_context(args)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    report_path = ctx.out_dir / REPORT
    report = load_report(report_path, Path(args.seed_report) if args.seed_report else None)
    if args.list:
        for name in STAGES:
            s = report["stages"].get(name, {})
            print(f"{name:12s} {s.get('status', '-'):8s} {s.get('started', '')}")
        return 0
    stage = args.stage or next_stage(report)
    if stage is None:
        print("gpu_check: every stage has run (use --stage NAME to run one again)")
        write_report(report_path, report)
        return 0
    report = run_stage(stage, ctx, args, report_path, report)
    write_report(report_path, report)
    entry = report["stages"][stage]
    if args.dry_run:
        for name, step in entry["steps"].items():
            print(f"[{stage}] would run {name}: {shlex.join(step['argv'])}")
    else:
        print("\n".join(entry["summary"]))
    print(f"report: {report_path}")
    return 0 if entry["status"] in ("passed", "partial", "dry-run") else 1


if __name__ == "__main__":
    sys.exit(main())
