"""SmoothQuant's pieces against float references: the observing linear, and factors that move
activation outliers into the weights so that per-row int8 keeps the other channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.executor.observed_linear import ObservedLinear
from services.executor.quantized import Int8Linear
from services.executor.smoothing import factors


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def outlier_batch(rows: int = 64, channels: int = 128, seed: int = 0) -> torch.Tensor:
    """[rows, channels]: normal activations with three channels 50x larger, as after an LLM's
    RMSNorms."""
    x = torch.randn(rows, channels, generator=torch.Generator().manual_seed(seed))
    x[:, [3, 40, 77]] *= 50
    return x


def test_observed_linear_is_the_dense_layer_and_keeps_each_channels_maximum():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    layer = ObservedLinear(weight, bias)
    first, second = torch.randn(5, 16, generator=gen), torch.randn(3, 16, generator=gen)
    torch.testing.assert_close(layer(first), F.linear(first, weight, bias))
    layer(second)
    expected = torch.cat([first, second]).abs().amax(dim=0)
    assert torch.equal(layer.input_max, expected)


def test_smoothing_leaves_the_float_product_unchanged():
    x = outlier_batch()
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    s = factors(x.abs().amax(dim=0), weight.abs().amax(dim=0), alpha=0.5)
    torch.testing.assert_close(
        F.linear(x / s, weight * s), F.linear(x, weight), rtol=1e-4, atol=1e-4
    )


def test_smoothing_cuts_the_int8_error_of_outlier_channels():
    x = outlier_batch()
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    reference = F.linear(x, weight)
    plain = relative_error(Int8Linear(weight, None)(x), reference)
    s = factors(x.abs().amax(dim=0), weight.abs().amax(dim=0), alpha=0.5)
    smoothed = relative_error(Int8Linear(weight * s, None)(x / s), reference)
    assert smoothed < plain / 2, (smoothed, plain)
    assert smoothed < 0.01


def test_factors_stay_finite_for_channels_calibration_never_saw():
    s = factors(torch.tensor([0.0, 2.0]), torch.tensor([0.5, 0.0]), alpha=0.5)
    assert torch.isfinite(s).all() and (s > 0).all()
