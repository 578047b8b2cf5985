"""Incremental (streaming) detokenization, as HF TGI and vLLM do it.

Decoding each new token alone is wrong: a byte-level BPE token may be one byte of a multi-byte
character (CJK, emoji), and SentencePiece-style decoders render a token differently at the start of
a text. So each step decodes a short window of ids twice:

    ids:  ... | prefix_offset ........ read_offset ........ end |
                 \\-- prefix_text --/
                 \\------------------ new_text -----------------/

and emits new_text[len(prefix_text):] unless new_text ends in U+FFFD (the decoder's rendering of an
incomplete UTF-8 sequence): then it waits for more ids. After emitting, the window slides:
prefix_offset = read_offset, read_offset = end. `flush()` emits whatever remains, U+FFFD included.

Guarantees (tests/unit/test_detokenize.py checks them with hypothesis on the generated models):
- the concatenation of all deltas (flush included) equals `decode(all ids)` exactly;
- the text emitted so far is always a prefix of that final decode: nothing is repeated, dropped or
  revised later;
- for ids of valid text, no delta holds U+FFFD or half a character, and after each id whose bytes
  complete a character, all text up to it has been emitted.

Window starts only move to points where the decode ended on a complete character, which keeps
window decodes equal to the matching slice of the full decode for byte-level tokenizers even when
ids decode to invalid UTF-8 (each maximal invalid sequence renders as one U+FFFD either way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[list[int], bool], str]


class IncrementalDetokenizer:
    """Streaming detokenizer for one sequence.

    `decode(ids, skip_special_tokens) -> str` is the tokenizer's decode. `context_ids` precede the
    sequence (e.g. the prompt's last ids): they give the first tokens their context and are never
    emitted.
    """

    def __init__(self, decode: DecodeFn, skip_special_tokens: bool = False,
                 context_ids: Iterable[int] = ()):
        self._decode = decode
        self.skip_special_tokens = skip_special_tokens
        # Only ids from prefix_offset on are kept; offsets are relative to self._ids[0].
        self._ids: list[int] = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix:read], computed lazily
        self.num_tokens = 0  # ids pushed (context excluded)
        self.finished = False

    def _decode_window(self, start: int, end: int | None = None) -> str:
        return self._decode(self._ids[start:end], self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode_window(self._prefix_offset, self._read_offset)
        new_text = self._decode_window(self._prefix_offset)
        prefix_len = len(self._prefix_text)
        if not final and (len(new_text) <= prefix_len or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[prefix_len:]
        # Slide the window and drop ids before its new start.
        drop = self._read_offset
        self._ids = self._ids[drop:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        return delta

    def push(self, ids: Sequence[int]) -> str:
        """Feed the next ids; return the text that became final (possibly empty)."""
        if self.finished:
            raise RuntimeError("push() after flush()")
        out = []
        # One step per id, so a chunk that ends mid-character still releases the complete text
        # before it.
        for i in ids:
            self._ids.append(int(i))
            self.num_tokens += 1
            out.append(self._step(final=False))
        return "".join(out)

    def flush(self) -> str:
        """Emit everything not yet emitted (an incomplete character becomes U+FFFD) and finish."""
        if self.finished:
            return ""
        self.finished = True
        return self._step(final=True)


def detokenize_all(decode: DecodeFn, ids: Sequence[int], skip_special_tokens: bool = False,
                   chunk_sizes: Iterable[int] | None = None) -> list[str]:
    """Deltas for ids fed in chunks (default: one id at a time), the flush last."""
    det = IncrementalDetokenizer(decode, skip_special_tokens)
    sizes = iter(chunk_sizes) if chunk_sizes is not None else None
    deltas, pos = [], 0
    while pos < len(ids):
        n = max(1, next(sizes, 1)) if sizes is not None else 1
        deltas.append(det.push(ids[pos:pos + n]))
        pos += n
    deltas.append(det.flush())
    return deltas
