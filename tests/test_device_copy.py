"""Host arrays to the device: `to_device_many` packs several arrays into one buffer and one
copy, each coming back as its own tensor (dtype, shape, values). The packing runs here on
CPU tensors (``pack=True``); on a GPU the buffer is pinned and the copy non-blocking
(tests/test_executor_overlap.py's GPU cases run the executor's steps through it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.device_copy import to_device_many


@pytest.mark.parametrize("pack", [False, True])
def test_every_array_comes_back_with_its_dtype_shape_and_values(pack):
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 1 << 40, 7)  # int64 beyond int32
    slots = np.array([3, -1, 9], dtype=np.int32)  # widened to int64
    starts = np.array([0, 5, 9, 12], dtype=np.int64)  # narrowed to int32
    tables = rng.integers(0, 1000, (3, 5)).astype(np.int32)  # 2-D
    empty = np.zeros(0, dtype=np.int64)
    odd = np.array([1, 2, 3], dtype=np.int32)  # 12 bytes: the next array stays aligned
    items = ((positions, torch.int64), (slots, torch.int64), (starts, torch.int32),
             (tables, torch.int32), (empty, torch.int64), (odd, torch.int32),
             (positions[:3], torch.int64))
    out = to_device_many(items, "cpu", pack=pack)
    assert len(out) == len(items)
    for t, (values, dtype) in zip(out, items, strict=True):
        assert t.dtype == dtype and tuple(t.shape) == values.shape
        assert t.is_contiguous()
        assert t.tolist() == values.astype(np.int64).tolist()
    if pack:  # one buffer: every tensor a view of the same storage
        base = out[0].untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in out)
        assert all(t.data_ptr() % 16 == 0 for t in out if t.numel())


def test_writes_into_one_tensor_leave_the_others_alone():
    a, b = to_device_many(((np.arange(4), torch.int64), (np.arange(3), torch.int32)), "cpu",
                          pack=True)
    a.index_copy_(0, torch.tensor([1]), torch.tensor([99]))
    b.fill_(-1)
    assert a.tolist() == [0, 99, 2, 3] and b.tolist() == [-1, -1, -1]
