"""The holes of issue 16, each at its class: the proposal is byte-exact and never holds a secret value, path
rules hold for every git output and every walker, credential variables named the common ways are secrets,
a run that verifies replays, a run always closes, the budget record says where the budget ran out, and the
error line names the error's type. agent.py runs as a user runs it; only the model is a stand-in."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import reasoning_ledger as rl
from conftest import KEY, ROOT, all_bytes_under, clean_env, error_lines
from test_agent import (CALC, FIX, TESTS, _replays, _verifies, action, agent, git, make_repo, payload,  # noqa: F401
                        propose, tools_json, udiff)

AUTH = "def clean(raw):\n    password = raw.strip\n    return password\n"
AUTH_TESTS = "from auth import clean\n\n\ndef test_clean():\n    assert clean('  pw  ') == 'pw'\n"
AUTH_FIX = udiff("auth.py", AUTH, AUTH.replace("raw.strip\n", "raw.strip()\n"))
DOTENV_VALUE = "dotenv-value-0123456789abcdef"
ENV_VALUE = "environment-value-9876543210zyx"


def commit(repo, message="c"):
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD").decode().strip()


def told(server, index):
    """What the model was told last in its request number `index`."""
    return server.requests[index]["body"]["messages"][-1]["content"]


def host_said(server):
    """Everything the host sent the model (its own replies, sent back, left out), as one text."""
    return json.dumps([m["content"] for r in server.requests for m in r["body"]["messages"]
                       if m["role"] != "assistant"])


# ----------------------------------------------------------------------------
# 1. The proposal is byte-exact; a patch holding a known secret value is refused
# ----------------------------------------------------------------------------

def test_the_proposal_is_the_exact_bytes_accepted_even_when_they_look_like_a_secret(agent, tmp_path):
    repo = make_repo(tmp_path / "repo", calc=CALC.replace("a - b", "a + b"),
                     extra={"auth.py": AUTH, "test_auth.py": AUTH_TESTS})
    proc, run_dir, events = agent(repo, [propose(AUTH_FIX)])
    assert proc.returncode == 8, proc.err + json.dumps(payload(events, "judge_verdict"))
    data = (run_dir / "proposal.patch").read_bytes()
    assert data == AUTH_FIX.encode() and b"password = raw.strip()" in data
    import hashlib
    assert hashlib.sha256(data).hexdigest() == payload(events, "decision")[0]["proposal_sha256"]
    assert payload(events, "judge_verdict")[0]["verdict"] == "accept"
    _replays(run_dir)


@pytest.mark.parametrize("where", ["dotenv", "environment"])
def test_a_patch_holding_a_known_secret_value_is_refused_by_rule_and_the_value_never_told(agent, tmp_path, server,
                                                                                            where):
    repo = make_repo(tmp_path / "repo", extra={".env": f"DEPLOY_TOKEN={DOTENV_VALUE}\n"})
    value = DOTENV_VALUE if where == "dotenv" else ENV_VALUE
    leaky = udiff("calc.py", CALC, CALC.replace("a - b", "a + b") + f'\n\nTOKEN = "{value}"\n')
    proc, run_dir, events = agent(repo, [propose(leaky), propose(FIX)], env={"DEPLOY_TOKEN": ENV_VALUE})
    assert proc.returncode == 8, proc.err
    (refused,) = payload(events, "patch_rejected")
    assert refused["rule"] == "patch.secret" and value not in refused["message"]
    assert "(rule patch.secret)" in told(server, 1) and value not in host_said(server)
    assert [p["step"] for p in payload(events, "decision")] == [2]
    assert (run_dir / "proposal.patch").read_bytes() == FIX.encode()
    assert value.encode() not in all_bytes_under(agent.runs)
    _replays(run_dir)


# ----------------------------------------------------------------------------
# 2. Path rules hold for every git output, whatever the diff format
# ----------------------------------------------------------------------------

def _merge_with_conflict(repo, name):
    """A merge commit whose `name` differs from both parents: `git show` prints it as `diff --cc`."""
    git(repo, "checkout", "-qb", "side")
    (repo / name).write_text("marker-side-ZQX-1\n")
    commit(repo, "side")
    git(repo, "checkout", "-q", "-")
    (repo / name).write_text("marker-main-ZQX-2\n")
    commit(repo, "main")
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "merge", "-q", "side"],
                   capture_output=True, env=clean_env())
    (repo / name).write_text("marker-merged-ZQX-3\n")
    return commit(repo, "merge")


@pytest.mark.parametrize("name", ["deploy.key", "app-secret.yml", ".env"])
def test_a_merge_commits_combined_diff_of_a_denied_file_never_reaches_the_model(agent, tmp_path, server, name):
    repo = make_repo(tmp_path / "repo", extra={name: "marker-base-ZQX-0\n"})
    merge = _merge_with_conflict(repo, name)
    shown = git(repo, "show", "--format=", merge).decode()
    assert f"diff --cc {name}" in shown  # the format the filter must read
    proc, run_dir, events = agent(repo, [action("git_diff"), propose(FIX)], "--ref", merge)
    assert proc.returncode == 8, proc.err
    assert "ZQX" not in json.dumps(server.requests)
    assert b"ZQX" not in all_bytes_under(run_dir)


def test_renames_copies_binary_and_mode_sections_of_denied_files_are_left_out(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo", extra={"id_rsa": "marker-key-ZQX-0\n" * 3, "keep.txt": "k\n"})
    (repo / "blob.key").write_bytes(b"\0marker-binary-ZQX\0")
    commit(repo, "secrets")
    git(repo, "mv", "id_rsa", "renamed.txt")
    (repo / "renamed.txt").write_text("marker-key-ZQX-0\n" * 3 + "marker-renamed-ZQX-1\n")
    (repo / "blob.key").write_bytes(b"\0marker-binary-ZQX-2\0")
    os.chmod(repo / "keep.txt", 0o755)
    head = commit(repo, "rename")
    proc, run_dir, events = agent(repo, [action("git_diff"), propose(FIX)], "--ref", head)
    assert proc.returncode == 8, proc.err
    shown = told(server, 1)
    assert "ZQX" not in json.dumps(server.requests) and "blob.key" not in shown and "renamed.txt" not in shown
    assert "keep.txt" in shown  # a mode change of an allowed file is still shown


def test_the_values_of_env_files_at_the_ref_are_masked_not_only_the_working_trees(agent, tmp_path, server):
    printing = TESTS + "\n\ndef test_env():\n    assert open('.env').read() == ''\n"
    repo = make_repo(tmp_path / "repo", tests=printing, extra={".env": f"GREETING={DOTENV_VALUE}\n"})
    ref = git(repo, "rev-parse", "HEAD").decode().strip()
    os.unlink(repo / ".env")
    commit(repo, "the .env is gone from the working tree, not from history")
    proc, run_dir, events = agent(repo, [propose(FIX)], "--ref", ref)
    assert proc.returncode == 3, proc.err  # test_env still fails in the judge's copy
    assert payload(events, "tests_run")[0]["counts"]["failed"] == 2
    assert DOTENV_VALUE not in json.dumps(server.requests)
    assert DOTENV_VALUE.encode() not in all_bytes_under(agent.runs)


# ----------------------------------------------------------------------------
# 3. Every file a tool reads or walks is judged by its resolved path
# ----------------------------------------------------------------------------

def test_grep_and_list_files_through_a_symlinked_directory_judge_each_file_by_its_resolved_path(agent, tmp_path,
                                                                                                 server):
    repo = make_repo(tmp_path / "repo", extra={"deploy/prod/db.yml": "password_hint: marker-ZQX-db\n",
                                               "deploy/prod/readme.txt": "open\n"})
    os.symlink("deploy/prod", repo / "current")
    commit(repo, "link")
    tools = tools_json(tmp_path / "deny.json", paths={"deny": [".git/", ".env*", "deploy/prod/db.yml"]})
    replies = [action("read_file", path="current/db.yml"), action("grep", pattern="ZQX", path="current"),
               action("grep", pattern="ZQX"), action("list_files", path="current"), propose(FIX)]
    proc, run_dir, events = agent(repo, replies, tools_file=tools)
    assert proc.returncode == 8, proc.err
    assert payload(events, "tool_denied")[0]["rule"] == "path.denied"
    assert "ZQX" not in host_said(server)
    listed = told(server, 4)
    assert "current/readme.txt" in listed and "db.yml" not in listed


# ----------------------------------------------------------------------------
# 4. Credential variables named the common ways are secrets
# ----------------------------------------------------------------------------

# The tools an agent's repository meets and the variables their documentation names for a credential.
TOOLS = {"PG": ("PASSWORD",), "MYSQL": ("PWD", "PASSWORD"), "MARIADB": ("PASSWORD",), "REDIS": ("PASSWORD",),
         "MONGO": ("PASSWORD",), "CLICKHOUSE": ("PASSWORD",), "SNOWFLAKE": ("PASSWORD",), "ORACLE": ("PWD",),
         "SQLCMD": ("PASSWORD",), "AWS": ("SECRET_ACCESS_KEY", "SESSION_TOKEN"), "AZURE": ("CLIENT_SECRET",),
         "ARM": ("CLIENT_SECRET", "ACCESS_KEY"), "GOOGLE": ("OAUTH_ACCESS_TOKEN",), "DIGITALOCEAN": ("TOKEN",),
         "HCLOUD": ("TOKEN",), "OS": ("PASSWORD",), "NPM": ("TOKEN",), "NODE": ("AUTH_TOKEN",),
         "TWINE": ("PASSWORD",), "CARGO_REGISTRY": ("TOKEN",), "GEM_HOST": ("API_KEY",), "NUGET": ("API_KEY",),
         "DOCKER": ("PASSWORD",), "HF": ("TOKEN",), "VAULT": ("TOKEN",), "GITLAB": ("TOKEN",), "GH": ("TOKEN",)}
GLUED = ("PGPASSWORD", "SQLCMDPASSWORD", "MYSQLPASSWORD", "GITLABTOKEN")
NAMED = ("SSHPASS", "MYSQL_PWD", "REDISCLI_AUTH", "PGPASSWORD", "NPM_CONFIG__AUTH", "DATABASE_URL",
         "PIP_INDEX_URL", "UV_INDEX_URL", "AZURE_STORAGE_CONNECTION_STRING", "POETRY_PYPI_TOKEN_PYPI",
         "POETRY_HTTP_BASIC_PRIVATE_PASSWORD", "BUNDLE_GEMS__EXAMPLE__COM", "COMPOSER_AUTH", "DOCKER_AUTH_CONFIG",
         "GOOGLE_APPLICATION_CREDENTIALS_JSON", "CLOUDSDK_AUTH_ACCESS_TOKEN", "ISC_PASSWORD")
PLAIN = ("PATH", "HOME", "PWD", "OLDPWD", "LANG", "SHELL", "TERM", "USER", "PYTHONPATH", "VIRTUAL_ENV", "EDITOR",
         "TZ", "LC_ALL", "HOSTNAME", "GIT_AUTHOR_NAME", "TOKENIZERS_PARALLELISM", "GIT_ASKPASS", "SSH_ASKPASS",
         "PASSWORD_STORE_DIR", "BYPASS_CACHE", "COMPASS", "PGHOST", "PGUSER", "PGDATABASE", "MYSQL_HOST")


def generated_secret_names():
    names = [f"{tool}_{word}" for tool, words in TOOLS.items() for word in words]
    return sorted(set(names + list(GLUED) + list(NAMED)))


@pytest.mark.parametrize("name", generated_secret_names())
def test_credential_variables_named_the_common_ways_are_secrets(name):
    assert rl.is_secret_env_name(name), name


@pytest.mark.parametrize("name", PLAIN)
def test_ordinary_variables_are_not_secrets(name):
    assert not rl.is_secret_env_name(name), name


def test_credential_variables_reach_neither_the_patched_code_nor_the_record(agent, tmp_path, server):
    names = generated_secret_names()
    values = {name: f"value-of-{name.lower()}-0123456789" for name in names}
    dump = ("import os, sys\nprint(sorted(os.environ))\n"
            "print([v for v in os.environ.values() if v.startswith('value-of-')])\nsys.exit(1)\n")
    tools = tools_json(tmp_path / "dump.json", test_command=[sys.executable, "-c", dump])
    proc, run_dir, events = agent(repo := make_repo(tmp_path / "repo"), [action("run_tests")] * 2, "--max-steps",
                                  "1", tools_file=tools, env=values)
    assert proc.returncode == 7, proc.err
    output = (run_dir / payload(events, "tests_run")[0]["output_artifact"]["path"]).read_text()
    assert "'PATH'" in output and not [n for n in names if f"'{n}'" in output]  # not in the child's environment
    blob = all_bytes_under(agent.runs) + json.dumps(server.requests).encode()
    assert not [n for n, v in values.items() if v.encode() in blob]
    assert repo.exists()


def test_docs_secrets_documents_the_rule_and_the_list_and_readme_links_it():
    doc = (ROOT / "docs" / "secrets.md").read_text()
    for name in ("PGPASSWORD", "MYSQL_PWD", "SSHPASS", "DATABASE_URL"):
        assert name in doc
    readme = (ROOT / "README.md").read_text()
    assert "docs/secrets.md" in readme.split("### The trust boundary", 1)[1].split("\n### ", 1)[0]


# ----------------------------------------------------------------------------
# 5. A run that verifies replays identically
# ----------------------------------------------------------------------------

def test_a_reply_whose_masked_text_no_longer_parses_still_replays_identically(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    reply = json.dumps({"tool": "read_file", "args": {"path": "calc.py"},
                        "reason": "see how the Authorization: header is read before the fix"})
    proc, run_dir, events = agent(repo, [reply, propose(FIX)])
    assert proc.returncode == 8, proc.err
    stored = (run_dir / payload(events, "model_proposed")[0]["call"]["reply_artifact"]["path"]).read_text()
    assert "Authorization: [REDACTED]" in stored  # the text kept for humans is masked
    _verifies(agent.runs)
    _replays(run_dir)


# ----------------------------------------------------------------------------
# 6. A run always closes, whenever the signal comes
# ----------------------------------------------------------------------------

# Runs agent.py with an audit hook that, at the first audit event named EVENT whose arguments mention
# SUBSTRING, touches PAUSE_DIR/at, then waits for PAUSE_DIR/go; a SIGTERM that arrives during the wait
# touches PAUSE_DIR/handled before the agent's own handler runs. The test signals between the two.
PAUSER = r'''
import os, runpy, signal, sys, threading, time
event, substring, where = os.environ["PAUSE_EVENT"], os.environ["PAUSE_SUBSTRING"], os.environ["PAUSE_DIR"]
state = {"busy": False, "done": False}

def touch(name):
    with open(os.path.join(where, name), "w"):
        pass

def pause():
    agents = signal.getsignal(signal.SIGTERM)

    def relay(signum, frame):
        touch("handled")
        agents(signum, frame)
    signal.signal(signal.SIGTERM, relay)
    touch("at")
    try:
        while not os.path.exists(os.path.join(where, "go")):
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, agents)

def hook(name, args):
    if state["busy"] or state["done"] or name != event or threading.current_thread() is not threading.main_thread():
        return
    state["busy"] = True
    try:
        if substring in repr(args[:2]):  # the program or path, not the environment
            state["done"] = True
            pause()
    finally:
        state["busy"] = False

sys.argv = sys.argv[1:]
sys.addaudithook(hook)
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _wait_for(path, proc, what):
    deadline = time.monotonic() + 240  # a hang guard only
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"never reached {what}: {proc.communicate()}")
        time.sleep(0.02)


POINTS = {"baseline-tests": ("subprocess.Popen", "pytest"), "model-call": ("socket.connect", "{port}"),
          "removing-a-patch-check": ("shutil.rmtree", "agent-patch-"), "writing-proposal": ("open", "proposal.patch"),
          "starting-judge": ("subprocess.Popen", "judge"), "judge-testing": (None, None),
          "removing-scratch": ("shutil.rmtree", "agent-2")}
# In the judge's copy add() is fixed: this test then says where it is and waits, so the signal comes mid-judge.
WAITING_TEST = ("\n\ndef test_wait():\n    import os, time\n    if add(2, 3) == 5:\n"
                "        open(os.path.join(os.environ['PAUSE_DIR'], 'at'), 'w').close()\n"
                "        while not os.path.exists(os.path.join(os.environ['PAUSE_DIR'], 'go')):\n"
                "            time.sleep(0.01)\n")


@pytest.mark.parametrize("point", list(POINTS))
def test_a_sigterm_at_any_point_after_run_started_closes_the_run_and_removes_its_temp_dirs(agent, tmp_path, server,
                                                                                          point):
    event, substring = POINTS[point]
    no_action = point == "removing-scratch"  # the tests pass: the run's work ends at once, and it closes
    repo = make_repo(tmp_path / "repo", calc=CALC.replace("a - b", "a + b") if no_action else CALC,
                     tests=TESTS + (WAITING_TEST if point == "judge-testing" else ""))
    server.queue(*([] if no_action else [{"name": "ok", "answer": propose(FIX)}]))
    pauser, pause_dir, tmp = tmp_path / "pauser.py", tmp_path / "pause", tmp_path / "tmp"
    pauser.write_text(PAUSER)
    pause_dir.mkdir()
    tmp.mkdir()
    port = server.base_url.split(":")[2].split("/")[0]
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model", TMPDIR=tmp,
                    PAUSE_EVENT=event or "-", PAUSE_SUBSTRING=(substring or "-").format(port=port),
                    PAUSE_DIR=pause_dir)
    # The judge's test signals the pause through PAUSE_DIR, which a box hides: this point runs unboxed.
    tools = tools_json(tmp_path / "unboxed.json", sandbox="off") if point == "judge-testing" else agent.tools
    proc = subprocess.Popen([sys.executable, str(pauser), str(ROOT / "agent.py"), "run", "--repo", str(repo),
                             "--runs-dir", str(agent.runs), "--tools", str(tools)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(pause_dir / "at", proc, point)
    proc.send_signal(signal.SIGTERM)
    if event:  # paused in the agent itself: let it go on once the signal has been handled
        _wait_for(pause_dir / "handled", proc, "the signal handler")
        (pause_dir / "go").touch()
    try:
        out, err = (s.decode() for s in proc.communicate(timeout=240))
    finally:
        (pause_dir / "go").touch()  # a test the judge ran, left waiting by the judge's end
    assert proc.returncode == 1 and "Traceback" not in err, err
    run_id, outcome, proposal = out.split()
    assert outcome == "error" and proposal == "-"
    (line,) = error_lines(err)
    assert line.startswith(f"error: run {run_id}: _Terminated: ") and "SIGTERM" in line
    events = list(rl.read_events(agent.runs / run_id / "events.jsonl"))
    assert [e["kind"] for e in events][-2:] == ["error", "run_closed"]
    assert events[-1]["payload"]["outcome"] == "error"
    index = rl.read_events(agent.runs / "index.jsonl", run_id=None)
    assert [p["run"] for p in payload(index, "run_closed")] == [run_id]
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("reasoning-ledger-locks-")] == []
    _verifies(agent.runs)


# ----------------------------------------------------------------------------
# 7. The budget record says where the budget ran out
# ----------------------------------------------------------------------------

def test_a_wall_budget_spent_before_the_model_is_called_is_not_recorded_as_during_a_model_call(agent, tmp_path,
                                                                                                server):
    """The test command holds until the run has used two of its three seconds (a lower bound, not a race):
    the budget then runs out before any model call, wherever the host notices it."""
    marker, go = tmp_path / "testing", tmp_path / "go"
    hold = (f"import os, sys, time\nopen({str(marker)!r}, 'w').close()\n"
            f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\nsys.exit(1)\n")
    # unboxed: the held test command signals through tmp_path, which a box hides
    tools = tools_json(tmp_path / "hold.json", test_command=[sys.executable, "-c", hold], sandbox="off")
    settings = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    proc = subprocess.Popen([sys.executable, str(ROOT / "agent.py"), "run", "--repo", str(make_repo(tmp_path / "r")),
                             "--runs-dir", str(agent.runs), "--tools", str(tools), "--max-wall-s", "3"],
                            env=settings, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(marker, proc, "the test command")
    time.sleep(2.2)  # the run started before the test command did: it has used at least this much
    go.touch()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 7, err
    events = list(rl.read_events(agent.runs / out.decode().split()[0] / "events.jsonl"))
    (spent,) = payload(events, "budget_exhausted")
    assert spent["limit"] == "max_wall_s" and spent.get("during") != "model call", spent
    assert server.requests == [] and payload(events, "model_call") == []


# ----------------------------------------------------------------------------
# 10. The error line names the error's type
# ----------------------------------------------------------------------------

def test_a_model_endpoint_failure_names_its_type_on_the_error_line(agent, tmp_path):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    proc, run_dir, events = agent(make_repo(tmp_path / "repo"), env={"BASE_URL": f"http://127.0.0.1:{port}/v1"})
    assert proc.returncode == 1, proc.err
    (line,) = error_lines(proc.err)
    (error,) = payload(events, "error")
    assert error["type"] and error["type"] != "None"
    assert line.startswith(f"error: run {run_dir.name}: {error['type']}: ") and ": None:" not in line, line
