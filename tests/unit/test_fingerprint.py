"""The state digests: sum64 tells apart any two states that differ in one word or in the order of
two different words, is the same for the same bytes however they are laid out in memory, and the
blake3 kind is byte for byte the digest verlj journaled before sum64 (old runs replay against it)."""

import blake3
import numpy as np
import pytest
import torch

from verlj.engine.state import fingerprint
from verlj.engine.state.fingerprint import ROW, _words, group_sums, leaves_digest, tensor_sums


def sums(t):
    return tensor_sums(t).tolist()


@pytest.mark.parametrize("n", [1, 7, ROW - 1, ROW, 3 * ROW + 5])
def test_sum64_sees_every_word_and_every_exchange(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g)
    base = sums(t)
    assert sums(t.clone()) == base
    for i in sorted({0, n // 2, n - 1}):
        for bit in (0, 13, 31):
            u = t.clone()
            u.view(torch.int32)[i] ^= 1 << bit
            assert sums(u) != base, (i, bit)
    if n > 1:
        for i, j in ((0, n - 1), (0, 1), (n // 3, (2 * n) // 3 + 1 if (2 * n) // 3 + 1 < n else n - 1)):
            if i != j and t[i] != t[j]:
                u = t.clone()
                u[i], u[j] = t[j], t[i]
                assert sums(u) != base, (i, j)


def test_sum64_is_layout_free_and_covers_every_dtype():
    t = torch.randn(64, 96)
    assert sums(t.t().contiguous().t()) == sums(t)  # a non-contiguous view of the same values
    assert sums(t) == sums(t.reshape(-1))
    for x in (t.to(torch.bfloat16), t.to(torch.float64), torch.arange(10), torch.tensor([True, False]), torch.tensor(3.5)):
        s = sums(x)
        y = x.clone()
        y.reshape(-1)[0] = (~y.reshape(-1)[0]) if y.dtype == torch.bool else y.reshape(-1)[0] + 1
        assert sums(y) != s, x.dtype


def test_leaves_digest_names_shapes_and_the_old_blake3_bytes():
    a = torch.arange(6, dtype=torch.float32)
    leaves = [("param/w", a), ("optim/state/0/step", torch.tensor(4.0)), ("optim/param_groups/0/lr", 0.001), ("global_steps", 4)]
    d = leaves_digest(leaves, "sum64")
    assert d == leaves_digest(list(leaves), "sum64")
    assert leaves_digest([("param/w", a.reshape(2, 3)), *leaves[1:]], "sum64") != d  # the shape is part of it
    assert leaves_digest([("param/v", a), *leaves[1:]], "sum64") != d  # and the name
    # blake3: what engine_digest hashed before there were kinds
    h = blake3.blake3()
    for path, v in leaves:
        if isinstance(v, torch.Tensor):
            h.update(f"{path}:{v.dtype}:{tuple(v.shape)}".encode())
            h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif path == "global_steps":
            h.update(f"global_steps={v}".encode())
        else:
            h.update(f"{path}={v!r}".encode())
    assert leaves_digest(leaves, "blake3") == h.hexdigest()
    assert np.asarray(tensor_sums(a)).dtype == np.int64


def test_the_small_tensors_row_is_their_concatenation_s_without_building_it():
    """group_sums reduces the small tensors in place (and the tiny ones in bounded chunks): the row it
    gives must be tensor_sums of all their words laid end to end, as every journaled sum64 holds."""
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        sizes = torch.randint(1, 70000, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        if trial % 3 == 0:
            sizes = [int(x) % 40 + 1 for x in sizes]  # only tiny ones: every word in gathered chunks
        ts = [torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64).view(torch.float64) if i % 4 == 0
              else torch.randn(n * 2 + i % 3, generator=g).to(torch.bfloat16 if i % 4 == 1 else torch.float32)
              for i, n in enumerate(sizes)]
        small = [t for t in ts if t.numel() * t.element_size() < 1 << 20]
        want = tensor_sums(torch.cat([_words(t) for t in small]))
        assert group_sums(ts)[0].tolist() == want.tolist(), sizes


@pytest.mark.parametrize("piece", [fingerprint.PIECE, 1000 * ROW, 4099])
def test_large_tensors_in_pieces_on_threads_are_the_same_bits(monkeypatch, piece):
    """A large tensor is reduced in pieces (at any offset, part rows included), by one thread or many:
    each row of group_sums is still tensor_sums of the tensor, as a journaled sum64 holds."""
    g = torch.Generator().manual_seed(piece)
    ts = [torch.randn(n, generator=g) for n in (300_001, 5, 262_144, 70)] + [torch.randn(700, 513, generator=g).to(torch.bfloat16),
                                                                          torch.randn(9, 40_000, generator=g, dtype=torch.float64).t()]
    want = [tensor_sums(t).tolist() for t in ts if t.numel() * t.element_size() >= 1 << 20]
    monkeypatch.setattr(fingerprint, "PIECE", piece)
    for threads in (1, 4):
        monkeypatch.setattr(fingerprint, "MAX_THREADS", threads)
        got = group_sums(ts)
        assert got[1:].tolist() == want, (piece, threads)
        assert got[0].tolist() == tensor_sums(torch.cat([_words(t) for t in ts if t.numel() * t.element_size() < 1 << 20])).tolist()


def test_sum64_digest_is_pinned():
    """A journaled fingerprint must never change: this digest was computed by the concatenating code."""
    g = torch.Generator().manual_seed(7)
    leaves = [(f"param/t{i}", torch.randn(n, generator=g)) for i, n in enumerate([3, 17, 1000, 65537, 40000, 262143, 5, 300000, 16, 33])]
    leaves += [("optim/b", torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8)),
               ("optim/h", torch.randn(7, generator=g).to(torch.bfloat16)), ("optim/big", torch.randn(600, 1000, generator=g)),
               ("global_steps", 3)]
    assert leaves_digest(leaves, "sum64") == "cfdb0486ab1759c46c060a75c1926fd51c6bbc495d32e1ce54b58473cd172064"
