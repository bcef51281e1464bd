/*
 * What a training loop sees of a guarded step: outcomes, actions, signals and causes as enums
 * with to_string(), the StepReport and its Incident. The definitions live in the engine's core
 * (csrc/core/include/stepguard/core/), installed beside this header, because the engine modules
 * that fill and write them share them with the loop.
 */
#pragma once

#include "stepguard/core/report.h"
#include "stepguard/core/vocabulary.h"
