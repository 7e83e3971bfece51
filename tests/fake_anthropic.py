#!/usr/bin/env python3
"""fake_anthropic.py -- a scripted Anthropic Messages API stand-in for tests (real socket, stdlib).

  from fake_anthropic import ScriptedAnthropic
  turns = [{"tool_use": {"name": "Bash", "input": {"command": "touch x"}}, "thinking": "a file"},
           {"text": "Made it.", "usage": {"input_tokens": 50, "cache_read_input_tokens": 10}}]
  with ScriptedAnthropic(turns) as server:      # 127.0.0.1, port 0, served by a thread
      server.base_url                           # "http://127.0.0.1:PORT" (no /v1: ANTHROPIC_BASE_URL)
      server.requests                           # [{"method", "path", "headers", "body"}] in order
      server.messages                           # the POST /v1/messages requests only

Each POST /v1/messages (any query, such as ?beta=true) answers the next turn, as one message or as
the Messages API's server-sent events when the body asks for "stream": message_start, then for each
block content_block_start / content_block_delta... / content_block_stop (thinking_delta and
signature_delta, text_delta, input_json_delta in pieces), message_delta with stop_reason and usage,
message_stop. After the last turn it answers {"text": "done"}.

A turn is {"text": str} or {"tool_use": {"name": str, "input": dict}}, either optionally with
"thinking": str (a thinking block first) and "usage": dict (merged over the counted usage: any of
input_tokens, output_tokens, cache_read_input_tokens, cache_creation_input_tokens; a key set to None
is left out). For hostile tests a turn may instead be {"status": int, "error": {"type", "message"}}
(an HTTP error in Anthropic's shape) or {"raw": bytes} (those bytes after a 200 text/event-stream
head, then the connection is closed). Also: HEAD / and HEAD /api/hello -> 200, POST /v1/messages/count_tokens ->
{"input_tokens": N}, anything else 404. `headers` keys are lower-case; `body` is the parsed JSON,
or the raw bytes when it is not JSON.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__version__ = "1.0.0"

DONE = {"text": "done"}
CHUNK_CHARS = 12  # a block's text and tool-input JSON go out in pieces this long, as the API does


def count_tokens(body):
    """A deterministic stand-in tokenizer: four characters of the request's JSON per token."""
    return max(1, len(json.dumps(body, separators=(",", ":"))) // 4)


def _blocks(turn, serial):
    blocks = []
    if turn.get("thinking") is not None:
        blocks.append({"type": "thinking", "thinking": turn["thinking"], "signature": "c2ln" * 8})
    if "tool_use" in turn:
        if turn.get("text"):
            blocks.append({"type": "text", "text": turn["text"]})
        call = turn["tool_use"]
        blocks.append(
            {
                "type": "tool_use",
                "id": "toolu_fake%04d" % serial,
                "name": call["name"],
                "input": call.get("input", {})
            }
        )
    else:
        blocks.append({"type": "text", "text": turn.get("text", "")})
    return blocks


def message(body, turn, serial):
    """The whole message that answers `turn` to a request `body` (`serial`: its number)."""
    blocks = _blocks(turn, serial)
    out = sum(
        len(b.get("text") or b.get("thinking") or json.dumps(b.get("input", ""))) for b in blocks
    )
    usage = {
        "input_tokens": count_tokens(body),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": max(1, out // 4)
    }
    usage.update(turn.get("usage") or {})
    usage = {k: v for k, v in usage.items() if v is not None}
    return {
        "id": "msg_fake%04d" % serial,
        "type": "message",
        "role": "assistant",
        "model": body.get("model") if isinstance(body, dict) else None,
        "content": blocks,
        "stop_reason": "tool_use" if "tool_use" in turn else "end_turn",
        "stop_sequence": None,
        "usage": usage
    }


def _pieces(text):
    return [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] or [""]


def events(whole):
    """The server-sent events of a `whole` message, as the Messages API streams it: [(event, data)]."""
    message = whole
    usage = message["usage"]
    start_usage = {k: v for k, v in usage.items() if k != "output_tokens"}
    start_usage["output_tokens"] = 1
    head = dict(message, content=[], stop_reason=None, usage=start_usage)
    out = [("message_start", {"type": "message_start", "message": head}), ("ping", {"type": "ping"})]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        empty = {
            "thinking": {"type": "thinking", "thinking": "", "signature": ""},
            "text": {"type": "text", "text": ""},
            "tool_use": dict(block, input={})
        }[kind]
        out.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": empty}
            )
        )
        if kind == "thinking":
            deltas = [{"type": "thinking_delta", "thinking": p} for p in _pieces(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "text":
            deltas = [{"type": "text_delta", "text": p} for p in _pieces(block["text"])]
        else:
            deltas = [
                {"type": "input_json_delta", "partial_json": p}
                for p in [""] + _pieces(json.dumps(block["input"]))
            ]
        for delta in deltas:
            out.append(
                (
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta}
                )
            )
        out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    out.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {k: v for k, v in usage.items() if k == "output_tokens"}
            }
        )
    )
    out.append(("message_stop", {"type": "message_stop"}))
    return out


def sse(pairs):
    """Events as the bytes of a text/event-stream."""
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(data).encode())
        for name, data in pairs
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-anthropic/1.0"

    def log_message(self, *args):  # quiet
        pass

    def _note(self, body):
        self.server.fake._record(self.command, self.path, self.headers, body)

    def _send(self, status, data, content_type="application/json", close=False):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("request-id", "req_fake")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def do_HEAD(self):
        self._note(None)
        # Claude Code's preconnect is HEAD /api/hello
        self.send_response(200 if self.path.split("?")[0] in ("/", "/api/hello") else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self._note(None)
        self._error(404, "not_found_error", f"no route {self.path}")

    def _error(self, status, kind, message):
        body = {"type": "error", "error": {"type": kind, "message": message}}
        self._send(status, json.dumps(body).encode())

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw
        self._note(body)
        path = self.path.split("?")[0]
        if path == "/v1/messages/count_tokens" and isinstance(body, dict):
            return self._send(200, json.dumps({"input_tokens": count_tokens(body)}).encode())
        if path != "/v1/messages":
            return self._error(404, "not_found_error", f"no route {self.path}")
        if not isinstance(body, dict):
            return self._error(400, "invalid_request_error", "the body is not a JSON object")
        turn, serial = self.server.fake._next()
        if "status" in turn:
            error = dict({"type": "api_error", "message": "scripted"}, **turn.get("error", {}))
            return self._error(turn["status"], error["type"], error["message"])
        if "raw" in turn:
            return self._send(200, turn["raw"], "text/event-stream", close=True)
        answer = message(body, turn, serial)
        if body.get("stream"):
            return self._send(200, sse(events(answer)), "text/event-stream", close=True)
        return self._send(200, json.dumps(answer).encode())


class ScriptedAnthropic:
    """A real HTTP server on 127.0.0.1 (port 0) in a thread, answering `turns` in order."""

    def __init__(self, turns=()):
        self.turns = list(turns)
        self.requests = []
        self.lock = threading.Lock()
        self.served = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        self.base_url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.1,), daemon=True)

    @property
    def messages(self):
        with self.lock:
            return [r for r in self.requests if r["path"].split("?")[0] == "/v1/messages"]

    def _record(self, method, path, headers, body):
        request = {
            "method": method,
            "path": path,
            "headers": {k.lower(): v for k, v in headers.items()},
            "body": body
        }
        with self.lock:
            self.requests.append(request)

    def _next(self):
        with self.lock:
            self.served += 1
            turn = self.turns.pop(0) if self.turns else DONE
            return turn, self.served

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        return False
