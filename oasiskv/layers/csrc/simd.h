// What the CPU kernels in this folder share (decode_attention.cpp, block_mass.cpp,
// gemv_bf16.cpp): vectors of
// W fp32 lanes as GCC/clang vector extensions (so that no hot loop depends on the
// auto-vectorizer), an exp accurate to about 1 ulp on them, lane sums, the per-ISA target
// attributes and the CPUID check of which instruction sets this CPU runs. Each kernel compiles
// its loops once per ISA (W 16 for AVX-512, 8 for AVX2+FMA, 4 for the baseline) and picks one
// at run time, so one binary runs on any x86-64. `layers/decode_kernel.build_dir` hashes this
// header with each source, so a change here rebuilds them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define OASIS_X86 1
#include <immintrin.h>
#endif

// the vector types below never cross a call (everything is inlined into one function per ISA)
#pragma GCC diagnostic ignored "-Wpsabi"

#define OASIS_INLINE inline __attribute__((always_inline))
#define OASIS_SHUF __builtin_shufflevector
#define OASIS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define OASIS_AVX2 __attribute__((target("avx2,fma")))
// AVX-512 with its BF16 dot products (vdpbf16ps), for the avx512bf16 tiers
#define OASIS_BF16_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,avx512bf16"
// AVX-512 with its integer dot products (vpdpwssd), for the avx512vnni tiers
#define OASIS_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,avx512vnni"

namespace {

// exp(x) to about 1 ulp (Cephes' expf polynomial), branch-free so that loops vectorize;
// exp(-inf) and anything below -87 is 0
OASIS_INLINE float fexp(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float t = xc * 1.44269504088896341f;
  const int32_t n = int32_t(t + (t >= 0.0f ? 0.5f : -0.5f));
  const float nf = float(n);
  float r = xc - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = uint32_t(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

// ---- vectors of W fp32 lanes and the integer vectors of as many lanes

template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(W * 4)));
  typedef int32_t i __attribute__((vector_size(W * 4)));
  typedef uint32_t u __attribute__((vector_size(W * 4)));
  typedef uint16_t h __attribute__((vector_size(W * 2)));
  typedef int16_t s __attribute__((vector_size(W * 2)));
  typedef int8_t b __attribute__((vector_size(W)));
  typedef uint8_t ub __attribute__((vector_size(W)));
};

template <int W>
OASIS_INLINE typename Vec<W>::f vload(const float* p) {
  typename Vec<W>::f v;
  std::memcpy(&v, p, sizeof v);  // unaligned
  return v;
}
template <int W>
OASIS_INLINE void vstore(float* p, typename Vec<W>::f v) { std::memcpy(p, &v, sizeof v); }

// fexp on W lanes, the same operations lane by lane
template <int W>
OASIS_INLINE typename Vec<W>::f vexp(typename Vec<W>::f x) {
  using F = typename Vec<W>::f;
  using I = typename Vec<W>::i;
  const F lo = F{} - 87.0f, hi = F{} + 88.0f;
  const F xc = x < lo ? lo : (x > hi ? hi : x);
  const F t = xc * 1.44269504088896341f;
  const I n = __builtin_convertvector(t + (t >= 0.0f ? F{} + 0.5f : F{} - 0.5f), I);
  const F nf = __builtin_convertvector(n, F);
  F r = xc - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const F scale = (F)((n + 127) << 23);
  return x < lo ? F{} : p * scale;
}

// Adjacent lanes of a and b summed pairwise within 128-bit blocks (hadd): lane 2i of each block
// gets a's pair i, lane 2i+1 b's
template <int W>
OASIS_INLINE typename Vec<W>::f pair_sums(typename Vec<W>::f a, typename Vec<W>::f b) {
  if constexpr (W == 16)
    return OASIS_SHUF(a, b, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
           OASIS_SHUF(a, b, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
  else if constexpr (W == 8)
    return OASIS_SHUF(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           OASIS_SHUF(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  else
    return OASIS_SHUF(a, b, 0, 2, 4, 6) + OASIS_SHUF(a, b, 1, 3, 5, 7);
}

// r[k] = the sum of v[k]'s lanes, k < W: adjacent lanes paired (hadd) within 128-bit blocks,
// then the blocks summed across; the shuffles pair what the instruction sets pair cheaply (W
// vectors' sums at about two operations a vector, where one vector's sum alone costs eight)
template <int W>
OASIS_INLINE typename Vec<W>::f hsums(const typename Vec<W>::f* v) {
  using F = typename Vec<W>::f;
  F g[W / 4];
  for (int m = 0; m < W / 4; ++m)  // g[m]: block k, lane i = block k of v[4m + i]
    g[m] = pair_sums<W>(pair_sums<W>(v[4 * m], v[4 * m + 1]),
                        pair_sums<W>(v[4 * m + 2], v[4 * m + 3]));
  if constexpr (W == 16) {  // blocks (0+2, 1+3) of g0, g1 and of g2, g3, then (0+1) of each
    const F e0 = OASIS_SHUF(g[0], g[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 OASIS_SHUF(g[0], g[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                            30, 31);
    const F e1 = OASIS_SHUF(g[2], g[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 OASIS_SHUF(g[2], g[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                            30, 31);
    return OASIS_SHUF(e0, e1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           OASIS_SHUF(e0, e1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  } else if constexpr (W == 8) {
    return OASIS_SHUF(g[0], g[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           OASIS_SHUF(g[0], g[1], 4, 5, 6, 7, 12, 13, 14, 15);
  } else {
    return g[0];
  }
}

// The instruction sets this CPU runs, best first: avx512vnni and avx512bf16 (AVX-512 with its
// integer or BF16 dot products; only where a kernel has such a tier), avx512, avx2 (with FMA),
// base
std::vector<std::string> cpu_isas(bool with_bf16, bool with_vnni = false) {
  std::vector<std::string> out;
#ifdef OASIS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma")) {
    if (with_vnni && __builtin_cpu_supports("avx512vnni")) out.push_back("avx512vnni");
    if (with_bf16 && __builtin_cpu_supports("avx512bf16")) out.push_back("avx512bf16");
    out.push_back("avx512");
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back("avx2");
#endif
  out.push_back("base");
  return out;
}

}  // namespace
