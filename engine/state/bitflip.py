"""One flipped bit, on purpose: the silent data corruption that the ``update.grads`` and
``update.params`` failpoints (journal.failpoints) inject, for `verlj rerun` to find. A mantissa
bit: the smallest change a value can take, the hardest to see in any metric."""

from __future__ import annotations

import random

import torch

_INT_VIEW = {torch.float32: (torch.int32, 23), torch.float64: (torch.int64, 52), torch.float16: (torch.int16, 10),
             torch.bfloat16: (torch.int16, 7)}


def flip_one_bit(tensors: list[torch.Tensor], action: str) -> str:
    """Flip one mantissa bit of one element among `tensors`, in place, chosen by the seed in `action`
    (``flip=SEED``); says which."""
    rng = random.Random(int(action.partition("=")[2] or 0))
    pool = [t for t in tensors if t.dtype in _INT_VIEW and t.numel() and t.is_contiguous()]
    if not pool:
        return "nothing to flip"
    k = rng.randrange(sum(t.numel() for t in pool))
    n = 0
    while k >= pool[n].numel():
        k -= pool[n].numel()
        n += 1
    t = pool[n]
    int_dtype, mantissa = _INT_VIEW[t.dtype]
    bit = rng.randrange(mantissa)
    words = t.detach().view(-1).view(int_dtype)
    words[k] = words[k] ^ (1 << bit)
    return f"bit {bit} of element {k} of tensor {n} ({tuple(t.shape)})"
