// Tensor parallelism's transport between ranks on one machine: the all-reduce,
// the logits' gather and rank 0's command bytes over a shared-memory region
// (distributed/shm.py maps it; the layer loop all-reduces through shm_reduce).
//
// The region: `size` flags, each on its own 64-byte line (the last sequence
// number rank r posted), then two sets (by the sequence's parity) of `size`
// slots of `capacity` floats. An all-reduce, on each rank: copy its part into
// its slot of this sequence's set, post the sequence (release), wait until
// every rank has posted it (acquire), then sum the slots in rank order, so
// every rank computes the same bits. A slot of sequence s is written again at
// s + 2 only, and a rank posts s + 1 only after it has read s's slots: so
// each operation first waits until every rank has posted s - 1 (at once,
// unless the last one was a gather, which does not wait on the others' side).
#include <torch/extension.h>

#include "distributed.h"
#include "no_gil.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>

namespace {
constexpr int64_t kShmLine = 64;

int64_t* shm_flag(const ShmGroup& g, int64_t r) {
  return reinterpret_cast<int64_t*>(static_cast<uint8_t*>(g.region.data_ptr()) + r * kShmLine);
}

float* shm_slot(const ShmGroup& g, int64_t seq, int64_t r) {
  const int64_t index = (seq & 1) * g.size + r;
  return reinterpret_cast<float*>(static_cast<uint8_t*>(g.region.data_ptr()) + g.size * kShmLine) +
         index * g.capacity;
}

// Whether process `pid` has exited (gone, or a zombie: its memory and files released).
bool process_gone(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return true;
  const size_t close = line.rfind(')');  // (the name may hold spaces and parentheses)
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state == 'Z' || state == 'X' || state == 'x';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Until rank q has posted `seq`: spin a few microseconds (the other rank is
// usually a layer's imbalance away), then yield, then sleep; every few ms check
// that q is alive and the step's timeout. A dead or stuck peer throws. `idle`
// (a worker waiting for rank 0's next command): no timeout, and after 100 ms
// longer sleeps.
void shm_wait(const ShmGroup& g, int64_t q, int64_t seq, bool idle = false) {
  const int64_t* flag = shm_flag(g, q);
  if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= seq) return;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point check = start;
  for (int64_t round = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; ++round) {
    if (round < 20000) {
      cpu_relax();
      continue;
    }
    if (round < 22000) {
      sched_yield();
    } else {
      const bool long_idle = idle && Clock::now() - start > std::chrono::milliseconds(100);
      std::this_thread::sleep_for(std::chrono::microseconds(long_idle ? 500 : 50));
    }
    const Clock::time_point now = Clock::now();
    if (now - check < std::chrono::milliseconds(5)) continue;
    check = now;
    TORCH_CHECK(!process_gone(g.pids[q]), "tensor-parallel shared memory: rank ", q, " (pid ",
                g.pids[q], ") is gone");
    TORCH_CHECK(idle || std::chrono::duration<double>(now - start).count() < g.timeout_s,
                "tensor-parallel shared memory: no answer from rank ", q, " within ", g.timeout_s,
                " s");
  }
}

}  // namespace

// t (float32, contiguous) summed over the ranks, in place, in chunks of a slot.
void shm_reduce(const ShmGroup& g, at::Tensor& t) {
  float* data = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t off = 0; off < n; off += g.capacity) {  // (every rank has the same n)
    const int64_t m = std::min(g.capacity, n - off);
    int64_t* mine = shm_flag(g, g.rank);
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;  // (only this rank writes it)
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq - 1);
    std::memcpy(shm_slot(g, seq, g.rank), data + off, m * sizeof(float));
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq);
    float* out = data + off;
    const float* first = shm_slot(g, seq, 0);
    for (int64_t i = 0; i < m; ++i) out[i] = first[i];
    for (int64_t q = 1; q < g.size; ++q) {
      const float* part = shm_slot(g, seq, q);
      for (int64_t i = 0; i < m; ++i) out[i] += part[i];
    }
  }
}

namespace {
// Each rank's [rows, widths[r]] side by side in `out` on rank 0, in chunks of
// whole rows: the others copy theirs into their slot and go on; rank 0 waits
// for every slot and copies each into its columns.
void shm_gather_rows(const ShmGroup& g, const float* local, float* out, const std::vector<int64_t>& widths,
                     int64_t rows) {
  const int64_t max_w = *std::max_element(widths.begin(), widths.end());
  int64_t total = 0;
  std::vector<int64_t> col(widths.size());
  for (size_t q = 0; q < widths.size(); ++q) col[q] = total, total += widths[q];
  const int64_t per = std::max<int64_t>(1, g.capacity / std::max<int64_t>(1, max_w));
  const int64_t w = widths[g.rank];
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t m = std::min(per, rows - r0);
    int64_t* mine = shm_flag(g, g.rank);
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq - 1);
    if (g.rank != 0) {
      std::memcpy(shm_slot(g, seq, g.rank), local + r0 * w, m * w * sizeof(float));
      __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
      continue;
    }
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
    for (int64_t q = 0; q < g.size; ++q) {
      const float* src = local + r0 * w;
      if (q != 0) {
        shm_wait(g, q, seq);
        src = shm_slot(g, seq, q);
      }
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(out + (r0 + i) * total + col[q], src + i * widths[q], widths[q] * sizeof(float));
    }
  }
}

// Rank 0's bytes to the others through its own slots, a chunk a sequence (the
// first starts with the total length); the others post each sequence once
// they have read its chunk.
void shm_send_bytes(const ShmGroup& g, const uint8_t* data, int64_t n) {
  const int64_t cap = g.capacity * int64_t(sizeof(float));
  int64_t* mine = shm_flag(g, g.rank);
  for (int64_t off = 0, chunk = 0; chunk == 0 || off < n; ++chunk) {
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq - 1);
    uint8_t* slot = reinterpret_cast<uint8_t*>(shm_slot(g, seq, g.rank));
    const int64_t head = chunk == 0 ? int64_t(sizeof(int64_t)) : 0;
    if (chunk == 0) std::memcpy(slot, &n, sizeof(int64_t));
    const int64_t m = std::min(cap - head, n - off);
    std::memcpy(slot + head, data + off, m);
    off += m;
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
  }
}

at::Tensor shm_receive_bytes(const ShmGroup& g) {
  const int64_t cap = g.capacity * int64_t(sizeof(float));
  int64_t* mine = shm_flag(g, g.rank);
  at::Tensor out;
  int64_t n = 0;
  for (int64_t off = 0, chunk = 0; chunk == 0 || off < n; ++chunk) {
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    shm_wait(g, 0, seq, /*idle=*/chunk == 0);
    const uint8_t* slot = reinterpret_cast<const uint8_t*>(shm_slot(g, seq, 0));
    const int64_t head = chunk == 0 ? int64_t(sizeof(int64_t)) : 0;
    if (chunk == 0) {
      std::memcpy(&n, slot, sizeof(int64_t));
      out = at::empty({n}, at::kByte);
    }
    const int64_t m = std::min(cap - head, n - off);
    std::memcpy(out.data_ptr<uint8_t>() + off, slot + head, m);
    off += m;
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
  }
  return out;
}

}  // namespace

void check_group(const ShmGroup& g) {
  TORCH_CHECK(g.size >= 1 && g.rank >= 0 && g.rank < g.size && static_cast<int64_t>(g.pids.size()) == g.size,
              "ShmGroup: rank, size and a pid per rank");
  TORCH_CHECK(g.region.is_contiguous() && g.region.scalar_type() == at::kByte && g.capacity > 0 &&
                  g.region.numel() >= g.size * kShmLine + 2 * g.size * g.capacity * int64_t(sizeof(float)),
              "ShmGroup: the region holds the flags and 2 x size slots of capacity floats");
}

// Rank r's `local` [rows, widths[r]] (float32) side by side in rank 0's `out`
// [rows, sum(widths)] (the others pass an empty `out`), over `group`'s shared
// memory: the logits' gather. A rank's widths[r] at most the slot's capacity.
void shm_gather(const ShmGroup& group, at::Tensor local, at::Tensor out, std::vector<int64_t> widths) {
  check_group(group);
  TORCH_CHECK(static_cast<int64_t>(widths.size()) == group.size, "shm_gather: a width per rank");
  TORCH_CHECK(local.scalar_type() == at::kFloat && local.is_contiguous() && local.dim() == 2 &&
                  local.size(1) == widths[group.rank],
              "shm_gather: local [rows, widths[rank]] contiguous float32");
  TORCH_CHECK(*std::max_element(widths.begin(), widths.end()) <= group.capacity,
              "shm_gather: a width past the slot's capacity");
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  if (group.rank == 0)
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                    out.size(0) == local.size(0) && out.size(1) == total,
                "shm_gather: out [rows, sum(widths)] contiguous float32 on rank 0");
  NoGil no_gil;
  shm_gather_rows(group, local.data_ptr<float>(), group.rank == 0 ? out.data_ptr<float>() : nullptr, widths,
                  local.size(0));
}

// Rank 0's command bytes (uint8 [n]) to the other ranks of `group`
// (shm_receive there): a step's broadcast over shared memory.
void shm_send(const ShmGroup& group, at::Tensor data) {
  check_group(group);
  TORCH_CHECK(group.rank == 0, "shm_send: rank 0 sends");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 1, "shm_send: uint8 [n]");
  NoGil no_gil;
  shm_send_bytes(group, data.data_ptr<uint8_t>(), data.numel());
}

// The next bytes rank 0 sends; waits as long as it takes (rank 0 may idle),
// but throws once rank 0's process is gone.
at::Tensor shm_receive(const ShmGroup& group) {
  check_group(group);
  TORCH_CHECK(group.rank != 0, "shm_receive: the other ranks receive");
  NoGil no_gil;
  return shm_receive_bytes(group);
}

// `t` (float32, contiguous) summed over `group`'s ranks, in place: the same
// bits on every rank (the slots added in rank order). Blocks until every rank
// has called it; throws where a peer has died or timed out.
void shm_all_reduce(const ShmGroup& group, at::Tensor t) {
  check_group(group);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
              "shm_all_reduce: a contiguous float32 CPU tensor");
  NoGil no_gil;
  shm_reduce(group, t);
}
