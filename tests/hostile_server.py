#!/usr/bin/env python3
"""hostile_server.py -- a scripted hostile or broken OpenAI-compatible endpoint for tests.

It speaks HTTP on a raw socket (socket + threading, not http.server), so it can send bytes that no
well-behaved server would: lying Content-Length, a garbage status line, a 200 KB header, a body that
never ends, an RST. Stdlib only, Python 3.9 or newer.

Usage:
  python tests/hostile_server.py SCENARIO [PORT]       # that scenario for every connection, until Ctrl-C
  python tests/hostile_server.py '{"name": "trickle", "interval": 0.05}' 8000
  python tests/hostile_server.py --list                 # the scenarios and their parameters

  from hostile_server import HostileServer
  srv = HostileServer().start()          # 127.0.0.1, port 0, a daemon thread, one thread per connection
  srv.base_url                           # "http://127.0.0.1:PORT/v1"
  srv.queue("short_body", {"name": "trickle", "interval": 0.1})   # the next connections, in order
  srv.requests                           # [{"method", "path", "headers": {lower-name: value}, "body": bytes}]
  srv.stop()                             # never hangs, even with a client still connected

Each connection: the request is read in full (request line, headers, Content-Length or chunked body)
and recorded, the next queued scenario (or "ok" once the queue is empty) is acted out, and the
connection is closed. A connection that closes before sending a whole request is neither recorded
nor given a scenario. Every scenario ends by itself: all waits are bounded and stop() cuts them short.
The server looks only at the request, never at anything else.

Scenarios that send a head accept a `headers` parameter: a dict or a list of (name, value) pairs
(str or bytes), sent verbatim after the status line. A name given there replaces the default header
of that name (case-insensitive), so a test can lie about Content-Length or send it twice.
"""

import json
import socket
import struct
import sys
import threading
import time
from http import HTTPStatus

__version__ = "1.0.0"

# -- constants ----------------------------------------------------------------------------------

HOST = "127.0.0.1"
ANSWER = "The answer is 4."
DEFAULT_MODEL = "hostile-model"
USAGE = {"prompt_tokens": 21, "completion_tokens": 6, "total_tokens": 27}
MODELS = ["hostile-model", "hostile-model-large"]

ACCEPT_POLL_S = 0.1            # how often the accept loop looks at the stop flag
REQUEST_TIMEOUT_S = 30.0       # a client silent this long while sending its request is dropped
SEND_TIMEOUT_S = 30.0          # a client that reads nothing for this long is dropped
DRAIN_S = 0.5                  # after our FIN, how long unread client bytes are drained before close()
JOIN_TIMEOUT_S = 2.0           # stop(): how long to wait for each thread after its socket is shut down
MAX_REQUEST_HEAD = 1 << 20     # bytes of request line + headers accepted
MAX_REQUEST_BODY = 64 << 20    # bytes of request body accepted
CHUNK = 1 << 16                # bytes per send() for the huge scenarios

DEFAULT_LOCATION = "http://127.0.0.1:9/v1/chat/completions"
HUGE_SIZE = 200_000_000

# name -> (parameters, one line). "headers" is accepted wherever a head is sent.
SCENARIOS = {
    "ok": (("headers",), "valid completion (SSE if the body asks stream: true); GET .../models lists models"),
    "redirect": (("status", "location", "headers"), "3xx (default 302) to `location`, small body"),
    "interim": (("status", "headers"), "an interim answer (default 103 Early Hints), then the valid completion"),
    "short_body": (("content_length", "sent", "headers"),
                   "Content-Length: 500 (content_length) but only 100 (sent) bytes of JSON, then close"),
    "garbage_status": (("line",), "a first line that is not a status line (default HELLO WORLD), then close"),
    "empty_reply": ((), "close without sending a byte"),
    "long_header": (("size", "headers"), "200 with one header line of `size` bytes (default 200 KB)"),
    "many_headers": (("count", "headers"), "200 with `count` extra headers (default 150)"),
    "trickle": (("interval", "total_seconds", "headers"),
                "the ok response one byte every `interval` s (0.2) until sent or `total_seconds` (10)"),
    "sse_keepalive": (("interval", "total_seconds", "headers"),
                      "200 event-stream of ': keep-alive' comments every `interval` s (0.5) for `total_seconds` (10)"),
    "huge_body": (("size", "headers"), "200 JSON body of `size` bytes (200 MB), Content-Length set, streamed"),
    "huge_chunked": (("size", "headers"), "the same with Transfer-Encoding: chunked, no Content-Length"),
    "huge_sse_line": (("size", "headers"), "200 event-stream whose single data: line is `size` bytes, no newline"),
    "json": (("body", "status", "headers"), "`body` (str/bytes verbatim, or dict/list) with `status` (200)"),
    "sse": (("events", "cut", "status", "interval", "headers"),
            "200 event-stream of `events` written verbatim; cut=True drops the last event's final newlines"),
    "raw": (("data",), "exactly `data` (bytes), then close"),
    "hang": (("seconds",), "read the request, send nothing, hold the connection `seconds` (10)"),
    "reset": ((), "close with SO_LINGER 0 (an RST) right after the request"),
}


# -- helpers ------------------------------------------------------------------------------------

def _bytes(value):
    """str -> UTF-8 (a lone surrogate is sent as its raw, invalid bytes); bytes stay as they are."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return str(value).encode("utf-8", "surrogatepass")


def _reason(status):
    try:
        return HTTPStatus(int(status)).phrase
    except ValueError:
        return "Hostile"


def _header_pairs(headers):
    if not headers:
        return []
    items = headers.items() if isinstance(headers, dict) else headers
    return [(_bytes(name), _bytes(value)) for name, value in items]


def _head(status, defaults, extra=None):
    """Status line and headers as bytes. Names in `extra` replace the defaults of that name."""
    extra = _header_pairs(extra)
    replaced = {name.lower() for name, _ in extra}
    pairs = [pair for pair in _header_pairs(defaults) if pair[0].lower() not in replaced] + extra
    lines = [b"HTTP/1.1 %d %s" % (int(status), _bytes(_reason(status)))]
    lines += [name + b": " + value for name, value in pairs]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _response(status, body, content_type="application/json", extra=None):
    body = _bytes(body)
    defaults = [("Content-Type", content_type), ("Content-Length", str(len(body))), ("Connection", "close")]
    return _head(status, defaults, extra) + body


def _sse_head(status=200, extra=None):
    return _head(status, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                          ("Connection", "close")], extra)


def _json(obj):
    return json.dumps(obj).encode("utf-8")


def _request_json(request):
    try:
        body = json.loads(request["body"].decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _model_of(request):
    body = _request_json(request) or {}
    return body.get("model", DEFAULT_MODEL)


def _completion(model):
    return {"id": "chatcmpl-hostile", "object": "chat.completion", "created": 1764400000, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER},
                         "finish_reason": "stop"}],
            "usage": USAGE}


def _stream_events(model):
    base = {"id": "chatcmpl-hostile", "object": "chat.completion.chunk", "created": 1764400000, "model": model}
    chunks = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None}])]
    for i in range(0, len(ANSWER), 5):
        chunks.append(dict(base, choices=[{"index": 0, "delta": {"content": ANSWER[i:i + 5]},
                                           "finish_reason": None}]))
    chunks.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    chunks.append(dict(base, choices=[], usage=USAGE))
    return [b"data: " + _json(chunk) + b"\n\n" for chunk in chunks] + [b"data: [DONE]\n\n"]


def _ok_bytes(request, extra=None):
    """The whole response the `ok` scenario gives this request."""
    path = request["path"].split("?", 1)[0].rstrip("/")
    if request["method"] == "GET" and path.endswith("/models"):
        data = [{"id": m, "object": "model", "created": 1764400000, "owned_by": "hostile"} for m in MODELS]
        return _response(200, _json({"object": "list", "data": data}), extra=extra)
    if request["method"] != "POST" or not path.endswith("/chat/completions"):
        return _response(404, _json({"error": {"message": "no route %s %s" % (request["method"], request["path"]),
                                               "type": "invalid_request_error", "code": None}}), extra=extra)
    body = _request_json(request)
    if body is None:
        return _response(400, _json({"error": {"message": "the request body is not a JSON object",
                                               "type": "invalid_request_error", "code": None}}), extra=extra)
    model = body.get("model", DEFAULT_MODEL)
    if body.get("stream") is True:
        return _sse_head(200, extra) + b"".join(_stream_events(model))
    return _response(200, _json(_completion(model)), extra=extra)


def _filler(size, prefix, suffix):
    """`size` bytes: prefix, then x's, then suffix, made CHUNK by CHUNK (never all in memory)."""
    if size < len(prefix) + len(suffix):
        prefix, suffix = b"", b""
    yield prefix
    block = b"x" * CHUNK
    left = size - len(prefix) - len(suffix)
    while left > 0:
        piece = block if left >= CHUNK else block[:left]
        left -= len(piece)
        yield piece
    yield suffix


def _huge_json(size, model):
    prefix = (b'{"id":"chatcmpl-huge","object":"chat.completion","model":' + _json(model)
              + b',"choices":[{"index":0,"message":{"role":"assistant","content":"')
    return _filler(size, prefix, b'"},"finish_reason":"stop"}]}')


def _parse_head(head):
    """Request line and headers -> (method, target, {lower-name: value}); duplicate names are joined."""
    text = head.decode("latin-1").lstrip("\r\n")
    lines = text.replace("\r\n", "\n").split("\n")
    parts = lines[0].split()
    if len(parts) < 2:
        return None
    headers = {}
    for line in lines[1:]:
        if ":" not in line:
            continue
        name, value = line.split(":", 1)
        name, value = name.strip().lower(), value.strip()
        headers[name] = headers[name] + ", " + value if name in headers else value
    return parts[0], parts[1], headers


class _Reader:
    """Buffered reads from a socket; None from any read means the client went away."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def _fill(self):
        try:
            data = self.sock.recv(CHUNK)
        except OSError:
            return False
        self.buf += data
        return bool(data)

    def until(self, marks, limit):
        while True:
            found = [(self.buf.find(m), m) for m in marks if m in self.buf]
            if found:
                at, mark = min(found)
                out, self.buf = self.buf[:at], self.buf[at + len(mark):]
                return out
            if len(self.buf) > limit or not self._fill():
                return None

    def exactly(self, n):
        while len(self.buf) < n:
            if not self._fill():
                return None
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def _read_request(sock):
    """One whole request as the dict that goes into `requests`, or None if the client gave up."""
    reader = _Reader(sock)
    head = reader.until((b"\r\n\r\n", b"\n\n"), MAX_REQUEST_HEAD)
    while head is not None and not head.strip():   # stray CRLFs before a request line are allowed
        head = reader.until((b"\r\n\r\n", b"\n\n"), MAX_REQUEST_HEAD)
    parsed = _parse_head(head) if head is not None else None
    if parsed is None:
        return None
    method, target, headers = parsed
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = b""
        while True:
            size_line = reader.until((b"\r\n", b"\n"), 1024)
            try:
                size = int(size_line.split(b";")[0].strip(), 16) if size_line is not None else -1
            except ValueError:
                return None
            if size < 0 or len(body) + size > MAX_REQUEST_BODY:
                return None
            if size == 0:
                while reader.until((b"\r\n", b"\n"), MAX_REQUEST_HEAD):   # trailers, up to the blank line
                    pass
                break
            chunk = reader.exactly(size)
            if chunk is None or reader.until((b"\r\n", b"\n"), 2) is None:
                return None
            body += chunk
    else:
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            return None
        if length < 0 or length > MAX_REQUEST_BODY:
            return None
        body = reader.exactly(length)
        if body is None:
            return None
    return {"method": method, "path": target, "headers": headers, "body": body}


def _normalise(scenario):
    """A name or a dict -> a checked dict with "name"; unknown names and parameters are ValueError."""
    name = scenario.get("name") if isinstance(scenario, dict) else scenario
    if not isinstance(name, str) or name not in SCENARIOS:
        raise ValueError("unknown scenario %r (known: %s)" % (name, ", ".join(SCENARIOS)))
    if isinstance(scenario, str):
        scenario = {"name": scenario}
    allowed = SCENARIOS[scenario["name"]][0]
    unknown = sorted(set(scenario) - set(allowed) - {"name"})
    if unknown:
        raise ValueError("scenario %r takes %s, not %s" % (scenario["name"], ", ".join(allowed) or "no parameters",
                                                           ", ".join(unknown)))
    return dict(scenario)


# -- the server ---------------------------------------------------------------------------------

class HostileServer:
    """A raw-socket HTTP server that acts out one queued scenario per connection (see the module doc)."""

    def __init__(self, host=HOST, port=0, default="ok", tls=None):
        self.default, self.tls = _normalise(default), tls  # tls: a server SSLContext
        self.cut = threading.Event()  # a scenario ended early: the client left or reset
        self.requests = []
        self._scenarios = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conns = set()
        self._threads = set()
        self._accept_thread = None
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(64)
            self._listener.settimeout(ACCEPT_POLL_S)
        except OSError:
            self._listener.close()
            raise
        self.host, self.port = self._listener.getsockname()[:2]

    @property
    def base_url(self):
        return "%s://%s:%d/v1" % ("https" if self.tls else "http", self.host, self.port)

    def queue(self, *scenarios):
        """The next connections get these scenarios in order; once the queue is empty, the default ("ok")."""
        checked = [_normalise(s) for s in scenarios]
        with self._lock:
            self._scenarios.extend(checked)
        return self

    def start(self):
        self._accept_thread = threading.Thread(target=self._accept_loop, name="hostile-accept", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self):
        """Stop accepting, cut every open connection short, and wait (bounded) for the threads."""
        self._stopping.set()
        if self._accept_thread is not None:
            try:   # wake accept() now rather than at its next poll
                socket.create_connection((self.host if self.host not in ("", "0.0.0.0") else HOST, self.port),
                                         timeout=ACCEPT_POLL_S).close()
            except OSError:
                pass
            self._accept_thread.join(JOIN_TIMEOUT_S)
        self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:  # the descriptor's shutdown, under TLS too (SSLSocket.shutdown would unwrap)
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- plumbing --------------------------------------------------------------------------------

    def _accept_loop(self):
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if self._stopping.is_set():
                conn.close()
                return
            conn.settimeout(REQUEST_TIMEOUT_S)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            thread = threading.Thread(target=self._serve, args=(conn,), name="hostile-conn", daemon=True)
            with self._lock:
                if self._stopping.is_set():   # stop() has begun: it will not see this connection
                    conn.close()
                    return
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn):
        graceful = True
        try:
            if self.tls:  # the handshake in this connection's thread; stop() shuts the TLS socket
                raw, conn = conn, self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns.discard(raw)
                    self._conns.add(conn)
            request = _read_request(conn)
            if request is None or self._stopping.is_set():
                return
            with self._lock:
                scenario = self._scenarios.pop(0) if self._scenarios else self.default
                self.requests.append(request)
            conn.settimeout(SEND_TIMEOUT_S)
            graceful = getattr(self, "_do_" + scenario["name"])(conn, request, scenario) is not False
        except OSError:   # the client went away, reset us, or stop() shut the socket: all expected
            self.cut.set()
        finally:
            self._close(conn, graceful)
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _close(self, conn, graceful):
        """FIN, then drain what the client still sends (so close() sends no RST), then close."""
        try:
            if graceful:
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(DRAIN_S)
                deadline = time.monotonic() + DRAIN_S
                while time.monotonic() < deadline and conn.recv(CHUNK):
                    pass
        except OSError:
            pass
        finally:
            conn.close()

    def _sleep(self, seconds):
        """A stop()-aware sleep; True if the server is stopping."""
        return self._stopping.wait(max(0.0, float(seconds)))

    def _send_chunks(self, conn, chunks):
        for chunk in chunks:
            if self._stopping.is_set():
                return
            conn.sendall(chunk)

    # -- the scenarios: each gets (conn, request, scenario); returning False means "no FIN, just close"

    def _do_ok(self, conn, request, s):
        conn.sendall(_ok_bytes(request, s.get("headers")))

    def _do_interim(self, conn, request, s):
        status = int(s.get("status", 103))
        conn.sendall(b"HTTP/1.1 %d Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" % status)
        conn.sendall(_ok_bytes(request, s.get("headers")))

    def _do_redirect(self, conn, request, s):
        status = int(s.get("status", 302))
        location = s.get("location", DEFAULT_LOCATION)
        body = _json({"error": {"message": "moved to %s" % location, "type": "redirect", "code": status}})
        conn.sendall(_head(status, [("Location", location), ("Content-Type", "application/json"),
                                    ("Content-Length", str(len(body))), ("Connection", "close")],
                           s.get("headers")) + body)

    def _do_short_body(self, conn, request, s):
        sent = int(s.get("sent", 100))
        body = b"".join(_huge_json(max(sent * 10, 1000), _model_of(request)))[:sent]
        conn.sendall(_head(200, [("Content-Type", "application/json"),
                                 ("Content-Length", str(int(s.get("content_length", 500)))),
                                 ("Connection", "close")], s.get("headers")) + body)

    def _do_garbage_status(self, conn, request, s):
        conn.sendall(_bytes(s.get("line", b"HELLO WORLD\r\n")))

    def _do_empty_reply(self, conn, request, s):
        pass

    def _do_long_header(self, conn, request, s):
        extra = [("X-Hostile-Long", "a" * int(s.get("size", 200_000)))] + _header_pairs(s.get("headers"))
        conn.sendall(_ok_bytes(request, extra))

    def _do_many_headers(self, conn, request, s):
        extra = [("X-Hostile-%d" % i, str(i)) for i in range(int(s.get("count", 150)))]
        conn.sendall(_ok_bytes(request, extra + _header_pairs(s.get("headers"))))

    def _do_trickle(self, conn, request, s):
        data = _ok_bytes(request, s.get("headers"))
        interval = float(s.get("interval", 0.2))
        deadline = time.monotonic() + float(s.get("total_seconds", 10))
        for i in range(len(data)):
            if time.monotonic() >= deadline:
                return
            conn.sendall(data[i:i + 1])
            if i + 1 < len(data) and self._sleep(min(interval, max(0.0, deadline - time.monotonic()))):
                return

    def _do_sse_keepalive(self, conn, request, s):
        conn.sendall(_sse_head(200, s.get("headers")))
        interval = float(s.get("interval", 0.5))
        deadline = time.monotonic() + float(s.get("total_seconds", 10))
        while time.monotonic() < deadline:
            conn.sendall(b": keep-alive\n\n")
            if self._sleep(min(interval, max(0.0, deadline - time.monotonic()))):
                return

    def _do_huge_body(self, conn, request, s):
        size = int(s.get("size", HUGE_SIZE))
        conn.sendall(_head(200, [("Content-Type", "application/json"), ("Content-Length", str(size)),
                                 ("Connection", "close")], s.get("headers")))
        self._send_chunks(conn, _huge_json(size, _model_of(request)))

    def _do_huge_chunked(self, conn, request, s):
        size = int(s.get("size", HUGE_SIZE))
        conn.sendall(_head(200, [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked"),
                                 ("Connection", "close")], s.get("headers")))
        framed = (b"%x\r\n%s\r\n" % (len(piece), piece) for piece in _huge_json(size, _model_of(request)) if piece)
        self._send_chunks(conn, framed)
        if not self._stopping.is_set():
            conn.sendall(b"0\r\n\r\n")

    def _do_huge_sse_line(self, conn, request, s):
        size = int(s.get("size", HUGE_SIZE))
        conn.sendall(_sse_head(200, s.get("headers")))
        prefix = b'data: {"id":"chatcmpl-huge","object":"chat.completion.chunk","model":' + _json(
            _model_of(request)) + b',"choices":[{"index":0,"delta":{"content":"'
        self._send_chunks(conn, _filler(size, prefix, b""))

    def _do_json(self, conn, request, s):
        body = s.get("body")
        if body is None:
            body = _json(_completion(_model_of(request)))
        elif not isinstance(body, (str, bytes, bytearray)):
            body = _json(body)
        conn.sendall(_response(s.get("status", 200), body, extra=s.get("headers")))

    def _do_sse(self, conn, request, s):
        events = [_bytes(e) for e in (s["events"] if "events" in s else _stream_events(_model_of(request)))]
        if s.get("cut") and events:
            events[-1] = events[-1].rstrip(b"\r\n")
        conn.sendall(_sse_head(s.get("status", 200), s.get("headers")))
        interval = float(s.get("interval", 0))
        for i, event in enumerate(events):
            if i and interval and self._sleep(interval):
                return
            conn.sendall(event)

    def _do_raw(self, conn, request, s):
        conn.sendall(_bytes(s.get("data", b"")))

    def _do_hang(self, conn, request, s):
        self._sleep(s.get("seconds", 10))

    def _do_reset(self, conn, request, s):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False


# -- command line -------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "--list") or len(argv) > 2:
        out = sys.stdout if argv and len(argv) == 1 else sys.stderr
        if not argv or argv[0] != "--list":
            print(__doc__.split("\n\n")[2].split("\n\n")[0], file=out)
        print("scenarios (name, parameters, what it does):", file=out)
        for name, (params, line) in SCENARIOS.items():
            print("  %-15s %-38s %s" % (name, ", ".join(params), line), file=out)
        return 0 if out is sys.stdout else 2
    try:
        scenario = json.loads(argv[0]) if argv[0].lstrip().startswith("{") else argv[0]
        port = int(argv[1]) if len(argv) > 1 else 0
        server = HostileServer(port=port, default=scenario)
    except (ValueError, OSError) as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 2
    server.start()
    print("hostile server (%s) at %s -- Ctrl-C to stop" % (server.default["name"], server.base_url), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
