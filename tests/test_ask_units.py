"""ask.py's pure functions, tested directly: usage parsing, checks, waits, URLs, settings, estimates."""

import pytest

import ask

@pytest.mark.parametrize("usage,status,counts", [
    (None, "absent", (None, None, None)),
    ({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "complete", (3, 4, 7)),
    ({"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}, "complete", (3, 4, 7)),
    ({"total_tokens": 7}, "partial", (None, None, 7)),
    ({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}, "zero", (0, 0, 0)),
    ({"prompt_tokens": "3", "completion_tokens": 4.0, "total_tokens": True}, "malformed", (None, None, None)),
    ({"prompt_tokens": -1, "completion_tokens": 2 ** 70, "total_tokens": None}, "malformed", (None, None, None)),
    ([1, 2], "malformed", (None, None, None)),
    ({}, "malformed", (None, None, None)),
])
def test_parse_usage_records_only_what_was_reported(usage, status, counts):
    fields = ask.parse_usage(usage)
    assert fields["usage_status"] == status
    assert (fields["input_tokens"], fields["output_tokens"], fields["total_tokens"]) == counts
    assert fields["usage_reported"] is (status in ("complete", "partial", "zero"))


def test_parse_usage_details():
    fields = ask.parse_usage({"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                              "prompt_tokens_details": {"cached_tokens": 2},
                              "completion_tokens_details": {"reasoning_tokens": "x"}})
    assert fields["cached_input_tokens"] == 2 and fields["reasoning_output_tokens"] is None


@pytest.mark.parametrize("kwargs,check,detail", [
    ({}, None, None),
    ({"expect": r"\b4\b"}, True, r"matched /\b4\b/"),
    ({"expect": "5"}, False, "no match for /5/"),
    ({"expect_json": True}, False, "not JSON"),
    ({"strict_model": True, "request_model": "a", "response_model": "b"}, False, "is not the requested one"),
    ({"strict_model": True, "request_model": "a", "response_model": "a", "expect": "4"}, True, "; "),
])
def test_run_checks(kwargs, check, detail):
    got, got_detail = ask.run_checks("The answer is 4.", **kwargs)
    assert got is check and (detail is None and got_detail is None or detail in got_detail)


def test_expect_json_allows_one_fence():
    assert ask.run_checks('```json\n{"a": 1}\n```', expect_json=True) == (True, "valid JSON (inside a ``` fence)")


@pytest.mark.parametrize("headers,wait", [
    ({"retry-after-ms": "250"}, 0.25), ({"Retry-After": "3"}, 3.0), ({"Retry-After": "-3"}, 0.0),
    ({"Retry-After": "nan"}, None), ({"Retry-After": "inf"}, None), ({"Retry-After": "soon"}, None),
    ({"retry-after-ms": "x", "Retry-After": "2"}, 2.0), ({}, None), (None, None),
])
def test_retry_after_seconds(headers, wait):
    assert ask.retry_after_seconds(headers, now=0) == wait


@pytest.mark.parametrize("url,recorded,host,port", [
    ("https://h.example/v1/", "https://h.example/v1", "h.example", 443),
    ("http://u:p@h.example:8080/v1?api-version=1#x", "http://h.example:8080/v1", "h.example", 8080),
    ("http://[::1]:9/v1", "http://[::1]:9/v1", "::1", 9),
])
def test_split_base_url_records_no_credentials(url, recorded, host, port):
    request_base, got, got_host, got_port = ask.split_base_url(url)
    assert (got, got_host, got_port) == (recorded, host, port)


def test_settings_name_every_missing_one_and_refuse_a_bad_key():
    with pytest.raises(ask.ConfigError, match="BASE_URL and MODEL_ID are not set"):
        ask.settings_from_env(environ={"API_KEY": "k" * 10})
    with pytest.raises(ask.ConfigError, match="white space"):
        ask.settings_from_env(environ={"API_KEY": " k", "BASE_URL": "http://h/v1", "MODEL_ID": "m"})
    assert ask.settings_from_env(environ={"OPENAI_API_KEY": "k", "OPENAI_BASE_URL": "http://h/v1"},
                                 need_model=False) == ("http://h/v1", None, "k")


def test_estimates_are_ceil_chars_over_four():
    assert [ask.estimate_tokens(n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
