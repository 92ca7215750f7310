// durable_file.h: a file appears at its path only complete, a failed write leaves the previous file
// byte for byte, no temporary survives any outcome, and every error names the path (issue 17: four
// copies of the temp + fsync + rename + fsync-dir sequence, one of which ignored the folder fsync).
#include "executor/faulty_io.h"
#include "megatrain/core/durable_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "executor/file_test_util.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;
using test::files_containing;
using test::read_bytes;
using test::write_bytes;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

class DurableFile : public ::testing::Test {
 protected:
  test::ScratchDir dir{"durable"};
  // Entries of the scratch folder that look like our temporaries.
  std::vector<std::string> temporaries() const { return files_containing(dir.path(), ".tmp"); }
};

TEST_F(DurableFile, WriteFileAtomicWritesTheBytesAndLeavesNoTemporary) {
  const fs::path p = dir / "plan.json";
  const std::string bytes = std::string("{\"a\": 1}\n") + std::string(1, '\0') + std::string(100000, 'x');
  ASSERT_TRUE(write_file_atomic(p, bytes).ok());
  EXPECT_EQ(read_bytes(p), bytes);
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(DurableFile, WriteFileAtomicReplacesAnExistingFile) {
  const fs::path p = dir / "plan.json";
  write_bytes(p, "old content that is longer than the new one");
  ASSERT_TRUE(write_file_atomic(p, "new").ok());
  EXPECT_EQ(read_bytes(p), "new");
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(DurableFile, AnEmptyFileIsWritten) {
  const fs::path p = dir / "empty";
  write_bytes(p, "something");
  ASSERT_TRUE(write_file_atomic(p, "").ok());
  EXPECT_TRUE(fs::exists(p));
  EXPECT_EQ(fs::file_size(p), 0u);
}

// The bytes stay in the temporary, invisible at the path, until commit().
TEST_F(DurableFile, TheFileAppearsOnlyAtCommit) {
  const fs::path p = dir / "m.safetensors";
  auto f = AtomicFile::create(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  ASSERT_TRUE(f->write("0123456789", 10).ok());
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(fs::exists(f->temp_path()));
  EXPECT_EQ(f->temp_path().parent_path(), p.parent_path());  // same folder: rename never crosses filesystems
  ASSERT_TRUE(f->write_at(2, "ab", 2).ok());                   // a header rewritten in place
  const fs::path tmp = f->temp_path();
  ASSERT_TRUE(f->commit().ok());
  EXPECT_EQ(read_bytes(p), "01ab456789");
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(temporaries().empty());
  EXPECT_FALSE(f->commit().ok()) << "a second commit must be refused";
}

TEST_F(DurableFile, AnAbandonedWriteKeepsThePreviousFile) {
  const fs::path p = dir / "m.safetensors";
  write_bytes(p, "previous");
  {
    auto f = AtomicFile::create(p);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(f->write("half of the new", 15).ok());
  }  // destroyed without commit(): an error path of a writer
  EXPECT_EQ(read_bytes(p), "previous");
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(DurableFile, TwoWritersAimedAtOnePathUseTwoTemporaries) {
  const fs::path p = dir / "x";
  auto a = AtomicFile::create(p);
  auto b = AtomicFile::create(p);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->temp_path(), b->temp_path());
  ASSERT_TRUE(a->write("a", 1).ok());
  ASSERT_TRUE(b->write("b", 1).ok());
  ASSERT_TRUE(a->commit().ok());
  ASSERT_TRUE(b->commit().ok());
  EXPECT_EQ(read_bytes(p), "b");
  EXPECT_TRUE(temporaries().empty());
}

// A write that fails half-way (a full disk, injected through FileIo: the second write of the file
// is torn and fails with ENOSPC) leaves the old file byte for byte, and no temporary.
TEST_F(DurableFile, AFailedWriteKeepsTheOldContent) {
  const fs::path p = dir / "profile.json";
  write_bytes(p, "the old profile");
  test::FaultyIo io(dir.path());
  io.inject(test::FaultyIo::Op::kWrite, 1, test::FaultyIo::Mode::kTorn, ENOSPC);
  Status s;
  {
    ScopedFileIo use(io);
    s = write_file_atomic(p, std::string(1 << 20, 'n'));
  }
  ASSERT_TRUE(io.fired());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(s.message(), p.string()) && contains(s.message(), "the disk is full") && contains(s.message(), "unchanged"))
      << s.message();
  EXPECT_EQ(read_bytes(p), "the old profile");
  EXPECT_TRUE(temporaries().empty());
}

// The rename is refused (the target is a non-empty folder) after every byte was written.
TEST_F(DurableFile, AFailedRenameKeepsTheTargetAndLeavesNoTemporary) {
  const fs::path p = dir / "target";
  fs::create_directories(p / "inside");
  Status s = write_file_atomic(p, "bytes");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(s.message(), "cannot rename")) << s.message();
  EXPECT_TRUE(contains(s.message(), "'" + p.string() + "'")) << s.message();
  EXPECT_TRUE(fs::is_directory(p / "inside"));
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(DurableFile, AMissingFolderIsNotFoundAndNamed) {
  const fs::path p = dir / "no" / "such" / "plan.json";
  Status s = write_file_atomic(p, "x");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "cannot write '" + p.string() + "': the directory '" + p.parent_path().string() +
                             "' does not exist");
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST_F(DurableFile, AFolderThatIsARegularFileIsRefusedAndNamed) {
  write_bytes(dir / "file", "I am a file");
  const fs::path p = dir / "file" / "plan.json";
  Status s = write_file_atomic(p, "x");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), "cannot write '" + p.string() + "': '" + (dir / "file").string() + "' is not a directory");
  EXPECT_EQ(read_bytes(dir / "file"), "I am a file");

  Status n = write_new_file(p, "x");
  EXPECT_FALSE(n.ok());
  EXPECT_TRUE(contains(n.message(), p.string())) << n.message();
}

TEST_F(DurableFile, WriteNewFileRefusesAnExistingFileAndLeavesIt) {
  const fs::path p = dir / "manifest.json";
  ASSERT_TRUE(write_new_file(p, "first").ok());
  EXPECT_EQ(read_bytes(p), "first");
  Status s = write_new_file(p, "second");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(s.message(), "'" + p.string() + "'")) << s.message();
  EXPECT_TRUE(contains(s.message(), "exists")) << s.message();
  EXPECT_EQ(read_bytes(p), "first");
}

TEST_F(DurableFile, PublishMovesTheTemporaryIntoPlace) {
  const fs::path tmp = temp_path_beside(dir / "trace.mtrace");
  EXPECT_EQ(tmp.parent_path(), dir.path());
  EXPECT_EQ(tmp.filename().string().rfind(".trace.mtrace.tmp-", 0), 0u) << tmp;
  write_bytes(tmp, "sqlite bytes");
  write_bytes(dir / "trace.mtrace", "the old trace");
  ASSERT_TRUE(publish(tmp, dir / "trace.mtrace").ok());
  EXPECT_EQ(read_bytes(dir / "trace.mtrace"), "sqlite bytes");
  EXPECT_FALSE(fs::exists(tmp));
}

TEST_F(DurableFile, PublishOfAMissingTemporaryNamesItAndKeepsTheTarget) {
  write_bytes(dir / "out.json", "kept");
  const fs::path tmp = dir / ".out.json.tmp-gone";
  Status s = publish(tmp, dir / "out.json");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(s.message(), "'" + tmp.string() + "'")) << s.message();
  EXPECT_TRUE(contains(s.message(), "No such file or directory")) << s.message();
  EXPECT_EQ(read_bytes(dir / "out.json"), "kept");
}

TEST_F(DurableFile, FsyncPathSyncsFilesAndFoldersAndNamesWhatIsMissing) {
  write_bytes(dir / "f", "x");
  EXPECT_TRUE(fsync_path(dir / "f", false).ok());
  EXPECT_TRUE(fsync_path(dir.path(), true).ok());
  Status s = fsync_path(dir / "missing", true);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(s.message(), "'" + (dir / "missing").string() + "'")) << s.message();
  // A regular file is not a folder: opening it as one fails, and says so.
  Status d = fsync_path(dir / "f", true);
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(contains(d.message(), "Not a directory")) << d.message();
}

TEST_F(DurableFile, APathWithoutAFileNameIsRefused) {
  Status s = write_file_atomic(dir.path() / "", "x");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(temporaries().empty());
}

}  // namespace
}  // namespace megatrain
