"""audit.py on ledgers with known answers, written by the real writer and ask.py's own code path."""

import json
import re
import shutil
import subprocess

import pytest

import ask
import reasoning_ledger as rl
from conftest import ROOT, clean_env, clock_for, error_lines, parse_html, run_script

KEY = "sk-audit-test-key-0001"
DAY1, DAY2 = "2026-11-01", "2026-11-02"


def calls(path, server, day, scenarios, model="fake-model", **kwargs):
    """Run ask.ask() (the same code path as `python ask.py`) with the ledger's clock set to `day`."""
    server.queue(*scenarios)
    with rl.Ledger(path, f"r{day}", key=b"", clock=clock_for(day)) as ledger:
        for _ in scenarios:
            ask.ask("What is 2 + 2?", ledger=ledger, base_url=server.base_url, model=model, api_key=KEY, **kwargs)


def audit(*args, cwd=None):
    return run_script("audit.py", *args, cwd=cwd)


def audit_json(*args):
    proc = audit(*args, "--json")
    assert proc.returncode in (0, 4), proc.err
    return json.loads(proc.out)


# ----------------------------------------------------------------------------
# Columns with known answers
# ----------------------------------------------------------------------------

def test_reported_and_estimated_tokens_are_never_mixed(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok", "ok", "no_usage", "zero_usage", "partial_usage", "server_error"])
    data = audit_json(ledger)
    (row,) = data["models"]
    assert row["calls"] == 6 and row["ok"] == 5 and row["failed"] == 1
    assert row["no_usage"] == 2  # absent and zero: spend that cannot be audited
    assert row["input_tokens"] == 42 and row["output_tokens"] == 12  # 2 x (21, 6); partial has no in/out
    assert row["usage_calls"] == 2
    assert row["est_input_tokens"] == 6 * 4 and row["est_output_tokens"] == 5 * 4
    assert row["errors"] == {"server_error": 1}
    text = audit(ledger).out
    assert "usage: 2 of 5 ok calls lacked usage" in text
    assert "est_in~" in text and "never added in" in text


def test_checks_and_retries_are_counted(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok", "ok"], expect=r"\b4\b")
    calls(ledger, server, DAY1, ["ok"], expect=r"\b5\b")
    calls(ledger, server, DAY1, ["ok"])
    server.queue("server_error", "ok")
    with rl.Ledger(ledger, "retry", key=b"", clock=clock_for(DAY1)) as book:
        ask.ask("q", ledger=book, base_url=server.base_url, model="fake-model", api_key=KEY, retries=1,
                backoff=0.01)
    (row,) = audit_json(ledger)["models"]
    assert (row["calls"], row["ok"], row["checked"], row["passed"], row["retries"]) == (6, 5, 3, 2, 1)


def test_json_matches_the_text_table(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok", "no_usage", "http_404"])
    calls(ledger, server, DAY2, ["ok", "ok"], model="fake-model-large")
    data = audit_json(ledger, "--by", "day")
    text = audit(ledger, "--by", "day", "--wide").out.splitlines()
    header = next(line for line in text if line.startswith("model "))
    names = header.split()
    for row in data["models"]:
        line = next(l for l in text if l.startswith(row["request_model"] + " ") and row["day"] in l)
        cells = dict(zip(names, line.split()))
        for column in ("calls", "ok", "failed", "no_usage"):
            assert int(cells[column].replace(",", "")) == row[column], column
        assert cells["checks"] == (f"{row['passed']}/{row['checked']}" if row["checked"] else "-")
        assert cells["in_tok"] == (f"{row['input_tokens']:,}" if row["input_tokens"] is not None else "-")
        for q in ("min", "p50", "p95", "max"):
            assert cells[f"{q}_ms"] == f"{row[f'latency_{q}_ms']:,.0f}"


def test_csv_has_one_row_per_group(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"])
    calls(ledger, server, DAY2, ["ok"])
    rows = audit(ledger, "--csv", "--by", "day").out.splitlines()
    assert rows[0].startswith("request_model,base_url,day,calls,ok,failed,no_usage,malformed")
    assert len(rows) == 3 and DAY1 in rows[1] and DAY2 in rows[2]


def test_filters(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"])
    calls(ledger, server, DAY2, ["ok", "ok"], model="other-model")
    assert audit_json(ledger, "--since", DAY2)["summary"]["model_calls"] == 2
    assert audit_json(ledger, "--until", DAY1)["summary"]["model_calls"] == 1
    assert audit_json(ledger, "--model", "fake-model")["summary"]["model_calls"] == 1
    assert audit(ledger, "--since", "not-a-date").returncode == 2


# ----------------------------------------------------------------------------
# Changes
# ----------------------------------------------------------------------------

def test_a_model_swapped_behind_the_name_shows_under_changes(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"] * 3)
    calls(ledger, server, DAY2, ["model_swap"] * 3)
    proc = audit(ledger)
    assert proc.returncode == 0
    assert re.search(rf"{DAY2}\s+fake-model @ \S+: response_model: new cheaper-model-q4; gone fake-model", proc.out)
    assert audit(ledger, "--fail-on-change").returncode == 4
    changes = audit_json(ledger)["changes"]
    assert {"request_model": "fake-model", "base_url": server.base_url, "day": DAY2, "previous_day": DAY1,
            "what": "response_model", "detail": "new cheaper-model-q4; gone fake-model"} in changes


def test_a_latency_shift_is_flagged(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"] * 3)
    calls(ledger, server, DAY2, [{"name": "sleepy", "sleep": 0.25}] * 3)
    whats = {c["what"] for c in audit_json(ledger)["changes"]}
    assert {"latency_p50", "latency_p95"} <= whats
    # a generous threshold hides it
    whats = {c["what"] for c in audit_json(ledger, "--latency-shift", "1000")["changes"]}
    assert not whats & {"latency_p50", "latency_p95"}


def test_usage_disappearing_error_jump_and_falling_pass_rate(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"] * 4, expect=r"\b4\b")
    calls(ledger, server, DAY2, ["no_usage", "no_usage", "server_error", "server_error"], expect=r"\b5\b")
    changes = {c["what"]: c["detail"] for c in audit_json(ledger)["changes"]}
    assert changes["usage"] == "usage reported always -> never"
    assert changes["error_rate"] == "0% -> 50% of calls failed"
    assert changes["checks"] == "100% -> 0% of checks passed"


def test_no_change_when_nothing_changed(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"] * 3)
    calls(ledger, server, DAY2, ["ok"] * 3)
    # a loaded CI box can stretch one 3 ms call to 60 ms: keep scheduler noise out of this test
    assert audit_json(ledger, "--latency-floor", "500")["changes"] == []
    assert audit(ledger, "--fail-on-change", "--latency-floor", "500").returncode == 0


def test_a_models_listing_that_changed(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    for day, models in ((DAY1, ["a", "b"]), (DAY2, ["b", "c"])):
        server.queue({"name": "ok", "models": models})
        with rl.Ledger(ledger, "m", key=b"", clock=clock_for(day)) as book:
            ask.list_models(ledger=book, base_url=server.base_url, api_key=KEY)
    (change,) = audit_json(ledger)["changes"]
    assert change["what"] == "models_list" and change["detail"] == "gained c; lost a"


# ----------------------------------------------------------------------------
# Verification first
# ----------------------------------------------------------------------------

def test_a_tampered_ledger_is_refused_and_named(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"] * 4)
    lines = ledger.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"input_tokens":21', b'"input_tokens":2')
    ledger.write_bytes(b"".join(lines))
    proc = audit(ledger)
    assert proc.returncode == 1
    assert "line 3: prev does not match line 2" in proc.out + proc.err
    assert "Models" not in proc.out  # nothing audited
    loose = audit(ledger, "--no-verify")
    assert loose.returncode == 0 and "UNVERIFIED" in loose.out
    assert audit_json(ledger, "--no-verify")["verified"] is False


def test_a_torn_tail_is_a_warning(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok"] * 2)
    with open(ledger, "ab") as handle:
        handle.write(b'{"seq":3,"run_id"')
    proc = audit(ledger)
    assert proc.returncode == 0
    assert "warning:" in proc.out and "torn tail" in proc.out
    assert audit_json(ledger)["summary"]["model_calls"] == 2


def test_missing_path_is_a_usage_error(tmp_path):
    proc = audit(tmp_path / "nope.jsonl")
    assert proc.returncode == 2 and proc.err.startswith("error: ")


# ----------------------------------------------------------------------------
# Agent runs, discovery, HTML, the drill
# ----------------------------------------------------------------------------

def _agent_run(runs, server, outcome, denied=0):
    """A run in agent.py's vocabulary, written through the real writer and ask's own code path."""
    run = rl.open_run(runs, key=b"")
    run.decide("plan", "ask the model for a patch", "the test names the bug")
    ask.ask("fix it", ledger=run, base_url=server.base_url, model="fake-model", api_key=KEY)
    run.append("model_proposed", {"step": 1, "tool": "run_tests", "args": {}})
    run.append("tool_allowed", {"step": 1, "tool": "run_tests", "args": {}, "rule": "builtin.enabled"})
    for _ in range(denied):
        run.append("model_proposed", {"step": 2, "tool": "read_file", "args": {"path": "../../etc/passwd"}})
        run.append("tool_denied", {"step": 2, "tool": "read_file", "args": {"path": "../../etc/passwd"},
                                   "rule": "path.escape", "reason": "outside the repository"})
    run.append("judge_verdict", {"verdict": "reject", "applies": True, "tests_passed": False,
                                 "reason": "tests still fail"})
    run.close(outcome)
    return run


def test_default_discovery_and_agent_runs_table(tmp_path, server):
    calls(tmp_path / "calls.jsonl", server, DAY1, ["ok"])
    first = _agent_run(tmp_path / "runs", server, "proposal_written", denied=2)
    _agent_run(tmp_path / "runs", server, "budget_exhausted")
    data = json.loads(audit("--json", cwd=tmp_path).out)
    assert data["summary"]["model_calls"] == 3
    assert len(data["ledgers"]) == 3
    row = next(r for r in data["agent_runs"] if r["run_id"] == first.run_id)
    assert row["outcome"] == "proposal_written" and row["judge_verdict"] == "reject"
    assert (row["tools_allowed"], row["tools_denied"], row["model_calls"], row["steps"]) == (1, 2, 1, 2)
    assert row["input_tokens"] == 21 and row["output_tokens"] == 6
    text = audit(cwd=tmp_path).out
    assert "Agent runs: 2" in text and "budget_exhausted" in text


def test_html_page_is_well_formed_with_one_latency_chart_per_model(tmp_path, server):
    ledger = tmp_path / "runs.jsonl"
    calls(ledger, server, DAY1, ["ok", "ok", "server_error"])
    calls(ledger, server, DAY2, ["ok", "model_swap"], model="fake-model-large")
    page = tmp_path / "report.html"
    proc = audit(ledger, "--html", page)
    assert proc.returncode == 0 and page.exists()

    nodes = list(parse_html(page.read_text(encoding="utf-8")).walk())  # every element closed
    charts = [n.attrs.get("data-model") for n in nodes
              if n.tag == "svg" and "latency-histogram" in (n.attrs.get("class") or "")]
    external = [n.tag for n in nodes
                if n.tag in ("script", "link", "img") or (n.attrs.get("src") or "").startswith("http")]
    assert external == []
    assert sorted(charts) == sorted(f"{m} @ {server.base_url}" for m in ("fake-model", "fake-model-large"))
    assert page.read_text().count('class="calls-per-day"') == 1


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_drill_runs_the_prompts_and_audits(tmp_path, server):
    prompts = tmp_path / "prompts"
    shutil.copytree(ROOT / "prompts", prompts)
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="fake-model")
    server.queue("ok")  # the drill's first request: the /models list
    for answer in ("17 * 23 = 391", "def add(a, b):\n    return a + b", '{"name": "Ada", "age": 36}'):
        server.queue(*[{"name": "ok", "answer": answer}] * 5)  # prompts run in name order, 5 times each
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "drill", f"LEDGER={tmp_path / 'calls.jsonl'}",
                           f"PROMPTS={prompts}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    listing, *events = rl.read_events(tmp_path / "calls.jsonl")
    assert listing["kind"] == "models_list" and listing["payload"]["model_ids"] == ["fake-model", "fake-model-large"]
    assert len(events) == 15
    assert all(e["payload"]["check"] is True and e["payload"]["temperature"] == 0 for e in events)
    assert "fake-model" in proc.stdout and "Changes (day over day): 0" in proc.stdout
    assert "drill: 15 calls: 0 failed, 0 checks not passed" in proc.stdout
    bodies = [r["body"]["messages"][0]["content"] for r in server.requests]  # the chat calls (GETs are apart)
    assert len(set(bodies)) == 3


# ----------------------------------------------------------------------------
# Ledgers written by another tool, or by an attacker
# ----------------------------------------------------------------------------

def _write(path, payloads, kind="model_call", day=DAY1, run_id="other-tool"):
    with rl.Ledger(path, run_id, key=b"", clock=clock_for(day)) as ledger:
        for payload in payloads:
            ledger.append(kind, payload)


MISTYPED = [
    {"request_model": "m", "latency_ms": "fast"},
    {"request_model": "m", "input_tokens": "12", "usage_reported": True, "usage_status": "complete"},
    {"request_model": "m", "attempt": "2"},
    {"request_model": "m", "check": "yes"},
    {"request_model": "m", "error_type": 42},
    {"request_model": "m", "usage_status": ["complete"], "usage_reported": "true"},
    {"request_model": 5, "base_url": {"a": 1}},
    {"request_model": "m", "response_model": ["x"], "system_fingerprint": 3},
    {"request_model": "m", "est_input_tokens": 1.5, "est_output_tokens": "9"},
    {"request_model": "m", "latency_ms": True},
    {},
]


def test_payloads_of_the_wrong_type_are_counted_as_malformed_never_a_crash(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    _write(ledger, MISTYPED)
    runs = tmp_path / "runs"
    run = rl.open_run(runs, key=b"")
    for kind, payload in (("model_proposed", {"step": "one"}), ("judge_verdict", {"verdict": {"no": 1}}),
                          ("tool_denied", []), ("model_call", {"input_tokens": "lots"})):
        run.append(kind, payload if isinstance(payload, dict) else {"x": payload})
    run.close("error")
    run_dir = run.dir
    (run_dir / "events.jsonl")  # the run, closed with a string outcome, is in the index too
    for flags in ([], ["--json"], ["--csv"], ["--by", "day"], ["--html", tmp_path / "a.html"]):
        proc = audit(ledger, runs, *flags)
        assert proc.returncode == 0 and "Traceback" not in proc.err, (flags, proc.err)
    data = audit_json(ledger, runs)
    rows = {str(r["request_model"]): r for r in data["models"]}
    assert sum(r["calls"] for r in rows.values()) == len(MISTYPED) + 1
    assert data["summary"]["malformed"] == 11  # every payload above but {}, and the run's model_call
    assert rows["m"]["latency_min_ms"] is None and rows["m"]["input_tokens"] is None
    assert "malformed: 11 model_call payloads" in audit(ledger, runs).out


def test_control_characters_from_a_ledger_are_escaped_in_text_output(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    evil = "m\nforged line\r\x1b[31mred\x9b2J\u2028"
    _write(ledger, [{"request_model": evil, "response_model": evil, "base_url": "http://h/\x1b]0;title\x07",
                     "error_type": None, "latency_ms": 5.0},
                    {"request_model": evil, "error_type": "bad\nerror", "latency_ms": 5.0}])
    with rl.Ledger(ledger, "evil\x1b" if False else "evil", key=b"") as book:
        book.decide("plan", evil, evil)
    for proc in (audit(ledger), audit(ledger, "--by", "day"),
                 run_script("reasoning_ledger.py", "report", ledger)):
        assert proc.returncode == 0, proc.err
        for char in "\r\x1b\x07\x9b\u2028":
            assert char not in proc.out, (repr(char), proc.out)
        assert "forged line" not in [line.strip() for line in proc.out.splitlines()]
        assert "\\x1b[31m" in proc.out or "\\n" in proc.out
    report = run_script("reasoning_ledger.py", "report", ledger).out.splitlines()
    assert len(report) == 3  # one line per event, whatever the payload holds


@pytest.mark.parametrize("name", ["=cmd|' /C calc'!A0", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"])
def test_csv_cells_that_a_spreadsheet_would_run_are_neutralised(tmp_path, name):
    ledger = tmp_path / "calls.jsonl"
    _write(ledger, [{"request_model": name, "base_url": "=HYPERLINK(\"http://evil\")", "error_type": None,
                     "latency_ms": 12.5, "est_input_tokens": 3, "est_output_tokens": 4}])
    import csv
    import io
    rows = list(csv.DictReader(io.StringIO(audit(ledger, "--csv").out)))
    (row,) = rows
    assert row["request_model"] == "'" + name and row["base_url"].startswith("'=HYPERLINK")
    assert row["calls"] == "1" and row["latency_p50_ms"] == "12.5" and row["est_output_tokens"] == "4"


def test_a_missing_count_is_null_not_zero(tmp_path, server):
    ledger = tmp_path / "calls.jsonl"
    calls(ledger, server, DAY1, ["no_usage", "no_usage"])
    (row,) = audit_json(ledger)["models"]
    assert row["input_tokens"] is None and row["output_tokens"] is None and row["passed"] is None
    assert row["checked"] == 0 and row["usage_calls"] == 0 and row["est_input_tokens"] == 8
    import csv
    import io
    (cells,) = csv.DictReader(io.StringIO(audit(ledger, "--csv").out))
    assert cells["input_tokens"] == "" and cells["passed"] == "" and cells["checked"] == "0"


def test_very_many_model_strings_fold_into_one_row(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    import audit as audit_module
    n = audit_module.MAX_MODEL_STRINGS + 500
    with rl.Ledger(ledger, "many", key=b"", fsync=False, clock=clock_for(DAY1)) as book:
        for i in range(n):
            book.append("model_call", {"request_model": f"model-{i}", "base_url": "http://h/v1", "error_type": None,
                                       "latency_ms": 1.0, "response_model": f"served-{i}"})
    data = audit_json(ledger)
    assert len(data["models"]) == audit_module.MAX_MODEL_STRINGS + 1
    assert data["summary"]["folded_calls"] == 500
    other = next(r for r in data["models"] if r["request_model"] == "(other)")
    assert other["calls"] == 500 and len(other["response_models"]) <= audit_module.MAX_LABELS + 1
    assert "(other)" in audit(ledger).out and "are counted under (other)" in audit(ledger).err + audit(ledger).out


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_drill_stops_at_a_configuration_error(tmp_path, server):
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY)  # no MODEL_ID
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "drill", f"LEDGER={tmp_path / 'calls.jsonl'}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert len(error_lines(proc.stderr)) == 1 and "MODEL_ID is not set" in proc.stderr
    assert "drill: stopped: configuration error" in proc.stderr
    assert [r["method"] for r in server.gets] == ["GET"] and server.requests == []  # /models; no model asked


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_drill_sums_up_and_fails_when_a_call_or_check_failed(tmp_path, server):
    prompts = tmp_path / "prompts"
    shutil.copytree(ROOT / "prompts", prompts)
    server.queue("ok", "server_error")  # the /models list, then one failed call among the 3
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="fake-model")
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "drill", f"LEDGER={tmp_path / 'calls.jsonl'}",
                           f"PROMPTS={prompts}", "DRILL_REPEAT=1"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode != 0
    # the server error, and two checks the fake cannot pass: one word for each
    assert "drill: 3 calls: 1 failed, 2 checks not passed" in proc.stdout
