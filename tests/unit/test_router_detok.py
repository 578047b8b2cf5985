"""The router's in-process detokenizer (router/detok.py, `--detokenize router`): built from the tokenizer
service's GetTokenizerJson answer, it gives the same deltas as the service's DetokenizeStream, checks ids
as the service does, and keeps no state for a sequence once it is final."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from llmserve.incremental_detok import detokenize_all
from llmserve.v1 import tokenizer_pb2 as tpb
from router.detok import DetokenizeError, LocalDetokenizer, LocalVocabulary
from tokenizer_svc.tokenizer import ModelTokenizer

# Multi-byte characters split over several byte tokens, and a special token in the middle.
TEXT = "Grüße, 世界! 👍🏽 done"


def _vocab(tok: ModelTokenizer) -> LocalVocabulary:
    text = tok.tokenizer.to_str()
    resp = tpb.GetTokenizerJsonResponse(tokenizer_json=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                                        vocab_size=tok.vocab_size)
    return LocalVocabulary.from_response(resp)


async def _deltas(det: LocalDetokenizer, sequence_id: int, ids: list[int]) -> list[str]:
    out = [await det.push(sequence_id, [i]) for i in ids]
    out.append(await det.push(sequence_id, [], final=True))
    return out


@pytest.mark.parametrize("skip", [False, True])
def test_deltas_equal_the_services_and_join_to_decode(tok: ModelTokenizer, skip: bool) -> None:
    vocab = _vocab(tok)
    special = next(iter(tok.special_tokens))
    ids = tok.encode(TEXT, add_special_tokens=False)
    ids = ids[:5] + [special] + ids[5:]

    async def run() -> None:
        det = LocalDetokenizer(vocab, skip_special_tokens=skip)
        # Two sequences interleaved on one request (n = 2) keep apart.
        a, b = await asyncio.gather(_deltas(det, 0, ids), _deltas(det, 1, ids[::-1]))
        assert a == detokenize_all(tok.decode, ids, skip)  # what the service's DetokenizeStream sends
        assert "".join(a) == tok.decode(ids, skip)
        assert "".join(b) == tok.decode(ids[::-1], skip)
        assert not det._open  # both final: nothing kept

    asyncio.run(run())


def test_out_of_range_id_is_refused_naming_it(tok: ModelTokenizer) -> None:
    det = LocalDetokenizer(_vocab(tok), skip_special_tokens=True)
    with pytest.raises(DetokenizeError, match=rf"token_ids \(sequence_id 3\): id {tok.vocab_size} at position 1 "):
        asyncio.run(det.push(3, [5, tok.vocab_size]))
    with pytest.raises(DetokenizeError, match="id -1 at position 0"):
        asyncio.run(det.push(0, [-1]))


def test_a_final_push_without_ids_on_a_sequence_never_opened_is_empty(tok: ModelTokenizer) -> None:
    det = LocalDetokenizer(_vocab(tok), skip_special_tokens=False)
    assert asyncio.run(det.push(7, [], final=True)) == ""
    assert not det._open
