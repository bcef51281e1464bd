// An empty directory under the test temp dir, for tests that write files. Torch-free.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace stepguard {

inline std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/sg_ckpt_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace stepguard
