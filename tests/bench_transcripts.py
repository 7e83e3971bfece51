#!/usr/bin/env python3
"""bench_transcripts.py -- `transcripts.py import` speed (issue 27).

Usage:
  python tests/bench_transcripts.py [MB]   # default 100 MB of transcripts
  python tests/bench.py transcripts        # the same, printed with the other benches

bench(quick) returns rows (name, ratio, target, note), each ratio taken in this run:
  * importing MB megabytes of transcripts (Claude Code and Codex lines in the shapes the pinned CLIs
    write: prompts, assistant text and tool calls with usage, tool results with code and logs, 1 MB
    a file) vs a bare read of the same bytes with json.loads per line, both whole processes
    (goal <= 3);
  * a second import with nothing new, 1,000 files: its seconds (goal < 0.5 s), and the ratio to a
    bare process that stats the same files;
  * Redactor.text over the same lines vs every shape over every line (the path before its
    per-shape hints; the output is the same, tests/test_redaction.py).
Nothing is asserted; the files are written to a temp dir and removed.
"""

import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for entry in (str(ROOT), str(ROOT / "tests")):
    if entry not in sys.path:
        sys.path.insert(0, entry)

import reasoning_ledger as rl  # noqa: E402

CODE = (
    "def handler(request, context):\n    config = load_config(os.environ['APP_CONFIG'])\n"
    "    for item in request.items:\n        if item.kind == 'user':\n"
    "            result.append(process(item, timeout=30))\n    return {'status': 200, 'body': result}\n"
)
LOG = "2026-12-01 10:00:01 INFO worker started pid=4242 queue=default\n" * 8


def _claude_lines(rng, sid, n):
    base = {
        "parentUuid": None,
        "isSidechain": False,
        "userType": "external",
        "cwd": "/home/u/project",
        "sessionId": sid,
        "version": "2.1.332",
        "gitBranch": "main"
    }
    for i in range(n):
        at = "2026-12-01T10:%02d:%02d.%03dZ" % (i // 60 % 60, i % 60, i % 1000)
        roll = rng.random()
        if roll < 0.15:
            yield dict(
                base,
                type="user",
                uuid="u%d" % i,
                timestamp=at,
                message={"role": "user", "content": "Please fix the failing test in handler.py"}
            )
        elif roll < 0.6:
            usage = {
                "input_tokens": 1200 + i,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 20000,
                "output_tokens": 300
            }
            block = (
                {
                    "type": "tool_use",
                    "id": "toolu_%d" % i,
                    "name": "Bash",
                    "input": {"command": "pytest -q tests/test_handler.py"}
                }
                if roll < 0.35
                else {"type": "text", "text": "I read handler.py; the loop drops items.\n" + CODE}
            )
            yield dict(
                base,
                type="assistant",
                uuid="a%d" % i,
                timestamp=at,
                requestId="req_%d" % i,
                message={
                    "id": "msg_%d" % (i // 2),
                    "type": "message",
                    "role": "assistant",
                    "model": "claude-sonnet-4-5",
                    "content": [block],
                    "usage": usage
                }
            )
        else:
            yield dict(
                base,
                type="user",
                uuid="t%d" % i,
                timestamp=at,
                message={
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_%d" % i,
                            "content": CODE + LOG
                        }
                    ]
                },
                toolUseResult={"stdout": LOG, "stderr": "", "interrupted": False}
            )


def _codex_lines(rng, sid, n):
    total = {
        "input_tokens": 0,
        "cached_input_tokens": 0,
        "output_tokens": 0,
        "reasoning_output_tokens": 0,
        "total_tokens": 0
    }
    yield {
        "timestamp": "2026-12-01T10:00:00.000Z",
        "type": "session_meta",
        "payload": {"id": sid, "cwd": "/home/u/project", "cli_version": "0.171.0"}
    }
    yield {
        "timestamp": "2026-12-01T10:00:00.000Z",
        "type": "turn_context",
        "payload": {"cwd": "/home/u/project", "model": "gpt-5-codex"}
    }
    for i in range(n):
        at = "2026-12-01T10:%02d:%02d.%03dZ" % (i // 60 % 60, i % 60, i % 1000)
        roll = rng.random()
        if roll < 0.3:
            payload = {
                "type": "function_call",
                "name": "exec_command",
                "call_id": "call_%d" % i,
                "arguments": json.dumps({"cmd": "pytest -q"})
            }
            yield {"timestamp": at, "type": "response_item", "payload": payload}
        elif roll < 0.7:
            payload = {
                "type": "function_call_output",
                "call_id": "call_%d" % i,
                "output": CODE + LOG
            }
            yield {"timestamp": at, "type": "response_item", "payload": payload}
        else:
            total = {k: v + 100 for k, v in total.items()}
            yield {
                "timestamp": at,
                "type": "event_msg",
                "payload": {
                    "type": "token_count",
                    "info": {"total_token_usage": total, "last_token_usage": total}
                }
            }


def write_tree(root, megabytes, files):
    """Claude Code and Codex trees under root holding about `megabytes` MB in `files` files."""
    rng, per_file = random.Random(27), megabytes * 1000000 // files
    total = 0
    for n in range(files):
        sid = "%08d-0000-4000-8000-%012d" % (n, n)
        if n % 2:
            path = root / "claude" / "projects" / ("-p%d" % (n % 10)) / (sid + ".jsonl")
            lines = _claude_lines(rng, sid, 10**9)
        else:
            path = root / "codex" / "sessions" / "2026" / "12" / "01" / ("rollout-x-%s.jsonl" % sid)
            lines = _codex_lines(rng, sid, 10**9)
        path.parent.mkdir(parents=True, exist_ok=True)
        out, size = [], 0
        for line in lines:
            data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
            out.append(data)
            size += len(data)
            if size >= per_file:
                break
        path.write_bytes(b"".join(out))
        total += size
    return total


def _timed(cmd, cwd):
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


BARE_READ = (
    "import json, pathlib, sys\nfor p in sorted(pathlib.Path(sys.argv[1]).rglob('*.jsonl')):\n"
    "    for l in open(p, 'rb'): json.loads(l)\n"
)
BARE_STAT = (
    "import os, sys\nfor d, _s, fs in os.walk(sys.argv[1]):\n"
    "    for f in fs: os.stat(os.path.join(d, f))\n"
)


def bench(quick=False, megabytes=100):
    out = []
    work = Path(tempfile.mkdtemp(prefix="bench-transcripts-"))
    try:
        size = write_tree(work / "src", megabytes, 100)
        args = [
            "import",
            "--claude",
            str(work / "src" / "claude"),
            "--codex",
            str(work / "src" / "codex")
        ]
        base, mine = [], []
        for _ in range(1 if quick else 3):
            base.append(_timed([sys.executable, "-c", BARE_READ, str(work / "src")], work))
            shutil.rmtree(work / "l", ignore_errors=True)
            (work / "l").mkdir()
            mine.append(_timed([sys.executable, str(ROOT / "transcripts.py"), *args], work / "l"))
        b, m = statistics.median(base), statistics.median(mine)
        out.append(
            (
                f"transcripts.py import of {size / 1e6:.0f} MB vs read + json.loads per line",
                m / b,
                "<= 3",
                f"{m:.1f} s vs {b:.1f} s ({size / 1e6 / m:.0f} MB/s)"
            )
        )
        text = [
            line.decode()
            for p in sorted((work / "src").rglob("*.jsonl"))[:20]
            for line in p.read_bytes().splitlines()
        ]
        redactor = rl.Redactor(rl.secret_values())
        fast = _best(lambda: [redactor.text(t) for t in text])
        shapes = [(re.compile(p), r) for p, r in rl._SHAPES]
        slow = _best(lambda: [[p.sub(r, t) for p, r in shapes] for t in text])
        out.append(
            (
                "Redactor.text on transcript lines vs every shape over every line",
                fast / slow,
                "report",
                f"{sum(map(len, text)) / 1e6 / fast:.0f} vs "
                f"{sum(map(len, text)) / 1e6 / slow:.0f} MB/s"
            )
        )
        shutil.rmtree(work / "src")
        shutil.rmtree(work / "l")
        write_tree(work / "src", 20, 1000)
        (work / "l").mkdir()
        _timed([sys.executable, str(ROOT / "transcripts.py"), *args], work / "l")
        again = statistics.median(
            _timed([sys.executable, str(ROOT / "transcripts.py"), *args], work / "l")
            for _ in range(3)
        )
        bare = statistics.median(
            _timed([sys.executable, "-c", BARE_STAT, str(work / "src")], work) for _ in range(3)
        )
        out.append(
            (
                "a second import, nothing new, 1,000 files, vs a bare stat of each",
                again / bare,
                "report",
                f"{again:.2f} s (goal < 0.5 s) vs {bare:.2f} s"
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _best(fn, repeat=3):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":
    for row in bench(megabytes=int(sys.argv[1]) if len(sys.argv) > 1 else 100):
        print("  %-62s %6.2f   (target %s)  %s" % row)
