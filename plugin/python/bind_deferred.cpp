// stepguard._C: the deferred verdict's two halves and its question (stepguard/_deferred.py
// drives them). Only bindings.
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <utility>

#include "plugin/python/py_guard.h"

namespace py = pybind11;

namespace stepguard {

void bind_deferred(py::class_<PyGuard>& guard) {
  using Release = py::call_guard<py::gil_scoped_release>;
  guard
      .def(
          "begin_deferred",
          [](PyGuard& g, const std::optional<at::Tensor>& loss) {
            const auto begun = g.engine->begin_deferred(loss.value_or(at::Tensor()));
            return std::make_pair(begun.found_inf, begun.lr_factor);
          },
          py::arg("loss") = py::none(), Release())
      .def(
          "resolve_deferred",
          [](PyGuard& g, bool update_failed, bool batch_in_hand) {
            return g.engine->resolve_deferred(update_failed, batch_in_hand);
          },
          py::arg("update_failed") = false, py::arg("batch_in_hand") = false, Release())
      .def("deferred_pending", [](const PyGuard& g) { return g.engine->deferred_pending(); })
      .def("deferred_grad_norm", [](const PyGuard& g) { return g.engine->deferred_grad_norm(); });
}

}  // namespace stepguard
