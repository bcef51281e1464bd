#include "csrc/checkpoint/background.h"

#include <pthread.h>

#include <utility>

namespace stepguard {
namespace checkpoint {

BackgroundThread::BackgroundThread(std::string name) : name_(std::move(name)) {}

BackgroundThread::~BackgroundThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

std::future<void> BackgroundThread::submit(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  std::future<void> done = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) {  // first: a thread that cannot start leaves no job behind
      thread_ = std::thread([this] { run(); });
      ::pthread_setname_np(thread_.native_handle(), name_.substr(0, 15).c_str());
    }
    jobs_.push_back(std::move(task));
  }
  wake_.notify_one();
  return done;
}

void BackgroundThread::run() {
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and every job has run
      task = std::move(jobs_.front());
      jobs_.pop_front();
    }
    task();  // a throw lands in the task's future
  }
}

}  // namespace checkpoint
}  // namespace stepguard
