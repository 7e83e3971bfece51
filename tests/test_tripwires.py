"""Tripwires (issue 15): one table per rule, code that must trip it and clean code that must not. Python files
are read with ast, so a name in a comment or a string does not count; only what the patch adds counts.

Where the line is for process control: importing `signal` or `ctypes` anywhere in a changed file trips
tripwire.process_control, even inside a function that only defines a handler, because a function can be
called at import. A fix that truly needs a signal handler is for a human to write (or for
judge.tripwires_off to allow, per run). Calling subprocess.run() without start_new_session, preexec_fn or
process_group does not trip it. For exits: sys.exit() inside a function does not trip tripwire.exit_paths
(only at import, i.e. at module or class level, outside `if __name__ == "__main__":`); os._exit and atexit
trip it anywhere."""

import subprocess

import pytest

import agent
from test_agent import git

TABLE = {
    "tripwire.runner_internals": (
        ["import _pytest.python\n", "from _pytest import runner\n", "import pluggy\n",
         "from unittest import TextTestRunner\n", "import unittest\nunittest.TestCase.run = None\n",
         "import pytest\npytest.Function = None\n", "def pytest_runtest_call(item):\n    pass\n",
         "pytest_plugins = ['x']\n", "import importlib\nimportlib.import_module('_pytest.runner')\n",
         "import unittest\nunittest.result.failfast = None\n"],
        ["import pytest\n\n\n@pytest.fixture\ndef thing():\n    return 1\n", "import unittest\n\n\n"
         "class T(unittest.TestCase):\n    pass\n", "# _pytest in a comment\nx = 'see _pytest docs'\n",
         "def runtest():\n    return 'pytest_runtest'\n"]),
    "tripwire.interpreter_state": (
        ["import sys\nsys.modules['calc'] = None\n", "import sys\ndel sys.modules['os']\n",
         "import sys\nsys.modules.update({})\n", "import builtins\nbuiltins.open = None\n",
         "__builtins__['len'] = None\n", "import sys\nsys.meta_path.insert(0, object())\n",
         "import sys\nsys.path_hooks.append(None)\n", "import sys\nsys.settrace(None)\n",
         "import threading\nthreading.setprofile(None)\n", "import sys\nsetattr(sys, 'modules', {})\n"],
        ["import sys\nthis = sys.modules[__name__]\n", "import sys\nprint(sys.path)\n",
         "import builtins\nprint(builtins.len([]))\n", "modules = {}\nmodules['x'] = 1\n"]),
    "tripwire.exit_paths": (
        ["import os\nos._exit(0)\n", "import atexit\n", "import sys\nsys.exit(0)\n", "raise SystemExit(1)\n",
         "exit()\n", "import unittest\nunittest.main()\n", "from os import _exit\n",
         "import sys\ntry:\n    pass\nfinally:\n    sys.exit(0)\n", "class A:\n    quit()\n",
         "import os\n\n\ndef f():\n    os._exit(1)\n"],
        ["import sys\n\n\ndef main():\n    sys.exit(1)\n",
         "import sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
         "import unittest\n\nif __name__ == '__main__':\n    unittest.main()\n",
         "def f():\n    raise SystemExit(2)\n", "x = lambda: exit()\n"]),
    "tripwire.process_control": (
        ["import signal\n", "import os\nos.fork()\n", "import os\nos.setsid()\n", "import ctypes\n",
         "def handler():\n    import signal\n    signal.signal(2, None)\n", "from os import fork\n",
         "import os\nos.kill(1, 9)\n", "import subprocess\nsubprocess.Popen(['x'], start_new_session=True)\n",
         "import subprocess\nsubprocess.run(['x'], preexec_fn=print)\n", "import pty\n"],
        ["import subprocess\nsubprocess.run(['true'], check=True)\n", "import os\nprint(os.getpid())\n",
         "signals = ['a']\nsignal_strength = 3\n", "# import signal\n", "text = 'os.fork()'\n"]),
}


@pytest.mark.parametrize("rule,source", [(r, s) for r, (hits, _) in TABLE.items() for s in hits])
def test_code_that_trips_the_rule(rule, source):
    fired = {found[0] for found in agent._py_tripwires(source)}
    assert rule in fired, (source, fired)


@pytest.mark.parametrize("rule,source", [(r, s) for r, (_, clean) in TABLE.items() for s in clean])
def test_clean_code_does_not_trip_the_rule(rule, source):
    fired = {found[0] for found in agent._py_tripwires(source)}
    assert rule not in fired, (source, fired)


def reading(tmp_path, files, before=None):
    """A real git tree with `before` committed, and git's own reading of a patch that writes `files`."""
    tree = tmp_path / "tree"
    tree.mkdir(parents=True)
    git(tree, "init", "-q")
    for name, text in (before or {"README": "x\n"}).items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    git(tree, "add", "-A")
    git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    git(tree, "add", "-A", "--intent-to-add")
    patch = subprocess.run(["git", "-C", str(tree), "diff", "--no-color"], capture_output=True, check=True).stdout
    git(tree, "reset", "-q", "--hard")
    git(tree, "clean", "-qfd")
    env = agent._scratch_git_env(tmp_path)
    return tree, agent.git_reading(tree, patch, [], env), env


@pytest.mark.parametrize("files,rule", [
    ({"quiet-1.0.dist-info/entry_points.txt": "[pytest11]\nq = q\n"}, "tripwire.packaging_metadata"),
    ({"pkg.egg-info/PKG-INFO": "Name: pkg\n"}, "tripwire.packaging_metadata"),
    ({"lib/entry_points.txt": "[console_scripts]\n"}, "tripwire.packaging_metadata"),
    ({"hook.pth": "import os\n"}, "tripwire.startup_hook"),
    ({"sitecustomize.py": "x = 1\n"}, "tripwire.startup_hook"),
    ({"usercustomize/__init__.py": "x = 1\n"}, "tripwire.startup_hook"),
])
def test_other_files_that_add_runner_plug_in_points(tmp_path, files, rule):
    tree, read, env = reading(tmp_path, files)
    fired = agent.tripwires(tree, read, agent.TRIPWIRES, env)
    assert rule in [f["rule"] for f in fired], fired


@pytest.mark.parametrize("files", [{"docs/info.txt": "entry points\n"}, {"path.py": "x = 1\n"},
                                   {"dist/readme.md": "x\n"}, {"site.py.txt": "x\n"}])
def test_other_files_that_do_not_trip(tmp_path, files):
    tree, read, env = reading(tmp_path, files)
    assert agent.tripwires(tree, read, agent.TRIPWIRES, env) == []


def test_only_what_the_patch_adds_counts(tmp_path):
    before = {"app.py": "import signal\n\n\ndef f():\n    return 1\n"}
    tree, read, env = reading(tmp_path, {"app.py": "import signal\n\n\ndef f():\n    return 2\n"}, before)
    assert agent.tripwires(tree, read, agent.TRIPWIRES, env) == []
    tree2, read2, env2 = reading(tmp_path / "b", {"app.py": "import signal\nimport atexit\n"}, before)
    assert [f["rule"] for f in agent.tripwires(tree2, read2, agent.TRIPWIRES, env2)] == ["tripwire.exit_paths"]


def test_all_that_fire_are_listed_in_rule_order_and_off_means_off(tmp_path):
    files = {"evil.pth": "x\n", "a.py": "import signal\nimport _pytest\nimport sys\nsys.settrace(None)\n"}
    tree, read, env = reading(tmp_path, files)
    fired = [f["rule"] for f in agent.tripwires(tree, read, agent.TRIPWIRES, env)]
    assert fired == ["tripwire.runner_internals", "tripwire.interpreter_state", "tripwire.process_control",
                     "tripwire.startup_hook"], fired
    some = tuple(t for t in agent.TRIPWIRES if t != "tripwire.runner_internals")
    assert [f["rule"] for f in agent.tripwires(tree, read, some, env)][0] == "tripwire.interpreter_state"
    assert agent.tripwires(tree, read, (), env) == []
