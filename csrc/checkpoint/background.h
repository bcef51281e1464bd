/*
 * One background thread for checkpoint work that must not hold up the training thread: RAM
 * snapshot copies and disk checkpoint writes. Jobs run one at a time, in the order they were
 * submitted; each submit() returns a future that ends with the job and holds what it threw.
 *
 * Not here: what the jobs do (snapshot.h, the engine's recovery), or when the training thread
 * waits for them (the engine: before anything changes what a job reads).
 *
 * Torch-free. Thread-safety: one owning thread submits and destroys; the jobs run on the
 * background thread and must not touch Python objects (they never take the GIL).
 */
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include <cstdint>

namespace stepguard {
namespace checkpoint {

/// A function a test installs to hold background work at a gate instead of timing it: set() from
/// the test thread, run(step) on the background thread as each job starts (an empty function:
/// nothing happens).
class TestHook {
 public:
  void set(std::function<void(std::int64_t)> hook) {
    std::lock_guard<std::mutex> lock(mutex_);
    hook_ = std::move(hook);
  }
  void run(std::int64_t step) const {
    std::function<void(std::int64_t)> hook;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      hook = hook_;
    }
    if (hook) hook(step);  // outside the lock: it may block until the test lets it go
  }

 private:
  mutable std::mutex mutex_;
  std::function<void(std::int64_t)> hook_;
};

class BackgroundThread {
 public:
  /// `name` (at most 15 characters) names the thread in debuggers and `top -H`. The thread
  /// starts with the first job.
  explicit BackgroundThread(std::string name);
  /// Runs the jobs already submitted, then joins the thread.
  ~BackgroundThread();
  BackgroundThread(const BackgroundThread&) = delete;
  BackgroundThread& operator=(const BackgroundThread&) = delete;

  /// Queues `job`; the future becomes ready when it has run (rethrowing what it threw). Throws
  /// std::system_error when the thread cannot be started.
  std::future<void> submit(std::function<void()> job);

 private:
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace checkpoint
}  // namespace stepguard
