// Skips a CUDA test where no GPU is visible, naming the reason (cuda::device_count's). For the
// tests built whenever nvcc exists and run only where a GPU is present.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "csrc/inspect/cuda/inspect_cuda.h"

#define SKIP_WITHOUT_GPU()                                \
  do {                                                    \
    std::string why;                                      \
    if (::stepguard::cuda::device_count(&why) == 0) {     \
      GTEST_SKIP() << "no CUDA GPU here (" << why << ")"; \
    }                                                     \
  } while (0)
