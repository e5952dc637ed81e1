"""Asynchronous rollout (``rollout.mode=async``): a generator process beside each trainer rank.

The process holds its own copy of the policy and generates with verlj's sampler (sampler.sample_seeded),
so a sample depends only on its seed and the weights it was generated from. It is spawned with
``torch.multiprocessing`` and shares the weights with the trainer through shared memory: its
parameters *are* tensors the trainer allocated once (``share_memory_``), and a push is the trainer
copying the actor's current parameters into them while the generator is idle. Requests and results
travel over two pipes (no named semaphores, so a SIGKILL of the whole process group leaves nothing in
/dev/shm). Nothing else is shared, and nothing is written to disk.

What the trainer asks for is decided by its rollout source (``rl.sources``), so the generator needs
no policy of its own: it generates what it is told, from the version it holds, and says which
version that was.

- Step order (``rollout.async_order=step``): one batch at a time (``submit``/``result``), the batch of
  step s+k generated from version s-1 while step s trains.
- Completion order (``rollout.async_order=completion``): the trainer queues groups (``ask``: one
  prompt, ``rollout.n`` samples each) and the process works through the queue on its own, taking
  what is queued (up to a rank's share of a step) as one batch, and sends each group back as its
  batch completes (``arrived``).

- Completion order with ``rollout.partial`` (``rl.partial``): the process keeps its rows generating
  token by token, sends each group back as its last sample ends, and a push stops every generation at
  its next token instead: the groups stopped are sent back as they stand (``partials``: the trainer
  makes them durable) and go on under the new weights.

A push (``sync``) first pauses the process at a batch's boundary (with rollout.partial: at its next
token): every generation begun from the old version has then been sent back, complete or stopped, so
whatever is still queued starts from the new one. The
completion source's ``finish_collect`` pushes before the step's commit, so a group in flight at a
crash began (if at all) from the last committed version, the one a resume holds, which generates it
again from its seeds (in a batch that timing composes: the same version and seeds, not necessarily
the same bits).

The process ignores SIGINT and SIGTERM (the trainer finishes its step and stops it), and dies with
the trainer (PR_SET_PDEATHSIG, and a parent check between requests). If it dies first, the trainer's
next wait ends with one sentence naming it, and ``--resume`` continues exactly: a batch counts only
once the journal holds it.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from verlj.journal.failpoints import failpoint

from ..config import Config
from ..errors import RunError
from .partial import Progress
from .reaper import resource_tracker_apart
from .sampler import AskedGroup, SamplerEngine, sampling_params

POLL_S = 0.5  # how often a wait checks that the other side is alive
START_TIMEOUT_S = 600.0


class GeneratorProcess(SamplerEngine):
    """rollout.mode=async: the RolloutEngine that generates in a separate process (see the module's doc),
    on the trainer's device. ``submit`` returns at once; ``result`` waits. ``policy_version`` is the
    version it holds."""

    def __init__(self, rt, actor, tokenizer) -> None:
        super().__init__(rt, actor, tokenizer)
        self.proc: Any = None  # the generator's (torch.multiprocessing) Process: None until the first sync, after close
        self.shared: dict[str, torch.Tensor] = {}
        self.policy_version: int | None = None  # the version the process holds
        self.stale = True
        self._next = 0
        self._arrivals: list[tuple] = []  # completion order: groups sent back, not yet taken by `arrived`
        self._partials: dict[int, tuple] = {}  # rollout.partial: groups a push stopped, not yet taken by `partials`

    # ------------------------------------------------------------------ lifecycle

    def sync(self, cfg: Config, version: int) -> None:
        """Start the process (first call) or push the actor's weights (after an update), as `version`.
        Called only while the process is idle. Collective (ZeRO-3 gathers the parameters)."""
        if self.proc is not None and not self.stale and self.policy_version == version:
            return
        params = self.actor.policy_weights()
        if self.proc is None:
            self._start(cfg, params, version)
        else:
            self._call(("pause",), "paused")  # at a batch's boundary: what began from the old version is sent back
            failpoint("async.push")
            with torch.no_grad():
                for name, t in params:
                    self.shared[name].copy_(t)
            self._call(("version", version), "push")
        self.policy_version, self.stale = version, False

    def _start(self, cfg: Config, params, version: int) -> None:
        failpoint("async.start")
        resource_tracker_apart()  # a group kill of the run leaves no sem.mp-* in /dev/shm (rl.reaper)
        ctx = torch.multiprocessing.get_context("spawn")
        self.shared = {name: t.detach().clone().share_memory_() for name, t in params}
        child_requests, self.requests = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self.results, child_results = ctx.Pipe(duplex=False)
        tok = self.tokenizer
        self.proc = ctx.Process(
            target=serve,
            args=(child_requests, child_results, cfg.to_dict(), self.shared, version, tok.eos_token_id, tok.pad_token_id,
                  torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), os.getpid(), self.rt.dp_size),
            name=f"verlj-generator-{self.rt.rank}",
            daemon=True,
        )
        self.proc.start()
        child_requests.close()  # the child's ends: a dead child then reads as end-of-file here
        child_results.close()
        atexit.register(self.close)  # before multiprocessing's own exit handler, which would wait on it forever
        self._wait("ready", START_TIMEOUT_S)

    def weights_changed(self) -> None:
        self.stale = True

    def close(self, at_once: bool = False) -> None:
        """Stop the generator process: it finishes the batch in hand, then exits; `at_once` (a second
        Ctrl-C) kills it instead. It holds nothing that must outlive it: every sample the run may
        rely on is journaled by the trainer."""
        if self.proc is None:
            return
        if self.proc.is_alive():
            try:
                self.requests.send(("stop",))
            except (OSError, ValueError):
                pass
            self.proc.join(0 if at_once else 10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        for conn in (self.requests, self.results):
            conn.close()
        self.proc = None
        self.shared = {}
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ generation

    def submit(self, prompts: list[np.ndarray], seeds: list[int], cfg: Config) -> int:
        self._next += 1
        self._send(("generate", self._next, [np.asarray(p) for p in prompts], list(seeds), sampling_params(cfg), self.policy_version))
        return self._next

    def result(self, handle: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        reply = self._wait(handle, None)
        return reply[2], reply[3]

    def generate(self, prompts: list[np.ndarray], seeds: list[int], cfg: Config):
        return self.result(self.submit(prompts, seeds, cfg))

    def ask(self, groups: list[AskedGroup], cfg: Config, batch_groups: int, progress: dict[int, Progress] | None = None) -> None:
        """Completion order: queue groups (group id, prompt, one seed per sample; the prompt may be a list
        of one prompt per seed: an episode's turn); they come back from `arrived`, in the order the
        process completes them. It generates up to `batch_groups` queued groups together, as one batch
        from one version. rollout.partial: `progress` has a group's tokens so far where it goes on from them
        (rl.partial: a resume's durable tokens), and a push stops the groups in flight (`partials`)."""
        if not groups:
            return
        if cfg.rollout.partial:
            progress = progress or {}
            self._send(("ask", [(int(g), np.asarray(p), list(seeds), progress.get(int(g))) for g, p, seeds in groups], sampling_params(cfg),
                        batch_groups))
            return
        self._send(("ask", [(int(g), [np.asarray(x) for x in p] if isinstance(p, list) else np.asarray(p), list(seeds))
                            for g, p, seeds in groups], sampling_params(cfg), batch_groups))

    def partials(self) -> list[tuple]:
        """rollout.partial: the groups the pushes since the last call stopped with tokens, as (group, responses,
        log-probs, runs, done): each as it stood at its push (the latest)."""
        out, self._partials = list(self._partials.values()), {}
        return out

    def arrived(self, wait: float) -> list[tuple]:
        """Completion order: the groups completed since the last call, as (group, responses, log-probs,
        version), waiting up to `wait` seconds for the first when none has."""
        deadline = time.monotonic() + wait
        while (reply := self._reply(0 if self._arrivals else max(0.0, deadline - time.monotonic()))) is not None:
            if reply[0] not in ("group", "partial"):
                raise RunError(f"the rollout generator process answered {reply[1]!r} unasked")
            self._took(reply)
        out, self._arrivals = self._arrivals, []
        return out

    def _took(self, reply: tuple) -> None:
        """A group sent back: completed (to `arrived`), or stopped by a push with its tokens so far (to `partials`)."""
        if reply[0] == "group":
            self._arrivals.append(reply[1:])
            self._partials.pop(int(reply[1]), None)
        else:
            self._partials[int(reply[1])] = reply[1:]

    def _call(self, message: tuple, tag) -> tuple:
        self._send(message)
        return self._wait(tag, None)

    def _send(self, message: tuple) -> None:
        """Send to the process; one sentence when it died (the pipe breaks when it is gone)."""
        try:
            self.requests.send(message)
        except OSError:  # BrokenPipeError, ...: its end closed
            self.proc.join(5)
            if not self.proc.is_alive():
                self._died()
            raise

    def _died(self):
        code = self.proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        raise RunError(f"the rollout generator process (pid {self.proc.pid}) {how}; every committed step is in "
                       "the journal: `verlj train --resume` continues the run exactly") from None

    def _reply(self, timeout: float) -> tuple | None:
        """The process's next message within `timeout` seconds (None: nothing yet); one sentence when it
        died or erred."""
        try:
            reply = self.results.recv() if self.results.poll(timeout) else None
        except (EOFError, OSError):  # the child's end closed: it is gone (the exit code comes with the join)
            self.proc.join(5)
            reply = None
        if reply is None:
            if not self.proc.is_alive():
                self._died()
            return None
        if reply[0] == "error":
            raise RunError(f"the rollout generator process failed: {reply[1]}")
        return reply

    def _wait(self, tag, timeout: float | None) -> tuple:
        """The process's reply `tag`, waiting while it is alive; one sentence when it died or erred."""
        start = time.monotonic()
        while True:
            reply = self._reply(POLL_S)
            if reply is None:
                if timeout is not None and time.monotonic() - start > timeout:
                    raise RunError(f"the rollout generator process (pid {self.proc.pid}) did not start within {timeout:.0f} s") from None
                continue
            if reply[0] in ("group", "partial"):  # completion order: a group that completed (or a push stopped) before the reply awaited
                self._took(reply)
                continue
            if reply[1] != tag:
                raise RunError(f"the rollout generator process answered {reply[1]!r} where {tag!r} was awaited")
            return reply


class VllmGeneratorProcess(GeneratorProcess):
    """rollout.mode=async with rollout.engine=vllm: the generator process runs a vLLM engine, built
    from the shared weights and reloaded from them at every push (vLLM's own weight reload)."""

    name = "vllm"

    @classmethod
    def preflight(cls, cfg: Config, device) -> None:
        from .vllm_engine import preflight

        preflight(cfg, device)

    def __init__(self, rt, actor, tokenizer):
        from .vllm_engine import import_vllm

        super().__init__(rt, actor, tokenizer)
        self.version = str(import_vllm().__version__)


def serve(requests, results, cfg_dict: dict, weights: dict, version: int, eos_id: int, pad_id: int, threads: int,
          deterministic: bool, parent: int, dp_size: int = 1) -> None:
    """The generator process's main loop (spawned: everything it needs comes as arguments). With
    rollout.engine=vllm it generates with a vLLM engine of its own, else with verlj's sampler on the
    shared weights."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    try:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        generate, push, stream = _generator(cfg_dict, weights, eos_id, pad_id, dp_size)
        results.send(("ready", "ready", os.getpid()))
    except Exception as e:  # noqa: BLE001 - reported to the trainer in one sentence
        results.send(("error", f"{type(e).__name__}: {e}"))
        return
    if stream is not None:  # rollout.partial: generations stopped at a push and continued (rl.partial)
        from . import partial

        partial.serve(requests, results, stream, push, version, parent)
        return

    queue: deque = deque()  # completion order: (group, prompt, seeds, params) asked, not begun
    batch_groups = 1  # completion order: the most groups generated together (one batch: one version)
    paused = False
    while True:
        idle = paused or not queue
        try:
            msg = requests.recv() if requests.poll(POLL_S if idle else 0) else None
        except (EOFError, OSError):  # the trainer closed its end or died
            return
        try:
            if msg is None:
                if idle:
                    if os.getppid() != parent:
                        return
                    continue
                batch = [queue.popleft() for _ in range(min(len(queue), batch_groups))]  # from the version held now
                prompts = [x for _, p, seeds, _ in batch for x in (p if isinstance(p, list) else [p] * len(seeds))]
                seeds = [x for _, _, seeds, _ in batch for x in seeds]
                responses, logps = generate(prompts, seeds, batch[-1][3])
                failpoint("generator.before_reply")
                at = 0
                for group, _, group_seeds, _ in batch:
                    n = len(group_seeds)
                    results.send(("group", group, responses[at : at + n], logps[at : at + n], version))
                    at += n
            elif msg[0] == "stop":
                return
            elif msg[0] == "ask":
                queue.extend((g, p, seeds, msg[2]) for g, p, seeds in msg[1])
                batch_groups = msg[3]
            elif msg[0] == "pause":  # between two batches: nothing is begun from the version held
                paused = True
                results.send(("ok", "paused"))
            elif msg[0] == "version":  # the trainer has copied new weights in: they are this version
                push()
                version, paused = msg[1], False
                results.send(("ok", "push"))
            elif msg[0] == "generate":
                _, tag, prompts, seeds, params, want = msg
                if want != version:
                    raise RuntimeError(f"asked for policy version {want}, holding {version}")
                responses, logps = generate(prompts, seeds, params)
                failpoint("generator.before_reply")
                results.send(("done", tag, responses, logps, version))
        except Exception as e:  # noqa: BLE001 - reported to the trainer in one sentence
            results.send(("error", f"{type(e).__name__}: {e}"))
            return


def _generator(cfg_dict: dict, weights: dict, eos_id: int, pad_id: int, dp_size: int):
    """The generator process's policy, its parameters the trainer's shared `weights` (with
    rollout.engine=vllm, a vLLM engine built from them). Returns (generate(prompts, seeds, params)
    -> (responses, log-probs), push(): the weights changed, reload them where they are copied,
    rollout.partial's stream over the policy (rl.partial; None without))."""
    from ..config import config_from_dict
    from .models import load_causal_lm
    from .partial import stream_for
    from .sampler import sample_seeded

    cfg = config_from_dict(cfg_dict)
    model = load_causal_lm(cfg.model.actor.model_name_or_path, cfg, 0)  # its structure: the weights are the trainer's
    params = dict(model.named_parameters())
    if set(params) != set(weights):
        raise RuntimeError(f"the policy's parameters differ from the trainer's: {sorted(set(params) ^ set(weights))[:3]}")
    for name, t in weights.items():
        params[name].data = t
    model.eval()
    device = next(iter(weights.values())).device
    rows = max(1, cfg.data.prompts_per_step // dp_size) * cfg.rollout.n  # a rank's share of a step: one batch
    if cfg.rollout.partial:  # every group asked generates at once: the k rounds asked ahead and the step's own
        rows *= cfg.rollout.staleness + 1
    if cfg.rollout.engine != "vllm":
        stream = stream_for(model, False, eos_id, pad_id, device, rows) if cfg.rollout.partial else None
        return (lambda prompts, seeds, p: sample_seeded(model, prompts, seeds, p, eos_id, pad_id, device)), (lambda: None), stream
    from . import vllm_engine

    names = list(weights)
    llm = vllm_engine.start_llm(cfg, model.config, list(weights.items()), dp_size, device.type, seqs=rows if cfg.rollout.partial else None)
    return ((lambda prompts, seeds, p: vllm_engine.generate_llm(llm, prompts, seeds, p, eos_id)),
            (lambda: vllm_engine.push_llm(llm, names, list(weights.items()))),
            stream_for(llm, True, eos_id, pad_id, device, rows) if cfg.rollout.partial else None)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the trainer dies (PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
