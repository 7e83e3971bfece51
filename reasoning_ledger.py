#!/usr/bin/env python3
"""reasoning_ledger.py -- an append-only, hash-chained JSONL ledger. Standard library only.

Usage:
  python reasoning_ledger.py verify PATH... [--all RUNS_DIR] [--expect-head SEQ:HASH]
                             [--key-env NAME]
  python reasoning_ledger.py head PATH [--key-env NAME]
  python reasoning_ledger.py report PATH... [--all RUNS_DIR] [--kind K] [--stage S] [--run R]
                             [--since T] [--until T] [--json]
  python reasoning_ledger.py append PATH --kind K [--run-id R] [--payload JSON | < payload.json]
  python reasoning_ledger.py keygen NAME --out FILE [--cosigner]
  python reasoning_ledger.py checkpoint PATH --key FILE [--origin ORIGIN] [--append]
  python reasoning_ledger.py verify PATH --checkpoint FILE --vkey KEY [--since FILE]
                             [--witness VKEY]... [--witnesses-needed N]
  python reasoning_ledger.py prove PATH SEQ --checkpoint FILE | prove PATH --consistency M [N]
  python reasoning_ledger.py verify-proof PROOF --vkey KEY [--witness VKEY]... < line

Library (copy this one file next to your code):
  from reasoning_ledger import Ledger, open_run, read_events, verify
  with Ledger("calls.jsonl", run_id="nightly") as ledger:
      ledger.decide("plan", "run tests first", "cheapest signal", ["read code"])
      ledger.append("note", {"text": "hello"})

Exit codes are shared by every script of the toolkit: see EXIT_CODES.
"""

import argparse
import base64
import collections
import contextlib
import datetime
import errno
import fcntl
import functools
import hashlib
import hmac
import json
import math
import os
import pickle
import re
import sys
import threading
import time
import weakref
from pathlib import Path

__version__ = "1.1.0"

# What a vendoring script needs; the toolkit's own scripts also use the CLI kit below (error,
# write_out, ...) and Bucket.
__all__ = [
    "Ledger",
    "Run",
    "open_run",
    "store_artifact",
    "read_events",
    "verified_events",
    "verify",
    "verify_runs",
    "run_ledgers",
    "run_summary",
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

FIELDS = tuple("seq run_id kind at payload prev".split())
GENESIS = "0" * 64
MAX_LINE_BYTES = 1024 * 1024  # a line, newline included, is at most this long: the format's limit
MAX_DEPTH = 64  # nesting levels of a payload; the payload object itself is level 1
KEY_ENV = "LEDGER_KEY"
REDACTED = "[REDACTED]"
# The toolkit's own secret settings, the one list (docs/secrets.md): their values are masked, no
# program the agent runs sees them, and the daemon hands a run the first three on its stdin and
# keeps the next three, its own, from it.
SECRET_ENV_VARS = tuple(
    "API_KEY OPENAI_API_KEY LEDGER_KEY WEBHOOK_SECRET WEBHOOK_SECRET_FILE READ_TOKEN PROXY_TOKEN "
    "CLICKHOUSE_PASSWORD LEDGER_SIGNING_KEY_FILE".split()
)
REDACT_ENV_LIST = "LEDGER_REDACT_ENV"
MIN_SECRET_CHARS = 8  # shorter env values ("none", "test") are too common to mask by value
INDEX_NAME = "index.jsonl"
EVENTS_NAME = "events.jsonl"
SIGNING_KEY_ENV = "LEDGER_SIGNING_KEY_FILE"
# a Ledger with a signer key checkpoints after this many of its lines, or its first line after this
# many seconds since its last checkpoint, and at close
CHECKPOINT_EVERY = (10000, 300)

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
EXIT_CODES = dict(enumerate("""ok
failed: integrity failure (verify, audit, ship), failed call (ask), error outcome (agent)
usage, configuration or I/O error; nothing was done
answer received but a check failed (ask); proposal rejected by the judge (agent)
changes found: audit --fail-on-change; decisions another tools.json flips (agent replay)
stdout could not be written; the result was recorded
another run holds the repository's lock (agent)
budget exhausted (agent)
proposal accepted by the judge, waiting for review (agent)
the model repeated itself until the run stopped it (agent)""".split("\n")))

_KIND_RE = re.compile(r"[a-z][a-z0-9_.]*\Z")
_AT_RE = re.compile(
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
    r"\.[0-9]{6}Z\Z"
)
# Any run id (the daemon's delivery ids too), and the shape of the ones new_run_id() makes.
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
OUR_RUN_ID_RE = re.compile(r"[0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[0-9a-f]{8}\Z")
_SEQ_PREFIX_RE = re.compile(rb'\{"seq":([1-9][0-9]*),')
_PREV_SUFFIX_RE = re.compile(rb',"prev":"([0-9a-f]{64})"\}\Z')


def _claim(line):
    """(seq, prev) as a line's bytes claim them, without parsing it; None: not a ledger line."""
    seq, prev = _SEQ_PREFIX_RE.match(line), _PREV_SUFFIX_RE.search(line)
    return seq and prev and (int(seq[1]), prev[1].decode())


# Python 3.11+ refuses to print longer ints; a line must read back everywhere
_INT_LIMIT = 10**4300


class LedgerError(Exception):
    """Base of every error the toolkit raises on purpose; a script exits with its `exit_code`."""

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
        super().__init__(f"{path}: {f'line {line}: ' if line else ''}{reason}")


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
    seconds, micros = divmod(time.time_ns() // 1000, 1000000)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(seconds))}.{micros:06d}Z"


def new_run_id():
    """A run id that sorts by creation time and carries a random suffix:
    20261129T120000.123456Z-1a2b3c4d."""
    return f"{utc_now().replace('-', '').replace(':', '')}-{os.urandom(4).hex()}"


@functools.lru_cache(maxsize=4096)  # a ledger's lines share a few days
def _day_exists(day):  # YYYY-MM-DD in ASCII digits
    try:
        datetime.date.fromisoformat(day)
    except ValueError:
        return False
    return True


def _matches(regex, value):
    return type(value) is str and regex.match(value) is not None


def _at_ok(at):
    """`at` as the writer writes it: the exact shape, ASCII digits, and a date that exists."""
    return type(at) is str and _AT_RE.match(at) is not None and _day_exists(at[:10])


def _key_bytes(key):
    return (key.encode() if isinstance(key, str) else bytes(key)) if key else None


def resolve_key(key):
    """The HMAC key as bytes, or None: key=None reads LEDGER_KEY; b"" or "" means explicitly
    unkeyed."""
    return _key_bytes(os.environ.get(KEY_ENV) if key is None else key)


def line_hash(raw, key=None):
    """SHA-256 (or HMAC-SHA256 with `key`) in hex of one stored line, without its newline (or of
    any bytes)."""
    return (hmac.new(key, raw, hashlib.sha256) if key else hashlib.sha256(raw)).hexdigest()


def genesis(key):
    """Line 1's prev: all zeros, or with `key` the HMAC of nothing."""
    return line_hash(b"", key) if key else GENESIS


def parse_head(text):
    """'SEQ HASH' or 'SEQ:HASH' -> (seq, hash)."""
    match = re.fullmatch(r"([0-9]+)[:\s]+([0-9a-fA-F]{64})", text.strip())
    if not match:
        raise UsageError(
            f"not a ledger head (want SEQ:HASH, the whole 64-hex hash `head` prints): "
            f"{printable(text)!r}"
        )
    return int(match[1]), match[2].lower()


# ----------------------------------------------------------------------------
# Redaction
# ----------------------------------------------------------------------------

# A key name is split into segments on "_", "-", "." and camelCase; it names a secret when its last
# segment is one of these words, or its last two one of these pairs (input_tokens, max_tokens,
# token_count stay).
_SECRET_WORDS = frozenset(
    "token secret password passwd passphrase credential credentials apikey session cookie "
    "authorization".split()
)
_SECRET_PAIRS = frozenset(
    "api_key private_key access_key secret_key signing_key encryption_key master_key "
    "client_key".split()
)
# Query and fragment parameters that carry a secret although their names end in another word.
_SECRET_PARAMS = frozenset(
    "key code sig signature auth pwd pass x_amz_signature x_goog_signature".split()
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
        segments[-1] in _SECRET_WORDS or "_".join(segments[-2:]) in _SECRET_PAIRS
    )


def _mask_scheme(m):
    # a credential, not prose ("a bearer token"): 20+ characters, or 8+ with a digit, token
    # punctuation or a capital after the first letter
    word = m[3].rstrip(".")
    credential = (
        len(word) >= 20
        or len(word) >= 8
        and (any(c.isdigit() or c in "_~+/=" for c in word) or any(c.isupper() for c in word[1:]))
    )
    return f"{m[1]}{m[2]}{REDACTED}" if credential else m[0]


def _mask_userinfo(m):
    # a URL's user part with a password, or one that is a token (16+ characters, letters and digits)
    user = m[2]
    token = len(user) >= 16 and any(c.isdigit() for c in user) and any(c.isalpha() for c in user)
    return f"{m[1]}{REDACTED}@" if ":" in user or token else m[0]


def _mask_param(m):
    name = m[2]
    secret = is_secret_key(name) or name.lower().replace("-", "_") in _SECRET_PARAMS
    return f"{m[1]}{name}={REDACTED}" if secret and m[3] != REDACTED else m[0]


_PROSE_RE = re.compile(r"[ \t]+[A-Za-z]")


def _mask_assignment(m):
    double, single, bare = m.group(3, 4, 5)
    value = double or single or bare or ""
    # a word that a sentence goes on after ("a webhook secret: set WEBHOOK_SECRET") is prose, not
    # a value: the program's own messages keep their words
    prose = bare and ":" in m[2] and bare.isalpha() and _PROSE_RE.match(m.string, m.end())
    if (
        prose
        or not is_secret_key(m[1])
        or value in ("", REDACTED)
        or value.lower() in ("bearer", "basic")
    ):
        return m[0]
    quote = '"' if double is not None else "'" if single is not None else ""
    return f"{m[1]}{m[2]}{quote}{REDACTED}{quote}"


# Secret shapes masked inside any string, run in this order: a later shape leaves an earlier one's
# mask alone. A shape without its replacement is replaced whole by [REDACTED].
_SHAPES = (
    (
        r"(?s)-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
        REDACTED
    ),
    (
        r"(?i)\b((?:set-)?cookie|(?:proxy-)?authorization)"
        r"([ \t]*:[ \t]*)(?!\[REDACTED\])\S[^\r\n]*",
        r"\1\2" + REDACTED
    ),
    (r"(?i)\b(bearer|basic)(\s+)([A-Za-z0-9._~+/=-]+)", _mask_scheme),
    (r"\bsk-[A-Za-z0-9_-]{8,}", REDACTED),
    (r"PRIVATE\+KEY\+\S+", REDACTED),  # a signed-note signer key (docs/checkpoints.md)
    (r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})", REDACTED),
    (r"\bxox[abposr]-[A-Za-z0-9-]{8,}", REDACTED),
    (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", REDACTED),
    (r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,31}://)([^\s/?#\"'<>]+)@", _mask_userinfo),
    (r"([?&;#])([A-Za-z0-9_.\[\]-]{1,64})=([^&#\s\"'<>]+)", _mask_param),
    (
        r"\b([A-Za-z][A-Za-z0-9_.-]{0,63})([\"']?[ \t]*[:=][ \t]*)"
        r"(?:\"([^\"\r\n]*)\"|'([^'\r\n]*)'|([^\s\"',;&]+))",
        _mask_assignment
    )
)
# What every shape needs to match at all (tests/test_redaction.py holds this to the shapes): a
# string with none of these skips the shapes, at a tenth of their cost (tests/BENCH.md).
_SCHEME_WORD = re.compile(r"b(?:earer|asic)\s", re.I)
_LITERALS = tuple(": = @ -----BEGIN sk- PRIVATE+KEY+ gh github_pat_ xox AKIA ASIA".split())


def _may_match(text):
    for literal in _LITERALS:  # `in` is a fast search: a regex is slower over long strings
        if literal in text:
            return True
    # without white space (a hash, an id) the scheme word cannot match: the search is skipped
    return not text.isalnum() and _SCHEME_WORD.search(text) is not None


# Each shape's own prefilter, on the text folded to lower case (a comma between shapes): literals of
# which it needs one (it cannot match without), or None for the assignment shape, which changes a
# name only where a secret word ends it (_ASSIGNMENT_HINT). A shape's mask adds "[REDACTED]" only,
# so it never makes a later hint true. The same output, several times faster over transcripts
# (tests/test_redaction.py).
_SHAPE_HINTS = [
    hint.split()
    for hint in "-----begin,cookie authorization,bearer basic,sk-,private+key+,gh github_pat_,xox,"
    "akia asia,@,=".split(",")
] + [None]
# A secret word ending a name, then what the assignment shape needs before the value.
_ASSIGNMENT_HINT = re.compile(
    r"(?:token|secret|passw(?:or)?d|passphrase|credentials?|session|cookie|authorization|key)"
    r"[_.-]*[\"']?[ \t]*[:=]"
)


def _folded(text):
    # lower case, and the letters re.IGNORECASE matches to ASCII ones (ſ, ı, İ, K) as those
    low = text.lower()
    return (
        low
        if text.isascii()
        else low.replace("\u017f", "s").replace("\u0131", "i").replace("i\u0307", "i")
    )


# a pattern compiled on its first use: most strings need no secret shape, and verify none at all
_compiled = functools.cache(re.compile)


class Redactor:
    """Masks known secret values and secret shapes (tokens, credentials in URLs, key=value
    assignments)."""

    def __init__(self, values=()):
        self.values = tuple(_longest_first(values))

    def text(self, text):
        for value in self.values:
            if value in text:  # faster than replace() over text without it
                text = text.replace(value, REDACTED)
        if _may_match(text):
            low = _folded(text)
            for (pattern, repl), hint in zip(_SHAPES, _SHAPE_HINTS):
                if any(map(low.__contains__, hint)) if hint else _ASSIGNMENT_HINT.search(low):
                    text = _compiled(pattern).sub(repl, text)
        return text


# Credential variables of common tools that the rule of is_secret_env_name misses (docs/secrets.md).
SECRET_ENV_NAMES = tuple(
    "SSHPASS DATABASE_URL *_DATABASE_URL REDIS_URL MONGODB_URI MONGO_URL AMQP_URL "
    "CELERY_BROKER_URL PIP_INDEX_URL PIP_EXTRA_INDEX_URL UV_INDEX_URL UV_EXTRA_INDEX_URL "
    "POETRY_PYPI_TOKEN_* BUNDLE_*__* COMPOSER_AUTH DOCKER_AUTH_CONFIG "
    "AZURE_STORAGE_CONNECTION_STRING GOOGLE_APPLICATION_CREDENTIALS_JSON GOOGLE_CREDENTIALS".split()
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
        or name.upper() in SECRET_ENV_NAMES
        # a pattern compiles on first use: the plain names need no regex
        or any(fnmatch.fnmatchcase(name.upper(), p) for p in SECRET_ENV_NAMES if "*" in p)
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
    return _longest_first(values)


def _longest_first(values):
    # longest first: a secret holding another goes whole
    return sorted(
        {v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_CHARS},
        key=len,
        reverse=True
    )


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
    if kind is float and not math.isfinite(value):
        raise _BadValue(f"{value!r} is not valid JSON (NaN/Infinity)")
    if value is None or kind in (bool, int, float):
        return value
    if kind not in (dict, list, tuple):
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
        text = dumps(clean)
        text.encode()
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
    return f"payload is larger than {limit} bytes of JSON" if len(text.encode()) > limit else None


_SCANNER = json.JSONDecoder().scan_once
# The writer's JSON: compact, UTF-8 as it is; dumps(value) -> str.
dumps = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, check_circular=False
).encode


# ----------------------------------------------------------------------------
# Writing: low-level file helpers, Ledger, store_artifact, runs
# ----------------------------------------------------------------------------


def named_error(exc, path):
    """An OSError that names no file, named `path`; any other error as it is."""
    if isinstance(exc, OSError) and not exc.filename:
        return OSError(exc.errno, exc.strerror or str(exc), str(path))
    return exc


def _fsync_dir(path):
    fd = os.open(str(Path(path).parent), os.O_RDONLY)
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
    """(offset past the last newline, the last complete line: b"" if none, None if too long), read
    from the end."""
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


def _write_file(path, data, flags=os.O_APPEND, fsync=True, lead=b""):
    """Write `data` (after `lead` when the file is not empty) to the end of `path`, created with
    mode 0600, and fsync it unless `fsync` is False; on failure the file is cut back as it was."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o600)
    try:
        size = os.fstat(fd).st_size
        _write_or_undo(fd, (lead if size else b"") + data, size, fsync)
    finally:
        os.close(fd)


_LIVE_LEDGERS = weakref.WeakSet()


def _after_fork_in_child():
    # A fork copies the fd (one open file description: its flock would be shared with the parent)
    # and the thread lock (maybe held by a thread that does not exist here). Start both afresh.
    for ledger in list(_LIVE_LEDGERS):
        if ledger._fd is not None:
            with contextlib.suppress(OSError):
                os.close(ledger._fd)
        ledger._afresh()


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
        clock=utc_now,
        signer=None
    ):
        self.path = Path(path)
        own = run_dir_id(self.path)  # runs/<run id>/events.jsonl holds that run's lines only
        if own and run_id and run_id != own:
            raise UsageError(
                f"{self.path} holds run {own}'s events only; not {printable(run_id)!r}"
            )
        self.run_id = run_id or own or new_run_id()
        if not _matches(RUN_ID_RE, self.run_id):
            raise UsageError(
                f"bad run id {printable(self.run_id)!r}: letters, digits and _.:- only, at most 128"
            )
        if not 0 < max_line_bytes <= MAX_LINE_BYTES:
            raise UsageError(f"max_line_bytes must be 1 to {MAX_LINE_BYTES}")
        self.key, self.fsync, self.max_line_bytes = resolve_key(key), fsync, max_line_bytes
        self.clock = clock  # returns `at`; replaceable for importing history and for tests
        self.extra_secrets = tuple(s for s in secrets if s)
        self.redactor = Redactor(secret_values(self.extra_secrets))  # env read once, not per append
        self.head = None  # (seq, hash) of the last line this object wrote
        self._mode_checked = False
        # with a signer key: a checkpoint every CHECKPOINT_EVERY, and at close (docs/checkpoints.md)
        self.signer, self._unsigned, self._signed_at = signer, 0, time.monotonic()
        self.add_secret(signer and key_text(signer, secret=True))
        # group commit: lines this object wrote, made durable, lost to a failed fsync
        self._written = self._synced = self._lost = 0
        self._afresh()
        _LIVE_LEDGERS.add(self)

    def _afresh(self):  # no file open, no lock held, no fsync under way
        self._fd, self._lock, self._sync, self._syncing = (
            None,
            threading.Lock(),
            threading.Condition(),
            False
        )

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
        if self.signer and self._unsigned:
            self.checkpoint()
        with self._lock, self._sync:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _locked(self, work):
        """work(fd) under the thread lock and the file's exclusive flock; I/O errors name the
        file."""
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
                raise named_error(exc, self.path) from None

    def _check_mode(self, fd):
        """Refuse to mix keyed and unkeyed lines in one file (checked once per object)."""
        first = os.pread(fd, 4096, 0)
        if b"\n" not in first:
            first = os.pread(fd, MAX_LINE_BYTES, 0)
        first, newline, _rest = first.partition(b"\n")
        if not newline:  # empty (or one torn fragment): the line about to be written sets the mode
            return
        claim = _claim(first)
        if not claim:
            raise IntegrityError(self.path, 1, "not a ledger line; refusing to append")
        prev = claim[1]
        if prev != genesis(self.key):
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
        """The file's head (seq, hash) if the next append can succeed (a torn tail it recovers);
        writes nothing."""

        seq, prev = self._locked(
            lambda fd: self._next(*_scan_tail(fd, os.fstat(fd).st_size, self.path))
        )
        return seq - 1, prev

    def append(self, kind, payload=None):
        """Append one event; return it as written (payload masked). PayloadError: nothing was
        written."""
        if not _matches(_KIND_RE, kind):
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
            event = self._write_event(fd, end, last, kind, clean, payload_json)
            self._written += 1
            self._unsigned += 1
            return event, self._written

        event, ticket = self._locked(write)
        if self.fsync:
            self._commit(ticket)
        lines, seconds = CHECKPOINT_EVERY
        if self.signer and (
            self._unsigned >= lines or time.monotonic() - self._signed_at >= seconds
        ):
            self.checkpoint()
        return event

    def checkpoint(self):
        """Sign the ledger's tree as it is now and append it to PATH.checkpoints; the note."""
        self._unsigned, self._signed_at = 0, time.monotonic()
        return make_checkpoint(self.path, self.signer, key=self.key or b"", append=True)

    def _commit(self, ticket):
        """Return once this object's line number `ticket` is on disk: fsync every line written so
        far, or wait for the fsync in progress, which may cover it (group commit)."""
        with self._sync:
            while ticket > self._synced:
                if ticket <= self._lost:  # the line may be in the file; it was never acknowledged
                    raise OSError(errno.EIO, "the fsync after this append failed", str(self.path))
                if self._syncing:
                    self._sync.wait()
                    continue
                upto, self._syncing, fd = self._written, True, self._fd
                try:
                    fd = (
                        os.open(self.path, os.O_RDONLY | os.O_CLOEXEC) if fd is None else os.dup(fd)
                    )
                    self._sync.release()
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                        self._sync.acquire()
                    self._synced = upto
                except OSError as exc:
                    self._lost = self._written
                    raise named_error(exc, self.path) from None
                finally:
                    self._syncing = False
                    self._sync.notify_all()

    def _next(self, end, last):
        """(seq, prev) for the line after `last`, the file's last complete line."""
        if not last and not end:
            return 1, genesis(self.key)
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
        return int(match[1]) + 1, line_hash(last, self.key)

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
            f'{{"seq":{seq},"run_id":"{self.run_id}","kind":"{kind}","at":"{at}",'
            f'"payload":{payload_json},"prev":"{prev}"}}'
        ).encode()
        if len(raw) + 1 > self.max_line_bytes:
            raise PayloadError(
                f"event is {len(raw) + 1} bytes, over the {self.max_line_bytes}-byte line limit"
            )
        _write_or_undo(fd, raw + b"\n", size, False)  # append() makes it durable
        self.head = seq, line_hash(raw, self.key)
        return dict(zip(FIELDS, (seq, self.run_id, kind, at, clean, prev)))

    def _recover_torn_tail(self, fd, size, end, last):
        fragment = os.pread(fd, size - end, end)
        digest = line_hash(fragment)
        sidecar = Path(f"{self.path}.torn")
        header = f"torn offset={end} length={len(fragment)} sha256={digest} at={utc_now()}\n"
        try:
            _write_file(sidecar, header.encode() + fragment + b"\n")
        except OSError as exc:
            raise named_error(exc, sidecar) from None
        os.ftruncate(fd, end)
        if self.fsync:
            os.fsync(fd)
        recovered = {
            "offset": end,
            "length": len(fragment),
            "sha256": digest,
            "sidecar": sidecar.name
        }
        self._write_event(fd, end, last, "ledger_recovered", recovered, dumps(recovered))
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

    def store_text(self, entry):
        """One conversation entry, {"role", "parts"} (docs/proxy.md), masked and stored once in
        text_dir() beside the ledger; returns its SHA-256, the name a line gives it."""
        clean = dumps(_clean(entry, self.redactor))
        return store_artifact(text_dir(self.path), clean, redact_secrets=False, fsync=self.fsync)[
            "sha256"
        ]

    def store_artifact(self, data, *, redact_secrets=True):
        """store_artifact() under artifacts/ beside the ledger."""
        return store_artifact(
            self.path.parent / "artifacts",
            data,
            redact_secrets=redact_secrets,
            redactor=self.redactor
        )


def text_dir(path):
    """The text store of the ledger at `path`: the directory PATH.text/ beside it, one file per
    SHA-256."""
    return Path(f"{path}.text")


def store_artifact(
    directory, data, *, redact_secrets=True, extra_secrets=(), redactor=None, fsync=True
):
    """Store bytes or text (masked first) as directory/<sha256>, fsync'd unless `fsync` is False;
    return {"sha256", "size", "path"}."""
    if isinstance(data, str):
        data = data.encode("utf-8", "backslashreplace")  # a lone surrogate stays visible as \\udXXX
    if redact_secrets:
        with contextlib.suppress(UnicodeDecodeError):  # not UTF-8 text: stored as it is
            data = (redactor or Redactor(secret_values(extra_secrets))).text(data.decode()).encode()
    directory = Path(directory)
    digest = line_hash(data)
    target = directory / digest
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not target.exists():
            # one per writer, even in one process
            tmp = directory / f".{digest[:16]}.{os.urandom(8).hex()}.tmp"
            try:
                _write_file(tmp, data, os.O_EXCL, fsync)
            except OSError:
                with contextlib.suppress(OSError):  # the error to name is the first
                    os.unlink(str(tmp))
                raise
            os.replace(str(tmp), str(target))
            if fsync:
                _fsync_dir(target)
    except OSError as exc:
        raise named_error(exc, target) from None
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
        ledger = self.ledger
        ledger.append(
            "run_closed",
            {"outcome": outcome, **{k: v for k, v in summary.items() if v is not None}}
        )
        (seq, digest), signer = ledger.head, ledger.signer
        with Ledger(
            self.runs_dir / INDEX_NAME,
            self.run_id,
            key=ledger.key or b"",
            fsync=ledger.fsync,
            secrets=ledger.extra_secrets,
            signer=signer
        ) as index:
            index.append(
                "run_closed",
                {
                    "run": self.run_id,
                    "events": f"{self.run_id}/{EVENTS_NAME}",
                    "head_seq": seq,
                    "head_hash": digest,
                    "outcome": outcome,
                    **({"checkpoint": ledger.checkpoint()} if signer else {})
                }
            )
        ledger.close()

        self.closed = True
        return seq, digest


def open_run(runs_dir="runs", *, run_id=None, **options):
    """Create runs_dir/<run id>/ (never reused, a given run_id too) and return a Run writing to its
    events.jsonl; `options` are the Ledger's (key, fsync, secrets, signer)."""
    runs_dir, given = Path(runs_dir), run_id
    runs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if given is not None and not _matches(RUN_ID_RE, given):
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
    return Run(runs_dir, run_id, Ledger(runs_dir / run_id / EVENTS_NAME, run_id, **options))


# ----------------------------------------------------------------------------
# Events a stranger can cause (the daemon's rejections, the proxy's refusals): a bounded rate
# ----------------------------------------------------------------------------


class Bucket:
    """A token bucket: `burst` at once, then `per_s` a second (default 50, then 5 a second: a flood
    of refused requests cannot grow a ledger without bound); take() counts what it refuses."""

    def __init__(self, per_s=5, burst=50):
        self.per_s, self.burst, self.tokens, self.at, self.refused = (
            per_s,
            burst,
            float(burst),
            time.monotonic(),
            0
        )
        self.lock = threading.Lock()

    def take(self):
        """None when refused, else how many were refused since the last one let through."""
        with self.lock:
            now = time.monotonic()
            self.tokens, self.at = min(self.burst, self.tokens + (now - self.at) * self.per_s), now
            if self.tokens < 1:
                self.refused += 1
                return None
            self.tokens -= 1
            refused, self.refused = self.refused, 0
            return refused

    def counted(self, payload):
        """`payload` to record now, with `unrecorded_before` when some were left out since the last
        one; None when it is left out."""
        dropped = self.take()
        return (
            dict(payload, unrecorded_before=dropped)
            if dropped
            else None if dropped is None else payload
        )


# ----------------------------------------------------------------------------
# Reading and verifying
# ----------------------------------------------------------------------------

# The words for a ledger short of the head it is held to (fleet.py words its own).
TRUNCATED = "the expected head is seq {} but the ledger ends at seq {}"


def run_dir_id(path):
    """The run id of runs/<run id>/events.jsonl, which open_run() makes and which holds only that
    run's events; else None."""
    path = Path(path)
    return (
        path.parent.name
        if path.name == EVENTS_NAME and OUR_RUN_ID_RE.match(path.parent.name)
        else None
    )


def _form_problem(body):
    """Why a line is not in the writer's form; asked only of a line that is not."""

    def unique(pairs):
        seen = set()
        for name, _value in pairs:
            if name in seen:
                raise _BadValue(f"duplicate key {name!r} in one object")
            seen.add(name)
        return dict(pairs)

    def constant(name):
        raise _BadValue(f"{name} is not JSON the writer writes")

    def finite(literal):
        if math.isinf(float(literal)):
            raise _BadValue(f"the number {literal[:40]} overflows to Infinity")
        return float(literal)

    if not body.strip():
        return "white space only" if body else "blank line"
    if b"\x00" in body:
        return "NUL byte in line"
    try:
        json.loads(
            body.decode(), object_pairs_hook=unique, parse_constant=constant, parse_float=finite
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
    """What is wrong with the fields of a line, or None; `known` gathers the (run_id, kind) pairs
    found good, which the inline test of _check_lines passes."""
    if type(event) is not dict:
        return "line is not a JSON object"
    if tuple(event) != FIELDS:
        missing = [name for name in FIELDS if name not in event]
        return (
            f"missing field {missing[0]!r}"
            if missing
            else "fields must be exactly seq, run_id, kind, at, payload, prev, in that order"
        )
    seq, rid, kind, at, payload, prev = event.values()
    if type(seq) is not int or seq != lineno:
        return f"expected seq {lineno}, got {seq!r}" + (
            ""
            if type(seq) is not int
            else " (gap in seq)" if seq > lineno else " (duplicate or repeated seq)"
        )
    if not _matches(RUN_ID_RE, rid):
        return f"bad run_id {rid!r}"
    if run_id not in (None, rid):
        return f"run_id {rid!r} differs from the run directory's {run_id!r}"
    if not _matches(_KIND_RE, kind):
        return f"bad kind {kind!r}"
    if not _at_ok(at):
        return f"bad timestamp {at!r} (want a real UTC time as YYYY-MM-DDTHH:MM:SS.ffffffZ)"
    if type(payload) is not dict:
        return "payload is not a JSON object"
    if type(prev) is not str:
        return "prev is not a string"
    if len(known) < 4096:  # a ledger repeats a few
        known.add((rid, kind))
    return None


def _chain_error(path, lineno, prev, key):
    if lineno == 1 and not key:
        return KeyRequiredError(path)
    return IntegrityError(
        path,
        lineno,
        (
            f"prev does not match line {lineno - 1} (changed, removed or moved)"
            if lineno > 1
            else (
                "ledger is not keyed but a key was given (or was rewritten without it)"
                if prev == GENESIS
                else "prev is not this key's genesis: wrong key, or line 1 was rewritten"
            )
        )
    )


def _file_lines(path, offset=0):
    with open(path, "rb") as handle:
        if offset:  # a pipe cannot seek
            handle.seek(offset)
        yield from iter(functools.partial(handle.readline, MAX_LINE_BYTES), b"")


def _check_lines(path, lines, key, run_id, expect=None, start=None):
    # The one line check. `key`: bytes or None; `expect`: a head (seq, hash) to hold the lines to;
    # `start`: (seq, hash, byte offset) of the line before the first one.
    known, sha256 = set(), hashlib.sha256
    lineno, expected_prev, offset = start or (0, genesis(key), 0)
    for raw in lines:
        lineno += 1
        if raw[-1:] != b"\n":
            if len(raw) >= MAX_LINE_BYTES:
                raise IntegrityError(
                    path, lineno, f"line is longer than the format's {MAX_LINE_BYTES}-byte limit"
                )
            raise TornTailError(path, lineno, offset, len(raw), (lineno - 1, expected_prev))
        offset += len(raw)
        body = raw[:-1]
        # exactly the writer's bytes: encoded again by the writer's own encoder, the line gives back
        # its text
        try:
            text = body.decode()
            event, end = _SCANNER(text, 0)
            canonical = end == len(text) and dumps(event) == text
        except (ValueError, StopIteration, RecursionError):
            raise IntegrityError(path, lineno, _form_problem(body)) from None
        # the common good line passes this one inline test (verify's bench guard); any other is
        # named below
        try:
            good = (
                canonical
                and type(event) is dict
                and tuple(event) == FIELDS
                and event["seq"] == lineno
                and type(event["seq"]) is int
                and event["prev"] == expected_prev
                and (event["run_id"], event["kind"]) in known
                and type(event["payload"]) is dict
                and _at_ok(event["at"])
            )
        except TypeError:  # a run_id or kind that cannot be hashed
            good = False
        if not good:
            problem = _envelope_problem(event, lineno, run_id, known) or (
                None if canonical else _form_problem(body)
            )
            if problem:
                raise IntegrityError(path, lineno, problem)
            if event["prev"] != expected_prev:
                raise _chain_error(path, lineno, event["prev"], key)
        expected_prev = (hmac.new(key, body, sha256) if key else sha256(body)).hexdigest()
        if expect and lineno == expect[0] and expected_prev != expect[1]:
            raise IntegrityError(
                path, lineno, "does not match the expected head: the history up to it was rewritten"
            )
        yield event, body, expected_prev


def read_events(path, *, key=None, run_id=None):
    """Stream the events of a ledger in order, verifying as it goes (constant memory)."""
    for event, _raw, _digest in verified_events(path, key=key, run_id=run_id):
        yield event


def verified_events(
    path,
    *,
    key=None,
    expect=None,
    run_id=None,
    closed=False,
    lines=None,
    truncated=TRUNCATED,
    after=None
):
    """Yield (event, raw line, its hash) for each line of a ledger, verifying as it goes;
    TornTailError after every good line of a torn file. `expect` = (seq, hash), a head published
    earlier, holds the ledger to it; with `closed` it is the head index.jsonl recorded when the run
    closed, where the ledger must end. `run_id`: the one run id of its lines (default: the run
    directory's). `lines`: its raw lines from elsewhere (ClickHouse's rows; default: the file's);
    `truncated`: the words for a ledger short of `expect`, as TRUNCATED. `after`: the [seq, hash,
    offset] parallel_start() vouched for, where the check goes on."""
    key = resolve_key(key)
    if expect is not None and (type(expect[0]) is not int or type(expect[1]) is not str):
        raise IntegrityError(path, None, "the index entry for this run has no valid head")
    if closed and expect and not os.path.exists(path):
        raise IntegrityError(path, None, "closed in the index but its events.jsonl is missing")
    run_id, count = run_dir_id(path) if run_id is None else run_id, after[0] if after else 0
    lines = _file_lines(path, after[2] if after else 0) if lines is None else lines
    try:
        for event, raw, digest in _check_lines(path, lines, key, run_id, expect, after):
            count = event["seq"]
            yield event, raw, digest
    except TornTailError:
        _check_end(path, expect, count, key, closed, truncated)  # a cut outranks a torn tail
        raise
    _check_end(path, expect, count, key, closed, truncated)


def _check_end(path, expect, count, key, closed, truncated):
    seq = expect[0] if expect else count
    if expect and seq == 0 and expect[1] != genesis(key):
        raise IntegrityError(
            path, None, "the expected head is seq 0, but its hash is not this key's genesis"
        )
    if seq > count:
        raise IntegrityError(
            path, count + 1 if count else None, f"truncated: {truncated.format(seq, count)}"
        )
    if closed and count > seq:
        raise IntegrityError(
            path, seq + 1, f"{count - seq} line(s) after the run closed at seq {seq}"
        )


class Verified:
    """The result of verify(): how many lines, the head (seq, hash), and the text files its lines
    name."""

    def __init__(self, path, head, texts=()):
        self.path, self.count, self.head, self.texts = str(path), head[0], head, texts

    def head_text(self):
        return f"{self.head[0]} {self.head[1]}"


def verify(path, *, key=None, expect_head=None, jobs=1, **options):
    """Verify a whole ledger, held to `expect_head` and the options of verified_events(); return
    Verified or raise. `jobs`: worker processes for a regular file (None: one per core, at most 8,
    from PARALLEL_BYTES up); the outcome is the same."""
    key, texts = resolve_key(key) or b"", set()
    start = jobs != 1 and parallel_start(path, key, expect_head, jobs, **options)
    head = tuple(start[:2]) if start else (0, genesis(key))
    for event, _raw, digest in verified_events(
        path, key=key, expect=expect_head, after=start, **options
    ):
        head, named = (event["seq"], digest), event["payload"].get("messages_text")
        named = (named if type(named) is list else []) + [event["payload"].get("answer_text")]
        texts.update(name for name in named if type(name) is str)
    return Verified(path, head, texts)


_SHA256_RE = re.compile(r"[0-9a-f]{64}\Z")


def _text_problem(directory, name):
    """What is wrong with the text file `name` a line names: not a SHA-256, missing, or changed."""
    if not _SHA256_RE.match(name):
        return f"{printable(name[:80])!r} is not a SHA-256"
    try:
        data = (directory / name).read_bytes()
    except OSError as exc:
        return error_text(named_error(exc, directory / name))
    return None if line_hash(data) == name else f"{directory / name}: changed"


def _text_checked(path, result, strict):
    """A verified ledger's named text files: any missing or changed is a failure with --text (
    `strict`), else a warning."""
    problems = list(filter(None, (_text_problem(text_dir(path), n) for n in sorted(result.texts))))
    if problems and strict:
        return IntegrityError(path, None, f"text store: {len(problems)} bad; {problems[0]}")
    if problems:
        warn(f"{path}: text store: {len(problems)} bad (--text fails on it); {problems[0]}")
    return result


# ----------------------------------------------------------------------------
# Parallel verify: workers vouch for byte ranges, this process continues the check after them
# ----------------------------------------------------------------------------

PARALLEL_BYTES = 4 << 20  # below this, forking costs more than it saves (make bench)


def _line_ranges(path, jobs):
    """[(begin, stop), ...]: a regular file cut at line ends into `jobs` byte ranges (None: one per
    core, at most 8, from PARALLEL_BYTES up), the bytes after its last newline left out; None: read
    it in one process (not a regular file, which may read only once; a line over the limit)."""
    if not os.path.isfile(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # the one-process path says why, in its turn
        return None
    try:
        size = os.fstat(fd).st_size
        jobs = jobs or (min(os.cpu_count() or 1, 8) if size >= PARALLEL_BYTES else 1)
        cuts = [_rfind_newline(fd, size * i // jobs) for i in range(1, jobs + 1)]
    finally:
        os.close(fd)
    if jobs < 2 or None in cuts:
        return None
    bounds = sorted({0, *(cut + 1 for cut in cuts)})
    return list(zip(bounds, bounds[1:]))


def parallel_start(path, key, expect, jobs, run_id=None, lines=None, fold=None, **_options):
    """Check a ledger's lines in forked workers, one of _line_ranges() each, and return the [seq,
    hash, offset] after the last line they vouch for in one unbroken chain from line 1, or None.
    The check continues from there in this process, so any failure, a torn tail and the end are
    found and worded by the one-process path. (A thread could hold a lock that a forked child
    would wait on forever.) With `fold`, each worker also returns fold(its (event, raw line)
    pairs); then this returns (state, [fold's answers in file order]) only when every range was
    vouched for."""
    ranges = lines is None and _line_ranges(path, jobs)
    if not ranges or threading.active_count() > 1 or not fold and _names_text(path):
        return None
    run_id, folds = run_dir_id(path) if run_id is None else run_id, []
    state = [0, genesis(key), 0]
    for result in _in_children(
        _check_range, [(path, key, expect, run_id, *pair, fold) for pair in ranges]
    ):
        if not result or result[0] != state:
            break
        state = result[1]
        if result[2]:
            break
        folds.append(result[3])
    return state if fold is None else len(folds) == len(ranges) and (state, folds)


def _names_text(path):
    """Whether a line may name text-store files (--store-text): verify then reads every line in
    this process, which gathers the names; workers return none. A bare key can only be a key: a
    quote inside a JSON string is escaped."""
    keys, tail = (b'"messages_text":', b'"answer_text":'), b""
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            if any(k in tail + chunk for k in keys):
                return True
            tail = chunk[-16:]
    return False


def _check_range(path, key, expect, run_id, begin, stop, fold=None):
    """In a worker: check the lines from byte `begin` to `stop`, from the seq and prev the first
    one claims. Returns (that claimed state, the state after the last good line, whether a line
    failed, what `fold` returned for their (event, raw line) pairs); a state is [seq, hash,
    offset]."""
    with open(path, "rb") as handle:
        handle.seek(begin)
        first = handle.readline(MAX_LINE_BYTES)[:-1]
    claim = _claim(first)
    if not claim:
        return None
    state = claimed = [claim[0] - 1, claim[1], begin]

    def lines():
        nonlocal state
        for event, body, digest in _check_lines(
            path, _file_lines(path, begin), key, run_id, expect, claimed
        ):
            state = [state[0] + 1, digest, state[2] + len(body) + 1]
            yield event, body
            if state[2] >= stop:
                break

    try:  # verify's fold, all(), reads every pair and keeps none
        folded = (fold or all)(lines())
    except (LedgerError, OSError):
        return claimed, state, True, None
    return claimed, state, False, folded


def _leaf_hashes(lines):
    """make_checkpoint()'s fold: the tree leaf hash of each line."""
    return [hashlib.sha256(b"\0" + body).digest() for _event, body in lines]


def _in_children(work, calls):
    """[work(*args) for args in calls], each in a child forked for it that sends its answer back
    pickled on a pipe, written in full and read to the end child by child (an answer may be
    megabytes); None for a child that failed or could not be forked."""
    children = []
    for args in calls:
        try:
            rfd, wfd = os.pipe()
        except OSError:
            break
        try:
            pid = os.fork()
        except OSError:
            os.close(rfd), os.close(wfd)
            break
        if pid == 0:
            try:
                answer = memoryview(pickle.dumps(work(*args)))
                while answer:
                    answer = answer[os.write(wfd, answer) :]
            finally:
                os._exit(0)
        os.close(wfd)
        children.append((pid, rfd))
    answers = []
    for pid, rfd in children:
        with open(rfd, "rb") as pipe:
            answer = pipe.read()
        # a child killed on its way (a status) may have sent part of an answer
        answers.append(None if os.waitpid(pid, 0)[1] or not answer else pickle.loads(answer))
    return answers


def run_heads(runs_dir, *, key=None):
    """Yield (run id, (head seq, head hash)) for each closed run runs_dir/index.jsonl records,
    reading the index as read_events() does (nothing when there is none)."""
    index = Path(runs_dir) / INDEX_NAME
    for event in read_events(index, key=key) if index.is_file() else ():
        entry = event["payload"]
        if event["kind"] == "run_closed" and type(entry.get("run")) is str:
            yield entry["run"], (entry.get("head_seq"), entry.get("head_hash"))


def run_ledgers(runs_dir, key=None):
    """[(path, expected head or None)]: index.jsonl, every run (a closed one with its index head),
    then the runs the index names whose events.jsonl is missing. The index is read as far as it
    verifies."""
    runs_dir, heads = Path(runs_dir), {}
    with contextlib.suppress(LedgerError, OSError):
        for run_id, head in run_heads(runs_dir, key=key):
            heads[run_id] = head
    index, found = runs_dir / INDEX_NAME, {p.parent.name for p in runs_dir.glob(f"*/{EVENTS_NAME}")}
    return ([(index, None)] if index.exists() else []) + [
        (runs_dir / run_id / EVENTS_NAME, heads.get(run_id))
        for run_id in sorted(found) + sorted(set(heads) - found)
    ]


def verify_runs(runs_dir, *, key=None, jobs=1):
    """Yield (path, Verified or the exception) for each of run_ledgers(), a closed run held to its
    index head (`closed`)."""
    for path, expect in run_ledgers(runs_dir, key):
        try:
            yield path, verify(path, key=key, expect_head=expect, closed=True, jobs=jobs)
        except (LedgerError, OSError) as exc:
            yield path, exc


# ----------------------------------------------------------------------------
# A run summed up: agent.py writes the events, and every reader of a run asks here
# ----------------------------------------------------------------------------

# A run's summary, field by field, as it starts (docs/audit.md, "Agent runs"): the counts, steps
# to errors, at 0.
_RUN = dict.fromkeys(
    "run_id started outcome judge_verdict steps tools_allowed tools_denied model_calls "
    "input_tokens output_tokens usage_calls est_tokens errors why proposal unboxed".split()
)
_RUN.update(dict.fromkeys(list(_RUN)[4:13], 0), outcome="open")
# A model_call's token fields, each summed into this field of the run.
_CALL_TOKENS = dict(
    pair.split(":")
    for pair in "input_tokens:input_tokens output_tokens:output_tokens est_input_tokens:est_tokens "
    "est_output_tokens:est_tokens".split()
)


def run_summary(events=(), **fields):
    """How an agent run is summed up from its events, `fields` (its run_id) given: when it started,
    its outcome (`open` until run_closed), the judge's verdict, steps, tools allowed and denied,
    model calls, tokens reported (by `usage_calls` of them) and estimated, errors, why it ended, the
    proposal, and why its programs ran without a sandbox (None when they ran in one)."""
    run = dict(_RUN, **fields)
    for event in events:
        add_run_event(run, event)
    return run


def add_run_event(run, event):
    """Add one event to a run_summary(). A field of a type agent.py or ask.py does not write is
    absent."""
    kind, get = event["kind"], event["payload"].get

    def typed(name, want=str, default=None):
        value = get(name)
        return value if type(value) is want else default

    run["started"], why = run["started"] or event["at"], None
    if kind == "model_call":
        for name, total in _CALL_TOKENS.items():
            run[total] += typed(name, int, 0)
        run["model_calls"] += 1
        run["usage_calls"] += int in (type(get("input_tokens")), type(get("output_tokens")))
        run["errors"] += type(get("error_type")) is str
    elif kind in ("model_proposed", "proposal_malformed"):
        run["steps"] = max(run["steps"], typed("step", int, run["steps"] + 1))
    elif kind in ("tool_allowed", "tool_denied"):
        run[kind.replace("tool_", "tools_")] += 1
    elif kind == "error":
        run["errors"] += 1
        code = get("error_code")
        why = (
            f"{get('type')}: {get('message')}"
            if get("error_type") is None
            else f"{get('stage') or 'model'}: {get('error_type')}{f' ({code})' if code else ''}"
        )
    elif kind == "judge_verdict":
        run["judge_verdict"] = typed("verdict")
        why = f"judge {get('verdict')}: {get('reason')}"
    elif kind == "run_closed":
        run["outcome"], run["proposal"], why = (
            typed("outcome", str, "closed"),
            typed("proposal"),
            typed("why")
        )
    elif kind == "run_started" and get("sandbox") == "none":
        run["unboxed"] = get("sandbox_reason") or "no reason recorded"
    elif kind == "budget_exhausted":
        why = f"budget {get('limit')}: {get('used')} of {get('max')}"
    elif kind == "stuck":
        unusable = str(get("unusable") or "").split(":")[0]
        why = (
            f"stuck: the same {'unusable ' if unusable else ''}reply {get('repeats')} times"
            f"{f' ({unusable})' if unusable else ''}"
        )
    elif kind == "decision" and get("stage") == "triage":
        why = f"{get('decision')}: {get('rationale')}"
    run["why"] = why or run["why"]  # the last event that says why a run ended wins


# ----------------------------------------------------------------------------
# Command line helpers shared by the toolkit's scripts
# ----------------------------------------------------------------------------

_CONTROL_RE = "[\x00-\x1f\x7f-\x9f\u2028\u2029]"  # compiled on first use (_compiled)


def plural(count, word, many=None):
    """'1 call', '2 calls', '1,000 calls' (`many`: the plural when it is not word + s)."""
    return f"{count:,} {word if count == 1 else many or word + 's'}"


def printable(value):
    """str(value) with control characters escaped (\\n, \\x1b, \\u2028), so text from a ledger or a
    server can neither forge a line nor drive a terminal."""
    return _compiled(_CONTROL_RE).sub(lambda match: repr(match[0])[1:-1], str(value))


def error(message, secrets=(), label="error"):
    """One 'error: …' line on stderr: secrets masked, control characters escaped."""
    text = redact_text(str(message), secret_values(secrets))
    print(f"{label}: {printable(text)}", file=sys.stderr, flush=True)


def warn(message, secrets=()):
    error(message, secrets, "warning")


_stdout_dead = []  # the OutputError that ended stdout: later writes raise it again


def write_out(text):
    """Write text to stdout and flush. A stdout that is closed, full or cannot encode the text
    raises OutputError; later writes are dropped, and the interpreter's last flush cannot fail."""
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
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        raise _stdout_dead[0] from None


def error_text(exc):
    """One line for an error: 'path: No such file or directory' for OSError, str() otherwise."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc) or type(exc).__name__


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error as the toolkit's one `error: …` line (and a pointer to
    --help)."""

    def error(self, message):
        error(f"{self.prog}: {message} (see {self.prog} --help)")
        raise SystemExit(EXIT_USAGE)


def exit_codes_epilog(*codes):
    return "exit codes:\n" + "\n".join(f"  {c}  {EXIT_CODES[c]}" for c in codes)


def parse_time(text, end=False, now=None):
    """A date (YYYY-MM-DD), an ISO time, `today`, `yesterday`, or an age (`36h`, `7d`: that long
    before now) -> the ledger's `at` string form for comparing. `end` makes a day its last
    microsecond."""
    utc, timedelta = datetime.timezone.utc, datetime.timedelta
    text, now = text.strip(), now or datetime.datetime.now(utc)
    if text in ("today", "yesterday"):
        text = f"{now - timedelta(days=text == 'yesterday'):%Y-%m-%d}"
    age = re.fullmatch(r"([0-9]{1,5})([hd])", text)
    try:
        if age:
            moment = now - timedelta(hours=int(age[1]) * (24 if age[2] == "d" else 1))
        else:  # a date is its first microsecond, or its last with `end`
            moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            moment = moment if moment.tzinfo else moment.replace(tzinfo=utc)
            if end and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text):
                moment += timedelta(days=1, microseconds=-1)
    except ValueError:
        raise UsageError(
            f"not a date, an ISO time, today, yesterday or an age like 7d: {printable(text)!r}"
        ) from None
    return f"{moment.astimezone(utc):%Y-%m-%dT%H:%M:%S.%fZ}"


# Commands that moved to another script answer with one error line naming the new one
# (CHANGELOG.md).
MOVED = {"ship": "fleet.py ship", "verify --from": "fleet.py verify --from"}


def run_main(parser, argv=None, command=None, moved=None):
    """A script's main(): the one error line of a command that moved (`moved`: old spelling -> new;
    answered without importing the new home), else argv parsed and `command`, or the chosen
    subcommand, run. No subcommand shows the help (exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for old, new in (moved or {}).items():
        first, *options = old.split()
        if argv[:1] == [first] and all(
            any(a == o or a.startswith(o + "=") for a in argv[1:]) for o in options
        ):
            error(f"`{parser.prog} {old}` has moved: run `python3 {new}` (see CHANGELOG.md)")
            return EXIT_USAGE
    try:  # argparse exits 0 after the help, or 2 on a usage error
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    command = command or getattr(args, "func", None)
    if command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:  # our errors and OS errors become one error line and their exit code (others are bugs)
        return command(args) or EXIT_OK  # a command that returns nothing succeeded
    except (LedgerError, OSError) as exc:
        error(error_text(exc))
        return getattr(exc, "exit_code", EXIT_USAGE)
    except KeyboardInterrupt:
        error("interrupted")
        return 130


# Arguments as text, one a line: "NAME KEY=VALUE...: help", add_argument's keywords (type=int and
# required=true as those values); a line indented further goes on with the help.
_VALUES = {"int": int, "true": True}
_TARGETS = """
  paths nargs=* metavar=PATH
  --all metavar=RUNS_DIR: also RUNS_DIR/index.jsonl and every run in it"""
_KEY_ENV = f"""
  --key-env default={KEY_ENV} metavar=NAME: environment variable holding the HMAC key
    (default {KEY_ENV})"""


def add_arguments(parser, specs):
    for spec in re.sub(r"\n {3,}", " ", specs).strip().split("\n"):
        words, _sep, text = spec.partition(": ")
        name, *pairs = words.split()
        options = {k: _VALUES.get(v, v) for k, v in (pair.split("=") for pair in pairs)}
        parser.add_argument(name, help=text or None, **options)


def add_targets(parser):
    add_arguments(parser, _TARGETS)


def add_key_env(parser):
    add_arguments(parser, _KEY_ENV)


# ----------------------------------------------------------------------------
# Checkpoints and proofs (docs/checkpoints.md)
# ----------------------------------------------------------------------------

# The interface for our own rooms (fleet.py's witness), docs/checkpoints.md: parse_key,
# read_signer_key, key_text, parse_checkpoint, open_checkpoint, split_notes, sign_note, cosign,
# tree_proof, verify_inclusion, verify_consistency, check_against and the ed25519_* functions.


def _node(left, right):
    return hashlib.sha256(b"\1" + left + right).digest()


class Tree:
    """RFC 6962's Merkle tree hash, built leaf by leaf from the roots of its full subtrees: O(log n)
    memory (fleet.py roots the lines ClickHouse holds with it)."""

    def __init__(self):
        self.size, self.stack = 0, []

    def add(self, leaf, node=None):  # node: the leaf's hash, when a worker made it
        self.size += 1
        node, size = node or hashlib.sha256(b"\0" + leaf).digest(), self.size
        while not size & 1:  # a full subtree: it and the one to its left make one
            node, size = _node(self.stack.pop(), node), size >> 1
        self.stack.append(node)

    def root(self):
        root = self.stack[-1] if self.stack else hashlib.sha256().digest()
        for left in reversed(self.stack[:-1]):
            root = _node(left, root)
        return root


def ledger_leaves(path):
    """A ledger's tree leaves: each complete line without its newline (a torn tail is none)."""
    for raw in _file_lines(path):
        if raw[-1:] == b"\n":
            yield raw[:-1]


def _split(size):  # RFC 6962's k: the largest power of two below size
    return 1 << (size - 1).bit_length() - 1


def _inclusion_ranges(index, lo, hi):  # PATH(index, D[lo:hi]) as the leaf ranges of its hashes
    if hi - lo < 2:
        return []
    mid = lo + _split(hi - lo)
    if index < mid:
        return _inclusion_ranges(index, lo, mid) + [(mid, hi)]
    return _inclusion_ranges(index, mid, hi) + [(lo, mid)]


def _consistency_ranges(old, lo, hi, whole=True):  # SUBPROOF(old, D[lo:hi], whole)
    if old == hi - lo:
        return [] if whole else [(lo, hi)]
    mid = lo + _split(hi - lo)
    if old <= mid - lo:
        return _consistency_ranges(old, lo, mid, whole) + [(mid, hi)]
    return _consistency_ranges(old - mid + lo, mid, hi, False) + [(lo, mid)]


def tree_proof(path, size, index=None, old=None):
    """(proof, root) of the tree of a ledger's first `size` lines, in one pass: the inclusion proof
    of leaf `index`, or the consistency proof from size `old` (RFC 6962, 2.1.1 and 2.1.2)."""
    ranges = (
        _inclusion_ranges(index, 0, size)
        if old is None
        else _consistency_ranges(old, 0, size) if 0 < old < size else []
    )
    ends, hashes, whole, part = dict(ranges), {}, Tree(), None
    for leaf in ledger_leaves(path):
        if whole.size == size:
            break
        if whole.size in ends:
            start, part = whole.size, Tree()
        whole.add(leaf)
        if part:
            part.add(leaf)
            if start + part.size == ends[start]:
                hashes[start], part = part.root(), None
    if whole.size < size:
        raise IntegrityError(path, None, f"cut: the ledger has {whole.size} lines, not {size}")
    return [hashes[lo] for lo, _hi in ranges], whole.root()


def _climb(fn, sn, node, proof, old_node=None):
    """RFC 9162's walk up a proof from node index fn of last index sn: (old_node, node), the roots
    it gives, or (None, None)."""
    for sibling in proof:
        if sn == 0:
            return None, None
        if fn & 1 or fn == sn:
            old_node, node = old_node and _node(sibling, old_node), _node(sibling, node)
            while fn and not fn & 1:
                fn, sn = fn >> 1, sn >> 1
        else:
            node = _node(node, sibling)
        fn, sn = fn >> 1, sn >> 1
    return (old_node, node) if sn == 0 else (None, None)


def verify_inclusion(leaf, index, size, proof, root):
    """True when `proof` shows `leaf` is leaf `index` of the tree of `size` leaves with `root`
    (RFC 9162, 2.1.3.2)."""
    leaf_hash = hashlib.sha256(b"\0" + leaf).digest()
    return 0 <= index < size and _climb(index, size - 1, leaf_hash, proof)[1] == root


def verify_consistency(old_size, old_root, size, root, proof):
    """True when `proof` shows the tree of `size` leaves with `root` extends the tree of `old_size`
    with `old_root` (RFC 9162, 2.1.4.2); from size 0 every tree does, with an empty proof."""
    if old_size in (0, size) or old_size > size:
        return not proof and old_size <= size and (old_size == 0 or old_root == root)
    proof = ([old_root] if old_size & (old_size - 1) == 0 else []) + list(proof)
    fn, sn = old_size - 1, size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    return bool(proof) and _climb(fn, sn, proof[0], proof[1:], proof[0]) == (old_root, root)


# Ed25519 (RFC 8032, 5.1) on points in extended coordinates (X, Y, Z, T), x = X/Z, y = Y/Z.
_P = 2**255 - 19
_L = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, -1, _P) % _P


def _ed_add(p, q):
    (x1, y1, z1, t1), (x2, y2, z2, t2) = p, q
    a, b = (y1 - x1) * (y2 - x2) % _P, (y1 + x1) * (y2 + x2) % _P
    c, d = 2 * t1 * t2 * _D % _P, 2 * z1 * z2 % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


def _ed_mul(scalar, point):
    result = (0, 1, 1, 0)
    while scalar:
        if scalar & 1:
            result = _ed_add(result, point)
        point, scalar = _ed_add(point, point), scalar >> 1
    return result


def _ed_encode(point):
    inverse = pow(point[2], -1, _P)
    x, y = point[0] * inverse % _P, point[1] * inverse % _P
    return (y | (x & 1) << 255).to_bytes(32, "little")


def _ed_decode(data):  # the point, or None
    y = int.from_bytes(data, "little")
    sign, y = y >> 255, y & ((1 << 255) - 1)
    x2 = (y * y - 1) * pow(_D * y * y + 1, -1, _P) % _P
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * pow(2, (_P - 1) // 4, _P) % _P
    if y >= _P or (x * x - x2) % _P or (x == 0 and sign):
        return None
    if x & 1 != sign:
        x = _P - x
    return x, y, 1, x * y % _P


_B = _ed_decode((4 * pow(5, -1, _P) % _P).to_bytes(32, "little"))


def _ed_int(*parts):  # a hash as a scalar
    return int.from_bytes(hashlib.sha512(b"".join(parts)).digest(), "little") % _L


def _ed_secret(seed):
    digest = hashlib.sha512(seed).digest()
    return int.from_bytes(digest[:32], "little") & (1 << 254) - 8 | 1 << 254, digest[32:]


def ed25519_public(seed):
    """The 32-byte public key of a 32-byte Ed25519 seed (the RFC's secret key)."""
    return _ed_encode(_ed_mul(_ed_secret(seed)[0], _B))


def ed25519_sign(seed, message):
    scalar, prefix = _ed_secret(seed)
    nonce = _ed_int(prefix, message)
    r = _ed_encode(_ed_mul(nonce, _B))
    k = _ed_int(r, ed25519_public(seed), message)
    return r + ((nonce + k * scalar) % _L).to_bytes(32, "little")


def ed25519_verify(public, message, signature):
    point = _ed_decode(public) if len(public) == 32 and len(signature) == 64 else None
    s = int.from_bytes(signature[32:], "little")
    if point is None or s >= _L:
        return False
    k = _ed_int(signature[:32], public, message)
    minus_a = (_P - point[0], point[1], 1, _P - point[3])
    return _ed_encode(_ed_add(_ed_mul(s, _B), _ed_mul(k, minus_a))) == signature[:32]


# C2SP signed notes: keys, notes, tlog-checkpoint bodies and tlog-cosignatures.
NoteKey = collections.namedtuple("NoteKey", "name kid kind public seed")
Checkpoint = collections.namedtuple("Checkpoint", "origin size root body")
SIGNER, COSIGNER = 1, 4  # the key types: a log's signer, a witness's cosigner
_PRIVATE = "PRIVATE+KEY+"
# patterns compiled on first use (_compiled): a plain append never needs them
_NAME_RE = r"[^\s+\x00-\x1f\x7f]+\Z"
_SIG_RE = "\u2014 ([^\\s+]+) ([A-Za-z0-9+/]+=*)\\Z"
_CHECKPOINT_RE = r"([^\n]+)\n(0|[1-9][0-9]{0,18})\n([A-Za-z0-9+/]{43}=)\n(?:[^\n]+\n)*\Z"
_PROOF_RE = (
    r"c2sp\.org/tlog-proof@v1\n(?:extra [A-Za-z0-9+/=]*\n)?index (0|[1-9][0-9]{0,18})\n"
    r"((?:[A-Za-z0-9+/]{43}=\n){0,63})\n"
)


def _b64(data):
    return base64.b64encode(data).decode()


def _proof_lines(hashes):
    return "".join(f"{_b64(h)}\n" for h in hashes)


def _unb64(text):  # b"" for what is not base64

    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        return b""


def _key_id(name, kind, public):
    return hashlib.sha256(name.encode() + b"\n" + bytes([kind]) + public).digest()[:4]


def key_text(key, secret=False):
    """A NoteKey as text: its verifier key, or with `secret` its signer key."""
    data = bytes([key.kind]) + (key.seed if secret else key.public)
    return f"{_PRIVATE if secret else ''}{key.name}+{key.kid.hex()}+{_b64(data)}"


def parse_key(text, secret=False):
    """A verifier key (NAME+KEYID+BASE64), or with `secret` a signer key (PRIVATE+KEY+...), as a
    NoteKey. It splits at its first two `+` only, as base64 holds `+`. Raises UsageError."""
    text = text.strip()
    if text.startswith(_PRIVATE) != secret:
        raise UsageError(
            "want a signer key, as keygen writes it"
            if secret
            else "a signer key is a secret: give its verifier key (keygen printed it)"
        )
    name, kid, data = (text[len(_PRIVATE) * secret :].split("+", 2) + ["", ""])[:3]
    raw = _unb64(data)
    if not _compiled(_NAME_RE).match(name) or len(raw) != 33 or raw[0] not in (SIGNER, COSIGNER):
        raise UsageError(f"not a signed-note Ed25519 key: {'…' if secret else text[:80]}")
    public = ed25519_public(raw[1:]) if secret else raw[1:]
    if kid != _key_id(name, raw[0], public).hex():
        raise UsageError(f"the key {name}: its key ID {kid} does not match the key")
    return NoteKey(name, bytes.fromhex(kid), raw[0], public, raw[1:] if secret else None)


def read_signer_key(path):
    """The signer key in a file only its owner can read (any group or other bit is refused, as ssh
    refuses)."""
    with open(path, "rb") as handle:
        mode, text = os.fstat(handle.fileno()).st_mode & 0o777, handle.read(4096)
    if mode & 0o077:
        raise UsageError(f"{path}: a signer key file must be private (mode {mode:o}): chmod 600 it")
    return parse_key(text.decode("utf-8", "replace"), secret=True)


def _signature_line(key, signature):
    return f"\u2014 {key.name} {_b64(key.kid + signature)}\n"


def sign_note(body, key):
    """A signed note: `body` (lines ending in a newline), an empty line, `key`'s signature line."""
    return f"{body}\n{_signature_line(key, ed25519_sign(key.seed, body.encode()))}"


def _cosigned(body, timestamp):
    return f"cosignature/v1\ntime {timestamp}\n{body}".encode()


def cosign(body, key, timestamp):
    """A witness's tlog-cosignature line for a checkpoint body: a COSIGNER key, POSIX seconds."""
    signature = ed25519_sign(key.seed, _cosigned(body, timestamp))
    return _signature_line(key, timestamp.to_bytes(8, "big") + signature)


def split_notes(text):
    """The signed notes of a checkpoint file, oldest first (LEDGER.checkpoints holds several, one
    empty line between)."""
    parts = text.split("\n\n")
    if len(parts) % 2:
        return [text]
    return [f"{parts[i]}\n\n{parts[i + 1]}\n" for i in range(0, len(parts) - 2, 2)] + [
        "\n\n".join(parts[-2:])
    ]


def parse_checkpoint(text, where="checkpoint"):
    """A signed checkpoint note, unverified -> (Checkpoint, [(name, key ID, signature)]). Raises
    IntegrityError naming what is wrong."""
    body, _sep, block = text.rpartition("\n\n")
    problem = (
        "a control character in the note"
        if _compiled(_CONTROL_RE).search(text.replace("\n", ""))
        else (
            "truncated: the note does not end in a newline"
            if not text.endswith("\n")
            else "not a signed note: no empty line before the signatures" if not body else None
        )
    )
    signatures, match = [], _compiled(_CHECKPOINT_RE).match(body + "\n")
    for line in block[:-1].split("\n") if not problem else ():
        found = _compiled(_SIG_RE).match(line)
        raw = _unb64(found[2]) if found else b""
        if len(raw) < 5:
            problem = f"malformed signature line {line[:60]!r}"
            break
        signatures.append((found[1], raw[:4], raw[4:]))
    if not problem and not match:
        problem = "malformed checkpoint: want an origin, a tree size and a base64 root, one a line"
    if problem:
        raise IntegrityError(where, None, problem)
    origin, size, root = match.groups()
    return Checkpoint(origin, int(size), base64.b64decode(root), f"{body}\n"), signatures


def open_checkpoint(text, keys, witnesses=(), needed=None, where="checkpoint"):
    """A signed checkpoint checked by the signed-note rules -> (Checkpoint, names of its verified
    signers): unknown signers are ignored, a known one's signature must verify, one of `keys` must
    have signed and `needed` (default: all) of `witnesses` cosigned (tlog-cosignature/v1)."""
    checkpoint, signatures = parse_checkpoint(text, where)
    known, signed, wrong = {(k.name, k.kid): k for k in (*keys, *witnesses)}, [], None
    for name, kid, signature in signatures:
        key, message = known.get((name, kid)), checkpoint.body.encode()
        if not key:
            if any(k.name == name for k in known.values()):
                wrong = (
                    f"wrong key ID: the signature by {name} has key ID {kid.hex()}, not the key's"
                )
            continue
        if key.kind == COSIGNER:
            message = _cosigned(checkpoint.body, int.from_bytes(signature[:8], "big"))
            signature = signature[8:]
        if not ed25519_verify(key.public, message, signature):
            raise IntegrityError(where, None, f"the signature by {name} does not verify")
        signed.append(key)
    needed = len(witnesses) if needed is None else needed
    cosigned = len(set(signed) & set(witnesses))
    if not set(signed) & set(keys):
        raise IntegrityError(
            where,
            None,
            wrong or f"signed by no key given (signers: {', '.join(s[0] for s in signatures)})"
        )
    if cosigned < needed:
        raise IntegrityError(
            where, None, f"cosigned by {cosigned} of the {needed} witnesses needed"
        )
    return checkpoint, [k.name for k in dict.fromkeys(signed)]


def check_against(path, checkpoint, earlier=(), since=None, key=None):
    """Hold a ledger to a checkpoint: its first `size` lines give its root (and a verified `since`'s
    size its root), then verify(path, key=key). A failure names a cut, a fork after one of the
    `earlier` checkpoints, a changed line, or a rebuild."""
    earlier = [*earlier, since] if since else earlier
    sizes, tree = {c.size for c in earlier} | {checkpoint.size}, Tree()
    roots, top = {0: tree.root()}, max(sizes)
    for leaf in ledger_leaves(path):
        if tree.size == top:
            break
        tree.add(leaf)
        if tree.size in sizes:
            roots[tree.size] = tree.root()
    try:
        result = verify(path, key=key)
    except IntegrityError as exc:
        result = exc
    size = checkpoint.size
    matched = max([c.size for c in earlier if roots.get(c.size) == c.root], default=0)
    if roots.get(size) != checkpoint.root:
        reason = (
            f"a line changed ({str(result)[len(result.path) + 2 :]})"
            if type(result) is IntegrityError  # the chain breaks; a torn tail is no change
            else (
                f"cut: the checkpoint covers {size} lines, the ledger has {tree.size}"
                if size not in roots
                else (
                    f"forked after line {matched}, where an earlier checkpoint matches"
                    if matched
                    else "rebuilt, or forked before any earlier checkpoint"
                )
            )
        ) + (f": its first {size} lines do not give the checkpoint's root" if size in roots else "")
    elif since and roots[since.size] != since.root:
        reason = f"forked: the checkpoint does not extend the earlier one of size {since.size}"
    elif isinstance(result, IntegrityError):
        raise result
    else:
        return result
    raise IntegrityError(path, None, reason)


def cli_keys(values, kind):
    """--vkey / --witness values (fleet.py's too): key texts, or files that hold them."""
    keys = [parse_key(Path(v).read_text() if os.path.isfile(v) else v) for v in values or ()]
    for key in keys:
        if key.kind != kind:
            raise UsageError(f"the key {key.name} has type {key.kind}, not {kind}")
    return keys


def _read_text(path):
    """A checkpoint or proof file's text; IntegrityError when it is not UTF-8, as notes must be."""
    try:
        return Path(path).read_bytes().decode()
    except UnicodeDecodeError as exc:
        raise IntegrityError(path, None, f"not UTF-8 (byte {exc.start})") from None


def _open_cli_checkpoint(args, text, where):
    """`text`'s newest note checked with --vkey and --witness -> (Checkpoint, signers, keys)."""
    keys, witnesses = cli_keys(args.vkey, SIGNER), cli_keys(args.witness, COSIGNER)
    needed = len(witnesses) if args.witnesses_needed is None else args.witnesses_needed
    if not keys or not 0 <= needed <= len(witnesses):
        raise UsageError("want --vkey KEY, and --witnesses-needed N up to the --witness keys given")
    return (*open_checkpoint(split_notes(text)[-1], keys, witnesses, needed, where), keys)


def _verify_checkpoint(args):
    if len(args.paths) != 1 or args.all or not args.checkpoint:
        raise UsageError("--checkpoint FILE (and --vkey, --since, --witness) go with one PATH")
    path, since, suffix = args.paths[0], None, ""
    try:
        text = _read_text(args.checkpoint)
        checkpoint, signers, keys = _open_cli_checkpoint(args, text, args.checkpoint)
        earlier = []
        for note in split_notes(text)[:-1]:  # unverified: they only name a fork
            with contextlib.suppress(IntegrityError):
                earlier.append(parse_checkpoint(note)[0])
        if args.since:
            since = open_checkpoint(
                split_notes(_read_text(args.since))[-1], keys, where=args.since
            )[0]
            if (since.origin, since.size > checkpoint.size) != (checkpoint.origin, False):
                raise IntegrityError(args.since, None, "not an earlier checkpoint of this log")
        result = check_against(path, checkpoint, earlier, since, cli_key(args))
        suffix = f"  checkpoint {checkpoint.size} signed by {', '.join(signers)}"
    except IntegrityError as exc:
        result = exc
    return tally([(path, result, suffix)])


def _cmd_keygen(args):
    if not _compiled(_NAME_RE).match(args.name):
        raise UsageError(f"a key name has no white space or `+`: {args.name!r}")
    kind, seed = COSIGNER if args.cosigner else SIGNER, os.urandom(32)
    public = ed25519_public(seed)
    key = NoteKey(args.name, _key_id(args.name, kind, public), kind, public, seed)
    try:
        _write_file(args.out, f"{key_text(key, secret=True)}\n".encode(), os.O_EXCL)
    except FileExistsError:
        raise UsageError(f"{args.out} exists: keygen never overwrites a key") from None
    write_out(f"{key_text(key)}\n")


def _cmd_checkpoint(args):
    key = read_signer_key(args.key)
    write_out(make_checkpoint(args.path, key, origin=args.origin, append=args.append))


def _cmd_prove(args):
    if (args.seq is None) == (args.consistency is None) or len(args.consistency or ()) > 2:
        raise UsageError("prove takes SEQ --checkpoint FILE, or --consistency M [N]")
    if args.consistency:
        old, *size = args.consistency
        size = size[0] if size else sum(1 for _leaf in ledger_leaves(args.path))
        if not 0 <= old <= size:
            raise UsageError(f"--consistency {old} {size}: want 0 <= M <= N")
        return write_out(_proof_lines(tree_proof(args.path, size, old=old)[0]))
    if not args.checkpoint:
        raise UsageError("prove SEQ needs --checkpoint FILE")
    note = split_notes(_read_text(args.checkpoint))[-1]
    checkpoint = parse_checkpoint(note, args.checkpoint)[0]
    if not 0 < args.seq <= checkpoint.size:
        raise UsageError(f"line {args.seq} is not among the checkpoint's {checkpoint.size}")
    proof, root = tree_proof(args.path, checkpoint.size, index=args.seq - 1)
    if root != checkpoint.root:
        raise IntegrityError(args.path, None, "does not give the checkpoint's root: verify it")
    write_out(f"c2sp.org/tlog-proof@v1\nindex {args.seq - 1}\n{_proof_lines(proof)}\n{note}")


def _cmd_verify_proof(args):
    text = _read_text(args.proof)
    found = _compiled(_PROOF_RE).match(text)
    if not found:
        raise IntegrityError(args.proof, None, "not a c2sp.org/tlog-proof@v1 proof")
    checkpoint, signers, _keys = _open_cli_checkpoint(args, text[found.end() :], args.proof)
    line, index = sys.stdin.buffer.read().removesuffix(b"\n"), int(found[1])
    proof = [base64.b64decode(h) for h in found[2].split()]
    if not verify_inclusion(line, index, checkpoint.size, proof, checkpoint.root):
        raise IntegrityError(
            args.proof, None, f"the line on stdin is not line {index + 1} of the log"
        )
    write_out(
        f"ok    line {index + 1} of {checkpoint.origin} ({checkpoint.size} lines), "
        f"signed by {', '.join(signers)}\n"
    )


# ----------------------------------------------------------------------------
# Checkpoints as ledgers are written (a signing Ledger), and the tree for other rooms
# ----------------------------------------------------------------------------


def make_checkpoint(path, signer, *, origin=None, key=None, append=False):
    """A ledger's signed checkpoint (origin: the key's name), its chain verified first (a torn last
    line is no leaf); with `append` also added to PATH.checkpoints, fsync'd."""
    origin = origin or signer.name
    if signer.kind != SIGNER or not origin.strip() or _compiled(_CONTROL_RE).search(origin):
        raise UsageError("a checkpoint needs a log key (not --cosigner) and a one-line origin")
    tree, got = Tree(), parallel_start(path, resolve_key(key), None, None, fold=_leaf_hashes)
    for leaves in got[1] if got else ():
        for leaf in leaves:
            tree.add(None, leaf)
    with contextlib.suppress(TornTailError):  # a writer is mid-append (or died there)
        for _event, raw, _digest in verified_events(path, key=key, after=got and got[0]):
            tree.add(raw)
    note = sign_note(f"{origin}\n{tree.size}\n{_b64(tree.root())}\n", signer)
    if append:
        _write_file(f"{path}.checkpoints", note.encode(), lead=b"\n")
    return note


def env_signer():
    """The signer key LEDGER_SIGNING_KEY_FILE names (a Ledger's `signer`), or None when unset."""
    path = os.environ.get(SIGNING_KEY_ENV)
    key = read_signer_key(path) if path else None
    if key and key.kind != SIGNER:
        raise UsageError(f"{SIGNING_KEY_ENV}: a log's key, not a witness's (--cosigner)")
    return key


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------


def cli_key(args):
    value = os.environ.get(args.key_env)
    if args.key_env != KEY_ENV and value is None:
        raise UsageError(f"--key-env {args.key_env}: that environment variable is not set")
    return _key_bytes(value) or b""


def check_targets(args, command):
    if not args.paths and not args.all:
        raise UsageError(f"{command} needs a PATH or --all RUNS_DIR")
    if args.all and not Path(args.all).is_dir():
        raise UsageError(f"--all: no such directory: {args.all}")


def verified_line(result):
    return (
        f"ok    {printable(result.path)}  {result.count} line{'' if result.count == 1 else 's'}  "
        f"head {result.head_text()}"
    )


def tally(results, good=verified_line, summary="{}/{} ledgers valid".format, inside="", after=""):
    """One line per (path, result, suffix): good(result) (default: verified_line), FAIL or ERROR;
    then summary(ok, total) (default: N/M ledgers valid).
    Returns the exit code: a FAIL (1) outranks an ERROR (2). `after` may hold {} for 'it' or 'them',
    the failed ledgers."""
    counts, keyless = collections.Counter(), 0
    for path, result, suffix in results:
        if not isinstance(result, BaseException):
            state, line = "ok", good(result)
        elif isinstance(result, IntegrityError):
            state, line = "fail", f"FAIL  {printable(result)}"
        else:
            text, keyless = error_text(result), keyless + isinstance(result, KeyRequiredError)
            state, line = (
                "error",
                f"ERROR {printable(text if text.startswith(str(path)) else f'{path}: {text}')}"
            )
        counts[state] += 1
        write_out(f"{line}{suffix}\n")
    write_out(f"{summary(counts['ok'], sum(counts.values()))}\n")
    if counts["fail"]:
        error(
            f"integrity check failed ({counts['fail']} ledger{'s' if counts['fail'] > 1 else ''}"
            f"{inside}){after.format('them' if counts['fail'] > 1 else 'it')}"
        )
        return EXIT_FAILED
    if counts["error"]:
        error(
            f"{counts['error']} ledger{'s' if counts['error'] > 1 else ''} could not be read"
            + (f" ({keyless} need{'s' if keyless == 1 else ''} a key)" if keyless else "")
        )
        return EXIT_USAGE
    return EXIT_OK


def _cmd_verify(args):
    if args.checkpoint or args.vkey or args.since or args.witness:
        return _verify_checkpoint(args)
    check_targets(args, "verify")
    if args.expect_head is not None and (len(args.paths) != 1 or args.all):
        raise UsageError("--expect-head goes with exactly one PATH")
    expect = parse_head(args.expect_head) if args.expect_head is not None else None
    if args.jobs is not None and args.jobs < 1:
        raise UsageError("--jobs must be 1 or more")
    key, results = cli_key(args), []
    for path in args.paths:
        try:
            results.append((path, verify(path, key=key, expect_head=expect, jobs=args.jobs)))
        except (LedgerError, OSError) as exc:
            results.append((path, exc))
    results += verify_runs(args.all, key=key, jobs=args.jobs) if args.all else []
    return tally(
        [
            (p, r if isinstance(r, BaseException) else _text_checked(p, r, args.text), "")
            for p, r in results
        ]
    )


def _cmd_head(args):
    write_out(f"{verify(args.path, key=cli_key(args), jobs=None).head_text()}\n")


# Payload fields that say what happened, shown on an event's line by `report`.
_REPORT_FIELDS = tuple(
    "stage decision outcome tool rule verdict reason limit request_model response_model error_type "
    "error_code error message".split()
)
_ARTIFACT_RE = re.compile(r"artifacts/[0-9a-f]{64}\Z")


def _artifact(ledger_path, ref):
    if type(ref) is not dict or not _matches(_ARTIFACT_RE, ref.get("path")):
        return ""
    try:
        with open(Path(ledger_path).parent / ref["path"], "rb") as handle:
            return handle.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def _answer_text(ledger_path, name):
    """The text of an answer in the ledger's text store (answer_text), or "" (`name` may be any
    JSON value)."""
    try:
        entry = (
            json.loads((text_dir(ledger_path) / name).read_bytes())
            if _SHA256_RE.match(name)
            else {}
        )
        return "".join(p["text"] for p in entry.get("parts", ()) if p["type"] == "text")
    except (OSError, ValueError, RecursionError, LookupError, TypeError, AttributeError):
        return ""  # not there, or not an entry


def _tests_meaning(path, payload):
    counts = payload.get("counts") if type(payload.get("counts")) is dict else {}
    tally = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    if payload.get("passed") is True:
        return f"tests passed ({tally})" if tally else "tests passed"
    why = "timed out" if payload.get("timed_out") else f"exit {payload.get('returncode')}"
    try:  # not JSON, or not an object: no names
        outcomes = json.loads(_artifact(path, payload.get("outcomes_artifact")) or "{}")
        failed = sorted(
            name for name, outcome in outcomes.items() if outcome in ("failed", "error")
        )
    except (ValueError, AttributeError):
        failed = []
    shown = f"{', '.join(failed[:5])}{f' and {len(failed) - 5} more' if len(failed) > 5 else ''}"
    return f"tests FAILED ({why}{'; ' + tally if tally else ''}){': ' + shown if shown else ''}"


def _event_summary(path, event):
    """The envelope, the fields that say what happened, what it means (a failed check, tests, a
    reply)."""
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
    call = payload.get("call")
    reply = _artifact(
        path, payload.get("response_artifact") or type(call) is dict and call.get("reply_artifact")
    )
    reply = reply or _answer_text(path, payload.get("answer_text"))
    line = next((s.strip() for s in reply.splitlines() if s.strip()), "")
    if line:
        parts.append(f"reply: {line if len(line) <= 120 else line[:119] + '…'}")
    if payload.get("rationale"):
        parts.append(f"-- {payload['rationale']}")
    return "  ".join(printable(p) for p in parts)


def _cmd_report(args):
    check_targets(args, "report")
    key = cli_key(args)
    targets = [(Path(p), None) for p in args.paths] + (
        run_ledgers(args.all, key) if args.all else []
    )
    since = parse_time(args.since) if args.since else ""
    until = parse_time(args.until, True) if args.until else "~"  # after any `at`
    try:
        for path, expect in targets:
            if len(targets) > 1 and not args.json:
                write_out(f"== {printable(path)}\n")
            for event, raw, _digest in verified_events(path, key=key, expect=expect):
                if not (
                    (args.kind and event["kind"] not in args.kind)
                    or (args.stage and event["payload"].get("stage") != args.stage)
                    or (args.run and not event["run_id"].startswith(args.run))
                    or not since <= event["at"] <= until
                ):
                    write_out(f"{raw.decode() if args.json else _event_summary(path, event)}\n")
    except OutputError as exc:
        if not exc.pipe:  # `report | head`: the reader has all it wanted
            raise


def _cmd_append(args):
    text = args.payload
    try:
        if text is None and not sys.stdin.isatty():
            text = sys.stdin.buffer.read().decode()
        payload = json.loads(text) if text and text.strip() else {}
    except UnicodeDecodeError as exc:
        raise PayloadError(f"payload is not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:
        raise PayloadError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise PayloadError(f"payload is nested deeper than {MAX_DEPTH} levels") from None
    if type(payload) is not dict:
        raise PayloadError("payload must be a JSON object")
    key = cli_key(args)
    with Ledger(
        args.path,
        args.run_id or os.environ.get("LEDGER_RUN_ID") or None,
        key=key,
        secrets=(key.decode("utf-8", "replace"),) if key else ()
    ) as ledger:
        ledger.append(args.kind, payload)
        write_out(f"{ledger.head[0]} {ledger.head[1]}\n")


_VKEYS = """
  --vkey action=append metavar=KEY: the log's verifier key, or its file
  --witness action=append metavar=VKEY: a witness's verifier key (repeatable)
  --witnesses-needed type=int metavar=N: default: every --witness"""
# The subcommands, as "NAME: help" and their arguments below (as add_arguments() reads them); each
# runs _cmd_NAME.
_COMMANDS = f"""
verify: check ledgers; exit 1 on any integrity failure{_TARGETS}{_KEY_ENV}
  --expect-head metavar=SEQ:HASH: a head published earlier (finds truncation)
  --text action=store_true: a missing or changed file of the text store (LEDGER.text/) fails
    (default: a warning)
  --jobs type=int metavar=N: worker processes per ledger (default: one per core, at most 8, for 4
    MiB or more)
  --checkpoint metavar=FILE: hold PATH to a signed checkpoint
  --since metavar=FILE: an earlier checkpoint it extends{_VKEYS}
head: print the anchor 'SEQ HASH' of a verified ledger
  path metavar=PATH{_KEY_ENV}
report: one readable line per event: what it says and what it means{_TARGETS}{_KEY_ENV}
  --kind action=append: only this kind (repeatable)
  --stage: only decisions of this stage
  --run: only this run id (or prefix)
  --since: date or ISO time (UTC)
  --until: date (inclusive) or ISO time
  --json action=store_true: print the matching lines unchanged
append: append one event; prints the new head
  path metavar=PATH{_KEY_ENV}
  --kind required=true
  --run-id: default: $LEDGER_RUN_ID or a new id
  --payload: a JSON object (default: stdin when it is not a terminal)
keygen: write a signer key to --out (mode 0600); print its verifier key
  name metavar=NAME
  --out required=true metavar=FILE
  --cosigner action=store_true: a witness key (type 0x04)
checkpoint: verify a ledger, then print its signed checkpoint
  path metavar=PATH
  --key required=true metavar=FILE: the signer key file
  --origin: the log's name (default: the key's)
  --append action=store_true: also add it to PATH.checkpoints
prove: an inclusion proof of line SEQ, or --consistency M [N]
  path metavar=PATH
  seq nargs=? type=int metavar=SEQ
  --checkpoint metavar=FILE
  --consistency nargs=+ type=int metavar=M: M [N]: from size M to N
verify-proof: check that the line on stdin is in the signed log
  proof metavar=PROOF{_VKEYS}"""


def _build_parser():
    parser = ArgumentParser(
        prog="reasoning_ledger.py",
        description="Append-only, hash-chained JSONL ledger.",
        epilog=exit_codes_epilog(EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_OUTPUT),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for block in re.split(r"\n(?=\S)", _COMMANDS.strip()):
        line, _nl, specs = block.partition("\n")
        name, _sep, text = line.partition(": ")
        command = sub.add_parser(name, help=text)
        command.set_defaults(func=globals()[f"_cmd_{name.replace('-', '_')}"])
        add_arguments(command, specs)
    return parser


def main(argv=None):
    return run_main(_build_parser(), argv, moved=MOVED)


if __name__ == "__main__":
    sys.exit(main())
