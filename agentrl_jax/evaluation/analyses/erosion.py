"""Erosion localisation: where full-budget RL loses single-step quality (R_single, §7.5).

Two views, each split into classes:

* **Tokens, over training.** The base policy's own responses (its trajectories at ``T_max``)
  are scored, teacher-forced, by each saved snapshot of an RL run (step 0 is the base): at
  each response token the entropy of the snapshot's next-token distribution and the change
  ``log pi_step(token) - log pi_base(token)`` of the base's choice. Tokens are split by
  *token class* (``action``: inside the span the environment reads the action from, e.g.
  FrozenLake's ``<answer>...</answer>``; ``other``: the rest of the response) and by *depth*
  (the turn's third of ``T_max``). Means per class come with 95% CIs over trajectories (each
  trajectory's mean over its tokens of the class), since tokens of one episode are not
  independent.
* **States, base vs final policy.** From the step diagnostics' own records (``steps``: matched
  states, ``errors``: injected error states), the change in mean step quality ``q_RL - q_base``
  per *state class* (matched states by depth third, error states), its weight (the class's
  share of all those states) and its contribution ``weight x change``; the contributions add
  up to the change over all the states, and each class's share of it is reported (meaningful
  when the contributions share a sign).

``compute_tokens`` -> :class:`TokenErosion`, ``compute_states`` -> :class:`StateErosion`;
:func:`section` writes ``erosion.json``, ``erosion.csv``, the figure and the section.

The ``erosion`` analysis (:data:`ANALYSIS`, pairwise; Qwen3 models only): the base's tokens
under each run's snapshots (:class:`~.context.Snapshots`), and step quality by state class
from the raw records of ``steps`` and ``errors`` (so it runs after them).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import drivers, likelihood, raw, stats
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.figures import legend_below, new_figure, save_figure
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result

EROSION_JSON, EROSION_CSV = "erosion.json", "erosion.csv"
TOKEN_CLASSES = ("action", "other")
DEPTHS = ("first third", "middle third", "last third")
ERROR_STATES = "error states"


def depth_class(turn: np.ndarray, budget: np.ndarray | int) -> np.ndarray:
    """``int[...]`` index into :data:`DEPTHS` of turn ``turn`` (0-based) under ``budget``:
    the third of the budget it falls in (``floor(3 t / B)``, at most 2)."""
    turn, budget = np.asarray(turn, np.int64), np.asarray(budget, np.int64)
    return np.minimum(3 * turn // np.maximum(budget, 1), 2)


def class_sums(
    values: np.ndarray, rows: np.ndarray, token_class: np.ndarray, depth: np.ndarray, n: int
) -> np.ndarray:
    """``float64[n, C, D]``: the sum of ``values [tokens]`` per trajectory row, token class
    (:data:`TOKEN_CLASSES`) and depth (:data:`DEPTHS`); with ``values`` all ones, the counts."""
    out = np.zeros((n, len(TOKEN_CLASSES), len(DEPTHS)), np.float64)
    np.add.at(out, (rows, token_class, depth), np.asarray(values, np.float64))
    return out


def _row_ci(sums: np.ndarray, counts: np.ndarray) -> stats.MeanCI:
    """The mean over rows holding tokens of each row's mean (``sums / counts``, ``[rows]``),
    with its 95% CI: tokens of one episode are not independent, episodes are."""
    held = counts > 0
    if not held.any():
        return stats.MeanCI(np.nan, np.nan, np.nan, 0)
    return stats.mean_ci_normal(sums[held] / counts[held])


@result
class ClassCurve(Result):
    """One (token class, depth) class of one run: per snapshot ``steps [S]``, the mean
    entropy and mean log-prob change of the base's tokens, each a CI over trajectories;
    ``tokens``: how many tokens the class holds."""

    token_class: str
    depth: str
    tokens: int
    steps: np.ndarray
    entropy: list[stats.MeanCI]
    logp_change: list[stats.MeanCI]


@result
class TokenErosion(Result):
    """``curves[run]``: one :class:`ClassCurve` per class holding tokens (token class x
    depth, then each token class over all depths as depth ``"all"``)."""

    rows: int
    tokens: int
    curves: dict[str, list[ClassCurve]]


def compute_tokens(
    entropy: Mapping[str, Mapping[int, np.ndarray]],
    logp_change: Mapping[str, Mapping[int, np.ndarray]],
    counts: np.ndarray,
) -> TokenErosion:
    """The token view (module docstring) from per-row class sums (:func:`class_sums`, each
    ``[rows, C, D]``): ``entropy[run][step]`` of the snapshot's entropies and
    ``logp_change[run][step]`` of its log-prob changes of the base's tokens, ``counts`` the
    tokens per row and class."""
    counts = np.asarray(counts, np.float64)
    classes = [(c, d) for c in range(len(TOKEN_CLASSES)) for d in range(len(DEPTHS))]
    classes += [(c, None) for c in range(len(TOKEN_CLASSES))]

    def pick(x: np.ndarray, c: int, d: int | None) -> np.ndarray:
        x = np.asarray(x, np.float64)[:, c]
        return x.sum(axis=1) if d is None else x[:, d]

    curves: dict[str, list[ClassCurve]] = {}
    for run in entropy:
        steps = sorted(entropy[run])
        curves[run] = []
        for c, d in classes:
            n = pick(counts, c, d)
            if not n.any():
                continue
            curves[run].append(
                ClassCurve(
                    TOKEN_CLASSES[c],
                    "all" if d is None else DEPTHS[d],
                    int(n.sum()),
                    np.asarray(steps, np.int64),
                    [_row_ci(pick(entropy[run][s], c, d), n) for s in steps],
                    [_row_ci(pick(logp_change[run][s], c, d), n) for s in steps],
                )
            )
    rows = int((counts.sum(axis=(1, 2)) > 0).sum())
    return TokenErosion(rows, int(counts.sum()), curves)


@result
class StateClass(Result):
    """One state class: its states, weight, change in mean step quality (CI over its states),
    contribution (``weight x change``) and share of the total."""

    name: str
    states: int
    weight: float
    change: stats.MeanCI
    contribution: float
    share: float


@result
class StateErosion(Result):
    """``classes[policy]`` (the RL policies) and ``total[policy]``: the change over all the
    states (the contributions' sum)."""

    classes: dict[str, list[StateClass]]
    total: dict[str, float]


def state_classes(
    matched: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    errors: tuple[np.ndarray, np.ndarray] | None,
) -> list[StateClass]:
    """The state view of one policy: ``matched`` ``(q_base [S], q_rl [S], turn [S], budget
    [S])`` on the matched states, ``errors`` ``(q_base [E], q_rl [E])`` on the error states
    (None: none)."""
    q_b, q_r, turn, budget = (np.asarray(x) for x in matched)
    groups = [(DEPTHS[d], q_r[m] - q_b[m]) for d, m in _depth_masks(turn, budget)]
    if errors is not None:
        groups.append((ERROR_STATES, np.asarray(errors[1], float) - np.asarray(errors[0], float)))
    groups = [(n, np.asarray(x, np.float64)) for n, x in groups if len(x)]
    total_states = sum(len(x) for _, x in groups)
    contributions = [len(x) / total_states * float(x.mean()) for _, x in groups]
    total = float(sum(contributions))
    return [
        StateClass(
            name,
            len(x),
            len(x) / total_states,
            stats.mean_ci_normal(x),
            contribution,
            contribution / total if total != 0 else float("nan"),
        )
        for (name, x), contribution in zip(groups, contributions)
    ]


def _depth_masks(turn: np.ndarray, budget: np.ndarray) -> list[tuple[int, np.ndarray]]:
    classes = depth_class(turn, budget)
    return [(d, classes == d) for d in range(len(DEPTHS))]


def compute_states(
    steps: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    errors: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> StateErosion:
    """:func:`state_classes` of every policy of ``steps`` (``errors`` where it has them)."""
    classes = {p: state_classes(m, errors.get(p)) for p, m in steps.items()}
    return StateErosion(
        classes, {p: float(sum(c.contribution for c in cs)) for p, cs in classes.items()}
    )


def _num(ci: stats.MeanCI, digits: int = 3, sign: str = "+") -> str:
    if not np.isfinite(ci.mean):
        return "-"
    fmt = f"{sign}.{digits}f"
    if not np.isfinite(ci.low):
        return f"{ci.mean:{fmt}}"
    return f"{ci.mean:{fmt}} [{ci.low:{fmt}}, {ci.high:{fmt}}]"


def markdown(tokens: TokenErosion, states: StateErosion | None, quality: str) -> str:
    """Per run: the token classes at the last snapshot (entropy at step 0 and last, the
    change of the base's log-probs), then the state classes' contributions."""
    lines = []
    for run, curves in tokens.curves.items():
        if not curves:
            continue
        first, last = int(curves[0].steps[0]), int(curves[0].steps[-1])
        lines += [
            f"**{run}**: the base's response tokens under step {last} (step {first}: the base)",
            "",
            f"| token class | depth | tokens | entropy at step {first} | entropy at step {last} "
            f"| log-prob change of the base's token at step {last} |",
            "|---|---|---|---|---|---|",
        ]
        for c in curves:
            lines.append(
                f"| {c.token_class} | {c.depth} | {c.tokens} | {_num(c.entropy[0], sign='')} | "
                f"{_num(c.entropy[-1], sign='')} | {_num(c.logp_change[-1])} |"
            )
        lines.append("")
    for policy, classes in (states.classes if states else {}).items():
        lines += [
            f"**{policy}**: change in {quality} by state class (final policy vs base; total "
            f"{states.total[policy]:+.4f})",
            "",
            "| state class | states | weight | change [95% CI] | contribution | share |",
            "|---|---|---|---|---|---|",
        ]
        for c in classes:
            share = f"{100 * c.share:.0f}%" if np.isfinite(c.share) else "-"
            lines.append(
                f"| {c.name} | {c.states} | {c.weight:.2f} | {_num(c.change, 4)} | "
                f"{c.contribution:+.4f} | {share} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(tokens: TokenErosion, out_path: str | Path) -> tuple[Path, Path]:
    """Per run: entropy (left) and the log-prob change of the base's tokens (right) against
    the training step, one line per token class (all depths) with its 95% band; one legend
    (the token classes) below the panels."""
    runs = [r for r, c in tokens.curves.items() if c]
    fig, axes = new_figure(ncols=2, nrows=max(1, len(runs)), height=3.0)
    for row, run in zip(axes, runs):
        for curve in tokens.curves[run]:
            if curve.depth != "all":
                continue
            for ax, series in ((row[0], curve.entropy), (row[1], curve.logp_change)):
                mean = np.array([s.mean for s in series])
                ax.plot(curve.steps, mean, marker="o", label=curve.token_class)
                low, high = np.array([s.low for s in series]), np.array([s.high for s in series])
                ax.fill_between(curve.steps, low, high, alpha=0.15)
        row[0].set_title(f"{run}: entropy", fontsize=9)
        row[1].set_title(f"{run}: log-prob change of the base's tokens", fontsize=9)
        for ax in row:
            ax.set_xlabel("training step")
    if runs:
        legend_below(fig, axes[0][0], ncols=len(TOKEN_CLASSES), title="token class")
    return save_figure(fig, out_path)


def section(
    folder: str | Path,
    tokens: TokenErosion,
    states: StateErosion | None,
    *,
    quality: str = "step quality",
    action_note: str = "the span the environment reads the action from",
) -> Section:
    """``erosion.json``, ``erosion.csv`` (the token curves), the figure and the section."""
    folder = Path(folder)
    path = write_json(folder / EROSION_JSON, {"tokens": tokens, "states": states})
    rows: dict[str, list] = {
        k: [] for k in ("run", "token_class", "depth", "step", "tokens", "entropy", "logp_change")
    }
    for run, curves in tokens.curves.items():
        for c in curves:
            for i, step in enumerate(c.steps):
                rows["run"].append(run)
                rows["token_class"].append(c.token_class)
                rows["depth"].append(c.depth)
                rows["step"].append(int(step))
                rows["tokens"].append(c.tokens)
                rows["entropy"].append(c.entropy[i].mean)
                rows["logp_change"].append(c.logp_change[i].mean)
    csv = write_csv(folder / EROSION_CSV, rows)
    png, _ = plot(tokens, figure_path(folder, "erosion"))
    text = (
        f"Where single-step quality is lost. Tokens: the base policy's own responses "
        f"({tokens.rows} trajectories, {tokens.tokens} response tokens) scored by every saved "
        f"snapshot of each RL run: the entropy of its next-token distribution and the change "
        f"in log-probability of the base's token, by token class (action: {action_note}; other: "
        f"the rest of the response) and by the turn's third of T_max; 95% CIs over "
        f"trajectories. States: the change in {quality} from the base to each final policy on "
        f"the step diagnostics' states, by class (matched states by depth third, injected "
        f"error states), weighted by the class's share of those states; the contributions "
        f"add up to the change over all of them."
    )
    return Section(
        "Erosion: where single-step quality is lost",
        text,
        files=(rel(folder, path), rel(folder, csv)),
        figures=(rel(folder, png),),
        markdown=markdown(tokens, states, quality),
    )


def token_classes(
    tokens: np.ndarray,
    scored: np.ndarray,
    token_turn: np.ndarray,
    decode: Callable[[Sequence[int]], str],
    pattern: str | None,
) -> np.ndarray:
    """``int[N, L]``: each sampled token's class (index into :data:`TOKEN_CLASSES`; -1 where
    ``scored`` is False). A turn's response is decoded token by token; a token is ``action``
    when its characters overlap the last match of ``pattern`` in the response (the span the
    environment reads the action from), else ``other`` (all ``other`` without a pattern)."""
    tokens, scored, token_turn = (
        np.asarray(tokens),
        np.asarray(scored, bool),
        np.asarray(token_turn),
    )
    out = np.full(tokens.shape, -1, np.int64)
    regex = re.compile(pattern, re.S) if pattern else None
    for row in range(tokens.shape[0]):
        positions = np.flatnonzero(scored[row])
        for turn in np.unique(token_turn[row, positions]):
            where = positions[token_turn[row, positions] == turn]
            ids = tokens[row, where].tolist()
            ends = [len(decode(ids[: i + 1])) for i in range(len(ids))]
            starts = [0] + ends[:-1]
            matches = list(regex.finditer(decode(ids))) if regex else []
            lo, hi = (matches[-1].start(), matches[-1].end()) if matches else (0, 0)
            for p, a, b in zip(where, starts, ends):
                out[row, p] = 0 if (a < hi and b > lo) or (a == b and lo <= a < hi) else 1
    return out


# ---------------------------------------------------------------- the erosion analysis


FINAL_STEP = -1
"""The step the erosion analysis gives a final policy whose run left no snapshots."""


def _state_qualities(run: AnalysisRun) -> StateErosion | None:
    """The state view of the erosion from the ``steps`` and ``errors`` raw records (None
    without ``steps``)."""
    steps, errors = raw.load_raw(run.out, "steps"), raw.load_raw(run.out, "errors")
    if steps is None:
        return None
    matched = {}
    for other, pair in steps["pairs"].items():
        turn = np.asarray(pair["states"]["turn"], np.int64)
        budget = np.asarray(pair["states"].get("budget", [run.t_max] * len(turn)), np.int64)
        q = pair["quality"]
        matched[other] = (np.asarray(q[steps["base"]]), np.asarray(q[other]), turn, budget)
    at_errors = {
        other: (np.asarray(pair["quality"][errors["base"]]), np.asarray(pair["quality"][other]))
        for other, pair in (errors or {"pairs": {}})["pairs"].items()
    }
    return compute_states(matched, at_errors)


class Erosion(Analysis):
    """Where full-budget RL loses single-step quality: tokens over training, states."""

    name = "erosion"
    unit_seconds = 1.4e-2  # fit on the stored default run (reproduce.progress)
    pairwise = True

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        return drivers.rollout_units(num_tasks, settings.likelihood_samples, t_max)

    def run(self, run: AnalysisRun) -> list[Section]:
        s = run.settings
        run.models_only("erosion")
        traj = drivers.likelihood_rollouts(
            run.play,
            {run.base: run.policies[run.base]},
            run.key("erosion"),
            samples=s.likelihood_samples,
            budget=run.t_max,
        )[run.base]
        scored = np.asarray(traj.loss_mask, bool) & np.asarray(traj.token_mask, bool)
        token_turn = np.asarray(traj.token_turn)
        pattern = getattr(run.states, "action_pattern", None)
        classes = token_classes(
            np.asarray(traj.tokens), scored, token_turn, run.tokenizer.decode, pattern
        )
        rows, cols = np.nonzero(scored)
        n = scored.shape[0]
        depth_of = depth_class(token_turn[rows, cols], np.asarray(traj.budget)[rows])
        sums = lambda x: class_sums(x[rows, cols], rows, classes[rows, cols], depth_of, n)  # noqa: E731
        score = functools.partial(
            likelihood.token_scores, trajectory=traj, rows_per_batch=s.likelihood_rows_per_batch
        )
        base_logp, base_entropy = score(run.models[run.base], attention=s.attention)
        entropy_sums, change_sums = {}, {}
        for other in run.names[1:]:
            steps = list(run.snapshots.steps(other)) if run.snapshots is not None else []
            entropy_sums[other] = {0: sums(base_entropy)}
            change_sums[other] = {0: sums(np.zeros_like(base_logp))}
            for step in steps or [FINAL_STEP]:
                model = run.models[other] if not steps else run.snapshots.load(other, step)
                logp, entropy_ = score(model, attention=s.attention)
                entropy_sums[other][int(step)] = sums(entropy_)
                change_sums[other][int(step)] = sums(logp - base_logp)
        run.progress(drivers.rollout_units(len(run.task_ids), s.likelihood_samples, run.t_max))
        raw_file = run.write_raw(
            "erosion",
            {
                "samples": s.likelihood_samples,
                "action_pattern": pattern,
                "counts": sums(np.ones_like(base_logp)),
                "entropy": entropy_sums,
                "logp_change": change_sums,
            },
        )
        saved = raw.load_raw(run.out, "erosion")
        tokens = compute_tokens(*raw.erosion_sums(saved))
        written = section(
            run.out,
            tokens,
            _state_qualities(run),
            quality=getattr(run.states, "quality_name", "step quality"),
            action_note=getattr(run.states, "action_note", "the span the action is read from"),
        )
        return [with_(written, files=(raw_file,))]


ANALYSIS = register(Erosion())
