"""`llmserve worker`: one model worker serving sglang.grpc.scheduler.SglangScheduler (TP size 1).

    llmserve worker --model DIR --host 127.0.0.1 --port 30001 [engine flags] [--log-json]

Builds the engine (model load, KV pool), serves until SIGINT/SIGTERM, then drains and exits 0.
With ``--port 0`` the OS picks a free port; the bound address is logged and printed, and written to
``--port-file`` (atomically) once the server accepts calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

import structlog

from llmserve.logging import configure_logging
from worker_svc.cli_args import add_engine_args, engine_config_from_args

log = structlog.get_logger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")


def _write_port_file(path: str, port: int) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)


async def _serve(args: argparse.Namespace) -> int:
    from worker_svc.engine import Engine
    from worker_svc.server import WorkerOptions, WorkerServer

    config = engine_config_from_args(args)
    engine = await asyncio.to_thread(Engine, config)
    options = WorkerOptions(
        served_model_name=args.served_model_name or Path(config.model_path).resolve().name,
        advertised_model_path=args.advertised_model_path,
        health_probe_timeout_s=args.health_probe_timeout,
    )
    server = WorkerServer(engine, host=args.host, port=args.port, options=options)
    port = await server.start()
    if args.port_file:
        _write_port_file(args.port_file, port)
    print(f"llmserve worker listening on {server.address}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received; shutting down")
    await server.stop(args.shutdown_grace)
    return 0


def run(args: argparse.Namespace) -> int:
    configure_logging(json=args.log_json, level=args.log_level)
    try:
        return asyncio.run(_serve(args))
    except (ValueError, OSError, RuntimeError) as exc:
        log.error("worker failed", error=str(exc))
        return 1


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser(
        "worker",
        help="serve one model worker (sglang.grpc.scheduler.SglangScheduler + grpc.health.v1)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=30001, help="gRPC port; 0 lets the OS pick one")
    g.add_argument("--port-file", default=None, help="write the bound port here once serving")
    g.add_argument("--served-model-name", default=None, help="model name reported to gateways (default: folder name)")
    g.add_argument(
        "--advertised-model-path",
        default="",
        metavar="PATH",
        help="model_path/tokenizer_path reported in GetModelInfo (default empty: a gateway given a path "
        "it cannot open may try a model hub). A path valid on the gateway host lets it load the "
        "tokenizer itself; smg 1.13 given a path it cannot find fetches the tokenizer with GetTokenizer",
    )
    g.add_argument("--health-probe-timeout", type=float, default=20.0, metavar="S",
                   help="seconds the idle health check's one-token generation may take")
    g.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="seconds in-flight calls may run on after SIGTERM before they are aborted")
    g.add_argument("--log-json", action="store_true", help="JSON log lines")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.set_defaults(func=run)

