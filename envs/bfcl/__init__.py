"""BFCL v3 multi-turn function calling (tasks and APIs from the PyPI package ``bfcl-eval``)."""

from envs.bfcl.calls import ApiSet, Call, Calls, Malformed, NoCall, parse_call, parse_response
from envs.bfcl.data import CATEGORIES, BfclTask, Message, load_tasks, package_data_dir
from envs.bfcl.env import BfclConfig, BfclEnv, Episode, official_checkers, reference_responses
from envs.bfcl.tasks import make_tasks  # noqa: E402
from envs.registry import register  # noqa: E402

register("bfcl", make_tasks, label="BFCL v3 multi-turn", max_response_tokens=512, max_context=16384)

__all__ = [
    "CATEGORIES",
    "ApiSet",
    "BfclConfig",
    "BfclEnv",
    "BfclTask",
    "Call",
    "Calls",
    "Episode",
    "Malformed",
    "Message",
    "NoCall",
    "load_tasks",
    "official_checkers",
    "package_data_dir",
    "parse_call",
    "parse_response",
    "reference_responses",
]
