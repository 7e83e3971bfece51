#!/usr/bin/env python3
"""demo.py -- `make demo`: the whole agent loop in seconds, with nothing to configure.

Usage:
  python tests/demo.py            # against the local STAND-IN model (scripted; not a real model)
  python tests/demo.py --repo DIR [--patch FILE] [--tools FILE]   # make demo REPO=DIR PATCH=FILE
  BASE_URL=... API_KEY=... MODEL_ID=... python tests/demo.py   # the same run against a real endpoint

It starts tests/fake_openai.py on 127.0.0.1 as a stand-in for the model, creates a small sample repository
with a failing test in a temporary directory, and runs agent.py on it. The stand-in's script makes one
allowlist escape attempt, which the host denies, then proposes a patch. The demo prints the denial and the
rule behind it, the proposal, the judge's verdict, `agent.py runs`, the audit and `verify`. The sample
repository's tests use unittest, so a bare python3 runs it; the demo's tools.json is the shipped one with
that test command. Exit 0 when the loop went as it should.

With --repo, the run is on your repository (never changed: the agent only proposes) with tools.json
(or --tools): the scripted model lists the files, reads those the patch touches, runs the tests and
proposes --patch FILE, or without one runs out of steps. Exit 0 when that run closed without an error.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__version__ = "1.1.0"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = ("import unittest\n\nfrom calc import add, mul\n\n\nclass CalcTest(unittest.TestCase):\n"
         "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
         "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n")
PATCH = ("--- a/calc.py\n+++ b/calc.py\n@@ -1,5 +1,5 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n \n \n"
         " def mul(a, b):\n")


def _script():
    """What the stand-in answers, turn by turn: look around, try to escape, read the code, propose."""
    def act(tool, reason, **args):
        return json.dumps({"tool": tool, "args": args, "reason": reason})
    return [act("list_files", "see what is in the repository"),
            act("read_file", "an escape attempt: the host must deny it", path="../../etc/passwd"),
            act("read_file", "the failing test names calc.add", path="calc.py"),
            act("propose_patch", "add subtracts", patch=PATCH, rationale="add() subtracted instead of adding",
                alternatives=["rewrite add with sum()"])]


def _your_script(patch):
    """The stand-in's script on your repository: look, read what the patch touches, test, propose."""
    def act(tool, reason, **args):
        return json.dumps({"tool": tool, "args": args, "reason": reason})
    touched = sorted({line[6:].strip() for line in (patch or "").splitlines() if line.startswith("+++ b/")})
    script = [act("list_files", "see what is in the repository")]
    script += [act("read_file", "the patch changes this file", path=path) for path in touched]
    script.append(act("run_tests", "see what fails"))
    if patch:
        script.append(act("propose_patch", "the patch given to the demo", patch=patch,
                          rationale="the patch given with PATCH=FILE", alternatives=[]))
    return script


def _sample_repo(path):
    path.mkdir()
    (path / "calc.py").write_text(CALC)
    (path / "test_calc.py").write_text(TESTS)
    env = dict(os.environ, GIT_AUTHOR_NAME="demo", GIT_AUTHOR_EMAIL="demo@localhost", GIT_COMMITTER_NAME="demo",
               GIT_COMMITTER_EMAIL="demo@localhost")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "sample"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env)


def _tools(path):
    data = json.loads((ROOT / "tools.json").read_text())
    data["test_command"] = [sys.executable, "-m", "unittest"]
    path.write_text(json.dumps(data, indent=1) + "\n")


def _run(*args, env=None):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    return proc


def _section(title):
    print(f"\n== {title}")


def _args(argv):
    import argparse
    parser = argparse.ArgumentParser(prog="demo.py", description="The agent loop against a scripted stand-in.")
    parser.add_argument("--repo", help="your repository (a git work tree) instead of the sample one")
    parser.add_argument("--patch", help="with --repo: the unified diff the scripted model proposes")
    parser.add_argument("--tools", help="with --repo: the allowlist (default: the tools.json beside agent.py)")
    args = parser.parse_args(argv)
    if (args.patch or args.tools) and not args.repo:
        parser.error("--patch and --tools need --repo (make demo REPO=DIR PATCH=FILE)")
    return args


def main(argv=None):
    started = time.monotonic()
    args = _args(argv)
    try:
        patch = Path(args.patch).read_text(encoding="utf-8") if args.patch else None
    except OSError as exc:
        print(f"error: cannot read {args.patch}: {exc.strerror}", file=sys.stderr)
        return 2
    script = _your_script(patch) if args.repo else _script()
    real = all(os.environ.get(name) for name in ("BASE_URL", "API_KEY", "MODEL_ID"))
    server = None
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    if real:
        print(f"model: {os.environ['MODEL_ID']} at {os.environ['BASE_URL']} (a real endpoint)")
    else:
        import fake_openai
        server = fake_openai.FakeServer(models=["stand-in-model"], counted=True).start()
        server.queue(*[{"name": "ok", "answer": reply} for reply in script])
        env.update(BASE_URL=server.base_url, API_KEY="stand-in-key-not-a-secret", MODEL_ID="stand-in-model")
        print(f"model: a STAND-IN at {server.base_url}: scripted answers from tests/demo.py, not a real model.\n"
              f"       Set BASE_URL, API_KEY and MODEL_ID to run the same demo against a real endpoint.")
    work = Path(tempfile.mkdtemp(prefix="reasoning-ledger-demo-"))
    repo, runs, tools = work / "repo", work / "runs", work / "tools.json"
    try:
        if args.repo:
            repo = Path(args.repo).resolve()
            _your_tools(tools, args.tools, None if patch or real else len(script))
            print(f"your repository: {repo} (never changed: the agent only proposes)"
                  + ("" if patch or real else "; no PATCH given, so the scripted model proposes nothing"))
        else:
            _sample_repo(repo)
            _tools(tools)
            print(f"sample repository: {repo} (calc.py and test_calc.py: test_add fails)")
        _section(f"python3 agent.py run --repo {repo} --runs-dir {runs} --tools {tools}")
        proc = _run(ROOT / "agent.py", "run", "--repo", repo, "--runs-dir", runs, "--tools", tools, env=env)
        print(proc.stdout.strip() or "(nothing on stdout)")
        if proc.stderr.strip():
            print(proc.stderr.strip())
        print(f"exit {proc.returncode}" + (" (a proposal waits for review)" if proc.returncode == 8 else ""))
        if not proc.stdout.strip():
            return 1
        run_dir = runs / proc.stdout.split()[0]
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        ok = _show(events, run_dir, expect_denial=not args.repo)
        _section(f"python3 agent.py runs --runs-dir {runs}")
        print(_run(ROOT / "agent.py", "runs", "--runs-dir", runs, env=env).stdout.rstrip())
        _section(f"python3 audit.py {runs}")
        print(_run(ROOT / "audit.py", runs, env=env).stdout.rstrip())
        _section(f"python3 reasoning_ledger.py verify --all {runs}")
        verified = _run(ROOT / "reasoning_ledger.py", "verify", "--all", runs, env=env)
        print(verified.stdout.rstrip())
        kept = "the run's ledger, artifacts and proposal.patch" if (run_dir / "proposal.patch").exists() else \
            "the run's ledger and artifacts; this run ended without a proposal"
        print(f"\nthe run step by step: python3 {ROOT / 'reasoning_ledger.py'} report {run_dir / 'events.jsonl'}")
        print(f"done in {time.monotonic() - started:.1f} s; the files stay in {work} ({kept}) -- look, then rm -rf it")
        if args.repo:
            return 0 if proc.returncode not in (1, 2) and verified.returncode == 0 else 1
        return 0 if ok and verified.returncode == 0 and (real or proc.returncode == 8) else 1
    finally:
        if server is not None:
            server.stop()


def _your_tools(path, given, max_steps):
    """Your allowlist (or the shipped one); without a patch, as many steps as the script has."""
    data = json.loads(Path(given or ROOT / "tools.json").read_text(encoding="utf-8"))
    if max_steps:
        data.setdefault("budget", {})["max_steps"] = max_steps
    path.write_text(json.dumps(data, indent=1) + "\n")


def _show(events, run_dir, expect_denial=True):
    _section("what the host denied, and the rule behind it")
    denials = [e["payload"] for e in events if e["kind"] == "tool_denied"]
    for denial in denials:
        print(f"  step {denial['step']}: {denial['tool']} {json.dumps(denial['args'])}\n"
              f"    denied by rule {denial['rule']}: {denial['reason']}")
    if not denials:
        print("  (nothing was denied)")
    _section(f"the proposal: {run_dir / 'proposal.patch'} (never applied to the repository)")
    proposal = run_dir / "proposal.patch"
    decisions = [e["payload"] for e in events if e["kind"] == "decision" and e["payload"].get("stage") == "proposal"]
    if decisions:
        print(f"  decision (recorded before the file was written): {decisions[-1]['rationale']}")
    print(proposal.read_text().rstrip() if proposal.exists() else "  (no proposal)")
    _section("the judge (its own process, its own copy of the repository)")
    verdicts = [e["payload"] for e in events if e["kind"] == "judge_verdict"]
    for verdict in verdicts:
        print(f"  {verdict['verdict']}: {verdict['reason']}\n  applies={verdict['applies']} "
              f"tests_passed={verdict['tests_passed']} touched_tests={verdict['touched_tests']}")
    if not verdicts:
        print("  (no verdict)")
    return (bool(denials) or not expect_denial) and bool(verdicts) and verdicts[-1]["verdict"] == "accept"


if __name__ == "__main__":
    sys.exit(main())
