"""Shared fixtures and helpers: the scripts run as a user runs them (real subprocesses, real files, real
sockets on 127.0.0.1); only the model is a stand-in (fake_openai.py, hostile_server.py)."""

import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
from html.parser import HTMLParser
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
            "CLICKHOUSE_USER", "CLICKHOUSE_PASSWORD", "LEDGER_SIGNING_KEY_FILE")
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


# ----------------------------------------------------------------------------
# Repositories and tools.json for agent runs
# ----------------------------------------------------------------------------

SAMPLE_CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
SAMPLE_TESTS = ("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_mul():\n    assert mul(2, 3) == 6\n")


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          env=dict(clean_env(), GIT_OPTIONAL_LOCKS="0"), timeout=120).stdout


def make_repo(root, calc=SAMPLE_CALC, tests=SAMPLE_TESTS, extra=None, commit=True):
    """A git repository with calc.py and test_calc.py (by default test_add fails), plus `extra` files."""
    root.mkdir(parents=True)
    git(root, "init", "-q")
    (root / "calc.py").write_text(calc)
    (root / "test_calc.py").write_text(tests)
    for name, text in (extra or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if commit:
        git(root, "add", "-A")
        git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return root


def tools_json(path, **changes):
    """The shipped tools.json with the test command (pytest) and plugins on this interpreter, plus `changes`
    (a dict updates the section of that name; anything else replaces the key)."""
    data = json.loads((ROOT / "tools.json").read_text())
    data["test_command"] = [sys.executable, "-m", "pytest", "-q"]
    for plugin in data["plugins"].values():
        plugin["argv"] = [sys.executable if a == "python3" else a for a in plugin["argv"]]
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=1))
    return path


def clock_for(day):
    """A ledger clock on `day`: one second later per line, from 12:00:00 (the audit reads lines in order)."""
    ticks = iter(range(10 ** 6))

    def clock():
        tick = next(ticks)
        return f"{day}T12:{tick // 60 % 60:02d}:{tick % 60:02d}.000000Z"
    return clock


# ----------------------------------------------------------------------------
# HTML pages read back as a browser would
# ----------------------------------------------------------------------------

HTML_VOID = {"meta", "br", "img", "link", "input", "hr", "area", "base", "col", "embed", "source", "track", "wbr"}


class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.data = tag, dict(attrs), parent, [], []

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()

    def find(self, tag=None, cls=None, **attrs):
        return [n for n in self.walk() if (tag is None or n.tag == tag)
                and (cls is None or cls in (n.attrs.get("class") or "").split())
                and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def text(self):
        return "".join("".join(n.data) for n in self.walk())

    def own_title(self):
        titles = [c for c in self.children if c.tag == "title"]
        return titles[0].text() if titles else None


class Tree(HTMLParser):
    """The page as nested nodes; fails on a closing tag that does not close the open element."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", [])
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.stack[-1])
        self.stack[-1].children.append(node)
        if tag not in HTML_VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Node(tag, attrs, self.stack[-1]))

    def handle_endtag(self, tag):
        assert len(self.stack) > 1 and self.stack[-1].tag == tag, (tag, [n.tag for n in self.stack[-5:]])
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].data.append(data)


def parse_html(text):
    """The root Node of a page; every element must be closed."""
    tree = Tree()
    tree.feed(text)
    tree.close()
    assert [n.tag for n in tree.stack] == ["#root"], "unclosed elements"
    return tree.root


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


def pytest_collection_modifyitems(config, items):
    """TEST_SHARD=i/n (set by tests/shards.py) keeps every n-th collected test, starting at the i-th."""
    shard = os.environ.get("TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % count != index])
    items[:] = [item for k, item in enumerate(items) if k % count == index]


def tls_certificate(tmp_path):
    """(a self-signed certificate for 127.0.0.1 and localhost, made by the openssl CLI, and a server
    SSLContext serving it); a client trusts it through SSL_CERT_FILE."""
    if shutil.which("openssl") is None:
        reason = "the openssl CLI is not installed"
        if os.environ.get("TLS_REQUIRED") == "1" or os.environ.get("CLIENTS_REQUIRED") == "1":
            pytest.fail("TLS_REQUIRED=1 (or CLIENTS_REQUIRED=1) but " + reason, pytrace=False)
        pytest.skip(reason)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return cert, server
