"""Which 16-bit dtypes this machine's CPU computes natively, and what `--dtype auto` runs.

`--dtype auto` is the checkpoint's dtype (transformers' `dtype="auto"`), with one exception:
on a CPU device, a bfloat16 or float16 checkpoint runs in float32 when the CPU has no
native arithmetic for it. Without AVX-512 BF16 / AMX-BF16 (x86) or the BF16 extension
(Arm), torch emulates bfloat16 matmuls through float32 and is slower than float32 itself
(benchmarks/dtype_bench.py, the built-in model on an AVX2-only EPYC: a 128-token prefill
3.16 s in bfloat16 against 0.51 s in float32, batch-32 decode 1.37 against 0.44 s); float16 likewise needs AVX-512 FP16 / AMX-FP16 or Arm's FP16 arithmetic.
An explicit `--dtype bfloat16` is always honoured.

Torch-free (the router reads it too): the flags come from /proc/cpuinfo. Where they cannot
be read (not Linux), the checkpoint's dtype is kept: nothing is known to be slow.
"""

from __future__ import annotations

import functools

DTYPE_NAMES = ("float32", "float16", "bfloat16")

# Any one of these cpuinfo flags means the CPU computes that dtype natively.
NATIVE_FLAGS = {
    "bfloat16": frozenset({"avx512_bf16", "amx_bf16", "bf16"}),  # x86 ×2, Arm "Features"
    "float16": frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}),
}


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (x86 "flags", Arm "Features"), or None where unknown."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def computes_natively(dtype: str, flags: frozenset[str] | None) -> bool:
    """False only when the flags are known and lack every native flag for `dtype`."""
    needed = NATIVE_FLAGS.get(dtype)
    return needed is None or flags is None or not needed.isdisjoint(flags)


def checkpoint_dtype(config: dict) -> str:
    """config.json's dtype when it is one we run, else float32 (as transformers)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return name if name in DTYPE_NAMES else "float32"


def auto_dtype(stored: str, *, on_cpu: bool,
               flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(dtype `--dtype auto` runs for a checkpoint stored in `stored`, why if it differs)."""
    if on_cpu:
        flags = cpu_flags() if flags is None else flags
        if not computes_natively(stored, flags):
            return "float32", (f"this CPU has no native {stored} arithmetic (emulated "
                               f"{stored} is slower than float32); pass --dtype {stored} "
                               "to run it anyway")
    return stored, ""
