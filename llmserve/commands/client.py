"""Client subcommands: `llmserve generate`, `llmserve chat` (stream text from a router to the
terminal as it arrives) and `llmserve health` (a grpc.health.v1 probe, e.g. for container health
checks).

    llmserve generate "Once upon a time" [--router 127.0.0.1:30000] [--max-new-tokens 64] \\
        [--temperature 0] [--stop "."] ...
    llmserve chat [--router HOST:PORT] [--system TEXT] [--message TEXT ...]   # no --message: interactive
    llmserve health HOST:PORT [--service NAME] [--wait SECONDS]

The router address defaults to $LLMSERVE_ROUTER, else 127.0.0.1:30000. A router serving TLS:
`--tls-ca FILE` (or `--tls` for the system's roots), plus `--tls-cert/--tls-key` when it requires a
client certificate; one requiring a token: `--token-file FILE` (its first token is sent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from llmserve.security_args import add_client_args

DEFAULT_ROUTER = "127.0.0.1:30000"


def _router_default() -> str:
    return os.environ.get("LLMSERVE_ROUTER", DEFAULT_ROUTER)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default=None, metavar="HOST:PORT",
                   help=f"router address (default $LLMSERVE_ROUTER or {DEFAULT_ROUTER})")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=None, help="default: what the context leaves")
    g.add_argument("--min-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None, help="0 is greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=None,
                   metavar="ID", help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument("--n", type=int, default=None, help="number of sequences")
    g.add_argument("--include-stop-str", dest="include_stop_str_in_output", action="store_true", default=None,
                   help="keep a matched stop string in the output")
    g.add_argument("--keep-special-tokens", dest="skip_special_tokens", action="store_false", default=None,
                   help="keep special tokens in the output text")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print every streamed message as a JSON line")
    o.add_argument("-v", "--verbose", action="store_true", help="print finish reason and usage to stderr")
    o.add_argument("--timeout", type=float, default=None, metavar="S", help="deadline of the call in seconds")
    o.add_argument("--request-id", default=None, help="request id (x-request-id); default: the router assigns one")
    o.add_argument("--model", default="", help="model name (default: the served one)")
    add_client_args(p.add_argument_group("security"))


_SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids",
                  "ignore_eos", "n", "include_stop_str_in_output", "skip_special_tokens")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _SAMPLING_KEYS if getattr(args, k) is not None}


def _delta_json(d: Any) -> str:
    out: dict[str, Any] = {"index": d.index, "text": d.text, "token_ids": list(d.token_ids),
                           "request_id": d.request_id}
    if d.finish is not None:
        out["finish"] = {k: v for k, v in vars(d.finish).items() if v not in (None, "")}
    return json.dumps(out, ensure_ascii=False)


def _print_stream(deltas: Any, args: argparse.Namespace) -> list[Any]:
    """Stream to stdout (index 0 live; other indexes printed when they finish); return finishes."""
    finishes = []
    others: dict[int, str] = {}
    for d in deltas:
        if args.json:
            print(_delta_json(d), flush=True)
        elif d.index == 0:
            sys.stdout.write(d.text)
            sys.stdout.flush()
        else:
            others[d.index] = others.get(d.index, "") + d.text
        if d.finish is not None:
            finishes.append((d.index, d.finish))
    if not args.json:
        sys.stdout.write("\n")
        for i in sorted(others):
            sys.stdout.write(f"--- sequence {i} ---\n{others[i]}\n")
        sys.stdout.flush()
    if args.verbose:
        for i, f in sorted(finishes):
            stop = f" stop={f.stop_str!r}" if f.stop_str is not None else (
                f" stop_token_id={f.stop_token_id}" if f.stop_token_id is not None else "")
            msg = f" ({f.message})" if f.message else ""
            print(f"[{i}] finish={f.reason}{stop} prompt_tokens={f.prompt_tokens} "
                  f"completion_tokens={f.completion_tokens}{msg}", file=sys.stderr)
    return finishes


def _rpc_failed(cmd: str, exc: Any) -> int:
    print(f"llmserve {cmd}: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1


def _client(cmd: str, args: argparse.Namespace) -> Any:
    """A RouterClient with the security flags applied; None (after a message) when they are bad."""
    from llmserve.security import SecurityConfigError
    from llmserve.security_args import client_security_from_args
    from router.client import RouterClient

    try:
        security = client_security_from_args(args)
    except SecurityConfigError as exc:
        print(f"llmserve {cmd}: {exc}", file=sys.stderr)
        return None
    return RouterClient(args.router or _router_default(), tls=security.tls, token=security.token)


def _run_generate(args: argparse.Namespace) -> int:
    import grpc

    client = _client("generate", args)
    if client is None:
        return 2
    try:
        deltas = client.generate(args.prompt, model=args.model, request_id=args.request_id, timeout=args.timeout,
                                 **_sampling(args))
        _print_stream(deltas, args)
        return 0
    except grpc.RpcError as exc:
        return _rpc_failed("generate", exc)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _run_chat(args: argparse.Namespace) -> int:
    import grpc

    client = _client("chat", args)
    if client is None:
        return 2
    history: list[tuple[str, str]] = [("system", args.system)] if args.system else []
    sampling = _sampling(args)

    def reply() -> Any:
        text = []
        for d in client.chat(history, model=args.model, request_id=args.request_id, timeout=args.timeout,
                             **sampling):
            if d.index == 0:
                text.append(d.text)
            yield d
        history.append(("assistant", "".join(text)))

    try:
        if args.message:
            for m in args.message:
                history.append(("user", m))
            _print_stream(reply(), args)
            return 0
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\n")
            if line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            history.append(("user", line))
            try:
                _print_stream(reply(), args)
            except grpc.RpcError as exc:
                history.pop()
                _rpc_failed("chat", exc)
                if not interactive:
                    return 1
    except grpc.RpcError as exc:
        return _rpc_failed("chat", exc)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _run_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from llmserve.security import SecurityConfigError
    from llmserve.security_args import client_security_from_args

    try:
        security = client_security_from_args(args)
    except SecurityConfigError as exc:
        print(f"llmserve health: {exc}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    status_name = "UNKNOWN"
    with security.channel(args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
                status_name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    if not args.quiet:
                        print(f"{args.address}: SERVING")
                    return 0
            except grpc.RpcError as exc:
                status_name = f"{exc.code().name}: {exc.details()}"
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    if not args.quiet:
        print(f"{args.address}: {status_name}", file=sys.stderr)
    return 1


def register_generate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("generate", help="stream a completion from a router",
                              description="Stream the completion of PROMPT from an llmserve router to stdout.")
    p.add_argument("prompt", help="the prompt text")
    _add_sampling_args(p)
    p.set_defaults(func=_run_generate)


def register_chat(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "chat", help="chat with the model through a router (interactive, or one-shot with --message)",
        description="Chat through the model's chat template. Without --message, read user turns from stdin "
        "(one per line; /exit or EOF ends) and stream each reply.")
    p.add_argument("--message", action="append", default=None, metavar="TEXT",
                   help="a user message (repeatable): answer once and exit")
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(p)
    p.set_defaults(func=_run_chat)


def register_health(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("health", help="grpc.health.v1 check of a server (exit 0 when SERVING)",
                              description="Check a server's grpc.health.v1 status; exit 0 when SERVING, else 1.")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help="service name (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="timeout of one check")
    p.add_argument("--wait", type=float, default=0.0, metavar="S", help="keep retrying for up to S seconds")
    p.add_argument("-q", "--quiet", action="store_true")
    add_client_args(p.add_argument_group("security (grpc.health.v1 needs no token)"), token=False)
    p.set_defaults(func=_run_health)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    register_generate(subparsers)
    register_chat(subparsers)
    register_health(subparsers)
