"""Streaming detokenization: deltas concatenate to the full decode, and never show half a character.

Properties, for the byte-level BPE tokenizers of the generated tiny (512 ids) and small (2048 ids)
models, fed one id at a time and in random chunk sizes, with and without skip_special_tokens:

  P1  "".join(deltas, flush) == decode(ids) exactly.
  P2  after every push, the text emitted so far is a prefix of decode(ids so far) (nothing is
      emitted that a later id could change), and equals it whenever decode(ids so far) does not end
      in U+FFFD (the only text held back is a possibly incomplete character).
  P3  for ids obtained by encoding valid text, no delta contains U+FFFD.

Random id sequences may decode to U+FFFD legitimately (invalid byte sequences: a lone piece of a
multi-byte character). P1 and P2 hold for them too: a U+FFFD may then appear in a delta exactly
where the full decode has it, never elsewhere (P1 and P2 pin its place).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llmserve.incremental_detok import REPLACEMENT_CHAR, IncrementalDetokenizer, detokenize_all
from tokenizer_svc.tokenizer import ModelTokenizer

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Characters that byte-level BPE splits into several byte tokens.
CJK = [chr(c) for c in range(0x4E00, 0x4E00 + 400)] + list("日本語の文章中文한국어カタカナ")
EMOJI = [chr(c) for c in range(0x1F600, 0x1F650)] + ["👨‍👩‍👧", "🏳️‍🌈", "🇫🇷", "👍🏽", "❤️"]
ACCENTED = [chr(c) for c in range(0xC0, 0x180)] + ["e\u0301", "ǅ", "ß", "Ω", "€"]
ASCII = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]
ALPHABETS = {"cjk": CJK, "emoji": EMOJI, "accented": ACCENTED, "ascii": ASCII}


@pytest.fixture(scope="module", params=["tiny", "small"])
def tok(request: pytest.FixtureRequest, model_factory) -> ModelTokenizer:
    model_dir: Path = model_factory(request.param)
    return ModelTokenizer.from_dir(model_dir)


def _partial_ids(tok: ModelTokenizer) -> list[int]:
    """Ids whose bytes are not valid UTF-8 alone: pieces of multi-byte characters."""
    return [i for i in range(tok.vocab_size) if REPLACEMENT_CHAR in tok.decode([i])]


def _stream(tok: ModelTokenizer, ids: list[int], skip: bool, chunks: list[int] | None) -> list[str]:
    """Feed ids in chunks (None: one at a time); check P2 after every push; return all deltas."""
    det = IncrementalDetokenizer(tok.decode, skip_special_tokens=skip)
    sizes = iter(chunks or [])
    deltas: list[str] = []
    emitted, pos = "", 0
    while pos < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(det.push(ids[pos:pos + n]))
        pos = min(pos + n, len(ids))
        emitted += deltas[-1]
        so_far = tok.decode(ids[:pos], skip)
        assert so_far.startswith(emitted), (ids[:pos], emitted, so_far)
        if not so_far.endswith(REPLACEMENT_CHAR):
            assert emitted == so_far, (ids[:pos], emitted, so_far)
    deltas.append(det.flush())
    assert det.num_tokens == len(ids)
    return deltas


def _check(tok: ModelTokenizer, ids: list[int], skip: bool, chunks: list[int]) -> list[str]:
    full = tok.decode(ids, skip)
    deltas = None
    for schedule in (None, chunks):  # one id at a time, then random chunks
        deltas = _stream(tok, ids, skip, schedule)
        assert "".join(deltas) == full  # P1
    assert deltas is not None
    return deltas


chunk_sizes = st.lists(st.integers(1, 7), max_size=64)


@SETTINGS
@given(data=st.data(), skip=st.booleans(), chunks=chunk_sizes)
def test_random_ids_stream_to_full_decode(tok: ModelTokenizer, data: st.DataObject, skip: bool,
                                          chunks: list[int]) -> None:
    partial = _partial_ids(tok)
    special = list(tok.special_tokens)
    any_id = st.integers(0, tok.vocab_size - 1)
    # Weighted towards the interesting ids: byte pieces of multi-byte characters and specials.
    one_id = st.one_of(any_id, st.sampled_from(partial), st.sampled_from(partial), st.sampled_from(special))
    ids = data.draw(st.lists(one_id, max_size=48), label="ids")
    _check(tok, ids, skip, chunks)


text_strategy = st.one_of(
    *(st.lists(st.sampled_from(chars), max_size=24).map("".join) for chars in ALPHABETS.values()),
    st.lists(st.sampled_from(CJK + EMOJI + ACCENTED + ASCII), max_size=32).map("".join),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=24),  # any code point
)


@SETTINGS
@given(text=text_strategy, add_special=st.booleans(), skip=st.booleans(), chunks=chunk_sizes)
def test_encoded_text_streams_without_replacement_chars(tok: ModelTokenizer, text: str, add_special: bool,
                                                       skip: bool, chunks: list[int]) -> None:
    ids = tok.encode(text, add_special_tokens=add_special)
    assume(REPLACEMENT_CHAR not in text)  # a literal U+FFFD in the input is valid text, not an error
    deltas = _check(tok, ids, skip, chunks)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)  # P3
    # Byte-level BPE round-trips any text exactly.
    assert "".join(deltas) == (tok.bos_token if add_special and not skip else "") + text


def test_multibyte_pieces_are_held_until_complete(tok: ModelTokenizer) -> None:
    text = "世界 👨‍👩‍👧 é"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # some characters really are split over several ids
    deltas = detokenize_all(tok.decode, ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "" in deltas  # something was held back while a character was incomplete


def test_skipped_special_token_inside_a_character(tok: ModelTokenizer) -> None:
    # The bytes of one character split around a special token: skipping it joins the bytes again.
    ids = tok.encode("世", add_special_tokens=False)
    assert len(ids) >= 2
    eot = tok.eos_token_ids[-1]
    mixed = [ids[0], eot, *ids[1:]]
    assert "".join(detokenize_all(tok.decode, mixed, skip_special_tokens=True)) == "世"
    # Not skipped, the split character is invalid UTF-8 on both sides: same as the full decode.
    shown = detokenize_all(tok.decode, mixed, skip_special_tokens=False)
    assert "".join(shown) == tok.decode(mixed) and REPLACEMENT_CHAR in tok.decode(mixed)


def test_context_ids_are_not_emitted(tok: ModelTokenizer) -> None:
    context = tok.encode("Once upon a time", add_special_tokens=True)[-4:]
    ids = tok.encode(" there was 一只猫 🐈.", add_special_tokens=False)
    det = IncrementalDetokenizer(tok.decode, context_ids=context)
    text = "".join(det.push([i]) for i in ids) + det.flush()
    assert text == tok.decode(ids) == " there was 一只猫 🐈."
    assert det.num_tokens == len(ids)


def test_flush_emits_incomplete_tail_and_finishes(tok: ModelTokenizer) -> None:
    ids = tok.encode("a😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tok.decode)
    out = det.push(ids[:-1])
    assert out == "a"
    tail = det.flush()
    assert out + tail == tok.decode(ids[:-1]) and tail.endswith(REPLACEMENT_CHAR)
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.push([1])
