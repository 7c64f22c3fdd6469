// Packed weights on 2 MiB pages. A decode step streams every weight once, and on 4 KiB pages that is a TLB
// miss every 4 KiB (a two-level walk in a VM) and a hardware prefetcher that stops at each page's end. Measured
// on this project's 2-core VM (M = 1, 14,336 x 4,096 Q4_K, 15-bit activations): 18.3-18.5 GB/s on 4 KiB pages
// against 22.1-24.3 on 2 MiB ones. Most of a small model's matrices are far below 2 MiB (the embedded model's
// are 0.2-0.6 MB), so they are cut from shared regions of 64 MiB, each advised MADV_HUGEPAGE before it is
// touched; a region lives as long as any tensor cut from it, and no longer. Matrices of 8 MiB and more (a
// 7B model's MLP) are mapped on their own, so freeing one frees its memory whatever else lives. Linux only
// (elsewhere, and when the kernel says no, the pages are ordinary ones and nothing else changes). Anonymous
// memory starts zeroed, as the packer needs: rows past a matrix's last are zero.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
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
      const int64_t need = round_up(bytes, kAlign);
      std::shared_ptr<Region> region;
      uint8_t* at = nullptr;
      if (need >= kOwnBytes) {
        // A large matrix gets a mapping of its own: unmapped as soon as it dies, and no shared region's
        // room is left behind for it. Its last partial 2 MiB stays on 4 KiB pages (THP backs only whole
        // aligned 2 MiB ranges of a mapping), so it costs no memory past its bytes.
        region = Region::map(need);
        if (region) at = region->base;
      } else {
        std::lock_guard<std::mutex> hold(mutex_);
        region = current_.lock();  // gone once every tensor cut from it is
        if (region && used_ + need > region->size) {
          region->release_after(used_);  // the rest will never be cut: give the address space back
          region.reset();
        }
        if (!region) {
          region = Region::map(kRegionBytes);
          current_ = region;
          used_ = 0;
        }
        if (region) {
          at = region->base + used_;
          used_ += need;
        }
      }
      if (region) {
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
  static constexpr int64_t kPage = 4096;
  static constexpr int64_t kRegionBytes = int64_t{64} << 20;
  static constexpr int64_t kOwnBytes = kRegionBytes / 8;  // from here a matrix is mapped on its own
  static constexpr int64_t kAlign = 64;  // a cache line: every tensor starts one, as torch's allocator does

  static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

  struct Region {
    uint8_t* base = nullptr;
    int64_t size = 0;  // bytes mapped from base, whole 4 KiB pages

#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // At least `bytes` starting on a 2 MiB boundary, or null: mapped with 2 MiB of slack, which is then
    // unmapped on both sides, so only the region's own pages count against the system's commit limit.
    static std::shared_ptr<Region> map(int64_t bytes) {
      const int64_t size = round_up(bytes, kPage);
      const int64_t mapped = size + kHuge;
      void* p = mmap(nullptr, static_cast<size_t>(mapped), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return nullptr;
      auto* start = static_cast<uint8_t*>(p);
      const auto addr = reinterpret_cast<uintptr_t>(p);
      auto* base = reinterpret_cast<uint8_t*>((addr + kHuge - 1) / kHuge * kHuge);
      if (base > start) munmap(start, static_cast<size_t>(base - start));
      const int64_t tail = (start + mapped) - (base + size);
      if (tail > 0) munmap(base + size, static_cast<size_t>(tail));
      auto r = std::make_shared<Region>();
      r->base = base;
      r->size = size;
      madvise(base, static_cast<size_t>(size), MADV_HUGEPAGE);  // advice: refused, it costs nothing
      return r;
    }
    // Unmaps the untouched room from `used` bytes on, from the next 2 MiB boundary: cutting inside the last
    // huge page would split it, and its live bytes would go back to 4 KiB pages (the arena holds its lock and
    // a reference).
    void release_after(int64_t used) {
      const int64_t keep = round_up(used, kHuge);
      if (keep < size) munmap(base + keep, static_cast<size_t>(size - keep));
      size = std::min(size, keep);
    }
    ~Region() {
      if (base != nullptr) munmap(base, static_cast<size_t>(size));
    }
#else
    static std::shared_ptr<Region> map(int64_t) { return nullptr; }
    void release_after(int64_t) {}
#endif
  };

  std::mutex mutex_;
  std::weak_ptr<Region> current_;  // the region being filled; the arena alone never keeps one alive
  int64_t used_ = 0;
};

}  // namespace hq
