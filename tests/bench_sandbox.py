"""bench_sandbox.py -- the sandbox's cost for `make bench` (tests/bench.py sandbox): one judge run of the demo
repository (tests/demo.py's sample, unittest) with "sandbox": "auto" (bwrap) against "off", as a ratio of
medians. The judge's time is read from its own ledger: from the proposal's decision to judge_verdict."""

import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import demo  # noqa: E402
import fake_openai  # noqa: E402
import reasoning_ledger as rl  # noqa: E402


def _judge_seconds(work, server, mode, index):
    """One run that proposes the fix at once; the seconds its judge took."""
    tools = json.loads((ROOT / "tools.json").read_text())
    tools["test_command"], tools["sandbox"] = [sys.executable, "-m", "unittest"], mode
    (work / f"tools-{mode}.json").write_text(json.dumps(tools))
    reply = json.dumps({"tool": "propose_patch", "args": {"patch": demo.PATCH, "rationale": "add adds"},
                        "reason": "bench"})
    server.queue({"name": "ok", "answer": reply})
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(BASE_URL=server.base_url, API_KEY="sk-bench-0000000000", MODEL_ID="stand-in-model")
    runs = work / f"runs-{mode}-{index}"
    proc = subprocess.run([sys.executable, str(ROOT / "agent.py"), "run", "--repo", str(work / "repo"),
                           "--runs-dir", str(runs), "--tools", str(work / f"tools-{mode}.json")], env=env,
                          capture_output=True, text=True, check=False)
    run_dir = runs / proc.stdout.split()[0]
    events = list(rl.read_events(run_dir / rl.EVENTS_NAME))
    at = {e["kind"]: datetime.datetime.strptime(e["at"], "%Y-%m-%dT%H:%M:%S.%fZ") for e in events
          if e["kind"] in ("decision", "judge_verdict")}
    verdict = [e["payload"] for e in events if e["kind"] == "judge_verdict"][-1]
    if verdict["verdict"] != "accept" or (verdict["sandbox"] == "bwrap") != (mode == "auto"):
        raise RuntimeError(f"bench_sandbox: the {mode} run did not go as it should: {verdict}")
    return (at["judge_verdict"] - at["decision"]).total_seconds()


def bench(quick=True):
    if not shutil.which("bwrap"):
        return [("sandbox: skipped (bwrap is not installed)", float("nan"), "< 1.2", "")]
    work = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    server = fake_openai.start()
    try:
        demo._sample_repo(work / "repo")
        times = {"auto": [], "off": []}
        for index in range(3 if quick else 7):
            for mode in ("off", "auto"):
                times[mode].append(_judge_seconds(work, server, mode, index))
        boxed, bare = statistics.median(times["auto"]), statistics.median(times["off"])
        return [("one judge run, sandbox auto (bwrap) vs off, demo repository", boxed / bare, "< 1.2",
                 f"{boxed * 1e3:.0f} ms vs {bare * 1e3:.0f} ms")]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
