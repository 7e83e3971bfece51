#!/usr/bin/env python3
"""bench_daemon.py -- the webhook daemon's accept path against a bare http.server handler, on loopback.

Usage:
  python tests/bench_daemon.py           # quick: 4 client threads x 200 signed POSTs to each server
  python tests/bench_daemon.py --full    # 8 threads x 500, three rounds, medians
  from bench_daemon import bench; rows = bench(quick=True)   # [(name, value, target, note)]

Both servers get the same loop: N client threads, each sending its share of signed GitHub push deliveries,
one connection per request (the daemon answers every request with Connection: close; so does the bare
handler). The daemon records each delivery (body artifact and ledger line, fsync'd) before its 202, while a
run it dispatched is executing (its test command sleeps). The bare handler reads the body and answers 200.
Every loop has a fixed number of requests; nothing here asserts a time.
"""

import hashlib
import hmac
import http.client
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-webhook-secret-0123456789"


class _Bare(BaseHTTPRequestHandler):
    """The baseline: read the body, answer 200, nothing else."""
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"{}\n"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


def _repo(root):
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b", GIT_COMMITTER_NAME="b",
               GIT_COMMITTER_EMAIL="b@b")
    root.mkdir()
    (root / "x.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "init"]):
        subprocess.run(["git", "-C", str(root), *args], check=True, env=env, capture_output=True, timeout=60)
    return root


def _tools(path):
    """tools.json whose test command sleeps: the first run executes for the whole measurement."""
    data = json.loads((ROOT / "tools.json").read_text())
    data["test_command"] = [sys.executable, "-c", "import time; time.sleep(600)"]
    path.write_text(json.dumps(data))
    return path


def _start_daemon(work, queue):
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(WEBHOOK_SECRET=SECRET, BASE_URL="http://127.0.0.1:9/v1", API_KEY="sk-bench-0123456789",
               MODEL_ID="bench-model", AGENT_LOCK_DIR=str(work / "locks"), PYTHONDONTWRITEBYTECODE="1")
    env.pop("WEBHOOK_SECRET_FILE", None)
    env.pop("READ_TOKEN", None)
    err = open(work / "daemon.err", "wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "daemon.py"), "--repo", str(_repo(work / "repo")),
                             "--port", "0", "--runs-dir", str(work / "runs"), "--tools", str(_tools(work / "t.json")),
                             "--queue", str(queue), "--grace-s", "0"], stdout=subprocess.PIPE, stderr=err, env=env)
    err.close()
    ready, _w, _x = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("serving on http://127.0.0.1:"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the daemon did not start: {line!r} {(work / 'daemon.err').read_text()[-2000:]}")
    return proc, int(line.rsplit(":", 1)[1])


def _stop_daemon(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def _post(port, body, headers):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/webhook", body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _signed(tag, i):
    body = json.dumps({"ref": "refs/heads/main", "after": "0" * 40, "n": i, "tag": tag}).encode()
    return body, {"Content-Type": "application/json", "X-GitHub-Event": "push", "X-GitHub-Delivery": f"{tag}-{i}",
                  "X-Hub-Signature-256": "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()}


def _load(port, tag, threads, per_thread):
    """threads x per_thread POSTs, each thread one after another. Returns (requests/s, latencies in ms,
    statuses)."""
    latencies, statuses, lock = [], {}, threading.Lock()
    requests = [[_signed(tag, t * per_thread + i) for i in range(per_thread)] for t in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def client(mine):
        barrier.wait(timeout=60)
        for body, headers in mine:
            started = time.perf_counter()
            try:
                status = _post(port, body, headers)
            except OSError as exc:
                status = type(exc).__name__
            took = (time.perf_counter() - started) * 1000
            with lock:
                latencies.append(took)
                statuses[status] = statuses.get(status, 0) + 1

    workers = [threading.Thread(target=client, args=(mine,), daemon=True) for mine in requests]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=60)
    started = time.perf_counter()
    for worker in workers:
        worker.join(600)
    wall = time.perf_counter() - started
    return len(latencies) / wall, latencies, statuses


def _p99(latencies):
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def _wait_running(port, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/healthz")
            if json.loads(conn.getresponse().read()).get("running"):
                return True
        finally:
            conn.close()
        time.sleep(0.1)
    return False


def bench(quick=True):
    """Measure both servers with the same bounded loop. Returns rows (name, value, target, note)."""
    threads, per_thread, rounds = (4, 200, 1) if quick else (8, 500, 3)
    work = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    bare = ThreadingHTTPServer(("127.0.0.1", 0), _Bare)
    bare.daemon_threads = True
    threading.Thread(target=bare.serve_forever, daemon=True).start()
    proc = None
    try:
        proc, port = _start_daemon(work, queue=threads * per_thread * (rounds + 1) + 10)
        _post(port, *_signed("first", 0))  # the run that executes while we measure
        running = _wait_running(port)
        _load(port, "warm", threads, 20)
        _load(bare.server_address[1], "warm", threads, 20)
        measured = {"daemon": [], "bare": []}
        for r in range(rounds):  # alternating, so a noisy neighbour hits both alike
            measured["bare"].append(_load(bare.server_address[1], f"bare{r}", threads, per_thread))
            measured["daemon"].append(_load(port, f"daemon{r}", threads, per_thread))
    finally:
        if proc is not None:
            _stop_daemon(proc)
        bare.shutdown()
        bare.server_close()
        shutil.rmtree(work, ignore_errors=True)
    rps = {k: statistics.median(m[0] for m in v) for k, v in measured.items()}
    p99 = {k: statistics.median(_p99(m[1]) for m in v) for k, v in measured.items()}
    statuses = {k: sorted({s for m in v for s in m[2]}, key=str) for k, v in measured.items()}
    load = f"{threads} threads x {per_thread} requests" + (f", median of {rounds} rounds" if rounds > 1 else "")
    busy = "a run executing" if running else "NO run was executing"
    return [
        ("/webhook requests/s, daemon vs bare http.server handler", rps["daemon"] / rps["bare"], "report",
         f"{rps['daemon']:.0f} vs {rps['bare']:.0f} req/s; {load}; statuses {statuses['daemon']} vs "
         f"{statuses['bare']}"),
        (f"/webhook p99 latency, ms ({busy})", p99["daemon"], "< 100 ms", f"bare handler: {p99['bare']:.1f} ms"),
        ("/webhook p99 latency, daemon vs bare", p99["daemon"] / p99["bare"], "report", ""),
    ]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    quick = "--full" not in argv
    print(f"daemon (bench_daemon.py, {'quick' if quick else 'full'}):", flush=True)
    for name, value, target, note in bench(quick=quick):
        print(f"  {name:<62} {value:8.2f}   (target {target}){'  ' + note if note else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
