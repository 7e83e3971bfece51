"""What the audit tells a user, read off its output: the text report in 120 columns, latency in one unit,
errors with their code, why each agent run ended, a model the endpoint does not list; the HTML page's run
links, colours and one-day summary; and README.md's own examples, run as printed."""

import json
import math
import re
import select
import shlex
import subprocess
import sys
import urllib.request
from html.parser import HTMLParser

import pytest

import agent
import daemon
import reasoning_ledger as rl
from conftest import ROOT, clean_env, run_script
from test_fleet import audit_from, clickhouse, db, ship  # noqa: F401  -- clickhouse and db are fixtures

KEY = "sk-audit-reasons-key-0001"
DAY1, DAY2 = "2026-11-01", "2026-11-02"
LONG_MODEL = "meta-llama/Meta-Llama-3.1-70B-Instruct-Turbo-128k-q4_k_m-instruct-2026-11"
LONG_BASE = "https://inference.eu-west-1.some-provider.example.com/openai/deployments/team-a/v1"
MODELS = [(LONG_MODEL, LONG_BASE), ("qwen2.5-coder-32b-instruct-q4_k_m.gguf", "http://llama-box.internal:8080/v1"),
          ("gpt-4o", "http://127.0.0.1:8080/v1")]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = "\n".join([README] + [p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))])


def clock_for(day):
    ticks = iter(range(10 ** 6))
    return lambda: f"{day}T12:{next(ticks) // 60 % 60:02d}:{next(ticks) % 60:02d}.000000Z"


def call(model, base, latency=447.0, error=None, code=None, served=None, tokens=(1234, 56)):
    return {"request_model": model, "base_url": base, "attempt": 1, "error_type": error, "error_code": code,
            "usage_reported": error is None, "usage_status": "complete" if error is None else "absent",
            "latency_ms": latency, "response_model": None if error else (served or model),
            "input_tokens": tokens[0] if error is None else None, "output_tokens": tokens[1] if error is None else None,
            "est_input_tokens": 1000, "est_output_tokens": 50 if error is None else None, "check": None}


def write(path, days):
    for day, payloads in days:
        with rl.Ledger(path, f"r{day}", key=b"", clock=clock_for(day)) as ledger:
            for payload in payloads:
                ledger.append(payload.pop("_kind", "model_call"), payload)


def realistic(tmp_path):
    """Two days, three model strings with long names and endpoints, big token counts, slow and fast calls,
    errors with and without a code."""
    ledger = tmp_path / "calls.jsonl"
    days = []
    for day in (DAY1, DAY2):
        payloads = []
        for model, base in MODELS:
            payloads += [call(model, base, latency=447.0, tokens=(1_234_567, 98_765), served=model + "-build-7"),
                         call(model, base, latency=4014.0), call(model, base, latency=13_500.0),
                         call(model, base, latency=23_300.0),
                         call(model, base, error="http_error", code="context_length_exceeded"),
                         call(model, base, error="http_error", code="context_length_exceeded"),
                         call(model, base, error="timeout")]
        days.append((day, payloads))
    write(ledger, days)
    return ledger


def agent_runs(runs):
    """Five runs that ended five ways, each recorded as agent.py records it."""
    ids = {}
    endings = {
        "budget": ("budget_exhausted", [("budget_exhausted", {"limit": "max_steps", "used": 12, "max": 12})]),
        "judge": ("proposal_rejected_by_judge", [("judge_verdict", {"verdict": "reject", "reason": "tests still "
                                                                    "fail: test_add, test_mul and three more"})]),
        "model": ("error", [("model_call", call("gpt-4o", MODELS[2][1], error="http_error",
                                                 code="context_length_exceeded")),
                            ("error", {"stage": "model", "message": "the model endpoint failed: http_error "
                                       "(context_length_exceeded): HTTP 400: too long",
                                       "error_type": "http_error", "error_code": "context_length_exceeded"})]),
        "crash": ("error", [("error", {"type": "TestCommandError", "message": "the test command 'pytest' "
                                       "cannot run: No module named pytest"})]),
        "triage": ("no_action", [("decision", {"stage": "triage", "decision": "no action",
                                               "rationale": "the tests pass", "alternatives": []})]),
    }
    for name, (outcome, events) in endings.items():
        run = rl.open_run(runs, key=b"")
        run.decide("plan", "ask the model", "the tests fail")
        for kind, payload in events:
            run.append(kind, payload)
        run.close(outcome)
        ids[name] = run.run_id
    return ids


def audit(*args):
    proc = run_script("audit.py", *args)
    assert proc.returncode == 0, proc.err
    return proc


# ----------------------------------------------------------------------------
# The text report
# ----------------------------------------------------------------------------

def test_the_text_report_fits_120_columns_and_wide_shows_everything(tmp_path):
    ledger = realistic(tmp_path)
    runs = tmp_path / "runs"
    agent_runs(runs)
    for by in ("model", "day"):
        text = audit(ledger, runs, "--by", by).out
        assert max(len(line) for line in text.splitlines()) <= 120, by
        # an endpoint is a short key in the table and is named whole below it
        for n, (_model, base) in enumerate(sorted(MODELS, key=lambda m: m[0]), 1):
            assert f"at #{n} = {base}" in text.splitlines()
        assert LONG_MODEL not in text and "\u2026" in text and "marks a name cut in the middle" in text
        assert "Agent runs: 5" in text
        wide = audit(ledger, runs, "--by", by, "--wide").out
        assert max(len(line) for line in wide.splitlines()) > 120
        assert all(re.search(rf"^{re.escape(model)} +{re.escape(base)} ", wide, re.M) for model, base in MODELS)
        assert "\u2026" not in wide


def test_latency_is_in_ms_in_every_latency_column(tmp_path):
    ledger = realistic(tmp_path)
    wide = audit(ledger, "--wide").out.splitlines()
    header = next(line for line in wide if line.startswith("model "))
    names = header.split()
    row = dict(zip(names, next(line for line in wide if line.startswith("gpt-4o ")).split()))
    assert (row["min_ms"], row["p50_ms"], row["p95_ms"], row["max_ms"]) == ("447", "4,014", "23,300", "23,300")
    narrow = audit(ledger).out.splitlines()
    names = next(line for line in narrow if line.startswith("model ")).split()
    assert "p50_ms" in names and "p95_ms" in names and not any("/" in n for n in names if n.endswith("_ms"))
    row = dict(zip(names, next(line for line in narrow if line.startswith("gpt-4o ")).split()))
    assert (row["p50_ms"], row["p95_ms"]) == ("4,014", "23,300")


def test_errors_show_their_code(tmp_path):
    ledger = realistic(tmp_path)
    text = audit(ledger).out
    assert "errors: http_error (context_length_exceeded) 12, timeout 6" in text.splitlines()
    (row, *_rest) = json.loads(audit(ledger, "--json").out)["models"]
    assert row["errors"] == {"http_error (context_length_exceeded)": 4, "timeout": 2}


def test_every_agent_run_says_why_it_ended(tmp_path):
    runs = tmp_path / "runs"
    ids = agent_runs(runs)
    expected = {"budget": "budget max_steps: 12 of 12",
                "judge": "judge reject: tests still fail: test_add, test_mul and three more",
                "model": "model: http_error (context_length_exceeded)",
                "crash": "TestCommandError: the test command 'pytest' cannot run: No module named pytest",
                "triage": "no action: the tests pass"}
    wide = audit(runs, "--wide").out.splitlines()
    for name, why in expected.items():
        (line,) = [line for line in wide if line.startswith(ids[name])]
        assert line.endswith("  " + why), line
    narrow = audit(runs).out.splitlines()
    assert "why" in next(line for line in narrow if line.startswith("run ")).split()
    (line,) = [line for line in narrow if line.startswith(ids["triage"])]
    assert line.endswith("  no action: the tests pass")
    data = json.loads(audit(runs, "--json").out)
    assert {r["run_id"]: r["why"] for r in data["agent_runs"]} == {ids[n]: w for n, w in expected.items()}


def test_a_model_the_endpoints_models_list_does_not_name_is_flagged(tmp_path, server):
    """A server that answers to any model name (llama.cpp, the stand-in) takes MODEL_ID=gpt-4o, even with
    --strict-model; the /models list the drill records shows it was never there."""
    ledger = tmp_path / "calls.jsonl"
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, LEDGER=ledger)
    assert run_script("ask.py", "--models", env=env).returncode == 0
    for model in ("fake-model", "gpt-4o"):
        env["MODEL_ID"] = model
        proc = run_script("ask.py", "--strict-model", env=env, input="What is 2 + 2?")
        assert proc.returncode == 0, proc.err
    text = audit(ledger).out
    flagged = [line for line in text.splitlines() if line.startswith("not listed:")]
    assert len(flagged) == 1 and flagged[0].startswith(f"not listed: gpt-4o @ {server.base_url} (1 call)")
    data = json.loads(audit(ledger, "--json").out)
    assert [(u["request_model"], u["calls"]) for u in data["unlisted"]] == [("gpt-4o", 1)]
    page = tmp_path / "page.html"
    audit(ledger, "--html", page)
    assert f"not listed: gpt-4o @ {server.base_url}" in page.read_text(encoding="utf-8")


def test_the_audit_from_clickhouse_shows_the_same_codes_and_reasons(clickhouse, db, tmp_path):  # noqa: F811
    ledger = realistic(tmp_path)
    runs = tmp_path / "runs"
    agent_runs(runs)
    proc = ship(clickhouse, db, ledger, "--all", runs)
    assert proc.returncode == 0, proc.err
    local = json.loads(audit(ledger, runs, "--json").out)
    remote = json.loads(audit_from(clickhouse, db, "--json").out)
    assert remote["models"] == local["models"] and remote["agent_runs"] == local["agent_runs"]
    assert "http_error (context_length_exceeded)" in remote["models"][0]["errors"]
    assert {r["why"] for r in remote["agent_runs"]} >= {"budget max_steps: 12 of 12", "no action: the tests pass"}


# ----------------------------------------------------------------------------
# The HTML page
# ----------------------------------------------------------------------------

class Page(HTMLParser):
    """What the page shows: links, key colours, error-bar colours, classes of tables and charts."""

    def __init__(self, text):
        super().__init__()
        self.links, self.model_colours, self.error_colours, self.classes = [], [], set(), set()
        self.legend, self.heads, self.table = None, {}, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.classes.update((attrs.get("class") or "").split())
        if tag == "a" and not (attrs.get("href") or "").startswith("#"):
            self.links.append(attrs["href"])
        if tag == "ul":
            self.legend = attrs.get("data-legend")
        if tag == "span" and "key" in (attrs.get("class") or "") and self.legend == "models":
            self.model_colours.append(re.search(r"background:(#[0-9A-Fa-f]{6})", attrs["style"]).group(1))
        if tag == "rect" and "data-error-type" in attrs:
            self.error_colours.add(attrs["fill"])
        if tag == "table":
            self.table = attrs.get("class")
        if tag == "th" and "data-field" in attrs:
            self.heads.setdefault(self.table, []).append(attrs["data-field"])

    handle_startendtag = handle_starttag


def lab(colour):
    """CIE L*a*b* (D65) of #rrggbb."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = [((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92 for c in rgb]
    xyz = ((r * 0.4124 + g * 0.3576 + b * 0.1805) / 0.95047, r * 0.2126 + g * 0.7152 + b * 0.0722,
           (r * 0.0193 + g * 0.1192 + b * 0.9505) / 1.08883)
    fx, fy, fz = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in xyz]
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def test_model_colours_and_error_colours_never_look_alike(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    errors = ["timeout", "server_error", "rate_limited", "http_error", "invalid_json", "connection_refused",
              "truncated_response", "redirect"]
    days = []
    for day in (DAY1, DAY2):
        payloads = []
        for i in range(10):  # more model strings than colours, more error types than colours
            payloads += [call(f"m-{i}", "http://h/v1")] * (20 - i) + [call(f"m-{i}", "http://h/v1", error=e)
                                                                     for e in errors[:i]]
        days.append((day, payloads))
    write(ledger, days)
    page = tmp_path / "page.html"
    audit(ledger, "--html", page)
    seen = Page(page.read_text(encoding="utf-8"))
    assert len(set(seen.model_colours)) == 9 and len(seen.error_colours) == 7  # 8 + the rest, 6 + the rest
    for model in seen.model_colours:
        for error in seen.error_colours:
            assert math.dist(lab(model), lab(error)) >= 25, (model, error)


def test_one_day_of_data_gives_a_summary_instead_of_single_dots(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    write(ledger, [(DAY1, [call("m-a", "http://h/v1")] * 3 + [call("m-b", "http://h/v1", error="timeout")])])
    page = tmp_path / "page.html"
    audit(ledger, "--html", page)
    text = page.read_text(encoding="utf-8")
    seen = Page(text)
    assert "one-day" in seen.classes and f"One day of data ({DAY1})" in text
    assert not {"calls-per-day", "error-rate-per-day", "tokens-per-day", "errors-per-day"} & seen.classes
    assert "errors-per-model" in seen.classes  # the errors by model still have their chart
    write(ledger, [(DAY2, [call("m-a", "http://h/v1")])])
    audit(ledger, "--html", page)
    seen = Page(page.read_text(encoding="utf-8"))
    assert "one-day" not in seen.classes and {"calls-per-day", "errors-per-day"} <= seen.classes


def test_the_tables_lead_with_latency_served_models_and_why(tmp_path):
    ledger = realistic(tmp_path)
    runs = tmp_path / "runs"
    agent_runs(runs)
    page = tmp_path / "page.html"
    audit(ledger, runs, "--html", page)
    heads = Page(page.read_text(encoding="utf-8")).heads
    models, runs_table = heads["models"], heads["runs"]
    for field in ("latency_p50_ms", "latency_p95_ms", "response_models", "errors"):
        assert models.index(field) < models.index("input_tokens"), field
    assert runs_table.index("why") < runs_table.index("steps")


def _daemon(tmp_path, runs):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q",
                    "--allow-empty", "-m", "init"], check=True)
    env = clean_env(BASE_URL="http://127.0.0.1:9/v1", API_KEY=KEY, MODEL_ID="m")
    return _started([sys.executable, str(ROOT / "daemon.py"), "--repo", str(repo), "--port", "0",
                     "--runs-dir", str(runs)], r"serving on (http://127\.0\.0\.1:[0-9]+)\n", "the daemon", env=env)


def _started(argv, pattern, what, env=None):
    """Start argv and read the first line it prints; returns (process, the pattern's group 1)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    ready, _w, _x = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().decode() if ready else ""
    match = re.match(pattern, line)
    if not match:
        proc.kill()
        raise AssertionError(f"{what} did not start: {line!r}")
    return proc, match.group(1)


def test_run_ids_link_to_the_timelines_the_daemon_serves(tmp_path):
    runs = tmp_path / "runs"
    ids = agent_runs(runs)
    page = tmp_path / "page.html"
    audit(runs, "--html", page)
    assert sorted(Page(page.read_text(encoding="utf-8")).links) == sorted(f"runs/{i}" for i in ids.values())
    proc, address = _daemon(tmp_path, runs)
    try:
        audit(runs, "--html", page, "--runs-url", address + "/runs/")
        links = Page(page.read_text(encoding="utf-8")).links
        assert len(links) == 5
        for link in links:
            request = urllib.request.Request(link, headers={"Accept": "text/html"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/html")
                assert link.rsplit("/", 1)[1] in answer.read().decode("utf-8")
    finally:
        proc.terminate()
        proc.wait(timeout=90)
        proc.stdout.close()


# ----------------------------------------------------------------------------
# README.md's examples, as printed
# ----------------------------------------------------------------------------

def _stand_in():
    """`python3 tests/fake_openai.py PORT` as the README starts it, on a free port."""
    return _started([sys.executable, str(ROOT / "tests" / "fake_openai.py"), "0"],
                    r"fake OpenAI-compatible server at (http://127\.0\.0\.1:[0-9]+/v1) ", "the stand-in")


@pytest.fixture
def stand_in():
    proc, base_url = _stand_in()
    yield base_url
    proc.terminate()
    proc.wait(timeout=30)
    proc.stdout.close()


def test_the_readmes_stand_in_lists_the_readmes_model_and_answers_its_sample_line(tmp_path, stand_in):
    (exports,) = re.findall(r"^export BASE_URL=\S+ API_KEY=(\S+) MODEL_ID=(\S+)$", README, re.M)
    env = clean_env(BASE_URL=stand_in, API_KEY=exports[0], MODEL_ID=exports[1], LEDGER=tmp_path / "calls.jsonl")
    listed = run_script("ask.py", "--models", env=env)
    assert listed.returncode == 0 and exports[1] in listed.out.split()
    (command,) = re.findall(r"copied from a run of `(python3 ask\.py --expect [^`]+)`", README)
    argv = shlex.split(command)
    assert argv[-2] == "<"
    proc = run_script("ask.py", *argv[2:-2], env=env, input=(ROOT / argv[-1]).read_bytes(), cwd=ROOT)
    (sample,) = re.findall(r'^\{"seq":1,.*"kind":"model_call".*\}$', README, re.M)
    printed = json.loads(sample)["payload"]
    got = list(rl.read_events(tmp_path / "calls.jsonl"))[-1]["payload"]
    for field in ("request_model", "response_model", "check", "check_detail", "response_chars", "prompt_sha256"):
        assert got[field] == printed[field], field
    assert proc.returncode == (0 if printed["check"] else rl.EXIT_CHECK)


def test_the_readmes_commands_need_no_extra_tool_and_no_shared_port():
    stand_in_ports = set(re.findall(r"tests/fake_openai\.py (\d+)", DOCS))
    serve_lines = re.findall(r"^python3 daemon\.py .*$", DOCS, re.M)
    serve_ports = {m.group(1) if m else str(daemon.DEFAULT_PORT)
                   for m in (re.search(r"--port (\d+)", line) for line in serve_lines)}
    assert stand_in_ports and not stand_in_ports & serve_ports
    assert serve_lines and "uuidgen" not in DOCS
