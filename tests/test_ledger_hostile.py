"""The ledger under threads, forks, hostile payloads, hostile files and a full disk."""

import collections
import json
import subprocess
import sys
import threading

import pytest

import reasoning_ledger as rl
from conftest import ROOT, chain, clean_env, error_lines, event, run_script

NO_KEY = b""


def _verify_fails(path, words, *extra):
    proc = run_script("reasoning_ledger.py", "verify", path, *extra)
    assert proc.returncode == 1, proc.out + proc.err
    assert words in proc.out, proc.out
    assert "Traceback" not in proc.err
    return proc


# ----------------------------------------------------------------------------
# Threads and fork
# ----------------------------------------------------------------------------

def test_one_ledger_shared_by_eight_threads_loses_nothing(tmp_path):
    path = tmp_path / "l.jsonl"
    ledger = rl.Ledger(path, "shared", key=NO_KEY)
    returned = collections.defaultdict(list)
    start = threading.Barrier(8)

    def writer(name):
        start.wait()
        for i in range(150):
            returned[name].append(ledger.append("note", {"writer": name, "i": i})["seq"])

    threads = [threading.Thread(target=writer, args=(f"t{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.close()
    events = list(rl.read_events(path))
    assert [e["seq"] for e in events] == list(range(1, 1201))
    assert all(e["kind"] == "note" for e in events)  # no spurious ledger_recovered
    by_seq = {e["seq"]: e["payload"] for e in events}
    for name, seqs in returned.items():  # every append that returned is there, as returned
        assert [by_seq[s]["i"] for s in seqs] == list(range(150)) and {by_seq[s]["writer"] for s in seqs} == {name}
    assert not (tmp_path / "l.jsonl.torn").exists()


FORK_WRITER = r"""
import os, sys, threading
sys.path.insert(0, sys.argv[1])
import reasoning_ledger as rl
ledger = rl.Ledger(sys.argv[2], "parent", key=b"")
ledger.append("note", {"who": "parent", "i": -1})      # the fd is open before the fork
hold = threading.Thread(target=lambda: [ledger.append("note", {"who": "parent-thread", "i": i}) for i in range(200)])
hold.start()                                            # a thread may hold the lock at the moment of fork
children = []
for n in range(4):
    pid = os.fork()
    if pid == 0:
        for i in range(200):
            ledger.append("note", {"who": f"child{n}", "i": i})
        os._exit(0)
    children.append(pid)
for i in range(200):
    ledger.append("note", {"who": "parent", "i": i})
hold.join()
codes = [os.waitpid(pid, 0)[1] for pid in children]
print(codes)
"""


def test_fork_after_open_keeps_every_append(tmp_path):
    path = tmp_path / "l.jsonl"
    proc = subprocess.run([sys.executable, "-c", FORK_WRITER, str(ROOT), str(path)], capture_output=True,
                          env=clean_env(), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == b"[0, 0, 0, 0]", proc.stderr
    events = list(rl.read_events(path))
    assert [e["seq"] for e in events] == list(range(1, 1 + 1 + 200 + 4 * 200 + 200))
    assert all(e["kind"] == "note" for e in events)
    for who in ("child0", "child1", "child2", "child3", "parent-thread"):
        assert [e["payload"]["i"] for e in events if e["payload"]["who"] == who] == list(range(200))


def test_the_same_artifact_from_many_threads_at_once(tmp_path):
    ledger = rl.Ledger(tmp_path / "l.jsonl", "r", key=NO_KEY)
    body = "the same body " * 10000
    results, failures = [], []
    start = threading.Barrier(16)

    def store():
        start.wait()
        try:
            results.append(ledger.store_artifact(body))
        except Exception as exc:  # the test reports any failure at all
            failures.append(exc)

    threads = [threading.Thread(target=store) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and len({r["sha256"] for r in results}) == 1
    stored = tmp_path / results[0]["path"]
    assert stored.read_text() == body
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == [results[0]["sha256"]]  # no temp left


# ----------------------------------------------------------------------------
# Payloads: one check for JSON types, and a depth limit
# ----------------------------------------------------------------------------

NOT_JSON = [
    collections.Counter(a=1),
    collections.OrderedDict(a=1),
    collections.defaultdict(int, a=1),
    {1: "int key"},
    {None: "none key"},
    {True: "bool key"},
    {(1, 2): "tuple key"},
    {"ok": {"inner": collections.Counter(b=2)}},
    {"ok": [1, {2: "x"}]},
    {"n": float("nan")},
    {"n": [float("-inf")]},
    {"big": 10 ** 5000},
    {"s": {1, 2}},
    {"b": b"bytes"},
    {"sub": type("S", (str,), {})("a str subclass")},
]


@pytest.mark.parametrize("value", NOT_JSON, ids=[f"{i}-{type(v).__name__}" for i, v in enumerate(NOT_JSON)])
@pytest.mark.parametrize("company", ["plain", "secret-looking"])
def test_one_check_for_json_types_whatever_else_the_payload_holds(tmp_path, value, company):
    """A value that is not plain JSON is refused the same way whether or not other strings in the payload
    look like secrets (which once sent it down another path)."""
    path = tmp_path / "l.jsonl"
    with rl.Ledger(path, "r", key=NO_KEY) as ledger:
        ledger.append("note", {})
        before = path.read_bytes()
        payload = value if isinstance(value, dict) and company == "plain" else {"x": value}
        if company == "secret-looking":
            payload["auth"] = "Authorization: Bearer abcDEF123456ghiJKL"
        payload = value if type(value) is not dict and company == "plain" else payload
        with pytest.raises(rl.PayloadError) as caught:
            ledger.append("note", payload)
    assert "nothing was written" in str(caught.value)
    assert path.read_bytes() == before


def test_depth_limit_is_a_payload_error_never_a_recursion_error(tmp_path):
    deep = inner = {}
    for _ in range(rl.MAX_DEPTH - 1):
        inner["d"] = {}
        inner = inner["d"]
    path = tmp_path / "l.jsonl"
    with rl.Ledger(path, "r", key=NO_KEY) as ledger:
        ledger.append("note", deep)  # exactly MAX_DEPTH levels: fine
        inner["d"] = {}
        with pytest.raises(rl.PayloadError, match=f"nested deeper than {rl.MAX_DEPTH} levels"):
            ledger.append("note", deep)
        very = []
        for _ in range(100000):
            very = [very]
        with pytest.raises(rl.PayloadError, match="nested deeper"):
            ledger.append("note", {"v": very})
    assert rl.verify(path).count == 1
    proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note",
                      input='{"a":' * 100000 + "1" + "}" * 100000)
    assert proc.returncode == 2 and "nested deeper" in proc.err and "Traceback" not in proc.err


def test_a_deep_line_already_in_a_ledger_stops_neither_appends_nor_the_verifier(tmp_path):
    path = tmp_path / "l.jsonl"
    deep = '{"seq":2,"run_id":"r1","kind":"note","at":"2026-11-29T12:00:00.000000Z","payload":{"x":' + \
           "[" * 200000 + "]" * 200000 + '},"prev":"{prev}"}'
    path.write_bytes(chain([event(1), deep]))
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        assert ledger.append("note", {"after": True})["seq"] == 3
    proc = _verify_fails(path, "line 2:")
    assert "nested too deeply" in proc.out


def test_lone_surrogates_are_refused_and_named(tmp_path):
    with rl.Ledger(tmp_path / "l.jsonl", "r", key=NO_KEY) as ledger:
        with pytest.raises(rl.PayloadError, match="lone surrogate"):
            ledger.append("note", {"model": "bad\ud800"})


# ----------------------------------------------------------------------------
# Hostile files: blank lines, long lines, torn tails on a full disk
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("tail", [b"\n", b"   \n", b"\t\n", b"\n\n"])
def test_a_blank_last_line_is_an_integrity_error_not_an_empty_file(tmp_path, tail):
    path = tmp_path / "l.jsonl"
    with rl.Ledger(path, "r", key=NO_KEY) as ledger:
        ledger.append("note", {})
    path.write_bytes(path.read_bytes() + tail)
    before = path.read_bytes()
    with rl.Ledger(path, "r", key=NO_KEY) as ledger:
        with pytest.raises(rl.IntegrityError, match="the last line is (blank|white space only)"):
            ledger.append("note", {})
    assert path.read_bytes() == before  # never restarted at seq 1
    proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note", "--payload", "{}")
    assert proc.returncode == 1 and "last line is" in proc.err
    _verify_fails(path, "line 2: ")


def test_a_file_of_one_blank_line_is_not_empty(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_bytes(b"\n")
    with pytest.raises(rl.IntegrityError, match="blank"):
        rl.Ledger(path, "r", key=NO_KEY).append("note", {})
    assert path.read_bytes() == b"\n"


MEASURE = r"""
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True)
sys.stdout.buffer.write(proc.stdout)
print(proc.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
"""


def test_a_line_over_the_limit_is_found_without_reading_it_into_memory(tmp_path):
    path = tmp_path / "l.jsonl"
    huge = b'{"seq":2,"run_id":"r1","kind":"note","at":"2026-11-29T12:00:00.000000Z","payload":{"x":"' + \
           b"y" * (150 * 1024 * 1024) + b'"},"prev":"' + b"0" * 64 + b'"}\n'
    path.write_bytes(chain([event(1)]) + huge)
    proc = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, str(ROOT / "reasoning_ledger.py"),
                           "verify", str(path)], capture_output=True, env=clean_env(), timeout=120)
    *report, last = proc.stdout.decode().splitlines()
    code, peak_mib = map(int, last.split())
    assert code == 1 and "line 2: line is longer than the format's 1048576-byte limit" in "\n".join(report)
    assert peak_mib < 60, f"peak RSS {peak_mib} MiB verifying a 150 MiB line"
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:  # and the writer refuses to build on it
        with pytest.raises(rl.IntegrityError, match="longer than"):
            ledger.append("note", {})


def test_a_huge_fragment_without_a_newline_is_refused_not_read(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_bytes(chain([event(1)]) + b"x" * (3 * 1024 * 1024))
    before_size = path.stat().st_size
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        with pytest.raises(rl.IntegrityError, match="without a newline"):
            ledger.append("note", {})
    assert path.stat().st_size == before_size and not (tmp_path / "l.jsonl.torn").exists()


FULL_DISK = r"""
import os, resource, signal, sys
sys.path.insert(0, sys.argv[1])
import reasoning_ledger as rl
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # past the limit a write fails (EFBIG) instead of killing us
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    rl.Ledger(sys.argv[2], "r1", key=b"").append("note", {"after": "x" * 500})
except OSError as exc:
    print("OSError", exc.filename, exc.strerror)
"""


def test_torn_tail_recovery_on_a_full_disk_leaves_no_half_record(tmp_path):
    path = tmp_path / "l.jsonl"
    sidecar = tmp_path / "l.jsonl.torn"
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        ledger.append("note", {})
    fragment = b'{"seq":2,"run_id":"r1","kind":"note","at":"2026-' + b"z" * 3000
    path.write_bytes(path.read_bytes() + fragment)
    sidecar.write_bytes(b"torn offset=1 length=1 sha256=00 at=earlier\nq\n")  # an earlier, complete record
    ledger_before, sidecar_before = path.read_bytes(), sidecar.read_bytes()
    # the sidecar already holds more than the limit allows for the new record: its write fails midway
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(ROOT), str(path), str(len(sidecar_before) + 1000)],
                          capture_output=True, env=clean_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().startswith(f"OSError {sidecar}"), proc.stdout  # the error names the file
    assert sidecar.read_bytes() == sidecar_before  # the half record was rolled back
    assert path.read_bytes() == ledger_before      # the fragment is still there to recover later
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:  # with room again, recovery works
        ledger.append("note", {"after": True})
    assert [e["kind"] for e in rl.read_events(path)] == ["note", "ledger_recovered", "note"]
    assert sidecar.read_bytes().startswith(sidecar_before) and fragment in sidecar.read_bytes()


def test_a_failed_append_on_a_full_disk_leaves_the_ledger_as_it_was(tmp_path):
    path = tmp_path / "l.jsonl"
    with rl.Ledger(path, "r1", key=NO_KEY) as ledger:
        ledger.append("note", {})
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(ROOT), str(path), str(len(before) + 100)],
                          capture_output=True, env=clean_env(), timeout=60)
    assert proc.stdout.decode().startswith(f"OSError {path}"), proc.stdout
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------
# verify rejects whatever the writer could not have produced (each ledger's chain holds)
# ----------------------------------------------------------------------------

GOOD = '{"seq":2,"run_id":"r1","kind":"note","at":"2026-11-29T12:00:00.000000Z","payload":%s,"prev":"{prev}"}'


@pytest.mark.parametrize("line,words", [
    (GOOD % '{"a":1,"a":2}', "duplicate key 'a'"),
    ('{"seq":2,"seq":2,"run_id":"r1","kind":"note","at":"2026-11-29T12:00:00.000000Z","payload":{},"prev":"{prev}"}',
     "duplicate key 'seq'"),
    (GOOD % '{"n":NaN}', "NaN is not JSON the writer writes"),
    (GOOD % '{"n":Infinity}', "Infinity is not JSON the writer writes"),
    (GOOD % '{"n":-Infinity}', "-Infinity"),
    (GOOD % '{"n":1e999}', "overflows to Infinity"),
    (GOOD % '{"n":-1e400}', "overflows to Infinity"),
    (GOOD.replace('"seq"', '"s\\u0065q"') % "{}", "compact form"),
    (GOOD % '{"t\\u0065xt":"x"}', "compact form"),
    (GOOD % '{"a": 1}', "compact form"),
    (GOOD % '{"a":1 }', "compact form"),
    (GOOD % '{"a":"\\u00e9"}', "compact form"),
    (GOOD % '{"a":"\\/"}', "compact form"),
    (GOOD % '{"a":1.50}', "compact form"),
    (GOOD % '{"a":1E5}', "compact form"),
    (GOOD % '{"a":-0}', "compact form"),
    (GOOD.replace("2026-11-29", "2026-11-2\u0669") % "{}", "bad timestamp"),
    (GOOD.replace("2026-11-29", "２０２６-11-29") % "{}", "bad timestamp"),
    (GOOD.replace("2026-11-29", "2026-02-30") % "{}", "bad timestamp"),
    (GOOD.replace("2026-11-29", "2026-13-01") % "{}", "bad timestamp"),
    (GOOD.replace("12:00:00", "25:00:00") % "{}", "bad timestamp"),
    (GOOD.replace("12:00:00", "12:00:60") % "{}", "bad timestamp"),
    (GOOD.replace("2026-11-29", "2025-02-29") % "{}", "bad timestamp"),
    (GOOD % "{}" + " ", "compact form"),
    ("", "blank line"),
    ("   ", "white space only"),
    (b'{"seq":2,"run_id":"r1","kind":"note","at":"2026-11-29T12:00:00.000000Z","payload":{"a":"\xff"},'
     b'"prev":"{prev}"}', "not UTF-8"),
])
def test_verify_rejects_what_the_writer_could_not_have_written(tmp_path, line, words):
    path = tmp_path / "l.jsonl"
    path.write_bytes(chain([event(1), line, event(3)]))
    proc = _verify_fails(path, "line 2: ")
    assert words in proc.out, proc.out
    assert len(error_lines(proc.err)) == 1


def test_a_leap_day_that_exists_verifies(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_bytes(chain([event(1, at="2024-02-29T23:59:59.999999Z"), event(2)]))
    assert rl.verify(path, key=NO_KEY).count == 2


def test_the_writer_refuses_an_impossible_time_from_its_clock(tmp_path):
    for bad in ("2026-02-30T12:00:00.000000Z", "2026-11-29T12:00:00.000000", "２０２６-11-29T12:00:00.000000Z"):
        ledger = rl.Ledger(tmp_path / "l.jsonl", "r", key=NO_KEY, clock=lambda: bad)
        with pytest.raises(rl.UsageError, match="clock returned"):
            ledger.append("note", {})


def test_every_line_the_writer_writes_reads_back_canonical(tmp_path):
    """The other side of the strict verifier: nothing the writer accepts is refused on reading."""
    path = tmp_path / "l.jsonl"
    odd = ["", "\x00\x01\x1f\x7f", "tab\there", "é 你好 🙂", "\u2028\u2029", '"quoted" \\back\\', "</script>",
           "\ufeffbom", "\U0010ffff"]
    numbers = [0, -1, 2 ** 63, -(2 ** 63), 10 ** 4000, 0.1, -0.0, 1e-300, 1e300, 5e-324, 1.7976931348623157e308]
    with rl.Ledger(path, "r", key=NO_KEY) as ledger:
        for text in odd:
            ledger.append("note", {text: text, "list": [text, None, True, False]})
        for number in numbers:
            ledger.append("note", {"n": number, "nested": {"deeper": [number]}})
    assert rl.verify(path).count == len(odd) + len(numbers)


# ----------------------------------------------------------------------------
# --expect-head and verify --all
# ----------------------------------------------------------------------------

def test_expect_head_checks_seq_zero_too(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    genesis = "0" * 64
    ok = run_script("reasoning_ledger.py", "verify", empty, "--expect-head", f"0:{genesis}")
    assert ok.returncode == 0, ok.out + ok.err
    _verify_fails(empty, "genesis", "--expect-head", f"0:{'1' * 64}")
    keyed = tmp_path / "keyed.jsonl"
    with rl.Ledger(keyed, "r", key="a-ledger-key-123") as ledger:
        ledger.append("note", {})
    env = clean_env(LEDGER_KEY="a-ledger-key-123")
    proc = run_script("reasoning_ledger.py", "verify", keyed, "--expect-head", f"0:{genesis}", env=env)
    assert proc.returncode == 1 and "genesis" in proc.out  # seq 0 of a keyed ledger is the key's genesis
    right = rl.genesis(b"a-ledger-key-123")
    assert run_script("reasoning_ledger.py", "verify", keyed, "--expect-head", f"0:{right}", env=env).returncode == 0


@pytest.mark.parametrize("head", ["1:" + "a" * 64, "٣:" + "a" * 64, "1:" + "g" * 64, "-1:" + "a" * 64, ""])
def test_a_malformed_head_is_a_usage_error(tmp_path, head):
    path = tmp_path / "l.jsonl"
    path.touch()
    proc = run_script("reasoning_ledger.py", "verify", path, "--expect-head", head)
    assert proc.returncode == (1 if head.startswith("1:a") else 2), proc.out + proc.err


def test_verify_all_reports_every_run_past_an_unreadable_one_and_integrity_wins(tmp_path):
    runs = tmp_path / "runs"
    made = []
    for _ in range(4):
        run = rl.open_run(runs, key=NO_KEY)
        run.append("note", {})
        run.close("no_action")
        made.append(run)
    unreadable = made[1].dir / "events.jsonl"
    unreadable.unlink()
    unreadable.mkdir()  # opening it fails with an OSError, as for an unreadable file
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 2, proc.out  # only unreadable: exit 2
    assert proc.out.count("ok    ") == 4 and "ERROR" in proc.out  # index + 3 runs, past the bad one
    tampered = made[2].dir / "events.jsonl"
    tampered.write_bytes(tampered.read_bytes().replace(b'"outcome":"no_action"', b'"outcome":"accepted"'))
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 1, proc.out  # integrity failure outranks the unreadable one
    assert "FAIL" in proc.out and "ERROR" in proc.out and proc.out.count("ok    ") == 3
    (runs / "index.jsonl").unlink()
    (runs / "index.jsonl").mkdir()  # without the index, runs are checked only as chains: still no pass
    proc = run_script("reasoning_ledger.py", "verify", "--all", runs)
    assert proc.returncode == 2 and proc.out.count("ERROR") == 2 and proc.out.count("ok    ") == 3


def test_key_env_value_is_masked_like_ledger_key(tmp_path):
    path = tmp_path / "l.jsonl"
    env = clean_env(MY_LEDGER_HMAC="hmac-value-7f3a9c2e")
    proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note", "--key-env", "MY_LEDGER_HMAC",
                      "--payload", json.dumps({"note": "the key is hmac-value-7f3a9c2e"}), env=env)
    assert proc.returncode == 0, proc.err
    assert b"hmac-value-7f3a9c2e" not in path.read_bytes()


def test_io_errors_name_the_file(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError) as caught:
        rl.Ledger(tmp_path / "a-file" / "l.jsonl", "r", key=NO_KEY).append("note", {})
    assert str(tmp_path / "a-file") in str(caught.value.filename)
    with pytest.raises(OSError) as caught:
        rl.store_artifact(tmp_path / "a-file" / "artifacts", b"x")
    assert caught.value.filename and "a-file" in caught.value.filename
    proc = run_script("reasoning_ledger.py", "append", tmp_path / "a-file" / "l.jsonl", "--kind", "note")
    assert proc.returncode == 2 and "a-file" in proc.err and len(error_lines(proc.err)) == 1
