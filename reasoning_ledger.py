#!/usr/bin/env python3
"""reasoning_ledger.py -- an append-only, hash-chained JSONL ledger. Standard library only.

Usage:
  python reasoning_ledger.py verify PATH... [--all RUNS_DIR] [--expect-head SEQ:HASH] [--key-env NAME]
  python reasoning_ledger.py head PATH [--key-env NAME]
  python reasoning_ledger.py report PATH [--kind K] [--stage S] [--run R] [--since T] [--until T] [--json]
  python reasoning_ledger.py append PATH --kind K [--run-id R] [--payload JSON | < payload.json]

Library (copy this one file next to your code):
  from reasoning_ledger import Ledger, open_run, read_events, verify
  with Ledger("runs.jsonl", run_id="nightly") as ledger:
      ledger.decide("plan", "run tests first", "cheapest signal", ["read code"])
      ledger.append("note", {"text": "hello"})

Exit codes: 0 ok, 1 integrity failure, 2 usage or I/O error.
"""

import argparse
import datetime
import errno
import fcntl
import hashlib
import hmac
import json
import os
import re
import sys
import time
from pathlib import Path

__version__ = "1.0.0"

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

FORMAT_VERSION = 1
FIELDS = ("seq", "run_id", "kind", "at", "payload", "prev")
GENESIS = "0" * 64
MAX_LINE_BYTES = 1024 * 1024
KEY_ENV = "LEDGER_KEY"
REDACTED = "[REDACTED]"
SECRET_ENV_VARS = ("API_KEY", "OPENAI_API_KEY", "WEBHOOK_SECRET", "LEDGER_KEY")
REDACT_ENV_LIST = "LEDGER_REDACT_ENV"
MIN_SECRET_CHARS = 4
_INF = float("inf")
INDEX_NAME = "index.jsonl"
EVENTS_NAME = "events.jsonl"

EXIT_OK, EXIT_INTEGRITY, EXIT_USAGE = 0, 1, 2

_KIND_RE = re.compile(r"[a-z][a-z0-9_.]*\Z")
_AT_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\Z")
_OUR_RUN_ID_RE = re.compile(r"\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{8}\Z")
_HEX64_RE = re.compile(r"[0-9a-f]{64}\Z")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")

# Keys whose values are secrets wherever they appear in a payload (compared lower-case, "-" as "_").
_SECRET_KEYS = frozenset((
    "api_key", "apikey", "x_api_key", "authorization", "proxy_authorization", "password", "passwd",
    "secret", "token", "access_token", "refresh_token", "id_token", "session_token", "auth_token",
    "cookie", "set_cookie", "private_key", "client_secret",
))
# Secret shapes masked inside any string: (trigger substrings, pattern, flags); group 1, when present,
# is kept. A shape's regex runs (and is compiled) only when a string holds one of its triggers, so the
# common string costs a few substring tests and `python ask.py` compiles no pattern it does not need.
_SECRET_SHAPES = (
    (("PRIVATE KEY",), r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S),
    (("earer",), r"(\b[Bb]earer\s+)[A-Za-z0-9._~+/=-]{4,}", 0),
    (("sk-",), r"\bsk-[A-Za-z0-9_-]{8,}", 0),
    (("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
     r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})", 0),
    (("xox",), r"\bxox[abposr]-[A-Za-z0-9-]{8,}", 0),
    (("AKIA", "ASIA"), r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0),
    (("@",), r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,31}://)[^\s/@:\"']{1,256}:[^\s/@\"']{1,256}(?=@)", 0),
    (("=",), r"([?&;](?:api[-_]?key|key|token|access_token|auth|secret|password|sig|signature)=)[^&#\s\"']+",
     re.I),
)
_SHAPE_LITERALS = tuple(t for triggers, _src, _flags in _SECRET_SHAPES for t in triggers)
_compiled_shapes = {}
_SEQ_PREFIX_RE = re.compile(rb'\{"seq":([1-9][0-9]*),')


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------

class LedgerError(Exception):
    """Base of every error this module raises."""


class PayloadError(LedgerError, ValueError):
    """The event cannot be written (not JSON, too long, bad kind). Nothing was written."""


class KeyRequiredError(LedgerError):
    """The ledger is keyed (HMAC) and no key was given."""

    def __init__(self, path):
        self.path = str(path)
        super().__init__(f"{path}: ledger is keyed (line 1's prev is not all zeros); "
                         f"a key is needed: set {KEY_ENV} or pass --key-env NAME")


class IntegrityError(LedgerError):
    """The file is not a valid ledger: names the file, the line and the reason."""

    def __init__(self, path, line, reason):
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{path}: line {line}" if line else f"{path}"
        super().__init__(f"{where}: {reason}")


class TornTailError(IntegrityError):
    """The last line has no newline: a writer died mid-append. All lines before it are valid."""

    def __init__(self, path, line, offset, length, head):
        self.offset, self.length, self.head = offset, length, head
        super().__init__(path, line, f"torn tail: {length} bytes at offset {offset} without a newline "
                                     f"(a writer crashed mid-append; the next append moves them to "
                                     f"{Path(path).name}.torn)")


# ----------------------------------------------------------------------------
# Helpers: time, ids, hashing
# ----------------------------------------------------------------------------

def utc_now():
    """Current UTC time as the ledger writes it: 2026-11-29T12:00:00.123456Z."""
    micros = time.time_ns() // 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(micros // 1000000)) + ".%06dZ" % (micros % 1000000)


def new_run_id():
    """A run id that sorts by creation time and carries a random suffix."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%S.%fZ") + "-" + os.urandom(4).hex()


def _key_bytes(key):
    if key is None or key == b"" or key == "":
        return None
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def key_from_env(name=KEY_ENV):
    """The HMAC key in environment variable `name`, or None."""
    return _key_bytes(os.environ.get(name))


def _genesis(key):
    return hmac.new(key, b"", hashlib.sha256).hexdigest() if key else GENESIS


def line_hash(raw, key=None):
    """SHA-256 (or HMAC-SHA256 with `key`) of one stored line, without its newline."""
    if key:
        return hmac.new(key, raw, hashlib.sha256).hexdigest()
    return hashlib.sha256(raw).hexdigest()


def parse_head(text):
    """'SEQ HASH' or 'SEQ:HASH' -> (seq, hash)."""
    parts = re.split(r"[:\s]+", text.strip())
    if len(parts) != 2 or not parts[0].isdigit() or not _HEX64_RE.match(parts[1].lower()):
        raise ValueError(f"not a ledger head (want SEQ:HASH): {text!r}")
    return int(parts[0]), parts[1].lower()


# ----------------------------------------------------------------------------
# Redaction
# ----------------------------------------------------------------------------

def secret_values(extra=()):
    """The exact secret strings to mask: our env vars, LEDGER_REDACT_ENV's, and `extra`."""
    names = list(SECRET_ENV_VARS)
    names += [n.strip() for n in os.environ.get(REDACT_ENV_LIST, "").split(",") if n.strip()]
    values = {os.environ.get(n) for n in names}
    values.update(extra)
    # longest first, so a secret that contains another is masked whole
    return sorted((v for v in values if v and len(v) >= MIN_SECRET_CHARS), key=len, reverse=True)


def _mask(match):
    return (match.group(1) or "") + REDACTED if match.re.groups else REDACTED


def _may_hold_shape(text):
    for literal in _SHAPE_LITERALS:
        if literal in text:
            return True
    return False


def redact_text(text, values=None):
    """Mask secret shapes and known secret values inside one string."""
    if values is None:
        values = secret_values()
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    if _may_hold_shape(text):  # the common case: nothing to mask, no regex run
        for triggers, src, flags in _SECRET_SHAPES:
            if any(t in text for t in triggers):
                pattern = _compiled_shapes.get(src)
                if pattern is None:
                    pattern = _compiled_shapes[src] = re.compile(src, flags)
                text = pattern.sub(_mask, text)
    return text


_secret_key_cache = {}


def is_secret_key(key):
    """True when a payload key names a secret (api_key, Authorization, *_secret, token, cookie...).
    Counts such as input_tokens are not secrets."""
    found = _secret_key_cache.get(key)
    if found is None:
        low = key.lower().replace("-", "_")
        found = low in _SECRET_KEYS or low.endswith("_secret") or low.startswith("x_") and low[2:] in _SECRET_KEYS
        if len(_secret_key_cache) < 4096:
            _secret_key_cache[key] = found
    return found


class _BadValue(Exception):
    def __init__(self, reason):
        super().__init__(reason)
        self.reason, self.where = reason, []


def _clean(value, values):
    """Validate that `value` is plain JSON and return it redacted. Raises _BadValue.
    Only the slow path runs this: serialize_payload() skips it when its screen finds nothing."""
    kind = type(value)
    if kind is str:
        return redact_text(value, values)
    if kind is int or kind is bool or value is None:
        return value
    if kind is float:
        if value != value or value in (_INF, -_INF):
            raise _BadValue(f"{value!r} is not valid JSON (NaN/Infinity)")
        return value
    if kind is dict:
        items = value.items()
    elif kind is list or kind is tuple:
        items = enumerate(value)
    else:
        raise _BadValue(f"a {kind.__name__} is not a JSON type")
    out = {} if kind is dict else []
    for k, v in items:
        if kind is dict:
            if type(k) is not str:
                raise _BadValue(f"key {k!r} is a {type(k).__name__}; JSON keys must be strings")
            if v is not None and is_secret_key(k):
                out[k] = REDACTED
                continue
        try:
            cleaned = _clean(v, values)
        except _BadValue as exc:
            exc.where.append(f".{k}" if kind is dict else f"[{k}]")
            raise
        if kind is dict:
            out[k] = cleaned
        else:
            out.append(cleaned)
    return out


def _clean_payload(payload, values):
    try:
        return _clean(payload, values)
    except _BadValue as exc:
        raise PayloadError(f"payload{''.join(reversed(exc.where))}: {exc.reason}; nothing was written") from None
    except RecursionError:
        raise PayloadError("payload is circular or nested too deeply; nothing was written") from None


_CONTAINERS = frozenset((dict, list, tuple))
_STR_ONLY = {str}


def _keys_are_strings(obj):
    """json.dumps turns 1 or None keys into strings silently; the ledger refuses them."""
    if type(obj) is dict:
        if obj and set(map(type, obj)) != _STR_ONLY:
            return False
        values = obj.values()
    else:
        values = obj
    if _CONTAINERS.isdisjoint(map(type, values)):
        return True
    return all(_keys_are_strings(v) for v in values if type(v) in _CONTAINERS)


# A literal screen over a serialized payload: a superset of what is_secret_key() can flag (every
# secret key name ends in one of these words) and of the secret shapes (each needs its trigger).
# Substring tests run at C speed; a hit only means the exact walk runs.
_KEY_SUFFIXES = ('key":', 'authorization":', 'password":', 'passwd":', 'secret":', 'token":', 'cookie":')


def _may_hold_secret(text, values):
    if _may_hold_shape(text):
        return True
    low = text.lower()
    for suffix in _KEY_SUFFIXES:
        if suffix in low:
            return True
    for value in values:
        if value in text:
            return True
    return False


def serialize_payload(payload, values=()):
    """(json_text, payload_as_stored). The common case -- nothing to redact -- is one C-level dumps and
    two scans of its output; anything suspicious takes the exact walk (_clean), which also names the
    place of a bad value."""
    try:
        text = _dumps(payload)
        fast = _keys_are_strings(payload) and not _may_hold_secret(text, values)
    except (TypeError, ValueError, RecursionError):
        fast = False
    if fast:
        return text, payload
    clean = _clean_payload(payload, values)
    return _dumps(clean), clean


_SCANNER = json.JSONDecoder().scan_once
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_dumps = _ENCODER.encode


# ----------------------------------------------------------------------------
# Low-level file helpers
# ----------------------------------------------------------------------------

def _fsync_dir(path):
    fd = os.open(str(Path(path).parent) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _scan_tail(fd, size):
    """(end, last_line): end is the offset just past the last '\\n', last_line the bytes of the
    last complete line without its newline (b"" when there is none). Reads from the end only."""
    buf, start, step = b"", size, 4096
    while True:
        nl = buf.rfind(b"\n")
        if nl != -1:
            before = buf.rfind(b"\n", 0, nl)
            if before != -1 or start == 0:
                return start + nl + 1, buf[before + 1:nl]
        elif start == 0:
            return 0, b""
        read_from = max(0, start - step)
        buf = os.pread(fd, start - read_from, read_from) + buf
        start = read_from
        step *= 4


def _read_first_line(fd, limit=MAX_LINE_BYTES + 1):
    buf, pos = b"", 0
    while len(buf) < limit:
        chunk = os.pread(fd, 65536, pos)
        if not chunk:
            return None
        nl = chunk.find(b"\n")
        if nl != -1:
            return buf + chunk[:nl]
        buf += chunk
        pos += len(chunk)
    return None


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]


# ----------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------

class Ledger:
    """An append-only ledger file. Safe to share between threads, processes and objects:
    every append takes an exclusive flock and derives seq and prev from the file itself."""

    def __init__(self, path, run_id=None, *, key=None, fsync=True, max_line_bytes=MAX_LINE_BYTES,
                 secrets=(), clock=utc_now):
        self.path = Path(path)
        self.run_id = run_id or new_run_id()
        if not _RUN_ID_RE.match(self.run_id):
            raise LedgerError(f"bad run id {self.run_id!r}: letters, digits and _.:- only, at most 128")
        self.key = _key_bytes(key) if key is not None else key_from_env()
        self.fsync = fsync
        self.max_line_bytes = max_line_bytes
        self.extra_secrets = tuple(s for s in secrets if s)
        self._set_secret_values()
        self.clock = clock  # returns `at`; replaceable for importing history and for tests
        self.head = None  # (seq, hash) of the last line this object wrote
        self._fd = None
        self._mode_checked = False

    def _set_secret_values(self):
        """Read the secret env values once (not per append), with their JSON-escaped forms for the
        screen that runs over serialized payloads."""
        self._secret_values = secret_values(self.extra_secrets)
        escaped = {_dumps(v)[1:-1] for v in self._secret_values}
        self._screen_values = tuple(set(self._secret_values) | escaped)

    def add_secret(self, value):
        """Mask this exact value too (an API key passed as an argument rather than in the env)."""
        if value and value not in self.extra_secrets:
            self.extra_secrets += (value,)
            self._set_secret_values()

    # -- context manager -------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- writing ---------------------------------------------------------
    def _open(self):
        if self._fd is None:
            created = not self.path.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            if created and self.fsync:
                _fsync_dir(self.path)
        return self._fd

    def _check_mode(self, fd):
        """Refuse to mix keyed and unkeyed lines in one file (checked once per object)."""
        first = _read_first_line(fd)
        if first is None:  # empty: the line we are about to write sets the mode
            self._mode_checked = True
            return
        try:
            prev = json.loads(first)["prev"]
        except (ValueError, KeyError, TypeError):
            raise IntegrityError(self.path, 1, "line 1 is not a ledger line; refusing to append") from None
        if prev == GENESIS and self.key:
            raise LedgerError(f"{self.path}: ledger is not keyed but a key was given ({KEY_ENV}); "
                              f"refusing to mix keyed and unkeyed lines")
        if prev != GENESIS and not self.key:
            raise KeyRequiredError(self.path)
        if self.key and prev != _genesis(self.key):
            raise IntegrityError(self.path, 1, "prev is not the HMAC of the empty string under this key "
                                               "(wrong key?); refusing to append")
        self._mode_checked = True

    def append(self, kind, payload=None):
        """Append one event and return it as written (payload redacted). Raises PayloadError
        (nothing written) for a bad kind or payload, LedgerError/OSError for file trouble."""
        if type(kind) is not str or not _KIND_RE.match(kind):
            raise PayloadError(f"bad kind {kind!r}: lower-case [a-z][a-z0-9_.]*")
        if payload is None:
            payload = {}
        if type(payload) is not dict:
            raise PayloadError(f"payload must be a JSON object, not a {type(payload).__name__}")
        payload_json, clean = serialize_payload(payload, self._screen_values)
        fd = self._open()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if not self._mode_checked:
                self._check_mode(fd)
            size = os.fstat(fd).st_size
            end, last = _scan_tail(fd, size)
            if end != size:
                end, last = self._recover_torn_tail(fd, size, end, last)
            return self._write_event(fd, end, last, kind, clean, payload_json)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _next(self, last):
        if not last:
            return 1, _genesis(self.key)
        match = _SEQ_PREFIX_RE.match(last)  # seq leads every line: no need to parse a 1 MiB line
        if not match:
            raise IntegrityError(self.path, None, "the last line is not a ledger line; refusing to append "
                                                  "(run verify)")
        return int(match.group(1)) + 1, line_hash(last, self.key)

    def _write_event(self, fd, size, last, kind, clean, payload_json):
        seq, prev = self._next(last)
        at = self.clock()
        if self.clock is not utc_now and not (type(at) is str and _AT_RE.match(at)):
            raise LedgerError(f"clock returned {at!r}, not YYYY-MM-DDTHH:MM:SS.ffffffZ")
        # run_id, kind, at and prev are validated plain ASCII: this is exactly what json.dumps would write
        raw = ('{"seq":%d,"run_id":"%s","kind":"%s","at":"%s","payload":%s,"prev":"%s"}'
               % (seq, self.run_id, kind, at, payload_json, prev)).encode("utf-8")
        if len(raw) + 1 > self.max_line_bytes:
            raise PayloadError(f"event is {len(raw) + 1} bytes, over the {self.max_line_bytes}-byte line limit; "
                               f"store large bodies with store_artifact()")
        try:
            _write_all(fd, raw + b"\n")
            if self.fsync:
                os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)  # never leave half a line behind us
            raise
        self.head = (seq, line_hash(raw, self.key))
        return {"seq": seq, "run_id": self.run_id, "kind": kind, "at": at, "payload": clean, "prev": prev}

    def _recover_torn_tail(self, fd, size, end, last):
        fragment = os.pread(fd, size - end, end)
        digest = hashlib.sha256(fragment).hexdigest()
        sidecar = Path(str(self.path) + ".torn")
        header = f"torn offset={end} length={len(fragment)} sha256={digest} at={utc_now()}\n".encode()
        sfd = os.open(str(sidecar), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            _write_all(sfd, header + fragment + b"\n")
            os.fsync(sfd)
        finally:
            os.close(sfd)
        os.ftruncate(fd, end)
        if self.fsync:
            os.fsync(fd)
        recovered = {"offset": end, "length": len(fragment), "sha256": digest, "sidecar": sidecar.name}
        self._write_event(fd, end, last, "ledger_recovered", recovered, _dumps(recovered))
        return _scan_tail(fd, os.fstat(fd).st_size)

    def decide(self, stage, decision, rationale, alternatives=(), **extra):
        """Record a decision before acting on it: what, why, and what else was possible."""
        for name, value in (("stage", stage), ("decision", decision)):
            if not isinstance(value, str) or not value.strip():
                raise PayloadError(f"decide(): {name} must be a non-empty string")
        payload = {"stage": stage, "decision": decision, "rationale": rationale,
                   "alternatives": list(alternatives)}
        payload.update(extra)
        return self.append("decision", payload)

    def store_artifact(self, data, *, redact_secrets=True):
        """Write a body content-addressed under artifacts/ beside the ledger; return its reference."""
        return store_artifact(self.path.parent / "artifacts", data, redact_secrets=redact_secrets,
                              extra_secrets=self.extra_secrets)


def store_artifact(directory, data, *, redact_secrets=True, extra_secrets=()):
    """Store bytes or text as `directory/<sha256>` (dir 0700, file 0600), text redacted first.
    Returns {"sha256", "size", "path"} with path relative to the directory's parent."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if redact_secrets:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            data = redact_text(text, secret_values(extra_secrets)).encode("utf-8")
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()
    target = directory / digest
    if not target.exists():
        tmp = directory / f".{digest}.{os.getpid()}.tmp"
        fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(str(tmp), str(target))
        _fsync_dir(target)
    return {"sha256": digest, "size": len(data), "path": f"{directory.name}/{digest}"}


# ----------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------

class Run:
    """One run directory runs/<run_id>/ holding events.jsonl and artifacts/."""

    def __init__(self, runs_dir, run_id, ledger):
        self.runs_dir, self.run_id, self.ledger = Path(runs_dir), run_id, ledger
        self.dir = self.runs_dir / run_id
        self.closed = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.closed:
            self.close("error" if exc_type else "closed",
                       error=f"{exc_type.__name__}: {exc}" if exc_type else None)

    def append(self, kind, payload=None):
        return self.ledger.append(kind, payload)

    def decide(self, *args, **kwargs):
        return self.ledger.decide(*args, **kwargs)

    def store_artifact(self, data, **kwargs):
        return self.ledger.store_artifact(data, **kwargs)

    def close(self, outcome, **summary):
        """Append run_closed, then anchor this run's head in runs/index.jsonl."""
        payload = {"outcome": outcome}
        payload.update({k: v for k, v in summary.items() if v is not None})
        self.ledger.append("run_closed", payload)
        seq, digest = self.ledger.head
        with Ledger(self.runs_dir / INDEX_NAME, self.run_id, key=self.ledger.key,
                    fsync=self.ledger.fsync) as index:
            index.append("run_closed", {"run": self.run_id, "events": f"{self.run_id}/{EVENTS_NAME}",
                                        "head_seq": seq, "head_hash": digest, "outcome": outcome})
        self.ledger.close()
        self.closed = True
        return seq, digest


def open_run(runs_dir="runs", *, key=None, fsync=True, secrets=()):
    """Create runs_dir/<new run id>/ (never reused) and return a Run writing to its events.jsonl."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    while True:
        run_id = new_run_id()
        try:
            (runs_dir / run_id).mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
    ledger = Ledger(runs_dir / run_id / EVENTS_NAME, run_id, key=key, fsync=fsync, secrets=secrets)
    return Run(runs_dir, run_id, ledger)


# ----------------------------------------------------------------------------
# Reading and verifying
# ----------------------------------------------------------------------------

def _expected_run_id(path):
    """runs/<run id>/events.jsonl, as open_run() makes it, must hold only that run's events."""
    path = Path(path)
    if path.name == EVENTS_NAME and _OUR_RUN_ID_RE.match(path.parent.name):
        return path.parent.name
    return None


def _keyed_first_line(path, first_prev, key):
    if first_prev == GENESIS:
        if key:
            raise IntegrityError(path, 1, "ledger is not keyed but a key was given: "
                                          "a keyed ledger rewritten without its key looks like this")
    elif not key:
        raise KeyRequiredError(path)


def _line_error(path, lineno, body, event, expected_prev, run_id, key):
    """The precise reason why a line failed the fast check in iter_lines."""
    if event is None:
        if b"\x00" in body:
            return IntegrityError(path, lineno, "NUL byte in line")
        try:
            json.loads(body)
        except ValueError as exc:
            return IntegrityError(path, lineno, f"broken JSON: {exc}")
        return IntegrityError(path, lineno, "not in the ledger's compact form (white space around the JSON)")
    if type(event) is not dict:
        return IntegrityError(path, lineno, "line is not a JSON object")
    if tuple(event) != FIELDS:
        missing = [f for f in FIELDS if f not in event]
        return IntegrityError(path, lineno, f"missing field {missing[0]!r}" if missing else
                              f"fields must be exactly {', '.join(FIELDS)}, in that order")
    seq, rid, kind, at, payload, prev = (event[f] for f in FIELDS)
    if type(seq) is not int:
        return IntegrityError(path, lineno, f"seq is not an integer: {seq!r}")
    if seq != lineno:
        why = "duplicate or repeated seq" if seq < lineno else "gap in seq"
        return IntegrityError(path, lineno, f"expected seq {lineno}, got {seq} ({why})")
    if type(rid) is not str or not _RUN_ID_RE.match(rid):
        return IntegrityError(path, lineno, f"bad run_id {rid!r}")
    if run_id is not None and rid != run_id:
        return IntegrityError(path, lineno, f"run_id {rid!r} differs from the run directory's {run_id!r}")
    if type(kind) is not str or not _KIND_RE.match(kind):
        return IntegrityError(path, lineno, f"bad kind {kind!r}")
    if type(at) is not str or not _AT_RE.match(at):
        return IntegrityError(path, lineno, f"bad timestamp {at!r}")
    if type(payload) is not dict:
        return IntegrityError(path, lineno, "payload is not a JSON object")
    if type(prev) is not str:
        return IntegrityError(path, lineno, "prev is not a string")
    if lineno == 1:
        _keyed_first_line(path, prev, key)  # raises KeyRequiredError / keyed-vs-unkeyed mismatch
        return IntegrityError(path, 1, "prev is not the HMAC of the empty string under this key: "
                                       "wrong key, or line 1 was rewritten")
    return IntegrityError(path, lineno, f"prev does not match line {lineno - 1} "
                                        f"(a line was changed, removed, inserted or reordered)")


def iter_lines(path, *, key=None, run_id=None):
    """Yield (event, raw_line, line_hash) for each line, verifying seq, fields and the chain.
    A damaged line raises IntegrityError; a torn last line raises TornTailError after every good line
    was yielded.  `key=None` reads LEDGER_KEY; run_id defaults to the run directory's name."""
    key = _key_bytes(key) if key is not None else key_from_env()
    if run_id is None:
        run_id = _expected_run_id(path)
    scan, sha256, at_match, fields = _SCANNER, hashlib.sha256, _AT_RE.match, FIELDS
    expected_prev = _genesis(key)
    good_kinds, last_rid = set(), None
    lineno = offset = 0
    with open(path, "rb") as handle:
        for raw in handle:
            lineno += 1
            if raw[-1:] != b"\n":
                raise TornTailError(path, lineno, offset, len(raw), (lineno - 1, expected_prev))
            offset += len(raw)
            body = raw[:-1]
            # The C scanner behind json.loads, called directly: no encoding sniffing, no wrappers.
            try:
                text = body.decode("utf-8")
                event, end = scan(text, 0)
                if end != len(text):
                    event = None
            except (ValueError, StopIteration):
                event = None
            # One fast check per line; _line_error says exactly what is wrong when it fails.
            if (type(event) is not dict or tuple(event) != fields
                    or event["seq"] != lineno or type(event["seq"]) is not int
                    or event["prev"] != expected_prev
                    or type(event["payload"]) is not dict
                    or type(event["at"]) is not str or not at_match(event["at"])
                    or (event["kind"] not in good_kinds and not _kind_ok(event["kind"], good_kinds))
                    or (event["run_id"] != last_rid and not _run_id_ok(event["run_id"], run_id))):
                raise _line_error(path, lineno, body, event, expected_prev, run_id, key)
            last_rid = event["run_id"]
            expected_prev = (hmac.new(key, body, sha256) if key else sha256(body)).hexdigest()
            yield event, body, expected_prev


def _kind_ok(kind, good_kinds):
    if type(kind) is str and _KIND_RE.match(kind):
        good_kinds.add(kind)
        return True
    return False


def _run_id_ok(rid, run_id):
    return type(rid) is str and bool(_RUN_ID_RE.match(rid)) and (run_id is None or rid == run_id)


def read_events(path, *, key=None, run_id=None):
    """Stream the events of a ledger in order, verifying as it goes (constant memory)."""
    for event, _raw, _digest in iter_lines(path, key=key, run_id=run_id):
        yield event


class Verified:
    """The result of verify(): how many lines, and the head (seq, hash)."""

    def __init__(self, path, count, head):
        self.path, self.count, self.head = str(path), count, head

    def head_text(self):
        return f"{self.head[0]} {self.head[1]}"


def verify(path, *, key=None, expect_head=None, run_id=None):
    """Verify a whole ledger; return Verified, or raise IntegrityError/KeyRequiredError.
    `expect_head` = (seq, hash) published earlier: the file must still contain that exact line."""
    count, head = 0, None
    matched = False
    for event, _raw, digest in iter_lines(path, key=key, run_id=run_id):
        count = event["seq"]
        head = (count, digest)
        if expect_head and count == expect_head[0]:
            if digest != expect_head[1]:
                raise IntegrityError(path, count, "does not match the expected head: the history up to "
                                                  "the published head was rewritten")
            matched = True
    if head is None:
        head = (0, _genesis(_key_bytes(key) if key is not None else key_from_env()))
    if expect_head and not matched and expect_head[0] > 0:
        raise IntegrityError(path, count + 1 if count else None,
                             f"truncated: the expected head is seq {expect_head[0]} but the ledger "
                             f"ends at seq {count}")
    return Verified(path, count, head)


def verify_runs(runs_dir, *, key=None):
    """Verify runs/index.jsonl and every runs/*/events.jsonl, checking closed runs against the index.
    Yields (path, Verified or LedgerError)."""
    runs_dir = Path(runs_dir)
    index_path = runs_dir / INDEX_NAME
    closed = {}
    if index_path.exists():
        try:
            for event in read_events(index_path, key=key, run_id=None):
                if event["kind"] == "run_closed":
                    closed[event["payload"].get("run")] = event["payload"]
            yield index_path, verify(index_path, key=key)
        except LedgerError as exc:
            yield index_path, exc
    seen = set()
    for events in sorted(runs_dir.glob(f"*/{EVENTS_NAME}")):
        run_id = events.parent.name
        seen.add(run_id)
        entry = closed.get(run_id)
        try:
            expect = (entry["head_seq"], entry["head_hash"]) if entry else None
            yield events, verify(events, key=key, expect_head=expect)
        except (LedgerError, KeyError, TypeError) as exc:
            yield events, exc if isinstance(exc, LedgerError) else IntegrityError(index_path, None, str(exc))
    for run_id in sorted(set(closed) - seen):
        yield runs_dir / str(run_id) / EVENTS_NAME, IntegrityError(
            runs_dir / str(run_id) / EVENTS_NAME, None, "closed in the index but its events.jsonl is missing")


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def _err(message):
    print(f"error: {message}", file=sys.stderr)


def error_text(exc):
    """One line for an error: 'path: No such file or directory' for OSError, str() otherwise."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)


def parse_cli(parser, argv):
    """(args, None), or (None, exit code) when argparse printed help (0) or a usage error (2).
    Shared by the scripts so that every one of them exits 2 on bad usage."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:
        return None, (EXIT_USAGE if exc.code else EXIT_OK)


def parse_time(text, end=False):
    """A date (YYYY-MM-DD) or ISO time -> the ledger's `at` string form for comparing."""
    text = text.strip()
    try:
        if re.fullmatch(r"\d{4}-\d\d-\d\d", text):
            day = datetime.datetime.strptime(text, "%Y-%m-%d")
            if end:
                day += datetime.timedelta(days=1) - datetime.timedelta(microseconds=1)
            moment = day.replace(tzinfo=datetime.timezone.utc)
        else:
            moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        raise ValueError(f"not a date or ISO time: {text!r}") from None
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _cli_key(args):
    value = os.environ.get(args.key_env)
    if args.key_env != KEY_ENV and value is None:
        raise LedgerError(f"--key-env {args.key_env}: that environment variable is not set")
    return _key_bytes(value) or b""


def _cmd_verify(args):
    key = _cli_key(args)
    expect = None
    if args.expect_head:
        if len(args.paths) != 1 or args.all:
            raise ValueError("--expect-head goes with exactly one PATH")
        expect = parse_head(args.expect_head)
    results = []
    for path in args.paths:
        try:
            results.append((path, verify(path, key=key, expect_head=expect)))
        except (LedgerError, OSError) as exc:
            results.append((path, exc))
    if args.all:
        if not Path(args.all).is_dir():
            raise OSError(errno.ENOENT, f"--all: no such directory: {args.all}")
        results.extend(verify_runs(args.all, key=key))
    worst = EXIT_OK
    valid = 0
    for path, result in results:
        if isinstance(result, Verified):
            valid += 1
            print(f"ok    {path}  {result.count} lines  head {result.head_text()}")
        elif isinstance(result, IntegrityError):
            worst = max(worst, EXIT_INTEGRITY)
            print(f"FAIL  {result}")
        else:
            worst = EXIT_USAGE
            print(f"ERROR {path}: {error_text(result)}")
    print(f"{valid}/{len(results)} ledgers valid")
    if worst == EXIT_USAGE:
        _err("some ledgers could not be read or need a key")
    elif worst == EXIT_INTEGRITY:
        _err("integrity check failed")
    return worst


def _cmd_head(args):
    result = verify(args.path, key=_cli_key(args))
    print(result.head_text())
    return EXIT_OK


def _event_summary(event):
    payload = event["payload"]
    parts = [event["at"], f"#{event['seq']}", event["kind"]]
    for name in ("stage", "decision", "outcome", "request_model", "response_model", "tool", "verdict",
                 "error_type", "error"):
        value = payload.get(name)
        if value not in (None, "", [], {}):
            parts.append(f"{name}={value}")
    if payload.get("rationale"):
        parts.append(f"-- {payload['rationale']}")
    return "  ".join(str(p).replace("\n", " ") for p in parts)


def _cmd_report(args):
    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until, end=True) if args.until else None
    out = sys.stdout
    for event, raw, _digest in iter_lines(args.path, key=_cli_key(args), run_id=None):
        if args.kind and event["kind"] not in args.kind:
            continue
        if args.stage and event["payload"].get("stage") != args.stage:
            continue
        if args.run and not event["run_id"].startswith(args.run):
            continue
        if (since and event["at"] < since) or (until and event["at"] > until):
            continue
        if args.json:
            out.write(raw.decode("utf-8") + "\n")
        else:
            out.write(_event_summary(event) + "\n")
    return EXIT_OK


def _cmd_append(args):
    if args.payload is not None:
        text = args.payload
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        text = ""
    try:
        payload = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise PayloadError(f"payload is not valid JSON: {exc}") from None
    if type(payload) is not dict:
        raise PayloadError("payload must be a JSON object")
    run_id = args.run_id or os.environ.get("LEDGER_RUN_ID") or None
    key = _cli_key(args)
    with Ledger(args.path, run_id, key=key) as ledger:
        ledger.append(args.kind, payload)
        print(f"{ledger.head[0]} {ledger.head[1]}")
    return EXIT_OK


def _build_parser():
    parser = argparse.ArgumentParser(prog="reasoning_ledger.py",
                                     description="Append-only, hash-chained JSONL ledger.")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def keyed(p):
        p.add_argument("--key-env", default=KEY_ENV, metavar="NAME",
                       help=f"environment variable holding the HMAC key (default {KEY_ENV})")
        return p

    p = keyed(sub.add_parser("verify", help="check ledgers; exit 1 on any integrity failure"))
    p.add_argument("paths", nargs="*", metavar="PATH")
    p.add_argument("--all", metavar="RUNS_DIR", help="also every run in RUNS_DIR, against RUNS_DIR/index.jsonl")
    p.add_argument("--expect-head", metavar="SEQ:HASH", help="a head published earlier (detects truncation)")
    p.set_defaults(func=_cmd_verify)

    p = keyed(sub.add_parser("head", help="print the anchor 'SEQ HASH' of a verified ledger"))
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=_cmd_head)

    p = keyed(sub.add_parser("report", help="one readable line per event"))
    p.add_argument("path", metavar="PATH")
    p.add_argument("--kind", action="append", help="only this kind (repeatable)")
    p.add_argument("--stage", help="only decisions of this stage")
    p.add_argument("--run", help="only this run id (or prefix)")
    p.add_argument("--since", help="date or ISO time (UTC)")
    p.add_argument("--until", help="date (inclusive) or ISO time (UTC)")
    p.add_argument("--json", action="store_true", help="print the matching lines unchanged")
    p.set_defaults(func=_cmd_report)

    p = keyed(sub.add_parser("append", help="append one event; prints the new head"))
    p.add_argument("path", metavar="PATH")
    p.add_argument("--kind", required=True)
    p.add_argument("--run-id", help="default: $LEDGER_RUN_ID or a new id")
    p.add_argument("--payload", help="a JSON object (default: stdin when it is not a terminal)")
    p.set_defaults(func=_cmd_append)
    return parser


def main(argv=None):
    parser = _build_parser()
    args, code = parse_cli(parser, argv)
    if args is None:
        return code
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "verify" and not args.paths and not args.all:
        _err("verify needs a PATH or --all RUNS_DIR")
        return EXIT_USAGE
    try:
        return args.func(args)
    except TornTailError as exc:
        _err(str(exc))
        return EXIT_INTEGRITY
    except IntegrityError as exc:
        _err(str(exc))
        return EXIT_INTEGRITY
    except (LedgerError, ValueError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    except OSError as exc:
        _err(error_text(exc))
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
