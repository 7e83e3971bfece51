"""Issue 28: a newcomer's second hour. The agent on your own repository without a model (the stand-in's
--replies, `make demo REPO=DIR PATCH=FILE`), an HTML report and a daemon timeline that can be read, and
messages that tell the truth (the masker, the drill, the audit's labels, plurals, help texts).
Everything runs as a user runs it: real files, git repositories, sockets on 127.0.0.1, subprocesses."""

import ast
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import agent as agent_module
import reasoning_ledger as rl
from conftest import KEY, ROOT, SAMPLE_CALC, clean_env, error_lines, make_repo, run_script, tools_json
from test_agent import propose, udiff
from test_daemon import TOKEN, github_headers, push_body, serve  # noqa: F401 (fixture)

README = (ROOT / "README.md").read_text(encoding="utf-8")
AGENT_DOC = (ROOT / "docs" / "agent.md").read_text(encoding="utf-8")
FIX = udiff("calc.py", SAMPLE_CALC, SAMPLE_CALC.replace("a - b", "a + b"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def need_make():
    if not shutil.which("make"):
        pytest.skip("needs make")


def stand_in(*args):
    """`python3 tests/fake_openai.py 0 ARGS` as README starts it; returns (process, base_url)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_openai.py"), "0", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready, _w, _x = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().decode() if ready else ""
    match = re.match(r"fake OpenAI-compatible server at (http://127\.0\.0\.1:[0-9]+/v1) ", line)
    if not match:
        proc.kill()
        raise AssertionError(f"the stand-in did not start: {line!r}")
    return proc, match.group(1)


@pytest.fixture
def started():
    procs = []

    def start(*args):
        proc, url = stand_in(*args)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


def http(url, body=None, headers=None):
    """(status, parsed JSON or text) of one request; an HTTP error status is an answer too."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, dict({"Content-Type": "application/json"}, **(headers or {})))
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            status, raw, kind = answer.status, answer.read(), answer.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    return status, json.loads(raw) if kind.startswith("application/json") else raw.decode("utf-8", "replace")


# ----------------------------------------------------------------------------
# 1. The agent on your own repository, without a model
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, line", [('{"tool": "list_files"}\n{"tool": \n', 2),
                                        ('"a reply"\n\n[1, 2]\nnot json\n', 4),
                                        ('{"a": 1}\n"\\ud800 fine"\n{"b": }\n', 3)])
def test_a_malformed_replies_file_is_exit_2_with_one_error_line_naming_the_line(tmp_path, text, line):
    replies = tmp_path / "replies.jsonl"
    replies.write_text(text)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_openai.py"), "0", "--replies", str(replies)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (error,) = proc.stderr.splitlines()
    assert error.startswith("error: ") and f"line {line}:" in error
    missing = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_openai.py"), "0", "--replies",
                              str(tmp_path / "nothere")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and len(error_lines(missing.stderr)) == 1 == len(missing.stderr.splitlines())


def test_a_replies_file_drives_the_agent_to_a_proposal_on_your_own_repository(tmp_path, started):
    repo = make_repo(tmp_path / "mine")
    replies = tmp_path / "replies.jsonl"
    steps = [{"tool": "read_file", "args": {"path": "calc.py"}, "reason": "the failing test names add"},
             json.loads(propose(FIX))]
    replies.write_text("".join(json.dumps(step) + "\n" for step in steps))
    url = started("--replies", replies)
    env = clean_env(BASE_URL=url, API_KEY="anything", MODEL_ID="stand-in-model", TMPDIR=str(tmp_path))
    before = (repo / "calc.py").read_text()
    proc = run_script("agent.py", "run", "--repo", repo, "--runs-dir", tmp_path / "runs", env=env, timeout=300)
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err
    run_id, outcome, patch = proc.out.split()
    assert outcome == "proposal_accepted" and Path(patch).read_text() .startswith("--- a/calc.py")
    assert (repo / "calc.py").read_text() == before
    calls = [e["payload"] for e in rl.read_events(tmp_path / "runs" / run_id / "events.jsonl")
             if e["kind"] == "model_call"]
    # usage of the right order: what the stand-in counts is within a factor 2 of the chars/4 estimate
    assert all(c["est_input_tokens"] / 2 <= c["input_tokens"] <= c["est_input_tokens"] * 2 for c in calls)


def test_make_demo_runs_on_your_repository_with_your_patch_or_none(tmp_path):
    need_make()
    repo = make_repo(tmp_path / "mine")
    (tmp_path / "fix.patch").write_text(FIX)
    before = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    env = clean_env(TMPDIR=str(tmp_path))
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "demo", f"REPO={repo}", f"PATCH={tmp_path / 'fix.patch'}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " proposal_accepted " in proc.stdout and "accept: the patch applies" in proc.stdout
    assert "+    return a + b" in proc.stdout and "not listed" not in proc.stdout + proc.stderr
    assert "reasoning_ledger.py report " in proc.stdout
    none = subprocess.run(["make", "-s", "-C", str(ROOT), "demo", f"REPO={repo}"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert none.returncode == 0 and " budget_exhausted -" in none.stdout, none.stdout + none.stderr
    after = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    assert after == before and (repo / "calc.py").read_text() == SAMPLE_CALC


def test_readme_says_how_to_go_from_no_model_to_your_repository_and_the_doc_has_every_action():
    assert "make demo REPO=" in README and "PATCH=" in README and "--replies" in README
    builtins = json.loads((ROOT / "tools.json").read_text())["builtins"]
    examples = {}
    for text in re.findall(r"^(\{\"tool\": .*\})$", AGENT_DOC, re.M):
        action, form = agent_module.parse_reply(text)
        assert form == "json" and action["reason"], text
        examples[action["tool"]] = action["args"]
    assert set(builtins) <= set(examples), set(builtins) - set(examples)
    patch = examples["propose_patch"]
    assert patch["patch"].startswith("--- a/") and "\n@@ " in patch["patch"] and patch["rationale"]


# ----------------------------------------------------------------------------
# 9, 14. The stand-in lists what it serves and answers like a real server
# ----------------------------------------------------------------------------

def test_the_stand_in_answers_every_v1_route_and_404s_off_v1(started):
    url = started("--model", "my-model")
    root = url[: -len("/v1")]
    status, models = http(url + "/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["my-model"]
    chat = {"model": "my-model", "messages": [{"role": "user", "content": "x" * 400}]}
    status, body = http(url + "/chat/completions", chat)
    assert status == 200 and body["choices"][0]["message"]["content"] and body["usage"]["prompt_tokens"] >= 100
    status, body = http(url + "/completions", {"model": "my-model", "prompt": "2+2="})
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"]
    status, body = http(url + "/responses", {"model": "my-model", "input": "2+2?"})
    assert status == 200 and body["object"] == "response" and body["output"][0]["content"][0]["text"]
    assert body["usage"]["input_tokens"] > 0
    status, body = http(url + "/embeddings", {"model": "my-model", "input": ["a", "b"]})
    assert status == 200 and len(body["data"]) == 2 and body["data"][0]["embedding"]
    status, events = http(url + "/responses", {"model": "my-model", "input": "2+2?", "stream": True})
    assert status == 200 and "event: response.completed" in events
    for path in ("/chat/completions", "/models", "/v2/chat/completions", "/"):
        assert http(root + path, chat if "chat" in path else None)[0] == 404, path
    env = clean_env(BASE_URL=root, API_KEY="anything", MODEL_ID="my-model")  # the mistake: no /v1
    assert run_script("ask.py", env=env, input="2+2?").returncode != 0


def test_the_demo_has_no_false_alarm_and_usage_of_the_right_order(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "demo.py")], capture_output=True, text=True,
                          env=clean_env(TMPDIR=str(tmp_path)), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not listed" not in proc.stdout + proc.stderr
    (row,) = re.findall(r"^stand-in-model +[0-9]+ +0 +0 +- +([0-9,]+) +([0-9,]+) +([0-9,]+) ", proc.stdout, re.M)
    reported, estimated = int(row[0].replace(",", "")) + int(row[1].replace(",", "")), int(row[2].replace(",", ""))
    assert estimated / 2 <= reported <= estimated * 2


# ----------------------------------------------------------------------------
# 5. The masker never rewrites the program's own words
# ----------------------------------------------------------------------------

def _message_texts():
    """Every string a room hands to a call (an error, a warning, an exception), f-string holes filled."""
    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "1" for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = text(node.left), text(node.right)
            return None if left is None and right is None else (left or "") + (right or "")
        return None

    for path in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and node.args:
                found = text(node.args[0])
                if found and " " in found:
                    yield path.name, node.lineno, found


def test_no_message_of_the_program_is_changed_by_the_masker():
    redactor = rl.Redactor([])
    texts = list(_message_texts())
    assert len(texts) > 150 and any("set WEBHOOK_SECRET" in t for _n, _l, t in texts)
    changed = [(name, line, t) for name, line, t in texts if redactor.text(t) != t]
    assert changed == []
    for secret in ("password=hunter2", "client_secret: colon-secret-16", "api_key: sk-abc"):
        assert redactor.text(secret) != secret  # values are still masked


def test_the_daemon_refusing_an_open_address_says_what_to_set(tmp_path):
    repo = make_repo(tmp_path / "repo")
    env = clean_env(BASE_URL="http://127.0.0.1:9/v1", API_KEY=KEY, MODEL_ID="m")
    proc = run_script("daemon.py", "--repo", repo, "--host", "0.0.0.0", "--runs-dir", tmp_path / "runs", env=env)
    assert proc.returncode == 2
    (line,) = error_lines(proc.err)
    assert "set WEBHOOK_SECRET or WEBHOOK_SECRET_FILE" in line and "REDACTED" not in line


# ----------------------------------------------------------------------------
# 6, 7, 8, 10, 11. The drill, the audit and verify say what is true
# ----------------------------------------------------------------------------

def test_drill_sh_exits_as_documented_and_names_failed_calls_and_checks_apart(tmp_path, server):
    prompts = tmp_path / "prompts"
    shutil.copytree(ROOT / "prompts", prompts)
    server.queue("ok", "server_error")  # the /models list, one failed call, then answers that fail the checks
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="fake-model", LEDGER=tmp_path / "calls.jsonl",
                    PROMPTS=prompts, DRILL_REPEAT="2")
    proc = subprocess.run(["sh", str(ROOT / "drill.sh")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "drill: 6 calls: 1 failed, 5 checks not passed" in proc.stdout
    assert len(error_lines(proc.stderr)) == 1 and "check" not in proc.stderr  # the failed call's line only
    config = subprocess.run(["sh", str(ROOT / "drill.sh")], capture_output=True, text=True,
                            env=dict(env, MODEL_ID=""), timeout=120)
    assert config.returncode == 2 and "drill: stopped: configuration error" in config.stderr
    docs = README + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    make_help = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True).stdout
    assert "drill.sh" in docs and "make's exit 2" in make_help and "exit 1 if any call" not in make_help


def test_audit_with_nothing_to_audit_is_exit_2_unless_allow_empty(tmp_path):
    proc = run_script("audit.py", cwd=tmp_path)
    assert proc.returncode == 2 and proc.out == ""
    (line,) = error_lines(proc.err)
    assert "nothing to audit" in line and "--allow-empty" in line
    empty = run_script("audit.py", "--allow-empty", cwd=tmp_path)
    assert empty.returncode == 0 and "audit: 0 ledgers, 0 model calls" in empty.out
    assert "usage: no ok calls" in empty.out and "0 of 0" not in empty.out


def _proxied(tmp_path, server):
    """A ledger the proxy wrote: two sessions, and one request it refused before sending (no model)."""
    ledger = tmp_path / "calls.jsonl"
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, LEDGER=ledger)
    proc = subprocess.Popen([sys.executable, str(ROOT / "proxy.py"), "--listen", "127.0.0.1:0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _w, _x = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline().decode() if ready else ""
        url = (re.findall(r"http://127\.0\.0\.1:[0-9]+", line) or [None])[0]
        assert url, line
        for session, model in (("alpha", "fake-model"), ("beta", "fake-model"), ("beta", None)):
            http(url + "/v1/models")  # the list: a model it does not name is flagged
            body = {"messages": [{"role": "user", "content": "2+2?"}], **({"model": model} if model else {})}
            http(url + "/v1/chat/completions", body, {"X-Ledger-Session": session})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    return ledger


def test_audit_by_session_is_labelled_by_session_and_unsent_calls_are_counted_apart(tmp_path, server):
    ledger = _proxied(tmp_path, server)
    text = run_script("audit.py", ledger, "--by", "session").out
    assert "Models by session" in text and "Models by day" not in text
    assert re.search(r"^model +session +calls", text, re.M) and "Changes (day over day)" not in text
    assert "not sent: 1 call refused by the proxy before sending (model_missing 1)" in text
    assert "not listed" not in text
    data = json.loads(run_script("audit.py", ledger, "--by", "session", "--json").out)
    assert data["by"] == "session" and data["summary"]["not_sent"] == {"model_missing": 1}
    assert sorted((r["session_id"], r["calls"], r["request_model"]) for r in data["models"]) == [
        ("alpha", 1, "fake-model"), ("beta", 1, "fake-model")]
    assert data["unlisted"] == []
    page = tmp_path / "page.html"
    run_script("audit.py", ledger, "--by", "session", "--html", page)
    assert "Models by session" in page.read_text() and 'data-field="session_id"' in page.read_text()


def test_verify_and_audit_errors_say_what_is_wrong_once(tmp_path):
    proc = run_script("reasoning_ledger.py", "verify", "nothere.jsonl", cwd=tmp_path)
    (line,) = error_lines(proc.err)
    assert proc.returncode == 2 and "1 ledger could not be read" in line and "key" not in line
    with rl.Ledger(tmp_path / "calls.jsonl") as ledger:
        ledger.append("note", {"text": "a"})
        ledger.append("note", {"text": "b"})
    head = run_script("reasoning_ledger.py", "head", tmp_path / "calls.jsonl").out.split()
    prefix = f"{head[0]}:{head[1][:8]}"
    proc = run_script("reasoning_ledger.py", "verify", tmp_path / "calls.jsonl", "--expect-head", prefix)
    (line,) = error_lines(proc.err)
    assert proc.returncode == 2 and "64-hex" in line
    raw = (tmp_path / "calls.jsonl").read_bytes()
    (tmp_path / "calls.jsonl").write_bytes(raw.replace(b'"a"', b'"x"'))
    proc = run_script("audit.py", tmp_path / "calls.jsonl")
    assert proc.returncode == 1 and len(error_lines(proc.err)) == 1, proc.err


def test_counts_of_one_are_singular(tmp_path, server):
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="fake-model", LEDGER=tmp_path / "calls.jsonl")
    run_script("ask.py", "--models", env=env)
    run_script("ask.py", env=dict(env, MODEL_ID="not-listed-model"), input="2+2?")
    text = run_script("audit.py", tmp_path / "calls.jsonl").out
    assert "1 ledger, 1 model call," in text and "(1 call)" in text and "cover 1 call (100%)" in text
    assert not re.search(r"\b1 (calls|runs|ledgers|model calls)\b", text)


# ----------------------------------------------------------------------------
# 12, 13, 15. Help texts and pointers
# ----------------------------------------------------------------------------

def test_agent_run_help_names_the_settings_and_exit_codes_and_runs_point_to_the_report(tmp_path, started):
    text = run_script("agent.py", "run", "--help").out
    for word in ("BASE_URL", "API_KEY", "MODEL_ID"):
        assert word in text
    for code in (6, 7, 8, 9):
        assert re.search(rf"^  {code}  ", text, re.M), code
    repo = make_repo(tmp_path / "mine")
    url = started()  # answers every call the same: the run is stuck
    env = clean_env(BASE_URL=url, API_KEY="anything", MODEL_ID="stand-in-model", TMPDIR=str(tmp_path))
    runs = tmp_path / "runs"
    proc = run_script("agent.py", "run", "--repo", repo, "--runs-dir", runs, env=env, timeout=300)
    assert proc.returncode == rl.EXIT_STUCK
    run_id = proc.out.split()[0]
    assert str(runs / run_id) in proc.err
    listed = run_script("agent.py", "runs", "--runs-dir", runs, env=env).out
    assert "reasoning_ledger.py report" in listed and "events.jsonl" in listed
    agent_section = README.split("### The coding agent", 1)[1].split("###", 1)[0]
    assert "reasoning_ledger.py report RUN/events.jsonl" in agent_section


def test_readme_ask_section_names_store_text():
    ask_section = README.split("### One call: `ask.py`", 1)[1].split("###", 1)[0]
    assert "--store-text" in ask_section
    assert "--store-text" in run_script("ask.py", "--help").out


# ----------------------------------------------------------------------------
# 4. The daemon serves a run's files, and the timeline shows the patch
# ----------------------------------------------------------------------------

def test_the_daemon_serves_the_files_a_run_lists_and_nothing_else(serve, server):
    repo = make_repo(serve.tmp / "mine")
    daemon = serve(repo=repo, tools=tools_json(serve.tmp / "pytest-tools.json"), env={"READ_TOKEN": TOKEN})
    server.queue(*[{"name": "ok", "answer": reply} for reply in (
        json.dumps({"tool": "read_file", "args": {"path": "calc.py"}, "reason": "look"}), propose(FIX))])
    body = push_body()
    run_id = daemon.post(body, github_headers(body, delivery="files-1")).json()["run_id"]
    assert daemon.finished([run_id])[run_id]["outcome"] == "proposal_accepted"
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    run_dir = serve.runs / run_id
    answer = daemon.get(f"/runs/{run_id}/proposal.patch", bearer)
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/plain")
    assert answer.body == (run_dir / "proposal.patch").read_bytes()
    assert daemon.get(f"/runs/{run_id}/proposal.patch").status == 401  # the read token applies
    listed = sorted(p.name for p in (run_dir / "artifacts").iterdir())
    assert listed and all(daemon.get(f"/runs/{run_id}/artifacts/{n}", bearer).status == 200 for n in listed)
    # names the ledger does not list, paths out of the run, links and other kinds of file
    (serve.runs / "secret.txt").write_text("not for you")
    stray = "ab" * 32
    (run_dir / "artifacts" / stray).write_text("not for you")
    linked = "cd" * 32
    os.symlink(serve.runs / "secret.txt", run_dir / "artifacts" / linked)
    data = (run_dir / "events.jsonl").read_bytes()
    for path in (f"/runs/{run_id}/artifacts/{stray}", f"/runs/{run_id}/events.jsonl",
                 f"/runs/{run_id}/../secret.txt", f"/runs/{run_id}/..%2fsecret.txt",
                 f"/runs/{run_id}/artifacts/../../secret.txt", f"/runs/{run_id}/artifacts/{listed[0]}/x",
                 f"/runs/{run_id}/artifacts/{listed[0][:-1]}", f"/runs/{run_id}/%2e%2e/%2e%2e/secret.txt",
                 f"/runs/{run_id}/proposal.patch/", f"/runs/{run_id}//proposal.patch"):
        answer = daemon.get(path, bearer)
        assert answer.status == 404 and b"not for you" not in answer.body, path
    # a listed name that is a link (the run's own file swapped for one) is not followed
    target = run_dir / "artifacts" / listed[0]
    target.unlink()
    os.symlink(serve.runs / "secret.txt", target)
    answer = daemon.get(f"/runs/{run_id}/artifacts/{listed[0]}", bearer)
    assert answer.status == 404 and b"not for you" not in answer.body
    (run_dir / "proposal.patch").unlink()
    os.mkfifo(run_dir / "proposal.patch")  # a FIFO would hang a reader that opened it blocking
    assert daemon.get(f"/runs/{run_id}/proposal.patch", bearer).status == 404
    assert (run_dir / "events.jsonl").read_bytes() == data  # read-only


def test_the_timeline_links_the_files_and_colours_the_patch(serve, server):
    repo = make_repo(serve.tmp / "mine")
    daemon = serve(repo=repo, tools=tools_json(serve.tmp / "pytest-tools.json"))
    server.queue({"name": "ok", "answer": propose(FIX)})
    body = push_body()
    run_id = daemon.post(body, github_headers(body, delivery="timeline-1")).json()["run_id"]
    daemon.finished([run_id])
    page = daemon.get(f"/runs/{run_id}", {"Accept": "text/html"}).body.decode()
    links = set(re.findall(r'href="(/runs/[^"]+)"', page))
    assert f"/runs/{run_id}/proposal.patch" in links and any("/artifacts/" in link for link in links)
    for link in links:
        assert daemon.get(link).status == 200, link
    assert '<span class="add">+    return a + b</span>' in page
    assert '<span class="del">-    return a - b</span>' in page and '<span class="hunk">@@ ' in page


# ----------------------------------------------------------------------------
# 2, 3. The HTML report: cards that show failed checks, tables that can be read
# ----------------------------------------------------------------------------

SAMPLE = json.loads(re.findall(r'^(\{"seq":1,.*"kind":"model_call".*\})$', README, re.M)[0])["payload"]


def _drill_ledger(path, checks_failed=16, checks=17):
    with rl.Ledger(path) as ledger:
        for n in range(checks):
            ledger.append("model_call", dict(SAMPLE, check=n >= checks_failed))


def test_the_cards_count_failed_checks_apart_from_failed_calls(tmp_path):
    _drill_ledger(tmp_path / "calls.jsonl")
    page = tmp_path / "page.html"
    run_script("audit.py", tmp_path / "calls.jsonl", "--html", page)
    found = re.findall(r'<div class="k">([^<]+)</div><div class="v">([^<]+)</div><div class="s">([^<]*)</div>',
                       page.read_text())
    cards = {k: (v, s) for k, v, s in found}
    assert cards["Checks passed"][0] == "1 / 17"
    assert cards["Failed"][0] == "16" and "0 calls failed" in cards["Failed"][1]
    assert "16 checks not passed" in cards["Failed"][1]


MEASURE = """<pre id="measured"></pre><script>
const out = [];
const ctx = document.createElement("canvas").getContext("2d");
for (const cell of document.querySelectorAll("table td.t, table th.t")) {
  const style = getComputedStyle(cell);
  ctx.font = style.font;
  const inner = cell.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  out.push({table: cell.closest("table").className, text: cell.textContent.slice(0, 40),
            chars: inner / ctx.measureText("0").width});
}
const cut = [];
for (const box of document.querySelectorAll(".scroll")) {
  const table = box.querySelector("table");
  if (table.getBoundingClientRect().width > box.scrollWidth + 1) cut.push(table.className);
}
const numbers = [...document.querySelectorAll("table.models td:not(.t):not(.null)")]
  .filter(td => getComputedStyle(td).textAlign !== "right").length;
document.getElementById("measured").textContent = JSON.stringify({cells: out, cut: cut, numbers: numbers});
</script></body>"""


def test_the_html_tables_are_readable_at_1300_px_in_chromium(tmp_path):
    if not CHROMIUM:
        if os.environ.get("CHROMIUM_REQUIRED") == "1":  # set by .ci/run
            pytest.fail("chromium is missing: .ci/run installs Debian's chromium")
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    ledger = tmp_path / "calls.jsonl"
    long_url = "https://inference.some-provider.example.com/openai/deployments/team-a/v1"
    with rl.Ledger(ledger) as writer:
        for n, model in enumerate(("meta-llama/Meta-Llama-3.1-70B-Instruct-Turbo", "qwen2.5-coder:32b-instruct-q4",
                                   "gpt-4o")):
            for day in range(3):
                writer.append("model_call", dict(SAMPLE, request_model=model, response_model=model + "-served",
                                                 base_url=long_url if n else SAMPLE["base_url"],
                                                 error_type="server_error" if day == 2 else None,
                                                 input_tokens=123456789, output_tokens=98765432))
    page = tmp_path / "page.html"
    proc = run_script("audit.py", ledger, "--html", page)
    assert proc.returncode == 0, proc.err
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", MEASURE))
    profile = tmp_path / "profile"
    profile.mkdir()
    dump = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", "--window-size=1300,1000", "--dump-dom",
                           probe.as_uri()], capture_output=True, text=True, timeout=180)
    (found,) = re.findall(r'<pre id="measured">(.*?)</pre>', dump.stdout, re.S)
    measured = json.loads(found.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                          .replace("&gt;", ">"))
    assert measured["cells"], "no text cell was measured"
    narrow = [c for c in measured["cells"] if c["chars"] < 8]
    assert narrow == [] and measured["cut"] == [] and measured["numbers"] == 0


# ----------------------------------------------------------------------------
# 16. make test does not depend on where the clone sits
# ----------------------------------------------------------------------------

def test_the_unprivileged_user_test_runs_from_a_clone_others_cannot_read(tmp_path):
    if os.getuid() != 0 or not shutil.which("bwrap"):
        pytest.skip("running as another user needs root and bwrap")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    clone = closed / "clone"
    # dot entries left out: .git, .venv and the temp dirs that other tests make in the clone meanwhile
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".*", "__pycache__"))
    env = clean_env(TMPDIR=tempfile.gettempdir())
    env.pop("TEST_SHARD", None)  # under `make test`, the shard would deselect the one test named
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/test_sandbox.py::test_the_attack_takes_no_effect_as_an_unprivileged_user"],
                          cwd=clone, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]
