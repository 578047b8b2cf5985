"""Per-request sampling parameters and the batched sampler used once per engine step."""

from worker_svc.sampling.noise import noise_key
from worker_svc.sampling.params import (
    GREEDY_TEMPERATURE_EPS,
    SamplingParamError,
    SamplingParams,
)
from worker_svc.sampling.sampler import FusedSamplingOps, SampleOutput, Sampler, SamplingBatch

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "FusedSamplingOps",
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "SamplingParamError",
    "SamplingParams",
    "noise_key",
]
