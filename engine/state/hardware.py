"""The hardware a run's numbers depend on, recorded with its library versions.

Bitwise equality is promised on the same kernels, not across them: torch dispatches CPU kernels by the
processor's instruction set (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2, AVX512, ...), and
matrix products round differently at each level; at one level, another processor model can too (the BLAS picks
its code path and blocking by the model: a 5th-generation Xeon rounds a run written on an earlier AVX-512 Xeon
differently); the BLAS torch was built with and, on GPUs, the device and its CUDA/cuDNN versions do the same. A run records these facts beside its versions (a start's identity, each
resume's lineage entry: ``loop.ledger``), ``verlj inspect`` shows them, and a replay, resume or rerun whose
fingerprint differs where they changed says that first (:func:`cross_hardware`).
"""

from __future__ import annotations

import re

KERNELS = "cpu kernels"  # the keys, as they read in `verlj inspect`'s versions line
PROCESSOR = "processor"
BLAS = "blas"
ACCELERATOR = "accelerator"
CUDA = "cuda"
CUDNN = "cudnn"
HARDWARE_KEYS = (KERNELS, PROCESSOR, BLAS, ACCELERATOR, CUDA, CUDNN)


def hardware() -> dict[str, str]:
    """This process's hardware facts: the CPU kernel level torch dispatches to, the processor's model, torch's BLAS,
    and the accelerator's name with its CUDA and cuDNN versions where one is present ("none" otherwise)."""
    import torch

    facts = {KERNELS: torch.backends.cpu.get_cpu_capability(), PROCESSOR: _processor(), BLAS: _blas(torch.__config__.show()),
             ACCELERATOR: "none"}
    if torch.cuda.is_available():
        facts[ACCELERATOR] = torch.cuda.get_device_name(0)
        facts[CUDA] = str(torch.version.cuda)
        facts[CUDNN] = str(torch.backends.cudnn.version())
    return facts


def _processor(cpuinfo: str | None = None) -> str:
    """The processor's model as its vendor, family and model numbers (``GenuineIntel 6/207``: what tells processors
    apart where a virtual machine names every one "Intel(R) Xeon(R) Processor"), from /proc/cpuinfo (`cpuinfo`: its
    text); else what the platform says; "unknown" when nothing does."""
    import platform

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read(1 << 16)
        except OSError:
            cpuinfo = ""
    first = cpuinfo.split("\n\n", 1)[0]
    fields = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in first.splitlines()))
    vendor, family, model = (fields.get(name, "") for name in ("vendor_id", "cpu family", "model"))
    if vendor and family and model:
        return f"{vendor} {family}/{model}"
    return platform.processor() or platform.machine() or "unknown"


def _blas(config: str) -> str:
    """The BLAS torch was built with, from its build settings (``BLAS_INFO=mkl``); "unknown" when not said."""
    found = re.search(r"BLAS_INFO=([\w.-]+)", config)
    return found.group(1) if found else "unknown"


def cross_hardware(recorded: dict, now: dict, verb: str = "replayed") -> str | None:
    """The sentence that explains a bitwise difference by the hardware, when the facts `recorded` with the
    run and those of this process (`now`) differ in kernel level or device; None when they agree or the run
    recorded none (runs from before this was recorded)."""
    if recorded.get(ACCELERATOR, "none") != now.get(ACCELERATOR, "none") and ACCELERATOR in recorded:
        return (f"produced on {_device(recorded)}, {verb} on {_device(now)}: bitwise equality across devices "
                "is not promised")
    if KERNELS in recorded and recorded[KERNELS] != now.get(KERNELS):
        return (f"produced on {recorded[KERNELS]}, {verb} on {now.get(KERNELS)}: bitwise equality across kernel "
                "levels is not promised")
    if PROCESSOR in recorded and recorded[PROCESSOR] != now.get(PROCESSOR) and recorded.get(ACCELERATOR, "none") == "none":
        return (f"produced on a {recorded[PROCESSOR]} processor, {verb} on a {now.get(PROCESSOR)} one: bitwise equality across "
                f"processor models is not promised")
    for key in (BLAS, CUDA, CUDNN):
        if key in recorded and recorded[key] != now.get(key):
            return (f"produced with {key} {recorded[key]}, {verb} with {key} {now.get(key)}: bitwise equality across "
                    f"{key} builds is not promised")
    return None


def _device(facts: dict) -> str:
    name = facts.get(ACCELERATOR, "none")
    return f"the CPU ({facts.get(KERNELS)})" if name == "none" else name
