// The packed weight layout of hydragen's quantized matmul, shared by the repacker (quant_pack.cpp) and the
// kernels (quant_kernels.h, quant_matmul.cpp).
//
// A GGUF stores a quantized matrix row by row, each row a run of blocks (32 weights, or 256 for the
// K-quants) with its scales inside the block. At load, hydragen rewrites the rows into tiles of 16 rows so
// that one 512-bit register holds 4 bytes of each of the 16 rows: a VNNI dot product (vpdpbusd) then adds
// 4 weights x 4 activations into each row's own 32-bit lane, the activations broadcast. One instruction does
// 64 multiply-adds for 16 different outputs, and a block's 16 scales are one contiguous load. The values are
// the file's, bit for bit: only their order changes (and the K-quants' packed 6-bit scales are unpacked to
// bytes, 2-4 % more memory).
//
// Every weight becomes an unsigned integer u (0..255) with w = a * (u - offset) + b per group, where a, b
// and the offset come from the block (see kFormats). Per tile and per block, in this order:
//   d[16]       fp16  the block scale of each row (all formats)
//   dm[16]      fp16  Q4_1/Q5_1: the block minimum m (added); Q4_K/Q5_K/Q2_K: dmin (subtracted)
//   sc[S][16]   int8/u8 sub-block scales: Q4_K/Q5_K 8 x 6 bits; Q6_K 16 x int8; Q3_K 16 x int8 (already
//                     minus 32); Q2_K 16 x (scale | min << 4)
//   mn[8][16]   u8    Q4_K/Q5_K: the 8 sub-block minimums (6 bits)
//   then per group of 32 weights, its planes (a "vector" is 64 bytes: 4 bytes for each of the 16 rows,
//   row r at bytes 4r..4r+3; byte i of row r's 4 in vector j is called (r, i) below):
//   low4   4 vectors: vector j, byte (r,i): low nibble = u[r][4j+i] & 15, high nibble = u[r][16+4j+i] & 15
//   bit4   1 vector : byte (r,i) bit 2j = bit 4 of u[r][4j+i], bit 2j+1 = bit 4 of u[r][16+4j+i] (j=0..3)
//   bit45  2 vectors: vector h, byte (r,i): bits 4t..4t+1 = bits 4-5 of u[r][4(2h+t)+i], bits 4t+2..4t+3 =
//                     bits 4-5 of u[r][16+4(2h+t)+i] (t = 0, 1)
//   low2   2 vectors: vector v, byte (r,i): bits 2c..2c+1 = u[r][4(4v+c)+i] & 3 (c = 0..3)
//   bit2   1 vector : byte (r,i) bit s = bit 2 of u[r][4s+i] (s = 0..7)
//   byte   8 vectors: vector s, byte (r,i) = q[r][4s+i] (Q8_0's signed values as stored)
// Rows past the matrix's last (when rows % 16 != 0) are zero: every scale 0, so they compute 0.
//
// F16, BF16 and F32 matrices are not repacked: their kernel reads the file's row-major layout directly.

#pragma once

#include <cstdint>

namespace hq {

constexpr int kTileRows = 16;

// GGML type ids (ggml.h): the same numbers the GGUF file and the gguf Python package use.
enum QType : int {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

// Bytes of each plane per group of 32 weights in a 16-row tile.
constexpr int kLow4 = 256, kBit4 = 64, kBit45 = 128, kLow2 = 128, kBit2 = 64, kByte = 512;

struct Format {
  int block;         // weights per block along a row (32 or 256)
  int file_bytes;    // bytes of one block in the GGUF file
  int head_bytes;    // bytes of a tile-block's scale section (d, dm, sc, mn for 16 rows)
  int group_bytes;   // bytes of one group's planes (32 weights x 16 rows)
  bool float_type;   // F32/F16/BF16: row-major, not repacked
};

constexpr Format format_of(int qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18, 32, kLow4, false};
    case kQ4_1: return {32, 20, 64, kLow4, false};
    case kQ5_0: return {32, 22, 32, kLow4 + kBit4, false};
    case kQ5_1: return {32, 24, 64, kLow4 + kBit4, false};
    case kQ8_0: return {32, 34, 32, kByte, false};
    case kQ4_K: return {256, 144, 64 + 8 * 16 + 8 * 16, kLow4, false};
    case kQ5_K: return {256, 176, 64 + 8 * 16 + 8 * 16, kLow4 + kBit4, false};
    case kQ6_K: return {256, 210, 32 + 16 * 16, kLow4 + kBit45, false};
    case kQ3_K: return {256, 110, 32 + 16 * 16, kLow2 + kBit2, false};
    case kQ2_K: return {256, 84, 64 + 16 * 16, kLow2, false};
    case kF32: return {1, 4, 0, 0, true};
    case kF16: return {1, 2, 0, 0, true};
    case kBF16: return {1, 2, 0, 0, true};
    default: return {0, 0, 0, 0, false};
  }
}

constexpr bool supported(int qtype) { return format_of(qtype).block != 0; }

// Bytes of one tile-block (16 rows x one block) in the packed layout.
constexpr int tile_block_bytes(int qtype) {
  const Format f = format_of(qtype);
  return f.head_bytes + (f.block / 32) * f.group_bytes;
}

}  // namespace hq
