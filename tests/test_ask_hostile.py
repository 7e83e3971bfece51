"""ask.py against an endpoint that does what no well-behaved server would (tests/hostile_server.py, a raw
socket). Whatever the server does, an attempt ends in exactly one ledger line, a clear error, no traceback,
and the key goes nowhere but the configured host."""

import json
import subprocess
import sys
import time

import pytest

import ask
import reasoning_ledger as rl
from conftest import (KEY, ROOT, all_bytes_under, clean_env, error_lines, lines_of, run_script,
                      tls_certificate)
from hostile_server import HostileServer

PROMPT = "What is 2 + 2?"


@pytest.fixture
def call(hostile, tmp_path):
    """Run ask.py against the hostile server; return (proc, events written by this call)."""
    ledger = tmp_path / "calls.jsonl"

    def run(*args, scenarios=(), prompt=PROMPT, timeout=60, **env):
        hostile.queue(*scenarios)
        before = len(ledger.read_bytes().splitlines()) if ledger.exists() else 0
        settings = dict(BASE_URL=hostile.base_url, API_KEY=KEY, MODEL_ID="hostile-model", LEDGER=ledger)
        settings.update(env)
        proc = run_script("ask.py", *args, input=prompt, env=clean_env(**settings), cwd=tmp_path, timeout=timeout)
        new = ledger.read_bytes().splitlines()[before:] if ledger.exists() else []
        events = [json.loads(line) for line in new]
        return proc, events

    run.ledger = ledger
    return run


# ----------------------------------------------------------------------------
# Redirects: the key never follows
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("models", [False, True])
def test_a_redirect_is_recorded_and_never_followed(call, status, models):
    with HostileServer() as elsewhere:
        elsewhere.start()
        target = elsewhere.base_url.replace("127.0.0.1", "localhost") + ("/models" if models else "/chat/completions")
        proc, events = call(*(["--models"] if models else []),
                            scenarios=[{"name": "redirect", "status": status, "location": target}])
        assert elsewhere.requests == []  # nothing, with or without the key, reached the other host
    assert proc.returncode == 1 and "Traceback" not in proc.err
    (event,) = events
    assert event["kind"] == ("models_list" if models else "model_call")
    payload = event["payload"]
    assert payload["error_type"] == "redirect" and payload["http_status"] == status
    assert payload["redirect_host"] == target.split("/")[2]
    (line,) = error_lines(proc.err)
    assert "redirect" in line and target.split("/")[2] in line and KEY not in proc.err


# ----------------------------------------------------------------------------
# Transport and framing: one line per attempt, retryable
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("scenario,error_type,words", [
    ("short_body", "truncated_response", "short of its Content-Length"),
    ({"name": "short_body", "content_length": 500, "sent": 100, "headers": {"Transfer-Encoding": "identity"}},
     "truncated_response", "short"),
    ("garbage_status", "connection_error", "BadStatusLine"),
    ("empty_reply", "connection_error", "RemoteDisconnected"),
    ("long_header", "connection_error", "LineTooLong"),
    ("many_headers", "connection_error", "more than 100 headers"),
    ("reset", "connection_error", "ConnectionReset"),
    ({"name": "raw", "data": b"HTTP/1.1 200 OK\r\nContent-Length: 9999999999999999999999\r\n\r\n{}"},
     "response_too_large", "limit"),
    ({"name": "raw", "data": b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}"}, "no_choices", "no choices"),
    ({"name": "sse", "events": ['data: {"choices":[{"delta":{"content":"The ans'], "cut": True},
     "truncated_stream", "middle of an event"),
])
def test_transport_and_framing_failures_end_in_one_line(call, scenario, error_type, words):
    stream = isinstance(scenario, dict) and scenario["name"] == "sse"
    proc, events = call(*(["--stream"] if stream else []), scenarios=[scenario])
    payload = _check_one_line(proc, events, error_type)
    assert words in payload["error_message"]


def _check_one_line(proc, events, error_type, code=1):
    assert "Traceback" not in proc.err, proc.err
    assert len(events) == 1, events
    payload = events[0]["payload"]
    assert payload["error_type"] == error_type, payload
    assert proc.returncode == code, proc.err
    lines = error_lines(proc.err)
    assert len(lines) == 1 and error_type in lines[0], proc.err
    return payload


@pytest.mark.parametrize("broken", ["short_body", "garbage_status", "empty_reply", "reset", "long_header"])
def test_a_broken_answer_is_retried_and_each_attempt_has_its_line(call, broken):
    proc, events = call("--retries", "1", "--backoff", "0.01", scenarios=[broken, "ok"])
    assert proc.returncode == 0, proc.err
    assert proc.out == "The answer is 4.\n"
    first, second = (e["payload"] for e in events)
    assert first["error_type"] in ("truncated_response", "connection_error") and first["retry_in_s"] is not None
    assert first["retry_reason"].startswith(first["error_type"] + ": ")
    assert second["error_type"] is None and second["attempt"] == 2
    (warning,) = [line for line in proc.err.splitlines() if line.startswith("warning: attempt 1 failed")]
    assert first["error_type"] in warning and "retrying in" in warning


def test_every_line_verifies_after_the_hostile_scenarios(call):
    for scenario in ("short_body", "garbage_status", "reset", "ok"):
        call(scenarios=[scenario])
    assert rl.verify(call.ledger).count == 4


# ----------------------------------------------------------------------------
# The deadline: --timeout bounds the whole attempt
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags,scenario", [
    ([], {"name": "trickle", "interval": 0.05, "total_seconds": 300}),
    (["--stream"], {"name": "sse_keepalive", "interval": 0.1, "total_seconds": 300}),
    ([], {"name": "hang", "seconds": 300}),
])
def test_timeout_is_a_deadline_for_the_whole_attempt(call, flags, scenario):
    started = time.monotonic()
    proc, events = call("--timeout", "1", *flags, scenarios=[scenario])
    elapsed = time.monotonic() - started
    payload = _check_one_line(proc, events, "timeout")
    # every read was fast; only a deadline for the whole attempt ends this long before the server's 300 s
    assert 900 <= payload["latency_ms"] < 150000
    assert elapsed < 150


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize("flags,scenario", [
    ([], {"name": "trickle", "interval": 0.5, "total_seconds": 600}),
    (["--stream"], {"name": "sse_keepalive", "interval": 0.1, "total_seconds": 600}),
])
def test_the_deadline_cuts_the_connection_over_tls_too(tmp_path, tls, flags, scenario):
    # the answer would take minutes to arrive; the attempt ends at its deadline and the server sees
    # the connection cut then, not at the answer's end. TLS takes over the descriptor of the socket
    # it wraps: the deadline must still reach it.
    cert, context = tls_certificate(tmp_path) if tls else (None, None)
    with HostileServer(tls=context).start() as server:
        server.queue(scenario)
        env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="hostile-model",
                        LEDGER=tmp_path / "calls.jsonl", **({"SSL_CERT_FILE": cert} if tls else {}))
        proc = run_script("ask.py", "--timeout", "2", *flags, input=PROMPT, env=env, cwd=tmp_path,
                          timeout=900)
        events = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_bytes().splitlines()]
        _check_one_line(proc, events, "timeout")
        assert server.cut.wait(120) and len(server.requests) == 1


# ----------------------------------------------------------------------------
# Size caps: memory does not grow with a hostile body
# ----------------------------------------------------------------------------

MEASURE = r"""
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], input=b"hi", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
sys.stderr.buffer.write(proc.stderr)
print(proc.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
"""


@pytest.mark.parametrize("scenario,flags", [
    ({"name": "huge_body", "size": 200_000_000}, []),
    ({"name": "huge_chunked", "size": 200_000_000}, []),
    ({"name": "huge_sse_line", "size": 200_000_000}, ["--stream"]),
    ({"name": "huge_chunked", "size": 200_000_000}, ["--stream"]),
])
def test_a_200_mb_body_is_refused_without_being_held(hostile, tmp_path, scenario, flags):
    hostile.queue(scenario)
    env = clean_env(BASE_URL=hostile.base_url, API_KEY=KEY, MODEL_ID="hostile-model",
                    LEDGER=tmp_path / "calls.jsonl")
    proc = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, str(ROOT / "ask.py"), *flags],
                          capture_output=True, env=env, timeout=120)
    code, peak_mib = map(int, proc.stdout.split())
    assert code == 1 and b"Traceback" not in proc.stderr, proc.stderr
    (event,) = lines_of(tmp_path / "calls.jsonl")
    assert event["payload"]["error_type"] == "response_too_large"
    assert peak_mib < 80, f"peak RSS {peak_mib} MiB for a 200 MB body"  # the default cap is 8 MiB


def test_max_response_bytes_is_the_cap(call):
    proc, events = call("--max-response-bytes", "2000", scenarios=[{"name": "huge_body", "size": 5000}])
    assert _check_one_line(proc, events, "response_too_large")
    proc, events = call("--max-response-bytes", "100000", scenarios=[{"name": "huge_body", "size": 5000}])
    assert events[0]["payload"]["error_type"] != "response_too_large"


# ----------------------------------------------------------------------------
# Values the server chose: malformed_response, and the user still gets the answer
# ----------------------------------------------------------------------------

def _completion(**overrides):
    body = {"id": "c1", "object": "chat.completion", "model": "hostile-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is 4."},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}}
    body.update(overrides)
    return json.dumps(body)


@pytest.mark.parametrize("body,words,answer", [
    (_completion(model="\ud800bad"), "model holds a lone surrogate", "The answer is 4."),
    (_completion(model=["a", "list"]), "model is a list", "The answer is 4."),
    (_completion(id={"nested": True}), "id is a dict", "The answer is 4."),
    (_completion(model="m" * 5000), "model was cut from 5000 to 512", "The answer is 4."),
    (_completion().replace('"total_tokens": 10', '"total_tokens": NaN'), "NaN in the body", "The answer is 4."),
    (_completion().replace('"completion_tokens": 5', '"completion_tokens": -Infinity'), "-Infinity", "The answer is 4."),
    (_completion(choices=[{"message": {"content": [1, {"text": 5}, {"type": "text", "text": "ok"}]}}]),
     "content[0] is a int", "ok"),
    (_completion(choices=[{"message": {"content": "fine\ud83d"}, "finish_reason": "stop"}]), "lone surrogate",
     "fine\ufffd"),
    (_completion(choices=[{"message": "not an object"}]), "message is a str", None),
    (_completion(choices=["just a string"]), "choices[0] is a str", None),
    (_completion(choices=[{"message": {"content": "x"}, "finish_reason": 7}]), "finish_reason is a int", "x"),
])
def test_a_body_that_parses_but_is_wrong_is_malformed_response(call, body, words, answer):
    proc, events = call(scenarios=[{"name": "json", "body": body}])
    payload = _check_one_line(proc, events, "malformed_response")
    assert any(words in problem for problem in payload["malformed"]), payload["malformed"]
    if answer:
        assert proc.out == answer + "\n"  # when there is an answer, the user gets it
    else:
        assert proc.out == ""


@pytest.mark.parametrize("body,error_type", [
    (_completion(choices="a string"), "no_choices"),
    (_completion(choices=[]), "no_choices"),
    ('[1, 2, 3]', "invalid_json"),
    ('"just a string"', "invalid_json"),
    pytest.param("[" * 100000 + "]" * 100000, "malformed_response", id="deep-array"),
    pytest.param('{"a":' * 50000 + "1" + "}" * 50000, "malformed_response", id="deep-object"),
    (b'{"choices": "\xff\xfe"}', "invalid_json"),
    (_completion(error={"message": "upstream failed", "code": "context_length_exceeded"}, choices=None), "api_error"),
])
def test_bodies_of_the_wrong_shape(call, body, error_type):
    proc, events = call(scenarios=[{"name": "json", "body": body}])
    payload = _check_one_line(proc, events, error_type)
    if error_type == "api_error":
        assert payload["error_code"] == "context_length_exceeded"


@pytest.mark.parametrize("events,words", [
    (['data: {"choices":[{"delta":"just text"}]}\n\n', "data: [DONE]\n\n"], "delta is a str"),
    (['data: {"choices":"x"}\n\n', "data: [DONE]\n\n"], "choices is a str"),
    (['data: {"choices":["x"]}\n\n', "data: [DONE]\n\n"], "stream choice is a str"),
    (["data: not json at all\n\n", "data: [DONE]\n\n"], "not a JSON object"),
    (['data: {"choices":[{"delta":{"content":"The answer"}}]}\n\n', 'data: {"model": 5, "choices":[]}\n\n',
      "data: [DONE]\n\n"], "model is a int"),
    (['data: {"choices":[{"delta":{"content":[{"text":"The answer"}, 3]}}]}\n\n', "data: [DONE]\n\n"],
     "content[1] is a int"),
])
def test_malformed_stream_chunks(call, events, words):
    proc, got = call("--stream", scenarios=[{"name": "sse", "events": events}])
    payload = _check_one_line(proc, got, "malformed_response")
    assert any(words in problem for problem in payload["malformed"]), payload["malformed"]


_SHAPES = {  # each answer shape the readers know, whole or streamed
    "chat": json.loads(_completion(system_fingerprint="fp")),
    "responses": {"type": "response.completed", "id": "r1", "model": "hostile-model", "status": "completed",
                  "output": [{"type": "message", "content": [{"type": "output_text", "text": "4"}]},
                             {"type": "function_call"}], "usage": {"input_tokens": 3, "output_tokens": 1}},
    "embeddings": {"object": "list", "data": [{"embedding": [0.1]}], "model": "hostile-model",
                   "usage": {"prompt_tokens": 2}},
    "chat-stream": [{"id": "c1", "model": "hostile-model", "choices": [{"index": 0, "delta": {"content": "4"}}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1}}],
    "responses-stream": [{"type": "response.output_text.delta", "delta": "4"},
                         {"type": "response.completed", "item": {"type": "message"},
                          "response": {"id": "r1", "model": "m", "status": "completed", "usage": {"input_tokens": 1}}}],
}
_STRANGE = [None, True, 0, -1.5, "s", "error", "response.completed", "list", [], [1], {}, {"a": 1}]


def _places(value, path=()):
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _places(child, path + (key,))


def _with(value, path, new):
    if not path:
        return new
    copy = json.loads(json.dumps(value))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return copy


def test_any_value_anywhere_in_any_answer_shape_ends_in_one_line(hostile, tmp_path):
    """The class, not an instance: every field (and every whole object) of every answer shape replaced by every
    JSON type; each call returns a record and writes exactly one line, whatever its error."""
    ledger = tmp_path / "calls.jsonl"
    cases = [(name, path, new) for name, shape in _SHAPES.items() for path in _places(shape) for new in _STRANGE]
    for count, (name, path, new) in enumerate(cases, 1):
        answer, stream = _with(_SHAPES[name], path, new), name.endswith("-stream")
        if stream:
            events = [f"data: {json.dumps(e)}\n\n" for e in (answer if isinstance(answer, list) else [answer])]
            hostile.queue({"name": "sse", "events": events + ["data: [DONE]\n\n"]})
        else:
            hostile.queue({"name": "json", "body": json.dumps(answer)})
        record = ask.chat([{"role": "user", "content": PROMPT}], ledger=ledger, base_url=hostile.base_url,
                          model="hostile-model", api_key=KEY, stream=stream, timeout=60)
        assert record["error_type"] is None or isinstance(record["error_type"], str), (name, path, new)
        assert len(ledger.read_bytes().splitlines()) == count, (name, path, new)
    assert len(cases) > 500


def test_an_error_in_a_stream_keeps_its_code(call):
    events = ['data: {"error": {"message": "too long", "code": "context_length_exceeded"}}\n\n']
    proc, got = call("--stream", scenarios=[{"name": "sse", "events": events}])
    payload = _check_one_line(proc, got, "api_error")
    assert payload["error_code"] == "context_length_exceeded"


def test_an_http_error_keeps_the_error_code(call):
    body = json.dumps({"error": {"message": "This model's maximum context length is 8192 tokens",
                                 "type": "invalid_request_error", "code": "context_length_exceeded"}})
    proc, events = call(scenarios=[{"name": "json", "status": 400, "body": body}])
    payload = _check_one_line(proc, events, "http_error")
    assert payload["error_code"] == "context_length_exceeded" and "8192" in payload["error_message"]


# ----------------------------------------------------------------------------
# Before anything is sent
# ----------------------------------------------------------------------------

def test_every_missing_setting_is_named_in_one_message(call, hostile):
    proc, events = call(BASE_URL="", API_KEY="", MODEL_ID="")
    assert proc.returncode == 2 and events == [] and hostile.requests == []
    (line,) = error_lines(proc.err)
    assert "BASE_URL, API_KEY and MODEL_ID are not set" in line


@pytest.mark.parametrize("key", [KEY + "\n", " " + KEY, KEY + "\r\nX-Evil: 1", "sk-ключ-123456789"])
def test_a_malformed_api_key_is_refused_unsent_and_unechoed(call, hostile, key):
    proc, events = call(API_KEY=key)
    assert proc.returncode == 2 and events == [] and hostile.requests == []
    assert KEY not in proc.err and "ключ" not in proc.err and len(error_lines(proc.err)) == 1


@pytest.mark.parametrize("url", ["ftp://host/v1", "http:///v1", "http://host:99999/v1", "http://ho st/v1",
                                 "http://host/v1\n", "https://host/v1?api-key=qs-secret-value-123",
                                 "http://[::1/v1", "not a url"])
def test_a_bad_base_url_is_refused_with_no_query_secret_echoed(call, hostile, url):
    proc, events = call(BASE_URL=url if "qs-secret" not in url else url.replace("https://host", "gopher://host"))
    assert proc.returncode == 2 and events == [] and hostile.requests == []
    assert "qs-secret-value-123" not in proc.err and len(error_lines(proc.err)) == 1


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"], ["--timeout", "inf"],
                                   ["--timeout", "nan"], ["--timeout", "0"], ["--max-wait", "-1"],
                                   ["--backoff", "nan"], ["--max-tokens", "0"], ["--max-response-bytes", "10"],
                                   ["--retries", "-1"], ["--expect", "(unclosed"]])
def test_bad_numbers_are_refused_before_sending(call, hostile, flags):
    proc, events = call(*flags)
    assert proc.returncode == 2 and events == [] and hostile.requests == [], proc.err
    assert len(error_lines(proc.err)) == 1


@pytest.mark.parametrize("content", [
    b'{"hello": "not a ledger"}\n',
    b"\n",
    b"   \n",
    None,
])
def test_a_ledger_that_cannot_take_the_line_costs_no_request(call, hostile, tmp_path, content):
    if content is None:  # a keyed ledger and no key
        with rl.Ledger(call.ledger, "r", key="the-ledger-key-123") as ledger:
            ledger.append("note", {})
    else:
        call.ledger.write_bytes(content)
    before = call.ledger.read_bytes()
    proc, _ = call()
    assert proc.returncode == 2 and hostile.requests == [], proc.err
    assert call.ledger.read_bytes() == before
    (line,) = error_lines(proc.err)
    assert "nothing was sent" in line and str(call.ledger) in line


def test_models_checks_the_ledger_first_too(call, hostile):
    call.ledger.write_bytes(b"garbage\n")
    proc, _ = call("--models")
    assert proc.returncode == 2 and hostile.requests == []


# ----------------------------------------------------------------------------
# After the call: a paid answer is never thrown away
# ----------------------------------------------------------------------------

LIMITED = r"""
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # a write past the limit fails with EFBIG instead
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
os.execv(sys.executable, [sys.executable] + sys.argv[2:])
"""


def test_a_ledger_write_that_fails_after_the_call_still_prints_the_answer(hostile, tmp_path):
    ledger = tmp_path / "calls.jsonl"
    with rl.Ledger(ledger, "r", key=b"") as book:
        book.append("note", {"padding": "x" * 200})
    size = ledger.stat().st_size
    env = clean_env(BASE_URL=hostile.base_url, API_KEY=KEY, MODEL_ID="hostile-model", LEDGER=ledger)
    proc = subprocess.run([sys.executable, "-c", LIMITED, str(size + 100), str(ROOT / "ask.py")], input=b"hi",
                          capture_output=True, env=env, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert proc.stdout == b"The answer is 4.\n"  # the answer that was paid for
    assert len(hostile.requests) == 1 and "Traceback" not in err
    (line,) = error_lines(err)
    assert str(ledger) in line and "could not be written" in line
    assert ledger.stat().st_size == size and rl.verify(ledger).count == 1  # no half line left behind


# ----------------------------------------------------------------------------
# Secrets: stderr carries none
# ----------------------------------------------------------------------------

def test_stderr_and_the_ledger_carry_no_secret_whatever_the_server_echoes(call, tmp_path):
    served = f"model-{KEY}"
    body = _completion(model=served)
    proc, events = call("--retries", "1", "--backoff", "0.01", scenarios=[
        {"name": "json", "status": 500, "body": json.dumps({"error": {"message": f"bad key {KEY}"}})},
        {"name": "json", "body": body}])
    assert proc.returncode == 0, proc.err
    assert "warning: asked for 'hostile-model', the server says it ran 'model-[REDACTED]'" in proc.err
    assert KEY not in proc.err + proc.out
    assert KEY.encode() not in all_bytes_under(tmp_path)


def test_a_control_character_from_the_server_cannot_forge_a_stderr_line(call):
    body = json.dumps({"error": {"message": "bad\nerror: forged line\x1b[31m"}})
    proc, events = call(scenarios=[{"name": "json", "status": 400, "body": body}])
    assert len(error_lines(proc.err)) == 1 and "\x1b" not in proc.err
    assert "bad\\nerror: forged line\\x1b[31m" in proc.err


# ----------------------------------------------------------------------------
# Vendored: python3 -I finds reasoning_ledger.py beside the script
# ----------------------------------------------------------------------------

def test_isolated_mode_from_another_directory(hostile, tmp_path):
    vendored = tmp_path / "vendor"
    vendored.mkdir()
    for name in ("reasoning_ledger.py", "ask.py", "fleet.py", "audit.py"):
        (vendored / name).write_bytes((ROOT / name).read_bytes())
    work = tmp_path / "work"
    work.mkdir()
    env = clean_env(BASE_URL=hostile.base_url, API_KEY=KEY, MODEL_ID="hostile-model")
    proc = subprocess.run([sys.executable, "-I", str(vendored / "ask.py")], input=b"hi", capture_output=True,
                          env=env, cwd=work, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (work / "calls.jsonl").exists()
    proc = subprocess.run([sys.executable, "-I", str(vendored / "audit.py")], capture_output=True, env=env,
                          cwd=work, timeout=60)
    assert proc.returncode == 0 and b"hostile-model" in proc.stdout, proc.stderr


@pytest.mark.parametrize("status", [102, 103, 199])
@pytest.mark.parametrize("flags", [[], ["--stream"]])
def test_an_interim_answer_before_the_answer_is_skipped(call, status, flags):
    proc, events = call(*flags, scenarios=[{"name": "interim", "status": status}])
    assert proc.returncode == 0, proc.err
    assert len(events) == 1 and events[0]["payload"]["http_status"] == 200
    assert events[0]["payload"]["error_type"] is None
