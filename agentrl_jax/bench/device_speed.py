"""``bench device``'s speed and memory figures (:mod:`agentrl_jax.bench.device`): decode and
generate tokens/s, one GRPO update's tokens/s and MFU, the rollout engine's turns/s, and the
peak memory :mod:`agentrl_jax.plan` predicts for the very programs that run against the
allocator's measured peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.device_figures import (
    MEMORY_DECODE_BATCH,
    ROLLOUT_CONTEXT,
    ROLLOUT_RESPONSE_TOKENS,
    Figure,
    Scale,
    _median,
    _sync,
    _torch_device,
    _train_batch,
    against,
    decode_name,
    decode_prediction,
    device_name,
    dims,
    generate_name,
    gpu_here,
    memory_name,
    our_config,
    rollout_name,
    rollout_prediction,
    train_name,
    train_prediction,
)
from agentrl_jax.plan.roofline import layer_matmul_parameters, model_flops_per_token


# ---------------------------------------------------------------------------- memory
@contextlib.contextmanager
def measured_peak(arguments: int) -> Iterator[dict[str, Any]]:
    """The allocator's peak while the block runs one program, as that program's own: the peak
    minus what was in use on entry plus the program's ``arguments`` bytes (already in use on
    entry). ``out["bytes"]`` is None on devices without memory statistics (the CPU) or when an
    earlier, higher peak in this process hides this one."""
    device = jax.devices()[0]
    before = device.memory_stats()
    out: dict[str, Any] = {"bytes": None}
    yield out
    after = device.memory_stats()
    if not (before and after):
        out["unavailable"] = f"{device_name(device)} reports no memory statistics"
    elif after["peak_bytes_in_use"] > before["peak_bytes_in_use"]:
        out["bytes"] = int(after["peak_bytes_in_use"] - before["bytes_in_use"] + arguments)
    else:
        out["hidden"] = "an earlier, higher peak in this process hides this program's"


def _memory_figure(name: str, predicted: Any, measured: dict[str, Any], settings) -> Figure:
    return Figure(
        memory_name(name),
        "memory",
        None if measured["bytes"] is None else float(measured["bytes"]),
        "bytes",
        "agentrl_jax.plan's predicted peak (plan.analyse: the compiler's memory analysis of "
        "this very program)",
        float(predicted.peak),
        settings={
            **settings,
            "predicted_arguments": predicted.arguments,
            "predicted_temporaries": predicted.temporaries,
            **{k: v for k, v in measured.items() if k != "bytes"},
        },  # fmt: skip
    )


def _device_memory() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("bytes_limit", 80 * 1024**3))


def decode_memory_figure(scale: Scale, batch: int = MEMORY_DECODE_BATCH) -> Figure:
    """Plan's figure for the decode program (cache for ``prompt + new`` tokens) against the
    measured peak of the same compiled program."""
    from agentrl_jax.plan import analyse  # noqa: PLC0415
    from agentrl_jax.sampling import SamplingConfig  # noqa: PLC0415

    shape = scale.decode_shapes[0]
    model = _random_model(shape)
    max_len = scale.prompt_len + scale.new_tokens
    greedy = SamplingConfig(temperature=0.0)
    sampler, params, prompt = _decoder(model, batch, scale)
    state = _sync(sampler.append(params, sampler.init(batch, max_len), *prompt))
    key = jax.random.key(0)
    compiled = sampler.lower_decode(params, state, key, greedy).compile()
    predicted = analyse("decode", compiled, _device_memory(), 0.0)
    args = sampler._decode_args(params, state, key, None, None)
    with measured_peak(predicted.arguments) as measured:
        _sync(compiled(*args))
    return _memory_figure(decode_name(shape, batch), predicted, measured,
                          {"shape": shape, "batch": batch, "max_len": max_len})  # fmt: skip


# ---------------------------------------------------------------------------- speed
def _random_model(shape: str, seed: int = 0, param_dtype=jnp.bfloat16, layers: int | None = None):
    """A random Qwen3 of ``shape`` computing in bfloat16 (``layers`` of its layers)."""
    from agentrl_jax.models import Qwen3ForCausalLM  # noqa: PLC0415

    config = our_config(shape)
    if layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=layers)
    return Qwen3ForCausalLM(
        config, dtype=jnp.bfloat16, param_dtype=param_dtype, rngs=nnx.Rngs(seed)
    )


def train_config(scale: Scale):
    """The train-step figure's :class:`~agentrl_jax.train.TrainConfig`: full rematerialisation,
    ``attention: auto`` (cuDNN on an NVIDIA GPU; XLA's at tiny shapes)."""
    from agentrl_jax.train import RLConfig, TrainConfig  # noqa: PLC0415

    return TrainConfig(
        rl=RLConfig(memory={"remat": "full", "attention": "xla" if scale.tiny else "auto"})
    )


def train_layers(shape: str, memory_bytes: float) -> int:
    """The layers of ``shape`` whose float32 train state (parameters, gradients, two AdamW
    moments and the KL reference: 20 bytes a parameter) fills at most half the device."""
    config = our_config(shape)
    per_layer = layer_matmul_parameters(config)
    embed = config.hidden_size * config.vocab_size * (1 if config.tie_word_embeddings else 2)
    fit = int((memory_bytes / 2 / 20 - embed) // per_layer)
    return max(1, min(config.num_hidden_layers, fit))


def _decoder(model, batch: int, scale: Scale):
    from agentrl_jax.sampling import Sampler, pad_rows  # noqa: PLC0415

    rng = np.random.default_rng(batch)
    prompts = [
        rng.integers(0, model.config.vocab_size, scale.prompt_len).tolist() for _ in range(batch)
    ]
    sampler = Sampler(model, max_new_tokens=scale.new_tokens, stop_token_ids=())
    return sampler, nnx.state(model), pad_rows(prompts, scale.prompt_len)


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read + written per second by a large on-device copy, best of ``repeats``."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    _sync(copy(x))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        _sync(copy(x))
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def _parameter_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def decode_figures(scale: Scale, bandwidth: float) -> list[Figure]:
    """Decode tokens/s against the HBM floor, generate tokens/s against transformers."""
    from agentrl_jax.sampling import SamplingConfig  # noqa: PLC0415

    greedy = SamplingConfig(temperature=0.0)
    spec = gpu_here()
    out = []
    for shape in scale.decode_shapes:
        model = _random_model(shape)
        config = model.config
        param_bytes = _parameter_bytes(nnx.state(model))
        for batch in scale.decode_batches:
            sampler, params, prompt = _decoder(model, batch, scale)
            max_len = scale.prompt_len + scale.new_tokens

            def decode_only() -> float:
                state = _sync(sampler.append(params, sampler.init(batch, max_len), *prompt))
                start = time.perf_counter()
                _sync(sampler.decode(params, state, jax.random.key(0), greedy))
                return (time.perf_counter() - start) / scale.new_tokens

            def generate() -> float:
                start = time.perf_counter()
                state = sampler.append(params, sampler.init(batch, max_len), *prompt)
                _sync(sampler.decode(params, state, jax.random.key(0), greedy))
                return time.perf_counter() - start

            step_s = _median(decode_only, scale.repeats)
            # a step reads every weight and the cache so far (K and V, bfloat16), on average
            # half way through the new tokens
            cached = scale.prompt_len + scale.new_tokens / 2
            cache_bytes = (
                2 * batch * cached * config.num_hidden_layers * config.num_key_value_heads
                * config.head_dim * 2
            )  # fmt: skip
            floor_s = (param_bytes + cache_bytes) / bandwidth
            settings = {"shape": shape, "batch": batch, "prompt_len": scale.prompt_len,
                        "new_tokens": scale.new_tokens, "param_bytes": param_bytes,
                        "copy_bandwidth_bytes_per_s": bandwidth, "step_ms": step_s * 1e3,
                        "device": device_name()}  # fmt: skip
            prediction = None if spec is None else decode_prediction(config, spec, batch, scale)
            out.append(Figure(decode_name(shape, batch), "speed", batch / step_s,
                              "tokens/s", "HBM floor: (parameter + cache bytes) per step over "
                              "the measured copy bandwidth", batch / floor_s,
                              settings={**settings,
                                        **against(prediction, batch / step_s)}))  # fmt: skip
            ours_s = _median(generate, scale.repeats)
            theirs_s = _transformers_generate_s(shape, prompt, scale)
            tokens = batch * scale.new_tokens
            out.append(Figure(generate_name(shape, batch), "speed", tokens / ours_s,
                              "tokens/s", f"PyTorch transformers generate (greedy, bfloat16, "
                              f"{_torch_device()}, same shape)",
                              None if theirs_s is None else tokens / theirs_s,
                              settings={**settings, "ours_s": ours_s,
                                        "transformers_s": theirs_s}))  # fmt: skip
    return out


def _transformers_generate_s(shape: str, prompt, scale: Scale) -> float | None:
    """Median seconds of transformers' greedy ``generate`` at ``shape`` (random bfloat16
    weights) on the device PyTorch sees; None without PyTorch."""
    where = _torch_device()
    if where is None:
        return None
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    config = transformers.Qwen3Config(**dims(shape))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(where):
            hf = transformers.Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    tokens = torch.tensor(np.asarray(prompt[0]), dtype=torch.long, device=where)
    mask = torch.tensor(np.asarray(prompt[1]), dtype=torch.long, device=where)

    def run() -> float:
        if where == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(tokens, attention_mask=mask, do_sample=False,
                        max_new_tokens=scale.new_tokens, min_new_tokens=scale.new_tokens,
                        eos_token_id=None, pad_token_id=0)  # fmt: skip
        if where == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds = _median(run, scale.repeats)
    if where == "cuda":
        torch.cuda.empty_cache()
    return seconds


def train_figures(scale: Scale) -> list[Figure]:
    """One GRPO update at the train shape: tokens/s, MFU; plan's peak against the measured."""
    from agentrl_jax.plan import analyse  # noqa: PLC0415
    from agentrl_jax.train import init_train_state  # noqa: PLC0415
    from agentrl_jax.train.jitted_step import make_train_step  # noqa: PLC0415

    shape, length = scale.train_shape, scale.train_tokens
    layers = train_layers(shape, _device_memory())
    model = _random_model(shape, param_dtype=jnp.float32, layers=layers)
    train = train_config(scale)
    attention = train.rl.memory.attention
    state = init_train_state(model, train)
    step = make_train_step(nnx.graphdef(model), train, donate=True)
    batch = step.place(_train_batch(1, length, model.config.vocab_size), state)
    tokens = int(np.asarray(batch.trajectory.token_mask).sum())
    compiled = step.lower(state, batch).compile()
    predicted = analyse("train", compiled, _device_memory(), 0.0)
    with measured_peak(predicted.arguments) as measured:  # the step's own calling convention
        new, metrics = compiled(state.replace(base=None), batch, state.base)
        state = new.replace(base=state.base)
        _sync(metrics)

    def update() -> float:
        nonlocal state
        start = time.perf_counter()
        state, m = step(state, batch)
        _sync(m)
        return time.perf_counter() - start

    seconds = _median(update, scale.repeats)
    # policy forward + backward (3x forward) and the reference forward: 4x forward FLOPs
    flops = 4 * model_flops_per_token(model.config, length) * length
    spec = gpu_here()
    peak = None if spec is None else spec.peak_bf16_flops
    prediction = None if spec is None else train_prediction(model.config, spec, scale)
    settings = {"shape": shape, "layers": layers, "length": length, "rows": 1,
                "remat": "full", "attention": attention, "param_dtype": "float32",
                "compute_dtype": "bfloat16", "update_s": seconds,
                "model_flops": flops, "device": device_name()}  # fmt: skip
    del state
    return [
        Figure(
            train_name(scale),
            "speed",
            tokens / seconds,
            "tokens/s",
            "the chip's dense bfloat16 peak, as tokens/s at these model FLOPs",
            None if peak is None else peak * tokens / flops,
            settings={
                **settings,
                "mfu": None if peak is None else flops / seconds / peak,
                "peak_flops": peak,
                **against(prediction, tokens / seconds),
            },
        ),  # fmt: skip
        _memory_figure(train_name(scale), predicted, measured, settings),
    ]


def frozenlake_runner(scale: Scale, seed: int = 0):
    """The rollout figure's FrozenLake runner (real tokenizer and chat template, 4x4 maps,
    budget and group of ``scale``) and the key of its rollouts."""
    from agentrl_jax.models.tokenizer import load_tokenizer  # noqa: PLC0415
    from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig  # noqa: PLC0415
    from envs.frozenlake import maps as fl_maps  # noqa: PLC0415
    from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv  # noqa: PLC0415

    budget = scale.rollout_budget
    key_maps, key_run = jax.random.split(jax.random.key(seed))
    env = FrozenLakeTextEnv(fl_maps.generate(key_maps, scale.rollout_tasks, size=4),
                            FrozenLakeTextConfig(t_max=budget))  # fmt: skip
    config = RolloutConfig(group_size=scale.rollout_group, budget=budget,
                           max_response_tokens=ROLLOUT_RESPONSE_TOKENS,
                           max_context=ROLLOUT_CONTEXT)  # fmt: skip
    return MultiTurnRollout(env, load_tokenizer(), config), key_run


def turn_tokens(runner, budget: int) -> tuple[list[int], list[int]]:
    """Tokens of each task's first prompt (system, rules, the first grid) and of the message
    that follows a response on its first grid (closing the response, the next user turn), as
    ``runner`` builds them: what a rollout of ``runner`` prefills, turn after turn."""
    from envs.protocol import cut_observation  # noqa: PLC0415

    tasks = np.arange(runner.env.num_tasks())
    _, observations = runner.env.reset(tasks, 0)
    chat, prompt = runner.chat, runner.config.prompt
    first, after = [], []
    for text in observations:
        text = cut_observation(text, runner.observation_chars)
        system = prompt.system_text(runner.instructions, budget)
        first.append(len(chat.first_prompt(system, prompt.turn_text(text, budget, 0))))
        user = prompt.turn_text(text, budget, 1)
        after.append(len(chat.close_response([])) + len(chat.next_prompt(user)))
    return first, after


def rollout_figure(scale: Scale, seed: int = 0) -> Figure:
    """The rollout engine's turns/s on FrozenLake against one task group at a time."""
    from agentrl_jax.sampling import Paging, SamplerPolicy  # noqa: PLC0415

    budget = scale.rollout_budget
    runner, key_run = frozenlake_runner(scale, seed)
    if scale.tiny:
        from agentrl_jax.bench.rollout import frozenlake_token_map, tiny_policy_model  # noqa

        token_map = frozenlake_token_map(runner, [budget])
        model, policy_args = tiny_policy_model(len(token_map), seed), {"token_map": token_map}
    else:
        model, policy_args = _random_model(scale.rollout_shape), {}
    policy = SamplerPolicy(model, paging=Paging(), **policy_args)
    tasks = np.arange(scale.rollout_tasks)

    def timed(run: Callable[[], list]) -> tuple[float, int]:
        run()  # compiles
        start = time.perf_counter()
        results = run()
        seconds = time.perf_counter() - start
        return seconds, sum(r.stats.turns_played for r in results)

    batched_s, turns = timed(lambda: [runner(policy, tasks, key_run)])
    one_s, one_turns = timed(
        lambda: [
            runner(policy, tasks[k : k + 1], jax.random.fold_in(key_run, k))
            for k in range(len(tasks))
        ]  # fmt: skip
    )
    first, after = turn_tokens(runner, budget)
    prompt_tokens, observation_tokens = float(np.mean(first)), float(np.mean(after))
    spec = gpu_here()
    prediction = None if spec is None else rollout_prediction(
        model.config, spec, scale, prompt_tokens, observation_tokens
    )  # fmt: skip
    return Figure(
        rollout_name(scale),
        "speed",
        turns / batched_s,
        "turns/s",
        "the same rollouts one task group (G rows) at a time",
        one_turns / one_s,
        settings={
            "budget": budget,
            "max_response_tokens": ROLLOUT_RESPONSE_TOKENS,
            "paged": True,
            "turns": turns,
            "seconds": batched_s,
            "prompt_tokens": prompt_tokens,
            "observation_tokens": observation_tokens,
            "device": device_name(),
            **against(prediction, turns / batched_s),
        },  # fmt: skip
    )
