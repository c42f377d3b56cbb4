"""The budget-aware prompt (paper §6) and the chat tokens of a multi-turn conversation.

Wording lives in one :class:`BudgetPrompt` that users can replace; its templates must mention
the three budget values, which :meth:`BudgetPrompt.__post_init__` checks:

* ``{max_turns}``       B, the turn budget of the trajectory,
* ``{current_turn}``    t, the turns already completed (0 at the first turn),
* ``{remaining_turns}`` B - t.

How the budget is *shown* is an experimental variable of its own (:class:`BudgetPresentation`,
the rollout's ``presentation``): ``exact`` states B (the paper's setting, §6), ``hidden`` uses
the templates without any budget line (:attr:`BudgetPrompt.hidden_system`,
:attr:`BudgetPrompt.hidden_turn`), ``approximate`` states a perturbed budget S (each group its
own draw, :meth:`BudgetPresentation.shown_budgets`) with ``remaining = max(S - t, 0)``, and
``mixed`` draws one of those per group (a BudgetMix variant randomising the presentation).
Whatever is shown, the episode still ends after B turns.

The conversation is kept as tokens, never re-rendered (Qwen3's chat template drops the
``<think>`` part of earlier assistant turns, so a re-rendered history is not what the policy
sampled). :class:`ChatTokens` cuts the tokenizer's own chat template into the three pieces a
rollout appends:

* :meth:`ChatTokens.first_prompt`: system + first user message + generation prompt,
* the sampled response (the policy's own tokens, ending with an end-of-turn token when the
  model stopped by itself; otherwise :attr:`ChatTokens.end_of_turn` closes it),
* :meth:`ChatTokens.next_prompt`: the next user message + generation prompt.

Their concatenation is token for token what ``apply_chat_template`` gives for the whole
conversation (tested), so a policy trained on it sees exactly the format it will be served in.
"""

from __future__ import annotations

import dataclasses
import math
import string
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from agentrl_jax.errors import did_you_mean

REQUIRED_TURN_FIELDS = ("max_turns", "current_turn", "remaining_turns", "observation")
REQUIRED_SYSTEM_FIELDS = ("instructions", "max_turns")
BUDGET_FIELDS = ("max_turns", "current_turn", "remaining_turns")
PRESENTATIONS = ("exact", "hidden", "approximate")
"""How a budget can be shown (:class:`BudgetPresentation`); ``mixed`` draws one per group."""
MIXED = "mixed"
HIDDEN = 0
"""The shown budget that means "no budget shown" (:meth:`BudgetPrompt.turn_text`)."""

_MARK = "\u2063RESPONSE\u2063"  # invisible separator: never produced by a chat template


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


@dataclasses.dataclass(frozen=True)
class BudgetPrompt:
    """Templates of the system prompt and of every turn's user message."""

    system: str = (
        "{instructions}\n\n"
        "You have at most {max_turns} turns to finish the task. Each turn you see the current "
        "state and reply with one action; the episode ends when you succeed, fail, or run out "
        "of turns."
    )
    turn: str = (
        "[MAX TURNS] {max_turns} [CURRENT TURN] {current_turn} "
        "[REMAINING TURNS] {remaining_turns}\n{observation}"
    )
    # the hidden presentation: the same texts without the budget (no budget field allowed)
    hidden_system: str = "{instructions}"
    hidden_turn: str = "{observation}"

    def __post_init__(self):
        for field, required in (
            ("hidden_system", ("instructions",)),
            ("hidden_turn", ("observation",)),
        ):
            template = getattr(self, field)
            try:
                names = _fields(template)
            except ValueError as error:
                raise ValueError(f"BudgetPrompt.{field}: not a format string: {error}") from None
            if names != set(required):
                raise ValueError(
                    f"BudgetPrompt.{field} must contain {{{required[0]}}} and no other field "
                    f"(it shows no budget), got {sorted(names)}"
                )
        for field, required in (("system", REQUIRED_SYSTEM_FIELDS), ("turn", REQUIRED_TURN_FIELDS)):
            template = getattr(self, field)
            try:
                names = _fields(template)
            except ValueError as error:
                raise ValueError(f"BudgetPrompt.{field}: not a format string: {error}") from None
            missing = [f"{{{n}}}" for n in required if n not in names]
            unknown = sorted(names - set(required) - set(REQUIRED_TURN_FIELDS))
            if missing:
                raise ValueError(f"BudgetPrompt.{field} must contain {', '.join(missing)}")
            if unknown:
                raise ValueError(f"BudgetPrompt.{field} has unknown fields {unknown}")

    def system_text(self, instructions: str, budget: int, shown: int | None = None) -> str:
        """The system prompt under budget ``budget``; ``shown``: the budget it states (None:
        ``budget``; :data:`HIDDEN`: none, :attr:`hidden_system`)."""
        _check_budget(budget, 0)
        shown = _check_shown(budget, shown)
        if shown == HIDDEN:
            return self.hidden_system.format(instructions=instructions)
        return self.system.format(instructions=instructions, max_turns=shown)

    def turn_text(self, observation: str, budget: int, turn: int, shown: int | None = None) -> str:
        """The user message of turn ``turn`` (turns already completed) under budget
        ``budget``; ``shown``: the budget it states (None: ``budget``; :data:`HIDDEN`: none,
        :attr:`hidden_turn`; another ``S``: ``S``, turn ``turn``, ``max(S - turn, 0)`` left)."""
        _check_budget(budget, turn)
        shown = _check_shown(budget, shown)
        if shown == HIDDEN:
            return self.hidden_turn.format(observation=observation)
        return self.turn.format(
            observation=observation,
            max_turns=shown,
            current_turn=turn,
            remaining_turns=max(shown - turn, 0),
        )


def _check_shown(budget: int, shown: int | None) -> int:
    if shown is None:
        return budget
    if isinstance(shown, bool) or not isinstance(shown, (int, np.integer)) or shown < 0:
        raise ValueError(f"shown budget must be an int >= 0 (0: hidden), got {shown!r}")
    return int(shown)


@dataclasses.dataclass(frozen=True)
class BudgetPresentation:
    """How the turn budget is shown to the policy (the module docstring): ``mode`` one of
    :data:`PRESENTATIONS` or ``"mixed"``; ``noise``: the approximate budget's relative error
    bound (the shown budget is ``max(1, round(B (1 + e)))``, ``e`` uniform in ``[-noise,
    noise]``, one draw per task group); ``modes``: what ``mixed`` draws from, uniformly, one
    per group."""

    mode: str = "exact"
    noise: float = 0.25
    modes: tuple[str, ...] = PRESENTATIONS

    def __post_init__(self):
        known = PRESENTATIONS + (MIXED,)
        if self.mode not in known:
            raise ValueError(f"presentation.mode: must be one of {list(known)}, got {self.mode!r}")
        noise = self.noise
        if (
            isinstance(noise, bool)
            or not isinstance(noise, (int, float))
            or not math.isfinite(noise)
            or not 0 <= noise < 1
        ):
            raise ValueError(f"presentation.noise: must be a number in [0, 1), got {noise!r}")
        modes = self.modes
        if (
            isinstance(modes, (str, bytes))
            or not isinstance(modes, Sequence)
            or not modes
            or any(m not in PRESENTATIONS for m in modes)
        ):
            raise ValueError(
                f"presentation.modes: must be a non-empty list of {list(PRESENTATIONS)}, "
                f"got {modes!r}"
            )
        object.__setattr__(self, "noise", float(noise))
        object.__setattr__(self, "modes", tuple(modes))

    @classmethod
    def from_value(cls, value: Any) -> "BudgetPresentation":
        """A presentation from a config value: itself, a mode name, or ``{mode, noise,
        modes}``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(mode=value)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"mode", "noise", "modes"})
            if unknown:
                raise ValueError(
                    f"presentation: unknown field {unknown[0]!r}; known: mode, noise, modes"
                    f"{did_you_mean(unknown[0], ('mode', 'noise', 'modes'))}"
                )
            return cls(**value)
        raise ValueError(
            f"presentation: must be a mode ({', '.join(PRESENTATIONS + (MIXED,))}) or "
            f"{{mode, noise, modes}}, got {value!r}"
        )

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    def shown_budgets(self, key: jax.Array, budgets: Any) -> np.ndarray:
        """``int[groups]``: the budget shown to each group whose budget is ``budgets
        [groups]`` (:data:`HIDDEN` for none), drawn with ``key`` (``mixed``: the mode, then
        the approximate error, each group its own)."""
        budgets = np.asarray(budgets, np.int64)
        if self.exact:
            return budgets.copy()
        key_mode, key_noise = jax.random.split(key)
        groups = budgets.shape[0]
        if self.mode == MIXED:
            pick = np.asarray(jax.random.randint(key_mode, (groups,), 0, len(self.modes)))
            modes = np.asarray(self.modes)[pick]
        else:
            modes = np.full(groups, self.mode)
        error = np.asarray(
            jax.random.uniform(key_noise, (groups,), minval=-self.noise, maxval=self.noise),
            np.float64,
        )
        approximate = np.maximum(1, np.rint(budgets * (1.0 + error))).astype(np.int64)
        return np.select(
            [modes == "exact", modes == "hidden"], [budgets, np.full(groups, HIDDEN)], approximate
        )


def _check_budget(budget: int, turn: int) -> None:
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if not 0 <= turn < budget:
        raise ValueError(f"turn must be in [0, budget={budget}), got {turn}")


class ChatTokens:
    """Token pieces of a chat conversation, cut from the tokenizer's chat template.

    ``enable_thinking`` is Qwen3's switch: False makes every generation prompt end with an
    empty ``<think></think>`` block.
    """

    def __init__(self, tokenizer, *, enable_thinking: bool = False):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        render = lambda messages: tokenizer.apply_chat_template(  # noqa: E731
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        one = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        two = one + [{"role": "assistant", "content": _MARK}, {"role": "user", "content": "V"}]
        text = render(two)
        if text.count(_MARK) != 1:
            raise ValueError("the chat template does not render assistant content verbatim")
        after = text[text.index(_MARK) + len(_MARK) :]
        # What closes an assistant turn (e.g. "<|im_end|>") is the text up to the next user
        # message's header; the header is what ``render([user "V"])`` starts with.
        next_turn = render([{"role": "user", "content": "V"}])
        start = after.find(next_turn[: next_turn.index("V")])
        if start < 0:
            raise ValueError("cannot locate the user turn after an assistant turn in the template")
        self._end_text, self._next_template = after[:start], after[start:].replace("V", "{user}", 1)
        self.end_of_turn: tuple[int, ...] = tuple(self._encode(self._end_text.rstrip("\n")))
        self._separator = self._end_text[len(self._end_text.rstrip("\n")) :]
        if not self.end_of_turn:
            raise ValueError("the chat template closes assistant turns with no token")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a response: the end-of-turn token(s) and the tokenizer's EOS."""
        ids = set(self.end_of_turn[-1:])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def first_prompt(self, system: str, user: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return self._encode(
            self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=self.enable_thinking,
            )
        )

    def next_prompt(self, user: str) -> list[int]:
        """Tokens after a closed assistant turn: separator, the user message, generation prompt."""
        return self._encode(self._separator + self._next_template.format(user=user))

    def close_response(self, response_ids: Sequence[int]) -> list[int]:
        """Tokens to append after a response so its turn is closed (empty if it already is)."""
        n = len(self.end_of_turn)
        return [] if tuple(response_ids[-n:]) == self.end_of_turn else list(self.end_of_turn)
