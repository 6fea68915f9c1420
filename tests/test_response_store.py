"""The stored Responses (router/response_store.py): exact byte accounting, least recently
used eviction of finished entries only, a finished entry never replaced (a cancel wins over
the run's end), cancels aborting their requests; and a stateful machine against a model of
the store under any sequence of puts, updates, reads, events, cancels and deletes."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedserve.router.errors import InvalidRequest, NotFound
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.response_store import CONVERSATION, LIVE, RESPONSE, ResponseStore
from prometheus_client import CollectorRegistry

STATUSES = ("queued", "in_progress", "completed", "incomplete", "failed")


def record(status: str, pad: int = 0) -> bytes:
    return msgspec.json.encode({"response": {"status": status, "error": None, "pad": "x" * pad},
                                "input_items": []})


def run(coro):
    return asyncio.run(coro)


def test_eviction_drops_the_least_recently_used_finished_entries():
    async def main():
        size = len(record("completed"))
        metrics = RouterMetrics(registry=CollectorRegistry())
        store = ResponseStore(3 * size, metrics=metrics)
        for rid in "abc":
            assert await store.put(rid, record("completed"))
        assert store.bytes == 3 * size
        await store.get("a")  # a is now the most recently used
        assert await store.put("d", record("completed"))
        assert [await store.get(r) is not None for r in "abcd"] == [True, False, True, True]
        assert store.bytes == 3 * size and len(store) == 3
        assert (metrics.responses_stored._value.get(), metrics.responses_stored_bytes._value
                .get(), metrics.responses_dropped._value.get()) == (3, 3 * size, 1)
        # a running background response is never dropped, even past the budget
        assert await store.put("live", record("in_progress", pad=2 * size), background=True)
        assert await store.get("live") is not None and len(store) == 1
        # a finished entry larger than the whole store is not kept
        assert not await store.put("huge", record("completed", pad=4 * size))
        assert await store.get("huge") is None
        assert store.bytes == len(record("in_progress", pad=2 * size))
        assert metrics.responses_stored_bytes._value.get() == store.bytes
        assert metrics.responses_dropped._value.get() == 5  # b, then a, c, d; then huge
    run(main())


def test_a_finished_entry_is_never_replaced_and_a_cancel_aborts():
    async def main():
        aborted = []
        store = ResponseStore(1 << 20, abort=lambda rid: aborted.append(rid) or True)
        assert await store.put("r", record("queued"), background=True, request_ids=("r-0",))
        assert await store.put("r", record("in_progress"), update=True)
        cancelled = msgspec.json.decode(await store.cancel("r"))["response"]
        assert cancelled["status"] == "cancelled" and aborted == ["r-0"]
        assert not await store.put("r", record("completed"), update=True)  # the run's end
        assert await store.cancel("r") == await store.get("r")  # idempotent
        assert aborted == ["r-0"]
        assert not await store.put("gone", record("in_progress"), update=True)
        assert await store.put("f", record("completed"))
        with pytest.raises(InvalidRequest):
            await store.cancel("f")
        with pytest.raises(NotFound):
            await store.cancel("nope")
        with pytest.raises(NotFound):
            await store.events("nope", -1, 0)
        assert await store.put("s", record("in_progress"), background=True,
                               request_ids=("s-0",))
        assert await store.delete("s") and aborted == ["r-0", "s-0"]
        off = ResponseStore(0)
        assert not off.enabled and not await off.put("x", record("completed"))
    run(main())


def test_a_reader_waits_for_events_and_the_end():
    async def main():
        store = ResponseStore(1 << 20)
        await store.put("r", record("in_progress"), background=True)
        reader = asyncio.ensure_future(store.events("r", -1, 5.0))
        await asyncio.sleep(0.01)
        await store.add_events("r", [b"a", b"b"])
        assert await reader == ([b"a", b"b"], False)
        reader = asyncio.ensure_future(store.events("r", 1, 5.0))
        await asyncio.sleep(0.01)
        await store.put("r", record("completed"), update=True)
        assert await reader == ([], True)
        assert store.bytes == len(record("completed")) + 2
        assert await store.events("r", -1, 5.0) == ([b"a", b"b"], True)
    run(main())


def test_an_edit_that_would_not_fit_is_refused_and_changes_nothing():
    """A conversation grown past what the store holds (with every other finished entry
    dropped and the running ones kept) stays as it was: a 400 for the client, never a
    200 for a conversation then gone."""
    async def main():
        conv = msgspec.json.encode({"conversation": {"id": "c"}, "items": []})
        running = record("in_progress", 100)
        store = ResponseStore(len(conv) + len(running) + 40)
        assert await store.put("r", running, background=True)
        assert await store.put_conversation("c", conv)
        grown = await store.edit_conversation("c", append=[{"id": "a", "t": "y" * 10}])
        assert len(grown) == len(conv) + 27  # the item's JSON: it fits
        with pytest.raises(InvalidRequest, match="not changed") as refused:
            await store.edit_conversation("c", append=[{"id": "b", "t": "y" * 40}])
        assert refused.value.field == "items"
        assert await store.get("c", CONVERSATION) == grown
        assert store.bytes == len(grown) + len(running)
        with pytest.raises(InvalidRequest) as refused:
            await store.edit_conversation("c", metadata={"k": "v" * 60})
        assert refused.value.field == "metadata"
        assert await store.delete("r")  # the running response gone, room for it
        assert await store.edit_conversation("c", append=[{"id": "b", "t": "y" * 40}])
    run(main())


class StoreMachine(RuleBasedStateMachine):
    """The store against a model: an ordered dict id -> [status, background, record,
    event bytes], least recently used first."""

    IDS = st.sampled_from("abcdef")

    def __init__(self) -> None:
        super().__init__()
        self.max = 3 * len(record("completed", 40))
        self.aborted: list[str] = []
        self.store = ResponseStore(self.max, abort=self.aborted.append)
        self.model: OrderedDict[str, list] = OrderedDict()
        self.finished: dict[str, bytes] = {}  # the record each entry finished with

    def _size(self, entry) -> int:
        return len(entry[2]) + entry[3]

    def _bytes(self) -> int:
        return sum(self._size(e) for e in self.model.values())

    def _evict(self, keep: str) -> None:
        for rid in [r for r, e in self.model.items() if r != keep and e[0] not in LIVE]:
            if self._bytes() <= self.max:
                return
            del self.model[rid]

    @rule(rid=IDS, status=st.sampled_from(STATUSES), pad=st.integers(0, 120),
          background=st.booleans(), update=st.booleans())
    def put(self, rid, status, pad, background, update):
        rec = record(status, pad)
        kept = run(self.store.put(rid, rec, background=background, request_ids=(rid,),
                                  update=update))
        old = self.model.get(rid)
        if old is not None and old[0] not in LIVE or old is None and update:
            assert not kept
            return
        if old is None:
            self.model[rid] = [status, background, rec, 0]
        else:
            old[0], old[2] = status, rec
        self.model.move_to_end(rid)
        self._evict(keep=rid)
        if self._bytes() > self.max and status not in LIVE:
            del self.model[rid]
            assert not kept
            return
        assert kept

    @rule(rid=IDS)
    def get(self, rid):
        got = run(self.store.get(rid))
        entry = self.model.get(rid)
        assert got == (entry[2] if entry is not None and entry[1] != "conv" else None)
        if got is not None:
            self.model.move_to_end(rid)

    @rule(cid=st.sampled_from("uvw"), pad=st.integers(0, 80))
    def put_conversation(self, cid, pad):
        """A conversation: finished (never running), its own kind."""
        rec = msgspec.json.encode({"conversation": {"id": cid}, "items": ["x" * pad]})
        kept = run(self.store.put_conversation(cid, rec))
        if cid in self.model:
            assert not kept
            return
        self.model[cid] = ["completed", "conv", rec, 0]
        self._evict(keep=cid)
        if self._bytes() > self.max:
            del self.model[cid]
            assert not kept
            return
        assert kept

    @rule(cid=st.sampled_from("uvw"), n=st.integers(1, 30))
    def append_to_conversation(self, cid, n):
        entry = self.model.get(cid)
        if entry is None:
            with pytest.raises(NotFound):
                run(self.store.edit_conversation(cid, append=[{"id": "i", "t": "y" * n}]))
            return
        items = msgspec.json.decode(entry[2])
        items["items"].append({"id": "i", "t": "y" * n})
        new = msgspec.json.encode(items)
        live = sum(self._size(e) for e in self.model.values() if e[0] in LIVE)
        if len(new) + live > self.max:  # refused: it would not fit with all else dropped
            with pytest.raises(InvalidRequest, match="not changed"):
                run(self.store.edit_conversation(cid, append=[{"id": "i", "t": "y" * n}]))
            return
        got = run(self.store.edit_conversation(cid, append=[{"id": "i", "t": "y" * n}]))
        assert got == new
        entry[2] = got
        self.finished.pop(cid, None)  # a conversation changes: not a finished response
        self.model.move_to_end(cid)
        self._evict(keep=cid)
        assert run(self.store.get(cid, CONVERSATION)) == got  # an edit never drops it

    @rule(rid=IDS, n=st.integers(1, 60))
    def add_events(self, rid, n):
        run(self.store.add_events(rid, [b"e" * n]))
        entry = self.model.get(rid)
        if entry is not None and entry[0] in LIVE:
            entry[3] += n
            self._evict(keep=rid)

    @rule(rid=IDS)
    def cancel(self, rid):
        entry = self.model.get(rid)
        if entry is None or entry[1] in (False, "conv"):
            with pytest.raises(InvalidRequest if entry is not None and entry[1] is False
                               else NotFound):
                run(self.store.cancel(rid))
            return
        got = run(self.store.cancel(rid))
        if entry[0] in LIVE:
            entry[0], entry[2] = "cancelled", got
            assert self.aborted[-1] == rid
            self._evict(keep=rid)
        assert msgspec.json.decode(got)["response"]["status"] == entry[0]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        kind = CONVERSATION if self.model[rid][1] == "conv" else RESPONSE
        assert not run(self.store.delete(rid, RESPONSE if kind == CONVERSATION else
                                         CONVERSATION))  # never the other kind's
        assert run(self.store.delete(rid, kind))
        del self.model[rid]

    @invariant()
    def agrees(self):
        assert self.store.bytes == self._bytes()
        assert len(self.store) == len(self.model)
        for rid, entry in self.model.items():
            if entry[1] == "conv":
                continue
            if entry[0] not in LIVE:  # once finished, never replaced
                assert self.finished.setdefault(rid, entry[2]) == entry[2]
            else:
                self.finished.pop(rid, None)
        for rid in list(self.finished):
            if rid not in self.model:
                del self.finished[rid]
        if self.store.bytes > self.max:  # only running ones and the entry last finished
            assert sum(e[0] not in LIVE for e in self.model.values()) <= 1


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_store_file_is_what_the_next_router_loads(tmp_path):
    """--responses-dir: finished responses, conversations and cancels written through; the
    next store loads them in the order they changed, a running one as failed, and drops
    the least recently changed past its (smaller) budget, from the file too."""
    from pagedserve.router.response_persistence import ResponseFile

    async def main():
        store = ResponseStore(1 << 20, file=ResponseFile(tmp_path))
        assert await store.put("a", record("completed"))
        assert await store.put("b", record("in_progress"), background=True)
        assert await store.put("c", record("queued"), background=True)
        await store.cancel("c")
        assert await store.put_conversation("conv", msgspec.json.encode(
            {"conversation": {"id": "conv"}, "items": []}))
        await store.edit_conversation("conv", append=[{"id": "i1"}])
        assert await store.put("gone", record("completed"))
        assert await store.delete("gone")
        store.close()

        again = ResponseStore(1 << 20, file=ResponseFile(tmp_path))
        assert await again.get("a") == record("completed")
        b = msgspec.json.decode(await again.get("b"))["response"]
        assert b["status"] == "failed" and "restarted" in b["error"]["message"]
        assert msgspec.json.decode(await again.get("c"))["response"]["status"] == "cancelled"
        conv = msgspec.json.decode(await again.get("conv", CONVERSATION))
        assert conv["items"] == [{"id": "i1"}]
        assert await again.get("gone") is None and len(again) == 4
        with pytest.raises(InvalidRequest):  # still not a background one
            await again.cancel("a")
        sizes = {rid: len(await again.get(rid, CONVERSATION if rid == "conv" else RESPONSE))
                 for rid in ("a", "b", "c", "conv")}
        again.close()

        # a smaller budget: the least recently changed dropped: a, then c (b's failure was
        # written by the second load: the most recent change)
        small = ResponseStore(sizes["b"] + sizes["conv"], file=ResponseFile(tmp_path))
        assert [await small.get(r) is not None for r in "abc"] == [False, True, False]
        assert await small.get("conv", CONVERSATION) is not None
        small.close()
        assert len(ResponseFile(tmp_path).load()) == 2
    run(main())
