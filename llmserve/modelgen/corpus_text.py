"""Training text for the tokenizer: the small corpus shipped in corpus/, plus seeded filler.

A few KB of prose only yields a few thousand BPE merges; the 32000-token `bench` vocabulary needs
tens of thousands of distinct words, so we append pseudo-words built from syllables by a seeded RNG.
"""

import random
from importlib import resources

_CORPUS_PACKAGE = "llmserve.modelgen"
_CORPUS_DIR = "corpus"

_ONSETS = (
    "", "b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l", "m", "n",
    "p", "pl", "qu", "r", "s", "sh", "sk", "sl", "st", "t", "th", "tr", "v", "w", "y", "z",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ie", "oo", "ou", "y", "é", "ö", "å")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "x", "rk", "ß")
_PUNCT = (".", ".", ".", ",", "?", "!", ";")
# Multi-byte extras keep 2-, 3- and 4-byte UTF-8 sequences frequent enough to earn merges.
_EXTRAS = ("—", "…", "°", "€", "の", "は", "中", "文", "한", "😀", "🚀", "🌍", "ñ", "ç")

# Seed of the filler text: fixed, so a vocabulary size alone determines the tokenizer.
_AUGMENT_SEED = 1234


def base_corpus() -> list[str]:
    """Lines of the shipped corpus files, in file-name order (sorted for determinism)."""
    root = resources.files(_CORPUS_PACKAGE).joinpath(_CORPUS_DIR)
    files = sorted((f for f in root.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    lines: list[str] = []
    for f in files:
        lines.extend(line for line in f.read_text(encoding="utf-8").splitlines() if line.strip())
    return lines


def _pseudo_word(rng: random.Random) -> str:
    n_syllables = rng.choice((1, 2, 2, 3, 3, 4))
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syllables))


def augmented_lines(n_words: int, seed: int = _AUGMENT_SEED) -> list[str]:
    """Sentences over a lexicon of about n_words pseudo-words with Zipf-like reuse."""
    rng = random.Random(seed)
    lexicon = [_pseudo_word(rng) for _ in range(n_words)]
    # Zipf-like: low ranks reused often (they become whole-word merges), the tail appears ~once.
    weights = [1.0 / (rank + 1) ** 0.7 for rank in range(n_words)]
    lines: list[str] = []
    # Every word appears at least once (the shuffled lexicon) plus as many Zipf draws again.
    order = lexicon[:]
    rng.shuffle(order)
    stream = order + rng.choices(lexicon, weights=weights, k=n_words)
    pos = 0
    while pos < len(stream):
        length = rng.randint(5, 14)
        words = stream[pos : pos + length]
        pos += length
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words) + 1), rng.choice(_EXTRAS))
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words) + 1), str(rng.randrange(10_000)))
        sentence = " ".join(words)
        lines.append(sentence[:1].upper() + sentence[1:] + rng.choice(_PUNCT))
    return lines
