"""eval-ppl's sliding windows: every token after the first is scored exactly once, each window holds
at most `window` tokens, and scored tokens past the first window see at least window - stride
tokens of context; texts and settings that cannot be scored are refused with a message."""

from __future__ import annotations

import pytest

from llmserve.eval.perplexity import windows


@pytest.mark.parametrize("n,window,stride", [(2, 2, 1), (10, 4, 4), (10, 4, 1), (1000, 256, 128), (1000, 1024, 512),
                                             (257, 256, 200)])
def test_windows_score_every_token_once_with_context(n, window, stride):
    plan = windows(n, window, stride)
    scored = [t for w in plan for t in range(w.first_target, w.end)]
    assert scored == list(range(1, n))
    for w in plan:
        assert w.end - w.begin <= window and w.begin < w.first_target <= w.end
        if w.begin > 0:
            assert w.first_target - w.begin >= window - stride


@pytest.mark.parametrize("n,window,stride", [(1, 8, 4), (0, 8, 4), (10, 1, 1), (10, 8, 9), (10, 8, 0)])
def test_unscorable_inputs_are_refused(n, window, stride):
    with pytest.raises(ValueError):
        windows(n, window, stride)
