// offloadopt's SIMD layer: one `struct V` per instruction set, with the same names in each, so
// the kernel's body (adam_body.h) is written once and compiled once per ISA.
//
// No include guard: adam_cpu.cpp includes this file once per ISA, inside that ISA's namespace
// and its `#pragma GCC target` region, with exactly one of OO_SIMD_AVX512, OO_SIMD_AVX2,
// OO_SIMD_GENERIC defined. <immintrin.h> and <cstdint> are included by the caller first.
//
//   ISA       lanes  registers       masks                  target
//   AVX-512   16     zmm             __mmask16 (k regs)      avx512f,avx512bw,avx512vl,avx512dq
//   AVX2      8      ymm             all-ones lanes in ymm   avx2,fma
//   generic   8      plain arrays    all-ones lanes          the build's baseline (any CPU)
//
// Every floating-point operation here is a correctly rounded IEEE operation (add, sub, mul,
// div, sqrt, fma), and everything else is integer bit manipulation, so the three give the same
// bits for the same inputs (tests/test_kernels.py runs all three on one host). No approximate
// reciprocal or rsqrt: rcp14/rsqrt14 and rcpps/rsqrtps give different bits on AVX-512 and AVX2
// and between vendors (ispc#2882, xsimd#790).
//
// Names: F a vector of fp32, I of uint32, M a lane mask. sel(m, a, b): a where m, else b.
// isnan2(a, b): the lanes where a or b is NaN; mor: or of masks; any: a lane set.
// ld_bf16 widens bf16 to fp32 (exact); st_u16 stores the low 16 bits of each lane.
// H: 2W uint16 lanes in one register (int8 codes as bf16 patterns, half the ops of 32-bit
// lanes). ld_s8h / ld_u8h load 2W bytes sign / zero extended, in an order of the ISA's own that
// hi16_lo / hi16_hi turn into the paired order below, each code in the high 16 bits of a 32-bit
// lane (low bits 0). addnz16(x, t, c): x + c where t != 0 (t in 0..0x7FFF), else x.
//
// The paired order: 2W elements in two vectors a, b. With 128-bit lanes (AVX2, AVX-512) lane k
// of a holds elements 8k..8k+3 and lane k of b 8k+4..8k+7: the order in which unpacklo /
// unpackhi of 16-bit lanes widen and packus_epi32 narrows, so a pair of bf16 vectors loads in
// one instruction a vector (not two) and stores in one (not three); fp32 pairs cost one
// shuffle a vector. Generic: the same order, by index. The lanes are independent but for the
// master's random draw, one hash for the elements of one lane of a and b (j, j + 4: rounding.py);
// each lane's counter is its own element's (iota2).
// ld2_bf16 / ld2f load a pair, st2_u16 / st2f store one (st2_u16_stream: p kStreamAlign2
// aligned). B: 4W bytes; pack8 narrows two pairs' signed lanes to bytes, each clamped to 0..255
// (packs then packus), in an order of the ISA's own that st_u8 stores in element order
// (maxu8 / minu8 work lane by lane, in any order); st_u8x4 = st_u8 of pack8.

#if defined(OO_SIMD_AVX512)

struct V {
  static constexpr int W = 16;
  static constexpr const char* name = "avx512";
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static inline F ldf(const float* p) { return _mm512_loadu_ps(p); }
  static inline void stf(float* p, F x) { _mm512_storeu_ps(p, x); }
  static inline F ld_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static inline void st_u16(uint16_t* p, I x) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(x)); }
  // st_u16 with a streaming (non-temporal) store: p 32-byte aligned
  static inline void st_u16_stream(uint16_t* p, I x) { _mm256_stream_si256((__m256i*)p, _mm512_cvtepi32_epi16(x)); }
  static constexpr int kStreamAlign = 32;
  static inline F setf(float x) { return _mm512_set1_ps(x); }
  static inline I seti(uint32_t x) { return _mm512_set1_epi32((int)x); }
  static inline I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a*b + c, one rounding
  static inline I bits(F a) { return _mm512_castps_si512(a); }
  static inline F flt(I a) { return _mm512_castsi512_ps(a); }
  static inline I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static inline I band(I a, I b) { return _mm512_and_si512(a, b); }
  static inline I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static inline I bxor(I a, I b) { return _mm512_xor_si512(a, b); }
  static inline I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static inline I maxu(I a, I b) { return _mm512_max_epu32(a, b); }
  static inline I maxs(I a, I b) { return _mm512_max_epi32(a, b); }
  static inline I minu(I a, I b) { return _mm512_min_epu32(a, b); }
  template <int S> static inline I srl(I a) { return _mm512_srli_epi32(a, S); }
  template <int S> static inline I sll(I a) { return _mm512_slli_epi32(a, S); }
  template <int S> static inline I sra(I a) { return _mm512_srai_epi32(a, S); }
  static inline M lt_u(I a, I b) { return _mm512_cmplt_epu32_mask(a, b); }
  static inline M isnan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static inline M isnan2(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  static inline M none() { return 0; }
  static inline M mor(M a, M b) { return (M)(a | b); }
  static inline bool any(M m) { return m != 0; }
  static inline I sel(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }
  static inline F sel(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  static inline I keep_nonzero(I x, I a) { return _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(x, x), a); }
  static inline uint32_t hmaxu(I a) { return _mm512_reduce_max_epu32(a); }
  static inline M lanes_from(int k) { return (M)(k >= W ? 0 : (0xFFFFu << k)); }  // lanes >= k
  // the paired order (above)
  static inline void iota2(I& a, I& b) {
    a = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    b = _mm512_add_epi32(a, _mm512_set1_epi32(4));
  }
  static inline void ld2_bf16(const uint16_t* p, F& a, F& b) {
    const __m512i x = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
    a = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
    b = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
  }
  static inline void ld2f(const float* p, F& a, F& b) {  // a: lanes 0, 2 of each half; b: 1, 3
    const F x = _mm512_loadu_ps(p), y = _mm512_loadu_ps(p + 16);
    a = _mm512_shuffle_f32x4(x, y, 0x88);
    b = _mm512_shuffle_f32x4(x, y, 0xDD);
  }
  static inline void st2f(float* p, F a, F b) {
    const I lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    _mm512_storeu_ps(p, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(a, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), b));
  }
  static inline void st2_u16(uint16_t* p, I a, I b) { _mm512_storeu_si512(p, _mm512_packus_epi32(a, b)); }
  static inline void st2_u16_stream(uint16_t* p, I a, I b) { _mm512_stream_si512((__m512i*)p, _mm512_packus_epi32(a, b)); }
  static constexpr int kStreamAlign2 = 64;
  // packed to 16 then 8 bits within 128-bit lanes; st_u8 puts the qwords in order
  using B = __m512i;
  static inline B pack8(I a, I b, I c, I d) {
    return _mm512_packus_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
  }
  static inline void st_u8(uint8_t* p, B x) {
    _mm512_storeu_si512(p, _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), x));
  }
  static inline void st_u8x4(uint8_t* p, I a, I b, I c, I d) { st_u8(p, pack8(a, b, c, d)); }
  static inline B set8(uint8_t x) { return _mm512_set1_epi8((char)x); }
  static inline B maxu8(B a, B b) { return _mm512_max_epu8(a, b); }
  static inline B minu8(B a, B b) { return _mm512_min_epu8(a, b); }
  using H = __m512i;
  static inline H ld_s8h(const uint8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
  static inline H ld_u8h(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
  static inline H set16(uint16_t x) { return _mm512_set1_epi16((short)x); }
  static inline H and16(H a, H b) { return _mm512_and_si512(a, b); }
  template <int S> static inline H sll16(H a) { return _mm512_slli_epi16(a, S); }
  static inline H addnz16(H x, H t, H c) { return _mm512_mask_add_epi16(x, _mm512_test_epi16_mask(t, t), x, c); }
  static inline I hi16_lo(H h) { return _mm512_unpacklo_epi16(_mm512_setzero_si512(), h); }
  static inline I hi16_hi(H h) { return _mm512_unpackhi_epi16(_mm512_setzero_si512(), h); }
};

#elif defined(OO_SIMD_AVX2)

struct V {
  static constexpr int W = 8;
  static constexpr const char* name = "avx2";
  using F = __m256;
  using I = __m256i;
  using M = __m256i;
  static inline F ldf(const float* p) { return _mm256_loadu_ps(p); }
  static inline void stf(float* p, F x) { _mm256_storeu_ps(p, x); }
  static inline F ld_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static inline __m128i pack_u16(I x) {
    // the low two bytes of each 32-bit lane to the low 8 bytes of each 128-bit half, then the
    // two halves' 8 bytes side by side
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, pick), 0x08));
  }
  static inline void st_u16(uint16_t* p, I x) { _mm_storeu_si128((__m128i*)p, pack_u16(x)); }
  static inline void st_u16_stream(uint16_t* p, I x) { _mm_stream_si128((__m128i*)p, pack_u16(x)); }
  static constexpr int kStreamAlign = 16;
  static inline F setf(float x) { return _mm256_set1_ps(x); }
  static inline I seti(uint32_t x) { return _mm256_set1_epi32((int)x); }
  static inline I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline I bits(F a) { return _mm256_castps_si256(a); }
  static inline F flt(I a) { return _mm256_castsi256_ps(a); }
  static inline I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static inline I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static inline I band(I a, I b) { return _mm256_and_si256(a, b); }
  static inline I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static inline I bxor(I a, I b) { return _mm256_xor_si256(a, b); }
  static inline I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static inline I maxu(I a, I b) { return _mm256_max_epu32(a, b); }
  static inline I maxs(I a, I b) { return _mm256_max_epi32(a, b); }
  static inline I minu(I a, I b) { return _mm256_min_epu32(a, b); }
  template <int S> static inline I srl(I a) { return _mm256_srli_epi32(a, S); }
  template <int S> static inline I sll(I a) { return _mm256_slli_epi32(a, S); }
  template <int S> static inline I sra(I a) { return _mm256_srai_epi32(a, S); }
  static inline M lt_u(I a, I b) {  // no unsigned compare in AVX2: a < b iff max(a, b) != a
    return _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(a, b), a), _mm256_set1_epi32(-1));
  }
  static inline M isnan(F a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  static inline M isnan2(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
  static inline M none() { return _mm256_setzero_si256(); }
  static inline M mor(M a, M b) { return _mm256_or_si256(a, b); }
  static inline bool any(M m) { return !_mm256_testz_si256(m, m); }
  static inline I sel(M m, I a, I b) { return _mm256_blendv_epi8(b, a, m); }
  static inline F sel(M m, F a, F b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
  static inline I keep_nonzero(I x, I a) { return _mm256_andnot_si256(_mm256_cmpeq_epi32(x, _mm256_setzero_si256()), a); }
  // the paired order (above)
  static inline void iota2(I& a, I& b) {
    a = _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11);
    b = _mm256_add_epi32(a, _mm256_set1_epi32(4));
  }
  static inline void ld2_bf16(const uint16_t* p, F& a, F& b) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)p), z = _mm256_setzero_si256();
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
  }
  static inline void ld2f(const float* p, F& a, F& b) {
    a = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm_loadu_ps(p + 8), 1);
    b = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + 4)), _mm_loadu_ps(p + 12), 1);
  }
  static inline void st2f(float* p, F a, F b) {
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
  static inline void st2_u16(uint16_t* p, I a, I b) { _mm256_storeu_si256((__m256i*)p, _mm256_packus_epi32(a, b)); }
  static inline void st2_u16_stream(uint16_t* p, I a, I b) { _mm256_stream_si256((__m256i*)p, _mm256_packus_epi32(a, b)); }
  static constexpr int kStreamAlign2 = 32;
  // packed to 16 then 8 bits within 128-bit halves; st_u8 puts the qwords in order
  using B = __m256i;
  static inline B pack8(I a, I b, I c, I d) {
    return _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  }
  static inline void st_u8(uint8_t* p, B x) { _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(x, 0xD8)); }
  static inline void st_u8x4(uint8_t* p, I a, I b, I c, I d) { st_u8(p, pack8(a, b, c, d)); }
  static inline B set8(uint8_t x) { return _mm256_set1_epi8((char)x); }
  static inline B maxu8(B a, B b) { return _mm256_max_epu8(a, b); }
  static inline B minu8(B a, B b) { return _mm256_min_epu8(a, b); }
  static inline uint32_t hmaxu(I a) {
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(x);
  }
  static inline M lanes_from(int k) { return _mm256_cmpgt_epi32(iota(), _mm256_set1_epi32(k - 1)); }
  using H = __m256i;
  static inline H ld_s8h(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
  static inline H ld_u8h(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); }
  static inline H set16(uint16_t x) { return _mm256_set1_epi16((short)x); }
  static inline H and16(H a, H b) { return _mm256_and_si256(a, b); }
  template <int S> static inline H sll16(H a) { return _mm256_slli_epi16(a, S); }
  static inline H addnz16(H x, H t, H c) { return _mm256_add_epi16(x, _mm256_sign_epi16(c, t)); }  // sign: c, 0 where t == 0
  static inline I hi16_lo(H h) { return _mm256_unpacklo_epi16(_mm256_setzero_si256(), h); }
  static inline I hi16_hi(H h) { return _mm256_unpackhi_epi16(_mm256_setzero_si256(), h); }
};

#elif defined(OO_SIMD_GENERIC)

// Plain arrays of 8 lanes: what any C++ compiler builds (the fallback off x86, and the
// same-shape reference the tests run beside the vector builds). -ffp-contract=off keeps a*b+c
// two roundings, as the intrinsics are; std::fma is the one fused operation.
struct V {
  static constexpr int W = 8;
  static constexpr const char* name = "generic";
  struct F { float v[8]; };
  struct I { uint32_t v[8]; };
  using M = I;
#define OO_LANES(expr) for (int l = 0; l < 8; ++l) { expr; }
  static inline F ldf(const float* p) { F r; std::memcpy(r.v, p, 32); return r; }
  static inline void stf(float* p, F x) { std::memcpy(p, x.v, 32); }
  static inline F ld_bf16(const uint16_t* p) { I r; OO_LANES(r.v[l] = (uint32_t)p[l] << 16) return flt(r); }
  static inline void st_u16(uint16_t* p, I x) { OO_LANES(p[l] = (uint16_t)x.v[l]) }
  static inline void st_u16_stream(uint16_t* p, I x) { st_u16(p, x); }
  static constexpr int kStreamAlign = 1;
  static inline F setf(float x) { F r; OO_LANES(r.v[l] = x) return r; }
  static inline I seti(uint32_t x) { I r; OO_LANES(r.v[l] = x) return r; }
  static inline I iota() { I r; OO_LANES(r.v[l] = (uint32_t)l) return r; }
  static inline F add(F a, F b) { OO_LANES(a.v[l] = a.v[l] + b.v[l]) return a; }
  static inline F sub(F a, F b) { OO_LANES(a.v[l] = a.v[l] - b.v[l]) return a; }
  static inline F mul(F a, F b) { OO_LANES(a.v[l] = a.v[l] * b.v[l]) return a; }
  static inline F div(F a, F b) { OO_LANES(a.v[l] = a.v[l] / b.v[l]) return a; }
  static inline F sqrt(F a) { OO_LANES(a.v[l] = std::sqrt(a.v[l])) return a; }
  static inline F fma(F a, F b, F c) { OO_LANES(a.v[l] = std::fma(a.v[l], b.v[l], c.v[l])) return a; }
  static inline I bits(F a) { I r; std::memcpy(r.v, a.v, 32); return r; }
  static inline F flt(I a) { F r; std::memcpy(r.v, a.v, 32); return r; }
  static inline I add(I a, I b) { OO_LANES(a.v[l] += b.v[l]) return a; }
  static inline I sub(I a, I b) { OO_LANES(a.v[l] -= b.v[l]) return a; }
  static inline I band(I a, I b) { OO_LANES(a.v[l] &= b.v[l]) return a; }
  static inline I bor(I a, I b) { OO_LANES(a.v[l] |= b.v[l]) return a; }
  static inline I bxor(I a, I b) { OO_LANES(a.v[l] ^= b.v[l]) return a; }
  static inline I mullo(I a, I b) { OO_LANES(a.v[l] *= b.v[l]) return a; }
  static inline I maxu(I a, I b) { OO_LANES(a.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]) return a; }
  static inline I maxs(I a, I b) { OO_LANES(a.v[l] = (int32_t)a.v[l] > (int32_t)b.v[l] ? a.v[l] : b.v[l]) return a; }
  static inline I minu(I a, I b) { OO_LANES(a.v[l] = a.v[l] < b.v[l] ? a.v[l] : b.v[l]) return a; }
  template <int S> static inline I srl(I a) { OO_LANES(a.v[l] >>= S) return a; }
  template <int S> static inline I sll(I a) { OO_LANES(a.v[l] <<= S) return a; }
  template <int S> static inline I sra(I a) { OO_LANES(a.v[l] = (uint32_t)((int32_t)a.v[l] >> S)) return a; }
  static inline M lt_u(I a, I b) { OO_LANES(a.v[l] = a.v[l] < b.v[l] ? ~0u : 0u) return a; }
  static inline M isnan(F a) { I r; OO_LANES(r.v[l] = a.v[l] != a.v[l] ? ~0u : 0u) return r; }
  static inline M isnan2(F a, F b) { I r; OO_LANES(r.v[l] = a.v[l] != a.v[l] || b.v[l] != b.v[l] ? ~0u : 0u) return r; }
  static inline M none() { return seti(0u); }
  static inline M mor(M a, M b) { return bor(a, b); }
  static inline bool any(M m) { return hmaxu(m) != 0; }
  static inline I sel(M m, I a, I b) { OO_LANES(a.v[l] = (a.v[l] & m.v[l]) | (b.v[l] & ~m.v[l])) return a; }
  static inline F sel(M m, F a, F b) { return flt(sel(m, bits(a), bits(b))); }
  static inline I keep_nonzero(I x, I a) { OO_LANES(a.v[l] = x.v[l] ? a.v[l] : 0u) return a; }
  // the paired order of the vector builds (lane l of a: element (l & 3) + (l >> 2) * 8; of b: 4
  // more), so that one lane of a and b holds elements j and j + 4 as there (rounding.py: the
  // master's draw)
  static inline int pj(int l) { return (l & 3) + ((l >> 2) << 3); }
  struct B { uint8_t v[32]; };  // in element order
  static inline B pack8(I a, I b, I c, I d) {
    const I* x[4] = {&a, &b, &c, &d};
    B r;
    for (int u = 0; u < 4; ++u)
      OO_LANES(const int32_t y = (int32_t)x[u]->v[l]; r.v[(u >> 1) * 16 + (u & 1) * 4 + pj(l)] = (uint8_t)(y < 0 ? 0 : y > 255 ? 255 : y))
    return r;
  }
  static inline void st_u8(uint8_t* p, B x) { std::memcpy(p, x.v, 32); }
  static inline void st_u8x4(uint8_t* p, I a, I b, I c, I d) { st_u8(p, pack8(a, b, c, d)); }
  static inline B set8(uint8_t x) { B r; std::memset(r.v, x, 32); return r; }
  static inline B maxu8(B a, B b) { for (int l = 0; l < 32; ++l) a.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]; return a; }
  static inline B minu8(B a, B b) { for (int l = 0; l < 32; ++l) a.v[l] = a.v[l] < b.v[l] ? a.v[l] : b.v[l]; return a; }
  static inline void iota2(I& a, I& b) { OO_LANES(a.v[l] = (uint32_t)pj(l)) b = add(a, seti(4u)); }
  static inline void ld2_bf16(const uint16_t* p, F& a, F& b) {
    I x, y;
    OO_LANES(x.v[l] = (uint32_t)p[pj(l)] << 16; y.v[l] = (uint32_t)p[pj(l) + 4] << 16)
    a = flt(x);
    b = flt(y);
  }
  static inline void ld2f(const float* p, F& a, F& b) { OO_LANES(a.v[l] = p[pj(l)]; b.v[l] = p[pj(l) + 4]) }
  static inline void st2f(float* p, F a, F b) { OO_LANES(p[pj(l)] = a.v[l]; p[pj(l) + 4] = b.v[l]) }
  static inline void st2_u16(uint16_t* p, I a, I b) { OO_LANES(p[pj(l)] = (uint16_t)a.v[l]; p[pj(l) + 4] = (uint16_t)b.v[l]) }
  static inline void st2_u16_stream(uint16_t* p, I a, I b) { st2_u16(p, a, b); }
  static constexpr int kStreamAlign2 = 1;
  static inline uint32_t hmaxu(I a) { uint32_t r = 0; OO_LANES(r = a.v[l] > r ? a.v[l] : r) return r; }
  static inline M lanes_from(int k) { I r; OO_LANES(r.v[l] = l >= k ? ~0u : 0u) return r; }
  struct H { uint16_t v[16]; };
  static inline H ld_s8h(const uint8_t* p) { H r; for (int l = 0; l < 16; ++l) r.v[l] = (uint16_t)(int16_t)(int8_t)p[l]; return r; }
  static inline H ld_u8h(const uint8_t* p) { H r; for (int l = 0; l < 16; ++l) r.v[l] = p[l]; return r; }
  static inline H set16(uint16_t x) { H r; for (int l = 0; l < 16; ++l) r.v[l] = x; return r; }
  static inline H and16(H a, H b) { for (int l = 0; l < 16; ++l) a.v[l] &= b.v[l]; return a; }
  template <int S> static inline H sll16(H a) { for (int l = 0; l < 16; ++l) a.v[l] = (uint16_t)(a.v[l] << S); return a; }
  static inline H addnz16(H x, H t, H c) { for (int l = 0; l < 16; ++l) x.v[l] = (uint16_t)(x.v[l] + (t.v[l] ? c.v[l] : 0)); return x; }
  static inline I hi16_lo(H h) { I r; OO_LANES(r.v[l] = (uint32_t)h.v[pj(l)] << 16) return r; }
  static inline I hi16_hi(H h) { I r; OO_LANES(r.v[l] = (uint32_t)h.v[pj(l) + 4] << 16) return r; }
#undef OO_LANES
};

#else
#error "simd.h: define one of OO_SIMD_AVX512, OO_SIMD_AVX2, OO_SIMD_GENERIC"
#endif
