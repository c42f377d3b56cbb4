"""``agentrl-jax reproduce frozenlake``: the paper's FrozenLake study end to end (PAPER.md §5, §7, §9).

* :mod:`.config`   - the validated, YAML-backed configuration (CPU default and paper scale).
* :mod:`.demos`    - the scripted Q*-greedy demonstrator with injected mistakes.
* :mod:`.sft`      - supervised warm-start of the policy on the demonstrations (the base).
* :mod:`.training` - the RL runs (GRPO, BudgetMix GRPO, GiGPO, PPO) with checkpoints.
* :mod:`.evaluate` - Pass@(K, T), Table 1 and the diagnostics for several policies.
* :mod:`.pipeline` - the phases, their results folder, resuming, and the progress bar.
"""
