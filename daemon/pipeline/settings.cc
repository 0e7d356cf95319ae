#include "daemon/pipeline/settings.h"

namespace sparsecar {

policies::StaticSettings settings_from_config(const Config& config) {
  policies::StaticSettings s;
  s.compression = config.compression;
  s.selector = config.selector;
  s.density = config.density;
  s.threshold = config.threshold;
  return s;
}

}  // namespace sparsecar
