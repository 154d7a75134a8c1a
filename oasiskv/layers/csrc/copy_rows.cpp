// dst[dst_rows[i]] = src[src_rows[i]] for whole rows of two 2-D CPU tensors
// (`kv/row_copy.py`): the sparse step's local stage, the admitted block-heads copied from
// the host pool into their device slots, one row (a head's block, B * d elements) each.
// One memcpy a row, rows shared by the threads: PyTorch's index_select into a temporary
// then index_copy_ reads and writes every row twice and touches a fresh temporary each step
// (3.5x slower at a 7K x 6 step's ~10,000 rows of 2 KB, measured).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <vector>

void copy_rows(at::Tensor& dst, const at::Tensor& dst_rows, const at::Tensor& src,
               const at::Tensor& src_rows) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.dim() == 2 &&
                  src.dim() == 2 && dst.is_contiguous() && src.is_contiguous(),
              "dst and src: contiguous 2-D CPU tensors");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.size(1) == src.size(1),
              "dst and src: rows of one dtype and width, got ", dst.sizes(), " and ",
              src.sizes());
  for (const at::Tensor* t : {&dst_rows, &src_rows})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->scalar_type() == at::kLong &&
                    t->is_contiguous(), "row indices: contiguous 1-D CPU int64 tensors");
  TORCH_CHECK(dst_rows.numel() == src_rows.numel(), "as many dst rows (", dst_rows.numel(),
              ") as src rows (", src_rows.numel(), ")");
  const int64_t n = dst_rows.numel(), bytes = dst.size(1) * dst.element_size();
  const int64_t* di = dst_rows.data_ptr<int64_t>();
  const int64_t* si = src_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)  // a bad index would write outside the pool
    TORCH_CHECK(di[i] >= 0 && di[i] < dst.size(0) && si[i] >= 0 && si[i] < src.size(0),
                "row ", i, ": dst ", di[i], " of ", dst.size(0), ", src ", si[i], " of ",
                src.size(0));
  auto* d = static_cast<char*>(dst.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) std::memcpy(d + di[i] * bytes, s + si[i] * bytes, bytes);
  });
}

std::vector<std::string> isas() { return {"base"}; }  // decode_kernel.load asks every kernel

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy_rows", &copy_rows, "dst[dst_rows] = src[src_rows], whole rows", py::arg("dst"),
        py::arg("dst_rows"), py::arg("src"), py::arg("src_rows"));
  m.def("isas", &isas, "the instruction sets this build runs");
}
