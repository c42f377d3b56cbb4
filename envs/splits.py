"""Train and test splits of named tasks: a fixed hash split that does not depend on the tasks'
order or number, so no test task is ever trained on."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from envs.protocol import EnvOptionError


def hash_split(name: str) -> str:
    """``"train"`` or ``"test"``: the top bit of ``name``'s SHA-256, a fixed split of named tasks
    into two disjoint halves that does not depend on their order or number."""
    return ("train", "test")[hashlib.sha256(name.encode()).digest()[0] >> 7]


def split_tasks(items: Sequence[Any], names: Sequence[str], split: str | None) -> list[Any]:
    """The ``items`` whose ``names`` fall in ``split`` (:func:`hash_split`; None: all of them);
    another split is refused (:class:`~envs.protocol.EnvOptionError`)."""
    if split not in (None, "train", "test"):
        raise EnvOptionError(
            f"split: must be 'train' or 'test' (a hash split of the tasks), got {split!r}"
        )
    return [item for item, name in zip(items, names) if split is None or hash_split(name) == split]
