"""Recording a step's stage outputs (state.stages): digests taken where the tensors live, summaries
over every rank's values. The trainer fills one StageRecorder per step."""

from __future__ import annotations

import blake3
import numpy as np
import torch

from .fingerprint import tensor_sums


class StageRecorder:
    """Collects one step's stage outputs on this rank (rank-local), then digests them over all ranks."""

    def __init__(self) -> None:
        self._parts: dict[str, list] = {}
        self._stats: dict[str, list] = {}

    def tensor(self, stage: str, t: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """A stage output held as a tensor (this rank's share); `mask` selects what the summary counts."""
        t = t.detach()
        self._parts.setdefault(stage, []).append(("t", tensor_sums(t), tuple(t.shape), str(t.dtype)))
        vals = t.float()[mask.bool()] if mask is not None else t.float().reshape(-1)
        self._stats.setdefault(stage, []).append(torch.stack([torch.tensor(float(vals.numel()), device=vals.device),
                                                              vals.double().sum().float() if vals.numel() else vals.new_zeros(()),
                                                              vals.abs().max() if vals.numel() else vals.new_zeros(())]))

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
        """A stage output that is a few numbers (the micro-batch losses): their exact bits."""
        self.host(stage, np.asarray(values, np.float64))
        if values:
            v = np.asarray(values, np.float64)
            self._stats.setdefault(stage, []).append(torch.tensor([float(v.size), float(v.sum()), float(np.abs(v).max())]))

    def local(self) -> dict:
        """This rank's digests and summary sums: a small picklable dict (only 16 bytes a tensor
        come off the device)."""
        digests = {}
        for stage, parts in self._parts.items():
            h = blake3.blake3()
            for p in parts:
                if p[0] == "t":
                    h.update(f"{p[2]}:{p[3]}".encode())
                    h.update(p[1].cpu().numpy().tobytes())
                else:
                    h.update(p[1])
            digests[stage] = h.hexdigest()
        stats = {stage: [x.cpu().double().tolist() for x in xs] for stage, xs in self._stats.items()}
        return {"digests": digests, "stats": stats}
