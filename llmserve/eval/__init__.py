"""Accuracy on real text: perplexity through this engine's own forward (``llmserve eval-ppl``)."""
