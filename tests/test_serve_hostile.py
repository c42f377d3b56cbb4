"""The policy server under bad input and load (issue #59): each hostile request gets an
OpenAI-shaped error naming what is wrong, the server keeps serving, no request reads or writes
a file, a client that leaves mid-stream frees its rows, a full queue answers 429, and a
bounded load of hundreds of concurrent clients loses and duplicates no episode record."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import sys
import threading
import time
import urllib.parse

import openai
import pytest
import serve_helpers as h

from agentrl_jax.serve import serve_in_thread

_OPENED: list[str] = []
_WATCH = threading.Event()


def _audit(event, args):  # every file this process opens while the hostile requests run
    if _WATCH.is_set() and event == "open" and args and isinstance(args[0], (str, bytes)):
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def served():
    server = h.make_server(api_key="sesame", max_body_bytes=64 << 10)
    with serve_in_thread(server) as url:
        yield server, url


def post(
    url: str,
    body,
    *,
    key: str | None = "sesame",
    path: str = "/chat/completions",
    method="POST",
    headers=None,
):  # noqa: E501
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        head["Authorization"] = f"Bearer {key}"
    conn.request(method, parts.path + path, body=data if method == "POST" else None, headers=head)
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw


GOOD = {"model": "tiny", "messages": [{"role": "user", "content": h.TEXTS[0]}], "max_tokens": 4}
BAD = [  # (body, status, param or code)
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b"\xff\xfe", 400, "invalid_json"),
    (b"[" * 30_000, 400, "invalid_json"),  # nested past the recursion limit
    ({**GOOD, "model": "../../etc/passwd"}, 404, "model"),
    ({**GOOD, "model": 7}, 400, "model"),
    ({**GOOD, "messages": "hi"}, 400, "messages"),
    ({**GOOD, "messages": []}, 400, "messages"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),  # noqa: E501
    (
        {**GOOD, "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        400,
        "messages[0].tool_calls",
    ),  # noqa: E501
    (
        {**GOOD, "messages": [{"role": "user", "content": " ".join([h.TEXTS[0]] * 60)}]},
        400,
        "context_length_exceeded",
    ),  # noqa: E501
    (
        {**GOOD, "messages": [{"role": "user", "content": "\u4e2d\u6587 not in the vocabulary"}]},
        400,
        "messages",
    ),  # noqa: E501
    ({**GOOD, "n": 9}, 400, "n"),
    ({**GOOD, "n": "2"}, 400, "n"),
    ({**GOOD, "n": 0}, 400, "n"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    ({**GOOD, "temperature": -1}, 400, "temperature"),
    ({**GOOD, "top_p": 0}, 400, "top_p"),
    ({**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": 1.5}, 400, "max_tokens"),
    ({**GOOD, "max_completion_tokens": True}, 400, "max_completion_tokens"),
    ({**GOOD, "seed": "x"}, 400, "seed"),
    ({**GOOD, "seed": 1 << 70}, 400, "seed"),
    ({**GOOD, "logprobs": "yes"}, 400, "logprobs"),
    ({**GOOD, "top_logprobs": 5}, 400, "top_logprobs"),  # without logprobs: true
    ({**GOOD, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({**GOOD, "stop": ["a"] * 5}, 400, "stop"),
    ({**GOOD, "stop": [""]}, 400, "stop"),
    ({**GOOD, "stream": "no"}, 400, "stream"),
    ({**GOOD, "tools": {"a": 1}}, 400, "tools"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": 1}}]}, 400, "tools[0]"),
    ({**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
    ({**GOOD, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({**GOOD, "user": "x" * 1000}, 400, "user"),
    ({**GOOD, "user": "/etc/passwd\n"}, 400, "user"),
    (b'{"a": 1}', 400, "model"),  # no model at all
    (
        b'{"model": "tiny", "messages": [' + b'{"role": "user", "content": "x"},' * 4000 + b"]}",
        413,
        "request_too_large",
    ),  # noqa: E501
]


@pytest.mark.parametrize("body, status, where", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_hostile_request_gets_an_openai_error_and_the_server_goes_on(served, body, status, where):  # noqa: E501
    server, url = served
    _OPENED.clear()
    _WATCH.set()
    try:
        got, reply = post(url, body)
    finally:
        _WATCH.clear()
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert where in (error["param"], error["code"]), error
    assert not [p for p in _OPENED if "passwd" in p or "etc" in p], _OPENED


def test_keys_routes_and_methods(served):
    server, url = served
    assert post(url, GOOD, key=None)[0] == 401
    status, reply = post(url, GOOD, key="wrong")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    assert post(url, GOOD)[0] == 200
    assert post(url, b"", path="/nowhere")[1]["error"]["code"] == "not_found"
    assert post(url, b"", path="/chat/completions", method="GET")[0] == 405
    status, reply = post(url, b"", path="/models/..%2F..%2Fetc%2Fpasswd", method="GET")
    assert status == 404 and reply["error"]["param"] == "model"


def test_a_client_that_leaves_mid_stream_frees_its_rows(served):
    server, url = served
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = {**GOOD, "max_tokens": 32, "stream": True, "temperature": 1.0, "user": "leaver"}
    conn.request(
        "POST",
        parts.path + "/chat/completions",
        body=json.dumps(body),
        headers={"Authorization": "Bearer sesame", "Content-Type": "application/json"},
    )  # noqa: E501
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event, then the client is gone
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 30
    while server.engine._busy_rows() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine._busy_rows()
    assert server.store.turns("leaver") == []  # a reply nobody received is not a turn
    assert post(url, GOOD)[0] == 200


def test_a_full_queue_answers_429_and_the_rest_are_served():
    server = h.make_server(slots=1, max_queue=1)
    with serve_in_thread(server) as url:
        body = {**GOOD, "max_tokens": 24}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            statuses = [
                f.result()[0] for f in [pool.submit(post, url, body, key=None) for _ in range(12)]
            ]  # noqa: E501
        assert set(statuses) == {200, 429}, statuses
        assert post(url, GOOD, key=None)[0] == 200


def test_hundreds_of_concurrent_clients_lose_and_duplicate_no_episode():
    """200 clients, two turns each, on 8 rows: every episode is recorded exactly once, as
    two chained turns (the second continuing the first's tokens)."""
    server = h.make_server(slots=8)
    clients = 200
    with serve_in_thread(server) as url:

        def episode(i: int):
            client = openai.OpenAI(
                base_url=f"{url.removesuffix('/v1')}/episodes/load-{i}/v1",
                api_key="-",
                max_retries=0,
                timeout=300,
            )  # noqa: E501
            messages = [{"role": "user", "content": h.TEXTS[i % 2]}]
            first = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=3, seed=i
            )  # noqa: E501
            messages += [
                h.as_json(first.choices[0].message),
                {"role": "user", "content": h.TEXTS[0]},
            ]  # noqa: E501
            second = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=3, seed=i
            )  # noqa: E501
            return first, second

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            replies = list(pool.map(episode, range(clients)))
        took = time.monotonic() - started
    assert took < 600
    assert len(server.store) == clients
    for i, (first, second) in enumerate(replies):
        turns = server.store.turns(f"load-{i}")
        assert [t.parent for t in turns] == [None, 0]
        assert (
            list(turns[0].completion_ids)
            == first.choices[0].model_extra["agentrl"]["completion_token_ids"]
        )  # noqa: E501
        assert second.model_extra["agentrl"]["prompt_token_ids"][
            : len(turns[0].prompt_ids)
        ] == list(turns[0].prompt_ids)  # noqa: E501
    assert server.store.dropped_turns == 0


def test_an_engine_failure_fails_its_requests_with_a_500_and_the_server_goes_on(served):
    server, url = served
    decode = server.engine.sampler.decode
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a device error")
        return decode(*args, **kwargs)

    server.engine.sampler.decode = broken
    try:
        status, reply = post(url, GOOD)
        assert status == 500 and reply["error"]["code"] == "internal_error"
        assert "device" not in reply["error"]["message"]  # no internals leave the server
        assert post(url, GOOD)[0] == 200  # a fresh cache, the same compiled programs
    finally:
        server.engine.sampler.decode = decode
