"""``agentrl-jax eval ...``: Pass@(K, T) and the paper's diagnostics (PAPER.md §3, §7) for a
base policy and its RL descendant, written to a results folder.

    agentrl-jax eval passk      --base DIR --rl DIR --out results/   # Pass@K, k = 1..128
    agentrl-jax eval passt      --base DIR --rl DIR --out results/   # Pass@T and Table 1
    agentrl-jax eval steps      --base DIR --rl DIR --out results/   # matched states, depth
    agentrl-jax eval errors     --base DIR --rl DIR --out results/   # error states
    agentrl-jax eval likelihood --base DIR --rl DIR --out results/   # ActionNLL, LLR
    agentrl-jax eval report     --out results/ [--training-log metrics.jsonl]
    agentrl-jax eval env-passk|env-passt --env sql|code|bfcl ...     # see cli/eval_envs.py

A policy is a Hugging Face model directory or a training checkpoint (a run's checkpoint
directory or one step of it; see :mod:`agentrl_jax.evaluation.policies`). The tasks are
FrozenLake maps generated from ``--map-seed`` (test split by default). Each analysis writes
JSON, CSV and figures (PNG + PDF) through :mod:`agentrl_jax.evaluation.report`, its settings
to ``settings/<analysis>.json`` and its report sections to ``sections/<analysis>.json``;
``report`` assembles the sections present into ``report.md``. ``steps`` and ``errors`` with
the same settings use the same state pool.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:  # the heavy imports wait until a command runs
    import numpy as np

    from agentrl_jax.evaluation.policies import LoadedPolicy
    from agentrl_jax.rollout import RolloutConfig
    from envs.frozenlake.text_env import FrozenLakeTextEnv

app = typer.Typer(
    help="Evaluate a base policy and its RL descendant: Pass@(K, T) and the "
    "paper's diagnostics, with figures and a Markdown report.",
    no_args_is_help=True,
)

NAMES = ("base", "RL")
SETTINGS_DIR = "settings"
# Order of the analyses in the report (the streams of randomness: evaluation.drivers.STREAMS).
ORDER = ("passk", "passt", "steps", "errors", "likelihood", "training")


# Options every analysis takes: (name, type, typer.Option).
_COMMON = (
    (
        "base",
        Path,
        typer.Option(
            ..., help="Base policy: a Hugging Face model directory or a training checkpoint."
        ),
    ),
    (
        "rl",
        Optional[Path],
        typer.Option(
            None,
            help="RL policy: a Hugging Face model directory or "
            "a training checkpoint (required except for "
            "passk/passt).",
        ),
    ),
    (
        "base_model_dir",
        Optional[Path],
        typer.Option(
            None,
            help="Hugging Face directory a base "
            "checkpoint was trained from "
            "(default: the one it records).",
        ),
    ),
    (
        "rl_model_dir",
        Optional[Path],
        typer.Option(
            None,
            help="Hugging Face directory an RL "
            "checkpoint was trained from "
            "(default: the one it records).",
        ),
    ),
    ("out", Path, typer.Option(..., help="Results folder.")),
    ("maps", int, typer.Option(64, help="FrozenLake maps to evaluate on (the tasks).", min=1)),
    ("map_size", int, typer.Option(8, help="Map side n.", min=2)),
    (
        "map_p",
        float,
        typer.Option(0.8, help="Probability that a cell is frozen.", min=0.0, max=1.0),
    ),
    ("map_seed", int, typer.Option(0, help="Seed of the maps.")),
    ("split", str, typer.Option("test", help="Map split: test, train or any.")),
    (
        "random_start_goal",
        bool,
        typer.Option(False, help="Random start and goal cells (else the corners)."),
    ),
    ("t_max", int, typer.Option(70, help="Largest turn budget T_max (paper §2: 70).", min=1)),
    ("slippery", bool, typer.Option(True, help="gymnasium's slippery dynamics.")),
    (
        "success_rate",
        float,
        typer.Option(
            1.0 / 3.0, help="Probability of the intended move when slippery.", min=0.0, max=1.0
        ),
    ),
    ("max_response_tokens", int, typer.Option(256, help="Most tokens of one response.", min=1)),
    ("max_context", int, typer.Option(4096, help="Tokens of context per trajectory.", min=1)),
    (
        "temperature",
        float,
        typer.Option(0.6, help="Sampling temperature (paper §3: 0.6).", min=0.0),
    ),
    (
        "top_p",
        float,
        typer.Option(0.9, help="Nucleus sampling top-p (paper §3: 0.9).", min=0.0, max=1.0),
    ),
    ("thinking", bool, typer.Option(False, help="Qwen3's thinking mode in the chat template.")),
    ("seed", int, typer.Option(0, help="Seed of the sampling and the environment's randomness.")),
    (
        "tasks_per_call",
        Optional[int],
        typer.Option(None, help="Tasks per rollout call (bounds memory).", min=1),
    ),
    # 16: reproduce.evaluate.KV_PAGE_SIZE, repeated to keep jax out of the CLI's start-up
    (
        "kv_page_size",
        int,
        typer.Option(
            16,
            help="Tokens per page of the paged KV cache (0: the "
            "static cache, the reference engine; same tokens).",
            min=0,
        ),
    ),
)


@dataclasses.dataclass
class Setup:
    """Everything an analysis needs, built from the common options."""

    out: Path
    env: FrozenLakeTextEnv
    task_ids: np.ndarray
    config: RolloutConfig
    seed: int
    tasks_per_call: int | None
    kv_page_size: int
    base: LoadedPolicy
    rl: LoadedPolicy | None
    settings: dict[str, Any]

    def key(self, stream: str):
        from agentrl_jax.evaluation.drivers import stream_key

        return stream_key(self.seed, stream)

    def play(self, states_per_call: int | None = None):
        """Where the policies play (:class:`~agentrl_jax.evaluation.drivers.Play`), saying what
        it samples."""
        from agentrl_jax.evaluation.drivers import Play

        return Play(
            self.env,
            self.base.tokenizer,
            self.task_ids,
            self.config,
            tasks_per_call=self.tasks_per_call,
            states_per_call=states_per_call,
            echo=typer.echo,
        )

    @functools.cached_property
    def policies(self) -> dict[str, Any]:
        """Samplers of the loaded policies (one each, sharing compilations when the models
        allow)."""
        from agentrl_jax.evaluation.policies import sampler_policies
        from agentrl_jax.policy import SamplerPolicy
        from agentrl_jax.sampling import Paging

        paging = Paging(page_size=self.kv_page_size) if self.kv_page_size else None
        if self.rl is None:
            return {NAMES[0]: SamplerPolicy(self.base.model, paging=paging)}
        return dict(zip(NAMES, sampler_policies(self.base, self.rl, paging=paging)))

    def require_rl(self, analysis: str) -> None:
        if self.rl is None:
            raise typer.BadParameter(f"`{analysis}` compares two policies: pass --rl")


def _setup(options: dict[str, Any]) -> Setup:
    import jax
    import numpy as np

    from agentrl_jax.cli.paths import output_folder
    from agentrl_jax.evaluation import passt
    from agentrl_jax.evaluation.policies import PolicyLoadError, load_policy, same_tokenizer
    from envs.frozenlake import maps as fl_maps
    from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

    o = dict(options)
    output_folder(o["out"])
    if o["split"] not in ("test", "train", "any"):
        raise typer.BadParameter(f"--split must be test, train or any, got {o['split']!r}")
    try:
        base = load_policy(o["base"], model_dir=o["base_model_dir"])
        rl = None if o["rl"] is None else load_policy(o["rl"], model_dir=o["rl_model_dir"])
    except PolicyLoadError as error:
        raise typer.BadParameter(str(error)) from None
    if rl is not None and not same_tokenizer(base, rl):
        raise typer.BadParameter(
            f"the policies {o['base']} and {o['rl']} use different tokenizers; "
            "they must share one to be compared on the same prompts"
        )
    tiles = fl_maps.generate(
        jax.random.key(o["map_seed"]),
        o["maps"],
        size=o["map_size"],
        p=o["map_p"],
        random_start_goal=o["random_start_goal"],
        split=None if o["split"] == "any" else o["split"],
    )
    env = FrozenLakeTextEnv(
        np.asarray(tiles),
        FrozenLakeTextConfig(
            t_max=o["t_max"], is_slippery=o["slippery"], success_rate=o["success_rate"]
        ),
    )
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
        max_response_tokens=o["max_response_tokens"],
        max_context=o["max_context"],
        sampling=sampling,
        enable_thinking=o["thinking"],
    )
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in o.items()}
    settings["policies"] = {NAMES[0]: base.describe(), **({NAMES[1]: rl.describe()} if rl else {})}
    return Setup(
        o["out"],
        env,
        np.arange(o["maps"]),
        config,
        o["seed"],
        o["tasks_per_call"],
        o["kv_page_size"],
        base,
        rl,
        settings,
    )


def _analysis(name: str):
    """Register an analysis command: its own options plus :data:`_COMMON`, called with a
    :class:`Setup` instead of the common options."""

    def decorate(fn):
        own = [p for p in inspect.signature(fn).parameters.values() if p.name != "setup"]
        common = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=t)
            for n, t, d in _COMMON
        ]

        @functools.wraps(fn)
        def command(**kwargs):
            options = {n: kwargs.pop(n) for n, _, _ in _COMMON}
            setup = _setup(options)
            setup.settings.update(command=name, **kwargs)
            fn(setup=setup, **kwargs)

        command.__signature__ = inspect.Signature(own + common)
        return app.command(name)(command)

    return decorate


def _save_sections(setup: Setup, analysis: str, sections: list) -> None:
    """Write the analysis' settings and its report sections (the settings file is linked)."""
    from agentrl_jax.evaluation import report

    settings = report.write_json(setup.out / SETTINGS_DIR / f"{analysis}.json", setup.settings)
    rel = settings.relative_to(setup.out).as_posix()
    sections = [dataclasses.replace(sections[0], files=sections[0].files + (rel,))] + sections[1:]
    report.write_sections(setup.out, analysis, sections)
    for section in sections:
        typer.echo(f"{section.title}: {section.text}")
    typer.echo(
        f"Wrote {analysis} results to {setup.out} "
        f"(assemble the report: agentrl-jax eval report --out {setup.out})"
    )


# ---------------------------------------------------------------- Pass@K and Pass@T


@_analysis("passk")
def passk_command(
    setup: Setup,
    samples: int = typer.Option(
        128, help="Trajectories per task at the full budget (k = 1..samples).", min=1
    ),
) -> None:
    """Pass@K at the full budget T_max, k = 1..128 (paper §3)."""
    from agentrl_jax.evaluation import drivers, report
    from agentrl_jax.evaluation.analyses import pass_at_k

    counts = drivers.pass_at_k_counts(
        setup.play(), setup.policies, setup.key("passk"), samples=samples
    )
    section = pass_at_k.section(setup.out, pass_at_k.compute(counts))
    raw = report.write_json(
        setup.out / "pass_at_k_counts.json",
        {name: {"n": n, "c": c} for name, (n, c) in counts.items()},
    )
    section = dataclasses.replace(
        section, files=section.files + (raw.relative_to(setup.out).as_posix(),)
    )
    _save_sections(setup, "passk", [section])


def _budgets(text: str | None, t_max: int) -> tuple[int, ...]:
    from agentrl_jax.evaluation import passt

    if text is None:
        return passt.default_budgets(t_max)
    try:
        budgets = tuple(sorted({int(b) for b in text.split(",") if b.strip()}))
    except ValueError:
        raise typer.BadParameter(
            f"--budgets must be comma-separated integers, got {text!r}"
        ) from None
    if not budgets or budgets[0] < 1 or budgets[-1] > t_max:
        raise typer.BadParameter(f"--budgets must lie in [1, T_max={t_max}], got {text!r}")
    return budgets


@_analysis("passt")
def passt_command(
    setup: Setup,
    samples: int = typer.Option(8, help="Trajectories per task at each budget.", min=1),
    k: int = typer.Option(8, help="k of Pass@(k, T) (paper §3: 8).", min=1),
    budgets: Optional[str] = typer.Option(
        None,
        help="Comma-separated budgets T (default: every 10% of T_max and "
        "the 25/50/75/100% levels).",
    ),
) -> None:
    """Pass@(k, T) against the budget, each T sampled afresh with T in the prompt; Table 1."""
    from agentrl_jax.evaluation import drivers, passk
    from agentrl_jax.evaluation.analyses import pass_at_t

    if k > samples:
        raise typer.BadParameter(f"--k {k} needs at least as many --samples (got {samples})")
    chosen = _budgets(budgets, setup.env.t_max)
    results = drivers.pass_at_t_counts(
        setup.play(), setup.policies, setup.key("passt"), budgets=chosen, samples=samples
    )
    levels = passk.budget_levels(setup.env.t_max)
    with_table = set(levels) <= set(chosen)
    if not with_table:
        typer.echo(f"(no Table 1: the budgets do not include all of {list(levels)})")
    sections = pass_at_t.section(
        setup.out,
        pass_at_t.compute(
            results,
            k=k,
            t_max=setup.env.t_max if with_table else None,
            shortest_paths=setup.env.structural_bounds(setup.task_ids),
        ),
    )
    _save_sections(setup, "passt", sections)


# ---------------------------------------------------------------- step-level diagnostics


def _matched_pool(setup: Setup, states: int, source_samples: int, budget: int | None):
    """The §7.1 pool: states visited by each policy's trajectories at ``budget``."""
    from agentrl_jax.reproduce.studies.frozenlake.diagnostics import play_visits
    from agentrl_jax.reproduce.studies.frozenlake.states import matched_pool

    budget = setup.env.t_max if budget is None else budget
    visits = play_visits(
        setup.play(), setup.policies, setup.key("sources"), samples=source_samples, budget=budget
    )
    return matched_pool(*visits.values(), size=states, seed=setup.seed)


def _state_options(fn):
    """Options shared by ``steps`` and ``errors`` (so both build the same pool)."""
    params = list(inspect.signature(fn).parameters.values())
    extra = [
        (
            "states",
            int,
            typer.Option(512, help="States in the matched pool (half from each policy).", min=2),
        ),
        (
            "group_size",
            int,
            typer.Option(16, help="Actions (episodes) per state and policy, G.", min=1),
        ),
        (
            "source_samples",
            int,
            typer.Option(4, help="Trajectories per task the states are drawn from.", min=1),
        ),
        (
            "budget",
            Optional[int],
            typer.Option(None, help="Budget of the source trajectories (default T_max).", min=1),
        ),
        (
            "gamma",
            float,
            typer.Option(0.95, help="Discount of Q* (paper §7: 0.95).", min=0.0, max=1.0),
        ),
        (
            "invalid",
            str,
            typer.Option(
                "noop",
                help="Quality of an invalid response: noop (Q* of "
                "staying, what the environment plays) or zero.",
            ),
        ),
        (
            "states_per_call",
            Optional[int],
            typer.Option(None, help="States per rollout call.", min=1),
        ),
    ]
    names = {n for n, _, _ in extra}
    fn.__signature__ = inspect.Signature(
        [p for p in params if p.name not in names]
        + [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=t)
            for n, t, d in extra
        ]
    )
    return fn


def _check_invalid(invalid: str) -> None:
    from agentrl_jax.evaluation.state_diagnostics import INVALID_SCORES

    if invalid not in INVALID_SCORES:
        raise typer.BadParameter(f"--invalid must be one of {INVALID_SCORES}, got {invalid!r}")


@_analysis("steps")
@_state_options
def steps_command(
    setup: Setup,
    *,
    bins: int = typer.Option(10, help="Depth bins.", min=1),
    states: int,
    group_size: int,
    source_samples: int,
    budget: Optional[int],
    gamma: float,
    invalid: str,
    states_per_call: Optional[int],
) -> None:
    """Step-level action quality on matched states (§7.1) and against depth t / T_max (§7.3)."""
    from agentrl_jax.evaluation import report
    from agentrl_jax.evaluation.analyses import depth, step_quality
    from agentrl_jax.reproduce.studies.frozenlake.diagnostics import play_step_quality

    setup.require_rl("steps")
    _check_invalid(invalid)
    pool = _matched_pool(setup, states, source_samples, budget)
    typer.echo(f"Step quality: {len(pool)} states x G={group_size} actions per policy")
    values, result = play_step_quality(
        setup.play(states_per_call),
        pool,
        *setup.policies.values(),
        setup.key("steps"),
        names=NAMES,
        group_size=group_size,
        gamma=gamma,
        invalid=invalid,
    )
    section = step_quality.section(
        setup.out,
        step_quality.compute(result.pools()),
        name="step_quality",
        policy_names=NAMES,
        title="Step-level action quality on matched states",
    )
    details = report.write_json(setup.out / "step_quality_details.json", result.summary())
    states_csv = report.write_csv(
        setup.out / "step_quality_states.csv",
        {
            **pool.to_columns(),
            **{f"q_{n}": result.quality[n] for n in NAMES},
            "q_spread": values.spread,
        },
    )
    shares = ", ".join(f"{n} {100 * s:.1f}%" for n, s in result.invalid_share().items())
    section = dataclasses.replace(
        section,
        text=f"{section.text}. Invalid responses ({invalid}-scored): {shares}.",
        files=section.files
        + tuple(p.relative_to(setup.out).as_posix() for p in (details, states_csv)),
    )
    depth_section = depth.section(
        setup.out,
        depth.compute(*depth.quality_by_depth(result, setup.env.t_max), bins=bins, seed=setup.seed),
    )
    _save_sections(setup, "steps", [section, depth_section])


@_analysis("errors")
@_state_options
def errors_command(
    setup: Setup,
    *,
    states: int,
    group_size: int,
    source_samples: int,
    budget: Optional[int],
    gamma: float,
    invalid: str,
    states_per_call: Optional[int],
) -> None:
    """Error states (§7.2): action quality after an injected mistake and continuation success."""
    from agentrl_jax.evaluation import report
    from agentrl_jax.evaluation.analyses import continuation, step_quality
    from agentrl_jax.reproduce.studies.frozenlake.diagnostics import play_error_states
    from agentrl_jax.reproduce.studies.frozenlake.states import inject_errors

    setup.require_rl("errors")
    _check_invalid(invalid)
    pool = _matched_pool(setup, states, source_samples, budget)
    errors = inject_errors(setup.env.maps, pool, seed=setup.seed)
    if len(errors.states) == 0:
        raise typer.BadParameter("no state of the pool admits an error move with a turn left")
    typer.echo(
        f"Error states: {len(errors.states)} of {len(pool)} states, G={group_size} "
        "continuations per policy"
    )
    _, result = play_error_states(
        setup.play(states_per_call),
        errors,
        *setup.policies.values(),
        setup.key("errors"),
        names=NAMES,
        group_size=group_size,
        gamma=gamma,
        invalid=invalid,
    )
    quality = step_quality.section(
        setup.out,
        step_quality.compute(result.quality.pools()),
        name="error_step_quality",
        policy_names=NAMES,
        title="Step-level action quality at error states",
    )
    details = report.write_json(setup.out / "error_states_details.json", result.summary())
    states_csv = report.write_csv(
        setup.out / "error_states.csv",
        {
            **errors.states.to_columns(),
            "injected_action": errors.action,
            **{f"q_{n}": result.quality.quality[n] for n in NAMES},
            **{f"continuation_{n}": result.success[n].mean(axis=1) for n in NAMES},
        },
    )
    quality = dataclasses.replace(
        quality,
        title="Step-level action quality at error states",
        files=quality.files
        + tuple(p.relative_to(setup.out).as_posix() for p in (details, states_csv)),
    )
    rates = continuation.section(setup.out, continuation.compute(result.success))
    _save_sections(setup, "errors", [quality, rates])


# ---------------------------------------------------------------- likelihood


@_analysis("likelihood")
def likelihood_command(
    setup: Setup,
    samples: int = typer.Option(4, help="Trajectories per task and policy.", min=1),
    budget: Optional[int] = typer.Option(
        None, help="Budget of the trajectories (default T_max).", min=1
    ),
    match_length: Optional[int] = typer.Option(
        None, help="Turns L of the length-matched LLR (default: the smallest median length).", min=1
    ),
    valid_only: bool = typer.Option(
        False, help="ActionNLL of responses that parsed into an action only."
    ),
    rows_per_batch: int = typer.Option(
        16, help="Trajectories per teacher-forced forward pass.", min=1
    ),
) -> None:
    """ActionNLL under the base policy and cumulative LLR split by success (§7.4)."""
    from agentrl_jax.evaluation import drivers, likelihood
    from agentrl_jax.evaluation.analyses import likelihood as analysis

    setup.require_rl("likelihood")
    budget = setup.env.t_max if budget is None else budget
    trajectories = drivers.likelihood_rollouts(
        setup.play(), setup.policies, setup.key("likelihood"), samples=samples, budget=budget
    )
    data = likelihood.likelihood_data(
        setup.base.model, setup.rl.model, trajectories, rows_per_batch=rows_per_batch
    )
    nll = data.action_nll(valid_only=valid_only)
    empty = [k for k, v in nll.items() if v.size == 0]
    if empty:
        raise typer.BadParameter(f"no responses to score for {empty} (try without --valid-only)")
    section = analysis.section(
        setup.out, analysis.compute(nll, data.llr_sets(), match_length=match_length)
    )
    _save_sections(setup, "likelihood", [section])


# ---------------------------------------------------------------- the report


def read_sections(folder: Path) -> list:
    """The report sections saved in ``folder/sections``, in the order of :data:`ORDER`."""
    from agentrl_jax.evaluation.report import SECTIONS_DIR
    from agentrl_jax.evaluation.report import read_sections as read_file

    records = []
    for path in sorted((folder / SECTIONS_DIR).glob("*.json")):
        try:
            analysis, sections = read_file(path)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
        rank = ORDER.index(analysis) if analysis in ORDER else len(ORDER)
        records.append((rank, path.stem, sections))
    return [s for *_, sections in sorted(records, key=lambda r: r[:2]) for s in sections]


@app.command("report")
def report_command(
    out: Path = typer.Option(..., help="Results folder written by the analyses."),
    training_log: Optional[Path] = typer.Option(
        None, help="The trainer's JSONL metrics log: adds the R_multi / R_single plot (§7.5)."
    ),
    title: str = typer.Option("Evaluation report", help="Title of report.md."),
) -> None:
    """Assemble report.md from the analyses in the results folder."""
    from agentrl_jax.evaluation import report
    from agentrl_jax.evaluation.analyses import dynamics

    if not out.is_dir():
        raise typer.BadParameter(f"--out {out} is not a folder")
    sections = read_sections(out)
    if training_log is not None:
        if not training_log.is_file():
            raise typer.BadParameter(f"--training-log {training_log}: no such file")
        try:
            sections.append(dynamics.section(out, dynamics.from_log(training_log)))
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
    if not sections:
        raise typer.BadParameter(
            f"{out} holds no analysis yet (run passk, passt, steps, errors or likelihood first)"
        )
    path = report.write_report(out, sections, title=title)
    typer.echo(f"Wrote {path} ({len(sections)} sections)")
