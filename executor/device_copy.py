"""Host values onto the device without waiting for it (the executor's sampler and grammar
masks: they run behind a forward the device is still computing)."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """``values`` (a list or an array) as a tensor on ``device``, through pinned memory and a
    non-blocking copy: the executor leaves steps in flight, and a plain copy to a GPU waits
    for everything queued before it (the next step's forward). The pinned buffer is kept
    by torch's host allocator until the copy has run."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
