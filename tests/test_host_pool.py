"""executor/host_pool.py: host buffers and events handed out, taken back and handed out again,
never while given out; and the runner's read-backs through it (tokens right when the pool's
buffers are used again step after step)."""

from __future__ import annotations

import pytest
import torch
from pagedserve.executor.host_pool import _KEEP, HostPool

CPU = torch.device("cpu")


def test_a_buffer_is_a_view_of_its_base_and_the_smallest_free_base_that_fits_is_used():
    pool = HostPool(CPU)
    t, base = pool.buffer((3, 5), torch.int64)
    assert t.shape == (3, 5) and t.dtype == torch.int64 and base.dtype == torch.int64
    assert t.data_ptr() == base.data_ptr() and base.numel() == 512  # 4 KiB, the smallest
    big, big_base = pool.buffer((2048,), torch.int64)  # 16 KiB: a larger base
    assert big_base.numel() == 2048 and big.shape == (2048,) and pool.made_buffers == 2
    pool.give([big_base, None, base])
    again, again_base = pool.buffer((7,), torch.int64)  # fits the small one: that one
    assert again_base is base and again.shape == (7,) and pool.made_buffers == 2
    wide, wide_base = pool.buffer((1000,), torch.int64)  # the small one is taken
    assert wide_base is big_base and wide.shape == (1000,)
    _, third = pool.buffer((513,), torch.int64)  # none free: a new one, to a power of two
    assert third.numel() == 1024 and pool.made_buffers == 3
    floats, float_base = pool.buffer((4,), torch.float32)  # bases are typed
    assert float_base.dtype == torch.float32 and float_base.numel() == 1024
    pool.give([float_base, third])
    assert pool.buffer((600,), torch.int64)[1] is third


def test_empty_shapes_and_what_is_kept():
    pool = HostPool(CPU)
    empty, base = pool.buffer((0,), torch.int64)
    assert empty.shape == (0,) and base.numel() == 512
    bases = [pool.buffer((1 + i * 100,), torch.int64)[1] for i in range(_KEEP + 4)]
    pool.give(reversed(bases))
    kept = pool._buffers[torch.int64]
    assert len(kept) == _KEEP  # the rest left to the garbage collector
    sizes = [b.numel() for b in kept]
    assert sizes == sorted(sizes)


def test_events_only_where_there_is_a_clock():
    assert HostPool(CPU).event() is None and HostPool(CPU).timing_pair() is None
    made = []

    def new_event():
        made.append(object())
        return made[-1]

    pool = HostPool(CPU, new_event=new_event)
    first = pool.timing_pair()
    assert list(first) == made and pool.made_events == 2
    pool.give(first)
    second = pool.timing_pair()
    assert set(second) == set(first) and pool.made_events == 2  # used again, none new
    assert pool.event() is not None and pool.made_events == 3


class _Recorded:
    def __init__(self) -> None:
        self.on: list = []

    def record(self, *stream) -> None:
        self.on.append(stream)


def test_events_are_recorded_on_the_pools_stream():
    """Given a stream (CUDA: the current one when the pool was made), ``record`` passes it
    (record() alone looks it up every call); without one, the event's own record()."""
    stream = object()
    event = _Recorded()
    HostPool(CPU, new_event=_Recorded, stream=stream).record(event)
    HostPool(CPU, new_event=_Recorded).record(event)
    assert event.on == [(stream,), ()]


@pytest.mark.gpu
def test_cuda_pool_records_on_the_current_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", 0)
    pool = HostPool(device)
    assert pool.stream == torch.cuda.current_stream(device)
    start, end = pool.timing_pair()
    pool.record(start)
    torch.ones(1024, device=device).sum()
    pool.record(end)
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0


@pytest.mark.parametrize("rows", [3, 40])
def test_a_plain_read_back_copies_out_of_the_pools_buffer(rows):
    """The sampler's plain tokens through a pooled host copy (a CPU's graph step copies the
    graph's token buffer): the result is a copy, which a later step's use of the same buffer
    leaves as it was."""
    from pagedserve.executor.sampler import Sampler

    sampler = Sampler()
    sampler.pool = pool = HostPool(CPU)
    tokens = torch.arange(rows, dtype=torch.int64)
    sampled = sampler._plain_output(tokens, own_host_copy=True)
    tokens += 100  # the graph's buffer, overwritten by the next replay
    out = sampled.result()
    assert out.token_ids.tolist() == list(range(rows))
    pool.give(sampled.pooled())
    later = sampler._plain_output(torch.full((rows,), 7, dtype=torch.int64),
                                  own_host_copy=True)
    assert later.pooled()[1] is sampled.pooled()[1] and pool.made_buffers == 1
    assert later.result().token_ids.tolist() == [7] * rows
    assert out.token_ids.tolist() == list(range(rows))  # not a view of the buffer
