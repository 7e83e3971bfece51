"""`proxy.py` as the real clients showed it (issue 25, part 4), through a proxy subprocess and real
sockets: a client that leaves (before the answer, during its write, on a keep-alive connection) is
`client_gone` and its upstream request is cut; tool-call answers have an output size and a ttft;
an empty stream is relayed as the 200 it was and recorded `empty_stream`; every refusal of a client
is a `proxy_refused` line, at a bounded rate, with no secret on disk."""

import http.client
import json
import socket
import struct
import time

import pytest

import ask
import reasoning_ledger as rl
from conftest import KEY, all_bytes_under
from fake_upstream import TOOL_CALL
from proxy_helpers import JSON, Proxy, post
from test_proxy import CHAT, calls, upstream  # noqa: F401 -- the scripted upstream fixture

GUARD_S = 60  # a hang guard only: every wait below ends on an event
TOOL_CHARS = len("run") + len('{"cmd": "ls"}')  # fake_upstream's tool call: name + arguments
RESPONSES = {"model": "up-model", "input": "2+2?"}


@pytest.fixture
def start(tmp_path):
    started = []

    def go(base_url, *args, **env):
        proxy = Proxy(base_url, tmp_path / "calls.jsonl", *args, **env)
        started.append(proxy)
        return proxy
    yield go
    for proxy in started:
        proxy.stop()


def lines(path, kind="model_call", count=1):
    """The ledger's `kind` payloads once there are `count` of them (the line of a client that left
    is written after the attempt ends: wait for it, under the guard)."""
    ends = time.monotonic() + GUARD_S
    while True:
        found = calls(path, kind) if path.exists() else []
        if len(found) >= count or time.monotonic() > ends:
            return found
        time.sleep(0.02)


def request(path, body, headers=None, method="POST"):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    head = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(data)),
            **(headers or {})}
    return (f"{method} /v1{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
            + "\r\n").encode() + data


def connect(proxy, rcvbuf=None):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(GUARD_S)
    sock.connect(("127.0.0.1", proxy.port))
    return sock


def reset(sock):
    """Close with an RST, as a client killed mid-answer does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def answer(sock):
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response, response.read()


# ----------------------------------------------------------------------------
# A client that leaves: client_gone, and the upstream request is cut
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("route, body", [("/chat/completions", CHAT), ("/responses", RESPONSES)])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_client_gone_before_the_answer_is_client_gone_and_the_upstream_is_cut(start, upstream, route,
                                                                                 body, stream, how):
    upstream.queue("held")
    proxy = start(upstream.base_url)
    sock = connect(proxy)
    sock.sendall(request(route, dict(body, stream=stream)))
    assert upstream.first_sent.wait(GUARD_S)
    if stream:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")  # relaying began
    sock.close() if how == "close" else reset(sock)
    assert upstream.closed.wait(GUARD_S), "the proxy kept the upstream request open"
    (line,) = lines(proxy.ledger)
    assert line["error_type"] == "client_gone" and "client closed" in line["error_message"]
    assert line["http_status"] == (200 if stream else None)
    if stream and route == "/chat/completions":  # its first event is text (the Responses API's is not)
        assert line["response_chars"] > 0 and line["ttft_ms"] is not None
    assert len(upstream.requests) == 1


def test_a_client_gone_during_the_write_of_a_whole_answer_is_client_gone(start, hostile):
    text = "x" * 12_000_000  # more than the socket buffers hold: the write is under way when it leaves
    usage = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    hostile.queue({"name": "json", "body": {"model": "m", "usage": usage, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}})
    proxy = start(hostile.base_url, "--max-response-bytes", 32 * 1024 * 1024)
    sock = connect(proxy, rcvbuf=4096)
    sock.sendall(request("/chat/completions", CHAT))
    assert sock.recv(16).startswith(b"HTTP/1.1 200")
    reset(sock)
    (line,) = lines(proxy.ledger)
    assert (line["error_type"], line["http_status"], line["usage_status"]) == ("client_gone", 200, "complete")
    assert line["response_chars"] == len(text)  # what the upstream answered, and was paid for


def test_on_a_keep_alive_connection_only_the_call_the_client_left_is_client_gone(start, upstream):
    upstream.queue("ok", "held")
    proxy = start(upstream.base_url)
    sock = connect(proxy)
    sock.sendall(request("/chat/completions", CHAT))
    response, raw = answer(sock)
    assert response.status == 200 and json.loads(raw)["choices"]
    sock.sendall(request("/chat/completions", CHAT))  # the same connection, the next call
    assert upstream.first_sent.wait(GUARD_S)
    sock.close()
    assert upstream.closed.wait(GUARD_S)
    first, second = lines(proxy.ledger, count=2)
    assert first["error_type"] is None and second["error_type"] == "client_gone"
    # a client that closes an idle keep-alive connection after its answer left nothing behind
    sock = connect(proxy)
    sock.sendall(request("/chat/completions", CHAT))
    assert answer(sock)[0].status == 200
    sock.close()
    assert post(proxy.conn(), "/chat/completions", CHAT)[0].status == 200
    assert [line["error_type"] for line in lines(proxy.ledger, count=4)] == [None, "client_gone", None, None]


# ----------------------------------------------------------------------------
# Tool-call answers have an output size and a time to first token
# ----------------------------------------------------------------------------

def _responses_tool_events(arguments):
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "run", "arguments": ""}
    done = dict(item, arguments=arguments)
    response = {"id": "resp_1", "object": "response", "model": "m", "status": "completed", "output": [done],
                "usage": {"input_tokens": 5, "output_tokens": 9, "total_tokens": 14}}
    events = [("response.created", {"response": dict(response, status="in_progress", output=[])}),
              ("response.output_item.added", {"output_index": 0, "item": item})]
    events += [("response.function_call_arguments.delta", {"item_id": "fc_1", "delta": arguments[i:i + 5]})
               for i in range(0, len(arguments), 5)]
    events += [("response.function_call_arguments.done", {"item_id": "fc_1", "arguments": arguments}),
               ("response.output_item.done", {"output_index": 0, "item": done}),
               ("response.completed", {"response": response})]
    return response, [f"event: {k}\ndata: {json.dumps(dict(v, type=k))}\n\n".encode() for k, v in events]


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_answer_of_tool_calls_counts_them_as_output(start, upstream, stream):
    upstream.queue("tools")
    proxy = start(upstream.base_url)
    assert post(proxy.conn(), "/chat/completions", dict(CHAT, stream=stream))[0].status == 200
    (line,) = lines(proxy.ledger)
    assert line["error_type"] is None and line["finish_reason"] == "tool_calls"
    assert (line["response_chars"], line["est_output_tokens"]) == (TOOL_CHARS, ask.estimate_tokens(TOOL_CHARS))
    assert (line["ttft_ms"] is not None) is stream


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_answer_of_tool_calls_counts_them_once_as_output(start, hostile, stream):
    arguments = '{"cmd": "ls -la /tmp"}'
    response, events = _responses_tool_events(arguments)
    hostile.queue({"name": "sse", "events": events} if stream else {"name": "json", "body": response})
    proxy = start(hostile.base_url)
    reply, raw = post(proxy.conn(), "/responses", dict(RESPONSES, stream=stream))
    assert reply.status == 200 and b"ls -la" in raw
    (line,) = lines(proxy.ledger)
    assert line["error_type"] is None and line["finish_reason"] == "completed"
    assert line["response_chars"] == len("run") + len(arguments)  # .done repeats them: not counted twice
    assert (line["ttft_ms"] is not None) is stream


@pytest.mark.parametrize("stream", [False, True])
def test_ask_py_reads_tool_calls_with_the_same_parser(upstream, tmp_path, stream):
    upstream.queue("tools")
    record = ask.chat(CHAT["messages"], ledger=tmp_path / "calls.jsonl", base_url=upstream.base_url,
                      model="up-model", api_key=KEY, stream=stream)
    assert record["response_chars"] == TOOL_CHARS and (record["ttft_ms"] is not None) is stream
    assert record["error_type"] == "empty_content"  # ask.py asked for text, and got none


# ----------------------------------------------------------------------------
# An empty stream: relayed as it came, a 200 that ends; recorded empty_stream
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("route, body", [("/chat/completions", CHAT), ("/responses", RESPONSES)])
@pytest.mark.parametrize("sent", [b"", b"data: [DONE]\n\n", b": keep-alive\n\n", b": ping\n\ndata: [DONE]\n\n"])
def test_an_empty_stream_is_relayed_as_a_200_that_ends_and_recorded_empty_stream(start, hostile, route, body,
                                                                                  sent):
    hostile.queue({"name": "sse", "events": [sent] if sent else []})
    proxy = start(hostile.base_url)
    response, raw = post(proxy.conn(), route, dict(body, stream=True))  # read to its end: no IncompleteRead
    assert response.status == 200 and raw == sent
    (line,) = lines(proxy.ledger)
    assert (line["error_type"], line["http_status"], line["response_chars"]) == ("empty_stream", 200, 0)


def test_a_stream_with_a_data_event_but_no_end_is_still_truncated_not_empty(start, hostile):
    chunk = b'data: {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
    hostile.queue({"name": "sse", "events": [chunk]})
    proxy = start(hostile.base_url)
    conn = proxy.conn()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(CHAT, stream=True)), headers=JSON)
    with pytest.raises(http.client.IncompleteRead):
        conn.getresponse().read()
    assert lines(proxy.ledger)[0]["error_type"] == "truncated_stream"


def test_ask_py_records_an_empty_stream_and_does_not_retry_it(hostile, tmp_path):
    hostile.queue({"name": "sse", "events": [b"data: [DONE]\n\n"]})
    record = ask.chat(CHAT["messages"], ledger=tmp_path / "calls.jsonl", base_url=hostile.base_url,
                      model="m", api_key=KEY, stream=True, retries=2, backoff=0)
    assert record["error_type"] == "empty_stream" and len(hostile.requests) == 1


# ----------------------------------------------------------------------------
# Refusals of clients: proxy_refused lines, bounded, without a secret
# ----------------------------------------------------------------------------

TOKEN = "proxy-token-0123456789abcdef"
WRONG = "wrong-token-9876543210fedcba"
BIG_HEADERS = "".join(f"X-Filler-{i}: {i}\r\n" for i in range(150))
REFUSALS = [  # (name, proxy args and env, the request's bytes, status, reason)
    ("no token", {"PROXY_TOKEN": TOKEN}, request("/chat/completions", CHAT), 401, "invalid_api_key"),
    ("wrong token", {"PROXY_TOKEN": TOKEN}, request("/chat/completions", CHAT, {"Authorization": f"Bearer {WRONG}"}),
     401, "invalid_api_key"),
    ("host", {}, request("/chat/completions", CHAT, {"Host": "evil.example"}), 403, "forbidden"),
    ("origin", {}, request("/chat/completions", CHAT, {"Origin": "http://evil.example"}), 403, "bad_origin"),
    ("content type", {}, request("/chat/completions", CHAT, {"Content-Type": "text/plain"}), 415,
     "wrong_content_type"),
    ("no length", {}, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
     b"\r\n\r\n", 411, "missing_length"),
    ("chunked", {}, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
     b"\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411, "transfer_encoding"),
    ("bad length", {}, request("/chat/completions", CHAT, {"Content-Length": "ten"}), 400, "bad_length"),
    ("too large", {"args": ["--max-body-bytes", 1024]}, request("/chat/completions", b"{" + b" " * 2000 + b"}"),
     413, "too_large"),
    ("no route", {}, b"GET /v1/nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 404, "not_found"),
    ("method", {}, b"GET /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 405, "method_not_allowed"),
    ("request line", {}, b"GARBAGE\r\n\r\n", 400, "invalid_request"),
    ("headers", {}, ("GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + BIG_HEADERS + "\r\n").encode(), 431,
     "headers_too_large"),
    ("slow body", {"args": ["--read-timeout", 1]}, request("/chat/completions", CHAT)[:-5], 408,
     "request_timeout"),
    ("short body", {"half_close": True}, request("/chat/completions", CHAT)[:-5], 400, "incomplete_body"),
]


@pytest.mark.parametrize("name, given, data, status, reason", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_refusal_of_a_client_is_a_proxy_refused_line(start, upstream, tmp_path, name, given, data,
                                                          status, reason):
    given = dict(given)
    half_close, args = given.pop("half_close", False), given.pop("args", [])
    proxy = start(upstream.base_url, *args, **given)
    sock = connect(proxy)
    sock.sendall(data)
    if half_close:
        sock.shutdown(socket.SHUT_WR)
    if status == 408:  # the read deadline shuts the connection both ways: no answer gets out
        assert sock.recv(65536) == b""
    else:
        response, raw = answer(sock)
        assert response.status == status and json.loads(raw)["error"]["code"] == reason
    sock.close()
    (line,) = lines(proxy.ledger, "proxy_refused")
    assert (line["status"], line["reason"], line["client_address"]) == (status, reason, "127.0.0.1")
    assert "unrecorded_before" not in line and upstream.requests == [] and calls(proxy.ledger) == []
    code, out, err = proxy.stop()
    assert code == 0 and rl.verify(proxy.ledger).count >= 1
    blob = all_bytes_under(tmp_path) + out.encode() + err.encode()
    assert TOKEN.encode() not in blob and WRONG.encode() not in blob and KEY.encode() not in blob


def test_past_the_body_budget_the_503_busy_is_recorded(start, upstream):
    proxy = start(upstream.base_url, "--max-body-bytes", 4096, "--max-body-bytes-in-flight", 4096)
    held = connect(proxy)  # the whole budget: admitted (its 100 Continue came back), its body never sent
    held.sendall(request("/chat/completions", b" " * 4096, {"Expect": "100-continue"})[:-4096])
    assert held.recv(100).startswith(b"HTTP/1.1 100 ")
    second = connect(proxy)
    second.sendall(request("/chat/completions", CHAT))
    assert answer(second)[0].status == 503
    (line,) = lines(proxy.ledger, "proxy_refused")
    assert (line["status"], line["reason"], line["path"]) == (503, "busy", "/v1/chat/completions")
    second.close(), held.close()


def test_past_max_connections_the_503_is_recorded(start, upstream):
    proxy = start(upstream.base_url, "--max-connections", 1)
    first = connect(proxy)  # accepted first, and holds the one slot while it idles
    second = connect(proxy)
    assert answer(second)[0].status == 503
    (line,) = lines(proxy.ledger, "proxy_refused")
    assert (line["status"], line["reason"], line["client_address"]) == (503, "too_many_connections",
                                                                        "127.0.0.1")
    first.close(), second.close()


def test_a_flood_of_bad_tokens_is_recorded_at_a_bounded_rate_and_every_refusal_counted(start, upstream,
                                                                                      tmp_path):
    proxy = start(upstream.base_url, PROXY_TOKEN=TOKEN)
    sock, sent = connect(proxy), 0
    bad = request("/models", b"", {"Authorization": f"Bearer {WRONG}"}, method="GET")

    def refuse():
        sock.sendall(bad)  # GET, no body: the connection stays open after each 401
        assert answer(sock)[0].status == 401
        return 1
    began = time.monotonic()
    while sent <= 60 + 5 * (time.monotonic() - began):  # faster than the bucket refills
        sent += refuse()
    elapsed = time.monotonic() - began
    flood = calls(proxy.ledger, "proxy_refused")
    assert len(flood) <= 50 + 5 * elapsed + 1  # the burst, then 5 a second
    while not calls(proxy.ledger, "proxy_refused")[len(flood):]:  # the next one let through counts the rest
        assert time.monotonic() - began < GUARD_S + elapsed
        sent += refuse()
    recorded = calls(proxy.ledger, "proxy_refused")
    assert sum(1 + line.get("unrecorded_before", 0) for line in recorded) == sent
    assert recorded[-1]["unrecorded_before"] > 0 and upstream.requests == []
    assert {(line["status"], line["reason"], line["path"]) for line in recorded} == {
        (401, "invalid_api_key", "/v1/models")}
    code, out, err = proxy.stop()
    blob = all_bytes_under(tmp_path) + out.encode() + err.encode()
    assert code == 0 and WRONG.encode() not in blob and TOKEN.encode() not in blob
