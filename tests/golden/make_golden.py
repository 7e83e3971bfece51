"""Writes the format-v1 golden ledgers with the vendoring API, `Ledger(path, run_id, key=..., clock=...)
.append(kind, payload)`. The committed files are the truth; tests/test_golden_format.py checks that this
script, run by today's writer, still gives the same bytes.

    python3 tests/golden/make_golden.py [DIR]    # default: beside this file
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import reasoning_ledger as rl  # noqa: E402

KEY = b"golden-hmac-key-0123456789"
RUN_A = "golden-run-a"
RUN_B = "20261129T120000.000000Z-0badf00d"
TORN_FRAGMENT = b'{"seq":4,"run_id":"golden-run-a","kind":"note","at":"2026-11-29T12:00:0'

PAYLOADS = [
    ("note", {}),
    ("note", {"text": "你好，世界 · ünïcödé · עברית · 🙂 · e\u0301", "tab\tnew\nline": "quote \" back \\ slash",
              "control": "\u0001\u001f\u007f\u2028\u2029", "html": "</script>&<b>", "键": "值"}),
    ("numbers", {"zero": 0, "neg": -1, "big": 2 ** 63, "huge": 10 ** 30, "half": 1.5, "tiny": 1e-07,
                 "large": 1e22, "negzero": -0.0, "pi": 3.141592653589793, "third": 1 / 3, "bools": [True, False]}),
    ("nulls.and_empties", {"none": None, "list": [], "obj": {}, "str": "", "mixed": [None, 0, "", [], {}]}),
    ("nested", {"a": {"b": {"c": {"d": {"e": {"f": [1, [2, [3, [4, {"g": "deep"}]]]]}}}}}, "tuple": (1, "two")}),
    ("model_call", {"request_model": "m", "api_key": "sk-golden0123456789abcdef", "password": None,
                    "token": True, "input_tokens": 12, "max_tokens": 64,
                    "headers": {"Authorization": "Bearer abcDEF0123456789ghij", "Accept": "application/json"},
                    "url": "https://user:hunter2hunter2@example.com/v1?access_token=tok123456789&page=2",
                    "log": "export GITHUB_TOKEN=ghp_0123456789abcdefABCDEF and AKIAABCDEFGHIJKLMNOP",
                    "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----",
                    "sk-inkey0123456789xyz": "a secret shape in a key"}),
]


def clock(start=0):
    """A fixed clock: 2026-11-29T12:00:SS.ffffffZ, one tick per call."""
    ticks = iter(range(start, 10 ** 6))

    def now():
        n = next(ticks)
        return "2026-11-29T12:%02d:%02d.%06dZ" % (n // 60, n % 60, n * 1111 % 1000000)
    return now


def write_ledger(path, key):
    tick = clock()
    with rl.Ledger(path, RUN_A, key=key, clock=tick) as ledger:
        for kind, payload in PAYLOADS:
            ledger.append(kind, payload)
    with rl.Ledger(path, RUN_B, key=key, clock=tick) as ledger:  # a second writer of the same file
        ledger.append("note", {"run": "b", "n": 1})


def write_torn(path):
    """Three lines, then a fragment without its newline: a writer that died mid-append."""
    with rl.Ledger(path, RUN_A, key=b"", clock=clock()) as ledger:
        for kind, payload in PAYLOADS[:3]:
            ledger.append(kind, payload)
    with open(path, "ab") as handle:
        handle.write(TORN_FRAGMENT)


def recover_torn(path):
    """The next append after a torn tail: the fragment goes to PATH.torn, a ledger_recovered line follows."""
    with rl.Ledger(path, RUN_A, key=b"", clock=clock(100)) as ledger:
        ledger.append("note", {"after": "recovery"})


def write_all(directory):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("unkeyed.jsonl", "keyed.jsonl", "torn.jsonl", "torn-recovered.jsonl", "torn-recovered.jsonl.torn"):
        if (directory / name).exists():
            os.unlink(str(directory / name))
    write_ledger(directory / "unkeyed.jsonl", b"")
    write_ledger(directory / "keyed.jsonl", KEY)
    write_torn(directory / "torn.jsonl")
    (directory / "torn-recovered.jsonl").write_bytes((directory / "torn.jsonl").read_bytes())
    recover_torn(directory / "torn-recovered.jsonl")


if __name__ == "__main__":
    write_all(sys.argv[1] if len(sys.argv) > 1 else HERE)
