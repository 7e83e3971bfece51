"""Reasons everywhere, asserted on what the user sees: `agent.py runs` (headers, why), the stderr line of a
test command that cron's PATH breaks, and the daemon's stdout, its index page, its timeline summary and its
access log."""

import html.parser
import os
import select
import signal
import socket
import subprocess

import pytest

from conftest import run_script
from test_agent import FIX, action, agent, make_repo, propose, tools_json  # noqa: F401
from test_daemon import TOKEN, github_headers, push_body, serve  # noqa: F401


class Page(html.parser.HTMLParser):
    """The tags and the text of a page, failing on any event-handler attribute."""

    def __init__(self, text):
        super().__init__()
        self.tags, self.text = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        assert not any(name.startswith("on") for name, _v in attrs), (tag, attrs)

    def handle_data(self, data):
        self.text.append(data)


def test_runs_has_headers_and_says_why_each_run_ended(agent, tmp_path):
    repo = make_repo(tmp_path / "repo")
    agent(repo, [propose(FIX)])
    agent(repo, [action("read_file", path="calc.py")], "--max-steps", "1")
    agent(repo, ["no json here"] * 3)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    agent(repo, env={"BASE_URL": down})
    proc = run_script("agent.py", "runs", "--runs-dir", agent.runs)
    assert proc.returncode == 0, proc.err
    header, *rows, hint = proc.out.splitlines()
    assert header.split() == ["RUN", "STARTED", "OUTCOME", "STEPS", "TOKENS", "VERIFIED", "WHY"]
    assert len(rows) == 4 and hint.startswith("a run step by step: reasoning_ledger.py report ")
    why = {row.split()[2]: row.split("  ok  ", 1)[1].strip() for row in rows}
    assert why["proposal_accepted"].startswith("judge accept: ")
    assert why["budget_exhausted"] == "budget max_steps: 1 of 1"
    assert why["stuck"] == "stuck: the same unusable reply 3 times (no action found)"
    assert why["error"] == "model: connection_refused"
    assert header.index("WHY") == rows[0].index(why[rows[0].split()[2]])  # the column lines up


def test_under_crons_path_a_missing_pytest_names_the_interpreter_and_the_fix(agent, tmp_path, server):
    found = subprocess.run(["/usr/bin/python3", "-c", "import pytest"], capture_output=True) if os.path.exists(
        "/usr/bin/python3") else None
    if found is None or found.returncode == 0 or not os.path.exists("/usr/bin/git"):
        pytest.skip("needs a /usr/bin/python3 without pytest and /usr/bin/git, as on a bare box")
    repo = make_repo(tmp_path / "repo")
    tools = tools_json(tmp_path / "cron.json", test_command=["python3", "-m", "pytest", "-q"])
    proc, run_dir, _events = agent(repo, [propose(FIX)], tools_file=tools, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and server.requests == [], proc.err
    (line,) = [line for line in proc.err.splitlines() if line.startswith("error: ")]
    assert "No module named pytest" in line and "python3 is /usr/bin/python3 on PATH=/usr/bin:/bin" in line
    assert "fix test_command in" in line and "(or PATH)" in line


def _read_stdout(proc, until, timeout=120):
    """Lines of the daemon's stdout until one contains `until`."""
    lines = []
    while not any(until in line for line in lines):
        ready, _w, _x = select.select([proc.stdout], [], [], timeout)
        assert ready, f"no {until!r} on stdout; so far {lines}"
        line = proc.stdout.readline().decode()
        assert line, f"stdout ended before {until!r}; so far {lines}"
        lines.append(line.rstrip("\n"))
    return lines


def test_the_daemon_says_what_it_does_and_its_pages_say_why(serve):
    daemon = serve(env={"READ_TOKEN": TOKEN})
    bearer = {"Authorization": f"Bearer {TOKEN}", "Accept": "text/html"}
    ids = []
    for delivery in ("why-1", "why-2"):
        body = push_body(number=delivery)
        ids.append(daemon.post(body, github_headers(body, delivery=delivery)).json()["run_id"])
        said = _read_stdout(daemon.proc, f"run {ids[-1]} no_action")
        assert said == [f"run {ids[-1]} started: push delivery {delivery}",
                        f"run {ids[-1]} no_action: no action: the tests pass"]
    assert daemon.get("/", {"Accept": "text/html"}).status == 401  # the same read token as /runs
    index = daemon.get("/", bearer)
    assert index.status == 200 and index.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in index.headers["content-security-policy"]
    text = index.body.decode()
    assert text.index(ids[1]) < text.index(ids[0])  # newest first
    shown = "".join(Page(text).text)
    assert "no_action" in shown and "the tests pass" in shown and f'href="/runs/{ids[0]}"' in text
    timeline = daemon.get(f"/runs/{ids[0]}", bearer).body.decode()
    summary = timeline[timeline.index('<dl class="summary">'):timeline.index("<table>")]
    parts = "".join(Page(summary).text)
    assert "outcomeno_action" in parts and "whyno action: the tests pass" in parts
    assert "proposal-" in parts and "verdict-" in parts
    idle = socket.create_connection(("127.0.0.1", daemon.port))  # a browser's preconnect: nothing sent
    idle.close()
    assert daemon.get("/healthz").status == 200
    daemon.proc.send_signal(signal.SIGTERM)
    assert _read_stdout(daemon.proc, "draining")[-1] == "draining on SIGTERM: no new run starts; 0 queued stay " \
                                                        "recorded for the next start"
    assert daemon.proc.wait(timeout=90) == 0
    log = [line for line in daemon.stderr().splitlines() if not line.startswith("warning: ")]
    assert len(log) == 6, log  # two posts, the 401, the index, the timeline, /healthz: not the idle connection
    assert all(line.startswith("127.0.0.1 ") and " - - " not in line for line in log), log


def test_the_summary_and_the_index_escape_every_value(tmp_path):
    import daemon as daemon_module
    events = [{"seq": 1, "at": "2026-12-01T00:00:00.000000Z", "kind": "judge_verdict",
               "payload": {"verdict": "reject", "reason": "<script>alert(1)</script> changed"}},
              {"seq": 2, "at": "2026-12-01T00:00:01.000000Z", "kind": "run_closed",
               "payload": {"outcome": "proposal_rejected_by_judge", "proposal": "<b>p</b>", "verdict": "reject"}}]
    page = daemon_module.timeline_html({"run_id": "r", "events": events, "verified": True, "problem": None,
                                       "truncated": False}, tmp_path)
    parsed = Page(page)
    assert "script" not in parsed.tags and "b" not in parsed.tags
    assert "judge reject: <script>alert(1)</script> changed" in "".join(parsed.text)
    rows = [{"run_id": "<i>r</i>", "started": None, "outcome": "error", "why": "<img src=x onerror=alert(1)>",
             "steps": 1, "tokens": None, "tokens_source": None, "verified": "ok"}]
    parsed = Page(daemon_module.index_html(rows))
    assert "img" not in parsed.tags and "i" not in parsed.tags
    assert "<img src=x onerror=alert(1)>" in "".join(parsed.text)
