// The SIMT executor (runtime.h): fibers for the threads of one CTA at a time, a
// scheduler that runs each thread until it meets others (a warp collective or __syncthreads)
// and then resolves what every thread waits for, shadow state per byte of shared memory for the
// race and cp.async checks, and the __tsan_* entry points through which the instrumented kernel
// code reports its memory accesses. Compiled without instrumentation itself.
#include "runtime.h"

#include <sys/mman.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace fp8nca::simt {
namespace {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = size_t{256} << 10;
// Shared memory sits between two guard zones of this size: an access there is out of bounds.
constexpr size_t kGuardBytes = size_t{1} << 20;
constexpr int kErrorLaunchFailure = 719;  // cudaErrorLaunchFailure

enum class State { kRunnable, kBarrier, kCollective, kExited };
enum class Op { kShuffle, kVote, kMma, kLdmatrix };

struct Copy {
  uint8_t* dst;
  const uint8_t* src;
  int bytes, src_bytes;
};

struct ShuffleArgs {
  uint32_t value;
  int lane_arg, width;
  ShuffleMode mode;
  uint32_t result;
};
struct VoteArgs {
  bool predicate, result;
};
struct MmaArgs {
  float* c;
  const uint32_t* a;
  uint32_t b0, b1;
  MmaType type;
};
struct LdmatrixArgs {
  uint32_t address;
  uint32_t* d;
};

// A fiber: its own stack and saved registers. On x86-64 a switch saves the callee-saved
// registers and the FP control words and swaps stacks (fp8nca_simt_fiber_switch below):
// 65-70 ns a switch on the 2-core development machine, where glibc's swapcontext, which also
// saves the signal mask with a system call, took 0.9-2.5 us; a warp collective costs 64
// switches. Elsewhere ucontext.
struct Fiber {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t context;
#endif
};

struct Thread {
  Fiber fiber;
  int tid = 0;
  State state = State::kRunnable;
  Site site{};
  Op op{};
  uint32_t mask = 0;
  void* args = nullptr;
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open;                 // copies since the last commit
};

// One byte of shared memory: who wrote and read it in which barrier interval (epoch), and
// whose cp.async still owes it.
struct Shadow {
  uint32_t write_epoch = 0, read_epoch = 0;
  int32_t writer = -1, reader = -1;  // reader kManyReaders: several threads this epoch
  int32_t pending = -1;
};
constexpr int32_t kManyReaders = -2;

struct Region {
  uintptr_t begin, end;
  std::string name;
};

struct Executor {
  std::mutex lock;
  std::string kernel;
  GridShape shape{};
  Index3 block{};
  void (*entry)(void*) = nullptr;
  void* arg = nullptr;
  std::vector<Thread> threads;
  Fiber scheduler;
  uint8_t* stacks = nullptr;
  size_t stack_slots = 0;
  uint8_t* arena = nullptr;  // guard | shared memory | guard
  size_t arena_bytes = 0;
  uint8_t* smem = nullptr;
  std::vector<Shadow> shadow;
  uint32_t epoch = 1;
  bool failed = false;
  std::string report;
  int sticky = 0;
  std::vector<Region> writable;
};

Executor& executor() {
  static Executor e;
  return e;
}

// The running fiber's thread (null outside a kernel: the launch code's own accesses pass).
Thread* g_current = nullptr;

[[noreturn]] void fiber_main();

#if defined(__x86_64__)
// fiber_switch(save, load): saves this fiber's registers on its stack and its stack pointer in
// *save, then resumes the fiber whose stack pointer is `load`.
extern "C" void fp8nca_simt_fiber_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .hidden fp8nca_simt_fiber_switch
  .type fp8nca_simt_fiber_switch, @function
fp8nca_simt_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fp8nca_simt_fiber_switch, .-fp8nca_simt_fiber_switch
)");

[[noreturn]] void fiber_entry();

// A fresh fiber on [stack, stack + bytes) that starts in fiber_entry: the frame
// fp8nca_simt_fiber_switch pops (FP control words, six registers, the return address).
void start_fiber(Fiber& f, uint8_t* stack, size_t bytes) {
  auto* top = reinterpret_cast<uint64_t*>(
      reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15});
  uint32_t control[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  *--top = 0;  // fiber_entry's return address slot: it never returns
  *--top = reinterpret_cast<uint64_t>(&fiber_entry);
  for (int r = 0; r < 6; ++r) *--top = 0;
  *--top = uint64_t{control[0]} | uint64_t{control[1] & 0xffffu} << 32;
  f.sp = top;
}
void switch_fiber(Fiber& from, Fiber& to) { fp8nca_simt_fiber_switch(&from.sp, to.sp); }
#else
[[noreturn]] void fiber_entry_ucontext();
void start_fiber(Fiber& f, uint8_t* stack, size_t bytes) {
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = stack;
  f.context.uc_stack.ss_size = bytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, fiber_entry_ucontext, 0);
}
void switch_fiber(Fiber& from, Fiber& to) { swapcontext(&from.context, &to.context); }
#endif

std::string hex(uintptr_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

std::string where(const Site& s) {
  const char* slash = std::strrchr(s.file, '/');
  return std::string(s.what) + " (" + (slash ? slash + 1 : s.file) + ":" + std::to_string(s.line) +
         ")";
}

std::string thread_name(int tid) {
  return "thread " + std::to_string(tid) + " (warp " + std::to_string(tid / kWarpSize) +
         ", lane " + std::to_string(tid % kWarpSize) + ")";
}

// Records the launch's failure (the first one only).
void record(int tid, const std::string& what) {
  Executor& e = executor();
  if (e.failed) return;
  e.failed = true;
  e.report = "SIMT executor: " + e.kernel + ", CTA (" + std::to_string(e.block.x) + ", " +
             std::to_string(e.block.y) + ", " + std::to_string(e.block.z) + "), " +
             thread_name(tid) + ": " + what;
}

// Leaves the failing fiber for good (the scheduler abandons the CTA).
[[noreturn]] void abandon(Thread* t) {
  t->state = State::kExited;
  g_current = nullptr;
  switch_fiber(t->fiber, executor().scheduler);
  std::abort();  // never resumed
}

[[noreturn]] void fail(Thread* t, const std::string& what) {
  record(t->tid, what);
  abandon(t);
}

std::string shared_at(size_t offset) { return "shared memory offset " + std::to_string(offset); }

// The race and cp.async checks of one access of `size` bytes at `offset` by thread `tid`;
// false (the failure recorded) when one fails. `cp_async`: the access is a cp.async issue.
bool check_shared(int tid, size_t offset, size_t size, bool write, bool cp_async = false) {
  Executor& e = executor();
  const char* verb = cp_async ? "a cp.async into" : write ? "a write of" : "a read of";
  for (size_t i = offset; i < offset + size; ++i) {
    Shadow& s = e.shadow[i];
    if (s.pending >= 0) {
      record(tid, std::string(verb) + " " + shared_at(i) + " that a cp.async of " +
                      thread_name(s.pending) +
                      " has not completed (no cp.async.wait_group covers it yet)");
      return false;
    }
    if (s.write_epoch == e.epoch && s.writer != tid) {
      record(tid, std::string("shared-memory race (") + (write ? "WAW" : "RAW") + "): " + verb +
                      " " + shared_at(i) + ", which " + thread_name(s.writer) +
                      " wrote with no __syncthreads between");
      return false;
    }
    if (write && s.read_epoch == e.epoch && s.reader != tid) {
      const std::string reader =
          s.reader == kManyReaders ? "several threads" : thread_name(s.reader);
      record(tid, "shared-memory race (WAR): " + std::string(verb) + " " + shared_at(i) +
                      ", which " + reader + " read with no __syncthreads between");
      return false;
    }
    if (write) {
      s.write_epoch = e.epoch;
      s.writer = tid;
    } else if (s.read_epoch != e.epoch) {
      s.read_epoch = e.epoch;
      s.reader = tid;
    } else if (s.reader != tid) {
      s.reader = kManyReaders;
    }
  }
  return true;
}

bool in_shared_window(uintptr_t a, size_t size) {
  const Executor& e = executor();
  const auto lo = reinterpret_cast<uintptr_t>(e.arena);
  return e.arena != nullptr && a + size > lo && a < lo + e.arena_bytes;
}

void on_access(const void* p, size_t size, bool write) {
  Thread* t = g_current;
  if (t == nullptr) return;
  Executor& e = executor();
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (in_shared_window(a, size)) {
    const auto lo = reinterpret_cast<uintptr_t>(e.smem);
    if (a < lo || a + size > lo + e.shape.smem_bytes) {
      const long long offset = static_cast<long long>(a) - static_cast<long long>(lo);
      fail(t, std::string(write ? "write" : "read") + " of " + std::to_string(size) +
                  " bytes at shared memory offset " + std::to_string(offset) +
                  ", outside the launch's " + std::to_string(e.shape.smem_bytes) +
                  " bytes of shared memory");
    }
    if (!check_shared(t->tid, a - lo, size, write)) abandon(t);
    return;
  }
  const auto stacks = reinterpret_cast<uintptr_t>(e.stacks);
  if (a >= stacks && a < stacks + e.stack_slots * kStackBytes) return;  // a thread's locals
  if (!write) return;
  for (const Region& r : e.writable) {
    if (a >= r.begin && a + size <= r.end) return;
  }
  std::string regions;
  for (const Region& r : e.writable) {
    regions += (regions.empty() ? "" : ", ") + r.name + " [" + hex(r.begin) + ", " + hex(r.end) +
               ")";
  }
  fail(t, "global write of " + std::to_string(size) + " bytes at " + hex(a) +
              ", outside every tensor the launch may write (" +
              (regions.empty() ? "none" : regions) + ")");
}

// Blocks the calling thread at a collective until the scheduler resolves it.
void arrive(Op op, uint32_t mask, void* args, const Site& site) {
  Thread* t = g_current;
  t->state = State::kCollective;
  t->op = op;
  t->mask = mask;
  t->args = args;
  t->site = site;
  g_current = nullptr;
  switch_fiber(t->fiber, executor().scheduler);
}

float operand(uint32_t word, int half, MmaType type) {
  const auto bits = static_cast<uint16_t>(word >> (16 * half));
  if (type == MmaType::kBF16) {
    uint32_t u = uint32_t{bits} << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  }
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// mma.m16n8k16 over the warp's fragments, in the PTX ISA's layouts (lane = 4 g + t):
// A (16 x 16): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9],
// a3 = A[g+8][2t+8, 2t+9]; B (16 x 8, k x n): b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
// C / D (16 x 8): c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]. Lower half first.
// Products are exact in double; each D element is rounded to fp32 once.
void resolve_mma(Thread* lanes) {
  double a[16][16], b[16][8], c[16][8];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const auto* m = static_cast<const MmaArgs*>(lanes[lane].args);
    const int g = lane >> 2, t = lane & 3;
    for (int h = 0; h < 2; ++h) {
      a[g][2 * t + h] = operand(m->a[0], h, m->type);
      a[g + 8][2 * t + h] = operand(m->a[1], h, m->type);
      a[g][2 * t + 8 + h] = operand(m->a[2], h, m->type);
      a[g + 8][2 * t + 8 + h] = operand(m->a[3], h, m->type);
      b[2 * t + h][g] = operand(m->b0, h, m->type);
      b[2 * t + 8 + h][g] = operand(m->b1, h, m->type);
      c[g][2 * t + h] = m->c[h];
      c[g + 8][2 * t + h] = m->c[2 + h];
    }
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    auto* m = static_cast<MmaArgs*>(lanes[lane].args);
    const int g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
      double sum = c[row][col];
      for (int k = 0; k < 16; ++k) sum += a[row][k] * b[k][col];
      m->c[e] = static_cast<float>(sum);
    }
  }
}

// ldmatrix.m8n8.x4.trans.b16: lane 8i + r gives the address of row r of matrix i (16 bytes,
// 16-byte aligned); lane l receives in d[i] the elements (2(l%4), l/4) and (2(l%4)+1, l/4) of
// matrix i, i.e. row l/4 of its transpose, lower half first.
bool resolve_ldmatrix(Thread* lanes, int warp) {
  Executor& e = executor();
  uint16_t rows[4][8][8];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const uint32_t address = static_cast<const LdmatrixArgs*>(lanes[lane].args)->address;
    const int tid = warp * kWarpSize + lane;
    if (address % 16 != 0 || address + 16 > e.shape.smem_bytes) {
      record(tid, "ldmatrix row address " + std::to_string(address) +
                      (address % 16 ? " is not 16-byte aligned" : " is outside the launch's ") +
                      (address % 16 ? "" : std::to_string(e.shape.smem_bytes) +
                                               " bytes of shared memory"));
      return false;
    }
    if (!check_shared(tid, address, 16, false)) return false;
    std::memcpy(rows[lane / 8][lane % 8], e.smem + address, 16);
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    uint32_t* d = static_cast<LdmatrixArgs*>(lanes[lane].args)->d;
    const int r = 2 * (lane % 4), c = lane / 4;
    for (int i = 0; i < 4; ++i) d[i] = rows[i][r][c] | uint32_t{rows[i][r + 1][c]} << 16;
  }
  return true;
}

void resolve_shuffle(Thread* lanes, uint32_t mask, int warp) {
  uint32_t results[kWarpSize];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if (!(mask >> lane & 1u)) continue;
    const auto* s = static_cast<const ShuffleArgs*>(lanes[lane].args);
    const int src = s->mode == ShuffleMode::kIndex ? (s->lane_arg & (kWarpSize - 1))
                                                   : lane ^ s->lane_arg;
    if (src >= kWarpSize) {
      results[lane] = s->value;  // outside the warp: the lane's own value (CUDA's rule)
      continue;
    }
    if (!(mask >> src & 1u)) {
      record(warp * kWarpSize + lane, where(lanes[lane].site) + " reads lane " +
                                          std::to_string(src) + ", outside its mask " +
                                          hex(mask));
      return;
    }
    results[lane] = static_cast<const ShuffleArgs*>(lanes[src].args)->value;
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if (mask >> lane & 1u) static_cast<ShuffleArgs*>(lanes[lane].args)->result = results[lane];
  }
}

std::string state_of(const Thread& t) {
  switch (t.state) {
    case State::kExited: return "has exited";
    case State::kBarrier: return "waits at " + where(t.site);
    case State::kCollective: return "waits at " + where(t.site);
    default: return "runs";
  }
}

// Resolves the collective the lanes of warp `w` wait at, when every lane of its mask waits at
// the same one. Returns whether it did; a lane of the mask that has exited or waits elsewhere
// is reported (the launch fails).
bool resolve_warp(int w) {
  Executor& e = executor();
  Thread* lanes = &e.threads[static_cast<size_t>(w) * kWarpSize];
  int first = -1;
  for (int l = 0; l < kWarpSize && first < 0; ++l) {
    if (lanes[l].state == State::kCollective) first = l;
  }
  if (first < 0) return false;
  const Thread& f = lanes[first];
  for (int l = 0; l < kWarpSize; ++l) {
    const Thread& t = lanes[l];
    if (!(f.mask >> l & 1u)) continue;
    const bool same = t.state == State::kCollective && t.op == f.op && t.mask == f.mask &&
                      t.site.line == f.site.line && std::strcmp(t.site.file, f.site.file) == 0;
    if (!same) {
      record(t.tid, "lane " + std::to_string(first) + " waits at " + where(f.site) +
                        " with mask " + hex(f.mask) + " while this lane " + state_of(t) +
                        " (a warp collective needs every lane of its mask)");
      return false;
    }
  }
  if ((f.op == Op::kMma || f.op == Op::kLdmatrix) && f.mask != 0xffffffffu) {
    record(f.tid, where(f.site) + " is .aligned: all 32 lanes take part");
    return false;
  }
  switch (f.op) {
    case Op::kShuffle: {
      const auto* s = static_cast<const ShuffleArgs*>(f.args);
      if (s->width != kWarpSize) {
        record(f.tid, where(f.site) + ": the executor supports width 32 only");
        return false;
      }
      resolve_shuffle(lanes, f.mask, w);
      break;
    }
    case Op::kVote: {
      bool any = false;
      for (int l = 0; l < kWarpSize; ++l) {
        if (f.mask >> l & 1u) any |= static_cast<const VoteArgs*>(lanes[l].args)->predicate;
      }
      for (int l = 0; l < kWarpSize; ++l) {
        if (f.mask >> l & 1u) static_cast<VoteArgs*>(lanes[l].args)->result = any;
      }
      break;
    }
    case Op::kMma: resolve_mma(lanes); break;
    case Op::kLdmatrix: resolve_ldmatrix(lanes, w); break;
  }
  if (e.failed) return false;
  const uint32_t mask = f.mask;
  for (int l = 0; l < kWarpSize; ++l) {
    if (mask >> l & 1u) lanes[l].state = State::kRunnable;
  }
  return true;
}

// Releases the CTA's barrier when every thread waits at the same __syncthreads; reports a
// thread that has exited or waits at another one. Returns whether it released.
bool resolve_barrier() {
  Executor& e = executor();
  const Thread* at = nullptr;
  for (const Thread& t : e.threads) {
    if (t.state == State::kBarrier) {
      at = &t;
      break;
    }
  }
  if (at == nullptr) return false;
  for (const Thread& t : e.threads) {
    const bool same = t.state == State::kBarrier && t.site.line == at->site.line &&
                      std::strcmp(t.site.file, at->site.file) == 0;
    if (!same) {
      record(t.tid, thread_name(at->tid) + " waits at " + where(at->site) + " while this thread " +
                        state_of(t) + " (every thread of the CTA must reach the same barrier)");
      return false;
    }
  }
  ++e.epoch;
  for (Thread& t : e.threads) t.state = State::kRunnable;
  return true;
}

[[noreturn]] void fiber_main() {
  Executor& e = executor();
  e.entry(e.arg);
  Thread* t = g_current;
  t->state = State::kExited;
  g_current = nullptr;
  switch_fiber(t->fiber, e.scheduler);  // never resumed
  std::abort();
}

#if defined(__x86_64__)
void fiber_entry() { fiber_main(); }
#else
void fiber_entry_ucontext() { fiber_main(); }
#endif

void reserve(size_t threads, size_t smem_bytes) {
  Executor& e = executor();
  if (threads > e.stack_slots) {
    if (e.stacks != nullptr) munmap(e.stacks, e.stack_slots * kStackBytes);
    void* p = mmap(nullptr, threads * kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) std::abort();
    e.stacks = static_cast<uint8_t*>(p);
    e.stack_slots = threads;
  }
  const size_t arena = 2 * kGuardBytes + smem_bytes;
  if (arena > e.arena_bytes) {
    if (e.arena != nullptr) munmap(e.arena, e.arena_bytes);
    void* p = mmap(nullptr, arena, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) std::abort();
    e.arena = static_cast<uint8_t*>(p);
    e.arena_bytes = arena;
  }
  e.smem = e.arena + kGuardBytes;
}

// One CTA, to its end or its first failure.
void run_cta() {
  Executor& e = executor();
  ++e.epoch;
  // Uninitialised shared memory reads as garbage on a GPU; a fixed non-zero pattern here.
  std::memset(e.smem, 0xa5, e.shape.smem_bytes);
  e.shadow.assign(e.shape.smem_bytes, Shadow{});
  for (size_t i = 0; i < e.threads.size(); ++i) {
    Thread& t = e.threads[i];
    t.state = State::kRunnable;
    t.groups.clear();
    t.open.clear();
    start_fiber(t.fiber, e.stacks + i * kStackBytes, kStackBytes);
  }
  const int warps = static_cast<int>(e.threads.size()) / kWarpSize;
  while (true) {
    for (Thread& t : e.threads) {
      if (t.state != State::kRunnable) continue;
      g_current = &t;
      switch_fiber(e.scheduler, t.fiber);
      g_current = nullptr;
      if (e.failed) return;
    }
    bool resolved = false;
    for (int w = 0; w < warps; ++w) {
      resolved |= resolve_warp(w);
      if (e.failed) return;
    }
    if (resolved) continue;
    if (resolve_barrier()) continue;
    if (e.failed) return;
    return;  // every thread has exited (resolve_barrier reports a stuck one)
  }
}

}  // namespace

Index3 thread_index() {
  const Executor& e = executor();
  const unsigned tid = static_cast<unsigned>(g_current->tid);
  return {tid % e.shape.block.x, tid / e.shape.block.x % e.shape.block.y,
          tid / (e.shape.block.x * e.shape.block.y)};
}
Index3 block_index() { return executor().block; }
Index3 block_dim() { return executor().shape.block; }
Index3 grid_dim() { return executor().shape.grid; }

int run_grid(const char* kernel, const GridShape& shape, void (*entry)(void*), void* arg) {
  Executor& e = executor();
  const std::lock_guard<std::mutex> guard(e.lock);
  std::string name = kernel;
  const size_t at = name.find("Kernel = ");
  if (at != std::string::npos) name = name.substr(at + 9, name.rfind(']') - at - 9);
  e.kernel = name;
  e.shape = shape;
  e.entry = entry;
  e.arg = arg;
  e.failed = false;
  const size_t threads = size_t{shape.block.x} * shape.block.y * shape.block.z;
  if (threads == 0 || threads % kWarpSize != 0 || threads > 1024) {
    e.report = "SIMT executor: " + name + ": blocks of whole warps (32..1024 threads) only";
    return e.sticky = kErrorLaunchFailure;
  }
  reserve(threads, shape.smem_bytes);
  e.threads.resize(threads);
  for (size_t i = 0; i < threads; ++i) e.threads[i].tid = static_cast<int>(i);
  for (unsigned z = 0; z < shape.grid.z; ++z) {
    for (unsigned y = 0; y < shape.grid.y; ++y) {
      for (unsigned x = 0; x < shape.grid.x; ++x) {
        e.block = {x, y, z};
        run_cta();
        if (e.failed) return e.sticky = kErrorLaunchFailure;
      }
    }
  }
  return 0;
}

int take_launch_error() {
  Executor& e = executor();
  const int err = e.sticky;
  e.sticky = 0;
  return err;
}

const char* last_report() { return executor().report.c_str(); }

uint32_t shuffle_word(uint32_t mask, uint32_t value, int lane_arg, int width, ShuffleMode mode,
                      const Site& site) {
  ShuffleArgs args{value, lane_arg, width, mode, 0};
  arrive(Op::kShuffle, mask, &args, site);
  return args.result;
}

bool vote_any(uint32_t mask, bool predicate, const Site& site) {
  VoteArgs args{predicate, false};
  arrive(Op::kVote, mask, &args, site);
  return args.result;
}

void sync_threads(const Site& site) {
  Thread* t = g_current;
  t->state = State::kBarrier;
  t->site = site;
  g_current = nullptr;
  switch_fiber(t->fiber, executor().scheduler);
}

void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, MmaType type,
                  const Site& site) {
  MmaArgs args{c, a, b0, b1, type};
  arrive(Op::kMma, 0xffffffffu, &args, site);
}

void ldmatrix_x4_trans(uint32_t (&d)[4], uint32_t smem_address, const Site& site) {
  LdmatrixArgs args{smem_address, d};
  arrive(Op::kLdmatrix, 0xffffffffu, &args, site);
}

void cp_async(void* smem, const void* src, int bytes, int src_bytes, const Site& site) {
  Thread* t = g_current;
  Executor& e = executor();
  const auto a = reinterpret_cast<uintptr_t>(smem);
  const auto lo = reinterpret_cast<uintptr_t>(e.smem);
  if (a < lo || a + bytes > lo + e.shape.smem_bytes) {
    fail(t, where(site) + " to " + hex(a) + ": its destination is outside the launch's shared "
                                            "memory");
  }
  if (a % bytes != 0 || (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % bytes != 0)) {
    fail(t, where(site) + ": addresses must be aligned to the copy's " + std::to_string(bytes) +
                " bytes");
  }
  if (!check_shared(t->tid, a - lo, bytes, true, true)) abandon(t);
  for (int i = 0; i < bytes; ++i) e.shadow[a - lo + i].pending = t->tid;
  t->open.push_back({static_cast<uint8_t*>(smem), static_cast<const uint8_t*>(src), bytes,
                     src_bytes});
}

void cp_async_commit() {
  Thread* t = g_current;
  t->groups.push_back(std::move(t->open));
  t->open.clear();
}

void cp_async_wait(int n) {
  Thread* t = g_current;
  Executor& e = executor();
  if (n == 0) cp_async_commit();  // wait_all: the uncommitted copies too
  const size_t keep = static_cast<size_t>(n);
  while (t->groups.size() > keep) {
    for (const Copy& c : t->groups.front()) {
      std::memcpy(c.dst, c.src, c.src_bytes);
      std::memset(c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
      const size_t offset = c.dst - e.smem;
      for (int i = 0; i < c.bytes; ++i) {
        Shadow& s = e.shadow[offset + i];
        s.pending = -1;
        s.write_epoch = e.epoch;  // written by this thread, visible to it now
        s.writer = t->tid;
      }
    }
    t->groups.erase(t->groups.begin());
  }
}

uint32_t shared_offset(const void* p) {
  return static_cast<uint32_t>(static_cast<const uint8_t*>(p) - executor().smem);
}

void* dynamic_smem() { return executor().smem; }

}  // namespace fp8nca::simt

extern "C" __attribute__((visibility("default"))) void fp8nca_simt_set_writable(int count, const uint64_t* begin, const uint64_t* end,
                                         const char* const* names) {
  auto& e = fp8nca::simt::executor();
  e.writable.clear();
  for (int i = 0; i < count; ++i) e.writable.push_back({begin[i], end[i], names[i]});
}

// The ThreadSanitizer instrumentation's entry points (the kernel translation units are built
// with -fsanitize=thread and linked without its runtime): every load and store reaches on_access.
#define FP8NCA_TSAN_ACCESS(size)                                                        \
  extern "C" void __tsan_read##size(void* p) { fp8nca::simt::on_access(p, size, false); } \
  extern "C" void __tsan_write##size(void* p) { fp8nca::simt::on_access(p, size, true); } \
  extern "C" void __tsan_unaligned_read##size(void* p) {                                \
    fp8nca::simt::on_access(p, size, false);                                            \
  }                                                                                     \
  extern "C" void __tsan_unaligned_write##size(void* p) {                               \
    fp8nca::simt::on_access(p, size, true);                                             \
  }
FP8NCA_TSAN_ACCESS(1)
FP8NCA_TSAN_ACCESS(2)
FP8NCA_TSAN_ACCESS(4)
FP8NCA_TSAN_ACCESS(8)
FP8NCA_TSAN_ACCESS(16)
#undef FP8NCA_TSAN_ACCESS
extern "C" void __tsan_read_range(void* p, unsigned long size) {
  fp8nca::simt::on_access(p, size, false);
}
extern "C" void __tsan_write_range(void* p, unsigned long size) {
  fp8nca::simt::on_access(p, size, true);
}
// std::atomic in the launch code (outside any CTA): plain atomics.
extern "C" uint64_t __tsan_atomic64_load(const volatile uint64_t* a, int) {
  return __atomic_load_n(a, __ATOMIC_SEQ_CST);
}
extern "C" uint64_t __tsan_atomic64_fetch_or(volatile uint64_t* a, uint64_t v, int) {
  return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);
}
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
