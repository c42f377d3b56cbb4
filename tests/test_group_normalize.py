"""Group normalisation: exact 0 for all-equal groups, and agreement with an exact/float64 reference.

The reference below is written from the formulas, not from our code: the group mean and the
deviations are exact rationals (``fractions.Fraction`` of the float32 inputs), the std and
the quotient are then taken in float64.
"""

from collections import defaultdict
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_jax.algorithms import advantages as adv

M = 128  # every example is padded to this many elements, so the jitted functions compile once


def _groups(keys, valid):
    members = defaultdict(list)
    for i in range(len(valid)):
        if valid[i]:
            members[tuple(int(k[i]) for k in keys)].append(i)
    return members.values()


def normalize_reference(values, keys, valid, *, eps=1e-6, ddof=1, scale_by_std=True):
    """(v - mean_g) / (std_g + eps), std with ddof; mean and deviations exact, the rest float64."""
    out = np.zeros(len(values), np.float64)
    for idx in _groups(keys, valid):
        exact = [Fraction(float(values[i])) for i in idx]
        mean = sum(exact) / len(exact)
        centered = [x - mean for x in exact]
        if not scale_by_std:
            out[idx] = [float(c) for c in centered]
            continue
        var = sum(c * c for c in centered) / max(len(idx) - ddof, 1)
        std = np.sqrt(float(var))
        out[idx] = [float(c) / (std + eps) for c in centered]
    return out


def rloo_reference(values, group_ids, valid):
    """r_i - mean of the other valid members of i's group; 0 for a group of one."""
    out = np.zeros(len(values), np.float64)
    for idx in _groups([group_ids], valid):
        if len(idx) < 2:
            continue
        exact = [Fraction(float(values[i])) for i in idx]
        total = sum(exact)
        out[idx] = [float(x - (total - x) / (len(idx) - 1)) for x in exact]
    return out


_normalize = jax.jit(adv.group_normalize, static_argnames=("eps", "ddof", "scale_by_std"))
_rloo = jax.jit(adv.rloo_advantages)


# ------------------------------------------------------------------------- the reported case


def test_seven_identical_returns_get_exactly_zero():
    """The issue's case: seven returns of 9.025 (0.95^2 * 10) in one group, float32."""
    values = jnp.full((7,), 9.025, jnp.float32)
    assert float(jnp.sum(values) / 7) != 9.025  # the naive float32 mean is one ulp off ...
    got = adv.group_normalize(values, [jnp.zeros(7, jnp.int32)], jnp.ones(7, bool))
    np.testing.assert_array_equal(np.asarray(got), np.zeros(7))  # ... which no longer matters


def test_gigpo_identical_trajectories_get_exactly_zero():
    """Seven identical 4-turn trajectories (reward 10 at the last turn) and one that fails.

    Every step group of the seven holds equal returns 10 * 0.95^k; the failing row sits in
    other anchor groups (its own states), so all seven members get exactly A^S = 0, and the
    episode advantage is the same for the seven.
    """
    n, t = 8, 4
    turn_mask = jnp.ones((n, t), bool)
    rewards = jnp.array([10.0] * 7 + [0.0])
    step_rewards = adv.place_at_last_valid(rewards, turn_mask)
    anchors = jnp.array([[0, 1, 2, 3]] * 7 + [[0, 5, 6, 7]], jnp.int32)  # row 7 shares only state 0
    group_ids = jnp.zeros(n, jnp.int32)
    step = adv.gigpo_step_advantages(step_rewards, group_ids, anchors, turn_mask)
    np.testing.assert_array_equal(np.asarray(step)[:7, 1:], np.zeros((7, 3)))
    # state 0 mixes seven returns a = 10 * 0.95^3 with one 0: mean 7a/8, deviations a/8 and -7a/8,
    # var = (7 (a/8)^2 + (7a/8)^2) / 7 = a^2/8 -> A = sqrt(8)/8 = 0.353553 (seven),
    #   -7/sqrt(8) = -2.474874
    # (eps = 1e-6 against std = a/sqrt(8) = 3.03 moves these by 3e-7 relative)
    want = [np.sqrt(8) / 8] * 7 + [-7 / np.sqrt(8)]
    np.testing.assert_allclose(np.asarray(step)[:, 0], want, rtol=1e-6)
    # and the episode part: all seven equal -> one shared value
    episode = adv.grpo_advantages(rewards, group_ids)
    assert len(set(np.asarray(episode)[:7].tolist())) == 1


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("ddof", [0, 1])
def test_ties_of_many_values_and_sizes_are_exactly_zero(ddof, scale_by_std):
    values = [0.95**k * c for k in range(0, 40, 3) for c in (1.0, 10.0)]
    values += [0.0, -0.0, -1.0, 1e-30, -3.7, 1e6, -2.5e8, 3.0e10, float(np.float32(1 / 3))]
    for size in (1, 2, 3, 7, 16, 33):
        for v in values:
            x = jnp.full((size,), v, jnp.float32)
            got = adv.group_normalize(
                x,
                [jnp.zeros(size, jnp.int32)],
                jnp.ones(size, bool),
                ddof=ddof,
                scale_by_std=scale_by_std,
            )
            assert np.all(np.asarray(got) == 0.0), (v, size, got)


def test_near_ties_are_not_zeroed():
    """Values one ulp apart really differ: the result is the formula's, not a tolerance's 0."""
    base = np.float32(9.025)
    x = np.array([base, np.nextafter(base, np.float32(np.inf))] * 2, np.float32)
    keys, valid = [np.zeros(4, np.int32)], np.ones(4, bool)
    got = np.asarray(
        adv.group_normalize(jnp.asarray(x), [jnp.asarray(keys[0])], jnp.asarray(valid))
    )
    want = normalize_reference(x, keys, valid)
    assert abs(want[0]) > 0.1  # one ulp (9.5e-7) against std 5.5e-7 + eps 1e-6
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_invalid_elements_may_hold_anything():
    x = jnp.array([1.0, jnp.nan, 3.0, jnp.inf, 2.0])
    valid = jnp.array([True, False, True, False, True])
    got = adv.group_normalize(x, [jnp.zeros(5, jnp.int32)], valid)
    np.testing.assert_allclose(got, [-1.0 / (1 + 1e-6), 0.0, 1.0 / (1 + 1e-6), 0.0, 0.0], rtol=1e-6)


# ------------------------------------------------------------------------- property


_TIES = [0.95**k for k in range(0, 30)] + [10 * 0.95**k for k in range(0, 30)]
_value = st.one_of(
    st.sampled_from(_TIES),
    st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e6, -1e6, 3.0e7, -2.5e8, 1e-20]),
    st.floats(-1e6, 1e6, width=32),
    st.floats(-10.0, 10.0, width=32),
)


@st.composite
def _group(draw):
    size = draw(st.integers(1, 16))
    kind = draw(st.sampled_from(["equal", "values", "near"]))
    if kind == "equal":
        return kind, [draw(_value)] * size
    if kind == "near":  # a few ulps around one value: real differences of the size of eps
        base = np.float32(draw(_value))
        steps = draw(st.lists(st.integers(-3, 3), min_size=size, max_size=size))
        return kind, [float(base + np.float32(s) * np.spacing(base)) for s in steps]
    return kind, draw(st.lists(_value, min_size=size, max_size=size))


@st.composite
def _layout(draw):
    """Groups of random sizes and kinds, random non-dense 2-column keys, shuffled, padded to M."""
    groups = draw(st.lists(_group(), min_size=1, max_size=7))
    used = sum(len(v) for _, v in groups)
    keys = draw(
        st.lists(
            st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(-5, 5)),
            min_size=len(groups),
            max_size=len(groups),
            unique=True,
        )
    )
    garbage = draw(
        st.lists(
            st.sampled_from([np.nan, np.inf, 1e30, 9.025, 0.0]),
            min_size=M - used,
            max_size=M - used,
        )
    )
    values = np.array([x for _, v in groups for x in v] + garbage, np.float32)
    k0 = np.array(
        [keys[g][0] for g, (_, v) in enumerate(groups) for _ in v] + [keys[0][0]] * len(garbage)
    )
    k1 = np.array(
        [keys[g][1] for g, (_, v) in enumerate(groups) for _ in v] + [keys[0][1]] * len(garbage)
    )
    valid = np.array([True] * used + [False] * len(garbage))
    all_equal = [len(set(np.asarray(v, np.float32).tolist())) == 1 for _, v in groups]  # as float32
    assert all(e for (kind, _), e in zip(groups, all_equal) if kind == "equal")
    equal = np.array(
        [e for e, (_, v) in zip(all_equal, groups) for _ in v] + [False] * len(garbage)
    )
    order = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(M)
    return (
        values[order],
        k0[order].astype(np.int32),
        k1[order].astype(np.int32),
        valid[order],
        equal[order],
    )


@settings(max_examples=60, deadline=None)
@given(_layout(), st.sampled_from([(1, True), (0, True), (1, False)]))
def test_group_normalize_property(layout, options):
    values, k0, k1, valid, equal = layout
    ddof, scale = options
    got = np.asarray(
        _normalize(
            jnp.asarray(values),
            [jnp.asarray(k0), jnp.asarray(k1)],
            jnp.asarray(valid),
            ddof=ddof,
            scale_by_std=scale,
        )
    )
    assert np.all(got[equal] == 0.0), got[equal]
    assert np.all(got[~valid] == 0.0)
    want = normalize_reference(values, [k0, k1], valid, ddof=ddof, scale_by_std=scale)
    if scale:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # raw deviations: relative to the group's spread
        spread = np.ones(M)
        for idx in _groups([k0, k1], valid):
            spread[idx] = max(1.0, float(np.max(np.abs(want[idx]))))
        np.testing.assert_array_less(np.abs(got - want) / spread, 1e-6)


@settings(max_examples=40, deadline=None)
@given(_layout())
def test_rloo_property(layout):
    values, k0, _, valid, _ = layout
    got = np.asarray(_rloo(jnp.asarray(values), jnp.asarray(k0), jnp.asarray(valid)))
    # k0 alone can merge groups that differed only in k1: recompute which are all-equal
    for idx in _groups([k0], valid):
        if len(set(values[idx].tolist())) == 1:
            assert np.all(got[idx] == 0.0)
    want = rloo_reference(values, k0, valid)
    spread = np.ones(M)
    for idx in _groups([k0], valid):
        spread[idx] = max(1.0, float(np.max(np.abs(want[idx]))))
    np.testing.assert_array_less(np.abs(got - want) / spread, 1e-6)
    assert np.all(got[~valid] == 0.0)
