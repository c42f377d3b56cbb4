"""The step diagnostics' states and scores for one environment (PAPER.md §7.1-7.3): what the
``steps`` and ``errors`` analyses (:mod:`agentrl_jax.evaluation.analyses.step_quality`,
:mod:`~agentrl_jax.evaluation.analyses.error_recovery`) ask of it.

An environment's study supplies one
(:meth:`agentrl_jax.reproduce.studies.Study.state_diagnostics`); nothing here knows which
environment it serves. Two kinds exist:

* :class:`RecordedQualityStates` (here; any Python environment that scores its turns, e.g.
  DeepCoder-MT's test pass share): a state is a task and the responses played so far; a
  response's quality is the environment's score of it there
  (:mod:`~agentrl_jax.evaluation.text_states`); an error is a response the study supplies
  (for code, the reference program mutated to fail a test).
* an environment's own, e.g. FrozenLake's exact Q* on the cells of its maps
  (:class:`agentrl_jax.reproduce.studies.frozenlake.diagnostics.QStarStates`).

Both answer the same calls, in the order the analyses make them::

    pools = states.visits(play, policies, key, samples=..., budget=...)  # {policy: pool}
    pool = states.matched(pools[base], pools[other], size=..., seed=...)
    result, record = states.steps(play, pool, base, other, key, names=..., settings=...)
    result, record = states.errors(play, pool, base, other, key, names=..., settings=...)

``result`` has ``pools()``, ``invalid_share()``, ``names``, ``pool`` (``turn``) and
``quality`` for the step-quality and depth analyses (an error result: ``quality``, ``success``,
``overflow`` and ``paired_success()``); ``record`` is what ``raw/<analysis>.json`` keeps of
the pair (its ``quality`` and, for errors, ``success``: ``{policy: [S] / [E, G]}``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

from agentrl_jax.evaluation import drivers, passt
from agentrl_jax.evaluation.text_states import (
    ErrorReply,
    TextStateStarts,
    concat_text_pools,
    inject_text_errors,
    matched_text_pool,
    text_error_states,
    text_step_quality,
    visited_text_states,
)
from agentrl_jax.sampling import Policy

INVALID_SCORES = ("noop", "zero")
"""How an unparsable response is scored in the step diagnostics (``eval.invalid``): as the
no-op it is played as, or 0."""


def columns(pool: Any, names: tuple[str, str]) -> dict[str, Any]:
    """The pool's columns with ``source`` as the policy name."""
    columns = pool.to_columns()
    columns["source"] = [names[s] if s >= 0 else "" for s in pool.source]
    return columns


@dataclasses.dataclass
class RecordedQualityStates:
    """Text states of the Python environment ``env`` scored by the environment itself (the
    module docstring). ``error_reply(task_id, rng)`` gives the erroneous response injected
    at error states (None: the task has none); the notes word the report."""

    env: Any
    error_reply: ErrorReply
    quality_name: str = "step quality"
    quality_symbol: str = "step quality"
    suite: str = "error-recovery/v1"
    error_note: str = "one injected erroneous response"
    success_note: str = "solving the task within the remaining budget"
    workers: int = 8
    # the span of a response the action is read from (the erosion's action tokens; None:
    # every response token is "other")
    action_pattern: str | None = None
    action_note: str = "the span the environment reads the action from"

    def invalid_note(self, settings: Any) -> str:
        del settings
        return "scored by the environment"

    def visits(
        self,
        play: drivers.Play,
        policies: Mapping[str, Policy],
        key: jax.Array,
        *,
        samples: int,
        budget: int,
    ) -> dict[str, Any]:
        """Every policy's visited states (:func:`visited_text_states`) from ``samples``
        trajectories per task at ``budget``: the calls of :func:`passt.rollout_tasks`, kept
        with their response texts."""
        runner = passt._runner(play.env, play.tokenizer, budget, samples, play.config)
        out = {}
        for name, policy in policies.items():
            play.echo(f"Source trajectories: {name}, {play.tasks} tasks x {samples} at T={budget}")
            parts = []
            for call, chunk, real in passt._calls(
                np.asarray(play.task_ids, np.int64), play.tasks_per_call
            ):
                result = runner(policy, chunk, jax.random.fold_in(key, call))
                parts.append(visited_text_states(result, rows=real * samples))
            out[name] = concat_text_pools(parts)
            play.progress(drivers.rollout_units(play.tasks, samples, budget))
        return out

    def matched(self, base: Any, other: Any, *, size: int, seed: int) -> Any:
        return matched_text_pool(base, other, size=size, seed=seed)

    def _starts(self, play: drivers.Play, pool: Any, group_size: int) -> TextStateStarts:
        return TextStateStarts(
            self.env,
            play.tokenizer,
            pool,
            dataclasses.replace(play.config, group_size=group_size),
            states_per_call=play.states_per_call,
            workers=self.workers,
        )

    def steps(
        self,
        play: drivers.Play,
        pool: Any,
        base: Policy,
        rl: Policy,
        key: jax.Array,
        *,
        names: tuple[str, str],
        settings: Any,
    ) -> tuple[Any, dict[str, Any]]:
        starts = self._starts(play, pool, settings.group_size)
        try:
            result = text_step_quality(starts, base, rl, key, names=names)
        finally:
            starts.close()
        return result, {
            "states": columns(result.pool, names),
            "offered": len(pool),
            "samples": result.samples,
            "valid": result.valid,
            "quality": result.quality,
        }

    def errors(
        self,
        play: drivers.Play,
        pool: Any,
        base: Policy,
        rl: Policy,
        key: jax.Array,
        *,
        names: tuple[str, str],
        settings: Any,
    ) -> tuple[Any, dict[str, Any]]:
        errors = inject_text_errors(pool, self.error_reply, seed=settings.seed)
        if len(errors.states) == 0:
            raise ValueError(
                f"errors: no state of the {names} pool admits an error reply with a turn left"
            )
        starts = self._starts(play, errors.states, settings.group_size)
        try:
            result = text_error_states(starts, errors, base, rl, key, names=names)
        finally:
            starts.close()
        kept = result.errors
        return result, {
            "states": columns(kept.states, names),
            "offered": len(errors.states),
            "origin": kept.origin,
            "injected_reply": list(kept.reply),
            "samples": result.quality.samples,
            "valid": result.quality.valid,
            "quality": result.quality.quality,
            "success": result.success,
            "overflow": result.overflow,
        }
