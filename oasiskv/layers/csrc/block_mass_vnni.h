// The rerank kernel's avx512vnni tier (`block_mass.cpp` includes it inside its namespace,
// after its Args and GC_MAX): int8 codes, B = 16, d even.
#pragma once

// Each query head as int16: its largest |element| scaled to QMAX (so the error of an element is
// at most 2^-15 of that). A block's logits by vpdpwssd: per pair of dims, one vector of the 16
// tokens' two codes (widened to int16 and interleaved) times the head's two elements, summed
// exactly in int32, then scaled back once in fp32; the fp32 loops widen every code to fp32 and
// spend a multiply-add per dim and head. A quarter less time with the codes in cache; both
// remain bound by widening the dim-major codes (docs/results/2026-12-07-rerank-every-block.md).

constexpr int64_t VB = 16;  // a block's tokens: one vector of int32 sums
constexpr float QMAX = 16384.0f;

// q [G, d] -> pairs [G, d/2] (the int16 of dims 2i and 2i + 1 in one int32) and inv [G] (the
// factor back to q's scale); the scale keeps |sum| <= d * 128 * QMAX below 2^31
OASIS_INLINE void int16_pairs(const float* q, int64_t G, int64_t d, int32_t* pairs, float* inv) {
  const float top = std::min(QMAX, float(INT32_MAX / (d * 128)));
  for (int64_t g = 0; g < G; ++g) {
    float m = 0.0f;
    for (int64_t r = 0; r < d; ++r) m = std::max(m, std::fabs(q[g * d + r]));
    const float s = m > 0.0f ? top / m : 0.0f;
    inv[g] = m > 0.0f ? m / top : 0.0f;
    for (int64_t i = 0; i < d / 2; ++i) {
      const auto lo = uint16_t(int16_t(std::nearbyint(q[g * d + 2 * i] * s)));
      const auto hi = uint16_t(int16_t(std::nearbyint(q[g * d + 2 * i + 1] * s)));
      pairs[g * (d / 2) + i] = int32_t(uint32_t(lo) | (uint32_t(hi) << 16));
    }
  }
}

#ifdef OASIS_X86
// Dims 2i, 2i + 1 of a block (32 bytes: two rows of 16 tokens) as int16, interleaved: lane 2t
// <- token t of the first dim (lane t), lane 2t + 1 <- of the second (lane 16 + t)
__attribute__((target(OASIS_VNNI_TARGET))) inline __m512i two_dims(const uint8_t* blk,
                                                                    int64_t i) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * i * VB));
  return _mm512_permutexvar_epi16(idx, _mm512_cvtepi8_epi16(x));
}

// Logits of GC query heads (pairs [GC, d/2], inv [GC]) for one block's 16 tokens, times sc
template <int GC>
__attribute__((target(OASIS_VNNI_TARGET))) inline void vnni_head_logits(
    const uint8_t* blk, const int32_t* pairs, const float* inv, float sc, int64_t d, float* out) {
  const int64_t half = d / 2;
  __m512i a0[GC], a1[GC];  // two sets: independent chains
  for (int g = 0; g < GC; ++g) a0[g] = a1[g] = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 2 <= half; i += 2) {
    const __m512i x0 = two_dims(blk, i), x1 = two_dims(blk, i + 1);
    for (int g = 0; g < GC; ++g) {
      a0[g] = _mm512_dpwssd_epi32(a0[g], x0, _mm512_set1_epi32(pairs[g * half + i]));
      a1[g] = _mm512_dpwssd_epi32(a1[g], x1, _mm512_set1_epi32(pairs[g * half + i + 1]));
    }
  }
  if (i < half) {
    const __m512i x0 = two_dims(blk, i);
    for (int g = 0; g < GC; ++g)
      a0[g] = _mm512_dpwssd_epi32(a0[g], x0, _mm512_set1_epi32(pairs[g * half + i]));
  }
  for (int g = 0; g < GC; ++g)
    _mm512_storeu_ps(out + g * VB,
                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0[g], a1[g])),
                                   _mm512_set1_ps(sc * inv[g])));
}

__attribute__((target(OASIS_VNNI_TARGET))) inline void vnni_block_logits(
    const uint8_t* blk, const int32_t* pairs, const float* inv, float sc, const Args& a,
    float* lg) {
  const int64_t half = a.d / 2;
  for (int64_t g0 = 0; g0 < a.G; g0 += GC_MAX) {
    const int64_t gc = std::min<int64_t>(GC_MAX, a.G - g0);
    const int32_t* p = pairs + g0 * half;
    float* o = lg + g0 * VB;
    if (gc == 4) vnni_head_logits<4>(blk, p, inv + g0, sc, a.d, o);
    else if (gc == 3) vnni_head_logits<3>(blk, p, inv + g0, sc, a.d, o);
    else if (gc == 2) vnni_head_logits<2>(blk, p, inv + g0, sc, a.d, o);
    else vnni_head_logits<1>(blk, p, inv + g0, sc, a.d, o);
  }
}
#endif
