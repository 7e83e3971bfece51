"""Parallel verify and group commit (issue 29): `verify --jobs N` says exactly what `--jobs 1` says, over
every tamper class and every place a worker's range can begin or end; concurrent appends share fsyncs and a
kill -9 loses no append that returned."""

import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import reasoning_ledger as rl
from conftest import ROOT, clean_env, run_script

NO_KEY = b""
KEY = "k3y-for-parallel-tests"
LINES = 13  # lines of uneven length, so the byte cuts of 2, 3 and 4 workers fall on many different lines


def ledger(path, key=NO_KEY, lines=LINES):
    with rl.Ledger(path, "r1", key=key, fsync=False) as book:
        for i in range(lines):
            book.append("note", {"i": i, "text": "abcdefgh" * (i * 7 % 11)})
    return path.read_bytes().splitlines(keepends=True)


def flip(line):  # a payload byte changed, the JSON still valid: the next line's prev no longer matches
    return line.replace(b'"i":', b'"j":', 1)


def forged(line):  # the line rebuilt by the writer's encoder with other content and its own seq
    event = json.loads(line)
    event["payload"] = {"forged": True}
    return rl.dumps(event).encode() + b"\n"


# Each tamper class: lines -> position -> the tampered lines.
TAMPER = {
    "flipped byte": lambda lines, i: lines[:i] + [flip(lines[i])] + lines[i + 1:],
    "byte that breaks the JSON": lambda lines, i: lines[:i] + [lines[i].replace(b'"', b"#", 2)] + lines[i + 1:],
    "lost line": lambda lines, i: lines[:i] + lines[i + 1:],
    "reordered": lambda lines, i: lines[:i] + lines[i + 1:i + 2] + lines[i:i + 1] + lines[i + 2:],
    "rebuilt line": lambda lines, i: lines[:i] + [forged(lines[i])] + lines[i + 1:],
    "duplicated line": lambda lines, i: lines[:i + 1] + lines[i:],
    "cut tail": lambda lines, i: lines[:i],
    "torn last line": lambda lines, i: lines[:i] + [lines[i][: len(lines[i]) // 2]],
    "bad JSON": lambda lines, i: lines[:i] + [b'{"seq":%d,"run_id":"r1" oops}\n' % (i + 1)] + lines[i + 1:],
    "blank line": lambda lines, i: lines[:i] + [b"\n"] + lines[i:],
}


def outcome(*args, env=None):
    proc = run_script("reasoning_ledger.py", "verify", *args, env=env)
    return proc.out, proc.err, proc.returncode


def same_for_every_jobs(*args, env=None):
    """`verify ARGS --jobs 1` against --jobs 2, 3, 4 and the default: stdout, stderr and exit code alike."""
    one = outcome(*args, "--jobs", "1", env=env)
    for jobs in ("2", "3", "4", None):
        assert outcome(*args, *(("--jobs", jobs) if jobs else ()), env=env) == one, jobs
    return one


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
@pytest.mark.parametrize("name", list(TAMPER))
def test_parallel_verify_says_what_one_process_says_for_every_tamper_at_every_line(tmp_path, name, keyed):
    key = KEY if keyed else NO_KEY
    env = clean_env(LEDGER_KEY=KEY if keyed else None)
    lines = ledger(tmp_path / "good.jsonl", key=key)
    paths = [tmp_path / "good.jsonl"]
    for i in range(LINES):  # every line, so every worker boundary has a tampered line on each side of it
        paths.append(tmp_path / f"at-{i}.jsonl")
        paths[-1].write_bytes(b"".join(TAMPER[name](lines, i)))
    out, err, code = same_for_every_jobs(*paths, env=env)
    assert out.startswith(f"ok    {paths[0]}  {LINES} lines  head {LINES} ")
    if name != "cut tail":  # the others all fail, each at its own line (a change to the last line may not)
        assert code == 1 and out.count("FAIL ") >= LINES - 1 and err.startswith("error: integrity check failed")


def test_parallel_verify_holds_a_cut_or_rewritten_ledger_to_its_head(tmp_path):
    lines = ledger(tmp_path / "good.jsonl")
    head = run_script("reasoning_ledger.py", "head", tmp_path / "good.jsonl").out.strip().replace(" ", ":")
    for i in range(LINES):
        cut = tmp_path / f"cut-{i}.jsonl"
        cut.write_bytes(b"".join(lines[:i]))
        assert "truncated: the expected head" in same_for_every_jobs(cut, "--expect-head", head)[0]
        rewritten = tmp_path / f"rewritten-{i}.jsonl"
        rewritten.write_bytes(b"".join(TAMPER["rebuilt line"](lines, i)))
        out, _err, code = same_for_every_jobs(rewritten, "--expect-head", head)
        assert code == 1 and f"line {min(i + 2, LINES)}: " in out


def test_parallel_verify_with_the_wrong_key_or_none(tmp_path):
    ledger(tmp_path / "keyed.jsonl", key=KEY)
    ledger(tmp_path / "plain.jsonl")
    paths = (tmp_path / "keyed.jsonl", tmp_path / "plain.jsonl")
    assert same_for_every_jobs(*paths, env=clean_env(LEDGER_KEY="another-key-0000"))[2] == 1
    assert "key is needed" in same_for_every_jobs(*paths)[0]


def test_parallel_verify_of_runs_and_of_a_pipe(tmp_path):
    run = rl.open_run(tmp_path / "runs", key=NO_KEY, fsync=False)
    for i in range(LINES):
        run.append("note", {"i": i})
    run.close("ok")
    same_for_every_jobs("--all", tmp_path / "runs")
    events = run.dir / "events.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    events.write_bytes(b"".join(lines[:5] + lines[6:]))
    assert same_for_every_jobs("--all", tmp_path / "runs")[2] == 1
    # a pipe is read once, by one process
    lines = ledger(tmp_path / "piped.jsonl")
    for jobs in ("1", "4"):
        proc = subprocess.run([sys.executable, str(ROOT / "reasoning_ledger.py"), "verify", "/dev/stdin",
                               "--jobs", jobs], input=b"".join(lines), capture_output=True, env=clean_env())
        assert proc.returncode == 0 and f" {LINES} lines " in proc.stdout.decode()


VOUCHED = "import sys; sys.path.insert(0, sys.argv[1]); import reasoning_ledger as rl; " \
          "print(rl.parallel_start(sys.argv[2], b'', None, int(sys.argv[3]), None))"


def test_the_workers_do_the_checking(tmp_path):
    """The comparisons above would hold if the workers never ran: here they vouch for the lines."""
    lines = ledger(tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(TAMPER["lost line"](lines, 9)))
    for jobs in (2, 3, 4):
        out = subprocess.run([sys.executable, "-c", VOUCHED, str(ROOT), str(tmp_path / "good.jsonl"), str(jobs)],
                             capture_output=True, text=True, env=clean_env(), check=True).stdout
        assert json.loads(out.replace("'", '"')) == [LINES, rl.verify(tmp_path / "good.jsonl", key=NO_KEY).head[1],
                                                     sum(map(len, lines))]
        out = subprocess.run([sys.executable, "-c", VOUCHED, str(ROOT), str(bad), str(jobs)],
                             capture_output=True, text=True, env=clean_env(), check=True).stdout
        assert json.loads(out.replace("'", '"'))[0] <= 9  # they stop where the chain breaks


def test_bad_jobs_is_a_usage_error(tmp_path):
    ledger(tmp_path / "l.jsonl")
    proc = run_script("reasoning_ledger.py", "verify", tmp_path / "l.jsonl", "--jobs", "0")
    assert proc.returncode == 2 and proc.err.startswith("error: --jobs")


# ----------------------------------------------------------------------------
# Group commit
# ----------------------------------------------------------------------------

def test_threads_appending_at_once_keep_the_chain_in_write_order(tmp_path):
    path = tmp_path / "l.jsonl"
    book = rl.Ledger(path, "r1", key=NO_KEY)
    returned, guard = [], threading.Lock()

    def writer(name):
        for i in range(40):
            event = book.append("note", {"writer": name, "i": i})
            with guard:
                returned.append((event["seq"], name, i))

    threads = [threading.Thread(target=writer, args=(f"t{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    book.close()
    events = list(rl.read_events(path, key=NO_KEY))
    assert [e["seq"] for e in events] == list(range(1, 321))
    assert sorted(returned) == sorted((e["seq"], e["payload"]["writer"], e["payload"]["i"]) for e in events)
    for n in range(8):  # each thread's lines in its own order
        assert [e["payload"]["i"] for e in events if e["payload"]["writer"] == f"t{n}"] == list(range(40))


THREADED_WRITER = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
import reasoning_ledger as rl
book, out = rl.Ledger(sys.argv[2], sys.argv[3], key=b""), threading.Lock()
def writer(name):
    for i in range(100000):
        event = book.append("note", {"writer": name, "i": i})
        with out:  # a row means: this append returned
            print(event["seq"], name, i, flush=True)
for n in range(6):
    threading.Thread(target=writer, args=(f"{sys.argv[3]}-{n}",)).start()
"""


def test_kill_9_of_threads_sharing_fsyncs_loses_no_append_that_returned(tmp_path):
    path = tmp_path / "l.jsonl"
    rng = random.Random(29)
    returned = {}
    for round_no in range(6):
        procs = [subprocess.Popen([sys.executable, "-c", THREADED_WRITER, str(ROOT), str(path), f"k{round_no}{w}"],
                                  stdout=subprocess.PIPE, env=clean_env()) for w in range(2)]
        firsts = [proc.stdout.readline() for proc in procs]  # each process has appended: a slow start is no miss
        time.sleep(rng.uniform(0.0, 0.3))
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        for proc, first in zip(procs, firsts):
            out = first + proc.stdout.read()
            proc.stdout.close()
            proc.wait(timeout=60)
            for row in out.decode().split("\n")[:-1]:  # a row cut by the kill is not counted
                seq, name, i = row.split()
                returned[int(seq)] = (name, int(i))
        with rl.Ledger(path, "after-crash", key=NO_KEY) as book:  # the next append repairs a torn tail
            book.append("note", {"round": round_no})
        assert run_script("reasoning_ledger.py", "verify", path).returncode == 0
    by_seq = {e["seq"]: e for e in rl.read_events(path, key=NO_KEY)}
    assert len(returned) > 12, "the writers never got to append"
    for seq, (name, i) in returned.items():  # every append that returned is there, unchanged
        assert by_seq[seq]["payload"] == {"writer": name, "i": i}


def test_a_checkpoint_of_a_big_ledger_signs_the_root_one_process_computes(tmp_path):
    """`checkpoint` over a ledger big enough for workers (PARALLEL_BYTES): they verify the lines and hash
    the leaves; the root and size are the ones the plain tree gives, a torn tail is no leaf, and a changed
    line fails at the line after it, as in one process."""
    key = tmp_path / "log.key"
    assert run_script("reasoning_ledger.py", "keygen", "example.org/log", "--out", key).returncode == 0
    big = tmp_path / "big.jsonl"
    with rl.Ledger(big, "r1", key=NO_KEY, fsync=False) as book:
        for _ in range(rl.PARALLEL_BYTES // 1000 + 10):
            book.append("note", {"text": "abcdefgh" * 125})
    lines = big.read_bytes().splitlines(keepends=True)
    assert rl._line_ranges(big, None) or (os.cpu_count() or 1) < 2  # workers, where there are cores
    for name, data in (("good", lines), ("torn", lines + [lines[5][:40]])):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(data))
        tree = rl.Tree()
        for raw in lines:
            tree.add(raw[:-1])
        proc = run_script("reasoning_ledger.py", "checkpoint", path, "--key", key)
        assert proc.returncode == 0, proc.err
        origin, size, root = proc.out.split("\n")[:3]
        assert (origin, int(size), root) == ("example.org/log", len(lines), base64.b64encode(tree.root()).decode())
    for i in (1, len(lines) // 3, len(lines) // 2, len(lines) - 2):
        path = tmp_path / f"at-{i}.jsonl"
        path.write_bytes(b"".join(lines[:i] + [flip_payload(lines[i])] + lines[i + 1:]))
        proc = run_script("reasoning_ledger.py", "checkpoint", path, "--key", key)
        assert proc.returncode == 1 and f"line {i + 2}: prev does not match line {i + 1}" in proc.err, proc.err


def flip_payload(line):
    return line.replace(b'"text":"a', b'"text":"b', 1)
