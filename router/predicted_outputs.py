"""Predicted Outputs: drafts from the text a request says its output will mostly repeat.

A client editing a file sends the file as the prediction (OpenAI's ``prediction``); the
output is that file with a few changes. Each sample keeps a `PredictionCursor`: its place
in the prediction, the index of the prediction token its output should take next. Before
a decode the cursor follows the output tokens received since the last decode: while each
equals the prediction token at the place, the place moves on; at the first that differs
the output has left the prediction there (the anchor) and the place is lost. The drafts
are the prediction's next tokens from the place (router/speculative.py verifies them as
any drafts: outputs do not change). A row of drafts from a place just found again for
sure (`SURE_MATCH` tokens matched, or at most `SURE_NEAR` after the anchor: the output
rejoins the prediction where it left it, after a replaced or inserted token or two) is
as long as any row may be (the output is back on the prediction: rows confirmed in full
would double their way up to it, one decode each); a weaker match drafts as many as the
sample's last rows earned. Where the prediction has no place
for the output, the sample drafts what the n-gram lookup finds in its own tokens
(router/speculative.py; with or without --speculative-config: an edit's new text often
repeats itself or the prompt); where neither finds anything, the next decode looks again,
and only after that one decode in 2, 4, 8, 16 (a prediction unrelated to the output
costs a sample its pipelining for a few decodes only: a sample looking for drafts is the
only plan in flight to its executor).

Finding the place again (`find`): the changed text is written, then the output usually
goes on with the prediction a little after the anchor (a replaced name), at it (inserted
lines) or further on (deleted ones). The candidates are the prediction's places just
after an occurrence of the output's last token; each is scored by how many of the
output's last tokens (at most `MAX_MATCH`) match the prediction's tokens before it (one
vectorised compare a length, as router/speculative.py's lookup). The longest match at or
after the anchor wins, the nearest among equals; a single matching token counts only
within `NEAR` tokens of the anchor (a token as common as a newline occurs everywhere
further on); with none after the anchor, a match of `MIN_BACK_MATCH` tokens or more before
it (text the output repeats).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_MATCH = 16  # output tokens a candidate place is scored by, at most
NEAR = 16  # a one-token match counts only this close after the anchor
MIN_BACK_MATCH = 3  # tokens a place before the anchor must match
SURE_MATCH = 3  # a place found again by this many tokens matched ...
SURE_NEAR = 3  # ... or this close after the anchor drafts a full row


class PredictedDrafts(list):
    """A row's drafts taken from its request's prediction: when the plan is answered,
    those confirmed and rejected count in the request's usage (`count`), whatever
    happened to the sample meanwhile (its last row may end it)."""

    __slots__ = ()


def count(group, num_drafted: int, num_confirmed: int) -> None:
    """A predicted row's result, into its request's usage (router/token_apply.py)."""
    group.accepted_prediction_tokens += num_confirmed
    group.rejected_prediction_tokens += num_drafted - num_confirmed


class PredictionCursor:
    """One sample's place in its request's prediction."""

    __slots__ = ("tokens", "at", "followed", "anchor", "lost_for", "matched")

    def __init__(self, prediction: Sequence[int]) -> None:
        self.tokens = np.asarray(prediction, dtype=np.int64)
        self.at = 0  # the prediction token the output takes next (-1: lost)
        self.followed = 0  # output tokens followed so far
        self.anchor = 0  # where the output last left the prediction
        self.lost_for = 0  # decodes in a row that found no place
        self.matched = 0  # output tokens the last place found matched

    def follow(self, token_ids: Sequence[int], num_prompt_tokens: int) -> bool:
        """Follow the output tokens received since the last call (``token_ids``: the
        sample's prompt and output); True when the place, lost, was found again for
        sure (see the module's doc)."""
        pred = self.tokens
        size = pred.shape[0]
        at = self.at
        end = len(token_ids)
        for i in range(num_prompt_tokens + self.followed, end):
            if 0 <= at < size and pred[at] == token_ids[i]:
                at += 1
            elif at >= 0:  # the output leaves the prediction here
                self.anchor = at
                at = -1
        self.followed = end - num_prompt_tokens
        found = False
        if at < 0 and self.followed:
            start = max(num_prompt_tokens, end - MAX_MATCH)
            at = self.find(token_ids[start:end])
            found = at >= 0
            self.lost_for = 0 if found else self.lost_for + 1
        self.at = at
        return found and (self.matched >= SURE_MATCH or at - self.anchor <= SURE_NEAR)

    def drafts(self, k: int) -> list[int]:
        """Up to ``k`` prediction tokens from the place ([]: lost, or at the end)."""
        at = self.at
        return self.tokens[at:at + k].tolist() if at >= 0 and k > 0 else []

    def find(self, tail: Sequence[int]) -> int:
        """The place after the best match of the output's last tokens ``tail`` (see the
        module's doc), -1 when none qualifies."""
        pred = self.tokens
        tail = np.asarray(tail, dtype=np.int64)
        ends = np.flatnonzero(pred == tail[-1])  # candidates: the match ends here
        if ends.shape[0] == 0:
            return -1
        length = np.ones(ends.shape[0], dtype=np.int64)
        ok = np.ones(ends.shape[0], dtype=bool)
        for n in range(2, tail.shape[0] + 1):
            back = ends - (n - 1)
            ok &= back >= 0
            ok[ok] &= pred[back[ok]] == tail[-n]
            alive = np.count_nonzero(ok)
            if not alive:
                break
            length += ok
            if alive == 1 and n >= SURE_MATCH:
                break  # the longest already; its length past this decides nothing more
        places = ends + 1
        after = places > self.anchor  # matches ending at the anchor or after it
        forward = after & ((length >= 2) | (places - self.anchor <= NEAR))
        if forward.any():
            best = np.flatnonzero(forward & (length == length[forward].max()))[0]
            self.matched = int(length[best])
            return int(places[best])
        back = ~after & (length >= MIN_BACK_MATCH)
        if back.any():
            best = np.flatnonzero(back & (length == length[back].max()))[-1]
            self.matched = int(length[best])
            return int(places[best])  # the latest: nearest the anchor
        return -1
