"""The host objects a step's read-back uses, used again: CUDA timing events (a forward's
start and end, the end of its tokens' copies) and the host buffers the tokens are copied
into (pinned on a GPU). Made fresh every step, each costs the host a driver call or two and
the pinned host allocator's bookkeeping (the sixth GPU run's host profile, H200: ~15 us an
event, ~17 us a pinned allocation; a steady decode step made three events and one pinned
buffer), on the main thread, between two forwards.

Who gives an object back, and when (model_runner.py): a step's objects are read when it is
read back (its events' times, its tokens' copy) and once more when the step after it is
read back (its end event starts that step's gap). So the objects of step N come back to the
pool when step N + 1 has been read back; a step that is never followed (a reset, a step
with no device work after it) leaves its objects to the garbage collector. The pool hands
out nothing it has not been given back, so a slow reader can never see an object reused.

Events are recorded through the pool (``record``), on the stream current when the pool was
made (the runner's: nothing in a step sets another; graph capture's side stream records no
step event): ``Event.record()`` without a stream looks the current one up and builds a
Python Stream object each call (the seventh GPU run's host, H100: 11.0 us a record against
3.0 given the stream; four a step).

Host buffers: a base of the dtype asked for, at least as large as asked, viewed as the
shape asked for; a reader of the view must copy what it keeps (the SamplerOutput's arrays are
copies; sampler.py).
"""

from __future__ import annotations

import functools
import math

import torch

# At most this many of each kind are kept (a step in flight, the one being read back, the
# one before it; more come back only after a burst of fresh ones, which the GC then frees).
_KEEP = 16
_MIN_BUFFER_BYTES = 4096  # a 256-row step's int64 tokens take 2 KiB: one base serves


class HostPool:
    """Timing events (CUDA) and host buffers (pinned on CUDA) given out and taken back."""

    __slots__ = ("cuda", "stream", "_new_event", "_events", "_buffers", "made_events",
                 "made_buffers")

    def __init__(self, device: torch.device, new_event=None, stream=None) -> None:
        """``new_event``: makes an event (default: a CUDA timing event on CUDA, none on a
        CPU; tests give a stand-in to time steps on a CPU). ``stream``: where ``record``
        records (default: the device's current stream on CUDA; None: the event's own
        ``record()``)."""
        self.cuda = device.type == "cuda"
        if new_event is None and self.cuda:
            new_event = functools.partial(torch.cuda.Event, enable_timing=True)
        if stream is None and self.cuda:
            stream = torch.cuda.current_stream(device)
        self.stream = stream
        self._new_event = new_event
        self._events: list = []
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}  # free bases, ascending
        self.made_events = 0  # made fresh, for tests and benchmarks
        self.made_buffers = 0

    def event(self):
        """A timing event not in use (None on a CPU: nothing to time there)."""
        if self._new_event is None:
            return None
        if self._events:
            return self._events.pop()
        self.made_events += 1
        return self._new_event()

    def record(self, event) -> None:
        """Record ``event`` (the pool's or not) on the pool's stream."""
        if self.stream is None:
            event.record()
        else:
            event.record(self.stream)

    def timing_pair(self) -> tuple | None:
        """Two timing events for a step's forward, its start and end (None on a CPU)."""
        return None if self._new_event is None else (self.event(), self.event())

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
        """(a host tensor of ``shape`` and ``dtype``, its base to give back): the smallest
        free base of that dtype that holds it, else a new one (pinned on CUDA). Bases are
        typed, so a row of tokens is one slice of one (a view through bytes costs three)."""
        numel = math.prod(shape)
        free = self._buffers.get(dtype)
        if free:
            for i, base in enumerate(free):
                if base.numel() >= numel:
                    del free[i]
                    break
            else:
                base = self._new_buffer(numel, dtype)
        else:
            base = self._new_buffer(numel, dtype)
        view = base[:numel]
        return (view if len(shape) == 1 else view.view(shape)), base

    def _new_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.made_buffers += 1
        size = max(_MIN_BUFFER_BYTES // dtype.itemsize, 1 << max(0, numel - 1).bit_length())
        return torch.empty(size, dtype=dtype, pin_memory=self.cuda)

    def give(self, items) -> None:
        """Take back events and buffer bases (None entries are skipped) that nothing will
        read again."""
        for item in items:
            if item is None:
                continue
            if isinstance(item, torch.Tensor):
                keep = self._buffers.setdefault(item.dtype, [])
                if len(keep) < _KEEP:
                    # sorted by size: `buffer` takes the smallest that fits
                    at = len(keep)
                    while at and keep[at - 1].numel() > item.numel():
                        at -= 1
                    keep.insert(at, item)
            elif len(self._events) < _KEEP:
                self._events.append(item)
