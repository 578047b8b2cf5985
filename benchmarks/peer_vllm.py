"""vLLM's side of benchmarks/peers.py, run by the vLLM venv's python (never imported by the project).

Loads ``vllm.LLM`` once (minutes on this host), then measures on demand so the caller can interleave
it with the other engines: each line on stdin, ``BATCH OUTPUT_LEN INPUT_LEN``, answers one JSON line
on stdout with the decode step ``(t(OUTPUT_LEN tokens) - t(1 token)) / (OUTPUT_LEN - 1)`` and the
prefill rate ``BATCH * INPUT_LEN / t(1 token)``, best of three each. An empty line or EOF ends it.

    VLLM_PY -m benchmarks.peer_vllm MODEL       # or: VLLM_PY benchmarks/peer_vllm.py MODEL
"""

from __future__ import annotations

import json
import sys
import time


def _timed(llm, prompts, tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best


def main(model: str) -> None:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, max_num_seqs=32, enable_prefix_caching=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        batch, output_len, input_len = (int(v) for v in line.split())
        # Distinct token ids per request, so nothing is shared between them.
        prompts = [TokensPrompt(prompt_token_ids=[(7 + 13 * b + 31 * i) % 30000 + 100 for i in range(input_len)])
                   for b in range(batch)]
        one = _timed(llm, prompts, 1)
        full = _timed(llm, prompts, output_len)
        print(json.dumps({"batch": batch, "decode_step_s": (full - one) / (output_len - 1),
                          "prefill_tok_s": batch * input_len / one}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
