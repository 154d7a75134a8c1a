// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) in bf16 for a few rows (decode), on CPUs with
// AVX-512 BF16 (`layers/gemv.py` builds, packs and calls it).
//
// The weight is packed once at load (gemv.pack): blocks of 16 output rows, within a block the
// K values in pairs, [Nb, Kp/2, 16, 2] (N padded to Nb * 16 and K to Kp, even, with zeros). One
// 64-byte vector then holds a pair of K for 16 outputs, and one vdpbf16ps with a row's pair of
// x broadcast adds both products (exact in fp32) to the 16 outputs' fp32 sums: no horizontal
// reductions, no widening, and a block streams its K * 32 bytes in order. Each weight vector is
// loaded once and used by every row of x (the rows' sums in registers: M x NB accumulators, NB
// blocks at once for independent chains); past 8 rows the rows go in chunks of 8 over the same
// NB blocks (read again from L2). The sums plus the bias (fp32) are rounded once to bf16
// (round to nearest even, as oneDNN). Blocks are shared by the threads (at::parallel_for).
//
// Only an avx512bf16 tier: elsewhere gemv.py keeps oneDNN's path (isas() says which this CPU
// runs). The function carries its target, so the one binary loads on any x86-64.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace {

constexpr int MR = 8;  // rows of x per pass over a group of blocks
#ifndef OASIS_PREFETCH
#define OASIS_PREFETCH 1024
#endif
constexpr int64_t AHEAD = OASIS_PREFETCH;  // bytes of each block's stream prefetched ahead
#ifndef OASIS_NB
#define OASIS_NB 3
#endif
constexpr int NB = OASIS_NB;  // blocks at once (MR x NB accumulators of 32 registers)

struct Args {
  const uint16_t* x;   // [M, Kp] bf16
  const uint16_t* w;   // [Nb, Kp/2, 16, 2] bf16
  const float* bias;   // [Nb * 16] fp32, or null
  uint16_t* y;         // [M, N] bf16
  int64_t M, N, Kp;
};

#ifdef OASIS_X86
#define OASIS_BF16 __attribute__((target(OASIS_BF16_TARGET)))

// Rows [r0, r0 + R) of x times blocks [b0, b0 + G): R x G sums of 16 outputs each
template <int R, int G>
OASIS_BF16 inline void tile(const Args& a, int64_t r0, int64_t b0) {
  const int64_t pairs = a.Kp / 2, bstride = a.Kp * 16;
  const uint16_t* w = a.w + b0 * bstride;
  const uint16_t* x = a.x + r0 * a.Kp;
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < G; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i wv[G];
    for (int b = 0; b < G; ++b) {
      const uint16_t* p = w + b * bstride + j * 32;
      if (AHEAD) __builtin_prefetch(reinterpret_cast<const char*>(p) + AHEAD);
      wv[b] = _mm512_loadu_si512(p);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * a.Kp + 2 * j, 4);
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int b = 0; b < G; ++b)
        acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
  for (int b = 0; b < G; ++b) {
    const int64_t n0 = (b0 + b) * 16;
    const int64_t left = std::min<int64_t>(16, a.N - n0);
    const __mmask16 keep = left == 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bias));
      __m256i bits;
      std::memcpy(&bits, &out, sizeof bits);
      _mm256_mask_storeu_epi16(a.y + (r0 + r) * a.N + n0, keep, bits);
    }
  }
}

// G blocks from b0 for all rows, in chunks of up to MR rows
template <int G>
OASIS_BF16 void blocks(const Args& a, int64_t b0) {
  for (int64_t r0 = 0; r0 < a.M; r0 += MR) {
    switch (std::min<int64_t>(MR, a.M - r0)) {
      case 1: tile<1, G>(a, r0, b0); break;
      case 2: tile<2, G>(a, r0, b0); break;
      case 3: tile<3, G>(a, r0, b0); break;
      case 4: tile<4, G>(a, r0, b0); break;
      case 5: tile<5, G>(a, r0, b0); break;
      case 6: tile<6, G>(a, r0, b0); break;
      case 7: tile<7, G>(a, r0, b0); break;
      default: tile<8, G>(a, r0, b0); break;
    }
  }
}

// Blocks [lo, hi): NB at a time, then one by one
OASIS_BF16 void run(const Args& a, int64_t lo, int64_t hi) {
  int64_t b = lo;
  for (; b + NB <= hi; b += NB) blocks<NB>(a, b);
  for (; b < hi; ++b) blocks<1>(a, b);
}
#endif

// The instruction sets this CPU runs the kernel with (empty: none; gemv.py keeps oneDNN)
std::vector<std::string> isas() {
  const auto all = cpu_isas(true);
  if (std::find(all.begin(), all.end(), "avx512bf16") != all.end()) return {"avx512bf16"};
  return {};
}

}  // namespace

// x [M, Kp] bf16 contiguous (Kp even: a zero column past an odd K); w [Nb, Kp/2, 16, 2] bf16
// contiguous (gemv.pack); bias [Nb * 16] float32 or None; N <= Nb * 16 -> y [M, N] bf16.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                int64_t N) {
  TORCH_CHECK(!isas().empty(), "this CPU has no AVX-512 BF16: the kernel does not run here");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0,
              "x: a contiguous CPU bfloat16 [M, Kp] tensor, Kp even");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 4 && w.is_contiguous() &&
                  w.scalar_type() == at::kBFloat16 && w.size(2) == 16 && w.size(3) == 2,
              "w: a contiguous CPU bfloat16 [Nb, Kp/2, 16, 2] tensor (gemv.pack)");
  const int64_t M = x.size(0), Kp = x.size(1), Nb = w.size(0);
  TORCH_CHECK(w.size(1) * 2 == Kp, "w's K (", w.size(1) * 2, ") is x's (", Kp, ")");
  TORCH_CHECK(N >= 0 && N <= Nb * 16 && N > (Nb - 1) * 16, "N ", N, " does not fit ", Nb,
              " blocks of 16");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat && bias->numel() == Nb * 16,
                "bias: a contiguous CPU float32 tensor of Nb * 16");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef OASIS_X86
  Args a{reinterpret_cast<const uint16_t*>(x.data_ptr()),
         reinterpret_cast<const uint16_t*>(w.data_ptr()), bp,
         reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, Kp};
  // grain: at least 3 blocks (one group) a thread
  at::parallel_for(0, Nb, 3, [&](int64_t lo, int64_t hi) { run(a, lo, hi); });
#endif
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ W^T (+ bias) in bf16 for a few rows, W packed by gemv.pack",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("n"));
  m.def("isas", &isas, "the instruction sets this CPU runs the kernel with");
}
