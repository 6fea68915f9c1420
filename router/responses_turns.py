"""A Responses request as one turn of a stored conversation: its `previous_response_id`
resolved into the items before its own input, and what is stored once it has answered.

With `truncation: "auto"` a conversation too long for the context loses items from its
middle (OpenAI's rule): the first item is kept when it is a user message (what the
conversation is about), then as many of the latest earlier items as fit, starting at a user
message (a tool output never without its call); the request's own input is never dropped.
The stored input items are those the model was given, so a chain stays within the context
too.

A stored record is `{"response": Response, "input_items": [...]}`: the input items are the
whole conversation the model was given, each with an `id` (a string input becomes a user
message item; a message's string content an input_text or output_text part): the previous
response's input items, its output items, then this request's own input. A turn that
names a previous response continues from exactly that: its input items and output (a
reasoning item is kept but, as in any input, not shown to the model again), then the new
input. As OpenAI's, `instructions` are not carried over (each request gives its own).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from .errors import NotFound
from .openai_fields import bad, optional_bool, optional_str
from .response_store import CONVERSATION, LIVE
from .responses_api import input_messages

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class ResponseTurn:
    body: dict  # the client's body, `store` its effective value (what the Response echoes)
    chat: dict  # the body to translate (responses_api.chat_body): `input` every item
    items: list[dict]  # every input item with an id: the record's input_items
    store: bool  # the response is stored once it has answered
    background: bool
    earlier: int = 0  # how many of `items` came before this request's own input
    conversation: str | None = None  # the conversation it continues and adds to

    @property
    def own_items(self) -> list[dict]:
        """This request's own input items (what a conversation gets, with the output)."""
        return self.items[self.earlier:]

    def record(self, response: dict) -> bytes:
        """The stored record of this turn's Response."""
        return _encode({"response": response, "input_items": self.items})


def stored_response(record: bytes) -> dict:
    return _decode(record)["response"]


def stored_input_items(record: bytes) -> list[dict]:
    return _decode(record)["input_items"]


async def resolve_turn(store, body: dict,
                       fits: Callable[[dict], Awaitable[bool]] | None = None) -> ResponseTurn:
    """The turn a Responses body asks for (InvalidRequest naming the field; NotFound for a
    previous response the store does not hold). `store`: a ResponseStore or
    RemoteResponses; `fits(chat)`: whether a turn's body fits the context (for
    `truncation: "auto"`)."""
    truncation = optional_str(body, "truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise bad("truncation", f"must be auto or disabled, got {truncation!r}")
    asked = optional_bool(body, "store")
    keep = asked is not False and store.enabled
    background = optional_bool(body, "background") is True
    previous = optional_str(body, "previous_response_id")
    if background and asked is False:
        raise bad("background", "needs store: true (a background response is read from the "
                  "store)")
    if (background or previous) and not store.enabled:
        raise bad("background" if background else "previous_response_id",
                  "this server keeps no responses (--responses-store-mb 0)")
    conversation = _conversation_id(body, previous, store)
    own = input_items(body.get("input"))
    history: list[dict] = []
    if conversation:
        record = await store.get(conversation, CONVERSATION)
        if record is None:
            raise NotFound(f"no conversation has the id {conversation!r}",
                           field="conversation")
        history = _decode(record)["items"]
    if previous:
        record = await store.get(previous)
        if record is None:
            raise NotFound(f"no stored response has the id {previous!r} (never stored, "
                           "deleted, or dropped from the store)", field="previous_response_id")
        earlier = _decode(record)
        status = earlier["response"]["status"]
        if status in LIVE:
            raise bad("previous_response_id", f"the response {previous!r} is still {status}: "
                      "continue from it once it has finished")
        history = earlier["input_items"] + earlier["response"]["output"]
    items = history + own
    chat = {k: v for k, v in body.items()
            if k not in ("previous_response_id", "input", "conversation")}
    chat["input"] = items
    echo = {**body, "store": keep, "conversation": {"id": conversation} if conversation
            else None}
    turn = ResponseTurn(echo, chat, items, keep, background, len(history), conversation)
    if truncation == "auto" and fits is not None and history and not await fits(chat):
        turn = await _fitted(turn, fits)
    return turn


def _conversation_id(body: dict, previous: str | None, store) -> str | None:
    """The conversation a body names (its id, or {"id": ...}), None when it names none."""
    value = body.get("conversation")
    if value is None:
        return None
    cid = value.get("id") if isinstance(value, dict) else value
    if not isinstance(cid, str) or not cid:
        raise bad("conversation", 'must be a conversation id or {"id": ...}')
    if previous:
        raise bad("conversation", "cannot be combined with previous_response_id")
    if not store.enabled:
        raise bad("conversation", "this server keeps no conversations "
                  "(--responses-store-mb 0)")
    return cid


def _is_user(item: dict) -> bool:
    return item.get("type") == "message" and item.get("role") == "user"


def _without(turn: ResponseTurn, kept: list[dict]) -> ResponseTurn:
    """The turn with `kept` as its earlier items."""
    items = kept + turn.items[turn.earlier:]
    return replace(turn, items=items, chat={**turn.chat, "input": items}, earlier=len(kept))


async def _fitted(turn: ResponseTurn, fits) -> ResponseTurn:
    """The turn with the fewest earlier items dropped from the middle that fits (the whole
    history dropped when nothing else does; the request then fails as any too long one).
    Fitting only gets easier the more is dropped: a binary search over where the kept tail
    starts, one rendering and tokenization a step."""
    history = turn.items[:turn.earlier]
    head = history[:1] if _is_user(history[0]) else []
    tails = [j for j in range(len(head) + 1, len(history)) if _is_user(history[j])]
    candidates = [head + history[j:] for j in tails] + ([head] if head else [])
    lo, hi = 0, len(candidates)  # the first fitting candidate is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if await fits(_without(turn, candidates[mid]).chat):
            hi = mid
        else:
            lo = mid + 1
    return _without(turn, candidates[lo] if lo < len(candidates) else [])


def input_items(value: Any) -> list[dict]:
    """A body's `input` as items with ids (InvalidRequest naming the field)."""
    input_messages(value)  # every item checked, errors naming the client's own indexes
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message" if "role" in item else None)
        item = {**item, "type": kind}
        if not item.get("id"):
            item["id"] = f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"
        if kind == "message" and isinstance(item["content"], str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        items.append(item)
    return items
