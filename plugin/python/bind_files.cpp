#include "plugin/python/bind_files.h"

#include <cstdint>
#include <string>

#include "csrc/common/safe_file.h"

namespace py = pybind11;

namespace stepguard {

void bind_files(py::module_& m) {
  // A file that could not be read or written: an OSError, and a RuntimeError as
  // std::runtime_error was before it had a type of its own.
  static py::object file_error =
      py::module_::import("builtins")
          .attr("type")("FileError",
                        py::make_tuple(py::handle(PyExc_OSError), py::handle(PyExc_RuntimeError)),
                        py::dict(py::arg("__module__") = "stepguard._C"));
  m.attr("FileError") = file_error;
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const FileError& e) {
      py::set_error(file_error, e.what());
    }
  });
  m.def(
      "write_file_atomically",
      [](const std::string& path, const py::bytes& data) {
        std::string bytes = data;
        py::gil_scoped_release release;
        write_file_atomically(path, bytes);
      },
      py::arg("path"), py::arg("data"),
      "Writes `data` to `path` through a fresh temporary file and a rename: never through a "
      "link, never into a file it did not create. Raises FileError naming the path.");
  m.def(
      "open_regular_file",
      [](const std::string& path, std::int64_t max_bytes) {
        std::string why;
        const int fd = open_regular_file(path, max_bytes, &why);
        if (fd < 0) throw FileError(path + ": cannot read: " + why);
        return fd;
      },
      py::arg("path"), py::arg("max_bytes"),
      "A file descriptor of `path` open for reading when it is a regular file of at most "
      "`max_bytes` (never blocks on a FIFO); FileError naming the path otherwise.");
}

}  // namespace stepguard
