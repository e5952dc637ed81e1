"""What the post-mortem readers share: views of plain maps as frozen dataclasses, and the words for a
topology boundary (inspect's summary and diff both print them). No torch here.
"""

from __future__ import annotations

from dataclasses import fields

from ..loop.records import TopologyChange

TIMING = "timing_s/"  # the prefix of the wall-time metrics: diff leaves them aside


def _view(cls, d: dict):
    """`cls` (a frozen dataclass) over a plain map another module keeps (the ledger's identity and
    snapshot entries, a probe file's, a rollout-table row): the keys its fields name; a key `d` lacks is the field's default."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def _json(view) -> dict:
    """A view's fields as a map, in their order (the values as they are)."""
    return {f.name: getattr(view, f.name) for f in fields(view)}


def topology_line(entry: dict) -> str:
    """One topology boundary of the ledger's history (an entry of ledger.identity.topology_history), in words."""
    change = TopologyChange.from_dict(entry)
    said = f"from step {change.from_step}: {change.before} -> {change.topology}"
    if change.checked_steps:
        w = change.max_deviation
        said += (f"; {change.checked_steps} replayed step(s) agreed with the journal within the tolerance "
                 f"(largest deviation {0 if w is None else w.deviation:.3g}, {None if w is None else w.metric})")
    return said + "; bits differ from here by design, the new fingerprints are the reference"
