"""RequestRows (executor/request_rows.py): the executor's per-request columns. Exact rows,
tables and padding after each operation, and a state machine against a dict-of-lists model
(the structure the columns replace)."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedserve.executor.request_rows import RequestRows


def _i64(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _change(rows: RequestRows, changes: list[tuple[int, int, list[int]]]) -> None:
    """Apply {row: table[start:] = ids} the way ModelRunner does (scatter indices of a plan,
    cuts first)."""
    row_ids = _i64([r for r, _, _ in changes])
    starts = _i64([s for _, s, _ in changes])
    lens = _i64([len(ids) for _, _, ids in changes])
    ids = np.array([b for _, _, i in changes for b in i], dtype=np.int32)
    new_len = starts + lens
    id_seq = np.repeat(np.arange(len(changes)), lens)
    id_cols = np.arange(ids.shape[0]) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
    rows.cut(row_ids, rows.num_blocks[row_ids], new_len)
    rows.ensure_width(int(new_len.max()))
    rows.set_tails(row_ids, new_len, row_ids[id_seq], id_cols, ids)


def test_rows_are_taken_lowest_first_and_handed_back_zeroed():
    rows = RequestRows(capacity=4, width=3)
    assert [rows.add() for _ in range(3)] == [0, 1, 2]
    _change(rows, [(1, 0, [7, 8]), (2, 0, [9])])
    rows.record_samples(_i64([1, 2]), np.array([42, 43], np.int32), step_id=5)
    assert rows.table(1) == [7, 8] and rows.table(2) == [9] and rows.table(0) == []
    assert rows.sampled_token[:3].tolist() == [-1, 42, 43]
    assert rows.sampled_step[:3].tolist() == [-1, 5, 5]
    rows.release(1)
    assert rows.tables[1].tolist() == [0, 0, 0] and rows.num_blocks[1] == 0
    assert (rows.sampled_token[1], rows.sampled_step[1]) == (-1, -1)
    assert rows.num_free == 2
    assert rows.add() == 1  # the row handed back is taken first
    assert rows.add() == 3
    rows.release(3)
    with pytest.raises(ValueError, match="not in use"):
        rows.release(3)


def test_fork_copies_table_and_last_sample():
    rows = RequestRows(capacity=2, width=4)
    parent = rows.add()
    _change(rows, [(parent, 0, [3, 4, 5])])
    rows.record_samples(_i64([parent]), np.array([11], np.int32), step_id=9)
    child = rows.fork(parent)
    assert child == 1 and rows.table(child) == [3, 4, 5]
    assert (rows.sampled_token[child], rows.sampled_step[child]) == (11, 9)
    _change(rows, [(child, 2, [6])])  # copy-on-write of the child's last block
    assert rows.table(parent) == [3, 4, 5] and rows.table(child) == [3, 4, 6]


def test_set_tails_appends_replaces_and_cuts_with_zero_padding():
    rows = RequestRows(capacity=3, width=4)
    a, b, c = rows.add(), rows.add(), rows.add()
    _change(rows, [(a, 0, [1, 2, 3]), (b, 0, [4]), (c, 0, [5, 6, 7, 8])])
    # a appends one block; b is unchanged (start at its end, no ids); c is cut to 1 block
    # and given a new second block (a swap-in with other ids, shorter).
    _change(rows, [(a, 3, [9]), (b, 1, []), (c, 1, [10])])
    assert rows.table(a) == [1, 2, 3, 9] and rows.table(b) == [4] and rows.table(c) == [5, 10]
    assert rows.tables[c].tolist() == [5, 10, 0, 0]  # the cut entries are zero
    assert rows.gather(_i64([c, b])).tolist() == [[5, 10], [4, 0]]
    assert rows.gather(_i64([b, a]), width=4).tolist() == [[4, 0, 0, 0], [1, 2, 3, 9]]
    assert rows.gather(_i64([])).shape == (0, 0)
    # A table replaced with nothing (start 0, no ids) is empty and all zero.
    _change(rows, [(a, 0, [])])
    assert rows.table(a) == [] and not rows.tables[a].any()


def test_growth_keeps_every_row():
    rows = RequestRows(capacity=1, width=1)
    first = rows.add()
    _change(rows, [(first, 0, [7])])
    rows.record_samples(_i64([first]), np.array([3], np.int32), step_id=1)
    taken = [rows.add() for _ in range(4)]  # grows 1 -> 2 -> 4 -> 8 rows
    assert taken == [1, 2, 3, 4] and rows.capacity == 8 and rows.num_free == 3
    _change(rows, [(4, 0, [1, 2, 3, 4, 5])])  # wider than the columns: they grow
    assert rows.tables.shape[1] >= 5
    assert rows.table(first) == [7] and rows.table(4) == [1, 2, 3, 4, 5]
    assert (rows.sampled_token[first], rows.sampled_step[first]) == (3, 1)
    assert rows.sampled_step[1:5].tolist() == [-1] * 4
    rows.clear()
    assert rows.num_free == 8 and not rows.tables.any() and rows.add() == 0


class RowsMachine(RuleBasedStateMachine):
    """Random add / fork / release / table changes / samples, each checked against a model:
    {row: (table, sampled token, sampled step)}."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = RequestRows(capacity=2, width=2)
        self.model: dict[int, list] = {}

    @rule()
    def add(self) -> None:
        row = self.rows.add()
        assert row not in self.model
        self.model[row] = [[], -1, -1]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model)))
        row = self.rows.fork(parent)
        table, token, step = self.model[parent]
        self.model[row] = [list(table), token, step]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.model)))
        self.rows.release(row)
        del self.model[row]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def change(self, data) -> None:
        """One step's table changes on distinct rows: table[start:] = ids, start <= len."""
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1,
                                    unique=True))
        changes = []
        for row in chosen:
            table = self.model[row][0]
            start = data.draw(st.integers(0, len(table)))
            ids = data.draw(st.lists(st.integers(0, 999), max_size=5))
            changes.append((row, start, ids))
            table[start:] = ids
        _change(self.rows, changes)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), step=st.integers(0, 50))
    def sample(self, data, step: int) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1,
                                    unique=True))
        tokens = data.draw(st.lists(st.integers(0, 1000), min_size=len(chosen),
                                    max_size=len(chosen)))
        self.rows.record_samples(_i64(chosen), np.array(tokens, np.int32), step)
        for row, token in zip(chosen, tokens, strict=True):
            self.model[row][1:] = [token, step]

    @invariant()
    def columns_match_the_model(self) -> None:
        rows = self.rows
        assert rows.num_free == rows.capacity - len(self.model)
        for row in range(rows.capacity):
            table, token, step = self.model.get(row, [[], -1, -1])
            assert rows.table(row) == table
            assert not rows.tables[row, len(table):].any()  # zero past the end
            assert (rows.sampled_token[row], rows.sampled_step[row]) == (token, step)
        if self.model:
            order = sorted(self.model, reverse=True)
            width = max(len(self.model[r][0]) for r in order)
            expect = np.zeros((len(order), width), np.int32)
            for i, r in enumerate(order):
                expect[i, :len(self.model[r][0])] = self.model[r][0]
            np.testing.assert_array_equal(rows.gather(_i64(order)), expect)


TestRowsMachine = RowsMachine.TestCase
TestRowsMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
