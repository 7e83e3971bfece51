"""Shared helpers: run the scripts as a user does (real subprocesses, real files)."""

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

SECRET_VARS = ("API_KEY", "OPENAI_API_KEY", "WEBHOOK_SECRET", "LEDGER_KEY", "LEDGER_REDACT_ENV",
               "BASE_URL", "OPENAI_BASE_URL", "MODEL_ID", "LEDGER", "LEDGER_RUN_ID")


def clean_env(**extra):
    """The environment a test's subprocess sees: no proxies, none of our settings unless given."""
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and k not in SECRET_VARS}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def run_script(script, *args, env=None, input=None, cwd=None, timeout=60):
    """Run one of the top-level scripts exactly as a user would: `python SCRIPT ARGS`."""
    cmd = [sys.executable, str(ROOT / script), *map(str, args)]
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


@pytest.fixture
def env():
    return clean_env()


def pytest_configure(config):
    config.addinivalue_line("markers", "real: talks to a real endpoint (REAL_BASE_URL, REAL_MODEL_ID)")
