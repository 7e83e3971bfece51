"""agent.py as a user runs it: real git repositories in temp dirs, the stand-in endpoint scripted per test,
agent.py as a subprocess. The user's repository must come out of every run exactly as it went in."""

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import reasoning_ledger as rl
from conftest import KEY, ROOT, all_bytes_under, clean_env, error_lines, git, make_repo, run_script, tools_json
from conftest import SAMPLE_CALC as CALC, SAMPLE_TESTS as TESTS


def udiff(name, before, after):
    """A unified diff as `diff -u` writes it (three lines of context)."""
    import difflib
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{name}", f"b/{name}"))


FIX = udiff("calc.py", CALC, CALC.replace("a - b", "a + b"))
MISCOUNTED = FIX.replace("@@ -1,5 +1,5 @@", "@@ -1,9 +1,9 @@")
DELETE_TEST = udiff("test_calc.py", TESTS, TESTS.replace("def test_add():\n    assert add(2, 3) == 5\n\n\n", ""))
WEAKEN = udiff("test_calc.py", TESTS, TESTS.replace("assert add(2, 3) == 5", "assert add(2, 3) is not None"))
STALE = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(x, y):\n-    return x - y\n+    return x + y\n"
ENV_SECRET = "s3cr3t-env-value-0123456789"


def repo_state(repo):
    """Every file under the repository, .git included: content, mode and mtime; then git status, read
    without an index write."""
    files = {}
    for path in sorted(Path(repo).rglob("*")):
        info = os.lstat(path)
        content = path.read_bytes() if stat.S_ISREG(info.st_mode) else os.readlink(path) if stat.S_ISLNK(
            info.st_mode) else None
        files[str(path.relative_to(repo))] = (content, info.st_mode, info.st_mtime_ns)
    return files, git(repo, "status", "--porcelain", "--ignored")


def action(tool, **args):
    return json.dumps({"tool": tool, "args": args, "reason": f"step {tool}"})


def propose(patch, rationale="add must add"):
    return action("propose_patch", patch=patch, rationale=rationale, alternatives=["rewrite add"])


@pytest.fixture
def agent(server, tmp_path):
    """Run agent.py on a repository with scripted replies; returns (proc, run_dir, events)."""
    runs = tmp_path / "runs"
    tools = tools_json(tmp_path / "tools.json")

    def run(repo, replies=(), *args, tools_file=None, env=None, timeout=180, check_untouched=True):
        server.queue(*[r if isinstance(r, dict) else {"name": "ok", "answer": r} for r in replies])
        before = repo_state(repo) if check_untouched else None
        settings = dict(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
        settings.update(env or {})
        proc = run_script("agent.py", "run", "--repo", repo, "--runs-dir", runs, "--tools", tools_file or tools,
                          *args, env=clean_env(**settings), timeout=timeout)
        if check_untouched:
            assert repo_state(repo) == before, "the run changed the user's repository"
        assert "Traceback" not in proc.err, proc.err
        line = proc.out.split()
        run_dir = runs / line[0] if line else None
        events = list(rl.read_events(run_dir / "events.jsonl")) if run_dir and run_dir.exists() else []
        return proc, run_dir, events

    run.runs, run.tools = runs, tools
    return run


def kinds(events):
    return [e["kind"] for e in events if e["kind"] not in ("model_call", "tool_result", "context_trimmed",
                                                            "models_list")]


def payload(events, kind):
    return [e["payload"] for e in events if e["kind"] == kind]


def _verifies(runs):
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 0, proc.out + proc.err


def _replays(run_dir):
    proc = run_script("agent.py", "replay", run_dir)
    assert proc.returncode == 0 and proc.out.startswith("identical"), proc.out + proc.err


# ----------------------------------------------------------------------------
# The main job
# ----------------------------------------------------------------------------

def test_a_failing_repo_gets_a_proposal_that_the_judge_accepts(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [action("read_file", path="calc.py"), propose(FIX)])
    assert proc.returncode == rl.EXIT_PROPOSAL == 8, proc.err
    run_id, outcome, proposal = proc.out.split()
    assert outcome == "proposal_accepted" and proposal == str(run_dir / "proposal.patch")
    assert (run_dir / "proposal.patch").read_text() == FIX
    assert kinds(events) == ["run_started", "tests_run", "prompt_context", "model_proposed", "tool_allowed",
                             "model_proposed", "tool_allowed", "decision", "judge_verdict", "run_closed"]
    started = payload(events, "run_started")[0]
    assert started["repo"] == str(repo.resolve()) and started["dirty"] is False and started["model"] == "stand-in-model"
    assert started["tools_sha256"] and started["commit"] == git(repo, "rev-parse", "HEAD").decode().strip()
    tests_run = payload(events, "tests_run")[0]
    assert tests_run["passed"] is False and tests_run["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    decision = payload(events, "decision")[0]
    assert decision["stage"] == "proposal" and decision["rationale"] == "add must add"
    assert decision["alternatives"] == ["rewrite add"] and decision["files"] == ["calc.py"]
    assert [e["seq"] for e in events if e["kind"] == "decision"][0] < \
        [e["seq"] for e in events if e["kind"] == "judge_verdict"][0]  # decided before the file was judged
    verdict = payload(events, "judge_verdict")[0]
    assert verdict["verdict"] == "accept" and verdict["applies"] and verdict["tests_passed"]
    assert verdict["comparison"] == "per test (JUnit XML)" and verdict["newly_failing"] == []
    assert payload(events, "run_closed")[0]["outcome"] == "proposal_accepted"
    # every model call of the run is in the run's ledger, with all of ask.py's fields
    calls = payload(events, "model_call")
    assert len(calls) == 2 and all(c["max_tokens"] == 2048 and c["request_model"] == "stand-in-model" for c in calls)
    first_prompt = server.requests[0]["body"]["messages"][1]["content"]
    assert "assert add(2, 3) == 5" in first_prompt and "Budget left: 24 steps" in first_prompt
    _verifies(agent.runs)
    _replays(run_dir)


def test_a_passing_repo_gets_no_action(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo", calc=CALC.replace("a - b", "a + b"))
    proc, run_dir, events = agent(repo)
    assert proc.returncode == 0 and proc.out.split()[1:] == ["no_action", "-"]
    assert kinds(events) == ["run_started", "tests_run", "decision", "run_closed"]
    assert payload(events, "decision")[0]["decision"] == "no action" and server.requests == []
    _verifies(agent.runs)


def test_uncommitted_changes_are_the_tree_worked_on_and_ref_is_the_commit(agent, tmp_path):
    repo = make_repo(tmp_path / "repo", calc=CALC.replace("a - b", "a + b"))
    (repo / "calc.py").write_text(CALC)  # the user's uncommitted change broke it
    proc, run_dir, events = agent(repo, [action("read_file", path="calc.py")], "--max-steps", "1")
    assert proc.returncode == 7, proc.err  # the tree worked on fails: the model was asked
    assert payload(events, "run_started")[0]["dirty"] is True
    diff = (run_dir / payload(events, "prompt_context")[0]["diff_artifact"]["path"]).read_text()
    assert "-    return a + b" in diff and "+    return a - b" in diff
    head = git(repo, "rev-parse", "HEAD").decode().strip()
    proc, run_dir, events = agent(repo, [], "--ref", head)  # the commit itself passes
    assert proc.returncode == 0 and proc.out.split()[1] == "no_action"
    assert payload(events, "run_started")[0]["ref"] == head


def test_a_tracked_directory_replaced_by_a_symlink_out_is_never_written_through(agent, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.txt").write_text("precious data outside the repository\n")
    repo = make_repo(tmp_path / "repo", extra={"d/x.txt": "tracked\n"})
    (repo / "d" / "x.txt").unlink()
    (repo / "d").rmdir()
    os.symlink(outside, repo / "d")
    proc, _run_dir, _events = agent(repo, [propose(FIX)])
    assert proc.returncode == 8, proc.err
    assert sorted(os.listdir(outside)) == ["x.txt"]
    assert (outside / "x.txt").read_text() == "precious data outside the repository\n"


def test_a_commit_whose_tree_holds_a_symlink_and_a_directory_of_one_name_writes_nothing_outside(agent, tmp_path):
    """A crafted tree (a fetched commit, a push's `after`): d -> outside, and a directory d/ with a file."""
    outside = tmp_path / "outside"
    outside.mkdir()
    repo = make_repo(tmp_path / "repo")

    def git_in(*args, data):
        return subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True, check=True,
                              env=clean_env()).stdout.decode().strip()
    link = git_in("hash-object", "-w", "--stdin", data=str(outside).encode())
    planted = git_in("hash-object", "-w", "--stdin", data=b"planted = True\n")
    sub = git_in("mktree", data=f"100644 blob {planted}\tplanted.py\n".encode())
    entries = git(repo, "ls-tree", "HEAD").decode() + f"120000 blob {link}\td\n040000 tree {sub}\td\n"
    tree = git_in("mktree", "--missing", data=entries.encode())
    commit = git_in("-c", "user.name=t", "-c", "user.email=t@t", "commit-tree", tree, "-m", "crafted", "-p", "HEAD",
                    data=b"")
    proc, _run_dir, _events = agent(repo, [propose(FIX)], "--ref", commit)
    assert "Traceback" not in proc.err
    assert os.listdir(outside) == []


@pytest.mark.parametrize("how", ["gitfile", "symlink", "uppercase"])
def test_a_commit_holding_a_dot_git_entry_cannot_turn_git_on_another_repository(agent, tmp_path, how):
    victim = make_repo(tmp_path / "victim")
    before = (git(victim, "rev-parse", "HEAD"), (victim / ".git" / "index").read_bytes())
    repo = make_repo(tmp_path / "repo")

    def git_in(*args, data):
        return subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True, check=True,
                              env=clean_env()).stdout.decode().strip()
    if how == "symlink":
        entry = f"120000 blob {git_in('hash-object', '-w', '--stdin', data=str(victim / '.git').encode())}\t.git"
    else:
        blob = git_in("hash-object", "-w", "--stdin", data=f"gitdir: {victim / '.git'}\n".encode())
        entry = f"100644 blob {blob}\t{'.GIT' if how == 'uppercase' else '.git'}"
    tree = git_in("mktree", "--missing", data=(git(repo, "ls-tree", "HEAD").decode() + entry + "\n").encode())
    commit = git_in("-c", "user.name=t", "-c", "user.email=t@t", "commit-tree", tree, "-m", "crafted", "-p", "HEAD",
                    data=b"")
    proc, _run_dir, _events = agent(repo, [propose(FIX)], "--ref", commit)
    assert proc.returncode == 8, proc.err
    assert (git(victim, "rev-parse", "HEAD"), (victim / ".git" / "index").read_bytes()) == before


def test_an_env_file_that_is_a_named_pipe_does_not_hang_the_run(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    os.mkfifo(tmp_path / "env.fifo")
    os.symlink(tmp_path / "env.fifo", repo / ".env")
    proc, _run_dir, _events = agent(repo, [propose(FIX)])  # a hang meets the default hang guard
    assert proc.returncode == 8, proc.err


# ----------------------------------------------------------------------------
# The judge
# ----------------------------------------------------------------------------

CONFTEST = udiff("conftest.py", "", "collect_ignore = ['test_calc.py']\n").replace("--- a/conftest.py", "--- /dev/null")
TIMESTAMPED = WEAKEN.replace("--- a/test_calc.py", "--- a/test_calc.py\t2026-11-30 01:02:03.000000000 +0000").replace(
    "+++ b/test_calc.py", "+++ b/test_calc.py\t2026-11-30 01:02:04.000000000 +0000")


@pytest.mark.parametrize("patch,words", [
    (DELETE_TEST, "changes test files or test configuration (test_calc.py)"),
    (WEAKEN, "changes test files or test configuration (test_calc.py)"),
    (TIMESTAMPED, "changes test files or test configuration (test_calc.py)"),
    (CONFTEST, "changes test files or test configuration (conftest.py)"),
    (udiff("pytest.ini", "", "[pytest]\naddopts = -p no:python\n").replace("--- a/pytest.ini", "--- /dev/null"),
     "changes test files or test configuration (pytest.ini)"),
    (udiff(".pytest.ini", "", "[pytest]\naddopts = -p no:python\n").replace("--- a/.pytest.ini", "--- /dev/null"),
     "changes test files or test configuration (.pytest.ini)"),
    ("diff --git a/test_calc.py b/docs/old.txt\nsimilarity index 100%\nrename from test_calc.py\n"
     "rename to docs/old.txt\n", "changes test files or test configuration (test_calc.py)"),
    (udiff("pytest.py", "", "passed = True\n").replace("--- a/pytest.py", "--- /dev/null"),
     "the patch adds pytest.py, named like a module Python can already import"),
], ids=["delete", "weaken", "timestamped-header", "root-conftest", "pytest-ini", "dot-pytest-ini", "renamed-away",
        "shadows-pytest"])
def test_a_patch_that_deletes_or_weakens_the_failing_test_is_rejected(agent, tmp_path, patch, words):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [propose(patch)])
    assert proc.returncode == rl.EXIT_CHECK == 3, proc.err
    assert proc.out.split()[1] == "proposal_rejected_by_judge"
    verdict = payload(events, "judge_verdict")[0]
    assert verdict["verdict"] == "reject" and words in verdict["reason"] and verdict["applies"] is True
    _replays(run_dir)


def test_the_judge_catches_vanished_tests_even_when_test_changes_are_allowed(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    tools = tools_json(tmp_path / "lenient.json", judge={"allow_test_changes": True})
    proc, _run_dir, events = agent(repo, [propose(DELETE_TEST)], tools_file=tools)
    verdict = payload(events, "judge_verdict")[0]
    assert proc.returncode == 3 and "gone or skipped" in verdict["reason"]
    assert verdict["vanished"] == ["test_calc::test_add"] and verdict["tests_passed"] is True


def test_a_patch_that_stops_the_test_runner_is_rejected_even_though_pytest_exits_0(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    cheat = udiff("calc.py", CALC, "import os, sys\nif 'pytest' in sys.modules:\n    os._exit(0)\n" + CALC)
    tools = tools_json(tmp_path / "no-checks.json", judge={"tripwires_off": ["*"], "known_answers": False})
    proc, run_dir, events = agent(repo, [propose(cheat)], tools_file=tools)  # the exit-code path alone
    verdict = payload(events, "judge_verdict")[0]
    assert proc.returncode == 3 and verdict["verdict"] == "reject", verdict
    assert verdict["results_missing"] is True and "stops or bypasses the test runner" in verdict["reason"]


def test_a_conftest_that_fails_to_import_is_the_models_to_fix_not_a_broken_command(agent, tmp_path, server):
    broken = CALC.replace("def add(a, b):", "def add(a, b)")
    repo = make_repo(tmp_path / "repo", calc=broken, extra={"conftest.py": "import calc\n"})
    fix = udiff("calc.py", broken, CALC.replace("a - b", "a + b"))
    proc, run_dir, events = agent(repo, [propose(fix)])
    assert proc.returncode == 8, proc.err
    (baseline,) = payload(events, "tests_run")
    assert baseline["returncode"] == 4 and len(server.requests) == 1
    assert payload(events, "judge_verdict")[0]["verdict"] == "accept"


def test_deleting_a_file_named_with_a_mode_like_number_is_not_a_mode_change(denial_tree, tmp_path):
    import agent as agent_module
    policy, _resolve, _tree = denial_tree
    repo = make_repo(tmp_path / "repo", extra={"weird-120000.txt": "x\n"})
    gone = "diff --git a/weird-120000.txt b/weird-120000.txt\ndeleted file mode 100644\n--- a/weird-120000.txt\n" \
           "+++ /dev/null\n@@ -1 +0,0 @@\n-x\n"
    assert agent_module.patch_files(FIX + gone) == (["calc.py", "weird-120000.txt"], [])
    resolve = agent_module.Workspace(repo, None, repo, policy, None).resolve
    assert agent_module.check_action({"tool": "propose_patch", "args": {"patch": FIX + gone}}, policy, resolve).allowed
    check = agent_module.check_patch(repo, FIX + gone, rl.Redactor(), policy, resolve)
    assert check["applies"] is True and sorted(check["files"]) == ["calc.py", "weird-120000.txt"], check


def test_the_judge_command_refuses_a_run_without_a_proposal_or_already_closed(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    _proc, accepted, _events = agent(repo, [propose(FIX)])
    _proc, nothing, _events = agent(repo, ["not json"], "--max-steps", "1")
    for run_dir, words in ((accepted, "the run is closed"), (nothing, "has no accepted proposal")):
        before = (run_dir / "events.jsonl").read_bytes()
        proc = run_script("agent.py", "judge", run_dir)
        assert proc.returncode == 2 and words in error_lines(proc.err)[0], proc.err
        assert (run_dir / "events.jsonl").read_bytes() == before


def test_the_judge_catches_a_test_that_passed_before_and_fails_now(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    breaks_mul = udiff("calc.py", CALC, CALC.replace("a - b", "a + b").replace("a * b", "a + b"))
    proc, _run_dir, events = agent(repo, [propose(breaks_mul)])
    verdict = payload(events, "judge_verdict")[0]
    assert proc.returncode == 3 and verdict["newly_failing"] == ["test_calc::test_mul"]


# ----------------------------------------------------------------------------
# Patches that do not apply
# ----------------------------------------------------------------------------

def test_a_patch_that_does_not_apply_is_rejected_and_fed_back(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [propose(STALE), action("read_file", path="calc.py")], "--max-steps", "2")
    assert proc.returncode == 7, proc.err  # the run went on after the rejection, to its step budget
    rejected = payload(events, "patch_rejected")[0]
    assert rejected["step"] == 1 and "patch failed" in rejected["message"]
    told = server.requests[1]["body"]["messages"][-1]["content"]
    assert told.startswith("The patch does not apply (git apply --check)") and "patch failed" in told
    _replays(run_dir)


def test_miscounted_hunks_are_fixed_with_recount_and_say_so(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [propose(MISCOUNTED)])
    assert proc.returncode == 8, proc.err
    decision = payload(events, "decision")[0]
    assert decision["recount"] is True
    written = (run_dir / "proposal.patch").read_text()
    assert "+    return a + b" in written and "@@ -1,9" not in written  # git's own, applicable diff
    assert payload(events, "judge_verdict")[0]["verdict"] == "accept"


# ----------------------------------------------------------------------------
# The allowlist: denied or rejected with the rule named, and the run goes on
# ----------------------------------------------------------------------------

RENAMES_ENV = FIX + "diff --git a/notes b/leak.txt\nsimilarity index 100%\nrename old .env\nrename new leak.txt\n"
NESTED = '{"tool": "read_file", "args": {"path": "calc.py", "x": ' + "[" * 100 + "]" * 100 + "}}"
# What check_action denies, and the rule it names. The paths resolve in a real tree (denial_tree):
# escape -> /etc, link_to_env -> .env.
DENIALS = [
    (("read_file", {"path": "../../etc/passwd"}), "path.dotdot"),
    (("read_file", {"path": "/etc/passwd"}), "path.absolute"),
    (("read_file", {"path": "escape/passwd"}), "path.escape"),
    (("read_file", {"path": "link_to_env"}), "path.denied"),
    (("read_file", {"path": ".env"}), "path.denied"),
    (("read_file", {"path": "sub/.env.local"}), "path.denied"),
    (("read_file", {"path": ".git/config"}), "path.denied"),
    (("read_file", {"path": "-rf"}), "arg.option"),
    (("read_file", {"path": "calc.py\x00.txt"}), "path.nul"),
    (("read_file", {"path": "a" * 2000}), "arg.too_long"),
    (("list_files", {"path": "~root"}), "path.absolute"),
    (("py_compile", {"path": "calc.py; rm -rf /"}), "arg.pattern"),
    (("py_compile", {"path": "calc.py && id"}), "arg.pattern"),
    (("py_compile", {"path": "$(id).py"}), "arg.pattern"),
    (("py_compile", {"path": "-c.py"}), "arg.option"),
    (("py_compile", {"path": "notes.txt"}), "arg.pattern"),
    (("run_test", {"node_id": "test_calc.py::test_add --pdb"}), "arg.pattern"),
    (("shell", {"cmd": "cat /etc/passwd"}), "tool.unknown"),
    (("read_file", {"path": "calc.py", "mode": "w"}), "args.unknown"),
    (("read_file", {}), "args.missing"),
    (("read_file", {"path": "calc.py", "start_line": "1"}), "args.type"),
    (("propose_patch", {"patch": FIX.replace("calc.py", "../outside.py")}), "path.dotdot"),
    (("propose_patch", {"patch": FIX.replace("calc.py", ".git/hooks/pre-commit")}), "path.denied"),
    (("propose_patch", {"patch": "just words"}), "patch.no_files"),
    (("propose_patch", {"patch": "diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n"
                                 "+/etc/passwd\n"}), "patch.mode"),
    (("propose_patch", {"patch": "diff --git a/l b/l\nnew file mode 0120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n"
                                 "+/etc/passwd\n"}), "patch.mode"),
]
# ...and what it allows, so a check_action that denies everything fails the table too.
ALLOWED = [
    (("read_file", {"path": "calc.py", "start_line": 1, "end_line": 2}), "builtin.read_file"),
    (("list_files", {"path": "sub"}), "builtin.list_files"),
    (("py_compile", {"path": "calc.py"}), "plugin.py_compile"),
    (("run_test", {"node_id": "test_calc.py::test_add"}), "plugin.run_test"),
    (("propose_patch", {"patch": FIX}), "builtin.propose_patch"),
    (("propose_patch", {"patch": RENAMES_ENV}), "builtin.propose_patch"),  # git's reading refuses it: see below
]


@pytest.fixture(scope="module")
def denial_tree(tmp_path_factory):
    """(policy, resolve) of a run: the shipped tools.json, and a real scratch tree with links out and to .env."""
    import agent as agent_module
    root = tmp_path_factory.mktemp("denials")
    repo = make_repo(root / "repo", extra={"sub/.env.local": "X=1\n"})
    outside = root / "outside"  # not /etc: boxed, root has no capabilities and /etc has root-only dirs
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0\n")
    os.symlink(outside, repo / "escape")
    os.symlink(".env", repo / "link_to_env")
    (repo / ".env").write_text(f"SECRET_TOKEN={ENV_SECRET}\n")
    policy = agent_module.load_policy(tools_json(root / "tools.json"))
    return policy, agent_module.Workspace(repo, None, repo, policy, None).resolve, repo


@pytest.mark.parametrize("call,rule", DENIALS + ALLOWED, ids=[f"{i}-{d[1]}" for i, d in enumerate(DENIALS + ALLOWED)])
def test_check_action_names_the_rule_of_each_decision(denial_tree, call, rule):
    import agent as agent_module
    policy, resolve, _repo = denial_tree
    verdict = agent_module.check_action({"tool": call[0], "args": call[1]}, policy, resolve)
    assert (verdict.allowed, verdict.rule) == ((call, rule) in ALLOWED, rule), verdict.reason
    assert verdict.reason


@pytest.mark.parametrize("reply,words", [
    ("Sure! I will fix it now.", "no action found"),
    ('{"tool": 5, "args": {}}', "tool name"),
    ('{"tool": "read_file", "args": "calc.py"}', "JSON object"),
])
def test_a_reply_that_is_no_action_is_malformed(reply, words):
    import agent as agent_module
    with pytest.raises(agent_module.Malformed, match=words):
        agent_module.parse_reply(reply)


def test_an_action_nested_too_deep_to_record_is_refused_before_the_policy_sees_it():
    import agent as agent_module
    action, _form = agent_module.parse_reply(NESTED)
    assert "nested" in rl.payload_problem({"args": action["args"], "reason": action["reason"]})


def test_a_patch_check_action_allows_is_refused_by_gits_own_reading_of_it(denial_tree, tmp_path):
    """Our parse of RENAMES_ENV sees calc.py (and a made-up header); git reads a rename of .env. The
    scratch copy a run checks patches in holds the user's .env, as this repository's commit does."""
    import agent as agent_module
    policy, resolve, _tree = denial_tree
    repo = make_repo(tmp_path / "scratch", extra={".env": f"SECRET_TOKEN={ENV_SECRET}\n"})
    check = agent_module.check_patch(repo, RENAMES_ENV, rl.Redactor(), policy, resolve)
    assert check["applies"] is False
    assert "'.env'" in check["message"] and "(rule path.denied)" in check["message"]
    assert agent_module.check_patch(repo, FIX, rl.Redactor(), policy, resolve)["applies"] is True


def test_each_kind_of_refusal_reaches_the_model_and_the_record_and_the_run_goes_on(agent, tmp_path, server):
    """One run through the four ways the host refuses a reply: a denied action, a reply that is no action,
    an action that cannot be recorded, and a patch git reads as touching .env."""
    repo = make_repo(tmp_path / "repo")
    (repo / ".env").write_text(f"SECRET_TOKEN={ENV_SECRET}\n")
    proc, run_dir, events = agent(repo, [action("read_file", path=".env"), "Sure! I will fix it now.", NESTED,
                                         propose(RENAMES_ENV), propose(FIX)])
    assert proc.returncode == 8, proc.err  # the run went on to its proposal
    refused = [e for e in events if e["kind"] in ("tool_denied", "proposal_malformed", "patch_rejected")]
    assert [e["kind"] for e in refused] == ["tool_denied", "proposal_malformed", "proposal_malformed",
                                            "patch_rejected"]
    assert [e["payload"]["step"] for e in refused] == [1, 2, 3, 4]
    denied = refused[0]["payload"]
    assert (denied["tool"], denied["args"], denied["rule"]) == ("read_file", {"path": ".env"}, "path.denied")
    assert denied["reason"] and denied["paths"] == {}
    told = [r["body"]["messages"][-1]["content"] for r in server.requests[1:]]
    assert told[0].startswith("Denied by the host: read_file: ") and "(rule path.denied)" in told[0]
    assert told[1].startswith("The host could not read your reply: no action found")
    assert told[2].startswith("The host could not record your action (") and "nested" in told[2]
    assert told[3].startswith("The patch does not apply") and "'.env'" in told[3] and "(rule path.denied)" in told[3]
    assert "'.env'" in refused[3]["payload"]["message"]
    assert ENV_SECRET.encode() not in all_bytes_under(agent.runs)
    assert ENV_SECRET not in json.dumps(server.requests)
    _replays(run_dir)


def test_a_fenced_or_wrapped_action_and_a_bare_diff_are_read(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    replies = ["Let me look.\n```json\n" + action("read_file", path="calc.py") + "\n```",
               "I will list: " + action("list_files") + " thanks",
               "```diff\n" + STALE + "```"]
    proc, run_dir, events = agent(repo, replies, "--max-steps", "3")
    assert proc.returncode == 7, proc.err
    assert [p["form"] for p in payload(events, "model_proposed")] == ["fenced_json", "embedded_json", "fenced_diff"]
    assert [p["tool"] for p in payload(events, "model_proposed")] == ["read_file", "list_files", "propose_patch"]
    assert payload(events, "patch_rejected")[0]["patch_sha256"] == hashlib.sha256(STALE.encode()).hexdigest()


def test_read_only_tools_work_and_their_output_is_capped(agent, tmp_path, server):
    big = "x = 1\n" * 20000
    repo = make_repo(tmp_path / "repo", extra={"big.py": big})
    replies = [action("read_file", path="calc.py", start_line=1, end_line=2), action("grep", pattern=r"return a \S b"),
               action("list_files"), action("git_log", n=3), action("git_diff"), action("read_file", path="big.py"),
               action("run_tests"), action("py_compile", path="calc.py"),
               action("run_test", node_id="test_calc.py::test_mul"), action("git_diff")]  # the last: to see run_test's
    proc, run_dir, events = agent(repo, replies, "--max-steps", str(len(replies)))
    assert proc.returncode == 7, proc.err
    results = payload(events, "tool_result")
    assert [r["tool"] for r in results] == ["read_file", "grep", "list_files", "git_log", "git_diff", "read_file",
                                            "run_tests", "py_compile", "run_test", "git_diff"]
    shown = [r["body"]["messages"][-1]["content"] for r in server.requests[1:]]
    assert "1| def add(a, b):" in shown[0] and "2|     return a - b" in shown[0]
    assert "calc.py:2:     return a - b" in shown[1] and "calc.py:6:     return a * b" in shown[1]
    assert "calc.py" in shown[2] and ".git" not in shown[2] and "init" in shown[3]
    assert "bytes cut" in shown[5] and results[5]["truncated"] is True and results[5]["size"] > 100000
    assert "1 failed, 1 passed" in shown[6] and results[6]["returncode"] == 1
    assert results[7]["returncode"] == 0 and "1 passed" in shown[8]
    full = (run_dir / results[5]["output_artifact"]["path"]).read_text()
    assert full.count("x = 1") == 20000  # the whole output is kept as an artifact


# ----------------------------------------------------------------------------
# Budgets
# ----------------------------------------------------------------------------

def test_max_steps_ends_the_run_cleanly(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    replies = [action("read_file", path="calc.py", start_line=i) for i in range(1, 6)]  # no repeat: not stuck
    proc, run_dir, events = agent(repo, replies, "--max-steps", "3")
    assert proc.returncode == rl.EXIT_BUDGET == 7 and proc.out.split()[1] == "budget_exhausted"
    (spent,) = payload(events, "budget_exhausted")
    assert spent["limit"] == "max_steps" and spent["used"] == 3 and spent["max"] == 3
    assert proc.err.splitlines() == [f"warning: run {run_dir.name}: budget exhausted: max_steps (3 of 3); "
                                 f"its record: {run_dir}"]
    _verifies(agent.runs)
    _replays(run_dir)


def test_a_model_that_never_sends_valid_json_ends_in_budget_exhausted(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    patient = tools_json(tmp_path / "patient.json", budget={"max_repeats": 5})  # 3 would end it as stuck
    proc, run_dir, events = agent(repo, ["I am thinking..."] * 4, "--max-steps", "4", tools_file=patient)
    assert proc.returncode == 7 and len(payload(events, "proposal_malformed")) == 4
    assert payload(events, "budget_exhausted")[0]["limit"] == "max_steps"
    assert not payload(events, "error")
    _verifies(agent.runs)


@pytest.mark.parametrize("budget,limit,scenario,source", [
    ({"max_model_calls": 2}, "max_model_calls", "ok", "reported"),
    ({"max_total_tokens": 50}, "max_total_tokens", "ok", "reported"),
    ({"max_total_tokens": 60}, "max_total_tokens", "no_usage", "estimated"),
])
def test_call_and_token_budgets(agent, tmp_path, budget, limit, scenario, source):
    repo = make_repo(tmp_path / "repo")
    tools = tools_json(tmp_path / "tight.json", budget=budget)
    replies = [{"name": scenario, "answer": action("read_file", path="calc.py")}] * 5
    proc, run_dir, events = agent(repo, replies, tools_file=tools)
    assert proc.returncode == 7, proc.err
    (spent,) = payload(events, "budget_exhausted")
    assert spent["limit"] == limit and spent["budget"]["tokens_source"] == source
    _replays(run_dir)


def test_max_wall_s_holds_while_a_slow_model_is_answering(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    held = threading.Event()  # the model answers only once the run is over: the wall budget must end it
    try:
        proc, run_dir, events = agent(repo, [{"name": "sleepy", "hold": held, "answer": propose(FIX)}],
                                      "--max-wall-s", "12")  # room for the probe and the boxed baseline run
    finally:
        held.set()
    assert proc.returncode == 7, proc.err
    (spent,) = payload(events, "budget_exhausted")
    assert spent["limit"] == "max_wall_s"
    calls = payload(events, "model_call")
    if server.requests:  # the usual case: the budget ran out while the model was answering
        assert spent["during"] == "model call" and [c["error_type"] for c in calls] == ["timeout"]
    else:  # a machine so loaded that the baseline tests spent it: the record must say so, not "model call"
        assert spent.get("during") != "model call" and calls == []
    _verifies(agent.runs)


# ----------------------------------------------------------------------------
# Failures end in a closed run that verifies
# ----------------------------------------------------------------------------

def test_a_server_that_is_down_ends_in_a_closed_error_run(agent, tmp_path):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, env={"BASE_URL": f"http://127.0.0.1:{port}/v1"})
    assert proc.returncode == 1 and proc.out.split()[1] == "error"
    (error,) = payload(events, "error")
    assert "connection_refused" in error["message"]
    (line,) = error_lines(proc.err)
    assert line.startswith(f"error: run {run_dir.name}: ") and "connection_refused" in line
    assert len(payload(events, "model_call")) == 3  # retried within the budget, each attempt recorded
    _verifies(agent.runs)


@pytest.mark.parametrize("command,words", [
    (["definitely-not-a-program-0123"], "cannot run"),
    ([sys.executable, "-m", "pytest", "-q", "--no-such-option"], "pytest was called wrongly (exit 4)"),
    ([sys.executable, "-m", "pytest", "-q", "no_such_dir/"], "pytest was called wrongly (exit 4)"),
    ([sys.executable, "-m", "pytest", "-q", "-k", "no_test_has_this_name"], "pytest collected no tests (exit 5)"),
    ([sys.executable, "-S", "-m", "pytest", "-q"], "No module named pytest"),  # -S: no site-packages
], ids=["not-found", "bad-option", "bad-path", "no-tests", "no-pytest"])
def test_a_test_command_that_cannot_run_ends_the_run_before_any_model_call(agent, tmp_path, server, command, words):
    repo = make_repo(tmp_path / "repo")
    tools = tools_json(tmp_path / "broken.json", test_command=command)
    proc, run_dir, events = agent(repo, [propose(FIX)], tools_file=tools)
    assert proc.returncode == 1 and proc.out.split()[1] == "error", proc.err
    (error,) = payload(events, "error")
    assert error["type"] == "TestCommandError" and words in error["message"], error
    assert "fix test_command in" in error["message"] and server.requests == []
    (line,) = error_lines(proc.err)
    assert words in line
    _verifies(agent.runs)


def test_a_context_too_long_answer_shrinks_the_context_once_and_retries(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [{"name": "context_too_long"}, action("read_file", path="calc.py")],
                                  "--max-steps", "1")
    assert proc.returncode == 7, proc.err  # the retried call was answered; the step budget ended the run
    assert payload(events, "model_proposed")[0]["tool"] == "read_file"
    (shrunk,) = payload(events, "context_shrunk")
    assert shrunk["error_code"] == "context_length_exceeded" and shrunk["stated_window"] == 4096
    assert shrunk["before_max_tokens"] == 2048 > shrunk["after_max_tokens"]
    assert shrunk["after_chars"] < shrunk["before_chars"]
    assert payload(events, "model_call")[0]["error_code"] == "context_length_exceeded"
    proc, _run_dir, events = agent(repo, [{"name": "context_too_long"}] * 2)
    assert proc.returncode == 1 and "context_length_exceeded" in payload(events, "error")[0]["message"]


def test_sigterm_closes_the_run_as_an_error_with_a_traceback(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    held = threading.Event()  # the model never answers before the signal
    server.queue({"name": "sleepy", "hold": held, "answer": propose(FIX)})
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    proc = subprocess.Popen([sys.executable, str(ROOT / "agent.py"), "run", "--repo", str(repo), "--runs-dir",
                             str(agent.runs), "--tools", str(agent.tools)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240  # a hang guard
    while time.monotonic() < deadline and not server.requests:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        held.set()
    assert proc.returncode == 1, err
    run_dir = agent.runs / out.decode().split()[0]
    events = list(rl.read_events(run_dir / "events.jsonl"))
    (error,) = payload(events, "error")
    assert error["type"] == "_Terminated" and "SIGTERM" in error["message"]
    assert "Traceback" in (run_dir / error["traceback_artifact"]["path"]).read_text()
    assert events[-1]["kind"] == "run_closed" and events[-1]["payload"]["outcome"] == "error"
    _verifies(agent.runs)


# ----------------------------------------------------------------------------
# Locks and directories
# ----------------------------------------------------------------------------

def test_a_second_run_on_the_same_repo_exits_with_the_lock_code(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    other = make_repo(tmp_path / "other")
    held = threading.Event()  # the first run holds its lock, waiting for the model, until the second has run
    server.queue({"name": "sleepy", "hold": held, "answer": propose(FIX)})
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    first = subprocess.Popen([sys.executable, str(ROOT / "agent.py"), "run", "--repo", str(repo), "--runs-dir",
                              str(agent.runs), "--tools", str(agent.tools)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240  # a hang guard
    while time.monotonic() < deadline and not server.requests:
        time.sleep(0.05)
    try:
        second = run_script("agent.py", "run", "--repo", repo, "--runs-dir", agent.runs, "--tools", agent.tools,
                            env=env)
    finally:
        held.set()
    assert second.returncode == rl.EXIT_LOCKED == 6 and second.out == ""
    (line,) = error_lines(second.err)
    assert "another run holds the lock" in line and str(repo.resolve()) in line
    server.queue({"name": "ok", "answer": action("read_file", path="calc.py")})
    third = run_script("agent.py", "run", "--repo", other, "--runs-dir", agent.runs, "--tools", agent.tools,
                       "--max-steps", "1", env=env, timeout=120)  # a different repository is not locked out
    out, err = first.communicate(timeout=120)
    assert first.returncode == 8 and third.returncode == 7, (err, third.err)  # the third ran to its step budget
    assert out.split()[0] != third.out.split()[0]
    assert len(list(agent.runs.glob("*/events.jsonl"))) == 2  # the locked-out run opened nothing
    _verifies(agent.runs)


# ----------------------------------------------------------------------------
# Secrets
# ----------------------------------------------------------------------------

def test_a_secret_in_the_repos_env_never_reaches_the_ledger_or_the_model(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo", extra={".env": f"SECRET_TOKEN={ENV_SECRET}\nPLAIN=hello\n"})
    tools = tools_json(tmp_path / "leaky.json", plugins={
        "show_env": {"description": "prints .env (a careless plugin)", "argv": ["cat", ".env"], "args": {}}})
    proc, run_dir, events = agent(repo, [action("show_env"), action("grep", pattern="SECRET"), propose(FIX)],
                                  tools_file=tools)
    assert proc.returncode == 8, proc.err
    assert payload(events, "tool_result")[0]["returncode"] == 0
    assert ENV_SECRET.encode() not in all_bytes_under(agent.runs)
    assert ENV_SECRET not in json.dumps(server.requests)  # the model was shown the masked output
    assert KEY.encode() not in all_bytes_under(agent.runs)


# ----------------------------------------------------------------------------
# tools.json
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    ({"bogus": 1}, "tools.json.bogus: unknown key"),
    ({"budget": {"max_step": 3}}, "budget.max_step: unknown key; did you mean 'max_steps'?"),
    ({"builtins": ["read_file", "write_file"]}, "builtins: unknown tool 'write_file'"),
    ({"test_command": []}, "test_command: must be a non-empty list"),
    ({"version": 2}, "version: must be 1"),
    ({"plugins": {"x": {"description": "d", "argv": ["echo", "{a}"], "args": {"a": {"pattern": "(unclosed"}}}}},
     "plugins.x.args.a.pattern: bad regex"),
    ({"plugins": {"x": {"description": "d", "argv": ["echo", "{b}"], "args": {"a": {"pattern": "a"}}}}},
     "{b} is not declared in args"),
    ({"plugins": {"x": {"argv": ["echo"], "args": {}}}}, "plugins.x.description: missing (required)"),
    ({"plugins": {"x": {"description": "d", "argv": ["{a}"], "args": {"a": {"pattern": "a"}}}}},
     "argv[0]: the program is fixed"),
    ({"plugins": {"read_file": {"description": "d", "argv": ["cat"], "args": {}}}}, "is a built-in"),
    ({"plugins": {"x": {"description": "d", "argv": ["echo"], "args": {}, "timeout": 5}}},
     "plugins.x.timeout: unknown key; did you mean 'timeout_s'?"),
])
def test_check_tools_names_each_problem_precisely(tmp_path, change, words):
    import agent as agent_module
    with pytest.raises(agent_module.PolicyError) as caught:
        agent_module.load_policy(tools_json(tmp_path / "t.json", **change))
    assert any(words in problem for problem in caught.value.problems), caught.value.problems


def test_check_tools_says_every_problem_on_its_own_error_line(tmp_path):
    path = tools_json(tmp_path / "t.json", bogus=1, version=2, budget={"max_step": 3})
    proc = run_script("agent.py", "check-tools", path)
    assert proc.returncode == 2 and proc.out == ""
    lines = proc.err.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"error: {path}: ") for line in lines), lines
    for words in ("tools.json.bogus: unknown key", "version: must be 1", "budget.max_step: unknown key"):
        assert sum(words in line for line in lines) == 1, (words, lines)


def test_check_tools_accepts_the_shipped_file_and_rejects_broken_json(tmp_path):
    ok = run_script("agent.py", "check-tools")
    assert ok.returncode == 0 and ok.out.startswith("ok    ") and "2 plugins" in ok.out
    (tmp_path / "dup.json").write_text('{"version": 1, "version": 1, "test_command": ["x"]}')
    assert "duplicate key 'version'" in run_script("agent.py", "check-tools", tmp_path / "dup.json").err
    (tmp_path / "bad.json").write_text("{not json")
    assert run_script("agent.py", "check-tools", tmp_path / "bad.json").returncode == 2


def test_a_run_refuses_to_start_on_an_invalid_tools_json(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    bad = tools_json(tmp_path / "bad.json", builtins=["rm_rf"])
    proc, _run_dir, _events = agent(repo, [], tools_file=bad)
    assert proc.returncode == 2 and "unknown tool 'rm_rf'" in proc.err and not agent.runs.exists()
    assert server.requests == []


def test_a_vendored_copy_finds_its_own_tools_json(tmp_path, server):
    vendored = tmp_path / "vendor"
    vendored.mkdir()
    for name in ("reasoning_ledger.py", "ask.py", "fleet.py", "agent.py"):
        (vendored / name).write_bytes((ROOT / name).read_bytes())
    tools_json(vendored / "tools.json", test_command=[sys.executable, "-c", "pass"])
    repo = make_repo(tmp_path / "repo")
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    proc = subprocess.run([sys.executable, "-I", str(vendored / "agent.py"), "run", "--repo", str(repo)],
                          capture_output=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr  # the vendored test command passes: shipped tools.json's would fail
    events = list(rl.read_events(tmp_path / "runs" / proc.stdout.decode().split()[0] / "events.jsonl"))
    assert payload(events, "run_started")[0]["tools_path"] == str((vendored / "tools.json").resolve())


# ----------------------------------------------------------------------------
# Replay and the record of runs
# ----------------------------------------------------------------------------

def test_replay_with_a_stricter_tools_json_lists_each_flipped_decision(agent, tmp_path):
    """A run of four steps (its tools.json says so) whose last is a proposal git cannot apply: the
    decisions are all check_action's, and no judge is needed to have them."""
    repo = make_repo(tmp_path / "repo")
    four = tools_json(tmp_path / "four.json", budget={"max_steps": 4})
    proc, run_dir, events = agent(repo, [action("read_file", path="calc.py"), action("list_files"),
                                         action("read_file", path="../x"), propose(STALE)], tools_file=four)
    assert proc.returncode == 7, proc.err
    stricter = tools_json(tmp_path / "strict.json", builtins=["read_file", "propose_patch"], budget={"max_steps": 4},
                          paths={"allow": ["**"], "deny": [".git/", "calc.py"]})
    proc = run_script("agent.py", "replay", run_dir, "--tools", stricter)
    assert proc.returncode == rl.EXIT_CHANGED == 4, proc.out + proc.err
    lines = proc.out.splitlines()
    assert any("step 1: read_file" in line and "allowed by builtin.read_file -> denied by path.denied" in line
               for line in lines)
    assert any("step 2: list_files" in line and "-> denied by tool.unknown" in line for line in lines)
    assert any("step 4: propose_patch" in line and "-> denied by path.denied" in line for line in lines)
    assert not any("step 3" in line for line in lines)  # denied before, denied now, by the same rule
    assert lines[-1] == "3 decisions would change under " + str(stricter)
    same = run_script("agent.py", "replay", run_dir, "--tools", four)
    assert same.returncode == 0 and same.out.startswith("0 decisions")


def test_replay_reports_the_first_divergence(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [action("read_file", path="calc.py")], "--max-steps", "1")
    assert proc.returncode == 7, proc.err
    ledger = run_dir / "events.jsonl"
    lines = ledger.read_bytes().splitlines(keepends=True)
    # a record whose recorded decision differs from what the host decides: re-chained, so it verifies
    from conftest import chain
    bodies = [json.loads(line) for line in lines]
    for body in bodies:
        if body["kind"] == "tool_allowed" and body["payload"]["step"] == 1:
            body["payload"]["rule"] = "builtin.something_else"
    ledger.write_bytes(chain([dict(b, prev=None) for b in bodies]))
    proc = run_script("agent.py", "replay", run_dir)
    assert proc.returncode == 1 and "first divergence at seq" in proc.out and "builtin.something_else" in proc.out


def test_runs_lists_every_run_and_whether_it_verifies(agent, tmp_path):
    agent(make_repo(tmp_path / "passing", calc=CALC.replace("a - b", "a + b")))  # no model call
    agent(make_repo(tmp_path / "repo"), ["not json"], "--max-steps", "1")
    proc = run_script("agent.py", "runs", "--runs-dir", agent.runs)
    assert proc.returncode == 0, proc.err
    rows = proc.out.splitlines()[1:-1]  # under a header line, over the pointer to `report`
    assert len(rows) == 2 and "no_action" in rows[0] and "budget_exhausted" in rows[1]
    assert all(row.split()[5] == "ok" for row in rows) and rows[1].split()[3:5] == ["1", "27"]
    assert rows[0].split()[4] == "-"
    import agent as agent_module
    listed = agent_module.list_runs(agent.runs)
    assert [(r["tokens"], r["tokens_source"]) for r in listed] == [(None, None), (27, "reported")]
    events = next(p for p in agent.runs.glob("*/events.jsonl") if b'"outcome":"no_action"' in p.read_bytes())
    events.write_bytes(events.read_bytes().replace(b'"outcome":"no_action"', b'"outcome":"proposal_accepted"'))
    proc = run_script("agent.py", "runs", "--runs-dir", agent.runs)
    assert proc.returncode == 1 and "FAIL" in proc.out
    audit = run_script("audit.py", agent.runs, "--json")
    assert audit.returncode == 1  # the audit refuses a tampered run too


@pytest.mark.parametrize("tamper", ["flipped byte", "garbage line", "torn tail", "not UTF-8"])
def test_runs_refuses_a_broken_index_rather_than_vouch_for_the_runs_it_anchors(agent, tmp_path, tamper):
    """The index holds every closed run's head: with it broken, no run can be called verified, and a
    run cut back to before its run_closed must not pass as an open one."""
    agent(make_repo(tmp_path / "passing", calc=CALC.replace("a - b", "a + b")))
    agent(make_repo(tmp_path / "second", calc=CALC.replace("a - b", "a + b")))
    cut = sorted(agent.runs.glob("*/events.jsonl"))[1]
    cut.write_bytes(b"".join(cut.read_bytes().splitlines(keepends=True)[:-1]))  # its run_closed gone
    index = agent.runs / "index.jsonl"
    raw = index.read_bytes()
    index.write_bytes({"flipped byte": raw[:-20] + bytes([raw[-20] ^ 1]) + raw[-19:],
                       "garbage line": raw + b"garbage\n",
                       "torn tail": raw + b'{"seq":3,',
                       "not UTF-8": raw + b'\xff\xfe\n'}[tamper])
    proc = run_script("agent.py", "runs", "--runs-dir", agent.runs)
    assert proc.returncode == 1 and proc.out == "", (proc.returncode, proc.out)
    assert len(error_lines(proc.err)) == 1 == len(proc.err.splitlines()) and "index.jsonl" in proc.err, proc.err


def test_a_signing_key_checkpoints_the_run_and_the_index_at_close(agent, tmp_path):
    key = tmp_path / "log.key"
    vkey = run_script("reasoning_ledger.py", "keygen", "box.example/agent", "--out", key).out.strip()
    proc, run_dir, events = agent(make_repo(tmp_path / "repo"), [propose(FIX)],
                                  env={"LEDGER_SIGNING_KEY_FILE": str(key)})
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err
    index, ledger = agent.runs / rl.INDEX_NAME, run_dir / rl.EVENTS_NAME
    closing = list(rl.read_events(index))[-1]["payload"]
    # the run's closing line in the index carries the run ledger's checkpoint, of every line to run_closed
    assert Path(f"{ledger}.checkpoints").read_text() == closing["checkpoint"]
    assert rl.parse_checkpoint(closing["checkpoint"])[0].size == closing["head_seq"] == len(events)
    for path in (ledger, index):
        ok = run_script("reasoning_ledger.py", "verify", path, "--checkpoint", f"{path}.checkpoints", "--vkey", vkey)
        assert ok.returncode == 0, ok.out + ok.err
    assert key.read_text().strip().encode() not in all_bytes_under(agent.runs)
    _verifies(agent.runs)
