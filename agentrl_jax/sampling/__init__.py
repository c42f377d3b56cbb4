"""Sampling: logit filters, and a jitted multi-turn sampler over a static-shape or paged KV
cache."""

from agentrl_jax.sampling.filters import (
    SamplingConfig,
    filtered_log_probs,
    model_log_probs,
    nucleus_fits_prefilter,
    sample,
)
from agentrl_jax.sampling.padding import bucket_width, pad_rows
from agentrl_jax.sampling.sampler import (
    GENERATION_LAYOUTS,
    Paging,
    SampleOutput,
    Sampler,
    SamplerState,
    StopReason,
    append,
    append_in_chunks,
    append_rows,
    copy_rows,
    decode,
    generation_params,
    generation_rules,
    init_state,
    release_rows,
    resolve_layout,
)

__all__ = [
    "GENERATION_LAYOUTS",
    "Paging",
    "SampleOutput",
    "Sampler",
    "SamplerState",
    "SamplingConfig",
    "StopReason",
    "append",
    "append_in_chunks",
    "append_rows",
    "copy_rows",
    "bucket_width",
    "decode",
    "filtered_log_probs",
    "generation_params",
    "generation_rules",
    "init_state",
    "model_log_probs",
    "nucleus_fits_prefilter",
    "pad_rows",
    "release_rows",
    "resolve_layout",
    "sample",
]
