"""Scoring samples at collect time: the rule reward (``rollout.reward_fn``), the frozen reward model's
score, an episode's score (the env's rewards), and the frozen reference's log-probs, journaled with
each sample. Every rollout source (``rl.sources``) scores through one :class:`Scorer`; ``verlj rerun``
and what-ifs score journaled samples again through it too (:meth:`Scorer.rescore`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..config import Config
from ..dist import Runtime
from ..schema.sample import Sample
from .data import Dataset, Example
from .episodes import Round
from .models import load_reward_model, model_digest
from .rewards import load_reward_fn, reward_model_scores, scored_or_faults
from .tasks import TaskScorer
from .workers import ActorWorker, collate, needs_reference

__all__ = ["Scorer", "needs_reference"]


class Scorer:
    """The reward of a response or an episode, by the config in force (`set_config` follows it)."""

    def __init__(self, cfg: Config, rt: Runtime, tokenizer: Any, data: Dataset) -> None:
        self.cfg, self.rt, self.tokenizer, self.data = cfg, rt, tokenizer, data
        self.dataset: list[Example] = data.train
        self.reward_fn = self._reward_fn(cfg)
        # the eval pass scores with the task's own scorer (reasoning-gym), else with the rule reward
        self.eval_scorer = TaskScorer(data.task_dataset, cfg.rollout.answer_format) if data.task_dataset is not None else None
        self.rm = None
        self.rm_digest = None
        if cfg.model.reward_model.model_name_or_path:
            model, tok = load_reward_model(cfg.model.reward_model.model_name_or_path)
            self.rm_digest = model_digest(cfg.model.reward_model.model_name_or_path)
            self.rm = (model.to(rt.device).eval(), tok)
            for p in self.rm[0].parameters():
                p.requires_grad_(False)

    def set_config(self, cfg: Config) -> None:
        if (cfg.rollout.reward_fn, cfg.rollout.answer_format) != (self.cfg.rollout.reward_fn, self.cfg.rollout.answer_format):
            self.reward_fn = self._reward_fn(cfg)
            if self.eval_scorer is not None:
                self.eval_scorer.answer_format = cfg.rollout.answer_format
        self.cfg = cfg

    def _reward_fn(self, cfg: Config) -> Callable[..., Any]:
        return load_reward_fn(cfg.rollout.reward_fn, cfg.data.train_dataset, self.data.task_dataset, cfg.rollout.answer_format)

    def rewards(self, rows: list[int], prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], model: bool = True,
                scored: list[str] | None = None) -> tuple[list[float], list[float] | None, list[str]]:
        """(rule rewards, reward model scores: None when `model` is false or there is no reward model,
        each rule reward's fault: "" none, else the sample's: rl.faults) of each response to the prompt
        of dataset row `rows[k]`. `scored`: the texts the rule reward scores instead of the responses'
        (an episode's: its last action)."""
        tok = self.tokenizer
        texts_p = [tok.decode(p, skip_special_tokens=True) for p in prompts]
        texts_r = [tok.decode(r, skip_special_tokens=True) for r in responses]
        rule, faulted = scored_or_faults(self.reward_fn, texts_p, texts_r if scored is None else scored, [self.dataset[i] for i in rows])
        rm = None
        if model and self.rm is not None:
            rm = reward_model_scores(self.rm[0], self.rm[1], [p + r for p, r in zip(texts_p, texts_r)], self.rt.device)
        return rule, rm, faulted

    def rescore(self, samples: list[Sample], model: bool = False) -> None:
        """`verlj rerun`, what-ifs: score journaled samples again, in place, with the reward function the
        config names now (and the reward model with `model`; else its journaled scores are kept), as
        collect scored them: score = rule_reward + weight * rm_score. Reads, generates nothing."""
        if not samples:
            return
        tok, named = self.tokenizer, self.reward_fn_named()
        scored = [tok.decode(s.turns()[-1].action_ids, skip_special_tokens=True) if s.is_episode else tok.decode(s.response_ids, skip_special_tokens=True)
                  for s in samples]
        rule, rm, faulted = self.rewards([int(s.index) for s in samples], [s.prompt_ids for s in samples],
                                         [s.response_ids for s in samples], model, scored)
        w = self.cfg.model.reward_model.weight
        for k, s in enumerate(samples):
            s.rule_reward = (s.env_score() + (rule[k] if named else 0.0)) if s.is_episode else rule[k]
            s.fault = faulted[k] if named or not s.is_episode else ""
            if rm is not None:
                s.rm_score = rm[k]
            s.score = s.rule_reward + w * s.rm_score

    def reward_fn_named(self) -> bool:
        """Whether the config names rollout.reward_fn (anything but `auto`): an episode's score then adds
        its rule reward to the env's rewards; with `auto` the env's rewards alone score an episode."""
        return self.cfg.rollout.reward_fn != "auto"

    def score_episodes(self, mine: Sequence[int] | np.ndarray, group_size: int, eps: Round) -> list[Sample]:
        """An episode's score: the env's rewards summed over its turns (turns without one count 0), plus
        the rule reward of its last action when rollout.reward_fn is named (reward_fn_named), plus the
        reward model's weighted score of the whole episode."""
        rows = [int(i) for i in mine for _ in range(group_size)]
        fields = [eps.fields(k) for k in range(len(rows))]
        named = self.reward_fn_named()
        rule: list[float] = [0.0] * len(rows)
        rm: list[float] | None = None
        faulted = [""] * len(rows)
        if named or self.rm is not None:
            rule, rm, faulted = self.rewards(rows, [ep.prompt_ids for ep in eps.episodes[: len(rows)]],
                                    [np.asarray(ep.response, np.int64) for ep in eps.episodes[: len(rows)]],
                                    scored=[ep.last_action for ep in eps.episodes])
        rm = rm or [0.0] * len(rows)
        w = self.cfg.model.reward_model.weight
        out = []
        for k, f in enumerate(fields):
            reward = eps.env_score(k) + (rule[k] if named else 0.0)
            out.append(Sample(index=rows[k], id=0, group=0, score=reward + w * rm[k], rule_reward=reward, rm_score=rm[k],
                              fault=faulted[k] if named else "", **f))
        return out

    def score(self, mine: Sequence[int] | np.ndarray, group_size: int, prompts: list[np.ndarray], responses: list[np.ndarray],
              logps: list[np.ndarray]) -> list[Sample]:
        """Single-turn samples of the dataset rows `mine` (`group_size` each), scored."""
        rows = [int(i) for i in mine for _ in range(group_size)]
        rule, rm, faulted = self.rewards(rows, prompts, responses)
        rm = rm or [0.0] * len(rule)
        w = self.cfg.model.reward_model.weight
        return [Sample(index=rows[k], prompt_ids=prompts[k], response_ids=responses[k], gen_logprobs=logps[k], id=0, group=0,
                       score=rule[k] + w * rm[k], rule_reward=rule[k], rm_score=rm[k], fault=faulted[k]) for k in range(len(prompts))]

    def reference_logprobs(self, samples: list[Sample], actor: ActorWorker) -> None:
        """The frozen reference's log-probs of each response, computed once at collect time and
        journaled with the sample: they depend on nothing the update changes, so replay reads them."""
        if not samples:
            return
        if not needs_reference(self.cfg):
            for s in samples:
                s.ref_logprobs = np.zeros(0, dtype=np.float32)
            return
        batch = collate(samples, self.tokenizer.pad_token_id, self.rt.device)
        ref = actor.reference_logprobs(batch).float().cpu().numpy()
        for i, s in enumerate(samples):
            s.ref_logprobs = ref[i, : len(s.response_ids)].astype(np.float32)
