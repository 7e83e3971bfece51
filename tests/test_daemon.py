"""daemon.py as it runs on a server: the daemon as a subprocess on 127.0.0.1 (port 0), real sockets, real
git repositories in temp dirs, and the stand-in model (fake_openai.py) for the runs the deliveries start.
Every wait has a deadline and every daemon is killed in teardown; nothing asserts a speed."""

import base64
import hashlib
import hmac
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import agent
import conftest
import daemon
import reasoning_ledger as rl
from conftest import KEY, ROOT, all_bytes_under, clean_env, error_lines, git, parse_html, run_script

SECRET = "whk test secret, rotated 2026-11 0123456789"       # white space and a comma inside: one line of the file
VECTOR_SECRET = "It's a Secret to Everybody"                     # GitHub's published test vector
VECTOR_BODY = b"Hello, World!"
VECTOR_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
STANDARD_SECRET = "whsec_" + base64.b64encode(b"standard-webhooks-test-key-0123456789").decode()
TOKEN = "read-token-0123456789abcdefXYZ"
CALC = "def add(a, b):\n    return a + b\n"
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
WAIT_S = 240  # the longest any wait here may take before the test fails


# ----------------------------------------------------------------------------
# Helpers: repositories, tools.json, signing, HTTP
# ----------------------------------------------------------------------------

def make_repo(root, extra=None):
    """A repository whose tests pass (conftest.make_repo with this file's calc.py)."""
    return conftest.make_repo(root, calc=CALC, tests=TESTS, extra=extra)


def tools_json(path, test_code="pass", **changes):
    """The shipped tools.json whose test command is `python -c TEST_CODE` (exit 0: the run is a quick
    no_action), plus `changes`."""
    return conftest.tools_json(path, test_command=[sys.executable, "-c", test_code], **changes)


def github_signature(body, secret=SECRET):
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def github_headers(body, delivery=None, event="push", secret=SECRET, **extra):
    headers = {"Content-Type": "application/json", "X-GitHub-Event": event,
               "X-GitHub-Delivery": delivery or str(uuid.uuid4()), "X-Hub-Signature-256": github_signature(body, secret)}
    headers.update(extra)
    return headers


def standard_headers(body, msg_id, timestamp=None, secret=STANDARD_SECRET):
    timestamp = str(int(time.time()) if timestamp is None else timestamp)
    key = base64.b64decode(secret[len("whsec_"):])
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return {"Content-Type": "application/json", "webhook-id": msg_id, "webhook-timestamp": timestamp,
            "webhook-signature": "v1," + base64.b64encode(digest).decode()}


def push_body(after="0" * 40, **extra):
    data = {"ref": "refs/heads/main", "before": "0" * 40, "after": after, "repository": {"full_name": "o/r"}}
    data.update(extra)
    return json.dumps(data).encode()


class Answer:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


def request(port, method, path, body=None, headers=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def raw_exchange(port, data, timeout=20, shut_write=False):
    """Send raw bytes, read until the server closes; returns (status or None, everything read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        return _read_answer(sock)


def _read_answer(sock):
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    match = re.match(rb"HTTP/1\.[01] ([0-9]{3}) ", got)
    return (int(match.group(1)) if match else None), got


def wait_until(what, predicate, timeout=WAIT_S, every=0.1):
    """predicate()'s first true value, polled until `timeout`; fails the test naming `what` otherwise."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


# ----------------------------------------------------------------------------
# The daemon as a subprocess
# ----------------------------------------------------------------------------

class Daemon:
    """One `daemon.py` process; its stderr goes to a file (the access log is one line a request)."""

    def __init__(self, argv, env, runs, log):
        self.argv, self.env, self.runs, self.log = argv, env, runs, log
        self.proc, self.port, self.address = None, None, None

    def start(self):
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=err, env=self.env, cwd=str(ROOT))
        ready, _w, _x = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline().decode() if ready else ""
        match = re.fullmatch(r"serving on (http://127\.0\.0\.1:([0-9]+))\n", line)
        if not match:
            self.kill()
            raise AssertionError(f"the daemon did not start: {line!r}\n{self.stderr()}")
        self.address, self.port = match.group(1), int(match.group(2))
        return self

    def post(self, body, headers, path="/webhook", timeout=30):
        return request(self.port, "POST", path, body, headers, timeout=timeout)

    def get(self, path, headers=None):
        return request(self.port, "GET", path, headers=headers)

    def stop(self, signum=signal.SIGTERM, timeout=90):
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout=timeout)
        self.proc.stdout.close()
        return code

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def stderr(self):
        return Path(self.log).read_text(encoding="utf-8", errors="replace") if Path(self.log).exists() else ""

    # the daemon's own ledger
    def events(self, kind=None):
        path = self.runs / "daemon.jsonl"
        found = []
        if path.exists():
            try:
                for event in rl.read_events(path, run_id=None):
                    found.append(event)
            except rl.TornTailError:
                pass  # a line being appended right now
        return [e for e in found if kind is None or e["kind"] == kind]

    def payloads(self, kind):
        return [e["payload"] for e in self.events(kind)]

    def finished(self, run_ids):
        """Wait until every run id has a run_finished; returns {run id: payload}."""
        wanted = set(run_ids)

        def done():
            found = {p["run_id"]: p for p in self.payloads("run_finished")}
            return found if wanted <= set(found) else None
        return wait_until(f"{len(wanted)} runs to finish", done)


@pytest.fixture
def serve(tmp_path, server):
    """Start daemons on a passing repository (or the one given), all on the same runs dir; every one still
    running is killed at the end."""
    started = []
    base = {"repo": None, "tools": None}
    runs = tmp_path / "runs"
    secrets = tmp_path / "webhook-secrets"
    secrets.write_text(f"{SECRET}\n\n{VECTOR_SECRET}\n{STANDARD_SECRET}\n")
    (tmp_path / "locks").mkdir()

    def start(*args, repo=None, tools=None, env=None, secret_file=True):
        if repo is None:
            base["repo"] = base["repo"] or make_repo(tmp_path / "repo")
            repo = base["repo"]
        if tools is None:
            base["tools"] = base["tools"] or tools_json(tmp_path / "tools.json")
            tools = base["tools"]
        settings = {"BASE_URL": server.base_url, "API_KEY": KEY, "MODEL_ID": "stand-in-model",
                    "AGENT_LOCK_DIR": str(tmp_path / "locks"),
                    "WEBHOOK_SECRET_FILE": str(secrets) if secret_file else None}
        settings.update(env or {})
        argv = [sys.executable, str(ROOT / "daemon.py"), "--repo", str(repo), "--port", "0", "--runs-dir",
                str(runs), "--tools", str(tools), *map(str, args)]
        daemon = Daemon(argv, clean_env(**settings), runs, tmp_path / f"daemon-{len(started)}.err")
        started.append(daemon)
        return daemon.start()

    start.runs, start.tmp = runs, tmp_path
    yield start
    for daemon in started:
        daemon.kill()


def verifies(runs):
    """The daemon's ledger, the index and every run verify."""
    proc = run_script("reasoning_ledger.py", "verify", runs / "daemon.jsonl", "--all", runs, timeout=120)
    assert proc.returncode == 0, proc.out + proc.err
    return proc


def run_events(runs, run_id):
    return list(rl.read_events(runs / run_id / "events.jsonl"))


def no_traceback(*daemons):
    for daemon in daemons:
        assert "Traceback" not in daemon.stderr(), daemon.stderr()


# ----------------------------------------------------------------------------
# Signatures: GitHub's and Standard Webhooks'
# ----------------------------------------------------------------------------

def test_githubs_published_test_vector_passes_the_signature_and_a_changed_byte_does_not(serve):
    assert github_signature(VECTOR_BODY, VECTOR_SECRET) == VECTOR_SIGNATURE
    daemon = serve()
    headers = {"Content-Type": "application/json", "X-GitHub-Event": "push", "X-GitHub-Delivery": "vector-1",
               "X-Hub-Signature-256": VECTOR_SIGNATURE}
    answer = daemon.post(VECTOR_BODY, headers)
    assert answer.status == 400 and answer.json() == {"error": "the body is not JSON"}  # signed, then parsed
    assert daemon.post(b"Hello, World?", headers).status == 401  # one byte of the body
    last = VECTOR_SIGNATURE[-1]
    flipped = VECTOR_SIGNATURE[:-1] + ("e" if last == "f" else "f")
    bad = daemon.post(VECTOR_BODY, dict(headers, **{"X-Hub-Signature-256": flipped}))  # one byte of the signature
    assert bad.status == 401 and bad.json() == {"error": "the signature does not match"}
    rejected = daemon.payloads("webhook_rejected")
    assert [(r["reason"], r["status"]) for r in rejected] == [("invalid_json", 400), ("bad_signature", 401),
                                                               ("bad_signature", 401)]
    assert all(r["delivery"] == "vector-1" and r["remote"] == "127.0.0.1" for r in rejected)
    assert not daemon.events("webhook_received") and not (serve.runs / "artifacts").exists()
    assert VECTOR_SIGNATURE[7:].encode() not in bad.body + answer.body


def test_a_signed_push_is_recorded_before_the_202_and_runs_at_its_after_commit(serve):
    daemon = serve()
    head = git(serve.tmp / "repo", "rev-parse", "HEAD").decode().strip()
    body = push_body(after=head)
    answer = daemon.post(body, github_headers(body, delivery="push-1"))
    assert answer.status == 202, answer.body
    reply = answer.json()
    assert set(reply) == {"run_id", "delivery"} and reply["delivery"] == "push-1"
    (received,) = daemon.payloads("webhook_received")  # already on disk when the 202 arrived
    assert received["run_id"] == reply["run_id"] and received["event"] == "push" and received["source"] == "github"
    assert received["body_sha256"] == hashlib.sha256(body).hexdigest() and received["after"] == head
    assert (serve.runs / received["body_artifact"]["path"]).read_bytes() == body
    other = push_body(after="f" * 40)  # a commit this repository does not have: HEAD
    second = daemon.post(other, github_headers(other, delivery="push-2")).json()
    finished = daemon.finished([reply["run_id"], second["run_id"]])
    assert finished[reply["run_id"]]["outcome"] == "no_action" and finished[reply["run_id"]]["exit_code"] == 0
    refs = {p["run_id"]: p["ref"] for p in daemon.payloads("run_dispatched")}
    assert refs == {reply["run_id"]: head, second["run_id"]: None}
    started = run_events(serve.runs, reply["run_id"])[0]["payload"]
    assert started["delivery"] == "push-1" and started["event"] == "push" and started["ref"] == head
    assert run_events(serve.runs, second["run_id"])[0]["payload"]["ref"] is None
    assert daemon.stop() == 0
    kinds = [e["kind"] for e in daemon.events()]
    assert kinds[0] == "daemon_started" and kinds[-1] == "daemon_stopped"
    verifies(serve.runs)
    no_traceback(daemon)


def test_standard_webhooks_signed_per_the_spec_are_accepted_and_stale_ones_rejected(serve):
    import daemon as script  # the spec's own example: secret, id, timestamp, payload and signature
    keys = script.signing_keys(["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
    example = (b'{"test": 2432232314}', "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330",
               "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=")
    script.verify_standard(keys, *example, now=1614265330)
    with pytest.raises(script.Refused) as stale:
        script.verify_standard(keys, *example, now=1614265330 + 301)
    assert stale.value.reason == "stale_timestamp"

    daemon = serve()
    body = json.dumps({"type": "build.finished", "timestamp": "2026-11-30T00:00:00Z", "data": {"ok": True}}).encode()
    headers = standard_headers(body, "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W")
    headers["webhook-signature"] = "v1,bm90IHRoaXMgb25l " + headers["webhook-signature"]  # one of two matches
    answer = daemon.post(body, headers)
    assert answer.status == 202, answer.body
    (received,) = daemon.payloads("webhook_received")
    assert received["source"] == "standard" and received["event"] == "build.finished"
    assert received["delivery"] == "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W" == answer.json()["delivery"]
    for offset in (-600, 600):  # ten minutes in the past, ten in the future
        stale = daemon.post(body, standard_headers(body, f"msg_stale{offset}", int(time.time()) + offset))
        assert stale.status == 401
    tampered = standard_headers(body, "msg_tampered")
    assert daemon.post(body.replace(b"true", b"false"), tampered).status == 401
    unsigned = {k: v for k, v in standard_headers(body, "msg_x").items() if k != "webhook-id"}
    assert daemon.post(body, unsigned).status == 401
    assert [r["reason"] for r in daemon.payloads("webhook_rejected")] == [
        "stale_timestamp", "stale_timestamp", "bad_signature", "missing_signature"]
    daemon.finished([answer.json()["run_id"]])


# ----------------------------------------------------------------------------
# What does not get in: each with its status and an event, and the daemon goes on
# ----------------------------------------------------------------------------

def _signed_raw(body, extra_headers=b"", length=True):
    headers = github_headers(body, delivery="raw-1")
    lines = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
    size = f"Content-Length: {len(body)}\r\n".encode() if length else b""
    return b"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\n" + lines + size + extra_headers + b"\r\n" + body


MALFORMED = [
    # (name, how, expected status, recorded reason or None)
    ("no signature", ("post", b'{"a": 1}', {"Content-Type": "application/json", "X-GitHub-Event": "push",
                                           "X-GitHub-Delivery": "d1"}), 401, "missing_signature"),
    ("garbled signature", ("post", b'{"a": 1}', {"Content-Type": "application/json", "X-GitHub-Event": "push",
                                                "X-GitHub-Delivery": "d2", "X-Hub-Signature-256": "sha256=zz"}),
     401, "bad_signature_format"),
    ("sha1 only", ("post", b'{"a": 1}', {"Content-Type": "application/json", "X-GitHub-Delivery": "d3",
                                        "X-Hub-Signature": "sha1=" + "0" * 40}), 401, "missing_signature"),
    ("no delivery id", ("signed", b'{"a": 1}', {"X-GitHub-Delivery": ""}), 400, "missing_delivery"),
    ("garbled delivery id", ("signed", b'{"a": 1}', {"X-GitHub-Delivery": "../../etc/passwd"}), 400, "bad_delivery"),
    ("garbled event", ("signed", b'{"a": 1}', {"X-GitHub-Event": "push; rm -rf /"}), 400, "bad_event"),
    ("bad timestamp", ("post", b'{"a": 1}', {"Content-Type": "application/json", "webhook-id": "msg_1",
                                            "webhook-timestamp": "yesterday", "webhook-signature": "v1,AAAA"}),
     401, "bad_timestamp"),
    ("text/plain", ("signed", b'{"a": 1}', {"Content-Type": "text/plain"}), 415, "wrong_content_type"),
    ("form-encoded", ("signed", b"payload=%7B%7D", {"Content-Type": "application/x-www-form-urlencoded"}),
     415, "wrong_content_type"),
    ("latin-1 charset", ("signed", b'{"a": 1}', {"Content-Type": "application/json; charset=latin-1"}),
     415, "wrong_content_type"),
    ("invalid JSON", ("signed", b'{"a": ', {}), 400, "invalid_json"),
    ("invalid UTF-8", ("signed", b'{"a": "\xff\xfe"}', {}), 400, "invalid_utf8"),
    ("JSON, not an object", ("signed", b"[1, 2, 3]", {}), 400, "not_an_object"),
    ("no Content-Length", ("raw", _signed_raw(b"", length=False)), 411, "missing_length"),
    ("chunked", ("raw", _signed_raw(b"", b"Transfer-Encoding: chunked\r\n", length=False) + b"8\r\n{\"a\": 1}\r\n0\r\n\r\n"),
     411, "transfer_encoding"),
    ("two Content-Lengths", ("raw", _signed_raw(b'{"a": 1}', b"Content-Length: 8\r\n")), 400, "bad_length"),
    ("negative Content-Length", ("raw", _signed_raw(b"", b"Content-Length: -5\r\n", length=False)), 400, "bad_length"),
    ("short body", ("rawshut", _signed_raw(b'{"a": 1}').replace(b"Content-Length: 8", b"Content-Length: 80")),
     400, "incomplete_body"),
    ("unknown path", ("req", "POST", "/hook", b"{}"), 404, None),
    ("GET /webhook", ("req", "GET", "/webhook", None), 405, None),
    ("DELETE /webhook", ("req", "DELETE", "/webhook", None), 405, None),
    ("PUT /runs", ("req", "PUT", "/runs", b"{}"), 405, None),
    ("a path that climbs", ("req", "GET", "/../../etc/passwd", None), 404, None),
    ("garbage request line", ("rawshut", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"), 400, None),
    ("unknown method", ("rawshut", b"BREW /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"), 501, None),
]


def test_malformed_requests_get_the_right_status_and_an_event_and_never_a_crash(serve):
    daemon = serve()
    for name, how, status, _reason in MALFORMED:
        if how[0] == "post":
            got = daemon.post(how[1], how[2]).status
        elif how[0] == "signed":
            headers = github_headers(how[1], delivery=f"m-{len(name)}")
            headers.update(how[2])
            got = daemon.post(how[1], {k: v for k, v in headers.items() if v != ""}).status
        elif how[0] == "req":
            got = request(daemon.port, how[1], how[2], how[3]).status
        else:
            got = raw_exchange(daemon.port, how[1], shut_write=how[0] == "rawshut")[0]
        assert got == status, f"{name}: {got}, want {status}"
    reasons = [r["reason"] for r in daemon.payloads("webhook_rejected")]
    assert reasons == [reason for _n, _h, _s, reason in MALFORMED if reason], reasons
    assert daemon.get("/healthz").status == 200  # still serving
    assert not daemon.events("webhook_received") and not (serve.runs / "artifacts").exists()  # no body kept
    assert daemon.stop() == 0
    verifies(serve.runs)
    no_traceback(daemon)


def test_a_rejected_sender_that_keeps_sending_is_drained_a_little_then_cut_off(serve):
    """The linger after an early answer reads at most a little: a client that streams on is not a free firehose."""
    daemon = serve("--request-timeout", 120, "--max-body", 1024)
    head = (b"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 900000000\r\n\r\n")
    sent, chunk = 0, b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as sock:
        try:
            sock.sendall(head)
            while sent < 512 << 20:  # what an unbounded drain would take in well under the 1 s linger
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the daemon closed: reset, or a broken pipe
            pass
    assert sent < 64 << 20, f"{sent >> 20} MiB were taken from a rejected sender"  # 64 KiB + socket buffers
    assert [r["reason"] for r in daemon.payloads("webhook_rejected")] == ["too_large"]
    assert daemon.get("/healthz").status == 200


def test_an_oversized_body_gets_413_at_once_without_being_read(serve):
    daemon = serve("--request-timeout", 120, "--max-body", 1024)
    head = (b"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-GitHub-Event: push\r\n"
            b"X-GitHub-Delivery: big-1\r\nX-Hub-Signature-256: " + github_signature(b"x").encode() +
            b"\r\nContent-Length: 100000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(head)  # and not one byte of the 100 MB: an answer after the deadline would time out here
        status, got = _read_answer(sock)
    assert status == 413 and b"larger than 1024 bytes" in got
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:  # with Expect: no 100 first
        sock.sendall(head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
        status, got = _read_answer(sock)
    assert status == 413 and b"100 Continue" not in got
    assert [r["reason"] for r in daemon.payloads("webhook_rejected")] == ["too_large", "too_large"]
    assert not daemon.events("webhook_timeout")
    body = push_body()  # a body that fits, sent after the 100 Continue as curl does
    request_head = _signed_raw(body).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n", 1)[:-len(body)]
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(request_head)
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        status, got = _read_answer(sock)
    assert status == 202 and b'"delivery": "raw-1"' in got


def test_fetch_brings_in_the_pushed_commit_and_is_recorded(serve):
    upstream = make_repo(serve.tmp / "upstream")
    clone = serve.tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(upstream), str(clone)], check=True, capture_output=True,
                   env=clean_env(), timeout=60)
    (upstream / "calc.py").write_text(CALC + "\n\ndef sub(a, b):\n    return a - b\n")
    git(upstream, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "sub")
    pushed = git(upstream, "rev-parse", "HEAD").decode().strip()
    before = git(clone, "rev-parse", "HEAD")
    daemon = serve("--fetch", repo=clone)
    body = push_body(after=pushed)
    run_id = daemon.post(body, github_headers(body, delivery="fetch-1")).json()["run_id"]
    assert daemon.finished([run_id])[run_id]["outcome"] == "no_action"
    (fetched,) = daemon.payloads("git_fetch")
    assert fetched["returncode"] == 0 and fetched["run_id"] == run_id
    (dispatched,) = daemon.payloads("run_dispatched")
    assert dispatched["ref"] == pushed  # fetched first, so the commit is there
    assert run_events(serve.runs, run_id)[0]["payload"]["commit"] == pushed
    assert git(clone, "rev-parse", "HEAD") == before  # fetch moved no branch and no file of the clone
    assert daemon.stop() == 0
    verifies(serve.runs)


# ----------------------------------------------------------------------------
# Load: fifty at once, redeliveries, a full queue, stalled clients, the connection cap
# ----------------------------------------------------------------------------

def _deliver_concurrently(daemon, count, threads=None, prefix="load"):
    """`count` signed pushes from `count` threads released together. Returns [(delivery, Answer or error)]."""
    barrier = threading.Barrier(threads or count)
    results = [None] * count

    def one(i):
        body = push_body(number=i)
        delivery = f"{prefix}-{i}"
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        try:
            results[i] = (delivery, daemon.post(body, github_headers(body, delivery=delivery), timeout=60))
        except OSError as exc:
            results[i] = (delivery, exc)

    workers = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert not any(w.is_alive() for w in workers)
    return results


def test_fifty_concurrent_deliveries_are_each_recorded_once_with_one_run_each(serve):
    daemon = serve("--queue", 64)
    results = _deliver_concurrently(daemon, 50)
    statuses = [r.status if isinstance(r, Answer) else repr(r) for _d, r in results]
    assert statuses == [202] * 50, statuses
    run_ids = {d: r.json()["run_id"] for d, r in results}
    assert len(set(run_ids.values())) == 50
    received = daemon.payloads("webhook_received")
    assert sorted(p["delivery"] for p in received) == sorted(run_ids)  # each exactly once
    assert {p["delivery"]: p["run_id"] for p in received} == run_ids
    rl.verify(serve.runs / "daemon.jsonl")  # one chain, fifty concurrent writers
    finished = daemon.finished(run_ids.values())
    assert all(p["outcome"] == "no_action" for p in finished.values())
    dispatched = [p["run_id"] for p in daemon.payloads("run_dispatched")]
    assert sorted(dispatched) == sorted(run_ids.values())  # one run each
    for delivery, run_id in run_ids.items():
        assert run_events(serve.runs, run_id)[0]["payload"]["delivery"] == delivery
    assert daemon.stop() == 0
    verifies(serve.runs)
    no_traceback(daemon)


def test_a_redelivery_gets_the_same_run_and_no_second_run_even_after_a_restart(serve):
    daemon = serve()
    body = push_body()
    headers = github_headers(body, delivery="again-1")
    first = daemon.post(body, headers)
    assert first.status == 202
    run_id = first.json()["run_id"]
    again = daemon.post(body, headers)
    assert again.status == 200 and again.json() == {"run_id": run_id, "delivery": "again-1", "duplicate": True}
    daemon.finished([run_id])
    assert daemon.stop() == 0
    daemon = serve()  # the delivery -> run map comes back from daemon.jsonl
    third = daemon.post(body, headers)
    assert third.status == 200 and third.json()["run_id"] == run_id
    duplicates = daemon.payloads("webhook_duplicate")
    assert [(p["delivery"], p["run_id"]) for p in duplicates] == [("again-1", run_id)] * 2
    assert [p["run_id"] for p in daemon.payloads("run_dispatched")] == [run_id]
    assert len(list(serve.runs.glob("*/events.jsonl"))) == 1
    assert daemon.stop() == 0
    verifies(serve.runs)


def test_a_captured_github_delivery_replayed_under_new_ids_starts_no_new_run(serve):
    """GitHub signs the body, not X-GitHub-Delivery: a captured request sent again with fresh ids is the same
    delivery, before and after a restart. A different body is a different delivery."""
    daemon = serve()
    body = push_body()
    first = daemon.post(body, github_headers(body, delivery="orig-1"))
    assert first.status == 202
    run_id = first.json()["run_id"]
    replayed = [daemon.post(body, github_headers(body, delivery=f"forged-{i}")) for i in range(3)]
    assert [(a.status, a.json()["run_id"], a.json()["delivery"]) for a in replayed] == [(200, run_id, "orig-1")] * 3
    daemon.finished([run_id])
    assert daemon.stop() == 0
    daemon = serve()
    again = daemon.post(body, github_headers(body, delivery="forged-after-restart"))
    assert again.status == 200 and again.json()["run_id"] == run_id
    other = push_body(ref="refs/heads/other")
    fresh = daemon.post(other, github_headers(other, delivery="forged-x"))
    assert fresh.status == 202 and fresh.json()["run_id"] != run_id  # a new body is a new delivery
    daemon.finished([fresh.json()["run_id"]])
    same = [p for p in daemon.payloads("webhook_duplicate") if p.get("same_body_as") == "orig-1"]
    assert len(same) == 4 and {p["run_id"] for p in same} == {run_id}
    assert len([p for p in daemon.payloads("run_dispatched") if p["run_id"] == run_id]) == 1
    assert daemon.stop() == 0
    verifies(serve.runs)


def test_a_flood_of_bad_signatures_is_counted_without_filling_the_ledger(serve):
    daemon = serve()
    body = push_body()
    flood = 120
    statuses = {daemon.post(body, github_headers(body, delivery=f"flood-{i}", secret="wrong")).status
                for i in range(flood)}
    assert statuses == {401}
    time.sleep(1.0)  # the bucket refills: the next rejection is recorded with the count it stands for
    assert daemon.post(body, github_headers(body, delivery="last", secret="wrong")).status == 401
    rejected = daemon.payloads("webhook_rejected")
    assert len(rejected) < flood and rejected[-1]["delivery"] == "last"
    assert rejected[-1]["unrecorded_before"] > 0
    assert len(rejected) + sum(r.get("unrecorded_before", 0) for r in rejected) == flood + 1  # none uncounted
    assert daemon.get("/healthz").status == 200 and not daemon.events("webhook_received")
    for i in range(flood):  # a second flood, then a stop: what was not recorded is counted at the stop
        daemon.post(body, github_headers(body, delivery=f"again-{i}", secret="wrong"))
    assert daemon.stop() == 0
    rejected = daemon.payloads("webhook_rejected")
    (stopped,) = daemon.payloads("daemon_stopped")
    assert stopped["unrecorded_rejections"] > 0
    assert len(rejected) + sum(r.get("unrecorded_before", 0) for r in rejected) + stopped[
        "unrecorded_rejections"] == 2 * flood + 1
    verifies(serve.runs)


def test_idle_connections_count_against_the_same_rejection_budget(serve):
    daemon = serve("--request-timeout", 1)
    idle = []
    for _ in range(3):
        batch = [socket.create_connection(("127.0.0.1", daemon.port)) for _ in range(40)]
        time.sleep(3.0)  # each times out (408 after 1 s) with nothing sent
        for sock in batch:
            sock.close()
        idle += batch
    assert daemon.stop() == 0
    timeouts = daemon.payloads("webhook_timeout")
    (stopped,) = daemon.payloads("daemon_stopped")
    counted = len(timeouts) + sum(t.get("unrecorded_before", 0) for t in timeouts) + stopped["unrecorded_rejections"]
    assert counted == len(idle) and len(timeouts) < len(idle), (len(timeouts), counted)


def test_a_ping_is_answered_200_and_recorded_without_a_run(serve):
    daemon = serve()
    body = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1}).encode()
    answer = daemon.post(body, github_headers(body, delivery="ping-1", event="ping"))
    assert answer.status == 200 and answer.json() == {"run_id": None, "delivery": "ping-1"}
    (received,) = daemon.payloads("webhook_received")
    assert received["event"] == "ping" and received["run_id"] is None
    assert daemon.stop() == 0
    assert not daemon.events("run_dispatched") and not list(serve.runs.glob("*/events.jsonl"))


def test_a_full_queue_answers_503_and_sigterm_terminates_the_run_after_its_grace(serve):
    slow = tools_json(serve.tmp / "slow.json", "import time; time.sleep(60)")
    daemon = serve("--queue", 1, "--grace-s", 1, tools=slow)
    bodies = [push_body(number=i) for i in range(3)]
    first = daemon.post(bodies[0], github_headers(bodies[0], delivery="q-0")).json()["run_id"]
    wait_until("the first run to be dispatched", lambda: daemon.events("run_dispatched"))
    # in its 60 s test command: started and recorded, so the SIGTERM below finds a run that can close itself
    ledger = serve.runs / first / "events.jsonl"
    wait_until("the first run to record its start", lambda: ledger.exists() and ledger.stat().st_size > 0)
    second = daemon.post(bodies[1], github_headers(bodies[1], delivery="q-1"))
    third = daemon.post(bodies[2], github_headers(bodies[2], delivery="q-2"))
    assert second.status == 202 and third.status == 503 and third.headers["retry-after"] == "30"
    (full,) = daemon.payloads("queue_full")
    assert full["delivery"] == "q-2" and full["max"] == 1
    assert daemon.stop() == 0
    (finished,) = daemon.payloads("run_finished")
    assert finished["run_id"] == first and finished["outcome"] == "terminated"
    assert run_events(serve.runs, first)[-1]["payload"]["outcome"] == "error"  # the run closed itself
    stopped = daemon.payloads("daemon_stopped")[-1]
    assert stopped["signal"] == "SIGTERM" and stopped["queued"] == [second.json()["run_id"]]
    verifies(serve.runs)
    daemon = serve()  # the quick tools.json: the queued delivery runs now
    finished = daemon.finished([second.json()["run_id"]])
    assert finished[second.json()["run_id"]]["outcome"] == "no_action"
    assert daemon.payloads("daemon_recovered")[-1]["requeued"] == [second.json()["run_id"]]
    assert daemon.stop() == 0
    verifies(serve.runs)


def test_a_client_that_sends_headers_and_stalls_does_not_delay_others(serve):
    daemon = serve("--request-timeout", 8)
    body = push_body()
    head = _signed_raw(body).replace(b"Content-Length: %d" % len(body), b"Content-Length: 1000")
    stalled = socket.create_connection(("127.0.0.1", daemon.port), timeout=30)
    slowloris = socket.create_connection(("127.0.0.1", daemon.port), timeout=30)
    try:
        stalled.sendall(head[:-len(body)] + body[:10])  # the headers and ten bytes of a 1000-byte body
        slowloris.sendall(b"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Git")  # half a header
        other = daemon.post(body, github_headers(body, delivery="not-delayed"))
        assert other.status == 202  # answered while both are still held open
        for sock in (stalled, slowloris):
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing yet, not even a close: their deadline is ahead
                sock.recv(1)
            sock.setblocking(True)
            sock.settimeout(30)
        answers = [_read_answer(sock)[0] for sock in (stalled, slowloris)]
    finally:
        stalled.close()
        slowloris.close()
    assert answers == [408, 408]
    timeouts = daemon.payloads("webhook_timeout")
    assert sorted(t["stage"] for t in timeouts) == ["body", "request"]
    assert all(t["timeout_s"] == 8 and t["remote"] == "127.0.0.1" for t in timeouts)
    assert daemon.get("/healthz").status == 200
    no_traceback(daemon)


def test_connections_over_the_cap_get_503_and_the_cap_frees_up(serve):
    daemon = serve("--max-connections", 2, "--request-timeout", 60)
    held = [socket.create_connection(("127.0.0.1", daemon.port), timeout=30) for _ in range(2)]
    try:
        for sock in held:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # and no end of the headers
        status, got = raw_exchange(daemon.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 503 and b"Retry-After: 1" in got
    finally:
        for sock in held:
            sock.close()
    wait_until("a free connection slot", lambda: raw_exchange(daemon.port, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200)
    (limit,) = daemon.payloads("connection_limit")
    assert limit["max_connections"] == 2 and limit["refused"] >= 1


# ----------------------------------------------------------------------------
# Stops: SIGTERM and kill -9 during load, a torn tail, a run past its budget, the agent's lock
# ----------------------------------------------------------------------------

def _load_in_background(daemon, count, prefix):
    """Signed deliveries from four threads, one after another each, until `count` or the daemon stops."""
    results, lock = [], threading.Lock()

    def client(start):
        for i in range(start, count, 4):
            body = push_body(number=i)
            delivery = f"{prefix}-{i}"
            try:
                answer = daemon.post(body, github_headers(body, delivery=delivery), timeout=30)
            except OSError as exc:  # the daemon went away mid-request: not accepted
                answer = exc
            with lock:
                results.append((delivery, answer))

    threads = [threading.Thread(target=client, args=(start,)) for start in range(4)]
    for thread in threads:
        thread.start()
    return results, threads


def _accepted(results):
    return {d: a.json()["run_id"] for d, a in results if isinstance(a, Answer) and a.status == 202}


def test_sigterm_during_load_loses_no_accepted_delivery_and_a_restart_runs_them_all(serve):
    seconds = tools_json(serve.tmp / "seconds.json", "import time; time.sleep(1)")
    daemon = serve("--queue", 200, "--grace-s", 30, tools=seconds)
    results, threads = _load_in_background(daemon, 400, "term")
    wait_until("some accepted deliveries", lambda: len(_accepted(list(results))) >= 10)
    assert daemon.stop() == 0  # while the clients are still sending
    for thread in threads:
        thread.join(60)
    accepted = _accepted(results)
    received = {p["delivery"]: p["run_id"] for p in daemon.payloads("webhook_received")}
    assert all(received.get(d) == run_id for d, run_id in accepted.items())  # every 202 was recorded first
    stopped = daemon.payloads("daemon_stopped")[-1]
    dispatched = {p["run_id"] for p in daemon.payloads("run_dispatched")}
    assert set(stopped["queued"]) == set(received.values()) - dispatched and stopped["queued"]
    assert all(p["outcome"] == "no_action" for p in daemon.payloads("run_finished"))  # finished within grace
    verifies(serve.runs)
    daemon = serve("--queue", 200)  # quick runs now
    daemon.finished(received.values())
    assert sorted(p["run_id"] for p in daemon.payloads("run_dispatched")) == sorted(received.values())
    assert daemon.stop() == 0
    verifies(serve.runs)
    no_traceback(daemon)


def test_kill_9_during_load_leaves_ledgers_that_verify_after_the_next_start(serve):
    go = serve.tmp / "go"  # the run in progress at the kill is still running at the restart: it waits for this
    waiting = tools_json(serve.tmp / "waiting.json",  # unboxed: a box would hide `go` from it
                         f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)",
                         sandbox="off")
    daemon = serve("--queue", 200, tools=waiting)
    results, threads = _load_in_background(daemon, 400, "kill")
    wait_until("a run in progress and some accepted deliveries",
                lambda: daemon.events("run_dispatched") and len(_accepted(list(results))) >= 10)
    daemon.proc.kill()  # SIGKILL: no handler runs; the run in progress is orphaned and goes on
    daemon.proc.wait(30)
    for thread in threads:
        thread.join(60)
    accepted = _accepted(results)
    received = {p["delivery"]: p["run_id"] for p in daemon.payloads("webhook_received")}
    assert all(received.get(d) == run_id for d, run_id in accepted.items())
    orphan = daemon.payloads("run_dispatched")[-1]["run_id"]
    daemon = serve("--queue", 200)  # recovers: adopts the orphan, queues the rest again
    recovered = daemon.payloads("daemon_recovered")[-1]
    go.touch()
    if Path("/proc/self").exists():
        assert recovered["adopted"] == [orphan]
    finished = daemon.finished(received.values())
    assert finished[orphan]["run_outcome"] == "no_action"
    assert all(p["outcome"] == "no_action" for p in finished.values())
    assert daemon.stop() == 0
    verifies(serve.runs)
    no_traceback(daemon)


def test_a_torn_tail_left_by_a_crash_is_recovered_by_the_next_start(serve):
    daemon = serve()
    body = push_body()
    run_id = daemon.post(body, github_headers(body, delivery="torn-1")).json()["run_id"]
    daemon.finished([run_id])
    daemon.proc.kill()
    daemon.proc.wait(30)
    ledger = serve.runs / "daemon.jsonl"
    with open(ledger, "ab") as handle:  # what a kill -9 in the middle of an append leaves
        handle.write(b'{"seq":99,"run_id":"daemon-x","kind":"webhook_rec')
    proc = run_script("reasoning_ledger.py", "verify", ledger)
    assert proc.returncode == 1 and "torn tail" in proc.out
    daemon = serve()
    (recovered,) = daemon.payloads("ledger_recovered")
    assert recovered["sidecar"] == "daemon.jsonl.torn" and (serve.runs / "daemon.jsonl.torn").exists()
    again = daemon.post(body, github_headers(body, delivery="torn-1"))  # the map survived the crash
    assert again.status == 200 and again.json()["run_id"] == run_id
    assert daemon.stop() == 0
    verifies(serve.runs)


def test_a_run_past_its_wall_budget_is_killed_with_its_process_group(serve):
    slow = tools_json(serve.tmp / "slow.json", "import time; time.sleep(60)")
    daemon = serve("--kill-after-s", 2, tools=slow)
    body = push_body()
    run_id = daemon.post(body, github_headers(body)).json()["run_id"]
    finished = daemon.finished([run_id])[run_id]
    assert finished["outcome"] == "killed" and finished["duration_ms"] < 60000
    events = run_events(serve.runs, run_id)
    assert events[-1]["kind"] == "run_closed" and events[-1]["payload"]["outcome"] == "error"
    assert daemon.stop() == 0
    verifies(serve.runs)


def test_a_run_locked_out_by_another_run_is_recorded_as_locked(serve, monkeypatch):
    import agent
    daemon = serve()
    monkeypatch.setenv("AGENT_LOCK_DIR", str(serve.tmp / "locks"))
    lock = agent.take_lock((serve.tmp / "repo").resolve(), "held-by-the-test")
    try:
        body = push_body()
        run_id = daemon.post(body, github_headers(body, delivery="locked-1")).json()["run_id"]
        finished = daemon.finished([run_id])[run_id]
    finally:
        os.close(lock)
    assert finished["outcome"] == "locked" and finished["exit_code"] == 6
    assert "another run holds the lock" in finished["output_tail"]
    body = push_body(number=2)
    run_id = daemon.post(body, github_headers(body, delivery="locked-2")).json()["run_id"]
    assert daemon.finished([run_id])[run_id]["outcome"] == "no_action"


# ----------------------------------------------------------------------------
# Reading: tokens, paths, the timeline page
# ----------------------------------------------------------------------------

def test_read_endpoints_need_the_token_once_one_is_set_and_run_ids_are_checked(serve):
    daemon = serve(env={"READ_TOKEN": TOKEN})
    body = push_body()
    run_id = daemon.post(body, github_headers(body, delivery="read-1")).json()["run_id"]
    daemon.finished([run_id])
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert daemon.get("/healthz").json() == {"ok": True}  # liveness only, without the token
    health = daemon.get("/healthz", bearer).json()
    assert health["queued"] == 0 and health["last_run"]["run_id"] == run_id
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}):
        for path in ("/runs", f"/runs/{run_id}"):
            answer = daemon.get(path, headers)
            assert answer.status == 401 and answer.headers["www-authenticate"].startswith("Bearer")
    runs = daemon.get("/runs", bearer).json()["runs"]
    assert [(r["run_id"], r["outcome"], r["delivery"], r["verified"]) for r in runs] == [
        (run_id, "no_action", "read-1", "ok")]
    assert re.fullmatch(r"[0-9]+:[0-9a-f]{64}", runs[0]["head"]) and runs[0]["started"].startswith("20")
    assert runs[0]["tokens"] is None and runs[0]["tokens_source"] is None  # a passing repo: no model call
    events = daemon.get(f"/runs/{run_id}", bearer).json()
    assert events["verified"] and [e["kind"] for e in events["events"]][0] == "run_started"
    (serve.runs / "secret.txt").write_text("not for you")
    for path in ("/runs/../daemon.jsonl", "/runs/..%2fdaemon.jsonl", "/runs/%2e%2e/secret.txt",
                 f"/runs/{run_id}/../../secret.txt", f"/runs/{run_id}/events.jsonl", "/runs/20261130T000000.000000Z-00000000",
                 "/runs/" + "9" * 500):
        answer = daemon.get(path, bearer)
        assert answer.status == 404 and b"not for you" not in answer.body, path
    assert len(daemon.payloads("read_rejected")) == 8
    index = serve.runs / "index.jsonl"  # the index anchors every run: broken, it vouches for none
    index.write_bytes(index.read_bytes() + b"garbage\n")
    answer = daemon.get("/runs", bearer)
    assert answer.status == 500 and b"ok" not in answer.body
    assert "index.jsonl" in daemon.payloads("daemon_error")[-1]["message"]


def test_the_timeline_page_shows_every_value_escaped(serve, server):
    notes = "<script>alert(1)</script> and <img src=x onerror=alert(1)>"
    repo = make_repo(serve.tmp / "xss-repo", extra={"notes.html": notes})
    failing = tools_json(serve.tmp / "failing.json", "import sys; print('<script>alert(0)</script>'); sys.exit(1)",
                         budget={"max_steps": 3})
    daemon = serve(repo=repo, tools=failing)
    server.queue(*[{"name": "ok", "answer": a} for a in (
        json.dumps({"tool": "read_file", "args": {"path": "notes.html"}, "reason": "look"}),
        "<script>alert(2)</script> I will not answer in JSON",
        json.dumps({"tool": "list_files", "args": {}, "reason": "<img src=x onerror=alert(3)>"}))])
    body = push_body()
    run_id = daemon.post(body, github_headers(body, delivery="xss-1")).json()["run_id"]
    assert daemon.finished([run_id])[run_id]["outcome"] == "budget_exhausted"
    page = daemon.get(f"/runs/{run_id}", {"Accept": "text/html,application/xhtml+xml"})
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    text = page.body.decode()

    page_root = parse_html(text)
    nodes = list(page_root.walk())
    assert not [n.tag for n in nodes if n.tag in ("script", "img")]
    assert not [(n.tag, name) for n in nodes for name in n.attrs if name.startswith("on")]
    shown = page_root.text()
    for value in ("<script>alert(0)</script>", "<script>alert(1)</script>", "<script>alert(2)</script>",
                  "<img src=x onerror=alert(3)>"):
        assert value in shown  # shown as text
    for kind in ("tests_run", "model_proposed", "tool_allowed", "tool_result", "proposal_malformed",
                 "budget_exhausted", "run_closed"):
        assert f"<td>{kind}</td>" in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    as_json = daemon.get(f"/runs/{run_id}", {"Accept": "application/json"})
    assert as_json.headers["content-type"] == "application/json" and as_json.json()["run_id"] == run_id


# ----------------------------------------------------------------------------
# Secrets, the access log, configuration
# ----------------------------------------------------------------------------

def test_secrets_never_reach_the_disk_or_stderr(serve):
    env_secret = "env-webhook-secret-0123456789abcdef"
    daemon = serve(env={"WEBHOOK_SECRET": env_secret, "READ_TOKEN": TOKEN})
    body = push_body(note=f"a body that quotes {SECRET} and {env_secret}")
    accepted = daemon.post(body, github_headers(body, delivery="s-1"))
    assert accepted.status == 202
    other = push_body(number=2)
    assert daemon.post(other, github_headers(other, delivery="s-2", secret=env_secret)).status == 202  # rotation
    assert daemon.post(other, github_headers(other, delivery="s-1")).status == 200
    assert daemon.post(other, github_headers(other, secret="not-the-secret-0123456789")).status == 401
    assert daemon.get("/runs?token=" + TOKEN, {"Authorization": f"Bearer {TOKEN}"}).status == 200
    daemon.finished([p["run_id"] for p in daemon.payloads("webhook_received")])
    assert daemon.stop() == 0
    disk = all_bytes_under(serve.runs)
    stderr = daemon.stderr().encode()
    for secret in (SECRET, VECTOR_SECRET, STANDARD_SECRET, env_secret, TOKEN, KEY):
        assert secret.encode() not in disk and secret.encode() not in stderr, secret
    received = daemon.payloads("webhook_received")[0]
    assert received["body_sha256"] == hashlib.sha256(body).hexdigest()  # of the body as it came
    assert b"[REDACTED]" in (serve.runs / received["body_artifact"]["path"]).read_bytes()  # stored masked


def test_the_access_log_is_one_line_a_request_without_secrets_or_queries(serve):
    daemon = serve()
    body = push_body()
    daemon.post(body, github_headers(body, delivery="log-1"))
    daemon.post(body, {"Content-Type": "application/json"})
    daemon.get("/healthz?token=abc&x=1")
    raw_exchange(daemon.port, b"GET /runs/\x1b[2J HTTP/1.1\r\n\r\n")
    assert daemon.stop() == 0
    lines = [line for line in daemon.stderr().splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 4, lines
    pattern = r"127\.0\.0\.1 (GET|POST) \S+ [0-9]{3} [0-9]+ [0-9]+\.[0-9] \S+"
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    # a line is written once its answer is sent, so two requests in a row may log in either order
    assert sum(line.startswith("127.0.0.1 POST /webhook 202 ") and line.endswith(" log-1") for line in lines) == 1
    assert sum(line.startswith("127.0.0.1 POST /webhook 401 ") for line in lines) == 1
    assert sum(line.startswith("127.0.0.1 GET /healthz 200 ") for line in lines) == 1
    assert "token" not in daemon.stderr() and "\x1b" not in daemon.stderr()
    assert sum(line.startswith("127.0.0.1 GET /runs/\\x1b[2J ") for line in lines) == 1


def test_configuration_errors_stop_the_daemon_before_it_listens(serve, tmp_path):
    repo = make_repo(tmp_path / "cfg-repo")
    tools = tools_json(tmp_path / "cfg-tools.json")
    base = clean_env(BASE_URL="http://127.0.0.1:9/v1", API_KEY=KEY, MODEL_ID="m")

    def fails(*args, env=base, code=2):
        proc = run_script("daemon.py", "--repo", repo, "--port", "0", "--runs-dir", tmp_path / "cfg-runs",
                          "--tools", tools, *args, env=env)
        assert proc.returncode == code and proc.out == "", (proc.out, proc.err)
        (line,) = error_lines(proc.err)
        return line

    assert "not a loopback address, without a webhook secret" in fails("--host", "0.0.0.0")
    assert "whsec_" in fails(env=dict(base, WEBHOOK_SECRET="whsec_not base64!"))
    assert "at least 8 characters" in fails(env=dict(base, WEBHOOK_SECRET="short"))
    assert "BASE_URL" in fails(env=clean_env(WEBHOOK_SECRET=SECRET))
    assert "at least 16 characters" in fails("--read-token", "short")
    assert "--queue must be at least 1" in fails("--queue", "0")
    assert "user name or password" in fails("--ship-to", "http://user:pw@127.0.0.1:8123")
    assert "WEBHOOK_SECRET_FILE" in fails(env=dict(base, WEBHOOK_SECRET_FILE=str(tmp_path / "missing")))
    (tmp_path / "huge").write_bytes(b"s" * 40 + b"\n" * 70000)  # a secret, then more than a secrets file holds
    assert "WEBHOOK_SECRET_FILE: larger than 65536 bytes" in fails(env=dict(base, WEBHOOK_SECRET_FILE=str(
        tmp_path / "huge")))
    assert "WEBHOOK_SECRET_FILE: larger than" in fails(env=dict(base, WEBHOOK_SECRET_FILE="/dev/zero"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in fails("--port", port)
    assert not (tmp_path / "cfg-runs" / "daemon.jsonl").exists()
    daemon = serve()  # one daemon per runs directory
    proc = run_script("daemon.py", "--repo", serve.tmp / "repo", "--port", "0", "--runs-dir", serve.runs,
                      "--tools", tools, env=dict(base, WEBHOOK_SECRET=SECRET))
    assert proc.returncode == 6 and "another daemon serves" in proc.err
    assert daemon.get("/healthz").status == 200


def test_secret_files_are_absent_in_the_judges_box_under_the_daemon(serve, server):
    """Issue 24 under the daemon: WEBHOOK_SECRET_FILE (the daemon reads it; the run and the judge are started
    without it) and a file standing for /etc/reasoning-ledger/agent.env, both 0600 in a directory outside
    the repository, $HOME and /tmp. The model's patch fixes calc.py and, at import time in the judge's box,
    prints both files hex-encoded: neither file's bytes nor their hex land under the runs directory."""
    import shutil
    import tempfile

    import test_agent
    from test_sandbox import need_bwrap, secret_file, theft
    need_bwrap()
    base = Path(tempfile.mkdtemp(prefix=".daemon-box-test-", dir=ROOT))  # outside /tmp and $HOME
    try:
        os.chmod(base, 0o755)
        etc = base / "etc-reasoning-ledger"
        env_file, hooks = etc / "agent.env", etc / "webhook-secrets"
        secrets = [secret_file(env_file)]
        hooks.write_bytes((serve.tmp / "webhook-secrets").read_bytes())  # the fixture's secrets: pushes still sign
        hooks.chmod(0o600)
        secrets.append(hooks.read_bytes())
        repo = test_agent.make_repo(base / "repo")  # test_add fails: the model is asked for a patch
        tools = conftest.tools_json(base / "tools.json", test_command=[sys.executable, "-m", "pytest", "-q", "-s"],
                                    sandbox="required", judge={"tripwires_off": ["*"]})
        server.queue({"name": "ok", "answer": test_agent.propose(theft([env_file, hooks]))})
        daemon = serve(repo=repo, tools=tools, env={"WEBHOOK_SECRET_FILE": str(hooks)})
        body = push_body()
        answer = daemon.post(body, github_headers(body, delivery="box-24"))
        assert answer.status == 202, answer.body
        run_id = answer.json()["run_id"]
        finished = daemon.finished([run_id])[run_id]
        assert finished["outcome"] in ("proposal_accepted", "proposal_rejected_by_judge"), (finished,
                                                                                            daemon.stderr())
        events = run_events(serve.runs, run_id)
        verdict = [e["payload"] for e in events if e["kind"] == "judge_verdict"][-1]
        assert verdict["sandbox"] == "bwrap", verdict
        output = (serve.runs / run_id / verdict["output_artifact"]["path"]).read_text()
        assert output.count("UNREADABLE") == 2, output  # the theft ran in the judge's box, and read nothing
        assert daemon.stop() == 0
        blob = all_bytes_under(serve.runs) + daemon.stderr().encode()
        for data in secrets:
            assert data not in blob and data.hex().encode() not in blob, "a secret file's bytes landed in the run"
    finally:
        shutil.rmtree(base, ignore_errors=True)
