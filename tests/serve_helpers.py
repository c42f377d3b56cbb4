"""A tiny Qwen3 served over HTTP for the policy server's tests: the real Qwen3 tokenizer and chat
template, a vocabulary cut to the ids the tests' conversations use (a TokenMap), and weights
that learned one tool call by heart, so a greedy completion is a real ``<tool_call>`` block."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_fakes import tiny_model

from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.prompts import ChatTokens
from agentrl_jax.sampling import TokenMap
from agentrl_jax.serve import ChatRenderer, PolicyServer, ServingEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one cell.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": ["Left", "Right"]}},
            },
        },
    }
]
ASK = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Where now?"}]
CALL = '<tool_call>\n{"name": "move", "arguments": {"direction": "Right"}}\n</tool_call>'
TEXTS = [
    "hello there, how are you? Tell me a story.",
    "Moved. You are at the goal. ok again more words stop here please",
    "{}[]:,\"' 0123456789 abcdefghijklmnopqrstuvwxyz",
]


@functools.lru_cache(maxsize=1)
def tokenizer():
    return load_tokenizer()


def token_map(tok) -> TokenMap:
    render = ChatRenderer(tok)
    texts = [
        tok.apply_chat_template(
            ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False
        ),
        CALL,
        *TEXTS,
        render.decode(render.continuation([{"role": "tool", "content": TEXTS[1]}], closed_by=None)),
        render.decode(render.continuation([{"role": "user", "content": TEXTS[0]}], closed_by=None)),
    ]
    stops = ChatTokens(tok).stop_token_ids
    return TokenMap.from_texts(tok, texts, extra_ids=stops)


@functools.lru_cache(maxsize=1)
def tool_model():
    """``(model, token_map)``: a tiny Qwen3 that answers ``ASK`` (with ``TOOLS``) with ``CALL``
    and its end of turn, greedily (memorised by 150 Adam steps)."""
    tok = tokenizer()
    tmap = token_map(tok)
    stops = ChatTokens(tok).stop_token_ids
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model = tiny_model(
        seed=1,
        vocab_size=len(tmap),
        hidden_size=32,
        intermediate_size=64,
        eos_token_ids=tuple(int(i) for i in tmap.to_model(list(stops))),
    )
    render = ChatRenderer(tok)
    prompt = render.prompt(ASK, TOOLS)
    reply = render.encode(CALL) + [im_end]
    ids = jnp.asarray(tmap.to_model(prompt + reply))[None]
    target = np.zeros(ids.shape[1], bool)
    target[len(prompt) :] = True
    positions = jnp.arange(ids.shape[1])[None]
    graphdef, params = nnx.split(model)
    optimizer = optax.adam(3e-2)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(ids, positions, jnp.ones_like(ids, bool))
        logp = jax.nn.log_softmax(logits[0, :-1])
        picked = jnp.take_along_axis(logp, ids[0, 1:, None], 1)[:, 0]
        return -jnp.sum(jnp.where(jnp.asarray(target[1:]), picked, 0.0))

    @jax.jit
    def step(p, opt):
        value, grad = jax.value_and_grad(loss)(p)
        updates, opt = optimizer.update(grad, opt)
        return optax.apply_updates(p, updates), opt, value

    opt = optimizer.init(params)
    for _ in range(150):
        params, opt, value = step(params, opt)
    assert float(value) < 0.05, float(value)
    return nnx.merge(graphdef, params), tmap


def teacher_forced_rows(model, tmap, ids: list[int]) -> np.ndarray:
    """``[len(ids) - 1, V]``: log p(. | ids[: t + 1]) under ``model`` (float32, model ids)."""
    tokens = jnp.asarray(tmap.to_model(ids))[None]
    logits, _ = model(tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens, bool))
    return np.asarray(jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32)))


def teacher_forced(model, tmap, ids: list[int]) -> np.ndarray:
    """``[len(ids) - 1]``: log p(ids[t + 1] | ids[: t + 1]) under ``model`` (float32)."""
    rows = teacher_forced_rows(model, tmap, ids)
    return rows[np.arange(len(ids) - 1), tmap.to_model(ids[1:])]


def make_server(slots: int = 8, **options) -> PolicyServer:
    tok = tokenizer()
    model, tmap = tool_model()
    engine = ServingEngine(
        model,
        stop_token_ids=ChatTokens(tok).stop_token_ids,
        token_map=tmap,
        slots=slots,
        max_context=options.pop("max_context", 512),
        chunk=options.pop("chunk", 8),
        max_queue=options.pop("max_queue", 256),
    )
    return PolicyServer(engine, tok, model_name="tiny", max_tokens=32, **options)


def as_json(message) -> dict:
    return json.loads(message.model_dump_json(exclude_none=True))
