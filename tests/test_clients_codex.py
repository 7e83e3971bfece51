"""The real Codex CLI (npm @openai/codex, pinned in tests/clients.py) through `proxy.py` with
UPSTREAM_API=chat to the scripted chat stand-in, offline, with the config.toml docs/proxy.md prints:
a shell-tool round trip, every call on the record, no key on disk."""

import os
import re
import socket
import subprocess
import threading


import reasoning_ledger as rl
from clients import client, offline_env
from conftest import KEY, ROOT, all_bytes_under, run_script
from fake_chat import ScriptedChat
from proxy_helpers import Proxy

TOKEN = "codex-client-token-0123456789"


def docs_config(port, model):
    """The config.toml of docs/proxy.md's Codex recipe, with this test's port and model."""
    text = (ROOT / "docs" / "proxy.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if "[model_providers." in b]
    assert "127.0.0.1:8787" in block and "the-exact-model-id" in block
    return block.replace("127.0.0.1:8787", f"127.0.0.1:{port}").replace("the-exact-model-id", model)


class Refuser:
    """An HTTP(S) proxy that answers every request 403 and notes its first line: what a client
    would contact besides the recording proxy."""

    def __init__(self):
        self.sock, self.seen = socket.create_server(("127.0.0.1", 0)), []
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(10)
                    self.seen.append(conn.recv(4096).split(b"\r\n")[0].decode("latin-1"))
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass


def test_codex_exec_runs_a_shell_tool_through_the_bridge_offline(tmp_path):
    codex = client("codex")
    work = tmp_path / "work"
    work.mkdir()
    made = work / "made-by-codex.txt"
    turns = [{"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "touch made-by-codex.txt"}}],
              "reasoning_content": "A file is asked for."},
             {"text": "Created made-by-codex.txt."}]
    refuser = Refuser()
    with ScriptedChat(turns) as chat:
        proxy = Proxy(chat.base_url, tmp_path / "calls.jsonl", "--store-text", UPSTREAM_API="chat",
                      PROXY_TOKEN=TOKEN)
        try:
            via = {name: refuser.url for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy",
                                                  "http_proxy", "all_proxy")}
            env = offline_env(tmp_path / "home", PROXY_TOKEN=TOKEN, NO_PROXY="127.0.0.1,localhost",
                              no_proxy="127.0.0.1,localhost", **via)
            os.makedirs(env["CODEX_HOME"])
            with open(os.path.join(env["CODEX_HOME"], "config.toml"), "w") as f:
                f.write(docs_config(proxy.port, "scripted-model"))
            result = subprocess.run(
                [codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                 "Create the file made-by-codex.txt here."],
                cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
        finally:
            code, _out, err = proxy.stop()
        sent = [r["body"] for r in chat.requests if r["method"] == "POST"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert made.exists(), result.stderr[-3000:]
    assert "Created made-by-codex.txt." in result.stdout
    assert code == 0 and "Traceback" not in err, err
    assert refuser.seen == []  # nothing but the proxy was contacted
    # the tool's result went back to the model as a chat tool message answering the call
    assert len(sent) == 2 and "web_search" not in str(sent[0]["tools"])
    assert any(t["function"]["name"] == "exec_command" for t in sent[0]["tools"])
    call, answer = sent[1]["messages"][-2:]
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "exec_command"
    assert answer["role"] == "tool" and answer["tool_call_id"] == call["tool_calls"][0]["id"]
    lines = [e["payload"] for e in rl.read_events(tmp_path / "calls.jsonl", run_id=None)
             if e["kind"] == "model_call"]
    assert len(lines) == 2
    for line in lines:
        assert (line["route"], line["upstream_route"], line["error_type"], line["http_status"]) == (
            "/responses", "/chat/completions", None, 200)
        assert line["session_id"] == "codex" and line["user_agent"].startswith("codex_exec/0.171.0")
        assert line["request_model"] == line["response_model"] == "scripted-model"
        assert line["usage_status"] == "complete" and line["tools_dropped"] >= 1
    assert [line["finish_reason"] for line in lines] == ["tool_calls", "stop"]
    disk = all_bytes_under(tmp_path)
    assert KEY.encode() not in disk and TOKEN.encode() not in disk
    assert run_script("reasoning_ledger.py", "verify", tmp_path / "calls.jsonl").returncode == 0
    audit = run_script("audit.py", "--by", "session", tmp_path / "calls.jsonl")
    assert audit.returncode == 0 and "codex" in audit.out, audit.err
    # the conversation is on the record: the prompt, the reasoning, the tool call and its result, the answer
    ledger = tmp_path / "calls.jsonl"
    assert run_script("reasoning_ledger.py", "verify", "--text", ledger).returncode == 0
    shown = run_script("audit.py", "--conversation", "codex", ledger)
    assert shown.returncode == 0, shown.err
    for said in ("Create the file made-by-codex.txt here.", "A file is asked for.", "exec_command",
                 "touch made-by-codex.txt", call["tool_calls"][0]["id"], "Created made-by-codex.txt."):
        assert said in shown.out, (said, shown.out[-3000:])
