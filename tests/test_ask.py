"""ask.py against the scripted fake server: one subprocess per scenario, the exact event checked."""

import json
import os
import socket
import stat
import threading
import time

import pytest

import ask
import reasoning_ledger as rl
from conftest import KEY, ROOT, all_bytes_under, clean_env, error_lines, lines_of, run_script

PROMPT = "What is 2 + 2? Answer with a number."


@pytest.fixture
def call(server, tmp_path):
    """Run ask.py as a user would; return (proc, events written by this call)."""
    ledger = tmp_path / "calls.jsonl"

    def run(*args, scenarios=(), prompt=PROMPT, **env):
        server.queue(*scenarios)
        before = len(lines_of(ledger)) if ledger.exists() else 0
        settings = dict(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="fake-model", LEDGER=ledger)
        settings.update(env)
        proc = run_script("ask.py", *args, input=prompt, env=clean_env(**settings), cwd=tmp_path)
        events = lines_of(ledger)[before:] if ledger.exists() else []
        return proc, events

    run.ledger = ledger
    return run


def _only(events):
    assert len(events) == 1, events
    assert events[0]["kind"] == "model_call"
    return events[0]["payload"]


# ----------------------------------------------------------------------------
# The good path, field by field
# ----------------------------------------------------------------------------

def test_ok_call_prints_the_answer_and_records_every_field(call, server):
    proc, events = call("--temperature", "0", "--max-tokens", "50")
    assert proc.returncode == 0, proc.err
    assert proc.out == "The answer is 4.\n" and proc.err == ""
    p = _only(events)
    assert p["request_model"] == "fake-model" and p["response_model"] == "fake-model"
    assert p["response_id"] == "chatcmpl-fake123" and p["system_fingerprint"] == "fp_fake01"
    assert p["base_url"] == server.base_url and p["server_address"] == "127.0.0.1"
    assert p["server_port"] == int(server.base_url.split(":")[2].split("/")[0])
    assert p["stream"] is False and p["attempt"] == 1
    assert p["prompt_chars"] == len(PROMPT) and p["response_chars"] == len("The answer is 4.")
    assert p["usage_reported"] is True and p["usage_status"] == "complete"
    assert (p["input_tokens"], p["output_tokens"], p["total_tokens"]) == (21, 6, 27)
    assert p["cached_input_tokens"] == 3 and p["reasoning_output_tokens"] == 2
    assert p["est_input_tokens"] == 9 and p["est_output_tokens"] == 4 and p["est_method"] == "chars/4"
    assert p["latency_ms"] > 0 and p["ttft_ms"] is None and p["http_status"] == 200
    assert p["finish_reason"] == "stop" and p["request_id"].startswith("req_fake_")
    assert p["ratelimit"] == {"x-ratelimit-remaining-requests": "99"}
    assert p["error_type"] is None and p["error_message"] is None
    assert p["check"] is None and p["check_detail"] is None
    assert p["temperature"] == 0 and p["max_tokens"] == 50
    import hashlib
    assert p["prompt_sha256"] == hashlib.sha256(PROMPT.encode()).hexdigest()
    sent = server.requests[-1]
    assert sent["body"]["model"] == "fake-model" and sent["headers"]["Authorization"] == f"Bearer {KEY}"
    assert sent["body"]["messages"] == [{"role": "user", "content": PROMPT}]
    assert PROMPT.encode() not in call.ledger.read_bytes()  # text is not stored by default


def test_prompt_from_a_file_and_system_prompt(call, server, tmp_path):
    (tmp_path / "p.txt").write_text("你好?", encoding="utf-8")
    proc, events = call(tmp_path / "p.txt", "--system", "be brief", prompt="")
    assert proc.returncode == 0
    assert server.requests[-1]["body"]["messages"][0] == {"role": "system", "content": "be brief"}
    assert server.requests[-1]["body"]["messages"][1]["content"] == "你好?"
    assert _only(events)["system_chars"] == 8


def test_json_output_is_the_record(call):
    proc, events = call("--json")
    record = json.loads(proc.out)
    assert record["text"] == "The answer is 4."
    assert {k: v for k, v in record.items() if k != "text"} == _only(events)


def test_store_text_keeps_messages_and_answer_in_the_private_text_store(call, tmp_path):
    proc, events = call("--store-text", "--system", "Be brief.")
    p = _only(events)
    store = rl.text_dir(call.ledger)
    assert not any(k.endswith("_artifact") for k in p)  # one way to keep text
    entries = [json.loads((store / name).read_text()) for name in p["messages_text"] + [p["answer_text"]]]
    assert entries == [{"role": role, "parts": [{"type": "text", "text": text}]} for role, text in (
        ("system", "Be brief."), ("user", PROMPT), ("assistant", "The answer is 4."))]
    assert {stat.S_IMODE(f.stat().st_mode) for f in store.iterdir()} == {0o600}
    assert run_script("reasoning_ledger.py", "verify", "--text", call.ledger).returncode == 0
    assert "reply: The answer is 4." in run_script("reasoning_ledger.py", "report", call.ledger).out


# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["BASE_URL", "API_KEY", "MODEL_ID"])
def test_a_missing_setting_names_the_variable(call, missing):
    proc, events = call(**{missing: ""})
    assert proc.returncode == 2 and events == []
    assert proc.err.startswith("error: ") and missing in proc.err and proc.out == ""


def test_openai_names_are_accepted_and_flags_override(call, server):
    proc, _ = call("--model", "fake-model-large", BASE_URL="", API_KEY="", OPENAI_BASE_URL=server.base_url,
                   OPENAI_API_KEY=KEY)
    assert proc.returncode == 0, proc.err
    assert server.requests[-1]["body"]["model"] == "fake-model-large"


def test_bad_inputs_are_usage_errors(call, tmp_path):
    assert call("--expect", "(unclosed")[0].returncode == 2
    assert call(prompt="   \n")[0].returncode == 2
    assert call(prompt=b"\xff\xfe not utf-8")[0].returncode == 2
    assert call(BASE_URL="ftp://x/v1")[0].returncode == 2
    assert call("--retries", "-1")[0].returncode == 2
    missing = call(tmp_path / "nope.txt")[0]
    assert missing.returncode == 2 and "nope.txt" in missing.err


def test_unwritable_ledger_is_exit_2_with_one_error_line(call, tmp_path):
    (tmp_path / "a-file").write_text("")
    proc, _ = call(LEDGER=tmp_path / "a-file" / "runs.jsonl")
    assert proc.returncode == 2 and proc.err.startswith("error: ") and len(proc.err.splitlines()) == 1


# ----------------------------------------------------------------------------
# What endpoints do wrong: each a clear error and one ledger line
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("scenario,error_type,status,words", [
    ("http_401", "auth_error", 401, "Incorrect API key provided"),
    ("http_403", "auth_error", 403, "not allowed to use this model"),
    ("http_404", "not_found", 404, "does not exist"),
    ("rate_limited", "rate_limited", 429, "Rate limit reached"),
    ("server_error", "server_error", 500, "The server had an error"),
    ("html_error", "server_error", 502, "an HTML page titled '502 Bad Gateway'"),
    ("html_200", "html_response", 200, "titled 'Sign in'"),
    ("not_json", "invalid_json", 200, "body is not JSON"),
    ("no_choices", "no_choices", 200, "no choices"),
    ("error_in_200", "api_error", 200, "Provider returned error"),
    ("empty_content", "empty_content", 200, "answer is empty"),
    ("null_content", "empty_content", 200, "answer is empty"),
    ("drop", "connection_error", None, "RemoteDisconnected"),
])
def test_endpoint_failures(call, scenario, error_type, status, words):
    proc, events = call(scenarios=[scenario])
    assert proc.returncode == 1, proc.err
    assert proc.out == ""
    err_lines = error_lines(proc.err)
    assert len(err_lines) == 1 and error_type in err_lines[0] and words in err_lines[0]
    p = _only(events)
    assert p["error_type"] == error_type and p["http_status"] == status
    assert words in p["error_message"]
    assert p["check"] is None
    assert KEY not in proc.err and KEY.encode() not in call.ledger.read_bytes()


def test_the_401_echoing_the_key_never_leaks_it(call, tmp_path):
    proc, events = call(scenarios=["http_401"])
    assert "Incorrect API key provided: [REDACTED]" in _only(events)["error_message"]
    assert KEY not in proc.err + proc.out
    assert KEY.encode() not in all_bytes_under(tmp_path)


def test_connection_refused(call):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc, events = call(BASE_URL=f"http://127.0.0.1:{port}/v1")
    assert proc.returncode == 1 and "connection_refused" in proc.err
    p = _only(events)
    assert p["error_type"] == "connection_refused" and p["http_status"] is None and p["server_port"] == port


def test_dns_failure(call):
    proc, events = call(BASE_URL="http://no-such-host.invalid/v1")
    assert proc.returncode == 1
    assert _only(events)["error_type"] == "dns_error"


def test_tls_error_against_a_plain_http_server(call, server):
    proc, events = call(BASE_URL=server.base_url.replace("http://", "https://"))
    assert proc.returncode == 1
    assert _only(events)["error_type"] == "tls_error"


def test_timeout(call):
    held = threading.Event()  # the server answers only after ask.py has exited: only its timeout ends the call
    try:
        proc, events = call("--timeout", "0.3", scenarios=[{"name": "sleepy", "hold": held}])
    finally:
        held.set()
    assert proc.returncode == 1
    p = _only(events)
    assert p["error_type"] == "timeout" and p["latency_ms"] >= 250
    assert p["http_status"] is None


# ----------------------------------------------------------------------------
# Usage honesty
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("scenario,status,reported,inp,out,total", [
    ("no_usage", "absent", False, None, None, None),
    ("partial_usage", "partial", True, None, None, 30),
    ("zero_usage", "zero", True, 0, 0, 0),
])
def test_usage_is_reported_values_only_estimates_apart(call, scenario, status, reported, inp, out, total):
    proc, events = call(scenarios=[scenario])
    assert proc.returncode == 0
    assert f"usage {status}" in proc.err
    p = _only(events)
    assert p["usage_status"] == status and p["usage_reported"] is reported
    assert (p["input_tokens"], p["output_tokens"], p["total_tokens"]) == (inp, out, total)
    assert p["est_input_tokens"] == 9 and p["est_output_tokens"] == 4


def test_served_model_differs_is_recorded_and_warned(call):
    proc, events = call(scenarios=["model_swap"])
    assert proc.returncode == 0
    assert "warning: asked for 'fake-model', the server says it ran 'cheaper-model-q4'" in proc.err
    p = _only(events)
    assert p["request_model"] == "fake-model" and p["response_model"] == "cheaper-model-q4"


def test_strict_model_turns_a_swap_into_a_failed_check(call):
    proc, events = call("--strict-model", scenarios=["model_swap"])
    assert proc.returncode == 3
    p = _only(events)
    assert p["check"] is False and "is not the requested one" in p["check_detail"]


def test_missing_model_field_is_null_not_a_guess(call):
    proc, events = call(scenarios=["no_model_field"])
    assert proc.returncode == 0 and _only(events)["response_model"] is None


# ----------------------------------------------------------------------------
# The assertion gate
# ----------------------------------------------------------------------------

def test_expect_passes_and_fails(call):
    proc, events = call("--expect", r"\b4\b")
    assert proc.returncode == 0
    assert _only(events)["check"] is True and _only(events)["check_detail"] == r"matched /\b4\b/"
    proc, events = call("--expect", r"\b5\b")
    assert proc.returncode == 3
    assert proc.out == "The answer is 4.\n"  # the answer is still shown
    assert proc.err.strip().endswith(r"error: check not passed: no match for /\b5\b/")
    p = _only(events)
    assert p["check"] is False and p["error_type"] is None


def test_expect_json(call):
    proc, events = call("--expect-json", scenarios=[{"name": "ok", "answer": '```json\n{"a": 1}\n```'}])
    assert proc.returncode == 0 and _only(events)["check_detail"] == "valid JSON (inside a ``` fence)"
    proc, events = call("--expect-json")
    assert proc.returncode == 3 and _only(events)["check_detail"].startswith("not JSON")


def test_a_failed_transport_is_not_checked(call):
    proc, events = call("--expect", "4", scenarios=["server_error"])
    assert proc.returncode == 1 and _only(events)["check"] is None


# ----------------------------------------------------------------------------
# Retries
# ----------------------------------------------------------------------------

def test_retries_honour_retry_after_and_log_every_attempt(call):
    proc, events = call("--retries", "3", "--backoff", "0.01",
                        scenarios=[{"name": "rate_limited", "retry_after": 0},
                                   {"name": "rate_limited", "retry_after_ms": 50}, "server_error", "ok"])
    assert proc.returncode == 0, proc.err
    payloads = [e["payload"] for e in events]
    assert [p["attempt"] for p in payloads] == [1, 2, 3, 4]
    assert [p["error_type"] for p in payloads] == ["rate_limited", "rate_limited", "server_error", None]
    assert payloads[0]["retry_in_s"] == 0 and payloads[1]["retry_in_s"] == 0.05
    assert payloads[1]["ratelimit"]["retry-after-ms"] == "50"
    assert len({e["run_id"] for e in events}) == 1


def test_retries_run_out(call):
    proc, events = call("--retries", "1", "--backoff", "0.01", scenarios=["server_error", "server_error", "ok"])
    assert proc.returncode == 1 and len(events) == 2
    assert "attempt 2" in proc.err


def test_no_retry_on_a_client_error(call):
    proc, events = call("--retries", "3", scenarios=["http_404", "ok"])
    assert proc.returncode == 1 and len(events) == 1


def test_retry_after_is_capped(call):
    start = time.monotonic()
    proc, events = call("--retries", "1", "--max-wait", "0.2", scenarios=[{"name": "rate_limited",
                                                                           "retry_after": 3600}])
    assert proc.returncode == 0 and events[0]["payload"]["retry_in_s"] == 0.2
    assert time.monotonic() - start < 600  # an hour was asked for; an ignored cap would sleep it


def test_retry_after_http_date():
    from email.utils import formatdate
    now = time.time()
    wait = ask.retry_after_seconds({"Retry-After": formatdate(now + 30, usegmt=True)}, now=now)
    assert 28 <= wait <= 31
    assert ask.retry_after_seconds({"Retry-After": "garbage"}) is None


# ----------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------

def test_stream_prints_text_records_ttft_and_final_usage(call, server):
    proc, events = call("--stream")
    assert proc.returncode == 0, proc.err
    assert proc.out == "The answer is 4.\n"
    p = _only(events)
    assert p["stream"] is True and p["ttft_ms"] is not None and p["ttft_ms"] <= p["latency_ms"]
    assert p["usage_status"] == "complete" and p["input_tokens"] == 21
    assert p["finish_reason"] == "stop" and p["response_chars"] == 16
    assert server.requests[-1]["body"]["stream_options"] == {"include_usage": True}


def test_stream_without_usage(call):
    proc, events = call("--stream", scenarios=["stream_no_usage"])
    assert proc.returncode == 0
    p = _only(events)
    assert p["usage_reported"] is False and p["input_tokens"] is None and p["est_output_tokens"] == 4


def test_truncated_stream(call):
    proc, events = call("--stream", scenarios=["stream_truncated"])
    assert proc.returncode == 1 and "truncated_stream" in proc.err
    p = _only(events)
    assert p["error_type"] == "truncated_stream" and p["response_chars"] == 10


def test_stream_options_rejected_is_retried_once_without_them(call, server):
    proc, events = call("--stream", scenarios=["reject_stream_options", "reject_stream_options"])
    assert proc.returncode == 0, proc.err
    first, second = (e["payload"] for e in events)
    assert first["error_type"] == "http_error" and first["http_status"] == 400
    assert "stream_options" in first["retry_reason"]
    assert second["stream_options_dropped"] is True and second["error_type"] is None
    assert second["attempt"] == 2 and second["usage_reported"] is False
    assert "stream_options" not in server.requests[-1]["body"]


# ----------------------------------------------------------------------------
# --models
# ----------------------------------------------------------------------------

def test_models_lists_ids_and_records_them(call):
    proc, events = call("--models")
    assert proc.returncode == 0 and proc.out.split() == ["fake-model", "fake-model-large"]
    assert events[0]["kind"] == "models_list"
    assert events[0]["payload"]["model_ids"] == ["fake-model", "fake-model-large"]


def test_models_with_a_bad_key(call):
    proc, events = call("--models", scenarios=["http_401"])
    assert proc.returncode == 1 and "auth_error" in proc.err
    assert events[0]["payload"]["error_type"] == "auth_error"


# ----------------------------------------------------------------------------
# Secrets and the library
# ----------------------------------------------------------------------------

def test_key_and_url_credentials_never_reach_disk_or_stderr(call, server, tmp_path):
    url = server.base_url.replace("http://", "http://alice:pa55word-xyz@") + "?api-key=qs-secret-123"
    proc, events = call("--store-text", "--json", BASE_URL=url, scenarios=["http_401"])
    p = _only(events)
    assert p["base_url"] == server.base_url
    blob = all_bytes_under(tmp_path) + proc.stderr
    for secret in (KEY, "pa55word-xyz", "qs-secret-123"):
        assert secret.encode() not in blob
    assert server.requests[-1]["path"].endswith("/chat/completions?api-key=qs-secret-123")


def test_library_call_shares_the_ledger_and_returns_the_record(server, tmp_path):
    with rl.Ledger(tmp_path / "events.jsonl", "agent-run", key=b"") as ledger:
        ledger.decide("plan", "ask the model", "first step")
        record = ask.ask(PROMPT, ledger=ledger, base_url=server.base_url, model="fake-model", api_key=KEY)
    assert record["text"] == "The answer is 4."
    events = list(rl.read_events(tmp_path / "events.jsonl"))
    assert [e["kind"] for e in events] == ["decision", "model_call"]
    assert {k: v for k, v in record.items() if k != "text"} == events[1]["payload"]
    with pytest.raises(ask.ConfigError):
        ask.ask(PROMPT, ledger=tmp_path / "x.jsonl", base_url=server.base_url, model="", api_key=KEY)


def test_until_bounds_the_retries_and_each_attempt(server, tmp_path):
    """A retry whose wait ends past `until` is not made (nor claimed in the record); one that fits is (the
    waits go to `sleep`, so an ignored `until` would show as a retry, not as an hour asleep)."""
    server.queue({"name": "rate_limited", "retry_after": 3600}, {"name": "rate_limited", "retry_after": 0}, "ok")
    waits = []
    record = ask.chat([{"role": "user", "content": PROMPT}], ledger=tmp_path / "calls.jsonl",
                      base_url=server.base_url, model="fake-model", api_key=KEY, retries=3, max_wait=7200,
                      until=time.monotonic() + 1800, sleep=waits.append)
    assert record["error_type"] == "rate_limited" and record["attempt"] == 1 and "retry_in_s" not in record
    assert waits == [] and len(server.requests) == 1
    record = ask.chat([{"role": "user", "content": PROMPT}], ledger=tmp_path / "calls.jsonl",
                      base_url=server.base_url, model="fake-model", api_key=KEY, retries=3,
                      until=time.monotonic() + 1800, sleep=waits.append)
    assert record["error_type"] is None and record["attempt"] == 2 and waits == [0]
    with pytest.raises(ask.ConfigError):
        ask.chat([{"role": "user", "content": PROMPT}], ledger=tmp_path / "calls.jsonl", base_url=server.base_url,
                 model="fake-model", api_key=KEY, until=float("nan"))


@pytest.mark.real
@pytest.mark.skipif(not (os.environ.get("REAL_BASE_URL") and os.environ.get("REAL_MODEL_ID")),
                    reason="set REAL_BASE_URL, REAL_MODEL_ID (and REAL_API_KEY) to try a real endpoint")
def test_real_endpoint(tmp_path):
    proc = run_script("ask.py", "--ledger", tmp_path / "runs.jsonl", "--retries", "2", input="Say OK.",
                      env=clean_env(BASE_URL=os.environ["REAL_BASE_URL"], MODEL_ID=os.environ["REAL_MODEL_ID"],
                                    API_KEY=os.environ.get("REAL_API_KEY", "none")), timeout=300)
    assert proc.returncode in (0, 3), proc.err
    assert run_script("reasoning_ledger.py", "verify", tmp_path / "runs.jsonl").returncode == 0


@pytest.mark.parametrize("flags", [[], ["--stream"]])
@pytest.mark.parametrize("how", ["closed", "full", "unencodable"])
def test_an_unwritable_stdout_is_an_output_error_after_the_line_is_recorded(server, tmp_path, flags, how):
    import subprocess
    import sys
    server.queue({"name": "ok", "answer": "答案是 4。"})
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="fake-model", LEDGER=tmp_path / "calls.jsonl")
    cmd = [sys.executable, str(ROOT / "ask.py"), *flags]
    if how == "closed":
        read_end, write_end = os.pipe()
        os.close(read_end)  # nobody will ever read: the first write fails with EPIPE
        proc = subprocess.run(cmd, input=b"hi", stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=60)
        os.close(write_end)
    elif how == "full":
        with open("/dev/full", "wb") as full:
            proc = subprocess.run(cmd, input=b"hi", stdout=full, stderr=subprocess.PIPE, env=env, timeout=60)
    else:
        proc = subprocess.run(cmd, input=b"hi", capture_output=True, env=dict(env, PYTHONIOENCODING="ascii"),
                              timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == rl.EXIT_OUTPUT == 5, err
    assert "Traceback" not in err and len(error_lines(err)) == 1 and "stdout" in err
    (event,) = rl.read_events(tmp_path / "calls.jsonl")
    assert event["payload"]["error_type"] is None and event["payload"]["response_chars"] == len("答案是 4。")
