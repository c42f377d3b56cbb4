"""The OpenAI-compatible policy server: ``/v1/chat/completions`` over the serving engine.

    server = PolicyServer(model, tokenizer, model_name="policy")
    with serve_in_thread(server) as url:          # http://127.0.0.1:PORT/v1
        client = openai.OpenAI(base_url=url, api_key="-")
        client.chat.completions.create(model="policy", messages=[...], tools=[...])

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``
(``messages``, ``tools`` with ``tool_choice`` ``auto`` or ``none``, ``temperature``, ``top_p``,
``max_tokens`` / ``max_completion_tokens``, ``n``, ``stop``, ``seed``, ``logprobs`` with
``top_logprobs`` (up to 20),
``stream`` with ``stream_options.include_usage``, ``user``), and the extension
``GET /v1/episodes/{id}`` (an episode's recorded turns as token ids). The same routes also
live under ``/episodes/{id}/v1/...``: a client given that base URL tags every request with its
episode without knowing it (the ``X-Episode-Id`` header and the ``user`` field do the same).

Every completion's exact tokens are recorded (:mod:`agentrl_jax.serve.episodes`) and returned in
the extension field ``agentrl`` (prompt and completion ids, both log-probs, the parameters'
version, the turn's index in its episode). A request whose messages continue a turn of its
episode (the earlier messages, then that turn's reply as returned) is prompted with that
turn's tokens plus the new messages' (:mod:`agentrl_jax.serve.chat`), and its row's cache is
reused.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 for a
malformed body, a bad parameter, a prompt longer than the context, ``n`` above the engine's
rows or an unsupported option (``tool_choice`` ``required`` or a named function,
penalties); 401 without the API key (when one is set); 404 for an unknown
model or route; 413 for a body over ``max_body_bytes``; 429 when ``max_queue`` requests wait;
500 (no details) if the engine fails, which then goes on serving. Nothing in a request names a
file: the server reads and writes none.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import secrets
import threading
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from starlette.requests import Request as HttpRequest

from agentrl_jax.sampling.filters import SamplingConfig
from agentrl_jax.serve.chat import ChatRenderer, message_key, parse_reply, reply_key
from agentrl_jax.serve.engine import (
    TOP_LOGPROBS,
    EngineBusy,
    EngineLimit,
    Event,
    Request,
    ServingEngine,
)
from agentrl_jax.serve.episodes import EpisodeStore, Turn
from agentrl_jax.serve.requests import (
    MAX_STOP,
    ApiError,
    bad,
    check_messages,
    check_tools,
    flag,
    integer,
    number,
)


@jax.jit
def _request_key(key: jax.Array, count: int) -> jax.Array:
    """``uint32[2]``: the key data of ``fold_in(key, count)`` (one compiled program instead of
    the dozen small ones an eager ``fold_in`` dispatches on every request; the same bits)."""
    return jax.random.key_data(jax.random.fold_in(key, count))


@functools.partial(jax.jit, static_argnums=1)
def choice_keys(base: jax.Array, n: int) -> jax.Array:
    """``uint32[n, 2]``: the key data of ``fold_in(base, c)`` for choices ``c < n`` (``base``:
    key data ``uint32[2]``); one compiled program per ``n``."""
    key = jax.random.wrap_key_data(base)
    return jax.random.key_data(jax.vmap(lambda c: jax.random.fold_in(key, c))(jnp.arange(n)))


class PolicyServer:
    """The state behind the HTTP routes (module docstring): the engine, the chat renderer,
    the episode store, the served model's name and the limits.

    ``engine``: a :class:`~agentrl_jax.serve.engine.ServingEngine` (started by the server);
    ``api_key``: required as ``Authorization: Bearer <key>`` when given; ``max_body_bytes``:
    the largest request body read; ``max_tokens``: the default (and largest) completion
    length."""

    def __init__(
        self,
        engine: ServingEngine,
        tokenizer: Any,
        *,
        model_name: str = "policy",
        api_key: str | None = None,
        enable_thinking: bool = False,
        max_body_bytes: int = 4 << 20,
        max_tokens: int | None = None,
        store: EpisodeStore | None = None,
        seed: int | None = None,
    ):
        self.engine, self.tokenizer = engine, tokenizer
        self.renderer = ChatRenderer(tokenizer, enable_thinking=enable_thinking)
        self.model_name, self.api_key = model_name, api_key
        self.max_body_bytes = max_body_bytes
        self.max_tokens = max_tokens or engine.max_context
        self.store = store or EpisodeStore()
        self._rng = np.random.default_rng(seed)
        self._episode_keys: dict[str, Any] = {}
        self._requests_in_episode: dict[str, int] = {}
        self._lock = threading.Lock()
        self.created = int(time.time())
        vocab = engine.model.config.vocab_size
        self._valid_vocab = (
            len(tokenizer) if engine.token_map is None and len(tokenizer) < vocab else None
        )

    # -- episodes a trainer opens
    def open_episode(self, episode: str, key: jax.Array) -> None:
        """Sample ``episode``'s requests by keys from ``key`` (request ``i``'s choice ``c``:
        ``fold_in(fold_in(key, i), c)``) unless a request gives a ``seed``: its tokens are then
        a function of the key, never of timing."""
        with self._lock:
            self._episode_keys[episode] = key
            self._requests_in_episode[episode] = 0

    def close_episode(self, episode: str) -> list[Turn]:
        with self._lock:
            self._episode_keys.pop(episode, None)
            self._requests_in_episode.pop(episode, None)
        return self.store.pop(episode)

    def _keys(self, episode: str | None, n: int, seed: int | None) -> np.ndarray:
        with self._lock:
            if seed is not None:
                base = jax.random.key_data(jax.random.key(seed % (1 << 63)))
            elif episode in self._episode_keys:
                count = self._requests_in_episode[episode]
                self._requests_in_episode[episode] = count + 1
                base = _request_key(self._episode_keys[episode], count)
            else:
                return self._rng.integers(0, 1 << 32, size=(n, 2), dtype=np.uint32)
        return np.asarray(choice_keys(base, n), np.uint32)

    # -- a request
    def authorize(self, header: str | None) -> None:
        if self.api_key is None:
            return
        given = (header or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(
                401,
                "Incorrect API key provided.",
                code="invalid_api_key",
                kind="authentication_error",
            )

    def parse(self, raw: bytes) -> dict:
        if len(raw) > self.max_body_bytes:
            raise ApiError(
                413,
                f"the request body is over {self.max_body_bytes} bytes",
                code="request_too_large",
            )
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def check_model(self, name: Any) -> None:
        if not isinstance(name, str):
            raise bad("model", "must be a string", "invalid_type")
        if name != self.model_name:
            raise ApiError(
                404,
                f"The model {name[:100]!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def prepare(self, body: dict, episode: str | None) -> tuple[Request, dict]:
        """The engine request of a chat body, and what the reply needs (checked)."""
        self.check_model(body.get("model"))
        messages = check_messages(body.get("messages"))
        tools = check_tools(body.get("tools"))
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise bad(
                "tool_choice",
                "only 'auto' and 'none' are supported: decoding is not constrained",
                "unsupported_value",
            )
        if choice == "none":
            tools = None
        for name in ("frequency_penalty", "presence_penalty"):
            if number(body, name, 0.0, -2.0, 2.0) != 0.0:
                raise bad(name, "penalties are not supported", "unsupported_value")
        if body.get("logit_bias"):
            raise bad("logit_bias", "is not supported", "unsupported_value")
        temperature = number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = number(body, "top_p", 1.0, 0.0, 1.0, open_low=True)
        n = integer(body, "n", 1, 128) or 1
        if n > self.engine.slots:
            raise bad(
                "n", f"must be at most {self.engine.slots} (the rows this server decodes together)"
            )
        limit = integer(body, "max_completion_tokens", 1, 1 << 30)
        if limit is None:
            limit = integer(body, "max_tokens", 1, 1 << 30)
        seed = integer(body, "seed", -(1 << 63), (1 << 64) - 1)
        logprobs = flag(body, "logprobs")
        top = integer(body, "top_logprobs", 0, TOP_LOGPROBS) or 0
        if top and not logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        stream = flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object", "invalid_type")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if (
            not isinstance(stop, list)
            or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop)
        ):  # noqa: E501
            raise bad(
                "stop", f"must be a string or up to {MAX_STOP} non-empty strings", "invalid_type"
            )
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise bad("user", "must be a string", "invalid_type")
        episode = episode or user
        if episode is not None and (len(episode) > 256 or not episode.isprintable()):
            raise bad("user", "an episode id is at most 256 printable characters")
        prompt, parent, turn_messages = self.prompt(messages, tools, episode)
        max_tokens = min(limit or self.max_tokens, self.max_tokens)
        sampling = SamplingConfig(
            temperature=temperature, top_p=top_p, valid_vocab_size=self._valid_vocab
        )
        request = Request(
            prompt=prompt,
            n=n,
            max_tokens=max_tokens,
            sampling=sampling,
            keys=self._keys(episode, n, seed),
            top_logprobs=top > 0,
        )
        try:
            self.engine.check(request)
        except EngineLimit as error:
            code = "context_length_exceeded" if "context" in str(error) else "invalid_value"
            raise ApiError(400, str(error), param="messages", code=code) from None
        return request, {
            "episode": episode,
            "parent": parent,
            "messages": turn_messages,
            "tools": json.dumps(tools, sort_keys=True),
            "logprobs": logprobs,
            "top_logprobs": top,
            "stream": stream,
            "usage": bool(options.get("include_usage")),
            "stop": stop,
        }

    def prompt(self, messages: list[dict], tools: Any, episode: str | None):
        """``(prompt ids, parent turn or None, canonical messages)``: a continuation of one
        of the episode's turns when the messages extend it, else the template's rendering."""
        keys = tuple(message_key(m) for m in messages)
        tools_key = json.dumps(tools, sort_keys=True)
        if episode is not None:
            turns = self.store.turns(episode)
            for index in range(len(turns) - 1, -1, -1):
                turn = turns[index]
                seen = len(turn.messages)
                if (
                    turn.tools == tools_key
                    and len(keys) > seen + 1
                    and keys[:seen] == turn.messages
                    and keys[seen] == "assistant:" + turn.reply
                    and turn.finish_reason != "abort"
                ):
                    closed_by = (
                        self.tokenizer.decode([int(turn.completion_ids[-1])])
                        if turn.closed
                        else None
                    )
                    tail = self.renderer.continuation(messages[seen + 1 :], closed_by=closed_by)
                    prompt = turn.prompt_ids.tolist() + turn.completion_ids.tolist() + tail
                    return prompt, index, keys
        return self.renderer.prompt(messages, tools), None, keys

    # -- a reply
    def text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.engine.stop_token_ids:
            ids = ids[:-1]
        return self.renderer.decode(ids)

    def cut_at_stop(self, ids: list[int], stop: list[str]) -> tuple[int, str] | None:
        """Where the first stop string ends the completion: ``(tokens kept, text kept)``."""
        text = self.text(ids)
        found = [text.find(s) for s in stop if s in text]
        if not found:
            return None
        position = min(found)
        # the fewest tokens whose text holds a stop string: a prefix that holds one, its
        # longer prefixes hold too, so a bisection (log n decodes, not n)
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            if any(s in self.text(ids[:middle]) for s in stop):
                high = middle
            else:
                low = middle + 1
        return low, text[:position]

    def finish(self, request: Request, index: int, meta: dict) -> dict:
        """Choice ``index``'s message (and record it as a turn): its text cut at a stop
        string, its tool calls parsed."""
        choice = request.choices[index]
        ids = list(choice.tokens)
        reason = choice.finish_reason
        cut = self.cut_at_stop(ids, meta["stop"]) if meta["stop"] else None
        if cut is not None:
            count, text = cut
            ids, reason = ids[:count], "stop"
        else:
            text = self.text(ids)
        content, calls = parse_reply(text) if meta["tools"] != "null" else (text, [])
        closed = bool(ids) and ids[-1] in self.engine.stop_token_ids
        turn = Turn(
            parent=meta["parent"],
            messages=meta["messages"],
            tools=meta["tools"],
            reply=reply_key(content, [{"function": c} for c in calls]),
            prompt_ids=np.asarray(request.prompt, np.int32),
            completion_ids=np.asarray(ids, np.int32),
            logprobs=np.asarray(choice.logprobs[: len(ids)], np.float32),
            sampling_logprobs=np.asarray(choice.sampling_logprobs[: len(ids)], np.float32),
            finish_reason=reason,
            weight_version=request.weight_version,
            closed=closed,
            experts=np.stack(choice.experts[: len(ids)]) if choice.experts and ids else None,
        )
        number = None
        if meta["episode"] is not None and reason != "abort":
            number = self.store.add(meta["episode"], turn)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": c}
                for c in calls
            ]
        finish = "tool_calls" if calls and reason == "stop" else reason
        out = {
            "index": index,
            "message": message,
            "finish_reason": "stop" if finish == "abort" else finish,
            "logprobs": self.logprobs(ids, turn.logprobs, choice.top, meta["top_logprobs"])
            if meta["logprobs"]
            else None,
            "agentrl": {
                "turn": number,
                "completion_token_ids": turn.completion_ids.tolist(),
                "logprobs": turn.logprobs.tolist(),
                "sampling_logprobs": turn.sampling_logprobs.tolist(),
            },
        }
        return out

    def logprobs(self, ids: list[int], values, top: list, count: int) -> dict:
        """OpenAI's ``logprobs.content``: each token's log-prob under the model (temperature
        1) and its ``count`` most likely alternatives."""

        def entry(token: int, value: float) -> dict:
            piece = self.renderer.decode([int(token)])
            return {
                "token": piece,
                "logprob": float(value),
                "bytes": list(piece.encode("utf-8", "replace")),
            }

        content = []
        for t, (token, value) in enumerate(zip(ids, values)):
            alternatives = []
            if count and t < len(top):
                alternatives = [entry(i, v) for i, v in zip(top[t][0][:count], top[t][1][:count])]
            content.append({**entry(token, value), "top_logprobs": alternatives})
        return {"content": content}

    def extension(self, request: Request, meta: dict) -> dict:
        return {
            "episode_id": meta["episode"],
            "parent_turn": meta["parent"],
            "weight_version": request.weight_version,
            "prompt_token_ids": [int(i) for i in request.prompt],
            "reused_prompt_tokens": request.reused_tokens,
        }

    def usage(self, request: Request) -> dict:
        completion = sum(len(c.tokens) for c in request.choices)
        return {
            "prompt_tokens": len(request.prompt),
            "completion_tokens": completion,
            "total_tokens": len(request.prompt) + completion,
        }


def make_app(server: PolicyServer):
    """The ASGI app (FastAPI) of ``server``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(
        title="agentrl-jax policy server", docs_url=None, redoc_url=None, openapi_url=None
    )  # noqa: E501

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error(ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):  # no traceback, no detail leaves the server
        return error(
            ApiError(
                500, "the server failed on this request", code="internal_error", kind="server_error"
            )
        )

    def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    def model_card() -> dict:
        return {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "agentrl-jax",
        }  # noqa: E501

    async def list_models(http: HttpRequest, episode: str | None = None):
        server.authorize(http.headers.get("authorization"))
        return models()

    async def get_model(model: str, http: HttpRequest, episode: str | None = None):
        server.authorize(http.headers.get("authorization"))
        server.check_model(model)
        return model_card()

    async def get_episode(episode_id: str, http: HttpRequest):
        server.authorize(http.headers.get("authorization"))
        turns = server.store.turns(episode_id)
        if not turns:
            raise ApiError(404, "no turns are recorded for this episode", code="not_found")
        return {"episode_id": episode_id, "turns": [t.as_json() for t in turns]}

    async def chat(http: HttpRequest, episode: str | None = None):
        server.authorize(http.headers.get("authorization"))
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > server.max_body_bytes:
            raise ApiError(
                413,
                f"the request body is over {server.max_body_bytes} bytes",
                code="request_too_large",
            )
        raw = b""
        async for part in http.stream():
            raw += part
            if len(raw) > server.max_body_bytes:
                raise ApiError(
                    413,
                    f"the request body is over {server.max_body_bytes} bytes",
                    code="request_too_large",
                )  # noqa: E501
        body = server.parse(raw)
        episode = episode or http.headers.get("x-episode-id")
        request, meta = server.prepare(body, episode)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        request.emit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        try:
            server.engine.submit(request)
        except EngineBusy as e:
            raise ApiError(
                429, str(e), code="rate_limit_exceeded", kind="rate_limit_error"
            ) from None  # noqa: E501
        except EngineLimit as e:
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        ident = f"chatcmpl-{secrets.token_hex(12)}"
        if meta["stream"]:
            return StreamingResponse(
                _stream(server, request, meta, events, ident, http),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            done = set()
            while len(done) < request.n:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        request.cancel()
                        return JSONResponse({}, status_code=499)
                    continue
                if event.kind == "error":
                    raise ApiError(
                        500,
                        "the server failed on this request",
                        code="internal_error",
                        kind="server_error",
                    )  # noqa: E501
                if event.kind == "done":
                    done.add(event.choice)
        except asyncio.CancelledError:
            request.cancel()
            raise
        choices = [server.finish(request, i, meta) for i in range(request.n)]
        body = {
            "id": ident,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": choices,
            "usage": server.usage(request),
            "system_fingerprint": f"weights-v{request.weight_version}",
            "agentrl": server.extension(request, meta),
        }
        return JSONResponse(body)  # plain JSON: FastAPI's encoder walks every token id

    for prefix in ("/v1", "/episodes/{episode}/v1"):
        app.add_api_route(prefix + "/models", list_models, methods=["GET"])
        app.add_api_route(prefix + "/models/{model:path}", get_model, methods=["GET"])
        app.add_api_route(prefix + "/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/episodes/{episode_id}", get_episode, methods=["GET"])
    return app


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _stream(server: PolicyServer, request: Request, meta: dict, events, ident, http):
    """Server-sent chunks: each choice's content as it grows (held back from a ``<tool_call>``
    or a possible stop string on), its tool calls and finish reason at its end, usage last."""
    tools = meta["tools"] != "null"
    hold = max([len(s) for s in meta["stop"]] + [len("<tool_call>") if tools else 1]) - 1
    sent = ["" for _ in range(request.n)]
    created = int(time.time())

    def chunk(index: int, delta: dict, finish: str | None = None, **extra) -> bytes:
        return _sse(
            {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": server.model_name,
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "finish_reason": finish,
                        "logprobs": None,
                        **extra,
                    }
                ],  # noqa: E501
            }
        )

    finished = False
    try:
        for i in range(request.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        done = 0
        while done < request.n:
            event = await events.get()
            if event.kind == "error":
                yield _sse(
                    {
                        "error": ApiError(
                            500,
                            "the server failed on this request",
                            code="internal_error",
                            kind="server_error",
                        ).body()["error"]
                    }
                )  # noqa: E501
                return
            i = event.choice
            if event.kind == "tokens":
                text = server.text(list(request.choices[i].tokens))
                cut = min([text.find(s) for s in meta["stop"] if s in text] + [len(text)])
                if cut < len(text):  # a stop string: the choice ends here
                    request.cancel(i)
                    continue
                safe = text[: max(0, len(text) - hold)]
                if tools:  # the content a tool-calling reply keeps: stripped, no calls
                    safe = safe.split("<tool_call>", 1)[0]
                    safe = safe.strip() if not sent[i] else safe.rstrip()
                if len(safe) > len(sent[i]) and safe.startswith(sent[i]):
                    yield chunk(i, {"content": safe[len(sent[i]) :]})
                    sent[i] = safe
            elif event.kind == "done":
                done += 1
                out = server.finish(request, i, meta)
                message = out["message"]
                content = message.get("content") or ""
                if content.startswith(sent[i]) and len(content) > len(sent[i]):
                    yield chunk(i, {"content": content[len(sent[i]) :]})
                for k, call in enumerate(message.get("tool_calls", [])):
                    yield chunk(i, {"tool_calls": [{"index": k, **call}]})
                yield chunk(i, {}, out["finish_reason"], agentrl=out["agentrl"])
        if meta["usage"]:
            yield _sse(
                {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": server.model_name,
                    "choices": [],
                    "usage": server.usage(request),
                    "agentrl": server.extension(request, meta),
                }
            )
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            request.cancel()  # the client went away: its rows stop at the next iteration


@contextlib.contextmanager
def serve_in_thread(server: PolicyServer, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``server`` (its engine too) on ``host:port`` (0: a free port) in a background
    thread; yields the base URL ``http://host:port/v1``; stops both on exit."""
    import uvicorn

    config = uvicorn.Config(
        make_app(server),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )  # noqa: E501
    web = uvicorn.Server(config)
    thread = threading.Thread(target=web.run, name="policy-server", daemon=True)
    server.engine.start()
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not web.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the policy server did not start on {host}:{port}")
            time.sleep(0.01)
        bound = web.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{bound}/v1"
    finally:
        web.should_exit = True
        thread.join(timeout=30)
        server.engine.stop()
