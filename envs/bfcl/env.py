"""BFCL v3 multi-turn as a :class:`~envs.protocol.PythonEnv`.

An episode is one BFCL task: a conversation of several user requests against stateful APIs
(a file system, a trading bot, ...). The first observation lists the task's functions and the
first request. Each model turn is one step:

* a response with function calls (grammar: :mod:`envs.bfcl.calls`) runs them, in order,
  against the episode's API instances; the observation lists each call with its result;
* a response without a call ends the current request. It is checked as the official
  ``multi_turn_checker`` checks a turn, and if it passes, the next request is shown (a
  miss-func turn shows the functions it adds); after the last request the episode ends with
  reward 1. A turn that fails the check ends the episode with reward 0 at once: the official
  checker stops at the first failing turn, so nothing after it can change the outcome;
* a response that tries to call but does not parse is an invalid action; the observation says
  why and the request goes on.

The check of a request with annotated calls (turns annotated with no call are not checked, as
in BFCL): the agent called functions in it; the package's ``state_checker`` finds every public
attribute of every API instance equal to that of instances that replayed the annotated calls of
all requests so far; and the package's ``response_checker`` finds every result of this
request's annotated calls among the results of all the agent's calls so far (as a multiset,
any order). The two checkers are the package's own functions; the execution that feeds them is
:class:`envs.bfcl.calls.ApiSet`, a faithful re-implementation of the official executor without
``eval`` (see there).

Deliberate differences from BFCL's own inference loop, for a training environment: a response
that fails to parse is an invalid action rather than the end of the request; positional
arguments are bound as Python binds them (BFCL's prompt decoder drops them, though its own
annotations use them); there is no per-request step cap (BFCL fails a task after 20 steps in
one request): the rollout owns the turn budget and ends the episode after ``B`` turns.

Timeouts: calls run in the calling thread, so a call that never returns is stopped by
:class:`~envs.protocol.PythonTextEnv`'s step timeout (the row ends with ``info["timeout"]``).
Its thread cannot be killed and finishes on its own; a single C-level operation that holds
the GIL (say, a huge integer power in ``MathAPI.power``) delays the timeout until it returns.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any, Sequence

from envs.bfcl import calls as calls_lib
from envs.bfcl import data
from envs.protocol import Feedback, PythonEnv, text_key

_CHECKER_MODULE = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker"
# BFCL's user message of a miss-func turn, after the added functions.
ADDED_FUNCTIONS_MESSAGE = "I have updated some more functions you can choose from. What about now?"
CALL_FORMAT = (
    "To call functions, answer with only a Python list of calls with literal "
    "arguments, e.g. [cd(folder='documents'), ls(a=True)]. To finish the current "
    "request, answer without a function call."
)

INSTRUCTIONS = f"""You are an expert in composing functions. A user makes several requests, one \
after another; you fulfil each one by calling the functions you are given (listed as JSON in \
the first message, and more may be added later). The functions act on a persistent state that \
carries over from one request to the next.

{CALL_FORMAT} The calls run in order and you see the result of each. Keep calling functions \
until the current request is fulfilled, then answer without a call (an empty answer or a \
short message to the user) to receive the next request. Each of your answers, with calls or \
without, is one turn, and the turns of all the requests count together. If no function fits \
the request or it lacks a parameter a function requires, say so without calling a function."""


@dataclasses.dataclass(frozen=True)
class BfclConfig:
    """Which tasks, and how results are shown.

    Attributes:
      categories: BFCL multi-turn categories to serve (:data:`envs.bfcl.data.CATEGORIES`).
      data_dir: a folder laid out like the package's ``data``; None: the installed package's.
      max_result_chars: the most characters of one call's result shown to the agent (the rest
        is cut, saying so); None shows all. The checks always use the full result.
    """

    categories: tuple[str, ...] = ("multi_turn_base",)
    data_dir: str | None = None
    max_result_chars: int | None = 4000

    def __post_init__(self):
        if isinstance(self.categories, str) or not self.categories:
            raise ValueError(
                f"BfclConfig.categories must be a non-empty tuple of names, got {self.categories!r}"
            )
        for category in self.categories:
            if category not in data.CATEGORIES:
                raise ValueError(
                    f"BfclConfig.categories: unknown category {category!r}; "
                    f"expected some of {data.CATEGORIES}"
                )
        if self.max_result_chars is not None and self.max_result_chars < 1:
            raise ValueError(
                f"BfclConfig.max_result_chars must be >= 1 or None, got {self.max_result_chars}"
            )


@dataclasses.dataclass
class Episode:
    """One row's state. Mutable: the API instances change in place as calls run.

    Attributes:
      task_id: index of the task in the environment.
      agent: the API instances the agent's calls act on.
      truth: instances replaying the annotated calls, one request behind until it ends.
      turn: index of the current user request.
      calling_steps: responses with calls in the current request.
      results: every result of the agent's calls so far (the response check's haystack).
      key: anchor key of the current state (cached: the state can be large).
    """

    task_id: int
    agent: calls_lib.ApiSet
    truth: calls_lib.ApiSet
    turn: int = 0
    calling_steps: int = 0
    results: list[str] = dataclasses.field(default_factory=list)
    key: int = 0


class BfclEnv(PythonEnv):
    """BFCL v3 multi-turn tasks; wrap with :class:`~envs.protocol.PythonTextEnv`.

    ``tasks``, if given, are served instead of loading ``config.categories``; task ids index
    :attr:`tasks` (categories in the order configured, each in its file's order).
    """

    name = "bfcl"
    t_max = 24
    # The observation budget (envs.protocol.observation_budget): the first message lists every
    # function as JSON, up to 28,815 characters in bfcl-eval's four multi-turn categories, so
    # the default (16,000) would cut it; 40,000 characters fit its 16,384-token context.
    max_observation_chars = 40_000

    def __init__(
        self, config: BfclConfig | None = None, *, tasks: Sequence[data.BfclTask] | None = None
    ):
        self.config = config if config is not None else BfclConfig()
        self.tasks = (
            list(tasks)
            if tasks is not None
            else data.load_tasks(self.config.categories, self.config.data_dir)
        )
        if not self.tasks:
            raise ValueError("BfclEnv: no tasks")
        self._truth_calls = [_parse_ground_truth(task) for task in self.tasks]
        self._state_checker, self._response_checker = official_checkers()

    def instructions(self) -> str:
        return INSTRUCTIONS

    def num_tasks(self) -> int:
        return len(self.tasks)

    def reset_task(self, task_id: int, seed: int) -> tuple[Episode, str]:
        del seed  # BFCL's APIs seed their own randomness from the scenario
        task = self.tasks[task_id]
        episode = Episode(task_id=task_id, agent=_api_set(task), truth=_api_set(task))
        episode.key = self._key(episode)
        return episode, self._request_text(task, 0)

    def step_task(self, episode: Episode, response: str) -> tuple[Episode, Feedback]:
        action = calls_lib.parse_response(response)
        if isinstance(action, calls_lib.Malformed):
            return episode, Feedback(
                f"Invalid function call: {action.reason}. {CALL_FORMAT}", action_valid=False
            )
        if isinstance(action, calls_lib.Calls):
            results = episode.agent.run(action.calls)
            episode.results.extend(results)
            episode.calling_steps += 1
            episode.key = self._key(episode)
            return episode, Feedback(self._results_text(action.calls, results))
        return episode, self._end_request(episode)

    def state_key(self, episode: Episode) -> int:
        return episode.key

    def _end_request(self, episode: Episode) -> Feedback:
        task, turn = self.tasks[episode.task_id], episode.turn
        truth_calls = self._truth_calls[episode.task_id][turn]
        truth_results = episode.truth.run(truth_calls)
        failure = self._check_request(episode, truth_calls, truth_results)
        if failure is not None:
            return Feedback(f"Request {turn + 1} was not fulfilled: {failure}", done=True)
        episode.turn, episode.calling_steps = turn + 1, 0
        episode.key = self._key(episode)
        if episode.turn == len(task.turns):
            return Feedback("All requests are fulfilled.", reward=1.0, done=True, success=True)
        return Feedback(self._request_text(task, episode.turn))

    def _check_request(self, episode: Episode, truth_calls, truth_results) -> str | None:
        """Why the request just ended fails the official turn check; None if it passes."""
        if not truth_calls:
            return None
        if episode.calling_steps == 0:
            return "no function was called"
        state = self._state_checker(episode.agent.instances, episode.truth.instances)
        if not state["valid"]:
            differing = ", ".join(sorted(state["details"]["differences"]))
            return f"{state['error_message']} Differing attributes: {differing}."
        response = self._response_checker(episode.results, truth_results, episode.turn)
        if not response["valid"]:
            return response["error_message"]
        return None

    def _request_text(self, task: data.BfclTask, turn: int) -> str:
        parts = []
        if turn == 0:
            parts.append(_functions_text("Functions you can call", task.functions))
        if turn in task.added_functions:
            parts.append(_functions_text("New functions you can call", task.added_functions[turn]))
        messages = task.turns[turn] or (data.Message("user", ADDED_FUNCTIONS_MESSAGE),)
        parts.append("\n".join(f"{m.role.capitalize()}: {m.content}" for m in messages))
        return "\n\n".join(parts)

    def _results_text(self, calls: Sequence[calls_lib.Call], results: Sequence[str]) -> str:
        limit = self.config.max_result_chars
        lines = []
        for call, result in zip(calls, results):
            if limit is not None and len(result) > limit:
                result = f"{result[:limit]}... [{len(result) - limit} more characters not shown]"
            lines.append(f"{call.text} -> {result}")
        return "Results:\n" + "\n".join(lines)

    @staticmethod
    def _key(episode: Episode) -> int:
        # The state the outcome depends on: the request, the APIs' public state, and the
        # results so far (a later request's response check may be met by an earlier result).
        return text_key(
            episode.task_id, episode.turn, episode.agent.state_text(), sorted(episode.results)
        )


def reference_responses(task: data.BfclTask) -> list[str]:
    """The annotated trajectory as responses in this environment's grammar: per request, its
    annotated calls as one call list (if any), then an empty response ending the request.
    Its length is :attr:`~envs.bfcl.data.BfclTask.min_turns`."""
    responses = []
    for truth_calls in task.ground_truth:
        if truth_calls:
            responses.append("[" + ", ".join(truth_calls) + "]")
        responses.append("")
    return responses


def official_checkers():
    """The package's ``(state_checker, response_checker)``."""
    try:
        module = importlib.import_module(_CHECKER_MODULE)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"{error}: {data.INSTALL_HINT}") from error
    return module.state_checker, module.response_checker


def _api_set(task: data.BfclTask) -> calls_lib.ApiSet:
    return calls_lib.ApiSet(task.involved_classes, task.initial_config, task.long_context)


def _parse_ground_truth(task: data.BfclTask) -> list[tuple[calls_lib.Call, ...]]:
    try:
        return [tuple(calls_lib.parse_call(text) for text in turn) for turn in task.ground_truth]
    except ValueError as error:
        raise ValueError(f"{task.id}: ground truth {error}") from None


def _functions_text(title: str, docs: Sequence[Any]) -> str:
    return f"{title} (one JSON object per line):\n" + "\n".join(json.dumps(doc) for doc in docs)
