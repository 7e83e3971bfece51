"""`proxy.py`'s keep-alive pool of upstream connections (issue 29): against a raw-socket HTTP/1.1
upstream that counts its TCP accepts and TLS handshakes and acts out the awkward and hostile things an
upstream does to a kept connection. Every wait ends on an event; HANG_GUARD_S only bounds a hang.

The TLS test makes a self-signed certificate with the `openssl` CLI; without it the test skips, and
fails when TLS_REQUIRED=1 or CLIENTS_REQUIRED=1 (CI)."""

import json
import socket
import threading

import pytest

from conftest import KEY, all_bytes_under, tls_certificate
from fake_upstream import _answer, _chat_chunks
from proxy_helpers import Proxy, post
from test_proxy import CHAT, calls

HANG_GUARD_S = 60
STREAM = dict(CHAT, stream=True)
STRAY = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"


class KeepAlive:
    """An HTTP/1.1 upstream on 127.0.0.1 (TLS with `tls`, a server SSLContext) that keeps each
    connection open and answers its requests in turn, each as the next queued scenario says (then
    "ok"). `requests` holds (connection number, body) of every request read whole; `accepts`,
    `handshakes`, `reused` (session_reused of each handshake) and `open` (connections not yet closed)
    count under `cond`. Scenarios:
      ok          the chat answer, Content-Length; a stream (chunked, [DONE] and the last chunk at once)
      close       the answer, then the connection closed
      hangup      the request read, the connection closed without a byte of answer
      stray       the answer and a second, unasked answer in the same write
      stray_later the answer; once `go` is set, an unasked answer, then `sent` is set
      conn_close  the answer with `Connection: close`, the connection left open
      http10      an HTTP/1.0 answer with Content-Length, the connection left open
      held        a stream's head and first event, `first_sent` set, then nothing until the proxy closes
      barrier     waits until `barrier` (a threading.Barrier) is full, then the answer
      trickle     a head announcing 1000 bytes, then a byte every 50 ms until the proxy closes
      long_tail   a stream whose last event is followed by 100 KiB more before its last chunk
      interim     a 103 Early Hints, then the answer as "ok" gives it
      no_end      a stream's events to [DONE] without its last chunk, then nothing until the proxy closes"""

    def __init__(self, tls=None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.tls, self.scenarios, self.requests = tls, [], []
        self.accepts = self.handshakes = self.open = 0
        self.reused, self.socks, self.cond = [], [], threading.Condition()
        self.go, self.sent, self.first_sent, self.closed = (threading.Event() for _ in range(4))
        self.barrier = None
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self):
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.listener.getsockname()[1]}/v1"

    def queue(self, *names):
        with self.cond:
            self.scenarios += names

    def wait_for(self, predicate):
        with self.cond:
            assert self.cond.wait_for(predicate, HANG_GUARD_S), "hang guard"

    def stop(self):
        self.go.set()
        self.listener.close()
        with self.cond:
            for sock in self.socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.cond:
                self.accepts += 1
                self.open += 1
                self.socks.append(sock)
                number = self.accepts
            threading.Thread(target=self._serve, args=(sock, number), daemon=True).start()

    def _serve(self, sock, number):
        reader = None
        try:
            if self.tls:
                sock = self.tls.wrap_socket(sock, server_side=True)
                with self.cond:
                    self.handshakes += 1
                    self.reused.append(sock.session_reused)
            reader = sock.makefile("rb")
            while self._one(sock, reader, number):
                pass
        except (OSError, ValueError):
            pass
        finally:
            if reader is not None:
                reader.close()
            sock.close()  # on loopback, the proxy's socket is readable once this returns
            with self.cond:
                self.open -= 1
                self.cond.notify_all()

    def _one(self, sock, reader, number):
        line = reader.readline()
        if not line:
            return False
        headers = {}
        for raw in iter(reader.readline, b"\r\n"):
            if not raw:
                return False
            name, _, value = raw.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = json.loads(reader.read(int(headers.get("content-length", 0))) or b"null")
        with self.cond:
            name = self.scenarios.pop(0) if self.scenarios else "ok"
            self.requests.append((number, body))
            self.cond.notify_all()
        if name == "hangup":
            return False
        if name == "barrier":
            self.barrier.wait(HANG_GUARD_S)
        if body.get("stream"):
            events = _chat_chunks(body["model"], "ok", True)
            if name == "held":
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(events[0]), events[0]))
                self.first_sent.set()
                while sock.recv(1):  # the proxy sends nothing more: its close ends this
                    pass
                self.closed.set()
                return False
            events += [b": more\n\n" * 1000] * 10 if name == "long_tail" else []
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n" + chunks + (b"" if name == "no_end" else b"0\r\n\r\n"))
            while name == "no_end" and sock.recv(1):
                pass
            return name != "no_end"
        if name == "interim":  # 103 Early Hints before the answer, as a CDN may send
            sock.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
        if name == "trickle":
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            while not self.closed.wait(0.05):  # each byte well inside the read timeout: only a deadline ends it
                sock.sendall(b" ")
            return False
        data = json.dumps(_answer("/chat/completions", body["model"], {"name": "ok"})).encode()
        head = b"HTTP/1.0 200 OK\r\n" if name == "http10" else b"HTTP/1.1 200 OK\r\n"
        if name == "conn_close":
            head += b"Connection: close\r\n"
        answer = head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
        sock.sendall(answer + (STRAY if name == "stray" else b""))
        if name == "stray_later":
            self.go.wait(HANG_GUARD_S)
            sock.sendall(STRAY)
            self.sent.set()
        return name != "close"


@pytest.fixture
def run(tmp_path):
    started = []

    def go(upstream, *args, **env):
        started.append(upstream)
        proxy = Proxy(upstream.base_url, tmp_path / "calls.jsonl", *args, **env)
        started.append(proxy)
        return proxy
    yield go
    for one in reversed(started):
        one.stop()
    assert KEY.encode() not in all_bytes_under(tmp_path)  # the upstream key never reaches disk


def _ok(conn, body=CHAT):
    response, raw = post(conn, "/chat/completions", body)
    assert response.status == 200, raw
    assert b"stray" not in raw and (b"[DONE]" in raw if body.get("stream") else json.loads(raw)["choices"])
    return raw


def _numbers(upstream):
    return [number for number, _body in upstream.requests]


def test_sequential_calls_plain_and_streamed_share_one_connection(run):
    upstream = KeepAlive()
    proxy = run(upstream)
    client = proxy.conn()
    for body in (CHAT, STREAM, CHAT, STREAM, STREAM, CHAT):
        _ok(client, body)
    assert upstream.accepts == 1 and _numbers(upstream) == [1] * 6
    assert [line["error_type"] for line in calls(proxy.ledger)] == [None] * 6


@pytest.mark.parametrize("scenario", ["close", "stray", "conn_close", "http10"])
def test_a_connection_the_upstream_ended_or_spoiled_is_not_used_again(run, scenario):
    upstream = KeepAlive()
    upstream.queue(scenario)
    proxy = run(upstream)
    client = proxy.conn()
    _ok(client)
    if scenario == "close":
        upstream.wait_for(lambda: upstream.open == 0)
    _ok(client)  # on a fresh connection, sent once
    _ok(client)  # which is kept
    assert _numbers(upstream) == [1, 2, 2]
    assert [line["error_type"] for line in calls(proxy.ledger)] == [None] * 3


@pytest.mark.parametrize("scenario", ["long_tail", "no_end"])
def test_a_stream_not_read_to_its_end_gives_up_its_connection(run, scenario):
    upstream = KeepAlive()
    upstream.queue(scenario)
    proxy = run(upstream)
    client = proxy.conn()
    _ok(client, STREAM)  # whole for the client: its last event came
    _ok(client, STREAM)
    _ok(client, STREAM)
    assert _numbers(upstream) == [1, 2, 2]
    assert [line["error_type"] for line in calls(proxy.ledger)] == [None] * 3


def test_stray_bytes_on_an_idle_connection_close_it(run):
    upstream = KeepAlive()
    upstream.queue("stray_later")
    proxy = run(upstream)
    client = proxy.conn()
    _ok(client)
    upstream.go.set()
    assert upstream.sent.wait(HANG_GUARD_S)  # loopback: the bytes are at the proxy's socket
    _ok(client)  # the answer is not the stray bytes
    assert _numbers(upstream) == [1, 2] and len(calls(proxy.ledger)) == 2


def test_a_request_the_upstream_dropped_on_a_kept_connection_is_never_sent_again(run):
    upstream = KeepAlive()
    upstream.queue("ok", "hangup")
    proxy = run(upstream)
    client = proxy.conn()
    _ok(client)
    response, raw = post(client, "/chat/completions", CHAT)
    assert response.status == 502 and json.loads(raw)["error"]["code"] == "connection_error"
    assert _numbers(upstream) == [1, 1]  # the request may have reached the model: never resent
    _ok(proxy.conn())
    assert _numbers(upstream) == [1, 1, 2]
    lines = calls(proxy.ledger)
    assert [line["error_type"] for line in lines] == [None, "connection_error", None]
    assert lines[1]["http_status"] is None and lines[1]["error_message"]


def test_a_stream_the_client_abandoned_gives_up_its_connection(run):
    upstream = KeepAlive()
    upstream.queue("ok", "held")
    proxy = run(upstream)
    _ok(proxy.conn(), STREAM)
    client = socket.create_connection(("127.0.0.1", proxy.port))
    data = json.dumps(STREAM).encode()
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    assert upstream.first_sent.wait(HANG_GUARD_S)
    client.close()
    assert upstream.closed.wait(HANG_GUARD_S)  # the proxy cut the upstream request
    _ok(proxy.conn())
    assert _numbers(upstream) == [1, 1, 2]
    upstream.wait_for(lambda: upstream.open == 1)  # the cut one closed, the fresh one kept
    assert [line["error_type"] for line in calls(proxy.ledger)] == [None, "client_gone", None]


def test_concurrent_calls_leave_at_most_the_bound_idle(run):
    upstream, clients = KeepAlive(), 6
    upstream.barrier = threading.Barrier(clients)
    upstream.queue(*["barrier"] * clients)
    proxy = run(upstream, "--upstream-idle", "2")
    results = []

    def one():
        response, raw = post(proxy.conn(), "/chat/completions", CHAT)
        results.append(response.status)
    threads = [threading.Thread(target=one) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert results == [200] * clients and upstream.accepts == clients  # all at once: one each
    upstream.wait_for(lambda: upstream.open <= 2)
    _ok(proxy.conn())
    _ok(proxy.conn())
    assert upstream.accepts == clients and upstream.open == 2  # the two kept were used
    assert len(calls(proxy.ledger)) == clients + 2


def test_an_environment_proxy_keeps_the_plain_path(run):
    upstream = KeepAlive()  # here, the HTTP proxy: it answers the absolute URL it is sent
    proxy = run(_Named(upstream, "http://upstream.invalid/v1"), HTTP_PROXY=upstream.base_url.rsplit("/", 1)[0])
    client = proxy.conn()
    _ok(client)
    _ok(client)
    assert upstream.accepts == 2  # urllib's path: a connection per call, through the proxy


class _Named:
    """An upstream reached by another base URL (through an HTTP proxy)."""

    def __init__(self, upstream, base_url):
        self.upstream, self.base_url = upstream, base_url

    def stop(self):
        self.upstream.stop()


def test_tls_one_handshake_for_many_calls_and_the_session_resumed(run, tmp_path):
    cert, server = tls_certificate(tmp_path)
    upstream = KeepAlive(tls=server)
    proxy = run(upstream, SSL_CERT_FILE=cert)
    client = proxy.conn()
    for body in (CHAT, STREAM) * 4:
        _ok(client, body)
    assert upstream.accepts == upstream.handshakes == 1 and len(upstream.requests) == 8
    upstream.queue("close")
    _ok(client)
    upstream.wait_for(lambda: upstream.open == 0)
    _ok(client)  # a new connection, its TLS session the first one's
    assert upstream.handshakes == 2 and upstream.reused == [False, True]
    assert [line["error_type"] for line in calls(proxy.ledger)] == [None] * 10


def test_tls_the_deadline_cuts_a_kept_connection(run, tmp_path):
    cert, server = tls_certificate(tmp_path)
    upstream = KeepAlive(tls=server)
    upstream.queue("ok", "trickle")
    proxy = run(upstream, "--timeout", "2", SSL_CERT_FILE=cert)
    client = proxy.conn()
    _ok(client)
    response, raw = post(client, "/chat/completions", CHAT)  # ends at the deadline, not the body's end
    upstream.closed.set()
    assert response.status == 502 and json.loads(raw)["error"]["code"] == "timeout"
    _ok(proxy.conn())
    assert _numbers(upstream) == [1, 1, 2]
    assert [line["error_type"] for line in calls(proxy.ledger)] == [None, "timeout", None]


def test_tls_an_untrusted_certificate_is_refused(run, tmp_path):
    _cert, server = tls_certificate(tmp_path)
    proxy = run(KeepAlive(tls=server))  # SSL_CERT_FILE not set: the system's roots only
    response, raw = post(proxy.conn(), "/chat/completions", CHAT)
    assert response.status == 502 and json.loads(raw)["error"]["code"] == "tls_error"


def test_an_interim_answer_is_skipped_and_the_connection_kept(run):
    upstream = KeepAlive()
    upstream.queue("interim", "interim")
    proxy = run(upstream)
    client = proxy.conn()
    for body in (CHAT, STREAM):
        _ok(client, body)
    assert upstream.accepts == 1 and len(upstream.requests) == 2
    lines = calls(proxy.ledger)
    assert [(line["error_type"], line["http_status"]) for line in lines] == [(None, 200)] * 2
