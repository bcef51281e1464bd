// The ATen ops a piece of code dispatches on this thread, counted with a RecordFunction
// callback (what a kernel-launch budget per step is checked with).
#pragma once

#include <ATen/record_function.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

namespace stepguard {

// The ATen ops a thread dispatches while `run` runs, by name, outermost calls only (a zero_ that
// calls fill_ counts once).
inline std::map<std::string, int> ops_of(const std::function<void()>& run) {
  static thread_local std::map<std::string, int>* counted = nullptr;
  static thread_local int depth = 0;
  std::map<std::string, int> out;
  counted = &out;
  const at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            if (depth++ == 0 && counted != nullptr) ++(*counted)[fn.name()];
            return nullptr;
          },
          [](const at::RecordFunction&, at::ObserverContext*) { --depth; })
          .scopes({at::RecordScope::FUNCTION}));
  run();
  at::removeCallback(handle);
  counted = nullptr;
  return out;
}

}  // namespace stepguard
