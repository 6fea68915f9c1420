"""Steps of the GPU check (scripts/gpu_check.py) that are not a test suite or a benchmark:
one JSON line per result (DESIGN §8, bench "gpu_check"), exit 1 when a check fails.

    gpu_steps.py env [--small]                      versions, the device, every module imports
    gpu_steps.py build-model --out DIR [--small]    the random-weight Qwen2.5-0.5B-shape model
    gpu_steps.py memory --model-dir DIR [--small]   blocks from --gpu-memory-utilization

`--small`: no CUDA needed (env does not require it, build-model makes a tiny Qwen2, memory
prints one skipped line without CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pkgutil
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

BENCH = "gpu_check"
# Shape of Qwen2.5-0.5B (its config.json), random weights; the tokenizer is the tiny BPE of
# pagedserve.tinymodels, so generated ids above its vocabulary decode to no text.
QWEN25_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                  intermediate_size=4864, max_position_embeddings=32768,
                  tie_word_embeddings=True, dtype="bfloat16",
                  config_overrides={"vocab_size": 151936, "rms_norm_eps": 1e-6})
SMALL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
             intermediate_size=256, max_position_embeddings=1024, dtype="float32")
VERSIONS = ("torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface_hub",
            "numpy", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
            "pyzmq", "msgspec", "prometheus-client", "jinja2", "gguf", "accelerate", "aiohttp",
            "uvloop", "pytest", "hypothesis")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def _host() -> dict:
    """The host's CPU and Python build: the router's CPU figures there differed from the
    CPU machine's by 1.2-2x (H200 host, 2026-11-27); is it the cores or the interpreter?"""
    import os
    import sysconfig

    model = mhz = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "cpu MHz" and mhz is None:
                mhz = float(value)
    config = sysconfig.get_config_var("CONFIG_ARGS") or ""
    return {"cpu_model": model, "cpu_mhz": mhz, "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None,
            "python_optimized": "--enable-optimizations" in config,
            "python_lto": "--with-lto" in config, "python_executable": sys.executable}


def _gpu_processes() -> str:
    """nvidia-smi's compute processes (pid, name, memory), or why they are unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(nvidia-smi: {exc})"
    return "; ".join(line.strip() for line in out.stdout.splitlines() if line.strip()) \
        or "(none listed)"


def cmd_env(args) -> int:
    import torch

    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    failed = {}
    import pagedserve

    def walk(path, prefix):
        # An editable install puts the repository root on pagedserve's path, and the root
        # holds pagedserve/ again: never descend into a second "pagedserve".
        for mod in pkgutil.iter_modules(path, prefix):
            if ".pagedserve" in mod.name:
                continue
            try:
                module = importlib.import_module(mod.name)
            except Exception as exc:  # every failure reported, the first hides no other
                failed[mod.name] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            if mod.ispkg:
                walk(module.__path__, mod.name + ".")

    walk(pagedserve.__path__, "pagedserve.")
    figures = dict(python=platform.python_version(), versions=versions, host=_host(),
                   pagedserve_file=pagedserve.__file__, torch_cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available(), import_failures=failed)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        figures.update(device=props.name, capability=f"{props.major}.{props.minor}",
                       multiprocessors=props.multi_processor_count,
                       total_memory_gib=round(props.total_memory / 2**30, 2),
                       free_memory_gib=round(free / 2**30, 2),
                       device_count=torch.cuda.device_count())
    # Half the device held by others before the stage starts (the seventh run: an earlier
    # step's server left running held 64 GiB, the next cluster's executor got no KV cache
    # and its step waited out its limit): stop here, saying who holds it.
    taken = torch.cuda.is_available() and free < 0.5 * total
    ok = not failed and (args.small or torch.cuda.is_available()) and not taken
    emit("env", ok=ok, **figures)
    if taken:
        print(f"the device has {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free before "
              f"the stage: other processes hold it: {_gpu_processes()}", file=sys.stderr)
    for name, why in failed.items():
        print(f"import {name} failed: {why}", file=sys.stderr)
    if not torch.cuda.is_available() and not args.small:
        print("no CUDA device (use --small to check the steps on CPU)", file=sys.stderr)
    return 0 if ok else 1


def cmd_build_model(args) -> int:
    """Build once: a stamp with the spec marks a finished directory (deterministic seed)."""
    from pagedserve.tinymodels import build_model

    spec = SMALL if args.small else QWEN25_05B
    out = Path(args.out)
    stamp = out / "gpu_check_spec.json"
    text = json.dumps(spec, sort_keys=True)
    cached = stamp.is_file() and stamp.read_text() == text
    start = time.perf_counter()
    if not cached:
        build_model(out, "qwen2", initializer_range=0.2, seed=15, **spec)
        stamp.write_text(text)
    config = json.loads((out / "config.json").read_text())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    emit("build_model", ok=True, cached=cached, model_dir=str(out),
         build_s=round(time.perf_counter() - start, 1), weight_bytes=size,
         vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"],
         hidden_size=config["hidden_size"], dtype=spec["dtype"])
    return 0


def cmd_memory(args) -> int:
    """For each utilization: load through build_runner (profiling), then check the device
    holds no more than the target after a forward of the profiling size (the largest step
    the router may plan), that the swap space is pinned, and that blocks grow with it."""
    import torch

    if not torch.cuda.is_available():
        emit("memory_profile", skipped="no CUDA device")
        return 0 if args.small else 1
    import gc

    from pagedserve.executor.cache_engine import (
        block_bytes,
        memory_accounting,
        profile_num_gpu_blocks,
    )
    from pagedserve.executor.runner_setup import build_runner

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    ok, blocks_seen = True, []
    for util in args.utilizations:
        torch.cuda.empty_cache()
        start = time.perf_counter()
        runner = build_runner(args.model_dir, device="cuda", dtype="bfloat16",
                              gpu_memory_utilization=util, swap_space=args.swap_space,
                              progress=False)
        load_s = time.perf_counter() - start
        cache = runner.cache
        # A forward of the profiling size beside the allocated cache: must stay under util.
        torch.cuda.reset_peak_memory_stats(device)
        profile_num_gpu_blocks(runner.model, cache.block_size, args.max_num_batched_tokens,
                               util, device)
        torch.cuda.synchronize(device)
        free, _ = torch.cuda.mem_get_info(device)
        others = max(0, total - free - torch.cuda.memory_reserved(device))
        # Reserved, not allocated: the decode graphs' pool is reserved by this process
        # whether or not its blocks count as allocated between replays.
        peak = torch.cuda.max_memory_reserved(device) + others
        peak_allocated = torch.cuda.max_memory_allocated(device) + others
        per_block = block_bytes(runner.model.config, cache.block_size, cache.kv_cache.dtype)
        within = peak <= util * total * 1.02
        graphs, mixed = runner.graphs, runner.mixed_graphs
        pinned = cache.cpu_cache.is_pinned() if cache.num_cpu_blocks else None
        grows = not blocks_seen or cache.num_gpu_blocks <= blocks_seen[-1]
        case_ok = within and pinned is not False and cache.num_gpu_blocks > 0 and grows
        ok &= case_ok
        emit(f"memory_util_{util}", ok=case_ok, gpu_memory_utilization=util,
             num_gpu_blocks=cache.num_gpu_blocks, num_cpu_blocks=cache.num_cpu_blocks,
             kv_cache_gib=round(cache.num_gpu_blocks * per_block / 2**30, 2),
             peak_used_gib=round(peak / 2**30, 2),
             peak_allocated_gib=round(peak_allocated / 2**30, 2),
             target_gib=round(util * total / 2**30, 2),
             within_target=within, accounting=memory_accounting(device),
             cpu_cache_pinned=pinned, load_and_profile_s=round(load_s, 1),
             cuda_graph_sizes=len(graphs.sizes) if graphs else 0,
             graph_capture_s=round(graphs.capture_s, 1) if graphs else None,
             mixed_graph_buckets=len(mixed.sizes) if mixed else 0,
             mixed_graph_capture_s=round(mixed.capture_s, 1) if mixed else None)
        blocks_seen.append(cache.num_gpu_blocks)
        del runner, cache, graphs, mixed
        gc.collect()  # the runner's cycles (graphs, model) hold its cache until collected
        torch.cuda.empty_cache()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env")
    p.add_argument("--small", action="store_true")
    p = sub.add_parser("build-model")
    p.add_argument("--out", required=True)
    p.add_argument("--small", action="store_true")
    p = sub.add_parser("memory")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--small", action="store_true")
    p.add_argument("--utilizations", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.9, 0.6, 0.3], help="descending")
    p.add_argument("--swap-space", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    return {"env": cmd_env, "build-model": cmd_build_model, "memory": cmd_memory}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
