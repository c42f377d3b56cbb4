"""Shared test helpers for the trainer: a tiny Qwen3, synthetic Trajectory batches, a fake rollout.

The fake rollout is a real (if tiny) multi-turn episode driven by the policy: each turn the
policy samples one token from its own logits over the conversation so far (teacher-forced
forward of the whole buffer, no cache), the "environment" appends an observation token, and
the episode succeeds, and ends, when the sampled token is the task's target. It produces a
genuine :class:`Trajectory` (variable turn counts, loss mask on sampled tokens only, sampling
log-probs), so training on it is a real learning signal through the real train step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.algorithms import logprobs_from_logits
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM, positions_from_mask
from agentrl_jax.trajectory import Trajectory

TINY = dict(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
)


def tiny_model(seed: int = 0, std: float = 0.1, **overrides) -> Qwen3ForCausalLM:
    """A random tiny Qwen3: weights N(0, std), norm weights 1 + N(0, 0.1), drawn with NumPy
    (JAX's random init compiles one threefry kernel per shape, seconds on a busy CPU)."""
    config = Qwen3Config(**{**TINY, **overrides})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if "norm" in str(path[-1]):
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
        return jnp.asarray(std * rng.standard_normal(leaf.shape), leaf.dtype)

    pure = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def random_trajectory(
    seed: int,
    *,
    rows: int = 8,
    tokens: int = 24,
    turns: int = 3,
    group_size: int = 4,
    vocab: int = 16,
    padded_rows: int = 0,
) -> Trajectory:
    """A synthetic batch with the layout a rollout produces (prompt, then response/observation
    turns, right padding). Sampling log-probs are random (so ratios differ from 1), actions are
    random in -1..3 (-1 invalid), anchors collide often. The last ``padded_rows`` rows are
    padding."""
    rng = np.random.default_rng(seed)
    t = Trajectory.zeros(rows, tokens, turns)
    f = {name: np.array(getattr(t, name)) for name in t.__dataclass_fields__}
    for i in range(rows - padded_rows):
        pos = int(rng.integers(2, 5))
        f["tokens"][i, :pos] = rng.integers(1, vocab, pos)
        f["token_mask"][i, :pos] = True
        used = 0
        for turn in range(turns):
            response, observation = int(rng.integers(1, 4)), int(rng.integers(1, 3))
            if pos + response + observation > tokens:
                break
            span = slice(pos, pos + response)
            f["tokens"][i, span] = rng.integers(1, vocab, response)
            f["token_mask"][i, span] = f["loss_mask"][i, span] = True
            f["token_turn"][i, span] = turn
            f["logprobs"][i, span] = -rng.uniform(0.5, 4.0, response)
            f["sampling_logprobs"][i, span] = f["logprobs"][i, span]  # drawn at temperature 1
            pos += response
            f["tokens"][i, pos : pos + observation] = rng.integers(1, vocab, observation)
            f["token_mask"][i, pos : pos + observation] = True
            pos += observation
            f["turn_mask"][i, turn] = True
            f["action"][i, turn] = int(rng.integers(-1, 4))
            f["action_valid"][i, turn] = f["action"][i, turn] >= 0
            f["anchor_key"][i, turn] = int(rng.integers(0, 3))
            f["state_id"][i, turn] = int(rng.integers(0, 16))
            used += 1
            if rng.random() < 0.25:
                break
        f["turns_used"][i] = used
        f["success"][i] = rng.random() < 0.5
        f["row_mask"][i] = True
    f["group_id"][:] = np.arange(rows) // group_size
    f["task_id"][:] = np.arange(rows) // group_size
    f["budget"][:] = turns
    return Trajectory(**{k: jnp.asarray(v) for k, v in f.items()})


# ------------------------------------------------------------------------- fake rollout

PROMPT = 3  # tokens: [1, task token, 2]
OBSERVATION_TOKEN = 3


def target_token(task_ids: jax.Array, vocab: int) -> jax.Array:
    """The token a task asks for (never one of the prompt/observation ids 0..3)."""
    return 4 + task_ids % (vocab - 4)


def make_fake_rollout(graphdef: nnx.GraphDef, *, group_size: int, turns: int = 2):
    """``rollout(params, key, task_ids [K]) -> Trajectory`` with ``K * group_size`` rows."""
    length = PROMPT + 2 * turns

    @jax.jit
    def rollout(params, key, task_ids):
        model = nnx.merge(graphdef, params)
        vocab = model.config.vocab_size
        rows = task_ids.shape[0] * group_size
        tasks = jnp.repeat(task_ids, group_size)
        target = target_token(tasks, vocab)
        tokens = jnp.zeros((rows, length), jnp.int32)
        tokens = tokens.at[:, 0].set(1).at[:, 1].set(4 + tasks % (vocab - 4)).at[:, 2].set(2)
        mask = jnp.zeros((rows, length), bool).at[:, :PROMPT].set(True)
        t = Trajectory.zeros(rows, length, turns)
        loss_mask, token_turn, logprobs = t.loss_mask, t.token_turn, t.logprobs
        turn_mask, action, reward = t.turn_mask, t.action, t.reward
        done = jnp.zeros(rows, bool)
        for turn in range(turns):  # a static handful of turns
            slot = PROMPT + 2 * turn
            logits, _ = model(tokens, positions_from_mask(mask), mask)
            step_logits = logits[:, slot - 1]
            sampled = jax.random.categorical(jax.random.fold_in(key, turn), step_logits).astype(
                jnp.int32
            )
            active = ~done
            hit = active & (sampled == target)
            tokens = tokens.at[:, slot].set(jnp.where(active, sampled, 0))
            mask = mask.at[:, slot].set(active)
            loss_mask = loss_mask.at[:, slot].set(active)
            token_turn = token_turn.at[:, slot].set(jnp.where(active, turn, -1))
            lp = logprobs_from_logits(step_logits[:, None], sampled[:, None])[:, 0]
            logprobs = logprobs.at[:, slot].set(jnp.where(active, lp, 0.0))
            turn_mask = turn_mask.at[:, turn].set(active)
            action = action.at[:, turn].set(jnp.where(active, sampled, -1))
            reward = reward.at[:, turn].set(hit.astype(jnp.float32))
            continues = active & ~hit
            tokens = tokens.at[:, slot + 1].set(jnp.where(continues, OBSERVATION_TOKEN, 0))
            mask = mask.at[:, slot + 1].set(continues)
            done = done | hit
        return t.replace(
            tokens=tokens,
            token_mask=mask,
            loss_mask=loss_mask,
            token_turn=token_turn,
            logprobs=logprobs,
            sampling_logprobs=logprobs,  # drawn from the model's own distribution
            turn_mask=turn_mask,
            action=action,
            action_valid=turn_mask,
            reward=reward,
            anchor_key=jnp.where(turn_mask, jnp.arange(turns)[None, :], 0),
            state_id=jnp.where(turn_mask, jnp.arange(turns)[None, :], -1),
            group_id=jnp.arange(rows, dtype=jnp.int32) // group_size,
            task_id=tasks.astype(jnp.int32),
            budget=jnp.full(rows, turns, jnp.int32),
            turns_used=jnp.sum(turn_mask, axis=1).astype(jnp.int32),
            success=done,
            row_mask=jnp.ones(rows, bool),
        )

    return rollout


def task_batches(num_tasks: int, groups_per_batch: int):
    """``batch_index -> task ids [groups_per_batch]``: a deterministic cycle over the tasks."""

    def tasks(index: int) -> jax.Array:
        start = (index * groups_per_batch) % num_tasks
        return (start + jnp.arange(groups_per_batch, dtype=jnp.int32)) % num_tasks

    return tasks
