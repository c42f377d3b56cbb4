"""The training state: one pytree holding everything a run needs to continue.

:class:`TrainState` fields (all arrays, so Orbax saves and restores it as one tree):

* ``step``             int32 []  updates attempted so far (skipped ones included)
* ``policy``           nnx.State of the policy's parameters (``nnx.split(model)[1]``)
* ``policy_opt``       its optax state
* ``reference``        frozen reference parameters for the KL term, or None without one
* ``critic``           :class:`CriticParams` (PPO), or None
* ``critic_opt``       the critic's optax state, or None
* ``rng``              uint32[2] PRNG key; the loop splits a rollout key off it every step
* ``data_position``    int32 []  index of the next task batch to draw
* ``skipped_updates``  int32 []  updates skipped because the loss or a gradient was not finite
* ``base``             with LoRA (``rl.lora``): the frozen base weights, and ``policy`` holds the
  adapters only (so the optimizer and the gradients cover the adapters); None without LoRA

With LoRA the model's ``graphdef`` has the adapters (:func:`train_model`) and
``nnx.merge(graphdef, state.policy, state.base)`` is the policy; :func:`policy_params` gives a
plain Qwen3's parameters (the adapters merged into the weights) for the sampler and export.

The model's ``graphdef`` (structure, dtypes, remat) and the :class:`TrainConfig` are static and
live outside the state. The critic is a separate Qwen3 backbone (initialised as a copy of the
policy, as verl does) plus a linear value head on its final hidden states.

:func:`state_shardings` places a state on a mesh: parameters (and the optimizer moments that
mirror them) by the partition rules of :mod:`agentrl_jax.sharding`, everything else replicated.

Placement is decided once: :func:`init_train_state` commits every leaf (the counters and the
key too) to where the parameters are, and :func:`place_state` puts a state in its final
layout before the first step. A jitted step compiles once per placement of its inputs as
well as per shape: an uncommitted counter in the first step and the committed one the step
returns would compile the step (and the sampler, whose key is split off ``rng``) twice.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.errors import ConfigError
from agentrl_jax.models import lora
from agentrl_jax.sharding import QWEN3_PARAM_RULES, PartitionRule, path_string, spec_for
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.inputs import check_model_inputs


@struct.dataclass
class CriticParams:
    """A value model: a Qwen3 ``backbone`` (nnx.State) and a linear ``head`` on its hidden states.

    ``head = {"kernel": [hidden_size], "bias": []}``; value = hidden . kernel + bias.
    """

    backbone: Any
    head: dict[str, jax.Array]


@struct.dataclass
class TrainState:
    step: jax.Array
    policy: Any
    policy_opt: Any
    reference: Any
    critic: CriticParams | None
    critic_opt: Any
    rng: jax.Array
    data_position: jax.Array
    skipped_updates: jax.Array
    base: Any = None


def make_optimizer(
    learning_rate: float, weight_decay: float, config: TrainConfig
) -> optax.GradientTransformation:
    """Global-norm clipping (``config.rl.optimizer.max_grad_norm``, if set) then AdamW."""
    adamw = optax.adamw(
        learning_rate,
        b1=config.rl.optimizer.adam_b1,
        b2=config.rl.optimizer.adam_b2,
        eps=config.rl.optimizer.adam_eps,
        weight_decay=weight_decay,
    )
    if config.rl.optimizer.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.rl.optimizer.max_grad_norm), adamw)


def policy_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return make_optimizer(
        config.rl.optimizer.learning_rate, config.rl.optimizer.weight_decay, config
    )


def critic_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return make_optimizer(
        config.rl.optimizer.critic_learning_rate, config.rl.optimizer.critic_weight_decay, config
    )


def init_critic(policy_params: Any, hidden_size: int) -> CriticParams:
    """A critic whose backbone copies the policy and whose value head is zero (V = 0 at first)."""
    backbone = jax.tree.map(jnp.copy, policy_params)
    return CriticParams(
        backbone,
        {"kernel": jnp.zeros((hidden_size,), jnp.float32), "bias": jnp.zeros((), jnp.float32)},
    )


def train_model(model: nnx.Module, config: TrainConfig) -> nnx.Module:
    """The model the step trains: ``model`` itself, or with ``rl.lora`` a model sharing its
    weights with fresh adapters (:func:`~agentrl_jax.models.lora.with_adapters`, keyed by
    ``rl.seed``); its ``graphdef`` is the step's."""
    if config.rl.lora is None or lora.has_adapters(model):
        return model
    key = jax.random.fold_in(jax.random.PRNGKey(config.rl.seed), 0x10A)
    return lora.with_adapters(model, config.rl.lora, key)


def init_train_state(model: nnx.Module, config: TrainConfig) -> TrainState:
    """The state at step 0 for ``model`` (its current parameters become policy and reference;
    with ``rl.lora``, ``model`` is :func:`train_model`'s: its adapters are the policy, the rest
    the frozen base, cast to ``rl.lora.base_dtype``, and there is no reference copy).

    The copies and optimizer states are made in one jitted call, so they land where the
    parameters are (same shardings) and no op is dispatched eagerly, one by one. Every leaf
    is committed (:func:`commit_state`).

    A ConfigError names the setting that asks a dense model for what only an MoE one has
    (router loss terms, ``rl.routing_replay``).
    """
    moe_layers = sum(model.config.moe_layers)
    try:
        check_model_inputs(config.algorithm, moe_layers)
    except ValueError as e:
        raise ConfigError(f"algorithm.{e}") from None
    if config.rl.routing_replay and not moe_layers:
        raise ConfigError(
            "rl.routing_replay: the model has no MoE layers (a dense model has no routing to "
            "replay): set it to false or train an MoE model"
        )
    base = None
    if config.rl.lora is not None:
        if not lora.has_adapters(model):
            raise ValueError("rl.lora is set: build the state from train_model(model, config)")
        _, params, base = lora.split_adapters(model)
        wanted = config.rl.lora.base_dtype
        if wanted is not None and any(x.dtype != wanted for x in jax.tree.leaves(base)):
            base = _cast(base, jnp.dtype(wanted))  # else the model's own weights, no copy
    else:
        if lora.has_adapters(model):
            raise ValueError("the model has LoRA adapters but rl.lora is null")
        _, params = nnx.split(model)
    policy_opt, reference, critic, critic_opt = _derived_state(
        params, config, model.config.hidden_size
    )
    return commit_state(
        TrainState(
            step=jnp.zeros((), jnp.int32),
            policy=params,
            policy_opt=policy_opt,
            reference=reference,
            critic=critic,
            critic_opt=critic_opt,
            rng=jax.random.PRNGKey(config.rl.seed),
            data_position=jnp.zeros((), jnp.int32),
            skipped_updates=jnp.zeros((), jnp.int32),
            base=base,
        )
    )


@functools.partial(jax.jit, static_argnums=1)
def _cast(params: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype), params)


@functools.partial(jax.jit, static_argnums=2)
def _merged(base: Any, adapters: Any, scale: float) -> Any:
    return lora.merged_params(base, adapters, scale)


def policy_params(state: TrainState, config: TrainConfig) -> Any:
    """The policy as a plain Qwen3's parameters: ``state.policy``, or with LoRA the base with
    the adapters merged into its weights (one jitted call, on the state's devices; the base's
    dtype). What a run returns and exports."""
    if state.base is None:
        return state.policy
    return _merged(state.base, state.policy, config.rl.lora.scale)


def sampler_params(state: TrainState) -> Any:
    """What the rollouts decode with, for :func:`train_model`'s graphdef: ``state.policy``, or
    with LoRA the base and the adapters as one state (no copy), the adapters applied in each
    projection. Merging instead would hold a second copy of the weights beside the base
    (Qwen3-8B: 15.3 GiB in bfloat16, which one 80 GB GPU does not have beside the rollout's
    cache, ``plan``), while the adapters add ``2 r (in + out)`` FLOPs per token and projection
    to its ``2 in out`` (rank 16 on Qwen3-8B's projections: under 1%)."""
    if state.base is None:
        return state.policy
    return nnx.merge_state(state.base, state.policy)


def commit_state(state: TrainState) -> TrainState:
    """``state`` with every leaf committed to where its parameters are.

    Parameters on a mesh (``NamedSharding``) keep their layout and the other leaves are
    replicated over that mesh; otherwise the whole state goes to the parameters' device
    (``jax.local_devices()[0]`` if they have none). ``device_put`` onto the sharding an array
    already has is a no-op.
    """
    leaf = jax.tree.leaves(state.policy if state.base is None else state.base)[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        replicated = NamedSharding(sharding.mesh, P())

        def place(x):
            return (
                x
                if isinstance(getattr(x, "sharding", None), NamedSharding)
                else jax.device_put(x, replicated)
            )

        return jax.tree.map(place, state)
    device = next(iter(sharding.device_set)) if sharding is not None else jax.local_devices()[0]
    return jax.device_put(state, SingleDeviceSharding(device))


def place_state(
    state: TrainState, mesh: Mesh | None = None, rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES
) -> TrainState:
    """``state`` in the layout the train step keeps: :func:`shard_state` on a mesh, else
    :func:`commit_state` (one device)."""
    return commit_state(state) if mesh is None else shard_state(state, mesh, rules)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _derived_state(params: Any, config: TrainConfig, hidden_size: int):
    # with LoRA the reference is the base, adapters off: no copy
    reference = (
        jax.tree.map(jnp.copy, params) if config.uses_reference and config.rl.lora is None else None
    )
    critic = critic_opt = None
    if config.uses_critic:
        critic = init_critic(params, hidden_size)
        critic_opt = critic_optimizer(config).init(critic)
    return policy_optimizer(config).init(params), reference, critic, critic_opt


# ------------------------------------------------------------------------- sharding

# State fields whose array leaves are model parameters, or optimizer moments shaped like them.
_PARAM_FIELDS = ("policy", "policy_opt", "reference", "critic", "critic_opt", "base")


def _param_spec(path: str, shape: Sequence[int], mesh: Mesh, rules: Sequence[PartitionRule]) -> P:
    """The rule-given spec of the parameter a path ends in, else replicated.

    Optimizer states nest parameters under prefixes ("1/0/mu/layers/q_proj"), so the longest
    path suffix that a rule matches decides; scalars (step counts) and the critic's value
    head match no rule and are replicated.
    """
    parts = path.split("/")
    for start in range(len(parts)):
        suffix = "/".join(parts[start:])
        if len(shape) and any(re.search(pattern, suffix) for pattern, _ in rules):
            return spec_for(suffix, shape, mesh, rules)
    return P()


def state_shardings(
    state: TrainState, mesh: Mesh, rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES
) -> TrainState:
    """A ``NamedSharding`` for every leaf of ``state`` (arrays or ShapeDtypeStructs)."""

    def sharding(path, leaf):
        field = path_string(path[:1])
        if field in _PARAM_FIELDS:
            return NamedSharding(mesh, _param_spec(path_string(path[1:]), leaf.shape, mesh, rules))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(sharding, state)


def shard_state(
    state: TrainState, mesh: Mesh, rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES
) -> TrainState:
    """``jax.device_put`` of ``state`` onto :func:`state_shardings`."""
    return jax.device_put(state, state_shardings(state, mesh, rules))
