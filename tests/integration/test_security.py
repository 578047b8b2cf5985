"""TLS, mTLS and bearer tokens on real servers over loopback (review finding F15; llmserve/security.py).

A secured cluster runs in this process: the tokenizer service and a worker serve TLS and require
the internal token; the router serves TLS, requires client tokens, and reaches both over TLS with
the internal token. Certificates come from a CA made at test time (tests/certs.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc
from smg_grpc_proto.generated import common_pb2

from llmserve.security import (
    BearerToken,
    ChannelSecurity,
    ChannelTls,
    ServerSecurity,
    ServerTls,
    TokenTable,
    current_identity,
)
from llmserve.v1 import router_pb2 as pb
from llmserve.v1 import router_pb2_grpc as pb_grpc
from llmserve.v1 import tokenizer_pb2 as tpb
from llmserve.v1 import tokenizer_pb2_grpc as tpb_grpc
from llmserve.v1 import worker_stream_pb2 as wpb
from llmserve.v1 import worker_stream_pb2_grpc as wpb_grpc
from router.client import AsyncRouterClient, RouterClient, collect
from tests.certs import Pki, make_pki
from tests.integration.conftest import worker_engine_config

TIMEOUT = 10.0
SERVING = health_pb2.HealthCheckResponse.SERVING
ALICE = "alice-token-0123456789abcdef"  # admin
BOB = "bob-token-0123456789abcdef0000"
INTERNAL = "internal-token-fedcba9876543210"


class Loop:
    """An asyncio loop on a thread, for grpc.aio servers driven by blocking test clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tokens")
    clients, internal = d / "clients.tokens", d / "internal.token"
    clients.write_text(f"# client tokens\n{ALICE} alice admin\n{BOB} bob\n")
    internal.write_text(f"{INTERNAL}\n")
    for f in (clients, internal):
        f.chmod(0o600)
    return {"clients": clients, "internal": internal}


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def _tls(pki: Pki, **kw) -> grpc.ChannelCredentials:
    return ChannelTls.from_files(ca=pki.ca, **kw).credentials()


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def tiny(model_factory) -> Path:
    return model_factory("tiny")


@dataclass
class SecureCluster:
    router: str
    tokenizer: str
    worker: str
    step_delay: list[float]  # seconds the worker sleeps before each forward step (a slow worker on demand)
    on_worker_stream: Callable[[], bool]  # the router carries its requests on the worker's WorkerStream


@pytest.fixture(scope="module")
def cluster(tiny, pki, token_files, loop) -> Iterator[SecureCluster]:
    from router.server import RouterOptions, start_router
    from tokenizer_svc.server import start_server
    from worker_svc.engine.engine import Engine
    from worker_svc.server.app import ServerThread, WorkerServer
    from worker_svc.server.servicer import WorkerOptions

    internal_server = ServerSecurity(ServerTls.from_files(pki.server_cert, pki.server_key),
                                     TokenTable.from_file(token_files["internal"], "--internal-token-file"))
    tok = loop.run(start_server(tiny, "127.0.0.1", 0, internal_server))
    engine = Engine(worker_engine_config(tiny))
    step_delay = [0.0]
    forward = engine.runner.forward

    def slow_forward(step):
        if step_delay[0]:
            time.sleep(step_delay[0])
        return forward(step)

    engine.runner.forward = slow_forward
    worker = ServerThread(WorkerServer(engine, "127.0.0.1", 0,
                                       WorkerOptions(served_model_name="tiny-test"), security=internal_server))
    worker.start()
    internal_channel = ChannelSecurity(ChannelTls.from_files(ca=pki.ca),
                                       BearerToken.from_file(token_files["internal"], "--internal-token-file"))
    options = RouterOptions(tokenizer=f"127.0.0.1:{tok.port}", workers=[f"127.0.0.1:{worker.server.port}"],
                            probe_interval=0.2, internal_security=internal_channel, max_requests_per_client=1)
    public = ServerSecurity(ServerTls.from_files(pki.server_cert, pki.server_key),
                            TokenTable.from_file(token_files["clients"], "--auth-token-file"))
    router = loop.run(start_router(options, "127.0.0.1", 0, public))
    address = f"127.0.0.1:{router.port}"
    with grpc.secure_channel(address, _tls(pki)) as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT, wait_for_ready=True)
        for _ in range(200):
            if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == SERVING:
                break
            loop.run(asyncio.sleep(0.05))
        else:
            raise AssertionError("the secured router never became SERVING")
    yield SecureCluster(address, f"127.0.0.1:{tok.port}", f"127.0.0.1:{worker.server.port}", step_delay,
                        lambda: router.servicer.pool.groups[0].stream is not None)
    loop.run(router.stop(0.5))
    worker.stop(grace=0.5)
    loop.run(tok.stop(0.5))


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


# ---- TLS and mTLS --------------------------------------------------------------------------------


def test_plaintext_client_is_refused_by_a_tls_server(cluster, pki) -> None:
    for address in (cluster.router, cluster.tokenizer, cluster.worker):
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert _code(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=2)) == \
                grpc.StatusCode.UNAVAILABLE
        # A client that trusts another CA refuses the server's certificate.
        with grpc.secure_channel(address, ChannelTls.from_files(ca=pki.other_ca).credentials()) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert _code(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=2)) == \
                grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, _tls(pki)) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status \
                == SERVING


def test_mtls_server_refuses_a_client_without_a_trusted_certificate(tiny, pki, loop) -> None:
    from tokenizer_svc.server import start_server

    security = ServerSecurity(ServerTls.from_files(pki.server_cert, pki.server_key, pki.ca))
    running = loop.run(start_server(tiny, "127.0.0.1", 0, security))
    address = f"127.0.0.1:{running.port}"
    try:
        for creds in (_tls(pki), _tls(pki, cert=pki.other_client_cert, key=pki.other_client_key)):
            with grpc.secure_channel(address, creds) as ch:
                stub = tpb_grpc.TokenizerStub(ch)
                assert _code(lambda: stub.GetInfo(tpb.GetInfoRequest(), timeout=2)) == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, _tls(pki, cert=pki.client_cert, key=pki.client_key)) as ch:
            assert tpb_grpc.TokenizerStub(ch).GetInfo(tpb.GetInfoRequest(), timeout=TIMEOUT).vocab_size > 0
    finally:
        loop.run(running.stop(0.5))


# ---- client tokens on the router ----------------------------------------------------------------


def test_router_refuses_missing_and_wrong_tokens_with_unauthenticated(cluster, pki) -> None:
    request = pb.GenerateRequest(text="Once upon a time", sampling_params=pb.SamplingParams(max_new_tokens=4))
    with grpc.secure_channel(cluster.router, _tls(pki)) as ch:
        stub = pb_grpc.RouterStub(ch)
        for metadata in ((), _auth("not-a-known-token-at-all"), (("authorization", f"Basic {ALICE}"),),
                         _auth(INTERNAL)):  # the internal token is not a client token
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=TIMEOUT, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ALICE not in info.value.details() and INTERNAL not in info.value.details()
            assert _code(lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=TIMEOUT,
                                               metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
        missing = _code(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT))
        assert missing == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open for probes; reflection is behind the token.
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
        query = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            list(reflect.ServerReflectionInfo(iter([query]), timeout=TIMEOUT))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = list(reflect.ServerReflectionInfo(iter([query]), timeout=TIMEOUT, metadata=_auth(BOB)))
        assert any(s.name == "llmserve.v1.Router" for s in listed[0].list_services_response.service)
        # The right token streams a generation.
        responses = list(stub.Generate(request, timeout=TIMEOUT, metadata=_auth(BOB)))
        assert responses[-1].finish.reason == "length" and responses[-1].finish.usage.completion_tokens == 4


def test_list_workers_needs_an_admin_token(cluster, pki) -> None:
    with grpc.secure_channel(cluster.router, _tls(pki)) as ch:
        stub = pb_grpc.RouterStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListWorkers(pb.ListWorkersRequest(), timeout=TIMEOUT, metadata=_auth(BOB))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin" in info.value.details() and "bob" in info.value.details()
        assert len(stub.ListWorkers(pb.ListWorkersRequest(), timeout=TIMEOUT, metadata=_auth(ALICE)).groups) == 1


def test_router_clients_stream_over_tls_with_a_token(cluster, pki) -> None:
    tls = ChannelTls.from_files(ca=pki.ca)
    with RouterClient(cluster.router, timeout=TIMEOUT, tls=tls, token=BOB) as client:
        (done,) = collect(client.generate("Once upon a time", max_new_tokens=5, temperature=0))
        assert done.finish.completion_tokens == 5
        assert client.tokenize("hello") and client.model_info().model
    assert cluster.on_worker_stream()  # TLS and the internal token on the router's worker stream too
    with RouterClient(cluster.router, timeout=TIMEOUT, tls=tls) as anonymous:
        assert _code(lambda: anonymous.generate_text("hi", max_new_tokens=2)) == grpc.StatusCode.UNAUTHENTICATED

    async def run() -> int:
        async with AsyncRouterClient(cluster.router, timeout=TIMEOUT, tls=tls, token=BearerToken(ALICE)) as client:
            (done,) = await client.complete("The quick brown fox", max_new_tokens=3, temperature=0)
            assert len((await client.list_workers()).groups) == 1
            return done.finish.completion_tokens

    assert asyncio.run(run()) == 3


def test_per_client_limit_keys_on_the_token_identity(cluster, pki) -> None:
    """--max-requests-per-client 1: a second call with alice's token waits for none, bob's goes through."""
    request = pb.GenerateRequest(text="Once upon a time",
                                 sampling_params=pb.SamplingParams(max_new_tokens=40, ignore_eos=True))
    cluster.step_delay[0] = 0.05
    try:
        with grpc.secure_channel(cluster.router, _tls(pki)) as ch:
            stub = pb_grpc.RouterStub(ch)
            held = stub.Generate(request, timeout=TIMEOUT, metadata=_auth(ALICE))
            next(held)  # alice's first call is streaming now
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=TIMEOUT, metadata=_auth(ALICE)))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "alice" in info.value.details() and "--max-requests-per-client" in info.value.details()
            short = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_new_tokens=2))
            assert list(stub.Generate(short, timeout=TIMEOUT, metadata=_auth(BOB)))[-1].finish.reason == "length"
            held.cancel()
    finally:
        cluster.step_delay[0] = 0.0


def test_interceptor_exposes_the_authenticated_identity(loop) -> None:
    async def whoami(request: bytes, context) -> bytes:
        return (current_identity() or "-").encode()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=ServerSecurity(tokens=TokenTable.of([(ALICE, "alice"), BOB]))
                                 .interceptors(open_methods={"/t.T/Open"}))
        handler = grpc.unary_unary_rpc_method_handler(whoami)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"Who": handler,
                                                                                       "Open": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            who, open_ = ch.unary_unary("/t.T/Who"), ch.unary_unary("/t.T/Open")
            assert who(b"", timeout=TIMEOUT, metadata=_auth(ALICE)) == b"alice"
            assert who(b"", timeout=TIMEOUT, metadata=_auth(BOB)).startswith(b"token-")  # default identity
            assert open_(b"", timeout=TIMEOUT) == b"-"
            assert _code(lambda: who(b"", timeout=TIMEOUT)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        loop.run(server.stop(0))


# ---- the internal token on the worker and tokenizer service --------------------------------------


def test_worker_refuses_generate_and_abort_without_the_internal_token(cluster, pki, tiny) -> None:
    from tokenizer_svc.tokenizer import ModelTokenizer

    ids = ModelTokenizer.from_dir(tiny).encode("Once upon a time", True)
    request = spb.GenerateRequest(request_id="sec-1", tokenized=spb.TokenizedInput(input_ids=ids),
                                  sampling_params=spb.SamplingParams(temperature=0.0, max_new_tokens=3))
    with grpc.secure_channel(cluster.worker, _tls(pki)) as ch:
        stub = spb_grpc.SglangSchedulerStub(ch)
        for metadata in ((), _auth(ALICE), _auth(BOB)):  # client tokens do not open the worker
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=TIMEOUT, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for call in (lambda: stub.Abort(spb.AbortRequest(request_id="sec-1"), timeout=TIMEOUT, metadata=metadata),
                         lambda: stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT, metadata=metadata),
                         lambda: stub.HealthCheck(spb.HealthCheckRequest(), timeout=TIMEOUT, metadata=metadata),
                         lambda: list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT,
                                                        metadata=metadata)),
                         # KV events name the token ids of cached prompts.
                         lambda: list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT,
                                                             metadata=metadata)),
                         # The router's worker stream carries Generate calls.
                         lambda: list(wpb_grpc.WorkerStreamStub(ch).GenerateMany(
                             iter([wpb.WorkerStreamRequest(open=[wpb.CallOpen(
                                 call=1, generate_request=request.SerializeToString())], credit=8)]),
                             timeout=TIMEOUT, metadata=metadata))):
                assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
        # The probes a gateway makes stay open.
        assert stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=TIMEOUT).served_model_name == "tiny-test"
        assert stub.GetLoads(spb.GetLoadsRequest(), timeout=TIMEOUT).loads
        assert stub.GetServerInfo(spb.GetServerInfoRequest(), timeout=TIMEOUT).server_args
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == SERVING
        # With the internal token, the router's calls go through.
        out = list(stub.Generate(request, timeout=TIMEOUT, metadata=_auth(INTERNAL)))
        assert out[-1].complete.output_ids and len(out[-1].complete.output_ids) == 3
        assert stub.Abort(spb.AbortRequest(request_id="sec-1"), timeout=TIMEOUT, metadata=_auth(INTERNAL)) is not None
    with grpc.secure_channel(cluster.tokenizer, _tls(pki)) as ch:
        stub = tpb_grpc.TokenizerStub(ch)
        assert _code(lambda: stub.Encode(tpb.EncodeRequest(text="hi"), timeout=TIMEOUT)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert stub.Encode(tpb.EncodeRequest(text="hi"), timeout=TIMEOUT, metadata=_auth(INTERNAL)).token_ids


# ---- the whole cluster: `llmserve serve --tls-cert ... --auth-token-file ...` ---------------------


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_serve_cluster_streams_over_tls_with_a_token(tiny, pki, token_files, tmp_path) -> None:
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    log_dir = tmp_path / "logs"
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(tiny), "--port", "0",
           "--log-dir", str(log_dir), "--probe-interval", "0.3", "--dtype", "float32", "--max-total-tokens", "1024",
           "--context-length", "256", "--max-running-requests", "8", "--log-level", "debug",
           "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-ca", str(pki.ca),
           "--auth-token-file", str(token_files["clients"]),
           "--demo-prompt", "Once upon a time", "--demo-max-new-tokens", "4"]
    out_path = tmp_path / "serve.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while "serving; Ctrl-C or SIGTERM" not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.1)
        text = out_path.read_text()
        assert "demo finished (length, 4 tokens)" in text, text  # serve's own client went through TLS + token
        router = re.search(r"router listening on (\S+)", text).group(1)
        worker = re.search(r"worker 0\s+(\S+)", text).group(1)
        pids = [int(p) for p in re.findall(r"pid (\d+)\)", text)]
        assert len(pids) == 3
        assert f"--tls-ca {pki.ca}" in text and f"--token-file {token_files['clients']}" in text

        tls = ChannelTls.from_files(ca=pki.ca)
        with RouterClient(router, timeout=TIMEOUT, tls=tls, token=BOB) as client:
            deltas = list(client.generate("Once upon a time", max_new_tokens=6, temperature=0, ignore_eos=True))
            assert len(deltas) >= 2 and deltas[-1].finish.completion_tokens == 6  # streamed, not one message
        with RouterClient(router, timeout=TIMEOUT, tls=tls) as anonymous:
            assert _code(lambda: anonymous.generate_text("hi", max_new_tokens=2)) == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(router) as ch:  # plaintext to a TLS router
            assert _code(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)) \
                == grpc.StatusCode.UNAVAILABLE
        # The worker takes only serve's internal token: a client token does not get around the router.
        with grpc.secure_channel(worker, tls.credentials()) as ch:
            stub = spb_grpc.SglangSchedulerStub(ch)
            request = spb.GenerateRequest(request_id="direct", tokenized=spb.TokenizedInput(input_ids=[1, 2, 3]),
                                          sampling_params=spb.SamplingParams(max_new_tokens=2))
            for metadata in ((), _auth(BOB)):
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(request, timeout=TIMEOUT, metadata=metadata))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        cli = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "--router", router, "Hello",
                              "--max-new-tokens", "3", "--tls-ca", str(pki.ca), "--token-file",
                              str(token_files["clients"]), "-v"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "completion_tokens=3" in cli.stderr, cli.stderr
        health = subprocess.run([sys.executable, "-m", "llmserve.cli", "health", router, "--tls-ca", str(pki.ca)],
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr

        # Secrets stay out of process arguments and logs (debug level), only their paths show.
        internal = (log_dir / "internal.token").read_text().strip()
        assert (log_dir / "internal.token").stat().st_mode & 0o077 == 0
        secrets = (ALICE, BOB, internal)
        for pid in [proc.pid, *pids]:
            assert not any(s in _cmdline(pid) for s in secrets)
        logs = out_path.read_text() + "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))
        assert "call refused" in logs  # the refusals above were logged ...
        assert not any(s in logs for s in secrets)  # ... without the tokens
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, out_path.read_text()
