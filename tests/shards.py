"""Run the suite as N pytest processes at once, each a shard of the collected tests (`make test`, TEST_JOBS).

usage: python tests/shards.py N [pytest args...]

Most tests wait on subprocesses, sockets and fsyncs, so two shards on two cores take little more than half the
time of one. Shard 0 prints as it runs; the others' output follows, in order, as each ends. The exit code is
pytest's own: 0 when every shard passed (a shard left with no test counts as passed), 5 ("no tests ran") when no
shard collected a test, else the first failing shard's code.
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv):
    count, args = int(argv[0]), argv[1:]
    if count < 1:
        raise SystemExit("error: TEST_JOBS must be at least 1")
    top = Path(tempfile.mkdtemp(prefix="rl-tests-"))
    procs, logs = [], []
    for index in range(count):
        env = {**os.environ, "TEST_SHARD": f"{index}/{count}"}
        log = None if index == 0 else open(top / f"shard{index}.log", "w+b")
        command = [sys.executable, "-m", "pytest", f"--basetemp={top / f'tmp{index}'}", *args]
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT if log else None))
        logs.append(log)
    try:
        codes = [proc.wait() for proc in procs]
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        raise
    summaries = []
    for index, log in enumerate(logs[1:], start=1):
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
        sys.stdout.write(f"\n---------------- shard {index} of {count} ----------------\n{text}")
        summaries.append(text.rstrip().rsplit("\n", 1)[-1])
    sys.stdout.write(f"\nshards: {count}, exit codes {codes}; the other shards' summaries: {summaries}\n")
    failed = [code for code in codes if code not in (0, 5)]
    if not failed:
        shutil.rmtree(top, ignore_errors=True)  # a failed run keeps its tmp dirs to look at
    if failed:
        return failed[0]
    if all(code == 5 for code in codes):
        sys.stdout.write("no tests ran\n")
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
