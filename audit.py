#!/usr/bin/env python3
"""audit.py -- what each model string did, day by day, from verified ledgers only. Stdlib only.

Usage:
  python audit.py                          # ./calls.jsonl and ./runs/*/events.jsonl
  python audit.py calls.jsonl runs/ --by day
  python audit.py --since 2026-11-01 --model my-model --fail-on-change   # exit 4 when something changed
  python audit.py --json > audit.json      # or --csv; --html report.html for a page with charts
  python audit.py --no-verify broken.jsonl # audit anyway, marked UNVERIFIED

Exit codes: 0 ok, 1 a ledger failed verification (nothing audited), 2 usage or I/O error,
4 changes found and --fail-on-change given, 5 stdout could not be written.
"""

import argparse
import csv
import glob
import html
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the toolkit beside us, even under -I
import ask  # noqa: E402  -- the model_call field list
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.1.0"

__all__ = ["Audit", "run_audit", "find_ledgers", "percentile", "compare_days", "model_call_view",
           "render_text", "render_json", "render_csv", "render_html", "MODEL_COLUMNS", "AuditError"]

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

DEFAULT_LEDGERS = ("calls.jsonl", "runs.jsonl")  # runs.jsonl: ask.py's default before 1.1
DEFAULT_RUNS = "runs"
DEFAULT_LATENCY_SHIFT = 0.5
DEFAULT_RATE_JUMP = 0.2
MIN_LATENCY_SAMPLES = 3
DEFAULT_LATENCY_FLOOR_MS = 50.0
NO_USAGE_STATUSES = ("absent", "zero", "malformed")
MAX_MODEL_STRINGS = 1000   # distinct (request_model, base_url) pairs kept apart; the rest share one row
MAX_LABELS = 50            # distinct served models, fingerprints or error types kept per row
OTHER = "(other)"
MAX_CHART_MODELS = 8       # the HTML draws per-model charts for the busiest; the rest are summarised

MODEL_COLUMNS = ("request_model", "base_url", "day", "calls", "ok", "failed", "no_usage", "malformed", "checked",
                 "passed", "input_tokens", "output_tokens", "usage_calls", "est_input_tokens", "est_output_tokens",
                 "latency_min_ms", "latency_p50_ms", "latency_p95_ms", "latency_max_ms", "retries",
                 "response_models", "system_fingerprints", "errors")
RUN_COLUMNS = ("run_id", "started", "outcome", "judge_verdict", "steps", "tools_allowed", "tools_denied",
               "model_calls", "input_tokens", "output_tokens", "est_tokens", "errors")
# The model_call fields this audit reads, each checked against ask.py's definition of its types.
_READ = ("request_model", "base_url", "attempt", "error_type", "usage_status", "usage_reported", "latency_ms",
         "response_model", "system_fingerprint", "check", "input_tokens", "output_tokens", "est_input_tokens",
         "est_output_tokens")
_TYPES = {name: ask.MODEL_CALL_FIELDS[name] for name in _READ}


class AuditError(rl.UsageError):
    """Bad arguments or unreadable input (exit 2)."""


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------

def percentile(sorted_values, q):
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, int(math.ceil(q / 100.0 * len(sorted_values))))
    return sorted_values[rank - 1]


def model_call_view(payload):
    """(fields, malformed): the fields this audit reads from a model_call payload, each None unless it
    has a type ask.py writes for it; malformed is True when a present field had another type. A payload
    written by another tool is counted, never a crash."""
    view, malformed = {}, False
    for name, types in _TYPES.items():
        value = payload.get(name)
        if value is not None and type(value) not in types:
            malformed, value = True, None
        elif type(value) is float and not math.isfinite(value):
            malformed, value = True, None
        view[name] = value
    return view, malformed


def _count_label(counter, label):
    """counter[label] += 1, with at most MAX_LABELS distinct labels (the rest under OTHER)."""
    if label not in counter and len(counter) >= MAX_LABELS:
        label = OTHER
    counter[label] = counter.get(label, 0) + 1


def _fmt_int(value):
    return "-" if value is None else f"{value:,}"


def _fmt_ms(value):
    if value is None:
        return "-"
    return f"{value / 1000:.1f}s" if value >= 10000 else f"{value:.0f}"


def _top(counter):
    return ",".join(f"{name}" for name, _ in sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def find_ledgers(paths):
    """Expand PATHs (files, directories, globs) into ledger files; default: ./calls.jsonl + ./runs/."""
    if not paths:
        found = [Path(name) for name in DEFAULT_LEDGERS if Path(name).is_file()]
        if Path(DEFAULT_RUNS).is_dir():
            found += sorted(Path(DEFAULT_RUNS).glob("*/" + rl.EVENTS_NAME))
        return found
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
    seen, unique = set(), []
    for path in out:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


# ----------------------------------------------------------------------------
# Core: one streaming pass
# ----------------------------------------------------------------------------

class Group:
    """Counters for one (request_model, base_url, day)."""

    COUNTS = ("calls", "ok", "no_usage", "malformed", "checked", "passed", "input_tokens", "output_tokens",
              "usage_calls", "est_input_tokens", "est_output_tokens", "est_output_calls", "retries")
    __slots__ = COUNTS + ("latencies", "response_models", "fingerprints", "errors")

    def __init__(self):
        for name in self.COUNTS:
            setattr(self, name, 0)
        self.latencies = []
        self.response_models, self.fingerprints, self.errors = {}, {}, {}

    def add(self, call, malformed):
        """Count one model_call (its model_call_view)."""
        self.calls += 1
        self.malformed += malformed
        if (call["attempt"] or 1) > 1:
            self.retries += 1
        measured = call["usage_reported"] is True and call["usage_status"] not in NO_USAGE_STATUSES
        if call["error_type"] is None:
            self.ok += 1
            if call["latency_ms"] is not None:
                self.latencies.append(call["latency_ms"])
            if not measured:
                self.no_usage += 1
            _count_label(self.response_models, call["response_model"])
            if call["system_fingerprint"] is not None:
                _count_label(self.fingerprints, call["system_fingerprint"])
            if call["check"] is not None:
                self.checked += 1
                self.passed += call["check"] is True
        else:
            _count_label(self.errors, call["error_type"])
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
        for mine, theirs in ((self.response_models, other.response_models),
                             (self.fingerprints, other.fingerprints), (self.errors, other.errors)):
            for name, count in theirs.items():
                if name not in mine and len(mine) >= MAX_LABELS:
                    name = OTHER
                mine[name] = mine.get(name, 0) + count

    def row(self, request_model, base_url, day):
        """One row of the model table. A count that nothing reported is None (null), never 0."""
        lat = sorted(self.latencies)
        return {
            "request_model": request_model, "base_url": base_url, "day": day,
            "calls": self.calls, "ok": self.ok, "failed": self.calls - self.ok, "no_usage": self.no_usage,
            "malformed": self.malformed, "checked": self.checked,
            "passed": self.passed if self.checked else None,
            "input_tokens": self.input_tokens if self.usage_calls else None,
            "output_tokens": self.output_tokens if self.usage_calls else None, "usage_calls": self.usage_calls,
            "est_input_tokens": self.est_input_tokens if self.calls else None,
            "est_output_tokens": self.est_output_tokens if self.est_output_calls else None,
            "latency_min_ms": lat[0] if lat else None, "latency_p50_ms": percentile(lat, 50),
            "latency_p95_ms": percentile(lat, 95), "latency_max_ms": lat[-1] if lat else None,
            "retries": self.retries,
            "response_models": dict(sorted(self.response_models.items(), key=lambda kv: str(kv[0]))),
            "system_fingerprints": dict(sorted(self.fingerprints.items(), key=lambda kv: str(kv[0]))),
            "errors": dict(sorted(self.errors.items(), key=lambda kv: str(kv[0]))),
        }


class Audit:
    """Everything the reports need, gathered in one pass over the events."""

    def __init__(self, since=None, until=None, model=None):
        self.since, self.until, self.model = since, until, model
        self.groups = {}            # (request_model, base_url, day) -> Group
        self.model_strings = set()  # the (request_model, base_url) pairs kept apart
        self.folded = 0             # calls counted under OTHER because there were too many model strings
        self.listings = {}          # (base_url, day) -> (at, model_ids) of the day's last listing
        self.runs = {}              # run_id -> agent run summary
        self.ledgers = []           # {"path", "status", "lines", "reason"}

    def add_file(self, path, verify=True):
        """Stream one ledger into the audit. Returns its status dict; raises IntegrityError /
        KeyRequiredError when `verify` and the file does not hold."""
        info = {"path": str(path), "status": "ok", "lines": 0, "reason": None}
        agent_run = path.name == rl.EVENTS_NAME
        events = self._verified(path, info) if verify else self._unverified(path, info)
        self._consume(events, agent_run, path)
        self.ledgers.append(info)
        return info

    def _verified(self, path, info):
        count = 0
        try:
            for event, _raw, _digest in rl.iter_lines(path):
                count += 1
                yield event
        except rl.TornTailError as exc:
            info["status"], info["reason"] = "torn", str(exc)
        finally:
            info["lines"] = count

    @staticmethod
    def _unverified(path, info):
        count = skipped = 0
        info["status"] = "unverified"
        with open(path, "rb") as handle:
            for raw in handle:
                try:
                    event = json.loads(raw)
                except (ValueError, RecursionError):
                    event = None
                if (type(event) is dict and type(event.get("payload")) is dict and type(event.get("at")) is str
                        and type(event.get("kind")) is str and type(event.get("run_id")) is str):
                    count += 1
                    info["lines"] = count
                    yield event
                else:
                    skipped += 1
                    info["skipped"] = skipped

    def _group(self, model, base, day):
        key = (model, base)
        if key not in self.model_strings:
            if len(self.model_strings) >= MAX_MODEL_STRINGS:
                self.folded += 1
                model, base = OTHER, OTHER
            else:
                self.model_strings.add(key)
        group = self.groups.get((model, base, day))
        if group is None:
            group = self.groups[(model, base, day)] = Group()
        return group

    def _consume(self, events, agent_run, path):
        since, until, only = self.since, self.until, self.model
        run = None
        for event in events:
            kind, at, payload = event["kind"], event["at"], event["payload"]
            if (since is not None and at < since) or (until is not None and at > until):
                continue
            if agent_run:
                if run is None:
                    run = self.runs.setdefault(event["run_id"], _new_run(event["run_id"], str(path), at))
                _run_event(run, kind, payload)
            if kind == "model_call":
                call, malformed = model_call_view(payload)
                if only is not None and call["request_model"] != only:
                    continue
                self._group(call["request_model"], call["base_url"], at[:10]).add(call, malformed)
            elif kind == "models_list":
                ids = payload.get("model_ids")
                base = payload.get("base_url")
                if type(ids) is list and type(base) is str and all(type(i) is str for i in ids):
                    key = (base, at[:10])
                    previous = self.listings.get(key)
                    if (previous is None or previous[0] <= at) and (key in self.listings
                                                                     or len(self.listings) < 100000):
                        self.listings[key] = (at, ids[:10000])

    # -- results ---------------------------------------------------------
    def model_rows(self, by_day=False):
        if by_day:
            return [g.row(m, b, d) for (m, b, d), g in sorted(self.groups.items(), key=_group_sort)]
        merged = {}
        for (model, base, _day), group in self.groups.items():
            merged.setdefault((model, base), Group()).merge(group)
        return [g.row(m, b, None) for (m, b), g in sorted(merged.items(), key=lambda kv: (str(kv[0][0]),
                                                                                           str(kv[0][1])))]

    def changes(self, latency_shift=DEFAULT_LATENCY_SHIFT, rate_jump=DEFAULT_RATE_JUMP,
                latency_floor=DEFAULT_LATENCY_FLOOR_MS):
        by_model = {}
        for (model, base, day), group in self.groups.items():
            by_model.setdefault((model, base), []).append((day, group))
        found = []
        for (model, base), days in sorted(by_model.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
            days.sort(key=lambda item: item[0])
            for (prev_day, prev), (day, cur) in zip(days, days[1:]):
                for what, detail in compare_days(prev, cur, latency_shift, rate_jump, latency_floor):
                    found.append({"request_model": model, "base_url": base, "day": day, "previous_day": prev_day,
                                  "what": what, "detail": detail})
        by_base = {}
        for (base, day), (_at, ids) in self.listings.items():
            by_base.setdefault(base, []).append((day, ids))
        for base, days in sorted(by_base.items(), key=lambda kv: str(kv[0])):
            days.sort()
            for (prev_day, prev_ids), (day, ids) in zip(days, days[1:]):
                gained, lost = sorted(set(ids) - set(prev_ids)), sorted(set(prev_ids) - set(ids))
                if gained or lost:
                    parts = ([f"gained {', '.join(gained)}"] if gained else []) + (
                        [f"lost {', '.join(lost)}"] if lost else [])
                    found.append({"request_model": None, "base_url": base, "day": day, "previous_day": prev_day,
                                  "what": "models_list", "detail": "; ".join(parts)})
        return found

    def run_rows(self):
        rows = []
        for _, run in sorted(self.runs.items()):
            row = {k: run[k] for k in RUN_COLUMNS}
            if not run["usage_calls"]:
                row["input_tokens"] = row["output_tokens"] = None
            rows.append(row)
        return rows


def _group_sort(item):
    (model, base, day), _ = item
    return (str(model), str(base), day)


def _new_run(run_id, path, at):
    return {"run_id": run_id, "path": path, "started": at, "outcome": "open", "judge_verdict": None, "steps": 0,
            "tools_allowed": 0, "tools_denied": 0, "model_calls": 0, "input_tokens": 0, "output_tokens": 0,
            "usage_calls": 0, "est_tokens": 0, "errors": 0}


def _run_event(run, kind, payload):
    """Fold one event of an agent run (agent.py's vocabulary) into its summary row."""
    if kind == "model_call":
        call, _malformed = model_call_view(payload)
        run["model_calls"] += 1
        if call["input_tokens"] is not None or call["output_tokens"] is not None:
            run["usage_calls"] += 1
            run["input_tokens"] += call["input_tokens"] or 0
            run["output_tokens"] += call["output_tokens"] or 0
        run["est_tokens"] += (call["est_input_tokens"] or 0) + (call["est_output_tokens"] or 0)
        run["errors"] += call["error_type"] is not None
    elif kind in ("model_proposed", "proposal_malformed"):
        step = payload.get("step")
        run["steps"] = max(run["steps"], step if type(step) is int else run["steps"] + 1)
    elif kind == "tool_allowed":
        run["tools_allowed"] += 1
    elif kind == "tool_denied":
        run["tools_denied"] += 1
    elif kind == "judge_verdict":
        verdict = payload.get("verdict")
        run["judge_verdict"] = verdict if type(verdict) is str else None
    elif kind == "error":
        run["errors"] += 1
    elif kind == "run_closed":
        outcome = payload.get("outcome")
        run["outcome"] = outcome if type(outcome) is str else "closed"


def _usage_state(group):
    if not group.ok:
        return None
    if group.no_usage == 0:
        return "always"
    return "never" if group.no_usage == group.ok else "sometimes"


def compare_days(prev, cur, latency_shift=DEFAULT_LATENCY_SHIFT, rate_jump=DEFAULT_RATE_JUMP,
                 latency_floor=DEFAULT_LATENCY_FLOOR_MS):
    """What differs from one day (a Group) to the next for one model string: yields (what, detail)."""
    for what, before, after in (("response_model", prev.response_models, cur.response_models),
                                ("system_fingerprint", prev.fingerprints, cur.fingerprints)):
        new = sorted(set(after) - set(before), key=str)
        gone = sorted(set(before) - set(after), key=str)
        if new or gone:
            parts = ([f"new {', '.join(map(str, new))}"] if new else []) + (
                [f"gone {', '.join(map(str, gone))}"] if gone else [])
            yield what, "; ".join(parts)
    if len(prev.latencies) >= MIN_LATENCY_SAMPLES and len(cur.latencies) >= MIN_LATENCY_SAMPLES:
        a, b = sorted(prev.latencies), sorted(cur.latencies)
        for name, q in (("p50", 50), ("p95", 95)):
            old, new = percentile(a, q), percentile(b, q)
            if old and abs(new - old) / old > latency_shift and abs(new - old) >= latency_floor:
                yield f"latency_{name}", f"{_fmt_ms(old)} -> {_fmt_ms(new)} ms ({(new - old) / old:+.0%})"
    before, after = _usage_state(prev), _usage_state(cur)
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


# ----------------------------------------------------------------------------
# Reports: text, JSON, CSV
# ----------------------------------------------------------------------------

def _table(headers, rows, text_columns):
    """Aligned columns: the named text columns to the left, numbers to the right. Cells are made
    printable here, so a value from a ledger can neither forge a line nor drive the terminal."""
    rows = [[rl.printable(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = []
    for row in [headers] + rows:
        cells = [cell.ljust(w) if h in text_columns else cell.rjust(w) for cell, w, h in zip(row, widths, headers)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _label(value):
    return "-" if value is None else str(value)


def render_text(audit, rows, changes, runs, verified, by_day):
    out = []
    calls = sum(r["calls"] for r in rows)
    ok = sum(r["ok"] for r in rows)
    no_usage = sum(r["no_usage"] for r in rows)
    malformed = sum(r["malformed"] for r in rows)
    files = len(audit.ledgers)
    mark = "verified" if verified else "UNVERIFIED (--no-verify): the chain was not checked"
    out.append(f"audit: {files} ledger{'s' if files != 1 else ''}, {calls:,} model calls, {mark}")
    for ledger in audit.ledgers:
        if ledger["status"] == "torn":
            out.append(f"warning: {rl.printable(ledger['reason'])}")
        if ledger.get("skipped"):
            out.append(f"warning: {rl.printable(ledger['path'])}: {ledger['skipped']:,} lines are not ledger "
                       f"events and were skipped")
    if audit.folded:
        out.append(f"warning: more than {MAX_MODEL_STRINGS:,} model strings; {audit.folded:,} calls are counted "
                   f"under {OTHER}")
    out.append("")
    out.append("Models" + (" by day" if by_day else "") + " (request_model @ base_url)")
    headers = ["model", "base_url"] + (["day"] if by_day else []) + [
        "calls", "ok", "failed", "no_usage", "passed/checked", "in_tok", "out_tok", "est_in~", "est_out~",
        "latency_ms min/p50/p95/max", "retries", "served"]
    body = []
    for r in rows:
        latency = "/".join(_fmt_ms(r[k]) for k in ("latency_min_ms", "latency_p50_ms", "latency_p95_ms",
                                                    "latency_max_ms"))
        body.append([_label(r["request_model"]), _label(r["base_url"])] + ([r["day"]] if by_day else []) + [
            _fmt_int(r["calls"]), _fmt_int(r["ok"]), _fmt_int(r["failed"]), _fmt_int(r["no_usage"]),
            f"{r['passed']:,}/{r['checked']:,}" if r["checked"] else "-",
            _fmt_int(r["input_tokens"]), _fmt_int(r["output_tokens"]),
            _fmt_int(r["est_input_tokens"]), _fmt_int(r["est_output_tokens"]),
            latency if r["latency_min_ms"] is not None else "-", _fmt_int(r["retries"]),
            _top(r["response_models"]) or "-"])
    out += _table(headers, body, {"model", "base_url", "day", "served"}) if body else ["(no model calls)"]
    measured = sum(r["usage_calls"] for r in rows)
    share = f"{measured / ok:.0%}" if ok else "-"
    out.append(f"usage: {no_usage:,} of {ok:,} ok calls lacked usage; in_tok/out_tok are what servers reported "
               f"and cover {measured:,} calls ({share}). est_in~/est_out~ are chars/4 estimates, never added in.")
    if malformed:
        out.append(f"malformed: {malformed:,} model_call payloads had fields of the wrong type (written by another "
                   f"tool?); those fields were not counted")
    errors = {}
    for r in rows:
        for name, count in r["errors"].items():
            errors[name] = errors.get(name, 0) + count
    if errors:
        out.append("errors: " + rl.printable(", ".join(f"{name} {count:,}" for name, count in sorted(errors.items()))))
    out.append("")
    out.append(f"Changes (day over day): {len(changes)}")
    for change in changes:
        who = change["request_model"] if change["request_model"] is not None else "(models list)"
        out.append(rl.printable(f"  {change['day']}  {who} @ {_label(change['base_url'])}: {change['what']}: "
                                f"{change['detail']}  (vs {change['previous_day']})"))
    if runs:
        out.append("")
        out.append(f"Agent runs: {len(runs)}")
        headers = ["run", "outcome", "verdict", "steps", "tools_ok", "tools_denied", "model_calls", "in_tok",
                   "out_tok", "est_tok~"]
        body = [[r["run_id"], _label(r["outcome"]), _label(r["judge_verdict"]), _fmt_int(r["steps"]),
                 _fmt_int(r["tools_allowed"]), _fmt_int(r["tools_denied"]), _fmt_int(r["model_calls"]),
                 _fmt_int(r["input_tokens"]), _fmt_int(r["output_tokens"]), _fmt_int(r["est_tokens"])]
                for r in runs]
        out += _table(headers, body, {"run", "outcome", "verdict"})
    return "\n".join(out) + "\n"


def render_json(audit, rows, changes, runs, verified, by_day):
    calls = sum(r["calls"] for r in rows)
    return json.dumps({
        "version": 2, "verified": verified, "by": "day" if by_day else "model",
        "ledgers": audit.ledgers,
        "summary": {"model_calls": calls, "ok": sum(r["ok"] for r in rows),
                    "no_usage": sum(r["no_usage"] for r in rows), "malformed": sum(r["malformed"] for r in rows),
                    "folded_calls": audit.folded, "changes": len(changes), "agent_runs": len(runs)},
        "models": rows, "changes": changes, "agent_runs": runs,
    }, ensure_ascii=False, indent=1) + "\n"


_CSV_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value):
    """A CSV cell. Text that a spreadsheet would run as a formula gets a leading ' (OWASP's advice);
    numbers stay numbers, and null is an empty cell."""
    if value is None:
        return ""
    if type(value) in (int, float):
        return value
    text = json.dumps(value, ensure_ascii=False, sort_keys=True) if isinstance(value, dict) else str(value)
    return "'" + text if text.startswith(_CSV_TRIGGERS) else text


def render_csv(rows, stream):
    writer = csv.writer(stream, lineterminator="\r\n")  # RFC 4180; a CR or LF in a value is then quoted
    writer.writerow(MODEL_COLUMNS)
    for r in rows:
        writer.writerow([_csv_cell(r[c]) for c in MODEL_COLUMNS])


# ----------------------------------------------------------------------------
# Reports: HTML
# ----------------------------------------------------------------------------

def _svg_bars(title, labels, values, css_class, width=560, height=180, unit=""):
    esc = html.escape
    top = max(values) if values and max(values) > 0 else 1
    n = max(1, len(values))
    bar = (width - 60) / n
    parts = [f'<svg class="{css_class}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 40}" '
             f'viewBox="0 0 {width} {height + 40}" role="img"><title>{esc(title)}</title>',
             f'<line x1="50" y1="{height}" x2="{width - 5}" y2="{height}" stroke="#888"/>',
             f'<text x="5" y="12" font-size="10">{esc(_fmt_int(top) if isinstance(top, int) else f"{top:.0f}")}'
             f'{esc(unit)}</text>']
    for i, (label, value) in enumerate(zip(labels, values)):
        h = (value / top) * (height - 20) if top else 0
        x = 50 + i * bar
        parts.append(f'<rect x="{x + 1:.1f}" y="{height - h:.1f}" width="{max(bar - 2, 1):.1f}" height="{h:.1f}" '
                     f'fill="#4a7bd0"><title>{esc(str(label))}: {esc(str(value))}</title></rect>')
        if n <= 16 or i % max(1, n // 8) == 0:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{height + 14}" font-size="9" text-anchor="middle">'
                         f'{esc(str(label))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _latency_histogram(model, latencies, bins=24):
    """Log-scale bins, so a cold-start hump stands apart from the warm one."""
    if not latencies:
        return f'<svg class="latency-histogram" data-model="{html.escape(model)}" width="1" height="1"></svg>'
    low, high = max(min(latencies), 1.0), max(max(latencies), 1.0)
    if high <= low:
        high = low * 1.01
    span = math.log10(high) - math.log10(low)
    counts = [0] * bins
    for value in latencies:
        i = int((math.log10(max(value, 1.0)) - math.log10(low)) / span * bins)
        counts[min(max(i, 0), bins - 1)] += 1
    labels = [f"{10 ** (math.log10(low) + span * (i + 0.5) / bins):.0f}ms" for i in range(bins)]
    svg = _svg_bars(f"latency of {model} (ms, log scale)", labels, counts, "latency-histogram")
    return svg.replace('class="latency-histogram"', f'class="latency-histogram" data-model="{html.escape(model)}"',
                       1)


def render_html(audit, rows, changes, runs, verified, by_day):
    esc = html.escape
    totals = {}
    for (model, base, _day), group in audit.groups.items():
        totals.setdefault(f"{model} @ {_label(base)}", []).extend(group.latencies)
    per_day = {}
    for (_model, _base, day), group in audit.groups.items():
        calls, reported, estimated = per_day.get(day, (0, 0, 0))
        per_day[day] = (calls + group.calls, reported + group.input_tokens + group.output_tokens,
                        estimated + group.est_input_tokens + group.est_output_tokens)
    days = sorted(per_day)
    errors = {}
    for group in audit.groups.values():
        for name, count in group.errors.items():
            errors[name] = errors.get(name, 0) + count
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>reasoning-ledger audit</title>",
           "<style>body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
           "table{border-collapse:collapse;font-size:13px;margin:1em 0}"
           "th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#f0f0f0}"
           "td.t{text-align:left}.warn{color:#a40}.chart{display:inline-block;margin:0 1em 1em 0}</style>",
           "</head><body>", "<h1>reasoning-ledger audit</h1>",
           f"<p>{len(audit.ledgers)} ledgers, {sum(r['calls'] for r in rows):,} model calls, "
           + ("verified." if verified else '<strong class="warn">UNVERIFIED</strong> (--no-verify).') + "</p>"]
    out.append("<h2>Models" + (" by day" if by_day else "") + "</h2><table><thead><tr>")
    cols = [c for c in MODEL_COLUMNS if by_day or c != "day"]
    out.append("".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr></thead><tbody>")
    for r in rows:
        cells = []
        for c in cols:
            value = r[c]
            text = _top(value) if isinstance(value, dict) else ("-" if value is None else str(value))
            cells.append(f'<td class="t">{esc(text)}</td>' if c in ("request_model", "base_url", "day",
                                                                     "response_models", "system_fingerprints",
                                                                     "errors") else f"<td>{esc(text)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    no_usage = sum(r["no_usage"] for r in rows)
    out.append(f"<p>{no_usage:,} of {sum(r['ok'] for r in rows):,} ok calls lacked usage. input/output tokens are "
               "reported values; est_* are chars/4 estimates and are never added to them.</p>")
    out.append(f"<h2>Changes ({len(changes)})</h2><ul>")
    for change in changes:
        out.append(f"<li>{esc(change['day'])} <b>{esc(str(change['request_model'] or '(models list)'))}</b> @ "
                   f"{esc(_label(change['base_url']))}: {esc(change['what'])}: {esc(change['detail'])}</li>")
    out.append("</ul><h2>Latency per model</h2>")
    for model, latencies in sorted(totals.items()):
        out.append(f'<div class="chart"><h3>{esc(model)}</h3>{_latency_histogram(model, latencies)}</div>')
    out.append("<h2>Per day</h2>")
    out.append('<div class="chart"><h3>calls</h3>'
               + _svg_bars("calls per day", days, [per_day[d][0] for d in days], "calls-per-day") + "</div>")
    out.append('<div class="chart"><h3>tokens reported</h3>'
               + _svg_bars("reported tokens per day", days, [per_day[d][1] for d in days], "tokens-per-day")
               + "</div>")
    out.append('<div class="chart"><h3>tokens estimated (chars/4)</h3>'
               + _svg_bars("estimated tokens per day", days, [per_day[d][2] for d in days], "est-tokens-per-day")
               + "</div>")
    out.append("<h2>Errors</h2>")
    names = sorted(errors)
    out.append(_svg_bars("errors by type", names, [errors[n] for n in names], "errors") if names else "<p>none</p>")
    if runs:
        out.append(f"<h2>Agent runs ({len(runs)})</h2><table><thead><tr>")
        out.append("".join(f"<th>{esc(k)}</th>" for k in RUN_COLUMNS) + "</tr></thead><tbody>")
        for r in runs:
            out.append("<tr>" + "".join(f"<td>{esc(_label(r[k]))}</td>" for k in RUN_COLUMNS) + "</tr>")
        out.append("</tbody></table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def _build_parser():
    p = argparse.ArgumentParser(
        prog="audit.py", description="What each model string did, day by day.",
        epilog=rl.exit_codes_epilog(rl.EXIT_OK, rl.EXIT_FAILED, rl.EXIT_USAGE, rl.EXIT_CHANGED, rl.EXIT_OUTPUT),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATH", help="ledgers, directories or globs "
                                                             "(default: calls.jsonl and runs/*/events.jsonl)")
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("--by", choices=("model", "day"), default="model", help="one row per model, or per model and day")
    p.add_argument("--since", help="date (UTC) or ISO time")
    p.add_argument("--until", help="date (inclusive) or ISO time")
    p.add_argument("--model", help="only this request_model")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="machine-readable output, stable keys")
    out.add_argument("--csv", action="store_true", help="the model table as CSV")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained page with charts")
    p.add_argument("--no-verify", action="store_true", help="audit without checking the chain (marked UNVERIFIED)")
    p.add_argument("--fail-on-change", action="store_true", help="exit 4 when the Changes section is not empty")
    p.add_argument("--latency-shift", type=float, default=DEFAULT_LATENCY_SHIFT,
                   help="flag a p50/p95 move larger than this fraction (default 0.5)")
    p.add_argument("--latency-floor", type=float, default=DEFAULT_LATENCY_FLOOR_MS, metavar="MS",
                   help="never flag a latency move smaller than this many ms (default 50)")
    p.add_argument("--rate-jump", type=float, default=DEFAULT_RATE_JUMP,
                   help="flag an error rate rise or pass rate fall of this much (default 0.2)")
    return p


def run_audit(paths, *, verify=True, since=None, until=None, model=None):
    """Audit the given ledgers. Returns (audit, failures): failures lists the IntegrityErrors."""
    audit = Audit(since=since, until=until, model=model)
    failures = []
    for path in find_ledgers(paths):
        try:
            audit.add_file(path, verify=verify)
        except rl.IntegrityError as exc:
            failures.append(exc)
    return audit, failures


def _run(args):
    for name, value in (("--latency-shift", args.latency_shift), ("--rate-jump", args.rate_jump)):
        if not (math.isfinite(value) and value > 0):
            raise AuditError(f"{name} must be a positive number")
    if not (math.isfinite(args.latency_floor) and args.latency_floor >= 0):
        raise AuditError("--latency-floor must be a number of at least 0")
    since = rl.parse_time(args.since) if args.since else None
    until = rl.parse_time(args.until, end=True) if args.until else None
    audit, failures = run_audit(args.paths, verify=not args.no_verify, since=since, until=until, model=args.model)
    if failures:
        for exc in failures:
            rl.write_out(f"FAIL  {rl.printable(exc)}\n")
        rl.error(f"{len(failures)} ledger(s) failed verification; nothing was audited "
                 f"(--no-verify audits anyway, marked UNVERIFIED): {failures[0]}")
        return rl.EXIT_FAILED
    if not audit.ledgers:
        rl.warn("no ledgers found (looked for ./calls.jsonl and ./runs/*/events.jsonl)")
    by_day = args.by == "day"
    rows = audit.model_rows(by_day)
    changes = audit.changes(args.latency_shift, args.rate_jump, args.latency_floor)
    runs = audit.run_rows()
    verified = not args.no_verify
    if args.html:
        Path(args.html).write_text(render_html(audit, rows, changes, runs, verified, by_day), encoding="utf-8")
    if args.json:
        rl.write_out(render_json(audit, rows, changes, runs, verified, by_day))
    elif args.csv:
        render_csv(rows, _OutStream())
    else:
        rl.write_out(render_text(audit, rows, changes, runs, verified, by_day))
    if args.fail_on_change and changes:
        rl.error(f"{len(changes)} change(s) found")
        return rl.EXIT_CHANGED
    return rl.EXIT_OK


class _OutStream:
    """A file-like object over write_out, for csv.writer."""

    def write(self, text):
        rl.write_out(text)


def main(argv=None):
    args, code = rl.parse_cli(_build_parser(), argv)
    if args is None:
        return code
    return rl.run_cli(_run, args)


if __name__ == "__main__":
    sys.exit(main())
