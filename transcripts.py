#!/usr/bin/env python3
"""transcripts.py -- Claude Code and Codex session transcripts, kept in a ledger before the agents
delete them. Standard library only; needs reasoning_ledger.py beside it.

Usage:
  python3 transcripts.py import [--claude DIR]... [--codex DIR]... [--ledger PATH]
  python3 transcripts.py list [--ledger PATH]
  python3 transcripts.py restore SESSION --out DIR [--ledger PATH]

`import` reads DIR/projects/*/*.jsonl of each Claude Code config directory (default
$CLAUDE_CONFIG_DIR, else ~/.claude) and DIR/sessions/**/rollout-*.jsonl and
DIR/archived_sessions/*.jsonl of each Codex home (default $CODEX_HOME, else ~/.codex). Only what was
added since the last import comes in: the ledger (--ledger, else $LEDGER, else ./transcripts.jsonl)
records how far each file was read. The lines, masked, go to the text store LEDGER.text/, one file
per SHA-256. docs/transcripts.md has the fields of both formats and of the ledger lines.
"""

import argparse
import fcntl
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import reasoning_ledger as rl

__version__ = "1.0.0"

__all__ = ["import_transcripts", "sessions", "restore", "main"]

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

MAX_LINE = 16 * 1024 * 1024  # a longer transcript line is counted, hashed and named, not stored
PIECE = 8 * 1024 * 1024  # the masked text goes to the store in pieces about this long
SEGMENT = 1024 * 1024 * 1024  # one ledger line covers at most this much of a file
BLOCK = 1024 * 1024
# Distinct models and days a segment counts apart (more go under "(other)"), so that no transcript
# can make its ledger line too long to write.
MAX_MODELS, MAX_DAYS = 16, 62
# What a ledger line carries of its file's state (the first six also on transcript_gone).
STATE = tuple("agent session_id source root version stat offset lines prefix_sha256 carry".split())
KINDS = ("transcript", "transcript_changed", "transcript_gone", "transcript_moved")
# The line types this version reads; any other is counted as unknown_type and kept (stored) raw.
CLAUDE_TYPES = frozenset(
    "user assistant system summary attachment queue-operation file-history-snapshot last-prompt "
    "atis-latch api-request api-request-shape api-request-blob tools-used cost-state mode "
    "custom-title progress".split()
)
CODEX_TYPES = frozenset(
    "session_meta turn_context response_item event_msg world_state token_usage_record "
    "compacted".split()
)
# The token counts each source reports, under its own names (never mixed with estimates).
CLAUDE_TOKENS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens"
)
CODEX_TOKENS = (
    "input_tokens",
    "cached_input_tokens",
    "cache_write_input_tokens",
    "output_tokens",
    "reasoning_output_tokens",
    "total_tokens"
)
CODEX_TOOL_ITEMS = frozenset(
    "function_call custom_tool_call local_shell_call web_search_call tool_search_call".split()
)
_DAY_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')

# ----------------------------------------------------------------------------
# Helpers: finding the files, reading lines, masking
# ----------------------------------------------------------------------------


def _files(root, depth, name):
    """(path, DirEntry) of the regular files under root whose names match `name`, at `depth`
    levels below it (None: any). Symlinked directories are not entered; a symlinked file is taken
    only when it resolves inside root."""
    top = os.path.realpath(root) + os.sep
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            if depth is None or depth > 1:
                yield from _files(entry.path, None if depth is None else depth - 1, name)
        elif (depth is None or depth == 1) and name.fullmatch(entry.name):
            if entry.is_symlink() and not os.path.realpath(entry.path).startswith(top):
                continue
            if entry.is_file():
                yield os.path.abspath(entry.path), entry


def _sources(claude, codex):
    """(agent, root, path, entry) of every transcript file under the given directories."""
    jsonl, rollout = re.compile(r".+\.jsonl"), re.compile(r"rollout-.+\.jsonl")
    for root in claude:
        for path, entry in _files(os.path.join(root, "projects"), 2, jsonl):
            yield "claude-code", root, path, entry
    for root in codex:
        for sub, depth, name in (("sessions", None, rollout), ("archived_sessions", 1, jsonl)):
            for path, entry in _files(os.path.join(root, sub), depth, name):
                yield "codex", root, path, entry


def _lines(handle, end, hashers, limit=SEGMENT):
    """Yield each complete line of `handle` up to byte `end`, its newline included; a line over
    MAX_LINE as (its size, its SHA-256) instead; None, then nothing, when a further line would go
    past `limit` bytes read. Every byte of every line yielded feeds each of `hashers`, a list whose
    items are replaced while a long line is read. A last line without its newline is neither
    yielded nor hashed: it is read again next time."""
    buf, pos, long, size, line_hash, taken = b"", handle.tell(), None, 0, None, 0
    while pos < end:
        block = handle.read(min(BLOCK, end - pos))
        if not block:
            break
        pos, start = pos + len(block), 0
        while True:
            newline = block.find(b"\n", start)
            if newline < 0:
                break
            piece, start = block[start : newline + 1], newline + 1
            if taken >= limit:
                yield None
                return
            if long is None:
                line, buf = buf + piece if buf else piece, b""
                for hasher in hashers:
                    hasher.update(line)
                taken += len(line)
                yield line
                continue
            for hasher in long:
                hasher.update(piece)
            hashers[:], size, long = long[:-1], size + len(piece), None
            taken += size
            yield size, line_hash.hexdigest()
        rest = block[start:]
        if long is not None:
            for hasher in long:
                hasher.update(rest)
            size += len(rest)
            continue
        buf += rest
        # hashed on copies, so a torn long line leaves `hashers` as they were
        if len(buf) > MAX_LINE:
            line_hash = hashlib.sha256()
            long, size = [h.copy() for h in hashers] + [line_hash], len(buf)
            for hasher in long:
                hasher.update(buf)
            buf = b""


def _plain(value):
    """A string from a transcript that a ledger line may carry: short, and UTF-8 (no lone
    surrogate from a \\udXXX escape)."""
    if type(value) is not str or not 0 < len(value) <= 4096:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(text):
    if text.count("{") + text.count("[") <= rl.MAX_DEPTH:
        return False
    depth = deepest = 0
    for char in _STRING_RE.sub("", text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest > rl.MAX_DEPTH


def _masked(text, value, redactor, escaped):
    """The line masked as the ledger masks a payload, so it stays JSON: unchanged when the
    Redactor finds nothing in it (its common escapes read) and it holds no secret value as JSON
    escapes it (`escaped`), else the masked value re-encoded."""
    view = text.replace('\\"', '"').replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
    view = view.replace("\\\\", "\\")
    if redactor.text(view) == view and not any(secret in text for secret in escaped):
        return text
    try:
        clean, encoded = rl._clean_payload(value, redactor)  # the payload masking of Ledger.append
    except rl.PayloadError:  # NaN, a lone surrogate, a 4,300-digit number: masked as text
        return redactor.text(text)
    return text if clean == value else encoded


def _count(value):
    return type(value) is int and 0 <= value < 10**15


def _tokens(row, usage, names, before=None):
    """Add `usage`'s counts (minus `before`'s, for a cumulative total) to row; True if any grew."""
    grew = False
    for name in names:
        value = usage.get(name)
        if _count(value):
            old = (before or {}).get(name, 0)
            delta = value - old if type(old) is int and value >= old else value
            row[name] = row.get(name, 0) + delta
            grew = grew or delta > 0
    return grew


# ----------------------------------------------------------------------------
# Core: one segment of one file
# ----------------------------------------------------------------------------


class _Segment:
    """What the new complete lines of one file say: counts per model and day, and the carry (what
    the next segment needs from this one)."""

    def __init__(self, agent, carry, redactor):
        self.agent, self.carry = agent, dict(carry)
        # the secret values whose JSON spelling differs from them (a quote, a backslash...)
        self.escaped = [rl.dumps(v)[1:-1] for v in redactor.values if rl.dumps(v) != f'"{v}"']
        self.usage, self.prompts, self.skipped, self.missing = {}, {}, {}, []
        self.first = self.last = None
        self.days = set()
        self.lines = 0

    def skip(self, reason):
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def row(self, day):
        model = self.carry.get("model") or "(unknown)"
        if model not in self.usage and len(self.usage) >= MAX_MODELS:
            model = "(other)"
        return self.usage.setdefault(model, {}).setdefault(day, {"turns": 0, "tool_calls": 0})

    def note(self, stamp, **fields):
        if _plain(stamp) and _DAY_RE.match(stamp):
            self.first = min(self.first or stamp, stamp)
            self.last = max(self.last or stamp, stamp)
            day = stamp[:10]
            if day not in self.days and len(self.days) >= MAX_DAYS:
                day = "(other)"
            self.days.add(day)
            self.carry["day"] = day
        for name, value in fields.items():
            if _plain(value):
                self.carry[name] = value

    def prompt(self):
        day = self.carry.get("day", "")
        self.prompts[day] = self.prompts.get(day, 0) + 1

    def read(self, value):
        """Count one parsed line; False for a type this version does not know."""
        kind = value.get("type") if type(value) is dict else None
        if type(kind) is not str:
            return False
        if self.agent == "claude-code":
            return kind in CLAUDE_TYPES and (self._claude(kind, value) or True)
        return kind in CODEX_TYPES and (self._codex(kind, value) or True)

    def _claude(self, kind, value):
        self.note(
            value.get("timestamp"),
            session_id=value.get("sessionId"),
            cwd=value.get("cwd"),
            agent_version=value.get("version")
        )
        message = value.get("message")
        message = message if type(message) is dict else {}
        content = message.get("content")
        blocks = [b for b in content if type(b) is dict] if type(content) is list else []
        if kind == "assistant":
            self.note(None, model=message.get("model"))
            row = self.row(self.carry.get("day", ""))
            row["tool_calls"] += sum(b.get("type") == "tool_use" for b in blocks)
            ident = message.get("id")
            if _plain(ident) and ident != self.carry.get("message_id"):
                self.carry["message_id"] = ident
                row["turns"] += 1
                usage = message.get("usage")
                _tokens(row, usage if type(usage) is dict else {}, CLAUDE_TOKENS)
        elif kind == "user" and not value.get("isMeta"):
            if type(content) is str or any(b.get("type") == "text" for b in blocks):
                self.prompt()

    def _codex(self, kind, value):
        payload = value.get("payload")
        payload = payload if type(payload) is dict else {}
        self.note(value.get("timestamp"), cwd=payload.get("cwd"))
        inner = payload.get("type") if type(payload.get("type")) is str else None
        if kind == "session_meta":
            self.note(None, session_id=payload.get("id"), agent_version=payload.get("cli_version"))
        elif kind == "turn_context":
            self.note(None, model=payload.get("model"))
        elif kind == "response_item" and inner in CODEX_TOOL_ITEMS:
            self.row(self.carry.get("day", ""))["tool_calls"] += 1
        elif kind == "event_msg" and inner == "token_count":
            info = payload.get("info")
            total = info.get("total_token_usage") if type(info) is dict else None
            if type(total) is dict:
                row = self.row(self.carry.get("day", ""))
                if _tokens(row, total, CODEX_TOKENS, self.carry.get("total")):
                    row["turns"] += 1
                valid = {n: total[n] for n in CODEX_TOKENS if _count(total.get(n))}
                self.carry["total"] = dict(self.carry.get("total") or {}, **valid)
        elif kind == "event_msg" and (
            inner == "user_message"
            or inner == "item_completed"
            and type(payload.get("item")) is dict
            and payload["item"].get("type") == "UserMessage"
        ):
            self.prompt()

    def take(self, line, redactor):
        """Count one complete line (bytes with its newline); return it masked, as bytes."""
        self.lines += 1
        body = line[:-1]
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            self.skip("not_utf8")
            text = body.decode("utf-8", "surrogateescape")
            return redactor.text(text).encode("utf-8", "surrogateescape") + b"\n"
        if _too_deep(text):
            self.skip("too_deep")
            return redactor.text(text).encode("utf-8") + b"\n"
        try:
            value = json.loads(text)
        except ValueError:
            self.skip("not_json")
            return redactor.text(text).encode("utf-8") + b"\n"
        if not self.read(value):
            self.skip("unknown_type")
        return _masked(text, value, redactor, self.escaped).encode("utf-8") + b"\n"


def _stat(entry):
    st = entry.stat(follow_symlinks=True)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _segment(ledger, store, handle, state, end):
    """Import the complete lines of `handle` from state["offset"] up to `end` (at most SEGMENT
    bytes); append one `transcript` line and return its payload, or None when no line was whole."""
    start = state["offset"]
    hashers = [state.pop("_prefix"), hashlib.sha256()]
    redactor = ledger.redactor
    seg, pieces, out, size = _Segment(state["agent"], state.get("carry", {}), redactor), [], [], 0

    def flush():
        if out:
            pieces.append(rl.store_artifact(store, b"".join(out), redact_secrets=False)["sha256"])
            out.clear()

    pending, stat = 0, None
    for line in _lines(handle, end, hashers):
        if line is None:  # more than one line's payload should cover: on the next line
            break
        if type(line) is tuple:
            seg.lines += 1
            seg.skip("too_long")
            where = {"line": state["lines"] + seg.lines, "offset": start + size}
            seg.missing.append(dict(where, size=line[0], sha256=line[1]))
            size += line[0]
        else:
            size += len(line)
            out.append(seg.take(line, redactor))
            pending += len(out[-1])
            if pending >= PIECE:
                flush()
                pending = 0
    else:  # read to the end: the stat stands for what was imported (none: read again next run)
        stat = state["stat"]
    flush()
    if not seg.lines:
        return None, hashers[0]
    payload = {
        **{k: state[k] for k in ("agent", "source", "root", "version")},
        "session_id": seg.carry.get("session_id") or Path(state["source"]).stem,
        "cwd": seg.carry.get("cwd"),
        "agent_version": seg.carry.get("agent_version"),
        "start": start,
        "end": start + size,
        "lines": state["lines"] + seg.lines,
        "prefix_sha256": hashers[0].hexdigest(),
        "sha256": hashers[1].hexdigest(),
        "stored": pieces,
        "missing": seg.missing,
        "first": seg.first,
        "last": seg.last,
        "models": sorted(seg.usage),
        "usage": seg.usage,
        "prompts": seg.prompts,
        "skipped": seg.skipped,
        "carry": seg.carry,
        "stat": stat
    }
    return ledger.append("transcript", payload)["payload"], hashers[0]


def _prefix(handle, length):
    hasher, left = hashlib.sha256(), length
    while left > 0:
        block = handle.read(min(BLOCK, left))
        if not block:
            break
        hasher.update(block)
        left -= len(block)
    return hasher


def _import_file(ledger, store, source, old, counts):
    """Bring one file up to date from its state `old` (None: new); count the ledger lines written
    by kind."""
    agent, root, path, entry = source
    st = _stat(entry)
    if old and old["stat"] == st and not old.get("gone"):
        return
    fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        end = os.fstat(fd).st_size
        fresh = _fresh(agent, root, path, st, (old or {}).get("version", 0) + 1)
        live = old and not old.get("gone")
        state = dict(old, root=root, source=path, stat=st) if live else fresh
        hasher = _prefix(handle, state["offset"])
        if live and (state["offset"] > end or hasher.hexdigest() != state["prefix_sha256"]):
            # rewritten, cut or compacted: noted with both hashes, then read again from the top
            ledger.append(
                "transcript_changed",
                dict(
                    fresh,
                    session_id=state.get("session_id"),
                    old_prefix_sha256=state["prefix_sha256"],
                    new_prefix_sha256=hasher.hexdigest(),
                    old_end=state["offset"],
                    size=end
                )
            )
            state, hasher = fresh, hashlib.sha256()
            counts["transcript_changed"] += 1
            handle.seek(0)
        while True:
            state["_prefix"] = hasher
            added, hasher = _segment(ledger, store, handle, state, end)
            if added is None:
                return
            counts["transcript"] += 1
            state = dict(_state("transcript", added), stat=st)
            handle.seek(state["offset"])


def _fresh(agent, root, path, st, version):
    return {
        "agent": agent,
        "root": root,
        "source": path,
        "stat": st,
        "version": version,
        "offset": 0,
        "lines": 0,
        "prefix_sha256": hashlib.sha256().hexdigest(),
        "carry": {}
    }


def _state(kind, payload):
    """What a ledger line says of its file now (offset, lines, prefix hash, carry...)."""
    if kind == "transcript_changed":
        return dict(_fresh(*(payload[k] for k in ("agent", "root", "source", "stat", "version"))))
    if kind == "transcript":
        return dict(payload, offset=payload["end"])
    return dict(payload)


def _ledger_states(path):
    """source -> its state, from the ledger's transcript lines (verified on the way)."""
    states = {}
    if not os.path.exists(path):
        return states
    for event in rl.read_events(path):
        kind, payload = event["kind"], event["payload"]
        if kind in KINDS:
            if kind == "transcript_moved":
                states.pop(payload["from"], None)
            states[payload["source"]] = _state(kind, payload)
    return states


def _moved_to(old, found):
    """The file under the same root with old's name and its imported prefix (codex archive), or
    None."""
    name = os.path.basename(old["source"])
    for path, (agent, root, entry) in found.items():
        if os.path.basename(path) == name and agent == old["agent"] and root == old["root"]:
            try:
                with open(os.path.realpath(path), "rb") as handle:
                    if _prefix(handle, old["offset"]).hexdigest() == old["prefix_sha256"]:
                        return path
            except OSError:
                continue
    return None


def import_transcripts(ledger_path, claude=(), codex=()):
    """Import what was added to the transcripts under the given directories; return counts of the
    ledger lines written by kind. An import that overlaps another waits for it (a lock on the
    store), then reads the ledger's state."""
    store, counts = rl.text_dir(ledger_path), dict.fromkeys(KINDS, 0)
    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(str(store), os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        states = _ledger_states(ledger_path)
        found = {p: (agent, root, entry) for agent, root, p, entry in _sources(claude, codex)}
        roots = {("claude-code", r) for r in claude} | {("codex", r) for r in codex}
        with rl.Ledger(ledger_path, run_id="transcripts") as ledger:
            _vanished(ledger, states, found, roots, counts)
            for path, (agent, root, entry) in found.items():
                try:
                    _import_file(
                        ledger, store, (agent, root, path, entry), states.get(path), counts
                    )
                except FileNotFoundError:
                    continue  # gone between the listing and the read: the next run notes it
    finally:
        os.close(lock)
    return counts


def _vanished(ledger, states, found, roots, counts):
    """Note each file of the state no longer found under a directory given: moved or gone."""
    new = {p: v for p, v in found.items() if p not in states or states[p].get("gone")}
    for source, old in list(states.items()):
        if source in found or old.get("gone") or (old["agent"], old["root"]) not in roots:
            continue
        target = _moved_to(old, new)
        if target:
            moved = dict({k: old.get(k) for k in STATE}, source=target, **{"from": source})
            states[target] = ledger.append("transcript_moved", moved)["payload"]
            new.pop(target)
        else:
            gone = dict({k: old.get(k) for k in STATE[:6]}, gone=True)
            ledger.append("transcript_gone", gone)
        counts["transcript_moved" if target else "transcript_gone"] += 1


def _files_of(ledger_path):
    """(agent, session) -> file name -> the `transcript` lines of that file's latest version."""
    files = {}
    for event in rl.read_events(ledger_path):
        kind, payload = event["kind"], event["payload"]
        if kind != "transcript":
            continue
        key = (payload["agent"], payload["session_id"])
        name = os.path.basename(payload["source"])
        versions = files.setdefault(key, {}).setdefault(name, {})
        versions.setdefault(payload["version"], []).append(payload)
    return {
        key: {name: versions[max(versions)] for name, versions in names.items()}
        for key, names in files.items()
    }


def sessions(ledger_path):
    """One dict per session kept: agent, session, cwd, first, last, models, turns, tokens (input
    and output, as reported), files."""
    rows = []
    for (agent, session), names in sorted(_files_of(ledger_path).items(), key=str):
        parts = [p for segments in names.values() for p in segments]
        turns = tokens_in = tokens_out = 0
        for part in parts:
            for days in part["usage"].values():
                for row in days.values():
                    turns += row.get("turns", 0)
                    tokens_in += row.get("input_tokens", 0)
                    tokens_out += row.get("output_tokens", 0)
        stamps = [p[k] for p in parts for k in ("first", "last") if p.get(k)]
        rows.append(
            {
                "agent": agent,
                "session_id": session,
                "cwd": next((p["cwd"] for p in reversed(parts) if p.get("cwd")), None),
                "first": min(stamps, default=None),
                "last": max(stamps, default=None),
                "models": sorted({m for p in parts for m in p["models"]}),
                "turns": turns,
                "tokens": {"input_tokens": tokens_in, "output_tokens": tokens_out},
                "files": sorted(names)
            }
        )
    return rows


def restore(ledger_path, session, out):
    """Write the session's files (its latest versions) under `out` from the text store, never
    over an existing file; return (paths written, lines missing: over MAX_LINE when imported)."""
    files = _files_of(ledger_path)
    keys = [k for k in files if k[1] == session] or [
        k for k in files if str(k[1]).startswith(session)
    ]
    if len({k[1] for k in keys}) != 1:
        found = (
            "no session in {} matches {!r}"
            if not keys
            else f"{len({k[1] for k in keys})} sessions in {{}} match {{!r}}: give more of the id"
        )
        raise rl.UsageError(found.format(ledger_path, rl.printable(session)))
    store, out = rl.text_dir(ledger_path), Path(out)
    plan = [(name, parts) for key in keys for name, parts in files[key].items()]
    for name, _parts in plan:
        if not re.fullmatch(r"[\w][\w.-]*", name) or (out / name).exists():
            raise rl.UsageError(f"{out / rl.printable(name)}: exists or is not a plain file name")
    out.mkdir(parents=True, exist_ok=True)
    written, missing = [], []
    for name, parts in plan:
        with open(out / name, "xb") as handle:
            try:
                missing += _write_parts(handle, name, parts, store, ledger_path)
                written.append(str(out / name))
            finally:
                if not written or written[-1] != str(out / name):  # nothing half-written stays
                    os.unlink(str(out / name))
    return written, missing


def _write_parts(handle, name, parts, store, ledger_path):
    offset, missing = 0, []
    for part in sorted(parts, key=lambda p: p["start"]):
        if part["start"] != offset:
            raise rl.IntegrityError(
                ledger_path, None, f"{name}: bytes {offset}-{part['start']} are not kept"
            )
        for digest in part["stored"]:
            if not re.fullmatch(r"[0-9a-f]{64}", str(digest)):
                raise rl.IntegrityError(ledger_path, None, f"{name}: a stored piece has no hash")
            data = (store / digest).read_bytes()
            if hashlib.sha256(data).hexdigest() != digest:
                raise rl.IntegrityError(store / digest, None, "does not match its name")
            handle.write(data)
        missing += [dict(m, file=name) for m in part["missing"]]
        offset = part["end"]
    return missing


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------


def _default_ledger(args):
    return args.ledger or os.environ.get("LEDGER") or "transcripts.jsonl"


def _cmd_import(args):
    claude, codex = args.claude or [], args.codex or []
    for given in claude + codex:
        if not os.path.isdir(given):
            raise rl.UsageError(f"{given}: not a directory")
    if not claude and not codex:  # the defaults, where they exist
        home = os.path.expanduser("~")
        claude = [os.environ.get("CLAUDE_CONFIG_DIR") or os.path.join(home, ".claude")]
        codex = [os.environ.get("CODEX_HOME") or os.path.join(home, ".codex")]
        claude, codex = [d for d in claude if os.path.isdir(d)], [
            d for d in codex if os.path.isdir(d)
        ]
    claude, codex = [os.path.abspath(d) for d in claude], [os.path.abspath(d) for d in codex]
    counts = import_transcripts(_default_ledger(args), claude, codex)
    rl.write_out(
        f"imported {rl.plural(counts['transcript'], 'segment')}; {counts['transcript_changed']} "
        f"changed, {counts['transcript_gone']} gone, {counts['transcript_moved']} moved\n"
    )
    return rl.EXIT_OK


def _cmd_list(args):
    path = _default_ledger(args)
    if not os.path.exists(path):
        raise rl.UsageError(f"{path}: no such ledger (run `transcripts.py import` first)")
    lines = ["agent\tsession\tcwd\tfirst\tlast\tmodels\tturns\tinput_tokens\toutput_tokens"]
    for row in sessions(path):
        cells = [row[k] or "-" for k in ("agent", "session_id", "cwd", "first", "last")]
        cells += [",".join(row["models"]) or "-", row["turns"], *row["tokens"].values()]
        lines.append("\t".join(rl.printable(c).replace("\t", "\\t") for c in cells))
    rl.write_out("\n".join(lines) + "\n")
    return rl.EXIT_OK


def _cmd_restore(args):
    written, missing = restore(_default_ledger(args), args.session, args.out)
    for gap in missing:
        rl.warn(
            "{file}: line {line} (offset {offset}, {size} bytes, sha256 {sha256}) was over the "
            "{cap}-byte line cap when imported and is not kept".format(cap=MAX_LINE, **gap)
        )
    rl.write_out("".join(f"{rl.printable(path)}\n" for path in written))
    return rl.EXIT_OK


def _build_parser():
    parser = rl.ArgumentParser(
        prog="transcripts.py",
        description="Keep Claude Code and Codex transcripts in a ledger.",
        epilog=rl.exit_codes_epilog(rl.EXIT_OK, rl.EXIT_FAILED, rl.EXIT_USAGE, rl.EXIT_OUTPUT),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text, handler in (
        ("import", "import what the transcripts added since the last import", _cmd_import),
        ("list", "the sessions kept: agent, id, cwd, times, models, turns, tokens", _cmd_list),
        ("restore", "write a session's files back from the store (masked)", _cmd_restore)
    ):
        p = sub.add_parser(name, help=text)
        p.set_defaults(func=handler)
        p.add_argument("--ledger", help="default: $LEDGER, else ./transcripts.jsonl")
    p.add_argument("session", metavar="SESSION", help="a session id or a unique prefix")
    p.add_argument("--out", required=True, metavar="DIR", help="written under DIR, never over")
    p = sub.choices["import"]
    for name in ("claude", "codex"):
        p.add_argument(
            f"--{name}", action="append", metavar="DIR", help=f"a {name} directory (repeatable)"
        )
    return parser


def main(argv=None) -> int:
    return rl.run_main(_build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
