"""transcripts.py on transcripts the real Claude Code and Codex CLIs wrote (offline, against the
scripted stand-ins: tests/fake_anthropic.py for Claude Code, proxy.py's bridge to tests/fake_chat.py for
Codex), and on hostile files.

The real-CLI tests skip where node or the pinned CLIs are missing (tests/clients.py; CLIENTS_REQUIRED=1
in CI makes that a failure). Run here with CLIENTS_PREFIX=/opt/rl-clients."""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clients import client, offline_env
from conftest import ROOT, all_bytes_under, clean_env, error_lines, lines_of, run_script
from fake_anthropic import ScriptedAnthropic
from fake_chat import ScriptedChat
from proxy_helpers import Proxy

SID = "7d1c0a52-3f4e-4b6a-9c2d-1e0f5a6b7c8d"
CLAUDE_MODEL = "claude-sonnet-4-5"
CODEX_MODEL = "gpt-test-codex"
# Secrets the sessions carry: in the agent's answers and tool output, and the client's own key.
SECRETS = ("sk-transcript0123456789abcd", "ghp_abcdefghijklmnopqrstuvwxyz0123")
CLIENT_KEY = "sk-ant-client-key-0123456789"
PROXY_TOKEN = "codex-proxy-token-0123456789"
# What the chat stand-in reports for each Codex response, in chat's names (the bridge renames them).
CHAT_USAGE = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110,
              "prompt_tokens_details": {"cached_tokens": 20}, "completion_tokens_details": {"reasoning_tokens": 5}}


# ----------------------------------------------------------------------------
# Driving the real CLIs
# ----------------------------------------------------------------------------


def claude(home, prompt, turns, resume=False):
    """One `claude -p` run (a new session SID, or --resume SID); the transcript's path."""
    binary = client("claude")
    work = Path(home) / "work"
    work.mkdir(parents=True, exist_ok=True)
    with ScriptedAnthropic(turns) as server:
        env = offline_env(home, ANTHROPIC_BASE_URL=server.base_url, ANTHROPIC_API_KEY=CLIENT_KEY)
        proc = subprocess.run(
            [binary, "-p", "--resume" if resume else "--session-id", SID,
             "--dangerously-skip-permissions", "--model", CLAUDE_MODEL, prompt],
            env=env, cwd=work, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = glob.glob(f"{home}/.claude/projects/*/{SID}.jsonl")
    assert len(found) == 1, found
    return Path(found[0])


def codex_config(codex_home, port):
    """Codex pointed at proxy.py on `port` (its key from PROXY_TOKEN), offline."""
    os.makedirs(codex_home, exist_ok=True)
    Path(codex_home, "config.toml").write_text(
        f'model = "{CODEX_MODEL}"\nmodel_provider = "ledger"\n\n[model_providers.ledger]\n'
        f'name = "recording proxy"\nbase_url = "http://127.0.0.1:{port}/v1"\nenv_key = "PROXY_TOKEN"\n'
        f'wire_api = "responses"\n\n[analytics]\nenabled = false\n\n[features]\nplugins = false\n')


def codex(home, *args, turns=()):
    """One codex run (`exec PROMPT`, `exec resume ID PROMPT`: through proxy.py's bridge to the scripted
    chat stand-in, recorded in HOME/calls.jsonl; `archive ID`: no model)."""
    binary = client("codex")
    work = Path(home) / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = offline_env(home, PROXY_TOKEN=PROXY_TOKEN)
    if args[0] != "exec":
        proc = subprocess.run([binary, *args], env=env, cwd=work, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return
    args = ("exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox") + args[1:]
    with ScriptedChat(turns, model=CODEX_MODEL) as chat:
        proxy = Proxy(chat.base_url, Path(home) / "calls.jsonl", UPSTREAM_API="chat", PROXY_TOKEN=PROXY_TOKEN)
        try:
            codex_config(env["CODEX_HOME"], proxy.port)
            proc = subprocess.run([binary, *args], env=env, cwd=work, capture_output=True, text=True,
                                  timeout=300, stdin=subprocess.DEVNULL)
        finally:
            code, _out, err = proxy.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert code == 0, err[-2000:]


def rollouts(home, under="sessions"):
    return sorted(Path(home, ".codex", under).rglob("*.jsonl"))


CLAUDE_TURNS = [
    {"tool_use": {"name": "Bash", "input": {"command": "echo made > x.txt"}}, "thinking": "a file first"},
    {"text": f"Made x.txt. The key was api_key={SECRETS[0]}"},
]
CODEX_TURNS = [
    {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "echo made > x.txt"}}], "usage": CHAT_USAGE},
    {"text": f"Made it. token={SECRETS[1]}", "usage": CHAT_USAGE},
]


def tx(*args, cwd, env=None):
    return run_script("transcripts.py", *args, cwd=cwd, env=env or clean_env())


def imported(ledger, kind="transcript"):
    return [e["payload"] for e in lines_of(ledger) if e["kind"] == kind]


def same_but_masked(restored, original):
    """Every line as it was, except the lines that held a secret: those are valid JSON, masked."""
    new, old = restored.read_bytes().split(b"\n"), original.read_bytes().split(b"\n")
    assert len(new) == len(old)
    changed = [(a, b) for a, b in zip(new, old) if a != b]
    for mine, theirs in changed:
        assert any(s.encode() in theirs for s in SECRETS), theirs[:300]
        json.loads(mine)
        assert b"[REDACTED]" in mine
    return len(changed)


def no_secret_under(*directories):
    for directory in directories:
        blob = all_bytes_under(directory)
        for secret in SECRETS:
            assert secret.encode() not in blob, (directory, secret)


# ----------------------------------------------------------------------------
# The real CLIs: import, append, import again, restore
# ----------------------------------------------------------------------------


def test_claude_code_session_imported_twice_then_restored(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    path = claude(home, "make x.txt", CLAUDE_TURNS)
    first = tx("import", "--claude", home / ".claude", cwd=out)
    assert first.returncode == 0, first.err
    ledger = out / "transcripts.jsonl"
    (seg,) = imported(ledger)
    assert seg["agent"] == "claude-code" and seg["session_id"] == SID and seg["start"] == 0
    assert seg["end"] == path.stat().st_size and seg["cwd"] == str(home / "work")
    assert seg["models"] == [CLAUDE_MODEL] and seg["agent_version"] == "2.1.332"
    (day,) = seg["usage"][CLAUDE_MODEL].values()
    assert day["turns"] == 2 and day["tool_calls"] == 1 and day["input_tokens"] > 0
    assert set(day) == {"turns", "tool_calls", "input_tokens", "output_tokens", "cache_read_input_tokens",
                        "cache_creation_input_tokens"}
    assert sum(seg["prompts"].values()) == 1
    # nothing new: no line at all
    before = ledger.read_bytes()
    assert tx("import", "--claude", home / ".claude", cwd=out).returncode == 0
    assert ledger.read_bytes() == before
    # the session goes on: only the new part comes in
    size = path.stat().st_size
    claude(home, "again", [{"text": "second answer"}], resume=True)
    assert tx("import", "--claude", home / ".claude", cwd=out).returncode == 0
    first_seg, second = imported(ledger)
    assert second["start"] == size == first_seg["end"] and second["end"] == path.stat().st_size
    assert second["lines"] == len(path.read_bytes().splitlines())
    assert second["carry"]["session_id"] == SID
    assert sum(d["turns"] for d in second["usage"][CLAUDE_MODEL].values()) == 1

    assert second["sha256"] == hashlib.sha256(path.read_bytes()[size:]).hexdigest()
    assert second["prefix_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # restore: the file back, masked; verify passes; no secret anywhere we wrote
    proc = tx("restore", SID[:8], "--out", out / "restored", cwd=out)
    assert proc.returncode == 0, proc.err
    restored = out / "restored" / path.name
    assert same_but_masked(restored, path) >= 1
    assert run_script("reasoning_ledger.py", "verify", ledger).returncode == 0
    no_secret_under(out)
    # never over a file
    again = tx("restore", SID, "--out", out / "restored", cwd=out)
    assert again.returncode == 2 and len(error_lines(again.err)) == 1
    listing = tx("list", cwd=out)
    assert listing.returncode == 0 and SID in listing.out and CLAUDE_MODEL in listing.out


def test_codex_session_resumed_archived_and_audited(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    codex(home, "exec", "make x.txt", turns=CODEX_TURNS)
    (path,) = rollouts(home)
    session = path.name[-42:-6]
    assert tx("import", "--codex", home / ".codex", cwd=out).returncode == 0
    ledger = out / "transcripts.jsonl"
    (seg,) = imported(ledger)
    assert seg["agent"] == "codex" and seg["session_id"] == session and seg["models"] == [CODEX_MODEL]
    (day,) = seg["usage"][CODEX_MODEL].values()
    # the stand-in reports 100 in (20 cached), 10 out (5 reasoning) per response (CHAT_USAGE)
    assert day["turns"] == 2 and day["tool_calls"] == 1
    assert (day["input_tokens"], day["cached_input_tokens"], day["output_tokens"]) == (200, 40, 20)
    assert day["reasoning_output_tokens"] == 10 and seg["carry"]["total"]["input_tokens"] == 200
    # resumed: the cumulative total carried over counts only the growth
    codex(home, "exec", "resume", session, "again", turns=[{"text": "second", "usage": CHAT_USAGE}])
    assert tx("import", "--codex", home / ".codex", cwd=out).returncode == 0
    second = imported(ledger)[1]
    (day2,) = second["usage"][CODEX_MODEL].values()
    assert day2["turns"] == 1 and day2["input_tokens"] == 100 and second["start"] == seg["end"]
    # `codex archive` moves the rollout: moved, never gone plus new
    codex(home, "archive", session)
    (archived,) = rollouts(home, "archived_sessions")
    assert archived.name == path.name and not path.exists()
    proc = tx("import", "--codex", home / ".codex", cwd=out)
    assert proc.returncode == 0 and "1 moved" in proc.out, proc.out
    (moved,) = imported(ledger, "transcript_moved")
    assert moved["from"] == str(path) and moved["source"] == str(archived)
    assert imported(ledger, "transcript_gone") == [] and len(imported(ledger)) == 2
    before = ledger.read_bytes()
    assert tx("import", "--codex", home / ".codex", cwd=out).returncode == 0
    assert ledger.read_bytes() == before
    # restore and audit
    assert tx("restore", session, "--out", out / "r", cwd=out).returncode == 0
    same_but_masked(out / "r" / path.name, archived)
    no_secret_under(out)
    report = run_script("audit.py", "--json", cwd=out)  # ./transcripts.jsonl by default
    assert report.returncode == 0, report.err
    rows = json.loads(report.out)["imported"]
    (row,) = rows["models"]
    assert row["turns"] == 3 and row["input_tokens"] == 300 and row["agent"] == "codex"
    assert rows["agents"]["codex"] == {"versions": ["0.171.0"], "sessions": 1}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A Claude Code transcript and a Codex rollout as the real CLIs wrote them."""
    home = tmp_path_factory.mktemp("clients")
    path = claude(home, "make x.txt", CLAUDE_TURNS)
    codex(home, "exec", "make x.txt", turns=CODEX_TURNS)
    return path, rollouts(home)[0]


def claude_tree(root, data, name=SID + ".jsonl"):
    target = root / "c" / "projects" / "-work"
    target.mkdir(parents=True, exist_ok=True)
    (target / name).write_bytes(data)
    return target / name


def test_a_torn_last_line_is_left_for_the_next_run(tmp_path, made):
    lines = made[0].read_bytes().splitlines(True)
    path = claude_tree(tmp_path, b"".join(lines[:-1]) + lines[-1][:40])
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    (seg,) = imported(tmp_path / "transcripts.jsonl")
    assert seg["end"] == sum(map(len, lines[:-1])) and seg["lines"] == len(lines) - 1
    with open(path, "ab") as handle:
        handle.write(lines[-1][40:])
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    second = imported(tmp_path / "transcripts.jsonl")[1]
    assert (second["start"], second["end"], second["lines"]) == (seg["end"], path.stat().st_size, len(lines))
    assert tx("restore", SID, "--out", tmp_path / "r", cwd=tmp_path).returncode == 0
    same_but_masked(tmp_path / "r" / path.name, path)


def test_a_rewritten_file_is_changed_and_a_deleted_one_gone(tmp_path, made):
    data = made[0].read_bytes()
    path = claude_tree(tmp_path, data)
    ledger = tmp_path / "transcripts.jsonl"
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    old = imported(ledger)[0]
    lines = data.splitlines(True)
    path.write_bytes(b"".join(lines[len(lines) // 2:]))  # compacted: the first half cut
    proc = tx("import", "--claude", tmp_path / "c", cwd=tmp_path)
    assert proc.returncode == 0 and "1 changed" in proc.out
    (changed,) = imported(ledger, "transcript_changed")
    assert changed["old_prefix_sha256"] == old["prefix_sha256"] != changed["new_prefix_sha256"]
    new = imported(ledger)[1]
    assert (new["version"], new["start"], new["end"]) == (2, 0, path.stat().st_size)
    # the audit counts the latest version only
    report = json.loads(run_script("audit.py", "--json", ledger).out)["imported"]["models"]
    assert sum(r["turns"] for r in report) == sum(
        d["turns"] for days in new["usage"].values() for d in days.values())
    # deleted: gone only under a directory given on that run, then noted once, still restorable
    path.unlink()
    claude_tree(tmp_path / "x", data, "other.jsonl")
    assert "0 gone" in tx("import", "--claude", tmp_path / "x" / "c", cwd=tmp_path).out
    assert "1 gone" in tx("import", "--claude", tmp_path / "c", cwd=tmp_path).out
    before = ledger.read_bytes()
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    assert ledger.read_bytes() == before and len(imported(ledger, "transcript_gone")) == 1
    proc = tx("restore", SID, "--out", tmp_path / "r", cwd=tmp_path)
    assert proc.returncode == 0, proc.err
    assert (tmp_path / "r" / path.name).read_bytes().count(b"\n") == len(lines) - len(lines) // 2


# ----------------------------------------------------------------------------
# Hostile transcripts
# ----------------------------------------------------------------------------


def test_hostile_lines_are_counted_skipped_and_kept(tmp_path, made):
    lines = made[0].read_bytes().splitlines(True)
    forged = json.dumps({"type": "user", "message": {"role": "user", "content":
                         '\n{"seq":2,"run_id":"x","kind":"note","at":"2026","payload":{},"prev":"0"}\n'}})
    hostile = [
        b"not json at all\n",
        b'{"type": "from-the-future", "x": 1}\n',
        b"[" * 100 + b"]" * 100 + b"\n",
        b'{"type": "user", "bad": "\xff\xfe"}\n',
        b'"just a string"\n',
        forged.encode() + b"\n",
        b"\x1b[2J\x07 terminal\n",
        b'{"type": {"not": "a name"}, "message": [1]}\n',
    ]
    path = claude_tree(tmp_path, b"".join(lines[:3] + hostile + lines[3:]))
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    ledger = tmp_path / "transcripts.jsonl"
    (seg,) = imported(ledger)
    assert seg["skipped"] == {"not_json": 2, "unknown_type": 3, "too_deep": 1, "not_utf8": 1}
    assert seg["lines"] == len(lines) + len(hostile)
    assert run_script("reasoning_ledger.py", "verify", ledger).returncode == 0
    assert len(lines_of(ledger)) == 1
    assert tx("restore", SID, "--out", tmp_path / "r", cwd=tmp_path).returncode == 0
    restored = (tmp_path / "r" / path.name).read_bytes()
    for line in hostile:
        assert line in restored
    listing = tx("list", cwd=tmp_path)
    assert "\x1b" not in listing.out and "\x07" not in listing.out


def test_values_a_ledger_line_cannot_carry_are_left_out_not_fatal(tmp_path):
    """Lone surrogates, NaN, 5,000-digit numbers, a huge message id, thousands of models and days:
    the import still writes one verifiable line of bounded size, and masks what it can."""
    lines = [
        '{"type":"assistant","sessionId":"\\ud800","cwd":"/w\\udfff","timestamp":"2026-12-01T00:00:00\\ud800",'
        '"message":{"id":"\\udfff","model":"m\\ud800","usage":{"input_tokens":1}}}',
        '{"type":"user","x":NaN,"note":"api_key=%s"}' % SECRETS[0],
        '{"type":"user","n":%s,"note":"token=%s"}' % ("9" * 5000, SECRETS[1]),
        '{"type":"assistant","message":{"id":"%s","model":"m"}}' % ("i" * 100000),
    ]
    for n in range(3000):
        lines.append(json.dumps({"type": "assistant", "timestamp": "2026-%02d-%02dT00:00:00Z" % (n % 12 + 1, n % 28 + 1),
                                 "message": {"id": "msg%d" % n, "model": "model-%d" % (n % 50),
                                             "usage": {"output_tokens": 1}}}))
    claude_tree(tmp_path, "\n".join(lines).encode() + b"\n", "odd.jsonl")
    proc = tx("import", "--claude", tmp_path / "c", cwd=tmp_path)
    assert proc.returncode == 0, proc.err
    ledger = tmp_path / "transcripts.jsonl"
    assert run_script("reasoning_ledger.py", "verify", ledger).returncode == 0
    (seg,) = imported(ledger)
    assert len(ledger.read_bytes()) < 300000 and seg["cwd"] is None
    assert len(seg["usage"]) <= 17 and all(len(days) <= 63 for days in seg["usage"].values())
    turns = sum(d["turns"] for days in seg["usage"].values() for d in days.values())
    assert turns == 3000  # each response once, folded or not; an id no line can carry is no turn
    no_secret_under(tmp_path / "transcripts.jsonl.text")
    assert not any(s.encode() in ledger.read_bytes() for s in SECRETS)


def test_terminal_control_in_a_session_cannot_reach_list(tmp_path):
    line = {"type": "user", "sessionId": "ev\x1b[2Jil\r\n", "cwd": "/w\x1b]0;title\x07",
            "message": {"role": "user", "content": "hi"}, "timestamp": "2026-12-01T00:00:00Z"}
    claude_tree(tmp_path, json.dumps(line).encode() + b"\n", "ev.jsonl")
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    listing = tx("list", cwd=tmp_path)
    assert listing.returncode == 0
    assert not any(c in listing.out for c in "\x1b\x07\r") and len(listing.out.splitlines()) == 2


def test_a_line_over_the_cap_is_named_not_stored_in_bounded_memory(tmp_path, made):
    """A 200 MiB line among real ones: hashed and named, not held; the import's peak memory stays
    far under the line's size (the same reading holds a 1 GB file: blocks of 1 MiB, lines to 16 MiB)."""
    lines = made[0].read_bytes().splitlines(True)
    path = claude_tree(tmp_path, b"".join(lines[:2]))
    big = 200 * 1024 * 1024
    with open(path, "ab") as handle:
        handle.write(b'{"type":"user","pad":"')
        for _ in range(big // (1 << 20)):
            handle.write(b"x" * (1 << 20))
        handle.write(b'"}\n')
        handle.write(b"".join(lines[2:]))
    # VmHWM is this process's own peak: ru_maxrss would carry the forking test process's size
    # across exec, and that grows with whatever ran before in the same pytest process
    code = ("import sys, transcripts; rc = transcripts.main(sys.argv[1:]); "
            "print([line.split()[1] for line in open('/proc/self/status') "
            "if line.startswith('VmHWM:')][0]); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "import", "--claude", str(tmp_path / "c")],
                          cwd=tmp_path, env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    peak_kib = int(proc.stdout.split()[-1])
    assert peak_kib * 1024 < big / 2, peak_kib
    (seg,) = imported(tmp_path / "transcripts.jsonl")
    (gap,) = seg["missing"]
    assert gap["line"] == 3 and gap["size"] == big + len('{"type":"user","pad":""}\n')
    assert seg["skipped"] == {"too_long": 1} and seg["end"] == path.stat().st_size
    proc = tx("restore", SID, "--out", tmp_path / "r", cwd=tmp_path)
    assert proc.returncode == 0 and "line 3" in proc.err and gap["sha256"] in proc.err
    expected = tmp_path / "expected.jsonl"  # every line but the long one
    expected.write_bytes(b"".join(lines))
    same_but_masked(tmp_path / "r" / path.name, expected)


def test_symlinks_out_of_the_tree_are_not_followed(tmp_path, made):
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(made[0].read_bytes())
    inside = claude_tree(tmp_path, made[0].read_bytes(), "inside.jsonl")
    (inside.parent / "escape.jsonl").symlink_to(outside)
    (inside.parent / "alias.jsonl").symlink_to(inside)
    (tmp_path / "c" / "projects" / "linked-dir").symlink_to(tmp_path, target_is_directory=True)
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    sources = sorted(Path(s["source"]).name for s in imported(tmp_path / "transcripts.jsonl"))
    assert sources == ["alias.jsonl", "inside.jsonl"]


def test_no_source_and_bad_arguments(tmp_path):
    proc = tx("import", "--claude", tmp_path / "missing", cwd=tmp_path)
    assert proc.returncode == 2 and len(error_lines(proc.err)) == 1
    assert not (tmp_path / "transcripts.jsonl").exists()
    proc = tx("list", cwd=tmp_path)
    assert proc.returncode == 2 and len(error_lines(proc.err)) == 1
    claude_tree(tmp_path, b'{"type":"user","sessionId":"abc1"}\n', "a.jsonl")
    claude_tree(tmp_path, b'{"type":"user","sessionId":"abc2"}\n', "b.jsonl")
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    proc = tx("restore", "abc", "--out", tmp_path / "r", cwd=tmp_path)  # two sessions match
    assert proc.returncode == 2 and "2 sessions" in proc.err and not (tmp_path / "r").exists()
    # defaults: $CLAUDE_CONFIG_DIR and $CODEX_HOME, and $LEDGER
    env = clean_env(CLAUDE_CONFIG_DIR=tmp_path / "c", CODEX_HOME=tmp_path / "none", LEDGER=tmp_path / "l.jsonl")
    proc = tx("import", cwd=tmp_path, env=env)
    assert proc.returncode == 0 and len(imported(tmp_path / "l.jsonl")) == 2


# ----------------------------------------------------------------------------
# Shipped like any ledger: fleet.py ship, fleet.py verify --from, audit.py --from
# ----------------------------------------------------------------------------


def test_imported_sessions_ship_and_audit_from_clickhouse(tmp_path, made):
    from clickhouse_server import ClickHouse, skip_reason
    reason = skip_reason()
    if reason:
        if os.environ.get("CLICKHOUSE_REQUIRED") == "1":
            pytest.fail(f"CLICKHOUSE_REQUIRED=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    claude_tree(tmp_path, made[0].read_bytes())
    codex_home = tmp_path / "x"
    shutil.copytree(made[1].parent, codex_home / "sessions" / "2026")
    assert tx("import", "--claude", tmp_path / "c", "--codex", codex_home, cwd=tmp_path).returncode == 0
    local = json.loads(run_script("audit.py", "--json", cwd=tmp_path).out)["imported"]
    ch = ClickHouse.start(tmp_path / "ch")
    try:
        env = clean_env(CLICKHOUSE_USER=ch.SHIPPER_USER, CLICKHOUSE_PASSWORD=ch.SHIPPER_PASSWORD)
        where = ("--to", ch.url, "--database", "transcripts")
        ch.query("CREATE DATABASE transcripts")
        proc = run_script("fleet.py", "ship", "transcripts.jsonl", *where, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.err
        where = ("--from", ch.url, "--database", "transcripts")
        assert run_script("fleet.py", "verify", *where, cwd=tmp_path, env=env).returncode == 0
        proc = run_script("audit.py", *where, "--json", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.err
        remote = json.loads(proc.out)["imported"]
    finally:
        ch.stop()
    assert remote == local and {r["agent"] for r in remote["models"]} == {"claude-code", "codex"}


def test_the_audit_shows_a_codex_session_beside_its_proxied_calls(tmp_path):
    """Codex through proxy.py: the proxy's model_call lines and the imported rollout, in one audit, the
    tokens each reports under its own names."""
    codex(tmp_path, "exec", "make x.txt", turns=CODEX_TURNS)  # the proxy writes ./calls.jsonl
    assert tx("import", "--codex", tmp_path / ".codex", cwd=tmp_path).returncode == 0
    report = run_script("audit.py", "--json", cwd=tmp_path)  # ./calls.jsonl and ./transcripts.jsonl
    assert report.returncode == 0, report.err
    audit = json.loads(report.out)
    (calls,) = audit["models"]
    (session,) = audit["imported"]["models"]
    assert calls["request_model"] == session["model"] == CODEX_MODEL
    assert calls["calls"] == session["turns"] == 2
    assert calls["input_tokens"] == session["input_tokens"] == 200
    assert audit["imported"]["agents"] == {"codex": {"versions": ["0.171.0"], "sessions": 1}}
    text = run_script("audit.py", cwd=tmp_path).out
    assert "Imported sessions" in text and "from: codex 0.171.0 (1 sessions)" in text
    disk = all_bytes_under(tmp_path)
    assert PROXY_TOKEN.encode() not in disk and SECRETS[1].encode() not in (tmp_path / "calls.jsonl").read_bytes()


def test_restore_refuses_a_store_that_lost_or_changed_a_piece(tmp_path, made):
    claude_tree(tmp_path, made[0].read_bytes())
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path).returncode == 0
    (piece,) = (tmp_path / "transcripts.jsonl.text").iterdir()
    piece.write_bytes(piece.read_bytes() + b"\n")
    proc = tx("restore", SID, "--out", tmp_path / "r", cwd=tmp_path)
    assert proc.returncode == 1 and "does not match its name" in proc.err
    piece.unlink()
    proc = tx("restore", SID, "--out", tmp_path / "r", cwd=tmp_path)
    assert proc.returncode == 2 and len(error_lines(proc.err)) == 1
    assert list((tmp_path / "r").iterdir()) == []  # nothing half-written is left


def test_imports_that_overlap_write_each_segment_once(tmp_path, made):
    claude_tree(tmp_path, made[0].read_bytes())
    cmd = [sys.executable, str(ROOT / "transcripts.py"), "import", "--claude", str(tmp_path / "c")]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE) for _ in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    assert len(imported(tmp_path / "transcripts.jsonl")) == 1
    assert tx("restore", SID, "--out", tmp_path / "r", cwd=tmp_path).returncode == 0


def test_hostile_codex_lines_are_counted_not_fatal(tmp_path, made):
    lines = made[1].read_bytes().splitlines(True)
    hostile = [
        b'{"type":"response_item","payload":{"type":["function_call"]}}\n',
        b'{"type":"event_msg","payload":{"type":{"token_count":1}}}\n',
        b'{"type":"event_msg","payload":{"type":"token_count","info":{"total_token_usage":'
        b'{"input_tokens":1e400,"output_tokens":-5,"total_tokens":' + b"9" * 20 + b'}}}}\n',
        b'{"type":"turn_context","payload":"not an object"}\n',
        b'{"type":"session_meta","payload":{"id":["x"],"cwd":7}}\n',
    ]
    sessions = tmp_path / "x" / "sessions" / "2026" / "12" / "02"
    sessions.mkdir(parents=True)
    first = next(n for n, line in enumerate(lines) if b'"token_count"' in line) + 1  # between two totals
    (sessions / made[1].name).write_bytes(b"".join(lines[:first] + hostile + lines[first:]))
    assert tx("import", "--codex", tmp_path / "x", cwd=tmp_path).returncode == 0
    (seg,) = imported(tmp_path / "transcripts.jsonl")
    assert seg["skipped"] == {} and seg["lines"] == len(lines) + len(hostile)
    (day,) = seg["usage"][CODEX_MODEL].values()
    assert day["turns"] == 2 and day["tool_calls"] == 1 and day["input_tokens"] == 200


def test_a_secret_value_that_json_escapes_is_masked_too(tmp_path):
    """An environment secret with a quote and a backslash is in the file as JSON spells it."""
    secret = 'quo"te\\slash-secret-0042'
    line = {"type": "user", "sessionId": "esc", "message": {"role": "user", "content": f"use {secret} now"}}
    claude_tree(tmp_path, json.dumps(line).encode() + b"\n", "esc.jsonl")
    env = clean_env(MY_SERVICE_SECRET=secret)
    assert tx("import", "--claude", tmp_path / "c", cwd=tmp_path, env=env).returncode == 0
    stored = all_bytes_under(tmp_path / "transcripts.jsonl.text")
    assert json.dumps(secret)[1:-1].encode() not in stored and b"[REDACTED]" in stored
    json.loads(stored)
