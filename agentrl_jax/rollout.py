"""Multi-turn rollouts with a visible turn budget (paper §1, §5, §6).

A rollout plays ``G`` trajectories of each task of a batch against a text environment
(:class:`envs.protocol.TextEnv`) with a policy (:class:`agentrl_jax.policy.Policy`) and
returns a :class:`~agentrl_jax.trajectory.Trajectory`::

    runner = MultiTurnRollout(env, tokenizer, RolloutConfig(group_size=16, budget=20))
    result = runner(SamplerPolicy(model), task_ids, key)   # RolloutResult
    result.trajectory                                       # Trajectory, N = len(task_ids) * G
    train_rollout = runner.for_training(SamplerPolicy(model))  # (params, key, tasks) -> Trajectory

Layout: row ``n`` plays task ``task_ids[n // G]`` in task group ``n // G``; the ``G`` rows of a
group share one budget ``B``: the config's fixed ``budget``, the caller's ``budgets[k]``, or a
BudgetMix draw from ``budget_set(env.t_max)`` (paper §5).

The loop, one iteration per turn ``t = 0, 1, ...``:

1. every live row samples a response at once (one batched decode on the continuing KV cache);
2. responses are decoded and played in the environment (one batched step; the environment
   parses them, an unparsable one is an invalid action);
3. a row ends on success or failure (``done``), after ``B`` turns, on an invalid action if
   ``end_on_invalid``, or when its context is full (flagged ``overflow``);
4. rows that go on get the tokens that close their response (the end-of-turn token, when the
   response was cut at ``max_response_tokens``) and the next user message, the budget-aware
   turn text (``[MAX TURNS] B [CURRENT TURN] t+1 [REMAINING TURNS] B-t-1`` and the observation).

The conversation is kept as tokens, never re-rendered, so training sees exactly what was
sampled (Qwen3's template would drop earlier ``<think>`` blocks). ``Trajectory.tokens`` are
tokenizer ids (a :class:`~agentrl_jax.policy.TokenMap` policy maps them to its model's ids).

Context overflow is never silent: a response is capped at the room left in the context
(``max_context`` tokens of KV cache, ``record_tokens`` of record); a response cut by that cap
(below ``max_response_tokens``, with no stop token) is not played: its turn is recorded with no
valid action and the row ends with ``overflow``; a row whose next user message does not fit
ends after its last played turn, also with ``overflow``. A prompt that does not fit at all
gives a row with no turns and ``overflow``.

History window: with ``history_window = k`` the policy sees the system header and only the
last ``k`` turns (plus the current user message). Once the window slides (``t > k``), every
turn rebuilds each live row's context from the recorded tokens of the kept turns and
*re-prefills* it into a fresh cache (the cached keys of a window cannot be reused: positions
and attention change when the oldest turn leaves). That costs a prefill of about
``prefix + k * (turn tokens)`` per row per turn, against only the new chunk with the whole
history kept, which is why the window is off by default. The record still holds the whole
conversation; ``context_start`` says where each turn's context began.

Budgets (§6): the system prompt states ``B``; turn ``t``'s user message states ``B``, ``t``
(turns completed) and ``B - t``. A row that has not succeeded after ``B`` turns gets reward 0
(``success`` False). Per-turn rewards are the environment's, plus ``invalid_penalty`` on an
invalid action.

Throughput: the model work is batched over live rows every turn and the environment steps the
whole batch in one call (one per lane with ``lanes``); the policy drops finished rows from its cache
once at most half are live (see :class:`~agentrl_jax.policy.SamplerPolicy`). Shapes are fixed by the
config, so no turn recompiles. The loop itself is host Python: templating, tokenizing and decoding
are per row and cached where texts repeat.

Memory (``max_rows_per_call``): a policy's KV cache holds all its rows for the whole
conversation, so a large batch (the paper's 32 tasks x 16) can need more memory than a device
has. With ``max_rows_per_call = R`` the batch is played in parts of whole task groups of at
most ``R`` rows (as even as possible, :func:`row_parts`), one part after another, each from
``policy.start`` to its last turn; one environment state holds every row (reset once, rows
outside the playing part are not live, so it leaves them untouched) and one record collects
them, so the result is one Trajectory of the whole batch.

Continuous batching (``refill``): the policy holds ``max_rows_per_call`` seats and rows wait in
one queue; every loop iteration plays one turn of every seated row, each at its own turn, and
a row whose episode ended gives its seat to the next waiting row at once (its first prompt
prefilled into that seat alone, :meth:`~agentrl_jax.policy.SamplerPolicy.restart`). Parts are
the same loop with a queue per part, seated only when every seat is empty. A task group's rows
are seated together in order, and the Trajectory comes out whole at the end, so GRPO/GiGPO
groups are never split.

Lanes (``lanes = n``): the seats are split into ``n`` lanes, each a cache of its own (the
policy and its ``fork()``s; whole task groups of seats where the seats allow, so a group's
first prompt is still prefilled once). Each lane seats rows by the rules above on its own
seats, so with parts a lane whose seats are empty starts on the next part while another still
plays the last one, and preemption's "one row alone" applies per lane. The loop visits the
lanes in turn; a lane's environment step is
handed to one background thread (steps run one at a time, in order, each from the state the
one before left) and the next lane samples meanwhile; the lane takes the answer on its next
visit. So an environment whose steps take real time (a Python environment's queries, test runs
or sandboxes, off the device that decodes) costs at most what decoding does not already
hide. Each lane's calls hold fewer rows (smaller decode batches, maybe more compiled
shapes), so a jitted environment like FrozenLake's gains nothing from it; and on an
accelerator in bfloat16 a smaller batch can round differently, so lanes give the one-lane
tokens only up to the float rounding discussed below.

Randomness: budgets, the environment's seed and the policy's key come from ``key``; the
policy gets one key per row per turn, ``fold_in(fold_in(key_policy, turn), row)``
(:func:`row_keys`), and the environment keys its rows by their index in the whole batch. So a
row's conversation does not depend on which rows share its call: splitting a batch into parts,
continuous batching, lanes (or a policy compacting its cache) give every row the same tokens
for the same ``key`` (up to
the float rounding of differently sized batches, which could only flip a draw that lands
exactly on a boundary; the log-probs agree to ~1e-6).

Several processes (``split_processes``) are one more such split: every process resets every
row but plays only its share (:func:`~agentrl_jax.distributed.row_shares`) on its own
devices, then the rows are gathered,
so each returns the whole result. Every process must make the same calls; the stats' seconds
are this process's own.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import dataclasses
import functools
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax import distributed
from agentrl_jax.algorithms.budgetmix import sample_budgets
from agentrl_jax.policy import Policy, PolicySettings, Responses, SamplerPolicy
from agentrl_jax.prompts import BudgetPrompt, ChatTokens
from agentrl_jax.sampling import SamplingConfig
from agentrl_jax.trajectory import Trajectory
from envs.protocol import TextEnv, TurnResult


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are played (validated on construction).

    group_size: ``G`` trajectories per task (paper §4: 16).
    budget: the turn budget ``B`` of every group; None draws one per group with BudgetMix.
    max_response_tokens: the most tokens of one response.
    max_context: tokens of context (KV cache slots) per row.
    record_tokens: ``L``, tokens of the record per row; default ``max_context`` (raise it with a
      history window, whose whole conversation can be longer than any one context).
    history_window: None keeps every past turn in context; ``k`` keeps the last ``k``.
    end_on_invalid: an invalid action ends the row (else it is a no-op and the row goes on).
    invalid_penalty: reward (<= 0) added to a turn whose action is invalid.
    sampling: the sampler's distribution (paper §4: temperature 1 for training rollouts).
    max_rows_per_call: the most rows one policy holds at once (a multiple of ``group_size``);
      a larger batch is played in parts of whole groups, one after another (see the module
      docstring); None plays every row at once.
    adaptive_budgets: with ``budget=None``, BudgetMix draws only budgets each task can meet: none
      below its structural bound (the environment's ``structural_bounds(task_ids)``, e.g.
      FrozenLake's shortest path), ``T_max`` where none is left
      (:func:`~agentrl_jax.algorithms.budgetmix.sample_budgets`).
    refill: with ``max_rows_per_call``, continuous batching instead of parts: the policy holds
      ``max_rows_per_call`` seats, and a seat whose row's episode ended takes the next row
      waiting (its first prompt prefilled at once, :meth:`Policy.restart` where the policy has
      it), so rows at different turns sample together and no seat idles while rows wait.
    enable_thinking: Qwen3's thinking switch in the chat template.
    prompt: the budget-aware wording (§6).
    lanes: the seats split into this many lanes, each a cache of its own (the policy and its
      ``fork()``s); while one lane's environment step runs (on a thread of its own), the next
      lane samples, so slow environment steps (Python environments: queries, tests, sandboxes)
      overlap decoding. Each lane's calls hold fewer rows, so it pays where steps are slow
      against sampling, not for FrozenLake's jitted step. A paged cache's ``num_pages`` is
      per lane. Trajectories are the same as with one lane.
    split_processes: with several processes (:mod:`agentrl_jax.distributed`), each plays its
      share of the rows on its own devices and gathers the others' (every process makes the
      same call); nothing changes for one process.
    """

    group_size: int = 16
    budget: int | None = None
    max_response_tokens: int = 256
    max_context: int = 4096
    record_tokens: int | None = None
    history_window: int | None = None
    end_on_invalid: bool = False
    invalid_penalty: float = 0.0
    sampling: SamplingConfig = SamplingConfig()
    enable_thinking: bool = False
    prompt: BudgetPrompt = BudgetPrompt()
    max_rows_per_call: int | None = None
    refill: bool = False
    adaptive_budgets: bool = False
    lanes: int = 1
    split_processes: bool = False

    def __post_init__(self):
        def positive(name: str, optional: bool = False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"RolloutConfig.{name} must be an int >= 1"
                    f"{' or None' if optional else ''}, got {value!r}"
                )

        for name in ("group_size", "max_response_tokens", "max_context"):
            positive(name)
        positive("lanes")
        for name in ("budget", "record_tokens", "history_window", "max_rows_per_call"):
            positive(name, optional=True)
        if self.max_rows_per_call is not None and self.max_rows_per_call % self.group_size:
            raise ValueError(
                f"RolloutConfig.max_rows_per_call must be a multiple of group_size "
                f"({self.group_size}), so groups stay whole, got "
                f"{self.max_rows_per_call}"
            )
        if self.record_tokens is not None and self.record_tokens < self.max_context:
            raise ValueError(
                f"RolloutConfig.record_tokens ({self.record_tokens}) must be >= "
                f"max_context ({self.max_context})"
            )
        for name in (
            "end_on_invalid",
            "enable_thinking",
            "refill",
            "adaptive_budgets",
            "split_processes",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"RolloutConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        penalty = self.invalid_penalty
        if (
            isinstance(penalty, bool)
            or not isinstance(penalty, (int, float))
            or not math.isfinite(penalty)
            or penalty > 0
        ):
            raise ValueError(
                f"RolloutConfig.invalid_penalty must be a finite number <= 0, got {penalty!r}"
            )
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(
                f"RolloutConfig.sampling must be a SamplingConfig, got {self.sampling!r}"
            )
        if not isinstance(self.prompt, BudgetPrompt):
            raise ValueError(f"RolloutConfig.prompt must be a BudgetPrompt, got {self.prompt!r}")

    @property
    def record_length(self) -> int:
        return self.record_tokens or self.max_context


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Where a rollout's time went, and how much it did."""

    turns: int  # loop iterations (the longest row's turns)
    live_rows: tuple[int, ...]  # rows that sampled at each turn
    sampled_tokens: int
    policy_s: float  # prefill, decode, cache compaction (blocking)
    env_s: float  # reset, and waiting for steps (parsing included)
    host_s: float  # the rest: templates, tokenizing, decoding, bookkeeping
    total_s: float
    env_step_s: float = 0.0  # steps, wherever they ran: with lanes, more than the
    #                                part of env_s they add (the rest overlapped sampling)

    @property
    def turns_played(self) -> int:
        return int(sum(self.live_rows))


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    trajectory: Trajectory
    responses: list[list[str]]  # [row][turn] decoded response texts (special tokens dropped)
    env_seed: int  # the seed passed to env.reset (replays the dynamics)
    stats: RolloutStats


def _host(x: Any) -> np.ndarray:
    """``x`` as a NumPy array in the dtype jax would give it (int64 as int32 without x64)."""
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def row_parts(groups: int, group_size: int, max_rows: int | None) -> list[np.ndarray]:
    """The rows (global indices) of each policy call: whole task groups, contiguous, in as
    even parts as possible of at most ``max_rows`` rows each (None: one part, every row)."""
    rows = np.arange(groups * group_size)
    if max_rows is None or groups * group_size <= max_rows:
        return [rows]
    count = -(-groups // (max_rows // group_size))
    return [
        rows[g[0] * group_size : (g[-1] + 1) * group_size]
        for g in np.array_split(np.arange(groups), count)
    ]


def lane_seats(seats: int, group_size: int, lanes: int) -> list[int]:
    """The seats of each of ``lanes`` lanes (``lanes <= seats``), as even as they can be: in
    whole task groups when there are at least as many groups as lanes (so a group seated at
    once shares one prefill of its prompt), else seat by seat."""
    groups = seats // group_size
    if seats % group_size == 0 and groups >= lanes:
        return [len(share) * group_size for share in np.array_split(np.arange(groups), lanes)]
    return [len(share) for share in np.array_split(np.arange(seats), lanes)]


@jax.jit
def row_keys(key: jax.Array, turn: Any, rows: Any) -> jax.Array:
    """The sampling keys of ``rows`` (global row indices ``int[R]``) at ``turn`` (one turn, or
    each row's own ``int[R]``): ``fold_in(fold_in(key, turn), row)``, a function of the row
    and its turn only, not of the part or the seat."""
    turns = jnp.broadcast_to(jnp.asarray(turn, jnp.int32), jnp.shape(rows))
    return jax.vmap(lambda t, row: jax.random.fold_in(jax.random.fold_in(key, t), row))(
        turns, jnp.asarray(rows, jnp.int32)
    )


class _Seats:
    """The policy's rows ("seats") and the rollout rows sitting in them: the policy is called
    with its seats only; responses come back as the rollout's ``n`` rows (empty for rows not
    seated). A row keeps its seat from its first prompt to its last turn."""

    def __init__(self, policy: Policy, seats: int, n: int, settings: PolicySettings):
        self.policy, self.n, self.settings = policy, n, settings
        self.row = np.full(seats, -1, np.int64)  # the row in each seat, -1: empty

    def seat(self, rows: np.ndarray, contexts: Callable[[int], Sequence[int]], fresh: bool) -> None:
        """Seat ``rows`` in empty seats and prefill their ``contexts(row)`` (each row's context
        so far): a fresh ``start`` of every seat (``fresh``, or a policy without ``restart``:
        the rows already seated start again from theirs), else ``restart`` of the new seats
        only."""
        empty = np.flatnonzero(self.row < 0)[: len(rows)]
        self.row[empty] = rows
        restart = getattr(self.policy, "restart", None)
        if fresh or restart is None:
            self.policy.start([() if r < 0 else contexts(r) for r in self.row], self.settings)
        else:
            which = np.zeros(len(self.row), bool)
            which[empty] = True
            restart([contexts(r) if w else () for r, w in zip(self.row, which)], which)

    def restart(self, rows: np.ndarray, contexts: Callable[[int], Sequence[int]]) -> bool:
        """Prefill seated ``rows`` afresh from ``contexts(row)`` (a sliding history window).
        A policy without ``restart`` gets a ``start`` of every seat instead (``contexts`` must
        then give every seated row's whole context); returns whether that happened."""
        restart = getattr(self.policy, "restart", None)
        if restart is None:
            self.policy.start([contexts(r) if r >= 0 else () for r in self.row], self.settings)
            return True
        which = np.isin(self.row, rows) & (self.row >= 0)
        restart([contexts(r) if w else () for r, w in zip(self.row, which)], which)
        return False

    def vacate(self, rows: np.ndarray) -> None:
        self.row[np.isin(self.row, rows)] = -1

    def holds(self) -> np.ndarray:
        """``bool[n]``: the rows seated here."""
        seated = np.zeros(self.n, bool)
        seated[self.row[self.row >= 0]] = True
        return seated

    def extend(self, chunks: Sequence[Sequence[int]]) -> None:
        self.policy.extend([chunks[r] if r >= 0 else () for r in self.row])

    def respond(self, live: np.ndarray, max_tokens: np.ndarray, keys: jax.Array) -> Responses:
        """``live``, ``max_tokens``: ``[n]``; ``keys``: one per seat."""
        seated = self.row >= 0
        row = np.where(seated, self.row, 0)
        out = self.policy.respond(seated & live[row], np.where(seated, max_tokens[row], 0), keys)
        full = Responses(
            np.zeros((self.n,) + out.tokens.shape[1:], out.tokens.dtype),
            np.zeros(self.n, out.lengths.dtype),
            np.zeros((self.n,) + out.logprobs.shape[1:], out.logprobs.dtype),
            np.zeros((self.n,) + out.logprobs.shape[1:], out.logprobs.dtype),
        )
        rows = self.row[seated]
        full.tokens[rows], full.lengths[rows] = out.tokens[seated], out.lengths[seated]
        full.logprobs[rows] = out.logprobs[seated]
        full.sampling_logprobs[rows] = out.behaviour_logprobs[seated]
        if out.preempted is None:
            return full
        preempted = np.zeros(self.n, bool)
        preempted[rows] = np.asarray(out.preempted, bool)[seated]
        return dataclasses.replace(full, preempted=preempted)


@dataclasses.dataclass
class _Play:
    """What the parts of one rollout share: the record and the per-row outcome so far."""

    rec: "_Record"
    budget: np.ndarray
    context_len: np.ndarray
    overflow: np.ndarray
    success: np.ndarray
    turns_used: np.ndarray
    texts: list[list[str]]
    live_rows: list[int] = dataclasses.field(default_factory=list)  # per turn, over all parts
    sampled: int = 0

    def count_live(self, turns: np.ndarray) -> None:
        """Count rows sampling at their turns ``turns`` (one entry per live row)."""
        counts = np.bincount(turns, minlength=len(self.live_rows))
        self.live_rows.extend([0] * (len(counts) - len(self.live_rows)))
        for turn in np.flatnonzero(counts):
            self.live_rows[turn] += int(counts[turn])


def _gather_rows(play: _Play, shares: list[np.ndarray]) -> None:
    """Fill ``play`` with the rows the other processes played (``shares[p]``: process ``p``'s
    rows), so every process holds the whole rollout; live-row and token counts add up."""
    rec, own = play.rec, shares[jax.process_index()]
    arrays = {f"rec.{name}": value[own] for name, value in vars(rec).items()}
    arrays.update(
        success=play.success[own],
        turns_used=play.turns_used[own],
        overflow=play.overflow[own],
        live_rows=np.asarray(play.live_rows, np.int64),
        sampled=np.asarray([play.sampled], np.int64),
    )
    live_rows = np.zeros(0, np.int64)
    play.sampled = 0
    gathered = distributed.allgather_blobs(arrays, [play.texts[r] for r in own])
    for rows, (theirs, texts) in zip(shares, gathered):
        for name, value in vars(rec).items():
            value[rows] = theirs[f"rec.{name}"]
        for name in ("success", "turns_used", "overflow"):
            getattr(play, name)[rows] = theirs[name]
        for row, text in zip(rows, texts):
            play.texts[row] = list(text)
        counts = theirs["live_rows"]
        live_rows = np.pad(live_rows, (0, max(0, len(counts) - len(live_rows))))
        live_rows[: len(counts)] += counts
        play.sampled += int(theirs["sampled"][0])
    play.live_rows = live_rows.tolist()


class _Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {"policy": 0.0, "env": 0.0}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class _Turn:
    """One lane's turn between its responses and the environment's answer (``[n]`` arrays:
    rows that sampled, rows whose response is played, rows whose response was cut)."""

    out: Responses
    live: np.ndarray
    playing: np.ndarray
    cut: np.ndarray
    step: futures.Future  # -> TurnResult


class _EnvSteps:
    """The environment's steps in the order they are submitted, each from the state the one
    before left: at once, or (``background``) on one thread of their own, so that a lane's
    step runs while the other lanes sample. ``busy``: seconds spent stepping."""

    def __init__(self, env: TextEnv, state: Any, background: bool):
        self.env, self.state, self.busy = env, state, 0.0
        self._thread = (
            futures.ThreadPoolExecutor(1, thread_name_prefix="env-steps") if background else None
        )

    def _step(self, replies: list[str], playing: np.ndarray) -> TurnResult:
        begin = time.perf_counter()
        self.state, result = self.env.step(self.state, replies, playing)
        self.busy += time.perf_counter() - begin
        return result

    def submit(self, replies: list[str], playing: np.ndarray) -> futures.Future:
        if self._thread is not None:
            return self._thread.submit(self._step, replies, playing)
        done: futures.Future = futures.Future()
        done.set_result(self._step(replies, playing))
        return done

    def __enter__(self) -> "_EnvSteps":
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:  # a step in flight finishes first (it owns the state)
            self._thread.shutdown(wait=True, cancel_futures=True)


class _Record:
    """Host buffers of the Trajectory under construction, with a write position per row."""

    def __init__(self, rows: int, length: int, turns: int):
        self.tokens = np.zeros((rows, length), np.int32)
        self.loss_mask = np.zeros((rows, length), bool)
        self.token_turn = np.full((rows, length), -1, np.int32)
        self.logprobs = np.zeros((rows, length), np.float32)
        self.sampling_logprobs = np.zeros((rows, length), np.float32)
        self.length = np.zeros(rows, np.int64)
        self.turn_mask = np.zeros((rows, turns), bool)
        self.action = np.full((rows, turns), -1, np.int32)
        self.action_valid = np.zeros((rows, turns), bool)
        self.reward = np.zeros((rows, turns), np.float32)
        self.anchor_key = np.zeros((rows, turns), np.int32)
        self.state_id = np.full((rows, turns), -1, np.int32)  # -1: no turn, or no id
        self.step_quality = np.full((rows, turns), np.nan, np.float32)
        self.context_start = np.zeros((rows, turns), np.int32)
        # where turn t's user message starts (the next-prompt form, separator included)
        self.turn_start = np.zeros((rows, turns + 1), np.int64)
        self.prefix_len = np.zeros(rows, np.int32)

    def write(self, row: int, ids: Sequence[int]) -> None:
        start = self.length[row]
        self.tokens[row, start : start + len(ids)] = ids
        self.length[row] += len(ids)

    def write_responses(self, out: Responses, turn: np.ndarray) -> None:
        """Every row's response (empty for rows that did not sample) at its write position;
        ``turn [rows]``: each row's turn."""
        width = out.tokens.shape[1]
        rows, offsets = np.nonzero(np.arange(width)[None, :] < out.lengths[:, None])
        slots = self.length[rows] + offsets
        self.tokens[rows, slots] = out.tokens[rows, offsets]
        self.loss_mask[rows, slots] = True
        self.token_turn[rows, slots] = turn[rows]
        self.logprobs[rows, slots] = out.logprobs[rows, offsets]
        self.sampling_logprobs[rows, slots] = out.behaviour_logprobs[rows, offsets]
        self.length += out.lengths

    def context(self, row: int, turn: int, window: int) -> list[int]:
        """The tokens row ``row`` sees at ``turn`` with a window: header + kept turns."""
        start = self.turn_start[row, max(0, turn - window)]
        return (
            self.tokens[row, : self.prefix_len[row]].tolist()
            + self.tokens[row, start : self.length[row]].tolist()
        )


class MultiTurnRollout:
    """Plays policies on one environment (see the module docstring); reusable across calls."""

    def __init__(self, env: TextEnv, tokenizer, config: RolloutConfig = RolloutConfig()):
        if config.budget is not None and config.budget > env.t_max:
            raise ValueError(
                f"RolloutConfig.budget={config.budget} exceeds the environment's t_max={env.t_max}"
            )
        if config.adaptive_budgets and not callable(getattr(env, "structural_bounds", None)):
            raise ValueError(
                f"RolloutConfig.adaptive_budgets needs an environment with "
                f"structural_bounds(task_ids); {type(env).__name__} has none"
            )
        self.env, self.tokenizer, self.config = env, tokenizer, config
        self.chat = ChatTokens(tokenizer, enable_thinking=config.enable_thinking)
        self.instructions = env.instructions()
        # T of the record: room for every budget this configuration can draw.
        self.num_turns = config.budget if config.budget is not None else env.t_max
        self.settings = PolicySettings(
            max_context=config.max_context,
            max_response_tokens=config.max_response_tokens,
            stop_token_ids=self.chat.stop_token_ids,
            sampling=config.sampling,
        )
        self._stop_ids = np.asarray(self.chat.stop_token_ids, np.int64)
        # Bounded caches: FrozenLake revisits few texts; long unique texts (SQL results) just miss.
        self._next_prompt = functools.lru_cache(maxsize=1 << 13)(self._next_prompt_uncached)
        self._first_prompt = functools.lru_cache(maxsize=1 << 10)(self._first_prompt_uncached)

    # -- templates (cached: many rows share a state early on)
    def _next_prompt_uncached(self, user: str) -> tuple[int, ...]:
        return tuple(self.chat.next_prompt(user))

    def _first_prompt_uncached(self, budget: int, observation: str) -> tuple[tuple[int, ...], int]:
        """``(tokens, prefix_len)``; ``prefix_len`` 0 when the header cannot be split off."""
        prompt = self.config.prompt
        user = prompt.turn_text(observation, budget, 0)
        ids = tuple(self.chat.first_prompt(prompt.system_text(self.instructions, budget), user))
        tail = self._next_prompt(user)
        if ids[len(ids) - len(tail) :] == tail:
            return ids, len(ids) - len(tail)
        if self.config.history_window is not None:
            raise ValueError(
                "history_window needs a chat template whose first prompt is the "
                "system header followed by an ordinary user turn; this one is not"
            )
        return ids, 0

    # -- budgets and tasks
    def _tasks(self, task_ids: Any) -> np.ndarray:
        tasks = np.asarray(task_ids)
        if (
            tasks.ndim != 1
            or tasks.size == 0
            or not np.issubdtype(tasks.dtype, np.integer)
            or tasks.min() < 0
            or tasks.max() >= self.env.num_tasks()
        ):
            raise ValueError(
                f"task_ids must be a non-empty 1-D int array in [0, "
                f"{self.env.num_tasks()}), got {task_ids!r}"
            )
        return tasks.astype(np.int64)

    def _group_budgets(self, key: jax.Array, tasks: np.ndarray, budgets: Any) -> np.ndarray:
        groups = len(tasks)
        if budgets is not None:
            out = np.asarray(budgets)
            if out.shape != (groups,) or not np.issubdtype(out.dtype, np.integer):
                raise ValueError(f"budgets must be {groups} ints (one per task), got {budgets!r}")
        elif self.config.budget is not None:
            out = np.full(groups, self.config.budget)
        else:
            bound = self.env.structural_bounds(tasks) if self.config.adaptive_budgets else None
            out = np.asarray(
                sample_budgets(key, jnp.full((groups,), self.env.t_max), bound).budgets
            )
        if out.min() < 1 or out.max() > self.num_turns:
            raise ValueError(f"budgets must be in [1, {self.num_turns}], got {out}")
        return out.astype(np.int64)

    # -- the rollout
    def __call__(
        self, policy: Policy, task_ids: Any, key: jax.Array, budgets: Any = None
    ) -> RolloutResult:
        """Play ``G`` trajectories of each of ``task_ids`` (``int[K]``).

        ``budgets``: ``int[K]`` budgets per task group, overriding the config's ``budget`` and
        BudgetMix (e.g. an evaluation sweep). ``key`` draws budgets, dynamics and samples.
        """
        began = time.perf_counter()
        cfg, timer = self.config, _Timer()
        tasks = self._tasks(task_ids)
        groups, size = len(tasks), cfg.group_size
        rows = groups * size
        row_task = np.repeat(tasks, size)
        group = np.repeat(np.arange(groups), size)
        key_budget, key_env, key_policy = jax.random.split(key, 3)
        budget = self._group_budgets(key_budget, tasks, budgets)[group]
        env_seed = int(jax.random.randint(key_env, (), 0, np.iinfo(np.int32).max))
        with timer("env"):
            env_state, observations = self.env.reset(row_task, env_seed)

        length = cfg.record_length
        rec = _Record(rows, length, self.num_turns)
        first = [self._first_prompt(int(b), o) for b, o in zip(budget, observations)]
        context_len = np.array([len(ids) for ids, _ in first], np.int64)
        fits = context_len <= min(cfg.max_context, length)
        for r in np.flatnonzero(fits):
            rec.write(r, first[r][0])
            rec.prefix_len[r] = rec.turn_start[r, 0] = first[r][1]
        play = _Play(
            rec,
            budget,
            context_len,
            overflow=~fits,
            success=np.zeros(rows, bool),
            turns_used=np.zeros(rows, np.int32),
            texts=[[] for _ in range(rows)],
        )
        # several processes splitting the rows: this one plays its share only
        shares = distributed.row_shares(rows) if cfg.split_processes else None
        mine = np.ones(rows, bool)
        if shares is not None:
            mine[:] = False
            mine[shares[jax.process_index()]] = True
        parts = row_parts(groups, size, cfg.max_rows_per_call)
        lanes = self._lanes(policy, max(1, max(int(mine[p].sum()) for p in parts)), rows)
        queues = [part[fits[part] & mine[part]] for part in parts]
        if cfg.refill:  # one queue of every row, seats as many as the largest part
            queues = [np.concatenate(queues)]
        with _EnvSteps(self.env, env_state, background=len(lanes) > 1) as env:
            self._play(lanes, play, queues, env, key_policy, timer)
        if shares is not None:
            _gather_rows(play, shares)
        total = time.perf_counter() - began
        stats = RolloutStats(
            turns=len(play.live_rows),
            live_rows=tuple(play.live_rows),
            sampled_tokens=play.sampled,
            policy_s=timer.seconds["policy"],
            env_s=timer.seconds["env"],
            host_s=total - timer.seconds["policy"] - timer.seconds["env"],
            total_s=total,
            env_step_s=env.busy,
        )
        trajectory = self._trajectory(
            rec, group, row_task, budget, play.turns_used, play.success, play.overflow
        )
        return RolloutResult(trajectory, play.texts, env_seed, stats)

    def _lanes(self, policy: Policy, seats: int, rows: int) -> list[_Seats]:
        """``config.lanes`` lanes sharing ``seats`` seats as evenly as they can: the policy and
        its forks (:meth:`~agentrl_jax.policy.SamplerPolicy.fork`), each a cache of its own."""
        count = min(self.config.lanes, seats)
        if count > 1 and not callable(getattr(policy, "fork", None)):
            raise ValueError(
                f"RolloutConfig.lanes={self.config.lanes} needs a policy with "
                f"fork() (a second cache); {type(policy).__name__} has none"
            )
        policies = [policy] + [policy.fork() for _ in range(count - 1)]
        return [
            _Seats(p, n, rows, self.settings)
            for p, n in zip(policies, lane_seats(seats, self.config.group_size, count))
        ]

    def _play(
        self,
        lanes: list[_Seats],
        play: _Play,
        queues: list[np.ndarray],
        env: _EnvSteps,
        key_policy: jax.Array,
        timer: _Timer,
    ) -> None:
        """Play every row of ``queues`` to its end.

        Each pass of the loop visits every lane: it takes the environment's answer to the
        lane's last turn (recording it and appending the next user message), seats waiting
        rows, and samples one turn of every live row of the lane, each at its own turn, whose
        environment step then runs while the other lanes sample (one lane: at once). Rows take
        seats from the first queue with rows left: without ``refill`` (one queue per part) only
        once every seat of the lane is empty, a fresh ``start``; with ``refill`` (one queue)
        whenever a seat is empty. Rows not seated are not live, so the environment leaves them
        as they are. A row the policy preempts (``Responses.preempted``: its paged cache ran
        out of pages) did not play its turn: it leaves its seat for the front of the queue and,
        seated again, restarts from its context and plays that turn again (the same key, so
        the same draws). When every live row of a lane was preempted, one row alone takes a
        seat of that lane next (it always fits).
        """
        rows = play.rec.tokens.shape[0]
        turn = np.zeros(rows, np.int64)  # each row's current turn
        live = np.zeros(rows, bool)  # rows seated and playing, in any lane
        waiting = [list(q) for q in queues if len(q)]
        pending: list[_Turn | None] = [None] * len(lanes)
        alone = [False] * len(lanes)
        while live.any() or waiting:
            for i, seats in enumerate(lanes):
                if pending[i] is not None:
                    live &= ~pending[i].live
                    live |= self._finish(seats, play, pending[i], turn, timer)
                    pending[i] = None
                mine = live & seats.holds()
                empty = int(np.sum(seats.row < 0))
                if waiting and empty and (self.config.refill or not mine.any()):
                    count = 1 if alone[i] else empty
                    take = np.asarray(waiting[0][:count], np.int64)
                    del waiting[0][:count]
                    with timer("policy"):  # a row's context so far: its first prompt, or more
                        context = lambda r: self._context(play.rec, r, int(turn[r]))  # noqa: E731
                        seats.seat(take, context, fresh=not mine.any())
                    live[take] = mine[take] = True
                    waiting = [q for q in waiting if q]
                if not mine.any():
                    continue
                pending[i], preempted = self._respond(
                    seats, play, mine, turn, key_policy, env, timer
                )
                alone[i] = pending[i] is None
                if preempted.any():  # back to the front of the queue, to replay this turn
                    seats.vacate(np.flatnonzero(preempted))
                    waiting.insert(0, np.flatnonzero(preempted).tolist())
                    live &= ~preempted

    def _respond(
        self,
        seats: _Seats,
        play: _Play,
        live: np.ndarray,
        turn: np.ndarray,
        key_policy: jax.Array,
        env: _EnvSteps,
        timer: _Timer,
    ):
        """Sample one turn of the ``live`` rows (all seated in ``seats``), record the responses
        and hand them to the environment: ``(turn in flight or None, preempted rows)``."""
        cfg, window, rec = self.config, self.config.history_window, play.rec
        rows, length = len(live), cfg.record_length
        kept_from = (
            rec.turn_start[np.arange(rows), np.maximum(0, turn - window)]
            if window is not None
            else rec.prefix_len
        )
        rec.context_start[live, turn[live]] = kept_from[live]
        room = np.minimum(cfg.max_context - play.context_len, length - rec.length)
        max_tokens = np.where(live, np.minimum(cfg.max_response_tokens, room), 0)
        seat_rows = np.maximum(seats.row, 0)
        with timer("policy"):
            out = seats.respond(live, max_tokens, row_keys(key_policy, turn[seat_rows], seat_rows))
        self._check(out, live, max_tokens)
        preempted = live & (False if out.preempted is None else out.preempted)
        live = live & ~preempted
        if not live.any():
            return None, preempted
        play.count_live(turn[live])
        rec.write_responses(out, turn)
        play.context_len += out.lengths
        play.sampled += int(out.lengths.sum())
        last = out.tokens[np.arange(rows), np.maximum(out.lengths - 1, 0)]
        stopped = (out.lengths > 0) & np.isin(last, self._stop_ids)
        cut = live & ~stopped & (out.lengths >= room) & (room < cfg.max_response_tokens)
        playing = live & ~cut
        replies = [""] * rows
        decoded = self.tokenizer.batch_decode(
            [out.tokens[r, : out.lengths[r]].tolist() for r in np.flatnonzero(live)],
            skip_special_tokens=True,
        )
        for r, text in zip(np.flatnonzero(live), decoded):
            play.texts[r].append(text)
            replies[r] = text if playing[r] else ""
        with timer("env"):
            step = env.submit(replies, playing)
        return _Turn(out, live, playing, cut, step), preempted

    def _finish(
        self, seats: _Seats, play: _Play, done: _Turn, turn: np.ndarray, timer: _Timer
    ) -> np.ndarray:
        """Take the environment's answer to turn ``done``: record it, end rows or append their
        next user message, free the seats of ended rows and advance ``turn`` in place; returns
        the rows of ``done`` that play on."""
        cfg, rec = self.config, play.rec
        with timer("env"):
            result = done.step.result()
        live, playing = done.live, done.playing
        self._record_turn(rec, turn, live, playing, result)
        play.turns_used += live
        play.success |= playing & np.asarray(result.success, bool)
        invalid = playing & ~np.asarray(result.action_valid, bool)
        ended = (
            ~playing
            | np.asarray(result.done, bool)
            | (turn + 1 >= play.budget)
            | (cfg.end_on_invalid & invalid)
        )
        play.overflow |= done.cut
        next_live, play.context_len, play.overflow = self._next_turn(
            seats,
            rec,
            turn,
            live & ~ended,
            done.out,
            result,
            play.budget,
            play.context_len,
            play.overflow,
            timer,
        )
        seats.vacate(np.flatnonzero(live & ~next_live))
        turn += next_live
        return next_live

    def _check(self, out: Responses, live: np.ndarray, max_tokens: np.ndarray) -> None:
        """The policy kept its contract (a broken one would corrupt the record silently)."""
        rows, width = len(live), self.config.max_response_tokens
        if (
            out.tokens.shape != (rows, width)
            or out.logprobs.shape != (rows, width)
            or out.behaviour_logprobs.shape != (rows, width)
            or out.lengths.shape != (rows,)
        ):
            raise ValueError(
                f"policy returned tokens {out.tokens.shape}, logprobs "
                f"{out.logprobs.shape}, sampling_logprobs {out.behaviour_logprobs.shape}, "
                f"lengths {out.lengths.shape}; expected [{rows}, {width}] and [{rows}]"
            )
        if np.any(out.lengths > max_tokens) or np.any(out.lengths[~live] != 0):
            raise ValueError(
                "policy returned a response longer than its max_tokens, or one for "
                "a row that was not live"
            )

    def _record_turn(
        self,
        rec: _Record,
        turn: np.ndarray,
        live: np.ndarray,
        playing: np.ndarray,
        result: TurnResult,
    ) -> None:
        """Write each ``live`` row's turn ``turn[row]`` (other rows keep what they hold: rows
        not seated, or the record's defaults)."""
        at = (live, turn[live])
        rec.turn_mask[at] = True
        valid = playing & np.asarray(result.action_valid, bool)
        rec.action_valid[at] = valid[live]
        rec.action[at] = np.where(valid, result.action, -1)[live]
        penalty = np.where(playing & ~valid, self.config.invalid_penalty, 0.0)
        rec.reward[at] = (np.where(playing, result.reward, 0.0) + penalty)[live]
        rec.anchor_key[at] = np.asarray(result.anchor_key)[live]
        if result.state_id is not None:
            rec.state_id[at] = np.asarray(result.state_id)[live]
        rec.step_quality[at] = np.asarray(result.quality, np.float32)[live]

    def _next_turn(
        self,
        seats: _Seats,
        rec: _Record,
        turn: np.ndarray,
        going: np.ndarray,
        out: Responses,
        result: TurnResult,
        budget: np.ndarray,
        context_len: np.ndarray,
        overflow: np.ndarray,
        timer: _Timer,
    ):
        """Append the next user message to rows going on, or end them with ``overflow``:
        ``(live, context_len, overflow)`` for the next turn. ``turn [rows]``: each row's turn."""
        cfg, window = self.config, self.config.history_window
        rows = len(going)
        chunks: list[tuple[int, ...]] = [()] * rows
        closing = np.zeros(rows, np.int64)
        for r in np.flatnonzero(going):
            close = tuple(self.chat.close_response(out.tokens[r, : out.lengths[r]].tolist()))
            user = cfg.prompt.turn_text(result.observations[r], int(budget[r]), int(turn[r]) + 1)
            chunks[r] = close + self._next_prompt(user)
            closing[r] = len(close)
        chunk_len = np.array([len(c) for c in chunks], np.int64)
        # rows whose window slides get a new context: header + turns t+1-window .. t + message
        slides = (turn + 1 > window) if window is not None else np.zeros(rows, bool)
        kept_from = rec.turn_start[np.arange(rows), np.maximum(turn + 1 - (window or 0), 0)]
        new_context = np.where(
            slides, rec.prefix_len + rec.length + chunk_len - kept_from, context_len + chunk_len
        )
        fits = (new_context <= cfg.max_context) & (rec.length + chunk_len <= cfg.record_length)
        overflow = overflow | (going & ~fits)
        live = going & fits
        for r in np.flatnonzero(live):
            rec.turn_start[r, turn[r] + 1] = rec.length[r] + closing[r]
            rec.write(r, chunks[r])
        with timer("policy"):
            restarted = (live & slides).any() and seats.restart(
                np.flatnonzero(live & slides),
                lambda r: self._context(rec, r, int(turn[r]) + 1) if live[r] else (),
            )
            if not restarted:
                seats.extend([chunks[r] if live[r] and not slides[r] else () for r in range(rows)])
        return live, np.where(live, new_context, context_len), overflow

    def _context(self, rec: _Record, row: int, turn: int) -> list[int]:
        """What row ``row`` sees at ``turn``: its whole record, or header + window."""
        window = self.config.history_window
        if window is None or turn <= window:
            return rec.tokens[row, : rec.length[row]].tolist()
        return rec.context(row, turn, window)

    def _trajectory(
        self, rec: _Record, group, row_task, budget, turns_used, success, overflow
    ) -> Trajectory:
        """The record as a :class:`Trajectory` of host (NumPy) arrays in jax's dtypes: it stays
        on the host until a train step places it (or an analysis reads it)."""
        rows, length = rec.tokens.shape
        i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
        return Trajectory(
            tokens=_host(rec.tokens),
            token_mask=np.arange(length)[None, :] < rec.length[:, None],
            loss_mask=_host(rec.loss_mask),
            token_turn=_host(rec.token_turn),
            logprobs=_host(rec.logprobs),
            sampling_logprobs=_host(rec.sampling_logprobs),
            turn_mask=_host(rec.turn_mask),
            action=_host(rec.action),
            action_valid=_host(rec.action_valid),
            reward=_host(rec.reward),
            anchor_key=_host(rec.anchor_key),
            state_id=_host(rec.state_id),
            step_quality=_host(rec.step_quality),
            group_id=i32(group),
            task_id=i32(row_task),
            budget=i32(budget),
            turns_used=i32(turns_used),
            success=_host(success),
            overflow=_host(overflow),
            row_mask=np.ones(rows, bool),
            prefix_len=i32(rec.prefix_len),
            context_start=_host(rec.context_start),
        )

    def for_training(self, policy: SamplerPolicy) -> Callable[[Any, jax.Array, Any], Trajectory]:
        """The trainer's ``rollout(params, key, task_ids) -> Trajectory`` (agentrl_jax.train).

        The trainer scores ``tokens`` with the policy's model, so with a ``token_map`` they are
        the model's ids (padding 0): decode them with ``token_map.to_tokenizer`` first.
        """

        def rollout(params: Any, key: jax.Array, task_ids: Any) -> Trajectory:
            trajectory = self(policy.using(params), np.asarray(task_ids), key).trajectory
            if policy.token_map is None:
                return trajectory
            real = trajectory.token_mask
            ids = policy.token_map.to_model(
                np.where(real, trajectory.tokens, policy.token_map.tokenizer_ids[0])
            )
            return trajectory.replace(tokens=np.where(real, ids, 0).astype(np.int32))

        return rollout
