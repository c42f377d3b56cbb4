"""The multi-turn rollout with a tiny random Qwen3 policy: the 64 tasks x G = 16 run and its
compilations, recorded log-probs against teacher forcing (whole history, windows, compacted
batches, the re-encoding baseline), and the trainer's entry point."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_counter import count_backend_compiles
from flax import nnx

from agentrl_jax.algorithms.budgetmix import budget_set
from agentrl_jax.bench.rollout import frozenlake_token_map, tiny_policy_model
from agentrl_jax.models import positions_from_mask
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import Paging, SamplerPolicy
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


# ---------------------------------------------------------------------------- a real policy
class Watched:
    """A policy wrapper noting, at each turn, the compilations and shapes used so far."""

    def __init__(self, policy, events):
        self.policy, self.events, self.marks = policy, events, []

    def start(self, contexts, settings):
        self.policy.start(contexts, settings)

    def extend(self, chunks):
        self.policy.extend(chunks)

    def respond(self, live, max_tokens, key):
        self.marks.append((len(self.events), len(self.policy.shapes_used)))
        return self.policy.respond(live, max_tokens, key)


def teacher_forced_logprobs(model, token_map, rows, width):
    """``log pi(token_i | tokens_<i)`` of each of ``rows`` (tokenizer id lists, right-padded to
    ``width`` in one batched forward): a list of float32 ``[len(row)]`` (0 at position 0)."""
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = token_map.to_model(row), True
    logp = np.asarray(_teacher_forced(nnx.graphdef(model), nnx.state(model), ids, mask))
    return [np.concatenate([[0.0], logp[i, : len(row) - 1]]) for i, row in enumerate(rows)]


def count_preemptions(policy) -> list[int]:
    """The rows ``policy`` and its forks preempt at each ``respond`` from now on (the list
    fills as they play)."""
    counts = []

    def watch(p):
        respond, fork = p.respond, p.fork

        def counted(*args):
            out = respond(*args)
            counts.append(0 if out.preempted is None else int(out.preempted.sum()))
            return out

        p.respond, p.fork = counted, lambda: watch(fork())
        return p

    watch(policy)
    return counts


def six_groups_of_two(env, tokenizer, reference):
    """``(config, tasks, key, whole)``: 6 groups of 2 rows (BudgetMix budgets, so rows end at
    different turns) played all at once by ``reference`` (the static engine), the rollout the
    seated, laned and preempting variants must reproduce."""
    config = RolloutConfig(group_size=2, max_response_tokens=4, max_context=SMALL_CONTEXT)
    tasks, key = np.array([4, 9, 2, 7, 11, 5]), jax.random.key(6)
    whole = MultiTurnRollout(env, tokenizer, config)(reference.using(reference.params), tasks, key)
    return config, tasks, key, whole


def assert_same_trajectory(got, want):
    """Every field equal; log-probs to 1e-5 (the same tokens, from batches of other shapes)."""
    for field in dataclasses.fields(want):
        ours, theirs = getattr(got, field.name), getattr(want, field.name)
        if field.name in ("logprobs", "sampling_logprobs"):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0, err_msg=field.name)
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=field.name)


@functools.partial(jax.jit, static_argnums=0)
def _teacher_forced(graphdef, state, ids, mask):
    logits, _ = nnx.merge(graphdef, state)(ids, positions_from_mask(mask), mask)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]


@pytest.fixture(scope="module")
def tiny_policy(tokenizer):
    return make_tiny_policy(tokenizer)


def make_tiny_policy(tokenizer):
    """``(env, runner, token_map, model)``: 64 FrozenLake 4x4 maps, the 64 x 16 runner, the
    token map of what it can meet, a tiny random Qwen3 over it (also used by child processes)."""
    maps = fl_maps.generate(jax.random.key(1), 64, size=4, p=0.8)
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=20))
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(group_size=16, budget=20, max_response_tokens=4, max_context=1536),
    )
    token_map = frozenlake_token_map(runner, budget_set(20))
    model = tiny_policy_model(
        len(token_map),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
    )
    return env, runner, token_map, model


@pytest.fixture(scope="module")
def shared_policy(tiny_policy):
    """One policy (so one set of compiled functions) for the small tests; each test takes
    ``shared_policy.using(params)``, which keeps the compilations and starts ``shapes_used``
    afresh. Small tests use ``SMALL_CONTEXT`` so that their shapes coincide."""
    _, _, token_map, model = tiny_policy
    return SamplerPolicy(model, token_map=token_map, min_rows=1)


SMALL_CONTEXT = 768
PAGED = Paging(page_size=16, block_pages=4)
SMALL_POOL = Paging(page_size=16, num_pages=60, block_pages=4)  # room for ~1.25 long rows


class Engines:
    """One compiled policy per engine (``None``: the static cache, or a :class:`Paging`) for the
    batching matrices: ``engines(paging)`` is that engine's policy afresh (``using``: no rows,
    ``shapes_used`` empty), its compilations shared with every test before it; ``seen`` holds
    the shapes each engine compiled so far."""

    def __init__(self, model, token_map):
        self.model, self.token_map = model, token_map
        self.base: dict = {}
        self.seen: dict = {}

    def __call__(self, paging):
        if paging not in self.base:
            self.base[paging] = SamplerPolicy(
                self.model, token_map=self.token_map, min_rows=1, paging=paging
            )
            self.seen[paging] = set()
        base = self.base[paging]
        return base.using(base.params)

    def assert_one_compilation_per_new_shape(self, policy, paging, before):
        """Since ``before`` (``trace_counts``), ``policy`` compiled decode and append once per
        shape it used that its engine had not compiled yet; that engine has now seen them."""
        new = policy.shapes_used - self.seen[paging]
        traces = policy.trace_counts
        for kind in ("decode", "append"):
            assert traces[kind] - before[kind] == len({s for s in new if s[0] == kind}), kind
        self.seen[paging] |= policy.shapes_used


@pytest.fixture(scope="module")
def engines(tiny_policy):
    _, _, token_map, model = tiny_policy
    return Engines(model, token_map)


@pytest.fixture(scope="module")
def six_groups(tiny_policy, shared_policy, tokenizer):
    """:func:`six_groups_of_two` by the static engine, played once for every test."""
    return six_groups_of_two(tiny_policy[0], tokenizer, shared_policy)


@pytest.mark.slow
@pytest.mark.optimized  # its rollout runs long: 18 s at -O1, 32 s at the suite's -O0
def test_tiny_qwen3_on_64_tasks_x_16_compiles_a_fixed_number_of_times(tiny_policy, full_scale):
    """The acceptance run: 64 FrozenLake tasks x G = 16, B = 20, the real tokenizer, a random
    Qwen3 (vocabulary mapped to the ids the rollout can meet: see bench.rollout). CI runs 16
    tasks (256 rows: the same turns, buckets and compilations, a quarter of the decoding);
    ``--full-scale`` all 64."""
    env, runner, token_map, model = tiny_policy
    tasks = 64 if full_scale else 16
    n_rows = tasks * 16
    policy = SamplerPolicy(model, token_map=token_map)
    with count_backend_compiles() as events:
        watched = Watched(policy, events)
        result = runner(watched, np.arange(tasks), jax.random.key(0))
    traj = jax.device_get(result.trajectory)
    assert traj.tokens.shape == (n_rows, 1536) and traj.turn_mask.shape == (n_rows, 20)
    assert result.stats.turns == 20 and (traj.turns_used <= 20).all() and not traj.overflow.any()
    # compilations: once per shape the policy used, once for the env; none from turn to turn
    traces = policy.trace_counts
    kinds = lambda kind: {s for s in policy.shapes_used if s[0] == kind}  # noqa: E731
    assert traces["decode"] == len(kinds("decode")) and traces["append"] == len(kinds("append"))
    assert traces["take_rows"] == len(kinds("take_rows"))
    assert len(policy.shapes_used) <= 2 + 3 * len(kinds("decode"))  # a bounded handful
    assert dict(env.trace_counts) == {"reset": 1, "step": 1}
    for (compiled, shapes), (compiled_next, shapes_next) in zip(
        watched.marks[2:], watched.marks[3:]
    ):
        assert compiled_next == compiled or shapes_next > shapes  # compiles only for a new shape
    # what was recorded is what the model sampled: teacher-forced log-probs match
    picked = (0, n_rows // 2 + 5, n_rows - 1)
    rows = [traj.tokens[r][traj.token_mask[r]] for r in picked]
    for r, _row, expected in zip(
        picked, rows, teacher_forced_logprobs(model, token_map, rows, 1536)
    ):
        sampled = traj.loss_mask[r][traj.token_mask[r]]
        np.testing.assert_allclose(
            traj.logprobs[r][traj.token_mask[r]][sampled], expected[sampled], atol=2e-4
        )
    assert traj.action_valid.any()  # the random policy sometimes says a move


def test_window_rollout_logprobs_match_each_turns_context(tiny_policy, shared_policy, tokenizer):
    """With a window every turn is re-prefilled: re-score each turn on tokens[:prefix] +
    tokens[context_start:] and compare with the sampled log-probs."""
    env, _, token_map, model = tiny_policy
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(
            group_size=2,
            budget=5,
            max_response_tokens=4,
            max_context=SMALL_CONTEXT,
            history_window=1,
            record_tokens=1024,
        ),
    )
    result = runner(shared_policy.using(shared_policy.params), np.array([3, 8]), jax.random.key(2))
    traj = jax.device_get(result.trajectory)
    assert (traj.turns_used >= 3).any()
    contexts, sampled_at = [], []
    for r in range(4):
        prefix = int(traj.prefix_len[r])
        for t in range(int(traj.turns_used[r])):
            sampled = np.flatnonzero(traj.token_turn[r] == t)
            start = int(traj.context_start[r, t])
            contexts.append(
                np.concatenate([traj.tokens[r, :prefix], traj.tokens[r, start : sampled[-1] + 1]])
            )
            sampled_at.append((r, sampled))
    for (r, sampled), expected in zip(
        sampled_at, teacher_forced_logprobs(model, token_map, contexts, SMALL_CONTEXT)
    ):
        np.testing.assert_allclose(traj.logprobs[r, sampled], expected[-len(sampled) :], atol=2e-4)


def test_for_training_gives_the_trainer_fixed_shape_trajectories(
    tiny_policy, shared_policy, tokenizer
):
    env, _, _, model = tiny_policy
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(group_size=2, max_response_tokens=4, max_context=SMALL_CONTEXT),
    )
    rollout = runner.for_training(shared_policy)
    params = nnx.state(model)
    a = rollout(params, jax.random.key(0), jnp.array([1, 2]))
    b = rollout(jax.tree.map(lambda x: x * 1.0, params), jax.random.key(1), jnp.array([5, 6]))
    assert jax.tree.map(jnp.shape, a) == jax.tree.map(jnp.shape, b)
    assert a.turn_mask.shape == (4, 20) and (a.turns_used <= a.budget).all()
    assert a.logprobs[a.loss_mask].max() <= 0 and (a.logprobs[~a.loss_mask] == 0).all()


@pytest.mark.parametrize("reuse_cache", [True, False])
def test_finished_rows_leave_the_batch_and_the_rest_sample_on(
    tiny_policy, shared_policy, tokenizer, reuse_cache
):
    """Groups with budgets 1, 2, 3, 6 finish at different turns: the policy's batch shrinks to
    the bucket of the live rows (8, 4, 2, 1) and what every row sampled is still exactly what
    the model gives on its recorded conversation. ``reuse_cache=False`` is the benchmark's
    baseline (re-encoding every turn); it must be just as right."""
    env, _, token_map, model = tiny_policy
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(group_size=2, budget=6, max_response_tokens=4, max_context=SMALL_CONTEXT),
    )
    policy = (
        shared_policy.using(shared_policy.params)
        if reuse_cache
        else SamplerPolicy(model, token_map=token_map, min_rows=1, reuse_cache=False)
    )
    result = runner(
        policy, np.array([0, 1, 2, 3]), jax.random.key(3), budgets=np.array([1, 2, 3, 6])
    )
    traj = jax.device_get(result.trajectory)
    live = result.stats.live_rows
    assert live[0] == 8 and len(live) == 6 and live[-1] <= 2
    bucket = lambda n: min(b for b in (8, 4, 2, 1) if b >= n)  # noqa: E731
    assert {s[1] for s in policy.shapes_used if s[0] == "decode"} == {bucket(n) for n in live}
    rows = [traj.tokens[r][traj.token_mask[r]] for r in range(8)]
    for r, expected in enumerate(teacher_forced_logprobs(model, token_map, rows, SMALL_CONTEXT)):
        sampled = traj.loss_mask[r][traj.token_mask[r]]
        np.testing.assert_allclose(
            traj.logprobs[r][traj.token_mask[r]][sampled], expected[sampled], atol=2e-4
        )


@pytest.mark.parametrize("max_rows", [8, 4])
def test_a_batch_played_in_parts_is_the_batch_played_at_once(
    tiny_policy, shared_policy, tokenizer, max_rows
):
    """``max_rows_per_call``: 4 task groups of 2 rows played in parts of 8 or 4 rows (whole
    groups, one part after another) give the Trajectory of one call, token for token: keys
    are per row and the (slippery) environment keys rows by their index in the whole batch.
    No policy call held more than ``max_rows`` rows."""
    env, _, _, _ = tiny_policy
    config = RolloutConfig(group_size=2, max_response_tokens=4, max_context=SMALL_CONTEXT)
    tasks, key = np.array([4, 9, 2, 7, 11]), jax.random.key(6)
    whole = MultiTurnRollout(env, tokenizer, config)(
        shared_policy.using(shared_policy.params), tasks, key
    )
    policy = shared_policy.using(shared_policy.params)
    split = MultiTurnRollout(
        env, tokenizer, dataclasses.replace(config, max_rows_per_call=max_rows)
    )(policy, tasks, key)
    assert max(s[1] for s in policy.shapes_used) <= max_rows
    a, b = jax.device_get(whole.trajectory), jax.device_get(split.trajectory)
    assert jax.tree.map(np.shape, a) == jax.tree.map(np.shape, b)
    assert (a.turns_used > 1).any() and len(set(a.budget.tolist())) > 1  # BudgetMix budgets
    assert_same_trajectory(b, a)
    assert split.responses == whole.responses and split.env_seed == whole.env_seed
    assert split.stats.live_rows == whole.stats.live_rows
    assert split.stats.sampled_tokens == whole.stats.sampled_tokens


def test_a_group_prefills_its_shared_first_prompt_once_and_plays_the_same_conversations(
    tiny_policy, shared_policy, tokenizer
):
    """``share_prefixes`` (the default): the G rows of a task group start from one context, which
    is prefilled once and copied into each row's cache (one gather). The rollout is the one
    every row prefilling its own copy gives: same tokens, log-probs to 1e-5 (prefills of
    different batch sizes may round differently)."""
    env, _, token_map, model = tiny_policy
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(group_size=4, max_response_tokens=4, max_context=SMALL_CONTEXT),
    )  # BudgetMix budgets
    tasks, key = np.array([3, 8, 12]), jax.random.key(9)
    sharing = shared_policy.using(shared_policy.params)
    shared = jax.device_get(runner(sharing, tasks, key).trajectory)
    separate = jax.device_get(
        runner(
            SamplerPolicy(model, token_map=token_map, min_rows=1, share_prefixes=False), tasks, key
        ).trajectory
    )
    assert len(set(shared.budget.tolist())) > 1 and (shared.turns_used > 1).any()
    assert_same_trajectory(shared, separate)
    # 12 rows, 3 distinct first prompts: the first prefill ran on 4 rows (the 3 prompts and an
    # empty row: below the batch, sizes are powers of two), then one gather to the 12 rows (a
    # compaction is recorded the other way round: ("take_rows", fewer, more))
    assert ("take_rows", 12, 4) in sharing.shapes_used
    assert any(s[:2] == ("append", 4) for s in sharing.shapes_used)


def test_shared_contexts_lists_each_context_once_in_order():
    from agentrl_jax.sampling.scheduler import shared_contexts

    unique, index = shared_contexts([(1, 2), (1, 2), (), (3,), (1, 2), ()])
    assert (
        unique == [(1, 2), (), (3,)]
        and index.tolist() == [0, 0, 1, 2, 0, 1]
        and index.dtype == np.int32
    )


@pytest.mark.parametrize(
    "num_rows, min_rows, multiple, expected",
    [
        (1528, 8, 1, (1536, 1024, 512, 256, 128, 64, 32, 16, 8)),  # top: a 16th of 2048 = 128
        (1544, 8, 1, (1664, 1024, 512, 256, 128, 64, 32, 16, 8)),
        (2304, 8, 1, (2304, 2048, 1024, 512, 256, 128, 64, 32, 16, 8)),  # 2304 = 9 x 256
        (12, 1, 1, (12, 8, 4, 2, 1)),
        (12, 1, 8, (16, 8)),  # each a multiple of the mesh's 8 batch shards
        (6, 4, 1, (6, 4)),
        (3, 8, 1, (3,)),  # fewer rows than min_rows: no compaction
        (41, 64, 1, (44,)),  # the same, the batch rounded up to a 16th of 64
    ],
)
def test_row_buckets_round_the_batch_a_little_and_compact_to_shared_powers_of_two(
    num_rows, min_rows, multiple, expected
):
    """Evaluations of nearly the same number of rows (error states per policy pair) share
    their compiled batch sizes: the top is at most 1/8 above ``num_rows``, the rest powers of
    two whatever ``num_rows`` was (hand-computed)."""
    from agentrl_jax.sampling.scheduler import row_buckets

    buckets = row_buckets(num_rows, min_rows, multiple)
    assert buckets == expected
    assert num_rows <= buckets[0] <= -(-num_rows * 9 // 8 // multiple) * multiple


def test_chunked_prefill_and_a_bfloat16_cache_in_a_rollout(tiny_policy, shared_policy, tokenizer):
    """``SamplerPolicy(prefill_chunk=...)`` plays the same conversations (prompts of a few
    hundred tokens fed 64 at a time); a bfloat16 cache gives a well-formed Trajectory."""
    env, _, token_map, model = tiny_policy
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(group_size=2, budget=3, max_response_tokens=4, max_context=SMALL_CONTEXT),
    )
    tasks, key = np.array([1, 5]), jax.random.key(8)
    whole = jax.device_get(runner(shared_policy.using(shared_policy.params), tasks, key).trajectory)
    chunked_policy = SamplerPolicy(model, token_map=token_map, min_rows=1, prefill_chunk=64)
    chunked = jax.device_get(runner(chunked_policy, tasks, key).trajectory)
    assert max(s[2] for s in chunked_policy.shapes_used if s[0] == "append") > 64
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    bf16_policy = SamplerPolicy(model, token_map=token_map, min_rows=1, cache_dtype=jnp.bfloat16)
    bf16 = jax.device_get(runner(bf16_policy, tasks, key).trajectory)
    assert jax.tree.map(np.shape, bf16) == jax.tree.map(np.shape, whole)
    assert (bf16.turns_used >= 1).all() and bf16.logprobs[bf16.loss_mask].max() <= 0
    assert bf16_policy._state.cache.k.dtype == jnp.bfloat16


def test_the_paged_engine_plays_the_static_engines_conversations(
    tiny_policy, shared_policy, engines, tokenizer
):
    """``SamplerPolicy(paging=...)``: the same rollout as the static cache (the reference) --
    same tokens, log-probs to 1e-5 -- with finished rows releasing their pages each turn,
    prefix sharing copying pages, compaction moving page tables; compilations once per shape."""
    env, _, token_map, model = tiny_policy
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(group_size=4, max_response_tokens=4, max_context=SMALL_CONTEXT),
    )
    tasks, key = np.array([3, 8, 12, 5]), jax.random.key(11)
    static = jax.device_get(runner(shared_policy.using(shared_policy.params), tasks, key))
    paged_policy = engines(PAGED)
    before = paged_policy.trace_counts
    paged = jax.device_get(runner(paged_policy, tasks, key))
    a, b = static.trajectory, paged.trajectory
    assert len(set(a.budget.tolist())) > 1 and len(set(a.turns_used.tolist())) > 1
    assert_same_trajectory(b, a)
    assert paged.responses == static.responses
    decodes = {s for s in paged_policy.shapes_used if s[0] == "decode"}
    released = paged_policy.trace_counts["release"] - before["release"]
    assert released <= len(decodes)  # at most once per batch size
    engines.assert_one_compilation_per_new_shape(paged_policy, PAGED, before)
    # every episode ended: rows were released as they finished, so no page is held at the end
    state = paged_policy._state
    assert state is None or int(state.cache.pages_used) <= int(
        np.ceil(np.asarray(state.cache.lengths) / 16).sum()
    )


@pytest.mark.parametrize("paging", [None, PAGED], ids=["static", "paged"])
def test_continuous_batching_plays_the_whole_batchs_conversations(
    tiny_policy, six_groups, engines, tokenizer, paging
):
    """``refill``: 6 groups of 2 (BudgetMix budgets, so rows end at different turns) through 4
    seats; each ended row's seat takes the next waiting row (its first prompt prefilled into
    that seat alone, the pair of a group sharing one prefill on pages), so rows at different
    turns decode together. The Trajectory is the whole batch's, token for token (log-probs to
    1e-5); no policy call held more than 4 rows; compilations once per shape."""
    env = tiny_policy[0]
    config, tasks, key, whole = six_groups
    policy = engines(paging)
    before = policy.trace_counts
    restarts = []
    original = policy.restart
    policy.restart = lambda contexts, which: (
        restarts.append(np.flatnonzero(which).tolist()),
        original(contexts, which),
    )
    seated = MultiTurnRollout(
        env, tokenizer, dataclasses.replace(config, max_rows_per_call=4, refill=True)
    )(policy, tasks, key)
    a, b = jax.device_get(whole.trajectory), jax.device_get(seated.trajectory)
    assert len(set(a.budget.tolist())) > 1 and len(set(a.turns_used.tolist())) > 1
    assert_same_trajectory(b, a)
    assert seated.responses == whole.responses
    assert seated.stats.live_rows == whole.stats.live_rows
    # rows took seats while others played on (when every seated row ends at once, the next
    # rows start afresh instead); the first 4 took theirs at the start
    assert restarts and sum(len(r) for r in restarts) <= 12 - 4
    assert max(s[1] for s in policy.shapes_used) <= 4
    engines.assert_one_compilation_per_new_shape(policy, paging, before)


@pytest.mark.parametrize(
    "paging, seats",
    [(None, {}), (PAGED, {"max_rows_per_call": 4, "refill": True})],
    ids=["static_all_rows", "paged_4_seats"],
)
def test_lanes_play_the_whole_batchs_conversations(
    tiny_policy, six_groups, engines, tokenizer, paging, seats
):
    """``lanes=2``: the rows in two caches (the policy and its fork), the environment of one
    lane stepping while the other samples. The Trajectory is one lane's, token for token
    (log-probs to 1e-5); the fork shares the placed parameters and the compiled programs, and
    a second rollout compiles nothing (none per turn, none per refill)."""
    env, _, token_map, model = tiny_policy
    config, tasks, key, whole = six_groups
    policy = engines(paging)
    assert policy.fork().params is policy.params
    spied = SamplerPolicy(model, token_map=token_map, min_rows=1)
    spied.respond = lambda *args: None
    assert spied.fork().respond.__func__ is SamplerPolicy.respond  # a spy stays with its policy
    laned = MultiTurnRollout(env, tokenizer, dataclasses.replace(config, lanes=2, **seats))(
        policy, tasks, key
    )
    a, b = jax.device_get(whole.trajectory), jax.device_get(laned.trajectory)
    assert len(set(a.budget.tolist())) > 1 and len(set(a.turns_used.tolist())) > 1
    assert_same_trajectory(b, a)
    assert laned.responses == whole.responses and laned.stats.live_rows == whole.stats.live_rows
    assert max(s[1] for s in policy.shapes_used) <= (2 if seats else 6)
    traces = dict(policy.trace_counts)
    MultiTurnRollout(env, tokenizer, dataclasses.replace(config, lanes=2, **seats))(
        policy, tasks, key
    )
    assert dict(policy.trace_counts) == traces


@pytest.mark.parametrize(
    "refill, lanes",
    [(True, 1), (False, 1), (True, 2), (False, 2)],
    ids=["refill", "parts", "refill_2_lanes", "parts_2_lanes"],
)
def test_a_pool_smaller_than_the_rows_preempts_and_replays_the_same_conversations(
    tiny_policy, six_groups, engines, tokenizer, refill, lanes
):
    """4 seats whose rows grow to ~760 tokens over a pool of 60 pages of 16 tokens (room for
    ~1.25 such rows): rows that find no page are preempted (their turn dropped, their pages
    released), wait at the front of the queue and replay the turn with the same key. The
    Trajectory is the unbounded engine's, token for token (log-probs to 1e-5)."""
    env = tiny_policy[0]
    config, tasks, key, whole = six_groups
    policy = engines(SMALL_POOL)
    preempted = count_preemptions(policy)
    played = MultiTurnRollout(
        env, tokenizer, dataclasses.replace(config, max_rows_per_call=4, refill=refill, lanes=lanes)
    )(policy, tasks, key)
    a, b = jax.device_get(whole.trajectory), jax.device_get(played.trajectory)
    assert int(np.asarray(a.token_mask).sum(axis=1).max()) > 60 * 16 // 2  # rows outgrow the pool
    assert_same_trajectory(b, a)
    assert played.responses == whole.responses
    assert played.stats.live_rows == whole.stats.live_rows  # a replayed turn counts once
    assert sum(preempted) > 0


def test_a_pool_that_cannot_hold_one_row_is_refused(tiny_policy, tokenizer):
    env, _, token_map, model = tiny_policy
    policy = SamplerPolicy(
        model, token_map=token_map, paging=Paging(page_size=16, num_pages=47, block_pages=4)
    )
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(group_size=2, max_response_tokens=4, max_context=SMALL_CONTEXT),
    )
    with pytest.raises(
        ValueError, match=r"num_pages=47 \(1 shard\(s\)\) cannot hold one row of max_len=768"
    ):
        runner(policy, np.array([1]), jax.random.key(0))
