#!/usr/bin/env python3
"""fleet.py -- ledgers of many boxes in one ClickHouse: ship them, verify them there again.

Usage:
  python3 fleet.py ship PATH... [--all RUNS_DIR] [--to URL]     # URL or LEDGER_SHIP_URL; for cron
  python3 fleet.py verify [--from [URL]] [--ledger-id ID] [--expect-head SEQ:HASH] [--vkey KEY]
  python3 fleet.py witness --listen HOST:PORT --key FILE --logs FILE [--ledger FILE]
  python3 fleet.py witness-push LEDGER URL --witness VKEY       # for cron

`ship` sends only lines it verified, resumes where ClickHouse stops, and never sends a torn tail;
`verify` re-verifies every shipped ledger from its stored lines, as `reasoning_ledger.py verify`
does a file, and holds them to the signed checkpoints shipped beside them. `witness` is a C2SP
tlog-witness on another box; `witness-push` gets its cosignature (docs/checkpoints.md).
`audit.py --from URL` and `agent.py run --ship-to URL` read and write through here.
ClickHouse's user and password come from CLICKHOUSE_USER and CLICKHOUSE_PASSWORD. Exit codes are
the toolkit's (reasoning_ledger.EXIT_CODES): 0 ok, 1 an integrity failure or an unreachable
server, 2 usage, configuration or refusal, 5 stdout could not be written.
"""

import argparse
import base64
import collections
import contextlib
import datetime
import functools
import hashlib
import itertools
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

# the toolkit beside us, even under -I
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ask  # noqa: E402
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.1.0"
__all__ = ["ClickHouse", "ClickHouseError", "ship", "verify_shipped", "main"]

# ----------------------------------------------------------------------------
# Constants and the ClickHouse client
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
_EPOCH, _SECOND = datetime.datetime(1970, 1, 1), datetime.timedelta(seconds=1)
_STORED_ROW_RE = re.compile(rb"([0-9a-f]{64})\t([0-9]{1,20})\t([0-9a-f]{64})\t")

# The model_call fields the audit reads, and total_tokens, shipped as typed columns. One rule for
# what a malformed field is, which the table and audit.py both use (call_fields), so SQL counts what
# the audit counts: a value is read only as ask.py writes it, and so as its column holds it (String:
# a JSON string, Int64: an integer within Int64, UInt8: true or false, Float64: a finite number).
# Another value is read as None (stored as NULL) and makes the call malformed, unless the field is
# total_tokens, which the audit does not read. ClickHouse 18.16 has no JSON functions to do it.
SHIP_CALL_FIELDS = tuple(
    tuple(column.split())
    for column in (
        "request_model String, response_model String, base_url String, attempt Int64, "
        "error_type String, usage_status String, usage_reported UInt8, latency_ms Float64, "
        "system_fingerprint String, check UInt8, input_tokens Int64, output_tokens Int64, "
        "total_tokens Int64, est_input_tokens Int64, est_output_tokens Int64"
    ).split(", ")
)
# the types read of each kind (None is absent, never malformed), and a number's open range
_READ = {"String": (str,), "Int64": (int,), "UInt8": (bool,), "Float64": (float, int)}
_RANGE = {"Int64": (-1 - (1 << 63), 1 << 63), "Float64": (-math.inf, math.inf)}
_TEXT_RULES = tuple(
    (name, _READ[kind] + (type(None),)) for name, kind in SHIP_CALL_FIELDS if kind not in _RANGE
)
_NUMBER_RULES = tuple(
    (name, _READ[kind] + (type(None),)) + _RANGE[kind]
    for name, kind in SHIP_CALL_FIELDS
    if kind in _RANGE
)


def call_fields(payload):
    """(fields, malformed): each of SHIP_CALL_FIELDS of a model_call payload, None when absent or
    not as ask.py writes it; malformed when a field but total_tokens was not. The audit runs this
    for every call: two loops, as only the numbers have a range to check."""
    fields, malformed = {}, False
    for name, types in _TEXT_RULES:
        value = payload.get(name)
        if type(value) not in types:
            malformed, value = True, None
        fields[name] = value
    for name, types, low, high in _NUMBER_RULES:
        value = payload.get(name)
        if type(value) not in types or value is not None and not low < value < high:
            malformed, value = malformed or name != "total_tokens", None
        fields[name] = value
    return fields, malformed


# ledger_id is the SHA-256 of line 1; `raw` the exact line; line_sha256 its plain SHA-256 (keyed
# ledgers too); at_time `at` in Unix seconds (0 outside 1970..2105).
SHIP_COLUMNS = (
    tuple(
        tuple(column.split())
        for column in (
            "ledger_id String, host String, path String, seq UInt64, run_id String, kind String, "
            "at String, at_time DateTime, raw String, line_sha256 String, prev String, "
            "shipped_at DateTime"
        ).split(", ")
    )
    + tuple((name, f"Nullable({kind})") for name, kind in SHIP_CALL_FIELDS)
    + (("malformed", "UInt8"),)
)


def ship_ddl(database=SHIP_DATABASE, table=SHIP_TABLE):
    """The CREATE TABLE `ship` runs: one row per (ledger_id, seq) once merged; every read uses
    FINAL."""
    columns = ",\n".join(f"    {name} {kind}" for name, kind in SHIP_COLUMNS)
    return (
        f"CREATE TABLE IF NOT EXISTS {database}.{table} (\n{columns}\n) "
        f"ENGINE = ReplacingMergeTree ORDER BY (ledger_id, seq)"
    )


class ClickHouseError(rl.LedgerError):
    """ClickHouse could not be reached (exit 1: worth a retry, and the next run resumes) or refused
    (exit 2)."""

    def __init__(self, message, exit_code=rl.EXIT_FAILED):
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
            raise rl.UsageError(
                f"no ClickHouse URL: pass --to URL or set {SHIP_URL_ENV} "
                "(e.g. http://127.0.0.1:8123)"
            )
        try:  # a URL is never echoed: it may hold a password
            parts = urllib.parse.urlsplit(url)
            self.where = (
                f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
            )
        except ValueError:
            raise rl.UsageError(
                "the ClickHouse URL is not a valid URL (want http://HOST:PORT)"
            ) from None
        if "@" in parts.netloc:
            raise rl.UsageError(
                f"the ClickHouse URL holds a user name or password; set {SHIP_USER_ENV} and "
                f"{SHIP_PASSWORD_ENV} instead (a URL shows in process lists and logs)"
            )
        if parts.scheme not in ("http", "https") or not parts.hostname or "?" in url or "#" in url:
            raise rl.UsageError(
                "the ClickHouse URL must be http[s]://HOST[:PORT], with no query or fragment "
                "(use --database and --table)"
            )
        for what, name in (("--database", database), ("--table", table)):
            if type(name) is not str or not _NAME_RE.match(name):
                raise rl.UsageError(
                    f"{what}: want letters, digits and _ (a ClickHouse name), "
                    f"got {rl.printable(name)!r}"
                )
        if not (timeout > 0 and (deadline is None or deadline > 0)):
            raise rl.UsageError("--timeout and --deadline must be positive numbers")
        self.base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}/"
        self.database, self.table, self.name = database, table, f"{database}.{table}"
        self.timeout, self.retries = float(timeout), int(retries)
        self.ends = time.monotonic() + deadline if deadline else None
        user, password = env.get(SHIP_USER_ENV), env.get(SHIP_PASSWORD_ENV)
        headers = {
            "User-Agent": f"reasoning-ledger-fleet/{__version__}",
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
                if exc.exit_code != rl.EXIT_FAILED:
                    raise ClickHouseError(
                        f"ClickHouse at {self.where}: {exc}", exc.exit_code
                    ) from None
                if attempt > self.retries or (
                    self.ends and self.ends - time.monotonic() < delay + 0.1
                ):
                    took = f"{time.monotonic() - started:.1f} s"
                    raise ClickHouseError(
                        f"ClickHouse at {self.where}: {exc} "
                        f"({attempt} attempt{'s' if attempt != 1 else ''} in {took})"
                    ) from None
                time.sleep(delay)

    def _once(self, sql, data, stream):
        import http.client
        import urllib.error
        import urllib.parse
        import urllib.request

        query = {"wait_end_of_query": 1, "output_format_json_quote_64bit_integers": 0}
        if data is not None:
            query["query"] = sql
        request = urllib.request.Request(
            self.base + "?" + urllib.parse.urlencode(query),
            data=sql.encode() if data is None else data,
            headers=self._headers,
            method="POST"
        )
        seconds = min(self.timeout, self.ends - time.monotonic()) if self.ends else self.timeout
        if seconds <= 0:
            raise ClickHouseError("the --deadline passed")
        deadline = ask.Deadline(None if stream else seconds)
        try:
            response = ask.http_open(request, deadline, timeout=seconds)
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
                else rl.printable(rl.error_text(reason))
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
                f"ClickHouse at {self.where}: an answer that is not JSON lines", rl.EXIT_USAGE
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
                rl.EXIT_USAGE
            )
        if not found:
            self.query(f"CREATE DATABASE IF NOT EXISTS {self.database}")
            self.query(ship_ddl(self.database, self.table))
            found = {row["name"]: row["type"] for row in self.rows(sql)}
        for name, kind in SHIP_COLUMNS:
            if found.get(name) != kind:
                what = f"{name} {found[name]}" if name in found else f"no column {name}"
                raise ClickHouseError(
                    f"ClickHouse at {self.where}: table {self.name} has {what}, want {kind}: it "
                    "was not made by this tool (or by another version); pick another with --table",
                    rl.EXIT_USAGE
                )
        if create:  # the signed checkpoints beside the lines: one row a note, whole
            self.query(
                f"CREATE TABLE IF NOT EXISTS {self.name}_checkpoints (ledger_id String, note "
                "String) ENGINE = ReplacingMergeTree ORDER BY (ledger_id, note)"
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
            rl.EXIT_USAGE
        )
    try:
        text = (exc.read(65536).decode("utf-8", "replace").strip().splitlines() or [""])[0]
    except (OSError, http.client.HTTPException):
        text = ""
    # 18.16's form
    text = re.sub(r"e\.displayText\(\) = (DB::Exception: )?|, e\.what\(\) = .*", "", text)
    answer = f"HTTP {exc.code}: {rl.printable(text[:300]) or 'no message'}"
    if exc.code >= 500 or exc.code in (408, 429):  # worth a retry
        return ClickHouseError(answer)
    hint = f" (check {SHIP_USER_ENV} / {SHIP_PASSWORD_ENV})" if exc.code in (401, 403) else ""
    return ClickHouseError(answer + hint, rl.EXIT_USAGE)


class Shipped:
    """What `ship` did for one ledger: lines first..last sent (none when first > last), its head,
    and the torn tail it stopped at; `resend`: ClickHouse had lost rows, all were sent again."""

    def __init__(self, path, ledger_id, first, last, head, torn=None, resend=False):
        self.path, self.ledger_id, self.first, self.last = str(path), ledger_id, first, last
        self.head, self.torn, self.more = head, torn, head[0] - last
        self.sent = max(0, last - first + 1)
        self.resent = resend and self.sent > 0

    def text(self):
        where = f"{rl.printable(self.path)}  {self.ledger_id[:12]}"
        if not self.sent:
            return f"up to date {where}  head {self.head[0]} {self.head[1]}"
        lines = "line" if self.sent == 1 else "lines"
        what = f"{lines} re-sent" if self.resent else f"new {lines}"
        more = f", {self.more:,} more next run" if self.more else ""
        return (
            f"shipped {where}  {self.sent:,} {what} (seq {self.first}..{self.last}){more}  "
            f"head {self.head[0]} {self.head[1]}"
        )


def _row(base, event, body, line_sha, shipped_at):
    seconds = (datetime.datetime.fromisoformat(event["at"][:19]) - _EPOCH) // _SECOND
    row = dict(
        base,
        at_time=seconds if 0 <= seconds < 1 << 32 else 0,
        line_sha256=line_sha,
        shipped_at=shipped_at,
        raw=body.decode(),
        **{name: event[name] for name in ("seq", "run_id", "kind", "at", "prev")}
    )
    if event["kind"] == "model_call":
        fields, malformed = call_fields(event["payload"])
        row.update(fields, malformed=int(malformed))
    return rl.dumps(row).encode() + b"\n"


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
        rl.run_ledgers(runs_dir, key) if runs_dir else []
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
    """Send the new verified lines of each (path, expected head or None) to ClickHouse. Yields
    (path, Shipped or the LedgerError/OSError that stopped it: nothing of it was sent); a
    ClickHouseError propagates."""
    key, host = rl.resolve_key(key), host or socket.gethostname()
    if not 0 < batch_rows <= SHIP_MAX_BATCH_ROWS:
        raise rl.UsageError(f"--batch-rows must be between 1 and {SHIP_MAX_BATCH_ROWS:,}")
    # {path: SHA-256 of line 1, None without a complete line, or the OSError of reading it}
    ids = {}
    for path, _expect in targets:
        try:
            with open(path, "rb") as handle:
                first = handle.readline(rl.MAX_LINE_BYTES)
            ids[path] = hashlib.sha256(first[:-1]).hexdigest() if first[-1:] == b"\n" else None
        except OSError as exc:
            ids[path] = rl.named_error(exc, path)
    try:
        client.ensure_table()
        wanted, heads = sorted(i for i in set(ids.values()) if type(i) is str), {}
        for i in range(0, len(wanted), 500):  # ClickHouse's max_query_size is 256 KiB
            heads.update(
                (row["ledger_id"], (row["top"], row["sha"], row["n"]))
                for row in client.rows(
                    f"SELECT ledger_id, max(seq) AS top, argMax(line_sha256, seq) AS sha, "
                    f"count() AS n FROM {client.name} FINAL WHERE ledger_id IN "
                    f"({', '.join(map(sql_string, wanted[i:i + 500]))}) GROUP BY ledger_id"
                )
            )
    except ClickHouseError as exc:
        raise (
            exc
            if exc.exit_code != rl.EXIT_FAILED
            else ClickHouseError(f"{exc}; the next run resumes")
        ) from None
    for path, expect in targets:
        try:
            if isinstance(ids[path], OSError):
                raise ids[path]
            shipped = _ship_one(
                client,
                path,
                ids[path],
                heads.get(ids[path]),
                key,
                expect,
                host,
                batch_rows,
                batch_bytes
            )
            yield path, _ship_checkpoints(client, path, shipped)
        except (rl.IntegrityError, rl.KeyRequiredError, OSError) as exc:
            yield path, rl.named_error(exc, path)


def _ship_one(client, path, ledger_id, server, key, expect, host, batch_rows, batch_bytes):
    """Verify the whole ledger while spooling the rows ClickHouse lacks (up to its limit), then send
    them."""
    import tempfile

    held = dict(
        key=key or b"",
        expect=expect,
        truncated="index.jsonl records seq {} but the run ends at seq {}"
    )
    if ledger_id is None:  # no complete line yet
        return Shipped(path, "-" * 12, 1, 0, rl.verify(path, lines=(), **held).head)
    top, top_sha, stored = server or (0, None, 0)
    # ClickHouse lost rows (deleted?): send them all again; FINAL keeps one of each
    resend = stored < top
    start = 0 if resend else top
    # marks: (last seq, spool offset)
    head, torn, last, marks = (0, rl.genesis(key)), None, None, [(start, 0)]
    base = {"ledger_id": ledger_id, "host": host, "path": os.path.abspath(path)}
    limit, shipped_at = _spool_limit(), int(time.time())
    with tempfile.SpooledTemporaryFile(max_size=SHIP_SPOOL_MEMORY) as spool:
        try:
            for event, body, digest in rl.verified_events(path, **held):
                seq, line_sha = event["seq"], hashlib.sha256(body).hexdigest() if key else digest
                if seq == 1 and line_sha != ledger_id:
                    raise rl.IntegrityError(
                        path, 1, "line 1 changed while it was being shipped (the file was replaced)"
                    )
                if seq == top and line_sha != top_sha:
                    raise rl.IntegrityError(
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
        except rl.TornTailError as exc:  # the reader held it to `expect` first
            torn, head = exc, exc.head
        if head[0] < top:
            raise rl.IntegrityError(
                path,
                head[0] + 1,
                f"ClickHouse holds this ledger up to seq {top} but the file ends at seq {head[0]}: "
                "it was cut or rewritten after it was shipped; nothing was sent"
            )
        last = last or head[0]
        marks += [(last, spool.tell())] if last > marks[-1][0] else []
        _send(client, path, spool, marks)
    return Shipped(path, ledger_id, start + 1, last, head, torn, resend)


def _ship_checkpoints(client, path, shipped):
    """Send PATH.checkpoints' notes over lines ClickHouse holds now, each time: FINAL keeps one
    row of each."""
    try:
        with open(f"{path}.checkpoints", encoding="utf-8") as handle:
            notes = rl.split_notes(handle.read())
    except FileNotFoundError:
        return shipped
    rows = [
        rl.dumps({"ledger_id": shipped.ledger_id, "note": note})
        for note in notes
        if 0 < rl.parse_checkpoint(note, handle.name)[0].size <= shipped.last
    ]
    if rows:
        client.query(
            f"INSERT INTO {client.name}_checkpoints FORMAT JSONEachRow", "\n".join(rows).encode()
        )
    return shipped


def _send(client, path, spool, marks):
    """INSERT the spooled rows batch by batch, marks [(last seq, spool offset)] apart."""
    start, last = marks[0][0], marks[-1][0]
    spool.seek(0)
    for (sent, offset), (_seq, end) in zip(marks, marks[1:]):
        try:
            query = f"INSERT INTO {client.name} FORMAT JSONEachRow"
            client.query(query, data=spool.read(end - offset))
        except ClickHouseError as exc:
            raise ClickHouseError(
                f"{exc}; {sent - start:,} of {last - start:,} new lines of {path} were sent, "
                f"the next run resumes at seq {sent + 1}",
                exc.exit_code
            ) from None


# -- verify ---------------------------------------------------------------


def shipped_ledgers(client, condition=""):
    """[{ledger_id, last_host, last_path, n, top}] in the table; `condition` is a SQL WHERE clause
    (trusted)."""
    return client.rows(
        f"SELECT ledger_id, argMax(host, seq) AS last_host, argMax(path, seq) AS last_path, "
        f"count() AS n, max(seq) AS top FROM {client.name} FINAL {condition} GROUP BY ledger_id "
        f"ORDER BY ledger_id"
    )


def verify_shipped(client, *, ledger_ids=(), key=None, expect_head=None, condition=None, vkeys=()):
    """Re-verify the raw lines ClickHouse holds, each row's line_sha256, seq and ledger_id, and the
    roots of the checkpoints shipped (signed by one of `vkeys`, if any). Yields (ledger as
    shipped_ledgers(), Verified or the error); `ledger_ids`: ids or their starts, or a SQL WHERE
    `condition`."""
    for prefix in ledger_ids:
        if not re.fullmatch(r"[0-9a-f]{1,64}", prefix):
            raise rl.UsageError(
                "--ledger-id: want hex digits (a ledger_id or its start), "
                f"got {rl.printable(prefix)!r}"
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
    notes = _shipped_notes(client, where)
    if expect_head is not None and len(listed) > 1:
        raise rl.UsageError(f"--expect-head goes with exactly one ledger; {len(listed)} match")
    for prefix in ledger_ids:
        if not any(found.startswith(prefix) for found in listed):
            yield (
                {"ledger_id": prefix, "last_host": None, "last_path": None, "n": 0},
                rl.IntegrityError(
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
            try:
                yield ledger, _verify_stored(
                    ledger_id,
                    rows,
                    notes[ledger_id],
                    vkeys,
                    key=key,
                    expect_head=expect_head,
                    run_id=rl.run_dir_id(ledger["last_path"] or "")
                )
            except (rl.IntegrityError, rl.KeyRequiredError) as exc:
                yield ledger, exc


def _shipped_notes(client, where):
    """{ledger_id: its checkpoints} as shipped (none in a table an earlier version made)."""
    notes = collections.defaultdict(list)
    if client.query(f"EXISTS TABLE {client.name}_checkpoints").strip() == b"1":
        for row in client.rows(f"SELECT * FROM {client.name}_checkpoints FINAL {where}"):
            notes[row["ledger_id"]].append(row["note"])
    return notes


def _verify_stored(ledger_id, rows, notes, vkeys, **options):
    """verify() of a ledger's stored rows, then its root at each checkpoint shipped with them
    (signed by one of `vkeys`, if any): Verified, with how many checkpoints it holds to."""
    name, roots = f"clickhouse:{ledger_id}", {}
    marks = [
        rl.open_checkpoint(n, vkeys, where=name) if vkeys else rl.parse_checkpoint(n, name)
        for n in notes
    ]
    result = rl.verify(
        name,
        lines=_rooted(_stored_lines(name, ledger_id, rows), marks, roots),
        truncated="the expected head is seq {} but ClickHouse holds up to seq {}",
        **options
    )
    for checkpoint, _signers in marks:
        if roots.get(checkpoint.size) != checkpoint.root:
            raise rl.IntegrityError(
                name,
                None,
                f"its first {checkpoint.size} rows do not give the root a checkpoint shipped with "
                "them signed: rows were rebuilt or deleted"
            )
    result.checkpoints = len(marks)
    return result


# -- audit.py --from ------------------------------------------------------


def _in_range(since, until):
    return "".join(
        f" AND at {op} {sql_string(t)}" for op, t in ((">=", since), ("<=", until)) if t is not None
    )


def shipped_in_range(client, since=None, until=None, verify=True):
    """The ledgers holding a line at since..until (ISO times, or None): (ledger as
    shipped_ledgers(), Verified or the error as verify_shipped() yields, or None without
    `verify`)."""
    client.require_table()
    in_range = _in_range(since, until)
    where = in_range and (
        f"WHERE ledger_id IN (SELECT ledger_id FROM {client.name} WHERE 1{in_range})"
    )
    if verify:
        return verify_shipped(client, condition=where)
    return ((ledger, None) for ledger in shipped_ledgers(client, where))


def events_in_range(client, since=None, until=None):
    """(path, events) per shipped ledger: its events at since..until in seq order, and the path its
    first one was shipped from. Streamed: read a ledger's events before the next."""
    with client.stream(
        f"SELECT ledger_id, path, raw FROM {client.name} FINAL WHERE 1{_in_range(since, until)} "
        f"ORDER BY ledger_id, seq FORMAT JSONEachRow"
    ) as response:
        rows = (json.loads(line) for line in response if line.strip())
        for _ledger, lines in itertools.groupby(rows, key=lambda row: row["ledger_id"]):
            first = next(lines)
            yield first["path"], (json.loads(row["raw"]) for row in itertools.chain([first], lines))


def _stored_rows(response, client):
    """(ledger_id, seq, line_sha256, line) for each TSVRaw row; one of another shape as (last id,
    None, why, b"")."""
    import http.client

    last, read = "", functools.partial(response.readline, rl.MAX_LINE_BYTES + 256)
    try:
        for line in iter(read, b""):
            match = _STORED_ROW_RE.match(line)
            if match is None or line[-1:] != b"\n":
                why = "a stored row is not in the expected shape (too long, or holds a newline?)"
                yield last, None, why, b""
                while line and line[-1:] != b"\n":
                    line = read()
                continue
            last, seq, sha = line[: match.end() - 1].decode().split("\t")
            yield last, int(seq), sha, line[match.end() :]
    except (OSError, http.client.HTTPException) as exc:
        raise ClickHouseError(
            f"ClickHouse at {client.where}: the answer was cut short "
            f"({rl.printable(rl.error_text(exc))})",
            rl.EXIT_USAGE
        ) from None


def _rooted(lines, marks, roots):
    """The lines, and into `roots` the tree's root at each size a checkpoint of `marks` names."""
    tree, sizes = rl.Tree(), {checkpoint.size for checkpoint, _signers in marks}
    for line in lines:
        tree.add(line[:-1])
        if tree.size in sizes:
            roots[tree.size] = tree.root()
        yield line


def _stored_lines(name, ledger_id, rows):
    for expected, (_ledger_id, seq, sha, line) in enumerate(rows, 1):
        if seq is None:
            raise rl.IntegrityError(name, expected, sha)
        if seq != expected:
            raise rl.IntegrityError(
                name,
                expected,
                (
                    f"missing from ClickHouse: the next row stored is seq {seq} (a row was deleted)"
                    if seq > expected
                    else f"seq {seq} comes twice"
                )
            )
        digest = hashlib.sha256(line[:-1]).hexdigest()
        if digest != sha or (seq == 1 and digest != ledger_id):
            raise rl.IntegrityError(
                name,
                seq,
                f"{'line_sha256' if digest != sha else 'ledger_id'} is not the SHA-256 "
                f"of the stored line (the row was altered in ClickHouse)"
            )
        yield line


def _client(args):  # --to or --from (then "" for the environment's URL)
    return ClickHouse(
        args.to or None,
        database=args.database,
        table=args.table,
        timeout=args.timeout,
        deadline=args.deadline
    )


def _cmd_ship(args):
    rl.check_targets(args, "ship")
    key, client = rl.cli_key(args), _client(args)
    sent = []

    def shipped(result):
        sent.append(result.sent)
        torn = result.torn
        try:  # a file that grew past its torn tail since it was read: an append was in progress
            quiet = torn is None or os.path.getsize(torn.path) > torn.offset + torn.length
        except OSError:
            quiet = False
        if not quiet:
            rl.warn(
                f"{torn}; the lines before it were shipped, the torn bytes were not "
                "(a crash, not tampering)"
            )
        return result.text()

    results = ship(
        ship_targets(args.paths, args.all, key),
        client,
        key=key,
        host=args.host,
        batch_rows=args.batch_rows
    )
    return rl.tally(
        ((path, result, "") for path, result in results),
        shipped,
        lambda ok, total: f"{ok}/{total} ledgers shipped or up to date, {sum(sent):,} new lines "
        f"sent to {client.where} {client.name}",
        after="; nothing of {} was shipped"
    )


def _cmd_verify(args):
    expect = rl.parse_head(args.expect_head) if args.expect_head is not None else None
    ids = [i.strip().lower() for i in args.ledger_id or ()]
    if expect is not None and len(ids) != 1:
        raise rl.UsageError("--expect-head goes with exactly one --ledger-id")
    client = _client(args)

    def rows():
        for ledger, result in verify_shipped(
            client,
            ledger_ids=ids,
            key=rl.cli_key(args),
            expect_head=expect,
            vkeys=rl.cli_keys(args.vkey, rl.SIGNER)
        ):
            shown = ledger["last_path"] is not None and isinstance(
                result, (rl.Verified, rl.IntegrityError)
            )
            where = (
                f"  {rl.printable(ledger['last_host'])}:{rl.printable(ledger['last_path'])}"
                if shown
                else ""
            ) + (f"  {result.checkpoints} checkpoints" if getattr(result, "checkpoints", 0) else "")
            yield f"clickhouse:{ledger['ledger_id']}", result, where

    try:
        return rl.tally(
            rows(),
            rl.verified_line,
            lambda ok, total: f"{ok}/{total} ledgers valid in {client.where} {client.name}",
            inside=" in ClickHouse"
        )
    except ClickHouseError as exc:  # ClickHouse could not be read: like a file that cannot be read
        exc.exit_code = rl.EXIT_USAGE
        raise


# ----------------------------------------------------------------------------
# The witness: C2SP tlog-witness's add-checkpoint, served from the shared HTTP kit
# ----------------------------------------------------------------------------


WITNESS_MAX_BODY = 64 * 1024  # 63 proof hashes and a checkpoint fit many times over; 413 beyond
WITNESS_TIMEOUT = 10.0  # seconds for one request, first byte to last
WITNESS_CONNECTIONS = 16  # at once; more get 503
WITNESS_LEDGER = "witness.jsonl"
_TEXT, _SIZE = "text/plain; charset=utf-8", "text/x.tlog.size"


def _refuse(status, message):
    return ask.Refused(status, None, message, {"Content-Type": _SIZE if status == 409 else _TEXT})


class Witness:
    """Cosigns a log's checkpoint only when it extends the last one it cosigned. `logs`: a file of
    `origin vkey` lines. Its state, each origin's last cosigned (size, base64 root), is its own
    ledger: read (and verified) at start, and checked and written, fsync'd, under one lock before
    an answer."""

    def __init__(self, key_file, logs_file, ledger):
        self.signer, self.logs, self.state = rl.read_signer_key(key_file), {}, {}
        if self.signer.kind != rl.COSIGNER:
            raise rl.UsageError(f"{key_file}: not a witness's key (keygen --cosigner makes one)")
        with open(logs_file, encoding="utf-8") as handle:
            for line in handle:
                origin, _, vkey = line.strip().rpartition(" ")
                if line.strip() and not line.startswith("#"):
                    self.logs.setdefault(origin.strip(), []).append(rl.parse_key(vkey))
        with contextlib.suppress(rl.TornTailError):  # a line torn by a crash was never answered
            for event in rl.read_events(ledger) if os.path.exists(ledger) else ():
                held = event["payload"]
                if event["kind"] == "witness_cosigned":
                    self.state[held["origin"]] = (held["size"], base64.b64decode(held["root"]))
        self.book = rl.Ledger(ledger, secrets=[rl.key_text(self.signer, secret=True)])
        self.lock = threading.Lock()

    def add(self, body):
        """The cosignature line for an add-checkpoint body; else raise Refused, as the spec says."""
        try:
            head, _, note = body.decode("utf-8").partition("\n\n")
            old, *proof = head.split("\n")
            old = int(re.fullmatch(r"old (0|[1-9][0-9]{0,18})", old).group(1))
            checkpoint = rl.parse_checkpoint(note, "the request")[0]
            proof = [base64.b64decode(h, validate=True) for h in proof]
        except (ValueError, AttributeError, rl.LedgerError) as exc:
            raise _refuse(400, f"not an add-checkpoint body: {exc}") from None
        origin, size, root = checkpoint.origin, checkpoint.size, checkpoint.body.split("\n")[2]
        if len(proof) > 63 or {len(h) for h in proof} - {32}:
            raise _refuse(400, "want at most 63 proof hashes, 32 bytes each")
        if origin not in self.logs:
            raise _refuse(404, "unknown origin")
        try:
            rl.open_checkpoint(note, self.logs[origin])
        except rl.IntegrityError as exc:
            raise _refuse(403, f"no signature of a key trusted for the origin verifies: {exc}")
        if old > size:
            raise _refuse(400, f"old size {old} is above the checkpoint's size {size}")
        with self.lock:
            held, held_root = self.state.get(origin, (0, b""))
            fork = origin in self.state and size == held and checkpoint.root != held_root
            if old != held or fork:
                self._record(fork and "fork", origin, old, note)
                raise _refuse(409, str(held))
            if not rl.verify_consistency(old, held_root, size, checkpoint.root, proof):
                self._record("bad_proof", origin, old, note)
                raise _refuse(422, "the consistency proof does not verify")
            stamp = int(time.time())
            self.book.append(
                "witness_cosigned", {"origin": origin, "size": size, "root": root, "time": stamp}
            )
            self.state[origin] = (size, checkpoint.root)
        return rl.cosign(checkpoint.body, self.signer, stamp)

    def _record(self, reason, origin, old, note):
        if reason:  # a stale old size is the client's, not evidence: not recorded
            self.book.append(
                "witness_refused",
                {"reason": reason, "origin": origin, "old": old, "checkpoint": note}
            )


class _WitnessHandler(ask.RequestHandler):
    """One request a connection: POST /add-checkpoint, read under one deadline."""

    def allowed(self, path):
        return "POST" if path == "/add-checkpoint" else None

    def handle(self):
        status, head = 200, {"Content-Type": _TEXT}
        try:
            answer = self.server.witness.add(
                self.read_request(self.server.timeout, WITNESS_MAX_BODY, socket.SHUT_RD)
            )
        except ask.Refused as refused:
            status, head, answer = refused.status, refused.headers, refused.message + "\n"
        except ConnectionAbortedError:
            return
        finally:
            self.deadline.cancel()
        with contextlib.suppress(OSError):
            self.wfile.write(ask.http_answer(status, answer.encode(), head.items(), close=True))


def serve_witness(args):
    host, _, port = args.listen.rpartition(":")
    witness = Witness(args.key, args.logs, args.ledger)
    busy = ask.http_answer(503, b"busy\n", [("Content-Type", _TEXT), ("Retry-After", "1")], True)
    try:
        server = ask.CappedServer(
            (host.strip("[]"), int(port)), _WitnessHandler, args.max_connections, busy
        )
    except (OSError, ValueError, OverflowError) as exc:
        raise rl.UsageError(f"--listen {args.listen}: {rl.error_text(exc)}") from None
    server.witness, server.timeout, stop = witness, args.request_timeout, threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True).start()
    rl.write_out(f"witness: {witness.signer.name} on {host}:{server.server_address[1]}\n")
    while not stop.wait(1.0):  # the signal handler runs between waits
        pass
    server.stop(args.request_timeout)
    witness.book.close()
    return rl.EXIT_OK


# -- witness-push ---------------------------------------------------------


def witness_push(ledger, url, vkey, timeout=WITNESS_TIMEOUT):
    """Send LEDGER's newest checkpoint to the witness at `url` with the consistency proof from the
    largest size it cosigned in LEDGER.checkpoints (or 0), once more from the size a 409 names;
    append its cosignature under that checkpoint. Returns the Checkpoint, and False when it was
    cosigned already."""
    sidecar, witness = f"{ledger}.checkpoints", rl.cli_keys([vkey], rl.COSIGNER)
    with open(sidecar, encoding="utf-8") as handle:
        text = handle.read()
    notes, old = rl.split_notes(text), 0
    newest = rl.parse_checkpoint(notes[-1], sidecar)[0]
    for note in notes:
        with contextlib.suppress(rl.IntegrityError):
            old = max(old, rl.open_checkpoint(note, witness)[0].size)
            if note is notes[-1]:
                return newest, False
    for attempt in (1, 2):
        proof = rl.tree_proof(ledger, newest.size, old=old)[0] if old else []
        lines = [f"old {old}", *(base64.b64encode(h).decode() for h in proof), "", notes[-1]]
        status, kind, answer = _post(
            f"{url.rstrip('/')}/add-checkpoint", "\n".join(lines).encode(), timeout
        )
        if status == 409 and kind == _SIZE and attempt == 1 and answer.strip().isdigit():
            old = int(answer)
            continue
        break
    if status != 200:
        raise rl.IntegrityError(
            url, None, f"the witness refused: HTTP {status}: {rl.printable(answer[:200].strip())}"
        )
    try:  # its cosignature, checked before it is kept
        rl.open_checkpoint(notes[-1] + answer, witness)
    except rl.IntegrityError as exc:
        raise rl.IntegrityError(url, None, f"the witness's answer: {exc.reason}") from None
    with open(sidecar, "r+", encoding="utf-8") as handle:
        if handle.read() != text:
            raise rl.UsageError(f"{sidecar} changed meanwhile; run witness-push again")
        handle.write(answer)
    return newest, True


def _post(url, body, timeout):
    """(status, content type, text) of a POST's answer, an error status's too."""
    import http.client
    import urllib.error
    import urllib.request

    deadline = ask.Deadline(timeout)
    try:
        try:
            response = ask.http_open(urllib.request.Request(url, body), deadline)
        except urllib.error.HTTPError as exc:
            response = exc
        with response:
            kind, text = response.headers.get("Content-Type"), response.read(65536).decode()
            return response.code, kind, text
    except (OSError, http.client.HTTPException, UnicodeDecodeError) as exc:
        why = "in time" if deadline.expired else rl.error_text(getattr(exc, "reason", exc))
        raise rl.IntegrityError(url, None, f"no answer from the witness: {why}") from None
    finally:
        deadline.cancel()


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------


def _build_parser():
    parser = rl.ArgumentParser(
        prog="fleet.py",
        description="Ledgers of many boxes in one ClickHouse: ship, and verify there again.",
        epilog=rl.exit_codes_epilog(rl.EXIT_OK, rl.EXIT_FAILED, rl.EXIT_USAGE, rl.EXIT_OUTPUT),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (_ship_parser(sub), _verify_parser(sub)):
        command.add_argument(
            "--database", default=SHIP_DATABASE, metavar="DB", help=f"default {SHIP_DATABASE}"
        )
        command.add_argument(
            "--table", default=SHIP_TABLE, metavar="T", help=f"default {SHIP_TABLE}"
        )
        rl.add_key_env(command)
    command = sub.add_parser("witness", help="cosign checkpoints that extend the last (C2SP)")
    command.set_defaults(func=serve_witness)
    for flag, kind, default, text in (
        ("--listen", str, None, "HOST:PORT to serve POST /add-checkpoint on"),
        ("--key", str, None, "the witness's signer key (keygen --cosigner)"),
        ("--logs", str, None, "a file of `origin vkey` lines: the logs it cosigns"),
        ("--ledger", str, WITNESS_LEDGER, "its state and evidence"),
        ("--request-timeout", float, WITNESS_TIMEOUT, "seconds a request"),
        ("--max-connections", int, WITNESS_CONNECTIONS, "at once; more get 503")
    ):
        command.add_argument(
            flag,
            type=kind,
            default=default,
            required=default is None,
            help=text + (" (%(default)s)" if default else "")
        )
    command = sub.add_parser("witness-push", help="get a witness's cosignature (for cron)")
    command.set_defaults(func=_cmd_push)
    command.add_argument("ledger", metavar="LEDGER")
    command.add_argument("url", metavar="URL", help="the witness (its add-checkpoint's prefix)")
    command.add_argument("--witness", required=True, metavar="VKEY", help="its verifier key")
    return parser


def _cmd_push(args):
    checkpoint, new = witness_push(args.ledger, args.url, args.witness)
    rl.write_out(
        f"{'cosigned' if new else 'cosigned already'}: {checkpoint.origin} {checkpoint.size}\n"
    )
    return rl.EXIT_OK


def _ship_parser(sub):
    command = sub.add_parser(
        "ship", help="send the verified lines of ledgers (resumable; for cron)"
    )
    command.set_defaults(func=_cmd_ship)
    rl.add_targets(command)
    command.add_argument(
        "--to",
        metavar="URL",
        help=f"ClickHouse's HTTP interface (default ${SHIP_URL_ENV}); user and "
        f"password from ${SHIP_USER_ENV} / ${SHIP_PASSWORD_ENV}"
    )
    command.add_argument(
        "--timeout",
        type=float,
        default=SHIP_TIMEOUT,
        metavar="S",
        help=f"seconds a request ({SHIP_TIMEOUT:g})"
    )
    command.add_argument(
        "--batch-rows",
        type=int,
        default=SHIP_BATCH_ROWS,
        metavar="N",
        help=f"lines per INSERT ({SHIP_BATCH_ROWS:,}; at most {SHIP_BATCH_BYTES >> 20} MiB)"
    )
    command.add_argument(
        "--deadline",
        type=float,
        default=SHIP_DEADLINE,
        metavar="S",
        help=f"seconds for the whole run; the next run resumes ({SHIP_DEADLINE:g})"
    )
    command.add_argument(
        "--host", help="host name recorded with each line (default: this machine's)"
    )
    return command


def _verify_parser(sub):
    command = sub.add_parser("verify", help="re-verify the shipped lines; exit 1 on any failure")
    command.set_defaults(func=_cmd_verify, deadline=None)
    command.add_argument(
        "--from",
        dest="to",
        nargs="?",
        const="",
        metavar="URL",
        help=f"ClickHouse's HTTP interface (default ${SHIP_URL_ENV})"
    )
    command.add_argument(
        "--ledger-id", action="append", metavar="ID", help="this ledger (or prefix), repeatable"
    )
    command.add_argument(
        "--expect-head", metavar="SEQ:HASH", help="a head published earlier (finds truncation)"
    )
    command.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="seconds a request (300)"
    )
    command.add_argument(
        "--vkey", action="append", metavar="KEY", help="the shipped checkpoints' signers (or files)"
    )
    return command


def main(argv=None):
    return rl.run_main(_build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
