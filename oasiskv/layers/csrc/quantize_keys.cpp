// The rerank's int8 key copy of a prompt's blocks, written in place (`kv/summaries.py`,
// quantize_into): what `summaries._quantize` computes for 8 bits (each block and KV head's
// largest |key| / 127 its scale, the codes round(key / scale) clamped to +-127, dim-major),
// read from the host pool where the keys lie and written straight into the device copy's rows
// of the blocks' summary ids. The compiled PyTorch pass took ~50 ms a 7K prompt (82 MB of keys
// read, a temporary written and copied again into the copy's rows), most of a batch's
// admission step on a 2-core EPYC; here each (layer, block, head) is one task of a parallel loop
// (16 ms a 7K prompt, AVX-512 tier).
//
// keys [L, Hkv, n, B, d] bf16 or fp32, each block's B x d values contiguous (any strides above);
// codes [L', ids, Hkv, d, B] int8 and scales [L', ids, Hkv] fp32, contiguous, written at layers
// l0 .. l0 + L - 1 and rows ids [n]. Division, not a reciprocal's product, and rint (half to
// even), as the PyTorch pass: the same codes bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "simd.h"

namespace {

typedef float f16v __attribute__((vector_size(64)));    // 16 fp32 lanes: a block's tokens
typedef int32_t i16v __attribute__((vector_size(64)));
typedef int8_t b16v __attribute__((vector_size(16)));

struct QArgs {
  const void* k;
  int64_t sl, sh, sn;  // keys' strides: layer, head, block
  int8_t* c;
  float* s;
  const int64_t* id;
  int64_t n, H, B, d, I, l0;
};

// blocks [lo, hi) of the L * n * H (layer, block, head) tasks
template <typename T>
OASIS_INLINE void quantize_range(const QArgs& a, int64_t lo, int64_t hi) {
  const int64_t n = a.n, H = a.H, B = a.B, d = a.d;
  std::vector<float> xt(d * B);  // [d, B]: the block's keys dim-major, as the codes
  for (int64_t t = lo; t < hi; ++t) {
    const int64_t l = t / (n * H), i = t / H % n, h = t % H;
    const T* kb = static_cast<const T*>(a.k) + l * a.sl + h * a.sh + i * a.sn;  // [B, d]
    float m = 0.0f;
    for (int64_t tok = 0; tok < B; ++tok)
      for (int64_t e = 0; e < d; ++e) {
        const float v = static_cast<float>(kb[tok * d + e]);
        xt[e * B + tok] = v;
        m = std::max(m, std::fabs(v));
      }
    const float scale = m / 127.0f, safe = scale > 0.0f ? scale : 1.0f;
    const int64_t row = ((a.l0 + l) * a.I + a.id[i]) * H + h;
    a.s[row] = scale;
    int8_t* cb = a.c + row * d * B;  // [d, B]
    if (B == 16) {  // a dim's 16 tokens one vector: divided, rounded half to even by the
      // add of 1.5 * 2^23 (exact for |v| <= 2^22; here |v| <= 127), clamped, narrowed
      const float magic = 12582912.0f;
      for (int64_t e = 0; e < d; ++e) {
        f16v v;
        std::memcpy(&v, &xt[e * 16], 64);
        v = (v / safe + magic) - magic;
        v = v > 127.0f ? f16v{} + 127.0f : v;
        v = v < -127.0f ? f16v{} - 127.0f : v;
        const b16v q = __builtin_convertvector(__builtin_convertvector(v, i16v), b16v);
        std::memcpy(cb + e * 16, &q, 16);
      }
      continue;
    }
    for (int64_t j = 0; j < d * B; ++j)
      cb[j] = static_cast<int8_t>(std::min(std::max(std::nearbyint(xt[j] / safe), -127.0f),
                                           127.0f));
  }
}

// compiled for AVX-512 (16 lanes one instruction) and the baseline, chosen by CPUID
#ifdef OASIS_X86
OASIS_AVX512 void range_avx512_bf16(const QArgs& a, int64_t lo, int64_t hi) {
  quantize_range<c10::BFloat16>(a, lo, hi);
}
OASIS_AVX512 void range_avx512_f32(const QArgs& a, int64_t lo, int64_t hi) {
  quantize_range<float>(a, lo, hi);
}
#endif
void range_base_bf16(const QArgs& a, int64_t lo, int64_t hi) {
  quantize_range<c10::BFloat16>(a, lo, hi);
}
void range_base_f32(const QArgs& a, int64_t lo, int64_t hi) { quantize_range<float>(a, lo, hi); }

}  // namespace

std::vector<std::string> isas() {  // the instruction sets this CPU runs it with, best first
  const auto all = cpu_isas(false);
  if (std::find(all.begin(), all.end(), "avx512") != all.end()) return {"avx512", "base"};
  return {"base"};
}

void quantize_into(const at::Tensor& keys, at::Tensor& codes, at::Tensor& scales,
                   const at::Tensor& ids, int64_t l0) {
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 5 &&
                  (keys.scalar_type() == at::kBFloat16 || keys.scalar_type() == at::kFloat),
              "keys: a [L, Hkv, n, B, d] bf16 or float32 CPU tensor");
  const int64_t L = keys.size(0), H = keys.size(1), n = keys.size(2), B = keys.size(3),
                d = keys.size(4);
  TORCH_CHECK(keys.stride(4) == 1 && keys.stride(3) == d,
              "keys: each block's B x d values contiguous, got strides ", keys.strides());
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous() && codes.dim() == 5 && codes.size(2) == H &&
                  codes.size(3) == d && codes.size(4) == B && l0 >= 0 &&
                  l0 + L <= codes.size(0),
              "codes: a contiguous [L, ids, Hkv, d, B] int8 CPU tensor with layers ", l0, "..",
              l0 + L - 1, ", got ", codes.sizes());
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == H,
              "scales: a contiguous [L, ids, Hkv] float32 CPU tensor beside the codes");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
                  ids.is_contiguous() && ids.numel() == n, "ids: n int64 summary ids");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)  // a bad id would write outside the copy
    TORCH_CHECK(id[i] >= 0 && id[i] < codes.size(1), "id ", id[i], " of ", codes.size(1));
  const QArgs a{keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
                codes.data_ptr<int8_t>(), scales.data_ptr<float>(), id, n, H, B, d,
                codes.size(1), l0};
  const bool bf16 = keys.scalar_type() == at::kBFloat16;
  auto range = bf16 ? range_base_bf16 : range_base_f32;
#ifdef OASIS_X86
  if (isas().front() == "avx512") range = bf16 ? range_avx512_bf16 : range_avx512_f32;
#endif
  at::parallel_for(0, L * n * H, 16, [&](int64_t lo, int64_t hi) { range(a, lo, hi); });
}


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_into", &quantize_into, "the int8 key copy of blocks, into its rows",
        py::arg("keys"), py::arg("codes"), py::arg("scales"), py::arg("ids"), py::arg("l0"));
  m.def("isas", &isas, "the instruction sets this build runs");
}
