#!/usr/bin/env python3
"""fake_upstream.py -- a scripted OpenAI-compatible upstream for the proxy's tests (stdlib, real socket).

Usage:
  from fake_upstream import Upstream
  up = Upstream().start()          # 127.0.0.1, port 0
  up.queue("tools", {"name": "error", "status": 429, "headers": {"Retry-After": "7"}})
  ... up.base_url, up.requests (method, path, headers, body, raw), up.gate / up.first_sent, up.stop()

It speaks every route the proxy forwards: chat/completions, completions, responses (the Responses API,
whose stream has `event:` lines, no [DONE], and usage in response.completed), embeddings and models.
Scenarios (the next request takes the next one; then "ok"):
  ok        the route's answer; streamed when the body asks stream: true (the usage chunk only when
            stream_options.include_usage is true, as OpenAI does)
  tools     a chat answer that is a tool call with content null (streamed too)
  reasoning a chat answer with reasoning_content (REASONING) before its text (streamed too)
  filter    a chat stream with Azure's content-filter chunk (empty choices, no usage) first
  gated     a stream whose first text event is sent, then `first_sent` is set and the rest waits for `gate`
  held      nothing (a stream: the head and the first event), then `first_sent` is set, and the
            connection is held until the proxy closes it (`closed` is set) or `gate` opens
  cut       a stream cut after two events (the connection closed)
  reject_options  400 "Unrecognized request argument supplied: stream_options" when the body has them
  error     {"status", "headers"}: an OpenAI error body with that status
  turn      {"text": str} or {"tool_calls": [{"name": str, "arguments": dict}]}, each optionally with
            "reasoning_content" and "usage": one scripted chat answer, streamed when asked
ScriptedChat(turns) is the same server as a scripted conversation (tests/fake_chat.py names it for the
real-client tests): each POST /v1/chat/completions answers the next turn, then {"text": "done"}.
Every answer carries x-request-id, x-ratelimit-remaining-requests, openai-processing-ms, Retry-After
and two headers the proxy must not pass back (Set-Cookie, X-Upstream-Private).
"""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__version__ = "1.0.0"

ANSWER = "The answer is 4."
CHAT_USAGE = {"prompt_tokens": 21, "completion_tokens": 6, "total_tokens": 27}
RESPONSES_USAGE = {"input_tokens": 30, "output_tokens": 7, "total_tokens": 37,
                   "input_tokens_details": {"cached_tokens": 4}, "output_tokens_details": {"reasoning_tokens": 1}}
REASONING = "Two and two make four."
TOOL_CALL = [{"id": "call_1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}]
PASSED = {"x-request-id": "req_up_1", "x-ratelimit-remaining-requests": "99", "openai-processing-ms": "12",
          "Retry-After": "3"}
PRIVATE = {"Set-Cookie": "upstream_session=private-cookie-value", "X-Upstream-Private": "do-not-pass"}


def _chat_chunks(model, scenario, include_usage, text_field=False):
    base = {"id": "chatcmpl-up", "object": "text_completion" if text_field else "chat.completion.chunk",
            "model": model}
    def choice(piece=None, finish=None, tools=None):
        if text_field:
            return {"index": 0, "text": piece or "", "finish_reason": finish}
        delta = {} if piece is None else {"content": piece}
        if tools:
            delta = {"role": "assistant", "content": None, "tool_calls": tools}
        return {"index": 0, "delta": delta, "finish_reason": finish}
    out = []
    if scenario == "filter":
        out.append({"id": "", "object": "", "model": "", "choices": [], "prompt_filter_results": [
            {"prompt_index": 0, "content_filter_results": {"hate": {"filtered": False, "severity": "safe"}}}]})
    if scenario == "tools":
        out += [dict(base, choices=[choice(tools=TOOL_CALL)]), dict(base, choices=[choice(finish="tool_calls")])]
    else:
        if scenario == "reasoning":
            out += [dict(base, choices=[{"index": 0, "delta": {"reasoning_content": REASONING[i:i + 9]},
                                         "finish_reason": None}]) for i in range(0, len(REASONING), 9)]
        out += [dict(base, choices=[choice(ANSWER[i:i + 6])]) for i in range(0, len(ANSWER), 6)]
        out.append(dict(base, choices=[choice(finish="stop")]))
    if include_usage:
        out.append(dict(base, choices=[], usage=CHAT_USAGE))
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in out] + [b"data: [DONE]\n\n"]


def _turn_message(turn):
    """A scripted turn as a chat message: text, or tool calls (ids call_1, call_2...), its reasoning."""
    message = {"role": "assistant", "content": turn.get("text")}
    if turn.get("tool_calls"):
        message["tool_calls"] = [{"id": "call_%d" % (i + 1), "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for i, c in enumerate(turn["tool_calls"])]
    if turn.get("reasoning_content") is not None:
        message["reasoning_content"] = turn["reasoning_content"]
    return message


def _turn_chunks(model, turn, include_usage):
    """A scripted turn as a chat stream: reasoning, then text in pieces or each call's name then its
    arguments in two pieces, the finish_reason, the usage chunk when asked, [DONE]."""
    base, message, deltas = {"id": "chatcmpl-turn", "object": "chat.completion.chunk", "model": model}, \
        _turn_message(turn), [{"role": "assistant"}]
    if message.get("reasoning_content"):
        deltas.append({"reasoning_content": message["reasoning_content"]})
    text = message.get("content") or ""
    deltas += [{"content": text[i:i + 6]} for i in range(0, len(text), 6)]
    for i, call in enumerate(message.get("tool_calls", [])):
        args = call["function"]["arguments"]
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        half = len(args) // 2
        deltas += [{"tool_calls": [{"index": i, "function": {"arguments": a}}]} for a in (args[:half], args[half:])]
    out = [dict(base, choices=[{"index": 0, "delta": d, "finish_reason": None}]) for d in deltas]
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    out.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": finish}]))
    if include_usage:
        out.append(dict(base, choices=[], usage=turn.get("usage", CHAT_USAGE)))
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in out] + [b"data: [DONE]\n\n"]


def _responses_events(model):
    response = {"id": "resp_up", "object": "response", "model": model, "status": "in_progress", "output": []}
    events = [("response.created", {"response": response})]
    events += [("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "delta": ANSWER[i:i + 6]})
               for i in range(0, len(ANSWER), 6)]
    events.append(("response.completed", {"response": dict(_response(model), status="completed")}))
    return [f"event: {kind}\ndata: {json.dumps(dict(body, type=kind))}\n\n".encode() for kind, body in events]


def _response(model):
    return {"id": "resp_up", "object": "response", "model": model, "status": "completed",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                        "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]}],
            "usage": RESPONSES_USAGE}


def _answer(route, model, scenario):
    if scenario["name"] == "turn":
        message = _turn_message(scenario)
        return {"id": "chatcmpl-turn", "object": "chat.completion", "model": model,
                "usage": scenario.get("usage", CHAT_USAGE),
                "choices": [{"index": 0, "message": message,
                             "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]}
    scenario = scenario["name"]
    if route == "/completions":
        return {"id": "cmpl-up", "object": "text_completion", "model": model, "usage": CHAT_USAGE,
                "choices": [{"index": 0, "text": ANSWER, "finish_reason": "stop"}]}
    if route == "/responses":
        return _response(model)
    if route == "/embeddings":
        return {"object": "list", "model": model, "usage": {"prompt_tokens": 5, "total_tokens": 5},
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2, 0.3]}]}
    message = {"role": "assistant", "content": ANSWER}
    if scenario == "tools":
        message = {"role": "assistant", "content": None, "tool_calls": TOOL_CALL}
    if scenario == "reasoning":
        message["reasoning_content"] = REASONING
    return {"id": "chatcmpl-up", "object": "chat.completion", "model": model, "usage": CHAT_USAGE,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if scenario == "tools"
                         else "stop"}]}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # head and body are two writes: no delayed-ACK wait between them

    def log_message(self, *args):
        pass

    def _head(self, status, content_type, length=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in list(PASSED.items()) + list(PRIVATE.items()):
            self.send_header(name, value)
        if length is None:
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _json(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in list(PASSED.items()) + list(PRIVATE.items()) + list((headers or {}).items()):
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.server.up.take(self, None)
        self._json(200, {"object": "list", "data": [{"id": self.server.up.model, "object": "model"}]})

    def do_POST(self):
        up = self.server.up
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw or b"null")
        scenario = up.take(self, body, raw)
        name, route = scenario["name"], self.path.split("?")[0][len("/v1"):]
        model = body.get("model", "") if isinstance(body, dict) else ""
        if name == "error":
            return self._json(scenario.get("status", 500), {"error": {"message": "upstream says no", "type": "x",
                                                                      "code": "nope"}}, scenario.get("headers"))
        if name == "reject_options" and "stream_options" in body:
            return self._json(400, {"error": {"message": "Unrecognized request argument supplied: stream_options",
                                              "type": "invalid_request_error", "code": None}})
        if name == "held":
            return self._held(up, route, model, body)
        if not body.get("stream"):
            return self._json(200, _answer(route, model, scenario))
        include = bool((body.get("stream_options") or {}).get("include_usage"))
        if name == "turn":
            events = _turn_chunks(model, scenario, include)
        elif route == "/responses":
            events = _responses_events(model)
        else:
            events = _chat_chunks(model, name, include, text_field=route == "/completions")
        self._head(200, "text/event-stream")
        for i, event in enumerate(events[:2] if name == "cut" else events):
            self.wfile.write(event)
            self.wfile.flush()
            if name == "gated" and i == 0:
                up.first_sent.set()
                up.gate.wait(60)


    def _held(self, up, route, model, body):
        if body.get("stream"):
            self._head(200, "text/event-stream")
            self.wfile.write((_responses_events(model) if route == "/responses" else _chat_chunks(model, "ok", False))[0])
            self.wfile.flush()
        up.first_sent.set()
        self.connection.settimeout(0.2)
        while not up.gate.is_set():  # the proxy sends nothing more: data here is its close
            try:
                if not self.connection.recv(1):
                    break
            except socket.timeout:
                continue
            except OSError:
                break
        else:
            return
        up.closed.set()
        self.close_connection = True


class Upstream:
    model = "up-model"  # what GET /v1/models lists
    default = {"name": "ok"}  # the scenario once the queue is empty
    get_takes = True  # a GET takes the next scenario too

    def __init__(self):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.up = self
        self.scenarios, self.requests, self.lock = [], [], threading.Lock()
        self.gate, self.first_sent, self.closed = threading.Event(), threading.Event(), threading.Event()

    @property
    def base_url(self):
        return "http://127.0.0.1:%d/v1" % self.httpd.server_address[1]

    def queue(self, *scenarios):
        with self.lock:
            self.scenarios.extend({"name": s} if isinstance(s, str) else s for s in scenarios)
        return self

    def take(self, handler, body, raw=None):
        with self.lock:
            takes = self.scenarios and (handler.command == "POST" or self.get_takes)
            scenario = self.scenarios.pop(0) if takes else self.default
            self.requests.append({"method": handler.command, "path": handler.path, "body": body, "raw": raw,
                                  "headers": {k.lower(): v for k, v in handler.headers.items()}})
        return scenario

    def start(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class ScriptedChat(Upstream):
    """A scripted chat-completions server as a context manager: `with ScriptedChat(turns) as chat:`
    gives .base_url and .requests ({"method", "path", "headers", "body"}); each chat call answers the
    next turn ({"text": str} or {"tool_calls": [{"name": str, "arguments": dict}]}, optionally with
    "reasoning_content" and "usage"), then {"text": "done"}; GET /v1/models lists `model`."""

    default, get_takes = {"name": "turn", "text": "done"}, False

    def __init__(self, turns, model="scripted-model"):
        super().__init__()
        self.model = model
        self.queue(*[dict(turn, name="turn") for turn in turns])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
