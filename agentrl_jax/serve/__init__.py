"""Serving the policy to agent programs: an OpenAI-compatible server over the paged engine
(:mod:`.server`; each request checked field by field, :mod:`.requests`), continuous batching
(:mod:`.engine`), chat rendering without re-tokenising what the model wrote (:mod:`.chat`),
the per-episode token record (:mod:`.episodes`) and RL on agent programs (:mod:`.agents`)."""

from agentrl_jax.serve.chat import ChatRenderer, parse_reply
from agentrl_jax.serve.engine import EngineBusy, EngineLimit, Request, ServingEngine
from agentrl_jax.serve.episodes import EpisodeStore, Turn, episode_row
from agentrl_jax.serve.server import PolicyServer, make_app, serve_in_thread

__all__ = [
    "ChatRenderer",
    "EngineBusy",
    "EngineLimit",
    "EpisodeStore",
    "PolicyServer",
    "Request",
    "ServingEngine",
    "Turn",
    "episode_row",
    "make_app",
    "parse_reply",
    "serve_in_thread",
]
