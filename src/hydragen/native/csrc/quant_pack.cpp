// Repacking GGUF rows into hydragen's 16-row tiles (quant_layout.h), and reading rows back out as floats
// (the embedding lookup of a quantized token table, and the tests' check of the layout against the gguf
// package's own dequantizer).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "quant_decode.h"
#include "weight_arena.h"

namespace {

using namespace hq;

void check_qtype(int64_t qtype) {
  TORCH_CHECK(supported(static_cast<int>(qtype)) && !format_of(static_cast<int>(qtype)).float_type,
              "quant_pack: GGML type ", qtype, " has no packed layout");
}

// parts: [rows_i, row_bytes] uint8 each, the file's rows of matrices stacked one after the other ->
// [ceil(sum rows_i / 16), row_bytes_packed] uint8, on 2 MiB pages when huge_pages (weight_arena.h). The parts
// are read where they lie (views of the file's memory map, a column slice's strided rows): the rows they
// stack into are never copied together first, so a load holds no copy of them beside the packed tiles.
at::Tensor quant_pack(const std::vector<at::Tensor>& parts, int64_t qtype, bool huge_pages) {
  check_qtype(qtype);
  TORCH_CHECK(!parts.empty(), "quant_pack: no parts");
  const Format f = format_of(static_cast<int>(qtype));
  const int64_t row_bytes = parts[0].dim() == 2 ? parts[0].size(1) : -1;
  std::vector<const uint8_t*> rows_at;
  for (const at::Tensor& raw : parts) {
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.device().is_cpu() &&
                    (raw.size(1) <= 1 || raw.stride(1) == 1),
                "quant_pack: each part must be a 2-D uint8 CPU tensor whose rows are contiguous");
    TORCH_CHECK(raw.size(1) == row_bytes, "quant_pack: parts of ", row_bytes, " and ", raw.size(1),
                " bytes a row cannot be stacked");
    const uint8_t* base = raw.data_ptr<uint8_t>();
    for (int64_t r = 0; r < raw.size(0); ++r) rows_at.push_back(base + r * raw.stride(0));
  }
  TORCH_CHECK(row_bytes % f.file_bytes == 0, "quant_pack: a row of ", row_bytes,
              " bytes is not a whole number of ", f.file_bytes, "-byte blocks");
  const int64_t rows = static_cast<int64_t>(rows_at.size());
  const int64_t blocks = row_bytes / f.file_bytes, tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t tb_bytes = tile_block_bytes(static_cast<int>(qtype));
  at::Tensor out = huge_pages ? WeightArena::instance().zeros(tiles, blocks * tb_bytes)
                              : at::zeros({tiles, blocks * tb_bytes}, at::TensorOptions().dtype(at::kByte));
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    Block b;
    for (int64_t t = begin; t < end; ++t) {
      for (int r = 0; r < kTileRows && t * kTileRows + r < rows; ++r) {
        const uint8_t* row = rows_at[t * kTileRows + r];
        for (int64_t k = 0; k < blocks; ++k) {
          decode_file_block(static_cast<int>(qtype), row + k * f.file_bytes, b);
          write_tile_row(static_cast<int>(qtype), b, r, dst + t * blocks * tb_bytes + k * tb_bytes);
        }
      }
    }
  });
  return out;
}

// Rows `ids` of a packed matrix with `cols` columns, as float32 [len(ids), cols].
at::Tensor quant_rows(const at::Tensor& packed, int64_t qtype, int64_t cols, const at::Tensor& ids) {
  check_qtype(qtype);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "quant_rows: packed must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quant_rows: ids must be a 1-D int64 tensor");
  const Format f = format_of(static_cast<int>(qtype));
  TORCH_CHECK(cols % f.block == 0, "quant_rows: ", cols, " columns are not whole blocks");
  const int64_t blocks = cols / f.block, tb_bytes = tile_block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(packed.size(1) == blocks * tb_bytes, "quant_rows: packed width does not match ", cols, " columns");
  const int64_t n = ids.size(0), limit = packed.size(0) * kTileRows;
  at::Tensor out = at::empty({n, cols}, packed.options().dtype(at::kFloat));
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < limit, "quant_rows: row ", idp[i], " out of range");
  const uint8_t* base = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = idp[i], t = row / kTileRows;
      const int r = static_cast<int>(row % kTileRows);
      for (int64_t k = 0; k < blocks; ++k) {
        const uint8_t* tb = base + t * packed.size(1) + k * tb_bytes;
        for (int g = 0; g < f.block / 32; ++g) dequant_group(static_cast<int>(qtype), tb, g, r, o + i * cols + k * f.block + 32 * g);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydragen, m) {
  m.def("quant_pack(Tensor[] parts, int qtype, bool huge_pages) -> Tensor");
  m.impl("quant_pack", c10::DispatchKey::CPU, &quant_pack);
  m.def("quant_rows(Tensor packed, int qtype, int cols, Tensor ids) -> Tensor");
  m.impl("quant_rows", c10::DispatchKey::CPU, &quant_rows);
}
