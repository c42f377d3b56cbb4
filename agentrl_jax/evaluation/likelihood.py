"""Likelihood diagnostics (PAPER.md §7.4): how likely each policy's responses are under the
base policy, and how far RL trajectories drift from it.

* ``ActionNLL_B(r) = -log pi_B(r | h)``: negative log-likelihood of a whole response (the sum
  over its tokens) under the base model, for the base policy's own responses and for the RL
  policy's;
* ``LLR_{1:t}(tau) = sum_{i <= t} [log pi_RL(r_i | h_i) - log pi_B(r_i | h_i)]`` along each
  trajectory, split by success, and length-matched
  (the statistics and figures: :mod:`agentrl_jax.evaluation.analyses.likelihood`).

Every log-prob here is teacher-forced: the model reads the recorded conversation (prompt,
responses, observations; :mod:`agentrl_jax.trajectory`) in one forward pass and
``log pi(r_t | h_t)`` is the sum of the log-probs of turn ``t``'s sampled tokens
(``loss_mask``, ``token_turn``) at the model's own distribution (temperature 1, no top-p),
through :func:`agentrl_jax.train.step.sequence_logprobs`, the trainer's function.

Trajectories must have been sampled with the whole history in context (the rollout's
default): with a history window each turn saw a different context and would need its own
forward pass, which is not implemented (an error says so).

Memory: the forward is the trainer's (:func:`scoring_program`): the output head runs only at
the sampled positions, in chunks, with the configured attention implementation (``"blocked"``
keeps no ``[L, L]`` score matrix); on a mesh (the parameters' own) the rows are split over
the batch axes and activations are constrained to stay so. ``agentrl-jax plan`` compiles
this program as ``eval:likelihood``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax import distributed
from agentrl_jax.models.attention import partitioned
from agentrl_jax.models.qwen3 import Qwen3ForCausalLM
from agentrl_jax.sampling import TokenMap
from agentrl_jax.sampling.scheduler import params_mesh
from agentrl_jax.sharding import BATCH_AXES, batch_shards
from agentrl_jax.train.scoring import Forward, activation_constraint, sequence_logprobs
from agentrl_jax.trajectory import Trajectory, bucket_width

_MIN_WIDTH = 64


def scoring_config(
    attention: str = "xla", loss_positions: int | None = None, logits_chunk: int = 512
) -> Forward:
    """The teacher-forced forward's settings: the attention implementation, the bound on
    sampled positions per row (None: every position) and the head's chunk."""
    return Forward(attention=attention, loss_positions=loss_positions, logits_chunk=logits_chunk)


@functools.cache
def scoring_program(graphdef: nnx.GraphDef, config: Forward, mesh: Mesh | None = None):
    """The jitted forward ``(params, tokens, token_mask, loss_mask) -> logprobs [N, L]``
    (float32, 0 off ``loss_mask``) of one model structure, :func:`scoring_config` and mesh
    (rows split over the mesh's batch axes, activations constrained to them; None: one
    device). One jit per ``(graphdef, config, mesh)``, so repeated calls share compilations."""
    constrain = activation_constraint(mesh)

    def score(params, tokens, token_mask, loss_mask):
        with partitioned(mesh is not None and mesh.size > 1):
            logprobs, _ = sequence_logprobs(
                nnx.merge(graphdef, params),
                tokens,
                token_mask,
                loss_mask=loss_mask,
                forward=config,
                constrain=constrain,
            )
        return logprobs

    if mesh is None:
        return jax.jit(score)
    rows = NamedSharding(mesh, P(BATCH_AXES, None))
    return jax.jit(score, in_shardings=(None, rows, rows, rows), out_shardings=rows)


def _power_of_two(n: int, low: int) -> int:
    """The smallest ``low x 2^k >= n``."""
    width = low
    while width < n:
        width *= 2
    return width


def turn_logprobs(
    model: Qwen3ForCausalLM,
    trajectory: Trajectory,
    *,
    token_map: TokenMap | None = None,
    rows_per_batch: int = 16,
    attention: str = "xla",
) -> np.ndarray:
    """Teacher-forced ``log pi(r_t | h_t)`` of every turn's response: ``[N, T]`` float64.

    Args:
      model: the policy's model (``pi``).
      trajectory: a rollout record (tokenizer ids) sampled with the whole history in context.
      token_map: maps tokenizer ids to the model's ids when they differ (a small test model).
      rows_per_batch: rows per forward pass (rounded up to a multiple of the mesh's batch
        shards); the last batch is padded to this size. Fewer rows than that run as one
        batch of the smallest power of two (per shard) that holds them.
      attention: the forward's attention implementation (:mod:`agentrl_jax.models.attention`).

    Returns:
      ``[N, T]``: sum over turn ``t``'s sampled tokens of ``log pi(token | everything before
      it)``; 0 on turns that did not happen (see ``turn_mask``).

    Several processes, each holding the whole model (on its own devices): each scores its
    share of the rows (:func:`~agentrl_jax.distributed.row_shares`) and every process gets
    all of them (:func:`~agentrl_jax.distributed.allgather_blobs`).
    """
    traj = jax.device_get(trajectory)
    shares = distributed.row_shares(np.asarray(traj.turn_mask).shape[0])
    leaves = jax.tree.leaves(nnx.state(model))
    if shares is not None and all(getattr(x, "is_fully_addressable", True) for x in leaves):
        # several processes, each with the whole model: each scores its share of the rows
        mine = shares[jax.process_index()]
        own = turn_logprobs_of_rows(model, traj, mine, token_map, rows_per_batch, attention)
        return np.concatenate([a["per_turn"] for a, _ in distributed.allgather_blobs(own, None)])
    return _turn_logprobs(model, traj, token_map, rows_per_batch, attention)


def turn_logprobs_of_rows(model, traj, rows, token_map, rows_per_batch, attention) -> dict:
    """:func:`turn_logprobs` of ``traj``'s ``rows`` only, as ``{"per_turn": [len(rows), T]}``."""
    part = jax.tree.map(lambda x: np.asarray(x)[rows], traj)
    return {"per_turn": _turn_logprobs(model, part, token_map, rows_per_batch, attention)}


def _turn_logprobs(model, traj, token_map, rows_per_batch, attention) -> np.ndarray:
    turn_mask = np.asarray(traj.turn_mask, bool)
    windowed = turn_mask & (np.asarray(traj.context_start) != np.asarray(traj.prefix_len)[:, None])
    if np.any(windowed):
        raise ValueError(
            "turn_logprobs: the trajectory was sampled with a history window "
            "(context_start != prefix_len); only whole-history records are supported"
        )
    if rows_per_batch < 1:
        raise ValueError(f"turn_logprobs: `rows_per_batch` must be >= 1, got {rows_per_batch}")
    tokens = np.asarray(traj.tokens)
    token_mask = np.asarray(traj.token_mask, bool)
    scored = np.asarray(traj.loss_mask, bool) & token_mask
    token_turn = np.asarray(traj.token_turn)
    if np.any(token_turn[scored] < 0):
        raise ValueError("turn_logprobs: a sampled token (loss_mask) has no turn (token_turn -1)")
    rows, length = tokens.shape
    width = bucket_width(int(token_mask.sum(axis=1).max(initial=1)), length, _MIN_WIDTH)
    if np.any(token_mask[:, width:]):
        raise ValueError("turn_logprobs: tokens must be left-aligned (token_mask a prefix)")
    ids = (
        tokens
        if token_map is None
        else np.where(
            token_mask,
            token_map.to_model(np.where(token_mask, tokens, token_map.tokenizer_ids[0])),
            0,
        )
    )
    # The head runs at most at `bound` sampled positions per row (a power of two: few compilations).
    bound = _power_of_two(int(scored[:, 1:width].sum(axis=1).max(initial=1)), _MIN_WIDTH)
    graphdef, params = nnx.split(model)
    mesh = params_mesh(params)
    shards = 1 if mesh is None else batch_shards(mesh)
    # Rows per shard: rows_per_batch's share, or, for fewer rows than a batch, the smallest
    # power of two that holds them (a few trajectories are not padded to a whole batch).
    rows_per_batch = shards * min(
        -(-rows_per_batch // shards), _power_of_two(-(-rows // shards), 1)
    )
    program = scoring_program(
        graphdef, scoring_config(attention, bound if bound < width - 1 else None), mesh
    )
    logprobs = np.zeros((rows, width), np.float64)
    for start in range(0, rows, rows_per_batch):
        index = np.minimum(np.arange(start, start + rows_per_batch), rows - 1)  # pad: repeat
        batch = (
            ids[index, :width].astype(np.int32),
            token_mask[index, :width],
            scored[index, :width],
        )
        if mesh is not None:  # placed first: jit takes no host arrays for a sharded input
            batch = jax.device_put(
                batch, NamedSharding(mesh, P(BATCH_AXES, None))
            )  # with several processes
        out = program(params, *batch)
        real = min(rows_per_batch, rows - start)
        logprobs[start : start + real] = np.asarray(out, np.float64)[:real]
    per_turn = np.zeros(turn_mask.shape, np.float64)
    row, col = np.nonzero(scored[:, :width])
    np.add.at(per_turn, (row, token_turn[row, col]), logprobs[row, col])
    return per_turn


@dataclasses.dataclass(frozen=True)
class LikelihoodData:
    """Per-turn teacher-forced log-probs of some trajectory sets under both policies.

    For each set (e.g. ``"base"``: the base policy's trajectories): ``logp_base[set]`` and
    ``logp_rl[set]`` ``[N, T]``, ``turn_mask[set]`` and ``action_valid[set]`` ``[N, T]`` bool,
    ``success[set]`` ``[N]`` bool.
    """

    logp_base: dict[str, np.ndarray]
    logp_rl: dict[str, np.ndarray]
    turn_mask: dict[str, np.ndarray]
    action_valid: dict[str, np.ndarray]
    success: dict[str, np.ndarray]

    def action_nll(self, valid_only: bool = False) -> dict[str, np.ndarray]:
        """``{"<set> responses": ActionNLL_B [M]}``: ``-log pi_B`` of every response of the set,
        or only of those that parsed into an action (``valid_only``)."""
        out = {}
        for name, logp in self.logp_base.items():
            keep = self.turn_mask[name] & (self.action_valid[name] if valid_only else True)
            out[f"{name} responses"] = -logp[keep]
        return out

    def llr_sets(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """``{"<set> trajectories": (logp_rl, logp_base, turn_mask, success)}`` for
        :func:`agentrl_jax.evaluation.analyses.likelihood.compute`."""
        return {
            f"{name} trajectories": (
                self.logp_rl[name],
                self.logp_base[name],
                self.turn_mask[name],
                self.success[name],
            )
            for name in self.logp_base
        }


def likelihood_data(
    base_model: Qwen3ForCausalLM,
    rl_model: Qwen3ForCausalLM,
    trajectories: Mapping[str, Trajectory],
    *,
    token_map: TokenMap | None = None,
    rows_per_batch: int = 16,
    attention: str = "xla",
) -> LikelihoodData:
    """Teacher-forced log-probs of each set of ``trajectories`` (``{set name: Trajectory}``,
    e.g. ``{"base": ..., "RL": ...}``, all with the same tokenizer) under both models
    (``rows_per_batch`` and ``attention``: see :func:`turn_logprobs`)."""
    if not trajectories:
        raise ValueError("likelihood_data: no trajectories")
    logp_base, logp_rl, turn_mask, action_valid, success = {}, {}, {}, {}, {}
    for name, traj in trajectories.items():
        host = jax.device_get(traj)
        real = np.asarray(host.row_mask, bool)
        host = jax.tree.map(lambda x: np.asarray(x)[real], host)
        for model, out in ((base_model, logp_base), (rl_model, logp_rl)):
            out[name] = turn_logprobs(
                model, host, token_map=token_map, rows_per_batch=rows_per_batch, attention=attention
            )
        turn_mask[name] = np.asarray(host.turn_mask, bool)
        action_valid[name] = np.asarray(host.action_valid, bool)
        success[name] = np.asarray(host.success, bool)
    return LikelihoodData(logp_base, logp_rl, turn_mask, action_valid, success)


@functools.cache
def _entropy_program(graphdef: nnx.GraphDef, config: Forward):
    def score(params, tokens, token_mask, loss_mask):
        return sequence_logprobs(
            nnx.merge(graphdef, params),
            tokens,
            token_mask,
            loss_mask=loss_mask,
            with_entropy=True,
            forward=config,
        )

    return jax.jit(score)


def token_scores(
    model: Qwen3ForCausalLM,
    trajectory: Trajectory,
    *,
    rows_per_batch: int = 16,
    attention: str = "xla",
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced ``(log pi(token), entropy of pi at it)``, each ``float64[N, L]``, at
    every sampled token of ``trajectory`` (``loss_mask``; 0 elsewhere), on one device; the
    trajectory's ids must be the model's (no token map). For the erosion analysis
    (:mod:`~agentrl_jax.evaluation.analyses.erosion`)."""
    traj = jax.device_get(trajectory)
    tokens = np.asarray(traj.tokens)
    token_mask = np.asarray(traj.token_mask, bool)
    scored = np.asarray(traj.loss_mask, bool) & token_mask
    rows, length = tokens.shape
    width = bucket_width(int(token_mask.sum(axis=1).max(initial=1)), length, _MIN_WIDTH)
    rows_per_batch = min(max(int(rows_per_batch), 1), _power_of_two(rows, 1))
    graphdef, params = nnx.split(model)
    program = _entropy_program(graphdef, scoring_config(attention))
    logp, entropy = np.zeros((rows, length)), np.zeros((rows, length))
    for start in range(0, rows, rows_per_batch):
        index = np.minimum(np.arange(start, start + rows_per_batch), rows - 1)  # pad: repeat
        out = program(
            params,
            tokens[index, :width].astype(np.int32),
            token_mask[index, :width],
            scored[index, :width],
        )
        real = min(rows_per_batch, rows - start)
        got_logp, got_entropy = (np.asarray(x, np.float64)[:real] for x in out)
        logp[start : start + real, :width] = np.where(
            scored[start : start + real, :width], got_logp, 0
        )
        entropy[start : start + real, :width] = np.where(
            scored[start : start + real, :width], got_entropy, 0
        )
    return logp, entropy
