// A FileIo (megatrain/core/file_io.h) for fault tests: it watches the files under one folder,
// counts each kind of call made there, and injects one fault: an errno, a short or a torn write, or
// a crash. A crash stops every later call there (as if the process had died at that point), and
// lose_power() then undoes what had not reached the disk the way a power cut would: bytes written
// to a file since its last fsync, and files created, renamed or made folders whose folder was not
// fsynced since. Install it with ScopedFileIo.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "megatrain/core/file_io.h"

namespace megatrain::test {

class FaultyIo : public FileIo {
 public:
  enum class Op { kOpen, kRead, kWrite, kFsync, kRename, kMkdir, kUnlink, kCompletion, kCount };
  enum class Mode { kErrno, kShort, kTorn };

  explicit FaultyIo(std::filesystem::path root) : root_(std::filesystem::absolute(root).lexically_normal().string() + "/") {}

  // The at-th call (from 1) of `op` under the folder fails: -1 with errno `err` (kErrno), moves
  // half its bytes and says so (kShort, a legal short transfer), or moves half and fails with `err`
  // (kTorn). Completions (io_uring) take kErrno (res -err) and kShort.
  void inject(Op op, int at, Mode mode, int err = EIO) {
    std::lock_guard<std::mutex> g(mu_);
    fault_op_ = op, fault_at_ = at, mode_ = mode, err_ = err;
  }
  // The process "dies" just before its at-th durable operation (from 1: a write, fsync, rename,
  // mkdir, unlink or file creation under the folder): that call and every later one there fail
  // with EIO and change nothing.
  void crash_before(int at) {
    std::lock_guard<std::mutex> g(mu_);
    crash_at_ = at;
  }
  int count(Op op) const {
    std::lock_guard<std::mutex> g(mu_);
    return counts_[static_cast<int>(op)];
  }
  int durable_ops() const {
    std::lock_guard<std::mutex> g(mu_);
    return durable_;
  }
  bool fired() const {
    std::lock_guard<std::mutex> g(mu_);
    return fired_ || crashed_;
  }

  // After a crash: undo, newest first, the creations, renames and folders whose folder was not
  // fsynced after them, then cut every file written here back to its size at its last fsync.
  void lose_power() {
    std::lock_guard<std::mutex> g(mu_);
    namespace fs = std::filesystem;
    std::error_code ec;
    for (size_t i = journal_.size(); i-- > 0;) {
      const Entry& e = journal_[i];
      if (e.durable) continue;
      if (e.kind == Entry::kRename) {
        if (fs::exists(e.b, ec)) ::rename(e.b.c_str(), e.a.c_str());
        if (e.had_old) std::ofstream(e.b, std::ios::binary | std::ios::trunc) << e.old_bytes;
        continue;
      }
      // Where the file or folder is now: moved along by the durable renames of a folder above it.
      std::string at = e.a;
      for (size_t j = i + 1; j < journal_.size(); ++j) {
        const Entry& r = journal_[j];
        if (r.kind == Entry::kRename && r.durable && at.rfind(r.a + "/", 0) == 0) at = r.b + at.substr(r.a.size());
      }
      if (e.kind == Entry::kCreate) ::unlink(at.c_str());
      else fs::remove_all(at, ec);
    }
    for (const auto& [ino, size] : durable_size_)
      for (const auto& f : fs::recursive_directory_iterator(root_, ec)) {
        struct stat st{};
        if (f.is_regular_file(ec) && ::stat(f.path().c_str(), &st) == 0 && st.st_ino == ino && st.st_size > size)
          ::truncate(f.path().c_str(), size);
      }
    journal_.clear();
  }

  int open(const char* path, int flags, unsigned mode) override {
    const bool under = watched(path);
    if (!under) return FileIo::open(path, flags, mode);
    std::unique_lock<std::mutex> g(mu_);
    const bool creates = (flags & O_CREAT) && ::access(path, F_OK) != 0;
    if (creates && durable_step()) return fail(EIO);
    if (injected(Op::kOpen)) return fail(err_);
    const int fd = FileIo::open(path, flags, mode);
    if (fd < 0) return fd;
    fds_[fd] = norm(path);
    struct stat st{};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
      inode_[fd] = st.st_ino;
      if (creates) durable_size_[st.st_ino] = 0;
    }
    if (creates) journal_.push_back({Entry::kCreate, norm(path), "", parent(path), false, "", false});
    return fd;
  }
  ssize_t read(int fd, void* buf, size_t n) override { return transfer(fd, buf, n, -1, false); }
  ssize_t pread(int fd, void* buf, size_t n, int64_t offset) override { return transfer(fd, buf, n, offset, false); }
  ssize_t write(int fd, const void* buf, size_t n) override { return transfer(fd, const_cast<void*>(buf), n, -1, true); }
  ssize_t pwrite(int fd, const void* buf, size_t n, int64_t offset) override {
    return transfer(fd, const_cast<void*>(buf), n, offset, true);
  }
  int fsync(int fd) override {
    std::unique_lock<std::mutex> g(mu_);
    const auto f = known(fd);
    if (f == fds_.end()) return FileIo::fsync(fd);
    if (durable_step()) return fail(EIO);
    if (injected(Op::kFsync)) return fail(err_);
    const int rc = FileIo::fsync(fd);
    if (rc != 0) return rc;
    struct stat st{};
    if (const auto i = inode_.find(fd); i != inode_.end()) {
      if (::fstat(fd, &st) == 0) durable_size_[i->second] = st.st_size;
    } else {  // a folder: what was created, renamed or made in it is durable now
      for (Entry& e : journal_)
        if (e.folder == f->second) e.durable = true;
    }
    return 0;
  }
  int close(int fd) override {
    std::lock_guard<std::mutex> g(mu_);
    fds_.erase(fd);
    inode_.erase(fd);
    return FileIo::close(fd);  // even after a crash: the descriptor must not leak into the test
  }
  int rename(const char* from, const char* to) override { return renamed(from, to, false); }
  int rename_exchange(const char* a, const char* b) override { return renamed(a, b, true); }
  int mkdir(const char* path, unsigned mode) override {
    if (!watched(path)) return FileIo::mkdir(path, mode);
    std::unique_lock<std::mutex> g(mu_);
    if (durable_step()) return fail(EIO);
    if (injected(Op::kMkdir)) return fail(err_);
    const int rc = FileIo::mkdir(path, mode);
    if (rc == 0) journal_.push_back({Entry::kMkdir, norm(path), "", parent(path), false, "", false});
    return rc;
  }
  int unlink(const char* path) override {
    if (!watched(path)) return FileIo::unlink(path);
    std::unique_lock<std::mutex> g(mu_);
    if (durable_step()) return fail(EIO);
    if (injected(Op::kUnlink)) return fail(err_);
    return FileIo::unlink(path);
  }
  int completed(int fd, bool write, int res, size_t requested) override {
    std::unique_lock<std::mutex> g(mu_);
    if (known(fd) == fds_.end()) return res;
    if (crashed_) return -EIO;
    (void)write;
    if (!injected(Op::kCompletion)) return res;
    return mode_ == Mode::kShort ? static_cast<int>(requested / 2) : -err_;
  }

 private:
  struct Entry {
    enum Kind { kCreate, kRename, kMkdir } kind;
    std::string a, b, folder;  // create/mkdir: a; rename: a -> b; the folder whose fsync makes it durable
    bool had_old;
    std::string old_bytes;
    bool durable;
  };

  static std::string norm(const std::string& p) {
    std::string s = std::filesystem::absolute(p).lexically_normal().string();
    while (s.size() > 1 && s.back() == '/') s.pop_back();
    return s;
  }
  bool watched(const char* path) const {
    const std::string p = norm(path) + "/";
    return p.rfind(root_, 0) == 0;
  }
  static std::string parent(const std::string& p) { return std::filesystem::path(norm(p)).parent_path().string(); }
  // The descriptor's entry: one opened through this FileIo, or one opened before it was installed
  // (an NVMe store's files) whose path, read from /proc, is under the folder.
  std::map<int, std::string>::iterator known(int fd) {
    if (auto f = fds_.find(fd); f != fds_.end()) return f;
    std::error_code ec;
    const auto target = std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
    if (ec || (norm(target.string()) + "/").rfind(root_, 0) != 0) return fds_.end();
    struct stat st{};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) inode_[fd] = st.st_ino;
    return fds_.emplace(fd, norm(target.string())).first;
  }
  // Counts a durable operation; true when the crash happens at it or happened before.
  bool durable_step() {
    if (crashed_) return true;
    ++durable_;
    if (crash_at_ > 0 && durable_ == crash_at_) crashed_ = true;
    return crashed_;
  }
  bool injected(Op op) {
    const int n = ++counts_[static_cast<int>(op)];
    if (op == fault_op_ && n == fault_at_) {
      fired_ = true;
      return true;
    }
    return false;
  }
  static int fail(int err) {
    errno = err;
    return -1;
  }
  ssize_t transfer(int fd, void* buf, size_t n, int64_t offset, bool write) {
    std::unique_lock<std::mutex> g(mu_);
    if (known(fd) == fds_.end()) {
      g.unlock();
      return write ? (offset < 0 ? FileIo::write(fd, buf, n) : FileIo::pwrite(fd, buf, n, offset))
                   : (offset < 0 ? FileIo::read(fd, buf, n) : FileIo::pread(fd, buf, n, offset));
    }
    if (write ? durable_step() : crashed_) return fail(EIO);
    const bool hit = injected(write ? Op::kWrite : Op::kRead);
    if (hit && mode_ == Mode::kErrno) return fail(err_);
    const size_t m = hit && n > 1 ? n / 2 : n;
    const ssize_t done = write ? (offset < 0 ? FileIo::write(fd, buf, m) : FileIo::pwrite(fd, buf, m, offset))
                               : (offset < 0 ? FileIo::read(fd, buf, m) : FileIo::pread(fd, buf, m, offset));
    if (hit && mode_ == Mode::kTorn) return fail(err_);
    return done;
  }
  int renamed(const char* from, const char* to, bool exchange) {
    if (!watched(from) && !watched(to)) return exchange ? FileIo::rename_exchange(from, to) : FileIo::rename(from, to);
    std::unique_lock<std::mutex> g(mu_);
    if (durable_step()) return fail(EIO);
    if (injected(Op::kRename)) return fail(err_);
    Entry e{Entry::kRename, norm(from), norm(to), parent(to), false, "", false};
    struct stat st{};
    if (!exchange && ::stat(to, &st) == 0 && S_ISREG(st.st_mode)) {
      std::ifstream in(to, std::ios::binary);
      e.old_bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      e.had_old = true;
    }
    const int rc = exchange ? FileIo::rename_exchange(from, to) : FileIo::rename(from, to);
    if (rc == 0 && !exchange) journal_.push_back(std::move(e));
    return rc;
  }

  const std::string root_;
  mutable std::mutex mu_;
  int counts_[static_cast<int>(Op::kCount)] = {};
  Op fault_op_ = Op::kCount;
  int fault_at_ = 0, err_ = EIO, crash_at_ = 0, durable_ = 0;
  Mode mode_ = Mode::kErrno;
  bool fired_ = false, crashed_ = false;
  std::map<int, std::string> fds_;
  std::map<int, ino_t> inode_;
  std::map<ino_t, off_t> durable_size_;
  std::vector<Entry> journal_;
};

}  // namespace megatrain::test
