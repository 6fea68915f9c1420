"""A decode graph's inputs from one staged buffer (kernels/graph_input_ops.py) against its twin
(reference.graph_inputs_) and against the values packed, under TRITON_INTERPRET=1 on CPU
(natively on a GPU): every ``ids_from`` rule, padding rows, tables narrower than the static
width (the columns past them untouched), no rows, and the "all in place" header that leaves
every buffer as it was."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import graph_input_ops as gio
from pagedserve.kernels import ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS, WIDTH = 6, 40  # the static buffers (a graph of 6 rows, tables 40 wide)


def _statics(device):
    gen = torch.Generator().manual_seed(3)  # stale values from an earlier step
    return dict(
        input_ids=torch.randint(0, 500, (ROWS,), generator=gen).to(device),
        positions=torch.randint(0, 500, (ROWS,), generator=gen).to(device),
        slot_mapping=torch.randint(0, 500, (ROWS,), generator=gen).to(device),
        seq_lens=torch.randint(1, 500, (ROWS,), generator=gen).int().to(device),
        block_tables=torch.randint(0, 90, (ROWS, WIDTH), generator=gen).int().to(device))


def _stage(n, w, ids_from, ids, positions, slots, lens, tables):
    stage = torch.zeros(gio.stage_words(ROWS, WIDTH), dtype=torch.int32)
    stage[:4] = torch.tensor([n, w, ids_from, 0])
    body = torch.cat([torch.as_tensor(v, dtype=torch.int32).reshape(-1)
                      for v in (ids, positions, slots, lens, tables)])
    stage[4:4 + body.shape[0]] = body
    return stage


def _run(backend, device, stage, statics, last):
    out = {k: v.clone() for k, v in statics.items()}
    ops.graph_inputs_(stage.to(device), out["input_ids"], out["positions"],
                      out["slot_mapping"], out["seq_lens"], out["block_tables"],
                      last.to(device), backend=backend)
    return {k: v.cpu() for k, v in out.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ids_from", [gio.IDS_FROM_STAGE, gio.IDS_FROM_LAST_TOKENS,
                                      gio.IDS_IN_PLACE])
@pytest.mark.parametrize("n,w", [(4, 3), (6, 40), (1, 17), (0, 0), (5, 0)])
def test_rows_and_padding_as_packed(device, ids_from, n, w):
    gen = torch.Generator().manual_seed(n * 100 + w)
    ids = torch.randint(0, 1000, (n,), generator=gen)
    positions = torch.randint(0, 4096, (n,), generator=gen)
    slots = torch.randint(-1, 2 ** 31 - 1, (n,), generator=gen)
    lens = torch.randint(1, 4096, (n,), generator=gen)
    tables = torch.randint(0, 2 ** 31 - 1, (n, w), generator=gen)
    last = torch.randint(0, 1000, (ROWS + 2,), generator=gen)
    stage = _stage(n, w, ids_from, ids, positions, slots, lens, tables)
    statics = _statics(device)
    before = {k: v.cpu() for k, v in statics.items()}
    got = _run("triton", device, stage, statics, last)
    twin = _run("torch", device, stage, statics, last)
    for k, v in twin.items():
        assert torch.equal(got[k], v), k
    want_ids = {gio.IDS_FROM_STAGE: ids, gio.IDS_FROM_LAST_TOKENS: last[:n],
                gio.IDS_IN_PLACE: before["input_ids"][:n]}[ids_from]
    assert torch.equal(got["input_ids"][:n], want_ids)
    assert torch.equal(got["positions"][:n], positions)
    assert torch.equal(got["slot_mapping"][:n], slots)
    assert torch.equal(got["seq_lens"][:n], lens.int())
    assert torch.equal(got["block_tables"][:n, :w], tables.int())
    assert torch.equal(got["block_tables"][:n, w:], before["block_tables"][:n, w:])
    assert torch.equal(got["block_tables"][n:], before["block_tables"][n:])  # never read
    assert got["input_ids"][n:].eq(0).all() and got["positions"][n:].eq(0).all()
    assert got["slot_mapping"][n:].eq(-1).all() and got["seq_lens"][n:].eq(0).all()
    for k in ("input_ids", "positions", "slot_mapping"):
        assert got[k].dtype == torch.int64
    assert got["seq_lens"].dtype == got["block_tables"].dtype == torch.int32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_in_place_writes_nothing(device, backend):
    stage = _stage(3, 5, gio.ALL_IN_PLACE, [1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1],
                   torch.ones(3, 5))
    statics = _statics(device)
    got = _run(backend, device, stage, statics, torch.zeros(ROWS, dtype=torch.long))
    for k, v in statics.items():
        assert torch.equal(got[k], v.cpu()), k


def test_wide_tables_loop_over_column_blocks():
    """Tables wider than one block of columns (1,024) are copied block after block."""
    rows, width, w = 2, 2600, 2567
    gen = torch.Generator().manual_seed(9)
    tables = torch.randint(0, 10 ** 6, (rows, w), generator=gen)
    stage = torch.zeros(gio.stage_words(rows, width), dtype=torch.int32)
    stage[:4] = torch.tensor([rows, w, gio.IDS_FROM_STAGE, 0])
    body = torch.cat([torch.tensor([5, 6, 7, 8, 9, 10, 11, 12]), tables.reshape(-1)])
    stage[4:4 + body.shape[0]] = body.int()
    out = [torch.zeros(rows, dtype=torch.long) for _ in range(3)]
    lens = torch.zeros(rows, dtype=torch.int32)
    table = torch.full((rows, width), -7, dtype=torch.int32)
    ops.graph_inputs_(stage, *out, lens, table, torch.zeros(rows, dtype=torch.long),
                      backend="triton")
    assert torch.equal(table[:, :w], tables.int()) and table[:, w:].eq(-7).all()
    assert out[0].tolist() == [5, 6] and lens.tolist() == [11, 12]


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_rows_into_out(device):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).to(device)
    for backend in ("triton", "torch"):
        out = torch.full((8,), -1, dtype=torch.long, device=device)
        got = ops.argmax_rows(logits, out=out[:5], backend=backend)
        assert got.data_ptr() == out.data_ptr()
        assert out[:5].tolist() == logits.argmax(-1).tolist() and out[5:].eq(-1).all()
    with pytest.raises(ValueError, match="int64"):
        ops.argmax_rows(logits, out=torch.zeros(5, dtype=torch.int32, device=device),
                        backend="triton")
