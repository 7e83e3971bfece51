"""`reasoning_ledger.py report` says what a line means (a failed check, a test run's result and its failing
tests, a model reply's first line), reads a whole runs directory with --all, and ends quietly on a closed pipe."""

import json
import subprocess
import sys

import reasoning_ledger as rl
from conftest import ROOT, clean_env, run_script


def make_run(runs):
    run = rl.open_run(runs, key=b"")
    reply = run.store_artifact("\n  I will run the tests first.\nThen I patch.\n")
    run.append("model_call", {"request_model": "m", "response_model": "m", "check": False,
                              "check_detail": "expect: no match for '\\b391\\b'", "response_artifact": reply})
    outcomes = run.store_artifact(json.dumps({"tests/test_a.py::test_x": "failed", "tests/test_a.py::test_y": "passed",
                                              "tests/test_b.py::test_z": "error"}))
    run.append("tests_run", {"passed": False, "returncode": 1, "timed_out": False,
                             "counts": {"passed": 1, "failed": 1, "error": 1, "skipped": 0},
                             "outcomes_artifact": outcomes})
    run.append("tests_run", {"passed": True, "returncode": 0, "counts": {"passed": 3, "failed": 0}})
    run.append("tests_run", {"passed": False, "returncode": None, "timed_out": True})
    run.append("model_proposed", {"step": 1, "tool": "read_file", "call": {"reply_artifact": reply}})
    run.append("model_call", {"request_model": "m", "check": True, "check_detail": None})
    run.close("proposal_rejected_by_judge")
    return run.dir / rl.EVENTS_NAME


def test_report_says_what_each_line_means(tmp_path):
    events = make_run(tmp_path / "runs")
    proc = run_script("reasoning_ledger.py", "report", events)
    assert proc.returncode == 0 and proc.err == ""
    rows = proc.out.splitlines()
    assert len(rows) == 7
    assert "CHECK FAILED: expect: no match for '\\b391\\b'" in rows[0]
    assert "reply: I will run the tests first." in rows[0] and "Then I patch" not in rows[0]
    assert rows[1].endswith("tests FAILED (exit 1; 1 passed, 1 failed, 1 error): tests/test_a.py::test_x, "
                            "tests/test_b.py::test_z")
    assert rows[2].endswith("tests passed (3 passed)")
    assert rows[3].endswith("tests FAILED (timed out)")
    assert rows[4].endswith("tool=read_file  reply: I will run the tests first.")
    assert "CHECK" not in rows[5]
    assert "outcome=proposal_rejected_by_judge" in rows[6]


def test_report_all_reads_the_index_and_every_run(tmp_path):
    runs = tmp_path / "runs"
    first, second = make_run(runs), make_run(runs)
    proc = run_script("reasoning_ledger.py", "report", "--all", runs, "--kind", "run_closed")
    assert proc.returncode == 0, proc.err
    rows = proc.out.splitlines()
    assert [rows[0], rows[3], rows[5]] == [f"== {runs / 'index.jsonl'}", f"== {first}", f"== {second}"]
    assert all("  run_closed  " in row for i, row in enumerate(rows) if i not in (0, 3, 5)) and len(rows) == 7
    assert proc.out.count("outcome=proposal_rejected_by_judge") == 4
    as_json = run_script("reasoning_ledger.py", "report", "--all", runs, "--json").out.splitlines()
    assert len(as_json) == 2 + 7 + 7 and all(json.loads(line)["seq"] for line in as_json)


def test_report_all_holds_each_run_to_its_index_head(tmp_path):
    runs = tmp_path / "runs"
    events = make_run(runs)
    lines = events.read_bytes().splitlines(keepends=True)
    events.write_bytes(b"".join(lines[:-2]))  # cut off the run's last two lines: the chain still holds
    proc = run_script("reasoning_ledger.py", "report", "--all", runs)
    assert proc.returncode == 1 and "truncated: the expected head is seq 7" in proc.err


def test_report_needs_a_ledger(tmp_path):
    proc = run_script("reasoning_ledger.py", "report")
    assert proc.returncode == 2 and proc.err.startswith("error: report needs a PATH or --all RUNS_DIR")
    assert run_script("reasoning_ledger.py", "report", "--all", tmp_path / "nope").returncode == 2


def test_report_into_a_closed_pipe_ends_quietly_with_exit_0(tmp_path):
    path = tmp_path / "big.jsonl"
    with rl.Ledger(path, "r1", key=b"", fsync=False) as ledger:
        for i in range(5000):
            ledger.append("note", {"message": "x" * 200, "i": i})
    proc = subprocess.Popen([sys.executable, str(ROOT / "reasoning_ledger.py"), "report", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does: the rest (about 1 MB) meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == b""
    assert b"#1  note" in first
    shell = subprocess.run(f"'{sys.executable}' '{ROOT / 'reasoning_ledger.py'}' report '{path}' | head -n 2; "
                           f"echo \"rc=${{PIPESTATUS[0]}}\"", shell=True, executable="/bin/bash", capture_output=True,
                           env=clean_env(), timeout=120)
    assert shell.stdout.decode().splitlines()[-1] == "rc=0" and shell.stderr == b""
