"""The `llmserve tokenizer` subcommand: run the llmserve.v1.Tokenizer service."""

import argparse
import sys
from pathlib import Path

from llmserve.arg_types import add_metrics_port_arg
from llmserve.security_args import add_server_args


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser(
        "tokenizer",
        help="serve llmserve.v1.Tokenizer for a model folder",
        description="Serve Encode/Decode/DetokenizeStream/GetInfo plus grpc.health.v1 until "
        "SIGINT or SIGTERM, then stop gracefully and exit 0.",
    )
    p.add_argument("--model", required=True, help="model folder with tokenizer.json (and tokenizer_config.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port, see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port to this file once serving")
    add_metrics_port_arg(p)
    add_server_args(p, "--internal-token-file",
                    "refuse every call but grpc.health.v1 without this file's token (the router's "
                    "--internal-token-file)")
    p.add_argument("--log-json", action="store_true", help="log JSON lines (for services) instead of text")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from llmserve.logging import configure_logging
    from llmserve.metrics import MetricsConfig, TokenizerMetrics
    from llmserve.security import SecurityConfigError
    from llmserve.security_args import server_security_from_args

    configure_logging(json=args.log_json, level=args.log_level)
    if not (Path(args.model) / "tokenizer.json").is_file():
        print(f"llmserve tokenizer: {args.model}/tokenizer.json not found", file=sys.stderr)
        return 2
    try:
        security = server_security_from_args(args, "--internal-token-file")
    except SecurityConfigError as exc:
        print(f"llmserve tokenizer: {exc}", file=sys.stderr)
        return 2
    from tokenizer_svc.server import serve

    metrics = TokenizerMetrics.create(MetricsConfig(args.host, args.metrics_port)) if args.metrics_port else None
    try:
        return serve(args.model, args.host, args.port, port_file=args.port_file, security=security, metrics=metrics)
    except OSError as exc:  # a port that cannot be bound
        print(f"llmserve tokenizer: {exc}", file=sys.stderr)
        return 1
