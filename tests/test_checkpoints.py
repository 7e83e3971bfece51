"""Signed checkpoints over RFC 6962 trees, inclusion and consistency proofs, Ed25519 (issue 26):
real files and the CLI in subprocesses, as a user and a stranger run them."""

import base64
import hashlib
import os
import shutil
import stat
import subprocess
import sys

import pytest

import reasoning_ledger as rl
from conftest import ROOT, all_bytes_under, clean_env, run_script

NO_KEY = b""

# RFC 8032, 7.1: TEST 1, 2 and 3 (secret key, public key, message, signature), and TEST SHA(abc).
RFC8032 = [
    ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
     "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
     "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b4"
     "6bd25bf5f0595bbe24655141438e7a100b"),
    ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
     "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
     "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d"
     "8c387b2eaeb4302aeeb00d291612bb0c00"),
    ("c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
     "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025", "af82",
     "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc6"
     "594a7c15e9716ed28dc027beceea1ec40a"),
]


def flipped(data, bit):
    return data[:bit // 8] + bytes([data[bit // 8] ^ (1 << bit % 8)]) + data[bit // 8 + 1:]


def write(path, n, run_id="r1", start=0):
    with rl.Ledger(path, run_id, key=NO_KEY) as ledger:
        for i in range(start, start + n):
            ledger.append("note", {"i": i})


def cli(*args, input=None, cwd=None, env=None):
    return run_script("reasoning_ledger.py", *args, input=input, cwd=cwd, env=env)


def keygen(tmp_path, name="example.org/log", cosigner=False):
    out = tmp_path / (name.replace("/", "_") + ".key")
    proc = cli("keygen", name, "--out", out, *(["--cosigner"] if cosigner else []))
    assert proc.returncode == 0, proc.err
    return out, proc.out.strip()


# ----------------------------------------------------------------------------
# Ed25519
# ----------------------------------------------------------------------------

def test_ed25519_gives_rfc8032s_published_vectors():
    for secret, public, message, signature in RFC8032:
        secret, public, message, signature = map(bytes.fromhex, (secret, public, message, signature))
        assert rl.ed25519_public(secret) == public
        assert rl.ed25519_sign(secret, message) == signature
        assert rl.ed25519_verify(public, message, signature)


def test_ed25519_with_random_keys_and_every_kind_of_flipped_bit():
    for _ in range(4):
        seed, message = os.urandom(32), os.urandom(40)
        public, signature = rl.ed25519_public(seed), rl.ed25519_sign(seed, message)
        assert rl.ed25519_verify(public, message, signature)
        for bit in (0, 7, 100, 255, 300, 511):  # R and S halves, low and high bits
            assert not rl.ed25519_verify(public, message, flipped(signature, bit))
        for bit in (0, 9, 254):
            assert not rl.ed25519_verify(flipped(public, bit), message, signature)
        assert not rl.ed25519_verify(public, flipped(message, 3), signature)
        assert not rl.ed25519_verify(public, message + b"\0", signature)
        assert not rl.ed25519_verify(public, message, signature[:63])
    # S + L: the same point, but a signature must hold S below the group order
    s = int.from_bytes(signature[32:], "little") + rl._L
    assert not rl.ed25519_verify(public, message, signature[:32] + s.to_bytes(32, "little"))


# ----------------------------------------------------------------------------
# RFC 6962 trees and proofs
# ----------------------------------------------------------------------------

def mth(leaves):
    """RFC 6962's MTH, written the naive recursive way."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return hashlib.sha256(b"\0" + leaves[0]).digest()
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return hashlib.sha256(b"\1" + mth(leaves[:k]) + mth(leaves[k:])).digest()


@pytest.fixture(scope="module")
def seventy(tmp_path_factory):
    path = tmp_path_factory.mktemp("tree") / "lines"
    leaves = [b"line %d" % i for i in range(69)] + [b""]  # an empty line is a leaf too
    path.write_bytes(b"".join(leaf + b"\n" for leaf in leaves) + b"a torn tail, no leaf")
    return path, leaves


def test_trees_of_every_size_up_to_70_match_the_naive_mth(seventy):
    path, leaves = seventy
    for size in range(71):
        proof, root = rl.tree_proof(path, size, old=size)
        assert (proof, root) == ([], mth(leaves[:size]))
    with pytest.raises(rl.IntegrityError, match="cut: the ledger has 70 lines, not 71"):
        rl.tree_proof(path, 71, old=0)
    tree = rl.Tree()  # O(log n) memory: one subtree root per set bit of the size
    for size in range(1, 5000):
        tree.add(b"x")
        assert len(tree.stack) == bin(size).count("1")


def test_inclusion_proofs_for_every_leaf_of_every_tree_up_to_70(seventy):
    path, leaves = seventy
    for size in range(1, 71):
        root = mth(leaves[:size])
        for index in range(size):
            proof, got = rl.tree_proof(path, size, index=index)
            assert got == root
            assert rl.verify_inclusion(leaves[index], index, size, proof, root)
            assert not rl.verify_inclusion(leaves[index] + b"x", index, size, proof, root)
            assert not rl.verify_inclusion(leaves[index], index + 1, size, proof, root)
            if proof:
                assert not rl.verify_inclusion(leaves[index], index, size, proof[:-1], root)
                assert not rl.verify_inclusion(leaves[index], index, size, proof + proof[:1], root)
                bad = [flipped(proof[0], 5)] + proof[1:]
                assert not rl.verify_inclusion(leaves[index], index, size, bad, root)


def test_consistency_proofs_for_every_pair_of_sizes_up_to_70(seventy):
    path, leaves = seventy
    roots = [mth(leaves[:size]) for size in range(71)]
    for size in range(71):
        for old in range(size + 1):
            proof, root = rl.tree_proof(path, size, old=old)
            assert root == roots[size]
            assert rl.verify_consistency(old, roots[old], size, root, proof), (old, size)
            if 0 < old < size:
                assert not rl.verify_consistency(old, roots[old - 1], size, root, proof)
                assert not rl.verify_consistency(old, roots[old], size, roots[size - 1], proof)
                assert not rl.verify_consistency(old, roots[old], size, root, proof[:-1])
                assert not rl.verify_consistency(old, roots[old], size, root, proof + proof[:1])
                assert not rl.verify_consistency(size, roots[size], old, roots[old], proof)
            if old == size and size:
                assert not rl.verify_consistency(old, roots[old], size, root, [root])
                assert not rl.verify_consistency(old, roots[old - 1], size, root, [])


# ----------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------

def test_keygen_writes_a_private_signer_key_and_prints_its_verifier_key(tmp_path):
    for cosigner, kind in ((False, 1), (True, 4)):
        out, vkey = keygen(tmp_path, f"w{kind}.example", cosigner)
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        secret = out.read_text()
        assert secret.startswith(f"PRIVATE+KEY+w{kind}.example+") and secret.endswith("\n")
        name, kid, data = vkey.split("+", 2)  # base64 may hold more `+`
        raw = base64.b64decode(data)
        assert name == f"w{kind}.example" and raw[0] == kind and len(raw) == 33
        assert bytes.fromhex(kid) == hashlib.sha256(name.encode() + b"\n" + raw).digest()[:4]
        assert base64.b64decode(secret.split("+", 4)[4])[0] == kind  # the type byte in both forms
        key = rl.read_signer_key(out)
        assert rl.key_text(key) == vkey and rl.key_text(key, secret=True) == secret.strip()
        before = out.read_bytes()
        again = cli("keygen", name, "--out", out)
        assert again.returncode == 2 and "never overwrites" in again.err and out.read_bytes() == before
    assert cli("keygen", "bad name", "--out", tmp_path / "x").returncode == 2
    assert cli("keygen", "a+b", "--out", tmp_path / "x").returncode == 2
    assert cli("keygen", "name").returncode == 2  # --out is required
    assert not (tmp_path / "x").exists()


def test_a_key_splits_at_its_first_two_plus_signs_only():
    while True:  # a key whose base64 holds a `+`
        seed = os.urandom(32)
        public = rl.ed25519_public(seed)
        key = rl.NoteKey("log", rl._key_id("log", 1, public), 1, public, seed)
        if "+" in rl.key_text(key).split("+", 2)[2] and "+" in rl.key_text(key, True)[12:].split("+", 2)[2]:
            break
    assert rl.parse_key(rl.key_text(key)) == key._replace(seed=None)
    assert rl.parse_key(rl.key_text(key, True), secret=True) == key


def test_keys_and_notes_match_the_go_note_packages_published_example():
    """golang.org/x/mod/sumdb/note's ExampleSign and ExampleOpen: the same key texts (a `+` in the
    base64), the same key ID and the same signed note, byte for byte."""
    skey = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
    vkey = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
    text = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
    signed = text + ("\n\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvq"
                     "fqdngotpRZb6KE6RyyBwJnAM=\n")
    key = rl.parse_key(skey, secret=True)
    assert rl.key_text(key) == vkey and rl.key_text(key, secret=True) == skey
    assert rl.parse_key(vkey) == key._replace(seed=None)
    assert rl.sign_note(text, key) == signed
    raw = base64.b64decode(signed.split(" ")[-1])
    assert rl.ed25519_verify(rl.parse_key(vkey).public, text.encode(), raw[4:])


def test_bad_keys_are_refused_as_usage_errors(tmp_path):
    good = rl.key_text(rl.parse_key(rl.key_text(rl.NoteKey("a", rl._key_id("a", 1, rl.ed25519_public(
        b"\1" * 32)), 1, rl.ed25519_public(b"\1" * 32), None))))
    name, kid, data = good.split("+", 2)
    for text, words in ((f"{name}+00000000+{data}", "does not match"),
                        (f"{name}+{kid}+{data[:-4]}", "not a signed-note"),
                        (f"{name}+{kid}", "not a signed-note"),
                        ("", "not a signed-note"),
                        (f"{name}+{kid}+" + base64.b64encode(b"\2" + base64.b64decode(data)[1:]).decode(),
                         "not a signed-note"),
                        ("PRIVATE+KEY+" + good, "secret")):
        with pytest.raises(rl.UsageError, match=words):
            rl.parse_key(text)
    ledger = tmp_path / "l.jsonl"
    write(ledger, 2)
    out, _vkey = keygen(tmp_path)
    for bit in (0o040, 0o020, 0o010, 0o004, 0o002, 0o001):  # any group or other bit, as ssh refuses
        out.chmod(0o600 | bit)
        proc = cli("checkpoint", ledger, "--key", out)
        assert proc.returncode == 2 and "must be private" in proc.err and proc.out == ""
    out.chmod(0o600)
    wkey, _wv = keygen(tmp_path, "w.example", cosigner=True)
    assert cli("checkpoint", ledger, "--key", wkey).returncode == 2  # a cosigner key signs no checkpoint
    assert cli("checkpoint", ledger, "--key", tmp_path / "missing").returncode == 2
    proc = cli("verify", ledger, "--checkpoint", tmp_path / "missing", "--vkey", _vkey)
    assert proc.returncode == 2


def test_the_signer_key_never_reaches_a_ledger_line_or_an_error(tmp_path):
    out, _vkey = keygen(tmp_path)
    secret = out.read_text().strip()
    seed_b64 = secret.split("+", 4)[4]
    ledger = tmp_path / "l.jsonl"
    proc = cli("append", ledger, "--kind", "note", "--payload", '{"text": "oops ' + secret + ' pasted"}')
    assert proc.returncode == 0
    proc = cli("append", ledger, "--kind", "note", "--payload", '{"text": ' + secret + "}")  # not JSON
    assert proc.returncode == 2
    proc = cli("verify", ledger, "--checkpoint", out, "--vkey", secret)
    assert proc.returncode == 2 and "secret" in proc.err
    proc = cli("checkpoint", ledger, "--key", out, "--origin", "x\n" + secret)
    assert proc.returncode == 2
    blob = all_bytes_under(tmp_path).replace(out.read_bytes(), b"")
    assert seed_b64.encode() not in blob and b"PRIVATE+KEY+" not in blob
    for text in (proc.out + proc.err, rl.redact_text(f"key={secret}"), rl.redact_text(secret + "\n")):
        assert seed_b64 not in text
    for cut in range(len(secret)):  # the prefilter lets through whatever the shape masks
        for sample in (secret[cut:], secret[:len(secret) - cut]):
            if rl.Redactor().text(sample) != sample:
                assert rl._may_match(sample)


# ----------------------------------------------------------------------------
# Checkpoints: signing, the sidecar, verify
# ----------------------------------------------------------------------------

@pytest.fixture
def signed(tmp_path):
    ledger = tmp_path / "l.jsonl"
    write(ledger, 5)
    key, vkey = keygen(tmp_path)
    return ledger, key, vkey


def checkpoint(ledger, key, *extra):
    proc = cli("checkpoint", ledger, "--key", key, *extra)
    assert proc.returncode == 0, proc.err
    return proc.out


def test_a_checkpoint_is_a_signed_tlog_checkpoint_note(signed, tmp_path):
    ledger, key, vkey = signed
    note = checkpoint(ledger, key)
    lines = ledger.read_bytes().split(b"\n")[:-1]
    root = base64.b64encode(mth(lines)).decode()
    body = f"example.org/log\n5\n{root}\n"
    assert note.startswith(body + "\n\u2014 example.org/log ") and note.endswith("\n")
    raw = base64.b64decode(note.split(" ")[-1])
    assert raw[:4] == bytes.fromhex(vkey.split("+")[1]) and len(raw) == 68
    assert rl.ed25519_verify(rl.parse_key(vkey).public, body.encode(), raw[4:])
    assert checkpoint(ledger, key, "--origin", "other.example/x").startswith("other.example/x\n5\n")
    # a torn last line is no leaf; the lines before it are checkpointed
    with open(ledger, "ab") as handle:
        handle.write(b'{"seq":6,"run_id":"r1"')
    assert checkpoint(ledger, key).startswith(body)


def test_checkpoint_reads_a_keyed_ledger_with_its_key_only(tmp_path):
    ledger = tmp_path / "keyed.jsonl"
    with rl.Ledger(ledger, "r1", key=b"hmac-key-0123456789") as writer:
        writer.append("note", {})
    key, vkey = keygen(tmp_path)
    assert cli("checkpoint", ledger, "--key", key).returncode == 2
    proc = cli("checkpoint", ledger, "--key", key, env=clean_env(LEDGER_KEY="hmac-key-0123456789"))
    assert proc.returncode == 0 and "\n1\n" in proc.out


def test_the_sidecar_holds_notes_one_empty_line_apart_and_verify_uses_the_newest(signed):
    ledger, key, vkey = signed
    old_umask = os.umask(0o022)  # the CLI inherits it: a file made with the umask's mode is 0644
    try:
        first = checkpoint(ledger, key, "--append")
    finally:
        os.umask(old_umask)
    write(ledger, 2, start=5)
    second = checkpoint(ledger, key, "--append")
    sidecar = ledger.parent / (ledger.name + ".checkpoints")
    assert sidecar.read_text() == first + "\n" + second
    assert stat.S_IMODE(sidecar.stat().st_mode) == 0o600  # private like its ledger, whatever the umask
    assert rl.split_notes(sidecar.read_text()) == [first, second]
    proc = cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey)
    assert proc.returncode == 0, proc.err
    assert "7 lines" in proc.out and "checkpoint 7 signed by example.org/log" in proc.out
    vkey_file = ledger.parent / "log.vkey"
    vkey_file.write_text(vkey + "\n")
    assert cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey_file).returncode == 0
    (ledger.parent / "old").write_text(first)
    proc = cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey, "--since", ledger.parent / "old")
    assert proc.returncode == 0, proc.err
    # later lines than the checkpoint are fine: the log grew
    write(ledger, 1, start=7)
    assert cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey).returncode == 0


def rewrite(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def test_every_tamper_class_against_a_checkpoint_is_named(signed, tmp_path):
    ledger, key, vkey = signed
    (tmp_path / "early").write_text(checkpoint(ledger, key, "--append"))  # at 5 lines
    write(ledger, 3, start=5)
    checkpoint(ledger, key, "--append")  # at 8 lines
    sidecar = tmp_path / "l.jsonl.checkpoints"
    original = ledger.read_bytes().split(b"\n")[:-1]

    def verify(*extra):
        proc = cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey, *extra)
        assert proc.returncode == 1 and proc.out.startswith("FAIL"), (proc.out, proc.err)
        return proc.out + proc.err

    # a line changed (its chain breaks at the next line)
    rewrite(ledger, original[:2] + [original[2].replace(b'"i":2', b'"i":9')] + original[3:])
    assert "a line changed" in verify() and "line 4" in verify()
    # a line removed, two lines swapped, a line repeated: the chain breaks inside the checkpoint too
    for lines in (original[:3] + original[4:], original[:3] + [original[4], original[3]] + original[5:],
                  original[:4] + [original[3]] + original[4:]):
        rewrite(ledger, lines)
        assert "a line changed (line " in verify()
    # the last line changed: the chain cannot see it, the checkpoint does
    rewrite(ledger, original[:7] + [original[7].replace(b'"i":7', b'"i":9')])
    assert "rebuilt, or forked before any earlier checkpoint" not in verify()  # the early one matches
    assert "forked after line 5, where an earlier checkpoint matches" in verify()
    # a tail cut below the checkpoint's size
    rewrite(ledger, original[:6])
    assert "cut: the checkpoint covers 8 lines, the ledger has 6" in verify()
    rewrite(ledger, [])
    assert "cut" in verify()
    # the whole file rebuilt with a fresh, valid chain: the chain alone passes it
    ledger.unlink()
    write(ledger, 8, start=100)
    assert cli("verify", ledger).returncode == 0
    assert "rebuilt, or forked before any earlier checkpoint" in verify()
    # a fork: the first 5 lines kept, then another history of the same length
    ledger.unlink()
    rewrite(ledger, original[:5])
    write(ledger, 3, start=50)
    assert cli("verify", ledger).returncode == 0
    assert "forked after line 5, where an earlier checkpoint matches: its first 8" in verify()
    # the original verifies again
    rewrite(ledger, original)
    assert cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey).returncode == 0
    # two checkpoints the log signed over two histories: --since names the fork
    ledger.unlink()
    write(ledger, 5, start=30)
    (tmp_path / "other").write_text(checkpoint(ledger, key))
    rewrite(ledger, original)
    proc = cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey, "--since", tmp_path / "other")
    assert proc.returncode == 1 and "does not extend the earlier one of size 5" in proc.out
    bigger = tmp_path / "bigger"
    write(tmp_path / "big.jsonl", 9)
    bigger.write_text(checkpoint(tmp_path / "big.jsonl", key))
    proc = cli("verify", ledger, "--checkpoint", sidecar, "--vkey", vkey, "--since", bigger)
    assert proc.returncode == 1 and "not an earlier checkpoint" in proc.out


def test_bad_checkpoints_are_refused_each_with_its_own_message(signed, tmp_path):
    ledger, key, vkey = signed
    note = checkpoint(ledger, key)
    stranger_key, stranger_vkey = keygen(tmp_path, "stranger.example")
    body, sig_line = note.split("\n\n")
    name, sig = sig_line.split(" ")[1:]
    raw = base64.b64decode(sig)
    other_id = base64.b64encode(flipped(raw, 0)).decode()
    cases = {
        "unknown key": (checkpoint(ledger, stranger_key), "signed by no key given (signers: stranger"),
        "truncated": (note[:-9], "truncated: the note does not end in a newline"),
        "truncated body": (note[:30] + "\n", "not a signed note: no empty line before the signatures"),
        "malformed signature": (body + "\n\n\u2014 x\n", "malformed signature line"),
        "malformed body": (note.replace("\n5\n", "\nfive\n"), "malformed checkpoint"),
        "wrong key ID": (f"{body}\n\n\u2014 {name} {other_id}\n", "wrong key ID: the signature by"),
        "control character": (note.replace("example.org/log\n", "example.org/\x1blog\n", 1),
                              "a control character in the note"),
        "bad signature": (note.replace("\n5\n", "\n4\n"), "the signature by example.org/log does not"),
        "empty": ("", "truncated"),
    }
    seen = set()
    for case, (text, words) in cases.items():
        bad = tmp_path / "bad.checkpoint"
        bad.write_text(text)
        proc = cli("verify", ledger, "--checkpoint", bad, "--vkey", vkey)
        assert proc.returncode == 1 and words in proc.out, (case, proc.out, proc.err)
        seen.add(proc.out.splitlines()[0])
    assert len(seen) == len(cases) - 1  # "empty" and "truncated" share their words
    bad.write_bytes(note.encode().replace(b"example.org/log\n", b"example.org/\xff\n", 1))
    proc = cli("verify", ledger, "--checkpoint", bad, "--vkey", vkey)
    assert proc.returncode == 1 and "not UTF-8" in proc.out
    assert cli("verify", ledger, "--vkey", vkey).returncode == 2  # --vkey alone: no checkpoint to check
    # unknown signers beside a known one are ignored, as the signed-note rules say
    extra = note + "\u2014 stranger.example " + base64.b64encode(b"\0" * 68).decode() + "\n"
    (tmp_path / "extra").write_text(extra)
    assert cli("verify", ledger, "--checkpoint", tmp_path / "extra", "--vkey", vkey).returncode == 0
    # a second --vkey: either key may have signed
    proc = cli("verify", ledger, "--checkpoint", tmp_path / "extra", "--vkey", stranger_vkey,
               "--vkey", vkey)
    assert proc.returncode == 0


def test_witness_cosignatures_are_required_as_asked(signed, tmp_path):
    ledger, key, vkey = signed
    note = checkpoint(ledger, key)
    body = note.split("\n\n")[0] + "\n"
    witnesses = [keygen(tmp_path, f"w{i}.example", cosigner=True) for i in range(3)]
    keys = [rl.read_signer_key(path) for path, _v in witnesses]
    cosigned = note + rl.cosign(body, keys[0], 1764633600) + rl.cosign(body, keys[1], 1764633601)
    raw = base64.b64decode(rl.cosign(body, keys[0], 1764633600).split(" ")[-1])
    assert raw[4:12] == (1764633600).to_bytes(8, "big") and len(raw) == 76
    message = b"cosignature/v1\ntime 1764633600\n" + body.encode()
    assert rl.ed25519_verify(keys[0].public, message, raw[12:])
    path = tmp_path / "cosigned"
    path.write_text(cosigned)
    w = [v for _p, v in witnesses]

    def verify(*extra):
        return cli("verify", ledger, "--checkpoint", path, "--vkey", vkey, *extra)

    assert verify("--witness", w[0], "--witness", w[1]).returncode == 0
    proc = verify("--witness", w[0], "--witness", w[2])
    assert proc.returncode == 1 and "cosigned by 1 of the 2 witnesses needed" in proc.out
    assert verify("--witness", w[0], "--witness", w[2], "--witnesses-needed", "1").returncode == 0
    assert verify("--witness", w[0], "--witnesses-needed", "2").returncode == 2
    assert verify("--witness", vkey).returncode == 2  # a log key is no witness key
    path.write_text(cosigned.replace(rl.cosign(body, keys[1], 1764633601),
                                     rl.cosign(body, keys[1], 1764633601).replace("A", "B", 1)))
    assert verify("--witness", w[1]).returncode == 1
    # a witness's cosignature alone is no log signature
    path.write_text(body + "\n" + rl.cosign(body, keys[0], 1))
    assert "signed by no key given" in verify("--witness", w[0]).out


# ----------------------------------------------------------------------------
# Proofs, and the stranger's check
# ----------------------------------------------------------------------------

def test_a_stranger_checks_a_line_with_the_proof_file_and_the_verifier_key_only(signed, tmp_path):
    ledger, key, vkey = signed
    write(ledger, 20, start=5)
    checkpoint(ledger, key, "--append")
    sidecar = tmp_path / "l.jsonl.checkpoints"
    proc = cli("prove", ledger, "13", "--checkpoint", sidecar)
    assert proc.returncode == 0, proc.err
    lines = proc.out.split("\n")
    assert lines[:2] == ["c2sp.org/tlog-proof@v1", "index 12"] and proc.out.endswith(sidecar.read_text())
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "l.tlog-proof").write_text(proc.out)
    (stranger / "log.vkey").write_text(vkey + "\n")
    shutil.copy(ROOT / "reasoning_ledger.py", stranger)
    line = ledger.read_bytes().split(b"\n")[12] + b"\n"

    def check(text, proof="l.tlog-proof"):
        return subprocess.run([sys.executable, "-I", "reasoning_ledger.py", "verify-proof", proof,
                               "--vkey", "log.vkey"], input=text, cwd=stranger, capture_output=True,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout=60)

    ok = check(line)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.decode() == "ok    line 13 of example.org/log (25 lines), signed by example.org/log\n"
    assert check(line.rstrip(b"\n")).returncode == 0
    other = ledger.read_bytes().split(b"\n")[11]
    for text in (other, line.replace(b'"i":12', b'"i":13'), b"", line + line):
        failed = check(text)
        assert failed.returncode == 1 and b"is not line 13 of the log" in failed.stderr
    proof = (stranger / "l.tlog-proof").read_text()
    for bad, words in ((proof.replace("index 12", "index 11"), b"is not line 12"),
                       (proof.replace("c2sp.org/tlog-proof@v1", "tlog-proof"), b"not a c2sp.org"),
                       (proof[:-10], b"truncated"),
                       (proof.replace("\n25\n", "\n24\n"), b"does not verify")):
        (stranger / "bad").write_text(bad)
        failed = check(line, "bad")
        assert failed.returncode == 1 and words in failed.stderr, failed.stderr
    assert check(line, "missing").returncode == 2
    assert sorted(p.name for p in stranger.iterdir()) == ["bad", "l.tlog-proof", "log.vkey",
                                                          "reasoning_ledger.py"]


def test_prove_refuses_what_it_cannot_prove(signed, tmp_path):
    ledger, key, vkey = signed
    (tmp_path / "cp").write_text(checkpoint(ledger, key))
    assert cli("prove", ledger, "6", "--checkpoint", tmp_path / "cp").returncode == 2
    assert cli("prove", ledger, "0", "--checkpoint", tmp_path / "cp").returncode == 2
    assert cli("prove", ledger, "3").returncode == 2
    assert cli("prove", ledger).returncode == 2
    assert cli("prove", ledger, "--consistency", "6").returncode == 2
    assert cli("prove", ledger, "--consistency", "1", "2", "3").returncode == 2
    rewrite(ledger, [b"x"] * 5)
    proc = cli("prove", ledger, "3", "--checkpoint", tmp_path / "cp")
    assert proc.returncode == 1 and "does not give the checkpoint's root" in proc.err
    rewrite(ledger, [b"x"] * 4)
    assert "cut" in cli("prove", ledger, "3", "--checkpoint", tmp_path / "cp").err


def test_prove_consistency_links_two_checkpoints(signed, tmp_path):
    ledger, key, vkey = signed
    old = rl.parse_checkpoint(checkpoint(ledger, key))[0]
    write(ledger, 12, start=5)
    new = rl.parse_checkpoint(checkpoint(ledger, key))[0]
    for args, (m, n) in ((("5",), (5, 17)), (("5", "11"), (5, 11)), (("0",), (0, 17)),
                         (("17",), (17, 17))):
        proc = cli("prove", ledger, "--consistency", *args)
        assert proc.returncode == 0, proc.err
        proof = [base64.b64decode(line) for line in proc.out.split()]
        if (m, n) == (5, 17):
            assert rl.verify_consistency(old.size, old.root, new.size, new.root, proof)
            assert not rl.verify_consistency(old.size, new.root, new.size, new.root, proof)
        root = rl.tree_proof(ledger, n, old=0)[1]
        assert rl.verify_consistency(m, rl.tree_proof(ledger, m, old=0)[1], n, root, proof)
