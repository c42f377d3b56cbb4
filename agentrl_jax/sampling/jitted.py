"""The jitted front end of the sampling engine (:mod:`agentrl_jax.sampling.sampler`): one
:class:`Sampler` per model architecture compiles :func:`~agentrl_jax.sampling.sampler.append`
and :func:`~agentrl_jax.sampling.sampler.decode` and places their inputs and states.

A multi-turn rollout is a sequence of calls on one :class:`SamplerState`::

    sampler = Sampler(model, max_new_tokens=64, stop_token_ids=eos_ids)
    params = nnx.state(model)
    state = sampler.init(batch_size=8, max_len=1024)
    state = sampler.append(params, state, prompt_tokens, prompt_mask)      # prefill
    for turn in range(turns):
        state, out = sampler.decode(params, state, keys[turn], SamplingConfig(top_p=0.9))
        state = sampler.append(params, state, observation_tokens, observation_mask)

Shapes are static: the cache is ``[B, max_len]`` per layer, decode output ``[B,
max_new_tokens]``; a different per-row budget, prompt length or observation length inside a
chunk width changes no shape. Each distinct chunk width ``L`` of ``append`` compiles once (pad
chunks to a few widths with :func:`agentrl_jax.sampling.padding.pad_rows`), ``decode`` once per
``SamplingConfig`` and ``init`` once per ``(batch, max_len)``; so a 10-turn rollout compiles a
fixed handful of times. A decode step is the model's own cache forward of one token per row
(``Qwen3ForCausalLM.hidden_states(..., few_rows=True)``: matrix products ordered for small
batches; on CPU the layers unrolled from per-layer weights).

Paged on a mesh (``tensor`` = 1): each batch shard is a whole one-device engine: its rows, and
an equal share of the pool's pages, live on its device
(:func:`~agentrl_jax.sampling.sampler.paged_state_specs`) and every paged program runs per shard
(``shard_map``; parameters replicated), so no page ever crosses devices; a row can be copied only
within its shard, and decode needs per-row keys.

Placement (decided once, so no program compiles twice for one shape): every array the
Sampler makes or is given (states from ``init``, tokens, masks, budgets, keys) is committed
to one placement, the mesh's (``KV_CACHE_RULES`` for the cache, rows over ``BATCH_AXES``) or
one device's. Parameters are the caller's: :func:`~agentrl_jax.sharding.generation_params` puts them
in the layout decode reads them from. On a mesh with ``fsdp`` > 1 the training layout shards every
weight over ``fsdp``, so each decode step would all-gather the whole model;
:func:`~agentrl_jax.sharding.generation_rules` (the Qwen3 rules with ``fsdp`` dropped) replicates
the weights over ``fsdp`` instead (each device holds them whole, split only over ``tensor``), and
rows stay split over ``data`` x ``fsdp``, so decode needs no weight collectives. That copy costs one
full set of weights per ``tensor`` shard per device while it lives (one update). With per-row keys
each step's sampling runs on each device's own rows
(:func:`~agentrl_jax.sampling.sampler.rows_local_sample`), so the ``[B, V]`` logits are not gathered
for the top-k either.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.models import paged_kernels
from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.paged_cache import PagedKVCache
from agentrl_jax.models.paged_kernels import select_kernel
from agentrl_jax.models.qwen3 import Qwen3ForCausalLM
from agentrl_jax.sampling.filters import SamplingConfig, sample
from agentrl_jax.sampling.sampler import (
    Paging,
    SampleOutput,
    SamplerState,
    append,
    append_rows,
    copy_rows,
    decode,
    init_state,
    paged_state_specs,
    release_rows,
    rows_local_sample,
)
from agentrl_jax.sharding import BATCH_AXES, KV_CACHE_RULES, batch_shards, tree_shardings


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _is_key_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class Sampler:
    """Jitted :func:`append` / :func:`decode` for one model architecture.

    ``params`` (``nnx.state(model)``, or any state of the same structure, e.g. after a train
    step) is an argument of every call, so one Sampler serves a changing policy. Calls consume
    the ``state`` passed in (its buffers are donated, so the cache is updated in place).

    With ``mesh``: states are laid out by ``KV_CACHE_RULES`` (batch over ``data`` x ``fsdp``,
    KV heads over ``tensor``), inputs and outputs by batch; place ``params`` with
    :func:`generation_params` (or by their partition rules, ``load_qwen3(..., mesh=mesh)``).
    Without: everything is committed to ``device`` (default ``jax.local_devices()[0]``; put
    ``params`` there too, :func:`generation_params`). ``prefill_chunk``: appends wider than it
    run in chunks of that width (:func:`append_in_chunks`; None: never).
    ``paging``: states from :meth:`init` hold a paged KV cache (:class:`Paging`; on a mesh per batch
    shard, see the module docstring): attention reads only the pages rows use, and :meth:`release`
    returns a finished row's pages to the pool. ``trace_counts`` counts traces per function, for
    tests and logs (a trace is a compilation as long as the placement of the inputs stays the same).
    ``unroll_layers`` (default: on CPU only) decodes with unrolled layers from per-layer copies of
    the weights made once per decode call (:meth:`Qwen3ForCausalLM.split_layers`).
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        pad_token_id: int = 0,
        mesh: Mesh | None = None,
        unroll_layers: bool | None = None,
        prefill_chunk: int | None = None,
        device: Any = None,
        paging: Paging | None = None,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool)
            or not isinstance(prefill_chunk, int)
            or prefill_chunk < 1
        ):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        self.graphdef = nnx.graphdef(model)
        self.config: Qwen3Config = model.config
        self.dtype = model.dtype
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = tuple(
            model.config.eos_token_ids if stop_token_ids is None else stop_token_ids
        )
        for token in self.stop_token_ids:
            if not 0 <= token < self.config.vocab_size:
                raise ValueError(
                    f"stop token id {token} is outside vocab_size={self.config.vocab_size}"
                )
        self.pad_token_id = pad_token_id
        self.mesh = mesh
        self.device = None if mesh is not None else (device or jax.local_devices()[0])
        self.prefill_chunk = prefill_chunk
        if paging is not None and mesh is not None and mesh.shape["tensor"] > 1:
            raise NotImplementedError(
                f"a paged KV cache on a mesh splits rows and pages over {BATCH_AXES} only; this "
                f"mesh has tensor={mesh.shape['tensor']}: use tensor=1 or the static cache "
                "(paging=None)"
            )
        self.paging = paging
        self.platform = (mesh.devices.flat[0] if mesh is not None else self.device).platform
        self.sharded_pages = paging is not None and mesh is not None
        self.unroll_layers = self.platform == "cpu" if unroll_layers is None else unroll_layers
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._init = jax.jit(self._init_impl, static_argnums=(0, 1, 2, 3))
        self._release = jax.jit(self._release_impl, donate_argnums=0)
        self._append_rows = jax.jit(self._append_rows_impl, donate_argnums=1)
        self._copy_rows = jax.jit(self._copy_rows_impl, donate_argnums=0)
        self._append = jax.jit(self._append_impl, donate_argnums=1)
        self._decode = jax.jit(
            self._decode_impl, static_argnames=("sampling", "top_logprobs"), donate_argnums=1
        )

    # -- layout
    def _constrain(self, tree: Any) -> Any:
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.state_shardings(tree))

    def state_shardings(self, state: SamplerState) -> SamplerState:
        """The layout of a state (on a mesh: cache by KV_CACHE_RULES, the rest by batch; a
        paged state by :func:`paged_state_specs`)."""
        if self.mesh is None:
            return jax.tree.map(lambda _: self.replicated, state)
        if isinstance(state.cache, PagedKVCache):
            return jax.tree.map(
                lambda spec: NamedSharding(self.mesh, spec),
                paged_state_specs(state),
                is_leaf=_is_spec,
            )
        batch = NamedSharding(self.mesh, P(BATCH_AXES))
        return SamplerState(
            cache=tree_shardings(state.cache, self.mesh, KV_CACHE_RULES),
            hidden=NamedSharding(self.mesh, P(BATCH_AXES, None)),
            overflowed=batch,
        )

    @property
    def replicated(self) -> jax.sharding.Sharding:
        """Where unbatched inputs go: the whole mesh (replicated), or the device."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh, P())

    def rows_sharding(self, ndim: int) -> jax.sharding.Sharding:
        """Where batch-major inputs of ``ndim`` dimensions go (rows over ``BATCH_AXES``)."""
        if self.mesh is None:
            return self.replicated
        return NamedSharding(self.mesh, P(BATCH_AXES, *[None] * (ndim - 1)))

    def _batch_put(self, x: Any, dtype: Any) -> jax.Array:
        """A batch-major input, committed (host inputs converted on the host: no compile)."""
        x = x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x, dtype)
        return jax.device_put(x, self.rows_sharding(x.ndim))  # unlike jnp.asarray, compiles nothing

    def _key_put(self, key: Any, batch: int) -> jax.Array:
        """One key (replicated), or per-row keys as ``[B, 2]`` uint32 data (rows split)."""
        if _is_key_array(key) and key.ndim == 0:
            return jax.device_put(key, self.replicated)
        data = np.asarray(jax.random.key_data(key) if _is_key_array(key) else key, np.uint32)
        if data.shape == (2,):  # a raw (uint32[2]) key
            return jax.device_put(data, self.replicated)
        if data.shape != (batch, 2):
            raise ValueError(
                f"decode: key must be one key or [batch={batch}] keys (threefry), "
                f"got key data of shape {data.shape}"
            )
        return self._batch_put(data, np.uint32)

    # -- calls
    def init(
        self, batch_size: int, max_len: int, dtype: Any = None, pool_rows: int | None = None
    ) -> SamplerState:
        """An empty state, cache in ``dtype`` (default: the model's compute dtype; e.g.
        bfloat16 halves a float32 model's cache), pending hidden states in the compute dtype;
        paged when the Sampler was made with ``paging`` (a pool of ``paging.num_pages``, or by
        default enough pages for ``pool_rows`` rows at ``max_len``, ``pool_rows`` defaulting to
        ``batch_size``: a state that will be copied to more rows needs the larger pool; on a
        mesh each batch shard holds an equal share of the rows and of the pages); one
        compiled program per (batch_size, max_len, dtype, pool size)."""
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        dtype = jnp.dtype(dtype or self.dtype)
        state = self._init(
            batch_size, max_len, dtype, self.pool(batch_size, max_len, pool_rows, dtype)
        )
        return jax.device_put(state, self.state_shardings(state))  # committed: see the module doc

    def pool(
        self, batch_size: int, max_len: int, pool_rows: int | None = None, dtype: Any = None
    ) -> Paging | None:
        """The paging of a state from ``init(batch_size, max_len, dtype, pool_rows=...)``, its
        ``num_pages`` and ``kernel`` resolved (None for a static cache). A pool must hold one
        row of ``max_len`` tokens (per batch shard): a row alone can always play."""
        paging = self.paging
        if paging is None:
            return None
        shape = dict(
            page_size=paging.page_size,
            head_dim=self.config.head_dim,
            dtype=jnp.dtype(dtype or self.dtype),
        )
        if paging.kernel == "auto":
            paging = dataclasses.replace(paging, kernel=select_kernel(self.platform, **shape))
        elif (why := paged_kernels.unmet(paging.kernel, **shape)) is not None:
            raise ValueError(
                f"paging.kernel={paging.kernel!r} cannot serve this cache: {why}; "
                "use kernel='auto' (the XLA version where no kernel fits)"
            )
        shards = batch_shards(self.mesh) if self.sharded_pages else 1
        if paging.num_pages is None:
            rows = batch_size if pool_rows is None else max(pool_rows, 1)
            pages = -(-rows * -(-max_len // paging.page_size) // shards) * shards
            paging = dataclasses.replace(paging, num_pages=pages)
        if batch_size % shards or paging.num_pages % shards:
            raise ValueError(
                f"a paged state on this mesh needs batch_size and paging.num_pages "
                f"divisible by its {shards} batch shards (each holds its share of "
                f"rows and pages), got {batch_size} and {paging.num_pages}"
            )
        need = -(-max_len // paging.page_size)
        if paging.num_pages // shards < need:  # a row alone must fit, so preemption can end
            raise ValueError(
                f"paging.num_pages={paging.num_pages} ({shards} shard(s)) cannot hold "
                f"one row of max_len={max_len} tokens: it needs {need} pages of "
                f"{paging.page_size} per shard"
            )
        return paging

    def append_rows(
        self, params: nnx.State, state: SamplerState, rows: Any, tokens: Any, mask: Any
    ) -> SamplerState:
        """Jitted :func:`append_rows` (paged states): ``rows int[k]`` (``-1`` padding),
        tokens and mask ``[k, L]``; one program per ``(k, L)``."""
        rows = np.asarray(rows)
        if (
            rows.ndim != 1
            or np.shape(tokens) != np.shape(mask)
            or np.shape(tokens)[:1] != rows.shape
        ):
            raise ValueError(
                f"append_rows: rows {rows.shape}, tokens {np.shape(tokens)} and mask "
                f"{np.shape(mask)} must be [k] and [k, L]"
            )
        if self.sharded_pages:
            rows, (tokens, mask) = self._by_shard(state, rows, np.asarray(tokens), np.asarray(mask))
        return self._append_rows(
            params,
            state,
            self._batch_put(rows, jnp.int32),
            self._batch_put(tokens, jnp.int32),
            self._batch_put(mask, bool),
        )

    def copy_rows(self, state: SamplerState, dst: Any, src: Any) -> SamplerState:
        """Jitted :func:`copy_rows` (paged states): ``dst``, ``src`` ``int[k]``. On a mesh a
        row can only be copied within its batch shard (pages never cross devices)."""
        dst, src = np.asarray(dst), np.asarray(src)
        if self.sharded_pages:
            local = state.hidden.shape[0] // batch_shards(self.mesh)
            crossing = (dst >= 0) & (dst // local != src // local)
            if crossing.any():
                i = int(np.flatnonzero(crossing)[0])
                raise ValueError(
                    f"copy_rows: row {src[i]} cannot be copied to row {dst[i]}: "
                    f"they are on different batch shards ({local} rows each)"
                )
            dst, (src,) = self._by_shard(state, dst, src)
            src = np.where(dst >= 0, src % local, 0)
        return self._copy_rows(
            state, self._batch_put(dst, jnp.int32), self._batch_put(src, jnp.int32)
        )

    def _by_shard(
        self, state: SamplerState, rows: np.ndarray, *columns: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Rows ``int[k]`` (``-1``: padding) of a paged state on a mesh, regrouped so that each
        batch shard's block of ``k'`` entries (``k'``: the most rows any shard gets, rounded up
        to a power of two) names that shard's rows by their local index; ``columns`` (``[k,
        ...]``) follow their rows, padding entries zero."""
        shards = batch_shards(self.mesh)
        local = state.hidden.shape[0] // shards
        shard = np.where(rows >= 0, rows // local, -1)
        most = int(np.bincount(shard[shard >= 0], minlength=shards).max(initial=0))
        width = 1 << max(most - 1, 0).bit_length()
        out = np.full(shards * width, -1, np.int32)
        outs = [np.zeros((shards * width,) + c.shape[1:], c.dtype) for c in columns]
        for s in range(shards):
            picked = np.flatnonzero(shard == s)
            at = s * width + np.arange(len(picked))
            out[at] = rows[picked] - s * local
            for o, c in zip(outs, columns):
                o[at] = c[picked]
        return out, outs

    def release(self, state: SamplerState, rows: Any) -> SamplerState:
        """Empty the rows where ``rows [B]`` is True (a paged cache's pages go back to the
        pool; a static cache's rows are reset); consumes ``state``."""
        return self._release(state, self._batch_put(rows, bool))

    def append(
        self, params: nnx.State, state: SamplerState, tokens: Any, mask: Any
    ) -> SamplerState:
        """Jitted :func:`append` (prefill or an observation). tokens, mask: ``[B, L]``."""
        batch = state.hidden.shape[0]
        shape, mask_shape = np.shape(tokens), np.shape(mask)
        if len(shape) != 2 or shape != mask_shape or shape[0] != batch:
            raise ValueError(
                f"append: tokens {shape} and mask {mask_shape} must both be [batch={batch}, L]"
            )
        return self._append(
            params, state, self._batch_put(tokens, jnp.int32), self._batch_put(mask, bool)
        )

    prefill = append

    def decode(
        self,
        params: nnx.State,
        state: SamplerState,
        key: jax.Array,
        sampling: SamplingConfig,
        budget: Any = None,
        active: Any = None,
        offset: Any = None,
        top_logprobs: int = 0,
        history: Any = None,
    ) -> tuple[SamplerState, SampleOutput]:
        """Jitted :func:`decode`. key: one key, or one per row (``[B]`` typed keys or their
        ``[B, 2]`` uint32 data); budget: ``[B]`` int (default ``max_new_tokens``); active:
        ``[B]`` bool (default all rows); offset: ``[B]`` int, each row's first step's number
        (per-row keys; None: 0; not with a paged cache on a mesh); top_logprobs: K > 0 also
        returns each step's K most likely tokens (one program per K); history: ``[B, L]``
        int, each row's cached tokens from position 0, for exact log-probs
        (:mod:`agentrl_jax.sampling.exact`; one program per ``L``; one device)."""
        if offset is not None:
            if self.sharded_pages:
                raise NotImplementedError("decode: step offsets with a paged cache on a mesh")
            offset = self._batch_put(offset, jnp.int32)
        args = self._decode_args(params, state, key, budget, active)
        if history is None:
            return self._decode(*args, offset, sampling=sampling, top_logprobs=int(top_logprobs))
        if self.mesh is not None and self.mesh.size > 1:
            raise NotImplementedError("decode: exact log-probs (a history) on several devices")
        if np.ndim(history) != 2 or np.shape(history)[0] != state.hidden.shape[0]:
            raise ValueError(
                f"decode: history {np.shape(history)} must be [batch={state.hidden.shape[0]}, L]"
            )
        return self._decode(
            *args,
            offset,
            self._batch_put(history, jnp.int32),
            sampling=sampling,
            top_logprobs=int(top_logprobs),
        )

    def lower_decode(
        self,
        params: nnx.State,
        state: SamplerState,
        key: jax.Array,
        sampling: SamplingConfig,
        budget: Any = None,
        active: Any = None,
    ) -> jax.stages.Lowered:
        """The decode program for these inputs, lowered but not run (``.compile().as_text()``
        shows its collectives, ``.compile().memory_analysis()`` its memory)."""
        return self._decode.lower(
            *self._decode_args(params, state, key, budget, active), sampling=sampling
        )

    def _decode_args(self, params, state, key, budget, active) -> tuple:
        batch = state.hidden.shape[0]
        budget = np.full(batch, self.max_new_tokens) if budget is None else budget
        active = np.ones(batch, bool) if active is None else active
        if np.shape(budget) != (batch,) or np.shape(active) != (batch,):
            raise ValueError(
                f"decode: budget {np.shape(budget)} and active {np.shape(active)} "
                f"must be [batch={batch}]"
            )
        return (
            params,
            state,
            self._key_put(key, batch),
            self._batch_put(budget, jnp.int32),
            self._batch_put(active, bool),
        )

    def _per_shard(
        self, fn: Callable, params: Any, state: SamplerState, *rows: Any, with_output: bool = False
    ) -> Any:
        """``fn(params, state, *rows)`` (no ``params`` when None) run by each batch shard on its
        own rows and pages (a paged state on a mesh, :func:`paged_state_specs`): parameters
        replicated, ``rows`` batch-major. Returns the state, or ``(state, batch-major output)``
        with ``with_output``."""
        state_specs = paged_state_specs(state)
        specs = (state_specs,) + (P(BATCH_AXES),) * len(rows)
        inputs = (state, *rows)
        if params is not None:
            specs, inputs = (P(),) + specs, (params,) + inputs
        out_specs = (state_specs, P(BATCH_AXES)) if with_output else state_specs
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=specs, out_specs=out_specs, check_vma=False
        )(*inputs)

    def _init_impl(self, batch_size, max_len, dtype, paging):
        self.trace_counts["init"] += 1
        if self.sharded_pages:  # each batch shard: its rows over its own share of the pages
            shards = batch_shards(self.mesh)
            local = dataclasses.replace(paging, num_pages=paging.num_pages // shards)
            make = lambda: init_state(
                self.config,
                batch_size // shards,
                max_len,
                dtype,  # noqa: E731
                self.dtype,
                local,
            )
            return jax.shard_map(
                make,
                mesh=self.mesh,
                in_specs=(),
                out_specs=paged_state_specs(jax.eval_shape(make)),
                check_vma=False,
            )()
        return self._constrain(
            init_state(self.config, batch_size, max_len, dtype, self.dtype, paging)
        )

    def _append_rows_impl(self, params, state, rows, tokens, mask):
        self.trace_counts["append_rows"] += 1
        if self.sharded_pages:
            return self._per_shard(
                lambda p, *a: append_rows(
                    nnx.merge(self.graphdef, p), *a, chunk=self.prefill_chunk
                ),
                params,
                state,
                rows,
                tokens,
                mask,
            )
        return append_rows(
            nnx.merge(self.graphdef, params),
            state,
            rows,
            tokens,
            mask,
            self._constrain,
            self.prefill_chunk,
        )

    def _copy_rows_impl(self, state, dst, src):
        self.trace_counts["copy_rows"] += 1
        if self.sharded_pages:
            return self._per_shard(copy_rows, None, state, dst, src)
        return self._constrain(copy_rows(state, dst, src))

    def _release_impl(self, state, rows):
        self.trace_counts["release"] += 1
        if self.sharded_pages:
            return self._per_shard(release_rows, None, state, rows)
        return self._constrain(release_rows(state, rows))

    def _append_impl(self, params, state, tokens, mask):
        self.trace_counts["append"] += 1
        if self.sharded_pages:
            return self._per_shard(
                lambda p, *a: append(nnx.merge(self.graphdef, p), *a, chunk=self.prefill_chunk),
                params,
                state,
                tokens,
                mask,
            )
        return append(
            nnx.merge(self.graphdef, params),
            state,
            tokens,
            mask,
            self._constrain,
            self.prefill_chunk,
        )

    def _decode_impl(
        self,
        params,
        state,
        key,
        budget,
        active,
        offset=None,
        history=None,
        *,
        sampling,
        top_logprobs=0,
    ):
        self.trace_counts["decode"] += 1
        extra = {} if history is None else {"history": history}
        run = functools.partial(
            self._decode_local, sampling=sampling, offset=offset, top_logprobs=top_logprobs, **extra
        )
        if self.sharded_pages:
            if key.ndim != 2:
                raise ValueError(
                    "decode: a paged KV cache on a mesh samples each row with its "
                    "own key: pass [B] keys (one key would be split per shard)"
                )
            return self._per_shard(run, params, state, key, budget, active, with_output=True)
        sample_fn = sample
        if key.ndim == 2 and self.mesh is not None and key.shape[0] % batch_shards(self.mesh) == 0:
            sample_fn = rows_local_sample(self.mesh)
        return run(
            params, state, key, budget, active, constrain=self._constrain, sample_fn=sample_fn
        )

    def _decode_local(
        self,
        params,
        state,
        key,
        budget,
        active,
        *,
        sampling,
        constrain=lambda x: x,
        sample_fn=sample,
        offset=None,
        top_logprobs=0,
        history=None,
    ):
        if key.ndim == 2:  # per-row key data
            key = jax.random.wrap_key_data(key)
        return decode(
            nnx.merge(self.graphdef, params),
            state,
            key,
            budget,
            active,
            sampling=sampling,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            unroll_layers=self.unroll_layers,
            constrain=constrain,
            sample_fn=sample_fn,
            offset=offset,
            top_logprobs=top_logprobs,
            history=history,
        )
