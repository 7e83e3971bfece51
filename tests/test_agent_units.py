"""agent.py's pure functions, tested directly: globs, paths, replies, patches, budgets, the context, secrets."""

import math

import pytest

import agent
import reasoning_ledger as rl

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
