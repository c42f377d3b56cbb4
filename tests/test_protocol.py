"""PythonTextEnv: per-row play, live masks, timeouts and environment failures."""

import threading
import time

import numpy as np
import pytest

from envs.protocol import Feedback, PythonEnv, PythonTextEnv, text_key


class GuessEnv(PythonEnv):
    """Guess the task's number; "hang" blocks, "crash" raises, "slow N" takes 0.2 s."""

    name, t_max = "guess", 5

    def __init__(self):
        self.closed = []
        self.release = threading.Event()

    def instructions(self):
        return "Guess the number."

    def num_tasks(self):
        return 10

    def reset_task(self, task_id, seed):
        return {"target": task_id, "guesses": 0}, f"task {task_id}"

    def step_task(self, state, response):
        if response == "hang":
            self.release.wait(5)
        if response == "crash":
            raise RuntimeError("boom")
        if response.startswith("slow "):
            time.sleep(0.2)
            response = response.removeprefix("slow ")
        state = dict(state, guesses=state["guesses"] + 1)
        try:
            guess = int(response)
        except ValueError:
            return state, Feedback("not a number", action_valid=False)
        won = guess == state["target"]
        return state, Feedback(
            "right" if won else "wrong", reward=float(won), done=won, success=won
        )

    def state_key(self, state):
        return text_key(state["target"], state["guesses"])

    def close_task(self, state):
        self.closed.append(state["target"])


def test_rows_play_independently_and_keys_are_stable():
    inner = GuessEnv()
    env = PythonTextEnv(inner, workers=2, step_timeout_s=2)
    rows, obs = env.reset(np.array([3, 4, 5]), seed=0)
    assert obs == ["task 3", "task 4", "task 5"]
    rows, r = env.step(rows, ["3", "x", "1"], np.array([True, True, True]))
    np.testing.assert_array_equal(r.reward, [1, 0, 0])
    np.testing.assert_array_equal(r.done, [True, False, False])
    np.testing.assert_array_equal(r.success, [True, False, False])
    np.testing.assert_array_equal(r.action_valid, [True, False, True])
    assert r.observations == ["right", "not a number", "wrong"]
    assert inner.closed == [3]
    # The anchor key is of the state acted from: rows 1 and 2 differ by task, so do their keys.
    assert r.anchor_key[0] == text_key(3, 0) and len(set(r.anchor_key.tolist())) == 3
    # A done row stays done and unchanged even if marked live; a non-live row is untouched.
    rows, r2 = env.step(rows, ["3", "4", "5"], np.array([True, True, False]))
    np.testing.assert_array_equal(r2.done, [True, True, False])
    np.testing.assert_array_equal(r2.reward, [0, 1, 0])
    assert r2.observations[2] == ""
    env.close()


def test_timeout_and_crash_end_only_their_row():
    inner = GuessEnv()
    env = PythonTextEnv(inner, workers=3, step_timeout_s=0.3)
    rows, _ = env.reset(np.array([1, 2, 3]), seed=0)
    t0 = time.perf_counter()
    rows, r = env.step(rows, ["hang", "crash", "3"], np.ones(3, bool))
    assert time.perf_counter() - t0 < 3
    inner.release.set()
    np.testing.assert_array_equal(r.info["timeout"], [True, False, False])
    np.testing.assert_array_equal(r.done, [True, True, True])
    np.testing.assert_array_equal(r.success, [False, False, True])
    assert "timed out" in r.observations[0] and "RuntimeError: boom" in r.observations[1]
    env.close()


def test_a_step_waiting_for_a_worker_is_not_charged_for_the_steps_before_it():
    """One worker, four 0.2 s steps, 0.5 s each: the batch takes 0.8 s, no step more than 0.2 s,
    so none times out (a timeout over the whole batch once ended the last rows under load)."""
    env = PythonTextEnv(GuessEnv(), workers=1, step_timeout_s=0.5)
    rows, _ = env.reset(np.array([1, 2, 3, 4]), seed=0)
    rows, r = env.step(rows, ["slow 1", "slow 2", "slow 3", "slow 4"], np.ones(4, bool))
    assert not r.info["timeout"].any() and r.observations == ["right"] * 4
    np.testing.assert_array_equal(r.success, True)
    env.close()


def test_steps_queued_behind_hung_workers_end_their_rows_instead_of_hanging():
    inner = GuessEnv()
    env = PythonTextEnv(inner, workers=1, step_timeout_s=0.3)
    rows, _ = env.reset(np.array([1, 2, 3, 4, 4]), seed=0)
    t0 = time.perf_counter()
    rows, r = env.step(rows, ["hang", "2", "3", "", ""], np.array([1, 1, 1, 0, 0], bool))
    assert time.perf_counter() - t0 < 3
    np.testing.assert_array_equal(r.info["timeout"], [True, True, True, False, False])
    assert "timed out after 0.3 s" in r.observations[0]
    assert all("could not start" in o for o in r.observations[1:3])
    # The next batch, with the worker still hung, ends at once the same way; once the worker
    # is free again, steps run.
    rows, r = env.step(rows, [""] * 3 + ["4", ""], np.array([0, 0, 0, 1, 0], bool))
    assert r.info["timeout"][3] and "could not start" in r.observations[3]
    inner.release.set()
    time.sleep(0.1)
    rows, r = env.step(rows, [""] * 4 + ["4"], np.array([0, 0, 0, 0, 1], bool))
    assert not r.info["timeout"][4] and r.success[4]
    env.close()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="workers"):
        PythonTextEnv(GuessEnv(), workers=0)
    env = PythonTextEnv(GuessEnv())
    with pytest.raises(ValueError, match="task_ids"):
        env.reset(np.array([10]), seed=0)
    env.close()


def test_text_key_is_stable_int32():
    assert text_key("a", 1) == text_key("a", 1) != text_key("a", 2)
    assert 0 <= text_key("x" * 1000) < 2**31
