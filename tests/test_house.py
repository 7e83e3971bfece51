"""The house: the rooms (one concern per file), the imports between them, running one way down to
the ledger with no cycle, at most 100 columns a line, at most 60 lines a function, and the commands
that moved naming their new home. The token budgets are reported by `make house`, not held here."""

import ast
import json
import re
import subprocess
import sys

import pytest

from conftest import KEY, ROOT, clean_env, run_script
from house import ROOMS

# Each room and the rooms it may import: a layering, so no cycle is possible.
MAY_IMPORT = {
    "reasoning_ledger": set(),
    "ask": {"reasoning_ledger"},
    "fleet": {"reasoning_ledger", "ask"},
    "proxy": {"reasoning_ledger", "ask"},
    "audit": {"reasoning_ledger", "ask", "fleet"},
    "agent": {"reasoning_ledger", "ask", "fleet"},
    "daemon": {"reasoning_ledger", "ask", "fleet", "agent"},
    "transcripts": {"reasoning_ledger"},
}
NETWORK = {"socket", "socketserver", "http", "urllib", "ssl", "selectors", "asyncio"}
SHIPPED = sorted(p.name for p in ROOT.glob("*.py"))


def _imports(tree):
    """Every module a file imports, at the top or lazily inside a function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def _tree(name):
    return ast.parse((ROOT / name).read_text(encoding="utf-8"), feature_version=(3, 9))


def test_the_top_level_holds_the_rooms_and_nothing_else():
    assert set(SHIPPED) <= set(ROOMS), set(SHIPPED) - set(ROOMS)
    assert set(ROOMS) - set(SHIPPED) <= {"transcripts.py"}
    assert set(MAY_IMPORT) == {name[:-3] for name in ROOMS}


@pytest.mark.parametrize("name", SHIPPED)
def test_imports_run_one_way_down_to_the_ledger(name):
    ours = {n for n in _imports(_tree(name)) if n + ".py" in ROOMS}
    assert ours <= MAY_IMPORT[name[:-3]], (name, ours - MAY_IMPORT[name[:-3]])


def test_the_ledger_opens_no_socket_not_even_lazily():
    found = set(_imports(_tree("reasoning_ledger.py"))) & NETWORK
    assert not found, found
    # imported alone, it loads no module that opens a socket, nor any of ours (pathlib itself
    # loads urllib.parse, which opens nothing)
    watched = {"socket", "socketserver", "http", "ssl", "selectors", "asyncio"} | set(MAY_IMPORT)
    code = ("import sys; import reasoning_ledger; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % watched)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout.strip()
    assert out == "['reasoning_ledger']", out


# Runs ask.py as `python ask.py` does (runpy, as __main__), recording every pattern re compiles, then
# prints the modules loaded and those patterns.
_PLAIN_CALL = r"""
import json, re, runpy, sys
compiled, compile = set(), re._compile
re._compile = lambda pattern, flags: compiled.add(pattern) or compile(pattern, flags)
try:
    runpy.run_path(sys.argv[1], run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules),
                  "compiled": sorted(p for p in compiled if isinstance(p, str))}))
"""
# What a plain call never needs: the other rooms (the proxy, ClickHouse, reports, the agent), HTML,
# servers, child processes and worker pools.
_NOT_FOR_A_PLAIN_CALL = {name[:-3] for name in ROOMS} - {"ask", "reasoning_ledger"} | {
    "html", "http.server", "subprocess", "multiprocessing", "concurrent", "asyncio", "xml", "sqlite3"}


def test_a_plain_ask_call_loads_and_compiles_only_what_it_uses(tmp_path, server):
    """The start is most of a call's cost (tests/BENCH.md): modules, the redaction shapes, the
    checkpoint and control-character patterns load or compile on first use, not on every call."""
    import fnmatch

    import reasoning_ledger as rl

    env = clean_env(BASE_URL=server.base_url, API_KEY=KEY, MODEL_ID="fake-model", LEDGER="calls.jsonl")
    bare = json.loads(subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(list(sys.modules)))"],
                                     env=env, capture_output=True, text=True, timeout=60).stdout)
    proc = subprocess.run([sys.executable, "-c", _PLAIN_CALL, str(ROOT / "ask.py")], input="What is 2 + 2?",
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["code"] == 0 and len((tmp_path / "calls.jsonl").read_text().splitlines()) == 1, proc.stderr
    loaded = {m for m in set(seen["modules"]) - set(bare) if m.split(".")[0] in _NOT_FOR_A_PLAIN_CALL
              or m in _NOT_FOR_A_PLAIN_CALL}
    assert not loaded, sorted(loaded)
    lazy = [p for p, _ in rl._SHAPES] + [rl._CONTROL_RE, rl._NAME_RE, rl._SIG_RE, rl._CHECKPOINT_RE, rl._PROOF_RE]
    lazy += [fnmatch.translate(n) for n in rl.SECRET_ENV_NAMES if "*" not in n]  # names need no regex
    assert not set(lazy) & set(seen["compiled"]), set(lazy) & set(seen["compiled"])
    assert seen["compiled"], "no pattern recorded: the recorder itself is broken"


@pytest.mark.parametrize("name", SHIPPED)
def test_no_line_over_100_columns(name):
    wide = [i for i, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100]
    assert not wide, f"{name}: {len(wide)} lines over 100 columns, the first at line {wide[:1]}"


@pytest.mark.parametrize("name", SHIPPED)
def test_no_function_over_60_lines(name):
    long = [(f.name, f.lineno, f.end_lineno - f.lineno + 1) for f in ast.walk(_tree(name))
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno >= 60]
    assert not long, (name, long)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_room_has_a_narrow_all(name):
    tree = _tree(name)
    names = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    assert 0 < len(names) <= 30 and len(set(names)) == len(names), (name, names)


@pytest.mark.parametrize("old, new", [
    (("agent.py", "serve", "--repo", "."), "daemon.py"),
    (("ask.py", "proxy", "--listen", "127.0.0.1:0"), "proxy.py"),
    (("reasoning_ledger.py", "ship", "calls.jsonl"), "fleet.py ship"),
    (("reasoning_ledger.py", "verify", "--from", "http://127.0.0.1:9/"), "fleet.py verify --from"),
    (("reasoning_ledger.py", "verify", "x.jsonl", "--from=http://127.0.0.1:9/"), "fleet.py verify --from"),
])
def test_a_command_that_moved_names_its_new_home_and_does_nothing(tmp_path, old, new):
    proc = run_script(*old, cwd=tmp_path)
    assert proc.returncode == 2 and proc.out == "", (old, proc.out)
    lines = proc.err.splitlines()
    assert len(lines) == 1 and re.match(r"error: .* run `python3 %s`" % re.escape(new), lines[0]), lines
    assert list(tmp_path.iterdir()) == []  # no ledger, no daemon.jsonl: nothing was started


def test_a_moved_command_is_refused_even_without_its_new_home(tmp_path):
    """The old spelling imports nothing to answer: a copy with only the ledger still says where to go."""
    (tmp_path / "reasoning_ledger.py").write_bytes((ROOT / "reasoning_ledger.py").read_bytes())
    proc = subprocess.run([sys.executable, "-I", "reasoning_ledger.py", "ship", "x"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "fleet.py ship" in proc.stderr, proc.stderr


def test_the_readme_names_what_a_vendoring_script_may_rely_on():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Vendoring"):readme.index("### Anyone can check the record")]
    for name in SHIPPED:
        tree = _tree(name)
        names = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
        missing = [n for n in names if n != "main" and f"`{n}`" not in section]
        assert not missing, (name, missing)
