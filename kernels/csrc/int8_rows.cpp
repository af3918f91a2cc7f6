// int8 linear layers for calls of a few rows (decode and verify steps), on the CPU.
//
// A decode step of a small model on a CPU is the time it takes to stream its int8 weights once.
// fbgemm's dynamic linear streams them well for one row, but a call of several rows (a verify
// step's K + 1) costs a third more for four rows and twice as much for sixteen, and it takes one
// activation range for the whole call, so a row's result depends on the rows beside it. Here
// each weight tile is read from memory once per call and used for every row while it is in the
// cache, and each row is quantized on its own range: a row's result is the same bits alone or
// beside others (services/executor/quantized.py, `Int8Linear`).
//
// Arithmetic, exact up to the last two roundings: each row x is quantized asymmetrically on 256
// levels as fbgemm's dynamic linear quantizes its one row (torch's ChooseQuantizationParams and
// fbgemm's Quantize, followed to the bit: a one-row call gives fbgemm's result): the range
// [min(x, 0), max(x, 0)], its scale s = (max - min) / 255 in double then float, the zero point z
// from whichever end loses less, q = clamp(rint(fma(x, 1 / s, z)), 0, 255); the int8 weights
// w (levels -127..127, one scale per output) give acc = sum_k (q_k - z) w_k exactly in int32
// (|acc| < 2^31 for in_features < 66,000); out = float(acc) * (s * w_scale).
//
// Weight layout ("packed", made by services/executor/quantized.py `pack_int8_rows`): the output
// channels in blocks of 64, each four tiles of 16, the input in groups of 4:
// [out / 64, in / 4, 4, 16, 4] int8, both padded with zero weights. A tile's 16 x 4 bytes are one
// 64-byte line: the VNNI instruction multiplies it by a row's 4 broadcast activations into the
// tile's 16 int32 sums. A block's four tiles of one input group lie side by side, so a thread
// reads its blocks as one sequential stream: with four tiles in four separate streams the
// hardware prefetcher fell behind as soon as each line fed several rows (four rows cost 1.5x
// one; in one stream about the same as one).
//
// Paths: AVX-512 VNNI (u8 x s8 products summed in int32 by the instruction), AVX2 (the
// activations shifted to s8 so that |q - 128| <= 128 and a pair of products fits int16 without
// saturation: 2 * 128 * 127 < 2^15), and plain C++ elsewhere. All three compute the same
// integers, so the same float results.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int8_rows.h"

namespace {

constexpr int64_t TILE = 16;  // output channels per tile
constexpr int64_t GROUP = 4;  // input values per int32 lane
constexpr int MAX_ROWS = 4;   // rows sharing one pass over a block (accumulators in registers)
constexpr int TILES = 4;      // tiles per block
constexpr int64_t BLOCK = TILES * TILE;  // output channels per block

struct QuantizedRows {
  std::vector<uint8_t> q;       // [rows, in_padded]
  std::vector<int32_t> zero;    // [rows]
  std::vector<float> scale;     // [rows]
};

QuantizedRows quantize(const float* x, int64_t rows, int64_t in, int64_t in_padded) {
  QuantizedRows out{std::vector<uint8_t>(rows * in_padded, 0), std::vector<int32_t>(rows),
                    std::vector<float>(rows)};
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float lo = 0.f, hi = 0.f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
    for (int64_t i = 0; i < in; ++i) {
      lo = std::min(lo, xr[i]);
      hi = std::max(hi, xr[i]);
    }
    double scale = (static_cast<double>(hi) - lo) / 255.0;
    // An all-zero row (or one whose scale under- or overflows a float): torch's 0.1.
    if (static_cast<float>(scale) == 0.f || std::isinf(1.f / static_cast<float>(scale)))
      scale = 0.1;
    const double from_min = -lo / scale, from_max = 255.0 - hi / scale;
    const double min_error = -std::fabs(lo / scale), max_error = 255.0 - std::fabs(hi / scale);
    const double zero = min_error < max_error ? from_min : from_max;
    const float z = static_cast<float>(std::min(255.0, std::max(0.0, std::nearbyint(zero))));
    const float s = static_cast<float>(scale);
    out.scale[r] = s;
    out.zero[r] = static_cast<int32_t>(z);
    const float inverse = 1.f / s;
    uint8_t* qr = out.q.data() + r * in_padded;
    // One rounding of x / s + z (fbgemm's fused multiply-add), then to the nearest level, ties
    // to even; rint is one vector instruction where nearbyint would be a library call.
#pragma omp simd
    for (int64_t i = 0; i < in; ++i) {
      const float level = std::rint(std::fma(xr[i], inverse, z));
      qr[i] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, level)));
    }
  }
  return out;
}

#if defined(__AVX512VNNI__)
// One row's step over one input group of a block: its four tiles' sums take the row's 4 bytes.
__attribute__((always_inline)) inline void row_group(const uint8_t* qr, const __m512i (&tiles)[4],
                                                     __m512i& s0, __m512i& s1, __m512i& s2,
                                                     __m512i& s3) {
  int32_t four;
  std::memcpy(&four, qr, 4);
  const __m512i a = _mm512_set1_epi32(four);
  s0 = _mm512_dpbusd_epi32(s0, a, tiles[0]);
  s1 = _mm512_dpbusd_epi32(s1, a, tiles[1]);
  s2 = _mm512_dpbusd_epi32(s2, a, tiles[2]);
  s3 = _mm512_dpbusd_epi32(s3, a, tiles[3]);
}
#endif

// acc[r][t * 16 + j] = sum over the input of (q - bias) * w for rows [0, R) of one block of
// weights (w: [in_padded / 4, 4, 16, 4]); `q` rows hold in_padded bytes. bias is 0 on VNNI, 128
// on AVX2, and the caller adds (bias - z) * colsum. Reads the block's weights once.
template <int R>
void block_pass(const uint8_t* q, int64_t in_padded, const int8_t* w, int32_t* acc /* [R, 64] */) {
  constexpr int T = TILES;
  const int64_t groups = in_padded / GROUP;
#if defined(__AVX512VNNI__)
  // Sixteen named accumulators, not an array: GCC 12 at -O3 kept an array's sums on the stack
  // or copied each of them twice per input group, which halved the speed of a four-row block.
  const __m512i zero = _mm512_setzero_si512();
  __m512i s00 = zero, s01 = zero, s02 = zero, s03 = zero, s10 = zero, s11 = zero, s12 = zero,
          s13 = zero, s20 = zero, s21 = zero, s22 = zero, s23 = zero, s30 = zero, s31 = zero,
          s32 = zero, s33 = zero;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* wg = w + g * T * TILE * GROUP;
    const __m512i tiles[4] = {_mm512_loadu_si512(wg), _mm512_loadu_si512(wg + 64),
                              _mm512_loadu_si512(wg + 128), _mm512_loadu_si512(wg + 192)};
    const uint8_t* qg = q + g * GROUP;
    row_group(qg, tiles, s00, s01, s02, s03);
    if constexpr (R > 1) row_group(qg + in_padded, tiles, s10, s11, s12, s13);
    if constexpr (R > 2) row_group(qg + 2 * in_padded, tiles, s20, s21, s22, s23);
    if constexpr (R > 3) row_group(qg + 3 * in_padded, tiles, s30, s31, s32, s33);
  }
  const __m512i sums[MAX_ROWS * T] = {s00, s01, s02, s03, s10, s11, s12, s13,
                                      s20, s21, s22, s23, s30, s31, s32, s33};
  for (int i = 0; i < R * T; ++i) _mm512_storeu_si512(acc + i * TILE, sums[i]);
#elif defined(__AVX2__)
  // AVX2 has sixteen ymm registers. One row: its eight sums (two halves of each of the four
  // tiles) stay in registers, the weights are operands read as they stream (faster for a
  // decode row than the path below, which keeps the four tiles in registers too and spills;
  // docs/benchmarks.md, "Prompt chunks on CPUs without VNNI"). Several rows: the path below,
  // whose tiles, loaded once per group, serve every row (one row per pass over an
  // L2-resident block was slower for 2 to 8 rows).
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i shift = _mm256_set1_epi8(static_cast<char>(0x80));
  if constexpr (R == 1) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i s0 = zero, s1 = zero, s2 = zero, s3 = zero, s4 = zero, s5 = zero, s6 = zero,
            s7 = zero;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t four;
      std::memcpy(&four, q + g * GROUP, 4);
      // q - 128 as s8; its magnitude as u8 and its sign moved onto the weights.
      const __m256i a = _mm256_xor_si256(_mm256_set1_epi32(four), shift);
      const __m256i magnitude = _mm256_sign_epi8(a, a);
      const int8_t* wg = w + g * T * TILE * GROUP;  // half k of the group: tile k / 2, half k % 2
      auto step = [&](__m256i& sum, int k) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + k * 32));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(half, a));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
      };
      step(s0, 0), step(s1, 1), step(s2, 2), step(s3, 3);
      step(s4, 4), step(s5, 5), step(s6, 6), step(s7, 7);
    }
    // Half k's eight sums are outputs t * 16 + h * 8 .. + 7 = k * 8 .. + 7 of the block.
    const __m256i sums[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int k = 0; k < 8; ++k)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + k * 8), sums[k]);
  } else {
    // Two ymm halves per tile (8 outputs x 4 inputs each).
    __m256i sums[R][T][2];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) sums[r][t][0] = sums[r][t][1] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i tiles[T][2];
      for (int t = 0; t < T; ++t) {
        const int8_t* p = w + (g * T + t) * TILE * GROUP;
        tiles[t][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        tiles[t][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, q + r * in_padded + g * GROUP, 4);
        // q - 128 as s8; its magnitude as u8 and its sign moved onto the weights.
        const __m256i a = _mm256_xor_si256(_mm256_set1_epi32(four), shift);
        const __m256i magnitude = _mm256_sign_epi8(a, a);
        for (int t = 0; t < T; ++t)
          for (int h = 0; h < 2; ++h) {
            const __m256i signed_w = _mm256_sign_epi8(tiles[t][h], a);
            const __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_w);
            sums[r][t][h] = _mm256_add_epi32(sums[r][t][h], _mm256_madd_epi16(pairs, ones));
          }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * T * TILE + t * TILE + h * 8),
                              sums[r][t][h]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      for (int64_t j = 0; j < TILE; ++j) {
        int32_t sum = 0;
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t i = 0; i < GROUP; ++i)
            sum += static_cast<int32_t>(q[r * in_padded + g * GROUP + i]) *
                   w[(g * T + t) * TILE * GROUP + j * GROUP + i];
        acc[r * T * TILE + t * TILE + j] = sum;
      }
#endif
}

#if defined(__AVX512VNNI__) || !defined(__AVX2__)
constexpr int32_t BIAS = 0;
#else
constexpr int32_t BIAS = 128;
#endif

// The rows' sums over a block for 1 to MAX_ROWS rows: each count has its own pass.
void block_sums(int rows, const uint8_t* q, int64_t in_padded, const int8_t* w, int32_t* acc) {
  switch (rows) {
    case 1: return block_pass<1>(q, in_padded, w, acc);
    case 2: return block_pass<2>(q, in_padded, w, acc);
    case 3: return block_pass<3>(q, in_padded, w, acc);
    default: return block_pass<4>(q, in_padded, w, acc);
  }
}

}  // namespace

namespace pagedserve {

at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& colsum, const at::Tensor& weight_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be [rows, in] contiguous fp32");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == TILES && packed.size(3) == TILE && packed.size(4) == GROUP,
              "packed must be [out / 64, in / 4, 4, 16, 4] int8");
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t blocks = packed.size(0), in_padded = packed.size(1) * GROUP;
  const int64_t out_features = weight_scales.numel();
  TORCH_CHECK(in <= in_padded && in_padded < in + GROUP, "x's width does not match the weights");
  TORCH_CHECK(out_features <= blocks * BLOCK && out_features > (blocks - 1) * BLOCK,
              "weight_scales does not match the weights");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.numel() == blocks * BLOCK &&
                  colsum.is_contiguous(),
              "colsum must be [out padded to 64] int32");
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous(),
              "weight_scales must be fp32");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;

  const QuantizedRows qx = quantize(x.data_ptr<float>(), rows, in, in_padded);
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* ws = weight_scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t block_bytes = in_padded * BLOCK;

  // Threads take contiguous runs of blocks: each streams its own part of the weights.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int32_t acc[MAX_ROWS * BLOCK];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * BLOCK;
      const int64_t n = std::min(BLOCK, out_features - first);  // the block's real outputs
      for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int r_count = static_cast<int>(std::min<int64_t>(MAX_ROWS, rows - r0));
        block_sums(r_count, qx.q.data() + r0 * in_padded, in_padded, w + b * block_bytes, acc);
        for (int r = 0; r < r_count; ++r) {
          const int32_t shift = BIAS - qx.zero[r0 + r];
          const float s = qx.scale[r0 + r];
          const int32_t* ar = acc + r * BLOCK;
          const int32_t* csb = cs + first;
          const float* wsb = ws + first;
          float* orow = op + (r0 + r) * out_features + first;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j)
            orow[j] = static_cast<float>(ar[j] + shift * csb[j]) * (s * wsb[j]);
        }
      }
    }
  });
  return out;
}

}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("int8_rows_linear(Tensor x, Tensor packed, Tensor colsum, Tensor weight_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("int8_rows_linear", &pagedserve::int8_rows_linear);
}
