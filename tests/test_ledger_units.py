"""reasoning_ledger.py's pure functions, tested directly: printable text, times and heads."""

import datetime

import pytest

import reasoning_ledger as rl

@pytest.mark.parametrize("text,shown", [
    ("plain", "plain"), ("a\nb", "a\\nb"), ("\x1b[31m", "\\x1b[31m"), ("\x9b", "\\x9b"), ("\u2028", "\\u2028"),
    ("tab\t", "tab\\t"), ("你好", "你好"), (5, "5"),
])
def test_printable(text, shown):
    assert rl.printable(text) == shown


def test_parse_time_and_head():
    assert rl.parse_time("2026-11-29") == "2026-11-29T00:00:00.000000Z"
    assert rl.parse_time("2026-11-29", end=True) == "2026-11-29T23:59:59.999999Z"
    assert rl.parse_time("2026-11-29T12:00:00+02:00") == "2026-11-29T10:00:00.000000Z"
    now = datetime.datetime(2026, 11, 30, 3, 0, tzinfo=datetime.timezone.utc)
    assert rl.parse_time("today", now=now) == "2026-11-30T00:00:00.000000Z"
    assert rl.parse_time("yesterday", end=True, now=now) == "2026-11-29T23:59:59.999999Z"
    assert rl.parse_time("7d", now=now) == "2026-11-23T03:00:00.000000Z"
    assert rl.parse_time("36h", now=now) == "2026-11-28T15:00:00.000000Z"
    for bad in ("tomorrow", "7w", "-7d", "123456d", "2026-13-01", "٢٠٢٦-11-29"):
        with pytest.raises(rl.UsageError):
            rl.parse_time(bad)
    assert rl.parse_head("3 " + "A" * 64) == (3, "a" * 64)
    with pytest.raises(rl.UsageError):
        rl.parse_head("٣:" + "a" * 64)


def test_at_must_be_a_real_time():
    assert rl._at_ok("2024-02-29T23:59:59.999999Z")
    for bad in ("2023-02-29T00:00:00.000000Z", "2026-11-29T24:00:00.000000Z", "2026-11-29T12:00:00.00000Z",
                "2026-11-29 12:00:00.000000Z", None, 5):
        assert not rl._at_ok(bad)
