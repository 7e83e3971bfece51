#!/usr/bin/env python3
"""proxy.py -- a recording OpenAI-compatible proxy: point any agent at it, and every upstream
attempt of every client is one model_call line in the ledger, as ask.py writes it.

Usage:
  BASE_URL=... API_KEY=... python3 proxy.py [--listen HOST:PORT] [--ledger FILE]
  # then the agent's base URL is http://127.0.0.1:8787/v1 (MODEL_ID pins the model;
  # PROXY_TOKEN is the key clients must send, and is needed to listen beyond loopback)

Routes: POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings; GET /v1/models.
Exit codes: 0 stopped by SIGTERM or SIGINT, 2 usage or configuration error. See docs/proxy.md.
"""

import argparse
import functools
import json
import math
import os
import re
import socket
import sys
import threading
import time

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
    "openai-processing-ms"
)
_WHOLE_ERRORS = ("api_error", "malformed_response", "empty_content")  # the stream ended by itself


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
                f"[{str(part.get('type', 'part'))[:40]}]"
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


def _passed_back(headers):
    return [
        (name, re.sub(r"[\r\n]", " ", value))
        for name, value in (headers.items() if headers is not None else ())
        if name.lower() in _PASS_BACK or name.lower().startswith("x-ratelimit-")
    ]


def _error_json(message, code, kind="proxy_error"):
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
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

    def __init__(self, address, args, upstream, token):
        base_url, self.model, self.api_key = upstream
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

    def append(self, kind, record):
        try:
            ask.append_record(self.book, kind, record)
        # the answer still goes to the client: a paid answer is never thrown away
        except ask.RecordError as exc:
            rl.error(str(exc), self.secrets)


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
        if app.token and not ask.bearer_ok(self.headers.get("Authorization"), app.token):
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

    def _read_and_call(self, args):
        try:
            raw = self.read_request(args.read_timeout, args.max_body_bytes)
        # nothing was sent upstream
        except ask.Refused as refused:
            code = {404: "not_found", 405: "method_not_allowed"}.get(refused.status)
            return self._error(
                refused.status,
                refused.message,
                refused.reason or code or "invalid_request",
                refused.headers
            )
        # the body is in: from here the upstream's deadline bounds the request
        self.deadline.cancel()
        self.connection.settimeout(args.timeout + args.read_timeout)
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
        retry = self.headers.get("x-stainless-retry-count") or ""
        record.update(
            route=route,
            client_address=self.client_address[0],
            user_agent=(self.headers.get("User-Agent") or "")[:MAX_HEADER_CHARS] or None,
            session_id=(self.headers.get("X-Ledger-Session") or "")[:MAX_HEADER_CHARS] or None,
            client_retry=int(retry) if retry.isdigit() and len(retry) < 10 else None
        )
        return record

    def _call(self, route, raw):
        app, refused = self.server, None
        try:
            twice = []  # a key given twice: re-encoded, upstream reads what the record says
            body = json.loads(
                raw.decode("utf-8"), object_pairs_hook=functools.partial(_object, twice)
            )
            if type(body) is not dict:
                raise ValueError("not a JSON object")
            # pinned, the body is re-encoded too: the model checked is the one sent
            body, body.raw = _Body(body), None if app.model or twice else raw
            messages, tokens = _client_messages(route, body)
        except (ValueError, RecursionError) as exc:
            body, messages, tokens = {}, [], 0
            refused = ask.CallFailed(
                "invalid_request", f"the request body cannot be read: {str(exc)[:200]}"
            )
        model = body.get("model")
        if refused is None and (type(model) is not str or not model):
            refused = ask.CallFailed("model_missing", "the request has no model")
        elif refused is None and app.model and model != app.model:
            refused = ask.CallFailed(
                "model_not_allowed", f"this proxy serves {app.model!r} only, not {model[:200]!r}"
            )
        model = model[: ask.MAX_FIELD_CHARS] if type(model) is str and model else app.model or ""
        stream = bool(body.get("stream"))
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
        options = body.get("stream_options") if type(body.get("stream_options")) is dict else {}
        injected = stream and route != "/responses" and options.get("include_usage") is not True
        if injected:
            body["stream_options"] = dict(options, include_usage=True)
        result, failure, state, out = ask.attempts(
            ask.endpoint(app.split[0], route),
            body,
            new_record,
            app.append,
            api_key=app.api_key,
            timeout=app.args.timeout,
            limit=app.args.max_response_bytes,
            redactor=app.book.redactor,
            relay=functools.partial(_Relay, self, injected) if stream else None,
            tools_answer=True
        )
        return self._answer(result, failure, state, out)

    def _answer(self, record, failure, state, out):
        """Once the line is written: the stream's last event, the body as it came, the upstream's
        error, or 502."""
        if out is not None and (out.began or failure is None):
            return out.end(failure is None or failure.error_type in _WHOLE_ERRORS)
        if "raw" in state:  # a body that parsed goes back as it is, whatever the record says of it
            return self._send(state["status"], state["raw"], _passed_back(state["headers"]))
        if failure.body is not None and failure.status >= 400:
            body = failure.body.replace(self.server.api_key.encode(), rl.REDACTED.encode())
            return self._send(failure.status, body, _passed_back(failure.headers))
        return self._error(502, f"upstream: {record['error_message']}", record["error_type"])

    def _models(self):
        app = self.server
        record, raw, failure, headers = ask.models_call(
            app.book.redactor, app.split, app.api_key, app.args.timeout, app.args.max_response_bytes
        )
        app.append("models_list", record)
        return self._answer(
            record, failure, {"raw": raw, "status": 200, "headers": headers} if raw else {}, None
        )

    def _send(self, status, body, headers=(), chunked=False):
        self.status = status
        self.wfile.write(ask.http_answer(status, body, headers, close=self.close, chunked=chunked))

    def _error(self, status, message, code, headers=None, kind="proxy_error"):
        self._send(status, _error_json(message, code, kind), list((headers or {}).items()))


class _Relay:
    """A stream's events to the client as they arrive (chunked); the usage chunk the proxy asked for
    is dropped, and the last event is held until the ledger line is written."""

    def __init__(self, handler, injected):
        self.handler, self.injected, self.began, self.held, self.headers = (
            handler,
            injected,
            False,
            [],
            None
        )

    def __call__(self, raw, chunk):
        if (
            chunk is None
            and raw.rstrip().endswith(b"[DONE]")
            or chunk
            and chunk.get("type") in ask.RESPONSE_DONE
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

    def _write(self, raw):
        try:
            if not self.began:
                self.began = True
                self.handler._send(200, b"", _passed_back(self.headers), chunked=True)
            if raw:
                self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
        except OSError:
            self.handler.close = True
            raise ask.CallFailed(
                "client_gone", "the client closed the connection during the stream"
            ) from None

    def end(self, whole):
        """Send what was held; a whole stream ends cleanly, a broken one by closing the
        connection."""
        try:
            for raw in self.held + [b""]:
                self._write(raw)
            self.handler.wfile.write(b"0\r\n\r\n" if whole else b"")
        except (ask.CallFailed, OSError):
            whole = False
        self.handler.close = self.handler.close or not whole


def _proxy_parser():
    p = rl.ArgumentParser(
        prog="proxy.py",
        description="A recording OpenAI-compatible proxy: BASE_URL and API_KEY upstream "
        "(MODEL_ID optional: pins the model; PROXY_TOKEN optional: the clients' key), "
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
    server = _ProxyServer((host, port), args, upstream, token)
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
