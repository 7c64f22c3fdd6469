// Scalar access to GGUF blocks and to the packed layout (quant_layout.h): decoding a file block into its
// integers and scales (the repacker's input), and reading one row's integers back out of a packed tile (the
// scalar kernel's and the dequantizer's input). Portable C++, no SIMD.

#pragma once

#include <cstdint>
#include <cstring>

#include "quant_layout.h"

namespace hq {

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One file block decoded: w = a * (u - offset) + b per group (kFormats in quant_layout.h).
struct Block {
  uint8_t u[256];
  uint16_t d = 0, dm = 0;  // fp16 bits
  int8_t sc[16] = {};      // sub-block scales (Q4_K/Q5_K: 8 used, u8 values; Q2_K: the raw byte)
  uint8_t mn[8] = {};      // Q4_K/Q5_K sub-block minimums
};

// Q4_K/Q5_K: the j-th of 8 six-bit (scale, min) pairs packed in 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void decode_file_block(int qtype, const uint8_t* p, Block& b) {
  switch (qtype) {
    case kQ4_0:
    case kQ4_1: {
      b.d = load16(p);
      const uint8_t* qs = p + (qtype == kQ4_1 ? 4 : 2);
      if (qtype == kQ4_1) b.dm = load16(p + 2);
      for (int j = 0; j < 16; ++j) {
        b.u[j] = qs[j] & 15;
        b.u[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case kQ5_0:
    case kQ5_1: {
      const int off = qtype == kQ5_1 ? 4 : 2;
      b.d = load16(p);
      if (qtype == kQ5_1) b.dm = load16(p + 2);
      uint32_t qh;
      std::memcpy(&qh, p + off, 4);
      const uint8_t* qs = p + off + 4;
      for (int j = 0; j < 16; ++j) {
        b.u[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
        b.u[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      break;
    }
    case kQ8_0:
      b.d = load16(p);
      std::memcpy(b.u, p + 2, 32);
      break;
    case kQ4_K:
    case kQ5_K: {
      b.d = load16(p);
      b.dm = load16(p + 2);
      const uint8_t* scales = p + 4;
      for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        scale_min_k4(j, scales, s, m);
        b.sc[j] = static_cast<int8_t>(s);
        b.mn[j] = m;
      }
      const uint8_t* qh = p + 16;
      const uint8_t* ql = p + (qtype == kQ5_K ? 48 : 16);
      for (int pair = 0; pair < 4; ++pair) {
        for (int l = 0; l < 32; ++l) {
          uint8_t lo = ql[32 * pair + l] & 15, hi = ql[32 * pair + l] >> 4;
          if (qtype == kQ5_K) {
            lo |= ((qh[l] >> (2 * pair)) & 1) << 4;
            hi |= ((qh[l] >> (2 * pair + 1)) & 1) << 4;
          }
          b.u[64 * pair + l] = lo;
          b.u[64 * pair + 32 + l] = hi;
        }
      }
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      std::memcpy(b.sc, p + 192, 16);
      b.d = load16(p + 208);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* l8 = ql + 64 * n;
        const uint8_t* h8 = qh + 32 * n;
        uint8_t* u = b.u + 128 * n;
        for (int l = 0; l < 32; ++l) {
          u[l] = (l8[l] & 15) | (((h8[l] >> 0) & 3) << 4);
          u[l + 32] = (l8[l + 32] & 15) | (((h8[l] >> 2) & 3) << 4);
          u[l + 64] = (l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4);
          u[l + 96] = (l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4);
        }
      }
      break;
    }
    case kQ3_K: {
      const uint8_t* hm = p;
      const uint8_t* qs = p + 32;
      const uint8_t* s12 = p + 96;
      b.d = load16(p + 108);
      uint32_t aux[4];
      std::memcpy(aux, s12, 12);
      const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
      aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
      aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
      aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
      aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
      uint8_t raw[16];
      std::memcpy(raw, aux, 16);
      for (int s = 0; s < 16; ++s) b.sc[s] = static_cast<int8_t>(static_cast<int>(raw[s]) - 32);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* q = qs + 32 * n;
        for (int j = 0; j < 4; ++j) {
          const uint8_t m = static_cast<uint8_t>(1u << (4 * n + j));
          uint8_t* u = b.u + 128 * n + 32 * j;
          for (int l = 0; l < 16; ++l) {
            u[l] = ((q[l] >> (2 * j)) & 3) | ((hm[l] & m) ? 4 : 0);
            u[l + 16] = ((q[l + 16] >> (2 * j)) & 3) | ((hm[l + 16] & m) ? 4 : 0);
          }
        }
      }
      break;
    }
    case kQ2_K: {
      std::memcpy(b.sc, p, 16);
      const uint8_t* qs = p + 16;
      b.d = load16(p + 80);
      b.dm = load16(p + 82);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* q = qs + 32 * n;
        for (int j = 0; j < 4; ++j) {
          uint8_t* u = b.u + 128 * n + 32 * j;
          for (int l = 0; l < 16; ++l) {
            u[l] = (q[l] >> (2 * j)) & 3;
            u[l + 16] = (q[l + 16] >> (2 * j)) & 3;
          }
        }
      }
      break;
    }
    default:
      break;
  }
}

// Where a tile-block's sections start (see quant_layout.h).
struct Head {
  int dm = -1, sc = -1, mn = -1;  // byte offsets, -1 when the format has none
};

constexpr Head head_of(int qtype) {
  switch (qtype) {
    case kQ4_1:
    case kQ5_1: return {32, -1, -1};
    case kQ4_K:
    case kQ5_K: return {32, 64, 192};
    case kQ6_K:
    case kQ3_K: return {-1, 32, -1};
    case kQ2_K: return {32, 64, -1};
    default: return {-1, -1, -1};
  }
}

constexpr bool has_low4(int t) {
  return t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || t == kQ4_K || t == kQ5_K || t == kQ6_K;
}
constexpr bool has_bit4(int t) { return t == kQ5_0 || t == kQ5_1 || t == kQ5_K; }
constexpr bool has_low2(int t) { return t == kQ2_K || t == kQ3_K; }

// Writes row r (0..15) of a decoded block into its tile-block.
inline void write_tile_row(int qtype, const Block& b, int r, uint8_t* tb) {
  const Format f = format_of(qtype);
  const Head h = head_of(qtype);
  std::memcpy(tb + 2 * r, &b.d, 2);
  if (h.dm >= 0) std::memcpy(tb + h.dm + 2 * r, &b.dm, 2);
  const int subs = qtype == kQ4_K || qtype == kQ5_K ? 8 : 16;
  if (h.sc >= 0)
    for (int s = 0; s < subs; ++s) tb[h.sc + 16 * s + r] = static_cast<uint8_t>(b.sc[s]);
  if (h.mn >= 0)
    for (int s = 0; s < 8; ++s) tb[h.mn + 16 * s + r] = b.mn[s];
  for (int g = 0; g < f.block / 32; ++g) {
    const uint8_t* u = b.u + 32 * g;
    uint8_t* gp = tb + f.head_bytes + g * f.group_bytes;
    for (int i = 0; i < 4; ++i) {
      uint8_t* at = gp + 4 * r + i;
      if (qtype == kQ8_0) {
        for (int s = 0; s < 8; ++s) at[64 * s] = u[4 * s + i];
        continue;
      }
      if (has_low4(qtype)) {
        for (int j = 0; j < 4; ++j) at[64 * j] = (u[4 * j + i] & 15) | ((u[16 + 4 * j + i] & 15) << 4);
        uint8_t* extra = at + kLow4;
        if (has_bit4(qtype)) {
          uint8_t v = 0;
          for (int j = 0; j < 4; ++j)
            v |= ((u[4 * j + i] >> 4) & 1) << (2 * j) | ((u[16 + 4 * j + i] >> 4) & 1) << (2 * j + 1);
          extra[0] = v;
        } else if (qtype == kQ6_K) {
          for (int hv = 0; hv < 2; ++hv) {
            uint8_t v = 0;
            for (int t = 0; t < 2; ++t) {
              const int j = 2 * hv + t;
              v |= ((u[4 * j + i] >> 4) & 3) << (4 * t) | ((u[16 + 4 * j + i] >> 4) & 3) << (4 * t + 2);
            }
            extra[64 * hv] = v;
          }
        }
      } else if (has_low2(qtype)) {
        for (int v = 0; v < 2; ++v) {
          uint8_t x = 0;
          for (int c = 0; c < 4; ++c) x |= (u[4 * (4 * v + c) + i] & 3) << (2 * c);
          at[64 * v] = x;
        }
        if (qtype == kQ3_K) {
          uint8_t x = 0;
          for (int s = 0; s < 8; ++s) x |= ((u[4 * s + i] >> 2) & 1) << s;
          at[kLow2] = x;
        }
      }
    }
  }
}

// The 32 integers u of row r in group g of a tile-block (the inverse of write_tile_row's planes).
inline void read_group_u(int qtype, const uint8_t* tb, int g, int r, uint8_t* u) {
  const Format f = format_of(qtype);
  const uint8_t* gp = tb + f.head_bytes + g * f.group_bytes;
  for (int i = 0; i < 4; ++i) {
    const uint8_t* at = gp + 4 * r + i;
    if (qtype == kQ8_0) {
      for (int s = 0; s < 8; ++s) u[4 * s + i] = at[64 * s];
      continue;
    }
    if (has_low4(qtype)) {
      for (int j = 0; j < 4; ++j) {
        u[4 * j + i] = at[64 * j] & 15;
        u[16 + 4 * j + i] = at[64 * j] >> 4;
      }
      const uint8_t* extra = at + kLow4;
      if (has_bit4(qtype)) {
        for (int j = 0; j < 4; ++j) {
          u[4 * j + i] |= ((extra[0] >> (2 * j)) & 1) << 4;
          u[16 + 4 * j + i] |= ((extra[0] >> (2 * j + 1)) & 1) << 4;
        }
      } else if (qtype == kQ6_K) {
        for (int j = 0; j < 4; ++j) {
          const uint8_t v = extra[64 * (j / 2)];
          const int t = j % 2;
          u[4 * j + i] |= ((v >> (4 * t)) & 3) << 4;
          u[16 + 4 * j + i] |= ((v >> (4 * t + 2)) & 3) << 4;
        }
      }
    } else {
      for (int s = 0; s < 8; ++s) u[4 * s + i] = (at[64 * (s / 4)] >> (2 * (s % 4))) & 3;
      if (qtype == kQ3_K)
        for (int s = 0; s < 8; ++s) u[4 * s + i] |= ((at[kLow2] >> s) & 1) << 2;
    }
  }
}

// Per-group affine terms of row r, group g: w = a * (u - off) + b for a 32-group, or for the 16-sub-blocks
// of Q6_K/Q3_K/Q2_K a[0..1], b[0..1] per half. Written to mirror ggml's dequantization order of operations.
inline void dequant_group(int qtype, const uint8_t* tb, int g, int r, float* out) {
  const Head h = head_of(qtype);
  const float d = fp16_to_float(load16(tb + 2 * r));
  const float dm = h.dm >= 0 ? fp16_to_float(load16(tb + h.dm + 2 * r)) : 0.0f;
  uint8_t u[32];
  read_group_u(qtype, tb, g, r, u);
  for (int k = 0; k < 32; ++k) {
    const int q = u[k], half = 2 * g + k / 16;
    float w;
    switch (qtype) {
      case kQ4_0: w = static_cast<float>(q - 8) * d; break;
      case kQ4_1:
      case kQ5_1: w = static_cast<float>(q) * d + dm; break;
      case kQ5_0: w = static_cast<float>(q - 16) * d; break;
      case kQ8_0: w = static_cast<float>(static_cast<int8_t>(q)) * d; break;
      case kQ4_K:
      case kQ5_K:
        w = (d * static_cast<float>(tb[h.sc + 16 * g + r])) * static_cast<float>(q) -
            dm * static_cast<float>(tb[h.mn + 16 * g + r]);
        break;
      case kQ6_K:
        w = d * static_cast<float>(static_cast<int8_t>(tb[h.sc + 16 * half + r])) * static_cast<float>(q - 32);
        break;
      case kQ3_K:
        w = d * static_cast<float>(static_cast<int8_t>(tb[h.sc + 16 * half + r])) * static_cast<float>(q - 4);
        break;
      case kQ2_K: {
        const uint8_t s = tb[h.sc + 16 * half + r];
        w = d * static_cast<float>(s & 15) * static_cast<float>(q) - dm * static_cast<float>(s >> 4);
        break;
      }
      default: w = 0.0f;
    }
    out[k] = w;
  }
}

}  // namespace hq
