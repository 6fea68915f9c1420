"""The routing simulator's report (benchmarks/routing_sim.py): issue 14's targets per
workload (`targets`) and the table of every workload and policy on stderr (`print_table`)."""

from __future__ import annotations

import sys

from routing_workloads import Workload


def targets(w: Workload, rows: dict[str, dict]) -> dict:
    """Issue 14's simulator targets for one workload (None where a policy did not run)."""
    p = rows.get("prefix")
    if p is None:
        return {}
    others = [r for k, r in rows.items() if k != "prefix"]
    out = dict(
        best_hit=all(p["hit_ratio"] >= r["hit_ratio"] for r in others),
        best_ttft_p50=all(p["ttft_ms_p50"] <= r["ttft_ms_p50"] for r in others),
        hit_minus_best_other=round(p["hit_ratio"] - max(r["hit_ratio"] for r in others), 4)
        if others else None,
        ttft_p50_over_best_other_ratio=round(
            p["ttft_ms_p50"] / min(r["ttft_ms_p50"] for r in others), 3) if others else None,
        hit_of_bound_ratio=round(p["hit_ratio"] / max(p["bound_hit_ratio"], 1e-9), 3),
        fits_cluster=w.fits_cluster,
    )
    out["hit_ge_90pct_bound"] = (out["hit_of_bound_ratio"] >= 0.9) if w.fits_cluster else None
    ll = rows.get("least-loaded")
    if ll is not None:
        out["p99_over_least_loaded_ratio"] = round(p["ttft_ms_p99"] / ll["ttft_ms_p99"], 3)
        out["p99_within_10pct"] = out["p99_over_least_loaded_ratio"] <= 1.10
    out["met"] = all(v for k, v in out.items()
                     if k in ("best_hit", "best_ttft_p50", "hit_ge_90pct_bound",
                              "p99_within_10pct") and v is not None)
    return out


def print_table(lines, target_rows) -> None:
    """One table: every workload and policy; then the targets per workload."""
    head = (f"{'workload':<16} {'policy':<13} {'hit':>6} {'of bound':>8} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'out tok/s':>9} {'busy':>5} {'preempt':>7} {'left':>5} "
            f"{'spread':>6}")
    out = [head, "-" * len(head)]
    last = None
    bound = 1.0
    for name, policy, f in lines:
        label = name if name != last else ""
        if name != last:
            bound = f.get("bound_hit_ratio", 1.0)
        last = name
        if policy == "infinite":
            out.append(f"{label:<16} {policy:<13} {f['hit_ratio']:>6.3f} {1:>8.2f}")
            continue
        out.append(f"{label:<16} {policy:<13} {f['hit_ratio']:>6.3f} "
                   f"{f['hit_ratio'] / max(bound, 1e-9):>8.2f} {f['ttft_ms_p50']:>9.1f} "
                   f"{f['ttft_ms_p99']:>9.1f} {f['output_tok_per_s']:>9.0f} "
                   f"{f['busy_ratio']:>5.2f} {f['preemptions']:>7} "
                   f"{f['left_cache_ratio']:>5.2f} {f['executors_per_tenant']:>6.2f}")
    if target_rows:
        out += ["", f"{'prefix routing':<16} {'best hit':>8} {'best p50':>8} {'p50/best':>8} "
                    f"{'fits':>5} {'>=0.9 bound':>11} {'p99/LL':>7} {'met':>4}"]
        for name, t in target_rows:
            ge = {None: "-", True: "yes", False: "NO"}[t["hit_ge_90pct_bound"]]
            out.append(
                f"{name:<16} {'yes' if t['best_hit'] else 'NO':>8} "
                f"{'yes' if t['best_ttft_p50'] else 'NO':>8} "
                f"{t['ttft_p50_over_best_other_ratio']:>8.2f} {str(t['fits_cluster']):>5} "
                f"{ge:>11} {t.get('p99_over_least_loaded_ratio', float('nan')):>7.2f} "
                f"{'yes' if t['met'] else 'NO':>4}")
    print("\n".join(out), file=sys.stderr)
