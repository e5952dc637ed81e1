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

    def ask(self, groups: list[AskedGroup], cfg: Config, batch_groups: int) -> None:
        raise step_order_only(self.name)

    def arrived(self, wait: float) -> list[tuple]:
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


def sample_seeded(model, prompts: list[np.ndarray], seeds: list[int], params: dict, eos_id: int, pad_id: int, device,
                  all_done: Callable[[bool], bool] = lambda done: done,
                  on_token: Callable[[np.ndarray], None] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """verlj's sampler on `model`: each sample's uniforms from its own seed (see the module's doc)."""
    uniforms = torch.stack([torch.rand(params["max_new_tokens"], generator=generator(s)) for s in seeds])
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
    ends at eos (included) or at max_new_tokens. ``all_done`` lets ranks that share sharded
    weights (ZeRO-3, TP) keep stepping together until every rank has finished. ``on_token`` is given
    each step's tokens ([B], a row's pad once it has ended) as they are sampled (the agent gateway's
    token-by-token streams); it reads, and changes nothing sampled.
    """
    was_training = model.training
    model.eval()
    B = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    out_tokens: list[torch.Tensor] = []
    out_logps: list[torch.Tensor] = []
    cache = None
    step_ids, step_pos = ids, positions
    for _ in range(max_new_tokens):
        logits, cache = forward_with_cache(model, step_ids, mask, step_pos, cache)
        tok, lp = sample_token(logits[:, -1, :], uniforms[:, len(out_tokens)], temperature, top_p)
        tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
        out_tokens.append(tok)
        out_logps.append(lp)
        if on_token is not None:
            on_token(tok.cpu().numpy())
        if not ignore_eos:
            finished = finished | (tok == eos_id)
        if all_done(bool(finished.all())):
            break
        mask = torch.cat([mask, (~finished | (tok == eos_id)).long()[:, None]], dim=1)
        step_pos = step_pos[:, -1:] + 1
        step_ids = tok[:, None]
    model.train(was_training)
    toks = torch.stack(out_tokens, 1).cpu().numpy()
    logps = torch.stack(out_logps, 1).float().cpu().numpy()
    responses, logprobs = [], []
    for i in range(B):
        row = toks[i]
        ends = np.nonzero(row == eos_id)[0] if not ignore_eos else np.zeros(0, dtype=np.int64)
        n = int(ends[0]) + 1 if len(ends) else len(row)
        responses.append(row[:n].astype(np.int64))
        logprobs.append(logps[i, :n].astype(np.float32))
    return responses, logprobs
