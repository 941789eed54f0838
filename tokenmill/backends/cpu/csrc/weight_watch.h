// CpuPlan.fresh() (plan.py) in one C++ loop: whether every tensor the plan
// packed is still the one its module holds under that name (not replaced) and
// unchanged in place (its version counter). A small decode step's Python runs
// with cold caches (the forward streams the weights through L3): there the
// Python loop took ~0.09 ms for 61 entries, where it took 7 us called in a
// loop (docs/perf-notes.md). Called with the GIL held.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

struct WeightWatch {
  std::vector<pybind11::object> dicts;    // each entry's module._parameters or module._buffers
  std::vector<pybind11::object> names;    // its name there
  std::vector<pybind11::object> objects;  // the Python tensor packed
  std::vector<at::Tensor> tensors;        // the same tensors
  std::vector<int64_t> versions;          // their versions when packed; -1: an inference tensor (none kept)

  WeightWatch(pybind11::list d, pybind11::list n, pybind11::list o) {
    TORCH_CHECK(d.size() == n.size() && n.size() == o.size(), "WeightWatch: a dict, a name and a tensor each");
    for (size_t i = 0; i < d.size(); ++i) {
      TORCH_CHECK(PyDict_Check(d[i].ptr()), "WeightWatch: dicts must be dicts");
      dicts.push_back(d[i]);
      names.push_back(n[i]);
      objects.push_back(o[i]);
      at::Tensor t = o[i].cast<at::Tensor>();
      versions.push_back(t.is_inference() ? -1 : static_cast<int64_t>(t._version()));
      tensors.push_back(std::move(t));
    }
  }

  bool unchanged() const {
    for (size_t i = 0; i < tensors.size(); ++i)  // (independent loads: their misses overlap)
      if (versions[i] >= 0 && static_cast<int64_t>(tensors[i]._version()) != versions[i]) return false;
    for (size_t i = 0; i < dicts.size(); ++i) {
      PyObject* now = PyDict_GetItemWithError(dicts[i].ptr(), names[i].ptr());  // (borrowed)
      if (now != objects[i].ptr()) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }
};
