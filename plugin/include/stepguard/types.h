/*
 * What a training loop sees of a guarded step: outcomes, actions, signals and causes as enums
 * with to_string(), the StepReport and its Incident. The definitions live in the engine's core
 * (csrc/core/include/stepguard/vocabulary.h, csrc/core/include/stepguard/report.h; installed under include/csrc/core), because the
 * engine modules that fill and write them share them with the loop.
 */
#pragma once

#include "stepguard/report.h"
#include "stepguard/vocabulary.h"
