"""`pagedserve chat`'s session and loop against a fake stub (no server): the conversation
sent each turn (system first, history kept, /reset), Ctrl-C while streaming (Abort with the
request's id, call cancelled, shown text kept, the chat goes on), Ctrl-C at the prompt, errors.
The real thing over a cluster: tests/test_cli.py.
"""

from __future__ import annotations

import io

import grpc
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from pagedserve.chat_client import ChatSession, run


class FakeCall:
    def __init__(self, pieces, interrupt: bool, error: grpc.RpcError | None) -> None:
        self.pieces, self.interrupt, self.error = pieces, interrupt, error
        self.cancelled = False

    def __iter__(self):
        for piece in self.pieces:
            yield pb.GenerateStreamResponse(text=piece)
        if self.error is not None:
            raise self.error
        if self.interrupt:
            raise KeyboardInterrupt

    def cancel(self) -> None:
        self.cancelled = True


class FakeError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "messages: too long"


class FakeStub:
    """Answers turn i with scripts[i]: (pieces, interrupted, error)."""

    def __init__(self, scripts) -> None:
        self.scripts = list(scripts)
        self.requests: list[pb.GenerateRequest] = []
        self.calls: list[FakeCall] = []
        self.aborted: list[str] = []
        self.metadata: list[tuple] = []  # each call's, in order

    def Stream(self, request, timeout=None, metadata=()):  # noqa: N802 - the gRPC method's name
        self.metadata.append(tuple(metadata))
        self.requests.append(request)
        pieces, interrupt, error = self.scripts.pop(0)
        self.calls.append(FakeCall(pieces, interrupt, error))
        return self.calls[-1]

    def Abort(self, request, timeout=None, metadata=()):  # noqa: N802
        self.metadata.append(tuple(metadata))
        self.aborted.append(request.request_id)
        return pb.AbortResponse()


def _turns(request) -> list[tuple[str, str]]:
    assert request.WhichOneof("input") == "messages"
    return [(m.role, m.content) for m in request.messages.messages]


def _chat(scripts, lines: str, system: str | None = None, api_key: str | None = None):
    stub = FakeStub(scripts)
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(stub, pb.SamplingParams(max_tokens=5), system=system, out=out,
                          api_key=api_key)
    rc = run(session, stdin=io.StringIO(lines), err=err, interactive=False)
    return rc, stub, out.getvalue(), err.getvalue()


def test_history_is_sent_each_turn_and_reset_forgets_it():
    rc, stub, out, err = _chat([(["Hel", "lo"], False, None), (["Fine."], False, None),
                                (["Hi"], False, None)],
                               "hi\n\n  how are you?\n/reset\n/nope\nhi\n/exit\nnever sent\n",
                               system="Be brief.")
    assert rc == 0 and out == "Hello\nFine.\n[history cleared]\nHi\n"
    assert "unknown command /nope" in err
    assert [_turns(r) for r in stub.requests] == [
        [("system", "Be brief."), ("user", "hi")],
        [("system", "Be brief."), ("user", "hi"), ("assistant", "Hello"),
         ("user", "  how are you?")],
        [("system", "Be brief."), ("user", "hi")]]
    assert all(r.params.max_tokens == 5 for r in stub.requests)
    assert len({r.request_id for r in stub.requests}) == 3


def test_ctrl_c_aborts_the_answer_keeps_what_was_shown_and_goes_on():
    rc, stub, out, _ = _chat([(["Once", " upon"], True, None), ([], True, None),
                              (["ok"], False, None)], "story\nagain\nmore\n")
    assert rc == 0 and out == "Once upon\n[stopped]\n\n[stopped]\nok\n"
    assert stub.aborted == [stub.requests[0].request_id, stub.requests[1].request_id]
    assert [c.cancelled for c in stub.calls] == [True, True, False]
    assert _turns(stub.requests[2]) == [("user", "story"), ("assistant", "Once upon"),
                                        ("user", "more")]  # nothing shown: question dropped
    assert set(stub.metadata) == {()}  # no key: no authorization sent


def test_api_key_goes_with_every_call():
    _, stub, _, _ = _chat([(["Once"], True, None), (["ok"], False, None)], "story\nmore\n",
                          api_key="sk-chat-1")
    assert stub.metadata == [(("authorization", "Bearer sk-chat-1"),)] * 3  # 2 Streams, Abort


def test_ctrl_c_at_the_prompt_and_errors_keep_the_chat():
    stub = FakeStub([([], False, FakeError()), (["A"], False, None)])
    out, err = io.StringIO(), io.StringIO()
    inputs = iter([KeyboardInterrupt, "too long", "short", EOFError])

    def read(prompt, stdin, interactive):
        item = next(inputs)
        if isinstance(item, type):
            raise item
        return item

    session = ChatSession(stub, pb.SamplingParams(), out=out)
    assert run(session, stdin=io.StringIO(), err=err, interactive=False, read=read) == 0
    assert "pagedserve chat: INVALID_ARGUMENT: messages: too long" in err.getvalue()
    assert _turns(stub.requests[1]) == [("user", "short")]  # the failed turn left no trace
    assert session.history == [("user", "short"), ("assistant", "A")]
