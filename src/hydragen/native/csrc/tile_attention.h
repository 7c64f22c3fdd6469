// Attention of many query rows over one KV head's keys as register-blocked matrix products: the kernel behind
// a shared node's pieces (Hydragen's batched read of a prefix) and prefill tiles. Included by
// step_attention.cpp after aten_vec.h, so Vec is AVX-512 or AVX2 as -march=native gives.
//
// Every vector runs along the query rows (16 or 8 rows a register), so nothing is transposed per key:
//   S^T[key][row] = sum_e K[key][e] * Q^T[e][row]   each K value broadcast, Q^T packed once per piece
//   O^T[e][row]  += sum_key V[key][e] * P^T[key][row]  each V value broadcast
// K and V rows are read in place from the pool through a pointer per key (a node on scattered pages costs
// nothing extra); a 16-bit cache is widened once per chunk of keys into a small float32 buffer. The softmax
// runs over a chunk of keys at a time (online: running max and sum per row), and its per-row state is a
// vector too. Rows are padded to whole register tiles; padded rows compute on zeros and are never written.
// A causal or partly visible piece masks each row at its own last key; under a sliding window each row is also
// masked below its first visible key (TileJob::tok_first against the piece's first key's position), so a shared
// node's one matrix product serves decode tokens at different positions. A soft-cap (TileJob::cap) applies
// cap * tanh(s / cap) to each chunk's scores before the mask.
// Around the two products: the next chunk's K/V rows are prefetched, the score tiles keep each row's chunk
// maximum as they store, the exponentials are inline (exp_nonpositive) and chunks are 60 keys. With those the
// op over n = 64 tokens and 2,048 fp16 keys (two threads, 30 layers cycled, alternating processes) takes
// 1.98-2.02 ms a layer against 2.27-2.29 before (one slow round 2.58), 152-155 GFLOP/s.
//
// Per key chunk the arithmetic is two loops over register tiles of accumulators, where ATen's flash kernel
// (what pieces ran before) ran small GEMM calls with their packing. Measured on the embedded model's shapes
// (one thread, the op over 32 tokens x 9 heads and 2,048 shared keys, alternating runs): 74-80 GFLOP/s
// against 55-69 for the flash kernel.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace hta {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVL = Vec::size();
// Tile shapes for RV row vectors: keys per score tile (12 accumulators) and head-dim columns per value tile
// (16 accumulators on AVX-512's 32 registers, 12 on AVX2's 16).
template <int RV>
constexpr int kScoreKeys = 12 / RV;
template <int RV>
constexpr int kValueCols = (kVL >= 16 ? 16 : 12) / RV;
// Keys per softmax step: the chunk's scores stay in L1/L2, and 60 is a multiple of both score tiles' widths
// (6 and 12 keys), so only a context's last chunk runs keys through the one-key tile.
constexpr int64_t kChunkKeys = 60;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A piece's query rows and keys. Row r is token tok_lo + r / g, query head hq0 + r % g; token j sees the first
// min(first + j, total) keys of the concatenation of runs[run_lo:] (first may be <= 0: none). Under a sliding
// window (tok_first set) the keys are at positions kpos, kpos + 1, ... and token t sees none before position
// tok_first[t]: a lower bound per row, as the first is an upper one. cap > 0 soft-caps the scores.
struct TileJob {
  int64_t tok_lo, nt, g, hq0, run_lo, first, total;
  int64_t q_t, q_h;                    // q strides (token, head), elements
  int64_t k_s, v_s;                    // K / V strides per slot, elements; the head's offset is in k and v
  float* o;                            // token j, head r % g: o + j * o_t + (r % g) * d
  float* lse;                          // lse + j * lse_t + r % g
  int64_t o_t, lse_t;
  const int64_t* tok_first = nullptr;  // per step token: the first position it sees, or null (no window)
  int64_t kpos = 0;                    // the position of the piece's first key
  float cap = 0.f;                     // soft-cap (0: off)
};

// s[0:n] = cap * tanh(s / cap), Gemma 2's soft-capped scores (the scale already in s).
inline void soft_cap(float* s, int64_t n, float cap) {
  const Vec c(cap);
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) ((Vec::loadu(s + i) / c).tanh() * c).store(s + i);
  if (i < n) ((Vec::loadu(s + i, n - i) / c).tanh() * c).store(s + i, n - i);
}

// The first key index (of an item whose first key sits at position kpos) token t sees: 0 without a window.
inline int64_t first_seen(const int64_t* tok_first, int64_t t, int64_t kpos) {
  return tok_first == nullptr ? 0 : std::max<int64_t>(0, tok_first[t] - kpos);
}

struct TileScratch {
  std::vector<float> qt, st, ot, m, l, alpha, lim, low, cmax, kbuf, vbuf, vclean;
  std::vector<const float*> krow, vrow;
  std::vector<std::pair<int64_t, const float*>> vbad;  // a masked chunk's keys whose V row is not finite
};

inline TileScratch& tile_scratch() {
  thread_local TileScratch w;
  return w;
}

// Walks the slots of a concatenation of runs.
struct SlotCursor {
  const int64_t* runs;
  int64_t run, slot;
  int64_t next() {
    while (slot >= runs[2 * run + 1]) slot = runs[2 * ++run];  // callers never read past the last key
    return slot++;
  }
};

// Every cache line of [p, p + bytes) on its way into L1 (the last one too when the range does not start one).
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
  if (bytes > 0) __builtin_prefetch(c + bytes - 1, 0, 3);
}

template <typename T>
inline void grow(std::vector<T>& x, int64_t n) {
  if (static_cast<int64_t>(x.size()) < n) x.resize(n);
}

// max(a, b) in one instruction where there is one; a NaN may be dropped (it reaches the row through its
// exponential anyway, which is NaN whatever the maximum).
inline Vec max_fast(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_max_ps(a, b));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

// S^T[j0 + c][r0 + v kVL ...] for C keys and one row tile: acc[c][v] += K[j0 + c][e] * Q^T[e][r0 + v kVL ...].
// With cmax, each row's running maximum over the chunk is kept there too (the softmax then skips a pass).
template <int C, int RV>
inline void score_tile(const float* const* krow, const float* qt, int64_t mpad, int64_t d, float* st, int64_t j0,
                       int64_t r0, float* cmax) {
  Vec acc[C][RV];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < RV; ++v) acc[c][v] = Vec(0.f);
  for (int64_t e = 0; e < d; ++e) {
    Vec qv[RV];
    for (int v = 0; v < RV; ++v) qv[v] = Vec::loadu(qt + e * mpad + r0 + v * kVL);
    for (int c = 0; c < C; ++c) {
      const Vec kb(krow[j0 + c][e]);
      for (int v = 0; v < RV; ++v) acc[c][v] = at::vec::fmadd(kb, qv[v], acc[c][v]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < RV; ++v) acc[c][v].store(st + (j0 + c) * mpad + r0 + v * kVL);
  if (cmax == nullptr) return;
  for (int v = 0; v < RV; ++v) {
    Vec m = Vec::loadu(cmax + r0 + v * kVL);
    for (int c = 0; c < C; ++c) m = max_fast(m, acc[c][v]);
    m.store(cmax + r0 + v * kVL);
  }
}

// O^T[e0 + t][r0 ...] = O^T * alpha + sum_j V[j][e0 + t] * P^T[j][r0 ...] for T head-dim columns, one row tile.
template <int T, int RV>
inline void value_tile(const float* const* vrow, const float* pt, const float* alpha, int64_t mpad, int64_t nc,
                       float* ot, int64_t e0, int64_t r0) {
  Vec acc[T][RV];
  for (int v = 0; v < RV; ++v) {
    const Vec a = Vec::loadu(alpha + r0 + v * kVL);
    for (int t = 0; t < T; ++t) acc[t][v] = Vec::loadu(ot + (e0 + t) * mpad + r0 + v * kVL) * a;
  }
  for (int64_t j = 0; j < nc; ++j) {
    Vec pv[RV];
    for (int v = 0; v < RV; ++v) pv[v] = Vec::loadu(pt + j * mpad + r0 + v * kVL);
    const float* vr = vrow[j] + e0;
    for (int t = 0; t < T; ++t) {
      const Vec vb(vr[t]);
      for (int v = 0; v < RV; ++v) acc[t][v] = at::vec::fmadd(vb, pv[v], acc[t][v]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v].store(ot + (e0 + t) * mpad + r0 + v * kVL);
}

template <int RV, int... Ts>
inline void value_cols(int64_t cols, const float* const* vrow, const float* pt, const float* alpha, int64_t mpad,
                       int64_t nc, float* ot, int64_t e0, int64_t r0, std::integer_sequence<int, Ts...>) {
  // the remainder of the head dim (cols < kValueCols) as one tile of exactly that width
  ((cols == Ts + 1 ? value_tile<Ts + 1, RV>(vrow, pt, alpha, mpad, nc, ot, e0, r0) : void()), ...);
}

// exp(x) for x <= 0 (a softmax's shifted scores: also -inf, which gives 0, and NaN, which stays NaN), inline.
// On AVX-512: 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 in two steps (Cody and Waite), e^r by its
// degree-7 Taylor polynomial (truncation below 6e-9 relative on |r| <= ln 2 / 2) and 2^n by vscalefps: within
// 1 ulp of the rounded exp over [-87.3, 0], as Sleef's u10 is, and 0 below -104, where that rounds to 0.
// Sleef's expf behind Vec::exp() is a call that spills the loop's registers; this is a dozen instructions.
inline Vec exp_nonpositive(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  // max returns its second operand when either is NaN, so NaN survives; below -126 the result is 0 anyway.
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-126.f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);  // exact: 9 significant bits times n
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return Vec(_mm512_scalef_ps(p, n));
#else
  return x.exp();
#endif
}

// A row as float32 (a 16-bit row's exact values), a vector at a time; step_attention.cpp widens q rows with it.
template <typename kv_t>
inline void widen_row(const kv_t* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<kv_t, float>) {
    std::copy(src, src + n, dst);
  } else {
    int64_t e = 0;
    for (; e + kVL <= n; e += kVL) {
      Vec x;
      at::vec::load_to_float<kv_t>(src + e, x);
      x.store(dst + e);
    }
    for (; e < n; ++e) dst[e] = static_cast<float>(src[e]);
  }
}

// A masked chunk's V rows that hold an inf or NaN, for the keys some row does not see: the value products
// would give those rows 0 x inf = NaN from a key they must not read (and a prefill row would then write NaN
// K/V that the prefix cache shares). Each such row is replaced by a copy with those entries at 0; after the
// products, add_bad_values adds the entries back to the rows that see the key, so they get the inf or NaN.
inline void set_aside_bad_values(TileScratch& w, int64_t first_masked, int64_t nc, int64_t d) {
  w.vbad.clear();
  for (int64_t jj = first_masked; jj < nc; ++jj) {
    const float* vr = w.vrow[jj];
    bool finite = true;
    for (int64_t e = 0; e < d && finite; ++e) finite = std::isfinite(vr[e]);
    if (!finite) w.vbad.emplace_back(jj, vr);
  }
  if (w.vbad.empty()) return;
  grow(w.vclean, static_cast<int64_t>(w.vbad.size()) * d);
  for (size_t i = 0; i < w.vbad.size(); ++i) {
    const float* vr = w.vbad[i].second;
    float* clean = w.vclean.data() + i * d;
    for (int64_t e = 0; e < d; ++e) clean[e] = std::isfinite(vr[e]) ? vr[e] : 0.f;
    w.vrow[w.vbad[i].first] = clean;
  }
}

inline void add_bad_values(const TileScratch& w, const float* pt, const float* lim, const float* low, int64_t rows,
                           int64_t mpad, int64_t c0, int64_t d, float* ot) {
  for (const auto& [jj, vr] : w.vbad) {
    const float key = static_cast<float>(c0 + jj);
    for (int64_t r = 0; r < rows; ++r) {
      if (lim[r] <= key || key < low[r]) continue;  // row r does not see this key
      const float p = pt[jj * mpad + r];
      for (int64_t e = 0; e < d; ++e)
        if (!std::isfinite(vr[e])) ot[e * mpad + r] += vr[e] * p;
    }
  }
}

// The piece: writes each real row's normalised output and log-sum-exp (-inf and zeros for a row that sees no
// key). k and v point at the KV head's first element of slot 0.
template <int RV, typename q_t, typename kv_t>
void tile_attention_rv(const q_t* q, const kv_t* k, const kv_t* v, const int64_t* runs, const TileJob& job, int64_t d,
                       float scale) {
  constexpr int64_t kRowTile = RV * kVL;
  const int64_t rows = job.nt * job.g, mpad = (rows + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t kmax = std::max<int64_t>(0, std::min(job.first + job.nt - 1, job.total));  // keys of the last token
  TileScratch& w = tile_scratch();
  grow(w.qt, d * mpad);
  grow(w.st, kChunkKeys * mpad);
  grow(w.ot, d * mpad);
  for (auto* x : {&w.m, &w.l, &w.alpha, &w.lim, &w.low, &w.cmax}) grow(*x, mpad);
  grow(w.krow, kChunkKeys);
  grow(w.vrow, kChunkKeys);
  float* qt = w.qt.data();
  float* st = w.st.data();
  float* ot = w.ot.data();
  float *m = w.m.data(), *l = w.l.data(), *alpha = w.alpha.data(), *lim = w.lim.data(), *low = w.low.data();
  float max_low = 0.f;  // the highest lower bound of a real row (0 without a window)

  for (int64_t r = 0; r < mpad; ++r) {
    const bool real = r < rows;
    m[r] = kNegInf;
    l[r] = 0.f;
    // keys row r sees, [low, lim); padded rows see every key, so they never force the masked path
    lim[r] = static_cast<float>(real ? std::max<int64_t>(0, std::min(job.first + r / job.g, job.total)) : kmax);
    low[r] = real ? static_cast<float>(first_seen(job.tok_first, job.tok_lo + r / job.g, job.kpos)) : 0.f;
    max_low = std::max(max_low, low[r]);
    if (!real) {
      for (int64_t e = 0; e < d; ++e) qt[e * mpad + r] = 0.f;
      continue;
    }
    const q_t* src = q + (job.tok_lo + r / job.g) * job.q_t + (job.hq0 + r % job.g) * job.q_h;
    for (int64_t e = 0; e < d; ++e) qt[e * mpad + r] = static_cast<float>(src[e]) * scale;
  }
  std::fill(ot, ot + d * mpad, 0.f);
  const float min_lim = lim[0];  // limits grow with the token: row 0's is the smallest

  constexpr bool widen = !std::is_same_v<kv_t, float>;
  if constexpr (widen) {
    grow(w.kbuf, kChunkKeys * d);
    grow(w.vbuf, kChunkKeys * d);
  }
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(kv_t));
  SlotCursor cursor{runs, job.run_lo, runs[2 * job.run_lo]};
  for (int64_t c0 = 0; c0 < kmax; c0 += kChunkKeys) {
    const int64_t nc = std::min(kChunkKeys, kmax - c0);
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t slot = cursor.next();
      const kv_t* kr = k + slot * job.k_s;
      const kv_t* vr = v + slot * job.v_s;
      if constexpr (widen) {
        float* kb = w.kbuf.data() + j * d;
        float* vb = w.vbuf.data() + j * d;
        widen_row(kr, kb, d);
        widen_row(vr, vb, d);
        w.krow[j] = kb;
        w.vrow[j] = vb;
      } else {
        w.krow[j] = kr;
        w.vrow[j] = vr;
      }
    }
    // The next chunk's rows are fetched while this one computes: widening waits on the pool otherwise
    // (its rows are scattered over pages and strided by the other KV heads).
    SlotCursor ahead = cursor;
    for (int64_t j = 0, next = std::min(kChunkKeys, kmax - c0 - nc); j < next; ++j) {
      const int64_t slot = ahead.next();
      prefetch_row(k + slot * job.k_s, row_bytes);
      prefetch_row(v + slot * job.v_s, row_bytes);
    }
    const float* const* krow = w.krow.data();
    const float* const* vrow = w.vrow.data();
    // Some row stops seeing keys inside this chunk, or (a window) starts seeing them only inside it or later.
    const bool below = max_low > static_cast<float>(c0);
    const bool masked = min_lim < static_cast<float>(c0 + nc) || below;
    float* cmax = masked || job.cap > 0.f ? nullptr : w.cmax.data();  // else the maxima come after mask or cap
    if (cmax) std::fill(cmax, cmax + mpad, kNegInf);
    int64_t j = 0;
    for (; j + kScoreKeys<RV> <= nc; j += kScoreKeys<RV>)
      for (int64_t r0 = 0; r0 < mpad; r0 += kRowTile)
        score_tile<kScoreKeys<RV>, RV>(krow, qt, mpad, d, st, j, r0, cmax);
    for (; j < nc; ++j)
      for (int64_t r0 = 0; r0 < mpad; r0 += kRowTile) score_tile<1, RV>(krow, qt, mpad, d, st, j, r0, cmax);
    if (job.cap > 0.f) soft_cap(st, nc * mpad, job.cap);  // before the mask: a masked score stays -inf
    const int64_t first_masked = below ? 0 : std::max<int64_t>(0, static_cast<int64_t>(min_lim) - c0);
    if (masked) {
      set_aside_bad_values(w, first_masked, nc, d);
      const Vec ninf(kNegInf);
      for (int64_t jj = first_masked; jj < nc; ++jj) {
        const Vec key(static_cast<float>(c0 + jj));
        for (int64_t r0 = 0; r0 < mpad; r0 += kVL) {
          float* s = st + jj * mpad + r0;
          Vec x = Vec::blendv(Vec::loadu(s), ninf, Vec::loadu(lim + r0) <= key);
          if (below) x = Vec::blendv(x, ninf, key < Vec::loadu(low + r0));
          x.store(s);
        }
      }
    }
    // Online softmax, a row vector at a time: P^T = exp(S^T - m) in place, alpha = exp(m_old - m).
    for (int64_t r0 = 0; r0 < mpad; r0 += kVL) {
      Vec mx(kNegInf);
      if (cmax) mx = Vec::loadu(cmax + r0);
      else for (int64_t jj = 0; jj < nc; ++jj) mx = at::vec::maximum(mx, Vec::loadu(st + jj * mpad + r0));
      const Vec m_old = Vec::loadu(m + r0);
      const Vec m_new = at::vec::maximum(m_old, mx);
      // a row that has seen no key yet keeps m = -inf: shift by 0 there, so exp gives 0, never NaN
      const Vec shift = Vec::blendv(m_new, Vec(0.f), m_new == Vec(kNegInf));
      Vec sum(0.f);
      for (int64_t jj = 0; jj < nc; ++jj) {
        const Vec p = exp_nonpositive(Vec::loadu(st + jj * mpad + r0) - shift);
        p.store(st + jj * mpad + r0);
        sum = sum + p;
      }
      const Vec a = exp_nonpositive(m_old - shift);
      a.store(alpha + r0);
      (Vec::loadu(l + r0) * a + sum).store(l + r0);
      m_new.store(m + r0);
    }
    int64_t e0 = 0;
    for (; e0 + kValueCols<RV> <= d; e0 += kValueCols<RV>)
      for (int64_t r0 = 0; r0 < mpad; r0 += kRowTile) value_tile<kValueCols<RV>, RV>(vrow, st, alpha, mpad, nc, ot, e0, r0);
    if (e0 < d) {
      for (int64_t r0 = 0; r0 < mpad; r0 += kRowTile)
        value_cols<RV>(d - e0, vrow, st, alpha, mpad, nc, ot, e0, r0, std::make_integer_sequence<int, kValueCols<RV> - 1>{});
    }
    if (masked && !w.vbad.empty()) add_bad_values(w, st, lim, low, rows, mpad, c0, d, ot);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = r / job.g, head = r % job.g;
    const float inv = l[r] != 0.f ? 1.f / l[r] : 0.f;  // 0: the row saw no key; NaN: it read a NaN
    float* dst = job.o + tok * job.o_t + head * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = ot[e * mpad + r] * inv;
    job.lse[tok * job.lse_t + head] = l[r] != 0.f ? m[r] + std::log(l[r]) : kNegInf;
  }
}

// Rows go in tiles of two vectors (32 rows on AVX-512) where that pads no more than one-vector tiles would:
// two vectors share each broadcast K or V value, so fewer loads per multiply-add.
template <typename q_t, typename kv_t>
void tile_attention(const q_t* q, const kv_t* k, const kv_t* v, const int64_t* runs, const TileJob& job, int64_t d,
                    float scale) {
  const int64_t rows = job.nt * job.g;
  const int64_t one = (rows + kVL - 1) / kVL, two = (rows + 2 * kVL - 1) / (2 * kVL) * 2;  // vectors
  if (two == one) tile_attention_rv<2>(q, k, v, runs, job, d, scale);
  else tile_attention_rv<1>(q, k, v, runs, job, d, scale);
}

}  // namespace hta
