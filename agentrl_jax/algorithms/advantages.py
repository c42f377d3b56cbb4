"""Advantage estimators (GRPO, Dr. GRPO, RLOO, GiGPO, GAE) as pure, jittable functions on padded
arrays.

Layout conventions, shared by all of :mod:`agentrl_jax.algorithms`:

* ``N`` trajectories (rows), ``T`` turns and ``L`` tokens per trajectory, all padded to
  fixed sizes. Padded or invalid entries are excluded by masks, never by slicing.
* ``group_ids [N]`` (any integer dtype): the task group of each trajectory; trajectories
  with equal ids were sampled for the same task (G per task). Ids need not be dense,
  sorted or contiguous. ``traj_mask [N]`` (bool, or None for all True) marks real rows.
* ``turn_mask [N, T]``: real turns. Per-turn arrays are ``[N, T]``.
* ``loss_mask [N, L]``: 1 on the policy's own sampled (response) tokens.
* ``token_turn_index [N, L]`` int: the turn each token belongs to, -1 on non-response
  tokens; :func:`broadcast_turns_to_tokens` uses it to spread per-turn values to tokens.

Grouping is sort-based (:func:`group_normalize`): the composite key of every element is
sorted once (``jnp.lexsort``), segment ids are read off the sorted order and statistics
are segment sums, so it costs O(M log M) time and O(M) memory for M elements (M = N for
GRPO, N*T for GiGPO steps), with static shapes. Deviations are taken against a member of
each group (:func:`group_center`), so a group of equal values gets exactly 0.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

# ------------------------------------------------------------------------- helpers


def _check_shape(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")


def _rows_mask(traj_mask: jax.Array | None, n: int) -> jax.Array:
    if traj_mask is None:
        return jnp.ones((n,), bool)
    _check_shape("traj_mask", traj_mask, (n,))
    return traj_mask.astype(bool)


def _dense_segment_ids(keys: Sequence[jax.Array], valid: jax.Array) -> jax.Array:
    """Segment id in [0, M) per element; equal ids iff equal validity and all keys equal."""
    invalid = (~valid).astype(jnp.int32)
    # lexsort's last key is the primary one: invalid first, then keys[0], keys[1], ...
    columns = (invalid, *keys)
    order = jnp.lexsort(tuple(reversed(columns)))
    changed = jnp.zeros(valid.shape[0] - 1, bool)
    for column in columns:  # a handful of key columns, not data
        ordered = column[order]
        changed = changed | (ordered[1:] != ordered[:-1])
    segment_in_order = jnp.cumsum(
        jnp.concatenate([jnp.zeros(1, jnp.int32), changed.astype(jnp.int32)])
    )
    return jnp.zeros_like(segment_in_order).at[order].set(segment_in_order)


def _group_segments(keys: Sequence[jax.Array], valid: jax.Array, m: int) -> jax.Array:
    _check_shape("valid", valid, (m,))
    for k, key in enumerate(keys):
        _check_shape(f"keys[{k}]", key, (m,))
    return _dense_segment_ids(keys, valid.astype(bool))


def _center(values: jax.Array, segment: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    m = values.shape[0]
    weight = valid.astype(values.dtype)
    # Invalid elements are zeroed first (they may hold anything, even NaN); they sit in
    # segments of their own (validity is the first sort key), so they never mix in.
    values = jnp.where(valid, values, 0.0)
    count = jax.ops.segment_sum(weight, segment, num_segments=m)
    per_group = jnp.maximum(count, 1.0)
    reference = jax.ops.segment_max(values, segment, num_segments=m)
    d = (values - reference[segment]) * weight
    c = d - (jax.ops.segment_sum(d, segment, num_segments=m) / per_group)[segment]
    c = (
        c - (jax.ops.segment_sum(c * weight, segment, num_segments=m) / per_group)[segment]
    ) * weight
    return c, count[segment] * weight


def _std(centered: jax.Array, segment: jax.Array, valid: jax.Array, ddof: int) -> jax.Array:
    m = centered.shape[0]
    weight = valid.astype(centered.dtype)
    count = jax.ops.segment_sum(weight, segment, num_segments=m)
    scale = jax.ops.segment_max(jnp.abs(centered) * weight, segment, num_segments=m)
    unit = centered * weight / jnp.where(scale > 0, scale, 1.0)[segment]
    squares = jax.ops.segment_sum(unit**2, segment, num_segments=m)
    std = scale * jnp.sqrt(squares / jnp.maximum(count - ddof, 1.0))
    return std[segment] * weight


def group_center(
    values: jax.Array, keys: Sequence[jax.Array], valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Deviations from the group mean, and the size of each element's group.

    values [M] float, keys: integer key columns, each [M] (grouping as in
    :func:`group_normalize`), valid [M] bool -> ``(centered [M], count [M])``:
    ``centered = v - mean_g``, ``count = n_g`` (float), both 0 on invalid elements, which
    enter no statistic.

    Computed as a shifted, corrected two-pass mean, so that a group whose members are all
    equal gets exactly 0 by construction, whatever the values and the group size:

    1. ``d = v - v_ref`` with ``v_ref`` a member of the group (its largest): every member
       of an all-equal group has ``d = 0`` exactly (``x - x == 0`` in IEEE arithmetic),
       and elsewhere ``d`` is the difference itself, rounded once (exact when the values
       are within a factor of two: Sterbenz), so the group's common offset is gone before
       anything is summed;
    2. ``c = d - mean_g(d)``, then ``c - mean_g(c)`` (the corrected two-pass algorithm:
       the second mean is the rounding error of the first, ~1 ulp of the group's spread).

    The plain ``sum(v) / n`` in float32 is off by up to an ulp of the values themselves:
    seven copies of 9.025 have a float32 mean one ulp (9.5e-7) from 9.025, so each member
    had a "deviation" of one ulp, which a std of the same size turned into -0.47.
    """
    (m,) = values.shape
    segment = _group_segments(keys, valid, m)
    values = values.astype(jnp.result_type(values, jnp.float32))
    if m == 0:
        return values, values
    return _center(values, segment, valid.astype(bool))


def group_normalize(
    values: jax.Array,
    keys: Sequence[jax.Array],
    valid: jax.Array,
    *,
    eps: float = 1e-6,
    ddof: int = 1,
    scale_by_std: bool = True,
) -> jax.Array:
    """Normalises ``values [M]`` within groups of equal composite key.

    Elements i, j are in one group iff ``keys[k][i] == keys[k][j]`` for every key column k
    (each ``[M]``, integer) and both are valid. Returns
    ``(v - mean_g) / (std_g + eps)`` (or ``v - mean_g`` when ``scale_by_std`` is False),
    with ``std_g = sqrt(sum_g (v - mean_g)^2 / max(n_g - ddof, 1))``: eps is added to the
    standard deviation, not the variance. Invalid elements get 0 and do not enter any
    statistic.

    A group whose valid members are all equal (a group of one, in particular) gets exactly
    0 for every member, for any values and size, with no tolerance involved: deviations
    are taken against a member of the group (:func:`group_center`), so they are exactly 0,
    and so are the std and the quotient. The std is computed from ``c / max_g |c|`` and
    scaled back, so large values do not overflow float32 squares nor tiny ones underflow.
    Elsewhere the result is the formula's, up to float32 rounding of the deviations.
    """
    (m,) = values.shape
    segment = _group_segments(keys, valid, m)
    values = values.astype(jnp.result_type(values, jnp.float32))
    if m == 0:
        return values
    valid = valid.astype(bool)
    centered, _ = _center(values, segment, valid)
    if not scale_by_std:
        return centered
    return centered / (_std(centered, segment, valid, ddof) + eps)


def place_at_last_valid(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Puts ``values [N]`` at the last True position of each row of ``mask [N, K]``.

    Turns a final (outcome) reward into a per-turn or per-token reward array: 0 elsewhere,
    and an all-False row gets all 0.
    """
    n, k = mask.shape
    _check_shape("values", values, (n,))
    mask = mask.astype(bool)
    last = k - 1 - jnp.argmax(mask[:, ::-1], axis=-1)
    one_hot = (jnp.arange(k)[None, :] == last[:, None]) & jnp.any(mask, axis=-1, keepdims=True)
    return jnp.where(one_hot, values[:, None], 0.0).astype(jnp.result_type(values, jnp.float32))


def broadcast_turns_to_tokens(turn_values: jax.Array, token_turn_index: jax.Array) -> jax.Array:
    """Per-turn ``[N, T]`` -> per-token ``[N, L]`` via ``token_turn_index [N, L]``.

    Tokens with index -1 get 0. An index >= T is a caller bug and yields NaN (loud), not a
    silently clamped value.
    """
    n, _ = turn_values.shape
    if token_turn_index.ndim != 2 or token_turn_index.shape[0] != n:
        raise ValueError(
            f"token_turn_index: expected shape [{n}, L], got {tuple(token_turn_index.shape)}"
        )
    gathered = jnp.take_along_axis(
        turn_values, jnp.maximum(token_turn_index, 0), axis=1, mode="fill", fill_value=jnp.nan
    )
    return jnp.where(token_turn_index >= 0, gathered, 0.0)


def broadcast_trajectories_to_tokens(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Per-trajectory ``[N]`` -> per-token ``[N, L]``: the value on every loss token, else 0."""
    _check_shape("values", values, (loss_mask.shape[0],))
    return values[:, None] * loss_mask.astype(values.dtype)


def _scan_backwards(step, init, xs):
    """Runs ``step`` over axis 1 (time) of each ``[N, K]`` array in xs, last position first."""
    xs_time_major = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs)
    _, out = jax.lax.scan(step, init, xs_time_major, reverse=True)
    return jnp.swapaxes(out, 0, 1)


# ------------------------------------------------------------------------- GRPO


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    traj_mask: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    ddof: int = 1,
    scale_by_std: bool = True,
) -> jax.Array:
    """GRPO: ``A_i = (R_i - mean_g R) / (std_g R + eps)`` over the trajectories of a group.

    rewards [N] float, group_ids [N] int, traj_mask [N] bool or None -> advantages [N].

    ``ddof=1`` (unbiased std) matches verl, whose GRPO uses ``torch.std``; eps (1e-6, as in
    verl) is added to the std. ``scale_by_std=False`` gives the mean-only (Dr. GRPO)
    variant (:func:`dr_grpo_advantages`). A group of size 1, and a group whose rewards are
    all equal, get exactly 0 (see :func:`group_normalize`); verl instead uses mean 0 and
    std 1 for a group of one (A = R), which gives a lone sample an advantage with no
    baseline. Masked rows get 0.
    """
    (n,) = rewards.shape
    _check_shape("group_ids", group_ids, (n,))
    valid = _rows_mask(traj_mask, n)
    return group_normalize(
        rewards.astype(jnp.float32),
        [group_ids],
        valid,
        eps=eps,
        ddof=ddof,
        scale_by_std=scale_by_std,
    )


def dr_grpo_advantages(
    rewards: jax.Array, group_ids: jax.Array, traj_mask: jax.Array | None = None
) -> jax.Array:
    """Dr. GRPO: ``A_i = R_i - mean_g R``, GRPO without the division by the group std.

    rewards [N] float, group_ids [N] int, traj_mask [N] bool or None -> advantages [N].

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783), Sec. 3.2: the std normaliser weights questions by how (in)consistent
    their rewards are, so Dr. GRPO drops it (and the 1/|o_i| length normaliser, see the
    ``"seq-mean-token-sum"`` aggregation). verl: ``norm_adv_by_std_in_grpo=False``. A group
    of one, and an all-equal group, get exactly 0 (:func:`group_center`); masked rows 0.
    """
    (n,) = rewards.shape
    _check_shape("group_ids", group_ids, (n,))
    centered, _ = group_center(rewards.astype(jnp.float32), [group_ids], _rows_mask(traj_mask, n))
    return centered


def rloo_advantages(
    rewards: jax.Array, group_ids: jax.Array, traj_mask: jax.Array | None = None
) -> jax.Array:
    """RLOO: ``A_i = R_i - (1 / (n_g - 1)) sum_{j != i, j in g} R_j``, a leave-one-out baseline.

    rewards [N] float, group_ids [N] int, traj_mask [N] bool or None -> advantages [N].

    Computed as ``n_g / (n_g - 1) * (R_i - mean_g R)`` (the same quantity), from the exact
    deviations of :func:`group_center`, so an all-equal group gets exactly 0. A group of one
    has no other member to form a baseline and gets 0 (verl instead uses baseline 0 there,
    ``A = R``); masked rows get 0 and are no one's baseline.

    Sources: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (arXiv:2402.14740), Eq. 6; verl's
    ``compute_rloo_outcome_advantage``.
    """
    (n,) = rewards.shape
    _check_shape("group_ids", group_ids, (n,))
    centered, count = group_center(
        rewards.astype(jnp.float32), [group_ids], _rows_mask(traj_mask, n)
    )
    return centered * (count / jnp.maximum(count - 1.0, 1.0))


# ------------------------------------------------------------------------- GiGPO


def discounted_returns(rewards: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
    """Return-to-go ``G_t = r_t + gamma * G_{t'}`` along axis 1 of ``[N, K]``.

    ``t'`` is the next position with ``mask`` True: masked positions are skipped (they carry
    nothing and get 0), so the recursion runs over real turns (or response tokens) only.
    """
    _check_shape("mask", mask, rewards.shape)
    rewards = rewards.astype(jnp.float32)

    def step(carry, x):
        r, m = x
        g = jnp.where(m, r + gamma * carry, carry)
        return g, jnp.where(m, g, 0.0)

    return _scan_backwards(
        step, jnp.zeros(rewards.shape[0], jnp.float32), (rewards, mask.astype(bool))
    )


def _key_columns(anchor_keys: jax.Array, n: int, t: int) -> list[jax.Array]:
    if anchor_keys.ndim == 2:
        anchor_keys = anchor_keys[..., None]
    if anchor_keys.ndim != 3 or anchor_keys.shape[:2] != (n, t):
        raise ValueError(
            f"anchor_keys: expected shape [{n}, {t}] or [{n}, {t}, K], "
            f"got {tuple(anchor_keys.shape)}"
        )
    if not jnp.issubdtype(anchor_keys.dtype, jnp.integer):
        raise ValueError(f"anchor_keys: must be an integer array, got {anchor_keys.dtype}")
    return [anchor_keys[..., k].reshape(-1) for k in range(anchor_keys.shape[-1])]


def gigpo_step_advantages(
    step_rewards: jax.Array,
    group_ids: jax.Array,
    anchor_keys: jax.Array,
    turn_mask: jax.Array,
    traj_mask: jax.Array | None = None,
    *,
    gamma: float = 0.95,
    eps: float = 1e-6,
    ddof: int = 1,
    scale_by_std: bool = True,
) -> jax.Array:
    """GiGPO step advantage ``A^S [N, T]``.

    step_rewards [N, T] float, group_ids [N], anchor_keys [N, T] or [N, T, K] integer,
    turn_mask [N, T], traj_mask [N] or None.

    Each step's discounted return-to-go (``gamma``, over real turns) is normalised like
    GRPO within its anchor group: the real steps of one task group whose anchor keys are
    equal (all K columns; use :func:`agentrl_jax.algorithms.budgetmix.budget_anchor_keys`
    for the BudgetMix anchor (state, B - t)). A state revisited within one trajectory adds
    one member per visit. Singleton anchor groups, and invalid turns, get 0.
    """
    n, t = step_rewards.shape
    _check_shape("group_ids", group_ids, (n,))
    _check_shape("turn_mask", turn_mask, (n, t))
    valid = turn_mask.astype(bool) & _rows_mask(traj_mask, n)[:, None]
    returns = discounted_returns(step_rewards, valid, gamma)
    keys = [
        jnp.broadcast_to(group_ids[:, None], (n, t)).reshape(-1),
        *_key_columns(anchor_keys, n, t),
    ]
    normalised = group_normalize(
        returns.reshape(-1), keys, valid.reshape(-1), eps=eps, ddof=ddof, scale_by_std=scale_by_std
    )
    return normalised.reshape(n, t)


def gigpo_advantages(
    rewards: jax.Array,
    step_rewards: jax.Array,
    group_ids: jax.Array,
    anchor_keys: jax.Array,
    turn_mask: jax.Array,
    traj_mask: jax.Array | None = None,
    *,
    omega: float = 1.0,
    gamma: float = 0.95,
    eps: float = 1e-6,
    ddof: int = 1,
    episode_scale_by_std: bool = True,
    step_scale_by_std: bool = True,
) -> jax.Array:
    """GiGPO: ``A_{i,t} = A^E_i + omega * A^S_{i,t}`` per turn, ``[N, T]`` (0 on invalid turns).

    rewards [N] (episode reward, for A^E = :func:`grpo_advantages`), step_rewards [N, T]
    (for A^S = :func:`gigpo_step_advantages`; with an outcome reward only, use
    ``place_at_last_valid(rewards, turn_mask)``; process rewards (§8) go here instead).
    Paper values: omega = 1, gamma = 0.95.
    """
    n, t = step_rewards.shape
    valid = turn_mask.astype(bool) & _rows_mask(traj_mask, n)[:, None]
    episode = grpo_advantages(
        rewards,
        group_ids,
        _rows_mask(traj_mask, n),
        eps=eps,
        ddof=ddof,
        scale_by_std=episode_scale_by_std,
    )
    step = gigpo_step_advantages(
        step_rewards,
        group_ids,
        anchor_keys,
        turn_mask,
        traj_mask,
        gamma=gamma,
        eps=eps,
        ddof=ddof,
        scale_by_std=step_scale_by_std,
    )
    return jnp.where(valid, episode[:, None] + omega * step, 0.0)


# ------------------------------------------------------------------------- GAE


def gae_advantages(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over the masked positions of each row.

    rewards, values, mask: [N, K] (tokens, K = L, or turns, K = T) -> (advantages, returns)
    both [N, K], 0 where mask is 0.

    The recursion visits only positions with mask 1: for a response token p with next
    response token p' (observation tokens between them are skipped, not treated as
    zero-reward steps), ``delta_p = r_p + gamma V_{p'} - V_p`` and
    ``A_p = delta_p + gamma lam A_{p'}``; after the last response token V = A = 0 (the
    episode ends there). Returns are ``A + V``. Rewards on masked positions are ignored,
    so put the outcome reward on the last response token (:func:`place_at_last_valid`).
    Defaults gamma = lam = 1 are verl's.
    """
    _check_shape("values", values, rewards.shape)
    _check_shape("mask", mask, rewards.shape)
    rewards = rewards.astype(jnp.float32)
    values = values.astype(jnp.float32)
    n = rewards.shape[0]

    def step(carry, x):
        next_value, next_adv = carry
        r, v, m = x
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
        return carry, jnp.where(m, adv, 0.0)

    init = (jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.float32))
    advantages = _scan_backwards(step, init, (rewards, values, mask.astype(bool)))
    returns = jnp.where(mask.astype(bool), advantages + values, 0.0)
    return advantages, returns


def masked_whiten(
    x: jax.Array, mask: jax.Array, *, eps: float = 1e-8, ddof: int = 1, shift_mean: bool = True
) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries of the whole batch; 0 elsewhere.

    ``ddof=1`` and eps inside the square root match verl's ``masked_whiten``. With
    ``shift_mean=False`` the mean is added back (scale only).
    """
    _check_shape("mask", mask, x.shape)
    weight = mask.astype(jnp.float32)
    count = jnp.sum(weight)
    mu = jnp.sum(x * weight) / jnp.maximum(count, 1.0)
    var = jnp.sum(((x - mu) * weight) ** 2) / jnp.maximum(count - ddof, 1.0)
    out = (x - mu) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mu
    return out * weight
