#!/usr/bin/env python3
"""proxy.py -- a recording proxy for OpenAI-compatible APIs and Anthropic's Messages API: point any
agent at it, and every upstream attempt of every client is one model_call line in the ledger, as
ask.py writes it.

Usage:
  BASE_URL=... API_KEY=... python3 proxy.py [--listen HOST:PORT] [--ledger FILE]
  # then the agent's base URL is http://127.0.0.1:8787/v1 (MODEL_ID pins the model;
  # PROXY_TOKEN is the key clients must send, and is needed to listen beyond loopback;
  # Claude Code: ANTHROPIC_BASE_URL=http://127.0.0.1:8787; UPSTREAM_AUTH=x-api-key|bearer;
  # UPSTREAM_API=chat carries /v1/responses to an upstream that has chat completions only)

Routes: POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/messages,
/v1/messages/count_tokens; GET /v1/models; HEAD / (answered here).
Exit codes: 0 stopped by SIGTERM or SIGINT, 2 usage or configuration error. See docs/proxy.md.
"""

import argparse
import functools
import hashlib
import http.client
import json
import math
import os
import re
import select
import selectors
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

# the toolkit beside us, even under -I
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ask  # noqa: E402
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.1.0"
__all__ = ["main"]

# ----------------------------------------------------------------------------
# Constants and helpers
# ----------------------------------------------------------------------------


PROXY_ROUTES = {
    "/chat/completions": "POST",
    "/completions": "POST",
    "/responses": "POST",
    "/embeddings": "POST",
    "/messages": "POST",
    "/messages/count_tokens": "POST",
    "/models": "GET"
}
PROXY_LISTEN = "127.0.0.1:8787"
MAX_HEADER_CHARS = 200
_PROXY_OPTIONS = (  # flag, type, default, least value (None: above 0), help
    ("--max-body-bytes", int, 32 * 1024 * 1024, 1024, "the largest request body (past it, 413)"),
    (
        "--max-body-bytes-in-flight",
        int,
        64 * 1024 * 1024,
        1024,
        "request-body bytes held at once, all connections (past it, 503 with Retry-After)"
    ),
    ("--max-connections", int, 64, 1, "past this many at once, 503 with Retry-After"),
    ("--upstream-idle", int, 16, 0, "idle keep-alive connections kept per upstream host"),
    ("--grace", float, 10.0, 0, "seconds for the requests in flight at SIGTERM"),
    ("--idle-timeout", float, 15.0, None, "seconds a keep-alive connection may idle"),
    ("--read-timeout", float, 30.0, None, "seconds to read one request, head and body"),
    (
        "--timeout",
        float,
        600.0,
        None,
        "seconds for a whole upstream attempt, a long stream included"
    ),
    (
        "--max-response-bytes",
        int,
        ask.DEFAULT_MAX_RESPONSE_BYTES,
        1024,
        "the largest upstream body or stream"
    )
)
_PASS_BACK = (
    "content-type",
    "retry-after",
    "retry-after-ms",
    "x-request-id",
    "request-id",
    "openai-processing-ms"
)
# the stream ended by itself (an empty one too: relayed as it came, a 200 that ends)
_WHOLE_ERRORS = (None, "api_error", "malformed_response", "empty_content", "empty_stream")
_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    431: "headers_too_large"
}
# a bridged answer that came whole though its record faults it: completed, not failed
_BRIDGED_WHOLE = ("malformed_response", "empty_content")
_USAGE_ASKED = ("/chat/completions", "/completions")  # streams the proxy asks usage of
_LAST_EVENTS = ask.RESPONSE_DONE + ("message_stop",)  # held until the line is written


def _json_text(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _as_text(content):
    """A client's content as text: a string, content parts (text kept, others such as images named),
    null."""
    if content is None or type(content) is str:
        return content or ""
    if type(content) is not list:
        return _json_text(content)
    return "".join(
        (
            part["text"]
            if type(part) is dict and type(part.get("text")) is str
            else (
                _block_text(part)
                if type(part) is dict
                else part if type(part) is str else _json_text(part)
            )
        )
        for part in content
    )


def _client_messages(route, body):
    """(messages, token ids): a client's prompt as [{role, content}] text, and the ids of any token
    arrays."""
    tokens, items = 0, []
    if route == "/chat/completions":
        items = (
            body.get("messages") if type(body.get("messages")) is list else [body.get("messages")]
        )
    elif route == "/responses":
        if body.get("instructions") is not None:
            items.append({"role": "system", "content": body["instructions"]})
        given = body.get("input")
        items += given if type(given) is list else [{"role": "user", "content": given}]
    elif route.startswith("/messages"):
        items = [{"role": "system", "content": body["system"]}] if body.get("system") else []
        given = body.get("messages")
        items += given if type(given) is list else [given]
    else:
        given = body.get("prompt" if route == "/completions" else "input")
        given = given if type(given) is list else [given]
        for one in [given] if given and all(type(x) is int for x in given) else given:
            if type(one) is list and all(type(x) is int for x in one):
                tokens += len(one)
            else:
                items.append({"role": "user", "content": one})
    messages = []
    for item in [
        i if type(i) is dict else {"role": "user", "content": i} for i in items if i is not None
    ]:
        role = (
            item.get("role")
            if type(item.get("role")) is str
            else ("tool" if str(item.get("type", "")).endswith("_output") else "assistant")
        )
        calls = "".join(
            v if type(v) is str else _json_text(v)
            for k, v in item.items()
            if k in ("tool_calls", "function_call", "arguments", "output")
        )
        one = {
            "role": "system" if role == "developer" else role[:40],
            "content": _as_text(item.get("content")) + calls
        }
        # a message already in this shape is kept, not copied: a body of tiny ones costs half
        messages.append(item if item == one and list(item) == ["role", "content"] else one)
    return messages, tokens


# ----------------------------------------------------------------------------
# The conversation (--store-text): any route's messages and answer as (role, parts)
# ----------------------------------------------------------------------------

# Request headers that name a session, first found wins; recorded as session_source.
SESSION_HEADERS = ("X-Ledger-Session", "session-id", "X-Claude-Code-Session-Id")
MAX_CONVERSATIONS = 10000  # calls remembered to find the conversation a call extends
MAX_NAMED = 10000  # hashes a line names: the earliest messages past it are stored as one entry
_NAMED_ONCE = ("id", "call_id", "type", "name", "role", "index")  # a stream sends them whole


def _str(value):
    return value if type(value) is str else "" if value is None else _json_text(value)


def _parsed(text):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _part(block):
    """A content block, tool call or output item of chat, Responses or Anthropic as one part: text,
    tool_call, tool_result or reasoning. Transport keys (cache_control, signatures, ids of items)
    are left out, so a message hashes alike however a client decorates it."""
    if type(block) is not dict:
        return {"type": "text", "text": _str(block)}
    kind, call = block.get("type"), block.get("function")
    call = call if type(call) is dict else block
    if kind in ("function", "function_call", "tool_use", "custom_tool_call"):
        return {
            "type": "tool_call",
            "id": _str(block.get("call_id") or block.get("id")),
            "name": _str(call.get("name")),
            "arguments": _str(call.get("arguments", call.get("input")))
        }
    if kind in ("function_call_output", "tool_result", "custom_tool_call_output"):
        return {
            "type": "tool_result",
            "id": _str(block.get("call_id") or block.get("tool_use_id")),
            "text": _as_text(block.get("output", block.get("content")))
        }
    if kind in ("reasoning", "thinking"):
        pieces = [block.get("thinking")] + [
            piece.get("text")
            for key in ("summary", "content")
            if type(block.get(key)) is list
            for piece in block[key]
            if type(piece) is dict
        ]
        return {"type": "reasoning", "text": "\n".join(p for p in pieces if type(p) is str)}
    text = block.get("text", block.get("refusal"))
    return {"type": "text", "text": text if type(text) is str else f"[{_str(kind)[:40]}]"}


def _entry(item, role="user"):
    """One message or input item as (role, parts)."""
    if type(item) is not dict:
        return role, [_part(item)]
    kind, content, calls = item.get("type"), item.get("content"), item.get("tool_calls")
    if type(item.get("role")) is not str and kind not in (None, "message"):
        # a Responses item of its own: a call, its output, reasoning
        return ("tool" if str(kind).endswith("_output") else "assistant"), [_part(item)]
    role = item["role"][:40] if type(item.get("role")) is str else role
    parts = [
        _part(p)
        for p in (content if type(content) is list else [] if content in (None, "") else [content])
    ]
    if role == "tool":  # chat's tool result
        parts = [
            {"type": "tool_result", "id": _str(item.get("tool_call_id")), "text": _as_text(content)}
        ]
    reasoning = item.get("reasoning_content", item.get("reasoning"))
    if type(reasoning) is str and reasoning:
        parts.insert(0, {"type": "reasoning", "text": reasoning})
    parts += [_part(call) for call in (calls if type(calls) is list else [])]
    if type(item.get("function_call")) is dict:
        parts.append(_part(dict(item["function_call"], type="function_call")))
    return role, parts


def conversation(route, body):
    """A request's messages as [(role, parts)]: the system prompt or instructions first, then chat
    messages, Responses input items or Anthropic messages (a completion's prompt as one)."""
    if route == "/embeddings":
        return []
    system = body.get("system" if route.startswith("/messages") else "instructions")
    given = body.get({"/responses": "input", "/completions": "prompt"}.get(route, "messages"))
    given = [given] if route == "/completions" or type(given) is not list else given
    return [_entry({"role": "system", "content": system})] * (system not in (None, "", [])) + [
        _entry(item) for item in given if item is not None
    ]


class _Pieces(list):
    """A text that arrives in pieces, joined once at the end (joining as they come is quadratic)."""


def _join(into, delta):
    """A stream's delta added to what came before: text pieces kept, names kept once."""
    for key, value in delta.items() if type(delta) is dict else ():
        if type(value) is str and key in _NAMED_ONCE:
            into.setdefault(key, value)
        elif type(value) is str:
            into[key] = into[key] if type(into.get(key)) is _Pieces else _Pieces()
            into[key].append(value)


def _joined(one):
    return {k: "".join(v) if type(v) is _Pieces else v for k, v in one.items()}


class _Answer:
    """An answer's parts, built as its whole body or a stream's events come (add): chat's message
    or deltas, a completion's text, Responses output items, Anthropic content blocks."""

    def __init__(self):
        self.message, self.calls, self.blocks, self.items = {}, {}, {}, []

    def add(self, data):
        if type(data) is not dict:
            return
        kind, whole = data.get("type"), data.get("response")
        whole, choices = whole if type(whole) is dict else data, data.get("choices")
        if type(whole.get("output")) is list and whole["output"]:  # all of it: never twice
            self.items = whole["output"]
        elif kind == "response.output_item.done":
            self.items.append(data.get("item"))
        elif type(data.get("content")) is list:
            self.blocks = dict(enumerate(data["content"]))
        elif kind == "content_block_start" and type(data.get("content_block")) is dict:
            self.blocks[str(data.get("index"))] = dict(data["content_block"])
        elif kind == "content_block_delta":
            block = self.blocks.setdefault(str(data.get("index")), {"type": "text"})
            _join(block, data.get("delta"))
        elif kind == "response.output_text.delta":
            _join(self.message, {"content": data.get("delta")})
        elif type(choices) is list and choices and type(choices[0]) is dict:
            one = choices[0].get("message") or choices[0].get("delta")
            one = one if type(one) is dict else {"content": choices[0].get("text")}
            _join(self.message, one)
            given = one.get("tool_calls")
            for i, call in enumerate(given if type(given) is list else ()):
                if type(call) is dict:
                    done = self.calls.setdefault(str(call.get("index", i)), {})
                    _join(done, call)
                    _join(done.setdefault("function", {}), call.get("function"))

    def parts(self):
        if self.items:  # Responses: the items hold what the text deltas said
            return [p for item in self.items for p in _entry(item, "assistant")[1]]
        blocks = [_joined(b) if type(b) is dict else b for b in self.blocks.values()]
        for block in blocks:
            if type(block) is dict and "partial_json" in block:
                block["input"] = _parsed(block.pop("partial_json"))
        calls = [dict(_joined(c), function=_joined(c["function"])) for c in self.calls.values()]
        message = dict(_joined(self.message), tool_calls=calls)
        return [_part(block) for block in blocks] + _entry(message, "assistant")[1]


def answer(chunks):
    """The answer's parts from the whole body ([body]) or a stream's events (parsed)."""
    assembled = _Answer()
    for data in chunks:
        assembled.add(data)
    return assembled.parts()


def _passed_back(headers):
    return [
        (name, re.sub(r"[\r\n]", " ", value))
        for name, value in (headers.items() if headers is not None else ())
        if name.lower() in _PASS_BACK
        or name.lower().startswith(("x-ratelimit-", "anthropic-ratelimit-"))
    ]


def _error_json(message, code, kind="proxy_error"):
    return json.dumps(
        {"type": "error", "error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()


def _object(twice, pairs):
    """A JSON object of a client's body; a key it gives twice is noted in `twice`."""
    value = dict(pairs)
    if len(value) < len(pairs):
        twice.append(pairs)
    return value


class _Body(dict):
    """A client's JSON object: upstream it goes as the bytes it came in (`raw`) until changed."""

    raw = None

    def __setitem__(self, key, value):
        self.raw = None
        super().__setitem__(key, value)

    def pop(self, *args):
        self.raw = None
        return super().pop(*args)


class _ProxyServer(ask.CappedServer):
    """The settings, the one Ledger and a thread per connection, at most --max-connections (past
    that a 503)."""

    def __init__(self, address, args, upstream, token, auth=None):
        base_url, self.model, self.api_key = upstream
        self.auth = auth  # UPSTREAM_AUTH: None, "x-api-key" or "bearer"
        self.args, self.split, self.token = args, ask.split_base_url(base_url), token
        self.secrets = [s for s in (self.api_key, token) if s]
        self.book = rl.Ledger(
            args.ledger,
            os.environ.get("LEDGER_RUN_ID") or None,
            fsync=not args.no_fsync,
            secrets=self.secrets,
            signer=rl.env_signer()
        )
        ask.check_ledger(self.book)
        self.in_flight = 0  # request-body bytes admitted and not yet done with, under the lock
        # chained hashes of a call's messages -> its session, under the lock
        self.conversations = {}
        self.known = {}  # the hash of an entry as sent -> its name in the store (stored_text)
        self.watcher, self.refusals, self.pool = _Watcher(), rl.Bucket(), _Pool(args.upstream_idle)
        busy = ask.http_answer(
            503,
            _error_json("too many connections; retry later", "busy"),
            [("Retry-After", "1")],
            close=True
        )
        try:
            super().__init__(address, _ProxyHandler, args.max_connections, busy)
        except OSError as exc:
            raise ask.ConfigError(f"cannot listen on {args.listen}: {rl.error_text(exc)}") from None

    def hold(self, size):
        """Take `size` bytes of the body budget (a negative size gives them back): False if full."""
        with self.lock:
            if self.in_flight + size > self.args.max_body_bytes_in_flight:
                return False
            self.in_flight += size
            return True

    def conversation(self, texts):
        """The session of calls whose messages extend an earlier call's: `conv-` and a hash of the
        first call's messages."""
        keys, key = [], ""
        for name in texts:
            key = hashlib.sha256((key + name).encode()).hexdigest()
            keys.append(key)
        with self.lock:
            found = (self.conversations.get(k) for k in reversed(keys))
            session = next((s for s in found if s), "conv-" + key[:16])
            self.conversations[key] = session
            if len(self.conversations) > MAX_CONVERSATIONS:  # the oldest call goes
                del self.conversations[next(iter(self.conversations))]
        return session

    def stored_text(self, entry):
        """Ledger.store_text(entry), once: an agent sends every message again with each call, and
        masking them all each time would cost more than the call."""
        key = hashlib.sha256(repr(entry).encode("utf-8", "surrogatepass")).digest()
        name = self.known.get(key)
        if name is None:
            name = self.book.store_text(entry)
            with self.lock:
                self.known[key] = name
                if len(self.known) > MAX_CONVERSATIONS * 10:
                    del self.known[next(iter(self.known))]
        return name

    def append(self, kind, record):
        try:
            ask.append_record(self.book, kind, record)
        # the answer still goes to the client: a paid answer is never thrown away
        except ask.RecordError as exc:
            rl.error(str(exc), self.secrets)

    def refused(self, client_address, status=503, reason="too_many_connections", handler=None):
        """A client refused (by a check, or over --max-connections): a proxy_refused line, at the
        daemon's bounded rate (the next line written counts those left out). Never a header."""
        record = {"status": status, "reason": reason, "client_address": client_address[0]}
        if handler is not None and handler.method != "-":
            # the path without its query, where a key could ride
            record.update(method=handler.method[:16], path=handler.path.split("?")[0][:200])
        record = self.refusals.counted(record)
        if record is not None:
            self.append("proxy_refused", record)


class _ProxyHandler(ask.RequestHandler):
    """One client connection: requests in turn (keep-alive), each read under --read-timeout, then
    forwarded."""

    def handle(self):
        # each event goes out at once
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        args, self.close = self.server.args, False
        while not self.close and self._await_request():
            self.started, self.status = time.perf_counter(), None
            try:
                self._one_request()
            except OSError:  # the client went away: nothing to answer
                return
            finally:
                self.deadline.cancel()
            if args.verbose:
                path = self.server.book.redactor.text(self.path)[:200]
                print(
                    rl.printable(
                        f"proxy: {self.client_address[0]} {self.method} {path} {self.status} "
                        f"{ask.ms_since(self.started)} ms"
                    ),
                    file=sys.stderr,
                    flush=True
                )

    def _await_request(self):
        """Wait --idle-timeout for a request; at shutdown none (a request already sent gets its
        503)."""
        app = self.server
        with app.lock:  # stop() shuts the idle connections; one that comes later does not wait
            stopping = app.stopping
            app.idle.add(self.connection)
        try:
            self.connection.settimeout(0.0 if stopping else app.args.idle_timeout)
            return bool(self.rfile.peek(1))
        except OSError:
            return False
        finally:
            with app.lock:
                app.idle.discard(self.connection)

    def check(self):
        app, host = self.server, ask.host_name(self.headers.get("Host") or "")
        if app.stopping:
            self.close = True
            raise ask.Refused(
                503, "unavailable", "the proxy is shutting down", {"Retry-After": "1"}
            )
        key = self.headers.get("x-api-key")  # how Anthropic's clients send it
        given = self.headers.get("Authorization") if key is None else "Bearer " + key
        if app.token and not ask.bearer_ok(given, app.token):
            raise ask.Refused(401, "invalid_api_key", "the proxy token is required as the API key")
        if not app.token and not ask.is_loopback(host or ""):
            raise ask.Refused(
                403, "forbidden", "Host must be a loopback name (set PROXY_TOKEN to serve others)"
            )
        # what a web page sends: a browser names the page's origin, and a cross-site fetch
        origin = self.headers.get("Origin")
        if (
            origin is not None
            and not ask.is_loopback(ask.host_name(ask.origin_host(origin)) or "")
            or (self.headers.get("Sec-Fetch-Site") or "").strip().lower() == "cross-site"
        ):
            raise ask.Refused(403, "bad_origin", "requests from a web page's Origin are refused")

    def allowed(self, path):
        if path in _PROBES:
            return "HEAD"
        self.route = path[3:].rstrip("/") if path.startswith("/v1/") else None
        method = PROXY_ROUTES.get(self.route)
        if method == self.method == "POST":  # a 415 before the body is read: no simple POST
            ask.require_json(self.headers)
        return method

    def admit(self, length):
        # the parsed body and its record cost many times its bytes: the budget bounds the memory
        if not self.server.hold(length):
            raise ask.Refused(
                503, "busy", "too many request bytes in flight; retry later", {"Retry-After": "1"}
            )
        self.held = length

    def _one_request(self):
        self.held = 0
        try:
            self._read_and_call(self.server.args)
        finally:
            self.server.hold(-self.held)
            self.server.watcher.forget(self.connection)

    def _read_and_call(self, args):
        try:
            raw = self.read_request(args.read_timeout, args.max_body_bytes)
        # nothing was sent upstream
        except ask.Refused as refused:
            code = refused.reason or _CODES.get(refused.status) or "invalid_request"
            self.server.refused(self.client_address, refused.status, code, self)
            return self._error(refused.status, refused.message, code, refused.headers)
        # the body is in: from here the upstream's deadline bounds the request
        self.deadline.cancel()
        self.connection.settimeout(args.timeout + args.read_timeout)
        if self.method == "HEAD":  # a client's probe: answered here, neither sent on nor recorded
            return self._send(200, b"")
        return self._models() if self.route == "/models" else self._call(self.route, raw)

    def _record(self, route, model, stream, attempt, messages, tokens, body):
        """The record of one upstream attempt: a direct call's, plus the client's route, address and
        headers."""
        number = body.get("temperature")
        limits = [body.get(k) for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")]
        limits = [n for n in limits if type(n) is int and 0 < n < 2**63]
        record = ask.call_record(
            model,
            self.server.split,
            stream,
            messages,
            {
                "temperature": (
                    number if type(number) in (int, float) and abs(number) < math.inf else None
                ),
                "max_tokens": limits[0] if limits else None
            },
            attempt
        )
        if tokens:
            record["est_input_tokens"] += tokens
            record["est_method"] = ask.EST_METHOD + " + token ids counted"
        retry, texts = self.headers.get("x-stainless-retry-count") or "", self.texts
        header = next((name for name in SESSION_HEADERS if self.headers.get(name)), None)
        session = (
            (self.headers[header][:MAX_HEADER_CHARS], header.lower())
            if header
            else (self.server.conversation(texts), "conversation") if texts else (None, None)
        )
        record.update(
            route=route,
            client_address=self.client_address[0],
            user_agent=(self.headers.get("User-Agent") or "")[:MAX_HEADER_CHARS] or None,
            session_id=session[0],
            session_source=session[1],
            client_retry=int(retry) if retry.isdigit() and len(retry) < 10 else None
        )
        if texts is not None:
            record["messages_text"] = texts
        return record

    def _store(self, entries):
        """--store-text: each (role, parts) once in the text store, before the line naming it; their
        hashes, or None when the store cannot be written (the call goes on; one error line). Past
        MAX_NAMED the earliest are one entry: a line holds at most 1 MiB."""
        if len(entries) > MAX_NAMED:
            cut = len(entries) - MAX_NAMED + 1
            earlier = [
                [{"type": "text", "text": f"[{role}]"}] + parts for role, parts in entries[:cut]
            ]
            entries = [("earlier", [p for parts in earlier for p in parts])] + entries[cut:]
        try:
            return [self.server.stored_text({"role": r, "parts": p}) for r, p in entries]
        except (OSError, RecursionError) as exc:
            rl.error(f"the text store: {rl.error_text(exc)}", self.server.secrets)
            return None

    def _answer_text(self, _text, state):
        """--store-text: the answer, whole (its body) or streamed (the relay's events), stored."""
        parts = answer([_parsed(state["raw"])]) if "raw" in state else self.relay.answer.parts()
        stored = self._store([("assistant", parts)]) if parts else None
        return stored and stored[0]

    def _parse(self, route, raw):
        """The body, its messages for the record and --store-text's entries, or why it is
        refused."""
        try:
            twice = []  # a key given twice: re-encoded, upstream reads what the record says
            body = json.loads(
                raw.decode("utf-8"), object_pairs_hook=functools.partial(_object, twice)
            )
            if type(body) is not dict:
                raise ValueError("not a JSON object")
            # pinned, the body is re-encoded too: the model checked is the one sent
            body, body.raw = _Body(body), None if self.server.model or twice else raw
            if route.startswith("/messages"):
                body.take = _take_messages
            messages, tokens = _client_messages(route, body)
            entries = conversation(route, body) if self.server.args.store_text else []
            return body, messages, tokens, entries, None
        except (ValueError, RecursionError) as exc:
            refused = ask.CallFailed(
                "invalid_request", f"the request body cannot be read: {str(exc)[:200]}"
            )
            return {}, [], 0, [], refused

    def _call(self, route, raw):
        app, self.relay = self.server, _Relay(self, False, False)
        body, messages, tokens, entries, refused = self._parse(route, raw)
        model = body.get("model")
        if refused is None and (type(model) is not str or not model):
            refused = ask.CallFailed("model_missing", "the request has no model")
        elif refused is None and app.model and model != app.model:
            refused = ask.CallFailed(
                "model_not_allowed", f"this proxy serves {app.model!r} only, not {model[:200]!r}"
            )
        model = model[: ask.MAX_FIELD_CHARS] if type(model) is str and model else app.model or ""
        stream = bool(body.get("stream"))
        bridge, refused = _Bridge.of(app.args, route, body, refused)
        self.texts = self._store(entries) if app.args.store_text else None  # named by _record
        new_record = functools.partial(
            self._record, route, model, stream, messages=messages, tokens=tokens, body=body
        )
        if refused is not None:  # recorded, with no HTTP status: nothing was sent
            record = new_record(1)
            ask.finish(record, self.started, None, refused, [], app.book.redactor)
            app.append("model_call", record)
            return self._error(
                400, refused.message, refused.error_type, kind="invalid_request_error"
            )
        if bridge is not None:
            return bridge.call(self, new_record)
        options = body.get("stream_options") if type(body.get("stream_options")) is dict else {}
        injected = stream and route in _USAGE_ASKED and options.get("include_usage") is not True
        if injected:
            body["stream_options"] = dict(options, include_usage=True)
        url = ask.endpoint(app.split[0], route)
        query = self.path.partition("?")[2]  # ?beta=true goes on as it came
        result, failure, state, out = ask.attempts(
            url + ("&" if "?" in url else "?") + query if query else url,
            body,
            new_record,
            app.append,
            api_key=self._upstream_headers(route),
            timeout=app.args.timeout,
            limit=app.args.max_response_bytes,
            redactor=app.book.redactor,
            relay=functools.partial(_Relay, self, injected, stream),
            tools_answer=True,
            store=self._answer_text if app.args.store_text else None,
            opener=app.pool.open
        )
        app.hold(-self.held)  # the line is written: the body's bytes are given back
        self.held = 0
        return self._answer(result, failure, state, out)

    def _answer(self, record, failure, state, out):
        """Once the line is written: the answer's last byte or event, the upstream's error, or 502;
        nothing to a client gone."""
        kind = failure and failure.error_type
        if kind == "client_gone":
            self.close = True
            return None
        if out is not None and (out.began or kind in (None, "empty_stream")):
            return out.end(kind in _WHOLE_ERRORS)
        if "raw" in state:  # a body that parsed goes back as it is, whatever the record says of it
            return self._send(state["status"], state["raw"], _passed_back(state["headers"]))
        if failure.body is not None and failure.status >= 400:
            body = failure.body.replace(self.server.api_key.encode(), rl.REDACTED.encode())
            return self._send(failure.status, body, _passed_back(failure.headers))
        return self._error(502, f"upstream: {record['error_message']}", record["error_type"])

    def _models(self):
        app = self.server
        record, raw, failure, headers = ask.models_call(
            app.book.redactor,
            app.split,
            self._upstream_headers("/models"),
            app.args.timeout,
            app.args.max_response_bytes
        )
        app.append("models_list", record)
        return self._answer(
            record, failure, {"raw": raw, "status": 200, "headers": headers} if raw else {}, None
        )

    def _upstream_headers(self, route):
        """The proxy's key as UPSTREAM_AUTH says (by default x-api-key on /messages, else bearer),
        and the Anthropic headers the client sent; the client's own key is never among them."""
        auth = self.server.auth or ("x-api-key" if route.startswith("/messages") else "bearer")
        key = self.server.api_key
        headers = {"x-api-key": key} if auth == "x-api-key" else {"Authorization": "Bearer " + key}
        for name in _ANTHROPIC_HEADERS:
            value = self.headers.get(name)
            if value is not None and re.fullmatch(r"[\x20-\x7e]*", value):
                headers[name] = value
        return headers

    def _send(self, status, body, headers=(), chunked=False):
        self.status = status
        self.wfile.write(ask.http_answer(status, body, headers, close=self.close, chunked=chunked))

    def _error(self, status, message, code, headers=None, kind="proxy_error"):
        self._send(status, _error_json(message, code, kind), list((headers or {}).items()))


_GONE = ask.CallFailed("client_gone", "the client closed the connection before its answer ended")


class _Relay:
    """The client's side of one attempt: the answer goes out as it arrives (a stream's events,
    chunked; a whole body once it parses), but its last event or byte waits for the ledger line.
    The usage chunk the proxy asked for is dropped. A client that leaves stops the attempt: its
    connection closed (the watcher sees it) or a write that fails."""

    def __init__(self, handler, injected, stream):
        self.handler, self.injected, self.stream, self.began, self.held = (
            handler,
            injected,
            stream,
            False,
            []
        )
        self.answer = _Answer() if handler.server.args.store_text else None
        handler.relay = self  # its answer is --store-text's

    def start(self, deadline, state):
        self.deadline, self.state = deadline, state
        self.handler.server.watcher.watch(self.handler.connection, self.gone)

    def gone(self):
        self.deadline.expire(_GONE)  # once the attempt is over, nothing

    def __call__(self, raw, chunk):
        if not self.stream:  # a whole body: all but its last byte
            answer = self._head(raw)
            self.held = [answer[-1:]]
            return self._out(answer[:-1])
        if self.answer is not None:
            self.answer.add(chunk)
        if (
            chunk is None
            and raw.rstrip().endswith(b"[DONE]")
            or chunk
            and chunk.get("type") in _LAST_EVENTS
        ):
            # read at its line
            self.held.append(raw if raw.endswith((b"\n\n", b"\r\n\r\n")) else raw + b"\n")
        elif not (
            self.injected
            and chunk
            and chunk.get("choices") == []
            and chunk.get("usage") is not None
        ):
            self._write(raw)

    def _head(self, body):
        self.handler.status = self.state["status"]
        return ask.http_answer(
            self.state["status"],
            body,
            _passed_back(self.state["headers"]),
            close=self.handler.close,
            chunked=self.stream
        )

    def _write(self, raw):
        """One event, chunked (the head first)."""
        self._out(
            (b"" if self.began else self._head(b""))
            + (b"%x\r\n%s\r\n" % (len(raw), raw) if raw else b"")
        )

    def _out(self, data):
        self.began = True
        try:
            self.handler.wfile.write(data)
        except OSError:
            self.handler.close = True
            self.gone()

    def end(self, whole):
        """Send what was held; a whole stream ends cleanly, a broken one by closing the
        connection."""
        if not self.stream:
            return self._out(self.held[0])
        for raw in self.held + [b""]:
            self._write(raw)
        self._out(b"0\r\n\r\n" if whole else b"")
        self.handler.close = self.handler.close or not whole
        return None


class _Watcher:
    """One thread watches the client connection of every attempt in flight: a client that closes
    or resets it stops its attempt at once (client_gone), and the upstream request is cut."""

    def __init__(self):
        self.selector, self.lock, self.peers = selectors.DefaultSelector(), threading.Lock(), {}
        self.idle = socket.socketpair()  # registered, never ready: no selector is ever empty
        self.selector.register(self.idle[0], selectors.EVENT_READ)
        threading.Thread(target=self._run, name="client-watch", daemon=True).start()

    def watch(self, sock, gone):
        """gone() once the client closes `sock`, until forget(sock)."""
        self.forget(sock)
        peer = sock.dup()  # non-blocking: a peek never waits, whatever the timeout of `sock`
        peer.setblocking(False)
        with self.lock:
            self.peers[sock] = peer
            self.selector.register(peer, selectors.EVENT_READ, gone)

    def forget(self, sock):
        with self.lock:
            peer = self.peers.pop(sock, None)
            if peer is not None:
                if self.selector.get_map().get(peer) is not None:
                    self.selector.unregister(peer)
                peer.close()

    def _run(self):
        while True:
            for key, _events in self.selector.select(1.0):  # the timeout: a late registration
                try:
                    gone = not key.fileobj.recv(1, socket.MSG_PEEK)
                except BlockingIOError:
                    continue
                except OSError:  # reset, or forgotten meanwhile
                    gone = True
                with self.lock:  # a client that sent more is still there: no longer watched
                    if self.selector.get_map().get(key.fd) is key:
                        self.selector.unregister(key.fd)
                if gone and key.data is not None:
                    key.data()


# ----------------------------------------------------------------------------
# The upstream's connections: kept alive, at most --upstream-idle idle per (scheme, host, port)
# ----------------------------------------------------------------------------

# what reading a stream's end (its last chunk, after the last event) may cost to keep its socket
DRAIN_S, DRAIN_BYTES = 0.5, 65536


class _Use:
    """One attempt's hold on a connection: what its Deadline watches and shuts, until end(). A
    finished attempt's Deadline must never shut the socket a later attempt holds."""

    def __init__(self, pool, conn, deadline):
        self.pool, self.conn, self.sock, self.deadline = pool, conn, conn.sock, deadline
        self.lock = threading.Lock()

    def shutdown(self, how):
        with self.lock:
            if self.sock is not None:  # the fd, under TLS too: its reader sees the end
                try:
                    socket.socket.shutdown(self.sock, how)
                except OSError:
                    pass

    def end(self):
        with self.lock:
            self.sock = None


class _Response(ask._Answer):
    """An upstream answer that gives its connection back to the pool once closed, if its body was
    read to the end and nothing came after it. A stream read to its last event has its last chunk
    read at close (at most DRAIN_S, DRAIN_BYTES)."""

    use = None

    def _close_conn(self):  # the body's end: its reader is kept, to see any byte past it
        self.rest, self.fp = self.fp, None

    def _read_and_discard_trailer(self):  # a chunked body ended, as a Content-Length one: length 0
        super()._read_and_discard_trailer()
        self.length = 0

    def close(self):
        use, self.use = self.use, None
        if use and self.fp and not (self.will_close or use.deadline.expired):
            drain = ask.Deadline(DRAIN_S)  # past it the socket is shut, and not kept
            drain.watch(use)
            try:
                self.read(DRAIN_BYTES)
            except (OSError, http.client.HTTPException):
                pass
            drain.cancel()
        super().close()
        if use:
            use.pool.release(use, self)


def _quiet(sock, reader=None):
    """Nothing to read on an idle connection: a byte there (or past a body, in `reader`) is the
    upstream's close or stray bytes, and the connection is not used again."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    if poll.poll(0) or getattr(sock, "pending", int)():  # TLS: bytes decrypted, not yet read
        return False
    sock.settimeout(0.0)
    try:
        return not (reader and reader.peek(1))
    except OSError as exc:  # TLS says "nothing yet" by raising
        import ssl

        return isinstance(exc, ssl.SSLWantReadError)


class _Pool:
    """ask.http_open's contract over kept connections: open() returns the response of a 2xx and
    raises HTTPError for anything else (a 3xx too: never a redirect). A connection is used again
    only when idle and quiet, so a request is never sent twice; an upstream behind a proxy from the
    environment goes through http_open."""

    def __init__(self, bound):
        self.bound, self.lock, self.idle, self.sessions, self.direct = (
            bound,
            threading.Lock(),
            {},
            {},
            {}
        )

    def open(self, request, deadline, timeout=None):
        key, seconds = (request.type, request.host), timeout or deadline.remaining()
        if key not in self.direct:
            proxies = urllib.request.getproxies()
            self.direct[key] = not (
                (proxies.get(key[0]) or proxies.get("all"))
                and not urllib.request.proxy_bypass(key[1])
            )
        if not self.direct[key]:
            return ask.http_open(request, deadline, timeout)
        conn = self._take(key)
        fresh = conn is None
        if fresh:
            conn = http.client.HTTPConnection(key[1], timeout=seconds)
            conn.response_class, conn.key = _Response, key
            conn.connect()
            if key[0] == "https":  # the session of an earlier connection resumed where it can be
                conn.sock = ask._tls_context().wrap_socket(
                    conn.sock,
                    server_hostname=conn.host,
                    session=self.sessions.get(key),
                    do_handshake_on_connect=False
                )
        use = deadline.watch(_Use(self, conn, deadline))
        try:
            conn.sock.settimeout(seconds)
            if fresh and key[0] == "https":
                conn.sock.do_handshake()
            conn.request(
                request.get_method(), request.selector, request.data, dict(request.header_items())
            )
            response = conn.getresponse()
        except (OSError, http.client.HTTPException):
            use.end()
            conn.close()
            raise
        response.use = use
        if 200 <= response.status < 300:
            return response
        raise urllib.error.HTTPError(
            request.full_url, response.status, response.reason, response.headers, response
        )

    def _take(self, key):
        while True:
            with self.lock:
                idle = self.idle.get(key)
                conn = idle.pop() if idle else None
            if conn is None or _quiet(conn.sock):
                return conn
            conn.close()

    def release(self, use, response):
        """Keep the connection of a response read to its end, not cut, nothing after it."""
        sock, conn, rest = use.sock, use.conn, response.rest
        use.end()
        session = getattr(sock, "session", None)  # TLS: resumed by the next new connection
        keep = (
            response.length == 0
            and not (response.will_close or use.deadline.expired)
            and _quiet(conn.sock, rest)
        )
        if rest:
            rest.close()
        with self.lock:
            if session is not None:
                self.sessions[conn.key] = session
            idle = self.idle.setdefault(conn.key, [])
            if keep and len(idle) < self.bound:
                idle.append(conn)
                return
        conn.close()


# ----------------------------------------------------------------------------
# Anthropic's Messages API: /v1/messages (plain and streamed) and /v1/messages/count_tokens
# ----------------------------------------------------------------------------

_PROBES = ("/", "/api/hello")  # HEAD: a client's reachability check (Claude Code's preconnect)
_ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")  # passed on as the client sent them
# the events _take_messages reads itself; any other (error, ping) is ask._take's
_MESSAGE_EVENTS = (
    "message",
    "message_start",
    "content_block_start",
    "content_block_delta",
    "message_delta",
    "message_stop"
)
_USAGE_KEYS = (
    "input_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "output_tokens"
)


def _block_text(part):
    """A content part that is not text: an Anthropic tool call's input, a tool result, thinking;
    any other (an image) is named."""
    if "input" in part:
        return _json_text(part["input"])
    if "content" in part:
        return _as_text(part["content"])
    if type(part.get("thinking")) is str:
        return part["thinking"]
    return f"[{str(part.get('type', 'part'))[:40]}]"


def _usage(seen):
    """Anthropic's usage in the fields ask.parse_usage reads. Its input_tokens leaves out the cached
    input, read or written; the record counts it in, as OTel's GenAI conventions do, and
    total_tokens, which Anthropic does not report, is input plus output."""
    fresh, read, made, out = (
        seen.get(k) if type(seen.get(k)) is int and seen[k] >= 0 else None for k in _USAGE_KEYS
    )
    given = fresh if fresh is None else fresh + (read or 0) + (made or 0)
    return {
        "prompt_tokens": given,
        "completion_tokens": out,
        "total_tokens": None if None in (given, out) else given + out,
        "prompt_tokens_details": {"cached_tokens": read}
    }


def _take_messages(record, data, key, state, problems, status, headers):
    """A Messages API answer into `record` and `state`, as ask._take reads OpenAI's: the whole
    message (key "message"), one stream event ("delta") or count_tokens' answer. Returns the text
    its blocks add: text, thinking and tool input, which all count as output."""
    kind = data.get("type")
    if key == "message" and kind is None and "input_tokens" in data:  # count_tokens
        # input tokens only, complete usage, as for embeddings
        state.update(usage={"prompt_tokens": data["input_tokens"]}, tools=True, embedding=True)
        return None
    if kind not in _MESSAGE_EVENTS:
        return ask._take(record, data, key, state, problems, status, headers)
    message = data.get("message") if kind == "message_start" else data
    message = message if type(message) is dict else {}
    if kind in ("message", "message_start"):
        ask._fill_ids(record, message, problems)
    got = message.get("usage")
    if type(got) is dict:  # message_start's, then message_delta's, the later count winning
        seen = state.setdefault("anthropic_usage", {})
        seen.update((k, got[k]) for k in _USAGE_KEYS if got.get(k) is not None)
        state["usage"] = _usage(seen)
        made = seen.get("cache_creation_input_tokens")
        if type(made) is int and made >= 0:
            record["cache_creation_input_tokens"] = made
    delta = data.get("delta") if type(data.get("delta")) is dict else {}
    if kind == "message" or delta.get("stop_reason") is not None:
        record["finish_reason"] = ask._server_text(
            message.get("stop_reason", delta.get("stop_reason")),
            "stop_reason",
            problems,
            ask.MAX_FIELD_CHARS
        )
    state["done"] = state.get("done") or kind == "message_stop"
    blocks = message.get("content") if kind == "message" else [data.get("content_block"), delta]
    blocks = [b for b in blocks if b is not None] if type(blocks) is list else []
    texts = []
    for block in blocks:
        if type(block) is not dict:
            problems.append(f"a content block is a {type(block).__name__}, not an object")
            continue
        state["tools"] = state.get("tools") or block.get("type") == "tool_use"
        if key == "message" and block.get("type") == "tool_use":
            texts.append(_json_text(block.get("input")))
        texts += [
            block[k] for k in ("text", "thinking", "partial_json") if type(block.get(k)) is str
        ]
    return "".join(texts)


# ----------------------------------------------------------------------------
# The Responses bridge: with UPSTREAM_API=chat, /responses goes upstream as chat completions
# ----------------------------------------------------------------------------

# Responses options that chat completions names too, and their chat names
_BRIDGE_OPTIONS = {
    "max_output_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "parallel_tool_calls": "parallel_tool_calls",
    "tool_choice": "tool_choice"
}


def _field(obj, key, kind=str):
    """obj[key] when obj is an object and the value a `kind`, else an empty `kind`: what a client or
    an upstream sends cannot break the translation."""
    value = obj.get(key) if type(obj) is dict else None
    return value if type(value) is kind else kind()


def _chat_tools(tools, spaces):
    """(chat tools, number dropped): function tools kept, a namespace's flattened (their names
    noted in `spaces`), hosted web_search* tools dropped; any other kind is refused."""
    out, dropped = [], 0
    for tool in tools if type(tools) is list else []:
        kind = _field(tool, "type")
        if kind == "namespace":
            inner, more = _chat_tools(tool.get("tools"), spaces)
            spaces.update((t["function"]["name"], _field(tool, "name")) for t in inner)
            out, dropped = out + inner, dropped + more
        elif kind == "function":
            keep = {k: tool[k] for k in ("description", "parameters", "strict") if k in tool}
            out.append({"type": "function", "function": dict(keep, name=_field(tool, "name"))})
        elif kind.startswith("web_search"):
            dropped += 1
        else:
            raise ask.CallFailed(
                "unsupported_tool",
                f"a {kind[:40]!r} tool cannot run on a chat-completions upstream "
                "(UPSTREAM_API=chat)"
            )
    return out, dropped


def _chat_messages(body):
    """(chat messages, reasoning items dropped) of the instructions and input items; an assistant
    message and the function calls after it are one message, system and developer parts in a row
    one system message."""
    messages, dropped, given = [], 0, body.get("input")
    items = given if type(given) is list else [{"role": "user", "content": given}]
    for item in [{"role": "system", "content": body.get("instructions")}] + items:
        item = item if type(item) is dict else {"content": item}
        kind, last = _field(item, "type") or "message", messages[-1] if messages else {}
        role = {"developer": "system"}.get(_field(item, "role"), _field(item, "role") or "user")
        if kind == "message" and not item.get("content") and role == "system":
            continue  # Codex sends null instructions and its prompt as developer items
        if kind == "message" and role == last.get("role") == "system":
            last["content"] += "\n\n" + _as_text(item.get("content"))
        elif kind == "message":
            messages.append({"role": role, "content": _as_text(item.get("content"))})
        elif kind == "function_call":
            if last.get("role") != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(
                {
                    "id": _field(item, "call_id"),
                    "type": "function",
                    "function": {
                        "name": _field(item, "name"),
                        "arguments": _field(item, "arguments")
                    }
                }
            )
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _field(item, "call_id"),
                    "content": _as_text(item.get("output"))
                }
            )
        elif kind == "reasoning":
            dropped += 1
        else:
            raise ask.CallFailed(
                "unsupported_input",
                f"an input item of type {kind[:40]!r} cannot go to a chat-completions upstream"
            )
    return messages, dropped


class _Output:
    """An answer as Responses output items, from a whole chat message or a stream's deltas."""

    def __init__(self, spaces):
        self.spaces, self.items, self.calls, self.message, self.text = spaces, [], {}, None, ""

    def add(self, message):
        """A chat message or delta into the items; returns the events it makes, (type, body)."""
        events, text = [], _field(message, "content")
        if text:
            if self.message is None:
                self.message = self._open(
                    {"type": "message", "role": "assistant", "content": []}, events
                )
            self.text += text
            events.append(("response.output_text.delta", self._at(self.message, delta=text)))
        for n, call in enumerate(_field(message, "tool_calls", list)):
            index = call.get("index") if type(call) is dict else n  # a whole message's have none
            index, function = index if type(index) is int else n, _field(call, "function", dict)
            item = self.calls.get(index)
            if item is None:
                name = _field(function, "name")
                item = self.calls[index] = self._open(
                    {
                        "type": "function_call",
                        "call_id": _field(call, "id") or f"call_{len(self.items)}",
                        "name": name,
                        "arguments": ""
                    },
                    events
                )
                if name in self.spaces:
                    item["namespace"] = self.spaces[name]
            piece = _field(function, "arguments")
            item["arguments"] += piece
            if piece:
                events.append(
                    ("response.function_call_arguments.delta", self._at(item, delta=piece))
                )
        return events

    def _open(self, item, events):
        item.update(id=f"{item['type'][:2]}_{len(self.items)}", status="in_progress")
        self.items.append(item)
        events.append(("response.output_item.added", self._at(item, item=dict(item))))
        return item

    def _at(self, at, **more):
        return dict(more, item_id=at["id"], output_index=self.items.index(at), content_index=0)

    def done(self):
        """The events that close every item."""
        if self.message is not None:
            self.message["content"] = [
                {"type": "output_text", "text": self.text, "annotations": []}
            ]
        events = []
        for item in self.items:
            item["status"] = "completed"
            if item["type"] == "function_call":
                events.append(
                    (
                        "response.function_call_arguments.done",
                        self._at(item, arguments=item["arguments"])
                    )
                )
            events.append(("response.output_item.done", self._at(item, item=item)))
        return events


def _events(events):
    return b"".join(
        f"event: {kind}\ndata: {_json_text(dict(body, type=kind))}\n\n".encode()
        for kind, body in events
    )


class _Bridge:
    """One Responses request carried to a chat-completions upstream, and its answer back."""

    @classmethod
    def of(cls, args, route, body, refused):
        """(bridge or None, refusal): a request the bridge cannot carry is refused (400), unsent."""
        if refused is not None or route != "/responses" or args.upstream_api != "chat":
            return None, refused
        try:
            return cls(body), None
        except ask.CallFailed as exc:
            return None, exc

    def __init__(self, body):
        self.spaces, self.id = {}, "resp_" + os.urandom(12).hex()
        messages, reasoning = _chat_messages(body)
        tools, dropped = _chat_tools(body.get("tools"), self.spaces)
        self.chat = {
            "model": body["model"],
            "messages": messages,
            "stream": bool(body.get("stream"))
        }
        self.chat.update(
            (new, body[old]) for old, new in _BRIDGE_OPTIONS.items() if body.get(old) is not None
        )
        choice = body.get("tool_choice")
        if _field(choice, "type") == "function":
            self.chat["tool_choice"] = {
                "type": "function",
                "function": {"name": choice.get("name")}
            }
        if tools:
            self.chat["tools"] = tools
        else:  # chat servers refuse these without tools
            for key in ("tool_choice", "parallel_tool_calls"):
                self.chat.pop(key, None)
        if self.chat["stream"]:
            self.chat["stream_options"] = {"include_usage": True}
        self.fields = {
            "upstream_route": "/chat/completions",
            "tools_dropped": dropped,
            "reasoning_dropped": reasoning
        }

    def response(self, record, output, status):
        """The Responses object: in progress (no record yet), completed (incomplete when the
        upstream stopped at max_tokens) or failed."""
        record = record or dict.fromkeys(("response_model", "request_model", "usage_reported"))
        cut = status == "completed" and record.get("finish_reason") == "length"
        usage = {
            "input_tokens": record.get("input_tokens") or 0,
            "input_tokens_details": {"cached_tokens": record.get("cached_input_tokens") or 0},
            "output_tokens": record.get("output_tokens") or 0,
            "output_tokens_details": {
                "reasoning_tokens": record.get("reasoning_output_tokens") or 0
            },
            "total_tokens": record.get("total_tokens") or 0
        }
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if cut else status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": record["response_model"] or record["request_model"] or self.chat["model"],
            "output": output.items,
            "usage": usage if record["usage_reported"] else None,
            "error": (
                None
                if status != "failed"
                else {"code": record["error_type"], "message": record["error_message"]}
            )
        }

    def call(self, handler, new_record):
        app = handler.server
        record, failure, state, out = ask.attempts(
            ask.endpoint(app.split[0], "/chat/completions"),
            self.chat,
            lambda attempt: dict(new_record(attempt), **self.fields),
            app.append,
            api_key=app.api_key,
            timeout=app.args.timeout,
            limit=app.args.max_response_bytes,
            redactor=app.book.redactor,
            relay=functools.partial(_BridgeStream, handler, self) if self.chat["stream"] else None,
            tools_answer=True,
            store=handler._answer_text if app.args.store_text else None,
            opener=app.pool.open
        )
        if out is not None and (out.began or failure is None):
            return out.finish(record, failure)
        if "raw" in state and (failure is None or failure.error_type in _BRIDGED_WHOLE):
            output = _Output(self.spaces)
            choices = _field(json.loads(state["raw"]), "choices", list)
            output.add(_field(choices[0] if choices else {}, "message", dict))
            output.done()
            body = self.response(record, output, "completed")
            return handler._send(200, _json_text(body).encode())
        return handler._answer(record, failure, {}, None)


class _BridgeStream(_Relay):
    """A chat stream written to the client as Responses events as it arrives; the last one,
    response.completed or response.failed, once the line is written."""

    def __init__(self, handler, bridge):
        super().__init__(handler, True, True)
        self.bridge, self.output = bridge, _Output(bridge.spaces)

    def _start(self):
        """response.created, before anything is sent (the Content-Type is the proxy's)."""
        if self.began:
            return []
        headers = self.state["headers"] or {}
        self.state["headers"] = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        return [
            (
                "response.created",
                {"response": self.bridge.response(None, self.output, "in_progress")}
            )
        ]

    def __call__(self, raw, chunk):
        if self.answer is not None:
            self.answer.add(chunk)
        events = self._start()
        for choice in _field(chunk, "choices", list):
            if _field(choice, "index", int) == 0:
                events += self.output.add(_field(choice, "delta", dict))
        self._write(_events(events))

    def finish(self, record, failure):
        whole = failure is None or failure.error_type in _BRIDGED_WHOLE
        status = "completed" if whole else "failed"
        events = self._start() + (self.output.done() if whole else [])
        body = self.bridge.response(record, self.output, status)
        events.append(("response." + body["status"], {"response": body}))
        self.held = [_events(events)]
        self.end(True)


def _proxy_parser():
    p = rl.ArgumentParser(
        prog="proxy.py",
        description="A recording proxy for OpenAI-compatible APIs and Anthropic's Messages API: "
        "BASE_URL and API_KEY upstream (MODEL_ID optional: pins the model; PROXY_TOKEN optional: "
        "the clients' key; UPSTREAM_AUTH optional: x-api-key or bearer; UPSTREAM_API=chat: "
        "/responses carried to chat completions), "
        "one model_call line per upstream attempt. See docs/proxy.md.",
        epilog=rl.exit_codes_epilog(rl.EXIT_OK, rl.EXIT_USAGE),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--listen",
        default=PROXY_LISTEN,
        metavar="HOST:PORT",
        help=f"default {PROXY_LISTEN}; port 0 " "picks a free one"
    )
    p.add_argument("--ledger", help=f"default $LEDGER, then ./{ask.DEFAULT_LEDGER}")
    for flag, kind, default, _least, text in _PROXY_OPTIONS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="lines reach the kernel before the answer (kill -9 "
        "loses none) but are not forced to disk one by one"
    )
    p.add_argument(
        "--store-text",
        action="store_true",
        help="keep the conversation: each message and answer, masked, once in LEDGER.text/"
    )
    p.add_argument("--verbose", action="store_true", help="one line per request on stderr")
    return p


def _run_proxy(args):
    import signal

    args.ledger = args.ledger or os.environ.get("LEDGER") or ask.DEFAULT_LEDGER
    upstream, token = ask.settings_from_env(need_model=False), os.environ.get("PROXY_TOKEN") or None
    if token is not None and not re.fullmatch(r"[\x21-\x7e]+", token):
        raise ask.ConfigError(
            "PROXY_TOKEN must be printable ASCII without spaces (the token is not shown)"
        )
    for flag, _kind, _default, least, _text in _PROXY_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        ask.check_number(flag, value, minimum=least, above=0 if least is None else None)
    match = re.fullmatch(r"\[?([^\[\]]*?)\]?:([0-9]{1,5})", args.listen)
    if not match or int(match.group(2)) > 65535:
        raise ask.ConfigError(f"--listen must be HOST:PORT, not {args.listen!r}")
    host, port = match.group(1), int(match.group(2))
    if args.max_body_bytes_in_flight < args.max_body_bytes:
        raise ask.ConfigError("--max-body-bytes-in-flight must be at least --max-body-bytes")
    if token is None and not ask.is_loopback(host):
        raise ask.ConfigError(
            f"--listen {host}: set PROXY_TOKEN to listen on anything but loopback"
        )
    auth = os.environ.get("UPSTREAM_AUTH") or None
    if auth not in (None, "x-api-key", "bearer"):
        raise ask.ConfigError(f"UPSTREAM_AUTH must be x-api-key or bearer, not {auth[:40]!r}")
    args.upstream_api = os.environ.get("UPSTREAM_API") or "responses"
    if args.upstream_api not in ("chat", "responses"):
        raise ask.ConfigError(
            f"UPSTREAM_API must be chat or responses, not {args.upstream_api[:40]!r}"
        )
    server = _ProxyServer((host, port), args, upstream, token, auth)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True).start()
    shown = f"[{host}]" if ":" in host else host
    rl.write_out(
        f"proxy: listening on http://{shown}:{server.server_address[1]}/v1 -> {server.split[1]} "
        f"(ledger {args.ledger})\n"
    )
    while not stop.wait(1.0):
        pass
    server.stop(args.grace)  # new requests 503, idle connections closed; then no new connections
    server.book.close()  # its last checkpoint, with a signer key
    return rl.EXIT_OK


def main(argv=None):
    return rl.run_main(_proxy_parser(), argv, _run_proxy)


if __name__ == "__main__":
    sys.exit(main())
