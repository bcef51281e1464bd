/*
 * The binding of the engine's one file layer (csrc/common/safe_file.h) for the package's own
 * reads and writes (stepguard._files): FileError, write_file_atomically, open_regular_file.
 * Only bindings.
 */
#pragma once

#include <pybind11/pybind11.h>

namespace stepguard {

void bind_files(pybind11::module_& m);

}  // namespace stepguard
