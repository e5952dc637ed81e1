"""What-ifs: re-train a run's steps on its journaled samples under another config, without generating.

    verlj whatif RUN --from-step A [--to-step B] -o NEW model.actor.optim.lr=5e-4

NEW starts from RUN's state after step A (materialized as `replay --fork` does) and trains steps
A+1..B, keeping RUN's step numbers, on the samples RUN journaled for them: the same prompts,
responses and generation log-probs, in the same order, fed to the same ``take`` and ``apply`` that
replay feeds (a :class:`WhatifSource` stands where ``collect`` stands in the train loop). The
samples are scored again with the what-if's reward function (its rule reward; a reward model's
journaled scores are kept), and with ``algorithm.dynamic_sampling`` the groups whose scores then do
not vary are left out (sync runs). Only the keys config.WHATIF_KEYS names (and bookkeeping) may
change; eval never runs (it would generate).

NEW is a real run (journal, snapshots, lineage naming RUN and A) whose identity says it is
counterfactual (ledger.identity.counterfactual): forking it is refused, since its samples were not drawn by
its own policy; `verlj train -o NEW --resume` continues the what-if from RUN's journal.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from verlj.journal import StepRecord, open_journal_reader

from ..config import Config, check_whatif, check_whatif_keys, make_config
from ..errors import RunError
from ..schema.sample import Sample
from .context import Run
from .ledger import Ledger, check_local_dir, journal_dir
from .reader import StepReader
from .records import Counterfactual


def refuse_counterfactual(ledger: Ledger, run_dir: Path, what: str, instead: str) -> None:
    """A what-if is never forked, nor made the base of another what-if: one sentence (`what` it
    cannot be; `instead`: what to do to its parent run)."""
    cf = ledger.identity.whatif_of()
    if cf is not None:
        raise RunError(f"{run_dir} is a what-if of {cf.run} (its samples were not drawn by its own policy): it cannot be {what}; "
                       f"{instead} {cf.run} instead")


def whatif_config(old: dict, overrides: list[str], to_step: int, new_run: Path) -> tuple[Config, list[str]]:
    """A what-if's config: RUN's (`old`, in force at its first step) with the overrides, checked by
    config.check_whatif; trainer.total_steps is the last step it trains. Returns (config, changed keys)."""
    cfg = make_config(None, [*overrides, f"trainer.total_steps={to_step}"], base=old)
    changed = [k for k in check_whatif(old, cfg) if k != "trainer.total_steps"]
    if "algorithm.dynamic_sampling" in changed and cfg.rollout.mode == "async":
        raise RunError("algorithm.dynamic_sampling cannot change in a what-if of an async run: its steps' plans were made "
                       "when the batches were generated")
    check_local_dir(new_run, cfg.journal)
    return cfg, changed


class WhatifSource:
    """Stands where the run's rollout source collects in the train loop: each step's inputs read from RUN's
    journal (reader.StepReader: rank 0 reads, the others receive them), its samples scored with the
    what-if's reward."""

    def __init__(self, run: Run, parent: Path):
        self.run, self.parent = run, Path(parent)
        self.ledger: Ledger | None = None  # RUN's (the parent's), rank 0's
        if run.rt.is_main:
            if not (journal_dir(parent)).exists():
                raise RunError(f"{run.run_dir} is a what-if of {parent}, whose journal is gone: it cannot go on")
            self.ledger = Ledger(open_journal_reader(journal_dir(parent)))
        self.reader = StepReader(self.ledger.journal if self.ledger is not None else None, run.rt)

    def collect(self, step: int):
        """Step `step`'s inputs from RUN's journal, its samples scored again, and whether the update
        corrects for the policy that generated them no longer being the one it starts from (the state
        now differs from RUN's after step - 1): the async objective's truncated importance weights."""
        from ..rl.inputs import StepInputs
        from ..schema import sample as sample_codec

        trainer = self.run.trainer

        def check(record: StepRecord) -> None:
            if record.pruned:
                raise RunError(f"step {step}'s samples were pruned from {self.parent}'s journal (journal.retain_samples)")

        def theirs_before() -> str | None:
            assert self.ledger is not None  # rank 0's
            return self.ledger.fingerprint_at(step - 1) or self._origin(step - 1)

        record = self.reader.read(step, f"reading step {step} of {self.parent}", check)
        theirs = self.run.rt.from_rank0(theirs_before, f"reading the fingerprint of step {step - 1} of {self.parent}")
        inputs = StepInputs.from_record(record)
        mine, _ = trainer.state_fingerprint()
        inputs.rollout = dataclasses.replace(inputs.rollout, whatif=True, whatif_correction=mine != theirs)
        added = sample_codec.unpack(inputs.added)
        trainer.rescore(added)
        inputs.added = sample_codec.pack(added)
        if trainer.cfg.algorithm.dynamic_sampling and not inputs.rollout.is_async:
            self._filter(inputs, added)
        trainer.advance_sampler(inputs)
        return inputs

    def _filter(self, inputs, added: list[Sample]) -> None:
        """Dynamic sampling on the scores given again: the consumed groups whose scores do not vary are
        dropped, and groups trimmed from the end so every data-parallel rank gets as many samples."""
        known = {**self.run.trainer.buffer.samples, **{s.id: s for s in added}}
        groups: dict[int, list[int]] = {}
        for i in inputs.consumed.tolist():
            groups.setdefault(known[i].group, []).append(i)
        keep = [ids for ids in groups.values() if len({known[i].score for i in ids}) > 1]
        while keep and sum(map(len, keep)) % self.run.rt.dp_size:
            keep.pop()
        kept = [i for ids in keep for i in ids]
        gone = sorted(set(inputs.consumed.tolist()) - set(kept))
        if gone:
            import numpy as np

            inputs.consumed = np.asarray(kept, np.int64)
            inputs.dropped = np.concatenate([inputs.dropped, np.asarray(gone, np.int64)])

    def finish_collect(self, step: int, inputs):
        return inputs

    def _origin(self, step: int) -> str | None:
        """RUN's fingerprint after its base step (a fork's), from its parent record."""
        assert self.ledger is not None  # rank 0's
        parent = self.ledger.identity.parent_run()
        return parent.fingerprint if parent is not None and parent.step == step else None

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()


def resume_source(run: Run, counterfactual: dict, changed: list[str]) -> WhatifSource:
    """`verlj train -o NEW --resume` of a what-if: it goes on training on its parent's samples. The
    config keys its resume changes (`changed`) must be ones a what-if may change. `counterfactual`:
    the ledger's record of it, as it reached this rank (Counterfactual.to_dict)."""
    check_whatif_keys(changed)
    return WhatifSource(run, Path(Counterfactual.from_dict(counterfactual).run))
