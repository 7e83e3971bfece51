"""Run the suite as N pytest processes at once, each a shard of the collected tests (`make test`, TEST_JOBS).

usage: python tests/shards.py N [pytest args...]

Most tests wait on subprocesses, sockets and fsyncs, so two shards on two cores take little more than half the
time of one. Shard 0 prints as it runs; the others' output follows, in order, once all have ended, then one line
with the counts summed. The exit code is pytest's own: 0 when every shard passed (a shard left with no test counts
as passed), 5 ("no tests ran") when no shard collected a test, else the first failing shard's code.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _summary(text):
    """pytest's last line, e.g. '=== 3 passed, 1 skipped, 4 deselected in 1.2s ==='."""
    return text.rstrip().rsplit("\n", 1)[-1].strip("= ")


def main(argv):
    count, args = int(argv[0]), argv[1:]
    if count < 1:
        raise SystemExit("error: TEST_JOBS must be at least 1")
    top = Path(tempfile.mkdtemp(prefix="rl-tests-"))
    procs, logs = [], []
    for index in range(count):
        env = {**os.environ, "TEST_SHARD": f"{index}/{count}", "PYTHONUNBUFFERED": "1"}
        log = subprocess.PIPE if index == 0 else open(top / f"shard{index}.log", "w+b")
        command = [sys.executable, "-m", "pytest", f"--basetemp={top / f'tmp{index}'}", *args]
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        tail = b""
        for chunk in iter(lambda: os.read(procs[0].stdout.fileno(), 65536), b""):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            tail = (tail + chunk)[-4096:]
        codes = [proc.wait() for proc in procs]
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        raise
    summaries = [_summary(tail.decode("utf-8", "replace"))]
    for index, log in enumerate(logs[1:], start=1):
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
        sys.stdout.write(f"\n---------------- shard {index} of {count} ----------------\n{text}")
        summaries.append(_summary(text))
    totals = {}
    for summary in summaries:
        for number, word in re.findall(r"([0-9]+) ([a-z]+)", summary.split(" in ")[0]):
            if word != "deselected":
                totals[word] = totals.get(word, 0) + int(number)
    counted = ", ".join(f"{n} {word}" for word, n in totals.items()) or "nothing"
    sys.stdout.write(f"\nall {count} shards: {counted}; exit codes {codes}\n")
    failed = [code for code in codes if code not in (0, 5)]
    if failed:
        return failed[0]  # a failed run keeps its tmp dirs to look at
    shutil.rmtree(top, ignore_errors=True)
    if all(code == 5 for code in codes):
        sys.stdout.write("no tests ran\n")
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
