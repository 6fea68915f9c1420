"""`pagedserve chat`: an interactive terminal chat against a running server over gRPC.

Each line you type is a user message; the whole conversation so far (after `--system`, if
given) goes to the server in GenerateRequest's chat form (the server renders the model's chat
template) and the answer streams back as it is generated, then joins the history.

    /reset        forget the conversation (the system message stays)
    /exit, Ctrl-D leave
    Ctrl-C        while an answer streams: stop it (the request is aborted on the server) and
                  stay in the chat; the part already shown stays in the history. At the
                  prompt: drop the line.

With stdin not a terminal (piped) no prompt is printed: stdout holds the answers, each
followed by a newline, and the bracketed notes ("[stopped]", "[history cleared]").
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import uuid
from collections.abc import Callable
from typing import TextIO

import grpc

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D); Ctrl-C stops an answer"


def chat_messages(history: list[tuple[str, str]], system: str | None = None):
    """The gRPC chat form of `history` ((role, content) pairs), after `system` if given."""
    from .protos.generated.pagedserve.v1 import generate_pb2 as pb
    turns = ([("system", system)] if system else []) + history
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])


class ChatSession:
    """One conversation with a server: `ask` streams an answer into `out` and keeps both turns.

    `stub` is a GeneratorStub; `params` the SamplingParams of every turn."""

    def __init__(self, stub, params, system: str | None = None, out: TextIO = sys.stdout,
                 timeout: float | None = None, api_key: str | None = None) -> None:
        from .router.edge_security import grpc_metadata
        self.stub = stub
        self.metadata = grpc_metadata(api_key)
        self.params = params
        self.system = system
        self.out = out
        self.timeout = timeout
        self.history: list[tuple[str, str]] = []

    def reset(self) -> None:
        self.history.clear()

    def ask(self, text: str) -> str:
        """Send `text` as the next user message and stream the answer to `out`. Ctrl-C
        (KeyboardInterrupt) aborts the request and keeps what was shown; a gRPC error
        propagates and leaves the history as it was."""
        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        turns = self.history + [("user", text)]
        request_id = f"chat-{uuid.uuid4().hex}"
        request = pb.GenerateRequest(request_id=request_id, params=self.params,
                                     messages=chat_messages(turns, self.system))
        call = self.stub.Stream(request, timeout=self.timeout, metadata=self.metadata)
        pieces: list[str] = []
        stopped = False
        try:
            for chunk in call:
                pieces.append(chunk.text)
                self.out.write(chunk.text)
                self.out.flush()
        except grpc.RpcError:
            if pieces:
                self.out.write("\n")
            raise
        except KeyboardInterrupt:
            stopped = True
            self._stop(request_id, call)
            self.out.write("\n[stopped]\n")
        else:
            self.out.write("\n")
        self.out.flush()
        answer = "".join(pieces)
        if answer or not stopped:  # stopped before any text: the question is dropped too
            self.history = turns + [("assistant", answer)]
        return answer

    def _stop(self, request_id: str, call) -> None:
        """Abort the request on the server (its blocks are freed at once), then drop the call."""
        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        # Already finished, or the server is gone: cancelling the call is enough then.
        with contextlib.suppress(grpc.RpcError):
            self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=5,
                            metadata=self.metadata)
        call.cancel()


def _read_line(prompt: str, stdin: TextIO, interactive: bool) -> str | None:
    """One line from the user (None at end of input)."""
    if interactive:
        return input(prompt)  # raises EOFError at Ctrl-D
    line = stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run(session: ChatSession, stdin: TextIO = sys.stdin, err: TextIO = sys.stderr,
        interactive: bool | None = None, read: Callable | None = None) -> int:
    """The chat loop until /exit or end of input; 0 on a normal exit."""
    if interactive is None:
        interactive = stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
        print(f"pagedserve chat — {HELP}", file=err)
    read = read or _read_line
    out = session.out
    while True:
        try:
            line = read("you> ", stdin, interactive)
        except EOFError:
            line = None
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if line is None:
            if interactive:
                out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            out.write("[history cleared]\n")
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text}; {HELP}", file=err)
            continue
        try:
            session.ask(line)
        except grpc.RpcError as exc:
            print(f"pagedserve chat: {exc.code().name}: {exc.details()}", file=err)


def main(argv: list[str]) -> int:
    from .client import _parser
    from .protos.generated.pagedserve.v1 import generate_pb2 as pb
    from .protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
    from .router.edge_security import add_client_api_key
    p = _parser("pagedserve chat")
    p.description = "Interactive chat against a running server (the model's chat template)."
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = HELP
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--system", default=None, help="a system message before the conversation")
    p.add_argument("--max-tokens", type=int, default=512, help="per answer")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="answers run to --max-tokens")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each answer (s)")
    add_client_api_key(p)
    args = p.parse_args(argv)
    params = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                               top_p=args.top_p, ignore_eos=args.ignore_eos)
    if args.seed is not None:
        params.seed = args.seed
    with grpc.insecure_channel(args.address) as channel:
        session = ChatSession(pb_grpc.GeneratorStub(channel), params, system=args.system,
                              timeout=args.timeout, api_key=args.api_key)
        return run(session)
