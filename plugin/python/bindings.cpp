// stepguard._C: bindings only (the engine: plugin/src; the port: python_port.cpp, the package).
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>

#include "csrc/consensus/process_group_consensus.h"
#include "plugin/python/bind_files.h"
#include "plugin/python/bind_values.h"
#include "plugin/python/py_guard.h"
#include "plugin/src/step_engine.h"
#include "stepguard/tools.h"
#include "stepguard/version.h"

namespace py = pybind11;

namespace stepguard {
namespace {

template <typename T>
T option_value(const std::string& what, const py::handle& value) {
  const auto type_error = [&](const char* expected) {
    return py::type_error("stepguard: " + what + " must be " + expected + ", got " +
                          py::str(py::type::of(value).attr("__name__")).cast<std::string>());
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (!py::isinstance<py::bool_>(value)) throw type_error("True or False");
    return value.cast<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (py::isinstance<py::bool_>(value) || !py::isinstance<py::int_>(value)) {
      throw type_error("an int");
    }
    const py::int_ number = py::reinterpret_borrow<py::int_>(value);
    if (number < py::int_(std::numeric_limits<T>::min()) ||
        number > py::int_(std::numeric_limits<T>::max())) {
      throw py::value_error("stepguard: " + what +
                            " is out of range: " + py::str(value).cast<std::string>());
    }
    return number.cast<T>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    // Paths may come as pathlib.Path.
    if (!py::isinstance<py::str>(value) && !py::hasattr(value, "__fspath__")) {
      throw type_error("a str");
    }
    return py::str(py::module_::import("os").attr("fspath")(value)).cast<std::string>();
  } else if constexpr (std::is_same_v<T, std::chrono::milliseconds>) {
    // Seconds as a number, or a datetime.timedelta, as torch.distributed takes timeouts.
    double seconds = 0;
    if (py::hasattr(value, "total_seconds")) {
      seconds = value.attr("total_seconds")().cast<double>();
    } else if (!py::isinstance<py::bool_>(value) &&
               (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value))) {
      seconds = value.cast<double>();
    } else {
      throw type_error("seconds (a number) or a datetime.timedelta");
    }
    // At most a year: also keeps the milliseconds far inside int64.
    if (!(seconds > 0 && seconds <= 366.0 * 86400.0)) {
      throw py::value_error("stepguard: " + what +
                            " must be more than 0 and at most a year of seconds, got " +
                            py::str(value).cast<std::string>());
    }
    return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
  } else {
    if (value.is_none()) return T();
    try {
      return value.cast<T>();
    } catch (const py::cast_error&) {
      // The process group and the store: pybind's own text names a C++ type, not the option.
      throw type_error(std::is_same_v<T, c10::intrusive_ptr<c10d::Store>>
                           ? "a torch.distributed Store (e.g. dist.TCPStore, dist.FileStore)"
                           : "a torch.distributed ProcessGroup (e.g. dist.group.WORLD)");
    }
  }
}

template <typename T>
py::object option_object(const T& value) {
  if constexpr (std::is_same_v<T, std::chrono::milliseconds>) {
    return py::float_(static_cast<double>(value.count()) / 1000.0);
  } else if constexpr (std::is_same_v<T, c10::intrusive_ptr<c10d::ProcessGroup>> ||
                       std::is_same_v<T, c10::intrusive_ptr<c10d::Store>>) {
    return value ? py::cast(value) : py::none();
  } else {
    return py::cast(value);
  }
}

// The Python type an option takes, for help(GuardOptions).
template <typename T>
const char* option_type_name() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_integral_v<T>) return "int";
  if constexpr (std::is_same_v<T, std::string>) return "str (or a path)";
  if constexpr (std::is_same_v<T, std::chrono::milliseconds>) return "seconds or timedelta";
  if constexpr (std::is_same_v<T, c10::intrusive_ptr<c10d::Store>>) return "Store or None";
  return "ProcessGroup or None";
}

// The guard record's totals by name, in the order of its words (StepEngine::guard_record).
constexpr const char* kTotalNames[] = {"steps",   "applied",   "skipped",   "rolled_back",
                                       "aborted", "incidents", "snapshots", "checkpoints_written"};

py::dict record_dict(const checkpoint::GuardRecord& r) {
  py::dict d;
  d["step"] = r.step;
  d["data_position"] = r.data_position;
  d["guard"] = r.guard;
  py::dict totals;  // by name: a count added later does not shift the others
  for (std::size_t i = 0; i < r.totals.size() && i < std::size(kTotalNames); ++i) {
    totals[kTotalNames[i]] = r.totals[i];
  }
  d["totals"] = totals;
  d["skipped_ranges"] = r.skipped_ranges;
  return d;
}

// The guard's part of a state dict, every key named in its error: a missing key or a value of
// the wrong type is a KeyError or TypeError saying which.
checkpoint::GuardRecord record_of(const py::handle& object) {
  if (!py::isinstance<py::dict>(object)) {
    throw py::type_error("stepguard: the state dict's 'stepguard' entry must be a dict, got " +
                         py::str(py::type::of(object).attr("__name__")).cast<std::string>());
  }
  const py::dict d = py::reinterpret_borrow<py::dict>(object);
  const auto entry = [&](const char* key) -> py::object {
    if (!d.contains(key)) {
      throw py::key_error(std::string("stepguard: the guard state lacks the key '") + key + "'");
    }
    return d[key];
  };
  const auto name = [](const char* key) { return std::string("the guard state's '") + key + "'"; };
  const auto count = [&](const char* key) {
    return option_value<std::int64_t>(name(key), entry(key));
  };
  const auto words = [&](const char* key) {
    const py::object v = entry(key);
    std::vector<std::int64_t> out;
    if (!py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v)) {
      throw py::type_error(std::string("stepguard: the guard state's '") + key +
                           "' must be a list of ints");
    }
    for (const auto& item : v) out.push_back(option_value<std::int64_t>(name(key), item));
    return out;
  };
  // The totals by name (a count the state lacks, added after it was saved, starts at 0), or
  // as the positional words state dicts held before.
  const auto totals = [&]() -> std::vector<std::int64_t> {
    const py::object v = entry("totals");
    if (!py::isinstance<py::dict>(v)) return words("totals");
    const py::dict named = py::reinterpret_borrow<py::dict>(v);
    std::vector<std::int64_t> out(std::size(kTotalNames), 0);
    for (const auto& [key, value] : named) {
      const std::string k = py::str(key).cast<std::string>();
      const auto* at = std::find_if(std::begin(kTotalNames), std::end(kTotalNames),
                                    [&](const char* n) { return k == n; });
      if (at == std::end(kTotalNames)) {
        throw py::key_error("stepguard: the guard state's 'totals' has no count '" + k + "'");
      }
      out[static_cast<std::size_t>(at - std::begin(kTotalNames))] =
          option_value<std::int64_t>(name("totals") + "['" + k + "']", value);
    }
    return out;
  };
  checkpoint::GuardRecord r;
  r.step = count("step");
  r.data_position = count("data_position");
  r.guard = words("guard");
  r.totals = totals();
  r.skipped_ranges = words("skipped_ranges");
  return r;
}

py::dict totals_dict(const GuardTotals& t) {
  py::dict d;
  d["steps"] = t.steps;
  d["applied"] = t.applied;
  d["skipped"] = t.skipped;
  d["rolled_back"] = t.rolled_back;
  d["aborted"] = t.aborted;
  d["incidents"] = t.incidents;
  d["snapshots"] = t.snapshots;
  return d;
}

py::dict stage_dict(const StageSeconds& s) {
  py::dict d;
  d["inspect"] = s.inspect;
  d["agree"] = s.agree;
  d["decide"] = s.decide;
  d["act"] = s.act;
  d["snapshot"] = s.snapshot;
  d["record"] = s.record;
  return d;
}

// Every field of GuardStats, nested values as dicts: what json.dumps takes.
py::dict stats_dict(const GuardStats& g) {
  py::dict d;
  d["step_count"] = g.step_count;
  d["totals"] = totals_dict(g.totals);
  d["aborted"] = g.aborted;
  d["consecutive_bad_steps"] = g.consecutive_bad_steps;
  d["bad_steps_total"] = g.bad_steps_total;
  d["loss_scale"] = g.loss_scale;
  d["lr_factor"] = g.lr_factor;
  d["rank"] = g.rank;
  d["world_size"] = g.world_size;
  d["data_position"] = g.data_position;
  d["skipped_ranges"] = g.skipped_ranges;
  d["snapshots_held"] = g.snapshots_held;
  d["snapshot_bytes"] = g.snapshot_bytes;
  d["checkpoints_written"] = g.checkpoints_written;
  d["checkpoints_failed"] = g.checkpoints_failed;
  d["checkpoints_skipped"] = g.checkpoints_skipped;
  d["collective_calls"] = g.collective_calls;
  d["collective_bytes"] = g.collective_bytes;
  d["step_buffer_bytes"] = g.step_buffer_bytes;
  d["last_step_seconds"] = stage_dict(g.last_step_seconds);
  d["metrics_endpoint"] = g.metrics_endpoint;
  return d;
}

// One property per GuardOptions field: the name is the C++ member's, the type its type.
#define STEPGUARD_BIND_OPTION(cls, field)                                              \
  do {                                                                                 \
    using Value = std::decay_t<decltype(std::declval<const GuardOptions&>().field())>; \
    /* pybind11 copies a property's docstring */                                       \
    const std::string doc =                                                            \
        std::string(option_type_name<Value>()) + ", default " +                        \
        py::repr(option_object<Value>(GuardOptions().field())).cast<std::string>() +   \
        " (the C++ GuardOptions::" #field ", stepguard/options.h)";                    \
    cls.def_property(                                                                  \
        #field, [](const GuardOptions& o) { return option_object<Value>(o.field()); }, \
        [](GuardOptions& o, const py::object& v) {                                     \
          o.field(option_value<Value>("option " #field, v));                           \
        },                                                                             \
        doc.c_str());                                                                  \
    fields.append(#field);                                                             \
  } while (0)

void bind_options(py::module_& m) {
  py::class_<GuardOptions> options(
      m, "GuardOptions",
      "The C++ GuardOptions, one property per option (name, type, default), set by keyword.");
  options.def(py::init<>());
  py::list fields;
  STEPGUARD_BIND_OPTION(options, policy);
  STEPGUARD_BIND_OPTION(options, policy_yaml);
  STEPGUARD_BIND_OPTION(options, max_consecutive_bad_steps);
  STEPGUARD_BIND_OPTION(options, loss_scaling);
  STEPGUARD_BIND_OPTION(options, zero_grad_on_skip);
  STEPGUARD_BIND_OPTION(options, checkpoint_dir);
  STEPGUARD_BIND_OPTION(options, checkpoint_every);
  STEPGUARD_BIND_OPTION(options, run_id);
  STEPGUARD_BIND_OPTION(options, incident_dir);
  STEPGUARD_BIND_OPTION(options, trace_path);
  STEPGUARD_BIND_OPTION(options, trace_every_step);
  STEPGUARD_BIND_OPTION(options, max_blamed_tensors);
  STEPGUARD_BIND_OPTION(options, process_group);
  STEPGUARD_BIND_OPTION(options, store);
  STEPGUARD_BIND_OPTION(options, metrics_port);
  STEPGUARD_BIND_OPTION(options, metrics_bind_address);
  STEPGUARD_BIND_OPTION(options, metrics_run_label);
  STEPGUARD_BIND_OPTION(options, sharded_gradients);
  STEPGUARD_BIND_OPTION(options, enabled);
  STEPGUARD_BIND_OPTION(options, collective_timeout);
  options.attr("fields") = py::tuple(fields);
}

#undef STEPGUARD_BIND_OPTION

// A Python replay closure, called with the GIL held and released with it.
forensics::Recompute recompute_of(py::function fn) {
  auto held = std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
  return [held](ReplayMode mode) {
    py::gil_scoped_acquire gil;
    return (*held)(to_string(mode)).cast<at::Tensor>();
  };
}

// GuardStats and its parts as read-only values with the C++ field names; to_dict() for JSON.
void bind_stats(py::module_& m) {
  py::class_<GuardTotals>(m, "GuardTotals", "Running totals by outcome.")
      .def_readonly("steps", &GuardTotals::steps)
      .def_readonly("applied", &GuardTotals::applied)
      .def_readonly("skipped", &GuardTotals::skipped)
      .def_readonly("rolled_back", &GuardTotals::rolled_back)
      .def_readonly("aborted", &GuardTotals::aborted)
      .def_readonly("incidents", &GuardTotals::incidents)
      .def_readonly("snapshots", &GuardTotals::snapshots)
      .def("to_dict", &totals_dict)
      .def("__eq__", [](const GuardTotals& a,
                        const GuardTotals& b) { return totals_dict(a).equal(totals_dict(b)); })
      .def("__repr__", [](const GuardTotals& t) {
        return "GuardTotals(" + py::str(totals_dict(t)).cast<std::string>() + ")";
      });
  py::class_<StageSeconds>(m, "StageSeconds", "Where one step's time went, stage by stage.")
      .def_readonly("inspect", &StageSeconds::inspect)
      .def_readonly("agree", &StageSeconds::agree)
      .def_readonly("decide", &StageSeconds::decide)
      .def_readonly("act", &StageSeconds::act)
      .def_readonly("snapshot", &StageSeconds::snapshot)
      .def_readonly("record", &StageSeconds::record)
      .def("total", &StageSeconds::total)
      .def("to_dict", &stage_dict);
  py::class_<GuardStats> stats(m, "GuardStats", "What the guard knows now (guard.stats()).");
#define STEPGUARD_STAT(field) stats.def_readonly(#field, &GuardStats::field)
  STEPGUARD_STAT(step_count);
  STEPGUARD_STAT(totals);
  STEPGUARD_STAT(aborted);
  STEPGUARD_STAT(consecutive_bad_steps);
  STEPGUARD_STAT(bad_steps_total);
  STEPGUARD_STAT(loss_scale);
  STEPGUARD_STAT(lr_factor);
  STEPGUARD_STAT(rank);
  STEPGUARD_STAT(world_size);
  STEPGUARD_STAT(data_position);
  STEPGUARD_STAT(skipped_ranges);
  STEPGUARD_STAT(snapshots_held);
  STEPGUARD_STAT(snapshot_bytes);
  STEPGUARD_STAT(checkpoints_written);
  STEPGUARD_STAT(checkpoints_failed);
  STEPGUARD_STAT(checkpoints_skipped);
  STEPGUARD_STAT(collective_calls);
  STEPGUARD_STAT(collective_bytes);
  STEPGUARD_STAT(step_buffer_bytes);
  STEPGUARD_STAT(last_step_seconds);
  STEPGUARD_STAT(metrics_endpoint);
#undef STEPGUARD_STAT
  stats.def("to_dict", &stats_dict).def("__repr__", [](const GuardStats& g) {
    return "GuardStats(" + py::str(stats_dict(g)).cast<std::string>() + ")";
  });
}

void bind_input_verdict(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<InputVerdict>(m, "InputVerdict",
                           "What check_inputs() found: true when the batch looks fine. Asking "
                           "(bool() or .problems) reads the counts once; ignoring it costs no "
                           "read.")
      .def("__bool__", &InputVerdict::clean, Release())
      // A property cannot take a call guard itself (newer pybind11 refuses it; older ones
      // ignored it and kept the GIL): the getter is a function that releases the GIL.
      .def_property_readonly("problems", py::cpp_function(&InputVerdict::problems, Release()))
      .def("__repr__", [](const InputVerdict& v) {
        return v.clean() ? std::string("InputVerdict(clean)")
                         : "InputVerdict(" + std::to_string(v.problems().size()) + " problems)";
      });
}

void bind_guard(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  bind_deferred(
      py::class_<PyGuard>(m, "Guard",
                          "The step engine over a torch.optim port (see GuardedOptimizer).")
          .def(py::init([](py::object port, const GuardOptions& options) {
                 return std::make_unique<PyGuard>(std::move(port), options);
               }),
               py::arg("port"), py::arg("options"))
          .def(
              "step",
              [](PyGuard& g, const std::optional<at::Tensor>& loss) {
                return g.engine->step(loss.value_or(at::Tensor()));
              },
              py::arg("loss") = py::none(), Release())
          .def(
              "verdict",
              [](PyGuard& g, const std::optional<at::Tensor>& loss) {
                return g.engine->verdict(loss.value_or(at::Tensor()));
              },
              py::arg("loss") = py::none(), Release())
          .def(
              "settle",
              [](PyGuard& g, const Verdict& v, bool applied) {
                return g.engine->settle(v, applied);
              },
              py::arg("verdict"), py::arg("applied"), Release())
          .def(
              "clip_gradients", [](PyGuard& g, const Verdict& v) { g.engine->clip_gradients(v); },
              py::arg("verdict"), Release())
          .def("verdict_pending", [](const PyGuard& g) { return g.engine->verdict_pending(); })
          .def("scale_loss",
               [](PyGuard& g, const at::Tensor& loss) { return g.engine->scale_loss(loss); })
          .def(
              "check_inputs",
              [](PyGuard& g, const std::vector<at::Tensor>& inputs,
                 std::optional<at::Tensor> mask) {
                py::gil_scoped_release release;
                return g.engine->check_inputs(inputs, mask.value_or(at::Tensor()));
              },
              py::arg("inputs"), py::arg("mask") = py::none())
          .def("set_replay",
               [](PyGuard& g, const py::object& fn) {
                 g.engine->set_replay(fn.is_none() ? forensics::Recompute()
                                                   : recompute_of(fn.cast<py::function>()));
               })
          .def("probe", [](PyGuard& g, const std::string& name,
                           const at::Tensor& output) { return g.engine->probe(name, output); })
          .def("watch_gradient",
               [](PyGuard& g, const at::Tensor& grad) { g.engine->watch_gradient(grad); })
          .def("track_buffers",
               [](PyGuard& g, std::vector<at::Tensor> buffers) {
                 g.engine->track_buffers(std::move(buffers));
               })
          .def(
              "resume", [](PyGuard& g, const std::string& dir) { return g.engine->resume(dir); },
              Release())
          .def(
              "commit_pending_checkpoint",
              [](PyGuard& g) { g.engine->commit_pending_checkpoint(); }, Release())
          .def(
              "wait_for_background_work", [](PyGuard& g) { g.engine->wait_for_background_work(); },
              Release())
          .def("record", [](const PyGuard& g) { return record_dict(g.engine->record()); })
          .def("load_record",
               [](PyGuard& g, const py::object& d) { g.engine->load_record(record_of(d)); })
          .def("set_data_position",
               [](PyGuard& g, std::int64_t p) { g.engine->set_data_position(p); })
          .def(
              "stats", [](PyGuard& g) { return g.engine->stats(); }, Release())
          .def("metrics_text", [](const PyGuard& g) { return g.engine->metrics_text(); })
          .def("explain_policy", [](const PyGuard& g) { return g.engine->explain_policy(); }));
}

}  // namespace
}  // namespace stepguard

PYBIND11_MODULE(_C, m) {
  m.doc() = "stepguard's step engine (use the stepguard package)";
  // c10::Error carries a C++ backtrace; Python sees the message (with its FILE:LINE:COL: lines).
  static py::exception<c10::Error> error(m, "StepguardError", PyExc_RuntimeError);
  // The ranks can no longer agree (a collective failed or missed its deadline): a StepguardError
  // that also carries the step and the ranks found missing.
  static py::exception<stepguard::consensus::ConsensusError> consensus_error(m, "ConsensusError",
                                                                             error.ptr());
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      py::set_error(error, e.msg().c_str());
    } catch (const stepguard::consensus::ConsensusError& e) {
      py::object instance = py::reinterpret_borrow<py::object>(consensus_error.ptr())(e.what());
      instance.attr("step") = e.step();
      instance.attr("missing_ranks") = py::cast(e.missing_ranks());
      PyErr_SetObject(consensus_error.ptr(), instance.ptr());
    }
  });
  stepguard::bind_options(m);
  stepguard::bind_report(m);
  stepguard::bind_layout(m);
  stepguard::bind_verdict(m);
  stepguard::bind_stats(m);
  stepguard::bind_input_verdict(m);
  stepguard::bind_guard(m);
  m.def("check_policy_file", &stepguard::check_policy_file, py::arg("path"));
  // An invalid policy is the guard's error (StepguardError), as GuardedOptimizer raises it.
  m.def(
      "explain_policy_file",
      [](const std::string& path) {
        try {
          return stepguard::explain_policy_file(path);
        } catch (const std::invalid_argument& e) {
          TORCH_CHECK(false, e.what());
        }
      },
      py::arg("path"));
  m.def(
      "policy_presets",
      [] {
        py::dict out;
        for (const auto& name : stepguard::policy_preset_names()) {
          out[py::str(name)] = stepguard::policy_preset_text(name);
        }
        return out;
      },
      "The shipped policy presets: {name: YAML text}. A name works wherever a policy path does.");
  stepguard::bind_files(m);
  m.def("attach_incident_picture", &stepguard::attach_incident_picture, py::arg("report_path"),
        py::arg("picture_path"));
  m.def("version", &stepguard::version);
}
