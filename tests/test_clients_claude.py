"""The real Claude Code CLI (npm, pinned in clients.py) through `proxy.py` to the scripted Anthropic
stand-in, offline: docs/proxy.md's recipe, as a user runs it. Skips where the CLI or node is
missing; fails in CI (CLIENTS_REQUIRED=1)."""

import subprocess
import uuid

import pytest

import reasoning_ledger as rl
from clients import client, offline_env
from conftest import KEY, all_bytes_under, run_script
from fake_anthropic import ScriptedAnthropic
from proxy_helpers import Proxy

CLIENT_KEY = "sk-ant-api03-client-own-key-never-forwarded-0123456789"
TOKEN = "proxy-token-for-claude-code-0123456789abcdef"


@pytest.fixture
def claude():
    return client("claude")


# without PROXY_TOKEN the client's own key is ignored; with it, the client sends it as x-api-key
@pytest.mark.parametrize("token", [None, TOKEN])
def test_claude_code_tool_round_trip_through_the_proxy(claude, tmp_path, token):
    client_key = token or CLIENT_KEY
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    target = work / "made.txt"
    session = str(uuid.uuid4())
    turns = [
        {
            "thinking": "The user wants a file; the Bash tool makes it.",
            "tool_use": {
                "name": "Bash",
                "input": {"command": f"echo made > {target}", "description": "Make the file"},
            },
            "usage": {"cache_read_input_tokens": 1000, "cache_creation_input_tokens": 200},
        },
        {"text": "Made made.txt."},
    ]
    ledger = tmp_path / "ledger" / "calls.jsonl"
    ledger.parent.mkdir()
    with ScriptedAnthropic(turns) as fake:
        proxy = Proxy(fake.base_url + "/v1", ledger, "--store-text", PROXY_TOKEN=token)
        try:
            # docs/proxy.md's recipe: the proxy's address, without /v1; the client's own key
            env = offline_env(
                home,
                ANTHROPIC_BASE_URL=f"http://127.0.0.1:{proxy.port}",
                ANTHROPIC_API_KEY=client_key,
            )
            done = subprocess.run(
                [claude, "-p", "Make a file called made.txt here.", "--model", "stand-in-model",
                 "--session-id", session, "--dangerously-skip-permissions",
                 "--output-format", "json"],
                cwd=work, env=env, capture_output=True, text=True, timeout=600,
            )
        finally:
            code, _out, err = proxy.stop()
        sent = fake.messages
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert code == 0, err
    assert target.read_text() == "made\n"
    assert '"Made made.txt."' in done.stdout
    # the round trip: the second request carries the tool's result for the first answer's call
    assert len(sent) == 2
    results = [
        block
        for m in sent[1]["body"]["messages"]
        if isinstance(m.get("content"), list)
        for block in m["content"]
        if block.get("type") == "tool_result"
    ]
    assert [r["tool_use_id"] for r in results] == ["toolu_fake0001"]
    for request in sent:
        assert request["path"] == "/v1/messages?beta=true"
        assert request["headers"]["x-api-key"] == KEY  # the proxy's key, never the client's
        assert request["headers"]["anthropic-version"] and request["headers"]["anthropic-beta"]
    lines = [e["payload"] for e in rl.read_events(ledger, run_id=None) if e["kind"] == "model_call"]
    assert len(lines) == 2
    for line in lines:
        assert line["route"] == "/messages" and line["stream"] is True
        assert line["error_type"] is None and line["http_status"] == 200
        assert line["session_id"] == session and line["usage_status"] == "complete"
        assert line["request_model"] == "stand-in-model" == line["response_model"]
        assert line["total_tokens"] == line["input_tokens"] + line["output_tokens"]
    assert [line["finish_reason"] for line in lines] == ["tool_use", "end_turn"]
    assert lines[0]["cached_input_tokens"] == 1000
    assert lines[0]["cache_creation_input_tokens"] == 200
    assert lines[0]["input_tokens"] > 1200 and lines[0]["ttft_ms"] is not None
    assert run_script("reasoning_ledger.py", "verify", ledger).returncode == 0
    audited = run_script("audit.py", "--by", "session", ledger)
    assert audited.returncode == 0, audited.err
    assert session in audited.out
    # the conversation is on the record: the prompt, the thinking, the tool call and its result, the answer
    assert run_script("reasoning_ledger.py", "verify", "--text", ledger).returncode == 0
    shown = run_script("audit.py", "--conversation", session[:8], ledger)
    assert shown.returncode == 0, shown.err
    for said in ("Make a file called made.txt here.", "The user wants a file", "Bash",
                 f"echo made > {target}", "toolu_fake0001", "Made made.txt."):
        assert said in shown.out, (said, shown.out[-3000:])
    # no key in any file written: the ledger, the client's home and config, the work dir
    blob = all_bytes_under(tmp_path)
    assert client_key.encode() not in blob and KEY.encode() not in blob
    assert client_key[-20:].encode() not in blob
