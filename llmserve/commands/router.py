"""`llmserve router`: serve the public llmserve.v1.Router in front of a tokenizer service and worker groups.

    llmserve router --tokenizer 127.0.0.1:30010 --workers 127.0.0.1:30001,127.0.0.1:30002 \\
        --host 127.0.0.1 --port 30000 [--policy least_load|round_robin|prefix] [--port-file F] [--log-json]

Serves until SIGINT/SIGTERM, then stops accepting calls, lets in-flight ones finish for
--shutdown-grace seconds (the rest are aborted on the workers) and exits 0. grpc.health.v1 says
SERVING while the tokenizer service and at least one worker group are healthy.

Security (docs/security.md): `--tls-cert/--tls-key [--tls-client-ca]` for the public port,
`--auth-token-file` for client tokens; `--internal-tls-ca [--internal-tls-cert/--internal-tls-key]`
and `--internal-token-file` towards the tokenizer service and workers. Plaintext without them.
"""

from __future__ import annotations

import argparse

from llmserve.arg_types import add_metrics_port_arg

DEFAULT_ROUTER_PORT = 30000
POLICIES = ("least_load", "round_robin", "prefix")


def _addresses(text: str) -> list[str]:
    items = [a.strip() for a in text.split(",") if a.strip()]
    for a in items:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{a!r} is not HOST:PORT")
    if not items:
        raise argparse.ArgumentTypeError("give at least one HOST:PORT")
    return items


def _address(text: str) -> str:
    items = _addresses(text)
    if len(items) != 1:
        raise argparse.ArgumentTypeError(f"one HOST:PORT expected, got {text!r}")
    return items[0]


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Admission control, per-request caps and the stream inactivity timeout (docs/reliability.md);
    `serve` passes them on to its router."""
    g = p.add_argument_group("limits")
    g.add_argument("--max-concurrent-requests", type=int, default=256, metavar="N",
                   help="Router calls in progress at once; more get RESOURCE_EXHAUSTED at once (default 256; 0: none)")
    g.add_argument("--max-requests-per-client", type=int, default=0, metavar="N",
                   help="calls in progress per authenticated client (default 0: no per-client limit)")
    g.add_argument("--max-n", type=int, default=64, metavar="N", help="samples per request (default 64)")
    g.add_argument(
        "--max-stop-strings", type=int, default=16, metavar="N", help="stop strings per request (default 16)"
    )
    g.add_argument(
        "--max-stop-chars", type=int, default=256, metavar="N", help="characters per stop string (default 256)"
    )
    g.add_argument(
        "--stream-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="a worker stream silent this long is a hung worker: the request is aborted there and "
        "re-routed if nothing was sent yet (default 60)",
    )
    g.add_argument("--log-prompts", action="store_true", help="log prompt text (off by default)")


def limit_argv(args: argparse.Namespace) -> list[str]:
    """The flags of add_limit_args as a command line (serve -> router)."""
    argv = [
        f"--max-concurrent-requests={args.max_concurrent_requests}",
        f"--max-requests-per-client={args.max_requests_per_client}",
        f"--max-n={args.max_n}",
        f"--max-stop-strings={args.max_stop_strings}",
        f"--max-stop-chars={args.max_stop_chars}",
        f"--stream-timeout={args.stream_timeout}",
    ]
    return argv + (["--log-prompts"] if args.log_prompts else [])


def add_security_args(p: argparse.ArgumentParser) -> None:
    """TLS of the public port and client tokens; TLS and the internal token towards the tokenizer
    service and the workers (llmserve/security.py)."""
    from llmserve.security_args import add_internal_channel_args, add_server_args

    add_server_args(
        p.add_argument_group("security: the public port"),
        "--auth-token-file",
        "require a client token from this file on every call but grpc.health.v1 (lines "
        "`TOKEN [IDENTITY [admin]]`; ListWorkers needs an admin token)",
    )
    add_internal_channel_args(p.add_argument_group("security: the tokenizer service and workers"))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "router",
        help="serve llmserve.v1.Router (the public API) in front of a tokenizer service and workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tokenizer", required=True, type=_address, metavar="HOST:PORT", help="the llmserve.v1.Tokenizer service"
    )
    p.add_argument(
        "--workers",
        required=True,
        type=_addresses,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="worker group leaders (sglang.grpc.scheduler.SglangScheduler), one per data-parallel replica",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_ROUTER_PORT,
        help=f"port (default {DEFAULT_ROUTER_PORT}; 0: any free port, see --port-file)",
    )
    p.add_argument("--port-file", default=None, help="write the bound port to this file once serving")
    add_metrics_port_arg(p)
    p.add_argument(
        "--policy", choices=POLICIES, default="least_load", help="how to pick a worker group (default least_load)"
    )
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=32,
        metavar="N",
        help="the prefix policy routes by the workers' KV events (their prefix caches); while some "
        "group publishes none it hashes the first N prompt tokens instead (default 32)",
    )
    p.add_argument(
        "--detokenize",
        choices=("router", "service"),
        default="router",
        help="where generated ids become text: here, with the tokenizer service's tokenizer fetched once "
        "(default), or on the tokenizer service, one DetokenizeStream call per request",
    )
    p.add_argument(
        "--disable-worker-stream",
        action="store_true",
        help="one SglangScheduler.Generate call per request even to workers that serve llmserve.v1.WorkerStream "
        "(by default a worker's requests share one stream, and an engine step's tokens come in one message)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model name clients may send (default: what the workers report)"
    )
    p.add_argument(
        "--probe-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between GetLoads probes of every group (default 1)",
    )
    p.add_argument(
        "--health-every",
        type=int,
        default=5,
        metavar="K",
        help="run the workers' HealthCheck every K probe rounds (default 5)",
    )
    p.add_argument("--probe-timeout", type=float, default=5.0, metavar="S", help="timeout of one probe (default 5)")
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds in-flight calls may run on after SIGTERM (default 5)",
    )
    add_limit_args(p)
    add_security_args(p)
    p.add_argument("--log-json", action="store_true", help="log JSON lines (for services) instead of text")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import sys

    from llmserve.logging import configure_logging
    from llmserve.metrics import MetricsConfig, RouterMetrics
    from llmserve.security import SecurityConfigError
    from llmserve.security_args import internal_security_from_args, server_security_from_args
    from router.limits import RequestLimits
    from router.server import RouterOptions, serve

    configure_logging(json=args.log_json, level=args.log_level)
    try:
        security = server_security_from_args(args, "--auth-token-file")
        internal = internal_security_from_args(args)
    except SecurityConfigError as exc:
        print(f"llmserve router: {exc}", file=sys.stderr)
        return 2
    options = RouterOptions(
        tokenizer=args.tokenizer,
        workers=args.workers,
        policy=args.policy,
        probe_interval=args.probe_interval,
        health_every=args.health_every,
        probe_timeout=args.probe_timeout,
        prefix_tokens=args.prefix_tokens,
        served_model_name=args.served_model_name,
        limits=RequestLimits(
            max_n=args.max_n, max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars
        ),
        max_concurrent_requests=args.max_concurrent_requests,
        max_requests_per_client=args.max_requests_per_client,
        stream_timeout=args.stream_timeout,
        log_prompts=args.log_prompts,
        internal_security=internal,
        detokenize=args.detokenize,
        worker_stream=not args.disable_worker_stream,
    )
    metrics = RouterMetrics.create(MetricsConfig(args.host, args.metrics_port)) if args.metrics_port else None
    try:
        return serve(options, args.host, args.port, port_file=args.port_file, grace=args.shutdown_grace,
                     security=security, metrics=metrics)
    except OSError as exc:  # a port that cannot be bound
        print(f"llmserve router: {exc}", file=sys.stderr)
        return 1
