#!/usr/bin/env python3
"""agent.py -- the host of a coding agent. The model proposes, tools.json decides, a judge rules,
and the patch goes to a file for a human: nothing is ever applied to your repository. Stdlib only.

Usage:
  python agent.py run --repo DIR [--ref REV] [--runs-dir DIR] [--tools FILE] [--max-steps N]
                      [--max-wall-s S] [--ship-to URL]  # URL: ClickHouse, to ship the closed run to
  python agent.py runs [--runs-dir DIR]               # a table of runs: id, started, outcome, why
  python agent.py replay RUN_DIR [--tools OTHER.json] # the same decisions from the record, offline
  python agent.py check-tools [FILE]                  # validate an allowlist (exit 0 valid, 2 not)
  python agent.py judge RUN_DIR                       # the judge, as the host runs it: a process

Settings: BASE_URL, API_KEY, MODEL_ID, as for ask.py. Exit codes of `run`: 0 no action needed, 8 a
proposal waits for review, 3 the judge rejected the proposal, 7 budget exhausted, 9 stuck (the model
sent the same reply, or the same unusable one, max_repeats times in a row), 1 error (the run is
closed and recorded), 6 another run holds the repository's lock, 2 usage or configuration error (no
run).
"""

import sys


def _prctl(option, value):
    """prctl(2) on Linux; True when it took."""
    try:
        import ctypes

        linux = sys.platform.startswith("linux")
        return linux and ctypes.CDLL(None).prctl(option, value, 0, 0, 0) == 0
    except (ImportError, OSError, AttributeError):
        return False


# first: /proc/PID/environ and mem closed early, PR_SET_DUMPABLE 0 (closes nothing to root;
# docs/sandbox.md)
if __name__ == "__main__":
    _prctl(4, 0)

import argparse
import ast
import collections
import contextlib
import difflib
import errno
import fcntl
import glob
import hashlib
import itertools
import json
import math
import os
import posixpath
import re
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import traceback
from pathlib import Path

# the toolkit beside us, even under -I
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ask  # noqa: E402
import fleet  # noqa: E402
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.1.0"

__all__ = ["run_agent", "judge_run", "replay_run", "load_policy", "list_runs", "main"]

# == Constants =================================================================

HERE = Path(__file__).resolve().parent
DEFAULT_TOOLS = HERE / "tools.json"
DEFAULT_RUNS = "runs"
PROPOSAL_NAME = "proposal.patch"
BUILTINS = tuple("read_file list_files grep git_diff git_log run_tests propose_patch".split())
HARD_DENY = (".git/",)  # denied whatever a tools.json says
DEFAULT_DENY = tuple(
    ".git/ .env* *.pem *.key id_* *.p12 *.pfx *.keystore *.jks .ssh/ .aws/ .gnupg/ .netrc .npmrc"
    " .pypirc *secret* *credential* *.kdbx".split()
)
DEFAULT_BUDGET = {
    "max_steps": 24,
    "max_model_calls": 40,
    "max_total_tokens": 300000,
    "max_wall_s": 900,
    "max_tokens_per_call": 2048,
    "call_timeout_s": 180,
    "max_context_chars": 60000,
    "context_tokens": None,
    "max_repeats": 3
}
DEFAULT_CAPS = {
    "output_bytes": 16384,
    "timeout_s": 60,
    "cpu_s": 900,
    "address_space_bytes": 8 << 30,
    "file_size_bytes": 1 << 30,
    "open_files": 4096,
    "processes": 4096
}
SANDBOX_MODES = ("auto", "required", "off")
TRIPWIRES = tuple(
    "tripwire.runner_internals tripwire.interpreter_state tripwire.exit_paths"
    " tripwire.process_control tripwire.packaging_metadata tripwire.startup_hook".split()
)
DEFAULT_TEST_PATHS = tuple(
    "test_*.py *_test.py test*.py tests.py tests/ test/ *_spec.* spec/ __tests__/ *.test.*"
    " conftest.py pytest.ini .pytest.ini pytest.toml .pytest.toml tox.ini setup.cfg pyproject.toml"
    " noxfile.py sitecustomize.py usercustomize.py *.pth".split()
)
MAX_TOOLS_FILE = 1024 * 1024
SHIP_RUN_DEADLINE_S = 120  # run --ship-to: the longest shipping may delay the end of a run
MAX_PATH_CHARS = 1024
MAX_PLUGIN_ARG_CHARS = 256
MAX_TEXT_ARG_CHARS = 8000
MAX_PATCH_BYTES = 256 * 1024
MAX_GREP_PATTERN = 200
MAX_ARTIFACT_BYTES = 8 * 1024 * 1024
MAX_RESULTS_BYTES = 8 * 1024 * 1024  # the JUnit XML a box leaves, as the host or the judge reads it
EXCERPT_BYTES = 2000
CALL_RETRIES = 2
GIT_ENV = {
    "GIT_OPTIONAL_LOCKS": "0",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_NOSYSTEM": "1",
    "LC_ALL": "C"
}
OUTCOME_EXIT = {
    "no_action": rl.EXIT_OK,
    "proposal_accepted": rl.EXIT_PROPOSAL,
    "proposal_rejected_by_judge": rl.EXIT_CHECK,
    "budget_exhausted": rl.EXIT_BUDGET,
    "stuck": rl.EXIT_STUCK,
    "error": rl.EXIT_FAILED
}
# The host's decisions, as replay compares them (tool results and model calls are inputs, not
# decisions).
DECISION_KINDS = tuple(
    "model_proposed proposal_malformed tool_allowed tool_denied patch_rejected decision"
    " budget_exhausted stuck".split()
)


# == Errors ====================================================================


class PolicyError(rl.UsageError):
    """tools.json is not valid. `.problems` lists every problem, each naming its place."""

    def __init__(self, source, problems):
        self.problems, more = problems, len(problems) - 1
        super().__init__(
            f"{source}: {problems[0]}"
            + (f" (and {more} more; run agent.py check-tools)" if more else "")
        )


class LockHeld(rl.LedgerError):
    """Another run holds this repository's lock."""

    exit_code = rl.EXIT_LOCKED


class RepoError(rl.UsageError):
    """The repository cannot be read as a git work tree (or --ref does not name a commit)."""


class TestCommandError(rl.UsageError):
    """The test command cannot run here (no model can fix that): the run ends before any model
    call."""


class _Terminated(Exception):
    """SIGTERM or SIGINT arrived: the run is closed as an error, and its child processes are
    killed."""


# == Policy: tools.json ========================================================

_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
_PLACEHOLDER_RE = re.compile(r"\{([a-z][a-z0-9_]{0,31})\}")
_GLOB_TOKENS = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
# tools.json's shape, for check-tools: an object is a dict (a key ending in "!" is required, "*"
# stands for a name the user chooses), anything else names a check in _leaf_problems. The defaults
# are the tables above.
_PLUGIN = {
    "description!": "text",
    "argv!": "command",
    "args!": {"*": {"pattern!": "regex", "path": "bool"}},
    "timeout_s": "number",
    "output_bytes": "number"
}
_SCHEMA = {
    "version!": "version",
    "test_command!": "command",
    "test_timeout_s": "number",
    "builtins": "builtins",
    "paths": {"allow": "globs", "deny": "globs"},
    "budget": dict.fromkeys(DEFAULT_BUDGET, "number"),
    "caps": dict.fromkeys(DEFAULT_CAPS, "number"),
    "sandbox": "sandbox",
    "plugins": {"*": _PLUGIN},
    "judge": {
        "test_paths": "strings",
        "allow_test_changes": "bool",
        "known_answers": "bool",
        "tripwires_off": "tripwires"
    }
}
# the other numbers are integers
_REAL_KEYS = ("max_wall_s", "call_timeout_s", "timeout_s", "test_timeout_s")
# greater than this (else 0)
_MINIMUM = {"context_tokens": 255, "max_repeats": 2, "output_bytes": 255}


def _glob_regex(pattern, flags=0):
    """A gitignore-like glob as a regex over a repo-relative POSIX path ('/' anchors it, '**' spans
    dirs)."""
    body = pattern.strip("/") if pattern.startswith("/") else pattern.rstrip("/")
    parts = re.split(r"(\*\*/|\*\*|\*|\?|\[.[^\]]*\])", body)
    # the text between wildcards is literal; a bracket's leading '!' negates it, as '^' does
    out = [
        (
            _GLOB_TOKENS.get(part) or "[" + re.sub("^!", "^", re.escape(part[1:-1])) + "]"
            if i % 2
            else re.escape(part)
        )
        for i, part in enumerate(parts)
    ]
    start = "^" if "/" in pattern.rstrip("/") else "^(?:.*/)?"
    return re.compile(start + "".join(out) + "(?:/.*)?$", flags)


class Plugin:
    """A user-declared tool: an argv template filled by arguments that fully match their regex. No
    shell."""

    def __init__(self, spec):
        self.description, self.argv = spec["description"], spec["argv"]
        # each argument: its pattern, and whether its value is a repository path
        self.args = {
            arg: (re.compile(a["pattern"]), a.get("path", False)) for arg, a in spec["args"].items()
        }
        self.timeout_s, self.output_bytes = spec.get("timeout_s"), spec.get("output_bytes")

    def command(self, args):
        return [_PLACEHOLDER_RE.sub(lambda m: args[m[1]], part) for part in self.argv]


class Policy:
    """A validated tools.json: which tools, which paths, the test command, budgets and caps."""

    def __init__(self, data, text, source):
        self.source, self.text = str(source), text
        self.sha256 = _sha256_hex(text)
        self.version, self.test_command = data["version"], data["test_command"]
        self.test_timeout_s = data.get("test_timeout_s", 300)
        self.builtins = frozenset(data.get("builtins", ()))
        paths, judge = data.get("paths", {}), data.get("judge", {})
        self.allow = list(map(_glob_regex, paths.get("allow", ["**"])))
        deny = dict.fromkeys([*HARD_DENY, *paths.get("deny", DEFAULT_DENY)])
        self.deny = [(g, _glob_regex(g, re.I)) for g in deny]
        self.budget = dict(DEFAULT_BUDGET, **data.get("budget", {}))
        self.caps = dict(DEFAULT_CAPS, **data.get("caps", {}))
        # and the runner's own, whatever tools.json lists
        tests = [*judge.get("test_paths", DEFAULT_TEST_PATHS), *_runner_patterns(self.test_command)]
        self.test_paths = list(map(_glob_regex, tests))
        self.allow_test_changes = judge.get("allow_test_changes", False)
        self.known_answers = judge.get("known_answers", True)
        off = judge.get("tripwires_off", [])
        self.tripwires = () if off == ["*"] else tuple(t for t in TRIPWIRES if t not in off)
        sandbox = data.get("sandbox", "auto")
        sandbox = sandbox if type(sandbox) is dict else {"mode": sandbox}
        self.sandbox, self.read_paths = sandbox.get("mode", "auto"), sandbox.get("read_paths", [])
        self.plugins = {name: Plugin(spec) for name, spec in data.get("plugins", {}).items()}

    def denied_by(self, path):
        """The deny glob that matches `path`, or None (the root itself is never denied)."""
        return next((glob for glob, regex in self.deny if regex.match(path) and path != "."), None)

    def is_test_path(self, path):
        return any(regex.match(path) for regex in self.test_paths)


def _unknown(text, name, known):
    near = difflib.get_close_matches(name, known, n=1)
    return text + (f"; did you mean {near[0]!r}?" if near else f"; known: {', '.join(known)}")


def _problems(value, rule=_SCHEMA, where="tools.json", key=""):
    """Every problem of a parsed tools.json held to `rule` (a shape of _SCHEMA), each naming its
    place."""
    if key == "sandbox" and type(value) is dict:  # a mode, or {"mode": ..., "read_paths": [...]}
        rule = {"mode": "sandbox", "read_paths": "paths"}
    if not isinstance(rule, dict):
        return _leaf_problems(where, value, rule, key)
    if type(value) is not dict:
        return [f"{where}: must be an object"]
    known = {name.rstrip("!"): sub for name, sub in rule.items()}
    problems = [
        f"{where}.{name[:-1]}: missing (required)"
        for name in rule
        if name[-1] == "!" and name[:-1] not in value
    ]
    for name, item in value.items():
        if "*" in known and not _NAME_RE.match(name):
            problems.append(f"{where}.{name}: a name is [a-z][a-z0-9_]*, at most 32 characters")
        elif name not in known and "*" not in known:
            problems.append(_unknown(f"{where}.{name}: unknown key", name, tuple(known)))
        else:
            problems += _problems(item, known.get(name) or known["*"], f"{where}.{name}", name)
    if rule is _PLUGIN:
        problems += _plugin_problems(where, key, value)
    return problems


def _leaf_problems(where, value, rule, key):
    if rule == "number":
        integer, minimum = key not in _REAL_KEYS, _MINIMUM.get(key, 0)
        finite = type(value) is float and not integer and math.isfinite(value)
        if (
            (type(value) is int or finite)
            and value > minimum
            or (key == "context_tokens" and value is None)
        ):
            return []  # context_tokens null: learned from the endpoint
        return [
            f"{where}: must be {'an integer' if integer else 'a number'} greater than {minimum}"
        ]
    if rule == "bool":
        return [] if type(value) is bool else [f"{where}: must be true or false"]
    if rule == "text":
        if type(value) is str and value.strip():
            return []
        return [f"{where}: must be a non-empty string (the model reads it)"]
    if rule == "version":
        return [] if value == 1 else [f"{where}: must be 1 (this agent.py reads version 1)"]
    if rule == "sandbox":
        if value in SANDBOX_MODES:
            return []
        return [f"{where}: must be one of {', '.join(map(repr, SANDBOX_MODES))}"]
    if rule == "regex":
        try:
            re.compile(value)
        except (re.error, TypeError) as exc:
            return [f"{where}: bad regex: {exc}"]
        return []
    # the rest are lists of strings; a command (a plugin's argv too) has at least one
    nonempty = rule == "command"
    if (
        type(value) is not list
        or not all(type(v) is str and v for v in value)
        or (nonempty and not value)
    ):
        return [f"{where}: must be a {'non-empty ' if nonempty else ''}list of non-empty strings"]
    if rule == "builtins":
        return [
            _unknown(f"{where}: unknown tool {name!r}", name, BUILTINS)
            for name in value
            if name not in BUILTINS
        ] + ([f"{where}: a tool is listed twice"] if len(set(value)) < len(value) else [])
    if rule == "globs":
        return [
            f"{where}: {g!r} is not a glob of repository paths"
            for g in value
            if "\x00" in g or ".." in g.split("/")
        ]
    if rule == "paths":
        return [
            f"{where}: {p!r} is not an absolute path that exists"
            for p in value
            if not (os.path.isabs(p) and os.path.exists(p))
        ]
    if rule == "tripwires" and value != ["*"] and not set(value) <= set(TRIPWIRES):
        return [f"{where}: names from {', '.join(TRIPWIRES)}, or [\"*\"] for all"]
    return []


def _plugin_problems(where, name, spec):
    """What the shape does not say of a plugin: its name, and the placeholders of its argv."""
    problems = (
        [f"{where}: {name!r} is a built-in; give the plugin another name"]
        if name in BUILTINS
        else []
    )
    argv, declared = spec.get("argv"), spec.get("args")
    if (
        type(argv) is not list
        or not all(type(part) is str for part in argv)
        or type(declared) is not dict
    ):
        return problems
    used = set()
    for i, part in enumerate(argv):
        names = _PLACEHOLDER_RE.findall(part)
        used.update(names)
        if i == 0 and names:
            problems.append(f"{where}.argv[0]: the program is fixed; it cannot be a placeholder")
        if re.search("[{}]", _PLACEHOLDER_RE.sub("", part)):
            problems.append(f"{where}.argv[{i}]: a brace that is not a {{placeholder}}")
        problems += [
            f"{where}.argv[{i}]: {{{p}}} is not declared in args"
            for p in names
            if p not in declared
        ]
    return problems + [
        f"{where}.args.{arg}: declared but not used in argv" for arg in declared if arg not in used
    ]


def _no_duplicate_keys(pairs):
    found = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"duplicate key {key!r}")
        found[key] = value
    return found


def load_policy(path):
    """Read and validate a tools.json. Raises PolicyError with every problem; OSError when
    unreadable."""
    with open(path, "rb") as handle:
        raw = handle.read(MAX_TOOLS_FILE + 1)
    if len(raw) > MAX_TOOLS_FILE:
        raise PolicyError(path, [f"larger than {MAX_TOOLS_FILE} bytes"])
    return policy_from_text(raw, path)


def policy_from_text(raw, source):
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError as exc:
        raise PolicyError(source, [f"not UTF-8 (byte {exc.start})"]) from None
    except (ValueError, RecursionError) as exc:
        raise PolicyError(source, [f"not valid JSON: {exc}"]) from None
    problems = _problems(data)
    if problems:
        raise PolicyError(source, problems)
    return Policy(data, text, source)


# == Policy: checking a proposed action ========================================

# each built-in's arguments and their kinds; a name ending in "!" is required, as in _SCHEMA
_BUILTIN_ARGS = {
    "read_file": {"path!": "path", "start_line": "int", "end_line": "int"},
    "list_files": {"path": "path"},
    "grep": {"pattern!": "pattern", "path": "path"},
    "git_diff": {},
    "git_log": {"n": "int"},
    "run_tests": {},
    "propose_patch": {"patch!": "patch", "rationale": "text", "alternatives": "texts"}
}
_TEXT_LIMITS = {"text": MAX_TEXT_ARG_CHARS, "pattern": MAX_GREP_PATTERN, "patch": MAX_PATCH_BYTES}


# The policy's answer for one action, with how each path resolved (so replay decides the same way).
Verdict = collections.namedtuple("Verdict", "allowed rule reason paths")


class _Deny(Exception):
    def __init__(self, rule, reason):
        super().__init__(reason)
        self.rule, self.reason = rule, reason


def check_path(path, policy, resolve, paths, what="path"):
    """Check one repository path; record its resolution in `paths`. Raises _Deny."""
    if type(path) is not str or not path:
        raise _Deny("args.type", f"{what} must be a non-empty string")
    if "\x00" in path:
        raise _Deny("path.nul", f"{what} contains a NUL byte")
    _check_option(what, path, MAX_PATH_CHARS)
    if re.match(r"[/~\\]|[A-Za-z]:[\\/]", path):
        raise _Deny(
            "path.absolute",
            f"{what} {path!r} is absolute; paths are relative to the repository root"
        )
    if ".." in re.split(r"[/\\]", path):
        raise _Deny(
            "path.dotdot", f"{what} {path!r} climbs with '..'; paths stay inside the repository"
        )
    norm = posixpath.normpath(path.replace("\\", "/"))
    glob = policy.denied_by(norm)
    if glob:
        raise _Deny("path.denied", f"{what} {path!r} matches the deny glob {glob!r}")
    resolved = paths.setdefault(path, resolve(norm))
    if resolved is None:
        raise _Deny("path.escape", f"{what} {path!r} resolves outside the repository (a symlink?)")
    glob = policy.denied_by(resolved)
    if glob:
        raise _Deny(
            "path.denied",
            f"{what} {path!r} resolves to {resolved!r}, which matches the deny glob {glob!r}"
        )
    if norm != "." and not any(regex.match(norm) for regex in policy.allow):
        raise _Deny("path.not_allowed", f"{what} {path!r} matches no allow glob")
    return norm


def _check_option(name, value, limit):
    if len(value) > limit:
        raise _Deny("arg.too_long", f"{name} is longer than {limit} characters")
    if value.startswith("-"):
        raise _Deny(
            "arg.option",
            f"{name} {value!r} starts with '-', which a program would read as an option"
        )


def patch_files(patch):
    """The repository paths a unified diff touches, and its problems (binary, symlink or submodule
    modes)."""
    files, problems = [], []
    for line in patch.splitlines():
        if line.startswith(("--- ", "+++ ")):
            files.append(_diff_path(line[4:]))
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            files.append(_diff_path(line.split(" ", 2)[2], prefixed=False))
        elif line.startswith("diff --git ") and " b/" in line[11:]:
            old, new = line[11:].split(" b/", 1)
            files += [_diff_path(old), _diff_path("b/" + new)]
        elif re.match(r"GIT binary patch|Binary files (.* )?differ", line):
            problems.append(
                ("patch.binary", "the patch changes a binary file; propose text changes only")
            )
        elif re.match(
            r"(new file |new |old |deleted file )?mode\s+\+?0*1[26]0000|index \S+ 0*1[26]0000", line
        ):
            problems.append(("patch.mode", "the patch creates a symlink or a submodule"))
    return [name for name in dict.fromkeys(files) if name is not None], problems


def diff_section_files(section):
    """Every path one section of git's output names; empty when none can be read (then it is left
    out)."""
    files, header = patch_files(section)[0], section.split("\n", 1)[0]
    match = re.match(r"diff --(?:cc|combined) (.+)", header)
    if match:
        files.append(_diff_path(match[1], prefixed=False))
    elif not header.startswith("diff --git "):
        return []
    return [f for f in files if f]


def _diff_path(text, prefixed=True):
    text = text.split("\t")[0].rstrip("\r")
    # diff -u's timestamp
    text = re.sub(r" +[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:.]+( [+-][0-9]{4})?\Z", "", text)
    # C-quoted, octal escapes of UTF-8 bytes
    if len(text) > 1 and text[0] == text[-1] == '"':
        raw = (
            text[1:-1]
            .encode("latin-1", "backslashreplace")
            .decode("unicode_escape")
            .encode("latin-1", "replace")
        )
        text = raw.decode("utf-8", "replace")
    if text == "/dev/null":
        return None
    return text[2:] if prefixed and text[:2] in ("a/", "b/") else text


def check_action(action, policy, resolve):
    """Decide an action {tool, args}; pure given `resolve` (path -> resolved path, None outside). A
    Verdict."""
    paths, tool, args = {}, action["tool"], action["args"]

    def check(path, what):
        return check_path(path, policy, resolve, paths, what)

    try:
        if tool not in policy.builtins and tool not in policy.plugins:
            what = (
                "a built-in that this tools.json does not enable"
                if tool in BUILTINS
                else "not a tool this host offers"
            )
            raise _Deny("tool.unknown", f"{tool!r} is {what}")
        plugin = policy.plugins.get(tool)
        spec = {f"{name}!": "plugin" for name in plugin.args} if plugin else _BUILTIN_ARGS[tool]
        takes = [key.rstrip("!") for key in spec]
        for name in args:
            if name not in takes:
                raise _Deny(
                    "args.unknown",
                    f"{tool} takes no argument {name!r} (it takes: {', '.join(takes) or 'none'})"
                )
        for key, kind in spec.items():
            name = key.rstrip("!")
            # a plugin's null is a wrong type
            if args.get(name) is not None or (plugin and name in args):
                _check_arg(name, args[name], kind, plugin, check)
            elif key != name:
                raise _Deny("args.missing", f"{tool} needs the argument {name!r}")
        if plugin:
            return Verdict(
                True,
                f"plugin.{tool}",
                f"plugin {tool} with arguments that match their patterns",
                paths
            )
        _check_builtin(tool, args, check)
    except _Deny as deny:
        return Verdict(False, deny.rule, deny.reason, paths)
    return Verdict(True, f"builtin.{tool}", f"{tool} is enabled and every path is allowed", paths)


def _check_arg(name, value, kind, plugin, check):
    """One argument, held to its kind; `check(path, what)` holds a path to the path rules."""
    if kind == "path":
        check(value, name)
    elif kind == "int":
        if type(value) is not int or not 1 <= value <= 10**7:
            raise _Deny("args.type", f"{name} must be a positive integer")
    elif kind == "texts":
        if (
            type(value) is not list
            or len(value) > 20
            or not all(type(v) is str and len(v) <= MAX_TEXT_ARG_CHARS for v in value)
        ):
            raise _Deny("args.type", f"{name} must be a list of at most 20 strings")
    else:  # text, pattern, patch, plugin
        if type(value) is not str:
            raise _Deny("args.type", f"{name} must be a string")
        if kind != "plugin" and len(value.encode("utf-8", "surrogatepass")) > _TEXT_LIMITS[kind]:
            raise _Deny("arg.too_long", f"{name} is longer than {_TEXT_LIMITS[kind]} bytes")
        if "\x00" in value:
            raise _Deny("arg.nul", f"{name} contains a NUL byte")
    if kind == "plugin":
        pattern, is_path = plugin.args[name]
        _check_option(name, value, MAX_PLUGIN_ARG_CHARS)
        if not pattern.fullmatch(value):
            raise _Deny("arg.pattern", f"{name} {value!r} does not match {pattern.pattern!r}")
        if is_path:
            check(value, name)


# what holds between its arguments, and in a patch
def _check_builtin(tool, args, check):
    start, end = args.get("start_line"), args.get("end_line")
    if tool == "read_file" and start and end and end < start:
        raise _Deny("args.type", "end_line is before start_line")
    if tool == "grep":
        try:
            re.compile(args["pattern"])
        except (re.error, RecursionError) as exc:
            raise _Deny("args.type", f"pattern is not a regular expression: {exc}") from None
    if tool == "propose_patch":
        files, problems = patch_files(args["patch"])
        if problems:
            raise _Deny(*problems[0])
        if not files:
            raise _Deny(
                "patch.no_files",
                "the patch names no file: send a unified diff (--- a/PATH, +++ b/PATH, "
                "@@ hunks)"
            )
        for name in files:
            check(name, "a file in the patch,")


# == The repository: read-only git, snapshots, secrets =========================


def _git_env(**extra):
    return {**_child_env(), **GIT_ENV, **extra}


def git(repo, *args, input=None, check=True, timeout=120, env=None):
    """A git command in `repo`, read-only unless `env` says otherwise (no optional locks). Its
    stdout bytes."""
    proc = subprocess.run(
        ["git", "-c", "core.fsmonitor=false", "-c", "core.quotepath=false", "-C", repo, *args],
        input=input,
        capture_output=True,
        env=env or _git_env(),
        timeout=timeout
    )
    if check and proc.returncode:
        raise RepoError(
            f"git {args[0]} in {repo}: {proc.stderr.decode('utf-8', 'replace').strip()[:300]}"
        )
    return proc.stdout


def repo_root(path):
    """The top of the git work tree holding `path`, resolved."""
    if not Path(path).is_dir():
        raise RepoError(f"--repo {path}: not a directory")
    return Path(os.fsdecode(git(path, "rev-parse", "--show-toplevel").strip())).resolve()


def resolve_ref(repo, ref):
    """The full commit id of REV, or HEAD's (None for a repository without commits)."""
    spec = f"{ref or 'HEAD'}^{{commit}}"
    commit = git(repo, "rev-parse", "--verify", "--quiet", spec, check=False, timeout=60).strip()
    if not commit and ref:
        raise RepoError(f"--ref {ref}: not a commit in {repo}")
    return commit.decode() or None


def snapshot(repo, ref, dest):
    """Copy the tree at `ref` (or the working tree as it is) into `dest`, a git repo of its own; its
    digest."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    links = []  # made last, so nothing is ever written through one
    for rel, executable, target, content in (
        _ref_entries(repo, ref) if ref else _worktree_entries(repo)
    ):
        if target is not None:
            links.append((rel, target))
            continue
        fd = _create(dest, rel, executable)
        if fd is not None:
            with os.fdopen(fd, "wb") as writer:
                writer.write(content)
    for rel, target in links:
        _create(dest, rel, link=target)
    digest = tree_digest(dest)
    env = _scratch_git_env(dest.parent)
    for args in (
        "init -q",
        "add -A -f",
        "-c commit.gpgsign=false -c core.hooksPath=/dev/null commit -q --no-verify --allow-empty"
        " -m baseline"
    ):
        git(dest, *args.split(), env=env, timeout=300)
    return digest


def _scratch_git_env(ceiling):
    """git in a scratch copy: no walking up, no user or system config (no filter, hook), fixed
    identity."""
    return _git_env(
        GIT_CEILING_DIRECTORIES=str(ceiling),
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_AUTHOR_NAME="agent.py",
        GIT_AUTHOR_EMAIL="agent@localhost",
        GIT_COMMITTER_NAME="agent.py",
        GIT_COMMITTER_EMAIL="agent@localhost",
        GIT_AUTHOR_DATE="2000-01-01T00:00:00Z",
        GIT_COMMITTER_DATE="2000-01-01T00:00:00Z"
    )


def _worktree_entries(repo):
    """(path, executable, link target, content) of the files as on disk, none under a symlinked dir
    (outside), nor through a `..` (_create refuses a `.git` entry)."""
    listing = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    real = os.path.realpath(repo)
    for rel in sorted({os.fsdecode(raw) for raw in listing.split(b"\0") if raw}):
        path = os.path.join(repo, rel)
        if os.path.realpath(os.path.dirname(path)) != os.path.dirname(os.path.join(real, rel)):
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue  # deleted in the working tree: as the user has it
        if stat.S_ISLNK(mode):
            yield rel, False, os.readlink(path), None
        elif stat.S_ISREG(mode):
            content = _read_plain_file(path)[0]
            if content is not None:  # else gone, or replaced by a symlink, since it was listed
                yield rel, mode & 0o111, None, content


def _tree_blobs(repo, rev, check=True):
    """(mode, sha, path) of every blob in commit `rev`."""
    records = git(repo, "ls-tree", "-r", "-z", rev, check=check).split(b"\0")
    for meta, path in (record.split(b"\t", 1) for record in records if b"\t" in record):
        mode, kind, sha = meta.decode().split()
        if kind == "blob":
            yield mode, sha, os.fsdecode(path)


def _ref_entries(repo, ref):
    """(path, executable, link target, content) of every blob in commit `ref`, from git's
    objects."""
    entries = list(_tree_blobs(repo, ref))  # _create refuses an unsafe name
    batch = subprocess.Popen(
        ["git", "-C", repo, "cat-file", "--batch"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_git_env()
    )
    shas = "".join(sha + "\n" for _mode, sha, _name in entries).encode()
    feeder = threading.Thread(target=_feed_stdin, args=(batch.stdin, shas), daemon=True)
    feeder.start()
    try:
        for mode, sha, name in entries:
            header = batch.stdout.readline().split()
            if len(header) != 3:
                raise RepoError(
                    f"{ref}: git cannot read object {sha} (a shallow or damaged repository)"
                )
            content = batch.stdout.read(int(header[2]) + 1)[:-1]  # and the newline after it
            link = os.fsdecode(content) if mode == "120000" else None
            yield name, mode == "100755", link, content
    finally:
        feeder.join()
        batch.stdout.close()
        batch.wait()


# a file created here, never one that was there, nor through a symlink
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _safe_rel(rel):
    """A path git would check out: no `..`, no `.git` in any case (`.GIT` is `.git` on a
    case-insensitive disk)."""
    # "" and "/x" have an empty part
    return not any(part in ("", ".", "..") or part.lower() == ".git" for part in rel.split("/"))


def _create(dest, rel, executable=False, link=None):
    """Open dest/rel to write (an fd) or make it a symlink to `link`; None, not through a symlink
    nor over a path."""
    if not _safe_rel(rel):
        return None
    parent = dest
    for part in rel.split("/")[:-1]:
        parent = os.path.join(parent, part)
        try:
            os.mkdir(parent, 0o755)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(parent).st_mode):
                return None
    path = os.path.join(dest, rel)
    try:
        if link is not None:
            return os.symlink(link, path)
        return os.open(path, _NEW_FILE, 0o755 if executable else 0o644)
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        return None


def tree_digest(root):
    """SHA-256 over the sorted (path, kind, mode, content digest) of every file under `root` but
    .git."""
    digest = hashlib.sha256()
    for path in sorted(_walk_files(root)):
        full = os.path.join(root, path)
        info = os.lstat(full)
        if stat.S_ISLNK(info.st_mode):
            entry = f"link {path} {os.readlink(full)}"
        else:
            content = hashlib.sha256()
            with open(full, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    content.update(chunk)
            entry = f"file {path} {'x' if info.st_mode & 0o111 else '-'} {content.hexdigest()}"
        digest.update(entry.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


def _walk_files(root):
    for base, dirs, files in os.walk(root):
        rel_base = os.path.relpath(base, root)
        if rel_base == ".":
            dirs[:] = [d for d in dirs if d != ".git"]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
            yield posixpath.normpath(posixpath.join(rel_base, name))  # POSIX only, as fcntl is


def repo_secrets(repo, commit=None):
    """The values of the repo's .env* files, and of those in `commit` and its parents, to mask
    everywhere."""
    # every .env* file, and every file under a .env* directory, in any case
    listing = git(
        repo,
        "ls-files",
        "-z",
        "--cached",
        "--others",
        "--",
        ":(glob,icase)**/.env*",
        ":(glob,icase)**/.env*/**",
        check=False
    )
    texts = [
        _read_plain_file(Path(repo) / os.fsdecode(raw), 256 * 1024, 0)[0]
        for raw in list(dict.fromkeys(listing.split(b"\0")))[:200]
        if raw
    ]
    commits = (
        git(repo, "rev-list", "--no-walk", commit, f"{commit}^@", check=False) if commit else b""
    )
    # ls-tree takes no pathspec magic: every path, each component looked at
    for rev in commits.decode().split()[:16]:
        blobs = [
            sha
            for _mode, sha, path in _tree_blobs(repo, rev, check=False)
            if re.search(r"(?i)(^|/)\.env", path)
        ]
        texts += [_blob(repo, sha)[: 256 * 1024] for sha in blobs[:200]]
    values = (v for text in texts for v in dotenv_values((text or b"").decode("utf-8", "replace")))
    return list(dict.fromkeys(values))


# KEY=, then the value:
_ENV_RE = re.compile(
    r"^[ \t]*(?:export[ \t]+)?[A-Za-z_][A-Za-z0-9_.-]*[ \t]*[=:][ \t]*"
    # double-quoted (to the end when not closed),
    r'(?:"((?:\\[\s\S]|[^"\\])*\\?)(?:"|\Z)'
    r"|'((?:\\[\s\S]|[^'\\])*\\?)(?:'|\Z)"  # single-quoted,
    r"|([^\n]*))",
    re.M
)  # or bare
_ENV_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}


def dotenv_values(text):
    """Every value a .env file sets, as dotenv reads it; each raw and decoded, since either may be
    printed."""
    values = []
    for match in _ENV_RE.finditer(text.lstrip("\ufeff")):
        double, single, bare = match.groups()
        # unquoted: `a#b` is one value, ` # note` a comment; both readings are masked
        if bare is not None:
            values += [bare, re.split(r"\s#", bare.strip(), maxsplit=1)[0]]
            continue
        raw = double if double is not None else single
        decoded = re.sub(
            r"\\(.)",
            lambda m: (
                _ENV_ESCAPES.get(m[1], m[1])
                if double is not None
                else m[1] if m[1] in "\\'" else m[0]
            ),
            raw,
            flags=re.S
        )
        values += [raw, decoded] + [
            line.strip() for line in decoded.splitlines() if len(line.strip()) >= 8
        ]
    return [value.strip() for value in values if value.strip()]


_NOT_PLAIN = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def _read_plain_file(path, limit=None, flags=os.O_NOFOLLOW):
    """(up to `limit` bytes (None: all) of a regular file, why not all of it) or (None, what the
    path is instead; None when missing). It never blocks on a FIFO, reads a device or, by default,
    follows a symlink: the one way to read what a box may have left."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    except OSError as exc:  # a socket cannot be opened, nor a symlink under O_NOFOLLOW
        why = {errno.ELOOP: "a symlink", errno.ENXIO: "a socket", errno.ENOENT: None}
        return None, why.get(exc.errno, exc.strerror)
    with os.fdopen(fd, "rb") as handle:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            return None, _NOT_PLAIN.get(kind, "a device")
        data = handle.read(-1 if limit is None else limit + 1)
    return data[:limit], f"over {limit} bytes" if len(data) > (limit or len(data)) else None


# == Processes: argv only, a timeout, the whole process group killed, output capped ==

_SETTINGS = rl.SECRET_ENV_VARS + ("BASE_URL", "OPENAI_BASE_URL", "MODEL_ID", "LEDGER_SHIP_URL")
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")  # empty and private in the box
_RLIMITS = {
    "RLIMIT_CPU": "cpu_s",
    "RLIMIT_AS": "address_space_bytes",
    "RLIMIT_FSIZE": "file_size_bytes",
    "RLIMIT_NOFILE": "open_files",
    "RLIMIT_NPROC": "processes",
    "RLIMIT_CORE": None
}
_TAIL_BYTES = 65536  # kept from the end of a program's output, beside its first MAX_ARTIFACT_BYTES
_CHILDREN = set()  # process groups running now, killed when the run is terminated
_REAPING = False  # this process is a child subreaper: run_program kills what a program left behind


def _child_env():
    """Every program's environment: none of our settings, nothing named like a secret (the model's
    code)."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in _SETTINGS and not rl.is_secret_env_name(name)
    }


def _subreaper():
    """Become a child subreaper (Linux): what a program detaches comes back to us, so it can be
    killed."""
    global _REAPING
    _REAPING = _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


class SandboxError(rl.UsageError):
    """ "sandbox": "required" and bwrap does not work on this box."""


# What the box reads of the host besides the interpreter: the system trees (a link stays a link)
# and the /etc entries programs read (the loader, users and names, time, certificates, Python,
# locales)
_SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = (
    "ld.so.cache ld.so.conf ld.so.conf.d passwd group hosts host.conf nsswitch.conf resolv.conf"
    " gai.conf localtime timezone ssl ca-certificates ca-certificates.conf alternatives python3*"
    " locale.alias locale.conf default/locale mime.types protocols services"
).split()


class Sandbox:
    """How a run's programs are boxed ("bwrap", or "none" and why), what is never in the box, what
    tools.json adds to read, and the rlimits."""

    def __init__(self, kind, reason, hide, policy):
        self.kind, self.reason, self.hide, self.caps = kind, reason, hide, policy.caps
        self.bwrap = shutil.which("bwrap") if kind == "bwrap" else None
        self.reads = [os.path.realpath(p) for p in policy.read_paths]
        for path in self.reads:
            if any(_under(path, h) or _under(h, path) for h in hide):
                raise rl.UsageError(
                    f"tools.json: sandbox.read_paths: {path} is in or above the repository, "
                    "runs or lock directory or a *_FILE setting's file"
                )

    def record(self):
        return {
            "sandbox": self.kind,
            **({"sandbox_reason": self.reason} if self.kind == "none" else {})
        }

    def limit(self):
        """preexec_fn: the rlimits, in the child before it runs the program (never above the hard
        limit)."""
        import resource

        for name, key in _RLIMITS.items():
            which = getattr(resource, name)
            hard = resource.getrlimit(which)[1]
            value = self.caps.get(key, 0)  # no core dumps
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (value, value))

    def wrap(self, program, argv, cwd, env, writable=()):
        """bwrap's argv: no network, own pids, reads only what programs need (an allow-list), only
        cwd and `writable` written."""
        args = [self.bwrap] + (
            "--die-with-parent --new-session --unshare-all --cap-drop ALL --proc /proc --dev /dev"
        ).split()
        for path in filter(os.path.lexists, _SYSTEM_TREES):
            link = os.path.islink(path)
            args += ["--symlink", os.readlink(path), path] if link else ["--ro-bind", path, path]
        args += [arg for path in _PRIVATE_DIRS for arg in ("--tmpfs", path)]
        etc = [p for name in _ETC for p in sorted(glob.glob("/etc/" + name)) if os.path.exists(p)]
        never = [*map(os.path.realpath, (cwd, *writable)), *self.hide]
        reads = etc + _program_roots(program, env, never) + self.reads
        args += [arg for path in reads for arg in ("--ro-bind", path, path)]
        # a repository, runs dir or secrets file inside a tree read here
        for path in self.hide:
            if _under(path, *_SYSTEM_TREES, *reads):
                blank = os.path.isdir(path)
                args += ["--tmpfs", path] if blank else ["--ro-bind", "/dev/null", path]
        # after the private /tmp: cwd and `writable` usually live there
        args += [arg for path in (cwd, *writable) for arg in ("--bind", path, path)]
        # a pyenv shim cds to where pyenv was first called, which is absent here
        if "PYENV_DIR" in env:
            args += ["--setenv", "PYENV_DIR", cwd]
        return args + ["--chdir", cwd, "--", program, *argv[1:]]


def _hidden_paths(repo, runs_dir):
    """What a boxed program must never see: the repo, the runs and lock dirs, files settings
    name."""
    hidden = [repo, runs_dir, _lock_dir()]
    hidden += [v for n, v in os.environ.items() if n.endswith("_FILE") and os.path.isfile(v)]
    return list(dict.fromkeys(os.path.realpath(h) for h in hidden if h))


def _program_roots(program, env, never):
    """The interpreter's trees, from the host's view of the program and of python3 on PATH: their
    prefixes, a venv's base, pyenv's root. Nothing in `never` (the scratch copy, the repository)
    chooses one, and none is in or above `never`, $HOME or a private dir."""
    home = os.path.realpath(os.path.expanduser("~"))
    pyenv = os.path.realpath(env.get("PYENV_ROOT") or os.path.join(home, ".pyenv"))
    places = []
    for exe in (program, shutil.which("python3", path=env.get("PATH", os.defpath))):
        real = os.path.realpath(exe or "/")
        if not exe or _under(real, *never) or _under(os.path.abspath(exe), *never):
            continue
        prefix = os.path.dirname(os.path.dirname(os.path.abspath(exe)))
        places += [prefix, os.path.dirname(os.path.dirname(real))]
        places += [pyenv] if _under(real, pyenv) else []
        cfg = os.path.join(prefix, "pyvenv.cfg")
        if os.path.isfile(cfg) and not _under(os.path.realpath(cfg), *never):
            # a venv: its `home = DIR` line names the base interpreter's bin/
            text = Path(cfg).read_text("utf-8", "replace")
            lines = re.findall(r"(?m)^[ \t]*home[ \t]*=(.*)", text)
            places += [os.path.dirname(line.strip()) for line in lines]
    roots = []
    for place in sorted(set(map(os.path.realpath, places)), key=len):  # the widest first
        if (
            os.path.isdir(place)
            and not _under(place, *_SYSTEM_TREES, *roots, *never)
            and not any(_under(p, place) for p in (home, *never, *_PRIVATE_DIRS))
        ):
            roots.append(place)
    return roots


def _under(path, *bases):
    return any(path == b or path.startswith(b.rstrip(os.sep) + os.sep) for b in bases)


def probe_sandbox(policy, hide):
    """Once per run: does bwrap box a trivial command here? A Sandbox, kind "none" and why when
    not."""
    box = Sandbox("bwrap", None, hide, policy)
    reason = _unboxed_because(policy, box)
    return Sandbox("none", reason, hide, policy) if reason else box


def _unboxed_because(policy, box):
    """Why `box` cannot be used here, or None when bwrap boxes `true`."""
    true = shutil.which("true")
    if policy.sandbox == "off":
        return 'tools.json sets "sandbox": "off"'
    if not box.bwrap or not true:
        return "bwrap is not installed (the Debian package bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="agent-probe-") as cwd:
        try:
            proc = subprocess.run(
                box.wrap(true, [true], cwd, _child_env()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap does not work here: {rl.error_text(exc)}"
    if proc.returncode:
        output = proc.stdout.decode("utf-8", "replace").strip()[:300]
        return f"bwrap does not work here (exit {proc.returncode}: {output})"


def require_box(box, policy):
    """Raise SandboxError when tools.json requires bwrap and the probe found none."""
    if box.kind == "none" and policy.sandbox == "required":
        raise SandboxError(
            f'tools.json sets "sandbox": "required" but {box.reason}; install bubblewrap (apt-get '
            'install bubblewrap) where user namespaces work, or set "sandbox": "auto" in '
            "tools.json"
        )


def _children():
    found = set()
    for path in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError):  # the thread ended
            found.update(map(int, path.read_text().split()))
    return found


def _kill_strays(known):
    """Kill and reap every child not in `known` until none is left (a stray's children come back in
    turn)."""
    for _round in range(1000):
        strays = _children() - known
        if not strays:
            return
        for pid in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in strays:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


class Output(
    collections.namedtuple(
        "Output",
        "returncode head tail size duration_ms timed_out error errno sandbox",
        defaults=(False, None, None, None)
    )
):
    """A program's result: its exit code and output, capped (head and tail kept), with what was cut.
    `sandbox`: a boxed program's record, {"sandbox": "bwrap"} or "none" with its reason."""

    def text(self, cap):
        """Head and tail within `cap` bytes, saying how much was cut."""
        data = self.head + self.tail
        if self.size <= cap and len(data) == self.size:
            return data.decode("utf-8", "replace")
        half = cap // 2
        return (
            self.head[:half].decode("utf-8", "replace")
            + f"\n[... {self.size - 2 * half:,} bytes cut ...]\n"
            + data[-half:].decode("utf-8", "replace")
        )

    def artifact_bytes(self):
        cut = self.size - len(self.head) - len(self.tail)
        return (
            self.head
            + (f"\n[... {cut:,} bytes not kept ...]\n".encode() if cut > 0 else b"")
            + self.tail
        )


def _ms(started):
    return round((time.monotonic() - started) * 1000, 1)


def run_program(argv, cwd, timeout, env=None, input=None, box=None, writable=()):
    """Run argv (no shell) in its own group, boxed, killed on timeout with what it left; output
    capped."""
    started = time.monotonic()
    env = _child_env() if env is None else env
    known = _children() if _REAPING else set()
    record = box and box.record()
    try:
        proc = subprocess.Popen(  # close_fds: the default
            _boxed(argv, cwd, env, box, writable),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=box and box.limit
        )
    except OSError as exc:
        error = rl.error_text(exc)
        head = f"cannot run {argv[0]}: {error}".encode()
        return Output(None, head, b"", 0, _ms(started), False, error, exc.errno, record)
    _CHILDREN.add(proc.pid)
    if input is not None:
        threading.Thread(target=_feed_stdin, args=(proc.stdin, input), daemon=True).start()
    held = {"head": bytearray(), "tail": bytearray(), "size": 0}
    try:
        timed_out = _read_until_exit(proc, started + timeout, held)
    finally:
        _kill_group(proc.pid)  # on a timeout, and any background child left holding the output open
        proc.wait()
        os.set_blocking(proc.stdout.fileno(), False)
        with contextlib.suppress(OSError):  # what is still in the pipe once the group is gone
            for chunk in iter(lambda: os.read(proc.stdout.fileno(), 65536), b""):
                _keep(held, chunk)
        proc.stdout.close()
        _CHILDREN.discard(proc.pid)
        if _REAPING:
            _kill_strays(known)
    code = None if timed_out else proc.returncode
    head, tail = bytes(held["head"]), bytes(held["tail"])
    return Output(code, head, tail, held["size"], _ms(started), timed_out, sandbox=record)


def _boxed(argv, cwd, env, box, writable):
    """argv as run: in bwrap when the box has it, the program resolved first so a missing one fails
    as unboxed."""
    if not box or box.kind != "bwrap":
        return argv
    program = (
        os.path.join(cwd, argv[0])
        if "/" in argv[0]
        else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    )
    missing = not program or not os.path.exists(program)
    if missing or os.path.isdir(program) or not os.access(program, os.X_OK):
        code = errno.ENOENT if missing else errno.EACCES  # OSError makes it FileNotFoundError, ...
        raise OSError(code, os.strerror(code), argv[0])
    return box.wrap(program, argv, cwd, env, writable)


def _read_until_exit(proc, deadline, held):
    """Read output until the program exits (a child of it may still hold the pipe) or the deadline
    (True)."""
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            if selector.select(min(remaining, 0.05)):
                chunk = os.read(fd, 65536)
                _keep(held, chunk)
                if not chunk:  # EOF: only the exit is left to wait for, up to the deadline
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(remaining)
    return False


def _keep(held, chunk):
    """The first MAX_ARTIFACT_BYTES and the last _TAIL_BYTES of a program's output, and its size."""
    held["size"] += len(chunk)
    room = max(MAX_ARTIFACT_BYTES - len(held["head"]), 0)
    held["head"] += chunk[:room]
    held["tail"] += chunk[room:]
    del held["tail"][:-_TAIL_BYTES]


def _feed_stdin(stream, data):
    with contextlib.suppress(OSError):
        stream.write(data)
        stream.close()


def _kill_group(pgid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# == Tools =====================================================================

GREP_SCRIPT = r"""
import re, sys
pattern, limit, found = re.compile(sys.argv[1]), 500, 0
for rel in filter(None, sys.stdin.read().split("\0")):
    try:
        with open(rel, "rb") as handle:
            data = handle.read(2 * 1024 * 1024)
    except OSError:
        continue
    text = data.decode("utf-8", "replace") if b"\0" not in data[:8192] else ""
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.search(line):
            print(f"{rel}:{number}: {line[:300]}")
            found += 1
            if found >= limit:
                print(f"[stopped after {limit} matches]")
                sys.exit(0)
sys.exit(0 if found else 1)
"""


class Workspace:
    """The host's scratch copy of the repository, and the tools that run there."""

    def __init__(self, repo, ref, root, policy, box):
        # box: every program run here, its rlimits, and its bwrap when it works
        self.repo, self.ref, self.root, self.policy, self.box = repo, ref, Path(root), policy, box

    def resolve(self, rel):
        root = os.path.realpath(self.root)
        real = os.path.realpath(os.path.join(root, rel))
        return os.path.relpath(real, root) if _under(real, root) else None

    def run_tests(self):
        """The tests in the box, which may write out/ beside the copy (JUnit XML) and nothing else
        of the host's: (Output, pytest's per-test outcomes or None, why they are None)."""
        argv, out, junit = list(self.policy.test_command), self.root.parent / "out", None
        out.mkdir(exist_ok=True)
        if _is_pytest(argv):
            junit = out / f"junit-{time.monotonic_ns()}.xml"
            argv += [f"--junitxml={junit}", "-p", "no:cacheprovider"]
        output = run_program(
            argv, self.root, self.policy.test_timeout_s, box=self.box, writable=[out]
        )
        return (output, *junit_outcomes(junit)) if junit else (output, None, None)

    def execute(self, tool, args):
        """Run an allowed action. Returns an Output."""
        started, timeout = time.monotonic(), self.policy.caps["timeout_s"]
        plugin = self.policy.plugins.get(tool)
        if plugin:
            return run_program(
                plugin.command(args), self.root, plugin.timeout_s or timeout, box=self.box
            )
        if tool == "run_tests":  # as tools.json has it, with no file of results
            return run_program(
                self.policy.test_command, self.root, self.policy.test_timeout_s, box=self.box
            )
        if tool == "grep":
            files = self._files(args.get("path") or ".")
            if not files:
                return _text_output(1, "no files to search", started)
            return run_program(
                [sys.executable, "-I", "-c", GREP_SCRIPT, args["pattern"]],
                self.root,
                timeout,
                env=dict(_child_env(), PYTHONIOENCODING="utf-8"),
                box=self.box,
                input="\0".join(files).encode("utf-8", "surrogateescape")
            )
        if tool == "git_diff":
            return _text_output(0, self._git_diff() or "(no changes)", started)
        # git_log, read_file, list_files: (exit code, text)
        return _text_output(*getattr(self, "_" + tool)(args), started)

    def _git_log(self, args):
        log = git(
            self.repo,
            "log",
            f"-n{min(args.get('n') or 10, 50)}",
            "--no-color",
            "--date=short",
            "--format=%h %ad %an: %s",
            self.ref or "HEAD",
            check=False
        )
        return 0, log.decode("utf-8", "replace") or "(no commits)"

    def _list_files(self, args):
        rel = args.get("path") or "."
        if not (self.root / rel).exists():
            return 1, f"{rel}: no such file or directory"
        files = self._files(rel)
        more = f"\n[... {len(files) - 2000} more]" if len(files) > 2000 else ""
        return 0, "\n".join(files[:2000]) + more or "(no files)"

    def _read_file(self, args):
        path = args["path"]
        # a program run in the box may have left a FIFO: the copy's files are read as a box's are
        data, why = _read_plain_file(self.root / path, MAX_ARTIFACT_BYTES, 0)
        if why == "a directory":
            return 1, f"{path} is a directory; use list_files"
        if data is None:
            return 1, f"{path}: {why or os.strerror(errno.ENOENT)}"
        if b"\0" in data[:8192]:
            return 1, f"{path} is a binary file ({len(data)} bytes); not shown"
        lines = data.decode("utf-8", "replace").splitlines()
        last = min(args.get("end_line") or len(lines), len(lines))
        body = "\n".join(
            f"{n:>{len(str(last))}}| {lines[n - 1]}"
            for n in range(args.get("start_line") or 1, last + 1)
        )
        return 0, body if lines else "(empty file)"

    def _files(self, rel):
        """The files under `rel` a tool may open, each held to the path rules by what it resolves
        to."""
        base = self.root / rel
        paths = (
            [rel]
            if base.is_file()
            else (posixpath.normpath(posixpath.join(rel, p)) for p in sorted(_walk_files(base)))
        )
        out = []
        for full in paths:
            try:
                check_path(full, self.policy, self.resolve, {})
            except _Deny:
                continue
            if not os.path.islink(self.root / full) or full == rel:
                out.append(full)
            if len(out) >= 20000:
                break
        return out

    def _git_diff(self):
        """The change under review (uncommitted, or the --ref commit's), less the sections of denied
        files."""
        # no output without a commit: "HEAD --" is a revision or git fails
        command, *rest = ["show", "--format=", self.ref] if self.ref else ["diff", "HEAD", "--"]
        raw = git(
            self.repo, command, "--no-color", "--no-ext-diff", "--no-textconv", *rest, check=False
        )
        # --git, --cc, --combined: every format git writes
        sections = re.split(r"(?m)^(?=diff )", raw.decode("utf-8", "replace"))
        listed = [(section, diff_section_files(section)) for section in sections]
        return "".join(
            s for s, files in listed if files and not any(map(self.policy.denied_by, files))
        )


def _is_pytest(argv):
    return _runner(argv)[0] == "pytest"


def _text_output(code, text, started):
    data = text.encode("utf-8", "replace")
    return Output(code, data, b"", len(data), _ms(started))


def junit_outcomes(path):
    """({test id: passed|failed|error|skipped}, None) from a JUnit XML file; (None, why) when it is
    not a plain file of at most MAX_RESULTS_BYTES; (None, None) when there is none."""
    import xml.etree.ElementTree as ElementTree  # only when pytest ran

    data, why = _read_plain_file(path, MAX_RESULTS_BYTES)
    if why or data is None:
        return None, why and f"the JUnit XML is {why}"
    try:
        tree = ElementTree.fromstring(data)
    except ElementTree.ParseError:
        return None, None
    outcomes = {}
    for case in tree.iter("testcase"):
        kinds = {child.tag for child in case}
        outcomes[f"{case.get('classname', '')}::{case.get('name', '')}"] = (
            "failed"
            if "failure" in kinds
            else "error" if "error" in kinds else "skipped" if "skipped" in kinds else "passed"
        )
    return outcomes, None


# == The action protocol =======================================================


class Malformed(Exception):
    """A reply that is neither a valid action nor a bare unified diff; `reason` goes back to the
    model."""

    reason = property(lambda self: self.args[0])


_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)
_TOOL_DOCS = {
    "read_file": '{"path": "src/x.py", "start_line": 1, "end_line": 200}: a file with line numbers',
    "list_files": '{"path": "src"}: the files under a directory (default: the whole repository)',
    "grep": '{"pattern": "REGEX", "path": "src"}: matching lines, as path:line: text',
    "git_diff": "{}: the change under review (uncommitted changes, or the commit given with --ref)",
    "git_log": '{"n": 10}: recent commits',
    "run_tests": "{}: run the test command and see its output",
    "propose_patch": '{"patch": "UNIFIED DIFF", "rationale": "why this fixes it", '
    '"alternatives": ["what else you considered"]}: your final answer; a human reviews it'
}


def _looks_like_diff(text):
    text = text.lstrip()
    return text.startswith(("diff --git ", "--- ")) and re.search(
        r"(?m)^--- \S.*\n\+\+\+ \S.*\n@@ ", text
    )


def _action(obj):
    if type(obj) is not dict or "tool" not in obj:
        return None
    tool, args, reason = obj["tool"], obj.get("args"), obj.get("reason")
    if type(tool) is not str or not tool or len(tool) > 64:
        raise Malformed('"tool" must be a tool name (a short string)')
    if type(args) is not dict and args is not None:
        raise Malformed('"args" must be a JSON object')
    return {"tool": tool, "args": args or {}, "reason": reason if type(reason) is str else ""}


def parse_reply(text):
    """(action, form): one JSON object, bare, fenced or in prose, or a bare unified diff. Raises
    Malformed."""
    stripped = text.strip()
    if not stripped:
        raise Malformed("the reply is empty")
    fenced = _FENCE_RE.findall(text)
    whole = [(stripped, "json")] + [
        (block.strip(), "fenced_json")
        for lang, block in fenced
        if lang.lower() in ("", "json", "javascript", "js")
    ]
    embedded = [
        (m.start(), "embedded_json") for m in itertools.islice(re.finditer(r"\{", text), 50)
    ]
    decode = json.JSONDecoder().raw_decode
    for candidate, form in whole + embedded:
        try:
            found = decode(text, candidate)[0] if form == "embedded_json" else json.loads(candidate)
            action = _action(found)
        except (ValueError, RecursionError):
            continue
        if action:
            return action, form
    diffs = [block for _lang, block in fenced if _looks_like_diff(block)]
    if len(diffs) == 1 and not text.replace(diffs[0], "").replace("```", "").strip(
        " \n\tdiffpatch"
    ):
        patch, form = diffs[0].strip("\n"), "fenced_diff"
    elif _looks_like_diff(stripped) and not re.search(r"(?m)^```", stripped):
        patch, form = stripped, "diff"
    else:
        raise Malformed(
            'no action found: answer with one JSON object {"tool": NAME, "args": {...}, "reason": '
            'TEXT}, or with a unified diff alone'
        )
    return {"tool": "propose_patch", "args": {"patch": patch + "\n"}, "reason": ""}, form


def system_prompt(policy):
    """What the model is told about the protocol and the tools tools.json enables."""
    lines = [
        "You are a coding agent working through a host. You cannot change files and you cannot run "
        "commands yourself: you ask the host for one action at a time, and it decides whether to "
        "run it. Your goal is one patch that makes the failing tests pass without changing the "
        "tests.",
        "",
        "Answer every turn with exactly one JSON object and nothing else:",
        '{"tool": "NAME", "args": {...}, "reason": "why this step"}',
        "",
        "Tools:"
    ]
    lines += [f"- {tool} {_TOOL_DOCS[tool]}" for tool in BUILTINS if tool in policy.builtins]
    for name, plugin in sorted(policy.plugins.items()):
        args = ", ".join(f'"{a}": "..."' for a in plugin.args)
        lines.append(f"- {name} {{{args}}}: {plugin.description}")
    lines += [
        "",
        "Paths are relative to the repository root. Some paths are off limits (.git, .env files, "
        f"keys) and outputs are cut at {policy.caps['output_bytes']} bytes. A patch is a unified "
        "diff against the files as they are now (--- a/PATH, +++ b/PATH, @@ hunks). You may also "
        "answer with the diff alone."
    ]
    return "\n".join(lines)


def first_prompt(tests_output, diff, budget_line):
    code = "timeout" if tests_output.timed_out else tests_output.returncode
    return (
        f"The tests fail (exit {code}). Their output, cut to the end that matters:\n\n"
        f"{tests_output.text(6000)}\n\nThe change under review (git diff):\n\n"
        f"{diff[:6000] or '(no uncommitted changes)'}\n\n{budget_line}\nPropose the next action. "
        "If you can already fix it, answer with propose_patch."
    )


# == The host loop, shared by a live run and by replay =========================


class _Exit(Exception):
    """The loop ends: its outcome, the payload of the event of that kind that says why (none for a
    proposal, or when a replay runs out of replies), and the accepted patch check of a proposal."""

    def __init__(self, outcome, payload=None, check=None):
        super().__init__(outcome)
        self.outcome, self.payload, self.check = outcome, payload, check


class Budget:
    """What the run has spent: steps, model calls, tokens (reported or estimated, and which), wall
    time."""

    def __init__(self, limits):
        self.limits, self.sources = limits, set()
        self.steps = self.model_calls = self.tokens = 0

    def add(self, call):
        self.model_calls += call["attempts"]
        self.tokens += call["tokens"]
        self.sources.add(call["tokens_source"])

    def snapshot(self, elapsed):
        return {
            "steps": self.steps,
            "model_calls": self.model_calls,
            "tokens": self.tokens,
            "tokens_source": _source(self.sources),
            "elapsed_s": round(elapsed, 3)
        }

    def exhausted(self, elapsed):
        used = {
            "max_steps": self.steps,
            "max_model_calls": self.model_calls,
            "max_total_tokens": self.tokens,
            "max_wall_s": elapsed
        }
        return next(((name, n) for name, n in used.items() if n >= self.limits[name]), None)

    def over(self, limit, used, elapsed, **during):
        """The _Exit of a spent budget: the limit, how much was used, what was spent."""
        return _Exit(
            "budget_exhausted",
            {
                "limit": limit,
                "used": used,
                "max": self.limits[limit],
                "budget": self.snapshot(elapsed),
                **during
            }
        )

    def line(self, elapsed):
        limits = self.limits
        return (
            f"Budget left: {limits['max_steps'] - self.steps} steps, "
            f"{limits['max_model_calls'] - self.model_calls} model calls, "
            f"{max(0, limits['max_total_tokens'] - self.tokens):,} tokens, "
            f"{max(0.0, limits['max_wall_s'] - elapsed):.0f} seconds."
        )


def _source(sources):
    return (
        "reported"
        if sources == {"reported"}
        else "estimated" if sources <= {"estimated"} else "mixed"
    )


def _excerpt(text, limit=EXCERPT_BYTES):
    data = text.encode("utf-8", "replace")
    return text if len(data) <= limit else "[...] " + data[-limit:].decode("utf-8", "ignore")


def _sha256_hex(data):
    """SHA-256 of bytes, or of a text's UTF-8 (a lone surrogate kept as it is)."""
    if type(data) is str:
        data = data.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def _chars(messages):
    return sum(len(m["content"]) for m in messages)


def _fit(messages, limit):
    """Keep the conversation within `limit` chars: shorten old outputs, drop old exchanges, cut the
    longest."""
    size = before = _chars(messages)
    shortened = dropped = cut_short = 0
    for message in messages[2:-2]:
        text = message["content"]
        if size <= limit:
            break
        if message["role"] == "user" and len(text) > 400:
            cut = len(text) - 300
            message["content"] = (
                text[:300] + f"\n[... {cut:,} characters of this old output shortened]"
            )
            size -= cut - 60
            shortened += 1
    while size > limit and len(messages) > 4:
        size -= len(messages.pop(2)["content"]) + len(messages.pop(2)["content"])
        dropped += 1
    for message in sorted(messages, key=lambda m: (m["role"] == "system", -len(m["content"]))):
        excess, text = size - limit, message["content"]
        if excess <= 0 or len(text) <= 400:
            continue
        # the head says what it is; the tail of an output matters most
        keep = max(300, len(text) - excess - 80)
        message["content"] = (
            text[: keep // 3] + f"\n[... {len(text) - keep:,} characters cut to fit the model's "
            f"context ...]\n" + text[len(text) - (keep - keep // 3) :]
        )
        size += len(message["content"]) - len(text)
        cut_short += 1
    after = _chars(messages)
    if after >= before:
        return None  # nothing could be cut: no record that says otherwise
    return {
        "before_chars": before,
        "after_chars": after,
        "outputs_shortened": shortened,
        "exchanges_dropped": dropped,
        "messages_cut": cut_short
    }


_WINDOW_RE = re.compile(
    r"maximum context length is ([0-9]+)|available context size \(([0-9]+)|n_ctx\D{1,4}([0-9]+)"
)
_PROMPT_RE = re.compile(
    r"\(([0-9]+) in the messages|request has ([0-9]+) input tokens|messages resulted in ([0-9]+) "
    r"tokens|request \(([0-9]+) tokens\)|n_prompt_tokens\D{1,4}([0-9]+)"
)
MAX_TOKEN_RATIO = 8.0  # server tokens per chars/4 estimate believed at most (CJK text is near 4)


def overflow_sizes(message):
    """(window, prompt tokens) an overflow answer states (OpenAI, vLLM, llama.cpp wordings), each or
    None."""
    found = [regex.search(message or "") for regex in (_WINDOW_RE, _PROMPT_RE)]
    return tuple(int(next(g for g in match.groups() if g)) if match else None for match in found)


class ContextPlan:
    """What fits the model's window within the budget's `limits`: the smallest window known, and the
    server's token ratio to chars/4."""

    MARGIN = 0.10  # of the window, kept free for the estimate's error
    PER_MESSAGE = 16  # tokens of chat template around each message

    def __init__(self, limits):
        self.limits, self.window, self.ratio, self.learned = limits, None, 1.2, False
        self.know(limits.get("context_tokens"))

    def know(self, window):
        if type(window) is int and window > 0:
            self.window = min(self.window or window, window)

    def learn(self, reported, estimated):
        if reported and estimated:
            ratio = min(MAX_TOKEN_RATIO, max(0.5, reported / estimated))
            self.ratio = max(self.ratio, ratio) if self.learned else ratio
            self.learned = True

    def tokens(self, messages):
        estimate = ask.estimate_tokens(_chars(messages))
        return int(estimate * self.ratio * 1.1) + self.PER_MESSAGE * len(messages)

    def chars(self, count):
        """The most chars `count` messages may hold, leaving a reply room of a quarter of the
        window."""
        limits, window = self.limits, self.window
        if not window:
            return limits["max_context_chars"]
        room = min(limits["max_tokens_per_call"], max(128, window // 4))
        prompt = window - int(window * self.MARGIN) - room - self.PER_MESSAGE * count
        return max(0, min(limits["max_context_chars"], int(prompt * 4 / (self.ratio * 1.1))))

    def max_tokens(self, messages):
        """The per-call cap, cut to what the window leaves after the messages."""
        cap, window = self.limits["max_tokens_per_call"], self.window
        if not window:
            return cap
        return max(16, min(cap, window - int(window * self.MARGIN) - self.tokens(messages)))


class _Loop:
    """The host loop over a `world`, a live run or a replay: run() steps until an _Exit, and is
    (outcome, accepted patch check or None); step() queries the model, then executes what it asked
    for."""

    def __init__(self, world, policy, messages):
        self.world, self.policy, self.messages = world, policy, messages
        self.budget, self.last, self.repeats = Budget(policy.budget), None, 0

    def run(self):
        try:
            while True:
                self.step()
        except _Exit as end:
            if end.payload:
                self.world.record(end.outcome, end.payload)
            return end.outcome, end.check

    def step(self):
        step, text, call, checked = self.query()
        feedback = self.execute(step, text, call, checked) + self.repeated(step, text, checked)
        self.messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": feedback + "\n" + self.budget.line(self.world.elapsed())}
        ]

    def query(self):
        budget, elapsed = self.budget, self.world.elapsed()
        checked, spent = budget.snapshot(elapsed), budget.exhausted(elapsed)
        if spent:
            raise budget.over(*spent, elapsed)
        budget.steps += 1
        text, call = self.world.ask(budget.steps, self.messages, budget)
        budget.add(call)
        return budget.steps, text, call, checked

    def repeated(self, step, text, checked):
        """The notice before the last repeat allowed; raises _Exit (stuck) at it."""
        try:
            parse_reply(text)
            key = _sha256_hex(text.strip()), None
        except Malformed as bad:
            key = "", bad.reason
        self.repeats, self.last = (self.repeats + 1 if key == self.last else 1), key
        left = self.budget.limits["max_repeats"] - self.repeats
        if left <= 0:
            payload = {"step": step, "repeats": self.repeats, "unusable": key[1], "budget": checked}
            raise _Exit("stuck", payload)
        if left > 1:
            return ""
        return (
            f"\nYou have sent the same {'unusable ' if key[1] else ''}reply {self.repeats} times "
            "in a row. If the next one is the same again, the host ends the run: answer "
            "differently."
        )

    def execute(self, step, text, call, checked):
        """Record the reply's action and the host's verdict on it, and run it when allowed; what the
        model is told."""
        world, policy = self.world, self.policy
        try:
            action, form = world.parse(step, text)
            problem = rl.payload_problem({"args": action["args"], "reason": action["reason"]})
        except Malformed as bad:
            action, problem = None, bad.reason
        # unreadable; or nested too deep, a lone surrogate, too large: not recordable, so no action
        if problem:
            world.record(
                "proposal_malformed",
                {
                    "step": step,
                    "reason": (
                        problem if action is None else f"the action cannot be recorded: {problem}"
                    ),
                    "excerpt": _excerpt(text, 500),
                    "budget": checked,
                    "call": call
                }
            )
            answer = ' JSON object {"tool": NAME, "args": {...}, "reason": TEXT}.'
            if action is None:
                return f"The host could not read your reply: {problem}. Answer with one" + answer
            return (
                f"The host could not record your action ({problem}). Answer with one plain" + answer
            )
        tool, args = action["tool"], action["args"]
        # tool, args and reason, in that order
        world.record(
            "model_proposed",
            {"step": step, "form": form, **action, "budget": checked, "call": call}
        )
        verdict = check_action(action, policy, world.resolver(step))
        world.record(
            "tool_allowed" if verdict.allowed else "tool_denied",
            {
                "step": step,
                "tool": tool,
                "args": args,
                "rule": verdict.rule,
                "reason": verdict.reason,
                "paths": verdict.paths
            }
        )
        if not verdict.allowed:
            return (
                f"Denied by the host: {tool}: {verdict.reason} (rule {verdict.rule}). "
                "Choose another action."
            )
        if tool == "propose_patch":
            return self.propose(step, action)
        return world.run_tool(step, tool, args)

    def propose(self, step, action):
        args, world = action["args"], self.world
        check = world.check_patch(step, args["patch"])
        rule = check.get("rule")
        if not check["applies"]:
            world.record(
                "patch_rejected",
                {
                    "step": step,
                    "message": check["message"],
                    "patch_sha256": check["patch_sha256"],
                    **({"rule": rule} if rule else {})
                }
            )
            if rule:
                return f"Refused by the host: {check['message']}. Propose the patch without it."
            return (
                f"The patch does not apply (git apply --check): {check['message']}\nFix the patch "
                "against the files as they are (read them again if needed), with the context lines "
                "around each change as `diff -u` writes them, and propose it again."
            )
        world.record(
            "decision",
            {
                "stage": "proposal",
                "decision": "write proposal.patch for a human to review",
                "rationale": args.get("rationale") or action["reason"] or "(none given)",
                "alternatives": list(args.get("alternatives") or []),
                "step": step,
                "patch_sha256": check["patch_sha256"],
                "proposal_sha256": check["proposal_sha256"],
                "recount": check["recount"],
                "files": check["files"]
            }
        )
        raise _Exit("proposal", check=check)


class LiveWorld:
    """A live run: the model through ask.chat(), tools in the scratch copy, everything onto the
    run's ledger."""

    def __init__(self, run, workspace, settings, started):
        self.run, self.ws, self.settings, self.started = run, workspace, settings, started
        self.plan = ContextPlan(workspace.policy.budget)
        self.record, self.resolver = run.append, lambda step: workspace.resolve
        self.parse = lambda step, text: parse_reply(text)

    def elapsed(self):
        return time.monotonic() - self.started

    def ask(self, step, messages, budget):
        """One model turn through ask.chat(), which retries within the wall budget; a context
        overflow shrinks the context once and asks again. Raises _Exit."""
        trimmed = _fit(messages, self.plan.chars(len(messages)))
        if trimmed:
            self.record("context_trimmed", dict(trimmed, step=step))
        call, sources = {
            "attempts": 0,
            "tokens": 0,
            "tokens_source": "estimated",
            "latency_ms": 0.0
        }, set()

        # every attempt counts against the budget, retries and overflows too
        def tally(record, wait=None):
            tokens, source = _call_tokens(record)
            sources.add(source)
            call["attempts"] += 1
            call["tokens"] += tokens
            call["tokens_source"] = _source(sources)
            call["latency_ms"] = round(call["latency_ms"] + (record["latency_ms"] or 0), 1)

        retries = CALL_RETRIES
        record = self._chat(messages, budget, retries, tally, "before model call")
        # once: a second overflow in this step is an error
        if _context_too_long(record):
            retries = max(0, CALL_RETRIES - record["attempt"])  # the attempts before count
            self._shrink(step, messages, record)
            record = self._chat(messages, budget, retries, tally, "model call")
        if not record["error_type"]:
            self.plan.learn(record["input_tokens"], record["est_input_tokens"])
            call["reply_sha256"] = _sha256_hex(record["text"])
            call["reply_artifact"] = self.run.store_artifact(record["text"])
            return record["text"], call
        # a timeout at the wall, or a retry ask.chat left undone (it does only when the wall has no
        # time for it)
        if (
            record["error_type"] == "timeout"
            and self.elapsed() >= budget.limits["max_wall_s"] - ask.MIN_ATTEMPT_S
        ) or (ask.retryable(record) and record["attempt"] <= retries):
            raise self._out_of_wall(budget, "model call")
        code = f" ({record['error_code']})" if record["error_code"] else ""
        raise _Exit(
            "error",
            {
                "type": "ModelEndpointError",
                "stage": "model",
                "message": f"the model endpoint failed: {record['error_type']}{code}: "
                f"{record['error_message']}",
                "error_type": record["error_type"],
                "error_code": record["error_code"]
            }
        )

    def _chat(self, messages, budget, retries, tally, during):
        limits = budget.limits
        if limits["max_wall_s"] - self.elapsed() < ask.MIN_ATTEMPT_S:  # no call is made now
            raise self._out_of_wall(budget, during)
        base_url, model, api_key = self.settings
        record = ask.chat(
            messages,
            ledger=self.run,
            base_url=base_url,
            model=model,
            api_key=api_key,
            max_tokens=self.plan.max_tokens(messages),
            timeout=limits["call_timeout_s"],
            retries=retries,
            until=self.started + limits["max_wall_s"],
            on_retry=tally
        )
        tally(record)
        return record

    def _shrink(self, step, messages, record):
        """After an overflow answer: learn the window and ratio, then cut messages and max_tokens to
        fit."""
        window, prompt = overflow_sizes(record["error_message"])
        self.plan.learn(prompt, record["est_input_tokens"])
        before, sent = _chars(messages), record["max_tokens"]
        self.plan.know(window or (self.plan.tokens(messages) + sent) // 2)
        trimmed = _fit(messages, self.plan.chars(len(messages))) or {}
        self.record(
            "context_shrunk",
            dict(
                trimmed,
                step=step,
                error_code=record["error_code"],
                stated_window=window,
                stated_prompt_tokens=prompt,
                window_tokens=self.plan.window,
                before_chars=before,
                after_chars=_chars(messages),
                before_max_tokens=sent,
                after_max_tokens=self.plan.max_tokens(messages)
            )
        )

    def _out_of_wall(self, budget, during):
        elapsed = self.elapsed()
        return budget.over("max_wall_s", round(elapsed, 3), elapsed, during=during)

    def run_tool(self, step, tool, args):
        """Run it, record tool_result (digest, excerpt, output artifact); what the model is told."""
        policy = self.ws.policy
        cap = getattr(policy.plugins.get(tool), "output_bytes", None) or policy.caps["output_bytes"]
        output = self.ws.execute(tool, args)
        full = output.artifact_bytes()
        shown = self.run.ledger.redactor.text(output.text(cap))
        self.record(
            "tool_result",
            {
                "step": step,
                "tool": tool,
                "returncode": output.returncode,
                "timed_out": output.timed_out,
                "size": output.size,
                "sha256": _sha256_hex(full),
                "truncated": output.size > cap,
                "duration_ms": output.duration_ms,
                "output_artifact": self.run.store_artifact(full),
                "excerpt": _excerpt(shown, 800),
                **(output.sandbox or {})
            }
        )
        status = "timed out" if output.timed_out else f"exit {output.returncode}"
        cut = f", {output.size:,} bytes, cut to {cap:,}" if output.size > cap else ""
        return f"Result of {tool} ({status}{cut}):\n{shown}"

    def check_patch(self, step, patch):
        ws = self.ws
        return check_patch(ws.root, patch, self.run.ledger.redactor, ws.policy, ws.resolve)


def _call_tokens(record):
    if record["total_tokens"] is not None:
        return record["total_tokens"], "reported"
    if record["input_tokens"] is not None and record["output_tokens"] is not None:
        return record["input_tokens"] + record["output_tokens"], "reported"
    return (record["est_input_tokens"] or 0) + (record["est_output_tokens"] or 0), "estimated"


def _context_too_long(record):
    codes = ("context_length_exceeded", "string_above_max_length", "context_window_exceeded")
    return record["error_code"] in codes or (
        record["http_status"] in (400, 413, 422)
        and re.search(
            r"context.?length|maximum context|context window|context size|too many tokens|"
            r"prompt is too long|reduce the length",
            record["error_message"] or "",
            re.I
        )
    )


# What git does with a patch: the added paths, special (a symlink or a submodule), and blobs: each
# path it touches (a rename as both) -> (blob before, blob after), None where there is none.
GitReading = collections.namedtuple("GitReading", "added special blobs")


def git_reading(tree, patch_bytes, flags, env):
    """The patch as git applies it to a throwaway index of `tree`, the reading the rules trust; None
    if not."""
    with tempfile.TemporaryDirectory(prefix="agent-index-", dir=Path(tree).parent) as scratch:
        env = dict(env, GIT_INDEX_FILE=os.path.join(scratch, "index"))
        try:
            git(tree, "read-tree", "HEAD", env=env)
            git(tree, "apply", "--cached", *flags, "-", input=patch_bytes, env=env)
        except RepoError:
            return None
        raw = git(
            tree,
            "diff",
            "--cached",
            "--raw",
            "-z",
            "--no-renames",
            "--no-ext-diff",
            "HEAD",
            env=env,
            check=False
        )
    fields = raw.split(b"\0")
    added, special, blobs = [], False, {}
    # ":old_mode new_mode old_sha new_sha status", path; each path once (no renames)
    for meta, name in zip(fields[0::2], fields[1::2]):
        parts = meta.split()
        if len(parts) < 5 or not meta.startswith(b":"):
            continue
        path = os.fsdecode(name)
        if parts[4] == b"A":
            added.append(path)
        special |= parts[1] in (b"120000", b"160000")
        # 48: b"0"
        blobs[path] = tuple(None if set(sha) == {48} else sha.decode() for sha in parts[2:4])
    return GitReading(added, special, blobs)


def _git_apply(tree, patch_bytes, env, *flags):
    """`git apply FLAGS -` in `tree`: (its exit code, its output, stderr and stdout together)."""
    proc = subprocess.run(
        ["git", "-C", tree, "apply", *flags, "-"],
        input=patch_bytes,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        timeout=120
    )
    return proc.returncode, proc.stdout.decode("utf-8", "replace")


def check_patch(scratch, patch, redactor, policy, resolve):
    """Does the patch apply (`git apply --check`, then `--recount`) and pass the path rules and
    tripwires? The proposal is git's own diff when it took --recount."""
    patch_bytes = patch.encode("utf-8", "surrogateescape")
    result = {
        "applies": False,
        "recount": False,
        "message": "",
        "files": patch_files(patch)[0],
        "patch_sha256": _sha256_hex(patch_bytes),
        "proposal_sha256": None,
        "proposal": None
    }
    # the proposal is written as is: refuse, never mask
    if any(value in patch for value in redactor.values):
        return dict(
            result,
            rule="patch.secret",
            message="the patch holds the value of a secret (from the environment "
            "or a .env file); a patch must not (rule patch.secret)"
        )
    with tempfile.TemporaryDirectory(prefix="agent-patch-", dir=Path(scratch).parent) as work:
        clone, env = Path(work) / "tree", _scratch_git_env(work)
        git(work, "clone", "-q", "--no-hardlinks", scratch, clone, env=env, timeout=300)
        for flags in ([], ["--recount"]):
            code, output = _git_apply(clone, patch_bytes, env, "--check", "--verbose", *flags)
            if code == 0:
                break
            result["message"] = result["message"] or redactor.text(output.strip())[-1500:]
        else:
            return result
        reading = git_reading(clone, patch_bytes, flags, env)
        refusal = _refusal(clone, reading, policy, resolve, env)
        if refusal:
            return dict(result, message=refusal)
        proposal = patch_bytes
        if flags:
            git(clone, "apply", *flags, "-", input=patch_bytes, env=env)
            git(clone, "add", "-A", env=env)
            # git's own
            proposal = git(
                clone, "-c", "core.quotepath=true", "diff", "--cached", "--no-color", env=env
            )
    return dict(
        result,
        applies=True,
        recount=bool(flags),
        files=list(reading.blobs),
        proposal=proposal,
        proposal_sha256=_sha256_hex(proposal)
    )


def _shadows_a_module(path):
    """A new top-level module named like one Python can import (the tests would import it
    instead)."""
    top = path.split("/")[0]
    name = top[:-3] if "/" not in path and top.endswith(".py") else top if "/" in path else None
    if not name or not name.isidentifier():
        return False
    if name in sys.builtin_module_names:
        return True
    import importlib.machinery

    search = [
        p for p in sys.path if p and os.path.realpath(p) not in (str(HERE), os.path.realpath("."))
    ]
    return importlib.machinery.PathFinder.find_spec(name, search) is not None


def _refusal(clone, reading, policy, resolve, env):
    """Why the host refuses a patch git can apply: as git reads it, its paths and its tripwires."""
    if reading is None:
        return "git cannot apply this patch to the baseline's index"
    if reading.special:
        return "git reads this patch as making a symlink or a submodule (rule patch.mode)"
    if not reading.blobs:
        return "git reads no file in this patch (rule patch.no_files)"
    for name in reading.blobs:
        try:
            check_path(name, policy, resolve, {}, what="a file in the patch,")
        except _Deny as deny:
            return f"git reads this patch as touching {name!r}: {deny.reason} (rule {deny.rule})"
    for first in tripwires(clone, reading, policy.tripwires, env)[:1]:
        return (
            f"the patch trips {first['rule']} ({first['path']}: {first['what']}); a fix must not "
            f"need it: change the code without it (rule {first['rule']})"
        )
    return None


# == A run: what cron calls ====================================================


def _lock_dir():
    base = Path(
        os.environ.get("AGENT_LOCK_DIR")
        or Path(tempfile.gettempdir()) / f"reasoning-ledger-locks-{os.getuid()}"
    )
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(base)
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
        raise RepoError(
            f"{base}: the lock directory must be a directory of your own (not a symlink)"
        )
    return base


def take_lock(repo, run_id):
    """The repository's run lock, an flock held for the run's life. Raises LockHeld at once when
    held."""
    name = _sha256_hex(str(repo).encode("utf-8", "surrogateescape"))[:32] + ".lock"
    return _hold_lock(
        _lock_dir() / name, f"another run holds the lock for {repo}", f"run {run_id} "
    )


def _hold_lock(path, held_message, holder_note):
    """An exclusive flock on `path`, taken without waiting, noting who holds it; the fd. Raises
    LockHeld."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 300, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise LockHeld(f"{held_message} ({holder}); lock file {path}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} {holder_note}since {rl.utc_now()}\n".encode(), 0)
    return fd


# raise into the run only while armed; otherwise note the signal
_SIGNALS = {"armed": False, "noted": None}


def _on_signal(signum, _frame):
    """Kill the children and raise _Terminated once; while a run opens or closes, only note the
    signal."""
    for pgid in list(_CHILDREN):
        _kill_group(pgid)
    _SIGNALS["noted"] = _SIGNALS["noted"] or signum
    if _SIGNALS["armed"]:
        _SIGNALS["armed"] = False
        raise _terminated()


def _terminated(when=""):
    signum = _SIGNALS["noted"]
    return _Terminated(f"terminated by signal {signum} ({signal.Signals(signum).name}){when}")


def run_agent(
    repo,
    *,
    settings,
    ref=None,
    runs_dir=DEFAULT_RUNS,
    tools=DEFAULT_TOOLS,
    max_steps=None,
    max_wall_s=None,
    run_id=None,
    origin=None
):
    """One run on `repo`: (outcome, run_id, proposal path or None). Failures after open are
    recorded."""
    policy = load_policy(tools)
    for name, n in (("max_steps", max_steps), ("max_wall_s", max_wall_s)):
        if n is not None:
            policy.budget[name] = n
    repo = repo_root(repo)
    commit = resolve_ref(repo, ref)
    run_id = run_id or rl.new_run_id()
    lock = take_lock(repo, run_id)
    try:
        run = rl.open_run(
            runs_dir,
            run_id=run_id,
            secrets=[settings[2]] + repo_secrets(repo, commit if ref else None),
            signer=rl.env_signer()
        )
        started = time.monotonic()
        # every temp dir of the run is in it
        scratch = Path(tempfile.mkdtemp(prefix=f"agent-{run.run_id}-"))
        try:
            try:
                _SIGNALS["armed"] = True
                if _SIGNALS["noted"]:  # it came while the run was being opened
                    raise _terminated()
                tree = scratch / "tree"
                workspace = _start(run, repo, ref, commit, policy, settings, tree, origin or {})
                outcome, proposal = _run_steps(run, workspace, settings, started)
            finally:
                _SIGNALS["armed"] = False
        # the boundary: recorded as an event, then the run is closed
        except (Exception, _Terminated) as exc:
            outcome, proposal = "error", None
            _record_error(run, exc, traceback.format_exc())
        _remove_tree(scratch)
        if _SIGNALS["noted"] and outcome != "error":
            outcome, proposal = "error", None
            _record_error(
                run,
                _terminated(" while the run was being closed"),
                "".join(traceback.format_stack())
            )
        _close(run, outcome)
        return outcome, run.run_id, proposal
    finally:
        os.close(lock)


def _close(run, outcome):
    """run_closed, with the steps, the proposal's file and the judge's verdict."""
    summed = rl.run_summary(rl.read_events(run.ledger.path))
    run.close(
        outcome,
        steps=summed["steps"],
        proposal=PROPOSAL_NAME if (run.dir / PROPOSAL_NAME).exists() else None,
        verdict=summed["judge_verdict"]
    )


def _payloads(events, kind):
    return [e["payload"] for e in events if e["kind"] == kind]


def _record_error(run, exc, trace):
    run.append(
        "error",
        {
            "type": type(exc).__name__,
            "message": rl.error_text(exc)[:2000],
            "traceback_artifact": run.store_artifact(trace)
        }
    )


def _remove_tree(path):
    for base, dirs, _files in os.walk(path):
        # a test may have left a read-only directory behind (never chmod through a link)
        for full in (os.path.join(base, name) for name in dirs):
            if not os.path.islink(full):
                with contextlib.suppress(OSError):
                    os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _run_steps(run, workspace, settings, started):
    """The run in its workspace: the baseline tests, the host loop, the judge; (outcome, proposal
    path or None)."""
    policy = workspace.policy
    baseline = _tests(run, workspace)
    broken = _test_command_broken(policy.test_command, baseline)
    if broken:
        path = _child_env().get("PATH", os.defpath)
        ran = shutil.which(policy.test_command[0], path=path) or "not found"
        raise TestCommandError(
            f"the test command {' '.join(policy.test_command)!r} cannot run: {broken}; "
            f"{policy.test_command[0]} is {ran} on PATH={path}: fix test_command in "
            f"{policy.source} (or PATH)"
        )
    if baseline["passed"]:
        run.decide("triage", "no action", "the tests pass", ["look for other work"])
        return "no_action", None
    diff = workspace._git_diff()
    run.append(
        "prompt_context", {"diff_artifact": run.store_artifact(diff), "diff_chars": len(diff)}
    )
    first = first_prompt(baseline["output"], diff, Budget(policy.budget).line(0.0))
    messages = [
        {"role": "system", "content": system_prompt(policy)},
        {"role": "user", "content": run.ledger.redactor.text(first)}
    ]
    world = LiveWorld(run, workspace, settings, started)
    if policy.budget["context_tokens"] is None:  # asked of the endpoint, recorded as models_list
        base_url, model, api_key = settings
        timeout = min(30, policy.budget["call_timeout_s"])
        listed = ask.list_models(ledger=run, base_url=base_url, api_key=api_key, timeout=timeout)
        world.plan.know((listed.get("context_tokens") or {}).get(model))
    outcome, check = _Loop(world, policy, messages).run()
    if outcome != "proposal":
        return outcome, None
    # after the decision that accepted it: its exact bytes, never masked; one open, on the new file
    # itself: nothing planted there is followed
    path = run.dir / PROPOSAL_NAME
    with os.fdopen(os.open(path, _NEW_FILE, 0o600), "wb") as handle:
        handle.write(check["proposal"])
    verdict = _judge_in_child(run, workspace)
    return ("proposal_accepted" if verdict == "accept" else "proposal_rejected_by_judge"), path


def _start(run, repo, ref, commit, policy, settings, tree, origin):
    """Copy the repository to `tree`, probe the sandbox, record run_started; the run's Workspace."""
    # stored unmasked: replay reads it again
    if any(value in policy.text for value in run.ledger.redactor.values):
        raise rl.UsageError(
            "tools.json holds the value of a secret (the value is not shown); it cannot be recorded"
        )
    pinned = commit if ref else None
    digest = snapshot(repo, pinned, tree)
    dirty = not ref and bool(
        git(repo, "status", "--porcelain=v1", "-z", "--untracked-files=normal")
    )
    box = probe_sandbox(policy, _hidden_paths(repo, run.dir.parent))
    run.append(
        "run_started",
        {
            "repo": str(repo),
            "ref": ref,
            "commit": commit,
            "dirty": dirty,
            "tree_digest": digest,
            "tools_path": policy.source,
            "tools_sha256": policy.sha256,
            "tools_artifact": run.store_artifact(policy.text, redact_secrets=False),
            "model": settings[1],
            "base_url": ask.split_base_url(settings[0])[1],
            "budget": policy.budget,
            "test_command": policy.test_command,
            "agent_version": __version__,
            "python": sys.version.split()[0],
            **box.record(),
            **({"read_paths": box.reads} if box.reads else {}),
            **origin
        }
    )
    require_box(box, policy)
    return Workspace(repo, pinned, tree, policy, box)


def _tests(run, workspace):
    output, outcomes, why = workspace.run_tests()
    payload = {
        "command": workspace.policy.test_command,
        "returncode": output.returncode,
        "passed": output.returncode == 0,
        "timed_out": output.timed_out,
        "duration_ms": output.duration_ms,
        "size": output.size,
        "output_artifact": run.store_artifact(output.artifact_bytes()),
        "excerpt": _excerpt(run.ledger.redactor.text(output.text(EXCERPT_BYTES * 2))),
        **output.sandbox
    }
    if outcomes is not None:
        payload["outcomes_artifact"] = run.store_artifact(
            json.dumps(outcomes, sort_keys=True, indent=0)
        )
        counted = list(outcomes.values())
        payload["counts"] = {k: counted.count(k) for k in ("passed", "failed", "error", "skipped")}
    if why:
        payload["results_unread"] = why
    run.append("tests_run", payload)
    return dict(payload, output=output, outcomes=outcomes)


# Why a program cannot be started at all (a transient EAGAIN or ENOMEM is not among them)
_CANNOT_START = (
    errno.ENOENT,
    errno.EACCES,
    errno.ENOEXEC,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ELOOP
)


def _test_command_broken(command, baseline):
    """Why the test command itself cannot run (no repo change can fix it), else None."""
    output = baseline["output"]
    if output.error:
        return output.error if output.errno in _CANNOT_START else None
    if baseline["outcomes"]:
        return None  # tests ran: whatever failed is the model's to fix
    if output.returncode in (126, 127):
        return f"exit {output.returncode} (not executable or not found)"
    if not _is_pytest(command):
        return None
    text = output.text(8192)
    if output.returncode == 1 and re.search(r"No module named '?pytest'?\s*$", text):
        return "No module named pytest (install it for this interpreter, or change test_command)"
    if output.returncode == 4 and "while loading conftest" not in text:
        return "pytest was called wrongly (exit 4)"
    if output.returncode == 5:
        return "pytest collected no tests (exit 5)"
    return None


def _judge_in_child(run, workspace):
    """Run the judge as its own process; key, secrets and probe go on stdin, never in its
    environment."""
    given = {
        "key": os.environ.get(rl.KEY_ENV) or None,
        "secrets": list(run.ledger.redactor.values),
        "sandbox": workspace.box.record()
    }
    argv = [sys.executable, Path(__file__).resolve(), "judge", run.dir.resolve(), "--from-host"]
    output = run_program(
        argv,
        HERE,
        workspace.policy.test_timeout_s + 300,
        env=dict(_child_env(), TMPDIR=str(workspace.root.parent)),
        input=json.dumps(given).encode("utf-8")
    )
    verdict = rl.run_summary(rl.read_events(run.ledger.path))["judge_verdict"]
    if verdict is None:
        raise RuntimeError(
            f"the judge did not give a verdict (exit {output.returncode}): "
            f"{output.text(1000).strip()[-500:]}"
        )
    return verdict


# == The judge: reads only the run's ledger and artifacts, works in its own copy ==


def _artifact_text(run_dir, ref):
    return (run_dir / ref["path"]).read_bytes().decode("utf-8", "replace")


def _recorded_policy(run_dir, started):
    text = _artifact_text(run_dir, started["tools_artifact"])
    return policy_from_text(text, "the run's tools.json")


def judge_run(run_dir, *, key=None, secrets=(), sandbox=None):
    """Apply proposal.patch in a throwaway copy, run the tests boxed with known answers, rule; the
    verdict."""
    run_dir = Path(run_dir).resolve()
    events = list(rl.read_events(run_dir / rl.EVENTS_NAME, key=key))
    decisions = [p for p in _payloads(events, "decision") if p.get("stage") == "proposal"]
    if not decisions:
        raise rl.UsageError(f"{run_dir}: the run has no accepted proposal to judge")
    if _payloads(events, "run_closed"):
        raise rl.UsageError(f"{run_dir}: the run is closed; its verdict is in its ledger")
    started, baseline = _payloads(events, "run_started")[0], _payloads(events, "tests_run")[0]
    policy = _recorded_policy(run_dir, started)
    before = baseline.get("outcomes_artifact") and json.loads(
        _artifact_text(run_dir, baseline["outcomes_artifact"])
    )
    patch = (run_dir / PROPOSAL_NAME).read_bytes()
    repo, commit = Path(started["repo"]), started["commit"] if started.get("ref") else None
    hide = _hidden_paths(repo, run_dir.parent)
    box = (
        Sandbox(sandbox["sandbox"], sandbox.get("sandbox_reason"), hide, policy)
        if sandbox
        else probe_sandbox(policy, hide)
    )
    require_box(box, policy)
    verdict = _unruled(box)
    ledger = rl.Ledger(
        run_dir / rl.EVENTS_NAME,
        run_dir.name,
        key=key,
        secrets=list(secrets) + repo_secrets(repo, commit)
    )
    with tempfile.TemporaryDirectory(prefix="agent-judge-") as work:
        tree = Path(work) / "tree"
        if _sha256_hex(patch) != decisions[-1].get("proposal_sha256"):
            verdict["reason"] = "proposal.patch is not the patch the decision accepted"
        elif snapshot(repo, commit, tree) != started["tree_digest"]:
            verdict["reason"] = (
                "the repository changed since the run started; the judge cannot compare"
            )
        else:
            workspace = Workspace(repo, None, tree, policy, box)
            _judge_tree(patch, before, workspace, ledger, verdict)
    ledger.append("judge_verdict", verdict)
    ledger.close()
    return verdict


def _unruled(box):
    """The verdict before the judge rules: a reject, with nothing found yet."""
    return {
        "verdict": "reject",
        "rule": None,
        "applies": False,
        "tests_passed": False,
        "reason": "",
        "touched_tests": [],
        "shadows": [],
        "newly_failing": [],
        "vanished": [],
        "still_failing": [],
        "comparison": "exit codes",
        "tripwires": [],
        **box.record()
    }


def _judge_tree(patch, before, workspace, ledger, verdict):
    """The judge's work in its copy: read the patch as git does, apply, plant, run the tests,
    rule."""
    tree, policy = workspace.root, workspace.policy
    env = _scratch_git_env(tree.parent)
    reading = git_reading(tree, patch, [], env) or GitReading([], False, {})
    verdict["touched_tests"] = [f for f in reading.blobs if policy.is_test_path(f)]
    verdict["shadows"] = [f for f in reading.added if _shadows_a_module(f)]
    verdict["tripwires"] = tripwires(tree, reading, policy.tripwires, env)
    off = [t for t in TRIPWIRES if t not in policy.tripwires]
    if off:
        verdict["tripwires_off"] = off
    code, output = _git_apply(tree, patch, env)
    verdict["applies"] = code == 0 and not reading.special
    if not verdict["applies"]:
        verdict["reason"] = (
            "git reads the patch as making a symlink or a submodule"
            if reading.special
            else "the patch does not apply: " + output[-500:]
        )
        return
    plants = plant_known_answers(tree, policy, before) if policy.known_answers else None
    if isinstance(plants, str):
        verdict["known_answers"], verdict["known_answers_reason"], plants = (
            "not planted",
            plants,
            None
        )
    else:
        verdict["known_answers"] = "planted" if plants else "off"
    output, after, why = workspace.run_tests()
    if why:
        verdict["results_unread"] = why
    after, passed, subverted = plants.read(output, after) if plants else (after, None, None)
    verdict.update(_compare(before, after, output, passed))
    if subverted:
        verdict["runner_subverted"] = subverted
    text = output.artifact_bytes().decode("utf-8", "replace")
    text = plants.label(text) if plants else text
    verdict["output_artifact"] = ledger.store_artifact(text)
    verdict["excerpt"] = _excerpt(ledger.redactor.text(text[-EXCERPT_BYTES:]), 800)
    verdict["duration_ms"] = output.duration_ms
    accept = (
        "the patch applies, the tests pass, no test that passed before fails, no test file changed"
    )
    rule, verdict["reason"] = next(_broken_rules(verdict, policy), (None, accept))
    verdict["verdict"], verdict["rule"] = "reject" if rule else "accept", rule


def _compare(before, after, output, passed):
    """Before and after, per test where both have results; `passed`: as the known answers
    decided."""
    found = {
        "tests_passed": output.returncode == 0 if passed is None else passed,
        "returncode": output.returncode,
        "timed_out": output.timed_out
    }
    if before is not None and after is None:
        # per-test results before, none now: pytest was stopped or bypassed
        found["results_missing"] = True
    if before is None or after is None:
        return found
    found["comparison"] = "per test (JUnit XML)"
    found["newly_failing"] = sorted(
        t for t, o in before.items() if o == "passed" and after.get(t) in ("failed", "error")
    )
    found["vanished"] = sorted(
        t
        for t, o in before.items()
        if o in ("passed", "failed", "error") and after.get(t) in (None, "skipped")
    )
    found["still_failing"] = sorted(t for t, o in after.items() if o in ("failed", "error"))
    return found


def _broken_rules(verdict, policy):
    """(rule, reason) of each rule the verdict breaks, in the order the judge rules on them; the
    first rejects."""

    def listed(key):
        return ", ".join(verdict[key][:5])

    for first in verdict["tripwires"][:1]:
        yield first["rule"], f"the patch trips {first['rule']} ({first['path']}: {first['what']})"
    if verdict["shadows"]:
        yield "judge.shadows_module", (
            f"the patch adds {listed('shadows')}, named like a module Python can already import: "
            "run from the repository, the tests would import it instead"
        )
    if verdict["touched_tests"] and not policy.allow_test_changes:
        yield "judge.test_changed", (
            "the patch changes test files or test configuration "
            f"({listed('touched_tests')}); a fix must not"
        )
    if verdict.get("results_unread"):  # before the plants, whose results it holds
        yield "judge.results_missing", (
            f"the judge reads only a plain file of at most {MAX_RESULTS_BYTES} bytes: "
            + verdict["results_unread"]
        )
    if verdict.get("runner_subverted"):
        yield "judge.runner_subverted", (
            "the test runner did not report the judge's known answers "
            f"({verdict['runner_subverted']}): the patch subverts it"
        )
    if verdict.get("results_missing"):
        yield "judge.results_missing", (
            "the tests gave per-test results before the patch and none with it: the patch stops or "
            "bypasses the test runner"
        )
    if verdict["vanished"]:
        yield "judge.tests_vanished", "tests that ran before are gone or skipped: " + listed(
            "vanished"
        )
    if verdict["newly_failing"]:
        yield "judge.newly_failing", "tests that passed before now fail: " + listed("newly_failing")
    if not verdict["tests_passed"]:
        yield "judge.tests_fail", (
            "the tests time out with the patch"
            if verdict.get("timed_out")
            else f"the tests still fail with the patch (exit {verdict.get('returncode')})"
        )


# -- known answers: a test that must fail and one that must pass, planted in the judge's copy only

# pytest's options that take a value as the next argument, and those that can deselect a test or
# stop before it runs
_PYTEST_VALUE_OPTS = set(
    "-p -c -o -W -r --rootdir --confcutdir --basetemp --tb --ignore --ignore-glob --junitxml "
    "--junit-xml --override-ini --import-mode --durations --color --capture --log-level "
    "--cov".split()
)
_DESELECTING = {
    *"-k -m --lf --last-failed --deselect -x --exitfirst --maxfail --sw --stepwise --random-order "
    "--random-order-bucket --random-order-seed -f --failfast".split(),
    "-p randomly",
    "-p random_order"
}
_UNITTEST_VALUES = {
    "-s": "start",
    "--start-directory": "start",
    "-p": "pattern",
    "--pattern": "pattern",
    "-t": "top",
    "--top-level-directory": "top"
}


def _runner(argv):
    """("pytest" | "unittest" | None, the arguments after the runner's name): `pytest`, `py.test`,
    or `python [options] -m pytest|unittest`."""
    if os.path.basename(argv[0]) in ("pytest", "py.test"):
        return "pytest", argv[1:]
    for index, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            name = argv[index + 1 : index + 2]
            return (
                (name[0], argv[index + 2 :]) if name in (["pytest"], ["unittest"]) else (None, [])
            )
        if not arg.startswith("-"):
            break
    return None, []


def _unittest_discovery(args):
    """(start directory, pattern, why nothing can be planted or None) of `python -m unittest
    ARGS`."""
    given, positional, rest, why = {"start": ".", "pattern": "test*.py"}, [], list(args[1:]), None
    if args[:1] != ["discover"]:
        rest = []
        if any(not a.startswith("-") for a in args):
            why = "the test command names test modules"
        elif any(a in _DESELECTING for a in args):
            why = "the test command can deselect or stop before the known answers"
    while rest and not why:
        arg = rest.pop(0)
        if arg == "-k":
            why = "-k can deselect the known answers"
        elif arg in _UNITTEST_VALUES:
            key = _UNITTEST_VALUES[arg]
            given[key] = rest.pop(0) if rest else given.get(key)
        elif not arg.startswith("-"):
            positional.append(arg)
        elif arg in _DESELECTING:
            why = f"{arg} can stop the run before the known answers run"
    if why:  # the options read before it, and no positional argument
        positional = []
    return (positional + [given["start"]])[0], (positional[1:] + [given["pattern"]])[0], why


def _runner_patterns(argv):
    """The test runner's own discovery patterns, which count as test files whatever tools.json
    lists."""
    runner, args = _runner(argv)
    if runner == "pytest":
        return ["test_*.py", "*_test.py", "conftest.py"]
    return ["test*.py", "tests.py", _unittest_discovery(args)[1]] if runner == "unittest" else []


def _pytest_why_not(args, tree):
    index = 0
    while index < len(args):
        arg = args[index]
        option = arg.split("=", 1)[0]
        pair = f"{arg} {args[index + 1]}" if index + 1 < len(args) else arg
        if option in _DESELECTING or pair in _DESELECTING:
            return f"{option} can deselect the known answers or stop before they run"
        if option in _PYTEST_VALUE_OPTS and "=" not in arg:
            index += 2
            continue
        if not arg.startswith("-") and ("::" in arg or not (tree / arg).is_dir()):
            return "the test command names test files, modules or node ids"
        index += 1
    return None


class KnownAnswers:
    """The planted tests of one judge run: their names, the token the passing one writes, how to
    read them."""

    def __init__(self, runner, tag, token):
        self.runner, self.tag, self.token = runner, tag, token
        self.fail, self.ok = f"test_known_fail_{tag}", f"test_known_pass_{tag}"

    def source(self):
        # the token is never whole in the file: only the test's run writes it
        half = len(self.token) // 2
        write = (
            f'os.write(1, ("\\\\nknown-answer-" + "{self.token[:half]}" + "{self.token[half:]}'
            '\\\\n").encode())'
        )
        if self.runner == "pytest":  # plain functions, the kind pytest collects from a test file
            return (
                f"import os\n\n\ndef {self.fail}():\n    assert False, 'planted by the judge: must "
                f"fail'\n\n\ndef {self.ok}():\n    {write}\n"
            )
        return (
            f"import os\nimport unittest\n\n\nclass KnownAnswer{self.tag}(unittest.TestCase):\n"
            f"    def {self.fail}(self):\n        self.fail('planted by the judge: must fail')\n\n"
            f"    def {self.ok}(self):\n        {write}\n"
        )

    def read(self, output, after):
        """(per-test results less the plants, whether the project's tests pass, why the runner is
        not believed)."""
        if output.timed_out:
            return after, False, None
        if self.runner == "pytest":
            planted = (f"::{self.fail}", f"::{self.ok}")
            rest = after and {t: o for t, o in after.items() if not t.endswith(planted)}
            # by test name: the plants' names are the run's own
            got = {t.rsplit("::", 1)[-1]: o for t, o in (after or {}).items()}
            ok = (
                got.get(self.fail) == "failed"
                and got.get(self.ok) == "passed"
                and output.returncode == 1
            )
            passed = ok and not any(o in ("failed", "error") for o in rest.values())
            why = (
                None
                if ok
                else f"planted failure {got.get(self.fail, 'missing')}, planted pass "
                f"{got.get(self.ok, 'missing')}, exit {output.returncode}"
            )
            return rest, passed, why
        text = (output.head + output.tail).decode("utf-8", "replace")
        named, wrote = (
            re.findall(r"(?m)^(?:FAIL|ERROR): (\S+)", text),
            f"known-answer-{self.token}" in text
        )
        ran = re.search(r"(?m)^Ran \d+ tests? in ", text)
        ok = named.count(self.fail) == 1 and wrote and ran and output.returncode == 1
        why = (
            None
            if ok
            else (
                f"planted failure {'reported' if self.fail in named else 'not reported'}, planted "
                f"pass {'ran' if wrote else 'did not run'}, {'a' if ran else 'no'} Ran line, exit "
                f"{output.returncode}"
            )
        )
        return after, bool(ok) and named == [self.fail], why

    def label(self, text):
        """The planted lines, marked, so that a reader is not alarmed by a failure the patch did not
        cause."""
        return re.sub(
            rf"(?m)^(?=.*(?:known_(?:fail|pass)_{self.tag}|known-answer-{self.token}|"
            rf"KnownAnswer{self.tag}))",
            "[planted by the judge] ",
            text
        )


def plant_known_answers(tree, policy, before):
    """Plant a must-fail and a must-pass test where the runner collects; KnownAnswers, or why
    not."""
    import fnmatch

    runner, args = _runner(policy.test_command)
    tag = os.urandom(6).hex()
    if runner == "pytest":
        why, place = _pytest_why_not(args, tree), _collected_file(tree, before)
        if why or not place:
            return why or "the baseline run collected no test file to plant beside"
        base = os.path.basename(place)
        name = (
            f"test_zz_known_{tag}.py"
            if base.startswith("test")
            else f"zz_known_{tag}_test.py" if base.endswith("_test.py") else None
        )
        where = tree / os.path.dirname(place)
    elif runner == "unittest":
        start, pattern, why = _unittest_discovery(args)
        if why:
            return why
        name = pattern.replace("*", f"_zz_known_{tag}", 1).replace("*", "").replace("?", "x")
        name = (
            name
            if fnmatch.fnmatch(name, pattern) and name.endswith(".py") and name[:-3].isidentifier()
            else None
        )
        where = tree / start
    else:
        return "the test runner is neither pytest nor unittest"
    if name is None:
        return "no file name fits the runner's pattern for test files"
    if not where.is_dir() or not _under(os.path.realpath(where), os.path.realpath(tree)):
        return "the test directory is not inside the copy"
    plants = KnownAnswers(runner, tag, os.urandom(12).hex())
    (where / name).write_text(plants.source(), encoding="utf-8")
    return plants


def _collected_file(tree, before):
    """A test file the baseline run collected, from its JUnit class names
    (`tests.test_calc.TestX`)."""
    for test_id in sorted(before or ()):
        parts = test_id.split("::")[0].split(".")
        for end in range(len(parts), 0, -1):
            rel = "/".join(parts[:end]) + ".py"
            if (tree / rel).is_file():
                return rel
    return None


# -- tripwires: what a fix does not need, read from the patch (tripwires, not proof)

_RUNNER_NAMES = set("_pytest pluggy TestResult TextTestResult TextTestRunner TestProgram".split())
_RUNNER_MODULES = set("_pytest pluggy unittest.runner unittest.result unittest.main".split())
_PROCESS_MODULES = set("signal _signal ctypes _ctypes pty".split())
_PROCESS_CALLS = set("fork forkpty setsid setpgrp setpgid kill killpg fork_exec".split())
_HOOK_ATTRS = set("meta_path path_hooks path_importer_cache settrace setprofile".split())
_MODULES_WRITES = set("update setdefault pop popitem clear __setitem__ __delitem__".split())


def tripwires(tree, reading, enabled, env):
    """Every enabled tripwire the patch fires, [{rule, path, what}]; only what the patch adds
    counts."""
    fired = []
    for path, (old, new) in reading.blobs.items():
        parts = path.split("/")
        if (
            any(p.endswith((".dist-info", ".egg-info")) for p in parts)
            or parts[-1] == "entry_points.txt"
        ):
            fired.append(
                ("tripwire.packaging_metadata", path, "packaging metadata (a runner plug-in point)")
            )
        if parts[-1].endswith(".pth") or any(
            p in ("sitecustomize.py", "usercustomize.py", "sitecustomize", "usercustomize")
            for p in parts
        ):
            fired.append(("tripwire.startup_hook", path, "a file Python runs at start-up"))
        if new and path.endswith((".py", ".pyw")):
            was = _py_tripwires(_blob(tree, old, env)) if old else []
            seen = collections.Counter(w[:2] for w in was)
            for rule, what, line in _py_tripwires(_blob(tree, new, env)):
                if seen[rule, what]:
                    seen[rule, what] -= 1
                else:
                    fired.append((rule, path, f"line {line}: {what}"))
    fired.sort(key=lambda f: TRIPWIRES.index(f[0]))
    return [{"rule": r, "path": p, "what": w} for r, p, w in fired if r in enabled]


def _blob(tree, sha, env=None):
    return git(tree, "cat-file", "blob", sha, check=False, env=env)


def _dotted(node):
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join([node.id] + names[::-1]) if isinstance(node, ast.Name) else None


def _py_tripwires(source):
    """[(rule, what, line)] in one Python file's source. See docs/sandbox.md for where each line
    is."""
    try:
        module = ast.parse(source)
    except (SyntaxError, ValueError):
        return []  # it does not compile: the tests say so
    found = [
        (rule, what, getattr(node, "lineno", 0))
        for node in ast.walk(module)
        for rule, what in _node_tripwires(node)
    ]
    for node in _import_time(module.body):
        target = node.func if isinstance(node, ast.Call) else node.exc
        name = _dotted(target.func if isinstance(target, ast.Call) else target)
        if name in ("sys.exit", "exit", "quit", "SystemExit", "unittest.main", "os.abort"):
            found.append(("tripwire.exit_paths", f"{name} at import", node.lineno))
    return found


def _node_tripwires(node):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        base = getattr(node, "module", None) or ""
        names = [base] if base else []
        names += [f"{base}.{a.name}" if base else a.name for a in node.names]
        for name in names:
            top = name.split(".")[0]
            if (
                top in _RUNNER_MODULES
                or name in _RUNNER_MODULES
                or name.split(".")[-1] in _RUNNER_NAMES
            ):
                yield "tripwire.runner_internals", f"imports {name}"
            elif top in _PROCESS_MODULES or name in {f"os.{c}" for c in _PROCESS_CALLS}:
                yield "tripwire.process_control", f"imports {name}"
            elif top == "atexit" or name in ("os._exit", "os.abort"):
                yield "tripwire.exit_paths", f"imports {name}"
            elif name in {f"sys.{a}" for a in _HOOK_ATTRS}:
                yield "tripwire.interpreter_state", f"imports {name}"
    elif isinstance(node, ast.Attribute):
        attr, dotted, stored = node.attr, _dotted(node) or "", not isinstance(node.ctx, ast.Load)
        name, root = dotted or attr, dotted.split(".")[0]
        if (
            root in _RUNNER_MODULES
            or attr in _RUNNER_NAMES
            or (root == "unittest" and attr in ("runner", "result"))
        ):
            yield "tripwire.runner_internals", name
        elif root in ("pytest", "unittest") and stored:
            yield "tripwire.runner_internals", f"assigns {name}"
        if attr in _HOOK_ATTRS or root in ("builtins", "__builtins__") and stored:
            yield "tripwire.interpreter_state", name
        if attr in ("_exit", "abort") and root == "os" or root == "atexit":
            yield "tripwire.exit_paths", name
        if attr in _PROCESS_CALLS and root in ("os", "pty") or root in _PROCESS_MODULES:
            yield "tripwire.process_control", name
    elif isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Load):
        if _dotted(node.value) in ("sys.modules", "__builtins__", "builtins.__dict__"):
            yield "tripwire.interpreter_state", f"writes {_dotted(node.value)}[...]"
    elif isinstance(node, ast.Call):
        yield from _call_tripwires(node)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
        "pytest_"
    ):
        yield "tripwire.runner_internals", f"defines the pytest hook {node.name}"
    elif (
        isinstance(node, ast.Name)
        and node.id == "pytest_plugins"
        and isinstance(node.ctx, ast.Store)
    ):
        yield "tripwire.runner_internals", "sets pytest_plugins"
    elif (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.match(r"_pytest(\.|$)", node.value)
    ):
        yield "tripwire.runner_internals", f"names {node.value[:60]}"


def _call_tripwires(node):
    name = _dotted(node.func) or ""
    if name.startswith("sys.modules.") and name.rsplit(".", 1)[1] in _MODULES_WRITES:
        yield "tripwire.interpreter_state", f"calls {name}"
    if name in ("setattr", "delattr") and node.args:
        target = (_dotted(node.args[0]) or "").split(".")[0]
        if target in ("sys", "builtins", "__builtins__"):
            yield "tripwire.interpreter_state", f"{name} on {target}"
        elif target in ("pytest", "unittest", "_pytest"):
            yield "tripwire.runner_internals", f"{name} on {target}"
    for keyword in node.keywords:
        if keyword.arg in ("start_new_session", "preexec_fn", "process_group"):
            yield "tripwire.process_control", f"{keyword.arg}="


def _import_time(nodes):
    """Calls and raises that run at import: in module and class bodies, not in functions, lambdas or
    `__main__`."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if (
            isinstance(node, ast.If)
            and "__name__" in ast.dump(node.test)
            and "__main__" in ast.dump(node.test)
        ):
            yield from _import_time(node.orelse)
            continue
        if isinstance(node, (ast.Call, ast.Raise)):
            yield node
        yield from _import_time(ast.iter_child_nodes(node))


# == Replay: the same decisions from the record, with no model, no tool and no network ==


class ReplayWorld:
    """A recorded run as the host's world: replies, resolutions, git's answers and clock from the
    ledger."""

    def __init__(self, run_dir, events):
        self.run_dir, self.produced, self.steps = run_dir, [], 0
        self.replies, self.clock, self.paths, self.checks = [], [], {}, {}
        for event in events:
            kind, payload = event["kind"], event["payload"]
            if kind in ("model_proposed", "proposal_malformed", "budget_exhausted"):
                self.clock.append(payload["budget"]["elapsed_s"])
            if kind in ("model_proposed", "proposal_malformed"):
                self.replies.append(payload)
            elif kind in ("tool_allowed", "tool_denied"):
                self.paths.setdefault(payload["step"], {}).update(payload.get("paths") or {})
            elif (
                kind == "patch_rejected"
                or kind == "decision"
                and payload.get("stage") == "proposal"
            ):
                # the check as the host read it: applies, and the fields of its event
                self.checks[payload["step"]] = dict(payload, applies=kind == "decision")

    def elapsed(self):
        return self.clock[min(self.steps, len(self.clock) - 1)] if self.clock else 0.0

    def record(self, kind, payload):
        self.produced.append((kind, payload))

    def resolver(self, step):
        recorded = {posixpath.normpath(g): r for g, r in reversed(self.paths.get(step, {}).items())}
        # not resolved in the recorded run: taken at its word
        return lambda norm: recorded.get(norm, norm)

    # what the model answered, whatever the messages held
    def ask(self, step, messages, budget):
        if step > len(self.replies):
            raise _Exit("replayed")
        self.steps, call = step, self.replies[step - 1]["call"]
        return _artifact_text(self.run_dir, call["reply_artifact"]), call

    def parse(self, step, text):
        """The action as the live run read it (the stored reply is masked, which can change how it
        parses)."""
        payload = self.replies[step - 1]
        if "tool" not in payload:  # proposal_malformed
            raise Malformed(payload["reason"])
        return {k: payload[k] for k in ("tool", "args", "reason")}, payload["form"]

    def run_tool(self, step, tool, args):
        return "(replayed: the recorded output is in the ledger)"

    def check_patch(self, step, patch):
        return self.checks.get(step) or {
            "applies": False,
            "message": "(not checked in the recorded run)",
            "patch_sha256": None
        }


# What replay compares of each decision, after its kind (budget_exhausted and stuck: the limit)
_DECISION_FIELDS = {
    "tool_allowed": ("step", "tool", "rule"),
    "tool_denied": ("step", "tool", "rule"),
    "model_proposed": ("step", "tool"),
    "proposal_malformed": ("step",),
    "patch_rejected": ("step",),
    "decision": ("stage", "proposal_sha256")
}


def _decision_key(kind, payload):
    return (kind, *(payload.get(field) for field in _DECISION_FIELDS.get(kind, ("limit",))))


def replay_run(run_dir, tools=None):
    """Drive the host again from the record: (first divergence or [], decisions `tools` would
    flip)."""
    run_dir = Path(run_dir)
    events = list(rl.read_events(run_dir / rl.EVENTS_NAME))
    started = _payloads(events, "run_started")
    if not started:
        raise rl.UsageError(f"{run_dir}: no run_started event: not an agent run")
    policy = load_policy(tools) if tools else _recorded_policy(run_dir, started[0])
    # a run recorded before max_repeats existed was never stopped for repeating itself
    if tools is None:
        policy.budget = {**DEFAULT_BUDGET, "max_repeats": float("inf"), **started[0]["budget"]}
    world = ReplayWorld(run_dir, events)
    _Loop(world, policy, []).run()  # the replies are the record's, whatever the messages
    recorded = [
        (e["seq"], _decision_key(e["kind"], e["payload"]), e)
        for e in events
        if e["kind"] in DECISION_KINDS
    ]
    produced = [_decision_key(k, p) for k, p in world.produced if k in DECISION_KINDS]
    # the first: (its seq, the recorded decision, the replayed one), None where there is none
    pairs = itertools.zip_longest(recorded, produced)
    divergences = [(r and r[0], r and r[1], got) for r, got in pairs if (r and r[1]) != got][:1]
    decided = [key[2] for _seq, key, _event in recorded if key[0] == "decision"]
    proposal = run_dir / PROPOSAL_NAME
    digest = _sha256_hex(proposal.read_bytes()) if decided and proposal.exists() else None
    if digest and digest != decided[-1]:
        divergences.append((None, ("proposal.patch", decided[-1]), ("proposal.patch", digest)))
    return divergences, (_flips(recorded, produced) if tools is not None else [])


def _flips(recorded, produced):
    flips, tools_at = [], {k[1]: k for k in produced if k[0].startswith("tool_")}
    for seq, key, event in recorded:
        now = tools_at.get(key[1])
        if key[0].startswith("tool_") and now and (now[0], now[3]) != (key[0], key[3]):
            p = event["payload"]
            args = json.dumps(p["args"], ensure_ascii=False)[:120]
            flips.append(
                f"seq {seq} step {key[1]}: {p['tool']} {args}: "
                f"{key[0][5:]} by {key[3]} -> {now[0][5:]} by {now[3]}"
            )
    ends = [
        [k[1] for k in keys if k[0] == "budget_exhausted"]
        for keys in ([k for _s, k, _e in recorded], produced)
    ]
    if ends[0] != ends[1]:
        was, now = (end[0] if end else "not exhausted" for end in ends)
        flips.append(f"budget: {was} -> {now}")
    return flips


# == The record of runs ========================================================


def list_runs(runs_dir):
    """One row per run: id, started, outcome, steps, tokens, whether it verifies against the index,
    why it ended, whether it ran unboxed, and the head the index recorded (`seq:hash`)."""
    runs_dir, rows = Path(runs_dir), []
    heads = dict(rl.run_heads(runs_dir))  # the index anchors every run: one that fails raises
    found = {path.parent.name for path in runs_dir.glob(f"*/{rl.EVENTS_NAME}")}
    for run_id in sorted(found | set(heads)):
        path, head = runs_dir / run_id / rl.EVENTS_NAME, heads.get(run_id)
        try:
            lines = rl.verified_events(path, expect=head, closed=True)
            run, verified = rl.run_summary(event for event, _raw, _digest in lines), "ok"
        except rl.IntegrityError:
            run, verified = {}, "FAIL"
        except (rl.LedgerError, OSError):
            run, verified = {}, "ERROR"
        tokens, source = (
            (run["input_tokens"] + run["output_tokens"], "reported")
            if run.get("usage_calls")
            else (run["est_tokens"], "estimated") if run.get("est_tokens") else (None, None)
        )
        rows.append(
            {
                "run_id": run_id,
                "started": run.get("started"),
                "outcome": run.get("outcome"),
                "steps": run.get("steps"),
                "tokens": tokens,
                "tokens_source": source,
                "verified": verified,
                "why": run.get("why"),
                "unboxed": run.get("unboxed") is not None,
                "head": f"{head[0]}:{head[1]}" if head else None
            }
        )
    return rows


def _tokens_cell(row):
    if row["tokens"] is None:
        return "-"
    return f"{row['tokens']:,}" + ("~" if row["tokens_source"] == "estimated" else "")


# == CLI =======================================================================


def _cmd_run(args):
    if args.max_steps is not None and args.max_steps < 1:
        raise rl.UsageError("--max-steps must be at least 1")
    if args.max_wall_s is not None and not 0 < args.max_wall_s < float("inf"):
        raise rl.UsageError("--max-wall-s must be a positive number")
    _subreaper()
    # the daemon's keys come through a pipe, never in the run's environment
    if args.settings_on_stdin:
        os.environ.update(json.loads(sys.stdin.buffer.read() or b"{}"))
    settings = ask.settings_from_env()
    if args.ship_to:
        fleet.ClickHouse(args.ship_to)  # a URL of the wrong form is exit 2 before the run
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)
    origin = {k: v for k, v in (("delivery", args.delivery), ("event", args.event)) if v}
    outcome, run_id, proposal = run_agent(
        args.repo,
        settings=settings,
        ref=args.ref,
        runs_dir=args.runs_dir,
        tools=args.tools,
        max_steps=args.max_steps,
        max_wall_s=args.max_wall_s,
        run_id=args.run_id,
        origin=origin
    )
    runs = Path(args.runs_dir)
    events = _events_of(runs / run_id)
    summed = rl.run_summary(events)
    unboxed = summed["unboxed"]
    if unboxed and not unboxed.startswith('tools.json sets "sandbox": "off"'):
        rl.warn(f"run {run_id}: the tests and tools ran without a sandbox: {unboxed}")
    # error, budget_exhausted
    ended = (_payloads(events, outcome) or [None])[-1]
    if outcome == "error" and ended:
        rl.error(f"run {run_id}: {ended.get('type')}: {ended.get('message')}"[:500])
    elif outcome == "budget_exhausted" and ended:
        rl.warn(
            f"run {run_id}: budget exhausted: {ended.get('limit')} "
            f"({ended.get('used')} of {ended.get('max')}); its record: {runs / run_id}"
        )
    elif outcome == "stuck":
        rl.warn(f"run {run_id}: {summed['why'] or ''}; its record: {runs / run_id}")
    # bounded: a ClickHouse that hangs delays the run's exit by SHIP_RUN_DEADLINE_S at most
    if args.ship_to:
        _ship_run(
            fleet.ClickHouse(args.ship_to, timeout=30, deadline=SHIP_RUN_DEADLINE_S), runs, run_id
        )
    rl.write_out(f"{run_id} {outcome} {proposal or '-'}\n")
    return OUTCOME_EXIT[outcome]


def _ship_run(client, runs_dir, run_id):
    """Ship a closed run's ledger and the index; a failure is one warning (`ship --all` sends it
    later)."""
    wanted = {runs_dir / rl.INDEX_NAME, runs_dir / run_id / rl.EVENTS_NAME}
    try:
        targets = [t for t in fleet.ship_targets([], runs_dir) if t[0] in wanted]
        failed = [
            (path, result)
            for path, result in fleet.ship(targets, client)
            if not isinstance(result, fleet.Shipped)
        ]
    except (rl.LedgerError, OSError) as exc:
        failed = [(runs_dir / run_id, exc)]
    for path, problem in failed:
        rl.warn(
            f"run {run_id}: {path} not shipped to ClickHouse at {client.where}: "
            f"{rl.error_text(problem)}; `fleet.py ship --all {runs_dir}` sends it later"
        )


def _events_of(run_dir):
    """A run's events, or [] when its ledger cannot be read."""
    try:
        return list(rl.read_events(Path(run_dir) / rl.EVENTS_NAME))
    except (rl.LedgerError, OSError):
        return []


def _cmd_check_tools(args):
    path = args.file or DEFAULT_TOOLS
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        for problem in exc.problems:
            rl.error(f"{path}: {problem}")
        return rl.EXIT_USAGE
    rl.write_out(
        f"ok    {path}  version {policy.version}, {len(policy.builtins)} built-ins, "
        f"{len(policy.plugins)} plugins, sha256 {policy.sha256}\n"
    )
    return rl.EXIT_OK


def _cmd_judge(args):
    _subreaper()
    # agent.py run hands over the ledger key, the values to mask and its probe on stdin
    given = json.loads(sys.stdin.buffer.read() or b"{}") if args.from_host else {}
    verdict = judge_run(
        args.run_dir,
        key=(given.get("key") or "").encode("utf-8") if args.from_host else None,
        secrets=given.get("secrets") or (),
        sandbox=given.get("sandbox")
    )
    rl.write_out(f"{verdict['verdict']}: {verdict['reason']}\n")
    return rl.EXIT_OK if verdict["verdict"] == "accept" else rl.EXIT_CHECK


def _cmd_replay(args):
    divergences, flips = replay_run(args.run_dir, args.tools)
    if args.tools:
        for line in flips:
            rl.write_out(rl.printable(line) + "\n")
        rl.write_out(
            f"{len(flips)} decision{'s' if len(flips) != 1 else ''} would change under "
            f"{args.tools}\n"
        )
        return rl.EXIT_CHANGED if flips else rl.EXIT_OK
    if not divergences:
        rl.write_out("identical: the host makes the same decisions from the record\n")
        return rl.EXIT_OK
    seq, want, got = divergences[0]
    rl.write_out(
        rl.printable(f"first divergence at seq {seq}: recorded {want}, replay {got}") + "\n"
    )
    return rl.EXIT_FAILED


def _cmd_runs(args):
    rows = list_runs(args.runs_dir)
    line = "{:<32}  {:<27}  {:<26}  {:>5}  {:>10}  {:<11}  {}\n"
    if rows:
        rl.write_out(line.format("RUN", "STARTED", "OUTCOME", "STEPS", "TOKENS", "VERIFIED", "WHY"))
    for row in rows:
        steps = "-" if row["steps"] is None else row["steps"]
        verified = row["verified"] + (" unboxed" if row["unboxed"] else "")
        rl.write_out(
            rl.printable(
                line.format(
                    row["run_id"],
                    row["started"] or "-",
                    row["outcome"] or "-",
                    steps,
                    _tokens_cell(row),
                    verified,
                    row["why"] or "-"
                )[:-1]
            )
            + "\n"
        )
    if not rows:
        rl.write_out(f"no runs in {args.runs_dir}\n")
    else:
        rl.write_out(
            f"a run step by step: reasoning_ledger.py report {args.runs_dir}/RUN/events.jsonl\n"
        )
    return rl.EXIT_FAILED if any(r["verified"] != "ok" for r in rows) else rl.EXIT_OK


def _build_parser():
    raw = argparse.RawDescriptionHelpFormatter
    parser = rl.ArgumentParser(
        prog="agent.py",
        description="The host of a coding agent.",
        epilog=rl.exit_codes_epilog(*rl.EXIT_CODES),  # agent.py answers with every one of them
        formatter_class=raw
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, func, help, arguments in _COMMANDS:
        command = sub.add_parser(name, help=help, epilog=_EPILOGS.get(name), formatter_class=raw)
        command.set_defaults(func=func)
        for flag, help, *options in arguments:
            command.add_argument(flag, help=help, **dict(*options))
    return parser


_HIDDEN = argparse.SUPPRESS
_EPILOGS = {
    "run": "needs BASE_URL, API_KEY and MODEL_ID in the environment (no defaults, no fallback).\n"
    + rl.exit_codes_epilog(0, 8, 3, 7, 9, 6, 1, 2)
}
# Each command: its name, its function, its help, and its arguments (flag, help, other options)
_COMMANDS = (
    (
        "run",
        _cmd_run,
        "one run on a repository: tests, then the model proposes until a patch or budget",
        (
            ("--repo", "the git repository (never modified)", {"required": True}),
            (
                "--ref",
                "a commit to work on (default: the working tree, uncommitted changes included)"
            ),
            (
                "--runs-dir",
                f"where runs are recorded (default ./{DEFAULT_RUNS})",
                {"default": DEFAULT_RUNS}
            ),
            (
                "--tools",
                "the allowlist (default: tools.json beside agent.py)",
                {"default": str(DEFAULT_TOOLS)}
            ),
            ("--max-steps", "override the budget's max_steps", {"type": int}),
            ("--max-wall-s", "override the budget's max_wall_s", {"type": float}),
            # the daemon's
            ("--run-id", _HIDDEN),
            ("--delivery", _HIDDEN),
            ("--event", _HIDDEN),
            ("--settings-on-stdin", _HIDDEN, {"action": "store_true"}),
            (
                "--ship-to",
                "once closed, ship the run and the index to ClickHouse at URL",
                {"metavar": "URL"}
            )
        )
    ),
    (
        "runs",
        _cmd_runs,
        "a table of runs: id, started, outcome, steps, tokens, verified, why",
        (("--runs-dir", None, {"default": DEFAULT_RUNS}),)
    ),
    (
        "replay",
        _cmd_replay,
        "the same decisions from the record; --tools: which would change",
        (
            ("run_dir", None, {"metavar": "RUN_DIR"}),
            ("--tools", "another tools.json: list the decisions it would flip")
        )
    ),
    (
        "check-tools",
        _cmd_check_tools,
        "validate a tools.json (exit 0 valid, 2 not)",
        (("file", None, {"nargs": "?", "metavar": "FILE"}),)
    ),
    (
        "judge",
        _cmd_judge,
        "judge a run's proposal.patch in a throwaway copy (the host runs this)",
        (
            ("run_dir", None, {"metavar": "RUN_DIR"}),
            ("--from-host", _HIDDEN, {"action": "store_true"})
        )
    )
)


def main(argv=None):
    return rl.run_main(_build_parser(), argv, moved={"serve": "daemon.py"})


if __name__ == "__main__":
    sys.exit(main())
