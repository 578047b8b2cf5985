"""In-process engine: a runner plus a scheduler, driven synchronously. Used by tests, benchmarks and
as the core the gRPC worker wraps."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.admission import StepCostEstimator
from worker_svc.engine.request import FinishReason, Request
from worker_svc.engine.scheduler import Scheduler
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.step_runner import StepRunner
from worker_svc.parallel.context import TPContext
from worker_svc.sampling import SamplingParams, noise_key


@dataclass
class GenerationResult:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    matched_stop: int | None
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    num_retractions: int
    error: str | None = None


class Engine:
    """``runner`` injects a prebuilt runner (a tensor-parallel leader passes a ``LeaderRunner``, which
    broadcasts every step to the followers); by default the engine builds a ``ModelRunner``."""

    def __init__(
        self,
        config: EngineConfig,
        tp: TPContext | None = None,
        runner: StepRunner | None = None,
        step_costs: StepCostEstimator | None = None,
    ) -> None:
        self.config = config
        self.runner: StepRunner = runner if runner is not None else ModelRunner(config, tp)
        # The config the runner was built with (a TP leader's names its rank's device).
        self.scheduler = Scheduler(self.runner, self.runner.kv, self.runner.engine_config, step_costs=step_costs)
        self._ids = itertools.count()

    def new_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        return Request(
            rid=rid or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            noise_key=noise_key(params.seed),
        )

    def submit(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        req = self.new_request(prompt_ids, params, rid)
        self.scheduler.submit(req)
        return req

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the radix prefix cache (only while nothing runs or waits); (success, message)."""
        return self.scheduler.flush_cache()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            self.scheduler.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Generate for every prompt (``n`` samples each, in order) and block until all finish.

        Sample ``i`` of a seeded request uses seed ``seed + i``: the same seed for all ``n`` would
        give ``n`` identical sequences."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [
            self.submit(prompt, p if i == 0 or p.seed is None else dataclasses.replace(p, seed=p.seed + i), rid=None)
            for prompt, p in zip(prompts, per_prompt, strict=True)
            for i in range(p.n)
        ]
        self.run_until_idle()
        return [self.result(req) for req in reqs]

    @staticmethod
    def result(req: Request) -> GenerationResult:
        assert req.finish_reason is not None
        return GenerationResult(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            output_ids=list(req.output_ids),
            finish_reason=req.finish_reason,
            matched_stop=req.matched_stop,
            logprobs=list(req.output_logprobs),
            top_logprobs=list(req.output_top_logprobs),
            num_retractions=req.num_retractions,
            error=req.error,
        )
