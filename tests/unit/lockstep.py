"""Two runners driven in lockstep over one script of requests joining, decoding and finishing, every step's
logits held equal bit for bit: the check that an alternative decode path (compiled, fused) computes exactly
what the layer-by-layer modules compute."""

from __future__ import annotations

import torch

from tests.unit.test_cuda_graph_runner import Requests


def decode_script(prompts: list[list[int]]) -> list[tuple]:
    """("join", rid, prompt) / ("decode", steps) / ("finish", rid): 1, 3, 2, 5, 3 and 1 requests in flight,
    unequal contexts, rows no longer contiguous after a finish."""
    return [
        ("join", "a", prompts[0][:3]), ("decode", 3),  # one request
        ("join", "b", prompts[1][:9]), ("join", "c", prompts[2][:5]), ("decode", 3),  # three, unequal contexts
        ("finish", "b"), ("decode", 2),  # rows no longer contiguous
        *[("join", f"e{i}", prompts[4][: 2 + i]) for i in range(3)], ("decode", 2),  # five
        ("finish", "e0"), ("finish", "a"), ("decode", 3),  # three again
        ("finish", "c"), ("finish", "e1"), ("decode", 2),  # one again, at a new context length
    ]


def run_lockstep(script: list[tuple], reference: Requests, candidate: Requests) -> list[int]:
    """Play ``script`` on both; every join's and decode's logits must be equal (atol 0). -> the number of
    requests of each decode step."""
    batch_sizes = []
    next_tokens: dict[str, int] = {}
    for action, *args in script:
        if action == "join":
            logits = [r.join(*args) for r in (reference, candidate)]
            torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
            next_tokens[args[0]] = int(logits[0][-1].argmax())
        elif action == "finish":
            for r in (reference, candidate):
                r.finish(args[0])
            next_tokens.pop(args[0])
        else:
            for _ in range(args[0]):
                logits = [r.decode(dict(next_tokens)) for r in (reference, candidate)]
                torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
                next_tokens = dict(zip(next_tokens, logits[0].argmax(dim=-1).tolist(), strict=True))
                batch_sizes.append(len(next_tokens))
    return batch_sizes
