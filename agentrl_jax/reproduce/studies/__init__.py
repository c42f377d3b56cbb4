"""The paper's study of each environment, keyed by the environment's registered name.

A :class:`~agentrl_jax.reproduce.studies.base.Study` is what ``agentrl-jax reproduce ENV``
needs from an environment beyond the rollout (tasks and their splits, demonstrations, a
tokenizer corpus, R_single, state diagnostics, the paper's figures, config defaults).
:func:`study_for` gives an environment's study: the one registered under its name
(:func:`register_study`; built in: ``frozenlake``, ``sql``, ``code``, ``bfcl``), else the
generic one, which serves any registered environment. A user's study is registered from its
own module (a ``--plugin`` file), with no change here.
"""

from __future__ import annotations

import importlib
from typing import Callable

from agentrl_jax.reproduce.studies.base import (
    ALL_ANALYSES,
    GENERIC_ANALYSES,
    GoldDemonstrator,
    RecordedQuality,
    Study,
    StudyError,
    first_observations,
    inner_env,
)

# The built-in studies, imported on first use ("module:class"): some import heavy modules.
_BUILT_IN = {
    "frozenlake": "agentrl_jax.reproduce.studies.frozenlake:FrozenLakeStudy",
    "sql": "agentrl_jax.reproduce.studies.sql:SqlStudy",
    "code": "agentrl_jax.reproduce.studies.code:CodeStudy",
    "bfcl": "agentrl_jax.reproduce.studies.bfcl:BfclStudy",
}
_REGISTERED: dict[str, Study | Callable[[], Study]] = {}
_BUILT: dict[str, Study] = {}
_GENERIC = Study()


def register_study(env: str, study: Study | Callable[[], Study], *, replace: bool = False) -> None:
    """Register ``study`` (a :class:`Study`, or a function returning one, called on first use)
    as the study of the environment named ``env``; a name that has one is refused unless
    ``replace``."""
    if not isinstance(env, str) or not env.isidentifier():
        raise ValueError(f"register_study: the environment name must be an identifier, got {env!r}")
    if (env in _REGISTERED or env in _BUILT_IN) and not replace:
        raise ValueError(f"register_study: {env!r} has a study (replace=True replaces it)")
    if not (isinstance(study, Study) or callable(study)):
        raise ValueError(
            f"register_study({env!r}): study must be a Study or a function returning one, "
            f"got {type(study).__name__}"
        )
    _BUILT.pop(env, None)
    _REGISTERED[env] = study


def study_for(env: str) -> Study:
    """The study of the environment named ``env`` (the generic one if none is registered)."""
    if env not in _BUILT:
        made = _REGISTERED.get(env)
        if made is None and env in _BUILT_IN:
            module, name = _BUILT_IN[env].split(":")
            made = getattr(importlib.import_module(module), name)
        study = _GENERIC if made is None else (made if isinstance(made, Study) else made())
        if not isinstance(study, Study):
            raise StudyError(
                f"environment {env!r}: its study must be a Study, got {type(study).__name__}"
            )
        _BUILT[env] = study
    return _BUILT[env]


__all__ = [
    "ALL_ANALYSES",
    "GENERIC_ANALYSES",
    "GoldDemonstrator",
    "RecordedQuality",
    "Study",
    "StudyError",
    "first_observations",
    "inner_env",
    "register_study",
    "study_for",
]
