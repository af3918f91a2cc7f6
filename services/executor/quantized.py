"""Quantized CPU layers: int8 and int4 linear layers and an int8 embedding.

On torch's own CPU kernels, and on the CPU row kernels where they are built:
- `Int8Linear`: int8 weights per output channel, activations quantized per call with one scale
  per row, multiplied in int8 with int32 sums (`torch._int_mm`). On this AVX2 CPU it is 4-5x
  faster than the fp32 GEMM from 17 rows to 2,048 (benchmarks/quantized_linear.py).
- `Int4Linear`: 4-bit weights in groups of 32 along the input, GGUF Q4_1 blocks (w = d*q + m)
  exactly, run by the CPU row kernels' 4-bit linear (kernels/csrc/int4_rows.cpp) where they are
  built, else by torch's `_weight_int4pack_mm_for_cpu`, which has no fast path on AVX2 (40-160x
  slower per layer there). Not the default: the row kernel's 8-bit activation levels cost
  perplexity (docs/benchmarks.md, "4-bit weights on the CPU").
- `Int8Embedding`: rows of int8 with one scale per 32 values (GGUF Q8_0's layout, exactly);
  a lookup gathers and scales only the rows asked for.

A call of few rows (a decode step of a few sequences, a verify step's K + 1 rows) goes through
fbgemm's dynamic int8 linear instead, where it sums exactly (`exact_decode_kernel`): on the same
int8 weights it streams them about twice as fast as `_int_mm` with its activation quantization
(benchmarks/decode_weight_streaming.py). It takes one activation range per call, so:
- one row is its own range: asymmetric, 256 levels between the row's minimum and maximum, which
  lose less than the symmetric 255: +0.30% perplexity against fp32 where the int8 path has
  +0.71% (benchmarks/perplexity.py, `int8+fbgemm-rows`);
- several rows are each divided by their own max |x| and a guard row holding -128/127 and 1 is
  added, so the call's range is always the same: scale 1/127, zero point 128, every row on its
  own levels round(127 x / max |x|), the int8 path's, whatever the other rows, and scaled back
  after (`fbgemm_rows`).
Beyond FBGEMM_MAX_ROWS rows `_int_mm` is faster (docs/benchmarks.md, "Verify rows through
fbgemm too").

Where the CPU row kernels are built (kernels/cpu_rows.py), calls of up to INT8_ROWS_MAX_ROWS rows
take their own int8 linear instead (kernels/csrc/int8_rows.cpp): every row of the call on its
own asymmetric 256 levels, exactly as fbgemm quantizes a one-row call (the same bits), so a
verify step's rows give the bits a one-row decode step gives; and each weight tile read once for
all the rows.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings

import torch
from torch import nn

from services.executor.observed_linear import ObservedLinear

GROUP_SIZE = 32  # GGUF's block length for Q4_1 and Q8_0; one of torch's int4 group sizes
# torch's int4 CPU kernel stores w = (q - INT4_MID) * scale + zero for q in [0, 15].
INT4_MID = 8
# Calls of up to this many rows take fbgemm where it sums exactly; larger ones _int_mm, which
# is faster there (benchmarks/decode_weight_streaming.py).
FBGEMM_MAX_ROWS = 32
# Calls of up to this many rows take the row kernels' int8 linear where it is loaded: faster
# than fbgemm's up to FBGEMM_MAX_ROWS, where _int_mm takes over anyway (benchmarks/
# int8_rows_linear.py).
INT8_ROWS_MAX_ROWS = FBGEMM_MAX_ROWS


@functools.cache
def int_mm_has_fast_path() -> bool:
    """Whether torch._int_mm is a vectorised GEMM on this CPU. torch 2.13 runs it through
    oneDNN only where the CPU has AVX-512 VNNI (`torch.cpu._is_vnni_supported`); elsewhere it
    is a plain loop: 1.3 GMAC/s for [64, 576] x [576, 1536] on an AVX2-only EPYC, about 50x
    slower than fp32's GEMM there, where a 128-token prompt chunk of the embedded model then
    took 9.5 s (docs/benchmarks.md, "Prompt chunks on CPUs without VNNI")."""
    return bool(torch.cpu._is_vnni_supported())


@functools.cache
def exact_decode_kernel() -> bool:
    """Whether fbgemm's dynamic int8 linear sums exactly here, checked once on a worst case.

    With VNNI it accumulates u8 x s8 products in int32. On AVX2 alone it adds pairs of them in
    int16 first, which saturates unless the activations are cut to 7 bits (+1.56% perplexity
    against fp32, `int8+fbgemm-rows-reduced`): there the decode rows stay on _int_mm."""
    weight = torch.full((8, 256), 127.0)  # every product at its largest: 255 x 127 per pair
    packed = pack_for_fbgemm(weight, torch.ones(8), None)
    exact = torch.full((1, 8), 256 * 127.0)
    # Exact sums give 256 * 127 up to the float scale's rounding; saturated ones about half.
    one_row = torch.ops.quantized.linear_dynamic(torch.ones(1, 256), packed, False)
    rows = fbgemm_rows(torch.ones(3, 256), packed)
    return bool(
        torch.allclose(one_row, exact, rtol=1e-4, atol=0)
        and torch.allclose(rows, exact.expand(3, -1), rtol=1e-4, atol=0)
    )


# fbgemm's dynamic linear without OpOverloadPacket.__call__'s per-call scan of its arguments for
# torch.compile's fake script objects (a few microseconds each, 121 calls a step, never
# compiled here): the packet's own dispatcher entry, the same op.
linear_dynamic = getattr(
    torch.ops.quantized.linear_dynamic, "_op", torch.ops.quantized.linear_dynamic
)

# Per (rows, in_features): [rows + 1, in] fp32, the last row the guard (-128/127, 1, 0, ...):
# fbgemm's range [-128/127, 1] gives scale 1/127 and zero point 128, so a row divided by its
# max |x| takes the levels 1 .. 255, the int8 path's -127 .. 127 shifted. Bounded: rows <=
# FBGEMM_MAX_ROWS, and a model has a few distinct input widths. Per thread: a buffer is written
# in place for each call.
_GUARDED = threading.local()


def fbgemm_rows(
    x: torch.Tensor,  # [rows, in] fp32
    packed,  # pack_for_fbgemm's weights, without bias
) -> torch.Tensor:  # [rows, out] fp32
    """fbgemm's dynamic int8 linear with every row quantized on its own levels: each divided by
    its max |x|, plus the guard row, so the call's one range is the same whatever the rows (a
    row's result does not depend on the others), then scaled back."""
    rows, width = x.shape
    buffers = _GUARDED.__dict__.setdefault("by_shape", {})
    buffer = buffers.get((rows, width))
    if buffer is None:
        # A normal tensor even when first made in inference mode (the executor's): an inference
        # tensor could not be written to outside it (a benchmark's or a test's calls).
        with torch.inference_mode(False):
            buffer = torch.zeros(rows + 1, width)
            buffer[rows, :2] = torch.tensor([-128 / 127, 1.0])
        buffers[(rows, width)] = buffer
    row_max = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)  # [rows, 1]
    torch.div(x, row_max, out=buffer[:rows])
    out = linear_dynamic(buffer, packed, False)  # [rows + 1, out]
    return out[:rows].mul_(row_max)


def quantize_rows(
    x: torch.Tensor,  # [rows, in] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 levels [rows, in], one scale per row [rows, 1]
    """The int8 path's activation levels: symmetric, round(127 x / max |x|) per row."""
    # abs().amax() rather than an inf-norm: 5x faster on this CPU (its reduction kernel).
    scales = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
    return (x / scales).round_().to(torch.int8), scales


def pack_int8_rows(
    qweight: torch.Tensor,  # [out, in] int8 levels
) -> tuple[torch.Tensor, torch.Tensor]:  # [out/64, in/4, 4, 16, 4] int8, [out/64*64] int32
    """The row kernels' layout (kernels/csrc/int8_rows.cpp): outputs in blocks of four tiles of
    16, inputs in groups of 4, each group's four tiles side by side, padded with zero weights;
    and each padded output's sum of levels (its correction for the activations' zero point)."""
    out_features, in_features = qweight.shape
    out_padded, in_padded = -(-out_features // 64) * 64, -(-in_features // 4) * 4
    padded = torch.zeros(out_padded, in_padded, dtype=torch.int8)
    padded[:out_features, :in_features] = qweight
    blocks = padded.view(out_padded // 64, 4, 16, in_padded // 4, 4).permute(0, 3, 1, 2, 4)
    return blocks.contiguous(), padded.sum(dim=1, dtype=torch.int32)


def pack_for_fbgemm(
    qweight: torch.Tensor,  # [out, in] int8 levels (any dtype holding them)
    scales: torch.Tensor,  # [out] per output channel
    bias: torch.Tensor | None,  # [out]
):  # fbgemm's packed per-channel weights: the same int8 levels and scales
    zeros = torch.zeros(qweight.shape[0], dtype=torch.long)
    levels = qweight.float() * scales[:, None]
    with warnings.catch_warnings():
        # torch 2.13 marks quantized tensors deprecated (torchao is their successor); fbgemm's
        # prepack still takes only them, and torch is pinned (pyproject.toml).
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(levels, scales.double(), zeros, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, bias)


class Int8Linear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,  # [out_features, in_features] float
        bias: torch.Tensor | None,  # [out_features]
        decode_kernel: bool = True,  # calls of few rows through fbgemm where it sums exactly
    ) -> None:
        super().__init__()
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out_features]
        qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        # Stored [in, out] as _int_mm's right operand wants it (contiguous: no copy per call).
        self.register_buffer("qweight_t", qweight.t().contiguous())  # [in, out] int8
        self.register_buffer("scales", scales)  # [out]
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # A second copy of the int8 weights in fbgemm's layout (not a buffer: a packed object),
        # without the bias, which forward() adds once fbgemm_rows has scaled its rows back.
        self.few_rows = None
        self.row_ops = None  # the CPU row kernels' ops, set by use_row_ops
        # Their largest call: without a fast _int_mm they take calls of every size (streaming
        # the weights once per four rows still beats fp32's GEMM there; docs/benchmarks.md).
        self.rows_max = INT8_ROWS_MAX_ROWS if int_mm_has_fast_path() else sys.maxsize
        # The row kernels' copy of the weights (pack_int8_rows), made by use_row_ops.
        self.rows_packed: torch.Tensor | None = None
        self.rows_colsum: torch.Tensor | None = None
        self.decode_kernel = decode_kernel
        if decode_kernel and exact_decode_kernel():
            self.few_rows = pack_for_fbgemm(qweight, scales, None)

    def use_row_ops(self, row_ops) -> None:
        """The CPU row kernels' ops (kernels/cpu_rows.py) for this layer's calls of few rows:
        their int8 linear where the layer takes a decode kernel at all (not with
        `--int8-decode-kernel int_mm`). Their copy of the weights replaces fbgemm's, which no
        call would take any more (None: fbgemm's back)."""
        self.row_ops = row_ops
        if row_ops is not None and self.decode_kernel:
            if self.rows_packed is None:
                self.rows_packed, self.rows_colsum = pack_int8_rows(self.qweight_t.t())
            self.few_rows = None
        else:
            self.rows_packed = self.rows_colsum = None
            if self.few_rows is None and self.decode_kernel and exact_decode_kernel():
                self.few_rows = pack_for_fbgemm(self.qweight_t.t(), self.scales, None)

    @property
    def packed_bytes(self) -> int:
        """The packed copies' int8 weights (fbgemm's per-column offsets left out); 0 without."""
        fbgemm = self.in_features * self.out_features if self.few_rows is not None else 0
        rows = 0 if self.rows_packed is None else self.rows_packed.numel()
        return fbgemm + rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers()) + self.packed_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if x.dtype != torch.float32:  # (a dispatch saved per call where it is already)
            x = x.float()
        if self.rows_packed is not None and 0 < x.shape[0] <= self.rows_max:
            out = self.row_ops.int8_rows_linear(
                x.contiguous(), self.rows_packed, self.rows_colsum, self.scales
            )
            return out if self.bias is None else out.add_(self.bias)
        if self.few_rows is not None and 0 < x.shape[0] <= FBGEMM_MAX_ROWS:
            if x.shape[0] == 1:
                out = linear_dynamic(x, self.few_rows, False)
            else:
                out = fbgemm_rows(x, self.few_rows)
            return out if self.bias is None else out.add_(self.bias)
        # One scale per row, so a token's result does not depend on the rest of the batch (a
        # per-tensor scale, as fbgemm's dynamic linear uses, would let one outlier token coarsen
        # every other row's quantization).
        xq, x_scales = quantize_rows(x)
        acc = torch._int_mm(xq, self.qweight_t)  # [rows, out] int32, exact sums
        out = acc.float().mul_(x_scales).mul_(self.scales)
        return out if self.bias is None else out.add_(self.bias)


class Int4Linear(nn.Module):
    def __init__(
        self,
        qweight: torch.Tensor,  # [out_features, in_features] int32 in [0, 15]
        d: torch.Tensor,  # [out_features, in_features // GROUP_SIZE] fp16-exact block scales
        m: torch.Tensor,  # [out_features, in_features // GROUP_SIZE] fp16-exact block minimums
        bias: torch.Tensor | None,  # [out_features]
    ) -> None:
        """w = d * q + m per block of 32 inputs (GGUF Q4_1's form), held once, in the row
        kernels' layout (0.625 bytes a weight); torch's int4 layout is made from it only where
        a call needs torch's kernel (the row kernels not loaded)."""
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("rows_packed", pack_int4_rows(qweight, d.half(), m.half()))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.row_ops = None
        self._torch_packed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        """Asymmetric min/max quantization per group of 32 inputs (for checkpoints not in GGUF),
        its scales and minimums rounded to fp16 as GGUF stores them."""
        out_features, in_features = weight.shape
        groups = weight.detach().float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low = groups.amin(-1).half().float()
        scales = ((groups.amax(-1) - low) / 15).clamp(min=1e-7).half().float()
        q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
        return cls(q.to(torch.int32).view_as(weight), scales, low, bias)

    def use_row_ops(self, row_ops) -> None:
        """The CPU row kernels' 4-bit linear (kernels/csrc/int4_rows.cpp) for every call of
        any size (40-160x faster than torch's int4 kernel on AVX2, docs/benchmarks.md); None:
        torch's kernel."""
        self.row_ops = row_ops
        if row_ops is not None:
            self._torch_packed = None

    def _torch_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's int4 kernel's weights and scales-and-zeros, made once from the packed copy:
        w = (q - 8) * d + zero, the same q, its zero m + 8d."""
        if self._torch_packed is None:
            q, d, m = unpack_int4_rows(self.rows_packed)
            d, m = d.float(), m.float()
            # innerKTiles=2: the layout torch's CPU int4 kernel expects for fp32 activations.
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
            zeros = torch.stack([d, m + INT4_MID * d], dim=-1).transpose(0, 1).contiguous()
            self._torch_packed = (packed, zeros)
        return self._torch_packed

    @property
    def packed_bytes(self) -> int:
        """torch's copy where a call made it (the row kernels' is a buffer)."""
        if self._torch_packed is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._torch_packed)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers()) + self.packed_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if x.dtype != torch.float32:
            x = x.float()
        if self.row_ops is not None:  # (an empty call too: no torch layout made for it)
            out = self.row_ops.int4_rows_linear(x.contiguous(), self.rows_packed)
        else:
            packed, zeros = self._torch_layout()
            out = torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, GROUP_SIZE, zeros)
        return out if self.bias is None else out + self.bias


# The row kernels' 4-bit layout (kernels/csrc/int4_rows.cpp): tiles of 8 outputs, in pairs.
INT4_ROWS_OUTS = 16


def pack_int4_rows(
    q: torch.Tensor,  # [out, in] integers in [0, 15], out % 16 == 0, in % 32 == 0
    d: torch.Tensor,  # [out, in // 32] fp16 block scales
    m: torch.Tensor,  # [out, in // 32] fp16 block minimums
) -> torch.Tensor:  # [out / 16, in / 32, 320] uint8
    """Per (pair of tiles of 8 outputs, block of 32 inputs), each tile's 160 bytes: 128 bytes of
    nibbles, byte u*32 + j*4 + i holding input 8u + i (low) and 8u + 4 + i (high) of output j,
    then the 8 outputs' d and m as fp16 (int4_rows.cpp says why)."""
    out_features, in_features = q.shape
    pairs, blocks = out_features // INT4_ROWS_OUTS, in_features // GROUP_SIZE
    n = q.to(torch.uint8).view(pairs, 2, 8, blocks, 4, 2, 4)  # [p, t, j, b, u, h, i]
    n = n.permute(0, 3, 1, 4, 5, 2, 6)  # [p, b, t, u, h, j, i]
    nibbles = (n[:, :, :, :, 0] | (n[:, :, :, :, 1] << 4)).reshape(pairs, blocks, 2, 128)

    def halves(v: torch.Tensor) -> torch.Tensor:  # [out, blocks] fp16 -> [p, b, t, 16] bytes
        v = v.half().view(pairs, 2, 8, blocks).permute(0, 3, 1, 2).contiguous()
        return v.view(torch.uint8).view(pairs, blocks, 2, 16)

    tiles = torch.cat([nibbles, halves(d), halves(m)], dim=-1)  # [p, b, 2, 160]
    return tiles.reshape(pairs, blocks, 320).contiguous()


def unpack_int4_rows(
    packed: torch.Tensor,  # [out / 16, in / 32, 320] uint8, pack_int4_rows's
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [out, in] uint8, d, m [out, in / 32]
    """pack_int4_rows undone: the nibbles and the fp16 scales and minimums."""
    pairs, blocks, _ = packed.shape
    tiles = packed.view(pairs, blocks, 2, 160)
    nibbles = tiles[..., :128].reshape(pairs, blocks, 2, 4, 8, 4)  # [p, b, t, u, j, i]
    n = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=4)  # [p, b, t, u, h, j, i]
    q = n.permute(0, 2, 5, 1, 3, 4, 6).reshape(pairs * INT4_ROWS_OUTS, blocks * GROUP_SIZE)

    def halves(part: torch.Tensor) -> torch.Tensor:  # [p, b, t, 16] bytes -> [out, blocks]
        v = part.contiguous().view(torch.float16)  # [p, b, t, 8]
        return v.permute(0, 2, 3, 1).reshape(pairs * INT4_ROWS_OUTS, blocks)

    return q.contiguous(), halves(tiles[..., 128:144]), halves(tiles[..., 144:160])


class Int8Embedding(nn.Module):
    def __init__(
        self,
        qweight: torch.Tensor,  # [num_embeddings, dim] int8
        scales: torch.Tensor,  # [num_embeddings, dim // GROUP_SIZE] float
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.float())

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Embedding:
        """Symmetric int8 per group of 32 values (GGUF Q8_0's scheme), for fp checkpoints."""
        rows, dim = weight.shape
        groups = weight.detach().float().view(rows, dim // GROUP_SIZE, GROUP_SIZE)
        scales = groups.abs().amax(-1).clamp(min=1e-12) / 127  # [rows, dim // 32]
        q = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q.view(rows, dim), scales)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 rows ([num_rows, dim]; all rows when `rows` is None)."""
        q = self.qweight if rows is None else self.qweight[rows]
        s = self.scales if rows is None else self.scales[rows]
        groups = q.float().view(q.shape[0], -1, GROUP_SIZE) * s[..., None]
        return groups.view(q.shape[0], self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [.., dim]
        return self.dequantized(input_ids)


# Modules the model calls as they are (not through its own fp32 matmul); ObservedLinear is the
# fp32 stand-in the int8 calibration pass measures activations with.
QUANTIZED_LINEARS = (Int8Linear, Int4Linear, ObservedLinear)
