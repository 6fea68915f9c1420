"""Cluster checks of the GPU check: `pagedserve serve` on CUDA against transformers on the
same GPU, one check per invocation (each starts its own server), JSON lines (bench
"gpu_cluster"), exit 1 when a check fails.

    gpu_cluster.py bf16-migration    --model-dir DIR   2 executors sharing the GPU at
        --gpu-memory-utilization 0.4 each (both must get blocks, within 10% of each other),
        greedy bf16 outputs judged against HF float32 by HF bf16's own drift from float32
        (bf16_noise, judge_bf16: first differences beyond the largest float32 gap at which
        HF bf16 itself differed no more often than HF bf16's own spread explains, none past
        twice it, and no earlier in median than half of HF bf16's); teacher-forced log-probabilities (prompt_logprobs) of the prompts followed
        by float32's continuation no further from float32's than HF bf16's are (1.5x at
        most); then the same requests again with SIGKILL of an executor once every stream
        has its first tokens: all complete on the other one, judged alike, migrations
        counted
    gpu_cluster.py fp32-exact        --model-dir DIR   1 executor, float32: equal to HF float32
        (a first difference only where HF's top two logits are within --fp32-tie)
    gpu_cluster.py preempt-swap      --model-dir DIR   a small --num-gpu-blocks: requests are
        swapped out to pinned CPU memory and back; outputs equal to HF float32
    gpu_cluster.py preempt-recompute --model-dir DIR   the same with recompute preemption

Prompts are token ids (the random model's tokenizer does not matter), in groups of one
length each (odd lengths, not multiples of the block size) so transformers generates each
group as one batch with no padding. HF references use output_logits for the top-two gaps.
`--small`: the executors on CPU, fewer and shorter requests (checks the script, not CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import ServeProcess, metric_sum, serve_argv  # noqa: E402

BENCH = "gpu_cluster"
PROMPT_LENGTHS = (13, 77, 200)  # one HF batch per length


def emit(case: str, **figures) -> dict:
    record = {"bench": BENCH, "case": case, **figures}
    print(json.dumps(record), flush=True)
    return record


def make_prompts(per_length: int, lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths for _ in range(per_length)]


@contextlib.contextmanager
def hf_model(model_dir: str, dtype: str, device: str):
    """transformers' model of `model_dir` in `dtype` on `device` (tf32 off), freed after."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to(device).eval()
    try:
        yield model
    finally:
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def hf_generate(model, prompts: list[list[int]], max_tokens: int,
                device: str) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations (EOS ignored) with HF's top-2 logit gap at each position; the
    prompts of one length run as one batch."""
    import torch

    out: dict[int, tuple[list[int], list[float]]] = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    with torch.inference_mode():
        for length, idx in by_len.items():
            ids = torch.tensor([prompts[i] for i in idx], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=0)
            top2 = torch.stack([step.float().topk(2, dim=-1).values for step in gen.logits], 1)
            gaps = (top2[..., 0] - top2[..., 1]).tolist()
            for row, i in enumerate(idx):
                out[i] = (gen.sequences[row, length:].tolist(), gaps[row])
    return [out[i] for i in range(len(prompts))]


def hf_references(model_dir: str, prompts: list[list[int]], max_tokens: int, dtype: str,
                  device: str) -> list[tuple[list[int], list[float]]]:
    """hf_generate with a model loaded for it."""
    with hf_model(model_dir, dtype, device) as model:
        return hf_generate(model, prompts, max_tokens, device)


def hf_token_logprobs(model, seqs: list[list[int]], device: str) -> list[np.ndarray]:
    """Teacher-forced log-probability of each token of each sequence from the second on (what
    SamplingParams.prompt_logprobs reports), one sequence at a time."""
    import torch

    out = []
    with torch.inference_mode():
        for seq in seqs:
            ids = torch.tensor([seq], device=device)
            logits = model(ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
                       .cpu().numpy())
    return out


def logprob_drift(client: Client, seqs, hf32, hf16) -> dict:
    """Mean |log p - float32's log p| per position over teacher-forced sequences, ours (bf16,
    through prompt_logprobs) beside HF bf16's: how far each bf16 computation is from float32
    on the same tokens, free of greedy paths that diverge. Ours may be at most 1.5x HF's."""
    ours = [np.array([e.logprob for e in client.score(seq).prompt_logprobs]) for seq in seqs]
    if any(len(o) != len(r) for o, r in zip(ours, hf32, strict=True)):
        return {"ok": False, "error": "prompt_logprobs of the wrong length"}
    drift = float(np.mean(np.concatenate([np.abs(o - r) for o, r in zip(ours, hf32,
                                                                       strict=True)])))
    hf_drift = float(np.mean(np.concatenate([np.abs(h - r) for h, r in zip(hf16, hf32,
                                                                         strict=True)])))
    return {"ok": drift <= 1.5 * hf_drift + 1e-4, "positions": int(sum(map(len, ours))),
            "drift_mean": round(drift, 5), "hf_bf16_drift_mean": round(hf_drift, 5),
            "drift_vs_hf_ratio": round(drift / max(hf_drift, 1e-9), 3)}


def compare(got: list[int], ref: list[int], gaps: list[float], tie: float) -> dict:
    """exact, tie (the first difference is where HF's top two are within `tie`), or
    mismatch (a first difference at a decisive position, or a wrong length)."""
    for j, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            kind = "tie" if gaps[j] <= tie else "mismatch"
            return {"verdict": kind, "position": j, "gap": round(gaps[j], 5)}
    return {"verdict": "exact" if len(got) == len(ref) else "mismatch", "position": None}


def tally(results: list, refs, tie: float, verdicts: list | None = None) -> dict:
    """Counts of compare()'s verdicts; each verdict is also appended to `verdicts`."""
    verdicts = [] if verdicts is None else verdicts
    for r, (ref, gaps) in zip(results, refs, strict=True):
        if isinstance(r, Exception):
            verdicts.append({"verdict": "error", "error": str(r)[:200]})
        else:
            verdicts.append(compare(r, ref, gaps, tie))
    count = {k: sum(v["verdict"] == k for v in verdicts) for k in ("exact", "tie", "mismatch",
                                                                  "error")}
    bad = [v for v in verdicts if v["verdict"] in ("mismatch", "error")][:3]
    tie_gaps = [v["gap"] for v in verdicts if v["verdict"] == "tie"]
    return {"ok": count["mismatch"] + count["error"] == 0, "matched": count["exact"],
            "tie_accepted": count["tie"], "mismatched": count["mismatch"],
            "errors": count["error"], "tie": tie,
            "max_tie_gap": max(tie_gaps) if tie_gaps else None, "first_bad": bad}


class Client:
    def __init__(self, address: str) -> None:
        import grpc
        from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
        from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GeneratorStub(self.channel)

    def request(self, ids: list[int], max_tokens: int):
        req = self.pb.GenerateRequest(params=self.pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        req.prompt_token_ids.ids.extend(ids)
        return req

    def score(self, ids: list[int]):
        """One token generated, the prompt's log-probabilities returned (Generate, unary)."""
        req = self.request(ids, 1)
        req.params.prompt_logprobs = 0
        return self.stub.Generate(req, timeout=120)

    def status(self):
        return self.stub.GetClusterStatus(self.pb.ClusterStatusRequest(), timeout=10)

    def stream_all(self, prompts, max_tokens: int, on_first=None, timeout_s: float = 300):
        """Every prompt as a concurrent stream; token ids per prompt (or the exception).
        With `on_first`, each stream pauses at its first chunk until all have one, then
        `on_first()` runs (every request is running somewhere) and they go on."""
        results: list = [None] * len(prompts)
        barrier = threading.Barrier(len(prompts) + 1, timeout=timeout_s) if on_first else None

        def run(i: int) -> None:
            tokens: list[int] = []
            try:
                for n, chunk in enumerate(self.stub.Stream(self.request(prompts[i], max_tokens),
                                                           timeout=timeout_s)):
                    tokens += list(chunk.token_ids)
                    if n == 0 and barrier is not None:
                        barrier.wait()
                results[i] = tokens
            except Exception as exc:  # grpc.RpcError or a broken barrier: reported per prompt
                results[i] = exc
                if barrier is not None:
                    barrier.abort()

        threads = [threading.Thread(target=run, args=(i,), daemon=True)
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        if barrier is not None:
            try:
                barrier.wait()
                on_first()
            except threading.BrokenBarrierError:
                pass
        for t in threads:
            t.join(timeout_s)
        return results

    def wait_all_free(self, timeout_s: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [e for e in self.status().executors if e.healthy]
            if all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in live):
                return True
            time.sleep(0.2)
        return False

    def close(self) -> None:
        self.channel.close()


def device_args(args) -> list[str]:
    if args.small:
        return ["--device", "cpu", "--cpu-threads", "1", "--kv-cache-space", "0.05"]
    return []


def first_divergence(got: list[int], ref: list[int]) -> int | None:
    return next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)


def bf16_noise(refs16, refs32, floor: float) -> dict:
    """How far HF's own bf16 greedy outputs drift from its float32 ones on these prompts: the
    first positions where they differ and float32's top-two gap there. bf16 is judged
    against float32 with a tie of the largest such gap (at least `floor`): our bf16 may
    differ from float32 where HF's bf16 could have too (judge_bf16 says how often beyond)."""
    positions, gaps = [], []
    for (seq16, _), (seq32, gaps32) in zip(refs16, refs32, strict=True):
        j = first_divergence(seq16, seq32)
        positions.append(len(seq32) if j is None else j)
        if j is not None:
            gaps.append(gaps32[j])
    return {"hf_bf16_exact": sum(p == len(r[0]) for p, r in zip(positions, refs32, strict=True)),
            "hf_bf16_first_diff_p50": float(np.median(positions)),
            "hf_bf16_diffs": len(gaps),
            "hf_bf16_max_gap": round(max(gaps), 4) if gaps else None,
            "tie": round(max([floor, *gaps]), 4)}


# A first difference at a float32 gap beyond HF bf16's largest is not by itself an error: if
# our bf16 rounding is as noisy as HF's, our gaps and HF's come from one distribution, and our
# largest exceeds HF's largest half the time (18 prompts each). What that null hypothesis
# makes unlikely is MANY of ours beyond HF's largest: the chance that k of our n first
# differences all rank above HF's m is C(n, k) / C(n + m, k) (0.5, 0.24, 0.11, 0.05 for k = 1..4
# at n = m = 18). judge_bf16 fails below BF16_BEYOND_P, and on any first difference past
# BF16_OUTLIER x the tie (a wrong kernel diverges where float32's choice is clear, at gaps
# many times HF bf16's).
BF16_BEYOND_P = 0.05
BF16_OUTLIER = 2.0


def beyond_max_p(n_ours: int, n_hf: int, k: int) -> float:
    """P(at least k of n_ours exchangeable draws exceed the largest of n_hf others)."""
    if k <= 0:
        return 1.0
    if n_hf == 0 or k > n_ours:
        return 0.0
    return math.comb(n_ours, k) / math.comb(n_ours + n_hf, k)


def judge_bf16(results, refs32, noise: dict) -> dict:
    """tally() against HF float32 with the noise's tie; first differences beyond the tie are
    allowed as far as HF bf16's own spread explains them (above), none past BF16_OUTLIER x
    the tie; and the median first difference no earlier than half of HF bf16's (a real
    error diverges early on every prompt)."""
    verdicts: list = []
    verdict = tally(results, refs32, noise["tie"], verdicts)
    firsts = [v for v in verdicts if v.get("position") is not None]
    beyond = [v["gap"] for v in firsts if v["verdict"] == "mismatch"]
    p_beyond = beyond_max_p(len(firsts), noise.get("hf_bf16_diffs", 0), len(beyond))
    outliers = [g for g in beyond if g > BF16_OUTLIER * noise["tie"]]
    # tally's own "ok" counts every gap beyond the tie; here only errors, wrong lengths,
    # outliers and an unlikely count of beyond-tie first differences fail.
    wrong_length = verdict["mismatched"] - len(beyond)
    positions = [len(ref) if (j := first_divergence(r, ref)) is None else j
                 for r, (ref, _) in zip(results, refs32, strict=True)
                 if not isinstance(r, Exception)]
    ours = float(np.median(positions)) if positions else 0.0
    early = ours < 0.5 * noise["hf_bf16_first_diff_p50"]
    ok = (verdict["errors"] == 0 and wrong_length == 0 and not outliers
          and p_beyond >= BF16_BEYOND_P and not early)
    return {**verdict, "ok": ok, "beyond_tie": len(beyond),
            "beyond_tie_p": round(p_beyond, 4), "outliers": outliers, "first_diff_p50": ours,
            **{k: v for k, v in noise.items() if k != "tie"}}


def check_bf16_migration(args) -> bool:
    prompts = make_prompts(args.per_length, args.lengths, args.prompt_vocab)
    # One load per dtype: greedy references, then the teacher-forced scores of each prompt
    # followed by float32's greedy continuation.
    with hf_model(args.model_dir, "float32", args.hf_device) as model:
        refs = hf_generate(model, prompts, args.max_tokens, args.hf_device)
        forced = [p + ref[:args.max_tokens // 2]
                  for p, (ref, _) in zip(prompts, refs, strict=True)]
        forced32 = hf_token_logprobs(model, forced, args.hf_device)
    with hf_model(args.model_dir, "bfloat16", args.hf_device) as model:
        refs16 = hf_generate(model, prompts, args.max_tokens, args.hf_device)
        forced16 = hf_token_logprobs(model, forced, args.hf_device)
    noise = bf16_noise(refs16, refs, args.bf16_tie)
    argv = serve_argv(args.model_dir, "--executors", "2", "--dtype", "bfloat16",
                      "--gpu-memory-utilization", "0.4", *device_args(args))
    ok = True
    with ServeProcess(argv, Path(args.log_dir) / "bf16-migration.log") as server:
        client = Client(server.address)
        status = client.status()
        blocks = {e.id: (e.num_gpu_blocks, e.num_cpu_blocks) for e in status.executors}
        gpu = [g for g, _ in blocks.values()]
        # Same model, same share: each executor sized for itself, not for its neighbour.
        shared = len(blocks) == 2 and min(gpu) > 0 and min(gpu) >= 0.9 * max(gpu)
        ok &= shared
        emit("two_executors_at_0.4", ok=shared, executors=len(blocks), num_gpu_blocks=gpu,
             num_cpu_blocks=[c for _, c in blocks.values()])
        results = client.stream_all(prompts, args.max_tokens)
        first = judge_bf16(results, refs, noise)
        ok &= first["ok"]
        same16 = tally(results, refs16, 0.0)["matched"]
        emit("bf16_equivalence", requests=len(prompts), max_tokens=args.max_tokens, **first,
             equal_to_hf_bf16=same16)
        drift = logprob_drift(client, forced, forced32, forced16)
        ok &= drift["ok"]
        emit("bf16_logprob_drift", sequences=len(forced), **drift)

        killed: dict = {}

        def kill_one() -> None:
            running = {e.id: e.running for e in client.status().executors}
            pids = server.executor_pids()
            victim = max(pids, key=lambda eid: (running.get(eid, 0), eid))
            killed.update(id=victim, pid=pids[victim], running=running.get(victim, 0))
            os.kill(pids[victim], signal.SIGKILL)

        before = metric_sum(server.metrics(), "pagedserve_migrations_total")
        start = time.perf_counter()
        second = judge_bf16(client.stream_all(prompts, args.max_tokens, on_first=kill_one),
                            refs, noise)
        migrated = metric_sum(server.metrics(), "pagedserve_migrations_total") - before
        health = {e.id: e.healthy for e in client.status().executors}
        survivor_free = client.wait_all_free()
        mig_ok = (second["ok"] and migrated > 0 and health.get(killed.get("id")) is False
                  and survivor_free)
        ok &= mig_ok
        emit("migration_sigkill", **{**second, "ok": mig_ok}, migrated=migrated,
             killed=killed, healthy=health, survivor_blocks_free=survivor_free,
             wall_s=round(time.perf_counter() - start, 2))
        client.close()
    return ok


def check_fp32(args) -> bool:
    prompts = make_prompts(args.per_length, args.lengths, args.prompt_vocab, seed=1)
    refs = hf_references(args.model_dir, prompts, args.max_tokens, "float32", args.hf_device)
    argv = serve_argv(args.model_dir, "--executors", "1", "--dtype", "float32",
                      *device_args(args))
    with ServeProcess(argv, Path(args.log_dir) / "fp32-exact.log") as server:
        client = Client(server.address)
        result = tally(client.stream_all(prompts, args.max_tokens), refs, args.fp32_tie)
        client.close()
    emit("fp32_equivalence", requests=len(prompts), max_tokens=args.max_tokens, **result)
    return result["ok"]


def check_preemption(args, mode: str) -> bool:
    prompts = make_prompts(args.per_length, args.lengths, args.prompt_vocab, seed=2)
    refs = hf_references(args.model_dir, prompts, args.max_tokens, "float32", args.hf_device)
    block_size = 16
    need = [-(-(len(p) + args.max_tokens) // block_size) for p in prompts]
    # About 40% of what all requests hold at their peak, never less than the largest one.
    num_blocks = max(max(need) + 2, int(0.4 * sum(need)))
    swap = ["--swap-space", "0.5"] if mode == "swap" else ["--swap-space", "0"]
    argv = serve_argv(args.model_dir, "--executors", "1", "--dtype", "float32",
                      "--num-gpu-blocks", str(num_blocks), "--preemption-mode", mode, *swap,
                      *device_args(args))
    with ServeProcess(argv, Path(args.log_dir) / f"preempt-{mode}.log") as server:
        client = Client(server.address)
        result = tally(client.stream_all(prompts, args.max_tokens), refs, args.fp32_tie)
        text = server.metrics()
        counts = {m: metric_sum(text, "pagedserve_preemptions_total", mode=m)
                  for m in ("swap", "recompute")}
        free = client.wait_all_free()
        status = client.status().executors[0]
        cpu_free = status.num_free_cpu_blocks == status.num_cpu_blocks
        client.close()
    counted = counts[mode] > 0 and (mode == "swap" or counts["swap"] == 0)
    ok = result["ok"] and counted and free and cpu_free
    emit(f"preempt_{mode}", **{**result, "ok": ok}, requests=len(prompts),
         num_gpu_blocks=num_blocks, blocks_needed=sum(need), preemptions=counts,
         blocks_free_after=free, cpu_blocks_free_after=cpu_free)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("check", choices=["bf16-migration", "fp32-exact", "preempt-swap",
                                      "preempt-recompute"])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--log-dir", default="cluster-logs")
    ap.add_argument("--small", action="store_true", help="CPU executors, fewer requests")
    ap.add_argument("--per-length", type=int, default=None, help="prompts per length group")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--bf16-tie", type=float, default=0.5,
                    help="the least bf16 tie: float32 top-2 logit gap under which a first "
                    "difference of bf16 from float32 is a tie (raised to HF bf16's own)")
    ap.add_argument("--fp32-tie", type=float, default=2e-3)
    args = ap.parse_args(argv)
    args.lengths = PROMPT_LENGTHS if not args.small else (13, 37)
    args.per_length = args.per_length or (2 if args.small else 6)
    args.max_tokens = args.max_tokens or (40 if args.small else 128)
    args.hf_device = "cpu" if args.small else "cuda"
    args.prompt_vocab = 500  # below the tiny tokenizer's size: ids that also decode
    checks = {"bf16-migration": check_bf16_migration, "fp32-exact": check_fp32,
              "preempt-swap": lambda a: check_preemption(a, "swap"),
              "preempt-recompute": lambda a: check_preemption(a, "recompute")}
    try:
        ok = checks[args.check](args)
    except Exception as exc:  # one line for the report, the traceback for the log
        import traceback
        traceback.print_exc()
        emit(args.check.replace("-", "_"), ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
