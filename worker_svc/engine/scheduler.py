"""Continuous-batching scheduler (leader rank only).

Each ``step()`` runs one model forward: an extend batch when waiting requests can be admitted (new
prompts, the next chunk of a long prompt, or the recompute of a retracted request), otherwise one
decode token for every running request. It owns KV accounting on the runner's ``KVCache``: slots are
taken from its allocator when a step needs them and returned when a request finishes, is aborted or is
retracted.

With the radix prefix cache (sglang's RadixAttention; off with ``--disable-radix-cache``) a slot is in
exactly one place: free in the allocator, held by the cache (``kvcache/radix_cache.py``), or owned by
one request. At admission a request matches its tokens (all but the last: one token is computed, for
its logits) against the cache, points the head of its row at the cached slots and locks them; budgets
count only its uncached tokens, and the cache's unlocked part counts as free (evicted, least recently
used first, when a step needs the slots). After each prefill step or chunk, and when a request finishes,
is aborted or is retracted, what it has computed goes into the cache: the slots the cache already had
another copy of are freed, and a running request's row is re-pointed at the cache's copy. Row changes
the leader makes here travel to tensor-parallel followers inside the next step (``TableWrites``).

Thread model: ``submit``/``abort`` may be called from any thread (they only enqueue); ``step`` runs
on the single engine thread.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

import structlog
import torch

from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.admission import StepCostEstimator, StepTimeModel, StepWork, first_batch_size
from worker_svc.engine.request import FinishReason, Request, RequestError, StepOutput
from worker_svc.engine.step_trace import StepShape
from worker_svc.executor.step_runner import StepRunner
from worker_svc.forward_batch import FatalStepError, ForwardMode, StepInput, TableWrites
from worker_svc.kvcache import KVCache
from worker_svc.kvcache.radix_cache import RadixCache, RadixNode
from worker_svc.sampling import (
    FusedSamplingOps,
    SampleOutput,
    Sampler,
    SamplingBatch,
    SamplingParamError,
    SamplingParams,
)

log = structlog.get_logger(__name__)

# A waiting request whose next this many uncached tokens another request computes in the same step waits a
# step for them (Scheduler._computed_alongside; sglang's in-batch prefix caching threshold is also 32).
IN_STEP_SHARED_TOKENS = 32
# --prefill-batching cost: the waiting requests whose cached prefix is looked up to plan the next extend step;
# those behind them count at these ones' mean cost.
ADMISSION_HORIZON = 16


@dataclass(frozen=True)
class QueueCounts:
    """The scheduler's queues and KV slot use (the engine loop's ``LoadSnapshot`` adds the rest)."""

    running: int
    waiting: int
    waiting_prompt_tokens: int
    retracted_waiting: int  # waiting requests that were retracted and await recompute
    free_tokens: int  # free slots plus what the prefix cache could evict (as sglang counts them)
    total_tokens: int
    used_tokens: int
    cached_tokens: int = 0  # held by the radix prefix cache (evictable or in use)
    cache_hit_rate: float = 0.0  # of the prompt tokens admitted so far, the share found in the cache


class Scheduler:
    """``kv`` is the runner's KV cache (the engine passes ``runner.kv``): this scheduler owns its slot
    accounting; ``engine_config`` gives the batching budgets."""

    def __init__(
        self,
        runner: StepRunner,
        kv: KVCache,
        engine_config: EngineConfig,
        eos_token_ids: frozenset[int] | None = None,
        step_costs: StepCostEstimator | None = None,
    ) -> None:
        """``step_costs`` plans extend steps under ``--prefill-batching cost`` (default: a ``StepTimeModel``
        fitted to this scheduler's steps); under ``budget`` it is not used."""
        self.runner = runner
        self.engine_config = engine_config
        self.allocator = kv.allocator
        self.req_table = kv.req_table
        # The fused sampling kernels run where this project's CPU kernels loaded (the kernel plan's cpu_ops).
        cpu_ops = runner.kernels.cpu_ops if runner.device.type == "cpu" else None
        self.sampler = Sampler(fused_ops=cast(FusedSamplingOps | None, cpu_ops))
        model_config = runner.model_config
        self.eos_token_ids = frozenset(model_config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked: Request | None = None  # a long prompt part-way through chunked prefill
        self.cache: RadixCache | None = None if engine_config.disable_radix_cache else RadixCache(self.allocator)
        # Row changes not made by a step's own slots, for the next step to carry (TP followers).
        self._table_writes: list[tuple[int, int, torch.Tensor]] = []
        self._no_slots = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        # Prompt tokens at first admission, and how many of them the prefix cache held (hit rate).
        self.prompt_tokens_admitted = 0
        self.prompt_tokens_cached = 0
        self.step_costs: StepCostEstimator | None = None  # None: admission by the budgets alone
        if engine_config.prefill_batching == "cost":
            self.step_costs = step_costs if step_costs is not None else StepTimeModel()
        self.last_step: StepShape | None = None  # what the last step() computed (None: no forward ran)
        self._first_admitted: list[Request] = []  # this step's requests admitted for the first time
        self._inbox: list[Request] = []
        self._abort_inbox: list[str] = []
        self._flush_inbox: list[Future[tuple[bool, str]]] = []
        self._lock = threading.Lock()

    # ---- API for other threads -------------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (naming the field) for a request this worker can never serve."""
        vocab = self.vocab_size
        if not prompt_ids:
            raise RequestError("input_ids", "input_ids is empty: the prompt needs at least one token")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("input_ids", f"input_ids contains token id {bad} outside [0, {vocab})")
        try:
            params.validate(vocab_size=vocab)
        except SamplingParamError as exc:
            raise RequestError(exc.field, str(exc)) from None
        limit = min(self.runner.context_len, self.allocator.size)
        if len(prompt_ids) >= limit:
            raise RequestError(
                "input_ids", f"prompt of {len(prompt_ids)} tokens does not fit: the limit is {limit - 1}", resource=True
            )
        if len(prompt_ids) + params.max_new_tokens > limit:
            raise RequestError(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds {limit} tokens "
                f"(context length {self.runner.context_len}, KV pool {self.allocator.size})",
                resource=True,
            )

    def submit(self, request: Request) -> None:
        self.validate(request.prompt_ids, request.params)
        with self._lock:
            self._inbox.append(request)

    def abort(self, rid: str) -> None:
        with self._lock:
            self._abort_inbox.append(rid)

    def request_flush(self) -> Future[tuple[bool, str]]:
        """Ask for ``flush_cache`` at the start of the next step; the future gets its (success, message)."""
        future: Future[tuple[bool, str]] = Future()
        with self._lock:
            self._flush_inbox.append(future)
        return future

    def refuse_flushes(self, why: str) -> None:
        """Answer every pending flush request with (False, why): the engine loop will not step again."""
        with self._lock:
            flushes, self._flush_inbox = self._flush_inbox, []
        for future in flushes:
            if future.set_running_or_notify_cancel():
                future.set_result((False, f"cache not flushed: {why}"))

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._abort_inbox or self._flush_inbox)
        return pending or bool(self.waiting or self.running or self.chunked)

    def counts(self) -> QueueCounts:
        """Call when no step runs (on the engine thread between steps, or before it starts): the
        queues are read without the lock."""
        free = self._free_capacity()
        return QueueCounts(
            running=len(self.running) + (self.chunked is not None),
            waiting=len(self.waiting),
            waiting_prompt_tokens=sum(len(r.prompt_ids) for r in self.waiting),
            retracted_waiting=sum(1 for r in self.waiting if r.num_retractions),
            free_tokens=free,
            total_tokens=self.allocator.size,
            used_tokens=self.allocator.size - free,
            cached_tokens=self.cache.total_size() if self.cache is not None else 0,
            cache_hit_rate=self.prompt_tokens_cached / max(1, self.prompt_tokens_admitted),
        )

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the radix prefix cache, freeing its slots (FlushCache; engine thread only). As in
        sglang, only while no request runs or waits: otherwise (False, why) and nothing changes."""
        if self.cache is None:
            return True, "the radix cache is disabled (--disable-radix-cache): nothing to flush"
        busy = len(self.running) + len(self.waiting) + (self.chunked is not None)
        if busy:
            return False, f"cache not flushed: {busy} request(s) running or waiting"
        tokens = self.cache.total_size()
        if not self.cache.reset():  # cannot happen with no request live; say so rather than assert
            return False, "cache not flushed: a cached prefix is still in use"
        log.info("prefix cache flushed", tokens=tokens)
        return True, f"flushed {tokens} cached tokens"

    # ---- the engine loop -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self.last_step = None
        self._first_admitted = []
        self._answer_flushes()
        outputs = self._drain_inbox()
        extend = self._schedule_extend()
        if extend:
            outputs += self._timed_run(ForwardMode.EXTEND, extend + self._mixed_decode(extend), prefills=len(extend))
        elif self.running:
            decode = self._schedule_decode()
            if decode:
                outputs += self._timed_run(ForwardMode.DECODE, [(req, 1) for req in decode])
        return outputs

    def _timed_run(self, mode: ForwardMode, batch: list[tuple[Request, int]], prefills: int = 0) -> list[StepOutput]:
        """``_run``, telling ``step_costs`` what the step computed and how long it took (forward, sampling
        and bookkeeping: what a request admitted to it waits for)."""
        if self.step_costs is None:
            return self._run(mode, batch, prefills)
        prompts, rows = batch[:prefills], batch[prefills:]
        work = StepWork(prompt_tokens=sum(n for _, n in prompts),
                        prompt_pairs=sum(StepWork.pairs(n, req.num_cached) for req, n in prompts),
                        rows=len(rows), row_pairs=sum(StepWork.pairs(1, req.num_cached) for req, _ in rows))
        started = time.perf_counter()
        outputs = self._run(mode, batch, prefills)
        if self.last_step is not None:  # the forward ran
            self.step_costs.observe(work, (time.perf_counter() - started) * 1000)
        return outputs

    def _answer_flushes(self) -> None:
        with self._lock:
            flushes, self._flush_inbox = self._flush_inbox, []
        for future in flushes:
            if future.set_running_or_notify_cancel():
                future.set_result(self.flush_cache())

    def _drain_inbox(self) -> list[StepOutput]:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._abort_inbox = self._abort_inbox, []
        self.waiting.extend(new)
        outputs = []
        for rid in aborts:
            req = self._find(rid)
            if req is not None:
                outputs.append(self._finish(req, FinishReason.ABORT))
        return outputs

    def _find(self, rid: str) -> Request | None:
        for req in (*self.waiting, *self.running, *([self.chunked] if self.chunked else [])):
            if req.rid == rid:
                return req
        return None

    def _reserved_for_decode(self, extra: Sequence[Request] = ()) -> int:
        ratio = self.engine_config.new_token_reserve_ratio
        return math.ceil(ratio * sum(r.remaining_new_tokens for r in (*self.running, *extra)))

    def _free_capacity(self) -> int:
        """Slots a step can have: the free ones plus the prefix cache's unlocked (evictable) ones."""
        return self.allocator.available() + (self.cache.evictable_size() if self.cache is not None else 0)

    def _make_room(self, n: int) -> bool:
        """Evict from the prefix cache until ``n`` slots are free; False if that is not enough."""
        short = n - self.allocator.available()
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.available() >= n

    def _schedule_extend(self) -> list[tuple[Request, int]]:
        """Pick (request, new tokens) pairs for an extend step within the token and memory budgets."""
        budget = self.engine_config.max_prefill_tokens
        taken = 0  # slots this batch will allocate
        chunk_size = self.engine_config.chunked_prefill_size
        batch: list[tuple[Request, int]] = []
        if self.chunked is not None:
            req = self.chunked
            n = min(req.seq_len - req.num_cached, chunk_size, budget, self._free_capacity())
            if n <= 0:
                return []
            batch.append((req, n))
            budget -= n
            taken += n
            if req.num_cached + n < req.seq_len:
                return batch  # one chunked request at a time
        admitted: list[Request] = []
        deferred: list[Request] = []  # wait a step: a request computing now computes their beginning too
        limit = self._admission_limit(budget)
        while self.waiting and budget > 0 and len(admitted) < limit:
            full = len(self.running) + len(batch) >= self.engine_config.max_running_requests
            if full or not self.req_table.available():
                break
            req = self.waiting.popleft()
            prefix, node = self._match(req)
            cached = int(prefix.numel())
            if self._computed_alongside(req, cached, batch):
                deferred.append(req)
                continue
            if node is not None:  # pinned first, so what the budget counts as evictable excludes it
                assert self.cache is not None
                self.cache.lock(node)
            reserve = math.ceil(self.engine_config.new_token_reserve_ratio * req.remaining_new_tokens)
            if req.seq_len - cached + reserve > self._free_capacity() - taken - self._reserved_for_decode(admitted):
                if node is not None:
                    assert self.cache is not None
                    self.cache.unlock(node)
                self.waiting.appendleft(req)
                break  # first come, first served: do not let later requests overtake it
            row = self.req_table.alloc()
            assert row is not None  # checked above
            req.req_row = row
            if cached:
                self._write_row(row, 0, prefix)
            req.num_cached = req.prefix_len = cached
            req.cache_node = node
            if req.num_retractions == 0:  # first admission: what usage reports as cached
                req.scheduled_time = time.monotonic()
                self._first_admitted.append(req)
                req.cached_prompt_tokens = min(cached, len(req.prompt_ids))
                self.prompt_tokens_admitted += len(req.prompt_ids)
                self.prompt_tokens_cached += req.cached_prompt_tokens
            n = min(req.seq_len - cached, chunk_size, budget)
            batch.append((req, n))
            admitted.append(req)
            budget -= n
            taken += n
            if cached + n < req.seq_len:
                self.chunked = req
                break
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order
        return batch

    def _admission_limit(self, budget: int) -> int:
        """How many waiting requests this extend step admits at most: under ``--prefill-batching cost`` the
        first share of the queue's split into steps that makes the waiting requests' summed time to first
        token least (engine/admission.py), each request's cost from its uncached tokens, the fixed cost from
        the model and the running requests that ride along; otherwise (or before the model has a fit) all
        that the budgets allow."""
        unlimited = len(self.waiting)
        costs = self.step_costs.coefficients() if self.step_costs is not None and unlimited > 1 else None
        if costs is None:
            return unlimited
        riders = self.running if self.engine_config.enable_mixed_chunk else []
        fixed_ms = costs.fixed_ms(len(riders), sum(StepWork.pairs(1, r.num_cached) for r in riders))
        own_ms: list[float] = []
        tokens: list[int] = []
        chunk_size = self.engine_config.chunked_prefill_size
        for req in itertools.islice(self.waiting, ADMISSION_HORIZON):
            cached = self._cached_estimate(req)
            n = min(req.seq_len - cached, chunk_size)  # a long prompt's first chunk: what this step would take
            own_ms.append(costs.prompt_ms(n, StepWork.pairs(n, cached)))
            tokens.append(n)
        behind = unlimited - len(own_ms)
        own_ms += [statistics.fmean(own_ms)] * behind
        tokens += [round(statistics.fmean(tokens))] * behind
        return first_batch_size(own_ms, tokens, fixed_ms, budget)

    def _cached_estimate(self, req: Request) -> int:
        """Tokens of ``req`` the prefix cache holds now (what admission would match), without touching it."""
        if self.cache is None:
            return 0
        return self.cache.cached_length(req.tokens(0, req.seq_len - 1))

    def _computed_alongside(self, req: Request, cached: int, batch: list[tuple[Request, int]]) -> bool:
        """Whether a request in this step's batch (the chunked one continuing, if any, is its first entry)
        shares the first IN_STEP_SHARED_TOKENS tokens ``req`` would compute: those are not cached yet because
        that request computes them, so ``req`` waits and finds them in the cache instead of computing them a
        second time (sglang's in-batch prefix caching; e.g. a burst of requests on a new system prompt, or
        the n samples of a long prompt). Only with the prefix cache, and only for that many tokens or more."""
        if self.cache is None:
            return False
        end = cached + IN_STEP_SHARED_TOKENS
        if end >= req.seq_len:  # the last token is computed anyway; a short rest is not worth a step
            return False
        uncached = req.tokens(cached, end)
        # The uncached tokens first (IN_STEP_SHARED_TOKENS of them), the cached prefix only where those match.
        sharing = [other for other, _ in batch if other.seq_len >= end and other.tokens(cached, end) == uncached]
        if not sharing:
            return False
        prefix = req.tokens(0, cached)
        return any(other.tokens(0, cached) == prefix for other in sharing)

    # ---- the radix prefix cache ------------------------------------------------------------------

    def _match(self, req: Request) -> tuple[torch.Tensor, RadixNode | None]:
        """The cached slots of the request's longest cached prefix, leaving at least its last token to
        compute (its logits choose the next token); (empty, None) without a cache."""
        if self.cache is None:
            return self._no_slots, None
        return self.cache.match_prefix(req.fill_ids[: req.seq_len - 1])

    def _write_row(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Point ``row`` at ``slots`` from ``start`` now, and tell the followers with the next step."""
        self.req_table.write(row, start, slots)
        self._table_writes.append((row, start, slots))

    def _take_table_writes(self) -> TableWrites | None:
        if not self._table_writes:
            return None
        writes, self._table_writes = self._table_writes, []
        return TableWrites(
            rows=[row for row, _, _ in writes],
            starts=[start for _, start, _ in writes],
            lens=[int(slots.numel()) for _, _, slots in writes],
            slots=torch.cat([slots for _, _, slots in writes]),
        )

    def _cache_computed(self, req: Request) -> None:
        """After a prefill step or chunk (sglang's cache_unfinished_req): put what the request has
        computed into the cache, free its copies of what the cache already had, point its row at the
        cache's slots and move its lock to the new end of its prefix."""
        cache, row, node = self.cache, req.req_row, req.cache_node
        assert cache is not None and row is not None and node is not None
        key = req.fill_ids[: req.num_cached]
        present = cache.insert(key, self.req_table.slots(row, req.num_cached))
        shared, new_node = cache.match_prefix(key)
        if present > req.prefix_len:  # another request cached these first: ours are duplicates
            self.allocator.free(self.req_table.slots(row, present)[req.prefix_len :].clone())
            self._write_row(row, req.prefix_len, shared[req.prefix_len : present])
        cache.lock(new_node)
        cache.unlock(node)
        req.cache_node, req.prefix_len = new_node, req.num_cached

    def _mixed_decode(self, extend: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Running requests ride along in an extend step as one-token extends, so a long chunked
        prefill does not stall everyone's decoding (sglang's mixed chunk)."""
        if not self.engine_config.enable_mixed_chunk:
            return []
        in_extend = {id(req) for req, _ in extend}
        riders = [req for req in self.running if id(req) not in in_extend]
        needed = sum(n for _, n in extend) + len(riders)
        if not riders or needed > self._free_capacity():
            return []
        return [(req, 1) for req in riders]

    def _schedule_decode(self) -> list[Request]:
        # Evict unused cached prefixes, then retract (release and requeue for recompute) the newest
        # requests, until every survivor gets a slot.
        while not self._make_room(len(self.running)):
            victim = max(self.running, key=lambda r: r.arrival_time)
            if len(self.running) == 1 and self.chunked is not None:
                victim = self.chunked
            self._retract(victim)
        return list(self.running)

    def _retract(self, req: Request) -> None:
        log.info("retracting request", rid=req.rid, seq_len=req.seq_len, free=self.allocator.available())
        self._free_kv(req)  # with the prefix cache its KV stays cached (evictable): the recompute can match it
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        req.num_retractions += 1
        self.waiting.appendleft(req)

    def _free_kv(self, req: Request) -> None:
        """Release the request's KV: without a cache its slots are freed; with one, what it computed
        is cached (its copies of what the cache already held are freed) and its lock is dropped."""
        row = req.req_row
        if row is None:
            return
        slots = self.req_table.slots(row, req.num_cached).clone()
        if self.cache is None:
            self.allocator.free(slots)
        else:
            assert req.cache_node is not None
            present = self.cache.insert(req.fill_ids[: req.num_cached], slots)
            self.allocator.free(slots[req.prefix_len : present])
            self.cache.unlock(req.cache_node)
        self.req_table.free(row)
        if self._table_writes:  # the row is gone: its pending writes would only dirty the next owner's
            self._table_writes = [w for w in self._table_writes if w[0] != row]
        req.req_row = None
        req.num_cached = req.prefix_len = 0
        req.cache_node = None

    def _build_step(self, mode: ForwardMode, batch: list[tuple[Request, int]]) -> StepInput | None:
        total = sum(n for _, n in batch)
        slots = self.allocator.alloc(total) if self._make_room(total) else None
        if slots is None:
            return None
        ids: list[int] = []
        positions: list[int] = []
        for req, n in batch:
            start = req.num_cached
            ids += req.fill_ids[start : start + n]
            positions += range(start, start + n)
        return StepInput(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=slots,
            req_rows=torch.tensor([req.req_row for req, _ in batch], dtype=torch.int64),
            seq_lens=[req.num_cached + n for req, n in batch],
            prefix_lens=[req.num_cached for req, _ in batch],
            table_writes=self._take_table_writes(),
        )

    def _run(self, mode: ForwardMode, batch: list[tuple[Request, int]], prefills: int = 0) -> list[StepOutput]:
        """Run one step; the first ``prefills`` entries of ``batch`` are prefills (or chunks of one),
        the rest one-token decodes."""
        step = self._build_step(mode, batch)
        if step is not None:
            self.last_step = StepShape(
                mode=mode.value, extends=prefills, extend_tokens=sum(n for _, n in batch[:prefills]),
                prefix_tokens=sum(req.num_cached for req, _ in batch[:prefills]), decodes=len(batch) - prefills,
                queued=tuple(cast(float, r.scheduled_time) - r.arrival_time for r in self._first_admitted))
        if step is None:  # accounting says it fits; if not, requeue rather than fail anyone
            for req, _ in batch:
                if req not in self.running and req is not self.chunked:
                    self._free_kv(req)
                    self.waiting.appendleft(req)
            return []
        try:
            logits = self.runner.forward(step)
        except Exception as exc:  # a failed step fails its own requests, never the engine...
            if isinstance(exc, FatalStepError):  # ...unless the engine itself is broken
                raise
            log.exception("forward step failed", mode=mode.value, batch=len(batch))
            self.last_step = None  # nothing computed: no trace line, no step time
            self.allocator.free(step.out_slots)
            return [self._finish(req, FinishReason.ABORT, error=f"internal error: {exc}") for req, _ in batch]
        for req, n in batch:
            req.num_cached += n
        if self.cache is not None:
            for req, _ in batch[:prefills]:
                self._cache_computed(req)
        ready = [i for i, (req, _) in enumerate(batch) if req.num_cached == req.seq_len]
        for i, (req, _) in enumerate(batch):
            if i in ready and req is self.chunked:
                self.chunked = None
            if i in ready and req not in self.running:
                self.running.append(req)
        if not ready:
            return []
        reqs = [batch[i][0] for i in ready]
        rows = logits if len(ready) == len(batch) else logits[torch.tensor(ready)]
        sample = self.sampler.sample(rows, self._sampling_batch(reqs))
        return self._commit_tokens(reqs, sample)

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        return SamplingBatch.build(
            params=[r.params for r in reqs],
            noise_keys=[r.noise_key for r in reqs],
            output_ids=[r.output_ids for r in reqs],
            prompt_ids=[r.prompt_ids for r in reqs],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=self.runner.device,
        )

    def _commit_tokens(self, reqs: list[Request], sample: SampleOutput) -> list[StepOutput]:
        tokens = sample.next_token_ids.tolist()
        logprobs = sample.logprobs.tolist() if sample.logprobs is not None else None
        top = None
        if sample.top_logprobs is not None:
            top = (sample.top_logprobs[0].tolist(), sample.top_logprobs[1].tolist())
        outputs = []
        now = time.monotonic()
        for i, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            if req.first_token_time is None:
                req.first_token_time = now
            req.output_ids.append(token)
            new_lp: list[float] = []
            new_top: list[list[tuple[int, float]]] = []
            if req.params.return_logprob and logprobs is not None:
                new_lp = [logprobs[i]]
                req.output_logprobs.append(logprobs[i])
                if top is not None and req.params.top_logprobs_num:
                    k = req.params.top_logprobs_num
                    new_top = [list(zip(top[0][i][:k], top[1][i][:k], strict=True))]
                    req.output_top_logprobs.extend(new_top)
            reason, matched = self._check_finish(req, token)
            if reason is not None:
                out = self._finish(req, reason, matched=matched)
                out.new_token_ids, out.new_logprobs, out.new_top_logprobs = [token], new_lp, new_top
            else:
                out = self._output(req, [token], new_lp, new_top)
            outputs.append(out)
        return outputs

    def _check_finish(self, req: Request, token: int) -> tuple[FinishReason | None, int | None]:
        if len(req.output_ids) >= req.params.min_new_tokens:
            if token in self.eos_token_ids and not req.params.ignore_eos:
                return FinishReason.STOP, token
            if token in req.params.stop_token_ids:
                return FinishReason.STOP, token
        if len(req.output_ids) >= req.params.max_new_tokens or req.seq_len >= self.runner.context_len:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(
        self, req: Request, reason: FinishReason, matched: int | None = None, error: str | None = None
    ) -> StepOutput:
        self._free_kv(req)
        if req is self.chunked:
            self.chunked = None
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason, req.matched_stop, req.error = reason, matched, error
        return self._output(req, [], [], [])

    @staticmethod
    def _output(
        req: Request, tokens: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]
    ) -> StepOutput:
        return StepOutput(
            rid=req.rid,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            new_top_logprobs=top,
            finish_reason=req.finish_reason,
            matched_stop=req.matched_stop,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_prompt_tokens,
            error=req.error,
        )
