"""PPO-style optimisation in the train step: epochs x mini-batches per rollout batch.

With 4 epochs x 4 mini-batches (16 updates per batch, one jitted step, compiled once): the
first update's importance ratio is exactly 1 (the old log-probs are the policy's before the
batch's first update), later updates show clipping; ratio, clip fraction, approximate KL and
the critic's explained variance are reported per update; rows are shuffled per epoch with a
key split off the state's; and one mini-batch's gradient, at parameters that moved away from
the old ones, equals ``jax.grad`` of the loss written out directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_counter import count_backend_compiles
from flax import nnx
from train_fakes import random_trajectory, tiny_model

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, init_train_state, make_train_step
from agentrl_jax.train.state import commit_state
from agentrl_jax.train.step import (
    policy_gradients,
    prepare_batch,
    select_rows,
    update_rows,
)
from agentrl_jax.train.step_metrics import explained_variance, explained_variance_sums

EPOCHS, MINI_BATCHES, ROWS = 4, 4, 16
UPDATES = EPOCHS * MINI_BATCHES
PPO = TrainConfig(
    rl=RLConfig(
        optimizer={"learning_rate": 3e-3}, batching={"epochs": EPOCHS, "mini_batches": MINI_BATCHES}
    ),
    algorithm=AlgorithmConfig(
        advantage="gae",
        loss_terms=(
            LossTermConfig("policy_clip"),
            LossTermConfig("kl", 0.001),
            LossTermConfig("value_clip"),
        ),
    ),
)
# The paper's GRPO (clip 0.2, k3 KL 0.001, token-mean) with PPO epochs, for the hand-written loss.
GRPO = TrainConfig(
    rl=RLConfig(batching={"epochs": EPOCHS, "mini_batches": MINI_BATCHES, "num_micro_batches": 2})
)


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model(num_hidden_layers=1)


def _graphdef():
    return nnx.graphdef(_model())


def _batch(seed: int) -> TrainBatch:
    return TrainBatch(random_trajectory(seed, rows=ROWS, padded_rows=1))


def _perturbed(tree, seed: int, scale: float = 0.05):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype), tree
    )


@functools.lru_cache(maxsize=None)
def _state(config: TrainConfig):
    state = init_train_state(_model(), config)
    state = state.replace(reference=_perturbed(state.reference, 7))  # so KL has a gradient
    if state.critic is not None:  # a non-zero value head, so values (and their variance) are not 0
        head = {
            "kernel": jnp.linspace(-0.25, 0.25, _model().config.hidden_size, dtype=jnp.float32),
            "bias": jnp.asarray(0.3, jnp.float32),
        }  # not weakly typed, as the step's outputs
        state = state.replace(critic=state.critic.replace(head=head))
    return commit_state(state)


@pytest.fixture(scope="module")
def ppo_run():
    """Two rollout batches through the PPO step:
    ``(step, states, metrics, compiles of the second call)``."""
    step = make_train_step(_graphdef(), PPO)
    state = _state(PPO)
    first, metrics = step(state, _batch(0))
    with count_backend_compiles() as compiles:
        second, metrics2 = step(first, _batch(1))
        jax.block_until_ready(metrics2)
    return (
        step,
        (state, first, second),
        (jax.device_get(metrics), jax.device_get(metrics2)),
        len(compiles),
    )


def test_first_update_has_ratio_exactly_one_and_later_updates_clip(ppo_run):
    _, _, metrics_by_batch, _ = ppo_run
    for m in metrics_by_batch:
        ratio, deviation = m["updates/ratio_mean"], m["updates/ratio_deviation"]
        clip, kl = m["updates/policy_clip/clip_fraction"], m["updates/approx_kl"]
        assert ratio.shape == clip.shape == kl.shape == (UPDATES,)
        # Update 1 trains the very parameters that scored the old log-probs: every ratio is 1.
        assert ratio[0] == 1.0 and deviation[0] == 0.0 and clip[0] == 0.0 and kl[0] == 0.0
        # Later updates see parameters the earlier ones moved: ratios leave 1 and get clipped.
        assert np.all(deviation[1:] > 0) and np.all(kl[1:] > 0), deviation
        assert clip[1:].max() > 0 and clip[-MINI_BATCHES:].min() > 0, clip
        # The step's summary is the mean over its updates; nothing was skipped.
        np.testing.assert_allclose(m["policy_clip/clip_fraction"], clip.mean(), rtol=1e-6)
        assert m["update_skipped"] == 0 and np.all(m["updates/update_skipped"] == 0)


def test_the_critic_reports_explained_variance_per_update(ppo_run):
    _, _, metrics_by_batch, _ = ppo_run
    for m in metrics_by_batch:
        ev = m["updates/explained_variance"]
        assert ev.shape == (UPDATES,) and np.all(np.isfinite(ev)) and np.all(ev <= 1.0)
        assert np.all(np.abs(ev) < 100), ev  # no blow-up on mini-batches whose returns barely vary
        assert np.all(m["updates/value_loss"] >= 0) and m["updates/critic_grad_norm"].max() > 0


def test_explained_variance_matches_numpy():
    rng = np.random.default_rng(0)
    values, returns = rng.standard_normal((2, 5, 7)).astype(np.float32)
    mask = rng.random((5, 7)) < 0.6
    halves = [
        explained_variance_sums(
            jnp.asarray(values[s]), jnp.asarray(returns[s]), jnp.asarray(mask[s])
        )
        for s in (slice(0, 2), slice(2, 5))
    ]  # sums add over micro-batches
    sums = jax.tree.map(jnp.add, *halves)
    r, v = returns[mask].astype(np.float64), values[mask].astype(np.float64)
    np.testing.assert_allclose(
        float(explained_variance(sums)), 1 - np.var(r - v) / np.var(r), rtol=1e-4
    )
    noisy = jnp.asarray(rng.standard_normal((4, 9)), jnp.float32)
    for level in (1.0, 0.7, 123.4):  # constant returns, whose float variance is a rounding error
        constant = explained_variance_sums(noisy, jnp.full((4, 9), level), jnp.ones((4, 9), bool))
        assert (
            float(explained_variance(constant)) == 0.0
        )  # returns that do not vary explain nothing


def test_sixteen_updates_per_batch_compile_once_and_advance_the_key(ppo_run):
    step, (state, first, second), _, second_call_compiles = ppo_run
    assert step.compiled_count() == 1 and step.traces == 1 and second_call_compiles == 0
    assert int(first.step) == 1 and int(second.step) == 2  # one step per rollout batch
    # Every update moved the policy's Adam state: 16 optimizer steps per batch.
    counts = [int(x) for x in jax.tree.leaves(first.policy_opt) if np.asarray(x).dtype == np.int32]
    assert counts and all(c == UPDATES for c in counts), counts
    # The shuffle key is split off the state's, so each batch gets a fresh order.
    assert not np.array_equal(np.asarray(first.rng), np.asarray(state.rng))


def test_update_rows_are_a_fresh_permutation_per_epoch():
    rows = np.asarray(update_rows(jax.random.PRNGKey(3), ROWS, EPOCHS, MINI_BATCHES))
    assert rows.shape == (UPDATES, ROWS // MINI_BATCHES) and rows.dtype == np.int32
    epochs = rows.reshape(EPOCHS, ROWS)
    assert all(sorted(e) == list(range(ROWS)) for e in epochs)  # every row once per epoch
    assert len({tuple(e) for e in epochs}) == EPOCHS  # reshuffled each epoch
    other = np.asarray(update_rows(jax.random.PRNGKey(4), ROWS, EPOCHS, MINI_BATCHES))
    assert not np.array_equal(rows, other)  # the key decides: no fixed order
    with pytest.raises(ValueError, match="mini_batches=3 must divide the batch's 16 rows"):
        update_rows(jax.random.PRNGKey(0), ROWS, EPOCHS, 3)


def test_rows_must_split_into_mini_and_micro_batches():
    config = TrainConfig(
        rl=RLConfig(
            batching={"epochs": 2, "mini_batches": 4, "num_micro_batches": 3},
            tasks_per_step=6,
            group_size=2,
        )
    )
    step = make_train_step(_graphdef(), config)
    with pytest.raises(
        ValueError, match=r"mini_batches=4 x num_micro_batches=3 must divide the batch's 16 rows"
    ):
        jax.eval_shape(step._step, _state(GRPO), _batch(0))


# ------------------------------------------------------------------------- one mini-batch, by hand


def _picked_logprobs(params, traj):
    """``log pi(token_p | tokens_<p)`` for p = 1..L-1 from the full logits: ``[n, L-1]``."""
    tokens, mask = traj.tokens, traj.token_mask
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits, _ = nnx.merge(_graphdef(), params)(tokens, positions, mask)
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]


def _hand_written_loss(params, old_params, reference, traj, advantages):
    """The paper's GRPO loss on one mini-batch, written out: PPO clip 0.2 on the ratio to the
    old policy's log-probs, k3 KL to the reference (coefficient 0.001, capped at 10), the
    token mean over the mini-batch's sampled tokens."""
    lp = _picked_logprobs(params, traj)
    old = jax.lax.stop_gradient(_picked_logprobs(old_params, traj))
    ref = jax.lax.stop_gradient(_picked_logprobs(reference, traj))
    a = advantages[:, 1:]
    ratio = jnp.exp(lp - old)
    surrogate = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 0.8, 1.2))
    d = ref - lp
    per_token = surrogate + 0.001 * jnp.minimum(jnp.exp(d) - d - 1, 10.0)
    mask = (traj.loss_mask & traj.row_mask[:, None])[:, 1:].astype(jnp.float32)
    return jnp.sum(per_token * mask) / jnp.sum(mask)


def test_a_later_mini_batch_gradient_equals_a_hand_written_loss():
    state, batch = _state(GRPO), _batch(2)
    data, _ = jax.jit(functools.partial(prepare_batch, _graphdef(), GRPO))(state, batch)
    rows = update_rows(jax.random.PRNGKey(5), ROWS, EPOCHS, MINI_BATCHES)[
        6
    ]  # epoch 2, mini-batch 3
    moved = _perturbed(state.policy, 11, scale=0.1)  # as if earlier updates had moved the policy

    @jax.jit
    def ours(params, data, rows):
        return policy_gradients(_graphdef(), GRPO, params, select_rows(data, rows))

    grads, metrics = ours(moved, data, rows)
    traj = jax.tree.map(lambda x: x[rows], batch.trajectory)
    want = jax.jit(jax.grad(_hand_written_loss))(
        moved, state.policy, state.reference, traj, data["advantages"][rows]
    )
    for i, (x, y) in enumerate(zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-6, err_msg=f"leaf {i}"
        )
    assert float(optax.tree.norm(want)) > 1e-3  # a real gradient
    assert float(metrics["policy_clip/clip_fraction"]) > 0  # the clip acts on this mini-batch
    assert float(metrics["ratio_deviation"]) > 0.01
