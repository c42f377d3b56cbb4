"""The train step: gradients against a hand-written loss, micro-batching and 8 devices exact,
non-finite updates skipped, the PPO critic's value loss and learning rate, one compile.

The 8-device check needs a fresh process (JAX fixes the device count at start-up): this file
runs itself as a script with ``--xla_force_host_platform_device_count=8``. The child starts
with the module's first test and runs alongside the others (it is mostly compilation, which
is single-threaded); it saves its sharded results, and the last test compares them with this
process's single-device, single-batch results (computed here, and shared with other tests).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fake_devices import fake_devices_env
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))  # train_fakes, also when run as a script

from train_fakes import random_trajectory, tiny_model  # noqa: E402

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig  # noqa: E402
from agentrl_jax.train import (  # noqa: E402
    RLConfig,
    TrainBatch,
    TrainConfig,
    batch_shardings,
    compute_gradients,
    init_train_state,
    make_train_step,
    shard_state,
    state_shardings,
)
from agentrl_jax.train.state import commit_state, train_model  # noqa: E402

ATOL = 1e-6
# GRPO with clip-higher, KL, an entropy bonus and sequence-mean aggregation: every term and a
# per-sequence statistic that micro-batching must keep exact. lr 1e-3 makes updates visible;
# Adam's eps 1e-6 bounds how much its first step amplifies a gradient's float rounding
# (by lr / eps: a 1e-10 difference on a ~1e-8 gradient element would move it by ~1e-5 at eps 1e-8).
GRPO = TrainConfig(
    rl=RLConfig(optimizer={"learning_rate": 1e-3, "max_grad_norm": 0.1, "adam_eps": 1e-6}),
    algorithm=AlgorithmConfig(
        aggregation="seq-mean-token-mean",
        loss_terms=(
            LossTermConfig("policy_clip", params={"clip_high": 0.28}),
            LossTermConfig("kl", 0.001),
            LossTermConfig("entropy", 0.01),
        ),
    ),
)
PPO = TrainConfig(
    algorithm=AlgorithmConfig(
        advantage="gae",
        loss_terms=(
            LossTermConfig("policy_clip"),
            LossTermConfig("kl", 0.001),
            LossTermConfig("value_clip"),
        ),
    )
)


@functools.lru_cache(maxsize=None)
def _model_and_graphdef():
    model = tiny_model()
    return model, nnx.split(model)[0]


@functools.lru_cache(maxsize=None)
def _gradients_fn(config: TrainConfig):
    return jax.jit(functools.partial(compute_gradients, _model_and_graphdef()[1], config))


@functools.lru_cache(maxsize=None)
def _step_fn(config: TrainConfig):
    return make_train_step(_model_and_graphdef()[1], config)


def _perturbed(tree, seed: int):
    """``tree`` plus N(0, 0.05) noise, drawn with NumPy (no per-shape compiles)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) + 0.05 * rng.standard_normal(x.shape), x.dtype), tree
    )


@functools.lru_cache(maxsize=None)
def _state(config: TrainConfig):
    """Initial state; the reference differs from the policy (so KL has a gradient) and the
    critic's value head is non-zero (so the critic's backbone has one)."""
    model, _ = _model_and_graphdef()
    state = init_train_state(model, config)
    if state.reference is not None:
        state = state.replace(reference=_perturbed(state.reference, 7))
    if state.critic is not None:
        head = {
            "kernel": jnp.linspace(-0.25, 0.25, model.config.hidden_size),
            "bias": jnp.asarray(0.3),
        }
        state = state.replace(critic=state.critic.replace(head=head))
    return commit_state(state)  # every leaf where the step's outputs will be: one compilation


def _assert_close(got, want, err_msg: str = "") -> None:
    """Leafwise ``|got - want| <= 1e-6 + 1e-6 |want|``: 1e-6 absolute, and relative above 1,
    where float32 resolves only ~1e-7 per operation and sums in another order differ by ulps."""
    for i, (x, y) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), atol=ATOL, rtol=ATOL, err_msg=f"{err_msg} leaf {i}"
        )


def _max_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


# ------------------------------------------------------------------------ 8 devices (child process)

# config, micro-batches, mesh (data, fsdp, tensor): sharding and micro-batching together
MESH_CASES = {"grpo": (GRPO, 2, (2, 2, 2)), "ppo": (PPO, 2, (8, 1, 1))}
LORA_PACKED = TrainConfig(
    rl=RLConfig(
        lora={"rank": 4, "alpha": 8.0}, memory={"packing": True}, batching={"num_micro_batches": 2}
    ),
    algorithm={"loss_terms": [{"name": "policy_clip"}], "aggregation": "seq-mean-token-mean"},
)


def _batch(seed: int) -> TrainBatch:
    """16 rows (2 padding), 24 tokens, 3 turns: one shape for every test, so compiles are shared."""
    return TrainBatch(random_trajectory(seed, rows=16, padded_rows=2))


def _sharded_results(out: Path) -> None:
    """Child process (8 devices): sharded gradients and one sharded update, saved to ``out``.

    GRPO runs on a data x fsdp x tensor = 2 x 2 x 2 mesh, PPO (critic included) on 8-way data
    parallelism, both with 2 micro-batches. The parent compares them with single-device,
    single-batch results of the same state and batch: GRPO's it computes itself (other tests
    share them), PPO's gradients this child computes on one device, unsharded, to spare the
    parent a compile.
    """
    from agentrl_jax.sharding import MeshConfig, build_mesh, describe

    assert jax.device_count() == 8, jax.devices()
    batch, arrays, specs = _batch(6), {}, {}

    def save(prefix, tree):
        for i, leaf in enumerate(jax.tree.leaves(tree)):
            arrays[f"{prefix}/{i}"] = np.asarray(leaf)

    for name, (config, micro, shape) in MESH_CASES.items():
        state, mesh = _state(config), build_mesh(MeshConfig(*shape))
        sharded_config = dataclasses.replace(
            config,
            rl=dataclasses.replace(
                config.rl, batching=dataclasses.replace(config.rl.batching, num_micro_batches=micro)
            ),
        )
        placed = jax.device_put(batch, batch_shardings(batch, mesh))
        grads = jax.jit(
            functools.partial(compute_gradients, _model_and_graphdef()[1], sharded_config),
            in_shardings=(state_shardings(state, mesh), batch_shardings(batch, mesh)),
        )(shard_state(state, mesh), placed)
        save(f"{name}/grads", (grads[0], grads[1], grads[2]["loss"]))
        if name == "ppo":
            single = _gradients_fn(config)(state, batch)
            save(f"{name}/single_grads", (single[0], single[1], single[2]["loss"]))
        if (
            name == "grpo"
        ):  # the whole sharded step: the same update, and the state keeps its layout
            step = make_train_step(
                _model_and_graphdef()[1], sharded_config, mesh=mesh, state_template=state
            )
            new, _ = step(shard_state(state, mesh), placed)
            save(f"{name}/policy", new.policy)
            opt_specs = describe(new.policy_opt)
            specs = {
                "q_proj": describe(new.policy)["layers/q_proj"],
                "mu_q_proj": next(
                    v for k, v in opt_specs.items() if k.endswith("mu/layers/q_proj")
                ),
            }
    _ordered_sums(save)
    # LoRA adapters on a sharded base, trajectories packed: the packed rows split over the
    # 2 x 2 batch shards, the replicated adapters' gradients summed across them
    config, mesh = LORA_PACKED, build_mesh(MeshConfig(2, 2, 2))
    model = train_model(_model_and_graphdef()[0], config)
    graphdef, state = nnx.graphdef(model), init_train_state(model, config)
    step = make_train_step(graphdef, config, mesh=mesh, state_template=state)
    packed = step.packed(batch)
    assert packed.packing.shape[0] % 8 == 0  # 2 micro-batches x 4 batch shards
    sharded = jax.jit(
        functools.partial(compute_gradients, graphdef, config, mesh=mesh),
        in_shardings=(state_shardings(state, mesh), batch_shardings(packed, mesh)),
    )(shard_state(state, mesh), jax.device_put(packed, batch_shardings(packed, mesh)))
    single = jax.jit(functools.partial(compute_gradients, graphdef, config))(
        state, step.packed(batch)
    )
    unpacked = jax.jit(
        functools.partial(
            compute_gradients,
            graphdef,
            dataclasses.replace(
                config,
                rl=dataclasses.replace(
                    config.rl, memory=dataclasses.replace(config.rl.memory, packing=False)
                ),
            ),
        )
    )(state, batch)
    for name, grads in (("sharded", sharded), ("single", single), ("unpacked", unpacked)):
        save(f"lora/{name}", (grads[0], grads[2]["loss"]))
    np.savez(out, **arrays)
    out.with_suffix(".json").write_text(json.dumps(specs))


def _ordered_partials() -> list[np.ndarray]:
    """Per-device partial sums ``[8, ...]`` for :func:`_ordered_sums`: a leaf exchanged on its
    own (>= ``SMALL`` elements) and two small ones exchanged together, over 12 orders of
    magnitude, so the order of the additions shows in the bits."""
    rng = np.random.default_rng(3)

    def draw(*shape):
        x = rng.standard_normal((8, *shape)) * 10.0 ** rng.integers(-6, 6, (8, *shape))
        return x.astype(np.float32)

    return [draw(300, 250), draw(5), draw()]


def _ordered_sums(save) -> None:
    """Child process (8 devices): :func:`~agentrl_jax.ordered_sums.ordered_sum` of
    :func:`_ordered_partials` (device ``d`` holding row ``d``) on two groupings of the 8
    devices into batch axes (8 along data; 2 x 4 along data x fsdp, as 2 hosts of 4 lay them
    out), saved for the parent to compare with NumPy's hand-ordered sum."""
    from jax.sharding import PartitionSpec as P

    from agentrl_jax.ordered_sums import ordered_sum
    from agentrl_jax.sharding import BATCH_AXES, MeshConfig, build_mesh

    parts = _ordered_partials()
    for shape in ((8, 1, 1), (2, 4, 1)):
        mesh = build_mesh(MeshConfig(*shape))
        summed = jax.jit(
            jax.shard_map(
                lambda tree: ordered_sum([x[0] for x in tree]),
                mesh=mesh,
                in_specs=(P(BATCH_AXES),),
                out_specs=P(),
                check_vma=False,
            )
        )(parts)
        save(f"ordered/{shape[0]}x{shape[1]}", summed)


@pytest.fixture(scope="module")
def multi_device_child(request, tmp_path_factory):
    """Starts the 8-device child with the module's first test, if the 8-device test is selected;
    it runs alongside the other tests (it is mostly single-threaded compilation)."""
    if not any(item.name.startswith("test_eight_devices") for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("eight_devices") / "results.npz"
    env = fake_devices_env(8)
    child = subprocess.Popen(
        [sys.executable, __file__, str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield child, out
    if child.poll() is None:
        child.kill()
        child.communicate()


@pytest.fixture(autouse=True)
def _start_child_early(multi_device_child):
    yield


# ---------------------------------------------------------------------- against a hand-written loss


def _hand_written_grpo_loss(params, reference, traj, advantages):
    """``GRPO``'s loss written out directly: clip-higher ratio (0.2 / 0.28), k3 KL (0.001),
    entropy bonus (0.01), each sequence's token mean, then the mean over sequences. One update
    per batch: the old log-probs are the policy's own (no gradient), so the ratio is 1."""
    graphdef = _model_and_graphdef()[1]
    tokens, mask = traj.tokens, traj.token_mask
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

    def token_log_softmax(p):  # [N, L-1, V]: the distribution each token 1..L-1 was drawn from
        logits, _ = nnx.merge(graphdef, p)(tokens, positions, mask)
        return jax.nn.log_softmax(logits[:, :-1], axis=-1)

    def picked(log_probs):
        return jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]

    log_probs = token_log_softmax(params)
    lp, ref = picked(log_probs), picked(token_log_softmax(reference))
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    a = advantages[:, None]
    ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))
    surrogate = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - 0.2, 1 + 0.28))
    d = ref - lp
    k3 = jnp.minimum(jnp.exp(d) - d - 1, 10.0)
    per_token = surrogate + 0.001 * k3 - 0.01 * entropy
    loss_mask = (traj.loss_mask & traj.row_mask[:, None])[:, 1:].astype(jnp.float32)
    tokens_per_row = jnp.sum(loss_mask, axis=1)
    row_means = jnp.sum(per_token * loss_mask, axis=1) / jnp.maximum(tokens_per_row, 1)
    has_tokens = tokens_per_row > 0
    return jnp.sum(jnp.where(has_tokens, row_means, 0.0)) / jnp.sum(has_tokens)


def _numpy_grpo_advantages(traj, eps=1e-6) -> np.ndarray:
    success, rows, groups = (np.asarray(x) for x in (traj.success, traj.row_mask, traj.group_id))
    adv = np.zeros(len(success), np.float32)
    for g in np.unique(groups[rows]):
        members = rows & (groups == g)
        r = success[members].astype(np.float64)
        adv[members] = (r - r.mean()) / (r.std(ddof=1) + eps) if members.sum() > 1 else 0.0
    return adv


def test_gradient_equals_a_hand_written_grpo_loss():
    state = _state(GRPO)
    traj = _batch(0).trajectory
    grads, _, metrics = _gradients_fn(GRPO)(state, TrainBatch(traj))
    advantages = jnp.asarray(_numpy_grpo_advantages(traj))
    loss, want = jax.jit(jax.value_and_grad(_hand_written_grpo_loss))(
        state.policy, state.reference, traj, advantages
    )
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    _assert_close(grads, want)
    assert float(optax.tree.norm(want)) > 1e-3  # a real gradient, not zeros compared to zeros


# ------------------------------------------------------------------------- micro-batching


def test_micro_batched_gradients_equal_the_single_batch_gradient():
    """(PPO's critic is micro-batched in the 8-device test, against the single batch.)"""
    split = dataclasses.replace(
        GRPO,
        rl=dataclasses.replace(
            GRPO.rl, batching=dataclasses.replace(GRPO.rl.batching, num_micro_batches=4)
        ),
    )
    state = _state(GRPO)
    batch = _batch(1)
    g1, _, m1 = _gradients_fn(GRPO)(state, batch)
    gm, _, mm = _gradients_fn(split)(state, batch)
    _assert_close(gm, g1)
    assert float(optax.tree.norm(g1)) > 1e-3
    for key in m1:
        np.testing.assert_allclose(mm[key], m1[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_micro_batch_count_must_divide_the_rows():
    config = TrainConfig(
        rl=RLConfig(batching={"num_micro_batches": 3}, tasks_per_step=3, group_size=2)
    )
    with pytest.raises(ValueError, match="num_micro_batches=3 must divide the batch's 16 rows"):
        jax.eval_shape(
            functools.partial(compute_gradients, _model_and_graphdef()[1], config),
            _state(GRPO),
            _batch(0),
        )


# ------------------------------------------------------------------------- update and skipping


def test_update_applies_clipped_adamw_and_compiles_once():
    step, state = _step_fn(GRPO), _state(GRPO)
    batch = _batch(2)
    new, metrics = step(state, batch)
    grads, _, _ = _gradients_fn(GRPO)(state, batch)
    optimizer = optax.chain(
        optax.clip_by_global_norm(0.1), optax.adamw(1e-3, eps=1e-6, weight_decay=0.01)
    )

    @jax.jit
    def reference_update(grads, params):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    # to float32 rounding: a few ulps of parameters near 1 (an ulp there is 1.2e-7)
    assert _max_diff(new.policy, reference_update(grads, state.policy)) <= 4e-7
    assert (
        int(new.step) == 1
        and int(new.skipped_updates) == 0
        and float(metrics["update_skipped"]) == 0
    )
    assert _max_diff(new.reference, state.reference) == 0  # the reference is frozen
    step(new, _batch(3))
    assert step.compiled_count() == 1


def test_non_finite_loss_skips_the_update_and_the_run_continues():
    """(A NaN process reward, through the training loop: tests/test_train_loop.py.)"""
    step, state = _step_fn(GRPO), _state(GRPO)  # the program test_update_applies_... compiles
    batch = _batch(4)
    corrupt = state.replace(reference=jax.tree.map(lambda x: x.at[0].set(jnp.nan), state.reference))
    after_bad, metrics = step(corrupt, batch)  # a NaN in the reference's weights: a NaN KL term
    assert not np.isfinite(float(metrics["loss"]))
    assert float(metrics["update_skipped"]) == 1 and int(after_bad.skipped_updates) == 1
    assert int(after_bad.step) == 1
    assert (
        _max_diff((after_bad.policy, after_bad.policy_opt), (state.policy, state.policy_opt)) == 0
    )
    after_good, metrics = step(after_bad.replace(reference=state.reference), batch)
    assert float(metrics["update_skipped"]) == 0 and int(after_good.skipped_updates) == 1
    assert int(after_good.step) == 2
    assert all(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(after_good.policy), jax.tree.leaves(state.policy))
    )
    assert step.compiled_count() == 1


# ------------------------------------------------------------------------- PPO critic


def test_ppo_value_loss_matches_a_hand_computation_and_uses_the_critic_learning_rate():
    """PPO defaults: critic lr 1e-5, value clip 0.5, GAE with gamma = lam = 1."""
    state = _state(PPO)
    traj = _batch(5).trajectory

    # By hand: V(token p) = head(hidden at p - 1); before the update old values equal values, so
    # the clipped loss is 0.5 (V - R)^2, and with gamma = lam = 1 every return of a row is its
    # outcome reward R (the only reward, on its last sampled token).
    def hidden_states(backbone, tokens, mask):
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        return nnx.merge(_model_and_graphdef()[1], backbone).hidden_states(tokens, positions, mask)[
            0
        ]

    hidden = jax.jit(hidden_states)(state.critic.backbone, traj.tokens, traj.token_mask)
    kernel, bias = (
        np.asarray(state.critic.head["kernel"], np.float64),
        float(state.critic.head["bias"]),
    )
    values = np.zeros(traj.tokens.shape)
    values[:, 1:] = np.asarray(hidden, np.float64)[:, :-1] @ kernel + bias
    mask = np.asarray(traj.loss_mask & traj.row_mask[:, None])
    returns = np.asarray(traj.success, np.float64)[:, None]
    expected = np.sum(0.5 * (values - returns) ** 2 * mask) / mask.sum()

    new, metrics = _step_fn(PPO)(state, TrainBatch(traj))
    np.testing.assert_allclose(float(metrics["value_loss"]), expected, rtol=1e-5)
    # Adam's first step moves a parameter by lr * g / (|g| + eps), i.e. by lr = 1e-5, plus
    # AdamW's decay lr * wd * value: the bias moves by 1e-5 (1 -/+ 0.01 * 0.3), up to the
    # float32 rounding of the stored bias (one ulp at 0.3 is 3e-8).
    bias_step = abs(float(new.critic.head["bias"]) - bias)
    ulp = float(np.spacing(np.float32(bias)))
    assert min(abs(bias_step - 1e-5 * (1 + s * 0.003)) for s in (1, -1)) <= ulp, bias_step
    assert float(metrics["critic_grad_norm"]) > 0 and float(metrics["update_skipped"]) == 0


# ------------------------------------------------------------------------- 8 devices


@functools.cache
def _child_results(child, out: Path):
    """The 8-device child's saved arrays, once it has finished (it succeeded)."""
    _, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-4000:]
    return dict(np.load(out))


def test_tree_sum_adds_pairs_then_pairs_of_pairs():
    """The fixed order, by hand in float32 (an ulp of 1e8 is 8, so a 1 added to 1e8 is lost):
    ((1e8 + 1) + (-1e8 + 1)) + 1 = (1e8 + -1e8) + 1 = 1, where a sequential sum gives 2."""
    from agentrl_jax.ordered_sums import tree_sum

    parts = [np.float32(x) for x in (1e8, 1.0, -1e8, 1.0, 1.0)]
    assert tree_sum(parts) == np.float32(1.0)
    assert functools.reduce(np.add, parts) == np.float32(2.0)
    assert tree_sum(parts[:1]) is parts[0]
    with pytest.raises(ValueError, match="nothing to add"):
        tree_sum([])


def test_eight_devices_sum_in_a_fixed_order(multi_device_child):
    """``mesh.ordered_sums``' reduction: each leaf of the 8 per-device partials added as the
    fixed binary tree ``((0+1)+(2+3))+((4+5)+(6+7))`` over the devices' batch index, bit for
    bit NumPy's float32 sum in that order, whether the 8 devices lie on one axis or 2 x 4 (as
    2 processes of 4 devices each hold them); a sequential sum of the same partials differs
    in the bits (the order shows)."""
    saved = _child_results(*multi_device_child)
    parts = _ordered_partials()
    want = [((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])) for p in parts]
    for grouping in ("8x1", "2x4"):
        got = [saved[f"ordered/{grouping}/{i}"] for i in range(len(parts))]
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == np.float32 and g.shape == w.shape
            np.testing.assert_array_equal(g, w, err_msg=grouping)
    sequential = functools.reduce(np.add, list(parts[0]))
    assert not np.array_equal(sequential, want[0])


def test_eight_devices_give_the_single_device_gradients_and_update(multi_device_child):
    child, out = multi_device_child
    saved = _child_results(child, out)

    def leaves(prefix):
        return [
            saved[k]
            for k in sorted(
                (k for k in saved if k.startswith(prefix + "/")),
                key=lambda k: int(k.rsplit("/", 1)[1]),
            )
        ]

    batch = _batch(6)
    grads, _, metrics = _gradients_fn(GRPO)(_state(GRPO), batch)
    for name, single in (
        ("grpo", jax.tree.leaves((grads, metrics["loss"]))),
        ("ppo", leaves("ppo/single_grads")),
    ):
        _assert_close(leaves(f"{name}/grads"), single, name)
        assert float(np.sqrt(sum(np.sum(np.square(x)) for x in single[:-1]))) > 1e-3
    # lr 1e-3 after clipping: Adam would turn any real gradient difference into a visible one.
    new, _ = _step_fn(GRPO)(_state(GRPO), batch)
    _assert_close(leaves("grpo/policy"), jax.tree.leaves(new.policy), "policy after the step")
    specs = json.loads(out.with_suffix(".json").read_text())
    column_parallel = str(jax.sharding.PartitionSpec(None, "tensor", "fsdp"))
    assert specs == {"q_proj": column_parallel, "mu_q_proj": column_parallel}
    # LoRA with packing: sharded = one device = unpacked (the adapters' gradients, the loss)
    _assert_close(leaves("lora/sharded"), leaves("lora/single"), "LoRA packed, sharded")
    _assert_close(leaves("lora/single"), leaves("lora/unpacked"), "LoRA packed vs unpacked")
    assert max(float(np.max(np.abs(x))) for x in leaves("lora/single")[:-1]) > 1e-6


if __name__ == "__main__":
    _sharded_results(Path(sys.argv[1]))
