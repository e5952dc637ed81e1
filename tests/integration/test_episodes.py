"""Multi-turn episodes (rollout.env, rollout.max_turns) in real training runs: the turns in the journal,
observation tokens out of the loss, a SIGKILL then --resume equal to the uninterrupted run (sync GRPO,
async step-order PPO), a SIGKILL in async completion order (GRPO and PPO) between a turn's completion
and its durability or just after, resumed from each episode's last durable turn with no completed turn
lost or stepped twice on a live env, replay and rerun that never call the environment, faulty
environments ending their episodes with journaled reasons, an environment that cannot be imported
refused up front, and episodes on vLLM and on two ranks in each order, killed and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_async_completion import check_accounting

from verlj.engine.loop.ledger import Ledger
from verlj.engine.rl.vocab import VOCABS, TextDecoder
from verlj.engine.schema.events import DropReason, StepEvents
from verlj.engine.schema.sample import EnvEnd, unpack
from verlj.journal import open_journal_reader
from verlj_testing import assert_same_journal, cli, fingerprints, kill_and_resume, raised_at, train, verlj

TESTS = str(Path(__file__).resolve().parents[1])  # envs_for_tests
ASCII = "model.tiny.vocab=ascii"
# the held-out eval (every 2 steps, 8 rows) plays episodes too, and the kill/resume test below covers it
GUESS = ["rollout.env=builtin:guess", "rollout.max_turns=3", ASCII, "trainer.total_steps=4", "trainer.save_interval=2",
         "trainer.eval_interval=2", "data.eval_size=8"]
# the untrained tiny model never writes a <calc> tag (builtin:calculator's episodes would all be one turn): a
# multi-turn env with rewards every turn and episodes of 1 to 3 turns instead, so PPO's mask has holes
PPO_ASYNC = ["rollout.env=envs_for_tests:Digits", "rollout.max_turns=3", ASCII, "algorithm.name=ppo", "rollout.mode=async",
             "trainer.total_steps=4", "trainer.save_interval=2"]


def episodes(run: Path) -> dict[int, list]:
    """Each step's added samples (Sample objects), from the journal."""
    out = {}
    with open_journal_reader(run / "journal") as j:
        for rec in j.iter_steps():
            added = StepEvents.of(rec).added
            out[rec.step] = unpack(added.samples) if added is not None and added.samples is not None else []
    return out


def steps_of(run: Path) -> dict[int, StepEvents]:
    with open_journal_reader(run / "journal") as j:
        return {rec.step: StepEvents.of(rec) for rec in j.iter_steps()}


def out_line(out, step: int) -> str:
    """The step's log line in a run's output."""
    return next(line for line in out.stdout.splitlines() if line.startswith(f"[INFO] Step {step}: "))


def metrics(run: Path) -> dict[int, dict]:
    with open_journal_reader(run / "journal") as j:
        return {rec.step: StepEvents.of(rec).metrics.values for rec in j.iter_steps()}


def evals(run: Path) -> dict[int, object]:
    """Each step's held-out eval event (schema.events.Eval), from the journal."""
    with open_journal_reader(run / "journal") as j:
        return {rec.step: e for rec in j.iter_steps() if (e := StepEvents.of(rec).eval) is not None}


@pytest.fixture(scope="module")
def guess_ref(tmp_path_factory):
    run = tmp_path_factory.mktemp("guess") / "ref"
    out = train(run, *GUESS)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_guess_episodes_are_journaled_turn_by_turn(guess_ref):
    dec = TextDecoder("builtin:tiny", VOCABS["ascii"])
    samples = [s for step in episodes(guess_ref).values() for s in step]
    assert samples and all(s.is_episode for s in samples)
    multi = [s for s in samples if len(s.turn_lens) // 2 > 1]
    assert multi, "no episode took more than one turn"
    s = multi[0]
    turns = s.turns()
    assert len(turns) == len(s.turn_lens) // 2 == len(s.turn_rewards) <= 3
    # the rules (reset's observation) follow the prompt; every turn's observation is a word the game says
    assert dec.decode(s.prompt_ids.tolist()).endswith("Answer with the number only.")
    words = [dec.decode(t.observation_ids.tolist()) for t in turns]
    assert all(w in ("higher", "lower", "not a number", "") for w in words) and words[0] != ""
    # loss_mask: 1 on each action's tokens, 0 on each observation's; log-probs 0 where the mask is 0
    want = np.concatenate([np.r_[np.ones(len(t.action_ids)), np.zeros(len(t.observation_ids))] for t in turns])
    assert np.array_equal(s.loss_mask, want.astype(np.int8)) and (s.loss_mask == 0).any()
    assert np.all(s.gen_logprobs[s.loss_mask == 0] == 0) and len(s.response_ids) == len(s.loss_mask) == len(s.gen_logprobs)
    assert s.env_end in (EnvEnd.DONE, EnvEnd.MAX_TURNS) and s.env_reason == ""
    assert np.isnan(s.turn_rewards[:-1]).all() and s.score == s.rule_reward == np.nansum(s.turn_rewards)
    # the env's seeds differ from sample to sample (each from its place in the step)
    assert len({int(x.env_seed) for x in samples}) == len(samples)
    assert all(m["rollout/env/faults"] == 0.0 for m in metrics(guess_ref).values())
    shown = verlj("inspect", guess_ref, "--step", "1", "--max-samples", "1", check=True).stdout  # turn by turn
    assert "turn 1: " in shown and " ⇒ " in shown


def test_the_held_out_eval_plays_episodes(guess_ref):
    """rollout.env: each held-out prompt is played as an episode against the env (the rules as the first
    observation, "higher" / "lower" after a wrong guess), scored by the env, its turns journaled."""
    dec = TextDecoder("builtin:tiny", VOCABS["ascii"])
    by_step, m = evals(guess_ref), metrics(guess_ref)
    assert sorted(by_step) == [2, 4]
    for step, e in by_step.items():
        assert sorted(e.rows.tolist()) == list(range(8)) and e.turns is not None
        turns = e.episode_turns()
        assert [len(t) // 2 for t in turns] == e.turns.tolist() and all(1 <= n <= 3 for n in e.turns)
        assert [int(t.sum()) for t in turns] == e.response_len.tolist()  # actions and observations, as a sample's response
        assert set(e.env_end.tolist()) <= {EnvEnd.DONE, EnvEnd.MAX_TURNS}
        # the env's reward is the score: 1.0 for a right guess, 0.0 for the last wrong one (the game ends either way)
        assert set(e.scores.tolist()) <= {0.0, 1.0} and all(e.turns[e.scores == 0.0] == 3)
        assert m[step]["eval/env/turns/mean"] == float(e.turns.mean()) and m[step]["eval/env/faults"] == 0.0
        assert m[step]["eval/score/mean"] == float(e.scores.mean())
        for resp, lens in zip(e.responses(), turns):  # each observation is what the game says
            ends = np.cumsum(lens)
            words = [dec.decode(resp[a:b].tolist()) for a, b in zip(ends[0::2], ends[1::2])]
            assert all(w in ("higher", "lower", "not a number", "") for w in words)
    assert max(int(e.turns.max()) for e in by_step.values()) > 1, "no held-out episode took more than one turn"
    assert 1 not in metrics(guess_ref) or "eval/score/mean" not in metrics(guess_ref)[1]


def _nan_as_none(x):
    """A row's values with NaN as None (Parquet and JSONL each keep a float list's NaN; NaN != NaN)."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, list):
        return [_nan_as_none(v) for v in x]
    return {k: _nan_as_none(v) for k, v in x.items()} if isinstance(x, dict) else x


def test_export_rollouts_has_each_episode_turn_by_turn_and_one_row_a_turn(guess_ref, tmp_path):
    """export --rollouts of a run of episodes: the episode's columns (turns as text, as inspect --step shows
    them; env_end, env_reason, env_seed; loss_mask, turn_lens, turn_rewards) in JSONL and Parquet alike, and
    --turns one row per turn whose action and observation ids put back together are the response."""
    pq = pytest.importorskip("pyarrow.parquet")
    by_id = {s.id: s for step in episodes(guess_ref).values() for s in step}
    cli("export", guess_ref, "--rollouts", "-o", tmp_path / "r.jsonl", check=True)
    cli("export", guess_ref, "--rollouts", "-o", tmp_path / "r.parquet", check=True)
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert _nan_as_none(pq.read_table(tmp_path / "r.parquet").to_pylist()) == _nan_as_none(rows)
    assert sorted(r["sample_id"] for r in rows) == sorted(by_id)
    shown = json.loads(cli("inspect", guess_ref, "--step", "2", "--json", check=True).stdout)["samples"]
    assert shown and all(next(r for r in rows if r["sample_id"] == s["id"])["turns"] == s["turns"] for s in shown)
    for r in rows:
        s = by_id[r["sample_id"]]
        assert len(r["turns"]) == len(s.turns()) == len(s.turn_lens) // 2 and r["turns"][0]["action"]
        assert [t["reward"] for t in r["turns"]] == [None if np.isnan(x) else x for x in s.turn_rewards]
        assert (r["env_end"], r["env_reason"], r["env_seed"]) == (s.env_end, s.env_reason, s.env_seed)
        assert (r["loss_mask"], r["turn_lens"]) == (s.loss_mask.tolist(), s.turn_lens.tolist())
        assert "".join(t["action"] + t["observation"] for t in r["turns"]) == r["response"]
    out = cli("export", guess_ref, "--rollouts", "--turns", "-o", tmp_path / "t.jsonl", check=True)
    cli("export", guess_ref, "--rollouts", "--turns", "-o", tmp_path / "t.parquet", check=True)
    turns = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert pq.read_table(tmp_path / "t.parquet").to_pylist() == turns
    assert len(turns) == sum(len(s.turns()) for s in by_id.values()) > len(by_id) and f"wrote {len(turns)} turns" in out.stdout
    for sid, s in by_id.items():
        mine = [t for t in turns if t["sample_id"] == sid]
        assert [t["turn"] for t in mine] == list(range(1, len(s.turns()) + 1))
        assert sum((t["action_ids"] + t["observation_ids"] for t in mine), []) == s.response_ids.tolist()
        assert np.array_equal(np.float32(sum((t["action_logprobs"] for t in mine), [])), s.gen_logprobs[s.loss_mask == 1])
        row = next(r for r in rows if r["sample_id"] == sid)
        assert [{k: t[k] for k in ("action", "observation", "reward")} for t in mine] == row["turns"]
        assert all((t["status"], t["status_step"], t["score"]) == (row["status"], row["status_step"], row["score"]) for t in mine)


def test_archived_episodes_read_back_as_the_journal_holds_them(guess_ref, tmp_path):
    """The rollout archive (retention) of a run of episodes keeps the episode's columns: each step's table
    written to Parquet as loop.archive writes it and read back as an archived step is gives the same rows."""
    pa, pq, pc = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet"), pytest.importorskip("pyarrow.compute")
    from verlj.engine.schema import table

    dec = TextDecoder("builtin:tiny", VOCABS["ascii"])
    with open_journal_reader(guess_ref / "journal") as j:
        cols = [table.step_columns(rec.step, StepEvents.of(rec).added.samples, dec) for rec in j.iter_steps()]
    schema = table.arrow_schema(False, episodes=True)
    with pq.ParquetWriter(tmp_path / "a.parquet", schema, **table.parquet_options(schema)) as w:
        w.write_table(pa.concat_tables([table.to_arrow(c, episodes=True) for c in cols]))
    back = pq.read_table(tmp_path / "a.parquet")
    for c in cols:
        step = int(c["step"][0])
        again = table.table_columns(back.filter(pc.equal(back.column("step"), step)))
        assert _nan_as_none(list(table.rows(again, True))) == _nan_as_none(list(table.rows(c, True)))
        assert table.TURNS in again and again["turn_rewards"][0].tobytes() == c["turn_rewards"][0].tobytes()


def test_guess_killed_mid_run_then_resumed_is_exact(tmp_path, guess_ref):
    run = tmp_path / "run"
    out = train(run, *GUESS, VERLJ_FAILPOINT="journal.after_commit:3")  # step 3 journaled, the last snapshot at 2
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *GUESS, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Replayed step 3 from the journal." in out.stdout
    assert fingerprints(run) == fingerprints(guess_ref)
    assert_same_journal(run, guess_ref)


def test_ppo_async_episodes_killed_then_resumed_is_exact(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *PPO_ASYNC, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    samples = [s for step in episodes(ref).values() for s in step]
    assert {len(s.turn_lens) // 2 for s in samples} >= {3} and len({s.score for s in samples}) > 1
    kill_and_resume(run, ref, *PPO_ASYNC, failpoint="step.before_commit:3", PYTHONPATH=TESTS)


def test_faulty_envs_end_their_episodes_and_replay_never_calls_an_env(tmp_path):
    """An env that raises, returns a tuple, or hangs past rollout.env_timeout_s ends that episode with its
    reason journaled and counted; the run completes. Then replay and rerun (which re-executes step 3 from
    the snapshot of step 2, rescoring its samples) run with every env call forbidden (exit 97) and
    reproduce the journaled fingerprint and stages."""
    run = tmp_path / "run"
    over = ["rollout.env=envs_for_tests:Faulty", "rollout.max_turns=3", "rollout.env_timeout_s=0.5", ASCII, "rollout.max_fault_rate=1",
            "rollout.reward_fn=builtin:add", "trainer.total_steps=3", "trainer.save_interval=2", "trainer.eval_interval=3", "data.eval_size=8"]
    out = train_out = train(run, *over, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    by_step, m = episodes(run), metrics(run)
    reasons = {s.env_reason for step in by_step.values() for s in step if s.env_end == EnvEnd.FAULT}
    assert reasons == {"step raised ValueError: the sandbox fell over" + raised_at(Path(TESTS) / "envs_for_tests.py", 'raise ValueError("the sandbox fell over")'), "step returned a list, not StepResult, (observation, reward, done) "
                       "or (observation, reward, terminated, truncated, info)", "step no answer in 0.5 s"}
    records = steps_of(run)
    for step, samples in by_step.items():
        faults = [s for s in samples if s.env_end == EnvEnd.FAULT]
        assert m[step]["rollout/env/faults"] == m[step]["rollout/faults"] == float(len(faults)) > 0
        assert m[step]["rollout/fault_rate"] == len(faults) / len(samples) and m[step]["rollout/faults/reward"] == 0.0
        assert all(len(s.turn_lens) == 4 and s.turn_lens[-1] == 0 and np.isnan(s.turn_rewards[-1]) for s in faults)
        # never trained on: out of the update, a drop of reason `fault` with the rest of any group left with one
        groups = {int(s.group): [x for x in samples if x.group == s.group and x.env_end != EnvEnd.FAULT] for s in samples}
        out = {s.id for s in faults} | {x.id for g in groups.values() if len(g) < 2 for x in g}
        assert set(records[step].dropped(DropReason.FAULT).tolist()) == out
        assert not out & set(records[step].consumed.ids.tolist()) and len(records[step].consumed.ids) > 0
        assert f"[INFO] Step {step}: " in out_line(train_out, step) and f"faults {len(faults)}/{len(samples)}: " in out_line(train_out, step)
    assert len({s.score for step in by_step.values() for s in step}) > 1  # the env's rewards vary: the update is not trivial
    # the held-out eval of step 3 played its episodes against the same env: its faults counted, and its
    # scores are the env's rewards plus the named reward_fn's (builtin:add) of each last action
    e = evals(run)[3]
    assert m[3]["eval/env/faults"] == float(np.sum(e.env_end == EnvEnd.FAULT)) > 0
    assert len(set(e.scores.tolist())) > 1 and m[3]["eval/env/turns/mean"] == float(e.turns.mean())
    head = f" eval faults {int(m[3]['eval/faults'])}/8: "  # the step's line names the eval's first fault too
    assert head in out_line(train_out, 3) and out_line(train_out, 3).split(head, 1)[1] in reasons
    want = fingerprints(run)
    rep = verlj("replay", run, "--to-step", "3", PYTHONPATH=TESTS, VERLJ_TEST_ENV_FORBID="1")
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert want[3] in rep.stdout
    again = verlj("rerun", run, "--steps", "3:3", "--json", PYTHONPATH=TESTS, VERLJ_TEST_ENV_FORBID="1")  # from step_00002
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads(again.stdout)
    assert report["from_snapshot"] == 2 and [v["verdict"] for v in report["verdicts"]] == ["reproduced"]


@pytest.mark.parametrize("env", ["TupleDigits", "GymDigits"])
def test_an_env_written_with_tuples_trains_on_its_rewards(tmp_path, env):
    """An env whose step returns (observation, reward, done), or gymnasium's 5-tuple (and whose reset
    returns gymnasium's (observation, info)), plays its episodes as a StepResult env does: no fault, the
    env's rewards are the scores, and the same journal as Digits, the env it wraps."""
    over = ["rollout.max_turns=3", ASCII, "trainer.total_steps=2"]
    out = train(tmp_path / env, f"rollout.env=envs_for_tests:{env}", *over, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    samples = [s for step in episodes(tmp_path / env).values() for s in step]
    assert samples and all(s.env_end in (EnvEnd.DONE, EnvEnd.MAX_TURNS, EnvEnd.STOPPED) and s.env_reason == "" for s in samples)
    assert any(s.score > 0 for s in samples) and all(s.score == np.nansum(s.turn_rewards) for s in samples)
    assert all(m["rollout/env/faults"] == 0.0 and m["actor/grad_norm"] > 0 for m in metrics(tmp_path / env).values())
    ref = train(tmp_path / "ref", "rollout.env=envs_for_tests:Digits", *over, PYTHONPATH=TESTS)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert fingerprints(tmp_path / env) == fingerprints(tmp_path / "ref")


def test_an_env_that_always_raises_stops_the_run_and_resume_after_the_fix_is_exact(tmp_path):
    """Every step of the sandbox raising: the step is not committed, the run stops (exit 1) in one line naming
    the fault and how to go on; --resume once it is fixed trains on as the run that never saw the fault."""
    ref, run, down = tmp_path / "ref", tmp_path / "run", tmp_path / "down"
    over = ["rollout.env=envs_for_tests:Sandbox", "rollout.max_turns=2", ASCII, "trainer.save_interval=2"]
    env = {"PYTHONPATH": TESTS, "VERLJ_TEST_SANDBOX_DOWN": str(down)}
    out = train(ref, *over, "trainer.total_steps=4", **env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(x["rollout/faults"] == 0.0 for x in metrics(ref).values()) and "faults 0/" in out_line(out, 4)
    out = train(run, *over, "trainer.total_steps=2", **env)
    assert out.returncode == 0, out.stderr[-3000:]
    down.touch()
    out = train(run, *over, "trainer.total_steps=4", resume=True, **env)
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: step 3: ") and "episodes ended by a fault, more than rollout.max_fault_rate=0.5" \
        " allows: step raised RuntimeError: the sandbox is down" + raised_at(Path(TESTS) / "envs_for_tests.py", 'raise RuntimeError("the sandbox is down")') + \
        ". Nothing of step 3 was committed" in errors[0], out.stderr[-3000:]
    assert f"verlj inspect {run} --step 3" in errors[0]
    assert max(fingerprints(run)) == 2
    down.unlink()
    out = train(run, *over, "trainer.total_steps=4", resume=True, **env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(run) == fingerprints(ref)


def test_a_flood_of_observation_costs_its_cap_and_hanging_envs_one_timeout_a_turn(tmp_path):
    """A megabyte an observation is cut to rollout.max_observation_length tokens, marked; sixteen envs that
    each hang are waited for together: the step costs about one rollout.env_timeout_s, not sixteen."""
    from verlj.engine.rl.episodes import TRUNCATED

    dec = TextDecoder("builtin:tiny", VOCABS["ascii"])
    out = train(tmp_path / "flood", "rollout.env=envs_for_tests:Flood", "rollout.max_turns=2", ASCII, "rollout.max_observation_length=16",
                "trainer.total_steps=1", PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    turns = [t for s in episodes(tmp_path / "flood")[1] for t in s.turns()]
    seen = [t.observation_ids for t in turns if len(t.observation_ids)]
    assert seen and all(len(o) == 16 and dec.decode(o.tolist()) == "x" * (16 - len(TRUNCATED)) + TRUNCATED for o in seen)
    out = train(tmp_path / "hang", "rollout.env=envs_for_tests:Hang", "rollout.max_turns=2", ASCII, "rollout.env_timeout_s=1",
                "rollout.max_fault_rate=1", "trainer.total_steps=1", PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    samples, m = episodes(tmp_path / "hang")[1], metrics(tmp_path / "hang")[1]
    hung = [s for s in samples if s.env_reason == "step no answer in 1.0 s"]
    assert len(hung) > 8 and m["rollout/faults"] == float(len(hung)) and m["actor/skipped_update"] == 1.0
    assert m["timing_s/step"] < 8.0, m["timing_s/step"]  # one after another: 16 s and more


def test_an_env_that_cannot_be_imported_is_one_line_before_training(tmp_path):
    out = train(tmp_path / "run", "rollout.env=no_such_env_module_xyz:Env", "rollout.max_turns=2")
    assert out.returncode == 2
    assert out.stderr.strip() == "error: rollout.env: cannot import 'no_such_env_module_xyz:Env' (No module named 'no_such_env_module_xyz')"
    assert not (tmp_path / "run" / "journal").exists()


COMPLETION = ["rollout.env=envs_for_tests:Logged", "rollout.max_turns=3", ASCII, "rollout.mode=async", "rollout.async_order=completion",
              "trainer.total_steps=3", "trainer.save_interval=2"]


def env_calls(log: Path) -> dict[int, list[tuple[int, str, str]]]:
    """The env calls envs_for_tests.Logged wrote, by env seed: (process, call, action), in order."""
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    pids = list(dict.fromkeys(x["pid"] for x in lines))
    out: dict[int, list] = {}
    for x in lines:
        out.setdefault(x["seed"], []).append((pids.index(x["pid"]), x["call"], x["action"]))
    return out


@pytest.mark.parametrize("point, algo", [("episodes.after_durable:1", "grpo"), ("episodes.before_durable:1", "ppo")])
def test_completion_order_killed_mid_episode_resumes_from_the_last_durable_turn(tmp_path, point, algo):
    """SIGKILL just after step 1's commit (groups asked ahead are mid-episode), --resume, SIGKILL again with
    turns durable and (before_durable) one more stepped but not durable; then --resume to the end. The
    committed steps never change, every group is accounted for, and each episode in flight continues
    from its durable turns: its journaled sample begins with them, and the last process's env saw a
    reset with the episode's seed, the durable actions re-applied in order, then only new turns."""
    run, log = tmp_path / "run", tmp_path / "env.jsonl"
    over = [*COMPLETION, f"algorithm.name={algo}"]
    out = train(run, *over, PYTHONPATH=TESTS, VERLJ_TEST_ENV_LOG=log, VERLJ_FAILPOINT="journal.after_commit:1")
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *over, resume=True, PYTHONPATH=TESTS, VERLJ_TEST_ENV_LOG=log, VERLJ_FAILPOINT=point)
    assert out.returncode == -9, out.stderr[-3000:]
    with Ledger.open_reader(run) as ledger:
        committed = {s: ledger.journal.read_raw(s) for s in range(1, ledger.last_step() + 1)}
        durable = ledger.in_flight.groups()
    assert committed and durable
    out = train(run, *over, resume=True, PYTHONPATH=TESTS, VERLJ_TEST_ENV_LOG=log)
    assert out.returncode == 0, out.stderr[-3000:]
    with Ledger.open_reader(run) as ledger:
        assert {s: ledger.journal.read_raw(s) for s in committed} == committed  # a committed step never changes
    check_accounting(run)  # verify passes; every group asked once, arrived once, trained or dropped once at most
    samples = {int(s.env_seed): s for step in episodes(run).values() for s in step}
    calls, dec = env_calls(log), TextDecoder("builtin:tiny", VOCABS["ascii"])
    restored = 0
    for full in durable.values():
        cut = full.before(sum(v <= max(committed) for v in full.versions))  # a turn from weights never committed is made again
        for k, seed in enumerate(full.env_seed):
            s, last = samples.get(seed), [c for c in calls[seed] if c[0] == 2]
            if s is None or cut is None:  # still in flight at the end; or made again from its start
                continue
            turns, n = len(cut.turn_lens[k]) // 2, len(cut.response_ids[k])
            assert np.array_equal(s.response_ids[:n], cut.response_ids[k]) and np.array_equal(s.gen_logprobs[:n], cut.gen_logprobs[k])
            assert s.env_states.startswith(cut.env_states[k][:-1])  # the durable states (a JSON list) begin the journaled ones
            assert np.array_equal(s.loss_mask[:n], cut.loss_mask[k]) and np.array_equal(s.turn_lens[: 2 * turns], cut.turn_lens[k])
            if cut.env_end[k] != EnvEnd.NONE:  # over before the kill: no env is made for it again
                assert last == [] and s.env_end == cut.env_end[k] and len(s.turn_lens) // 2 == turns
                continue
            actions = [dec.decode(t.action_ids.tolist()) for t in s.turns()]
            # a fresh env reset, the durable actions re-applied in order, then the turns after them, each stepped once
            assert [c[1] for c in last] == ["reset"] + ["step"] * (turns + len(actions) - turns)
            assert [c[2] for c in last[1:]] == actions[:turns] + actions[turns:]
            restored += turns
    assert restored > 0
    for s in samples.values():  # state(): reset's, then one a step it answered, whatever process played the step
        states = json.loads(s.env_states)
        assert states == [{"seed": int(s.env_seed), "turns": t} for t in range(len(s.turns()) + (s.env_end != EnvEnd.STOPPED))]
    first = min(s for s in fingerprints(run) if s > max(committed))
    assert metrics(run)[first]["rollout/env/restored_turns"] >= restored


@pytest.mark.parametrize("order", ["step", "completion"])
def test_async_faulted_episodes_are_never_trained_on(tmp_path, order):
    """Async rollout (either order) leaves faulted episodes out as sync does: dropped with reason fault (and a
    group's lone survivor with them), never consumed, counted in the step that generated them."""
    run = tmp_path / "run"
    out = train(run, "rollout.env=envs_for_tests:Faulty", "rollout.max_turns=3", "rollout.env_timeout_s=0.5", ASCII,
                "rollout.max_fault_rate=1", "rollout.mode=async", f"rollout.async_order={order}", "trainer.total_steps=3",
                PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    records, faulted, consumed = steps_of(run), set(), set()
    for step, samples in episodes(run).items():
        bad = {s.id for s in samples if s.env_end == EnvEnd.FAULT}
        assert bad <= set(records[step].dropped(DropReason.FAULT).tolist())
        assert metrics(run)[step]["rollout/faults"] == float(len(bad))
        faulted |= bad
        consumed |= set(records[step].consumed.ids.tolist())
    assert faulted and consumed and not faulted & consumed


# ----------------------------------------------------------------------------- vLLM and two ranks

WHERE = {"vllm": ["rollout.engine=vllm", "model.tiny.num_heads=2"], "2 ranks": []}  # head size 32: vLLM's CPU attention runs
ORDERS = {"sync": [], "step": ["rollout.mode=async", "rollout.async_order=step"],
          "completion": ["rollout.mode=async", "rollout.async_order=completion"]}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("where", list(WHERE))
def test_episodes_on_vllm_and_two_ranks_killed_then_resumed(tmp_path, where, order):
    """Episodes on vLLM (one rank) and on two ranks (torchrun, gloo; verlj's sampler), in each order: a
    SIGKILL, then --resume. Sync and step order end bit-identical to the uninterrupted run; completion
    order, killed just after step 1's commit (the groups asked ahead mid-episode, their turns durable),
    accounts for every group and brings episodes back from their last durable turn."""
    if where == "vllm":
        pytest.importorskip("vllm")
    ranks = 2 if where == "2 ranks" else 1
    over = ["rollout.env=envs_for_tests:Digits", "rollout.max_turns=3", ASCII, "trainer.total_steps=3", *WHERE[where], *ORDERS[order]]
    run = tmp_path / "run"
    point = "journal.after_commit:1" if order == "completion" else "journal.after_commit:2"  # completion: groups asked ahead mid-episode
    out = train(run, *over, ranks=ranks, PYTHONPATH=TESTS, VERLJ_FAILPOINT=point)
    assert out.returncode != 0 and 1 <= max(fingerprints(run), default=0) < 3, out.stderr[-3000:]
    out = train(run, *over, ranks=ranks, resume=True, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    samples = [s for step in episodes(run).values() for s in step]
    assert {len(s.turn_lens) // 2 for s in samples} >= {1, 2} and all(s.env_end != EnvEnd.FAULT for s in samples)
    engines = {e.rollout.engine for e in steps_of(run).values()}
    assert engines == {"vllm" if where == "vllm" else "hf"}
    if order == "completion":
        check_accounting(run)
        assert sum(m.get("rollout/env/restored_turns", 0.0) for m in metrics(run).values()) > 0
        return
    ref = tmp_path / "ref"
    out = train(ref, *over, ranks=ranks, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(run) == fingerprints(ref)
    assert_same_journal(run, ref)


@pytest.mark.parametrize("mode", [[], ["rollout.mode=async", "rollout.async_order=completion"]], ids=["sync", "completion"])
def test_no_action_is_generated_after_a_reset_fault(tmp_path, mode):
    """An episode whose reset faulted has no turn: nothing generated for it, journaled with its reason and
    left out of the update; the others play on (the held-out eval's too)."""
    run = tmp_path / "run"
    out = train(run, "rollout.env=envs_for_tests:ResetFaulty", "rollout.max_turns=2", ASCII, "rollout.max_fault_rate=1",
                "trainer.total_steps=2", "trainer.eval_interval=2", "data.eval_size=8", *mode, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    samples = [s for step in episodes(run).values() for s in step]
    said = "reset raised ConnectionError: no sandbox for this one" + raised_at(Path(TESTS) / "envs_for_tests.py", 'raise ConnectionError("no sandbox for this one")')
    bad = [s for s in samples if s.env_reason == said]
    assert bad and all(len(s.turn_lens) == 0 and len(s.response_ids) == 0 and s.env_end == EnvEnd.FAULT for s in bad)
    assert all(len(s.turn_lens) >= 2 for s in samples if s not in bad) and len(bad) < len(samples)
    e = evals(run)[2]
    assert set(e.turns[e.env_end == EnvEnd.FAULT].tolist()) <= {0} and (e.turns > 0).any()
    assert e.faults is not None and [f for f, end in zip(e.faults, e.env_end) if end == EnvEnd.FAULT] == [said] * int((e.env_end == EnvEnd.FAULT).sum())
    assert all(f == "" for f, end in zip(e.faults, e.env_end) if end != EnvEnd.FAULT) and e.env_states is None  # no state(): none kept


def test_the_held_out_eval_journals_each_rows_env_states(tmp_path):
    """An env with state(): the eval event keeps each held-out episode's states (reset's, then one a step), as a training
    sample's env_states; no row faulted, so no faults are journaled."""
    run = tmp_path / "run"
    out = train(run, "rollout.env=envs_for_tests:Logged", "rollout.max_turns=2", ASCII, "trainer.total_steps=1", "trainer.eval_interval=1",
                "data.eval_size=4", PYTHONPATH=TESTS, VERLJ_TEST_ENV_LOG=str(tmp_path / "env.log"))
    assert out.returncode == 0, out.stderr[-3000:]
    e = evals(run)[1]
    assert e.faults is None and e.env_states is not None and len(e.env_states) == len(e.rows) == 4
    for states, turns, end in zip(e.env_states, e.turns.tolist(), e.env_end.tolist()):
        assert [st["turns"] for st in json.loads(states)] == list(range(turns + (end != EnvEnd.STOPPED)))


@pytest.mark.parametrize("mode", [[], ["rollout.mode=async", "rollout.async_order=completion"]], ids=["sync", "completion"])
def test_a_group_whose_every_reset_faults_is_journaled_and_never_trained(tmp_path, mode):
    """Every episode of a group faulted at its reset (envs_for_tests.PoolDown: a task's sandboxes down), so no turn was
    played: the group is journaled with its reason, left out of the update, and the run goes on (in completion order such
    a group has no turn's version: its samples carry the policy version it began at; this was an IndexError)."""
    run = tmp_path / "run"
    out = train(run, "rollout.env=envs_for_tests:PoolDown", "rollout.max_turns=2", ASCII, "rollout.max_fault_rate=1",
                "trainer.total_steps=3", *mode, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    groups: dict[int, list] = {}
    for samples in episodes(run).values():
        for smp in samples:
            groups.setdefault(int(smp.group), []).append(smp)
    down = [g for g, ss in groups.items() if all(x.env_end == EnvEnd.FAULT and "the sandbox pool for this task is down" in x.env_reason
                                                  for x in ss)]
    assert down and len(down) < len(groups), (len(down), len(groups))
    assert all(len(x.turn_lens) == 0 and len(x.response_ids) == 0 and x.policy_version >= 0 for g in down for x in groups[g])
    with open_journal_reader(run / "journal") as j:
        consumed = {int(i) for rec in j.iter_steps() if (c := StepEvents.of(rec).consumed) is not None for i in c.ids.tolist()}
    assert consumed and not consumed & {int(x.id) for g in down for x in groups[g]}
    assert cli("verify", run).returncode == 0


def test_two_ranks_train_on_groups_that_faults_left_uneven(tmp_path):
    """2 ranks: groups left uneven by faults are chosen so both ranks get as many samples (the last group
    whose leaving evens the count waits for the next step), never none while some group is valid."""
    run = tmp_path / "run"
    out = train(run, "rollout.env=envs_for_tests:ResetFaulty", "rollout.max_turns=2", ASCII, "rollout.max_fault_rate=1",
                "trainer.total_steps=2", ranks=2, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    for e in steps_of(run).values():
        ids = set(e.consumed.ids.tolist())
        assert ids and len(ids) % 2 == 0 and not ids & set(e.dropped(DropReason.FAULT).tolist())
        assert e.metrics.values["rollout/faults"] > 0


@pytest.mark.parametrize("mode", [[], ["rollout.mode=async", "rollout.async_order=completion"]], ids=["sync", "completion"])
def test_on_a_real_tokenizer_episodes_keep_the_policys_tokens_and_a_kill_resumes_exact(tmp_path, bpe_model, mode):
    """The bpe_model (a byte-level BPE, ChatML): each turn's action is the tokens the policy sampled, never its text
    tokenized again, the observation the env's text tokenized after it. Killed after a commit and resumed: sync mode,
    the same journal and fingerprints; completion order (mid-episode: the groups asked ahead), the committed step
    unchanged and every group accounted for."""
    from transformers import AutoTokenizer

    over = [f"model.actor.model_name_or_path={bpe_model}", "rollout.env=builtin:guess", "rollout.max_turns=3", "rollout.max_response_length=8",
            "trainer.total_steps=3", "trainer.save_interval=1", *mode]
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(bpe_model, local_files_only=True)
    turns = [t for st in episodes(ref).values() for s in st for t in s.turns()]
    assert any(len(s.turn_lens) > 2 for st in episodes(ref).values() for s in st)  # episodes of several turns
    retokenized = [t for t in turns if tok(tok.decode(t.action_ids), add_special_tokens=False).input_ids != t.action_ids.tolist()]
    assert retokenized  # the sampled actions are not the tokenizer's own split: a text round trip would have changed them
    out = train(run, *over, VERLJ_FAILPOINT="journal.after_commit:2")
    assert out.returncode == -9, out.stderr[-3000:]
    with open_journal_reader(run / "journal") as j:
        committed = {s: j.read_raw(s) for s in (1, 2)}
    out = train(run, *over, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    if mode:  # completion order: timing composes the generator's batches; what is committed and accounted for is exact
        with open_journal_reader(run / "journal") as j:
            assert {s: j.read_raw(s) for s in (1, 2)} == committed
        check_accounting(run)
    else:
        assert fingerprints(run) == fingerprints(ref)
        assert_same_journal(run, ref)
