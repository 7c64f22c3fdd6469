// Truncated sampling (min_p / top_k / top_p survivors, then the top_p cut, then an inverse-CDF draw) on
// CPU, one row per task. engine/truncation.py defines the distribution and is this op's twin and oracle:
// the same fixed-point masses (floor(p * 2**36)), the same levels (fp32 exponent and 3 mantissa bits), the
// same tie rule, the same candidate sets and the same 24-bit draw, so both give the same token for every
// row. The twin pays many small tensor ops, and large gathers when the nucleus is wide; here a row is:
//   1. its largest probability, from its 64-token blocks' maxima (the caller has them already);
//   2. the candidates: tokens at or above a threshold, read only in blocks whose maximum reaches it (a
//      restricted row's survivor threshold; for a top_p-only row, just above its 64th best block maximum,
//      then, if those hold less than top_p of the mass, every token): their levels noted and their masses
//      summed per level;
//   3. the candidates of the level the top_p cut falls in, sorted by probability to decide each one;
//   4. the draw: the kept tokens' masses accumulated in token order until they pass the row's target.
// Rows never interact, so a row's token cannot depend on the batch.
//
// sample_step is the whole of engine/sampler.py's Sampler.sample (without logprobs) in one call: the same
// softmax (ATen's, on the same scaled logits), the caller's uniforms, and per row an argmax (greedy),
// an inverse CDF over the whole vocabulary (the fp32 CDF accumulated in double, as torch.cumsum does), or
// the truncated draw above. At batch 1 the Python version is ~25 small tensor ops around the softmax, each
// a few microseconds with cold caches: more than the arithmetic.

#include "aten_vec.h"  // before any ATen header

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int kLevels = 256;  // engine/truncation.py: _LEVELS
constexpr int kLevelShift = 20;  // _LEVEL_SHIFT
constexpr double kMassScale = 68719476736.0;  // MASS_SCALE = 2**36

inline int32_t level_bits(float p) {
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  return bits >> kLevelShift;
}

// floor(p * 2**36) for 0 <= p <= 1: scaling by a power of two is exact in fp32, and the conversion truncates.
inline int64_t mass_of(float p) { return static_cast<int64_t>(p * 68719476736.0f); }

constexpr int64_t kBlock = 64;  // BLOCK
constexpr int64_t kFirstK = 64;  // FIRST_K

struct AtCut {
  float p;
  int64_t mass;
  bool kept;
};

struct RowScratch {
  std::vector<int16_t> level;
  std::vector<float> sorted_max;
  std::vector<AtCut> cut_tokens;
  std::vector<int32_t> order;
};

// One row: probs [vocab] (padding below 0 never survives) and its blocks' maxima [blocks] (torch's amax,
// NaN where the block holds a NaN), survivors p >= survive (0 for a free row).
int64_t draw_row(const float* probs, const float* block_max, int64_t vocab, float survive, bool free_row,
                 float top_p, int64_t bits, RowScratch& w) {
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  float pmax = block_max[0];
  bool finite = true;
  for (int64_t b = 0; b < blocks; ++b) {
    pmax = std::max(pmax, block_max[b]);
    finite &= block_max[b] == block_max[b];
  }
  // NaN probabilities (from NaN logits) have no distribution to draw from: an impossible token, which the
  // model runner turns into an error for this row alone.
  if (!finite || !(pmax > 0)) return -1;
  const int32_t top_level = level_bits(pmax);
  auto level_of = [&](float p) { return std::min<int32_t>(top_level - level_bits(p), kLevels - 1); };

  // Candidates: p >= tau, read only in blocks whose maximum reaches tau.
  auto for_each_hot_block = [&](float tau, auto&& fn) {
    for (int64_t b = 0; b < blocks; ++b) {
      if (block_max[b] >= tau && fn(b * kBlock, std::min(vocab, (b + 1) * kBlock))) return;
    }
  };

  float tau = survive;
  if (free_row && blocks > kFirstK) {  // first try the tokens above the FIRST_K-th best block maximum
    w.sorted_max.assign(block_max, block_max + blocks);
    std::nth_element(w.sorted_max.begin(), w.sorted_max.begin() + (kFirstK - 1), w.sorted_max.end(),
                     std::greater<float>());
    tau = std::nextafter(w.sorted_max[kFirstK - 1], 2.0f);
  }
  w.level.resize(vocab);
  int16_t* level = w.level.data();  // a candidate's level, -1 for a non-candidate (in the hot blocks)
  std::array<int64_t, kLevels> inclusive;
  double limit = 0;
  for (;;) {
    // Four interleaved histograms: neighbouring tokens often share a level, and one histogram would chain
    // every add on the previous one's store.
    std::array<std::array<int64_t, kLevels>, 4> parts{};
    for_each_hot_block(tau, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const float p = probs[i];
        const bool candidate = p >= tau;
        const int16_t l = static_cast<int16_t>(level_of(p));
        level[i] = candidate ? l : int16_t{-1};
        parts[i & 3][l] += candidate ? mass_of(p) : 0;
      }
      return false;
    });
    int64_t total = 0;
    for (int l = 0; l < kLevels; ++l) {
      total += parts[0][l] + parts[1][l] + parts[2][l] + parts[3][l];
      inclusive[l] = total;
    }
    limit = static_cast<double>(top_p) * (free_row ? kMassScale : static_cast<double>(total));
    // A free row's candidates settle it when they hold top_p of the mass: every other token has at least
    // that much above it. Otherwise, every token.
    if (!free_row || tau <= 0 || static_cast<double>(total) >= limit) break;
    tau = 0;  // every token (the twin's lower floors first would give the same token; they cost a pass each)
  }
  int cut = kLevels;  // none passes the limit: every level is kept
  for (int l = 0; l < kLevels; ++l) {
    if (static_cast<double>(inclusive[l]) > limit) {
      cut = l;
      break;
    }
  }

  // The cut level's candidates, in token order, then by probability (largest first, ties in token order).
  auto& cut_tokens = w.cut_tokens;
  cut_tokens.clear();
  if (cut < kLevels) {
    for_each_hot_block(tau, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        if (level[i] == cut) cut_tokens.push_back({probs[i], mass_of(probs[i]), false});
      }
      return false;
    });
  }
  const size_t at_cut = cut_tokens.size();
  auto& order = w.order;
  order.resize(at_cut);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return cut_tokens[a].p > cut_tokens[b].p; });
  const int64_t levels_above = cut > 0 && cut < kLevels ? inclusive[cut - 1] : 0;
  int64_t kept_at_cut = 0, before = 0, tie_before = 0;
  for (size_t j = 0; j < order.size(); ++j) {
    AtCut& t = cut_tokens[order[j]];
    if (j == 0 || t.p != cut_tokens[order[j - 1]].p) tie_before = before;  // tied tokens share the mass above
    t.kept = t.mass > 0 && static_cast<double>(levels_above + tie_before) < limit;
    if (t.kept) kept_at_cut += t.mass;
    before += t.mass;
  }

  // The draw: the kept tokens' masses in token order (levels above the cut whole, the cut level as decided).
  const int64_t kept_total = (cut < kLevels ? levels_above : inclusive[kLevels - 1]) + kept_at_cut;
  if (kept_total <= 0) return -1;
  const int64_t target = ((2 * bits + 1) * kept_total) >> 25;
  int64_t cumulative = 0, picked = -1;
  size_t next_at_cut = 0;
  for_each_hot_block(tau, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int16_t l = level[i];
      if (l < 0 || l > cut) continue;
      if (l == cut && !cut_tokens[next_at_cut++].kept) continue;
      cumulative += mass_of(probs[i]);
      if (cumulative > target) {  // first true at a kept token with mass: the draw
        picked = i;
        return true;
      }
    }
    return false;
  });
  return picked;  // the last kept token only if the target were not below the kept mass (it always is)
}

at::Tensor sample_truncated(const at::Tensor& probs, const at::Tensor& maxima, const at::Tensor& survive,
                            const at::Tensor& free_rows, const at::Tensor& top_p, const at::Tensor& bits) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "sample_truncated: probs must be a contiguous float32 [rows, vocab] tensor");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(maxima.dim() == 2 && maxima.scalar_type() == at::kFloat && maxima.is_contiguous() &&
                  maxima.size(0) == rows && maxima.size(1) == (vocab + kBlock - 1) / kBlock,
              "sample_truncated: maxima must be a contiguous float32 [rows, vocab / 64] tensor");
  for (const at::Tensor* t : {&survive, &free_rows, &top_p, &bits}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->is_contiguous(),
                "sample_truncated: per-row tensors must be contiguous [rows]");
  }
  TORCH_CHECK(survive.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  free_rows.scalar_type() == at::kBool && bits.scalar_type() == at::kLong,
              "sample_truncated: survive/top_p float32, free bool, bits int64");
  at::Tensor tokens = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* pp = probs.const_data_ptr<float>();
  const float* mp = maxima.const_data_ptr<float>();
  const float* sp = survive.const_data_ptr<float>();
  const bool* fp = free_rows.const_data_ptr<bool>();
  const float* tp = top_p.const_data_ptr<float>();
  const int64_t* bp = bits.const_data_ptr<int64_t>();
  const int64_t blocks = maxima.size(1);
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    RowScratch scratch;
    for (int64_t r = lo; r < hi; ++r) {
      // A free row's survivors are every real token: p >= 0 (the padding is negative).
      const float s = fp[r] ? 0.0f : sp[r];
      out[r] = draw_row(pp + r * vocab, mp + r * blocks, vocab, s, fp[r], tp[r], bp[r], scratch);
    }
  });
  return tokens;
}

// The greedy token: the first maximum, or -1 (an impossible token, which the model runner reports as the row's
// error) when the row holds a NaN, as Sampler._argmax.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return -1;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// Sampler._draw_plain on one row: cdf = cumsum(probs) in fp32 accumulated in double (torch.cumsum on CPU),
// target = min(u * total, the float below total), the first token whose cdf passes it (searchsorted right).
int64_t draw_plain_row(const float* probs, int64_t n, int64_t bits) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += probs[i];
  const float total = static_cast<float>(acc);
  // NaN probabilities: no distribution. Past the end, as torch.searchsorted gives; the model runner
  // reports the row.
  if (!(total > 0)) return n;
  const float u = (static_cast<float>(bits) + 0.5f) * (1.0f / 16777216.0f);
  const float target = std::min(u * total, std::nextafter(total, 0.0f));
  acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc += probs[i];
    if (static_cast<float>(acc) > target) return i;
  }
  return n;  // not reached: the last cdf value is total > target
}

// The k-th largest of probs [n] (k >= 1): the k blocks with the largest maxima hold it (truncation.py's
// top_values), so only those are searched when that is much less than the row.
float kth_largest(const float* probs, const float* block_max, int64_t n, int64_t k, RowScratch& w) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<float>& pool = w.sorted_max;
  pool.clear();
  if (k * kBlock * 4 > n) {
    pool.assign(probs, probs + n);
  } else {
    std::vector<int32_t>& ids = w.order;
    ids.resize(blocks);
    for (int64_t b = 0; b < blocks; ++b) ids[b] = static_cast<int32_t>(b);
    std::nth_element(ids.begin(), ids.begin() + (k - 1), ids.end(),
                     [&](int32_t a, int32_t b) { return block_max[a] > block_max[b]; });
    for (int64_t j = 0; j < k; ++j) {
      const int64_t lo = ids[j] * kBlock, hi = std::min(n, lo + kBlock);
      pool.insert(pool.end(), probs + lo, probs + hi);
    }
  }
  std::nth_element(pool.begin(), pool.begin() + (k - 1), pool.end(), std::greater<float>());
  return pool[k - 1];
}

// The row's 64-token blocks' maxima as torch.amax gives them (NaN where a block holds one), and the row's:
// full blocks a vector at a time (ATen's maximum propagates NaN as amax does), the last one element-wise.
float block_maxima(const float* probs, int64_t vocab, float* block_max) {
  using Vec = at::vec::Vectorized<float>;
  const auto amax = [](float a, float b) {
    return std::isnan(a) || std::isnan(b) ? std::numeric_limits<float>::quiet_NaN() : std::max(a, b);
  };
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  float pmax = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < blocks; ++b) {
    const float* p = probs + b * kBlock;
    float m = -std::numeric_limits<float>::infinity();
    if ((b + 1) * kBlock <= vocab && kBlock % Vec::size() == 0) {
      Vec acc = Vec::loadu(p);
      for (int64_t i = Vec::size(); i < kBlock; i += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(p + i));
      float lanes[Vec::size()];
      acc.store(lanes);
      for (const float x : lanes) m = amax(m, x);
    } else {
      for (int64_t i = 0; i < std::min(kBlock, vocab - b * kBlock); ++i) m = amax(m, p[i]);
    }
    block_max[b] = m;
    pmax = amax(pmax, m);
  }
  return pmax;
}

// Sampler.sample without logprobs. probs_out / scaled_out are [rows, vocab] work buffers the caller keeps
// between steps (fresh ones would be fresh pages from the OS every step).
at::Tensor sample_step(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& bits,
                       at::Tensor scaled_out, at::Tensor probs_out) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample_step: logits must be a contiguous float32 [rows, vocab] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_step: an empty vocabulary");
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &min_p, &bits}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->is_contiguous() && t->device().is_cpu(),
                "sample_step: per-row tensors must be contiguous [rows] CPU tensors");
  }
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && top_k.scalar_type() == at::kLong &&
                  bits.scalar_type() == at::kLong,
              "sample_step: temperature/top_p/min_p float32, top_k/bits int64");
  for (const at::Tensor* t : {&scaled_out, &probs_out}) {
    TORCH_CHECK(t->sizes() == logits.sizes() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "sample_step: work buffers must be contiguous float32 tensors shaped like logits");
  }
  const float* temp = temperature.const_data_ptr<float>();
  // Greedy rows are divided by 1 (their softmax is not used); the division is skipped when every row's
  // scale is 1, as in Sampler._softmax (x / 1 == x, so the probabilities are the same either way).
  bool all_one = true;
  for (int64_t r = 0; r < rows; ++r) all_one &= !(temp[r] > 0) || temp[r] == 1.0f;
  at::Tensor scaled = logits;
  if (!all_one) {
    at::Tensor scale = at::empty({rows, 1}, temperature.options());
    float* sc = scale.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) sc[r] = temp[r] > 0 ? temp[r] : 1.0f;
    scaled = at::div_out(scaled_out, logits, scale);
  }
  at::_softmax_out(probs_out, scaled, -1, false);

  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.const_data_ptr<float>();
  const float* pp = probs_out.const_data_ptr<float>();
  const int64_t* kp = top_k.const_data_ptr<int64_t>();
  const float* tp = top_p.const_data_ptr<float>();
  const float* mp = min_p.const_data_ptr<float>();
  const int64_t* bp = bits.const_data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    RowScratch scratch;
    std::vector<float> block_max(blocks);
    for (int64_t r = lo; r < hi; ++r) {
      if (!(temp[r] > 0)) {
        out[r] = argmax_row(lp + r * vocab, vocab);
        continue;
      }
      const float* probs = pp + r * vocab;
      const int64_t row_bits = bp[r];
      const bool top_k_on = kp[r] > 0 && kp[r] < vocab;
      if (!(tp[r] < 1) && !top_k_on && !(mp[r] > 0)) {
        out[r] = draw_plain_row(probs, vocab, row_bits);
        continue;
      }
      const float pmax = block_maxima(probs, vocab, block_max.data());
      if (std::isnan(pmax)) {
        out[r] = -1;
        continue;
      }
      float survive = pmax * mp[r];
      if (top_k_on) survive = std::max(survive, kth_largest(probs, block_max.data(), vocab, kp[r], scratch));
      const bool free_row = survive <= 0;
      out[r] = draw_row(probs, block_max.data(), vocab, free_row ? 0.0f : survive, free_row, tp[r], row_bits,
                        scratch);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydragen, m) {
  m.def(
      "sample_truncated(Tensor probs, Tensor maxima, Tensor survive, Tensor free, Tensor top_p, Tensor bits) "
      "-> Tensor");
  m.impl("sample_truncated", c10::DispatchKey::CPU, &sample_truncated);
  m.def(
      "sample_step(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor bits, "
      "Tensor(a!) scaled_out, Tensor(b!) probs_out) -> Tensor");
  m.impl("sample_step", c10::DispatchKey::CPU, &sample_step);
}
