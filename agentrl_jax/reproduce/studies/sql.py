"""InterCode-SQL's study: what ``agentrl-jax reproduce sql`` knows beyond the rollout.

* **tasks**: with a Spider folder (``task.options.data``) the training tasks are Spider's
  ``train`` split and the test tasks its ``dev`` split (InterCode-SQL's evaluation set);
  without one, the 18 bundled bookshop questions split in two by a hash of each question
  (:func:`envs.sql.demo.question_split`), so no test question is trained on.
* **demonstrations**: each task's gold plan is to run the gold query, read its result and
  submit it (``<sql>GOLD</sql>`` then ``<submit>GOLD</submit>``; with one turn left, submit
  at once); a mistake plays another task's query in its place, so a mistaken submit fails.
* Everything else is the generic study's (:mod:`agentrl_jax.reproduce.studies.base`):
  Table 1, Pass@K, likelihood, training dynamics; SQL records no step quality, so no R_single.
"""

from __future__ import annotations

from typing import Any

from agentrl_jax.reproduce.studies.base import Study, cpu_defaults, inner_env
from envs.protocol import EnvEntry, EnvTasks
from envs.registry import make, with_t_max

SPIDER_SPLITS = {"train": "train", "test": "dev"}


class SqlStudy(Study):
    """The study of the ``sql`` environment (module docstring)."""

    demonstrations = "gold-query demonstrations"
    paper_figures = {
        "texts": {  # PAPER.md gives no InterCode-SQL figure for these
            "lead_grows": "no InterCode-SQL figure; FrozenLake 4B at 25%: "
            "GRPO 28.7% vs base 30.3%; the lead grows with T (§9)",
            "full_budget_dynamics": "no InterCode-SQL figure; FrozenLake R_multi +0.568, "
            "R_single -0.091 (§7.5)",
        }
    }
    # the CPU default of `agentrl-jax reproduce sql` (configs/ only override it)
    config_defaults = cpu_defaults(
        {
            "task": {
                "t_max": 10,
                "train_tasks": 1000,
                "eval_tasks": 1000,
                "max_response_tokens": 96,
                "max_context": 2048,
            },
            "model": {"tokenizer_vocab": 1024},
            "warm_start": {
                "demo_tasks": 1000,
                "demos_per_task": 32,
                "batch_size": 16,
                "epochs": 8,
                "group_by_length": True,
            },
            "rl": {
                "runs": ["grpo", "budgetmix"],
                "steps": 10,
                "tasks_per_step": 4,
                "group_size": 4,
                "memory": {"attention": "xla"},
            },
            "eval": {
                "max_response_tokens": 96,
                "max_context": 2048,
                "pass_k_samples": 16,
                "diagnostic_tasks": None,
            },
        }
    )

    def tasks(self, task: Any, *, split: str, count: int) -> EnvTasks:
        if task.options.get("data") is not None:  # Spider: train on train, test on dev
            split = SPIDER_SPLITS[split]
        # the split fixes the tasks: no seed
        options = {**task.options, "split": split, "limit": count}
        return with_t_max(make(task.env, **options), task.t_max)

    def has_split(self, entry: EnvEntry) -> bool:
        return True

    def plan(self, tasks: EnvTasks, task_id: int) -> list[str]:
        gold = inner_env(tasks.env).tasks[int(task_id)].gold_query.strip()
        return [f"<sql>{gold}</sql>", f"<submit>{gold}</submit>"]
