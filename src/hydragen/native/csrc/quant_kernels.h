// The quantized matmul kernels, written once over a vector type V (quant_v512.h / quant_v256.h) and
// included in one namespace per instruction set (quant_matmul.cpp), so each is compiled for its own target
// and picked at run time.
//
// packed_tile: rows [row0, row0 + V::W) of one 16-row tile (quant_layout.h) against up to MT activation rows.
// Each activation row is quantized in groups of 32 to integers q (scale dx, float sum xs = dx * sum q, integer
// sums per 16); a group's 4 weight bytes per row and the group's 4 activation bytes (broadcast) feed one dot
// instruction, so each row lane accumulates sum u * q over the group in int32. With SPLIT the activations
// have 15 bits, q = 128 * hi + lo with hi in [-127, 127] and lo in [-64, 63], two int8 planes: two dot
// instructions per step, combined per group as 128 * sum(u * hi) + sum(u * lo); without, q is int8. Offsets,
// sub-block scales (Q6_K/Q3_K/Q2_K: per 16 weights) and minimums are applied per group in integers where they
// are integers, then the group is added in float: acc += float(int sum) * (a * dx) [+ b * xs]. Every integer
// sum fits int32: |q| <= 16191, so a 32-group of u <= 255 is below 2^27, and Q6_K's two scaled sub-blocks
// below 2 * 16 * 32 * 16191 * 128 < 2^31.
//
// A batch-1 step runs neighbouring tiles in pairs (NT = 2, run_packed_pair): each activation broadcast then
// feeds two dot instructions, and two weight streams are read at once. Measured at M = 1 (one thread, weights in
// L3): Q4_K 121-126 against 115-116 GFLOP/s with 15-bit activations, Q6_K 89-92 against 86; from memory
// (14,336 x 4,096, two threads) Q4_K 29.9-30.4 against 25.5-28.9 GB/s.
//
// AVX2's pair sums saturate at 16 bits: 2 * u * |q| with |q| <= 127 (each plane) stays below 32767 for
// u <= 63, the largest u of every format but Q8_0, which AVX2 runs as |w| x sign(q, w) (|w| <= 128).

template <int... Js, class Fn>
inline void unroll(std::integer_sequence<int, Js...>, Fn&& fn) {
  (fn(std::integral_constant<int, Js>{}), ...);
}

template <int QT, int MT, bool SPLIT, int NT = 1>
inline void packed_tile(const uint8_t* tile, int64_t nblocks, const ActRows& a, int row0, float* const* out,
                        bool accumulate, int64_t tile_bytes = 0) {
  // NT tiles side by side (tile t at tile + t * tile_bytes, its outputs 16 columns on): each activation
  // broadcast feeds NT dot instructions, and NT weight streams are read at once.
  using I = typename V::I;
  using F = typename V::F;
  constexpr Format f = format_of(QT);
  constexpr Head h = head_of(QT);
  constexpr int TB = tile_block_bytes(QT);
  constexpr int G = f.block / 32;
  constexpr bool sub16 = QT == kQ6_K || QT == kQ3_K || QT == kQ2_K;
  const I m0f = V::c8(0x0F);
  F facc[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) facc[t][m] = V::fzero();

  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* tb[NT];
    F d[NT], dm[NT];
    for (int t = 0; t < NT; ++t) {
      tb[t] = tile + t * tile_bytes + b * TB;
      d[t] = V::load_f16(tb[t] + 2 * row0);
      dm[t] = V::fzero();
      if constexpr (h.dm >= 0) dm[t] = V::load_f16(tb[t] + h.dm + 2 * row0);
    }
    for (int g = 0; g < G; ++g) {
      const int64_t gi = b * G + g;  // this group's index along the row
      const uint8_t* gp[NT];
      for (int t = 0; t < NT; ++t) gp[t] = tb[t] + f.head_bytes + g * f.group_bytes + 4 * row0;
      I acc0[NT][MT], acc1[NT][MT], low0[NT][MT], low1[NT][MT];  // low: the lo plane's sums (SPLIT)
      for (int t = 0; t < NT; ++t)
        for (int m = 0; m < MT; ++m) acc0[t][m] = acc1[t][m] = low0[t][m] = low1[t][m] = V::zero();
      auto dot = [&](bool second, const I* u, int k) {
        for (int m = 0; m < MT; ++m) {
          const I x = V::bcast4(a.q[m] + 32 * gi + k);
          for (int t = 0; t < NT; ++t) {
            I& acc = second ? acc1[t][m] : acc0[t][m];
            acc = V::dot(acc, u[t], x);
          }
        }
        if constexpr (SPLIT) {
          for (int m = 0; m < MT; ++m) {
            const I x = V::bcast4(a.lo[m] + 32 * gi + k);
            for (int t = 0; t < NT; ++t) {
              I& low = second ? low1[t][m] : low0[t][m];
              low = V::dot(low, u[t], x);
            }
          }
        }
      };

      if constexpr (has_low4(QT)) {
        I hv[NT];
        for (int t = 0; t < NT; ++t) hv[t] = has_bit4(QT) ? V::load(gp[t] + kLow4) : V::zero();
        unroll(std::make_integer_sequence<int, 4>{}, [&](auto jc) {
          constexpr int J = decltype(jc)::value;
          I lo[NT], hi[NT];
          for (int t = 0; t < NT; ++t) {
            const I v = V::load(gp[t] + 64 * J);
            lo[t] = V::and_(v, m0f);
            hi[t] = V::and_(V::template shift16<-4>(v), m0f);
            if constexpr (has_bit4(QT)) {
              lo[t] = V::or_and(lo[t], V::template shift16<4 - 2 * J>(hv[t]), V::c8(0x10));
              hi[t] = V::or_and(hi[t], V::template shift16<3 - 2 * J>(hv[t]), V::c8(0x10));
            } else if constexpr (QT == kQ6_K) {
              constexpr int T = J % 2;
              const I h2 = V::load(gp[t] + kLow4 + 64 * (J / 2));
              lo[t] = V::or_and(lo[t], V::template shift16<4 - 4 * T>(h2), V::c8(0x30));
              hi[t] = V::or_and(hi[t], V::template shift16<2 - 4 * T>(h2), V::c8(0x30));
            }
          }
          dot(false, lo, 4 * J);
          dot(sub16, hi, 16 + 4 * J);
        });
      } else if constexpr (has_low2(QT)) {
        I hb[NT];
        for (int t = 0; t < NT; ++t) hb[t] = QT == kQ3_K ? V::load(gp[t] + kLow2) : V::zero();
        unroll(std::make_integer_sequence<int, 8>{}, [&](auto sc) {
          constexpr int S = decltype(sc)::value;
          I u[NT];
          for (int t = 0; t < NT; ++t) {
            u[t] = V::and_(V::template shift16<-2 * (S % 4)>(V::load(gp[t] + 64 * (S / 4))), V::c8(0x03));
            if constexpr (QT == kQ3_K) u[t] = V::or_and(u[t], V::template shift16<2 - S>(hb[t]), V::c8(0x04));
          }
          dot(S >= 4, u, 4 * S);
        });
      } else {  // Q8_0
        unroll(std::make_integer_sequence<int, 8>{}, [&](auto sc) {
          constexpr int S = decltype(sc)::value;
          if constexpr (V::kVnni) {
            I u[NT];
            for (int t = 0; t < NT; ++t) u[t] = V::xor_(V::load(gp[t] + 64 * S), V::c8(0x80));  // u = w + 128
            dot(false, u, 4 * S);
          } else {
            for (int t = 0; t < NT; ++t) {
              const I w = V::load(gp[t] + 64 * S);
              const I aw = V::abs8(w);
              for (int m = 0; m < MT; ++m) {
                acc0[t][m] = V::dot(acc0[t][m], aw, V::sign8(V::bcast4(a.q[m] + 32 * gi + 4 * S), w));
                if constexpr (SPLIT)
                  low0[t][m] = V::dot(low0[t][m], aw, V::sign8(V::bcast4(a.lo[m] + 32 * gi + 4 * S), w));
              }
            }
          }
        });
      }

      for (int t = 0; t < NT; ++t) {
        if constexpr (SPLIT) {
          for (int m = 0; m < MT; ++m) {
            acc0[t][m] = V::add(V::template slli32<7>(acc0[t][m]), low0[t][m]);
            acc1[t][m] = V::add(V::template slli32<7>(acc1[t][m]), low1[t][m]);
          }
        }

        // The group in float.
        if constexpr (sub16) {
          const uint8_t* s0p = tb[t] + h.sc + 16 * (2 * g) + row0;
          const uint8_t* s1p = s0p + 16;
          if constexpr (QT == kQ2_K) {
            const I s0 = V::lanes_u8(s0p), s1 = V::lanes_u8(s1p), low = V::set1(15);
            const I sc0 = V::and_(s0, low), sc1 = V::and_(s1, low);
            const I mn0 = V::template srli32<4>(s0), mn1 = V::template srli32<4>(s1);
            for (int m = 0; m < MT; ++m) {
              const I tot = V::add(V::mullo(acc0[t][m], sc0), V::mullo(acc1[t][m], sc1));
              const int32_t* qs = a.qs16[m] + 2 * gi;
              const I mins = V::add(V::mullo(V::set1(qs[0]), mn0), V::mullo(V::set1(qs[1]), mn1));
              const F dx = V::fset1(a.dx[m][gi]);
              facc[t][m] = V::fma(V::cvt(tot), V::mul(d[t], dx), facc[t][m]);
              facc[t][m] = V::fnmadd(V::cvt(mins), V::mul(dm[t], dx), facc[t][m]);
            }
          } else {
            constexpr int off = QT == kQ6_K ? 32 : 4;
            const I sc0 = V::lanes_s8(s0p), sc1 = V::lanes_s8(s1p);
            for (int m = 0; m < MT; ++m) {
              const int32_t* qs = a.qs16[m] + 2 * gi;
              const I t0 = V::sub(acc0[t][m], V::set1(off * qs[0])), t1 = V::sub(acc1[t][m], V::set1(off * qs[1]));
              const I tot = V::add(V::mullo(t0, sc0), V::mullo(t1, sc1));
              facc[t][m] = V::fma(V::cvt(tot), V::mul(d[t], V::fset1(a.dx[m][gi])), facc[t][m]);
            }
          }
        } else {
          constexpr int off = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : (QT == kQ8_0 && V::kVnni) ? 128 : 0;
          F scale = d[t], minimum = V::fzero();
          if constexpr (QT == kQ4_K || QT == kQ5_K) {
            scale = V::mul(d[t], V::cvt(V::lanes_u8(tb[t] + h.sc + 16 * g + row0)));
            minimum = V::mul(dm[t], V::cvt(V::lanes_u8(tb[t] + h.mn + 16 * g + row0)));
          }
          for (int m = 0; m < MT; ++m) {
            I acc = acc0[t][m];
            if constexpr (off != 0) {
              const int32_t* qs = a.qs16[m] + 2 * gi;
              acc = V::sub(acc, V::set1(off * (qs[0] + qs[1])));
            }
            facc[t][m] = V::fma(V::cvt(acc), V::mul(scale, V::fset1(a.dx[m][gi])), facc[t][m]);
            if constexpr (QT == kQ4_1 || QT == kQ5_1) facc[t][m] = V::fma(dm[t], V::fset1(a.xs[m][gi]), facc[t][m]);
            if constexpr (QT == kQ4_K || QT == kQ5_K)
              facc[t][m] = V::fnmadd(minimum, V::fset1(a.xs[m][gi]), facc[t][m]);
          }
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    for (int m = 0; m < MT; ++m) {
      float* o = out[m] + row0 + kTileRows * t;
      V::storef(o, accumulate ? V::add(V::loadf(o), facc[t][m]) : facc[t][m]);
    }
  }
}

// Float weights (F32/F16/BF16), the file's row-major layout: nr <= 4 rows against MT activation rows.
template <int QT, int MT>
inline void float_rows(const uint8_t* w, int64_t stride, int nr, int64_t k, const float* const* x, float* const* out,
                       bool accumulate) {
  using F = typename V::F;
  constexpr int es = QT == kF32 ? 4 : 2;
  F acc[4][MT];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = V::fzero();
  auto load = [&](const uint8_t* p) {
    if constexpr (QT == kF32) return V::loadf(reinterpret_cast<const float*>(p));
    else if constexpr (QT == kF16) return V::load_f16(p);
    else return V::load_bf16(p);
  };
  const int64_t main = k - k % V::W;
  for (int64_t c = 0; c < main; c += V::W) {
    F xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = V::loadf(x[m] + c);
    for (int r = 0; r < 4; ++r) {
      if (r >= nr) break;
      const F wv = load(w + r * stride + c * es);
      for (int m = 0; m < MT; ++m) acc[r][m] = V::fma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < nr; ++r) {
    const uint8_t* row = w + r * stride;
    for (int m = 0; m < MT; ++m) {
      float s = V::hsum(acc[r][m]);
      for (int64_t c = main; c < k; ++c) {
        float wc;
        if constexpr (QT == kF32) std::memcpy(&wc, row + 4 * c, 4);
        else if constexpr (QT == kF16) wc = fp16_to_float(load16(row + 2 * c));
        else wc = bf16_to_float(load16(row + 2 * c));
        s += wc * x[m][c];
      }
      out[m][r] = accumulate ? out[m][r] + s : s;
    }
  }
}

template <int QT, bool SPLIT>
inline void packed_dispatch_mt(const uint8_t* tile, int64_t nblocks, const ActRows& a, int mt, float* const* out,
                               bool accumulate) {
  for (int row0 = 0; row0 < kTileRows; row0 += V::W) {
    switch (mt) {
      case 1: packed_tile<QT, 1, SPLIT>(tile, nblocks, a, row0, out, accumulate); break;
      case 2: packed_tile<QT, 2, SPLIT>(tile, nblocks, a, row0, out, accumulate); break;
      case 3: packed_tile<QT, 3, SPLIT>(tile, nblocks, a, row0, out, accumulate); break;
      default: packed_tile<QT, 4, SPLIT>(tile, nblocks, a, row0, out, accumulate); break;
    }
  }
}

// fn(std::integral_constant<int, QT>) for the packed format qtype: one switch for every entry point.
template <class Fn>
inline void with_packed_type(int qtype, Fn&& fn) {
  switch (qtype) {
    case kQ4_0: fn(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int, kQ4_1>{}); break;
    case kQ5_0: fn(std::integral_constant<int, kQ5_0>{}); break;
    case kQ5_1: fn(std::integral_constant<int, kQ5_1>{}); break;
    case kQ8_0: fn(std::integral_constant<int, kQ8_0>{}); break;
    case kQ2_K: fn(std::integral_constant<int, kQ2_K>{}); break;
    case kQ3_K: fn(std::integral_constant<int, kQ3_K>{}); break;
    case kQ4_K: fn(std::integral_constant<int, kQ4_K>{}); break;
    case kQ5_K: fn(std::integral_constant<int, kQ5_K>{}); break;
    case kQ6_K: fn(std::integral_constant<int, kQ6_K>{}); break;
    default: break;
  }
}

// Two neighbouring full tiles (tile_bytes apart) against one activation row, the weight stream of a batch-1
// step; out[0] points at the first tile's first column, the second's 16 columns on.
inline void run_packed_pair(int qtype, const uint8_t* tile, int64_t tile_bytes, int64_t nblocks, const ActRows& a,
                            float* const* out, bool accumulate) {
  with_packed_type(qtype, [&](auto q) {
    constexpr int QT = decltype(q)::value;
    for (int row0 = 0; row0 < kTileRows; row0 += V::W) {
      if (a.lo[0] != nullptr) packed_tile<QT, 1, true, 2>(tile, nblocks, a, row0, out, accumulate, tile_bytes);
      else packed_tile<QT, 1, false, 2>(tile, nblocks, a, row0, out, accumulate, tile_bytes);
    }
  });
}

// Rows [0, 16) of one packed tile against mt (1..4) activation rows; out[m] points at the tile's first column.
// The activations are split in two planes (15 bits) when a.lo is set, else int8.
inline void run_packed(int qtype, const uint8_t* tile, int64_t nblocks, const ActRows& a, int mt, float* const* out,
                       bool accumulate) {
  with_packed_type(qtype, [&](auto q) {
    constexpr int QT = decltype(q)::value;
    if (a.lo[0] != nullptr) packed_dispatch_mt<QT, true>(tile, nblocks, a, mt, out, accumulate);
    else packed_dispatch_mt<QT, false>(tile, nblocks, a, mt, out, accumulate);
  });
}

template <int QT>
inline void float_dispatch_mt(const uint8_t* w, int64_t stride, int nr, int64_t k, const float* const* x, int mt,
                              float* const* out, bool accumulate) {
  switch (mt) {
    case 1: float_rows<QT, 1>(w, stride, nr, k, x, out, accumulate); break;
    default: float_rows<QT, 2>(w, stride, nr, k, x, out, accumulate); break;
  }
}

// nr (1..4) float rows against mt (1..2) activation rows; out[m] points at the first row's column.
inline void run_float(int qtype, const uint8_t* w, int64_t stride, int nr, int64_t k, const float* const* x, int mt,
                      float* const* out, bool accumulate) {
  switch (qtype) {
    case kF32: float_dispatch_mt<kF32>(w, stride, nr, k, x, mt, out, accumulate); break;
    case kF16: float_dispatch_mt<kF16>(w, stride, nr, k, x, mt, out, accumulate); break;
    case kBF16: float_dispatch_mt<kBF16>(w, stride, nr, k, x, mt, out, accumulate); break;
    default: break;
  }
}
