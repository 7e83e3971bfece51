"""Format v1 pinned: the committed golden ledgers are the truth. Today's writer must give the same bytes,
verify and `head` must accept them with the heads recorded here, the torn tail must recover as before, and the
shell recipe of docs/format.md must verify them with the real sha256sum and openssl."""

import re
import shutil
import subprocess

import pytest

import reasoning_ledger as rl
from conftest import ROOT, clean_env, run_script

GOLDEN = ROOT / "tests" / "golden"
KEY = "golden-hmac-key-0123456789"
HEADS = {  # taken from the committed files; a change here is a format change
    "unkeyed.jsonl": "7 8b5ab2e167304bda3dcc690122ec5d1c1933a9a539a33f2cf5ff10823406d075",
    "keyed.jsonl": "7 d38177cd2f42d836398e316b4df375812b5733381d10c8e11330600246efb163",
    "torn-recovered.jsonl": "5 ffe4c311a529b3db3a6ab4547430c715d9bb59468925da730b45905a703417ce",
}
TORN_HEAD = "3 502bb382c34236b57700653eb4d98919883154779fca6274cd1df976df006df4"
SIDECAR_AT = re.compile(rb" at=[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}\.[0-9]{6}Z\n")


def key_for(name):
    return KEY.encode() if name.startswith("keyed") else b""


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    import sys
    sys.path.insert(0, str(GOLDEN))
    import make_golden
    out = tmp_path_factory.mktemp("golden")
    make_golden.write_all(out)
    return out


@pytest.mark.parametrize("name", ["unkeyed.jsonl", "keyed.jsonl", "torn.jsonl", "torn-recovered.jsonl"])
def test_the_writer_gives_the_golden_bytes(regenerated, name):
    assert (regenerated / name).read_bytes() == (GOLDEN / name).read_bytes()


def test_the_torn_tail_recovers_as_before(regenerated):
    """Same sidecar record, except its `at`, which is the wall-clock time of the repair."""
    new, old = ((d / "torn-recovered.jsonl.torn").read_bytes() for d in (regenerated, GOLDEN))
    assert SIDECAR_AT.search(old) and SIDECAR_AT.sub(b" at=T\n", new) == SIDECAR_AT.sub(b" at=T\n", old)
    fragment = (GOLDEN / "torn.jsonl").read_bytes()[896:]
    assert old.startswith(b"torn offset=896 length=71 sha256=") and old.endswith(b"\n" + fragment + b"\n")
    recovered = list(rl.read_events(GOLDEN / "torn-recovered.jsonl", key=b""))
    assert recovered[3]["kind"] == "ledger_recovered"
    assert recovered[3]["payload"] == {"offset": 896, "length": 71, "sha256": old.split(b"sha256=")[1][:64].decode(),
                                       "sidecar": "torn-recovered.jsonl.torn"}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_verify_and_head_accept_the_golden_files(name):
    result = rl.verify(GOLDEN / name, key=key_for(name))
    assert result.head_text() == HEADS[name]
    seq, digest = HEADS[name].split()
    assert rl.verify(GOLDEN / name, key=key_for(name), expect_head=(int(seq), digest)).count == int(seq)
    env = clean_env(LEDGER_KEY=KEY if key_for(name) else None)
    head = run_script("reasoning_ledger.py", "head", GOLDEN / name, env=env)
    assert (head.returncode, head.out) == (0, HEADS[name] + "\n"), head.err
    check = run_script("reasoning_ledger.py", "verify", GOLDEN / name, env=env)
    assert check.returncode == 0 and f"  head {HEADS[name]}\n" in check.out


def test_the_torn_file_fails_verify_with_its_complete_head():
    with pytest.raises(rl.TornTailError) as caught:
        rl.verify(GOLDEN / "torn.jsonl", key=b"")
    assert (caught.value.offset, caught.value.length) == (896, 71)
    assert "%d %s" % caught.value.head == TORN_HEAD
    proc = run_script("reasoning_ledger.py", "verify", GOLDEN / "torn.jsonl")
    assert proc.returncode == 1 and "torn tail: 71 bytes at offset 896" in proc.out


def test_the_keyed_golden_file_needs_its_key():
    proc = run_script("reasoning_ledger.py", "verify", GOLDEN / "keyed.jsonl")
    assert proc.returncode == 2 and "a key is needed" in proc.out
    wrong = run_script("reasoning_ledger.py", "verify", GOLDEN / "keyed.jsonl",
                       env=clean_env(LEDGER_KEY="another-key-000"))
    assert wrong.returncode == 1


def _recipe():
    text = (ROOT / "docs" / "format.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    return next(b for b in blocks if b.startswith("# usage: sh verify.sh"))


@pytest.mark.skipif(not (shutil.which("sha256sum") and shutil.which("openssl")), reason="needs sha256sum and openssl")
@pytest.mark.parametrize("name", ["unkeyed.jsonl", "keyed.jsonl", "torn.jsonl", "torn-recovered.jsonl"])
def test_the_documented_shell_recipe_gives_the_same_heads(tmp_path, name):
    script = tmp_path / "verify.sh"
    script.write_text(_recipe(), encoding="utf-8")
    env = clean_env(KEY=KEY if key_for(name) else None)
    proc = subprocess.run(["sh", str(script), str(GOLDEN / name)], capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.decode() == (HEADS.get(name) or TORN_HEAD) + "\n"


def test_the_documented_shell_recipe_finds_a_changed_line(tmp_path):
    lines = (GOLDEN / "unkeyed.jsonl").read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"half":1.5', b'"half":2.5')
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines))
    script = tmp_path / "verify.sh"
    script.write_text(_recipe(), encoding="utf-8")
    proc = subprocess.run(["sh", str(script), str(tmp_path / "bad.jsonl")], capture_output=True, env=clean_env(),
                          timeout=120)
    assert proc.returncode == 1 and proc.stdout == b"line 4: prev does not match line 3\n"
