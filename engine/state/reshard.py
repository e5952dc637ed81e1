"""Resharding: loading a snapshot under another world size, ZeRO stage or tensor-parallel size.

A snapshot holds DeepSpeed's files as the topology that wrote them laid them out (ZeRO partitions
per data-parallel rank, TP shards per model-parallel rank). To load it elsewhere it is converted
once into DeepSpeed's universal checkpoint layout, every parameter whole with its Adam moments and
step, and cached beside the snapshot, checksummed like the rest of it:

    RUN/step_00050/universal/          (not part of the snapshot's own manifest; state.manifest)
      actor/ critic/
        zero/<param>/fp32.pt           {"param": the whole fp32 master weight, "cat_dim": 0}
        zero/<param>/exp_avg.pt  exp_avg_sq.pt  step.pt
        zero/optimizer_state.pt        param groups (lr, betas, ...), clip_grad, ds_version
        mp_rank_00_model_states.pt     the whole module, LR scheduler, global step counters
      meta.json                        the source topology, DeepSpeed version
      manifest.json                    size and BLAKE3 of every file above

Converting: ZeRO 1-3 snapshots go through DeepSpeed's own converter (``ds_to_universal``); ZeRO-0
snapshots (any TP size) hold the whole optimizer state per model-parallel rank and verlj writes the
same layout from them, joining TP shards along the dimension AutoTP split.
Loading: ZeRO 1-3 engines read it with DeepSpeed's universal loader; ZeRO-0 engines (any TP size)
are filled by verlj, each rank taking its TP shard. Every ``torch.load`` on the way is
weights-only (state.safe_load). After loading, the whole weights are compared with the converted
fp32 weights (:func:`check_loaded`): a conversion that lost or misplaced anything is refused.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from verlj.journal.durable import write_synced

from ..errors import SnapshotError
from ..schema.record import Record
from .manifest import MANIFEST, META, RESHARDED, SnapshotMeta, build_manifest, check_files, fsync_tree
from .safe_load import load_weights_only, save_portable, weights_only_everywhere
from .topology import Topology

MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIMIZER_STATE = "optimizer_state.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")


# ----------------------------------------------------------------------------- converting (rank 0)


@dataclass(frozen=True)
class Converted(Record):
    """The converted form's meta.json (RESHARDED/meta.json): the snapshot's step and topology, each engine's
    converted weights' digests ({dtype: digest}, as an fp32 and a bf16 engine hold them: check_loaded), and
    the DeepSpeed that converted it."""

    step: int
    source: Topology
    weights: dict[str, dict[str, str]]
    deepspeed: str


def cached(snapshot: Path) -> Path | None:
    """The snapshot's converted form, when it is there and checks out."""
    root = Path(snapshot) / RESHARDED
    if not (root / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        problems = check_files(root, manifest["files"], hash_files=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return root if not problems else None


def ensure_converted(snapshot: Path, meta: SnapshotMeta, full_shapes: dict[str, dict]) -> tuple[Path, float]:
    """Rank 0: the snapshot's universal form, converted now or found cached. Returns (dir, seconds spent).
    `full_shapes`: {engine: {trainable parameter: whole shape}} in module order (Trainer.param_layout)."""
    import time

    snapshot = Path(snapshot)
    found = cached(snapshot)
    if found is not None:
        return found, 0.0
    t0 = time.perf_counter()
    tmp = snapshot / f".tmp-{RESHARDED}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(snapshot / RESHARDED, ignore_errors=True)  # a damaged cache: convert again
    src = meta.topology
    digests = {}
    for tag in meta.engines:
        out = tmp / tag
        if src.zero_stage == 0:
            _from_zero0(snapshot / tag, out, list(full_shapes[tag]), full_shapes[tag])
        else:
            _from_zero(snapshot / tag, out)
        _complete(out, full_shapes[tag])
        digests[tag] = weights_digest_of_dir(out, list(full_shapes[tag]))
    import deepspeed

    write_synced(tmp / META, json.dumps(Converted(meta.step, src, digests, deepspeed.__version__).to_dict(), indent=2).encode())
    write_synced(tmp / MANIFEST, json.dumps(build_manifest(tmp), indent=2).encode())
    fsync_tree(tmp)
    tmp.rename(snapshot / RESHARDED)
    return snapshot / RESHARDED, time.perf_counter() - t0


def _complete(out: Path, shapes: dict[str, tuple]) -> None:
    """What each of DeepSpeed's loaders expects, whichever converter wrote the form: every tensor as
    {"param": whole shape, "cat_dim": 0} (from ZeRO-3 the converter writes flat tensors), the module
    states under the ZeRO-3 name too, and the step inside the optimizer state (ZeRO-3 reads it there)."""
    names = list(shapes)
    for n in names:
        for key in ("fp32", *MOMENTS):
            f = out / "zero" / n / f"{key}.pt"
            if not f.is_file():
                continue
            t = load_weights_only(f, map_location="cpu")
            if isinstance(t, torch.Tensor):
                if t.numel() != math.prod(shapes[n]):
                    raise SnapshotError(f"the converted {n} has {t.numel()} elements, the parameter {math.prod(shapes[n])}")
                save_portable({"param": t.reshape(shapes[n]), "cat_dim": 0}, f)
    have = [n for n in (MODEL_STATES, ZERO3_MODEL_STATES) if (out / n).is_file()]
    if not have:
        raise SnapshotError(f"the converted {out.name} state has no module states file")
    for n in (MODEL_STATES, ZERO3_MODEL_STATES):
        if not (out / n).is_file():
            shutil.copyfile(out / have[0], out / n)
    path = out / "zero" / OPTIMIZER_STATE
    sd = load_weights_only(path, map_location="cpu")
    model = load_weights_only(out / MODEL_STATES, map_location="cpu")
    sd.setdefault("ds_version", model.get("ds_version"))
    sd.setdefault("clip_grad", (model.get("ds_config") or {}).get("gradient_clipping", 0.0))
    if "param_groups" not in sd:
        sd["param_groups"] = sd["optimizer_state_dict"]["param_groups"]
    if "optimizer_state_dict" not in sd:
        steps = [out / "zero" / n / "step.pt" for n in names if (out / "zero" / n / "step.pt").is_file()]
        step = load_weights_only(steps[0]) if steps else None
        sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": sd["param_groups"]}
    save_portable(sd, path)


def _from_zero(src: Path, out: Path) -> None:
    """ZeRO 1-3: DeepSpeed's converter, in this process, its torch.loads weights-only, its prints kept."""
    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(input_folder=str(src), output_folder=str(out), num_extract_workers=1, num_merge_workers=1,
                     keep_temp_folder=False, strict=True, inject_missing_state=True)
    said = io.StringIO()
    try:
        with weights_only_everywhere(), contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(args)
    except Exception as e:  # noqa: BLE001 - the converter's failures are assertions and KeyErrors
        raise SnapshotError(f"DeepSpeed could not convert {src} to its universal layout: {str(e).splitlines()[0][:200]}") from None


def _split_dim(shards: list[tuple], full: tuple) -> int | None:
    """The dimension TP shards were cut along (None: the parameter is replicated). AutoTP cuts
    unevenly where a dimension does not divide (a vocabulary of 19 over 2 ranks: 10 and 9)."""
    full = tuple(full)
    if all(tuple(s) == full for s in shards):
        return None
    dims = {d for s in shards for d in range(len(full)) if len(s) == len(full) and s[d] != full[d]}
    if len(dims) == 1 and all(len(s) == len(full) for s in shards):
        d = dims.pop()
        if sum(s[d] for s in shards) == full[d] and all(s[:d] + s[d + 1:] == full[:d] + full[d + 1:] for s in shards):
            return d
    raise SnapshotError(f"tensor-parallel shards of shapes {[tuple(s) for s in shards]} do not make up the full shape {full}")


def _from_zero0(src: Path, out: Path, names: list[str], full_shapes: dict) -> None:
    """ZeRO-0: each model-parallel rank's file holds its shard of every parameter and of its Adam state
    (the optimizer's state is indexed by the trainable parameters in module order)."""
    import deepspeed

    files = sorted(src.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise SnapshotError(f"{src} holds no DeepSpeed model states")
    states = [load_weights_only(f, map_location="cpu") for f in files]
    optim = [s.get("optimizer") for s in states]
    if any(o is None or "state" not in o for o in optim):
        raise SnapshotError(f"{src} holds no optimizer state to reshard")
    merged_module = {}
    step = None
    for i, name in enumerate(names):
        shards = [s["module"][name] for s in states]
        dim = _split_dim([tuple(t.shape) for t in shards], full_shapes[name])

        def join(ts, dim=dim):
            return ts[0] if dim is None else torch.cat(ts, dim)

        param = join(shards)
        merged_module[name] = param
        d = out / "zero" / name
        d.mkdir(parents=True, exist_ok=True)
        save_portable({"param": param.float(), "cat_dim": 0}, d / "fp32.pt")
        per_rank = [o["state"].get(i) for o in optim]
        if per_rank[0] is None:
            continue  # no update has touched this parameter yet
        for key in MOMENTS:
            parts = [st[key] for st in per_rank]
            if [tuple(t.shape) for t in parts] != [tuple(t.shape) for t in shards]:
                raise SnapshotError(f"{src}: the optimizer state of {name} does not have the parameter's shape")
            save_portable({"param": join(parts).float(), "cat_dim": 0}, d / f"{key}.pt")
        step = per_rank[0]["step"]
        save_portable(step, d / "step.pt")
    for name, t in states[0]["module"].items():  # buffers and anything not trained: rank 0's copy
        merged_module.setdefault(name, t)
    groups = optim[0]["param_groups"]
    save_portable({"clip_grad": states[0].get("ds_config", {}).get("gradient_clipping", 0.0), "ds_version": deepspeed.__version__,
                "param_groups": groups, "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups}},
               out / "zero" / OPTIMIZER_STATE)
    model = {k: v for k, v in states[0].items() if k not in ("optimizer", "module")}
    model.update(module=merged_module, optimizer=None, mp_world_size=1,
                 param_shapes=[{n: torch.Size(full_shapes[n]) for n in names}])
    model.pop("universal_checkpoint_info", None)
    save_portable(model, out / MODEL_STATES)


# ----------------------------------------------------------------------------- loading (collective)


def load(engine, tag: str, root: Path, rt) -> None:
    """Fill a freshly built engine from the universal form of its snapshot (every rank)."""
    tag_dir = Path(root) / tag
    if engine.zero_optimization():
        engine._config.load_universal_checkpoint = True
        try:
            with weights_only_everywhere(), contextlib.redirect_stdout(io.StringIO()):
                load_path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                      load_lr_scheduler_states=True, load_module_strict=True)
        finally:
            engine._config.load_universal_checkpoint = False
        if load_path is None:
            raise SnapshotError(f"DeepSpeed found no universal checkpoint for {tag!r} in {root}")
        return
    _load_zero0(engine, tag_dir, rt)


def _tp_shards(rt, shape: tuple) -> list[tuple]:
    """The shapes of one parameter's shards on every rank of this rank's TP group, in TP order."""
    every = rt.all_gather_obj(list(shape))
    first = (rt.rank // rt.tp_size) * rt.tp_size
    return [tuple(s) for s in every[first : first + rt.tp_size]]


def _tp_shard(full: torch.Tensor, shards: list[tuple], rt) -> torch.Tensor:
    """This rank's piece of a whole tensor, cut as AutoTP cut the live parameter."""
    dim = _split_dim(shards, tuple(full.shape))
    if dim is None:
        return full
    k = rt.rank % rt.tp_size
    start = sum(s[dim] for s in shards[:k])
    return full.narrow(dim, start, shards[k][dim]).contiguous()


def _load_zero0(engine, tag_dir: Path, rt) -> None:
    zero = tag_dir / "zero"
    sd = load_weights_only(tag_dir / MODEL_STATES, map_location="cpu")
    saved = load_weights_only(zero / OPTIMIZER_STATE, map_location="cpu")
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                d = zero / name
                if not (d / "fp32.pt").is_file():
                    raise SnapshotError(f"{tag_dir} holds no weights for {name}")
                shards = _tp_shards(rt, tuple(p.shape)) if rt.tp_size > 1 else [tuple(p.shape)]
                p.copy_(_tp_shard(load_weights_only(d / "fp32.pt")["param"], shards, rt).to(p.dtype))
                opt.state.pop(p, None)
                if (d / "step.pt").is_file():
                    step = load_weights_only(d / "step.pt")
                    opt.state[p] = {"step": torch.as_tensor(step, dtype=torch.float32).clone().reshape(()),
                                    **{k: _tp_shard(load_weights_only(d / f"{k}.pt")["param"], shards, rt)
                                       .to(p.device, torch.float32).clone() for k in MOMENTS}}
    for group, old in zip(opt.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in old.items() if k != "params"})
    if engine.lr_scheduler is not None and sd.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(sd["lr_scheduler"])
    engine.global_steps = int(sd.get("global_steps", 0))
    engine.global_samples = int(sd.get("global_samples", 0))
    engine.skipped_steps = int(sd.get("skipped_steps", 0))


# ----------------------------------------------------------------------------- the check


def _digest(named: list[tuple[str, torch.Tensor]], dtype=torch.float32) -> str:
    """Over the weights as `dtype` holds them (a bf16 engine's weights are its fp32 masters rounded)."""
    h = blake3.blake3()
    for name, t in named:
        t = t.detach().to("cpu").to(dtype).float().contiguous()
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_digest_of_dir(tag_dir: Path, names: list[str]) -> dict[str, str]:
    """{dtype: digest} of the converted fp32 weights as an fp32 and as a bf16 engine would hold them."""
    named = [(n, load_weights_only(tag_dir / "zero" / n / "fp32.pt", map_location="cpu")["param"]) for n in names]
    return {"float32": _digest(named), "bfloat16": _digest(named, torch.bfloat16)}


def full_parameters(engine, rt, full_shapes: dict) -> list[tuple[str, torch.Tensor]]:
    """Every trainable parameter whole (ZeRO-3 partitions gathered, TP shards joined). Collective."""
    import deepspeed
    import torch.distributed as dist

    out = []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_tensor"):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                t = p.detach().clone()
        else:
            t = p.detach()
        if rt.tp_size > 1:
            shards = _tp_shards(rt, tuple(t.shape))
            dim = _split_dim(shards, full_shapes[name])
            if dim is not None:
                width = max(s[dim] for s in shards)  # all_gather wants one shape: pad the short shards
                padded = torch.zeros(t.shape[:dim] + (width,) + t.shape[dim + 1:], dtype=t.dtype, device=t.device)
                padded.narrow(dim, 0, t.shape[dim]).copy_(t)
                parts = [torch.empty_like(padded) for _ in range(rt.world_size)]
                dist.all_gather(parts, padded)
                first = (rt.rank // rt.tp_size) * rt.tp_size
                t = torch.cat([parts[first + k].narrow(dim, 0, s[dim]) for k, s in enumerate(shards)], dim)
        out.append((name, t))
    return out


def check_loaded(engine, tag: str, root: Path, rt, full_shapes: dict) -> None:
    """The loaded weights are the converted ones, bit for bit (fp32). Collective."""
    params = full_parameters(engine, rt, full_shapes)
    dtype = params[0][1].dtype if params else torch.float32
    want = Converted.from_dict(json.loads((Path(root) / META).read_text())).weights[tag].get(str(dtype).removeprefix("torch."))
    got = _digest(params, dtype)
    if not rt.all_true(got == want):
        raise SnapshotError(f"the {tag} weights loaded from {root} differ from the converted snapshot's")
