"""A run's topology: the number of ranks, the ZeRO stage and the tensor-parallel size that lay its
state out, and which changes of it a snapshot can be resharded across (state.reshard does it).
No torch here: recovery's plan and the post-mortem commands use it without a deep-learning stack."""

from __future__ import annotations

from dataclasses import dataclass

from ..schema.record import Record


@dataclass(frozen=True)
class Topology(Record):
    """As the ledger's topology history and a snapshot's converted form (state.reshard) hold it:
    ``{world_size, tensor_parallel_size, zero_stage}``."""

    world_size: int
    tensor_parallel_size: int
    zero_stage: int

    @classmethod
    def of_runtime(cls, rt, cfg) -> Topology:
        return cls(rt.world_size, rt.tp_size, cfg.distributed.zero_stage)

    def __str__(self) -> str:
        return f"{self.world_size} rank{'s' if self.world_size != 1 else ''}, ZeRO-{self.zero_stage}, TP {self.tensor_parallel_size}"


def refusal(src: Topology, dst: Topology, loss_normalization: str = "global_tokens") -> str | None:
    """Why a snapshot of `src` cannot be loaded under `dst` (one sentence), or None."""
    if loss_normalization == "micro_batch" and src != dst:
        return (f"this run normalises its loss per micro-batch (algorithm.loss_normalization=micro_batch: runs made "
                f"before verlj had the key), so another split over ranks would change its objective; resume it on {src}")
    if src.tensor_parallel_size > 1 and src.zero_stage > 0:
        return (f"a snapshot of a tensor-parallel run with ZeRO-{src.zero_stage} cannot be resharded (DeepSpeed's "
                f"converter has no AutoTP layout for it); resume it on {src}, or train TP runs at ZeRO-0, which reshard")
    if dst.tensor_parallel_size > 1 and dst.zero_stage > 0 and src != dst:
        return (f"resharded state loads into tensor-parallel engines only at ZeRO-0 (this resume asks for ZeRO-{dst.zero_stage} "
                f"with TP {dst.tensor_parallel_size}); use distributed.zero_stage=0 with TP, or TP 1 with any stage")
    return None
