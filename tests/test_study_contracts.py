"""What the reproduction's pipeline needs of each built-in environment's study
(agentrl_jax.reproduce.studies), checked study by study without running the pipeline: its CI
config loads and resolves, its tasks split as it says, its report line, bounds, demonstrations,
tokenizer corpus, R_single scorer, state diagnostics and paper figures are there and consistent.

The pipeline itself is environment-agnostic and runs end to end twice in the suite: on
FrozenLake at CI size (tests/test_reproduce_pipeline.py) and on a fast user environment given
as a plugin (tests/test_reproduce_envs.py); every gold plan of the Python environments is
played through the real environment in tests/test_reproduce_envs.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import envs
from agentrl_jax.evaluation import findings
from agentrl_jax.evaluation.analyses import registry
from agentrl_jax.prompts import BudgetPrompt
from agentrl_jax.reproduce.config import load_config
from agentrl_jax.reproduce.studies import StudyError, study_for

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STUDIES = ("frozenlake", "sql", "code", "bfcl")
PAIRWISE_STATE_ANALYSES = {"steps", "errors"}


@pytest.fixture(scope="module", params=STUDIES)
def study_tasks(request):
    """``(name, CI config, study, train tasks, test tasks)``, three tasks of each split."""
    name = request.param
    config = load_config(CONFIGS / f"{name}_ci.yaml")
    study = study_for(name)
    train = study.tasks(config.task, split="train", count=3)
    test = study.tasks(config.task, split="test", count=3)
    yield name, config, study, train, test
    train.close()
    test.close()


def test_the_ci_config_is_the_studys_and_every_run_resolves(study_tasks):
    name, config, study, *_ = study_tasks
    assert config.task.env == name and config.study is study
    runs = config.rl.resolved_runs()  # every run's algorithm builds
    assert len(runs) == len(config.rl.runs) and runs
    written = config.to_dict()
    for section, fields in study.config_defaults.items():  # the study's defaults reach it
        assert set(fields) <= set(written[section]), section


def test_tasks_split_as_the_study_says_and_carry_the_budget(study_tasks):
    _, config, study, train, test = study_tasks
    assert len(train.names) == len(test.names) == 3
    assert train.env.t_max == test.env.t_max == config.task.t_max
    if study.has_split(config.task.entry):
        assert not set(train.names) & set(test.names)
    bounds = study.min_turns(test)
    assert bounds.shape == (3,) and bounds.dtype == np.int64 and (bounds >= 1).all()
    line = study.describe(
        config.task.entry, config.task.options, t_max=config.task.t_max, train=train, test=test
    )
    assert f"T_max {config.task.t_max}" in line and "3 test" in line
    assert study.bound_note_for(config.task.options)


def test_the_demonstrations_and_the_tokenizer_corpus_cover_the_gold_play(study_tasks):
    _, config, study, train, _ = study_tasks
    ids = study.demonstrable(train, np.arange(3))
    assert set(ids.tolist()) <= {0, 1, 2} and len(ids)
    demo = study.demonstrator(train, ids, t_max=config.task.t_max, mistake_rate=0.0, seed=0)
    assert callable(demo)
    prompt = BudgetPrompt()
    corpus = study.corpus(train, ids, t_max=config.task.t_max, prompt=prompt)
    assert all(isinstance(text, str) for text in corpus)
    instructions = train.env.instructions()
    for budget in range(1, config.task.t_max + 1):  # the system prompt at every budget
        assert f"system\n{prompt.system_text(instructions, budget)}" in corpus
    try:
        replies = {r for t in ids for r in study.plan(train, t)}
    except StudyError:  # no gold replies (FrozenLake's demonstrator is Q*)
        replies = set()
    assert all(f"\n\n{r}" in corpus for r in replies)


def test_r_single_and_the_state_diagnostics_are_there_when_the_study_says(study_tasks):
    _, _, study, train, test = study_tasks
    if study.records_quality:
        assert study.step_scorer(train) is not None
    diagnostics = study.state_diagnostics(test)
    supported = set(study.analyses_for(registry.names()))
    assert (diagnostics is not None) == (PAIRWISE_STATE_ANALYSES <= supported)
    assert {"table", "passk", "likelihood"} <= supported


def test_the_paper_figures_a_study_cites_are_valid_and_written_with_the_run(study_tasks, tmp_path):
    name, _, study, *_ = study_tasks
    figures = findings.PaperFigures(**study.paper_figures)
    figures.write(tmp_path)
    assert findings.PaperFigures.load(tmp_path) == figures
    label = envs.entry(name).label
    for text in figures.texts.values():  # an environment's own figures name it
        assert label.split()[0] in text, text
