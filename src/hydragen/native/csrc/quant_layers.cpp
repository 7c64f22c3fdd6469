// hydragen::quant_layers: every decoder layer of a model whose projections are all packed (GGUF kept
// quantized, float32 activations), run in one call instead of one Python iteration per layer. Per layer it
// makes the same calls, in the same order, as LlamaModel.forward with the runner's attention callback:
//   qkv = quant_linear(h, norm = attn_norm, rope);  pool_k/v[layer][slots] = k, v;
//   o = step_attention(q, pool_k[layer], pool_v[layer], the step's work items);
//   h = quant_mlp_tail(o, h, ...)  (o + residual, RMSNorm, gate/up + SwiGLU, down + residual)
// so its result is bit for bit the per-op path's (tests/test_quant_layers.py). What it removes is the
// Python between the ops: at batch 1 on a small model that is ~1 ms of a ~10 ms step. The ops are reached
// through the dispatcher (they live in their own translation units); h is updated in place and returned.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;

c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor quant_layers(const at::Tensor& h, const at::Tensor& rope_cos, const at::Tensor& rope_sin, int64_t rope_cols,
                        at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef rows, at::IntArrayRef counts,
                        at::TensorList norms, double eps, const at::Tensor& pool_k, const at::Tensor& pool_v,
                        const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads, const at::Tensor& runs,
                        const at::Tensor& pieces, const at::Tensor& blocks, const at::Tensor& tok_ptr,
                        const at::Tensor& tok_parts, int64_t num_parts, int64_t max_item_tokens, int64_t flash_min_rows,
                        int64_t flash_min_keys, double scale, int64_t act_bits, int64_t isa) {
  static const auto linear =
      op_handle("hydragen::quant_linear")
          .typed<at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, const OptTensor&,
                            double, const OptTensor&, const OptTensor&, const OptTensor&, int64_t, bool, int64_t,
                            int64_t)>();
  static const auto tail =
      op_handle("hydragen::quant_mlp_tail")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef,
                            const at::Tensor&, double, at::TensorList, at::IntArrayRef, at::IntArrayRef, at::TensorList,
                            at::IntArrayRef, at::IntArrayRef, int64_t, int64_t)>();
  static const auto attention =
      op_handle("hydragen::step_attention")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                            int64_t, int64_t, int64_t, double)>();

  TORCH_CHECK(counts.size() % 4 == 0 && norms.size() == counts.size() / 2,
              "quant_layers: counts holds 4 part counts per layer (qkv, o, gate_up, down), norms 2 per layer");
  TORCH_CHECK(weights.size() == qtypes.size() && weights.size() == rows.size(),
              "quant_layers: weights, qtypes and rows must have one length");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "quant_layers: h must be a contiguous 2-D float32 tensor");
  const int64_t layers = static_cast<int64_t>(counts.size()) / 4;
  const auto pool_type = pool_k.scalar_type();
  TORCH_CHECK(pool_k.dim() == 4 && pool_k.sizes() == pool_v.sizes() && pool_k.size(0) == layers &&
                  pool_k.size(2) == num_kv_heads && pool_v.scalar_type() == pool_type &&
                  (pool_type == at::kFloat || pool_type == at::kBFloat16 || pool_type == at::kHalf),
              "quant_layers: pool_k/v must be float32, bfloat16 or float16 [layers, slots, kv heads, head dim]");
  const int64_t t = h.size(0), d = pool_k.size(3), qdim = num_heads * d, kvdim = num_kv_heads * d;
  const OptTensor none;
  const OptTensor cos = rope_cos, sin = rope_sin;
  size_t next = 0;  // the next part in weights/qtypes/rows
  auto take = [&](int64_t n) {
    TORCH_CHECK(n > 0 && next + n <= weights.size(), "quant_layers: counts do not match the weights given");
    const size_t at = next;
    next += n;
    return std::make_tuple(weights.slice(at, n), qtypes.slice(at, n), rows.slice(at, n));
  };
  for (int64_t layer = 0; layer < layers; ++layer) {
    const auto [qkv_w, qkv_t, qkv_r] = take(counts[4 * layer]);
    const auto [o_w, o_t, o_r] = take(counts[4 * layer + 1]);
    const auto [gu_w, gu_t, gu_r] = take(counts[4 * layer + 2]);
    const auto [d_w, d_t, d_r] = take(counts[4 * layer + 3]);
    const OptTensor attn_norm = norms[2 * layer];
    const at::Tensor qkv = linear.call(h, qkv_w, qkv_t, qkv_r, attn_norm, eps, none, cos, sin, rope_cols, false,
                                       act_bits, isa);
    TORCH_CHECK(qkv.size(1) == qdim + 2 * kvdim, "quant_layers: layer ", layer, " qkv gives ", qkv.size(1),
                " columns, the heads call for ", qdim + 2 * kvdim);
    const at::Tensor q = qkv.narrow(1, 0, qdim).view({t, num_heads, d});
    const at::Tensor k = qkv.narrow(1, qdim, kvdim).view({t, num_kv_heads, d});
    const at::Tensor v = qkv.narrow(1, qdim + kvdim, kvdim).view({t, num_kv_heads, d});
    at::Tensor layer_k = pool_k.select(0, layer), layer_v = pool_v.select(0, layer);
    layer_k.index_copy_(0, slots, k.to(pool_type));  // a 16-bit cache keeps the rounded values
    layer_v.index_copy_(0, slots, v.to(pool_type));
    const at::Tensor o = attention.call(q, layer_k, layer_v, runs, pieces, blocks, tok_ptr, tok_parts, num_parts,
                                        max_item_tokens, flash_min_rows, flash_min_keys, scale);
    tail.call(o.reshape({t, qdim}), h, o_w, o_t, o_r, norms[2 * layer + 1], eps, gu_w, gu_t, gu_r, d_w, d_t, d_r,
              act_bits, isa);
  }
  TORCH_CHECK(next == weights.size(), "quant_layers: more weights given than counts name");
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydragen, m) {
  m.def(
      "quant_layers(Tensor h, Tensor rope_cos, Tensor rope_sin, int rope_cols, Tensor[] weights, int[] qtypes, "
      "int[] rows, int[] counts, Tensor[] norms, float eps, Tensor pool_k, Tensor pool_v, Tensor slots, "
      "int num_heads, int num_kv_heads, Tensor runs, Tensor pieces, Tensor blocks, Tensor tok_ptr, Tensor tok_parts, "
      "int num_parts, int max_item_tokens, int flash_min_rows, int flash_min_keys, float scale, int act_bits, "
      "int isa) -> Tensor");
  m.impl("quant_layers", c10::DispatchKey::CPU, &quant_layers);
}
