"""The actor's frozen reference (rl.workers.ActorWorker) without DeepSpeed: loaded only when its
log-probs are asked for (a KL term in a live step; a replay reads them from the journal), once, dropped
when a live change stops reading it, loaded again with the same weights when one starts, and no random
stream consumed by the loading."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from verlj.engine.config import make_config
from verlj.engine.dist import Runtime
from verlj.engine.rl import workers
from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm
from verlj.engine.rl.scoring import Scorer
from verlj.engine.rl.workers import ActorWorker, collate, needs_reference
from verlj.engine.schema.sample import Sample

NO_KL = ["model.actor.use_kl_loss=false", "algorithm.kl_coef=0.0"]


class _Engine:
    def __init__(self, module):
        self.module = module
        self.lr_scheduler = None
        self.optimizer = type("O", (), {"param_groups": []})()


def _worker(monkeypatch, cfg, loads: list):
    monkeypatch.setattr(workers, "make_engine", lambda module, *a, **k: _Engine(module))
    rt = Runtime(rank=0, world_size=1, local_rank=0, tp_size=1, device=torch.device("cpu"), backend="gloo")

    def reference():
        loads.append(1)
        torch.rand(1)  # a loader that draws from the global stream: the worker keeps the run's stream untouched
        return load_causal_lm(BUILTIN_TINY, cfg, 7)

    return ActorWorker(load_causal_lm(BUILTIN_TINY, cfg, 7), cfg, rt, reference=reference)


def _sample() -> Sample:
    return Sample(index=0, prompt_ids=np.array([1, 5, 6]), response_ids=np.array([7, 8, 3]), gen_logprobs=np.zeros(3, np.float32),
                  id=0, group=0)


def _batch():
    return collate([_sample()], 0, torch.device("cpu"))


def _scored(cfg, worker) -> Sample:
    """A sample given its reference log-probs by the collect-time scorer (rl.scoring), under `cfg`."""
    s = _sample()
    tok = type("T", (), {"pad_token_id": 0})()
    Scorer.reference_logprobs(SimpleNamespace(cfg=cfg, tokenizer=tok, rt=worker.rt), [s], worker)
    return s


def test_no_kl_term_holds_no_reference(monkeypatch):
    for algo in ("grpo", "rloo", "reinforce_plus_plus"):
        cfg = make_config(None, [f"algorithm.name={algo}", *NO_KL])
        assert not needs_reference(cfg)
        loads: list = []
        worker = _worker(monkeypatch, cfg, loads)
        assert len(_scored(cfg, worker).ref_logprobs) == 0
        assert worker.ref is None and loads == []  # no copy of the actor was made
    with_kl = make_config(None, [])
    assert len(_scored(with_kl, worker).ref_logprobs) == 3 and loads == [1]


def test_kl_term_loads_the_reference_at_its_first_use_once_and_frozen(monkeypatch):
    cfg = make_config(None, [])
    assert needs_reference(cfg)  # GRPO's default KL loss
    loads: list = []
    worker = _worker(monkeypatch, cfg, loads)
    assert loads == [] and worker.ref is None  # a replay (log-probs journaled) never asks for it
    worker.reference_logprobs(_batch())
    assert loads == [1] and worker.ref is not None and worker.ref is not worker.module
    assert not any(p.requires_grad for p in worker.ref.parameters())
    worker.reference_logprobs(_batch())
    assert loads == [1]


def test_a_live_change_drops_and_reloads_the_same_reference(monkeypatch):
    cfg = make_config(None, NO_KL)
    loads: list = []
    worker = _worker(monkeypatch, cfg, loads)
    with torch.no_grad():  # the actor trains away from its start: the reference must not follow
        for p in worker.module.parameters():
            p.add_(0.01)
    with_kl = make_config(None, [])
    worker.set_config(with_kl)
    torch.manual_seed(5)
    want_stream = torch.rand(4)
    torch.manual_seed(5)
    got = worker.reference_logprobs(_batch())
    assert torch.equal(torch.rand(4), want_stream)  # loading drew nothing from the run's stream
    assert loads == [1]
    fresh = ActorWorker.logprobs(worker, _batch(), model=load_causal_lm(BUILTIN_TINY, with_kl, 7).eval())
    assert torch.equal(got, fresh) and not torch.equal(got, worker.logprobs(_batch()))
    worker.set_config(cfg)
    assert worker.ref is None  # dropped with the KL term
