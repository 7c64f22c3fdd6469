// Prompt-lookup drafts for a whole batch in one call: for each sequence, the tokens that followed the
// latest earlier occurrence of its context's last n tokens (the longest n in [min_n, max_n] that occurs), in
// its own context or its siblings'.
// The twin, and the reference the tests hold this to, is hydragen/spec/ngram.py: ngram_drafts_reference.
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// The start of the latest occurrence of pattern[0, n) in hay[0, hay_len) that some token follows, or -1.
int64_t latest_match(const int32_t* hay, int64_t hay_len, const int32_t* pattern, int64_t n) {
  for (int64_t p = hay_len - n - 1; p >= 0; --p) {
    if (hay[p + n - 1] != pattern[n - 1]) continue;  // the last token first: most candidates fail here
    if (std::equal(pattern, pattern + n - 1, hay + p)) return p;
  }
  return -1;
}

// contexts[i] holds lengths[i] tokens; sequence i takes at most limits[i] drafts, looked up in the contexts
// named by sources[i] (-1: none), its own first. The longest n wins; for one n, the first source that has it.
std::tuple<at::Tensor, at::Tensor> ngram_propose(const std::vector<at::Tensor>& contexts, const at::Tensor& lengths,
                                                 const at::Tensor& limits, const at::Tensor& sources, int64_t min_n,
                                                 int64_t max_n) {
  const int64_t batch = static_cast<int64_t>(contexts.size());
  TORCH_CHECK(lengths.numel() == batch && limits.numel() == batch, "ngram_propose: one length and limit a context");
  TORCH_CHECK(sources.dim() == 2 && sources.size(0) == batch, "ngram_propose: sources is [contexts, k]");
  TORCH_CHECK(1 <= min_n && min_n <= max_n, "ngram_propose: need 1 <= min_n <= max_n");
  auto len = lengths.contiguous().to(at::kLong);
  auto lim = limits.contiguous().to(at::kLong);
  auto src = sources.contiguous().to(at::kLong);
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t* kp = lim.data_ptr<int64_t>();
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t width = src.size(1);
  std::vector<const int32_t*> data(batch);
  for (int64_t i = 0; i < batch; ++i) {
    const at::Tensor& c = contexts[i];
    TORCH_CHECK(c.scalar_type() == at::kInt && c.is_contiguous() && c.dim() == 1,
                "ngram_propose: contexts are contiguous int32 vectors");
    TORCH_CHECK(0 <= lp[i] && lp[i] <= c.numel(), "ngram_propose: a length past its context");
    data[i] = c.data_ptr<int32_t>();
  }
  int64_t widest = 0;
  for (int64_t i = 0; i < batch; ++i) widest = std::max(widest, kp[i]);
  auto drafts = at::full({batch, widest}, -1, at::kInt);
  auto counts = at::zeros({batch}, at::kLong);
  int32_t* dp = drafts.data_ptr<int32_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t own = lp[i];
    if (kp[i] <= 0) continue;
    bool found = false;
    for (int64_t n = std::min(max_n, own - 1); n >= min_n && !found; --n) {
      const int32_t* pattern = data[i] + own - n;
      for (int64_t j = 0; j < width && !found; ++j) {
        const int64_t h = sp[i * width + j];
        if (h < 0) continue;
        TORCH_CHECK(h < batch, "ngram_propose: a source past the contexts");
        const int64_t p = latest_match(data[h], lp[h], pattern, n);
        if (p < 0) continue;
        const int64_t from = p + n, take = std::min(kp[i], lp[h] - from);
        std::copy(data[h] + from, data[h] + from + take, dp + i * widest);
        cp[i] = take;
        found = true;
      }
    }
  }
  return {drafts, counts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydragen, m) {
  m.def("ngram_propose(Tensor[] contexts, Tensor lengths, Tensor limits, Tensor sources, int min_n, int max_n) -> "
        "(Tensor, Tensor)",
        &ngram_propose);
}
