"""Chat messages to tokens and replies back to messages, for the OpenAI-compatible server.

The server never re-tokenises what the model wrote. A request's messages become prompt tokens
in one of two ways (:class:`ChatRenderer`):

* **fresh**: the whole conversation rendered by the tokenizer's chat template
  (:meth:`ChatRenderer.prompt`);
* **continued**: when the messages are an earlier turn's messages, then that turn's reply as
  the server returned it, then new messages (tool results, a user message), the prompt is the
  earlier turn's exact tokens (its prompt and its sampled completion), then the tokens that
  close that reply and render the new messages (:meth:`ChatRenderer.continuation`).

The continuation's text is cut from the template itself, as :class:`~agentrl_jax.prompts.
ChatTokens` cuts a turn: the new messages rendered after a marker assistant message, read
from the end of the marker on. So whatever the template does to old assistant messages
(Qwen3's drops their ``<think>`` blocks) never changes the tokens the policy saw.

Replies: Qwen3 writes tool calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` blocks (:func:`parse_reply`); a block that is not such JSON stays in the
content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

_MARK = "\u2063agentrl-jax-serve-marker\u2063"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_reply(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a reply's text: each well-formed ``<tool_call>`` block
    (a JSON object with a string ``name`` and an object ``arguments``) becomes a call
    ``{"name", "arguments"}`` (arguments as a JSON string, as OpenAI sends them) and leaves
    the content; the rest, stripped, is the content (None when calls took it all)."""
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except (ValueError, RecursionError):
            continue
        if (
            not isinstance(value, dict)
            or not isinstance(value.get("name"), str)
            or not isinstance(value.get("arguments", {}), dict)
        ):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append({"name": value["name"], "arguments": json.dumps(value.get("arguments", {}))})
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content if content or not calls else None), calls


def _arguments(value: Any) -> Any:
    """Tool-call arguments compared by value: a JSON string parsed (else kept as text)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def reply_key(content: Any, tool_calls: Sequence[Mapping[str, Any]] | None) -> str:
    """A canonical form of an assistant message (its content and its calls' names and
    arguments; ids and types ignored): a client that sends back the reply it was given
    matches it however it re-serialised it."""
    calls = []
    for call in tool_calls or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        if not isinstance(function, Mapping):
            function = {}
        calls.append([function.get("name"), _arguments(function.get("arguments"))])
    text = content if isinstance(content, str) else ""
    return json.dumps([text.strip(), calls], sort_keys=True, default=str)


def message_key(message: Mapping[str, Any]) -> str:
    """A canonical form of any message (an assistant's by :func:`reply_key`)."""
    if message.get("role") == "assistant":
        return "assistant:" + reply_key(message.get("content"), message.get("tool_calls"))
    return json.dumps(
        {k: message.get(k) for k in ("role", "content", "name", "tool_call_id")},
        sort_keys=True,
        default=str,
    )


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI message as the chat template reads it: content as text (a list of text
    parts joined), an assistant's tool calls as ``{"name", "arguments"}`` functions."""
    out: dict[str, Any] = {"role": message["role"]}
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    out["content"] = content if isinstance(content, str) else ""
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"].get("arguments", "{}")),
                },
            }
            for call in message["tool_calls"]
        ]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


class ChatRenderer:
    """Prompt tokens of chat requests (module docstring) for a tokenizer with a chat template.

    ``enable_thinking``: Qwen3's switch (False: every generation prompt ends with an empty
    think block, as the built-in rollouts use)."""

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = False):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        probe = self._render(
            [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARK}],
            None,
            generation=False,
        )
        if probe.count(_MARK) != 1:
            raise ValueError("the chat template does not render assistant content verbatim")
        # what the template writes after an assistant's content: its end of turn and separator
        self.closing = probe[probe.index(_MARK) + len(_MARK) :]

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Any, *, generation: bool):
        return self.tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation,
            enable_thinking=self.enable_thinking,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
        """The whole conversation's tokens, ending with the generation prompt."""
        return self.encode(self._render(messages, tools, generation=True))

    def continuation(
        self, tail: Sequence[Mapping[str, Any]], *, closed_by: str | None
    ) -> list[int]:
        """Tokens after an assistant reply the server sampled: what closes the reply (less
        ``closed_by``, the text of the stop token the model itself ended it with, if any),
        the ``tail`` messages (tool results, user messages) and the generation prompt."""
        text = self._render(
            [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARK}, *tail],
            None,
            generation=True,
        )
        after = text[text.index(_MARK) + len(_MARK) :]
        if closed_by and after.startswith(closed_by):
            after = after[len(closed_by) :]
        return self.encode(after)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
