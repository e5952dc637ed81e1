"""verlj's own sampler: a KV cache driven by explicit per-sample random numbers.

No draw touches a global RNG: a sample's seed gives its uniforms, one per response position, and a
token is drawn by inverting the (top-p truncated) CDF at the position's uniform. So a sample depends
only on its seed and the weights, in any process (the ``hf`` engine, the async generator).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..config import Config
from ..state.seeding import generator
from .models import forward_with_cache

# (group id, prompt token ids, one seed per sample): one group a rollout engine's `ask` queues in
# completion order (rl.rollout.RolloutEngine); the prompt may be a list of one per seed (an episode's
# turn: each episode's context so far)
AskedGroup = tuple[int, np.ndarray | list[np.ndarray], list[int]]


def step_order_only(engine: str) -> AssertionError:
    """What an engine that generates only in step order raises when asked for completion order."""
    return AssertionError(f"rollout.engine={engine} in rollout.mode=sync generates in step order only: "
                          "rollout.async_order=completion needs rollout.mode=async (config.validate refuses the rest)")


class GeneratesHere:
    """What the engines that generate in the trainer's own process share (hf, a colocated vLLM): a `submit`
    generates at once (its handle is the samples themselves: `result` hands them back), and only in step order
    (`ask` and `arrived`, completion order's calls, are refused). The engine defines `generate`."""

    name: str

    def generate(self, prompts: list[np.ndarray], seeds: list[int], cfg: Config) -> tuple[list[np.ndarray], list[np.ndarray]]:
        raise NotImplementedError

    def submit(self, prompts: list[np.ndarray], seeds: list[int], cfg: Config) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return self.generate(prompts, seeds, cfg)

    def result(self, handle: tuple[list[np.ndarray], list[np.ndarray]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return handle

    def ask(self, groups: list[AskedGroup], cfg: Config, batch_groups: int, progress: dict | None = None) -> None:
        raise step_order_only(self.name)

    def arrived(self, wait: float) -> list[tuple]:
        raise step_order_only(self.name)

    def partials(self) -> list[tuple]:
        raise step_order_only(self.name)


class SamplerEngine:
    """What the engines that run verlj's sampler share: their name in the journal and version."""

    name = "hf"

    @classmethod
    def preflight(cls, cfg: Config, device) -> None:
        """Runs wherever the actor runs."""

    def __init__(self, rt, actor, tokenizer) -> None:
        from importlib.metadata import version

        self.rt, self.actor, self.tokenizer = rt, actor, tokenizer
        self.version = version("transformers")  # read as loop.provenance.versions() reads it: one answer for both

    def metrics(self) -> dict[str, float]:
        """What the engine counts of itself for the step's metrics: nothing (the fleet counts its actors)."""
        return {}


def sampling_params(cfg: Config) -> dict:
    """What one generation call reads of the config (live keys: they may change between steps)."""
    ro = cfg.rollout
    return {"max_new_tokens": ro.max_response_length, "temperature": ro.temperature, "top_p": ro.top_p, "ignore_eos": ro.ignore_eos}


def seeded_uniforms(seeds: list[int], length: int, offsets: list[int] | None = None) -> torch.Tensor:
    """Each sample's uniforms ([B, length]): `length` draws from its seed's stream, from position `offsets[i]`
    on (a generation continued at token t draws uniforms[t:] of the same stream), zeros past its end."""
    full = torch.stack([torch.rand(length, generator=generator(s)) for s in seeds])
    if not offsets or not any(offsets):
        return full
    out = torch.zeros_like(full)
    for i, t in enumerate(offsets):
        out[i, : length - t] = full[i, t:]
    return out


def sample_seeded(model, prompts: list[np.ndarray], seeds: list[int], params: dict, eos_id: int, pad_id: int, device,
                  all_done: Callable[[bool], bool] = lambda done: done,
                  on_token: Callable[[np.ndarray], None] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """verlj's sampler on `model`: each sample's uniforms from its own seed (see the module's doc)."""
    uniforms = seeded_uniforms(seeds, params["max_new_tokens"])
    return generate(model, prompts, uniforms, eos_id=eos_id, pad_id=pad_id, device=device, all_done=all_done, on_token=on_token, **params)


def sample_token(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float):
    """Sample one token per row from logits [B, V] at the rows' uniforms [B] in [0, 1);
    returns (tokens [B], logprobs [B]) under temperature. Temperature 0 is greedy (the first of equal
    maxima; log-probs at temperature 1)."""
    if temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        remove = cum - sorted_p > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(remove, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    # inverse CDF on CPU (a sequential cumsum: the same bits everywhere); probs need not sum to 1.
    # The first index whose cumulative mass exceeds u * total never lands on a zero-probability token.
    cum = torch.cumsum(probs.cpu().double(), dim=-1)
    target = uniforms.double()[:, None] * cum[:, -1:]
    tokens = torch.searchsorted(cum, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    tokens = tokens.to(logits.device)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class Decoder:
    """One batch decoded token by token with a KV cache (what :func:`generate` runs): row i's token t drawn
    at ``uniforms[i, t]``, its context (prompt, and the tokens a continued generation had) left-padded into
    the batch, positions from the attention mask. A row ends at eos (included, unless ignore_eos) or at
    its budget (``budgets[i]`` tokens; None: the uniforms' width). `step` samples one token for every row
    (a row that ended gets the pad), `responses` gives each row's tokens and log-probs so far."""

    def __init__(self, model, contexts: list[np.ndarray], uniforms: torch.Tensor, *, temperature: float, top_p: float, eos_id: int,
                 pad_id: int, device: torch.device, ignore_eos: bool = False, budgets: list[int] | None = None):
        B = len(contexts)
        width = max(len(p) for p in contexts)
        ids = torch.full((B, width), pad_id, dtype=torch.long)
        mask = torch.zeros((B, width), dtype=torch.long)
        for i, p in enumerate(contexts):
            ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        self.model, self.uniforms, self.temperature, self.top_p = model, uniforms, temperature, top_p
        self.eos_id, self.pad_id, self.ignore_eos = eos_id, pad_id, ignore_eos
        self.mask = mask.to(device)
        self.step_ids, self.step_pos = ids.to(device), (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.budgets = torch.as_tensor(budgets, dtype=torch.long, device=device) if budgets is not None else None
        self.limit = int(max(budgets)) if budgets is not None else uniforms.shape[1]
        self.cache = None
        self.tokens: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One token for every row ([B]; a row's pad once it has ended)."""
        if self.tokens:  # the last token is the next input
            tok = self.tokens[-1]
            self.mask = torch.cat([self.mask, (~self.finished | (tok == self.eos_id)).long()[:, None]], dim=1)
            self.step_pos = self.step_pos[:, -1:] + 1
            self.step_ids = tok[:, None]
        logits, self.cache = forward_with_cache(self.model, self.step_ids, self.mask, self.step_pos, self.cache)
        tok, lp = sample_token(logits[:, -1, :], self.uniforms[:, len(self.tokens)], self.temperature, self.top_p)
        tok = torch.where(self.finished, torch.full_like(tok, self.pad_id), tok)
        self.tokens.append(tok)
        self.logps.append(lp)
        if not self.ignore_eos:
            self.finished = self.finished | (tok == self.eos_id)
        if self.budgets is not None:
            self.finished = self.finished | (self.budgets <= len(self.tokens))
        return tok

    @property
    def done(self) -> bool:
        """Every row ended, or the uniforms are spent."""
        return len(self.tokens) >= self.limit or bool(self.finished.all())

    def ended(self) -> np.ndarray:
        """Which rows have ended (bool [B])."""
        return self.finished.cpu().numpy()

    def responses(self, rows: list[int] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each row's tokens and log-probs so far (of `rows`, or all), cut after its eos and at its budget."""
        B = len(self.finished)
        if not self.tokens:
            return [np.zeros(0, np.int64) for _ in range(B)], [np.zeros(0, np.float32) for _ in range(B)]
        toks = torch.stack(self.tokens, 1).cpu().numpy()
        logps = torch.stack(self.logps, 1).float().cpu().numpy()
        budgets = self.budgets.cpu().numpy() if self.budgets is not None else None
        responses, logprobs = [], []
        for i in range(B) if rows is None else rows:
            row = toks[i]
            ends = np.nonzero(row == self.eos_id)[0] if not self.ignore_eos else np.zeros(0, dtype=np.int64)
            n = int(ends[0]) + 1 if len(ends) else len(row)
            if budgets is not None:
                n = min(n, int(budgets[i]))
            responses.append(row[:n].astype(np.int64))
            logprobs.append(logps[i, :n].astype(np.float32))
        return responses, logprobs


@torch.no_grad()
def generate(
    model,
    prompts: list[np.ndarray],
    uniforms: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    device: torch.device,
    ignore_eos: bool = False,
    all_done: Callable[[bool], bool] = lambda done: done,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Sample a response for each prompt, token t of row i at ``uniforms[i, t]`` ([B, max_new_tokens]).
    Returns (response ids, generation log-probs) per prompt.

    Prompts are left-padded into one batch; positions come from the attention mask. A response
    ends at eos (included) or at max_new_tokens (:class:`Decoder`). ``all_done`` lets ranks that share sharded
    weights (ZeRO-3, TP) keep stepping together until every rank has finished. ``on_token`` is given
    each step's tokens ([B], a row's pad once it has ended) as they are sampled (the agent gateway's
    token-by-token streams); it reads, and changes nothing sampled.
    """
    was_training = model.training
    model.eval()
    dec = Decoder(model, prompts, uniforms, temperature=temperature, top_p=top_p, eos_id=eos_id, pad_id=pad_id, device=device,
                  ignore_eos=ignore_eos)
    for _ in range(max_new_tokens):
        tok = dec.step()
        if on_token is not None:
            on_token(tok.cpu().numpy())
        if all_done(bool(dec.finished.all())):
            break
    model.train(was_training)
    return dec.responses()
