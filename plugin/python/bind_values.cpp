// stepguard._C: the values a step hands Python (StepReport, Verdict, Placement). Only bindings.
#include "plugin/python/bind_values.h"

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "stepguard/layout.h"
#include "stepguard/types.h"

namespace py = pybind11;

namespace stepguard {
namespace {

py::object incident_dict(const std::optional<Incident>& incident) {
  if (!incident) return py::none();
  py::dict d;
  d["step"] = incident->step;
  d["signal"] = to_string(incident->signal);
  d["action"] = to_string(incident->action);
  d["cause"] = to_string(incident->cause);
  d["tensors"] = incident->tensors;
  d["ranks"] = incident->ranks;
  d["origin_unknown"] = incident->origin_unknown;
  py::dict causes;
  for (const RankCause& c : incident->rank_causes) causes[py::int_(c.rank)] = to_string(c.cause);
  d["rank_causes"] = causes;
  d["reason"] = incident->reason;
  d["evidence"] = incident->evidence;
  d["fixes"] = incident->fixes;
  d["report"] = incident->report;
  return std::move(d);
}

std::vector<std::string> action_names(const std::vector<Action>& actions) {
  std::vector<std::string> out;
  for (Action a : actions) out.push_back(to_string(a));
  return out;
}

// What a person reading a log wants of a report: the outcome, the figures and, on an incident,
// what and where.
std::string report_repr(const StepReport& r) {
  std::ostringstream out;
  out << "StepReport(step=" << r.step << ", outcome='" << to_string(r.outcome) << "', action='"
      << to_string(r.action) << "', loss=";
  if (r.loss_given) {
    out << r.loss;
  } else {
    out << "None";
  }
  out << ", grad_norm=" << r.grad_norm << ", nonfinite_count=" << r.nonfinite_count;
  if (r.loss_scale != 1.0) out << ", loss_scale=" << r.loss_scale;
  if (r.lr_factor != 1.0) out << ", lr_factor=" << r.lr_factor;
  if (r.batches_to_skip > 0) out << ", batches_to_skip=" << r.batches_to_skip;
  if (r.incident) {
    out << ", incident=" << to_string(r.incident->signal) << "/" << to_string(r.incident->cause);
    if (!r.incident->tensors.empty()) out << " in " << r.incident->tensors.front();
    if (r.incident->tensors.size() > 1) out << " (+" << r.incident->tensors.size() - 1 << ")";
  }
  out << ")";
  return out.str();
}

// GuardOptions as one Python type: every field a property of the C++ struct's name and type,
// checked strictly (a bool is not a port, a float not a count), so the options are spelled once.
// `what` names the value in errors ("option metrics_port", "the guard state's 'step'").
}  // namespace

void bind_report(py::module_& m) {
  py::class_<StepReport>(m, "StepReport", "What guard.step(loss) did.")
      .def_property_readonly("outcome", [](const StepReport& r) { return to_string(r.outcome); })
      .def_property_readonly("applied", &StepReport::applied)
      .def_property_readonly("skipped",
                             [](const StepReport& r) { return r.outcome == Outcome::kSkipped; })
      .def_property_readonly("rolled_back",
                             [](const StepReport& r) { return r.outcome == Outcome::kRolledBack; })
      .def_property_readonly("aborted", &StepReport::aborted)
      .def_readonly("step", &StepReport::step)
      .def_property_readonly(
          "loss",
          [](const StepReport& r) -> py::object {
            return r.loss_given ? py::cast(r.loss) : py::none();
          },
          "The agreed loss; None when step() had no loss (the loss detectors saw none).")
      .def_readonly("loss_given", &StepReport::loss_given)
      .def_readonly("grad_norm", &StepReport::grad_norm)
      .def_readonly("nonfinite_count", &StepReport::nonfinite_count)
      .def_property_readonly("actions", [](const StepReport& r) { return action_names(r.actions); })
      .def_property_readonly("action", [](const StepReport& r) { return to_string(r.action); })
      .def_readonly("batches_to_skip", &StepReport::batches_to_skip)
      .def_readonly("rolled_back_to", &StepReport::rolled_back_to)
      .def_readonly("deferred", &StepReport::deferred)
      .def_readonly("loss_scale", &StepReport::loss_scale)
      .def_readonly("lr_factor", &StepReport::lr_factor)
      .def_property_readonly("incident",
                             [](const StepReport& r) { return incident_dict(r.incident); })
      .def("__repr__", &report_repr);
}

void bind_layout(py::module_& m) {
  py::class_<Placement> placement(
      m, "Placement",
      "How the ranks hold one parameter's gradient: replica() (every rank, data parallel), "
      "replicated(n) (an identical copy on n ranks: tensor-parallel duplicates), shard(n) (this "
      "rank's part; n ranks hold this same part), absent() (another pipeline stage). The guard "
      "counts every gradient element of the job once.");
  placement.def_static("replica", &Placement::replica)
      .def_static("replicated", &Placement::replicated, py::arg("copies"))
      .def_static("shard", &Placement::shard, py::arg("copies") = 1)
      .def_static("absent", &Placement::absent)
      .def_property_readonly("kind",
                             [](const Placement& p) {
                               switch (p.kind) {
                                 case Placement::Kind::kReplica:
                                   return "replica";
                                 case Placement::Kind::kReplicated:
                                   return "replicated";
                                 case Placement::Kind::kShard:
                                   return "shard";
                                 case Placement::Kind::kAbsent:
                                   return "absent";
                               }
                               return "?";
                             })
      .def_readonly("copies", &Placement::copies)
      .def("__eq__", [](const Placement& a, const Placement& b) { return a == b; })
      .def("__hash__",
           [](const Placement& p) { return static_cast<int>(p.kind) * 65537 + p.copies; })
      .def("__repr__", [](const Placement& p) { return "Placement." + to_string(p); });
}

void bind_verdict(py::module_& m) {
  py::class_<Verdict>(m, "Verdict",
                      "What guard.verdict(loss) agreed for a step, before anything changed.")
      .def_readonly("step", &Verdict::step)
      .def_property_readonly("outcome", [](const Verdict& v) { return to_string(v.outcome); })
      .def_property_readonly("applies", &Verdict::applies,
                             "Whether the framework applies its update this step.")
      .def_property_readonly("actions", [](const Verdict& v) { return action_names(v.actions); })
      .def_property_readonly("action", [](const Verdict& v) { return to_string(v.action); })
      .def_readonly("grad_norm", &Verdict::grad_norm,
                    "The agreed global norm, every element counted once: the clip's total norm.")
      .def_property_readonly(
          "clip_norm",
          [](const Verdict& v) -> py::object {
            return v.clip_norm > 0.0 ? py::cast(v.clip_norm) : py::none();
          },
          "The policy's clip target (None: no clip of the policy's this step).")
      .def_readonly("loss_scale", &Verdict::loss_scale)
      .def_readonly("lr_factor", &Verdict::lr_factor)
      .def_readonly("nonfinite_count", &Verdict::nonfinite_count)
      .def_property_readonly("loss",
                             [](const Verdict& v) -> py::object {
                               return v.loss_given ? py::cast(v.loss) : py::none();
                             })
      .def_readonly("batches_to_skip", &Verdict::batches_to_skip)
      .def("__repr__", [](const Verdict& v) {
        return "Verdict(step=" + std::to_string(v.step) + ", outcome='" + to_string(v.outcome) +
               "')";
      });
}

}  // namespace stepguard
