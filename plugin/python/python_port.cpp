#include "plugin/python/python_port.h"

#include <c10/util/Exception.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "csrc/scaling/loss_scaler.h"

namespace stepguard {

namespace py = pybind11;

namespace {

// Runs `f` with the GIL held and turns a Python exception into a c10::Error carrying its text,
// so the engine sees one error type and the binding hands the text back to Python.
template <typename F>
auto with_gil(const char* what, F&& f) -> decltype(f()) {
  py::gil_scoped_acquire gil;
  try {
    return f();
  } catch (py::error_already_set& e) {
    const std::string message = e.what();
    TORCH_CHECK(false, "stepguard: the optimizer port's ", what, "() failed: ", message);
  }
}

py::list to_python(const std::vector<NamedTensor>& tensors) {
  py::list out;
  for (const auto& t : tensors) out.append(py::make_tuple(t.name, t.tensor));
  return out;
}

std::vector<NamedTensor> from_python(const py::handle& list) {
  std::vector<NamedTensor> out;
  for (const auto& item : list) {
    const auto pair = item.cast<py::tuple>();
    out.push_back({pair[0].cast<std::string>(), pair[1].cast<at::Tensor>()});
  }
  return out;
}

// Whether a signature takes *args (then it takes a third positional argument too).
bool has_var_args(const py::object& signature) {
  const py::object var = py::module_::import("inspect").attr("Parameter").attr("VAR_POSITIONAL");
  for (const auto& item : signature.attr("parameters").attr("values")()) {
    if (py::reinterpret_borrow<py::object>(item.attr("kind")).equal(var)) return true;
  }
  return false;
}

}  // namespace

PythonPort::PythonPort(py::object port) : port_(std::move(port)) {
  py::gil_scoped_acquire gil;
  // A port that leaves gradients to the engine (.grad of each parameter) says so with
  // `gradients = None`: no call into Python per step.
  has_gradients_ = py::hasattr(port_, "gradients") && !port_.attr("gradients").is_none();
  has_sharded_state_ = py::hasattr(port_, "sharded_state");
  has_reduced_into_shards_ = py::hasattr(port_, "gradients_reduced_into_shards");
  has_layout_ = py::hasattr(port_, "layout");
  has_framework_scale_ = py::hasattr(port_, "framework_loss_scale");
  has_largest_lr_ = py::hasattr(port_, "largest_lr");
  has_state_owner_ = py::hasattr(port_, "state_owner");
  refresh();
}

PythonPort::~PythonPort() {
  py::gil_scoped_acquire gil;
  port_ = py::object();
}

void PythonPort::refresh() {
  with_gil("parameters", [&] {
    const py::tuple result = port_.attr("parameters")();
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (const auto& p : result[0]) params.push_back(p.cast<at::Tensor>());
    for (const auto& n : result[1]) names.push_back(n.cast<std::string>());
    TORCH_CHECK(names.size() == params.size(), "stepguard: the optimizer port named ", names.size(),
                " of ", params.size(), " parameters");
    // The layout goes with the parameter list: read when the list is first seen or changes
    // (by identity; not a Python call per step).
    bool same = params.size() == params_.size();
    for (std::size_t i = 0; same && i < params.size(); ++i) {
      same = params[i].unsafeGetTensorImpl() == params_[i].unsafeGetTensorImpl();
    }
    if (has_layout_ && (!layout_read_ || !same)) {
      std::vector<Placement> layout;
      const py::object placements = port_.attr("layout")();
      if (!placements.is_none()) {
        for (const auto& p : placements) layout.push_back(p.cast<Placement>());
      }
      layout_ = std::move(layout);
      layout_read_ = true;
    }
    params_ = std::move(params);
    names_ = std::move(names);
  });
}

std::vector<at::Tensor> PythonPort::gradients() const {
  if (!has_gradients_) return OptimizerPort::gradients();
  return with_gil("gradients", [&] {
    const py::object grads = port_.attr("gradients")();
    std::vector<at::Tensor> out;
    for (const auto& g : grads) out.push_back(g.is_none() ? at::Tensor() : g.cast<at::Tensor>());
    return out;
  });
}

void PythonPort::apply(double lr_factor) {
  with_gil("apply", [&] { port_.attr("apply")(lr_factor); });
}

std::vector<NamedTensor> PythonPort::state_tensors() const {
  return with_gil("state_tensors", [&] { return from_python(port_.attr("state_tensors")()); });
}

std::string PythonPort::state_bytes() const {
  return with_gil("state_bytes", [&] {
    return port_.attr("state_bytes")().cast<py::bytes>().cast<std::string>();
  });
}

void PythonPort::check_state_bytes(const std::string& bytes,
                                   const std::vector<NamedTensor>& saved) const {
  with_gil("check_state_bytes",
           [&] { port_.attr("check_state_bytes")(py::bytes(bytes), to_python(saved)); });
}

void PythonPort::load_state_bytes(const std::string& bytes, const std::vector<NamedTensor>& saved,
                                  bool settings) {
  with_gil("load_state_bytes", [&] {
    const py::object load = port_.attr("load_state_bytes");
    // A port written before `settings` existed takes (data, saved): it is called so, and its
    // settings stay as they are (what it did before).
    const py::object signature = py::module_::import("inspect").attr("signature")(load);
    const auto taken = py::len(signature.attr("parameters"));
    if (taken >= 3 || has_var_args(signature)) {
      load(py::bytes(bytes), to_python(saved), settings);
    } else {
      load(py::bytes(bytes), to_python(saved));
    }
  });
}

void PythonPort::after_restore() {
  with_gil("after_restore", [&] { port_.attr("after_restore")(); });
}

namespace {

// One item of framework_loss_scale(): a one-element floating tensor (kept, not read) or a number.
// Returns whether it was a tensor.
bool scale_tensor(const py::handle& item, const char* what, at::Tensor* tensor, double* number) {
  if (THPVariable_Check(item.ptr())) {
    const at::Tensor t = THPVariable_Unpack(item.ptr());
    TORCH_CHECK(t.numel() == 1 && at::isFloatingType(t.scalar_type()),
                "stepguard: the port's framework_loss_scale() gave a ", what, " tensor of ",
                t.numel(), " elements of ", t.scalar_type(), "; one floating element was expected");
    *tensor = t.detach();
    return true;
  }
  *number = item.cast<double>();
  return false;
}

}  // namespace

std::optional<OptimizerPort::FrameworkLossScale> PythonPort::framework_loss_scale() const {
  if (!has_framework_scale_) return std::nullopt;
  return with_gil("framework_loss_scale", [&]() -> std::optional<FrameworkLossScale> {
    const py::object got = port_.attr("framework_loss_scale")();
    if (got.is_none()) return std::nullopt;
    const auto items = got.cast<py::tuple>();
    TORCH_CHECK(items.size() == 2 || items.size() == 3,
                "stepguard: the port's framework_loss_scale() gave ", items.size(),
                " items; (scale, floor) or (scale, floor, gradients_scaled) was expected");
    FrameworkLossScale out;
    out.gradients_scaled = items.size() == 2 || items[2].cast<bool>();
    // A scaler's device tensors ride in the step buffer (no read here); numbers are checked now.
    const bool scale_on_device = scale_tensor(items[0], "scale", &out.scale_tensor, &out.scale);
    const bool floor_on_device =
        scale_tensor(items[1], "floor", &out.min_scale_tensor, &out.min_scale);
    TORCH_CHECK(scale_on_device || !floor_on_device,
                "stepguard: the port's framework_loss_scale() gave the floor as a tensor and the "
                "scale as a number; give both as tensors, or the floor as a number");
    TORCH_CHECK(!(scale_on_device && out.gradients_scaled),
                "stepguard: the port's framework_loss_scale() gave a tensor for gradients it "
                "says are scaled: their inspection needs the scale as a number before it");
    if (out.scale_tensor.defined()) return out;  // checked once agreed
    // A scale whose inverse is no finite fp32 number would unscale gradients to Inf or NaN.
    TORCH_CHECK(out.scale >= scaling::kMinUsableScale && out.scale <= scaling::kMaxUsableScale &&
                    out.min_scale >= 0,
                "stepguard: the port's framework_loss_scale() gave (", out.scale, ", ",
                out.min_scale,
                "); a scale in [2^-126, 2^126] (it and its inverse finite fp32 "
                "numbers) and a floor >= 0 were expected");
    return out;
  });
}

double PythonPort::largest_lr() const {
  if (!has_largest_lr_) return std::numeric_limits<double>::quiet_NaN();
  return with_gil("largest_lr", [&] {
    const py::object got = port_.attr("largest_lr")();
    return got.is_none() ? std::numeric_limits<double>::quiet_NaN() : got.cast<double>();
  });
}

std::string PythonPort::state_owner(std::size_t index) const {
  if (!has_state_owner_) return OptimizerPort::state_owner(index);
  return with_gil("state_owner", [&] {
    const py::object got = port_.attr("state_owner")(index);
    return got.is_none() ? std::string() : got.cast<std::string>();
  });
}

bool PythonPort::sharded_state() const {
  if (!has_sharded_state_) return false;
  return with_gil("sharded_state", [&] { return port_.attr("sharded_state")().cast<bool>(); });
}

bool PythonPort::gradients_reduced_into_shards() const {
  if (!has_reduced_into_shards_) return false;
  return with_gil("gradients_reduced_into_shards",
                  [&] { return port_.attr("gradients_reduced_into_shards")().cast<bool>(); });
}

}  // namespace stepguard
