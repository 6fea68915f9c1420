"""`--dtype auto` on a CPU without native 16-bit arithmetic runs float32 (cpu_dtypes.py),
the executor resolves it so, and the router's ModelInfo reports what executors registered."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pagedserve.executor.models import resolve_dtype
from pagedserve.protos import wire
from pipeline_rig import make_engine

from pagedserve import cpu_dtypes
from pagedserve.cpu_dtypes import auto_dtype, checkpoint_dtype, computes_natively, cpu_flags

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n"
X86_BF16 = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16 i8mm\n"


@pytest.mark.parametrize("text, expected", [
    (X86_AVX2, {"fpu", "sse2", "avx", "avx2", "fma"}),  # the first CPU's line
    (X86_BF16, {"fpu", "avx2", "avx512f", "avx512_bf16"}),
    (ARM, {"fp", "asimd", "fphp", "asimdhp", "bf16", "i8mm"}),
    ("processor\t: 0\nmodel name\t: something\n", None),
])
def test_cpu_flags_read_x86_flags_and_arm_features(tmp_path, text, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    flags = cpu_flags.__wrapped__(str(path))
    assert flags == (frozenset(expected) if expected is not None else None)


def test_cpu_flags_unknown_without_cpuinfo(tmp_path):
    assert cpu_flags.__wrapped__(str(tmp_path / "missing")) is None


def test_auto_keeps_the_checkpoint_dtype_unless_the_cpu_emulates_it():
    avx2 = frozenset({"avx2", "fma"})
    bf16 = frozenset({"avx2", "avx512_bf16"})
    amx = frozenset({"amx_bf16", "amx_tile"})
    assert auto_dtype("bfloat16", on_cpu=True, flags=avx2)[0] == "float32"
    assert "no native bfloat16" in auto_dtype("bfloat16", on_cpu=True, flags=avx2)[1]
    assert auto_dtype("bfloat16", on_cpu=True, flags=bf16) == ("bfloat16", "")
    assert auto_dtype("bfloat16", on_cpu=True, flags=amx) == ("bfloat16", "")
    assert auto_dtype("float16", on_cpu=True, flags=bf16)[0] == "float32"
    assert auto_dtype("float16", on_cpu=True, flags=frozenset({"avx512_fp16"})) == \
        ("float16", "")
    assert auto_dtype("float32", on_cpu=True, flags=avx2) == ("float32", "")
    assert auto_dtype("bfloat16", on_cpu=False, flags=avx2) == ("bfloat16", "")  # CUDA
    assert computes_natively("bfloat16", None)  # flags unknown: nothing known to be slow
    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_dtype({"dtype": "float16", "torch_dtype": "bfloat16"}) == "float16"
    assert checkpoint_dtype({"dtype": "int8"}) == checkpoint_dtype({}) == "float32"




class _SimpleConfig:
    def __init__(self, torch_dtype: str):
        self.torch_dtype = torch_dtype


@pytest.mark.parametrize("flags, device, asked, expected", [
    ({"avx2"}, "cpu", "auto", torch.float32),
    ({"avx512_bf16"}, "cpu", "auto", torch.bfloat16),
    ({"avx2"}, "cpu", "bfloat16", torch.bfloat16),  # asked for: honoured
    ({"avx2"}, "meta", "auto", torch.bfloat16),  # not a CPU device
])
def test_executor_resolves_auto_with_the_cpu_rule(monkeypatch, flags, device, asked, expected):
    monkeypatch.setattr(cpu_dtypes, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype(asked, _SimpleConfig("bfloat16"), torch.device(device)) == expected


def test_model_info_reports_the_registered_executors_dtype():
    async def main():
        engine, _ = make_engine()  # registers e0 computing float32; config says float32
        assert engine.model_info().dtype == "float32"
        engine.info = dataclasses.replace(engine.info, dtype="bfloat16")  # stored bfloat16
        assert engine.model_info().dtype == "float32"  # what e0 runs
        hello = wire.Hello(executor_id="e1", model_fingerprint="fp", device="cuda:0",
                           dtype="bfloat16", block_size=engine.info.block_size,
                           num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128)
        assert engine.membership.on_hello(b"e1", hello).accepted
        assert engine.model_info().dtype == "bfloat16,float32"
        engine.membership.executor_lost(engine.executors["e0"], "killed")
        assert engine.model_info().dtype == "bfloat16"
        engine.membership.executor_lost(engine.executors["e1"], "killed")
        assert engine.model_info().dtype == "bfloat16"  # none left: config.json's

    import asyncio
    asyncio.run(main())
