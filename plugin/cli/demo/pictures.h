/*
 * Pictures of the demo's incidents: after the run, the steps around each reported incident are
 * drawn from the trace beside its report (the Python tool stepguard.plot, python3 with
 * matplotlib), and the report links its picture. Not here: the drawing.
 */
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace stepguard {
namespace demo {

/// Draws `<report stem>.png` for every entry of `incidents` (the summary's) that has a "report",
/// from the trace at `trace`; each entry drawn gains "picture". Returns a line for the summary
/// table: where the pictures are, or how to draw one when they could not be drawn; "" when there
/// is nothing to draw (no trace, no reports). A picture that cannot be drawn never fails the run.
std::string draw_incident_pictures(const std::string& trace, nlohmann::json& incidents);

}  // namespace demo
}  // namespace stepguard
