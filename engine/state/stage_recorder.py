"""Recording a step's stage outputs (state.stages): digests taken where the tensors live, summaries
over every rank's values. The trainer fills one StageRecorder per step."""

from __future__ import annotations

import blake3
import numpy as np
import torch

from .fingerprint import tensor_sums
from .stages import RankStages


class StageRecorder:
    """Collects one step's stage outputs on this rank (rank-local), then digests them over all ranks.
    With ``keep``, it also keeps a host copy of every output, as ``kept[stage] = [(name, array)]``:
    what `verlj diff --stages` compares element by element when the journal holds only digests."""

    def __init__(self, keep: bool = False) -> None:
        self._parts: dict[str, list] = {}
        self._stats: dict[str, list] = {}
        self.kept: dict[str, list] | None = {} if keep else None

    def keep(self, stage: str, name: str, value) -> None:
        """A host copy of one output of `stage` (only when keeping)."""
        if self.kept is not None:
            a = value.detach().cpu().clone().numpy() if isinstance(value, torch.Tensor) else np.array(value)
            self.kept.setdefault(stage, []).append((name, a))

    def tensor(self, stage: str, t: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """A stage output held as a tensor (this rank's share), zero wherever `mask` is: the summary
        counts the masked positions (all, without a mask)."""
        t = t.detach()
        self.keep(stage, f"{stage}[{len(self._parts.get(stage, []))}]", t)
        self._parts.setdefault(stage, []).append(("t", tensor_sums(t), tuple(t.shape), str(t.dtype)))
        if t.numel() == 0:
            return
        count = mask.sum(dtype=torch.float64) if mask is not None else torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device)
        self._stats.setdefault(stage, []).append(torch.stack([count, t.sum(dtype=torch.float64), t.abs().max().double()]))

    def host(self, stage: str, *arrays) -> None:
        """A stage output already on the host (ids, rows): hashed whole."""
        h = blake3.blake3()
        for a in arrays:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype}:{a.shape}".encode())
            h.update(a.tobytes())
        self._parts.setdefault(stage, []).append(("h", h.digest()))

    def digest_only(self, stage: str, t: torch.Tensor) -> None:
        """A stage output known only by its digest (the gradients' sums): digested, not summarized."""
        self._parts.setdefault(stage, []).append(("t", t.reshape(-1), tuple(t.shape), str(t.dtype)))

    def numbers(self, stage: str, values: list[float]) -> None:
        """A stage output that is a few host numbers (the gradient norms): their exact bits."""
        v = np.asarray(values, np.float64)
        self.keep(stage, f"{stage}[{len(self._parts.get(stage, []))}]", v)
        self.host(stage, v)
        if values:
            self._stats.setdefault(stage, []).append(torch.tensor([float(v.size), float(v.sum()), float(np.abs(v).max())], dtype=torch.float64))

    def local(self) -> dict:
        """This rank's digests and summary sums: a small picklable dict. Everything on a device
        comes off it in one transfer a device (16 bytes a tensor, 24 a summary)."""
        on_device: dict = {}
        for parts in self._parts.values():
            for p in parts:
                if p[0] == "t":
                    on_device.setdefault(p[1].device, []).append(p[1].reshape(-1))
        for xs in self._stats.values():
            for x in xs:
                on_device.setdefault(x.device, []).append(x.view(torch.int64))  # float64 summaries, bit for bit
        host = {dev: iter(np.split(torch.cat(ts).cpu().numpy(), np.cumsum([t.numel() for t in ts])[:-1])) for dev, ts in on_device.items()}
        digests = {}
        for stage, parts in self._parts.items():
            h = blake3.blake3()
            for p in parts:
                if p[0] == "t":
                    h.update(f"{p[2]}:{p[3]}".encode())
                    h.update(next(host[p[1].device]).tobytes())
                else:
                    h.update(p[1])
            digests[stage] = h.hexdigest()
        stats = {stage: [next(host[x.device]).view(np.float64).tolist() for x in xs] for stage, xs in self._stats.items()}
        return RankStages(digests, stats).to_dict()

