"""`llmserve serve`: a whole local cluster on this machine, as child processes.

    llmserve serve --model DIR [--dp M] [--port 30000] [--host 127.0.0.1] [engine flags] \\
        [--demo-prompt TEXT | --demo-chat TEXT] [--exit-after-demo]

Starts the tokenizer service and M workers (each on an ephemeral port it reports through
--port-file), waits until every one answers grpc.health.v1 SERVING, then starts the router in front
of them and waits for it too. Prints the router's address and an example client command, and keeps
serving until SIGINT/SIGTERM: then the router stops first (in-flight requests may finish for
--shutdown-grace seconds, the rest are aborted), then the workers and the tokenizer; exit 0.

Supervision (llmserve/supervisor.py): a child that dies while the cluster serves is restarted on the
port it had, after --restart-backoff seconds doubling per recent restart, while the others keep
serving (the router routes around a dead worker group and probes it back). A TP group whose
follower died is restarted too: its rank 0 exits 1 once the group breaks (--tp-fault-exit-delay of
`llmserve worker`), and its followers die with it. A child needing more than --max-restarts
restarts within --restart-window seconds stops the cluster, and the command exits 1 with the last
lines of that child's log (--max-restarts 0: the first death does). A child failing during start-up
stops the cluster at once. No child outlives this process, even after kill -9 (parent-death signal
plus a parent watch); their pids are in LOG_DIR/pids.json. Children run in their own session, so a
terminal's Ctrl-C reaches only this process, which then shuts them down in order. Their logs go to
--log-dir (default: a new temporary folder).

Metrics (docs/metrics.md): --metrics-port BASE gives every process its own Prometheus endpoint on
--host, on consecutive ports: the router BASE, the tokenizer BASE+1, worker group i's rank r
BASE+2+i*tp+r. Default 0: no metrics.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from llmserve.arg_types import count, port_number, positive_seconds, seconds
from llmserve.commands.engine_args import add_engine_args, engine_argv
from llmserve.commands.router import DEFAULT_ROUTER_PORT, POLICIES, add_limit_args, limit_argv
from llmserve.commands.worker import add_worker_limit_args, worker_limit_argv
from llmserve.security_args import ServeSecurity, add_serve_args
from llmserve.supervisor import Child, ChildFailed, RestartPolicy, Supervisor
from worker_svc.config.tp_comm import TP_COMM_CHOICES, TP_COMM_HELP


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "serve", help="run a local cluster: tokenizer service, worker group(s) and the router",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("cluster")
    g.add_argument("--dp", type=int, default=1, metavar="M", help="data-parallel worker groups (default 1)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks per worker group (each group's rank 0 starts its followers)")
    g.add_argument("--tp-comm", choices=TP_COMM_CHOICES, default="auto", help=TP_COMM_HELP)
    g.add_argument("--host", default="127.0.0.1", help="address every process listens on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT,
                   help=f"the router's port (default {DEFAULT_ROUTER_PORT}; 0: any free port)")
    g.add_argument("--policy", choices=POLICIES, default="least_load", help="the router's routing policy")
    g.add_argument("--metrics-port", type=port_number, default=0, metavar="BASE",
                   help="Prometheus metrics of every process on --host, consecutive ports from BASE: router BASE, "
                   "tokenizer BASE+1, worker group i rank r BASE+2+i*tp+r (docs/metrics.md). Default 0: none")
    add_limit_args(p)
    add_worker_limit_args(p.add_argument_group("worker limits"))
    g.add_argument("--served-model-name", default=None, help="model name clients may send (default: folder name)")
    g.add_argument("--log-dir", default=None, help="children's log files (default: a new temporary folder)")
    g.add_argument("--log-json", action="store_true", help="children log JSON lines")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="seconds every child may take to become healthy (default 600)")
    g.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="seconds in-flight requests may run on after SIGINT/SIGTERM (default 5)")
    g.add_argument("--probe-interval", type=float, default=1.0, metavar="S",
                   help="the router's worker probe interval (default 1)")
    r = p.add_argument_group("supervision")
    r.add_argument("--restart-backoff", type=seconds, default=1.0, metavar="S",
                   help="a dead child is restarted after S seconds, doubling with each recent restart (default 1)")
    r.add_argument("--restart-backoff-max", type=seconds, default=30.0, metavar="S",
                   help="the longest wait before a restart (default 30)")
    r.add_argument("--max-restarts", type=count, default=5, metavar="N",
                   help="a child needing more than N restarts within --restart-window stops the cluster "
                   "(default 5; 0: any child's death stops the cluster)")
    r.add_argument("--restart-window", type=positive_seconds, default=300.0, metavar="S",
                   help="the sliding window --max-restarts counts in (default 300)")
    add_serve_args(p.add_argument_group("security (docs/security.md)"))
    d = p.add_argument_group("demo")
    demo = d.add_mutually_exclusive_group()
    demo.add_argument("--demo-prompt", default=None, metavar="TEXT",
                      help="once ready, stream one greedy generation of TEXT through the router")
    demo.add_argument("--demo-chat", default=None, metavar="TEXT",
                      help="once ready, stream a greedy chat answer to the user message TEXT through the router")
    d.add_argument("--demo-max-new-tokens", type=int, default=32, metavar="N")
    d.add_argument("--exit-after-demo", action="store_true", help="shut down after the demo instead of serving")
    p.set_defaults(func=run)


def _health_channel(security: ServeSecurity):
    """address -> a channel to a child's grpc.health.v1 (TLS and the internal token when configured)."""
    from llmserve.security import ChannelSecurity

    return (security.client or ChannelSecurity()).channel


def _connect_host(host: str) -> str:
    """Where to reach a server listening on `host` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _demo(router: str, args: argparse.Namespace, security: ServeSecurity = ServeSecurity()) -> bool:
    import grpc

    from router.client import RouterClient

    sampling = {"max_new_tokens": args.demo_max_new_tokens, "temperature": 0.0}
    if args.demo_chat is not None:
        print(f"llmserve serve: demo chat: {args.demo_chat!r} ->", flush=True)
    else:
        print(f"llmserve serve: demo: {args.demo_prompt!r} ->", flush=True)
    try:
        client_security = security.client
        with RouterClient(router, tls=client_security.tls if client_security else None,
                          token=client_security.token if client_security else None) as client:
            if args.demo_chat is not None:
                stream = client.chat([("user", args.demo_chat)], **sampling)
            else:
                stream = client.generate(args.demo_prompt, **sampling)
            finish = None
            for d in stream:
                sys.stdout.write(d.text)
                sys.stdout.flush()
                finish = d.finish or finish
        sys.stdout.write("\n")
        if finish is not None:
            print(f"llmserve serve: demo finished ({finish.reason}, {finish.completion_tokens} tokens)", flush=True)
        return True
    except grpc.RpcError as exc:
        print(f"\nllmserve serve: demo failed: {exc.code().name}: {exc.details()}", file=sys.stderr, flush=True)
        return False


def run(args: argparse.Namespace) -> int:
    if args.tp < 1:
        print(f"llmserve serve: --tp must be >= 1, got {args.tp}", file=sys.stderr)
        return 2
    if args.dp < 1:
        print(f"llmserve serve: --dp must be >= 1, got {args.dp}", file=sys.stderr)
        return 2
    if args.metrics_port and metrics_ports(args.metrics_port, args.dp, args.tp)[-1] > 65535:
        print(f"llmserve serve: --metrics-port {args.metrics_port}: the cluster needs {2 + args.dp * args.tp} "
              "consecutive ports from it, past 65535", file=sys.stderr)
        return 2
    model = Path(args.model).resolve()
    for name in ("config.json", "tokenizer.json"):
        if not (model / name).is_file():
            print(f"llmserve serve: {model / name} not found", file=sys.stderr)
            return 2
    from llmserve.security import SecurityConfigError
    from llmserve.security_args import serve_security_from_args

    try:  # every certificate and token file checked before any child starts
        security = serve_security_from_args(args)
    except SecurityConfigError as exc:
        print(f"llmserve serve: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="llmserve-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_cluster(args, model, log_dir, stop, security)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def metrics_ports(base: int, dp: int, tp: int) -> list[int]:
    """[router, tokenizer, worker 0 rank 0, ...] metrics ports from ``base`` (worker group i's rank r:
    base + 2 + i*tp + r; each group's leader hands rank r its own port + r)."""
    return [base + k for k in range(2 + dp * tp)]


def _metrics_argv(port: int) -> list[str]:
    return ["--metrics-port", str(port)] if port else []


def _run_cluster(args: argparse.Namespace, model: Path, log_dir: Path, stop: threading.Event,
                 security: ServeSecurity = ServeSecurity()) -> int:
    from llmserve.grpc_server import grpc_address
    from llmserve.security import write_new_token

    py = [sys.executable, "-m", "llmserve.cli"]
    common = ["--log-level", args.log_level] + (["--log-json"] if args.log_json else [])
    # With client auth on, the backends take only the router's internal token, so a client cannot
    # step around the router's auth by calling a worker's port.
    internal_token = write_new_token(log_dir / "internal.token") if security.auth_token_file else None
    base_env = {"PYTHONUNBUFFERED": "1"}
    worker_env = dict(base_env)
    if "OMP_NUM_THREADS" not in os.environ and args.device == "cpu":
        # M workers on one machine share its cores; unbounded OpenMP pools would oversubscribe it.
        worker_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (args.dp * args.tp)))
    served = args.served_model_name or model.name
    ports = metrics_ports(args.metrics_port, args.dp, args.tp) if args.metrics_port else [0] * (2 + args.dp * args.tp)
    router_metrics, tokenizer_metrics = ports[0], ports[1]
    worker_metrics = [ports[2 + i * args.tp] for i in range(args.dp)]

    tokenizer = Child("tokenizer", py + ["tokenizer", "--model", str(model), "--host", args.host, "--port", "0",
                                         "--port-file", str(log_dir / "tokenizer.port"),
                                         *_metrics_argv(tokenizer_metrics),
                                         *security.backend_argv(internal_token), *common],
                      log_dir / "tokenizer.log", log_dir / "tokenizer.port", base_env)
    workers = [
        Child(f"worker {i}", py + ["worker", "--model", str(model), "--host", args.host, "--port", "0",
                                   "--port-file", str(log_dir / f"worker{i}.port"), "--served-model-name", served,
                                   *(["--tp", str(args.tp), "--tp-comm", args.tp_comm] if args.tp > 1 else []),
                                   *_metrics_argv(worker_metrics[i]), *engine_argv(args),
                                   *worker_limit_argv(args), *security.backend_argv(internal_token), *common],
              log_dir / f"worker{i}.log", log_dir / f"worker{i}.port", worker_env)
        for i in range(args.dp)
    ]
    backends = [tokenizer, *workers]
    router: Child | None = None
    t0 = time.monotonic()
    connect = _connect_host(args.host)
    policy = RestartPolicy(backoff_s=args.restart_backoff, max_backoff_s=max(args.restart_backoff,
                           args.restart_backoff_max), max_restarts=args.max_restarts, window_s=args.restart_window)
    supervisor = Supervisor(policy, connect, _health_channel(security), args.startup_timeout, log_dir / "pids.json")

    def stop_all(grace: float, but: Child | None = None) -> None:
        started = [c for c in supervisor.children if c is not but]
        supervisor.stop([[c for c in started if c is router], [c for c in started if c is not router]], grace)

    print(f"llmserve serve: starting the tokenizer service and {args.dp} worker group(s) for {model} "
          f"(logs in {log_dir})", flush=True)
    try:
        for child in backends:
            supervisor.start(child)
        supervisor.wait_ready(backends, stop)
        if not stop.is_set():
            router = Child("router", py + [
                "router", "--tokenizer", grpc_address(connect, tokenizer.address_port),
                "--workers", ",".join(grpc_address(connect, w.address_port) for w in workers),
                "--host", args.host, "--port", str(args.port), "--port-file", str(log_dir / "router.port"),
                "--policy", args.policy, "--served-model-name", served, "--probe-interval", str(args.probe_interval),
                "--shutdown-grace", str(args.shutdown_grace), *limit_argv(args), *security.router_argv(internal_token),
                *_metrics_argv(router_metrics), *common],
                log_dir / "router.log", log_dir / "router.port", base_env)
            supervisor.start(router)
            supervisor.wait_ready([router], stop)
        if stop.is_set():
            print("llmserve serve: interrupted during startup; stopping", flush=True)
            stop_all(args.shutdown_grace)
            return 0

        assert router is not None
        address = grpc_address(connect, router.address_port)
        print(f"llmserve serve: ready in {time.monotonic() - t0:.1f}s", flush=True)
        print(f"  router     {address}  (llmserve.v1.Router, grpc.health.v1, reflection; pid {router.pid})")
        for i, w in enumerate(workers):
            print(f"  worker {i}   {grpc_address(connect, w.address_port)}  (sglang.grpc.scheduler.SglangScheduler; "
                  f"pid {w.pid})")
        print(f"  tokenizer  {grpc_address(connect, tokenizer.address_port)}  "
              f"(llmserve.v1.Tokenizer; pid {tokenizer.pid})")
        if args.metrics_port:
            ranks = ", ".join(f"worker {i} rank {r} {worker_metrics[i] + r}"
                              for i in range(args.dp) for r in range(args.tp))
            print(f"  metrics    http://{grpc_address(connect, router_metrics)}/metrics (router), tokenizer "
                  f"{tokenizer_metrics}, {ranks}")
        flags = "".join(f" {a}" for a in security.client_argv())
        print(f'  try:  llmserve generate --router {address}{flags} "Once upon a time" --max-new-tokens 32')
        print(f"        llmserve chat --router {address}{flags}")
        print(f"llmserve serve: router listening on {address}", flush=True)

        if args.demo_prompt is not None or args.demo_chat is not None:
            ok = _demo(address, args, security)
            if args.exit_after_demo:
                stop_all(args.shutdown_grace)
                return 0 if ok else 1
        print("llmserve serve: serving; Ctrl-C or SIGTERM stops the cluster", flush=True)
        while not stop.wait(0.2):
            failure = supervisor.poll()  # restarts the dead; a failure here has used up its restarts
            if failure is not None:
                print(f"llmserve serve: stopping the cluster: {failure}", file=sys.stderr, flush=True)
                stop_all(args.shutdown_grace, but=failure.child)
                return 1
        print("llmserve serve: stopping", flush=True)
        stop_all(args.shutdown_grace)
        print("llmserve serve: stopped", flush=True)
        return 0
    except ChildFailed as exc:  # during start-up: fail fast
        child = exc.child
        print(
            f"llmserve serve: {exc}; last lines of its log ({child.log_path}):\n{child.tail()}",
            file=sys.stderr,
            flush=True,
        )
        stop_all(args.shutdown_grace, but=child)
        child.kill()
        return 1
    except BaseException:
        stop_all(0.0)
        raise
