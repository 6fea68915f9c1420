"""`pagedserve generate` and `pagedserve healthcheck`: small gRPC clients (`pagedserve chat`:
chat_client.py)."""

from __future__ import annotations

import argparse
import sys

import grpc

from .router.edge_security import add_client_api_key, grpc_metadata


def _channel(address: str, timeout: float | None = None) -> grpc.Channel:
    return grpc.insecure_channel(address)


def _parser(prog: str) -> argparse.ArgumentParser:
    class P(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"{self.prog}: {message}\n")
    return P(prog=prog)


def build_request(args):
    from .protos.generated.pagedserve.v1 import generate_pb2 as pb
    params = pb.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, stop=args.stop or [], n=args.n,
        ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
    )
    if args.seed is not None:
        params.seed = args.seed
    if args.logprobs is not None:
        params.logprobs = args.logprobs
    if args.beam_search:  # --n beams, best first (README "Beam search")
        params.beam_search.SetInParent()
        if args.length_penalty is not None:
            params.beam_search.length_penalty = args.length_penalty
        params.beam_search.early_stopping = pb.EarlyStopping.Value(
            f"EARLY_STOPPING_{args.early_stopping.upper()}")
    request = pb.GenerateRequest(request_id=args.request_id or "", params=params,
                                 priority=args.priority, cache_salt=args.cache_salt or "",
                                 lora_adapter=args.lora_adapter or "")
    if args.chat:  # one user turn, rendered with the model's chat template by the server
        from .chat_client import chat_messages
        request.messages.CopyFrom(chat_messages([("user", args.prompt)], args.system))
    else:
        request.prompt = args.prompt
    return request


def main(argv: list[str]) -> int:
    from google.protobuf import json_format

    from .protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
    p = _parser("pagedserve generate")
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message (the model's chat template)")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--json", action="store_true", help="print the response as protobuf JSON")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--beam-search", action="store_true",
                   help="beam search with --n beams (returned best first)")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="with --beam-search: a finished beam's score is its logprob sum / "
                        "its length ** this (default 1.0)")
    p.add_argument("--early-stopping", choices=("heuristic", "when_full", "never"),
                   default="heuristic", help="with --beam-search: when the search stops")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--lora-adapter", default=None,
                   help="a LoRA adapter the server serves (GetModelInfo lists them)")
    p.add_argument("--request-id", default=None)
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    add_client_api_key(p)
    args = p.parse_args(argv)
    if args.system is not None and not args.chat:
        p.error("--system needs --chat")
    if not args.beam_search and (args.length_penalty is not None
                                 or args.early_stopping != "heuristic"):
        p.error("--length-penalty and --early-stopping need --beam-search")
    request = build_request(args)
    metadata = grpc_metadata(args.api_key)
    with _channel(args.address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        try:
            if args.stream:
                for chunk in stub.Stream(request, timeout=args.timeout, metadata=metadata):
                    if args.json:
                        print(json_format.MessageToJson(chunk, indent=None), flush=True)
                    else:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                if not args.json:
                    sys.stdout.write("\n")
            else:
                response = stub.Generate(request, timeout=args.timeout, metadata=metadata)
                if args.json:
                    print(json_format.MessageToJson(response))
                else:
                    for completion in response.completions:
                        print(completion.text)
        except grpc.RpcError as exc:
            print(f"pagedserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def healthcheck_main(argv: list[str]) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    p = _parser("pagedserve healthcheck")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--service", default="", help='"" (process up) or pagedserve.v1.Generator')
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    with _channel(args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service),
                               timeout=args.timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            print(f"pagedserve healthcheck: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
