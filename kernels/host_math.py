"""What the launchers compute on the host per launch, kept cheap: launch-size arithmetic in
plain Python and whether Triton interprets.

``triton.next_power_of_2`` and ``triton.cdiv`` are ``ConstexprFunction`` wrappers (usable
inside kernels): called from the host they cost ~3 us each on the 2-core VM, a decode launch
made three such calls, and a step launches ~120 Triton kernels eagerly when it is not a
CUDA graph replay (benchmarks/README "GPU check": eager steps had ~12 ms of host time).
"""

from __future__ import annotations

import os

# Whether the kernels run in Triton's interpreter: decided when `@triton.jit` first runs, so
# read once, at import (an environment read per launch cost ~2 us).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Switches of the decode step, read at import where they apply and checked at an executor's
# start: decode steps' rotary embedding and cache write done by the attention kernel (its
# ``rope``; executor/models/llama.py; on by default wherever the Triton kernels run).
FUSED_ROPE_ENV = "PAGEDSERVE_DECODE_FUSED_ROPE"
# The model's projections through the split-K Triton GEMM (kernels/linear_ops.py) for
# batches of up to TRITON_GEMM_MAX_TOKENS tokens, instead of cuBLAS: "1" every projection,
# or a comma list of TRITON_GEMM_PROJECTIONS (e.g. "qkv,o": the narrow ones, whose few
# output tiles leave cuBLAS furthest from the arithmetic), "0" or unset none.
TRITON_GEMM_ENV = "PAGEDSERVE_DECODE_TRITON_GEMM"
TRITON_GEMM_MAX_TOKENS = 512
TRITON_GEMM_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def triton_gemm_from_env(environ=os.environ, strict: bool = True) -> frozenset[str]:
    """The projections PAGEDSERVE_DECODE_TRITON_GEMM sends through the Triton GEMM. Raises
    ValueError (one line) for a value other than 0, 1 or a list of known names, or with
    ``strict=False`` reads it as none (the model's import, before the executor has checked
    it)."""
    value = environ.get(TRITON_GEMM_ENV, "")
    if value in ("", "0"):
        return frozenset()
    if value == "1":
        return frozenset(TRITON_GEMM_PROJECTIONS)
    names = [n.strip() for n in value.split(",")]
    if not all(n in TRITON_GEMM_PROJECTIONS for n in names):
        if not strict:
            return frozenset()
        raise ValueError(f"{TRITON_GEMM_ENV}={value!r}: expected 0, 1 or a comma list of "
                         f"{', '.join(TRITON_GEMM_PROJECTIONS)}")
    return frozenset(names)


def switch_from_env(name: str, environ=os.environ, strict: bool = True) -> bool | None:
    """A 0/1 switch: "1" True, "0" False, unset None (the switch's default applies). Anything
    else raises ValueError (one line), or with ``strict=False`` reads as unset (a module's
    import, before the executor has checked the value at its start)."""
    value = environ.get(name, "")
    if value not in ("", "0", "1"):
        if strict:
            raise ValueError(f"{name}={value!r}: expected 0 or 1")
        value = ""
    return {"0": False, "1": True}.get(value)


# Steps with prompt tokens: the leading one-token sequences (the decodes beside a prompt
# chunk) attended by the decode kernel (split-K over their contexts) and the rest by the
# prefill kernel, two launches a layer, instead of the prefill kernel for all (one program
# a decode sequence and KV head walking its whole context, a 128-row tile for its few
# query rows). "1" on; "0" or unset off (ops.paged_attention), until a GPU has timed it
# (executor_bench's mixed cases).
MIXED_DECODE_SPLIT_ENV = "PAGEDSERVE_MIXED_DECODE_SPLIT"


def mixed_decode_split_from_env(environ=os.environ, strict: bool = True) -> bool:
    """PAGEDSERVE_MIXED_DECODE_SPLIT (`switch_from_env`; unset: off)."""
    return bool(switch_from_env(MIXED_DECODE_SPLIT_ENV, environ, strict))


def fused_rope_from_env(environ=os.environ, strict: bool = True) -> bool | None:
    """PAGEDSERVE_DECODE_FUSED_ROPE (`switch_from_env`): True always, False never, None (the
    default) wherever the Triton kernels run."""
    return switch_from_env(FUSED_ROPE_ENV, environ, strict)
