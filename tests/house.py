#!/usr/bin/env python3
"""house.py -- each room's code tokens and lines against its budgets (`make house`). It asserts
nothing: tests/test_house.py holds the structure, and a closing note reports these figures.

Code tokens are Python's tokenize NAME, OP, NUMBER and STRING tokens: comments are free and a
docstring is one token. The columns: the budget after issue 23 (one concern per room), and at the
end of stage 4.
"""

import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# room: (its one concern, tokens after issue 23, tokens at the end of stage 4)
ROOMS = {
    "reasoning_ledger.py": ("format v1, verify, runs, redaction, its CLI", 9000, 15000),
    "ask.py": ("one call over HTTP, and the HTTP kit", 11000, 11000),
    "proxy.py": ("the recording proxy", 5000, 12000),
    "audit.py": ("reports", 11000, 15000),
    "agent.py": ("the host loop, tools.json, box, judge, replay", 22000, 23000),
    "daemon.py": ("webhooks start agent runs", 8500, 9000),
    "fleet.py": ("ClickHouse: ship, verify", 4500, 7000),
    "transcripts.py": ("Claude Code and Codex transcripts", None, 8000),
}
TOTAL = (68000, 100000)
CODE = (tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING)


def measure(path):
    """(code tokens, lines, widest line) of a Python file."""
    source = path.read_text(encoding="utf-8")
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    lines = source.splitlines()
    return sum(t.type in CODE for t in tokens), len(lines), max(map(len, lines), default=0)


def main():
    print(f"{'room':21} {'tokens':>7} {'issue23':>8} {'stage4':>7} {'lines':>6} {'widest':>6}")
    sums = [0, 0]
    for name, (_concern, now, end) in ROOMS.items():
        path = ROOT / name
        if not path.exists():
            print(f"{name:21} {'-':>7} {now or '-':>8} {end:>7}")
            continue
        tokens, lines, widest = measure(path)
        sums[0], sums[1] = sums[0] + tokens, sums[1] + lines
        over = " over" if now and tokens > now else ""
        print(f"{name:21} {tokens:>7} {now or '-':>8} {end:>7} {lines:>6} {widest:>6}{over}")
    print(f"{'together':21} {sums[0]:>7} {TOTAL[0]:>8} {TOTAL[1]:>7} {sums[1]:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
