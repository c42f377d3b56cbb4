"""The evaluation's settings: :class:`EvalConfig`, the ``eval`` section of a config (how many
samples each analysis draws, the evaluation decoding and lengths, the state pools' sizes)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from agentrl_jax.errors import ConfigError
from agentrl_jax.evaluation import passk, passt
from agentrl_jax.evaluation.state_diagnostics import INVALID_SCORES
from agentrl_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from agentrl_jax.prompts import PRESENTATIONS
from agentrl_jax.rollout import RolloutConfig
from agentrl_jax.sampling import SamplingConfig
from agentrl_jax.validation import (
    BOOL,
    Check,
    integer,
    is_int,
    one_of,
    optional,
    real,
    short_repr,
    validate,
)

_COUNT = integer(1)
_CHECKS: dict[str, Check] = {
    **{
        name: _COUNT
        for name in (
            "samples",
            "k",
            "pass_k_samples",
            "group_size",
            "source_samples",
            "depth_bins",
            "likelihood_samples",
            "likelihood_rows_per_batch",
            "max_response_tokens",
            "max_context",
        )
    },
    "states": integer(2),
    "seed": integer(0),
    "temperature": (real(0.0)[0], "a number >= 0"),
    "top_p": (real(0.0, 1.0, lo_open=True)[0], "a number in (0, 1]"),
    "invalid": one_of(INVALID_SCORES),
    "enable_thinking": BOOL,
    "tasks_per_call": optional(_COUNT),
    "states_per_call": optional(_COUNT),
    "diagnostic_tasks": optional(_COUNT),
    "attention": one_of(ATTENTION_IMPLEMENTATIONS),
    "presentation_noise": (lambda v: real(0.0, 1.0)[0](v) and v < 1, "a number in [0, 1)"),
    "presentation_tasks": optional(_COUNT),
    "splice_tasks": optional(_COUNT),
    "splice_samples": _COUNT,
}


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """How the policies are evaluated: the ``eval`` section of a config (validated on
    construction; paper values in comments). The sampling engine is the config's ``engine``
    section, shared with the training rollouts.

    ``budgets``: the Pass@T budgets (None: every budget 1..T_max); the Table 1 levels
    (25/50/75/100% of ``T_max``) are always added. ``invalid``: how an unparsable response is
    scored in the step diagnostics
    (:data:`~agentrl_jax.evaluation.state_diagnostics.INVALID_SCORES`).
    """

    samples: int = 8  # trajectories per task and budget (Pass@T, Table 1)
    k: int = 8  # k of Pass@(k, T) (paper: 8)
    budgets: tuple[int, ...] | None = (
        1,
        2,
    )  # Pass@T budgets besides the Table 1 levels (null: 1..T_max)
    diagnostic_tasks: int | None = (
        32  # the first N tasks for every analysis but Table 1 / Pass@T (null: all)
    )
    pass_k_samples: int = 32  # per task at T_max for the Pass@K curve (paper: 128)
    states: int = 256  # matched state pool per pair (paper: 512)
    group_size: int = 8  # actions per state and policy (paper: 16)
    source_samples: int = 4  # trajectories per task the states are drawn from
    invalid: str = "noop"
    depth_bins: int = 10
    likelihood_samples: int = 4  # trajectories per task and policy for §7.4
    likelihood_rows_per_batch: int = 16
    temperature: float = 0.6  # evaluation decoding (paper §3)
    top_p: float = 0.9
    max_response_tokens: int = 256
    max_context: int = 4096
    enable_thinking: bool = False
    tasks_per_call: int | None = None
    states_per_call: int | None = None
    attention: str = "xla"  # memory: the likelihood forward's ("blocked": no [L, L] scores)
    seed: int = 0
    # budget presentation (not in the paper, whose prompts always state the budget): every
    # policy's Pass@k with the budget shown each of these ways, at 50% and 100% of T_max, on
    # the first presentation_tasks tasks (null: all)
    presentations: tuple[str, ...] = ("exact", "hidden", "approximate")
    presentation_noise: float = 0.25  # the approximate budget's relative error bound
    presentation_tasks: int | None = 96
    # the splice analysis: trajectories handed from one policy to another at these
    # normalised depths (the turn round(d T_max)), splice_samples per task
    splice_depths: tuple[float, ...] = (0.25, 0.5, 0.75)
    splice_tasks: int | None = 32
    splice_samples: int = 4

    def __post_init__(self):
        if self.budgets is not None:
            if (
                isinstance(self.budgets, (str, bytes))
                or not isinstance(self.budgets, Sequence)
                or not self.budgets
                or not all(is_int(b, 1) for b in self.budgets)
            ):
                raise ConfigError(
                    f"eval.budgets: must be null or a non-empty list of ints >= 1, "
                    f"got {short_repr(self.budgets)}"
                )
            object.__setattr__(self, "budgets", tuple(sorted({int(b) for b in self.budgets})))
        self._check_presentations()
        self._check_depths()
        validate("eval", self, _CHECKS)
        if self.k > self.samples:
            raise ConfigError(f"eval.k: must be <= eval.samples ({self.samples}), got {self.k}")

    def _check_presentations(self) -> None:
        value = self.presentations
        if (
            isinstance(value, (str, bytes))
            or not isinstance(value, Sequence)
            or "exact" not in value
            or any(m not in PRESENTATIONS for m in value)
            or len(set(value)) != len(value)
        ):
            raise ConfigError(
                f"eval.presentations: must be a list of distinct presentations of "
                f"{list(PRESENTATIONS)} holding exact (the reference), got {short_repr(value)}"
            )
        object.__setattr__(self, "presentations", tuple(value))

    def _check_depths(self) -> None:
        value = self.splice_depths
        if (
            isinstance(value, (str, bytes))
            or not isinstance(value, Sequence)
            or not value
            or not all(isinstance(d, (int, float)) and not isinstance(d, bool) for d in value)
            or not all(0 < d < 1 for d in value)
        ):
            raise ConfigError(
                f"eval.splice_depths: must be a non-empty list of numbers in (0, 1), got "
                f"{short_repr(value)}"
            )
        object.__setattr__(self, "splice_depths", tuple(sorted({float(d) for d in value})))

    def analysis_tasks(self, name: str, task_ids: Sequence[int]) -> Sequence[int]:
        """The tasks analysis ``name`` plays: all of ``task_ids`` for ``table`` (Table 1 and
        Pass@T, whose intervals need every task), the first :attr:`presentation_tasks` and
        :attr:`splice_tasks` for ``presentation`` and ``splice``, the first
        :attr:`diagnostic_tasks` for the others (the Pass@K curve, the state pools, the
        likelihood, the erosion), whose sample sizes are their own settings."""
        count = {
            "table": None,
            "presentation": self.presentation_tasks,
            "splice": self.splice_tasks,
        }.get(name, self.diagnostic_tasks)
        return task_ids if count is None else task_ids[:count]

    def table_budgets(self, t_max: int) -> tuple[int, ...]:
        """The Pass@T budgets at ``T_max``: :attr:`budgets` (default 1..T_max) and the levels."""
        chosen = range(1, t_max + 1) if self.budgets is None else self.budgets
        if max(chosen) > t_max:
            raise ValueError(f"eval.budgets: must be <= T_max ({t_max}), got {list(chosen)}")
        return tuple(sorted(set(chosen) | set(passk.budget_levels(t_max))))

    def rollout_config(self, valid_vocab_size: int | None = None) -> RolloutConfig:
        """Evaluation rollouts: the paper's decoding, these lengths (group size and budget are
        set per call)."""
        sampling = SamplingConfig(
            temperature=self.temperature, top_p=self.top_p, valid_vocab_size=valid_vocab_size
        )
        return passt.eval_rollout_config(
            max_response_tokens=self.max_response_tokens,
            max_context=self.max_context,
            sampling=sampling,
            enable_thinking=self.enable_thinking,
        )
