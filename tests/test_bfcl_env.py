"""BFCL v3 multi-turn: the package's data loaded offline, the call grammar, execution, and the
reward checked against the package's own ``multi_turn_checker`` (the reference)."""

import json
import random
import shutil
import threading
import uuid

import numpy as np
import pytest
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code.gorilla_file_system import (
    GorillaFileSystem,
)
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.bfcl import (
    CATEGORIES,
    ApiSet,
    BfclConfig,
    BfclEnv,
    Calls,
    Malformed,
    NoCall,
    load_tasks,
    package_data_dir,
    parse_call,
    parse_response,
    reference_responses,
)
from envs.bfcl import calls as calls_lib
from envs.bfcl import data as data_lib
from envs.bfcl.env import ADDED_FUNCTIONS_MESSAGE
from envs.protocol import PythonTextEnv


@pytest.fixture(scope="module")
def base_env():
    return BfclEnv()


def _raw_lines(category, folder=None):
    folder = folder or package_data_dir()
    [path] = folder.glob(f"BFCL_v*_{category}.json")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _official_verdict(task, steps):
    """The package's multi_turn_checker on per-turn lists of steps (lists of call strings)."""
    entry = {
        "id": task.id,
        "initial_config": task.initial_config,
        "involved_classes": list(task.involved_classes),
    }
    # The checker keeps instances in module globals keyed by the model name: use a fresh one.
    return multi_turn_checker(
        steps,
        [list(t) for t in task.ground_truth],
        entry,
        task.category,
        f"agentrl_test_{uuid.uuid4().hex}",
    )["valid"]


def _play(env, task_id, steps):
    """Our verdict on per-turn lists of steps: each step one call-list response, then ""."""
    episode, _ = env.reset_task(task_id, 0)
    for turn in steps:
        for step in turn:
            episode, fb = env.step_task(episode, "[" + ", ".join(step) + "]")
            assert fb.action_valid and not fb.done
        episode, fb = env.step_task(episode, "")
        if fb.done:
            assert fb.reward == float(fb.success)
            return fb.success
    raise AssertionError("the episode did not end after the last request")


# --- data ------------------------------------------------------------------------------------


def test_multi_turn_base_loads_fully():
    tasks = load_tasks("multi_turn_base")
    raw = _raw_lines("multi_turn_base")
    answers = _raw_lines("multi_turn_base", package_data_dir() / "possible_answer")
    assert len(tasks) == len(raw) == 200
    assert [t.id for t in tasks] == [f"multi_turn_base_{i}" for i in range(200)]
    docs_dir = package_data_dir() / "multi_turn_func_doc"
    for task, question, answer in zip(tasks, raw, answers):
        assert [[(m.role, m.content) for m in turn] for turn in task.turns] == [
            [(m["role"], m["content"]) for m in turn] for turn in question["question"]
        ]
        assert [list(t) for t in task.ground_truth] == answer["ground_truth"]
        assert task.initial_config == question["initial_config"]
        assert list(task.involved_classes) == question["involved_classes"]
        names = set()
        for cls in task.involved_classes:
            doc_file = data_lib.backend_config().MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls]
            names |= {
                json.loads(line)["name"]
                for line in (docs_dir / doc_file).read_text().splitlines()
                if line.strip()
            }
        assert {doc["name"] for doc in task.functions} == names and not task.added_functions
        assert task.min_turns == len(task.turns) + sum(1 for t in task.ground_truth if t)
    # BFCL's structural bound: the annotated trajectory fits the paper's budget.
    assert max(t.min_turns for t in tasks) <= BfclEnv.t_max


def test_all_multi_turn_categories_load_and_miss_func_holds_functions_back():
    for category in CATEGORIES:
        assert len(load_tasks(category)) == len(_raw_lines(category)) == 200
    raw = _raw_lines("multi_turn_miss_func")
    for task, question in zip(load_tasks("multi_turn_miss_func"), raw):
        held = {int(k): set(v) for k, v in question["missed_function"].items()}
        assert {k: {d["name"] for d in docs} for k, docs in task.added_functions.items()} == held
        offered = {d["name"] for d in task.functions}
        assert not offered & set().union(*held.values())
        assert all(not task.turns[k] for k in held)


def test_missing_package_and_bad_data_are_reported_clearly(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown BFCL category 'multi_turn_nope'"):
        load_tasks("multi_turn_nope")
    with pytest.raises(FileNotFoundError, match="BFCL_v<N>_multi_turn_base.json"):
        load_tasks("multi_turn_base", data_dir=tmp_path)
    data_dir = tmp_path / "data"
    shutil.copytree(package_data_dir(), data_dir)
    question_file = next(data_dir.glob("BFCL_v*_multi_turn_base.json"))
    lines = question_file.read_text().splitlines()
    question_file.write_text("\n".join(lines[:2] + ["{not json"] + lines[3:]) + "\n")
    with pytest.raises(ValueError, match=rf"{question_file.name}:3: not valid JSON"):
        load_tasks("multi_turn_base", data_dir=data_dir)
    first = json.loads(lines[0])
    first["id"] = "multi_turn_base_999"
    question_file.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match="does not match the task id 'multi_turn_base_999'"):
        load_tasks("multi_turn_base", data_dir=data_dir)
    first = json.loads(lines[0])
    del first["involved_classes"]
    question_file.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    with pytest.raises(
        ValueError, match=rf"{question_file.name}:1: missing field 'involved_classes'"
    ):
        load_tasks("multi_turn_base", data_dir=data_dir)
    monkeypatch.setattr(data_lib.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps bfcl-eval"):
        load_tasks("multi_turn_base")


def test_config_is_validated():
    with pytest.raises(ValueError, match="BfclConfig.categories"):
        BfclConfig(categories="multi_turn_base")
    with pytest.raises(ValueError, match="unknown category 'web_search'"):
        BfclConfig(categories=("web_search",))
    with pytest.raises(ValueError, match="max_result_chars"):
        BfclConfig(max_result_chars=0)


# --- grammar ---------------------------------------------------------------------------------


def test_call_lists_parse_into_calls():
    parsed = parse_response("[cd(folder='document'), mkdir(dir_name=\"temp\"), ls(a=True)]")
    assert [(c.name, c.args, dict(c.kwargs)) for c in parsed.calls] == [
        ("cd", (), {"folder": "document"}),
        ("mkdir", (), {"dir_name": "temp"}),
        ("ls", (), {"a": True}),
    ]
    assert [c.text for c in parsed.calls] == [
        "cd(folder='document')",
        "mkdir(dir_name='temp')",
        "ls(a=True)",
    ]
    nested = parse_response("[f(x={'k': [1, (2, 3)], 'n': None}, y=-1.5, z={1})]").calls[0]
    assert dict(nested.kwargs) == {"x": {"k": [1, (2, 3)], "n": None}, "y": -1.5, "z": {1}}
    for text in [
        "ls(a=True)",
        " ```python\n[ls(a=True)]\n``` ",
        "<think>maybe [rm(x=1)]</think>\n[ls(a=True)]",
        "<think>a</think><think>b</think>ls(a=True)",
    ]:
        assert parse_response(text) == parse_response("[ls(a=True)]"), text
    assert parse_response("sort('report.pdf')").calls[0].args == ("report.pdf",)
    assert parse_call("cd(folder='x')") == parse_response("[cd(folder='x')]").calls[0]
    with pytest.raises(ValueError, match="not a literal"):
        parse_call("cd(folder=x)")


def test_answers_without_a_call_end_the_request():
    for text in [
        "",
        "  \n",
        "[]",
        "```\n[]\n```",
        "<think>I am done</think>",
        "I created the folder and moved the file.",
        "Done (the file is there).",
    ]:
        assert isinstance(parse_response(text), NoCall), text
    assert parse_response("<think>x</think> All set.") == NoCall("All set.")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<think>I will call [ls()]", "inside <think>"),
        ("[ls(a=True)", "not a valid Python list of calls"),
        ("[ls()] Done!", "not a valid Python list of calls"),
        ("ls() then cd(folder='x')", "not a valid Python list of calls"),
        ("[ls(a=x)]", "argument a=x is not a literal value"),
        ("[ls(a=1 + 2)]", "argument a=1 + 2 is not a literal value"),
        ("[ls(a=print('side effect'))]", "is not a literal value"),
        ("[os.system('rm -rf /')]", "os.system is not a plain function name"),
        ("[__import__('os').system('x')]", "is not a plain function name"),
        ("[ls(*a)]", "*arguments are not allowed"),
        ("[ls(**k)]", "**arguments are not allowed"),
        ("[1, 2]", "1 is not a function call"),
        ("[ls" + "(" * 500 + ")" * 500 + "]", "not a valid Python list of calls"),
        ("[f(a=" + "[" * 5000 + "]" * 5000 + ")]", "not a valid Python list of calls"),
    ],
)
def test_malformed_calls_are_reported(text, reason, capsys):
    parsed = parse_response(text)
    assert isinstance(parsed, Malformed) and reason in parsed.reason, parsed
    assert capsys.readouterr().out == ""  # nothing was evaluated


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parsing_never_raises(text):
    assert isinstance(parse_response(text), (Calls, NoCall, Malformed))


_LITERALS = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: (
        s
        not in {
            "if",
            "in",
            "is",
            "or",
            "and",
            "not",
            "for",
            "def",
            "del",
            "try",
            "as",
            "with",
            "else",
            "elif",
            "from",
            "pass",
            "while",
            "break",
            "class",
            "raise",
            "yield",
            "async",
            "await",
            "global",
            "import",
            "lambda",
            "return",
            "assert",
            "except",
            "finally",
            "continue",
            "nonlocal",
        }
    )
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(_NAMES, st.dictionaries(_NAMES, _LITERALS, max_size=3)), min_size=1, max_size=4
    )
)
def test_calls_round_trip_through_python_literals(calls):
    # Independent reference: Python's own repr of each value is a literal the grammar must read.
    text = (
        "["
        + ", ".join(
            f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
            for name, kwargs in calls
        )
        + "]"
    )
    parsed = parse_response(text)
    assert [(c.name, dict(c.kwargs)) for c in parsed.calls] == calls


# --- execution -------------------------------------------------------------------------------


def test_results_are_written_as_the_official_executor_writes_them():
    assert calls_lib.result_text("plain") == "plain"
    assert calls_lib.result_text({"a": [1, "x"]}) == '{"a": [1, "x"]}'
    assert calls_lib.result_text({"a": {1, 2}}) == "{'a': {1, 2}}"  # JSON cannot hold a set
    assert calls_lib.result_text([1, 2]) == "[1, 2]" and calls_lib.result_text(None) == "None"
    apis = ApiSet(
        ["GorillaFileSystem", "MathAPI"],
        {"GorillaFileSystem": {"root": {"alex": {"type": "directory", "contents": {}}}}},
        long_context=False,
    )
    call = lambda text: parse_call(text)
    assert apis.run([call("mkdir(dir_name='temp')"), call("ls()"), call("add(a=1, b=2)")]) == [
        "None",
        '{"current_directory_content": ["temp"]}',
        '{"result": 3}',
    ]
    assert apis.execute(call("cd()")) == (
        "Error during execution: GorillaFileSystem.cd() missing 1 required positional "
        "argument: 'folder'"
    )
    assert apis.execute(call("exit()")) == "Error during execution: name 'exit' is not defined"
    assert apis.execute(call("_load_scenario(scenario={})")) == (
        "Error during execution: name '_load_scenario' is not defined"
    )


def test_concurrent_rows_get_the_results_of_a_lone_row():
    # MathAPI.logarithm sets mpmath's process-wide precision; rows in threads must not interfere.
    calls = [
        parse_call(f"logarithm(value={v}, base=7, precision={p})")
        for v, p in [(2, 3), (1000, 30), (5, 12), (42, 50)]
    ]
    apis = ApiSet(["MathAPI"], {}, long_context=False)
    expected = apis.run(calls)
    outputs, threads = [], []

    def worker():
        row = ApiSet(["MathAPI"], {}, long_context=False)
        outputs.append([row.run(calls) for _ in range(100)])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(run == expected for runs in outputs for run in runs)


# --- the environment -------------------------------------------------------------------------


def _replay_batch(env, task_ids, workers=4):
    """Every row plays its task's reference responses through PythonTextEnv, in one batch."""
    text_env = PythonTextEnv(env, workers=workers, step_timeout_s=60)
    rows, _ = text_env.reset(np.asarray(task_ids), seed=0)
    scripts = [reference_responses(env.tasks[i]) for i in task_ids]
    n = len(task_ids)
    steps, reward, success = np.zeros(n, int), np.zeros(n), np.zeros(n, bool)
    keys = []
    live = np.ones(n, bool)
    while live.any():
        responses = [scripts[i][steps[i]] if live[i] else "" for i in range(n)]
        rows, result = text_env.step(rows, responses, live)
        refused = np.flatnonzero(live & ~np.asarray(result.action_valid, bool))
        timed_out = np.flatnonzero(np.asarray(result.info["timeout"], bool))
        # say which response the environment refused at which step (it once failed under load)
        for i in (*refused, *timed_out):
            raise AssertionError(
                f"task {env.tasks[task_ids[i]].id} step {steps[i]}: response "
                f"{responses[i]!r} was {'timed out' if i in timed_out else 'refused'}; "
                f"observation {result.observations[i][:500]!r}"
            )
        keys.append(result.anchor_key.copy())
        steps += live
        reward += result.reward
        success |= result.success
        live &= ~result.done
    text_env.close()
    return steps, reward, success, np.stack(keys)


def test_reference_answers_score_one_on_every_base_task(base_env):
    task_ids = np.arange(base_env.num_tasks())
    steps, reward, success, keys = _replay_batch(base_env, task_ids)
    official = [
        _official_verdict(t, [[list(c)] if c else [] for c in t.ground_truth])
        for t in base_env.tasks
    ]
    assert sum(official) == 200  # the checker accepts the annotation on every base task ...
    np.testing.assert_array_equal(success, official)  # ... and so do we: 200 of 200
    np.testing.assert_array_equal(reward, 1.0)
    np.testing.assert_array_equal(steps, [t.min_turns for t in base_env.tasks])
    # Anchor keys are stable: a fresh environment replaying the same script gives the same keys.
    *_, keys_again = _replay_batch(BfclEnv(), task_ids, workers=2)
    np.testing.assert_array_equal(keys, keys_again)


def _skip_one_request(gt, rng):
    skipped = rng.randrange(len(gt))
    return [[list(t)] if t and k != skipped else [] for k, t in enumerate(gt)]


# Ways to replay (or spoil) the annotation: ground truth -> per-turn lists of steps.
PERTURBATIONS = {
    "one call per response": lambda gt, rng: [[[c] for c in t] for t in gt],
    "no call at all": lambda gt, rng: [[] for _ in gt],
    "last call left out": lambda gt, rng: [[list(t[:-1])] if len(t) > 1 else [] for t in gt],
    "calls shuffled": lambda gt, rng: [[rng.sample(list(t), len(t))] if t else [] for t in gt],
    "calls made twice": lambda gt, rng: [[list(t) * 2] if t else [] for t in gt],
    "one request skipped": _skip_one_request,
}


def test_reward_matches_the_official_checker_on_right_and_wrong_trajectories(base_env):
    accepted = {}
    for name, perturb in PERTURBATIONS.items():
        rng = random.Random(0)
        for task_id, task in enumerate(base_env.tasks):
            steps = perturb(task.ground_truth, rng)
            ours = _play(base_env, task_id, steps)
            assert ours == _official_verdict(task, steps), (name, task.id)
            accepted[name] = accepted.get(name, 0) + ours
    # Both outcomes occur, so the agreement is not vacuous.
    assert accepted["one call per response"] == 200 and accepted["no call at all"] == 0
    assert 0 < accepted["calls shuffled"] < 200 and 0 < accepted["calls made twice"] < 200


@pytest.mark.parametrize(
    "category", ["multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"]
)
def test_other_categories_agree_with_the_official_checker(category):
    env = BfclEnv(BfclConfig(categories=(category,)))
    for task_id, task in enumerate(env.tasks):
        truth = [[list(c)] if c else [] for c in task.ground_truth]
        assert _play(env, task_id, truth) and _official_verdict(task, truth), task.id
    for name in ["last call left out", "calls shuffled", "calls made twice", "one request skipped"]:
        rng = random.Random(1)
        for task_id, task in enumerate(env.tasks):
            steps = PERTURBATIONS[name](task.ground_truth, rng)
            assert _play(env, task_id, steps) == _official_verdict(task, steps), (name, task.id)


def test_observations_show_functions_requests_and_results(base_env):
    task = base_env.tasks[0]
    episode, first = base_env.reset_task(0, seed=0)
    assert first.endswith("User: " + task.turns[0][0].content)
    for doc in task.functions:
        assert json.dumps(doc) in first
    _, fb = base_env.step_task(
        episode, "[cd(folder='document'), mkdir(dir_name='temp'), cd(folder='nope')]"
    )
    assert fb.observation == (
        'Results:\ncd(folder=\'document\') -> {"current_working_directory": "document"}\n'
        "mkdir(dir_name='temp') -> None\n"
        "cd(folder='nope') -> {\"error\": \"cd: 'nope': No such file or directory\"}"
    )
    _, fb = base_env.step_task(episode, "[mv(source='final_report.pdf', destination='temp')]")
    _, fb = base_env.step_task(episode, "Moved.")
    assert fb.observation == "User: " + task.turns[1][0].content and not fb.done
    # A miss-func request shows the functions it adds.
    env = BfclEnv(BfclConfig(categories=("multi_turn_miss_func",)))
    task_id = 0
    task = env.tasks[task_id]
    [(turn, added)] = task.added_functions.items()
    episode, _ = env.reset_task(task_id, 0)
    for response in reference_responses(task):
        episode, fb = env.step_task(episode, response)
        if episode.turn == turn:
            break
    assert "New functions you can call" in fb.observation
    assert all(json.dumps(doc) in fb.observation for doc in added)
    assert fb.observation.endswith("User: " + ADDED_FUNCTIONS_MESSAGE)


def test_long_results_are_cut_for_display_only():
    env = BfclEnv(BfclConfig(categories=("multi_turn_long_context",), max_result_chars=50))
    lengths = []
    for task_id, task in enumerate(env.tasks[:30]):
        episode, _ = env.reset_task(task_id, 0)
        for response in reference_responses(task):
            episode, fb = env.step_task(episode, response)
            lengths += [len(r) for r in episode.results]
        assert fb.success, task.id  # the checks use the full results
    assert max(lengths) > 50
    episode, _ = env.reset_task(0, 0)
    _, fb = env.step_task(episode, "[ls(a=True)]")
    assert "more characters not shown]" in fb.observation


def test_wrong_answers_score_zero(base_env):
    task = base_env.tasks[0]
    episode, _ = base_env.reset_task(0, 0)
    _, fb = base_env.step_task(episode, "")  # skip the calls
    assert fb.done and fb.reward == 0 and not fb.success
    assert "Request 1 was not fulfilled: no function was called" in fb.observation
    episode, _ = base_env.reset_task(0, 0)
    base_env.step_task(episode, "[cd(folder='document'), mkdir(dir_name='tmp')]")  # wrong name
    _, fb = base_env.step_task(episode, "")
    assert fb.done and fb.reward == 0 and "does not match the state" in fb.observation
    assert "root" in fb.observation  # names the differing attribute
    assert task.ground_truth[0]


def test_malformed_output_is_an_invalid_action_and_changes_nothing(base_env):
    episode, _ = base_env.reset_task(0, 0)
    key = base_env.state_key(episode)
    for response in ["[cd(folder='document')", "<think>cd to document", "[cd(folder=document)]"]:
        episode, fb = base_env.step_task(episode, response)
        assert not fb.action_valid and not fb.done and fb.reward == 0
        assert fb.observation.startswith("Invalid function call: ")
        assert "[cd(folder='documents'), ls(a=True)]" in fb.observation  # says what is expected
        assert base_env.state_key(episode) == key and episode.turn == 0
    # Unknown functions parse: they run and fail as they would in BFCL.
    episode, fb = base_env.step_task(episode, "[rm_rf(path='/')]")
    assert fb.action_valid and "name 'rm_rf' is not defined" in fb.observation
    # The request goes on: the right calls still succeed.
    for response in reference_responses(base_env.tasks[0]):
        episode, fb = base_env.step_task(episode, response)
    assert fb.success


def test_anchor_keys_follow_the_state(base_env):
    a, _ = base_env.reset_task(0, 0)
    b, _ = base_env.reset_task(0, 0)
    c, _ = base_env.reset_task(1, 0)
    key = base_env.state_key
    assert key(a) == key(b) != key(c)
    base_env.step_task(a, "[cd(folder='document')]")
    base_env.step_task(b, "[ls()]")
    assert key(a) != key(b)  # a different result so far
    base_env.step_task(b, "[cd(folder='document')]")
    assert key(a) != key(b)
    b2, _ = base_env.reset_task(0, 0)
    base_env.step_task(b2, "[cd(folder='document')]")
    assert key(a) == key(b2)


def test_a_hanging_call_is_a_timeout_and_the_batch_goes_on(monkeypatch, base_env):
    release = threading.Event()
    original_ls = GorillaFileSystem.ls

    def hanging_ls(self, *args, **kwargs):
        release.wait(10)
        return original_ls(self, *args, **kwargs)

    monkeypatch.setattr(GorillaFileSystem, "ls", hanging_ls)
    text_env = PythonTextEnv(base_env, workers=2, step_timeout_s=0.5)
    rows, _ = text_env.reset(np.array([0, 0]), seed=0)
    try:
        rows, result = text_env.step(
            rows, ["[ls(a=True)]", "[cd(folder='document')]"], np.ones(2, bool)
        )
        np.testing.assert_array_equal(result.info["timeout"], [True, False])
        np.testing.assert_array_equal(result.done, [True, False])
        assert "timed out" in result.observations[0]
        assert result.observations[1].startswith("Results:\ncd(folder='document')")
        rows, result = text_env.step(
            rows, ["", "[mkdir(dir_name='temp')]"], np.array([False, True])
        )
        np.testing.assert_array_equal(result.done, [True, False])
        assert result.action_valid[1] and not result.info["timeout"].any()
    finally:
        release.set()
        text_env.close()


def test_instructions_leave_the_budget_to_the_rollout(base_env):
    text = base_env.instructions()
    assert "[cd(folder='documents'), ls(a=True)]" in text and "without a call" in text
    assert not any(word in text.lower() for word in ["budget", "remaining", "max turns"])
    assert base_env.t_max == 24 and base_env.name == "bfcl"


def test_responses_parse_in_many_threads_at_once():
    """PythonTextEnv steps rows in worker threads; CPython 3.11's ast.parse is not safe in
    several at once (gh-106905: "SystemError: AST constructor recursion depth mismatch", the
    replay tests' rare failure under load). Bare ast.parse of this response from 4 threads
    failed 3 times in 6000 parses on the project's CPU (2026-12-06); parse_response holds a
    lock, so it never does (1600 here)."""
    response = "[" + ", ".join(f"f{i}(a=[1, [2, [3, {{'k': (4, 5)}}]]], b='x')" for i in range(40))
    response += "]"
    errors, expected = [], parse_response(response)

    def parse_many():
        try:
            for _ in range(400):
                assert parse_response(response) == expected
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=parse_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(expected.calls) == 40
