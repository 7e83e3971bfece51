"""Parallel audit (issue 29): `audit.py --jobs N` prints, to the byte, what `--jobs 1` prints (stdout,
stderr, exit code, the --html page) over ledgers that use every part of the merge: model strings past
MAX_MODEL_STRINGS first seen in later ranges, several days, each day's listings with later ones in later
ranges, imported transcripts, sessions, errors, retries, calls never sent; and over every tamper class
placed on each side of every place a worker's range can begin or end."""

import hashlib
import json
import subprocess
import sys

import pytest

import audit
import reasoning_ledger as rl
from conftest import ROOT, clean_env, run_script

KEY = "k3y-for-parallel-audit"
DAYS = ("2026-11-01", "2026-11-02", "2026-11-03")


def clock(days, per_day):
    """A ledger clock that walks through `days`, `per_day` lines each, one second apart."""
    ticks = iter(range(10**7))

    def now():
        tick = next(ticks)
        day = days[min(tick // per_day, len(days) - 1)]
        return f"{day}T10:{tick // 60 % 60:02d}:{tick % 60:02d}.000000Z"

    return now


def call(i, model, **extra):
    payload = {
        "request_model": model,
        "base_url": f"https://llm{i % 2}.example.net/v1",
        "response_model": f"{model}-0{i % 3}",
        "system_fingerprint": f"fp_{i % 4}",
        "attempt": 1 + (i % 5 == 0),
        "usage_reported": i % 6 != 0,
        "usage_status": "complete" if i % 6 else "absent",
        "input_tokens": 10 + i,
        "output_tokens": 3 * i,
        "est_input_tokens": 9 + i,
        "est_output_tokens": i,
        "latency_ms": 100.0 + (i * 37) % 900,
        "error_type": None,
        "http_status": 200,
        "check": (i % 4 == 0) if i % 3 == 0 else None,
        "session_id": f"sess-{i % 3}"
    }
    if i % 7 == 3:
        payload.update(error_type="http_error", error_code=f"E{i % 2}", http_status=500)
    if i % 11 == 5:  # refused before it was sent: counted apart, never served
        payload.update(error_type="model_missing", http_status=None)
    payload.update(extra)
    return payload


def transcript(i, version):
    day = DAYS[i % len(DAYS)]
    return {
        "agent": "claude",
        "session_id": f"t-{i % 2}",
        "source": f"/home/u/s-{i % 2}.jsonl",
        "version": version,
        "agent_version": f"2.1.{i % 3}",
        "usage": {
            "m-transcribed": {day: {"turns": 1 + i % 2, "tool_calls": i % 3, "input_tokens": 5 * i}}
        }
    }


def rich(path, key=b"", calls=40, models=("alpha", "beta", "gamma"), labels=None):
    """A ledger of `calls` model calls across DAYS, with listings, transcripts and notes between them."""
    with rl.Ledger(path, "r1", key=key, fsync=False, clock=clock(DAYS, max(1, calls // 3))) as book:
        for i in range(calls):
            extra = {"response_model": labels(i)} if labels else {}
            book.append("model_call", call(i, models[i % len(models)], **extra))
            if i % 5 == 2:  # the day's last listing wins; a later one may drop or add a model
                book.append(
                    "models_list",
                    {
                        "base_url": f"https://llm{i % 2}.example.net/v1",
                        "model_ids": list(models[: 1 + i % len(models)])
                    }
                )
            if i % 9 == 4:  # a file's later version replaces its earlier segments
                book.append("transcript", transcript(i, version=i // 18))
            if i % 13 == 6:
                book.append("note", {"i": i, "text": "abcdefgh" * (i % 11)})
    return path.read_bytes().splitlines(keepends=True)


def outcome(*args, env=None, tmp=None):
    html = []
    if tmp is not None:
        html = ["--html", tmp / "page.html"]
    proc = run_script("audit.py", *args, *html, env=env or clean_env(), timeout=300)
    page = (tmp / "page.html").read_bytes() if tmp is not None and proc.returncode == 0 else None
    return proc.out, proc.err, proc.returncode, page


def same_for_every_jobs(*args, env=None, tmp=None):
    """`audit.py ARGS --jobs 1` against --jobs 2 and 3: stdout, stderr, exit code and page alike."""
    one = outcome(*args, "--jobs", "1", env=env, tmp=tmp)
    for jobs in ("2", "3"):
        assert outcome(*args, "--jobs", jobs, env=env, tmp=tmp) == one, jobs
    return one


WORKERS_USED = (
    "import sys, audit; "
    "print(bool(audit._parallel(audit.Audit(jobs=int(sys.argv[2])), sys.argv[1])))"
)


def workers_used(path, jobs=3):
    """Whether `--jobs N` merges workers' shares for this ledger (else one process reads it all). In
    a fresh interpreter: workers are never forked from a process with threads, and the suite's
    process may hold some (servers other tests started)."""
    proc = subprocess.run([sys.executable, "-c", WORKERS_USED, str(path), str(jobs)], capture_output=True,
                          cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout == b"True\n"


REPORTS = [
    (),
    ("--by", "day"),
    ("--by", "session"),
    ("--json",),
    ("--json", "--by", "day"),
    ("--csv", "--by", "day"),
    ("--since", DAYS[1]),
    ("--until", DAYS[1], "--json"),
    ("--model", "beta", "--by", "day"),
    ("--json", "--by", "session")
]


@pytest.mark.parametrize("report", REPORTS, ids=[" ".join(r) or "text" for r in REPORTS])
def test_every_report_is_the_same_at_every_jobs(tmp_path, report):
    rich(tmp_path / "calls.jsonl", calls=90)
    out, _err, code, page = same_for_every_jobs(tmp_path / "calls.jsonl", *report, tmp=tmp_path)
    assert (
        code == 0 and "llm0.example.net" in out and page and workers_used(tmp_path / "calls.jsonl")
    )
    if "--json" in report and "--since" not in report and "--model" not in report:
        doc = json.loads(out)
        assert doc["imported"]["agents"] and doc["ledgers"][0]["lines"] > 90


def test_a_keyed_ledger_and_several_files_are_the_same_at_every_jobs(tmp_path):
    rich(tmp_path / "calls.jsonl", key=KEY.encode(), calls=60)
    rich(tmp_path / "more.jsonl", key=KEY.encode(), calls=30, models=("beta", "delta"))
    env = clean_env(LEDGER_KEY=KEY)
    out, _err, code, _page = same_for_every_jobs(
        tmp_path / "calls.jsonl", tmp_path / "more.jsonl", "--by", "day", "--json", env=env
    )
    assert code == 0 and len(json.loads(out)["ledgers"]) == 2
    # no key: every jobs says the same thing about it
    assert same_for_every_jobs(tmp_path / "calls.jsonl", env=clean_env())[2] == 2


def many_models(path, strings, labels=None):
    """Past MAX_MODEL_STRINGS model strings, the later ones first seen in later ranges."""
    models = tuple(f"m-{i:05d}" for i in range(strings))
    return rich(path, calls=strings + 150, models=models, labels=labels)


@pytest.mark.parametrize(
    "report", [(), ("--json", "--by", "day"), ("--csv",)], ids=["text", "json", "csv"]
)
def test_model_strings_past_the_limit_fold_first_come_at_every_jobs(tmp_path, report):
    many_models(
        tmp_path / "calls.jsonl", audit.MAX_MODEL_STRINGS + 300, labels=lambda i: f"served-{i % 4}"
    )
    out, _err, code, _page = same_for_every_jobs(tmp_path / "calls.jsonl", *report, tmp=tmp_path)
    assert code == 0 and audit.OTHER in out and workers_used(tmp_path / "calls.jsonl")


def test_a_folded_row_with_many_labels_is_the_same_at_every_jobs(tmp_path):
    # every model string served under its own name: the (other) row holds more than MAX_LABELS of
    # them
    many_models(
        tmp_path / "calls.jsonl", audit.MAX_MODEL_STRINGS + 300, labels=lambda i: f"served-{i}"
    )
    out, _err, code, _page = same_for_every_jobs(tmp_path / "calls.jsonl", "--json", "--by", "day")
    folded = [r for r in json.loads(out)["models"] if r["request_model"] == audit.OTHER]
    assert code == 0 and any(audit.OTHER in r["response_models"] for r in folded)
    # their (other) rows would gather labels out of order
    assert not workers_used(tmp_path / "calls.jsonl")


@pytest.mark.parametrize("what", ["model strings", "labels"])
def test_more_than_a_worker_keeps_is_the_same_at_every_jobs(tmp_path, what):
    # past WORKER_*: the workers' shares are dropped and one process reads the ledger
    if what == "model strings":
        many_models(tmp_path / "calls.jsonl", 2 * audit.WORKER_MODEL_STRINGS + 10)
    else:
        rich(
            tmp_path / "calls.jsonl",
            calls=6 * audit.WORKER_LABELS + 60,
            models=("solo",),
            labels=str
        )
    out, _err, code, _page = same_for_every_jobs(tmp_path / "calls.jsonl", "--json", "--by", "day")
    assert (
        code == 0
        and json.loads(out)["models"]
        and not workers_used(tmp_path / "calls.jsonl", jobs=2)
    )


# a payload byte changed, the JSON still valid: the next line's prev no longer matches
def flip(line):
    return line.replace(b'"payload":{"', b'"payload":{"z', 1)


def forged(line):
    event = json.loads(line)
    event["payload"] = {"forged": True}
    return rl.dumps(event).encode() + b"\n"


def rechained(lines, i):
    """From line i+1 on, other content chained anew with plain SHA-256: a whole ledger that verifies
    without a key, and fails at line i+1 with one."""
    out, prev = lines[:i], hashlib.sha256(lines[i - 1][:-1]).hexdigest() if i else "0" * 64
    for raw in lines[i:]:
        event = json.loads(raw)
        event.update(payload=dict(event["payload"], rebuilt=True), prev=prev)
        body = rl.dumps(event).encode()
        out.append(body + b"\n")
        prev = hashlib.sha256(body).hexdigest()
    return out


TAMPER = {
    "flipped byte": lambda lines, i: lines[:i] + [flip(lines[i])] + lines[i + 1 :],
    "lost line": lambda lines, i: lines[:i] + lines[i + 1 :],
    "reordered": lambda lines, i: lines[:i]
    + lines[i + 1 : i + 2]
    + lines[i : i + 1]
    + lines[i + 2 :],
    "rebuilt line": lambda lines, i: lines[:i] + [forged(lines[i])] + lines[i + 1 :],
    "rebuilt chain": rechained,
    "duplicated line": lambda lines, i: lines[: i + 1] + lines[i:],
    "cut tail": lambda lines, i: lines[:i],
    "torn last line": lambda lines, i: lines[:i] + [lines[i][: len(lines[i]) // 2]],
    "bad JSON": lambda lines, i: lines[:i]
    + [b'{"seq":%d,"run_id":"r1" oops}\n' % (i + 1)]
    + lines[i + 1 :]
}


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
@pytest.mark.parametrize("name", list(TAMPER))
def test_every_tamper_at_every_line_says_the_same_at_every_jobs(tmp_path, name, keyed):
    key = KEY if keyed else ""
    lines = rich(tmp_path / "good.jsonl", key=key.encode(), calls=18)
    paths = []
    # every line, so every range boundary has a tampered line on each side
    for i in range(len(lines)):
        paths.append(tmp_path / f"at-{i:03d}.jsonl")
        paths[-1].write_bytes(b"".join(TAMPER[name](lines, i)))
    out, err, code, _page = same_for_every_jobs(
        *paths, "--json", env=clean_env(LEDGER_KEY=key or None)
    )
    if name == "rebuilt chain":  # nothing tells a plain ledger rebuilt by its writer's rules
        assert code == (1 if keyed else 0), err
    # a shorter ledger, or one a writer is mid-append to
    elif name in ("cut tail", "torn last line"):
        ledgers = json.loads(out)["ledgers"]
        assert code == 0 and [x["lines"] for x in ledgers] == list(range(len(lines)))
        assert {x["status"] for x in ledgers} == {"ok" if name == "cut tail" else "torn"}
    else:  # each fails at its own line, one FAIL line a ledger (a change to the last line may not)
        assert code == 1 and out.count("FAIL") >= len(lines) - 2, err
    # and each alone: the message that fails the run names that one file
    for path in paths[:: max(1, len(paths) // 6)]:
        same_for_every_jobs(path, "--json", "--allow-empty", env=clean_env(LEDGER_KEY=key or None))


def test_a_bad_jobs_is_refused(tmp_path):
    rich(tmp_path / "calls.jsonl", calls=5)
    proc = run_script("audit.py", tmp_path / "calls.jsonl", "--jobs", "0")
    assert proc.returncode == 2 and proc.err == "error: --jobs must be 1 or more\n"


HOSTILE_TRANSCRIPTS = [  # what a line anyone could append may hold where transcripts.py writes
    {"version": "2"},
    {"version": 3},
    {"version": None},
    {"version": 1.5},
    {"version": True},
    {"version": 4, "agent": ["a"]},
    {"version": 4, "session_id": {"x": 1}},
    {"version": 2},
    {"version": 5, "usage": {"m": {"2026-11-01": {"turns": "many"}}}},
    {"version": 5, "usage": []}
]


def test_transcript_lines_of_any_shape_are_counted_or_skipped_never_a_crash(tmp_path):
    path = tmp_path / "calls.jsonl"
    rich(path, calls=30)
    with rl.Ledger(path, "r1", fsync=False) as book:
        for hostile in HOSTILE_TRANSCRIPTS:
            book.append("transcript", dict(transcript(1, 0), **hostile))
    for report in ((), ("--json",)):
        out, err, code, _page = same_for_every_jobs(path, *report)
        assert code == 0 and err == "" and "Traceback" not in out
    doc = json.loads(out)
    # the file's latest int version (5) is the one counted; the other shapes are left out
    assert doc["imported"]["agents"]["claude"]["sessions"] >= 1
