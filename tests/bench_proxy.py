"""bench_proxy.py -- what `proxy.py` adds to a call, against direct calls to the same instant local upstream,
measured in the same run (`python tests/bench.py proxy`, part of `make bench`).

Figures: the added latency per call (p50 and p99 of proxied minus direct, in ms), the added time to the first
streamed event (p50, ms), and the throughput of 8 concurrent keep-alive clients as a ratio to direct.
Targets (issue 19): p50 added <= 2 ms, TTFT added <= 5 ms, throughput >= 0.5x direct.
The Responses bridge (UPSTREAM_API=chat, issue 25): the median time of a /responses call carried to chat
completions, whole and streamed, as a ratio to the same chat call through the proxy and direct.
Issue 25: the added latency with --store-text against without, on an agent's growing conversation (each
call repeats the conversation and adds a question; the answer comes back in the next), goal <= 1.2x.
Issue 29 (the proxy keeps its upstream connections): added p50 <= 1 ms, 8-client throughput >= 0.6x direct;
with PEERS=1 (`make bench PEERS=1`), the same three figures for LiteLLM's proxy in front of the same
upstream, side by side: LiteLLM (LITELLM_SPEC) is installed into its own venv under the user's cache
directory ($XDG_CACHE_HOME or ~/.cache, reasoning-ledger/), made only then, and run offline (its cost map,
blog posts and templates local, no telemetry, any other address behind an unreachable HTTP proxy).
"""

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fake_upstream import Upstream
from proxy_helpers import Proxy

BODY = json.dumps({"model": "up-model", "messages": [{"role": "user", "content": "2+2?"}]}).encode()
STREAM = json.dumps({"model": "up-model", "stream": True, "messages": [{"role": "user", "content": "2+2?"}]}).encode()
LITELLM_SPEC = "litellm[proxy]==1.108.7"
PEER_KEY = "sk-bench-" + os.urandom(16).hex()  # LiteLLM's master key; the others ignore it
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer " + PEER_KEY}


def _call(conn, body=BODY):
    conn.request("POST", "/v1/chat/completions", body=body, headers=HEADERS)
    response = conn.getresponse()
    response.read()
    assert response.status == 200, response.status


def _latencies(ports, n):
    """Per port, n call times in ms, the ports taken in turn so that the box's noise hits each alike."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for port in ports]
    samples = [[] for _ in ports]
    for i in range(n + 1):
        for conn, out in zip(conns, samples):
            started = time.perf_counter()
            _call(conn)
            if i:  # the first warms the connection, the proxy's thread and its opener
                out.append((time.perf_counter() - started) * 1000)
    return samples


def _ttfts(ports, n):
    """Per port, n times (ms) from sending a streamed request to reading its first text event."""
    samples = [[] for _ in ports]
    for i in range(n + 1):
        for port, out in zip(ports, samples):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            started = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body=STREAM, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            while b'"content"' not in response.readline():
                pass
            if i:
                out.append((time.perf_counter() - started) * 1000)
            response.read()
            conn.close()
    return samples


def _throughput(port, clients, per_client, fresh=False):
    """Calls per second of `clients` threads; `fresh`: a new connection per call (what the proxy's
    upstream side does: ask.py's transport sends Connection: close)."""
    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for _ in range(per_client):
            _call(conn)
            if fresh:
                conn.close()
        conn.close()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clients * per_client / (time.perf_counter() - started)


def _conversation_latencies(ports, n):
    """Per port, n call times (ms) of one growing conversation, each port sent the same body in turn."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for port in ports]
    samples, messages = [[] for _ in ports], [{"role": "system", "content": "You are a coding agent. " * 40}]
    for i in range(n + 1):
        messages.append({"role": "user", "content": f"step {i}: the tool said " + "output line\n" * 20})
        body = json.dumps({"model": "up-model", "messages": messages}).encode()
        for conn, out in zip(conns, samples):
            started = time.perf_counter()
            _call(conn, body)
            if i:
                out.append((time.perf_counter() - started) * 1000)
        messages.append({"role": "assistant", "content": "The answer is 4."})
    return samples


def _store_text_rows(upstream, direct, n):
    rows = []
    for label, args in (("", ()), (", --no-fsync", ("--no-fsync",))):
        with tempfile.TemporaryDirectory() as tmp:
            proxies = [Proxy(upstream.base_url, Path(tmp) / name, *args, *more)
                       for name, more in (("plain.jsonl", ()), ("text.jsonl", ("--store-text",)))]
            try:
                base, plain, text = map(statistics.median, _conversation_latencies(
                    [direct] + [proxy.port for proxy in proxies], n))
            finally:
                for proxy in proxies:
                    proxy.stop()
        rows.append((f"proxy --store-text{label}: added latency vs without, growing conversation",
                     (text - base) / (plain - base), "<= 1.2",
                     f"added p50 {text - base:.2f} vs {plain - base:.2f} ms; direct {base:.2f} ms"))
    return rows


def _p(samples, q):
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def bench(quick=True):
    n, ttft_n, per_client = (300, 60, 40) if quick else (2000, 300, 200)
    upstream = Upstream().start()
    direct = int(upstream.base_url.split(":")[2].split("/")[0])
    rows = []
    try:
        for label, args in (("", ()), (", --no-fsync", ("--no-fsync",))):
            with tempfile.TemporaryDirectory() as tmp:
                proxy = Proxy(upstream.base_url, Path(tmp) / "calls.jsonl", *args)
                try:
                    plain, proxied = _latencies((direct, proxy.port), n)
                    ttft_plain, ttft_proxied = _ttfts((direct, proxy.port), ttft_n)
                    rates = [(_throughput(direct, 8, per_client), _throughput(proxy.port, 8, per_client),
                              _throughput(direct, 8, per_client, fresh=True)) for _ in range(3)]
                finally:
                    proxy.stop()
            rate = statistics.median(p / d for d, p, _f in rates)
            rows += [
                (f"proxy{label}: added latency per call, p50 (ms)",
                 statistics.median(proxied) - statistics.median(plain), "<= 1",
                 f"direct {statistics.median(plain):.2f} ms"),
                (f"proxy{label}: added latency per call, p99 (ms)", _p(proxied, 99) - _p(plain, 99), "report",
                 f"direct {_p(plain, 99):.2f} ms"),
                (f"proxy{label}: added streaming time to first event, p50 (ms)",
                 statistics.median(ttft_proxied) - statistics.median(ttft_plain), "<= 5",
                 f"direct {statistics.median(ttft_plain):.2f} ms"),
                (f"proxy{label}: throughput, 8 keep-alive clients, vs direct", rate, ">= 0.6",
                 f"{statistics.median(r[1] for r in rates):.0f} vs {statistics.median(r[0] for r in rates):.0f} "
                 f"calls/s"),
                (f"proxy{label}: the same vs direct with a new connection per call", statistics.median(
                    p / f for _d, p, f in rates), "report", f"direct {statistics.median(r[2] for r in rates):.0f} "
                 f"calls/s"),
            ]
        rows += _store_text_rows(upstream, direct, n // 2)
    finally:
        upstream.stop()
    return rows + bench_bridge(quick) + (bench_peers(quick) if os.environ.get("PEERS") == "1" else [])


RESPONSES = json.dumps({"model": "up-model", "input": [{"role": "user", "content": "2+2?"}]}).encode()


def _timed(targets, n):
    """Per (port, path, body), n call times in ms, taken in turn; the first round warms up."""
    samples = [[] for _ in targets]
    conns = {port: http.client.HTTPConnection("127.0.0.1", port, timeout=60) for port, _, _ in targets}
    for i in range(n + 1):
        for (port, path, body), out in zip(targets, samples):
            started = time.perf_counter()
            conns[port].request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conns[port].getresponse()
            response.read()
            assert response.status == 200, response.status
            if i:
                out.append((time.perf_counter() - started) * 1000)
    return [statistics.median(s) for s in samples]


def bench_bridge(quick=True):
    """UPSTREAM_API=chat: a Responses call carried to chat completions, against the same chat call
    direct and through the same proxy, whole and streamed (the answer read to its end)."""
    n = 200 if quick else 1000
    upstream = Upstream().start()
    direct = int(upstream.base_url.split(":")[2].split("/")[0])
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            proxy = Proxy(upstream.base_url, Path(tmp) / "calls.jsonl", UPSTREAM_API="chat")
            try:
                for label, extra in (("whole", {}), ("streamed", {"stream": True})):
                    chat, responses = (json.dumps(dict(json.loads(b), **extra)).encode() for b in (BODY, RESPONSES))
                    plain, proxied, bridged = _timed(((direct, "/v1/chat/completions", chat),
                                                      (proxy.port, "/v1/chat/completions", chat),
                                                      (proxy.port, "/v1/responses", responses)), n)
                    rows += [
                        (f"bridge, {label}: /responses vs /chat/completions, both proxied", bridged / proxied,
                         "report", f"{bridged:.2f} vs {proxied:.2f} ms"),
                        (f"bridge, {label}: /responses vs /chat/completions direct", bridged / plain, "report",
                         f"{bridged:.2f} vs {plain:.2f} ms"),
                    ]
            finally:
                proxy.stop()
    finally:
        upstream.stop()
    return rows

if __name__ == "__main__":
    for row in bench():
        print("  %-62s %6.2f   (target %s)  %s" % row)


# ----------------------------------------------------------------------------
# PEERS=1: LiteLLM's proxy in front of the same instant upstream
# ----------------------------------------------------------------------------

def _litellm():
    """The litellm command of a venv of its own (made on first use), or raises RuntimeError."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = cache / "reasoning-ledger" / ("venv-" + LITELLM_SPEC.replace("[proxy]==", "-"))
    command = venv / "bin" / "litellm"
    if not command.exists():
        print(f"  (installing {LITELLM_SPEC} into {venv})", flush=True)
        for step in ([sys.executable, "-m", "venv", str(venv)],
                     [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", LITELLM_SPEC]):
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(step[:3])} failed: {(done.stderr or done.stdout).strip()[-300:]}")
    return command


class _LiteLLM:
    """`litellm --config` in front of `base_url` on a free loopback port, offline."""

    def __init__(self, command, base_url, workdir):
        config = Path(workdir) / "litellm.yaml"
        config.write_text("model_list:\n  - model_name: up-model\n    litellm_params:\n"
                          f"      model: openai/up-model\n      api_base: {base_url}\n      api_key: sk-upstream\n"
                          "litellm_settings:\n  telemetry: false\n")
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            self.port = free.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(LITELLM_MASTER_KEY=PEER_KEY, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOCAL_BLOG_POSTS="True",
                   LITELLM_LOCAL_POLICY_TEMPLATES="True", LITELLM_LOCAL_AUTOROUTER_PRESETS="True",
                   LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS="True", DISABLE_ADMIN_UI="True", DISABLE_SCHEMA_UPDATE="True",
                   # anything it still tries to reach beyond loopback fails at once
                   HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="127.0.0.1,localhost")
        self.log = open(Path(workdir) / "litellm.log", "w")
        self.proc = subprocess.Popen([str(command), "--config", str(config), "--host", "127.0.0.1", "--port",
                                      str(self.port), "--telemetry", "False"], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=workdir)
        ends = time.monotonic() + 300  # a guard: it starts in 5-20 s here
        while time.monotonic() < ends and self.proc.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health/liveliness")
                response = conn.getresponse()
                response.read()
                if response.status == 200:
                    _call(conn)  # its first call loads what calls need
                    return
            except (OSError, http.client.HTTPException):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("LiteLLM did not start: see " + self.log.name)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bench_peers(quick=True):
    """proxy.py and LiteLLM's proxy against the same instant keep-alive upstream, measured in turn:
    added p50 and p99 against direct calls, and 8 keep-alive clients' throughput against direct."""
    n, per_client = (300, 40) if quick else (1000, 100)
    try:
        command = _litellm()
    except RuntimeError as exc:
        print(f"  LiteLLM: not measured ({exc})")
        return []
    upstream = Upstream().start()
    direct = int(upstream.base_url.split(":")[2].split("/")[0])
    with tempfile.TemporaryDirectory() as tmp:
        proxy = Proxy(upstream.base_url, Path(tmp) / "calls.jsonl")
        try:
            peer = _LiteLLM(command, upstream.base_url, tmp)
        except RuntimeError as exc:
            print(f"  LiteLLM: not measured ({exc})")
            proxy.stop()
            upstream.stop()
            return []
        try:
            plain, ours, theirs = _latencies((direct, proxy.port, peer.port), n)
            rates = [[_throughput(port, 8, per_client) for port in (direct, proxy.port, peer.port)]
                     for _ in range(3)]
        finally:
            peer.stop()
            proxy.stop()
            upstream.stop()
    added = {q: [_p(s, q) - _p(plain, q) for s in (ours, theirs)] for q in (50, 99)}
    ratio = [statistics.median(r[i] / r[0] for r in rates) for i in (1, 2)]
    name = LITELLM_SPEC.split("==")[0].split("[")[0] + " " + LITELLM_SPEC.split("==")[1]
    return [
        ("peers: added latency p50 (ms), proxy.py | LiteLLM", added[50][0], "< LiteLLM",
         f"{name} {added[50][1]:.2f} ms; direct {_p(plain, 50):.2f} ms"),
        ("peers: added latency p99 (ms), proxy.py | LiteLLM", added[99][0], "< LiteLLM",
         f"{name} {added[99][1]:.2f} ms; direct {_p(plain, 99):.2f} ms"),
        ("peers: 8-client throughput vs direct, proxy.py | LiteLLM", ratio[0], "> LiteLLM",
         f"{name} {ratio[1]:.2f}; direct {statistics.median(r[0] for r in rates):.0f} calls/s"),
    ]
