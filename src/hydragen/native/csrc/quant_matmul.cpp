// hydragen::quant_linear: y = x @ W^T for a projection whose weight is one or more parts in GGUF formats
// (quantized parts repacked by quant_pack, float parts in the file's row-major layout), their outputs
// side by side, with the model's neighbours fused in so that a layer is a few calls, not dozens:
//   prologue: RMSNorm of x (norm weight, eps) before it is used;
//   epilogue: rotary embedding of the first rope_cols output columns (rotate-half, the model's tables),
//             SwiGLU (silu(first half) * second half), or accumulation into a residual tensor.
// The instruction set is chosen at run time (best_isa), never above what the CPU has; `isa` lowers it.
// The twin and oracle is hydragen/model/quant_twin.py: the same activation quantization and the same sums in
// torch, on weights dequantized by the gguf package.

#include "aten_vec.h"  // ATen's Vectorized<float> for SwiGLU; before any ATen header

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HQ_X86 1
#else
#define HQ_X86 0
#endif

#include "quant_decode.h"
#include "quant_linear.h"

namespace hq {

// Pointers to up to 4 quantized activation rows (quant_kernels.h): q is the int8 plane (with 15-bit
// activations, the high plane), lo the low plane (null for int8 activations).
struct ActRows {
  const int8_t* q[4];
  const int8_t* lo[4];
  const float* dx[4];
  const float* xs[4];
  const int32_t* qs16[4];
};

// The end of quantizing one group of 32, shared by every instruction-set path so they agree bit for bit: the
// scale, the float sum xs = dx * sum q, and the integer sums of the two halves.
inline void finish_group(float d, int32_t s0, int32_t s1, float* dx, float* xs, int32_t* qs16) {
  *dx = d;
  *xs = d * static_cast<float>(s0 + s1);
  qs16[0] = s0;
  qs16[1] = s1;
}

#if HQ_X86
#define HQ_STR(x) #x
#if defined(__clang__)
#define HQ_BEGIN(t) _Pragma(HQ_STR(clang attribute push(__attribute__((target(t))), apply_to = function)))
#define HQ_END _Pragma("clang attribute pop")
#else
#define HQ_BEGIN(t) _Pragma("GCC push_options") _Pragma(HQ_STR(GCC target(t)))
#define HQ_END _Pragma("GCC pop_options")
#endif

HQ_BEGIN("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")
namespace v512 {
#include "quant_v512.h"
#include "quant_kernels.h"
}  // namespace v512
HQ_END

HQ_BEGIN("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace v256evex {
#define HQ_DOT 1
#include "quant_v256.h"
#undef HQ_DOT
#include "quant_kernels.h"
}  // namespace v256evex
HQ_END

#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12)
#define HQ_AVXVNNI 1
HQ_BEGIN("avxvnni,avx2,fma,f16c")
namespace v256vex {
#define HQ_DOT 2
#include "quant_v256.h"
#undef HQ_DOT
#include "quant_kernels.h"
}  // namespace v256vex
HQ_END
#else
#define HQ_AVXVNNI 0
#endif

HQ_BEGIN("avx2,fma,f16c")
namespace v256 {
#define HQ_DOT 0
#include "quant_v256.h"
#undef HQ_DOT
#include "quant_kernels.h"
}  // namespace v256
HQ_END
#endif  // HQ_X86

// Instruction-set levels, as hydragen/native/quant.py names them.
enum Isa : int { kScalar = 1, kAvx2 = 2, kAvxVnni = 3, kAvx512 = 4 };

int best_isa() {
#if HQ_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512dq"))
    return kAvx512;
#if HQ_AVXVNNI
  if (avx2 && __builtin_cpu_supports("avxvnni")) return kAvxVnni;
#endif
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

// The portable path: the same integer sums per group, one row at a time.
void scalar_packed(int qtype, const uint8_t* tile, int64_t nblocks, const ActRows& a, int mt, float* const* out,
                   bool accumulate) {
  const Format f = format_of(qtype);
  const Head h = head_of(qtype);
  const int tb_bytes = tile_block_bytes(qtype), groups = f.block / 32;
  uint8_t u[32];
  for (int r = 0; r < kTileRows; ++r) {
    for (int m = 0; m < mt; ++m) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nblocks; ++b) {
        const uint8_t* tb = tile + b * tb_bytes;
        const float d = fp16_to_float(load16(tb + 2 * r));
        const float dm = h.dm >= 0 ? fp16_to_float(load16(tb + h.dm + 2 * r)) : 0.0f;
        for (int g = 0; g < groups; ++g) {
          const int64_t gi = b * groups + g;
          read_group_u(qtype, tb, g, r, u);
          int32_t q[32], w[32];
          for (int k = 0; k < 32; ++k) {
            q[k] = a.q[m][32 * gi + k];
            if (a.lo[m] != nullptr) q[k] = 128 * q[k] + a.lo[m][32 * gi + k];
            w[k] = qtype == kQ8_0 ? static_cast<int8_t>(u[k]) : static_cast<int>(u[k]);
          }
          int32_t s0 = 0, s1 = 0;
          for (int k = 0; k < 16; ++k) {
            s0 += w[k] * q[k];
            s1 += w[k + 16] * q[k + 16];
          }
          const int32_t qs0 = a.qs16[m][2 * gi], qs1 = a.qs16[m][2 * gi + 1];
          const float dx = a.dx[m][gi], xs = a.xs[m][gi];
          switch (qtype) {
            case kQ4_0: acc += static_cast<float>(s0 + s1 - 8 * (qs0 + qs1)) * (d * dx); break;
            case kQ5_0: acc += static_cast<float>(s0 + s1 - 16 * (qs0 + qs1)) * (d * dx); break;
            case kQ8_0: acc += static_cast<float>(s0 + s1) * (d * dx); break;
            case kQ4_1:
            case kQ5_1: acc += static_cast<float>(s0 + s1) * (d * dx) + dm * xs; break;
            case kQ4_K:
            case kQ5_K: {
              const float scale = d * static_cast<float>(tb[h.sc + 16 * g + r]);
              const float minimum = dm * static_cast<float>(tb[h.mn + 16 * g + r]);
              acc += static_cast<float>(s0 + s1) * (scale * dx) - minimum * xs;
              break;
            }
            case kQ6_K:
            case kQ3_K: {
              const int off = qtype == kQ6_K ? 32 : 4;
              const int sc0 = static_cast<int8_t>(tb[h.sc + 16 * (2 * g) + r]);
              const int sc1 = static_cast<int8_t>(tb[h.sc + 16 * (2 * g + 1) + r]);
              acc += static_cast<float>((s0 - off * qs0) * sc0 + (s1 - off * qs1) * sc1) * (d * dx);
              break;
            }
            case kQ2_K: {
              const int b0 = tb[h.sc + 16 * (2 * g) + r], b1 = tb[h.sc + 16 * (2 * g + 1) + r];
              const int tot = s0 * (b0 & 15) + s1 * (b1 & 15), mins = qs0 * (b0 >> 4) + qs1 * (b1 >> 4);
              acc += static_cast<float>(tot) * (d * dx) - static_cast<float>(mins) * (dm * dx);
              break;
            }
            default: break;
          }
        }
      }
      out[m][r] = accumulate ? out[m][r] + acc : acc;
    }
  }
}

void scalar_float(int qtype, const uint8_t* w, int64_t stride, int nr, int64_t k, const float* const* x, int mt,
                  float* const* out, bool accumulate) {
  for (int r = 0; r < nr; ++r) {
    const uint8_t* row = w + r * stride;
    for (int m = 0; m < mt; ++m) {
      float s = 0.0f;
      for (int64_t c = 0; c < k; ++c) {
        float wc;
        if (qtype == kF32) std::memcpy(&wc, row + 4 * c, 4);
        else if (qtype == kF16) wc = fp16_to_float(load16(row + 2 * c));
        else wc = bf16_to_float(load16(row + 2 * c));
        s += wc * x[m][c];
      }
      out[m][r] = accumulate ? out[m][r] + s : s;
    }
  }
}

}  // namespace hq

namespace {

using namespace hq;

constexpr int kMaxMt = 4;  // activation rows per kernel call
constexpr int64_t kRowChunk = 64;  // activation rows per task

constexpr float kQMax8 = 127.0f, kQMax15 = 16191.0f;  // 15 bits: hi = floor((q + 64) / 128) stays in int8

// One group of 32 activations, the reference: scale d = max|x| / qmax (NaNs ignored), integers rounded half to
// even (the default rounding mode), split into high and low planes for 15 bits, and their sums per 16.
void quantize_group(const float* v, float qmax, bool fifteen, int8_t* q, int8_t* lo, float* dx, float* xs,
                    int32_t* qs16) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / qmax;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t s0 = 0, s1 = 0;
  for (int i = 0; i < 32; ++i) {
    const int qi = static_cast<int>(std::nearbyint(v[i] * id));
    if (fifteen) {
      const int hi = (qi + 64) >> 7;  // floor: lo = qi - 128 * hi in [-64, 63]
      q[i] = static_cast<int8_t>(hi);
      lo[i] = static_cast<int8_t>(qi - 128 * hi);
    } else {
      q[i] = static_cast<int8_t>(qi);
    }
    (i < 16 ? s0 : s1) += qi;
  }
  finish_group(d, s0, s1, dx, xs, qs16);
}

}  // namespace

// The same group in vector registers, bit for bit: max is exact in any order (a NaN lane keeps the running
// maximum, as std::max(amax, NaN) does), the conversion rounds half to even as nearbyint does, the integer
// sums are exact, and the int8 stores keep each integer's low byte as the scalar casts do.
#if HQ_X86
HQ_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace hq::a512 {
void quantize_group(const float* v, float qmax, bool fifteen, int8_t* q, int8_t* lo, float* dx, float* xs,
                    int32_t* qs16) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 m =
      _mm512_max_ps(_mm512_andnot_ps(sign, b), _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_setzero_ps()));
  const float d = _mm512_reduce_max_ps(m) / qmax;
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
  if (fifteen) {
    const __m512i k64 = _mm512_set1_epi32(64);
    const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, k64), 7);
    const __m512i hb = _mm512_srai_epi32(_mm512_add_epi32(qb, k64), 7);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(ha));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(hb));
    const __m512i la = _mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 7));
    const __m512i lb = _mm512_sub_epi32(qb, _mm512_slli_epi32(hb, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(la));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16), _mm512_cvtepi32_epi8(lb));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  }
  finish_group(d, _mm512_reduce_add_epi32(qa), _mm512_reduce_add_epi32(qb), dx, xs, qs16);
}
}  // namespace hq::a512
HQ_END

HQ_BEGIN("avx2,fma")
namespace hq::a256 {
// The low byte of each of 8 int32 lanes, in order.
inline void store_low_bytes(int8_t* dst, __m256i x) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i y = _mm256_shuffle_epi8(x, pick);
  const int32_t lo = _mm256_extract_epi32(y, 0), hi = _mm256_extract_epi32(y, 4);
  std::memcpy(dst, &lo, 4);
  std::memcpy(dst + 4, &hi, 4);
}

inline int32_t sum8(__m256i x) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

void quantize_group(const float* v, float qmax, bool fifteen, int8_t* q, int8_t* lo, float* dx, float* xs,
                    int32_t* qs16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * j)), m);
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_shuffle_ps(r, r, 1));
  const float d = _mm_cvtss_f32(r) / qmax;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m256i k64 = _mm256_set1_epi32(64);
  int32_t s[2] = {0, 0};
  for (int j = 0; j < 4; ++j) {
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), id));
    if (fifteen) {
      const __m256i hi = _mm256_srai_epi32(_mm256_add_epi32(qi, k64), 7);
      store_low_bytes(q + 8 * j, hi);
      store_low_bytes(lo + 8 * j, _mm256_sub_epi32(qi, _mm256_slli_epi32(hi, 7)));
    } else {
      store_low_bytes(q + 8 * j, qi);
    }
    s[j / 2] += sum8(qi);
  }
  finish_group(d, s[0], s[1], dx, xs, qs16);
}
}  // namespace hq::a256
HQ_END
#endif  // HQ_X86

namespace hq {

void size_acts(int64_t m_rows, int64_t k, int bits, QuantizedActs& qa) {
  const int64_t groups = k / 32;
  qa.q.resize(m_rows * k);
  qa.lo.resize(bits == 15 ? m_rows * k : 0);
  qa.dx.resize(m_rows * groups);
  qa.xs.resize(m_rows * groups);
  qa.qs16.resize(m_rows * groups * 2);
}

void quantize_acts(const float* x, int64_t m0, int64_t m1, int64_t k, int bits, int level, QuantizedActs& qa) {
  const int64_t groups = k / 32;
  const float qmax = bits == 15 ? kQMax15 : kQMax8;
  const bool fifteen = bits == 15;
  auto* group = &quantize_group;
#if HQ_X86
  if (level >= kAvx512) group = &hq::a512::quantize_group;
  else if (level >= kAvx2) group = &hq::a256::quantize_group;
#endif
  for (int64_t i = m0 * groups; i < m1 * groups; ++i) {
    group(x + 32 * i, qmax, fifteen, qa.q.data() + 32 * i, fifteen ? qa.lo.data() + 32 * i : nullptr,
          qa.dx.data() + i, qa.xs.data() + i, qa.qs16.data() + 2 * i);
  }
}

// RMSNorm with the sum of squares in double: the result is then the exactly rounded one whatever the
// summation order, so the twin (quant_twin.kernel_rms_norm) reproduces it bit for bit, and with it every
// rounding of the activation quantization that follows.
void rms_norm_range(const float* x, const float* w, double eps, int64_t m0, int64_t m1, int64_t k, float* out) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* v = x + m * k;
    double ss = 0.0;
    for (int64_t i = 0; i < k; ++i) ss += static_cast<double>(v[i]) * v[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(k) + eps));
    for (int64_t i = 0; i < k; ++i) out[m * k + i] = w[i] * (v[i] * r);
  }
}

// y[:, :cols] rotated per head: the leading d columns of every head of `head` (d when 0) columns,
// x * cos + rotate_half(x) * signed_sin; the rest of a head passes through.
void rope_range(float* y, int64_t ld, int64_t m0, int64_t m1, int64_t cols, const float* cos, const float* sin,
                int64_t d, int64_t head) {
  const int64_t half = d / 2;
  const int64_t step = head > 0 ? head : d;
  float tmp[kMaxRopeDim];
  for (int64_t m = m0; m < m1; ++m) {
    const float* c = cos + m * d;
    const float* s = sin + m * d;
    for (int64_t h0 = 0; h0 < cols; h0 += step) {
      float* x = y + m * ld + h0;
      for (int64_t i = 0; i < d; ++i) tmp[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
      std::memcpy(x, tmp, d * sizeof(float));
    }
  }
}

void qkv_epilogue_range(float* y, int64_t ld, int64_t m0, int64_t m1, const QkvEpilogue& e) {
  if (e.bias != nullptr) {
    for (int64_t m = m0; m < m1; ++m) {
      float* row = y + m * ld;
      for (int64_t i = 0; i < ld; ++i) row[i] += e.bias[i];
    }
  }
  const int64_t d = e.head_dim;
  const auto norm_heads = [&](const float* w, int64_t col0, int64_t cols) {
    if (w == nullptr) return;
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t c = col0; c < col0 + cols; c += d) {  // a head is a row of d: normalised in place
        float* head = y + m * ld + c;
        rms_norm_range(head, w, e.eps, 0, 1, d, head);
      }
    }
  };
  norm_heads(e.q_norm, 0, e.q_cols);
  norm_heads(e.k_norm, e.q_cols, e.k_cols);
  if (e.cos != nullptr) rope_range(y, ld, m0, m1, e.q_cols + e.k_cols, e.cos, e.sin, e.rot, d);
}

// out[m] = silu(y[m, :half]) * y[m, half:], with silu as ATen's CPU kernel computes it: x / (1 + exp(-x)) on
// vectors of two registers at a time, the scalar formula for the rest. One pass, no temporaries.
void swiglu_range(const float* y, int64_t m0, int64_t m1, int64_t half, float* out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kStep = 2 * Vec::size();
  const Vec one(1.0f);
  for (int64_t m = m0; m < m1; ++m) {
    const float* gate = y + m * 2 * half;
    const float* up = gate + half;
    float* o = out + m * half;
    int64_t i = 0;
    for (; i + kStep <= half; i += kStep) {
      for (int64_t j = i; j < i + kStep; j += Vec::size()) {
        const Vec x = Vec::loadu(gate + j);
        ((x / (one + x.neg().exp())) * Vec::loadu(up + j)).store(o + j);
      }
    }
    for (; i < half; ++i) o[i] = (gate[i] / (1.0f + std::exp(-gate[i]))) * up[i];
  }
}

// out[m] = gelu_tanh(y[m, :half]) * y[m, half:] (Gemma's GeGLU): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
// x^3))), on whole vectors, the scalar formula for the rest. The per-op path (the geglu op) and the layer
// stack both call this, so they agree bit for bit; against torch's gelu they differ by float32 rounding.
void geglu_range(const float* y, int64_t m0, int64_t m1, int64_t half, float* out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  const Vec one(1.0f), point5(0.5f), beta(kBeta), kappa(kKappa);
  for (int64_t m = m0; m < m1; ++m) {
    const float* gate = y + m * 2 * half;
    const float* up = gate + half;
    float* o = out + m * half;
    int64_t i = 0;
    for (; i + Vec::size() <= half; i += Vec::size()) {
      const Vec x = Vec::loadu(gate + i);
      const Vec inner = beta * (x + kappa * x * x * x);
      (point5 * x * (one + inner.tanh()) * Vec::loadu(up + i)).store(o + i);
    }
    for (; i < half; ++i) {
      const float x = gate[i];
      o[i] = 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * x * x * x))) * up[i];
    }
  }
}

}  // namespace hq

namespace {

// Activation rows [m, m + mt) of qa (k columns) as the packed kernels take them.
ActRows act_rows(const QuantizedActs& qa, int64_t m, int mt, int64_t k) {
  const int64_t groups = k / 32;
  ActRows a{};
  for (int i = 0; i < mt; ++i) {
    a.q[i] = qa.q.data() + (m + i) * k;
    a.lo[i] = qa.lo.empty() ? nullptr : qa.lo.data() + (m + i) * k;
    a.dx[i] = qa.dx.data() + (m + i) * groups;
    a.xs[i] = qa.xs.data() + (m + i) * groups;
    a.qs16[i] = qa.qs16.data() + (m + i) * groups * 2;
  }
  return a;
}

void run_unit(int isa, const Part& p, int64_t unit, const QuantizedActs& qa, const float* xf, int64_t k,
              int64_t m0, int64_t m1, float* y, int64_t ldy, bool accumulate) {
  const Format f = format_of(p.qtype);
  const int64_t n0 = unit * kTileRows, nvalid = std::min<int64_t>(kTileRows, p.rows - n0);
  float tmp[kMaxMt][kTileRows];
  for (int64_t m = m0; m < m1; m += kMaxMt) {
    const int mt = static_cast<int>(std::min<int64_t>(kMaxMt, m1 - m));
    float* outs[kMaxMt];
    const bool direct = nvalid == kTileRows;
    for (int i = 0; i < mt; ++i) {
      outs[i] = direct ? y + (m + i) * ldy + p.col0 + n0 : tmp[i];
      if (!direct && accumulate) std::memcpy(tmp[i], y + (m + i) * ldy + p.col0 + n0, nvalid * sizeof(float));
    }
    if (f.float_type) {
      const float* xs[kMaxMt];
      for (int i = 0; i < mt; ++i) xs[i] = xf + (m + i) * k;
      for (int64_t r = 0; r < nvalid; r += 4) {
        const int nr = static_cast<int>(std::min<int64_t>(4, nvalid - r));
        const uint8_t* w = p.data + (n0 + r) * p.stride;
        for (int i0 = 0; i0 < mt; i0 += 2) {
          const int mt2 = std::min(2, mt - i0);
          float* o2[2] = {outs[i0] + r, mt2 > 1 ? outs[i0 + 1] + r : nullptr};
#if HQ_X86
          if (isa == kAvx512) { v512::run_float(p.qtype, w, p.stride, nr, k, xs + i0, mt2, o2, accumulate); continue; }
          if (isa >= kAvx2) { v256::run_float(p.qtype, w, p.stride, nr, k, xs + i0, mt2, o2, accumulate); continue; }
#endif
          scalar_float(p.qtype, w, p.stride, nr, k, xs + i0, mt2, o2, accumulate);
        }
      }
    } else {
      const int64_t nblocks = k / f.block;
      const ActRows a = act_rows(qa, m, mt, k);
      const uint8_t* tile = p.data + unit * p.stride;
#if HQ_X86
      if (isa >= kAvx2) {
        if (isa == kAvx512) v512::run_packed(p.qtype, tile, nblocks, a, mt, outs, accumulate);
        else if (isa == kAvxVnni) {
#if HQ_AVXVNNI
          if (__builtin_cpu_supports("avxvnni"))
            v256vex::run_packed(p.qtype, tile, nblocks, a, mt, outs, accumulate);
          else
#endif
            v256evex::run_packed(p.qtype, tile, nblocks, a, mt, outs, accumulate);
        } else {
          v256::run_packed(p.qtype, tile, nblocks, a, mt, outs, accumulate);
        }
      } else
#endif
        scalar_packed(p.qtype, tile, nblocks, a, mt, outs, accumulate);
    }
    if (!direct)
      for (int i = 0; i < mt; ++i) std::memcpy(y + (m + i) * ldy + p.col0 + n0, tmp[i], nvalid * sizeof(float));
  }
}

// Units u and u + 1 of a packed part, both full tiles, against activation row 0 (a batch-1 step): one kernel
// call reads both tiles' weights at once and shares each activation broadcast between them. AVX-512 only
// (run_tasks pairs nowhere else).
void run_unit_pair(const Part& p, int64_t unit, const QuantizedActs& qa, int64_t k, float* y, bool accumulate) {
#if HQ_X86
  float* out[1] = {y + p.col0 + unit * kTileRows};
  v512::run_packed_pair(p.qtype, p.data + unit * p.stride, p.stride, k / format_of(p.qtype).block,
                        act_rows(qa, 0, 1, k), out, accumulate);
#endif
}

int64_t isa_level(int64_t requested) {
  static const int best = best_isa();
  return requested <= 0 ? best : std::min<int64_t>(requested, best);
}

}  // namespace

namespace hq {

void check_rope_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t rows, int64_t rope_cols, int64_t cols,
                       const char* op, int64_t head) {
  const int64_t width = cos.dim() == 2 ? cos.size(1) : 0;
  const int64_t step = head > 0 ? head : width;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == rows && cos.sizes() == sin.sizes() &&
                  width > 0 && width % 2 == 0 && width <= kMaxRopeDim && width <= step && rope_cols >= 0 &&
                  rope_cols % step == 0 && rope_cols <= cols,
              op, ": rope tables must be contiguous float32 [rows, even width <= 512 and <= the head] and heads ",
              "must divide rope_cols");
}

LinearPlan plan_linear(at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef rows, int64_t m_rows,
                       int64_t k, int64_t isa) {
  TORCH_CHECK(weights.size() == qtypes.size() && weights.size() == rows.size() && !weights.empty(),
              "quant_linear: weights, qtypes and rows must be non-empty and of one length");
  LinearPlan plan;
  plan.m_rows = m_rows;
  plan.k = k;
  plan.level = static_cast<int>(isa_level(isa));
  plan.chunks = (m_rows + kRowChunk - 1) / kRowChunk;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int qt = static_cast<int>(qtypes[i]);
    TORCH_CHECK(supported(qt), "quant_linear: GGML type ", qt, " is not supported");
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                "quant_linear: weights must be contiguous 2-D uint8 tensors");
    const Format f = format_of(qt);
    TORCH_CHECK(k % f.block == 0 && (f.float_type || k % 32 == 0), "quant_linear: ", k,
                " input columns are not whole blocks of GGML type ", qt);
    const int64_t tiles = (rows[i] + kTileRows - 1) / kTileRows;
    if (f.float_type) {
      TORCH_CHECK(w.size(0) == rows[i] && w.size(1) == k * f.file_bytes, "quant_linear: float part ", i,
                  " has the wrong shape");
    } else {
      TORCH_CHECK(w.size(0) == tiles && w.size(1) == (k / f.block) * tile_block_bytes(qt), "quant_linear: packed part ",
                  i, " has the wrong shape for ", k, " columns");
      plan.any_packed = true;
    }
    plan.parts.push_back({w.data_ptr<uint8_t>(), qt, rows[i], plan.n_total, tiles, w.size(1)});
    plan.n_total += rows[i];
    plan.units += tiles;
  }
  return plan;
}

void run_tasks(const LinearPlan& plan, const QuantizedActs& qa, const float* xf, float* y, bool accumulate,
               int64_t begin, int64_t end) {
  size_t pi = 0;
  int64_t first_unit = 0;  // of part pi
  for (int64_t task = begin; task < end; ++task) {
    const int64_t u = task / plan.chunks;
    while (u >= first_unit + plan.parts[pi].units) first_unit += plan.parts[pi++].units;
    const Part& p = plan.parts[pi];
    const int64_t unit = u - first_unit;
    // Pairs on AVX-512 only, where they were measured: AVX2's 16 registers would spill two tiles' accumulators.
    if (plan.level == kAvx512 && plan.m_rows == 1 && task + 1 < end && !format_of(p.qtype).float_type &&
        (unit + 2) * kTileRows <= p.rows) {
      run_unit_pair(p, unit, qa, plan.k, y, accumulate);  // chunks == 1: the next task is unit + 1
      ++task;
      continue;
    }
    const int64_t m0 = (task % plan.chunks) * kRowChunk, m1 = std::min(plan.m_rows, m0 + kRowChunk);
    run_unit(plan.level, p, unit, qa, xf, plan.k, m0, m1, y, plan.n_total, accumulate);
  }
}

}  // namespace hq

namespace {

at::Tensor quant_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef rows,
                        const c10::optional<at::Tensor>& norm, double eps, const c10::optional<at::Tensor>& residual,
                        const c10::optional<at::Tensor>& rope_cos, const c10::optional<at::Tensor>& rope_sin,
                        int64_t rope_cols, bool swiglu, int64_t act_bits, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_linear: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(act_bits == 8 || act_bits == 15, "quant_linear: act_bits must be 8 or 15, got ", act_bits);
  const int64_t m_rows = x.size(0), k = x.size(1);
  const LinearPlan plan = plan_linear(weights, qtypes, rows, m_rows, k, isa);
  const int64_t n_total = plan.n_total;
  const int bits = static_cast<int>(act_bits);
  // Row helpers in parallel over rows, 16 at least to a thread (below that a region costs more than the rows).
  const auto by_rows = [&](const auto& fn) { at::parallel_for(0, m_rows, 16, fn); };

  const float* xf = x.data_ptr<float>();
  static thread_local std::vector<float> normed;
  if (norm.has_value()) {
    TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->numel() == k && norm->is_contiguous(),
                "quant_linear: norm must be a contiguous float32 vector of ", k);
    normed.resize(m_rows * k);
    const float* w = norm->data_ptr<float>();
    float* out = normed.data();  // this thread's buffer: inside the region `normed` would be each worker's own
    by_rows([&](int64_t m0, int64_t m1) { rms_norm_range(xf, w, eps, m0, m1, k, out); });
    xf = out;
  }
  // Scratch reused across calls. A thread_local named inside the parallel region below would be each worker
  // thread's own (empty) copy, so the region sees it through this reference.
  static thread_local QuantizedActs scratch;
  QuantizedActs& qa = scratch;
  if (plan.any_packed) {
    size_acts(m_rows, k, bits, qa);
    by_rows([&](int64_t m0, int64_t m1) { quantize_acts(xf, m0, m1, k, bits, plan.level, qa); });
  }

  at::Tensor y;
  bool accumulate = false;
  if (residual.has_value() && !swiglu) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->dim() == 2 &&
                    residual->size(0) == m_rows && residual->size(1) == n_total,
                "quant_linear: residual must be a contiguous float32 [", m_rows, ", ", n_total, "] tensor");
    y = *residual;
    accumulate = true;
  } else {
    y = at::empty({m_rows, n_total}, x.options());
  }
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, plan.tasks(), 1,
                   [&](int64_t begin, int64_t end) { run_tasks(plan, qa, xf, yp, accumulate, begin, end); });

  if (rope_cols > 0) {
    TORCH_CHECK(rope_cos.has_value() && rope_sin.has_value(), "quant_linear: rope needs cos and sin tables");
    const at::Tensor& c = *rope_cos;
    const at::Tensor& s = *rope_sin;
    check_rope_tables(c, s, m_rows, rope_cols, n_total, "quant_linear");
    by_rows([&](int64_t m0, int64_t m1) {
      rope_range(yp, n_total, m0, m1, rope_cols, c.data_ptr<float>(), s.data_ptr<float>(), c.size(1));
    });
  }
  if (swiglu) {
    TORCH_CHECK(n_total % 2 == 0, "quant_linear: swiglu needs an even number of outputs");
    const int64_t half = n_total / 2;
    at::Tensor out = at::empty({m_rows, half}, x.options());
    by_rows([&](int64_t m0, int64_t m1) { swiglu_range(yp, m0, m1, half, out.data_ptr<float>()); });
    return out;
  }
  return y;
}

// The rest of a decoder layer after attention, in one call: h += o(attn); h += down(swiglu(gate_up(norm(h)))).
// Three projections, one dispatch: at batch 1 the per-call cost (Python, the dispatcher, the parallel
// region) is a sizeable share of each small projection. h is updated in place and returned.
at::Tensor quant_mlp_tail(const at::Tensor& attn, const at::Tensor& h, at::TensorList o_w, at::IntArrayRef o_t,
                          at::IntArrayRef o_r, const at::Tensor& norm, double eps, at::TensorList gu_w,
                          at::IntArrayRef gu_t, at::IntArrayRef gu_r, at::TensorList d_w, at::IntArrayRef d_t,
                          at::IntArrayRef d_r, int64_t act_bits, int64_t isa) {
  const c10::optional<at::Tensor> none;
  quant_linear(attn, o_w, o_t, o_r, none, 0.0, h, none, none, 0, false, act_bits, isa);
  const at::Tensor act = quant_linear(h, gu_w, gu_t, gu_r, norm, eps, none, none, none, 0, true, act_bits, isa);
  quant_linear(act, d_w, d_t, d_r, none, 0.0, h, none, none, 0, false, act_bits, isa);
  return h;
}

// The qkv_epilogue op: the per-op path's stage between a packed q/k/v projection and attention, in place.
at::Tensor qkv_epilogue(const at::Tensor& y, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                        int64_t head_dim, int64_t q_cols, int64_t k_cols, const c10::optional<at::Tensor>& rope_cos,
                        const c10::optional<at::Tensor>& rope_sin) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "qkv_epilogue: y must be a contiguous 2-D float32 tensor");
  const int64_t rows = y.size(0), ld = y.size(1);
  TORCH_CHECK(head_dim > 0 && q_cols >= 0 && k_cols >= 0 && q_cols % head_dim == 0 && k_cols % head_dim == 0 &&
                  q_cols + k_cols <= ld,
              "qkv_epilogue: q_cols and k_cols must be whole heads of ", head_dim, " within the ", ld, " columns");
  QkvEpilogue e;
  e.eps = eps;
  e.head_dim = head_dim;
  e.q_cols = q_cols;
  e.k_cols = k_cols;
  const auto vector = [](const c10::optional<at::Tensor>& t, int64_t n, const char* what) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, "qkv_epilogue: ", what,
                " must be a contiguous float32 vector of ", n);
    return t->const_data_ptr<float>();
  };
  e.bias = vector(bias, ld, "bias");
  e.q_norm = vector(q_norm, head_dim, "q_norm");
  e.k_norm = vector(k_norm, head_dim, "k_norm");
  TORCH_CHECK(rope_cos.has_value() == rope_sin.has_value(), "qkv_epilogue: rope needs cos and sin tables");
  if (rope_cos.has_value()) {
    check_rope_tables(*rope_cos, *rope_sin, rows, q_cols + k_cols, ld, "qkv_epilogue", head_dim);
    e.cos = rope_cos->const_data_ptr<float>();
    e.sin = rope_sin->const_data_ptr<float>();
    e.rot = rope_cos->size(1);
  }
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) { qkv_epilogue_range(yp, ld, m0, m1, e); });
  return y;
}

// The per-op path's RMSNorm after a projection (Gemma's sandwich norms), as the layer stack computes it.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm_rows: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm_rows: w must be a contiguous float32 vector of ", x.size(1));
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t k = x.size(1);
  at::parallel_for(0, x.size(0), 16, [&](int64_t m0, int64_t m1) {
    rms_norm_range(x.const_data_ptr<float>(), w.const_data_ptr<float>(), eps, m0, m1, k, out.data_ptr<float>());
  });
  return out;
}

// The per-op path's GeGLU after gate_up, as the layer stack computes it.
at::Tensor geglu_rows(const at::Tensor& y) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(1) % 2 == 0,
              "geglu_rows: y must be a contiguous 2-D float32 tensor of gate and up halves");
  const int64_t half = y.size(1) / 2;
  at::Tensor out = at::empty({y.size(0), half}, y.options());
  at::parallel_for(0, y.size(0), 16, [&](int64_t m0, int64_t m1) {
    geglu_range(y.const_data_ptr<float>(), m0, m1, half, out.data_ptr<float>());
  });
  return out;
}

int64_t quant_isa() { return isa_level(0); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydragen, m) {
  m.def(
      "quant_linear(Tensor x, Tensor[] weights, int[] qtypes, int[] rows, Tensor? norm, float eps, Tensor? residual, "
      "Tensor? rope_cos, Tensor? rope_sin, int rope_cols, bool swiglu, int act_bits, int isa) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
  m.def(
      "quant_mlp_tail(Tensor attn, Tensor h, Tensor[] o_w, int[] o_t, int[] o_r, Tensor norm, float eps, "
      "Tensor[] gu_w, int[] gu_t, int[] gu_r, Tensor[] d_w, int[] d_t, int[] d_r, int act_bits, int isa) -> Tensor");
  m.impl("quant_mlp_tail", c10::DispatchKey::CPU, &quant_mlp_tail);
  m.def(
      "qkv_epilogue(Tensor(a!) y, Tensor? bias, Tensor? q_norm, Tensor? k_norm, float eps, int head_dim, int q_cols, "
      "int k_cols, Tensor? rope_cos, Tensor? rope_sin) -> Tensor(a!)");
  m.impl("qkv_epilogue", c10::DispatchKey::CPU, &qkv_epilogue);
  m.def("rms_norm_rows(Tensor x, Tensor w, float eps) -> Tensor");
  m.impl("rms_norm_rows", c10::DispatchKey::CPU, &rms_norm_rows);
  m.def("geglu_rows(Tensor y) -> Tensor");
  m.impl("geglu_rows", c10::DispatchKey::CPU, &geglu_rows);
  m.def("quant_isa() -> int", &quant_isa);
}
