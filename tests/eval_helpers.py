"""Shared helpers of the evaluation tests: scripted FrozenLake agents that read the prompt,
exact references computed from gymnasium's transition table, and tiny policy directories."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

sys.path.insert(0, str(Path(__file__).parent))  # hf_qwen3

from envs.frozenlake import grid, qstar  # noqa: E402

TURN = re.compile(
    r"\[MAX TURNS\] (\d+) \[CURRENT TURN\] (\d+) \[REMAINING TURNS\] (\d+)\n(.*?)<\|im_end\|>", re.S
)
LAST_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)
SYSTEM_BUDGET = re.compile(r"at most (\d+) turns")
SYMBOL_TILE = {"_": grid.FROZEN, "P": grid.FROZEN, "O": grid.HOLE, "G": grid.GOAL}


def turns_in(context: str) -> list[tuple[int, int, int, str]]:
    """``(B, t, B - t, grid text)`` of every user message of a decoded context, in order."""
    return [(int(b), int(t), int(r), text) for b, t, r, text in TURN.findall(context)]


def parse_grid(text: str) -> tuple[np.ndarray, int]:
    """``(tiles, pos)`` of a rendered grid (the start cell reads as ice, which it equals)."""
    rows = [line.split(" ") for line in text.strip("\n").split("\n")]
    tiles = np.array([[SYMBOL_TILE[c] for c in row] for row in rows], np.int8)
    return tiles, [c for row in rows for c in row].index("P")


class QStarAgent:
    """Reads the last grid and the remaining budget off the prompt and answers
    ``argmax_a Q*(remaining, pos, a)`` (gamma ``gamma``; ties to the lowest code), or, with
    probability ``epsilon``, a uniformly random move. Records every context it is shown."""

    def __init__(
        self,
        horizon: int,
        *,
        gamma: float = 0.95,
        epsilon: float = 0.0,
        seed: int = 0,
        is_slippery: bool = True,
        success_rate: float = 1.0 / 3.0,
    ):
        self.horizon, self.gamma, self.epsilon = horizon, gamma, epsilon
        self.is_slippery, self.success_rate = is_slippery, success_rate
        self.rng = np.random.default_rng(seed)
        self.q: dict[bytes, np.ndarray] = {}
        self.contexts: list[str] = []

    def table(self, tiles: np.ndarray) -> np.ndarray:
        key = tiles.tobytes()
        if key not in self.q:
            self.q[key] = np.asarray(
                qstar.q_star(
                    tiles,
                    self.horizon,
                    gamma=self.gamma,
                    is_slippery=self.is_slippery,
                    success_rate=self.success_rate,
                )
            )
        return self.q[key]

    def __call__(self, contexts, live):
        replies = []
        for context, on in zip(contexts, live):
            if not on:
                replies.append("")
                continue
            self.contexts.append(context)
            shown = turns_in(context)
            if shown:
                _, _, remaining, text = shown[-1]
            else:  # the budget hidden: the last user message is the grid alone
                remaining, text = self.horizon, LAST_USER.findall(context)[-1]
            remaining = min(remaining, self.horizon)  # an overstated budget (approximate)
            tiles, pos = parse_grid(text)
            action = int(np.argmax(self.table(tiles)[remaining, pos]))
            if self.rng.random() < self.epsilon:
                action = int(self.rng.integers(4))
            replies.append(f"<answer>{grid.ACTION_NAMES[action]}</answer>")
        return replies


def gym_transitions(tiles: np.ndarray, success_rate: float = 1.0 / 3.0):
    """gymnasium's ``P[s][a] = [(prob, next, reward, done), ...]`` of a map (slippery)."""
    desc = ["".join(grid.TILE_LETTERS[c] for c in row) for row in np.asarray(tiles)]
    return FrozenLakeEnv(desc=desc, is_slippery=True, success_rate=success_rate).P


def policy_success(
    tiles: np.ndarray, policy: np.ndarray, horizon: int, success_rate: float = 1.0 / 3.0
) -> np.ndarray:
    """Exact probability of reaching the goal within ``h`` moves, ``S[h, s]`` for h = 0..H,
    of a Markov policy ``policy[h, s, a]`` (action probabilities with ``h`` moves left), by
    dynamic programming over gymnasium's transition table."""
    transitions = gym_transitions(tiles, success_rate)
    cells = tiles.size
    terminal = np.isin(np.asarray(tiles).reshape(-1), [grid.HOLE, grid.GOAL])
    value = np.zeros((horizon + 1, cells))
    for h in range(1, horizon + 1):
        for s in range(cells):
            if terminal[s]:
                continue
            for a in range(4):
                value[h, s] += policy[h, s, a] * sum(
                    p * (r + (0.0 if done else value[h - 1, nxt]))
                    for p, nxt, r, done in transitions[s][a]
                )
    return value


def agent_policy(q: np.ndarray, epsilon: float) -> np.ndarray:
    """``policy[h, s, a]`` of a :class:`QStarAgent` with Q table ``q [H + 1, S, 4]``."""
    greedy = np.eye(4)[np.argmax(q, axis=-1)]
    return (1.0 - epsilon) * greedy + epsilon / 4.0


def gym_q_star(
    tiles: np.ndarray, horizon: int, gamma: float, success_rate: float = 1.0 / 3.0
) -> np.ndarray:
    """Finite-horizon ``Q[h, s, a]`` from gymnasium's transition table (float64 reference)."""
    transitions = gym_transitions(tiles, success_rate)
    cells = tiles.size
    terminal = np.isin(np.asarray(tiles).reshape(-1), [grid.HOLE, grid.GOAL])
    q = np.zeros((horizon + 1, cells, 4))
    for h in range(1, horizon + 1):
        v = q[h - 1].max(axis=1)
        for s in range(cells):
            if terminal[s]:
                continue
            for a in range(4):
                q[h, s, a] = sum(
                    p * (r + (0.0 if done else gamma * v[nxt]))
                    for p, nxt, r, done in transitions[s][a]
                )
    return q


# ---------------------------------------------------------------- tiny policy directories


def frozenlake_corpus(budgets=range(1, 21)) -> list[str]:
    """Texts a small FrozenLake tokenizer should encode compactly."""
    from agentrl_jax.prompts import BudgetPrompt
    from envs.frozenlake.text_env import INSTRUCTIONS, SLIP_TEXT

    prompt = BudgetPrompt()
    texts = [
        INSTRUCTIONS.format(slip=SLIP_TEXT.format(intended=1 / 3)),
        prompt.system_text("", 10),
        "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G",
    ]
    texts += [f"<answer>{a}</answer>" for a in grid.ACTION_NAMES]
    texts += [prompt.turn_text("", b, t) for b in budgets for t in range(b)]
    return texts * 3


def save_tiny_policy(path: Path, tokenizer, *, seed: int) -> Path:
    """A random tiny Hugging Face Qwen3 with ``tokenizer``'s vocabulary and the tokenizer,
    saved together in ``path`` (a model directory :func:`load_policy` reads)."""
    from hf_qwen3 import save_random_hf_qwen3

    save_random_hf_qwen3(
        path,
        seed=seed,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
    )
    tokenizer.save_pretrained(str(path))
    return path


def save_answering_policy(path: Path, tokenizer, answer: str) -> Path:
    """A tiny Qwen3 that after the generation prompt writes ``answer`` or stops at once, each
    with probability 1/2 (at the evaluation temperature 0.6, every other token has a
    probability below e^-90): its layer adds nothing to the residual stream
    (``o_proj`` and ``down_proj`` are zero), so the logits depend on the current token only,
    and embeddings and output rows chain the generation prompt's last token through the answer's
    tokens to the end-of-turn token."""
    import torch
    import transformers

    from agentrl_jax.prompts import ChatTokens

    save_tiny_policy(path, tokenizer, seed=2)
    model = transformers.Qwen3ForCausalLM.from_pretrained(path)
    chat = ChatTokens(tokenizer)
    start = chat.next_prompt("x")[-1]  # every generation prompt ends with this token
    chain = [start] + tokenizer(answer, add_special_tokens=False)["input_ids"]
    end = chat.end_of_turn[0]
    hidden = model.config.hidden_size
    assert not model.config.tie_word_embeddings
    assert len(set(chain)) == len(chain) < hidden and end not in chain, chain
    assert tokenizer.decode(chain[1:]) == answer
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        basis = torch.eye(hidden)
        for i, token in enumerate(chain):
            embed[token] = basis[i]
        head[chain[1:]] = 0.0
        head[end] = 0.0
        for i, successor in enumerate(chain[1:] + [end]):
            head[successor] += 10.0 * basis[i]  # after RMSNorm the logit is 10 * sqrt(hidden)
        head[end] += 10.0 * basis[0]  # the branch: stop at once
    model.save_pretrained(path)
    return path


@contextlib.contextmanager
def plugin_analysis(folder: Path):
    """:data:`PLUGIN_ANALYSIS` written to ``folder/solved_once.py`` (its path yielded); the
    analyses and plugins registered meanwhile are gone afterwards, so later tests see the
    built-in ones."""
    from agentrl_jax import plugins
    from agentrl_jax.evaluation.analyses import registry

    tables = (registry._REGISTRY, plugins._LOADED)
    before = [dict(table) for table in tables]
    path = Path(folder) / "solved_once.py"
    path.write_text(PLUGIN_ANALYSIS)
    try:
        yield path
    finally:
        for table, saved in zip(tables, before):
            table.clear()
            table.update(saved)


# A user's analysis, as a plugin file holds it (written to a file by the tests of
# `agentrl-jax eval` and `reproduce`, passed as --plugin or loaded as a plugin): it plays each
# policy once per task at T_max, saves its raw record, writes its report section and checks
# one claim of its own; the package knows nothing of it.
PLUGIN_ANALYSIS = '''
"""Solved once: the share of the first tasks each policy solves in one try at T_max."""

from agentrl_jax.evaluation import drivers
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.findings import REFUTED, SHOWS, Finding
from agentrl_jax.evaluation.report import Section

CLAIM = "Every policy solves a task in one try (a plugin's claim)"


class SolvedOnce(Analysis):
    name = "solved_once"
    sources = {CLAIM: "Solved once"}  # the section its verdicts link to

    def units(self, settings, num_tasks, policies, t_max):
        return policies * drivers.rollout_units(num_tasks, 1, t_max)

    def run(self, run):
        key = run.key("solved_once")  # a stream of its own
        counts = drivers.pass_at_k_counts(run.play, run.policies, key, samples=1)
        shares = {p: float(c.mean()) for p, (n, c) in counts.items()}
        raw_file = run.write_raw("solved_once", {"shares": shares})
        text = ", ".join(f"{p} {100 * s:.0f}%" for p, s in shares.items())
        return [Section("Solved once", f"Tasks solved in one try: {text}.", files=(raw_file,))]

    def findings(self, records, paper):
        record = records.get("solved_once")
        if record is None:
            return []
        return [
            Finding(CLAIM, p, "none", f"{100 * s:.0f}%", SHOWS if s > 0 else REFUTED)
            for p, s in record["shares"].items()
        ]


register(SolvedOnce())
'''
