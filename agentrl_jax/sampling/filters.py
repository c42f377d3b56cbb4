"""Next-token distributions from logits: greedy, temperature, top-k, top-p, valid-vocab mask.

All functions take float32 logits ``[B, V]`` and are jittable with static shapes.

The sampling distribution is built in transformers' order: drop ids ``>= valid_vocab_size``
(Qwen3's embedding has 151,936 rows, its tokenizer 151,669 ids), divide by ``temperature``,
keep the ``top_k`` largest logits, then keep the smallest prefix of the remaining tokens, in
order of decreasing probability, whose probability reaches ``top_p`` (token ``i`` of that
order is kept iff the tokens before it hold less than ``top_p``; the first is always kept),
and renormalise. Ties are ordered by lower id first (``lax.top_k``'s order).

Top-p prefilter and its exactness bound
---------------------------------------
Sorting 151,936 logits per row is slow on CPU (~350 ms per step at batch 8, against ~4 ms for
``lax.top_k`` of 256). With top-p and no top-k we therefore rank only the largest logits,
with probabilities still normalised over the whole (valid) vocabulary. Ranking ``k``
candidates is exactly top-p whenever the nucleus fits inside them, i.e. whenever the ``k``
candidates hold at least ``top_p`` of the mass (the cumulative probability then reaches
``top_p`` at or before the last candidate, so every later token is dropped).

The candidates come in stages, each taken only when the previous one misses the bound for
some row of the batch (``lax.cond``): the ``first_prefilter_k`` (32) largest, then the
``prefilter_k`` (256) largest, then the whole vocabulary (below). A trained model's nucleus
at top-p 0.9 usually holds a handful of tokens, and ``lax.top_k`` on CPU costs about in
proportion to ``k`` (batch 8 x 1,000 logits: 24 us for 32, 84 us for 256), so the first stage
is the one that runs. :func:`top_k` takes large vocabularies in two levels (blocks with the
largest maxima, then the top ``k`` inside them): 0.28 ms instead of 1.9 ms for 32 of 151,936
at batch 8.

When a row misses even the last stage (a very flat distribution), that row switches to an
exact search over the whole vocabulary with no sort (computed for the batch when any row needs
it, used only by the rows that do: a row's draw depends on its own logits and key, never on
which other rows share its batch, e.g. a finished row's or a seat's neighbours): the
nucleus is ``{logit >= t}`` for the smallest ``t`` such that the tokens with logits above
``t`` hold less than ``top_p``, found by a 32-step bisection over the float32 bit patterns
(32 masked sums over ``[B, V]``; ~25 ms per step at batch 8 x 151,936 on CPU). The only
difference from the sorted definition: tokens tied exactly at the boundary logit are all
kept, where sorting would keep a prefix of them by id. So sampling is always exact top-p (up to
float32 rounding of the probability sums); only its cost depends on the bound. Under
``vmap`` ``lax.cond`` runs both branches, so do not ``vmap`` these functions.

Sampling is by inverse CDF (one uniform per level), not Gumbel-max: drawing 151,936 Gumbel
variates per row per step costs ~70 ms at batch 8 on CPU, the two-level inverse CDF below
about 1 ms.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# Two-level scans (inverse-CDF sampling, argmax) look at per-block summaries, then one block.
_BLOCK_SIZES = (256, 128, 64)  # the first dividing V avoids padding (151,936 = 1,187 x 128)


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """``[B, N] -> [B, N / S, S]`` for a block size ``S`` from ``_BLOCK_SIZES``, padding the
    end with ``fill`` only when none divides ``N``."""
    batch, n = x.shape
    size = next((s for s in _BLOCK_SIZES if n % s == 0), _BLOCK_SIZES[0])
    blocks = -(-n // size)
    if blocks * size != n:
        x = jnp.pad(x, ((0, 0), (0, blocks * size - n)), constant_values=fill)
    return x.reshape(batch, blocks, size)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to turn logits into the next token (hashable: a static argument of jitted code).

    ``temperature`` 0 means greedy (argmax); ``top_k`` 0 and ``top_p`` 1 mean "off".
    ``first_prefilter_k`` and ``prefilter_k``: how many candidates top-p without top-k ranks
    in its first and second stage (see the module doc; ``prefilter_k`` is the most it ever
    ranks); the results never depend on them, only the cost does.
    ``valid_vocab_size``: ids at or above it are never produced (None: all logits are ids).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    first_prefilter_k: int = 32
    prefilter_k: int = 256
    valid_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(
                f"SamplingConfig.temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        for name in ("top_k", "first_prefilter_k", "prefilter_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SamplingConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("first_prefilter_k", "prefilter_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"SamplingConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")
        valid = self.valid_vocab_size
        if valid is not None and (
            isinstance(valid, bool) or not isinstance(valid, int) or valid < 1
        ):
            raise ValueError(
                f"SamplingConfig.valid_vocab_size must be a positive int or None, "
                f"got {self.valid_vocab_size!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncated(self) -> bool:
        """Whether top-k or top-p removes any token."""
        return self.top_k > 0 or self.top_p < 1

    def prefilter_stages(self, vocab_size: int) -> tuple[int, ...]:
        """The candidate counts top-p (without top-k) tries in turn over ``vocab_size``
        logits: ``first_prefilter_k`` then ``prefilter_k`` (the most ever ranked), each capped
        by the vocabulary, without repeats; when the last is below ``vocab_size`` the
        whole-vocabulary search follows it."""
        last = min(self.prefilter_k, vocab_size)
        return tuple(sorted({min(self.first_prefilter_k, last), last}))


# ---------------------------------------------------------------------------- pieces
def mask_invalid_vocab(logits: jax.Array, valid_vocab_size: int | None) -> jax.Array:
    """``[B, V]`` logits with ids ``>= valid_vocab_size`` set to -inf."""
    if valid_vocab_size is None or valid_vocab_size >= logits.shape[-1]:
        return logits
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < valid_vocab_size, logits, -jnp.inf)


def scaled_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """Valid-vocab-masked logits divided by the temperature (greedy: just masked)."""
    masked = mask_invalid_vocab(logits.astype(jnp.float32), config.valid_vocab_size)
    return masked if config.greedy else masked / config.temperature


def argmax(logits: jax.Array) -> jax.Array:
    """Row-wise first index of the maximum ``[B, V] -> [B]`` int32, as ``jnp.argmax``.

    Two levels (the first block holding the maximum, then the first maximum inside it),
    because XLA:CPU's variadic argmax reduction is ~30x slower than a plain max over V.
    """
    blocked = _blocks(logits, -jnp.inf)
    block = jnp.argmax(jnp.max(blocked, axis=-1), axis=-1)
    inside = jnp.take_along_axis(blocked, block[:, None, None], axis=1)[:, 0]
    return (block * blocked.shape[-1] + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` for ``x [B, V]``: the same ``values [B, k]`` and ``ids [B, k]``
    int32 (descending, ties by lower id first).

    When blocks of ``S`` (from ``_BLOCK_SIZES``) divide ``V`` and ``4 k S <= V``, two levels:
    the ``k`` blocks with the largest maxima (ties: lower block first) hold every top-``k``
    element (a block left out has ``k`` chosen blocks ahead of it, each holding its maximum,
    which is ahead of all the left-out block's elements); their ``k S`` entries, gathered in id
    order, are ranked by ``lax.top_k``. XLA:CPU's top-k costs about ``V log k``, the first
    level one pass over ``V``.
    """
    batch, vocab = x.shape
    size = next((s for s in _BLOCK_SIZES if vocab % s == 0), None)
    if size is None or 4 * k * size > vocab:
        return jax.lax.top_k(x, k)
    blocked = x.reshape(batch, vocab // size, size)
    _, blocks = jax.lax.top_k(jnp.max(blocked, axis=-1), k)
    blocks = jnp.sort(blocks, axis=-1)  # id order, so lax.top_k below breaks ties by id
    candidates = jnp.take_along_axis(blocked, blocks[:, :, None], axis=1).reshape(batch, -1)
    values, position = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(blocks, position // size, axis=1) * size + position % size
    return values, ids.astype(jnp.int32)


def model_log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``log softmax(logits)[b, tokens[b]]`` ``[B]``: the unmodified model distribution
    (temperature 1, no truncation, whole ``V``), the log-probability RL objectives need."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def nucleus_keep(sorted_logits: jax.Array, log_normaliser: jax.Array, top_p: float) -> jax.Array:
    """Which of ``sorted_logits [B, K]`` (descending) are in the top-p nucleus ``[B, K]`` bool.

    Probabilities are ``exp(sorted_logits - log_normaliser[:, None])``; token ``i`` is kept iff
    the tokens before it hold less than ``top_p``.
    """
    probs = jnp.exp(sorted_logits - log_normaliser[:, None])
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return mass_before < top_p


def _candidates(
    scaled: jax.Array, config: SamplingConfig, k: int, log_normaliser: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``k`` largest scaled logits with the filters applied.

    ``log_normaliser [B]``: ``logsumexp(scaled)`` for top-p without top-k (computed if None).
    Returns ``ids [B, k]``, ``log_probs [B, k]`` under the sampling distribution (-inf for
    dropped candidates) and ``exact [B]``: whether no token outside the ``k`` could be kept.
    """
    values, ids = top_k(scaled, k)
    keep = jnp.ones(values.shape, bool)
    if config.top_k:
        keep &= jnp.arange(k) < config.top_k
        log_norm = jax.nn.logsumexp(jnp.where(keep, values, -jnp.inf), axis=-1)
        exact = jnp.ones(values.shape[:1], bool)  # callers pass k = min(top_k, V)
    else:  # normalised over the whole vocabulary, not just the k candidates
        log_norm = jax.nn.logsumexp(scaled, axis=-1) if log_normaliser is None else log_normaliser
        covered = jnp.sum(jnp.exp(values - log_norm[:, None]), axis=-1)
        exact = (covered >= config.top_p) | (k == scaled.shape[-1])
    if config.top_p < 1:
        keep &= nucleus_keep(values, log_norm, config.top_p)
    kept = jnp.where(keep, values, -jnp.inf)
    return ids, kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True), exact


def _sortable_bits(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (negative floats' magnitude bits flipped)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def nucleus_by_threshold(scaled: jax.Array, top_p: float) -> jax.Array:
    """Top-p over the whole vocabulary without sorting: ``[B, V]`` bool.

    Keeps ``scaled >= t`` for the smallest float ``t`` whose strictly-larger logits hold less
    than ``top_p`` (bisection over the order-preserving int32 image of float32: 32 steps
    suffice for its 2**32 values). Equals :func:`nucleus_keep` on sorted logits except that
    all tokens tied exactly at the boundary are kept.
    """
    probs = jax.nn.softmax(scaled, axis=-1)
    keys = _sortable_bits(scaled)

    def halve(_, bounds):  # invariant: the answer lies in [low, high]
        low, high = bounds
        mid = (low >> 1) + (high >> 1) + (low & high & 1)  # no int32 overflow
        below_p = jnp.sum(jnp.where(keys > mid[:, None], probs, 0.0), axis=-1) < top_p
        return jnp.where(below_p, low, mid + 1), jnp.where(below_p, mid, high)

    _, threshold = jax.lax.fori_loop(0, 32, halve, (jnp.min(keys, -1), jnp.max(keys, -1)))
    return keys >= threshold[:, None]


def _over_candidates(
    scaled: jax.Array,
    config: SamplingConfig,
    use: Callable[[jax.Array | None, jax.Array], jax.Array | tuple],
):
    """``use(ids, log_probs)`` over the filtered candidates, exact for every row, and each row's
    result a function of its own row only.

    ``ids [B, K]`` maps candidate to token id (None: candidate ``i`` is id ``i``, K = V); ids
    ``>= V`` are padding, with log-probability -inf. With top-p and no top-k, ranks
    ``config.prefilter_stages(V)`` candidates in turn, each stage taken (``lax.cond``) only
    when some row's nucleus did not fit in the previous one, and ends with
    :func:`nucleus_by_threshold` over the whole vocabulary. The stages share one shape (the
    last one's), so ``use`` is traced once for them all: fewer branches to compile.
    """
    vocab = scaled.shape[-1]
    if config.top_k:
        ids, log_probs, _ = _candidates(scaled, config, min(config.top_k, vocab))
        return use(ids, log_probs)
    log_norm = jax.nn.logsumexp(scaled, axis=-1)
    stages = config.prefilter_stages(vocab)

    def ranked(stages: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
        ids, log_probs, exact = _candidates(scaled, config, stages[0], log_norm)
        padding = ((0, 0), (0, stages[-1] - stages[0]))
        ids = jnp.pad(ids, padding, constant_values=vocab)
        log_probs = jnp.pad(log_probs, padding, constant_values=-jnp.inf)
        if len(stages) == 1:
            return ids, log_probs, exact
        return jax.lax.cond(
            jnp.all(exact), lambda _: (ids, log_probs, exact), lambda _: ranked(stages[1:]), None
        )

    ids, log_probs, exact = ranked(stages)
    if stages[-1] == vocab:
        return use(ids, log_probs)

    prefiltered = use(ids, log_probs)

    def whole_vocabulary(_):  # some row's nucleus is wider than every prefilter: no sort
        kept = jnp.where(nucleus_by_threshold(scaled, config.top_p), scaled, -jnp.inf)
        whole = use(None, jax.nn.log_softmax(kept, axis=-1))
        # only the rows that need it take the whole-vocabulary result (its order of candidates
        # differs, so a draw from it differs): every row's result is its own
        return jax.tree.map(
            lambda a, b: jnp.where(exact.reshape(exact.shape + (1,) * (a.ndim - 1)), a, b),
            prefiltered,
            whole,
        )

    return jax.lax.cond(jnp.all(exact), lambda _: prefiltered, whole_vocabulary, None)


# ---------------------------------------------------------------------------- public API
def filtered_log_probs(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """The sampling distribution's log-probabilities over the whole vocabulary ``[B, V]``
    (-inf for excluded ids). Greedy: 0 at the argmax, -inf elsewhere."""
    scaled = scaled_logits(logits, config)
    batch, vocab = scaled.shape
    rows = jnp.arange(batch)[:, None]
    if config.greedy:
        best = argmax(scaled)
        return jnp.where(jnp.arange(vocab) == best[:, None], 0.0, -jnp.inf)
    if not config.truncated:
        return jax.nn.log_softmax(scaled, axis=-1)

    def scatter(ids, log_probs):
        if ids is None:
            return log_probs
        return jnp.full(scaled.shape, -jnp.inf).at[rows, ids].set(log_probs, mode="drop")

    return _over_candidates(scaled, config, scatter)


def scoring_logits(logits: jax.Array, targets: jax.Array, config: SamplingConfig) -> jax.Array:
    """The sampling distribution's logits, for scoring given tokens under it ``[B, V]``.

    ``logits [B, V]`` float32 (the model's), ``targets [B]`` int: the valid-vocabulary mask,
    division by the temperature, and -inf outside the top-k/top-p kept set, so
    ``log_softmax`` of the result is :func:`filtered_log_probs`, the distribution
    :func:`sample` draws from. Differentiable: the kept set is chosen without gradient (it
    is a step function of the logits), the kept logits carry it. ``targets`` are always
    kept, so a sampled token that float rounding moves across the nucleus boundary keeps a
    finite log-probability. Greedy decoding has no density to score under: ValueError.
    """
    if config.greedy:
        raise ValueError(
            "scoring_logits: greedy decoding (temperature 0) has no sampling distribution "
            "to score under"
        )
    scaled = scaled_logits(logits, config)
    if not config.truncated:
        return scaled
    kept = jnp.isfinite(filtered_log_probs(jax.lax.stop_gradient(logits), config))
    kept |= jax.lax.broadcasted_iota(jnp.int32, kept.shape, 1) == targets[:, None]
    return jnp.where(kept, scaled, -jnp.inf)


def nucleus_fits_prefilter(
    logits: jax.Array, config: SamplingConfig, k: int | None = None
) -> jax.Array:
    """``[B]`` bool: whether each row's top-p nucleus fits in its ``k`` largest candidates
    (default ``config.prefilter_k``), so that stage is exact for it. Always True when top-k is
    on or top-p is off."""
    if config.greedy or config.top_k or config.top_p == 1:
        return jnp.ones(logits.shape[:1], bool)
    scaled = scaled_logits(logits, config)
    k = config.prefilter_k if k is None else k
    return _candidates(scaled, config, min(k, scaled.shape[-1]))[2]


def sample_categorical(key: jax.Array, log_weights: jax.Array) -> jax.Array:
    """One index per row drawn with probability ``softmax(log_weights)`` ``[B, N] -> [B]``.

    Two-level inverse CDF: pick a block of entries by its mass, then an entry inside it,
    each with its own uniform in (0, 1]. Exact up to float32 rounding; entries with weight 0
    (-inf) are never drawn. ``key``: one key for the batch, or ``[B]`` typed keys, one per row
    (a row's draw then depends only on its own key, not on its position or the batch size).
    """
    batch = log_weights.shape[0]
    weights = _blocks(jnp.exp(log_weights - jnp.max(log_weights, axis=-1, keepdims=True)), 0.0)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1:
        u_block, u_entry = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (2,)))(key).T
    else:
        u_block, u_entry = 1.0 - jax.random.uniform(key, (2, batch))  # (0, 1]
    block = _inverse_cdf(u_block, jnp.sum(weights, axis=-1))
    inside = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]
    return block * weights.shape[-1] + _inverse_cdf(u_entry, inside)


def _inverse_cdf(u: jax.Array, weights: jax.Array) -> jax.Array:
    """The first index whose cumulative weight reaches ``u * total`` (u in (0, 1]) ``[B]``."""
    cumulative = jnp.cumsum(weights, axis=-1)
    target = u * cumulative[:, -1]
    index = jnp.sum(cumulative < target[:, None], axis=-1)
    return jnp.minimum(index, weights.shape[-1] - 1).astype(jnp.int32)


def sample(
    key: jax.Array, logits: jax.Array, config: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Draw the next token of each row.

    logits: ``[B, V]`` float32; key: one key, or ``[B]`` typed keys (one per row, see
    :func:`sample_categorical`). Returns ``tokens [B]`` int32 and their log-probabilities
    under the sampling distribution ``[B]`` (0 for greedy).
    """
    scaled = scaled_logits(logits, config)
    if config.greedy:
        tokens = argmax(scaled)
        return tokens, jnp.zeros(tokens.shape, jnp.float32)
    if not config.truncated:
        tokens = sample_categorical(key, scaled)
        log_probs = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
        return tokens, log_probs - jax.nn.logsumexp(scaled, axis=-1)

    def draw(ids, log_probs):
        index = sample_categorical(key, log_probs)
        picked = lambda x: jnp.take_along_axis(x, index[:, None], axis=-1)[:, 0]  # noqa: E731
        tokens = index if ids is None else picked(ids).astype(jnp.int32)
        return tokens, picked(log_probs)

    return _over_candidates(scaled, config, draw)
