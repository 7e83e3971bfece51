#!/usr/bin/env python3
"""bench.py -- `make bench`: speed as ratios against baselines measured in the same run.

Usage:
  python tests/bench.py [ledger] [ask] [audit] [parallel] [agent] [daemon] [ship] [sandbox] [proxy] [transcripts]
    [checkpoints]  # default: all
  BENCH_LINES=1000000 python tests/bench.py                            # the full figures (default 100,000)
  BENCH_KEEP=1 python tests/bench.py ledger                            # keep .bench/ (the big ledger) afterwards
  PEERS=1 python tests/bench.py proxy                                  # LiteLLM's proxy beside proxy.py (its venv: ~/.cache)

Each figure is a ratio of two medians taken in this run on this machine, so a noisy shared box
moves both sides alike. Nothing here asserts a time; it prints what it measured. The figures and what
they mean are in tests/BENCH.md. The big files are removed at the end unless BENCH_KEEP=1.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import reasoning_ledger as rl  # noqa: E402

BENCH_DIR = ROOT / ".bench"
BIG_LINES = int(os.environ.get("BENCH_LINES", "100000"))
PAYLOAD = {
    "request_model": "vendor/free-model-7b", "response_model": "vendor/free-model-7b-0612",
    "response_id": "chatcmpl-123", "system_fingerprint": "fp_44709d6fcb",
    "base_url": "https://llm.example.net/v1", "server_address": "llm.example.net", "server_port": 443,
    "stream": False, "attempt": 1,
    "prompt_sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "prompt_chars": 512, "response_chars": 1800, "usage_reported": True, "usage_status": "complete",
    "input_tokens": 130, "output_tokens": 450, "total_tokens": 580, "cached_input_tokens": None,
    "reasoning_output_tokens": None, "est_input_tokens": 128, "est_output_tokens": 450,
    "est_method": "chars/4", "latency_ms": 1234.5, "ttft_ms": None, "http_status": 200,
    "finish_reason": "stop", "request_id": "req_abc", "ratelimit": {}, "error_type": None,
    "error_message": None, "check": True, "check_detail": "matched /\\d+/",
}


def _median_time(fn, repeat):
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _line(name, ratio, target, note=""):
    print(f"  {name:<62} {ratio:6.2f}   (target {target}){'  ' + note if note else ''}")


# ----------------------------------------------------------------------------
# The big ledger (built once, reused while its size matches)
# ----------------------------------------------------------------------------

def big_ledger(lines=BIG_LINES):
    """A ledger of `lines` model_call events for three model strings, written through the real writer."""
    path = BENCH_DIR / f"big-{lines}.jsonl"
    if path.exists():
        return path
    BENCH_DIR.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    if tmp.exists():
        tmp.unlink()
    print(f"  building a {lines:,}-line ledger at {path} (once) ...", flush=True)
    models = ["vendor/free-model-7b", "vendor/coder-32b", "other/tiny-1b"]
    with rl.Ledger(tmp, "bench", fsync=False, key=b"") as ledger:
        for i in range(lines):
            payload = dict(PAYLOAD)
            payload["request_model"] = models[i % 3]
            payload["latency_ms"] = 200.0 + (i * 7919) % 3000
            payload["usage_reported"] = i % 10 != 0
            ledger.append("model_call", payload)
    tmp.rename(path)
    return path


# ----------------------------------------------------------------------------
# Ledger
# ----------------------------------------------------------------------------

def bench_ledger():
    print("ledger")
    work = Path(tempfile.mkdtemp(dir=BENCH_DIR))
    try:
        ledger_path, raw_path = work / "ledger.jsonl", work / "raw.jsonl"
        ledger = rl.Ledger(ledger_path, "bench", key=b"")
        sample = rl.dumps(ledger.append("model_call", PAYLOAD)).encode() + b"\n"
        raw_fd = os.open(str(raw_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

        def raw_batch():
            for _ in range(200):
                os.write(raw_fd, sample)
                os.fsync(raw_fd)

        def ledger_batch():
            for _ in range(200):
                ledger.append("model_call", PAYLOAD)

        def threads_batch():  # group commit: 8 writers share fsyncs, 200 lines in all
            threads = [threading.Thread(target=lambda: [ledger.append("model_call", PAYLOAD)
                                                        for _ in range(25)]) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        raw_t, led_t, group_t = [], [], []
        for _ in range(7):  # interleaved, so drift on a shared box hits both
            raw_t.append(_median_time(raw_batch, 1))
            led_t.append(_median_time(ledger_batch, 1))
            group_t.append(_median_time(threads_batch, 1))
        os.close(raw_fd)
        ledger.close()
        raw_med, led_med = statistics.median(raw_t), statistics.median(led_t)
        _line("append+fsync throughput vs raw os.write+os.fsync", raw_med / led_med, ">= 0.6",
              f"{led_med / 200 * 1e6:.0f} us vs {raw_med / 200 * 1e6:.0f} us per line")
        group_med = statistics.median(group_t)
        _line("8 threads appending (group commit) vs one raw os.write+os.fsync", raw_med / group_med,
              ">= 3", f"{group_med / 200 * 1e6:.0f} us per line")

        big = big_ledger()
        small = work / "small.jsonl"
        with rl.Ledger(small, "bench", key=b"") as seed:
            seed.append("model_call", PAYLOAD)

        def one_append(path):
            def run():
                with rl.Ledger(path, "bench", key=b"") as fresh:
                    fresh.append("model_call", PAYLOAD)
            return run

        copy = work / "big.jsonl"
        shutil.copyfile(big, copy)
        big_t, small_t = [], []
        for _ in range(5):
            big_t.append(_median_time(one_append(copy), 40))
            small_t.append(_median_time(one_append(small), 40))
        ratio = statistics.median(big_t) / statistics.median(small_t)
        _line(f"one append to a {BIG_LINES:,}-line ledger vs to a 1-line one", ratio, "<= 1.5")

        def loads_pass():
            loads = json.loads
            with open(big, "rb") as handle:
                for raw in handle:
                    loads(raw)

        def verify_pass(jobs):
            return lambda: rl.verify(big, key=b"", jobs=jobs)

        def floor_pass():  # what the format's strictness needs at the least: parse, re-encode, hash
            loads, sha256 = json.loads, __import__("hashlib").sha256
            dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
            with open(big, "rb") as handle:
                for raw in handle:
                    body = raw[:-1]
                    text = body.decode("utf-8")
                    dumps(loads(text)) == text
                    sha256(body).hexdigest()

        passes = {"loads": loads_pass, "floor": floor_pass, 1: verify_pass(1), 2: verify_pass(2), 4: verify_pass(4)}
        times = {name: [] for name in passes}
        for _ in range(3):  # interleaved rounds, so a load that comes and goes hits every figure alike
            for name, run in passes.items():
                times[name].append(_median_time(run, 1))
        base, ver, floor = (statistics.median(times[name]) for name in ("loads", 1, "floor"))
        _line("verify throughput vs bare json.loads per line", base / ver, ">= 0.6",
              f"{BIG_LINES / ver / 1e3:.0f}k lines/s")
        bench_parallel_verify(big, base, ver, times)
        _line("verify throughput vs bare parse + re-encode + sha256 per line", floor / ver, "(info)",
              "the least the v1 strictness costs")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_parallel_verify(big, base, one, times):
    """verify --jobs 2 and 4 against --jobs 1 (`one`) and json.loads (`base`); then where workers start
    to pay off, which sets rl.PARALLEL_BYTES."""
    cpus = os.cpu_count() or 1
    for jobs in (2, 4):
        took = statistics.median(times[jobs])
        _line(f"verify, {jobs} workers, vs bare json.loads per line", base / took,
              ">= 0.9 at 2", f"{one / took:.2f}x of 1 worker; {(one / took - 1) / (min(jobs, cpus) - 1):.2f} "
              f"of an ideal core per added core ({cpus} cpus)")
    small = BENCH_DIR / "parallel-bytes.jsonl"
    with open(big, "rb") as src, open(small, "wb") as dst:
        dst.writelines(line for line, _ in zip(src, range(rl.PARALLEL_BYTES * BIG_LINES // big.stat().st_size)))
    for size in (rl.PARALLEL_BYTES, rl.PARALLEL_BYTES // 4):
        with open(small, "r+b") as handle:  # the first `size` bytes, cut at a line's end
            handle.truncate(handle.read(size).rfind(b"\n") + 1)
        one_t, two_t = [], []
        for _ in range(7):
            one_t.append(_median_time(lambda: rl.verify(small, key=b"", jobs=1), 1))
            two_t.append(_median_time(lambda: rl.verify(small, key=b"", jobs=2), 1))
        one_t, two_t = statistics.median(one_t), statistics.median(two_t)
        _line(f"verify of {size >> 10} KiB, 2 workers vs 1", one_t / two_t,
              "> 1 at PARALLEL_BYTES", f"PARALLEL_BYTES is {rl.PARALLEL_BYTES >> 10} KiB")
    small.unlink()


# ----------------------------------------------------------------------------
# ask.py
# ----------------------------------------------------------------------------

FLOOR_CLIENT = r'''
import json, os, sys, urllib.request
body = json.dumps({"model": os.environ["MODEL_ID"],
                   "messages": [{"role": "user", "content": sys.stdin.read()}]}).encode()
req = urllib.request.Request(os.environ["BASE_URL"].rstrip("/") + "/chat/completions", data=body,
                             headers={"Content-Type": "application/json",
                                      "Authorization": "Bearer " + os.environ["API_KEY"]})
with urllib.request.urlopen(req, timeout=30) as resp:
    print(json.loads(resp.read())["choices"][0]["message"]["content"])
'''


def _run_median(cmd, env, stdin, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, env=env, input=stdin, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_ask():
    import fake_openai
    print("ask.py (whole process, against the local fake server)")
    work = Path(tempfile.mkdtemp(dir=BENCH_DIR))
    server = fake_openai.start()
    try:
        # As on a user's box: Python caches the scripts' bytecode in __pycache__ after the first run.
        # (This workplace exports PYTHONDONTWRITEBYTECODE=1; the cold figure is printed too.)
        env = {k: v for k, v in os.environ.items()
               if not k.lower().endswith("_proxy") and k != "PYTHONDONTWRITEBYTECODE"}
        env.update(BASE_URL=server.base_url, API_KEY="sk-bench-secret-000", MODEL_ID="fake-model",
                   LEDGER=str(work / "runs.jsonl"))
        prompt = b"What is 2 + 2? Answer with a number."
        floor_script = work / "floor.py"
        floor_script.write_text(FLOOR_CLIENT)
        ask_cmd = [sys.executable, str(ROOT / "ask.py")]
        floor_cmd = [sys.executable, str(floor_script)]
        cold_env = dict(env, PYTHONDONTWRITEBYTECODE="1")
        for cmd in (ask_cmd, floor_cmd):  # warm-up: bytecode cache, page cache
            _run_median(cmd, env, prompt, 1)
        ask_t, floor_t, cold_t, cold_floor_t = [], [], [], []
        for _ in range(5):
            ask_t.append(_run_median(ask_cmd, env, prompt, 5))
            floor_t.append(_run_median(floor_cmd, env, prompt, 5))
            cold_t.append(_run_median(ask_cmd, cold_env, prompt, 1))
            cold_floor_t.append(_run_median(floor_cmd, cold_env, prompt, 1))
        a, f = statistics.median(ask_t), statistics.median(floor_t)
        _line("python ask.py vs a bare urllib client (lower is better)", a / f, "<= 1.3",
              f"{a * 1e3:.0f} ms vs {f * 1e3:.0f} ms")
        ca, cf = statistics.median(cold_t), statistics.median(cold_floor_t)
        _line("  same, no bytecode cache (PYTHONDONTWRITEBYTECODE=1)", ca / cf, "report",
              f"{ca * 1e3:.0f} ms vs {cf * 1e3:.0f} ms")
        curl = shutil.which("curl")
        if curl:
            body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": prompt.decode()}]})
            curl_cmd = [curl, "-s", "-o", "/dev/null", "-H", "Content-Type: application/json",
                        "-H", "Authorization: Bearer sk-bench-secret-000", "-d", body,
                        server.base_url + "/chat/completions"]
            c = _run_median(curl_cmd, env, b"", 15)
            _line("python ask.py vs curl (information: interpreter start-up)", a / c, "report",
                  f"{c * 1e3:.0f} ms for curl")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------
# audit.py
# ----------------------------------------------------------------------------

def _peak_rss_mib(cmd):
    """Run cmd and return (seconds, peak RSS MiB of the child)."""
    import resource
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
    elapsed = time.perf_counter() - start
    return elapsed, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def bench_audit():
    print("audit.py")
    big = big_ledger()
    loads_cmd = [sys.executable, "-c",
                 "import json,sys\nfor l in open(sys.argv[1],'rb'): json.loads(l)", str(big)]
    audit_cmd = [sys.executable, str(ROOT / "audit.py"), str(big)]
    base_t, audit_t = [], []
    peak = 0.0
    for _ in range(3):
        base_t.append(_peak_rss_mib(loads_cmd)[0])
        elapsed, rss = _peak_rss_mib(audit_cmd)
        audit_t.append(elapsed)
        peak = max(peak, rss)
    b, a = statistics.median(base_t), statistics.median(audit_t)
    _line("audit.py vs a bare json.loads-per-line pass (lower is better)", a / b, "<= 1.5",
          f"{a:.1f} s vs {b:.1f} s")
    print(f"  {'audit.py peak RSS (MiB)':<62} {peak:6.0f}   (target < 200)")
    jq = shutil.which("jq")
    if jq:
        jq_prog = ('[.[] | select(.kind=="model_call") | .payload] | group_by(.request_model, .base_url) '
                   '| map({model: .[0].request_model, runs: length, ok: map(select(.error_type==null)) | length,'
                   ' input: map(.input_tokens // 0) | add, latency: (map(.latency_ms) | sort)})')
        jq_t = _peak_rss_mib([jq, "-s", jq_prog, str(big)])[0]
        _line("audit.py vs the jq -s group_by one-liner (lower is better)", a / jq_t, "< 1",
              f"{jq_t:.1f} s for jq")


# ----------------------------------------------------------------------------
# verify and audit across workers (issue 29): 1, 2 and 4 of them, at 100k lines and BENCH_LINES
# ----------------------------------------------------------------------------

JQ_GROUP_BY = ('[.[] | select(.kind=="model_call") | .payload] | group_by(.request_model, .base_url) '
               '| map({model: .[0].request_model, runs: length, ok: map(select(.error_type==null)) | length,'
               ' input: map(.input_tokens // 0) | add, latency: (map(.latency_ms) | sort)})')


def bench_parallel():
    """verify (in this process) and audit.py (a whole process) at --jobs 1, 2 and 4, each against one
    json.loads pass over the same file, and the gain per added core: (speed-up - 1) / (cores added),
    1.0 being ideal; cores beyond the box's count add nothing."""
    cpus = os.cpu_count() or 1
    print(f"verify and audit across workers ({cpus} cpus)")
    for lines in sorted({100000, BIG_LINES}):
        big = big_ledger(lines)
        loads_cmd = [sys.executable, "-c", "import json,sys\nfor l in open(sys.argv[1],'rb'): json.loads(l)",
                     str(big)]
        runs = {"loads": lambda: subprocess.run(loads_cmd, check=True)}
        for jobs in (1, 2, 4):
            runs[("verify", jobs)] = (lambda j: lambda: rl.verify(big, key=b"", jobs=j))(jobs)
            cmd = [sys.executable, str(ROOT / "audit.py"), str(big), "--jobs", str(jobs)]
            runs[("audit", jobs)] = (lambda c: lambda: subprocess.run(c, stdout=subprocess.DEVNULL, check=True))(cmd)
        jq = shutil.which("jq")
        if jq:
            runs["jq"] = lambda: subprocess.run([jq, "-s", JQ_GROUP_BY, str(big)], stdout=subprocess.DEVNULL,
                                                check=True)
        times = {name: [] for name in runs}
        for _ in range(3):  # interleaved rounds: a load that comes and goes hits every figure alike
            for name, run in runs.items():
                times[name].append(_median_time(run, 1))
        t = {name: statistics.median(values) for name, values in times.items()}
        base = t["loads"]
        for what, words, target in (("verify", "throughput", ">= 0.9 at 2"),
                                    ("audit", "time", "<= 1.5 at 2, lower is better")):
            for jobs in (1, 2, 4):
                took, gain = t[(what, jobs)], t[(what, 1)] / t[(what, jobs)]
                per_core = f"; {(gain - 1) / (min(jobs, cpus) - 1):.2f} of an ideal core per added core" \
                    if min(jobs, cpus) > 1 else ""
                _line(f"{what} {lines // 1000:,}k lines, {jobs} worker(s): {words} vs json.loads",
                      base / took if what == "verify" else took / base, target,
                      f"{took:.1f} s, {gain:.2f}x of 1 worker{per_core}")
        if jq:
            best = min(t[("audit", jobs)] for jobs in (1, 2, 4))
            _line(f"jq -s group_by vs the fastest audit.py, {lines // 1000:,}k lines", t["jq"] / best, ">= 2",
                  f"{t['jq']:.1f} s for jq")


# ----------------------------------------------------------------------------
# agent.py: the host's own overhead per step
# ----------------------------------------------------------------------------

BARE_LOOP = """
import json, subprocess, sys, time, urllib.request
url, steps = sys.argv[1], int(sys.argv[2])
messages = [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "u" * 3000}]
start = time.perf_counter()
for step in range(steps):
    body = json.dumps({"model": "stand-in-model", "messages": messages, "max_tokens": 2048}).encode()
    request = urllib.request.Request(url + "/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": "Bearer k"})
    with urllib.request.urlopen(request, timeout=30) as response:
        reply = json.loads(response.read())["choices"][0]["message"]["content"]
    output = subprocess.run(["true"], capture_output=True).stdout
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Result: " + output.decode()}]
print(time.perf_counter() - start)
"""


def _agent_repo(path):
    path.mkdir()
    (path / "test_x.py").write_text("import sys\nsys.exit(1)\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b", GIT_COMMITTER_NAME="b",
               GIT_COMMITTER_EMAIL="b@b")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env)


def bench_agent():
    """Per step, the host (ask.chat with its ledger lines, the policy check, model_proposed, tool_allowed,
    the tool run with its artifact and tool_result) against a bare loop making the same HTTP call and
    running the same subprocess. Steps are timed as the difference of a long and a short run, so the
    fixed cost of a run (the scratch copy, the baseline tests) drops out."""
    import fake_openai
    print("agent.py (per step: an instant stand-in model and a cheap tool)")
    work = Path(tempfile.mkdtemp(dir=BENCH_DIR))
    server = fake_openai.start()
    try:
        repo = work / "repo"
        _agent_repo(repo)
        tools = json.loads((ROOT / "tools.json").read_text())
        tools["test_command"] = [sys.executable, "test_x.py"]
        tools["plugins"] = {"noop": {"description": "does nothing", "argv": ["true"], "args": {}}}
        (work / "tools.json").write_text(json.dumps(tools))
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(BASE_URL=server.base_url, API_KEY="sk-bench-0000000000", MODEL_ID="stand-in-model")
        reply = json.dumps({"tool": "noop", "args": {}, "reason": "bench"})

        def host(steps):
            server.queue(*[{"name": "ok", "answer": reply}] * steps)
            start = time.perf_counter()
            subprocess.run([sys.executable, str(ROOT / "agent.py"), "run", "--repo", str(repo), "--runs-dir",
                            str(work / "runs"), "--tools", str(work / "tools.json"), "--max-steps", str(steps)],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            return time.perf_counter() - start

        def bare(steps):
            server.queue(*[{"name": "ok", "answer": reply}] * steps)
            out = subprocess.run([sys.executable, "-c", BARE_LOOP, server.base_url, str(steps)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            return float(out)

        few, many = 5, 5 + (60 if BIG_LINES >= 1000000 else 25)
        host_t, bare_t = [], []
        for _ in range(3):
            host_t.append((host(many) - host(few)) / (many - few))
            bare_t.append(bare(many) / many)
        h, b = statistics.median(host_t), statistics.median(bare_t)
        _line("host overhead per step vs a bare loop of the same calls (lower is better)", h / b, "<= 1.3",
              f"{h * 1e3:.1f} ms vs {b * 1e3:.1f} ms a step")
        started = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "tests" / "demo.py")], env={k: v for k, v in env.items() if k not in (
            "BASE_URL", "API_KEY", "MODEL_ID")}, stdout=subprocess.DEVNULL, check=False)
        _line("make demo, wall time in seconds (information)", time.perf_counter() - started, "< 10")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def bench_module(name):
    """A bench that lives in its own module (tests/bench_NAME.py), printed like the others."""
    module = __import__(f"bench_{name}")
    rows = module.bench(quick=BIG_LINES < 1000000)
    for row in rows:
        _line(*row)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    benches = {"ledger": bench_ledger, "ask": bench_ask, "audit": bench_audit,
               "parallel": bench_parallel, "agent": bench_agent,
               "daemon": lambda: bench_module("daemon"), "ship": lambda: bench_module("ship"),
               "sandbox": lambda: bench_module("sandbox"), "proxy": lambda: bench_module("proxy"),
               "transcripts": lambda: bench_module("transcripts"),
               "checkpoints": lambda: bench_module("checkpoints")}
    wanted = argv or list(benches)
    unknown = [name for name in wanted if name not in benches]
    if unknown:
        print(f"bench.py: unknown bench {', '.join(unknown)} (choose from {', '.join(benches)})", file=sys.stderr)
        return 2
    BENCH_DIR.mkdir(exist_ok=True)
    print(f"make bench: ratios of medians measured in this run (python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cpus, {BIG_LINES:,} lines)")
    try:
        for name in wanted:
            started = time.perf_counter()
            benches[name]()
            print(f"  ({name}: {time.perf_counter() - started:.0f} s)")
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(BENCH_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
