"""Byte-level BPE tokenizer trained deterministically to an exact vocabulary size.

Layout follows Llama 3: BPE tokens first (256 byte symbols, then merges), then the named special
tokens, then `<|reserved_N|>` padding when the corpus cannot supply enough merges.
"""

from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from llmserve.modelgen.corpus_text import augmented_lines, base_corpus

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN)
RESERVED_TOKEN_FORMAT = "<|reserved_{}|>"

_BYTE_ALPHABET_SIZE = 256
# The real corpus is repeated so its English pairs outrank the pseudo-word filler in merge order.
_BASE_CORPUS_WEIGHT = 4


def min_vocab_size() -> int:
    return _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)


def training_lines(n_bpe: int, augment: bool) -> list[str]:
    lines = base_corpus() * _BASE_CORPUS_WEIGHT
    if augment:
        # About one pseudo-word per wanted merge: each distinct word can end as one token.
        lines += augmented_lines(n_words=n_bpe)
    return lines


def _empty_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_bos_post_processor(tok: Tokenizer) -> None:
    """encode(add_special_tokens=True) prepends BOS, as Llama 3's tokenizer.json does."""
    bos_id = tok.token_to_id(BOS_TOKEN)
    template = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0",
        pair=f"{BOS_TOKEN} $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    # ByteLevel first keeps offsets pointing at the original text (trim_offsets=False as in Llama 3).
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


@lru_cache(maxsize=8)
def _trained_json(vocab_size: int, augment: bool) -> str:
    # Cached as JSON text: a Tokenizer is mutable, so every caller gets a fresh copy.
    if vocab_size < min_vocab_size():
        raise ValueError(f"vocab_size {vocab_size} < {min_vocab_size()} (256 bytes + special tokens)")
    n_bpe = vocab_size - len(SPECIAL_TOKENS)
    tok = _empty_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training_lines(n_bpe, augment), trainer=trainer)
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    n_reserved = vocab_size - tok.get_vocab_size() - len(specials)
    reserved = [
        AddedToken(RESERVED_TOKEN_FORMAT.format(i), special=True, normalized=False) for i in range(n_reserved)
    ]
    tok.add_special_tokens(specials + reserved)
    _add_bos_post_processor(tok)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok.to_str(pretty=True)


def train_tokenizer(vocab_size: int, augment: bool = True) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly vocab_size tokens (special and reserved included).

    Depends only on (vocab_size, augment), never on the weight seed: models of one family share it.
    """
    return Tokenizer.from_str(_trained_json(vocab_size, augment))


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return ids  # type: ignore[return-value]
