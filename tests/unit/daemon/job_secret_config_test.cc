// The job_secret_file knob at start-up: --check-config makes the same check start does (a
// regular private file with at least 16 bytes), and no error ever shows the secret.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "daemon/config/config.h"
#include "daemon/config/knobs.h"

namespace sparsecar {
namespace {

Expected<CommandLine> parse(std::vector<std::string> args, std::string* out) {
  std::vector<const char*> argv{"sparsecard"};
  for (auto& a : args) argv.push_back(a.c_str());
  return parse_command_line(static_cast<int>(argv.size()), argv.data(), out,
                            [](const char*) -> const char* { return nullptr; });
}

std::string write_temp(const std::string& content, mode_t mode) {
  char path[] = "/tmp/sparsecar-secret-XXXXXX";
  int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  ::close(fd);
  std::ofstream(path) << content;
  EXPECT_EQ(::chmod(path, mode), 0);
  return path;
}

TEST(JobSecretConfigTest, CheckConfigRefusesAnUnsafeOrShortSecretFileAndAcceptsAGoodOne) {
  const std::string secret = "hunter2-hunter2-hunter2-hunter2";
  const std::string good = write_temp(secret + "\n", 0600);
  const std::string loose = write_temp(secret + "\n", 0644);
  const std::string shorty = write_temp("hunter2\n", 0600);
  std::string out;
  for (const std::string& bad : {loose, shorty}) {
    const std::string config = write_temp("world_size = 2\njob_secret_file = \"" + bad + "\"\n", 0600);
    auto r = parse({"--check-config", config}, &out);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("job_secret_file"), std::string::npos) << r.status().message();
    EXPECT_EQ(r.status().message().find("hunter2"), std::string::npos) << "secret leaked: " << r.status().message();
    // Start reads the flags the same way.
    EXPECT_FALSE(parse({"--job-secret-file", bad}, &out).ok());
    std::remove(config.c_str());
  }
  const std::string config = write_temp("world_size = 2\njob_secret_file = \"" + good + "\"\n", 0600);
  auto ok = parse({"--check-config", config}, &out);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->config.job_secret_file, good);
  EXPECT_EQ(out.find("hunter2"), std::string::npos);
  auto flag = parse({"--job-secret-file", good}, &out);
  ASSERT_TRUE(flag.ok()) << flag.status().to_string();
  EXPECT_EQ(flag->config.job_secret_file, good);
  const KnobSpec* spec = find_knob("job_secret_file");
  ASSERT_NE(spec, nullptr);
  EXPECT_FALSE(spec->live);
  EXPECT_FALSE(spec->agreed);
  EXPECT_EQ(Config{}.job_secret_file, "");
  for (const auto& p : {good, loose, shorty, config}) std::remove(p.c_str());
}

}  // namespace
}  // namespace sparsecar
