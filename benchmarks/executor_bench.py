"""Executor step benchmark (DESIGN §8): one JSON object per line on stdout.

Cases:
* ``cpu_tiny_decode_b{1,32,128}``: decode step time of the tiny random Llama (tinymodels
  defaults, fp32, --cpu-threads 1) at context ~128, through ModelRunner.execute (plan
  handling + forward + sampling, the executor's whole step minus the socket);
* ``gpu_qwen2.5-0.5b_decode_b{64,256}`` (CUDA only, else one ``skipped`` line): decode
  tokens/s of a random-weight Qwen2.5-0.5B-shaped model (bf16) at context 1k, next to the
  bandwidth bound ``batch / ((weight bytes + KV bytes read) / measured copy bandwidth)``.
  With ``--model-dir`` the model is that directory loaded as the executor loads it (the GPU
  check builds a random-weight Qwen2.5-0.5B-shape one: scripts/gpu_steps.py build-model);
  without, the same shape is initialised in place on the device.
* ``gpu_qwen2.5-0.5b_decode_b{1,8}`` and ``..._b{1,8,64,256}_graphs``: the same at batch
  1 and 8, and each batch with the decode step replayed as a CUDA graph
  (executor/cuda_graphs.py; only that batch size captured) instead of launched eagerly.
  These time each step alone (execute, then a device sync).
* ``gpu_qwen2.5-0.5b_pipelined_b{64,256}_graphs``: the same decodes (40 steps) through the
  executor's pipelined loop as in the gap cases below (plans marked ``feed_sampled``):
  the mean step period (the steps' window over their count; the p50 of the intervals
  between consecutive results beside it), tok/s and share of the bound from the mean, gap,
  forward and sampling p50 — the executor as `serve` runs it, without the router;
  ``..._b256_graphs_top_p`` with every row sampling at top-p 0.95 (all nuclei past the
  first 256 tokens on the random model: the sampler's whole-row kernel on every row), and
  ``..._top_p_sort`` with the sampler on the sort it replaced (a host read a step), and
  ``..._temperature`` with every row sampling at temperature 1 alone (the keyed draw:
  kernels/draw_ops.py on a GPU).
* ``gpu_qwen2.5-0.5b_serve_loop_b{64,256}_graphs``: the same 40 decodes through the
  executor process's waiting rule (executor_steps.serve_loop_steps): the pipelined loop
  above reads the step in flight back as soon as the next plan is not decoded yet, which
  serialised every other step on an H200 (2026-11-27 trace); this one waits for the plan
  or the device's end of the step, whichever comes first, as `serve` does.
  ``..._serve_loop_b{64,256}_graphs_unfed``: the same with the graphs' staged feed off
  (executor/graph_feed.py: each input copied into the graphs' buffers on its own, as
  before the fifteenth session), right after: the feed's A/B on one warm machine.
* ``gpu_qwen2.5-0.5b_mixed_b{64,256}_chunk256``: the same decodes with a 256-token prompt
  computed in every step (a stream ending and the next starting, steadily), eagerly, and
  ``..._pieces`` through the graph pieces cut at the attention calls
  (executor/mixed_graphs.py, as `serve` runs such steps); step time against the graphed
  decode step.

* ``cpu_tiny_gap_b{32,256}`` (``--gap`` only: not in the default run): the executor's gap
  between decode steps (``StepResult.gap_s``, from the end of a step's sampling to the
  next forward) in the executor's pipelined loop without sockets: the `pagedserve serve`
  tiny model (``--model tiny``), 16-token prompts, then greedy decodes; plan N+1 is built
  before step N runs (its decodes marked ``feed_sampled``, as the router pipelines), and
  a second thread decodes it from MessagePack and runs ``ModelRunner.precompute`` once
  step N's forward starts (``before_forward``, where the executor's I/O thread does it),
  encoding the previous result there too. Figures: gap p50/p90/p99, forward p50, and a
  checksum of the sampled tokens (equal before and after a host-side change).

* ``--profile``: after the timed cases, the largest batch's decode steps once more under
  torch.profiler (``profile_gpu_b256_{eager,graphs}``; on CPU ``profile_cpu_tiny_b128``):
  per step, how many device kernels ran and how long they took together, and the kernels
  that took the most (name, launches and microseconds per step). What splits a step
  between attention, matmuls and the small elementwise kernels (the GPU check runs it);
  on a GPU also batch 8's graph steps (``profile_gpu_b8_graphs``, the top 20): a
  low-concurrency step's kernels.
  Then under cProfile (``host_profile_gpu_b256_{eager,graphs}``, ``host_profile_cpu_tiny_b128``):
  the host's functions by own time per step — where an eager step's ~12 ms of host time on
  the H200 went (Triton's launcher, torch operators, pagedserve's Python). And
  (``trace_gpu_b256_{pipelined,serve_loop}``, graphs) each pipelined loop under torch.profiler
  (benchmarks/executor_trace.py): the host's phases per step against the device's busy and
  idle time, and the host phase each idle stretch of the device began and ended in; with
  ``--trace-dir`` its Chrome trace (gzip). And the mixed steps with the graph pieces at
  batch 64 and 256 (``profile_mixed``: ``profile_gpu_b{64,256}_mixed_chunk256_pieces``,
  ``host_profile_...`` and ``serve_loop_...``; on CPU ``..._cpu_tiny_b32_mixed_chunk32``):
  on the H100 (2026-11-28) such a step took 5.3 ms against 1.8 of a batch-64 decode
  step, without saying how much of it was the device's.

Sequences enter as take-overs: a NewRequest with a full prompt whose keys/values are
already "in the cache" (random), so no prefill is timed or needed (not in the gap cases).

    .venv/bin/python benchmarks/executor_bench.py [--steps N] [--cpu-only] [--gpu-only]
        [--model-dir DIR] [--gap [--gap-steps N]] [--profile [--trace-dir DIR]]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from pagedserve.executor.cache_engine import CacheEngine
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.mixed_graphs import MixedGraphs
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.models import LlamaForCausalLM, ModelConfig
from pagedserve.executor.runner_setup import build_runner
from pagedserve.kernels.kv_dtypes import (
    KV_CACHE_DTYPE_CHOICES,
    kv_dtype_name,
    resolve_kv_cache_dtype,
)
from pagedserve.protos.wire import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # executor_steps, also PYTHONSAFEPATH
from executor_profile import (  # noqa: E402
    emit,
    fresh_runner,
    host_profile_steps,
    profile_mixed,
    profile_steps,
)
from executor_steps import (  # noqa: E402
    decode_plans,
    mixed_plans,
    pipelined_decode_plans,
    pipelined_steps,
    randomise_cache,
    serve_loop_steps,
    time_steps,
)
from executor_trace import trace_pipelined  # noqa: E402

TRACE_STEPS = 20  # the pipelined trace's steps (3 of them warm-up)


def emit_loop(case: str, run: dict, batch: int, context: int, bound_s: float) -> None:
    """A pipelined loop's figures (executor_steps): the mean step period, tok/s and share of
    the bound from it, and the p50 of the intervals, gap, forward and sampling."""
    period = statistics.fmean(run["periods"])
    emit(case, batch=batch, context_tokens=context, step_us_mean=round(period * 1e6, 1),
         interval_us_p50=round(statistics.median(run["periods"]) * 1e6, 1),
         decode_tok_per_s=round(batch / period, 1), of_bound_ratio=round(bound_s / period, 3),
         gap_us_p50=round(statistics.median(run["gaps"]) * 1e6, 1),
         forward_us_p50=round(statistics.median(run["forwards"]) * 1e6, 1),
         sample_us_p50=round(statistics.median(run["samples"]) * 1e6, 1),
         steps=len(run["periods"]), cuda_graphs=True)


def bench_cpu(steps: int, profile: bool = False, trace_dir: str | None = None) -> None:
    from pagedserve.tinymodels import build_model

    torch.set_num_threads(1)
    context, block_size = 128, 16
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(tmp + "/tiny", "llama")
        for batch in (1, 32, 128):
            num_blocks = batch * ((context + steps + block_size) // block_size)
            runner = build_runner(str(model_dir), num_gpu_blocks=num_blocks, num_cpu_blocks=0,
                                  block_size=block_size, progress=False)
            times = time_steps(runner, decode_plans(batch, context, block_size, steps,
                                                    runner.vocab_size))
            p50 = statistics.median(times)
            emit(f"cpu_tiny_decode_b{batch}", batch=batch, context_tokens=context,
                 step_us_p50=round(p50 * 1e6, 1), decode_tok_per_s=round(batch / p50, 1),
                 threads=1, device="cpu")
            if profile and batch == 32:
                chunk = 32
                blocks = num_blocks + 2 * (chunk // block_size)

                new_runner = functools.partial(build_runner, str(model_dir),
                                               num_gpu_blocks=blocks, num_cpu_blocks=0,
                                               block_size=block_size, progress=False)
                plans = functools.partial(mixed_plans, batch, context, chunk, block_size,
                                          steps, runner.vocab_size)
                profile_mixed(new_runner, plans, plans, f"cpu_tiny_b{batch}_mixed_chunk{chunk}",
                              p50, batch=batch, context_tokens=context, prefill_tokens=chunk)
            if profile and batch == 128:
                runner = build_runner(str(model_dir), num_gpu_blocks=num_blocks,
                                      num_cpu_blocks=0, block_size=block_size, progress=False)
                profile_steps(runner, decode_plans(batch, context, block_size, steps,
                                                   runner.vocab_size), "profile_cpu_tiny_b128")
                host_profile_steps(runner, decode_plans(batch, context, block_size, steps,
                                                        runner.vocab_size),
                                   "host_profile_cpu_tiny_b128")
                runner = build_runner(str(model_dir), num_gpu_blocks=num_blocks,
                                      num_cpu_blocks=0, block_size=block_size, progress=False)
                emit("trace_cpu_tiny_b128_pipelined", **trace_pipelined(
                    runner, decode_plans(batch, context, block_size, steps, runner.vocab_size,
                                         feed=True), warmup=3, trace_dir=trace_dir,
                    case="trace_cpu_tiny_b128_pipelined"))


def bench_gap(steps: int) -> None:
    """The ``cpu_tiny_gap_b*`` cases (module docstring)."""
    from pagedserve.models import ensure_tiny_model

    torch.set_num_threads(1)
    for batch in (32, 256):
        gaps, forwards, crc = _gap_case(str(ensure_tiny_model()), batch, steps)
        gaps.sort()

        def q(values: list[float], p: float) -> float:
            return round(values[min(len(values) - 1, int(p * len(values)))] * 1e3, 4)

        emit(f"cpu_tiny_gap_b{batch}", batch=batch, steps=len(gaps), gap_ms_p50=q(gaps, 0.5),
             gap_ms_p90=q(gaps, 0.9), gap_ms_p99=q(gaps, 0.99),
             forward_ms_p50=round(statistics.median(forwards) * 1e3, 3), tokens_crc32=crc,
             threads=1, device="cpu")


def _gap_case(model_dir: str, batch: int, steps: int,
              warmup: int = 5) -> tuple[list[float], list[float], str]:
    """(gap_s and forward_s of the steps after ``warmup``, crc32 of every sampled token)."""
    prompt_len, block_size = 16, 16
    runner = build_runner(model_dir, num_gpu_blocks=batch * ((prompt_len + steps) // 16 + 3),
                          num_cpu_blocks=0, block_size=block_size, max_model_len=1024,
                          progress=False)
    run = pipelined_steps(runner, pipelined_decode_plans(
        batch, prompt_len, block_size, steps, runner.vocab_size), warmup)
    return run["gaps"], run["forwards"], run["tokens_crc32"]


def qwen25_05b_config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        rms_norm_eps=1e-6, max_model_len=32768, tie_word_embeddings=True, qkv_bias=True,
        o_bias=False, mlp_bias=False, qk_norm=False, rope_theta=1e6, torch_dtype="bfloat16",
    )


def copy_bandwidth_bytes_per_s(device, num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * 10 / (time.perf_counter() - t0)  # read + write


def bench_gpu(steps: int, model_dir: str | None = None, profile: bool = False,
              trace_dir: str | None = None, kv_cache_dtype: str = "auto") -> None:
    if not torch.cuda.is_available():
        emit("gpu_qwen2.5-0.5b_decode", skipped="no CUDA device")
        return
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    if model_dir:
        from pagedserve.executor.models import load_config, load_model

        cfg = load_config(model_dir)
        model = load_model(model_dir, dtype, device, cfg, progress=False)
    else:
        cfg = qwen25_05b_config()
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model = model.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        model.cos_sin_cache = LlamaForCausalLM.rope_cache(cfg).to(device)
        model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth_bytes_per_s(device)
    context, block_size = 1024, 16
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    kv_bytes_per_token = (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                          * kv_dtype.itemsize)
    pipelined_steps_n = max(steps, 40)
    blocks_per_seq = (context + pipelined_steps_n + block_size) // block_size
    cases = [(64, False), (256, False), (1, False), (8, False),
             (1, True), (8, True), (64, True), (256, True)]
    mixed_chunk = 256
    for batch, graphed in cases:
        num_blocks = batch * blocks_per_seq + 2 * (mixed_chunk // block_size)
        cache = CacheEngine(cfg, block_size, num_blocks, 0, kv_dtype, device)
        randomise_cache(cache.kv_cache)
        graphs = None
        if graphed:
            graphs = DecodeGraphs(model, cache.kv_cache, block_size,
                                  blocks_per_seq * block_size, batch)
            graphs.capture([batch])
            wrong = graphs.check_feed()  # as an executor checks at start (runner_setup.py)
            assert not wrong, wrong
        runner = ModelRunner(model, cache, graphs=graphs)
        times = time_steps(runner, decode_plans(batch, context, block_size, steps,
                                                cfg.vocab_size))
        assert runner.graph_steps == (steps if graphed else 0), runner.graph_steps
        p50 = statistics.median(times)
        bytes_read = weight_bytes + batch * (context + steps // 2) * kv_bytes_per_token
        bound_s = bytes_read / bandwidth
        suffix = "_graphs" if graphed else ""
        emit(f"gpu_qwen2.5-0.5b_decode_b{batch}{suffix}", batch=batch, context_tokens=context,
             step_us_p50=round(p50 * 1e6, 1), decode_tok_per_s=round(batch / p50, 1),
             bound_tok_per_s=round(batch / bound_s, 1), of_bound_ratio=round(bound_s / p50, 3),
             weight_bytes=weight_bytes, kv_read_bytes=bytes_read - weight_bytes,
             copy_bandwidth_gb_per_s=round(bandwidth / 1e9, 1),
             device=torch.cuda.get_device_name(device),
             model="loaded" if model_dir else "initialised in place",
             cuda_graphs=graphed, kv_cache_dtype=kv_dtype_name(kv_dtype))
        if graphed and batch in (64, 256):
            # One 256-token prompt joins the decodes in every step: the executor runs such
            # a step eagerly (its graphs are decode-only), as a server does whenever a
            # stream ends and the next starts.
            # Eagerly, and with the graph pieces cut at the attention calls (mixed_graphs.py).
            pieces = MixedGraphs(model, cache.kv_cache, batch + mixed_chunk)
            pieces.capture()
            for suffix, mixed_graphs in (("", None), ("_pieces", pieces)):
                randomise_cache(cache.kv_cache)
                runner = ModelRunner(model, cache, graphs=graphs, mixed_graphs=mixed_graphs)
                times = time_steps(runner, mixed_plans(batch, context, mixed_chunk,
                                                       block_size, steps, cfg.vocab_size))
                mixed = statistics.median(times)
                emit(f"gpu_qwen2.5-0.5b_mixed_b{batch}_chunk{mixed_chunk}{suffix}",
                     batch=batch, context_tokens=context, prefill_tokens=mixed_chunk,
                     step_us_p50=round(mixed * 1e6, 1),
                     vs_decode_graph_step_ratio=round(mixed / p50, 3),
                     mixed_graph_steps=runner.mixed_graph_steps, steps=len(times),
                     pieces_capture_s=round(pieces.capture_s, 2) if mixed_graphs else None)
            if profile:
                plans = functools.partial(mixed_plans, batch, context, mixed_chunk, block_size)
                profile_mixed(functools.partial(fresh_runner, model, cache, graphs, pieces),
                              functools.partial(plans, steps, cfg.vocab_size),
                              functools.partial(plans, pipelined_steps_n, cfg.vocab_size),
                              f"gpu_b{batch}_mixed_chunk{mixed_chunk}_pieces", p50,
                              batch=batch, context_tokens=context, prefill_tokens=mixed_chunk)
            del pieces, mixed_graphs
        # The same decode in the executor's own pipelined loop (plan N+1 decoded and
        # prepared on the I/O thread during step N, marked decodes fed on the device's
        # side): the step period serving sees, against the synchronous steps above. At
        # batch 256 also with every row sampling at top-p 0.95: the random model's rows are
        # flat, so every nucleus reaches past its best 256 tokens, with the sampler's
        # whole-row kernel and with the sort it replaced (its host read waits for the
        # forward: the overlap lost).
        pipelined = [("", None, "auto")] if graphed and batch in (64, 256) else []
        if graphed and batch == 256:
            top_p = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
            pipelined += [("_top_p", top_p, "auto"), ("_top_p_sort", top_p, "torch"),
                          # temperature alone (the OpenAI API's default top_p is 1): the
                          # keyed draw after the division, the sampler's plainest random row
                          ("_temperature", SamplingParams(temperature=1.0, seed=7), "auto")]
        for suffix, sampling, sampler_backend in pipelined:
            randomise_cache(cache.kv_cache)
            runner = ModelRunner(model, cache, graphs=graphs)
            runner.sampler.kernel_backend = sampler_backend
            run = pipelined_steps(runner, decode_plans(batch, context, block_size,
                                                       pipelined_steps_n, cfg.vocab_size,
                                                       feed=True, sampling=sampling), warmup=3)
            # Throughput from the mean period (the window over the steps): results come
            # out in bursts (one collected when the next plan is late, then one at the next
            # launch), so the intervals' median can be far below the mean — on an H200 it
            # was 1.6 ms at batch 256 against a 2.3 ms forward (2026-11-27).
            emit_loop(f"gpu_qwen2.5-0.5b_pipelined_b{batch}_graphs{suffix}", run, batch,
                      context, bound_s)
        if graphed and batch in (64, 256):
            # The same through the executor process's waiting rule (serve_loop_steps): no
            # read-back of the step in flight just because the next plan is still being
            # decoded (the loop above does that, and serialises every other step).
            # Then with the graph's inputs copied buffer by buffer (``_unfed``: the same
            # graphs, their feed turned off as the start-up check would), back to back.
            for suffix, feeds in (("", graphs.feeds), ("_unfed", False)):
                randomise_cache(cache.kv_cache)
                fed_before, graphs.feeds = graphs.feeds, feeds
                runner = ModelRunner(model, cache, graphs=graphs)
                run = serve_loop_steps(runner, decode_plans(batch, context, block_size,
                                                            pipelined_steps_n, cfg.vocab_size,
                                                            feed=True), warmup=3)
                graphs.feeds = fed_before
                emit_loop(f"gpu_qwen2.5-0.5b_serve_loop_b{batch}_graphs{suffix}", run, batch,
                          context, bound_s)
        if profile and graphed and batch == 8:
            # A small batch's device kernels: its forward takes ~1.25 ms on an H200 (the
            # pipelined b64 case, step_overhead at 32 streams) against ~0.24 ms of weight
            # reads: which kernels hold a low-concurrency step's latency.
            randomise_cache(cache.kv_cache)
            runner = ModelRunner(model, cache, graphs=graphs)
            profile_steps(runner, decode_plans(batch, context, block_size, steps,
                                               cfg.vocab_size), f"profile_gpu_b{batch}_graphs",
                          top=20)
        if profile and batch == 256:
            randomise_cache(cache.kv_cache)
            runner = ModelRunner(model, cache, graphs=graphs)
            mode = "graphs" if graphed else "eager"
            profile_steps(runner, decode_plans(batch, context, block_size, steps,
                                               cfg.vocab_size), f"profile_gpu_b{batch}_{mode}")
            host_profile_steps(runner, decode_plans(batch, context, block_size, steps,
                                                    cfg.vocab_size),
                               f"host_profile_gpu_b{batch}_{mode}")
            # The pipelined loops' period: host phases against device idle.
            loops = (("pipelined", pipelined_steps), ("serve_loop", serve_loop_steps))
            for name, loop in loops if graphed else ():
                randomise_cache(cache.kv_cache)
                runner = ModelRunner(model, cache, graphs=graphs)
                case = f"trace_gpu_b{batch}_{name}"
                emit(case, **trace_pipelined(
                    runner, decode_plans(batch, context, block_size, TRACE_STEPS,
                                         cfg.vocab_size, feed=True),
                    warmup=3, trace_dir=trace_dir, case=case, loop=loop))
        del cache, runner, graphs
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--model-dir", default=None,
                        help="GPU cases: load this model directory (bf16) instead")
    parser.add_argument("--gap", action="store_true",
                        help="only the cpu_tiny_gap_b* cases (the gap between decode steps)")
    parser.add_argument("--gap-steps", type=int, default=100)
    parser.add_argument("--profile", action="store_true",
                        help="also profile the largest batch's steps (kernels per step)")
    parser.add_argument("--kv-cache-dtype", default=os.environ.get(
        "PAGEDSERVE_KV_CACHE_DTYPE", "auto"), choices=KV_CACHE_DTYPE_CHOICES,
        help="GPU cases: the KV cache's dtype (default $PAGEDSERVE_KV_CACHE_DTYPE, else "
             "auto: the model's bf16); the bound counts its bytes")
    parser.add_argument("--trace-dir", default=None,
                        help="with --profile: write the pipelined trace's Chrome trace here")
    args = parser.parse_args(argv)
    if args.gap:
        bench_gap(args.gap_steps)
        return 0
    if not args.gpu_only:
        bench_cpu(args.steps, args.profile, args.trace_dir)
    if not args.cpu_only:
        bench_gpu(args.steps, args.model_dir, args.profile, args.trace_dir,
                  args.kv_cache_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
