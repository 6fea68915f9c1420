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
# whole modules on two pytest-xdist workers (-n 2 --dist loadfile --no-loadscope-reorder), each
# taking the next module when it is free: longest first, so that no long module starts last
# and leaves one worker idle while the other finishes it. Seconds: each module's tests as
# `make test --durations=0` measured them on the 2-core VM (2026-11-29); the rest follow in
# collection order.
SLOWEST_MODULES_FIRST = (
    "test_benchmarks_smoke.py",  # 100 s: each benchmark's quick setting, most in processes
    "test_builtin_model.py",  # 67 s: demo --quick on the built-in model, then its cluster
    "test_reliability_aborts.py",  # 55 s, mostly waiting out deadlines
    "test_reliability_soak.py",  # 54 s: a 45 s soak
    "test_sampling_ops.py",  # 49 s: kernels in the Triton interpreter
    "test_models.py",  # 40 s
    "test_kernels_compile.py",  # 40 s
    "test_scheduler_stateful.py",  # 33 s
    "test_decode_splits.py",  # 30 s
    "test_draw_ops.py",  # 29 s
    "test_cli.py",  # 24 s
    "test_pipeline_cluster.py",  # 24 s
    "test_speculative_cluster.py",  # 23 s
    "test_lora_cluster.py",  # 22 s
    "test_decode_lane.py",  # 21 s
    "test_api_workers.py",  # 21 s
    "test_executor_pipeline.py",  # 19 s
    "test_router_cluster.py",  # 18 s
    "test_router_preemption.py",  # 16 s
    "test_beam_search_cluster.py",  # 16 s
    "test_embeddings.py",  # 16 s
    "test_run_batch.py",  # 14 s
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
