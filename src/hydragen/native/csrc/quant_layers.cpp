// hydragen::quant_layers: every decoder layer of a model whose projections are all packed (GGUF kept
// quantized, float32 activations), in one call and one parallel region. Per layer it computes what
// DecoderModel.forward computes with the runner's attention callback, with the same functions:
//   qkv = quant_linear(h, norm = attn_norm), then its epilogue (bias, QK-norm, rotary: hq::QkvEpilogue);
//   pool_k/v[layer][slots] = k, v;
//   o = step_attention(q, pool_k[layer], pool_v[layer], the step's work items, scale and soft-cap);
//   h += o_proj(o);  h += down(swiglu(gate_up(norm(h))))
// or, with Gemma's sandwich norms and GeGLU, h += norm(o_proj(o)); h += norm(down(geglu(gate_up(norm(h))))),
// with the windowed layers' own rotary table where they have one (Gemma 3);
// so its result is bit for bit the per-op path's (tests/unit/model/test_quant_model.py, at 1, 2 and 3
// threads): every output row or tile is computed by one thread, whichever it is.
//
// Why one region: at batch 1 a small model's projections are a few hundred KB each, and a region per op (fork,
// join, the dispatcher, allocations), repeated ~6 times per layer, left the memory bus idle between streams; the
// layers ran at ~20 GB/s where a plain read of the same bytes runs at ~32. Here the threads go through the
// layers together, each taking its share of every stage (rows of the row-wise stages, output tiles of the
// projections, attention items from shared counters) and meeting at a spin barrier between stages. A thread
// done with its share of a projection helps with the others' (drain_tasks). h is updated in place and returned.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "quant_linear.h"
#include "step_attention.h"

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// Threads meet here between stages. A thread that fails sets `failed`; everyone then leaves (wait returns
// false) instead of waiting for it forever. Past a few thousand spins a waiter yields, in case the threads
// outnumber the free cores.
class SpinBarrier {
 public:
  explicit SpinBarrier(const std::atomic<bool>& failed) : failed_(failed) {}
  void set_threads(int threads) { threads_ = threads; }  // before anyone waits

  bool wait() {
    if (threads_ == 1) return !failed_.load(std::memory_order_relaxed);
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
    } else {
      for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
        if (failed_.load(std::memory_order_relaxed)) return false;
        if (spins < 4096) cpu_relax();
        else std::this_thread::yield();
      }
    }
    return !failed_.load(std::memory_order_relaxed);
  }

 private:
  int threads_ = 1;
  const std::atomic<bool>& failed_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> phase_{0};
};

// [begin, end) of n split evenly over the threads: thread `tid` of `threads` takes its own slice.
struct Share {
  int64_t begin, end;
  Share(int64_t n, int tid, int threads) : begin(n * tid / threads), end(n * (tid + 1) / threads) {}
};

// One projection's tasks, each thread starting on its own contiguous share (its cursor) and taking it in
// chunks; a thread whose share is done takes chunks of the others' shares, so threads that stream at unequal
// speeds finish a projection together. On the 1B shape at batch 1 fixed halves finished 20-45 us apart per
// projection (1.3-1.6 ms of waiting in a 31 ms step); with help the decode ran 4 % faster (paired median of
// 14 alternating rounds; the 8B shape 2 %, the embedded model within the noise). The owner's counter stays in
// its own cache line, so a chunk costs an uncontended atomic until someone helps.
struct alignas(64) TaskCursor {
  std::atomic<int64_t> next{0};
  int64_t end = 0, chunk = 2;
};

// Sets `threads` cursors for `total` tasks: even chunks of about a 32nd of a share (pairs stay whole).
inline void share_tasks(TaskCursor* c, int threads, int64_t total) {
  for (int i = 0; i < threads; ++i) {
    const Share s(total, i, threads);
    c[i].next.store(s.begin, std::memory_order_relaxed);
    c[i].end = s.end;
    c[i].chunk = std::max<int64_t>(2, (s.end - s.begin) / 64 * 2);
  }
}

template <class Fn>
inline void drain_tasks(TaskCursor* c, int threads, int tid, const Fn& run) {
  for (int i = 0; i < threads; ++i) {
    TaskCursor& mine = c[(tid + i) % threads];
    for (int64_t b = mine.next.fetch_add(mine.chunk, std::memory_order_relaxed); b < mine.end;
         b = mine.next.fetch_add(mine.chunk, std::memory_order_relaxed))
      run(b, std::min(b + mine.chunk, mine.end));
  }
}

// One row of k or v (float32) into the pool's row, in the pool's dtype: finite values rounded to nearest
// even, as Tensor.to rounds them (a NaN's payload may differ; such a request fails at sampling anyway).
template <typename kv_t>
inline void store_row(const float* src, void* dst, int64_t n) {
  kv_t* out = static_cast<kv_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<kv_t>(src[i]);
}

using StoreRow = void (*)(const float*, void*, int64_t);

at::Tensor quant_layers(const at::Tensor& h, const at::Tensor& rope_cos, const at::Tensor& rope_sin, int64_t rope_cols,
                        at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef rows, at::IntArrayRef counts,
                        at::TensorList norms, at::TensorList qkv_biases, at::TensorList head_norms,
                        at::TensorList post_norms, int64_t activation, const c10::optional<at::Tensor>& local_cos,
                        const c10::optional<at::Tensor>& local_sin, at::IntArrayRef local_layers, double eps,
                        const at::Tensor& pool_k, const at::Tensor& pool_v,
                        at::TensorList group_slots, at::IntArrayRef layer_group, at::IntArrayRef layer_row,
                        int64_t num_heads, int64_t num_kv_heads, at::TensorList runs,
                        at::TensorList pieces, at::TensorList blocks, at::TensorList tok_ptr, at::TensorList tok_parts,
                        at::IntArrayRef num_parts, at::IntArrayRef max_item_tokens, at::TensorList tok_first,
                        at::IntArrayRef layer_meta, at::ArrayRef<double> scales, at::ArrayRef<double> softcaps,
                        int64_t tile_min_rows, int64_t tile_min_keys, int64_t act_bits, int64_t isa) {
  TORCH_CHECK(counts.size() % 4 == 0 && norms.size() == counts.size() / 2,
              "quant_layers: counts holds 4 part counts per layer (qkv, o, gate_up, down), norms 2 per layer");
  TORCH_CHECK(weights.size() == qtypes.size() && weights.size() == rows.size(),
              "quant_layers: weights, qtypes and rows must have one length");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "quant_layers: h must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(act_bits == 8 || act_bits == 15, "quant_layers: act_bits must be 8 or 15, got ", act_bits);
  const int64_t layers = static_cast<int64_t>(counts.size()) / 4;
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == layers,
              "quant_layers: qkv_biases holds none or one bias per layer");
  TORCH_CHECK(head_norms.empty() || static_cast<int64_t>(head_norms.size()) == 2 * layers,
              "quant_layers: head_norms holds none or a q and a k norm per layer");
  TORCH_CHECK(post_norms.empty() || static_cast<int64_t>(post_norms.size()) == 2 * layers,
              "quant_layers: post_norms holds none or an attention and an MLP output norm per layer");
  TORCH_CHECK(activation == 0 || activation == 1, "quant_layers: activation is 0 (SwiGLU) or 1 (GeGLU)");
  TORCH_CHECK(local_layers.empty() || static_cast<int64_t>(local_layers.size()) == layers,
              "quant_layers: local_layers holds none or a flag per layer");
  TORCH_CHECK(local_layers.empty() || (local_cos.has_value() && local_sin.has_value()),
              "quant_layers: local layers need their rotary tables");
  // The step's attention metadata per distinct layer mask (a window's has tok_first), and each layer's (with its
  // own scale and soft-cap).
  const size_t metas = runs.size();
  TORCH_CHECK(metas > 0 && pieces.size() == metas && blocks.size() == metas && tok_ptr.size() == metas &&
                  tok_parts.size() == metas && num_parts.size() == metas && max_item_tokens.size() == metas &&
                  tok_first.size() == metas,
              "quant_layers: runs, pieces, blocks, tok_ptr, tok_parts, num_parts, max_item_tokens and tok_first "
              "hold one entry per attention metadata");
  TORCH_CHECK(static_cast<int64_t>(layer_meta.size()) == layers && static_cast<int64_t>(scales.size()) == layers &&
                  static_cast<int64_t>(softcaps.size()) == layers,
              "quant_layers: layer_meta, scales and softcaps hold one entry per layer");
  for (const double cap : softcaps) TORCH_CHECK(cap >= 0 && std::isfinite(cap), "quant_layers: bad soft-cap ", cap);
  for (int64_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(layer_meta[layer] >= 0 && static_cast<size_t>(layer_meta[layer]) < metas, "quant_layers: layer ",
                layer, " names metadata ", layer_meta[layer], " of ", metas);
  }
  const auto pool_type = pool_k.scalar_type();
  TORCH_CHECK(static_cast<int64_t>(layer_group.size()) == layers && static_cast<int64_t>(layer_row.size()) == layers,
              "quant_layers: layer_group and layer_row hold one entry per layer");
  TORCH_CHECK(pool_k.dim() == 4 && pool_k.sizes() == pool_v.sizes() &&
                  pool_k.size(2) == num_kv_heads && pool_v.scalar_type() == pool_type &&
                  (pool_type == at::kFloat || pool_type == at::kBFloat16 || pool_type == at::kHalf),
              "quant_layers: pool_k/v must be float32, bfloat16 or float16 [rows, slots, kv heads, head dim]");
  const int64_t t = h.size(0), hidden = h.size(1), d = pool_k.size(3), qdim = num_heads * d,
                kvdim = num_kv_heads * d, qkv_cols = qdim + 2 * kvdim;
  TORCH_CHECK(pool_k.stride(3) == 1 && pool_k.stride(2) == d && pool_v.stride(3) == 1 && pool_v.stride(2) == d,
              "quant_layers: each slot's K and V rows must be dense");
  // Each KV group's slots (where its layers write the step's K/V), and each layer's group and pool row.
  std::vector<const int64_t*> slot_of_group;
  for (const at::Tensor& slots : group_slots) {
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == t,
                "quant_layers: slots must be contiguous int64 vectors with one slot per token");
    const int64_t* slot = slots.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_k.size(1), "quant_layers: slot ", slot[i], " is outside the ",
                  pool_k.size(1), " slots of the KV pool");
    }
    slot_of_group.push_back(slot);
  }
  for (int64_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(layer_group[layer] >= 0 && static_cast<size_t>(layer_group[layer]) < slot_of_group.size() &&
                    layer_row[layer] >= 0 && layer_row[layer] < pool_k.size(0),
                "quant_layers: layer ", layer, " names KV group ", layer_group[layer], " row ", layer_row[layer],
                " of ", slot_of_group.size(), " groups and ", pool_k.size(0), " rows");
  }
  hq::check_rope_tables(rope_cos, rope_sin, t, rope_cols, qkv_cols, "quant_layers", d);
  TORCH_CHECK(rope_cols == qdim + kvdim, "quant_layers: the rotary covers q and k (", qdim + kvdim,
              " columns), not ", rope_cols);
  if (!local_layers.empty()) {
    hq::check_rope_tables(*local_cos, *local_sin, t, rope_cols, qkv_cols, "quant_layers (local)", d);
    TORCH_CHECK(local_cos->size(1) == rope_cos.size(1), "quant_layers: both rotary tables rotate as many dims");
  }

  // Every projection planned (and checked) before any thread starts.
  struct LayerPlan {
    hq::LinearPlan qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm;
    const float *post_attn = nullptr, *post_mlp = nullptr;  // sandwich norms: on o's and down's outputs
    hq::QkvEpilogue epilogue;
  };
  std::vector<LayerPlan> plan(layers);
  size_t next = 0;  // the next part in weights/qtypes/rows
  const auto take = [&](int64_t n, int64_t k) {
    TORCH_CHECK(n > 0 && next + n <= weights.size(), "quant_layers: counts do not match the weights given");
    const size_t at = next;
    next += n;
    return hq::plan_linear(weights.slice(at, n), qtypes.slice(at, n), rows.slice(at, n), t, k, isa);
  };
  int64_t ffn = 0;
  for (int64_t layer = 0; layer < layers; ++layer) {
    LayerPlan& p = plan[layer];
    p.qkv = take(counts[4 * layer], hidden);
    p.o = take(counts[4 * layer + 1], qdim);
    p.gate_up = take(counts[4 * layer + 2], hidden);
    TORCH_CHECK(p.qkv.n_total == qkv_cols, "quant_layers: layer ", layer, " qkv gives ", p.qkv.n_total,
                " columns, the heads call for ", qkv_cols);
    TORCH_CHECK(p.o.n_total == hidden && p.gate_up.n_total % 2 == 0, "quant_layers: layer ", layer,
                " o or gate_up has the wrong number of outputs");
    ffn = std::max(ffn, p.gate_up.n_total / 2);
    p.down = take(counts[4 * layer + 3], p.gate_up.n_total / 2);
    TORCH_CHECK(p.down.n_total == hidden, "quant_layers: layer ", layer, " down gives ", p.down.n_total,
                " columns, not ", hidden);
    for (int j = 0; j < 2; ++j) {
      const at::Tensor& norm = norms[2 * layer + j];
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == hidden,
                  "quant_layers: norms must be contiguous float32 vectors of ", hidden);
    }
    p.attn_norm = norms[2 * layer].const_data_ptr<float>();
    p.mlp_norm = norms[2 * layer + 1].const_data_ptr<float>();
    hq::QkvEpilogue& e = p.epilogue;
    e.eps = eps;
    e.head_dim = d;
    e.q_cols = qdim;
    e.k_cols = kvdim;
    const bool local = !local_layers.empty() && local_layers[layer] != 0;
    e.cos = (local ? *local_cos : rope_cos).const_data_ptr<float>();
    e.sin = (local ? *local_sin : rope_sin).const_data_ptr<float>();
    e.rot = rope_cos.size(1);
    if (!post_norms.empty()) {
      for (int j = 0; j < 2; ++j) {
        const at::Tensor& norm = post_norms[2 * layer + j];
        TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == hidden,
                    "quant_layers: post norms must be contiguous float32 vectors of ", hidden);
      }
      p.post_attn = post_norms[2 * layer].const_data_ptr<float>();
      p.post_mlp = post_norms[2 * layer + 1].const_data_ptr<float>();
    }
    if (!qkv_biases.empty()) {
      const at::Tensor& bias = qkv_biases[layer];
      TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == qkv_cols,
                  "quant_layers: qkv biases must be contiguous float32 vectors of ", qkv_cols);
      e.bias = bias.const_data_ptr<float>();
    }
    if (!head_norms.empty()) {
      for (int j = 0; j < 2; ++j) {
        const at::Tensor& norm = head_norms[2 * layer + j];
        TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == d,
                    "quant_layers: head norms must be contiguous float32 vectors of ", d);
      }
      e.q_norm = head_norms[2 * layer].const_data_ptr<float>();
      e.k_norm = head_norms[2 * layer + 1].const_data_ptr<float>();
    }
  }
  TORCH_CHECK(next == weights.size(), "quant_layers: more weights given than counts name");

  // Buffers for the whole call, reused by every layer.
  const auto f32 = h.options();
  at::Tensor qkv = at::empty({t, qkv_cols}, f32);
  at::Tensor normed = at::empty({t, hidden}, f32);
  at::Tensor gate_up = at::empty({t, 2 * ffn}, f32);
  at::Tensor act = at::empty({t, ffn}, f32);
  at::Tensor side = at::empty({post_norms.empty() ? 0 : t, hidden}, f32);  // o's or down's output, to norm
  hq::QuantizedActs qa;
  const int bits = static_cast<int>(act_bits);
  hq::size_acts(t, std::max({hidden, qdim, ffn}), bits, qa);
  std::vector<hsa::StepAttention> attentions;  // one per metadata: its own output and partials
  attentions.reserve(metas);
  for (size_t m = 0; m < metas; ++m) {
    attentions.emplace_back(qkv.narrow(1, 0, qdim).view({t, num_heads, d}), pool_k, pool_v, runs[m], pieces[m],
                            blocks[m], tok_ptr[m], tok_parts[m], num_parts[m], max_item_tokens[m], tile_min_rows,
                            tile_min_keys, scales[0], tok_first[m], 0.0);
  }
  float* hp = h.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  float* np = normed.data_ptr<float>();
  float* gup = gate_up.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  float* sidep = side.data_ptr<float>();
  const auto range_activation = activation == 1 ? &hq::geglu_range : &hq::swiglu_range;
  StoreRow store = &store_row<float>;
  if (pool_type == at::kHalf) store = &store_row<c10::Half>;
  if (pool_type == at::kBFloat16) store = &store_row<c10::BFloat16>;
  const int64_t elem = pool_k.element_size();
  char* kbase = static_cast<char*>(pool_k.data_ptr());
  char* vbase = static_cast<char*>(pool_v.data_ptr());
  const int64_t k_layer = pool_k.stride(0) * elem, k_slot = pool_k.stride(1) * elem;
  const int64_t v_layer = pool_v.stride(0) * elem, v_slot = pool_v.stride(1) * elem;
  std::vector<std::atomic<int64_t>> taken(2 * layers);  // attention items handed out, per layer and phase
  for (auto& n : taken) n.store(0, std::memory_order_relaxed);

  std::atomic<bool> failed{false};
  std::exception_ptr error;
  SpinBarrier barrier(failed);
  const int threads = static_cast<int>(std::max(1, std::min(at::get_num_threads(), omp_get_max_threads())));
  // Each projection's task cursors, set before the region: OpenMP may give a smaller team (one thread when
  // nested), whose threads then take the missing threads' shares too.
  std::vector<TaskCursor> cursors(4 * layers * threads);
  for (int64_t layer = 0; layer < layers; ++layer) {
    const LayerPlan& p = plan[layer];
    const hq::LinearPlan* stages[4] = {&p.qkv, &p.o, &p.gate_up, &p.down};
    for (int j = 0; j < 4; ++j) share_tasks(&cursors[(4 * layer + j) * threads], threads, stages[j]->tasks());
  }
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads(), tid = omp_get_thread_num();
#pragma omp single
    barrier.set_threads(team);  // the team OpenMP gave (one thread when nested); single ends with a barrier
    const at::internal::ThreadIdGuard tid_guard(tid);
    const Share my_rows(t, tid, team);
    const auto matmul = [&](const hq::LinearPlan& p, const float* x, float* y, bool accumulate, int64_t stage) {
      drain_tasks(&cursors[stage * threads], threads, tid,
                  [&](int64_t begin, int64_t end) { hq::run_tasks(p, qa, x, y, accumulate, begin, end); });
    };
    const auto quantize = [&](const float* x, int64_t k, const hq::LinearPlan& next) {  // for next's packed parts
      if (next.any_packed) hq::quantize_acts(x, my_rows.begin, my_rows.end, k, bits, next.level, qa);
    };
    // h += norm(side) on this thread's rows (sandwich norms): no barrier after, the next stage reads its own rows
    const auto add_normed = [&](const float* w) {
      hq::rms_norm_range(sidep, w, eps, my_rows.begin, my_rows.end, hidden, sidep);
      for (int64_t i = my_rows.begin * hidden; i < my_rows.end * hidden; ++i) hp[i] += sidep[i];
    };
    try {
      for (int64_t layer = 0; layer < layers; ++layer) {
        const LayerPlan& p = plan[layer];
        // qkv = norm(h) @ W_qkv, with rotary on q and k; k and v written into the pool.
        hq::rms_norm_range(hp, p.attn_norm, eps, my_rows.begin, my_rows.end, hidden, np);
        quantize(np, hidden, p.qkv);
        if (!barrier.wait()) break;
        matmul(p.qkv, np, qkvp, false, 4 * layer);
        if (!barrier.wait()) break;
        hq::qkv_epilogue_range(qkvp, qkv_cols, my_rows.begin, my_rows.end, p.epilogue);
        const int64_t* slot = slot_of_group[layer_group[layer]];
        const int64_t pool_row = layer_row[layer];
        for (int64_t r = my_rows.begin; r < my_rows.end; ++r) {  // the engine gives each token its own slot
          const float* row = qkvp + r * qkv_cols + qdim;
          store(row, kbase + pool_row * k_layer + slot[r] * k_slot, kvdim);
          store(row + kvdim, vbase + pool_row * v_layer + slot[r] * v_slot, kvdim);
        }
        hsa::StepAttention& attention = attentions[layer_meta[layer]];
        if (tid == 0) {  // read by the items after the barrier
          attention.set_layer(pool_row);
          attention.scale_ = scales[layer];
          attention.softcap_ = softcaps[layer];
        }
        if (!barrier.wait()) break;
        // Attention: pieces, then blocks (which fold in the pieces' partials).
        std::atomic<int64_t>& next_piece = taken[2 * layer];
        std::atomic<int64_t>& next_block = taken[2 * layer + 1];
        for (int64_t i = next_piece++; i < attention.num_pieces(); i = next_piece++) attention.piece(i);
        if (!barrier.wait()) break;
        for (int64_t i = next_block++; i < attention.num_blocks(); i = next_block++) attention.block(i);
        if (!barrier.wait()) break;
        // h += o(attention)
        const float* attn_out = attention.out().const_data_ptr<float>();
        quantize(attn_out, qdim, p.o);
        if (!barrier.wait()) break;
        matmul(p.o, attn_out, p.post_attn ? sidep : hp, p.post_attn == nullptr, 4 * layer + 1);
        if (!barrier.wait()) break;
        if (p.post_attn != nullptr) add_normed(p.post_attn);
        // h += down(swiglu(gate_up(norm(h))))
        hq::rms_norm_range(hp, p.mlp_norm, eps, my_rows.begin, my_rows.end, hidden, np);
        quantize(np, hidden, p.gate_up);
        if (!barrier.wait()) break;
        matmul(p.gate_up, np, gup, false, 4 * layer + 2);
        if (!barrier.wait()) break;
        const int64_t half = p.gate_up.n_total / 2;
        range_activation(gup, my_rows.begin, my_rows.end, half, actp);
        quantize(actp, half, p.down);
        if (!barrier.wait()) break;
        matmul(p.down, actp, p.post_mlp ? sidep : hp, p.post_mlp == nullptr, 4 * layer + 3);
        if (!barrier.wait()) break;
        if (p.post_mlp != nullptr) add_normed(p.post_mlp);
      }
    } catch (...) {
#pragma omp critical(hydragen_quant_layers)
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  }
  if (error) std::rethrow_exception(error);
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydragen, m) {
  m.def(
      "quant_layers(Tensor h, Tensor rope_cos, Tensor rope_sin, int rope_cols, Tensor[] weights, int[] qtypes, "
      "int[] rows, int[] counts, Tensor[] norms, Tensor[] qkv_biases, Tensor[] head_norms, Tensor[] post_norms, "
      "int activation, Tensor? local_cos, Tensor? local_sin, int[] local_layers, float eps, Tensor pool_k, Tensor pool_v, Tensor[] group_slots, "
      "int[] layer_group, int[] layer_row, "
      "int num_heads, int num_kv_heads, Tensor[] runs, Tensor[] pieces, Tensor[] blocks, Tensor[] tok_ptr, "
      "Tensor[] tok_parts, int[] num_parts, int[] max_item_tokens, Tensor[] tok_first, int[] layer_meta, "
      "float[] scales, float[] softcaps, int tile_min_rows, int tile_min_keys, int act_bits, int isa) -> Tensor");
  m.impl("quant_layers", c10::DispatchKey::CPU, &quant_layers);
}
