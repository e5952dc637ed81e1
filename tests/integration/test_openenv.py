"""An OpenEnv server as the environment (rollout.env=openenv:URL): examples/openenv_guess.yaml's recipe, its server
(examples/openenv_server.py, written with openenv.core's create_app) started by verlj from rollout.openenv_command,
on the BPE model. Trains, one WebSocket session an episode; killed before step 2's commit and resumed, bit-identical
to the uninterrupted run (sync mode and async step order: the step's episodes played again from their seeds on fresh
sessions); replay reads the episodes from the journal with no server at all. Each episode journals the env's state()
after reset and each step (env_states), what the server's env reports, and inspect shows it turn by turn. A server that
goes down mid-run faults its episodes, counted and never trained, the step refused in one line. In completion order,
killed mid-episode, no turn is lost and nothing trained twice. An MCP env
(examples/openenv_mcp.yaml's server, an MCPEnvironment) trains with its tools in the prompt, killed and resumed
bit-identical, replayed without its server."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest

from verlj.engine.schema.events import StepEvents
from verlj.engine.schema.sample import EnvEnd, unpack
from verlj.journal import open_journal_reader
from verlj_testing import REPO, cli, free_port, kill_and_resume, train, verlj

RECIPE = REPO / "examples" / "openenv_guess.yaml"


def overrides(bpe_model: str, port: int, log: Path, *more: str) -> list[str]:
    """The recipe on the BPE model, its server on `port`; each start of the server adds a line to `log`."""
    server = f"{sys.executable} {REPO / 'examples' / 'openenv_server.py'} --port {port}"
    return ["--config", str(RECIPE), f"model.actor.model_name_or_path={bpe_model}", f"rollout.env=openenv:http://127.0.0.1:{port}",
            f"rollout.openenv_command=sh -c 'echo started >> {log}; exec {server}'", "trainer.total_steps=3", "trainer.save_interval=1",
            "rollout.max_response_length=8", *more]


def samples(run: Path) -> dict[int, list]:
    with open_journal_reader(run / "journal") as j:
        return {rec.step: unpack(StepEvents.of(rec).added.samples) for rec in j.iter_steps()}


def states_of_the_servers_env(s, tok) -> list[dict]:
    """The states examples/openenv_server.py's env reports for the sample's episode, played here in this process: reset
    on its seed, then each action stepped (an action of only end-of-sequence is not); its episode_id left out, as verlj does."""
    spec = importlib.util.spec_from_file_location("openenv_server", REPO / "examples" / "openenv_server.py")
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    env = server.GuessEnvironment()
    env.reset(seed=int(s.env_seed))
    out = [env.state.model_dump(exclude={"episode_id"})]
    turns = s.turns()[:-1] if s.env_end == EnvEnd.STOPPED else s.turns()
    for t in turns:
        env.step(server.GuessAction(guess=tok.decode(t.action_ids, skip_special_tokens=True)))
        out.append(env.state.model_dump(exclude={"episode_id"}))
    return out


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("mode", [[], ["rollout.mode=async"]], ids=["sync", "async_step"])
def test_an_openenv_server_trains_and_a_kill_resumes_bit_identical(tmp_path, bpe_model, mode):
    port, log = free_port(), tmp_path / "starts.log"
    over = overrides(bpe_model, port, log, *mode)
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "faults 0/16" in out.stdout + out.stderr
    eps = [s for st in samples(ref).values() for s in st]
    assert len(eps) >= 3 * 16 and not any(s.env_end == EnvEnd.FAULT for s in eps)
    assert any(len(s.turn_lens) > 2 for s in eps) and any(s.env_end == EnvEnd.DONE for s in eps)  # several guesses, the server ending some
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_model)
    for s in eps:  # state() journaled: reset's first, then one a step, what the server's env reports (episode_id aside)
        states = json.loads(s.env_states)
        assert len(states) == len(s.turns()) + (s.env_end != EnvEnd.STOPPED) and states[0] == {"step_count": 0, "tries": 0}
        assert states == states_of_the_servers_env(s, tok), s.id
    shown = json.loads(cli("inspect", ref, "--step", "1", "--json", check=True).stdout)["samples"]
    assert all(x["reset_state"] == {"step_count": 0, "tries": 0} for x in shown)  # inspect: each turn's state where there is one
    stepped = [(n, t["state"]) for x in shown for n, t in enumerate(x["turns"]) if "state" in t]
    assert stepped and all(state["step_count"] == n + 1 for n, state in stepped)
    text = cli("inspect", ref, "--step", "1", check=True).stdout
    assert 'reset state {"step_count": 0, "tries": 0}' in text and '  state {"step_count": 1, "tries": ' in text
    assert not listening(port)  # stopped at exit
    kill_and_resume(run, ref, *over, failpoint="step.before_commit:2")
    assert log.read_text().splitlines() == ["started"] * 3  # ref, the killed run and its resume: once each
    assert not listening(port)  # the killed run's server died with it
    if not mode:  # replay reads the episodes: no server is started, none answers
        rep = verlj("replay", run, "--to-step", "3")
        assert rep.returncode == 0, rep.stderr[-3000:]
        assert log.read_text().splitlines() == ["started"] * 3


def test_a_server_that_goes_down_faults_its_episodes_never_trained(tmp_path, bpe_model):
    """A server that dies at its 17th reset (tests/openenv_for_tests.py): step 1 trains, step 2's episodes cannot reach
    it: each a fault naming the server, none trained, the step not committed, the run stopped in one line."""
    port = free_port()
    dying = f"{sys.executable} {REPO / 'tests' / 'openenv_for_tests.py'} --port {port} --die-after 16"
    over = [*overrides(bpe_model, port, tmp_path / "starts.log"), f"rollout.openenv_command={dying}"]
    run = tmp_path / "run"
    out = train(run, *over)
    assert out.returncode == 1, out.stderr[-3000:]
    said = (out.stdout + out.stderr).strip().splitlines()
    assert said[-1].startswith("error: step 2: 16 of 16 episodes ended by a fault, more than rollout.max_fault_rate=0.5 allows: "), said[-1]
    assert f"reset raised OpenEnvError: the OpenEnv server at http://127.0.0.1:{port} " in said[-1]  # not answering, or closed mid-reset
    assert list(samples(run)) == [1]  # step 2 never committed


def test_an_mcp_env_trains_with_its_tools_offered_and_a_kill_resumes_bit_identical(tmp_path, bpe_model):
    """examples/openenv_mcp.yaml: the server's MCP tool (`add`, listed once at reset: the state's step_count 1) rendered
    into each prompt with the reset's text; a call the policy makes is answered as a tool message, masked from the loss.
    Killed before step 2's commit and resumed, bit-identical; replay starts no server."""
    port, log = free_port(), tmp_path / "starts.log"
    server = f"{sys.executable} {REPO / 'examples' / 'openenv_mcp_server.py'} --port {port}"
    over = ["--config", str(REPO / "examples" / "openenv_mcp.yaml"), f"model.actor.model_name_or_path={bpe_model}",
            f"rollout.env=openenv:http://127.0.0.1:{port}", f"rollout.openenv_command=sh -c 'echo started >> {log}; exec {server}'",
            "trainer.total_steps=3", "trainer.save_interval=1", "data.prompts_per_step=4"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "faults 0/" in out.stdout + out.stderr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_model)
    eps = [s for st in samples(ref).values() for s in st]
    for s in eps:
        prompt = tok.decode(s.prompt_ids)
        assert '{"name": "add", "description": "Add two integers."' in prompt and prompt.endswith(" Use the add tool.<|im_end|>\n<|im_start|>assistant\n")
        assert json.loads(s.env_states)[0]["step_count"] == 1  # reset, then the tools listed once
        if len(s.turn_lens) > 2:  # a call answered: a tool message, masked
            a, o = int(s.turn_lens[0]), int(s.turn_lens[1])
            assert tok.decode(s.response_ids[a : a + o]).startswith("\n<|im_start|>user\n<tool_response>\n")
            assert not s.loss_mask[a : a + o].any()
    kill_and_resume(run, ref, *over, failpoint="step.before_commit:2")
    rep = verlj("replay", run, "--to-step", "3")
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert log.read_text().splitlines() == ["started"] * 3  # ref, the killed run and its resume; replay none


def test_an_openenv_server_in_completion_order_killed_mid_episode_loses_no_turn_and_trains_nothing_twice(tmp_path, bpe_model):
    """Completion order: killed after step 1's commit, then with turns of groups asked ahead durable; resumed to the
    end, the committed steps unchanged and every group accounted for (asked once, arrived once, trained or dropped once
    at most), the episodes in flight rebuilt on fresh sessions of a server started again, by replaying their actions."""
    from test_async_completion import kill_mid_episode_and_resume

    port, log = free_port(), tmp_path / "starts.log"
    run = tmp_path / "run"
    kill_mid_episode_and_resume(run, *overrides(bpe_model, port, log, "rollout.mode=async", "rollout.async_order=completion"))
    with open_journal_reader(run / "journal") as j:
        assert sum(e["values"].get("rollout/env/restored_turns", 0) for _, e in j.iter_events("metrics")) > 0  # rebuilt, not regenerated
    assert log.read_text().count("started") == 3  # one server a start of verlj, stopped with it (killed with it)
    assert not listening(port)
