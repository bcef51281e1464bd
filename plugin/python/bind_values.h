/*
 * The bindings of the values a guarded step hands Python: StepReport (and its incident as a
 * dict), Verdict, Placement. Only bindings; the types are the engine's public ones.
 */
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace stepguard {

void bind_report(pybind11::module_& m);
void bind_layout(pybind11::module_& m);
void bind_verdict(pybind11::module_& m);

}  // namespace stepguard
