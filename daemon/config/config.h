// Start-up configuration of sparsecard: command line, config file and launcher environment,
// all resolved through the knob table (knobs.h).
//
// Precedence, lowest to highest: built-in defaults < environment fallbacks (SPARSECAR_NODE_RANK
// else NODE_RANK, SPARSECAR_NNODES else NNODES, SPARSECAR_LOCAL_WORLD_SIZE, MASTER_ADDR/MASTER_PORT,
// SPARSECAR_*; the knob table's `env` column) < config file (--config FILE) < flags.
// The node-level variables never fall back to a launcher's per-process RANK / WORLD_SIZE /
// LOCAL_WORLD_SIZE: torchrun sets those for each trainer, and a daemon started beside the
// trainers would take a trainer's rank for the node's.
// The config file is TOML with top-level `knob = value` lines; unknown keys are errors.
// Exceptions are allowed here (start-up only); everything is reported as Status to the caller.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/config/knobs.h"

namespace sparsecar {

// What main() should do after parsing the command line.
struct CommandLine {
  Config config;
  std::string config_file;
  bool exit_now = false;  // --help / --version / --check-config printed something
  int exit_code = 0;
};

using EnvLookup = std::function<const char*(const char*)>;

// Parses argv; `out` receives --help / --version text. Errors (unknown flag, bad value, unreadable
// config file) come back as Status with a message meant for the user.
Expected<CommandLine> parse_command_line(int argc, const char* const* argv, std::string* out,
                                         const EnvLookup& env = ::getenv);

// Config files larger than this are refused (a config file is a few kilobytes).
inline constexpr size_t kMaxConfigFileBytes = size_t{1} << 20;

// The bytes of a config file. Errors (with the path and errno text): missing, unreadable, a
// directory or anything but a regular file, larger than kMaxConfigFileBytes.
Expected<std::string> read_config_text(const std::string& path);

// Applies a TOML config file's top-level `knob = value` entries to `config`; returns the knob
// names it set. Errors carry the file name and line.
Expected<std::vector<std::string>> load_config_file(const std::string& path, Config& config);
// The same for a config file's text already in memory; `source` names it in errors (a path).
Expected<std::vector<std::string>> load_config_text(std::string_view text, const std::string& source,
                                                    Config& config);

// Version string "sparsecar 0.1.0".
std::string version_string();

}  // namespace sparsecar
