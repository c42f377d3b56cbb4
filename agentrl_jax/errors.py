"""The project's errors for bad input files: each message names the file and the field.

* :class:`ConfigError`: a configuration (a reproduction YAML, a model's ``config.json``, a
  trainer config) has a missing, malformed or nonsensical field;
* :class:`CheckpointError`: a checkpoint's files (safetensors headers, the shard index) are
  malformed or do not match the model its config describes.

Both are ``ValueError`` subclasses, so callers that catch ``ValueError`` keep working. Loaders
raise them instead of a library's own error (``KeyError``, ``TypeError``, ``yaml.YAMLError``,
``json.JSONDecodeError``, ...), and never read a bad file as valid.

A message that refuses an unknown name (a config field or section, an environment, a run
preset, an analysis, a loss term, ...) lists the valid ones and ends with
:func:`did_you_mean`'s suggestion of the closest, where one is close:
``rl: unknown field 'stepz'; known: ...; did you mean 'steps'?``.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable


class ConfigError(ValueError):
    """A config field is missing, malformed, or describes something we do not implement."""


class CheckpointError(ValueError):
    """A checkpoint's files or tensors are malformed or do not match its config."""


def did_you_mean(name: Any, known: Iterable[Any]) -> str:
    """``"; did you mean 'x'?"``, naming the entry of ``known`` closest to ``name``
    (:func:`difflib.get_close_matches`, ignoring case), for the end of a message that refuses
    ``name``; ``""`` when none is close, or ``name`` is not a string."""
    if not isinstance(name, str) or not name:
        return ""
    by_lower: dict[str, str] = {}
    for candidate in known:
        if isinstance(candidate, str) and candidate != name:
            by_lower.setdefault(candidate.lower(), candidate)
    matches = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    return f"; did you mean {by_lower[matches[0]]!r}?" if matches else ""
