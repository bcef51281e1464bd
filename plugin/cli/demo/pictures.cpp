#include "plugin/cli/demo/pictures.h"

#include <cstdint>
#include <exception>
#include <filesystem>
#include <iostream>
#include <vector>

#include "plugin/cli/plot_tool.h"
#include "stepguard/tools.h"

namespace stepguard {
namespace demo {

std::string draw_incident_pictures(const std::string& trace, nlohmann::json& incidents) {
  std::vector<std::string> args = {trace, "--quiet"};
  std::int64_t first_step = -1;
  for (const auto& inc : incidents) {
    if (!inc.contains("report")) continue;
    args.insert(args.end(), {"--incident", inc["report"].get<std::string>()});
    if (first_step < 0) first_step = inc["step"].get<std::int64_t>();
  }
  if (trace.empty() || first_step < 0) return {};
  const std::string by_hand = "not drawn; draw one with: stepguard plot " + trace + " --around " +
                              std::to_string(first_step) + " -o incident.png";
  // One Python for all of them: starting it and matplotlib costs more than a picture.
  try {
    if (cli::run_plot_script(args) != 0) return by_hand;  // the tool said why on stderr
  } catch (const std::exception& e) {
    std::cerr << "stepguard demo: incident pictures: " << e.what() << "\n";
    return by_hand;
  }
  int drawn = 0;
  std::string dir;
  for (auto& inc : incidents) {
    if (!inc.contains("report")) continue;
    const std::string report = inc["report"].get<std::string>();
    const std::string picture = std::filesystem::path(report).replace_extension(".png").string();
    try {
      attach_incident_picture(report, picture);
    } catch (const std::exception& e) {
      std::cerr << "stepguard demo: incident pictures: " << e.what() << "\n";
      continue;
    }
    inc["picture"] = picture;
    dir = std::filesystem::path(report).parent_path().string();
    ++drawn;
  }
  if (drawn == 0) return by_hand;
  return std::to_string(drawn) + " beside the incident reports in " + dir;
}

}  // namespace demo
}  // namespace stepguard
