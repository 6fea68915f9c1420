"""Memory accounting of the KV-cache sizing (executor/cache_engine.py) without a GPU: NVML's
per-process figure where it lists this process, the device-wide growth otherwise."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from pagedserve.executor import cache_engine

GiB = 1 << 30


class _Proc:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid, self.usedGpuMemory = pid, used


def _fake_nvml(processes: list[_Proc], calls: list[str]) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlShutdown = lambda: calls.append("shutdown")

    def by_uuid(uuid: str):
        calls.append(uuid)
        return "handle"

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: processes
    return nvml


@pytest.fixture
def fake_device(monkeypatch):
    props = types.SimpleNamespace(uuid="1a2b3c")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return torch.device("cuda", 0)


def test_nvml_counts_this_process_only(monkeypatch, fake_device):
    calls: list[str] = []
    others = [_Proc(os.getpid() + 1, 30 * GiB), _Proc(os.getpid(), 5 * GiB)]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(others, calls))
    assert cache_engine.process_device_bytes(fake_device) == 5 * GiB
    assert calls == ["init", "GPU-1a2b3c", "shutdown"]
    # Another process grew 30 GiB since the baseline: not this executor's to pay for.
    baseline = (2 * GiB, 0)
    got = cache_engine.outside_torch_bytes(fake_device, free=40 * GiB, total=80 * GiB,
                                           reserved=4 * GiB, baseline=baseline)
    assert got == 1 * GiB  # 5 GiB in use by the process, 4 GiB of it torch's
    assert cache_engine.memory_accounting(fake_device) == "nvml-process"


@pytest.mark.parametrize("processes", [
    [_Proc(12345678, 5 * GiB)],  # another PID namespace: this pid is not listed
    [_Proc(os.getpid(), None)],  # NVML without per-process figures
])
def test_falls_back_to_device_growth(monkeypatch, fake_device, processes):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(processes, []))
    assert cache_engine.process_device_bytes(fake_device) is None
    got = cache_engine.outside_torch_bytes(fake_device, free=40 * GiB, total=80 * GiB,
                                           reserved=4 * GiB, baseline=(2 * GiB, 1 * GiB))
    # used 40 GiB now, 2 then: 38 GiB of growth, 3 of it torch's
    assert got == 35 * GiB
    assert cache_engine.memory_accounting(fake_device) == "device-delta"


def test_nvml_missing_or_failing(monkeypatch, fake_device):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert cache_engine.process_device_bytes(fake_device) is None
    broken = _fake_nvml([], [])

    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert cache_engine.process_device_bytes(fake_device) is None


def test_the_plan_says_which_limit_left_no_block():
    """The figures behind a KV cache of no blocks, as the executor's error gives them: a
    device whose other processes hold most of it (the GPU check's stray server, H100)."""
    plan = cache_engine.KvMemoryPlan(
        total=80 * GiB, utilization=0.9, peak=3 * GiB, outside_torch=GiB // 2,
        reserve=GiB // 4, free=2 * GiB, activations=2 * GiB, block_bytes=196_608)
    assert plan.describe() == (
        "this executor's share 72.00 GiB (--gpu-memory-utilization 0.90 of 80.00 GiB) less "
        "the weights and the largest step's activations 3.00 GiB, CUDA graphs 0.25 GiB and "
        "memory outside torch 0.50 GiB leaves 68.25 GiB; free on the device 2.00 GiB (other "
        "processes hold the rest) less the activations and graphs leaves -0.25 GiB; a block "
        "takes 196,608 bytes")
    assert plan.blocks == 0
    roomy = plan._replace(free=75 * GiB)  # room 72.75 GiB: the share (68.25) limits
    assert roomy.blocks == int(68.25 * GiB) // 196_608


def test_a_cpu_cache_of_no_block_names_its_flag(tmp_path):
    from pagedserve.executor.runner_setup import build_runner

    from pagedserve.tinymodels import build_model

    model = build_model(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, intermediate_size=128)
    with pytest.raises(ValueError) as err:
        build_runner(str(model), kv_cache_space=1e-7, progress=False)
    assert str(err.value) == ("no memory left for the KV cache (num_gpu_blocks = 0): "
                              "--kv-cache-space 1e-07 GiB holds no block of 8,192 bytes")  # fp32
