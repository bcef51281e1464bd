// The background thread of checkpoint work: jobs run one at a time in submission order, a job's
// throw lands in its own future (the next job still runs), and destruction runs the jobs already
// queued before it joins. Torch-free: also built with ASan/UBSan.
#include <gtest/gtest.h>

#include <future>
#include <stdexcept>
#include <vector>

#include "csrc/checkpoint/background.h"

namespace stepguard {
namespace {

using checkpoint::BackgroundThread;

TEST(BackgroundThread, RunsJobsInOrderAndHandsBackWhatTheyThrew) {
  std::vector<int> order;  // written by the jobs only, read after the last one's future
  BackgroundThread thread("sg-test");
  std::promise<void> go;
  std::shared_future<void> started = go.get_future().share();
  std::future<void> first = thread.submit([&] {
    started.wait();  // the later jobs queue up behind this one
    order.push_back(1);
  });
  std::future<void> second = thread.submit([&] {
    order.push_back(2);
    throw std::runtime_error("disk full");
  });
  std::future<void> third = thread.submit([&] { order.push_back(3); });
  go.set_value();
  first.get();
  try {
    second.get();
    FAIL() << "the throw was lost";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "disk full");
  }
  third.get();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST(BackgroundThread, DestructionRunsTheQueuedJobsFirst) {
  int ran = 0;
  std::future<void> last;
  {
    BackgroundThread thread("sg-test");
    for (int i = 0; i < 5; ++i) last = thread.submit([&ran] { ++ran; });
  }
  EXPECT_EQ(ran, 5);
  last.get();
}

}  // namespace
}  // namespace stepguard
