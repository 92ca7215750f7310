// The profiler's storage probe: O_DIRECT writes then reads of a temp file through io_uring, at each
// block size and queue depth, as the NVMe tier issues them. The temp file is unlinked as soon as it is
// open, so it disappears whatever happens to the process.
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "detail/profile_probes.h"
#include "megatrain/core/units.h"

namespace megatrain::planner {
namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// Owns the O_DIRECT fd of an already-unlinked temp file.
struct TempFile {
  int fd = -1;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
  }
};

// Creates, opens with O_DIRECT and immediately unlinks a temp file in `dir`.
Result<int> open_direct_temp(const std::string& dir) {
  struct stat st{};
  if (::stat(dir.c_str(), &st) != 0)
    return not_found("--storage " + dir + ": " + errno_text(errno) + "; expected an existing, writable directory on the drive to measure");
  if (!S_ISDIR(st.st_mode))
    return invalid_argument("--storage " + dir + ": not a directory; expected an existing, writable directory on the drive to measure");
  struct statvfs vfs{};
  if (::statvfs(dir.c_str(), &vfs) == 0 && (vfs.f_flag & ST_RDONLY))
    return io_error("--storage " + dir + ": the file system is mounted read-only; expected a writable directory");
  std::random_device rd;
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::ostringstream name;
    name << dir << (dir.empty() || dir.back() != '/' ? "/" : "") << ".megatrain-profile-" << ::getpid() << "-" << std::hex
         << rd() << ".tmp";
    const std::string path = name.str();
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::unlink(path.c_str());
      return fd;
    }
    const int e = errno;
    if (e == EEXIST) continue;
    if (e == EINVAL) {
      // O_DIRECT refused (tmpfs on older kernels, some FUSE file systems). The kernel may have created
      // the file before refusing the flag; the name is ours (O_EXCL), so remove it.
      ::unlink(path.c_str());
      return unsupported("--storage " + dir + ": the file system does not support O_DIRECT (" + errno_text(e) +
                         "); expected a directory on a block device (ext4, xfs), not tmpfs");
    }
    if (e == EACCES || e == EPERM || e == EROFS)
      return io_error("--storage " + dir + ": cannot create a file there: " + errno_text(e) + "; expected a writable directory");
    return io_error("--storage " + dir + ": cannot create an O_DIRECT temp file: " + errno_text(e));
  }
  return io_error("--storage " + dir + ": could not pick an unused temp file name after 16 attempts");
}

// The mount holding `dir`: the /proc/mounts entry with the longest mount point that prefixes it.
void find_mount(const std::string& dir, std::string& device, std::string& fs_type, std::string& mount) {
  std::error_code ec;
  const std::string real = std::filesystem::weakly_canonical(dir, ec).string();
  std::ifstream in("/proc/mounts");
  std::string dev, mnt, type, rest;
  size_t best = 0;
  while (in >> dev >> mnt >> type && std::getline(in, rest)) {
    const bool prefix = real == mnt || (real.rfind(mnt, 0) == 0 && (mnt == "/" || real[mnt.size()] == '/'));
    if (prefix && mnt.size() >= best) {
      best = mnt.size();
      device = dev;
      fs_type = type;
      mount = mnt;
    }
  }
  if (device.empty()) {
    device = "unknown device";
    fs_type = "unknown fs";
    mount = real.empty() ? dir : real;
  }
}

// Writes or reads `total` bytes sequentially in `block`-byte requests with `depth` in flight, starting
// at offset 0 and wrapping at file_bytes; stops early once `max_s` passed and 32 MiB were done.
// Returns bytes per second.
Result<double> run_io(int fd, bool write, int64_t block, int64_t depth, int64_t file_bytes, int64_t total, double max_s,
                      unsigned char* buf, const std::string& dir) {
  io_uring ring{};
  const int rc = io_uring_queue_init(static_cast<unsigned>(depth), &ring, 0);
  if (rc < 0) return io_error("--storage " + dir + ": io_uring_queue_init(" + std::to_string(depth) + "): " + errno_text(-rc));
  struct RingGuard {
    io_uring* r;
    ~RingGuard() { io_uring_queue_exit(r); }
  } guard{&ring};
  const int64_t requests = std::max<int64_t>(1, total / block);
  int64_t issued = 0, completed = 0, inflight = 0;
  const auto t0 = Clock::now();
  bool stop_issuing = false;
  while (completed < issued || (!stop_issuing && issued < requests)) {
    while (!stop_issuing && issued < requests && inflight < depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (!sqe) break;
      const int64_t off = (issued * block) % file_bytes;
      unsigned char* slot = buf + (issued % depth) * block;
      if (write) io_uring_prep_write(sqe, fd, slot, static_cast<unsigned>(block), static_cast<uint64_t>(off));
      else io_uring_prep_read(sqe, fd, slot, static_cast<unsigned>(block), static_cast<uint64_t>(off));
      ++issued;
      ++inflight;
    }
    const int sub = io_uring_submit(&ring);
    if (sub < 0) return io_error("--storage " + dir + ": io_uring_submit: " + errno_text(-sub));
    io_uring_cqe* cqe = nullptr;
    const int w = io_uring_wait_cqe(&ring, &cqe);
    if (w < 0) return io_error("--storage " + dir + ": io_uring_wait_cqe: " + errno_text(-w));
    const int res = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
    --inflight;
    ++completed;
    if (res < 0)
      return io_error("--storage " + dir + ": O_DIRECT " + (write ? "write" : "read") + " of " + std::to_string(block) +
                      " bytes: " + errno_text(-res) + (res == -ENOSPC ? "; free some space or pass another directory" : ""));
    if (res != block)
      return io_error("--storage " + dir + ": short O_DIRECT " + std::string(write ? "write" : "read") + ": " +
                      std::to_string(res) + " of " + std::to_string(block) + " bytes");
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!stop_issuing && dt > max_s && completed * block >= (32ll << 20)) stop_issuing = true;
  }
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  return static_cast<double>(completed * block) / dt;
}

}  // namespace

Status check_storage_dir(const std::string& dir) {
  if (dir.empty()) return invalid_argument("--storage: empty directory name; expected an existing, writable directory");
  MT_ASSIGN_OR_RETURN(const int fd, open_direct_temp(dir));
  ::close(fd);
  return {};
}

namespace detail {

Result<StorageResult> measure_storage(const std::string& dir, const ProfileSizes& sizes, const Progress& progress) {
  for (int64_t b : sizes.storage_blocks)
    if (b <= 0 || b % 4096 != 0)
      return invalid_argument("storage block size " + std::to_string(b) + ": expected a positive multiple of 4096 bytes (O_DIRECT)");
  if (sizes.storage_blocks.empty() || sizes.storage_depths.empty())
    return invalid_argument("storage probe: needs at least one block size and one queue depth");
  int64_t max_block = 0, max_depth = 0;
  for (int64_t b : sizes.storage_blocks) max_block = std::max(max_block, b);
  for (int64_t d : sizes.storage_depths) {
    if (d < 1 || d > 4096) return invalid_argument("storage queue depth " + std::to_string(d) + ": expected 1 .. 4096");
    max_depth = std::max(max_depth, d);
  }
  const int64_t file_bytes = std::max(max_block * max_depth, sizes.storage_file_bytes / max_block * max_block);

  StorageResult out;
  find_mount(dir, out.device, out.fs_type, out.mount);
  struct statvfs vfs{};
  if (::statvfs(dir.c_str(), &vfs) != 0) return io_error("--storage " + dir + ": statvfs: " + errno_text(errno));
  const double avail = static_cast<double>(vfs.f_bavail) * static_cast<double>(vfs.f_frsize);
  const double total = static_cast<double>(vfs.f_blocks) * static_cast<double>(vfs.f_frsize);
  if (avail < 2.0 * static_cast<double>(file_bytes))
    return resource_exhausted("--storage " + dir + ": " + format_bytes(avail) + " free, the probe needs a " +
                              format_bytes(static_cast<double>(file_bytes)) + " temp file and as much again spare");

  TempFile f;
  MT_ASSIGN_OR_RETURN(f.fd, open_direct_temp(dir));
  if (const int e = ::posix_fallocate(f.fd, 0, file_bytes); e != 0)
    return io_error("--storage " + dir + ": cannot allocate a " + format_bytes(static_cast<double>(file_bytes)) +
                    " temp file: " + errno_text(e));
  void* raw = nullptr;
  const size_t buf_bytes = static_cast<size_t>(max_block * max_depth);
  if (posix_memalign(&raw, 4096, buf_bytes) != 0) return resource_exhausted("storage probe: cannot allocate an aligned buffer");
  std::unique_ptr<unsigned char, decltype(&std::free)> buf(static_cast<unsigned char*>(raw), &std::free);
  // Incompressible data, so a drive or file system that compresses cannot flatter the figures.
  std::mt19937_64 gen(12345);
  for (size_t i = 0; i + 8 <= buf_bytes; i += 8) {
    const uint64_t r = gen();
    std::memcpy(buf.get() + i, &r, 8);
  }

  // Fill the whole file first: reads of never-written (unwritten-extent) blocks return zeros without
  // touching the drive, and the write points then measure overwrites, as the tier's steady state does.
  if (progress) progress("fill " + format_bytes(static_cast<double>(file_bytes)));
  const int64_t fill_block = std::min<int64_t>(max_block, 4ll << 20);
  MT_ASSIGN_OR_RETURN(double fill_rate, run_io(f.fd, true, fill_block, std::min<int64_t>(max_depth, 16), file_bytes,
                                               file_bytes, 1e9, buf.get(), dir));
  (void)fill_rate;
  if (::fdatasync(f.fd) != 0) return io_error("--storage " + dir + ": fdatasync: " + errno_text(errno));

  std::vector<int64_t> blocks = sizes.storage_blocks, depths = sizes.storage_depths;
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  std::sort(depths.begin(), depths.end());
  depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
  for (bool write : {true, false}) {
    for (int64_t b : blocks) {
      for (int64_t d : depths) {
        if (progress)
          progress(std::string(write ? "write " : "read ") + format_bytes(static_cast<double>(b)) + " QD" + std::to_string(d));
        MT_ASSIGN_OR_RETURN(double rate, run_io(f.fd, write, b, d, file_bytes, file_bytes, sizes.storage_point_max_s,
                                                buf.get(), dir));
        (write ? out.spec.write : out.spec.read).push_back({b, d, rate});
      }
    }
    if (write && ::fdatasync(f.fd) != 0) return io_error("--storage " + dir + ": fdatasync: " + errno_text(errno));
  }
  std::error_code ec;
  out.spec.path = std::filesystem::weakly_canonical(dir, ec).string();
  if (out.spec.path.empty()) out.spec.path = dir;
  out.spec.name = out.device + " (" + out.fs_type + " at " + out.mount + "; " + out.spec.path + ")";
  out.spec.capacity_bytes.value = avail;
  out.spec.capacity_bytes.provenance.source =
      "statvfs(" + out.spec.path + "): space free to this user (f_bavail x f_frsize) at profile time, of " + format_bytes(total) +
      " in the file system";
  return out;
}

}  // namespace detail
}  // namespace megatrain::planner
