#!/usr/bin/env python3
"""fake_agents.py -- a scripted OpenAI Responses API stand-in, enough for the real Codex CLI to run a
session with a tool round trip offline (real socket on 127.0.0.1, stdlib only).

  from fake_agents import ScriptedResponses, codex_config
  turns = [{"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "touch x"}}]},
           {"text": "Made it."}]
  with ScriptedResponses(turns) as server:      # server.base_url ends in /v1
      codex_config(codex_home, server.base_url, "gpt-test")

Each POST /v1/responses answers the next turn as server-sent events: response.created, one
response.output_item.done per output item, response.completed with usage (input 100, cached 20,
output 10, reasoning 5 per turn). After the last turn it answers {"text": "done"}. Anything else is
404. `requests` holds every parsed request body in order.
"""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

USAGE = {
    "input_tokens": 100,
    "input_tokens_details": {"cached_tokens": 20},
    "output_tokens": 10,
    "output_tokens_details": {"reasoning_tokens": 5},
    "total_tokens": 110,
}


def _items(turn, serial):
    if "tool_calls" in turn:
        return [
            {
                "type": "function_call",
                "id": "fc_%d_%d" % (serial, n),
                "call_id": "call_%d_%d" % (serial, n),
                "name": call["name"],
                "arguments": json.dumps(call.get("arguments", {})),
                "status": "completed",
            }
            for n, call in enumerate(turn["tool_calls"])
        ]
    text = turn.get("text", "")
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return [{"type": "message", "id": "msg_%d" % serial, "role": "assistant",
             "status": "completed", "content": content}]


def events(model, turn, serial):
    response = {"id": "resp_%d" % serial, "object": "response", "model": model, "output": []}
    out = [("response.created", {"response": dict(response, status="in_progress")})]
    items = _items(turn, serial)
    for index, item in enumerate(items):
        out.append(("response.output_item.added", {"output_index": index, "item": item}))
        out.append(("response.output_item.done", {"output_index": index, "item": item}))
    done = dict(response, status="completed", output=items, usage=USAGE)
    out.append(("response.completed", {"response": done}))
    return b"".join(
        ("event: %s\ndata: %s\n\n" % (kind, json.dumps(dict(body, type=kind)))).encode()
        for kind, body in out
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.split("?")[0] != "/v1/responses":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        request = json.loads(body)
        data = events(request.get("model", ""), *self.server.owner.next_turn(request))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST


class ScriptedResponses:
    def __init__(self, turns=()):
        self.turns, self.requests, self._lock = list(turns), [], threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.owner = self
        self.base_url = "http://127.0.0.1:%d/v1" % self.server.server_address[1]

    def next_turn(self, request):
        with self._lock:
            self.requests.append(request)
            turn = self.turns.pop(0) if self.turns else {"text": "done"}
            return turn, len(self.requests)

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def codex_config(codex_home, base_url, model, env_key="FAKE_API_KEY"):
    """A config.toml that points Codex at `base_url` (its key from the variable `env_key`) and
    keeps it offline."""
    os.makedirs(codex_home, exist_ok=True)
    with open(os.path.join(codex_home, "config.toml"), "w") as handle:
        handle.write(
            f'model = "{model}"\nmodel_provider = "fake"\n\n[model_providers.fake]\n'
            f'name = "fake"\nbase_url = "{base_url}"\nenv_key = "{env_key}"\n'
            f'wire_api = "responses"\n\n[analytics]\nenabled = false\n\n'
            f"[features]\nplugins = false\n"
        )
