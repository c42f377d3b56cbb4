"""The project's errors for bad input files: each message names the file and the field.

* :class:`ConfigError`: a configuration (a reproduction YAML, a model's ``config.json``, a
  trainer config) has a missing, malformed or nonsensical field;
* :class:`CheckpointError`: a checkpoint's files (safetensors headers, the shard index) are
  malformed or do not match the model its config describes.

Both are ``ValueError`` subclasses, so callers that catch ``ValueError`` keep working. Loaders
raise them instead of a library's own error (``KeyError``, ``TypeError``, ``yaml.YAMLError``,
``json.JSONDecodeError``, ...), and never read a bad file as valid.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config field is missing, malformed, or describes something we do not implement."""


class CheckpointError(ValueError):
    """A checkpoint's files or tensors are malformed or do not match its config."""
