"""Redaction: key names by segment, secret shapes, secret values (in values and in keys), and generated
payloads that leak no secret."""

import json
import random
import re
import string

import pytest

import reasoning_ledger as rl
from conftest import all_bytes_under, clean_env, lines_of, run_script

ENV_SECRET = "envsecret-7f3a9c2e1b44"
VALUES = (ENV_SECRET, 'quo"te\\slash-secret-99')


def stored(payload, values=VALUES):
    """What the ledger would write for this payload."""
    return json.loads(rl._clean_payload(payload, rl.Redactor(values))[1])


# ----------------------------------------------------------------------------
# Key names
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "GITHUB_TOKEN", "db_password", "OPENAI_API_KEY", "x-api-key", "X-Api-Key", "apikey", "api.key", "accessToken",
    "privateKey", "AWS_SECRET_ACCESS_KEY", "Set-Cookie", "cookie", "Authorization", "proxy-authorization",
    "client.secret", "user_session", "SESSION", "passphrase", "DB_PASSWD", "credentials", "aws.credential",
    "refresh_token", "id_token", "HTTPAuthorization", "webhook-secret",
])
def test_a_name_ending_in_a_secret_word_is_masked(name):
    assert rl.is_secret_key(name)
    assert stored({name: "plain-value-1"})[name] == "[REDACTED]"


@pytest.mark.parametrize("name", [
    "input_tokens", "max_tokens", "token_count", "tokens", "output_tokens", "cached_input_tokens", "keyboard",
    "session_id", "password_hint_shown", "secretary", "key", "possession", "api_key_id", "monkey", "sessions",
    "cookies_enabled", "author",
])
def test_counts_and_lookalikes_stay(name):
    assert not rl.is_secret_key(name)
    assert stored({name: 12})[name] == 12


def test_null_and_booleans_under_a_secret_name_stay():
    assert stored({"token": None, "has_token": True, "api_key": False}) == {"token": None, "has_token": True,
                                                                             "api_key": False}


def test_dict_keys_are_masked_for_values_and_shapes():
    out = stored({ENV_SECRET: 1, f"prefix-{ENV_SECRET}": 2, "sk-proj-A1b2C3d4E5f6G7h8": 3, "plain": 4})
    assert out == {"[REDACTED]": 1, "prefix-[REDACTED]": 2, "[REDACTED]~": 3, "plain": 4}


# ----------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------

# Each rule's smallest example: (text, the secret part that must go, what must stay).
SHAPE_CASES = [
    ("Authorization: Bearer abcDEF123456ghiJKL", "abcDEF123456ghiJKL", "Authorization: "),
    ("header bearer 3f9a8b7c6d5e4f3a2b1c", "3f9a8b7c6d5e4f3a2b1c", "header bearer "),
    ("BEARER eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", "eyJhbGciOiJIUzI1NiJ9", "BEARER "),
    ("sent Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA==", "sent Basic "),
    ("sent Basic dXNlcjpwYXNzdzBy", "dXNlcjpwYXNzdzBy", "sent Basic "),
    ("Cookie: opaque-cookie-blob-19", "opaque-cookie-blob-19", "Cookie: "),
    ("Authorization: Digest0123456789abc", "Digest0123456789abc", "Authorization: "),
    ("token: colon-token-15", "colon-token-15", "token: "),
    ("client_secret: colon-secret-16", "colon-secret-16", "client_secret: "),
    ("credentials: colon-cred-17", "colon-cred-17", "credentials: "),
    ("session: colon-sess-18", "colon-sess-18", "session: "),
    ("aws ASIAIOSFODNN7EXAMPLE temp", "ASIAIOSFODNN7EXAMPLE", " temp"),
    ("pat ghs_abcdefijklmnopqrstuvwxyz012345", "ghs_abcdefijklmnopqrstuvwxyz012345", "pat "),
    ("the key sk-proj-A1b2C3d4E5f6G7h8I9j0", "sk-proj-A1b2C3d4E5f6G7h8I9j0", "the key "),
    ("gh token ghp_abcdefghijklmnopqrstuvwxyz012345", "ghp_abcdefghijklmnopqrstuvwxyz012345", "gh token "),
    ("pat github_pat_11ABCDEFG0123456789_abcdefghij", "github_pat_11ABCDEFG0123456789_abcdefghij", "pat "),
    ("fine-grained github_pat_11ABCDEF0123456789_ZZZZZZZZZZ", "github_pat_11ABCDEF0123456789_ZZZZZZZZZZ",
     "fine-grained "),
    ("slack xoxb-1234567890-abcdefijkl", "xoxb-1234567890-abcdefijkl", "slack "),
    ("aws AKIAIOSFODNN7EXAMPLE here", "AKIAIOSFODNN7EXAMPLE", " here"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjE\n-----END OPENSSH PRIVATE KEY-----",
     "b3BlbnNzaC1rZXktdjE", ""),
    ("https://user:hunter2pass@llm.example.net/v1", "hunter2pass", "@llm.example.net/v1"),
    ("https://user:p@ss@w0rd@host.example/x", "ss@w0rd", "@host.example/x"),
    ("clone https://3f9a8b7c6d5e4f3a2b1c0d9e@github.com/o/r.git", "3f9a8b7c6d5e4f3a2b1c0d9e", "@github.com/o/r.git"),
    ("https://h.example/cb?client_secret=cs-value-1&state=ok", "cs-value-1", "state=ok"),
    ("https://h.example/cb?access_token=at-value-2&x=1", "at-value-2", "x=1"),
    ("https://h.example/cb?refresh_token=rt-value-3", "rt-value-3", "refresh_token="),
    ("https://h.example/cb?id_token=it-value-4", "it-value-4", "id_token="),
    ("https://h.example/cb?code=oauth-code-5&state=s", "oauth-code-5", "state=s"),
    ("https://acct.blob.core.windows.net/c/b?sv=2020&sig=sas-sig-6%3D", "sas-sig-6%3D", "sv=2020"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Signature=amzsig7&X-Amz-Credential=AKID%2F20261129", "amzsig7",
     "X-Amz-Credential="),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKID%2F20261129%2Fus", "AKID%2F20261129%2Fus", "X-Amz-"),
    ("https://h.example/deployments?api-key=azure-key-8", "azure-key-8", "api-key="),
    ("https://h.example/cb#access_token=frag-token-9&token_type=bearer", "frag-token-9", "token_type=bearer"),
    ("DB_PASSWORD=hunter2-env-10", "hunter2-env-10", "DB_PASSWORD="),
    ('export GITHUB_TOKEN="tok en 11"', "tok en 11", "export GITHUB_TOKEN="),
    ("password: 'yaml-pass-12'", "yaml-pass-12", "password: "),
    ('{"api_key": "json-in-text-13"}', "json-in-text-13", '{"api_key": '),
    ("Cookie: sid=abc; csrf=def14", "csrf=def14", "Cookie: "),
    (f"the env value {ENV_SECRET} leaked", ENV_SECRET, "leaked"),
    ('escaped quo"te\\slash-secret-99 too', 'quo"te\\slash-secret-99', "too"),
]


@pytest.mark.parametrize("text,secret,kept", SHAPE_CASES, ids=[c[1][:24] for c in SHAPE_CASES])
def test_each_shape_is_masked_in_values_and_keys(text, secret, kept):
    out = stored({"v": text, text: "key side"})
    assert secret not in out["v"] and kept in out["v"], out["v"]
    assert all(secret not in key for key in out)


@pytest.mark.parametrize("prose", [
    "send a bearer token in the header", "Bearer authentication is described in RFC 6750",
    "basic setup", "Basic authentication.", "ssh git@github.com:org/repo.git", "mail bob@example.com now",
    "https://deploy@host.example/path", "a https://host.example/page#section-2 link", "max_tokens=512",
    "input_tokens: 12", "the key is in the cupboard", "token_count = 3",
])
def test_prose_and_harmless_forms_stay(prose):
    assert stored({"v": prose})["v"] == prose


def test_masking_is_stable_when_applied_twice():
    for text, _secret, _kept in SHAPE_CASES:
        once = rl.Redactor(VALUES).text(text)
        assert rl.Redactor(VALUES).text(once) == once


# ----------------------------------------------------------------------------
# Generated payloads
# ----------------------------------------------------------------------------

SECRET_NAMES = ["GITHUB_TOKEN", "db_password", "OPENAI_API_KEY", "x-api-key", "accessToken", "privateKey",
                "Set-Cookie", "client.secret", "user_session", "api.key", "Passphrase", "CREDENTIALS"]
PLAIN_NAMES = ["note", "message", "count", "items", "input_tokens", "max_tokens", "token_count", "url", "text",
               "tokens", "session_id", "keyboard"]
PLAIN_TEXT = ["hello", "", "chars/4", "stop", "a bearer token", "matched /\\d+/", "x = 1", "a@b", "50%", "你好",
              "</script>", "line\nbreak", "tab\t"]


def _text(rng):
    """A string that may hold any one secret, embedded or alone, or nothing at all."""
    pick = rng.random()
    if pick < 0.4:
        return rng.choice(PLAIN_TEXT)
    text, _secret, _kept = rng.choice(SHAPE_CASES)
    if pick < 0.7:
        return text
    return rng.choice(PLAIN_TEXT) + " " + text + " " + rng.choice(PLAIN_TEXT)


def _payload(rng, depth=1):
    out = {}
    for _ in range(rng.randint(0, 6)):
        roll = rng.random()
        name = (rng.choice(SECRET_NAMES) if roll < 0.2 else _text(rng) if roll < 0.35 else rng.choice(PLAIN_NAMES))
        kind = rng.random()
        if kind < 0.5:
            value = _text(rng)
        elif kind < 0.65:
            value = rng.choice([0, 1, -7, 3.5, True, False, None, 10 ** 20])
        elif kind < 0.8 and depth < 6:
            value = [_text(rng) if rng.random() < 0.6 else _payload(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        elif depth < 6:
            value = _payload(rng, depth + 1)
        else:
            value = _text(rng)
        out[name] = value
    return out


def _leaks(blob):
    return [secret for _text, secret, _kept in SHAPE_CASES if secret in blob]


def test_generated_payloads_leak_no_secret():
    rng = random.Random(20261130)
    for _ in range(3000):
        payload = _payload(rng)
        out = stored(payload)
        blob = json.dumps(out, ensure_ascii=False)
        assert _leaks(blob) == [], (payload, blob)
        for name in SECRET_NAMES:
            if name in payload and payload[name] is not None and type(payload[name]) is not bool:
                assert out[name] == "[REDACTED]"


def test_every_rule_masks_its_example():
    for text, secret, _kept in SHAPE_CASES:
        assert secret not in rl.Redactor(VALUES).text(text), text
    for name in SECRET_NAMES:
        assert rl.is_secret_key(name)


# ----------------------------------------------------------------------------
# The environment, artifacts and the CLI
# ----------------------------------------------------------------------------

def test_env_vars_named_like_secrets_are_masked_by_value(tmp_path):
    env = clean_env(GITHUB_TOKEN="gh-env-value-1234", DB_PASSWORD="db-env-value-5678", MY_VAULT="vault-value-9012",
                    LEDGER_REDACT_ENV="MY_VAULT", SHORT_TOKEN="short")
    text = "values: gh-env-value-1234 db-env-value-5678 vault-value-9012 short"
    path = tmp_path / "l.jsonl"
    proc = run_script("reasoning_ledger.py", "append", path, "--kind", "note", "--payload",
                      json.dumps({"log": text}), env=env)
    assert proc.returncode == 0, proc.err
    stored_text = lines_of(path)[0]["payload"]["log"]
    assert stored_text == "values: [REDACTED] [REDACTED] [REDACTED] short"  # under 8 characters: not by value


def test_artifacts_are_masked_the_same_way(tmp_path, monkeypatch):
    monkeypatch.setenv("API_KEY", "artifact-key-123456")
    ledger = rl.Ledger(tmp_path / "l.jsonl", "r", key=b"")
    shapes = [case for case in SHAPE_CASES if case[1] not in VALUES]  # VALUES are not in this test's env
    body = "\n".join(text for text, _s, _k in shapes) + "\nkey artifact-key-123456\n"
    ref = ledger.store_artifact(body)
    blob = (tmp_path / ref["path"]).read_text()
    assert [s for _t, s, _k in shapes if s in blob] == [] and "artifact-key-123456" not in blob
    assert all_bytes_under(tmp_path).count(b"[REDACTED]") >= len(shapes)


def test_error_and_warning_lines_are_masked(capsys, monkeypatch):
    monkeypatch.setenv("API_KEY", "stderr-key-0000111")
    rl.error("failed with stderr-key-0000111 and Bearer abcDEF123456ghiJKL\nsecond line")
    err = capsys.readouterr().err
    assert err == "error: failed with [REDACTED] and Bearer [REDACTED]\\nsecond line\n"


def test_the_prefilter_lets_through_every_string_a_shape_changes():
    """rl._may_match is a necessary condition of every shape: wherever a shape alone changes a sample, it
    says so. The samples are the rule examples and their secrets, cut at every point from either end (so
    what the prefilter looks for is cut through while the rest of a shape may still match), in upper and
    lower case, and the whole examples with each letter re.IGNORECASE folds to ASCII, derived from re."""
    any_letter = re.compile("[a-z]", re.I)  # one pass over every code point, then which letter for the few
    folds = [(next(c for c in string.ascii_lowercase if re.fullmatch(c, char, re.I)), char)
             for char in map(chr, range(128, 0x110000)) if any_letter.fullmatch(char)]
    assert folds
    samples = set()
    for text, secret, _kept in SHAPE_CASES:
        for whole in (text, secret):
            for cut in range(len(whole)):
                samples.update((whole[cut:], whole[:len(whole) - cut]))
            samples.update(whole.replace(a, b).replace(a.upper(), b) for a, b in folds)
    samples |= {s.upper() for s in samples} | {s.lower() for s in samples}
    changed = 0
    for sample in samples:
        for pattern, repl in rl._SHAPES:
            if re.sub(pattern, repl, sample) != sample:
                changed += 1
                assert rl._may_match(sample), (pattern, sample)
    assert changed > len(SHAPE_CASES) * 10  # the cuts reach matches beyond the examples themselves


def _reference(redactor, text):
    """The Redactor as it was before its per-shape hints: every shape over every string."""
    for value in redactor.values:
        text = text.replace(value, rl.REDACTED)
    for pattern, repl in rl._SHAPES:
        text = re.sub(pattern, repl, text)
    return text


def test_the_per_shape_hints_change_nothing_the_shapes_do():
    """Redactor.text skips a shape when the folded text lacks its literals (or, for assignments, a
    secret word ending a name): the output equals every shape run over every string, over the secret
    sets (rule examples, names, cuts, case and the letters re.IGNORECASE folds to ASCII, the examples
    as JSON and as JSON keys, and generated payloads)."""
    folds = [(next(c for c in string.ascii_lowercase if re.fullmatch(c, char, re.I)), char)
             for char in map(chr, range(128, 0x110000)) if re.fullmatch("[a-z]", char, re.I)]
    samples = set(PLAIN_TEXT)
    for text, secret, _kept in SHAPE_CASES:
        for whole in (text, secret):
            for cut in range(len(whole)):
                samples.update((whole[cut:], whole[:len(whole) - cut]))
            samples.update(whole.replace(a, b).replace(a.upper(), b) for a, b in folds)
        samples.update((json.dumps({"text": text}), json.dumps({text: 1}), text.replace(" ", "\n")))
    for name in SECRET_NAMES + PLAIN_NAMES:
        for form in (f"{name}=abc123xyz", f'"{name}": "abc123xyz"', f"{name.upper()} : 'v'",
                     f"{name}_ = v", f"{name}s=v", f"x.{name}-=v"):
            samples.update((form, form.swapcase()))
    rng = random.Random(20261202)
    samples.update(json.dumps(_payload(rng), ensure_ascii=False) for _ in range(500))
    redactor = rl.Redactor(VALUES)
    changed = 0
    for sample in samples:
        expected = _reference(redactor, sample)
        assert redactor.text(sample) == expected, sample
        changed += expected != sample
    assert changed > len(samples) // 4  # the sets reach the shapes, not only the skips
