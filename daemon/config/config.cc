#include "daemon/config/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "sparsecar/common/checked_file.h"
#include "sparsecar/policies/overrides.h"

namespace sparsecar {
namespace {

std::string dashed(std::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

// TOML value -> the text set_knob() parses.
Expected<std::string> toml_text(const toml::node& node) {
  if (auto s = node.as_string()) return s->get();
  if (auto i = node.as_integer()) {
    if (i->get() < 0) return invalid_argument("negative value " + std::to_string(i->get()));
    return std::to_string(i->get());
  }
  if (auto f = node.as_floating_point()) {
    std::ostringstream os;
    os.precision(17);
    os << f->get();
    return os.str();
  }
  if (auto b = node.as_boolean()) return std::string(b->get() ? "on" : "off");
  return invalid_argument("value must be a string, number or boolean");
}

// A row's environment variables ("A|B": A, else B), in the order they are consulted.
std::vector<std::string> env_names(const KnobSpec& spec) {
  std::vector<std::string> names;
  std::string_view rest(spec.env);
  while (!rest.empty()) {
    const size_t bar = rest.find('|');
    names.emplace_back(rest.substr(0, bar));
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return names;
}

// Environment fallbacks for knobs neither the file nor a flag set.
Status apply_env(Config& config, const std::set<std::string>& already_set, const EnvLookup& env) {
  for (const auto& spec : knob_table()) {
    if (already_set.count(spec.name)) continue;
    for (const std::string& name : env_names(spec)) {
      const char* value = env(name.c_str());
      if (value == nullptr || *value == '\0') continue;
      SC_RETURN_IF_ERROR(set_knob(config, spec.name, value).with_context("environment variable " + name));
      break;  // the first one set wins
    }
  }
  // torchrun/Slurm style: the coordinator is the launcher's master address, one port above its
  // store (MASTER_PORT itself belongs to the trainers' own rendezvous).
  if (!already_set.count("coordinator") && env("SPARSECAR_COORDINATOR") == nullptr) {
    const char* addr = env("MASTER_ADDR");
    const char* port = env("MASTER_PORT");
    if (addr && *addr && port && *port) {
      char* end = nullptr;
      long p = std::strtol(port, &end, 10);
      if (*end != '\0' || p <= 0 || p >= 65535) {
        return invalid_argument(std::string("environment variable MASTER_PORT: invalid port '") + port + "'");
      }
      config.coordinator = std::string(addr) + ":" + std::to_string(p + 1);
    }
  }
  return Status::Ok();
}

}  // namespace

static Expected<std::vector<std::string>> load_config(const std::string& path, const std::string_view* contents,
                                                      Config& config);

std::string version_string() { return "sparsecar 0.1.0"; }

Expected<std::string> read_config_text(const std::string& path) {
  const std::string what = "config file " + path;
  return read_checked_file(path, what, kMaxConfigFileBytes, [&](const struct stat& st) -> Status {
    if (S_ISDIR(st.st_mode)) return invalid_argument(what + " is a directory");
    if (!S_ISREG(st.st_mode)) return invalid_argument(what + " is not a regular file");
    if (st.st_size > static_cast<off_t>(kMaxConfigFileBytes)) {
      return invalid_argument(what + " is " + std::to_string(st.st_size) + " bytes; at most " +
                              std::to_string(kMaxConfigFileBytes) + " are read");
    }
    return Status::Ok();
  });
}

Expected<std::vector<std::string>> load_config_file(const std::string& path, Config& config) {
  SC_ASSIGN_OR_RETURN(std::string content, read_config_text(path));
  const std::string_view view(content);
  return load_config(path, &view, config);
}

Expected<std::vector<std::string>> load_config_text(std::string_view text, const std::string& source,
                                                    Config& config) {
  return load_config(source, &text, config);
}

// Parses `contents`, naming it `path` in errors.
static Expected<std::vector<std::string>> load_config(const std::string& path, const std::string_view* contents,
                                                      Config& config) {
  toml::table table;
  try {
    table = toml::parse(*contents, path);
  } catch (const toml::parse_error& e) {
    std::ostringstream os;
    os << path << ":" << e.source().begin.line << ":" << e.source().begin.column << ": "
       << e.description();
    return invalid_argument(os.str());
  } catch (const std::exception& e) {
    return invalid_argument(path + ": " + e.what());
  }
  std::vector<std::string> set_names;
  for (const auto& [key, node] : table) {
    std::string name(key.str());
    std::string where = path + ":" + std::to_string(node.source().begin.line);
    if (name == "tensor" && node.is_table()) {
      // [tensor."GLOB"] tables: per-tensor overrides, appended in file order to tensor_overrides.
      // toml++ iterates keys sorted; rules must keep file order (later ones win), so sort by line.
      auto in_file_order = [](const toml::table& t) {
        std::vector<std::pair<std::string, const toml::node*>> items;
        for (const auto& [k, v] : t) items.emplace_back(std::string(k.str()), &v);
        std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
          return a.second->source().begin < b.second->source().begin;
        });
        return items;
      };
      std::string rules = config.tensor_overrides;
      for (const auto& [glob, section] : in_file_order(*node.as_table())) {
        const std::string at = path + ":" + std::to_string(section->source().begin.line);
        if (!section->is_table()) return invalid_argument(at + ": tensor.\"" + glob + "\" must be a table");
        std::string rule = glob + ":";
        bool first = true;
        for (const auto& [k, v] : in_file_order(*section->as_table())) {
          auto text = toml_text(*v);
          if (!text.ok()) return text.status().with_context(at + ": tensor." + glob + "." + k);
          rule += (first ? " " : ", ") + k + "=" + *text;
          first = false;
        }
        rules += (rules.empty() ? "" : "; ") + rule;
      }
      SC_RETURN_IF_ERROR(set_knob(config, "tensor_overrides", rules).with_context(where));
      if (auto parsed = policies::parse_tensor_overrides(rules); !parsed.ok()) {
        return parsed.status().with_context(where);
      }
      set_names.push_back("tensor_overrides");
      continue;
    }
    if (!find_knob(name)) return not_found(where + ": unknown knob '" + name + "'");
    auto text = toml_text(node);
    if (!text.ok()) return text.status().with_context(where + ": knob '" + name + "'");
    SC_RETURN_IF_ERROR(set_knob(config, name, *text).with_context(where));
    set_names.push_back(name);
  }
  return set_names;
}

Expected<CommandLine> parse_command_line(int argc, const char* const* argv, std::string* out,
                                         const EnvLookup& env) {
  CommandLine result;
  CLI::App app{"sparsecard — the sparsecar gradient-compression daemon (one per node).\n"
               "Trainers hand it gradients over shared memory; it sparsifies them with error\n"
               "feedback, exchanges them with the other nodes over UCX and returns the average.",
               "sparsecard"};
  app.get_formatter()->column_width(34);
  bool version = false;
  std::string check_config;
  app.add_option("--config", result.config_file, "TOML file of `knob = value` lines (flags override it)");
  app.add_flag("--version", version, "print the version and exit");
  app.add_option("--check-config", check_config, "validate a config file and exit");

  std::map<std::string, std::string> flag_values;
  for (const auto& spec : knob_table()) {
    std::string doc = spec.doc;
    doc += " [default: ";
    std::string def = knob_default(spec);
    doc += def.empty() ? "\"\"" : def;
    doc += "]";
    if (spec.choices[0] != '\0') doc += std::string(" {") + spec.choices + "}";
    if (spec.env[0] != '\0') {
      std::string names;
      for (const std::string& name : env_names(spec)) names += (names.empty() ? "" : ", else ") + name;
      doc += " (env " + names + ")";
    }
    if (spec.live) doc += " (live)";
    app.add_option("--" + dashed(spec.name), flag_values[spec.name], doc)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    *out = app.help();
    result.exit_now = true;
    return result;
  } catch (const CLI::ParseError& e) {
    return invalid_argument(std::string(e.what()) + " (see --help)");
  }
  if (version) {
    *out = version_string() + "\n";
    result.exit_now = true;
    return result;
  }

  std::set<std::string> explicitly_set;
  for (const auto& spec : knob_table()) {
    if (app.get_option("--" + dashed(spec.name))->count() > 0) explicitly_set.insert(spec.name);
  }
  std::string file = !check_config.empty() ? check_config : result.config_file;
  std::vector<std::string> from_file;
  if (!file.empty()) {
    Config scratch = result.config;
    SC_ASSIGN_OR_RETURN(from_file, load_config_file(file, scratch));
  }
  std::set<std::string> set_by_user(explicitly_set);
  set_by_user.insert(from_file.begin(), from_file.end());
  SC_RETURN_IF_ERROR(apply_env(result.config, set_by_user, env));
  if (!file.empty()) SC_RETURN_IF_ERROR(load_config_file(file, result.config).status());
  for (const auto& name : explicitly_set) {
    SC_RETURN_IF_ERROR(set_knob(result.config, name, flag_values[name]).with_context("--" + dashed(name)));
  }
  SC_RETURN_IF_ERROR(validate(result.config));
  if (!check_config.empty()) {
    *out = check_config + ": OK\n";
    result.exit_now = true;
  }
  return result;
}

}  // namespace sparsecar
