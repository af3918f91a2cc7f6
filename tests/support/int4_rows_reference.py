"""Checks of the row kernels' 4-bit linear (kernels/csrc/int4_rows.cpp) against its arithmetic in
torch (int4_rows_reference below), shared by the built op's test and the other instruction
set paths' (each built in its own process)."""

from __future__ import annotations

import torch

from services.executor.quantized import GROUP_SIZE, pack_int4_rows

# (out, in): one pair of tiles and one block; the embedded model's q/k/v and down shapes.
SHAPES = [(16, 32), (960, 576), (576, 1536)]
ROWS = [1, 2, 3, 4, 5, 9, 33]


def int4_rows_reference(
    x: torch.Tensor,  # [rows, in] fp32
    q: torch.Tensor,  # [out, in] integers in [0, 15]
    d: torch.Tensor,  # [out, in // 32] fp16
    m: torch.Tensor,  # [out, in // 32] fp16
) -> torch.Tensor:  # [rows, out] fp64
    """int4_rows_linear's arithmetic in torch (float64 accumulation): each row quantized per
    block of 32 to -127..127 by max |x| / 127, exact integer sums per block, then
    sum_b d * s * I + m * X."""
    rows, in_features = x.shape
    blocks = in_features // GROUP_SIZE
    xb = x.float().view(rows, blocks, GROUP_SIZE)
    amax = xb.abs().amax(-1)  # [rows, blocks]
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    a = (xb * inverse[..., None]).round().clamp(-127, 127)  # [rows, blocks, 32]
    s, sums = amax / 127.0, xb.sum(-1)
    qb = q.double().view(q.shape[0], blocks, GROUP_SIZE)  # [out, blocks, 32]
    integers = torch.einsum("rbi,obi->rob", a.double(), qb)  # exact in fp64
    dd, mm = d.double(), m.double()  # [out, blocks]
    return (integers * dd[None] * s.double()[:, None] + mm[None] * sums.double()[:, None]).sum(-1)


def random_case(out_features: int, in_features: int, seed: int):
    """Q4_1-like blocks (d > 0, m <= 0 as GGUF's minimums mostly are) of random nibbles."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    blocks = in_features // 32
    d = (torch.rand(out_features, blocks, generator=gen) * 0.02 + 1e-3).half()
    m = (-torch.rand(out_features, blocks, generator=gen) * 0.1).half()
    return q, d, m


def worst_case(in_features: int):
    """Every nibble 15 and every activation level 127: the int16 pair sums at their largest."""
    q = torch.full((16, in_features), 15, dtype=torch.int32)
    d = torch.full((16, in_features // 32), 0.5).half()
    m = torch.zeros(16, in_features // 32).half()
    return q, d, m


def outputs(op, seed: int = 0) -> list[torch.Tensor]:
    """The op's outputs on every shape and row count (seeded inputs, worst case last)."""
    results = []
    for i, (out_features, in_features) in enumerate(SHAPES):
        q, d, m = random_case(out_features, in_features, seed + i)
        packed = pack_int4_rows(q, d, m)
        gen = torch.Generator().manual_seed(seed + 100 + i)
        for rows in ROWS:
            results.append(op(torch.randn(rows, in_features, generator=gen), packed))
    q, d, m = worst_case(64)
    results.append(op(torch.ones(3, 64), pack_int4_rows(q, d, m)))
    return results


def check_op(op, seed: int = 0) -> None:
    """The op equals the torch reference up to fp32 rounding, sums the worst case exactly, and
    gives each row the bits it gets alone."""
    for i, (out_features, in_features) in enumerate(SHAPES):
        q, d, m = random_case(out_features, in_features, seed + i)
        packed = pack_int4_rows(q, d, m)
        gen = torch.Generator().manual_seed(seed + 100 + i)
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            got = op(x, packed)
            assert got.shape == (rows, out_features)
            expected = int4_rows_reference(x, q, d, m)
            error = ((got.double() - expected).abs().max() / expected.abs().max()).item()
            assert error < 1e-5, (out_features, in_features, rows, error)
            alone = torch.cat([op(row.contiguous(), packed) for row in x.split(1)])
            assert torch.equal(alone, got), (out_features, in_features, rows)
    q, d, m = worst_case(64)
    got = op(torch.ones(3, 64), pack_int4_rows(q, d, m))
    # 64 inputs of level 127 x nibble 15 x d 0.5 x scale 1/127: 64 * 15 * 0.5 = 480 up to the
    # scale's rounding; a saturated int16 (8 groups x 2 x 15 x 127 = 30,480 fits) would be far off.
    assert torch.allclose(got, torch.full((3, 16), 480.0), rtol=1e-6, atol=0)
