"""audit.py --html: the page a person looks at. Ledgers are written by the real writer, the page by
`python audit.py ... --html`, and the page is read back with html.parser, as a browser would see it."""

import re

import ask
import audit as audit_module
import reasoning_ledger as rl
from conftest import HTML_VOID, Node, Tree, clock_for, run_script  # noqa: F401
from conftest import parse_html as parse

BASE = "http://models.test/v1"
DAYS = ("2026-11-01", "2026-11-02", "2026-11-03")
ALLOWED_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "nav", "a", "div", "ul",
                "li", "span", "strong", "table", "thead", "tbody", "tr", "th", "td", "figure", "figcaption", "wbr",
                "details", "summary", "svg", "g", "line", "polyline", "circle", "rect", "text"}
XSS = ("<script>alert(1)</script>", '" onload="x', "'><img src=http://evil.test/x.png>",
       "</title></svg><svg onload=alert(2)>")


# ----------------------------------------------------------------------------
# Helpers: ledgers shaped like ask.py's records, and the page as a tree
# ----------------------------------------------------------------------------

def call(model, base=BASE, error=None, latency=120.0, usage=(10, 5), est=(12, 6), served=None, fingerprint=None,
         check=None):
    """One model_call payload with ask.py's fields (the ones that do not apply are None, as ask writes them)."""
    record = dict.fromkeys(ask.MODEL_CALL_FIELDS)
    record.update(request_model=model, base_url=base, attempt=1, error_type=error, est_input_tokens=est[0],
                  est_method="chars/4", usage_reported=False, usage_status="absent", latency_ms=latency)
    if error is None:
        record.update(response_model=served or model, system_fingerprint=fingerprint, est_output_tokens=est[1],
                      check=check)
        if usage is not None:
            record.update(usage_reported=True, usage_status="complete", input_tokens=usage[0],
                          output_tokens=usage[1])
    return record


def write(path, days_and_calls, run_id="hist", fsync=True):
    """days_and_calls: [(day, [payload, ...]), ...], appended through the real writer with `at` on that day."""
    with rl.Ledger(path, run_id, key=b"", fsync=fsync) as ledger:
        for day, payloads in days_and_calls:
            ledger.clock = clock_for(day)
            for payload in payloads:
                ledger.append("model_call", payload)


def agent_run(runs, outcome, verdict, model="m-a", day=DAYS[-1]):
    run = rl.open_run(runs, key=b"", fsync=False)
    run.ledger.clock = clock_for(day)
    run.append("model_call", call(model))
    run.append("model_proposed", {"step": 1, "tool": "run_tests", "args": {}})
    run.append("tool_allowed", {"step": 1, "tool": "run_tests", "args": {}, "rule": "builtin.enabled"})
    run.append("tool_denied", {"step": 2, "tool": "read_file", "args": {}, "rule": "path.escape", "reason": "no"})
    run.append("judge_verdict", {"verdict": verdict})
    run.close(outcome)
    return run


def render(tmp_path, *args, name="report.html"):
    page = tmp_path / name
    proc = run_script("audit.py", *args, "--html", page)
    assert proc.returncode == 0, proc.err
    text = page.read_text(encoding="utf-8")
    return text, parse(text)


def table_cells(table):
    """{data-field: [cell text per row]} of one table."""
    fields = [th.attrs["data-field"] for th in table.find("th")]
    rows = [[td.text() for td in tr.find("td")] for tr in table.find("tbody")[0].find("tr")]
    return {field: [row[i] for row in rows] for i, field in enumerate(fields)}


def realistic(tmp_path):
    """Three days, two models (m-b drops on day 2 and fails), one more that stops after day 1."""
    ledger = tmp_path / "calls.jsonl"
    write(ledger, [
        (DAYS[0], [call("m-a")] * 4 + [call("m-b", latency=900.0)] * 3 + [call("m-c", usage=None)] * 2
         + [call("m-a", error="timeout")]),
        (DAYS[1], [call("m-a")] * 4 + [call("m-b", latency=950.0, served="m-b-q4")]
         + [call("m-b", error="server_error"), call("m-b", error="rate_limited"), call("m-b", error="server_error")]),
        (DAYS[2], [call("m-a", latency=9000.0)] * 5 + [call("m-b")] * 3),
    ])
    return ledger


# ----------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------

def test_page_is_well_formed_and_fetches_nothing(tmp_path):
    ledger = realistic(tmp_path)
    agent_run(tmp_path / "runs", "proposal_written", "accept")
    for flags in ([], ["--by", "day"]):
        text, root = render(tmp_path, ledger, tmp_path / "runs", *flags)
        tags = {n.tag for n in root.walk()} - {"#root"}
        assert tags <= ALLOWED_TAGS, tags - ALLOWED_TAGS
        for node in root.walk():
            for name, value in node.attrs.items():
                assert not name.startswith("on"), (node.tag, name)
                if name in ("src", "href", "xlink:href"):  # a run's link is relative: nothing is fetched
                    assert re.match(r"#|runs/[0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[0-9a-f]{8}\Z", value or ""), (node.tag, name, value)
        style = root.find("style")[0].text()
        assert "url(" not in style and "@import" not in style and "@font-face" not in style
        assert text.count('class="calls-per-day"') == 1


def test_per_day_series_per_model_with_a_legend(tmp_path):
    _text, root = render(tmp_path, realistic(tmp_path))
    names = [f"m-{x} @ {BASE}" for x in "abc"]
    legend = root.find("ul", data_legend="models")
    assert [li.attrs["data-model"] for li in legend[0].find("li")] == names  # busiest first
    for chart in ("calls-per-day", "error-rate-per-day", "tokens-per-day", "est-tokens-per-day"):
        (svg,) = root.find("svg", cls=chart)
        assert [g.attrs["data-series"] for g in svg.find("g", cls="series")] == names, chart
        assert "day" in svg.text() and svg.own_title()
    points = {c.own_title() for c in root.find("svg", cls="calls-per-day")[0].find("circle")}
    # a drop for one model is its own point, not hidden in a total
    assert f"m-b @ {BASE} \u00b7 {DAYS[0]}: 3 calls" in points
    assert f"m-b @ {BASE} \u00b7 {DAYS[1]}: 4 calls" in points
    assert f"m-a @ {BASE} \u00b7 {DAYS[1]}: 4 calls" in points
    assert f"m-c @ {BASE} \u00b7 {DAYS[2]}: 0 calls" in points  # it stopped: 0 calls, a fact


def test_reported_and_estimated_tokens_are_separate_and_gaps_are_not_zero(tmp_path):
    _text, root = render(tmp_path, realistic(tmp_path))
    reported = {c.own_title() for c in root.find("svg", cls="tokens-per-day")[0].find("circle")}
    estimated = {c.own_title() for c in root.find("svg", cls="est-tokens-per-day")[0].find("circle")}
    assert f"m-a @ {BASE} \u00b7 {DAYS[0]}: 60 tokens" in reported    # 4 x (10 + 5); the timeout reported none
    assert f"m-a @ {BASE} \u00b7 {DAYS[0]}: 84 tokens" in estimated   # 4 x (12 + 6) + 12 for the timeout
    assert not any(t.startswith(f"m-c @ {BASE}") for t in reported)  # never reported usage: a gap, not 0
    m_c = root.find("svg", cls="est-tokens-per-day")[0].find("g", data_series=f"m-c @ {BASE}")[0]
    assert {c.own_title() for c in m_c.find("circle")} == {f"m-c @ {BASE} \u00b7 {DAYS[0]}: 36 tokens"}


def test_errors_chart_has_a_group_per_day_with_each_error_type(tmp_path):
    _text, root = render(tmp_path, realistic(tmp_path))
    (svg,) = root.find("svg", cls="errors-per-day")
    seen = {g.attrs["data-day"]: sorted(r.attrs["data-error-type"] for r in g.find("rect"))
            for g in svg.find("g", cls="day")}
    assert seen == {DAYS[0]: ["timeout"], DAYS[1]: ["rate_limited", "server_error"], DAYS[2]: []}
    heights = {r.own_title(): float(r.attrs["height"]) for r in svg.find("rect")}
    assert abs(heights[f"{DAYS[1]}: server_error \u00d7 2"] - 2 * heights[f"{DAYS[1]}: rate_limited \u00d7 1"]) < 0.5
    legend = root.find("ul", data_legend="error-types")[0]
    assert sorted(li.attrs["data-error-type"] for li in legend.find("li")) == ["rate_limited", "server_error",
                                                                                "timeout"]
    assert "failed calls" in svg.text() and "day (UTC" in svg.text()


def test_one_latency_histogram_per_model_with_axes_in_ms(tmp_path):
    _text, root = render(tmp_path, realistic(tmp_path))
    charts = root.find("svg", cls="latency-histogram")
    assert [c.attrs["data-model"] for c in charts] == [f"m-{x} @ {BASE}" for x in "abc"]
    m_a = charts[0]
    assert "latency (ms, log scale)" in m_a.text() and "ok calls" in m_a.text()
    bars = m_a.find("rect")
    assert len(bars) == 2 and sorted(b.own_title().split(": ")[1] for b in bars) == ["5 calls", "8 calls"]


def test_headings_are_for_people_and_keep_the_field_name(tmp_path):
    ledger = realistic(tmp_path)
    agent_run(tmp_path / "runs", "budget_exhausted", "reject")
    _text, root = render(tmp_path, ledger, tmp_path / "runs")
    (models,) = root.find("table", cls="models")
    heads = {th.attrs["data-field"]: th for th in models.find("th")}
    assert list(heads) == [c for c in audit_module._HTML_MODEL_COLUMNS if c != "day"]
    for field, th in heads.items():
        assert th.attrs["title"] == field and th.text() != field and "_" not in th.text(), field
    assert heads["calls"].text() == "Calls" and heads["failed"].text() == "Failed"
    assert heads["no_usage"].text() == "No usage"
    # short headings (the note and each title say the rest): numbers keep their columns narrow
    assert heads["input_tokens"].text() == "In tokens" and heads["est_input_tokens"].text() == "In tokens~"
    assert heads["latency_p50_ms"].text() == "p50 ms"
    (runs,) = root.find("table", cls="runs")
    assert [th.attrs["data-field"] for th in runs.find("th")] == list(audit_module._HTML_RUN_COLUMNS)
    assert all("_" not in th.text() for th in runs.find("th"))
    cells = table_cells(runs)
    assert cells["outcome"] == ["budget_exhausted"] and cells["judge_verdict"] == ["reject"]
    assert cells["tools_denied"] == ["1"] and cells["model_calls"] == ["1"]
    (changes,) = root.find("table", cls="changes")
    assert [th.attrs["data-field"] for th in changes.find("th")] == ["day", "request_model", "base_url", "what",
                                                                     "detail", "previous_day"]
    what = table_cells(changes)["what"]
    assert "Served model" in what and "response_model" not in what
    rows = table_cells(models)
    assert rows["request_model"] == ["m-a", "m-b", "m-c"]  # busiest first
    assert rows["calls"] == ["15", "10", "2"] and rows["failed"] == ["1", "3", "0"]  # 15: the agent run's call too


def test_nulls_are_dashes_never_zero_or_none(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    write(ledger, [(DAYS[0], [call("quiet", usage=None), call("broken", error="timeout", latency=None)])])
    text, root = render(tmp_path, ledger)
    rows = table_cells(root.find("table", cls="models")[0])
    i = rows["request_model"].index("quiet")
    j = rows["request_model"].index("broken")
    for field in ("input_tokens", "output_tokens", "passed"):
        assert rows[field][i] in ("\u2013", "-"), (field, rows[field][i])
    for field in ("latency_p50_ms", "latency_max_ms", "est_output_tokens", "response_models"):
        assert rows[field][j] in ("\u2013", "-"), (field, rows[field][j])
    assert rows["est_input_tokens"][i] == "12" and rows["checked"][i] == "0"  # a real 0 stays 0
    assert "None" not in root.text() and "None" not in text
    cards = {c.find("div", cls="k")[0].text(): c.find("div", cls="v")[0].text() for c in root.find("div", cls="card")}
    assert cards["Tokens reported"] in ("\u2013", "-")


def test_every_value_from_a_ledger_is_escaped(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    days = []
    for n, day in enumerate(DAYS[:2]):
        payloads = []
        for i, evil in enumerate(XSS):
            other = XSS[(i + 1) % len(XSS)]
            payloads += [call(evil, base=other, served=other + day, fingerprint=evil + day, latency=100.0 + n),
                         call(evil, base=other, error=XSS[(i + n) % len(XSS)])]
        days.append((day, payloads))
    write(ledger, days)
    runs = tmp_path / "runs"
    agent_run(runs, XSS[1], XSS[0], model=XSS[2])
    text, root = render(tmp_path, ledger, runs)
    assert "<script" not in text and "<img" not in text and "onload=\"" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert {n.tag for n in root.walk()} - {"#root"} <= ALLOWED_TAGS
    assert not [(n.tag, k) for n in root.walk() for k in n.attrs if k.startswith("on")]
    labels = {f"{evil} @ {XSS[(i + 1) % len(XSS)]}" for i, evil in enumerate(XSS)} | {f"{XSS[2]} @ {BASE}"}
    assert {c.attrs["data-model"] for c in root.find("svg", cls="latency-histogram")} == labels
    assert {g.attrs["data-series"] for g in root.find("svg", cls="calls-per-day")[0].find("g", cls="series")} == labels
    svg_texts = " ".join(t.text() for t in root.find("title")) + " ".join(t.text() for t in root.find("text"))
    for evil in XSS:
        assert evil in svg_texts  # shown as text, in the charts' titles and labels
    assert {r.attrs["data-error-type"] for r in root.find("svg", cls="errors-per-day")[0].find("rect")} == set(XSS)
    cells = table_cells(root.find("table", cls="runs")[0])
    assert cells["outcome"] == [XSS[1]] and cells["judge_verdict"] == [XSS[0]]
    changes = table_cells(root.find("table", cls="changes")[0])
    assert any(XSS[1] + DAYS[1] in detail for detail in changes["detail"])


def test_a_model_keeps_its_colour_in_every_chart(tmp_path):
    _text, root = render(tmp_path, realistic(tmp_path))
    legend = root.find("ul", data_legend="models")[0]
    colours = {li.attrs["data-model"]: re.search(r"background:(#[0-9A-Fa-f]{6})", li.find("span")[0].attrs["style"])
               .group(1) for li in legend.find("li")}
    assert len(set(colours.values())) == 3
    for chart in ("calls-per-day", "error-rate-per-day", "tokens-per-day", "est-tokens-per-day"):
        for g in root.find("svg", cls=chart)[0].find("g", cls="series"):
            strokes = {p.attrs["stroke"] for p in g.find("polyline")} | {c.attrs["fill"] for c in g.find("circle")}
            assert strokes <= {colours[g.attrs["data-series"]]}, (chart, g.attrs["data-series"])
            assert strokes or chart == "tokens-per-day"  # m-c never reported usage: no line at all
    for svg in root.find("svg", cls="latency-histogram"):
        assert {r.attrs["fill"] for r in svg.find("rect")} == {colours[svg.attrs["data-model"]]}


def test_thousands_of_model_strings_give_a_bounded_page(tmp_path):
    ledger = tmp_path / "calls.jsonl"
    n = 2000
    write(ledger, [(day, [call(f"model-{i}", latency=10.0 + i, error=None if i % 7 else "timeout",
                               served=f"served-{i}") for i in range(n)]) for day in DAYS[:2]], fsync=False)
    for flags in ([], ["--by", "day"]):
        text, root = render(tmp_path, ledger, *flags)
        assert len(text.encode("utf-8")) < 1_000_000, len(text)
        assert len(root.find("svg", cls="latency-histogram")) == audit_module.MAX_CHART_MODELS
        for chart in ("calls-per-day", "tokens-per-day"):
            series = root.find("svg", cls=chart)[0].find("g", cls="series")
            assert len(series) == audit_module.MAX_CHART_MODELS + 1
            assert "other model strings" in series[-1].attrs["data-series"]
        legend = root.find("ul", data_legend="models")[0].find("li")
        assert len(legend) == audit_module.MAX_CHART_MODELS + 1
        assert re.search(r"\d[\d,]*\+? other model strings \([\d,]+ calls\)", legend[-1].text())
        assert len(root.find("table", cls="models")[0].find("tbody")[0].find("tr")) <= 500
        assert "counted under (other)" in root.text()
