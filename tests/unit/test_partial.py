"""Partial rollouts (rollout.partial) in-process: the sampler continued from token t under the same
weights gives the uninterrupted generation's tokens; the generator's scheduler stopped at any token and
continued, each token's version recorded as runs; the runs codec and the sample's optional column; the
per-token importance weight the loss uses; the durable entries in a real journal; the config's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verlj.engine.config import Config, ConfigError, make_config
from verlj.engine.rl import algorithms
from verlj.engine.rl.models import load_causal_lm
from verlj.engine.rl.partial import Flight, Scheduler, settle, stream_for
from verlj.engine.rl.sampler import Decoder, sample_seeded, sampling_params, seeded_uniforms
from verlj.engine.schema import sample as codec
from verlj.engine.schema.sample import GroupProgress, Sample, extend_runs, runs_through, token_versions, version_runs

L = 40
EOS, PAD = 2, 0
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    cfg = Config()
    cfg.rollout.max_response_length = L
    torch.manual_seed(0)
    return load_causal_lm("builtin:tiny", cfg, 3).eval()


@pytest.fixture(scope="module")
def params():
    cfg = Config()
    cfg.rollout.max_response_length = L
    return sampling_params(cfg)


PROMPTS = [np.random.default_rng(0).integers(3, 15, size=n) for n in (4, 9, 6, 11, 5, 7, 8, 10)]
SEEDS = list(range(100, 108))


def test_continuing_a_generation_from_token_t_under_the_same_weights_gives_the_uninterrupted_tokens(model, params):
    full, full_lp = sample_seeded(model, PROMPTS, SEEDS, params, EOS, PAD, CPU)
    assert max(len(r) for r in full) == L and min(len(r) for r in full) < L  # some ended by eos, some ran to the maximum
    for stop_at in (1, 5, 17):
        dec = Decoder(model, PROMPTS, seeded_uniforms(SEEDS, L), temperature=1.0, top_p=1.0, eos_id=EOS, pad_id=PAD, device=CPU)
        for _ in range(stop_at):
            dec.step()
        head, head_lp = dec.responses()
        going = [i for i, ended in enumerate(dec.ended()) if not ended]
        assert going and all(len(head[i]) == stop_at for i in going)
        offsets = [stop_at] * len(going)
        rest = Decoder(model, [np.concatenate([PROMPTS[i], head[i]]) for i in going], seeded_uniforms([SEEDS[i] for i in going], L, offsets),
                       temperature=1.0, top_p=1.0, eos_id=EOS, pad_id=PAD, device=CPU, budgets=[L - t for t in offsets])
        while not rest.done:
            rest.step()
        tail, tail_lp = rest.responses()
        for k, i in enumerate(going):
            assert np.array_equal(np.concatenate([head[i], tail[k]]), full[i]), (stop_at, i)  # bit for bit: the same tokens
            np.testing.assert_allclose(np.concatenate([head_lp[i], tail_lp[k]]), full_lp[i], atol=1e-5)  # a prefill's rounding
        for i in set(range(len(PROMPTS))) - set(going):
            assert np.array_equal(head[i], full[i])


def _scheduled(model, params, capacity: int, cut_after: list[int]) -> tuple[dict, list]:
    """Flights of PROMPTS (two samples a group) through the scheduler, cut by a push after each of `cut_after`
    steps (the version going up by one at each), then to their ends."""
    sched = Scheduler(stream_for(model, False, EOS, PAD, CPU, capacity), 0)
    for g in range(4):
        sched.ask(Flight.asked(g, PROMPTS[2 * g], SEEDS[2 * g : 2 * g + 2], params))
    sent: list = []
    steps = 0
    for cut in cut_after:
        while steps < cut and sched.busy:
            sched.step(sent.append)
            steps += 1
        sched.cut(sent.append)
        sched.version += 1
    while sched.busy:
        sched.step(sent.append)
    return {m[1]: m for m in sent if m[0] == "group"}, [m for m in sent if m[0] == "partial"]


def test_a_scheduled_generation_stopped_at_pushes_goes_on_to_the_uninterrupted_tokens_each_tokens_version_recorded(model, params):
    """Same prompts, two samples a group: the group's samples are the uninterrupted generation's, whatever the
    pushes and the batches (a batch half spent is made again with the rows waiting); its runs say which version made each token."""
    want = [sample_seeded(model, [PROMPTS[2 * g]] * 2, SEEDS[2 * g : 2 * g + 2], params, EOS, PAD, CPU) for g in range(4)]
    plain, _ = _scheduled(model, params, 8, [])
    cut, partials = _scheduled(model, params, 4, [3, 11])  # two pushes, and a batch of 4 rows: groups wait and batches are made again
    assert partials  # the pushes stopped groups with tokens, reported as they stood
    for g in range(4):
        for got in (plain, cut):
            _, _, responses, logps, oldest, runs = got[g]
            for j in range(2):
                assert np.array_equal(responses[j], want[g][0][j])
                np.testing.assert_allclose(logps[j], want[g][1][j], atol=1e-5)
                assert len(token_versions(runs[j])) == len(responses[j])
            assert oldest == min(int(r[0]) for r in runs)
    spanning = [runs for g in range(4) for runs in cut[g][5] if len(runs) > 2]
    assert spanning  # some sample's tokens came from two versions or more
    for runs in spanning:
        v = token_versions(runs)
        assert np.all(np.diff(v) >= 0) and v[-1] > v[0]  # versions only go up along a sample
    for _, g, responses, _, runs, done in partials:  # a report is the flight as it stood: a prefix of what arrived
        for j in range(2):
            assert np.array_equal(responses[j], cut[g][2][j][: len(responses[j])])
            assert len(token_versions(runs[j])) == len(responses[j])
            assert not done[j] or len(responses[j]) == len(cut[g][2][j])


def test_a_flight_asked_with_progress_goes_on_from_it(model, params):
    t = 3
    seeds = [s for s in range(200, 300) if len(sample_seeded(model, [PROMPTS[0]], [s], params, EOS, PAD, CPU)[0][0]) > t + 2][:2]
    want = sample_seeded(model, [PROMPTS[0]] * 2, seeds, params, EOS, PAD, CPU)
    progress = ([want[0][0][:t], want[0][1][:t]], [want[1][0][:t], want[1][1][:t]], [np.asarray([4, t]), np.asarray([4, t])], [False, False])
    sched = Scheduler(stream_for(model, False, EOS, PAD, CPU, 4), 6)
    sched.ask(Flight.asked(9, PROMPTS[0], seeds, params, progress))
    sent: list = []
    while sched.busy:
        sched.step(sent.append)
    (_, g, responses, _, oldest, runs), = sent
    assert g == 9 and oldest == 4
    for j in range(2):
        assert np.array_equal(responses[j], want[0][j])
        assert runs[j][:2].tolist() == [4, t] and set(token_versions(runs[j])[t:].tolist()) <= {6}


def test_a_flight_whose_durable_tokens_reach_the_length_is_sent_back_as_it_is(model, params):
    """A sample stopped right at rollout.max_response_length has ended: nothing is generated past it."""
    full = [np.arange(L) % 10 + 3, np.arange(L) % 7 + 3]
    progress = (full, [np.zeros(L, np.float32)] * 2, [np.asarray([2, L])] * 2, [False, False])
    sched = Scheduler(stream_for(model, False, EOS, PAD, CPU, 4), 3)
    sched.ask(Flight.asked(5, PROMPTS[0], SEEDS[:2], params, progress))
    sent: list = []
    sched.step(sent.append)
    assert not sched.busy and [m[:2] for m in sent] == [("group", 5)] and [len(r) for r in sent[0][2]] == [L, L]


def test_the_fleets_side_of_a_call_sends_ended_groups_and_requeues_the_rest():
    items = [(None, 40, ("p", "s", None), {}), (None, 44, ("p", "s", None), {}), (None, 48, ("p", "s", None), {})]
    progress = ([np.arange(2)], [np.zeros(2, np.float32)], [np.asarray([1, 2])], [False])
    done = [(0, ("done", [np.arange(3)], [np.zeros(3, np.float32)], 1, [np.asarray([1, 3])])), (1, ("partial", progress))]
    arrivals, partials = [], {}
    back = settle(items, done, arrivals, partials)
    assert [a[0] for a in arrivals] == [40] and list(partials) == [44]
    assert [b[1] for b in back] == [44, 48] and back[0][2][2] is not None and back[1][2][2] is None


def test_version_runs_codec():
    versions = [3, 3, 4, 4, 4, 6]
    runs = version_runs(versions)
    assert runs.tolist() == [3, 2, 4, 3, 6, 1] and token_versions(runs).tolist() == versions
    assert version_runs([]).tolist() == [] and token_versions(np.zeros(0, np.int64)).tolist() == []
    assert extend_runs(runs, 6, 2).tolist() == [3, 2, 4, 3, 6, 3] and extend_runs(runs, 7, 1).tolist() == [3, 2, 4, 3, 6, 1, 7, 1]
    assert extend_runs(runs, 9, 0).tolist() == runs.tolist() and extend_runs([], 2, 5).tolist() == [2, 5]
    assert runs_through(runs, 4).tolist() == [3, 2, 4, 3] and runs_through(runs, 2).tolist() == []
    rng = np.random.default_rng(1)
    for _ in range(50):
        v = np.sort(rng.integers(0, 5, size=rng.integers(0, 30)))
        assert token_versions(version_runs(v)).tolist() == v.tolist()


def test_a_groups_progress_through_a_version_keeps_only_its_tokens_and_reads_back():
    p = GroupProgress(8, 3, [np.arange(5), np.arange(2)], [np.full(5, -1.0, np.float32), np.full(2, -2.0, np.float32)],
                      [np.asarray([2, 3, 3, 2]), np.asarray([2, 2])], [True, True])
    assert p.tokens == 7 and p.oldest == 2
    cut = p.through(2)
    assert [r.tolist() for r in cut.responses] == [[0, 1, 2], [0, 1]] and cut.done == [False, True]
    back = GroupProgress.from_dict(p.to_dict())
    assert back.row == 3 and all(np.array_equal(a, b) for a, b in zip(back.runs, p.runs)) and back.logprobs[0].dtype == np.float32


def test_the_events_hold_partial_and_continued_only_when_set_and_read_them_back():
    from dataclasses import replace

    from verlj.engine.schema import events as ev

    comp = ev.Rollout("hf", None, ev.RolloutMode.ASYNC, 1, ev.AsyncOrder.COMPLETION)
    assert "partial" not in comp.to_event() and "partial" not in comp.mode_fields()  # a run without keeps its bytes
    part = replace(comp, partial=True)
    e = part.to_event()
    assert [k for k in e if k not in ("type", "v")] == ["engine", "version", "mode", "max_staleness", "async_order", "partial"]
    assert ev.Rollout.from_event(e) == part and part.mode_fields()["partial"] is True
    ids = lambda *xs: np.asarray(xs, np.int64)  # noqa: E731
    req = ev.Requests(ids(4, 8), ids(1, 2), ids(4))
    assert "continued" not in req.to_event() and ev.Requests.from_event(req.to_event()).continued.tolist() == []
    went_on = replace(req, continued=ids(8))
    assert list(went_on.to_event())[-1] == "continued" and ev.Requests.from_event(went_on.to_event()).continued.tolist() == [8]


def _sample(i: int, runs=None) -> Sample:
    s = Sample(index=i, prompt_ids=np.arange(3), response_ids=np.arange(4 + i), gen_logprobs=np.full(4 + i, -0.5, np.float32), id=i, group=0,
               policy_version=2)
    if runs is not None:
        s.version_runs = np.asarray(runs, np.int64)
    return s


def test_the_version_column_is_absent_unless_a_sample_has_runs_and_packs_bit_for_bit():
    plain = codec.pack([_sample(0), _sample(1)])
    assert codec.RUNS not in plain and codec.RUNS + "_len" not in plain
    assert _sample(0).token_versions().tolist() == [2] * 4  # no runs: every token is policy_version's
    cols = codec.pack([_sample(0, [2, 1, 3, 3]), _sample(1)])
    back = codec.unpack(cols)
    assert back[0].version_runs.tolist() == [2, 1, 3, 3] and back[1].version_runs.tolist() == []
    assert back[0].same_as(_sample(0, [2, 1, 3, 3])) and not back[0].same_as(_sample(0, [2, 4]))
    assert back[0].token_versions().tolist() == [2, 3, 3, 3] and codec.Columns(cols).padded(codec.RUNS)[1].tolist() == [4, 0]


def test_the_rollout_table_has_each_tokens_version_for_a_run_with_partial_rollouts():
    from verlj.engine.schema import table

    cols = table.step_columns(5, codec.pack([_sample(0, [2, 1, 3, 3]), _sample(1, [2, 5])]), None)
    rows = list(table.rows(cols, partial=True))
    assert [r[table.TOKEN_VERSIONS] for r in rows] == [[2, 3, 3, 3], [2] * 5]
    assert table.TOKEN_VERSIONS not in next(table.rows(cols))  # a table without the column: as before
    pa = pytest.importorskip("pyarrow")
    arrow = table.to_arrow(cols, partial=True)
    assert arrow.schema.field(table.TOKEN_VERSIONS).type == pa.list_(pa.int64())
    assert list(table.rows(table.table_columns(arrow), partial=True)) == rows


def test_the_loss_weights_each_token_by_the_version_that_generated_it():
    """A sample generated by two versions: each token's importance weight is pi_old over the probability the
    version that generated that token gave it (its journaled log-prob), truncated at the threshold; the loss
    is the clipped surrogate times those weights."""
    old = torch.tensor([[-1.0, -1.2, -0.8, -2.0, -0.5]])
    gen = torch.tensor([[-1.1, -1.2, -0.1, -3.5, -0.6]])  # tokens 0-1 by version 3, 2-4 by version 4 (runs [3, 2, 4, 3])
    mask = torch.ones_like(old)
    weights, raw = algorithms.truncated_is_weights(old, gen, mask, 2.0)
    want = torch.exp(old - gen)
    assert torch.allclose(raw, want) and torch.allclose(weights, want.clamp(max=2.0))
    assert weights[0, 3] == 2.0 and weights[0, 2] < 1.0  # truncated where pi_gen was far below pi_old
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 0.5, 2.0, -0.5]])
    loss, _, _ = algorithms.policy_loss(logp, old, adv, mask, 0.2, token_weights=weights)
    loss.backward()
    assert torch.allclose(logp.grad, -(adv * weights) / 5)  # at ratio 1 nothing clips: each token's gradient is -A_t w_t / T


@pytest.mark.parametrize("overrides, says", [
    (["rollout.partial=true"], "in async completion order only"),
    (["rollout.partial=true", "rollout.mode=async"], "in async completion order only"),
    (["rollout.partial=true", "rollout.mode=async", "rollout.async_order=completion", "rollout.env=builtin:guess"],
     "does not combine with rollout.env"),
    (["rollout.partial=true", "rollout.mode=async", "rollout.async_order=completion", "rollout.agent=examples.agents_sdk:main"],
     "does not combine with rollout.agent"),
    (["rollout.max_token_staleness=3"], "applies to rollout.partial=true only"),
    (["rollout.partial=true", "rollout.mode=async", "rollout.async_order=completion", "rollout.max_staleness=2",
      "rollout.max_token_staleness=1"], "at least rollout.max_staleness (2)"),
])
def test_the_config_refuses_partial_rollouts_where_they_do_not_apply(overrides, says):
    with pytest.raises(ConfigError, match=r"\(?" + says.replace("(", r"\(").replace(")", r"\)")):
        make_config(None, overrides)
    ok = make_config(None, ["rollout.partial=true", "rollout.mode=async", "rollout.async_order=completion", "rollout.max_token_staleness=4"])
    assert ok.rollout.partial and ok.rollout.max_token_staleness == 4


def test_partial_is_fixed_for_a_run_and_its_staleness_bound_live():
    from verlj.engine.config import FIXED, LIVE, policy_of

    assert policy_of("rollout.partial") == FIXED and policy_of("rollout.max_token_staleness") == LIVE


def test_the_runs_durable_log_keeps_the_stopped_groups_and_forgets_the_settled(tmp_path):
    """The players' one way to the journal (loop.durable_log.DurableLog over the ledger's in-flight entries): what a push
    stopped is read back as it was kept, a settled group forgotten, and the episodes' entries are another family."""
    import torch

    from verlj.engine.dist import Runtime
    from verlj.engine.loop.durable_log import DurableLog
    from verlj.engine.loop.ledger import Ledger
    from verlj.journal import Journal

    j = Journal.open_writer(tmp_path / "journal")
    log = DurableLog(Runtime(rank=0, world_size=1, local_rank=0, tp_size=1, device=torch.device("cpu"), backend="gloo"), Ledger(j))

    def group(g: int, n: int) -> GroupProgress:
        return GroupProgress(g, 7, [np.arange(n)], [np.full(n, -0.25, np.float32)], [np.asarray([1, n])], [False])

    log.keep_stopped([group(4, 3), group(8, 2)], [])
    log.keep_stopped([group(4, 5)], [8])  # group 4 stopped again, with more tokens; group 8 arrived in a committed step
    back = log.read_stopped()
    assert list(back) == [4] and back[4].responses[0].tolist() == list(range(5)) and back[4].row == 7
    assert log.read_in_flight() == {}  # the episodes' entries are another family
    assert log.attempt(1) == 1  # no process has begun a step yet but this one
    j.close()


# ----------------------------------------------------------------------------- the completion source's side, without a model


class FakeEngine:
    """Completion order's engine calls: each group asked arrives at the next `arrived`, its samples' tokens by
    the versions `runs[group]` says (default: two of version 4)."""

    name, version = "hf", "x"

    def __init__(self, runs: dict[int, list[int]]):
        self.runs, self.asked, self.queue, self.stopped = runs, [], [], []

    def sync(self, cfg, version):
        pass

    def ask(self, groups, cfg, batch_groups, progress=None):
        self.asked.append(([g for g, _, _ in groups], dict(progress or {})))
        self.queue += [g for g, _, _ in groups]

    def arrived(self, wait):
        out = []
        for g in self.queue:
            runs = np.asarray(self.runs.get(g, [4, 2]), np.int64)
            n = int(runs.reshape(-1, 2)[:, 1].sum())
            out.append((g, [np.arange(n) + j for j in range(2)], [np.full(n, -1.0, np.float32)] * 2, int(runs[0]), [runs, runs]))
        self.queue = []
        return out

    def partials(self):
        out, self.stopped = self.stopped, []
        return out


class FakeLog:
    def __init__(self, entries: dict[int, GroupProgress]):
        self.entries, self.writes = entries, []

    def read_stopped(self):
        return dict(self.entries)

    def keep_stopped(self, groups, settled):
        self.writes.append(([g.group for g in groups], sorted(settled)))


class FakeScorer:
    def score(self, rows, n, prompts, responses, logps):
        return [Sample(index=rows[0], prompt_ids=p, response_ids=r, gen_logprobs=lp, score=float(j)) for j, (p, r, lp) in
                enumerate(zip(prompts, responses, logps))]

    def reference_logprobs(self, samples, actor):
        pass


def _source(entries: dict[int, GroupProgress], runs: dict[int, list[int]], bound: int = 1):
    from types import SimpleNamespace

    from verlj.engine.rl.buffer import RolloutBuffer
    from verlj.engine.rl.sources import Parts, make_source

    cfg = make_config(None, ["rollout.mode=async", "rollout.async_order=completion", "rollout.partial=true", "rollout.n=2",
                             "data.prompts_per_step=2", "rollout.max_staleness=1", f"rollout.max_token_staleness={bound}"])
    buffer = RolloutBuffer()
    buffer.request([6, 8], [3, 5], 2)  # asked before the resume and not arrived
    buffer.next_id = 12  # groups 10 and below were asked in committed steps
    draws = iter([np.array([7, 9]), np.array([11, 13])])
    rt = SimpleNamespace(dp_size=1, dp_rank=0, world_size=1, all_gather_obj=lambda x: [x])
    log = FakeLog(entries)
    sampler = SimpleNamespace(draw=lambda k: next(draws), epoch=0, cursor=0)
    parts = Parts(cfg, rt, SimpleNamespace(eos_token_id=2), [], [np.array([1, 2])] * 20, buffer, sampler, FakeScorer(), None, None, log)
    src = make_source(parts)
    src.engine = FakeEngine(runs)  # as a live step's begin would have made it (the trainer's last step: 4)
    return src, parts, log


def _progress(g: int, row: int, versions: list[int]) -> GroupProgress:
    runs = version_runs(versions)
    n = len(versions)
    return GroupProgress(g, row, [np.arange(n)] * 2, [np.zeros(n, np.float32)] * 2, [runs, runs], [False, False])


def test_a_resumed_completion_source_continues_durable_groups_drops_by_the_oldest_token_and_settles_the_rest():
    entries = {6: _progress(6, 3, [3, 3, 4]),  # still asked, same prompt: goes on from its 3 tokens
               8: _progress(8, 99, [4]),  # still asked, but another prompt's entry: asked from its start, forgotten
               2: _progress(2, 1, [2]),  # its samples are in a committed step: forgotten
               12: _progress(12, 7, [4, 4]),  # asked in a step that never committed: taken up when asked again for row 7
               14: _progress(14, 1, [4])}  # the same, but the resumed run asks group 14 for another row
    src, host, log = _source(entries, {6: [3, 2, 4, 2], 8: [2, 1, 4, 3]})
    inputs = src.collect(5)
    first_ask, second_ask = src.engine.asked[0], src.engine.asked[1]
    assert first_ask[0] == [6, 8] and list(first_ask[1]) == [6]  # only group 6 goes on from durable tokens
    assert second_ask[0] == [12, 14] and list(second_ask[1]) == [12]
    assert first_ask[1][6][0][0].tolist() == [0, 1, 2] and second_ask[1][12][2][0].tolist() == [4, 2]
    assert inputs.requests.continued.tolist() == [6, 12] and inputs.requests.regenerated.tolist() == [6, 8]
    # group 8's oldest token is version 2: 5 - 1 - 2 = 2 versions behind the policy step 5 starts from, past the bound 1
    assert inputs.stale.tolist() == [8, 9] and inputs.timings["rollout/dropped_stale"] == 2.0
    assert inputs.timings["rollout/partial/continued_groups"] == 2.0 and inputs.timings["rollout/partial/continued_tokens"] == 10.0
    assert host.buffer.samples[6].version_runs.tolist() == [3, 2, 4, 2] and host.buffer.samples[6].policy_version == 3
    # the push stops group 16 (asked ahead) with tokens: durable before the commit, with its row; groups 2, 8 and 14 forgotten
    host.buffer.request([16], [11], 2)
    src.engine.stopped = [(16, [np.arange(2)] * 2, [np.zeros(2, np.float32)] * 2, [np.asarray([5, 2])] * 2, [False, True])]
    inputs = src.finish_collect(5, inputs)
    assert log.writes == [([16], [2, 8, 14])]
    assert inputs.timings["rollout/partial/stopped_groups"] == 1.0 and inputs.timings["rollout/partial/stopped_tokens"] == 4.0
    src.engine.stopped = []
    src.engine.queue = []
    src.collect(6)  # the groups that arrived in step 5 (committed since) are forgotten at the next durable write
    src.finish_collect(6, inputs)
    assert log.writes[-1] == ([], [6, 8, 12, 14])
