// A gate for background work (a RAM snapshot copy, a disk checkpoint write): installed as the
// work's test hook, it holds every job at its start until open(), so a test can tell "the
// training thread went on while the job had not run" without timing anything. A job held for a
// minute is let go with an error (a test that waited for it fails instead of hanging).
// Torch-free.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <new>
#include <stdexcept>
#include <vector>

namespace stepguard {

class Gate {
 public:
  using Install = void (*)(std::function<void(std::int64_t)>);

  explicit Gate(Install install) : install_(install) {
    install_([this](std::int64_t step) { pass(step); });
  }
  ~Gate() {
    open();
    install_({});
  }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  /// Waits until a job has reached the gate (a minute at most); the step of the first one, or -1.
  std::int64_t held() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait_for(lock, std::chrono::minutes(1), [this] { return !arrived_.empty(); });
    return arrived_.empty() ? -1 : arrived_.front();
  }
  /// Lets the held jobs and every later one through; with `fail`, each one that passes throws
  /// std::bad_alloc (what an allocation of its host copy would throw).
  void open(bool fail = false) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
      fail_ = fail;
    }
    changed_.notify_all();
  }
  /// Jobs that have passed the gate so far.
  int passed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return passed_;
  }

 private:
  void pass(std::int64_t step) {
    std::unique_lock<std::mutex> lock(mutex_);
    arrived_.push_back(step);
    changed_.notify_all();
    if (!changed_.wait_for(lock, std::chrono::minutes(1), [this] { return open_; })) {
      throw std::runtime_error("the test never opened the gate");
    }
    ++passed_;
    if (fail_) throw std::bad_alloc();
  }

  Install install_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::int64_t> arrived_;
  bool open_ = false;
  bool fail_ = false;
  int passed_ = 0;
};

}  // namespace stepguard
