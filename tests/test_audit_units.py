"""audit.py's pure functions, tested directly: percentiles, day comparison, the audit's view of a payload, CSV cells."""

import pytest

import audit

def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert [audit.percentile(values, q) for q in (0, 50, 95, 100)] == [1, 50, 95, 100]
    assert audit.percentile([], 50) is None and audit.percentile([7], 95) == 7


def _group(calls):
    group = audit.Group()
    for call in calls:
        view, malformed = audit.model_call_view(dict({"error_type": None, "usage_reported": True,
                                                      "usage_status": "complete"}, **call))
        group.add(view, malformed)
    return group


def test_compare_days_names_what_changed():
    before = _group([{"response_model": "m", "latency_ms": 100.0, "check": True}] * 4)
    after = _group([{"response_model": "m-q4", "latency_ms": 400.0, "check": False, "usage_status": "absent"}] * 3
                   + [{"error_type": "timeout"}])
    found = dict(audit.compare_days(before, after))
    assert found["response_model"] == "new m-q4; gone m"
    assert found["latency_p50"] == "100 -> 400 ms (+300%)"
    assert found["usage"] == "usage reported always -> never"
    assert found["error_rate"] == "0% -> 25% of calls failed"
    assert found["checks"] == "100% -> 0% of checks passed"
    assert dict(audit.compare_days(before, before)) == {}


def test_compare_days_respects_floor_and_sample_size():
    small = _group([{"latency_ms": 3.0}] * 3)
    large = _group([{"latency_ms": 9.0}] * 3)
    assert "latency_p50" not in dict(audit.compare_days(small, large))  # +200%, but only 6 ms
    assert "latency_p50" in dict(audit.compare_days(small, large, latency_floor=1))
    assert "latency_p50" not in dict(audit.compare_days(_group([{"latency_ms": 3.0}] * 2), large, latency_floor=1))


def test_a_served_model_that_went_missing_is_named_as_a_dash():
    assert dict(audit.compare_days(_group([{"response_model": "m"}]), _group([{}])))["response_model"] == \
        "new -; gone m"


@pytest.mark.parametrize("payload,malformed,field,value", [
    ({"latency_ms": "fast"}, True, "latency_ms", None),
    ({"latency_ms": 12}, False, "latency_ms", 12),
    ({"latency_ms": float("nan")}, True, "latency_ms", None),
    ({"input_tokens": True}, True, "input_tokens", None),
    ({"attempt": 2}, False, "attempt", 2),
    ({"check": 1}, True, "check", None),
    ({}, False, "request_model", None),
])
def test_model_call_view_types_every_field_by_ask_py(payload, malformed, field, value):
    view, got = audit.model_call_view(payload)
    assert got is malformed and view[field] == value


@pytest.mark.parametrize("value,cell", [
    ("=1+1", "'=1+1"), ("+x", "'+x"), ("-x", "'-x"), ("@x", "'@x"), ("\tx", "'\tx"), ("\rx", "'\rx"),
    ("plain", "plain"), (-5, -5), (2.5, 2.5), (None, ""), ({"b": 1, "a": 2}, '{"a": 2, "b": 1}'),
])
def test_csv_cells(value, cell):
    assert audit._csv_cell(value) == cell
