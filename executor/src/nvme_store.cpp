// The NVMe tier's storage engine: O_DIRECT files striped over directories, whole-region transfers
// through io_uring (or a pread/pwrite thread pool where io_uring is unavailable), XXH64 per block.
#include "megatrain/executor/nvme_store.h"
#include "megatrain/core/file_io.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>
#include <thread>

#include "megatrain/core/plan.h"
#include "megatrain/core/units.h"
#include "megatrain/executor/checkpoint.h"

namespace megatrain::exec {
namespace {

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// One block of one transfer: where it lives and where its bytes go.
struct BlockIo {
  int64_t logical = 0;  // logical block number (the checksum's seed)
  int file = 0;
  int64_t offset = 0;   // in the file
  char* buf = nullptr;
};

}  // namespace

struct NvmeStore::Impl {
  NvmeStoreOptions opt;
  std::vector<std::filesystem::path> paths;
  std::vector<int> fds;
  std::vector<int64_t> file_size;
  std::vector<int64_t> bytes, first_block, blocks;  // per region
  int64_t total_blocks = 0;
  // Per logical block: 0 never written (reads as zeros), 1 written with checksum sums[k]. A block
  // belongs to one region, and a region is never read and written at once (the caller's rule), so
  // distinct threads touch distinct elements.
  std::vector<uint8_t> written;
  std::vector<uint64_t> sums;
  bool uring = true;
  std::string fallback_reason;
  std::mutex ring_mu;
  std::vector<std::unique_ptr<io_uring>> rings;  // idle rings, one taken per transfer

  ~Impl() {
    for (auto& r : rings) io_uring_queue_exit(r.get());
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i] >= 0) file_io().close(fds[i]);
      std::error_code ec;
      std::filesystem::remove(paths[i], ec);
    }
  }

  std::vector<BlockIo> layout(int64_t r, const void* buf) const {
    std::vector<BlockIo> v(static_cast<size_t>(blocks[static_cast<size_t>(r)]));
    const int64_t D = static_cast<int64_t>(fds.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const int64_t k = first_block[static_cast<size_t>(r)] + static_cast<int64_t>(i);
      v[i] = {k, static_cast<int>(k % D), (k / D) * opt.block_bytes,
              static_cast<char*>(const_cast<void*>(buf)) + static_cast<int64_t>(i) * opt.block_bytes};
    }
    return v;
  }

  std::string where(const BlockIo& b, int64_t r) const {
    return "'" + paths[static_cast<size_t>(b.file)].string() + "' at byte " + std::to_string(b.offset) + " (region " +
           std::to_string(r) + ", block " + std::to_string(b.logical) + ")";
  }

  Result<std::unique_ptr<io_uring>> take_ring() {
    {
      std::lock_guard<std::mutex> g(ring_mu);
      if (!rings.empty()) {
        auto r = std::move(rings.back());
        rings.pop_back();
        return r;
      }
    }
    auto ring = std::make_unique<io_uring>();
    const int rc = io_uring_queue_init(static_cast<unsigned>(std::max(1, opt.queue_depth)), ring.get(), 0);
    if (rc < 0) return io_error("io_uring_queue_init failed: " + errno_text(-rc));
    return ring;
  }
  void give_ring(std::unique_ptr<io_uring> r) {
    std::lock_guard<std::mutex> g(ring_mu);
    rings.push_back(std::move(r));
  }

  // Runs the blocks' reads or writes with up to queue_depth in flight; `done(i)` is checked per
  // block. A short transfer is an error: the files were sized at create().
  Status transfer_uring(std::vector<BlockIo>& io, bool write, int64_t r) {
    MT_ASSIGN_OR_RETURN(std::unique_ptr<io_uring> ring, take_ring());
    const int qd = std::max(1, opt.queue_depth);
    size_t next = 0, completed = 0;
    int in_flight = 0;
    Status failure;
    const unsigned len = static_cast<unsigned>(opt.block_bytes);
    while (completed < io.size()) {
      while (failure.ok() && in_flight < qd && next < io.size()) {
        io_uring_sqe* sqe = io_uring_get_sqe(ring.get());
        if (!sqe) break;
        const BlockIo& b = io[next];
        if (write)
          io_uring_prep_write(sqe, fds[static_cast<size_t>(b.file)], b.buf, len, static_cast<__u64>(b.offset));
        else
          io_uring_prep_read(sqe, fds[static_cast<size_t>(b.file)], b.buf, len, static_cast<__u64>(b.offset));
        io_uring_sqe_set_data64(sqe, next);
        ++next;
        ++in_flight;
      }
      if (in_flight == 0) break;  // a failure stopped the submissions and everything is reaped
      const int sub = file_io().submitted(io_uring_submit_and_wait(ring.get(), 1));
      if (sub < 0 && sub != -EINTR) {
        failure = io_error("io_uring_submit failed: " + errno_text(-sub));
        // The kernel may still be using the caller's buffer for requests already submitted: reap
        // them before returning (io_uring_wait_cqe does not submit).
        while (in_flight > 0) {
          io_uring_cqe* c = nullptr;
          if (io_uring_wait_cqe(ring.get(), &c) < 0) break;
          io_uring_cqe_seen(ring.get(), c);
          --in_flight;
        }
        break;  // the ring's state is unknown: do not reuse it
      }
      io_uring_cqe* cqe = nullptr;
      unsigned head = 0, seen = 0;
      io_uring_for_each_cqe(ring.get(), head, cqe) {
        const BlockIo& b = io[static_cast<size_t>(io_uring_cqe_get_data64(cqe))];
        const int res = file_io().completed(fds[static_cast<size_t>(b.file)], write, cqe->res, len);
        if (failure.ok()) {
          if (res < 0)
            failure = (-res == ENOSPC || -res == EFBIG || -res == EDQUOT)
                          ? resource_exhausted(std::string(write ? "writing " : "reading ") + where(b, r) + ": " + errno_text(-res) +
                                               "; the drive is full")
                          : io_error(std::string(write ? "writing " : "reading ") + where(b, r) + ": " + errno_text(-res));
          else if (res != static_cast<int>(len))
            failure = write ? io_error("short write of " + where(b, r) + ": " + std::to_string(res) + " of " + std::to_string(len) +
                                       " bytes (disk full, or the file was truncated)")
                            : corrupt("short read of " + where(b, r) + ": " + std::to_string(res) + " of " + std::to_string(len) +
                                      " bytes; the file was truncated");
        }
        ++seen;
        --in_flight;
        ++completed;
      }
      io_uring_cq_advance(ring.get(), seen);
      if (!failure.ok() && in_flight == 0) break;
    }
    if (failure.ok() || in_flight == 0)
      give_ring(std::move(ring));
    else
      io_uring_queue_exit(ring.get());
    return failure;
  }

  Status transfer_pool(std::vector<BlockIo>& io, bool write, int64_t r) {
    const int threads = static_cast<int>(std::clamp<int64_t>(opt.queue_depth, 1, std::min<int64_t>(8, static_cast<int64_t>(io.size()))));
    std::atomic<size_t> next{0};
    std::mutex mu;
    Status failure;
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < io.size();) {
        const BlockIo& b = io[i];
        int64_t done = 0;
        int err = 0;
        while (done < opt.block_bytes) {
          const ssize_t n = write ? file_io().pwrite(fds[static_cast<size_t>(b.file)], b.buf + done, static_cast<size_t>(opt.block_bytes - done), b.offset + done)
                                  : file_io().pread(fds[static_cast<size_t>(b.file)], b.buf + done, static_cast<size_t>(opt.block_bytes - done), b.offset + done);
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) err = errno;
          if (n <= 0) break;
          done += n;
        }
        if (done == opt.block_bytes) continue;
        Status s = err == ENOSPC || err == EFBIG || err == EDQUOT
                       ? resource_exhausted(std::string(write ? "writing " : "reading ") + where(b, r) + ": " + errno_text(err) + "; the drive is full")
                   : err ? io_error(std::string(write ? "writing " : "reading ") + where(b, r) + ": " + errno_text(err))
                   : write ? io_error("short write of " + where(b, r) + " (disk full, or the file was truncated)")
                           : corrupt("short read of " + where(b, r) + ": " + std::to_string(done) + " of " +
                                     std::to_string(opt.block_bytes) + " bytes; the file was truncated");
        std::lock_guard<std::mutex> g(mu);
        if (failure.ok()) failure = std::move(s);
        next = io.size();
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    return failure;
  }

  Status transfer(std::vector<BlockIo>& io, bool write, int64_t r) {
    if (io.empty()) return {};
    return uring ? transfer_uring(io, write, r) : transfer_pool(io, write, r);
  }
};

namespace {

Status check_dir(const std::filesystem::path& dir) {
  const std::string d = "NVMe directory '" + dir.string() + "'";
  struct stat st{};
  if (::stat(dir.c_str(), &st) != 0)
    return not_found(d + ": " + errno_text(errno) + "; accepted: an existing, writable directory on a local drive (ext4, xfs)");
  if (!S_ISDIR(st.st_mode)) return invalid_argument(d + " is not a directory; accepted: an existing, writable directory");
  struct statvfs vfs{};
  if (::statvfs(dir.c_str(), &vfs) == 0 && (vfs.f_flag & ST_RDONLY))
    return io_error(d + " is on a read-only file system; accepted: a writable directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return io_error(d + " is not writable: " + errno_text(errno) + "; accepted: a writable directory");
  return {};
}

}  // namespace

Result<std::unique_ptr<NvmeStore>> NvmeStore::create(const NvmeStoreOptions& options, const std::vector<int64_t>& region_bytes) {
  if (options.dirs.empty()) return invalid_argument("the NVMe store needs at least one directory (placement.nvme_dirs)");
  if (options.block_bytes <= 0 || options.block_bytes % kNvmeAlignment != 0 || options.block_bytes > (int64_t{1} << 30))
    return invalid_argument("NVMe block size " + std::to_string(options.block_bytes) + " bytes; accepted: a multiple of " +
                            std::to_string(kNvmeAlignment) + " up to 1 GiB");
  if (options.queue_depth < 1 || options.queue_depth > 4096)
    return invalid_argument("NVMe queue depth " + std::to_string(options.queue_depth) + "; accepted: 1 to 4096");
  for (const auto& d : options.dirs) MT_RETURN_IF_ERROR(check_dir(d));
  // A file-size limit (RLIMIT_FSIZE) must be an error we report, not a SIGXFSZ that kills the run.
  struct sigaction old{};
  if (::sigaction(SIGXFSZ, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) std::signal(SIGXFSZ, SIG_IGN);

  auto impl = std::make_unique<Impl>();
  Impl& I = *impl;
  I.opt = options;
  for (int64_t b : region_bytes) {
    if (b < 0) return invalid_argument("NVMe region of negative size " + std::to_string(b));
    I.bytes.push_back(b);
    I.first_block.push_back(I.total_blocks);
    const int64_t n = nvme_region_blocks(b, options.block_bytes);
    I.blocks.push_back(n);
    I.total_blocks += n;
  }
  I.written.assign(static_cast<size_t>(I.total_blocks), 0);
  I.sums.assign(static_cast<size_t>(I.total_blocks), 0);
  const int64_t D = static_cast<int64_t>(options.dirs.size());
  // Directories on one file system share its free space: check the sum of their files per device.
  std::vector<std::pair<dev_t, int64_t>> need_per_dev;
  for (int64_t f = 0; f < D; ++f) {
    const int64_t nblocks = I.total_blocks > f ? (I.total_blocks - f + D - 1) / D : 0;
    I.file_size.push_back(nblocks * options.block_bytes);
  }
  for (int64_t f = 0; f < D; ++f) {
    const auto& dir = options.dirs[static_cast<size_t>(f)];
    struct stat st{};
    ::stat(dir.c_str(), &st);
    int64_t need = 0;
    for (int64_t g = 0; g < D; ++g) {
      struct stat sg{};
      ::stat(options.dirs[static_cast<size_t>(g)].c_str(), &sg);
      if (sg.st_dev == st.st_dev) need += I.file_size[static_cast<size_t>(g)];
    }
    struct statvfs vfs{};
    if (::statvfs(dir.c_str(), &vfs) == 0) {
      const double avail = static_cast<double>(vfs.f_bavail) * static_cast<double>(vfs.f_frsize);
      if (static_cast<double>(need) > avail)
        return resource_exhausted("NVMe directory '" + dir.string() + "' has " + format_bytes(avail) + " (" +
                                  std::to_string(static_cast<int64_t>(avail)) + " bytes) free, but the state placed there needs " +
                                  format_bytes(static_cast<double>(need)) + " (" + std::to_string(need) +
                                  " bytes); accepted: a drive with that much free space, more directories in placement.nvme_dirs, "
                                  "or a plan that keeps less on NVMe");
    }
  }
  for (int64_t f = 0; f < D; ++f) {
    const auto& dir = options.dirs[static_cast<size_t>(f)];
    // pid and a process-wide counter: two stores never share a file (O_EXCL makes sure).
    static std::atomic<uint64_t> serial{0};
    std::filesystem::path path;
    int fd = -1;
    for (int attempt = 0; attempt < 64 && fd < 0; ++attempt) {
      path = dir / (options.file_prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(serial.fetch_add(1)) + "-" +
                    std::to_string(f) + ".bin");
      fd = file_io().open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
      if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) {
      const int e = errno;
      if (e == EINVAL) {
        file_io().unlink(path.c_str());
        return unsupported("NVMe directory '" + dir.string() + "': its file system does not support O_DIRECT (" + errno_text(e) +
                           "); accepted: a directory on a local drive (ext4, xfs)");
      }
      return io_error("NVMe directory '" + dir.string() + "': cannot create '" + path.string() + "': " + errno_text(e) +
                      (e == EROFS ? "; the file system is read-only" : "") + "; accepted: a writable directory");
    }
    I.paths.push_back(path);
    I.fds.push_back(fd);
    const int64_t size = I.file_size[static_cast<size_t>(f)];
    if (size == 0) continue;
    int rc = ::posix_fallocate(fd, 0, size);
    if (rc == EOPNOTSUPP || rc == EINVAL) rc = ::ftruncate(fd, size) == 0 ? 0 : errno;
    if (rc != 0)
      return rc == ENOSPC || rc == EFBIG || rc == EDQUOT
                 ? resource_exhausted("NVMe directory '" + dir.string() + "': cannot reserve " + format_bytes(static_cast<double>(size)) +
                                      " (" + std::to_string(size) + " bytes) for '" + path.string() + "': " + errno_text(rc) +
                                      (rc == EFBIG ? " (a file-size limit, RLIMIT_FSIZE); accepted: a limit above that size (ulimit -f)"
                                                   : " (the drive is full); accepted: a drive with that much free space"))
                 : io_error("NVMe directory '" + dir.string() + "': cannot reserve space for '" + path.string() + "': " + errno_text(rc));
  }
  if (options.force_thread_pool) {
    I.uring = false;
    I.fallback_reason = "asked for";
  } else {
    auto ring = I.take_ring();
    if (!ring.ok()) {
      I.uring = false;
      I.fallback_reason = "io_uring unavailable: " + ring.status().message();
    } else {
      I.give_ring(std::move(*ring));
    }
  }
  return std::unique_ptr<NvmeStore>(new NvmeStore(std::move(impl)));
}

NvmeStore::NvmeStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NvmeStore::~NvmeStore() = default;

int64_t NvmeStore::regions() const { return static_cast<int64_t>(impl_->bytes.size()); }
int64_t NvmeStore::region_bytes(int64_t r) const { return impl_->bytes.at(static_cast<size_t>(r)); }
int64_t NvmeStore::region_capacity(int64_t r) const { return impl_->blocks.at(static_cast<size_t>(r)) * impl_->opt.block_bytes; }
int64_t NvmeStore::block_bytes() const { return impl_->opt.block_bytes; }
int NvmeStore::queue_depth() const { return impl_->opt.queue_depth; }
int64_t NvmeStore::total_bytes() const { return impl_->total_blocks * impl_->opt.block_bytes; }
const std::vector<std::filesystem::path>& NvmeStore::files() const { return impl_->paths; }
bool NvmeStore::uses_io_uring() const { return impl_->uring; }
std::string NvmeStore::engine() const {
  if (impl_->uring) return "io_uring, queue depth " + std::to_string(impl_->opt.queue_depth);
  const int threads = static_cast<int>(std::clamp(impl_->opt.queue_depth, 1, 8));
  return "thread pool (pread/pwrite, " + std::to_string(threads) + " threads): " + impl_->fallback_reason;
}

Status NvmeStore::read(int64_t r, void* buf) {
  Impl& I = *impl_;
  if (r < 0 || r >= regions()) return invalid_argument("NVMe region " + std::to_string(r) + " does not exist");
  if (reinterpret_cast<uintptr_t>(buf) % kNvmeAlignment != 0)
    return invalid_argument("NVMe read of region " + std::to_string(r) + " into a buffer not aligned to 4096 bytes");
  std::vector<BlockIo> all = I.layout(r, buf), io;
  for (const BlockIo& b : all) {
    if (I.written[static_cast<size_t>(b.logical)])
      io.push_back(b);
    else
      std::memset(b.buf, 0, static_cast<size_t>(I.opt.block_bytes));
  }
  MT_RETURN_IF_ERROR(I.transfer(io, false, r));
  for (const BlockIo& b : io)
    if (xxh64(b.buf, static_cast<size_t>(I.opt.block_bytes), static_cast<uint64_t>(b.logical)) != I.sums[static_cast<size_t>(b.logical)])
      return corrupt("NVMe state file " + I.where(b, r) + " fails its checksum: the block on the drive is not the one written "
                     "(corrupted, torn or overwritten); the training state is damaged, resume from the last checkpoint");
  return {};
}

Status NvmeStore::write(int64_t r, const void* buf) {
  Impl& I = *impl_;
  if (r < 0 || r >= regions()) return invalid_argument("NVMe region " + std::to_string(r) + " does not exist");
  if (reinterpret_cast<uintptr_t>(buf) % kNvmeAlignment != 0)
    return invalid_argument("NVMe write of region " + std::to_string(r) + " from a buffer not aligned to 4096 bytes");
  std::vector<BlockIo> io = I.layout(r, buf);
  // Until the write completes the blocks count as damaged: a failed or torn write never reads as good.
  for (const BlockIo& b : io) {
    I.sums[static_cast<size_t>(b.logical)] = xxh64(b.buf, static_cast<size_t>(I.opt.block_bytes), static_cast<uint64_t>(b.logical));
    I.written[static_cast<size_t>(b.logical)] = 1;
  }
  return I.transfer(io, true, r);
}

void NvmeStore::reset(int64_t r) {
  Impl& I = *impl_;
  if (r < 0 || r >= regions()) return;
  for (int64_t k = 0; k < I.blocks[static_cast<size_t>(r)]; ++k) I.written[static_cast<size_t>(I.first_block[static_cast<size_t>(r)] + k)] = 0;
}

}  // namespace megatrain::exec
