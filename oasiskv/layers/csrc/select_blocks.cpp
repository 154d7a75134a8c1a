// The sparse selection's per-head bookkeeping on the CPU (`kv/select_kernel.py`): each KV
// head's top-k blocks by score, best first (the predict stage), and the capped-LRU update of
// its working set (the select stage), what `kv/select.select_capped_lru_batch` computes with
// about 40 tensor ops. A (layer, request, head) is a few hundred numbers, so those ops were
// almost all overhead: 2 ms of top-k and 3 ms of selection a step at 7K x 6 (30 layers, 3 KV
// heads, 448 blocks, K=128) on a 2-core EPYC; here each head is one task of a parallel loop.
//
// top_blocks: scores [T, n] (float32, T = layers * R * Hkv rows) -> [T, k] block indices,
// best first; ties go to the lower block, rows of request r past real[r] (its complete blocks
// up to K) are -2, as predict pads them.
//
// select_lru: the working sets head_map / last_used of each request ([L, K, Hkv] int64,
// contiguous, updated in place at layers l0 ..), predicted [layers, R, Hkv, k] from top_blocks,
// caps [layers, R] -> select_capped_lru_batch's BatchSelection, candidates in its order
// (layer-major (layer, request), head, then the j-th miss by rank into the j-th victim): hits
// stamped with their rank, up to cap misses each replacing an empty slot or the least recently
// selected block outside the predicted set (stable: the lower slot first on equal stamps).
//
// resident_masks: attention's masks of a layer, each slot of a head's block slots valid when
// the slot holds a block (the stack, compare and expanded copy it replaces took ~50 us a layer)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t RANKS = int64_t(1) << 20;  // kv/select.RANKS

int64_t stamp(int64_t step, int64_t rank) { return step * RANKS + (RANKS - 1) - rank; }

// A float's order as an unsigned integer's (larger float, larger key)
uint32_t ordered(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace

at::Tensor top_blocks(const at::Tensor& scores, const at::Tensor& real, int64_t heads,
                      int64_t k) {
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 2 &&
                  scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "scores: a contiguous 2-D float32 CPU tensor, got ", scores.sizes());
  TORCH_CHECK(real.device().is_cpu() && real.dim() == 1 && real.scalar_type() == at::kLong &&
                  real.is_contiguous(), "real: a contiguous 1-D int64 CPU tensor");
  const int64_t T = scores.size(0), n = scores.size(1), R = real.numel();
  TORCH_CHECK(heads > 0 && R > 0 && T % (R * heads) == 0, "rows (", T,
              ") are not layers x requests (", R, ") x heads (", heads, ")");
  TORCH_CHECK(k >= 1 && k <= n, "k must be in [1, ", n, "], got ", k);
  auto out = at::empty({T, k}, scores.options().dtype(at::kLong));
  const float* s = scores.data_ptr<float>();
  const int64_t* rl = real.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
    std::vector<uint64_t> keys(n);
    for (int64_t t = lo; t < hi; ++t) {
      const float* st = s + t * n;
      // (score, -block) as one integer: the best first, ties the lower block
      for (int64_t i = 0; i < n; ++i)
        keys[i] = (uint64_t(ordered(st[i])) << 32) | uint32_t(0xffffffffu - uint32_t(i));
      std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<>());
      std::sort(keys.begin(), keys.begin() + k, std::greater<>());
      const int64_t r = (t / heads) % R, m = std::min(rl[r], k);
      int64_t* ot = o + t * k;
      for (int64_t j = 0; j < k; ++j)
        ot[j] = j < m ? int64_t(0xffffffffu - uint32_t(keys[j])) : -2;
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
select_lru(const std::vector<at::Tensor>& head_maps, const std::vector<at::Tensor>& last_useds,
           int64_t l0, const at::Tensor& predicted, const at::Tensor& caps, int64_t step,
           int64_t num_blocks, int64_t max_cap) {
  TORCH_CHECK(predicted.device().is_cpu() && predicted.dim() == 4 &&
                  predicted.scalar_type() == at::kLong && predicted.is_contiguous(),
              "predicted: a contiguous [layers, R, Hkv, k] int64 CPU tensor");
  const int64_t L = predicted.size(0), R = predicted.size(1), H = predicted.size(2),
                k = predicted.size(3);
  TORCH_CHECK(int64_t(head_maps.size()) == R && int64_t(last_useds.size()) == R,
              "one head_map and last_used per request (", R, ")");
  TORCH_CHECK(caps.device().is_cpu() && caps.scalar_type() == at::kLong &&
                  caps.is_contiguous() && caps.numel() == L * R, "caps: [layers, R] int64");
  const int64_t K = R ? head_maps[0].size(1) : 0;
  for (int64_t r = 0; r < R; ++r)
    for (const at::Tensor* t : {&head_maps[r], &last_useds[r]})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 3 &&
                      t->is_contiguous() && t->size(1) == K && t->size(2) == H &&
                      l0 >= 0 && l0 + L <= t->size(0),
                  "working sets: contiguous [layers, K, Hkv] int64 CPU tensors covering "
                  "layers ", l0, "..", l0 + L - 1, ", got ", t->sizes());
  TORCH_CHECK(k <= K, "k (", k, ") above K (", K, ")");
  TORCH_CHECK(predicted.numel() == 0 || predicted.max().item<int64_t>() < num_blocks,
              "a predicted block past num_blocks (", num_blocks, ")");
  const int64_t c = std::min(max_cap, k);
  const int64_t A = L * R * H * c, rows = L * R;
  auto opts = predicted.options();
  auto requests = at::empty({A}, opts), slots = at::empty({A}, opts),
       heads = at::empty({A}, opts), blocks = at::empty({A}, opts);
  auto admitted = at::empty({A}, opts.dtype(at::kBool));
  auto n_pred = at::zeros({rows}, opts), n_hit = at::zeros({rows}, opts),
       n_want = at::zeros({rows}, opts);
  const int64_t* pr = predicted.data_ptr<int64_t>();
  const int64_t* cp = caps.data_ptr<int64_t>();
  int64_t *oreq = requests.data_ptr<int64_t>(), *oslot = slots.data_ptr<int64_t>(),
          *ohead = heads.data_ptr<int64_t>(), *oblk = blocks.data_ptr<int64_t>();
  bool* oadm = admitted.data_ptr<bool>();
  int64_t *np = n_pred.data_ptr<int64_t>(), *nh = n_hit.data_ptr<int64_t>(),
          *nw = n_want.data_ptr<int64_t>();
  // heads of one (layer, request) row write its counts: a task is a row's heads
  at::parallel_for(0, rows, 4, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> rank_of(num_blocks + 1, -1);  // block -> its rank, -1: not picked
    std::vector<uint8_t> resident(num_blocks + 1, 0);
    std::vector<int64_t> cols(k), order(K), age(K), held(K);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t l = row / R, r = row % R;
      int64_t* hm = head_maps[r].data_ptr<int64_t>() + (l0 + l) * K * H;
      int64_t* lu = last_useds[r].data_ptr<int64_t>() + (l0 + l) * K * H;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t* p = pr + (row * H + h) * k;
        int64_t valid = 0, hits = 0, misses = 0;
        for (int64_t j = 0; j < k; ++j)
          if (p[j] >= 0) rank_of[p[j]] = j, ++valid;
        for (int64_t i = 0; i < K; ++i) {  // hits stamped with their rank; empties age -1
          const int64_t b = held[i] = hm[i * H + h];
          const bool known = b >= 0 && b < num_blocks;
          const int64_t rk = known ? rank_of[b] : -1;
          if (known) resident[b] = 1;
          if (rk >= 0) lu[i * H + h] = stamp(step, rk), ++hits;
          age[i] = b < 0 ? -1 : rk >= 0 ? std::numeric_limits<int64_t>::max() : lu[i * H + h];
        }
        int64_t nc = 0;  // columns: the misses by rank, then the rest by rank
        for (int64_t j = 0; j < k; ++j)
          if (p[j] >= 0 && !resident[p[j]]) cols[nc++] = j;
        misses = nc;
        for (int64_t j = 0; j < k; ++j)
          if (!(p[j] >= 0 && !resident[p[j]])) cols[nc++] = j;
        for (int64_t i = 0; i < K; ++i) order[i] = i;  // victims: by age, the lower slot first
        std::partial_sort(order.begin(), order.begin() + c, order.end(),
                          [&](int64_t a, int64_t b) {
                            return age[a] < age[b] || (age[a] == age[b] && a < b);
                          });
        const int64_t enter = std::min(misses, cp[row]);
        for (int64_t j = 0; j < c; ++j) {
          const int64_t at = (row * H + h) * c + j, slot = order[j], blk = p[cols[j]];
          const bool in = j < enter;
          if (in) hm[slot * H + h] = blk, lu[slot * H + h] = stamp(step, cols[j]);
          oreq[at] = row, oslot[at] = slot, ohead[at] = h, oblk[at] = blk, oadm[at] = in;
        }
        for (int64_t j = 0; j < k; ++j)  // the tables back to empty for the next head
          if (p[j] >= 0) rank_of[p[j]] = -1, resident[p[j]] = 0;
        for (int64_t i = 0; i < K; ++i)
          if (held[i] >= 0 && held[i] < num_blocks) resident[held[i]] = 0;
        np[row] += valid, nh[row] += hits, nw[row] += misses;
      }
    }
  });
  return {requests, slots, heads, blocks, admitted, n_pred, n_hit, n_want};
}

void resident_masks(const std::vector<at::Tensor>& head_maps, int64_t layer, at::Tensor& masks,
                    int64_t block) {
  const int64_t R = int64_t(head_maps.size());
  TORCH_CHECK(masks.device().is_cpu() && masks.dim() == 3 && masks.size(0) == R &&
                  masks.scalar_type() == at::kBool && masks.is_contiguous(),
              "masks: a contiguous [R, Hkv, slots] bool CPU tensor, one per working set");
  const int64_t H = masks.size(1), slots = masks.size(2);
  for (const at::Tensor& t : head_maps)
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 3 &&
                    t.is_contiguous() && t.size(2) == H && t.size(1) * block <= slots &&
                    layer >= 0 && layer < t.size(0),
                "head maps: contiguous [layers, K, Hkv] int64 CPU tensors with layer ", layer,
                " and K * block within the masks' ", slots, " slots, got ", t.sizes());
  bool* m = masks.data_ptr<bool>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t K = head_maps[r].size(1);
    const int64_t* hm = head_maps[r].data_ptr<int64_t>() + layer * K * H;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < K; ++i)
        std::memset(m + (r * H + h) * slots + i * block, hm[i * H + h] >= 0, block);
  }
}

std::vector<std::string> isas() { return {"base"}; }  // decode_kernel.load asks every kernel

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("top_blocks", &top_blocks, "each row's best k blocks, best first",
        py::arg("scores"), py::arg("real"), py::arg("heads"), py::arg("k"));
  m.def("select_lru", &select_lru, "the capped-LRU selection of every (layer, request, head)",
        py::arg("head_maps"), py::arg("last_useds"), py::arg("l0"), py::arg("predicted"),
        py::arg("caps"), py::arg("step"), py::arg("num_blocks"), py::arg("max_cap"));
  m.def("resident_masks", &resident_masks, "masks[r, h, :K*B]: slot by slot, whether the "
        "head's block slot holds a block", py::arg("head_maps"), py::arg("layer"),
        py::arg("masks"), py::arg("block"));
  m.def("isas", &isas, "the instruction sets this build runs");
}
