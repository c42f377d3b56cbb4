"""The paper's analyses, one module each (PAPER.md §2, §3, §7).

Every module holds a pure ``compute(...) -> Result`` (a frozen dataclass of arrays and
numbers with a JSON round trip, :mod:`agentrl_jax.evaluation.result`), its figure
(``plot_*``) and ``section(folder, result, ...)``, which writes its JSON, CSV and figure
through the shared writer (:mod:`agentrl_jax.evaluation.report`) and returns its report
section:

* :mod:`.pass_at_k`    - Pass@K at the full budget (§3);
* :mod:`.pass_at_t`    - Pass@T with the structural bound, Table 1 at 25/50/75/100% (§2, §3);
* :mod:`.table1`       - Table 1 with CIs and paired differences between policies (§3, §9);
* :mod:`.robustness`   - budget robustness, Pass@T's area over the bound's;
* :mod:`.step_quality` - action quality on matched states and at error states (§7.1, §7.2);
* :mod:`.continuation` - success continuing from error states (§7.2);
* :mod:`.error_recovery` - the named error-recovery suite: every policy's figures at error
  states in one table (§7.2);
* :mod:`.depth`        - action quality against normalised depth (§7.3);
* :mod:`.likelihood`   - ActionNLL and the cumulative LLR (§7.4);
* :mod:`.dynamics`     - R_multi and R_single over training (§7.5).
"""
