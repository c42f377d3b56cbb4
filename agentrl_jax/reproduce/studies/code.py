"""DeepCoder-MT's study: what ``agentrl-jax reproduce code`` knows beyond the rollout.

* **tasks**: HumanEval (or a DeepCoder JSONL file, ``task.options.data``) split in two by a
  hash of each task id (:func:`envs.splits.hash_split`), so no test task is trained on.
* **demonstrations**: each task's known-correct program (``CodeTask.reference``: HumanEval's
  prompt + canonical solution) in one fenced block; a mistake submits another task's program,
  whose failing tests the next observation lists, and the demonstrator then submits the right
  one. Data without references (DeepCoder JSONL) cannot warm-start a random-init policy.
* **R_single**: the share of unit tests each turn's program passes (``TurnResult.quality``),
  the step quality the paper's DeepCoder-MT diagnostics use (§7).
* **step diagnostics** (:meth:`CodeStudy.state_diagnostics`): a state is a task and the
  responses played so far; a response's quality there is its program's test pass share; an
  error is the reference program with one mutation that makes a test fail
  (:mod:`envs.code.mutation`), submitted as the next turn.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentrl_jax.reproduce.studies.base import (
    ALL_ANALYSES,
    Study,
    StudyError,
    cpu_defaults,
    inner_env,
)
from envs.code.mutation import failing_mutant
from envs.protocol import EnvTasks


def fenced(program: str) -> str:
    """``program`` as a response: one fenced Python block."""
    return f"```python\n{program.strip()}\n```"


class CodeStudy(Study):
    """The study of the ``code`` environment (module docstring)."""

    analyses = ALL_ANALYSES
    demonstrations = "reference-program demonstrations"
    records_quality = True
    paper_figures = {  # PAPER.md §7.1, §7.2, §7.5: DeepCoder-MT's own figures
        "texts": {
            "error_recovery": "DeepCoder-MT: RL better on 46.8% of matched states (mean "
            "-0.005) but 67.3% of error states; continuation 38.5% vs "
            "22.9% (§7.1, §7.2)",
            "full_budget_dynamics": "DeepCoder-MT R_multi +0.331, R_single -0.097 (§7.5)",
        },
        "error_recovery_gain": 0.385 - 0.229,
        "r_multi": 0.331,
        "r_single": 0.097,
    }
    # the CPU default of `agentrl-jax reproduce code` (configs/ only override it)
    config_defaults = cpu_defaults(
        {
            "task": {
                "t_max": 10,
                "train_tasks": 1000,
                "eval_tasks": 16,
                "max_response_tokens": 256,
                "max_context": 2048,
            },
            "model": {"tokenizer_vocab": 2048},
            "warm_start": {
                "demo_tasks": 1000,
                "demos_per_task": 2,
                "batch_size": 8,
                "epochs": 10,
                "group_by_length": True,
            },
            "rl": {
                "runs": ["grpo", "budgetmix"],
                "steps": 8,
                "tasks_per_step": 2,
                "group_size": 4,
                "memory": {"attention": "blocked"},
            },
            "eval": {
                "max_response_tokens": 256,
                "max_context": 2048,
                "samples": 4,
                "k": 4,
                "budgets": [2],
                "pass_k_samples": 4,
                "likelihood_samples": 1,
                "diagnostic_tasks": 8,
                "states": 8,
                "group_size": 4,
                "source_samples": 1,
                "attention": "blocked",
            },
        }
    )

    def plan(self, tasks: EnvTasks, task_id: int) -> list[str]:
        task = inner_env(tasks.env).tasks[int(task_id)]
        if task.reference is None:
            raise StudyError(
                f"code task {task.task_id!r} has no reference program to demonstrate; "
                "give a pretrained model (model.model_dir) with warm_start.enabled: false"
            )
        return [fenced(task.reference)]

    def corpus(self, tasks: EnvTasks, task_ids, *, t_max: int, prompt: Any) -> list[str]:
        """The generic corpus and the headers of a state's history (the step diagnostics'
        prompts, :func:`~agentrl_jax.evaluation.text_states.render_history`)."""
        from agentrl_jax.evaluation.text_states import HISTORY_HEADER

        headers = [HISTORY_HEADER] + [
            f"[TURN {k} {part}]" for k in range(t_max) for part in ("RESPONSE", "RESULT")
        ]
        return super().corpus(tasks, task_ids, t_max=t_max, prompt=prompt) + headers * 16

    def state_diagnostics(self, tasks: EnvTasks) -> Any:
        from agentrl_jax.evaluation.state_diagnostics import RecordedQualityStates

        env = inner_env(tasks.env)
        return RecordedQualityStates(
            env,
            error_reply=MutatedReference(env),
            quality_name="test pass share",
            quality_symbol="pass share",
            suite="deepcoder-mt-error-recovery/v1",
            error_note="one injected submission: the reference program with one mutation "
            "that fails a test",
            success_note="passing every test within the remaining budget",
            action_pattern=r"```.*?(?:```|$)",
            action_note="the fenced code block the program is read from, fences included",
        )


class MutatedReference:
    """``error_reply(task_id, rng)`` for code tasks: the task's reference program with one
    mutation that fails a test (:func:`~envs.code.mutation.failing_mutant`, ``rng`` picks
    the order mutants are tried in), fenced; None for a task without a reference or without
    such a mutant. A task's reply is found once and then reused."""

    def __init__(self, env: Any, *, tries: int = 8):
        self.env, self.tries = env, tries
        self._replies: dict[int, str | None] = {}

    def pass_share(self, task_id: int, program: str) -> float:
        results = self.env.run_program(task_id, program)
        return sum(r.passed for r in results) / len(results)

    def __call__(self, task_id: int, rng: np.random.Generator) -> str | None:
        task_id = int(task_id)
        if task_id not in self._replies:
            reference = self.env.tasks[task_id].reference
            found = (
                None
                if reference is None
                else failing_mutant(
                    reference, lambda p: self.pass_share(task_id, p), rng, tries=self.tries
                )
            )
            self._replies[task_id] = None if found is None else fenced(found[0])
        return self._replies[task_id]
