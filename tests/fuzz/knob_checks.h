// Shared by the fuzz targets that apply knob text to a Config: a check that traps (so libFuzzer
// reports the input) and knob-by-knob equality of two configs through the knob table.
#pragma once

#include "daemon/config/knobs.h"

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

inline bool same_knobs(const sparsecar::Config& a, const sparsecar::Config& b) {
  for (const auto& spec : sparsecar::knob_table()) {
    if (sparsecar::get_knob(a, spec.name).value() != sparsecar::get_knob(b, spec.name).value()) return false;
  }
  return true;
}
