"""`proxy.py` with UPSTREAM_API=chat: a Responses request carried to a chat-completions upstream and
its answer written back as Responses events or a Responses object, through a real proxy subprocess
and real sockets. The real Codex CLI through the bridge: test_clients_codex.py."""

import json

import pytest

import reasoning_ledger as rl
from conftest import KEY, clean_env, run_script
from fake_upstream import ANSWER, CHAT_USAGE, ScriptedChat, Upstream
from hostile_server import HostileServer
from proxy_helpers import Proxy, post

TOKEN = "proxy-token-for-the-bridge-0123"
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "sub-agents",
    "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}],
}
RUN = {"type": "function", "name": "run", "description": "a shell", "strict": False,
       "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


@pytest.fixture
def start(tmp_path):
    started = []

    def go(base_url, **env):
        env.setdefault("UPSTREAM_API", "chat")
        proxy = Proxy(base_url, tmp_path / "calls.jsonl", PROXY_TOKEN=TOKEN, **env)
        started.append(proxy)
        return proxy
    yield go
    for proxy in started:
        proxy.stop()


def calls(path):
    return [e["payload"] for e in rl.read_events(path, run_id=None) if e["kind"] == "model_call"]


def ask(proxy, body):
    return post(proxy.conn(), "/responses", body, {"Authorization": "Bearer " + TOKEN})


def sse(raw):
    """The (type, data) of each Responses event, checking that `event:` names the data's type."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            kind, data = block.split("\n", 1)
            data = json.loads(data[len("data: "):])
            assert kind == "event: " + data["type"]
            out.append((data["type"], data))
    return out


# ----------------------------------------------------------------------------
# The request
# ----------------------------------------------------------------------------

def test_every_input_item_kind_and_option_becomes_its_chat_form(start, tmp_path):
    with ScriptedChat([]) as chat:
        proxy = start(chat.base_url)
        body = {
            "model": "scripted-model", "instructions": "Be brief.", "store": False,
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List "},
                                                                {"type": "input_text", "text": "files."}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
                {"type": "function_call", "call_id": "c1", "name": "run", "arguments": "{\"cmd\":\"ls\"}"},
                {"type": "function_call", "call_id": "c2", "name": "spawn_agent", "namespace": "multi_agent_v1",
                 "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
                {"type": "reasoning", "id": "rs_2", "summary": []},
                {"type": "function_call", "call_id": "c3", "name": "run", "arguments": "{}"},
                {"role": "user", "content": "Thanks."},
            ],
            "tools": [RUN, NAMESPACE, {"type": "web_search", "external_web_access": False},
                      {"type": "web_search_preview"}],
            "tool_choice": {"type": "function", "name": "run"}, "parallel_tool_calls": False,
            "max_output_tokens": 99, "temperature": 0.5, "top_p": 0.9, "reasoning": {"summary": "auto"},
        }
        response, raw = ask(proxy, body)
        assert response.status == 200, raw
        (sent,) = chat.requests
    assert sent["path"] == "/v1/chat/completions"
    assert sent["headers"]["authorization"] == "Bearer " + KEY  # the upstream's key, never the client's
    assert sent["body"]["messages"] == [
        {"role": "system", "content": "Be brief.\n\nRules."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "On it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\":\"ls\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "spawn_agent", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "run", "arguments": "{}"}}]},
        {"role": "user", "content": "Thanks."},
    ]
    assert sent["body"]["tools"] == [
        {"type": "function", "function": {"name": "run", "description": "a shell", "strict": False,
                                          "parameters": RUN["parameters"]}},
        {"type": "function", "function": {"name": "spawn_agent", "parameters": {"type": "object"}}},
    ]
    options = {k: v for k, v in sent["body"].items() if k not in ("messages", "tools")}
    assert options == {"model": "scripted-model", "stream": False, "max_tokens": 99, "temperature": 0.5,
                       "top_p": 0.9, "parallel_tool_calls": False,
                       "tool_choice": {"type": "function", "function": {"name": "run"}}}
    answer = json.loads(raw)
    assert (answer["object"], answer["status"], answer["model"]) == ("response", "completed", "scripted-model")
    assert answer["output"][0]["content"][0] == {"type": "output_text", "text": "done", "annotations": []}
    assert answer["usage"]["input_tokens"] == CHAT_USAGE["prompt_tokens"]
    (line,) = calls(proxy.ledger)
    assert (line["route"], line["upstream_route"], line["tools_dropped"], line["reasoning_dropped"]) == (
        "/responses", "/chat/completions", 2, 2)
    assert (line["http_status"], line["error_type"], line["max_tokens"], line["temperature"]) == (200, None, 99, 0.5)
    assert line["input_tokens"] == CHAT_USAGE["prompt_tokens"] and line["response_model"] == "scripted-model"
    assert TOKEN.encode() not in (tmp_path / "calls.jsonl").read_bytes()
    assert run_script("reasoning_ledger.py", "verify", proxy.ledger).returncode == 0


def test_codex_shape_null_instructions_and_string_input(start):
    with ScriptedChat([]) as chat:
        proxy = start(chat.base_url)
        for body in ({"model": "m", "instructions": None, "input": [
                         {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
                         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U"}]}]},
                     {"model": "m", "input": "just text", "tools": [], "tool_choice": "auto",
                      "parallel_tool_calls": True}):
            assert ask(proxy, body)[0].status == 200
        first, second = (r["body"] for r in chat.requests)
    assert first["messages"] == [{"role": "system", "content": "D"}, {"role": "user", "content": "U"}]
    # no tools: tool_choice and parallel_tool_calls, which chat servers refuse alone, stay out
    assert second == {"model": "m", "stream": False, "messages": [{"role": "user", "content": "just text"}]}


@pytest.mark.parametrize("field, item, error_type, named", [
    ("tools", {"type": "custom", "name": "apply_patch"}, "unsupported_tool", "'custom' tool"),
    ("tools", {"type": "file_search"}, "unsupported_tool", "'file_search' tool"),
    ("tools", {"type": "namespace", "name": "n", "tools": [{"type": "code_interpreter"}]}, "unsupported_tool",
     "'code_interpreter' tool"),
    ("tools", {"no": "type"}, "unsupported_tool", "'' tool"),
    ("input", {"type": "local_shell_call", "call_id": "x"}, "unsupported_input", "'local_shell_call'"),
    ("input", {"type": "item_reference", "id": "x"}, "unsupported_input", "'item_reference'"),
])
def test_what_a_chat_server_cannot_take_is_a_clear_400_and_a_line(start, field, item, error_type, named):
    with ScriptedChat([]) as chat:
        proxy = start(chat.base_url)
        body = {"model": "m", "input": [{"role": "user", "content": "hi"}], "tools": [RUN]}
        body[field] = body[field] + [item]
        response, raw = ask(proxy, body)
        assert chat.requests == []  # nothing was sent
    assert response.status == 400
    error = json.loads(raw)["error"]
    assert error["code"] == error_type and named in error["message"]
    assert "chat-completions upstream" in error["message"]
    (line,) = calls(proxy.ledger)
    assert (line["error_type"], line["http_status"], line["route"]) == (error_type, None, "/responses")


HOSTILE_REQUESTS = [
    {"input": [1, None, "text", [], {"type": 5}, {"role": ["x"], "content": {"a": 1}}]},
    {"input": {"not": "a list"}, "instructions": ["a", {"text": "b"}, 3]},
    {"input": [{"type": "function_call", "call_id": [], "name": {}, "arguments": 5},
               {"type": "function_call_output", "call_id": None, "output": {"x": [1]}}]},
    {"input": "hi", "tools": "none"},
    {"input": "hi", "tools": [{"type": "namespace", "tools": "x"}, {"type": "namespace"}, None]},
    {"input": "hi", "tools": [{"type": "function"}], "tool_choice": {"type": "function", "name": [1]}},
    {"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "namespace", "name": "m", "tools": [{"type": "function", "name": "deep"}]}]}]},
    {"input": "hi", "max_output_tokens": "lots", "temperature": None, "stream": "yes"},
]


def test_hostile_client_bodies_are_carried_or_refused_never_a_crash(start):
    with ScriptedChat([]) as chat:
        proxy = start(chat.base_url)
        for body in HOSTILE_REQUESTS:
            response, raw = ask(proxy, dict(body, model="m"))
            assert response.status in (200, 400), raw
        assert ask(proxy, {"model": "m", "input": "still up"})[0].status == 200
        sent = [r["body"] for r in chat.requests]
    assert len(calls(proxy.ledger)) == len(HOSTILE_REQUESTS) + 1
    assert all(type(m["content"]) in (str, type(None)) for body in sent for m in body["messages"])
    code, _out, err = proxy.stop()
    assert code == 0 and "Traceback" not in err, err


def test_upstream_api_must_be_known(tmp_path):
    result = run_script("proxy.py", "--listen", "127.0.0.1:0", "--ledger", tmp_path / "l.jsonl",
                        env=clean_env(BASE_URL="http://127.0.0.1:9/v1", API_KEY=KEY, UPSTREAM_API="anthropic"))
    assert result.returncode == 2 and result.err.startswith("error: UPSTREAM_API must be chat or responses")


# ----------------------------------------------------------------------------
# The answer
# ----------------------------------------------------------------------------

def test_a_streamed_text_answer_is_the_responses_events_codex_reads(start):
    usage = {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
             "prompt_tokens_details": {"cached_tokens": 8}}
    with ScriptedChat([{"text": "Hello from chat.", "reasoning_content": "think", "usage": usage}]) as chat:
        proxy = start(chat.base_url)
        response, raw = ask(proxy, {"model": "m", "input": "hi", "stream": True})
        assert chat.requests[0]["body"]["stream_options"] == {"include_usage": True}
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = sse(raw)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["response.created", "response.output_item.added"]
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert set(kinds[2:-2]) == {"response.output_text.delta"}
    item_id = events[1][1]["item"]["id"]
    assert all(data["item_id"] == item_id for _, data in events[1:-1])
    assert "".join(d["delta"] for k, d in events if k.endswith("text.delta")) == "Hello from chat."
    assert events[-2][1]["item"]["content"][0]["text"] == "Hello from chat."
    done = events[-1][1]["response"]
    assert done["status"] == "completed" and done["output"] == [events[-2][1]["item"]]
    assert done["usage"] == {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 8},
                             "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 45}
    assert events[0][1]["response"]["id"] == done["id"]
    (line,) = calls(proxy.ledger)
    assert (line["stream"], line["input_tokens"], line["cached_input_tokens"], line["finish_reason"]) == (
        True, 40, 8, "stop")
    assert line["response_chars"] == len("Hello from chat.") and line["upstream_route"] == "/chat/completions"


@pytest.mark.parametrize("stream", [True, False])
def test_tool_calls_come_back_as_function_call_items_namespace_kept(start, stream):
    turn = {"text": "Running.", "tool_calls": [{"name": "run", "arguments": {"cmd": "ls -la"}},
                                               {"name": "spawn_agent", "arguments": {"task": "x"}}]}
    with ScriptedChat([turn]) as chat:
        proxy = start(chat.base_url)
        response, raw = ask(proxy, {"model": "m", "input": "go", "stream": stream, "tools": [RUN, NAMESPACE]})
    assert response.status == 200
    if stream:
        events = sse(raw)
        output = events[-1][1]["response"]["output"]
        args = {}
        for kind, data in events:
            if kind == "response.function_call_arguments.delta":
                args[data["item_id"]] = args.get(data["item_id"], "") + data["delta"]
        done = {d["item_id"]: d["arguments"] for k, d in events if k == "response.function_call_arguments.done"}
        assert args == done and len(done) == 2
        added = [d["item"]["type"] for k, d in events if k == "response.output_item.added"]
        assert added == ["message", "function_call", "function_call"]
        assert [d["item"] for k, d in events if k == "response.output_item.done"] == output
    else:
        output = json.loads(raw)["output"]
    message, run, spawn = output
    assert message["content"][0]["text"] == "Running."
    assert (run["type"], run["call_id"], run["name"], json.loads(run["arguments"])) == (
        "function_call", "call_1", "run", {"cmd": "ls -la"})
    assert "namespace" not in run
    assert (spawn["call_id"], spawn["name"], spawn["namespace"]) == ("call_2", "spawn_agent", "multi_agent_v1")
    assert {run["status"], spawn["status"]} == {"completed"}
    (line,) = calls(proxy.ledger)
    assert (line["error_type"], line["finish_reason"]) == (None, "tool_calls")


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_stopped_at_max_tokens_is_incomplete(start, stream):
    srv = HostileServer().start()
    try:
        if stream:
            srv.queue({"name": "sse", "events": ['data: {"choices": [{"delta": {"content": "cut sh"}}]}\n\n',
                                                 'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\n\n',
                                                 "data: [DONE]\n\n"]})
        else:
            srv.queue({"name": "json", "body": {"choices": [{"message": {"content": "cut sh"},
                                                             "finish_reason": "length"}]}})
        proxy = start(srv.base_url)
        response, raw = ask(proxy, {"model": "m", "input": "hi", "stream": stream, "max_output_tokens": 2})
    finally:
        srv.stop()
    if stream:
        kind, answer = sse(raw)[-1]
        assert kind == "response.incomplete"
        answer = answer["response"]
    else:
        answer = json.loads(raw)
    assert (answer["status"], answer["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert answer["output"][0]["content"][0]["text"] == "cut sh"
    (line,) = calls(proxy.ledger)
    assert (line["finish_reason"], line["error_type"], line["max_tokens"]) == ("length", None, 2)


def test_a_stream_cut_early_is_response_failed_never_a_silent_stop(start):
    up = Upstream().start()
    try:
        up.queue("cut")  # two chunks, then the connection closes
        proxy = start(up.base_url)
        conn = proxy.conn()
        response, raw = post(conn, "/responses", {"model": "m", "input": "hi", "stream": True},
                             {"Authorization": "Bearer " + TOKEN})
    finally:
        up.stop()
    events = sse(raw)  # read to the chunked body's clean end
    assert events[0][0] == "response.created" and events[-1][0] == "response.failed"
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "truncated_stream"
    assert not any(kind == "response.completed" for kind, _ in events)
    (line,) = calls(proxy.ledger)
    assert (line["error_type"], line["route"], line["upstream_route"]) == (
        "truncated_stream", "/responses", "/chat/completions")


@pytest.mark.parametrize("stream", [True, False])
def test_an_upstream_error_goes_back_with_its_status_and_a_line(start, stream):
    up = Upstream().start()
    try:
        up.queue({"name": "error", "status": 429, "headers": {"Retry-After": "7"}})
        proxy = start(up.base_url)
        response, raw = ask(proxy, {"model": "m", "input": "hi", "stream": stream})
    finally:
        up.stop()
    assert response.status == 429 and json.loads(raw)["error"]["message"] == "upstream says no"
    assert "7" in response.getheader("Retry-After")  # passed back (the stand-in sends it twice)
    (line,) = calls(proxy.ledger)
    assert (line["error_type"], line["http_status"], line["upstream_route"]) == (
        "rate_limited", 429, "/chat/completions")


HOSTILE_BODIES = [
    [1, 2],
    {"choices": "none"},
    {"choices": []},
    {"choices": [{"message": "text"}]},
    {"choices": [{"message": {"content": 5, "tool_calls": "no"}}]},
    {"choices": [{"message": {"content": ["a", {"text": "b"}],
                              "tool_calls": [1, {"function": []}, {"index": [], "id": 7, "function": {"name": 3}},
                                             {"index": 2, "function": {"name": "x", "arguments": {"a": 1}}}]}}]},
    {"choices": [{"message": {"content": "fine"}}], "usage": {"prompt_tokens": "many"}, "model": ["x"]},
]
HOSTILE_STREAMS = [  # (events, the last Responses event's type and error code)
    (['data: {"choices": [{"delta": "x"}]}\n\n', 'data: [1]\n\n', 'data: {"choices": 5}\n\n',
      "data: [DONE]\n\n"], ("response.completed", None)),
    (['data: {"choices": [{"delta": {"tool_calls": [{"index": {}}, 3, {"index": 0, "function": "f"}]}}]}\n\n',
      'data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 9}}]},'
      ' "finish_reason": "tool_calls"}]}\n\n', "data: [DONE]\n\n"], ("response.completed", None)),
    (['data: {"choices": [{"index": 1, "delta": {"content": "other choice"}}]}\n\n',
      'data: {"choices": [{"delta": {"content": "mine"}, "finish_reason": "stop"}]}\n\n', "data: [DONE]\n\n"],
     ("response.completed", None)),
    (['data: {"choices": [{"delta": {"content": "half"}}]}\n\n', "data: {\"choi"],
     ("response.failed", "truncated_stream")),
    (["event: error\ndata: {\"error\": {\"message\": \"overloaded\"}}\n\n"], ("response.failed", "api_error")),
    # an upstream stream with no answer in it is a failure Codex is told of, never an empty turn
    (["data: [DONE]\n\n"], ("response.failed", "empty_stream")),
    ([": a comment, then the connection closes\n\n"], ("response.failed", "empty_stream")),
]


def test_hostile_upstream_bodies_and_streams_never_break_the_bridge(start):
    srv = HostileServer().start()
    try:
        for body in HOSTILE_BODIES:
            srv.queue({"name": "json", "body": body})
        for events, _verdict in HOSTILE_STREAMS:
            srv.queue({"name": "sse", "events": events})
        proxy = start(srv.base_url)
        for body in HOSTILE_BODIES:
            response, raw = ask(proxy, {"model": "m", "input": "hi"})
            assert response.status in (200, 502), raw
            answer = json.loads(raw)
            assert answer.get("object") == "response" or answer["error"]["message"].startswith("upstream: ")
        for _events, verdict in HOSTILE_STREAMS:  # a stream always ends with its verdict
            response, raw = ask(proxy, {"model": "m", "input": "hi", "stream": True})
            kind, last = sse(raw)[-1]
            assert response.status == 200 and (kind, (last["response"]["error"] or {}).get("code")) == verdict
        response, raw = ask(proxy, {"model": "m", "input": "hi"})  # and the proxy still serves
        assert response.status == 200 and json.loads(raw)["output"][0]["content"][0]["text"] == ANSWER
    finally:
        srv.stop()
    lines = calls(proxy.ledger)
    assert len(lines) == len(HOSTILE_BODIES) + len(HOSTILE_STREAMS) + 1
    assert {line["upstream_route"] for line in lines} == {"/chat/completions"}
    code, _out, err = proxy.stop()
    assert code == 0 and "Traceback" not in err, err


def test_without_upstream_api_responses_is_relayed_as_it_is(start):
    up = Upstream().start()
    try:
        proxy = start(up.base_url, UPSTREAM_API="responses")
        response, raw = ask(proxy, {"model": "m", "input": "hi"})
    finally:
        up.stop()
    assert response.status == 200 and up.requests[0]["path"] == "/v1/responses"
    (line,) = calls(proxy.ledger)
    assert "upstream_route" not in line


def test_a_client_that_leaves_mid_stream_is_recorded(start):
    up = Upstream().start()
    try:
        up.queue("gated")
        proxy = start(up.base_url)
        conn = proxy.conn()
        conn.request("POST", "/v1/responses", body=json.dumps({"model": "m", "input": "hi", "stream": True}),
                     headers={"Content-Type": "application/json", "Authorization": "Bearer " + TOKEN})
        response = conn.getresponse()
        assert response.status == 200
        assert up.first_sent.wait(60)
        conn.sock.shutdown(2)
        conn.close()
        up.gate.set()
        code, _out, err = proxy.stop()
    finally:
        up.stop()
    assert code == 0 and "Traceback" not in err
    (line,) = calls(proxy.ledger)
    assert line["route"] == "/responses" and line["error_type"] in (None, "client_gone")


def test_http_client_sees_a_whole_chunked_body(start):
    """The stream's chunked framing ends with its zero chunk: http.client reads it without error."""
    with ScriptedChat([{"text": "x"}]) as chat:
        proxy = start(chat.base_url)
        conn = proxy.conn()
        for _ in range(2):  # and the connection is kept for the next request
            response, raw = post(conn, "/responses", {"model": "m", "input": "hi", "stream": True},
                                 {"Authorization": "Bearer " + TOKEN})
            assert response.status == 200 and sse(raw)[-1][0] == "response.completed"
