"""Runs by name: presets that declare their hyper-parameters, and runs composed from the
registry.

``rl.runs`` lists the runs to train. Each is a preset name of :data:`RUN_PRESETS`, or a
mapping::

    {name: gigpo-dapo,            # required: the run's folder (runs/<name>, models/<name>)
     preset: gigpo,               # optional: start from this preset (default: ``name``, if one)
     label: "GiGPO, DAPO clip",   # optional: the run in tables (default: the preset's, else name)
     budget_mix: false,           # optional: BudgetMix budgets (default: the preset's, else false)
     presentation: exact,         # optional: how the budget is shown (default: the preset's,
                                  #   else exact; prompts.BudgetPresentation: a mode or
                                  #   {mode, noise, modes}; "mixed" draws one per group)
     params: {gigpo_omega: 0.5},  # optional: the preset's hyper-parameters for this run
     algorithm: {...}}            # optional: AlgorithmConfig fields over the preset's

A preset (:class:`RunPreset`) is a label, the hyper-parameters it declares (each a
:class:`~agentrl_jax.algorithms.Param`: default, check), a function of their values that
gives the run's :class:`~agentrl_jax.algorithms.AlgorithmConfig` data, and whether it draws
BudgetMix budgets (§5). A hyper-parameter's value is the preset's default, then
``rl.preset_params`` (shared by every run whose preset declares it, e.g. ``kl_coef`` for all
the GRPO-family runs; a name no run declares is refused), then the run's own ``params``.
The built-in presets declare the paper's hyper-parameters (§4) with the paper's defaults:
``clip_low``, ``clip_high`` (the ratio clip; ``clip_high`` > ``clip_low`` is DAPO's
clip-higher), ``kl_coef`` (0: no KL term), ``aggregation``, and GiGPO's ``gigpo_omega`` and
``gigpo_gamma``, PPO's ``gae_gamma``, ``gae_lambda`` and ``value_clip``.

The run's algorithm is then, field by field, the preset's (the paper's GRPO,
``AlgorithmConfig()``, without a preset), ``rl.algorithm`` (every run), then the run's own
``algorithm``. A field given replaces the one before it (``loss_terms`` as a whole list);
``advantage_params`` are kept only while the ``advantage`` stays the same. A loss term may be
written as its registered name alone (``policy_clip``) or as ``{name, coef, params}``, so
any registered estimator and term (a user's too, from a ``--plugin`` module) can be named::

    --set 'rl.runs=[{name: gigpo-dapo, preset: gigpo, algorithm: {loss_terms:
           [{name: policy_clip, params: {clip_low: 0.2, clip_high: 0.28}},
            {name: kl, coef: 0.001}]}}]'

Add a preset with :func:`register_run_preset` (e.g. from a plugin module); nothing else needs
to change. Nothing here is keyed on a preset's name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from agentrl_jax.algorithms import AGGREGATION_MODES, AlgorithmConfig, Param
from agentrl_jax.errors import ConfigError, did_you_mean
from agentrl_jax.prompts import BudgetPresentation
from agentrl_jax.train.inputs import check_inputs
from agentrl_jax.validation import is_real, short_repr

AlgorithmBuilder = Callable[[Mapping[str, Any]], Mapping[str, Any]]  # params -> algorithm data

BUDGET_MIX = (False, True, "adaptive")


class RunPreset(NamedTuple):
    """A named run: its ``label`` in tables, its ``algorithm`` (a function of the values of
    the hyper-parameters it declares in ``params``, giving ``AlgorithmConfig.from_dict``
    data), whether it draws BudgetMix budgets (paper §5): False, True, or ``"adaptive"``:
    only budgets each task can meet (none below its structural bound), and how its rollouts
    show the budget (``presentation``: a :class:`~agentrl_jax.prompts.BudgetPresentation`
    mode, default exact)."""

    label: str
    algorithm: AlgorithmBuilder
    budget_mix: bool | str = False
    params: Mapping[str, Param] = {}
    presentation: str = "exact"


# ---------------------------------------------------------------- the paper's hyper-parameters

_REAL_0_1_OPEN = (lambda v: is_real(v) and 0 < v < 1, "a finite number > 0 and < 1")
CLIP = {
    "clip_low": Param(0.2, _REAL_0_1_OPEN[0], _REAL_0_1_OPEN[1]),
    "clip_high": Param(0.2, lambda v: is_real(v) and v > 0, "a finite number > 0"),
}
POLICY = {  # paper §4: the clipped ratio and the KL to the reference
    **CLIP,
    "kl_coef": Param(0.001, lambda v: is_real(v) and v >= 0, "a finite number >= 0 (0: no KL)"),
}
AGGREGATION = {
    "aggregation": Param(
        "token-mean", lambda v: v in AGGREGATION_MODES, f"one of {AGGREGATION_MODES}"
    )
}
_UNIT = (lambda v: is_real(v) and 0 <= v <= 1, "a number in [0, 1]")
GIGPO = {
    "gigpo_omega": Param(1.0, lambda v: is_real(v) and v >= 0, "a finite number >= 0"),
    "gigpo_gamma": Param(0.95, *_UNIT),
}
PPO = {
    "gae_gamma": Param(1.0, *_UNIT),
    "gae_lambda": Param(1.0, *_UNIT),
    "value_clip": Param(0.5, lambda v: is_real(v) and v > 0, "a finite number > 0"),
}


def paper_policy_terms(p: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Paper §4: the clipped ratio (``clip_low`` / ``clip_high``) and, if ``kl_coef`` is
    positive, the k3 KL to the reference."""
    terms = [
        {"name": "policy_clip", "params": {"clip_low": p["clip_low"], "clip_high": p["clip_high"]}}
    ]
    return terms + ([{"name": "kl", "coef": p["kl_coef"]}] if p["kl_coef"] > 0 else [])


def grpo_algorithm(p: Mapping[str, Any]) -> dict[str, Any]:
    """GRPO (paper §4): group-relative advantages, clipped ratio, KL (``aggregation``)."""
    return {
        "advantage": "grpo",
        "aggregation": p["aggregation"],
        "loss_terms": paper_policy_terms(p),
    }


def gigpo_algorithm(p: Mapping[str, Any]) -> dict[str, Any]:
    """GiGPO (paper §4): episode plus anchor-state step advantages (omega, gamma)."""
    return {
        "advantage": "gigpo",
        "advantage_params": {"omega": p["gigpo_omega"], "gamma": p["gigpo_gamma"]},
        "aggregation": p["aggregation"],
        "loss_terms": paper_policy_terms(p),
    }


def ppo_algorithm(p: Mapping[str, Any]) -> dict[str, Any]:
    """PPO (paper §4): GAE on a learned critic, clipped ratio, KL, clipped value loss."""
    return {
        "advantage": "gae",
        "advantage_params": {"gamma": p["gae_gamma"], "lam": p["gae_lambda"]},
        "aggregation": p["aggregation"],
        "loss_terms": paper_policy_terms(p)
        + [{"name": "value_clip", "params": {"clip": p["value_clip"]}}],
    }


def dapo_algorithm(p: Mapping[str, Any]) -> dict[str, Any]:
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


def dr_grpo_algorithm(p: Mapping[str, Any]) -> dict[str, Any]:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): advantages ``R - mean_g R`` (no std), and
    each row's token losses summed and divided by one constant, the most sampled tokens a
    row can hold (``aggregation_constant`` None: the trainer's ``max_response_length``), then
    averaged over rows; the paper's clip and KL, for comparability with GRPO."""
    return {
        "advantage": "dr_grpo",
        "aggregation": "seq-mean-token-sum",
        "aggregation_constant": None,
        "loss_terms": paper_policy_terms(p),
    }


def rloo_algorithm(p: Mapping[str, Any]) -> dict[str, Any]:
    """RLOO: leave-one-out baseline advantages with the paper's clip and KL."""
    return {
        "advantage": "rloo",
        "aggregation": p["aggregation"],
        "loss_terms": paper_policy_terms(p),
    }


def gspo_algorithm(p: Mapping[str, Any]) -> dict[str, Any]:
    """GSPO (Zheng et al. 2025): GRPO advantages, sequence-level clipped ratio (its default
    clips)."""
    return {"advantage": "grpo", "loss_terms": [{"name": "gspo_clip"}]}


_GRPO, _GIGPO, _PPO = (
    {**POLICY, **AGGREGATION},
    {**POLICY, **AGGREGATION, **GIGPO},
    {
        **POLICY,
        **AGGREGATION,
        **PPO,
    },
)
RUN_PRESETS: dict[str, RunPreset] = {
    "grpo": RunPreset("GRPO", grpo_algorithm, False, _GRPO),
    "budgetmix": RunPreset("BudgetMix GRPO", grpo_algorithm, True, _GRPO),
    "budgetmix-adaptive": RunPreset("Adaptive BudgetMix GRPO", grpo_algorithm, "adaptive", _GRPO),
    # BudgetMix that also randomises how the budget is shown, per group (exact, hidden,
    # approximate): a policy that must not lean on the budget line being there or exact
    "budgetmix-presentation": RunPreset(
        "Presentation-mixed BudgetMix GRPO", grpo_algorithm, True, _GRPO, "mixed"
    ),
    "gigpo": RunPreset("GiGPO", gigpo_algorithm, False, _GIGPO),
    "gigpo-budgetmix": RunPreset("BudgetMix GiGPO", gigpo_algorithm, True, _GIGPO),
    "ppo": RunPreset("PPO", ppo_algorithm, False, _PPO),
    "ppo-budgetmix": RunPreset("BudgetMix PPO", ppo_algorithm, True, _PPO),
    "dapo": RunPreset("DAPO", dapo_algorithm),
    "dapo-budgetmix": RunPreset("BudgetMix DAPO", dapo_algorithm, True),
    "dr-grpo": RunPreset("Dr. GRPO", dr_grpo_algorithm, False, POLICY),
    "rloo": RunPreset("RLOO", rloo_algorithm, False, _GRPO),
    "gspo": RunPreset("GSPO", gspo_algorithm),
}


def register_run_preset(
    name: str,
    *,
    label: str,
    algorithm: AlgorithmBuilder,
    params: Mapping[str, Param] | None = None,
    budget_mix: bool | str = False,
) -> RunPreset:
    """Adds a preset to :data:`RUN_PRESETS` (``rl.runs`` can then name it); refuses a taken
    name. ``params``: the hyper-parameters it declares (``{name: Param}``); ``algorithm``
    gets their values, as a mapping, and returns ``AlgorithmConfig.from_dict`` data."""
    if not (isinstance(name, str) and RUN_NAME.fullmatch(name)) or name in RESERVED_NAMES:
        raise ValueError(
            f"run preset name: must match {RUN_NAME.pattern} and not be one of "
            f"{RESERVED_NAMES}, got {name!r}"
        )
    if name in RUN_PRESETS:
        raise ValueError(f"run preset {name!r} is already registered")
    if not callable(algorithm):
        raise ValueError(
            f"run preset {name!r}: algorithm must be a function of its hyper-parameters"
        )
    if budget_mix not in BUDGET_MIX:
        raise ValueError(
            f"run preset {name!r}: budget_mix must be true, false or 'adaptive', got {budget_mix!r}"
        )
    params = dict(params or {})
    if not all(isinstance(k, str) and isinstance(p, Param) for k, p in params.items()):
        raise ValueError(f"run preset {name!r}: params must map names to Param declarations")
    RUN_PRESETS[name] = RunPreset(label, algorithm, budget_mix, params)
    return RUN_PRESETS[name]


# ---------------------------------------------------------------- resolving rl.runs

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # a folder name
RESERVED_NAMES = ("init", "base")  # models/init, models/base are the reproduction's own
BASE_LABEL = "base"  # the warm-started policy's name in the evaluation
RUN_FIELDS = ("name", "preset", "label", "budget_mix", "presentation", "params", "algorithm")
ALGORITHM_FIELDS = tuple(f.name for f in dataclasses.fields(AlgorithmConfig))


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """One resolved run of ``rl.runs``: its folder name, label, BudgetMix, algorithm and how
    its rollouts show the budget."""

    name: str
    label: str
    budget_mix: bool | str  # False, True or "adaptive"
    algorithm: AlgorithmConfig
    presentation: BudgetPresentation = BudgetPresentation()


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
            f"{did_you_mean(unknown[0], ALGORITHM_FIELDS)}"
        )
    return dict(value)


def check_preset_params(where: str, value: Any) -> dict[str, Any]:
    """``value`` as a dict of hyper-parameter values; ConfigError naming ``where`` otherwise."""
    if not _is_mapping(value):
        raise ConfigError(
            f"{where}: must be a mapping of the presets' hyper-parameters "
            f"({', '.join(declared_params())}), got {short_repr(value)}"
        )
    return dict(value)


def declared_params() -> list[str]:
    """Every hyper-parameter some registered preset declares, sorted."""
    return sorted({name for preset in RUN_PRESETS.values() for name in preset.params})


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
    except (ValueError, TypeError) as error:  # TypeError: a malformed value deep in params
        raise ConfigError(f"{where}: {error}") from None
    try:
        check_inputs(algorithm)
    except ValueError as error:
        raise ConfigError(f"{where}.{error}") from None
    return algorithm


def preset_values(where: str, preset: RunPreset, shared: Mapping[str, Any], own: Any) -> dict:
    """The values of ``preset``'s hyper-parameters: its defaults, then ``shared``'s values of
    those it declares (``rl.preset_params``), then ``own`` (the run's ``params``, all of
    which it must declare); each checked by its declaration."""
    own = check_preset_params(f"{where}.params", own)
    unknown = sorted(set(own) - set(preset.params))
    if unknown:
        raise ConfigError(
            f"{where}.params: unknown hyper-parameter {unknown[0]!r}; the preset declares: "
            f"{', '.join(preset.params) or 'none'}{did_you_mean(unknown[0], preset.params)}"
        )
    values = {}
    for name, param in preset.params.items():
        value = own.get(name, shared.get(name, param.default))
        if not param.check(value):
            source = f"{where}.params" if name in own else "rl.preset_params"
            raise ConfigError(f"{source}.{name}: must be {param.expect}, got {short_repr(value)}")
        values[name] = value
    return values


def _plain(value: Any) -> Any:
    """``value`` as YAML wrote it (a frozen config's tuples as lists), for messages."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _entry_fields(where: str, entry: Any) -> dict[str, Any]:
    if isinstance(entry, str):
        if entry not in RUN_PRESETS:
            raise ConfigError(
                f"{where}: unknown run preset {entry!r}; presets: {', '.join(RUN_PRESETS)} "
                "(or a mapping {name, preset, label, budget_mix, presentation, params, algorithm})"
                f"{did_you_mean(entry, RUN_PRESETS)}"
            )
        return {"name": entry}
    if not _is_mapping(entry):
        raise ConfigError(
            f"{where}: must be a preset name ({', '.join(RUN_PRESETS)}) or a mapping "
            f"{{name, preset, label, budget_mix, presentation, params, algorithm}}, got "
            f"{short_repr(_plain(entry))}"
        )
    unknown = sorted(set(entry) - set(RUN_FIELDS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r}; known: {', '.join(RUN_FIELDS)}"
            f"{did_you_mean(unknown[0], RUN_FIELDS)}"
        )
    if "name" not in entry:
        raise ConfigError(f"{where}: needs a name (its folder under runs/ and models/)")
    return dict(entry)


def resolve_run(where: str, entry: Any, rl: Any) -> RunSettings:
    """One ``rl.runs`` entry (a preset name or a mapping) as :class:`RunSettings`; ``rl``: the
    section (its ``preset_params`` and ``algorithm`` overrides)."""
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
            f"{where}.preset: must be one of {', '.join(RUN_PRESETS)}, got "
            f"{short_repr(preset_name)}{did_you_mean(preset_name, RUN_PRESETS)}"
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
    if preset is None and fields.get("params"):
        raise ConfigError(f"{where}.params: a run without a preset has no hyper-parameters")
    data = (
        dict(
            preset.algorithm(
                preset_values(where, preset, rl.preset_params, fields.get("params", {}))
            )
        )
        if preset
        else {}
    )
    for override in (
        rl.algorithm,
        check_algorithm_overrides(f"{where}.algorithm", fields.get("algorithm", {})),
    ):
        data = merge_algorithm(data, override)
    try:
        presentation = BudgetPresentation.from_value(
            fields.get("presentation", preset.presentation if preset else "exact")
        )
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{where}.{error}") from None
    return RunSettings(
        name, label, budget_mix, build_algorithm(f"{where}.algorithm", data), presentation
    )


def resolve_runs(rl: Any) -> tuple[RunSettings, ...]:
    """Every entry of ``rl.runs``, resolved; names and labels must be distinct, and every
    hyper-parameter of ``rl.preset_params`` must be declared by some run's preset."""
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
    declared = declared_defaults(rl.runs)
    unused = sorted(set(rl.preset_params) - set(declared))
    if unused:
        raise ConfigError(
            f"rl.preset_params.{unused[0]}: no run's preset declares it; they declare: "
            f"{', '.join(sorted(declared)) or 'none'}{did_you_mean(unused[0], declared)}"
        )
    return runs


def declared_defaults(runs: Sequence[Any]) -> dict[str, set[str]]:
    """``{hyper-parameter: the reprs of its defaults}`` over the presets of raw ``rl.runs``
    entries (a name declared by several presets may have several defaults)."""
    out: dict[str, set[str]] = {}
    for entry in runs:
        for name, param in _preset_of(entry).params.items():
            out.setdefault(name, set()).add(repr(param.default))
    return out


def _preset_of(entry: Any) -> RunPreset:
    """The preset of a run entry already resolved (an empty one for a run without)."""
    name = entry if isinstance(entry, str) else None
    if isinstance(entry, Mapping):
        name = entry.get("preset", entry.get("name"))
    found = RUN_PRESETS.get(name) if isinstance(name, str) else None
    return found if found is not None else RunPreset("", lambda p: {})
