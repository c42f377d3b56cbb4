"""The analyses by name, in report order: each one :class:`Analysis` object, declared and
registered by its own module (:func:`register`).

An analysis says, on its object, everything the evaluation and the reproduction ask of it:

* ``name``: its raw record (``raw/<name>.json``), its sections (``sections/<name>.json``)
  and how ``--analysis`` names it;
* ``pairwise``: whether it compares the base with every other policy (then it needs two);
* ``needs_models``: False for an analysis that reads only what was saved (``dynamics``: the
  runs' metrics logs), so its policies may be None;
* :meth:`Analysis.tasks`: the tasks it plays (default: the first ``eval.diagnostic_tasks``);
* :meth:`Analysis.units`: the work units it reports through ``progress`` (a progress bar's
  length: trajectory-turns played or scored), and ``unit_seconds``, their predicted cost;
* :meth:`Analysis.run`: how it runs on a run's policies
  (:class:`~agentrl_jax.evaluation.analyses.context.AnalysisRun`): it samples through the
  drivers, writes its raw record, its CSVs and figures, and returns its report sections;
* :meth:`Analysis.findings`: the paper's headlines (or a plugin's own claims) it checks on the
  saved raw records (:mod:`agentrl_jax.evaluation.findings`), at ``findings_rank`` in the
  findings table, each linking to the section ``sources`` names.

The built-in analyses register themselves when :mod:`agentrl_jax.evaluation.analyses` is
imported (in report order, which is also their run order: ``erosion`` reads the raw records of
``steps`` and ``errors``). A user's plugin file (``--plugin``, :mod:`agentrl_jax.plugins`)
registers its own with :func:`register`; ``agentrl-jax reproduce`` and ``agentrl-jax eval``
then run it and report it after the built-in ones, with no edit to the package.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

from agentrl_jax.errors import did_you_mean

NAME = re.compile(r"[a-z][a-z0-9_]*")


class Analysis:
    """One analysis (see the module docstring). Subclass it, set ``name`` (and ``pairwise``,
    ``needs_models``, ``findings_rank`` where they differ), write :meth:`run` and
    :meth:`units`, and :func:`register` an instance."""

    name: str = ""
    pairwise: bool = False
    needs_models: bool = True
    findings_rank: float = math.inf  # its findings' place in the table (ties: report order)
    # predicted seconds per work unit on the reference 2-core CPU (a progress bar's ETA)
    unit_seconds: float = 1e-3
    # {headline it checks: the title prefix of the report section it is checked on}, so the
    # findings table links each verdict to its numbers
    sources: Mapping[str, str] = {}

    def tasks(self, settings: Any, task_ids: Sequence[int]) -> Sequence[int]:
        """The tasks it plays: the first ``settings.diagnostic_tasks`` (None: all)."""
        count = settings.diagnostic_tasks
        return task_ids if count is None else task_ids[:count]

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        """Work units it reports through ``progress`` for ``policies`` policies on
        ``num_tasks`` tasks (already :meth:`tasks`' count) at budget ``t_max``."""
        raise NotImplementedError

    def run(self, run: Any) -> list:
        """Sample, write the raw record and the files, return the report sections."""
        raise NotImplementedError

    def findings(self, raw: Mapping[str, Any], figures: Any) -> list:
        """The findings it checks on the raw records ``{analysis: record or None}`` (None: not
        run) against the paper's figures (:class:`~agentrl_jax.evaluation.paper.PaperFigures`);
        none by default."""
        return []

    def __repr__(self) -> str:
        return f"<analysis {self.name}>"


_REGISTRY: dict[str, Analysis] = {}


def register(analysis: Analysis, *, replace: bool = False) -> Analysis:
    """Adds ``analysis`` (after those registered before it, in report order); refuses a taken
    name unless ``replace`` (which keeps its place). Returns it."""
    if not isinstance(analysis, Analysis):
        raise ValueError(f"register: an Analysis instance, got {type(analysis).__name__}")
    name = analysis.name
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise ValueError(f"analysis name: must match {NAME.pattern}, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"analysis {name!r} is already registered")
    _REGISTRY[name] = analysis
    return analysis


def unregister(name: str) -> None:
    """Removes analysis ``name`` (a test's plugin, after the test)."""
    _REGISTRY.pop(get(name).name)


def names() -> tuple[str, ...]:
    """The registered analyses' names, in report order."""
    return tuple(_REGISTRY)


def analyses() -> tuple[Analysis, ...]:
    """The registered analyses, in report order."""
    return tuple(_REGISTRY.values())


def get(name: str) -> Analysis:
    """The analysis ``name``; a ValueError naming the known ones (and the closest) if none."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown analysis {name!r}; known: {', '.join(_REGISTRY)}"
            f"{did_you_mean(name, tuple(_REGISTRY))}"
        )
    return _REGISTRY[name]


def check_analysis(name: str) -> str:
    """``name``, a registered analysis; a ValueError naming them (and the closest) if not."""
    return get(name).name


def pairwise() -> tuple[str, ...]:
    """The analyses that compare the base with every other policy, in report order."""
    return tuple(n for n, a in _REGISTRY.items() if a.pairwise)
