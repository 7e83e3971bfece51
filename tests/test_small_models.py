"""Small models, as their users run them: a 2,048-token window served by a stand-in that refuses what does not
fit in the words of llama.cpp, vLLM or OpenAI, with the shipped settings; and a model that repeats itself."""

import pytest

import reasoning_ledger as rl
from conftest import run_script
from test_agent import FIX, _replays, _verifies, action, agent, make_repo, payload, propose, tools_json  # noqa: F401

WINDOW = 2048
BIG = "".join(f"def helper_{i}(value):\n    return value * {i}  # a line of an ordinary module\n" for i in range(400))
STEPS = [action("read_file", path="calc.py"), action("read_file", path="big.py"), action("run_tests"),
         action("grep", pattern="return"), propose(FIX)]


def sizes(server):
    """(prompt tokens the server counted, max_tokens asked) of every chat call."""
    return [(tokens, request["body"]["max_tokens"]) for tokens, request in zip(server.prompt_tokens, server.requests)]


@pytest.mark.parametrize("flavor,budget", [("llama.cpp", {}), ("vllm", {}), ("openai", {"context_tokens": WINDOW})])
def test_a_2k_window_with_the_shipped_settings_fits_every_request(agent, tmp_path, server, flavor, budget):
    server.window, server.models = (WINDOW, flavor), ["stand-in-model"]  # llama.cpp and vLLM state it in /models
    repo = make_repo(tmp_path / "repo", extra={"big.py": BIG})
    tools = tools_json(tmp_path / "tools.json", budget=budget)
    proc, run_dir, events = agent(repo, STEPS, tools_file=tools)
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err
    assert all(tokens + wanted <= WINDOW for tokens, wanted in sizes(server)), sizes(server)
    assert len(server.requests) == len(STEPS) and not [c for c in payload(events, "model_call") if c["error_type"]]
    assert not payload(events, "context_shrunk")
    trimmed = payload(events, "context_trimmed")
    assert trimmed and all(t["after_chars"] < t["before_chars"] for t in trimmed)  # the big file cut; no empty record
    assert max(wanted for _tokens, wanted in sizes(server)) < 2048  # max_tokens_per_call alone would fill the window
    _verifies(agent.runs)
    _replays(run_dir)


@pytest.mark.parametrize("flavor", ["openai", "vllm", "llama.cpp"])
def test_an_overflow_answer_leads_to_a_request_that_fits(agent, tmp_path, server, flavor):
    server.window, server.models = (WINDOW, flavor), ["another-model"]  # the window of ours is not listed
    repo = make_repo(tmp_path / "repo", extra={"big.py": BIG})
    proc, run_dir, events = agent(repo, STEPS)
    assert proc.returncode == rl.EXIT_PROPOSAL, proc.err
    first, *rest = sizes(server)
    assert first[0] + first[1] > WINDOW and first[1] == 2048  # refused: the window was not known yet
    assert all(tokens + wanted <= WINDOW for tokens, wanted in rest), rest
    (shrunk,) = payload(events, "context_shrunk")
    assert shrunk["step"] == 1 and shrunk["stated_window"] == WINDOW == shrunk["window_tokens"]
    assert shrunk["stated_prompt_tokens"] == first[0]
    assert shrunk["before_max_tokens"] == 2048 and shrunk["after_max_tokens"] == rest[0][1] < 2048
    assert shrunk["after_chars"] <= shrunk["before_chars"]
    assert [c["error_type"] for c in payload(events, "model_call")] == ["http_error"] + [None] * len(STEPS)
    _verifies(agent.runs)


def test_a_second_overflow_for_the_same_step_ends_the_run_cleanly(agent, tmp_path, server):
    server.window = (WINDOW, "openai")
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [{"name": "overflow"}, {"name": "overflow"}, propose(FIX)])
    assert proc.returncode == rl.EXIT_FAILED and proc.out.split()[1] == "error", proc.err
    assert len(server.requests) == 2 and len(payload(events, "context_shrunk")) == 1
    (error,) = payload(events, "error")
    assert error["error_code"] == "context_length_exceeded" and "maximum context length is 2048" in error["message"]
    (line,) = [line for line in proc.err.splitlines() if line.startswith("error: ")]
    assert run_dir.name in line and "context_length_exceeded" in line
    assert events[-1]["kind"] == "run_closed" and events[-1]["payload"]["outcome"] == "error"
    _verifies(agent.runs)


def test_a_model_that_repeats_an_unusable_reply_is_stopped_after_max_repeats(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, ["I am thinking about it..."] * 24)
    assert proc.returncode == rl.EXIT_STUCK == 9 and proc.out.split()[1] == "stuck", proc.err
    assert len(server.requests) == 3  # not 24
    told = [r["body"]["messages"][-1]["content"] for r in server.requests]
    assert sum("same unusable reply 2 times in a row" in t for t in told) == 1  # once, before the end
    assert "the host ends the run" in told[2]
    (stuck,) = payload(events, "stuck")
    assert stuck["step"] == 3 and stuck["repeats"] == 3 and stuck["unusable"].startswith("no action found")
    assert proc.err.splitlines() == [f"warning: run {run_dir.name}: stuck: the same unusable reply 3 times "
                                     f"(no action found); its record: {run_dir}"]
    assert events[-1]["payload"]["outcome"] == "stuck"
    _verifies(agent.runs)
    _replays(run_dir)


def test_identical_actions_are_stopped_too_and_max_repeats_is_a_budget_key(agent, tmp_path, server):
    repo = make_repo(tmp_path / "repo")
    proc, run_dir, events = agent(repo, [action("read_file", path="calc.py")] * 10)
    assert proc.returncode == 9 and len(payload(events, "tool_allowed")) == 3, proc.err
    assert payload(events, "stuck")[0]["unusable"] is None
    assert proc.err.splitlines() == [f"warning: run {run_dir.name}: stuck: the same reply 3 times; "
                                     f"its record: {run_dir}"]
    server.scenarios.clear()  # the replies the stopped run did not take
    patient = tools_json(tmp_path / "patient.json", budget={"max_repeats": 5})
    proc, run_dir, events = agent(repo, ["not json", "still not json"] * 2 + [action("list_files")] * 5,
                                  tools_file=patient)
    assert proc.returncode == 9 and payload(events, "stuck")[0]["step"] == 9, proc.err
    assert len(payload(events, "proposal_malformed")) == 4  # four unusable in a row: under max_repeats 5
    bad = tools_json(tmp_path / "bad.json", budget={"max_repeats": 2, "context_tokens": 100})
    checked = run_script("agent.py", "check-tools", bad)
    assert checked.returncode == 2
    assert "budget.max_repeats: must be an integer greater than 2" in checked.err
    assert "budget.context_tokens: must be an integer greater than 255" in checked.err


def test_a_run_recorded_before_max_repeats_existed_replays_identically(agent, tmp_path):
    import json

    from conftest import chain
    repo = make_repo(tmp_path / "repo")
    patient = tools_json(tmp_path / "patient.json", budget={"max_repeats": 9})
    proc, run_dir, events = agent(repo, ["I am thinking..."] * 4, "--max-steps", "4", tools_file=patient)
    assert proc.returncode == rl.EXIT_BUDGET, proc.err
    ledger = run_dir / "events.jsonl"
    bodies = [json.loads(line) for line in ledger.read_bytes().splitlines()]
    for body in bodies:  # as an older agent.py recorded it: no max_repeats, no context_tokens
        if body["kind"] == "run_started":
            for key in ("max_repeats", "context_tokens"):
                del body["payload"]["budget"][key]
    ledger.write_bytes(chain([dict(b, prev=None) for b in bodies]))
    _replays(run_dir)
