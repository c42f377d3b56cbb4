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
* :mod:`.presentation` - Pass@(k, T) with the budget shown exactly, hidden, approximately;
* :mod:`.step_quality` - action quality on matched states and at error states (§7.1, §7.2);
* :mod:`.continuation` - success continuing from error states (§7.2);
* :mod:`.error_recovery` - the named error-recovery suite: every policy's figures at error
  states in one table (§7.2);
* :mod:`.depth`        - action quality against normalised depth (§7.3);
* :mod:`.splice`       - the base and an RL policy handing episodes to each other part-way;
* :mod:`.likelihood`   - ActionNLL and the cumulative LLR (§7.4);
* :mod:`.erosion`      - where full-budget RL loses single-step quality (§7.5);
* :mod:`.dynamics`     - R_multi and R_single over training (§7.5).

An analysis that ``agentrl-jax eval`` and ``agentrl-jax reproduce`` run is ONE object
(:class:`~.registry.Analysis`) in one of these modules, its ``ANALYSIS``: its name, the work
units it needs, how it runs on a run's policies (:mod:`.context`), its report sections,
whether it is pairwise, and the findings it checks. Importing this package registers them
(:mod:`.registry`), in report order:

=================  =========================  ========
analysis           module                     pairwise
=================  =========================  ========
``table``          :mod:`.table1`             no
``presentation``   :mod:`.presentation`       no
``passk``          :mod:`.pass_at_k`          no
``steps``          :mod:`.step_quality`       yes
``errors``         :mod:`.error_recovery`     yes
``splice``         :mod:`.splice`             yes
``likelihood``     :mod:`.likelihood`         yes
``erosion``        :mod:`.erosion`            yes
``dynamics``       :mod:`.dynamics`           no
=================  =========================  ========

A plugin file registers more (:func:`~.registry.register`); they run and report after these.
"""

# the built-in analyses, registered in report (and run) order: erosion reads the raw records
# of steps and errors (imported to register; isort would sort them)
# isort: off
from agentrl_jax.evaluation.analyses import table1  # noqa: F401
from agentrl_jax.evaluation.analyses import presentation  # noqa: F401
from agentrl_jax.evaluation.analyses import pass_at_k  # noqa: F401
from agentrl_jax.evaluation.analyses import step_quality  # noqa: F401
from agentrl_jax.evaluation.analyses import error_recovery  # noqa: F401
from agentrl_jax.evaluation.analyses import splice  # noqa: F401
from agentrl_jax.evaluation.analyses import likelihood  # noqa: F401
from agentrl_jax.evaluation.analyses import erosion  # noqa: F401
from agentrl_jax.evaluation.analyses import dynamics  # noqa: F401
# isort: on
