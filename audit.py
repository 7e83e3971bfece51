#!/usr/bin/env python3
"""audit.py -- what each model string did, day by day, from verified ledgers only. Stdlib only.

Usage:
  python audit.py                  # ./calls.jsonl, ./transcripts.jsonl, ./runs/*/events.jsonl
  python audit.py calls.jsonl runs/ --by day
  python audit.py --since 2026-11-01 --model my-model --fail-on-change  # exit 4 on any change
  python audit.py --wide                   # every column, names whole (default: fits 120 columns)
  python audit.py --json > audit.json      # or --csv; --html report.html for a page with charts
  python audit.py --no-verify broken.jsonl # audit anyway, marked UNVERIFIED
  python audit.py --from http://ch:8123 --by day   # every box's shipped ledgers (fleet.py ship)
  python audit.py --conversation conv-3f2a   # one session's messages and answers (--store-text)

Exit codes: 0 ok, 1 a ledger failed verification (nothing audited), 2 usage or I/O error,
4 changes found and --fail-on-change given, 5 stdout could not be written.
"""

import argparse
import csv
import datetime
import glob
import hashlib
import html
import io
import itertools
import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path

# the toolkit beside us, even under -I
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fleet  # noqa: E402
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.2.0"

__all__ = [
    "Audit",
    "AuditError",
    "run_audit",
    "remote_audit",
    "render_text",
    "render_json",
    "render_csv",
    "render_html",
    "MODEL_COLUMNS"
]

# == Constants ==

# ask.py's default ledger, the name it once had, and transcripts.py's
DEFAULT_LEDGERS = ("calls.jsonl", "runs.jsonl", "transcripts.jsonl")
DEFAULT_RUNS = "runs"
DEFAULT_RUNS_URL = "runs/"  # daemon.py shows a run's timeline at /runs/ID
DEFAULT_LATENCY_SHIFT = 0.5
DEFAULT_RATE_JUMP = 0.2
MIN_LATENCY_SAMPLES = 3
DEFAULT_LATENCY_FLOOR_MS = 50.0
NO_USAGE_STATUSES = ("absent", "zero", "malformed")
# the proxy's refusals, recorded with no HTTP status: the request never left (docs/proxy.md)
UNSENT = ("model_missing", "model_not_allowed", "invalid_request")
# distinct (request_model, base_url) pairs kept apart; the rest share one row
MAX_MODEL_STRINGS = 1000
MAX_LABELS = 50  # distinct served models, fingerprints or error types kept per row
MAX_LISTINGS = 100000  # (base_url, day) /models listings kept
# what a worker keeps apart for the merge to fold in file order; past it, one process reads the file
WORKER_MODEL_STRINGS, WORKER_LABELS = 4 * MAX_MODEL_STRINGS, 4 * MAX_LABELS
OTHER = "(other)"
# the HTML draws per-model charts for the busiest; the rest are summarised
MAX_CHART_MODELS = 8
TEXT_WIDTH = 120  # the text report fits a terminal this wide, unless --wide
MIN_CUT_WIDTH = 8  # a name is never cut narrower than this to fit
ELLIPSIS = "\u2026"

# the agent-runs table: how the ledger sums a run up (docs/audit.md, "Agent runs")
RUN_COLUMNS = tuple(
    name for name in rl.run_summary() if name not in ("usage_calls", "proposal", "unboxed")
)


class AuditError(rl.UsageError):
    """Bad arguments or unreadable input (exit 2)."""


# == Helpers ==


def percentile(sorted_values, q):
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    return (
        sorted_values[max(1, math.ceil(q / 100.0 * len(sorted_values))) - 1]
        if sorted_values
        else None
    )


# (fields, malformed) of a model_call payload: the one rule, which the shipped table follows too
model_call_view = fleet.call_fields


def _label(value):
    return "-" if value is None else str(value)


def _num(value):
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def _fmt_ms(value):
    return "-" if value is None else f"{value:,.0f}"


def _short(value):
    """3 significant digits: 950, 1.2k, 4.94M, 2.5."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:.3g}"


def _ranked(counter):
    return sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0])))


def _add(counter, key, n):
    counter[key] = counter.get(key, 0) + n


def _count_label(counter, label, n=1):  # per call: _add inline
    label = label if label in counter or len(counter) < MAX_LABELS else OTHER
    counter[label] = counter.get(label, 0) + n


def find_ledgers(paths):
    """Expand PATHs (files, directories, globs) into ledger files; default: ./calls.jsonl +
    ./runs/."""
    if not paths:
        return [Path(name) for name in DEFAULT_LEDGERS if Path(name).is_file()] + sorted(
            Path(DEFAULT_RUNS).glob("*/" + rl.EVENTS_NAME)
        )
    out = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out += sorted(p for p in path.rglob("*.jsonl") if p.name != rl.INDEX_NAME)
        elif path.is_file():
            out.append(path)
        else:
            matches = sorted(glob.glob(raw))
            if not matches:
                raise AuditError(f"{raw}: no such file, directory or glob match")
            out += [Path(m) for m in matches if Path(m).is_file()]
    unique = {}  # a file named twice (or through a link) is read once
    for path in out:
        unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


# == Core: one streaming pass ==


# a models-table row's keys, in order: the CSV's columns
MODEL_COLUMNS = tuple(
    (
        "request_model base_url day calls ok failed no_usage malformed checked passed input_tokens "
        "output_tokens usage_calls est_input_tokens est_output_tokens latency_min_ms "
        "latency_p50_ms latency_p95_ms latency_max_ms retries response_models system_fingerprints "
        "errors"
    ).split()
)


class Group:
    """Counters for one (request_model, base_url, day)."""

    COUNTS = tuple(
        (
            "calls ok no_usage malformed checked passed input_tokens output_tokens usage_calls "
            "est_input_tokens est_output_tokens est_output_calls retries"
        ).split()
    )
    LABELS = ("response_models", "fingerprints", "errors")
    __slots__ = COUNTS + LABELS + ("latencies",)

    def __init__(self):
        for name in self.COUNTS:
            setattr(self, name, 0)
        self.latencies = []
        self.response_models, self.fingerprints, self.errors = {}, {}, {}

    def add(self, call, malformed, code=None):
        """Count one model_call (its model_call_view, and the payload's error_code)."""
        self.calls += 1
        self.malformed += malformed
        self.retries += (call["attempt"] or 1) > 1
        measured = call["usage_reported"] is True and call["usage_status"] not in NO_USAGE_STATUSES
        if call["error_type"] is None:
            self.ok += 1
            if call["latency_ms"] is not None:
                self.latencies.append(call["latency_ms"])
            self.no_usage += not measured
            _count_label(self.response_models, call["response_model"])
            if call["system_fingerprint"] is not None:
                _count_label(self.fingerprints, call["system_fingerprint"])
            if call["check"] is not None:
                self.checked += 1
                self.passed += call["check"] is True
        else:
            label = call["error_type"]
            _count_label(self.errors, f"{label} ({code})" if type(code) is str and code else label)
        if measured and (call["input_tokens"] is not None or call["output_tokens"] is not None):
            self.usage_calls += 1
            self.input_tokens += call["input_tokens"] or 0
            self.output_tokens += call["output_tokens"] or 0
        self.est_input_tokens += call["est_input_tokens"] or 0
        if call["est_output_tokens"] is not None:
            self.est_output_calls += 1
            self.est_output_tokens += call["est_output_tokens"]

    def merge(self, other):
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.latencies.extend(other.latencies)
        for name in self.LABELS:
            for label, count in getattr(other, name).items():
                _count_label(getattr(self, name), label, count)

    def row(self, request_model, base_url, day):
        """One row of the model table. A count that nothing reported is None (null), never 0."""
        lat, usage = sorted(self.latencies), self.usage_calls
        labels = [
            dict(sorted(getattr(self, name).items(), key=lambda kv: str(kv[0])))
            for name in self.LABELS
        ]
        return dict(
            zip(
                MODEL_COLUMNS,
                (
                    request_model,
                    base_url,
                    day,
                    self.calls,
                    self.ok,
                    self.calls - self.ok,  # failed
                    self.no_usage,
                    self.malformed,
                    self.checked,
                    self.passed if self.checked else None,
                    self.input_tokens if usage else None,
                    self.output_tokens if usage else None,
                    usage,  # usage_calls
                    self.est_input_tokens if self.calls else None,
                    self.est_output_tokens if self.est_output_calls else None,
                    lat[0] if lat else None,  # latency_min_ms
                    percentile(lat, 50),  # latency_p50_ms
                    percentile(lat, 95),  # latency_p95_ms
                    lat[-1] if lat else None,  # latency_max_ms
                    self.retries,
                    *labels  # response_models, system_fingerprints, errors
                )
            )
        )


class Audit:
    """Everything the reports need, gathered in one pass over the events."""

    def __init__(self, since=None, until=None, model=None, by_session=False, jobs=1):
        self.since, self.until, self.model, self.jobs = since, until, model, jobs
        self.by_session = by_session  # the proxy's X-Ledger-Session in the day's place
        self.groups = {}  # (request_model, base_url, day) -> Group
        self.model_strings = set()  # the (request_model, base_url) pairs kept apart
        # calls counted under OTHER because there were too many model strings
        self.folded = 0
        self.listings = {}  # (base_url, day) -> (at, model_ids) of the day's last listing
        self.runs = {}  # run_id -> agent run summary
        self.ledgers = []  # {"path", "status", "lines", "reason"}
        self._heads = {}  # index.jsonl -> {run id: (head seq, head hash)}
        self.imported = {}  # (agent, session, file name) -> (version, [its transcript payloads])
        self.unsent = {}  # error type -> calls the proxy refused before sending: never served

    def add_file(self, path, verify=True):
        """Stream one ledger in; returns its status. Raises IntegrityError / KeyRequiredError."""
        path = Path(path)
        info = {"path": str(path), "status": "ok", "lines": 0, "reason": None}
        start = verify and path.name != rl.EVENTS_NAME and _parallel(self, path)
        events = self._verified(path, info, start or None) if verify else _unverified(path, info)
        self._consume(events, path.name == rl.EVENTS_NAME, path)
        self.ledgers.append(info)
        return info

    def _verified(self, path, info, start=None):
        """A closed run is held to the head its index recorded, as `verify --all` holds it. `start`:
        where workers stopped (_parallel)."""
        count = start[0] if start else 0
        try:
            for event, _raw, _digest in rl.verified_events(
                path, expect=self._index_head(path), closed=True, after=start
            ):
                count += 1
                yield event
        except rl.TornTailError as exc:
            info["status"], info["reason"] = "torn", str(exc)
        finally:
            info["lines"] = count

    def _index_head(self, path):
        if path.name != rl.EVENTS_NAME:
            return None
        index = path.parent.parent / rl.INDEX_NAME
        if index not in self._heads:
            heads = self._heads[index] = {}  # a broken index fails the first run read under it
            for run_id, head in rl.run_heads(index.parent):
                heads[run_id] = head
        return self._heads[index].get(path.parent.name)

    def _consume(self, events, agent_run, path):
        # the per-line path: what it reads of self is read once, into locals
        run, since, until, only = None, self.since or "", self.until, self.model
        groups, strings, by_session = self.groups, self.model_strings, self.by_session
        for event in events:
            kind, at, payload = event["kind"], event["at"], event["payload"]
            if kind == "transcript":  # counted by the transcript's own days, not the import's
                self._transcript(payload)
                continue
            if at < since or until is not None and at > until:
                continue
            if agent_run:
                run = run or self.runs.setdefault(
                    event["run_id"], rl.run_summary(run_id=event["run_id"])
                )
                rl.add_run_event(run, event)
            if kind == "model_call":
                call, malformed = model_call_view(payload)
                model, base = call["request_model"], call["base_url"]
                if only is not None and model != only:
                    continue
                if call["error_type"] in UNSENT and payload.get("http_status") is None:
                    _add(self.unsent, call["error_type"], 1)
                    continue
                session = payload.get("session_id")
                day = (session if type(session) is str else "-") if by_session else at[:10]
                if (model, base) not in strings:
                    if len(strings) >= MAX_MODEL_STRINGS:
                        self.folded += 1
                        model = base = OTHER
                    else:
                        strings.add((model, base))
                group = groups.get((model, base, day))
                if group is None:  # not setdefault: that would build a Group for every call
                    group = groups[(model, base, day)] = Group()
                group.add(call, malformed, payload.get("error_code"))
            elif kind == "models_list":
                self._listing(payload, at)

    def _transcript(self, payload):
        _imported(self.imported, payload)

    def _listing(self, payload, at):
        ids, base = payload.get("model_ids"), payload.get("base_url")
        if type(ids) is list and type(base) is str and all(type(i) is str for i in ids):
            previous = self.listings.get((base, at[:10]))
            # the day's last listing wins; a new (base_url, day) is kept while under the cap
            if (previous[0] <= at) if previous else len(self.listings) < MAX_LISTINGS:
                self.listings[(base, at[:10])] = (at, ids[:10000])

    def model_rows(self, by_day=False):
        groups = self.groups
        if not by_day:
            groups = {}
            for (model, base, _day), group in self.groups.items():
                groups.setdefault((model, base, None), Group()).merge(group)
        return [
            g.row(*key)
            for key, g in sorted(
                groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]), kv[0][2] or "")
            )
        ]

    def imported_rows(self):
        return _imported_rows(self)

    def changes(
        self,
        latency_shift=DEFAULT_LATENCY_SHIFT,
        rate_jump=DEFAULT_RATE_JUMP,
        latency_floor=DEFAULT_LATENCY_FLOOR_MS
    ):
        """What changed from one day to the next: per model string (compare_days), then per
        endpoint's list."""
        groups = (((model, base), day, g) for (model, base, day), g in self.groups.items())
        found = [
            (model, base, day, prev_day, what, detail)
            for (model, base), prev_day, prev, day, cur in _day_pairs(groups)
            for what, detail in compare_days(prev, cur, latency_shift, rate_jump, latency_floor)
        ]
        listings = (((base,), day, ids) for (base, day), (_at, ids) in self.listings.items())
        for (base,), prev_day, before, day, after in _day_pairs(listings):
            detail = _set_change(before, after, ("gained", "lost"))
            found += [(None, base, day, prev_day, "models_list", detail)] if detail else []
        keys = "request_model base_url day previous_day what detail".split()
        return [dict(zip(keys, change)) for change in found]

    def unlisted(self):
        """The model strings asked for at an endpoint whose latest /models list (ask.py --models)
        lacks them."""
        latest = {
            base: listing
            for (base, _day), listing in sorted(self.listings.items(), key=lambda kv: kv[1][0])
        }
        calls = {}
        for (model, base, _day), group in self.groups.items():
            _add(calls, (model, base), group.calls)
        return [
            {"request_model": model, "base_url": base, "calls": n, "listed_at": latest[base][0]}
            for (model, base), n in sorted(
                calls.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))
            )
            if base in latest and model != OTHER and model not in latest[base][1]
        ]

    def run_rows(self):
        rows = []
        for _, run in sorted(self.runs.items()):
            row = {k: run[k] for k in RUN_COLUMNS}
            if not run["usage_calls"]:
                row["input_tokens"] = row["output_tokens"] = None
            rows.append(row)
        return rows


# == Parallel: workers gather byte ranges of one ledger, merged in file order as one pass reads ==


def _parallel(audit, path):
    """Where the one pass goes on in `path` (rl's parallel_start state) after forked workers
    verified and gathered its lines up to there and their shares were merged into `audit`; None:
    one process reads it all, and words any failure."""
    got = rl.parallel_start(
        path,
        rl.resolve_key(None),
        None,
        audit.jobs,
        fold=lambda lines: _share(audit, (event for event, _raw in lines))
    )
    if not got or None in got[1] or not _fold_exact(audit, got[1]):
        return None
    for share in got[1]:
        _merge(audit, share)
    return got[0]


def _share(audit, events):
    """In a forked worker: its range's (groups, listings, transcripts, unsent), model strings and
    labels kept apart up to WORKER_* for _merge() to fold; None past a limit."""
    global MAX_MODEL_STRINGS, MAX_LABELS  # this child's own copies
    MAX_MODEL_STRINGS, MAX_LABELS = WORKER_MODEL_STRINGS, WORKER_LABELS
    share, transcripts = Audit(audit.since, audit.until, audit.model, audit.by_session), []
    share._transcript = transcripts.append
    share._consume(events, False, None)
    labels = (len(getattr(g, name)) for g in share.groups.values() for name in Group.LABELS)
    if share.folded or len(share.listings) >= MAX_LISTINGS or max(labels, default=0) >= MAX_LABELS:
        return None
    return share.groups, share.listings, transcripts, share.unsent


def _merge(audit, share):
    """Add a worker's share as one pass reads its lines: model strings folded first come, labels
    (Group.merge), the day's last listing, transcripts read again in order."""
    groups, listings, transcripts, unsent = share
    for (model, base, day), part in groups.items():
        if (model, base) not in audit.model_strings:
            if len(audit.model_strings) >= MAX_MODEL_STRINGS:
                audit.folded += part.calls
                model = base = OTHER
            else:
                audit.model_strings.add((model, base))
        audit.groups.setdefault((model, base, day), Group()).merge(part)
    for (base, day), (at, ids) in listings.items():
        audit._listing({"model_ids": ids, "base_url": base}, at)
    for payload in transcripts:
        _imported(audit.imported, payload)
    for name, n in unsent.items():
        _add(audit.unsent, name, n)


def _fold_exact(audit, shares):
    """Whether _merge() gives what one pass gives: a folded row gathers its labels model string by
    model string, not in file order, which tells only once the (other) rows hold more than
    MAX_LABELS of a kind between them."""
    strings, kinds = set(audit.model_strings), {name: set() for name in Group.LABELS}
    rows = [g for (model, base, _), g in audit.groups.items() if model == base == OTHER]
    for groups, *_rest in shares:
        for (model, base, _day), group in groups.items():
            if (model, base) not in strings and len(strings) < MAX_MODEL_STRINGS:
                strings.add((model, base))
            rows += [group] if (model, base) not in strings or model == base == OTHER else []
    for group in rows:
        for name, seen in kinds.items():
            seen.update(getattr(group, name))
    return all(len(seen) <= MAX_LABELS for seen in kinds.values())


def _unverified(path, info):
    """The lines of a ledger that parse as events, its chain unchecked (--no-verify); the rest are
    counted."""
    info["status"] = "unverified"
    with open(path, "rb") as handle:
        for raw in handle:
            try:
                event = json.loads(raw)
            except (ValueError, RecursionError):
                event = None
            if (
                type(event) is dict
                and type(event.get("payload")) is dict
                and type(event.get("at")) is str
                and type(event.get("kind")) is str
                and type(event.get("run_id")) is str
            ):
                info["lines"] += 1
                yield event
            else:
                info["skipped"] = info.get("skipped", 0) + 1


def _day_pairs(entries):
    """(who, previous day, its value, day, its value) for consecutive days of each `who` in (who,
    day, value)."""
    by_who = {}
    for who, day, value in entries:
        by_who.setdefault(who, []).append((day, value))
    for who in sorted(by_who, key=lambda names: tuple(map(str, names))):
        days = sorted(by_who[who], key=lambda item: item[0])
        for (prev_day, prev), (day, cur) in zip(days, days[1:]):
            yield who, prev_day, prev, day, cur


def _set_change(before, after, words):
    """'new a, b; gone c' (with `words`): what `after` has that `before` lacks, then the reverse;
    "" if none."""
    parts = [(words[0], set(after) - set(before)), (words[1], set(before) - set(after))]
    return "; ".join(
        f"{word} {', '.join(map(_label, sorted(names, key=str)))}" for word, names in parts if names
    )


def _usage_habit(g):
    """Did a day's ok calls report usage always, sometimes or never (None: there was no ok call)."""
    return (
        None
        if not g.ok
        else "always" if not g.no_usage else "never" if g.no_usage == g.ok else "sometimes"
    )


def compare_days(
    prev,
    cur,
    latency_shift=DEFAULT_LATENCY_SHIFT,
    rate_jump=DEFAULT_RATE_JUMP,
    latency_floor=DEFAULT_LATENCY_FLOOR_MS
):
    """What differs from one day (a Group) to the next for one model string: yields (what,
    detail)."""
    for what, name in (
        ("response_model", "response_models"),
        ("system_fingerprint", "fingerprints")
    ):
        detail = _set_change(getattr(prev, name), getattr(cur, name), ("new", "gone"))
        if detail:
            yield what, detail
    if len(prev.latencies) >= MIN_LATENCY_SAMPLES and len(cur.latencies) >= MIN_LATENCY_SAMPLES:
        a, b = sorted(prev.latencies), sorted(cur.latencies)
        for q in (50, 95):
            old, new = percentile(a, q), percentile(b, q)
            if old and abs(new - old) / old > latency_shift and abs(new - old) >= latency_floor:
                yield f"latency_p{q}", f"{old:,.0f} -> {new:,.0f} ms ({(new - old) / old:+.0%})"
    before, after = _usage_habit(prev), _usage_habit(cur)
    if before and after and before != after:
        yield "usage", f"usage reported {before} -> {after}"
    if prev.calls and cur.calls:
        old_rate, new_rate = (prev.calls - prev.ok) / prev.calls, (cur.calls - cur.ok) / cur.calls
        if new_rate - old_rate >= rate_jump:
            yield "error_rate", f"{old_rate:.0%} -> {new_rate:.0%} of calls failed"
    if prev.checked and cur.checked:
        old_pass, new_pass = prev.passed / prev.checked, cur.passed / cur.checked
        if old_pass - new_pass >= rate_jump:
            yield "checks", f"{old_pass:.0%} -> {new_pass:.0%} of checks passed"


# == Reading back from ClickHouse ==


def remote_audit(client, *, since=None, until=None, model=None, verify=True):
    """Audit the lines shipped to ClickHouse (a fleet.ClickHouse), each ledger re-verified from its
    stored lines unless told not to (as `fleet.py verify`), through the local pass. Returns (audit,
    failures) like run_audit."""
    audit, failures = Audit(since=since, until=until, model=model), []
    for ledger, result in fleet.shipped_in_range(client, since, until, verify):
        if isinstance(result, rl.IntegrityError):
            failures.append(result)
        elif result is not None and not isinstance(result, rl.Verified):
            raise result  # a key is needed: exit 2, as locally
        else:
            audit.ledgers.append(
                {
                    "path": f"clickhouse:{ledger['ledger_id'][:12]} {ledger['last_host']}:"
                    f"{ledger['last_path']}",
                    "status": "unverified" if result is None else "ok",
                    "lines": ledger["n"] if result is None else result.count,
                    "reason": None
                }
            )
    for path, events in () if failures else fleet.events_in_range(client, since, until):
        audit._consume(events, path.endswith("/" + rl.EVENTS_NAME), path)
    return audit, failures


# == Imported sessions (transcripts.py): the agents' own transcripts, beside the proxied calls ==


def _imported(files, payload):
    # only the latest version of a file that changed counts; its segments add up
    # any JSON a hostile line holds: the key's parts as text, a version only as an int
    key = (str(payload.get("agent")), str(payload.get("session_id")))
    key += (Path(str(payload.get("source"))).name,)
    (version, parts), new = files.get(key, (None, [])), payload.get("version")
    if type(new) is not int:
        return
    if version != new:
        if version is not None and new < version:
            return
        files[key] = version, parts = new, []
    parts.append({k: payload.get(k) for k in ("usage", "agent_version")})


def _imported_rows(audit):
    """(rows per agent, model and day: turns, tool calls, tokens under the transcript's names,
    sessions; {agent: {"versions", "sessions"}}), within --since/--until and --model."""
    rows, agents = {}, {}
    first, last = (audit.since or "")[:10], (audit.until or "\uffff")[:10]
    for (agent, session, _name), (_version, parts) in audit.imported.items():
        seen = agents.setdefault(str(agent), {"versions": set(), "sessions": set()})
        seen["sessions"].add(session)
        for part in parts:
            seen["versions"].add(str(part["agent_version"]))
            usage = part["usage"] if type(part["usage"]) is dict else {}
            for model, days in usage.items():
                for day, counts in (days.items() if type(days) is dict else ()):
                    if not first <= day <= last or audit.model not in (None, model):
                        continue
                    row = rows.setdefault(
                        (str(agent), model, day),
                        {"agent": agent, "model": model, "day": day, "sessions": set()}
                    )
                    row["sessions"].add(session)
                    for name, n in counts.items() if type(counts) is dict else ():
                        row[name] = row.get(name, 0) + n if type(n) is int else row.get(name, 0)
    out = [dict(r, sessions=len(r["sessions"])) for _k, r in sorted(rows.items())]
    return out, {
        a: {"versions": sorted(v["versions"]), "sessions": len(v["sessions"])}
        for a, v in sorted(agents.items())
    }


def _imported_text(audit):
    rows, agents = audit.imported_rows()
    if not agents:
        return []
    out = [
        "",
        "Imported sessions (transcripts.py): turns are model responses; tokens as each transcript "
        "reports them, under its names, never estimated",
        "  from: "
        + "; ".join(
            f"{a} {', '.join(v['versions'])} ({v['sessions']} sessions)" for a, v in agents.items()
        )
    ]
    for row in rows:
        tokens = ", ".join(
            f"{k}={v:,}" for k, v in row.items() if k.endswith("tokens") and type(v) is int
        )
        out.append(
            f"  {row['day']}  {row['agent']}  {row['model']}: {row.get('turns', 0)} turns, "
            f"{row.get('tool_calls', 0)} tool calls, {row['sessions']} sessions; {tokens}"
        )
    return out


# == Reports: text, JSON, CSV ==


def _table(headers, rows, text_columns, cut=None, limit=None):
    """(lines, cut_any): aligned columns, text left and numbers right, cells made printable. With a
    limit, the columns in `cut` ({column: "middle" or "end"}) are narrowed in that order, down to
    MIN_CUT_WIDTH, to fit."""
    rows = [[rl.printable(cell) for cell in row] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    over = sum(widths) + 2 * (len(widths) - 1) - limit if limit else 0
    for name in cut or {}:
        i = headers.index(name)
        spare = max(0, min(over, widths[i] - max(MIN_CUT_WIDTH, len(name))))
        widths[i], over = widths[i] - spare, over - spare
    lines, cut_any = [], False
    for row in [headers] + rows:
        cells = []
        for cell, w, h in zip(row, widths, headers):
            if len(cell) > w:
                cell, cut_any = _elide(cell, w, cut[h]), True
            cells.append(cell.ljust(w) if h in text_columns else cell.rjust(w))
        lines.append("  ".join(cells).rstrip())
    return lines, cut_any


def _elide(text, width, where="middle"):
    if len(text) <= width:
        return text
    if where == "end":
        return text[: width - 1] + ELLIPSIS
    head = width // 2
    return text[:head] + ELLIPSIS + text[len(text) - (width - 1 - head) :]


def _model_table(rows, by_day, wide, endpoints, by="day"):
    """The models table: every column whole with --wide; else fitted to TEXT_WIDTH
    (docs/audit.md)."""

    def tokens(value):
        return _num(value) if value is None or wide or value < 10000 else _short(value)

    day = f" {by}" if by_day else ""
    columns = (
        f"model base_url{day} calls ok failed no_usage checks in_tok out_tok est_in~ est_out~ "
        "min_ms p50_ms p95_ms max_ms retries served"
        if wide
        else f"model{' at' if len(endpoints) > 1 else ''}{day} calls failed no_usage checks in_tok "
        f"out_tok est~ p50_ms p95_ms{'' if by_day else ' retries'} served"
    ).split()
    body = []
    for r in rows:
        est = (
            None
            if r["est_input_tokens"] is None
            else r["est_input_tokens"] + (r["est_output_tokens"] or 0)
        )
        served = (
            r["response_models"]
            if wide
            else {
                "=" if name == r["request_model"] else name: n
                for name, n in r["response_models"].items()
            }
        )
        cells = {
            "model": _label(r["request_model"]),
            "base_url": _label(r["base_url"]),
            "day": r["day"],
            "session": r["day"],
            "at": endpoints[r["base_url"]],
            "est~": tokens(est),
            "in_tok": tokens(r["input_tokens"]),
            "out_tok": tokens(r["output_tokens"]),
            "est_in~": _num(r["est_input_tokens"]),
            "checks": f"{r['passed']:,}/{r['checked']:,}" if r["checked"] else "-",
            "est_out~": _num(r["est_output_tokens"]),
            "served": ",".join(str(name) for name, _n in _ranked(served)) or "-"
        }
        cells.update(
            (name, _num(r[name])) for name in ("calls", "ok", "failed", "no_usage", "retries")
        )
        cells.update(
            (f"{q}_ms", _fmt_ms(r[f"latency_{q}_ms"])) for q in ("min", "p50", "p95", "max")
        )
        body.append([cells[c] for c in columns])
    return _table(
        columns,
        body,
        {"model", "base_url", "at", "day", "session", "served"},
        None if wide else {"served": "middle", "model": "middle"},
        None if wide else TEXT_WIDTH
    )


_RUN_TEXT = {
    "run": "run_id",
    "outcome": "outcome",
    "verdict": "judge_verdict",
    "steps": "steps",
    "tools_ok": "tools_allowed",
    "tools_denied": "tools_denied",
    "model_calls": "model_calls",
    "calls": "model_calls",
    "denied": "tools_denied",
    "in_tok": "input_tokens",
    "out_tok": "output_tokens",
    "est_tok~": "est_tokens",
    "why": "why"
}


def _runs_table(runs, wide):
    """`why` (how the run ended) last, cut at its end to fit unless --wide."""
    columns = (
        "run outcome verdict steps tools_ok tools_denied model_calls in_tok out_tok est_tok~ why"
        if wide
        else "run outcome steps calls denied why"
    ).split()
    text = {"run", "outcome", "verdict", "why"}
    body = [
        [_label(r[_RUN_TEXT[c]]) if c in text else _num(r[_RUN_TEXT[c]]) for c in columns]
        for r in runs
    ]
    return _table(
        columns, body, text, None if wide else {"why": "end"}, None if wide else TEXT_WIDTH
    )[0]


def render_text(audit, rows, changes, runs, verified, by_day, wide=False):
    sums, warnings = _sums(rows), _warnings(audit)
    files = len(audit.ledgers)
    mark = "verified" if verified else "UNVERIFIED (--no-verify): the chain was not checked"
    out = [f"audit: {rl.plural(files, 'ledger')}, {rl.plural(sums['calls'], 'model call')}, {mark}"]
    out += [line for line in warnings if line.startswith("warning:")] + [""]
    endpoints = {}  # base_url -> "#n", the short name the narrow table gives each endpoint
    for base in [r["base_url"] for r in rows] + [c["base_url"] for c in changes]:
        endpoints.setdefault(base, f"#{len(endpoints) + 1}")
    by = _by(audit, by_day)
    out.append("Models" + (f" by {by}" if by_day else "") + " (request_model @ base_url)")
    table, cut = (
        _model_table(rows, by_day, wide, endpoints, by) if rows else (["(no model calls)"], False)
    )
    out += table
    if rows and not wide:
        shown = {r["base_url"] for r in rows}
        out += [f"at {key} = {_label(base)}" for base, key in endpoints.items() if base in shown]
    if not wide:
        out.append(
            (
                f"{ELLIPSIS} marks a name cut in the middle to fit {TEXT_WIDTH} columns; "
                if cut
                else ""
            )
            + "served: = is the model asked for; latency in ms (ok calls); tokens from 10,000 on "
            "in k/M (3 digits); --wide shows exact tokens, min_ms, max_ms, ok, est_in~/est_out~"
            + (" and cut names whole" if cut else "")
        )
    out += _text_notes(sums) + [line for line in warnings if not line.startswith("warning:")]
    out += ["", f"Changes (day over day): {len(changes)}"]
    out[-1] = (
        "Changes: not compared by session (--by day compares days)" if by == "session" else out[-1]
    )
    for change in changes:
        who = change["request_model"] if change["request_model"] is not None else "(models list)"
        where = _label(change["base_url"]) if wide else endpoints.get(change["base_url"], "-")
        out.append(
            f"  {change['day']}  {who} @ {where}: {change['what']}: {change['detail']}  "
            f"(vs {change['previous_day']})"
        )
    if runs:
        out += ["", f"Agent runs: {len(runs)}"] + _runs_table(runs, wide)
    out += _imported_text(audit)
    # nothing from a ledger may forge a line or drive the terminal
    out = [rl.printable(line) for line in out]
    if not wide:  # prose wider than the terminal continues on the next line, indented
        out = [
            piece
            for line in out
            for piece in (
                [line]
                if len(line) <= TEXT_WIDTH
                else textwrap.wrap(
                    line, TEXT_WIDTH, subsequent_indent="    ", break_on_hyphens=False
                )
                or [line[:TEXT_WIDTH]]
            )
        ]
    return "\n".join(out) + "\n"


def _sums(rows):
    sums = {
        k: sum(r[k] or 0 for r in rows)
        for k in (
            "calls ok no_usage malformed usage_calls input_tokens output_tokens est_input_tokens "
            "est_output_tokens checked passed"
        ).split()
    }
    sums["errors"] = {}
    for r in rows:
        for name, count in r["errors"].items():
            _add(sums["errors"], name, count)
    return sums


def _warnings(audit):
    """Every report's warnings: torn tails, lines skipped, model strings folded, model strings not
    listed."""
    out = []
    for ledger in audit.ledgers:
        if ledger["status"] == "torn":
            out.append(f"warning: {ledger['reason']}")
        if ledger.get("skipped"):
            out.append(
                f"warning: {ledger['path']}: {ledger['skipped']:,} lines are not ledger events and "
                "were skipped"
            )
    if audit.unsent:
        n = sum(audit.unsent.values())
        out.append(
            f"not sent: {rl.plural(n, 'call')} refused by the proxy before sending ("
            + ", ".join(f"{k} {v:,}" for k, v in sorted(audit.unsent.items()))
            + "); counted apart: none was served"
        )
    if audit.folded:
        out.append(
            f"warning: more than {MAX_MODEL_STRINGS:,} model strings; {audit.folded:,} calls are "
            f"counted under {OTHER}"
        )
    return out + [
        f"not listed: {item['request_model']} @ {item['base_url']} "
        f"({rl.plural(item['calls'], 'call')}) is not in that endpoint's /models list of "
        f"{item['listed_at'][:10]}: a server that answers to any model name served it"
        for item in audit.unlisted()
    ]


def _by(audit, by_day):
    """What the rows are grouped by, as --by names it: model, day or session."""
    return "session" if audit.by_session else "day" if by_day else "model"


def _text_notes(sums):
    ok, measured = sums["ok"], sums["usage_calls"]
    out = [
        (
            f"usage: {sums['no_usage']:,} of {rl.plural(ok, 'ok call')} lacked usage; "
            f"in_tok/out_tok are what servers reported and cover {rl.plural(measured, 'call')} "
            f"({measured / ok:.0%})."
            if ok
            else "usage: no ok calls, so no usage to count."
        ),
        "est: est~ (est_in~ + est_out~) are chars/4 estimates, never added in."
    ]
    if sums["malformed"]:
        out.append(
            f"malformed: {sums['malformed']:,} model_call payloads had fields of the wrong type "
            "(written by another tool?); those fields were not counted"
        )
    if sums["errors"]:
        out.append(
            "errors: "
            + ", ".join(f"{name} {count:,}" for name, count in sorted(sums["errors"].items()))
        )
    return out


def render_json(audit, rows, changes, runs, verified, by_day):
    sums, unlisted = _sums(rows), audit.unlisted()
    return (
        json.dumps(
            {
                "version": 2,
                "verified": verified,
                "by": _by(audit, by_day),
                "ledgers": audit.ledgers,
                "summary": {
                    "model_calls": sums["calls"],
                    "ok": sums["ok"],
                    "no_usage": sums["no_usage"],
                    "malformed": sums["malformed"],
                    "folded_calls": audit.folded,
                    "changes": len(changes),
                    "agent_runs": len(runs),
                    "unlisted": len(unlisted),
                    "not_sent": audit.unsent
                },
                "models": rows,
                "changes": changes,
                "agent_runs": runs,
                "unlisted": unlisted,
                "imported": dict(zip(("models", "agents"), audit.imported_rows()))
            },
            ensure_ascii=False,
            indent=1
        )
        + "\n"
    )


def _csv_cell(value):
    """Text a spreadsheet would run as a formula gets a leading ' (OWASP's advice); null is an empty
    cell."""
    if value is None:
        return ""
    if type(value) in (int, float):
        return value
    if isinstance(value, dict):  # sorted as text: a served model may be null
        value = json.dumps(
            dict(sorted(value.items(), key=lambda kv: str(kv[0]))), ensure_ascii=False
        )
    text = str(value)
    return "'" + text if text.startswith(tuple("=+-@\t\r")) else text


def render_csv(rows):
    """The models table as CSV (RFC 4180: CRLF, a CR or LF in a value quoted)."""
    stream = io.StringIO()
    writer = csv.writer(stream, lineterminator="\r\n")
    writer.writerow(MODEL_COLUMNS)
    writer.writerows([_csv_cell(r[c]) for c in MODEL_COLUMNS] for r in rows)
    return stream.getvalue()


# == Reports: HTML ==

# One self-contained page: inline CSS and SVG, no script, nothing fetched. Every value from a ledger
# goes through _e(), in text, SVG <title>/<text> and attributes alike.

# Okabe-Ito
_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#000000", "#F0E442")
# Error types: colours each far (CIE76 delta E >= 35) from every model colour, so an error is never
# read as a model.
_ERROR_PALETTE = ("#4B0092", "#661100", "#D41159", "#B2DF8A", "#00441B", "#33A02C")
_GREY = "#8c8c8c"  # the model strings beyond MAX_CHART_MODELS
_ERROR_GREY = "#d9d9d9"  # the error types beyond _ERROR_PALETTE
_DASH = "\u2013"  # what a null (None) looks like on the page
_MAX_TABLE_ROWS = 300  # rows of the models table; the rest are in --json / --csv
_MAX_LIST_ROWS = 200  # changes, agent runs and ledgers listed
_MAX_CELL_LABELS = 5  # served models, fingerprints or error types named in one table cell
_MAX_CHART_DAYS = 120  # the per-day charts show the latest days
_MARKER_DAYS = 45  # a dot (with a tooltip) on every day up to this many days
# a longer ledger string is cut on the page (ask.py cuts server strings there too)
_MAX_TEXT = 512
# every chart: width, height; plot box (left, top, right, bottom)
_SIZE, _BOX = (640, 290), (66, 26, 626, 232)
# Column headings for people (the rest: the field name in words); each heading's title is its field
# name.
_HEADINGS = {
    "request_model": "Model (requested)",
    "base_url": "Endpoint",
    "passed": "Checks passed",
    "input_tokens": "In tokens",
    "output_tokens": "Out tokens",
    "est_input_tokens": "In tokens~",
    "est_output_tokens": "Out tokens~",
    "latency_p50_ms": "p50 ms",
    "latency_p95_ms": "p95 ms",
    "latency_max_ms": "Max ms",
    "response_models": "Served models",
    "run_id": "Run",
    "started": "Started (UTC)",
    "est_tokens": "Tokens (estimated)",
    "why": "Why it ended",
    "what": "What changed",
    "previous_day": "Compared with",
    "path": "Ledger",
    "lines": "Events",
    "reason": "Note",
    "label": "Model",
    "reported": "Tokens (reported)",
    "session_id": "Session"
}
# The tables lead with what is read first, so a narrow window scrolls only past the token counts.
_HTML_MODEL_COLUMNS = (
    "request_model base_url day calls failed latency_p50_ms latency_p95_ms latency_max_ms "
    "response_models errors no_usage checked passed input_tokens output_tokens est_input_tokens "
    "est_output_tokens retries"
).split()
_HTML_RUN_COLUMNS = (
    "run_id started outcome why judge_verdict steps tools_allowed tools_denied model_calls "
    "input_tokens output_tokens est_tokens errors"
).split()
_WHAT = {
    "response_model": "Served model",
    "system_fingerprint": "System fingerprint",
    "latency_p50": "Latency p50",
    "latency_p95": "Latency p95",
    "usage": "Usage reporting",
    "error_rate": "Error rate",
    "checks": "Check pass rate",
    "models_list": "Models listed"
}
_TEXT_FIELDS = set(
    (
        "request_model base_url day session_id response_models errors run_id started outcome "
        "judge_verdict "
        "what detail previous_day path status reason why label"
    ).split()
)
_CSS = (
    "body{font:14px system-ui,sans-serif;margin:24px auto;max-width:1400px;padding:0 24px;"
    "color:#1f2328}h2{margin-top:32px;padding-top:8px;border-top:1px solid #ddd}h3{font-size:14px;"
    "overflow-wrap:anywhere}h3 span{display:block;font-weight:400}.note,figcaption,.k,"
    ".s{color:#555;font-size:13px}.warn,.bad{color:#a33a00}nav a{margin-right:14px}"
    ".cards{display:flex;flex-wrap:wrap;gap:10px}.v{font-size:22px;font-weight:600}"
    ".card{border:1px solid #ddd;border-radius:8px;padding:8px 12px;min-width:140px}"
    ".scroll{overflow:auto;max-height:80vh;border:1px solid #ddd}table{border-collapse:collapse;"
    "width:100%}th,td{padding:4px 6px;border-bottom:1px solid #eee;text-align:right;"
    "vertical-align:top;white-space:nowrap}th{background:#f3f4f6;position:sticky;top:0;"
    "white-space:normal}.t{text-align:left;white-space:normal;"
    "overflow-wrap:break-word;min-width:10ch}.null{color:#aaa}"
    ".key{display:inline-block;width:11px;height:11px;margin-right:6px}"
    ".dash{background:repeating-linear-gradient(90deg,#8c8c8c 0 4px,#fff 4px 6px)!important}"
    ".legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:4px 18px}figure{margin:0}"
    ".charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:18px 28px}"
    "svg{max-width:100%;height:auto}svg text{font-size:11px;fill:#333}.gl{stroke:#e6e6e6}"
    ".axis{stroke:#888}.mark{stroke:#333;stroke-dasharray:4 3}"
)
# The per-day line charts: class, heading, unit (y axis and tooltips), a day's figure from (calls,
# ok, usage_calls, reported, estimated tokens) or None for a gap, and the format of a share (else a
# count).
_DAY_CHARTS = (
    ("calls-per-day", "Calls per day", "calls", lambda c, o, u, r, e: c, None),
    (
        "error-rate-per-day",
        "Failed calls (% of calls)",
        "of calls failed",
        lambda c, o, u, r, e: 100.0 * (c - o) / c if c else None,
        "{:.3g}%".format
    ),
    (
        "tokens-per-day",
        "Tokens reported by servers (input + output)",
        "tokens",
        lambda c, o, u, r, e: r if u else None,
        None
    ),
    (
        "est-tokens-per-day",
        "Tokens estimated (chars/4, input + output)",
        "tokens",
        lambda c, o, u, r, e: e if c else None,
        None
    )
)


def _e(value, limit=_MAX_TEXT):
    """A ledger value as HTML text or attribute (null as a dash), cut at `limit` characters."""
    return _DASH if value is None else html.escape(_elide(str(value), limit + 1, "end"), quote=True)


def _ms_text(value):
    if value is None:
        return _DASH
    return f"{value / 1000:,.1f} s" if value >= 10000 else f"{value:,.0f} ms"


def _is_date(day):
    try:
        return len(day) == 10 and datetime.date.fromisoformat(day).isoformat() == day
    except ValueError:  # not a date: the `at` of an unverified ledger
        return False


def _key(colour, dashed=False):
    return f'<span class="key{" dash" if dashed else ""}" style="background:{colour}"></span>'


def _chart_models(audit):
    """(series, order): the MAX_CHART_MODELS busiest (model, base_url) pairs and one grey series for
    the rest, each with [(day, Group)] and per-day figures (_DAY_CHARTS); order ranks every pair,
    busiest first."""
    totals = {}
    for (model, base, _day), group in audit.groups.items():
        _add(totals, (model, base), group.calls)
    order = sorted(totals, key=lambda k: (-totals[k], str(k[0]), str(k[1])))
    folded = (OTHER, OTHER) if audit.folded and (OTHER, OTHER) in totals else None
    top = [key for key in order if key != folded][:MAX_CHART_MODELS]
    series = [
        {
            "key": key,
            "label": f"{_label(key[0])} @ {_label(key[1])}",
            "colour": colour,
            "dashed": False
        }
        for key, colour in zip(top, _PALETTE)
    ]
    rest = [key for key in order if key not in top]
    if rest:
        many = f"{len(rest) - bool(folded):,}{'+' if folded else ''}"
        series.append(
            {
                "key": None,
                "colour": _GREY,
                "dashed": True,
                "label": f"{many} other model string"
                f"{'' if many == '1' else 's'} ({sum(totals[k] for k in rest):,} calls)"
            }
        )
    index = {key: i for i, key in enumerate(top)}
    for one in series:
        one.update(calls=0, groups=[], days={})
    for (model, base, day), g in audit.groups.items():
        one = series[index.get((model, base), len(top))]
        one["calls"] += g.calls
        one["groups"].append((day, g))
        figures = (
            g.calls,
            g.ok,
            g.usage_calls,
            g.input_tokens + g.output_tokens,
            g.est_input_tokens + g.est_output_tokens
        )
        one["days"][day] = [a + b for a, b in zip(one["days"].get(day, (0,) * 5), figures)]
    return series, order


def _frame(cls, title, top_value, y_title, x_ticks, x_title, fmt=_short, integer=True, attrs=""):
    """(parts, y_of): an SVG's opening, a y axis from 0 in about 4 steps of 1, 2 or 5, x ticks [(x,
    label)]."""
    (width, height), (left, top, right, bottom) = _SIZE, _BOX
    rough = top_value / 4 if top_value and top_value > 0 else 0.25
    mag = 10 ** math.floor(math.log10(rough))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= rough * (1 - 1e-9))
    step = max(1, math.ceil(step)) if integer else step
    ymax = step * math.ceil((top_value or 0) / step - 1e-9) or step

    def y_of(value):
        return bottom - (bottom - top) * value / ymax

    parts = [
        f'<svg class="{cls}"{attrs} xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img"><title>{_e(title)}</title>'
    ]
    for y, value in ((y_of(i * step), i * step) for i in range(int(round(ymax / step)) + 1)):
        parts.append(
            f'<line class="gl" x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(fmt(value))}</text>'
        )
    parts += [
        f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_e(label)}</text>'
        for x, label in x_ticks
    ]
    parts.append(
        f'<text text-anchor="middle" transform="translate(14 {(top + bottom) / 2:.0f}) '
        f'rotate(-90)">{_e(y_title)}</text><line class="axis" x1="{left}" y1="{bottom}" '
        f'x2="{right}" y2="{bottom}"/><text x="{(left + right) / 2:.0f}" y="{bottom + 38}" '
        f'text-anchor="middle">{_e(x_title)}</text>'
    )
    return parts, y_of


def _bands(labels):
    band = (_BOX[2] - _BOX[0]) / max(len(labels), 1)
    xs = [_BOX[0] + band * (i + 0.5) for i in range(len(labels))]
    every = max(1, math.ceil(len(labels) / 12))  # at most 12 labels on the axis
    return xs, [(x, label) for i, (x, label) in enumerate(zip(xs, labels)) if i % every == 0]


def _rect(x, y, width, height, colour, title, error_type=None):
    kind = "" if error_type is None else f' data-error-type="{_e(error_type)}"'
    return (
        f'<rect{kind} x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{height:.1f}" '
        f'fill="{colour}"><title>{_e(title)}</title></rect>'
    )


def _wrap(value):
    """Text that may wrap after a / (a URL, an org/model name) as well as at spaces."""
    return _e(value).replace("/", "/<wbr>")


def _td(field, row, colours, runs_url):
    value = row.get(field)
    if field == "request_model":
        if value is None and "what" in row:
            return '<td class="t">(models list)</td>'
        key = _key(colours.get((value, row["base_url"]), _GREY))
        return f'<td class="t">{key}{_wrap(_label(value))}</td>'
    if value in (None, {}, ""):
        return f'<td class="null">{_DASH}</td>'
    if isinstance(value, dict):
        ranked = _ranked(value)
        more = (
            f" and {len(ranked) - _MAX_CELL_LABELS:,} more"
            if len(ranked) > _MAX_CELL_LABELS
            else ""
        )
        return (
            '<td class="t">'
            + ", ".join(
                f"{_wrap(_label(name))}\u00a0\u00d7{n:,}" for name, n in ranked[:_MAX_CELL_LABELS]
            )
            + f"{more}</td>"
        )
    # only an id of agent.py's shape is a link
    if field == "run_id" and rl.OUR_RUN_ID_RE.match(str(value)):
        return f'<td class="t"><a href="{_e(runs_url + value)}">{_e(value)}</a></td>'
    if field == "what":
        return f'<td class="t" title="{_e(value)}">{_e(_WHAT.get(value, value))}</td>'
    if isinstance(value, str) or field in _TEXT_FIELDS:
        return f'<td class="t">{_wrap(value)}</td>'
    bad = ' class="bad"' if field in ("failed", "tools_denied", "errors") and value else ""
    return f"<td{bad}>{_fmt_ms(value) if field.endswith('_ms') else _num(value)}</td>"


def _html_table(css_class, columns, rows, colours=None, runs_url=""):
    heads = "".join(
        f'<th{" class=t" if c in _TEXT_FIELDS else ""} scope="col" data-field="{c}" title="{c}">'
        f'{_HEADINGS.get(c) or c.replace("_", " ").capitalize()}</th>'
        for c in columns
    )
    body = "\n".join(
        "<tr>" + "".join(_td(c, row, colours or {}, runs_url) for c in columns) + "</tr>"
        for row in rows
    )
    return (
        f'<div class="scroll"><table class="{css_class}"><thead><tr>{heads}</tr></thead>'
        f"<tbody>\n{body}\n</tbody></table></div>"
    )


def _per_day_section(series, axis):
    """A line chart per figure over the days, per model; with one day of data, that day's figures in
    a table."""
    days = axis[0]
    if not days:
        return ['<h2 id="per-day">Per day</h2><p>No model calls.</p>']
    legend = "".join(
        f'<li data-model="{_e(s["label"])}">{_key(s["colour"], s["dashed"])}{_e(s["label"])}'
        + (f' <span class="note">{s["calls"]:,} calls</span>' if s["key"] else "")
        + "</li>"
        for s in series
    )
    out = [
        '<h2 id="per-day">Per day, per model</h2>',
        f'<ul class="legend" data-legend="models">{legend}</ul>'
    ]
    figures = [[s["days"].get(day, (0,) * 5) for day in days] for s in series]
    if len(days) == 1:
        rows = [
            dict(
                s,
                calls=c,
                failed=f"{c - o:,} ({(c - o) / c:.1%})" if c else None,
                reported=r if u else None,
                est_tokens=e
            )
            for s, [(c, o, u, r, e)] in zip(series, figures)
        ]
        return out + [
            f'<p class="note one-day">One day of data ({_e(days[0])}): the per-day charts start '
            "with the second day. That day, per model:</p>",
            _html_table("one-day", "label calls failed reported est_tokens".split(), rows)
        ]
    out += [
        '<p class="note">A gap in a line: nothing to show that day (no calls, or no usage '
        'reported). '
        "Reported and estimated tokens are separate charts and are never added together.</p>",
        '<div class="charts">'
    ]
    out += [_day_chart(chart, series, figures, axis) for chart in _DAY_CHARTS]
    return out + ["</div>"]


def _day_chart(chart, series, figures, axis):
    """One of _DAY_CHARTS: a line per series; a gap where there is nothing, never a 0."""
    (cls, title, unit, pick, fmt), (xs, ticks) = chart, _bands(axis[1])
    lines = [(s, [pick(*day) for day in figs]) for s, figs in zip(series, figures)]
    top = max((v for _s, values in lines for v in values if v is not None), default=0)
    parts, y_of = _frame(cls, title, top, unit, ticks, axis[2], fmt or _short, fmt is None)
    for s, values in lines:
        parts.append(
            f'<g class="series" data-series="{_e(s["label"])}"><title>{_e(s["label"])}</title>'
        )
        dash = ' stroke-dasharray="6 4"' if s["dashed"] else ""
        for present, run in itertools.groupby(
            zip(xs, values), key=lambda point: point[1] is not None
        ):
            run = list(run)
            if present and len(run) > 1:
                parts.append(
                    f'<polyline fill="none" stroke="{s["colour"]}" stroke-width="2.2"{dash} '
                    'points="' + " ".join(f"{x:.1f},{y_of(v):.1f}" for x, v in run) + '"/>'
                )
        points = [(x, day, v) for x, day, v in zip(xs, axis[0], values) if v is not None]
        for x, day, v in points if len(axis[0]) <= _MARKER_DAYS or len(points) == 1 else ():
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y_of(v):.1f}" r="3.2" fill="{s["colour"]}" '
                f'stroke="#fff"><title>{_e(s["label"])} \u00b7 {_e(day)}: {(fmt or _num)(v)} '
                f"{unit}</title></circle>"
            )
        parts.append("</g>")
    return f"<figure><h3>{title}</h3>{''.join(parts)}</svg></figure>"


def _errors_section(series, axis):
    found = [
        (i, day, name, n)
        for i, s in enumerate(series)
        for day, g in s["groups"]
        for name, n in g.errors.items()
    ]
    if not found:
        return ['<h2 id="errors">Errors by day and type</h2><p>No failed calls.</p>']
    totals = {}
    for _i, _day, name, n in found:
        _add(totals, name, n)
    ranked = sorted(totals, key=lambda n: (-totals[n], str(n)))
    colours = dict(zip(ranked, _ERROR_PALETTE))
    other = f"{len(ranked) - len(colours):,} other error types"
    types = ranked[: len(colours)] + ([other] if len(ranked) > len(colours) else [])
    colours[other] = _ERROR_GREY
    by_day, by_model = {day: {} for day in axis[0]}, [{} for _s in series]
    for i, day, name, n in found:
        _add(by_model[i], name if name in colours else other, n)
        if day in by_day:
            _add(by_day[day], name if name in colours else other, n)
    legend = "".join(
        f'<li data-error-type="{_e(t)}">{_key(colours[t])}{_e(t)} <span class="note">'
        f"{sum(per.get(t, 0) for per in by_model):,}</span></li>"
        for t in types
    )
    out = [
        '<h2 id="errors">Errors by day and type</h2>',
        f'<ul class="legend" data-legend="error-types">{legend}</ul>',
        '<div class="charts">'
    ]
    # a model's name cut to its bar's width
    fit = max(4, int((_BOX[2] - _BOX[0]) / len(series) / 6.5))
    charts = (
        [
            (
                "day",
                "Failed calls per day, by error type (all models)",
                axis[0],
                axis[1],
                list(by_day.values()),
                axis[2]
            )
        ]
        if len(axis[0]) > 1
        else []
    )
    charts.append(
        (
            "model",
            "Failed calls by model and error type",
            [s["label"] for s in series],
            [_elide(_label(s["key"][0]) if s["key"] else "other", fit, "end") for s in series],
            by_model,
            "model, busiest first"
        )
    )
    return out + [_stacked_bars(*chart, types, colours) for chart in charts] + ["</div>"]


def _stacked_bars(kind, heading, cats, labels, counts, x_title, types, colours):
    """A bar per category, a rect per error type stacked in it."""
    left, _top, right, bottom = _BOX
    totals = [sum(per.values()) for per in counts]
    xs, ticks = _bands(labels)
    parts, y_of = _frame(
        f"errors-per-{kind}",
        f"failed calls per {kind}, by error type",
        max(totals),
        "failed calls",
        ticks,
        x_title
    )
    width = min((right - left) / len(cats) * 0.7, 56)
    for cat, x, per, total in zip(cats, xs, counts, totals):
        parts.append(f'<g class="{kind}" data-{kind}="{_e(cat)}">')
        y = bottom
        for name in (name for name in types if per.get(name)):
            y -= bottom - y_of(per[name])
            title = f"{cat}: {name} \u00d7 {per[name]:,}"
            parts.append(
                _rect(x - width / 2, y, width, bottom - y_of(per[name]), colours[name], title, name)
            )
        if total and len(cats) <= _MARKER_DAYS:
            parts.append(f'<text x="{x:.1f}" y="{y - 4:.1f}" text-anchor="middle">{total:,}</text>')
        parts.append("</g>")
    return f"<figure><h3>{heading}</h3>{''.join(parts)}</svg></figure>"


def _histogram(s, bins):
    """One model's ok latencies in `bins` log-scale bins over whole decades of ms, p50 and p95
    marked."""
    left, top, right, bottom = _BOX
    ordered = sorted(v for _day, group in s["groups"] for v in group.latencies)
    lo = math.floor(math.log10(max(ordered[0], 1.0))) if ordered else 2
    span = max(math.ceil(math.log10(max(ordered[-1], 1.0))) - lo, 1) if ordered else 1
    ticks = [
        m * 10**k
        for k in range(lo, lo + span + 1)
        for m in ((1, 2, 5) if span < 3 else (1,))
        if m * 10**k <= 10 ** (lo + span)
    ]

    def x_of(value):
        return left + (right - left) * (math.log10(max(value, 1.0)) - lo) / span

    counts = [0] * bins
    for value in ordered:
        counts[min(max(int((x_of(value) - left) / (right - left) * bins), 0), bins - 1)] += 1
    parts, y_of = _frame(
        "latency-histogram",
        f"latency of {s['label']} (ms, log scale)",
        max(counts),
        "ok calls",
        [(x_of(t), f"{t:g} ms" if t < 1000 else f"{t / 1000:g} s") for t in ticks],
        "latency (ms, log scale)",
        attrs=f' data-model="{_e(s["label"])}"'
    )
    for i, n in enumerate(counts):
        if n:
            a, b = (10 ** (lo + span * j / bins) for j in (i, i + 1))
            title = f"{_ms_text(a)} \u2013 {_ms_text(b)}: {n:,} calls"
            parts.append(
                _rect(
                    x_of(a) + 0.5,
                    y_of(n),
                    (right - left) / bins - 1,
                    bottom - y_of(n),
                    s["colour"],
                    title
                )
            )
    for row, q in enumerate((50, 95) if ordered else ()):
        x = x_of(percentile(ordered, q))
        anchor, dx = ("end", -3) if x > right - 90 else ("start", 3)
        parts.append(
            f'<line class="mark" x1="{x:.1f}" y1="{top - 12 + 12 * row}" x2="{x:.1f}" '
            f'y2="{bottom}"/><text x="{x + dx:.1f}" y="{top - 4 + 12 * row}" '
            f'text-anchor="{anchor}">p{q} {_ms_text(percentile(ordered, q))}</text>'
        )
    return (
        f'<figure><h3>{_key(s["colour"])}{_e(_label(s["key"][0]))}'
        f'<span>{_e(_label(s["key"][1]))}</span></h3>{"".join(parts)}</svg><figcaption>'
        f"{len(ordered):,} ok calls \u00b7 max {_ms_text(ordered[-1] if ordered else None)}"
        "</figcaption></figure>"
    )


def _latency_section(series, bins=32):
    """A histogram per model of its ok latencies in log-scale bins, so a cold-start hump stands
    apart."""
    out = [
        '<h2 id="latency">Latency per model</h2>',
        '<p class="note">Successful calls only, log-scale bins: a second hump to the right is '
        "usually cold starts or queueing. Dashed lines mark p50 and p95.</p>",
        '<div class="charts">'
    ]
    out += [_histogram(s, bins) for s in series if s["key"]] + ["</div>"]
    return out + [
        f'<p class="note">{_key(_GREY, True)}{_e(s["label"])}: no histogram (only the '
        f"{MAX_CHART_MODELS} busiest model strings get one).</p>"
        for s in series
        if not s["key"]
    ]


def _lists_sections(audit, changes, runs, runs_url, colours):
    more = (
        f"; the first {_MAX_LIST_ROWS:,} here, the rest in --json"
        if len(changes) > _MAX_LIST_ROWS
        else ""
    )
    out = [
        f'<h2 id="changes">Changes day over day ({len(changes):,}{more})</h2>',
        (
            _html_table(
                "changes",
                "day request_model base_url what detail previous_day".split(),
                changes[:_MAX_LIST_ROWS],
                colours
            )
            if changes
            else "<p>Nothing changed from one day to the next.</p>"
        )
    ]
    if runs:
        out += [
            f'<h2 id="runs">Agent runs ({len(runs):,})</h2>',
            f'<p class="note">A run id links to {_e(runs_url)}'
            "ID: the timeline daemon.py shows (--runs-url sets where)."
            + (
                f" The latest {_MAX_LIST_ROWS:,}; --json has all."
                if len(runs) > _MAX_LIST_ROWS
                else ""
            )
            + "</p>",
            _html_table("runs", _HTML_RUN_COLUMNS, runs[-_MAX_LIST_ROWS:], runs_url=runs_url)
        ]
    return out + [
        f'<h2 id="ledgers">Ledgers read ({len(audit.ledgers):,})</h2><details><summary>show the '
        "list</summary>",
        _html_table("ledgers", "path status lines reason".split(), audit.ledgers[:_MAX_LIST_ROWS]),
        "</details>"
    ]


def _day_axis(audit):
    """(days, their labels, the axis title): every calendar day to the last (at most
    _MAX_CHART_DAYS), or the days found if some are not dates."""
    days = sorted({day for (_m, _b, day) in audit.groups})[-_MAX_CHART_DAYS:]
    dated = bool(days) and all(map(_is_date, days))
    if dated:
        last = datetime.date.fromisoformat(days[-1])
        n = min((last - datetime.date.fromisoformat(days[0])).days, _MAX_CHART_DAYS - 1)
        days = [(last - datetime.timedelta(i)).isoformat() for i in range(n, -1, -1)]
    years = _DASH.join(sorted({days[0][:4], days[-1][:4]})) if dated else ""
    return (
        days,
        [day[5:] if dated else day for day in days],
        f"day (UTC{', ' + years if years else ''})"
    )


def _cards(audit, sums, days):
    calls, ok, measured = sums["calls"], sums["ok"], sums["usage_calls"]
    latencies = sorted(v for g in audit.groups.values() for v in g.latencies)
    strings = rl.plural(len(audit.model_strings), "model string") + (
        " and more" if audit.folded else ""
    )
    checked, passed = sums["checked"], sums["passed"]
    cards = [
        ("Model calls", f"{calls:,}", f"{strings} \u00b7 {rl.plural(len(days), 'day')}"),
        (
            "Failed",
            f"{calls - ok + checked - passed:,}",
            f"{rl.plural(calls - ok, 'call')} failed (no answer) \u00b7 "
            f"{rl.plural(checked - passed, 'check')} not passed (an answer that did not pass)"
        ),
        (
            "Checks passed",
            f"{passed:,} / {checked:,}" if checked else _DASH,
            "--expect, --expect-json, --strict-model" if checked else "no call was checked"
        ),
        ("No usage reported", f"{sums['no_usage']:,}", f"of {ok:,} ok calls"),
        (
            "Tokens reported",
            _short(sums["input_tokens"] + sums["output_tokens"]) if measured else _DASH,
            f"in + out, from {measured:,} calls"
        ),
        (
            "Tokens estimated",
            _short(sums["est_input_tokens"] + sums["est_output_tokens"]),
            "chars/4, in + out"
        ),
        (
            "Latency p50",
            _ms_text(percentile(latencies, 50)),
            f"p95 {_ms_text(percentile(latencies, 95))}"
        )
    ]
    return (
        ['<div class="cards">']
        + [
            f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div>'
            f'<div class="s">{_e(s)}</div></div>'
            for k, v, s in cards
        ]
        + ["</div>"]
    )


def _models_section(rows, order, by_day, colours, by="day"):
    rank = {key: i for i, key in enumerate(order)}
    shown = sorted(rows, key=lambda r: rank.get((r["request_model"], r["base_url"]), len(rank)))
    shown = shown[:_MAX_TABLE_ROWS]
    return [
        f'<h2 id="models">Models{" by " + by if by_day else ""}</h2><p class="note">One row per '
        f'model string (the model asked for, at its endpoint){" and " + by if by_day else ""}, '
        "busiest first. Tokens are what servers reported; tokens~ are chars/4 estimates, never "
        "added to them; latency in ms of ok calls. \u2013 means nothing was reported. OK calls, "
        "malformed payloads, minimum latency and fingerprints: --json or --csv."
        + (
            f" The {len(shown):,} busiest rows; --json or --csv has all {len(rows):,}."
            if len(rows) > len(shown)
            else ""
        )
        + "</p>",
        _html_table(
            "models",
            [
                c if c != "day" or by == "day" else "session_id"
                for c in _HTML_MODEL_COLUMNS
                if by_day or c != "day"
            ],
            shown,
            colours
        )
    ]


def render_html(audit, rows, changes, runs, verified, by_day, runs_url=DEFAULT_RUNS_URL):
    series, order = _chart_models(audit)
    colours = {s["key"]: s["colour"] for s in series if s["key"]}
    axis, sums, files = _day_axis(audit), _sums(rows), len(audit.ledgers)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>reasoning-ledger audit</title><style>{_CSS}</style></head><body>"
        "<h1>Model calls audit</h1>",
        f'<p class="note">{files:,} ledger{"s" if files != 1 else ""}, {sums["calls"]:,} model '
        "calls, "
        + (
            "verified (every hash chain checked)."
            if verified
            else '<strong class="warn">UNVERIFIED</strong> (--no-verify): the hash chain was not '
            "checked; anything on this page may have been edited."
        )
        + '</p><nav><a href="#models">Models</a><a href="#per-day">Per day</a>'
        '<a href="#errors">Errors</a><a href="#latency">Latency</a><a href="#changes">Changes</a>'
        + ('<a href="#runs">Agent runs</a>' if runs else "")
        + '<a href="#ledgers">Ledgers</a></nav>'
    ]
    out += [f'<p class="warn">{_e(line)}</p>' for line in _warnings(audit)[:_MAX_LIST_ROWS]]
    out += _cards(audit, sums, axis[0])
    out += _models_section(rows, order, by_day, colours, _by(audit, by_day))
    out += _per_day_section(series, axis) + _errors_section(series, axis) + _latency_section(series)
    out += _lists_sections(audit, changes, runs, runs_url, colours) + ["</body></html>"]
    return "\n".join(out) + "\n"


# == Conversations: one session as a timeline (--conversation) ==

MAX_PART_CHARS = 20000  # a text, call or reasoning shown; the store keeps it whole
MAX_RESULT_CHARS = 2000  # a tool's result shown
_HASH_RE = re.compile(r"[0-9a-f]{64}\Z")
_ROLE_CSS = (
    ".call{margin-top:18px;padding:4px 8px;background:#f3f4f6;font-weight:600}"
    ".msg{margin:6px 0 6px 16px;border-left:3px solid #ddd;padding:2px 10px}"
    ".msg pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:2px 0;font:13px monospace}"
    ".user{border-color:#0072B2}.assistant{border-color:#009E73}.tool{border-color:#E69F00}"
)


def _stored_entry(path, name):
    """(role, parts) of a text the ledger at `path` names, read from its text store; a missing,
    changed or unreadable one says so."""
    if type(name) is not str or not _HASH_RE.match(name):
        return "?", [{"type": "text", "text": "[not a text name]"}]
    try:
        data = (rl.text_dir(path) / name).read_bytes()
        entry = json.loads(data) if hashlib.sha256(data).hexdigest() == name else None
    except (OSError, ValueError, RecursionError) as exc:
        entry = {"parts": [{"type": "text", "text": f"[{rl.error_text(exc)}]"}]}
    entry = entry if type(entry) is dict else {"parts": [{"type": "text", "text": "[changed]"}]}
    parts = entry.get("parts")
    return str(entry.get("role", "?")), parts if type(parts) is list else []


def _call_entry(event, p):
    """A call's own line on the timeline: when, route, model asked and served, tokens, latency."""
    text = (
        f"#{event['seq']} {event['at']} {p.get('route') or ''} model {p.get('request_model')} "
        f"served {_label(p.get('response_model'))}  tokens {_num(p.get('input_tokens'))} in, "
        f"{_num(p.get('output_tokens'))} out  {_ms_text(p.get('latency_ms'))}"
    )
    error = p.get("error_type")
    return "call", [{"type": "text", "text": text + (f"  error {error}" if error else "")}]


def conversation(paths, session):
    """(session id, [(role, parts)]) of one session (`session`: its id or a unique prefix) in the
    verified ledgers at `paths`: each call's line ("call"), the messages it adds to the one before,
    and its answer."""
    calls = [
        (event["at"], str(path), event)
        for path in find_ledgers(paths)
        for event in rl.read_events(path)
        if event["kind"] == "model_call" and type(event["payload"].get("session_id")) is str
    ]
    ids = {event["payload"]["session_id"] for _at, _path, event in calls}
    found = [session] if session in ids else sorted(i for i in ids if i.startswith(session))
    if len(found) != 1:
        raise AuditError(
            f"{len(found)} sessions match {session!r}: " + ", ".join(found[:10])
            if found
            else f"no session {session!r} in the ledgers"
        )
    entries, before = [], []
    for _at, path, event in sorted(calls, key=lambda c: c[:2] + (c[2]["seq"],)):
        p = event["payload"]
        if p["session_id"] == found[0]:
            names = p.get("messages_text") if type(p.get("messages_text")) is list else []
            same = len(list(itertools.takewhile(lambda two: two[0] == two[1], zip(names, before))))
            entries.append(_call_entry(event, p))
            entries += [_stored_entry(path, name) for name in names[same:]]
            entries += [_stored_entry(path, p["answer_text"])] * ("answer_text" in p)
            before = names + [p.get("answer_text")]
    return found[0], entries


def _part_view(part):
    """(label, text) of one part, bounded: text, reasoning, a tool call with its arguments, or a
    tool's result."""
    part = part if type(part) is dict else {"text": part}
    kind, text = part.get("type"), str(part.get("text") or "")
    if kind == "tool_call":
        text = f"{part.get('name')}({part.get('arguments')}) [{part.get('id')}]"
    elif kind == "tool_result":
        return f"tool result [{part.get('id')}]", _elide(text, MAX_RESULT_CHARS, "end")
    return str(kind or "text").replace("_", " "), _elide(text, MAX_PART_CHARS, "end")


def render_conversation(session, entries):
    """The timeline as text: control characters escaped, so a ledger cannot drive the terminal."""
    out = [f"Conversation {rl.printable(session)}"]
    for role, parts in entries:
        for label, text in map(_part_view, parts):
            if role == "call":
                out += ["", rl.printable(text)]
                continue
            out.append(f"  {rl.printable(role)} ({label}):")
            out += ["    " + rl.printable(line) for line in text.splitlines() or [""]]
    return "\n".join(out) + "\n"


def render_conversation_html(session, entries):
    """The timeline as one self-contained page: every ledger value escaped."""
    out = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        f"<title>conversation {_e(session)}</title><style>{_CSS}{_ROLE_CSS}</style></head><body>",
        f"<h1>Conversation {_e(session)}</h1>"
    ]
    for role, parts in entries:
        for label, text in map(_part_view, parts):
            out.append(
                f'<div class="call">{_e(text, MAX_PART_CHARS)}</div>'
                if role == "call"
                else f'<div class="msg {_e(role, 40)}"><span class="k">{_e(role)} ({_e(label)})'
                f"</span><pre>{_e(text, MAX_PART_CHARS)}</pre></div>"
            )
    return "\n".join(out + ["</body></html>"]) + "\n"


def _run_conversation(args):
    if args.from_url is not None or args.json or args.csv:
        raise AuditError("--conversation reads ledger files: not with --from, --json or --csv")
    session, entries = conversation(args.paths, args.conversation)
    if args.html:
        Path(args.html).write_text(render_conversation_html(session, entries), encoding="utf-8")
    rl.write_out(render_conversation(session, entries))
    return rl.EXIT_OK


# == CLI ==


# The change thresholds: (flag, default, metavar, help, 0 allowed); each a finite number
_THRESHOLDS = (
    (
        "--latency-shift",
        DEFAULT_LATENCY_SHIFT,
        None,
        "flag a p50/p95 move larger than this fraction (default 0.5)",
        False
    ),
    (
        "--latency-floor",
        DEFAULT_LATENCY_FLOOR_MS,
        "MS",
        "never flag a latency move smaller than this many ms (default 50)",
        True
    ),
    (
        "--rate-jump",
        DEFAULT_RATE_JUMP,
        None,
        "flag an error rate rise or pass rate fall of this much (default 0.2)",
        False
    )
)


_FLAG = {"action": "store_true"}
# (group, name, help, options) of the report options; group "output": one of them at most
_OPTIONS = (
    (
        "",
        "--by",
        "one row per model, per model and day, or per model and proxy session "
        "(X-Ledger-Session)",
        {"choices": ("model", "day", "session"), "default": "model"}
    ),
    ("", "--since", "date (UTC) or ISO time", {}),
    ("", "--until", "date (inclusive) or ISO time", {}),
    ("", "--model", "only this request_model", {}),
    ("output", "--json", "machine-readable output, stable keys", _FLAG),
    ("output", "--csv", "the model table as CSV", _FLAG),
    ("", "--wide", f"every column, names whole (default: fit {TEXT_WIDTH} columns)", _FLAG),
    ("", "--html", "also write a self-contained page with charts", {"metavar": "FILE"}),
    (
        "",
        "--runs-url",
        "with --html: run ids link to URL + id, e.g. the daemon's http://HOST:PORT/runs/ "
        f"(default {DEFAULT_RUNS_URL!r}, relative to the page)",
        {"default": DEFAULT_RUNS_URL, "metavar": "URL"}
    ),
    ("", "--no-verify", "audit without checking the chain (marked UNVERIFIED)", _FLAG),
    (
        "",
        "--jobs",
        "worker processes per ledger (default: one per core, at most 8, for 4 MiB or more); "
        "the report is the same",
        {"type": int, "metavar": "N"}
    ),
    (
        "",
        "--conversation",
        "one session (its id or a unique prefix) as a timeline of messages, tool calls and "
        "answers (proxy.py --store-text); with --html also as a page",
        {"metavar": "SESSION"}
    ),
    ("", "--fail-on-change", "exit 4 when the Changes section is not empty", _FLAG),
    ("", "--allow-empty", "no ledger found is an empty report, not exit 2", _FLAG)
)


def _build_parser():
    p = rl.ArgumentParser(
        prog="audit.py",
        description="What each model string did, day by day.",
        epilog=rl.exit_codes_epilog(
            rl.EXIT_OK, rl.EXIT_FAILED, rl.EXIT_USAGE, rl.EXIT_CHANGED, rl.EXIT_OUTPUT
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="ledgers, directories or globs (default: calls.jsonl, transcripts.jsonl and "
        "runs/*/events.jsonl)"
    )
    p.add_argument("--version", action="version", version=__version__)
    output = p.add_mutually_exclusive_group()
    for where, name, about, options in _OPTIONS:
        (output if where else p).add_argument(name, help=about, **options)
    for name, default, metavar, about, _zero in _THRESHOLDS:
        p.add_argument(name, type=float, default=default, metavar=metavar, help=about)
    _from_options(p)
    return p


def _from_options(p):
    p.add_argument(
        "--from",
        dest="from_url",
        nargs="?",
        const="",
        metavar="URL",
        help=f"audit the lines shipped to ClickHouse at URL (default ${fleet.SHIP_URL_ENV}) "
        f"instead of files; user and password from ${fleet.SHIP_USER_ENV} / "
        f"${fleet.SHIP_PASSWORD_ENV}"
    )
    for name, default, metavar, about in (
        ("--database", fleet.SHIP_DATABASE, "DB", f"with --from ({fleet.SHIP_DATABASE})"),
        ("--table", fleet.SHIP_TABLE, "T", f"with --from ({fleet.SHIP_TABLE})")
    ):
        p.add_argument(name, default=default, metavar=metavar, help=about)
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --from: seconds a request (300)"
    )


def run_audit(paths, *, verify=True, since=None, until=None, model=None, by_session=False, jobs=1):
    """Audit the given ledgers. Returns (audit, failures): failures lists the IntegrityErrors.
    `jobs`: worker processes per ledger, as rl.verify()'s."""
    audit, failures = Audit(since, until, model, by_session, jobs), []
    for path in find_ledgers(paths):
        try:
            audit.add_file(path, verify=verify)
        except rl.IntegrityError as exc:
            failures.append(exc)
    return audit, failures


def _gather(args):
    """(audit, failures) of the ledgers at PATHs, or with --from of those shipped to ClickHouse."""
    kw = dict(
        since=rl.parse_time(args.since) if args.since else None,
        until=rl.parse_time(args.until, end=True) if args.until else None,
        model=args.model,
        verify=not args.no_verify
    )
    if args.jobs is not None and args.jobs < 1:
        raise AuditError("--jobs must be 1 or more")
    if args.from_url is None:
        return run_audit(args.paths, by_session=args.by == "session", jobs=args.jobs, **kw)
    if args.paths or args.by == "session":
        raise AuditError(
            "--from reads ClickHouse: it takes no PATH"
            if args.paths
            else "--by session reads ledgers: the shipped table has no session column"
        )
    client = fleet.ClickHouse(
        args.from_url or None, database=args.database, table=args.table, timeout=args.timeout
    )
    try:
        return remote_audit(client, **kw)
    except fleet.ClickHouseError as exc:
        exc.exit_code = rl.EXIT_USAGE  # the input could not be read
        raise


def _run(args):
    if args.conversation is not None:
        return _run_conversation(args)
    for name, _default, _metavar, _about, zero in _THRESHOLDS:
        value = vars(args)[name[2:].replace("-", "_")]
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            raise AuditError(
                f"{name} must be a " + ("number of at least 0" if zero else "positive number")
            )
    audit, failures = _gather(args)
    if failures:
        for exc in failures:
            rl.write_out(f"FAIL  {rl.printable(exc)}\n")
        rl.error(
            f"{len(failures)} ledger(s) failed verification; nothing was audited "
            f"(--no-verify audits anyway, marked UNVERIFIED): {failures[0]}"
        )
        return rl.EXIT_FAILED
    if not audit.ledgers:
        where = ", ".join(map(str, args.paths)) or "./calls.jsonl, ./transcripts.jsonl, ./runs/"
        found = (
            f"no ledgers found (looked in {where})"
            if args.from_url is None
            else "no ledgers found in ClickHouse (nothing shipped in that time range)"
        )
        if not args.allow_empty:
            raise AuditError(f"{found}: nothing to audit (--allow-empty reports it anyway)")
        rl.warn(found)
    # by session: the session in the day column
    by_day, by_session = args.by != "model", args.by == "session"
    rows = audit.model_rows(by_day)
    for row in rows if by_session else ():
        row["session_id"] = row["day"]
    changes = (
        [] if by_session else audit.changes(args.latency_shift, args.rate_jump, args.latency_floor)
    )
    report = (audit, rows, changes, audit.run_rows(), not args.no_verify, by_day)
    if args.html:
        Path(args.html).write_text(render_html(*report, runs_url=args.runs_url), encoding="utf-8")
    rl.write_out(
        render_json(*report)
        if args.json
        else render_csv(rows) if args.csv else render_text(*report, wide=args.wide)
    )
    if args.fail_on_change and changes:
        rl.error(f"{len(changes)} change(s) found")
        return rl.EXIT_CHANGED
    return rl.EXIT_OK


def main(argv=None):
    return rl.run_main(_build_parser(), argv, _run)


if __name__ == "__main__":
    sys.exit(main())
