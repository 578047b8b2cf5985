"""The router's parts, fast and in-process: stop-string matching, the UTF-8 locator, sampling
validation and the routing policies. The streaming path against scripted workers is in
tests/integration/test_router_streaming.py, the real cluster in tests/integration/test_router.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as spb

from llmserve.grpc_wire import InvalidRequest, find_invalid_utf8, tolerant
from llmserve.v1 import router_pb2 as pb
from router.stops import StopStringMatcher
from router.validation import ModelFacts, RouterError, check_fits, validate_sampling
from router.workers import NOT_SERVING, SERVING, PoolOptions, WorkerPool

TIMEOUT = 20.0

# ---- stop strings --------------------------------------------------------------------------------


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s) if include else i], s


def _stream(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None, list[str]]:
    m = StopStringMatcher(stops, include)
    out: list[str] = []
    for c in chunks:
        text, match = m.push(c)
        out.append(text)
        if match is not None:
            out.append(match.text)
            return "".join(out), match.stop, out
    out.append(m.flush())
    return "".join(out), None, out


def test_stop_string_spanning_deltas() -> None:
    text, stop, pieces = _stream(["Hello wo", "rl", "d. Bye"], ["world."], include=False)
    assert (text, stop) == ("Hello ", "world.")
    assert pieces[:2] == ["Hello ", ""]  # "wo", then "world" held back
    assert _stream(["Hello wo", "rl", "d. Bye"], ["world."], include=True)[:2] == ("Hello world.", "world.")
    # Held text that turns out not to be a stop string is released, in order.
    assert _stream(["abc <", "en", "x> def"], ["<end>"], False)[:2] == ("abc <enx> def", None)
    # The stop that completes first wins, as it would token by token.
    assert _stream(["xabcd"], ["abcd", "bc"], False)[:2] == ("xa", "bc")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc<>é", max_size=40),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
       stops=st.lists(st.text(alphabet="abc<>é", min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans())
def test_stop_matcher_equals_whole_text_search(text: str, cuts: list[int], stops: list[str], include: bool) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    got_text, got_stop, _ = _stream(chunks, stops, include)
    assert (got_text, got_stop) == _reference(text, stops, include)


# ---- wire ----------------------------------------------------------------------------------------


def test_invalid_utf8_is_located_not_raised() -> None:
    good = pb.ChatRequest(messages=[{"role": "user", "content": "ok"}, {"role": "user", "content": "zz"}],
                          sampling_params=pb.SamplingParams(stop=["a", "yy"])).SerializeToString()
    assert find_invalid_utf8(pb.ChatRequest.DESCRIPTOR, good) is None
    bad = good.replace(b"zz", b"\xc3(")
    assert find_invalid_utf8(pb.ChatRequest.DESCRIPTOR, bad) == "messages[1].content"
    parsed = tolerant(pb.ChatRequest)(good.replace(b"yy", b"\xff\xfe"))
    assert isinstance(parsed, InvalidRequest) and parsed.message.startswith("sampling_params.stop[1]:")
    assert isinstance(tolerant(pb.ChatRequest)(b"\xff\xff\xff"), InvalidRequest)  # garbage: still no raise


# ---- validation ----------------------------------------------------------------------------------

FACTS = ModelFacts(name="m", vocab_size=512, context_limit=256, eos_token_ids=(508,))


@pytest.mark.parametrize("params, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(stop_token_ids=[1, 512]), "stop_token_ids[1]"),
    (dict(stop=["ok", ""]), "stop[1]"),
    (dict(max_new_tokens=257), "max_new_tokens"),
    (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
    (dict(top_logprobs=21), "top_logprobs"),
])
def test_sampling_validation_names_the_field(params: dict, field: str) -> None:
    with pytest.raises(RouterError) as e:
        validate_sampling(pb.SamplingParams(**params), FACTS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"sampling_params.{field}" in e.value.message


def test_sampling_validation_accepts_proto3_zeros_and_bounds() -> None:
    validate_sampling(pb.SamplingParams(), FACTS)  # all zeros: defaults
    validate_sampling(pb.SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_new_tokens=256), FACTS)
    check_fits(255, pb.SamplingParams(), FACTS, "text")
    with pytest.raises(RouterError) as e:
        check_fits(256, pb.SamplingParams(), FACTS, "text")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.message.startswith("text:")
    with pytest.raises(RouterError) as e:
        check_fits(200, pb.SamplingParams(max_new_tokens=100), FACTS, "text")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_new_tokens" in e.value.message


# ---- policies ------------------------------------------------------------------------------------


def test_policies() -> None:
    async def scenario() -> None:
        addrs = [f"127.0.0.1:{p}" for p in (1, 2, 3)]
        pools = {name: WorkerPool(addrs, PoolOptions(policy=name)) for name in ("least_load", "round_robin", "prefix")}
        for pool in pools.values():
            for g in pool.groups:
                g.health = SERVING
        rr = pools["round_robin"]
        assert [rr.pick([1]).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
        ll = pools["least_load"]
        ll.groups[0].in_flight, ll.groups[1].in_flight, ll.groups[2].in_flight = 3, 1, 2
        assert {ll.pick([1]).index for _ in range(5)} == {1}
        # A reported load counts, corrected by what this router started since the report.
        ll.groups[1].load = spb.SchedulerLoad(num_running_reqs=5)
        ll.groups[1].in_flight_at_report = 1
        assert ll.pick([1]).index == 2
        px = pools["prefix"]
        prompts = [[7, i, i * 3] for i in range(60)]
        first = {tuple(p): px.pick(p).index for p in prompts}
        assert len(set(first.values())) == 3  # spreads
        assert all(px.pick(p).index == first[tuple(p)] for p in prompts)  # sticky
        px.groups[1].health = NOT_SERVING
        moved = {tuple(p): px.pick(p).index for p in prompts}
        assert all(moved[k] == v for k, v in first.items() if v != 1)  # only group 1's prefixes move
        assert 1 not in moved.values()
        assert rr.pick([1], exclude={0, 1}).index == 2
        for pool in pools.values():
            await pool.close()

    asyncio.run(scenario())

