"""What a multi-turn rollout samples from: the :class:`Policy` protocol and its implementations.

The rollout (:mod:`agentrl_jax.rollout`) keeps every conversation as token ids of the tokenizer
and talks to a policy in three calls, each over all ``N`` rows of the batch (a row with
nothing to do gets an empty token list, or is not ``live``)::

    policy.start(contexts, settings)              # (re)start rows from whole contexts (prefill)
    out = policy.respond(live, max_tokens, keys)  # one response for each live row
    policy.extend(chunks)                         # tokens to add after each row's response
    policy.restart(contexts, which)               # optional: (re)start only the rows `which`

``start`` is called once at the first turn, and again whenever the rollout rebuilds the
contexts (a history window, see :mod:`agentrl_jax.rollout`); ``restart`` (a policy may lack
it: the rollout then calls ``start`` with every row's context) starts some rows afresh and
leaves the others as they are (a finished row's seat taken by a new row under continuous
batching, one row's window sliding); ``extend`` follows a response
with the tokens that close it and open the next turn. Rows never exceed
``settings.max_context`` tokens (the rollout checks before calling) and a response never
exceeds its row's ``max_tokens``. ``keys`` are ``[N]`` PRNG keys, one per row (typed, or raw
``uint32[N, 2]``): a row's response depends only on its own key and context, so the same row
gets the same response however the batch is composed, compacted or split (one key for the
whole batch is accepted too; rows then draw by their position in the batch).

Implementations:

* :class:`SamplerPolicy`: a Qwen3 model through the jitted sampler
  (:mod:`agentrl_jax.sampling`), whose KV cache carries over from turn to turn. Live rows are
  sampled together; when the live rows fit a smaller batch, the cache is
  compacted to them (row counts come from a few fixed buckets: ``N`` rounded up a
  little, then powers of two, :func:`row_buckets`), so finished rows stop costing decode work
  and batches of nearby sizes share their programs. Each bucket compiles its ``decode`` once and its
  ``append`` once per chunk width (a few powers of two): the number of compilations is bounded
  independently of the number of turns. Memory options: ``cache_dtype`` (e.g. bfloat16 KV
  cache for a float32 model), ``prefill_chunk`` (appends fed in chunks of that width), and
  ``generation_layout``: the parameters are put where decode reads them once per
  :meth:`~SamplerPolicy.using` (on an FSDP mesh, by default replicated over ``fsdp`` so decode
  all-gathers no weights; see :func:`agentrl_jax.sampling.generation_params`).
* :class:`ScriptedPolicy`: text from a Python function of each row's context text (tests,
  scripted agents such as a Q*-greedy player).
* :class:`TokenMap`: lets a tiny model with a small vocabulary stand in for a real one (the
  tokenizer's ids are mapped one to one onto the model's; an unmapped id is an error).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from agentrl_jax.sampling.filters import SamplingConfig


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """What the rollout asks of a policy (fixed for a whole rollout)."""

    max_context: int  # tokens a row may hold (prompt, responses, observations)
    max_response_tokens: int  # the most tokens of one response
    stop_token_ids: tuple[int, ...]  # a response ends after the first of these it samples
    sampling: SamplingConfig  # how tokens are drawn


@dataclasses.dataclass(frozen=True)
class Responses:
    """One turn's responses for ``N`` rows (NumPy).

    tokens: ``int32[N, R]`` tokenizer ids, 0 at and after ``lengths[n]``;
    lengths: ``int32[N]`` (0 for rows that were not live);
    logprobs: ``float32[N, R]`` log-prob of each token under the policy's model distribution
    (temperature 1, no truncation), 0 on padding;
    sampling_logprobs: ``float32[N, R]`` under the distribution the token was drawn from
    (temperature, top-k/top-p, valid vocabulary), 0 on padding; None: the same as
    ``logprobs`` (a policy that samples from its model distribution, e.g. a script);
    preempted: ``bool[N]``, rows the policy could not play this turn for want of memory (a
    paged KV cache whose pool ran out): their responses are empty and their caches gone, the
    caller restarts them from their contexts later and asks again (None: none);
    experts: ``int16[N, R, M, k]``, an MoE model's experts each token went through in each of
    its ``M`` MoE layers (-1 on padding), for routing replay (None: a dense model, or a policy
    that records none).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    sampling_logprobs: np.ndarray | None = None
    preempted: np.ndarray | None = None
    experts: np.ndarray | None = None

    @property
    def behaviour_logprobs(self) -> np.ndarray:
        """``sampling_logprobs``, or ``logprobs`` where the policy gave none."""
        return self.logprobs if self.sampling_logprobs is None else self.sampling_logprobs


class Policy(Protocol):
    """What the rollout calls. Optional: ``restart(contexts, which)`` (prefill some rows
    afresh; else the rollout starts every row again) and ``fork()`` (the same policy with a
    cache of its own, for a rollout's ``lanes``)."""

    def start(self, contexts: Sequence[Sequence[int]], settings: PolicySettings) -> None: ...

    def respond(self, live: np.ndarray, max_tokens: np.ndarray, key: jax.Array) -> Responses: ...

    def extend(self, chunks: Sequence[Sequence[int]]) -> None: ...


# ---------------------------------------------------------------------------- token map
class TokenMap:
    """A one-to-one map between some tokenizer ids and the ids ``0..K-1`` of a small model.

    Test and benchmark models can then use the real tokenizer and chat template with a
    ``K``-row embedding instead of 151,936 rows (whose output head would dominate a tiny model's
    cost). Model id ``k`` is the ``k``-th smallest mapped tokenizer id.
    """

    def __init__(self, tokenizer_ids: Sequence[int], tokenizer=None):
        ids = np.unique(np.asarray(list(tokenizer_ids), np.int64))
        if ids.size == 0 or ids[0] < 0:
            raise ValueError("TokenMap needs a non-empty set of non-negative tokenizer ids")
        self.tokenizer_ids = ids
        self._tokenizer = tokenizer  # only to name unknown tokens in errors

    @classmethod
    def from_texts(
        cls, tokenizer, texts: Sequence[str], extra_ids: Sequence[int] = ()
    ) -> "TokenMap":
        """Every id of ``texts`` (special tokens in the text count) plus ``extra_ids``."""
        encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
        return cls([i for ids in encoded for i in ids] + list(extra_ids), tokenizer)

    def __len__(self) -> int:
        return int(self.tokenizer_ids.size)

    def to_model(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        index = np.clip(np.searchsorted(self.tokenizer_ids, ids), 0, len(self) - 1)
        unknown = self.tokenizer_ids[index] != ids
        if np.any(unknown):
            bad = int(ids[unknown].reshape(-1)[0])
            name = "?" if self._tokenizer is None else self._tokenizer.convert_ids_to_tokens(bad)
            raise ValueError(
                f"TokenMap: tokenizer id {bad} ({name!r}) has no model id; build the "
                "map from texts that cover every prompt and observation"
            )
        return index.astype(np.int32)

    def to_tokenizer(self, model_ids: Any) -> np.ndarray:
        model_ids = np.asarray(model_ids, np.int64)
        if model_ids.size and (model_ids.min() < 0 or model_ids.max() >= len(self)):
            raise ValueError(
                f"TokenMap: model ids must be in [0, {len(self)}), got "
                f"[{model_ids.min()}, {model_ids.max()}]"
            )
        return self.tokenizer_ids[model_ids].astype(np.int32)


# ---------------------------------------------------------------------------- sampler policy


# ---------------------------------------------------------------------------- scripted policy
Script = Callable[[list[str], np.ndarray], Sequence[str]]


class ScriptedPolicy:
    """Responses from ``script(contexts, live) -> texts``: ``contexts[n]`` is row ``n``'s whole
    context decoded (special tokens kept), ``texts[n]`` its reply (read only where ``live``).

    A reply is tokenized and ends with a stop token, as a model's would (at the first one, if the
    text holds one); a reply longer than the row's ``max_tokens`` is cut there (and has no stop
    token). Log-probs are 0.
    """

    def __init__(self, tokenizer, script: Script):
        self.tokenizer = tokenizer
        self.script = script
        self._texts: list[str] = []
        self._settings: PolicySettings | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def fork(self) -> "ScriptedPolicy":
        """The same script with rows of its own (a rollout lane)."""
        return type(self)(self.tokenizer, self.script)

    def start(self, contexts: Sequence[Sequence[int]], settings: PolicySettings) -> None:
        self._settings = settings
        self._texts = [self._decode(c) for c in contexts]

    def extend(self, chunks: Sequence[Sequence[int]]) -> None:
        for n, chunk in enumerate(chunks):
            if len(chunk):
                self._texts[n] += self._decode(chunk)

    def restart(self, contexts: Sequence[Sequence[int]], which: np.ndarray) -> None:
        for n in np.flatnonzero(np.asarray(which, bool)):
            self._texts[n] = self._decode(contexts[n])

    def respond(self, live: np.ndarray, max_tokens: np.ndarray, key: jax.Array) -> Responses:
        live = np.asarray(live, bool)
        replies = self.script(list(self._texts), live)
        if len(replies) != len(live):
            raise ValueError(f"the script returned {len(replies)} replies for {len(live)} rows")
        n, width = len(live), self._settings.max_response_tokens
        out = Responses(
            np.zeros((n, width), np.int32), np.zeros(n, np.int32), np.zeros((n, width), np.float32)
        )
        stops = set(self._settings.stop_token_ids)
        for r in np.flatnonzero(live):
            ids = self.tokenizer(replies[r], add_special_tokens=False)["input_ids"]
            ids += list(self._settings.stop_token_ids[:1])
            first_stop = next(i for i, token in enumerate(ids) if token in stops)
            ids = ids[: min(first_stop + 1, int(max_tokens[r]))]
            out.tokens[r, : len(ids)] = ids
            out.lengths[r] = len(ids)
            self._texts[r] += self._decode(ids)
        return out
