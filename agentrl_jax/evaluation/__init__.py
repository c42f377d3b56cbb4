"""Evaluation: Pass@(K, T) metrics, the paper's diagnostics, figures and reports (PAPER.md §3, §7).

* :mod:`passk`   - unbiased pass@k, Pass@K / Pass@T curves, budget levels, structural bound.
* :mod:`stats`   - CIs, paired comparisons, depth curves, log-likelihood ratios, ActionNLL.
* :mod:`figures` - one matplotlib figure per analysis (PNG + PDF), Table 1 as Markdown/CSV.
* :mod:`report`  - results folders (JSON, CSV, figures) and the Markdown report.

``passk`` and ``stats`` are pure NumPy; only ``figures`` and ``report`` write files.
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
