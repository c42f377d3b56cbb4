"""Sampling: logit filters, and a jitted multi-turn sampler over a static-shape KV cache."""

from agentrl_jax.sampling.filters import (
    SamplingConfig, filtered_log_probs, model_log_probs, nucleus_fits_prefilter, sample,
)
from agentrl_jax.sampling.padding import bucket_width, pad_rows
from agentrl_jax.sampling.sampler import (
    SampleOutput, Sampler, SamplerState, StopReason, append, decode, init_state,
)

__all__ = [
    "SampleOutput", "Sampler", "SamplerState", "SamplingConfig", "StopReason", "append",
    "bucket_width", "decode", "filtered_log_probs", "init_state", "model_log_probs",
    "nucleus_fits_prefilter", "pad_rows", "sample",
]
