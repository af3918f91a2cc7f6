"""An fp32 linear that records the largest |input| per input channel, for int8 calibration."""

from __future__ import annotations

import torch
from torch import nn


class ObservedLinear(nn.Module):
    """Computes exactly what the dense layer it wraps computes, and keeps a running maximum of
    |x| per input channel (the activation statistics SmoothQuant's factors are made from)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()  # weight: [out_features, in_features]
        self.weight, self.bias = weight, bias
        self.input_max = torch.zeros(weight.shape[1])  # [in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        x = x.float()
        torch.maximum(self.input_max, x.abs().amax(dim=0), out=self.input_max)
        return torch.nn.functional.linear(x, self.weight, self.bias)
