#!/usr/bin/env python3
"""fake_openai.py -- a scripted OpenAI-compatible server for tests (stdlib http.server, real socket).

Usage:
  python tests/fake_openai.py [PORT]            # serves the "ok" scenario until Ctrl-C
  python tests/fake_openai.py PORT --replies FILE   # FILE: one JSON value per line, each the content of
                                                 # one assistant reply in order (a string as is, anything
                                                 # else as its JSON text); then "ok" again
  from fake_openai import start
  server = start()                               # 127.0.0.1, port 0
  server.queue("rate_limited", "ok")             # the next requests, in order; then "ok" again
  ... server.base_url, server.requests, server.stop()
  server.window = (2048, "llama.cpp")            # enforce a context window, refused in that server's words

Every scenario is one thing real endpoints do (wrong): see SCENARIOS below. It answers like a real server
on /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings and GET /v1/models, and 404 off
/v1 (a BASE_URL without /v1 is a mistake real servers do not forgive). The command line's server lists
the model it is told to serve and reports usage counted from the request (chars/4), as a real one would.
"""

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__version__ = "1.0.0"

ANSWER = "The answer is 4."
USAGE = {"prompt_tokens": 21, "completion_tokens": 6, "total_tokens": 27,
         "prompt_tokens_details": {"cached_tokens": 3}, "completion_tokens_details": {"reasoning_tokens": 2}}
MODELS = ["fake-model", "fake-model-large"]
CLI_MODELS = ["stand-in-model"]  # what `python tests/fake_openai.py` lists: the MODEL_ID README.md uses
GET_SCENARIOS = ("http_401",)  # a GET /models takes these, a bare "ok" or one with "models" from the queue;
# any other scenario (an "ok" with its answer, say) stays for the next chat call
CHARS_PER_TOKEN = 3  # the windowed server's tokenizer: denser than the client's chars/4 estimate, as code is
# What each server says when a request does not fit: (window, prompt tokens, max_tokens) -> (message, code);
# llama.cpp's error type is exceed_context_size_error, the others' invalid_request_error.
OVERFLOW = {
    "openai": lambda w, p, m: ("This model's maximum context length is %d tokens. However, you requested %d tokens "
                               "(%d in the messages, %d in the completion). Please reduce the length of the "
                               "messages or completion." % (w, p + m, p, m), "context_length_exceeded"),
    "vllm": lambda w, p, m: ("'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum "
                             "context length is %d tokens and your request has %d input tokens (%d > %d - %d)."
                             % (m, w, p, m, w, p), None),
    "llama.cpp": lambda w, p, m: ("request (%d tokens) exceeds the available context size (%d tokens)" % (p, w),
                                  400),
}


ROUTES = ("chat/completions", "completions", "responses", "embeddings")


def _route(path):
    """The route after /v1/ ("chat/completions", "models", ...), or None off /v1."""
    head, sep, tail = path.split("?")[0].rstrip("/").rpartition("/v1/")
    return tail if sep else None


def _tokens(text):
    return -(-len(text) // 4) if text else 0


def _counted(body, answer):
    """Usage counted from the request, as a server's tokenizer would: chars/4 plus a few per message."""
    messages = body.get("messages") or []
    prompt = sum(_tokens(json.dumps(m.get("content"))) + 4 for m in messages if isinstance(m, dict))
    prompt += _tokens(json.dumps(body.get("input") or body.get("prompt") or ""))
    out = _tokens(answer or "")
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


def read_replies(path):
    """FILE's replies, in order: one JSON value per line (blank lines skipped). Raises ValueError naming the
    line of the first one that is not JSON."""
    replies = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path} line {number}: not a JSON value ({exc.msg})") from None
            replies.append(value if isinstance(value, str) else json.dumps(value))
    return replies


def _completion(model, answer=ANSWER, usage=USAGE, served=None, finish="stop"):
    body = {"id": "chatcmpl-fake123", "object": "chat.completion", "created": 1764400000,
            "model": served or model, "system_fingerprint": "fp_fake01",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                         "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return body


class Handler(BaseHTTPRequestHandler):
    server_version = "fake-openai/1.0"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    # -- plumbing ---------------------------------------------------------
    def _send(self, status, body, content_type="application/json", headers=None):
        data = body if isinstance(body, bytes) else (
            json.dumps(body).encode() if not isinstance(body, str) else body.encode())
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", f"req_fake_{self.server.fake.count}")
        self.send_header("x-ratelimit-remaining-requests", "99")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, message, kind="invalid_request_error", headers=None, code=None):
        self._send(status, {"error": {"message": message, "type": kind, "code": code}}, headers=headers)

    def _sse(self, chunks, done=True, close_early=False):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("x-request-id", f"req_fake_{self.server.fake.count}")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(0.01)
        if close_early:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if done:
            self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

    def _chunks(self, model, answer=ANSWER, usage=True, finish=True):
        base = {"id": "chatcmpl-fake123", "object": "chat.completion.chunk", "created": 1764400000,
                "model": model, "system_fingerprint": "fp_fake01"}
        pieces = [answer[i:i + 5] for i in range(0, len(answer), 5)]
        out = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}])]
        for piece in pieces:
            out.append(dict(base, choices=[{"index": 0, "delta": {"content": piece}, "finish_reason": None}]))
        if finish:
            out.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
        if usage:
            out.append(dict(base, choices=[], usage=USAGE))
        return out

    # -- routes -----------------------------------------------------------
    def do_GET(self):
        fake = self.server.fake
        scenario, request = fake.next_request(self, None)
        if _route(self.path) != "models":
            return self._error(404, f"no route {self.path}")
        if scenario.get("name") == "http_401":
            return self._error(401, "Incorrect API key provided", "invalid_api_key")
        window, flavor = fake.window or (None, None)
        meta = {"meta": {"n_ctx_train": window}} if flavor == "llama.cpp" else {"max_model_len": window} if (
            flavor == "vllm") else {}
        self._send(200, {"object": "list", "data": [dict({"id": m, "object": "model", "owned_by": "fake"}, **meta)
                                                    for m in scenario.get("models", fake.models)]})

    def _overflow(self, body, scenario):
        """Answer a request that does not fit the window (or any, for the "overflow" scenario) in the server's
        words: True. The prompt's tokens are counted at CHARS_PER_TOKEN plus a few for each message's template;
        a scripted answer refused that way is kept for the next call (the model never saw the request)."""
        window, flavor = self.server.fake.window or (None, None)
        forced = scenario.get("name") == "overflow"
        messages = body.get("messages") or []
        prompt = sum(-(-len(m.get("content") or "") // CHARS_PER_TOKEN) + 8 for m in messages)
        wanted = body.get("max_tokens") or 0
        self.server.fake.prompt_tokens.append(prompt)
        if not window or (prompt + wanted <= window and not forced):
            return False
        if not forced:
            with self.server.fake.lock:
                self.server.fake.scenarios.insert(0, scenario)
        message, code = OVERFLOW[flavor](window, prompt, wanted)
        self._error(400, message, "exceed_context_size_error" if flavor == "llama.cpp" else "invalid_request_error",
                    code=code)
        return True

    def do_POST(self):
        fake = self.server.fake
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        scenario, request = fake.next_request(self, body)
        route = _route(self.path)
        if route not in ROUTES:
            return self._error(404, f"no route {self.path}")
        if not isinstance(body, dict):
            return self._error(400, "body is not a JSON object")
        model = body.get("model")
        name = scenario.get("name", "ok")
        answer = scenario.get("answer", ANSWER)
        auth = self.headers.get("Authorization", "")
        if fake.api_key and auth != f"Bearer {fake.api_key}":
            return self._error(401, f"Incorrect API key provided: {auth[7:]}", "invalid_api_key")
        if route != "chat/completions":
            return self._other(route, model, answer, body)
        if scenario.get("sleep"):
            time.sleep(scenario["sleep"])
        if scenario.get("hold") is not None:  # a threading.Event: answer only once the test sets it
            scenario["hold"].wait(600)
        if fake.window and self._overflow(body, scenario):
            return None
        usage = dict(USAGE, prompt_tokens=fake.prompt_tokens[-1]) if fake.window else USAGE
        if fake.counted:
            usage = _counted(body, answer)
        stream = bool(body.get("stream"))
        if name == "reject_stream_options" and "stream_options" in body:
            return self._error(400, "Unrecognized request argument supplied: stream_options")
        if stream and name in ("ok", "reject_stream_options", "model_swap", "stream_no_usage", "sleepy"):
            served = scenario.get("served", model)
            include = (body.get("stream_options") or {}).get("include_usage") and name != "stream_no_usage"
            return self._sse(self._chunks(served, answer, usage=include))
        if name == "stream_truncated":
            return self._sse(self._chunks(model, answer, usage=False, finish=False)[:3], close_early=True)
        if name in ("ok", "sleepy"):
            return self._send(200, _completion(model, answer, usage=usage))
        if name == "no_usage":
            return self._send(200, _completion(model, answer, usage=None))
        if name == "partial_usage":
            return self._send(200, _completion(model, answer, usage={"total_tokens": 30}))
        if name == "zero_usage":
            return self._send(200, _completion(model, answer, usage={"prompt_tokens": 0, "completion_tokens": 0,
                                                                     "total_tokens": 0}))
        if name == "model_swap":
            return self._send(200, _completion(model, answer, served=scenario.get("served", "cheaper-model-q4")))
        if name == "no_model_field":
            completion = _completion(model, answer)
            del completion["model"]
            return self._send(200, completion)
        if name == "http_401":
            return self._error(401, f"Incorrect API key provided: {auth[7:]}", "invalid_api_key")
        if name == "http_403":
            return self._error(403, "Your account is not allowed to use this model", "permission_error")
        if name == "http_404":
            return self._error(404, f"The model `{model}` does not exist", "model_not_found")
        if name == "context_too_long":
            return self._error(400, "This model's maximum context length is 4096 tokens. However, your messages "
                                    "resulted in 9000 tokens.", code="context_length_exceeded")
        if name == "rate_limited":
            headers = {"Retry-After": str(scenario.get("retry_after", 0))}
            if "retry_after_ms" in scenario:
                headers = {"retry-after-ms": str(scenario["retry_after_ms"])}
            return self._error(429, "Rate limit reached for requests", "rate_limit_error", headers=headers)
        if name == "server_error":
            return self._error(scenario.get("status", 500), "The server had an error", "server_error")
        if name == "html_error":
            page = "<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>"
            return self._send(scenario.get("status", 502), page, "text/html")
        if name == "html_200":
            return self._send(200, "<!doctype html><html><head><title>Sign in</title></head><body>login</body>"
                                   "</html>", "text/html")
        if name == "not_json":
            return self._send(200, "upstream said: OK", "text/plain")
        if name == "no_choices":
            return self._send(200, {"id": "x", "object": "chat.completion", "model": model})
        if name == "error_in_200":
            return self._send(200, {"error": {"message": "Provider returned error", "code": 502}})
        if name == "empty_content":
            return self._send(200, _completion(model, ""))
        if name == "null_content":
            return self._send(200, _completion(model, None))
        if name == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        return self._error(500, f"unknown scenario {name}")

    def _other(self, route, model, answer, body):
        """The "ok" answer on the routes other than chat: completions, responses, embeddings."""
        usage = _counted(body, answer) if self.server.fake.counted else USAGE
        if route == "embeddings":
            inputs = body.get("input")
            inputs = inputs if isinstance(inputs, list) else [inputs]
            return self._send(200, {"object": "list", "model": model, "data": [
                {"object": "embedding", "index": i, "embedding": [0.1, -0.2, 0.3]}
                for i in range(len(inputs))], "usage": {"prompt_tokens": usage["prompt_tokens"],
                                                        "total_tokens": usage["prompt_tokens"]}})
        if route == "completions":
            done = {"id": "cmpl-fake123", "object": "text_completion", "created": 1764400000, "model": model,
                    "choices": [{"index": 0, "text": answer, "finish_reason": "stop"}], "usage": usage}
            if not body.get("stream"):
                return self._send(200, done)
            return self._sse([dict(done, usage=None)])
        response = {"id": "resp_fake123", "object": "response", "created_at": 1764400000, "model": model,
                    "status": "completed", "output": [{"type": "message", "id": "msg_fake", "role": "assistant",
                                                       "status": "completed", "content": [
                                                           {"type": "output_text", "text": answer,
                                                            "annotations": []}]}],
                    "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                              "total_tokens": usage["total_tokens"]}}
        if not body.get("stream"):
            return self._send(200, response)
        events = [("response.created", {"response": dict(response, status="in_progress", output=[],
                                                         usage=None)}),
                  ("response.output_text.delta", {"item_id": "msg_fake", "output_index": 0,
                                                  "content_index": 0, "delta": answer}),
                  ("response.completed", {"response": response})]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for number, (kind, data) in enumerate(events):
            data = dict(data, type=kind, sequence_number=number)
            self.wfile.write(b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(data).encode()))
        self.close_connection = True
        return None


class FakeServer:
    def __init__(self, host="127.0.0.1", port=0, api_key=None, models=MODELS, counted=False):
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        self.api_key = api_key
        self.models = models
        self.counted = counted     # usage counted from each request (chars/4) instead of the canned USAGE
        self.scenarios = []
        self.requests = []
        self.gets = []             # GET requests (the /models listing), kept apart from the chat calls
        self.window = None         # (tokens, "openai" | "vllm" | "llama.cpp"): enforce a context window
        self.prompt_tokens = []    # with a window: the prompt tokens the server counted in each chat call
        self.count = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self):
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def queue(self, *scenarios):
        """The next requests get these scenarios in order (a name or a dict with "name")."""
        with self.lock:
            self.scenarios.extend({"name": s} if isinstance(s, str) else s for s in scenarios)
        return self

    def next_request(self, handler, body):
        get = handler.command == "GET"
        with self.lock:
            self.count += 1
            head = self.scenarios[0] if self.scenarios else {}
            mine = bool(head) and (not get or head.get("name") in GET_SCENARIOS or "models" in head
                                   or head == {"name": "ok"})
            scenario = self.scenarios.pop(0) if mine else {"name": "ok"}
            request = {"method": handler.command, "path": handler.path, "headers": dict(handler.headers),
                       "body": body, "scenario": scenario.get("name")}
            (self.gets if get else self.requests).append(request)
        return scenario, request

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def start(api_key=None):
    return FakeServer(api_key=api_key).start()


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="fake_openai.py", description="A stand-in OpenAI-compatible endpoint "
                                     "on 127.0.0.1 that answers every chat call with the 'ok' scenario.")
    parser.add_argument("port", nargs="?", type=int, default=0, help="the port (default: any free one)")
    parser.add_argument("--replies", metavar="FILE", help="one JSON value per line, each the content of one "
                        "assistant reply in order (for agent.py: one action object, docs/agent.md); after the "
                        "last, the usual answer")
    parser.add_argument("--model", default=CLI_MODELS[0], help="the model id it lists (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        replies = read_replies(args.replies) if args.replies else []
    except OSError as exc:
        print(f"error: cannot read {args.replies}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server = FakeServer(port=args.port, models=[args.model], counted=True)
    except OSError as exc:
        print(f"error: cannot listen on 127.0.0.1:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    server.queue(*[{"name": "ok", "answer": reply} for reply in replies])
    scripted = f"; {len(replies)} scripted repl{'y' if len(replies) == 1 else 'ies'} first" if replies else ""
    print(f"fake OpenAI-compatible server at {server.base_url} (any API_KEY; it lists {args.model} "
          f"but answers to any MODEL_ID{scripted}; Ctrl-C stops it)", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
