"""Host values onto the device without waiting for it: every host-to-device copy of the
executor's step path (the plan's tensors, the batch, fed tokens, block copies, the sampler's
inputs, grammar masks) goes through here, since with overlapped steps the device is still
computing the step before."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """``values`` (a list, an array or a host tensor) as a tensor on ``device``, through
    pinned memory and a non-blocking copy: the executor leaves steps in flight, and a plain
    copy to a GPU waits for everything queued before it (the next step's forward). The
    pinned buffer is kept by torch's host allocator until the copy has run."""
    if isinstance(values, np.ndarray):  # numpy converts the dtype (torch would warn when
        # wrapping a read-only array first: a plan's, decoded over its message's buffer)
        if dtype is not None and values.dtype != (np_dtype := _numpy_dtype(dtype)):
            values = values.astype(np_dtype)
        t = torch.from_numpy(values)
    else:
        t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(str(dtype).removeprefix("torch."))


_ALIGN = 16  # bytes between packed arrays: every dtype's view starts aligned


def to_device_many(items, device: torch.device | str, *, pack: bool | None = None
                   ) -> list[torch.Tensor]:
    """Several host arrays (``(values, dtype)`` pairs) on ``device`` through ONE pinned
    buffer and ONE non-blocking copy; each comes back as its own tensor, a view of that one
    device buffer (``dtype``, the array's shape). A step's inputs are half a dozen small
    arrays: each through `to_device` cost a pinned allocation, a copy launch and ~40 us of
    host time on an H200's host (2026-11-27); packed, one of each. On a CPU the arrays are
    wrapped as they are, unless ``pack`` (tests: the packing's offsets and views)."""
    device = torch.device(device)
    arrays = [np.ascontiguousarray(values, dtype=_numpy_dtype(dtype)) for values, dtype in items]
    if not (device.type != "cpu" if pack is None else pack):
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = host.numpy()
    for a, off in zip(arrays, offsets, strict=True):
        flat[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    # (the host allocator keeps the pinned buffer until the copy has run, as in to_device)
    whole = host.to(device, non_blocking=True) if device.type != "cpu" else host
    return [whole[off:off + a.nbytes].view(dtype).view(a.shape)
            for a, off, (_, dtype) in zip(arrays, offsets, items, strict=True)]
