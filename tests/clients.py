"""The real agent CLIs (Claude Code and Codex from npm), for the tests that drive them offline.

`.ci/run` installs the pinned versions below with npm and puts them on PATH. Elsewhere a test that
needs one skips with the reason; with CLIENTS_REQUIRED=1 (CI) a missing client is a failure.
"""

import os
import shutil
import subprocess

import pytest

PINNED = {"claude": "2.1.332", "codex": "0.171.0"}
# Where .ci/run installs them; looked at after PATH.
PREFIX = os.environ.get("CLIENTS_PREFIX", "/opt/reasoning-ledger-clients")


def client(name):
    """The path of the pinned CLI `name` ("claude" or "codex"), or skip (fail in CI) saying why."""
    found = shutil.which(name) or shutil.which(name, path=os.path.join(PREFIX, "node_modules/.bin"))
    reason = None
    if not shutil.which("node"):
        reason = "node is not installed"
    elif not found:
        reason = f"{name} is not installed (npm install {_package(name)})"
    else:
        shown = subprocess.run(
            [found, "--version"], capture_output=True, text=True, timeout=120
        ).stdout
        if PINNED[name] not in shown:
            reason = f"{name} is {shown.strip()!r}, the tests pin {PINNED[name]}"
    if reason is None:
        return found
    if os.environ.get("CLIENTS_REQUIRED") == "1":
        pytest.fail("CLIENTS_REQUIRED=1 but " + reason, pytrace=False)
    pytest.skip(reason)


def _package(name):
    return {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}[name] + "@" + PINNED[name]


def offline_env(home, **extra):
    """An environment for a real CLI that keeps it off the network and out of the user's home:
    HOME, the config dirs and TMPDIR under `home` (Codex refuses a CODEX_HOME under the temp dir
    unless TMPDIR points elsewhere), telemetry and updates off, no inherited keys."""
    home = str(home)
    tmp = os.path.join(home, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        "CLAUDE_CONFIG_DIR": os.path.join(home, ".claude"),
        "CODEX_HOME": os.path.join(home, ".codex"),
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",  # as root, --dangerously-skip-permissions needs it
        "NO_COLOR": "1",
    }
    env.update(extra)
    return env
