// Packed weights on 2 MiB pages. A decode step streams every weight once, and on 4 KiB pages that is a TLB
// miss every 4 KiB (a two-level walk in a VM) and a hardware prefetcher that stops at each page's end. Measured
// on this project's 2-core VM (M = 1, 14,336 x 4,096 Q4_K, 15-bit activations): 18.3-18.5 GB/s on 4 KiB pages
// against 22.1-24.3 on 2 MiB ones. Most of a small model's matrices are far below 2 MiB (the embedded model's
// are 0.2-0.6 MB), so tensors are cut from shared regions of at least 64 MiB, each advised MADV_HUGEPAGE
// before it is touched; a region lives as long as any tensor cut from it, and no longer. Linux only (elsewhere, and when the
// kernel says no, the pages are ordinary ones and nothing else changes). Anonymous memory starts zeroed, as
// the packer needs: rows past a matrix's last are zero.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <memory>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace hq {

class WeightArena {
 public:
  // A zeroed uint8 tensor [rows, cols] on 2 MiB pages where the system gives them.
  at::Tensor zeros(int64_t rows, int64_t cols) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const int64_t bytes = rows * cols;
    if (bytes > 0) {
      std::lock_guard<std::mutex> hold(mutex_);
      const int64_t need = round_up(bytes, kAlign);
      std::shared_ptr<Region> region = current_.lock();  // gone once every tensor cut from it is
      if (!region || used_ + need > region->size) {
        region = Region::map(std::max(kRegionBytes, round_up(need, kHuge)));
        current_ = region;
        used_ = 0;
      }
      if (region) {
        uint8_t* at = region->base + used_;
        used_ += need;
        // the tensor's deleter owns the region: unmapped when the last tensor in it dies
        return at::from_blob(at, {rows, cols}, [region](void*) {}, at::TensorOptions().dtype(at::kByte));
      }
    }
#endif
    return at::zeros({rows, cols}, at::TensorOptions().dtype(at::kByte));
  }

  static WeightArena& instance() {
    static WeightArena arena;
    return arena;
  }

 private:
  static constexpr int64_t kHuge = int64_t{2} << 20;
  static constexpr int64_t kRegionBytes = int64_t{64} << 20;
  static constexpr int64_t kAlign = 64;  // a cache line: every tensor starts one, as torch's allocator does

  static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

  struct Region {
    uint8_t* base = nullptr;
    int64_t size = 0;
    void* mapping = nullptr;
    int64_t mapped = 0;

#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // size bytes starting on a 2 MiB boundary (mapped with a huge page of slack, then aligned), or null.
    static std::shared_ptr<Region> map(int64_t size) {
      const int64_t mapped = size + kHuge;
      void* p = mmap(nullptr, static_cast<size_t>(mapped), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return nullptr;
      auto r = std::make_shared<Region>();
      r->mapping = p;
      r->mapped = mapped;
      const auto addr = reinterpret_cast<uintptr_t>(p);
      r->base = reinterpret_cast<uint8_t*>((addr + kHuge - 1) / kHuge * kHuge);
      r->size = size;
      madvise(r->base, static_cast<size_t>(size), MADV_HUGEPAGE);  // advice: refused, it costs nothing
      return r;
    }
    ~Region() {
      if (mapping != nullptr) munmap(mapping, static_cast<size_t>(mapped));
    }
#else
    static std::shared_ptr<Region> map(int64_t) { return nullptr; }
#endif
  };

  std::mutex mutex_;
  std::weak_ptr<Region> current_;  // the region being filled; the arena alone never keeps one alive
  int64_t used_ = 0;
};

}  // namespace hq
