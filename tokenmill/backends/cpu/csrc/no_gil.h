// The kernels run without Python's GIL: a step's forward is ~300 calls of
// 0.02-2 ms each, and while one runs the server's event loop (HTTP, streaming)
// can take a request in, instead of waiting for the engine thread to give the
// GIL up between calls (up to the 5 ms switch interval each time).
#pragma once
#include <Python.h>

// Releases the GIL for a scope if this thread holds it (a kernel may be called
// from Python, or by another kernel on a thread that never had it: layer_stack).
class NoGil {
 public:
  NoGil() : state_(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~NoGil() {
    if (state_) PyEval_RestoreThread(state_);
  }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* state_;
};
