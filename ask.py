#!/usr/bin/env python3
"""ask.py -- one call to an OpenAI-compatible endpoint, one ledger line per attempt. Stdlib only.

Usage:
  python ask.py < prompt.txt                  # the answer on stdout, a model_call line in a ledger
  python ask.py prompt.txt --expect '\\b4\\b'   # a gate: exit 3 when the answer does not match
  python ask.py --expect-json --retries 3 < prompt.txt
  python ask.py --stream < prompt.txt         # print as it arrives; records time-to-first-token
  python ask.py --models                      # is my key and base URL right? lists the model ids

Settings (environment; flags override): BASE_URL (or OPENAI_BASE_URL), API_KEY (or OPENAI_API_KEY),
MODEL_ID (--model). Optional: LEDGER (--ledger, default ./calls.jsonl), LEDGER_RUN_ID, LEDGER_KEY.
Exit codes: 0 ok, 1 the call failed, 2 usage/config/ledger error, 3 answer received but a check
failed, 5 stdout could not be written (the call is recorded).

Library (the one code path for a model call; agent.py uses it): ask.chat(messages, ledger=...,
base_url=..., model=..., api_key=...) returns the last attempt's record plus "text" (docs/ask.md).
"""

import argparse
import contextlib
import functools
import hashlib
import heapq
import hmac
import http.client
import ipaddress
import json
import math
import os
import random
import re
import socket
import socketserver
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

# reasoning_ledger.py beside us, even under -I
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.1.0"

__all__ = [
    "chat",
    "ask",
    "list_models",
    "settings_from_env",
    "split_base_url",
    "retryable",
    "estimate_tokens",
    "ConfigError",
    "RecordError",
    "MODEL_CALL_FIELDS",
    "MODEL_CALL_OPTIONAL",
    "DEFAULT_MAX_RESPONSE_BYTES"
]
# Ours beyond __all__ (the rooms' surface, not the vendoring promise). The HTTP kit, for proxy.py,
# daemon.py and fleet.py: Deadline, http_open, CappedServer, RequestHandler, Refused, http_answer,
# host_name, is_loopback, bearer_ok, require_json. One call's parts, for proxy.py: attempts (every
# attempt of a call), call_record, finish, models_call, CallFailed, endpoint, check_ledger,
# append_record, check_number, ms_since, RESPONSE_DONE; _take, _fill_ids and _server_text, which
# proxy.py's reader of Anthropic's answers (a body's `take`) builds on.

# --- Constants ---

DEFAULT_LEDGER = "calls.jsonl"
DEFAULT_TIMEOUT = 120.0
MIN_ATTEMPT_S = 1.0  # with `until`, no attempt starts with less time than this left
DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_SSE_LINE_BYTES = 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024
# a server-chosen string (model, id, fingerprint) longer than this is cut, with a note
MAX_FIELD_CHARS = 512
MAX_ERROR_CHARS = 500
MAX_PROBLEMS = 20
EST_METHOD = "chars/4"
RETRYABLE_STATUS = {408, 409, 429}
RETRYABLE_ERRORS = set(
    "timeout connection_refused connection_error rate_limited server_error truncated_response "
    "truncated_stream".split()
)
# else 5xx/other
STATUS_ERRORS = {401: "auth_error", 403: "auth_error", 404: "not_found", 429: "rate_limited"}
USER_AGENT = f"reasoning-ledger-ask/{__version__}"

_S, _I, _F, _B, _N, _D, _L = str, int, float, bool, type(None), dict, list
# The model_call record, field by field, with the JSON types each may hold: the one definition,
# which the writer builds every record from and audit.py checks what it reads against.
MODEL_CALL_FIELDS = {
    "request_model": (_S,),
    "response_model": (_S, _N),
    "response_id": (_S, _N),
    "system_fingerprint": (_S, _N),
    "base_url": (_S,),
    "server_address": (_S,),
    "server_port": (_I,),
    "stream": (_B,),
    "attempt": (_I,),
    "prompt_sha256": (_S,),
    "prompt_chars": (_I,),
    "system_chars": (_I,),
    "message_count": (_I,),
    "messages_sha256": (_S,),
    "response_chars": (_I, _N),
    "usage_reported": (_B,),
    "usage_status": (_S,),
    "input_tokens": (_I, _N),
    "output_tokens": (_I, _N),
    "total_tokens": (_I, _N),
    "cached_input_tokens": (_I, _N),
    "reasoning_output_tokens": (_I, _N),
    "est_input_tokens": (_I,),
    "est_output_tokens": (_I, _N),
    "est_method": (_S,),
    "latency_ms": (_F, _I, _N),
    "ttft_ms": (_F, _I, _N),
    "http_status": (_I, _N),
    "finish_reason": (_S, _N),
    "request_id": (_S, _N),
    "ratelimit": (_D,),
    "error_type": (_S, _N),
    "error_code": (_S, _N),
    "error_message": (_S, _N),
    "check": (_B, _N),
    "check_detail": (_S, _N),
    "temperature": (_F, _I, _N),
    "max_tokens": (_I, _N)
}
# Fields present only when they apply.
MODEL_CALL_OPTIONAL = {
    "system_sha256": (_S,),
    "messages_text": (_L,),
    "answer_text": (_S,),
    "retry_in_s": (_F, _I),
    "retry_reason": (_S,),
    "stream_options_dropped": (_B,),
    "cache_creation_input_tokens": (_I,),
    "redirect_host": (_S,),
    "malformed": (_L,),
    "route": (_S,),
    "client_address": (_S,),
    "user_agent": (_S, _N),
    "session_id": (_S, _N),
    "session_source": (_S, _N),
    "client_retry": (_I, _N),
    "upstream_route": (_S,),
    "tools_dropped": (_I,),
    "reasoning_dropped": (_I,)
}

# --- Errors ---


class ConfigError(rl.UsageError):
    """A setting or argument is missing or wrong; nothing was sent."""


class RecordError(rl.UsageError):
    """The call was made but its ledger line could not be written; `.record` holds what was
    received."""

    def __init__(self, message, record):
        super().__init__(message)
        self.record = record


class CallFailed(Exception):
    """One attempt failed: what the ledger records about it (body: an HTTP error's, capped)."""

    def __init__(
        self,
        error_type,
        message,
        status=None,
        headers=None,
        code=None,
        redirect_host=None,
        body=None
    ):
        super().__init__(message)
        self.error_type, self.message, self.status, self.headers = (
            error_type,
            message,
            status,
            headers
        )
        self.code, self.redirect_host, self.body = code, redirect_host, body


# --- Settings ---


def settings_from_env(base_url=None, model=None, api_key=None, environ=None, need_model=True):
    """(base_url, model, api_key) from flags, then the environment; no defaults. Raises
    ConfigError."""
    env = os.environ if environ is None else environ
    base_url = base_url or env.get("BASE_URL") or env.get("OPENAI_BASE_URL")
    model = model or env.get("MODEL_ID")
    api_key = api_key or env.get("API_KEY") or env.get("OPENAI_API_KEY")
    missing = [
        name
        for name, value in (("BASE_URL", base_url), ("API_KEY", api_key), ("MODEL_ID", model))
        if not value and (need_model or name != "MODEL_ID")
    ]
    if missing:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        raise ConfigError(
            f"{names} {'is' if len(missing) == 1 else 'are'} not set; export BASE_URL (like "
            "https://host/v1), API_KEY (any value for servers that ignore it) and MODEL_ID "
            "(the exact model id); there are no defaults"
        )
    check_api_key(api_key)
    split_base_url(base_url)
    return base_url, model, api_key


def check_api_key(api_key):
    if not re.fullmatch(r"[\x21-\x7e]+", api_key):  # it goes into an HTTP header
        raise ConfigError(
            "API_KEY must be printable ASCII, with no white space or line break in or around it "
            "(the key is not shown)"
        )


def split_base_url(base_url):
    """(request_base, recorded_base, host, port): the first keeps a query string (api-version=...),
    the recorded one drops user:password, query and fragment. Raises ConfigError for a bad URL."""
    try:
        parts = urllib.parse.urlsplit(base_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        (parts.hostname or "").encode("idna")
        bad = (
            "must be an http(s) URL like https://host/v1, with no white space, not"
            if re.search(r"[\x00-\x20\x7f]", base_url)
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            else None
        )
    except (ValueError, UnicodeError):
        bad = "has a bad host or port:"
    if bad:  # shown without query, fragment or credentials
        raise ConfigError(f"BASE_URL {bad} {rl.redact_text(re.split(r'[?#]', base_url)[0])!r}")
    host = parts.hostname
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    path = parts.path.rstrip("/")
    recorded = urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))
    return (parts.scheme, netloc, path, parts.query), recorded, host, port


def endpoint(request_base, suffix):
    scheme, netloc, path, query = request_base
    return urllib.parse.urlunsplit((scheme, netloc, path + suffix, query, ""))


def check_number(name, value, minimum=None, above=None):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, not {value!r}")
    if (minimum is not None and value < minimum) or (above is not None and value <= above):
        raise ConfigError(
            f"{name} must be {'at least' if above is None else 'greater than'} "
            f"{minimum if above is None else above}"
        )


# --- What a server says ---


def estimate_tokens(chars):
    return math.ceil(chars / 4) if chars else 0


def _count(value):
    # never 0 by default, never a guess
    return value if type(value) is int and 0 <= value < 2**63 else None


def _code(value):
    return str(value)[:100] if type(value) in (str, int) else None  # JSON's: a bool is no code


def parse_usage(usage):
    """Reported usage only. Returns the fields and usage_status:
    complete/partial/zero/absent/malformed."""
    got = usage if isinstance(usage, dict) else {}

    def detail(keys, name):
        found = next((got[key] for key in keys if got.get(key)), {})
        return _count(found.get(name)) if isinstance(found, dict) else None

    fields = {
        "input_tokens": _count(got.get("prompt_tokens", got.get("input_tokens"))),
        "output_tokens": _count(got.get("completion_tokens", got.get("output_tokens"))),
        "total_tokens": _count(got.get("total_tokens")),
        "cached_input_tokens": detail(
            ("prompt_tokens_details", "input_tokens_details"), "cached_tokens"
        ),
        "reasoning_output_tokens": detail(
            ("completion_tokens_details", "output_tokens_details"), "reasoning_tokens"
        )
    }
    known = [value for value in list(fields.values())[:3] if value is not None]
    if usage is None or not known:
        status = "absent" if usage is None else "malformed"
    else:
        status = "zero" if not any(known) else "partial" if len(known) < 3 else "complete"
    return dict(fields, usage_reported=bool(known), usage_status=status)


def _server_text(value, where, problems, limit=None):
    """A string the server chose, safe to record: another type, a lone surrogate or an over-long
    value is noted."""
    if type(value) is not str:
        if value is not None:
            problems.append(f"{where} is a {type(value).__name__}, not a string")
        return None
    try:
        value.encode()  # fails on a lone surrogate only: no regex for the common text
    except UnicodeEncodeError:
        problems.append(f"{where} holds a lone surrogate (not Unicode text)")
        value = re.sub("[\ud800-\udfff]", "\ufffd", value)
    if limit is not None and len(value) > limit:
        problems.append(f"{where} was cut from {len(value)} to {limit} characters")
    return value[:limit]


def _content_text(content, where, problems):
    """The text of a message or delta `content`: a string, or a list of text parts."""
    if type(content) is not list:
        return _server_text(content, where, problems) or ""
    texts = []
    for i, part in enumerate(content):
        if type(part) is not dict:
            problems.append(f"{where}[{i}] is a {type(part).__name__}, not a content part")
        elif part.get("type", "text") in ("text", "output_text"):
            texts.append(_server_text(part.get("text"), f"{where}[{i}].text", problems) or "")
    return "".join(texts)


def retry_after_seconds(headers, now=None):
    """The server's requested wait: retry-after-ms, or Retry-After in seconds or as an HTTP date."""
    lower = {k.lower(): v for k, v in headers.items()} if headers else {}
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            seconds = float(lower[name]) / scale
            break
        except (KeyError, TypeError, ValueError):
            seconds = None
    if seconds is None and "retry-after" in lower:
        import email.utils  # only on this rare path

        try:
            moment = email.utils.parsedate_to_datetime(lower["retry-after"]).timestamp()
        except (TypeError, ValueError, IndexError, AttributeError):
            return None
        seconds = moment - (time.time() if now is None else now)
    return max(0.0, seconds) if seconds is not None and math.isfinite(seconds) else None


def _error_from_body(raw, content_type):
    """(message, code): from a JSON error body, the <title> of an HTML page, or the text."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    err = data.get("error", data) if isinstance(data, dict) else None
    if isinstance(err, dict):
        message = next(
            (
                err[name]
                for name in ("message", "detail")
                if isinstance(err.get(name), str) and err[name]
            ),
            text
        )
        return message, _code(err.get("code"))
    if isinstance(err, str):
        return err, None
    if "html" in content_type or text.lower().startswith(("<!doctype html", "<html")):
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
        return f"an HTML page{f' titled {title.group(1).strip()[:200]!r}' if title else ''}", None
    return text, None


def run_checks(
    text,
    *,
    expect=None,
    expect_json=False,
    strict_model=False,
    request_model=None,
    response_model=None
):
    """The assertion gate. Returns (check, detail): check is None when nothing was asked."""
    results = []
    if expect is not None:
        pattern = expect if hasattr(expect, "search") else re.compile(expect)
        ok = bool(pattern.search(text))
        results.append((ok, f"{'matched' if ok else 'no match for'} /{pattern.pattern}/"))
    if expect_json:
        fence = re.fullmatch(r"\s*```[a-zA-Z0-9_-]*\s*\n(.*?)\n?```\s*", text, re.S)
        try:
            json.loads(fence.group(1) if fence else text)
            results.append((True, f"valid JSON{' (inside a ``` fence)' if fence else ''}"))
        except (ValueError, RecursionError) as exc:
            results.append((False, f"not JSON: {exc}"))
    if strict_model:
        ok = response_model == request_model
        results.append(
            (
                ok,
                f"served model {'is' if ok else 'is not'} the requested one "
                f"({response_model!r} vs {request_model!r})"
            )
        )
    return (
        (all(ok for ok, _ in results), "; ".join(detail for _, detail in results))
        if results
        else (None, None)
    )


# --- HTTP kit: never a redirect, one deadline for a whole request, one capped server ---

# {pid: (heap of (at, id, Deadline), Condition)}: one thread a process expires every Deadline (a
# thread per deadline costs more than a call to a local server); a forked child starts its own.
_timers = {}


def _timer():
    fresh = ([], threading.Condition())
    heap, wake = timer = _timers.setdefault(os.getpid(), fresh)

    def run():
        while True:
            with wake:
                while heap and heap[0][2].cancelled:
                    heapq.heappop(heap)
                due = heap[0][0] - time.monotonic() if heap else None
                if due is None or due > 0:
                    wake.wait(due)
                    continue
                deadline = heapq.heappop(heap)[2]
            deadline.expire()

    if timer is fresh:
        threading.Thread(target=run, name="deadlines", daemon=True).start()
    return timer


def shut(sock, how=socket.SHUT_RDWR):
    try:
        sock.shutdown(how)
    except OSError:
        pass


class Deadline:
    """The deadline of a whole request, connect to last byte: a server that trickles one byte at a
    time passes every socket timeout, so every socket watched is shut down when it passes.
    Deadline(None) has none."""

    def __init__(self, seconds):
        self.seconds, self.expired, self.cancelled, self.why = seconds, False, False, None
        self.at = time.monotonic() + seconds if seconds else None
        self._sockets, self._held, self._lock = [], [], threading.Lock()
        if seconds:
            heap, wake = _timers.get(os.getpid()) or _timer()
            with wake:
                heapq.heappush(heap, (self.at, id(self), self))
                wake.notify()

    def remaining(self):
        return self.at and max(0.001, self.at - time.monotonic())  # None: no deadline

    def watch(self, sock, how=socket.SHUT_RDWR):
        """Shut `sock` (both ways, or `how`) when the deadline passes."""
        with self._lock:
            self._sockets.append((sock, how))
            if self.expired:
                shut(sock, how)
        return sock

    def hold(self, sock):
        """watch() a duplicate of a new connection's socket, closed at cancel(): TLS takes the
        descriptor of the socket it wraps, which then can no longer be shut."""
        self._held.append(self.watch(sock.dup()))
        return sock

    def expire(self, why=None):
        """Shut the sockets; `why`, a CallFailed: the caller's reason to stop, not time."""
        with self._lock:
            if not self.cancelled:
                self.expired, self.why = True, self.why or why
                for sock, how in self._sockets:
                    shut(sock, how)

    def cancel(self):
        with self._lock:
            self.cancelled = True
            for sock in self._held:
                sock.close()


class _Answer(http.client.HTTPResponse):
    def _read_status(self):  # an interim answer (103 Early Hints) is skipped as 100 Continue is
        version, status, reason = super()._read_status()
        return version, 100 if 101 < status < 200 else status, reason


# this thread's opener (one costs more to build than a local call), and its deadline
_http = threading.local()


def http_open(request, deadline, timeout=None):
    """Open a urllib Request: proxies from the environment, never a redirect (a 3xx raises
    HTTPError, so no key goes to another URL), every socket under `deadline`, each read under
    `timeout` (default: what remains)."""
    if getattr(_http, "opener", None) is None:

        def watched(connection_class):
            def make(host, **kwargs):
                conn = connection_class(host, **kwargs)
                create, deadline = conn._create_connection, _http.deadline
                conn._create_connection = lambda *args, **kw: deadline.hold(create(*args, **kw))
                conn.response_class = _Answer
                return conn

            return make

        class Watched(urllib.request.AbstractHTTPHandler):
            http_request = https_request = urllib.request.AbstractHTTPHandler.do_request_

            def http_open(self, req):
                return self.do_open(watched(http.client.HTTPConnection), req)

            # the certificates (~20 ms) load only once an https URL is used
            def https_open(self, req):
                return self.do_open(
                    watched(http.client.HTTPSConnection), req, context=_tls_context()
                )

        _http.opener = urllib.request.OpenerDirector()  # no redirect handler: a 3xx is an HTTPError
        for handler in (
            urllib.request.ProxyHandler(),
            urllib.request.UnknownHandler(),
            Watched(),
            urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPErrorProcessor()
        ):
            _http.opener.add_handler(handler)
    _http.deadline = deadline
    return _http.opener.open(
        request, timeout=timeout if timeout is not None else deadline.remaining()
    )


@functools.cache
def _tls_context():
    import ssl

    return ssl.create_default_context()


class CappedServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """A thread per connection, at most `max_connections` (past that `busy`, an answer's bytes, and
    a close). Handlers add their idle keep-alive sockets to `idle` (under `lock`), which stop()
    shuts at once."""

    daemon_threads, block_on_close, allow_reuse_address, request_queue_size = True, False, True, 128

    def __init__(self, address, handler, max_connections, busy):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.max_connections, self.busy, self.slots = (
            max_connections,
            busy,
            threading.Semaphore(max_connections)
        )
        self.lock, self.idle, self.stopping = threading.Lock(), set(), False
        super().__init__(address, handler)

    def refused(self, client_address):
        """Called for a connection over the cap, before its busy answer."""

    def log_error(self, text):
        rl.error(text)

    def handle_error(self, request, client_address):  # one line, not socketserver's traceback
        self.log_error(f"connection from {client_address[0]}: {type(sys.exc_info()[1]).__name__}")

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.refused(client_address)
            try:
                request.settimeout(1.0)
                request.sendall(self.busy)
            except OSError:
                pass
            return self.shutdown_request(request)
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread could be started
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def stop(self, grace):
        """Idle connections closed at once, then no new connection; those in flight get `grace`
        seconds."""
        with self.lock:
            self.stopping = True
            for sock in self.idle:
                shut(sock)
        self.shutdown()
        self.server_close()
        ends = time.monotonic() + grace
        for _ in range(self.max_connections):  # every slot back: every request done
            if not self.slots.acquire(timeout=max(0.0, ends - time.monotonic())):
                break


# --- The one HTTP request reader, of proxy.py and daemon.py ---


class Refused(Exception):
    """An error answer: `reason` a short code (the proxy sends it, the daemon records it; None: a
    malformed request), `message` all the client reads, `headers` a dict of extra ones."""

    def __init__(self, status, reason, message, headers=None):
        super().__init__(message)
        self.status, self.reason, self.message, self.headers = (
            status,
            reason,
            message,
            headers or {}
        )


def http_answer(status, body, headers=(), close=False, chunked=False):
    """The bytes of one answer, head and body in one write (no Nagle delay between them); `headers`
    are (name, value) pairs, Content-Type application/json unless one is given."""
    head = [f"HTTP/1.1 {status} {http.client.responses.get(status, 'Status')}"]
    head += [f"{name}: {value}" for name, value in headers]
    if not any(name.lower() == "content-type" for name, _ in headers):
        head.append(f"Content-Type: {'text/event-stream' if chunked else 'application/json'}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}")
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1", "replace") + body


def host_name(value):
    """The name a Host header (or an Origin's host) gives, lowercased, without its port, brackets or
    final dot; None when it is not one."""
    # Host: name[:port], [v6][:port]
    match = re.match(
        r"(?:\[([0-9a-f:.]+)\]|([a-z0-9_.-]+))(?::[0-9]{1,5})?\Z", value.strip().lower()
    )
    return (match.group(1) or match.group(2)).rstrip(".") if match else None


def origin_host(origin):
    """The host[:port] of an http(s) Origin; anything else (`null`) comes back as it is."""
    return re.sub(r"\Ahttps?://", "", origin.strip().lower())


def is_loopback(host):
    """Is `host` loopback by its text alone: `localhost` or a loopback address? A name is never
    resolved: under DNS rebinding a name resolves to whatever its owner says."""
    host = host.strip("[]").lower()
    try:
        return host == "localhost" or ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def bearer_ok(authorization, token):
    """Does an Authorization header carry `Bearer TOKEN` (the scheme in any case)? Compared in
    constant time."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("latin-1", "replace"), token.encode()
    )


def require_json(headers):
    """A body's Content-Type must be application/json, UTF-8 if a charset is named: else a 415."""
    ctype = [part.strip() for part in (headers.get("Content-Type") or "").lower().split(";")]
    if ctype[0] != "application/json" or any(
        part.startswith("charset=") and part not in ("charset=utf-8", 'charset="utf-8"')
        for part in ctype[1:]
    ):
        raise Refused(415, "wrong_content_type", "the body must be application/json (UTF-8)")


class RequestHandler(socketserver.StreamRequestHandler):
    """Reads one HTTP/1.x request under one Deadline, and checks it in order: the request line and
    the headers (400, 431), the server's own checks (check(): Host, Origin, a token), the route and
    its method (allowed(): 404, 405), Content-Length (411, 400, 413; admit(): a budget), `Expect:
    100-continue`, the body (400 when short). A refusal raises Refused; a late one is a 408."""

    line, method, path, headers, close, stage = b"", "-", "-", {}, True, "request"

    def check(self):
        """The server's checks of the head (Host, Origin, a token): raise Refused to refuse."""

    def allowed(self, path):
        """The method `path` (without its query) takes; None: no such route."""

    def admit(self, length):
        """Before a body of `length` bytes is read: raise Refused to refuse it unread."""

    def read_request(self, seconds, max_body, how=socket.SHUT_RDWR):
        """The body of a request that passes every check, read within `seconds`: the deadline shuts
        the socket (both ways, or `how`). Sets line, method, path, headers, close (no keep-alive),
        stage ("request", then "body"). A client that sends nothing raises ConnectionAbortedError.
        """
        self.deadline, self.close, self.stage = Deadline(seconds), True, "request"
        # nothing of a keep-alive connection's last request speaks for this one
        self.method, self.path, self.headers = "-", "-", {}
        self.connection.settimeout(seconds + 2)  # a backstop: the deadline ends the reads
        self.deadline.watch(self.connection, how)
        try:
            body = self._read_request(max_body)
            if not self.deadline.expired:  # else the head or the body ended at the deadline
                return body
        # the deadline's timer is late (a loaded box): the reads end all the same
        except socket.timeout:
            self.deadline.expire()
        except Refused:
            self.close = (
                self.close
                or "Transfer-Encoding" in self.headers
                or (self.headers.get("Content-Length") or "0") != "0"
            )  # a body left unread ends the connection
            if not self.deadline.expired:
                raise
        raise Refused(408, None, "the request took too long")

    def _read_request(self, max_body):
        line = self.line = self.rfile.readline(65537)
        if not line and not self.deadline.expired:
            raise ConnectionAbortedError("no request")  # a browser's idle preconnect, say
        parts = line.decode("latin-1").split()
        if len(line) > 65536 or len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
            raise Refused(400, None, "not an HTTP/1.x request line")
        self.method, self.path = parts[:2]
        try:
            self.headers = http.client.parse_headers(self.rfile)
        except http.client.HTTPException:
            raise Refused(431, None, "the request headers are too long or too many") from None
        connection = (self.headers.get("Connection") or "").lower()
        self.close = "close" in connection or (
            parts[2] == "HTTP/1.0" and "keep-alive" not in connection
        )
        self.check()
        path = self.path.split("?", 1)[0]
        method = self.allowed(path)
        if method is None:
            raise Refused(404, None, f"no route {path[:200]}")
        if self.method != method:
            raise Refused(405, None, f"use {method}", {"Allow": method})
        lengths = self.headers.get_all("Content-Length") or ([] if self.method == "POST" else ["0"])
        if self.headers.get("Transfer-Encoding") is not None:
            raise Refused(
                411,
                "transfer_encoding",
                "send the body with Content-Length, without Transfer-Encoding"
            )
        if not lengths:
            raise Refused(411, "missing_length", "Content-Length is required")
        if len(lengths) > 1 or not re.fullmatch(r"[0-9]{1,15}", lengths[0].strip()):
            raise Refused(400, "bad_length", "Content-Length must be one decimal number")
        length = int(lengths[0])
        if length > max_body:
            raise Refused(413, "too_large", f"the body is larger than {max_body} bytes")
        self.admit(length)
        self.stage = "body"
        if (self.headers.get("Expect") or "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = self.rfile.read(length)
        if len(body) < length:
            raise Refused(400, "incomplete_body", "the body is shorter than Content-Length")
        return body


# --- Transport: no redirects, one deadline for the whole attempt, bounded reads ---


def _classify(exc, deadline):  # a failure below a complete HTTP answer
    import ssl  # already loaded by urllib.request

    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if deadline.expired:
        return (
            "timeout",
            f"no complete answer within {deadline.seconds:g} s (--timeout bounds the whole attempt)"
        )
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timeout", "timed out"
    if isinstance(reason, socket.gaierror):
        return "dns_error", f"name resolution failed: {reason.strerror or reason}"
    if isinstance(reason, ConnectionRefusedError):
        return "connection_refused", "connection refused"
    if isinstance(reason, ssl.SSLError):
        return "tls_error", f"TLS error: {reason}"
    if isinstance(reason, http.client.IncompleteRead):
        return "truncated_response", f"the body was cut short ({len(reason.partial)} bytes arrived)"
    return "connection_error", f"{type(reason).__name__}: {str(reason)[:200]}"


# api_key: a key, sent as a bearer token, or a dict of the headers that carry it (the proxy's
# UPSTREAM_AUTH and the anthropic-* headers)
def _open(url, record, problems, *, api_key, deadline, limit, body=None, opener=None):
    """Send one request (GET without a body) through `opener` (http_open's contract; proxy.py's
    pool); return the response of a 2xx, its head in `record`. Raises CallFailed for anything else,
    or for a body announced over `limit`."""
    stream = bool(body and body.get("stream"))
    headers = {
        "User-Agent": USER_AGENT,
        "Accept": "text/event-stream" if stream else "application/json"
    }
    headers.update(api_key if type(api_key) is dict else {"Authorization": f"Bearer {api_key}"})
    if body is not None:
        headers["Content-Type"] = "application/json"
    # \u escapes: lone surrogates go out too; a proxied body nothing changed goes as it came (.raw)
    data = None if body is None else getattr(body, "raw", None) or json.dumps(body).encode("ascii")
    try:
        response = (opener or http_open)(urllib.request.Request(url, data, headers), deadline)
    except urllib.error.HTTPError as exc:
        found = exc.headers or {}
        with exc:
            raw = _read_body(exc, MAX_ERROR_BODY_BYTES, deadline, tolerant=True)
        if 300 <= exc.code < 400:
            host = (
                urllib.parse.urlsplit(found.get("Location", "")).netloc.rpartition("@")[2][:200]
                or "(no Location)"
            )
            raise CallFailed(
                "redirect",
                f"HTTP {exc.code}: redirect to {host} not followed (the API key is "
                f"never sent to another URL; fix BASE_URL)",
                exc.code,
                exc.headers,
                redirect_host=host
            ) from None
        message, code = _error_from_body(raw, found.get("Content-Type", ""))
        error_type = STATUS_ERRORS.get(
            exc.code, "server_error" if exc.code >= 500 else "http_error"
        )
        raise CallFailed(
            error_type,
            f"HTTP {exc.code}: {message or exc.reason}",
            exc.code,
            exc.headers,
            code=code,
            body=raw
        ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise CallFailed(*_classify(exc, deadline)) from None
    record["http_status"] = response.status
    _fill_head(record, response.headers, problems)
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        response.close()
        raise CallFailed(
            "response_too_large",
            f"the body announces {declared} bytes, over the {limit}-byte "
            f"limit (--max-response-bytes)",
            response.status,
            response.headers
        )
    return response


def _read_body(response, limit, deadline, tolerant=False):
    """The body, at most `limit` bytes, checked against Content-Length, unless `tolerant` (an
    error's body)."""
    failed, parts, size = None, [], 0
    try:
        # in pieces: read(limit + 1) sets the whole limit aside for a body of unknown length
        while size <= limit:
            part = response.read(min(65536, limit + 1 - size))
            if not part:
                break
            parts.append(part)
            size += len(part)
    except (OSError, http.client.HTTPException) as exc:
        failed = _classify(exc, deadline)
    raw = b"".join(parts)
    if tolerant:
        return raw[:limit]
    if len(raw) > limit:
        failed = (
            "response_too_large",
            f"the body is over the {limit}-byte limit (--max-response-bytes)"
        )
    elif deadline.expired:
        failed = _classify(None, deadline)
    elif failed is None and response.length:
        failed = (
            "truncated_response",
            f"the body ended {response.length} bytes short of its Content-Length"
        )
    if failed is not None:
        raise CallFailed(*failed, response.status, response.headers)
    return raw


def _parse_json(raw, what, problems, status, headers):
    """A JSON object from raw bytes. NaN and Infinity are noted in problems and read as null."""
    try:
        data = json.loads(
            raw.decode(), parse_constant=lambda name: problems.append(f"{name} in the {what}")
        )
    except UnicodeDecodeError:
        raise CallFailed(
            "invalid_json", f"HTTP {status} but the {what} is not UTF-8", status, headers
        ) from None
    except ValueError:
        message = _error_from_body(raw, headers.get("Content-Type", ""))[0]
        error_type = "html_response" if message.startswith("an HTML page") else "invalid_json"
        raise CallFailed(
            error_type,
            f"HTTP {status} but the {what} is not JSON: {message[:200]}",
            status,
            headers
        ) from None
    except RecursionError:
        raise CallFailed(
            "malformed_response", f"the {what} is nested too deeply to read", status, headers
        ) from None
    if not isinstance(data, dict):
        raise CallFailed(
            "invalid_json", f"HTTP {status} but the {what} is not a JSON object", status, headers
        )
    return data


def _api_error(err, status, headers, prefix):
    message, code = (
        (err.get("message"), _code(err.get("code"))) if isinstance(err, dict) else (err, None)
    )
    raise CallFailed(
        "api_error", f"{prefix}: {str(message)[:MAX_ERROR_CHARS]}", status, headers, code=code
    )


# --- Core: one attempt, one record, one ledger line ---


def _sha256(text):
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def call_record(model, split, stream, messages, options, attempt, **extra):
    """A model_call record before the answer: the request's fields, then `extra` (messages_text)."""
    _request_base, recorded_base, host, port = split
    system = [m["content"] for m in messages if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    system_chars = sum(map(len, system))
    prompt_chars = sum(len(m["content"]) for m in messages) - system_chars
    record = dict.fromkeys(MODEL_CALL_FIELDS)
    record.update(
        parse_usage(None),
        request_model=model,
        base_url=recorded_base,
        server_address=host,
        server_port=port,
        stream=stream,
        attempt=attempt,
        prompt_sha256=_sha256(users[-1] if users else ""),
        prompt_chars=prompt_chars,
        system_chars=system_chars,
        message_count=len(messages),
        messages_sha256=_sha256(json.dumps(messages, ensure_ascii=False, separators=(",", ":"))),
        est_input_tokens=estimate_tokens(prompt_chars + system_chars),
        est_method=EST_METHOD,
        ratelimit={},
        temperature=options.get("temperature"),
        max_tokens=options.get("max_tokens")
    )
    if system:
        record["system_sha256"] = _sha256("\n".join(system))
    record.update(extra)
    return record


def _fill_ids(record, data, problems):
    for name, key in (
        ("response_model", "model"),
        ("response_id", "id"),
        ("system_fingerprint", "system_fingerprint")
    ):
        value = _server_text(data.get(key), key, problems, MAX_FIELD_CHARS)
        if value is not None:
            record[name] = value


def _take(record, data, key, state, problems, status, headers):
    """A whole answer (key "message") or a stream chunk ("delta") of chat, completions, the
    Responses API or embeddings into record and state; returns its text (None for embeddings)."""
    whole, kind, choices = key == "message", data.get("type"), data.get("choices")
    if kind == "error" or (
        data.get("error") is not None and not (whole and (choices or data.get("output")))
    ):
        _api_error(
            data.get("error") or data,
            status,
            headers,
            f"HTTP {status} with an error body" if whole else "error in the stream"
        )
    if (whole and isinstance(data.get("output"), list)) or (
        type(kind) is str and kind.startswith("response.")
    ):
        return _take_response(record, data, whole, state, problems, status, headers)
    _fill_ids(record, data, problems)
    if whole or data.get("usage") is not None:
        state["usage"] = data.get("usage")
    if whole and data.get("object") == "list" and isinstance(data.get("data"), list):
        state["tools"] = state["embedding"] = True  # an answer, without text
        return None
    if whole and (not isinstance(choices, list) or not choices):
        raise CallFailed(
            "no_choices", f"HTTP {status} but the response has no choices", status, headers
        )
    if type(choices or []) is not list:
        problems.append(f"a stream chunk's choices is a {type(choices).__name__}, not a list")
        return ""
    return "".join(
        _choice_text(
            record, choice, key, "choices[0]" if whole else "a stream choice", state, problems
        )
        for choice in (choices[:1] if whole else choices or [])
        if whole or type(choice) is not dict or choice.get("index", 0) == 0
    )


def _choice_text(record, choice, key, where, state, problems):
    """One choice's text, whole or a stream's piece, with its finish_reason and whether it calls a
    tool."""
    if type(choice) is not dict:
        problems.append(f"{where} is a {type(choice).__name__}, not an object")
        return ""
    if key == "message" or choice.get("finish_reason") is not None:
        record["finish_reason"] = _server_text(
            choice.get("finish_reason"), f"{where}.finish_reason", problems, MAX_FIELD_CHARS
        )
        state["finished"] = True
    part = choice.get(key)
    if part is None:
        return _server_text(choice.get("text"), f"{where}.text", problems) or ""
    if type(part) is not dict:
        problems.append(f"{where}.{key} is a {type(part).__name__}, not an object")
        return ""
    calls = part.get("tool_calls") or part.get("function_call") or []
    for call in calls if type(calls) is list else [calls]:
        call = (call.get("function") or call) if type(call) is dict else {}
        _add_tool(state, call.get("name"), call.get("arguments"))
    return _content_text(part.get("content"), f"{where}.{key}.content", problems)


def _add_tool(state, *values):
    """A tool call, or a stream's piece of one: the answer calls a tool, and its name and arguments
    count as output (response_chars, est_output_tokens, ttft_ms)."""
    state["tools"] = True
    state["chars"] = state.get("chars", 0) + sum(len(v) for v in values if type(v) is str)


RESPONSE_DONE = ("response.completed", "response.incomplete", "response.failed")


def _take_response(record, data, whole, state, problems, status, headers):
    """The Responses API: a whole response, or one of a stream's response.* events."""
    kind = data.get("type")
    if kind == "response.output_text.delta":
        return _server_text(data.get("delta"), "delta", problems) or ""
    if kind in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
        _add_tool(state, data.get("delta"))
    response = data if whole else data.get("response")
    if type(response) is dict:
        _fill_ids(record, response, problems)
        state["usage"] = response.get("usage", state.get("usage"))
        if whole or kind in RESPONSE_DONE:
            record["finish_reason"] = _server_text(
                response.get("status"), "status", problems, MAX_FIELD_CHARS
            )
            state["done"] = True
        if kind == "response.failed":
            _api_error(response.get("error"), status, headers, "the response failed")
    texts, items = [], (
        data.get("output") if whole else [data["item"]] if type(data.get("item")) is dict else []
    )
    if type(items) is not list:
        problems.append(f"output is a {type(items).__name__}, not a list")
        items = []
    for item in items:
        if type(item) is not dict:
            problems.append(f"an output item is a {type(item).__name__}, not an object")
        elif whole and item.get("type") == "message":
            texts.append(_content_text(item.get("content"), "output[].content", problems))
        elif item.get("type") in ("function_call", "custom_tool_call"):
            # a stream's item comes again whole at .done: its arguments count from the deltas
            named = whole or kind == "response.output_item.added"
            _add_tool(state, *[item.get(k) for k in ("name", "arguments", "input") if named])
    return "".join(texts)


def _sse_chunk(data, state, problems, status, headers):
    """The JSON object an event's data lines hold; None for [DONE] (noted in `state`), a comment, or
    an event that is not a JSON object (noted in `problems`)."""
    event = b"\n".join(data) if data else None
    if event == b"[DONE]":
        state["done"] = True
    elif event is not None and event[:1] == b"{":
        return _parse_json(event, "stream chunk", problems, status, headers)
    elif event is not None:
        problems.append(f"a stream chunk is not a JSON object: {event[:80]!r}")
    return None


def _read_stream(response, record, started, on_text, limit, deadline, problems, relay, state, take):
    """Read server-sent events to [DONE], a finish_reason or response.completed; return the text.
    Lines and the stream are capped; relay(raw, chunk) gets each event as it arrives."""
    status, headers = response.status, response.headers
    parts, raw, data, total, seen = [], [], [], 0, False
    state["chars"] = 0
    try:
        while not (state.get("done") or deadline.expired):
            line = response.readline(MAX_SSE_LINE_BYTES + 1)
            total += len(line)
            if total > limit or (len(line) > MAX_SSE_LINE_BYTES and not line.endswith(b"\n")):
                raise CallFailed(
                    "response_too_large",
                    f"the stream is over the {limit}-byte limit or has a line "
                    f"over {MAX_SSE_LINE_BYTES} bytes",
                    status,
                    headers
                )
            if line and not line.endswith(b"\n"):
                raise CallFailed(
                    "truncated_stream",
                    "the stream was cut in the middle of an event",
                    status,
                    headers
                )
            raw.append(line)
            text = line.rstrip(b"\r\n")
            if text.startswith(b"data:"):
                data.append(text[5:].strip())
            if line and ((text and data[-1:] != [b"[DONE]"]) or (not text and len(raw) == 1)):
                continue  # the event goes on (a lone blank line goes out with the next one)
            if not (line or data):
                break
            chunk = _sse_chunk(data, state, problems, status, headers)
            seen = seen or data not in ([], [b"[DONE]"])
            if relay is not None:
                relay(b"".join(raw), chunk)
            raw, data = [], []
            piece = take(record, chunk, "delta", state, problems, status, headers) if chunk else ""
            state["chars"] += len(piece)
            if state["chars"] and record["ttft_ms"] is None:  # text or a tool call
                record["ttft_ms"] = ms_since(started)
            if piece:
                parts.append(piece)
                on_text(piece)
            if not line:
                break
        if deadline.expired:
            raise CallFailed(*_classify(None, deadline), status, headers)
    except (OSError, http.client.HTTPException) as exc:
        raise CallFailed(*_classify(exc, deadline), status, headers) from None
    # empty: no data line but [DONE], if that (proxy.py relays it as it came, a 200 that ends)
    if not (seen and (state.get("done") or state.get("finished"))):
        raise CallFailed(
            "truncated_stream" if seen else "empty_stream",
            f"the stream ended without {'a finish_reason or [DONE]' if seen else 'a data line'}",
            status,
            headers
        )
    return "".join(parts)


def _fill_head(record, headers, problems):
    record["request_id"] = _server_text(
        headers.get("x-request-id") or headers.get("request-id"),
        "request-id header",
        problems,
        MAX_FIELD_CHARS
    )
    record["ratelimit"] = limits = {}
    for name, value in headers.items():
        low = name.lower()
        if (low.startswith("x-ratelimit-") or low in ("retry-after", "retry-after-ms")) and len(
            limits
        ) < 32:
            limits[low[:64]] = str(value)[:200]


def _one_attempt(
    url, body, record, started, api_key, deadline, limit, on_text, problems, relay, state, opener
):
    """Send once; fill `record` but latency_ms, and `state` (status, headers, a parsed body's bytes,
    `chars` of text and tool calls); return the text. Raises CallFailed. `relay(raw, chunk)` gets a
    stream's events as they arrive, or a whole body once it parses (proxy.py)."""
    take = getattr(body, "take", _take)  # a proxied body may name the reader of its API's answer
    with _open(
        url,
        record,
        problems,
        api_key=api_key,
        deadline=deadline,
        limit=limit,
        body=body,
        opener=opener
    ) as response:
        status, headers = state["status"], state["headers"] = response.status, response.headers
        try:
            if body.get("stream"):
                return _read_stream(
                    response,
                    record,
                    started,
                    on_text,
                    limit,
                    deadline,
                    problems,
                    relay,
                    state,
                    take
                )
            raw = _read_body(response, limit, deadline)
            data = _parse_json(raw, "body", problems, status, headers)
            state["raw"] = raw
            if relay is not None:
                relay(raw, data)
            text = take(record, data, "message", state, problems, status, headers)
            if text is not None:  # an embedding has none
                state["chars"] = state.get("chars", 0) + len(text)
            return text
        # a shape the readers did not foresee
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            raise CallFailed(
                "malformed_response",
                f"the answer's shape cannot be read ({type(exc).__name__})",
                status,
                headers
            ) from None
        finally:
            record.update(parse_usage(state.get("usage")))
            if "chars" in state:
                record["response_chars"] = state["chars"]
                record["est_output_tokens"] = estimate_tokens(state["chars"])
            if (
                state.get("embedding")
                and record["input_tokens"] is not None
                and record["output_tokens"] is None
            ):
                record["usage_status"] = "complete"  # embeddings have input tokens only


def _attempt(
    record,
    on_text,
    relay,
    seconds,
    url,
    body,
    api_key,
    limit,
    redactor,
    tools_answer,
    checks,
    store,
    opener
):
    """One attempt under a deadline of `seconds`, its record finished, checked (`checks` for
    run_checks) and its text stored (`store`): (text, failure or None, state)."""
    text, failure, problems, state, started = None, None, [], {}, time.perf_counter()
    deadline = Deadline(seconds)
    if relay is not None:
        relay.start(deadline, state)
    try:
        text = _one_attempt(
            url,
            body,
            record,
            started,
            api_key,
            deadline,
            limit,
            on_text,
            problems,
            relay,
            state,
            opener
        )
    except CallFailed as exc:
        failure = exc
    finally:
        deadline.cancel()
    # deadline.why: stopped by the caller (proxy.py: its client went away)
    answered = tools_answer and state.get("tools")
    failure = finish(record, started, text, deadline.why or failure, problems, redactor, answered)
    if failure is None and checks:
        record["check"], record["check_detail"] = run_checks(
            text,
            request_model=record["request_model"],
            response_model=record["response_model"],
            **checks
        )
    answer = store and store(text, state)
    if answer:
        record["answer_text"] = answer
    return text, failure, state


def finish(record, started, text, failure, problems, redactor, answered=False):
    """The last steps of every attempt, one-shot, proxied, refused or /models: latency, problems
    and the failure, if any, into `record`. Returns the failure (None on success)."""
    record["latency_ms"] = ms_since(started)  # to the end of the body, or to the failure
    if problems:
        record["malformed"] = problems[:MAX_PROBLEMS]
    if problems and failure is None:
        failure = CallFailed(
            "malformed_response",
            f"the answer arrived but the body is malformed: {'; '.join(problems[:3])}",
            record["http_status"]
        )
    if failure is None and not answered and not (text or "").strip():
        failure = CallFailed(
            "empty_content",
            f"HTTP {record['http_status']} but the answer is empty",
            record["http_status"]
        )
    if failure is None:
        return None
    record["error_type"] = failure.error_type
    record["error_message"] = redactor.text(failure.message)[:MAX_ERROR_CHARS]
    if failure.code is not None:
        record["error_code"] = redactor.text(failure.code)
    if failure.status is not None:
        record["http_status"] = failure.status
    if failure.redirect_host:
        record["redirect_host"] = failure.redirect_host
    if failure.headers is not None:
        _fill_head(record, failure.headers, [])
    return failure


def ms_since(started):
    return round((time.perf_counter() - started) * 1000, 1)


def retryable(record):
    """Whether a failed attempt is worth retrying: a timeout, a dropped or cut answer, a busy or
    broken server."""
    return record["error_type"] in RETRYABLE_ERRORS or record["http_status"] in RETRYABLE_STATUS


class _Printer:
    """The caller's on_text; once it raises it is called no more, and the exception waits for the
    line."""

    def __init__(self, on_text):
        self.on_text, self.raised = on_text, None

    def __call__(self, piece):
        if self.on_text is not None and self.raised is None:
            try:
                self.on_text(piece)
            # the caller's code: kept, and raised again once the line is written
            except Exception as exc:
                self.raised = exc


def _retry_wait(record, failure, body, attempt, retries, backoff, max_wait, until):
    """The wait before the next attempt (its reason into `record`), or None when there is none to
    make."""
    if (
        "stream_options" in body
        and failure.status in (400, 422)
        and "stream_options" in (failure.message or "")
    ):
        record["retry_reason"] = "server rejected stream_options; retrying once without it"
        body.pop("stream_options")
        return 0.0
    if not retryable(record) or attempt > retries:
        return None
    server_wait = retry_after_seconds(failure.headers)
    wait = min(
        max_wait,
        (
            backoff * (2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            if server_wait is None
            else server_wait
        )
    )
    if until is not None and time.monotonic() + wait > until - MIN_ATTEMPT_S:
        return None  # the caller's time runs out before another attempt could be made
    record["retry_in_s"] = round(wait, 3)
    record["retry_reason"] = f"{failure.error_type}: {record['error_message']}"[:MAX_ERROR_CHARS]
    return wait


def attempts(
    url,
    body,
    new_record,
    append,
    *,
    api_key,
    timeout,
    limit,
    redactor,
    retries=0,
    checks=None,
    store=None,
    backoff=1.0,
    max_wait=60.0,
    on_text=None,
    on_retry=None,
    sleep=time.sleep,
    relay=None,
    tools_answer=False,
    until=None,
    opener=None
):
    """Every attempt of one call, each one model_call line through `append`, retried as _retry_wait
    says; each request sent by `opener` (None: http_open). Returns (result, failure, state, relay)
    of the last attempt; result is its record plus "text"."""
    attempt, options = 0, "stream_options" in body
    # the same each attempt
    call = (url, body, api_key, limit, redactor, tools_answer, checks, store, opener)
    while True:
        attempt += 1
        record, printer, out = new_record(attempt), _Printer(on_text), relay() if relay else None
        if options and "stream_options" not in body:  # _retry_wait dropped them
            record["stream_options_dropped"] = True
        seconds = timeout if until is None else max(0.001, min(timeout, until - time.monotonic()))
        text, failure, state = _attempt(record, printer, out, seconds, *call)
        wait = None
        # a stream already shown is not sent twice
        printed = on_text is not None and record["ttft_ms"] is not None
        if failure is not None and not (printed or (out is not None and out.began)):
            wait = _retry_wait(record, failure, body, attempt, retries, backoff, max_wait, until)
        result = dict(
            record,
            text=text if failure is None or failure.error_type == "malformed_response" else None
        )
        try:
            append("model_call", record)
        except RecordError as exc:
            exc.record = result
            raise
        if printer.raised is not None:
            raise printer.raised
        if wait is None:
            return result, failure, state, out
        if on_retry is not None:
            on_retry(result, wait)
        sleep(wait)


@contextlib.contextmanager
def _opened(ledger, api_key):
    """A Ledger that can take a line: the one given, a Run's, or one opened on a path (and closed
    after)."""
    ledger = ledger.ledger if isinstance(ledger, rl.Run) else ledger
    owned = not isinstance(ledger, rl.Ledger)
    book = rl.Ledger(ledger, os.environ.get("LEDGER_RUN_ID") or None) if owned else ledger
    book.add_secret(api_key)
    try:
        check_ledger(book)
        yield book
    finally:
        if owned:
            book.close()


def check_ledger(book):
    try:
        book.check()  # a ledger that cannot take the line costs no request
    except (rl.LedgerError, OSError) as exc:
        raise ConfigError(
            f"the ledger cannot take a line, so nothing was sent: {rl.error_text(exc)}"
        ) from None


def append_record(book, kind, record):
    try:
        book.append(kind, record)
    except (rl.LedgerError, OSError) as exc:
        raise RecordError(
            f"the call was made but its ledger line could not be written: {rl.error_text(exc)}",
            record
        ) from exc


def chat(
    messages,
    *,
    ledger,
    base_url,
    model,
    api_key,
    max_tokens=None,
    temperature=None,
    stream=False,
    retries=0,
    timeout=DEFAULT_TIMEOUT,
    expect=None,
    expect_json=False,
    strict_model=False,
    store_text=False,
    backoff=1.0,
    max_wait=60.0,
    max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES,
    on_text=None,
    on_retry=None,
    sleep=time.sleep,
    until=None
):
    """Send `messages` to {base_url}/chat/completions, one model_call line per attempt; return the
    last attempt's record plus "text". Failures are in the record; ConfigError means nothing was
    sent (docs/ask.md)."""
    expect = _check_chat(locals())
    split = split_base_url(base_url)
    options = {"max_tokens": max_tokens, "temperature": temperature}
    body = {
        "model": model,
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages]
    }
    body.update((name, value) for name, value in options.items() if value is not None)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    with _opened(ledger, api_key) as book:
        stored = [_store(book, m["role"], m["content"]) for m in messages if store_text]
        texts = {"messages_text": stored} if store_text else {}
        return attempts(
            endpoint(split[0], "/chat/completions"),
            body,
            functools.partial(call_record, model, split, bool(stream), messages, options, **texts),
            functools.partial(append_record, book),
            api_key=api_key,
            timeout=timeout,
            limit=max_response_bytes,
            redactor=book.redactor,
            retries=retries,
            checks=dict(expect=expect, expect_json=expect_json, strict_model=strict_model),
            store=functools.partial(_store, book, "assistant") if store_text else None,
            backoff=backoff,
            max_wait=max_wait,
            on_text=on_text,
            on_retry=on_retry,
            sleep=sleep,
            until=until
        )[0]


# chat()'s numbers: (name, the least allowed, the value to be above)
_CHAT_NUMBERS = (
    ("temperature", None, None),
    ("timeout", None, 0),
    ("max_wait", 0, None),
    ("backoff", 0, None),
    ("until", None, None),
    ("retries", 0, None),
    ("max_tokens", 1, None),
    ("max_response_bytes", 1024, None)
)


def _check_chat(args):
    """chat()'s arguments (`args`: its locals() on entry), before anything is sent; returns `expect`
    compiled. Raises ConfigError."""
    messages = args["messages"]
    if not args["model"]:
        raise ConfigError(
            "MODEL_ID is not set (export MODEL_ID=..., or pass --model); there is no default"
        )
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            type(m) is dict and type(m.get("role")) is str and type(m.get("content")) is str
            for m in messages
        )
    ):
        raise ConfigError('messages must be a non-empty list of {"role": str, "content": str}')
    if not any(m["role"] != "system" and m["content"].strip() for m in messages):
        raise ConfigError("the prompt is empty")
    if any(
        type(n) is not int
        for n in (
            args["retries"],
            args["max_response_bytes"],
            1 if args["max_tokens"] is None else args["max_tokens"]
        )
    ):
        raise ConfigError("retries, max_tokens and max_response_bytes must be integers")
    for name, minimum, above in _CHAT_NUMBERS:
        check_number(name, args[name], minimum, above)
    check_api_key(args["api_key"])
    try:
        expect = args["expect"]
        return re.compile(expect) if isinstance(expect, str) else expect
    except re.error as exc:
        raise ConfigError(f"--expect is not a valid regular expression: {exc}") from None


def _store(book, role, text, _state=None):
    """--store-text: one message as an entry in the ledger's text store; its SHA-256 (None without
    an answer)."""
    if text is not None:
        return book.store_text({"role": role, "parts": [{"type": "text", "text": text}]})


def ask(prompt, *, system=None, **kwargs):
    """One prompt (and an optional system prompt) through chat(). Same arguments and result."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("the prompt is empty")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return chat(messages, **kwargs)


def list_models(
    *,
    ledger,
    base_url,
    api_key,
    timeout=DEFAULT_TIMEOUT,
    max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES
):
    """GET {base_url}/models; append one models_list event; return its record (docs/ask.md,
    docs/small-models.md)."""
    check_api_key(api_key)
    split = split_base_url(base_url)
    check_number("timeout", timeout, above=0)
    with _opened(ledger, api_key) as book:
        record = models_call(book.redactor, split, api_key, timeout, max_response_bytes)[0]
        append_record(book, "models_list", record)
    return record


def models_call(redactor, split, api_key, timeout, limit):
    """GET /models once: (record, raw body or None, failure or None, response headers or None)."""
    request_base, recorded_base, host, port = split
    record = dict.fromkeys(
        "base_url server_address server_port http_status model_ids count latency_ms request_id "
        "ratelimit error_type error_code error_message".split()
    )
    record.update(base_url=recorded_base, server_address=host, server_port=port, ratelimit={})
    started, deadline = time.perf_counter(), Deadline(timeout)
    problems, raw, failure, headers = [], None, None, None
    try:
        with _open(
            endpoint(request_base, "/models"),
            record,
            problems,
            api_key=api_key,
            deadline=deadline,
            limit=limit
        ) as response:
            headers = response.headers
            raw = _read_body(response, limit, deadline)
            _model_list(
                record, _parse_json(raw, "body", problems, response.status, headers), problems
            )
        if problems:
            record["malformed"] = problems[:MAX_PROBLEMS]
    except CallFailed as exc:
        failure, raw = exc, None
    finally:
        deadline.cancel()
    finish(record, started, None, failure, [], redactor, answered=True)
    return record, raw, failure, headers


def _model_list(record, data, problems):
    """A /models answer's ids into `record`, and the context windows it states."""
    items = data.get("data")
    if not isinstance(items, list):
        raise CallFailed("invalid_json", "HTTP 200 but the body has no data list", 200)
    items = [item for item in items if isinstance(item, dict)]
    ids = {
        _server_text(item.get("id"), "data[].id", problems, MAX_FIELD_CHARS) for item in items
    } - {None}
    record["model_ids"], record["count"] = sorted(ids)[:10000], len(ids)
    windows = {}
    for item in items:  # vLLM's max_model_len, llama.cpp's meta.n_ctx_train, or context_length
        meta = item.get("meta") if isinstance(item.get("meta"), dict) else {}
        window = [
            n
            for n in (
                item.get("max_model_len"),
                meta.get("n_ctx_train"),
                item.get("context_length")
            )
            if type(n) is int and n > 0
        ]
        if window and type(item.get("id")) is str and item["id"] in ids:
            windows[item["id"]] = window[0]
    if windows:
        record["context_tokens"] = dict(sorted(windows.items())[:10000])


# --- CLI ---


def _read_prompt(source):
    if source is None and sys.stdin.isatty():
        raise ConfigError("no prompt: pipe one in (python ask.py < prompt.txt) or name a file")
    try:
        if source in (None, "-"):
            return sys.stdin.buffer.read().decode()
        with open(source, "rb") as handle:
            return handle.read().decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the prompt is not UTF-8 (byte {exc.start})") from None


def _build_parser():
    p = rl.ArgumentParser(
        prog="ask.py",
        description="One OpenAI-compatible call, one ledger line per attempt.",
        epilog=rl.exit_codes_epilog(
            rl.EXIT_OK, rl.EXIT_FAILED, rl.EXIT_USAGE, rl.EXIT_CHECK, rl.EXIT_OUTPUT
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "prompt_file", nargs="?", help="a file with the prompt, or - for stdin (default: stdin)"
    )
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("--model", help="the model id to pin (default $MODEL_ID)")
    p.add_argument("--base-url", help="default $BASE_URL, then $OPENAI_BASE_URL")
    p.add_argument("--ledger", help=f"default $LEDGER, then ./{DEFAULT_LEDGER}")
    p.add_argument(
        "--models", action="store_true", help="list the endpoint's model ids instead of asking"
    )
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument(
        "--stream", action="store_true", help="stream the answer; records time-to-first-token"
    )
    p.add_argument(
        "--retries", type=int, default=0, help="retries on 408/409/429/5xx/timeouts/broken answers"
    )
    p.add_argument(
        "--backoff", type=float, default=1.0, help="first retry wait in seconds, doubled each time"
    )
    p.add_argument(
        "--max-wait", type=float, default=60.0, help="cap on any one wait, Retry-After included"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds for a whole attempt, connect to last byte (default {DEFAULT_TIMEOUT:g})"
    )
    p.add_argument(
        "--max-response-bytes",
        type=int,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        help=f"largest body or stream accepted (default {DEFAULT_MAX_RESPONSE_BYTES})"
    )
    p.add_argument(
        "--expect", metavar="REGEX", help="the answer must match this regex (else exit 3)"
    )
    for flag, text in (
        ("--expect-json", "the answer must be JSON (else exit 3)"),
        ("--strict-model", "the served model must be the one asked (else exit 3)"),
        ("--store-text", "keep the text in LEDGER.text/"),
        ("--json", "print the whole record instead of the text")
    ):
        p.add_argument(flag, action="store_true", help=text)
    return p


_ASK_FLAGS = (
    "system max_tokens temperature stream retries timeout expect expect_json strict_model "
    "store_text backoff max_wait max_response_bytes"
).split()


def _run(args):
    args.ledger = args.ledger or os.environ.get("LEDGER") or DEFAULT_LEDGER
    base_url, model, api_key = settings_from_env(
        args.base_url, args.model, need_model=not args.models
    )
    # the numbers are checked once, by chat() and list_models(), before anything is sent
    secrets = [api_key]
    if args.models:
        return _run_models(args, base_url, api_key)
    prompt = _read_prompt(args.prompt_file)

    def announce_retry(result, wait):
        rl.warn(
            f"attempt {result['attempt']} failed ({result['error_type']}: "
            f"{result['error_message']}); retrying in {wait:.2f} s",
            secrets
        )

    try:
        record = ask(
            prompt,
            ledger=args.ledger,
            base_url=base_url,
            model=model,
            api_key=api_key,
            on_text=rl.write_out if args.stream and not args.json else None,
            on_retry=announce_retry,
            **{name: getattr(args, name) for name in _ASK_FLAGS}
        )
        _print_answer(record, args)
    except RecordError as exc:
        if exc.record.get("text") and not args.stream:
            _print_answer(exc.record, args)  # a paid answer is never thrown away
        raise
    # chat() raises a stream's failed print once the attempt's line is written
    except rl.OutputError as exc:
        rl.error(f"{exc} (the call is recorded in {args.ledger})", secrets)
        return rl.EXIT_OUTPUT
    if record["response_model"] and record["response_model"] != model:
        rl.warn(
            f"asked for {model!r}, the server says it ran {record['response_model']!r}", secrets
        )
    if record["error_type"]:
        rl.error(
            f"{record['error_type']}: {record['error_message']} ({record['base_url']}, attempt "
            f"{record['attempt']})",
            secrets
        )
        return rl.EXIT_FAILED
    if record["usage_status"] != "complete" and not args.json:
        rl.warn(
            f"usage {record['usage_status']}: token counts are not fully reported; "
            f"estimates ({EST_METHOD}) are recorded separately",
            secrets
        )
    if record["check"] is False:
        rl.error(f"check not passed: {record['check_detail']}", secrets)
        return rl.EXIT_CHECK
    return rl.EXIT_OK


def _run_models(args, base_url, api_key):
    """--models: the endpoint's model ids on stdout (the record with --json)."""
    record = list_models(
        ledger=args.ledger,
        base_url=base_url,
        api_key=api_key,
        timeout=args.timeout,
        max_response_bytes=args.max_response_bytes
    )
    if record["error_type"]:
        rl.error(
            f"{record['error_type']}: {record['error_message']} ({record['base_url']})", [api_key]
        )
        return rl.EXIT_FAILED
    rl.write_out(
        json.dumps(record, ensure_ascii=False) + "\n"
        if args.json
        else "".join(rl.printable(m) + "\n" for m in record["model_ids"])
    )
    return rl.EXIT_OK


def _print_answer(record, args):
    if args.json:
        rl.write_out(json.dumps(record, ensure_ascii=False) + "\n")
    elif record.get("text"):
        ending = "" if record["text"].endswith("\n") else "\n"
        rl.write_out(ending if args.stream else record["text"] + ending)


def main(argv=None):
    return rl.run_main(_build_parser(), argv, _run, {"proxy": "proxy.py"})


if __name__ == "__main__":
    sys.exit(main())
