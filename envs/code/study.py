"""DeepCoder-MT's study: what ``agentrl-jax reproduce code`` knows beyond the rollout.

* **tasks**: HumanEval (or a DeepCoder JSONL file, ``task.options.data``) split in two by a
  hash of each task id (:func:`envs.study.hash_split`), so no test task is trained on.
* **demonstrations**: each task's known-correct program (``CodeTask.reference``: HumanEval's
  prompt + canonical solution) in one fenced block; a mistake submits another task's program,
  whose failing tests the next observation lists, and the demonstrator then submits the right
  one. Data without references (DeepCoder JSONL) cannot warm-start a random-init policy.
* **R_single**: the share of unit tests each turn's program passes (``TurnResult.quality``),
  the step quality the paper's DeepCoder-MT diagnostics use (§7).
"""

from __future__ import annotations

from envs.registry import EnvTasks
from envs.study import Study, StudyError, inner_env


class CodeStudy(Study):
    """The study of the ``code`` environment (module docstring)."""

    demonstrations = "reference-program demonstrations"
    records_quality = True
    # the CPU default of `agentrl-jax reproduce code` (configs/code_cpu.yaml holds the same values)
    config_defaults = {
        "task": {"t_max": 10, "train_tasks": 1000, "eval_tasks": 16,
                 "max_response_tokens": 256, "max_context": 2048},
        "model": {"tokenizer_vocab": 2048},
        "warm_start": {"demo_tasks": 1000, "demos_per_task": 2, "batch_size": 8,
                       "epochs": 10, "group_by_length": True},
        "rl": {"runs": ["grpo", "budgetmix"], "steps": 8, "tasks_per_step": 2, "group_size": 4,
               "attention": "blocked"},
        "eval": {"max_response_tokens": 256, "max_context": 2048, "samples": 4, "k": 4,
                 "budgets": [2], "pass_k_samples": 4, "likelihood_samples": 1,
                 "diagnostic_tasks": 8, "attention": "blocked"},
    }

    def plan(self, tasks: EnvTasks, task_id: int) -> list[str]:
        task = inner_env(tasks.env).tasks[int(task_id)]
        if task.reference is None:
            raise StudyError(f"code task {task.task_id!r} has no reference program to demonstrate; "
                             "give a pretrained model (model.model_dir) with warm_start.enabled: false")
        return [f"```python\n{task.reference.strip()}\n```"]
