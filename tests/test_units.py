"""The pure functions, tested directly: usage parsing, checks, waits, URLs, percentiles, day comparison, the
audit's view of a payload, CSV cells, printable text, times and heads, the agent's globs, paths, replies."""

import datetime
import math

import pytest

import agent
import ask
import audit
import reasoning_ledger as rl

# ----------------------------------------------------------------------------
# ask.py
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# audit.py
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# reasoning_ledger.py
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# agent.py
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("glob,path,match", [
    (".env*", ".env", True), (".env*", "sub/.env.local", True), (".env*", "env.py", False),
    (".git/", ".git/config", True), (".git/", "a/.git/HEAD", True), (".git/", ".github/x.yml", False),
    ("*.pem", "keys/server.pem", True), ("src/*.py", "src/a.py", True), ("src/*.py", "src/b/a.py", False),
    ("src/**/*.py", "src/b/c/a.py", True), ("src/**/*.py", "src/a.py", True), ("**", "anything/at/all", True),
    ("tests/", "tests/test_x.py", True), ("tests/", "mytests/x.py", False), ("id_*", "ssh/id_rsa", True),
    ("[!a]*.txt", "b.txt", True), ("[!a]*.txt", "a.txt", False),
])
def test_glob_semantics(glob, path, match):
    assert bool(agent._glob_regex(glob).match(path)) is match


def _policy(**changes):
    import json
    data = json.loads((agent.DEFAULT_TOOLS).read_text())
    data.update(changes)
    return agent.policy_from_text(json.dumps(data), "test")


@pytest.mark.parametrize("path,rule", [
    ("a.py", None), ("./a.py", None), ("src/../a.py", "path.dotdot"), ("/etc/passwd", "path.absolute"),
    ("~/x", "path.absolute"), ("C:\\x", "path.absolute"), ("-x", "arg.option"), (".ENV", "path.denied"),
    ("x\x00y", "path.nul"), ("out", "path.escape"), ("link", "path.denied"), ("", "args.type"),
])
def test_check_path(path, rule):
    resolved = {"out": None, "link": ".env"}

    def resolve(norm):
        return resolved.get(norm, norm)
    policy = _policy()
    if rule is None:
        assert agent.check_path(path, policy, resolve, {}) == path.lstrip("./")
    else:
        with pytest.raises(agent._Deny) as caught:
            agent.check_path(path, policy, resolve, {})
        assert caught.value.rule == rule


def test_allow_globs_narrow_what_is_reachable():
    policy = _policy(paths={"allow": ["src/**"], "deny": []})
    assert agent.check_action({"tool": "read_file", "args": {"path": "src/a.py"}}, policy, lambda p: p).allowed
    verdict = agent.check_action({"tool": "read_file", "args": {"path": "setup.py"}}, policy, lambda p: p)
    assert verdict.rule == "path.not_allowed"
    verdict = agent.check_action({"tool": "read_file", "args": {"path": ".git/config"}}, policy, lambda p: p)
    assert verdict.rule == "path.denied"  # .git/ is denied whatever a tools.json says


@pytest.mark.parametrize("reply,tool,form", [
    ('{"tool": "git_diff", "args": {}}', "git_diff", "json"),
    ('{"tool": "git_diff"}', "git_diff", "json"),
    ('Sure.\n```json\n{"tool": "run_tests", "args": {}}\n```', "run_tests", "fenced_json"),
    ('I will call {"tool": "list_files", "args": {"path": "."}} now.', "list_files", "embedded_json"),
    ("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n", "propose_patch", "diff"),
    ("```diff\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n```", "propose_patch", "fenced_diff"),
    ("diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n", "propose_patch", "diff"),
])
def test_parse_reply(reply, tool, form):
    action, got_form = agent.parse_reply(reply)
    assert action["tool"] == tool and got_form == form


@pytest.mark.parametrize("reply,words", [
    ("", "empty"), ("no idea", "no action found"), ('{"tool": ["x"]}', "tool name"),
    ('{"tool": "x", "args": [1]}', "JSON object"), ('{"args": {}}', "no action found"),
    ("Here is a diff:\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\nand some prose after", "no action found"),
])
def test_malformed_replies_say_why(reply, words):
    with pytest.raises(agent.Malformed, match=words):
        agent.parse_reply(reply)


def test_patch_files_and_problems():
    files, problems = agent.patch_files('diff --git "a/caf\\303\\251.py" "b/caf\\303\\251.py"\n--- "a/caf\\303\\251.py"\n'
                                        '+++ "b/caf\\303\\251.py"\n@@ -1 +1 @@\n-a\n+b\n')
    assert files == ["café.py"] and problems == []
    files, problems = agent.patch_files("diff --git a/x b/y\nrename from x\nrename to y\n")
    assert files == ["x", "y"]
    assert agent.patch_files("--- a/img.png\n+++ b/img.png\nGIT binary patch\n")[1][0][0] == "patch.binary"


def test_budget_counts_and_names_the_limit():
    budget = agent.Budget(dict(agent.DEFAULT_BUDGET, max_model_calls=3, max_total_tokens=100))
    budget.add({"attempts": 2, "tokens": 60, "tokens_source": "reported"})
    assert budget.exhausted(1.0) is None
    budget.add({"attempts": 1, "tokens": 50, "tokens_source": "estimated"})
    assert budget.exhausted(1.0) == ("max_model_calls", 3) and budget.snapshot(1.0)["tokens_source"] == "mixed"
    assert budget.exhausted(10 ** 6)[0] == "max_model_calls"
    fresh = agent.Budget(dict(agent.DEFAULT_BUDGET))
    assert fresh.exhausted(agent.DEFAULT_BUDGET["max_wall_s"]) == ("max_wall_s", agent.DEFAULT_BUDGET["max_wall_s"])


def test_fit_shortens_old_outputs_first():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for i in range(6):
        messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "x" * 5000}]
    change = agent._fit(messages, 12000)
    assert change["outputs_shortened"] > 0 and change["after_chars"] <= 12000
    assert messages[-1]["content"] == "x" * 5000  # the newest output is kept whole
    assert math.isclose(sum(len(m["content"]) for m in messages), change["after_chars"])


def test_repo_secrets_reads_dotenv_values_as_dotenv_does(tmp_path):
    import subprocess
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".env").write_text(
        "A=abc#def\nB=pa55 word # a note\nexport C=\"x y # z\" # c\nD: 'quoted'\nE=\n# F=commented\n"
        "G = spaced-value  \n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".env.local").write_text("H=local-secret\n")
    (tmp_path / ".env.prod").write_text(
        '\ufeffBOM_TOKEN=bomsecret1234567\nESC_PASS="p4ss\\"word-XYZ123"\nSQ_PASS=\'it\\\'s-secret-9876\'\n'
        'NL_KEY="line1-AAAAAAAA\\nline2-BBBBBBBB"\nMULTI="first-line-CCCCCCCC\nsecond-line-DDDDDDDD"\n')
    (tmp_path / ".envs" / ".production").mkdir(parents=True)
    (tmp_path / ".envs" / ".production" / ".django").write_text("DJANGO_SECRET_KEY=in-a-dotenv-directory-1\n")
    values = set(agent.repo_secrets(tmp_path))
    assert {"abc#def", "pa55 word", "x y # z", "quoted", "spaced-value", "local-secret"} <= values
    assert "commented" not in values and "" not in values and "abc" not in values
    assert {"bomsecret1234567", 'p4ss"word-XYZ123', "it's-secret-9876", "line1-AAAAAAAA\nline2-BBBBBBBB",
            "line2-BBBBBBBB", "first-line-CCCCCCCC\nsecond-line-DDDDDDDD", "second-line-DDDDDDDD",
            "in-a-dotenv-directory-1"} <= values


@pytest.mark.parametrize("name,secret", [
    ("API_KEY", True), ("STRIPE_KEY", True), ("SENTRY_DSN", True), ("SLACK_WEBHOOK_URL", True),
    ("SECRET_KEY", True), ("DB_PASSWORD", True), ("GITHUB_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("PATH", False), ("HOME", False), ("KEYBOARD", False), ("MONKEY_BUSINESS", False), ("TOKENIZER_MODEL", False),
])
def test_secret_environment_names(name, secret):
    assert rl.is_secret_env_name(name) is secret
