"""Evaluation: Pass@(K, T) metrics, the paper's diagnostics, figures and reports (PAPER.md §3, §7).

* :mod:`analyses` - one module per analysis of the paper: ``compute(...) -> Result``, its
  figure and its report section, and ONE registered object (``analyses.registry``) that
  ``eval`` and the reproduction run (``analyses.context.run_analysis``); a plugin adds its own.
* :mod:`raw`      - the raw records each analysis saves, read back; BudgetMix counterparts.
* :mod:`verdicts`, :mod:`findings` - the verdict rule and the paper's figures; the findings
  of every analysis in the paper's order, the report's first section.
* :mod:`full_report` - ``report.md`` led by the findings; :mod:`evaluate_policies`: ``eval``
  of named policies or a results folder.
* :mod:`passk`    - unbiased pass@k, Pass@K / Pass@T curves, budget levels, structural bound.
* :mod:`stats`    - generic CIs (normal, bootstrap, Wilson), paired comparisons, binned and
  per-turn curves.
* :mod:`result`   - the analyses' results: frozen dataclasses with one JSON round trip.
* :mod:`figures`  - what every figure shares (an Agg figure, PNG + PDF).
* :mod:`report`   - the one writer: JSON, CSV, report sections, report.md and report.html.
* :mod:`passt`, :mod:`states`, :mod:`diagnostics`, :mod:`likelihood` - the data: rollouts,
  state pools, step qualities, teacher-forced log-probs.
* :mod:`drivers`  - what feeds each analysis, for ``agentrl-jax eval`` and the reproduction.

``passk``, ``stats``, ``result`` and every ``compute`` are pure NumPy; only ``section``,
``plot_*``, ``figures`` and ``report`` write files.
"""

from agentrl_jax.evaluation.passk import (
    BUDGET_PERCENTS,
    PASS_AT_K_RANGE,
    PASS_AT_T_K,
    budget_levels,
    counts_from_successes,
    pass_at_k,
    pass_at_k_by_budget,
    pass_at_k_curve,
    pass_at_k_matrix,
    pass_at_k_table,
    pass_at_t_curve,
    structural_upper_bound,
)

__all__ = [
    "BUDGET_PERCENTS",
    "PASS_AT_K_RANGE",
    "PASS_AT_T_K",
    "budget_levels",
    "counts_from_successes",
    "pass_at_k",
    "pass_at_k_by_budget",
    "pass_at_k_curve",
    "pass_at_k_matrix",
    "pass_at_k_table",
    "pass_at_t_curve",
    "structural_upper_bound",
]
