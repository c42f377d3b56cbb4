"""The reproduction's configuration: one tree of frozen sections, validated on construction,
read from YAML.

A :class:`ReproduceConfig` is the library's :class:`~agentrl_jax.train.config.Config` (the
sections the training entry point reads) and the reproduction's own::

    task:        the environment (a registered name), its options, T_max, task counts, lengths
    model:       a random-init Qwen3 of given dimensions with a small tokenizer, or a local
                 Qwen3 directory (paper scale)                       (:mod:`.settings`)
    warm_start:  behaviour cloning on the study's imperfect demonstrations (the "base" policy)
    engine:      the sampling engine, shared by the RL rollouts and the evaluation
    rl:          the RL runs (presets and compositions) and their trainer settings
    eval:        :class:`~agentrl_jax.evaluation.config.EvalConfig` (Pass@(K, T), diagnostics)
    mesh:        :class:`~agentrl_jax.sharding.MeshConfig` (data, fsdp, tensor axes)

Defaults come in one order: the classes' own (the library's: the paper's where it gives them),
then the environment's study (:attr:`~agentrl_jax.reproduce.studies.Study.config_defaults`:
``agentrl-jax reproduce ENV``'s CPU-sized default, the one place an environment's defaults
live; :func:`default_config`), then a file (``configs/*.yaml`` only override), then
``section.field=value`` overrides (:func:`load_config`). Reading, overrides, the structure
check and writing are the library's (:mod:`agentrl_jax.config_io`): every bad value raises
:class:`~agentrl_jax.errors.ConfigError` (a ``ValueError``) naming the file, the override if one
set it, and the field, e.g. ``config run.yaml: rl.group_size: must be an int >= 2, got 1``;
unknown sections and fields are errors too (a typo never silently falls back to a default),
and so is a file of the wrong structure (``task: 0``, ``rl: false``, a list where a mapping
belongs, a key given twice, an empty file). A config stored in an earlier layout is
rewritten once by ``notebooks/migrate_configs.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from agentrl_jax import config_io
from agentrl_jax.errors import ConfigError
from agentrl_jax.evaluation.config import EvalConfig
from agentrl_jax.models.lora import projection_shapes
from agentrl_jax.reproduce.settings import ModelConfig, WarmStartConfig
from agentrl_jax.sampling.config import EngineConfig
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.train.config import Config, RLConfig, TaskConfig
from agentrl_jax.train.presets import declared_defaults
from agentrl_jax.validation import short_repr

SECTIONS: dict[str, type] = {
    "task": TaskConfig,
    "model": ModelConfig,
    "warm_start": WarmStartConfig,
    "engine": EngineConfig,
    "rl": RLConfig,
    "eval": EvalConfig,
    "mesh": MeshConfig,
}


@dataclasses.dataclass(frozen=True)
class ReproduceConfig(Config):
    """The whole reproduction (see the module docstring)."""

    model: ModelConfig = ModelConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    eval: EvalConfig = EvalConfig(
        max_response_tokens=TaskConfig.max_response_tokens, max_context=TaskConfig.max_context
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("model", "warm_start", "eval"):
            if not isinstance(getattr(self, name), SECTIONS[name]):
                raise ConfigError(
                    f"{name}: must be a {SECTIONS[name].__name__}, "
                    f"got {short_repr(getattr(self, name))}"
                )
        if self.eval.budgets is not None and max(self.eval.budgets) > self.task.t_max:
            raise ConfigError(
                f"eval.budgets: must be <= task.t_max ({self.task.t_max}), "
                f"got {list(self.eval.budgets)}"
            )
        if self.rl.process_reward_coef > 0 and self.rl.process_rewards is None:
            raise ConfigError(
                f"rl.process_reward_coef: {self.rl.process_reward_coef} weighs process rewards, "
                "but rl.process_rewards names none (oracle or judge)"
            )
        if self.rl.lora is not None and self.model.model_dir is None:  # a loaded model: at setup
            m = self.model
            self.rl.lora.check_rank(
                projection_shapes(
                    m.hidden_size,
                    m.intermediate_size,
                    m.num_attention_heads,
                    m.num_key_value_heads,
                    m.head_dim,
                )
            )
        if self.model.tokenizer_isolate and self.study.tokenizer_isolate is None:
            raise ConfigError(
                f"model.tokenizer_isolate: the {self.task.env} environment's study "
                "declares no pieces to isolate (its Study.tokenizer_isolate)"
            )

    @property
    def study(self):
        """The environment's study (:func:`agentrl_jax.reproduce.studies.study_for`)."""
        from agentrl_jax.reproduce.studies import study_for  # noqa: PLC0415

        return study_for(self.task.env)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON), a copy; ``config_from_dict(c.to_dict()) == c``."""
        sections = self.plain_sections()
        return {name: sections[name] for name in SECTIONS}


def env_defaults(env: str) -> dict[str, dict[str, Any]]:
    """The defaults of ``agentrl-jax reproduce ENV``: the environment's study's
    (:attr:`~agentrl_jax.reproduce.studies.Study.config_defaults`), with ``task.env``."""
    import envs  # noqa: PLC0415
    from agentrl_jax.reproduce.studies import study_for  # noqa: PLC0415

    envs.entry(env)  # an unregistered name is refused, naming the registered ones
    defaults = study_for(env).config_defaults
    return {**defaults, "task": {**defaults.get("task", {}), "env": env}}


def default_config(env: str = "frozenlake", overrides: Sequence[str] = ()) -> ReproduceConfig:
    """The built-in default of ``agentrl-jax reproduce ENV`` (its study's defaults over the
    classes'), with ``section.field=value`` overrides."""
    return load_config(None, overrides, env=env)


# ---------------------------------------------------------------- building and reading


def config_from_dict(
    d: Mapping[str, Any] | None, *, source: str | None = None, overrides: Sequence[str] = ()
) -> ReproduceConfig:
    """A :class:`ReproduceConfig` from plain data; missing sections and fields take the
    classes' defaults (:func:`agentrl_jax.config_io.build`: ``source`` and ``overrides`` name
    where a bad value came from). A task of another environment than the default's takes
    none of the default's options."""
    task = d.get("task") if isinstance(d, Mapping) else None
    if isinstance(task, Mapping) and task.get("env", TaskConfig.env) != TaskConfig.env:
        d = {**d, "task": {"options": {}, **task}}
    return config_io.build(ReproduceConfig, SECTIONS, d, source=source, overrides=overrides)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    env: str | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> ReproduceConfig:
    """The config in the YAML file ``path`` (None: the built-in default) with ``overrides``,
    over the defaults of its environment: ``env``, else the one the file (or an override)
    names in ``task.env``, else ``frozenlake`` (:func:`env_defaults`; ``defaults`` replaces
    them). A field the file does not give takes its value there first (a mapping field, e.g.
    ``rl.preset_params``, key by key); the overrides come last.

    Every problem is a :class:`ConfigError` naming the file (and the override, if one is
    involved) and the field (:mod:`agentrl_jax.config_io`).
    """
    data: Any = {}
    source = None
    if path is not None:
        path = Path(path)
        source = f"config {path}"
        data = config_io.read_yaml(path)
        # the file's own structure, before overrides touch it
        config_io.check_structure(data, SECTIONS, config_io.Where(source))
    if defaults is None:
        named = (config_io.apply_overrides(data, overrides).get("task") or {}).get("env")
        env = env or (named if isinstance(named, str) else None) or "frozenlake"
        try:
            defaults = env_defaults(env)
        except ValueError as error:  # an unregistered environment
            raise ConfigError(
                f"{config_io.Where(source, overrides).prefix('task')}task.env: {error}"
            ) from None
    data = {
        name: {} if fields is None else fields for name, fields in data.items()
    }  # null: none set
    given = config_io.apply_overrides(data, overrides)
    data = config_io.apply_overrides(config_io.merged(defaults, data), overrides)
    _drop_undeclared_default_params(data, given)
    return config_from_dict(data, source=source, overrides=overrides)


def _drop_undeclared_default_params(data: dict[str, Any], given: Mapping[str, Any]) -> None:
    """Drops from ``data``'s ``rl.preset_params`` the hyper-parameters the defaults set that
    none of its runs' presets declares (the CPU default's ``kl_coef`` under ``rl.runs=[dapo]``):
    a default applies where it can. One the file or an override sets stays, and is refused if
    no preset declares it."""
    rl, mine = data.get("rl"), given.get("rl")
    params = rl.get("preset_params") if isinstance(rl, Mapping) else None
    if not isinstance(params, Mapping) or not isinstance(rl.get("runs"), (list, tuple)):
        return
    stated = mine.get("preset_params") if isinstance(mine, Mapping) else None
    stated = stated if isinstance(stated, Mapping) else {}
    try:
        declared = declared_defaults(rl["runs"])
    except (TypeError, AttributeError):  # a malformed run: the config's checks will name it
        return
    rl["preset_params"] = {
        name: value for name, value in params.items() if name in declared or name in stated
    }
