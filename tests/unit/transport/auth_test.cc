// Job secret files and the keys derived from them (auth.h): what is accepted, what is refused
// with which message (never the secret's bytes), and that every input of a key matters.
#include "daemon/transport/auth.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace sparsecar::auth {
namespace {

const std::string kSecret = "s3cr3t-value-for-tests-0123456789";

// A file in a fresh temporary directory, removed with it.
class TempDir {
 public:
  TempDir() {
    char dir[] = "/tmp/sparsecar-auth-XXXXXX";
    EXPECT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  ~TempDir() { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  std::string file(const std::string& name, const std::string& content, mode_t mode = 0600) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
    return path;
  }
  const std::string& path() const { return dir_; }

 private:
  std::string dir_;
};

void expect_refused(const Expected<std::string>& r, Code code, const std::string& says) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("job_secret_file"), std::string::npos) << r.status().message();
  EXPECT_EQ(r.status().message().find("s3cr3t"), std::string::npos) << "the secret leaked: " << r.status().message();
}

TEST(JobSecretFileTest, AcceptsAPrivateFileAndTrimsOneTrailingNewline) {
  TempDir d;
  auto r = read_job_secret_file(d.file("s", kSecret + "\n"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, kSecret);
  r = read_job_secret_file(d.file("crlf", kSecret + "\r\n"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, kSecret);
  r = read_job_secret_file(d.file("ro", kSecret, 0400));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  r = read_job_secret_file(d.file("sixteen", std::string(16, 'k') + "\n"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->size(), 16u);
  r = read_job_secret_file(d.file("max", std::string(kMaxSecretBytes, 'k')));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
}

TEST(JobSecretFileTest, RefusesWhatStartMustRefuse) {
  TempDir d;
  expect_refused(read_job_secret_file(d.file("group", kSecret, 0640)), Code::kPermissionDenied, "mode 0640");
  expect_refused(read_job_secret_file(d.file("world", kSecret, 0604)), Code::kPermissionDenied, "mode 0604");
  expect_refused(read_job_secret_file(d.file("empty", "")), Code::kInvalidArgument, "is empty");
  expect_refused(read_job_secret_file(d.file("newline", "\n")), Code::kInvalidArgument, "is empty");
  expect_refused(read_job_secret_file(d.file("short", "s3cr3t-short\n")), Code::kInvalidArgument, "at least 16");
  expect_refused(read_job_secret_file(d.file("big", "s3cr3t" + std::string(kMaxSecretBytes, 'k'))),
                 Code::kInvalidArgument, "larger than 4096");
  expect_refused(read_job_secret_file(d.path()), Code::kInvalidArgument, "not a regular file");
  auto missing = read_job_secret_file(d.path() + "/missing");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("cannot open"), std::string::npos);
  if (::geteuid() == 0) {  // only root can give a file away
    std::string theirs = d.file("theirs", kSecret);
    ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
    expect_refused(read_job_secret_file(theirs), Code::kPermissionDenied, "owned by uid 65534");
  }
}

TEST(JobSecretFileTest, LoadJobKeyOfNoPathIsTheOpenKey) {
  auto k = load_job_key("");
  ASSERT_TRUE(k.ok());
  EXPECT_TRUE(k->open);
  EXPECT_EQ(k->root, open_job_key().root);
  TempDir d;
  auto s = load_job_key(d.file("s", kSecret + "\n"));
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->open);
  EXPECT_EQ(s->root, job_key_from_secret(kSecret).root);
  EXPECT_FALSE(load_job_key(d.file("bad", kSecret, 0644)).ok());
}

TEST(KeysTest, EveryInputOfAKeyMatters) {
  const JobKey a = job_key_from_secret(kSecret);
  const JobKey b = job_key_from_secret(kSecret + "x");
  EXPECT_EQ(a.root, job_key_from_secret(kSecret).root);
  EXPECT_NE(a.root, b.root);
  EXPECT_NE(a.root, open_job_key().root);
  EXPECT_NE(rendezvous_key(a), rendezvous_key(b));
  Nonce f1{}, f2{};
  f2[31] = 1;
  EXPECT_NE(transport_key(a, 1, f1), transport_key(a, 2, f1));
  EXPECT_NE(transport_key(a, 1, f1), transport_key(a, 1, f2));
  EXPECT_NE(transport_key(a, 1, f1), transport_key(b, 1, f1));
  EXPECT_NE(transport_key(a, 1, f1), rendezvous_key(a));
  // Part boundaries do not matter (a MAC is over the concatenation); the key does.
  const Key k = rendezvous_key(a);
  EXPECT_EQ(mac128(k, {bytes_of("ab"), bytes_of("c")}), mac128(k, {bytes_of("abc")}));
  EXPECT_NE(mac128(k, {bytes_of("abc")}), mac128(rendezvous_key(b), {bytes_of("abc")}));
  EXPECT_NE(random_array<32>(), random_array<32>());
}

}  // namespace
}  // namespace sparsecar::auth
