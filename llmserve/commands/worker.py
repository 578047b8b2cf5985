"""`llmserve worker`: one model worker serving sglang.grpc.scheduler.SglangScheduler.

    llmserve worker --model DIR --host 127.0.0.1 --port 30001 [engine flags] [--log-json]

Builds the engine (model load, KV pool), serves until SIGINT/SIGTERM, then drains and exits 0.
With ``--port 0`` the OS picks a free port; the bound address is logged and printed, and written to
``--port-file`` (atomically) once the server accepts calls.

Tensor parallelism (worker_svc/server/tp_leader.py, tp_follower.py, launch.py):

    llmserve worker --tp 2 ...                       # one machine: rank 0 starts ranks 1.. itself
    llmserve worker --tp-size 2 --tp-rank R --dist-init-addr HOST:PORT ...   # one process per rank

Rank 0 serves SglangScheduler + grpc.health.v1 on --port; ranks > 0 serve only grpc.health.v1 on
their own --port (SERVING while their step loop runs) and never talk to a router. A dead or hung
rank is detected within --tp-timeout seconds: the leader then reports NOT_SERVING (and fails
in-flight requests with UNAVAILABLE) for --tp-fault-exit-delay seconds and exits 1, so whatever
supervises it restarts the group; followers exit 1. Followers that rank 0 started die with it.
The ranks' heartbeat handshake proves a shared secret (--tp-secret-file with one process per rank).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from llmserve.arg_types import add_metrics_port_arg, count, positive_count, positive_seconds
from llmserve.commands.engine_args import (
    add_engine_args,
    add_heap_policy_arg,
    apply_heap_policy_logged,
    engine_config_from_args,
)
from llmserve.logging import configure_logging
from llmserve.security_args import add_server_args
from worker_svc.config.tp_comm import TP_COMM_CHOICES, TP_COMM_HELP
from worker_svc.config.tp_timeouts import TP_CONNECT_TIMEOUT_S, TP_SERVING_TIMEOUT_S

if TYPE_CHECKING:
    from llmserve.security import ServerSecurity
    from worker_svc.server.servicer import WorkerOptions

log = structlog.get_logger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")


def _tp_layout(args: argparse.Namespace) -> tuple[int, int, str]:
    """(size, rank, init address: "" at TP=1); single-machine ``--tp N`` picks a loopback address."""
    size = args.tp_size or 1
    if size < 1:
        raise ValueError("--tp must be at least 1")
    if not 0 <= args.tp_rank < size:
        raise ValueError(f"--tp-rank {args.tp_rank} out of range for --tp {size}")
    if size > 1 and args.dist_init_addr is None:
        if args.tp_rank != 0:
            raise ValueError("--tp-rank > 0 needs --dist-init-addr (the leader's rendezvous address)")
        from worker_svc.parallel.group import free_port

        return size, 0, f"127.0.0.1:{free_port()}"
    return size, args.tp_rank, args.dist_init_addr or ""


async def _serve(args: argparse.Namespace, security: ServerSecurity) -> int:
    from llmserve.grpc_server import stop_signal_event, write_port_file
    from llmserve.metrics import FollowerMetrics, MetricsConfig, WorkerMetrics
    from worker_svc.engine.engine import Engine
    from worker_svc.engine.engine_loop import EngineLoop
    from worker_svc.engine.step_trace import StepTraceFile
    from worker_svc.server.app import WorkerServer
    from worker_svc.server.loader_thread import run_in_own_thread

    apply_heap_policy_logged(args.malloc_mmap_threshold)
    config = engine_config_from_args(args)
    size, rank, init_addr = _tp_layout(args)
    tp_secret = _tp_secret(args, os.environ) if size > 1 else None
    metrics_config = MetricsConfig(args.host, args.metrics_port)
    if rank > 0:
        from worker_svc.server.tp_follower import serve_follower

        def listening(port: int) -> None:
            if args.port_file:
                write_port_file(args.port_file, port)
            print(f"llmserve worker (tp rank {rank}/{size}, health only) listening on {args.host}:{port}", flush=True)

        return await serve_follower(
            config, rank, size, init_addr, args.host, args.port, args.tp_timeout, args.tp_connect_timeout,
            args.shutdown_grace, listening, tp_secret, args.tp_comm,
            metrics=FollowerMetrics.create(metrics_config) if args.metrics_port else None,
        )

    metrics = WorkerMetrics.create(metrics_config) if args.metrics_port else None
    step_trace = StepTraceFile(args.trace_steps) if args.trace_steps else None
    leader = None
    before_step = _step_delay(args.debug_step_delay) if args.debug_step_delay else None
    if size > 1:
        from llmserve import parent_death
        from llmserve.commands.engine_args import engine_argv
        from worker_svc.parallel.collective_observer import StepCollectives
        from worker_svc.parallel.heartbeat import new_secret
        from worker_svc.server.launch import spawn_follower_processes
        from worker_svc.server.tp_leader import TPLeader

        children = []
        if args.dist_init_addr is None:  # single-machine mode: this process starts the other ranks
            # Followers run steps too: the heap policy is theirs as well.
            shared = engine_argv(args, include_model=True) + [
                "--log-level", args.log_level, "--tp-timeout", str(args.tp_timeout), "--tp-comm", args.tp_comm,
                "--shutdown-grace", str(args.shutdown_grace), f"--malloc-mmap-threshold={args.malloc_mmap_threshold}"]
            tp_secret = tp_secret or new_secret()
            # Spawned from this (the event loop's) thread, which lives as long as the process: the
            # followers' parent-death signal fires when this process dies, not earlier.
            children = spawn_follower_processes(
                size, init_addr, shared + (["--log-json"] if args.log_json else []), tp_secret,
                env={**os.environ, **parent_death.child_env()}, preexec_fn=parent_death.die_with_parent_preexec(),
                metrics_port=args.metrics_port)
        try:
            leader = await run_in_own_thread(functools.partial(
                TPLeader.start, config, size, init_addr, args.tp_timeout, args.tp_connect_timeout, children, tp_secret,
                args.tp_comm, collectives=StepCollectives() if metrics is not None else None,
            ))
        except BaseException:
            for child in children:
                child.kill()
                child.wait()
            raise
        engine = leader.engine
        engine_loop = leader.engine_loop(before_step=before_step, metrics=metrics, step_trace=step_trace)
    else:
        engine = await run_in_own_thread(Engine, config)
        engine_loop = EngineLoop(engine, before_step=before_step, metrics=metrics, step_trace=step_trace)
    options = worker_options(args)
    server = WorkerServer(engine, host=args.host, port=args.port, options=options, engine_loop=engine_loop,
                          security=security, metrics=metrics)
    port = await server.start()
    if args.port_file:
        write_port_file(args.port_file, port)
    print(f"llmserve worker listening on {server.address}", flush=True)

    stop = stop_signal_event()
    if leader is not None:
        watch = asyncio.ensure_future(_stop_when_group_breaks(leader, args.tp_fault_exit_delay, stop))
    await stop.wait()
    if leader is not None:
        watch.cancel()
    log.info("shutting down", tp_group_failed=leader is not None and leader.failed)
    await server.stop(args.shutdown_grace)
    if leader is not None:
        code = await asyncio.to_thread(leader.shutdown)
    else:
        code = 0
    if step_trace is not None:
        step_trace.close()
    return code


async def _stop_when_group_breaks(leader, delay_s: float, stop: asyncio.Event) -> None:
    """A broken TP group never heals: after ``delay_s`` (health says NOT_SERVING meanwhile) stop, so
    the process exits 1 and its supervisor restarts the group. ``inf``: wait for a signal instead."""
    reason = await leader.wait_failed()
    if delay_s == float("inf"):
        log.error("tensor-parallel group broken; NOT_SERVING until signalled", reason=reason)
        return
    log.error("tensor-parallel group broken; exiting so the group is restarted", reason=reason, exit_in_s=delay_s)
    await asyncio.sleep(delay_s)
    stop.set()


def _tp_secret(args: argparse.Namespace, environ) -> bytes | None:
    """The group's heartbeat secret: the pipe a single-machine leader gave this follower, else
    --tp-secret-file, else None (the leader makes one; worker_svc/server/launch.py)."""
    from worker_svc.parallel.heartbeat import check_secret
    from worker_svc.server.launch import inherited_secret

    inherited = inherited_secret(environ)
    if inherited is not None:
        return inherited
    if args.tp_secret_file:
        try:
            return check_secret(Path(args.tp_secret_file).read_bytes().strip())
        except OSError as exc:
            raise ValueError(f"--tp-secret-file: cannot read {args.tp_secret_file}: {exc.strerror}") from None
        except ValueError as exc:
            raise ValueError(f"--tp-secret-file: {exc}") from None
    return None


def _delay_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds (or inf), got {text}")
    return value


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    from worker_svc.server.kv_events import KvEventsOptions
    from worker_svc.server.servicer import WorkerOptions

    return WorkerOptions(
        served_model_name=args.served_model_name or Path(args.model).resolve().name,
        advertised_model_path=args.advertised_model_path,
        health_probe_timeout_s=args.health_probe_timeout,
        step_stall_timeout_s=args.step_stall_timeout,
        max_queued_requests=args.max_queued_requests,
        kv_events=KvEventsOptions(block_size=args.kv_events_block_size),
        worker_stream=not args.disable_worker_stream,
    )


def _step_delay(delay_s: float) -> Callable[[], None]:
    """Test hook (--debug-step-delay): EngineLoop's ``before_step`` sleeps at the start of every step, so
    a generation stays in flight."""

    def sleep() -> None:
        time.sleep(delay_s)

    return sleep


def run(args: argparse.Namespace) -> int:
    from llmserve.security import SecurityConfigError
    from llmserve.security_args import server_security_from_args

    configure_logging(json=args.log_json, level=args.log_level)
    try:  # before the model loads: a bad certificate or token file fails at once
        security = server_security_from_args(args, "--internal-token-file")
    except SecurityConfigError as exc:
        print(f"llmserve worker: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args, security))
    except (ValueError, OSError, RuntimeError) as exc:
        log.error("worker failed", error=str(exc))
        return 1


def add_worker_limit_args(g: argparse._ArgumentGroup) -> None:
    """The worker's backpressure, stall detection and heap policy (docs/reliability.md); `serve`
    passes them on to its workers (worker_limit_argv)."""
    g.add_argument(
        "--step-stall-timeout",
        type=positive_seconds,
        default=120.0,
        metavar="S",
        help="with work pending, no engine step completing for this long makes the worker unhealthy "
        "(NOT_SERVING, new requests UNAVAILABLE)",
    )
    add_heap_policy_arg(g)
    g.add_argument(
        "--max-queued-requests",
        type=count,
        default=1024,
        metavar="N",
        help="at most N requests (samples) wait beyond the --max-running-requests slots; a Generate "
        "that would exceed it is refused at once with RESOURCE_EXHAUSTED",
    )


def worker_limit_argv(args: argparse.Namespace) -> list[str]:
    """The flags of add_worker_limit_args as a command line (serve -> worker)."""
    return [
        f"--step-stall-timeout={args.step_stall_timeout}",
        f"--malloc-mmap-threshold={args.malloc_mmap_threshold}",
        f"--max-queued-requests={args.max_queued_requests}",
    ]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    add_metrics_port_arg(g, "serve Prometheus metrics at http://HOST:P/metrics, HOST being --host (plain HTTP, "
                         "no auth; docs/metrics.md); every rank has its own: with --tp N on one machine rank r "
                         "serves on P + r. Default 0: no metrics")
    g.add_argument("--served-model-name", default=None, help="model name reported to gateways (default: folder name)")
    g.add_argument(
        "--advertised-model-path",
        default="",
        metavar="PATH",
        help="model_path/tokenizer_path reported in GetModelInfo (default empty: a gateway given a path "
        "it cannot open may try a model hub). A path valid on the gateway host lets it load the "
        "tokenizer itself; smg 1.13 given a path it cannot find fetches the tokenizer with GetTokenizer",
    )
    g.add_argument(
        "--health-probe-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="seconds the idle health check's one-token generation may take",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds in-flight calls may run on after SIGTERM before they are aborted",
    )
    add_worker_limit_args(g)
    g.add_argument(
        "--kv-events-block-size",
        type=positive_count,
        default=16,
        metavar="N",
        help="tokens per block in the KV cache events of SubscribeKvEvents (what smg's cache_aware policy "
        "and the router's prefix policy route by); the KV pool's page stays 1 token (default 16)",
    )
    g.add_argument(
        "--disable-worker-stream",
        action="store_true",
        help="do not serve llmserve.v1.WorkerStream, on which the router carries all its requests to this worker "
        "in one call (a step's tokens in one message); the router then makes one Generate call per request",
    )
    g.add_argument(
        "--trace-steps",
        default=None,
        metavar="FILE",
        help="write one JSON line per scheduler step to FILE (truncated at start): its time, the requests it "
        "extended (prompt and cached tokens) and decoded, first tokens, the queues after it "
        "(worker_svc/engine/step_trace.py). Rank 0 only. Default: no trace",
    )
    g.add_argument("--debug-step-delay", type=float, default=0.0, metavar="S", help=argparse.SUPPRESS)
    g.add_argument("--log-json", action="store_true", help="JSON log lines")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_server_args(
        p.add_argument_group("security (rank 0's SglangScheduler port)"),
        "--internal-token-file",
        "refuse Generate, Abort, HealthCheck, FlushCache, GetTokenizer ... without this file's "
        "token (the router's --internal-token-file); grpc.health.v1, GetModelInfo, GetServerInfo "
        "and GetLoads stay open",
    )
    t = p.add_argument_group("tensor parallelism")
    t.add_argument(
        "--tp",
        "--tp-size",
        dest="tp_size",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks. Without --dist-init-addr, this process is rank 0 and starts "
        "ranks 1..N-1 itself on this machine",
    )
    t.add_argument(
        "--tp-rank",
        type=int,
        default=0,
        metavar="R",
        help="this process's rank (one process per rank, e.g. one container each); 0 serves gRPC",
    )
    t.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="rank 0's rendezvous address (every rank passes the same one)",
    )
    t.add_argument(
        "--tp-timeout",
        type=float,
        default=TP_SERVING_TIMEOUT_S,
        metavar="S",
        help="a dead or hung rank is detected within this many seconds (heartbeat and collective timeout)",
    )
    t.add_argument("--tp-comm", choices=TP_COMM_CHOICES, default="auto", help=TP_COMM_HELP)
    t.add_argument(
        "--tp-connect-timeout",
        type=float,
        default=TP_CONNECT_TIMEOUT_S,
        metavar="S",
        help="how long ranks wait for each other at start-up (rendezvous and model load)",
    )
    t.add_argument(
        "--tp-fault-exit-delay",
        type=_delay_seconds,
        default=1.0,
        metavar="S",
        help="rank 0: once the group breaks (a rank died or hung), answer NOT_SERVING for S seconds, "
        "then exit 1 so a supervisor restarts the group (default 1; inf: stay up until signalled)",
    )
    t.add_argument(
        "--tp-secret-file",
        default=None,
        metavar="PATH",
        help="one process per rank: a file (mode 0600) holding the group's heartbeat secret, the same "
        "for every rank (at least 16 bytes). --tp N without --dist-init-addr makes its own",
    )
    p.set_defaults(func=run)
