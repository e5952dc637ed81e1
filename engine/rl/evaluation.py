"""The held-out eval: the policy after a step's update on the held-out prompts (``trainer.eval_interval``).
Live steps only (it generates); replay reads the journaled ``eval`` event back.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..schema import events as ev
from ..schema.sample import EnvEnd, states_text
from ..state.seeding import derive_seed
from .core import Core
from .data import Dataset
from .envs import EnvFactory, row_of
from .episodes import Limits, Round, play_lockstep
from .rewards import scored_or_faults
from .sampler import sample_seeded, sampling_params


class Evaluated(Core, Protocol):
    """What the eval reads of the trainer (rl.trainer conforms)."""

    @property
    def data(self) -> Dataset: ...

    @property
    def held_out_ids(self) -> list[np.ndarray]: ...

    def envs(self) -> EnvFactory: ...


def evaluate(tr: Evaluated, step: int) -> tuple[dict[str, float], dict, str]:
    """The policy after step `step`'s update on the held-out prompts: one response each, at
    rollout.eval_temperature (0: greedy; else each from its own seed), scored by the task's own
    scorer (reasoning-gym; rollout.answer_format) or else the rule reward. With rollout.env, each
    held-out prompt is an episode instead (:meth:`_eval_episodes`), scored as training scores one.
    Returns (metrics: eval/score/mean, per task eval/score/TASK/mean for reasoning-gym, and
    eval/response_length/mean, eval/faults (rows an env or the reward function failed: scored 0.0);
    with rollout.env also eval/env/turns/mean and eval/env/faults; the `eval` event with every row's response and score, each
    row's fault where one faulted, and with rollout.env each row's turns (and its env's states, for an env with state());
    what the step's log line adds: ``eval faults 2/8: REASON``, the first faulted row's reason, "" without one).
    Live steps only: replay reads them back. Draws from no stream training uses. Collective."""
    cfg, rt, held, tok = tr.cfg, tr.rt, tr.data.held_out, tr.tokenizer
    mine = np.array_split(np.arange(len(held)), rt.dp_size)[rt.dp_rank]
    rows = mine if len(mine) else np.zeros(1, np.int64)  # a rank with no row still steps with the others (ZeRO-3, TP)
    params = {**sampling_params(cfg), "temperature": cfg.rollout.eval_temperature}
    seeds = [derive_seed(cfg.trainer.seed, step, "eval", int(i)) for i in rows]
    if cfg.rollout.env is not None:
        responses, scores, turns, faulted = _eval_episodes(tr, step, rows, seeds, params)
        responses, scores, turns, faulted = responses[: len(mine)], scores[: len(mine)], turns[: len(mine)], faulted[: len(mine)]
    else:
        responses, _ = sample_seeded(tr.actor.module, [tr.held_out_ids[i] for i in rows], seeds, params, tok.eos_token_id,
                                     tok.pad_token_id, rt.device, all_done=rt.all_true)
        responses = responses[: len(mine)]
        prompts = [held[i].prompt for i in mine]
        scores, faulted = scored_or_faults(tr.scorer.eval_scorer or tr.scorer.reward_fn, prompts,
                                           [tok.decode(r, skip_special_tokens=True) for r in responses], [held[i] for i in mine])
        turns = None
    gathered = rt.all_gather_obj((mine.tolist(), scores, [r.tolist() for r in responses], turns, faulted))
    out_rows, out_scores, out_resp, out_faults = [], [], [], []
    out_turns: list[tuple[list[int], int, str | None]] = []
    for r, (g_rows, g_scores, g_resp, g_turns, g_faults) in enumerate(gathered):
        if r % rt.tp_size == 0:  # TP peers evaluated the same rows
            out_rows += g_rows
            out_scores += g_scores
            out_resp += g_resp
            out_turns += g_turns or []
            out_faults += g_faults
    score = np.asarray(out_scores, np.float64)
    # a row its env or its reward function failed scores 0.0 here, counted (rl.faults): the eval trains nothing
    metrics = {"eval/score/mean": float(score.mean()), "eval/faults": float(sum(map(bool, out_faults))),
               "eval/response_length/mean": float(np.mean([len(x) for x in out_resp]))}
    tasks = [held[i].task for i in out_rows]
    if len(set(tasks)) > 1 or tasks[0]:
        for task in sorted(set(tasks)):
            metrics[f"eval/score/{task}/mean"] = float(score[[t == task for t in tasks]].mean())
    episode: dict[str, Any] = {}
    if turns is not None:
        ends = np.asarray([end for _, end, _ in out_turns], np.int64)
        metrics.update({"eval/env/turns/mean": float(np.mean([len(lens) // 2 for lens, _, _ in out_turns])),
                        "eval/env/faults": float(np.sum(ends == EnvEnd.FAULT))})
        states = [st for _, _, st in out_turns]  # an env with state(): each row's, as a sample's env_states
        episode = {"turn_lens": np.asarray([n for lens, _, _ in out_turns for n in lens], np.int64),
                   "turns": np.asarray([len(lens) // 2 for lens, _, _ in out_turns], np.int64), "env_end": ends,
                   "env_states": [st or "" for st in states] if any(st is not None for st in states) else None}
    event = ev.Eval(rows=np.asarray(out_rows, np.int64), scores=score, response_ids=np.asarray([t for x in out_resp for t in x], np.int32),
                    response_len=np.asarray([len(x) for x in out_resp], np.int64), faults=out_faults if any(out_faults) else None,
                    **episode).to_event()
    first = next((f for f in out_faults if f), "")
    return metrics, event, f"eval faults {sum(map(bool, out_faults))}/{len(out_faults)}: {first}" if first else ""

def _eval_episodes(tr: Evaluated, step: int, rows: np.ndarray, seeds: list[int], params: dict) -> tuple[list[np.ndarray], list[float], list, list[str]]:
    """rollout.env's held-out eval: held-out row `rows[k]` played as an episode (a Round, as training
    plays one), turn 0 generated from `seeds[k]` (the single-turn eval's seed), turn t > 0 from
    ``derive_seed(seed, step, "eval", row, t)``, the env reset with ``derive_seed(seed, step,
    "eval/env", row)``. Scored as training scores an episode: the env's rewards summed, plus the rule
    reward of the last action when rollout.reward_fn is named (reward_fn_named). Returns each
    episode's (response ids: actions and observations, score, (turn_lens, env_end, env_states: None where its env has no
    state()), its fault: "" none). Collective: the
    ranks generate each turn together while any rank has an episode going."""
    cfg, rt, held, tok = tr.cfg, tr.rt, tr.data.held_out, tr.tokenizer
    examples = [held[int(i)] for i in rows]
    env_seeds = [derive_seed(cfg.trainer.seed, step, "eval/env", int(i)) for i in rows]
    eps = Round(tr.envs(), [row_of(ex) for ex in examples], env_seeds, [tr.held_out_ids[int(i)] for i in rows], tok,
                Limits.of(cfg.rollout))

    def generate(contexts: list[np.ndarray], turn_seeds: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return sample_seeded(tr.actor.module, contexts, turn_seeds, params, tok.eos_token_id, tok.pad_token_id, rt.device, all_done=rt.all_true)

    def seed_of(i: int, turn: int) -> int:
        return seeds[i] if turn == 0 else derive_seed(cfg.trainer.seed, step, "eval", int(rows[i]), turn)

    play_lockstep(eps, generate, seed_of, rt.all_true)
    scores = [eps.env_score(k) for k in range(len(rows))]
    faulted = [ep.reason if ep.end == EnvEnd.FAULT else "" for ep in eps.episodes]
    if tr.scorer.reward_fn_named():
        rule, bad = scored_or_faults(tr.scorer.reward_fn, [ex.prompt for ex in examples], [ep.last_action for ep in eps.episodes], examples)
        scores = [s + r for s, r in zip(scores, rule)]
        faulted = [f or b for f, b in zip(faulted, bad)]
    ends = [int(EnvEnd.MAX_TURNS) if ep.live else ep.end for ep in eps.episodes]  # as Round.fields says it
    return ([np.asarray(ep.response, np.int64) for ep in eps.episodes], scores,
            [(list(ep.turn_lens), end, None if ep.states is None else states_text(ep.states)) for ep, end in zip(eps.episodes, ends)], faulted)
