"""`llmserve serve`: a whole local cluster on this machine, as child processes.

    llmserve serve --model DIR [--dp M] [--port 30000] [--host 127.0.0.1] [engine flags] \\
        [--demo-prompt TEXT | --demo-chat TEXT] [--exit-after-demo]

Starts the tokenizer service and M workers (each on an ephemeral port it reports through
--port-file), waits until every one answers grpc.health.v1 SERVING, then starts the router in front
of them and waits for it too. Prints the router's address and an example client command, and keeps
serving until SIGINT/SIGTERM: then the router stops first (in-flight requests may finish for
--shutdown-grace seconds, the rest are aborted), then the workers and the tokenizer; exit 0. If
any child dies, the others are stopped and the command exits 1 with the last lines of that child's
log. Children run in their own session, so a terminal's Ctrl-C reaches only this process, which
then shuts them down in order. Their logs go to --log-dir (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmserve.router_command import DEFAULT_ROUTER_PORT, POLICIES
from worker_svc.cli_args import add_engine_args, engine_argv

TAIL_LINES = 25


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser(
        "serve", help="run a local cluster: tokenizer service, worker group(s) and the router",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("cluster")
    g.add_argument("--dp", type=int, default=1, metavar="M", help="data-parallel worker groups (default 1)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks per worker group (each group's rank 0 starts its followers)")
    g.add_argument("--host", default="127.0.0.1", help="address every process listens on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT,
                   help=f"the router's port (default {DEFAULT_ROUTER_PORT}; 0: any free port)")
    g.add_argument("--policy", choices=POLICIES, default="least_load", help="the router's routing policy")
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
    d = p.add_argument_group("demo")
    demo = d.add_mutually_exclusive_group()
    demo.add_argument("--demo-prompt", default=None, metavar="TEXT",
                      help="once ready, stream one greedy generation of TEXT through the router")
    demo.add_argument("--demo-chat", default=None, metavar="TEXT",
                      help="once ready, stream a greedy chat answer to the user message TEXT through the router")
    d.add_argument("--demo-max-new-tokens", type=int, default=32, metavar="N")
    d.add_argument("--exit-after-demo", action="store_true", help="shut down after the demo instead of serving")
    p.set_defaults(func=run)


class ChildFailed(Exception):
    def __init__(self, child: Child, what: str):
        super().__init__(what)
        self.child = child


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    port_file: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    port: int | None = None

    def start(self) -> None:
        self.port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            # Own session: a terminal's Ctrl-C goes to `serve` alone, which stops children in order.
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env}, start_new_session=True)

    @property
    def address_port(self) -> int:
        assert self.port is not None
        return self.port

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in lines[-n:]) or "    (empty log)"

    def check(self, when: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ChildFailed(self, f"{self.name} exited with code {self.proc.returncode} {when}")

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def _wait_port(child: Child, deadline: float, stop: threading.Event) -> None:
    while not child.port_file.exists():
        child.check("during startup")
        if time.monotonic() > deadline:
            raise ChildFailed(child, f"{child.name} did not report its port in time")
        if stop.wait(0.05):
            return
    child.port = int(child.port_file.read_text().strip())


def _wait_healthy(children: list[Child], host: str, deadline: float, stop: threading.Event) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for child in children:
        _wait_port(child, deadline, stop)
        if stop.is_set():
            return
    for child in children:
        with grpc.insecure_channel(_join(_connect_host(host), child.address_port)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                child.check("during startup")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise ChildFailed(child, f"{child.name} did not become healthy in time")
                if stop.wait(0.1):
                    return


def _connect_host(host: str) -> str:
    """Where to reach a server listening on `host` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _stop_children(groups: list[list[Child]], grace: float) -> None:
    """SIGTERM group by group (router first), waiting for each group; SIGKILL what does not exit."""
    for group in groups:
        for child in group:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace + 15.0
        for child in group:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"llmserve serve: {child.name} did not stop; killing it", file=sys.stderr)
                child.proc.kill()
                child.proc.wait(10)


def _report_failure(exc: ChildFailed) -> None:
    child = exc.child
    print(f"llmserve serve: {exc}; last lines of its log ({child.log_path}):\n{child.tail()}",
          file=sys.stderr, flush=True)


def _demo(router: str, args: argparse.Namespace) -> bool:
    import grpc

    from router.client import RouterClient

    sampling = {"max_new_tokens": args.demo_max_new_tokens, "temperature": 0.0}
    if args.demo_chat is not None:
        print(f"llmserve serve: demo chat: {args.demo_chat!r} ->", flush=True)
    else:
        print(f"llmserve serve: demo: {args.demo_prompt!r} ->", flush=True)
    try:
        with RouterClient(router) as client:
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
    model = Path(args.model).resolve()
    for name in ("config.json", "tokenizer.json"):
        if not (model / name).is_file():
            print(f"llmserve serve: {model / name} not found", file=sys.stderr)
            return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="llmserve-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_cluster(args, model, log_dir, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_cluster(args: argparse.Namespace, model: Path, log_dir: Path, stop: threading.Event) -> int:
    py = [sys.executable, "-m", "llmserve.cli"]
    common = ["--log-level", args.log_level] + (["--log-json"] if args.log_json else [])
    base_env = {"PYTHONUNBUFFERED": "1"}
    worker_env = dict(base_env)
    if "OMP_NUM_THREADS" not in os.environ and args.device == "cpu":
        # M workers on one machine share its cores; unbounded OpenMP pools would oversubscribe it.
        worker_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (args.dp * args.tp)))
    served = args.served_model_name or model.name

    tokenizer = Child("tokenizer", py + ["tokenizer", "--model", str(model), "--host", args.host, "--port", "0",
                                         "--port-file", str(log_dir / "tokenizer.port"), *common],
                      log_dir / "tokenizer.log", log_dir / "tokenizer.port", base_env)
    workers = [
        Child(f"worker {i}", py + ["worker", "--model", str(model), "--host", args.host, "--port", "0",
                                   "--port-file", str(log_dir / f"worker{i}.port"), "--served-model-name", served,
                                   *(["--tp", str(args.tp)] if args.tp > 1 else []), *engine_argv(args), *common],
              log_dir / f"worker{i}.log", log_dir / f"worker{i}.port", worker_env)
        for i in range(args.dp)
    ]
    backends = [tokenizer, *workers]
    started: list[Child] = []
    router: Child | None = None
    t0 = time.monotonic()
    deadline = t0 + args.startup_timeout
    connect = _connect_host(args.host)
    print(f"llmserve serve: starting the tokenizer service and {args.dp} worker group(s) for {model} "
          f"(logs in {log_dir})", flush=True)
    try:
        for child in backends:
            child.start()
            started.append(child)
        _wait_healthy(backends, args.host, deadline, stop)
        if not stop.is_set():
            router = Child("router", py + [
                "router", "--tokenizer", _join(connect, tokenizer.address_port),
                "--workers", ",".join(_join(connect, w.address_port) for w in workers),
                "--host", args.host, "--port", str(args.port), "--port-file", str(log_dir / "router.port"),
                "--policy", args.policy, "--served-model-name", served, "--probe-interval", str(args.probe_interval),
                "--shutdown-grace", str(args.shutdown_grace), *common],
                log_dir / "router.log", log_dir / "router.port", base_env)
            router.start()
            started.append(router)
            _wait_healthy([router], args.host, deadline, stop)
        if stop.is_set():
            print("llmserve serve: interrupted during startup; stopping", flush=True)
            _stop_children([[c for c in started if c is router], [c for c in started if c is not router]],
                           args.shutdown_grace)
            return 0

        assert router is not None
        address = _join(connect, router.address_port)
        print(f"llmserve serve: ready in {time.monotonic() - t0:.1f}s", flush=True)
        print(f"  router     {address}  (llmserve.v1.Router, grpc.health.v1, reflection; pid {router.proc.pid})")
        for i, w in enumerate(workers):
            print(f"  worker {i}   {_join(connect, w.address_port)}  (sglang.grpc.scheduler.SglangScheduler; "
                  f"pid {w.proc.pid})")
        print(f"  tokenizer  {_join(connect, tokenizer.address_port)}  (llmserve.v1.Tokenizer; pid {tokenizer.proc.pid})")
        print(f"  try:  llmserve generate --router {address} \"Once upon a time\" --max-new-tokens 32")
        print(f"        llmserve chat --router {address}")
        print(f"llmserve serve: router listening on {address}", flush=True)

        if args.demo_prompt is not None or args.demo_chat is not None:
            ok = _demo(address, args)
            if args.exit_after_demo:
                _stop_children([[router], backends], args.shutdown_grace)
                return 0 if ok else 1
        print("llmserve serve: serving; Ctrl-C or SIGTERM stops the cluster", flush=True)
        while not stop.wait(0.2):
            for child in started:
                child.check("unexpectedly")
        print("llmserve serve: stopping", flush=True)
        _stop_children([[router], backends], args.shutdown_grace)
        print("llmserve serve: stopped", flush=True)
        return 0
    except ChildFailed as exc:
        _report_failure(exc)
        others = [c for c in started if c is not exc.child]
        _stop_children([[c for c in others if c is router], [c for c in others if c is not router]],
                       args.shutdown_grace)
        return 1
    except BaseException:
        _stop_children([[c for c in started if c is router], [c for c in started if c is not router]], 0.0)
        raise
