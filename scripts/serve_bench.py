"""What the benchmarks that start `pagedserve serve` once per configuration share
(benchmarks/disagg_bench.py, benchmarks/kv_pull_bench.py): their common flags, and every
workload run under every configuration, each case's figures emitted as one JSON line with
`same_outputs` (its outputs equal to the baseline configuration's, token for token)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def bench_parser(doc: str, workloads: Iterable[str],
                 configs: Iterable[str]) -> argparse.ArgumentParser:
    """--model, --dtype, --device, --workloads, --configs and --seed (a benchmark adds its
    own)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", help="the executors' (cuda: the GPU check)")
    p.add_argument("--workloads", default=",".join(workloads))
    p.add_argument("--configs", default=",".join(configs))
    p.add_argument("--seed", type=int, default=0)
    return p


def emit(bench: str, case: str, **figures) -> None:
    print(json.dumps({"bench": bench, "case": case, **figures}), flush=True)


def run_matrix(args: argparse.Namespace, bench: str,
               run_case: Callable[[str, str, Path], dict],
               baseline: str) -> list[tuple[str, str, dict]]:
    """`run_case(workload, config, logs folder)` (figures with their "_outputs") for each of
    `args.workloads` under each of `args.configs`, emitted; (workload, config, figures) rows
    for the benchmark's table."""
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"{bench}-") as tmp:
        for workload in args.workloads.split(","):
            results = {c: run_case(workload, c, Path(tmp)) for c in args.configs.split(",")}
            outputs = {c: fig.pop("_outputs") for c, fig in results.items()}
            for config, fig in results.items():
                same = outputs[config] == outputs[baseline] if baseline in outputs else None
                emit(bench, f"{workload}/{config}", workload=workload, config=config, **fig,
                     same_outputs=same)
                rows.append((workload, config, fig))
    return rows
