#!/usr/bin/env python3
"""reasoning_ledger.py -- an append-only, hash-chained JSONL ledger. Standard library only.

Usage:
  python reasoning_ledger.py verify PATH... [--all RUNS_DIR] [--expect-head SEQ:HASH] [--key-env NAME]
  python reasoning_ledger.py head PATH [--key-env NAME]
  python reasoning_ledger.py report PATH... [--all RUNS_DIR] [--kind K] [--stage S] [--run R] [--since T] [--until T] [--json]
  python reasoning_ledger.py append PATH --kind K [--run-id R] [--payload JSON | < payload.json]
  python reasoning_ledger.py ship PATH... [--all RUNS_DIR] --to URL     # or LEDGER_SHIP_URL; for cron
  python reasoning_ledger.py verify --from URL [--ledger-id ID] [--expect-head SEQ:HASH]

Library (copy this one file next to your code):
  from reasoning_ledger import Ledger, open_run, read_events, verify
  with Ledger("calls.jsonl", run_id="nightly") as ledger:
      ledger.decide("plan", "run tests first", "cheapest signal", ["read code"])
      ledger.append("note", {"text": "hello"})

Exit codes are shared by every script of the toolkit: see EXIT_CODES.
"""

import argparse
import contextlib
import datetime
import errno
import fcntl
import functools
import hashlib
import hmac
import json
import os
import re
import socket
import socketserver
import sys
import threading
import time
import weakref
from pathlib import Path

__version__ = "1.1.0"

# What a vendoring script needs; the toolkit's own scripts also use the CLI kit below (error,
# write_out, ...).
__all__ = [
    "Ledger",
    "Run",
    "open_run",
    "store_artifact",
    "read_events",
    "iter_lines",
    "verified_events",
    "verify",
    "verify_runs",
    "run_ledgers",
    "Verified",
    "parse_head",
    "new_run_id",
    "utc_now",
    "Redactor",
    "redact_text",
    "secret_values",
    "LedgerError",
    "UsageError",
    "PayloadError",
    "KeyRequiredError",
    "IntegrityError",
    "TornTailError",
    "OutputError",
    "EXIT_CODES",
    "KEY_ENV",
    "INDEX_NAME",
    "EVENTS_NAME",
    "main"
]

# ----------------------------------------------------------------------------
# Constants and errors
# ----------------------------------------------------------------------------

FIELDS = ("seq", "run_id", "kind", "at", "payload", "prev")
GENESIS = "0" * 64
MAX_LINE_BYTES = 1024 * 1024  # a line, newline included, is at most this long: the format's limit
MAX_DEPTH = 64  # nesting levels of a payload; the payload object itself is level 1
KEY_ENV = "LEDGER_KEY"
REDACTED = "[REDACTED]"
SECRET_ENV_VARS = ("API_KEY", "OPENAI_API_KEY", "WEBHOOK_SECRET", "LEDGER_KEY")
REDACT_ENV_LIST = "LEDGER_REDACT_ENV"
MIN_SECRET_CHARS = 8  # shorter env values ("none", "test") are too common to mask by value
INDEX_NAME = "index.jsonl"
EVENTS_NAME = "events.jsonl"

# One exit-code table for every script of the toolkit.
(
    EXIT_OK,
    EXIT_FAILED,
    EXIT_USAGE,
    EXIT_CHECK,
    EXIT_CHANGED,
    EXIT_OUTPUT,
    EXIT_LOCKED,
    EXIT_BUDGET,
    EXIT_PROPOSAL,
    EXIT_STUCK
) = range(10)
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_FAILED: "failed: integrity failure (verify, audit, ship), failed call (ask), error outcome (agent)",
    EXIT_USAGE: "usage, configuration or I/O error; nothing was done",
    EXIT_CHECK: "answer received but a check failed (ask); proposal rejected by the judge (agent)",
    EXIT_CHANGED: "changes found: audit --fail-on-change; decisions another tools.json flips (agent replay)",
    EXIT_OUTPUT: "stdout could not be written; the result was recorded",
    EXIT_LOCKED: "another run holds the repository's lock (agent)",
    EXIT_BUDGET: "budget exhausted (agent)",
    EXIT_PROPOSAL: "proposal accepted by the judge, waiting for review (agent)",
    EXIT_STUCK: "the model repeated itself until the run stopped it (agent)"
}

_KIND_RE = re.compile(r"[a-z][a-z0-9_.]*\Z")
_AT_RE = re.compile(
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
    r"\.[0-9]{6}Z\Z"
)
_OUR_RUN_ID_RE = re.compile(r"[0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[0-9a-f]{8}\Z")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
_SEQ_PREFIX_RE = re.compile(rb'\{"seq":([1-9][0-9]*),')
_PREV_SUFFIX_RE = re.compile(rb',"prev":"([0-9a-f]{64})"\}\Z')
# Python 3.11+ refuses to print longer ints; a line must read back everywhere
_INT_LIMIT = 10**4300


class LedgerError(Exception):
    """Base of every error the toolkit raises on purpose. `exit_code` is what a script exits with."""

    exit_code = EXIT_USAGE


class UsageError(LedgerError):
    """Bad arguments or settings: nothing was done."""


class PayloadError(UsageError, ValueError):
    """The event cannot be written (not JSON, too long, too deep, bad kind). Nothing was written."""


class KeyRequiredError(UsageError):
    """The ledger is keyed (HMAC) and no key was given."""

    def __init__(self, path):
        self.path = str(path)
        super().__init__(
            f"{path}: ledger is keyed (line 1's prev is not all zeros); "
            f"a key is needed: set {KEY_ENV} or pass --key-env NAME"
        )


class IntegrityError(LedgerError):
    """The file is not a valid ledger: names the file, the line and the reason."""

    exit_code = EXIT_FAILED

    def __init__(self, path, line, reason):
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path}: line {line}: {reason}" if line else f"{path}: {reason}")


class TornTailError(IntegrityError):
    """The last line has no newline: a writer died mid-append. All lines before it are valid."""

    def __init__(self, path, line, offset, length, head):
        self.offset, self.length, self.head = offset, length, head
        super().__init__(
            path,
            line,
            f"torn tail: {length} bytes at offset {offset} without a newline (a writer "
            f"died mid-append; the next append moves them to {Path(path).name}.torn)"
        )


class OutputError(LedgerError):
    """stdout could not be written (closed, full, or unable to encode the text). `pipe`: its reader
    left."""

    exit_code = EXIT_OUTPUT

    def __init__(self, message, pipe=False):
        super().__init__(message)
        self.pipe = pipe


# ----------------------------------------------------------------------------
# Helpers: time, ids, hashing
# ----------------------------------------------------------------------------


def utc_now():
    """Current UTC time as the ledger writes it: 2026-11-29T12:00:00.123456Z."""
    micros = time.time_ns() // 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(micros // 1000000)) + ".%06dZ" % (
        micros % 1000000
    )


def new_run_id():
    """A run id that sorts by creation time and carries a random suffix:
    20261129T120000.123456Z-1a2b3c4d."""
    return utc_now().replace("-", "").replace(":", "") + "-" + os.urandom(4).hex()


@functools.lru_cache(maxsize=4096)  # a ledger's lines share a few days
def _day_exists(day):
    try:
        datetime.date(int(day[:4]), int(day[5:7]), int(day[8:10]))
    except ValueError:
        return False
    return True


def _at_ok(at):
    """`at` as the writer writes it: the exact shape, ASCII digits, and a date that exists."""
    return type(at) is str and _AT_RE.match(at) is not None and _day_exists(at[:10])


def _key_bytes(key):
    if not key:
        return None
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def _resolve_key(key):
    """key=None reads LEDGER_KEY; b"" or "" means explicitly unkeyed."""
    return _key_bytes(os.environ.get(KEY_ENV) if key is None else key)


def line_hash(raw, key=None):
    """SHA-256 (or HMAC-SHA256 with `key`) of one stored line, without its newline."""
    return (hmac.new(key, raw, hashlib.sha256) if key else hashlib.sha256(raw)).hexdigest()


def _genesis(key):
    return line_hash(b"", key) if key else GENESIS


def parse_head(text):
    """'SEQ HASH' or 'SEQ:HASH' -> (seq, hash)."""
    match = re.fullmatch(r"([0-9]+)[:\s]+([0-9a-fA-F]{64})", text.strip())
    if not match:
        raise UsageError(f"not a ledger head (want SEQ:HASH): {printable(text)!r}")
    return int(match.group(1)), match.group(2).lower()


# ----------------------------------------------------------------------------
# Redaction
# ----------------------------------------------------------------------------

# A key name is split into segments on "_", "-", "." and camelCase; it names a secret when its last
# segment is one of these words, or its last two one of these pairs (input_tokens, max_tokens,
# token_count stay).
_SECRET_WORDS = frozenset(
    (
        "token",
        "secret",
        "password",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "apikey",
        "session",
        "cookie",
        "authorization"
    )
)
_SECRET_PAIRS = frozenset(
    (
        ("api", "key"),
        ("private", "key"),
        ("access", "key"),
        ("secret", "key"),
        ("signing", "key"),
        ("encryption", "key"),
        ("master", "key"),
        ("client", "key")
    )
)
# Query and fragment parameters that carry a secret although their names end in another word.
_SECRET_PARAMS = frozenset(
    (
        "key",
        "code",
        "sig",
        "signature",
        "auth",
        "pwd",
        "pass",
        "x_amz_signature",
        "x_goog_signature"
    )
)
_SEGMENT_RE = re.compile(r"[_\-.]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def _segments(name):
    return [s.lower() for s in _SEGMENT_RE.split(name) if s]


# payloads repeat their key names; the split is a third of the masking
@functools.lru_cache(maxsize=4096)
def is_secret_key(name):
    """True when a key name (a payload key, an env var, a query parameter) names a secret."""
    segments = _segments(name)
    return bool(segments) and (
        segments[-1] in _SECRET_WORDS or tuple(segments[-2:]) in _SECRET_PAIRS
    )


def _mask_scheme(m):
    # a credential, not prose ("a bearer token"): 20+ characters, or 8+ with a digit, token
    # punctuation or a capital after the first letter
    word = m.group(3).rstrip(".")
    credential = (
        len(word) >= 20
        or len(word) >= 8
        and (any(c.isdigit() or c in "_~+/=" for c in word) or any(c.isupper() for c in word[1:]))
    )
    return m.group(1) + m.group(2) + REDACTED if credential else m.group(0)


def _mask_userinfo(m):
    # a URL's user part with a password, or one that is a token (16+ characters, letters and digits)
    user = m.group(2)
    token = len(user) >= 16 and any(c.isdigit() for c in user) and any(c.isalpha() for c in user)
    return m.group(1) + REDACTED + "@" if ":" in user or token else m.group(0)


def _mask_param(m):
    name = m.group(2)
    secret = is_secret_key(name) or name.lower().replace("-", "_") in _SECRET_PARAMS
    return m.group(1) + name + "=" + REDACTED if secret and m.group(3) != REDACTED else m.group(0)


def _mask_assignment(m):
    double, single, bare = m.group(3, 4, 5)
    value = next(v for v in (double, single, bare) if v is not None)
    if (
        not is_secret_key(m.group(1))
        or value in ("", REDACTED)
        or value.lower() in ("bearer", "basic")
    ):
        return m.group(0)
    quote = '"' if double is not None else "'" if single is not None else ""
    return m.group(1) + m.group(2) + quote + REDACTED + quote


# Secret shapes masked inside any string, run in this order: a later shape leaves an earlier one's
# mask alone.
_SHAPES = (
    (
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
        re.S,
        REDACTED
    ),
    (
        r"\b((?:set-)?cookie|(?:proxy-)?authorization)([ \t]*:[ \t]*)(?!\[REDACTED\])\S[^\r\n]*",
        re.I,
        r"\1\2" + REDACTED
    ),
    (r"\b(bearer|basic)(\s+)([A-Za-z0-9._~+/=-]+)", re.I, _mask_scheme),
    (r"\bsk-[A-Za-z0-9_-]{8,}", 0, REDACTED),
    (r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})", 0, REDACTED),
    (r"\bxox[abposr]-[A-Za-z0-9-]{8,}", 0, REDACTED),
    (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0, REDACTED),
    (r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,31}://)([^\s/?#\"'<>]+)@", 0, _mask_userinfo),
    (r"([?&;#])([A-Za-z0-9_.\[\]-]{1,64})=([^&#\s\"'<>]+)", 0, _mask_param),
    (
        r"\b([A-Za-z][A-Za-z0-9_.-]{0,63})([\"']?[ \t]*[:=][ \t]*)(?:\"([^\"\r\n]*)\"|'([^'\r\n]*)'|([^\s\"',;&]+))",
        0,
        _mask_assignment
    )
)
# What every shape needs to match at all (tests/test_redaction.py holds this to the shapes): a
# string with none of these skips the shapes, at a tenth of their cost (tests/BENCH.md).
_SCHEME_WORD = re.compile(r"b(?:earer|asic)\s", re.I)


def _may_match(text):
    return (
        ":" in text
        or "=" in text
        or "@" in text
        or "-----BEGIN" in text
        or "sk-" in text
        or "gh" in text
        or "github_pat_" in text
        or "xox" in text
        or "AKIA" in text
        or "ASIA" in text
        or _SCHEME_WORD.search(text) is not None
    )


@functools.lru_cache(maxsize=1)
def _compiled_shapes():  # on first use: verify never needs them
    return tuple((re.compile(src, flags), repl) for src, flags, repl in _SHAPES)


class Redactor:
    """Masks known secret values and secret shapes (tokens, credentials in URLs, key=value
    assignments)."""

    def __init__(self, values=()):
        self.values = tuple(
            sorted(
                {v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_CHARS},
                # longest first: a secret holding another goes whole
                key=len,
                reverse=True
            )
        )

    def text(self, text):
        for value in self.values:
            if value in text:
                text = text.replace(value, REDACTED)
        if _may_match(text):
            for pattern, repl in _compiled_shapes():
                text = pattern.sub(repl, text)
        return text


# Credential variables of common tools that the rule of is_secret_env_name misses (docs/secrets.md).
SECRET_ENV_NAMES = (
    "SSHPASS",
    "DATABASE_URL",
    "*_DATABASE_URL",
    "REDIS_URL",
    "MONGODB_URI",
    "MONGO_URL",
    "AMQP_URL",
    "CELERY_BROKER_URL",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "UV_INDEX_URL",
    "UV_EXTRA_INDEX_URL",
    "POETRY_PYPI_TOKEN_*",
    "BUNDLE_*__*",
    "COMPOSER_AUTH",
    "DOCKER_AUTH_CONFIG",
    "AZURE_STORAGE_CONNECTION_STRING",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON",
    "GOOGLE_CREDENTIALS"
)


def is_secret_env_name(name):
    """An environment variable's name that names a secret, by the five rules of docs/secrets.md."""
    import fnmatch

    segments = _segments(name)
    last = segments[-1] if segments else ""
    return (
        is_secret_key(name)
        or last in ("key", "dsn")
        or "webhook" in segments
        or last.endswith(("password", "passwd", "passphrase", "token", "secret"))
        or (len(segments) > 1 and last in ("pwd", "pass", "pw", "auth"))
        or any(fnmatch.fnmatchcase(name.upper(), pattern) for pattern in SECRET_ENV_NAMES)
    )


def secret_values(extra=()):
    """The values to mask: of our env vars, of every env var with a secret's name or listed in
    LEDGER_REDACT_ENV."""
    listed = {n.strip() for n in os.environ.get(REDACT_ENV_LIST, "").split(",") if n.strip()}
    values = {
        value
        for name, value in os.environ.items()
        if name in SECRET_ENV_VARS or name in listed or is_secret_env_name(name)
    }
    values.update(v for v in extra if v)
    return sorted((v for v in values if len(v) >= MIN_SECRET_CHARS), key=len, reverse=True)


def redact_text(text, values=None):
    """Mask secret shapes and known secret values inside one string."""
    return Redactor(secret_values() if values is None else values).text(text)


class _BadValue(Exception):  # not JSON the writer writes; `where` is filled in on the way out
    def __init__(self, reason):
        super().__init__(reason)
        self.reason, self.where = reason, []


def _clean(value, redactor, depth=1):
    # a masked copy, checked on the way: exact JSON types only (a Counter or an int key is refused),
    # MAX_DEPTH
    kind = type(value)
    if kind is str:
        return redactor.text(value)
    if kind is int and not -_INT_LIMIT < value < _INT_LIMIT:
        raise _BadValue("an integer longer than 4300 digits cannot be read back on Python 3.11+")
    if kind is float and (value != value or value in (float("inf"), float("-inf"))):
        raise _BadValue(f"{value!r} is not valid JSON (NaN/Infinity)")
    if value is None or kind is bool or kind is int or kind is float:
        return value
    if kind is not dict and kind is not list and kind is not tuple:
        raise _BadValue(f"a {kind.__name__} is not a JSON type")
    if depth > MAX_DEPTH:
        raise _BadValue(f"nested deeper than {MAX_DEPTH} levels (or circular)")
    out = {} if kind is dict else []
    for k, v in (value.items() if kind is dict else enumerate(value)):
        try:
            masked = _clean(v, redactor, depth + 1)
            if kind is not dict:
                out.append(masked)
                continue
            if type(k) is not str:
                raise _BadValue(f"key {k!r} is a {type(k).__name__}; JSON keys must be strings")
            name = redactor.text(k)
            while name in out:  # two keys that mask to the same text both stay
                name += "~"
            out[name] = (
                REDACTED if v is not None and type(v) is not bool and is_secret_key(k) else masked
            )
        except _BadValue as exc:
            exc.where.append(f".{k}" if kind is dict and type(k) is str else f"[{k!r}]")
            raise
    return out


def _clean_payload(payload, redactor):
    try:
        clean = _clean(payload, redactor)
        text = _dumps(clean)
        text.encode("utf-8")
    except _BadValue as exc:
        raise PayloadError(
            f"payload{''.join(exc.where[::-1])}: {exc.reason}; nothing was written"
        ) from None
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"payload holds a lone surrogate ({exc.object[exc.start:exc.end]!a}), which is not "
            f"UTF-8; nothing was written"
        ) from None
    return clean, text


def payload_problem(payload, limit=MAX_LINE_BYTES // 2):
    """Why `payload` could not be written (not plain JSON, too deep, over `limit` bytes of JSON), or
    None."""
    try:
        _stored, text = _clean_payload(payload, Redactor())
    except PayloadError as exc:
        return str(exc).replace("; nothing was written", "")
    return (
        f"payload is larger than {limit} bytes of JSON"
        if len(text.encode("utf-8")) > limit
        else None
    )


_SCANNER = json.JSONDecoder().scan_once
_dumps = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, check_circular=False
).encode


# ----------------------------------------------------------------------------
# Writing: low-level file helpers, Ledger, store_artifact, runs
# ----------------------------------------------------------------------------


def _named(exc, path):
    if isinstance(exc, OSError) and not exc.filename:
        return OSError(exc.errno, exc.strerror or str(exc), str(path))
    return exc


def _fsync_dir(path):
    fd = os.open(str(Path(path).parent) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rfind_newline(fd, stop):
    """Offset of the last newline before `stop`; -1: none before the file's start; None: none in a
    line's length."""
    pos, step = stop, 4096
    while pos > 0 and stop - pos < MAX_LINE_BYTES:
        start = max(0, pos - step, stop - MAX_LINE_BYTES)
        i = os.pread(fd, pos - start, start).rfind(b"\n")
        if i != -1:
            return start + i
        pos, step = start, step * 4
    return -1 if pos == 0 else None


def _scan_tail(fd, size, path):
    """(offset past the last newline, the last complete line: b"" if none, None if too long), read from
    the end."""
    last_nl = _rfind_newline(fd, size)
    if last_nl is None:
        raise IntegrityError(
            path,
            None,
            f"the file ends in more than {MAX_LINE_BYTES} bytes without a newline; "
            f"refusing to append"
        )
    if last_nl == -1:
        return 0, b""
    prev_nl = _rfind_newline(fd, last_nl)
    return last_nl + 1, (
        None if prev_nl is None else os.pread(fd, last_nl - prev_nl - 1, prev_nl + 1)
    )


def _write_or_undo(fd, data, size, fsync=True):
    """Write `data` to the end of a file `size` bytes long, and fsync; on failure cut it back to
    `size`."""
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            view = view[n:]
        if fsync:
            os.fsync(fd)
    except OSError:
        os.ftruncate(fd, size)
        raise


_LIVE_LEDGERS = weakref.WeakSet()


def _after_fork_in_child():
    # A fork copies the fd (one open file description: its flock would be shared with the parent)
    # and the thread lock (maybe held by a thread that does not exist here). Start both afresh.
    for ledger in list(_LIVE_LEDGERS):
        ledger._lock = threading.Lock()
        if ledger._fd is not None:
            with contextlib.suppress(OSError):
                os.close(ledger._fd)
            ledger._fd = None


os.register_at_fork(after_in_child=_after_fork_in_child)


class Ledger:
    """An append-only ledger file, safe to share between threads, processes (forked or not) and
    objects: every append holds a thread lock and an exclusive flock, and derives seq and prev from
    the file itself."""

    def __init__(
        self,
        path,
        run_id=None,
        *,
        key=None,
        fsync=True,
        max_line_bytes=MAX_LINE_BYTES,
        secrets=(),
        clock=utc_now
    ):
        self.path = Path(path)
        own = _expected_run_id(self.path)  # runs/<run id>/events.jsonl holds that run's lines only
        if own and run_id and run_id != own:
            raise UsageError(
                f"{self.path} holds run {own}'s events only; not {printable(run_id)!r}"
            )
        self.run_id = run_id or own or new_run_id()
        if type(self.run_id) is not str or not _RUN_ID_RE.match(self.run_id):
            raise UsageError(
                f"bad run id {printable(self.run_id)!r}: letters, digits and _.:- only, at most 128"
            )
        if not 0 < max_line_bytes <= MAX_LINE_BYTES:
            raise UsageError(f"max_line_bytes must be 1 to {MAX_LINE_BYTES}")
        self.key, self.fsync, self.max_line_bytes = _resolve_key(key), fsync, max_line_bytes
        self.clock = clock  # returns `at`; replaceable for importing history and for tests
        self.extra_secrets = tuple(s for s in secrets if s)
        self.redactor = Redactor(secret_values(self.extra_secrets))  # env read once, not per append
        self.head = None  # (seq, hash) of the last line this object wrote
        self._fd, self._mode_checked, self._lock = None, False, threading.Lock()
        _LIVE_LEDGERS.add(self)

    def add_secret(self, value):
        """Mask this exact value too (an API key passed as an argument rather than in the env)."""
        if value and value not in self.extra_secrets:
            self.extra_secrets += (value,)
            self.redactor = Redactor(self.redactor.values + (value,))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _locked(self, work):
        """work(fd) under the thread lock and the file's exclusive flock; I/O errors name the file."""
        with self._lock:
            try:
                if self._fd is None:
                    created = not self.path.exists()
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._fd = os.open(
                        str(self.path), os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
                    )
                    if created and self.fsync:
                        _fsync_dir(self.path)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    if not self._mode_checked:
                        self._check_mode(self._fd)
                    return work(self._fd)
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            except OSError as exc:
                raise _named(exc, self.path) from None

    def _check_mode(self, fd):
        """Refuse to mix keyed and unkeyed lines in one file (checked once per object)."""
        first = os.pread(fd, 4096, 0)
        if b"\n" not in first:
            first = os.pread(fd, MAX_LINE_BYTES, 0)
        first, newline, _rest = first.partition(b"\n")
        if not newline:  # empty (or one torn fragment): the line about to be written sets the mode
            return
        match = _PREV_SUFFIX_RE.search(first)
        if not match or not _SEQ_PREFIX_RE.match(first):
            raise IntegrityError(self.path, 1, "not a ledger line; refusing to append")
        prev = match.group(1).decode()
        if prev != _genesis(self.key):
            if not self.key:
                raise KeyRequiredError(self.path)
            if prev == GENESIS:
                raise UsageError(
                    f"{self.path}: ledger is not keyed but a key was given; refusing to mix keyed "
                    f"and unkeyed lines"
                )
            raise IntegrityError(
                self.path, 1, "prev is not this key's genesis (wrong key?); refusing to append"
            )
        self._mode_checked = True

    def check(self):
        """The file's head (seq, hash) if the next append can succeed (a torn tail it recovers); writes
        nothing."""

        def tail(fd):
            seq, prev = self._next(*_scan_tail(fd, os.fstat(fd).st_size, self.path))
            return seq - 1, prev

        return self._locked(tail)

    def append(self, kind, payload=None):
        """Append one event; return it as written (payload masked). PayloadError: nothing was written."""
        if type(kind) is not str or not _KIND_RE.match(kind):
            raise PayloadError(f"bad kind {printable(kind)!r}: lower-case [a-z][a-z0-9_.]*")
        payload = {} if payload is None else payload
        if type(payload) is not dict:
            raise PayloadError(
                f"payload must be a JSON object (a dict), not a {type(payload).__name__}; "
                f"nothing was written"
            )
        clean, payload_json = _clean_payload(payload, self.redactor)

        def write(fd):
            size = os.fstat(fd).st_size
            end, last = _scan_tail(fd, size, self.path)
            if end != size:
                end, last = self._recover_torn_tail(fd, size, end, last)
            return self._write_event(fd, end, last, kind, clean, payload_json)

        return self._locked(write)

    def _next(self, end, last):
        """(seq, prev) for the line after `last`, the file's last complete line."""
        if not last and not end:
            return 1, _genesis(self.key)
        # seq leads every line: no need to parse a 1 MiB line
        match = last and _SEQ_PREFIX_RE.match(last)
        if not match:
            what = (
                "longer than a line can be"
                if last is None
                else (
                    "blank"
                    if not last
                    else "white space only" if not last.strip() else "not a ledger line"
                )
            )
            raise IntegrityError(
                self.path, None, f"the last line is {what}; refusing to append (run verify)"
            )
        return int(match.group(1)) + 1, line_hash(last, self.key)

    def _write_event(self, fd, size, last, kind, clean, payload_json):
        seq, prev = self._next(size, last)
        at = self.clock()
        if self.clock is not utc_now and not _at_ok(at):
            raise UsageError(
                f"clock returned {printable(at)!r}, not a real YYYY-MM-DDTHH:MM:SS.ffffffZ time"
            )
        # run_id, kind, at and prev are validated plain ASCII: this is exactly what json.dumps would
        # write
        raw = (
            '{"seq":%d,"run_id":"%s","kind":"%s","at":"%s","payload":%s,"prev":"%s"}'
            % (seq, self.run_id, kind, at, payload_json, prev)
        ).encode("utf-8")
        if len(raw) + 1 > self.max_line_bytes:
            raise PayloadError(
                f"event is {len(raw) + 1} bytes, over the {self.max_line_bytes}-byte line limit"
            )
        _write_or_undo(fd, raw + b"\n", size, self.fsync)
        self.head = (seq, line_hash(raw, self.key))
        return {
            "seq": seq,
            "run_id": self.run_id,
            "kind": kind,
            "at": at,
            "payload": clean,
            "prev": prev
        }

    def _recover_torn_tail(self, fd, size, end, last):
        fragment = os.pread(fd, size - end, end)
        digest = hashlib.sha256(fragment).hexdigest()
        sidecar = Path(str(self.path) + ".torn")
        header = (
            f"torn offset={end} length={len(fragment)} sha256={digest} at={utc_now()}\n".encode()
        )
        try:
            sfd = os.open(
                str(sidecar), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
            try:
                _write_or_undo(sfd, header + fragment + b"\n", os.fstat(sfd).st_size)
            finally:
                os.close(sfd)
        except OSError as exc:
            raise _named(exc, sidecar) from None
        os.ftruncate(fd, end)
        if self.fsync:
            os.fsync(fd)
        recovered = {
            "offset": end,
            "length": len(fragment),
            "sha256": digest,
            "sidecar": sidecar.name
        }
        self._write_event(fd, end, last, "ledger_recovered", recovered, _dumps(recovered))
        return _scan_tail(fd, os.fstat(fd).st_size, self.path)

    def decide(self, stage, decision, rationale, alternatives=(), **extra):
        """Record a decision before acting on it: what, why, and what else was possible."""
        return self.append(
            "decision",
            {
                "stage": stage,
                "decision": decision,
                "rationale": rationale,
                "alternatives": list(alternatives),
                **extra
            }
        )

    def store_artifact(self, data, *, redact_secrets=True):
        """store_artifact() under artifacts/ beside the ledger."""
        return store_artifact(
            self.path.parent / "artifacts",
            data,
            redact_secrets=redact_secrets,
            redactor=self.redactor
        )


def store_artifact(directory, data, *, redact_secrets=True, extra_secrets=(), redactor=None):
    """Store bytes or text (masked first) as directory/<sha256>; return {"sha256", "size", "path"}."""
    if isinstance(data, str):
        data = data.encode("utf-8", "backslashreplace")  # a lone surrogate stays visible as \\udXXX
    if redact_secrets:
        with contextlib.suppress(UnicodeDecodeError):  # not UTF-8 text: stored as it is
            data = (
                (redactor or Redactor(secret_values(extra_secrets)))
                .text(data.decode("utf-8"))
                .encode("utf-8")
            )
    directory = Path(directory)
    digest = hashlib.sha256(data).hexdigest()
    target = directory / digest
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not target.exists():
            # one per writer, even in one process
            tmp = directory / f".{digest[:16]}.{os.urandom(8).hex()}.tmp"
            fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_or_undo(fd, data, 0)
            except OSError:
                os.unlink(str(tmp))
                raise
            finally:
                os.close(fd)
            os.replace(str(tmp), str(target))
            _fsync_dir(target)
    except OSError as exc:
        raise _named(exc, target) from None
    return {"sha256": digest, "size": len(data), "path": f"{directory.name}/{digest}"}


class Run:
    """One run directory runs/<run_id>/ holding events.jsonl and artifacts/."""

    def __init__(self, runs_dir, run_id, ledger):
        self.runs_dir, self.run_id, self.ledger = Path(runs_dir), run_id, ledger
        self.dir = self.runs_dir / run_id
        self.closed = False
        self.append, self.decide, self.store_artifact = (
            ledger.append,
            ledger.decide,
            ledger.store_artifact
        )

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.closed:
            self.close(
                "error" if exc_type else "closed",
                error=f"{exc_type.__name__}: {exc}" if exc_type else None
            )

    def close(self, outcome, **summary):
        """Append run_closed, then anchor this run's head in runs/index.jsonl."""
        self.ledger.append(
            "run_closed",
            {"outcome": outcome, **{k: v for k, v in summary.items() if v is not None}}
        )
        seq, digest = self.ledger.head
        with Ledger(
            self.runs_dir / INDEX_NAME,
            self.run_id,
            key=self.ledger.key or b"",
            fsync=self.ledger.fsync,
            secrets=self.ledger.extra_secrets
        ) as index:
            index.append(
                "run_closed",
                {
                    "run": self.run_id,
                    "events": f"{self.run_id}/{EVENTS_NAME}",
                    "head_seq": seq,
                    "head_hash": digest,
                    "outcome": outcome
                }
            )
        self.ledger.close()
        self.closed = True
        return seq, digest


def open_run(runs_dir="runs", *, run_id=None, key=None, fsync=True, secrets=()):
    """Create runs_dir/<run id>/ (never reused, a given run_id too) and return a Run writing to its
    events.jsonl."""
    runs_dir, given = Path(runs_dir), run_id
    runs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if given is not None and (type(given) is not str or not _RUN_ID_RE.match(given)):
        raise UsageError(f"bad run id {printable(given)!r}")
    while True:
        run_id = given or new_run_id()
        try:
            (runs_dir / run_id).mkdir(mode=0o700)
            break
        except FileExistsError:
            if given:
                raise UsageError(
                    f"{runs_dir / run_id}: that run already exists (never reused)"
                ) from None
    return Run(
        runs_dir,
        run_id,
        Ledger(runs_dir / run_id / EVENTS_NAME, run_id, key=key, fsync=fsync, secrets=secrets)
    )


# ----------------------------------------------------------------------------
# Reading and verifying
# ----------------------------------------------------------------------------


def _expected_run_id(path):
    # runs/<run id>/events.jsonl, as open_run() makes it, holds only that run's events
    path = Path(path)
    return (
        path.parent.name
        if path.name == EVENTS_NAME and _OUR_RUN_ID_RE.match(path.parent.name)
        else None
    )


def _form_problem(body):
    def no_duplicates(items):
        seen = set()
        for name, _value in items:
            if name in seen:
                raise _BadValue(f"duplicate key {name!r} in one object")
            seen.add(name)
        return dict(items)

    def no_constant(name):
        raise _BadValue(f"{name} is not JSON the writer writes")

    def finite(literal):
        if float(literal) in (float("inf"), float("-inf")):
            raise _BadValue(f"the number {literal[:40]} overflows to Infinity")
        return float(literal)

    if not body.strip():
        return "blank line" if not body else "white space only"
    if b"\x00" in body:
        return "NUL byte in line"
    try:
        json.loads(
            body.decode("utf-8"),
            object_pairs_hook=no_duplicates,
            parse_constant=no_constant,
            parse_float=finite
        )
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (byte {exc.start})"
    except _BadValue as exc:
        return exc.reason
    except ValueError as exc:
        return f"broken JSON: {exc}"
    except RecursionError:
        return "nested too deeply to read"
    return "not in the writer's compact form (white space, escapes or number format differ)"


def _envelope_problem(event, lineno, run_id, known):
    if type(event) is not dict:
        return "line is not a JSON object"
    if tuple(event) != FIELDS:
        missing = [f for f in FIELDS if f not in event]
        return (
            f"missing field {missing[0]!r}"
            if missing
            else f"fields must be exactly {', '.join(FIELDS)}, in that order"
        )
    seq, rid, kind, at, payload, prev = event.values()
    if type(seq) is not int:
        return f"seq is not an integer: {printable(seq)!r}"
    if seq != lineno:
        return f"expected seq {lineno}, got {seq} ({'duplicate or repeated seq' if seq < lineno else 'gap in seq'})"
    # a ledger repeats a few run ids and kinds: each pair is checked once
    if (rid, kind) not in known:
        if type(rid) is not str or not _RUN_ID_RE.match(rid):
            return f"bad run_id {printable(rid)!r}"
        if run_id is not None and rid != run_id:
            return f"run_id {rid!r} differs from the run directory's {run_id!r}"
        if type(kind) is not str or not _KIND_RE.match(kind):
            return f"bad kind {printable(kind)!r}"
        if len(known) < 4096:
            known.add((rid, kind))
    if not _at_ok(at):
        return (
            f"bad timestamp {printable(at)!r} (want a real UTC time as YYYY-MM-DDTHH:MM:SS.ffffffZ)"
        )
    if type(payload) is not dict:
        return "payload is not a JSON object"
    return None if type(prev) is str else "prev is not a string"


def _chain_error(path, lineno, prev, key):
    if lineno > 1:
        return IntegrityError(
            path, lineno, f"prev does not match line {lineno - 1} (changed, removed or moved)"
        )
    if prev == GENESIS and key:
        return IntegrityError(
            path, 1, "ledger is not keyed but a key was given (or was rewritten without it)"
        )
    if prev != GENESIS and not key:
        return KeyRequiredError(path)
    return IntegrityError(
        path, 1, "prev is not this key's genesis: wrong key, or line 1 was rewritten"
    )


def iter_lines(path, *, key=None, run_id=None):
    """Yield (event, raw line, its hash), verifying each line; TornTailError after every good line of a
    torn file."""
    return verified_events(path, key=key, run_id=run_id)


@contextlib.contextmanager
def _file_lines(path):
    with open(path, "rb") as handle:
        yield iter(functools.partial(handle.readline, MAX_LINE_BYTES), b"")


def _check_lines(path, source, key, run_id):
    # `source`: a context manager giving lines (of a file, or the rows of ClickHouse); `key`: bytes
    # or None
    expected_prev, known, sha256 = _genesis(key), set(), hashlib.sha256
    lineno = offset = 0
    with source as lines:
        for raw in lines:
            lineno += 1
            if raw[-1:] != b"\n":
                if len(raw) >= MAX_LINE_BYTES:
                    raise IntegrityError(
                        path,
                        lineno,
                        f"line is longer than the format's {MAX_LINE_BYTES}-byte limit"
                    )
                raise TornTailError(path, lineno, offset, len(raw), (lineno - 1, expected_prev))
            offset += len(raw)
            body = raw[:-1]
            # exactly the writer's bytes: encoded again by the writer's own encoder, the line gives
            # back its text
            try:
                text = body.decode("utf-8")
                event, end = _SCANNER(text, 0)
                canonical = end == len(text) and _dumps(event) == text
            except (ValueError, StopIteration, RecursionError):
                raise IntegrityError(path, lineno, _form_problem(body)) from None
            # the common good line passes this one inline test (verify's bench guard); any other is
            # named below
            if not (
                canonical
                and type(event) is dict
                and tuple(event) == FIELDS
                and event["seq"] == lineno
                and type(event["seq"]) is int
                and event["prev"] == expected_prev
                and (event["run_id"], event["kind"]) in known
                and type(event["payload"]) is dict
                and _at_ok(event["at"])
            ):
                problem = _envelope_problem(event, lineno, run_id, known) or (
                    None if canonical else _form_problem(body)
                )
                if problem:
                    raise IntegrityError(path, lineno, problem)
                if event["prev"] != expected_prev:
                    raise _chain_error(path, lineno, event["prev"], key)
            expected_prev = (hmac.new(key, body, sha256) if key else sha256(body)).hexdigest()
            yield event, body, expected_prev


def read_events(path, *, key=None, run_id=None):
    """Stream the events of a ledger in order, verifying as it goes (constant memory)."""
    for event, _raw, _digest in iter_lines(path, key=key, run_id=run_id):
        yield event


def verified_events(path, *, key=None, expect=None, run_id=None):
    """iter_lines() that also holds the ledger to a head published earlier, `expect` = (seq, hash)."""
    run_id = _expected_run_id(path) if run_id is None else run_id
    return _verified(path, _file_lines(path), _resolve_key(key), expect, run_id)


def _verified(
    path, source, key, expect, run_id, expected="the expected head is", ends="the ledger ends at"
):
    # the one verifying reader of files (verify, report, ship) and of the rows of ClickHouse (verify
    # --from)
    count = 0
    for event, raw, digest in _check_lines(path, source, key, run_id):
        count = event["seq"]
        if expect and count == expect[0] and digest != expect[1]:
            raise IntegrityError(
                path, count, "does not match the expected head: the history up to it was rewritten"
            )
        yield event, raw, digest
    _reached(path, expect, count, key, expected, ends)


def _reached(path, expect, count, key, expected="the expected head is", ends="the ledger ends at"):
    if expect and expect[0] == 0 and expect[1] != _genesis(key):
        raise IntegrityError(
            path, None, "the expected head is seq 0, but its hash is not this key's genesis"
        )
    if expect and expect[0] > count:
        raise IntegrityError(
            path,
            count + 1 if count else None,
            f"truncated: {expected} seq {expect[0]} but {ends} seq {count}"
        )


class Verified:
    """The result of verify(): how many lines, and the head (seq, hash)."""

    def __init__(self, path, count, head):
        self.path, self.count, self.head = str(path), count, head

    def head_text(self):
        return f"{self.head[0]} {self.head[1]}"


def _tally_lines(path, lines, key):
    count, head = 0, (0, _genesis(key))
    for event, _raw, digest in lines:
        count, head = event["seq"], (event["seq"], digest)
    return Verified(path, count, head)


def verify(path, *, key=None, expect_head=None, run_id=None):
    """Verify a whole ledger (held to `expect_head`, as verified_events); return Verified or raise."""
    key = _resolve_key(key)
    return _tally_lines(
        path, verified_events(path, key=key or b"", expect=expect_head, run_id=run_id), key
    )


def run_ledgers(runs_dir, key=None):
    """[(path, expected head or None)]: index.jsonl, every run (a closed one with its index head), then
    the runs the index names whose events.jsonl is missing. The index is read as far as it verifies.
    """
    runs_dir, heads = Path(runs_dir), {}
    index = runs_dir / INDEX_NAME
    with contextlib.suppress(LedgerError, OSError):
        for event in read_events(index, key=key or b"", run_id=None) if index.exists() else ():
            entry = event["payload"]
            if event["kind"] == "run_closed" and type(entry.get("run")) is str:
                heads[entry["run"]] = (entry.get("head_seq"), entry.get("head_hash"))
    runs = sorted(runs_dir.glob(f"*/{EVENTS_NAME}"))
    missing = sorted(set(heads) - {events.parent.name for events in runs})
    return (
        ([(index, None)] if index.exists() else [])
        + [(events, heads.get(events.parent.name)) for events in runs]
        + [(runs_dir / run_id / EVENTS_NAME, heads[run_id]) for run_id in missing]
    )


def verify_runs(runs_dir, *, key=None):
    """Yield (path, Verified or the exception) for each of run_ledgers(), closed runs held to their
    index heads."""
    for path, expect in run_ledgers(runs_dir, key):
        try:
            if expect is not None and not path.exists():
                raise IntegrityError(
                    path, None, "closed in the index but its events.jsonl is missing"
                )
            result = verify(path, key=key, expect_head=_checked_head(expect, path))
            if expect and result.count > expect[0]:
                raise IntegrityError(
                    path,
                    expect[0] + 1,
                    f"{result.count - expect[0]} line(s) after the run "
                    f"closed at seq {expect[0]}"
                )
            yield path, result
        except (LedgerError, OSError) as exc:
            yield path, exc


def _checked_head(expect, path):
    if expect is not None and (type(expect[0]) is not int or type(expect[1]) is not str):
        raise IntegrityError(path, None, "the index entry for this run has no valid head")
    return expect


# ---------------------------------------------------------------------------- HTTP: never a
# redirect, one deadline for a whole request (ask.py, ship and the daemon use it), one server
# ----------------------------------------------------------------------------

# {pid: (heap of (at, id, Deadline), Condition)}: one thread a process expires every Deadline (a
# thread per deadline costs more than a call to a local server); a forked child starts its own.
_timers = {}


def _timer():
    import heapq

    fresh = ([], threading.Condition())
    heap, wake = timer = _timers.setdefault(os.getpid(), fresh)

    def run():
        while True:
            with wake:
                while heap and heap[0][2].cancelled:
                    heapq.heappop(heap)
                due = heap[0][0] - time.monotonic() if heap else None
                if due is None or due > 0:
                    wake.wait(due)
                    continue
                deadline = heapq.heappop(heap)[2]
            deadline.expire()

    if timer is fresh:
        threading.Thread(target=run, name="deadlines", daemon=True).start()
    return timer


def shut(sock, how=socket.SHUT_RDWR):
    try:
        sock.shutdown(how)
    except OSError:
        pass


class Deadline:
    """The deadline of a whole request, connect to last byte: a server that trickles one byte at a time
    passes every socket timeout, so every socket watched is shut down when it passes. Deadline(None)
    has none."""

    def __init__(self, seconds):
        import heapq

        self.seconds, self.expired, self.cancelled = seconds, False, False
        self.at = time.monotonic() + seconds if seconds else None
        self._sockets, self._lock = [], threading.Lock()
        if seconds:
            heap, wake = _timers.get(os.getpid()) or _timer()
            with wake:
                heapq.heappush(heap, (self.at, id(self), self))
                wake.notify()

    def remaining(self):
        return max(0.001, self.at - time.monotonic()) if self.at is not None else None

    def watch(self, sock, how=socket.SHUT_RDWR):
        """Shut `sock` (both ways, or `how`) when the deadline passes."""
        with self._lock:
            self._sockets.append((sock, how))
            if self.expired:
                shut(sock, how)
        return sock

    def expire(self):
        with self._lock:
            if not self.cancelled:
                self.expired = True
                for sock, how in self._sockets:
                    shut(sock, how)

    def cancel(self):
        with self._lock:
            self.cancelled = True


# this thread's opener (one costs more to build than a local call), and its deadline
_http = threading.local()


def http_open(request, deadline, timeout=None):
    """Open a urllib Request: proxies from the environment, never a redirect (a 3xx raises HTTPError,
    so no key goes to another URL), every socket under `deadline`, each read under `timeout`
    (default: what remains)."""
    if getattr(_http, "opener", None) is None:
        import http.client
        import urllib.request

        def watched(connection_class):
            def make(host, **kwargs):
                conn = connection_class(host, **kwargs)
                create, deadline = conn._create_connection, _http.deadline
                conn._create_connection = lambda *args, **kw: deadline.watch(create(*args, **kw))
                return conn

            return make

        class Watched(urllib.request.AbstractHTTPHandler):
            http_request = https_request = urllib.request.AbstractHTTPHandler.do_request_

            def http_open(self, req):
                return self.do_open(watched(http.client.HTTPConnection), req)

            # the certificates (~20 ms) load only once an https URL is used
            def https_open(self, req):
                return self.do_open(
                    watched(http.client.HTTPSConnection), req, context=_tls_context()
                )

        _http.opener = urllib.request.OpenerDirector()  # no redirect handler: a 3xx is an HTTPError
        for handler in (
            urllib.request.ProxyHandler(),
            urllib.request.UnknownHandler(),
            Watched(),
            urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPErrorProcessor()
        ):
            _http.opener.add_handler(handler)
    _http.deadline = deadline
    return _http.opener.open(
        request, timeout=timeout if timeout is not None else deadline.remaining()
    )


@functools.lru_cache(maxsize=None)
def _tls_context():
    import ssl

    return ssl.create_default_context()


class CappedServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """A thread per connection, at most `max_connections` (past that `busy`, an answer's bytes, and a
    close). Handlers add their idle keep-alive sockets to `idle` (under `lock`), which stop() shuts
    at once."""

    daemon_threads, block_on_close, allow_reuse_address, request_queue_size = True, False, True, 128

    def __init__(self, address, handler, max_connections, busy):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.max_connections, self.busy, self.slots = (
            max_connections,
            busy,
            threading.Semaphore(max_connections)
        )
        self.lock, self.idle, self.stopping = threading.Lock(), set(), False
        super().__init__(address, handler)

    def refused(self, client_address):
        """Called for a connection over the cap, before its busy answer."""

    def log_error(self, text):
        error(text)

    def handle_error(self, request, client_address):  # one line, not socketserver's traceback
        self.log_error(f"connection from {client_address[0]}: {type(sys.exc_info()[1]).__name__}")

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.refused(client_address)
            try:
                request.settimeout(1.0)
                request.sendall(self.busy)
            except OSError:
                pass
            return self.shutdown_request(request)
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread could be started
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def stop(self, grace):
        """Idle connections closed at once, then no new connection; those in flight get `grace`
        seconds."""
        with self.lock:
            self.stopping = True
            for sock in self.idle:
                shut(sock)
        self.shutdown()
        self.server_close()
        ends = time.monotonic() + grace
        for _ in range(self.max_connections):  # every slot back: every request done
            if not self.slots.acquire(timeout=max(0.0, ends - time.monotonic())):
                break


# ---------------------------------------------------------------------------- Shipping to
# ClickHouse: a sink for verified lines (`ship`) and a source to verify again (`verify --from`)
# ----------------------------------------------------------------------------

SHIP_URL_ENV = "LEDGER_SHIP_URL"
SHIP_USER_ENV = "CLICKHOUSE_USER"
SHIP_PASSWORD_ENV = "CLICKHOUSE_PASSWORD"
SHIP_DATABASE = "reasoning_ledger"
SHIP_TABLE = "ledger_lines"
SHIP_BATCH_ROWS = 20000
# an INSERT below min_insert_block_size is one part: all or nothing
SHIP_BATCH_BYTES = 32 * 1024 * 1024
SHIP_MAX_BATCH_ROWS = 1000000
SHIP_TIMEOUT = 60.0  # seconds for one request, connect to last byte
SHIP_DEADLINE = 600.0  # seconds for a whole `ship` run: no request or retry starts after it
SHIP_RETRIES = 3  # after a connection error, a timeout or an HTTP 5xx; backoff 0.5, 1, 2 s
# rows waiting for their ledger's check stay in memory up to this,
SHIP_SPOOL_MEMORY = 64 * 1024 * 1024
# then go to a temp file up to this (or half the free space)
SHIP_SPOOL_MAX = 2 * 1024 * 1024 * 1024
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
_STORED_ROW_RE = re.compile(rb"([0-9a-f]{64})\t([0-9]{1,20})\t([0-9a-f]{64})\t")

# The model_call fields shipped as typed columns. A value its column cannot hold as ask.py writes it
# (String: a JSON string, Int64: an integer within Int64, UInt8: true or false, Float64: a number)
# is shipped as NULL, and the row's `malformed` is 1 when audit.py reads the field (all but
# total_tokens): the local audit's rule, so SQL counts what the audit counts. The typing is done
# here: ClickHouse 18.16 has no JSON functions to do it.
SHIP_CALL_FIELDS = (
    ("request_model", "String"),
    ("response_model", "String"),
    ("base_url", "String"),
    ("attempt", "Int64"),
    ("error_type", "String"),
    ("usage_status", "String"),
    ("usage_reported", "UInt8"),
    ("latency_ms", "Float64"),
    ("system_fingerprint", "String"),
    ("check", "UInt8"),
    ("input_tokens", "Int64"),
    ("output_tokens", "Int64"),
    ("total_tokens", "Int64"),
    ("est_input_tokens", "Int64"),
    ("est_output_tokens", "Int64")
)
_SHIP_TYPES = {"String": (str,), "Int64": (int,), "UInt8": (bool,), "Float64": (float, int)}
# ledger_id is the SHA-256 of line 1; `raw` the exact line; line_sha256 its plain SHA-256 (keyed
# ledgers too); at_time `at` in Unix seconds (0 outside 1970..2105).
SHIP_COLUMNS = (
    (
        ("ledger_id", "String"),
        ("host", "String"),
        ("path", "String"),
        ("seq", "UInt64"),
        ("run_id", "String"),
        ("kind", "String"),
        ("at", "String"),
        ("at_time", "DateTime"),
        ("raw", "String"),
        ("line_sha256", "String"),
        ("prev", "String"),
        ("shipped_at", "DateTime")
    )
    + tuple((name, f"Nullable({kind})") for name, kind in SHIP_CALL_FIELDS)
    + (("malformed", "UInt8"),)
)


def ship_ddl(database=SHIP_DATABASE, table=SHIP_TABLE):
    """The CREATE TABLE `ship` runs: one row per (ledger_id, seq) once merged; every read uses FINAL."""
    columns = ",\n".join(f"    {name} {kind}" for name, kind in SHIP_COLUMNS)
    return (
        f"CREATE TABLE IF NOT EXISTS {database}.{table} (\n{columns}\n) "
        f"ENGINE = ReplacingMergeTree ORDER BY (ledger_id, seq)"
    )


class ClickHouseError(LedgerError):
    """ClickHouse could not be reached (exit 1: worth a retry, and the next run resumes) or refused
    (exit 2)."""

    def __init__(self, message, exit_code=EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code


def sql_string(text):
    """A ClickHouse string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


class ClickHouse:
    """ClickHouse's HTTP interface: POST only, never a redirect, credentials as headers, deadlines,
    retries."""

    def __init__(
        self,
        url=None,
        *,
        database=SHIP_DATABASE,
        table=SHIP_TABLE,
        timeout=SHIP_TIMEOUT,
        deadline=None,
        retries=SHIP_RETRIES,
        environ=None
    ):
        import urllib.parse

        env = os.environ if environ is None else environ
        url = (url if url is not None else env.get(SHIP_URL_ENV) or "").strip()
        if not url:
            raise UsageError(
                f"no ClickHouse URL: pass --to URL or set {SHIP_URL_ENV} (e.g. http://127.0.0.1:8123)"
            )
        try:  # a URL is never echoed: it may hold a password
            parts = urllib.parse.urlsplit(url)
            self.where = (
                f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
            )
        except ValueError:
            raise UsageError(
                "the ClickHouse URL is not a valid URL (want http://HOST:PORT)"
            ) from None
        if "@" in parts.netloc:
            raise UsageError(
                f"the ClickHouse URL holds a user name or password; set {SHIP_USER_ENV} and "
                f"{SHIP_PASSWORD_ENV} instead (a URL shows in process lists and logs)"
            )
        if parts.scheme not in ("http", "https") or not parts.hostname or "?" in url or "#" in url:
            raise UsageError(
                "the ClickHouse URL must be http[s]://HOST[:PORT], with no query or fragment "
                "(use --database and --table)"
            )
        for what, name in (("--database", database), ("--table", table)):
            if type(name) is not str or not _NAME_RE.match(name):
                raise UsageError(
                    f"{what}: want letters, digits and _ (a ClickHouse name), got {printable(name)!r}"
                )
        if not (timeout > 0 and (deadline is None or deadline > 0)):
            raise UsageError("--timeout and --deadline must be positive numbers")
        self.base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}/"
        self.database, self.table, self.name = database, table, f"{database}.{table}"
        self.timeout, self.retries = float(timeout), int(retries)
        self.ends = time.monotonic() + deadline if deadline else None
        user, password = env.get(SHIP_USER_ENV), env.get(SHIP_PASSWORD_ENV)
        headers = {
            "User-Agent": f"reasoning-ledger/{__version__}",
            "X-ClickHouse-Key": password,
            "X-ClickHouse-User": user or (password and "default")
        }
        self._headers = {name: value for name, value in headers.items() if value}

    def query(self, sql, data=None, stream=False):
        """Run one statement (with `data`, the body, the SQL goes in ?query=); return the answer's
        bytes, or with `stream` the response to read and close. wait_end_of_query makes an error an
        HTTP error, never in rows."""
        started = time.monotonic()
        for attempt in range(1, self.retries + 2):
            try:
                return self._once(sql, data, stream)
            except ClickHouseError as exc:
                delay = 0.5 * 2 ** (attempt - 1)
                if exc.exit_code != EXIT_FAILED:
                    raise ClickHouseError(
                        f"ClickHouse at {self.where}: {exc}", exc.exit_code
                    ) from None
                if attempt > self.retries or (
                    self.ends and self.ends - time.monotonic() < delay + 0.1
                ):
                    took = f"{attempt} attempt{'s' if attempt != 1 else ''} in {time.monotonic() - started:.1f} s"
                    raise ClickHouseError(f"ClickHouse at {self.where}: {exc} ({took})") from None
                time.sleep(delay)

    def _once(self, sql, data, stream):
        import http.client
        import urllib.error
        import urllib.parse
        import urllib.request

        query = {"wait_end_of_query": 1, "output_format_json_quote_64bit_integers": 0}
        query.update({"query": sql} if data is not None else {})
        request = urllib.request.Request(
            self.base + "?" + urllib.parse.urlencode(query),
            data=sql.encode("utf-8") if data is None else data,
            headers=self._headers,
            method="POST"
        )
        seconds = min(self.timeout, self.ends - time.monotonic()) if self.ends else self.timeout
        if seconds <= 0:
            raise ClickHouseError("the --deadline passed")
        deadline = Deadline(None if stream else seconds)
        try:
            response = http_open(request, deadline, timeout=seconds)
            if stream:
                return response
            with response:
                return response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                raise _http_error(exc) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise ClickHouseError(
                f"no complete answer within {seconds:.3g} s"
                if deadline.expired
                else printable(error_text(reason))
            ) from None
        finally:
            deadline.cancel()

    def rows(self, sql):
        """The answer of a SELECT as dicts (64-bit integers as numbers)."""
        try:
            return [
                json.loads(line)
                for line in self.query(sql + " FORMAT JSONEachRow").splitlines()
                if line
            ]
        except ValueError:
            raise ClickHouseError(
                f"ClickHouse at {self.where}: an answer that is not JSON lines", EXIT_USAGE
            ) from None

    def stream(self, sql):
        return self.query(sql, stream=True)

    def ensure_table(self, create=True):
        """Create the table (and database) when missing, or without `create` raise; refuse another
        shape."""
        sql = (
            f"SELECT name, type FROM system.columns WHERE database = {sql_string(self.database)} "
            f"AND table = {sql_string(self.table)}"
        )
        found = {row["name"]: row["type"] for row in self.rows(sql)}
        if not found and not create:
            raise ClickHouseError(
                f"ClickHouse at {self.where}: no table {self.name} (nothing shipped to it yet?)",
                EXIT_USAGE
            )
        if not found:
            self.query(f"CREATE DATABASE IF NOT EXISTS {self.database}")
            self.query(ship_ddl(self.database, self.table))
            found = {row["name"]: row["type"] for row in self.rows(sql)}
        for name, kind in SHIP_COLUMNS:
            if found.get(name) != kind:
                what = f"{name} {found[name]}" if name in found else f"no column {name}"
                raise ClickHouseError(
                    f"ClickHouse at {self.where}: table {self.name} has {what}, want {kind}: it was "
                    f"not made by this tool (or by another version); pick another with --table",
                    EXIT_USAGE
                )

    def require_table(self):
        """Raise (exit 2) when the table is missing: nothing was shipped to it yet."""
        self.ensure_table(create=False)


def _http_error(exc):
    import http.client

    if 300 <= exc.code < 400:
        return ClickHouseError(
            f"HTTP {exc.code}: a redirect was not followed (the password is never sent to "
            f"another URL; fix the URL)",
            EXIT_USAGE
        )
    try:
        text = (exc.read(65536).decode("utf-8", "replace").strip().splitlines() or [""])[0]
    except (OSError, http.client.HTTPException):
        text = ""
    # 18.16's form
    text = re.sub(r"e\.displayText\(\) = (DB::Exception: )?|, e\.what\(\) = .*", "", text)
    answer = f"HTTP {exc.code}: {printable(text[:300]) or 'no message'}"
    if exc.code >= 500 or exc.code in (408, 429):  # worth a retry
        return ClickHouseError(answer)
    hint = f" (check {SHIP_USER_ENV} / {SHIP_PASSWORD_ENV})" if exc.code in (401, 403) else ""
    return ClickHouseError(answer + hint, EXIT_USAGE)


class Shipped:
    """What `ship` did for one ledger: lines first..last sent (none when first > last), and its head."""

    def __init__(self, path, ledger_id, first, last, head, torn=None, more=0, resent=False):
        self.path, self.ledger_id, self.first, self.last, self.head = (
            str(path),
            ledger_id,
            first,
            last,
            head
        )
        self.torn, self.more, self.resent = torn, more, resent
        self.sent = max(0, last - first + 1)

    def text(self):
        where = f"{printable(self.path)}  {self.ledger_id[:12]}"
        if not self.sent:
            return f"up to date {where}  head {self.head[0]} {self.head[1]}"
        lines = "line" if self.sent == 1 else "lines"
        what = f"{lines} re-sent" if self.resent else f"new {lines}"
        more = f", {self.more:,} more next run" if self.more else ""
        return (
            f"shipped {where}  {self.sent:,} {what} "
            f"(seq {self.first}..{self.last}){more}  head {self.head[0]} {self.head[1]}"
        )


def _row(base, event, body, line_sha, shipped_at):
    at = event["at"]
    seconds = (
        datetime.date(int(at[:4]), int(at[5:7]), int(at[8:10])).toordinal() - 719163
    ) * 86400 + (int(at[11:13]) * 3600 + int(at[14:16]) * 60 + int(at[17:19]))
    row = dict(
        base,
        seq=event["seq"],
        run_id=event["run_id"],
        kind=event["kind"],
        at=at,
        at_time=seconds if 0 <= seconds < 1 << 32 else 0,
        prev=event["prev"],
        line_sha256=line_sha,
        shipped_at=shipped_at
    )
    if event["kind"] == "model_call":
        malformed = False
        for name, kind in SHIP_CALL_FIELDS:
            value = event["payload"].get(name)
            if value is None:
                continue
            if type(value) in _SHIP_TYPES[kind] and (
                type(value) is not int or -1 << 63 <= value < 1 << 63
            ):
                row[name] = float(value) if kind == "Float64" else value
            else:
                malformed = malformed or name != "total_tokens"
        row["malformed"] = int(malformed)
    row["raw"] = body.decode("utf-8")
    return _dumps(row).encode("utf-8") + b"\n"


def _spool_limit():  # SHIP_SPOOL_MAX, or half the free space of the temp dir
    import shutil
    import tempfile

    try:
        return max(
            SHIP_SPOOL_MEMORY,
            min(SHIP_SPOOL_MAX, shutil.disk_usage(tempfile.gettempdir()).free // 2)
        )
    except OSError:
        return SHIP_SPOOL_MEMORY


def ship_targets(paths, runs_dir=None, key=None):
    """[(path, expected head or None)]: the PATHs, then run_ledgers(RUNS_DIR); a ledger named twice
    once."""
    unique = {}
    for path, expect in [(Path(p), None) for p in paths] + (
        run_ledgers(runs_dir, key) if runs_dir else []
    ):
        real = os.path.realpath(path)
        if real not in unique or expect is not None:
            unique[real] = (unique[real][0] if real in unique else path, expect)
    return list(unique.values())


def ship(
    targets,
    client,
    *,
    key=None,
    host=None,
    batch_rows=SHIP_BATCH_ROWS,
    batch_bytes=SHIP_BATCH_BYTES
):
    """Send the new verified lines of each (path, expected head or None) to ClickHouse. Yields (path,
    Shipped or the LedgerError/OSError that stopped it: nothing of it was sent); a ClickHouseError
    propagates."""
    key, host = _resolve_key(key), host or socket.gethostname()
    if not 0 < batch_rows <= SHIP_MAX_BATCH_ROWS:
        raise UsageError(f"--batch-rows must be between 1 and {SHIP_MAX_BATCH_ROWS:,}")
    # {path: SHA-256 of line 1, None without a complete line, or the OSError of reading it}
    ids = {}
    for path, _expect in targets:
        try:
            with _file_lines(path) as lines:
                first = next(lines, b"")
            ids[path] = hashlib.sha256(first[:-1]).hexdigest() if first[-1:] == b"\n" else None
        except OSError as exc:
            ids[path] = _named(exc, path)
    try:
        client.ensure_table()
        wanted, heads = sorted(i for i in set(ids.values()) if type(i) is str), {}
        for i in range(0, len(wanted), 500):  # ClickHouse's max_query_size is 256 KiB
            heads.update(
                (row["ledger_id"], (row["top"], row["sha"], row["n"]))
                for row in client.rows(
                    f"SELECT ledger_id, max(seq) AS top, argMax(line_sha256, seq) AS sha, count() AS n FROM "
                    f"{client.name} FINAL WHERE ledger_id IN ({', '.join(map(sql_string, wanted[i:i + 500]))}) "
                    f"GROUP BY ledger_id"
                )
            )
    except ClickHouseError as exc:
        raise (
            exc if exc.exit_code != EXIT_FAILED else ClickHouseError(f"{exc}; the next run resumes")
        ) from None
    for path, expect in targets:
        try:
            if isinstance(ids[path], OSError):
                raise ids[path]
            yield path, _ship_one(
                client,
                path,
                ids[path],
                heads.get(ids[path]),
                key,
                _checked_head(expect, path),
                host,
                batch_rows,
                batch_bytes
            )
        except (IntegrityError, KeyRequiredError, OSError) as exc:
            yield path, _named(exc, path)


def _ship_one(client, path, ledger_id, server, key, expect, host, batch_rows, batch_bytes):
    """Verify the whole ledger while spooling the rows ClickHouse lacks (up to its limit), then send
    them."""
    import tempfile

    texts = ("index.jsonl records", "the run ends at")
    if ledger_id is None:  # no complete line yet
        _reached(path, expect, 0, key, *texts)
        return Shipped(path, "-" * 12, 1, 0, (0, _genesis(key)))
    top, top_sha, stored = server or (0, None, 0)
    # ClickHouse lost rows (deleted?): send them all again; FINAL keeps one of each
    resend = stored < top
    start = 0 if resend else top
    # marks: (last seq, spool offset)
    head, torn, last, marks = (0, _genesis(key)), None, None, [(start, 0)]
    base = {"ledger_id": ledger_id, "host": host, "path": os.path.abspath(path)}
    limit, shipped_at = _spool_limit(), int(time.time())
    with tempfile.SpooledTemporaryFile(max_size=SHIP_SPOOL_MEMORY) as spool:
        try:
            for event, body, digest in _verified(
                path, _file_lines(path), key, expect, _expected_run_id(path), *texts
            ):
                seq, line_sha = event["seq"], hashlib.sha256(body).hexdigest() if key else digest
                if seq == 1 and line_sha != ledger_id:
                    raise IntegrityError(
                        path, 1, "line 1 changed while it was being shipped (the file was replaced)"
                    )
                if seq == top and line_sha != top_sha:
                    raise IntegrityError(
                        path,
                        seq,
                        "differs from the line ClickHouse holds at this seq: a fork or "
                        "a local rewrite; nothing was sent"
                    )
                if seq > start and last is None:
                    spool.write(_row(base, event, body, line_sha, shipped_at))
                    if (
                        seq - marks[-1][0] == batch_rows
                        or spool.tell() - marks[-1][1] >= batch_bytes
                    ):
                        marks.append((seq, spool.tell()))
                        last = seq if spool.tell() >= limit else None
                head = (seq, digest)
        except TornTailError as exc:
            torn = exc
            _reached(path, expect, head[0], key, *texts)
        if head[0] < top:
            raise IntegrityError(
                path,
                head[0] + 1,
                f"ClickHouse holds this ledger up to seq {top} but the file ends "
                f"at seq {head[0]}: it was cut or rewritten after it was shipped; "
                f"nothing was sent"
            )
        last = last or head[0]
        marks += [(last, spool.tell())] if last > marks[-1][0] else []
        spool.seek(0)
        for (sent, offset), (_seq, end) in zip(marks, marks[1:]):
            try:
                client.query(
                    f"INSERT INTO {client.name} FORMAT JSONEachRow", data=spool.read(end - offset)
                )
            except ClickHouseError as exc:
                raise ClickHouseError(
                    f"{exc}; {sent - start:,} of {last - start:,} new lines of {path} were sent, "
                    f"the next run resumes at seq {sent + 1}",
                    exc.exit_code
                ) from None
    return Shipped(
        path,
        ledger_id,
        start + 1,
        last,
        head,
        torn,
        more=head[0] - last,
        resent=resend and last > start
    )


# -- verify --from ---------------------------------------------------------------


def shipped_ledgers(client, condition=""):
    """[{ledger_id, last_host, last_path, n, top}] in the table; `condition` is a SQL WHERE clause
    (trusted)."""
    return client.rows(
        f"SELECT ledger_id, argMax(host, seq) AS last_host, argMax(path, seq) AS last_path, "
        f"count() AS n, max(seq) AS top FROM {client.name} FINAL {condition} GROUP BY ledger_id "
        f"ORDER BY ledger_id"
    )


def verify_shipped(client, *, ledger_ids=(), key=None, expect_head=None, condition=None):
    """Re-verify the raw lines ClickHouse holds, and each row's line_sha256, seq and ledger_id. Yields
    (ledger as shipped_ledgers(), Verified or the error); `ledger_ids`: ids or their starts, or a
    SQL WHERE `condition`."""
    import itertools

    key = _resolve_key(key)
    for prefix in ledger_ids:
        if not re.fullmatch(r"[0-9a-f]{1,64}", prefix):
            raise UsageError(
                f"--ledger-id: want hex digits (a ledger_id or its start), got {printable(prefix)!r}"
            )
    client.require_table()
    where = (
        condition
        if condition is not None
        else (
            "WHERE "
            + " OR ".join(
                f"substring(ledger_id, 1, {len(p)}) = {sql_string(p)}" for p in ledger_ids
            )
            if ledger_ids
            else ""
        )
    )
    listed = {row["ledger_id"]: row for row in shipped_ledgers(client, where)}
    if expect_head is not None and len(listed) > 1:
        raise UsageError(f"--expect-head goes with exactly one ledger; {len(listed)} match")
    for prefix in ledger_ids:
        if not any(found.startswith(prefix) for found in listed):
            yield (
                {"ledger_id": prefix, "last_host": None, "last_path": None, "n": 0},
                IntegrityError(
                    f"clickhouse:{prefix}", None, "ClickHouse holds no line of this ledger"
                )
            )
    with client.stream(
        f"SELECT ledger_id, seq, line_sha256, raw FROM {client.name} FINAL {where} "
        f"ORDER BY ledger_id, seq FORMAT TSVRaw"
    ) as response:
        for ledger_id, rows in itertools.groupby(
            _stored_rows(response, client), key=lambda row: row[0]
        ):
            ledger = listed.get(ledger_id) or {
                "ledger_id": ledger_id,
                "last_host": None,
                "last_path": None
            }
            name = f"clickhouse:{ledger_id}"
            run_id = _expected_run_id(ledger["last_path"]) if ledger["last_path"] else None
            lines = contextlib.nullcontext(_stored_lines(name, ledger_id, rows))
            try:
                yield ledger, _tally_lines(
                    name,
                    _verified(name, lines, key, expect_head, run_id, ends="ClickHouse holds up to"),
                    key
                )
            except (IntegrityError, KeyRequiredError) as exc:
                yield ledger, exc


def _stored_rows(response, client):
    """(ledger_id, seq, line_sha256, line) for each TSVRaw row; one of another shape as (last id, None,
    why, b"")."""
    import http.client

    last, read = "", functools.partial(response.readline, MAX_LINE_BYTES + 256)
    try:
        for line in iter(read, b""):
            match = _STORED_ROW_RE.match(line)
            if match is None or line[-1:] != b"\n":
                yield last, None, "a stored row is not in the expected shape (too long, or holds a newline?)", b""
                while line and line[-1:] != b"\n":
                    line = read()
                continue
            last = match.group(1).decode("ascii")
            yield last, int(match.group(2)), match.group(3).decode("ascii"), line[match.end() :]
    except (OSError, http.client.HTTPException) as exc:
        raise ClickHouseError(
            f"ClickHouse at {client.where}: the answer was cut short "
            f"({printable(error_text(exc))})",
            EXIT_USAGE
        ) from None


def _stored_lines(name, ledger_id, rows):
    for expected, (_ledger_id, seq, sha, line) in enumerate(rows, 1):
        if seq is None:
            raise IntegrityError(name, expected, sha)
        if seq != expected:
            raise IntegrityError(
                name,
                expected,
                (
                    f"missing from ClickHouse: the next row stored is seq {seq} "
                    f"(a row was deleted)"
                    if seq > expected
                    else f"seq {seq} comes twice"
                )
            )
        digest = hashlib.sha256(line[:-1]).hexdigest()
        if digest != sha or (seq == 1 and digest != ledger_id):
            raise IntegrityError(
                name,
                seq,
                f"{'line_sha256' if digest != sha else 'ledger_id'} is not the SHA-256 "
                f"of the stored line (the row was altered in ClickHouse)"
            )
        yield line


# ----------------------------------------------------------------------------
# Command line helpers shared by the toolkit's scripts
# ----------------------------------------------------------------------------

_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(value):
    """str(value) with control characters escaped (\\n, \\x1b, \\u2028), so text from a ledger or a
    server can neither forge a line nor drive a terminal."""
    return _CONTROL_RE.sub(
        lambda match: repr(match.group())[1:-1], value if type(value) is str else str(value)
    )


def error(message, secrets=(), label="error"):
    """One 'error: …' line on stderr: secrets masked, control characters escaped."""
    text = Redactor(secret_values(secrets)).text(str(message))
    print(f"{label}: {printable(text)}", file=sys.stderr, flush=True)


def warn(message, secrets=()):
    error(message, secrets, "warning")


_stdout_dead = []  # the OutputError that ended stdout: later writes raise it again


def write_out(text):
    """Write text to stdout and flush. A stdout that is closed, full or cannot encode the text raises
    OutputError; later writes are dropped, and the interpreter's last flush cannot fail."""
    if not _stdout_dead and sys.stdout is None:  # started with stdout closed (>&-)
        _stdout_dead.append(OutputError("stdout is closed"))
    if _stdout_dead:
        raise _stdout_dead[0]
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, UnicodeEncodeError) as exc:
        pipe = isinstance(exc, BrokenPipeError)
        reason = (
            "stdout is closed"
            if pipe
            else (
                f"stdout cannot encode the text as {sys.stdout.encoding}"
                if isinstance(exc, UnicodeEncodeError)
                else f"cannot write to stdout: {error_text(exc)}"
            )
        )
        _stdout_dead.append(OutputError(reason, pipe=pipe))
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        raise _stdout_dead[0] from None


def error_text(exc):
    """One line for an error: 'path: No such file or directory' for OSError, str() otherwise."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc) or type(exc).__name__


def run_cli(command, args, secrets=()):
    """command(args); our errors and OS errors become one error line and their exit code (others are
    bugs)."""
    try:
        return command(args)
    except (LedgerError, OSError) as exc:
        error(error_text(exc), secrets)
        return exc.exit_code if isinstance(exc, LedgerError) else EXIT_USAGE
    except KeyboardInterrupt:
        error("interrupted")
        return 130


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error as the toolkit's one `error: …` line (and a pointer to --help)."""

    def error(self, message):
        error(f"{self.prog}: {message} (see {self.prog} --help)")
        raise SystemExit(EXIT_USAGE)


def parse_cli(parser, argv):
    """(args, None), or (None, exit code) when argparse printed help (0) or a usage error (2)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:
        return None, (EXIT_USAGE if exc.code else EXIT_OK)


def exit_codes_epilog(*codes):
    return "exit codes:\n" + "\n".join(f"  {c}  {EXIT_CODES[c]}" for c in codes)


def parse_time(text, end=False, now=None):
    """A date (YYYY-MM-DD), an ISO time, `today`, `yesterday`, or an age (`36h`, `7d`: that long before
    now) -> the ledger's `at` string form for comparing. `end` makes a day its last microsecond."""
    text, now = text.strip(), now or datetime.datetime.now(datetime.timezone.utc)
    if text in ("today", "yesterday"):
        text = (now - datetime.timedelta(days=1 if text == "yesterday" else 0)).strftime("%Y-%m-%d")
    age = re.fullmatch(r"([0-9]{1,5})([hd])", text)
    try:
        if age:
            moment = now - datetime.timedelta(
                hours=int(age.group(1)) * (24 if age.group(2) == "d" else 1)
            )
        elif re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text):
            moment = datetime.datetime.strptime(text, "%Y-%m-%d").replace(
                tzinfo=datetime.timezone.utc
            )
            moment += datetime.timedelta(days=1, microseconds=-1) if end else datetime.timedelta()
        else:
            moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            moment = moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        raise UsageError(
            f"not a date, an ISO time, today, yesterday or an age like 7d: {printable(text)!r}"
        ) from None
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------


def _cli_key(args):
    value = os.environ.get(args.key_env)
    if args.key_env != KEY_ENV and value is None:
        raise UsageError(f"--key-env {args.key_env}: that environment variable is not set")
    return _key_bytes(value) or b""


def _check_targets(args, command):
    if not args.paths and not args.all:
        raise UsageError(f"{command} needs a PATH or --all RUNS_DIR")
    if args.all and not Path(args.all).is_dir():
        raise UsageError(f"--all: no such directory: {args.all}")


def _tally(results, good, summary, inside="", after=""):
    """One line per (path, result, suffix): good(result), FAIL or ERROR; then summary(ok, total).
    Returns the exit code: a FAIL (1) outranks an ERROR (2). `after` may hold {} for 'it' or 'them',
    the failed ledgers."""
    counts = {"ok": 0, "fail": 0, "error": 0}
    for path, result, suffix in results:
        if isinstance(result, (Verified, Shipped)):
            state, line = "ok", good(result)
        elif isinstance(result, IntegrityError):
            state, line = "fail", f"FAIL  {printable(result)}"
        else:
            text = error_text(result)
            state, line = (
                "error",
                f"ERROR {printable(text if text.startswith(str(path)) else f'{path}: {text}')}"
            )
        counts[state] += 1
        write_out(line + suffix + "\n")
    write_out(summary(counts["ok"], sum(counts.values())) + "\n")
    if counts["fail"]:
        them = "it" if counts["fail"] == 1 else "them"
        error(
            f"integrity check failed ({counts['fail']} ledger{'s' if them == 'them' else ''}{inside})"
            + after.format(them)
        )
        return EXIT_FAILED
    if counts["error"]:
        error("some ledgers could not be read or need a key")
        return EXIT_USAGE
    return EXIT_OK


def _verified_line(result):
    return (
        f"ok    {printable(result.path)}  {result.count} line{'' if result.count == 1 else 's'}  "
        f"head {result.head_text()}"
    )


def _cmd_verify(args):
    if args.from_url is not None:
        return _cmd_verify_from(args)
    _check_targets(args, "verify")
    if args.expect_head is not None and (len(args.paths) != 1 or args.all):
        raise UsageError("--expect-head goes with exactly one PATH")
    expect = parse_head(args.expect_head) if args.expect_head is not None else None
    key, results = _cli_key(args), []
    for path in args.paths:
        try:
            results.append((path, verify(path, key=key, expect_head=expect), ""))
        except (LedgerError, OSError) as exc:
            results.append((path, exc, ""))
    results += (
        [(path, result, "") for path, result in verify_runs(args.all, key=key)] if args.all else []
    )
    return _tally(results, _verified_line, "{}/{} ledgers valid".format)


def _cmd_head(args):
    write_out(verify(args.path, key=_cli_key(args)).head_text() + "\n")
    return EXIT_OK


# Payload fields that say what happened, shown on an event's line by `report`.
_REPORT_FIELDS = (
    "stage",
    "decision",
    "outcome",
    "tool",
    "rule",
    "verdict",
    "reason",
    "limit",
    "request_model",
    "response_model",
    "error_type",
    "error_code",
    "error",
    "message"
)
_ARTIFACT_RE = re.compile(r"artifacts/[0-9a-f]{64}\Z")


def _artifact(ledger_path, ref):
    if (
        type(ref) is not dict
        or type(ref.get("path")) is not str
        or not _ARTIFACT_RE.match(ref["path"])
    ):
        return ""
    try:
        with open(Path(ledger_path).parent / ref["path"], "rb") as handle:
            return handle.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def _tests_meaning(path, payload):
    counts = payload.get("counts") if type(payload.get("counts")) is dict else {}
    tally = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    if payload.get("passed") is True:
        return f"tests passed ({tally})" if tally else "tests passed"
    why = "timed out" if payload.get("timed_out") else f"exit {payload.get('returncode')}"
    try:
        outcomes = json.loads(_artifact(path, payload.get("outcomes_artifact")) or "{}")
    except ValueError:
        outcomes = {}
    failed = (
        sorted(name for name, outcome in outcomes.items() if outcome in ("failed", "error"))
        if type(outcomes) is dict
        else []
    )
    shown = ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
    return f"tests FAILED ({why}{'; ' + tally if tally else ''})" + (f": {shown}" if shown else "")


def _event_summary(path, event):
    """The envelope, the fields that say what happened, what it means (a failed check, tests, a reply)."""
    payload = event["payload"]
    parts = [event["at"], f"#{event['seq']}", event["kind"]] + [
        f"{name}={payload[name]}"
        for name in _REPORT_FIELDS
        if payload.get(name) not in (None, "", [], {})
    ]
    if payload.get("check") is False:
        parts.append(f"CHECK FAILED: {payload.get('check_detail') or 'no detail'}")
    if event["kind"] == "tests_run":
        parts.append(_tests_meaning(path, payload))
    call = payload.get("call") if type(payload.get("call")) is dict else {}
    reply = _artifact(path, payload.get("response_artifact") or call.get("reply_artifact"))
    line = next((s.strip() for s in reply.splitlines() if s.strip()), "")
    if line:
        parts.append(f"reply: {line if len(line) <= 120 else line[:119] + '…'}")
    if payload.get("rationale"):
        parts.append(f"-- {payload['rationale']}")
    return "  ".join(printable(p) for p in parts)


def _cmd_report(args):
    _check_targets(args, "report")
    key = _cli_key(args)
    targets = [(Path(p), None) for p in args.paths] + (
        run_ledgers(args.all, key) if args.all else []
    )
    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until, end=True) if args.until else None
    try:
        for path, expect in targets:
            if len(targets) > 1 and not args.json:
                write_out(f"== {printable(path)}\n")
            for event, raw, _digest in verified_events(path, key=key, expect=expect, run_id=None):
                if not (
                    (args.kind and event["kind"] not in args.kind)
                    or (args.stage and event["payload"].get("stage") != args.stage)
                    or (args.run and not event["run_id"].startswith(args.run))
                    or (since and event["at"] < since)
                    or (until and event["at"] > until)
                ):
                    write_out(
                        raw.decode("utf-8") + "\n"
                        if args.json
                        else _event_summary(path, event) + "\n"
                    )
    except OutputError as exc:
        if not exc.pipe:  # `report | head`: the reader has all it wanted
            raise
    return EXIT_OK


def _cmd_append(args):
    text = args.payload
    try:
        if text is None and not sys.stdin.isatty():
            text = sys.stdin.buffer.read().decode("utf-8")
        payload = json.loads(text) if text and text.strip() else {}
    except UnicodeDecodeError as exc:
        raise PayloadError(f"payload is not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:
        raise PayloadError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise PayloadError(f"payload is nested deeper than {MAX_DEPTH} levels") from None
    if type(payload) is not dict:
        raise PayloadError("payload must be a JSON object")
    key = _cli_key(args)
    with Ledger(
        args.path,
        args.run_id or os.environ.get("LEDGER_RUN_ID") or None,
        key=key,
        secrets=(key.decode("utf-8", "replace"),) if key else ()
    ) as ledger:
        ledger.append(args.kind, payload)
        write_out(f"{ledger.head[0]} {ledger.head[1]}\n")
    return EXIT_OK


def _cmd_ship(args):
    _check_targets(args, "ship")
    key = _cli_key(args)
    client = ClickHouse(
        args.to,
        database=args.database,
        table=args.table,
        timeout=args.timeout,
        deadline=args.deadline
    )
    sent = []

    def shipped(result):
        sent.append(result.sent)
        torn = result.torn
        try:  # a file that grew past its torn tail since it was read: an append was in progress
            quiet = torn is None or os.path.getsize(torn.path) > torn.offset + torn.length
        except OSError:
            quiet = False
        if not quiet:
            warn(
                f"{torn}; the lines before it were shipped, the torn bytes were not (a crash, not tampering)"
            )
        return result.text()

    results = ship(
        ship_targets(args.paths, args.all, key),
        client,
        key=key,
        host=args.host,
        batch_rows=args.batch_rows
    )
    return _tally(
        ((path, result, "") for path, result in results),
        shipped,
        lambda ok, total: (
            f"{ok}/{total} ledgers shipped or up to date, {sum(sent):,} new lines sent to {client.where} {client.name}"
        ),
        after="; nothing of {} was shipped"
    )


def _cmd_verify_from(args):
    if args.paths or args.all:
        raise UsageError("verify --from reads ClickHouse: it takes no PATH or --all")
    expect = parse_head(args.expect_head) if args.expect_head is not None else None
    ids = [i.strip().lower() for i in args.ledger_id or ()]
    if expect is not None and len(ids) != 1:
        raise UsageError("--expect-head with --from goes with exactly one --ledger-id")
    client = ClickHouse(
        args.from_url or None, database=args.database, table=args.table, timeout=args.timeout
    )

    def rows():
        for ledger, result in verify_shipped(
            client, ledger_ids=ids, key=_cli_key(args), expect_head=expect
        ):
            shown = ledger["last_path"] is not None and isinstance(
                result, (Verified, IntegrityError)
            )
            where = (
                f"  {printable(ledger['last_host'])}:{printable(ledger['last_path'])}"
                if shown
                else ""
            )
            yield f"clickhouse:{ledger['ledger_id']}", result, where

    try:
        return _tally(
            rows(),
            _verified_line,
            lambda ok, total: (f"{ok}/{total} ledgers valid in {client.where} {client.name}"),
            inside=" in ClickHouse"
        )
    except ClickHouseError as exc:  # ClickHouse could not be read: like a file that cannot be read
        raise ClickHouseError(str(exc), EXIT_USAGE) from None


def _build_parser():
    parser = ArgumentParser(
        prog="reasoning_ledger.py",
        description="Append-only, hash-chained JSONL ledger.",
        epilog=exit_codes_epilog(EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_OUTPUT),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub, commands = parser.add_subparsers(dest="command", metavar="COMMAND"), {}
    for name, text, handler in (
        ("verify", "check ledgers; exit 1 on any integrity failure", _cmd_verify),
        (
            "ship",
            "send the verified lines of ledgers to ClickHouse (resumable; for cron)",
            _cmd_ship
        ),
        ("head", "print the anchor 'SEQ HASH' of a verified ledger", _cmd_head),
        ("report", "one readable line per event: what it says and what it means", _cmd_report),
        ("append", "append one event; prints the new head", _cmd_append)
    ):
        p = commands[name] = sub.add_parser(name, help=text)
        p.set_defaults(func=handler)
        if name in ("head", "append"):
            p.add_argument("path", metavar="PATH")
        else:
            p.add_argument("paths", nargs="*", metavar="PATH")
            p.add_argument(
                "--all", metavar="RUNS_DIR", help="also RUNS_DIR/index.jsonl and every run in it"
            )
        if name in ("verify", "ship"):
            p.add_argument(
                "--database", default=SHIP_DATABASE, metavar="DB", help=f"default {SHIP_DATABASE}"
            )
            p.add_argument("--table", default=SHIP_TABLE, metavar="T", help=f"default {SHIP_TABLE}")
        p.add_argument(
            "--key-env",
            default=KEY_ENV,
            metavar="NAME",
            help=f"environment variable holding the HMAC key (default {KEY_ENV})"
        )
    p = commands["verify"]
    p.add_argument(
        "--expect-head", metavar="SEQ:HASH", help="a head published earlier (finds truncation)"
    )
    p.add_argument(
        "--from",
        dest="from_url",
        nargs="?",
        const="",
        metavar="URL",
        help=f"re-verify the lines shipped to ClickHouse at URL (default ${SHIP_URL_ENV})"
    )
    p.add_argument(
        "--ledger-id",
        action="append",
        metavar="ID",
        help="with --from: this ledger (or prefix), repeatable"
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="seconds a request (300)"
    )
    p = commands["ship"]
    p.add_argument(
        "--to",
        metavar="URL",
        help=f"ClickHouse's HTTP interface (default ${SHIP_URL_ENV}); user and "
        f"password from ${SHIP_USER_ENV} / ${SHIP_PASSWORD_ENV}"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=SHIP_TIMEOUT,
        metavar="S",
        help=f"seconds a request ({SHIP_TIMEOUT:g})"
    )
    p.add_argument(
        "--batch-rows",
        type=int,
        default=SHIP_BATCH_ROWS,
        metavar="N",
        help=f"lines per INSERT ({SHIP_BATCH_ROWS:,}; at most {SHIP_BATCH_BYTES >> 20} MiB)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=SHIP_DEADLINE,
        metavar="S",
        help=f"seconds for the whole run; the next run resumes ({SHIP_DEADLINE:g})"
    )
    p.add_argument("--host", help="host name recorded with each line (default: this machine's)")
    p = commands["report"]
    p.add_argument("--kind", action="append", help="only this kind (repeatable)")
    p.add_argument("--stage", help="only decisions of this stage")
    p.add_argument("--run", help="only this run id (or prefix)")
    p.add_argument("--since", help="date or ISO time (UTC)")
    p.add_argument("--until", help="date (inclusive) or ISO time")
    p.add_argument("--json", action="store_true", help="print the matching lines unchanged")
    p = commands["append"]
    p.add_argument("--kind", required=True)
    p.add_argument("--run-id", help="default: $LEDGER_RUN_ID or a new id")
    p.add_argument("--payload", help="a JSON object (default: stdin when it is not a terminal)")
    return parser


def main(argv=None):
    parser = _build_parser()
    args, code = parse_cli(parser, argv)
    if args is None:
        return code
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return run_cli(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
