// pybind11 module fp8_noncausal_attn._C: launches the CUDA kernels from raw device pointers.
// Taking integers (pointers, strides, the stream handle) rather than torch tensors keeps the
// extension independent of the torch build it runs next to.
#include <cstdint>
#include <stdexcept>
#include <string>

#include <pybind11/pybind11.h>

#include "params.h"

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fp8_noncausal_attn._C: ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

cudaError_t launch_for_dim(const fp8nca::AttnParams& p, int head_dim, int q_dtype, int kv_dtype,
                           cudaStream_t s, int* ctas_per_sm) {
  switch (head_dim) {
    case 64: return fp8nca::launch_attention_d64(p, q_dtype, kv_dtype, s, ctas_per_sm);
    case 128: return fp8nca::launch_attention_d128(p, q_dtype, kv_dtype, s, ctas_per_sm);
    case 256: return fp8nca::launch_attention_d256(p, q_dtype, kv_dtype, s, ctas_per_sm);
    default: return cudaErrorInvalidValue;
  }
}

// CTAs of the attention kernel for (head_dim, dtypes) that fit on one SM of `device`.
int ctas_per_sm(int device, int head_dim, int q_dtype, int kv_dtype) {
  check(cudaSetDevice(device), "cudaSetDevice");
  int ctas = 0;
  check(launch_for_dim(fp8nca::AttnParams{}, head_dim, q_dtype, kv_dtype, nullptr, &ctas),
        "occupancy query");
  return ctas;
}

// Launches attention (and the split-KV merge when num_splits > 1) on `stream`. Asynchronous.
void paged_attention(int device, std::uintptr_t stream, std::uintptr_t q, std::uintptr_t k,
                     std::uintptr_t v, std::uintptr_t out, std::uintptr_t block_table,
                     std::uintptr_t cu_seqlens_q, std::uintptr_t seq_lens, std::uintptr_t k_scale,
                     std::uintptr_t v_scale, std::uintptr_t causal_per_seq, bool causal,
                     std::uintptr_t ws_o, std::uintptr_t ws_lse, int q_dtype, int kv_dtype,
                     py::tuple q_strides, py::tuple o_strides, py::tuple k_strides,
                     py::tuple v_strides, py::tuple bt_strides, int num_tokens, int num_seqs,
                     int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                     int max_seqlen_q, int num_splits, float softmax_scale) {
  fp8nca::AttnParams p{};
  p.q = ptr<const void>(q);
  p.k = ptr<const void>(k);
  p.v = ptr<const void>(v);
  p.out = ptr<void>(out);
  p.block_table = ptr<const int32_t>(block_table);
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.seq_lens = ptr<const int32_t>(seq_lens);
  p.k_scale = ptr<const float>(k_scale);
  p.v_scale = ptr<const float>(v_scale);
  p.causal_per_seq = ptr<const uint8_t>(causal_per_seq);
  p.ws_o = ptr<float>(ws_o);
  p.ws_lse = ptr<float>(ws_lse);
  p.q_stride_t = q_strides[0].cast<int64_t>();
  p.q_stride_h = q_strides[1].cast<int64_t>();
  p.o_stride_t = o_strides[0].cast<int64_t>();
  p.o_stride_h = o_strides[1].cast<int64_t>();
  p.k_stride_b = k_strides[0].cast<int64_t>();
  p.k_stride_s = k_strides[1].cast<int64_t>();
  p.k_stride_h = k_strides[2].cast<int64_t>();
  p.v_stride_b = v_strides[0].cast<int64_t>();
  p.v_stride_s = v_strides[1].cast<int64_t>();
  p.v_stride_h = v_strides[2].cast<int64_t>();
  p.bt_stride_s = bt_strides[0].cast<int64_t>();
  p.bt_stride_b = bt_strides[1].cast<int64_t>();
  p.num_tokens = num_tokens;
  p.num_seqs = num_seqs;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_q_heads / num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.max_seqlen_q = max_seqlen_q;
  p.num_splits = num_splits;
  p.causal = causal ? 1 : 0;
  p.softmax_scale = softmax_scale;
  if (num_tokens == 0 || num_seqs == 0 || max_seqlen_q == 0) return;
  if (num_splits > 1 && (ws_o == 0 || ws_lse == 0)) {
    throw std::invalid_argument("fp8_noncausal_attn._C: num_splits > 1 needs ws_o and ws_lse");
  }

  check(cudaSetDevice(device), "cudaSetDevice");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  check(launch_for_dim(p, head_dim, q_dtype, kv_dtype, s, nullptr), "attention launch");
  if (num_splits > 1) check(fp8nca::launch_merge(p, q_dtype, s), "merge launch");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "CUDA paged attention kernels of fp8_noncausal_attn (mma.sync, cp.async).";
  m.def("paged_attention", &paged_attention, py::arg("device"), py::arg("stream"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("block_table"),
        py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("causal_per_seq"), py::arg("causal"), py::arg("ws_o"), py::arg("ws_lse"),
        py::arg("q_dtype"), py::arg("kv_dtype"), py::arg("q_strides"), py::arg("o_strides"),
        py::arg("k_strides"), py::arg("v_strides"), py::arg("bt_strides"),
        py::arg("num_tokens"), py::arg("num_seqs"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("max_seqlen_q"), py::arg("num_splits"), py::arg("softmax_scale"));
  m.def("ctas_per_sm", &ctas_per_sm, py::arg("device"), py::arg("head_dim"), py::arg("q_dtype"),
        py::arg("kv_dtype"), "CTAs of the attention kernel resident per SM (occupancy).");
  m.def("block_n", &fp8nca::block_n_for, py::arg("head_dim"),
        "Keys per tile of the kernel for this head dim (split-KV sizing).");
  m.attr("BLOCK_M") = fp8nca::kBlockM;
  m.attr("CUDA_ARCHS") = FP8NCA_CUDA_ARCHS;
}
