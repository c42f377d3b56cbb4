"""FrozenLake as an ordinary tool-calling agent program, trained through the policy server.

The agent knows nothing of agentrl-jax: it talks to whatever OpenAI-compatible endpoint it is
given with the ``openai`` package. The map is the user message; the model moves with a
``move`` tool (a reply with no tool call is read as a move too, e.g. "Right", so a small
untrained policy can play); each move's result comes back as the tool's output. The episode's
reward is 1.0 on reaching the goal within the budget, else 0.0.

As a plugin (``--plugin examples/frozenlake_openai_agent.py``) it registers the agent
``frozenlake_openai`` over ``TASKS`` generated 4x4 maps; :func:`make_agent` builds one over maps
of your own (the tests do). Run one episode against a server by hand::

    agentrl-jax serve --model-dir MODEL &        # http://127.0.0.1:8000/v1
    python examples/frozenlake_openai_agent.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np

from envs.frozenlake import grid
from envs.frozenlake.text import INVALID, parse_action, render

SYSTEM = (
    "You are on a frozen lake. P is you, G the goal, O a hole, _ ice. Reach G without "
    "falling into a hole. Move one cell per turn with the move tool."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one cell.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": list(grid.ACTION_NAMES)}},
                "required": ["direction"],
            },
        },
    }
]
TASKS = 64
BUDGET = 5


def observation(tiles: np.ndarray, pos: int, left: int) -> str:
    return f"{render(tiles, pos)}\nMoves left: {left}"


@functools.cache
def _http_client():
    """One connection pool shared by every episode and thread (httpx clients are thread-safe):
    a client of its own per episode would build an SSL context (~10 ms of CPU) and open fresh
    connections each time."""
    import openai

    return openai.DefaultHttpxClient()


def play(
    *,
    base_url: str,
    api_key: str,
    model: str,
    task: int,
    seed: int,
    maps: np.ndarray,
    budget: int = BUDGET,
    max_tokens: int = 64,
    temperature: float = 1.0,
) -> float:
    """One episode on ``maps[task]`` (deterministic moves); 1.0 on reaching the goal."""
    import openai

    client = openai.OpenAI(
        base_url=base_url, api_key=api_key, max_retries=2, timeout=600, http_client=_http_client()
    )
    tiles = np.asarray(maps[task])
    n = tiles.shape[0]
    pos = int(np.flatnonzero(tiles.reshape(-1) == grid.START)[0])
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": observation(tiles, pos, budget)},
    ]
    for turn in range(budget):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=max_tokens,
            temperature=temperature,
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        call = message.tool_calls[0] if message.tool_calls else None
        if call is not None:
            try:
                direction = json.loads(call.function.arguments).get("direction", "")
            except (ValueError, AttributeError):
                direction = ""
            action = parse_action(direction if isinstance(direction, str) else "")
        else:
            action = parse_action(message.content or "")
        if action != INVALID:
            pos = int(grid.move(pos, action, n))
        tile = int(tiles.reshape(-1)[pos])
        if tile == grid.GOAL:
            return 1.0
        if tile == grid.HOLE:
            return 0.0
        shown = observation(tiles, pos, budget - turn - 1)
        if call is not None:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": shown})
        else:
            messages.append({"role": "user", "content": shown})
    return 0.0


def make_agent(maps: np.ndarray, **options):
    """The agent over ``maps`` (``[tasks, n, n]`` tile codes), ``options`` as :func:`play`'s."""
    return functools.partial(play, maps=np.asarray(maps), **options)


def default_maps(count: int = TASKS, seed: int = 0) -> np.ndarray:
    import jax

    from envs.frozenlake import maps

    return np.asarray(maps.generate(jax.random.key(seed), count, size=4, p=0.8))


def register(name: str = "frozenlake_openai", maps: np.ndarray | None = None, **options):
    from agentrl_jax.serve.agents import register_agent

    maps = default_maps() if maps is None else np.asarray(maps)
    budget = options.get("budget", BUDGET)
    return register_agent(
        name,
        make_agent(maps, **options),
        tasks=len(maps),
        max_turns=budget,
        label="FrozenLake (OpenAI tool-calling agent)",
        replace=True,
    )


if __name__ != "__main__":
    register()

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default="policy")
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reward = play(
        base_url=args.base_url,
        api_key=args.api_key,
        model=args.model,
        task=args.task,
        seed=args.seed,
        maps=default_maps(),
    )
    print(f"reward: {reward}")
