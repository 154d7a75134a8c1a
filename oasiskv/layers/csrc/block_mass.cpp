// The rerank's second stage over the key copy's codes (`kv/rerank.py`, `_fused_mass_codes`):
// each candidate block's share of the query's softmax attention over the candidates' keys.
//
// Per group n (a layer, request and KV head: the leading index), the query heads q[n] [G, d]
// and candidates i < c (a block's row in the pool of codes, its scale, whether it is real):
//   logits[i, b, g] = scale[n, i] * sum_d code[rows[n, i], d, b] * q[n, g, d]
//   mass[n, i] = sum_g softmax over the real candidates' tokens (i, b) of logits[., ., g],
//                summed over the block's b; -inf where not real.
// (`_mass` writes it as a logsumexp per block, then a softmax over the blocks' logsumexps: the
// same value; here each block keeps its max m and sum s = sum_b exp(logit - m), and the
// softmax over the blocks weighs s by exp(m - the group's max), so no log is taken.)
//
// Codes are dim-major, [d, B] per block: per dim, a vector of W of the block's tokens is
// widened int8 -> int32 -> fp32 in registers (4-bit pairs: byte j holds token j in its low
// nibble, token j + B/2 in its high one, both stored +8) and FMAed with each query head's
// element into G accumulators (two sets, even and odd dims, for independent chains). Only the
// real candidates' codes are read, each block once, the next ones prefetched. Groups are
// shared by the threads (at::parallel_for). Compiled for AVX-512 (W 16), AVX2+FMA (W 8) and
// the baseline (W 4), chosen at run time by CPUID; a narrower W where B is not a multiple of
// the widest, a scalar loop where B is not a multiple of 4. With AVX-512 VNNI, int8 blocks of
// 16 tokens take integer products instead (the avx512vnni tier, below). Built by
// kv/block_mass.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "simd.h"

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int GC_MAX = 4;  // query heads accumulated at once (two sets of GC_MAX accumulators)
// Prefetch distances (scripts/bench_rerank.py at 7K x 6, every block: 11.9 ms a step with
// AHEAD 2 and the next group's first 2, ~9 with 8 and 32; the memory's latency is ~2 blocks'
// compute)
#ifndef OASIS_AHEAD
#define OASIS_AHEAD 8
#endif
constexpr int AHEAD = OASIS_AHEAD;  // candidates prefetched ahead
#ifndef OASIS_LEAD
#define OASIS_LEAD 32
#endif
constexpr int LEAD = OASIS_LEAD;  // the next group's first candidates, prefetched before pass 2

struct Args {
  const uint8_t* pool;  // [rows, d, row_bytes] codes (int8: row_bytes B; 4-bit: B / 2)
  int64_t pool_rows;
  const int64_t* rows;  // [N, c]
  const float* scale;   // [N, c]
  const float* q;       // [N, G, d]
  const bool* real;     // [N, c]
  float* out;           // [N, c]
  int64_t c, G, d, B, row_bytes;
  bool nibbles;
};

// W bytes widened to W int32 lanes: s8 signed, u8 unsigned, u8_twice W/2 bytes twice (lanes
// k and k + W/2 the same byte). Vector extensions here (GCC turns byte -> int32 conversions
// into scalar code, but through int16 into vector code: the baseline's); the AVX-512 and AVX2
// forms below are one instruction each. (Those carry their ISA's target and are not
// always_inline: a target's intrinsics cannot be inlined into a generic helper, but the
// compiler inlines them once the helper is inlined into a function of that target.)
template <int W>
struct Widen {
  using I = typename Vec<W>::i;
  static OASIS_INLINE I s8(const uint8_t* p) {
    typename Vec<W>::b x;
    std::memcpy(&x, p, W);
    return __builtin_convertvector(__builtin_convertvector(x, typename Vec<W>::s), I);
  }
  static OASIS_INLINE I u8(const uint8_t* p) {
    typename Vec<W>::ub x;
    std::memcpy(&x, p, W);
    return __builtin_convertvector(__builtin_convertvector(x, typename Vec<W>::h), I);
  }
  static OASIS_INLINE I u8_twice(const uint8_t* p) {
    typename Vec<W>::ub x{}, both;
    std::memcpy(&x, p, W / 2);
    if constexpr (W == 16)
      both = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    else if constexpr (W == 8)
      both = __builtin_shufflevector(x, x, 0, 1, 2, 3, 0, 1, 2, 3);
    else
      both = __builtin_shufflevector(x, x, 0, 1, 0, 1);
    return __builtin_convertvector(__builtin_convertvector(both, typename Vec<W>::h), I);
  }
};

#ifdef OASIS_X86

template <>
struct Widen<16> {
  using I = Vec<16>::i;
  OASIS_AVX512 static inline I s8(const uint8_t* p) {
    return (I)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  OASIS_AVX512 static inline I u8(const uint8_t* p) {
    return (I)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  OASIS_AVX512 static inline I u8_twice(const uint8_t* p) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return (I)_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(x, x));
  }
};

template <>
struct Widen<8> {
  using I = Vec<8>::i;
  OASIS_AVX2 static inline I s8(const uint8_t* p) {
    return (I)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  OASIS_AVX2 static inline I u8(const uint8_t* p) {
    return (I)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  OASIS_AVX2 static inline I u8_twice(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    const __m128i x = _mm_cvtsi32_si128(four);
    return (I)_mm256_cvtepu8_epi32(_mm_unpacklo_epi32(x, x));
  }
};
#endif

template <int W, int S>
OASIS_INLINE typename Vec<W>::f swapped(typename Vec<W>::f v) {  // lane k <- lane k ^ S
  if constexpr (W == 16) {
    if constexpr (S == 8) return OASIS_SHUF(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    if constexpr (S == 4) return OASIS_SHUF(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    if constexpr (S == 2) return OASIS_SHUF(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    if constexpr (S == 1) return OASIS_SHUF(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  } else if constexpr (W == 8) {
    if constexpr (S == 4) return OASIS_SHUF(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    if constexpr (S == 2) return OASIS_SHUF(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    if constexpr (S == 1) return OASIS_SHUF(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  } else {
    if constexpr (S == 2) return OASIS_SHUF(v, v, 2, 3, 0, 1);
    if constexpr (S == 1) return OASIS_SHUF(v, v, 1, 0, 3, 2);
  }
  return v;
}

template <int W, int S = W / 2>
OASIS_INLINE typename Vec<W>::f all_max(typename Vec<W>::f v) {  // v's max in every lane
  if constexpr (S == 0) {
    return v;
  } else {
    const typename Vec<W>::f s = swapped<W, S>(v);
    return all_max<W, S / 2>(v > s ? v : s);
  }
}

template <int W, int S = W / 2>
OASIS_INLINE typename Vec<W>::f all_sum(typename Vec<W>::f v) {  // v's sum in every lane
  if constexpr (S == 0)
    return v;
  else
    return all_sum<W, S / 2>(v + swapped<W, S>(v));
}

// Tokens [t0, t0 + W) of one dim's row of codes, in fp32
template <int W, bool NIB>
OASIS_INLINE typename Vec<W>::f tokens(const uint8_t* row, int64_t t0, int64_t B) {
  using F = typename Vec<W>::f;
  using I = typename Vec<W>::i;
  if constexpr (!NIB) {
    return __builtin_convertvector(Widen<W>::s8(row + t0), F);
  } else {
    const int64_t half = B / 2;
    if (W <= half) {  // all W in one half: W bytes, one nibble of each
      const bool high = t0 >= half;
      const I v = Widen<W>::u8(row + (high ? t0 - half : t0));
      return __builtin_convertvector(((high ? v >> 4 : v) & 15) - 8, F);
    }
    // W == B: the row's W/2 bytes twice, the low nibbles then the high ones
    I shift;
    for (int k = 0; k < W; ++k) shift[k] = k < W / 2 ? 0 : 4;
    return __builtin_convertvector(((Widen<W>::u8_twice(row) >> shift) & 15) - 8, F);
  }
}

// Logits of GC query heads (q rows, stride d) for tokens [t0, t0 + W) of one block, times sc
template <int W, int GC, bool NIB>
OASIS_INLINE void head_logits(const uint8_t* blk, const float* q, float sc, const Args& a,
                              int64_t t0, float* out) {
  using F = typename Vec<W>::f;
  const int64_t d = a.d, rb = a.row_bytes, B = a.B;
  F a0[GC], a1[GC];
  for (int g = 0; g < GC; ++g) a0[g] = a1[g] = F{};
  int64_t r = 0;
  for (; r + 2 <= d; r += 2) {
    const F x0 = tokens<W, NIB>(blk + r * rb, t0, B);
    const F x1 = tokens<W, NIB>(blk + (r + 1) * rb, t0, B);
    for (int g = 0; g < GC; ++g) {
      a0[g] += x0 * q[g * d + r];
      a1[g] += x1 * q[g * d + r + 1];
    }
  }
  if (r < d) {
    const F x0 = tokens<W, NIB>(blk + r * rb, t0, B);
    for (int g = 0; g < GC; ++g) a0[g] += x0 * q[g * d + r];
  }
  for (int g = 0; g < GC; ++g) vstore<W>(out + g * B + t0, (a0[g] + a1[g]) * sc);
}

template <int W, bool NIB>
OASIS_INLINE void block_logits(const uint8_t* blk, const float* q, float sc, const Args& a,
                              float* lg) {
  for (int64_t g0 = 0; g0 < a.G; g0 += GC_MAX) {
    const int64_t gc = std::min<int64_t>(GC_MAX, a.G - g0);
    for (int64_t t0 = 0; t0 < a.B; t0 += W) {
      const float* qg = q + g0 * a.d;
      float* o = lg + g0 * a.B;
      if (gc == 4) head_logits<W, 4, NIB>(blk, qg, sc, a, t0, o);
      else if (gc == 3) head_logits<W, 3, NIB>(blk, qg, sc, a, t0, o);
      else if (gc == 2) head_logits<W, 2, NIB>(blk, qg, sc, a, t0, o);
      else head_logits<W, 1, NIB>(blk, qg, sc, a, t0, o);
    }
  }
}

// The scalar form of block_logits (any B)
OASIS_INLINE void block_logits_scalar(const uint8_t* blk, const float* q, const Args& a,
                                      float* lg) {
  const int64_t d = a.d, B = a.B, half = B / 2;
  for (int64_t g = 0; g < a.G; ++g)
    for (int64_t t = 0; t < B; ++t) {
      float s = 0.0f;
      for (int64_t r = 0; r < d; ++r) {
        const uint8_t* row = blk + r * a.row_bytes;
        const float code = !a.nibbles ? float(int8_t(row[t]))
                           : t < half ? float(int(row[t] & 15) - 8)
                                      : float(int(row[t - half] >> 4) - 8);
        s += code * q[g * d + r];
      }
      lg[g * B + t] = s;
    }
}

#include "block_mass_vnni.h"  // the avx512vnni tier

OASIS_INLINE void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

// Groups [lo, hi), in two passes each. 1: the real candidates' scaled logits [c, G, B] (a
// block's codes read once, the next ones prefetched). 2: per query head, its max M over all of
// them, each block's s = sum_b exp(logit - M) (W blocks' sums at once), its share s / sum s
// added to the block's mass. (Per block a max, an exp and two sums would be a chain of ~100
// dependent operations a block and head: half the time, measured.) W 0: the scalar loops.
// VNNI: pass 1 by the avx512vnni tier's integer products (W 16, int8, B 16, d even).
template <int W, bool NIB, bool VNNI = false>
OASIS_INLINE void run_groups(const Args& a, int64_t lo, int64_t hi) {
  const int64_t c = a.c, G = a.G, B = a.B, d = a.d, block = d * a.row_bytes;
  const int64_t cw = W ? (c + W - 1) / W * W : c;  // c padded to whole vectors
  std::vector<float> buf(c * G * B + 2 * cw + G);
  float* lg = buf.data();     // [c, G, B] the real candidates' logits, scaled
  float* sum = lg + c * G * B;  // [cw] each block's s for one head
  float* mass = sum + cw;       // [cw]
  float* qinv = mass + cw;      // [G] VNNI: each head's factor back from int16
  std::vector<int32_t> qpairs(VNNI ? G * (d / 2) : 0);  // [G, d/2] VNNI: q as int16 pairs
  for (int64_t n = lo; n < hi; ++n) {
    const int64_t* rows = a.rows + n * c;
    const float* scale = a.scale + n * c;
    const bool* real = a.real + n * c;
    const float* q = a.q + n * G * d;
    if constexpr (VNNI) int16_pairs(q, G, d, qpairs.data(), qinv);
    int64_t next = 0;  // the next candidate not yet prefetched
    bool any = false;
    for (int64_t i = 0; i < c; ++i) {
      if (!real[i]) continue;
      any = true;
      for (next = std::max(next, i + 1); next < c && next <= i + AHEAD; ++next)
        if (real[next]) prefetch_block(a.pool + rows[next] * block, block);
      const uint8_t* blk = a.pool + rows[i] * block;
      float* l = lg + i * G * B;
      const float sc = scale[i];  // logits * scale, as _mass
      if constexpr (W == 0) {
        block_logits_scalar(blk, q, a, l);
        for (int64_t k = 0; k < G * B; ++k) l[k] *= sc;
#ifdef OASIS_X86
      } else if constexpr (VNNI) {
        vnni_block_logits(blk, qpairs.data(), qinv, sc, a, l);
#endif
      } else {
        block_logits<W, NIB>(blk, q, sc, a, l);
      }
    }
    if (n + 1 < hi)  // the next group's first blocks on their way during this one's pass 2
      for (int64_t i = 0, k = 0; i < c && k < LEAD; ++i)
        if (a.real[(n + 1) * c + i])
          prefetch_block(a.pool + a.rows[(n + 1) * c + i] * block, block), ++k;
    float* out = a.out + n * c;
    if (!any) {
      std::fill(out, out + c, NEG_INF);
      continue;
    }
    std::fill(mass, mass + c, 0.0f);
    for (int64_t g = 0; g < G; ++g) {
      float top = NEG_INF;
      if constexpr (W == 0) {
        for (int64_t i = 0; i < c; ++i)
          if (real[i])
            for (int64_t t = 0; t < B; ++t) top = std::max(top, lg[(i * G + g) * B + t]);
        for (int64_t i = 0; i < c; ++i) {
          float s = 0.0f;
          if (real[i])
            for (int64_t t = 0; t < B; ++t) s += fexp(lg[(i * G + g) * B + t] - top);
          sum[i] = s;
        }
      } else {
        using F = typename Vec<W>::f;
        F m = F{} + NEG_INF;
        for (int64_t i = 0; i < c; ++i)
          if (real[i])
            for (int64_t t = 0; t < B; t += W) {
              const F x = vload<W>(lg + (i * G + g) * B + t);
              m = m > x ? m : x;
            }
        top = all_max<W>(m)[0];
        for (int64_t i0 = 0; i0 < c; i0 += W) {
          F e[W];
          for (int k = 0; k < W; ++k) {
            const int64_t i = i0 + k;
            e[k] = F{};
            if (i < c && real[i])
              for (int64_t t = 0; t < B; t += W)
                e[k] += vexp<W>(vload<W>(lg + (i * G + g) * B + t) - top);
          }
          vstore<W>(sum + i0, hsums<W>(e));
        }
      }
      float total = 0.0f;
      for (int64_t i = 0; i < c; ++i) total += sum[i];
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < c; ++i) mass[i] += sum[i] * inv;
    }
    for (int64_t i = 0; i < c; ++i) out[i] = real[i] ? mass[i] : NEG_INF;
  }
}

using GroupsFn = void (*)(const Args&, int64_t, int64_t);

// W: the ISA's widest vector that B allows (and for 4-bit pairs, a half of B or all of it)
#define OASIS_KERNELS(ISA, ATTR, WMAX)                                                       \
  template <int W, bool NIB>                                                                \
  ATTR void ISA##_groups(const Args& a, int64_t lo, int64_t hi) {                           \
    run_groups<W, NIB>(a, lo, hi);                                                          \
  }                                                                                         \
  GroupsFn ISA##_pick(int64_t B, bool nib) {                                                \
    for (int w = WMAX; w >= 4; w /= 2) {                                                    \
      if (B % w || (nib && w != B && (B / 2) % w)) continue;                                \
      if (w == 16) return nib ? ISA##_groups<16, true> : ISA##_groups<16, false>;           \
      if (w == 8) return nib ? ISA##_groups<8, true> : ISA##_groups<8, false>;              \
      return nib ? ISA##_groups<4, true> : ISA##_groups<4, false>;                          \
    }                                                                                       \
    return nib ? ISA##_groups<0, true> : ISA##_groups<0, false>;                            \
  }

#ifdef OASIS_X86
OASIS_KERNELS(avx512, OASIS_AVX512, 16)
OASIS_KERNELS(avx2, OASIS_AVX2, 8)

__attribute__((target(OASIS_VNNI_TARGET))) void vnni_groups(const Args& a, int64_t lo,
                                                             int64_t hi) {
  run_groups<16, false, true>(a, lo, hi);
}
#endif
OASIS_KERNELS(base, , 4)


std::vector<std::string> isas() { return cpu_isas(false, true); }

GroupsFn pick(const std::string& isa, int64_t B, int64_t d, bool nib) {
#ifdef OASIS_X86
  if (isa == "avx512vnni")  // its shapes (SmolLM2's: B 16, d 64); others the avx512 loops
    return !nib && B == VB && d % 2 == 0 ? vnni_groups : avx512_pick(B, nib);
  if (isa == "avx512") return avx512_pick(B, nib);
  if (isa == "avx2") return avx2_pick(B, nib);
#endif
  return base_pick(B, nib);
}

}  // namespace

// codes [rows, d, B] int8 or [rows, d, B/2] uint8 (4-bit pairs), contiguous; rows, block_scale,
// real [N, c] (int64, float32, bool); q [N, G, d] float32 -> mass [N, c] float32 (see above).
at::Tensor block_mass(const at::Tensor& codes, const at::Tensor& rows,
                      const at::Tensor& block_scale, const at::Tensor& q,
                      const at::Tensor& real, const std::string& isa) {
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 3 && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte),
              "codes: a contiguous CPU int8 [rows, d, B] or uint8 [rows, d, B/2] tensor");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous() &&
                  q.scalar_type() == at::kFloat, "q: a contiguous CPU float32 [N, G, d] tensor");
  const int64_t N = q.size(0), G = q.size(1), d = q.size(2);
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == N && rows.scalar_type() == at::kLong &&
                  rows.is_contiguous() && rows.device().is_cpu(),
              "rows: a contiguous CPU int64 [N, c] tensor, N as q's");
  const int64_t c = rows.size(1);
  TORCH_CHECK(block_scale.sizes() == rows.sizes() && block_scale.scalar_type() == at::kFloat &&
                  block_scale.is_contiguous() && block_scale.device().is_cpu(),
              "block_scale: a contiguous CPU float32 tensor shaped as rows");
  TORCH_CHECK(real.sizes() == rows.sizes() && real.scalar_type() == at::kBool &&
                  real.is_contiguous() && real.device().is_cpu(),
              "real: a contiguous CPU bool tensor shaped as rows");
  const bool nib = codes.scalar_type() == at::kByte;
  const int64_t B = nib ? 2 * codes.size(2) : codes.size(2);
  TORCH_CHECK(codes.size(1) == d && G >= 1 && B >= 1, "codes' d (", codes.size(1),
              ") is q's (", d, ")");
  Args a{reinterpret_cast<const uint8_t*>(codes.data_ptr()), codes.size(0),
         rows.data_ptr<int64_t>(), block_scale.data_ptr<float>(), q.data_ptr<float>(),
         real.data_ptr<bool>(), nullptr, c, G, d, B, codes.size(2), nib};
  for (int64_t k = 0; k < N * c; ++k)  // a bad index would read outside the pool
    TORCH_CHECK(!a.real[k] || (a.rows[k] >= 0 && a.rows[k] < a.pool_rows),
                "a candidate's row ", a.rows[k], " is outside the pool of ", a.pool_rows);
  const auto names = isas();
  const std::string chosen = isa.empty() ? names.front() : isa;
  TORCH_CHECK(std::find(names.begin(), names.end(), chosen) != names.end(),
              "instruction set ", chosen, " is not available on this CPU");
  const GroupsFn fn = pick(chosen, B, d, nib);
  at::Tensor out = at::empty({N, c}, q.options());
  if (N == 0 || c == 0) return out;
  a.out = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) { fn(a, lo, hi); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_mass", &block_mass, "the rerank's candidate mass over int8/4-bit codes",
        py::arg("codes"), py::arg("rows"), py::arg("block_scale"), py::arg("q"),
        py::arg("real"), py::arg("isa") = "");
  m.def("isas", &isas, "the instruction sets this CPU runs, best first");
}
