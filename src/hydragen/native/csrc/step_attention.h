// One step's attention as a job whose items any thread may run: the op (step_attention.cpp) runs them in a
// parallel region of its own, and the layer stack (quant_layers.cpp) inside the one region that runs every
// layer of the step, moving the job from layer to layer with set_layer instead of building it again.
//
// Items come in two phases (step_attention.cpp documents them): every piece must be done before any block
// starts, since a block folds in the pieces' partials.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hsa {

class StepAttention {
 public:
  // q [T, Hq, D]; k, v [S, Hkv, D] (one layer's pool), or [L, S, Hkv, D] (every layer's; set_layer picks
  // one, layer 0 to start). Checks every shape and dtype; allocates the output and the partials.
  StepAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& runs,
                const at::Tensor& pieces, const at::Tensor& blocks, const at::Tensor& tok_ptr,
                const at::Tensor& tok_parts, int64_t num_parts, int64_t max_item_tokens, int64_t tile_min_rows,
                int64_t tile_min_keys, double scale, const at::Tensor& tok_first, double softcap);

  int64_t num_pieces() const { return n_pieces_; }  // phase 1
  int64_t num_blocks() const { return n_blocks_; }  // phase 2
  void piece(int64_t i) const { piece_fn_(*this, i); }
  void block(int64_t i) const { block_fn_(*this, i); }
  void set_layer(int64_t layer);  // a [L, S, Hkv, D] pool only
  const at::Tensor& out() const { return out_; }

  // Read by the item functions (step_attention.cpp).
  at::Tensor q_, k_, v_, out_, part_o_, part_lse_;  // k_, v_: layer 0's [S, Hkv, D], read for strides only
  at::Tensor k_pool_, v_pool_;                      // [L, S, Hkv, D], or undefined
  const char *kp_ = nullptr, *vp_ = nullptr;       // the current layer's first K / V row
  const int64_t *rp_, *pp_, *bp_, *tp_, *tq_;
  const int64_t* first_ = nullptr;  // a window: each token's first visible position (kept alive by the caller)
  int64_t n_pieces_, n_blocks_, hq_, hkv_, g_, d_, rows_, tile_min_rows_, tile_min_keys_;
  double scale_;
  double softcap_ = 0;  // 0: off

 private:
  using ItemFn = void (*)(const StepAttention&, int64_t);
  ItemFn piece_fn_, block_fn_;
};

}  // namespace hsa
