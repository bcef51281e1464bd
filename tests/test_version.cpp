#include <gtest/gtest.h>
#include <stepguard/version.h>

#include <string>

namespace stepguard {
namespace {

TEST(Version, MacrosAreNumbersThatSpellTheVersionString) {
  // Fails to compile when the configured header is malformed.
  constexpr int major = STEPGUARD_VERSION_MAJOR, minor = STEPGUARD_VERSION_MINOR,
                patch = STEPGUARD_VERSION_PATCH;
  EXPECT_EQ(std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch),
            std::string(STEPGUARD_VERSION_STRING));
  EXPECT_STREQ(version(), STEPGUARD_VERSION_STRING);
}

TEST(Version, BuildInfoNamesTheLibraryAndItsDependencies) {
  const std::string info = build_info();
  EXPECT_EQ(info.rfind(std::string("stepguard ") + STEPGUARD_VERSION_STRING, 0), 0u) << info;
  EXPECT_NE(info.find(" libtorch "), std::string::npos) << info;
  EXPECT_NE(info.find(" cuda "), std::string::npos) << info;
}

}  // namespace
}  // namespace stepguard
