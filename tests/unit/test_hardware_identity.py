"""state.hardware: the facts recorded, and the one sentence that names a hardware change as the cause."""

from verlj.engine.state.hardware import _blas, _processor, cross_hardware, hardware

CPU = {"cpu kernels": "AVX512", "processor": "GenuineIntel 6/85", "blas": "mkl", "accelerator": "none"}


def test_this_process_has_its_facts():
    import torch

    facts = hardware()
    assert facts["cpu kernels"] == torch.backends.cpu.get_cpu_capability()
    assert facts["blas"] != "" and facts["accelerator"] == ("none" if not torch.cuda.is_available() else torch.cuda.get_device_name(0))


def test_blas_from_the_build_settings():
    assert _blas("  - Build settings: BLAS_INFO=open, BUILD_TYPE=Release, LAPACK_INFO=open") == "open"
    assert _blas("no build settings here") == "unknown"


def test_the_processor_model_from_cpuinfo():
    info = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Intel(R) Xeon(R) Processor\n\n" \
           "processor\t: 1\nvendor_id\t: AuthenticAMD\n"
    assert _processor(info) == "GenuineIntel 6/207"  # the first processor's; a VM's model name tells nothing
    assert _processor("") != "" and hardware()["processor"] != ""


def test_another_processor_model_at_the_same_level_is_named():
    """A 5th-generation Xeon rounds what an earlier AVX-512 Xeon wrote differently: the model is the cause said."""
    assert cross_hardware(CPU, {**CPU, "processor": "GenuineIntel 6/207"}) == (
        "produced on a GenuineIntel 6/85 processor, replayed on a GenuineIntel 6/207 one: bitwise equality across processor "
        "models is not promised")
    assert cross_hardware(CPU, {**CPU, "processor": "GenuineIntel 6/207", "cpu kernels": "AVX2"}).startswith("produced on AVX512")
    gpu = {**CPU, "accelerator": "NVIDIA H200", "cuda": "12.8", "cudnn": "91002"}
    assert cross_hardware(gpu, {**gpu, "processor": "AuthenticAMD 25/17"}) is None  # the device computes: its host is no cause


def test_the_kernel_level_is_named_first():
    assert cross_hardware(CPU, {**CPU, "cpu kernels": "AVX2"}) == \
        "produced on AVX512, replayed on AVX2: bitwise equality across kernel levels is not promised"
    assert cross_hardware(CPU, {**CPU, "cpu kernels": "AVX2"}, "rerun").endswith("rerun on AVX2: bitwise equality across kernel levels is not promised")


def test_a_device_change_outranks_the_kernels():
    gpu = {**CPU, "accelerator": "NVIDIA H200", "cuda": "12.8", "cudnn": "91002"}
    assert cross_hardware(gpu, {**CPU, "cpu kernels": "AVX2"}) == \
        "produced on NVIDIA H200, replayed on the CPU (AVX2): bitwise equality across devices is not promised"
    assert cross_hardware(gpu, {**gpu, "cudnn": "90100"}) == \
        "produced with cudnn 91002, replayed with cudnn 90100: bitwise equality across cudnn builds is not promised"


def test_same_hardware_or_none_recorded_explains_nothing():
    assert cross_hardware(CPU, dict(CPU)) is None
    assert cross_hardware({}, CPU) is None  # a run from before the hardware was recorded
    assert cross_hardware({"torch": "2.13.0"}, CPU) is None


def test_every_rank_names_the_hardware_from_the_history_it_was_sent():
    """The divergence's cause is read from the run's History (sent to every rank), not from rank 0's
    ledger: a rank without a journal says the same first sentence."""
    from verlj.engine.errors import HardwareDivergence
    from verlj.engine.loop.records import History, ProducedOn
    from verlj.engine.loop.recovery import _diverged
    from verlj.engine.state.topology import Topology

    here = hardware()
    other = {**here, "cpu kernels": "AVX512" if here["cpu kernels"] != "AVX512" else "AVX2"}
    history = History(0, 3, 0, {}, [], Topology(1, 1, 0), [], produced_on=[ProducedOn(-1, other), ProducedOn(2, here)])
    assert history.versions_at(2) == other and history.versions_at(3) == here
    sent = History.from_dict(history.to_dict())
    err = _diverged(sent, 2, "fingerprint a… but the journal has b…")
    assert isinstance(err, HardwareDivergence) and str(err).startswith(f"step 2 was produced on {other['cpu kernels']}, replayed on")
    same = _diverged(sent, 3, "fingerprint a… but the journal has b…")
    assert not isinstance(same, HardwareDivergence) and str(same) == "replay diverged at step 3: fingerprint a… but the journal has b…"
