"""Prompt sets of `llmserve bench-serving`, generated from a seed: random, shared-prefix and multi-turn.

Prompts are token ids drawn uniformly from the model's vocabulary without its special tokens, so
every length is exact and no dataset file is needed. With a tokenizer they can be turned into text
(`TextMaker`) for a router that is to tokenize them itself.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TokenSpace:
    """The ids prompts are drawn from: [0, vocab_size) without `excluded` (EOS, BOS, other specials)."""

    vocab_size: int
    excluded: frozenset[int] = frozenset()

    def allowed(self) -> list[int]:
        ids = [i for i in range(self.vocab_size) if i not in self.excluded]
        if not ids:
            raise ValueError(f"no token ids to draw from: vocab_size {self.vocab_size}, all excluded")
        return ids


@dataclass(frozen=True)
class Prompt:
    """One request's prompt: ids, and the text they stand for when the run sends text."""

    ids: tuple[int, ...]
    text: str | None = None


@dataclass(frozen=True)
class BenchRequest:
    """One request of a random or shared-prefix run: `group` is the index of its shared prefix (-1:
    none), the first `prefix_len` ids of the prompt."""

    prompt: Prompt
    output_len: int
    group: int = -1
    prefix_len: int = 0


@dataclass(frozen=True)
class Conversation:
    """A generated chat: turn k sends turn k-1's prompt + its answer + `user_turns[k]`."""

    index: int
    user_turns: tuple[Prompt, ...]
    output_len: int


class TextCodec(Protocol):
    """What `as_text` needs of a tokenizer (tokenizer_svc.tokenizer.ModelTokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """sglang's random lengths: uniform over [max(1, int(length * range_ratio)), length]; ratio 1 is fixed."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    return rng.randint(max(1, int(length * range_ratio)), length)


def _ids(rng: random.Random, allowed: list[int], n: int) -> tuple[int, ...]:
    return tuple(rng.choices(allowed, k=n))


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, space: TokenSpace,
                    seed: int) -> list[BenchRequest]:
    """`num` prompts of random ids; input and output lengths drawn per request (sample_len)."""
    rng = random.Random(seed)
    allowed = space.allowed()
    out = []
    for _ in range(num):
        n_in, n_out = sample_len(rng, input_len, range_ratio), sample_len(rng, output_len, range_ratio)
        out.append(BenchRequest(Prompt(_ids(rng, allowed, n_in)), n_out))
    return out


def shared_prefix_requests(num: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                           space: TokenSpace, seed: int) -> list[BenchRequest]:
    """`num` prompts, each one of `num_prefixes` random prefixes plus its own random suffix; request i
    uses prefix i mod num_prefixes before the order is shuffled (with the seed), so the groups
    differ in size by at most one and arrive interleaved."""
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1:
        raise ValueError("num_prefixes, prefix_len and suffix_len must be >= 1")
    rng = random.Random(seed)
    allowed = space.allowed()
    prefixes = [_ids(rng, allowed, prefix_len) for _ in range(num_prefixes)]
    out = [BenchRequest(Prompt(prefixes[i % num_prefixes] + _ids(rng, allowed, suffix_len)), output_len,
                        group=i % num_prefixes, prefix_len=prefix_len) for i in range(num)]
    rng.shuffle(out)
    return out


def conversations(num: int, turns: int, turn_len: int, output_len: int, space: TokenSpace,
                  seed: int) -> list[Conversation]:
    """`num` chats of `turns` user messages of `turn_len` random ids each."""
    if turns < 1 or turn_len < 1:
        raise ValueError("turns and turn_len must be >= 1")
    rng = random.Random(seed)
    allowed = space.allowed()
    return [Conversation(c, tuple(Prompt(_ids(rng, allowed, turn_len)) for _ in range(turns)), output_len)
            for c in range(num)]


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of `request_rate`
    per second (exponential gaps, the first one included, as sglang), or all at 0 for inf."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {request_rate}")
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(request_rate)
        out.append(t)
    return out


# ---- text ----------------------------------------------------------------------------------------


def text_space(space: TokenSpace, codec: TextCodec) -> TokenSpace:
    """`space` without the ids whose text is empty or not whole characters (a byte-level BPE's
    partial UTF-8): joined, such ids would decode to replacement characters, which tokenize back
    to several tokens each."""
    bad = set(space.excluded)
    for i in range(space.vocab_size):
        if i not in bad:
            piece = codec.decode([i], skip_special_tokens=True)
            if not piece or "\ufffd" in piece:
                bad.add(i)
    return TokenSpace(space.vocab_size, frozenset(bad))


@dataclass
class TextMaker:
    """Turns id prompts into text of about as many tokens: decode, re-encode, then cut what is too
    long or top up what is too short with more random ids of `space` (drawn from `rng`). Ids
    should come from text_space(), so the text has no replacement characters."""

    codec: TextCodec
    space: TokenSpace
    rng: random.Random
    max_rounds: int = 8

    def __post_init__(self) -> None:
        self._allowed = self.space.allowed()

    def text(self, ids: Sequence[int]) -> str:
        target = len(ids)
        pieces = list(ids)
        text = ""
        for _ in range(self.max_rounds):
            text = self.codec.decode(pieces, skip_special_tokens=True)
            again = self.codec.encode(text, add_special_tokens=False)
            if len(again) == target:
                return text
            if len(again) > target:  # joined pieces tokenized into more tokens: cut at a token boundary
                return self.codec.decode(again[:target], skip_special_tokens=True).rstrip("\ufffd")
            pieces += self.rng.choices(self._allowed, k=target - len(again))  # merged into fewer: top up
        return text

    def prompt(self, prompt: Prompt) -> Prompt:
        """The prompt as text, with the ids a router makes of it (special tokens added: BOS)."""
        text = self.text(prompt.ids)
        return Prompt(tuple(self.codec.encode(text, add_special_tokens=True)), text)


def requests_as_text(requests: list[BenchRequest], maker: TextMaker) -> list[BenchRequest]:
    """Text prompts. A shared prefix becomes text once per group, so the group's prompts still share
    its text (and, but for where it meets the suffix, its ids)."""
    prefix_text: dict[int, str] = {}
    out = []
    for r in requests:
        if r.group < 0 or r.prefix_len == 0:
            out.append(dataclasses.replace(r, prompt=maker.prompt(r.prompt)))
            continue
        if r.group not in prefix_text:
            prefix_text[r.group] = maker.text(r.prompt.ids[: r.prefix_len])
        text = prefix_text[r.group] + maker.text(r.prompt.ids[r.prefix_len :])
        ids = maker.codec.encode(text, add_special_tokens=True)
        out.append(dataclasses.replace(r, prompt=Prompt(tuple(ids), text)))
    return out
