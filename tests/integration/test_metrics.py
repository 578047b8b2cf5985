"""/metrics of every service of a real cluster on loopback (tokenizer, a TP=2 worker whose rank 0 starts
rank 1, router; `--metrics-port` on each) after known traffic: three generations through the router
(one repeating an earlier prompt, so the worker's prefix cache serves it), one invalid request to the
router and one to the worker. Counters must equal what the clients were told (usage, status codes),
histograms must have one observation per request, the follower must report its steps and their
all-reduces, and every endpoint must close with its service."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from router.client import RouterClient, collect
from tests.integration.test_router import engine_flags, one_group_cluster
from tests.prom import Samples, free_ports, scrape, scrape_until
from tokenizer_svc.tokenizer import ModelTokenizer

HOST = "127.0.0.1"
REQUEST_HISTOGRAMS = ("llmserve:time_to_first_token_seconds", "llmserve:time_per_output_token_seconds",
                      "llmserve:e2e_request_latency_seconds")


def _calls(s: Samples, method: str, code: str) -> float:
    return s.value("llmserve:grpc_requests_total", method=method, code=code) if s.has(
        "llmserve:grpc_requests_total", method=method, code=code) else 0.0


def test_every_service_reports_known_traffic(model_factory, tmp_path) -> None:
    model = model_factory("tiny")
    tok = ModelTokenizer.from_dir(model)
    router_port, tokenizer_port, leader_port, follower_port = free_ports(4)
    prompt_a = "Once upon a time there was a tiny model that served metrics to anyone who asked politely"
    prompt_b = "The quick brown fox"
    plan = [(prompt_a, 5), (prompt_a, 3), (prompt_b, 4)]  # the repeat finds prompt_a in the prefix cache

    with one_group_cluster(model, tmp_path,
                           worker_flags=[*engine_flags(), "--tp", "2", "--metrics-port", str(leader_port)],
                           router_flags=["--metrics-port", str(router_port)],
                           tokenizer_flags=["--metrics-port", str(tokenizer_port)]) as (_tokenizer, worker, router):
        finishes = []
        with RouterClient(router.address, timeout=60) as client:
            for prompt, max_new in plan:
                (c,) = collect(client.generate(prompt, max_new_tokens=max_new, temperature=0, ignore_eos=True))
                assert c.finish is not None and c.finish.reason == "length"
                assert c.finish.completion_tokens == max_new and c.finish.prompt_tokens == len(tok.encode(prompt))
                finishes.append(c.finish)
            with pytest.raises(grpc.RpcError) as bad:
                list(client.generate(prompt_b, max_new_tokens=4, top_p=2.0))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with grpc.insecure_channel(worker.address) as channel:
            with pytest.raises(grpc.RpcError) as bad:
                list(spb_grpc.SglangSchedulerStub(channel).Generate(
                    spb.GenerateRequest(tokenized=spb.TokenizedInput(input_ids=[])), timeout=10))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        prompt_tokens = sum(f.prompt_tokens for f in finishes)
        generated = sum(f.completion_tokens for f in finishes)
        cached = sum(f.cached_tokens for f in finishes)
        assert finishes[1].cached_tokens == finishes[1].prompt_tokens - 1  # all but the last token reused

        # ---- the router
        r = scrape_until(HOST, router_port, lambda s: s.count("llmserve:e2e_request_latency_seconds") >= 3)
        assert _calls(r, "Generate", "OK") == 3
        assert _calls(r, "Generate", "INVALID_ARGUMENT") == 1
        assert r.value("llmserve:prompt_tokens_total") == prompt_tokens
        assert r.value("llmserve:generation_tokens_total") == generated == 12
        assert r.value("llmserve:prompt_tokens_cached_total") == cached
        assert r.value("llmserve:request_success_total", finished_reason="length") == 3
        for histogram in REQUEST_HISTOGRAMS:
            assert r.count(histogram) == 3 and r.sum(histogram) > 0, histogram
        assert r.count("llmserve:grpc_request_duration_seconds", method="Generate") == 4
        assert r.value("llmserve:num_requests_running") == 0
        assert r.value("llmserve:router_retries_total") == 0
        assert _calls(r, "Check", "OK") >= 1  # the test's own health waits, counted like any call

        # ---- the worker's rank 0
        # The router's idle HealthCheck probes run a one-token generation now and then: wait for a
        # scrape between two of them for the gauges.
        # The call counter moves when the gRPC handler returns, after the engine's histograms: wait for both.
        w = scrape_until(HOST, leader_port, lambda s: s.count("llmserve:e2e_request_latency_seconds") >= 3
                          and s.value("llmserve:num_requests_running") == 0 and _calls(s, "Generate", "OK") >= 3)
        assert _calls(w, "Generate", "OK") == 3
        assert _calls(w, "Generate", "INVALID_ARGUMENT") == 1
        assert _calls(w, "GetLoads", "OK") >= 1  # the router's probes
        # Exact although the router's HealthCheck probes run one-token generations: those are not traffic.
        assert w.value("llmserve:prompt_tokens_total") == prompt_tokens
        assert w.value("llmserve:generation_tokens_total") == generated
        assert w.value("llmserve:prompt_tokens_cached_total") == cached
        assert w.value("llmserve:prefix_cache_queries_total") == prompt_tokens
        assert w.value("llmserve:prefix_cache_hits_total") == cached
        assert w.value("llmserve:request_success_total", finished_reason="length") == 3
        for histogram in (*REQUEST_HISTOGRAMS, "llmserve:request_queue_time_seconds"):
            assert w.count(histogram) == 3, histogram
        for histogram in REQUEST_HISTOGRAMS:
            assert w.sum(histogram) > 0, histogram
        assert w.value("llmserve:num_requests_running") == 0 and w.value("llmserve:num_requests_waiting") == 0
        assert w.value("llmserve:prefix_cache_tokens") >= finishes[0].prompt_tokens
        # Step counts move with the probes: each generated token took at least one step on each rank.
        assert w.count("llmserve:engine_step_duration_seconds") >= generated
        assert w.sum("llmserve:engine_step_duration_seconds") > 0
        assert w.count("llmserve:step_collective_seconds") >= generated
        assert w.sum("llmserve:step_collective_seconds") > 0
        assert w.value("llmserve:collectives_total", op="all_reduce") > 0
        assert w.value("llmserve:collectives_total", op="broadcast") >= generated  # the leader sends every step
        assert w.value("llmserve:collective_seconds_total", op="all_reduce") > 0

        # ---- the follower, rank 1 (its leader gave it --metrics-port P + 1)
        f = scrape(HOST, follower_port)
        assert f.count("llmserve:engine_step_duration_seconds") >= generated
        assert f.sum("llmserve:engine_step_duration_seconds") > 0
        assert f.count("llmserve:step_collective_seconds") >= generated
        assert f.sum("llmserve:step_collective_seconds") > 0
        assert f.value("llmserve:collectives_total", op="all_reduce") > 0
        assert not f.has("llmserve:collectives_total", op="broadcast")  # receiving the next step is idle time
        assert "llmserve:grpc_requests_total" not in f.text  # a follower serves only health: no call metrics

        # ---- the tokenizer service
        t = scrape_until(HOST, tokenizer_port, lambda s: _calls(s, "Encode", "OK") >= 3)
        assert _calls(t, "Encode", "OK") == 3  # the invalid request never reached it
        assert _calls(t, "GetTokenizerJson", "OK") == 1  # the router detokenizes itself, with this
        assert _calls(t, "DetokenizeStream", "OK") == 0
        assert t.count("llmserve:grpc_request_duration_seconds", method="Encode") == 3
        assert t.sum("llmserve:grpc_request_duration_seconds", method="Encode") > 0
        assert _calls(t, "GetInfo", "OK") >= 1 and _calls(t, "Check", "OK") >= 1  # the router's probes

    for port in (router_port, tokenizer_port, leader_port, follower_port):  # closed with their services
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=2)
