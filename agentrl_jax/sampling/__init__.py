"""Sampling: logit filters, a jitted multi-turn sampler over a static-shape or paged KV
cache (the pure engine), the :class:`Policy` protocol a rollout samples from, and the
inference scheduler (:class:`SamplerPolicy`) that serves it with a Qwen3."""

from agentrl_jax.sampling.filters import (
    SamplingConfig,
    filtered_log_probs,
    model_log_probs,
    nucleus_fits_prefilter,
    sample,
)
from agentrl_jax.sampling.jitted import Sampler
from agentrl_jax.sampling.padding import bucket_width, pad_rows
from agentrl_jax.sampling.policy import Policy, PolicySettings, Responses, ScriptedPolicy, TokenMap
from agentrl_jax.sampling.sampler import (
    Paging,
    SampleOutput,
    SamplerState,
    StopReason,
    append,
    append_in_chunks,
    append_rows,
    copy_rows,
    decode,
    init_state,
    release_rows,
)
from agentrl_jax.sampling.scheduler import SamplerPolicy
from agentrl_jax.sharding import (
    GENERATION_LAYOUTS,
    generation_params,
    generation_rules,
    resolve_layout,
)

__all__ = [
    "GENERATION_LAYOUTS",
    "Paging",
    "Policy",
    "PolicySettings",
    "Responses",
    "SampleOutput",
    "Sampler",
    "SamplerPolicy",
    "SamplerState",
    "SamplingConfig",
    "ScriptedPolicy",
    "StopReason",
    "TokenMap",
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
