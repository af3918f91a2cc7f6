// 4-bit linear layers for the CPU (GGUF Q4_1's weights, exactly), any number of rows.
//
// A decode step of a small model on a CPU is the time it takes to stream its weights once, so
// the bytes per weight set its speed: Q4_1 is 0.625 bytes (four bits, an fp16 scale d and an
// fp16 minimum m per 32 inputs) against int8's one. torch's int4 CPU kernel has no fast AVX2
// path (4-30x slower than fp32 there), so this one does what llama.cpp's Q4_1 x Q8_1 dot product
// does, with the outputs in the vector lanes instead of the inputs: no horizontal sums, and the
// weights unpacked once per pass serve every row of the call.
//
// Arithmetic. Weights: w = d * n + m for n in 0..15, d and m per (output, block of 32 inputs),
// exactly the GGUF's blocks. Each row x is quantized per block of 32 symmetrically (as Q8_1):
// s = max|x| / 127, a = clamp(rint(x * (127 / max|x|)), -127, 127) (a = 0 where max|x| = 0), and
// the block's plain sum X = sum x. Per output, block by block in order:
//     I = sum_i n_i a_i (exact integers), acc = fma(float(I), d * s, acc), acc = fma(m, X, acc).
// Every row goes through the same operations in the same order whatever the other rows of the
// call, and the integer sums are exact, so a row's result is the same bits alone or beside
// others (a verify step's rows give the bits a one-row decode step gives) on every path.
//
// Weight layout (services/executor/quantized.py `pack_int4_rows`): outputs in pairs of tiles of
// 8, inputs in blocks of 32; per (pair, block) the two tiles' 160 bytes side by side, each 128
// bytes of nibbles, then the 8 outputs' d, then their m (fp16): a thread reads its pairs as one
// sequential stream (two streams, one per tile, left the prefetcher behind). Nibble byte u * 32 + j * 4 + i holds
// input 8u + i (low nibble) and 8u + 4 + i (high nibble) of output j: one 32-byte load unpacks
// into two groups of 4 inputs x 8 outputs, as vpmaddubsw wants them (u8 weights x s8 inputs, a
// pair of products summed into one int16; eight groups stay below 2^15: 8 * 2 * 15 * 127).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define INT4_ROWS_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t OUTS = 8;      // outputs per tile (one ymm of fp32 / int32 lanes)
constexpr int64_t BLOCK = 32;    // inputs per block (one d and one m per output)
constexpr int64_t NIBBLES = 128; // bytes of nibbles per (tile, block)
constexpr int64_t STRIDE = NIBBLES + 2 * OUTS * 2;  // + d and m as fp16: 160 bytes
constexpr int64_t PAIR = 2 * STRIDE;  // a block of two tiles, side by side
constexpr int MAX_ROWS = 4;      // rows sharing one pass over a pair of tiles
// Blocks ahead that a pass asks the cache for (2, 4, 8 and 16 timed: 4 was at least as fast as
// any, by the one-row pass's time against the int8 kernel's in the same run).
constexpr int64_t PREFETCH = 4;

struct BlockRows {
  std::vector<int8_t> a;     // [rows, in] levels -127..127
  std::vector<float> scale;  // [rows, blocks] max|x| / 127
  std::vector<float> sum;    // [rows, blocks] the block's sum of x
};

BlockRows quantize(const float* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / BLOCK;
  BlockRows out{std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks),
                std::vector<float>(rows * blocks)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + b * BLOCK;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        sum += xb[i];
      }
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* ab = out.a.data() + r * in + b * BLOCK;
#pragma omp simd
      for (int64_t i = 0; i < BLOCK; ++i) {
        const float level = std::rint(xb[i] * inverse);
        ab[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, level)));
      }
      out.scale[r * blocks + b] = amax / 127.f;
      out.sum[r * blocks + b] = sum;
    }
  }
  return out;
}

#if defined(INT4_ROWS_AVX2)
// out[r][t * 8 + j] for rows [0, R) and tiles [0, TT) of a pair's stream at w (tile t at
// t * STRIDE in each PAIR-byte block): every block's nibbles unpacked once for all R rows.
template <int R, int TT>
void tiles_pass(const BlockRows& x, int64_t row0, int64_t in, const uint8_t* w, float* out,
                int64_t out_stride) {
  const int64_t blocks = in / BLOCK;
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][TT];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  const int8_t* a = x.a.data() + row0 * in;
  const float* scale = x.scale.data() + row0 * blocks;
  const float* sum = x.sum.data() + row0 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    // The stream's lines PREFETCH blocks ahead (past the pair's end: the next pair's, which
    // this thread reads next): the hardware prefetcher alone left the loads waiting.
    for (int64_t line = 0; line < PAIR; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + (b + PREFETCH) * PAIR + line), _MM_HINT_T0);
    __m256i pairs[R][TT];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) pairs[r][t] = _mm256_setzero_si256();
    // Not unrolled: unrolled, GCC 12 ran every group's products ahead of their sums and
    // spilled them to the stack.
    #pragma GCC unroll 1
    for (int u = 0; u < 4; ++u) {
      __m256i lo[TT], hi[TT];
      #pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const __m256i raw = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + t * STRIDE + b * PAIR + u * 32));
        lo[t] = _mm256_and_si256(raw, low);
        hi[t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      }
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four_lo, four_hi;
        std::memcpy(&four_lo, a + r * in + b * BLOCK + u * 8, 4);
        std::memcpy(&four_hi, a + r * in + b * BLOCK + u * 8 + 4, 4);
        const __m256i a_lo = _mm256_set1_epi32(four_lo), a_hi = _mm256_set1_epi32(four_hi);
        #pragma GCC unroll 8
        for (int t = 0; t < TT; ++t) {
          pairs[r][t] = _mm256_add_epi16(pairs[r][t], _mm256_maddubs_epi16(lo[t], a_lo));
          pairs[r][t] = _mm256_add_epi16(pairs[r][t], _mm256_maddubs_epi16(hi[t], a_hi));
        }
      }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const uint8_t* p = w + t * STRIDE + b * PAIR + NIBBLES;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256 m =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * OUTS)));
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r][t], ones));
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(scale[r * blocks + b]));
        acc[r][t] = _mm256_fmadd_ps(sums, ds, acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[r * blocks + b]), acc[r][t]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) _mm256_storeu_ps(out + r * out_stride + t * OUTS, acc[r][t]);
}
#endif

// The same arithmetic one output at a time, for CPUs without AVX2 (and the same bits).
void pair_pass_plain(const BlockRows& x, int64_t row0, int rows, int64_t in, const uint8_t* w,
                     float* out, int64_t out_stride) {
  const int64_t blocks = in / BLOCK;
  for (int r = 0; r < rows; ++r) {
    const int8_t* a = x.a.data() + (row0 + r) * in;
    for (int t = 0; t < 2; ++t)
      for (int64_t j = 0; j < OUTS; ++j) {
        float acc = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* p = w + t * STRIDE + b * PAIR;
          int32_t sum = 0;
          for (int u = 0; u < 4; ++u)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = p[u * 32 + j * 4 + i];
              sum += (byte & 0x0f) * a[b * BLOCK + u * 8 + i];
              sum += (byte >> 4) * a[b * BLOCK + u * 8 + 4 + i];
            }
          uint16_t dh, mh;
          std::memcpy(&dh, p + NIBBLES + j * 2, 2);
          std::memcpy(&mh, p + NIBBLES + 2 * OUTS + j * 2, 2);
          const float ds = c10::detail::fp16_ieee_to_fp32_value(dh) * x.scale[(row0 + r) * blocks + b];
          acc = std::fma(static_cast<float>(sum), ds, acc);
          acc = std::fma(c10::detail::fp16_ieee_to_fp32_value(mh), x.sum[(row0 + r) * blocks + b], acc);
        }
        out[r * out_stride + t * OUTS + j] = acc;
      }
  }
}

// rows [row0, row0 + rows) x the 16 outputs of the pair of tiles at w.
void pair_pass(const BlockRows& x, int64_t row0, int rows, int64_t in, const uint8_t* w,
               float* out, int64_t out_stride) {
#if defined(INT4_ROWS_AVX2)
  // Both tiles in one pass share the rows' broadcast inputs. With three or four rows their
  // float sums no longer fit the sixteen registers and live on the stack, which was still
  // faster than a pass per tile (one thread, a gate/up layer in cache: 0.73x the int8 kernel's
  // time against 0.81-0.92x).
  switch (rows) {
    case 1: return tiles_pass<1, 2>(x, row0, in, w, out, out_stride);
    case 2: return tiles_pass<2, 2>(x, row0, in, w, out, out_stride);
    case 3: return tiles_pass<3, 2>(x, row0, in, w, out, out_stride);
    default: return tiles_pass<4, 2>(x, row0, in, w, out, out_stride);
  }
#else
  pair_pass_plain(x, row0, rows, in, w, out, out_stride);
#endif
}

}  // namespace

namespace pagedserve {

// x [rows, in] fp32 contiguous, packed [out / 16, in / 32, 320] uint8 -> [rows, out] fp32.
at::Tensor int4_rows_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be [rows, in] contiguous fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == PAIR,
              "packed must be [out / 16, in / 32, 320] uint8");
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t pairs = packed.size(0), out_features = pairs * 2 * OUTS;
  TORCH_CHECK(in == packed.size(1) * BLOCK, "x's width does not match the weights");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;

  const BlockRows qx = quantize(x.data_ptr<float>(), rows, in);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t pair_bytes = packed.size(1) * PAIR;
  // Threads take contiguous runs of pairs: each streams its own part of the weights, a pair's
  // 5.8-15 KB read from memory by its first MAX_ROWS rows and from the cache by the others.
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int r_count = static_cast<int>(std::min<int64_t>(MAX_ROWS, rows - r0));
        pair_pass(qx, r0, r_count, in, w + p * pair_bytes, op + r0 * out_features + p * 2 * OUTS,
                  out_features);
      }
  });
  return out;
}

}  // namespace pagedserve
TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("int4_rows_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("int4_rows_linear", &pagedserve::int4_rows_linear);
}
