// Step attention on CPU: every query token of a packed step (decode tokens, prefill chunks, extends)
// against its keys, in one call per layer. The Python side (attention/step_attention.py) documents the
// metadata and cuts the step into work items once per step; here is the arithmetic.
//
// Two phases in one parallel region whose threads take items from shared counters (items come sorted most
// expensive first, so uneven items balance and a busy core delays nobody); a thread that finds phase 1
// handed out waits for it to finish before taking phase-2 items. An item covers every KV
// head (a slot's rows of all heads are one contiguous read), except a tile piece, one item per KV head:
//  1. Pieces of units (shared tree nodes, prefill ancestors, causal diagonals) and of very long segments:
//     a piece with enough query rows and keys goes through the tile kernel (tile_attention.h) as matrix
//     products, the g query heads of a KV head folded into its rows so the keys are read once per KV head,
//     each row masked at its own last key (causal squares, partly visible chunks), the keys read in place
//     through their runs. Small pieces go through attend(). Each writes a normalised fp32 partial and its
//     log-sum-exp, one row per (piece, token).
//  2. Segment blocks (private tails, pages read in place): attend() runs an online softmax in fp32 over the
//     block's visible keys, reading each K/V row straight from the pool by slot once for all its query
//     rows (a 16-bit cache widened in registers), then folds in the partials covering each token (a CSR
//     built once per step) and writes.
//
// A sliding window is a lower bound per token (tok_first: the first position it sees) against the position of
// each item's first key (kpos, the items' last field): a tile row is masked below it as it is above its last key,
// and attend() starts each row at it. The items come trimmed (step_work.py), so a window's keys that no token
// sees are not read at all. A soft-cap (cap > 0) makes every score cap * tanh(score / cap) before the softmax.
//
// aten_vec.h maps ATen's Vectorized<float> to the AVX2 or AVX-512 registers -march=native gives.

#include "aten_vec.h"  // before any ATen header
#include "step_attention.h"
#include "tile_attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using hta::kNegInf;
using hta::kVL;
using hta::Vec;
constexpr int64_t kBlockKeys = 32;  // keys per online-softmax step: scores stay in L1

// kVL values of a row as float32 (the first `count` of them, the rest 0): a 16-bit cache is widened in
// registers as it is read, to the values a float32 copy of the row would hold.
template <typename kv_t>
inline Vec load_f(const kv_t* p) {
  if constexpr (std::is_same_v<kv_t, float>) {
    return Vec::loadu(p);
  } else {
    Vec x;
    at::vec::load_to_float<kv_t>(p, x);
    return x;
  }
}

template <typename kv_t>
inline Vec load_f(const kv_t* p, int64_t count) {
  if constexpr (std::is_same_v<kv_t, float>) {
    return Vec::loadu(p, count);
  } else {
    float tmp[kVL] = {};
    for (int64_t i = 0; i < count; ++i) tmp[i] = static_cast<float>(p[i]);
    return Vec::loadu(tmp);
  }
}

template <typename kv_t>
inline float dot(const float* a, const kv_t* b, int64_t n) {
  Vec s0(0.f), s1(0.f);
  int64_t d = 0;
  for (; d + 2 * kVL <= n; d += 2 * kVL) {
    s0 = at::vec::fmadd(Vec::loadu(a + d), load_f(b + d), s0);
    s1 = at::vec::fmadd(Vec::loadu(a + d + kVL), load_f(b + d + kVL), s1);
  }
  for (; d + kVL <= n; d += kVL) s0 = at::vec::fmadd(Vec::loadu(a + d), load_f(b + d), s0);
  if (d < n) s1 = at::vec::fmadd(Vec::loadu(a + d, n - d), load_f(b + d, n - d), s1);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s0 + s1);
}

// out[j] = the sum of the lanes of a_j, for four vectors at once (one shuffle tree instead of four).
inline void hsum4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const auto half = [](const Vec& a) {
    const __m512 x = a;
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  };
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  const auto sum = [](const Vec& x) {
    return at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, x);
  };
  out[0] = sum(a0);
  out[1] = sum(a1);
  out[2] = sum(a2);
  out[3] = sum(a3);
#endif
}

// s[i] = <q, rows[i]> for i < nk: four keys at a time share each load of q and one reduction. Rows are in the
// cache's dtype, widened as they are loaded.
template <typename kv_t>
inline void dots(const float* q, const kv_t* const* rows, int64_t nk, int64_t d, float* s) {
  int64_t i = 0;
  for (; i + 4 <= nk; i += 4) {
    const kv_t *k0 = rows[i], *k1 = rows[i + 1], *k2 = rows[i + 2], *k3 = rows[i + 3];
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    int64_t j = 0;
    for (; j + kVL <= d; j += kVL) {
      const Vec x = Vec::loadu(q + j);
      a0 = at::vec::fmadd(x, load_f(k0 + j), a0);
      a1 = at::vec::fmadd(x, load_f(k1 + j), a1);
      a2 = at::vec::fmadd(x, load_f(k2 + j), a2);
      a3 = at::vec::fmadd(x, load_f(k3 + j), a3);
    }
    if (j < d) {
      const int64_t c = d - j;
      const Vec x = Vec::loadu(q + j, c);
      a0 = at::vec::fmadd(x, load_f(k0 + j, c), a0);
      a1 = at::vec::fmadd(x, load_f(k1 + j, c), a1);
      a2 = at::vec::fmadd(x, load_f(k2 + j, c), a2);
      a3 = at::vec::fmadd(x, load_f(k3 + j, c), a3);
    }
    hsum4(a0, a1, a2, a3, s + i);
  }
  for (; i < nk; ++i) s[i] = dot(q, rows[i], d);
}

// dots() for the G query rows of one KV head at once: each loaded K vector feeds G rows, where one row at a
// time loaded it G times (the loads, not the multiply-adds, bounded the loop). Per row the multiply-adds and
// the reduction are dots()'s, in its order, so the scores are its bits. Needs d a multiple of kVL.
template <int G, typename kv_t>
inline void dots_rows(const float* const* q, const kv_t* const* rows, int64_t nk, int64_t d, float* const* s) {
  int64_t i = 0;
  for (; i + 4 <= nk; i += 4) {
    const kv_t *k0 = rows[i], *k1 = rows[i + 1], *k2 = rows[i + 2], *k3 = rows[i + 3];
    Vec a[G][4];
    for (int r = 0; r < G; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = Vec(0.f);
    for (int64_t j = 0; j < d; j += kVL) {
      const Vec x0 = load_f(k0 + j), x1 = load_f(k1 + j), x2 = load_f(k2 + j), x3 = load_f(k3 + j);
      for (int r = 0; r < G; ++r) {
        const Vec x = Vec::loadu(q[r] + j);
        a[r][0] = at::vec::fmadd(x, x0, a[r][0]);
        a[r][1] = at::vec::fmadd(x, x1, a[r][1]);
        a[r][2] = at::vec::fmadd(x, x2, a[r][2]);
        a[r][3] = at::vec::fmadd(x, x3, a[r][3]);
      }
    }
    for (int r = 0; r < G; ++r) hsum4(a[r][0], a[r][1], a[r][2], a[r][3], s[r] + i);
  }
  for (; i < nk; ++i)
    for (int r = 0; r < G; ++r) s[r][i] = dot(q[r], rows[i], d);
}

// acc_r[0 : NV * kVL] = acc_r * alpha_r + sum_i p_r[i] * rows[i][d0 : d0 + NV * kVL] for R rows sharing the
// V rows: the R x NV accumulators stay in registers and each loaded V vector feeds R of them. Per row the
// operations and their order do not depend on R, so R rows together give each row's bits alone.
template <int R, int NV, typename kv_t>
inline void scale_add_tile(float* const* acc, const float* alpha, const float* const* p, const kv_t* const* rows,
                           int64_t nk, int64_t d0) {
  Vec a[R][NV];
  for (int r = 0; r < R; ++r) {
    const Vec al(alpha[r]);
    for (int j = 0; j < NV; ++j) a[r][j] = Vec::loadu(acc[r] + j * kVL) * al;
  }
  for (int64_t i = 0; i < nk; ++i) {
    const kv_t* vr = rows[i] + d0;
    Vec w[R];
    for (int r = 0; r < R; ++r) w[r] = Vec(p[r][i]);
    for (int j = 0; j < NV; ++j) {
      const Vec x = load_f(vr + j * kVL);
      for (int r = 0; r < R; ++r) a[r][j] = at::vec::fmadd(w[r], x, a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j].store(acc[r] + j * kVL);
}

// acc[0:n] = acc * alpha + sum_i p[i] * rows[i][0:n] (rows in the cache's dtype, read as float32).
template <typename kv_t>
inline void scale_add_rows(float* acc, float alpha, const float* p, const kv_t* const* rows, int64_t nk,
                           int64_t n) {
  int64_t d = 0;
  const auto tile = [&](auto nv_c) {
    float* const at = acc + d;
    scale_add_tile<1, decltype(nv_c)::value>(&at, &alpha, &p, rows, nk, d);
  };
  for (; d + 8 * kVL <= n; d += 8 * kVL) tile(std::integral_constant<int, 8>{});
  if (d + 4 * kVL <= n) {
    tile(std::integral_constant<int, 4>{});
    d += 4 * kVL;
  }
  for (; d + kVL <= n; d += kVL) tile(std::integral_constant<int, 1>{});
  if (d < n) {
    const int64_t c = n - d;
    Vec a = Vec::loadu(acc + d, c) * Vec(alpha);
    for (int64_t i = 0; i < nk; ++i) a = at::vec::fmadd(Vec(p[i]), load_f(rows[i] + d, c), a);
    a.store(acc + d, c);
  }
}

// The largest of s[0:n].
inline float vmax(const float* s, int64_t n) {
  int64_t i = 0;
  Vec m(kNegInf);
  for (; i + kVL <= n; i += kVL) m = at::vec::maximum(m, Vec::loadu(s + i));
  float best = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, m);
  for (; i < n; ++i) best = std::max(best, s[i]);
  return best;
}

// p[0:n] = exp(s[0:n] - m); returns their sum.
inline float exp_shifted(const float* s, float* p, float m, int64_t n) {
  const Vec vm(m);
  Vec total(0.f);
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) {
    Vec e = (Vec::loadu(s + i) - vm).exp();
    e.store(p + i);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
  for (; i < n; ++i) {
    p[i] = std::exp(s[i] - m);
    sum += p[i];
  }
  return sum;
}

struct Strides {
  int64_t q_t, q_h, k_s, k_h, v_s, v_h;
};

// A work item: query tokens [tok_lo, tok_hi) x the g query heads of one KV head, against the keys of the
// slot runs [run_lo, run_hi) (a concatenation); token tok_lo + j sees the first min(first + j, total) of
// them (first may be <= 0: such tokens see none of this item's keys). Its keys are at positions kpos, kpos + 1,
// ... (read only under a window: token t then sees none before position tok_first[t]).
struct Item {
  int64_t tok_lo, tok_hi, run_lo, run_hi, first, total, kpos;
};

constexpr int64_t kPieceFields = 9;  // item, part_row, may_tile, kpos (step_work.PIECE_FIELDS)
constexpr int64_t kBlockFields = 7;  // item, kpos (step_work.BLOCK_FIELDS)

inline Item item_at(const int64_t* row, int64_t fields) {
  return {row[0], row[1], row[2], row[3], row[4], row[5], row[fields - 1]};
}

// What masks and shapes the scores beyond the items: each token's first visible position (a window; null: none)
// and the soft-cap (0: none).
struct Bounds {
  const int64_t* tok_first;
  float cap;
};

// Per-thread scratch for the largest item, kept by each worker thread between calls (grown, never shrunk):
// a decode step calls the op once per layer, and fresh buffers cost more than a short item's arithmetic.
struct Scratch {
  std::vector<float> q, acc, s, m, l, alpha;
  std::vector<int64_t> lim, beg;

  void fit(int64_t rows, int64_t d) {
    const auto grow = [](auto& x, int64_t n) {
      if (static_cast<int64_t>(x.size()) < n) x.resize(n);
    };
    grow(q, rows * d);
    grow(acc, rows * d);
    grow(s, rows * kBlockKeys);
    grow(m, rows);
    grow(l, rows);
    grow(alpha, rows);
    grow(lim, rows);
    grow(beg, rows);
  }
};

Scratch& thread_scratch(int64_t rows, int64_t d) {
  thread_local Scratch w;
  w.fit(rows, d);
  return w;
}

using hta::prefetch_row;
using hta::SlotCursor;

// Loads one word per 64 bytes of [p, p + bytes), front to back (every cache line of the range but perhaps an
// unaligned last one). Sweeping each window of keys into cache before the arithmetic reads it is what made
// the op faster in the engine (n = 1 decode, 512 keys: ~10 % float32, more with a 16-bit cache): the hardware
// prefetchers follow a plain sequential sweep, and the software prefetches of the gather alone did not hide
// the latency. Integer loads: 16-bit bytes read as floats could be denormals.
inline uint64_t sweep(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  uint64_t a = 0;
  for (int64_t i = 0; i + 8 <= bytes; i += 64) {
    uint64_t x;
    std::memcpy(&x, c + i, sizeof x);
    a ^= x;
#if defined(__GNUC__)
    asm volatile("" : "+r"(a));  // one scalar load per line: vectorized, the loop read whole lines and permuted
#endif
  }
  return a;
}

constexpr int64_t kSweepKeys = 64;  // keys swept ahead of the arithmetic (96 KB of float32 K/V, 3 KV heads)

// Online softmax of the item's rows over its visible keys, for the nh KV heads h, h + 1, ... together
// (row r = token tok_lo + r / (g nh), query head h g + r % (g nh)), reading each key's K/V rows of those
// heads from the pool once for all rows: with every head, one slot's rows are one contiguous read. Leaves
// the unnormalised state in w: running max m, sum l, and acc = sum_i exp(s_i - m) v_i. Keys go by blocks
// of kBlockKeys; the rows of the next block are prefetched while this one is computed (paged runs defeat
// the hardware prefetcher at every page boundary). Under a window a row takes its block's keys from its own
// first one (w.beg) on: its scores, weights and V rows all start there.
template <typename q_t, typename scalar_t>
void attend(const q_t* q, const scalar_t* k, const scalar_t* v, const Strides& st, const int64_t* runs,
            const Item& it, int64_t h, int64_t nh, int64_t g, int64_t d, float scale, const Bounds& bd,
            Scratch& w) {
  const int64_t gh = g * nh, nt = it.tok_hi - it.tok_lo, rows = nt * gh;
  float* qf = w.q.data();
  float* acc = w.acc.data();
  for (int64_t r = 0; r < rows; ++r) {
    hta::widen_row(q + (it.tok_lo + r / gh) * st.q_t + (h * g + r % gh) * st.q_h, qf + r * d, d);
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] *= scale;
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
  }
  std::fill(acc, acc + rows * d, 0.f);

  const int64_t kmax = std::min(it.first + nt - 1, it.total);  // keys seen by the last token
  if (kmax <= 0) return;
  // This block's K / V rows and the next block's (being prefetched), read in place in the cache's dtype; head
  // j's at j * kBlockKeys. Tables per thread and instantiation, swapped from block to block.
  static thread_local std::vector<const scalar_t*> krow, vrow, next_k, next_v;
  for (auto* table : {&krow, &vrow, &next_k, &next_v}) {
    if (static_cast<int64_t>(table->size()) < nh * kBlockKeys) table->resize(nh * kBlockKeys);
  }
  SlotCursor cursor{runs, it.run_lo, runs[2 * it.run_lo]};
  // The sweep's own walk over the runs: [run, slot) is where the next window starts.
  int64_t sweep_run = it.run_lo, sweep_slot = runs[2 * it.run_lo], swept = 0;
  // A slot's rows of the item's heads, from the first head's start to the last one's end. Only a compact layout
  // (the pool's [slot, head, dim], the item's heads filling each slot) is swept: there a run of slots is one
  // range of exactly the bytes the item reads; in any other layout a range would take in bytes it does not.
  const int64_t elem = static_cast<int64_t>(sizeof(scalar_t));
  const int64_t k_span = (nh - 1) * st.k_h + d, v_span = (nh - 1) * st.v_h + d;
  const bool slot_major = st.k_h == d && st.v_h == d && k_span == st.k_s && v_span == st.v_s;
  volatile uint64_t sink = 0;
  const auto sweep_window = [&]() {
    uint64_t acc = 0;
    for (int64_t left = std::min(kSweepKeys, kmax - swept); left > 0;) {
      if (sweep_slot >= runs[2 * sweep_run + 1]) {
        sweep_slot = runs[2 * ++sweep_run];
        continue;
      }
      const int64_t n = std::min(left, runs[2 * sweep_run + 1] - sweep_slot);
      acc ^= sweep(k + sweep_slot * st.k_s + h * st.k_h, ((n - 1) * st.k_s + k_span) * elem);
      acc ^= sweep(v + sweep_slot * st.v_s + h * st.v_h, ((n - 1) * st.v_s + v_span) * elem);
      sweep_slot += n;
      swept += n;
      left -= n;
    }
    sink = sink ^ acc;
  };
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(scalar_t));
  // The g rows of one token and KV head share their V rows: they take them together where the tile fits.
  // (g accumulators of d / kVL vectors each: at most 24 of AVX-512's 32 registers, 12 of AVX2's 16.)
  const bool shared_pv =
      g <= 4 && (d == 2 * kVL || d == 4 * kVL || d == 8 * kVL) && g * (d / kVL) <= (kVL >= 16 ? 24 : 12);
  const bool shared_qk = g <= 4 && d % kVL == 0;
  const auto gather = [&](int64_t count) {  // the next block's rows, prefetched
    for (int64_t i = 0; i < count; ++i) {
      const int64_t slot = cursor.next();
      for (int64_t j = 0; j < nh; ++j) {
        next_k[j * kBlockKeys + i] = k + slot * st.k_s + (h + j) * st.k_h;
        next_v[j * kBlockKeys + i] = v + slot * st.v_s + (h + j) * st.v_h;
        if (slot_major) continue;  // the sweep brings these rows in
        prefetch_row(next_k[j * kBlockKeys + i], row_bytes);
        prefetch_row(next_v[j * kBlockKeys + i], row_bytes);
      }
    }
  };
  gather(std::min(kBlockKeys, kmax));
  for (int64_t pos = 0; pos < kmax;) {
    if (slot_major && pos >= swept) sweep_window();
    const int64_t nk = std::min(kBlockKeys, kmax - pos);
    krow.swap(next_k);
    vrow.swap(next_v);
    gather(std::min(kBlockKeys, kmax - pos - nk));
    for (int64_t r = 0; r < rows; ++r) {  // row r takes keys [beg, beg + lim) of this block
      const int64_t seen = std::min(it.first + r / gh, it.total);
      const int64_t end = std::max<int64_t>(0, std::min(nk, seen - pos));
      const int64_t beg = std::min(end, std::max<int64_t>(0, hta::first_seen(bd.tok_first, it.tok_lo + r / gh,
                                                                              it.kpos) - pos));
      w.beg[r] = beg;
      w.lim[r] = end - beg;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += g) {  // the g rows of a token and KV head share K rows, beg and lim
      const scalar_t* const* kr = krow.data() + (r0 % gh) / g * kBlockKeys + w.beg[r0];
      if (!shared_qk) {
        for (int64_t r = r0; r < r0 + g; ++r) dots(qf + r * d, kr, w.lim[r], d, w.s.data() + r * kBlockKeys);
        continue;
      }
      const float* qs[4];
      float* ss[4];
      for (int64_t u = 0; u < g; ++u) {
        qs[u] = qf + (r0 + u) * d;
        ss[u] = w.s.data() + (r0 + u) * kBlockKeys;
      }
      switch (g) {
        case 1: dots_rows<1>(qs, kr, w.lim[r0], d, ss); break;
        case 2: dots_rows<2>(qs, kr, w.lim[r0], d, ss); break;
        case 3: dots_rows<3>(qs, kr, w.lim[r0], d, ss); break;
        default: dots_rows<4>(qs, kr, w.lim[r0], d, ss); break;
      }
    }
    if (bd.cap > 0.f) {
      for (int64_t r = 0; r < rows; ++r) hta::soft_cap(w.s.data() + r * kBlockKeys, w.lim[r], bd.cap);
    }
    for (int64_t r = 0; r < rows; ++r) {  // online softmax: p = exp(s - m) in place
      const int64_t n = w.lim[r];
      if (n == 0) continue;
      float* s = w.s.data() + r * kBlockKeys;
      const float m_new = std::max(w.m[r], vmax(s, n));
      const float alpha = w.m[r] == kNegInf ? 0.f : std::exp(w.m[r] - m_new);
      w.l[r] = w.l[r] * alpha + exp_shifted(s, s, m_new, n);
      w.m[r] = m_new;
      w.alpha[r] = alpha;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += g) {  // acc = acc * alpha + p V; the g rows of a token and KV head
      const int64_t n = w.lim[r0];            // share their V rows, beg and lim
      if (n == 0) continue;
      const scalar_t* const* vr = vrow.data() + (r0 % gh) / g * kBlockKeys + w.beg[r0];
      if (!shared_pv) {
        for (int64_t r = r0; r < r0 + g; ++r) {
          scale_add_rows(acc + r * d, w.alpha[r], w.s.data() + r * kBlockKeys, vr, n, d);
        }
        continue;
      }
      float* accs[4];
      const float* ps[4];
      for (int64_t u = 0; u < g; ++u) {
        accs[u] = acc + (r0 + u) * d;
        ps[u] = w.s.data() + (r0 + u) * kBlockKeys;
      }
      const float* al = w.alpha.data() + r0;
      const auto tile = [&](auto rows_c, auto nv_c) {
        scale_add_tile<decltype(rows_c)::value, decltype(nv_c)::value>(accs, al, ps, vr, n, 0);
      };
      const auto by_width = [&](auto rows_c) {
        if (d == 2 * kVL) tile(rows_c, std::integral_constant<int, 2>{});
        else if (d == 4 * kVL) tile(rows_c, std::integral_constant<int, 4>{});
        else tile(rows_c, std::integral_constant<int, 8>{});
      };
      switch (g) {
        case 1: by_width(std::integral_constant<int, 1>{}); break;
        case 2: by_width(std::integral_constant<int, 2>{}); break;
        case 3: by_width(std::integral_constant<int, 3>{}); break;
        default: by_width(std::integral_constant<int, 4>{}); break;
      }
    }
    pos += nk;
  }
}

struct Partials {
  float* o;    // [R, Hq, D]
  float* lse;  // [R, Hq]
};

// Phase 1 item through the tile kernel (tile_attention.h), KV head h: the g query heads of each token folded
// into the rows, so the head's keys are read once by matrix products for all of them.
template <typename q_t, typename scalar_t>
void tile_piece(const hsa::StepAttention& a, const Item& it, int64_t part_row, int64_t h, const Partials& part) {
  const int64_t g = a.g_, d = a.d_, hq = a.hq_;
  const hta::TileJob job{.tok_lo = it.tok_lo, .nt = it.tok_hi - it.tok_lo, .g = g, .hq0 = h * g,
                         .run_lo = it.run_lo, .first = it.first, .total = it.total, .q_t = a.q_.stride(0),
                         .q_h = a.q_.stride(1), .k_s = a.k_.stride(0), .v_s = a.v_.stride(0),
                         .o = part.o + (part_row * hq + h * g) * d, .lse = part.lse + part_row * hq + h * g,
                         .o_t = hq * d, .lse_t = hq, .tok_first = a.first_, .kpos = it.kpos,
                         .cap = static_cast<float>(a.softcap_)};
  hta::tile_attention(a.q_.const_data_ptr<q_t>(), reinterpret_cast<const scalar_t*>(a.kp_) + h * a.k_.stride(1),
                      reinterpret_cast<const scalar_t*>(a.vp_) + h * a.v_.stride(1), a.rp_, job, d,
                      static_cast<float>(a.scale_));
}

// Phase 1 item through attend() (KV heads h .. h + nh - 1): writes the normalised partial and its
// log-sum-exp.
template <typename q_t, typename scalar_t>
void own_piece(const q_t* q, const scalar_t* k, const scalar_t* v, const Strides& st, const int64_t* runs,
               const Item& it, int64_t part_row, int64_t h, int64_t nh, int64_t hq, int64_t g, int64_t d,
               float scale, const Bounds& bd, const Partials& part, Scratch& w) {
  attend(q, k, v, st, runs, it, h, nh, g, d, scale, bd, w);
  const int64_t gh = g * nh, rows = (it.tok_hi - it.tok_lo) * gh;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t idx = (part_row + r / gh) * hq + h * g + r % gh;
    const float l = w.l[r];
    const float inv = l != 0.f ? 1.f / l : 0.f;  // l is 0 where no key is seen, NaN where a NaN was read
    float* dst = part.o + idx * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = w.acc[r * d + i] * inv;
    part.lse[idx] = l != 0.f ? w.m[r] + std::log(l) : kNegInf;
  }
}

// Phase 2 item: a block of segment tokens (KV heads h .. h + nh - 1); folds in every partial covering each
// token, writes the output.
template <typename q_t, typename scalar_t>
void segment_block(const q_t* q, const scalar_t* k, const scalar_t* v, q_t* out, const Strides& st,
                   const int64_t* runs, const Item& it, const int64_t* tok_ptr, const int64_t* tok_parts,
                   int64_t h, int64_t nh, int64_t hq, int64_t g, int64_t d, float scale, const Bounds& bd,
                   const Partials& part, Scratch& w) {
  attend(q, k, v, st, runs, it, h, nh, g, d, scale, bd, w);
  const int64_t gh = g * nh, rows = (it.tok_hi - it.tok_lo) * gh;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.tok_lo + r / gh, head = h * g + r % gh;
    float* a = w.acc.data() + r * d;
    // The fold starts from the chunk that holds the token's last key, normalised exactly as own_piece writes
    // a partial: its own keys here, or, when it has none here, the last piece it sees (a token of a longer
    // segment, whose last chunk a piece read); then the other chunks in key order. So a token's output is
    // the same fold of the same chunks whether its last chunk was read here or by a piece, which makes a
    // verified draft's row (a token of a longer segment) bit for bit a decode row's.
    const float l_own = w.l[r];
    const float inv_own = l_own != 0.f ? 1.f / l_own : 0.f;
    const float lse_own = l_own != 0.f ? w.m[r] + std::log(l_own) : kNegInf;
    int64_t first = -1;  // the piece to start from when the token has no keys of its own here
    if (lse_own == kNegInf) {
      for (int64_t e = tok_ptr[t + 1] - 1; e >= tok_ptr[t] && first < 0; --e) {
        if (part.lse[tok_parts[e] * hq + head] != kNegInf) first = e;
      }
    }
    float m = kNegInf, l = 0.f;
    if (lse_own != kNegInf) {
      for (int64_t i = 0; i < d; ++i) a[i] = a[i] * inv_own;
      m = lse_own, l = 1.f;
    } else if (first >= 0) {
      const int64_t idx = tok_parts[first] * hq + head;
      std::copy(part.o + idx * d, part.o + (idx + 1) * d, a);
      m = part.lse[idx], l = 1.f;
    }
    for (int64_t e = tok_ptr[t]; e < tok_ptr[t + 1]; ++e) {
      const int64_t idx = tok_parts[e] * hq + head;
      const float lse = part.lse[idx];
      if (e == first || lse == kNegInf) continue;
      const float m_new = std::max(m, lse);
      const float alpha = m == kNegInf ? 0.f : std::exp(m - m_new);
      const float beta = std::exp(lse - m_new);
      const float* o = part.o + idx * d;
      scale_add_rows(a, alpha, &beta, &o, 1, d);
      l = l * alpha + beta;
      m = m_new;
    }
    q_t* dst = out + (t * hq + head) * d;
    const float inv = l != 0.f ? 1.f / l : 0.f;  // l is 0 where no key is seen, NaN where a NaN was read
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<q_t>(a[i] * inv);
  }
}

// Runs first(i) for i in [0, n1), then second(i) for i in [0, n2), on all threads in one parallel region:
// items are handed out one at a time in order (the build sorts them most expensive first, so uneven items
// still balance), and a thread that finds the first phase handed out waits until it is done (a phase-2 block
// reads phase-1 partials) rather than ending the region and forking a second one.
template <typename F1, typename F2>
void for_each_item(int64_t n1, const F1& first, int64_t n2, const F2& second) {
  const int64_t jobs = std::max(n1, n2);
  if (jobs == 0) return;
  std::atomic<int64_t> next1{0}, done1{0}, next2{0};
  std::atomic<bool> failed{false};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), jobs), 1, [&](int64_t, int64_t) {
    for (int64_t i = next1++; i < n1; i = next1++) {
      struct Done {  // counted even if the item throws, so no thread waits forever
        std::atomic<int64_t>& n;
        ~Done() { n.fetch_add(1, std::memory_order_release); }
      } done{done1};
      try {
        first(i);
      } catch (...) {
        failed = true;  // phase 2 would read partials never written; parallel_for rethrows this
        throw;
      }
    }
    while (done1.load(std::memory_order_acquire) < n1) std::this_thread::yield();
    for (int64_t i = next2++; i < n2 && !failed; i = next2++) second(i);
  });
}

inline Strides strides_of(const hsa::StepAttention& a) {
  return {a.q_.stride(0), a.q_.stride(1), a.k_.stride(0), a.k_.stride(1), a.v_.stride(0), a.v_.stride(1)};
}

inline Bounds bounds_of(const hsa::StepAttention& a) { return {a.first_, static_cast<float>(a.softcap_)}; }

template <typename q_t, typename scalar_t>
void piece_item(const hsa::StepAttention& a, int64_t i) {
  const int64_t* row = a.pp_ + kPieceFields * (i / a.hkv_);
  const Item it = item_at(row, kPieceFields);
  const int64_t nt = it.tok_hi - it.tok_lo;
  const int64_t keys = std::min(it.first + nt - 1, it.total);
  const Partials part{a.part_o_.data_ptr<float>(), a.part_lse_.data_ptr<float>()};
  if (row[7] && a.tile_min_rows_ >= 0 && nt * a.g_ >= a.tile_min_rows_ && keys >= a.tile_min_keys_) {
    tile_piece<q_t, scalar_t>(a, it, row[6], i % a.hkv_, part);
  } else if (i % a.hkv_ == 0) {
    own_piece<q_t, scalar_t>(a.q_.const_data_ptr<q_t>(), reinterpret_cast<const scalar_t*>(a.kp_),
                             reinterpret_cast<const scalar_t*>(a.vp_), strides_of(a), a.rp_, it, row[6], 0, a.hkv_,
                             a.hq_, a.g_, a.d_, static_cast<float>(a.scale_), bounds_of(a), part,
                             thread_scratch(a.rows_, a.d_));
  }
}

// Phase 2 item i: a block of segment tokens, every KV head.
template <typename q_t, typename scalar_t>
void block_item(const hsa::StepAttention& a, int64_t i) {
  const Partials part{a.part_o_.data_ptr<float>(), a.part_lse_.data_ptr<float>()};
  segment_block<q_t, scalar_t>(a.q_.const_data_ptr<q_t>(), reinterpret_cast<const scalar_t*>(a.kp_),
                               reinterpret_cast<const scalar_t*>(a.vp_), a.out_.data_ptr<q_t>(), strides_of(a), a.rp_,
                               item_at(a.bp_ + kBlockFields * i, kBlockFields), a.tp_, a.tq_, 0, a.hkv_, a.hq_, a.g_,
                               a.d_, static_cast<float>(a.scale_), bounds_of(a), part, thread_scratch(a.rows_, a.d_));
}

at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& runs,
                          const at::Tensor& pieces, const at::Tensor& blocks, const at::Tensor& tok_ptr,
                          const at::Tensor& tok_parts, int64_t num_parts, int64_t max_item_tokens,
                          int64_t tile_min_rows, int64_t tile_min_keys, double scale, const at::Tensor& tok_first,
                          double softcap) {
  const hsa::StepAttention job(q, k, v, runs, pieces, blocks, tok_ptr, tok_parts, num_parts, max_item_tokens,
                               tile_min_rows, tile_min_keys, scale, tok_first, softcap);
  for_each_item(
      job.num_pieces(), [&](int64_t i) { job.piece(i); }, job.num_blocks(), [&](int64_t i) { job.block(i); });
  return job.out();
}

}  // namespace

namespace hsa {

StepAttention::StepAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& runs,
                             const at::Tensor& pieces, const at::Tensor& blocks, const at::Tensor& tok_ptr,
                             const at::Tensor& tok_parts, int64_t num_parts, int64_t max_item_tokens,
                             int64_t tile_min_rows, int64_t tile_min_keys, double scale, const at::Tensor& tok_first,
                             double softcap)
    : q_(q), scale_(scale), softcap_(softcap) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "step_attention: CPU tensors");
  TORCH_CHECK(k.dim() == v.dim() && (k.dim() == 3 || k.dim() == 4) && k.sizes() == v.sizes(),
              "step_attention: k/v must be [S, Hkv, D] (or every layer's, [L, S, Hkv, D]) of one shape");
  if (k.dim() == 4) {
    TORCH_CHECK(k.size(0) > 0, "step_attention: a pool of no layers");
    k_pool_ = k;
    v_pool_ = v;
    k_ = k.select(0, 0);
    v_ = v.select(0, 0);
  } else {
    k_ = k;
    v_ = v;
  }
  TORCH_CHECK(q.dim() == 3, "step_attention: q [T, Hq, D], k/v [S, Hkv, D]");
  TORCH_CHECK(q.stride(2) == 1 && k_.stride(2) == 1 && v_.stride(2) == 1, "step_attention: head dim must be dense");
  TORCH_CHECK(k_.size(2) == q.size(2), "step_attention: k/v shapes differ from q's");
  // The KV pool may be narrower than the activations (a 16-bit cache under float32 compute): its rows are
  // widened to float32 as they are read, as 16-bit rows always were.
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "step_attention: k and v must share one dtype");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() || q.scalar_type() == at::kFloat,
              "step_attention: k/v must have q's dtype, or q must be float32 (a 16-bit KV cache), got q ",
              q.scalar_type(), " and k/v ", k.scalar_type());
  const int64_t t = q.size(0);
  hq_ = q.size(1);
  d_ = q.size(2);
  hkv_ = k_.size(1);
  TORCH_CHECK(hkv_ > 0 && hq_ % hkv_ == 0, "step_attention: Hq must be a multiple of Hkv");
  for (const at::Tensor* x : {&runs, &pieces, &blocks, &tok_ptr, &tok_parts, &tok_first}) {
    TORCH_CHECK(x->scalar_type() == at::kLong && x->is_contiguous() && x->device().is_cpu(),
                "step_attention: metadata must be contiguous int64 CPU tensors");
  }
  TORCH_CHECK(pieces.size(1) == kPieceFields && blocks.size(1) == kBlockFields && tok_ptr.numel() == t + 1,
              "step_attention: metadata shapes do not match");
  TORCH_CHECK(tok_first.numel() == 0 || tok_first.numel() == t,
              "step_attention: tok_first holds a first visible position per token, or nothing (no window)");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "step_attention: softcap must be finite and >= 0 (0: off)");
  first_ = tok_first.numel() ? tok_first.const_data_ptr<int64_t>() : nullptr;
  g_ = hq_ / hkv_;
  out_ = at::empty({t, hq_, d_}, q.options());
  part_o_ = at::empty({num_parts, hq_, d_}, q.options().dtype(at::kFloat));
  part_lse_ = at::empty({num_parts, hq_}, q.options().dtype(at::kFloat));
  rp_ = runs.const_data_ptr<int64_t>();
  pp_ = pieces.const_data_ptr<int64_t>();
  bp_ = blocks.const_data_ptr<int64_t>();
  tp_ = tok_ptr.const_data_ptr<int64_t>();
  tq_ = tok_parts.const_data_ptr<int64_t>();
  n_pieces_ = pieces.size(0) * hkv_;
  n_blocks_ = blocks.size(0);
  // attend() takes every KV head of an item at once: a slot's K (and V) rows of all heads are one
  // contiguous read, where one head per item read a third of each slot's bytes at a stride.
  rows_ = std::max<int64_t>(1, max_item_tokens) * hq_;
  tile_min_rows_ = tile_min_rows;
  tile_min_keys_ = tile_min_keys;
  kp_ = static_cast<const char*>(k_.const_data_ptr());
  vp_ = static_cast<const char*>(v_.const_data_ptr());
  const auto pick = [&](auto q_zero, auto kv_zero) {
    using q_t = decltype(q_zero);
    using scalar_t = decltype(kv_zero);
    piece_fn_ = &piece_item<q_t, scalar_t>;
    block_fn_ = &block_item<q_t, scalar_t>;
  };
  // k's dtype picks the kernel; q has it too, or is float32 over a 16-bit cache (checked above)
  const bool wide_q = q.scalar_type() != k.scalar_type();
  switch (k.scalar_type()) {
    case at::kFloat: pick(float{}, float{}); break;
    case at::kBFloat16: wide_q ? pick(float{}, at::BFloat16{}) : pick(at::BFloat16{}, at::BFloat16{}); break;
    case at::kHalf: wide_q ? pick(float{}, at::Half{}) : pick(at::Half{}, at::Half{}); break;
    default:
      TORCH_CHECK(false, "step_attention: q and k/v must be float32, bfloat16 or float16, got q ", q.scalar_type(),
                  " and k/v ", k.scalar_type());
  }
}

void StepAttention::set_layer(int64_t layer) {
  TORCH_CHECK(k_pool_.defined() && layer >= 0 && layer < k_pool_.size(0), "step_attention: no layer ", layer);
  const int64_t elem = k_pool_.element_size();
  kp_ = static_cast<const char*>(k_pool_.const_data_ptr()) + layer * k_pool_.stride(0) * elem;
  vp_ = static_cast<const char*>(v_pool_.const_data_ptr()) + layer * v_pool_.stride(0) * elem;
}

}  // namespace hsa

TORCH_LIBRARY(hydragen, m) {
  m.def(
      "step_attention(Tensor q, Tensor k, Tensor v, Tensor runs, Tensor pieces, Tensor blocks, Tensor tok_ptr, "
      "Tensor tok_parts, int num_parts, int max_item_tokens, int tile_min_rows, int tile_min_keys, "
      "float scale, Tensor tok_first, float softcap) -> Tensor");
  m.impl("step_attention", c10::DispatchKey::CPU, &step_attention);
  m.def("vec_capability() -> str", [] { return std::string(HYDRAGEN_VEC_CAPABILITY); });
}
