"""The inference scheduler behind :class:`SamplerPolicy`: a Qwen3 through the jitted sampler
(:mod:`agentrl_jax.sampling.sampler`), whose KV cache carries over from turn to turn. It seats
rows (a group's shared first prompt prefilled once), compacts the cache to the live rows in a
few fixed row buckets, pages (and preempts) on the paged cache, and places the parameters
where decode reads them; see :mod:`agentrl_jax.sampling.policy` for the protocol it serves."""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.models import paged_cache
from agentrl_jax.models.paged_cache import PagedKVCache
from agentrl_jax.models.qwen3 import KVCache, Qwen3ForCausalLM
from agentrl_jax.sampling.config import EngineConfig
from agentrl_jax.sampling.jitted import Sampler
from agentrl_jax.sampling.padding import pad_rows
from agentrl_jax.sampling.policy import PolicySettings, Responses, TokenMap
from agentrl_jax.sampling.sampler import Paging, SamplerState, StopReason
from agentrl_jax.sharding import batch_shards, generation_params, resolve_layout


def take_rows(state: SamplerState, index: jax.Array) -> SamplerState:
    """The rows ``index`` (``int[B']``) of a sampler state, in that order. With a paged
    cache ``index < 0`` gives an empty row, a row's first copy keeps its pages and rows not
    taken free theirs (:func:`agentrl_jax.models.paged_cache.take_rows`)."""
    cache = state.cache
    if isinstance(cache, PagedKVCache):  # a copy the pool has no room for: overflowed
        valid = index >= 0
        source = jnp.where(valid, index, 0)
        taken = paged_cache.take_rows(cache, index)
        lost = taken.lengths != jnp.where(valid, cache.lengths[source], 0)
        return SamplerState(
            cache=taken,
            hidden=jnp.where(valid[:, None], state.hidden[source], 0).astype(state.hidden.dtype),
            overflowed=valid & (state.overflowed[source] | lost),
        )
    return SamplerState(
        cache=KVCache(k=cache.k[:, index], v=cache.v[:, index], lengths=cache.lengths[index]),
        hidden=state.hidden[index],
        overflowed=state.overflowed[index],
    )


def key_data(keys: Any) -> np.ndarray:
    """Host ``uint32`` data of PRNG keys (typed keys or raw ``uint32[..., 2]`` ones)."""
    if isinstance(keys, jax.Array) and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    return np.asarray(keys, np.uint32)


def cache_row_keys(keys: Any, rows: np.ndarray, num_rows: int) -> Any:
    """The key of each cache row: ``keys[rows[i]]`` (padding rows, ``-1``, get zeros) as
    ``uint32[len(rows), 2]`` data, when ``keys`` holds one key per each of ``num_rows`` rows;
    a single key is returned as it is."""
    data = key_data(keys)
    if data.ndim != 2 or data.shape[0] != num_rows:
        if data.shape == (2,):
            return keys
        raise ValueError(
            f"respond: key must be one key or [{num_rows}] keys, got key data of shape {data.shape}"
        )
    out = np.zeros((len(rows), data.shape[1]), np.uint32)
    valid = rows >= 0
    out[valid] = data[rows[valid]]
    return out


def shared_contexts(rows: Sequence[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """``(unique, index)``: the distinct contexts of ``rows`` in order of first appearance
    (an empty context among them if any row has one) and ``index int32[len(rows)]``, the
    position of each row's context in ``unique``."""
    position: dict[tuple[int, ...], int] = {}
    index = np.array([position.setdefault(tuple(r), len(position)) for r in rows], np.int32)
    return list(position), index


def params_mesh(params: Any):
    """The mesh ``params`` are laid out on (a ``NamedSharding`` over several devices, all of
    this process's), else None. A mesh that spans processes is not one a sampler can run on:
    each process samples on its own devices (``distributed.local_mesh``), on one device when
    it has one."""
    sharding = getattr(next(iter(jax.tree.leaves(params)), None), "sharding", None)
    if (
        isinstance(sharding, jax.sharding.NamedSharding)
        and sharding.mesh.size > 1
        and sharding.is_fully_addressable
    ):
        return sharding.mesh
    return None


def row_buckets(num_rows: int, min_rows: int, multiple: int) -> tuple[int, ...]:
    """Batch sizes a compacted cache may take, descending: ``num_rows`` rounded up to a
    sixteenth of the power of two that holds it (at most 1/8 more rows), then the powers of two
    below it down to ``min_rows``; each rounded up to a multiple of ``multiple`` (the batch
    shards of a mesh). Batches of nearly the same size, and every batch once compacted, share
    their sizes and so their compiled programs (an evaluation of 1504, 1528 and 1544 rows
    compiles 1536, 1664 and 1024, 512, ... once, not three chains of halvings)."""
    round_up = lambda n, m: -(-n // m) * m  # noqa: E731
    whole = 1 << max(num_rows - 1, 0).bit_length()
    sizes = {round_up(round_up(num_rows, max(whole // 16, 1)), multiple)}
    if num_rows > min_rows:
        n = whole // 2  # below num_rows
        while n >= min_rows:
            sizes.add(round_up(n, multiple))
            n //= 2
        sizes.add(round_up(min_rows, multiple))
    return tuple(sorted(sizes, reverse=True))


def width_buckets(max_context: int, smallest: int = 16) -> tuple[int, ...]:
    """Chunk widths ``append`` sees: powers of two from ``smallest`` below ``max_context``, and
    ``max_context`` itself."""
    widths, w = [max_context], smallest
    while w < max_context:
        widths.append(w)
        w *= 2
    return tuple(sorted(widths))


class SamplerPolicy:
    """A Qwen3 policy sampled with a continuing KV cache (see the module docstring).

    ``mesh`` defaults to the mesh the parameters are sharded over (None for parameters on one
    device), ``row_multiple`` to the mesh's batch shards (``data`` x ``fsdp``, so every
    compacted batch splits evenly; 1 without a mesh).
    ``params`` defaults to the model's own state; :meth:`using` gives the same policy with other
    parameters (e.g. after a train step), sharing the compiled functions; either way they are
    placed once, by ``generation_layout`` (see :func:`agentrl_jax.sampling.generation_params`:
    ``"auto"`` replicates them over ``fsdp`` on a mesh with ``fsdp`` > 1). ``cache_dtype``: the
    KV cache's dtype (None: the model's compute dtype). ``prefill_chunk``: appends wider than
    this run in chunks of this width (None: never). ``reuse_cache=False`` is the naive
    baseline: every turn prefills each live row's whole history again. ``share_prefixes``:
    rows that start from the same context (the ``G`` rows of a task group) prefill it once
    and copy its cache (:meth:`start`; False: every row prefills its own). ``paging``: a paged
    KV cache (:class:`~agentrl_jax.sampling.Paging`): attention reads only the pages rows use,
    and a row that is not live at :meth:`respond` (its episode is over) releases its pages at
    once and can no longer be extended. On a mesh (``tensor`` = 1) each batch shard holds its
    rows' pages: the batch is then never compacted (rows stay on their shard) and a shared
    context is prefilled once per shard that has rows starting from it. ``exact_logprobs``
    (``rl.exact_logprobs``; one device): the policy keeps each row's tokens and decodes from
    the canonical forward of its whole history (:mod:`agentrl_jax.sampling.exact`), so the
    trainer's log-probs of its tokens equal the recorded ones bit for bit. ``trace_counts``
    counts traces (= compilations) per function.
    """

    @classmethod
    def from_engine(
        cls, model: Qwen3ForCausalLM, engine: EngineConfig, **options: Any
    ) -> "SamplerPolicy":
        """A policy with the sampling engine ``engine`` (a config's ``engine`` section: the KV
        cache's dtype, prefill chunks, the paged cache, where decode reads the weights from);
        ``options`` are the constructor's others (``mesh``, ``token_map``, ...)."""
        return cls(
            model,
            cache_dtype=engine.kv_cache_dtype,
            prefill_chunk=engine.prefill_chunk,
            generation_layout=engine.generation_layout,
            paging=engine.paging,
            **options,
        )

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        params: Any = None,
        *,
        token_map: TokenMap | None = None,
        compact: bool = True,
        min_rows: int = 8,
        row_multiple: int | None = None,
        reuse_cache: bool = True,
        mesh=None,
        cache_dtype: Any = None,
        prefill_chunk: int | None = None,
        generation_layout: str = "auto",
        device: Any = None,
        share_prefixes: bool = True,
        paging: Paging | None = None,
        exact_logprobs: bool = False,
    ):
        given = nnx.state(model) if params is None else params
        mesh = params_mesh(given) if mesh is None else mesh
        if row_multiple is None:
            row_multiple = 1 if mesh is None else batch_shards(mesh)
        if min_rows < 1 or row_multiple < 1:
            raise ValueError(
                f"min_rows and row_multiple must be >= 1, got {min_rows}, {row_multiple}"
            )
        if token_map is not None and len(token_map) > model.config.vocab_size:
            raise ValueError(
                f"token_map has {len(token_map)} ids but the model's vocab_size is "
                f"{model.config.vocab_size}"
            )
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool)
            or not isinstance(prefill_chunk, int)
            or prefill_chunk < 1
        ):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        if not isinstance(exact_logprobs, bool):
            raise ValueError(f"exact_logprobs must be a bool, got {exact_logprobs!r}")
        if exact_logprobs and mesh is not None and mesh.size > 1:
            raise NotImplementedError(
                "exact_logprobs: the sampler computes exact log-probs on one device only "
                f"(the parameters here are on a mesh of {mesh.size} devices)"
            )
        self.exact_logprobs = exact_logprobs
        self.model = model
        self.token_map = token_map
        self.compact, self.min_rows, self.row_multiple = compact, min_rows, row_multiple
        self.reuse_cache = reuse_cache
        self.share_prefixes = bool(share_prefixes)
        self.paging = paging
        # on a mesh each batch shard pages its own rows: rows never move between shards, so
        # finished rows free their pages but the batch is not compacted
        self.sharded_pages = paging is not None and mesh is not None
        if self.sharded_pages:
            self.compact = False
        self.mesh = mesh
        self.device = None if mesh is not None else (device or jax.local_devices()[0])
        self.cache_dtype = None if cache_dtype is None else jnp.dtype(cache_dtype)
        self.prefill_chunk = prefill_chunk
        self.generation_layout = resolve_layout(generation_layout, mesh)
        self._given = given
        self._placed: Any = None
        self._samplers: dict[tuple, Sampler] = {}
        self._own_traces: collections.Counter[str] = collections.Counter()
        self._take = jax.jit(self._take_impl)
        self.shapes_used: set[tuple[str, int, int]] = set()  # (call, batch, width)
        self._clear()

    def _clear(self) -> None:
        self._state: SamplerState | None = None
        self._rows = np.zeros(0, np.int64)  # global row of each cache row, -1 = padding
        self._contexts: list[list[int]] = []  # only without reuse_cache
        self._settings: PolicySettings | None = None
        self._history: dict[int, list[int]] = {}  # exact log-probs: each row's tokens

    def place(self, params: Any) -> Any:
        """``params`` in the generation layout (one ``device_put``; a no-op where they are)."""
        return generation_params(
            params, self.mesh, self.generation_layout, self.device, dtype=self.model.dtype
        )

    @property
    def params(self) -> Any:
        """The parameters decode reads, placed by :meth:`place` on first use (so a policy
        that only hands out :meth:`using` copies never holds a second copy of the weights)."""
        if self._placed is None:
            self._placed = self.place(self._given)
        return self._placed

    def using(self, params: Any) -> "SamplerPolicy":
        """This policy with other parameters, placed once (:meth:`place`, on first use);
        compiled functions (and ``trace_counts``) are shared, ``shapes_used`` starts afresh."""
        other = copy.copy(self)
        other._given, other._placed = params, None
        other.shapes_used = set()
        other._clear()
        return other

    def fork(self) -> "SamplerPolicy":
        """This policy with a cache of its own (no rows yet): the same placed parameters,
        compiled functions, ``trace_counts`` and ``shapes_used``. A rollout's lanes
        (:class:`~agentrl_jax.rollout.RolloutConfig` ``lanes``) each hold one."""
        self.params  # placed once, here, so the fork shares them  # noqa: B018
        other = copy.copy(self)
        for name in [n for n in vars(other) if callable(getattr(type(self), n, None))]:
            delattr(other, name)  # a method replaced on this instance (a spy) stays with it
        other._clear()
        return other

    @property
    def trace_counts(self) -> collections.Counter[str]:
        total = collections.Counter(self._own_traces)
        for sampler in self._samplers.values():
            total.update(sampler.trace_counts)
        return total

    def _take_impl(self, state, index):
        self._own_traces["take_rows"] += 1
        return take_rows(state, index)

    def _sampler(self, settings: PolicySettings) -> Sampler:
        stop = tuple(int(i) for i in self._to_model(settings.stop_token_ids))
        key = (settings.max_response_tokens, stop)
        if key not in self._samplers:
            self._samplers[key] = Sampler(
                self.model,
                max_new_tokens=settings.max_response_tokens,
                stop_token_ids=stop,
                mesh=self.mesh,
                prefill_chunk=self.prefill_chunk,
                device=self.device,
                paging=self.paging,
            )
        return self._samplers[key]

    def _to_model(self, ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        return ids.astype(np.int32) if self.token_map is None else self.token_map.to_model(ids)

    def _bucket(self, count: int, total: int) -> int:
        buckets = row_buckets(total, self.min_rows, self.row_multiple)
        return min(b for b in buckets if b >= count)

    # -- the protocol
    def start(self, contexts: Sequence[Sequence[int]], settings: PolicySettings) -> None:
        self._settings = settings
        self._num_rows = len(contexts)
        if self.exact_logprobs:
            self._history = {r: list(c) for r, c in enumerate(contexts)}
        if not self.reuse_cache:
            self._contexts = [list(c) for c in contexts]
            return
        sampler = self._sampler(settings)
        if self.sharded_pages:  # every row seated on its shard, then prefilled there
            shards = batch_shards(self.mesh)
            size = -(-self._num_rows // shards) * shards
            self._rows = np.full(size, -1, np.int64)
            self._rows[: self._num_rows] = np.arange(self._num_rows)
            self._state = sampler.init(size, settings.max_context, self.cache_dtype)
            self._seat(sampler, list(range(self._num_rows)), range(self._num_rows), contexts)
            return
        present = np.array([i for i, c in enumerate(contexts) if len(c)], np.int64)
        self._rows = (
            self._pad_rows(present, self._num_rows) if self.compact else np.arange(self._num_rows)
        )
        rows = [tuple(contexts[r]) if r >= 0 else () for r in self._rows]
        shared = shared_contexts(rows) if self.share_prefixes else None
        size = (
            None
            if shared is None
            else min(b for b in row_buckets(len(rows), 1, self.row_multiple) if b >= len(shared[0]))
        )
        if size is None or size > len(rows) // 2:
            state = sampler.init(len(rows), settings.max_context, self.cache_dtype)
            self._state = self._append(sampler, state, rows)
            return
        # each distinct context once (an empty one too, for rows without a context), then
        # every row takes a copy of its context's cache: one gather instead of G prefills
        unique, index = shared
        # (a paged cache's pool is sized for all the rows, which the copies will fill)
        state = sampler.init(size, settings.max_context, self.cache_dtype, pool_rows=len(rows))
        state = self._append(sampler, state, unique + [()] * (size - len(unique)))
        self.shapes_used.add(("take_rows", len(rows), size))
        state = self._take(state, jax.device_put(index, sampler.replicated))
        self._state = jax.block_until_ready(jax.device_put(state, sampler.state_shardings(state)))

    def _append(self, sampler: Sampler, state: SamplerState, rows: Sequence[Sequence[int]]):
        if not any(len(r) for r in rows):
            return state
        widths = width_buckets(self._settings.max_context)
        tokens, mask = pad_rows([self._to_model(r) for r in rows], widths)
        self.shapes_used.add(("append", len(rows), tokens.shape[1]))
        state = sampler.append(self.params, state, tokens, mask)
        return jax.block_until_ready(state)

    def extend(self, chunks: Sequence[Sequence[int]]) -> None:
        if self.exact_logprobs:
            for r, chunk in enumerate(chunks):
                if len(chunk):
                    self._history[r].extend(chunk)
        if not self.reuse_cache:
            for context, chunk in zip(self._contexts, chunks):
                context.extend(chunk)
            return
        position = {int(r): i for i, r in enumerate(self._rows) if r >= 0}
        missing = [i for i, c in enumerate(chunks) if len(c) and i not in position]
        if missing:
            raise ValueError(
                f"extend: rows {missing[:5]} are no longer cached (they were not live)"
            )
        batch_chunks = [chunks[r] if r >= 0 else [] for r in self._rows]
        self._state = self._append(self._sampler(self._settings), self._state, batch_chunks)

    def restart(self, contexts: Sequence[Sequence[int]], which: np.ndarray) -> None:
        """Start the rows where ``which [N]`` is True afresh from ``contexts`` (prefill); the
        other rows keep their caches. With ``share_prefixes`` and a paged cache, rows restarted
        with the same context prefill it once and copy its pages."""
        which = np.asarray(which, bool)
        if self.exact_logprobs:
            for r in np.flatnonzero(which):
                self._history[int(r)] = list(contexts[r])
        if not self.reuse_cache:
            for r in np.flatnonzero(which):
                self._contexts[r] = list(contexts[r])
            return
        targets = np.flatnonzero(which)
        if not len(targets):
            return
        sampler = self._sampler(self._settings)
        position = {int(r): i for i, r in enumerate(self._rows) if r >= 0}
        spare = [i for i, r in enumerate(self._rows) if r < 0]
        if len([t for t in targets if int(t) not in position]) > len(spare):  # regrow to N rows
            kept = [r for r in self._rows if r >= 0]
            size = self._bucket(self._num_rows, self._num_rows) if self.compact else self._num_rows
            index = np.full(size, -1 if self.paging is not None else 0, np.int32)
            index[: len(kept)] = [position[int(r)] for r in kept]
            self.shapes_used.add(("take_rows", size, len(self._rows)))
            state = self._take(self._state, jax.device_put(index, sampler.replicated))
            self._state = jax.device_put(state, sampler.state_shardings(state))
            self._rows = np.full(size, -1, np.int64)
            self._rows[: len(kept)] = kept
            position = {int(r): i for i, r in enumerate(self._rows) if r >= 0}
            spare = [i for i, r in enumerate(self._rows) if r < 0]
        slots = []
        for t in targets:
            slots.append(position[int(t)] if int(t) in position else spare.pop(0))
            self._rows[slots[-1]] = t
        cleared = np.zeros(len(self._rows), bool)
        cleared[slots] = True
        self.shapes_used.add(("release", len(self._rows), 0))
        self._state = sampler.release(self._state, cleared)
        if self.paging is None:  # a static cache: an append over every row, the others empty
            rows = [() for _ in self._rows]
            for slot, t in zip(slots, targets):
                rows[slot] = tuple(contexts[t])
            self._state = self._append(sampler, self._state, rows)
            return
        self._seat(sampler, slots, targets, contexts)

    def _seat(
        self,
        sampler: Sampler,
        slots: Sequence[int],
        targets: Sequence[int],
        contexts: Sequence[Sequence[int]],
    ) -> None:
        """Prefill the empty cache rows ``slots`` with ``contexts[targets]`` (a paged cache):
        each distinct context once (once per batch shard on a mesh), copied to the others."""
        shards = batch_shards(self.mesh) if self.sharded_pages else 1
        per_shard = len(self._rows) // shards
        first: dict[tuple[int, tuple[int, ...]], int] = {}
        prefill, copies = [], []
        for slot, t in zip(slots, targets):
            context = tuple(contexts[t])
            if not context:
                continue
            where = (slot // per_shard, context)
            if self.share_prefixes and where in first:
                copies.append((slot, first[where]))
            else:
                first[where] = slot
                prefill.append((slot, context))
        if prefill:
            size = self._sub_batch(len(prefill))
            tokens, mask = pad_rows(
                [self._to_model(c) for _, c in prefill] + [[]] * (size - len(prefill)),
                width_buckets(self._settings.max_context),
            )
            index = np.full(size, -1, np.int32)
            index[: len(prefill)] = [slot for slot, _ in prefill]
            self.shapes_used.add(("append_rows", size, tokens.shape[1]))
            self._state = sampler.append_rows(self.params, self._state, index, tokens, mask)
        if copies:
            size = self._sub_batch(len(copies))
            dst, src = np.full(size, -1, np.int32), np.zeros(size, np.int32)
            dst[: len(copies)], src[: len(copies)] = zip(*copies)
            self.shapes_used.add(("copy_rows", size, 0))
            self._state = sampler.copy_rows(self._state, dst, src)
        self._state = jax.block_until_ready(self._state)

    def _sub_batch(self, count: int) -> int:
        """Rows of a call on part of the batch: ``count`` rounded up to a power of two (at
        most the batch), so such calls compile a few times, not once per count."""
        return min(1 << max(count - 1, 0).bit_length(), len(self._rows))

    def respond(self, live: np.ndarray, max_tokens: np.ndarray, key: jax.Array) -> Responses:
        """``key``: ``[N]`` keys, one per row (or one key for the batch)."""
        settings = self._settings
        live = np.asarray(live, bool)
        sampler = self._sampler(settings)
        if not self.reuse_cache:  # the baseline: prefill every live row's whole history again
            self._rows = (
                self._pad_rows(np.flatnonzero(live), len(live))
                if self.compact
                else np.arange(len(live))
            )
            state = sampler.init(len(self._rows), settings.max_context, self.cache_dtype)
            self._state = self._append(
                sampler,
                state,
                [self._contexts[r] if r >= 0 and live[r] else [] for r in self._rows],
            )
        else:
            if self.paging is not None:
                self._release_finished(live)
            if self.compact:
                self._compact_to(np.flatnonzero(live), len(live))
        rows = self._rows
        valid = rows >= 0
        active = np.zeros(len(rows), bool)
        active[valid] = live[rows[valid]]
        budget = np.zeros(len(rows), np.int32)
        budget[valid] = max_tokens[rows[valid]]
        stuck = np.zeros(len(rows), bool)
        if self.paging is not None and self.reuse_cache:  # a prefill or observation found no page
            stuck = active & np.asarray(jax.device_get(self._state.overflowed))
            active = active & ~stuck
        self.shapes_used.add(("decode", len(rows), 0))
        self._state, out = sampler.decode(
            self.params,
            self._state,
            cache_row_keys(key, rows, len(live)),
            settings.sampling,
            budget=budget,
            active=active,
            **({"history": self._histories(rows)} if self.exact_logprobs else {}),
        )
        tokens, lengths, logprobs, sampling_lp, reason, experts = jax.device_get(
            (
                out.tokens,
                out.lengths,
                out.log_probs,
                out.sampling_log_probs,
                out.stop_reason,
                out.experts,
            )
        )
        n, width = len(live), settings.max_response_tokens
        result = Responses(
            np.zeros((n, width), np.int32),
            np.zeros(n, np.int32),
            np.zeros((n, width), np.float32),
            np.zeros((n, width), np.float32),
            experts=None
            if experts is None
            else np.full((n, *experts.shape[1:]), -1, experts.dtype),
        )
        filled = np.arange(width)[None, :] < lengths[:, None]
        if self.token_map is not None:
            tokens = np.where(filled, self.token_map.to_tokenizer(np.where(filled, tokens, 0)), 0)
        result.tokens[rows[valid]] = np.where(filled, tokens, 0)[valid]
        result.lengths[rows[valid]] = lengths[valid]
        result.logprobs[rows[valid]] = np.where(filled, logprobs, 0.0)[valid]
        result.sampling_logprobs[rows[valid]] = np.where(filled, sampling_lp, 0.0)[valid]
        if experts is not None:
            result.experts[rows[valid]] = np.where(filled[:, :, None, None], experts, -1)[valid]
        if not self.reuse_cache:
            for r in np.flatnonzero(live):
                self._contexts[r].extend(result.tokens[r, : result.lengths[r]].tolist())
        elif self.paging is not None:
            result = self._preempt(result, valid & (stuck | (reason == StopReason.NO_PAGE)))
        if self.exact_logprobs:
            for r in np.flatnonzero(result.lengths):
                self._history[int(r)].extend(result.tokens[r, : result.lengths[r]].tolist())
        return result

    def _histories(self, rows: np.ndarray) -> np.ndarray:
        """``int32 [len(rows), max_context]``: each cache row's tokens (model ids) from position
        0, zeros after them and on padding rows (exact log-probs' decode input)."""
        out = np.zeros((len(rows), self._settings.max_context), np.int32)
        for i, r in enumerate(rows):
            if r >= 0 and self._history[int(r)]:
                ids = self._to_model(self._history[int(r)])
                out[i, : len(ids)] = ids
        return out

    def _preempt(self, result: Responses, slots: np.ndarray) -> Responses:
        """Cache rows ``slots`` ran out of pages this turn: their responses are dropped and
        their pages released (they become padding), and ``result`` says so (``preempted``)."""
        if not slots.any():
            return result
        lost = self._rows[slots]
        for field in (result.tokens, result.lengths, result.logprobs, result.sampling_logprobs):
            field[lost] = 0
        if result.experts is not None:
            result.experts[lost] = -1
        preempted = np.zeros(len(result.lengths), bool)
        preempted[lost] = True
        self._state = self._sampler(self._settings).release(self._state, slots)
        self._rows = np.where(slots, -1, self._rows)
        return dataclasses.replace(result, preempted=preempted)

    def _pad_rows(self, rows: np.ndarray, total: int) -> np.ndarray:
        size = self._bucket(len(rows), total) if self.compact else len(rows)
        padded = np.full(size, -1, np.int64)
        padded[: len(rows)] = rows
        return padded

    def _release_finished(self, live: np.ndarray) -> None:
        """Return the pages of cached rows that are no longer live; they become padding."""
        cached = self._rows >= 0
        done = cached.copy()
        done[cached] = ~live[self._rows[cached]]
        if done.any():
            sampler = self._sampler(self._settings)
            self._state = sampler.release(self._state, done)
            self._rows = np.where(done, -1, self._rows)

    def _compact_to(self, live_rows: np.ndarray, total: int) -> None:
        """Shrink the cache to the live rows once they fit a smaller bucket."""
        size = self._bucket(len(live_rows), total)
        if size >= len(self._rows):
            return
        where = {int(r): i for i, r in enumerate(self._rows) if r >= 0}
        # padding slots copy slot 0 (never active); with pages they are empty rows instead
        index = np.full(size, -1 if self.paging is not None else 0, np.int32)
        index[: len(live_rows)] = [where[int(r)] for r in live_rows]
        self.shapes_used.add(("take_rows", size, len(self._rows)))
        sampler = self._sampler(self._settings)
        state = self._take(self._state, jax.device_put(index, sampler.replicated))
        self._state = jax.device_put(state, sampler.state_shardings(state))
        self._rows = self._pad_rows(live_rows, total)
