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
// AVX2's pair sums saturate at 16 bits: 2 * u * |q| with |q| <= 127 (each plane) stays below 32767 for
// u <= 63, the largest u of every format but Q8_0, which AVX2 runs as |w| x sign(q, w) (|w| <= 128).

template <int... Js, class Fn>
inline void unroll(std::integer_sequence<int, Js...>, Fn&& fn) {
  (fn(std::integral_constant<int, Js>{}), ...);
}

template <int QT, int MT, bool SPLIT>
inline void packed_tile(const uint8_t* tile, int64_t nblocks, const ActRows& a, int row0, float* const* out,
                        bool accumulate) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr Format f = format_of(QT);
  constexpr Head h = head_of(QT);
  constexpr int TB = tile_block_bytes(QT);
  constexpr int G = f.block / 32;
  constexpr bool sub16 = QT == kQ6_K || QT == kQ3_K || QT == kQ2_K;
  const I m0f = V::c8(0x0F);
  F facc[MT];
  for (int m = 0; m < MT; ++m) facc[m] = V::fzero();

  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* tb = tile + b * TB;
    const F d = V::load_f16(tb + 2 * row0);
    F dm = V::fzero();
    if constexpr (h.dm >= 0) dm = V::load_f16(tb + h.dm + 2 * row0);
    for (int g = 0; g < G; ++g) {
      const int64_t gi = b * G + g;  // this group's index along the row
      const uint8_t* gp = tb + f.head_bytes + g * f.group_bytes + 4 * row0;
      I acc0[MT], acc1[MT], low0[MT], low1[MT];  // low: the lo plane's sums (SPLIT)
      for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = low0[m] = low1[m] = V::zero();
      auto dot = [&](bool second, I u, int k) {
        I* acc = second ? acc1 : acc0;
        for (int m = 0; m < MT; ++m) acc[m] = V::dot(acc[m], u, V::bcast4(a.q[m] + 32 * gi + k));
        if constexpr (SPLIT) {
          I* low = second ? low1 : low0;
          for (int m = 0; m < MT; ++m) low[m] = V::dot(low[m], u, V::bcast4(a.lo[m] + 32 * gi + k));
        }
      };

      if constexpr (has_low4(QT)) {
        I hv = V::zero();
        if constexpr (has_bit4(QT)) hv = V::load(gp + kLow4);
        unroll(std::make_integer_sequence<int, 4>{}, [&](auto jc) {
          constexpr int J = decltype(jc)::value;
          const I v = V::load(gp + 64 * J);
          I lo = V::and_(v, m0f), hi = V::and_(V::template shift16<-4>(v), m0f);
          if constexpr (has_bit4(QT)) {
            lo = V::or_and(lo, V::template shift16<4 - 2 * J>(hv), V::c8(0x10));
            hi = V::or_and(hi, V::template shift16<3 - 2 * J>(hv), V::c8(0x10));
          } else if constexpr (QT == kQ6_K) {
            constexpr int T = J % 2;
            const I h2 = V::load(gp + kLow4 + 64 * (J / 2));
            lo = V::or_and(lo, V::template shift16<4 - 4 * T>(h2), V::c8(0x30));
            hi = V::or_and(hi, V::template shift16<2 - 4 * T>(h2), V::c8(0x30));
          }
          dot(false, lo, 4 * J);
          dot(sub16, hi, 16 + 4 * J);
        });
      } else if constexpr (has_low2(QT)) {
        I hb = V::zero();
        if constexpr (QT == kQ3_K) hb = V::load(gp + kLow2);
        unroll(std::make_integer_sequence<int, 8>{}, [&](auto sc) {
          constexpr int S = decltype(sc)::value;
          I u = V::and_(V::template shift16<-2 * (S % 4)>(V::load(gp + 64 * (S / 4))), V::c8(0x03));
          if constexpr (QT == kQ3_K) u = V::or_and(u, V::template shift16<2 - S>(hb), V::c8(0x04));
          dot(S >= 4, u, 4 * S);
        });
      } else {  // Q8_0
        unroll(std::make_integer_sequence<int, 8>{}, [&](auto sc) {
          constexpr int S = decltype(sc)::value;
          const I w = V::load(gp + 64 * S);
          if constexpr (V::kVnni) {
            dot(false, V::xor_(w, V::c8(0x80)), 4 * S);  // u = w + 128
          } else {
            const I aw = V::abs8(w);
            for (int m = 0; m < MT; ++m) {
              acc0[m] = V::dot(acc0[m], aw, V::sign8(V::bcast4(a.q[m] + 32 * gi + 4 * S), w));
              if constexpr (SPLIT)
                low0[m] = V::dot(low0[m], aw, V::sign8(V::bcast4(a.lo[m] + 32 * gi + 4 * S), w));
            }
          }
        });
      }
      if constexpr (SPLIT) {
        for (int m = 0; m < MT; ++m) {
          acc0[m] = V::add(V::template slli32<7>(acc0[m]), low0[m]);
          acc1[m] = V::add(V::template slli32<7>(acc1[m]), low1[m]);
        }
      }

      // The group in float.
      if constexpr (sub16) {
        const uint8_t* s0p = tb + h.sc + 16 * (2 * g) + row0;
        const uint8_t* s1p = s0p + 16;
        if constexpr (QT == kQ2_K) {
          const I s0 = V::lanes_u8(s0p), s1 = V::lanes_u8(s1p), low = V::set1(15);
          const I sc0 = V::and_(s0, low), sc1 = V::and_(s1, low);
          const I mn0 = V::template srli32<4>(s0), mn1 = V::template srli32<4>(s1);
          for (int m = 0; m < MT; ++m) {
            const I tot = V::add(V::mullo(acc0[m], sc0), V::mullo(acc1[m], sc1));
            const int32_t* qs = a.qs16[m] + 2 * gi;
            const I mins = V::add(V::mullo(V::set1(qs[0]), mn0), V::mullo(V::set1(qs[1]), mn1));
            const F dx = V::fset1(a.dx[m][gi]);
            facc[m] = V::fma(V::cvt(tot), V::mul(d, dx), facc[m]);
            facc[m] = V::fnmadd(V::cvt(mins), V::mul(dm, dx), facc[m]);
          }
        } else {
          constexpr int off = QT == kQ6_K ? 32 : 4;
          const I sc0 = V::lanes_s8(s0p), sc1 = V::lanes_s8(s1p);
          for (int m = 0; m < MT; ++m) {
            const int32_t* qs = a.qs16[m] + 2 * gi;
            const I t0 = V::sub(acc0[m], V::set1(off * qs[0])), t1 = V::sub(acc1[m], V::set1(off * qs[1]));
            const I tot = V::add(V::mullo(t0, sc0), V::mullo(t1, sc1));
            facc[m] = V::fma(V::cvt(tot), V::mul(d, V::fset1(a.dx[m][gi])), facc[m]);
          }
        }
      } else {
        constexpr int off = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : (QT == kQ8_0 && V::kVnni) ? 128 : 0;
        F scale = d, minimum = V::fzero();
        if constexpr (QT == kQ4_K || QT == kQ5_K) {
          scale = V::mul(d, V::cvt(V::lanes_u8(tb + h.sc + 16 * g + row0)));
          minimum = V::mul(dm, V::cvt(V::lanes_u8(tb + h.mn + 16 * g + row0)));
        }
        for (int m = 0; m < MT; ++m) {
          I acc = acc0[m];
          if constexpr (off != 0) {
            const int32_t* qs = a.qs16[m] + 2 * gi;
            acc = V::sub(acc, V::set1(off * (qs[0] + qs[1])));
          }
          facc[m] = V::fma(V::cvt(acc), V::mul(scale, V::fset1(a.dx[m][gi])), facc[m]);
          if constexpr (QT == kQ4_1 || QT == kQ5_1) facc[m] = V::fma(dm, V::fset1(a.xs[m][gi]), facc[m]);
          if constexpr (QT == kQ4_K || QT == kQ5_K) facc[m] = V::fnmadd(minimum, V::fset1(a.xs[m][gi]), facc[m]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float* o = out[m] + row0;
    V::storef(o, accumulate ? V::add(V::loadf(o), facc[m]) : facc[m]);
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

template <bool SPLIT>
inline void run_packed_as(int qtype, const uint8_t* tile, int64_t nblocks, const ActRows& a, int mt,
                          float* const* out, bool accumulate) {
  switch (qtype) {
    case kQ4_0: packed_dispatch_mt<kQ4_0, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ4_1: packed_dispatch_mt<kQ4_1, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ5_0: packed_dispatch_mt<kQ5_0, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ5_1: packed_dispatch_mt<kQ5_1, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ8_0: packed_dispatch_mt<kQ8_0, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ2_K: packed_dispatch_mt<kQ2_K, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ3_K: packed_dispatch_mt<kQ3_K, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ4_K: packed_dispatch_mt<kQ4_K, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ5_K: packed_dispatch_mt<kQ5_K, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    case kQ6_K: packed_dispatch_mt<kQ6_K, SPLIT>(tile, nblocks, a, mt, out, accumulate); break;
    default: break;
  }
}

// Rows [0, 16) of one packed tile against mt (1..4) activation rows; out[m] points at the tile's first column.
// The activations are split in two planes (15 bits) when a.lo is set, else int8.
inline void run_packed(int qtype, const uint8_t* tile, int64_t nblocks, const ActRows& a, int mt, float* const* out,
                       bool accumulate) {
  if (a.lo[0] != nullptr) run_packed_as<true>(qtype, tile, nblocks, a, mt, out, accumulate);
  else run_packed_as<false>(qtype, tile, nblocks, a, mt, out, accumulate);
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
