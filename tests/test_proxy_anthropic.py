"""`proxy.py` on Anthropic's Messages API: /v1/messages plain and streamed, count_tokens, HEAD
probes, the upstream's credentials, and hostile upstreams, through real sockets to the scripted
stand-in (fake_anthropic.py), with the proxy a subprocess as a user starts it."""

import http.client
import json

import pytest

import reasoning_ledger as rl
from conftest import KEY, all_bytes_under, run_script, clean_env
from fake_anthropic import ScriptedAnthropic, events, message, sse
from proxy_helpers import Proxy, post

CLIENT_KEY = "sk-ant-client-own-key-0123456789"
HEADERS = {
    "x-api-key": CLIENT_KEY,
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    "X-Claude-Code-Session-Id": "5b7c0d2e-1111-4222-8333-944455556666",
}
ASK = {
    "model": "claude-stand-in",
    "max_tokens": 1000,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}],
}
USAGE = {
    "input_tokens": 7,
    "cache_read_input_tokens": 100,
    "cache_creation_input_tokens": 20,
    "output_tokens": 5,
}


@pytest.fixture
def run(tmp_path):
    """run(turns, **env) -> (stand-in, proxy); both stopped after the test."""
    made = []

    def go(turns=(), **env):
        fake = ScriptedAnthropic(turns).__enter__()
        made.append(fake)
        proxy = Proxy(fake.base_url + "/v1", tmp_path / "calls.jsonl", **env)
        made.append(proxy)
        return fake, proxy

    yield go
    for thing in reversed(made):
        thing.stop() if isinstance(thing, Proxy) else thing.__exit__(None, None, None)


def calls(path):
    return [e["payload"] for e in rl.read_events(path, run_id=None) if e["kind"] == "model_call"]


def check_ledger(tmp_path):
    """The ledger verifies, audit reads it, and no key (the client's or the upstream's) is in any
    file written."""
    ledger = tmp_path / "calls.jsonl"
    assert run_script("reasoning_ledger.py", "verify", ledger).returncode == 0
    assert run_script("audit.py", ledger).returncode == 0
    blob = all_bytes_under(tmp_path)
    assert CLIENT_KEY.encode() not in blob and KEY.encode() not in blob


def test_plain_message_is_relayed_unchanged_and_recorded(run, tmp_path):
    fake, proxy = run([{"text": "4", "thinking": "two and two", "usage": USAGE}])
    response, raw = post(proxy.conn(), "/messages", ASK, HEADERS)
    assert response.status == 200
    answer = json.loads(raw)
    assert answer["content"][0]["type"] == "thinking" and answer["content"][1]["text"] == "4"
    sent = fake.messages[0]
    assert sent["body"] == ASK and sent["path"] == "/v1/messages"
    # the proxy's key, as x-api-key by default; the client's Anthropic headers, never its key
    assert sent["headers"]["x-api-key"] == KEY and "authorization" not in sent["headers"]
    assert sent["headers"]["anthropic-version"] == "2023-06-01"
    assert sent["headers"]["anthropic-beta"] == HEADERS["anthropic-beta"]
    [line] = calls(tmp_path / "calls.jsonl")
    assert line["route"] == "/messages" and line["stream"] is False and line["http_status"] == 200
    assert line["error_type"] is None and line["finish_reason"] == "end_turn"
    assert line["request_model"] == "claude-stand-in" == line["response_model"]
    assert line["response_id"] == answer["id"]
    # input counts the cached tokens read and written (OTel GenAI); total is input + output
    assert line["input_tokens"] == 127 and line["output_tokens"] == 5
    assert line["total_tokens"] == 132 and line["usage_status"] == "complete"
    assert line["cached_input_tokens"] == 100 and line["cache_creation_input_tokens"] == 20
    assert line["session_id"] == HEADERS["X-Claude-Code-Session-Id"]
    assert line["max_tokens"] == 1000 and line["system_chars"] == len("Be brief.")
    assert line["response_chars"] == len("two and two4")
    check_ledger(tmp_path)


def test_streamed_message_with_a_tool_call_is_relayed_event_for_event(run, tmp_path):
    turn = {"tool_use": {"name": "Bash", "input": {"command": "ls"}}, "thinking": "look first"}
    fake, proxy = run([turn])
    response, raw = post(proxy.conn(), "/messages?beta=true", dict(ASK, stream=True), HEADERS)
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    sent = fake.messages[0]
    assert sent["path"] == "/v1/messages?beta=true" and "stream_options" not in sent["body"]
    # what the stand-in sent, byte for byte (its message counted from the body it was sent)
    assert raw == sse(events(message(sent["body"], turn, 1)))
    [line] = calls(tmp_path / "calls.jsonl")
    assert line["route"] == "/messages" and line["stream"] is True and line["error_type"] is None
    assert line["finish_reason"] == "tool_use" and line["ttft_ms"] is not None
    assert line["usage_status"] == "complete"
    assert line["input_tokens"] + line["output_tokens"] == line["total_tokens"]
    assert line["response_chars"] == len("look first") + len(json.dumps({"command": "ls"}))
    check_ledger(tmp_path)


def test_count_tokens_is_a_call_with_input_tokens_only(run, tmp_path):
    fake, proxy = run()
    response, raw = post(proxy.conn(), "/messages/count_tokens", ASK, HEADERS)
    assert response.status == 200
    counted = json.loads(raw)["input_tokens"]
    assert fake.requests[0]["path"] == "/v1/messages/count_tokens"
    [line] = calls(tmp_path / "calls.jsonl")
    assert line["route"] == "/messages/count_tokens" and line["error_type"] is None
    assert line["input_tokens"] == counted and line["output_tokens"] is None
    assert line["usage_status"] == "complete"
    check_ledger(tmp_path)


@pytest.mark.parametrize("path", ["/", "/api/hello"])
def test_head_probe_is_answered_here_neither_forwarded_nor_recorded(run, tmp_path, path):
    fake, proxy = run()
    conn = proxy.conn()
    conn.request("HEAD", path)
    response = conn.getresponse()
    response.read()
    assert response.status == 200
    conn.request("GET", path)  # only the probe: nothing else is served there
    response = conn.getresponse()
    response.read()
    assert response.status == 405
    proxy.stop()
    assert fake.requests == [] and calls(tmp_path / "calls.jsonl") == []


def test_upstream_auth_bearer_and_a_wrong_setting(run, tmp_path):
    fake, proxy = run([{"text": "4"}], UPSTREAM_AUTH="bearer")
    response, _ = post(proxy.conn(), "/messages", ASK, HEADERS)
    assert response.status == 200
    headers = fake.messages[0]["headers"]
    assert headers["authorization"] == "Bearer " + KEY and "x-api-key" not in headers
    bad = run_script(
        "proxy.py",
        "--listen",
        "127.0.0.1:0",
        env=clean_env(BASE_URL=fake.base_url, API_KEY=KEY, UPSTREAM_AUTH="basic"),
    )
    assert bad.returncode == 2 and bad.err.count("\n") == 1
    assert bad.err.startswith("error: UPSTREAM_AUTH must be x-api-key or bearer")


def test_proxy_token_as_x_api_key_is_checked_and_never_forwarded(run, tmp_path):
    token = "proxy-token-for-clients-0123456789"
    fake, proxy = run([{"text": "4"}], PROXY_TOKEN=token)
    response, raw = post(proxy.conn(), "/messages", ASK, dict(HEADERS, **{"x-api-key": "wrong"}))
    assert response.status == 401 and json.loads(raw)["type"] == "error"
    response, _ = post(proxy.conn(), "/messages", ASK, dict(HEADERS, **{"x-api-key": token}))
    assert response.status == 200
    assert [r["headers"]["x-api-key"] for r in fake.messages] == [KEY]
    assert token.encode() not in all_bytes_under(tmp_path)


# ----------------------------------------------------------------------------
# Hostile upstreams
# ----------------------------------------------------------------------------


def _start_events(usage=None):
    head = {"id": "msg_h", "type": "message", "role": "assistant", "model": "served-model"}
    head.update(content=[], stop_reason=None)
    if usage is not None:
        head["usage"] = usage
    return [
        ("message_start", {"type": "message_start", "message": head}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "4"}},
        ),
    ]


END = [
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    (
        "message_delta",
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
    ),
    ("message_stop", {"type": "message_stop"}),
]
OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
HOSTILE = {
    # cut in the middle of a block: the relay ends broken, the line says so
    "cut_mid_block": (
        sse(_start_events({"input_tokens": 3}))[:-30],
        "truncated_stream",
        False,
    ),
    # cut between whole events, before message_stop
    "no_message_stop": (sse(_start_events({"input_tokens": 3}) + END[:2]), "truncated_stream", False),
    # an error event mid-stream is the line's error; the client reads it as the upstream sent it
    "error_event": (sse(_start_events() + [("error", OVERLOADED)]), "api_error", True),
    "bad_json": (sse(_start_events())[:-2] + b"\n\nevent: x\ndata: {not json\n\n", "invalid_json", False),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_streams_are_recorded_as_what_they_are(run, tmp_path, name):
    raw, error_type, whole = HOSTILE[name]
    fake, proxy = run([{"raw": raw}])
    conn = proxy.conn()
    conn.request(
        "POST",
        "/v1/messages",
        body=json.dumps(dict(ASK, stream=True)),
        headers=dict(HEADERS, **{"Content-Type": "application/json"}),
    )
    response = conn.getresponse()
    assert response.status == 200
    try:
        got, ended = response.read(), True
    except http.client.IncompleteRead as exc:
        got, ended = exc.partial, False
    assert ended is whole and got.startswith(b"event: message_start")
    if name == "error_event":
        assert got.endswith(sse([("error", OVERLOADED)]))
    [line] = calls(tmp_path / "calls.jsonl")
    assert line["error_type"] == error_type and line["route"] == "/messages"
    if name == "error_event":
        assert line["error_message"] == "error in the stream: Overloaded"
    check_ledger(tmp_path)


def test_a_stream_without_usage_is_a_success_with_usage_absent(run, tmp_path):
    quiet_end = [e if e[0] != "message_delta" else (e[0], dict(e[1], usage=None)) for e in END]
    fake, proxy = run([{"raw": sse(_start_events() + quiet_end)}, {"text": "4", "usage": {"output_tokens": None}}])
    response, raw = post(proxy.conn(), "/messages", dict(ASK, stream=True), HEADERS)
    assert response.status == 200 and raw.endswith(sse(END[-1:]))
    response, raw = post(proxy.conn(), "/messages", ASK, HEADERS)
    assert response.status == 200
    streamed, plain = calls(tmp_path / "calls.jsonl")
    assert streamed["error_type"] is None and streamed["usage_status"] == "absent"
    assert streamed["response_model"] == "served-model" and streamed["finish_reason"] == "end_turn"
    assert plain["error_type"] is None and plain["usage_status"] == "partial"
    assert plain["output_tokens"] is None and plain["total_tokens"] is None
    check_ledger(tmp_path)


def test_upstream_http_errors_go_back_as_sent_and_are_recorded(run, tmp_path):
    error = {"type": "overloaded_error", "message": "Overloaded"}
    fake, proxy = run([{"status": 529, "error": error}, {"raw": b"not an event stream at all"}])
    response, raw = post(proxy.conn(), "/messages", ASK, HEADERS)
    assert response.status == 529 and json.loads(raw) == {"type": "error", "error": error}
    response, raw = post(proxy.conn(), "/messages", dict(ASK, stream=True), HEADERS)
    first, second = calls(tmp_path / "calls.jsonl")
    assert first["http_status"] == 529 and first["error_type"] == "server_error"
    assert "Overloaded" in first["error_message"]
    assert second["error_type"] is not None
    check_ledger(tmp_path)


PLAIN = {
    # an error object with a 200: the body goes back as it came, the line says api_error
    "error_in_200": (json.dumps(OVERLOADED).encode(), "api_error"),
    "block_not_an_object": (
        json.dumps({"type": "message", "id": "m", "model": "m", "content": [7], "usage": USAGE}).encode(),
        "malformed_response",
    ),
    "cut_json": (b'{"type": "message", "content": [{"type": "text", "te', "invalid_json"),
    "empty_message": (
        json.dumps({"type": "message", "content": [], "stop_reason": "end_turn"}).encode(),
        "empty_content",
    ),
}


@pytest.mark.parametrize("name", list(PLAIN))
def test_hostile_plain_answers_are_recorded_as_what_they_are(run, tmp_path, name):
    raw, error_type = PLAIN[name]
    fake, proxy = run([{"raw": raw}])
    response, got = post(proxy.conn(), "/messages", ASK, HEADERS)
    [line] = calls(tmp_path / "calls.jsonl")
    assert line["error_type"] == error_type and line["route"] == "/messages"
    if error_type == "invalid_json":  # nothing usable came: a 502 naming it
        assert response.status == 502 and json.loads(got)["error"]["code"] == "invalid_json"
    else:  # a body that parses goes back as it came, whatever its line says of it
        assert response.status == 200 and got == raw
    check_ledger(tmp_path)
