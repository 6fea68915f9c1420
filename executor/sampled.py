"""What one step's sampling leaves for the host (sampler.py makes them): the tokens on the
device with their copies to the host queued (`SampledOnDevice`), and those read back as the
arrays a StepResult carries (`SamplerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pagedserve.executor.host_pool import HostPool


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Numpy arrays shaped for ``StepResult`` (row i belongs to the i-th state)."""

    token_ids: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R]; NaN where the request asked for none
    top_counts: np.ndarray  # int32 [R]; row i owns the next top_counts[i] entries below
    top_token_ids: np.ndarray  # int32 [sum(top_counts)], best first within a row
    top_logprobs: np.ndarray  # float32 [sum(top_counts)]


class SampledOnDevice:
    """What `Sampler.launch` returns: the sampled ``tokens`` (int64 [R], on the logits'
    device, for feeding the next step there) and their copies to the host, already queued
    behind the sampling kernels (host buffers and one CUDA event after them, from the
    sampler's HostPool when it has one). `result()` waits for that event only, so a step
    launched after this one is not waited for. `pooled()`: what goes back to the pool once
    nothing reads it (host_pool.py: when the step after this one has been read back)."""

    __slots__ = ("tokens", "_host", "_event", "_finish", "_bases")

    @property
    def event(self):
        """CUDA: the event after the tokens' copies to the host (None on a CPU)."""
        return self._event

    def __init__(self, tokens: torch.Tensor, host: list[torch.Tensor], finish,
                 pool: HostPool | None = None, copy_on_cpu: bool = False) -> None:
        self.tokens = tokens
        self._finish = finish  # host tensors -> SamplerOutput (copies: the buffers go back)
        self._bases: list[torch.Tensor] = []
        if tokens.device.type == "cuda":
            self._host = [self._copy(t, pool, True) for t in host]
            if pool is not None:
                self._event = pool.event()
                pool.record(self._event)
            else:
                self._event = torch.cuda.Event(enable_timing=True)
                self._event.record()
        else:
            self._host = [self._copy(t, pool, False) for t in host] if copy_on_cpu else host
            self._event = None

    def _copy(self, t: torch.Tensor, pool: HostPool | None, non_blocking: bool):
        """``t``'s copy on the host (queued, on a GPU), into a buffer of ``pool``'s."""
        if pool is None:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=non_blocking)
        else:
            out, base = pool.buffer(tuple(t.shape), t.dtype)
            self._bases.append(base)
        return out.copy_(t, non_blocking=non_blocking)

    def pooled(self) -> list:
        """The pool's objects this holds (its event, its host buffers' bases)."""
        return [self._event, *self._bases]

    def wait(self) -> None:
        """Until the tokens' copies are done (the GIL released meanwhile)."""
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        """Are the tokens' copies done (no wait)? Always on a CPU."""
        return self._event is None or self._event.query()

    def elapsed_s(self, since) -> float:
        """Device seconds from the CUDA event ``since`` (recorded earlier, with timing) to
        the end of these copies; after `result()`."""
        return since.elapsed_time(self._event) / 1e3

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        return self._finish(*[t.numpy() for t in self._host])
