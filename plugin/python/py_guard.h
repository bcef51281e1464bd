// stepguard._C's guard object: the Python port and the engine that drives it (bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

#include "plugin/python/python_port.h"
#include "plugin/src/step_engine.h"

namespace stepguard {

// A guard: the Python port and the engine that drives it.
struct PyGuard {
  PyGuard(pybind11::object port_object, GuardOptions options) : port(std::move(port_object)) {
    // Construction is collective (the ranks' layouts): a collective's completion may need the
    // GIL on another thread of the backend, so it is released meanwhile (the port takes it).
    pybind11::gil_scoped_release release;
    engine = std::make_unique<StepEngine>(port, std::move(options));
  }
  // The engine may hold the last reference to a process group, whose destructor waits for its
  // worker threads, which may need the GIL to free a Python tensor: release it meanwhile.
  ~PyGuard() {
    pybind11::gil_scoped_release release;
    engine.reset();
  }
  PythonPort port;
  std::unique_ptr<StepEngine> engine;
};

/// Binds begin_deferred, resolve_deferred and deferred_pending on the Guard class
/// (bind_deferred.cpp).
void bind_deferred(pybind11::class_<PyGuard>& guard);

}  // namespace stepguard
