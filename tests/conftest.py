"""Test set-up shared by every suite.

TRITON_INTERPRET must be set before any `@triton.jit` function is defined, so it is set here,
at the top, before anything imports pagedserve.kernels. With no CUDA device the Triton kernels
run in the interpreter on CPU tensors; with one they run natively.
"""

import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The slowest modules, run first (tests keep their order within a module). `make test` runs
# whole modules on two pytest-xdist workers (-n 2 --dist loadfile --no-loadscope-reorder): a
# long module started last would leave one worker idle while the other finishes it. Seconds
# are one serial run on the 2-core VM; the rest follow in collection order.
SLOWEST_MODULES_FIRST = (
    "test_builtin_model.py",  # 112 s: demo --quick on the built-in model, then its cluster
    "test_reliability_soak.py",  # 56 s: a 45 s soak
    "test_reliability_aborts.py",  # 55 s, mostly waiting out deadlines
    "test_cli.py",  # 26 s
    "test_router_preemption.py",  # 24 s
    "test_router_cluster.py",  # 17 s
    "test_pipeline_cluster.py",  # 15 s
    "test_bench_cli.py",  # 15 s
    "test_reliability_restart.py",  # 13 s
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def gpu_memory_alone():
    """Hold the device's memory profile to one test at a time across pytest-xdist workers.

    A runner built with ``num_gpu_blocks=None`` sizes its KV cache from what is free on the
    device when it profiles, then allocates it and captures its graphs. Two such runners
    starting at once in two workers (the GPU check runs ``-n 8`` on one card) each see the
    other's memory as free and the later capture runs out of it: the eighth run's two
    failures of this kind. The lock is a file lock (fcntl) in the temporary directory, held
    for the whole test; the test's runner is collected before it is released."""
    import fcntl
    import gc
    import tempfile
    from pathlib import Path

    import torch

    with open(Path(tempfile.gettempdir()) / "pagedserve-gpu-memory.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
