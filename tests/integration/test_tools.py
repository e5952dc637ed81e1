"""Tools through the journal (rollout.tools) in real training runs: an agent calls a tool that opens tickets in an outside
service (tests/tools_for_tests.py: every effect appended to a file) through the gateway's MCP server. SIGKILLed before a call
runs, after it ran and before its result was durable, and after its result was durable, then resumed: no ticket is opened twice
(never even re-sent: the service saw no repeated key), the unknown outcome is reconciled by the key, and the run is
bit-identical to the uninterrupted one; sync and completion order. A tool without keys or a reconcile: its episode is
unresolved, never trained, counted, and its effect applied once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verlj.engine.schema.events import DropReason, StepEvents
from verlj.engine.schema.sample import EnvEnd, unpack
from verlj.journal import open_journal_reader
from verlj_testing import cli, fingerprints, train

TESTS = str(Path(__file__).resolve().parents[1])  # agents_for_tests, tools_for_tests
TOOLS = ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:ticketing", "rollout.max_turns=2", "trainer.total_steps=2",
         "rollout.tools=[tools_for_tests:open_ticket,tools_for_tests:post_message]"]
COMPLETION = ["rollout.mode=async", "rollout.async_order=completion"]
def effects(path: Path) -> list[dict]:
    """The effects a service applied (a line a kill tore mid-write: never applied, tests/tools_for_tests.py)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def run_with_kills(tmp_path: Path, over: list[str], kills: list[str], ref_over=(), run_over=()) -> tuple[Path, Path, list[str]]:
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over, *ref_over, PYTHONPATH=TESTS, VERLJ_TEST_EFFECTS=str(tmp_path / "ref.effects"))
    assert out.returncode == 0, out.stderr[-3000:]
    said = []
    for k, point in enumerate(kills):
        out = train(run, *over, *run_over, resume=k > 0, PYTHONPATH=TESTS, VERLJ_TEST_EFFECTS=str(tmp_path / "run.effects"), VERLJ_FAILPOINT=point)
        assert out.returncode == -9, (point, out.stderr[-3000:])
        said.append(out.stderr)
    out = train(run, *over, *run_over, resume=True, PYTHONPATH=TESTS, VERLJ_TEST_EFFECTS=str(tmp_path / "run.effects"))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return ref, run, said


@pytest.mark.parametrize("order", ["sync", "completion"])
def test_killed_around_tool_calls_no_effect_is_applied_twice_and_the_run_is_bit_identical(tmp_path, order):
    over = [*TOOLS, *(COMPLETION if order == "completion" else [])]
    check_kills(tmp_path, over, order, tmp_path / "ref.effects", tmp_path / "run.effects")


def test_an_mcp_server_of_yours_through_kills_opens_each_ticket_once(tmp_path):
    """rollout.tools=[URL]: examples/counting_service.py over streamable HTTP (its keys, its reconcile), forwarded by the gateway."""
    import socket
    import subprocess
    import sys
    import time

    services = []

    def start(effects: Path) -> str:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        services.append(subprocess.Popen([sys.executable, str(Path(TESTS).parent / "examples" / "counting_service.py"), "--effects",
                                          str(effects), "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return f"http://127.0.0.1:{port}/mcp"
            time.sleep(0.1)
        raise AssertionError("the counting service did not start")

    try:
        ref_url, run_url = start(tmp_path / "ref.effects"), start(tmp_path / "run.effects")
        over = [o for o in TOOLS if not o.startswith("rollout.tools=")]
        check_kills(tmp_path, over, "sync", tmp_path / "ref.effects", tmp_path / "run.effects",
                    ref_over=[f"rollout.tools=[{ref_url}]"], run_over=[f"rollout.tools=[{run_url}]"])
    finally:
        for p in services:
            p.kill()
            p.wait()


def check_kills(tmp_path: Path, over: list[str], order: str, ref_effects: Path, run_effects: Path, ref_over=(), run_over=()) -> None:
    """Killed before a call runs (durable as sent, not applied), after it ran (applied, not durable), after its result was
    durable, then resumed: no effect applied twice or even re-sent, the run's samples and states the uninterrupted run's."""
    ref, run, _ = run_with_kills(tmp_path, over, ["tools.after_sent:20", "tools.after_run:3", "tools.after_done:4"], list(ref_over), list(run_over))
    done, got = effects(ref_effects), effects(run_effects)
    assert all(e["kind"] == "applied" for e in done)
    if order == "sync":  # a ticket an episode: 2 steps of 8 prompts x 2 (completion order plays groups ahead too, never trained)
        assert len(done) == 2 * 8 * 2
    keys = [e["key"] for e in got if e["kind"] == "applied"]
    assert len({k.split("-", 2)[1] for k in keys}) == 1  # one run token through every process (a start that committed nothing too)
    assert len(keys) == len(set(keys)) and len(keys) >= 32  # every ticket opened once, none twice
    assert [e for e in got if e["kind"] == "dedup"] == []  # and none even re-sent: the journal answered, the reconcile told
    # the samples trained are the uninterrupted run's, token for token and score for score; their tool calls differ only in
    # what says whose they were (another run's key, the attempt, reconciled where the outcome was asked), and the state after
    # every step is bit-identical
    mine, theirs = trained(run), trained(ref)
    assert [t[:-1] for t in mine] == [t[:-1] for t in theirs]
    assert [[(c["name"], c["arguments"], c["result"]) for c in t[-1]] for t in mine] == [[(c["name"], c["arguments"], c["result"]) for c in t[-1]] for t in theirs]
    calls = [c for t in mine for c in t[-1]]
    if order == "sync":  # the outcome the second kill left unknown, asked of the service by its key, by a later attempt (completion
        assert any(c["state"] == "reconciled" for c in calls) and any(c["attempt"] > 1 for c in calls)  # order may have played
        # that group ahead, in no committed step yet, and its first kill came before a commit: a fresh start, attempt 1 again)
    with open_journal_reader(run / "journal") as j:
        counted = [StepEvents.of(r).metrics.values for r in j.iter_steps()]
    assert sum(m["agent/tool_calls_from_journal"] for m in counted) >= 1
    assert fingerprints(run) == fingerprints(ref)


def trained(run: Path) -> list[tuple]:
    """Each step's samples in order: (step, id, prompt, response, mask, score, the tool calls journaled with it)."""
    with open_journal_reader(run / "journal") as j:
        return [(st.step, int(s.id), s.prompt_ids.tolist(), s.response_ids.tolist(), s.loss_mask.tolist(), float(s.score),
                 json.loads(s.agent_calls).get("tools", [])) for st in map(StepEvents.of, j.iter_steps()) for s in unpack(st.added.samples)]


def test_an_unkeyed_tool_without_a_reconcile_leaves_its_episode_unresolved_never_trained(tmp_path):
    over = [*TOOLS, "rollout.max_fault_rate=1"]
    run = tmp_path / "run"
    env = {"PYTHONPATH": TESTS, "VERLJ_TEST_EFFECTS": str(tmp_path / "effects"), "VERLJ_TEST_TOOL": "post_message"}
    out = train(run, *over, **env, VERLJ_FAILPOINT="tools.after_run:19")  # step 2's third message posted, its result never durable
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *over, resume=True, **env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    keys = [e["key"] for e in effects(tmp_path / "effects")]
    assert len(keys) == len(set(keys))  # no message posted twice: an unknown one is never sent again
    with open_journal_reader(run / "journal") as j:
        steps = [StepEvents.of(r) for r in j.iter_steps()]
    unresolved = [s for st in steps for s in unpack(st.added.samples) if s.env_end == EnvEnd.UNRESOLVED]
    # the calls in flight at the kill (episodes run 8 at once): each sent and perhaps applied, none known; their episodes unresolved
    assert unresolved and all("was sent before a crash and its outcome is unknown: post_message is external and has no reconcile"
                              in s.env_reason for s in unresolved)
    named = {s.env_reason.split("key ")[1].split(")")[0] for s in unresolved}
    assert len(set(keys) | named) == 32  # every episode's message posted once, or its episode unresolved with the key to check
    dropped = {int(i) for st in steps for i in st.dropped(DropReason.FAULT)}
    assert {int(s.id) for s in unresolved} <= dropped  # out of the update
    assert sum(st.metrics.values["agent/unresolved"] for st in steps) == len(unresolved)
    assert out.stderr.count("is unresolved: tool call 0 (post_message, key verlj-") == len(unresolved)
    said = cli("verify", run)  # verify counts them apart, with the steps to inspect; not damage
    assert said.returncode == 0, said.stdout + said.stderr
    line = next(x for x in said.stdout.splitlines() if "ended by a fault" in x)
    steps_at = sorted({st.step for st in steps if any(s.env_end == EnvEnd.UNRESOLVED for s in unpack(st.added.samples))})
    assert line.startswith(f"⚠ {sum(1 for st in steps for s in unpack(st.added.samples) if s.fault_reason)} samples ended by a fault"), line
    assert f", {len(unresolved)} unresolved (" in line and f"steps {', '.join(map(str, steps_at))})" in line, line
    assert f"{len(unresolved)} of them unresolved" in cli("inspect", run, check=True).stdout
