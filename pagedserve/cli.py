"""The `pagedserve` console script (DESIGN §4).

    pagedserve serve [--model M] [--executors N]     router + N executors on this machine
    pagedserve router --model M                      the router alone; executors join it
    pagedserve executor --model M --router ADDR      one executor
    pagedserve generate "prompt" [--stream] [--json] a client ([--chat] [--system TEXT])
    pagedserve chat [--address HOST:PORT]            interactive chat with a running server
    pagedserve healthcheck [--service NAME]          exit 0 when SERVING
    pagedserve demo [--quick]                        the main job on the built-in model
    pagedserve run-batch -i IN.jsonl -o OUT.jsonl    an OpenAI batch file, offline

M: a Hugging Face directory, a .gguf file, a hub id (org/name), `default` (the built-in
SmolLM2-135M-Instruct, what serve uses without --model) or `tiny` (random weights).
"""

from __future__ import annotations

import argparse
import logging
import sys

from .flags import FlagError, add_server_flags, flatten_lora_modules

log = logging.getLogger("pagedserve")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: {message}\n")


def setup_logging(fmt: str = "text") -> None:
    from .logs import setup_logging as _setup
    _setup(fmt)


def _server_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description)
    add_server_flags(parser)
    return parser


def _parse_server(prog: str, description: str, argv: list[str]) -> argparse.Namespace:
    parser = _server_parser(prog, description)
    args = parser.parse_args(argv)
    flatten_lora_modules(args)
    return args


def _resolve_model(args, prog: str, default: str | None = None) -> None:
    """Turn `--model` (a directory, a .gguf file, a hub id, `default` or `tiny`; see
    pagedserve.models) into the Hugging Face directory it names, preparing it if needed."""
    from .models import ModelSourceError, model_name, resolve_model

    if not args.model and default is None:
        print(f"{prog}: --model is required (or PAGEDSERVE_MODEL)", file=sys.stderr)
        raise SystemExit(2)
    spec = args.model or default
    try:
        args.model = str(resolve_model(spec, progress=args.log_format != "json"))
    except ModelSourceError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.model != spec:
        log.info("--model %s: %s", spec, args.model)
    if getattr(args, "served_model_name", None) is None:
        args.served_model_name = model_name(spec, args.model)


def cmd_router(argv: list[str]) -> int:
    args = _parse_server("pagedserve router", "The router alone: executors join it over "
                         "ZeroMQ at --executor-bind.", argv)
    setup_logging(args.log_format)
    _resolve_model(args, "pagedserve router")
    from .router.app import run_router
    return run_router(args)


def cmd_executor(argv: list[str]) -> int:
    args = _parse_server("pagedserve executor", "One executor: loads the model, owns one "
                         "device's KV cache and runs the router's step plans.", argv)
    setup_logging(args.log_format)  # run_executor sets it up again, the same way
    _resolve_model(args, "pagedserve executor")
    from .executor.startup import run_executor
    return run_executor(args)


def cmd_serve(argv: list[str]) -> int:
    args = _parse_server("pagedserve serve", "A one-machine cluster: the router plus "
                         "--executors executor processes.", argv)
    setup_logging(args.log_format)
    if args.prefill_executors >= args.executors:
        print(f"pagedserve serve: --prefill-executors {args.prefill_executors} leaves no "
              f"decode executor of --executors {args.executors} (take fewer, or 0: each "
              "executor does both)", file=sys.stderr)
        return 2
    # Resolved once here; the executors are handed the resulting directory.
    _resolve_model(args, "pagedserve serve", default="default")
    from .serve import run_serve
    return run_serve(args, argv)


def cmd_generate(argv: list[str]) -> int:
    from .client import main as client_main
    return client_main(argv)


def cmd_chat(argv: list[str]) -> int:
    from .chat_client import main as chat_main
    return chat_main(argv)


def cmd_healthcheck(argv: list[str]) -> int:
    from .client import healthcheck_main
    return healthcheck_main(argv)


def cmd_demo(argv: list[str]) -> int:
    from .demo import main as demo_main
    return demo_main(argv)


def cmd_keygen(argv: list[str]) -> int:
    from .keygen import main as keygen_main
    return keygen_main(argv)


def cmd_not_built(name: str):
    def run(argv: list[str]) -> int:
        print(f"pagedserve {name}: not built yet in this version", file=sys.stderr)
        return 2
    return run


COMMANDS = {
    "serve": cmd_serve,
    "router": cmd_router,
    "executor": cmd_executor,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "healthcheck": cmd_healthcheck,
    "demo": cmd_demo,
    "bench": lambda argv: __import__("pagedserve.bench", fromlist=["main"]).main(argv),
    "keygen": cmd_keygen,
    "run-batch": lambda argv: __import__("pagedserve.run_batch", fromlist=["main"]).main(argv),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\n`pagedserve COMMAND --help` lists a command's flags; every server flag can "
              "also be set as PAGEDSERVE_<FLAG>.")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"pagedserve {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"pagedserve: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except FlagError as exc:
        print(f"pagedserve {argv[0]}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
