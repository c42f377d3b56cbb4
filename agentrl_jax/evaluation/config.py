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
from agentrl_jax.sampling.config import SamplingSettings
from agentrl_jax.validation import (
    BOOL,
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_ROWS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_TURNS,
    Check,
    check_fields,
    integer,
    is_int,
    is_real,
    one_of,
    optional,
    real,
    setting,
    short_repr,
    subsection,
)

_SAMPLES = integer(1, MAX_SAMPLES)  # draws per task or state
_TASKS = optional(integer(1, MAX_COUNT))  # the first N tasks or states (null: all)


def _budgets(v) -> bool:
    return (
        not isinstance(v, (str, bytes))
        and isinstance(v, Sequence)
        and len(v) > 0
        and all(is_int(b, 1) and b <= MAX_TURNS for b in v)
    )


def _depths(v) -> bool:
    return (
        not isinstance(v, (str, bytes))
        and isinstance(v, Sequence)
        and len(v) > 0
        and all(is_real(d) and 0 < d < 1 for d in v)
    )


# the evaluation's decoding (paper §3): temperature 0.6, top-p 0.9
EVAL_SAMPLING = SamplingSettings(temperature=0.6, top_p=0.9)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """How the policies are evaluated: the ``eval`` section of a config (validated on
    construction; paper values in comments). The sampling engine is the config's ``engine``
    section, shared with the training rollouts; ``sampling`` (how the evaluation decodes) is
    the class ``rl.sampling`` is too (:class:`~agentrl_jax.sampling.config.SamplingSettings`).

    ``budgets``: the Pass@T budgets (None: every budget 1..T_max); the Table 1 levels
    (25/50/75/100% of ``T_max``) are always added. ``invalid``: how an unparsable response is
    scored in the step diagnostics
    (:data:`~agentrl_jax.evaluation.state_diagnostics.INVALID_SCORES`).
    """

    # trajectories per task and budget (Pass@T, Table 1)
    samples: int = setting(8, _SAMPLES)
    k: int = setting(8, _SAMPLES)  # k of Pass@(k, T) (paper: 8)
    # Pass@T budgets besides the Table 1 levels (null: 1..T_max)
    budgets: tuple[int, ...] | None = setting(
        (1, 2),
        Check(
            lambda v: v is None or _budgets(v),
            f"null or a non-empty list of ints in [1, {MAX_TURNS}]",
            1,
            MAX_TURNS,
        ),
    )
    # the first N tasks for every analysis but Table 1 / Pass@T (null: all)
    diagnostic_tasks: int | None = setting(32, _TASKS)
    pass_k_samples: int = setting(
        32, _SAMPLES
    )  # per task at T_max for the Pass@K curve (paper: 128)
    states: int = setting(256, integer(2, MAX_COUNT))  # matched state pool per pair (paper: 512)
    group_size: int = setting(8, _SAMPLES)  # actions per state and policy (paper: 16)
    source_samples: int = setting(4, _SAMPLES)  # trajectories per task the states are drawn from
    invalid: str = setting("noop", one_of(INVALID_SCORES))
    depth_bins: int = setting(10, integer(1, MAX_TURNS))
    likelihood_samples: int = setting(4, _SAMPLES)  # trajectories per task and policy for §7.4
    likelihood_rows_per_batch: int = setting(16, integer(1, MAX_ROWS))
    sampling: SamplingSettings = EVAL_SAMPLING  # the evaluation's decoding (paper §3)
    max_response_tokens: int = setting(256, integer(1, MAX_CONTEXT))
    max_context: int = setting(4096, integer(1, MAX_CONTEXT))
    enable_thinking: bool = setting(False, BOOL)
    tasks_per_call: int | None = setting(None, _TASKS)
    states_per_call: int | None = setting(None, _TASKS)
    # memory: the likelihood forward's ("blocked": no [L, L] scores)
    attention: str = setting("xla", one_of(ATTENTION_IMPLEMENTATIONS))
    seed: int = setting(0, integer(0, MAX_SEED))
    # budget presentation (not in the paper, whose prompts always state the budget): every
    # policy's Pass@k with the budget shown each of these ways, at 50% and 100% of T_max, on
    # the first presentation_tasks tasks (null: all)
    presentations: tuple[str, ...] = ("exact", "hidden", "approximate")
    # the approximate budget's relative error bound
    presentation_noise: float = setting(0.25, real(0.0, 1.0, hi_open=True))
    presentation_tasks: int | None = setting(96, _TASKS)
    # the splice analysis: trajectories handed from one policy to another at these
    # normalised depths (the turn round(d T_max)), splice_samples per task
    splice_depths: tuple[float, ...] = setting(
        (0.25, 0.5, 0.75),
        Check(_depths, "a non-empty list of numbers in (0, 1)", 0.0, 1.0),
    )
    splice_tasks: int | None = setting(32, _TASKS)
    splice_samples: int = setting(4, _SAMPLES)

    def __post_init__(self):
        object.__setattr__(
            self,
            "sampling",
            subsection("eval.sampling", SamplingSettings, self.sampling, EVAL_SAMPLING),
        )
        self._check_presentations()
        check_fields("eval", self)
        if self.budgets is not None:
            object.__setattr__(self, "budgets", tuple(sorted({int(b) for b in self.budgets})))
        object.__setattr__(
            self, "splice_depths", tuple(sorted({float(d) for d in self.splice_depths}))
        )
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

    def table_budgets(self, t_max: int) -> tuple[int, ...]:
        """The Pass@T budgets at ``T_max``: :attr:`budgets` (default 1..T_max) and the levels."""
        chosen = range(1, t_max + 1) if self.budgets is None else self.budgets
        if max(chosen) > t_max:
            raise ValueError(f"eval.budgets: must be <= T_max ({t_max}), got {list(chosen)}")
        return tuple(sorted(set(chosen) | set(passk.budget_levels(t_max))))

    def rollout_config(self, valid_vocab_size: int | None = None) -> RolloutConfig:
        """Evaluation rollouts: the paper's decoding, these lengths (group size and budget are
        set per call)."""
        return passt.eval_rollout_config(
            max_response_tokens=self.max_response_tokens,
            max_context=self.max_context,
            sampling=self.sampling.config(valid_vocab_size),
            enable_thinking=self.enable_thinking,
        )
