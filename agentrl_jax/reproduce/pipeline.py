"""The reproduction as resumable phases writing one results folder.

Phases, in order (each writes only under ``out/``)::

    setup           models/init/            a random Qwen3 + small tokenizer (or a local Qwen3)
    demos           warm_start/demos.npz    the study's demonstrations with mistakes, in the real
                                            rollout
    warm_start      models/base/            behaviour cloning -> the base policy
    train:<run>     runs/<run>/, models/<run>/   each RL run (checkpoints, metrics.jsonl)
    eval:<analysis> raw/, figures, sections/     Table 1, Pass@K, diagnostics, dynamics
    report          report.md, findings.json

The folder's files are :mod:`.folder`'s: ``out/phases.json`` records each finished phase (seconds,
outputs); a rerun skips them, and an unfinished training phase resumes from its newest Orbax
checkpoint. ``out/config.yaml`` is the exact config; rerunning on a folder made with a different
config is refused (start afresh with ``fresh=True`` or another folder) so a report never mixes
settings.

Several processes (:mod:`agentrl_jax.distributed`; ``OUT`` on a file system they all see)
run the same phases in step: the RL runs train on the global mesh with each process's
rollouts on its own devices, the evaluation's rollouts split their rows over the processes;
the likelihood analysis scores each process's share of the rows; the ``warm_start`` trains on
the global mesh, each process supplying its share of every batch's rows (with
``mesh.ordered_sums``, to the bits one process gives); ``setup``, ``demos``, the analyses
that read only what was saved (``eval:dynamics``) and ``report`` run on the main process
alone, which also writes every file but the Orbax checkpoints (written by all); the others
wait for each phase at a barrier, and write what an analysis writes to a scratch folder of
their own. ``out/plugins.json`` records the user plugins (:mod:`agentrl_jax.plugins`: files
and their sha256) the runs were made with; they also go into each checkpoint's metadata and
the report, and an error loading the folder's config names them. One progress bar
(:mod:`.progress`) counts the predicted seconds of every phase (its work units, e.g.
trajectory-turns, at their predicted cost), with the phase name, the update count while
training, and the ETA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from agentrl_jax import distributed
from agentrl_jax.errors import did_you_mean
from agentrl_jax.evaluation.analyses import registry
from agentrl_jax.evaluation.analyses.context import run_analysis
from agentrl_jax.evaluation.evaluate_policies import make_tasks
from agentrl_jax.evaluation.full_report import write_report
from agentrl_jax.evaluation.raw import counterparts_of_runs
from agentrl_jax.evaluation.verdicts import PaperFigures
from agentrl_jax.folders import SCRATCH, claim, remove_folder
from agentrl_jax.models import load_qwen3
from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.process_rewards import JudgeScorer, LocalModelJudge
from agentrl_jax.prompts import BudgetPrompt
from agentrl_jax.reproduce import demos as demo_lib
from agentrl_jax.reproduce import machine, sft
from agentrl_jax.reproduce.config import ReproduceConfig
from agentrl_jax.reproduce.folder import Phases, ReproduceError, prepare_folder, recorded_plugins
from agentrl_jax.reproduce.policy_init import random_qwen3, save_policy
from agentrl_jax.reproduce.progress import DEMO_TASKS_PER_CALL, PhaseWork, Progress
from agentrl_jax.reproduce.studies import StudyError
from agentrl_jax.sharding import training_mesh
from agentrl_jax.train.presets import RunSettings
from agentrl_jax.train.run import snapshot_params, snapshot_steps, train_policy
from agentrl_jax.trajectory import Trajectory

BASE = "base"
# phases with no collectives: the main process runs them alone (module docstring), with the
# analyses that read only what was saved (no policy: no rollout)
MAIN_ONLY = ("setup", "demos", "report")


def main_only(phase: str) -> bool:
    """Whether the main process runs ``phase`` alone (no collectives)."""
    if phase.startswith("eval:"):
        return not registry.get(phase[5:]).needs_models
    return phase in MAIN_ONLY


# ---------------------------------------------------------------- the run


def phase_names(config: ReproduceConfig) -> list[str]:
    """The phases of ``config``, in order (see the module docstring)."""
    names = [] if config.model.model_dir is not None else ["setup"]
    if config.warm_start.enabled:
        names += ["demos", "warm_start"]
    names += [f"train:{name}" for name in config.rl.run_names]
    names += [f"eval:{a}" for a in config.study.analyses_for(registry.names())]
    return names + ["report"]


def last_training_phase(config: ReproduceConfig) -> str:
    """The last phase ``agentrl-jax train`` runs: the last RL run's."""
    return [name for name in phase_names(config) if name.startswith("train:")][-1]


def check_until(config: ReproduceConfig, until: str | None) -> None:
    names = phase_names(config)
    if until is not None and until not in names:
        raise ReproduceError(
            f"--until: unknown phase {until!r}; phases: {', '.join(names)}"
            + did_you_mean(until, names)
        )


def check_mesh(config: ReproduceConfig) -> None:
    """The ``mesh`` section lays out this machine's devices (training and rollout devices):
    else one line naming it, before the results folder is touched."""
    try:
        training_mesh(config.mesh)
    except ValueError as error:
        raise ReproduceError(
            f"mesh: {error} (this run has {jax.device_count()} device(s) in "
            f"{jax.process_count()} process(es); e.g. --set mesh.data=-1 uses them all)"
        ) from None


def check_model_dirs(config: ReproduceConfig) -> None:
    """Each model folder ``config`` names (``model.model_dir``, ``rl.judge_model_dir``) holds a
    readable Qwen3 ``config.json``: else one line naming the field and the folder, before the
    results folder is touched (so the corrected command runs in the same folder)."""
    for field, folder in (
        ("model.model_dir", config.model.model_dir),
        ("rl.judge_model_dir", config.rl.judge_model_dir),
    ):
        if folder is None:
            continue
        try:
            Qwen3Config.from_model_dir(folder)
        except (OSError, ValueError) as error:  # missing, empty, unreadable, not a Qwen3
            raise ReproduceError(f"{field}: {error}") from None


class RunSnapshots:
    """The erosion analysis' view of a reproduction's RL runs over training
    (:class:`~agentrl_jax.evaluation.analyses.context.Snapshots`): the steps of each run's kept
    checkpoints (``rl.checkpoint.every``, ``rl.checkpoint.keep``) and the policy at one of
    them, restored read-only on this process's devices."""

    def __init__(self, reproduction: "Reproduction"):
        self.reproduction = reproduction

    def _spec(self, label: str) -> RunSettings:
        return next(spec for spec in self.reproduction.runs if spec.label == label)

    def _dir(self, label: str) -> Path:
        return self.reproduction.out / "runs" / self._spec(label).name

    def steps(self, label: str) -> list[int]:
        return snapshot_steps(self._dir(label))

    def load(self, label: str, step: int) -> Any:
        r = self.reproduction
        model = r.load_model(r.base_dir, local=True)
        params = snapshot_params(
            model, r.tokenizer, r.config, self._spec(label), self._dir(label), step
        )
        nnx.update(model, params)
        return model


class Reproduction:
    """Runs the phases of one config into one folder (see the module docstring)."""

    def __init__(
        self,
        config: ReproduceConfig,
        out: str | Path,
        *,
        fresh: bool = False,
        progress: bool = True,
        log: Callable[[str], None] = print,
        command: str = "reproduce",
        resume_with: str | None = None,
    ):
        self.config, self.out = config, Path(out)
        # the command the messages name (``reproduce`` or ``train``) and the one that resumes
        # this run (the rerun of the same command; default: ``reproduce`` on this folder)
        self.command = command
        self.resume_with = resume_with or f"agentrl-jax {command} ... --out {self.out}"
        self._where = ""  # the running phase's position (e.g. "update 3/8"), for an interrupt
        self.main = distributed.is_main()
        # the tasks (and the demonstrations' tasks) before the folder is touched: data that
        # cannot be read, or demonstrated, is one line, and the corrected command runs there
        self.runs = config.rl.resolved_runs()
        self.study = config.study
        self.tasks = make_tasks(config)
        try:
            if config.warm_start.enabled:
                self.demo_ids  # noqa: B018 (now: a ReproduceError if none can be demonstrated)
            if self.main:
                prepare_folder(self.out, config, fresh)
        except BaseException:
            self.tasks.close()
            raise
        distributed.barrier("reproduce:folder")
        self.phases = Phases(self.out)
        # where this process writes an analysis' files: the folder, or (not the main
        # process) a scratch folder of its own
        self.written = (
            self.out if self.main else claim(tempfile.mkdtemp(prefix="agentrl-jax-"), SCRATCH)
        )
        self.log = log
        self.mesh = self._mesh()
        self.local_mesh = distributed.local_mesh(self.mesh)  # rollouts and evaluation
        self.work = PhaseWork(
            config,
            self.demo_tasks if config.warm_start.enabled else 0,
            len(self.tasks.test.names),
            self.policy_names(),
        )
        self.progress = Progress(
            self.work, self.phase_names(), enabled=progress and self.main, desc=command
        )
        self.bar = self.progress.bar

    # -- layout
    def model_dir(self, name: str) -> Path:
        return self.out / "models" / name

    @property
    def init_dir(self) -> Path:
        if self.config.model.model_dir is not None:
            return Path(self.config.model.model_dir)
        return self.model_dir("init")

    @property
    def base_dir(self) -> Path:
        return self.model_dir(BASE) if self.config.warm_start.enabled else self.init_dir

    def _mesh(self):
        return training_mesh(self.config.mesh)

    def _dtype(self):
        return {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16}[
            self.config.model.dtype
        ]

    def load_model(self, model_dir: Path, *, local: bool = False, param_dtype: Any = None):
        """A policy directory's model, its parameters placed by the rules of the global mesh
        (``local``: of this process's part of it, where rollouts and evaluation run), stored
        in ``param_dtype`` (None: a LoRA run's ``rl.lora.base_dtype`` where set, so a frozen
        base and the policies made from it are held once in it; else float32)."""
        lora = self.config.rl.lora
        default = (lora and lora.base_dtype) or "float32"
        return load_qwen3(
            model_dir,
            dtype=self._dtype(),
            param_dtype=jax.numpy.dtype(param_dtype or default),
            mesh=self.local_mesh if local else self.mesh,
        )

    # -- phases
    def phase_names(self) -> list[str]:
        return phase_names(self.config)

    @functools.cached_property
    def demo_ids(self) -> np.ndarray:
        """The training tasks demonstrated: the first ``warm_start.demo_tasks`` the study's
        demonstrator can play (:meth:`agentrl_jax.reproduce.studies.Study.demonstrable`)."""
        first = np.arange(min(self.config.warm_start.demo_tasks, len(self.tasks.train.names)))
        try:
            ids = self.study.demonstrable(self.tasks.train, first)
        except StudyError as error:
            raise ReproduceError(f"warm start ({self.config.task.env}): {error}") from None
        if len(ids) == 0:
            raise ReproduceError(
                f"warm start ({self.config.task.env}): the demonstrator can play "
                "none of the training tasks (their first observations do not "
                "tell them apart)"
            )
        return ids

    @property
    def demo_tasks(self) -> int:
        return len(self.demo_ids)

    def policy_names(self) -> list[str]:
        return [BASE] + [r.label for r in self.runs]

    def run(self, until: str | None = None) -> Path:
        """Every phase not yet finished, up to and including ``until`` (default: all);
        returns the report's path (written once the ``report`` phase has run)."""
        check_until(self.config, until)
        names = self.phase_names()
        if until is not None:
            names = names[: names.index(until) + 1]
        started = time.perf_counter()
        if self.main and self.phases.done and not all(p in self.phases.done for p in names):
            self.log(f"{self.command}: resuming {self.out}: {self.saved_text(names)}")
        phase = None
        try:
            for phase in names:
                if phase in self.phases.done:
                    self.progress.skip(phase)
                    continue
                self._where = ""
                self.progress.start(phase)
                began = time.perf_counter()
                info = (self._run_phase(phase) or {}) if self.main or not main_only(phase) else {}
                self.progress.finish(phase)
                if self.main:
                    self.phases.finish(phase, time.perf_counter() - began, **info)
                distributed.barrier(f"reproduce:{phase}")  # its files are written
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as the command line turns it
            if self.main:
                self.bar.close()
                where = f" at {self._where}" if self._where else ""
                self.log(
                    f"{self.command}: interrupted during {phase}{where}; saved: "
                    f"{self.saved_text(names)}; resume with: {self.resume_with}"
                )
            raise
        finally:
            self.bar.close()
            self.tasks.close()
            if not self.main:
                with contextlib.suppress(OSError):  # a scratch folder left behind is harmless
                    remove_folder(self.written, SCRATCH)
        report = self.out / "report.md"
        finished = "report" in self.phases.done or self.command != "reproduce"
        self.log(
            f"{self.command}: {'done' if finished else f'stopped after {until}'} "
            f"in {time.perf_counter() - started:.0f} s (this invocation)"
            + (f"; report: {report}" if report.exists() else "")
        )
        return report

    def saved_text(self, names: list[str]) -> str:
        """What a rerun keeps of ``names``: the finished phases, then each unfinished RL run's
        newest checkpoint (or that it has none yet and starts over)."""
        done = [p for p in names if p in self.phases.done]
        parts = [
            "no phase finished"
            if not done
            else f"{len(done)} finished phase{'s' * (len(done) != 1)} ({', '.join(done)})"
        ]
        steps = self.config.rl.steps
        for p in names:
            if p.startswith("train:") and p not in self.phases.done:
                at = _checkpointed_steps(self.out / "runs" / p[6:])
                if at:
                    parts.append(f"{p} from its checkpoint at update {at}/{steps}")
                elif (self.out / "runs" / p[6:]).exists():
                    parts.append(f"{p} has no checkpoint yet (it starts again at update 0)")
        return "; ".join(parts)

    def _run_phase(self, phase: str) -> dict[str, Any] | None:
        if phase == "setup":
            return self.setup()
        if phase == "demos":
            return self.collect_demos()
        if phase == "warm_start":
            return self.warm_start()
        if phase.startswith("train:"):
            return self.train(next(r for r in self.runs if r.name == phase[6:]))
        if phase.startswith("eval:"):
            return self.evaluate(phase[5:])
        return self.report()

    # -- setup, demos, warm start
    def setup(self) -> dict[str, Any]:
        m, t = self.config.model, self.config.task
        corpus = self.study.corpus(
            self.tasks.train, self.demo_ids, t_max=t.t_max, prompt=BudgetPrompt()
        )
        isolate = (
            self.study.tokenizer_isolate if m.tokenizer_isolate else None
        )  # checked by the config
        tokenizer = build_small_tokenizer(
            corpus, vocab_size=m.tokenizer_vocab, split_words=False, isolate=isolate
        )
        model = random_qwen3(
            len(tokenizer),
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads,
            head_dim=m.head_dim,
            max_position_embeddings=max(t.max_context, 2048),
            seed=m.seed,
            eos_token_ids=tokenizer.convert_tokens_to_ids(["<|im_end|>"]),
        )
        save_policy(model, tokenizer, self.init_dir)
        params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        return {"parameters": int(params), "vocab_size": len(tokenizer)}

    @functools.cached_property
    def tokenizer(self):
        """The policies' tokenizer (read once, after ``setup`` has written it)."""
        return load_tokenizer(self.init_dir)

    def collect_demos(self) -> dict[str, Any]:
        ws, t = self.config.warm_start, self.config.task
        env = self.tasks.train.env
        demonstrator = self.study.demonstrator(
            self.tasks.train,
            self.demo_ids,
            t_max=t.t_max,
            mistake_rate=ws.mistake_rate,
            seed=ws.seed,
        )
        demos = demo_lib.collect_demos(
            env,
            self.tokenizer,
            demonstrator,
            self.demo_ids,
            jax.random.key(ws.seed),
            demos_per_task=ws.demos_per_task,
            max_response_tokens=t.max_response_tokens,
            max_context=t.max_context,
            tasks_per_call=DEMO_TASKS_PER_CALL,
            on_call=lambda: self.progress.advance(self.work.demo_call_units),
        )
        overflow = float(np.mean(demos.overflow))
        if overflow == 1.0:
            raise ReproduceError(
                f"every demonstration overflowed task.max_context={t.max_context} "
                "tokens (the prompt alone does not fit); raise task.max_context"
            )
        if overflow > 0:
            self.bar.write(
                f"warning: {overflow:.1%} of the demonstrations overflowed "
                f"task.max_context={t.max_context}; consider raising it"
            )
        path = self.out / "warm_start" / "demos.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path, **{f.name: np.asarray(getattr(demos, f.name)) for f in dataclasses.fields(demos)}
        )
        return {
            "trajectories": int(demos.tokens.shape[0]),
            "success_rate": float(np.mean(demos.success)),
            "mistake_share": demonstrator.mistakes / max(demonstrator.moves, 1),
            "overflow_rate": overflow,
        }

    def warm_start(self) -> dict[str, Any]:
        ws = self.config.warm_start
        with np.load(self.out / "warm_start" / "demos.npz") as data:
            demos = Trajectory.from_arrays(data)
        # on the training mesh, every process supplying its share of each batch's rows
        # (mesh.ordered_sums: the gradients added in an order independent of the process
        # count); it trains every parameter: float32, whatever a LoRA run's base dtype
        model = self.load_model(self.init_dir, param_dtype="float32")
        log_path = self.out / "warm_start" / "history.jsonl"

        steps = sft.num_sft_steps(
            self.demo_tasks * ws.demos_per_task, ws.batch_size, ws.epochs, ws.group_by_length
        )

        def on_step(step: int, record: dict) -> None:
            self.progress.advance(self.work.sft_step_units)
            self.bar.set_postfix_str(f"step {step}/{steps}, nll {record['nll']:.3f}")

        params, history = sft.warm_start(
            model,
            demos,
            batch_size=ws.batch_size,
            epochs=ws.epochs,
            learning_rate=ws.learning_rate,
            weight_decay=ws.weight_decay,
            seed=ws.seed,
            group_by_length=ws.group_by_length,
            attention=self.config.rl.memory.attention,
            on_step=on_step,
            mesh=self.mesh,
            ordered=self.config.mesh.ordered_sums,
        )
        if self.main:
            log_path.write_text("".join(json.dumps(r) + "\n" for r in history))
            nnx.update(
                model, distributed.host_value(params) if distributed.is_multiprocess() else params
            )
            save_policy(model, self.tokenizer, self.model_dir(BASE))
        return {
            "steps": len(history),
            "nll_first": history[0]["nll"],
            "nll_last": history[-1]["nll"],
        }

    # -- RL
    def train(self, spec: RunSettings) -> dict[str, Any]:
        model = self.load_model(self.base_dir)  # a LoRA run's frozen base: in its base_dtype
        run_dir = self.out / "runs" / spec.name

        def on_step(step: int, metrics: dict) -> None:
            self._where = f"update {step}/{self.config.rl.steps}"
            self.progress.advance(self.work.rl_step_units)
            self.bar.set_postfix_str(
                ", ".join(
                    [f"update {step}/{self.config.rl.steps}"]
                    + [f"{k} {metrics[k]:.3f}" for k in ("R_multi", "R_single") if k in metrics]
                )
            )

        already = _checkpointed_steps(run_dir)
        self.progress.advance(already * self.work.rl_step_units)
        params = train_policy(
            model,
            self.tokenizer,
            self.tasks.train,
            spec,
            self.config,
            out=run_dir,
            process_rewards=self.process_rewards(),
            quality_scorer=self.quality_scorer,
            metadata={
                "model_dir": str(self.base_dir.resolve()),
                "run": spec.name,
                "plugins": recorded_plugins(self.out),
            },
            mesh=self.mesh,
            on_step=on_step,
        )
        if self.main:
            nnx.update(model, params)
            save_policy(model, self.tokenizer, self.model_dir(spec.name))
        return {"resumed_from_step": already, "label": spec.label}

    @functools.cached_property
    def quality_scorer(self):
        """R_single's step scorer: the study's (None where it has none), built once."""
        return self.study.step_scorer(self.tasks.train)

    def process_rewards(self):
        """The step scorer ``rl.process_rewards`` names (None: none): ``oracle``, the study's
        step scorer (the same object as R_single's, so it scores each batch once), or
        ``judge``, a local Qwen3 asked about each step (:class:`LocalModelJudge`)."""
        kind = self.config.rl.process_rewards
        if kind is None:
            return None
        if kind == "oracle":
            if self.quality_scorer is None:
                raise ReproduceError(
                    f"rl.process_rewards: oracle needs a step scorer from the "
                    f"{self.config.task.env} environment's study, which has none"
                )
            return self.quality_scorer
        judge = LocalModelJudge.from_model_dir(self.config.rl.judge_model_dir)
        return JudgeScorer(judge, self.tokenizer.decode)

    # -- evaluation and report
    @functools.cached_property
    def eval_models(self) -> dict[str, Any]:
        """``{policy name: model}`` for the evaluation, loaded once for all analyses."""
        models = {BASE: self.load_model(self.base_dir, local=True)}
        for spec in self.runs:
            models[spec.label] = self.load_model(self.model_dir(spec.name), local=True)
        return models

    @functools.cached_property
    def state_diagnostics(self) -> Any:
        """What the step diagnostics score the test tasks' states with (the study's; None
        where it has none), built once for every analysis."""
        return self.study.state_diagnostics(self.tasks.test)

    @functools.cached_property
    def snapshots(self) -> "RunSnapshots":
        """Each RL run's checkpoints, for the erosion analysis."""
        return RunSnapshots(self)

    def evaluate(self, analysis: str) -> dict[str, Any]:
        # what the findings (and the dynamics' summary) compare this run with
        PaperFigures(**self.study.paper_figures).write(self.written)
        logs = {spec.label: self.out / "runs" / spec.name / "metrics.jsonl" for spec in self.runs}
        test, task = self.tasks.test, self.config.task
        run_analysis(
            analysis,
            self.written,
            test.env,
            np.arange(len(test.names)),
            self.tokenizer,
            self.eval_models
            if registry.get(analysis).needs_models
            else dict.fromkeys(self.policy_names()),  # it reads what was saved only
            self.config.eval,
            engine=self.config.engine,
            training_logs=logs,
            progress=self.progress.advance,
            min_turns=self.study.min_turns(test),
            bound_note=self.study.bound_note_for(task.options),
            states=self.state_diagnostics,
            snapshots=self.snapshots,
            counterparts=counterparts_of_runs(self.runs),  # BudgetMix: the runs' settings say
        )
        return {}

    def report(self) -> dict[str, Any]:
        path = write_report(
            self.out,
            header_markdown=self.header_markdown(),
            title=f"{self.config.task.entry.label} reproduction",
        )
        return {"report": str(path)}

    def _machines_text(self) -> str:
        """The machine(s) the finished phases ran on (this one if none recorded it)."""
        machines = self.phases.machines() or [machine.machine()]
        return " then ".join(machine.describe(m) for m in machines)

    def header_markdown(self) -> str:
        c, done = self.config, self.phases.done
        seconds = sum(p["seconds"] for p in done.values())
        base = (
            "a random-init Qwen3 warm-started on " + self.study.demonstrations + " with mistakes"
            if c.warm_start.enabled
            else c.model.model_dir
        )
        lines = [
            f"Policies: base = {base}; "
            + "; ".join(f"{r.label} = {r.name} ({c.rl.steps} updates)" for r in self.runs)
            + ".",
            "Tasks: "
            + self.study.describe(
                c.task.entry,
                c.task.options,
                t_max=c.task.t_max,
                train=self.tasks.train,
                test=self.tasks.test,
            ),
            f"Machine: {self._machines_text()}; phases so far took {seconds:.0f} s in all "
            "(see phases.json). Numbers on CPU depend on whether the CPU has AVX-512 and on the "
            "jax version: compare runs of the same kind of CPU and versions (`agentrl-jax "
            "compare` checks the built-in default against its stored runs).",
            "Exact config: [config.yaml](config.yaml).",
        ]
        plugins = recorded_plugins(self.out)
        if plugins:
            lines.append(
                "Plugins (user code the runs used, [plugins.json](plugins.json)): "
                + ", ".join(
                    f"`{r.get('spec')}` (sha256 {str(r.get('sha256'))[:12]})" for r in plugins
                )
                + "."
            )
        return "\n".join(f"- {line}" for line in lines)


def _checkpointed_steps(run_dir: Path) -> int:
    steps = [int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
    return max(steps, default=0)


def reproduce(
    config: ReproduceConfig,
    out: str | Path,
    *,
    fresh: bool = False,
    progress: bool = True,
    until: str | None = None,
    command: str = "reproduce",
    resume_with: str | None = None,
) -> Path:
    """Run (or resume) the reproduction of ``config`` in ``out``, up to phase ``until``
    (default: all); returns the report's path. ``command`` names the messages (``reproduce``
    or ``train``); ``resume_with`` is the command line an interrupt says resumes the run."""
    check_until(config, until)  # before the folder is touched
    check_model_dirs(config)
    check_mesh(config)
    return Reproduction(
        config, out, fresh=fresh, progress=progress, command=command, resume_with=resume_with
    ).run(until)
