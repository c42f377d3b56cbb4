"""The reproduction's progress accounting: the predicted work of each phase and the one bar
that counts it (:class:`Progress`).

A phase's work is its units (trajectory-turns, the evaluation's own count; demonstration
calls, warm-start and RL steps in the same currency) at its predicted seconds per unit
(:func:`phase_cost`): the bar counts predicted seconds, so its ETA (the rest at the rate so
far) holds across phases whose cost per unit differs ~10x. An analysis' units and its cost per
unit are its own (:meth:`~agentrl_jax.evaluation.analyses.registry.Analysis.units`,
``unit_seconds``); this module names none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from tqdm.auto import tqdm

from agentrl_jax.evaluation.analyses import registry
from agentrl_jax.evaluation.analyses.context import analysis_units
from agentrl_jax.reproduce import demos as demo_lib
from agentrl_jax.reproduce import sft

DEMO_TASKS_PER_CALL = 32

# Seconds per work unit of each kind of phase on this 2-core CPU, fit on the default run of
# 2026-12-01 (units: PhaseWork.units); the stored run, notebooks/results_cpu_default/
# phases.json (2026-12-03), checks them in the tests. The progress bar
# counts predicted seconds, so its ETA (the rest at the rate so far) holds across phases whose
# cost per unit differs ~10x (counting units, a 1-unit setup of 1.7 s made the first ETA 285 h).
# Only the ratios matter: a faster or slower machine scales them all. An analysis' phase
# (eval:<analysis>) costs its Analysis.unit_seconds.
PHASE_COST = {
    "setup": 1.7,
    "demos": 2.5e-4,
    "warm_start": 2.0e-3,
    "train": 1.7e-3,
    "report": 0.05,
}
DEFAULT_COST = 1e-3
BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}"


def phase_cost(phase: str) -> float:
    """Predicted seconds per unit of ``phase`` (``train:<run>`` as ``train``,
    ``eval:<analysis>`` the analysis' ``unit_seconds``)."""
    if phase.startswith("eval:"):
        return registry.get(phase[5:]).unit_seconds
    return PHASE_COST.get(phase, PHASE_COST.get(phase.split(":")[0], DEFAULT_COST))


@dataclasses.dataclass(frozen=True)
class PhaseWork:
    """The predicted work of the phases of ``config`` (a ``ReproduceConfig``): ``demo_tasks``
    demonstrated tasks, ``test_tasks`` evaluation tasks, the evaluated ``policies``."""

    config: Any
    demo_tasks: int
    test_tasks: int
    policies: Sequence[str]

    @property
    def demo_call_units(self) -> int:
        return DEMO_TASKS_PER_CALL * self.config.warm_start.demos_per_task * self.config.task.t_max

    @property
    def sft_step_units(self) -> int:
        return self.config.warm_start.batch_size * self.config.task.t_max

    @property
    def rl_step_units(self) -> int:
        # a rollout plus an update that costs about as much again
        return (
            2 * self.config.rl.tasks_per_step * self.config.rl.group_size * self.config.task.t_max
        )

    def units(self, phase: str) -> int:
        """Work of a phase in trajectory-turns (the unit of the evaluation's own count)."""
        ws, rl = self.config.warm_start, self.config.rl
        if phase == "demos":
            return demo_lib.demo_calls(self.demo_tasks, DEMO_TASKS_PER_CALL) * self.demo_call_units
        if phase == "warm_start":
            steps = sft.num_sft_steps(
                self.demo_tasks * ws.demos_per_task, ws.batch_size, ws.epochs, ws.group_by_length
            )
            return steps * self.sft_step_units
        if phase.startswith("train:"):
            return rl.steps * self.rl_step_units
        if phase.startswith("eval:"):
            return analysis_units(
                phase[5:], self.config.eval, self.test_tasks, self.policies, self.config.task.t_max
            )
        return 1

    def seconds(self, phase: str) -> float:
        """A phase's predicted seconds: its units at :func:`phase_cost`."""
        return self.units(phase) * phase_cost(phase)


class Progress:
    """The one bar of a reproduction: it counts the predicted seconds (:class:`PhaseWork`) of
    ``phases``, with the phase name, a postfix (e.g. the update count) and the ETA."""

    def __init__(self, work: PhaseWork, phases: Sequence[str], *, enabled: bool, desc: str):
        self.work = work
        self.cost = 1.0  # seconds per unit of the phase running
        # smoothing=0: the rate is all the work so far over all the time so far, so a stall
        # (the first update of a run compiles for ~20 s) does not make the ETA leap
        self.bar = tqdm(
            total=sum(work.seconds(p) for p in phases),
            disable=not enabled,
            dynamic_ncols=True,
            desc=desc,
            bar_format=BAR_FORMAT,
            smoothing=0,
        )
        self._before = 0.0

    def skip(self, phase: str) -> None:
        """``phase`` was done before: all its work at once."""
        self.bar.update(self.work.seconds(phase))

    def start(self, phase: str) -> None:
        self.bar.set_description(phase)
        self.bar.set_postfix_str("")  # the last phase's values leave the bar
        self.cost = phase_cost(phase)
        self._before = self.bar.n

    def advance(self, units: float) -> None:
        """The bar forward by ``units`` of the running phase (at its cost per unit)."""
        self.bar.update(units * self.cost)

    def finish(self, phase: str) -> None:
        """The bar at the end of ``phase``, whatever its own calls added up to."""
        self.bar.update(self.work.seconds(phase) - (self.bar.n - self._before))

    def close(self) -> None:
        self.bar.close()
