// packaging/sparsecard.toml.example lists every selector of the registry (kernels/selectors.h),
// in registry order, one "#   selector: <name>  <what it keeps>" line each: a selector added to
// the registry without a line in the example (or a line left for a removed one) fails here.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "sparsecar/kernels/selectors.h"

namespace sparsecar::kernels {
namespace {

TEST(kernelsSelectors, TheExampleConfigListsEverySelector) {
  const std::string path = std::string(SPARSECAR_SOURCE_DIR) + "/packaging/sparsecard.toml.example";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  std::vector<std::string> listed;
  const std::string marker = "#   selector: ";
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(marker, 0) != 0) continue;
    std::istringstream words(line.substr(marker.size()));
    std::string name;
    words >> name;
    listed.push_back(name);
  }
  std::vector<std::string> registry;
  for (const SelectorInfo& row : selector_registry()) {
    if (row.id != Selector::kNone) registry.emplace_back(row.name);  // none = compression off
  }
  EXPECT_EQ(listed, registry) << path << " lists the selectors on '" << marker << "<name>' lines";
  std::string choices;
  for (const std::string& name : listed) choices += (choices.empty() ? "" : "|") + name;
  EXPECT_EQ(choices, selector_choices());
}

}  // namespace
}  // namespace sparsecar::kernels
