// The kernel's FileIo (file_io.h) and the process's current one.
#include "megatrain/core/file_io.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>

namespace megatrain {
namespace {
FileIo g_kernel;
std::atomic<FileIo*> g_current{&g_kernel};
}  // namespace

int FileIo::open(const char* path, int flags, unsigned mode) { return ::open(path, flags, static_cast<mode_t>(mode)); }
ssize_t FileIo::read(int fd, void* buf, size_t n) { return ::read(fd, buf, n); }
ssize_t FileIo::pread(int fd, void* buf, size_t n, int64_t offset) { return ::pread(fd, buf, n, static_cast<off_t>(offset)); }
ssize_t FileIo::write(int fd, const void* buf, size_t n) { return ::write(fd, buf, n); }
ssize_t FileIo::pwrite(int fd, const void* buf, size_t n, int64_t offset) { return ::pwrite(fd, buf, n, static_cast<off_t>(offset)); }
int FileIo::fsync(int fd) { return ::fsync(fd); }
int FileIo::close(int fd) { return ::close(fd); }
int FileIo::rename(const char* from, const char* to) { return ::rename(from, to); }
int FileIo::rename_exchange(const char* a, const char* b) { return ::renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE); }
int FileIo::mkdir(const char* path, unsigned mode) { return ::mkdir(path, static_cast<mode_t>(mode)); }
int FileIo::unlink(const char* path) { return ::unlink(path); }
int FileIo::submitted(int rc) { return rc; }
int FileIo::completed(int, bool, int res, size_t) { return res; }

FileIo& file_io() { return *g_current.load(std::memory_order_acquire); }

ScopedFileIo::ScopedFileIo(FileIo& io) : previous_(g_current.exchange(&io)) {}
ScopedFileIo::~ScopedFileIo() { g_current.store(previous_); }

}  // namespace megatrain
