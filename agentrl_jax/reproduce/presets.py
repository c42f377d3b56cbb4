"""The reproduction's RL runs by name: one table of presets, and runs composed from the registry.

``rl.runs`` lists runs. Each is a preset name of :data:`RUN_PRESETS`, or a mapping::

    {name: gigpo-dapo,            # required: the run's folder (runs/<name>, models/<name>)
     preset: gigpo,               # optional: start from this preset (default: ``name``, if it
                                  # is one)
     label: "GiGPO, DAPO clip",   # optional: the run in tables (default: the preset's, else name)
     budget_mix: false,           # optional: BudgetMix budgets (default: the preset's, else false)
     algorithm: {...}}            # optional: AlgorithmConfig fields over the preset's

A run's :class:`~agentrl_jax.algorithms.AlgorithmConfig` is, field by field, its preset's
(``preset.algorithm(rl)``; the paper's GRPO, ``AlgorithmConfig()``, without a preset), then
``rl.algorithm`` (every run), then the run's own ``algorithm``. A field given replaces the one
before it (``loss_terms`` as a whole list); ``advantage_params`` are kept only while the
``advantage`` stays the same, else they restart from the new estimator's defaults. A loss
term may be written as its registered name alone (``policy_clip``) or as
``{name, coef, params}``. Any registered estimator and term (the built-ins, or a user's
registered from a ``--plugin`` module) can be named, e.g. GiGPO advantages with DAPO's
asymmetric clip::

    --set 'rl.runs=[{name: gigpo-dapo, preset: gigpo, algorithm: {loss_terms:
           [{name: policy_clip, params: {clip_low: 0.2, clip_high: 0.28}},
            {name: kl, coef: 0.001}]}}]'

A preset is a :class:`RunPreset`: a label, an algorithm (a function of the ``rl`` settings,
so the shared hyper-parameters ``rl.clip_low``, ``rl.kl_coef``, ``rl.gigpo_gamma``, ... reach
it) and whether it draws BudgetMix budgets. Add one with :func:`register_run_preset` (e.g.
from a plugin module); nothing else needs to change.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, NamedTuple

from agentrl_jax.algorithms import AlgorithmConfig
from agentrl_jax.errors import ConfigError
from agentrl_jax.train.inputs import check_inputs
from agentrl_jax.validation import short_repr

AlgorithmBuilder = Callable[
    [Any], Mapping[str, Any]
]  # rl settings -> AlgorithmConfig.from_dict data


BUDGET_MIX = (False, True, "adaptive")


class RunPreset(NamedTuple):
    """A named run: its ``label`` in tables, its ``algorithm`` (``rl -> AlgorithmConfig`` data)
    and whether it draws BudgetMix budgets (paper §5): False, True, or ``"adaptive"``: only
    budgets each task can meet (none below its structural bound; the paper's discussion)."""

    label: str
    algorithm: AlgorithmBuilder
    budget_mix: bool | str = False


# ---------------------------------------------------------------- the presets' algorithms


def paper_policy_terms(rl: Any) -> list[dict[str, Any]]:
    """Paper §4: the clipped ratio (``rl.clip_low`` / ``rl.clip_high``) and, if ``rl.kl_coef``
    is positive, the k3 KL to the reference."""
    terms = [
        {"name": "policy_clip", "params": {"clip_low": rl.clip_low, "clip_high": rl.clip_high}}
    ]
    return terms + ([{"name": "kl", "coef": rl.kl_coef}] if rl.kl_coef > 0 else [])


def grpo_algorithm(rl: Any) -> dict[str, Any]:
    """GRPO (paper §4): group-relative advantages, clipped ratio, KL (``rl.aggregation``)."""
    return {
        "advantage": "grpo",
        "aggregation": rl.aggregation,
        "loss_terms": paper_policy_terms(rl),
    }


def gigpo_algorithm(rl: Any) -> dict[str, Any]:
    """GiGPO (paper §4): episode plus anchor-state step advantages (omega, gamma)."""
    return {
        "advantage": "gigpo",
        "advantage_params": {"omega": rl.gigpo_omega, "gamma": rl.gigpo_gamma},
        "aggregation": rl.aggregation,
        "loss_terms": paper_policy_terms(rl),
    }


def ppo_algorithm(rl: Any) -> dict[str, Any]:
    """PPO (paper §4): GAE on a learned critic, clipped ratio, KL, clipped value loss."""
    return {
        "advantage": "gae",
        "advantage_params": {"gamma": rl.gae_gamma, "lam": rl.gae_lambda},
        "aggregation": rl.aggregation,
        "loss_terms": paper_policy_terms(rl)
        + [{"name": "value_clip", "params": {"clip": rl.value_clip}}],
    }


def dapo_algorithm(rl: Any) -> dict[str, Any]:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): GRPO advantages, clip-higher 0.2 / 0.28,
    token-mean, no KL, and dynamic sampling (groups whose rewards are all equal are dropped
    and the batch refilled from up to 4 rollout batches). Its soft overlong punishment is
    off here: over a multi-turn row it would punish taking more turns, which is what the
    paper's budget study varies; turn it on with ``algorithm: {overlong_buffer: 0.2}``
    (``L_cache = 0.2 L_max``, DAPO's 4096 / 20480)."""
    return {
        "advantage": "grpo",
        "aggregation": "token-mean",
        "dynamic_sampling": True,
        "max_rollout_batches": 4,
        "loss_terms": [{"name": "policy_clip", "params": {"clip_low": 0.2, "clip_high": 0.28}}],
    }


def dr_grpo_algorithm(rl: Any) -> dict[str, Any]:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): advantages ``R - mean_g R`` (no std), and
    each row's token losses summed and divided by one constant, the most sampled tokens a
    row can hold (``aggregation_constant`` None: the trainer's ``max_response_length``), then
    averaged over rows; the paper's clip and KL, for comparability with GRPO."""
    return {
        "advantage": "dr_grpo",
        "aggregation": "seq-mean-token-sum",
        "aggregation_constant": None,
        "loss_terms": paper_policy_terms(rl),
    }


def rloo_algorithm(rl: Any) -> dict[str, Any]:
    """RLOO: leave-one-out baseline advantages with the paper's clip and KL."""
    return {
        "advantage": "rloo",
        "aggregation": rl.aggregation,
        "loss_terms": paper_policy_terms(rl),
    }


def gspo_algorithm(rl: Any) -> dict[str, Any]:
    """GSPO (Zheng et al. 2025): GRPO advantages, sequence-level clipped ratio (its default
    clips)."""
    return {"advantage": "grpo", "loss_terms": [{"name": "gspo_clip"}]}


RUN_PRESETS: dict[str, RunPreset] = {
    "grpo": RunPreset("GRPO", grpo_algorithm),
    "budgetmix": RunPreset("BudgetMix GRPO", grpo_algorithm, True),
    "budgetmix-adaptive": RunPreset("Adaptive BudgetMix GRPO", grpo_algorithm, "adaptive"),
    "gigpo": RunPreset("GiGPO", gigpo_algorithm),
    "gigpo-budgetmix": RunPreset("BudgetMix GiGPO", gigpo_algorithm, True),
    "ppo": RunPreset("PPO", ppo_algorithm),
    "ppo-budgetmix": RunPreset("BudgetMix PPO", ppo_algorithm, True),
    "dapo": RunPreset("DAPO", dapo_algorithm),
    "dapo-budgetmix": RunPreset("BudgetMix DAPO", dapo_algorithm, True),
    "dr-grpo": RunPreset("Dr. GRPO", dr_grpo_algorithm),
    "rloo": RunPreset("RLOO", rloo_algorithm),
    "gspo": RunPreset("GSPO", gspo_algorithm),
}


def register_run_preset(
    name: str, *, label: str, algorithm: AlgorithmBuilder, budget_mix: bool | str = False
) -> RunPreset:
    """Adds a preset to :data:`RUN_PRESETS` (``rl.runs`` can then name it); refuses a taken name."""
    if not (isinstance(name, str) and RUN_NAME.fullmatch(name)) or name in RESERVED_NAMES:
        raise ValueError(
            f"run preset name: must match {RUN_NAME.pattern} and not be one of "
            f"{RESERVED_NAMES}, got {name!r}"
        )
    if name in RUN_PRESETS:
        raise ValueError(f"run preset {name!r} is already registered")
    if not callable(algorithm):
        raise ValueError(f"run preset {name!r}: algorithm must be a function of the rl settings")
    if budget_mix not in BUDGET_MIX:
        raise ValueError(
            f"run preset {name!r}: budget_mix must be true, false or 'adaptive', got {budget_mix!r}"
        )
    RUN_PRESETS[name] = RunPreset(label, algorithm, budget_mix)
    return RUN_PRESETS[name]


# ---------------------------------------------------------------- resolving rl.runs

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # a folder name
RESERVED_NAMES = ("init", "base")  # models/init, models/base are the reproduction's own
BASE_LABEL = "base"  # the warm-started policy's name in the evaluation
RUN_FIELDS = ("name", "preset", "label", "budget_mix", "algorithm")
ALGORITHM_FIELDS = tuple(f.name for f in dataclasses.fields(AlgorithmConfig))


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """One resolved run of ``rl.runs``: its folder name, label, BudgetMix and algorithm."""

    name: str
    label: str
    budget_mix: bool | str  # False, True or "adaptive"
    algorithm: AlgorithmConfig


def _is_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)


def check_algorithm_overrides(where: str, value: Any) -> dict[str, Any]:
    """``value`` as a dict of AlgorithmConfig fields; ConfigError naming ``where`` otherwise."""
    if not _is_mapping(value):
        raise ConfigError(
            f"{where}: must be a mapping of AlgorithmConfig fields "
            f"({', '.join(ALGORITHM_FIELDS)}), got {short_repr(value)}"
        )
    unknown = sorted(set(value) - set(ALGORITHM_FIELDS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r}; known: {', '.join(ALGORITHM_FIELDS)}"
        )
    return dict(value)


def _loss_term(term: Any) -> Any:
    return {"name": term} if isinstance(term, str) else term


def merge_algorithm(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s fields (see the module docstring; pure)."""
    merged = dict(base)
    if "advantage" in override and override["advantage"] != base.get(
        "advantage", AlgorithmConfig.advantage
    ):
        merged.pop("advantage_params", None)
    merged.update(override)
    if isinstance(merged.get("loss_terms"), (list, tuple)):
        merged["loss_terms"] = [_loss_term(t) for t in merged["loss_terms"]]
    return merged


def build_algorithm(where: str, data: Mapping[str, Any]) -> AlgorithmConfig:
    """``AlgorithmConfig.from_dict(data)``, checked against what the train step computes
    (:func:`~agentrl_jax.train.inputs.check_inputs`); errors as ConfigError naming ``where``."""
    try:
        algorithm = AlgorithmConfig.from_dict(data)
    except (ValueError, TypeError) as error:  # TypeError: a malformed value deep in a term's params
        raise ConfigError(f"{where}: {error}") from None
    try:
        check_inputs(algorithm)
    except ValueError as error:
        raise ConfigError(f"{where}.{error}") from None
    return algorithm


def _entry_fields(where: str, entry: Any) -> dict[str, Any]:
    if isinstance(entry, str):
        if entry not in RUN_PRESETS:
            raise ConfigError(
                f"{where}: unknown run preset {entry!r}; presets: {', '.join(RUN_PRESETS)} "
                "(or a mapping {name, preset, label, budget_mix, algorithm})"
            )
        return {"name": entry}
    if not _is_mapping(entry):
        raise ConfigError(
            f"{where}: must be a preset name ({', '.join(RUN_PRESETS)}) or a mapping "
            f"{{name, preset, label, budget_mix, algorithm}}, got {short_repr(entry)}"
        )
    unknown = sorted(set(entry) - set(RUN_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(RUN_FIELDS)}")
    if "name" not in entry:
        raise ConfigError(f"{where}: needs a name (its folder under runs/ and models/)")
    return dict(entry)


def resolve_run(where: str, entry: Any, rl: Any) -> RunSettings:
    """One ``rl.runs`` entry (a preset name or a mapping) as :class:`RunSettings`; ``rl``: the
    section (its ``algorithm`` overrides and shared hyper-parameters)."""
    fields = _entry_fields(where, entry)
    name = fields["name"]
    if not (isinstance(name, str) and RUN_NAME.fullmatch(name)) or name in RESERVED_NAMES:
        raise ConfigError(
            f"{where}.name: must be a folder name ({RUN_NAME.pattern}) other than "
            f"{' and '.join(RESERVED_NAMES)}, got {short_repr(name)}"
        )
    preset_name = fields.get("preset", name if name in RUN_PRESETS else None)
    if preset_name is not None and (
        not isinstance(preset_name, str) or preset_name not in RUN_PRESETS
    ):
        raise ConfigError(
            f"{where}.preset: must be one of {', '.join(RUN_PRESETS)}, "
            f"got {short_repr(preset_name)}"
        )
    preset = RUN_PRESETS.get(preset_name)
    label = fields.get("label", preset.label if preset else name)
    if not (isinstance(label, str) and label.strip()):
        raise ConfigError(f"{where}.label: must be a non-empty string, got {short_repr(label)}")
    budget_mix = fields.get("budget_mix", preset.budget_mix if preset else False)
    if not (isinstance(budget_mix, bool) or budget_mix == "adaptive"):
        raise ConfigError(
            f"{where}.budget_mix: must be true, false or adaptive, got {short_repr(budget_mix)}"
        )
    data = dict(preset.algorithm(rl)) if preset else {}
    for override in (
        rl.algorithm,
        check_algorithm_overrides(f"{where}.algorithm", fields.get("algorithm", {})),
    ):
        data = merge_algorithm(data, override)
    return RunSettings(name, label, budget_mix, build_algorithm(f"{where}.algorithm", data))


def resolve_runs(rl: Any) -> tuple[RunSettings, ...]:
    """Every entry of ``rl.runs``, resolved; names and labels must be distinct."""
    runs = tuple(resolve_run(f"rl.runs[{i}]", entry, rl) for i, entry in enumerate(rl.runs))
    for field in ("name", "label"):
        values = [getattr(r, field) for r in runs]
        twice = next((v for v in values if values.count(v) > 1), None)
        if twice is not None:
            raise ConfigError(
                f"rl.runs: two runs have the {field} {twice!r}; {field}s must be distinct"
            )
    if any(r.label == BASE_LABEL for r in runs):
        raise ConfigError(
            f"rl.runs: a run's label may not be {BASE_LABEL!r} (the warm-started policy's)"
        )
    return runs
