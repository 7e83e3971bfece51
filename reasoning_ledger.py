#!/usr/bin/env python3
"""reasoning_ledger.py -- an append-only, hash-chained JSONL ledger. Standard library only.

Usage:
  python reasoning_ledger.py verify PATH... [--all RUNS_DIR] [--expect-head SEQ:HASH] [--key-env NAME]
  python reasoning_ledger.py head PATH [--key-env NAME]
  python reasoning_ledger.py report PATH [--kind K] [--stage S] [--run R] [--since T] [--until T] [--json]
  python reasoning_ledger.py append PATH --kind K [--run-id R] [--payload JSON | < payload.json]

Library (copy this one file next to your code):
  from reasoning_ledger import Ledger, open_run, read_events, verify
  with Ledger("calls.jsonl", run_id="nightly") as ledger:
      ledger.decide("plan", "run tests first", "cheapest signal", ["read code"])
      ledger.append("note", {"text": "hello"})

Exit codes are shared by every script of the toolkit: see EXIT_CODES.
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
import threading
import time
import weakref
from pathlib import Path

__version__ = "1.1.0"

__all__ = [
    # the ledger
    "Ledger", "Run", "open_run", "store_artifact", "read_events", "iter_lines", "verify", "verify_runs",
    "Verified", "line_hash", "parse_head", "new_run_id", "utc_now", "key_from_env",
    # redaction
    "Redactor", "redact_text", "secret_values", "is_secret_key", "REDACTED",
    # errors
    "LedgerError", "UsageError", "PayloadError", "KeyRequiredError", "IntegrityError", "TornTailError",
    "OutputError",
    # the command line, shared by the toolkit's scripts
    "EXIT_CODES", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_CHECK", "EXIT_CHANGED", "EXIT_OUTPUT",
    "EXIT_LOCKED", "EXIT_BUDGET", "EXIT_PROPOSAL", "error", "warn", "write_out", "printable",
    "error_text", "run_cli", "parse_cli", "parse_time",
    # format constants
    "FORMAT_VERSION", "FIELDS", "GENESIS", "MAX_LINE_BYTES", "MAX_DEPTH", "KEY_ENV", "INDEX_NAME",
    "EVENTS_NAME",
]

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

FORMAT_VERSION = 1
FIELDS = ("seq", "run_id", "kind", "at", "payload", "prev")
GENESIS = "0" * 64
MAX_LINE_BYTES = 1024 * 1024  # a line, newline included, is at most this long: the format's limit
MAX_DEPTH = 64                # nesting levels of a payload; the payload object itself is level 1
KEY_ENV = "LEDGER_KEY"
REDACTED = "[REDACTED]"
SECRET_ENV_VARS = ("API_KEY", "OPENAI_API_KEY", "WEBHOOK_SECRET", "LEDGER_KEY")
REDACT_ENV_LIST = "LEDGER_REDACT_ENV"
MIN_SECRET_CHARS = 8  # shorter env values ("none", "test") are too common to mask by value
INDEX_NAME = "index.jsonl"
EVENTS_NAME = "events.jsonl"

# One exit-code table for every script of the toolkit.
EXIT_OK = 0        # done
EXIT_FAILED = 1    # what was checked or asked for failed: an integrity failure, a failed call, an agent error
EXIT_USAGE = 2     # usage, configuration or I/O error: nothing was done
EXIT_CHECK = 3     # an answer came back but a check failed (ask.py); the judge rejected the proposal (agent.py)
EXIT_CHANGED = 4   # audit.py --fail-on-change found changes
EXIT_OUTPUT = 5    # the result could not be written to stdout (closed, full, not encodable); it was recorded
EXIT_LOCKED = 6    # agent.py: another run holds the repository's lock
EXIT_BUDGET = 7    # agent.py: the budget ran out before an accepted proposal
EXIT_PROPOSAL = 8  # agent.py: a proposal was accepted by the judge and written for a human to review
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_FAILED: "failed: integrity failure (verify, audit, ship), failed call (ask), error outcome (agent)",
    EXIT_USAGE: "usage, configuration or I/O error; nothing was done",
    EXIT_CHECK: "answer received but a check failed (ask); proposal rejected by the judge (agent)",
    EXIT_CHANGED: "changes found with --fail-on-change (audit)",
    EXIT_OUTPUT: "stdout could not be written; the result was recorded",
    EXIT_LOCKED: "another run holds the repository's lock (agent)",
    EXIT_BUDGET: "budget exhausted (agent)",
    EXIT_PROPOSAL: "proposal accepted by the judge, waiting for review (agent)",
}

_KIND_RE = re.compile(r"[a-z][a-z0-9_.]*\Z")
_AT_RE = re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
                    r"\.[0-9]{6}Z\Z")
_OUR_RUN_ID_RE = re.compile(r"[0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[0-9a-f]{8}\Z")
_HEX64_RE = re.compile(r"[0-9a-f]{64}\Z")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
_SEQ_PREFIX_RE = re.compile(rb'\{"seq":([1-9][0-9]*),')
_PREV_SUFFIX_RE = re.compile(rb',"prev":"([0-9a-f]{64})"\}\Z')
_INT_LIMIT = 10 ** 4300  # Python 3.11+ refuses to print longer ints; a line must read back everywhere


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------

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
        super().__init__(f"{path}: ledger is keyed (line 1's prev is not all zeros); "
                         f"a key is needed: set {KEY_ENV} or pass --key-env NAME")


class IntegrityError(LedgerError):
    """The file is not a valid ledger: names the file, the line and the reason."""
    exit_code = EXIT_FAILED

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


class OutputError(LedgerError):
    """stdout could not be written (closed, full, or unable to encode the text)."""
    exit_code = EXIT_OUTPUT


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


_valid_days = set()


def _at_ok(at):
    """`at` as the writer writes it: the exact shape, ASCII digits, and a date that exists."""
    if type(at) is not str or not _AT_RE.match(at):
        return False
    day = at[:10]
    if day not in _valid_days:
        try:
            datetime.date(int(day[:4]), int(day[5:7]), int(day[8:10]))
        except ValueError:
            return False
        if len(_valid_days) < 100000:
            _valid_days.add(day)
    return True


def _key_bytes(key):
    if key is None or key == b"" or key == "":
        return None
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def key_from_env(name=KEY_ENV):
    """The HMAC key in environment variable `name`, or None."""
    return _key_bytes(os.environ.get(name))


def _resolve_key(key):
    """key=None reads LEDGER_KEY; b"" or "" means explicitly unkeyed."""
    return _key_bytes(key) if key is not None else key_from_env()


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
    if len(parts) != 2 or not re.fullmatch(r"[0-9]+", parts[0]) or not _HEX64_RE.match(parts[1].lower()):
        raise UsageError(f"not a ledger head (want SEQ:HASH): {printable(text)!r}")
    return int(parts[0]), parts[1].lower()


# ----------------------------------------------------------------------------
# Redaction
# ----------------------------------------------------------------------------

# A key name is split into segments on "_", "-", "." and camelCase; it names a secret when its last
# segment is one of these words, or its last two are one of these pairs. input_tokens, max_tokens and
# token_count end in other words and stay.
_SECRET_WORDS = frozenset(("token", "secret", "password", "passwd", "passphrase", "credential", "credentials",
                           "apikey", "session", "cookie", "authorization"))
_SECRET_PAIRS = frozenset((("api", "key"), ("private", "key"), ("access", "key")))
# Query and fragment parameters that carry a secret although their names end in another word.
_SECRET_PARAMS = frozenset(("key", "code", "sig", "signature", "auth", "pwd", "pass"))
_AUTH_SCHEMES = frozenset(("bearer", "basic"))
_SEGMENT_RE = re.compile(r"[_\-.]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")

_secret_key_cache = {}


def is_secret_key(name):
    """True when a key name (a payload key, an env var, a query parameter) names a secret."""
    found = _secret_key_cache.get(name)
    if found is None:
        segments = [s.lower() for s in _SEGMENT_RE.split(name) if s]
        found = bool(segments) and (segments[-1] in _SECRET_WORDS or tuple(segments[-2:]) in _SECRET_PAIRS)
        if len(_secret_key_cache) < 4096:
            _secret_key_cache[name] = found
    return found


def _credential_like(text):
    """A word that looks like a credential rather than prose: 8+ characters with a digit, a capital after
    the first letter or token punctuation, or 20+ characters of anything."""
    text = text.rstrip(".")
    if len(text) < 8:
        return False
    return (len(text) >= 20 or any(c.isdigit() for c in text) or any(c.isupper() for c in text[1:])
            or any(c in "_~+/=" for c in text))


def _random_looking(text):
    """A URL user part that is a token, not a login name: long, with letters and digits."""
    return len(text) >= 16 and any(c.isdigit() for c in text) and any(c.isalpha() for c in text)


def _mask_scheme(m):
    return m.group(1) + m.group(2) + REDACTED if _credential_like(m.group(3)) else m.group(0)


def _mask_userinfo(m):
    userinfo = m.group(2)
    return m.group(1) + REDACTED + "@" if ":" in userinfo or _random_looking(userinfo) else m.group(0)


def _mask_param(m):
    name = m.group(2)
    secret = is_secret_key(name) or name.lower() in _SECRET_PARAMS or name.lower().replace("-", "_") in (
        "x_amz_signature", "x_goog_signature")
    return m.group(1) + name + "=" + REDACTED if secret and m.group(3) != REDACTED else m.group(0)


def _mask_assignment(m):
    double, single, bare = m.group(3, 4, 5)
    value = next(v for v in (double, single, bare) if v is not None)
    if not is_secret_key(m.group(1)) or value in ("", REDACTED) or value.lower() in _AUTH_SCHEMES:
        return m.group(0)
    quote = '"' if double is not None else "'" if single is not None else ""
    return m.group(1) + m.group(2) + quote + REDACTED + quote


# Secret shapes masked inside any string, each a (pattern, replacement). Order matters only in that
# earlier masks are left alone by later ones.
_SHAPES = (
    (r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S, REDACTED),
    (r"(?i)\b((?:set-)?cookie|(?:proxy-)?authorization)([ \t]*:[ \t]*)(?!\[REDACTED\])\S[^\r\n]*", 0,
     lambda m: m.group(1) + m.group(2) + REDACTED),
    (r"\b(bearer|basic)(\s+)([A-Za-z0-9._~+/=-]+)", re.I, _mask_scheme),
    (r"\bsk-[A-Za-z0-9_-]{8,}", 0, REDACTED),
    (r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})", 0, REDACTED),
    (r"\bxox[abposr]-[A-Za-z0-9-]{8,}", 0, REDACTED),
    (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0, REDACTED),
    (r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,31}://)([^\s/?#\"'<>]+)@", 0, _mask_userinfo),
    (r"([?&;#])([A-Za-z0-9_.\[\]-]{1,64})=([^&#\s\"'<>]+)", 0, _mask_param),
    (r"\b([A-Za-z][A-Za-z0-9_.-]{0,63})([\"']?[ \t]*[:=][ \t]*)(?:\"([^\"\r\n]*)\"|'([^'\r\n]*)'|([^\s\"',;&]+))",
     0, _mask_assignment),
)
# Every shape above needs one of these (lower-case) substrings to match; a string without any of them,
# and without a secret value, is left as it is without running a single shape.
_TRIGGERS = ("cookie", "authorization", "bearer", "basic", "sk-", "gh", "xox", "akia", "asia",
             "@", "=", "token", "secret", "pass", "credential", "key", "session")
_compiled_shapes = []


def _shapes():
    if not _compiled_shapes:  # compiled on first use: `python ask.py` compiles none it does not need
        _compiled_shapes.extend((re.compile(src, flags), repl) for src, flags, repl in _SHAPES)
    return _compiled_shapes


class Redactor:
    """Masks known secret values, secret shapes (tokens, credentials in URLs, key=value assignments)
    and, in payloads, whole values under secret key names."""

    def __init__(self, values=()):
        self.values = tuple(sorted({v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_CHARS},
                                   key=len, reverse=True))  # longest first: a secret holding another goes whole
        self._screen = None
        self._keys = {}

    def key(self, name):
        """A payload key with secret values and shapes masked (keys repeat, so the answer is kept)."""
        masked = self._keys.get(name)
        if masked is None:
            masked = self.text(name)
            if len(self._keys) < 4096:
                self._keys[name] = masked
        return masked

    def screen(self):
        """One case-insensitive regex that finds every trigger and every secret value: the fast test."""
        if self._screen is None:
            self._screen = re.compile("|".join([re.escape(v) for v in self.values]
                                               + [re.escape(t) for t in _TRIGGERS]), re.I)
        return self._screen

    def text(self, text):
        """`text` with every secret masked."""
        if self.screen().search(text) is None:
            return text
        return self.exact(text)

    def exact(self, text):
        """The masking itself, without the screen (the tests check that the screen never changes it)."""
        for value in self.values:
            if value in text:
                text = text.replace(value, REDACTED)
        for pattern, repl in _shapes():
            text = pattern.sub(repl, text)
        return text


def secret_values(extra=()):
    """The exact secret strings to mask: our env vars, every env var whose name names a secret
    (GITHUB_TOKEN, DB_PASSWORD...), those listed in LEDGER_REDACT_ENV, and `extra`."""
    listed = {n.strip() for n in os.environ.get(REDACT_ENV_LIST, "").split(",") if n.strip()}
    values = {value for name, value in os.environ.items()
              if name in SECRET_ENV_VARS or name in listed or is_secret_key(name)}
    values.update(v for v in extra if v)
    return sorted((v for v in values if len(v) >= MIN_SECRET_CHARS), key=len, reverse=True)


def redact_text(text, values=None):
    """Mask secret shapes and known secret values inside one string."""
    return Redactor(secret_values() if values is None else values).text(text)


class _BadValue(Exception):
    def __init__(self, reason):
        super().__init__(reason)
        self.reason, self.where = reason, []


def _clean(value, redactor, depth):
    """Check that `value` is plain JSON within MAX_DEPTH and return a redacted copy. Raises _BadValue.
    The one check for every payload: exact types only, so a Counter or an int key is refused every time."""
    kind = type(value)
    if kind is dict:
        items = value.items()
    elif kind is list or kind is tuple:
        items = enumerate(value)
    else:
        return _clean_scalar(value, redactor)
    if depth > MAX_DEPTH:
        raise _BadValue(f"nested deeper than {MAX_DEPTH} levels (or circular)")
    is_dict = kind is dict
    out = {} if is_dict else []
    text, mask_key = redactor.text, redactor.key
    for k, v in items:
        try:
            if is_dict:
                if type(k) is not str:
                    raise _BadValue(f"key {k!r} is a {type(k).__name__}; JSON keys must be strings")
                name = mask_key(k)
                while name in out:  # two keys that mask to the same text both stay
                    name += "~"
                if v is not None and type(v) is not bool and is_secret_key(k):
                    out[name] = REDACTED
                    continue
            t = type(v)
            if t is str:
                v = text(v)
            elif t is dict or t is list or t is tuple:
                v = _clean(v, redactor, depth + 1)
            elif not (t is bool or v is None):
                v = _clean_scalar(v, redactor)
        except _BadValue as exc:
            exc.where.append(f".{k}" if is_dict and type(k) is str else f"[{k!r}]")
            raise
        if is_dict:
            out[name] = v
        else:
            out.append(v)
    return out


def _clean_scalar(value, redactor):
    kind = type(value)
    if kind is str:
        return redactor.text(value)
    if kind is int:
        if not -_INT_LIMIT < value < _INT_LIMIT:
            raise _BadValue("an integer longer than 4300 digits cannot be read back on Python 3.11+")
        return value
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise _BadValue(f"{value!r} is not valid JSON (NaN/Infinity)")
        return value
    if kind is bool or value is None:
        return value
    raise _BadValue(f"a {kind.__name__} is not a JSON type")


def _clean_payload(payload, redactor):
    """(payload_as_stored, its JSON text) or PayloadError naming the place."""
    try:
        clean = _clean(payload, redactor, 1)
    except _BadValue as exc:
        where = list(reversed(exc.where))
        if len(where) > 8:
            where = where[:4] + ["…"] + where[-2:]
        raise PayloadError(f"payload{''.join(where)}: {exc.reason}; nothing was written") from None
    text = _dumps(clean)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(f"payload holds a lone surrogate ({text[exc.start:exc.end]!a}), which is not "
                           f"UTF-8; nothing was written") from None
    return clean, text


_SCANNER = json.JSONDecoder().scan_once
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False, check_circular=False)
_dumps = _ENCODER.encode


# ----------------------------------------------------------------------------
# Low-level file helpers
# ----------------------------------------------------------------------------

def _named(exc, path):
    """The same OSError, naming `path` when it names no file."""
    if isinstance(exc, OSError) and not exc.filename:
        return OSError(exc.errno, exc.strerror or str(exc), str(path))
    return exc


def _fsync_dir(path):
    fd = os.open(str(Path(path).parent) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rfind_newline(fd, stop, limit):
    """Offset of the last b"\\n" before `stop`; -1 when the file's start comes first; None when none is
    within `limit` bytes. Reads backwards in growing chunks, never more than `limit` in all."""
    pos, step = stop, 4096
    while pos > 0:
        if stop - pos >= limit:
            return None
        start = max(0, pos - step, stop - limit)
        i = os.pread(fd, pos - start, start).rfind(b"\n")
        if i != -1:
            return start + i
        pos, step = start, min(step * 4, 1 << 20)
    return -1


def _scan_tail(fd, size, path):
    """(end, last_line): end is the offset just past the last '\\n' (0 when none), last_line the bytes
    of the last complete line without its newline (b"" when there is none, None when it is longer than
    any line of the format). Reads from the end only, at most two lines' worth."""
    last_nl = _rfind_newline(fd, size, MAX_LINE_BYTES)
    if last_nl is None:
        raise IntegrityError(path, None, f"the file ends in more than {MAX_LINE_BYTES} bytes without a newline, "
                                         f"more than any line of the format; refusing to append")
    if last_nl == -1:
        return 0, b""
    prev_nl = _rfind_newline(fd, last_nl, MAX_LINE_BYTES)
    if prev_nl is None:
        return last_nl + 1, None
    return last_nl + 1, os.pread(fd, last_nl - prev_nl - 1, prev_nl + 1)


def _read_first_line(fd, limit=MAX_LINE_BYTES):
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

_LIVE_LEDGERS = weakref.WeakSet()


def _after_fork_in_child():
    # A fork copies the fd (one open file description: its flock would be shared with the parent) and
    # the thread lock (maybe held by a thread that does not exist here). Start both afresh.
    for ledger in list(_LIVE_LEDGERS):
        ledger._lock = threading.Lock()
        if ledger._fd is not None:
            try:
                os.close(ledger._fd)
            except OSError:
                pass
            ledger._fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Ledger:
    """An append-only ledger file. Safe to share between threads, processes (forked or not) and
    objects: every append holds a thread lock and an exclusive flock, and derives seq and prev from
    the file itself."""

    def __init__(self, path, run_id=None, *, key=None, fsync=True, max_line_bytes=MAX_LINE_BYTES,
                 secrets=(), clock=utc_now):
        self.path = Path(path)
        self.run_id = run_id or new_run_id()
        if type(self.run_id) is not str or not _RUN_ID_RE.match(self.run_id):
            raise UsageError(f"bad run id {printable(self.run_id)!r}: letters, digits and _.:- only, at most 128")
        if not 0 < max_line_bytes <= MAX_LINE_BYTES:
            raise UsageError(f"max_line_bytes must be between 1 and {MAX_LINE_BYTES} (the format's limit)")
        self.key = _resolve_key(key)
        self.fsync = fsync
        self.max_line_bytes = max_line_bytes
        self.extra_secrets = tuple(s for s in secrets if s)
        self.redactor = Redactor(secret_values(self.extra_secrets))  # env read once, not per append
        self.clock = clock  # returns `at`; replaceable for importing history and for tests
        self.head = None  # (seq, hash) of the last line this object wrote
        self._fd = None
        self._mode_checked = False
        self._lock = threading.Lock()
        _LIVE_LEDGERS.add(self)

    def add_secret(self, value):
        """Mask this exact value too (an API key passed as an argument rather than in the env)."""
        if value and value not in self.extra_secrets:
            self.extra_secrets += (value,)
            self.redactor = Redactor(self.redactor.values + (value,))

    # -- context manager -------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        with self._lock:
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

    def _locked(self, work):
        """Run work(fd) holding the thread lock and the file's exclusive flock. I/O errors name the file."""
        with self._lock:
            try:
                fd = self._open()
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    if not self._mode_checked:
                        self._check_mode(fd)
                    return work(fd)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError as exc:
                raise _named(exc, self.path) from None

    def _check_mode(self, fd):
        """Refuse to mix keyed and unkeyed lines in one file (checked once per object)."""
        first = _read_first_line(fd)
        if first is None:  # empty (or one torn fragment): the line we are about to write sets the mode
            return
        match = _PREV_SUFFIX_RE.search(first)
        if not match or not _SEQ_PREFIX_RE.match(first):
            raise IntegrityError(self.path, 1, "line 1 is not a ledger line; refusing to append")
        prev = match.group(1).decode()
        if prev == GENESIS and self.key:
            raise UsageError(f"{self.path}: ledger is not keyed but a key was given ({KEY_ENV}); "
                             f"refusing to mix keyed and unkeyed lines")
        if prev != GENESIS and not self.key:
            raise KeyRequiredError(self.path)
        if self.key and prev != _genesis(self.key):
            raise IntegrityError(self.path, 1, "prev is not the HMAC of the empty string under this key "
                                               "(wrong key?); refusing to append")
        self._mode_checked = True

    def check(self):
        """Check, under the lock, that the next append can succeed: the file opens, line 1 agrees with
        the key, and the last line is a ledger line. Writes nothing; returns the file's head (seq, hash).
        A torn tail is not an error here: the next append recovers it."""
        def tail(fd):
            end, last = _scan_tail(fd, os.fstat(fd).st_size, self.path)
            seq, prev = self._next(end, last)
            return seq - 1, prev
        return self._locked(tail)

    def append(self, kind, payload=None):
        """Append one event and return it as written (payload redacted). Raises PayloadError
        (nothing written) for a bad kind or payload, LedgerError/OSError for file trouble."""
        if type(kind) is not str or not _KIND_RE.match(kind):
            raise PayloadError(f"bad kind {printable(kind)!r}: lower-case [a-z][a-z0-9_.]*")
        if payload is None:
            payload = {}
        if type(payload) is not dict:
            raise PayloadError(f"payload must be a JSON object (a dict), not a {type(payload).__name__}; "
                               f"nothing was written")
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
        if last is None:
            raise IntegrityError(self.path, None, f"the last line is longer than {MAX_LINE_BYTES} bytes, "
                                                  f"so no writer of this format wrote it; refusing to append")
        if not last:
            if end:
                raise IntegrityError(self.path, None, "the last line is blank; a ledger has no blank lines, and "
                                                      "taking it for an empty file would restart at seq 1; "
                                                      "refusing to append (run verify)")
            return 1, _genesis(self.key)
        match = _SEQ_PREFIX_RE.match(last)  # seq leads every line: no need to parse a 1 MiB line
        if not match:
            what = "white space only" if not last.strip() else "not a ledger line"
            raise IntegrityError(self.path, None, f"the last line is {what}; refusing to append (run verify)")
        return int(match.group(1)) + 1, line_hash(last, self.key)

    def _write_event(self, fd, size, last, kind, clean, payload_json):
        seq, prev = self._next(size, last)
        at = self.clock()
        if self.clock is not utc_now and not _at_ok(at):
            raise UsageError(f"clock returned {printable(at)!r}, not a real YYYY-MM-DDTHH:MM:SS.ffffffZ time")
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
        try:
            sfd = os.open(str(sidecar), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                before = os.fstat(sfd).st_size
                try:
                    _write_all(sfd, header + fragment + b"\n")
                    os.fsync(sfd)
                except OSError:
                    os.ftruncate(sfd, before)  # no half record in the sidecar
                    raise
            finally:
                os.close(sfd)
        except OSError as exc:
            raise _named(exc, sidecar) from None
        os.ftruncate(fd, end)
        if self.fsync:
            os.fsync(fd)
        recovered = {"offset": end, "length": len(fragment), "sha256": digest, "sidecar": sidecar.name}
        self._write_event(fd, end, last, "ledger_recovered", recovered, _dumps(recovered))
        return _scan_tail(fd, os.fstat(fd).st_size, self.path)

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
                              redactor=self.redactor)


def store_artifact(directory, data, *, redact_secrets=True, extra_secrets=(), redactor=None):
    """Store bytes or text as `directory/<sha256>` (dir 0700, file 0600), UTF-8 text redacted first.
    Safe from many threads and processes at once. Returns {"sha256", "size", "path"}, the path
    relative to the directory's parent."""
    if isinstance(data, str):
        data = data.encode("utf-8", "backslashreplace")  # a lone surrogate stays visible as \\udXXX
    if redact_secrets:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            redactor = redactor or Redactor(secret_values(extra_secrets))
            data = redactor.text(text).encode("utf-8")
    directory = Path(directory)
    digest = hashlib.sha256(data).hexdigest()
    target = directory / digest
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not target.exists():
            # unique per writer: threads of one process storing the same body must not share a temp file
            tmp = directory / f".{digest[:16]}.{os.getpid()}.{threading.get_ident()}.{os.urandom(4).hex()}.tmp"
            fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except OSError:
                os.close(fd)
                os.unlink(str(tmp))
                raise
            os.close(fd)
            os.replace(str(tmp), str(target))
            _fsync_dir(target)
    except OSError as exc:
        raise _named(exc, target) from None
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

    def add_secret(self, value):
        self.ledger.add_secret(value)

    def close(self, outcome, **summary):
        """Append run_closed, then anchor this run's head in runs/index.jsonl."""
        payload = {"outcome": outcome}
        payload.update({k: v for k, v in summary.items() if v is not None})
        self.ledger.append("run_closed", payload)
        seq, digest = self.ledger.head
        with Ledger(self.runs_dir / INDEX_NAME, self.run_id, key=self.ledger.key or b"", fsync=self.ledger.fsync,
                    secrets=self.ledger.extra_secrets) as index:
            index.append("run_closed", {"run": self.run_id, "events": f"{self.run_id}/{EVENTS_NAME}",
                                        "head_seq": seq, "head_hash": digest, "outcome": outcome})
        self.ledger.close()
        self.closed = True
        return seq, digest


def open_run(runs_dir="runs", *, run_id=None, key=None, fsync=True, secrets=()):
    """Create runs_dir/<run id>/ (never reused) and return a Run writing to its events.jsonl.
    A given `run_id` (allocated earlier, e.g. by the webhook daemon) must be new too."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if run_id is not None:
        if type(run_id) is not str or not _RUN_ID_RE.match(run_id):
            raise UsageError(f"bad run id {printable(run_id)!r}")
        try:
            (runs_dir / run_id).mkdir(mode=0o700)
        except FileExistsError:
            raise UsageError(f"{runs_dir / run_id}: that run already exists; a run directory is never reused") \
                from None
    else:
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


def _not_canonical(text):
    """Why a line that parses is still not what the writer writes."""
    def pairs(items):
        seen = set()
        for name, _value in items:
            if name in seen:
                raise ValueError(f"duplicate key {name!r} in one object")
            seen.add(name)
        return dict(items)

    def constant(name):
        raise ValueError(f"{name} is not JSON the writer writes")

    def number(literal):
        value = float(literal)
        if value in (float("inf"), float("-inf")):
            raise ValueError(f"the number {literal[:40]} overflows to Infinity")
        return value

    try:
        json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_float=number)
    except ValueError as exc:
        return str(exc)
    except RecursionError:
        return "nested too deeply to read"
    return ("not in the writer's compact form (white space, escapes or number format differ from what "
            "the writer writes)")


def _line_error(path, lineno, body, event, canonical, expected_prev, run_id, key):
    """The precise reason why a line failed the fast check in iter_lines."""
    if event is None:
        if not body.strip():
            return IntegrityError(path, lineno, "blank line" if not body else "white space only")
        if b"\x00" in body:
            return IntegrityError(path, lineno, "NUL byte in line")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return IntegrityError(path, lineno, f"not UTF-8 (byte {exc.start})")
        try:
            json.loads(text)
        except ValueError as exc:
            return IntegrityError(path, lineno, f"broken JSON: {exc}")
        except RecursionError:
            return IntegrityError(path, lineno, "nested too deeply to read")
        return IntegrityError(path, lineno, _not_canonical(text))
    if type(event) is not dict:
        return IntegrityError(path, lineno, "line is not a JSON object")
    if tuple(event) != FIELDS:
        missing = [f for f in FIELDS if f not in event]
        return IntegrityError(path, lineno, f"missing field {missing[0]!r}" if missing else
                              f"fields must be exactly {', '.join(FIELDS)}, in that order")
    seq, rid, kind, at, payload, prev = (event[f] for f in FIELDS)
    if type(seq) is not int:
        return IntegrityError(path, lineno, f"seq is not an integer: {printable(seq)!r}")
    if seq != lineno:
        why = "duplicate or repeated seq" if seq < lineno else "gap in seq"
        return IntegrityError(path, lineno, f"expected seq {lineno}, got {seq} ({why})")
    if type(rid) is not str or not _RUN_ID_RE.match(rid):
        return IntegrityError(path, lineno, f"bad run_id {printable(rid)!r}")
    if run_id is not None and rid != run_id:
        return IntegrityError(path, lineno, f"run_id {rid!r} differs from the run directory's {run_id!r}")
    if type(kind) is not str or not _KIND_RE.match(kind):
        return IntegrityError(path, lineno, f"bad kind {printable(kind)!r}")
    if not _at_ok(at):
        return IntegrityError(path, lineno, f"bad timestamp {printable(at)!r} (want a real UTC time as "
                                            f"YYYY-MM-DDTHH:MM:SS.ffffffZ)")
    if type(payload) is not dict:
        return IntegrityError(path, lineno, "payload is not a JSON object")
    if type(prev) is not str:
        return IntegrityError(path, lineno, "prev is not a string")
    if not canonical:
        return IntegrityError(path, lineno, _not_canonical(body.decode("utf-8")))
    if lineno == 1:
        _keyed_first_line(path, prev, key)  # raises KeyRequiredError / keyed-vs-unkeyed mismatch
        return IntegrityError(path, 1, "prev is not the HMAC of the empty string under this key: "
                                       "wrong key, or line 1 was rewritten")
    return IntegrityError(path, lineno, f"prev does not match line {lineno - 1} "
                                        f"(a line was changed, removed, inserted or reordered)")


def iter_lines(path, *, key=None, run_id=None):
    """Yield (event, raw_line, line_hash) for each line, verifying seq, fields, the writer's exact form
    and the chain. A damaged line raises IntegrityError; a torn last line raises TornTailError after
    every good line was yielded. No line longer than MAX_LINE_BYTES is read into memory.
    `key=None` reads LEDGER_KEY; run_id defaults to the run directory's name."""
    key = _resolve_key(key)
    if run_id is None:
        run_id = _expected_run_id(path)
    scan, dumps, sha256, fields = _SCANNER, _dumps, hashlib.sha256, FIELDS
    expected_prev = _genesis(key)
    good_kinds, last_rid = set(), None
    lineno = offset = 0
    with open(path, "rb") as handle:
        readline = handle.readline
        while True:
            raw = readline(MAX_LINE_BYTES)
            if not raw:
                return
            lineno += 1
            if raw[-1:] != b"\n":
                if len(raw) == MAX_LINE_BYTES:
                    raise IntegrityError(path, lineno, f"line is longer than the format's {MAX_LINE_BYTES}-byte "
                                                       f"limit (no writer of this format wrote it)")
                raise TornTailError(path, lineno, offset, len(raw), (lineno - 1, expected_prev))
            offset += len(raw)
            body = raw[:-1]
            # The C scanner behind json.loads, called directly; then the writer's own encoder must give
            # back the very same text: no white space, escapes, duplicate keys or number forms of its own.
            try:
                text = body.decode("utf-8")
                event, end = scan(text, 0)
                canonical = end == len(text) and dumps(event) == text
            except (ValueError, StopIteration, RecursionError):
                event, canonical = None, False
            if (not canonical or type(event) is not dict or tuple(event) != fields
                    or event["seq"] != lineno or type(event["seq"]) is not int
                    or event["prev"] != expected_prev
                    or type(event["payload"]) is not dict
                    or not _at_ok(event["at"])
                    or (event["kind"] not in good_kinds and not _remember(_kind_ok, event["kind"], good_kinds))
                    or (event["run_id"] != last_rid and not _run_id_ok(event["run_id"], run_id))):
                raise _line_error(path, lineno, body, event, canonical, expected_prev, run_id, key)
            last_rid = event["run_id"]
            expected_prev = (hmac.new(key, body, sha256) if key else sha256(body)).hexdigest()
            yield event, body, expected_prev


def _remember(check, value, good):
    if check(value):
        if len(good) > 4096:
            good.clear()
        good.add(value)
        return True
    return False


def _kind_ok(kind):
    return type(kind) is str and bool(_KIND_RE.match(kind))


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
    `expect_head` = (seq, hash) published earlier: the file must still hold that exact line (seq 0: the
    genesis value of this key, so an empty keyed ledger is told from an unkeyed one)."""
    key = _resolve_key(key)
    count, head = 0, (0, _genesis(key))
    for event, _raw, digest in iter_lines(path, key=key or b"", run_id=run_id):
        count = event["seq"]
        head = (count, digest)
        if expect_head and count == expect_head[0] and digest != expect_head[1]:
            raise IntegrityError(path, count, "does not match the expected head: the history up to "
                                              "the published head was rewritten")
    if expect_head:
        want_seq, want_hash = expect_head
        if want_seq == 0 and want_hash != _genesis(key):
            raise IntegrityError(path, None, "the expected head is seq 0, but its hash is not this ledger's "
                                             "genesis value (another key, or keyed vs unkeyed)")
        if want_seq > count:
            raise IntegrityError(path, count + 1 if count else None,
                                 f"truncated: the expected head is seq {want_seq} but the ledger ends at "
                                 f"seq {count}")
    return Verified(path, count, head)


def verify_runs(runs_dir, *, key=None):
    """Verify runs/index.jsonl and every runs/*/events.jsonl, checking closed runs against the index.
    Yields (path, Verified or an exception) for each, past any that cannot be read."""
    runs_dir = Path(runs_dir)
    index_path = runs_dir / INDEX_NAME
    closed = {}
    if index_path.exists():
        try:
            for event in read_events(index_path, key=key, run_id=None):
                if event["kind"] == "run_closed" and type(event["payload"].get("run")) is str:
                    closed[event["payload"]["run"]] = event["payload"]
            yield index_path, verify(index_path, key=key)
        except (LedgerError, OSError) as exc:
            yield index_path, exc
    seen = set()
    for events in sorted(runs_dir.glob(f"*/{EVENTS_NAME}")):
        run_id = events.parent.name
        seen.add(run_id)
        entry = closed.get(run_id)
        try:
            expect = None
            if entry:
                seq, digest = entry.get("head_seq"), entry.get("head_hash")
                if type(seq) is not int or type(digest) is not str:
                    raise IntegrityError(index_path, None, f"the entry for run {run_id} has no valid head")
                expect = (seq, digest)
            yield events, verify(events, key=key, expect_head=expect)
        except (LedgerError, OSError) as exc:
            yield events, exc
    for run_id in sorted(set(closed) - seen):
        missing = runs_dir / run_id / EVENTS_NAME
        yield missing, IntegrityError(missing, None, "closed in the index but its events.jsonl is missing")


# ----------------------------------------------------------------------------
# Command line helpers shared by the toolkit's scripts
# ----------------------------------------------------------------------------

_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_control(match):
    char = match.group()
    return _ESCAPES.get(char) or ("\\x%02x" % ord(char) if ord(char) < 256 else "\\u%04x" % ord(char))


def printable(value):
    """str(value) with control characters escaped, so text from a ledger or a server can neither forge
    a line nor drive a terminal."""
    text = value if type(value) is str else str(value)
    if _CONTROL_RE.search(text) is None:
        return text
    return _CONTROL_RE.sub(_escape_control, text)


def _say(label, message, secrets):
    text = Redactor(secret_values(secrets)).text(str(message))
    print(f"{label}: {printable(text)}", file=sys.stderr, flush=True)


def error(message, secrets=()):
    """One 'error: …' line on stderr: secrets masked, control characters escaped."""
    _say("error", message, secrets)


def warn(message, secrets=()):
    """One 'warning: …' line on stderr, like error()."""
    _say("warning", message, secrets)


_stdout_dead = []


def write_out(text):
    """Write text to stdout and flush. A stdout that is closed, full or cannot encode the text raises
    OutputError; later writes are dropped, and the interpreter's last flush cannot fail."""
    if _stdout_dead:
        raise OutputError(_stdout_dead[0])
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, UnicodeEncodeError) as exc:
        reason = ("stdout is closed" if isinstance(exc, BrokenPipeError) else
                  f"stdout cannot encode the text as {sys.stdout.encoding}" if isinstance(exc, UnicodeEncodeError)
                  else f"cannot write to stdout: {error_text(exc)}")
        _stdout_dead.append(reason)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        raise OutputError(reason) from None


def error_text(exc):
    """One line for an error: 'path: No such file or directory' for OSError, str() otherwise."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc) or type(exc).__name__


def run_cli(command, args, secrets=()):
    """Run one command of a script's CLI. The toolkit's own errors and OS errors become one error line
    and their exit code; anything else is a bug and keeps its traceback."""
    try:
        return command(args)
    except LedgerError as exc:
        error(str(exc), secrets)
        return exc.exit_code
    except OSError as exc:
        error(error_text(exc), secrets)
        return EXIT_USAGE
    except KeyboardInterrupt:
        error("interrupted")
        return 130


def parse_cli(parser, argv):
    """(args, None), or (None, exit code) when argparse printed help (0) or a usage error (2)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:
        return None, (EXIT_USAGE if exc.code else EXIT_OK)


def exit_codes_epilog(*codes):
    """The rows of EXIT_CODES a script uses, for its --help."""
    return "exit codes:\n" + "\n".join(f"  {c}  {EXIT_CODES[c]}" for c in codes)


def parse_time(text, end=False):
    """A date (YYYY-MM-DD) or ISO time -> the ledger's `at` string form for comparing."""
    text = text.strip()
    try:
        if re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text):
            day = datetime.datetime.strptime(text, "%Y-%m-%d")
            if end:
                day += datetime.timedelta(days=1) - datetime.timedelta(microseconds=1)
            moment = day.replace(tzinfo=datetime.timezone.utc)
        else:
            moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        raise UsageError(f"not a date or ISO time: {printable(text)!r}") from None
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def _cli_key(args):
    """The key named by --key-env (b"" for explicitly unkeyed when LEDGER_KEY is unset)."""
    value = os.environ.get(args.key_env)
    if args.key_env != KEY_ENV and value is None:
        raise UsageError(f"--key-env {args.key_env}: that environment variable is not set")
    return _key_bytes(value) or b""


def _cmd_verify(args):
    key = _cli_key(args)
    expect = None
    if args.expect_head is not None:
        if len(args.paths) != 1 or args.all:
            raise UsageError("--expect-head goes with exactly one PATH")
        expect = parse_head(args.expect_head)
    if args.all and not Path(args.all).is_dir():
        raise UsageError(f"--all: no such directory: {args.all}")
    results = []
    for path in args.paths:
        try:
            results.append((path, verify(path, key=key, expect_head=expect)))
        except (LedgerError, OSError) as exc:
            results.append((path, exc))
    if args.all:
        results.extend(verify_runs(args.all, key=key))
    failed = broken = valid = 0
    for path, result in results:
        if isinstance(result, Verified):
            valid += 1
            write_out(f"ok    {printable(path)}  {result.count} lines  head {result.head_text()}\n")
        elif isinstance(result, IntegrityError):
            failed += 1
            write_out(f"FAIL  {printable(result)}\n")
        else:
            broken += 1
            write_out(f"ERROR {printable(path)}: {printable(error_text(result))}\n")
    write_out(f"{valid}/{len(results)} ledgers valid\n")
    if failed:  # an integrity failure outranks a file that could not be read
        error(f"integrity check failed ({failed} ledger{'s' if failed != 1 else ''})")
        return EXIT_FAILED
    if broken:
        error("some ledgers could not be read or need a key")
        return EXIT_USAGE
    return EXIT_OK


def _cmd_head(args):
    result = verify(args.path, key=_cli_key(args))
    write_out(result.head_text() + "\n")
    return EXIT_OK


# Payload fields that report shows on an event's line, for the kinds this toolkit writes. model_call's
# come from ask.py, their owner, when ask.py is beside this file.
_REPORT_FIELDS = ("stage", "decision", "outcome", "tool", "rule", "verdict", "reason", "error_type", "error")


def _report_fields():
    here = str(Path(__file__).resolve().parent)
    if not (Path(here) / "ask.py").is_file():
        return _REPORT_FIELDS
    if here not in sys.path:
        sys.path.insert(0, here)
    import ask  # only for its field names, and only here
    summary = tuple(getattr(ask, "MODEL_CALL_SUMMARY", ()))
    return summary + tuple(f for f in _REPORT_FIELDS if f not in summary)


def _event_summary(event, fields):
    payload = event["payload"]
    parts = [event["at"], f"#{event['seq']}", event["kind"]]
    for name in fields:
        value = payload.get(name)
        if value not in (None, "", [], {}):
            parts.append(f"{name}={value}")
    if payload.get("rationale"):
        parts.append(f"-- {payload['rationale']}")
    return "  ".join(printable(p) for p in parts)


def _cmd_report(args):
    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until, end=True) if args.until else None
    fields = None
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
            write_out(raw.decode("utf-8") + "\n")
        else:
            fields = fields or _report_fields()
            write_out(_event_summary(event, fields) + "\n")
    return EXIT_OK


def _cmd_append(args):
    if args.payload is not None:
        text = args.payload
    elif not sys.stdin.isatty():
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadError(f"payload is not UTF-8 (byte {exc.start})") from None
    else:
        text = ""
    try:
        payload = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise PayloadError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise PayloadError(f"payload is nested deeper than {MAX_DEPTH} levels") from None
    if type(payload) is not dict:
        raise PayloadError("payload must be a JSON object")
    run_id = args.run_id or os.environ.get("LEDGER_RUN_ID") or None
    key = _cli_key(args)
    with Ledger(args.path, run_id, key=key, secrets=(key.decode("utf-8", "replace"),) if key else ()) as ledger:
        ledger.append(args.kind, payload)
        write_out(f"{ledger.head[0]} {ledger.head[1]}\n")
    return EXIT_OK


def _build_parser():
    parser = argparse.ArgumentParser(prog="reasoning_ledger.py",
                                     description="Append-only, hash-chained JSONL ledger.",
                                     epilog=exit_codes_epilog(EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_OUTPUT),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
        error("verify needs a PATH or --all RUNS_DIR")
        return EXIT_USAGE
    return run_cli(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
