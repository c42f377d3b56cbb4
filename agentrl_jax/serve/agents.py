"""RL on agent programs: an agent is a plain Python callable that plays one episode through any
OpenAI-compatible client; the trainer serves the policy to it and trains on what the server
recorded.

    def my_agent(*, base_url, api_key, model, task, seed) -> float:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...                                     # any loop: tools, several turns
        return reward                           # 1.0 on success, else 0.0

    agents.register_agent("my_agent", my_agent, tasks=100, max_turns=8)   # a --plugin file

Registering an agent registers an environment of the same name (:mod:`envs.registry`) whose
environment is an :class:`AgentEnv`; :func:`~agentrl_jax.train.run.train_policy` (and so
``agentrl-jax train`` with ``task.env`` naming it) then plays each update's episodes with an
:class:`AgentRunner` instead of the built-in text rollout: ``rl.group_size`` episodes per task,
all at once (``concurrency`` threads), against an in-process :class:`~agentrl_jax.serve.server.
PolicyServer` whose engine decodes with the update's parameters (synced on device between
updates; ``rl.asynchronous.max_staleness`` as for any rollout). Each episode gets its own base URL
(``.../episodes/<id>/v1``), so its requests are recorded as one episode whatever client sends
them, and its sampling keys come from the update's key: the tokens are a function of the key,
not of thread timing.

An episode's reward is the agent's return value, or ``reward(task, turns)`` of the entry when
the agent returns None. The paper's outcome reward R(tau) is binary (§4): a reward must be in
[0, 1], and the row's ``success`` is ``reward >= 0.5``; the reward itself is the last turn's
``Trajectory.reward``. An agent that raises loses its row (``row_mask`` False), counted in
:attr:`AgentRunner.errors`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import uuid
from typing import Any, Callable, Sequence

import jax
import numpy as np

from agentrl_jax.serve.episodes import Turn, episode_row
from agentrl_jax.trajectory import Trajectory

Agent = Callable[..., Any]  # agent(*, base_url, api_key, model, task, seed) -> reward | None


@dataclasses.dataclass
class AgentEnv:
    """The environment an agent registers (what the trainer and the registry read): its
    callable, how many tasks it has, its most turns per episode, and an optional reward
    function ``reward(task, turns) -> float`` for agents that return None."""

    name: str
    agent: Agent
    tasks: int
    max_turns: int
    reward: Callable[[int, Sequence[Turn]], float] | None = None
    t_max: int = 0  # the registry's task_set sets it (the turn budget of a config)

    def num_tasks(self) -> int:
        return self.tasks

    @property
    def instructions(self) -> str:
        return f"the agent program {self.name!r}"


def register_agent(
    name: str,
    agent: Agent,
    *,
    tasks: int,
    max_turns: int,
    label: str | None = None,
    reward: Callable[[int, Sequence[Turn]], float] | None = None,
    max_response_tokens: int = 256,
    max_context: int = 4096,
    replace: bool = False,
):
    """Register ``agent`` (module docstring) as the environment ``name`` with ``tasks`` tasks
    (ids ``0..tasks-1``, handed to the agent) and at most ``max_turns`` requests an episode
    records. Returns the registry's entry."""
    import envs

    if not callable(agent):
        raise ValueError(f"register_agent({name!r}): the agent must be callable")
    for field, value in (("tasks", tasks), ("max_turns", max_turns)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"register_agent({name!r}): {field} must be an int >= 1")

    def factory(limit: int | None = None) -> envs.EnvTasks:
        count = tasks if limit is None else min(tasks, limit)
        env = AgentEnv(name, agent, count, max_turns, reward)
        return envs.EnvTasks(env, tuple(f"{name}:{i}" for i in range(count)))

    return envs.register(
        name,
        factory,
        label=label or name,
        max_response_tokens=max_response_tokens,
        max_context=max_context,
        replace=replace,
    )


def outcome(value: Any, where: str) -> float:
    """An agent's reward as a float in [0, 1] (a ValueError naming ``where`` otherwise)."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, (int, float, np.number)) and math.isfinite(value) and 0 <= value <= 1:
        return float(value)
    raise ValueError(f"{where}: the reward must be a bool or a number in [0, 1], got {value!r}")


class AgentRunner:
    """Plays an :class:`AgentEnv`'s episodes through ``server`` (served at ``base_url``,
    ``.../v1``) and returns them as a :class:`~agentrl_jax.trajectory.Trajectory`
    (``group_size`` rows per task, rows of ``record_length`` tokens and ``env.max_turns``
    turns; with the engine's ``token_map``, the model's ids, as the trainer scores them).
    ``routing``: an MoE policy's ``(M, k)`` (its recorded experts go in the record)."""

    def __init__(
        self,
        env: AgentEnv,
        server: Any,
        base_url: str,
        *,
        group_size: int,
        record_length: int,
        concurrency: int = 64,
        api_key: str = "none",
        routing: tuple[int, int] = (0, 0),
    ):
        self.env, self.server, self.base_url = env, server, base_url.rstrip("/")
        self.group_size, self.record_length = group_size, record_length
        self.concurrency, self.api_key, self.routing = concurrency, api_key, routing
        self.errors: list[str] = []
        self.version = 0

    @property
    def num_turns(self) -> int:
        return self.env.max_turns

    def _episode_url(self, episode: str) -> str:
        root = self.base_url.removesuffix("/v1")
        return f"{root}/episodes/{episode}/v1"

    def __call__(self, params: Any, key: jax.Array, tasks: Sequence[int]) -> Trajectory:
        """Every task's ``group_size`` episodes, sampled by ``params``."""
        if params is not None:
            self.version += 1
            self.server.engine.set_params(params, self.version)
            self.server.engine.wait_params()
        tasks = np.asarray(tasks, np.int64)
        rows = len(tasks) * self.group_size
        run = uuid.uuid4().hex[:12]
        names = [f"{run}-{r}" for r in range(rows)]
        seeds = np.asarray(
            jax.random.randint(jax.random.fold_in(key, 1 << 20), (rows,), 0, 2**31 - 1)
        )
        for r, name in enumerate(names):
            self.server.open_episode(name, jax.random.fold_in(key, r))

        def play(r: int) -> Any:
            return self.env.agent(
                base_url=self._episode_url(names[r]),
                api_key=self.api_key,
                model=self.server.model_name,
                task=int(tasks[r // self.group_size]),
                seed=int(seeds[r]),
            )

        with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, rows)) as pool:
            futures = [pool.submit(play, r) for r in range(rows)]
            results = []
            for r, future in enumerate(futures):
                try:
                    results.append(future.result())
                except Exception as error:  # noqa: BLE001  (the agent's bug loses its row only)
                    self.errors.append(f"episode {r}: {type(error).__name__}: {error}")
                    results.append(error)
        return self._record(tasks, names, results)

    def _record(self, tasks: np.ndarray, names: list[str], results: list[Any]) -> Trajectory:
        n, length, turns = len(names), self.record_length, self.env.max_turns
        out = Trajectory.zeros(n, length, turns, self.routing)
        arrays = {k: np.array(v) for k, v in vars(out).items()}
        for r, name in enumerate(names):
            recorded = self.server.close_episode(name)
            task = int(tasks[r // self.group_size])
            arrays["group_id"][r] = r // self.group_size
            arrays["task_id"][r] = task
            arrays["budget"][r] = turns
            if isinstance(results[r], Exception):
                continue
            value = results[r]
            if value is None:
                if self.env.reward is None:
                    raise ValueError(
                        f"agent {self.env.name!r} returned no reward and registered no reward "
                        "function"
                    )
                value = self.env.reward(task, recorded)
            reward = outcome(value, f"agent {self.env.name!r}")
            row = episode_row(recorded, length, turns, self.routing)
            for field in ("tokens", "loss_mask", "token_turn", "logprobs", "sampling_logprobs"):
                arrays[field][r] = getattr(row, field)
            arrays["experts"][r] = row.experts
            arrays["token_mask"][r, : row.length] = True
            arrays["turn_mask"][r, : row.turns] = True
            arrays["action_valid"][r, : row.turns] = True
            if row.turns:
                arrays["reward"][r, row.turns - 1] = reward
            arrays["context_start"][r] = row.context_start
            arrays["turns_used"][r] = row.turns
            arrays["success"][r] = reward >= 0.5
            arrays["overflow"][r] = row.overflow
            arrays["row_mask"][r] = row.turns > 0
        token_map = self.server.engine.token_map
        if token_map is not None:  # the trainer scores with the model: its ids (padding 0)
            real = arrays["token_mask"]
            ids = token_map.to_model(np.where(real, arrays["tokens"], token_map.tokenizer_ids[0]))
            arrays["tokens"] = np.where(real, ids, 0).astype(np.int32)
        return Trajectory(**arrays)


@contextlib.contextmanager
def serving(model: Any, tokenizer: Any, env: AgentEnv, config: Any, *, slots: int | None = None):
    """An :class:`AgentRunner` for training ``model`` (the trained module: with LoRA, its
    adapters) on ``env`` under ``config`` (a :class:`~agentrl_jax.train.config.Config`): a
    policy server on 127.0.0.1 in this process, decoding ``slots`` rows at once (default: an
    update's episodes, at most 64) of ``task.max_context`` tokens on the paged engine
    (``engine`` section), completions of at most ``task.max_response_tokens``."""
    from agentrl_jax import distributed
    from agentrl_jax.prompts import ChatTokens
    from agentrl_jax.serve.engine import ServingEngine
    from agentrl_jax.serve.server import PolicyServer, serve_in_thread

    if distributed.is_multiprocess():
        raise NotImplementedError("training an agent program runs in one process")
    task, rl = config.task, config.rl
    rows = rl.tasks_per_step * rl.group_size
    engine = ServingEngine(
        model,
        stop_token_ids=ChatTokens(tokenizer).stop_token_ids,
        slots=slots or min(rows, 64),
        max_context=task.max_context,
        page_size=config.engine.kv_page_size or 16,
        cache_dtype=config.engine.kv_cache_dtype,
        max_queue=max(256, rows),
    )
    server = PolicyServer(engine, tokenizer, max_tokens=task.max_response_tokens)
    moe = sum(model.config.moe_layers)
    with serve_in_thread(server) as url:
        yield AgentRunner(
            env,
            server,
            url,
            group_size=rl.group_size,
            record_length=task.max_context,
            concurrency=max(rows, 1),
            routing=(moe, model.config.num_experts_per_tok) if moe else (0, 0),
        )
