"""The budget-aware prompt (paper §6) and the chat tokens of a multi-turn conversation.

Wording lives in one :class:`BudgetPrompt` that users can replace; its templates must mention
the three budget values, which :meth:`BudgetPrompt.__post_init__` checks:

* ``{max_turns}``       B, the turn budget of the trajectory,
* ``{current_turn}``    t, the turns already completed (0 at the first turn),
* ``{remaining_turns}`` B - t.

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
import string
from typing import Sequence

REQUIRED_TURN_FIELDS = ("max_turns", "current_turn", "remaining_turns", "observation")
REQUIRED_SYSTEM_FIELDS = ("instructions", "max_turns")

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

    def __post_init__(self):
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

    def system_text(self, instructions: str, budget: int) -> str:
        _check_budget(budget, 0)
        return self.system.format(instructions=instructions, max_turns=budget)

    def turn_text(self, observation: str, budget: int, turn: int) -> str:
        """The user message of turn ``turn`` (turns already completed) under budget ``budget``."""
        _check_budget(budget, turn)
        return self.turn.format(
            observation=observation,
            max_turns=budget,
            current_turn=turn,
            remaining_turns=budget - turn,
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
