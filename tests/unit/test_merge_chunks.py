"""convert.merge_chunks: what the worker stream sends when its caller fell behind (several steps' chunks
of one call as one chunk) must read exactly as the chunks would have, logprobs included."""

from __future__ import annotations

from worker_svc.engine.request import FinishReason, StepOutput
from worker_svc.server import convert
from worker_svc.server.convert import SampleState


def _out(ids: list[int], done: int, finish: FinishReason | None = None) -> StepOutput:
    return StepOutput(rid="r", new_token_ids=ids, new_logprobs=[-0.5 * t for t in ids],
                      new_top_logprobs=[[(t, -0.5 * t), (t + 1, -9.0)] for t in ids], finish_reason=finish,
                      matched_stop=None, prompt_tokens=7, completion_tokens=done, cached_tokens=3)


def test_consecutive_chunks_of_a_sample_become_one_and_completes_stay() -> None:
    steps = [_out([11], 1), _out([12, 13], 3), _out([14], 4, FinishReason.LENGTH)]
    state = SampleState(index=0, rid="r")
    responses = []
    for out in steps:
        state.add(out)
        responses.append(convert.chunk_response("req", 0, out, with_logprobs=True))
    responses.append(convert.complete_response("req", state, with_logprobs=True))
    other = convert.chunk_response("req", 1, _out([21], 1), with_logprobs=True)
    after = convert.chunk_response("req", 0, _out([15], 5), with_logprobs=True)

    merged = convert.merge_chunks([*responses, other, after])

    assert [r.WhichOneof("response") for r in merged] == ["chunk", "complete", "chunk", "chunk"]
    chunk = merged[0].chunk
    assert list(chunk.token_ids) == [11, 12, 13, 14] == list(merged[1].complete.output_ids)
    assert (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens, chunk.index) == (7, 4, 3, 0)
    assert list(chunk.output_logprobs.token_ids) == [11, 12, 13, 14]
    assert list(chunk.output_logprobs.token_logprobs) == [-5.5, -6.0, -6.5, -7.0]
    assert [list(t.token_ids) for t in chunk.output_logprobs.top_logprobs] == [[11, 12], [12, 13], [13, 14], [14, 15]]
    assert chunk.output_logprobs == merged[1].complete.output_logprobs
    # A chunk of another sample, and one after the complete, are not merged across.
    assert list(merged[2].chunk.token_ids) == [21] and merged[2].chunk.index == 1
    assert list(merged[3].chunk.token_ids) == [15]


def test_nothing_to_merge_is_left_as_it_is() -> None:
    one = convert.chunk_response("req", 0, _out([5], 1), with_logprobs=False)
    assert convert.merge_chunks([one]) == [one]
    assert convert.merge_chunks([]) == []
