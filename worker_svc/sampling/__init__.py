"""Per-request sampling parameters and the batched sampler used once per engine step."""

from worker_svc.sampling.params import (
    GREEDY_TEMPERATURE_EPS,
    SamplingParamError,
    SamplingParams,
)
from worker_svc.sampling.sampler import SampleOutput, Sampler, SamplingBatch, make_generator

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "SamplingParamError",
    "SamplingParams",
    "make_generator",
]
