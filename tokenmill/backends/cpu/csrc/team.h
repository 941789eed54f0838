// Work split by hand across the OpenMP threads, each thread's kernels on a team
// of one (layer_stack.cpp's split steps, moe.cpp's experts side by side).
#pragma once

#include <torch/extension.h>

#include <exception>
#include <vector>

#include <omp.h>

// fn(t) on each thread t of a team of `threads`: the kernels fn calls run on
// that thread alone (their own regions get one thread), under the caller's
// inference and grad modes (thread-local); an exception on any thread is
// rethrown here, after all have finished.
template <typename Fn>
void on_each_thread(int threads, Fn&& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  const bool inference = c10::InferenceMode::is_enabled(), grad = at::GradMode::is_enabled();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    try {
      omp_set_num_threads(1);
      c10::InferenceMode inference_mode(inference);
      at::AutoGradMode grad_mode(grad);
      fn(t);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  }
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}
