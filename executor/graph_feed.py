"""A decode graph step's inputs as host arrays (`GraphFeed`), packed into one pinned buffer
(`StagingRing`) and moved to the device in one copy; the graph scatters them into its static
buffers itself, as its first node (kernels/graph_input_ops.py has the layout, cuda_graphs.py
the replay).

Why: between two forwards the executor's host is the critical path whenever a step is
short (the device idled while the host prepared and launched the next step in every trace
of 2026-11-27 on an H200). A graph step used to make ten launches there: the tables' packed
copy, a copy per static buffer (token ids, positions, slots, lengths, tables) and up to four
fills of the padding rows. Fed, it makes the ids' copy when they are on the device and not
the graphs' own tokens, the stage's copy and the replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pagedserve.kernels.graph_input_ops import HEADER_WORDS
from pagedserve.kernels.host_math import switch_from_env

# The executor's way back to one copy per static buffer (tests and A/B runs set it to 0).
FEED_ENV = "PAGEDSERVE_GRAPH_FEED"


def feeds_wanted(strict: bool = False) -> bool:
    """`PAGEDSERVE_GRAPH_FEED=0` in an executor's environment: graph steps copy their inputs
    buffer by buffer, as before the staged feed (1 or unset: fed). Another value raises
    ValueError (one line) when ``strict`` (the executor's start: exit 2), else counts as
    unset (`host_math.switch_from_env`)."""
    return switch_from_env(FEED_ENV, strict=strict) is not False


@dataclass(slots=True)
class GraphFeed:
    """A decode step's rows for a graph: everything but the token ids on the host; the ids
    on the host (``token_ids``) or on the device (the batch's ``input_ids``)."""

    positions: np.ndarray  # [n], any integer dtype
    slots: np.ndarray  # [n]
    seq_lens: np.ndarray  # [n]
    tables: np.ndarray  # int32 [n, w]: each row's block table, w columns
    token_ids: np.ndarray | None  # [n] on the host, or None: on the device

    @property
    def num_rows(self) -> int:
        return self.tables.shape[0]


def pack(words: np.ndarray, feed: GraphFeed, ids_from: int) -> int:
    """Write ``feed`` into ``words`` (int32) in the stage layout with the header's
    ``ids_from``; returns the words used."""
    n, w = feed.tables.shape
    words[:HEADER_WORDS] = (n, w, ids_from, 0)
    at = HEADER_WORDS
    if feed.token_ids is not None:
        words[at:at + n] = feed.token_ids
    for values in (feed.positions, feed.slots, feed.seq_lens):
        at += n
        words[at:at + n] = values
    at += n
    end = at + n * w
    words[at:end].reshape(n, w)[:] = feed.tables
    return end


class StagingRing:
    """``count`` host buffers of ``words`` int32 words used in turn (pinned on a GPU's host,
    so their copies do not wait for the device): a buffer is written again only once the
    device has copied it out (an event recorded behind each copy; with the executor's
    pipeline, long done by then)."""

    def __init__(self, words: int, device: torch.device, count: int = 4) -> None:
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(words, dtype=torch.int32, pin_memory=cuda)
                        for _ in range(count)]
        self.arrays = [b.numpy() for b in self.buffers]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(count)]
        # recorded on the stream current now (the runner's; host_pool.py: record() without
        # one builds a Stream object each call)
        self.stream = torch.cuda.current_stream(device) if cuda else None
        self._used = [False] * count
        self._next = 0

    def take(self) -> int:
        """The index of the next buffer, free to write."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        if self._used[i] and self.events[i] is not None:
            self.events[i].synchronize()
        return i

    def copy_out(self, i: int, words: int, dst: torch.Tensor) -> None:
        """Queue the copy of buffer ``i``'s first ``words`` words into ``dst`` (and the
        event that frees the buffer behind it)."""
        dst[:words].copy_(self.buffers[i][:words], non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record(self.stream)
        self._used[i] = True
