"""DeepSeek-V2 (MLA + MoE) served end to end, tiny preset, fp32: `llmserve worker` answers Generate
through sglang.grpc.scheduler.SglangScheduler with the in-process engine's greedy tokens and reports
the latent KV size; smg 1.13.0 in front of it serves /v1/completions and /v1/chat/completions; and
`llmserve serve` (tokenizer, worker, router) runs its demo and answers through the router."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from router.client import RouterClient, collect
from tests.integration.conftest import launch_worker, worker_engine_config
from tests.integration.test_cluster import ENGINE_FLAGS, STARTUP_S, Serve, _alive
from tests.integration.test_smg import MODEL_NAME, SMG, Gateway, _chat_prompt_ids, _expected
from tests.integration.test_worker_server import _collect, _greedy, _prompt, _request
from worker_svc.engine.engine import Engine
from worker_svc.sampling import SamplingParams

TIMEOUT = 60


@pytest.fixture(scope="module")
def ds_model(model_factory) -> Path:
    return model_factory("tiny", arch="deepseek_v2")  # 2 layers, 4 heads, kv_lora_rank 32, rope 8


@pytest.fixture(scope="module")
def engine(ds_model) -> Engine:
    return Engine(worker_engine_config(ds_model))


@pytest.fixture(scope="module")
def tokenizer(ds_model) -> Tokenizer:
    return Tokenizer.from_file(str(ds_model / "tokenizer.json"))


@pytest.fixture(scope="module")
def worker(ds_model, tmp_path_factory):
    proc = launch_worker(ds_model, tmp_path_factory.mktemp("ds-worker"), "--served-model-name", MODEL_NAME)
    yield proc
    assert proc.terminate() == 0


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield pb_grpc.SglangSchedulerStub(ch)


def test_generate_equals_in_process_engine(stub, engine):
    # Several prompts at once (continuous batching: absorbed decode over requests of different lengths).
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 17, 40))]
    requests = [_request(p, rid=f"ds-{i}", max_new=12) for i, p in enumerate(prompts)]
    results = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = _collect(stub, requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for prompt, (_, (complete,)) in zip(prompts, results, strict=False):
        assert list(complete.output_ids) == _greedy(engine, prompt, 12)
        assert complete.finish_reason == "length" and complete.completion_tokens == 12


def test_server_info_reports_the_latent_kv_size(stub, worker, ds_model):
    cfg = json.loads((ds_model / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    latent = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # fp32
    mha = layers * heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 4
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    sched = json_format.MessageToDict(info.scheduler_info)
    assert sched["architecture"] == "DeepseekV2ForCausalLM"
    assert sched["kv_bytes_per_token"] == latent == 320
    assert sched["kv_bytes_per_token_if_mha"] == mha == 1280
    assert sched["kv_cache_bytes"] >= sched["max_total_num_tokens"] * latent
    (ready,) = [r for r in worker.log_records() if r.get("event") == "kv cache ready"]
    assert (ready["bytes_per_token"], ready["bytes_per_token_if_mha"]) == (latent, mha)


@pytest.fixture(scope="module")
def gateway(worker, ds_model, tmp_path_factory):
    if not SMG.exists():
        pytest.skip(f"smg gateway binary missing at {SMG}: pip install smg==1.13.0 (a test dependency)")
    gw = Gateway(worker.address, tmp_path_factory.mktemp("ds-smg"), tokenizer_path=ds_model)
    try:
        gw.wait_ready()
        yield gw
    finally:
        gw.stop()


def _expected_streamed(engine: Engine, tokenizer: Tokenizer, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    """Like test_smg's ``_expected``, but decoded incrementally as smg does: a trailing piece that is
    still an incomplete UTF-8 sequence is withheld (random-weight models emit byte tokens freely)."""
    from tokenizers.decoders import DecodeStream

    (result,) = engine.generate([prompt_ids], SamplingParams(max_new_tokens=max_tokens, temperature=0.0))
    stream = DecodeStream(skip_special_tokens=True)
    pieces = [stream.step(tokenizer, token) for token in result.output_ids]
    text = "".join(p for p in pieces if p)
    assert tokenizer.decode(result.output_ids, skip_special_tokens=True).startswith(text)
    return text, result.finish_reason.value


def test_smg_completions(gateway, engine, tokenizer):
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    response = gateway.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12,
                                                "temperature": 0})
    (choice,) = response["choices"]
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert (choice["text"], choice["finish_reason"]) in (
        _expected(engine, tokenizer, ids, 12), _expected_streamed(engine, tokenizer, ids, 12))


def test_smg_chat_completions(gateway, engine, tokenizer, ds_model):
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    ids = _chat_prompt_ids(ds_model, tokenizer, messages)
    expected = (_expected(engine, tokenizer, ids, 16), _expected_streamed(engine, tokenizer, ids, 16))
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 16, "temperature": 0}
    (choice,) = gateway.post("/v1/chat/completions", body)["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) in expected
    events = gateway.stream("/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert "".join(deltas) in (expected[0][0], expected[1][0])


def test_serve_cluster_demo_and_router_generate(ds_model, engine, tmp_path):
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(ds_model), "--port", "0",
           "--log-dir", str(tmp_path / "logs"), "--probe-interval", "0.3", *ENGINE_FLAGS,
           "--demo-prompt", "Once upon a time", "--demo-max-new-tokens", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    s = Serve(proc)
    for stream, sink in ((proc.stdout, s.lines), (proc.stderr, s.err)):
        threading.Thread(target=lambda st=stream, sk=sink: sk.extend(iter(st.readline, "")), daemon=True).start()
    try:
        s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster", STARTUP_S)
        assert "demo finished (length, 6 tokens)" in "".join(s.lines)
        with RouterClient(s.router, timeout=TIMEOUT) as client:
            ids = client.tokenize("The capital of France is")
            (completion,) = collect(client.generate(ids, max_new_tokens=12, temperature=0, ignore_eos=True))
        want = engine.generate([ids], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        assert list(completion.token_ids) == want[0].output_ids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(s.err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in s.pids().values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
