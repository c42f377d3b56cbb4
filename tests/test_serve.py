"""The OpenAI-compatible policy server (issue #59), through the real ``openai`` client on
127.0.0.1: plain, tool-calling, streaming and ``n > 1`` completions of a tiny Qwen3 whose
recorded tokens are what the engine samples (the same keys through one direct
``Sampler.decode``), whose log-probs are the model's teacher-forced ones (1e-5), whose greedy
completions are the engine's own, and whose later turns continue the earlier turns' exact
tokens instead of re-tokenising the conversation."""

from __future__ import annotations

import dataclasses

import numpy as np
import openai
import pytest
import serve_helpers as h
from flax import nnx

from agentrl_jax.sampling import Paging, Sampler, SamplingConfig
from agentrl_jax.sampling.padding import pad_rows
from agentrl_jax.serve import EpisodeStore, Turn, episode_row, serve_in_thread
from agentrl_jax.serve.chat import parse_reply


@pytest.fixture(scope="module")
def served():
    server = h.make_server()
    with serve_in_thread(server) as url:
        yield server, openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def direct(model, tmap, prompt, keys, sampling, max_tokens, stops):
    """The engine's own completion of ``prompt``: one ``Sampler.decode`` of ``max_tokens``
    tokens per key, from a fresh cache."""
    sampler = Sampler(
        model,
        max_new_tokens=max_tokens,
        stop_token_ids=tuple(int(i) for i in tmap.to_model(list(stops))),
        paging=Paging(page_size=16),
    )
    n = len(keys)
    state = sampler.init(n, 512)
    tokens, mask = pad_rows([tmap.to_model(prompt)] * n, (16, 32, 64, 128, 256, 512))
    state = sampler.append(nnx.state(model), state, tokens, mask)
    _, out = sampler.decode(nnx.state(model), state, keys, sampling, np.full(n, max_tokens))
    return [
        tmap.to_tokenizer(np.asarray(out.tokens[i, : int(out.lengths[i])])).tolist()
        for i in range(n)
    ]


def test_a_sampled_completion_is_the_engines_and_its_logprobs_are_teacher_forced(served):
    server, client = served
    model, tmap = h.tool_model()
    messages = [{"role": "user", "content": h.TEXTS[0]}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, n=3, seed=7, logprobs=True, top_logprobs=3
    )
    extra = reply.model_extra["agentrl"]
    prompt = extra["prompt_token_ids"]
    assert prompt == server.renderer.prompt(messages)  # the chat template's tokens
    keys = server._keys(None, 3, 7)
    want = direct(model, tmap, prompt, keys, SamplingConfig(), 20, server.engine.stop_token_ids)
    got = [c.model_extra["agentrl"]["completion_token_ids"] for c in reply.choices]
    assert got == want  # three choices, each the engine's one-call decode with its key
    assert len({tuple(g) for g in got}) == 3
    for choice, ids in zip(reply.choices, got):
        recorded = choice.model_extra["agentrl"]["logprobs"]
        forced = h.teacher_forced(model, tmap, prompt + ids)[len(prompt) - 1 :]
        np.testing.assert_allclose(recorded, forced, atol=1e-5)
        # temperature 1, no truncation: the sampling distribution is the model's
        np.testing.assert_allclose(
            choice.model_extra["agentrl"]["sampling_logprobs"], forced, atol=1e-5
        )  # noqa: E501
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(recorded)
        # each token's 3 most likely alternatives: the teacher-forced distribution's top 3
        rows = h.teacher_forced_rows(model, tmap, prompt + ids)[len(prompt) - 1 :]
        for row, token in zip(rows, choice.logprobs.content):
            best = np.argsort(-row, kind="stable")[:3]
            top = [t.logprob for t in token.top_logprobs]
            np.testing.assert_allclose(top, row[best], rtol=1e-5, atol=1e-5)
            want = [server.renderer.decode([int(i)]) for i in tmap.to_tokenizer(best)]
            assert [t.token for t in token.top_logprobs] == want
        assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == sum(len(g) for g in got)


def test_a_greedy_tool_call_is_the_engines_parsed_and_its_result_continues_the_tokens(served):
    server, client = served
    model, tmap = h.tool_model()
    first = client.chat.completions.create(
        model="tiny", messages=h.ASK, tools=h.TOOLS, temperature=0, max_tokens=32, user="tools-1"
    )
    choice = first.choices[0]
    prompt = first.model_extra["agentrl"]["prompt_token_ids"]
    ids = choice.model_extra["agentrl"]["completion_token_ids"]
    greedy = SamplingConfig(temperature=0.0)
    assert (
        ids
        == direct(
            model,
            tmap,
            prompt,
            np.zeros((1, 2), np.uint32),
            greedy,
            32,
            server.engine.stop_token_ids,
        )[0]
    )  # noqa: E501
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "move")
    assert call.function.arguments == '{"direction": "Right"}'
    assert choice.message.content is None
    # the client sends the reply back with the tool's output: the next prompt is the first
    # prompt and completion, token for token, then the tool message; the row's cache is reused
    history = h.ASK + [
        h.as_json(choice.message),
        {"role": "tool", "tool_call_id": call.id, "content": h.TEXTS[1]},
    ]  # noqa: E501
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=h.TOOLS, temperature=0, max_tokens=8, user="tools-1"
    )
    extra = second.model_extra["agentrl"]
    assert extra["parent_turn"] == 0
    assert extra["prompt_token_ids"][: len(prompt) + len(ids)] == prompt + ids
    tail = server.renderer.continuation(history[3:], closed_by="<|im_end|>")
    assert extra["prompt_token_ids"] == prompt + ids + tail
    assert extra["reused_prompt_tokens"] == len(prompt) + len(ids)
    # what the template alone renders differs (Qwen3 re-renders the old reply), which is why
    # the server never re-tokenises it
    assert extra["prompt_token_ids"] != server.renderer.prompt(history, h.TOOLS)
    turns = server.store.turns("tools-1")
    assert [t.parent for t in turns] == [None, 0]
    assert list(turns[0].completion_ids) == ids


def test_streaming_gives_the_non_streamed_completion_in_pieces(served):
    server, client = served
    messages = [{"role": "user", "content": h.TEXTS[0]}]
    once = client.chat.completions.create(model="tiny", messages=messages, seed=3, max_tokens=24)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        seed=3,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == once.choices[0].message.content
    assert len([p for p in pieces if p]) > 1  # it came in pieces
    assert finish == once.choices[0].finish_reason
    assert usage.completion_tokens == once.usage.completion_tokens


def test_a_streamed_tool_call_arrives_as_a_tool_call(served):
    _, client = served
    stream = client.chat.completions.create(
        model="tiny", messages=h.ASK, tools=h.TOOLS, temperature=0, max_tokens=32, stream=True
    )
    calls, content, finish = [], "", None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("move", '{"direction": "Right"}')
    ]  # noqa: E501


def test_stop_strings_cut_the_text_and_the_record(served):
    server, client = served
    messages = [{"role": "user", "content": h.TEXTS[0]}]
    full = client.chat.completions.create(model="tiny", messages=messages, seed=11, max_tokens=24)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the sampled text has no printable middle to stop at")  # seed-fixed: never
    cut = client.chat.completions.create(
        model="tiny", messages=messages, seed=11, max_tokens=24, stop=[stop], user="stop-1"
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    ids = cut.choices[0].model_extra["agentrl"]["completion_token_ids"]
    full_ids = full.choices[0].model_extra["agentrl"]["completion_token_ids"]
    assert ids == full_ids[: len(ids)] and len(ids) < len(full_ids)
    assert stop in server.text(ids) and stop not in server.text(ids[:-1])


def test_models_and_the_episode_endpoint(served):
    server, client = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    client.chat.completions.create(model="tiny", messages=h.ASK, max_tokens=4, user="ep-json")
    got = client.get("/episodes/ep-json", cast_to=object)
    assert [t["prompt_token_ids"] for t in got["turns"]] == [
        list(t.prompt_ids) for t in server.store.turns("ep-json")
    ]


def test_the_reply_parser_keeps_malformed_calls_as_text():
    assert parse_reply("hi") == ("hi", [])
    content, calls = parse_reply(
        'a <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> b'
    )  # noqa: E501
    assert content == "a  b" and calls == [{"name": "f", "arguments": '{"x": 1}'}]
    for bad in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
    ):  # noqa: E501
        assert parse_reply(bad) == (bad, [])
    assert parse_reply("<tool_call>" * 1000 + "[" * 100_000)[1] == []


def test_a_second_wave_of_requests_compiles_nothing(served):
    """Every program has a static shape: once a wave of requests of some sizes has run, a
    second wave (other prompts, other keys, other batch compositions) compiles nothing."""
    from compile_counter import count_backend_compiles

    _, client = served

    def wave(seed: int) -> None:
        for i, text in enumerate(h.TEXTS):
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": text}],
                max_tokens=12,
                n=1 + i % 2,
                seed=seed + i,
            )

    wave(0)
    with count_backend_compiles() as compiled:
        wave(100)
    assert compiled == []


def _turn(parent, prompt, completion, messages=("m",)):
    return Turn(
        parent=parent,
        messages=messages,
        tools="null",
        reply="r",
        prompt_ids=np.asarray(prompt, np.int32),
        completion_ids=np.asarray(completion, np.int32),
        logprobs=np.full(len(completion), -0.5, np.float32),
        sampling_logprobs=np.full(len(completion), -0.25, np.float32),
        finish_reason="stop",
        weight_version=1,
        closed=True,
    )


def test_a_kept_history_is_one_conversation_and_an_edited_one_trains_turn_by_turn():
    # kept: turn 1's prompt is turn 0's prompt and completion, then the observation [7, 8]
    chain = [_turn(None, [1, 2, 3], [4, 5]), _turn(0, [1, 2, 3, 4, 5, 7, 8], [9])]
    row = episode_row(chain, 16, 4)
    assert row.tokens[: row.length].tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert row.loss_mask[: row.length].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert row.token_turn[: row.length].tolist() == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert row.logprobs[3:5].tolist() == [-0.5, -0.5]
    assert row.sampling_logprobs[7] == -0.25
    assert (row.turns, row.context_start.tolist(), row.overflow) == (2, [0, 0, 0, 0], False)
    # edited: the second prompt does not continue the first; each turn is its own sequence
    # and sees only its own prompt (context_start at it)
    edited = [_turn(None, [1, 2, 3], [4, 5]), _turn(None, [1, 6], [9])]
    row = episode_row(edited, 16, 4)
    assert row.tokens[: row.length].tolist() == [1, 2, 3, 4, 5, 1, 6, 9]
    assert row.context_start.tolist()[:2] == [0, 5]
    assert row.token_turn[: row.length].tolist() == [-1, -1, -1, 0, 0, -1, -1, 1]
    # what does not fit is left out, and said
    row = episode_row(chain, 6, 4)
    assert (row.turns, row.length, row.overflow) == (1, 5, True)
    row = episode_row(chain, 16, 1)
    assert (row.turns, row.overflow) == (1, True)
    # an aborted turn (the client never received it) is not trained on
    assert episode_row([dataclasses.replace(chain[0], finish_reason="abort")], 16, 4).turns == 0


def test_the_episode_store_is_bounded_in_episodes_turns_and_tokens():
    """A client that names episodes at will cannot grow the server's memory past its bounds:
    the oldest episodes go first."""
    store = EpisodeStore(max_episodes=3, max_turns=2, max_tokens=20)
    turn = _turn(None, [1, 2, 3], [4, 5])  # 5 tokens
    for i in range(4):
        assert store.add(f"e{i}", turn) == 0
    assert len(store) == 3 and store.turns("e0") == [] and store.forgotten_episodes == 1
    assert store.add("e3", turn) == 1 and store.add("e3", turn) is None  # 2 turns at most
    assert store.dropped_turns == 1
    assert store.tokens == 20 and len(store.turns("e1")) == 1  # 20 tokens: all still fit
    store.add("e4", turn)  # 25 > 20: the oldest (e1) goes
    assert store.turns("e1") == [] and store.tokens == 20
    store.add("big", _turn(None, list(range(18)), [1]))  # 19 tokens: only it fits
    assert [len(store), store.tokens] == [1, 19]
    assert store.pop("big") and store.tokens == 0
