// safetensors files: a validating reader (F32/BF16/F16 to fp32, and raw bytes of any dtype checked
// against the dtype the caller expects), an atomic writer (F32/BF16/F16, and raw bytes of any dtype
// the format defines, such as U8),
// and Hugging Face checkpoint folders (model.safetensors or shards named by model.safetensors.index.json).
// The supported subset and the write protocol are in docs/data-and-checkpoints.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/core/model_spec.h"  // DType
#include "megatrain/core/status.h"
#include "megatrain/executor/bf16.h"

namespace megatrain::exec {

// Scalar conversions used by the reader and writer (round to nearest even; NaN stays NaN).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);

const char* safetensors_dtype_name(DType d);  // "F32" | "BF16" | "F16"
// The DType of a safetensors dtype string, when it is one MegaTrain computes with.
std::optional<DType> dtype_from_safetensors(std::string_view s);

// One tensor as a safetensors header describes it.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;          // as written in the file: "F32", "BF16", "F16", "I64", "U8", ...
  size_t element_bytes = 0;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0;         // data_offsets, relative to the start of the data section
  uint64_t end = 0;
};

// An open, fully validated safetensors file. open() reads and checks the header only; tensor data is
// read on demand with pread, so a 100 GB checkpoint costs no memory until a tensor is asked for.
// Move-only (owns a descriptor). Reads are const and safe from several threads at once.
class SafetensorsFile {
 public:
  // Errors: kNotFound (no file), kIoError, kCorrupt (anything the header or sizes get wrong: header
  // length beyond the file, invalid JSON, a bad field, offsets out of range, overlapping or with holes,
  // sizes != numel x dtype size, duplicate names, bytes after the last tensor), kUnsupported (a dtype
  // string the format does not define). Every message names the file.
  static Result<SafetensorsFile> open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::filesystem::path& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in data (offset) order
  const SafetensorsEntry* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }  // "__metadata__"
  uint64_t data_start() const { return data_start_; }  // 8 + header length
  uint64_t file_bytes() const { return file_bytes_; }

  // The stored bytes of `e` (an entry of this file); out_bytes must equal end - begin.
  Status read_raw(const SafetensorsEntry& e, void* out, size_t out_bytes) const;
  // Bytes [offset, offset + bytes) of `e`'s stored data (a slice of a large tensor); the range must
  // lie inside the tensor.
  Status read_raw_range(const SafetensorsEntry& e, uint64_t offset, void* out, size_t bytes) const;
  // The stored bytes of `e`, which must be of safetensors dtype `dtype` ("U8", "BF16", "F32", ...)
  // and hold exactly out_bytes bytes; otherwise kInvalidArgument naming the tensor, the file, and
  // the dtype or the byte count each side has. Nothing is converted.
  Status read_raw(const SafetensorsEntry& e, std::string_view dtype, void* out, size_t out_bytes) const;
  // The values of `e` as fp32 (F32 copied, BF16/F16 widened exactly; other dtypes kUnsupported).
  Status read_fp32(const SafetensorsEntry& e, float* out, int64_t out_numel) const;
  Result<std::vector<float>> read_fp32(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t file_bytes_ = 0;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// One tensor to write. `data` holds numel values of `source`; the file stores `stored`.
// Conversions: equal types are copied; fp32 -> bf16/fp16 round to nearest even; bf16/fp16 -> fp32.
// With raw_dtype set (a safetensors dtype string such as "U8"), `data` holds numel elements of that
// dtype, written byte for byte, and source/stored are ignored: bytes of types MegaTrain does not
// compute with (the codes of quantised optimizer states, say).
// With fetch set, data is asked for just before the tensor's bytes are written (the pointer must
// stay valid until the next fetch or the end of the write): state that lives on NVMe is paged in
// one unit at a time that way.
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  DType source = DType::kFp32;
  DType stored = DType::kFp32;
  std::string raw_dtype;
  std::function<Result<const void*>()> fetch;
  // Bytes made just before they are written, whose count is known only then (a compressed tensor):
  // raw_dtype must be "U8", and the shape is written as [the count]. max_bytes bounds the count.
  // The header is written first with room for every such tensor at its bound, then rewritten with
  // the real sizes, padded with spaces to the same length, before the file is renamed into place.
  std::function<Result<std::vector<uint8_t>>()> produce;
  uint64_t max_bytes = 0;
};

// A tensor written as raw bytes of safetensors dtype `dtype` (TensorToWrite::raw_dtype).
TensorToWrite raw_tensor(std::string name, std::vector<int64_t> shape, const void* data, std::string dtype);

// The element size of a safetensors dtype string (every dtype the format defines), or nothing.
std::optional<size_t> safetensors_element_bytes(std::string_view dtype);

// Writes `tensors` in the given order, contiguous (as the reference implementation requires), after a
// JSON header padded with spaces so the data section starts 8-byte aligned. `metadata` goes to
// "__metadata__"; "format": "pt" is added unless given, because transformers refuses safetensors
// weights without it. The bytes go to a temporary file in the same directory, then fsync, rename over
// `path`, fsync of the directory: `path` holds either its previous content or the complete new file.
// On failure the temporary file is removed and any previous file is left as it was.
Status write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// ---- MXFP4 (gpt-oss's published expert weights) -------------------------------------------------
//
// OCP Microscaling FP4 as Hugging Face transformers reads it (integrations/mxfp4.py,
// convert_moe_packed_tensors; docs/data-and-checkpoints.md "MXFP4 expert weights"): a tensor W that
// the model holds as [E, A, B] is stored as
//   W_blocks [E, B, A/32, 16] U8: two E2M1 codes per byte, the low nibble first (even index),
//   W_scales [E, B, A/32]     U8: one E8M0 exponent per block of 32 values, biased by 127,
// and W[e, 32 g + 2 j + n, r] = kMxfp4Values[nibble n of blocks[e, r, g, j]] * 2^(scales[e, r, g] - 127).
// (HF dequantises to [E, B, A] and transposes the last two axes.)
inline constexpr float kMxfp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
inline constexpr int64_t kMxfp4BlockValues = 32;
// The shapes of W_blocks and W_scales for a model tensor of shape [E, A, B], or an error when the
// shape is not 3-D or A is not a multiple of 32.
struct Mxfp4Shapes {
  std::vector<int64_t> blocks, scales;
};
Result<Mxfp4Shapes> mxfp4_shapes(const std::string& name, const std::vector<int64_t>& shape);
// Dequantises one expert: blocks [B, A/32, 16] and scales [B, A/32] into out [A, B] (fp32, exact:
// every value is m * 2^k with m in {0.5 .. 6}, which fp32 holds down to 2^-128). A scale byte of 255
// (E8M0's NaN) or a value that overflows fp32 is kInvalidArgument naming `what`, the row and the block.
Status dequantize_mxfp4_expert(const uint8_t* blocks, const uint8_t* scales, int64_t a, int64_t b, float* out,
                               const std::string& what);

// A Hugging Face checkpoint: a folder holding model.safetensors, or model.safetensors.index.json and the
// shards its weight_map names (model.safetensors wins when both exist, as in transformers). A path to
// a .safetensors file or to an index file is accepted too. All files are opened and validated by open().
// FP8 e4m3 (OCP "E4M3FN", safetensors F8_E4M3) as DeepSeek-V3 and Kimi-K2 store their linear
// weights: 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities, S.1111.111 NaN, the
// largest 448. Every value is exact in fp32.
float fp8_e4m3_to_float(uint8_t b);
// Block-scaled FP8 (DeepSeek-V3's published layout): weight W [rows, cols] stored as F8_E4M3 and
// beside it weight_scale_inv [ceil(rows / 128), ceil(cols / 128)] in F32, with
// W[i, j] = fp8(q[i, j]) * scale_inv[i / 128, j / 128] (one fp32 multiply, as transformers'
// FP8 dequantisation does). The scale's name is the weight's + "_scale_inv".
inline constexpr int64_t kFp8Block = 128;
std::string fp8_scale_name(const std::string& weight);

class HfCheckpoint {
 public:
  struct Location {
    std::filesystem::path file;
    SafetensorsEntry entry;
  };

  // Errors: kNotFound (no safetensors weights; a message says so when only pytorch_model.bin exists,
  // or a shard named by the index is missing), kCorrupt (a bad index, a tensor the index places in a
  // shard that lacks it, any shard's own corruption).
  static Result<HfCheckpoint> open(const std::filesystem::path& folder_or_file);

  const std::vector<std::filesystem::path>& files() const { return file_paths_; }
  // tensor name -> (file, entry)
  const std::map<std::string, Location>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // The index's "metadata" (values that are not strings are kept as JSON text), or the single file's.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  Result<std::vector<float>> load_fp32(const std::string& name) const;
  // Loads into `out` (numel of expected_shape floats) after checking the stored shape, so a checkpoint of
  // another model is refused with both shapes in the message (kInvalidArgument); a name the checkpoint
  // lacks is kNotFound.
  Status load_fp32(const std::string& name, const std::vector<int64_t>& expected_shape, float* out) const;

  // Whether `name` is stored in MXFP4 (the checkpoint holds name + "_blocks" or name + "_scales").
  bool has_mxfp4(const std::string& name) const;
  // Dequantises name + "_blocks" / name + "_scales" into `out` (the [E, A, B] fp32 tensor the model
  // holds), one expert at a time, so a 120B checkpoint costs one expert's bytes of buffer. Errors
  // (kInvalidArgument unless said): one of the two is missing (kNotFound, naming it), a dtype other
  // than U8, a shape other than mxfp4_shapes(expected_shape) (naming the tensor, the shape found and
  // the shape expected), A not a multiple of 32, a scale of 255 or a value that overflows.
  Status load_mxfp4_fp32(const std::string& name, const std::vector<int64_t>& expected_shape, float* out) const;

  // Whether `name` is stored as block-scaled FP8 (F8_E4M3, with fp8_scale_name(name) beside it).
  bool has_fp8_blocks(const std::string& name) const;
  // Dequantises `name` into `out` (expected_shape, rank 2), 128 rows at a time, so a layer of a
  // 671B checkpoint costs 128 rows of buffer. Errors (kInvalidArgument): the weight not F8_E4M3 or
  // not of expected_shape, the scale missing (kNotFound), not F32 or not [ceil(rows/128),
  // ceil(cols/128)], a NaN code (0x7F, 0xFF) or a scale that is not finite, naming tensor and block.
  Status load_fp8_blocks_fp32(const std::string& name, const std::vector<int64_t>& expected_shape, float* out) const;

 private:
  std::vector<std::filesystem::path> file_paths_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, Location> tensors_;
  std::map<std::string, size_t> file_of_;  // tensor name -> position in files_
  std::map<std::string, std::string> metadata_;
};

}  // namespace megatrain::exec
