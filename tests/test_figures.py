"""Every figure renders to a valid PNG and PDF at tiny scale; the report links real files."""

import base64
import csv
import html.parser
import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from markdown_it import MarkdownIt

from agentrl_jax.evaluation import figures, passk, report, stats
from agentrl_jax.evaluation.analyses import (
    continuation,
    depth,
    dynamics,
    likelihood,
    pass_at_k,
    pass_at_t,
    step_quality,
)
from agentrl_jax.evaluation.html import anchor

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_figure(paths):
    png, pdf = paths
    assert png.suffix == ".png" and pdf.suffix == ".pdf" and png.stem == pdf.stem
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    assert image.std() > 0  # something was drawn
    data = pdf.read_bytes()
    assert data[:5] == b"%PDF-" and b"%%EOF" in data[-32:]


def tiny_llr_set(rng, n=6, t=5):
    lengths = rng.integers(1, t + 1, size=n)
    mask = np.arange(t)[None, :] < lengths[:, None]
    logp_rl = rng.normal(-5, 1, size=(n, t))
    logp_base = rng.normal(-6, 1, size=(n, t))
    success = np.arange(n) % 2 == 0
    return logp_rl, logp_base, mask, success


def test_plot_pass_at_k(tmp_path):
    ks = np.arange(1, 9)
    curves = {
        "base": (ks, passk.pass_at_k_curve([8, 8], [1, 2], ks)),
        "RL": (ks, passk.pass_at_k_curve([8, 8], [3, 2], ks)),
    }
    bands = {"RL": (curves["RL"][1] - 0.05, curves["RL"][1] + 0.05)}
    assert_valid_figure(pass_at_k.plot_pass_at_k(curves, tmp_path / "pk.png", bands=bands))
    with pytest.raises(ValueError, match="nothing to plot"):
        pass_at_k.plot_pass_at_k({}, tmp_path / "empty")


def test_plot_pass_at_t_with_bound(tmp_path):
    budgets = np.array([2, 5, 7, 10])
    bound = (np.arange(1, 11), passk.structural_upper_bound([3, 4, 8, np.inf], np.arange(1, 11)))
    out = pass_at_t.plot_pass_at_t(
        {"base": (budgets, [0.1, 0.3, 0.4, 0.5]), "RL": (budgets, [0.1, 0.35, 0.5, 0.7])},
        tmp_path / "pt",
        bound=bound,
        t_max=10,
    )
    assert_valid_figure(out)
    assert out[0] == tmp_path / "pt.png"


def test_budget_table_figure_markdown_and_csv(tmp_path):
    table = {
        "base": {17: 0.303, 35: 0.5, 52: 0.6, 70: 0.7},
        "GRPO": {17: 0.287, 35: 0.55, 52: 0.7, 70: 0.8},
    }
    labels = pass_at_t.budget_level_labels(70)
    assert labels == {17: "25% (T=17)", 35: "50% (T=35)", 52: "75% (T=52)", 70: "100% (T=70)"}
    assert_valid_figure(pass_at_t.plot_budget_table(table, tmp_path / "t1", labels=labels))
    md = pass_at_t.budget_table_markdown(table, labels=labels)
    lines = md.strip().splitlines()
    assert lines[0] == "| policy (Pass@8, %) | 25% (T=17) | 50% (T=35) | 75% (T=52) | 100% (T=70) |"
    assert lines[2] == "| base | 30.3 | 50.0 | 60.0 | 70.0 |"
    assert lines[3] == "| GRPO | 28.7 | 55.0 | 70.0 | 80.0 |"
    rows = list(csv.DictReader(pass_at_t.budget_table_csv(table, labels=labels).splitlines()))
    assert len(rows) == 8
    assert rows[0] == {
        "policy": "base",
        "budget": "17",
        "level": "25% (T=17)",
        "pass_at_k": "0.303",
    }
    assert rows[7] == {"policy": "GRPO", "budget": "70", "level": "100% (T=70)", "pass_at_k": "0.8"}
    assert pass_at_t.budget_table_markdown(table).startswith("| policy (Pass@8, %) | T=17 | T=35 |")
    with pytest.raises(ValueError, match="'GRPO' lacks budgets \\[70\\]"):
        pass_at_t.budget_table_markdown({"base": {17: 0.1, 70: 0.2}, "GRPO": {17: 0.1}})


def test_plot_step_quality_and_rates(tmp_path):
    rng = np.random.default_rng(0)
    pools = {
        "matched": (rng.uniform(size=12), rng.uniform(size=12)),
        "error": (rng.uniform(size=8), rng.uniform(size=8)),
    }
    assert_valid_figure(step_quality.plot_step_quality(pools, tmp_path / "sq"))
    rates = {
        "base": stats.mean_ci_normal([1, 0, 0, 1, 0]),
        "RL": {"mean": 0.6, "low": 0.4, "high": 0.8},
    }
    assert_valid_figure(continuation.plot_rates_with_ci(rates, tmp_path / "cont"))


def test_plot_quality_vs_depth(tmp_path):
    rng = np.random.default_rng(1)
    at = rng.uniform(size=40)
    curves = {
        "base": stats.binned_curve(at, rng.uniform(size=40), bins=4, n_resamples=50),
        "RL": stats.binned_curve(at, rng.uniform(size=40), bins=4, n_resamples=50).to_dict(),
    }
    assert_valid_figure(depth.plot_quality_vs_depth(curves, tmp_path / "depth"))


def test_plot_action_nll_hist(tmp_path):
    rng = np.random.default_rng(2)
    out = likelihood.plot_action_nll_hist(
        {"base": rng.normal(12, 2, 30), "RL": rng.normal(10, 2, 30)}, tmp_path / "nll", bins=8
    )
    assert_valid_figure(out)
    with pytest.raises(ValueError, match="RL"):
        likelihood.plot_action_nll_hist({"RL": []}, tmp_path / "bad")


def test_plot_cumulative_llr(tmp_path):
    rng = np.random.default_rng(3)
    sets = {name: tiny_llr_set(rng) for name in ("RL trajectories", "base trajectories")}
    res = likelihood.compute({"base": [1.0, 2.0]}, sets)
    assert_valid_figure(likelihood.plot_cumulative_llr(res.llr, tmp_path / "llr"))
    # All trajectories of one outcome is fine (the other has nothing to draw).
    logp_rl, logp_base, mask, success = sets["RL trajectories"]
    all_ok = likelihood.compute(
        {"base": [1.0]}, {"all ok": (logp_rl, logp_base, mask, np.ones_like(success))}
    )
    assert_valid_figure(likelihood.plot_cumulative_llr(all_ok.llr, tmp_path / "llr_ok"))


def test_plot_training_dynamics(tmp_path):
    steps = np.arange(10)
    series = {
        "R_multi": np.linspace(0.2, 0.7, 10),
        "R_single": np.r_[np.linspace(0.5, 0.4, 9), np.nan],
    }
    assert_valid_figure(dynamics.plot_training_dynamics(steps, series, tmp_path / "dyn"))


def write_tiny_results(folder: Path):
    """Every analysis end to end on tiny synthetic arrays; returns the report path and counts."""
    rng = np.random.default_rng(4)
    tasks = 6
    counts = {
        "base": (np.full(tasks, 16), rng.integers(0, 17, tasks)),
        "RL": (np.full(tasks, 16), rng.integers(0, 17, tasks)),
    }
    sections = [pass_at_k.section(folder, pass_at_k.compute(counts, ks=range(1, 33)))]
    t_max = 10
    results = {
        p: {b: (np.full(tasks, 8), rng.integers(0, 9, tasks)) for b in (2, 5, 7, 10)}
        for p in counts
    }
    sections += pass_at_t.section(
        folder, pass_at_t.compute(results, t_max=t_max, shortest_paths=rng.integers(2, 12, tasks))
    )
    pools = {
        "matched": (rng.uniform(size=10), rng.uniform(size=10)),
        "error": (rng.uniform(size=10), rng.uniform(size=10)),
    }
    sections.append(step_quality.section(folder, step_quality.compute(pools)))
    sections.append(
        continuation.section(
            folder,
            continuation.compute(
                {"base": rng.uniform(size=10) < 0.4, "RL": rng.uniform(size=10) < 0.5}
            ),
        )
    )
    at = stats.normalised_depth(rng.integers(0, t_max + 1, 30), t_max)
    sections.append(
        depth.section(
            folder,
            depth.compute(at, {"base": rng.uniform(size=30), "RL": rng.uniform(size=30)}, bins=4),
        )
    )
    sections.append(
        likelihood.section(
            folder,
            likelihood.compute(
                {"base": rng.normal(12, 2, 20), "RL": rng.normal(10, 2, 20)},
                {"RL trajectories": tiny_llr_set(rng), "base trajectories": tiny_llr_set(rng)},
            ),
        )
    )
    log = folder / "train.jsonl"
    lines = [
        json.dumps({"step": s, "R_multi": 0.1 * s, "R_single": 0.5 - 0.01 * s}) for s in range(5)
    ]
    lines.insert(2, json.dumps({"event": "checkpoint"}))  # other records share the log
    log.write_text("\n".join(lines) + "\n")
    sections.append(dynamics.section(folder, dynamics.from_log(log)))
    return report.write_report(folder, sections, title="Tiny report"), counts


def test_report_renders_and_links_existing_files(tmp_path):
    path, counts = write_tiny_results(tmp_path)
    text = path.read_text()
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    images, links = [], []
    for token in tokens:
        for child in token.children or []:
            if child.type == "image":
                images.append(child.attrs["src"])
            if child.type == "link_open":
                links.append(child.attrs["href"])
    # Every PNG in figures/ is embedded, with its PDF linked, and every link resolves.
    pngs = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "figures").glob("*.png"))
    assert sorted(images) == pngs and len(pngs) == 9
    for png in pngs:
        assert_valid_figure((tmp_path / png, (tmp_path / png).with_suffix(".pdf")))
        assert png.replace(".png", ".pdf") in links
    for target in images + links:
        assert (tmp_path / target).is_file(), target
    data_files = {p.name for p in tmp_path.glob("*.json")} | {
        p.name for p in tmp_path.glob("*.csv")
    }
    assert data_files <= {Path(link).name for link in links}
    # The Table 1 Markdown made it in as a real table.
    assert any(t.type == "table_open" for t in tokens)
    assert "| policy (Pass@8, %) | 25% (T=2) | 50% (T=5) | 75% (T=7) | 100% (T=10) |" in text

    # JSON is strict (NaN written as null) and the numbers round-trip.
    def reject_constant(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    for json_file in tmp_path.glob("*.json"):
        json.loads(json_file.read_text(), parse_constant=reject_constant)
    dyn = json.loads((tmp_path / "training_dynamics.json").read_text())
    assert dyn["step"] == [0, 1, 2, 3, 4]
    # the means of the first and last 2 of the 5 steps: 0.05 -> 0.35
    assert dyn["change_start_to_end"]["R_multi"]["change"]["mean"] == pytest.approx(0.3)
    rows = list(csv.DictReader((tmp_path / "pass_at_k.csv").read_text().splitlines()))
    assert [int(r["k"]) for r in rows] == list(range(1, 17))  # k > n = 16 dropped
    n_base, c_base = counts["base"]
    assert float(rows[0]["base"]) == pytest.approx(
        np.mean(c_base / n_base)
    )  # pass@1 = success rate


def test_report_refuses_a_missing_file(tmp_path):
    section = report.Section("broken", figures=("figures/nope.png",))
    with pytest.raises(FileNotFoundError, match="nope.png"):
        report.write_report(tmp_path, [section])


def test_read_training_log_errors_name_the_line(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "R_multi": 0.1}\n{not json\n')
    with pytest.raises(ValueError, match="log.jsonl:2"):
        dynamics.read_training_log(log)
    log.write_text('{"step": 0, "R_multi": 0.1}\n{"step": 1, "R_multi": "high"}\n')
    with pytest.raises(ValueError, match="log.jsonl:2.*not a number"):
        dynamics.read_training_log(log)
    log.write_text('{"step": 0, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="no line"):
        dynamics.read_training_log(log)
    log.write_text('{"step": 0, "R_multi": 0.1}\n\n{"step": 1, "R_single": 0.2}\n')
    steps, series = dynamics.read_training_log(log)
    np.testing.assert_array_equal(steps, [0, 1])
    np.testing.assert_array_equal(np.isnan(series["R_single"]), [True, False])


def test_to_jsonable():
    ci = stats.MeanCI(0.5, float("nan"), float("inf"), 3)
    assert report.to_jsonable(
        {"a": np.arange(2), "ci": ci, 1: np.float32(2.5), "b": np.bool_(True)}
    ) == {"a": [0, 1], "ci": {"mean": 0.5, "low": None, "high": None, "n": 3}, "1": 2.5, "b": True}
    with pytest.raises(TypeError, match="object"):
        report.to_jsonable(object())


def test_the_training_dynamics_text_figure_and_table_state_one_change(tmp_path, monkeypatch):
    """A noisy 40-step log: the section's text, the figure's panel titles, the JSON and the
    reproduction's start-to-end table all give the change of the start and end means (one
    ``start_to_end`` result), and the figure names its run. (The figure and text used to say
    last-minus-first step, the table the means: -0.016 in one, +0.203 in the other.)"""
    from agentrl_jax.evaluation.analyses.dynamics import dynamics_markdown, start_to_end

    rng = np.random.default_rng(0)
    r_multi = np.clip(0.3 + 0.2 * rng.standard_normal(40), 0, 1)
    r_multi[0], r_multi[-1] = 0.0, 0.9  # first and last steps far from their windows' means
    r_single = 0.5 - 0.002 * np.arange(40) + 0.05 * rng.standard_normal(40)
    log = tmp_path / "runs" / "grpo" / "metrics.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(
        "".join(
            json.dumps({"step": s + 1, "R_multi": m, "R_single": q}) + "\n"
            for s, (m, q) in enumerate(zip(r_multi, r_single))
        )
    )
    drawn = _drawn(monkeypatch)
    section = dynamics.section(tmp_path, dynamics.from_log(log, run="GRPO"))
    expected = {"R_multi": start_to_end(r_multi), "R_single": start_to_end(r_single)}
    titles = [ax.get_title() for ax in drawn[0].axes]
    assert drawn[0].get_suptitle() == "Training dynamics: GRPO" and section.title.endswith("GRPO")
    data = json.loads((tmp_path / "training_dynamics.json").read_text())["change_start_to_end"]
    record = report.to_jsonable({"runs": {"GRPO": {"step": list(range(40)), "change": expected}}})
    table = dynamics_markdown(json.loads(json.dumps(record)))
    assert expected["R_multi"].window == 4
    assert abs(expected["R_multi"].change.mean - (r_multi[-1] - r_multi[0])) > 0.1
    for (name, change), title in zip(expected.items(), titles):
        delta = f"{change.change.mean:+.3f}"
        assert f"{change.start:.3f} -> {change.end:.3f}" in title and delta in title
        assert f"{name}: {change.start:.3f} -> {change.end:.3f}: {delta}" in section.text
        assert data[name]["change"]["mean"] == pytest.approx(change.change.mean)
        assert f"{change.start:.3f} -> {change.end:.3f}: {delta}" in table


def _drawn(monkeypatch):
    """The figures saved from now on (their Figure objects)."""
    drawn, original = [], figures.save_figure
    monkeypatch.setattr(
        figures, "save_figure", lambda fig, path: (drawn.append(fig), original(fig, path))[1]
    )
    return drawn


def legends_outside_the_axes(fig) -> list:
    """Every legend of ``fig`` (the figure's and its axes'), each asserted to cover no axes'
    frame (the data area), to lie whole on the canvas and to be at least 9 pt."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    canvas = fig.bbox
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert canvas.x0 <= box.x0 and box.x1 <= canvas.x1, (box, canvas)
        assert canvas.y0 <= box.y0 and box.y1 <= canvas.y1, (box, canvas)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), (box, ax.get_title())
        assert min(t.get_fontsize() for t in legend.get_texts()) >= figures.LEGEND_FONTSIZE
    return legends


def test_curve_and_bar_legends_sit_beside_the_axes(tmp_path, monkeypatch):
    """Pass@K, Pass@T and Table 1's bars: one legend each, to the right of the axes, naming
    every policy (and the bound), the longest name included."""
    drawn = _drawn(monkeypatch)
    names = ["base", "GRPO", "Presentation-mixed BudgetMix GRPO"]
    ks = np.arange(1, 33)
    pass_at_k.plot_pass_at_k(
        {p: (ks, np.linspace(0.2 + 0.1 * i, 0.9, ks.size)) for i, p in enumerate(names)},
        tmp_path / "pk",
    )
    budgets = np.array([1, 2, 3, 6, 9, 12])
    pass_at_t.plot_pass_at_t(
        {
            p: (budgets, np.linspace(0.1, 0.95 - 0.05 * i, budgets.size))
            for i, p in enumerate(names)
        },
        tmp_path / "pt",
        bound=(np.arange(1, 13), np.linspace(0.2, 1.0, 12)),
        t_max=12,
    )
    pass_at_t.plot_budget_table(
        {p: {3: 0.95, 6: 0.97, 9: 0.99, 12: 1.0} for p in names}, tmp_path / "t1"
    )
    expected = [names + ["structural bound"] if i == 1 else names for i in range(3)]
    for fig, labels in zip(drawn, expected):
        (legend,) = legends_outside_the_axes(fig)
        (ax,) = fig.axes
        assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # to the right
        assert [t.get_text() for t in legend.get_texts()] == labels


def test_the_splice_figure_has_one_legend_below_its_panels(tmp_path, monkeypatch):
    """Three RL policies: three panels, two to a row (the fourth slot removed), and one legend
    below them all naming the four ways of playing."""
    from agentrl_jax.evaluation.analyses import splice

    drawn = _drawn(monkeypatch)
    monkeypatch.setattr(splice, "save_figure", figures.save_figure)
    rng = np.random.default_rng(0)
    play = lambda: rng.random((6, 4)) < 0.4  # noqa: E731  successes [tasks, samples]
    rl = ["GRPO", "BudgetMix GRPO", "Presentation-mixed BudgetMix GRPO"]
    depths = (0.25, 0.5, 0.75)
    spliced = {
        splice.pair_label(a, b): {d: play() for d in depths}
        for p in rl
        for a, b in (("base", p), (p, "base"))
    }
    res = splice.compute({p: play() for p in ["base"] + rl}, spliced, "base", 12, [3, 6, 9])
    splice.plot(res, tmp_path / "splice")
    (fig,) = drawn
    assert [ax.get_title() for ax in fig.axes] == rl
    (legend,) = legends_outside_the_axes(fig)
    assert legend in fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "base then the panel's RL policy",
        "the panel's RL policy then base",
        "base alone",
        "the panel's RL policy alone",
    ]
    box = legend.get_window_extent()
    assert all(box.y1 <= ax.get_window_extent().y0 for ax in fig.axes)  # below every panel


# ---------------------------------------------------------------- every figure's legend

LONG = "Presentation-mixed BudgetMix GRPO"  # the longest policy name of the default run
NAMES = ["base", "GRPO", LONG]


def _draw_pass_at_k(tmp_path, rng):
    ks = np.arange(1, 33)
    curves = {p: (ks, np.linspace(0.2 + 0.1 * i, 0.9, ks.size)) for i, p in enumerate(NAMES)}
    pass_at_k.plot_pass_at_k(curves, tmp_path / "f")


def _draw_pass_at_t(tmp_path, rng):
    budgets = np.array([1, 2, 3, 6, 9, 12])
    curves = {p: (budgets, np.linspace(0.1, 0.95 - 0.05 * i, 6)) for i, p in enumerate(NAMES)}
    bound = (np.arange(1, 13), np.linspace(0.2, 1.0, 12))
    pass_at_t.plot_pass_at_t(curves, tmp_path / "f", bound=bound, t_max=12)


def _draw_budget_table(tmp_path, rng):
    table = {p: {3: 0.95, 6: 0.97, 9: 0.99, 12: 1.0} for p in NAMES}
    pass_at_t.plot_budget_table(table, tmp_path / "f", labels=pass_at_t.budget_level_labels(12))


def _draw_step_quality(tmp_path, rng):
    pools = {
        "all": (rng.random(20), rng.random(20)),
        "actions_differ": (rng.random(9), rng.random(9)),
    }
    step_quality.plot_step_quality(pools, tmp_path / "f", policy_names=("base", LONG))


def _draw_continuation(tmp_path, rng):
    rates = {"base": stats.MeanCI(0.1, 0.05, 0.2, 50), LONG: stats.MeanCI(0.6, 0.5, 0.7, 50)}
    continuation.plot_rates_with_ci(rates, tmp_path / "f")


def _draw_depth(tmp_path, rng):
    at = rng.uniform(size=40)
    curves = {
        label: stats.binned_curve(at, rng.uniform(size=40), bins=4, n_resamples=20)
        for label in ("base", LONG, f"{LONG} - base")
    }
    depth.plot_quality_vs_depth(curves, tmp_path / "f")


def _draw_action_nll(tmp_path, rng):
    samples = {"base responses": rng.normal(12, 2, 30), f"{LONG} responses": rng.normal(10, 2, 30)}
    likelihood.plot_action_nll_hist(samples, tmp_path / "f", bins=8)


def _draw_cumulative_llr(tmp_path, rng):
    sets = {name: tiny_llr_set(rng, n=10, t=8) for name in ("RL trajectories", "base trajectories")}
    likelihood.plot_cumulative_llr(likelihood.compute({"base": [1.0]}, sets).llr, tmp_path / "f")


def _draw_training_dynamics(tmp_path, rng):
    series = {"R_multi": np.linspace(0.2, 0.7, 10), "R_single": np.linspace(0.5, 0.4, 10)}
    dynamics.plot_training_dynamics(np.arange(10), series, tmp_path / "f")


def _draw_erosion(tmp_path, rng):
    from agentrl_jax.evaluation.analyses import erosion

    rows, klass, at = rng.integers(0, 4, 30), rng.integers(0, 2, 30), rng.integers(0, 3, 30)
    sums = lambda x: erosion.class_sums(x, rows, klass, at, 4)  # noqa: E731
    runs = ("GRPO", LONG)
    steps = (0, 10, 20)
    entropy = {r: {s: sums(rng.uniform(0.5, 2.0, 30)) for s in steps} for r in runs}
    change = {r: {s: sums(rng.normal(0, 1, 30)) for s in steps} for r in runs}
    erosion.plot(erosion.compute_tokens(entropy, change, sums(np.ones(30))), tmp_path / "f")


def _draw_presentation(tmp_path, rng):
    from agentrl_jax.evaluation.analyses import presentation

    counts = {
        mode: {p: {b: (np.full(6, 8), rng.integers(0, 9, 6)) for b in (6, 12)} for p in NAMES}
        for mode in ("exact", "hidden", "approximate")
    }
    presentation.plot(presentation.compute(counts, 8), tmp_path / "f")


def _draw_splice(tmp_path, rng):
    from agentrl_jax.evaluation.analyses import splice

    play = lambda: rng.random((6, 4)) < 0.4  # noqa: E731  successes [tasks, samples]
    depths = (0.25, 0.5, 0.75)
    spliced = {
        splice.pair_label(a, b): {d: play() for d in depths}
        for p in NAMES[1:]
        for a, b in (("base", p), (p, "base"))
    }
    res = splice.compute({p: play() for p in NAMES}, spliced, "base", 12, [3, 6, 9])
    splice.plot(res, tmp_path / "f")


FIGURES = {  # "module.function": (draws it, its legends)
    "pass_at_k.plot_pass_at_k": (_draw_pass_at_k, 1),
    "pass_at_t.plot_pass_at_t": (_draw_pass_at_t, 1),
    "pass_at_t.plot_budget_table": (_draw_budget_table, 1),
    "step_quality.plot_step_quality": (_draw_step_quality, 1),
    "continuation.plot_rates_with_ci": (_draw_continuation, 0),
    "depth.plot_quality_vs_depth": (_draw_depth, 1),
    "likelihood.plot_action_nll_hist": (_draw_action_nll, 1),
    "likelihood.plot_cumulative_llr": (_draw_cumulative_llr, 2),  # one per panel, its own
    "dynamics.plot_training_dynamics": (_draw_training_dynamics, 0),
    "erosion.plot": (_draw_erosion, 1),
    "presentation.plot": (_draw_presentation, 1),
    "splice.plot": (_draw_splice, 1),
}


def _figure_functions() -> set[str]:
    """``"module.function"`` of every ``plot*`` function the analyses define."""
    import importlib
    import inspect
    import pkgutil

    from agentrl_jax.evaluation import analyses

    out = set()
    for info in pkgutil.iter_modules(analyses.__path__):
        module = importlib.import_module(f"{analyses.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if name.startswith("plot") and inspect.isfunction(obj):
                if obj.__module__ == module.__name__:
                    out.add(f"{info.name}.{name}")
    return out


def test_the_legend_test_covers_every_figure():
    assert _figure_functions() == set(FIGURES)


def _drawn_everywhere(monkeypatch):
    """:func:`_drawn`, also for the analyses that imported ``save_figure`` by name."""
    import importlib
    import pkgutil

    from agentrl_jax.evaluation import analyses

    drawn = _drawn(monkeypatch)
    for info in pkgutil.iter_modules(analyses.__path__):
        module = importlib.import_module(f"{analyses.__name__}.{info.name}")
        if getattr(module, "save_figure", None) is not None:
            monkeypatch.setattr(module, "save_figure", figures.save_figure)
    return drawn


@pytest.mark.parametrize("name", list(FIGURES))
def test_every_legend_sits_outside_the_data(name, tmp_path, monkeypatch):
    """Each figure, drawn from small synthetic inputs with the default run's longest policy
    name: its legends (as many as expected) cover no panel, lie whole on the canvas, are at
    least 9 pt and cover no panel's tick labels, axis labels or title."""
    draw, expected = FIGURES[name]
    drawn = _drawn_everywhere(monkeypatch)
    draw(tmp_path, np.random.default_rng(0))
    (fig,) = drawn
    legends = legends_outside_the_axes(fig)
    assert len(legends) == expected
    renderer = fig.canvas.get_renderer()
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            parts = [ax.xaxis.get_tightbbox(renderer), ax.yaxis.get_tightbbox(renderer)]
            if ax.get_title():
                parts.append(ax.title.get_window_extent(renderer))
            for extent in parts:
                if extent is not None:
                    assert not box.overlaps(extent), (name, box, extent)
        assert all(t.get_text() for t in legend.get_texts())


def test_matched_and_error_state_figures_have_their_own_titles(tmp_path, monkeypatch):
    drawn = _drawn(monkeypatch)
    rng = np.random.default_rng(1)
    pools = {"all": (rng.random(12), rng.random(12))}
    titles = (
        "Step-level action quality on matched states: GRPO vs base",
        "Step-level action quality at error states: GRPO vs base",
    )
    sections = [
        step_quality.section(tmp_path, step_quality.compute(pools), name=f"q{i}", title=title)
        for i, title in enumerate(titles)
    ]
    assert [fig.get_suptitle() for fig in drawn] == list(titles)
    assert [s.title for s in sections] == list(titles)


def test_continuation_values_sit_inside_the_frame(tmp_path, monkeypatch):
    """Each rate's value label lies inside the axes (above its whisker), and states the rate."""
    drawn = _drawn(monkeypatch)
    rates = {
        "base": stats.MeanCI(0.108, 0.093, 0.125, 1584),
        "GRPO": stats.MeanCI(0.605, 0.58, 0.63, 1584),
    }
    continuation.plot_rates_with_ci(rates, tmp_path / "continuation")
    fig = drawn[0]
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    labels = [t for t in ax.texts]
    assert [t.get_text() for t in labels] == ["0.108", "0.605"]
    for text in labels:
        box = text.get_window_extent(renderer)
        assert frame.y0 <= box.y0 and box.y1 <= frame.y1, (text.get_text(), box, frame)


def test_the_llr_figure_marks_the_reports_final_values(tmp_path, monkeypatch):
    """The legend's per-outcome final LLR is ``llr_by_outcome``'s (the report's), drawn as its
    own marker, not next to the running-mean curve as if it were that curve's end."""
    drawn = _drawn(monkeypatch)
    logp_rl, logp_base, mask, success = tiny_llr_set(np.random.default_rng(3), n=12, t=8)
    res = likelihood.compute(
        {"base": [1.0]}, {"RL trajectories": (logp_rl, logp_base, mask, success)}
    )
    likelihood.plot_cumulative_llr(res.llr, tmp_path / "llr")
    by_outcome = likelihood.llr_by_outcome(
        likelihood.cumulative_llr(logp_rl, logp_base, mask), mask, success
    )
    ax = drawn[0].axes[0]
    markers = {
        line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if line.get_marker() == "D"
    }
    for outcome in ("success", "failure"):
        final = by_outcome[outcome].final.mean
        label = f"{outcome}: mean at each one's last turn {final:+.1f}"
        assert markers[label] == pytest.approx(final)
        assert label in [t.get_text() for t in ax.get_legend().get_texts()]


class _Page(html.parser.HTMLParser):
    """The images, links and section ids of an HTML page."""

    def __init__(self):
        super().__init__()
        self.images, self.links, self.ids = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "a":
            self.links.append(attrs["href"])
        if tag == "section":
            self.ids.append(attrs["id"])


def read_page(path):
    page = _Page()
    page.feed(path.read_text())
    return page


def test_the_html_report_holds_every_figure_inline_and_links_existing_files(tmp_path):
    path, _ = write_tiny_results(tmp_path)
    page = read_page(tmp_path / "report.html")
    pngs = sorted((tmp_path / "figures").glob("*.png"))
    assert len(page.images) == len(pngs) == 9
    embedded = sorted(base64.b64decode(src.split(",", 1)[1]) for src in page.images)
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    assert embedded == sorted(p.read_bytes() for p in pngs)  # each figure, byte for byte
    for href in page.links:
        if href.startswith("#"):
            assert href[1:] in page.ids, href
        else:
            assert (tmp_path / href).is_file(), href
    markdown_titles = [line[3:] for line in path.read_text().splitlines() if line.startswith("## ")]
    assert page.ids == [anchor(t) for t in markdown_titles]
