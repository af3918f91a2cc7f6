// A decoder layer's small ops for steps of a few rows per sequence, on the CPU.
//
// At decode and verify sizes a CPU step spends more time dispatching the layer's small ops
// (norms, rotary, the KV write, attention's gather and SDPA, the gate) than computing them: a
// few microseconds each, several dozen per layer, thirty layers. These ops do each group of them
// in one call, between the layer's matmuls (which stay in torch). Every query row is computed on
// its own, in a fixed order, from its own inputs and context only: a row's result never depends
// on the other rows of the step (services/executor/models/decoder.py, kernels/cpu_rows.py).
//
// Built with -ffp-contract=off, so x * c + y * s rounds each product as torch's elementwise ops
// do (rotary, the residual adds); reductions (norms, attention) sum in their own order.
//
// Layouts (kernels/reference.py): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
// head_dim] fp32, head_dim contiguous; a token's slot is block * block_size + offset.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <bit>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int4_rows.h"
#include "int8_rows.h"

namespace {

// a . b: lane sums over the vector's width, then the lanes added pairwise (halves, quarters..).
// The compiler's own reduction (omp simd, strict floating point) summed the lanes one after the
// other, a chain of sixteen dependent adds per dot that made attention's scores its slowest part.
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0 && n > 0) {
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < n; i += 16)
      sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    return _mm512_reduce_add_ps(sum);
  }
#elif defined(__AVX2__)
  if (n % 8 == 0 && n > 0) {
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t i = 8; i < n; i += 8)
      sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
  }
#endif
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// e^x to about one ulp (Cephes' expf: a degree-6 polynomial on x - n ln 2, times 2^n), in
// plain arithmetic so that loops over it vectorize: the C library's expf is a call per element,
// which left the gate of 64 rows and their softmaxes slower than torch's vectorized ones.
// Inputs are clamped to [-87.3, 88.3]: e^-87.3 is still a normal float, e^88.3 still finite.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  // x / ln 2 rounded to the nearest integer (the constant 1.5 * 2^23 pushes the fraction out
  // of the mantissa; std::floor would not vectorize).
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// out[0, head_dim) += sum over positions p < len of weights[p] * v_p, each element summed in
// position order, with v_p at v + table[p / block_size] * block_stride + (p % block_size) *
// slot_stride. Where 64 outputs fit four AVX-512 registers they stay there for the whole walk
// (the same sums in the same order as one axpy per position, without a store and a reload of
// the outputs per position).
void weighted_sum(float* out, const float* weights, int64_t len, const float* v,
                  const int64_t* table, int64_t block_stride, int64_t slot_stride,
                  int64_t block_size, int64_t head_dim) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 64 <= head_dim; c += 64) {
    __m512 a0 = _mm512_loadu_ps(out + c), a1 = _mm512_loadu_ps(out + c + 16);
    __m512 a2 = _mm512_loadu_ps(out + c + 32), a3 = _mm512_loadu_ps(out + c + 48);
    for (int64_t b = 0, p = 0; p < len; ++b) {
      const float* block = v + table[b] * block_stride + c;
      for (int64_t o = 0; o < block_size && p < len; ++o, ++p) {
        const float* vp = block + o * slot_stride;
        const __m512 w = _mm512_set1_ps(weights[p]);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(w, _mm512_loadu_ps(vp)));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(w, _mm512_loadu_ps(vp + 16)));
        a2 = _mm512_add_ps(a2, _mm512_mul_ps(w, _mm512_loadu_ps(vp + 32)));
        a3 = _mm512_add_ps(a3, _mm512_mul_ps(w, _mm512_loadu_ps(vp + 48)));
      }
    }
    _mm512_storeu_ps(out + c, a0);
    _mm512_storeu_ps(out + c + 16, a1);
    _mm512_storeu_ps(out + c + 32, a2);
    _mm512_storeu_ps(out + c + 48, a3);
  }
#endif
  if (c == head_dim) return;
  for (int64_t b = 0, p = 0; p < len; ++b) {
    const float* block = v + table[b] * block_stride;
    for (int64_t o = 0; o < block_size && p < len; ++o, ++p)
      axpy(out + c, weights[p], block + o * slot_stride + c, head_dim - c);
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), name,
              " must be a contiguous fp32 [rows, width] tensor");
}

// y = x * rsqrt(mean(x^2) + eps) * w, as torch's rms_norm rounds it: the product by the inverse
// root first, then by the weight.
void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float rstd = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * rstd) * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [width]");
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.size(1);
  for (int64_t r = 0; r < x.size(0); ++r)
    norm_row(x.data_ptr<float>() + r * n, weight.data_ptr<float>(), y.data_ptr<float>() + r * n,
             n, static_cast<float>(eps));
  return y;
}

// h += delta (in place: the residual stream), then the norm of the new h.
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  check_rows(h, "h");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == h.sizes(), "delta must be shaped as h");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1), "weight must be [width]");
  at::Tensor y = at::empty_like(h);
  const int64_t n = h.size(1);
  float* hp = h.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  for (int64_t i = 0; i < h.numel(); ++i) hp[i] = hp[i] + dp[i];
  for (int64_t r = 0; r < h.size(0); ++r)
    norm_row(hp + r * n, weight.data_ptr<float>(), y.data_ptr<float>() + r * n, n,
             static_cast<float>(eps));
  return y;
}

inline void silu_mul_row(const float* __restrict g, const float* __restrict u,
                         float* __restrict o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = (g[i] / (1.f + exp_approx(-g[i]))) * u[i];
}

// [rows, 2 * width] gate | up -> [rows, width] silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor y = at::empty({rows, width}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g + r * 2 * width;
    const float* ur = gr + width;
    float* o = out + r * width;
    silu_mul_row(gr, ur, o, width);
  }
  return y;
}

// Rotate-half rotary of one head: out[i] = x[i] c[i] - x[i + d/2] s[i] for i < d/2, and
// x[i] c[i] + x[i - d/2] s[i] after, as `x * cos + rotate_half(x) * sin`.
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

// Below this many multiply-adds the rows run on the calling thread: waking the pool costs more.
constexpr int64_t kSerialWork = 1 << 12;

// qkv [rows, (heads + 2 kv_heads) * head_dim] -> [rows, heads * head_dim]: rotary on q and k,
// k and v written to each row's slot, then each row attends to the first positions[r] + 1
// positions of its sequence's table (its own and the earlier rows' K/V of this step included).
at::Tensor rows_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                          const at::Tensor& tables, const at::Tensor& token_seqs,
                          const at::Tensor& positions, double scale, int64_t heads,
                          int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                  k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "caches must be fp32 [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.stride(2) == k_cache.size(3) && v_cache.stride(2) == v_cache.size(3),
              "each slot's heads must be contiguous");
  for (const at::Tensor* t : {&slots, &token_seqs, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() &&
                    t->size(0) == qkv.size(0),
                "slots, token_seqs and positions must be [rows] int64");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.stride(1) == 1,
              "tables must be [num_seqs, max_blocks] int64");
  const int64_t rows = qkv.size(0), head_dim = k_cache.size(3);
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(kv_heads == k_cache.size(2) && heads % kv_heads == 0, "head counts disagree");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv width disagrees");
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "cos and sin must be [rows, head_dim]");
  const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
  const int64_t width = qkv.size(1);
  const float* x = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* seq = token_seqs.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t tab_stride = tables.stride(0);
  const int64_t k0 = k_cache.stride(0), k1 = k_cache.stride(1);
  const int64_t v0 = v_cache.stride(0), v1 = v_cache.stride(1);

  // Rotary, and this step's K/V into the cache, before any row reads its context.
  at::Tensor q = at::empty({rows, heads * head_dim}, qkv.options());
  float* qp = q.data_ptr<float>();
  int64_t work = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < num_blocks * block_size, "slot out of the pool");
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_blocks * block_size, "position beyond its table");
    const float* xr = x + r * width;
    const float* c = cp + r * head_dim;
    const float* s = sp + r * head_dim;
    for (int64_t h = 0; h < heads; ++h)
      rotate(xr + h * head_dim, c, s, qp + (r * heads + h) * head_dim, head_dim);
    float* kd = kc + (slot[r] / block_size) * k0 + (slot[r] % block_size) * k1;
    float* vd = vc + (slot[r] / block_size) * v0 + (slot[r] % block_size) * v1;
    for (int64_t h = 0; h < kv_heads; ++h)
      rotate(xr + (heads + h) * head_dim, c, s, kd + h * head_dim, head_dim);
    std::copy(xr + (heads + kv_heads) * head_dim, xr + width, vd);
    work += (pos[r] + 1) * heads * head_dim;
  }

  at::Tensor out = at::zeros({rows, heads * head_dim}, qkv.options());
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // Consecutive rows of one sequence (a verify step's, a short chunk's) form a group whose
  // scores read each position's K once for every row that sees it. A row's arithmetic is the
  // same in any group (its scores, softmax and sums run over its own positions in order), so
  // its result is the same bits alone or beside others.
  std::vector<int64_t> starts{0};
  for (int64_t r = 1; r < rows; ++r)
    if (seq[r] != seq[r - 1]) starts.push_back(r);
  starts.push_back(rows);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  // Work items: (group, query head), so that one sequence's step (a decode, a verify step)
  // spreads over the threads too; a KV head's rows are re-read per query head of its group
  // (and V per row), from the cache after the first read.
  auto attend = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t gi = item / heads, h = item % heads, kv = h / group;
      const int64_t r0 = starts[gi], r1 = starts[gi + 1];
      const int64_t* table = tab + seq[r0] * tab_stride;
      int64_t n = 0;  // the group's longest context
      for (int64_t r = r0; r < r1; ++r) n = std::max(n, pos[r] + 1);
      scores.resize((r1 - r0) * n);
      // Row r: scores[(r - r0) * n + p], positions in order; blocks, then their slots (no
      // division per position).
      for (int64_t b = 0, p = 0; p < n; ++b) {
        const float* block = kc + table[b] * k0 + kv * head_dim;
        for (int64_t o = 0; o < block_size && p < n; ++o, ++p) {
          const float* kp = block + o * k1;
          for (int64_t r = r0; r < r1; ++r) {
            if (p > pos[r]) continue;
            const float* qh = qp + (r * heads + h) * head_dim;
            scores[(r - r0) * n + p] = dot(qh, kp, head_dim) * fscale;
          }
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t len = pos[r] + 1;
        float* sc = scores.data() + (r - r0) * n;
        const float top = *std::max_element(sc, sc + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; ++p) {
          sc[p] = exp_approx(sc[p] - top);
          sum += sc[p];
        }
        float* oh = op + (r * heads + h) * head_dim;
        weighted_sum(oh, sc, len, vc + kv * head_dim, table, v0, v1, block_size, head_dim);
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < head_dim; ++i) oh[i] *= inv;
      }
    }
  };
  if (work < kSerialWork) {
    attend(0, groups * heads);
  } else {
    at::parallel_for(0, groups * heads, 1, attend);
  }
  return out;
}

// Linear k of the stack: the 4-bit kernel where its packed weights are uint8 (their column
// sums and scales then unused, empty), else the int8 one.
at::Tensor linear_rows(const at::Tensor& x, const at::TensorList& packed,
                       const at::TensorList& colsums, const at::TensorList& scales,
                       const c10::List<std::optional<at::Tensor>>& biases, int64_t k) {
  at::Tensor y = packed[k].scalar_type() == at::kByte
                     ? pagedserve::int4_rows_linear(x, packed[k])
                     : pagedserve::int8_rows_linear(x, packed[k], colsums[k], scales[k]);
  const std::optional<at::Tensor> bias = biases.get(k);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// A step's whole stack of layers, as services/executor/models/decoder.py `_forward_rows` runs
// it, where every linear is one of the row kernels' (int8 or 4-bit): the same calls in the same
// order, so the same bits, without a few dozen microseconds of Python and dispatch per layer. Per layer k:
// norms[2k], norms[2k + 1] (input, post-attention) with eps[2k], eps[2k + 1]; the linears
// 4k .. 4k + 3 (qkv, o, gate_up, down) as packed / colsums / scales / biases. h [rows, hidden]
// is the residual stream, updated in place and returned (before the final norm).
at::Tensor rows_forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor kv_cache, const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& token_seqs, const at::Tensor& positions, double scale,
                        int64_t heads, int64_t kv_heads, at::TensorList norms,
                        at::ArrayRef<double> eps, at::TensorList packed, at::TensorList colsums,
                        at::TensorList scales,
                        const c10::List<std::optional<at::Tensor>>& biases) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(eps.size()) == 2 * layers,
              "two norms (and eps) per layer");
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == 4 * layers &&
                  colsums.size() == packed.size() && scales.size() == packed.size() &&
                  biases.size() == packed.size(),
              "four linears per layer");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == layers && kv_cache.size(1) == 2,
              "kv_cache must be [layers, 2, num_blocks, block_size, kv_heads, head_dim]");
  at::Tensor x = rms_norm(h, norms[0], eps[0]);
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor qkv = linear_rows(x, packed, colsums, scales, biases, 4 * i);
    at::Tensor cache = kv_cache.select(0, i);
    at::Tensor o = rows_attention(qkv, cos, sin, cache.select(0, 0), cache.select(0, 1), slots,
                                  tables, token_seqs, positions, scale, heads, kv_heads);
    x = add_rms_norm(h, linear_rows(o, packed, colsums, scales, biases, 4 * i + 1),
                     norms[2 * i + 1], eps[2 * i + 1]);
    at::Tensor gated = silu_mul(linear_rows(x, packed, colsums, scales, biases, 4 * i + 2));
    at::Tensor mlp = linear_rows(gated, packed, colsums, scales, biases, 4 * i + 3);
    if (i == layers - 1) {
      h.add_(mlp);
    } else {
      x = add_rms_norm(h, mlp, norms[2 * i + 2], eps[2 * i + 2]);
    }
  }
  return h;
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rows_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slots, Tensor tables, Tensor token_seqs, Tensor positions, "
      "float scale, int heads, int kv_heads) -> Tensor");
  m.def(
      "rows_forward(Tensor(a!) h, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slots, "
      "Tensor tables, Tensor token_seqs, Tensor positions, float scale, int heads, "
      "int kv_heads, Tensor[] norms, float[] eps, Tensor[] packed, Tensor[] colsums, "
      "Tensor[] scales, Tensor?[] biases) -> Tensor(a)");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rows_attention", &rows_attention);
  m.impl("rows_forward", &rows_forward);
}
