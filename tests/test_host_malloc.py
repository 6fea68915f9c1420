"""executor/host_malloc.py: glibc's allocator tuned so a step's large tensors reuse freed
pages (a subprocess each: the tuning is process-wide), and left alone when the operator
chose otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pagedserve.executor.host_malloc import tune_host_malloc

# Allocate, fill and free a 64 MiB array 20 times; print the minor page faults that took.
FAULTS = """
import resource, sys
import numpy as np
sys.path.insert(0, {root!r})
if {tune}:
    from pagedserve.executor.host_malloc import tune_host_malloc
    print(tune_host_malloc({{}}), file=sys.stderr)
a = np.ones(1 << 24, np.float32); del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    a = np.ones(1 << 24, np.float32)
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tune: bool) -> int:
    from pathlib import Path
    root = str(Path(__file__).resolve().parent.parent.parent)
    out = subprocess.run([sys.executable, "-c", FAULTS.format(root=root, tune=tune)],
                         capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_pages_are_reused():
    plain, tuned = _faults(False), _faults(True)
    # 64 MiB is 16,384 pages, 32 huge ones: glibc maps them again every time (the size is
    # above its largest mmap threshold) and the kernel faults (and zeroes) them in again
    assert plain >= 20 * 32, plain
    assert tuned * 20 < plain, (tuned, plain)


def test_an_operators_choice_is_kept():
    with pytest.raises(ValueError, match="PAGEDSERVE_HOST_MALLOC='yes'"):
        tune_host_malloc({"PAGEDSERVE_HOST_MALLOC": "yes"})
    assert tune_host_malloc({"PAGEDSERVE_HOST_MALLOC": "0"}).startswith("left as it is")
    assert "MALLOC_ARENA_MAX" not in tune_host_malloc({"MALLOC_TRIM_THRESHOLD_": "1"})
    assert tune_host_malloc({"MALLOC_MMAP_MAX_": "0"}) == \
        "left as it is (MALLOC_MMAP_MAX_ set)"
