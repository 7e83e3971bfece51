#!/usr/bin/env python3
"""bench_checkpoints.py -- signed checkpoints (issue 26), printed by `make bench` (`tests/bench.py checkpoints`).

bench(quick) returns rows (name, figure, target, note), each taken in this run:
  * `checkpoint`'s work on the big ledger (verify the chain and build the RFC 6962 tree in the same single
    pass) vs a bare `verify` of the same file (target <= 1.3);
  * `verify --checkpoint`'s work (the tree's pass to the checkpoint's size, then `verify`) vs a bare `verify`
    (report);
  * the tree alone (one streaming pass, SHA-256 per leaf) vs a bare `verify` (report);
  * signing one checkpoint and verifying one, in milliseconds (pure-Python Ed25519; target < 50 ms each).
"""

import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for entry in (str(ROOT), str(ROOT / "tests")):
    if entry not in sys.path:
        sys.path.insert(0, entry)

import reasoning_ledger as rl  # noqa: E402
from bench import BIG_LINES, _median_time as _median, big_ledger  # noqa: E402


def bench(quick=True):
    big = big_ledger()
    seed = os.urandom(32)
    public = rl.ed25519_public(seed)
    key = rl.NoteKey("bench.example/log", rl._key_id("bench.example/log", 1, public), 1, public, seed)
    vkey = key._replace(seed=None)

    def checkpoint_pass():  # what `checkpoint` does before it signs
        tree = rl.Tree()
        for _event, raw, _digest in rl.verified_events(big, key=b""):
            tree.add(raw)
        return f"{key.name}\n{tree.size}\n{rl._b64(tree.root())}\n"

    body = checkpoint_pass()
    checkpoint = rl.parse_checkpoint(rl.sign_note(body, key))[0]

    def verify_pass():
        rl.verify(big, key=b"")

    def workers_pass():  # `checkpoint` as it runs: from PARALLEL_BYTES up, workers verify and hash leaves
        rl.make_checkpoint(big, key, key=b"")

    def tree_pass():
        rl.tree_proof(big, checkpoint.size, old=checkpoint.size)

    def verify_checkpoint_pass():
        rl.check_against(big, checkpoint, key=b"")

    base, made, held, tree, split = [], [], [], [], []
    for _ in range(3):  # interleaved, so drift on a shared box hits every side
        base.append(_median(verify_pass, 1))
        made.append(_median(checkpoint_pass, 1))
        split.append(_median(workers_pass, 1))
        held.append(_median(verify_checkpoint_pass, 1))
        tree.append(_median(tree_pass, 1))
    base = statistics.median(base)
    note = rl.sign_note(body, key)
    sign_ms = _median(lambda: rl.sign_note(body, key), 20) * 1000
    open_ms = _median(lambda: rl.open_checkpoint(note, [vkey]), 20) * 1000
    return [
        (f"checkpoint of a {BIG_LINES:,}-line ledger (verify + tree, one pass) vs bare verify",
         statistics.median(made) / base, "<= 1.3", f"verify: {base:.1f} s"),
        (f"checkpoint as the command runs it ({os.cpu_count()} cpus: workers) vs the one pass",
         statistics.median(split) / statistics.median(made), "< 1 with 2+ cores", "lower is better"),
        ("verify --checkpoint (tree pass, then verify) vs bare verify", statistics.median(held) / base,
         "report", ""),
        ("the tree alone (one pass, SHA-256 a leaf) vs bare verify", statistics.median(tree) / base,
         "report", f"{BIG_LINES / statistics.median(tree) / 1e3:.0f}k leaves/s"),
        ("sign one checkpoint (pure-Python Ed25519), ms", sign_ms, "< 50 ms", ""),
        ("verify one signed checkpoint, ms", open_ms, "< 50 ms", ""),
    ]


if __name__ == "__main__":
    os.makedirs(ROOT / ".bench", exist_ok=True)
    for row in bench():
        print("  {:<62} {:6.2f}   (target {}){}".format(row[0], row[1], row[2], "  " + row[3] if row[3] else ""))
