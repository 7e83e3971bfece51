#!/usr/bin/env python3
"""audit.py -- what each model string did, day by day, from verified ledgers only. Stdlib only.

Usage:
  python audit.py                          # ./runs.jsonl and ./runs/*/events.jsonl
  python audit.py runs.jsonl runs/ --by day
  python audit.py --since 2026-11-01 --model my-model --fail-on-change   # exit 4 when something changed
  python audit.py --json > audit.json      # or --csv; --html report.html for a page with charts
  python audit.py --no-verify broken.jsonl # audit anyway, marked UNVERIFIED

Exit codes: 0 ok, 1 a ledger failed verification (nothing audited), 2 usage or I/O error,
4 changes found and --fail-on-change given.
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

import reasoning_ledger as rl

__version__ = "1.0.0"

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

EXIT_OK, EXIT_INTEGRITY, EXIT_USAGE, EXIT_CHANGED = 0, 1, 2, 4
DEFAULT_LATENCY_SHIFT = 0.5
DEFAULT_RATE_JUMP = 0.2
MIN_LATENCY_SAMPLES = 3
DEFAULT_LATENCY_FLOOR_MS = 50.0
NO_USAGE_STATUSES = ("absent", "zero", "malformed")

MODEL_COLUMNS = ("request_model", "base_url", "day", "runs", "ok", "failed", "no_usage", "checked", "passed",
                 "input_tokens", "output_tokens", "usage_calls", "est_input_tokens", "est_output_tokens",
                 "latency_min_ms", "latency_p50_ms", "latency_p95_ms", "latency_max_ms", "retries",
                 "response_models", "system_fingerprints", "errors")


class AuditError(Exception):
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


def _fmt_int(value):
    return "-" if value is None else f"{value:,}"


def _fmt_ms(value):
    if value is None:
        return "-"
    return f"{value / 1000:.1f}s" if value >= 10000 else f"{value:.0f}"


def _top(counter):
    return ",".join(f"{name}" for name, _ in sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def find_ledgers(paths):
    """Expand PATHs (files, directories, globs) into ledger files; default: ./runs.jsonl + ./runs/."""
    if not paths:
        found = [Path("runs.jsonl")] if Path("runs.jsonl").is_file() else []
        if Path("runs").is_dir():
            found += sorted(Path("runs").glob("*/" + rl.EVENTS_NAME))
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

    __slots__ = ("runs", "ok", "no_usage", "checked", "passed", "input_tokens", "output_tokens", "usage_calls",
                 "est_input_tokens", "est_output_tokens", "latencies", "response_models", "fingerprints",
                 "errors", "retries", "usage_reported")

    def __init__(self):
        self.runs = self.ok = self.no_usage = self.checked = self.passed = 0
        self.input_tokens = self.output_tokens = self.usage_calls = 0
        self.est_input_tokens = self.est_output_tokens = self.retries = self.usage_reported = 0
        self.latencies = []
        self.response_models, self.fingerprints, self.errors = {}, {}, {}

    def merge(self, other):
        for name in ("runs", "ok", "no_usage", "checked", "passed", "input_tokens", "output_tokens",
                     "usage_calls", "est_input_tokens", "est_output_tokens", "retries", "usage_reported"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.latencies.extend(other.latencies)
        for mine, theirs in ((self.response_models, other.response_models),
                             (self.fingerprints, other.fingerprints), (self.errors, other.errors)):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count

    def row(self, request_model, base_url, day):
        lat = sorted(self.latencies)
        return {
            "request_model": request_model, "base_url": base_url, "day": day,
            "runs": self.runs, "ok": self.ok, "failed": self.runs - self.ok, "no_usage": self.no_usage,
            "checked": self.checked, "passed": self.passed,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens, "usage_calls": self.usage_calls,
            "est_input_tokens": self.est_input_tokens, "est_output_tokens": self.est_output_tokens,
            "latency_min_ms": lat[0] if lat else None, "latency_p50_ms": percentile(lat, 50),
            "latency_p95_ms": percentile(lat, 95), "latency_max_ms": lat[-1] if lat else None,
            "retries": self.retries,
            "response_models": dict(sorted(self.response_models.items(), key=lambda kv: str(kv[0]))),
            "system_fingerprints": dict(sorted(self.fingerprints.items(), key=lambda kv: str(kv[0]))),
            "errors": dict(sorted(self.errors.items())),
        }


class Audit:
    """Everything the reports need, gathered in one pass over the events."""

    def __init__(self, since=None, until=None, model=None):
        self.since, self.until, self.model = since, until, model
        self.groups = {}            # (request_model, base_url, day) -> Group
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
        count = 0
        info["status"] = "unverified"
        with open(path, "rb") as handle:
            for raw in handle:
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                if type(event) is dict and type(event.get("payload")) is dict and type(event.get("at")) is str:
                    count += 1
                    info["lines"] = count
                    yield event

    def _consume(self, events, agent_run, path):
        groups, since, until, only = self.groups, self.since, self.until, self.model
        run = None
        for event in events:
            kind = event["kind"]
            at = event["at"]
            if (since is not None and at < since) or (until is not None and at > until):
                continue
            payload = event["payload"]
            if agent_run:
                if run is None:
                    run = self.runs.setdefault(event["run_id"], _new_run(event["run_id"], str(path), at))
                _run_event(run, kind, payload)
            if kind == "model_call":
                request_model = payload.get("request_model")
                if only is not None and request_model != only:
                    continue
                key = (request_model, payload.get("base_url"), at[:10])
                group = groups.get(key)
                if group is None:
                    group = groups[key] = Group()
                group.runs += 1
                if (payload.get("attempt") or 1) > 1:
                    group.retries += 1
                error_type = payload.get("error_type")
                status = payload.get("usage_status")
                measured = payload.get("usage_reported") and status not in NO_USAGE_STATUSES
                if error_type is None:
                    group.ok += 1
                    latency = payload.get("latency_ms")
                    if latency is not None:
                        group.latencies.append(latency)
                    if not measured:
                        group.no_usage += 1
                    else:
                        group.usage_reported += 1
                    served = payload.get("response_model")
                    group.response_models[served] = group.response_models.get(served, 0) + 1
                    fingerprint = payload.get("system_fingerprint")
                    if fingerprint is not None:
                        group.fingerprints[fingerprint] = group.fingerprints.get(fingerprint, 0) + 1
                    check = payload.get("check")
                    if check is not None:
                        group.checked += 1
                        if check is True:
                            group.passed += 1
                else:
                    group.errors[error_type] = group.errors.get(error_type, 0) + 1
                if measured:
                    inp, out = payload.get("input_tokens"), payload.get("output_tokens")
                    if inp is not None or out is not None:
                        group.usage_calls += 1
                        group.input_tokens += inp or 0
                        group.output_tokens += out or 0
                group.est_input_tokens += payload.get("est_input_tokens") or 0
                group.est_output_tokens += payload.get("est_output_tokens") or 0
            elif kind == "models_list" and payload.get("model_ids") is not None:
                key = (payload.get("base_url"), at[:10])
                previous = self.listings.get(key)
                if previous is None or previous[0] <= at:
                    self.listings[key] = (at, list(payload["model_ids"]))

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
                for what, detail in _compare_days(prev, cur, latency_shift, rate_jump, latency_floor):
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
        return [dict(run) for _, run in sorted(self.runs.items())]


def _group_sort(item):
    (model, base, day), _ = item
    return (str(model), str(base), day)


def _new_run(run_id, path, at):
    return {"run_id": run_id, "path": path, "started": at, "outcome": "open", "judge_verdict": None,
            "tool_calls_allowed": 0, "tool_calls_denied": 0, "model_calls": 0, "input_tokens": 0,
            "output_tokens": 0, "est_input_tokens": 0, "est_output_tokens": 0, "decisions": 0, "errors": 0}


def _run_event(run, kind, payload):
    if kind == "model_call":
        run["model_calls"] += 1
        run["input_tokens"] += payload.get("input_tokens") or 0
        run["output_tokens"] += payload.get("output_tokens") or 0
        run["est_input_tokens"] += payload.get("est_input_tokens") or 0
        run["est_output_tokens"] += payload.get("est_output_tokens") or 0
        if payload.get("error_type"):
            run["errors"] += 1
    elif kind == "tool_call":
        run["tool_calls_allowed" if payload.get("allowed") else "tool_calls_denied"] += 1
    elif kind == "decision":
        run["decisions"] += 1
    elif kind == "judge_verdict":
        run["judge_verdict"] = payload.get("verdict")
    elif kind == "run_closed":
        run["outcome"] = payload.get("outcome") or "closed"


def _usage_state(group):
    if not group.ok:
        return None
    if group.no_usage == 0:
        return "always"
    return "never" if group.no_usage == group.ok else "sometimes"


def _compare_days(prev, cur, latency_shift, rate_jump, latency_floor):
    """What differs from one day to the next for one model string."""
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
    if prev.runs and cur.runs:
        old_rate, new_rate = (prev.runs - prev.ok) / prev.runs, (cur.runs - cur.ok) / cur.runs
        if new_rate - old_rate >= rate_jump:
            yield "error_rate", f"{old_rate:.0%} -> {new_rate:.0%} of calls failed"
    if prev.checked and cur.checked:
        old_pass, new_pass = prev.passed / prev.checked, cur.passed / cur.checked
        if old_pass - new_pass >= rate_jump:
            yield "checks", f"{old_pass:.0%} -> {new_pass:.0%} of checks passed"


# ----------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------

def _table(headers, rows, text_columns):
    """Aligned columns: the named text columns to the left, numbers to the right."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = []
    for row in [headers] + rows:
        cells = [cell.ljust(w) if h in text_columns else cell.rjust(w) for cell, w, h in zip(row, widths, headers)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _short_base(base_url):
    if not base_url:
        return "-"
    return base_url


def render_text(audit, rows, changes, runs, verified, by_day):
    out = []
    calls = sum(r["runs"] for r in rows)
    ok = sum(r["ok"] for r in rows)
    no_usage = sum(r["no_usage"] for r in rows)
    files = len(audit.ledgers)
    torn = [l for l in audit.ledgers if l["status"] == "torn"]
    mark = "verified" if verified else "UNVERIFIED (--no-verify): the chain was not checked"
    out.append(f"audit: {files} ledger{'s' if files != 1 else ''}, {calls:,} model calls, {mark}")
    for ledger in torn:
        out.append(f"warning: {ledger['reason']}")
    out.append("")
    out.append("Models" + (" by day" if by_day else "") + " (request_model @ base_url)")
    headers = ["model", "base_url"] + (["day"] if by_day else []) + [
        "runs", "ok", "failed", "no_usage", "passed/checked", "in_tok", "out_tok", "est_in~", "est_out~",
        "latency_ms min/p50/p95/max", "retries", "served"]
    body = []
    for r in rows:
        latency = "/".join(_fmt_ms(r[k]) for k in ("latency_min_ms", "latency_p50_ms", "latency_p95_ms",
                                                    "latency_max_ms"))
        body.append([str(r["request_model"]), _short_base(r["base_url"])] + ([r["day"]] if by_day else []) + [
            _fmt_int(r["runs"]), _fmt_int(r["ok"]), _fmt_int(r["failed"]), _fmt_int(r["no_usage"]),
            f"{r['passed']:,}/{r['checked']:,}" if r["checked"] else "-",
            _fmt_int(r["input_tokens"]) if r["usage_calls"] else "-",
            _fmt_int(r["output_tokens"]) if r["usage_calls"] else "-",
            _fmt_int(r["est_input_tokens"]), _fmt_int(r["est_output_tokens"]),
            latency if r["latency_min_ms"] is not None else "-", _fmt_int(r["retries"]),
            _top(r["response_models"]) or "-"])
    out += _table(headers, body, {"model", "base_url", "day", "served"}) if body else ["(no model calls)"]
    measured = sum(r["usage_calls"] for r in rows)
    share = f"{measured / ok:.0%}" if ok else "-"
    out.append(f"usage: {no_usage:,} of {ok:,} ok calls lacked usage; in_tok/out_tok are what servers reported "
               f"and cover {measured:,} calls ({share}). est_in~/est_out~ are chars/4 estimates, never added in.")
    errors = {}
    for r in rows:
        for name, count in r["errors"].items():
            errors[name] = errors.get(name, 0) + count
    if errors:
        out.append("errors: " + ", ".join(f"{name} {count:,}" for name, count in sorted(errors.items())))
    out.append("")
    out.append(f"Changes (day over day): {len(changes)}")
    for change in changes:
        who = change["request_model"] if change["request_model"] is not None else "(models list)"
        out.append(f"  {change['day']}  {who} @ {_short_base(change['base_url'])}: {change['what']}: "
                   f"{change['detail']}  (vs {change['previous_day']})")
    if runs:
        out.append("")
        out.append(f"Agent runs: {len(runs)}")
        headers = ["run", "outcome", "verdict", "tools_ok", "tools_denied", "model_calls", "in_tok", "out_tok",
                   "est_tok~"]
        body = [[r["run_id"], str(r["outcome"]), str(r["judge_verdict"] or "-"), _fmt_int(r["tool_calls_allowed"]),
                 _fmt_int(r["tool_calls_denied"]), _fmt_int(r["model_calls"]), _fmt_int(r["input_tokens"]),
                 _fmt_int(r["output_tokens"]), _fmt_int(r["est_input_tokens"] + r["est_output_tokens"])]
                for r in runs]
        out += _table(headers, body, {"run", "outcome", "verdict"})
    return "\n".join(out) + "\n"


def render_json(audit, rows, changes, runs, verified, by_day):
    calls = sum(r["runs"] for r in rows)
    return json.dumps({
        "version": 1, "verified": verified, "by": "day" if by_day else "model",
        "ledgers": audit.ledgers,
        "summary": {"model_calls": calls, "ok": sum(r["ok"] for r in rows),
                    "no_usage": sum(r["no_usage"] for r in rows), "changes": len(changes), "agent_runs": len(runs)},
        "models": rows, "changes": changes, "agent_runs": runs,
    }, ensure_ascii=False, indent=1) + "\n"


def render_csv(rows, stream):
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(MODEL_COLUMNS)
    for r in rows:
        writer.writerow([json.dumps(r[c], ensure_ascii=False, sort_keys=True) if isinstance(r[c], dict)
                         else ("" if r[c] is None else r[c]) for c in MODEL_COLUMNS])


# -- HTML --------------------------------------------------------------------

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
        totals.setdefault(f"{model} @ {_short_base(base)}", []).extend(group.latencies)
    per_day = {}
    for (_model, _base, day), group in audit.groups.items():
        calls, reported, estimated = per_day.get(day, (0, 0, 0))
        per_day[day] = (calls + group.runs, reported + group.input_tokens + group.output_tokens,
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
           f"<p>{len(audit.ledgers)} ledgers, {sum(r['runs'] for r in rows):,} model calls, "
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
                   f"{esc(_short_base(change['base_url']))}: {esc(change['what'])}: {esc(change['detail'])}</li>")
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
        keys = ["run_id", "outcome", "judge_verdict", "tool_calls_allowed", "tool_calls_denied", "model_calls",
                "input_tokens", "output_tokens", "est_input_tokens", "est_output_tokens"]
        out.append("".join(f"<th>{esc(k)}</th>" for k in keys) + "</tr></thead><tbody>")
        for r in runs:
            out.append("<tr>" + "".join(f"<td>{esc(str(r[k]))}</td>" for k in keys) + "</tr>")
        out.append("</tbody></table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def _build_parser():
    p = argparse.ArgumentParser(prog="audit.py", description="What each model string did, day by day.")
    p.add_argument("paths", nargs="*", metavar="PATH", help="ledgers, directories or globs "
                                                             "(default: runs.jsonl and runs/*/events.jsonl)")
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


def main(argv=None):
    args, code = rl.parse_cli(_build_parser(), argv)
    if args is None:
        return code
    try:
        if args.latency_shift <= 0 or args.rate_jump <= 0 or args.latency_floor < 0:
            raise AuditError("--latency-shift and --rate-jump must be positive, --latency-floor not negative")
        since = rl.parse_time(args.since) if args.since else None
        until = rl.parse_time(args.until, end=True) if args.until else None
        audit, failures = run_audit(args.paths, verify=not args.no_verify, since=since, until=until,
                                    model=args.model)
    except (AuditError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except rl.KeyRequiredError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"error: {rl.error_text(exc)}", file=sys.stderr)
        return EXIT_USAGE
    if failures:
        for exc in failures:
            print(f"FAIL  {exc}")
        print(f"error: {len(failures)} ledger(s) failed verification; nothing was audited "
              f"(--no-verify audits anyway, marked UNVERIFIED): {failures[0]}", file=sys.stderr)
        return EXIT_INTEGRITY
    if not audit.ledgers:
        print("warning: no ledgers found (looked for ./runs.jsonl and ./runs/*/events.jsonl)", file=sys.stderr)
    by_day = args.by == "day"
    rows = audit.model_rows(by_day)
    changes = audit.changes(args.latency_shift, args.rate_jump, args.latency_floor)
    runs = audit.run_rows()
    verified = not args.no_verify
    try:
        if args.html:
            Path(args.html).write_text(render_html(audit, rows, changes, runs, verified, by_day), encoding="utf-8")
        if args.json:
            sys.stdout.write(render_json(audit, rows, changes, runs, verified, by_day))
        elif args.csv:
            render_csv(rows, sys.stdout)
        else:
            sys.stdout.write(render_text(audit, rows, changes, runs, verified, by_day))
        sys.stdout.flush()
    except BrokenPipeError:
        return EXIT_OK
    except OSError as exc:
        print(f"error: {rl.error_text(exc)}", file=sys.stderr)
        return EXIT_USAGE
    if args.fail_on_change and changes:
        print(f"error: {len(changes)} change(s) found", file=sys.stderr)
        return EXIT_CHANGED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
