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
