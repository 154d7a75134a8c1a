// Decode attention over K/V read where they lie in the pool (issue 45).
//
// For each (request, KV head), the query rows of the request (its normal token, then its
// drafts) times the G query heads of the group are scored against the K rows of the request's
// runs of slots, one tile at a time, with an online softmax in fp32 (flash-decoding): the
// scores never leave L1 and nothing is copied or expanded. When requests x KV heads are fewer
// than the threads can share, a request's slots are split into chunks scored apart and merged
// by log-sum-exp. bf16 and fp32 inputs, fp32 accumulation, the output rounded once.
//
// Row class j of a request (0: the normal token, j >= 1: draft j) sees slot s of head h when
// its mask allows it (class 0: `valid`, the others `draft_valid`, default `valid`; none: all),
// and draft j also its own K/V, row `extra[j]` of ke/ve (never the normal row).
//
// The hot loops are written on vectors of W fp32 lanes (GCC/clang vector extensions, so no
// loop depends on the auto-vectorizer): a tile's scores key-major, W keys a vector, their
// partial sums over d added lane-wise W keys at once (no horizontal sum per key); an exp over
// the tile's scores W at a time; P.V as broadcast FMAs over d; bf16 widened by shifts in the
// vector registers. They are compiled three times (AVX-512, W 16; AVX2+FMA, W 8; the baseline,
// W 4) and chosen at run time by CPUID, so one build runs on any x86-64. A fourth tier,
// avx512bf16 (CPUs with AVX-512 BF16), runs the AVX-512 loops with, for bf16 inputs only, the
// scores by vdpbf16ps on q and K as they are (products exact in fp32, summed in fp32: the same
// results to fp32 rounding) and V widened by unpacking; fp32 inputs get the AVX-512 loops. P
// stays fp32 (rounded to bf16 it would change results beyond the output's own rounding).
// Built and cached by oasiskv/layers/decode_kernel.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t TILE = 64;  // slots scored before their values are read
constexpr int64_t MAX_D = 512;  // the largest head dim (a row's vectors live on the stack)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Mask {  // bool [Hkv, >= T]: slot s of head h is seen iff ptr[h * hs + s * ss]
  const uint8_t* ptr = nullptr;
  int64_t hs = 0, ss = 0;
};

struct Args {
  const void* q; int64_t q_rs, q_hs;     // [N, H, d]
  void* out; int64_t o_rs, o_hs;         // [N, H, d]
  const void* k; int64_t k_hs, k_ss;     // [Hkv, S, d]
  const void* v; int64_t v_hs, v_ss;
  const void* ke; int64_t ke_hs, ke_ss;  // [Hkv, E, d]: the drafts' own K/V
  const void* ve; int64_t ve_hs, ve_ss;
  int64_t group, d;
  float scale;
  const int64_t* rows;     // request b: rows[row_off[b] : row_off[b + 1]], its normal row first
  const int64_t* row_off;
  const int64_t* runs;     // request b: (first slot, slots) pairs run_off[b] .. run_off[b + 1]
  const int64_t* run_off;
  const int64_t* extra;    // aligned with rows: a draft row's own K/V row in ke/ve
  std::vector<Mask> valid, draft_valid;  // per request
};

struct Unit {
  int64_t b, h, lo, hi;  // request, KV head, its slots [lo, hi) (in the order of its runs)
  int64_t part;          // offset of its partial result in the partials, -1: writes the output
  bool last;             // holds the request's last slot: also attends to the drafts' own K/V
};

OASIS_INLINE float load(const float* p, int64_t j) { return p[j]; }
OASIS_INLINE float load(const uint16_t* p, int64_t j) {  // bf16: the high half of an fp32
  uint32_t u = uint32_t(p[j]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
OASIS_INLINE void store(float* p, int64_t j, float x) { p[j] = x; }
OASIS_INLINE void store(uint16_t* p, int64_t j, float x) { p[j] = c10::BFloat16(x).x; }

template <int W>
OASIS_INLINE typename Vec<W>::f vload(const uint16_t* p) {  // bf16: shifted into the high half
  typename Vec<W>::h h;
  std::memcpy(&h, p, sizeof h);
  return (typename Vec<W>::f)(__builtin_convertvector(h, typename Vec<W>::u) << 16);
}

// One query row's running state gets a single more score (the drafts' own K/V)
OASIS_INLINE void attend_one(float score, const float* vf, float* acc, float& mx, float& l,
                             int64_t d) {
  const float mnew = std::max(mx, score);
  const float corr = fexp(mx - mnew), p = fexp(score - mnew);
  l = l * corr + p;
  for (int64_t c = 0; c < d; ++c) acc[c] = acc[c] * corr + p * vf[c];
  mx = mnew;
}

// Row t of the tile in fp32, d values then zeros up to dp (a multiple of W)
template <int W, typename T>
OASIS_INLINE void widen(const T* src, float* dst, int64_t d, int64_t dp) {
  int64_t c = 0;
  for (; c + W <= d; c += W) vstore<W>(dst + c, vload<W>(src + c));
  for (; c < d; ++c) dst[c] = load(src, c);
  for (; c < dp; ++c) dst[c] = 0.0f;
}

// Scores of W keys (fp32 rows kt, stride DP) against one query row: per key a vector of
// partial sums over d, the W of them summed lane-wise at once (no horizontal sum per key)
template <int W, int DP>
OASIS_INLINE typename Vec<W>::f scores_w(const typename Vec<W>::f* qv, const float* kt,
                                         int64_t dp) {
  using F = typename Vec<W>::f;
  const int64_t C = DP ? DP / W : dp / W, stride = DP ? DP : dp;
  F part[W];
  for (int k = 0; k < W; ++k) {
    const float* kr = kt + k * stride;
    F a = qv[0] * vload<W>(kr);
    for (int64_t c = 1; c < C; ++c) a += qv[c] * vload<W>(kr + c * W);
    part[k] = a;
  }
  return hsums<W>(part);
}

// P.V for RB query rows at once, key-outer: each V row widened in registers once (read where
// it lies, no copy) and broadcast-FMAed into the RB rows' accumulators, held in registers
template <typename T, int D, int W, int RB>
OASIS_INLINE void pv_block(const float* p, float* acc, const T* v, int64_t v_ss, int64_t tn,
                           int64_t dp) {
  using F = typename Vec<W>::f;
  constexpr int64_t CMAX = D ? D / W : MAX_D / W;
  const int64_t C = D ? D / W : dp / W;
  F av[RB][CMAX];
  for (int i = 0; i < RB; ++i)
    for (int64_t c = 0; c < C; ++c) av[i][c] = vload<W>(acc + i * dp + c * W);
  for (int64_t t = 0; t < tn; ++t) {
    const T* vr = v + t * v_ss;
    F vc[CMAX];
    for (int64_t c = 0; c < C; ++c) vc[c] = vload<W>(vr + c * W);
    for (int i = 0; i < RB; ++i) {
      const float pi = p[i * TILE + t];
      for (int64_t c = 0; c < C; ++c) av[i][c] += pi * vc[c];
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int64_t c = 0; c < C; ++c) vstore<W>(acc + i * dp + c * W, av[i][c]);
}

// pv_block for r <= RB rows
template <typename T, int D, int W, int RB>
OASIS_INLINE void pv_rows(int64_t r, const float* p, float* acc, const T* v, int64_t v_ss,
                          int64_t tn, int64_t dp) {
  if constexpr (RB > 1)
    if (r < RB) return pv_rows<T, D, W, RB - 1>(r, p, acc, v, v_ss, tn, dp);
  pv_block<T, D, W, RB>(p, acc, v, v_ss, tn, dp);
}

// Rows of a P.V block: as many as their accumulators and a V row fit the vector registers
// (32 with AVX-512, else 16)
template <int D, int W>
constexpr int pv_rows_max() {
  if (!D) return 4;
  const int c = D / W, regs = W == 16 ? 32 : 16;
  const int rb = (regs - c - 2) / c;
  return rb < 1 ? 1 : rb > 6 ? 6 : rb;
}

// Hints the cache to fetch rows [0, n) of a K or V pool (prefetches never fault)
template <typename T>
OASIS_INLINE void prefetch_rows(const T* p, int64_t ss, int64_t n, int64_t d) {
  const int64_t bytes = d * int64_t(sizeof(T));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t o = 0; o < bytes; o += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + t * ss) + o);
}

#ifdef OASIS_X86

// A tile's scores for all M query rows with vdpbf16ps (the avx512bf16 tier, bf16 only): each
// instruction multiplies 32 bf16 of a query row by 32 of a K row read in place (products exact
// in fp32, summed in pairs into 16 fp32 lanes: no widening), so a key leaves 16 partial sums
// and the W = 16 keys of a vector are reduced lane-wise at once, as in scores_w. qb [M, qp]:
// the unscaled bf16 queries, zeros past d (qp a multiple of 32); the scale applies to the sums.
// Keys tn..tw (padding) score 0 plus their -inf bias; K past d is not read (masked loads).
// Not inlined: its target (avx512bf16) is more than run_unit's callers have.
template <int D>
__attribute__((target(OASIS_BF16_TARGET), noinline)) void dot_scores(
    const uint16_t* qb, int64_t qp, int64_t M, int64_t G, const uint16_t* k, int64_t k_ss,
    int64_t tn, int64_t tw, int64_t d, float scale, const float* bias, float* s, float* rmax) {
  using F = Vec<16>::f;
  constexpr int64_t CMAX = D ? D / 32 : MAX_D / 32;
  const int64_t C = D ? D / 32 : (d + 31) / 32;
  const int64_t tail = d - (C - 1) * 32;  // K values in the last chunk, 1..32
  const __mmask32 last = tail == 32 ? ~__mmask32(0) : (__mmask32(1) << tail) - 1;
  for (int64_t i = 0; i < M; ++i) {
    __m512i qv[CMAX];
    for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(qb + i * qp + c * 32);
    const float* bc = bias + (i < G ? 0 : TILE);
    float* si = s + i * TILE;
    F vmax = F{} + NEG_INF;
    for (int64_t t = 0; t < tw; t += 16) {
      F part[16];
      for (int kk = 0; kk < 16; ++kk) {
        part[kk] = F{};
        if (t + kk >= tn) continue;  // padding: never read past the tile
        const uint16_t* kr = k + (t + kk) * k_ss;
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c + 1 < C; ++c)
          a = _mm512_dpbf16_ps(a, (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(kr + c * 32));
        const __m512i kl = D ? _mm512_loadu_si512(kr + (C - 1) * 32)
                             : _mm512_maskz_loadu_epi16(last, kr + (C - 1) * 32);
        part[kk] = (F)_mm512_dpbf16_ps(a, (__m512bh)qv[C - 1], (__m512bh)kl);
      }
      const F sc = hsums<16>(part) * scale + vload<16>(bc + t);
      vstore<16>(si + t, sc);
      vmax = vmax > sc ? vmax : sc;
    }
    float m = NEG_INF;
    for (int kk = 0; kk < 16; ++kk) m = std::max(m, vmax[kk]);
    rmax[i] = m;
  }
}

// P.V of RB query rows over a tile's tn V rows read in place (D 64 or 128): as pv_block (fp32
// products and sums, P unrounded), but a V row widened by unpacking its 32 bf16 of a 512-bit
// load against zeros, two instructions for 32 values (dims 0-3, 8-11, .. in one vector, 4-7,
// 12-15, .. in the other), the accumulators permuted to match while in registers
template <int D, int RB>
__attribute__((target(OASIS_BF16_TARGET), always_inline)) inline void dot_values_block(
    const float* p, float* acc, const uint16_t* v, int64_t v_ss, int64_t tn) {
  constexpr int C = D / 32;  // 32 values a load, two vectors of accumulators each
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
  __m512 av[RB][2 * C];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < C; ++c) {
      const __m512 n0 = _mm512_loadu_ps(acc + i * D + 32 * c);
      const __m512 n1 = _mm512_loadu_ps(acc + i * D + 32 * c + 16);
      av[i][2 * c] = _mm512_permutex2var_ps(n0, lo, n1);
      av[i][2 * c + 1] = _mm512_permutex2var_ps(n0, hi, n1);
    }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < tn; ++t) {
    const uint16_t* vr = v + t * v_ss;
    __m512 vl[C], vh[C];
    for (int c = 0; c < C; ++c) {
      const __m512i raw = _mm512_loadu_si512(vr + 32 * c);
      vl[c] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw));  // bf16 << 16: fp32
      vh[c] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw));
    }
    for (int i = 0; i < RB; ++i) {
      const __m512 pi = _mm512_set1_ps(p[i * TILE + t]);
      for (int c = 0; c < C; ++c) {
        av[i][2 * c] = _mm512_fmadd_ps(pi, vl[c], av[i][2 * c]);
        av[i][2 * c + 1] = _mm512_fmadd_ps(pi, vh[c], av[i][2 * c + 1]);
      }
    }
  }
  // back to the natural order: dims 0-3 from the first vector, 4-7 from the second, ..
  const __m512i b0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i b1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30,
                                       31);
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + i * D + 32 * c,
                       _mm512_permutex2var_ps(av[i][2 * c], b0, av[i][2 * c + 1]));
      _mm512_storeu_ps(acc + i * D + 32 * c + 16,
                       _mm512_permutex2var_ps(av[i][2 * c], b1, av[i][2 * c + 1]));
    }
}

// P.V of a tile for all M rows (p [M, TILE], acc [M, D]), as many rows a block as their
// accumulators and a V row fit the 32 vector registers
template <int D>
__attribute__((target(OASIS_BF16_TARGET), noinline)) void dot_values(
    const float* p, float* acc, int64_t M, const uint16_t* v, int64_t v_ss, int64_t tn) {
  constexpr int RB = D == 64 ? 6 : 2;  // (32 - D / 16 - 2) / (D / 16)
  int64_t i = 0;
  for (; i + RB <= M; i += RB) dot_values_block<D, RB>(p + i * TILE, acc + i * D, v, v_ss, tn);
  switch (M - i) {  // the rest, fewer than RB
    case 5: return dot_values_block<D, 5>(p + i * TILE, acc + i * D, v, v_ss, tn);
    case 4: return dot_values_block<D, 4>(p + i * TILE, acc + i * D, v, v_ss, tn);
    case 3: return dot_values_block<D, 3>(p + i * TILE, acc + i * D, v, v_ss, tn);
    case 2: return dot_values_block<D, 2>(p + i * TILE, acc + i * D, v, v_ss, tn);
    case 1: return dot_values_block<D, 1>(p + i * TILE, acc + i * D, v, v_ss, tn);
    default: return;
  }
}
#endif

// The unit's slots, a tile at a time: scores (key-major, W keys per vector), masks, online
// softmax with a vectorized exp over the tile, then P.V as broadcast FMAs over d. D: the head
// dim when fixed (64, 128), else 0; rows are padded with zeros to DP, a multiple of W.
// DOT: the scores by dot_scores (vdpbf16ps on the bf16 rows in place; bf16, W 16 only).
template <typename T, int D, int W, bool DOT = false>
OASIS_INLINE void run_unit(const Args& a, const Unit& u, float* partials,
                           std::vector<float>& buf) {
  using F = typename Vec<W>::f;
  static_assert(D % W == 0 && TILE % W == 0, "lanes divide the head dim and the tile");
  static_assert(!DOT || (std::is_same_v<T, uint16_t> && W == 16), "DOT: bf16 on 16 lanes");
  constexpr int64_t DP = D;  // 0: runtime
  constexpr int64_t CMAX = D ? D / W : MAX_D / W;  // vectors of a row held in registers
  const int64_t d = D ? D : a.d, dp = D ? D : (a.d + W - 1) / W * W, C = dp / W;
  const int64_t G = a.group, h = u.h, b = u.b;
  const int64_t r0 = a.row_off[b], n = a.row_off[b + 1] - r0, M = n * G;
  const int64_t qp = DOT ? (d + 31) / 32 * 32 : 0;  // DOT: a bf16 query row's padded length
  buf.resize(2 * M * dp + M * TILE + TILE * dp + 2 * M + 2 * TILE + 2 * W + M * qp / 2 + M);
  float* qf = buf.data();       // [M, dp] the queries, scaled
  float* acc = qf + M * dp;     // [M, dp] the weighted values
  float* s = acc + M * dp;      // [M, TILE] a tile's scores, then its probabilities
  float* tf = s + M * TILE;     // [TILE, dp] a tile's K rows, then its V rows, in fp32
  float* mx = tf + TILE * dp;   // [M] running max
  float* l = mx + M;            // [M] running sum of exp(score - max)
  float* bias = l + M;          // [2, TILE] 0 or -inf: the masks of the normal row, the drafts
  float* rmax = bias + 2 * TILE + 2 * W;  // DOT: [M] a tile's max score per row
  uint16_t* qb = reinterpret_cast<uint16_t*>(rmax + M);  // DOT: [M, qp] the bf16 queries
  const T* q = static_cast<const T*>(a.q);
  for (int64_t j = 0; j < n; ++j) {
    const T* qr = q + a.rows[r0 + j] * a.q_rs + h * G * a.q_hs;
    for (int64_t g = 0; g < G; ++g) {
      float* qi = qf + (j * G + g) * dp;
      widen<W>(qr + g * a.q_hs, qi, d, dp);
      for (int64_t c = 0; c < dp; ++c) qi[c] *= a.scale;
      if constexpr (DOT) {
        uint16_t* qbi = qb + (j * G + g) * qp;
        std::copy(qr + g * a.q_hs, qr + g * a.q_hs + d, qbi);
        std::fill(qbi + d, qbi + qp, uint16_t(0));
      }
    }
  }
  std::fill(acc, acc + M * dp, 0.0f);
  std::fill(mx, mx + M, NEG_INF);
  std::fill(l, l + M, 0.0f);
  const T* kh = static_cast<const T*>(a.k) + h * a.k_hs;
  const T* vh = static_cast<const T*>(a.v) + h * a.v_hs;
  const Mask& m0 = a.valid[b];
  const Mask& m1 = a.draft_valid[b].ptr ? a.draft_valid[b] : m0;
  int64_t pos = 0;  // the run's first slot in the request's order
  for (int64_t r = a.run_off[b]; r < a.run_off[b + 1]; ++r) {
    const int64_t first = a.runs[2 * r], len = a.runs[2 * r + 1];
    const int64_t lo = std::max(u.lo, pos), hi = std::min(u.hi, pos + len);
    for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
      const int64_t tn = std::min(TILE, hi - t0), tw = (tn + W - 1) / W * W;
      const int64_t slot = first + t0 - pos;
      // this tile's V rows and the next tile's K rows on their way while we score; not with
      // DOT, whose tiles are short enough that these bursts stall it (the hardware prefetchers
      // follow the runs: dense 7K x6 1.73 -> 1.21 ms per call, 19 -> 27 GB/s)
      if constexpr (!DOT) {
        prefetch_rows(vh + slot * a.v_ss, a.v_ss, tn, d);
        prefetch_rows(kh + (slot + tn) * a.k_ss, a.k_ss, std::min(TILE, hi - t0 - tn), d);
      }
      // the tile's K rows in fp32 once (the padding up to W keys zeros); DOT reads them in place
      if constexpr (!DOT) {
        for (int64_t t = 0; t < tn; ++t) widen<W>(kh + (slot + t) * a.k_ss, tf + t * dp, d, dp);
        std::fill(tf + tn * dp, tf + tw * dp, 0.0f);
      }
      // per row class, 0 where the slot is seen, -inf where masked or padding
      for (int64_t cls = 0; cls < (n > 1 ? 2 : 1); ++cls) {
        const Mask& mk = cls ? m1 : m0;
        float* bc = bias + cls * TILE;
        if (mk.ptr) {
          const uint8_t* mp = mk.ptr + h * mk.hs + t0 * mk.ss;
          for (int64_t t = 0; t < tn; ++t) bc[t] = mp[t * mk.ss] ? 0.0f : NEG_INF;
        } else {
          std::fill(bc, bc + tn, 0.0f);
        }
        std::fill(bc + tn, bc + tw, NEG_INF);
      }
#ifdef OASIS_X86
      if constexpr (DOT)  // every row's scores [tw] and their max at once
        dot_scores<D>(qb, qp, M, G, kh + slot * a.k_ss, a.k_ss, tn, tw, d, a.scale, bias, s,
                      rmax);
#endif
      for (int64_t i = 0; i < M; ++i) {
        float* si = s + i * TILE;
        float tmax = NEG_INF;
        if constexpr (DOT) {
          tmax = rmax[i];
        } else {
          const float* qi = qf + i * dp;
          const float* bc = bias + (i < G ? 0 : TILE);
          F qv[CMAX];
          for (int64_t c = 0; c < C; ++c) qv[c] = vload<W>(qi + c * W);
          // scores [tw]: W keys a vector
          F vmax = F{} + NEG_INF;
          for (int64_t t = 0; t < tw; t += W) {
            const F sc = scores_w<W, DP>(qv, tf + t * dp, dp) + vload<W>(bc + t);
            vstore<W>(si + t, sc);
            vmax = vmax > sc ? vmax : sc;
          }
          for (int k = 0; k < W; ++k) tmax = std::max(tmax, vmax[k]);
        }
        // online softmax: scores -> probabilities against the running max
        const float mnew = std::max(mx[i], tmax);
        if (mnew == NEG_INF) {  // nothing seen yet: nothing to add
          std::fill(si, si + tw, 0.0f);
          continue;
        }
        F vsum = F{};
        for (int64_t t = 0; t < tw; t += W) {
          const F p = vexp<W>(vload<W>(si + t) - mnew);
          vstore<W>(si + t, p);
          vsum += p;
        }
        float sum = 0.0f;
        for (int k = 0; k < W; ++k) sum += vsum[k];
        if (mnew != mx[i]) {
          const float corr = fexp(mx[i] - mnew);  // 0 while mx is -inf
          float* ai = acc + i * dp;
          for (int64_t c = 0; c < dp; c += W) vstore<W>(ai + c, vload<W>(ai + c) * corr);
          l[i] *= corr;
          mx[i] = mnew;
        }
        l[i] += sum;
      }
      // values: read in place when rows are whole vectors (d a multiple of W), RB rows at once
      if (d == dp) {
#ifdef OASIS_X86
        if constexpr (DOT && D != 0) {
          dot_values<D>(s, acc, M, vh + slot * a.v_ss, a.v_ss, tn);
          continue;
        }
#endif
        constexpr int RB = pv_rows_max<D, W>();
        for (int64_t i = 0; i < M; i += RB)
          pv_rows<T, D, W, RB>(std::min<int64_t>(RB, M - i), s + i * TILE, acc + i * dp,
                               vh + slot * a.v_ss, a.v_ss, tn, dp);
        continue;
      }
      // else the tile's V rows in fp32 once (zeros past d), each query row's sum in registers
      for (int64_t t = 0; t < tn; ++t) widen<W>(vh + (slot + t) * a.v_ss, tf + t * dp, d, dp);
      for (int64_t i = 0; i < M; ++i) {
        const float* pi = s + i * TILE;
        float* ai = acc + i * dp;
        F av[CMAX];
        for (int64_t c = 0; c < C; ++c) av[c] = vload<W>(ai + c * W);
        for (int64_t t = 0; t < tn; ++t) {
          const float p = pi[t];
          const float* vt = tf + t * dp;
          for (int64_t c = 0; c < C; ++c) av[c] += p * vload<W>(vt + c * W);
        }
        for (int64_t c = 0; c < C; ++c) vstore<W>(ai + c * W, av[c]);
      }
    }
    pos += len;
  }
  if (u.last && n > 1) {  // draft j's own K/V: one more slot that only its rows see
    const T* ke = static_cast<const T*>(a.ke) + h * a.ke_hs;
    const T* ve = static_cast<const T*>(a.ve) + h * a.ve_hs;
    float* kf = tf;
    float* vf = tf + dp;
    for (int64_t j = 1; j < n; ++j) {
      const int64_t row = a.extra[r0 + j];
      for (int64_t c = 0; c < d; ++c) kf[c] = load(ke + row * a.ke_ss, c);
      for (int64_t c = 0; c < d; ++c) vf[c] = load(ve + row * a.ve_ss, c);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = j * G + g;
        float dot = 0.0f;
        for (int64_t c = 0; c < d; ++c) dot += qf[i * dp + c] * kf[c];
        attend_one(dot, vf, acc + i * dp, mx[i], l[i], d);
      }
    }
  }
  if (u.part >= 0) {  // [M, d] weighted values, then [M] maxima, [M] sums
    float* p = partials + u.part;
    for (int64_t i = 0; i < M; ++i) std::copy(acc + i * dp, acc + i * dp + d, p + i * d);
    std::copy(mx, mx + M, p + M * d);
    std::copy(l, l + M, p + M * d + M);
    return;
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t j = 0; j < n; ++j) {
    T* orow = out + a.rows[r0 + j] * a.o_rs + h * G * a.o_hs;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = j * G + g;
      const float inv = 1.0f / l[i];  // 0 seen: 0/0, NaN, as a softmax over no slot
      for (int64_t c = 0; c < d; ++c) store(orow + g * a.o_hs, c, acc[i * dp + c] * inv);
    }
  }
}

// The chunks of one (request, head) merged by log-sum-exp into its output rows
template <typename T>
void merge(const Args& a, const Unit* units, int64_t chunks, const float* partials) {
  const int64_t d = a.d, G = a.group, b = units[0].b, h = units[0].h;
  const int64_t r0 = a.row_off[b], n = a.row_off[b + 1] - r0, M = n * G;
  std::vector<float> o(d);
  T* out = static_cast<T*>(a.out);
  for (int64_t i = 0; i < M; ++i) {
    float mstar = NEG_INF;
    for (int64_t c = 0; c < chunks; ++c)
      mstar = std::max(mstar, partials[units[c].part + M * d + i]);
    float total = 0.0f;
    std::fill(o.begin(), o.end(), 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = partials + units[c].part;
      const float wc = mstar == NEG_INF ? 0.0f : fexp(p[M * d + i] - mstar);
      total += wc * p[M * d + M + i];
      for (int64_t e = 0; e < d; ++e) o[e] += wc * p[i * d + e];
    }
    const int64_t j = i / G, g = i % G;
    T* orow = out + a.rows[r0 + j] * a.o_rs + (h * G + g) * a.o_hs;
    const float inv = 1.0f / total;
    for (int64_t e = 0; e < d; ++e) store(orow, e, o[e] * inv);
  }
}

using UnitsFn = void (*)(const Args&, const Unit*, int64_t, float*);

template <typename T, int D, int W, bool DOT = false>
OASIS_INLINE void run_units(const Args& a, const Unit* u, int64_t count, float* partials) {
  std::vector<float> buf;
  for (int64_t i = 0; i < count; ++i) run_unit<T, D, W, DOT>(a, u[i], partials, buf);
}

// One copy of the kernels per instruction set, each on its own vector width W
#define OASIS_KERNELS(ISA, ATTR, W)                                                           \
  ATTR void ISA##_f32_64(const Args& a, const Unit* u, int64_t n, float* p) {               \
    run_units<float, 64, W>(a, u, n, p);                                                     \
  }                                                                                          \
  ATTR void ISA##_f32_128(const Args& a, const Unit* u, int64_t n, float* p) {              \
    run_units<float, 128, W>(a, u, n, p);                                                    \
  }                                                                                          \
  ATTR void ISA##_f32_any(const Args& a, const Unit* u, int64_t n, float* p) {              \
    run_units<float, 0, W>(a, u, n, p);                                                      \
  }                                                                                          \
  ATTR void ISA##_bf16_64(const Args& a, const Unit* u, int64_t n, float* p) {              \
    run_units<uint16_t, 64, W>(a, u, n, p);                                                  \
  }                                                                                          \
  ATTR void ISA##_bf16_128(const Args& a, const Unit* u, int64_t n, float* p) {             \
    run_units<uint16_t, 128, W>(a, u, n, p);                                                 \
  }                                                                                          \
  ATTR void ISA##_bf16_any(const Args& a, const Unit* u, int64_t n, float* p) {             \
    run_units<uint16_t, 0, W>(a, u, n, p);                                                   \
  }                                                                                          \
  UnitsFn ISA##_pick(bool bf16, int64_t d) {                                                 \
    if (bf16) return d == 64 ? ISA##_bf16_64 : d == 128 ? ISA##_bf16_128 : ISA##_bf16_any;  \
    return d == 64 ? ISA##_f32_64 : d == 128 ? ISA##_f32_128 : ISA##_f32_any;               \
  }

#ifdef OASIS_X86
OASIS_KERNELS(avx512, OASIS_AVX512, 16)
OASIS_KERNELS(avx2, OASIS_AVX2, 8)

// avx512bf16: the avx512 loops with the bf16 scores by vdpbf16ps (dot_scores); fp32 inputs get
// the avx512 loops unchanged (their queries are not rounded to bf16)
OASIS_AVX512 void avx512bf16_bf16_64(const Args& a, const Unit* u, int64_t n, float* p) {
  run_units<uint16_t, 64, 16, true>(a, u, n, p);
}
OASIS_AVX512 void avx512bf16_bf16_128(const Args& a, const Unit* u, int64_t n, float* p) {
  run_units<uint16_t, 128, 16, true>(a, u, n, p);
}
OASIS_AVX512 void avx512bf16_bf16_any(const Args& a, const Unit* u, int64_t n, float* p) {
  run_units<uint16_t, 0, 16, true>(a, u, n, p);
}
UnitsFn avx512bf16_pick(bool bf16, int64_t d) {
  if (!bf16) return avx512_pick(false, d);
  return d == 64 ? avx512bf16_bf16_64 : d == 128 ? avx512bf16_bf16_128 : avx512bf16_bf16_any;
}
#endif
OASIS_KERNELS(base, , 4)


std::vector<std::string> isas() { return cpu_isas(true); }

UnitsFn pick(const std::string& isa, bool bf16, int64_t d) {
#ifdef OASIS_X86
  if (isa == "avx512bf16") return avx512bf16_pick(bf16, d);
  if (isa == "avx512") return avx512_pick(bf16, d);
  if (isa == "avx2") return avx2_pick(bf16, d);
#endif
  return base_pick(bf16, d);
}

Mask mask_of(const std::optional<at::Tensor>& m, int64_t hkv, int64_t total) {
  Mask out;
  if (!m.has_value()) return out;
  const at::Tensor& t = *m;
  TORCH_CHECK(t.scalar_type() == at::kBool && t.dim() == 2 && t.size(0) == hkv &&
                  t.size(1) >= total && t.device().is_cpu(),
              "a mask is a CPU bool [Hkv, >= slots attended] tensor");
  out.ptr = reinterpret_cast<const uint8_t*>(t.data_ptr<bool>());
  out.hs = t.stride(0);
  out.ss = t.stride(1);
  return out;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.device().is_cpu(), name,
              ": a CPU [., ., d] tensor whose last dim is contiguous");
}

const int64_t* ints(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
                  t.device().is_cpu(), name, ": a contiguous CPU int64 vector");
  return t.data_ptr<int64_t>();
}

}  // namespace

// out, q [N, H, d]; k, v [Hkv, S, d]; ke, ve [Hkv, E, d]; rows/row_off, runs/run_off, extra:
// see Args; valid/draft_valid per request. min_chunk: the fewest slots a split chunk holds.
void decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& ke, const at::Tensor& ve, const at::Tensor& rows,
            const at::Tensor& row_off, const at::Tensor& runs, const at::Tensor& run_off,
            const at::Tensor& extra, const std::vector<std::optional<at::Tensor>>& valid,
            const std::vector<std::optional<at::Tensor>>& draft_valid, double scale,
            int64_t min_chunk, const std::string& isa) {
  check_rows(out, "out");
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  check_rows(ke, "ke");
  check_rows(ve, "ve");
  TORCH_CHECK(q.size(2) <= MAX_D, "head dim ", q.size(2), " over ", MAX_D);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(out.scalar_type() == dtype && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype && ke.scalar_type() == dtype &&
                  ve.scalar_type() == dtype, "q, out and the K/V are of one dtype");
  const int64_t hkv = k.size(0), d = q.size(2), heads = q.size(1);
  TORCH_CHECK(heads % hkv == 0 && out.sizes() == q.sizes() && k.size(2) == d &&
                  v.sizes() == k.sizes() && ke.size(0) == hkv && ke.size(2) == d &&
                  ve.sizes() == ke.sizes(), "shapes: out, q [N, H, d]; k, v [Hkv, S, d]; "
              "ke, ve [Hkv, E, d], H a multiple of Hkv");
  const int64_t B = row_off.numel() - 1;
  TORCH_CHECK(B >= 0 && run_off.numel() == B + 1 && (int64_t)valid.size() == B &&
                  (int64_t)draft_valid.size() == B && extra.numel() == rows.numel(),
              "one row_off, run_off, mask and draft mask entry per request");
  Args a{q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
         k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
         ke.data_ptr(), ke.stride(0), ke.stride(1), ve.data_ptr(), ve.stride(0), ve.stride(1),
         heads / hkv, d, float(scale), ints(rows, "rows"), ints(row_off, "row_off"),
         ints(runs, "runs"), ints(run_off, "run_off"), ints(extra, "extra"), {}, {}};
  // bounds: a bad index would read outside the pools
  const int64_t N = q.size(0), S = k.size(1), E = ke.size(1);
  TORCH_CHECK(a.row_off[0] == 0 && a.row_off[B] == rows.numel() && a.run_off[0] == 0 &&
                  2 * a.run_off[B] == runs.numel(),
              "row_off and run_off start at 0 and end at the rows and runs given");
  std::vector<int64_t> total(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(a.row_off[b] < a.row_off[b + 1] && a.run_off[b] <= a.run_off[b + 1],
                "each request has rows and runs in order");
    for (int64_t r = a.run_off[b]; r < a.run_off[b + 1]; ++r) {
      const int64_t first = a.runs[2 * r], len = a.runs[2 * r + 1];
      TORCH_CHECK(first >= 0 && len >= 0 && first + len <= S, "a run outside the pool");
      total[b] += len;
    }
    for (int64_t i = a.row_off[b]; i < a.row_off[b + 1]; ++i) {
      TORCH_CHECK(a.rows[i] >= 0 && a.rows[i] < N, "a row outside q");
      TORCH_CHECK(i == a.row_off[b] || (a.extra[i] >= 0 && a.extra[i] < E),
                  "a draft's own K/V row outside ke/ve");
    }
    a.valid.push_back(mask_of(valid[b], hkv, total[b]));
    a.draft_valid.push_back(mask_of(draft_valid[b], hkv, total[b]));
  }
  const auto names = isas();
  const std::string chosen = isa.empty() ? names.front() : isa;
  TORCH_CHECK(std::find(names.begin(), names.end(), chosen) != names.end(),
              "instruction set ", chosen, " is not available on this CPU");
  const UnitsFn fn = pick(chosen, dtype == at::kBFloat16, d);

  // units: each (request, head) whole, or in chunks when there are fewer than the threads
  // can share evenly (4 per thread; the units a multiple of the threads, as the chunks allow)
  const int64_t threads = at::get_num_threads(), items = B * hkv;
  int64_t want = 1;
  if (threads > 1 && items > 0 && items < 4 * threads) {
    want = (4 * threads + items - 1) / items;
    for (int64_t i = 0; i < threads && (items * want) % threads; ++i) ++want;
  }
  std::vector<Unit> units;
  std::vector<std::pair<int64_t, int64_t>> split;  // (first unit, chunks) of split items
  int64_t part = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t M = (a.row_off[b + 1] - a.row_off[b]) * a.group;
    const int64_t chunks = std::max<int64_t>(
        1, std::min(want, total[b] / std::max<int64_t>(1, min_chunk)));
    for (int64_t h = 0; h < hkv; ++h) {
      if (chunks > 1) split.emplace_back(units.size(), chunks);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lo = total[b] * c / chunks, hi = total[b] * (c + 1) / chunks;
        units.push_back({b, h, lo, hi, chunks > 1 ? part : -1, c == chunks - 1});
        if (chunks > 1) part += M * d + 2 * M;
      }
    }
  }
  std::vector<float> partials(part);
  at::parallel_for(0, units.size(), 1, [&](int64_t lo, int64_t hi) {
    fn(a, units.data() + lo, hi - lo, partials.data());
  });
  if (split.empty()) return;
  at::parallel_for(0, split.size(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Unit* u = units.data() + split[i].first;
      if (dtype == at::kBFloat16)
        merge<uint16_t>(a, u, split[i].second, partials.data());
      else
        merge<float>(a, u, split[i].second, partials.data());
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "grouped decode attention over K/V runs in place (see the source)");
  m.def("isas", &isas, "the instruction sets this CPU runs, best first");
}
