"""`proxy.py`: every route, plain and streamed, against the scripted upstream, through real sockets,
with the proxy a subprocess started as a user starts it. Hostile servers and clients: test_proxy_hostile.py."""

import json
import threading

import pytest

import proxy as proxy_script
import reasoning_ledger as rl
from conftest import KEY, all_bytes_under, run_script, clean_env
from fake_upstream import ANSWER, Upstream
from proxy_helpers import JSON, Proxy, events, post

CHAT = {"model": "up-model", "messages": [{"role": "user", "content": "2+2?"}]}
BODIES = {
    "/chat/completions": CHAT,
    "/completions": {"model": "up-model", "prompt": "2+2="},
    "/responses": {"model": "up-model", "instructions": "Be brief.", "input": "2+2?"},
    "/embeddings": {"model": "up-model", "input": "four"},
}


@pytest.fixture
def upstream():
    up = Upstream().start()
    yield up
    up.stop()


@pytest.fixture
def start(upstream, tmp_path):
    started = []

    def go(*args, base_url=None, **env):
        proxy = Proxy(base_url or upstream.base_url, tmp_path / "calls.jsonl", *args, **env)
        started.append(proxy)
        return proxy
    yield go
    for proxy in started:
        proxy.stop()


def calls(path, kind="model_call"):
    return [e["payload"] for e in rl.read_events(path, run_id=None) if e["kind"] == kind]


def verified(path):
    return run_script("reasoning_ledger.py", "verify", path).returncode == 0


# ----------------------------------------------------------------------------
# Routes
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("route", list(BODIES))
def test_each_route_plain_is_forwarded_and_recorded(start, upstream, route):
    proxy = start()
    response, raw = post(proxy.conn(), route, BODIES[route])
    assert response.status == 200
    assert raw == json.dumps(json.loads(raw)).encode()  # the upstream's own bytes
    (line,) = calls(proxy.ledger)
    assert upstream.requests[0]["path"] == "/v1" + route
    assert (line["route"], line["http_status"], line["error_type"], line["check"]) == (route, 200, None, None)
    assert line["usage_status"] == "complete" and line["response_model"] == "up-model"
    assert line["client_address"] == "127.0.0.1" and line["user_agent"] == "test-client/1"
    if route == "/embeddings":
        assert (line["input_tokens"], line["output_tokens"], line["response_chars"]) == (5, None, None)
    else:
        assert line["response_chars"] == len(ANSWER)
    if route == "/responses":
        assert (line["input_tokens"], line["cached_input_tokens"], line["finish_reason"]) == (30, 4, "completed")
        assert line["system_chars"] == len("Be brief.") and line["prompt_chars"] == len("2+2?")


def test_models_is_forwarded_and_recorded_as_models_list(start):
    proxy = start()
    conn = proxy.conn()
    conn.request("GET", "/v1/models/")
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == "up-model"
    (line,) = calls(proxy.ledger, "models_list")
    assert line["model_ids"] == ["up-model"] and line["http_status"] == 200


@pytest.mark.parametrize("route", ["/chat/completions", "/completions", "/responses"])
def test_each_route_streamed_is_relayed_and_recorded(start, upstream, route):
    proxy = start()
    response, raw = post(proxy.conn(), route, dict(BODIES[route], stream=True))
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    got = events(raw)
    text = "".join(_delta(e) for e in got)
    assert text == ANSWER
    if route == "/responses":
        assert got[0].startswith("event: response.created") and got[-1].startswith("event: response.completed")
        assert "[DONE]" not in raw.decode()
    else:
        assert got[-1] == "data: [DONE]"
    (line,) = calls(proxy.ledger)
    assert line["stream"] is True and line["ttft_ms"] is not None and line["response_chars"] == len(ANSWER)
    assert line["usage_status"] == "complete" and line["error_type"] is None
    assert line["input_tokens"] == (30 if route == "/responses" else 21)


def _delta(event):
    data = json.loads(event.split("data: ", 1)[1]) if "data: {" in event else {}
    if data.get("type") == "response.output_text.delta":
        return data["delta"]
    choice = (data.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def test_unknown_paths_and_wrong_methods_are_not_forwarded(start, upstream):
    proxy = start()
    conn = proxy.conn()
    for method, path, status in (("POST", "/v1/nothing", 404), ("GET", "/chat/completions", 404),
                                 ("GET", "/v1/chat/completions", 405), ("POST", "/v1/models", 405)):
        conn.request(method, path, body=b"{}" if method == "POST" else None)
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == status and error["message"], (method, path)
    assert upstream.requests == [] and calls(proxy.ledger) == []


# ----------------------------------------------------------------------------
# Pinning, tokens, loopback
# ----------------------------------------------------------------------------

def test_a_pinned_model_refuses_any_other_and_records_it_unsent(start, upstream):
    proxy = start(MODEL_ID="up-model")
    conn = proxy.conn()
    response, raw = post(conn, "/chat/completions", dict(CHAT, model="other-model"))
    assert response.status == 400 and json.loads(raw)["error"]["code"] == "model_not_allowed"
    assert post(conn, "/chat/completions", CHAT)[0].status == 200
    refused, ok = calls(proxy.ledger)
    assert (refused["error_type"], refused["http_status"], refused["request_model"]) == (
        "model_not_allowed", None, "other-model")
    assert ok["error_type"] is None and len(upstream.requests) == 1


@pytest.mark.parametrize("pinned", [None, "up-model"])
def test_a_request_without_a_model_is_model_missing(start, upstream, pinned):
    proxy = start(MODEL_ID=pinned)
    response, raw = post(proxy.conn(), "/chat/completions", {"messages": CHAT["messages"]})
    assert response.status == 400 and json.loads(raw)["error"]["code"] == "model_missing"
    (line,) = calls(proxy.ledger)
    assert line["error_type"] == "model_missing" and upstream.requests == []


def test_with_a_token_clients_must_present_it_and_it_is_masked(start, upstream, tmp_path):
    token = "proxy-token-0123456789abcdef"
    proxy = start(PROXY_TOKEN=token)
    conn = proxy.conn()
    for auth in (None, "Bearer wrong-token-0123456789"):
        response, _ = post(conn, "/chat/completions", CHAT, {"Authorization": auth} if auth else {})
        assert response.status == 401
    response, _ = post(conn, "/chat/completions", dict(CHAT, messages=[{"role": "user", "content": token}]),
                       {"Authorization": f"Bearer {token}", "X-Ledger-Session": f"s-{token}"})
    assert response.status == 200
    assert upstream.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"
    code, out, err = proxy.stop()
    assert code == 0 and token.encode() not in all_bytes_under(tmp_path) and token not in out + err
    assert calls(proxy.ledger)[0]["session_id"] == f"s-{rl.REDACTED}"


def test_without_a_token_only_loopback_and_loopback_host_names(start, upstream, tmp_path):
    proc = run_script("proxy.py", "--listen", "0.0.0.0:0", env=clean_env(BASE_URL=upstream.base_url,
                                                                                 API_KEY=KEY))
    assert proc.returncode == 2 and proc.err.startswith("error: ") and len(proc.err.splitlines()) == 1
    proxy = start()
    for host, status in (("evil.example", 403), (f"localhost:{proxy.port}", 200), ("[::1]:9", 200)):
        response, _ = post(proxy.conn(), "/chat/completions", CHAT, {"Host": host})
        assert response.status == status, host
    assert len(upstream.requests) == 2


def test_a_missing_setting_or_a_port_in_use_is_exit_2_with_one_error_line(start):
    proc = run_script("proxy.py", "--listen", "127.0.0.1:0", env=clean_env(API_KEY=KEY))
    assert proc.returncode == 2 and proc.err.splitlines()[0].startswith("error: BASE_URL")
    proxy = start()
    proc = run_script("proxy.py", "--listen", f"127.0.0.1:{proxy.port}",
                      env=clean_env(API_KEY=KEY, BASE_URL="http://127.0.0.1:9/v1"))
    assert proc.returncode == 2 and proc.err.startswith("error: cannot listen") and proc.out == ""
    assert proxy.first_line.startswith("proxy: listening on http://127.0.0.1:") and "-> http://" in proxy.first_line


# ----------------------------------------------------------------------------
# Headers, both ways, and key hygiene
# ----------------------------------------------------------------------------

CLIENT_SECRETS = {"Authorization": "Bearer client-secret-aaaa1111", "api-key": "client-secret-bbbb2222",
                  "x-api-key": "client-secret-cccc3333", "Cookie": "sid=client-secret-dddd4444",
                  "Proxy-Authorization": "Basic client-secret-eeee5555", "Accept-Encoding": "gzip, br",
                  "X-Custom": "client-secret-ffff6666"}


def test_headers_pass_by_allow_lists_both_ways_and_no_secret_reaches_a_file(start, upstream, tmp_path):
    proxy = start()
    for body in (CHAT, dict(CHAT, stream=True)):
        response, _ = post(proxy.conn(), "/chat/completions", body, CLIENT_SECRETS)
        assert response.status == 200
        passed = {k.lower() for k, _ in response.getheaders()}
        assert {"x-request-id", "x-ratelimit-remaining-requests", "openai-processing-ms", "retry-after"} <= passed
        assert not passed & {"set-cookie", "x-upstream-private", "server"}
    for sent in upstream.requests:
        headers = sent["headers"]
        assert set(headers) <= {"authorization", "content-type", "content-length", "accept", "user-agent",
                                "host", "connection", "accept-encoding"}, headers
        assert headers["authorization"] == f"Bearer {KEY}" and headers.get("accept-encoding", "identity") == "identity"
    code, out, err = proxy.stop()
    written = all_bytes_under(tmp_path)
    for secret in [KEY] + [v.split()[-1].split("=")[-1] for v in CLIENT_SECRETS.values()]:
        assert secret.encode() not in written and secret not in out + err, secret


def test_an_upstream_error_reaches_the_client_as_it_is_without_the_key(start, upstream):
    upstream.queue({"name": "error", "status": 429, "headers": {"retry-after-ms": "1500"}})
    proxy = start()
    response, raw = post(proxy.conn(), "/chat/completions", CHAT)
    assert response.status == 429 and json.loads(raw)["error"]["message"] == "upstream says no"
    assert response.getheader("retry-after-ms") == "1500" and response.getheader("Set-Cookie") is None
    (line,) = calls(proxy.ledger)
    assert (line["error_type"], line["http_status"], line["error_code"]) == ("rate_limited", 429, "nope")


# ----------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------

def _stream(proxy):
    """A streamed chat request whose response is left unread: the test reads it as it arrives."""
    conn = proxy.conn()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(CHAT, stream=True)), headers=JSON)
    return conn.getresponse()


def test_a_streamed_chunk_reaches_the_client_before_the_next_is_sent(start, upstream):
    upstream.queue("gated")
    proxy = start()
    response = _stream(proxy)
    event = response.readline()
    assert b"The an" in event
    assert not upstream.gate.is_set()  # the upstream is still holding the rest
    upstream.gate.set()
    rest = response.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert calls(proxy.ledger)[0]["error_type"] is None


@pytest.mark.parametrize("asked", [False, True])
def test_the_usage_chunk_is_dropped_unless_asked_and_filter_chunks_stay(start, upstream, asked):
    upstream.queue("filter")
    proxy = start()
    body = dict(CHAT, stream=True, **({"stream_options": {"include_usage": True}} if asked else {}))
    _, raw = post(proxy.conn(), "/chat/completions", body)
    chunks = [json.loads(e[6:]) for e in events(raw) if e != "data: [DONE]"]
    assert "prompt_filter_results" in chunks[0] and chunks[0]["choices"] == []
    assert any(c.get("usage") for c in chunks) == asked
    assert upstream.requests[0]["body"]["stream_options"] == {"include_usage": True}
    assert calls(proxy.ledger)[0]["usage_status"] == "complete"


def test_a_stream_options_rejection_gets_one_retry_recorded_as_its_own_line(start, upstream):
    upstream.queue("reject_options")
    proxy = start()
    response, raw = post(proxy.conn(), "/chat/completions", dict(CHAT, stream=True))
    assert response.status == 200 and events(raw)[-1] == "data: [DONE]"
    first, second = calls(proxy.ledger)
    assert first["http_status"] == 400 and "stream_options" in first["retry_reason"]
    assert second["stream_options_dropped"] is True and second["attempt"] == 2 and second["error_type"] is None
    assert second["usage_status"] == "absent"  # without stream_options the upstream sends no usage
    assert len(upstream.requests) == 2 and "stream_options" not in upstream.requests[1]["body"]


def test_a_stream_cut_after_relaying_began_closes_the_client_stream(start, upstream):
    upstream.queue("cut")
    proxy = start()
    response = _stream(proxy)
    with pytest.raises(Exception) as broken:
        response.read()
    assert type(broken.value).__name__ == "IncompleteRead"
    (line,) = calls(proxy.ledger)
    assert line["error_type"] == "truncated_stream" and line["response_chars"] == 12


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_without_text_are_an_answer(start, upstream, stream):
    upstream.queue("tools")
    proxy = start()
    response, _ = post(proxy.conn(), "/chat/completions", dict(CHAT, stream=stream))
    assert response.status == 200
    (line,) = calls(proxy.ledger)
    assert line["error_type"] is None and line["finish_reason"] == "tool_calls" and line["check"] is None


# ----------------------------------------------------------------------------
# The record: written before the answer ends; client shapes normalised
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_the_line_is_there_before_the_answer_ends(start, stream):
    proxy = start()
    conn = proxy.conn()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(CHAT, stream=stream)), headers=JSON)
    response = conn.getresponse()
    if stream:
        while b"[DONE]" not in response.readline():
            pass
        assert len(calls(proxy.ledger)) == 1  # the last event was held until the line was written
        response.read()
    else:
        response.read()
        assert len(calls(proxy.ledger)) == 1


def test_client_shapes_are_normalised_for_the_prompt_fields(start, upstream):
    proxy = start()
    conn = proxy.conn()
    messages = [{"role": "developer", "content": "Rules."}, {"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    post(conn, "/chat/completions", dict(CHAT, messages=messages))
    post(conn, "/completions", {"model": "up-model", "prompt": [[1, 2, 3], [4, 5]]})
    post(conn, "/responses", {"model": "up-model", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call_output", "call_id": "c", "output": "done"}]})
    chat, tokens, responses = calls(proxy.ledger)
    assert chat["system_chars"] == len("Rules.") and chat["message_count"] == 5
    assert chat["prompt_chars"] == len("Look: [image_url]") + len('[{"id":"c","type":"function"}]') + len("ok")
    assert tokens["est_input_tokens"] == 5 and "token ids" in tokens["est_method"] and tokens["prompt_chars"] == 0
    assert responses["prompt_chars"] == len("hidone") and responses["message_count"] == 2


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe", b'{"model": 7}', b"[" * 100000 + b"]" * 100000,
                                  b'{"model": "up-model", "messages": 5}', b'{"model": "up-model", "messages": [5, null,'
                                  b' {"role": 3, "content": {"x": [1]}}, {"content": [7, {"type": null}]}]}',
                                  b'{"model": "up-model", "messages": [{"role": "user", "content": "\\ud800"}]}'],
                         ids=["text", "list", "bytes", "int-model", "deep", "int-messages", "odd-parts", "surrogate"])
def test_nothing_a_client_sends_crashes_the_record(start, body):
    proxy = start()
    response, raw = post(proxy.conn(), "/chat/completions", body)
    assert response.status in (200, 400) and json.loads(raw)
    assert len(calls(proxy.ledger)) == 1 and verified(proxy.ledger)


def test_session_and_client_retry_are_recorded_and_audit_groups_by_session(start, tmp_path):
    proxy = start()
    conn = proxy.conn()
    for session in ("alpha", "alpha", "beta"):
        post(conn, "/chat/completions", CHAT, {"X-Ledger-Session": session, "x-stainless-retry-count": "1",
                                                "User-Agent": "OpenAI/Python 1.0 " + "x" * 500})
    lines = calls(proxy.ledger)
    assert [c["session_id"] for c in lines] == ["alpha", "alpha", "beta"] and lines[0]["client_retry"] == 1
    assert len(lines[0]["user_agent"]) == proxy_script.MAX_HEADER_CHARS
    proc = run_script("audit.py", proxy.ledger, "--by", "session", "--json")
    assert proc.returncode == 0, proc.err
    rows = json.loads(proc.out)["models"]
    assert sorted((r["session_id"], r["calls"]) for r in rows) == [("alpha", 2), ("beta", 1)]


# ----------------------------------------------------------------------------
# Concurrency
# ----------------------------------------------------------------------------

def test_eight_keep_alive_clients_every_line_present_chain_valid_connections_reused(start):
    proxy = start()
    errors, ports = [], set()

    def client(n):
        conn = proxy.conn()
        try:
            for i in range(6):
                response, _ = post(conn, "/chat/completions", dict(CHAT, stream=i % 2 == 1),
                                   {"X-Ledger-Session": f"c{n}"})
                assert response.status == 200
                ports.add((n, conn.sock.getsockname()[1]))
        except Exception as exc:  # a thread's failure, reported by the test
            errors.append(exc)
    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert len(ports) == 8  # each client kept one connection for its six requests
    lines = calls(proxy.ledger)
    assert len(lines) == 48 and all(c["error_type"] is None for c in lines)
    assert sorted({c["session_id"] for c in lines}) == sorted(f"c{n}" for n in range(8))
    assert verified(proxy.ledger)
