"""Continuous batching over the paged engine: many independent requests share one decode.

:class:`ServingEngine` owns one paged KV cache of ``slots`` rows
(:class:`~agentrl_jax.sampling.Sampler`) and a thread that loops:

1. **weights**: parameters handed to :meth:`ServingEngine.set_params` replace the ones decode
   reads (between two decode calls; cached conversations made by the old ones are dropped);
2. **seat**: waiting requests take free rows. A request whose prompt extends a row's cached
   tokens (an earlier turn of the same conversation: its prompt and the completion it got)
   appends only the new tokens to that row; any other is prefilled into the row unused the
   longest; a request for ``n`` choices prefills once and copies the row ``n - 1`` times.
   All prefills of one iteration are one :func:`~agentrl_jax.sampling.append_rows` call;
3. **decode** at most ``chunk`` tokens for the rows that share one sampling setting (the one
   waiting longest), then hand each row's new tokens to its request. Row ``b`` draws its
   ``t``-th token with ``fold_in(key_b, t)`` however its tokens were split into calls
   (:func:`~agentrl_jax.sampling.decode`'s ``offset``), so a completion is the one a single
   :meth:`Sampler.decode` with that key samples, whichever requests shared its batches.

Every program has a static shape: decode ``[slots, chunk]`` (one per sampling setting, at most
``max_sampling_configs`` of them), prefills ``[k, w]`` for powers of two ``k`` and the chunk
widths ``w`` of :func:`~agentrl_jax.sampling.scheduler.width_buckets`. The pool holds every row
at ``max_context`` tokens, so no row is ever preempted. The largest buffers: the pool, 2 x
layers x KV heads x head_dim x ``slots x max_context`` in the cache dtype, and decode's
``[slots, V]`` float32 logits.

A request's rows, tokens and log-probs come back as events (:class:`Event`) through its
``emit`` callback, called from the engine thread; a request is cancelled by
:meth:`Request.cancel` (its rows stop at the next iteration and keep their cache).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from agentrl_jax.models.qwen3 import Qwen3ForCausalLM
from agentrl_jax.sampling.filters import SamplingConfig
from agentrl_jax.sampling.jitted import Sampler
from agentrl_jax.sampling.padding import pad_rows
from agentrl_jax.sampling.policy import TokenMap
from agentrl_jax.sampling.sampler import Paging, StopReason
from agentrl_jax.sampling.scheduler import width_buckets
from agentrl_jax.sharding import generation_params

TOP_LOGPROBS = 20  # alternatives recorded per token when a request asks for any (OpenAI's most)


class EngineBusy(RuntimeError):
    """The engine's queue is full (the server answers 429)."""


class EngineLimit(ValueError):
    """A request the engine cannot take as it is configured (the server answers 400)."""


@dataclasses.dataclass
class Choice:
    """One choice of a request as it is decoded (host copies; tokenizer ids)."""

    index: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # model, temperature 1
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)  # as drawn
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # [M, k] per token
    # with the request's top_logprobs: per token, the TOP_LOGPROBS most likely tokenizer ids
    # and their log-probs under the model
    top: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    cancelled: bool = False


@dataclasses.dataclass(frozen=True)
class Event:
    """``kind``: ``"tokens"`` (``choice`` got ``count`` new tokens: the last ``count`` of
    ``request.choices[choice]``), ``"done"`` (``choice`` finished) or ``"error"``
    (``message``; the request is over)."""

    kind: str
    choice: int = 0
    count: int = 0
    message: str = ""


@dataclasses.dataclass(eq=False)
class Request:
    """What the engine is asked: ``prompt`` (tokenizer ids), ``n`` choices of at most
    ``max_tokens`` tokens each, drawn by ``sampling`` with key data ``keys [n, 2]`` (uint32,
    one key per choice). ``emit(event)`` is called from the engine thread."""

    prompt: Sequence[int]
    n: int
    max_tokens: int
    sampling: SamplingConfig
    keys: np.ndarray
    emit: Callable[[Event], None] = lambda event: None
    top_logprobs: bool = False  # record each token's TOP_LOGPROBS most likely alternatives
    choices: list[Choice] = dataclasses.field(default_factory=list)
    weight_version: int = -1  # the parameters' version when the request was seated
    reused_tokens: int = 0  # prompt tokens found cached (not prefilled again)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.choices = [Choice(i) for i in range(self.n)]

    def cancel(self, choice: int | None = None) -> None:
        """Stop ``choice`` (None: every choice) at the engine's next iteration."""
        for c in self.choices if choice is None else [self.choices[choice]]:
            c.cancelled = True

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class ServingEngine:
    """Continuous batching of :class:`Request` s over one paged cache (module docstring).

    ``stop_token_ids``: tokenizer ids that end a completion (the chat template's end of turn
    and EOS); ``token_map``: a small model's ids (:class:`~agentrl_jax.sampling.TokenMap`);
    ``slots``: rows decoded together; ``max_context``: tokens a row holds (prompt and
    completion); ``chunk``: tokens per decode call (new requests join between calls);
    ``max_queue``: requests waiting for rows before :meth:`submit` refuses
    (:class:`EngineBusy`); ``max_sampling_configs``: distinct sampling settings served (each
    compiles its decode once; one more is refused, :class:`EngineLimit`)."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        params: Any = None,
        *,
        stop_token_ids: Sequence[int],
        token_map: TokenMap | None = None,
        slots: int = 32,
        max_context: int = 2048,
        chunk: int = 16,
        page_size: int = 16,
        cache_dtype: Any = None,
        max_queue: int = 256,
        max_sampling_configs: int = 8,
        device: Any = None,
    ):
        for name, value, low in (
            ("slots", slots, 1),
            ("max_context", max_context, 2),
            ("chunk", chunk, 1),
            ("max_queue", max_queue, 1),
            ("max_sampling_configs", max_sampling_configs, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ServingEngine: {name} must be an int >= {low}, got {value!r}")
        self.model, self.token_map = model, token_map
        self.slots, self.max_context, self.chunk = slots, max_context, chunk
        self.max_queue, self.max_sampling_configs = max_queue, max_sampling_configs
        self.device = device or jax.local_devices()[0]
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.sampler = Sampler(
            model,
            max_new_tokens=chunk,
            stop_token_ids=tuple(int(i) for i in self._to_model(self.stop_token_ids)),
            device=self.device,
            paging=Paging(page_size=page_size),
        )
        self.cache_dtype = cache_dtype
        self._params = self._place(nnx.state(model) if params is None else params)
        self.weight_version = 0
        self._pending_params: tuple[Any, int] | None = None
        self._state = None
        # per row: the request and choice it serves (None: free), its cached tokenizer ids,
        # when it was last used, its key and the tokens its choice has so far
        self._row_request: list[tuple[Request, int] | None] = [None] * slots
        self._row_tokens: list[list[int]] = [[] for _ in range(slots)]
        self._row_used = np.zeros(slots)
        self._row_waited = np.zeros(slots, np.int64)
        self._keys = np.zeros((slots, 2), np.uint32)
        self._configs: list[SamplingConfig] = []
        self._waiting: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = collections.Counter()  # decode_calls, prefill_calls, reused/prefilled tokens

    # -- public, any thread
    def start(self) -> "ServingEngine":
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="serving-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "ServingEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def check(self, request: Request) -> None:
        """Raises :class:`EngineLimit` for a request this engine can never serve."""
        if not 1 <= request.n <= self.slots:
            raise EngineLimit(f"n must be between 1 and {self.slots} (the engine's rows)")
        if not request.prompt:
            raise EngineLimit("the prompt is empty")
        if len(request.prompt) >= self.max_context:
            raise EngineLimit(
                f"the prompt has {len(request.prompt)} tokens; this model's context holds "
                f"{self.max_context} (prompt and completion)"
            )
        self._to_model(request.prompt)  # a token map without these ids: refused here
        config = (request.sampling, request.top_logprobs)
        if config not in self._configs and len(self._configs) >= self.max_sampling_configs:
            raise EngineLimit(
                f"this server serves at most {self.max_sampling_configs} distinct sampling "
                f"settings (temperature, top_p), each compiled once; in use: "
                + ", ".join(f"({c.temperature}, {c.top_p})" for c, _ in self._configs)
            )

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (checked by :meth:`check`); :class:`EngineBusy` when
        ``max_queue`` requests already wait."""
        self.check(request)
        with self._cond:
            if (request.sampling, request.top_logprobs) not in self._configs:
                self._configs.append((request.sampling, request.top_logprobs))
            if len(self._waiting) >= self.max_queue:
                raise EngineBusy(f"{len(self._waiting)} requests are waiting; try again later")
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def set_params(self, params: Any, version: int | None = None) -> None:
        """Decode with ``params`` from the next iteration on (placed on the engine's
        device); ``version``: their number (default: one more)."""
        placed = self._place(params)
        with self._cond:
            number = self.weight_version + 1 if version is None else int(version)
            self._pending_params = (placed, number)
            self._cond.notify_all()

    def wait_params(self, timeout: float = 60.0) -> None:
        """Block until parameters given to :meth:`set_params` are the ones decode reads."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending_params is not None:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("the engine did not take the new parameters in time")

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -- the engine thread
    def _place(self, params: Any) -> Any:
        return generation_params(params, None, "replicated", self.device, dtype=self.model.dtype)

    def _to_model(self, ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        if self.token_map is not None:
            try:
                return self.token_map.to_model(ids)
            except ValueError as error:
                raise EngineLimit(str(error)) from None
        if ids.size and (ids.min() < 0 or ids.max() >= self.model.config.vocab_size):
            raise EngineLimit("a token id is outside the model's vocabulary")
        return ids.astype(np.int32)

    def _to_tokenizer(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.token_map is None else self.token_map.to_tokenizer(ids)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._stopping
                    and self._pending_params is None
                    and not self._waiting
                    and not self._busy_rows()
                ):
                    self._cond.wait()
                if self._stopping:
                    break
                pending, self._pending_params = self._pending_params, None
                seating = self._take_seatable()
                if pending is not None:
                    self._cond.notify_all()
            try:
                if self._state is None:
                    self._state = self.sampler.init(self.slots, self.max_context, self.cache_dtype)
                if pending is not None:
                    self._params, self.weight_version = pending
                    self._forget_idle()  # their caches hold the old parameters' keys
                if seating:
                    self._seat(seating)
                if self._busy_rows():
                    self._decode()
            except Exception as error:  # noqa: BLE001  (every request fails, the engine goes on)
                self._fail_all(f"the engine failed: {type(error).__name__}: {error}")
        self._fail_all("the server is shutting down")

    def _busy_rows(self) -> list[int]:
        return [r for r, owner in enumerate(self._row_request) if owner is not None]

    def _take_seatable(self) -> list[Request]:
        """Waiting requests (oldest first) that fit the free rows (called under the lock)."""
        free = self.slots - len(self._busy_rows())
        taken = []
        while self._waiting and self._waiting[0].n <= free:
            request = self._waiting.popleft()
            if all(c.cancelled for c in request.choices):
                for c in request.choices:
                    c.finish_reason = "abort"
                    request.emit(Event("done", c.index))
                continue
            taken.append(request)
            free -= request.n
        return taken

    def _fail_all(self, message: str) -> None:
        owners = {id(o[0]): o[0] for o in self._row_request if o is not None}
        with self._cond:
            owners.update({id(r): r for r in self._waiting})
            self._waiting.clear()
        for request in owners.values():
            request.emit(Event("error", message=message))
        self._row_request = [None] * self.slots
        self._row_tokens = [[] for _ in range(self.slots)]
        self._state = None  # a fresh cache at the next iteration

    def _forget_idle(self) -> None:
        idle = np.array(
            [o is None and bool(t) for o, t in zip(self._row_request, self._row_tokens)]
        )
        if idle.any():
            self._state = self.sampler.release(self._state, idle)
            for r in np.flatnonzero(idle):
                self._row_tokens[r] = []

    def _seat(self, requests: list[Request]) -> None:
        free = [r for r in range(self.slots) if self._row_request[r] is None]
        prefill: list[tuple[int, list[int]]] = []  # (row, tokens to append)
        copies: list[tuple[int, int]] = []  # (dst, src)
        release = np.zeros(self.slots, bool)
        for request in requests:
            prompt = list(request.prompt)
            row, reused = self._cached_prefix(prompt, free)
            if row is None:
                row = min(free, key=lambda r: (len(self._row_tokens[r]) > 0, self._row_used[r]))
                reused = 0
                release[row] = bool(self._row_tokens[row])
            free.remove(row)
            if len(prompt) > reused:
                prefill.append((row, prompt[reused:]))
            rows = [row]
            for _ in range(request.n - 1):
                other = min(free, key=lambda r: (len(self._row_tokens[r]) > 0, self._row_used[r]))
                free.remove(other)
                release[other] = bool(self._row_tokens[other])
                copies.append((other, row))
                rows.append(other)
            request.weight_version, request.reused_tokens = self.weight_version, reused
            self.stats["reused_tokens"] += reused
            self.stats["prefilled_tokens"] += len(prompt) - reused
            for choice, r in enumerate(rows):
                self._row_request[r] = (request, choice)
                self._row_tokens[r] = list(prompt)
                self._row_used[r] = time.perf_counter()
                self._row_waited[r] = 0
                self._keys[r] = request.keys[choice]
        if release.any():
            self._state = self.sampler.release(self._state, release)
        if prefill:
            size = 1 << max(len(prefill) - 1, 0).bit_length()
            size = min(size, self.slots)
            tokens, mask = pad_rows(
                [self._to_model(t) for _, t in prefill] + [[]] * (size - len(prefill)),
                width_buckets(self.max_context),
            )
            index = np.full(size, -1, np.int32)
            index[: len(prefill)] = [r for r, _ in prefill]
            self._state = self.sampler.append_rows(self._params, self._state, index, tokens, mask)
            self.stats["prefill_calls"] += 1
        if copies:
            size = min(1 << max(len(copies) - 1, 0).bit_length(), self.slots)
            dst, src = np.full(size, -1, np.int32), np.zeros(size, np.int32)
            dst[: len(copies)], src[: len(copies)] = zip(*copies)
            self._state = self.sampler.copy_rows(self._state, dst, src)

    def _cached_prefix(self, prompt: list[int], free: list[int]) -> tuple[int | None, int]:
        """The free row whose cached tokens are the longest prefix of ``prompt`` (all of it
        at most), and their count; ``(None, 0)`` if none."""
        best, length = None, 0
        for r in free:
            cached = self._row_tokens[r]
            if length < len(cached) <= len(prompt) and prompt[: len(cached)] == cached:
                best, length = r, len(cached)
        return best, length

    def _decode(self) -> None:
        busy = self._busy_rows()
        for r in busy:  # cancelled choices end here, their rows freed (caches kept)
            request, choice = self._row_request[r]
            if request.choices[choice].cancelled:
                self._finish(r, "abort")
        busy = self._busy_rows()
        if not busy:
            return
        first = max(busy, key=lambda r: self._row_waited[r])  # the longest waiting setting
        group = self._row_request[first][0]
        sampling, top = group.sampling, group.top_logprobs
        active = np.zeros(self.slots, bool)
        budget = np.zeros(self.slots, np.int32)
        offset = np.zeros(self.slots, np.int32)
        for r in busy:
            request, choice = self._row_request[r]
            if (request.sampling, request.top_logprobs) != (sampling, top):
                self._row_waited[r] += 1
                continue
            done = len(request.choices[choice].tokens)
            active[r], offset[r] = True, done
            budget[r] = min(self.chunk, request.max_tokens - done)
            self._row_waited[r] = 0
        self._state, out = self.sampler.decode(
            self._params,
            self._state,
            self._keys,
            sampling,
            budget,
            active,
            offset,
            top_logprobs=TOP_LOGPROBS if top else 0,
        )
        self.stats["decode_calls"] += 1
        out = jax.device_get(out)  # one transfer of every output field
        for r in np.flatnonzero(active):
            request, index = self._row_request[r]
            choice, count = request.choices[index], int(out.lengths[r])
            new = self._to_tokenizer(out.tokens[r, :count]).tolist()
            choice.tokens += new
            choice.logprobs += out.log_probs[r, :count].tolist()
            choice.sampling_logprobs += out.sampling_log_probs[r, :count].tolist()
            if out.experts is not None:
                choice.experts += list(out.experts[r, :count])
            if out.top_ids is not None:
                ids = self._to_tokenizer(out.top_ids[r, :count].reshape(-1)).reshape(count, -1)
                choice.top += list(zip(ids, out.top_log_probs[r, :count]))
            self._row_tokens[r] += new
            self._row_used[r] = time.perf_counter()
            if count:
                request.emit(Event("tokens", index, count))
            if out.stop_reason[r] == StopReason.STOP_TOKEN:
                self._finish(r, "stop")
            elif len(choice.tokens) >= request.max_tokens or out.stop_reason[r] in (
                StopReason.CONTEXT_FULL,
                StopReason.NO_PAGE,
                StopReason.NOT_RUN,
            ):
                self._finish(r, "length")

    def _finish(self, row: int, reason: str) -> None:
        request, index = self._row_request[row]
        self._row_request[row] = None
        choice = request.choices[index]
        if choice.finish_reason is None:
            choice.finish_reason = reason
            request.emit(Event("done", index))
