// Tensor parallelism's shared-memory transport (distributed.cpp): the group's
// handle and what the layer loop calls between its kernels.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

// A tensor-parallel group's all-reduce over shared memory, for ranks on one
// machine (distributed.cpp; distributed/shm.py maps the region).
struct ShmGroup {
  at::Tensor region;          // uint8, the whole shared mapping (its layout: distributed.cpp)
  int64_t rank = 0, size = 1;
  int64_t capacity = 0;       // float32 values a slot holds; longer tensors go in chunks
  std::vector<int64_t> pids;  // each rank's process id, to tell a dead peer from a slow one
  double timeout_s = 120.0;   // no peer for this long: the group stops
};

// Throws unless the group's fields describe a region that holds its flags and slots.
void check_group(const ShmGroup& g);
// t (float32, contiguous) summed over the ranks, in place (no checks: the caller's).
void shm_reduce(const ShmGroup& g, at::Tensor& t);

void shm_all_reduce(const ShmGroup& group, at::Tensor t);
void shm_gather(const ShmGroup& group, at::Tensor local, at::Tensor out, std::vector<int64_t> widths);
void shm_send(const ShmGroup& group, at::Tensor data);
at::Tensor shm_receive(const ShmGroup& group);
