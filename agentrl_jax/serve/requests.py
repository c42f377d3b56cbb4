"""A chat request's body checked field by field: each bad field is an OpenAI-shaped error
(:class:`ApiError`) naming it (``param``), never an exception the server did not expect."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 4


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``message``, ``type``, ``param``, ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def number(
    body: Mapping, name: str, default: float, low: float, high: float, *, open_low=False
) -> float:  # noqa: E501
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"must be a number, got {json.dumps(value)[:60]}", "invalid_type")
    if value > high or value < low or (open_low and value == low):
        side = "(" if open_low else "["
        raise bad(name, f"must be in {side}{low}, {high}], got {value}")
    return float(value)


def integer(body: Mapping, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {json.dumps(value)[:60]}", "invalid_type")
    if not low <= value <= high:
        raise bad(name, f"must be between {low} and {high}, got {value}")
    return value


def flag(body: Mapping, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"must be a boolean, got {json.dumps(value)[:60]}", "invalid_type")
    return value


def check_messages(messages: Any) -> list[dict]:
    """The request's messages, checked (roles, content types, tool calls)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array of messages", "invalid_type")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, "must be an object", "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r:.60}")
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):  # noqa: E501
                    raise bad(f"{where}.content", "only text parts are supported", "invalid_type")
        elif content is not None and not isinstance(content, str):
            raise bad(
                f"{where}.content",
                "must be a string, an array of text parts or null",
                "invalid_type",
            )
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(
                    f"{where}.tool_calls",
                    "only an assistant message has tool calls, as an array",
                    "invalid_type",
                )  # noqa: E501
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not (
                    isinstance(function, dict)
                    and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments", "{}"), (str, dict))
                ):
                    raise bad(
                        f"{where}.tool_calls[{j}]",
                        "needs function.name and function.arguments",
                        "invalid_type",
                    )  # noqa: E501
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise bad(f"{where}.{key}", "must be a string", "invalid_type")
        role = "system" if role == "developer" else role
        out.append({**message, "role": role})
    return out


def check_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "must be an array", "invalid_type")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type", "function") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("parameters", {}), dict)
        ):
            raise bad(
                f"tools[{i}]",
                "must be {type: function, function: {name, parameters}}",
                "invalid_type",
            )
    return tools or None
