// 256-bit vector operations for the quantized kernels: one register holds 8 rows' lanes, so a 16-row tile
// is two halves. HQ_DOT selects the 4-way u8 x s8 dot product: 2 = AVX-VNNI (VEX vpdpbusd), 1 = AVX-512 VNNI
// with VL (the same instruction, EVEX-encoded), 0 = AVX2 (vpmaddubsw + vpmaddwd: pair sums saturate at
// 16 bits, which no format reaches: see quant_kernels.h). Included inside a namespace compiled for the
// matching features (quant_matmul.cpp).

struct V {
  using I = __m256i;
  using F = __m256;
  static constexpr int W = 8;
  static constexpr bool kVnni = HQ_DOT != 0;

  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I c8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I or_and(I a, I b, I mask) { return _mm256_or_si256(a, _mm256_and_si256(b, mask)); }
  template <int S>
  static I shift16(I v) {
    if constexpr (S > 0) return _mm256_slli_epi16(v, S);
    else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
    else return v;
  }
  template <int S>
  static I srli32(I v) { return _mm256_srli_epi32(v, S); }
  template <int S>
  static I slli32(I v) { return _mm256_slli_epi32(v, S); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I dot(I acc, I u, I x) {
#if HQ_DOT == 2
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#elif HQ_DOT == 1
    return _mm256_dpbusd_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
  }
  static I abs8(I v) { return _mm256_abs_epi8(v); }
  static I sign8(I x, I w) { return _mm256_sign_epi8(x, w); }
  static I lanes_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I lanes_s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F load_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load_bf16(const uint8_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static float hsum(F v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
};
