"""The turn loop (:class:`MultiTurnRollout`): plays every row's turns against the environment
with a policy; see :mod:`agentrl_jax.rollout` for the layout, the loop and its options."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax import distributed
from agentrl_jax.algorithms.budgetmix import sample_budgets
from agentrl_jax.prompts import ChatTokens
from agentrl_jax.rollout.config import RolloutConfig, RolloutResult, RolloutStats
from agentrl_jax.rollout.lanes import EnvSteps, Timer, Turn
from agentrl_jax.rollout.record import Play, Record, gather_rows, host_array
from agentrl_jax.rollout.seating import Seats, lane_seats, row_keys, row_parts
from agentrl_jax.sampling import Policy, PolicySettings, Responses, SamplerPolicy
from agentrl_jax.trajectory import Trajectory, no_experts
from envs.protocol import TextEnv, TurnResult, cut_observation, observation_budget


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
        # Each observation is cut to the environment's budget before it becomes tokens.
        self.observation_chars = observation_budget(env)
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

    def _first_prompt_uncached(
        self, budget: int, observation: str, shown: int | None = None
    ) -> tuple[tuple[int, ...], int]:
        """``(tokens, prefix_len)``; ``prefix_len`` 0 when the header cannot be split off.
        ``shown``: the budget the prompt states (None: ``budget``; 0: none)."""
        prompt = self.config.prompt
        user = prompt.turn_text(observation, budget, 0, shown)
        ids = tuple(
            self.chat.first_prompt(prompt.system_text(self.instructions, budget, shown), user)
        )
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
        cfg, timer = self.config, Timer()
        tasks = self._tasks(task_ids)
        groups, size = len(tasks), cfg.group_size
        rows = groups * size
        row_task = np.repeat(tasks, size)
        group = np.repeat(np.arange(groups), size)
        key_budget, key_env, key_policy = jax.random.split(key, 3)
        group_budget = self._group_budgets(key_budget, tasks, budgets)
        budget = group_budget[group]
        # the budget each row is shown (its own stream: exact rollouts draw nothing new)
        shown = cfg.presentation.shown_budgets(jax.random.fold_in(key, 3), group_budget)[group]
        exact = cfg.presentation.exact
        env_seed = int(jax.random.randint(key_env, (), 0, np.iinfo(np.int32).max))
        with timer("env"):
            env_state, observations = self.env.reset(row_task, env_seed)
        observations = [cut_observation(o, self.observation_chars) for o in observations]

        length = cfg.record_length
        rec = Record(rows, length, self.num_turns)
        first = [
            self._first_prompt(int(b), o) if exact else self._first_prompt(int(b), o, int(s))
            for b, o, s in zip(budget, observations, shown)
        ]
        context_len = np.array([len(ids) for ids, _ in first], np.int64)
        fits = context_len <= min(cfg.max_context, length)
        for r in np.flatnonzero(fits):
            rec.write(r, first[r][0])
            rec.prefix_len[r] = rec.turn_start[r, 0] = first[r][1]
        play = Play(
            rec,
            budget,
            context_len,
            overflow=~fits,
            success=np.zeros(rows, bool),
            turns_used=np.zeros(rows, np.int32),
            texts=[[] for _ in range(rows)],
            shown=None if exact else shown,
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
        with EnvSteps(self.env, env_state, background=len(lanes) > 1) as env:
            self._play(lanes, play, queues, env, key_policy, timer)
        if shares is not None:  # over the policy's devices only (not the training devices')
            gather_rows(play, shares, gather_device(policy))
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

    def _lanes(self, policy: Policy, seats: int, rows: int) -> list[Seats]:
        """``config.lanes`` lanes sharing ``seats`` seats as evenly as they can: the policy and
        its forks (:meth:`~agentrl_jax.sampling.SamplerPolicy.fork`), each a cache of its own."""
        count = min(self.config.lanes, seats)
        if count > 1 and not callable(getattr(policy, "fork", None)):
            raise ValueError(
                f"RolloutConfig.lanes={self.config.lanes} needs a policy with "
                f"fork() (a second cache); {type(policy).__name__} has none"
            )
        policies = [policy] + [policy.fork() for _ in range(count - 1)]
        return [
            Seats(p, n, rows, self.settings)
            for p, n in zip(policies, lane_seats(seats, self.config.group_size, count))
        ]

    def _play(
        self,
        lanes: list[Seats],
        play: Play,
        queues: list[np.ndarray],
        env: EnvSteps,
        key_policy: jax.Array,
        timer: Timer,
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
        pending: list[Turn | None] = [None] * len(lanes)
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
        seats: Seats,
        play: Play,
        live: np.ndarray,
        turn: np.ndarray,
        key_policy: jax.Array,
        env: EnvSteps,
        timer: Timer,
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
        return Turn(out, live, playing, cut, step), preempted

    def _finish(
        self, seats: Seats, play: Play, done: Turn, turn: np.ndarray, timer: Timer
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
            play.shown,
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
        rec: Record,
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
        seats: Seats,
        rec: Record,
        turn: np.ndarray,
        going: np.ndarray,
        out: Responses,
        result: TurnResult,
        budget: np.ndarray,
        context_len: np.ndarray,
        overflow: np.ndarray,
        shown: np.ndarray | None,
        timer: Timer,
    ):
        """Append the next user message to rows going on, or end them with ``overflow``:
        ``(live, context_len, overflow)`` for the next turn. ``turn [rows]``: each row's turn."""
        cfg, window = self.config, self.config.history_window
        rows = len(going)
        chunks: list[tuple[int, ...]] = [()] * rows
        closing = np.zeros(rows, np.int64)
        for r in np.flatnonzero(going):
            close = tuple(self.chat.close_response(out.tokens[r, : out.lengths[r]].tolist()))
            user = cfg.prompt.turn_text(
                cut_observation(result.observations[r], self.observation_chars),
                int(budget[r]),
                int(turn[r]) + 1,
                None if shown is None else int(shown[r]),
            )
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

    def _context(self, rec: Record, row: int, turn: int) -> list[int]:
        """What row ``row`` sees at ``turn``: its whole record, or header + window."""
        window = self.config.history_window
        if window is None or turn <= window:
            return rec.tokens[row, : rec.length[row]].tolist()
        return rec.context(row, turn, window)

    def _trajectory(
        self, rec: Record, group, row_task, budget, turns_used, success, overflow
    ) -> Trajectory:
        """The record as a :class:`Trajectory` of host (NumPy) arrays in jax's dtypes: it stays
        on the host until a train step places it (or an analysis reads it)."""
        rows, length = rec.tokens.shape
        i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
        return Trajectory(
            tokens=host_array(rec.tokens),
            token_mask=np.arange(length)[None, :] < rec.length[:, None],
            loss_mask=host_array(rec.loss_mask),
            token_turn=host_array(rec.token_turn),
            logprobs=host_array(rec.logprobs),
            sampling_logprobs=host_array(rec.sampling_logprobs),
            experts=no_experts(rec.tokens.shape) if rec.experts is None else rec.experts,
            turn_mask=host_array(rec.turn_mask),
            action=host_array(rec.action),
            action_valid=host_array(rec.action_valid),
            reward=host_array(rec.reward),
            anchor_key=host_array(rec.anchor_key),
            state_id=host_array(rec.state_id),
            step_quality=host_array(rec.step_quality),
            group_id=i32(group),
            task_id=i32(row_task),
            budget=i32(budget),
            turns_used=i32(turns_used),
            success=host_array(success),
            overflow=host_array(overflow),
            row_mask=np.ones(rows, bool),
            prefix_len=i32(rec.prefix_len),
            context_start=host_array(rec.context_start),
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


def gather_device(policy: Policy) -> Any:
    """The device a split rollout's rows are gathered on (with every other process's device
    at the same position, :func:`~agentrl_jax.distributed.peer_devices`): the first of this
    process's devices the policy samples on (its mesh's or its one device; on split devices,
    ``mesh.rollout``, a rollout device: the gather then waits for nothing the training
    devices run), or None (a policy without devices: the gather runs over every device)."""
    mesh = getattr(policy, "mesh", None)
    devices = list(mesh.devices.flat) if mesh is not None else [getattr(policy, "device", None)]
    own = [d for d in jax.local_devices() if d in devices]
    return own[0] if own else None
