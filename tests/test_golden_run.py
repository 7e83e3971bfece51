"""Format v1 of an agent run stays readable: tests/golden/demo-run/ is a runs directory written by `make demo`
(tests/demo.py against the stand-in) with agent.py 1.1.0, before issue 17's rewrite. Its bytes are never
re-recorded: replay, verify, `runs` and audit must read them as they are.

The recorded events hold the absolute paths of the machine that wrote them (/tmp/reasoning-ledger-demo-*,
the python that ran the tests); none of those is read back, so every test works on a copy in a temp dir."""

import json
import shutil

import pytest

from conftest import TESTS, run_script

GOLDEN = TESTS / "golden" / "demo-run"
RUN_ID = "20261201T111535.010422Z-7e568fd9"
# The heads verify printed when the run was recorded: the chain of the old bytes, not a copy of the writer.
EVENTS_HEAD = (20, "638439c530dc8bc9f0364f2ba686c45e8d084a190c3ee9dee02d614ce9c24319")
INDEX_HEAD = (1, "e8c155c9dde647328031eceb7dd8274f3f09f312bcae624bd507b8046e9c5ab7")


@pytest.fixture
def runs(tmp_path):
    copy = tmp_path / "runs"
    shutil.copytree(GOLDEN, copy)
    return copy


def test_replay_of_the_recorded_run_is_identical(runs):
    proc = run_script("agent.py", "replay", runs / RUN_ID)
    assert (proc.returncode, proc.err) == (0, "")
    assert proc.out.startswith("identical")


def test_replay_notices_a_proposal_that_is_not_the_recorded_one(runs):
    """The check above can fail: the same record with another proposal.patch is a divergence."""
    patch = runs / RUN_ID / "proposal.patch"
    patch.write_bytes(patch.read_bytes().replace(b"+    return a + b", b"+    return b + a"))
    proc = run_script("agent.py", "replay", runs / RUN_ID)
    assert proc.returncode == 1
    assert proc.out.startswith("first divergence") and "proposal.patch" in proc.out


def test_verify_accepts_the_old_bytes_with_the_recorded_heads(runs):
    proc = run_script("reasoning_ledger.py", "verify", "--all", ".", cwd=runs)
    assert proc.returncode == 0, proc.out + proc.err
    rows = {line.split()[1]: line.split() for line in proc.out.splitlines() if line.startswith("ok ")}
    events, index = rows[f"{RUN_ID}/events.jsonl"], rows["index.jsonl"]
    assert (int(events[-2]), events[-1]) == EVENTS_HEAD
    assert (int(index[-2]), index[-1]) == INDEX_HEAD
    closed = json.loads((runs / "index.jsonl").read_text(encoding="utf-8"))["payload"]
    assert (closed["head_seq"], closed["head_hash"]) == EVENTS_HEAD


def test_verify_refuses_one_changed_byte(runs):
    events = runs / RUN_ID / "events.jsonl"
    events.write_bytes(events.read_bytes().replace(b'"steps":4', b'"steps":5', 1))
    proc = run_script("reasoning_ledger.py", "verify", "--all", ".", cwd=runs)
    assert proc.returncode == 1
    assert any(line.startswith("FAIL") and "events.jsonl" in line for line in proc.out.splitlines())


def test_runs_lists_the_old_run_as_verified(runs):
    proc = run_script("agent.py", "runs", "--runs-dir", runs)
    assert (proc.returncode, proc.err) == (0, "")
    header, row, _hint = proc.out.splitlines()
    assert header.split() == ["RUN", "STARTED", "OUTCOME", "STEPS", "TOKENS", "VERIFIED", "WHY"]
    fields = row.split()
    assert fields[:6] == [RUN_ID, "2026-12-01T11:15:35.066601Z", "proposal_accepted", "4", "108", "ok"]
    assert "judge accept" in row


def test_audit_reads_the_old_run(runs):
    proc = run_script("audit.py", "--json", runs)
    assert (proc.returncode, proc.err) == (0, "")
    report = json.loads(proc.out)
    assert report["verified"] is True
    assert report["summary"]["model_calls"] == 4 and report["summary"]["agent_runs"] == 1
    (model,) = report["models"]
    assert (model["request_model"], model["calls"], model["ok"], model["input_tokens"], model["output_tokens"]) == (
        "stand-in-model", 4, 4, 84, 24)
    (run,) = report["agent_runs"]
    assert {k: run[k] for k in ("run_id", "outcome", "judge_verdict", "steps", "tools_allowed", "tools_denied")} == {
        "run_id": RUN_ID, "outcome": "proposal_accepted", "judge_verdict": "accept", "steps": 4,
        "tools_allowed": 3, "tools_denied": 1}


def test_the_golden_files_are_the_recorded_ones():
    """Nobody re-records the golden run to make a test pass: its events still end at the recorded head."""
    assert sorted(p.name for p in GOLDEN.iterdir()) == [RUN_ID, "index.jsonl"]
    last = (GOLDEN / RUN_ID / "events.jsonl").read_bytes().splitlines()[-1]
    assert json.loads(last)["seq"] == EVENTS_HEAD[0]
    assert (GOLDEN / RUN_ID / "proposal.patch").read_bytes().startswith(b"--- a/calc.py\n")
