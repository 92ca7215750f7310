// check_output: each way an output path can be wrong is refused with the path and the reason, and a
// good path passes leaving nothing behind (issue 16: a bad --trace or --checkpoint-dir used to be
// found only after every step had run).
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "megatrain/core/output_path.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;

class OutputPath : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("megatrain-output-path-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (mounted_) ::umount(readonly_.c_str());
    fs::remove_all(dir_);
  }
  // An empty file at `p`.
  static void touch(const fs::path& p, const std::string& text = "") { std::ofstream(p) << text; }
  static size_t entries(const fs::path& d) {
    return static_cast<size_t>(std::distance(fs::directory_iterator(d), fs::directory_iterator()));
  }
  // A folder nobody, root included, can create files in: a read-only tmpfs mounted here when this
  // process may mount, else /sys (sysfs takes no new files). Empty when neither is available.
  fs::path unwritable_folder() {
    readonly_ = dir_ / "readonly";
    fs::create_directories(readonly_);
    if (::mount("tmpfs", readonly_.c_str(), "tmpfs", MS_RDONLY, "size=64k") == 0) {
      mounted_ = true;
      return readonly_;
    }
    if (fs::is_directory("/sys") && !check_output({}, "/sys", OutputKind::kExistingFolder).ok()) return "/sys";
    return {};
  }

  fs::path dir_, readonly_;
  bool mounted_ = false;
};

TEST_F(OutputPath, AWritableFolderPassesAndKeepsNoProbeFile) {
  EXPECT_TRUE(check_output("--trace", dir_ / "run.mtrace", OutputKind::kFile).ok());
  EXPECT_TRUE(check_output("--dir", dir_, OutputKind::kExistingFolder).ok());
  EXPECT_FALSE(fs::exists(dir_ / "run.mtrace"));  // the output itself is not created
  EXPECT_EQ(entries(dir_), 0u);                   // the probe file is gone
}

TEST_F(OutputPath, AFolderOutputIsCreatedWithItsParents) {
  const fs::path ckpt = dir_ / "a" / "b" / "ckpt";
  ASSERT_TRUE(check_output("--checkpoint-dir", ckpt, OutputKind::kFolder).ok());
  EXPECT_TRUE(fs::is_directory(ckpt));
  EXPECT_EQ(entries(ckpt), 0u);
}

TEST_F(OutputPath, AnExistingFileIsLeftAlone) {
  touch(dir_ / "plan.json", "keep me");
  ASSERT_TRUE(check_output("-o", dir_ / "plan.json", OutputKind::kFile).ok());
  std::ifstream in(dir_ / "plan.json");
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "keep me");
}

TEST_F(OutputPath, AnExistingFileUsedAsAFolder) {
  const fs::path file = dir_ / "file";
  touch(file);
  const Status s = check_output("--checkpoint-dir", file, OutputKind::kFolder);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--checkpoint-dir " + file.string() + ": exists and is not a folder");
  EXPECT_EQ(check_output("--dir", file, OutputKind::kExistingFolder).message(), "--dir " + file.string() + ": exists and is not a folder");

  const Status below = check_output("--checkpoint-dir", file / "ckpt", OutputKind::kFolder);
  EXPECT_NE(below.message().find("could not be created (Not a directory)"), std::string::npos) << below.message();

  const Status in_file = check_output("--trace", file / "x.mtrace", OutputKind::kFile);
  EXPECT_EQ(in_file.message(), "--trace " + (file / "x.mtrace").string() + ": " + file.string() + " is not a folder");
}

TEST_F(OutputPath, AFolderWhereAFileShouldBe) {
  const Status s = check_output("--screenshot", dir_, OutputKind::kFile);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(dir_.string() + ": is a folder"), std::string::npos) << s.message();
}

TEST_F(OutputPath, AMissingParent) {
  const fs::path out = dir_ / "missing" / "dir" / "x.mtrace";
  const Status s = check_output("--trace", out, OutputKind::kFile);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "--trace " + out.string() + ": the folder " + (dir_ / "missing" / "dir").string() + " does not exist");
  EXPECT_FALSE(fs::exists(dir_ / "missing"));  // a file output never creates folders

  const Status d = check_output("--dir", dir_ / "missing", OutputKind::kExistingFolder);
  EXPECT_EQ(d.message(), "--dir " + (dir_ / "missing").string() + ": the folder does not exist");
}

TEST_F(OutputPath, ARelativeFileNameIsCheckedInTheWorkingFolder) {
  EXPECT_TRUE(check_output("-o", "plan.json", OutputKind::kFile).ok());
}

TEST_F(OutputPath, AnEmptyPath) {
  EXPECT_EQ(check_output("-o", "", OutputKind::kFile).message(), "-o: the path is empty");
  EXPECT_EQ(check_output({}, "", OutputKind::kFolder).message(), "the output: the path is empty");
}

TEST_F(OutputPath, AnUnwritableFolder) {
  const fs::path ro = unwritable_folder();
  if (ro.empty()) GTEST_SKIP() << "no folder here that root cannot write (cannot mount a read-only tmpfs, no /sys)";
  const Status f = check_output("--trace", ro / "x.mtrace", OutputKind::kFile);
  EXPECT_EQ(f.code(), StatusCode::kIoError);
  EXPECT_NE(f.message().find("--trace " + (ro / "x.mtrace").string() + ": the folder " + ro.string() + " is not writable ("),
            std::string::npos)
      << f.message();
  const Status d = check_output("--checkpoint-dir", ro, OutputKind::kFolder);
  EXPECT_NE(d.message().find("--checkpoint-dir " + ro.string() + ": not writable ("), std::string::npos) << d.message();
  const Status sub = check_output("--checkpoint-dir", ro / "ckpt", OutputKind::kFolder);
  EXPECT_NE(sub.message().find("could not be created"), std::string::npos) << sub.message();
}

}  // namespace
}  // namespace megatrain
