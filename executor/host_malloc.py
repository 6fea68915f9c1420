"""glibc's allocator tuned for a CPU executor: a step's large tensors reuse freed memory
instead of new pages.

glibc serves an allocation above its mmap threshold (128 KiB at start, raised up to 32 MiB
as such blocks are freed) with a fresh mmap and gives it back to the system when freed, so
the next step's tensor of the same size faults every one of its pages in again, zeroed by
the kernel. A prefill step allocates tens of such tensors a layer (activations of
[tokens, hidden] in float32 for the norms, [tokens, 2 x intermediate] for the MLP): on the
built-in model, 16 prompts of 256 tokens took 6.29 s a step against transformers' 5.80 in
the same process, the difference in the elementwise ops (pow, mul, silu: 2-3x theirs), not
in the matmuls; with mmap off and the heap's top kept, 5.77 s against 5.66
(benchmarks/README.md, "embed_bench.py"). Intel's advice for PyTorch CPU inference is a
caching allocator (jemalloc, tcmalloc) for the same reason; this gets the effect with the
allocator every Linux image has.

``M_MMAP_MAX = 0``: every allocation from the heap; ``M_TRIM_THRESHOLD``: freed memory at
the heap's top stays mapped up to this much (the step's peak, which the next step needs
again). The process keeps its peak working set mapped: what it needed once it will need
again. Skipped where the library is not glibc, and when the environment already sets any
of glibc's ``MALLOC_*_`` tunables or ``PAGEDSERVE_HOST_MALLOC=0`` (an operator's choice,
or a preloaded allocator)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from pagedserve.kernels.host_math import switch_from_env

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 30
HOST_MALLOC_ENV = "PAGEDSERVE_HOST_MALLOC"
_USER_TUNABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                  "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def tune_host_malloc(environ=os.environ) -> str:
    """Apply the settings above; returns what was done, for the executor's log. A value
    of PAGEDSERVE_HOST_MALLOC other than 0 or 1 raises ValueError."""
    if switch_from_env(HOST_MALLOC_ENV, environ) is False:
        return "left as it is (PAGEDSERVE_HOST_MALLOC=0)"
    set_by_user = [name for name in _USER_TUNABLES if environ.get(name)]
    if set_by_user:
        return f"left as it is ({', '.join(set_by_user)} set)"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: AttributeError elsewhere)
    except (OSError, AttributeError, TypeError):
        return "left as it is (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return "left as it is (mallopt refused)"
    return f"glibc malloc: no mmap, heap top kept up to {TRIM_THRESHOLD_BYTES >> 20} MiB"
