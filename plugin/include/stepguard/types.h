/*
 * What a training loop sees of a guarded step: outcomes, actions, signals and causes as enums
 * with to_string(), the StepReport and its Incident. The definitions live in the engine's core
 * (csrc/core/vocabulary.h, csrc/core/report.h), because the engine modules that fill and write
 * them share them with the loop; the build copies them beside the public headers
 * (stepguard/vocabulary.h, stepguard/report.h) and installs them there.
 */
#pragma once

#include "stepguard/report.h"
#include "stepguard/vocabulary.h"
