"""The FrozenLake 4x4 learning check of tests/test_frozenlake_learning.py (which describes the
setting): one-step maps, a tiny Qwen3 playing them through the real multi-turn
rollout, a run of the real training loop and a no-update control on the same rollout keys and
task batches, and held-out success before and after."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from train_fakes import tiny_model

from agentrl_jax.bench.rollout import frozenlake_token_map
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import SamplerPolicy
from agentrl_jax.train import RLConfig, TrainConfig, init_train_state, make_train_step, train
from agentrl_jax.train.state import policy_params, train_model
from envs.frozenlake import grid
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

BUDGET = 5
GROUP = 8
TASKS_PER_STEP = 4
TRAIN_MAPS = 8  # half with the goal right of the start, half with it below
HELD_OUT_MAPS = 16  # played in 4 batches of TASKS_PER_STEP: 128 rows
WINDOW = 3  # steps averaged at each end of the run


def one_step_maps(key: jax.Array, count: int, candidates: int = 640) -> np.ndarray:
    """``count`` distinct 4x4 maps whose goal is the cell right of the start (even indices) or
    below it (odd indices), from ``generate``'s random start/goal maps, in generation order."""
    maps = np.asarray(fl_maps.generate(key, candidates, size=4, p=0.8, random_start_goal=True))
    flat = maps.reshape(candidates, -1)
    _, first = np.unique(flat, axis=0, return_index=True)
    maps, flat = maps[np.sort(first)], flat[np.sort(first)]
    start, goal = np.argmax(flat == grid.START, 1), np.argmax(flat == grid.GOAL, 1)
    right = (goal == start + 1) & (start % 4 < 3)
    below = goal == start + 4
    half = count // 2
    right_maps, below_maps = maps[right][:half], maps[below][:half]
    assert len(right_maps) == len(below_maps) == half, "too few candidates; raise `candidates`"
    return np.stack([right_maps, below_maps], 1).reshape(count, 4, 4)


@dataclasses.dataclass(frozen=True)
class Run:
    trained: list[dict[str, float]]  # the loop's metrics, one dict per step
    control: list[dict[str, float]]
    held_out: dict[str, dict[str, float]]  # "initial"/"final" -> success and valid-move rate

    def r_multi(self, which: str) -> np.ndarray:
        return np.array([m["R_multi"] for m in getattr(self, which)])


def held_out_rates(
    runner: MultiTurnRollout, policy: SamplerPolicy, params, tasks: np.ndarray
) -> dict[str, float]:
    """Success rate and share of valid moves over ``tasks`` (batches of TASKS_PER_STEP), each
    batch with its own fixed key, the same for whatever ``params``."""
    success, valid, turns = 0.0, 0.0, 0.0
    for k, batch in enumerate(tasks.reshape(-1, TASKS_PER_STEP)):
        traj = jax.device_get(
            runner(policy.using(params), batch, jax.random.key(100 + k)).trajectory
        )
        success += traj.success.sum()
        valid += (traj.action_valid & traj.turn_mask).sum()
        turns += traj.turn_mask.sum()
    return {"success": float(success / (len(tasks) * GROUP)), "valid": float(valid / turns)}


STEPS = 10
# What the no-update control is run with: seed 0 (the rollout keys) for STEPS steps. It is the
# same for every trained configuration with that seed and length, so it is run once per process.
CONTROL = TrainConfig(rl=RLConfig(steps=STEPS, seed=0))


@dataclasses.dataclass(frozen=True)
class _Setting:
    runner: MultiTurnRollout
    policy: SamplerPolicy
    model: nnx.Module
    token_map: object
    train_ids: np.ndarray
    held_out_ids: np.ndarray


@functools.lru_cache(maxsize=4)
def _setting(
    std: float = 0.1, window: int | None = None, model: tuple = (), compact: bool = True
) -> _Setting:
    """The maps, the rollout (showing the policy the last ``window`` turns; None: all) and a
    tiny policy whose weights are N(0, ``std``) (``model``: config overrides, as pairs).
    ``compact``: the policy's cache is compacted to the live rows as rows finish (the
    default); the learning runs keep all 32 rows instead (module docstring)."""
    maps = one_step_maps(jax.random.key(0), TRAIN_MAPS + HELD_OUT_MAPS)  # distinct maps
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=BUDGET, is_slippery=False))
    runner = MultiTurnRollout(
        env,
        load_tokenizer(),
        RolloutConfig(
            group_size=GROUP,
            budget=BUDGET,
            max_response_tokens=1,
            max_context=512,
            history_window=window,
        ),
    )
    token_map = frozenlake_token_map(runner, [BUDGET])
    model = tiny_model(seed=0, std=std, vocab_size=len(token_map), **dict(model))
    return _Setting(
        runner,
        SamplerPolicy(model, token_map=token_map, compact=compact),
        model,
        token_map,
        np.arange(TRAIN_MAPS),
        np.arange(TRAIN_MAPS, len(maps)),
    )


def _loop(
    setting: _Setting, config: TrainConfig, train_step
) -> tuple[object, list[dict[str, float]]]:
    """``config.rl.steps`` steps of the training loop from the initial parameters."""

    def task_batches(position: int) -> np.ndarray:  # two "right" and two "below" maps each
        return setting.train_ids[
            (position * TASKS_PER_STEP + np.arange(TASKS_PER_STEP)) % TRAIN_MAPS
        ]

    metrics = []
    model = train_model(setting.model, config)  # with rl.lora: the sampler applies the adapters
    policy = (
        setting.policy
        if model is setting.model
        else SamplerPolicy(model, token_map=setting.token_map, compact=setting.policy.compact)
    )
    final = train(
        init_train_state(model, config),
        train_step,
        setting.runner.for_training(policy),
        task_batches,
        config,
        progress=False,
        on_step=lambda state, m: metrics.append(m),
    )
    return final, metrics


@functools.lru_cache(maxsize=4)
def _control(
    std: float = 0.1, window: int | None = None, model: tuple = ()
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """The no-update control's metrics and the initial parameters' held-out rates."""
    setting = _setting(std, window, model, compact=False)

    def unchanged(state, batch):  # the control's update: learning rate 0
        return state.replace(step=state.step + 1), {"update_skipped": jnp.zeros(())}

    unchanged_state, control = _loop(setting, CONTROL, unchanged)  # its policy: the initial one
    return control, held_out_rates(
        setting.runner,
        setting.policy,
        policy_params(unchanged_state, CONTROL),
        setting.held_out_ids,
    )


def learning_run(
    config: TrainConfig, std: float = 0.1, window: int | None = None, model: tuple = ()
) -> Run:
    """``config``'s training for STEPS steps, and the no-update control on the same rollout
    keys and task batches (``config`` must have the control's seed and length), from the
    tiny policy of weights N(0, ``std``) (``model``: its config overrides, as pairs), the
    rollouts showing it the last ``window`` turns."""
    if (config.rl.seed, config.rl.steps) != (CONTROL.rl.seed, CONTROL.rl.steps):
        raise ValueError(
            f"learning_run: seed {config.rl.seed} and steps {config.rl.steps} must be "
            f"the control's ({CONTROL.rl.seed}, {CONTROL.rl.steps})"
        )
    setting = _setting(std, window, model, compact=False)
    graphdef = nnx.graphdef(train_model(setting.model, config))  # with rl.lora: adapters
    final, trained = _loop(setting, config, make_train_step(graphdef, config))
    control, initial = _control(std, window, model)
    final_rates = held_out_rates(
        setting.runner, setting.policy, policy_params(final, config), setting.held_out_ids
    )
    return Run(trained, control, {"initial": initial, "final": final_rates})


def assert_learns_beyond_the_control(run: "Run", margin: float = 0.2) -> None:
    """R_multi gains over the run, and ends, more than ``margin`` above the no-update control
    (paired: same rollout keys and task batches, only the updates differ)."""
    trained, control = run.r_multi("trained"), run.r_multi("control")
    gain = trained[-WINDOW:].mean() - trained[:WINDOW].mean()
    control_gain = control[-WINDOW:].mean() - control[:WINDOW].mean()
    report = f"trained R_multi {np.round(trained, 2)}, control {np.round(control, 2)}"
    assert gain > control_gain + margin, report
    assert trained[-WINDOW:].mean() > control[-WINDOW:].mean() + margin, report


def assert_held_out_success_rises(run: "Run") -> None:
    """Held-out maps, same sampling key: success up by 0.15, valid answers more than doubled."""
    initial, final = run.held_out["initial"], run.held_out["final"]
    assert final["success"] > initial["success"] + 0.15, run.held_out
    assert final["valid"] > 2 * initial["valid"], run.held_out  # it learned to answer with a move
