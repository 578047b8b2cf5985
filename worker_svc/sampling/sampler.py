"""Batched, vectorized next-token sampling.

Used once per engine step on the final-position logits of every running request::

    batch = SamplingBatch.build(params, noise_keys, output_ids, prompt_ids, eos_ids, V, device)
    out = sampler.sample(logits, batch)  # logits: [B, V]

Pipeline, per row (every stage is one batched tensor op; stages nobody uses are skipped):

1. penalties: repetition (HF-style, over prompt + output tokens: positive logits divided, negative
   multiplied), then frequency/presence (OpenAI-style, over output tokens only:
   ``logit -= frequency * count + presence * (count > 0)``);
2. ``min_new_tokens``: while fewer output tokens exist, ``stop_token_ids`` and (unless
   ``ignore_eos``) the EOS ids get ``-inf``. Otherwise EOS is an ordinary token: the scheduler, not
   the sampler, decides when a request finishes;
3. greedy rows (``temperature == 0`` or ``top_k == 1``, see ``SamplingParams.is_greedy``) take the
   argmax here, before any scaling, so ``top_k == 1`` gives exactly the greedy tokens;
4. temperature: ``logits * (1 / T)`` (greedy rows use ``T = 1``). The result is ``processed_logits``;
5. truncation of sampled rows, all as logit thresholds (a token is kept iff its logit is ``>=`` the
   row's threshold, so tokens tied with the last kept one are always kept too; this makes the result
   independent of the order ties come out of a sort, hence of what else is in the batch):
   * top-k: keep the ``k`` highest logits (plus ties with the k-th);
   * top-p (nucleus), on the distribution renormalized after top-k: sort tokens by probability,
     descending; the nucleus is the shortest prefix whose cumulative probability is ``>= top_p``
     (plus ties with its last member);
   * min-p: keep tokens with ``p >= min_p * p_max`` (a ratio, so unchanged by renormalization);
6. sample by a Gumbel race (noise.py): token = ``argmax(processed_logits + g)`` over the kept tokens, ``g``
   Gumbel noise from a counter-based generator addressed by (the request's noise key, its step, token id).
   A token's noise depends on nothing else, so a seeded request reproduces its tokens regardless of batch
   composition, truncation route or retraction.

Log-probabilities are defined as ``log_softmax(processed_logits)``: after penalties, min-token
masking and temperature (``T = 1`` for greedy rows), before top-k/top-p/min-p truncation.

Performance notes (CPU decode is the hot loop): with this project's CPU kernels (``fused_ops``), truncation
is one threshold per row (kernels/csrc/sampling_truncation.cpp: the same thresholds, its sums in double where
the tensor path's cumsum is float, so the two can differ only where a cumulative probability lies within
float rounding of top_p) and the race one fused pass (kernels/csrc/sampling_race.cpp: noise, temperature,
threshold and argmax, straight from the model's bf16 logits when nothing else processes them). Elsewhere
(tensor ops, noise.py): a row with top-k races only inside its top-k view (``torch.topk``, k + 1 wide)
instead of over the vocabulary, unless a tie straddles its k-th logit; which route a row takes depends on
its own logits only, so reproducibility holds (the two routes' noise agrees to the last place of a float32
log). A full sort of the vocabulary happens only for a top-p row without top-k whose nucleus is wider than
the widest of ``Sampler.top_p_partial_widths``. ``torch.argmax`` over wide CPU rows is slow (not vectorized), so
wide argmaxes go through a max-per-chunk reduction that returns the same first-occurrence index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from worker_svc.sampling import noise
from worker_svc.sampling.noise import as_int64
from worker_svc.sampling.params import SamplingParams


class FusedSamplingOps(Protocol):
    """This project's CPU sampling kernels (``torch.ops.llmserve_cpu``: kernels/csrc/sampling_race.cpp and
    sampling_truncation.cpp)."""

    def gumbel_race(
        self, x: torch.Tensor, inv_temperature: torch.Tensor, threshold: torch.Tensor, keys: torch.Tensor,
        steps: torch.Tensor, V: int, isa: int = 0, sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[R] int64: per row, the first v < V maximizing ``x_v * inv_temperature + g_v`` (noise.py) among the v
        with ``x_v * inv_temperature >= threshold``; ``g = 0`` on rows where ``sampled`` ([R] bool) is false."""

    def truncation_threshold(
        self, x: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
        log_min_p: torch.Tensor, V: int,
    ) -> torch.Tensor:
        """[R] float32: per row of processed logits ``x * inv_temperature``, the logit threshold of top-k (0: off),
        then top-p on the renormalized top-k set (1: off), and min-p (``log(min_p)``, -inf: off); see the module
        doc. -inf on rows with none of the three."""


# Chunked argmax: chunk width, and the smallest CPU tensor for which it beats torch.argmax.
_ARGMAX_CHUNK = 512
_ARGMAX_CHUNKED_MIN_NUMEL = 1 << 16


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for [B, V] (first occurrence of the maximum), faster on wide CPU rows.

    torch's CPU argmax is a scalar loop; ``amax`` is vectorized. So: max of each chunk, the first
    chunk holding the row max, then argmax inside that one chunk. Rows containing NaN may return a
    different index than torch.argmax (which reports the NaN).
    """
    B, V = x.shape
    C = _ARGMAX_CHUNK
    if x.device.type != "cpu" or x.numel() < _ARGMAX_CHUNKED_MIN_NUMEL or V < 4 * C:
        return x.argmax(dim=-1)
    n = V // C
    cmax = x[:, : n * C].reshape(B, n, C).amax(dim=-1)  # [B, n]
    if n * C < V:
        cmax = torch.cat([cmax, x[:, n * C :].amax(dim=-1, keepdim=True)], dim=1)  # [B, n + 1]
    row_max = cmax.amax(dim=-1, keepdim=True)  # [B, 1]
    first = (cmax == row_max).to(torch.uint8).argmax(dim=-1, keepdim=True)  # [B, 1] chunk index
    # Positions of that chunk; the clamp repeats the last column in a short final chunk, which
    # cannot change the first occurrence.
    pos = (first * C + torch.arange(C, device=x.device)).clamp_(max=V - 1)  # [B, C]
    return pos.gather(1, x.gather(1, pos).argmax(dim=-1, keepdim=True)).view(B)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] long
    # log_softmax(processed_logits) at next_token_ids; [B] float32. None unless some row asked.
    logprobs: torch.Tensor | None
    # (ids [B, K] long, values [B, K] float32), K = max top_logprobs_num in the batch; None when
    # K == 0. Rows that asked for fewer (or none) should read only their first top_logprobs_num
    # columns.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None
    # [B, V] float32: logits after penalties, min-token masking and temperature, before truncation.
    # None unless some row asked for logprobs. May alias the input logits when nothing changed them.
    processed_logits: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Truncation:
    """Top-k / top-p / min-p parameters of the sampled rows (``R`` of them), as [R, 1] tensors.

    A field is None when no row uses the feature (``*_off`` masks: when every row uses it).
    """

    top_k_max: int  # largest top_k (0: no row has top-k); top-k rows always have k < V
    top_k_idx: torch.Tensor | None  # [R, 1] long: k - 1 (0 on rows without top-k)
    top_k_off: torch.Tensor | None  # [R, 1] bool: rows without top-k
    top_p: torch.Tensor | None  # [R, 1] float32 (1.0 on rows without top-p)
    top_p_off: torch.Tensor | None  # [R, 1] bool: rows with top_p == 1
    # [R, 1] bool: rows with top-p but no top-k, whose nucleus may need the whole sorted vocabulary.
    top_p_unbounded: torch.Tensor | None
    log_min_p: torch.Tensor | None  # [R, 1] float32: log(min_p), -inf where min_p == 0

    @property
    def needs_sorted(self) -> bool:
        return self.top_k_max > 0 or self.top_p is not None

    @property
    def truncates(self) -> bool:
        return self.needs_sorted or self.log_min_p is not None

    def per_row(self, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[R] top_k (int64, 0: off), top_p (float32, 1: off) and log(min_p) (float32, -inf: off), on the CPU."""
        top_k = torch.zeros(R, dtype=torch.long)
        if self.top_k_idx is not None:
            top_k = self.top_k_idx.view(R).cpu() + 1
            if self.top_k_off is not None:
                top_k = top_k.masked_fill_(self.top_k_off.view(R).cpu(), 0)
        top_p = torch.ones(R) if self.top_p is None else self.top_p.view(R).cpu()
        log_min_p = torch.full((R,), float("-inf")) if self.log_min_p is None else self.log_min_p.view(R).cpu()
        return top_k, top_p, log_min_p

    def take(self, rows: torch.Tensor) -> Truncation:
        """The parameters of a subset of rows ([R'] long indices)."""

        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return Truncation(
            top_k_max=self.top_k_max,
            top_k_idx=sel(self.top_k_idx),
            top_k_off=sel(self.top_k_off),
            top_p=sel(self.top_p),
            top_p_off=sel(self.top_p_off),
            top_p_unbounded=sel(self.top_p_unbounded),
            log_min_p=sel(self.log_min_p),
        )


def _spread(values: torch.Tensor, rows: torch.Tensor, size: int, fill: float | bool) -> torch.Tensor:
    """[size] with ``values`` at ``rows`` and ``fill`` elsewhere."""
    out = torch.full((size,), fill, dtype=values.dtype)
    out[rows] = values
    return out


def _ids_tensor(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1)


@dataclass(eq=False, slots=True)
class SamplingBatch:
    """Per-step tensors for :class:`Sampler`; build with :meth:`build`.

    ``B`` is the batch size, ``S`` the number of sampled (non-greedy) rows, ``V`` the vocabulary.
    Optional tensors are None when no row uses the feature, so the sampler skips that stage.
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    # All greedy, no logprobs, penalties or min-token masks: sample() is one argmax.
    fast_greedy: bool
    # Some rows sampled, nothing but temperature and truncation: with the fused kernels sample() reads the raw
    # logits once for thresholds and once for the race, greedy rows racing without noise.
    unprocessed: bool
    num_sampled: int
    # Row indices, set only when the batch mixes greedy and sampled rows.
    greedy_idx: torch.Tensor | None  # [B - S] long
    sample_idx: torch.Tensor | None  # [S] long
    # The sampled rows' noise keys and steps (tokens sampled so far), [S] int64, in row order; on the CPU.
    noise_keys: torch.Tensor
    noise_steps: torch.Tensor
    inv_temperatures: torch.Tensor | None  # [B, 1] float32 1 / T, 1.0 on greedy rows; None when all are 1
    truncation: Truncation  # over the S sampled rows
    # Penalties, over all rows.
    repetition_penalty: torch.Tensor | None  # [B, 1] float32
    seen_mask: torch.Tensor | None  # [B, V] bool: token occurs in prompt + output
    frequency_penalty: torch.Tensor | None  # [B, 1] float32
    presence_penalty: torch.Tensor | None  # [B, 1] float32
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output
    # min_new_tokens: (row, token) pairs set to -inf.
    min_tokens_rows: torch.Tensor | None  # [M] long
    min_tokens_cols: torch.Tensor | None  # [M] long
    # Logprobs.
    need_logprobs: bool
    top_logprobs_num: int  # max over the batch

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        noise_keys: Sequence[int | None],
        output_ids: Sequence[Sequence[int] | torch.Tensor],
        prompt_ids: Sequence[Sequence[int] | torch.Tensor],
        eos_token_ids: frozenset[int] | set[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Precompute the step's tensors. ``noise_keys[i]`` (noise.noise_key) may be None only for greedy
        rows; a row's step is ``len(output_ids[i])``.

        Prompt/output token lists are read only for rows with penalties or a pending
        ``min_new_tokens``; token ids must lie in ``[0, vocab_size)``. Parameters are expected to
        be validated (``SamplingParams.validate``).
        """
        B = len(params)
        if not (len(noise_keys) == len(output_ids) == len(prompt_ids) == B):
            raise ValueError("params, noise_keys, output_ids and prompt_ids must have equal length")
        if B == 0:
            raise ValueError("empty sampling batch")
        device = torch.device(device)
        V = vocab_size

        def f32(values: list[float], rows: int) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).view(rows, 1)

        def mask(values: list[bool]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.bool, device=device).view(len(values), 1)

        greedy = [p.is_greedy for p in params]
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        S = len(sampled_rows)
        need_logprobs = any(p.needs_logprobs for p in params)
        top_logprobs_num = min(max(p.top_logprobs_num for p in params), V)

        # --- penalties --------------------------------------------------------------------------
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        repetition_penalty = seen_mask = None
        if rep_rows:
            repetition_penalty = f32([p.repetition_penalty for p in params], B)
            seqs = [_ids_tensor(prompt_ids[i]) for i in rep_rows]
            seqs += [_ids_tensor(output_ids[i]) for i in rep_rows]
            lengths = torch.tensor([len(s) for s in seqs])
            rows = torch.tensor(rep_rows + rep_rows).repeat_interleave(lengths)
            seen_mask = torch.zeros(B, V, dtype=torch.bool, device=device)
            seen_mask[rows.to(device), torch.cat(seqs).to(device)] = True

        count_rows = [
            i
            for i, p in enumerate(params)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        frequency_penalty = presence_penalty = output_counts = None
        if count_rows:
            frequency_penalty = f32([p.frequency_penalty for p in params], B)
            presence_penalty = f32([p.presence_penalty for p in params], B)
            seqs = [_ids_tensor(output_ids[i]) for i in count_rows]
            lengths = torch.tensor([len(s) for s in seqs])
            rows = torch.tensor(count_rows).repeat_interleave(lengths).to(device)
            ids = torch.cat(seqs).to(device)
            output_counts = torch.zeros(B, V, dtype=torch.float32, device=device)
            ones = torch.ones(ids.shape, dtype=torch.float32, device=device)
            output_counts.index_put_((rows, ids), ones, accumulate=True)

        # --- min_new_tokens -------------------------------------------------------------------
        mt_rows: list[int] = []
        mt_cols: list[int] = []
        for i, p in enumerate(params):
            if p.min_new_tokens > 0 and len(output_ids[i]) < p.min_new_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:  # with ignore_eos, EOS does not stop, so it need not be masked
                    banned |= eos_token_ids
                banned_in_vocab = [t for t in sorted(banned) if 0 <= t < V]
                mt_rows += [i] * len(banned_in_vocab)
                mt_cols += banned_in_vocab
        min_tokens_rows = min_tokens_cols = None
        if mt_rows:
            min_tokens_rows = torch.tensor(mt_rows, dtype=torch.long, device=device)
            min_tokens_cols = torch.tensor(mt_cols, dtype=torch.long, device=device)

        # --- temperature and row routing --------------------------------------------------------
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        inv_temperatures = f32([1.0 / t for t in temps], B) if any(t != 1.0 for t in temps) else None
        greedy_idx = sample_idx = None
        if 0 < S < B:
            greedy_idx = torch.tensor(
                [i for i, g in enumerate(greedy) if g], dtype=torch.long, device=device
            )
            sample_idx = torch.tensor(sampled_rows, dtype=torch.long, device=device)

        sampled_keys: list[int] = []
        for i in sampled_rows:
            key = noise_keys[i]
            if key is None:
                raise ValueError(f"row {i} samples (temperature > 0) but has no noise key")
            sampled_keys.append(key)

        # --- truncation (sampled rows only) -----------------------------------------------------
        sp = [params[i] for i in sampled_rows]
        ks = [p.top_k if 0 < p.top_k < V else 0 for p in sp]  # top_k >= V keeps everything: off
        has_top_k = [k > 0 for k in ks]
        has_top_p = [p.top_p < 1.0 for p in sp]
        top_k_idx = top_k_off = top_p = top_p_off = top_p_unbounded = log_min_p = None
        if any(has_top_k) or any(has_top_p):
            top_k_idx = torch.tensor(
                [k - 1 if k > 0 else 0 for k in ks], dtype=torch.long, device=device
            ).view(S, 1)
            if not all(has_top_k):
                top_k_off = mask([not h for h in has_top_k])
            if any(has_top_p):
                top_p = f32([p.top_p for p in sp], S)
                if not all(has_top_p):
                    top_p_off = mask([not h for h in has_top_p])
                unbounded = [tp and not tk for tp, tk in zip(has_top_p, has_top_k, strict=True)]
                if any(unbounded):
                    top_p_unbounded = mask(unbounded)
        if any(p.min_p > 0.0 for p in sp):
            log_min_p = f32([p.min_p for p in sp], S).log()  # log(0) = -inf: no cut
        truncation = Truncation(
            top_k_max=max(ks, default=0),
            top_k_idx=top_k_idx,
            top_k_off=top_k_off,
            top_p=top_p,
            top_p_off=top_p_off,
            top_p_unbounded=top_p_unbounded,
            log_min_p=log_min_p,
        )

        unprocessed = (
            not need_logprobs and repetition_penalty is None and output_counts is None and min_tokens_rows is None
        )
        return cls(
            batch_size=B,
            vocab_size=V,
            device=device,
            fast_greedy=S == 0 and unprocessed,
            unprocessed=S > 0 and unprocessed,
            num_sampled=S,
            greedy_idx=greedy_idx,
            sample_idx=sample_idx,
            noise_keys=torch.tensor(as_int64(sampled_keys), dtype=torch.long),
            noise_steps=torch.tensor([len(output_ids[i]) for i in sampled_rows], dtype=torch.long),
            inv_temperatures=inv_temperatures,
            truncation=truncation,
            repetition_penalty=repetition_penalty,
            seen_mask=seen_mask,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            output_counts=output_counts,
            min_tokens_rows=min_tokens_rows,
            min_tokens_cols=min_tokens_cols,
            need_logprobs=need_logprobs,
            top_logprobs_num=top_logprobs_num,
        )


class Sampler:
    """Stateless between steps; all per-request state lives in :class:`SamplingBatch` (the noise keys
    and steps among it).

    ``top_p_partial_widths``: a top-p row without top-k looks for its nucleus among the highest
    ``w`` logits (``torch.topk``) for each width in turn, and sorts the whole vocabulary only when
    the nucleus closes inside none of them. LLM nuclei are usually a few dozen tokens, and a full
    sort of 32k logits costs milliseconds per row on a CPU. Every route gives the same tokens (the
    sorted prefix, hence its cumulative sum, is the same).
    """

    def __init__(
        self, top_p_partial_widths: Sequence[int] = (128, 1024), fused_ops: FusedSamplingOps | None = None
    ) -> None:
        if any(w < 1 for w in top_p_partial_widths):
            raise ValueError("top_p_partial_widths must be >= 1")
        self.top_p_partial_widths = tuple(sorted(top_p_partial_widths))
        self.fused_ops = fused_ops  # this project's CPU kernels; None: tensor ops (noise.py)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Pick one token per row of ``logits`` ([B, V'] of any float dtype, V' >= V).

        Columns beyond ``batch.vocab_size`` (a padded LM head) are ignored.
        """
        B, V = batch.batch_size, batch.vocab_size
        if logits.dim() != 2 or logits.shape[0] != B or logits.shape[1] < V:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match batch [{B}, {V}]")
        if logits.shape[1] > V:
            logits = logits[:, :V]

        if batch.fast_greedy:
            # float32 conversion is exact and order-preserving, so argmax in the input dtype agrees.
            return SampleOutput(_argmax(logits), None, None, None)
        if batch.unprocessed and self._fused(logits):
            return SampleOutput(self._sample_direct(logits, batch), None, None, None)

        x = logits.float()  # [B, V]
        x = self._apply_penalties(x, batch)
        if batch.min_tokens_rows is not None:
            # Out of place: x may still alias the caller's logits.
            x = x.index_put(
                (batch.min_tokens_rows, batch.min_tokens_cols),
                torch.tensor(float("-inf"), device=x.device),
            )
        # Whether x is our own copy (then later stages may work in place) or the caller's tensor.
        x_owned = x.data_ptr() != logits.data_ptr()

        S = batch.num_sampled
        # Greedy rows decide before temperature scaling: dividing can merge near-ties by rounding.
        greedy_ids: torch.Tensor | None = None
        if S == 0:
            greedy_ids = _argmax(x)  # [B]
        elif S < B:
            greedy_ids = _argmax(x[batch.greedy_idx])  # [B - S]

        if batch.inv_temperatures is not None:
            x = x.mul_(batch.inv_temperatures) if x_owned else x * batch.inv_temperatures
        processed = x  # [B, V]

        if S == 0:
            assert greedy_ids is not None
            next_ids = greedy_ids
        else:
            xs = processed if S == B else processed[batch.sample_idx]  # [S, V]
            sampled_ids = self._sample_rows(xs, batch)  # [S]
            if S == B:
                next_ids = sampled_ids
            else:
                assert greedy_ids is not None
                next_ids = torch.empty(B, dtype=torch.long, device=x.device)
                next_ids[batch.greedy_idx] = greedy_ids
                next_ids[batch.sample_idx] = sampled_ids

        if not batch.need_logprobs:
            return SampleOutput(next_ids, None, None, None)
        all_logprobs = torch.log_softmax(processed, dim=-1)  # [B, V]
        chosen = all_logprobs.gather(1, next_ids.view(B, 1)).view(B)
        top = None
        if batch.top_logprobs_num > 0:
            values, ids = torch.topk(all_logprobs, batch.top_logprobs_num, dim=-1)  # [B, K]
            top = (ids, values)
        return SampleOutput(next_ids, chosen, top, processed)

    @staticmethod
    def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.repetition_penalty is not None and batch.seen_mask is not None:  # set together
            rp = batch.repetition_penalty  # [B, 1]
            penalized = torch.where(x > 0, x / rp, x * rp)
            x = torch.where(batch.seen_mask, penalized, x)
        if (batch.output_counts is not None and batch.frequency_penalty is not None
                and batch.presence_penalty is not None):  # set together
            counts = batch.output_counts  # [B, V]
            x = x - batch.frequency_penalty * counts - batch.presence_penalty * (counts > 0)
        return x

    def _sample_direct(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The fused kernels straight on the model's logits ([B, V], any float dtype): each row scaled by 1 / T
        as the tensor path scales it (greedy rows by 1), truncated by a threshold, raced (greedy rows without
        noise, which is their argmax). The same tokens as the path below, without its float copies."""
        assert self.fused_ops is not None
        B, S = batch.batch_size, batch.num_sampled
        inv_t = torch.ones(B) if batch.inv_temperatures is None else batch.inv_temperatures.view(B)
        tr = batch.truncation
        per_row = tr.per_row(S) if tr.truncates else None
        keys, steps, sampled = batch.noise_keys, batch.noise_steps, None
        if S < B:  # spread the sampled rows' values over the batch
            assert batch.sample_idx is not None
            rows = batch.sample_idx.cpu()
            keys, steps = _spread(keys, rows, B, 0), _spread(steps, rows, B, 0)
            sampled = _spread(torch.ones(S, dtype=torch.bool), rows, B, False)
            if per_row is not None:
                per_row = (_spread(per_row[0], rows, B, 0), _spread(per_row[1], rows, B, 1.0),
                           _spread(per_row[2], rows, B, float("-inf")))
        return self._race_fused(logits, inv_t, keys, steps, per_row, sampled)

    def _fused(self, x: torch.Tensor) -> bool:
        return self.fused_ops is not None and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1

    def _sample_rows(self, xs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Truncate and sample the sampled rows ``xs`` ([S, V] processed logits) -> [S] ids."""
        S, V = xs.shape
        keys, steps = batch.noise_keys, batch.noise_steps
        tr = batch.truncation
        if self._fused(xs):
            return self._race_fused(xs, torch.ones(S), keys, steps, tr.per_row(S) if tr.truncates else None)
        if tr.top_k_max == 0:
            return self._race_full(xs, keys, steps, tr)
        # Top-k view one wider than the largest k, so that position k (a possible tie) is visible.
        K = min(V, tr.top_k_max + 1)
        vals, idx = torch.topk(xs, K, dim=-1, sorted=True)  # [S, K]
        assert tr.top_k_idx is not None
        kth = vals.gather(1, tr.top_k_idx)  # [S, 1]
        after = vals.gather(1, tr.top_k_idx + 1)  # [S, 1]
        # Every token such a row may keep lies in its first k view positions.
        in_view = after < kth  # [S, 1]
        if tr.top_k_off is not None:
            in_view &= ~tr.top_k_off
        n_in = int(in_view.sum())
        if n_in == S:
            return self._race_in_view(vals, idx, keys, steps, tr)
        if n_in == 0:
            return self._race_full(xs, keys, steps, tr)
        rows_in = in_view.view(S).nonzero().view(-1)
        rows_out = (~in_view).view(S).nonzero().view(-1)
        rin, rout = rows_in.cpu(), rows_out.cpu()
        out = torch.empty(S, dtype=torch.long, device=xs.device)
        out[rows_in] = self._race_in_view(vals[rows_in], idx[rows_in], keys[rin], steps[rin], tr.take(rows_in))
        out[rows_out] = self._race_full(xs[rows_out], keys[rout], steps[rout], tr.take(rows_out))
        return out

    @staticmethod
    def _race_in_view(
        vals: torch.Tensor, idx: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, tr: Truncation
    ) -> torch.Tensor:
        """Rows whose top-k set is exactly their first k view positions: race inside the view.

        vals/idx: [R, K] descending logits and their token ids; keys, steps: [R] (noise.py).
        """
        R, K = vals.shape
        assert tr.top_k_idx is not None
        in_k = torch.arange(K, device=vals.device) <= tr.top_k_idx  # [R, K]
        m = vals[:, :1]  # [R, 1]
        e = torch.exp(vals - m) * in_k  # [R, K] unnormalized probabilities of the top-k set
        thresh: torch.Tensor | None = None  # [R, 1] keep iff logit >= thresh
        if tr.top_p is not None:
            cum = (e / e.sum(dim=-1, keepdim=True)).cumsum(dim=-1)  # [R, K]
            # Position of the last nucleus member: the first whose cumulative prob >= top_p. If
            # rounding kept cum below top_p, this lands past the top-k set and top-k decides.
            last = (cum < tr.top_p).sum(dim=-1, keepdim=True).clamp_(max=K - 1)  # [R, 1]
            thresh = vals.gather(1, last)
            if tr.top_p_off is not None:
                thresh = thresh.masked_fill(tr.top_p_off, float("-inf"))
        if tr.log_min_p is not None:
            mp = m + tr.log_min_p  # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
            thresh = mp if thresh is None else torch.maximum(thresh, mp)
        kept = in_k if thresh is None else in_k & (vals >= thresh)
        g = noise.gumbel(noise.uniforms_at(keys.to(vals.device), steps.to(vals.device), idx))  # [R, K]
        scores = (vals + g).masked_fill_(~kept, float("-inf"))
        return idx.gather(1, scores.argmax(dim=-1, keepdim=True)).view(R)

    def _race_full(self, xs: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, tr: Truncation) -> torch.Tensor:
        """Truncate and race over the whole vocabulary. xs: [R, V]; keys, steps: [R] (noise.py)."""
        R, V = xs.shape
        thresh: torch.Tensor | None = None  # [R, 1] keep iff logit >= thresh
        if tr.truncates:
            m = xs.amax(dim=-1, keepdim=True)  # [R, 1]; the max is never truncated
            if tr.needs_sorted:
                e = (xs - m).exp_()  # [R, V] unnormalized probabilities (in place: fewer big temporaries)
                thresh = self._top_k_top_p_threshold(xs, e, m, tr)
            if tr.log_min_p is not None:
                mp = m + tr.log_min_p  # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
                thresh = mp if thresh is None else torch.maximum(thresh, mp)
        return noise.gumbel_race(xs, thresh, keys, steps)

    def _race_fused(
        self, x: torch.Tensor, inv_t: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor,
        per_row: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Truncate and race in this project's CPU kernels over the rows of ``x * inv_t`` ([R, V], [R]): a threshold
        per row (``per_row``: Truncation.per_row over these rows; None: no truncation), then one race (without noise
        on rows where ``sampled`` is false)."""
        assert self.fused_ops is not None
        R, V = x.shape
        if per_row is not None:
            floor = self.fused_ops.truncation_threshold(x, inv_t, *per_row, V)
        else:
            floor = torch.full((R,), float("-inf"))
        return self.fused_ops.gumbel_race(x, inv_t, floor, keys, steps, V, 0, sampled)

    def _top_k_top_p_threshold(
        self, xs: torch.Tensor, e: torch.Tensor, m: torch.Tensor, tr: Truncation
    ) -> torch.Tensor:
        """[R, 1] logit threshold implementing top-k, then top-p on the renormalized top-k set."""
        V = xs.shape[1]
        neg_inf = float("-inf")
        assert tr.top_k_idx is not None
        base = max(tr.top_k_max, 1)
        views = [base]  # widths of the sorted view to try, increasing; V means a full sort
        if tr.top_p_unbounded is not None:
            views = sorted({max(base, min(V, w)) for w in self.top_p_partial_widths} | {V})
        z: torch.Tensor | None = None
        for K in views:
            if K < V:
                vals = torch.topk(xs, K, dim=-1, sorted=True).values  # [R, K]
            else:
                vals = torch.sort(xs, dim=-1, descending=True).values  # [R, V]
            # By value, not index: the k-th value is the same whatever order ties came out in.
            kth = vals.gather(1, tr.top_k_idx)  # [R, 1]
            if tr.top_k_off is not None:
                kth = kth.masked_fill(tr.top_k_off, neg_inf)
            if tr.top_p is None:
                return kth
            if z is None:
                # Mass of the top-k set over the full vocab: ties with the k-th may lie beyond K.
                z = (e * (xs >= kth) if tr.top_k_max else e).sum(dim=-1, keepdim=True)  # [R, 1]
            pv = torch.exp(vals - m) * (vals >= kth) / z  # [R, K] sorted probs of the top-k set
            cum = pv.cumsum(dim=-1)  # [R, K]
            if K < V and tr.top_p_unbounded is not None:
                closed = (cum[:, -1:] >= tr.top_p) | ~tr.top_p_unbounded  # [R, 1]
                if not bool(closed.all()):
                    continue  # some nucleus extends past this view: try a wider one
            # Position of the last nucleus member: the first whose cumulative prob >= top_p.
            last = (cum < tr.top_p).sum(dim=-1, keepdim=True).clamp_(max=K - 1)  # [R, 1]
            cut = vals.gather(1, last)  # [R, 1]
            if tr.top_p_off is not None:
                cut = cut.masked_fill(tr.top_p_off, neg_inf)
            # If rounding kept cum below top_p, `cut` is at or below kth and top-k decides.
            return torch.maximum(kth, cut)
        raise AssertionError("unreachable: the last view is either bounded or the full sort")
