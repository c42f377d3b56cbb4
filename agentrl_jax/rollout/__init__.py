"""Multi-turn rollouts with a visible turn budget (paper §1, §5, §6).

A rollout plays ``G`` trajectories of each task of a batch against a text environment
(:class:`envs.protocol.TextEnv`) with a policy (:class:`agentrl_jax.sampling.Policy`) and
returns a :class:`~agentrl_jax.trajectory.Trajectory`::

    runner = MultiTurnRollout(env, tokenizer, RolloutConfig(group_size=16, budget=20))
    result = runner(SamplerPolicy(model), task_ids, key)   # RolloutResult
    result.trajectory                                       # Trajectory, N = len(task_ids) * G
    train_rollout = runner.for_training(SamplerPolicy(model))  # (params, key, tasks) -> Trajectory

Layout: row ``n`` plays task ``task_ids[n // G]`` in task group ``n // G``; the ``G`` rows of a
group share one budget ``B``: the config's fixed ``budget``, the caller's ``budgets[k]``, or a
BudgetMix draw from ``budget_set(env.t_max)`` (paper §5).

The loop, one iteration per turn ``t = 0, 1, ...``:

1. every live row samples a response at once (one batched decode on the continuing KV cache);
2. responses are decoded and played in the environment (one batched step; the environment
   parses them, an unparsable one is an invalid action);
3. a row ends on success or failure (``done``), after ``B`` turns, on an invalid action if
   ``end_on_invalid``, or when its context is full (flagged ``overflow``);
4. rows that go on get the tokens that close their response (the end-of-turn token, when the
   response was cut at ``max_response_tokens``) and the next user message, the budget-aware
   turn text (``[MAX TURNS] B [CURRENT TURN] t+1 [REMAINING TURNS] B-t-1`` and the observation).

The conversation is kept as tokens, never re-rendered, so training sees exactly what was
sampled (Qwen3's template would drop earlier ``<think>`` blocks). ``Trajectory.tokens`` are
tokenizer ids (a :class:`~agentrl_jax.sampling.TokenMap` policy maps them to its model's ids).

Context overflow is never silent: a response is capped at the room left in the context
(``max_context`` tokens of KV cache, ``record_tokens`` of record); a response cut by that cap
(below ``max_response_tokens``, with no stop token) is not played: its turn is recorded with no
valid action and the row ends with ``overflow``; a row whose next user message does not fit
ends after its last played turn, also with ``overflow``. A prompt that does not fit at all
gives a row with no turns and ``overflow``.

History window: with ``history_window = k`` the policy sees the system header and only the
last ``k`` turns (plus the current user message). Once the window slides (``t > k``), every
turn rebuilds each live row's context from the recorded tokens of the kept turns and
*re-prefills* it into a fresh cache (the cached keys of a window cannot be reused: positions
and attention change when the oldest turn leaves). That costs a prefill of about
``prefix + k * (turn tokens)`` per row per turn, against only the new chunk with the whole
history kept, which is why the window is off by default. The record still holds the whole
conversation; ``context_start`` says where each turn's context began.

Budgets (§6): the system prompt states ``B``; turn ``t``'s user message states ``B``, ``t``
(turns completed) and ``B - t``. A row that has not succeeded after ``B`` turns gets reward 0
(``success`` False). Per-turn rewards are the environment's, plus ``invalid_penalty`` on an
invalid action.

Throughput: the model work is batched over live rows every turn and the environment steps the
whole batch in one call (one per lane with ``lanes``); the policy drops finished rows from its cache
once at most half are live (see :class:`~agentrl_jax.sampling.SamplerPolicy`). Shapes are fixed
by the config, so no turn recompiles. The loop itself is host Python: templating, tokenizing and
decoding are per row and cached where texts repeat.

Memory (``max_rows_per_call``): a policy's KV cache holds all its rows for the whole
conversation, so a large batch (the paper's 32 tasks x 16) can need more memory than a device
has. With ``max_rows_per_call = R`` the batch is played in parts of whole task groups of at
most ``R`` rows (as even as possible, :func:`row_parts`), one part after another, each from
``policy.start`` to its last turn; one environment state holds every row (reset once, rows
outside the playing part are not live, so it leaves them untouched) and one record collects
them, so the result is one Trajectory of the whole batch.

Continuous batching (``refill``): the policy holds ``max_rows_per_call`` seats and rows wait in
one queue; every loop iteration plays one turn of every seated row, each at its own turn, and
a row whose episode ended gives its seat to the next waiting row at once (its first prompt
prefilled into that seat alone, :meth:`~agentrl_jax.sampling.SamplerPolicy.restart`). Parts are
the same loop with a queue per part, seated only when every seat is empty. A task group's rows
are seated together in order, and the Trajectory comes out whole at the end, so GRPO/GiGPO
groups are never split.

Lanes (``lanes = n``): the seats are split into ``n`` lanes, each a cache of its own (the
policy and its ``fork()``s; whole task groups of seats where the seats allow, so a group's
first prompt is still prefilled once). Each lane seats rows by the rules above on its own
seats, so with parts a lane whose seats are empty starts on the next part while another still
plays the last one, and preemption's "one row alone" applies per lane. The loop visits the
lanes in turn; a lane's environment step is
handed to one background thread (steps run one at a time, in order, each from the state the
one before left) and the next lane samples meanwhile; the lane takes the answer on its next
visit. So an environment whose steps take real time (a Python environment's queries, test runs
or sandboxes, off the device that decodes) costs at most what decoding does not already
hide. Each lane's calls hold fewer rows (smaller decode batches, maybe more compiled
shapes), so a jitted environment like FrozenLake's gains nothing from it; and on an
accelerator in bfloat16 a smaller batch can round differently, so lanes give the one-lane
tokens only up to the float rounding discussed below.

Randomness: budgets, the environment's seed and the policy's key come from ``key``; the
policy gets one key per row per turn, ``fold_in(fold_in(key_policy, turn), row)``
(:func:`row_keys`), and the environment keys its rows by their index in the whole batch. So a
row's conversation does not depend on which rows share its call: splitting a batch into parts,
continuous batching, lanes (or a policy compacting its cache) give every row the same tokens
for the same ``key`` (up to
the float rounding of differently sized batches, which could only flip a draw that lands
exactly on a boundary; the log-probs agree to ~1e-6).

Several processes (``split_processes``) are one more such split: every process resets every
row but plays only its share (:func:`~agentrl_jax.distributed.row_shares`) on its own
devices, then the rows are gathered over the policy's devices only (one per process,
:func:`~agentrl_jax.rollout.loop.gather_device`: rollout devices of their own never wait behind
the update in flight on the training devices), so each returns the whole result. Every
process must make the same calls; the stats' seconds are this process's own.
"""

from agentrl_jax.rollout.config import RolloutConfig, RolloutResult, RolloutStats
from agentrl_jax.rollout.loop import MultiTurnRollout
from agentrl_jax.rollout.seating import lane_seats, row_keys, row_parts

__all__ = [
    "MultiTurnRollout",
    "RolloutConfig",
    "RolloutResult",
    "RolloutStats",
    "lane_seats",
    "row_keys",
    "row_parts",
]
