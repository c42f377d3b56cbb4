"""``agentrl-jax bench train-step``: tokens/s of one GRPO update.

Ours: :func:`agentrl_jax.train.make_train_step` with the paper's GRPO (clipped ratio, k3 KL to a
frozen reference at 0.001, token mean, global-norm clipping 1.0, AdamW lr 1e-6, weight decay
0.01), jitted and warm, float32.

Baseline, measured in the same run on the same weights and batch: PyTorch ``transformers``
``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for a size with experts) doing the same update
by hand: policy forward, reference forward under ``no_grad``, the same loss, ``backward``,
``clip_grad_norm_``, ``torch.optim.AdamW`` step (float32, the default attention and experts
implementations). Before timing, the two first-step losses and gradient norms must agree (same
parameters, same batch), so both compute the same thing. With experts neither side adds a
router loss: ``transformers`` adds its auxiliary loss only with ``output_router_logits``
(false in the exported ``config.json``) and only to its own loss, and the baseline's loss is
written out from the logits.

Sizes (:data:`SIZES`): ``tiny`` (2 layers, hidden 128, vocab 2048) and ``qwen3-0.6b-2l``
(Qwen3-0.6B's shapes, vocab 151,936, cut to 2 layers); with experts (``num_experts``),
``tiny-moe`` (8 experts, 2 per token) and ``qwen3-30b-a3b-1l-32e-v16k``, Qwen3-30B-A3B's
shapes (hidden 2048, 32 query and 4 key/value heads of 128, experts of 768, 8 per token,
renormalised) cut to 1 layer of 48, 32 experts of 128 and a vocabulary of 16,384 of 151,936.
Fewer layers alone would not fit in 24 GiB: our update holds the weights about six times
(model, policy, reference, two AdamW moments, gradients; 5 GB each at 1 layer with 128 experts
and the whole vocabulary), and the PyTorch side as many again. Both sides' expert work grows
with the experts a token is routed to, not with the experts there are (ours: each expert's
rows in blocks, :func:`~agentrl_jax.models.moe.blocked_grouped_matmul`), so the cut keeps the
per-token work of the real model.

Batches (``masks``), ``rows`` conversations of ``tokens`` tokens in groups of 4; tokens/s
counts every real token the update processes:

* ``synthetic``: a quarter prompt, then alternating 3/4 response and 1/4 observation chunks
  (~55% of the tokens are sampled);
* ``frozenlake``: a multi-turn row as FrozenLake makes them, a ~105-token turn of which ~8
  tokens are the response (~8% sampled). Ours then runs the output head only at the sampled
  positions (``TrainConfig.loss_positions`` = turns x 8), as the reproduction does; the
  baseline is transformers' usual full-sequence logits;
* ``frozenlake-ragged``: the same turns, but episodes of FrozenLake's varied lengths (row
  ``i`` plays 1 + ``i`` mod the turns that fit, so lengths spread from one turn to the whole
  width) right-padded to ``tokens``. Two rows: ours padded, and ours packed (``rl.memory.packing``:
  several episodes per row, :mod:`agentrl_jax.train.packing`), each against the same
  baseline (transformers on the padded batch with its attention mask), the packed row also
  against ours padded (``settings.vs_padded``).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import tempfile
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.forward import hf_implementation
from agentrl_jax.bench.report import BenchResult, median_time
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM, export_qwen3
from agentrl_jax.models.config import qwen3_hf_config
from agentrl_jax.train import TrainBatch, TrainConfig, init_train_state, make_train_step
from agentrl_jax.trajectory import Trajectory

SIZES = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    # max_position_embeddings: transformers' default, which this size has always run with (no
    # effect at the lengths it runs), not Qwen3-0.6B's 40,960
    "qwen3-0.6b-2l": qwen3_hf_config(
        "qwen3-0.6b", num_hidden_layers=2, max_position_embeddings=32_768
    ),
    "tiny-moe": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen3-30b-a3b-1l-32e-v16k": qwen3_hf_config(
        "qwen3-30b-a3b", num_hidden_layers=1, num_experts=32, vocab_size=16384
    ),
}
GROUP_SIZE = 4
# first-step loss and gradient norm, ours vs the baseline. Not tighter: on an MoE model a token
# near a routing tie can go to other experts on the two sides (their sums run in other orders),
# which moved the gradient norm by 1.0e-3 of itself at qwen3-30b-a3b-1l-32e-v16k (4 x 256
# tokens, this project's CPU, 2026-12-07); a wrong model or batch is off by far more.
AGREEMENT_RTOL = 1e-2


def synthetic_batch(rows: int, tokens: int, vocab: int, seed: int = 0) -> Trajectory:
    """A full-length rollout-shaped batch: prompt, then response/observation chunks."""
    rng = np.random.default_rng(seed)
    t = Trajectory.zeros(rows, tokens, 4)
    prompt, chunk = tokens // 4, max(tokens // 8, 2)
    loss_mask = np.zeros((rows, tokens), bool)
    token_turn = np.full((rows, tokens), -1, np.int32)
    for turn, start in enumerate(range(prompt, tokens, chunk)):
        response = slice(start, min(start + (3 * chunk) // 4, tokens))
        loss_mask[:, response] = True
        token_turn[:, response] = min(turn, 3)
    logprobs = np.where(loss_mask, -rng.uniform(0.5, 4.0, (rows, tokens)), 0.0).astype(np.float32)
    turn_mask = np.zeros((rows, 4), bool)
    turn_mask[:, : int(token_turn.max()) + 1] = True
    return t.replace(
        tokens=jnp.asarray(rng.integers(0, vocab, (rows, tokens)), jnp.int32),
        token_mask=jnp.ones((rows, tokens), bool),
        loss_mask=jnp.asarray(loss_mask),
        token_turn=jnp.asarray(token_turn),
        logprobs=jnp.asarray(logprobs),
        turn_mask=jnp.asarray(turn_mask),
        group_id=jnp.arange(rows, dtype=jnp.int32) // GROUP_SIZE,
        success=jnp.asarray(rng.random(rows) < 0.5),
        row_mask=jnp.ones(rows, bool),
    )


FROZENLAKE_TURN, FROZENLAKE_RESPONSE = 105, 8


def frozenlake_batch(rows: int, tokens: int, vocab: int, seed: int = 0) -> tuple[Trajectory, int]:
    """A FrozenLake-like batch (see the module docstring) and its loss-position bound."""
    t = synthetic_batch(rows, tokens, vocab, seed)
    loss_mask = np.zeros((rows, tokens), bool)
    token_turn = np.full((rows, tokens), -1, np.int32)
    first = max(
        1, min(FROZENLAKE_TURN, tokens) - FROZENLAKE_RESPONSE
    )  # rows shorter than a turn: one
    starts = list(range(first, tokens, FROZENLAKE_TURN))
    for turn, start in enumerate(starts):  # the prompt/observation, then the response
        response = slice(start, min(start + FROZENLAKE_RESPONSE, tokens))
        loss_mask[:, response] = True
        token_turn[:, response] = turn
    turns = len(starts)
    turn_mask = np.zeros((rows, turns), bool)
    turn_mask[:, :turns] = True
    rng = np.random.default_rng(seed + 1)
    logprobs = np.where(loss_mask, -rng.uniform(0.5, 4.0, (rows, tokens)), 0.0).astype(np.float32)
    full = Trajectory.zeros(rows, tokens, turns)
    t = full.replace(
        tokens=t.tokens,
        token_mask=t.token_mask,
        group_id=t.group_id,
        success=t.success,
        row_mask=t.row_mask,
        loss_mask=jnp.asarray(loss_mask),
        token_turn=jnp.asarray(token_turn),
        logprobs=jnp.asarray(logprobs),
        turn_mask=jnp.asarray(turn_mask),
    )
    return t, turns * FROZENLAKE_RESPONSE


def ragged_frozenlake_batch(rows: int, tokens: int, vocab: int, seed: int = 0) -> Trajectory:
    """:func:`frozenlake_batch` with row ``i`` cut after ``1 + i mod turns`` turns (tokens,
    loss positions and turns past it are padding): FrozenLake's spread of episode lengths."""
    t, _ = frozenlake_batch(rows, tokens, vocab, seed)
    turns = t.turn_mask.shape[1]
    first = max(1, min(FROZENLAKE_TURN, tokens) - FROZENLAKE_RESPONSE)
    played = 1 + np.arange(rows) % turns
    ends = np.minimum(first + (played - 1) * FROZENLAKE_TURN + FROZENLAKE_RESPONSE, tokens)
    inside = np.arange(tokens)[None, :] < ends[:, None]
    keep = jnp.asarray(inside)
    return t.replace(
        token_mask=t.token_mask & keep,
        loss_mask=t.loss_mask & keep,
        logprobs=jnp.where(keep, t.logprobs, 0.0),
        token_turn=jnp.where(keep, t.token_turn, -1),
        turn_mask=jnp.asarray(np.arange(turns)[None, :] < played[:, None]),
    )


def _torch_step(model_dir: str, batch: Trajectory, config: TrainConfig):
    """The baseline's update as a closure returning its loss and gradient norm (before
    clipping), and the kernels it runs (:func:`~agentrl_jax.bench.forward.hf_implementation`).
    The model is whatever ``config.json`` names: ``Qwen3ForCausalLM`` or, with experts,
    ``Qwen3MoeForCausalLM`` (its router logits are not asked for, so no auxiliary loss: the
    loss is written out from the logits, as ours)."""
    import torch
    import transformers

    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(policy).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=config.rl.optimizer.learning_rate,
        betas=(config.rl.optimizer.adam_b1, config.rl.optimizer.adam_b2),
        eps=config.rl.optimizer.adam_eps,
        weight_decay=config.rl.optimizer.weight_decay,
    )
    tokens = torch.from_numpy(np.array(batch.tokens, np.int64))
    mask = torch.from_numpy(np.array(batch.token_mask, np.int64))
    loss_mask = torch.from_numpy(np.array(batch.loss_mask, np.float32))[:, 1:]
    success = torch.from_numpy(np.array(batch.success, np.float32)).view(-1, GROUP_SIZE)
    advantages = (
        (success - success.mean(1, keepdim=True)) / (success.std(1, keepdim=True) + 1e-6)
    ).reshape(-1, 1)
    targets = tokens[:, 1:, None]

    def logprobs(model):
        logits = model(input_ids=tokens, attention_mask=mask).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, targets)[..., 0]

    def step() -> tuple[float, float]:
        lp = logprobs(policy)
        old = (
            lp.detach()
        )  # one update per batch: the old policy is the current one (as ours, and verl's)
        with torch.no_grad():
            ref = logprobs(reference)
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        surrogate = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2))
        d = torch.clamp(ref - lp, -20, 20)
        k3 = torch.clamp(torch.exp(d) - d - 1, max=10.0)
        loss = ((surrogate + config.kl_coef * k3) * loss_mask).sum() / loss_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            policy.parameters(), config.rl.optimizer.max_grad_norm
        )
        optimizer.step()
        return loss.item(), norm.item()

    return step, hf_implementation(policy)


MASKS = ("synthetic", "frozenlake", "frozenlake-ragged")


def run(
    *,
    sizes: Sequence[str] = ("tiny", "qwen3-0.6b-2l"),
    rows: int = 8,
    tokens: int = 256,
    repeats: int = 3,
    masks: Sequence[str] = ("synthetic", "frozenlake"),
) -> list[BenchResult]:
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise ValueError(f"unknown size {unknown[0]!r}; known: {', '.join(SIZES)}")
    if rows % GROUP_SIZE:
        raise ValueError(f"rows must be a multiple of the group size {GROUP_SIZE}, got {rows}")
    if [m for m in masks if m not in MASKS]:
        raise ValueError(
            f"unknown mask {[m for m in masks if m not in MASKS][0]!r}; known: {', '.join(MASKS)}"
        )
    results = []
    for size, mask in [(size, mask) for size in sizes for mask in masks]:
        model_config = Qwen3Config(**SIZES[size])
        model = Qwen3ForCausalLM(model_config, rngs=nnx.Rngs(0))
        train_config = TrainConfig()  # the paper's GRPO defaults
        if mask == "synthetic":
            batch = synthetic_batch(rows, tokens, model_config.vocab_size)
        elif mask == "frozenlake":
            batch, bound = frozenlake_batch(rows, tokens, model_config.vocab_size)
            train_config = TrainConfig(loss_positions=bound)
        else:
            batch = ragged_frozenlake_batch(rows, tokens, model_config.vocab_size)
            bound = int(jnp.max(jnp.sum(batch.loss_mask, axis=1)))
            train_config = TrainConfig(loss_positions=bound)
        num_tokens = int(jnp.sum(batch.token_mask))
        with tempfile.TemporaryDirectory() as model_dir:
            export_qwen3(model, model_dir)
            torch_step, torch_implementation = _torch_step(model_dir, batch, train_config)
        torch_first = torch_step()  # (loss, gradient norm)
        torch_s = median_time(torch_step, repeats=repeats)
        del torch_step  # its policy, reference and AdamW moments: room for ours
        gc.collect()
        configs = [("padded", train_config)]
        if mask == "frozenlake-ragged":
            packed = dataclasses.replace(
                train_config,
                rl=dataclasses.replace(
                    train_config.rl,
                    memory=dataclasses.replace(train_config.rl.memory, packing=True),
                ),
            )
            configs.append(("packed", packed))
        padded_s = None
        for layout, config in configs:
            ours_s, ours_first, rows_run = _time_ours(model, config, batch, repeats)
            _check_agreement(f"{size}, {layout}", ours_first, torch_first)
            settings = {
                "size": size,
                "num_experts": model_config.num_experts,
                "mask": mask,
                "layout": layout,
                "rows_computed": rows_run,
                "loss_positions": config.loss_positions,
                "loss_tokens": int(jnp.sum(batch.loss_mask)),
                "real_token_share": num_tokens / (rows * tokens),
                "rows": rows,
                "tokens": tokens,
                "repeats": repeats,
                "backend": jax.default_backend(),
                "first_step_loss": ours_first[0],
                "first_step_grad_norm": ours_first[1],
                "torch_first_step_grad_norm": torch_first[1],
                "torch_implementation": torch_implementation,
            }
            if layout == "padded":
                padded_s = ours_s
            else:
                settings["vs_padded"] = padded_s / ours_s
            results.append(
                BenchResult(
                    name=f"GRPO update, {size}, {mask} mask, "
                    + ("" if mask != "frozenlake-ragged" else f"{layout}, ")
                    + f"{rows}x{tokens} tokens",
                    unit="tokens/s",
                    ours=num_tokens / ours_s,
                    baseline=num_tokens / torch_s,
                    baseline_name="PyTorch transformers fwd+ref fwd+bwd+AdamW",
                    settings=settings,
                )
            )
    return results


def _check_agreement(label: str, ours: tuple[float, float], baseline: tuple[float, float]) -> None:
    """Raise unless the first-step ``(loss, gradient norm)`` of ours and the baseline agree:
    same weights, same batch. At the first step the ratio is 1 and the KL 0 on both sides, so
    the loss checks the batch's advantages and masks; the gradient norm checks the model."""
    for what, mine, theirs in zip(("losses", "gradient norms"), ours, baseline):
        if not abs(mine - theirs) <= AGREEMENT_RTOL * max(abs(theirs), 1e-3):
            raise RuntimeError(f"{label}: first-step {what} disagree: ours {mine}, torch {theirs}")


def _time_ours(
    model: Qwen3ForCausalLM, config: TrainConfig, batch: Trajectory, repeats: int
) -> tuple[float, tuple[float, float], int]:
    """Seconds per warm update of ours under ``config``, its first-step ``(loss, gradient
    norm)``, and the rows it computes (fewer than the batch's when packed)."""
    state = init_train_state(model, config)
    state = state.replace(policy=jax.tree.map(jnp.copy, state.policy))  # the step donates it
    step = make_train_step(nnx.split(model)[0], config, donate=True)
    train_batch = step.packed(TrainBatch(batch))
    rows_run = (
        train_batch.trajectory.tokens.shape[0]
        if train_batch.packing is None
        else train_batch.packing.shape[0]
    )
    state, metrics = step(state, train_batch)
    first = (float(metrics["loss"]), float(metrics["grad_norm"]))

    def ours():
        nonlocal state
        state, m = step(state, train_batch)
        jax.block_until_ready(m)

    seconds = median_time(ours, repeats=repeats)
    del state
    return seconds, first, rows_run
