"""``agentrl-jax reproduce ENV``: the paper's study of a registered environment end to end
(PAPER.md §5, §7, §9). What is particular to an environment (tasks, demonstrations, R_single,
analyses, config defaults) comes from its study (:mod:`agentrl_jax.reproduce.studies`), not from
here.

* :mod:`.config`      - the validated, YAML-backed configuration (CPU default and paper scale).
* :mod:`.policy_init` - the initial policy: a random Qwen3 and a tokenizer built from the task text.
* :mod:`.demos`       - the study's demonstrations with mistakes, played through the real rollout.
* :mod:`.sft`         - supervised warm-start on the demonstrations (the base policy).
* :mod:`.presets`     - the runs by name: one table of presets, and runs composed from the registry.
* :mod:`.training`    - the RL runs (one TrainConfig each, from ``rl.runs``) with checkpoints.
* :mod:`.pipeline`    - the phases, their results folder, resuming; each ``eval:<analysis>``
  phase runs one analysis of the registry (:mod:`agentrl_jax.evaluation.analyses.registry`,
  in its order; none is named here), then ``report`` writes the report
  (:mod:`agentrl_jax.evaluation.full_report`: the findings first, then Table 1 and the
  analyses).
* :mod:`.progress`    - the phases' predicted work and the one progress bar.
* :mod:`.seeds`, :mod:`.compare` - a run across seeds; a run against its stored reference.
"""
