"""`fleet.py witness` and `fleet.py witness-push` (C2SP tlog-witness): the witness a subprocess on 127.0.0.1
(port 0) with two logs, keys and checkpoints made by `reasoning_ledger.py` as a user makes them, and hostile
clients on raw sockets. Nothing asserts a speed: a slow client is told apart by the answer it gets."""

import http.client
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import reasoning_ledger as rl
from conftest import ROOT, clean_env, run_script

LOG1, LOG2, WITNESS = "example.com/log1", "example.com/log2", "witness.example/w1"


def keygen(tmp_path, name, *extra):
    out = tmp_path / (name.replace("/", "_") + ("-w" if extra else "") + ".key")
    proc = run_script("reasoning_ledger.py", "keygen", name, "--out", out, *extra)
    assert proc.returncode == 0, proc.err
    return out, proc.out.strip()


def grow(path, n):
    """n more lines in the ledger at `path`."""
    with rl.Ledger(path, "r1") as book:
        for i in range(n):
            book.append("note", {"i": i})


def checkpoint(path, key):
    proc = run_script("reasoning_ledger.py", "checkpoint", path, "--key", key, "--append")
    assert proc.returncode == 0, proc.err
    return proc.out


class Witness:
    """`python fleet.py witness --listen 127.0.0.1:0 ...`; the port from its first stdout line."""

    def __init__(self, tmp_path, *args):
        self.args, self.tmp_path = args, tmp_path
        self.start()

    def start(self):
        t = self.tmp_path
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "fleet.py"), "witness", "--listen", "127.0.0.1:0", "--key", t / "w.key",
             "--logs", t / "logs.txt", "--ledger", t / "witness.jsonl", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
        line = self.proc.stdout.readline().decode()
        if not line:
            self.proc.wait(30)
            raise RuntimeError("the witness did not start: " + self.proc.stderr.read().decode())
        self.port = int(line.rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        out, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err.decode()

    def post(self, body, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/add-checkpoint", body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type"), response.read().decode()

    def events(self, kind):
        return [e["payload"] for e in rl.read_events(self.tmp_path / "witness.jsonl") if e["kind"] == kind]


@pytest.fixture
def world(tmp_path):
    """Two logs a witness knows: {origin: (signer key file, vkey)}, the witness's vkey, the witness."""
    logs = {name: keygen(tmp_path, name) for name in (LOG1, LOG2)}
    wkey, wvkey = keygen(tmp_path, WITNESS, "--cosigner")
    os.replace(wkey, tmp_path / "w.key")
    (tmp_path / "logs.txt").write_text("".join(f"{name} {vkey}\n" for name, (_k, vkey) in logs.items()))
    witness = Witness(tmp_path)
    yield logs, wvkey, witness
    witness.stop()


def push(ledger, witness, wvkey):
    return run_script("fleet.py", "witness-push", ledger, witness.url, "--witness", wvkey)


def verify(ledger, vkey, *extra):
    return run_script("reasoning_ledger.py", "verify", ledger, "--checkpoint", f"{ledger}.checkpoints",
                      "--vkey", vkey, *extra)


def body(old, note, proof=()):
    return "".join(f"{line}\n" for line in [f"old {old}", *proof, ""]).encode() + note.encode()


# ----------------------------------------------------------------------------
# keygen -> checkpoint -> witness-push -> verify --witness
# ----------------------------------------------------------------------------

def test_two_logs_are_cosigned_as_they_grow_and_verify_with_the_witness(world, tmp_path):
    logs, wvkey, witness = world
    for origin, (key, vkey) in logs.items():
        ledger = tmp_path / (origin.replace("/", "_") + ".jsonl")
        assert verify(ledger, vkey).returncode == 2  # no ledger, no sidecar yet
        for n in (3, 5, 1):
            grow(ledger, n)
            checkpoint(ledger, key)
            assert verify(ledger, vkey, "--witness", wvkey).returncode == 1  # not cosigned yet
            proc = push(ledger, witness, wvkey)
            assert proc.returncode == 0, proc.err
            ok = verify(ledger, vkey, "--witness", wvkey)
            assert ok.returncode == 0, ok.err
        # a stranger's proof carries the cosignature too
        proof = tmp_path / "2.tlog-proof"
        proof.write_text(run_script("reasoning_ledger.py", "prove", ledger, "2", "--checkpoint",
                                    f"{ledger}.checkpoints").out)
        line = ledger.read_bytes().splitlines(True)[1]
        ok = run_script("reasoning_ledger.py", "verify-proof", proof, "--vkey", vkey, "--witness", wvkey, input=line)
        assert ok.returncode == 0 and WITNESS in ok.out, ok.err
        # the cron line again with nothing new: no request, the sidecar unchanged
        sidecar = Path(f"{ledger}.checkpoints").read_bytes()
        again = push(ledger, witness, wvkey)
        assert again.returncode == 0 and again.out.startswith("cosigned already")
        assert Path(f"{ledger}.checkpoints").read_bytes() == sidecar
    cosigned = witness.events("witness_cosigned")
    assert [(e["origin"], e["size"]) for e in cosigned] == [
        (LOG1, 3), (LOG1, 8), (LOG1, 9), (LOG2, 3), (LOG2, 8), (LOG2, 9)]
    # the witness's key (and the logs' keys) never reach another file, nor its stderr
    secrets = [p.read_text().strip() for p in tmp_path.glob("*.key")] + [(tmp_path / "w.key").read_text().strip()]
    code, err = witness.stop()
    assert code == 0 and not err
    for path in tmp_path.iterdir():
        if path.is_file() and path.suffix != ".key":
            assert not any(secret.encode() in path.read_bytes() for secret in secrets), path


def test_a_push_without_a_cosigned_size_in_the_sidecar_learns_it_from_the_409(world, tmp_path):
    logs, wvkey, witness = world
    key, vkey = logs[LOG1]
    ledger = tmp_path / "l.jsonl"
    grow(ledger, 4)
    checkpoint(ledger, key)
    assert push(ledger, witness, wvkey).returncode == 0
    # the sidecar lost its cosignature (a restore from backup): push offers 0, the 409 says 4
    sidecar = Path(f"{ledger}.checkpoints")
    sidecar.write_text(sidecar.read_text().rsplit("\n", 2)[0] + "\n")
    grow(ledger, 2)
    checkpoint(ledger, key)
    proc = push(ledger, witness, wvkey)
    assert proc.returncode == 0, proc.err
    assert verify(ledger, vkey, "--witness", wvkey).returncode == 0


# ----------------------------------------------------------------------------
# Forks: refused with 409 (or 422 at a larger size), recorded, remembered after a restart
# ----------------------------------------------------------------------------

def test_a_fork_is_refused_recorded_and_still_refused_after_a_restart(world, tmp_path):
    logs, wvkey, witness = world
    key, vkey = logs[LOG1]
    ledger, fork = tmp_path / "l.jsonl", tmp_path / "fork" / "l.jsonl"
    grow(ledger, 6)
    checkpoint(ledger, key)
    assert push(ledger, witness, wvkey).returncode == 0
    # the box's owner rewrites history: the first 3 lines kept, 3 others, signed with the log's own key
    fork.parent.mkdir()
    fork.write_bytes(b"".join(ledger.read_bytes().splitlines(True)[:3]))
    with rl.Ledger(fork, "r1") as book:
        for i in range(3):
            book.append("note", {"rewritten": i})
    note = checkpoint(fork, key)
    status, kind, text = witness.post(body(6, note))
    assert (status, kind, text) == (409, "text/x.tlog.size", "6\n")
    proc = push(fork, witness, wvkey)
    assert proc.returncode == 1 and "409" in proc.err
    refused = witness.events("witness_refused")
    assert refused and {e["reason"] for e in refused} == {"fork"} and refused[0]["checkpoint"] == note
    # a restart keeps the state (a crash's torn last line was never answered): the fork is refused again
    witness.stop()
    with open(tmp_path / "witness.jsonl", "ab") as torn:
        torn.write(b'{"seq":9,"run_id":"x","kind":"witness_cosigned","payload":{"origin":"example.com/lo')
    witness.start()
    assert witness.post(body(6, note))[:2] == (409, "text/x.tlog.size")
    grow(fork, 2)
    checkpoint(fork, key)
    proc = push(fork, witness, wvkey)  # a larger fork: its proof from 6 cannot match the root held
    assert proc.returncode == 1 and "422" in proc.err
    assert witness.events("witness_refused")[-1]["reason"] == "bad_proof"
    grow(ledger, 1)
    checkpoint(ledger, key)
    assert push(ledger, witness, wvkey).returncode == 0
    assert verify(ledger, vkey, "--witness", wvkey).returncode == 0
    assert [e["size"] for e in witness.events("witness_cosigned")] == [6, 7]


# ----------------------------------------------------------------------------
# Hostile clients
# ----------------------------------------------------------------------------

def test_each_bad_request_gets_the_answer_the_spec_names(world, tmp_path):
    logs, wvkey, witness = world
    key, vkey = logs[LOG1]
    ledger = tmp_path / "l.jsonl"
    grow(ledger, 5)
    note5 = checkpoint(ledger, key)
    assert witness.post(body(0, note5))[0] == 200
    grow(ledger, 5)
    note10 = checkpoint(ledger, key)
    proof = run_script("reasoning_ledger.py", "prove", ledger, "--consistency", "5", "10").out.split()
    assert proof
    bad = [proof[0][:-2][::-1] + proof[0][-2:]] + proof[1:]
    cases = [
        (body(5, note10, bad), 422),                     # a proof that does not verify
        (body(5, note10, proof[:-1]), 422),              # one hash short
        (body(11, note10, proof), 400),                  # old above the checkpoint's size
        (body(0, note10, proof), 409),                   # not the size it holds (and a proof from 0)
        (body(3, note10, proof), 409),
        (body(5, note10.replace(LOG1, LOG2, 1), proof), 403),  # another log's name: its key does not verify
        (body(5, note10.replace(LOG1, "example.com/nobody")), 404),
        (body(5, note10[: len(note10) // 2]), 400),       # a cut note
        (b"old 05\n\n" + note10.encode(), 400),           # leading zero
        (b"\xff\xfe\n\n", 400),
        (body(5, note10, proof + ["AAAA"]), 400),           # not a hash
        (body(5, note10, proof * 40), 400),                 # over 63 proof lines
    ]
    for data, want in cases:
        status, kind, text = witness.post(data)
        assert status == want, (data[:80], status, text)
        if status == 409:
            assert (kind, text) == ("text/x.tlog.size", "5\n")
    # a checkpoint signed by a key the witness does not trust for the origin
    (tmp_path / "other").mkdir()
    other, _ = keygen(tmp_path / "other", LOG1)
    note_other = run_script("reasoning_ledger.py", "checkpoint", ledger, "--key", other).out
    assert witness.post(body(5, note_other, proof))[0] == 403
    # only 422 (a bad proof) is evidence here: 400, 403, 404 and a stale size are the client's
    assert [e["reason"] for e in witness.events("witness_refused")] == ["bad_proof", "bad_proof"]
    status, _kind, text = witness.post(body(5, note10, proof))
    assert status == 200 and text.startswith("\u2014 " + WITNESS + " ")
    # an empty log's first checkpoint (size 0) is no fork of anything
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    note0 = checkpoint(empty, logs[LOG2][0])
    assert witness.post(body(0, note0))[0] == 200 and witness.post(body(0, note0))[0] == 200


def test_a_body_over_64_kib_is_413_unread_and_a_wrong_route_or_method_is_refused(world):
    _logs, _wvkey, witness = world
    with socket.create_connection(("127.0.0.1", witness.port), timeout=120) as sock:
        sock.sendall(b"POST /add-checkpoint HTTP/1.1\r\nHost: w\r\nContent-Length: 65537\r\n\r\n")
        assert sock.makefile("rb").readline().split()[1] == b"413"
    assert witness.post(b"x" * 65536)[0] == 400  # at the limit: read, and refused as a body
    conn = http.client.HTTPConnection("127.0.0.1", witness.port, timeout=120)
    conn.request("GET", "/add-checkpoint")
    assert conn.getresponse().status == 405
    conn = http.client.HTTPConnection("127.0.0.1", witness.port, timeout=120)
    conn.request("POST", "/other", body=b"")
    assert conn.getresponse().status == 404


def test_a_slow_client_is_cut_at_the_deadline_and_others_are_served_meanwhile(world, tmp_path):
    logs, _wvkey, witness = world
    witness.stop()
    witness.args = ("--request-timeout", "1", "--max-connections", "2")
    witness.start()
    slow = socket.create_connection(("127.0.0.1", witness.port), timeout=120)
    slow.sendall(b"POST /add-checkpoint HTTP/1.1\r\nHost: w\r\nContent-Length: 100\r\n\r\nold ")
    # the other slot serves while the slow client holds one
    ledger = tmp_path / "l.jsonl"
    grow(ledger, 2)
    assert witness.post(body(0, checkpoint(ledger, logs[LOG1][0])))[0] == 200
    answer = slow.makefile("rb").read()  # the deadline ends it: whatever the clock says, it ends
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"408"
    slow.close()


def test_connections_over_the_cap_get_503(world):
    _logs, _wvkey, witness = world
    witness.stop()
    witness.args = ("--max-connections", "1")
    witness.start()
    with socket.create_connection(("127.0.0.1", witness.port), timeout=120) as held:
        held.sendall(b"POST /add-checkpoint HTTP/1.1\r\n")
        with socket.create_connection(("127.0.0.1", witness.port), timeout=120) as other:
            assert other.makefile("rb").readline().split()[1] == b"503"


def test_a_witness_refuses_to_start_without_its_files_or_with_a_logs_key(tmp_path):
    log_key, vkey = keygen(tmp_path, LOG1)
    (tmp_path / "logs.txt").write_text(f"{LOG1} {vkey}\n")
    for args in ([], ["--key", tmp_path / "none.key", "--logs", tmp_path / "logs.txt"],
                 ["--key", log_key, "--logs", tmp_path / "logs.txt"]):
        proc = run_script("fleet.py", "witness", "--listen", "127.0.0.1:0", *args)
        assert proc.returncode == 2 and proc.err.startswith("error: ") and len(proc.err.splitlines()) == 1, proc.err


# ----------------------------------------------------------------------------
# Where checkpoints are made: a signing Ledger, the proxy and the daemon at SIGTERM
# ----------------------------------------------------------------------------

def _sizes(ledger):
    return [rl.parse_checkpoint(n)[0].size for n in rl.split_notes(Path(f"{ledger}.checkpoints").read_text())]


def _verifies(ledger, vkey):
    proc = run_script("reasoning_ledger.py", "verify", ledger, "--checkpoint", f"{ledger}.checkpoints",
                      "--vkey", vkey)
    assert proc.returncode == 0, proc.out + proc.err


def test_a_signing_ledger_checkpoints_every_n_lines_or_m_seconds_and_at_close(tmp_path, monkeypatch):
    key, vkey = keygen(tmp_path, "box.example/log")
    signer, ledger = rl.read_signer_key(key), tmp_path / "l.jsonl"
    monkeypatch.setattr(rl, "CHECKPOINT_EVERY", (3, 3600))
    with rl.Ledger(ledger, "r1", signer=signer) as book:
        for i in range(7):
            book.append("note", {"i": i})
        assert _sizes(ledger) == [3, 6]
    assert _sizes(ledger) == [3, 6, 7]  # the close: the last line too
    rl.Ledger(ledger, "r1", signer=signer).close()  # nothing new: no checkpoint
    assert _sizes(ledger) == [3, 6, 7]
    monkeypatch.setattr(rl, "CHECKPOINT_EVERY", (1000, 0))  # every line is M seconds after the last
    with rl.Ledger(ledger, "r1", signer=signer) as book:
        book.append("note")
        book.append("note")
    assert _sizes(ledger) == [3, 6, 7, 8, 9]
    _verifies(ledger, vkey)
    assert key.read_text().strip() not in ledger.read_text()


def test_a_cosigner_or_readable_signing_key_is_refused_before_anything_is_written(tmp_path):
    from proxy_helpers import Proxy
    wkey, _ = keygen(tmp_path, "w.example", "--cosigner")
    open_key, _ = keygen(tmp_path, "box.example/open")
    open_key.chmod(0o644)
    for key in (wkey, open_key, tmp_path / "missing.key"):
        with pytest.raises(RuntimeError, match="error: "):
            Proxy("http://127.0.0.1:9/v1", tmp_path / "calls.jsonl", LEDGER_SIGNING_KEY_FILE=str(key))
        assert not (tmp_path / "calls.jsonl").exists()


def test_the_proxy_checkpoints_its_ledger_at_sigterm(tmp_path):
    from fake_upstream import Upstream
    from proxy_helpers import Proxy, post
    key, vkey = keygen(tmp_path, "box.example/proxy")
    upstream = Upstream().start()
    try:
        proxy = Proxy(upstream.base_url, tmp_path / "calls.jsonl", LEDGER_SIGNING_KEY_FILE=str(key))
        for _ in range(2):
            response, _raw = post(proxy.conn(), "/chat/completions",
                                  {"model": "up-model", "messages": [{"role": "user", "content": "2+2?"}]})
            assert response.status == 200
        code, _out, err = proxy.stop()
    finally:
        upstream.stop()
    assert code == 0, err
    assert _sizes(tmp_path / "calls.jsonl") == [len((tmp_path / "calls.jsonl").read_bytes().splitlines())]
    _verifies(tmp_path / "calls.jsonl", vkey)


def test_the_daemon_checkpoints_its_ledger_at_sigterm(tmp_path, server):
    from test_daemon import Daemon
    from conftest import KEY, make_repo, tools_json
    key, vkey = keygen(tmp_path, "box.example/daemon")
    runs = tmp_path / "runs"
    argv = [sys.executable, str(ROOT / "daemon.py"), "--repo", str(make_repo(tmp_path / "repo")), "--port", "0",
            "--runs-dir", str(runs), "--tools", str(tools_json(tmp_path / "tools.json"))]
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="m", LEDGER_SIGNING_KEY_FILE=str(key))
    daemon = Daemon(argv, env, runs, tmp_path / "daemon.err").start()
    try:
        assert daemon.stop() == 0, daemon.stderr()
    finally:
        daemon.kill()
    ledger = runs / "daemon.jsonl"
    assert _sizes(ledger) == [len(ledger.read_bytes().splitlines())]
    _verifies(ledger, vkey)


# ----------------------------------------------------------------------------
# A hostile witness: witness-push keeps nothing it did not verify
# ----------------------------------------------------------------------------

def test_witness_push_keeps_nothing_a_hostile_witness_answers(tmp_path):
    import http.server
    import threading
    key, _vkey = keygen(tmp_path, LOG1)
    _wkey, wvkey = keygen(tmp_path, WITNESS, "--cosigner")
    ledger = tmp_path / "l.jsonl"
    grow(ledger, 3)
    note = checkpoint(ledger, key)
    sidecar = Path(f"{ledger}.checkpoints")
    other_line = note.rsplit("\n\n", 1)[1]  # the log's own signature line: not the witness's
    answers = [
        (200, "text/plain", "garbage\n"),
        (200, "text/plain", other_line),
        (409, "text/x.tlog.size", "1\n"),  # twice: it retries once only
        (422, "text/plain", "no\n"),
        (302, "text/plain", ""),  # a redirect is not followed
        (200, "text/plain", "stall"),
    ]
    stalled = threading.Event()

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status, kind, text = answers[0]
            if text == "stall":
                stalled.wait(120)  # past witness-push's deadline
                return
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Location", "http://127.0.0.1:9/")
            self.send_header("Content-Length", str(len(text.encode())))
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        while answers:
            proc = run_script("fleet.py", "witness-push", ledger, f"http://127.0.0.1:{server.server_port}",
                              "--witness", wvkey, timeout=120)
            assert proc.returncode == 1 and len(proc.err.splitlines()) == 1, (answers[0], proc.err)
            assert sidecar.read_text() == note, answers[0]
            answers.pop(0)
    finally:
        stalled.set()
        server.shutdown()
