"""Per-request columns of one executor: one row per request it holds (the block table and
the last sampled token), so that a step handles its requests with numpy calls over rows
instead of Python work per request (ModelRunner's gap between steps).

Hot path: every method but ``release``/``add``/``fork`` runs once per step over all the
step's rows. Do not add Python loops over rows or blocks here (``set_tails`` loops only
over tables that get shorter, which a decode never does).
"""

from __future__ import annotations

import numpy as np


class RequestRows:
    """Rows of numpy columns, one per request:

    * ``tables`` int32 [capacity, width]: the block table, zero past ``num_blocks[row]``, so
      the tables of a batch are one gather (``gather``) with the zero padding a freshly
      built array has;
    * ``num_blocks`` int64 [capacity]: the table's length;
    * ``sampled_token``, ``sampled_step`` int64 [capacity]: the token the request last
      sampled on this executor and the step it was sampled in (-1: none yet); a decode of
      the next step marked ``feed_sampled`` is fed that token;
    * ``lora`` int64 [capacity]: the slot of the request's LoRA adapter (0: none;
      models/lora.py LoraSet), set once when the request is added.

    A row is taken with ``add`` (empty table, nothing sampled) or ``fork`` (a copy of
    another row) and handed back with ``release``; a free row is zero with nothing sampled.
    Rows are taken lowest first; capacity doubles when none is free, and the width grows to
    the longest table set (it starts at ``width``, the tables of max_model_len tokens).
    """

    def __init__(self, capacity: int = 64, width: int = 1) -> None:
        capacity, width = max(1, capacity), max(1, width)
        self.tables = np.zeros((capacity, width), dtype=np.int32)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self.sampled_token = np.full(capacity, -1, dtype=np.int64)
        self.sampled_step = np.full(capacity, -1, dtype=np.int64)
        self.lora = np.zeros(capacity, dtype=np.int64)
        self._free = list(range(capacity - 1, -1, -1))  # a stack: lowest row on top
        self._in_use = np.zeros(capacity, dtype=bool)

    @property
    def capacity(self) -> int:
        return self.tables.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------------------ rows
    def add(self) -> int:
        """A free row: empty table, nothing sampled."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._in_use[row] = True
        return row

    def fork(self, parent: int) -> int:
        """A free row holding a copy of ``parent``'s table and last sample."""
        row = self.add()
        self.tables[row] = self.tables[parent]
        self.num_blocks[row] = self.num_blocks[parent]
        self.sampled_token[row] = self.sampled_token[parent]
        self.sampled_step[row] = self.sampled_step[parent]
        self.lora[row] = self.lora[parent]
        return row

    def release(self, row: int) -> None:
        """Hand ``row`` back, zeroed (raises on a row that is free already)."""
        if not self._in_use[row]:
            raise ValueError(f"row {row} is not in use")
        self._in_use[row] = False
        self.tables[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.sampled_token[row] = self.sampled_step[row] = -1
        self.lora[row] = 0
        self._free.append(row)

    def clear(self) -> None:
        """Every row free."""
        self.tables[:] = 0
        self.num_blocks[:] = 0
        self.sampled_token[:] = self.sampled_step[:] = -1
        self.lora[:] = 0
        self._free = list(range(self.capacity - 1, -1, -1))
        self._in_use[:] = False

    def table(self, row: int) -> list[int]:
        return self.tables[row, :self.num_blocks[row]].tolist()

    # ------------------------------------------------------------------------- per step
    def ensure_width(self, width: int) -> None:
        """Room for tables of ``width`` blocks."""
        if width > self.tables.shape[1]:
            grown = np.zeros((self.capacity, max(width, 2 * self.tables.shape[1])), np.int32)
            grown[:, :self.tables.shape[1]] = self.tables
            self.tables = grown

    def set_tails(self, rows: np.ndarray, new_len: np.ndarray, id_rows: np.ndarray,
                  id_cols: np.ndarray, ids: np.ndarray) -> None:
        """Block-table changes, one scatter: ``tables[id_rows[j], id_cols[j]] = ids[j]`` for
        every j, then table ``rows[i]`` has length ``new_len[i]``. The caller names distinct
        rows, fits the width (``ensure_width``) and cuts tables that get shorter (``cut``)."""
        if ids.shape[0]:
            self.tables[id_rows, id_cols] = ids
        self.num_blocks[rows] = new_len

    def cut(self, rows: np.ndarray, old_len: np.ndarray, new_len: np.ndarray) -> None:
        """Zero what lies past ``new_len`` in the tables that get shorter (a Python loop over
        those only: a decode never shortens a table)."""
        for i in np.flatnonzero(new_len < old_len).tolist():
            self.tables[rows[i], new_len[i]:old_len[i]] = 0

    def gather(self, rows: np.ndarray, width: int | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """int32 [len(rows), width]: their tables, zero-padded (into ``out`` when given);
        ``width`` defaults to the longest of them."""
        if width is None:
            width = int(self.num_blocks[rows].max()) if rows.shape[0] else 0
        # take: lighter than self.tables[rows, :width]
        return self.tables[:, :width].take(rows, axis=0, out=out)

    def record_samples(self, rows: np.ndarray, token_ids: np.ndarray, step_id: int) -> None:
        self.sampled_token[rows] = token_ids
        self.sampled_step[rows] = step_id

    # ---------------------------------------------------------------------------- growth
    def _grow_rows(self) -> None:
        old = self.capacity
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(old, np.int64)])
        self.sampled_token = np.concatenate([self.sampled_token, np.full(old, -1, np.int64)])
        self.sampled_step = np.concatenate([self.sampled_step, np.full(old, -1, np.int64)])
        self.lora = np.concatenate([self.lora, np.zeros(old, np.int64)])
        self._in_use = np.concatenate([self._in_use, np.zeros(old, bool)])
        self._free = list(range(2 * old - 1, old - 1, -1))  # called with none free
