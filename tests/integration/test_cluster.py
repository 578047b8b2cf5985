"""`llmserve serve`: the one-command local cluster (tokenizer, worker group(s), router as child
processes), its demo, the client commands against it, clean SIGTERM shutdown and a dying child."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmserve.cli import main as cli_main
from router.client import RouterClient, collect

ENGINE_FLAGS = ["--dtype", "float32", "--max-total-tokens", "1024", "--context-length", "256",
                "--max-running-requests", "8"]
STARTUP_S = 120.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass
class Serve:
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def wait_line(self, needle: str, timeout: float = STARTUP_S) -> str:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                if needle in line:
                    return line
            seen = len(self.lines)
            if self.proc.poll() is not None and seen == len(self.lines):
                break
            time.sleep(0.05)
        raise AssertionError(f"no {needle!r} in serve output:\n{''.join(self.lines)}\nstderr:\n{''.join(self.err)}")

    @property
    def router(self) -> str:
        return self.wait_line("router listening on").split()[-1]

    def pids(self) -> dict[str, int]:
        out = {}
        for line in self.lines:
            m = re.match(r"\s+(router|worker \d+|tokenizer)\s.*pid (\d+)\)", line)
            if m:
                out[m.group(1)] = int(m.group(2))
        return out


@pytest.fixture
def serve(model_factory, tmp_path) -> Iterator:
    started: list[Serve] = []

    def start(*extra: str, preset: str = "tiny", model: Path | None = None) -> Serve:
        model = model or model_factory(preset)
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model), "--port", "0",
               "--log-dir", str(tmp_path / f"logs{len(started)}"), "--probe-interval", "0.3", *ENGINE_FLAGS, *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        s = Serve(proc)
        for stream, sink in ((proc.stdout, s.lines), (proc.stderr, s.err)):
            threading.Thread(target=lambda st=stream, sk=sink: sk.extend(iter(st.readline, "")), daemon=True).start()
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(30)
            except subprocess.TimeoutExpired:
                s.proc.kill()
        for pid in s.pids().values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=60)


def test_serve_demo_clients_and_sigterm(serve) -> None:
    s = serve("--demo-prompt", "Once upon a time", "--demo-max-new-tokens", "8")
    s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster")
    out = "".join(s.lines)
    assert "demo finished (length, 8 tokens)" in out and "llmserve generate --router" in out
    pids = s.pids()
    assert set(pids) == {"router", "worker 0", "tokenizer"} and all(_alive(p) for p in pids.values())
    router = s.router
    assert _cli("health", router).returncode == 0

    with RouterClient(router, timeout=30) as client:
        want = client.generate_text("Hello", max_new_tokens=6, temperature=0, ignore_eos=True)
    gen = _cli("generate", "--router", router, "Hello", "--max-new-tokens", "6", "--temperature", "0",
               "--ignore-eos", "-v")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout == want + "\n" and "finish=length" in gen.stderr and "completion_tokens=6" in gen.stderr
    chat = _cli("chat", "--router", router, "--message", "Hi", "--max-new-tokens", "4", "-v")
    assert chat.returncode == 0 and "finish=length" in chat.stderr, chat.stderr
    piped = _cli("chat", "--router", router, "--max-new-tokens", "3", "-v", stdin="Hi\nAnd again\n")
    assert piped.returncode == 0 and piped.stderr.count("finish=length") == 2, piped.stderr
    bad = _cli("generate", "--router", router, "x", "--top-p", "2")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "top_p" in bad.stderr

    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, "".join(s.err)
    assert "llmserve serve: stopped" in "".join(s.lines)
    assert not any(_alive(p) for p in pids.values())


def test_serve_real_model_chat_answers_and_stops_at_im_end(serve, real_model) -> None:
    """The default model through the whole cluster: the chat demo, a client chat and `llmserve chat`
    answer the question and end with finish reason stop at <|im_end|> (generation_config's EOS)."""
    s = serve("--demo-chat", "What is the capital of France?", "--demo-max-new-tokens", "32", model=real_model)
    s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster")
    out = "".join(s.lines)
    demo = out.split("demo chat: 'What is the capital of France?' ->", 1)[1]
    assert "Paris" in demo.split("llmserve serve: demo finished", 1)[0]
    assert re.search(r"demo finished \(stop, \d+ tokens\)", out), out
    router = s.router
    with RouterClient(router, timeout=60) as client:
        deltas = list(client.chat([("user", "What is the capital of France?")], max_new_tokens=32, temperature=0))
        generated = client.generate_text("The capital of France is", max_new_tokens=3, temperature=0)
    answer = "".join(d.text for d in deltas)
    finish = deltas[-1].finish
    assert "Paris" in answer and "<|im_end|>" not in answer
    assert finish.reason == "stop" and finish.completion_tokens < 32
    assert "Paris" in generated
    chat = _cli("chat", "--router", router, "--message", "What is the capital of France?", "--temperature", "0", "-v")
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout and "finish=stop" in chat.stderr, (chat.stdout, chat.stderr)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, "".join(s.err)


def test_serve_exits_nonzero_when_a_child_dies(serve) -> None:
    s = serve("--max-restarts", "0")  # no restarts: the first death stops the cluster (test_supervision.py)
    s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster")
    pids = s.pids()
    os.kill(pids["worker 0"], signal.SIGKILL)
    assert s.proc.wait(60) == 1
    err = "".join(s.err)
    assert "worker 0 exited with code -9" in err and "last lines of its log" in err
    assert "worker_svc" in err  # the child's own log lines are shown
    assert not any(_alive(p) for p in pids.values())


def test_serve_exit_after_demo(serve) -> None:
    s = serve("--demo-prompt", "The capital of France is", "--demo-max-new-tokens", "4", "--exit-after-demo")
    assert s.proc.wait(STARTUP_S) == 0, "".join(s.err)
    out = "".join(s.lines)
    assert "demo finished (length, 4 tokens)" in out and "serving; Ctrl-C" not in out
    assert not any(_alive(p) for p in s.pids().values())


def test_serve_rejects_bad_group_shapes(model_factory, capsys) -> None:
    assert cli_main(["serve", "--model", str(model_factory("tiny")), "--tp", "0"]) == 2
    assert "--tp" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(model_factory("tiny")), "--dp", "0"]) == 2


def test_serve_with_tensor_parallel_groups(serve) -> None:
    s = serve("--tp", "2", "--demo-prompt", "Once upon a time", "--demo-max-new-tokens", "6", "--exit-after-demo")
    assert s.proc.wait(STARTUP_S) == 0, "".join(s.err)
    assert "demo finished (length, 6 tokens)" in "".join(s.lines)
    assert not any(_alive(p) for p in s.pids().values())


def test_serve_gives_every_process_its_metrics_port(serve) -> None:
    """--metrics-port BASE: the router on BASE, the tokenizer on BASE+1, the worker group's ranks on
    BASE+2 and BASE+3 (rank 0 hands rank 1 its port), each reporting the demo; all closed at the end."""
    from tests.prom import free_ports, scrape, scrape_until

    ports = free_ports(4)
    s = serve("--tp", "2", "--metrics-port", str(ports[0]), "--demo-prompt", "Once upon a time",
              "--demo-max-new-tokens", "6")
    s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster")
    assert f"http://127.0.0.1:{ports[0]}/metrics (router), tokenizer {ports[1]}, worker 0 rank 0 {ports[2]}, " \
           f"worker 0 rank 1 {ports[3]}" in "".join(s.lines)
    router = scrape_until("127.0.0.1", ports[0], lambda m: m.count("llmserve:e2e_request_latency_seconds") == 1)
    tokenizer, leader, follower = (scrape("127.0.0.1", p) for p in ports[1:])
    assert router.value("llmserve:request_success_total", finished_reason="length") == 1
    assert router.value("llmserve:generation_tokens_total") == 6
    assert tokenizer.value("llmserve:grpc_requests_total", method="Encode", code="OK") == 1
    assert leader.value("llmserve:generation_tokens_total") == 6
    assert follower.count("llmserve:engine_step_duration_seconds") >= 6
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, "".join(s.err)
    for port in ports:
        with pytest.raises(OSError):  # URLError: nothing listens any more
            scrape("127.0.0.1", port, timeout=2)


def test_serve_rejects_a_metrics_port_range_past_65535(model_factory, capsys) -> None:
    assert cli_main(["serve", "--model", str(model_factory("tiny")), "--tp", "2", "--metrics-port", "65533"]) == 2
    assert "--metrics-port 65533" in capsys.readouterr().err


def test_serve_int4_quantized_tensor_parallel_cluster(serve, model_factory) -> None:
    """The quantization issue's cluster check: int4wo-128 on two tensor-parallel ranks (small preset:
    every per-rank input dimension is a multiple of 128) answers through the router with the same
    greedy tokens as an in-process TP=1 engine quantized the same way."""
    from llmserve.cli import build_parser
    from llmserve.commands.engine_args import engine_config_from_args
    from worker_svc.engine.engine import Engine
    from worker_svc.sampling import SamplingParams

    model = model_factory("small")
    s = serve("--tp", "2", "--torchao-config", "int4wo-128", preset="small")
    s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster")
    args = build_parser().parse_args(["worker", "--model", str(model), *ENGINE_FLAGS, "--torchao-config", "int4wo-128"])
    engine = Engine(engine_config_from_args(args))
    with RouterClient(s.router, timeout=60) as client:
        prompt_ids = client.tokenize("The capital of France is")
        (completion,) = collect(client.generate(prompt_ids, max_new_tokens=12, temperature=0, ignore_eos=True))
    want = engine.generate([prompt_ids], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert list(completion.token_ids) == want[0].output_ids
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, "".join(s.err)


def test_serve_tensor_parallel_cluster_with_two_batch_overlap(serve, model_factory) -> None:
    """`serve --tp 2 --enable-two-batch-overlap` (every step of 2+ tokens split): concurrent streams
    through the router give an in-process TP=1 engine's greedy tokens."""
    from llmserve.cli import build_parser
    from llmserve.commands.engine_args import engine_config_from_args
    from worker_svc.engine.engine import Engine
    from worker_svc.sampling import SamplingParams

    model = model_factory("tiny")
    s = serve("--tp", "2", "--enable-two-batch-overlap", "--tbo-min-tokens", "2")
    s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster")
    texts = ["Once upon a time", "The capital of France is", "In a hole in the ground there lived"]
    results: dict[int, list[int]] = {}
    with RouterClient(s.router, timeout=60) as client:
        prompts = [client.tokenize(t) for t in texts]

        def run(i: int) -> None:
            (completion,) = collect(client.generate(prompts[i], max_new_tokens=10, temperature=0, ignore_eos=True))
            results[i] = list(completion.token_ids)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
    args = build_parser().parse_args(["worker", "--model", str(model), *ENGINE_FLAGS])
    want = Engine(engine_config_from_args(args)).generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    assert [results.get(i) for i in range(len(texts))] == [w.output_ids for w in want]
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, "".join(s.err)


def test_serve_passes_every_engine_flag_to_its_workers() -> None:
    from llmserve.cli import build_parser
    from llmserve.commands.engine_args import engine_argv, engine_config_from_args

    flags = ["--dtype", "float32", "--max-total-tokens", "64", "--context-length", "32", "--random-seed", "7",
             "--json-model-override-args", '{"rope_theta": 10000}', "--max-running-requests", "3",
             "--prefill-batching", "budget"]
    serve_args = build_parser().parse_args(["serve", "--model", "/m", "--dp", "2", "--port", "0", *flags])
    argv = engine_argv(serve_args)
    worker_args = build_parser().parse_args(["worker", "--model", "/m", *argv])
    assert engine_config_from_args(worker_args) == engine_config_from_args(serve_args)
    assert "--dp" not in argv and "--port" not in argv
    assert engine_argv(build_parser().parse_args(["serve", "--model", "/m"])) == []  # defaults stay implicit
