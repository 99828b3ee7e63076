// pybind11 module fp8_noncausal_attn._C: the CUDA kernels from raw device pointers, the plan
// and the split-KV planner every CUDA kernel family uses, and version queries. Taking integers
// (pointers, strides, the stream handle) rather than torch tensors keeps the extension
// independent of the torch build it runs next to. The tests' CPU hooks into the kernels' index
// maps are a separate module (tests/ext/host_hooks.cpp), not shipped.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cache/reshape_and_cache.h"
#include "cascade/merge.h"
#include "common/launch.h"
#include "common/params.h"
#include "common/plan.h"
#include "mma_sync/index_maps.h"

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

// Makes `device` current for the scope and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Largest power of two (<= 16 bytes) dividing a 16-bit tensor's address and its strides: the
// kernels pick their store width from it, so any `out` the API admits is written in place.
int alignment_of(std::uintptr_t address, int64_t stride_t, int64_t stride_h) {
  int align = 16;
  for (const uint64_t bytes : {static_cast<uint64_t>(address), static_cast<uint64_t>(stride_t) * 2,
                               static_cast<uint64_t>(stride_h) * 2}) {
    while (align > 1 && bytes % align != 0) align /= 2;
  }
  return align;
}

fp8nca::PlanInput plan_input(int num_seqs, int num_tokens, int num_q_heads, int num_kv_heads,
                             int head_dim, int cache_dtype, int max_seqlen_q, int max_seqlen_k,
                             int64_t resident_ctas, int num_splits, int window_left,
                             int window_right, bool all_causal) {
  fp8nca::PlanInput in;
  in.num_seqs = num_seqs;
  in.num_tokens = num_tokens;
  in.num_q_heads = num_q_heads;
  in.num_kv_heads = num_kv_heads;
  in.head_dim = head_dim;
  in.cache_dtype = cache_dtype;
  in.max_seqlen_q = max_seqlen_q;
  in.max_seqlen_k = max_seqlen_k;
  in.resident_ctas = resident_ctas;
  in.num_splits = num_splits;
  in.window_left = window_left;
  in.window_right = window_right;
  in.all_causal = all_causal;
  return in;
}

py::dict plan(int num_seqs, int num_tokens, int num_q_heads, int num_kv_heads, int head_dim,
              int cache_dtype, int max_seqlen_q, int max_seqlen_k, int64_t resident_ctas,
              int num_splits, int window_left, int window_right, bool causal) {
  const fp8nca::Plan p = fp8nca::make_plan(plan_input(
      num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, cache_dtype, max_seqlen_q,
      max_seqlen_k, resident_ctas, num_splits, window_left, window_right, causal));
  namespace m = fp8nca::mma_sync;
  const int group = num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0;
  const int rows_in_tile = std::min(std::max(max_seqlen_q, 1) * group, p.block_m);
  py::dict d;
  d["family"] = "mma_sync";
  // The plan itself, which the launch takes back as it is (no second make_plan per launch).
  d["launch"] = p;
  // The kernel the launch runs: its demangled name is kernel_name<head_dim, QT, KV>.
  d["kernel_name"] = p.block_m == fp8nca::mma_sync::kBlockM ? "paged_attention_kernel"
                                                            : "paged_attention_kernel_m128";
  d["block_m"] = p.block_m;
  d["block_n"] = p.block_n;
  d["threads"] = p.threads;
  d["smem_bytes"] = p.smem_bytes;
  d["m_tiles"] = p.m_tiles;
  d["num_splits"] = p.num_splits;
  d["grid"] = py::make_tuple(p.grid_x, p.grid_y, p.grid_z);
  d["ws_o_elems"] = p.ws_o_elems;
  d["ws_lse_elems"] = p.ws_lse_elems;
  // Warps sharing one key tile in the longest sequence's CTAs (the key-group split).
  d["key_groups"] = m::key_groups(
      m::tile_shape(head_dim, fp8nca::cache_bytes(cache_dtype), p.block_m), rows_in_tile);
  return d;
}

// The split-KV count of a kernel family whose CTAs hold block_m query rows of one KV head and
// stream keys in tiles of block_n (the CUTLASS-DSL families' own tiles; make_plan uses the same
// rule with the mma.sync tiles).
int plan_splits(int num_seqs, int num_q_heads, int num_kv_heads, int max_seqlen_q,
                int max_seqlen_k, int64_t resident_ctas, int block_m, int block_n,
                int num_splits, int window_left, int window_right, bool causal) {
  if (block_m < 1 || block_n < 1) {
    throw std::invalid_argument("fp8_noncausal_attn._C: plan_splits needs tiles of >= 1");
  }
  return fp8nca::plan_splits(
      plan_input(num_seqs, 0, num_q_heads, num_kv_heads, 0, fp8nca::kE4M3, max_seqlen_q,
                 max_seqlen_k, resident_ctas, num_splits, window_left, window_right, causal),
      block_m, block_n);
}

// CTAs of the attention kernel for (head_dim, tile of block_m rows, dtypes) that fit on one SM
// of `device`.
int ctas_per_sm(int device, int head_dim, int q_dtype, int cache_dtype, int block_m) {
  const DeviceGuard guard(device);
  int ctas = 0;
  check(fp8nca::ctas_per_sm(head_dim, block_m, q_dtype, cache_dtype, &ctas), "occupancy query");
  return ctas;
}

// A Given field of AttnParams from `fields[name]`: device pointers come as integers.
template <typename T>
T field(const py::dict& fields, const char* name) {
  if (!fields.contains(name)) {
    throw std::invalid_argument(std::string("fp8_noncausal_attn._C: paged_attention needs ") +
                                name);
  }
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(fields[name].cast<std::uintptr_t>());
  } else {
    return fields[name].cast<T>();
  }
}

// The names of the Given fields of AttnParams (FP8NCA_ATTN_FIELDS), in order.
std::vector<std::string> given_fields() {
  std::vector<std::string> names;
#define FP8NCA_NAME_Given(name) names.emplace_back(#name);
#define FP8NCA_NAME_Derived(name)
#define FP8NCA_NAME(type, name, source) FP8NCA_NAME_##source(name)
  FP8NCA_ATTN_FIELDS(FP8NCA_NAME)
#undef FP8NCA_NAME
#undef FP8NCA_NAME_Derived
#undef FP8NCA_NAME_Given
  return names;
}

// Launches attention (and the split-KV merge when num_splits > 1) on `stream` by `plan` (what
// plan() returned as "launch", made for this batch's sizes), with every Given field of
// AttnParams taken from `fields` by name (an unknown name is an error); `lse` (fp32 [num_tokens,
// num_q_heads], contiguous, or 0) receives each row's natural-log LSE in the same passes.
// Asynchronous.
void paged_attention(int device, std::uintptr_t stream, const fp8nca::Plan& plan, int q_dtype,
                     int cache_dtype, const py::dict& fields, std::uintptr_t lse) {
  fp8nca::AttnParams p{};
#define FP8NCA_FILL_Given(type, name) p.name = field<type>(fields, #name);
#define FP8NCA_FILL_Derived(type, name)
#define FP8NCA_FILL(type, name, source) FP8NCA_FILL_##source(type, name)
  FP8NCA_ATTN_FIELDS(FP8NCA_FILL)
#undef FP8NCA_FILL
#undef FP8NCA_FILL_Derived
#undef FP8NCA_FILL_Given
  const std::vector<std::string> names = given_fields();
  if (fields.size() != names.size()) {
    for (const auto& [key, value] : fields) {
      const std::string name = py::str(key);
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        throw std::invalid_argument("fp8_noncausal_attn._C: paged_attention takes no " + name);
      }
    }
  }
  p.out_align = alignment_of(reinterpret_cast<std::uintptr_t>(p.out), p.o_stride_t,
                             p.o_stride_h);
  p.group = p.num_q_heads / p.num_kv_heads;
  if (p.block_shift < 0 || p.block_shift > 30 || (1 << p.block_shift) != p.block_size) {
    throw std::invalid_argument("fp8_noncausal_attn._C: block_shift must be log2(block_size)");
  }
  if (p.causal_per_seq != nullptr && p.causal_bytes != 1 && p.causal_bytes != 4) {
    throw std::invalid_argument(
        "fp8_noncausal_attn._C: causal_bytes must be 1 (bool) or 4 (int32)");
  }
  if (p.window_left < -1 || p.window_right < -1) {
    throw std::invalid_argument("fp8_noncausal_attn._C: window sides must be -1 or >= 0");
  }
  if (p.scale_mode != fp8nca::kScalePerHead && p.scale_mode != fp8nca::kScalePerTokenHead) {
    throw std::invalid_argument(
        "fp8_noncausal_attn._C: scale_mode must be 0 (per KV head) or 1 (per token and head)");
  }
  // With no sequence every row is padding: the launch still zeroes them.
  if (p.num_tokens == 0) return;
  // The grid's y and z come from the batch's sizes: a plan made for another batch is refused.
  const bool padding_slice = plan.num_splits == 1;
  if (p.num_splits != plan.num_splits || plan.grid_y != static_cast<unsigned>(p.num_kv_heads) ||
      plan.grid_z != static_cast<unsigned>(p.num_seqs * plan.num_splits + padding_slice)) {
    throw std::invalid_argument(
        "fp8_noncausal_attn._C: paged_attention's plan was made for other sizes");
  }
  if (plan.num_splits > 1 && (p.ws_o == nullptr || p.ws_lse == nullptr)) {
    throw std::invalid_argument("fp8_noncausal_attn._C: num_splits > 1 needs ws_o and ws_lse");
  }
  const DeviceGuard guard(device);
  check(fp8nca::launch_attention(plan, p, q_dtype, cache_dtype, ptr<float>(lse),
                                 reinterpret_cast<cudaStream_t>(stream)),
        "attention launch");
}

// The split-KV merge kernel (csrc/cascade/merge.cu) on partials a kernel family wrote (or on
// states merge_attention_states stacked): ws_o fp32 [num_splits, num_tokens, num_q_heads,
// head_dim] and ws_lse fp32 [num_splits, num_tokens, num_q_heads] (log2 units), both contiguous,
// into `out` [num_tokens, num_q_heads, head_dim] of out_dtype (kBF16, kFP16, kMergeFP32)
// through its strides; sinks: fp32 [num_q_heads]
// natural-log logits or 0; lse: fp32 natural-log LSE of each merged row through lse_strides, or
// 0 (none); rows past cu_seqlens_q[num_seqs] written as zeros (LSE -inf). Asynchronous.
void merge_splits(int device, std::uintptr_t stream, std::uintptr_t ws_o, std::uintptr_t ws_lse,
                  std::uintptr_t out, py::tuple o_strides, std::uintptr_t sinks,
                  std::uintptr_t cu_seqlens_q, int64_t cu_stride, int num_seqs, int num_splits,
                  int num_tokens, int num_q_heads, int head_dim, int q_dtype, std::uintptr_t lse,
                  py::tuple lse_strides) {
  if (num_splits < 1 || num_seqs < 0 || num_tokens < 0 || num_q_heads < 1 || head_dim < 1) {
    throw std::invalid_argument("fp8_noncausal_attn._C: merge_splits got an empty or negative "
                                "size");
  }
  if (q_dtype != fp8nca::kBF16 && q_dtype != fp8nca::kFP16 && q_dtype != fp8nca::kMergeFP32) {
    throw std::invalid_argument("fp8_noncausal_attn._C: merge_splits writes bf16, fp16 or fp32");
  }
  if (ws_o == 0 || ws_lse == 0 || cu_seqlens_q == 0 || out == 0) {
    throw std::invalid_argument(
        "fp8_noncausal_attn._C: merge_splits needs ws_o, ws_lse, cu_seqlens_q and out");
  }
  fp8nca::AttnParams p{};
  p.out = ptr<void>(out);
  p.o_stride_t = o_strides[0].cast<int64_t>();
  p.o_stride_h = o_strides[1].cast<int64_t>();
  p.ws_o = ptr<float>(ws_o);
  p.ws_lse = ptr<float>(ws_lse);
  p.sinks = ptr<const float>(sinks);
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.cu_stride = cu_stride;
  p.num_seqs = num_seqs;
  p.num_splits = num_splits;
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.head_dim = head_dim;
  const fp8nca::MergeOutputs outputs{ptr<float>(lse), lse_strides[0].cast<int64_t>(),
                                     lse_strides[1].cast<int64_t>()};
  const DeviceGuard guard(device);
  check(fp8nca::launch_merge(p, q_dtype, outputs, reinterpret_cast<cudaStream_t>(stream)),
        "merge launch");
}

void reshape_and_cache(int device, std::uintptr_t stream, std::uintptr_t key,
                       std::uintptr_t value, std::uintptr_t key_cache,
                       std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                       std::uintptr_t k_scale, std::uintptr_t v_scale, py::tuple key_strides,
                       py::tuple value_strides, py::tuple kc_strides, py::tuple vc_strides,
                       int64_t slot_stride, int num_tokens, int num_kv_heads, int head_dim,
                       int block_size, int in_dtype, int cache_dtype) {
  fp8nca::CacheWriteParams p{};
  p.key = ptr<const void>(key);
  p.value = ptr<const void>(value);
  p.key_cache = ptr<void>(key_cache);
  p.value_cache = ptr<void>(value_cache);
  p.slot_mapping = ptr<const int64_t>(slot_mapping);
  p.k_scale = ptr<const float>(k_scale);
  p.v_scale = ptr<const float>(v_scale);
  p.key_stride_t = key_strides[0].cast<int64_t>();
  p.key_stride_h = key_strides[1].cast<int64_t>();
  p.value_stride_t = value_strides[0].cast<int64_t>();
  p.value_stride_h = value_strides[1].cast<int64_t>();
  p.kc_stride_b = kc_strides[0].cast<int64_t>();
  p.kc_stride_s = kc_strides[1].cast<int64_t>();
  p.kc_stride_h = kc_strides[2].cast<int64_t>();
  p.vc_stride_b = vc_strides[0].cast<int64_t>();
  p.vc_stride_s = vc_strides[1].cast<int64_t>();
  p.vc_stride_h = vc_strides[2].cast<int64_t>();
  p.slot_stride = slot_stride;
  p.num_tokens = num_tokens;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.in_dtype = in_dtype;
  p.cache_dtype = cache_dtype;
  if (in_dtype != fp8nca::kBF16 && in_dtype != fp8nca::kFP16) {
    throw std::invalid_argument("fp8_noncausal_attn._C: key/value must be bf16 or fp16");
  }
  // int8 has a dtype code (the attention kernels read int8 caches) but no per-head write.
  if (cache_dtype == fp8nca::kI8) {
    throw std::invalid_argument("fp8_noncausal_attn._C: reshape_and_cache writes no int8 cache");
  }
  const DeviceGuard guard(device);
  check(fp8nca::launch_reshape_and_cache(p, reinterpret_cast<cudaStream_t>(stream)),
        "reshape_and_cache launch");
}

int driver_version() {
  int version = 0;
  // 0 when no driver is installed (the call itself needs none).
  if (cudaDriverGetVersion(&version) != cudaSuccess) return 0;
  return version;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "CUDA paged attention kernels of fp8_noncausal_attn (mma.sync family, cp.async).";
  // Local to the module: the SIMT executor's builds of this file (fp8_noncausal_attn/backends/
  // cuda/simt.py) load beside it and each other, and pybind11 registers a global type once.
  py::class_<fp8nca::Plan>(m, "Plan", py::module_local(),
                           "One batch's C++ plan (csrc/common/plan.h), as plan() made it: the "
                           "launch takes it back unchanged.")
      .def_readonly("num_splits", &fp8nca::Plan::num_splits)
      .def_readonly("block_m", &fp8nca::Plan::block_m)
      .def_property_readonly("grid", [](const fp8nca::Plan& p) {
        return py::make_tuple(p.grid_x, p.grid_y, p.grid_z);
      });
  m.def("paged_attention", &paged_attention, py::arg("device"), py::arg("stream"),
        py::arg("plan"), py::arg("q_dtype"), py::arg("cache_dtype"), py::arg("fields"),
        py::arg("lse") = 0,
        "Paged attention (and the split-KV merge) on `stream` by `plan` (plan()'s \"launch\"); "
        "`fields`: every name of ATTN_FIELDS (device pointers as integers); `lse`: fp32 "
        "[num_tokens, num_q_heads] contiguous, or 0. Asynchronous.");
  m.def("reshape_and_cache", &reshape_and_cache, py::arg("device"), py::arg("stream"),
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("key_strides"), py::arg("value_strides"), py::arg("kc_strides"),
        py::arg("vc_strides"), py::arg("slot_stride"), py::arg("num_tokens"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("in_dtype"), py::arg("cache_dtype"));
  m.def("merge_splits", &merge_splits, py::arg("device"), py::arg("stream"), py::arg("ws_o"),
        py::arg("ws_lse"), py::arg("out"), py::arg("o_strides"), py::arg("sinks"),
        py::arg("cu_seqlens_q"), py::arg("cu_stride"), py::arg("num_seqs"), py::arg("num_splits"),
        py::arg("num_tokens"), py::arg("num_q_heads"), py::arg("head_dim"), py::arg("q_dtype"),
        py::arg("lse") = 0, py::arg("lse_strides") = py::make_tuple(0, 0),
        "The split-KV merge kernel on fp32 partials [splits, tokens, q_heads(, head_dim)] "
        "(log2 LSE) into out (q_dtype: a DTYPE_CODES 16-bit code or MERGE_FP32) and, when "
        "lse is given, each row's natural-log LSE; padded rows past cu_seqlens_q[num_seqs] "
        "zeroed (LSE -inf). Asynchronous.");
  m.def("plan", &plan, py::arg("num_seqs"), py::arg("num_tokens"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("cache_dtype"),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("resident_ctas"),
        py::arg("num_splits") = 0, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("causal") = false,
        "Tiles, split-KV count, grid and workspace sizes of one batch (host only, no GPU); "
        "causal: every sequence is causal (sizes splits from a windowed key span).");
  m.def("plan_splits", &plan_splits, py::arg("num_seqs"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("resident_ctas"), py::arg("block_m"), py::arg("block_n"),
        py::arg("num_splits") = 0, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("causal") = false,
        "The split-KV count of CTAs of block_m query rows streaming block_n-key tiles, by the "
        "plan's rule (num_splits > 0 forces it, clamped to the grid).");
  m.def("ctas_per_sm", &ctas_per_sm, py::arg("device"), py::arg("head_dim"), py::arg("q_dtype"),
        py::arg("cache_dtype"), py::arg("block_m") = fp8nca::mma_sync::kBlockM,
        "CTAs of the attention kernel (tile of block_m query rows) resident per SM (occupancy).");
  m.def("block_m_for", &fp8nca::block_m_for, py::arg("head_dim"), py::arg("cache_dtype"),
        py::arg("rows_per_kv_head"),
        "Query rows per CTA the plan picks for R = max_seqlen_q x group rows per KV head.");
  m.def("driver_version", &driver_version,
        "The installed CUDA driver's version (cudaDriverGetVersion; 0 when none).");
  m.attr("CUDA_RUNTIME_VERSION") = CUDART_VERSION;
  m.attr("CUDA_ARCHS") = FP8NCA_CUDA_ARCHS;
  m.attr("PTX_ARCH") = FP8NCA_PTX_ARCH;  // PTX of the newest arch, JIT-compiled for newer GPUs
  m.attr("MAX_SEQS") = fp8nca::kMaxSeqs;
  m.attr("MAX_SPLITS") = fp8nca::kMaxSplits;
  m.attr("WAVE_FILL") = fp8nca::kWaveFill;
  m.attr("ATTN_FIELDS") = py::tuple(py::cast(given_fields()));  // AttnParams' Given fields
  // The launch record this was built from (fp8_noncausal_attn/launch_record.py record_hash):
  // the package refuses another record's when it loads this module.
  m.attr("LAUNCH_RECORD_HASH") = FP8NCA_LAUNCH_RECORD_HASH;
  py::dict codes;
  codes["bfloat16"] = static_cast<int>(fp8nca::kBF16);
  codes["float16"] = static_cast<int>(fp8nca::kFP16);
  codes["float8_e4m3fn"] = static_cast<int>(fp8nca::kE4M3);
  codes["float8_e5m2"] = static_cast<int>(fp8nca::kE5M2);
  codes["int8"] = static_cast<int>(fp8nca::kI8);
  m.attr("DTYPE_CODES") = codes;  // element type codes of csrc/common/params.h
  py::dict scale_modes;
  scale_modes["per_head"] = static_cast<int>(fp8nca::kScalePerHead);
  scale_modes["per_token_head"] = static_cast<int>(fp8nca::kScalePerTokenHead);
  m.attr("SCALE_MODES") = scale_modes;  // the scale_mode field's values (params.h ScaleMode)
  m.attr("MERGE_FP32") = fp8nca::kMergeFP32;  // merge_splits' code for float32 rows
}
