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
