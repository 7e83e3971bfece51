"""Project rules: the README and the code say the same thing, the scripts keep their shape, the Makefile works
the way the README says (cron's environment included), and shipped code is Python 3.9 and stdlib only."""

import ast
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys

import pytest

import ask
import reasoning_ledger as rl
from conftest import ROOT, clean_env, run_script

SCRIPTS = ("reasoning_ledger.py", "ask.py", "proxy.py", "audit.py", "agent.py", "daemon.py", "fleet.py")
README = (ROOT / "README.md").read_text(encoding="utf-8")
ASK_DOC = (ROOT / "docs" / "ask.md").read_text(encoding="utf-8")  # the reference README links to
DOCS = [README] + [path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md"))]


def _table_after(text, heading_words, first_column):
    """The first-column cells of the first markdown table after `heading_words` in `text`."""
    start = text.index(heading_words)
    cells = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            cell = line.split("|")[1].strip()
            if cell not in (first_column, "---") and not set(cell) <= set("-"):
                cells.append(cell.strip("`"))
        elif cells:
            break
    return cells


def test_docs_list_exactly_the_model_call_fields():
    listed = _table_after(ASK_DOC, "## The `model_call` event", "field")
    assert listed == list(ask.MODEL_CALL_FIELDS)
    optional = _table_after(ASK_DOC, "Present only when they apply:", "field")
    assert optional == list(ask.MODEL_CALL_OPTIONAL)


def _readme_exit_rows():
    """{code: meaning} of the README's exit code table."""
    start = README.index("## Exit codes")
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", README[start:README.index("\n## ", start + 1)], re.M)
    return {int(code): meaning for code, meaning in rows}


def test_readme_exit_codes_are_the_one_table():
    """The README's table has a row for each code of rl.EXIT_CODES, and each row names the scripts the
    code's description names."""
    rows = _readme_exit_rows()
    assert sorted(rows) == sorted(rl.EXIT_CODES)
    for code, meaning in rl.EXIT_CODES.items():
        for script in ("ask", "audit", "agent", "verify", "ship"):
            if re.search(rf"\b{script}\b", meaning):
                assert script in rows[code], (code, script, rows[code])


def test_every_script_keeps_its_shape_and_its_all():
    for name in SCRIPTS:
        source = (ROOT / name).read_text(encoding="utf-8")
        assert source.startswith("#!/usr/bin/env python3\n"), name
        tree = ast.parse(source)
        docstring = ast.get_docstring(tree)
        assert docstring and "Usage:" in docstring, name
        module = importlib.import_module(name[:-3])
        assert re.fullmatch(r"\d+\.\d+\.\d+", module.__version__)
        assert list(inspect.signature(module.main).parameters) == ["argv"]
        assert source.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())'), name
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert missing == [], (name, missing)


def test_shipped_code_parses_as_python_3_9_and_imports_only_the_stdlib():
    local = {p.stem for p in ROOT.glob("*.py")}
    std = set(getattr(sys, "stdlib_module_names", ()))  # Python 3.10+; on 3.9 only the syntax is held
    shipped = sorted(ROOT.glob("*.py"))
    for path in shipped + sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), feature_version=(3, 9))
        if path not in shipped or not std:
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for module in names:
                assert module.split(".")[0] in std | local | {"__future__"}, f"{path.name} imports {module}"


def test_every_exit_code_of_the_help_is_the_one_table_and_in_the_readme():
    rows = _readme_exit_rows()
    for name in SCRIPTS:
        proc = run_script(name, "--help")
        assert proc.returncode == 0 and "exit codes:" in proc.out, name
        listed = re.findall(r"^  (\d+)  (.+)$", proc.out.split("exit codes:")[1], re.M)
        assert listed and [int(code) for code, _text in listed] == sorted({int(code) for code, _t in listed}), name
        for code, text in listed:
            assert text == rl.EXIT_CODES[int(code)] and int(code) in rows, (name, code, text)


# ----------------------------------------------------------------------------
# The Makefile
# ----------------------------------------------------------------------------

pytestmark_make = pytest.mark.skipif(not shutil.which("make"), reason="needs make")


def _make(*args, env=None, cwd=None):
    return subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), *args], capture_output=True, text=True,
                          env=env if env is not None else clean_env(), cwd=cwd, timeout=300)


@pytestmark_make
def test_make_help_lists_every_target():
    targets = re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M)
    phony = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert sorted(targets) == sorted(phony)
    shown = _make("help").stdout
    for target in targets:
        assert f"make {target}" in shown, target


@pytestmark_make
@pytest.mark.parametrize("environ", [{}, {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "SHELL": "/bin/sh"}],
                         ids=["env -i", "cron"])
def test_make_audit_and_verify_work_in_crons_environment(tmp_path, environ):
    if not shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"):
        pytest.skip("no python3 on the default PATH")
    with rl.Ledger(tmp_path / "calls.jsonl", "cron", key=b"") as ledger:
        ledger.append("model_call", {"request_model": "m", "base_url": "http://h/v1", "error_type": None})
    audit = _make("audit", env=environ, cwd=tmp_path)
    assert audit.returncode == 0, audit.stderr
    assert "1 model call," in audit.stdout
    verify = _make("verify", env=environ, cwd=tmp_path)
    assert verify.returncode == 0 and "1/1 ledgers valid" in verify.stdout, verify.stderr


@pytestmark_make
def test_make_test_keeps_one_venv_per_interpreter(tmp_path):
    """Two interpreters, two venvs: a stand-in `python` that says it is 3.99 gets .venv/py3.99, not ours."""
    tag = "%d.%d" % sys.version_info[:2]
    other = tmp_path / "python-other"
    other.write_text("#!/bin/sh\necho 3.99\n")
    other.chmod(0o755)
    ours, theirs = _make("-n", "test", f"PYTHON={sys.executable}").stdout, _make("-n", "test", f"PYTHON={other}").stdout
    venvs = lambda out: set(re.findall(r"\.venv/py([\d.]+)/", out))  # noqa: E731
    assert venvs(ours) == {tag} and venvs(theirs) == {"3.99"}
    broken = _make("test", f"PYTHON={tmp_path / 'no-such-python'}")
    assert broken.returncode == 2 and "does not run" in broken.stderr


@pytestmark_make
def test_make_bench_hands_bench_lines_to_the_bench():
    dry = _make("-n", "bench", "BENCH_LINES=1234").stdout
    assert re.search(r"BENCH_LINES=1234 \S+ \S*tests/bench\.py", dry), dry


def test_the_commands_of_the_readme_and_docs_exist():
    for command in re.findall(r"python3 (\w+\.py) (\w[\w-]*)", "\n".join(DOCS)):
        script, first = command
        if script in SCRIPTS and first in ("run", "runs", "replay", "check-tools", "judge", "serve", "verify",
                                           "head", "report", "append", "ship"):
            proc = run_script(script, first, "--help")
            assert proc.returncode == 0, (script, first, proc.err)
    assert (ROOT / "prompts" / "arithmetic.txt").exists()  # the file the first commands use


@pytest.mark.parametrize("how", ["closed", "broken pipe"])
def test_an_unwritable_stdout_exits_5_with_one_error_line_and_the_call_still_recorded(tmp_path, server, how):
    """`cmd >&-` and a pipe whose reader is gone: the result could not be shown; what was recorded stays."""
    from conftest import KEY
    ledger = tmp_path / "calls.jsonl"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello\n")
    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="stand-in-model", LEDGER=str(ledger))
    commands = [
        ["ask.py", str(prompt)],
        ["reasoning_ledger.py", "verify", str(ledger)],
        ["reasoning_ledger.py", "report", str(ledger), "--json"],
        ["audit.py", str(ledger), "--json"],
        ["agent.py", "check-tools"],
    ]
    for command in commands:
        argv = [sys.executable, str(ROOT / command[0]), *command[1:]]
        if how == "closed":
            proc = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *argv], stderr=subprocess.PIPE, env=env,
                                  timeout=60)
            lines = proc.stderr.decode().splitlines()
            assert proc.returncode == rl.EXIT_OUTPUT == 5, (command, lines)
            assert len(lines) == 1 and lines[0].startswith("error: stdout is closed"), (command, lines)
        else:  # the reader is gone before the first write: every write fails with EPIPE
            read_end, write_end = os.pipe()
            os.close(read_end)
            try:
                proc = subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=60)
            finally:
                os.close(write_end)
            lines = proc.stderr.decode().splitlines()
            if command[1] == "report":  # a filter: its reader left (`report | head`), so it ends quietly
                assert (proc.returncode, lines) == (0, []), (command, lines)
                continue
            assert proc.returncode == 5, (command, lines)
            assert len(lines) == 1 and lines[0].startswith("error: "), (command, lines)
    assert run_script("reasoning_ledger.py", "verify", ledger).returncode == 0
    assert len(list(rl.read_events(ledger, run_id=None))) == 1  # the call was recorded all the same
