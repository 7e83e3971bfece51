"""ship, fleet.py verify and audit.py --from against a real clickhouse-server (tests/clickhouse_server.py).

Without a usable clickhouse-server these tests are skipped with the reason in one line; with
CLICKHOUSE_REQUIRED=1 (CI) they fail instead, so CI can never pass without running them."""

import hashlib
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ask
import fleet
import reasoning_ledger as rl
from clickhouse_server import ClickHouse, skip_reason
from conftest import (ROOT, SAMPLE_CALC, all_bytes_under, clean_env, clock_for, error_lines, lines_of, make_repo,
                      run_script, tools_json)

KEY = "sk-ship-test-key-0001"
DAY1, DAY2, DAY3 = "2026-11-01", "2026-11-02", "2026-11-03"


# ----------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def clickhouse(tmp_path_factory):
    reason = skip_reason()
    if reason:
        if os.environ.get("CLICKHOUSE_REQUIRED") == "1":
            pytest.fail(f"CLICKHOUSE_REQUIRED=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    ch = ClickHouse.start(tmp_path_factory.mktemp("clickhouse"))
    yield ch
    ch.stop()


@pytest.fixture
def db(clickhouse, request):
    """A database name of this test's own; ship creates it. Dropped (never truncated) before and after."""
    name = "t_" + re.sub(r"[^A-Za-z0-9]", "_", request.node.name)[:60]
    clickhouse.query(f"DROP DATABASE IF EXISTS {name}")
    yield name
    if clickhouse.alive():
        clickhouse.query(f"DROP DATABASE IF EXISTS {name}")


def ch_env(ch, **extra):
    return clean_env(CLICKHOUSE_USER=ch.SHIPPER_USER, CLICKHOUSE_PASSWORD=ch.SHIPPER_PASSWORD, **extra)


def ship(ch, db, *args, env=None, timeout=120):
    return run_script("fleet.py", "ship", *args, "--to", ch.url, "--database", db,
                      env=env or ch_env(ch), timeout=timeout)


def verify_from(ch, db, *args, env=None):
    return run_script("fleet.py", "verify", "--from", ch.url, "--database", db, *args,
                      env=env or ch_env(ch))


def audit_from(ch, db, *args):
    return run_script("audit.py", "--from", ch.url, "--database", db, *args, env=ch_env(ch))


def rows(ch, sql):
    """A SELECT's rows as dicts (64-bit integers as numbers)."""
    text = ch.query(sql + " FORMAT JSONEachRow", params={"output_format_json_quote_64bit_integers": 0})
    return [json.loads(line) for line in text.splitlines()]


def counts(ch, db):
    """(rows, rows under FINAL): equal when no line is stored twice."""
    return (int(ch.query(f"SELECT count() FROM {db}.ledger_lines")),
            int(ch.query(f"SELECT count() FROM {db}.ledger_lines FINAL")))


def ledger_id(path):
    return hashlib.sha256(Path(path).read_bytes().split(b"\n", 1)[0]).hexdigest()


def calls(path, server, day, scenarios, model="fake-model", **kwargs):
    """ask.ask() (the code path of `python ask.py`), the ledger's clock set to `day`."""
    server.queue(*scenarios)
    with rl.Ledger(path, f"r{day}", key=b"", clock=clock_for(day)) as ledger:
        for _ in scenarios:
            ask.ask("What is 2 + 2?", ledger=ledger, base_url=server.base_url, model=model, api_key=KEY, **kwargs)


def notes(path, n, start=0, **kwargs):
    with rl.Ledger(path, "notes", key=b"", fsync=False, **kwargs) as ledger:
        for i in range(start, start + n):
            ledger.append("note", {"i": i, "text": "x" * 50})


def agent_run(runs, server, outcome, denied=0, day=None):
    """A run in agent.py's vocabulary, through the real writer and ask's own code path."""
    run = rl.open_run(runs, key=b"")
    if day:
        run.ledger.clock = clock_for(day)
    run.decide("plan", "ask the model for a patch", "the test names the bug")
    ask.ask("fix it", ledger=run, base_url=server.base_url, model="fake-model", api_key=KEY)
    run.append("model_proposed", {"step": 1, "tool": "run_tests", "args": {}})
    run.append("tool_allowed", {"step": 1, "tool": "run_tests", "args": {}, "rule": "builtin.enabled"})
    for _ in range(denied):
        run.append("model_proposed", {"step": 2, "tool": "read_file", "args": {"path": "../../etc/passwd"}})
        run.append("tool_denied", {"step": 2, "tool": "read_file", "args": {"path": "../../etc/passwd"},
                                   "rule": "path.escape", "reason": "outside the repository"})
    run.append("error", {"error": "tool crashed"})
    run.append("judge_verdict", {"verdict": "reject", "applies": True, "tests_passed": False,
                                 "reason": "tests still fail"})
    run.close(outcome)
    return run


def wait_for_mutations(ch, db):
    for _ in range(200):
        if ch.query(f"SELECT count() FROM system.mutations WHERE database = '{db}' AND is_done = 0").strip() == "0":
            return
        time.sleep(0.05)
    raise AssertionError("mutation did not finish")


# ----------------------------------------------------------------------------
# Shipping
# ----------------------------------------------------------------------------

def test_ship_then_ship_again_leaves_one_row_per_line(clickhouse, db, tmp_path, server):
    ledger = tmp_path / "calls.jsonl"
    calls(ledger, server, DAY1, ["ok", "no_usage", "server_error"], expect=r"\b4\b")
    lid = ledger_id(ledger)
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0, proc.err
    head = run_script("reasoning_ledger.py", "head", ledger).out.strip()
    assert f"shipped {ledger}  {lid[:12]}  3 new lines (seq 1..3)  head {head}" in proc.out
    assert proc.err == ""

    stored = rows(clickhouse, f"SELECT * FROM {db}.ledger_lines FINAL ORDER BY seq")
    lines = ledger.read_bytes().splitlines()
    assert [r["raw"].encode("utf-8") for r in stored] == lines  # the exact bytes
    for row, raw in zip(stored, lines):
        event = json.loads(raw)
        assert row["ledger_id"] == lid and row["path"] == str(ledger.resolve())
        assert row["line_sha256"] == hashlib.sha256(raw).hexdigest()
        assert (row["seq"], row["run_id"], row["kind"], row["at"], row["prev"]) == (
            event["seq"], event["run_id"], event["kind"], event["at"], event["prev"])
        assert row["at_time"] == event["at"][:10] + " " + event["at"][11:19]
        payload = event["payload"]
        for name in ("request_model", "response_model", "base_url", "error_type", "usage_status", "latency_ms",
                     "input_tokens", "output_tokens", "total_tokens", "est_input_tokens", "est_output_tokens",
                     "system_fingerprint", "attempt"):
            assert row[name] == payload[name], name
        assert row["check"] == (None if payload["check"] is None else int(payload["check"]))
        assert row["malformed"] == 0
    assert stored[0]["input_tokens"] == 21 and stored[1]["input_tokens"] is None
    assert stored[2]["error_type"] == "server_error"

    again = ship(clickhouse, db, ledger)
    assert again.returncode == 0, again.err
    assert f"up to date {ledger}  {lid[:12]}  head {head}" in again.out
    assert counts(clickhouse, db) == (3, 3)


def test_a_resume_sends_only_the_new_lines(clickhouse, db, tmp_path):
    ledger = tmp_path / "notes.jsonl"
    notes(ledger, 5)
    assert ship(clickhouse, db, ledger).returncode == 0
    notes(ledger, 4, start=5)
    proc = ship(clickhouse, db, ledger, "--batch-rows", "3")
    assert proc.returncode == 0, proc.err
    assert "4 new lines (seq 6..9)" in proc.out
    assert counts(clickhouse, db) == (9, 9)
    assert [r["seq"] for r in rows(clickhouse, f"SELECT seq FROM {db}.ledger_lines FINAL ORDER BY seq")] == list(
        range(1, 10))


def test_a_ship_killed_mid_batch_is_completed_by_the_next_run(clickhouse, db, tmp_path):
    ledger = tmp_path / "big.jsonl"
    total = 40000
    notes(ledger, total)
    cmd = [sys.executable, str(ROOT / "fleet.py"), "ship", str(ledger), "--to", clickhouse.url,
           "--database", db, "--batch-rows", "50"]
    proc = subprocess.Popen(cmd, env=ch_env(clickhouse), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stored, began = 0, time.monotonic()
        while stored < 2000 and proc.poll() is None and time.monotonic() - began < 60:
            time.sleep(0.02)
            try:
                stored = int(clickhouse.query(f"SELECT count() FROM {db}.ledger_lines"))
            except Exception:  # noqa: BLE001 -- the table is not there yet
                stored = 0
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "ship finished before it could be killed: make the ledger bigger"
    partial = counts(clickhouse, db)[1]
    assert 0 < partial < total
    again = ship(clickhouse, db, ledger, "--batch-rows", "5000")
    assert again.returncode == 0, again.err
    # an INSERT whose body had all arrived may commit after the count above: the resume point is at or past it
    found = re.search(r"([\d,]+) new lines \(seq (\d+)\.\.(\d+)\)", again.out)
    assert found, again.out
    fresh, first, last = int(found.group(1).replace(",", "")), int(found.group(2)), int(found.group(3))
    assert partial < first <= total and last == total and fresh == total - first + 1
    assert counts(clickhouse, db)[1] == total
    assert int(clickhouse.query(f"SELECT uniqExact(seq) FROM {db}.ledger_lines")) == total
    check = verify_from(clickhouse, db)
    assert check.returncode == 0 and f"  {total} lines  head " in check.out, check.out + check.err


def test_a_local_rewrite_is_a_fork_and_nothing_is_sent(clickhouse, db, tmp_path):
    ledger = tmp_path / "notes.jsonl"
    notes(ledger, 4)
    assert ship(clickhouse, db, ledger).returncode == 0
    original = ledger.read_bytes()
    # A valid chain that differs from what was shipped: keep lines 1-2, write new 3-6 with the real writer.
    ledger.write_bytes(b"".join(original.splitlines(keepends=True)[:2]))
    with rl.Ledger(ledger, "forger", key=b"", fsync=False) as book:
        for i in range(4):
            book.append("note", {"forged": i})
    assert run_script("reasoning_ledger.py", "verify", ledger).returncode == 0  # locally it holds
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 1
    assert f"FAIL  {ledger}: line 4: differs from the line ClickHouse holds at this seq: a fork" in proc.out
    assert len(error_lines(proc.err)) == 1
    assert counts(clickhouse, db) == (4, 4)
    # The file cut short after it was shipped is refused too.
    ledger.write_bytes(b"".join(original.splitlines(keepends=True)[:3]))
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 1 and "ClickHouse holds this ledger up to seq 4 but the file ends at seq 3" in proc.out
    assert counts(clickhouse, db) == (4, 4)


def test_a_broken_ledger_sends_nothing_and_says_what_verify_says(clickhouse, db, tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    notes(good, 3)
    notes(bad, 5)
    lines = bad.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"i":2', b'"i":7')
    bad.write_bytes(b"".join(lines))
    verify_line = run_script("reasoning_ledger.py", "verify", bad).out.splitlines()[0]
    proc = ship(clickhouse, db, bad, good)
    assert proc.returncode == 1
    assert verify_line in proc.out.splitlines()  # FAIL  bad.jsonl: line 4: prev does not match line 3 ...
    assert "shipped" in proc.out and str(good) in proc.out  # the other ledger still goes
    stored = rows(clickhouse, f"SELECT DISTINCT ledger_id FROM {db}.ledger_lines")
    assert stored == [{"ledger_id": ledger_id(good)}]


def test_a_torn_tail_is_not_shipped_but_the_lines_before_it_are(clickhouse, db, tmp_path):
    ledger = tmp_path / "notes.jsonl"
    notes(ledger, 3)
    with open(ledger, "ab") as handle:
        handle.write(b'{"seq":4,"run_id":"no')
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0, proc.err
    assert "3 new lines (seq 1..3)" in proc.out
    assert "warning: " in proc.err and "torn tail" in proc.err and "a crash, not tampering" in proc.err
    assert counts(clickhouse, db) == (3, 3)
    notes(ledger, 1, start=3)  # the next append moves the torn bytes aside and records it
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0 and "2 new lines (seq 4..5)" in proc.out and proc.err == ""
    kinds = [r["kind"] for r in rows(clickhouse, f"SELECT kind FROM {db}.ledger_lines FINAL ORDER BY seq")]
    assert kinds == ["note"] * 3 + ["ledger_recovered", "note"]


def test_ship_all_ships_the_index_and_checks_runs_against_it(clickhouse, db, tmp_path, server):
    runs = tmp_path / "runs"
    first = agent_run(runs, server, "proposal_written")
    second = agent_run(runs, server, "error")
    proc = ship(clickhouse, db, "--all", runs)
    assert proc.returncode == 0, proc.err
    assert [l.split()[0] for l in proc.out.splitlines()].count("shipped") == 3 and "3/3 ledgers shipped" in proc.out
    # A closed run cut after it closed is refused, as `verify --all` refuses it.
    events = second.dir / "events.jsonl"
    events.write_bytes(b"".join(events.read_bytes().splitlines(keepends=True)[:-1]))
    proc = ship(clickhouse, db, "--all", runs)
    assert proc.returncode == 1
    assert f"FAIL  {events}: line" in proc.out and "index.jsonl records seq" in proc.out
    assert first.run_id in proc.out


def test_a_keyed_ledger_ships_and_verifies_with_its_key(clickhouse, db, tmp_path):
    ledger = tmp_path / "keyed.jsonl"
    secret = "ledger-hmac-key-000111"
    with rl.Ledger(ledger, "k", key=secret.encode(), fsync=False) as book:
        for i in range(3):
            book.append("note", {"i": i})
    assert ship(clickhouse, db, ledger).returncode == 2  # no key: cannot verify, so nothing is sent
    proc = ship(clickhouse, db, ledger, env=ch_env(clickhouse, LEDGER_KEY=secret))
    assert proc.returncode == 0, proc.err
    raw = ledger.read_bytes().splitlines()
    stored = rows(clickhouse, f"SELECT line_sha256 FROM {db}.ledger_lines FINAL ORDER BY seq")
    assert [r["line_sha256"] for r in stored] == [hashlib.sha256(line).hexdigest() for line in raw]
    assert verify_from(clickhouse, db).returncode == 2
    good = verify_from(clickhouse, db, env=ch_env(clickhouse, LEDGER_KEY=secret))
    head = run_script("reasoning_ledger.py", "head", ledger, env=clean_env(LEDGER_KEY=secret)).out.strip()
    assert good.returncode == 0 and f"3 lines  head {head}" in good.out
    assert secret.encode() not in all_bytes_under(clickhouse.dir / "data")


# ----------------------------------------------------------------------------
# Secrets, redirects, URLs
# ----------------------------------------------------------------------------

def test_the_password_is_never_in_argv_stderr_rows_or_the_server_files(clickhouse, db, tmp_path, server):
    ledger = tmp_path / "calls.jsonl"
    calls(ledger, server, DAY1, ["ok"])
    password = clickhouse.SHIPPER_PASSWORD.encode()
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0, proc.err
    assert not any(clickhouse.SHIPPER_PASSWORD in arg for arg in proc.args)
    assert password not in proc.stdout + proc.stderr
    dump = clickhouse.query_bytes(f"SELECT * FROM {db}.ledger_lines FORMAT TSV")
    assert password not in dump and KEY.encode() not in dump
    assert b"shipper" not in dump  # not even the user name
    clickhouse.query("SYSTEM FLUSH LOGS")
    for where in ("data", "log", "tmp"):
        for path in (clickhouse.dir / where).rglob("*"):
            if path.is_file() and "preprocessed_configs" not in path.parts:  # the server's own users.xml
                assert password not in path.read_bytes(), path
    # A wrong password: a clear one-line error that does not echo it, exit 2 (fix the settings).
    wrong = "wrong-password-12345"
    proc = ship(clickhouse, db, ledger, env=clean_env(CLICKHOUSE_USER="shipper", CLICKHOUSE_PASSWORD=wrong))
    assert proc.returncode == 2 and wrong not in proc.out + proc.err
    (line,) = error_lines(proc.err)
    assert "HTTP 401" in line and "CLICKHOUSE_PASSWORD" in line
    # Credentials in the URL are refused before anything is sent, without echoing them.
    proc = run_script("fleet.py", "ship", ledger, "--to",
                      f"http://shipper:{clickhouse.SHIPPER_PASSWORD}@127.0.0.1:{clickhouse.http_port}",
                      "--database", db, env=clean_env())
    assert proc.returncode == 2 and clickhouse.SHIPPER_PASSWORD not in proc.out + proc.err
    assert "CLICKHOUSE_USER" in proc.err
    proc = run_script("fleet.py", "ship", ledger, env=clean_env(
        LEDGER_SHIP_URL=f"{clickhouse.url}/?password={wrong}"))
    assert proc.returncode == 2 and wrong not in proc.err


class _Recorder(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})
        if self.server.redirect_to:
            self.send_response(307)
            self.send_header("Location", self.server.redirect_to)
        else:
            self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _recorder(redirect_to=None):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.seen, srv.redirect_to = [], redirect_to
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_a_redirect_is_never_followed(tmp_path):
    ledger = tmp_path / "notes.jsonl"
    notes(ledger, 1)
    password = "redirect-secret-0123"
    target = _recorder()
    redirector = _recorder(f"http://127.0.0.1:{target.server_address[1]}/")
    try:
        proc = run_script("fleet.py", "ship", ledger, "--to",
                          f"http://127.0.0.1:{redirector.server_address[1]}",
                          env=clean_env(CLICKHOUSE_USER="shipper", CLICKHOUSE_PASSWORD=password))
    finally:
        target.shutdown()
        redirector.shutdown()
    assert proc.returncode == 2
    (line,) = error_lines(proc.err)
    assert "HTTP 307" in line and "not followed" in line and password not in proc.err
    assert len(redirector.seen) == 1 and redirector.seen[0]["x-clickhouse-key"] == password
    assert redirector.seen[0]["x-clickhouse-user"] == "shipper"
    assert target.seen == []  # the password went nowhere else


# ----------------------------------------------------------------------------
# fleet.py verify
# ----------------------------------------------------------------------------

def _replace_row(ch, db, lid, seq, change, fix_sha=True):
    """Insert a second row for (ledger_id, seq) with its raw changed; FINAL then reads the new one."""
    (row,) = rows(ch, f"SELECT * FROM {db}.ledger_lines FINAL WHERE ledger_id = '{lid}' AND seq = {seq}")
    row["raw"] = change(row["raw"])
    if fix_sha:
        row["line_sha256"] = hashlib.sha256(row["raw"].encode("utf-8")).hexdigest()
    ch.query(f"INSERT INTO {db}.ledger_lines FORMAT JSONEachRow", data=json.dumps(row))


def test_verify_from_proves_the_copy_and_finds_an_altered_or_deleted_row(clickhouse, db, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    notes(a, 6)
    notes(b, 2)
    assert ship(clickhouse, db, a, b).returncode == 0
    lid, head = ledger_id(a), run_script("reasoning_ledger.py", "head", a).out.strip()
    proc = verify_from(clickhouse, db)
    assert proc.returncode == 0, proc.out + proc.err
    assert f"ok    clickhouse:{lid}  6 lines  head {head}  " in proc.out and "2/2 ledgers valid" in proc.out
    seq, digest = head.split()
    assert verify_from(clickhouse, db, "--ledger-id", lid[:10], "--expect-head", f"{seq}:{digest}").returncode == 0
    wrong = verify_from(clickhouse, db, "--ledger-id", lid, "--expect-head", f"3:{digest}")
    assert wrong.returncode == 1 and "line 3: does not match the expected head" in wrong.out

    # Altered in ClickHouse, its line_sha256 recomputed: the chain finds it at the next line.
    _replace_row(clickhouse, db, lid, 3, lambda raw: raw.replace('"i":2', '"i":9'))
    proc = verify_from(clickhouse, db)
    assert proc.returncode == 1
    assert f"FAIL  clickhouse:{lid}: line 4: prev does not match line 3" in proc.out
    assert "1/2 ledgers valid" in proc.out and len(error_lines(proc.err)) == 1
    # Altered without fixing line_sha256: found on the row itself.
    _replace_row(clickhouse, db, lid, 3, lambda raw: raw.replace('"i":9', '"i":8'), fix_sha=False)
    assert "line 3: line_sha256 is not the SHA-256 of the stored line" in verify_from(clickhouse, db).out
    # Put back, then delete a row in the middle.
    original = a.read_bytes().splitlines()[2].decode()
    _replace_row(clickhouse, db, lid, 3, lambda raw: original)
    clickhouse.query(f"OPTIMIZE TABLE {db}.ledger_lines FINAL")
    assert verify_from(clickhouse, db).returncode == 0
    clickhouse.query(f"ALTER TABLE {db}.ledger_lines DELETE WHERE ledger_id = '{lid}' AND seq = 2")
    wait_for_mutations(clickhouse, db)
    proc = verify_from(clickhouse, db, "--ledger-id", lid)
    assert proc.returncode == 1
    assert f"FAIL  clickhouse:{lid}: line 2: missing from ClickHouse: the next row stored is seq 3" in proc.out


def test_checkpoints_ship_beside_the_lines_and_catch_rows_rebuilt_or_cut_in_clickhouse(clickhouse, db, tmp_path):
    ledger = tmp_path / "a.jsonl"
    key = tmp_path / "log.key"
    vkey = run_script("reasoning_ledger.py", "keygen", "box1.example/a", "--out", key).out.strip()
    for n in (4, 3):
        notes(ledger, n, start=10 * n)
        assert run_script("reasoning_ledger.py", "checkpoint", ledger, "--key", key, "--append").returncode == 0
    notes(ledger, 2, start=90)  # lines after the newest checkpoint ship too
    assert ship(clickhouse, db, ledger).returncode == 0
    assert ship(clickhouse, db, ledger).returncode == 0  # sent again: FINAL keeps one row a note
    stored = rows(clickhouse, f"SELECT note FROM {db}.ledger_lines_checkpoints FINAL")
    assert sorted(r["note"] for r in stored) == sorted(rl.split_notes(Path(f"{ledger}.checkpoints").read_text()))
    proc = verify_from(clickhouse, db, "--vkey", vkey)
    assert proc.returncode == 0 and "9 lines" in proc.out and "2 checkpoints" in proc.out, proc.out + proc.err
    other = tmp_path / "other.key"
    other_vkey = run_script("reasoning_ledger.py", "keygen", "box1.example/a", "--out", other).out.strip()
    proc = verify_from(clickhouse, db, "--vkey", other_vkey)
    assert proc.returncode == 1 and "wrong key ID" in proc.out
    # Whoever holds ClickHouse rebuilds lines 5..9 with a fresh, valid chain: only the checkpoint tells.
    lid = ledger_id(ledger)
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_bytes(b"".join(ledger.read_bytes().splitlines(True)[:4]))
    notes(fresh, 5, start=500)
    for seq, raw in enumerate(fresh.read_bytes().splitlines()[4:], 5):
        _replace_row(clickhouse, db, lid, seq, lambda _raw, raw=raw: raw.decode())
    assert run_script("reasoning_ledger.py", "verify", fresh).returncode == 0
    proc = verify_from(clickhouse, db)
    assert proc.returncode == 1 and "its first 7 rows do not give the root" in proc.out, proc.out
    # Rows deleted at the end: the chain left is valid, the checkpoint of 7 lines is not met.
    clickhouse.query(f"ALTER TABLE {db}.ledger_lines DELETE WHERE ledger_id = '{lid}' AND seq >= 5")
    wait_for_mutations(clickhouse, db)
    proc = verify_from(clickhouse, db)
    assert proc.returncode == 1 and "its first 7 rows do not give the root" in proc.out, proc.out


def test_verify_from_without_a_url_reads_the_environment_as_the_cron_line_does(clickhouse, db, tmp_path):
    ledger = tmp_path / "a.jsonl"
    notes(ledger, 2)
    assert ship(clickhouse, db, ledger).returncode == 0
    proc = run_script("fleet.py", "verify", "--from", "--database", db,
                      env=ch_env(clickhouse, LEDGER_SHIP_URL=clickhouse.url))
    assert proc.returncode == 0 and "1/1 ledgers valid" in proc.out, proc.err


def test_rows_deleted_at_the_end_are_found_against_a_published_head(clickhouse, db, tmp_path):
    ledger = tmp_path / "a.jsonl"
    notes(ledger, 5)
    assert ship(clickhouse, db, ledger).returncode == 0
    lid, head = ledger_id(ledger), run_script("reasoning_ledger.py", "head", ledger).out.strip().replace(" ", ":")
    clickhouse.query(f"ALTER TABLE {db}.ledger_lines DELETE WHERE seq >= 4")
    wait_for_mutations(clickhouse, db)
    assert verify_from(clickhouse, db).returncode == 0  # a shorter chain still holds...
    proc = verify_from(clickhouse, db, "--ledger-id", lid, "--expect-head", head)
    assert proc.returncode == 1  # ...but not against the head published before
    assert "line 4: truncated: the expected head is seq 5 but ClickHouse holds up to seq 3" in proc.out
    assert verify_from(clickhouse, db, "--ledger-id", "abcdef").returncode == 1  # never shipped
    # The next ship puts the missing rows back (ReplacingMergeTree: one row per line).
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0 and "2 new lines (seq 4..5)" in proc.out
    assert verify_from(clickhouse, db, "--ledger-id", lid, "--expect-head", head).returncode == 0


def test_a_gap_in_the_middle_is_sent_again_by_the_next_ship(clickhouse, db, tmp_path):
    ledger = tmp_path / "a.jsonl"
    notes(ledger, 5)
    assert ship(clickhouse, db, ledger).returncode == 0
    clickhouse.query(f"ALTER TABLE {db}.ledger_lines DELETE WHERE seq = 2")
    wait_for_mutations(clickhouse, db)
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0 and "5 lines re-sent (seq 1..5)" in proc.out
    assert counts(clickhouse, db)[1] == 5 and verify_from(clickhouse, db).returncode == 0


# ----------------------------------------------------------------------------
# The server down
# ----------------------------------------------------------------------------

def test_the_server_down_is_one_clear_error_and_the_next_run_catches_up(clickhouse, db, tmp_path):
    ledger = tmp_path / "a.jsonl"
    notes(ledger, 3)
    assert ship(clickhouse, db, ledger).returncode == 0
    notes(ledger, 4, start=3)
    clickhouse.kill()
    try:
        began = time.monotonic()
        proc = ship(clickhouse, db, ledger)
        took = time.monotonic() - began
        assert proc.returncode == 1
        (line,) = error_lines(proc.err)
        assert f"ClickHouse at 127.0.0.1:{clickhouse.http_port}" in line and "refused" in line.lower()
        assert "4 attempts" in line and "the next run resumes" in line
        assert took < 30
        assert clickhouse.SHIPPER_PASSWORD not in proc.err
        assert run_script("fleet.py", "verify", "--from", clickhouse.url, "--database", db,
                          env=ch_env(clickhouse)).returncode == 2  # cannot read: exit 2, as for a file
        assert audit_from(clickhouse, db).returncode == 2
    finally:
        clickhouse.restart()
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0, proc.err
    assert "4 new lines (seq 4..7)" in proc.out
    assert counts(clickhouse, db)[1] == 7


def test_a_deadline_bounds_the_whole_run(clickhouse, db, tmp_path):
    ledger = tmp_path / "a.jsonl"
    notes(ledger, 2)
    clickhouse.kill()
    try:
        began = time.monotonic()
        proc = ship(clickhouse, db, ledger, "--deadline", "1")
        assert proc.returncode == 1 and time.monotonic() - began < 10
        assert "the next run resumes" in proc.err
    finally:
        clickhouse.restart()


# ----------------------------------------------------------------------------
# audit.py --from: the same tables as the local audit
# ----------------------------------------------------------------------------

MISTYPED = [
    {"request_model": "m", "latency_ms": "fast"},
    {"request_model": "m", "input_tokens": "12", "usage_reported": True, "usage_status": "complete"},
    {"request_model": "m", "attempt": "2"},
    {"request_model": "m", "check": "yes"},
    {"request_model": "m", "error_type": 42},
    {"request_model": "m", "usage_status": ["complete"], "usage_reported": "true"},
    {"request_model": 5, "base_url": {"a": 1}},
    {"request_model": "m", "response_model": ["x"], "system_fingerprint": 3},
    {"request_model": "m", "est_input_tokens": 1.5, "est_output_tokens": "9"},
    {"request_model": "m", "latency_ms": True},
    {"request_model": "m", "input_tokens": -7, "output_tokens": 3, "usage_reported": True, "attempt": 3,
     "latency_ms": 7.5, "check": False},
    {},
]


@pytest.fixture
def fleet_files(tmp_path, server):
    """Ledgers of several days, two models, errors, calls without usage, checks, model listings, retries,
    a ledger another tool wrote with fields of the wrong types, and agent runs."""
    ledger = tmp_path / "calls.jsonl"
    calls(ledger, server, DAY1, ["ok", "ok", "no_usage", "server_error"], expect=r"\b4\b")
    calls(ledger, server, DAY1, ["ok", "zero_usage"], model="fake-model-large")
    calls(ledger, server, DAY2, ["model_swap", "model_swap", "http_404", "partial_usage", "no_usage"], expect=r"\b5\b")
    calls(ledger, server, DAY2, ["ok", "server_error", "server_error"], model="fake-model-large")
    calls(ledger, server, DAY3, [{"name": "sleepy", "sleep": 0.12}] * 3)
    server.queue("server_error", "ok")
    with rl.Ledger(ledger, "retry", key=b"", clock=clock_for(DAY3)) as book:
        ask.ask("q", ledger=book, base_url=server.base_url, model="fake-model", api_key=KEY, retries=1, backoff=0.01)
    for day, models in ((DAY1, ["a", "b"]), (DAY2, ["b", "c"]), (DAY3, ["c"])):
        server.queue({"name": "ok", "models": models})
        with rl.Ledger(ledger, "m", key=b"", clock=clock_for(day)) as book:
            ask.list_models(ledger=book, base_url=server.base_url, api_key=KEY)
    other = tmp_path / "other.jsonl"
    with rl.Ledger(other, "other-tool", key=b"", clock=clock_for(DAY2)) as book:
        for payload in MISTYPED:
            book.append("model_call", payload)
        book.decide("plan", "not a call", "ignored by the audit")
    runs = tmp_path / "runs"
    agent_run(runs, server, "proposal_written", denied=2, day=DAY2)
    agent_run(runs, server, "budget_exhausted")
    return ledger, other, runs


def _comparable(data):
    data = dict(data)
    del data["ledgers"], data["verified"]
    return data


def test_audit_from_equals_the_local_audit(clickhouse, db, fleet_files, tmp_path):
    ledger, other, runs = fleet_files
    proc = ship(clickhouse, db, ledger, other, "--all", runs)
    assert proc.returncode == 0, proc.err
    for flags in ([], ["--by", "day"], ["--by", "day", "--since", DAY2], ["--until", DAY2, "--model", "fake-model"],
                  ["--by", "day", "--latency-floor", "10", "--latency-shift", "0.3"]):
        local = run_script("audit.py", ledger, other, runs, "--json", *flags)
        remote = audit_from(clickhouse, db, "--json", *flags)
        assert local.returncode == remote.returncode == 0, (flags, local.err, remote.err)
        mine, theirs = json.loads(local.out), json.loads(remote.out)
        assert _comparable(theirs) == _comparable(mine), flags
        assert remote.out.split('"summary"')[1] == local.out.split('"summary"')[1], flags  # to the byte
        assert theirs["verified"] is True
    data = json.loads(audit_from(clickhouse, db, "--json", "--by", "day").out)
    assert len(data["ledgers"]) == 5 and all(ledger["status"] == "ok" for ledger in data["ledgers"])  # + index
    # The data is what it claims to be (so the equality above is not of two empty tables).
    assert data["summary"]["model_calls"] == 33 and data["summary"]["malformed"] == 10
    assert {c["what"] for c in data["changes"]} >= {"response_model", "models_list", "error_rate", "checks",
                                                    "latency_p50", "usage"}
    assert len(data["agent_runs"]) == 2 and {r["outcome"] for r in data["agent_runs"]} == {
        "proposal_written", "budget_exhausted"}
    assert any(r["no_usage"] for r in data["models"]) and any(r["retries"] for r in data["models"])
    # CSV and the text tables are the same too (the text's first line counts the ledgers read).
    for flags in (["--csv"], ["--csv", "--by", "day"], [], ["--by", "day"]):
        local = run_script("audit.py", ledger, other, runs, *flags).out.splitlines()
        remote = audit_from(clickhouse, db, *flags).out.splitlines()
        skip = 0 if "--csv" in flags else 1
        assert remote[skip:] == local[skip:], flags
    page = tmp_path / "fleet.html"
    proc = audit_from(clickhouse, db, "--html", page, "--by", "day")
    assert proc.returncode == 0 and page.read_text().count('class="latency-histogram') >= 3


def test_audit_from_verifies_first_unless_told_not_to(clickhouse, db, tmp_path, server):
    ledger = tmp_path / "calls.jsonl"
    calls(ledger, server, DAY1, ["ok", "ok", "ok"])
    assert ship(clickhouse, db, ledger).returncode == 0
    lid = ledger_id(ledger)
    _replace_row(clickhouse, db, lid, 2, lambda raw: raw.replace('"input_tokens":21', '"input_tokens":2100'))
    proc = audit_from(clickhouse, db)
    assert proc.returncode == 1 and "Models" not in proc.out
    assert f"FAIL  clickhouse:{lid}: line 3: prev does not match line 2" in proc.out
    loose = audit_from(clickhouse, db, "--no-verify", "--json")
    assert loose.returncode == 0
    data = json.loads(loose.out)
    assert data["verified"] is False and data["ledgers"][0]["status"] == "unverified"


def test_audit_from_with_nothing_shipped(clickhouse, db):
    proc = audit_from(clickhouse, db)
    assert proc.returncode == 2 and "no table" in proc.err and len(error_lines(proc.err)) == 1
    assert audit_from(clickhouse, db, "some.jsonl").returncode == 2  # --from takes no PATH


def test_a_model_name_cannot_inject_sql(clickhouse, db, tmp_path):
    ledger = tmp_path / "calls.jsonl"
    evil = "x' OR 1=1 -- \\'"
    with rl.Ledger(ledger, "t", key=b"", clock=clock_for(DAY1)) as book:
        for model in (evil, "plain"):
            book.append("model_call", {"request_model": model, "base_url": "http://h/v1", "error_type": None,
                                       "latency_ms": 3.0})
    assert ship(clickhouse, db, ledger).returncode == 0
    data = json.loads(audit_from(clickhouse, db, "--json", "--model", evil).out)
    assert [r["request_model"] for r in data["models"]] == [evil]


# ----------------------------------------------------------------------------
# Every field of every JSON type: the SQL side counts what the local audit counts
# ----------------------------------------------------------------------------

# An integer beyond Int64 is malformed on both sides (fleet.call_fields, the one rule).
JSON_VALUES = ("text", 3, -3, 0, 2 ** 62, 2 ** 70, 2.5, float(2 ** 70), True, False, None, [1], {"a": 1})


def test_every_field_of_every_json_type_audits_the_same_from_clickhouse(clickhouse, db, tmp_path):
    """A model_call written by another tool may hold any JSON value in any field; shipped, its typed
    columns and `malformed` must give the tables the local audit gives (an integer latency may come back
    as the same float). (ask.py's fields are
    only the names tried here: nothing below depends on the types it declares.)"""
    ledger = tmp_path / "any.jsonl"
    with rl.Ledger(ledger, "any-tool", key=b"", clock=clock_for(DAY1)) as book:
        for field in ask.MODEL_CALL_FIELDS:
            for value in JSON_VALUES:
                book.append("model_call", {"request_model": "m", "base_url": "http://h/v1", field: value})
    assert ship(clickhouse, db, ledger).returncode == 0
    local = run_script("audit.py", ledger, "--json")
    remote = audit_from(clickhouse, db, "--json")
    assert local.returncode == remote.returncode == 0, (local.err, remote.err)
    assert _comparable(json.loads(remote.out)) == _comparable(json.loads(local.out))
    summary = json.loads(local.out)["summary"]
    assert summary["model_calls"] == len(ask.MODEL_CALL_FIELDS) * len(JSON_VALUES) and 0 < summary["malformed"]
    # and SQL over the typed columns counts what the audit counts
    (row,) = rows(clickhouse, f"SELECT sum(malformed) AS malformed, count() AS calls FROM {db}.ledger_lines FINAL")
    assert row == {"malformed": summary["malformed"], "calls": summary["model_calls"]}


# The table as format 1.x's ship made it, column for column: a table made by an earlier version, not by today's
# ship_ddl(), so a change to the columns (or to how they are filled) cannot pass unseen.
TABLE_1X = ", ".join(["ledger_id String", "host String", "path String", "seq UInt64", "run_id String", "kind String",
                      "at String", "at_time DateTime", "raw String", "line_sha256 String", "prev String",
                      "shipped_at DateTime", "request_model Nullable(String)", "response_model Nullable(String)",
                      "base_url Nullable(String)", "attempt Nullable(Int64)", "error_type Nullable(String)",
                      "usage_status Nullable(String)", "usage_reported Nullable(UInt8)",
                      "latency_ms Nullable(Float64)", "system_fingerprint Nullable(String)", "check Nullable(UInt8)",
                      "input_tokens Nullable(Int64)", "output_tokens Nullable(Int64)", "total_tokens Nullable(Int64)",
                      "est_input_tokens Nullable(Int64)", "est_output_tokens Nullable(Int64)", "malformed UInt8"])


def test_a_table_an_earlier_version_made_is_shipped_to_and_read(clickhouse, db, tmp_path, server):
    clickhouse.query(f"CREATE DATABASE {db}")
    clickhouse.query(f"CREATE TABLE {db}.ledger_lines ({TABLE_1X}) ENGINE = ReplacingMergeTree "
                     f"ORDER BY (ledger_id, seq)")
    ledger = tmp_path / "calls.jsonl"
    calls(ledger, server, DAY1, ["ok", "no_usage"])
    proc = ship(clickhouse, db, ledger)
    assert proc.returncode == 0 and "2 new lines (seq 1..2)" in proc.out, proc.out + proc.err
    (row,) = rows(clickhouse, f"SELECT request_model, input_tokens, malformed FROM {db}.ledger_lines FINAL "
                              f"WHERE seq = 1")
    assert row == {"request_model": "fake-model", "input_tokens": 21, "malformed": 0}
    assert verify_from(clickhouse, db).returncode == 0
    local, remote = run_script("audit.py", ledger, "--json"), audit_from(clickhouse, db, "--json")
    assert remote.returncode == 0 and _comparable(json.loads(remote.out)) == _comparable(json.loads(local.out))


def test_a_full_spool_ships_what_it_holds_and_the_next_run_the_rest(clickhouse, db, tmp_path, monkeypatch):
    ledger = tmp_path / "a.jsonl"
    notes(ledger, 7)
    monkeypatch.setattr(fleet, "_spool_limit", lambda: 1)  # full after the first batch
    client = fleet.ClickHouse(clickhouse.url, database=db, environ=ch_env(clickhouse))
    ((path, first),) = fleet.ship([(ledger, None)], client, host="box", batch_rows=3)
    assert (first.first, first.last, first.more) == (1, 3, 4)
    assert "3 new lines (seq 1..3), 4 more next run" in first.text()
    ((path, second),) = fleet.ship([(ledger, None)], client, host="box", batch_rows=3)
    assert (second.first, second.last, second.more) == (4, 6, 1)
    ((path, third),) = fleet.ship([(ledger, None)], client, host="box", batch_rows=3)
    assert (third.sent, third.more, third.head[0]) == (1, 0, 7)
    assert counts(clickhouse, db) == (7, 7)
    assert {r["host"] for r in rows(clickhouse, f"SELECT host FROM {db}.ledger_lines")} == {"box"}


def test_the_docs_table_and_its_sql_questions_work_on_a_shipped_fleet(clickhouse, db, fleet_files):
    readme = (ROOT / "docs" / "fleet.md").read_text(encoding="utf-8")
    assert fleet.ship_ddl() in readme  # the table docs/fleet.md shows is the one ship makes
    section = readme[readme.index("**Three questions in SQL**"):]
    block = section[section.index("```sql\n") + 7:section.index("\n```", section.index("```sql\n"))]
    queries = [q.strip() for q in block.split(";") if q.strip()]
    assert len(queries) == 3
    ledger, other, runs = fleet_files
    assert ship(clickhouse, db, ledger, other, "--all", runs).returncode == 0
    answers = [rows(clickhouse, query.replace("reasoning_ledger.ledger_lines", f"{db}.ledger_lines"))
               for query in queries]
    served = {(r["request_model"], r["response_model"]) for r in answers[0]}
    assert ("fake-model", "fake-model") in served and any(m != r for r, m in served if m)  # the swap shows
    assert answers[1] and any(0 < r["no_usage_share"] < 1 for r in answers[1])
    assert answers[2] == []  # everything was shipped just now


def test_agent_run_ship_to_ships_the_closed_run_and_the_index(clickhouse, tmp_path, server):
    """Shipping follows the close whatever the outcome: a repository whose tests pass is a run of a few
    events with no model call and no judge, and it ships as any run does."""
    repo = make_repo(tmp_path / "repo", calc=SAMPLE_CALC.replace("a - b", "a + b"))
    tools = tools_json(tmp_path / "tools.json")
    runs = tmp_path / "runs"
    env = ch_env(clickhouse, BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    clickhouse.query("DROP DATABASE IF EXISTS reasoning_ledger")  # --ship-to uses the default database

    def run(url):
        return run_script("agent.py", "run", "--repo", repo, "--runs-dir", runs, "--tools", tools, "--ship-to", url,
                          env=env, timeout=300)

    # a URL of the wrong form: exit 2 before anything is opened or asked
    bad = run("http://user:pw@127.0.0.1:1")
    assert bad.returncode == 2 and "user name or password" in error_lines(bad.err)[0] and not runs.exists()
    assert "pw@" not in bad.err
    # shipped: the run's ledger and the index, each proven by fleet.py verify
    proc = run(clickhouse.url)
    assert proc.returncode == 0 and proc.out.split()[1] == "no_action" and proc.err == "", proc.err
    events = runs / proc.out.split()[0] / "events.jsonl"
    mine = {ledger_id(events), ledger_id(runs / "index.jsonl")}
    tops = {r["ledger_id"]: r["top"] for r in rows(clickhouse, "SELECT ledger_id, max(seq) AS top FROM "
                                                               "reasoning_ledger.ledger_lines FINAL GROUP BY ledger_id")}
    assert set(tops) == mine and tops[ledger_id(events)] == len(lines_of(events))
    check = run_script("fleet.py", "verify", "--from", clickhouse.url,
                       *[arg for i in sorted(mine) for arg in ("--ledger-id", i)], env=ch_env(clickhouse))
    assert check.returncode == 0 and check.out.count("ok    ") == 2, check.out + check.err
    clickhouse.query("DROP DATABASE IF EXISTS reasoning_ledger")
    # ClickHouse down: the run's outcome and exit stand; one warning a ledger says how it is shipped later
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    down = run(dead)
    assert down.returncode == 0 and down.out.split()[1] == "no_action", down.err
    warnings = down.err.splitlines()
    assert warnings and all(w.startswith("warning: run ") and "not shipped to ClickHouse" in w and
                            f"ship --all {runs}" in w for w in warnings), down.err
    assert run_script("reasoning_ledger.py", "verify", "--all", runs).returncode == 0
    assert server.requests == []  # no run asked the model anything
