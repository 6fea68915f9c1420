"""What each stage of the GPU check runs (scripts/gpu_check.py runs them, keeps the report
and prints the summaries): its steps, their commands, time limits and environments."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("kernels", "executor", "cluster", "throughput")


@dataclass(frozen=True)
class Step:
    """One command of a stage. `reads`: what its output holds ("jsonl" benchmark lines,
    "pytest" a pytest run). `required`: the stage stops when this step fails."""

    name: str
    argv: list[str]
    timeout_s: float
    reads: str = "jsonl"
    required: bool = False
    env: dict = field(default_factory=dict)  # added to the stage's environment


@dataclass
class Context:
    out_dir: Path
    work_dir: Path
    python: str = sys.executable
    small: bool = False
    site: Path | None = None  # target folder of the installs, None: the environment as is
    env: dict = field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return self.work_dir / ("tiny-qwen2" if self.small else "qwen2.5-0.5b-random")


# --- stage plans --------------------------------------------------------------------------

def _py(ctx: Context, script: str, *args: str) -> list[str]:
    return [ctx.python, str(ROOT / script), *args]


def _common(ctx: Context) -> list[Step]:
    small = ["--small"] if ctx.small else []
    return [Step("env", _py(ctx, "scripts/gpu_steps.py", "env", *small), 120, required=True)]


def _model(ctx: Context) -> Step:
    args = ["build-model", "--out", str(ctx.model_dir)] + (["--small"] if ctx.small else [])
    return Step("build_model", _py(ctx, "scripts/gpu_steps.py", *args), 300, required=True)


def gpu_test_files() -> list[str]:
    """Test modules with tests marked `gpu`."""
    return sorted(str(p) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


# The rotary and the new token's cache write inside the decode attention launch is the
# default on a GPU (executor/models/llama.py, since the fourteenth session, checked to the
# bit at each executor's start): its A/B runs turn it off.
FUSED_ROPE_OFF = {"PAGEDSERVE_DECODE_FUSED_ROPE": "0"}
# A decode graph step's inputs through one staged copy that the graph scatters itself is the
# default (executor/graph_feed.py, fifteenth session): its A/B runs copy them buffer by buffer.
GRAPH_FEED_OFF = {"PAGEDSERVE_GRAPH_FEED": "0"}


def plan_stage(name: str, ctx: Context) -> list[Step]:
    small = ["--small"] if ctx.small else []
    model = ["--model-dir", str(ctx.model_dir)]
    if name == "kernels":
        # Compiling ~200 kernel variants is CPU work: spread it over workers when xdist is there.
        workers = [] if ctx.small or importlib.util.find_spec("xdist") is None else ["-n", "8"]
        # --durations: the slowest tests (setup included) into the report, to see what the
        # step's ~160 s of device time go to (the sixth run's 227 tests).
        pytest = [ctx.python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                  "--durations", "15", *workers, "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
                  *gpu_test_files()]
        # Every case but decode's and the sampler's (steps of their own): the grid, the
        # launch-configuration sweeps and the fused layer kernels.
        cases = ["--cases", "prefill,cache,layer,prefill_tune"
                 + ("" if ctx.small else ",tune")]
        bench = _py(ctx, "benchmarks/kernels_bench.py", *cases,
                    *(["--dry-run"] if ctx.small else []))
        # The decode cases and the rotary fused into the decode launch, in a step of their
        # own, to run alone when the device time is short.
        decode = _py(ctx, "benchmarks/kernels_bench.py", "--cases", "decode,decode_rope",
                     *(["--dry-run"] if ctx.small else []))
        # The decode kernel at contexts ending inside a tile (kernels_tail.py): the tail in
        # its own loop or the whole tiles' (decode_rules.MASK_EVERY_TILE), 64/128-token tiles.
        tail = _py(ctx, "benchmarks/kernels_bench.py", "--cases", "decode_tail",
                   *(["--dry-run"] if ctx.small else []))
        # A 1k context through a decode graph's table width (its splits from the width,
        # mostly empty at small batches) against its own (kernels_tail.py).
        wide = _py(ctx, "benchmarks/kernels_bench.py", "--cases", "decode_wide",
                   *(["--dry-run"] if ctx.small else []))
        # The decoder layer's projections under cuBLAS and cuBLASLt (kernels_gemm.py).
        gemm = _py(ctx, "benchmarks/kernels_bench.py", "--cases", "gemm",
                   *(["--dry-run"] if ctx.small else []))
        # The decode kernel on an fp8 KV cache beside bf16, and its tiles (kernels_fp8.py).
        fp8 = _py(ctx, "benchmarks/kernels_bench.py", "--cases", "decode_fp8",
                  *(["--dry-run"] if ctx.small else []))
        # The sampler's kernels alone (argmax; top-p by radix and by pieces a row).
        sampling = _py(ctx, "benchmarks/kernels_bench.py", "--cases", "sampling",
                       *(["--dry-run"] if ctx.small else []))
        return [*_common(ctx), Step("pytest_gpu", pytest, 330, reads="pytest"),
                Step("kernels_decode", decode, 240), Step("kernels_decode_tail", tail, 120),
                Step("kernels_decode_wide", wide, 90), Step("kernels_decode_fp8", fp8, 120),
                Step("kernels_gemm", gemm, 150),
                Step("kernels_sampling", sampling, 120), Step("kernels_bench", bench, 300)]
    if name == "executor":
        def executor_bench(traces: Path) -> list[str]:
            return _py(ctx, "benchmarks/executor_bench.py", *model,
                       *(["--cpu-only", "--steps", "6"] if ctx.small else ["--gpu-only"]),
                       "--profile", "--trace-dir", str(traces))

        traces = ctx.out_dir / "traces"
        memory = _py(ctx, "scripts/gpu_steps.py", "memory", *model, *small)
        # The A/B runs of the decode step's device time, each with its switch set and its
        # traces apart: the rotary and cache write as a launch of their own again (the
        # default fuses them into the attention launch); the projections through the
        # autotuned split-K Triton GEMM (its tuning, at every graph size, in the graphs'
        # warm-up), all four or the narrow two; torch preferring cuBLASLt for every matmul.
        variants = [("no_fused_rope", "no-fused-rope", FUSED_ROPE_OFF, 200),
                    ("triton_gemm", "triton-gemm", {"PAGEDSERVE_DECODE_TRITON_GEMM": "1"}, 300),
                    # only the narrow projections (few output tiles for cuBLAS): on the H200
                    # all four together lost 730 us of kernels a step (the sixth run)
                    ("triton_gemm_narrow", "triton-gemm-narrow",
                     {"PAGEDSERVE_DECODE_TRITON_GEMM": "qkv,o"}, 200),
                    # only the down projection, SiLU-and-multiply in its operand loads:
                    # the layer's SiLU launch and cuBLAS's split-K reduce (2 of its 9
                    # graph nodes, ~4.6 us a layer on the H200) against the GEMM's speed
                    ("triton_gemm_down", "triton-gemm-down",
                     {"PAGEDSERVE_DECODE_TRITON_GEMM": "down"}, 200),
                    ("cublaslt", "cublaslt", {"TORCH_BLAS_PREFER_CUBLASLT": "1"}, 200),
                    # a graph step's inputs copied buffer by buffer, as before the staged
                    # feed (executor/graph_feed.py, fifteenth session)
                    ("no_graph_feed", "no-graph-feed", GRAPH_FEED_OFF, 200),
                    # steps with prompt tokens: the leading decodes through the decode
                    # kernel, the prompts through the prefill kernel (two launches a
                    # layer; its mixed cases against the default's, eighteenth session)
                    ("mixed_decode_split", "mixed-decode-split",
                     {"PAGEDSERVE_MIXED_DECODE_SPLIT": "1"}, 200),
                    # an fp8 KV cache (--kv-cache-dtype fp8, twentieth session): half the
                    # KV bytes a step reads; its bound counts them
                    ("fp8_kv", "fp8-kv", {"PAGEDSERVE_KV_CACHE_DTYPE": "fp8"}, 200)]
        return [*_common(ctx), _model(ctx), Step("executor_bench", executor_bench(traces), 200),
                Step("memory_profile", memory, 150),
                *(Step(f"executor_bench_{name}", executor_bench(traces / folder), timeout,
                       env=env) for name, folder, env, timeout in variants)]
    if name == "cluster":
        def check(what: str, timeout_s: float) -> Step:
            return Step(what.replace("-", "_"),
                        _py(ctx, "scripts/gpu_cluster.py", what, *model, "--log-dir",
                            str(ctx.work_dir / "cluster-logs"), *small), timeout_s)
        return [*_common(ctx), _model(ctx), check("bf16-migration", 180),
                check("fp32-exact", 120), check("preempt-swap", 100),
                check("preempt-recompute", 100)]
    if name == "throughput":
        hf = _py(ctx, "benchmarks/hf_batch_bench.py", *model, *small)
        # The API edges in worker processes: on an H100 the router's CPU per step at 256
        # streams (10-15 ms) was what held the 3.8 ms steps back (2026-11-26).
        hf_workers = _py(ctx, "benchmarks/hf_batch_bench.py", *model, *small,
                         "--api-workers", "2")
        overhead = _py(ctx, "benchmarks/step_overhead.py", "--models", str(ctx.model_dir),
                       *(["--quick", "--depths", "2"] if ctx.small else
                         ["--running", "32,256", "--depths", "1,2", "--window-s", "5"]),
                       "--work-dir", str(ctx.work_dir / "step-overhead"))
        overhead_workers = _py(ctx, "benchmarks/step_overhead.py", "--models",
                               str(ctx.model_dir), "--api-workers", "2",
                               *(["--quick", "--depths", "2"] if ctx.small else
                                 ["--running", "32,256", "--depths", "2", "--window-s", "5",
                                  # streams over 8 connections: the kernel hands each
                                  # worker connections, not streams (benchmarks/README)
                                  "--client-channels", "8"]),
                               "--work-dir", str(ctx.work_dir / "step-overhead-workers"))
        def with_workers(folder: str, depth: int, running: str = "32,256",
                         extra: tuple[str, ...] = ()) -> list[str]:
            """step_overhead.py with 2 API workers and the streams over 8 client
            connections, at one pipeline depth."""
            return _py(ctx, "benchmarks/step_overhead.py", "--models", str(ctx.model_dir),
                       "--api-workers", "2",
                       *(["--quick", "--depths", str(depth)] if ctx.small else
                         ["--running", running, "--depths", str(depth), "--window-s", "5"]),
                       "--client-channels", "8", *extra,
                       "--work-dir", str(ctx.work_dir / folder))

        # The same with three plans in flight (--pipeline-depth 3): the round trip hidden
        # behind two forwards (on the H200, 2026-11-27, depth 2 left ~0.9 ms idle a step).
        overhead_depth3 = with_workers("step-overhead-depth3", 3)
        # The same at 256 streams with the executor's profiling window on
        # (executor/step_trace.py): 30 steps of the real serving loop under torch.profiler,
        # the trace and its summary (host phases, device idle by phase) in OUTDIR/traces.
        # Profiling slows those steps: read the step's figures from the run above.
        depth3_trace = with_workers("step-overhead-depth3-trace", 3, "256")
        # Four plans in flight: at 32 streams a forward (1.24 ms on the H200) is shorter
        # than the round trip, and depth 3 still left the device idle 0.34-0.58 ms a step.
        overhead_depth4 = with_workers("step-overhead-depth4", 4)
        trace_env = {"PAGEDSERVE_TORCH_PROFILER_DIR": str(ctx.out_dir / "traces" / "serve-depth3"),
                     "PAGEDSERVE_TORCH_PROFILER_STEPS": "20:10" if ctx.small else "300:30"}
        # Depth 4 at 32 streams with the profiling window: where the 0.23 ms the device
        # still idles a step goes (host phases against a 1.26 ms forward; the sixth run).
        depth4_trace32 = with_workers("step-overhead-depth4-trace32", 4, "32")
        trace32_env = {**trace_env, "PAGEDSERVE_TORCH_PROFILER_DIR":
                       str(ctx.out_dir / "traces" / "serve-depth4-32")}
        # 256 streams with the workers again, the clients in 4 processes: is one client
        # process's event loop what held output_tok_per_s under trace_tok_per_s (the H200:
        # 32.6k of 56.3k)? Read it against step_overhead_workers' 256-stream line.
        overhead_procs = with_workers("step-overhead-client-procs", 2, "256",
                                      ("--client-procs", "4"))
        # 256 streams with the workers, the router's decode lane off (the ninth session's
        # columns for steady decodes): what the lane buys on this host's cores.
        no_lane = with_workers("step-overhead-no-lane", 2, "256")
        # The same executors one step at a time (overlapped steps off): their effect.
        one_at_a_time = _py(ctx, "benchmarks/step_overhead.py", "--models",
                            str(ctx.model_dir),
                            *(["--quick", "--depths", "2"] if ctx.small else
                              ["--running", "32,256", "--depths", "2", "--window-s", "5"]),
                            "--work-dir", str(ctx.work_dir / "step-overhead-one-at-a-time"))
        # Streams ending and starting steadily: the steps with prompt tokens, replayed as
        # graph pieces and (PAGEDSERVE_MIXED_GRAPHS=0) eagerly.
        steady = _py(ctx, "benchmarks/steady_serving.py", *model, *small,
                     "--log-dir", str(ctx.work_dir / "steady-serving"))
        # The router engine's CPU a step on this host's cores (no GPU involved): what the
        # CPU machine's figures scale by here.
        engine_args = ["--streams", "8", "--steps", "100", "--window", "50"] if ctx.small \
            else ["--steps", "1000"]
        engine = _py(ctx, "benchmarks/engine_bench.py", *engine_args)
        # ... with the API workers' forwarding channels (as the `--api-workers 2` runs)
        engine_hub = _py(ctx, "benchmarks/engine_bench.py", *engine_args, "--sink", "hub")
        # ... profiled at 256 streams (the H200 host ran the hub case 2x this VM's time a
        # step, the null sink 1.2x: where does it go there?)
        engine_profile = _py(ctx, "benchmarks/engine_bench.py", *engine_args, "--sink", "hub",
                             *([] if ctx.small else ["--streams", "256"]), "--profile")
        # ... with requests ending and starting, about one a step (the serving case)
        engine_churn = _py(ctx, "benchmarks/engine_bench.py", *engine_args, "--churn")
        # The executor's host work on this host's cores, on a virtual device (no GPU
        # involved; benchmarks/executor_host.py): its ceiling with an instant device and
        # whether it keeps an H200-speed one busy, against the CPU machine's figures.
        executor_host = _py(ctx, "benchmarks/executor_host.py", "--depths", "4",
                            *(["--rows", "8", "--steps", "80", "--warmup", "20"]
                              if ctx.small else ["--rows", "32,256"]))
        # ... and the executor process alone on the GPU with the model (no router, no API
        # edges): does it keep the device busy at 32 streams by itself? (The sixth run's
        # step_overhead idled 0.43 ms a step there with the router in the loop.)
        executor_host_cuda = _py(ctx, "benchmarks/executor_host.py", "--depths", "4",
                                 "--model-dir", str(ctx.model_dir),
                                 *(["--device", "cpu", "--rows", "8", "--steps", "80",
                                    "--warmup", "20"] if ctx.small else
                                   ["--device", "cuda", "--rows", "32,256"]))
        # What a step's read-back objects (timing events, the tokens' pinned buffer) cost
        # this host made fresh against reused (executor/host_pool.py; no model, seconds).
        host_sync = _py(ctx, "benchmarks/host_sync_bench.py",
                        *(["--calls", "200"] if ctx.small else []))
        # Beam search (twenty-third session): the router's search against the same search
        # driven one 1-token request per beam per step, on the GPU (a step is ~1-2 ms there,
        # a request's host cost weighs more than on the CPU machine's 70 ms steps).
        beam = _py(ctx, "benchmarks/beam_search_bench.py", "--model", str(ctx.model_dir),
                   *(["--widths", "2", "--concurrency", "1", "--max-tokens", "4"]
                     if ctx.small else ["--widths", "4,8", "--concurrency", "1,16",
                                        "--max-tokens", "64"]))
        # Offloading (twenty-fourth session): multi-turn conversations 3x the device's
        # blocks, their prefixes swapped back in over the bus against computed again, and
        # single-turn prompts that only pay the copies (on the CPU machine a swap-in is a
        # memcpy against a 1-thread prefill; here the prefill is fast and the bus is PCIe)
        offload = _py(ctx, "benchmarks/kv_offload_bench.py", "--model", str(ctx.model_dir),
                      "--device", "cpu" if ctx.small else "cuda", "--configs", "off,offload",
                      "--workloads", "multi_turn_3x,no_reuse",
                      *(["--scale", "0.05", "--output-tokens", "2", "--device-blocks", "24",
                         "--host-blocks", "72"] if ctx.small else []))
        return [*_common(ctx), _model(ctx), Step("steady_serving", steady, 150),
                Step("engine_bench", engine, 60),
                Step("engine_bench_hub", engine_hub, 60),
                Step("engine_bench_churn", engine_churn, 60),
                Step("executor_host", executor_host, 60),
                Step("executor_host_cuda", executor_host_cuda, 120),
                Step("host_sync", host_sync, 60),
                Step("engine_bench_hub_profile", engine_profile, 60),
                Step("hf_batch_bench", hf, 150),
                Step("step_overhead", overhead, 150),
                Step("hf_batch_bench_workers", hf_workers, 100),
                Step("step_overhead_workers", overhead_workers, 130),
                Step("step_overhead_workers_depth3", overhead_depth3, 100),
                Step("step_overhead_workers_depth4", overhead_depth4, 100),
                # The same as step_overhead_workers_depth3 with the plans' precompute on the
                # executor's main thread (PAGEDSERVE_PLAN_PREP=main): does the I/O thread's
                # numpy take the GIL from the main thread's prepare and launch? (A/B)
                Step("step_overhead_depth3_main_prep",
                     [*overhead_depth3[:-1], str(ctx.work_dir / "step-overhead-depth3-main")],
                     100,
                     env={"PAGEDSERVE_PLAN_PREP": "main"}),
                Step("step_overhead_depth3_trace", depth3_trace, 80, env=trace_env),
                Step("step_overhead_depth4_trace32", depth4_trace32, 60, env=trace32_env),
                # Depth 4 with each graph step's inputs copied buffer by buffer (A/B of the
                # staged feed: the host's launches between two forwards, 6-10 against 1-2)
                Step("step_overhead_depth4_no_graph_feed",
                     [*overhead_depth4[:-1], str(ctx.work_dir / "step-overhead-depth4-no-feed")],
                     100, env=GRAPH_FEED_OFF),
                Step("step_overhead_client_procs", overhead_procs, 70),
                Step("step_overhead_workers_no_lane", no_lane, 70,
                     env={"PAGEDSERVE_DECODE_LANE_MIN_RUNNING": "0"}),
                Step("step_overhead_no_overlap", one_at_a_time, 100,
                     env={"PAGEDSERVE_OVERLAP_STEPS": "0"}),
                Step("beam_search_bench", beam, 150),
                Step("kv_offload_bench", offload, 150)]
    raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
