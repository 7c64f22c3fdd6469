// The quantized projection's steps (quant_matmul.cpp), for callers that run them inside a parallel region of
// their own: the layer stack (quant_layers.cpp) runs every layer of a step in one region, each thread taking
// its share of each step between barriers, where the quant_linear op forks a region per call.
//
// Every function here computes rows (or output tiles) independently of the others, so splitting them across
// threads in any way gives the same bits as the op.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace hq {

constexpr int64_t kMaxRopeDim = 512;  // the largest head dim the rotary embedding takes

// An activation matrix quantized for the packed kernels (quant_kernels.h): per group of 32, integers q with
// |q| <= kQMax[bits] (int8, or 15 bits stored as q = 128 * hi + lo), the scale dx = max|x| / kQMax, the float
// sum xs = dx * sum q and the integer sums per 16. Rows are k values apart, for the k quantize_acts was given
// (size_acts reserves room for the largest).
struct QuantizedActs {
  std::vector<int8_t> q, lo;
  std::vector<float> dx, xs;
  std::vector<int32_t> qs16;
};

// One part of a projection's weight: packed tiles, or a float matrix in the file's row-major layout.
struct Part {
  const uint8_t* data;
  int qtype;
  int64_t rows, col0, units, stride;  // stride: bytes per tile (packed) or per row (float)
};

// A projection of m_rows activation rows of k columns through its parts, cut into tasks: one 16-row output
// tile of one part against a chunk of up to 64 activation rows.
struct LinearPlan {
  std::vector<Part> parts;
  int64_t n_total = 0, units = 0, chunks = 0, m_rows = 0, k = 0;
  bool any_packed = false;
  int level = 0;  // the instruction set that runs it
  int64_t tasks() const { return units * chunks; }
};

// Checks the weights against k (every error names the problem) and lays out the tasks.
LinearPlan plan_linear(at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef rows, int64_t m_rows,
                       int64_t k, int64_t isa);

// Sizes qa for m_rows x k activations at `bits` (8 or 15); then quantize_acts fills rows [m0, m1).
void size_acts(int64_t m_rows, int64_t k, int bits, QuantizedActs& qa);
void quantize_acts(const float* x, int64_t m0, int64_t m1, int64_t k, int bits, int level, QuantizedActs& qa);

// Tasks [begin, end) of the plan: y[m, col] (= or +=) for their tiles and rows. xf: the float activations
// (float parts read them; packed parts read qa).
void run_tasks(const LinearPlan& plan, const QuantizedActs& qa, const float* xf, float* y, bool accumulate,
               int64_t begin, int64_t end);

// Checks the rotary tables (cos, sin [rows, rotated dims], float32, contiguous) for the first rope_cols of cols
// output columns, in heads of `head` columns (0: the tables' width) whose leading columns rotate; errors name
// `op`.
void check_rope_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t rows, int64_t rope_cols, int64_t cols,
                       const char* op, int64_t head = 0);

// Rows [m0, m1) of the model's neighbours of a projection: RMSNorm (sum of squares in double), rotary embedding
// of the first `cols` columns (rotate-half, tables [rows, d]), SwiGLU (silu(first half) * second half).
void rms_norm_range(const float* x, const float* w, double eps, int64_t m0, int64_t m1, int64_t k, float* out);
// `head` (0: d) is a head's width when only its leading d columns rotate (partial rotary: Phi-4-mini's 96 of 128).
void rope_range(float* y, int64_t ld, int64_t m0, int64_t m1, int64_t cols, const float* cos, const float* sin,
                int64_t d, int64_t head = 0);

// What follows a q/k/v projection before attention, in the model's order: the bias (Qwen2), RMSNorm over each
// head of q and of k (QK-norm: Qwen3), then the rotary on the leading `rot` columns of every head of q and k.
// A null pointer skips its stage. A row is ld floats: q_cols of q, k_cols of k, then v. The per-op path (the
// qkv_epilogue op) and the layer stack both run this, so they agree bit for bit.
struct QkvEpilogue {
  const float* bias = nullptr;    // [ld]
  const float* q_norm = nullptr;  // [head_dim]
  const float* k_norm = nullptr;  // [head_dim]
  double eps = 0.0;
  int64_t head_dim = 0, q_cols = 0, k_cols = 0;
  const float* cos = nullptr;  // [rows, rot]
  const float* sin = nullptr;
  int64_t rot = 0;
};
void qkv_epilogue_range(float* y, int64_t ld, int64_t m0, int64_t m1, const QkvEpilogue& e);
void swiglu_range(const float* y, int64_t m0, int64_t m1, int64_t half, float* out);
// GeGLU (Gemma): gelu with the tanh approximation of the first half, times the second.
void geglu_range(const float* y, int64_t m0, int64_t m1, int64_t half, float* out);

}  // namespace hq
