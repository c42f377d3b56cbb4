"""The rollout's settings (:class:`RolloutConfig`) and what a rollout returns
(:class:`RolloutResult`, with :class:`RolloutStats`)."""

from __future__ import annotations

import dataclasses
import math

from agentrl_jax.prompts import BudgetPresentation, BudgetPrompt
from agentrl_jax.sampling import SamplingConfig
from agentrl_jax.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are played (validated on construction).

    group_size: ``G`` trajectories per task (paper §4: 16).
    budget: the turn budget ``B`` of every group; None draws one per group with BudgetMix.
    max_response_tokens: the most tokens of one response.
    max_context: tokens of context (KV cache slots) per row.
    record_tokens: ``L``, tokens of the record per row; default ``max_context`` (raise it with a
      history window, whose whole conversation can be longer than any one context).
    history_window: None keeps every past turn in context; ``k`` keeps the last ``k``.
    end_on_invalid: an invalid action ends the row (else it is a no-op and the row goes on).
    invalid_penalty: reward (<= 0) added to a turn whose action is invalid.
    sampling: the sampler's distribution (paper §4: temperature 1 for training rollouts).
    max_rows_per_call: the most rows one policy holds at once (a multiple of ``group_size``);
      a larger batch is played in parts of whole groups, one after another (see the module
      docstring); None plays every row at once.
    adaptive_budgets: with ``budget=None``, BudgetMix draws only budgets each task can meet: none
      below its structural bound (the environment's ``structural_bounds(task_ids)``, e.g.
      FrozenLake's shortest path), ``T_max`` where none is left
      (:func:`~agentrl_jax.algorithms.budgetmix.sample_budgets`).
    refill: with ``max_rows_per_call``, continuous batching instead of parts: the policy holds
      ``max_rows_per_call`` seats, and a seat whose row's episode ended takes the next row
      waiting (its first prompt prefilled at once, :meth:`Policy.restart` where the policy has
      it), so rows at different turns sample together and no seat idles while rows wait.
    enable_thinking: Qwen3's thinking switch in the chat template.
    prompt: the budget-aware wording (§6).
    presentation: how the budget is shown (:class:`~agentrl_jax.prompts.BudgetPresentation`:
      exact, hidden, approximate, or mixed per group); the episode ends after ``B`` turns
      whatever is shown. A mode name or ``{mode, noise, modes}`` is accepted.
    lanes: the seats split into this many lanes, each a cache of its own (the policy and its
      ``fork()``s); while one lane's environment step runs (on a thread of its own), the next
      lane samples, so slow environment steps (Python environments: queries, tests, sandboxes)
      overlap decoding. Each lane's calls hold fewer rows, so it pays where steps are slow
      against sampling, not for FrozenLake's jitted step. A paged cache's ``num_pages`` is
      per lane. Trajectories are the same as with one lane.
    split_processes: with several processes (:mod:`agentrl_jax.distributed`), each plays its
      share of the rows on its own devices and gathers the others' (every process makes the
      same call); nothing changes for one process.
    """

    group_size: int = 16
    budget: int | None = None
    max_response_tokens: int = 256
    max_context: int = 4096
    record_tokens: int | None = None
    history_window: int | None = None
    end_on_invalid: bool = False
    invalid_penalty: float = 0.0
    sampling: SamplingConfig = SamplingConfig()
    enable_thinking: bool = False
    prompt: BudgetPrompt = BudgetPrompt()
    presentation: BudgetPresentation = BudgetPresentation()
    max_rows_per_call: int | None = None
    refill: bool = False
    adaptive_budgets: bool = False
    lanes: int = 1
    split_processes: bool = False

    def __post_init__(self):
        def positive(name: str, optional: bool = False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"RolloutConfig.{name} must be an int >= 1"
                    f"{' or None' if optional else ''}, got {value!r}"
                )

        for name in ("group_size", "max_response_tokens", "max_context"):
            positive(name)
        positive("lanes")
        for name in ("budget", "record_tokens", "history_window", "max_rows_per_call"):
            positive(name, optional=True)
        if self.max_rows_per_call is not None and self.max_rows_per_call % self.group_size:
            raise ValueError(
                f"RolloutConfig.max_rows_per_call must be a multiple of group_size "
                f"({self.group_size}), so groups stay whole, got "
                f"{self.max_rows_per_call}"
            )
        if self.record_tokens is not None and self.record_tokens < self.max_context:
            raise ValueError(
                f"RolloutConfig.record_tokens ({self.record_tokens}) must be >= "
                f"max_context ({self.max_context})"
            )
        for name in (
            "end_on_invalid",
            "enable_thinking",
            "refill",
            "adaptive_budgets",
            "split_processes",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"RolloutConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        penalty = self.invalid_penalty
        if (
            isinstance(penalty, bool)
            or not isinstance(penalty, (int, float))
            or not math.isfinite(penalty)
            or penalty > 0
        ):
            raise ValueError(
                f"RolloutConfig.invalid_penalty must be a finite number <= 0, got {penalty!r}"
            )
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(
                f"RolloutConfig.sampling must be a SamplingConfig, got {self.sampling!r}"
            )
        try:
            presentation = BudgetPresentation.from_value(self.presentation)
        except (ValueError, TypeError) as error:
            raise ValueError(f"RolloutConfig.{error}") from None
        object.__setattr__(self, "presentation", presentation)
        if not isinstance(self.prompt, BudgetPrompt):
            raise ValueError(f"RolloutConfig.prompt must be a BudgetPrompt, got {self.prompt!r}")

    @property
    def record_length(self) -> int:
        return self.record_tokens or self.max_context


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Where a rollout's time went, and how much it did."""

    turns: int  # loop iterations (the longest row's turns)
    live_rows: tuple[int, ...]  # rows that sampled at each turn
    sampled_tokens: int
    policy_s: float  # prefill, decode, cache compaction (blocking)
    env_s: float  # reset, and waiting for steps (parsing included)
    host_s: float  # the rest: templates, tokenizing, decoding, bookkeeping
    total_s: float
    env_step_s: float = 0.0  # steps, wherever they ran: with lanes, more than the
    #                                part of env_s they add (the rest overlapped sampling)

    @property
    def turns_played(self) -> int:
        return int(sum(self.live_rows))


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    trajectory: Trajectory
    responses: list[list[str]]  # [row][turn] decoded response texts (special tokens dropped)
    env_seed: int  # the seed passed to env.reset (replays the dynamics)
    stats: RolloutStats
