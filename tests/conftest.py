"""Shared fixtures and helpers: the scripts run as a user runs them (real subprocesses, real files, real
sockets on 127.0.0.1); only the model is a stand-in (fake_openai.py, hostile_server.py)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
for entry in (str(ROOT), str(TESTS)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

import fake_openai  # noqa: E402
import hostile_server  # noqa: E402

SETTINGS = ("API_KEY", "OPENAI_API_KEY", "WEBHOOK_SECRET", "WEBHOOK_SECRET_FILE", "LEDGER_KEY", "LEDGER_REDACT_ENV",
            "BASE_URL", "OPENAI_BASE_URL", "MODEL_ID", "LEDGER", "LEDGER_RUN_ID", "READ_TOKEN", "LEDGER_SHIP_URL",
            "CLICKHOUSE_USER", "CLICKHOUSE_PASSWORD")
KEY = "sk-test-0123456789abcdefXYZ"


def clean_env(**extra):
    """The environment a test's subprocess sees: no proxies, none of our settings unless given."""
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and k not in SETTINGS}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def run_script(script, *args, env=None, input=None, cwd=None, timeout=60, python=None):
    """Run one of the top-level scripts exactly as a user would: `python SCRIPT ARGS`."""
    cmd = [python or sys.executable, str(ROOT / script), *map(str, args)]
    if isinstance(input, str):
        input = input.encode("utf-8")
    proc = subprocess.run(cmd, input=input if input is not None else b"", capture_output=True,
                          env=env if env is not None else clean_env(), cwd=cwd, timeout=timeout)
    proc.out = proc.stdout.decode("utf-8", "replace")
    proc.err = proc.stderr.decode("utf-8", "replace")
    return proc


def lines_of(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def all_bytes_under(directory):
    """Every byte of every file under a directory, for grepping secrets."""
    blob = b""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            blob += path.read_bytes()
    return blob


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error: ")]


def chain(bodies, key=None):
    """Ledger bytes from line bodies (dicts, or JSON text with a {prev} placeholder), each line's prev
    the SHA-256 of the line before as stored: a ledger whose chain holds, whatever else is wrong."""
    import hmac
    prev = hmac.new(key, b"", hashlib.sha256).hexdigest() if key else "0" * 64
    out = b""
    for body in bodies:
        if isinstance(body, dict):
            body = dict(body, prev=prev)
            raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        else:
            raw = body.replace("{prev}", prev).encode("utf-8") if isinstance(body, str) else body.replace(
                b"{prev}", prev.encode())
        out += raw + b"\n"
        prev = hmac.new(key, raw, hashlib.sha256).hexdigest() if key else hashlib.sha256(raw).hexdigest()
    return out


def event(seq, payload=None, run_id="r1", kind="note", at="2026-11-29T12:00:00.000000Z"):
    """One envelope in the writer's field order (prev is filled in by chain())."""
    return {"seq": seq, "run_id": run_id, "kind": kind, "at": at, "payload": payload or {}, "prev": None}


@pytest.fixture
def env():
    return clean_env()


@pytest.fixture
def server():
    """The scripted, well-formed fake OpenAI-compatible endpoint."""
    srv = fake_openai.start()
    yield srv
    srv.stop()


@pytest.fixture
def hostile():
    """The raw-socket endpoint that does what no well-behaved server would."""
    srv = hostile_server.HostileServer().start()
    yield srv
    srv.stop()


def pytest_configure(config):
    config.addinivalue_line("markers", "real: talks to a real endpoint (REAL_BASE_URL, REAL_MODEL_ID)")
