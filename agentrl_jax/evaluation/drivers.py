"""What feeds each analysis: the rollouts and state plays behind Pass@K, Pass@T, step quality,
error states and likelihood, shared by ``agentrl-jax eval`` and the reproduction (both through
:func:`agentrl_jax.evaluation.analyses.context.run_analysis`),
so both sample the same data for the same seed and settings; each then hands it to the
analysis' ``compute`` and ``section`` (:mod:`agentrl_jax.evaluation.analyses`).

Randomness: every analysis draws from its own stream of the seed (:func:`stream_key`,
:data:`STREAMS`) and plays every policy with the same key, so policies meet the same
environment randomness, and step quality and error states build the same state pools.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from agentrl_jax.evaluation import passt
from agentrl_jax.evaluation.splicing import SplicedPolicy
from agentrl_jax.prompts import BudgetPresentation
from agentrl_jax.rollout import RolloutConfig
from agentrl_jax.sampling import Policy
from agentrl_jax.trajectory import Trajectory

STREAMS = {
    "passk": 1,
    "passt": 2,
    "sources": 3,
    "steps": 4,
    "errors": 5,
    "likelihood": 6,
    "presentation": 7,
    "splice": 8,
    "erosion": 9,
}
"""The stream of randomness each built-in analysis draws from (``sources``: the trajectories the
state pools are drawn from)."""
PLUGIN_STREAMS = 1 << 16  # where the streams of other names begin


def stream_number(stream: str) -> int:
    """``stream``'s number: :data:`STREAMS`' for a built-in one; for any other name (an
    analysis a plugin registers, drawing from a stream named after itself) a number of its
    own, the same in every process and run (its CRC-32, past the built-in ones)."""
    if stream in STREAMS:
        return STREAMS[stream]
    return PLUGIN_STREAMS + zlib.crc32(stream.encode()) % ((1 << 32) - PLUGIN_STREAMS)


def stream_key(seed: int, stream: str) -> jax.Array:
    """The key of ``stream`` (:func:`stream_number`) under ``seed``."""
    return jax.random.fold_in(jax.random.key(seed), stream_number(stream))


def rollout_units(tasks: int, samples: int, budget: int) -> int:
    """Work of a rollout, in trajectory-turns (an upper bound: episodes may end early)."""
    return tasks * samples * budget


@dataclasses.dataclass(frozen=True)
class Play:
    """Where the policies play: an environment (its ``t_max`` the full budget), the tasks
    ``task_ids [tasks]``, the tokenizer and the evaluation rollout settings. ``progress`` is
    called with the trajectory-turns (:func:`rollout_units`) of every task rollout as it
    finishes; ``echo`` with a line saying what is about to be sampled."""

    env: Any
    tokenizer: Any
    task_ids: np.ndarray
    config: RolloutConfig
    tasks_per_call: int | None = None
    states_per_call: int | None = None
    progress: Callable[[int], None] = lambda units: None
    echo: Callable[[str], None] = lambda line: None

    @property
    def tasks(self) -> int:
        return len(self.task_ids)

    def rollout(self, policy: Policy, key: jax.Array, *, samples: int, budget: int) -> Trajectory:
        """``samples`` trajectories of every task at ``budget`` (:func:`passt.rollout_tasks`)."""
        traj = passt.rollout_tasks(
            self.env,
            self.tokenizer,
            policy,
            self.task_ids,
            key,
            budget=budget,
            samples=samples,
            config=self.config,
            tasks_per_call=self.tasks_per_call,
        )
        self.progress(rollout_units(self.tasks, samples, budget))
        return traj


# ---------------------------------------------------------------- Pass@K and Pass@T


def pass_at_k_counts(
    play: Play, policies: Mapping[str, Policy], key: jax.Array, *, samples: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{policy: (n [tasks], c [tasks])}``: ``samples`` trajectories of every task at the full
    budget, for :mod:`~agentrl_jax.evaluation.analyses.pass_at_k`."""
    t_max, counts = play.env.t_max, {}
    for name, policy in policies.items():
        play.echo(f"Pass@K: {name}, {play.tasks} tasks x {samples} samples at T={t_max}")
        counts[name] = passt.pass_at_k_results(
            play.env,
            play.tokenizer,
            policy,
            play.task_ids,
            key,
            samples=samples,
            config=play.config,
            tasks_per_call=play.tasks_per_call,
        )[t_max]
        play.progress(rollout_units(play.tasks, samples, t_max))
    return counts


def pass_at_t_counts(
    play: Play,
    policies: Mapping[str, Policy],
    key: jax.Array,
    *,
    budgets: Sequence[int],
    samples: int,
) -> dict[str, dict[int, tuple]]:
    """``{policy: {T: (n [tasks], c [tasks])}}``: ``samples`` trajectories of every task at each
    of ``budgets``, each sampled afresh, for :mod:`~agentrl_jax.evaluation.analyses.pass_at_t`,
    in increasing ``T``. One rollout per budget (the same samples as all budgets at once,
    :mod:`passt`), so ``progress`` follows the budgets."""
    counts: dict[str, dict[int, tuple]] = {}
    for name, policy in policies.items():
        play.echo(f"Pass@T: {name}, budgets {list(budgets)}, {samples} samples per task")
        counts[name] = {}
        for budget in sorted({int(b) for b in budgets}):
            counts[name].update(
                passt.pass_at_t_results(
                    play.env,
                    play.tokenizer,
                    policy,
                    play.task_ids,
                    key,
                    budgets=[budget],
                    samples=samples,
                    config=play.config,
                    tasks_per_call=play.tasks_per_call,
                )
            )
            play.progress(rollout_units(play.tasks, samples, budget))
    return counts


def presentation_counts(
    play: Play,
    policies: Mapping[str, Policy],
    key: jax.Array,
    *,
    presentations: Sequence[str],
    noise: float,
    budgets: Sequence[int],
    samples: int,
) -> dict[str, dict[str, dict[int, tuple]]]:
    """``{presentation: {policy: {T: (n [tasks], c [tasks])}}}``: :func:`pass_at_t_counts`
    with the budget shown each way (:class:`~agentrl_jax.prompts.BudgetPresentation`), the
    same key for every presentation (paired per task), for
    :mod:`~agentrl_jax.evaluation.analyses.presentation`."""
    out = {}
    for mode in presentations:
        shown = BudgetPresentation(mode=mode, noise=noise)
        config = dataclasses.replace(play.config, presentation=shown)
        play.echo(f"Budget presentation: {mode}")
        out[mode] = pass_at_t_counts(
            dataclasses.replace(play, config=config),
            policies,
            key,
            budgets=budgets,
            samples=samples,
        )
    return out


def switch_turn(depth: float, t_max: int) -> int:
    """The turn a splice at normalised depth ``depth`` hands over at: ``round(depth T_max)``
    (Python's round: half to even), at least 1 and at most ``T_max - 1``."""
    return min(max(int(round(depth * t_max)), 1), max(t_max - 1, 1))


def splice_successes(
    play: Play,
    policies: Mapping[str, Policy],
    key: jax.Array,
    *,
    pairs: Sequence[tuple[str, str]],
    depths: Sequence[float],
    samples: int,
) -> tuple[dict[str, np.ndarray], dict[str, dict[float, np.ndarray]]]:
    """``(alone, spliced)``: ``alone[policy]`` ``bool[tasks, samples]`` successes at
    ``T_max``; ``spliced["A>B"][d]`` the same with A playing the turns before
    :func:`switch_turn` ``(d)`` and B the rest (:class:`SplicedPolicy`), for every ``(A, B)``
    of ``pairs``. Every rollout uses ``key``, so prefixes are matched (see
    :mod:`~agentrl_jax.evaluation.splicing`), for
    :mod:`~agentrl_jax.evaluation.analyses.splice`."""
    t_max, tasks = play.env.t_max, play.tasks

    def successes(policy: Policy) -> np.ndarray:
        traj = play.rollout(policy, key, samples=samples, budget=t_max)
        return np.asarray(traj.success, bool).reshape(tasks, samples)

    alone = {}
    for name in dict.fromkeys(name for pair in pairs for name in pair):
        play.echo(f"Splice: {name} alone, {tasks} tasks x {samples} samples at T={t_max}")
        alone[name] = successes(policies[name])
    spliced: dict[str, dict[float, np.ndarray]] = {}
    for first, then in pairs:
        label = f"{first}>{then}"
        spliced[label] = {}
        for depth in depths:
            turn = switch_turn(depth, t_max)
            play.echo(f"Splice: {first}'s first {turn} turns, then {then}")
            policy = SplicedPolicy(policies[first], policies[then], turn)
            spliced[label][float(depth)] = successes(policy)
    return alone, spliced


# ---------------------------------------------------------------- likelihood (§7.4)


def likelihood_rollouts(
    play: Play, policies: Mapping[str, Policy], key: jax.Array, *, samples: int, budget: int
) -> dict[str, Trajectory]:
    """``{policy: Trajectory}``: ``samples`` per task at ``budget``, whose responses
    :func:`~agentrl_jax.evaluation.likelihood.likelihood_data` scores under both models."""
    out = {}
    for name, policy in policies.items():
        play.echo(f"Likelihood: {name}, {play.tasks} tasks x {samples} trajectories at T={budget}")
        out[name] = play.rollout(policy, key, samples=samples, budget=budget)
    return out
