"""Post-mortem: what a run did, step by step, read from its journal (also while it trains).

    verlj inspect RUN                      # summary: config, versions, steps, snapshots, lineage, trend
    verlj inspect RUN --step 1247          # everything journaled at step 1247, samples as text
    verlj metrics RUN --names actor/pg_loss --steps 100:200 [--csv | --jsonl | --plot out.png]
    verlj find RUN --where 'actor/grad_norm > 10'
    verlj diff RUN_A RUN_B                 # the first step where two runs differ, and what differs

Metrics, find and diff read the journal's summary sub-database (no samples), so they stream a long
run quickly; a single step is one key lookup.
"""

from __future__ import annotations

import json
import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import diff_configs
from ..errors import RunError
from ..loop import archive
from ..loop.ledger import Ledger, open_run, writer_dir
from ..rl import samples as table
from ..schema.events import StepEvents
from ..state.manifest import check_snapshot
from . import derived
from .steps import parse_steps, ranges


def check_range(ledger: Ledger, step: int) -> None:
    first, last = ledger.base_step() + 1, ledger.last_step()
    if not first <= step <= last:
        raise RunError(f"step {step} is out of range: this run has steps {first}–{last}")


# ----------------------------------------------------------------------------- summary


def run_summary(run_dir: Path, trend_points: int = 20) -> dict:
    run_dir = Path(run_dir)
    with open_run(run_dir) as ledger:
        meta = ledger.identity()
        lineage = ledger.lineage()
        topology = ledger.topology_history()
        quarantined = ledger.quarantined()
        missing = ledger.missing()
        last, base = ledger.last_step(), ledger.base_step()
        index = ledger.snapshots()
        ranks_now = ledger.topology_at(last)["world_size"]
        last_summary = ledger.journal.read_summary(last) if last > base else None
        rollout = last_summary.first("rollout") if last_summary else None
        engine = {k: rollout[k] for k in ("engine", "version", "mode", "max_staleness", "async_order") if k in rollout} if rollout else \
            {"engine": ledger.config_at(last).get("rollout", {}).get("engine", "hf"), "version": None}
        trend = []
        if last > base:
            steps = sorted({int(x) for x in np.linspace(base + 1, last, num=min(trend_points, last - base))})
            for s in steps:
                summ = ledger.journal.read_summary(s)
                values = summ.metrics if summ else {}
                trend.append({"step": s, "reward": values.get("critic/score/mean"), "loss": values.get("actor/pg_loss")})
    snaps = []
    names = {p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("step_")} | {i["path"] for i in index.values()}
    indexed = {i["path"] for i in index.values()}
    for name in sorted(names):
        res = check_snapshot(run_dir / name, hash_files=False)
        snaps.append({"name": name, "indexed": name in indexed, "valid": res.valid, "problem": res.problems[0] if res.problems else None})
    return {
        "run": str(run_dir),
        "config_hash": meta.get("config_hash"),
        "config": meta.get("config"),
        "versions": meta.get("versions"),
        "world_size": ranks_now,
        "world_size_at_start": meta.get("world_size"),
        "rollout": engine,
        "created": meta.get("created"),
        "steps_committed": last - base,
        "first_step": base + 1 if last > base else None,
        "last_step": last,
        "snapshots": snaps,
        "lineage": lineage,
        "topology": topology,
        "writer": _writer(run_dir),
        "quarantined": quarantined,
        "missing": missing,
        "trend": trend,
        "probes": derived.probes(run_dir),
        "counterfactual": meta.get("counterfactual"),
    }


def _writer(run_dir: Path) -> dict | None:
    """The run's latest writer claim (journal.claim): who trains it, or trained it last."""
    from verlj.journal.claim import current

    found = current(writer_dir(run_dir))
    if found is None or found[1] is None:
        return None
    epoch, data = found
    return {"epoch": epoch, **{k: data.get(k) for k in ("host", "pid", "command", "claimed", "released")}}


def topology_line(entry: dict) -> str:
    """One topology boundary of the ledger's history, in words."""
    from ..state.topology import Topology

    said = f"from step {entry['from_step']}: {Topology(**entry['from'])} -> {Topology(**entry['topology'])}"
    if entry.get("checked_steps"):
        w = entry.get("max_deviation") or {}
        said += (f"; {entry['checked_steps']} replayed step(s) agreed with the journal within the tolerance "
                 f"(largest deviation {w.get('deviation', 0):.3g}, {w.get('metric')})")
    return said + "; bits differ from here by design, the new fingerprints are the reference"


def sparkline(values: list[float | None]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append("·")
        else:
            out.append(bars[0 if hi == lo else int((v - lo) / (hi - lo) * (len(bars) - 1))])
    return "".join(out)


def render_summary(s: dict) -> str:
    cfg = s["config"] or {}
    started_on = "" if s["world_size"] == s["world_size_at_start"] else f" (started on {s['world_size_at_start']})"
    lines = [
        f"run        {s['run']}",
        f"config     hash {s['config_hash']}  algorithm {cfg.get('algorithm', {}).get('name')}  "
        f"zero {cfg.get('distributed', {}).get('zero_stage')}  tp {cfg.get('distributed', {}).get('tensor_parallel_size')}  "
        f"actor {cfg.get('model', {}).get('actor', {}).get('model_name_or_path')}",
        "versions   " + "  ".join(f"{k} {v}" for k, v in (s["versions"] or {}).items()),
        f"ranks      {s['world_size']}{started_on}   created {s['created']}",
        f"rollout    {s['rollout']['engine']}" + ("" if not s["rollout"]["version"] else
                                                    f" (transformers {s['rollout']['version']})" if s["rollout"]["engine"] == "hf"
                                                    else f" {s['rollout']['version']}")
        + (f", async ({_order(s['rollout'])}max_staleness {s['rollout']['max_staleness']})" if s["rollout"].get("mode") == "async" else ""),
        f"steps      {s['steps_committed']} committed, last step {s['last_step']}",
    ]
    if s.get("counterfactual"):
        cf = s["counterfactual"]
        changed = ", ".join(cf["overrides"]) if cf["overrides"] else "nothing (RUN's own config)"
        lines.insert(1, f"what-if    COUNTERFACTUAL: steps {cf['from_step'] + 1}–{cf['to_step']} re-trained on the samples of "
                        f"{cf['run']} (not drawn by this run's policy), changed: {changed}")
    if s["snapshots"]:
        lines.append("snapshots  " + "  ".join(
            f"{x['name']}{'' if x['valid'] else ' ✗ ' + x['problem']}{'' if x['indexed'] else ' (unindexed)'}" for x in s["snapshots"]))
    else:
        lines.append("snapshots  none")
    if s.get("writer"):
        w = s["writer"]
        lines.append(f"writer     pid {w['pid']} on {w['host']} (writer epoch {w['epoch']}, claimed {w['claimed']}"
                     f"{', released' if w['released'] else ''})")
    for q in s.get("quarantined", []):
        lines.append(f"quarantine {q['name']} ({q['reason']}) moved to {q['path']}")
    for m in s.get("missing", []):
        lines.append(f"missing    {m['name']} was {m['reason']}: a resume removed it from the index")
    for entry in s["lineage"]:
        if entry["kind"] == "start":
            continue
        if entry["kind"] == "fork":
            lines.append(f"lineage    forked from {entry['parent']['run']} at step {entry['parent']['step']}")
        elif entry["kind"] == "whatif":
            lines.append(f"lineage    a what-if of {entry['parent']['run']} from its step {entry['parent']['step']}")
        else:
            changes = f", config changes: {', '.join(entry['config_changes'])}" if entry.get("config_changes") else ""
            asked = f" (asked: trainer.resume_from={entry['resume_from']})" if entry.get("resume_from") else ""
            lines.append(f"lineage    resumed after step {entry['at_step']} from snapshot step {entry['snapshot_step']}{asked} "
                         f"at {entry['time']}{changes}")
            if entry.get("versions_changed"):
                lines.append(f"versions   changed at that resume: {', '.join(entry['versions_changed'])}")
    for entry in s.get("topology", []):
        lines.append(f"topology   {topology_line(entry)}")
    for pr in s.get("probes", []):
        span = f"steps {pr['steps'][0]}–{pr['steps'][1]} ({pr['count']})" if pr["steps"] else "no steps"
        lines.append(f"probe      {pr['probe']} version {pr['version']}: {span}, as probe/{pr['probe']}/… (verlj replay --probe)")
    if s["trend"]:
        rewards = [t["reward"] for t in s["trend"]]
        losses = [t["loss"] for t in s["trend"]]
        fr = [r for r in rewards if r is not None]
        lines.append(f"reward     {sparkline(rewards)}  {fr[0]:.4g} → {fr[-1]:.4g}" if fr else "reward     (none)")
        fl = [x for x in losses if x is not None]
        lines.append(f"pg_loss    {sparkline(losses)}  {fl[0]:.4g} → {fl[-1]:.4g}" if fl else "pg_loss    (none)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one step


def step_detail(run_dir: Path, step: int, max_samples: int | None = None) -> dict:
    """Everything journaled at `step`, with samples decoded to text (from the rollout archive when
    retention pruned them from the journal)."""
    run_dir = Path(run_dir)
    note = None
    with open_run(run_dir) as ledger:
        check_range(ledger, step)
        record = ledger.journal.read_step(step)
        config = ledger.config_at(step)
        cols = None
        if record.pruned:
            cols = archive.Reader(run_dir, ledger).step_columns(step)
            note = (f"samples pruned from the journal (journal.retain_samples); shown from {archive.ARCHIVE_DIR}/"
                    if cols is not None else "samples pruned from the journal (journal.retain_samples) and not archived")
        elif record.first("buffer.add") is not None:
            cols = table.step_columns(step, record.first("buffer.add")["samples"], table.text_decoder(config))
    samples = _sample_view(cols) if cols is not None else []
    added = StepEvents.of(record).added
    if added is not None and added.samples is not None:  # episodes (rollout.env): each turn's action, observation, reward
        _add_turns(samples, table.Columns(added.samples).samples(), table.text_decoder(config))
    n = len(np.asarray((record.first("buffer.add") or {}).get("ids", [])))
    if max_samples is not None:
        samples = samples[:max_samples]
    data, rng, rollout = record.first("data") or {}, record.first("rng") or {}, record.first("rollout") or {}
    return {
        "step": step,
        "time": record.time,
        "data": {"epoch": data.get("epoch"), "cursor": data.get("cursor"), "rounds": data.get("rounds"),
                 "indices": np.asarray(data.get("indices", [])).tolist()},
        "seeds": rng.get("seeds"),
        "rollout": {k: v for k, v in rollout.items() if k in ("engine", "version", "mode", "max_staleness", "async_order")} or None,
        "plans": _plans(record.first("buffer.plan")),
        "requests": {k: np.asarray(v).tolist() for k, v in record.first("buffer.request").items() if k in ("groups", "rows", "regenerated")}
        if record.first("buffer.request") else None,
        "rng_digests": rng.get("digests"),
        "buffer": {
            "added": n,
            "dropped": [i for e in record.all("buffer.drop") for i in np.asarray(e.get("ids", [])).tolist()],
            "consumed": np.asarray((record.first("buffer.consume") or {}).get("ids", [])).tolist(),
        },
        "samples": samples,
        "samples_note": note,
        "metrics": record.metrics,
        "probes": {"metrics": derived.values(run_dir).get(step, {}), "stored": derived.probes(run_dir)},
        "fingerprint": record.fingerprint,
        "control": record.all("control") + record.all("config"),
        "eval": _eval_view(record.first("eval"), table.text_decoder(config)),
    }


def _eval_view(event: dict | None, decoder) -> dict | None:
    """The held-out eval of a step (trainer.eval_interval): each row's response and score."""
    if event is None:
        return None
    ids, lens = np.asarray(event["response_ids"]), np.asarray(event["response_len"])
    ends = np.cumsum(lens)
    responses = [ids[e - n : e].tolist() for n, e in zip(lens.tolist(), ends.tolist())]
    if decoder is not None:
        responses = [decoder.decode(r) for r in responses]
    scores = np.asarray(event["scores"], np.float64)
    return {"rows": np.asarray(event["rows"]).tolist(), "responses": responses, "scores": scores.tolist(),
            "score_mean": float(scores.mean()) if len(scores) else None}


def _order(rollout: dict) -> str:
    return "completion order, " if rollout.get("async_order") == "completion" else ""


def _plans(event: dict | None) -> dict[int, list[int]] | None:
    """Async rollout: {step: the sample ids it will train on} for the batches generated at this step."""
    if event is None:
        return None
    ids, out, at = np.asarray(event["ids"]).tolist(), {}, 0
    for step, count in zip(np.asarray(event["steps"]).tolist(), np.asarray(event["counts"]).tolist()):
        out[int(step)], at = ids[at : at + count], at + count
    return out


def _sample_view(cols: dict) -> list[dict]:
    """inspect --step's view of a step's samples (text where a decoder was found, else token ids)."""
    return [{"id": r["sample_id"], "group": r["group"], "index": r["index"], "prompt": r["prompt"] or r["prompt_ids"],
             "response": r["response"] or r["response_ids"], "score": r["score"], "rule_reward": r["rule_reward"],
             "rm_score": r["rm_score"], "policy_version": r["policy_version"]} for r in table.rows(cols)]


def _add_turns(view: list[dict], samples, decoder) -> None:
    text = (lambda ids: decoder.decode(ids.tolist(), skip_special_tokens=False)) if decoder else (lambda ids: ids.tolist())
    for v, s in zip(view, samples):
        if s.is_episode:
            v["turns"] = [{"action": text(t.action_ids), "observation": text(t.observation_ids), "reward": None if t.reward != t.reward else t.reward}
                          for t in s.turns()]
            v["env_end"], v["env_reason"] = int(s.env_end), s.env_reason


def render_step(d: dict) -> str:
    lines = [f"step {d['step']}  fingerprint {d['fingerprint']}"]
    data = d["data"]
    idx = data["indices"]
    lines.append(f"data       epoch {data['epoch']}  cursor {data['cursor']}  rounds {data['rounds']}  "
                 f"indices {idx[:16]}{' …' if len(idx) > 16 else ''} ({len(idx)})")
    lines.append(f"seeds      {d['seeds']}")
    ro = d.get("rollout")
    if ro:
        lines.append(f"rollout    {ro['engine']} {ro['version']}" + (f"  async, {_order(ro)}max_staleness {ro['max_staleness']}" if ro.get("mode") == "async" else ""))
    b = d["buffer"]
    lines.append(f"buffer     added {b['added']}  dropped {len(b['dropped'])}  consumed {len(b['consumed'])}")
    m = d["metrics"]
    if "rollout/staleness/mean" in m:
        lines.append(f"trained    {len(b['consumed'])} samples, staleness mean {m['rollout/staleness/mean']:.3g} max "
                     f"{m['rollout/staleness/max']:.3g} (policy versions behind the one step {d['step']} starts from)")
    versions = sorted({s["policy_version"] for s in d["samples"]})
    for step, ids in (d.get("plans") or {}).items():
        lines.append(f"planned    step {step} will train on {len(ids)} samples" + (f" (generated here from policy version {versions[-1]})" if versions else ""))
    req = d.get("requests")
    if req:
        again = f"; asked again {len(req['regenerated'])} groups in flight when the last process stopped (from their seeds)" if req["regenerated"] else ""
        lines.append(f"asked      {len(req['groups'])} groups of the generator (rows {req['rows'][:8]}{' …' if len(req['rows']) > 8 else ''}){again}")
    for c in d["control"]:
        lines.append(f"control    {c.get('kind', c['type'])} {c.get('details', c.get('changed', ''))}")
    ev = d.get("eval")
    if ev:
        shown = ", ".join(f"{r}: {resp!r} {sc:.3g}" for r, resp, sc in list(zip(ev["rows"], ev["responses"], ev["scores"]))[:4])
        lines.append(f"eval       {len(ev['rows'])} held-out prompts, score {ev['score_mean']:.4g} (row: response score; {shown}{', …' if len(ev['rows']) > 4 else ''})")
    if d.get("samples_note"):
        lines.append(f"samples    {d['samples_note']}")
    lines.append("samples    (id group version | prompt → response | score)")
    for s in d["samples"]:
        mark = " consumed" if s["id"] in set(b["consumed"]) else (" dropped" if s["id"] in set(b["dropped"]) else "")
        lines.append(f"  {s['id']:>6} {s['group']:>6} v{s['policy_version']:<3} | {s['prompt']!s} → {s['response']!s} | {s['score']:.4g}{mark}")
        for t, turn in enumerate(s.get("turns", [])):
            lines.append(f"         turn {t + 1}: {turn['action']!s} ⇒ {turn['observation']!s}" + (f"  reward {turn['reward']:.4g}" if turn["reward"] is not None else ""))
        if s.get("env_reason"):
            lines.append(f"         ended by a fault: {s['env_reason']}")
    lines.append("metrics")
    for k in sorted(d["metrics"]):
        lines.append(f"  {k:32s} {d['metrics'][k]:.6g}")
    probed = d.get("probes") or {}
    if probed.get("metrics"):
        versions = {p["probe"]: p["version"] for p in probed["stored"]}
        lines.append("probes     (computed afterwards by verlj replay --probe; not in the journal)")
        for k in sorted(probed["metrics"]):
            name = k.split("/")[1]
            lines.append(f"  {k:32s} {probed['metrics'][k]:.6g}  (version {versions.get(name)})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- metrics, find


def metric_rows(run_dir: Path, names: list[str] | None, steps: str | None) -> tuple[list[str], list[dict]]:
    start, stop = parse_steps(steps)
    rows, seen = [], set()
    probed = derived.values(run_dir)  # `verlj replay --probe`'s, beside the journal
    with open_run(run_dir) as ledger:
        for step, values in ledger.metrics(start, stop):
            values = {**values, **probed.get(step, {})}
            seen |= set(values)
            rows.append({"step": step, **(values if names is None else {k: values.get(k) for k in names})})
    if names is not None:
        unknown = [n for n in names if n not in seen]
        if unknown and rows:  # measured after a step's commit, some metrics are only in the logs
            logged = _logged_only(Path(run_dir) / "metrics.jsonl", set(unknown))
            for row in rows:
                row.update({k: v for k, v in logged.get(row["step"], {}).items()})
            found = {k for values in logged.values() for k in values}
            unknown = [n for n in unknown if n not in found]
        if unknown and rows:
            raise RunError(f"unknown metric {unknown[0]!r}; this run has: {', '.join(sorted(seen))}")
        cols = names
    else:
        cols = sorted(seen)
    return cols, rows


def _logged_only(path: Path, names: set[str]) -> dict[int, dict[str, float]]:
    """step -> {name: value} of `names` in metrics.jsonl: the metrics measured after a step's commit
    (timing_s/commit, journal/ship_lag_steps: run.train_loop logs them), which its record cannot hold."""
    out: dict[int, dict[str, float]] = {}
    try:
        f = open(path)
    except OSError:
        return out
    with f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            hit = {k: row[k] for k in names if k in row}
            if hit and isinstance(row.get("step"), int):
                out.setdefault(row["step"], {}).update(hit)
    return out


_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne}
_COND = re.compile(r"^\s*([\w/.\-]+)\s*(>=|<=|==|!=|>|<)\s*(\S+)\s*$|^\s*([\w/.\-]+)\s+is\s+(nan|inf|not finite)\s*$")


@dataclass
class Condition:
    name: str
    op: str
    value: float | None

    def __call__(self, values: dict) -> bool:
        v = values.get(self.name)
        if v is None:
            return False
        if self.op == "nan":
            return math.isnan(v)
        if self.op == "inf":
            return math.isinf(v)
        if self.op == "not finite":
            return not math.isfinite(v)
        return _OPS[self.op](v, self.value)


def parse_where(where: str) -> list[Condition]:
    """'actor/grad_norm > 10 and critic/score/mean < 0.1', or 'actor/pg_loss is nan'."""
    conds = []
    for part in re.split(r"\s+and\s+", where.strip()):
        m = _COND.match(part)
        if not m:
            raise RunError(
                f"cannot parse --where {where!r}: use NAME OP NUMBER (OP one of > >= < <= == !=) or NAME is nan|inf|not finite, joined by 'and'"
            )
        if m.group(1):
            try:
                conds.append(Condition(m.group(1), m.group(2), float(m.group(3))))
            except ValueError:
                raise RunError(f"cannot parse --where {where!r}: {m.group(3)!r} is not a number") from None
        else:
            conds.append(Condition(m.group(4), m.group(5), None))
    return conds


def find_steps(run_dir: Path, where: str, limit: int | None = None) -> list[tuple[int, dict]]:
    conds = parse_where(where)
    out = []
    names_seen: set[str] = set()
    probed = derived.values(run_dir)
    with open_run(run_dir) as ledger:
        for step, values in ledger.metrics():
            values = {**values, **probed.get(step, {})}
            names_seen |= set(values)
            if all(c(values) for c in conds):
                out.append((step, {c.name: values.get(c.name) for c in conds}))
                if limit is not None and len(out) >= limit:
                    break
    missing = [c.name for c in conds if names_seen and c.name not in names_seen]
    if missing:
        raise RunError(f"unknown metric {missing[0]!r} in --where")
    return out


# ----------------------------------------------------------------------------- diff


def _canon(x):
    if isinstance(x, np.ndarray):
        return ("nd", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, dict):
        return {k: _canon(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_canon(v) for v in x]
    if isinstance(x, float) and x != x:
        return "nan"
    return x


def _comparable(events: list[dict]) -> dict[str, object]:
    """A step's events as diff compares them: control events, timings and the rollout engine's package
    version aside (a version is the environment, named apart: _environment_differences)."""
    out = {}
    for e in events:
        if e["type"] in ("control", "config"):
            continue
        if e["type"] == "metrics":
            e = {**e, "values": {k: v for k, v in e["values"].items() if not k.startswith("timing_s/")}}
        if e["type"] == "rollout":
            e = {k: v for k, v in e.items() if k != "version"}
        out[e["type"]] = _canon(e)
    return out


def _rollout_version(events: list[dict]) -> tuple[str, str] | None:
    for e in events:
        if e["type"] == "rollout":
            return e.get("engine"), e.get("version")
    return None


def _environment_differences(ja: Ledger, jb: Ledger, rollout: dict | None) -> dict[str, list]:
    """Package -> [version in a, version in b]: the library versions (and verlj source digest) each run
    last started on, and the rollout engine's package where a step generated under different ones.
    An environment difference alone changes no number: diff names it apart from a training difference."""
    va, vb = ja.versions_in_force(), jb.versions_in_force()
    out = {k: [va.get(k), vb.get(k)] for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)}
    if rollout is not None:
        (ea, a), (eb, b) = rollout["a"], rollout["b"]
        package = {"hf": "transformers"}.get(ea, ea) if ea == eb else f"{ea}/{eb}"
        if out.get(package) != [a, b]:
            out[f"{package} (rollout, step {rollout['step']})"] = [a, b]
    return out


def first_difference(run_a: Path, run_b: Path, full: bool = False) -> dict:
    """The first step where two journals differ (timings, wall time and control events aside).

    Compares the summaries (data, seeds, metrics, fingerprint): samples that differ show there
    too, since the update trains on them. ``full`` also compares every step's samples (slower):
    from the rollout archive where retention pruned them from a journal; the steps whose samples
    neither holds are counted in ``samples_not_compared``. Where the first differing stage is one
    the journal holds only digests of, post_mortem.rerun.diff_stages re-executes the step."""
    not_compared: list[int] = []
    with open_run(run_a) as ja, open_run(run_b) as jb:
        la, lb = ja.last_step(), jb.last_step()
        base = max(ja.base_step(), jb.base_step())
        common = min(la, lb)
        config_changes = _config_differences(ja, jb)
        topology = {"a": ja.topology_history(), "b": jb.topology_history()}
        readers = (archive.Reader(Path(run_a), ja), archive.Reader(Path(run_b), jb))
        rollout = None  # the first step whose rollout engine's package version differs
        for x, y in zip(ja.journal.iter_summaries(base + 1, common), jb.journal.iter_summaries(base + 1, common)):
            step = x.step
            if rollout is None:
                ra_, rb_ = _rollout_version(x.events), _rollout_version(y.events)
                if ra_ is not None and rb_ is not None and ra_[1] != rb_[1]:
                    rollout = {"step": step, "a": ra_, "b": rb_}
            same = _comparable(x.events) == _comparable(y.events)
            if same and not full:
                continue
            ra, rb = ja.journal.read_step(step), jb.journal.read_step(step)
            ea, eb = ra.events, rb.events
            if ra.pruned or rb.pruned:  # samples gone on one side: compare what both still hold
                ea, eb = _without_samples(ea), _without_samples(eb)
            ea, eb = _comparable(ea), _comparable(eb)
            kinds = sorted(k for k in set(ea) | set(eb) if ea.get(k) != eb.get(k))
            if not kinds and (ra.pruned or rb.pruned) and full:  # then the samples, from the archive
                ca, cb = _step_samples(ra, readers[0]), _step_samples(rb, readers[1])
                if ca is None or cb is None:
                    not_compared.append(step)
                elif not _same_samples(ca, cb):
                    kinds = ["buffer.add"]
            if not kinds:
                continue
            metrics_a, metrics_b = x.metrics, y.metrics
            metrics = {k: [metrics_a.get(k), metrics_b.get(k)] for k in sorted(set(metrics_a) | set(metrics_b))
                       if not k.startswith("timing_s/") and _canon(metrics_a.get(k)) != _canon(metrics_b.get(k))}
            detail = {"metrics": metrics}
            st = _stage_difference(ra, rb)
            if st is not None:
                detail["stages"] = st
            return {"identical": False, "step": step, "differs": kinds, "detail": detail, "config": config_changes,
                    "environment": _environment_differences(ja, jb, rollout), "steps_a": la, "steps_b": lb, "topology": topology}
        environment = _environment_differences(ja, jb, rollout)
    if la != lb:
        return {"identical": False, "step": common + 1, "differs": ["length"], "detail": {}, "config": config_changes,
                "environment": environment, "steps_a": la, "steps_b": lb, "samples_not_compared": not_compared}
    return {"identical": True, "step": None, "differs": [], "detail": {}, "config": config_changes, "environment": environment,
            "steps_a": la, "steps_b": lb, "samples_not_compared": not_compared}


# the stages whose values the journal holds (compared there); the others are digests only
JOURNALED_STAGES = ("data", "samples", "scores", "ref_logprobs")


def _stage_difference(ra, rb) -> dict | None:
    """The first stage (state.stages) whose digest differs between two records of a step, with both
    sides' summaries; for the stages the journal holds as values (samples, scores, reference
    log-probs), the first consumed sample and token that differ, with both values."""
    from ..state.stages import first_difference as first_stage

    sa, sb = ra.first("stages"), rb.first("stages")
    if sa is None or sb is None:
        return None
    stage = first_stage(sa, sb)
    if stage is None:
        return None
    out = {"stage": stage, "a": sa.get("summary", {}).get(stage), "b": sb.get("summary", {}).get(stage)}
    if stage in JOURNALED_STAGES and not (ra.pruned or rb.pruned):
        out["element"] = _first_sample_difference(ra, rb, stage)
    return out


def _first_sample_difference(ra, rb, stage: str) -> dict | None:
    """The first consumed sample (in the order the update took them) whose `stage` field differs."""
    from ..rl.samples import unpack

    def consumed(record):
        by_id = {int(s["id"]): s for s in unpack(record.first("buffer.add")["samples"])} if record.first("buffer.add") else {}
        return [by_id.get(int(i)) for i in np.asarray((record.first("buffer.consume") or {}).get("ids", []))]

    field = {"data": "index", "samples": "response_ids", "scores": "score", "ref_logprobs": "ref_logprobs"}[stage]
    for n, (a, b) in enumerate(zip(consumed(ra), consumed(rb))):
        if a is None or b is None:
            continue
        f = "prompt_ids" if stage == "samples" and not np.array_equal(a["prompt_ids"], b["prompt_ids"]) else field
        va, vb = np.atleast_1d(np.asarray(a[f])), np.atleast_1d(np.asarray(b[f]))
        if va.shape == vb.shape and np.array_equal(va, vb):
            continue
        k = next((i for i in range(min(len(va), len(vb))) if va[i] != vb[i]), min(len(va), len(vb)))
        both = min(len(va), len(vb))
        largest = float(np.max(np.abs(va[:both].astype(np.float64) - vb[:both].astype(np.float64)))) if both else None
        return {"consumed": n, "sample_a": int(a["id"]), "sample_b": int(b["id"]), "field": f, "index": int(k),
                "a": va[k].item() if k < len(va) else None, "b": vb[k].item() if k < len(vb) else None, "largest_abs_diff": largest}
    return None


def _step_samples(record, reader) -> dict | None:
    """A step's samples as table columns: from the journal, or from the run's rollout archive when
    retention pruned them (None when it does not hold them, or pyarrow is missing)."""
    if not record.pruned:
        add = record.first("buffer.add")
        return table.step_columns(record.step, add["samples"], None) if add is not None else {}
    try:
        return reader.step_columns(record.step)
    except RunError:
        return None


def _same_samples(a: dict, b: dict) -> bool:
    """Every sample field alike, bit for bit (the decoded text aside: it follows from the ids)."""
    for name in table.COLUMNS:
        if name in table.TEXT:
            continue
        va, vb = a.get(name), b.get(name)
        if isinstance(va, tuple) or isinstance(vb, tuple):
            if not (isinstance(va, tuple) and isinstance(vb, tuple) and all(np.array_equal(p, q) for p, q in zip(va, vb))):
                return False
        elif not np.array_equal(np.asarray(va), np.asarray(vb)):
            return False
    return True


def _without_samples(events: list[dict]) -> list[dict]:
    """A step's events as retention leaves them: the payload fields (events.PAYLOAD_FIELDS) dropped."""
    from verlj.journal.events import PAYLOAD_FIELDS

    return [{k: v for k, v in e.items() if k not in PAYLOAD_FIELDS.get(e["type"], ())} for e in events]


def _config_differences(ja: Ledger, jb: Ledger) -> dict[str, list]:
    """Dotted key -> [value in a, value in b] for the configs the two runs started with."""
    a, b = ja.first_config(), jb.first_config()
    return {k: [_dotted(a, k), _dotted(b, k)] for k in diff_configs(a, b)}


def _dotted(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def render_diff(d: dict, a: Path, b: Path) -> str:
    config = [f"  config {k}: {va!r} vs {vb!r}" for k, (va, vb) in d.get("config", {}).items()]
    env = d.get("environment") or {}
    if env:
        config.append(("  environment only (every fingerprint and metric agrees): " if d["identical"] else "  environment: ")
                      + ", ".join(f"{k} {va} vs {vb}" for k, (va, vb) in env.items()))
    skipped = d.get("samples_not_compared") or []
    unseen = (f"; the samples of {len(skipped)} pruned step{'' if len(skipped) == 1 else 's'} ({ranges(skipped)}) were not "
              "compared: neither the journal nor the rollout archive holds them" if skipped else "")
    if d["identical"]:
        return "\n".join([f"identical: {a} and {b} agree on all {d['steps_a']} steps (timings aside){unseen}", *config])
    if d["differs"] == ["length"]:
        return "\n".join([f"the runs agree up to step {d['step'] - 1}; {a} has {d['steps_a']} steps, {b} has {d['steps_b']}", *config])
    names = {"data": "data (indices drawn)", "rng": "seeds", "rollout": "rollout engine", "buffer.add": "samples", "buffer.drop": "dropped samples",
             "buffer.consume": "consumed samples", "buffer.plan": "planned batches", "metrics": "metrics", "state": "fingerprint", "eval": "held-out eval",
             "stages": "stage digests"}
    lines = [f"first difference at step {d['step']}: " + ", ".join(names.get(k, k) for k in d["differs"]), *config]
    for side, run in (("a", a), ("b", b)):
        for entry in d.get("topology", {}).get(side, []):
            if entry["from_step"] <= d["step"]:
                lines.append(f"  note: {run} changed topology {topology_line(entry)}")
    st = d["detail"].get("stages")
    if st:
        def summary(x):
            return f"mean {x['mean']:.6g}, |max| {x['absmax']:.6g}" if x else "digest only"
        lines.append(f"  first differing stage: {st['stage']} ({summary(st['a'])} vs {summary(st['b'])})")
        e = st.get("element")
        if e and st.get("reexecuted"):
            at = f"[{e['index']}]" if e["index"] is not None else ""
            lines.append(f"    {e['part']}{at}: {e['a']!r} vs {e['b']!r} (largest difference {e['largest_abs_diff']!r}; "
                         f"both runs' step {d['step']} re-executed)")
        elif st.get("reexecuted"):
            lines.append(f"    re-executed, both runs' step {d['step']} give the same {st['stage']}: the difference is in the journal only")
        elif e:
            lines.append(f"    consumed sample #{e['consumed']} (ids {e['sample_a']} / {e['sample_b']}) {e['field']}[{e['index']}]: "
                         f"{e['a']!r} vs {e['b']!r} (largest difference {e['largest_abs_diff']!r})")
    for k, (va, vb) in list(d["detail"].get("metrics", {}).items())[:12]:
        lines.append(f"  {k:32s} {va!r:>14} vs {vb!r}")
    return "\n".join(lines)

