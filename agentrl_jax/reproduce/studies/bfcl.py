"""BFCL v3 multi-turn's study: what ``agentrl-jax reproduce bfcl`` knows beyond the rollout.

* **tasks**: bfcl-eval's ``multi_turn_base`` (``task.options.categories``, ``data``) split in
  two by a hash of each task id (:func:`envs.splits.hash_split`).
* **demonstrations**: the annotated trajectory (:func:`envs.bfcl.env.reference_responses`:
  per request its calls as one list, then an answer without a call); a mistake plays another
  task's reply of the same step, an erroneous call prefix that changes the state (§7), after
  which the checker fails the request. The structural bound is the annotation's length
  (``BfclTask.min_turns``), which adaptive BudgetMix reads.
"""

from __future__ import annotations

from agentrl_jax.reproduce.studies.base import Study, cpu_defaults, inner_env
from envs.bfcl.env import reference_responses
from envs.protocol import EnvTasks


class BfclStudy(Study):
    """The study of the ``bfcl`` environment (module docstring)."""

    demonstrations = "annotated-call demonstrations"
    paper_figures = {
        "texts": {  # PAPER.md §9
            "lead_grows": "BFCL 25%: GRPO 2.5% vs base 3.0%; the lead grows with T (§9)"
        }
    }
    bound = "a necessary condition: every request needs an answer and, with annotated calls, a call"
    # the CPU default of `agentrl-jax reproduce bfcl` (configs/ only override it)
    config_defaults = cpu_defaults(
        {
            "task": {
                "t_max": 24,
                "train_tasks": 1000,
                "eval_tasks": 16,
                "max_response_tokens": 128,
                "max_context": 8192,
            },
            "model": {"tokenizer_vocab": 2048},
            "warm_start": {
                "demo_tasks": 1000,
                "demos_per_task": 2,
                "batch_size": 4,
                "epochs": 2,
                "group_by_length": True,
            },
            "rl": {
                "runs": ["grpo", "budgetmix"],
                "steps": 6,
                "tasks_per_step": 2,
                "group_size": 4,
                "memory": {"attention": "blocked"},
            },
            "eval": {
                "max_response_tokens": 128,
                "max_context": 8192,
                "samples": 4,
                "k": 4,
                "budgets": [6],
                "pass_k_samples": 4,
                "likelihood_samples": 1,
                "diagnostic_tasks": 8,
                "attention": "blocked",
            },
        }
    )

    def plan(self, tasks: EnvTasks, task_id: int) -> list[str]:
        return reference_responses(inner_env(tasks.env).tasks[int(task_id)])

    def bound_note_for(self, options) -> str:
        return self.bound
