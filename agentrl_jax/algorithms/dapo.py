"""DAPO's batch-level pieces as pure functions: the dynamic-sampling mask and overlong shaping.

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv:2503.14476), and verl's ``recipe/dapo``. DAPO's other two pieces are loss
settings, not functions of their own: clip-higher is the ``"policy_clip"`` term with
``clip_low=0.2, clip_high=0.28`` (:func:`~agentrl_jax.algorithms.losses.clipped_surrogate`)
and its token-level loss is the ``"token-mean"`` aggregation (sum of token losses over the
batch divided by its number of tokens, :mod:`~agentrl_jax.algorithms.aggregation`).

Both functions here are per trajectory (``[N]``) and do not touch the loss: the trainer
applies them (drops the masked groups and refills the batch; adds the penalty to the
reward before advantages are computed).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms.advantages import _check_shape, _dense_segment_ids, _rows_mask


def dynamic_sampling_keep(
    rewards: jax.Array,
    group_ids: jax.Array,
    traj_mask: jax.Array | None = None,
    *,
    keep_singletons: bool = False,
) -> jax.Array:
    """DAPO dynamic sampling: which trajectories to keep, ``[N]`` bool.

    rewards [N] float, group_ids [N] int (any ids, as in
    :func:`~agentrl_jax.algorithms.advantages.grpo_advantages`), traj_mask [N] bool or None.

    A row is kept iff it is valid and its group's valid rewards are not all equal
    (``max_g R > min_g R``): DAPO's constraint ``0 < |{o_i : correct}| < G`` (Eq. 11),
    generalised to any reward, so a group where every trajectory succeeded, or every one
    failed, is dropped. These are exactly the groups whose group-relative advantages
    (GRPO, Dr. GRPO, RLOO) are 0 for every member, i.e. that would add no policy gradient
    but still count in a token-mean denominator. Equality is exact (no tolerance), as in
    :func:`~agentrl_jax.algorithms.advantages.group_normalize`. A NaN reward drops its group.

    A group of one valid row is all-equal and dropped unless ``keep_singletons`` (verl's
    DAPO filter keeps it, because verl gives a lone sample ``A = R``; here it gets 0).

    This is only the mask: over-sampling and refilling the batch until it holds enough
    kept groups is the trainer's job. The number of kept groups is the number of distinct
    ``group_ids`` among kept rows.
    """
    (n,) = rewards.shape
    _check_shape("group_ids", group_ids, (n,))
    valid = _rows_mask(traj_mask, n)
    if n == 0:
        return valid
    rewards = rewards.astype(jnp.result_type(rewards, jnp.float32))
    segment = _dense_segment_ids([group_ids], valid)
    rewards = jnp.where(valid, rewards, 0.0)
    high = jax.ops.segment_max(rewards, segment, num_segments=n)[segment]
    low = jax.ops.segment_min(rewards, segment, num_segments=n)[segment]
    varied = high > low
    if keep_singletons:
        count = jax.ops.segment_sum(valid.astype(jnp.int32), segment, num_segments=n)[segment]
        varied = varied | (count == 1)
    return valid & varied


def overlong_penalty(
    lengths: jax.Array, *, max_length: int, cache_length: int, penalty: float = 1.0
) -> jax.Array:
    """DAPO soft overlong punishment per trajectory, ``[N]`` float32 (a reward to add, <= 0).

    lengths [N] (int or float): response length ``|y|`` in tokens (e.g. the loss tokens of
    the trajectory, ``loss_mask.sum(-1)``). With ``L_max = max_length``,
    ``L_cache = cache_length`` (DAPO, Eq. 13, times ``penalty``)::

        R(y) = 0                                   if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
             = -1                                  if |y| > L_max

    i.e. ``penalty * clip(((L_max - L_cache) - |y|) / L_cache, -1, 0)``: 0 up to
    ``L_max - L_cache``, then linear down to ``-penalty`` at ``L_max``, and ``-penalty``
    beyond. DAPO uses L_max = 20480, L_cache = 4096. verl's ``overlong_buffer``
    (``len = L_cache``, ``penalty_factor = penalty``, ``L_max`` = max response length) has
    no floor, which only differs for ``|y| > L_max``, lengths its sampler cannot produce.
    """
    for name, value, ok, what in (
        (
            "max_length",
            max_length,
            isinstance(max_length, numbers.Integral) and max_length > 0,
            "an int > 0",
        ),
        (
            "cache_length",
            cache_length,
            isinstance(cache_length, numbers.Integral) and 0 < cache_length <= max_length,
            "an int in (0, max_length]",
        ),
        ("penalty", penalty, isinstance(penalty, numbers.Real) and penalty >= 0, "a number >= 0"),
    ):
        if isinstance(value, bool) or not ok:
            raise ValueError(f"overlong_penalty: {name} must be {what}, got {value!r}")
    if lengths.ndim != 1:
        raise ValueError(f"lengths: expected shape [N], got {tuple(lengths.shape)}")
    lengths = lengths.astype(jnp.float32)
    start = float(max_length - cache_length)
    return penalty * jnp.clip((start - lengths) / float(cache_length), -1.0, 0.0)
