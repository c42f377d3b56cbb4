"""How the reproduction evaluates its policies: :class:`EvalSettings` (the ``eval`` section of a
reproduction config, validated on construction) and the work each analysis does
(:func:`analysis_units`, for a progress bar). :mod:`.evaluate` runs the
analyses.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Sequence

from agentrl_jax.errors import ConfigError
from agentrl_jax.evaluation import passk, passt
from agentrl_jax.evaluation.drivers import rollout_units
from agentrl_jax.evaluation.state_diagnostics import INVALID_SCORES
from agentrl_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from agentrl_jax.reproduce.results import ANALYSES
from agentrl_jax.rollout import RolloutConfig
from agentrl_jax.sampling import SamplingConfig
from agentrl_jax.validation import (
    BOOL,
    Check,
    integer,
    is_int,
    is_real,
    one_of,
    optional,
    short_repr,
    validate,
)


def _in_range(lo: float, hi: float | None = None, lo_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: is_real(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)


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
    "gamma": (_in_range(0.0, 1.0), "a number in [0, 1]"),
    "temperature": (_in_range(0.0), "a number >= 0"),
    "top_p": (_in_range(0.0, 1.0, lo_open=True), "a number in (0, 1]"),
    "invalid": one_of(INVALID_SCORES),
    "enable_thinking": BOOL,
    "tasks_per_call": optional(_COUNT),
    "states_per_call": optional(_COUNT),
    "diagnostic_tasks": optional(_COUNT),
    "prefill_chunk": optional(_COUNT),
    "kv_cache_dtype": (
        lambda v: v is None or one_of(("float32", "bfloat16"))[0](v),
        "null, float32 or bfloat16",
    ),
    "attention": one_of(ATTENTION_IMPLEMENTATIONS),
    "kv_page_size": optional(_COUNT),
}


# The page size of the paged KV cache the reproduction and evaluation use by default (rl too;
# `agentrl-jax eval --kv-page-size` repeats it, to keep jax out of the CLI's start-up).
KV_PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How the policies are evaluated (validated on construction; paper values in comments).

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
    gamma: float = 0.95  # discount of Q* (paper §7)
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
    prefill_chunk: int | None = (
        None  # memory: prompts enter the KV cache this many tokens at a time
    )
    kv_cache_dtype: str | None = None  # memory: the KV cache's dtype (null: the compute dtype)
    attention: str = (
        "xla"  # memory: the likelihood forward's attention ("blocked": no [L, L] scores)
    )
    # rollouts on the paged KV cache, pages of that many tokens (null: the static cache)
    kv_page_size: int | None = KV_PAGE_SIZE
    seed: int = 0

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
        validate("eval", self, _CHECKS)
        if self.k > self.samples:
            raise ConfigError(f"eval.k: must be <= eval.samples ({self.samples}), got {self.k}")

    def analysis_tasks(self, name: str, task_ids: Sequence[int]) -> Sequence[int]:
        """The tasks analysis ``name`` plays: all of ``task_ids`` for ``table`` (Table 1 and
        Pass@T, whose intervals need every task), the first :attr:`diagnostic_tasks` for the
        others (the Pass@K curve, the state pools, the likelihood), whose sample sizes are
        their own settings."""
        if name == "table" or self.diagnostic_tasks is None:
            return task_ids
        return task_ids[: self.diagnostic_tasks]

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


# ---------------------------------------------------------------- work units (progress)


def _policy_count(policies: int | Sequence[str]) -> int:
    return policies if isinstance(policies, numbers.Integral) else len(policies)


def analysis_units(
    name: str, settings: EvalSettings, num_tasks: int, policies: int | Sequence[str], t_max: int
) -> int:
    """Work units of one analysis for a progress bar: trajectory-turns it may play (and, for
    ``likelihood``, score), ``1`` for ``dynamics``. :func:`run_analysis` reports exactly this
    many through ``progress``, in steps as its rollouts finish."""
    p, s = _policy_count(policies), settings
    num_tasks = len(s.analysis_tasks(name, range(num_tasks)))
    sources = p * rollout_units(num_tasks, s.source_samples, t_max)
    pairs = p - 1
    units = {
        "table": lambda: (
            p * sum(rollout_units(num_tasks, s.samples, b) for b in s.table_budgets(t_max))
        ),
        "passk": lambda: p * rollout_units(num_tasks, s.pass_k_samples, t_max),
        "steps": lambda: sources + pairs * 2 * rollout_units(s.states, s.group_size, 1),
        "errors": lambda: sources + pairs * 2 * rollout_units(s.states, s.group_size, t_max),
        "likelihood": lambda: (
            (p + pairs * 2) * rollout_units(num_tasks, s.likelihood_samples, t_max)
        ),
        "dynamics": lambda: 1,
    }
    if name not in units:
        raise ValueError(f"unknown analysis {name!r}; known: {', '.join(ANALYSES)}")
    return units[name]()
