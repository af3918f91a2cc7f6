"""The arithmetic kernels/csrc/int8_rows.cpp promises, in torch, for its tests: each row on its
own 256 levels, exact integer sums, then the same two float roundings."""

from __future__ import annotations

import torch

from services.executor.quantized import pack_int8_rows


def int8_rows_reference(
    x: torch.Tensor,  # [rows, in] fp32
    levels: torch.Tensor,  # [out, in] int8
    weight_scales: torch.Tensor,  # [out] fp32
) -> torch.Tensor:  # [rows, out] fp32
    lo = x.amin(dim=1, keepdim=True).clamp(max=0.0).double()
    hi = x.amax(dim=1, keepdim=True).clamp(min=0.0).double()
    scale = (hi - lo) / 255.0
    scale = torch.where(scale.float() > 0, scale, torch.full_like(scale, 0.1))  # all-zero rows
    from_min, from_max = -lo / scale, 255.0 - hi / scale
    use_min = -(lo / scale).abs() < 255.0 - (hi / scale).abs()
    zero = torch.where(use_min, from_min, from_max).round().clamp(0, 255).float()
    s = scale.float()
    inverse = 1.0 / s
    # fma(x, inverse, zero) rounded once to float: exact in double (a 48-bit product plus an
    # integer below 256), then one rounding to float.
    fused = (x.double() * inverse.double() + zero.double()).float()
    q = fused.round().clamp(0, 255)
    sums = (q - zero).long() @ levels.long().t()  # exact
    return sums.float() * (s * weight_scales)


def random_case(rows: int, out_features: int, in_features: int, seed: int):
    """Levels, scales and rows of several magnitudes, one all-zero row and one all-positive."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.randint(-127, 128, (out_features, in_features), generator=gen).to(torch.int8)
    scales = torch.rand(out_features, generator=gen) / 100 + 1e-4
    x = torch.randn(rows, in_features, generator=gen) * torch.rand(rows, 1, generator=gen) * 8
    x[0] = 0.0
    if rows > 1:
        x[1] = x[1].abs() + 0.5
    return x, levels, scales


def check_op(op, shapes=((37, 50), (48, 64), (130, 100)), row_counts=(1, 3, 4, 5, 9)) -> None:
    """op(x, packed, colsum, scales) equals the reference's bits, and each row alone equals
    itself among the others."""
    for out_features, in_features in shapes:
        for rows in row_counts:
            x, levels, scales = random_case(rows, out_features, in_features, rows + out_features)
            packed, colsum = pack_int8_rows(levels)
            got = op(x, packed, colsum, scales)
            expected = int8_rows_reference(x, levels, scales)
            assert torch.equal(got, expected), (out_features, in_features, rows)
            alone = torch.cat(
                [op(x[r : r + 1].clone(), packed, colsum, scales) for r in range(rows)]
            )
            assert torch.equal(alone, got), (out_features, in_features, rows)
