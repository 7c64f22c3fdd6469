// 512-bit vector operations for the quantized kernels (AVX-512 F/BW/VL/VNNI): one register holds 16 rows'
// lanes. Included inside a namespace compiled for those features (quant_matmul.cpp).

struct V {
  using I = __m512i;
  using F = __m512;
  static constexpr int W = 16;  // rows per register
  static constexpr bool kVnni = true;

  static I load(const uint8_t* p) { return _mm512_loadu_si512(reinterpret_cast<const void*>(p)); }
  static I zero() { return _mm512_setzero_si512(); }
  static I c8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I or_and(I a, I b, I mask) { return _mm512_ternarylogic_epi32(a, b, mask, 0xF8); }  // a | (b & mask)
  template <int S>
  static I shift16(I v) {  // left by S (right by -S), 16-bit lanes
    if constexpr (S > 0) return _mm512_slli_epi16(v, S);
    else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
    else return v;
  }
  template <int S>
  static I srli32(I v) { return _mm512_srli_epi32(v, S); }
  template <int S>
  static I slli32(I v) { return _mm512_slli_epi32(v, S); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I dot(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }  // u8 x s8, 4 per lane
  static I abs8(I v) { return _mm512_abs_epi8(v); }
  static I sign8(I x, I w) {  // x negated where w < 0 (AVX-512 has no vpsignb)
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
  static I lanes_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I lanes_s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
  static F load_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F load_bf16(const uint8_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
};
