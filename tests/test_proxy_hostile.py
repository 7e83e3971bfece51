"""`proxy.py` against hostile upstreams (the raw-socket server: every case a 502 and one line), hostile
clients (caps, deadlines, idle keep-alive, the connection bound) and shutdown (SIGTERM, kill -9)."""

import http.client
import json
import signal
import socket
import threading
import time

import pytest

from conftest import run_script
from proxy_helpers import JSON, Proxy, post
from test_proxy import CHAT, calls, upstream  # noqa: F401 -- the scripted upstream fixture

HANG_GUARD_S = 60  # a hang guard only: every wait below ends on an event, never on a margin


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


# ----------------------------------------------------------------------------
# Hostile upstreams: a 502 with an OpenAI-style error, and one line each
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("scenario, error_type", [
    ({"name": "redirect", "location": "http://elsewhere.example/v1/chat/completions"}, "redirect"),
    ("garbage_status", "connection_error"),
    ("empty_reply", "connection_error"),
    ("reset", "connection_error"),
    ({"name": "short_body", "content_length": 5000, "sent": 100}, "truncated_response"),
    ({"name": "huge_body", "size": 10_000_000}, "response_too_large"),
    ({"name": "json", "body": "<html><head><title>Sign in</title></head></html>"}, "html_response"),
    ({"name": "json", "body": "upstream says OK"}, "invalid_json"),
    ({"name": "trickle", "interval": 0.5, "total_seconds": 30}, "timeout"),
    ({"name": "long_header", "size": 200_000}, "connection_error"),
])
def test_each_broken_upstream_is_a_502_and_one_line(start, hostile, scenario, error_type):
    hostile.queue(scenario)
    proxy = start(hostile.base_url, "--timeout", "2", "--max-response-bytes", "1048576")
    response, raw = post(proxy.conn(), "/chat/completions", CHAT)
    assert response.status == 502
    error = json.loads(raw)["error"]
    assert error["code"] == error_type and error["message"].startswith("upstream: ")
    (line,) = calls(proxy.ledger)
    assert line["error_type"] == error_type
    if error_type == "redirect":
        assert line["redirect_host"] == "elsewhere.example" and len(hostile.requests) == 1


def test_an_upstream_error_page_passes_through_with_its_status(start, hostile):
    page = "<html><head><title>503 Service Unavailable</title></head></html>"
    hostile.queue({"name": "json", "status": 503, "body": page})
    proxy = start(hostile.base_url)
    response, raw = post(proxy.conn(), "/chat/completions", CHAT)
    assert response.status == 503 and raw.decode() == page
    assert calls(proxy.ledger)[0]["error_type"] == "server_error"


def test_a_stream_cut_mid_event_after_relaying_began_is_truncated_stream(start, hostile):
    first = b'data: {"model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    hostile.queue({"name": "sse", "events": [first, b'data: {"model": "m", "choi'], "cut": True})
    proxy = start(hostile.base_url)
    conn = proxy.conn()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(CHAT, stream=True)), headers=JSON)
    response = conn.getresponse()
    assert response.status == 200 and b"Hi" in response.readline()
    with pytest.raises(Exception) as broken:
        response.read()
    assert type(broken.value).__name__ == "IncompleteRead"
    (line,) = calls(proxy.ledger)
    assert line["error_type"] == "truncated_stream" and line["response_chars"] == 2


# ----------------------------------------------------------------------------
# Hostile clients
# ----------------------------------------------------------------------------

def _closed_by_peer(sock):
    """Wait (under the hang guard) until the proxy closes `sock`; True when it did."""
    sock.settimeout(HANG_GUARD_S)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_bad_request_after_a_good_one_on_a_keep_alive_is_judged_and_logged_on_its_own(start, upstream):
    """Nothing of the last request on a connection (its method, path or headers) speaks for the next."""
    proxy = start(upstream.base_url, "--verbose")
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_GUARD_S)
    body = json.dumps(CHAT).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    sock.sendall(b"GARBAGE\r\n\r\n")
    answers = b""
    while answers.count(b"HTTP/1.1 ") < 2 or not answers.endswith(b"}\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answers += chunk
    sock.close()
    assert answers.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 400" in answers, answers[:300]
    code, _out, err = proxy.stop()
    log = [line for line in err.splitlines() if line.startswith("proxy: ")]
    assert code == 0 and len(log) == 2 and " 400 " in log[1], log
    assert " POST /v1/chat/completions 200 " in log[0] and " - - 400 " in log[1], log
    assert len(calls(proxy.ledger)) == 1

# what a browser sends for a cross-site "simple" POST (fetch with mode no-cors, or a form)
BROWSER = {"Content-Type": "text/plain;charset=UTF-8", "Origin": "https://evil.example",
           "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "empty",
           "Host": "127.0.0.1:8787"}


@pytest.mark.parametrize("headers, status, code", [
    (BROWSER, 403, "bad_origin"),
    ({k: v for k, v in BROWSER.items() if k != "Origin"}, 403, "bad_origin"),
    (dict(BROWSER, Origin="null"), 403, "bad_origin"),
    (dict(BROWSER, **{"Sec-Fetch-Site": "same-site"}), 403, "bad_origin"),
    ({k: v for k, v in BROWSER.items() if k not in ("Origin", "Sec-Fetch-Site")}, 415,
     "wrong_content_type"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "wrong_content_type"),
    ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "wrong_content_type"),
    ({"Content-Type": ""}, 415, "wrong_content_type"),
], ids=["cross-site", "no-origin", "null-origin", "evil-origin", "text-plain", "form", "multipart",
        "none"])
def test_what_a_web_page_can_send_is_refused_and_never_forwarded(start, upstream, headers, status,
                                                                  code):
    proxy = start(upstream.base_url)
    response, raw = post(proxy.conn(), "/chat/completions", json.dumps(CHAT).encode(), headers)
    assert response.status == status, raw
    assert json.loads(raw)["error"]["code"] == code
    assert upstream.requests == []
    assert not proxy.ledger.exists() or calls(proxy.ledger) == []


def test_a_loopback_origin_and_json_with_a_charset_are_served(start, upstream):
    proxy = start(upstream.base_url)
    for origin in (f"http://127.0.0.1:{proxy.port}", f"http://localhost:{proxy.port}", None):
        headers = {"Content-Type": "application/json; charset=utf-8", "Sec-Fetch-Site": "same-origin"}
        if origin is not None:
            headers["Origin"] = origin
        assert post(proxy.conn(), "/chat/completions", CHAT, headers)[0].status == 200, origin
    assert len(upstream.requests) == 3 and len(calls(proxy.ledger)) == 3


def test_a_body_over_the_cap_is_413_without_reading_it(start, upstream):
    proxy = start(upstream.base_url)
    conn = proxy.conn()
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(64 * 1024 * 1024))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and response.getheader("Connection") == "close"
    assert upstream.requests == [] and calls(proxy.ledger) == []


def _held_body(proxy, length):
    """A request whose body is admitted (its 100 Continue came back) and never sent."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_GUARD_S)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                 b"application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % length)
    assert sock.recv(100).startswith(b"HTTP/1.1 100 ")
    return sock


def test_past_the_body_budget_the_answer_is_503_with_retry_after_before_the_body_is_read(start,
                                                                                        upstream):
    proxy = start(upstream.base_url, "--max-body-bytes", "4096", "--max-body-bytes-in-flight", "8192")
    held = [_held_body(proxy, 4096) for _ in range(2)]  # the whole budget
    conn = proxy.conn()
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", "100")
    conn.endheaders()  # the head only: the answer comes without the body
    response = conn.getresponse()
    assert response.status == 503 and response.getheader("Retry-After") == "1"
    assert json.loads(response.read())["error"]["code"] == "busy"
    assert upstream.requests == [] and calls(proxy.ledger) == []
    body = json.dumps(CHAT).encode().ljust(4096)
    held[0].sendall(body)  # a held body that comes in is served, and gives its bytes back
    answer = http.client.HTTPResponse(held[0])  # the whole answer: its last byte follows the line
    answer.begin()
    assert answer.status == 200 and answer.read()
    assert post(proxy.conn(), "/chat/completions", CHAT)[0].status == 200
    assert post(proxy.conn(), "/chat/completions", b"x" * 4097)[0].status == 413
    held[1].close()
    assert len(upstream.requests) == 2 and upstream.requests[0]["raw"] == body


def test_a_body_goes_upstream_as_it_came_unless_the_proxy_must_change_it(start, upstream):
    raw = ('{"model":"up-model",  "messages":[{"role":"user","content":"caf\u00e9 é"}],'
           '"temperature":1.0E0}').encode()
    proxy = start(upstream.base_url)
    assert post(proxy.conn(), "/chat/completions", raw)[0].status == 200
    streamed = raw[:-1] + b',"stream":true}'  # the proxy asks for the usage chunk: re-encoded
    assert post(proxy.conn(), "/chat/completions", streamed)[0].status == 200
    pinned = start(upstream.base_url, MODEL_ID="up-model")  # the model checked is the model sent
    assert post(pinned.conn(), "/chat/completions", raw)[0].status == 200
    sent = [r["raw"] for r in upstream.requests]
    assert sent[0] == raw and sent[1] != streamed and sent[2] != raw
    assert [r["body"] for r in upstream.requests] == [
        json.loads(raw), dict(json.loads(streamed), stream_options={"include_usage": True}),
        json.loads(raw)]



def test_a_body_with_a_key_given_twice_goes_upstream_as_the_record_reads_it(start, upstream):
    """Parsers disagree on a repeated key (first or last wins): the proxy never forwards such bytes."""
    raw = (b'{"model":"up-model","messages":[{"role":"user","content":"hi","role":"system"}],'
           b'"model":"other-model"}')
    proxy = start(upstream.base_url)
    assert post(proxy.conn(), "/chat/completions", raw)[0].status == 200
    (sent,) = [r["raw"] for r in upstream.requests]
    assert sent != raw and sent.count(b'"model"') == 1 and b'"role":' in sent
    assert json.loads(sent)["model"] == calls(proxy.ledger)[0]["request_model"] == "other-model"

MAX_BODY, BODIES_IN_FLIGHT = 4 * 1024 * 1024, 4
RSS_BOUND = 48 * 1024 * 1024 + 16 * MAX_BODY * BODIES_IN_FLIGHT  # docs/proxy.md's bound


def _peak_rss(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no VmHWM in /proc")


def test_peak_memory_is_bounded_by_the_body_budget(start, upstream, capsys):
    """The documented maximum of concurrent maximum-size bodies of tiny messages, and as many
    again: those past the budget are 503s, and the peak RSS stays under docs/proxy.md's bound."""
    proxy = start(upstream.base_url, "--max-body-bytes", MAX_BODY, "--max-body-bytes-in-flight",
                  MAX_BODY * BODIES_IN_FLIGHT)
    message = b'{"role":"user","content":"a"},'
    head = b'{"model":"up-model","messages":['
    body = head + message * ((MAX_BODY - len(head) - 60) // len(message)) + message[:-1] + b"]}"
    assert len(body) <= MAX_BODY
    before, statuses = _peak_rss(proxy.proc.pid), []
    barrier = threading.Barrier(BODIES_IN_FLIGHT * 2)

    def client():
        conn = proxy.conn(timeout=HANG_GUARD_S)
        barrier.wait(HANG_GUARD_S)
        try:
            statuses.append(post(conn, "/chat/completions", body)[0].status)
        except OSError:  # refused unread: the proxy's 503 and close can cut the sending short
            statuses.append(503)
    threads = [threading.Thread(target=client) for _ in range(BODIES_IN_FLIGHT * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    peak = _peak_rss(proxy.proc.pid)
    with capsys.disabled():
        print(f"\nproxy peak RSS {peak / 2**20:.0f} MiB (start {before / 2**20:.0f} MiB, bound "
              f"{RSS_BOUND / 2**20:.0f} MiB), statuses {sorted(statuses)}")
    assert len(statuses) == len(threads) and set(statuses) <= {200, 503}
    assert statuses.count(200) >= BODIES_IN_FLIGHT
    assert len(upstream.requests) == statuses.count(200) and peak < RSS_BOUND


@pytest.mark.parametrize("how", ["stalled head", "stalled body", "trickled head"])
def test_a_slow_client_is_cut_at_the_read_deadline_and_holds_no_one_else(start, upstream, how):
    proxy = start(upstream.base_url, "--read-timeout", "1")
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
    stop = threading.Event()
    if how == "stalled head":
        sock.sendall(head)
    elif how == "stalled body":
        sock.sendall(head + b"\r\n" + b"{" * 10)
    else:  # one byte at a time: every read arrives in time, the whole request never does
        def trickle():
            for byte in head * 1000:
                if stop.wait(0.05):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
        threading.Thread(target=trickle, daemon=True).start()
    assert post(proxy.conn(), "/chat/completions", CHAT)[0].status == 200  # meanwhile, others are served
    assert _closed_by_peer(sock)
    stop.set()
    assert len(calls(proxy.ledger)) == 1


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(start, upstream):
    proxy = start(upstream.base_url, "--idle-timeout", "1")
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    body = json.dumps(CHAT).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    assert _closed_by_peer(sock)  # the answer, then the close


def test_a_long_stream_is_not_cut_by_the_read_deadline(start, upstream):
    upstream.queue("gated")
    proxy = start(upstream.base_url, "--read-timeout", "1")
    conn = proxy.conn()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(CHAT, stream=True)), headers=JSON)
    response = conn.getresponse()
    assert b"The an" in response.readline()
    time.sleep(2.5)  # past the read deadline: it was cancelled once the body was in, so nothing is cut
    upstream.gate.set()
    assert response.read().endswith(b"data: [DONE]\n\n")
    assert calls(proxy.ledger)[0]["error_type"] is None


def test_past_max_connections_the_answer_is_503_with_retry_after(start, upstream):
    proxy = start(upstream.base_url, "--max-connections", "2")
    held = [proxy.conn() for _ in range(2)]
    for conn in held:  # each one is being handled (idle between requests) by the time it answers
        assert post(conn, "/chat/completions", CHAT)[0].status == 200
    extra = proxy.conn()
    extra.request("GET", "/v1/models")
    response = extra.getresponse()
    assert response.status == 503 and response.getheader("Retry-After") == "1"
    assert json.loads(response.read())["error"]["code"] == "busy"
    held[0].close()
    for _ in range(HANG_GUARD_S * 10):  # the slot frees when the proxy sees the close
        retry = proxy.conn()
        retry.request("GET", "/v1/models")
        if retry.getresponse().status == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the slot never freed")


# ----------------------------------------------------------------------------
# Shutdown
# ----------------------------------------------------------------------------

def test_sigterm_closes_idle_connections_finishes_those_in_flight_and_exits_0(start, upstream):
    upstream.queue("gated")
    proxy = start(upstream.base_url, "--grace", str(HANG_GUARD_S))
    idle = socket.create_connection(("127.0.0.1", proxy.port))
    body = json.dumps(CHAT).encode()
    idle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    answer, idle_chunk = b"", b"-"
    while b"The answer is 4." not in answer and idle_chunk:  # a closed connection ends the loop
        idle_chunk = idle.recv(65536)
        answer += idle_chunk
    assert b"The answer is 4." in answer, answer
    busy = proxy.conn()
    busy.request("POST", "/v1/chat/completions", body=json.dumps(dict(CHAT, stream=True)), headers=JSON)
    response = busy.getresponse()
    assert b"The an" in response.readline()
    proxy.proc.send_signal(signal.SIGTERM)
    assert _closed_by_peer(idle)  # at once, while the stream is still held by the gate
    assert not upstream.gate.is_set() and proxy.proc.poll() is None
    upstream.gate.set()
    assert response.read().endswith(b"data: [DONE]\n\n")
    code, out, err = proxy.stop(sig=None)
    assert code == 0 and err == "" and out == ""
    assert [c["error_type"] for c in calls(proxy.ledger)] == [None, None]
    assert run_script("reasoning_ledger.py", "verify", proxy.ledger).returncode == 0


def test_kill_9_under_load_leaves_a_ledger_that_verifies(start, upstream):
    proxy = start(upstream.base_url)
    stop = threading.Event()

    def client():
        conn = proxy.conn(timeout=HANG_GUARD_S)
        while not stop.is_set():
            try:
                post(conn, "/chat/completions", dict(CHAT, stream=True))
            except Exception:  # the proxy is killed under us: http.client raises what it raises
                return
    threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    for _ in range(HANG_GUARD_S * 20):
        if proxy.ledger.exists() and len(proxy.ledger.read_bytes().splitlines()) >= 30:
            break
        time.sleep(0.05)
    proxy.proc.kill()
    proxy.proc.wait(HANG_GUARD_S)
    stop.set()
    for t in threads:
        t.join(HANG_GUARD_S)
    recorded = proxy.ledger.read_bytes()
    # kill -9 can cut a write short (at a page boundary, say): a torn tail, which the next writer sets aside
    whole = recorded[:recorded.rfind(b"\n") + 1]
    assert len(whole.splitlines()) >= 30
    again = start(upstream.base_url)  # the next start on the same ledger, as after a crash
    post(again.conn(timeout=HANG_GUARD_S), "/chat/completions", CHAT)
    assert again.stop()[0] == 0
    assert proxy.ledger.read_bytes().startswith(whole)  # nothing whole was lost or rewritten
    verified = run_script("reasoning_ledger.py", "verify", proxy.ledger)
    assert verified.returncode == 0, verified.out + verified.err


def _wait_until_refused(port):
    for _ in range(HANG_GUARD_S * 20):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except (ConnectionRefusedError, ConnectionResetError):
            return  # refused, or queued in the backlog when the listener closed: it stopped
        time.sleep(0.05)
    pytest.fail("the proxy kept accepting")


def test_after_sigterm_a_request_already_sent_behind_one_in_flight_gets_503(start, upstream):
    upstream.queue("gated")
    proxy = start(upstream.base_url, "--grace", str(HANG_GUARD_S))
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    streamed, plain = json.dumps(dict(CHAT, stream=True)).encode(), json.dumps(CHAT).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    sock.sendall(head % len(streamed) + streamed)
    assert upstream.first_sent.wait(HANG_GUARD_S)
    sock.sendall(head % len(plain) + plain)  # pipelined behind the stream in flight
    proxy.proc.send_signal(signal.SIGTERM)
    _wait_until_refused(proxy.port)  # the proxy has taken the signal: it stopped accepting
    sock.settimeout(HANG_GUARD_S)
    received = b""
    upstream.gate.set()
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    assert b"data: [DONE]" in received and b"HTTP/1.1 503 " in received.split(b"data: [DONE]")[1]
    assert proxy.stop(sig=None)[0] == 0  # signalled once only: a second SIGTERM could meet the exiting interpreter
    assert len(calls(proxy.ledger)) == 1 and len(upstream.requests) == 1
    refused = calls(proxy.ledger, "proxy_refused")  # the 503 is a refusal of a client: recorded
    assert [(line["status"], line["reason"]) for line in refused] == [(503, "unavailable")]
