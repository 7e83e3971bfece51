"""The ledger: format, chain, crash safety, tamper detection, redaction, runs, CLI."""

import ast
import hashlib
import hmac
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

import reasoning_ledger as rl
from conftest import ROOT, all_bytes_under, chain, clean_env, event, lines_of, run_script

NO_KEY = b""  # explicit "unkeyed", whatever LEDGER_KEY the test machine has


def write(path, n, run_id="r1", key=NO_KEY, **payload):
    with rl.Ledger(path, run_id, key=key) as ledger:
        for i in range(n):
            ledger.append("note", dict(payload, i=i))


# ----------------------------------------------------------------------------
# Format
# ----------------------------------------------------------------------------

def test_line_format_and_chain_as_documented(tmp_path):
    path = tmp_path / "events.jsonl"
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        ledger.append("note", {"text": "你好，世界", "n": 1.5, "ok": True, "none": None})
        ledger.decide("plan", "run the tests first", "cheapest signal", ["read the code"])
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3
    first = json.loads(lines[0])
    assert list(first) == ["seq", "run_id", "kind", "at", "payload", "prev"]
    assert first["seq"] == 1 and first["prev"] == "0" * 64
    assert "你好，世界".encode("utf-8") in lines[0]  # ensure_ascii=False: stored as UTF-8
    assert b", " not in lines[0] and b": " not in lines[0]  # compact separators
    assert first["at"].endswith("Z") and len(first["at"]) == 27
    second = json.loads(lines[1])
    assert second["prev"] == hashlib.sha256(lines[0]).hexdigest()
    assert second["payload"] == {"stage": "plan", "decision": "run the tests first",
                                 "rationale": "cheapest signal", "alternatives": ["read the code"]}
    # docs/format.md's recipe with the real sha256sum
    if shutil.which("sha256sum"):
        out = subprocess.run(f"sed -n 1p {path} | tr -d '\\n' | sha256sum", shell=True,
                             capture_output=True, text=True).stdout.split()[0]
        assert out == second["prev"]
    assert list(rl.read_events(path)) == [first, second]


def test_chinese_text_round_trips_through_cli(tmp_path):
    path = tmp_path / "l.jsonl"
    text = "模型在周二换了：回答变短了。🙂"
    proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note", input=json.dumps({"text": text}))
    assert proc.returncode == 0, proc.err
    assert lines_of(path)[0]["payload"]["text"] == text
    report = run_script("reasoning_ledger.py", "report", path, "--json")
    assert json.loads(report.out)["payload"]["text"] == text


def test_restart_continues_seq(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 3)
    for _ in range(2):  # new processes, new objects
        proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note", "--payload", '{"x": 1}')
        assert proc.returncode == 0, proc.err
    assert [e["seq"] for e in lines_of(path)] == [1, 2, 3, 4, 5]
    head = proc.out.split()
    assert head[0] == "5"
    assert head[1] == hashlib.sha256(path.read_bytes().splitlines()[-1]).hexdigest()
    assert rl.verify(path).count == 5


def test_two_ledger_objects_on_one_file_interleave(tmp_path):
    path = tmp_path / "l.jsonl"
    a, b = rl.Ledger(path, "a", key=NO_KEY), rl.Ledger(path, "b", key=NO_KEY)
    for i in range(5):
        a.append("note", {"i": i})
        b.append("note", {"i": i})
    a.close(), b.close()
    assert [e["seq"] for e in rl.read_events(path)] == list(range(1, 11))


# ----------------------------------------------------------------------------
# Concurrency and crashes
# ----------------------------------------------------------------------------

WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import reasoning_ledger as rl
count = int(sys.argv[4])
with rl.Ledger(sys.argv[2], sys.argv[3], key=b"") as ledger:
    for i in range(count):
        event = ledger.append("note", {"writer": sys.argv[3], "i": i})
        print(event["seq"], i, flush=True)
"""


def test_two_processes_500_appends_each(tmp_path):
    path = tmp_path / "l.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT), str(path), name, "500"],
                              stdout=subprocess.PIPE, env=clean_env()) for name in ("w1", "w2")]
    for proc in procs:
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    events = list(rl.read_events(path))
    assert [e["seq"] for e in events] == list(range(1, 1001))
    for name in ("w1", "w2"):
        assert sorted(e["payload"]["i"] for e in events if e["run_id"] == name) == list(range(500))
    assert run_script("reasoning_ledger.py", "verify", path).returncode == 0


def test_kill_9_at_random_moments_never_breaks_the_ledger(tmp_path):
    path = tmp_path / "l.jsonl"
    rng = random.Random(7)
    returned = {}
    for round_no in range(8):
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT), str(path), f"k{round_no}{w}",
                                   "100000"], stdout=subprocess.PIPE, env=clean_env()) for w in range(2)]
        firsts = [proc.stdout.readline() for proc in procs]  # each writer has appended: a slow start is no miss
        time.sleep(rng.uniform(0.0, 0.3))
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        for proc, first in zip(procs, firsts):
            out = first + proc.stdout.read()  # through the buffer readline() filled: communicate() would skip it
            proc.stdout.close()
            proc.wait(timeout=30)
            name = proc.args[5]
            for row in out.decode().split("\n")[:-1]:  # a row cut by the kill is not counted
                seq, i = map(int, row.split())
                returned[seq] = (name, i)
        with rl.Ledger(path, "after-crash", key=NO_KEY) as ledger:  # the next append repairs
            ledger.append("note", {"round": round_no})
        assert run_script("reasoning_ledger.py", "verify", path).returncode == 0
    by_seq = {e["seq"]: e for e in rl.read_events(path)}
    assert returned, "the writers never got to append"
    for seq, (name, i) in returned.items():  # every append that returned is there, unchanged
        assert by_seq[seq]["run_id"] == name and by_seq[seq]["payload"]["i"] == i


def test_torn_tail_is_reported_then_recovered_into_sidecar(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 3)
    good = path.read_bytes()
    fragment = b'{"seq":4,"run_id":"r1","kind":"note","at":"2026-'
    with open(path, "ab") as handle:
        handle.write(fragment)
    proc = run_script("reasoning_ledger.py", "verify", path)
    assert proc.returncode == 1
    assert "line 4" in proc.out and "torn tail" in proc.out
    with pytest.raises(rl.TornTailError):
        list(rl.read_events(path))
    with rl.Ledger(path, "r2", key=NO_KEY) as ledger:
        event = ledger.append("note", {"after": True})
    assert event["seq"] == 5
    assert path.read_bytes().startswith(good)
    events = list(rl.read_events(path))
    recovered = events[3]
    assert recovered["kind"] == "ledger_recovered"
    assert recovered["payload"] == {"offset": len(good), "length": len(fragment),
                                    "sha256": hashlib.sha256(fragment).hexdigest(), "sidecar": "l.jsonl.torn"}
    sidecar = (tmp_path / "l.jsonl.torn").read_bytes()
    assert fragment in sidecar and f"offset={len(good)}".encode() in sidecar
    assert stat.S_IMODE((tmp_path / "l.jsonl.torn").stat().st_mode) == 0o600


def test_file_that_is_only_a_fragment_recovers_to_line_1(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_bytes(b'{"seq":1,"ru')
    with rl.Ledger(path, "r", key=NO_KEY) as ledger:
        ledger.append("note", {})
    assert [e["kind"] for e in rl.read_events(path)] == ["ledger_recovered", "note"]


# ----------------------------------------------------------------------------
# Tampering
# ----------------------------------------------------------------------------

def _lines(path):
    return path.read_bytes().splitlines(keepends=True)


def _verify_fails(path, *extra, env=None):
    proc = run_script("reasoning_ledger.py", "verify", path, *extra, env=env)
    assert proc.returncode == 1, proc.out + proc.err
    assert "0/1 ledgers valid" in proc.out
    assert proc.err.startswith("error: ")
    return proc.out


def test_flipped_byte_is_detected_at_the_next_line(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 5, text="aaaa")
    lines = _lines(path)
    lines[2] = lines[2].replace(b"aaaa", b"aaab")
    path.write_bytes(b"".join(lines))
    assert "line 4: prev does not match line 3" in _verify_fails(path)


def test_flipped_byte_that_breaks_json_is_named(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 5)
    data = bytearray(path.read_bytes())
    data[len(_lines(path)[0]) + 1] ^= 0x01  # line 2, second byte: '"' becomes '#'
    path.write_bytes(bytes(data))
    assert "line 2: broken JSON" in _verify_fails(path)
    data[len(_lines(path)[0]) + 1] ^= 0x01 ^ 0xFF  # the same byte, now not UTF-8 at all
    path.write_bytes(bytes(data))
    assert "line 2: not UTF-8 (byte 1)" in _verify_fails(path)


def test_deleted_line_is_detected(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 5)
    lines = _lines(path)
    del lines[1]
    path.write_bytes(b"".join(lines))
    assert "line 2: expected seq 2, got 3" in _verify_fails(path)


def test_swapped_lines_are_detected(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 5)
    lines = _lines(path)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_bytes(b"".join(lines))
    assert "line 2: expected seq 2, got 3" in _verify_fails(path)


def test_inserted_line_is_detected(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 5)
    lines = _lines(path)
    lines.insert(2, lines[1])
    path.write_bytes(b"".join(lines))
    assert "line 3: expected seq 3, got 2" in _verify_fails(path)


def test_forged_line_with_right_seq_is_detected_by_the_chain(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 3)
    lines = _lines(path)
    forged = json.loads(lines[1])
    forged["payload"] = {"i": 99}
    lines[1] = rl.dumps(forged).encode() + b"\n"
    path.write_bytes(b"".join(lines))
    assert "line 3: prev does not match line 2" in _verify_fails(path)


def test_nul_byte_is_named(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 3)
    lines = _lines(path)
    lines[1] = lines[1][:5] + b"\x00" + lines[1][5:]
    path.write_bytes(b"".join(lines))
    assert "line 2: NUL byte" in _verify_fails(path)


def test_truncated_tail_needs_the_published_head(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 5)
    head = run_script("reasoning_ledger.py", "head", path).out.strip()
    seq, digest = head.split()
    assert seq == "5"
    ok = run_script("reasoning_ledger.py", "verify", path, "--expect-head", f"{seq}:{digest}")
    assert ok.returncode == 0 and "1/1 ledgers valid" in ok.out
    path.write_bytes(b"".join(_lines(path)[:-1]))
    assert run_script("reasoning_ledger.py", "verify", path).returncode == 0  # alone, undetectable
    assert "truncated" in _verify_fails(path, "--expect-head", f"{seq}:{digest}")
    # growing the truncated file again does not help: its new seq 5 is not the published line
    write(path, 3)
    assert "does not match the expected head" in _verify_fails(path, "--expect-head", head)


def test_growth_after_published_head_verifies(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 2)
    head = run_script("reasoning_ledger.py", "head", path).out.strip()
    write(path, 2)
    assert run_script("reasoning_ledger.py", "verify", path, "--expect-head", head).returncode == 0


def test_keyed_ledger_detects_a_whole_file_rewrite(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 4, key="k3y-for-tests", text="original")
    first = json.loads(_lines(path)[0])
    assert first["prev"] == hmac.new(b"k3y-for-tests", b"", hashlib.sha256).hexdigest()
    keyed = clean_env(LEDGER_KEY="k3y-for-tests")
    assert run_script("reasoning_ledger.py", "verify", path, env=keyed).returncode == 0
    # without the key: an error that says a key is needed
    proc = run_script("reasoning_ledger.py", "verify", path)
    assert proc.returncode == 2 and "key is needed" in proc.out + proc.err
    # an attacker rewrites every line with a fresh, consistent plain chain ...
    events = list(rl.read_events(path, key="k3y-for-tests"))
    forged = tmp_path / "forged.jsonl"
    with rl.Ledger(forged, "r1", key=NO_KEY) as ledger:
        for event in events:
            ledger.append("note", dict(event["payload"], text="forged"))
    assert run_script("reasoning_ledger.py", "verify", forged).returncode == 0
    assert "not keyed" in _verify_fails(forged, env=keyed)
    # ... or with a key of their own
    other = tmp_path / "other.jsonl"
    write(other, 4, key="attacker-key", text="forged")
    assert "line 1" in _verify_fails(other, env=keyed)
    # --key-env names another variable
    alt = clean_env(MY_KEY="k3y-for-tests")
    assert run_script("reasoning_ledger.py", "verify", path, "--key-env", "MY_KEY", env=alt).returncode == 0


def test_appending_without_the_key_to_a_keyed_ledger_is_refused(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 2, key="secret-key-1")
    before = path.read_bytes()
    with pytest.raises(rl.KeyRequiredError):
        write(path, 1)
    with pytest.raises(rl.LedgerError):
        write(tmp_path / "plain.jsonl", 1) or write(tmp_path / "plain.jsonl", 1, key="secret-key-1")
    assert path.read_bytes() == before


def test_run_id_must_match_the_run_directory(tmp_path):
    run = rl.open_run(tmp_path / "runs", key=NO_KEY)
    run.append("note", {})
    path = run.dir / "events.jsonl"
    before = path.read_bytes()
    with pytest.raises(rl.UsageError, match="holds run .*'s events only; not 'xyz'"):
        write(path, 1, run_id="xyz")
    assert path.read_bytes() == before
    with rl.Ledger(path, key=NO_KEY) as ledger:  # the run id defaults to the directory's
        assert ledger.append("note", {})["run_id"] == run.run_id
    # a forged line with another run id, chained correctly, is still caught on reading
    forged = chain([event(1, run_id=run.run_id), event(2, run_id="xyz")])
    path.write_bytes(forged)
    with pytest.raises(rl.IntegrityError, match="line 2: run_id 'xyz' differs"):
        list(rl.read_events(path))


# ----------------------------------------------------------------------------
# Bad input loses nothing
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("payload", [
    {"body": b"bytes"}, {"n": float("nan")}, {"n": float("inf")}, {"s": {1, 2}}, {1: "int key"},
    {"when": __import__("datetime").datetime(2026, 1, 1)}, {"deep": [{"ok": 1}, {"bad": object()}]},
    "not a dict", {"big": "x" * (1024 * 1024)},
])
def test_rejected_payload_leaves_the_file_unchanged(tmp_path, payload):
    path = tmp_path / "l.jsonl"
    write(path, 2)
    before = path.read_bytes()
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        with pytest.raises(rl.PayloadError):
            ledger.append("note", payload)
    assert path.read_bytes() == before


def test_payload_error_names_the_place(tmp_path):
    with rl.Ledger(tmp_path / "l.jsonl", "r", key=NO_KEY) as ledger:
        with pytest.raises(rl.PayloadError, match=r"payload\.deep\[1\]\.bad: a object is not a JSON type"):
            ledger.append("note", {"deep": [{"ok": 1}, {"bad": object()}]})
        with pytest.raises(rl.PayloadError, match="bad kind"):
            ledger.append("Not-A-Kind", {})


def test_cli_bad_payload_is_exit_2_and_writes_nothing(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 1)
    before = path.read_bytes()
    for args, stdin in ((["--payload", "{broken"], ""), (["--payload", "[1, 2]"], ""), ([], "NaN"),
                        (["--payload", '{"x": NaN}'], "")):
        proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note", *args, input=stdin)
        assert proc.returncode == 2, (args, proc.err)
        assert proc.err.startswith("error: ") and proc.out == ""
    assert path.read_bytes() == before


def test_cli_usage_and_io_errors_are_exit_2(tmp_path):
    assert run_script("reasoning_ledger.py").returncode == 2
    assert run_script("reasoning_ledger.py", "verify").returncode == 2
    assert run_script("reasoning_ledger.py", "bogus").returncode == 2
    missing = run_script("reasoning_ledger.py", "verify", tmp_path / "nope.jsonl")
    assert missing.returncode == 2 and "0/1 ledgers valid" in missing.out
    assert run_script("reasoning_ledger.py", "head", tmp_path / "nope.jsonl").returncode == 2
    bad = run_script("reasoning_ledger.py", "verify", tmp_path / "x", "--expect-head", "nonsense")
    assert bad.returncode == 2 and "SEQ:HASH" in bad.err


def test_appending_to_a_file_that_is_not_a_ledger_is_refused(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text('{"hello": "world"}\n')
    with pytest.raises(rl.IntegrityError):
        write(path, 1)
    assert path.read_text() == '{"hello": "world"}\n'


# ----------------------------------------------------------------------------
# Secrets
# ----------------------------------------------------------------------------

SECRETS = {
    "env_api_key": "envkey-7f3a9c2e1b",
    "custom_env": "customsecret-51d0",
    "bearer": "abcDEF123456ghiJKL",
    "sk": "sk-proj-A1b2C3d4E5f6G7h8I9j0",
    "ghp": "ghp_abcdefghijklmnopqrstuvwxyz012345",
    "slack": "xoxb-1234567890-abcdefghij",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "pem": "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC",
    "url_pass": "hunter2pass",
    "query_token": "qtok-99887766",
    "key_value": "plain-password-value",
}


def test_secrets_never_reach_disk(tmp_path):
    payload = {
        "api_key": SECRETS["key_value"],
        "nested": [{"headers": {"Authorization": "Bearer " + SECRETS["bearer"], "X-Api-Key": "v-1"}},
                   {"password": SECRETS["key_value"], "db_secret": SECRETS["key_value"]}],
        "cookie": "session=" + SECRETS["key_value"],
        "text": f"the key {SECRETS['sk']} and {SECRETS['ghp']} and {SECRETS['slack']} and {SECRETS['aws']}",
        "log": f"got env key {SECRETS['env_api_key']} and {SECRETS['custom_env']}",
        "pem": f"-----BEGIN RSA PRIVATE KEY-----\n{SECRETS['pem']}\n-----END RSA PRIVATE KEY-----",
        "url": f"https://user:{SECRETS['url_pass']}@llm.example.net/v1?token={SECRETS['query_token']}&x=1",
        "input_tokens": 12, "output_tokens": 7, "total_tokens": 19, "token_count": 3,
    }
    env = clean_env(API_KEY=SECRETS["env_api_key"], MY_VAULT=SECRETS["custom_env"],
                    LEDGER_REDACT_ENV="MY_VAULT")
    path = tmp_path / "l.jsonl"
    proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note", input=json.dumps(payload),
                      env=env)
    assert proc.returncode == 0, proc.err
    stored = lines_of(path)[0]["payload"]
    assert stored["input_tokens"] == 12 and stored["output_tokens"] == 7 and stored["token_count"] == 3
    assert stored["api_key"] == "[REDACTED]" and stored["cookie"] == "[REDACTED]"
    assert stored["url"].startswith("https://[REDACTED]@llm.example.net/v1?token=[REDACTED]&x=1")
    blob = all_bytes_under(tmp_path)
    for name, secret in SECRETS.items():
        assert secret.encode() not in blob, name


def test_artifacts_are_content_addressed_private_and_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("API_KEY", "artifact-key-123456")
    ledger = rl.Ledger(tmp_path / "runs.jsonl", "r", key=NO_KEY)
    ref = ledger.store_artifact("prompt with artifact-key-123456 inside")
    stored = (tmp_path / ref["path"]).read_bytes()
    assert ref["sha256"] == hashlib.sha256(stored).hexdigest() and ref["size"] == len(stored)
    assert b"artifact-key-123456" not in stored
    assert stat.S_IMODE((tmp_path / "artifacts").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / ref["path"]).stat().st_mode) == 0o600
    assert ledger.store_artifact(b"\xff\xfe binary") != ref


def test_file_modes(tmp_path):
    old = os.umask(0o022)
    try:
        write(tmp_path / "l.jsonl", 1)
        run = rl.open_run(tmp_path / "runs", key=NO_KEY)
        run.append("note", {})
        run.close("no_action")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "l.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(run.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run.dir / "events.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "runs" / "index.jsonl").stat().st_mode) == 0o600


# ----------------------------------------------------------------------------
# Runs and the index
# ----------------------------------------------------------------------------

def test_runs_are_fresh_sorted_and_anchored_in_the_index(tmp_path):
    runs = tmp_path / "runs"
    ids = []
    for outcome in ("no_action", "proposal_written"):
        with rl.open_run(runs, key=NO_KEY) as run:
            run.decide("triage", "look at the failing test", "it is the only signal", [])
            run.close(outcome)
            ids.append(run.run_id)
    assert ids == sorted(ids) and ids[0] != ids[1]
    index = list(rl.read_events(runs / "index.jsonl"))
    assert [e["payload"]["run"] for e in index] == ids
    for entry, run_id in zip(index, ids):
        result = rl.verify(runs / run_id / "events.jsonl")
        assert (result.head[0], result.head[1]) == (entry["payload"]["head_seq"], entry["payload"]["head_hash"])
    open_run = rl.open_run(runs, key=NO_KEY)  # an open run: verified, not in the index
    open_run.append("note", {})
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 0, proc.out
    assert "4/4 ledgers valid" in proc.out


def test_verify_all_catches_a_truncated_closed_run_and_a_missing_one(tmp_path):
    runs = tmp_path / "runs"
    made = []
    for _ in range(2):
        run = rl.open_run(runs, key=NO_KEY)
        run.append("note", {"a": 1})
        run.close("no_action")
        made.append(run)
    events = made[0].dir / "events.jsonl"
    events.write_bytes(b"".join(_lines(events)[:-1]))  # drop run_closed: chain still valid alone
    assert run_script("reasoning_ledger.py", "verify", events).returncode == 0
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 1 and "truncated" in proc.out
    shutil.rmtree(made[1].dir)
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 1 and "missing" in proc.out


def test_verify_all_and_the_audit_catch_a_line_appended_after_a_run_closed(tmp_path):
    runs = tmp_path / "runs"
    run = rl.open_run(runs, key=NO_KEY)
    run.append("note", {"a": 1})
    run.close("no_action")
    events = run.dir / "events.jsonl"
    assert run_script("reasoning_ledger.py", "verify", "--all", runs).returncode == 0
    added = run_script("reasoning_ledger.py", "append", events, "--kind", "note", env=clean_env(),
                       input=b'{"late": true}')
    assert added.returncode == 0, added.err  # the file alone takes it: its chain is whole
    assert run_script("reasoning_ledger.py", "verify", events).returncode == 0
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 1 and "line 3: 1 line(s) after the run closed at seq 2" in proc.out, proc.out
    audit = run_script("audit.py", runs)
    assert audit.returncode == 1 and "after the run closed" in audit.err


def test_run_directories_are_never_reused(tmp_path):
    runs = tmp_path / "runs"
    ids = {rl.open_run(runs, key=NO_KEY).run_id for _ in range(50)}
    assert len(ids) == 50 and len(list(runs.iterdir())) == 50


# ----------------------------------------------------------------------------
# report / head
# ----------------------------------------------------------------------------

def test_report_filters_and_json_passthrough(tmp_path):
    path = tmp_path / "l.jsonl"
    with rl.Ledger(path, "run-a", key=NO_KEY) as ledger:
        ledger.decide("plan", "write a test", "reproduce first", ["patch directly"])
        ledger.append("model_call", {"request_model": "m1", "error_type": "timeout"})
        ledger.decide("judge", "reject", "tests still fail")
    with rl.Ledger(path, "run-b", key=NO_KEY) as ledger:
        ledger.append("note", {})
    proc = run_script("reasoning_ledger.py", "report", path)
    assert proc.returncode == 0
    rows = proc.out.splitlines()
    assert len(rows) == 4
    assert "#1  decision  stage=plan  decision=write a test  -- reproduce first" in rows[0]
    assert "error_type=timeout" in rows[1]
    stage = run_script("reasoning_ledger.py", "report", path, "--stage", "judge").out.splitlines()
    assert len(stage) == 1 and "decision=reject" in stage[0]
    kinds = run_script("reasoning_ledger.py", "report", path, "--kind", "decision", "--json").out
    raw = path.read_bytes().decode().splitlines()
    assert kinds.splitlines() == [raw[0], raw[2]]
    assert len(run_script("reasoning_ledger.py", "report", path, "--run", "run-b").out.splitlines()) == 1
    assert run_script("reasoning_ledger.py", "report", path, "--since", "2999-01-01").out == ""
    assert len(run_script("reasoning_ledger.py", "report", path, "--until", "2999-01-01").out.splitlines()) == 4
    assert len(run_script("reasoning_ledger.py", "report", path, "--since", "yesterday").out.splitlines()) == 4
    assert run_script("reasoning_ledger.py", "report", path, "--since", "1h").out.count("\n") == 4
    assert run_script("reasoning_ledger.py", "report", path, "--since", "last week").returncode == 2


def test_report_refuses_a_tampered_ledger(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 3)
    lines = _lines(path)
    path.write_bytes(lines[0] + lines[2])
    proc = run_script("reasoning_ledger.py", "report", path)
    assert proc.returncode == 1 and "line 2" in proc.err


def test_head_of_an_empty_ledger_is_the_genesis(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.touch()
    assert run_script("reasoning_ledger.py", "head", path).out.strip() == "0 " + "0" * 64


# ----------------------------------------------------------------------------
# Project rules
# ----------------------------------------------------------------------------

def test_shipped_scripts_parse_as_python_3_9_and_import_only_the_stdlib():
    local = {p.stem for p in ROOT.glob("*.py")}
    std = set(getattr(sys, "stdlib_module_names", ()))  # Python 3.10+; on 3.9 only the syntax is held
    for path in sorted(ROOT.glob("*.py")) + [ROOT / "tests" / "fake_openai.py", ROOT / "tests" / "bench.py"]:
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), feature_version=(3, 9))
        if path.parent != ROOT or not std:
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] in std | local | {"__future__"}, f"{path.name} imports {name}"


def test_nested_non_string_key_and_escaped_env_secret(tmp_path, monkeypatch):
    path = tmp_path / "l.jsonl"
    write(path, 1)
    before = path.read_bytes()
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        with pytest.raises(rl.PayloadError, match=r"payload\.a\.b"):
            ledger.append("note", {"a": {"b": {7: "int key"}}})
        with pytest.raises(rl.PayloadError, match=r"nested deeper than 64 levels \(or circular\)"):
            loop = {}
            loop["self"] = loop
            ledger.append("note", loop)
    assert path.read_bytes() == before
    monkeypatch.setenv("API_KEY", 'quo"te\\key-42')
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        event = ledger.append("note", {"msg": 'server said quo"te\\key-42'})
    assert event["payload"]["msg"] == "server said [REDACTED]"
    assert b"key-42" not in path.read_bytes()


def test_whitespace_around_a_line_is_not_the_ledger_form(tmp_path):
    path = tmp_path / "l.jsonl"
    write(path, 2)
    lines = _lines(path)
    lines[1] = b" " + lines[1]
    path.write_bytes(b"".join(lines))
    assert "line 2: not in the writer's compact form" in _verify_fails(path)
