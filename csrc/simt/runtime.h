// The SIMT executor: runs a CUDA kernel's launch grid on the CPU (runtime.cpp), CTA after CTA,
// each CTA's threads as fibers that switch only where threads meet (a warp collective, the
// barrier). It checks what compute-sanitizer would: a shared-memory race between threads with
// no barrier between their accesses, a shared access outside the launch's allocation, a global
// write outside every tensor the launch may write, a read of shared memory that a pending
// cp.async has not completed; and that every thread reaches the same barrier and every lane of
// a warp the same collective. The first failure stops the launch with a report naming the
// kernel, the CTA, the thread and the address.
//
// Memory accesses reach the checks through the compiler's ThreadSanitizer instrumentation
// (the kernel translation units are compiled with -fsanitize=thread, and runtime.cpp defines
// the __tsan_* entry points itself: no sanitizer runtime is linked).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fp8nca::simt {

struct Index3 {
  unsigned x, y, z;
};

// Where a collective or barrier is called from, for the reports.
struct Site {
  const char* file;
  int line;
  const char* what;
};

struct GridShape {
  Index3 grid, block;
  size_t smem_bytes;
};

Index3 thread_index();
Index3 block_index();
Index3 block_dim();
Index3 grid_dim();

// Runs entry(arg) as every thread of every CTA of `shape`; 0, or cudaErrorLaunchFailure's code
// with last_report() set. `kernel` is a __PRETTY_FUNCTION__ naming the kernel.
int run_grid(const char* kernel, const GridShape& shape, void (*entry)(void*), void* arg);
// The sticky error of the last launch (0 when it passed), cleared by the call.
int take_launch_error();
// What the last failed launch found.
const char* last_report();

enum class ShuffleMode { kIndex, kXor };
uint32_t shuffle_word(uint32_t mask, uint32_t value, int lane_arg, int width, ShuffleMode mode,
                      const Site& site);
bool vote_any(uint32_t mask, bool predicate, const Site& site);
void sync_threads(const Site& site);

template <typename T>
T shuffle(uint32_t mask, T value, int lane_arg, int width, ShuffleMode mode, const Site& site) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 32- or 64-bit values");
  uint32_t words[sizeof(T) / 4];
  std::memcpy(words, &value, sizeof(T));
  for (uint32_t& w : words) w = shuffle_word(mask, w, lane_arg, width, mode, site);
  std::memcpy(&value, words, sizeof(T));
  return value;
}

// cp.async of `bytes` into shared memory, reading src_bytes (0: zero-fill only) from `src`.
void cp_async(void* smem, const void* src, int bytes, int src_bytes, const Site& site);
void cp_async_commit();
// cp.async.wait_group n (n > 0), or cp.async.wait_all (n == 0).
void cp_async_wait(int n);

enum class MmaType { kBF16, kF16 };
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, MmaType type,
                  const Site& site);
void ldmatrix_x4_trans(uint32_t (&d)[4], uint32_t smem_address, const Site& site);

uint32_t shared_offset(const void* p);
void* dynamic_smem();

}  // namespace fp8nca::simt

// The executor's own C entry points, for the Python side (ctypes on the extension module):
// the address ranges the next launches may write, each with a name for the reports.
extern "C" void fp8nca_simt_set_writable(int count, const uint64_t* begin, const uint64_t* end,
                                         const char* const* names);
