"""`proxy.py --store-text`: the conversation kept in LEDGER.text/, sessions, `verify --text` and
`audit.py --conversation`, with the proxy a subprocess and the scripted upstream on real sockets.
The normalisers' shapes (chat, Responses, Anthropic Messages) are checked on bodies built here."""

import hashlib
import json
import stat
import threading

import pytest

import proxy as proxy_script
import reasoning_ledger as rl
from conftest import KEY, all_bytes_under, parse_html, run_script
from fake_upstream import ANSWER, REASONING, Upstream
from proxy_helpers import Proxy, events, post

CHAT = {"model": "up-model", "messages": [{"role": "user", "content": "2+2?"}]}


@pytest.fixture
def upstream():
    up = Upstream().start()
    yield up
    up.stop()


@pytest.fixture
def start(upstream, tmp_path):
    started = []

    def go(*args, **env):
        proxy = Proxy(upstream.base_url, tmp_path / "calls.jsonl", *args, **env)
        started.append(proxy)
        return proxy
    yield go
    for proxy in started:
        proxy.stop()


def calls(path):
    return [e["payload"] for e in rl.read_events(path) if e["kind"] == "model_call"]


def stored(ledger, name):
    """The entry a line names, read back from the store, after checking the file is its hash."""
    data = (rl.text_dir(ledger) / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == name
    return json.loads(data)


def texts(entry):
    return [p.get("text") or p.get("arguments") for p in entry["parts"]]


# ----------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------

def test_without_the_flag_nothing_of_the_text_is_kept(start, tmp_path):
    proxy = start()
    post(proxy.conn(), "/chat/completions", CHAT)
    (line,) = calls(proxy.ledger)
    assert "messages_text" not in line and "answer_text" not in line
    assert line["session_id"] is None and line["session_source"] is None
    assert not rl.text_dir(proxy.ledger).exists()


@pytest.mark.parametrize("stream", [False, True])
def test_messages_and_answer_are_stored_private_and_named_by_the_line(start, upstream, stream):
    proxy = start("--store-text")
    upstream.queue("reasoning")
    body = dict(CHAT, stream=stream, messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}])
    response, raw = post(proxy.conn(), "/chat/completions", body)
    assert response.status == 200 and (len(events(raw)) > 2 if stream else json.loads(raw)["choices"])
    (line,) = calls(proxy.ledger)
    assert [stored(proxy.ledger, n) for n in line["messages_text"]] == [
        {"role": "system", "parts": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "parts": [{"type": "text", "text": "2+2?"}]}]
    assert stored(proxy.ledger, line["answer_text"]) == {"role": "assistant", "parts": [
        {"type": "reasoning", "text": REASONING}, {"type": "text", "text": ANSWER}]}
    store = rl.text_dir(proxy.ledger)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in store.iterdir()} == {0o600} and len(list(store.iterdir())) == 3
    proc = run_script("reasoning_ledger.py", "verify", "--text", proxy.ledger)
    assert proc.returncode == 0 and not proc.err, proc.err


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_call_keeps_instructions_items_and_answer(start, stream):
    proxy = start("--store-text")
    post(proxy.conn(), "/responses", {"model": "up-model", "instructions": "Be brief.", "stream": stream, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "use ls"}], "encrypted_content": "zz"},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "shell", "arguments": "{\"cmd\":\"ls\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]})
    (line,) = calls(proxy.ledger)
    entries = [stored(proxy.ledger, n) for n in line["messages_text"]]
    assert [(e["role"], texts(e)) for e in entries] == [
        ("system", ["Be brief."]), ("user", ["list files"]), ("assistant", ["use ls"]),
        ("assistant", ['{"cmd":"ls"}']), ("tool", ["a.txt"])]
    assert texts(stored(proxy.ledger, line["answer_text"])) == [ANSWER]


def test_fifty_calls_of_a_growing_conversation_store_each_message_once(start):
    proxy = start("--store-text")
    conn, messages = proxy.conn(), []
    for n in range(50):
        messages.append({"role": "user", "content": f"question {n}: " + "x" * 200})
        response, raw = post(conn, "/chat/completions", dict(CHAT, messages=messages))
        messages.append(json.loads(raw)["choices"][0]["message"])
    lines = calls(proxy.ledger)
    assert [len(line["messages_text"]) for line in lines] == [2 * n + 1 for n in range(50)]
    files = list(rl.text_dir(proxy.ledger).iterdir())
    # 50 questions and the one answer the upstream always gives, which the client sends back
    assert len(files) == 51 and len({h for line in lines for h in line["messages_text"]}) == 51
    assert sum(f.stat().st_size for f in files) < 51 * 300  # linear, not 50 copies of a growing list
    assert all(line["session_id"] == lines[0]["session_id"] for line in lines)


def test_eight_clients_at_once_sharing_messages_every_line_and_file_whole(start):
    proxy = start("--store-text")
    errors = []

    def client(n):
        try:
            conn, messages = proxy.conn(), [{"role": "system", "content": "Shared rules."}]
            for step in range(8):
                messages.append({"role": "user", "content": f"step {step % 3}"})  # shared by all
                response, raw = post(conn, "/chat/completions", dict(CHAT, messages=messages, stream=n % 2 == 0))
                assert response.status == 200
                messages.append({"role": "assistant", "content": ANSWER})
        except (AssertionError, OSError) as exc:
            errors.append(exc)
    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(calls(proxy.ledger)) == 64
    assert len(list(rl.text_dir(proxy.ledger).iterdir())) == 5  # rules, three steps, the answer
    assert run_script("reasoning_ledger.py", "verify", "--text", proxy.ledger).returncode == 0


def test_secrets_in_messages_tool_calls_and_results_are_masked_in_every_file(start, tmp_path):
    proxy = start("--store-text", PROXY_TOKEN="tok-" + "9" * 20)
    secret = "password=hunter2hunter2hunter2"
    messages = [{"role": "user", "content": f"my key is {KEY} and {secret}"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "run", "arguments": json.dumps({"cmd": f"curl -H 'Authorization: Bearer {KEY}'"})}}]},
                {"role": "tool", "tool_call_id": "c", "content": f"token tok-{'9' * 20} ok"}]
    response, _raw = post(proxy.conn(), "/chat/completions", dict(CHAT, messages=messages),
                          {"Authorization": "Bearer tok-" + "9" * 20})
    assert response.status == 200
    (line,) = calls(proxy.ledger)
    assert len(line["messages_text"]) == 3
    blob = all_bytes_under(tmp_path)
    assert KEY.encode() not in blob and b"hunter2" not in blob and b"9" * 20 not in blob
    assert b"[REDACTED]" in (rl.text_dir(proxy.ledger) / line["messages_text"][0]).read_bytes()


HOSTILE = {
    "non-string content": {"messages": [{"role": "user", "content": 7}, {"role": 5, "content": {"a": [1]}},
                                        {"role": "assistant", "content": [None, 3, {"type": None}], "tool_calls": 9}]},
    "null messages": {"messages": [None, None]},
    "messages null": {"messages": None},
    "huge": {"messages": [{"role": "user", "content": "y" * 3_000_000}]},
    "nested": {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": [[[[[[[[1]]]]]]]]}}]}]},
    "deep": {"messages": [{"role": "user", "content": json.loads("[" * 500 + "]" * 500)}]},
    "surrogate": {"messages": [{"role": "user", "content": "\ud800 lone"}]},
    "tool result parts": {"messages": [{"role": "tool", "content": [{"type": "image"}, "x", None]}]},
    "responses odd": {"input": [5, None, {"type": "function_call", "arguments": {"x": 1}}, {"type": 3}], "instructions": [1]},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_message_shapes_never_crash_and_give_one_line(start, name):
    proxy = start("--store-text")
    route = "/responses" if "input" in HOSTILE[name] else "/chat/completions"
    response, raw = post(proxy.conn(), route, dict(HOSTILE[name], model="up-model"))
    assert response.status in (200, 400) and json.loads(raw)
    (line,) = calls(proxy.ledger)
    assert run_script("reasoning_ledger.py", "verify", "--text", proxy.ledger).returncode == 0
    assert proxy.proc.poll() is None


def test_a_store_that_cannot_be_written_costs_the_call_nothing(start, tmp_path):
    (tmp_path / "calls.jsonl.text").write_text("a file where the store's directory should be")
    proxy = start("--store-text")
    response, raw = post(proxy.conn(), "/chat/completions", CHAT)
    assert response.status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == ANSWER
    (line,) = calls(proxy.ledger)
    assert "messages_text" not in line and "answer_text" not in line and line["error_type"] is None
    code, _out, err = proxy.stop()
    assert code == 0 and "error: the text store: " in err and "calls.jsonl.text" in err


def test_a_conversation_past_the_lines_limit_still_gives_its_line(start):
    proxy = start("--store-text", "--no-fsync")
    count = proxy_script.MAX_NAMED + 2000
    messages = [{"role": "user", "content": f"m{n}"} for n in range(count)]
    response, _raw = post(proxy.conn(), "/chat/completions", dict(CHAT, messages=messages))
    assert response.status == 200
    (line,) = calls(proxy.ledger)
    assert len(line["messages_text"]) == proxy_script.MAX_NAMED and line["message_count"] == count
    earlier = stored(proxy.ledger, line["messages_text"][0])
    assert earlier["role"] == "earlier" and texts(earlier)[:4] == ["[user]", "m0", "[user]", "m1"]
    assert stored(proxy.ledger, line["messages_text"][-1])["parts"][0]["text"] == f"m{count - 1}"


# ----------------------------------------------------------------------------
# verify --text
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("harm", ["deleted", "changed"])
def test_verify_text_fails_on_a_missing_or_changed_file_and_warns_without(start, harm):
    proxy = start("--store-text")
    post(proxy.conn(), "/chat/completions", CHAT)
    (line,) = calls(proxy.ledger)
    target = rl.text_dir(proxy.ledger) / line["answer_text"]
    target.unlink() if harm == "deleted" else target.write_bytes(b'{"role":"assistant","parts":[]}')
    plain = run_script("reasoning_ledger.py", "verify", proxy.ledger)
    assert plain.returncode == 0 and "warning:" in plain.err and line["answer_text"] in plain.err
    strict = run_script("reasoning_ledger.py", "verify", "--text", proxy.ledger)
    assert strict.returncode == 1 and "FAIL" in strict.out and line["answer_text"] in strict.out
    assert ("No such file" if harm == "deleted" else "changed") in strict.out


def test_verify_text_refuses_a_name_that_is_not_a_hash(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    with rl.Ledger(ledger) as book:
        book.append("model_call", {"messages_text": ["../../etc/passwd"], "answer_text": book.store_text(
            {"role": "assistant", "parts": []})})
    proc = run_script("reasoning_ledger.py", "verify", "--text", ledger)
    assert proc.returncode == 1 and "is not a SHA-256" in proc.out


# ----------------------------------------------------------------------------
# Sessions
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("headers,source", [
    ({"X-Ledger-Session": "mine", "session-id": "codex-1"}, "x-ledger-session"),
    ({"session-id": "codex-1"}, "session-id"),
    ({"X-Claude-Code-Session-Id": "claude-1"}, "x-claude-code-session-id"),
])
def test_a_session_named_by_a_header(start, headers, source):
    proxy = start()  # headers name sessions with or without --store-text
    post(proxy.conn(), "/chat/completions", CHAT, headers)
    (line,) = calls(proxy.ledger)
    assert (line["session_id"], line["session_source"]) == (next(iter(headers.values())), source)


def test_calls_that_extend_a_conversation_share_one_session(start):
    proxy = start("--store-text")
    conn, first = proxy.conn(), [{"role": "user", "content": "first question"}]
    post(conn, "/chat/completions", dict(CHAT, messages=first))
    post(conn, "/chat/completions", dict(CHAT, messages=[{"role": "user", "content": "another conversation"}]))
    grown = first + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "and then?"}]
    post(conn, "/chat/completions", dict(CHAT, messages=grown))
    post(conn, "/chat/completions", dict(CHAT, messages=grown + [{"role": "user", "content": "more"}]))
    one, other, two, three = calls(proxy.ledger)
    assert {line["session_source"] for line in (one, other, two, three)} == {"conversation"}
    assert one["session_id"] == two["session_id"] == three["session_id"] != other["session_id"]
    assert one["session_id"].startswith("conv-")


# ----------------------------------------------------------------------------
# audit.py --conversation
# ----------------------------------------------------------------------------

def _recorded_session(proxy, upstream):
    """A session with a tool call, its result, reasoning and a hostile text; returns the messages."""
    conn, headers = proxy.conn(), {"X-Ledger-Session": "task-42"}
    upstream.queue("tools", "reasoning")
    messages = [{"role": "user", "content": "What is in the folder? <script>alert(1)</script>\x1b[31m"}]
    _r, raw = post(conn, "/chat/completions", dict(CHAT, messages=messages), headers)
    messages += [json.loads(raw)["choices"][0]["message"],
                 {"role": "tool", "tool_call_id": "call_1", "content": "notes.txt\n" + "z" * 5000}]
    post(conn, "/chat/completions", dict(CHAT, messages=messages, stream=True), headers)
    return messages


def test_audit_conversation_shows_the_session_as_a_timeline(start, upstream, tmp_path):
    proxy = start("--store-text")
    _recorded_session(proxy, upstream)
    page = tmp_path / "conversation.html"
    proc = run_script("audit.py", "--conversation", "task", proxy.ledger, "--html", page)
    assert proc.returncode == 0, proc.err
    out = proc.out
    assert "\x1b" not in out and "\\x1b[31m" in out and "Conversation task-42" in out
    for text in ("What is in the folder?", 'run({"cmd": "ls"})', "notes.txt", REASONING, ANSWER,
                 "served up-model", "tokens 21 in, 6 out"):
        assert text in out, text
    assert out.count("What is in the folder?") == 1 and out.count("run({") == 1  # each message once
    assert "z" * 1980 in out and "z" * 2000 not in out  # a tool result is bounded
    order = [out.index(t) for t in ("What is in", "run({", "notes.txt", REASONING, ANSWER)]
    assert order == sorted(order)
    raw = page.read_text()
    assert "<script>alert" not in raw and "&lt;script&gt;" in raw
    text = parse_html(raw).text()
    assert "What is in the folder?" in text and REASONING in text and "notes.txt" in text


def test_audit_conversation_says_which_text_is_missing_or_changed(start, upstream):
    proxy = start("--store-text")
    _recorded_session(proxy, upstream)
    first, second = calls(proxy.ledger)
    (rl.text_dir(proxy.ledger) / first["messages_text"][0]).unlink()
    (rl.text_dir(proxy.ledger) / second["answer_text"]).write_text('{"role": "assistant", "parts": []}')
    proc = run_script("audit.py", "--conversation", "task-42", proxy.ledger)
    assert proc.returncode == 0 and "No such file" in proc.out and "[changed]" in proc.out
    assert "notes.txt" in proc.out  # the rest is shown


def test_audit_conversation_refuses_an_unknown_or_ambiguous_session(start):
    proxy = start("--store-text")
    for session in ("task-1", "task-2"):
        post(proxy.conn(), "/chat/completions", CHAT, {"X-Ledger-Session": session})
    for given, words in (("task", "2 sessions match"), ("nope", "no session")):
        proc = run_script("audit.py", "--conversation", given, proxy.ledger)
        assert proc.returncode == 2 and words in proc.err and proc.err.count("\n") == 1
    assert run_script("audit.py", "--conversation", "task-2", proxy.ledger).returncode == 0


# ----------------------------------------------------------------------------
# The normalisers, on the three wire shapes (pure functions: bodies built here)
# ----------------------------------------------------------------------------

ANTHROPIC = {"model": "m", "system": [{"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}],
             "messages": [
                 {"role": "user", "content": "list files"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "use ls", "signature": "sig"},
                     {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                               "content": [{"type": "text", "text": "a.txt"}]}]}]}


def test_anthropic_messages_are_normalised_and_cache_control_is_left_out():
    entries = proxy_script.conversation("/messages", ANTHROPIC)
    assert entries == [
        ("system", [{"type": "text", "text": "Be kind."}]),
        ("user", [{"type": "text", "text": "list files"}]),
        ("assistant", [{"type": "reasoning", "text": "use ls"},
                       {"type": "tool_call", "id": "t1", "name": "bash", "arguments": '{"cmd":"ls"}'}]),
        ("user", [{"type": "tool_result", "id": "t1", "text": "a.txt"}])]
    moved = json.loads(json.dumps(ANTHROPIC))  # Claude Code moves cache_control from block to block
    del moved["system"][0]["cache_control"]
    moved["messages"][2]["content"][0]["cache_control"] = {"type": "ephemeral"}
    assert proxy_script.conversation("/messages", moved) == entries
    assert proxy_script.conversation("/messages/count_tokens", ANTHROPIC) == entries


def test_anthropic_answers_whole_and_streamed_are_the_same_parts():
    whole = {"type": "message", "role": "assistant", "content": [
        {"type": "thinking", "thinking": "think", "signature": "s"}, {"type": "text", "text": "Files:"},
        {"type": "tool_use", "id": "t2", "name": "bash", "input": {"cmd": "ls -l"}}]}
    stream = [{"type": "message_start", "message": {"content": []}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "thi"}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "nk"}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "s"}},
              {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
              {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Files:"}},
              {"type": "content_block_start", "index": 2,
               "content_block": {"type": "tool_use", "id": "t2", "name": "bash", "input": {}}},
              {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"cmd": '}},
              {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '"ls -l"}'}},
              {"type": "message_delta", "delta": {"stop_reason": "tool_use"}}, {"type": "message_stop"}]
    parts = proxy_script.answer([whole])
    assert parts == [{"type": "reasoning", "text": "think"}, {"type": "text", "text": "Files:"},
                     {"type": "tool_call", "id": "t2", "name": "bash", "arguments": '{"cmd":"ls -l"}'}]
    assert proxy_script.answer(stream) == parts
    # the answer, sent back by the client as its next message, is the same entry
    assert proxy_script.conversation("/messages", {"messages": [whole]})[0][1] == parts


def test_responses_answers_with_reasoning_whole_and_streamed():
    output = [{"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "think"}]},
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
              {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    parts = [{"type": "reasoning", "text": "think"}, {"type": "text", "text": "Hi"},
             {"type": "tool_call", "id": "c", "name": "f", "arguments": "{}"}]
    assert proxy_script.answer([{"object": "response", "output": output}]) == parts
    done = [{"type": "response.output_item.done", "item": item} for item in output]
    assert proxy_script.answer([{"type": "response.created", "response": {"output": []}}] + done) == parts
    completed = {"type": "response.completed", "response": {"output": output}}
    assert proxy_script.answer(done + [completed]) == parts  # never twice


def test_chat_tool_call_deltas_are_joined():
    chunks = [{"choices": [{"delta": {"role": "assistant", "reasoning_content": "r"}}]},
              {"choices": [{"delta": {"role": "assistant", "tool_calls": [
                  {"index": 0, "id": "c", "type": "function", "function": {"name": "run", "arguments": '{"a'}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '":1}'}}]}}]},
              {"choices": [], "usage": {"prompt_tokens": 1}}]
    assert proxy_script.answer(chunks) == [{"type": "reasoning", "text": "r"},
                                           {"type": "tool_call", "id": "c", "name": "run", "arguments": '{"a":1}'}]
