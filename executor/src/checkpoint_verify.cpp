// Verification of a step directory: its manifest (written with an XXH64 trailer over its own bytes,
// parsed strictly) and the checks every file passes before a load touches the training state; see
// detail/checkpoint_verify.h.
#include "detail/checkpoint_verify.h"

#include <cstring>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>

#include "detail/checkpoint_hash.h"
#include "detail/optimizer_file.h"

namespace megatrain::exec::detail {
namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

namespace {

// The manifest ends with this key; its value is the XXH64 of every byte before the comma.
constexpr const char* kTrailer = ",\n  \"manifest_xxh64\": \"";
constexpr uint64_t kMaxManifestBytes = uint64_t{256} << 20;

Json manifest_json(const CheckpointInfo& info, const std::map<std::string, FileDigest>& files, const std::string& created) {
  Json j = Json::object();
  j["schema"] = kCheckpointSchema;
  j["step"] = info.next_step;
  j["skipped_steps"] = info.skipped_steps;
  j["created"] = created;
  j["model"] = {{"name", info.model_name}, {"parameters", info.parameters}};
  Json jf = Json::object();
  for (const auto& [name, d] : files) jf[name] = {{"bytes", d.bytes}, {"xxh64", hex64(d.xxh64)}};
  j["files"] = std::move(jf);
  if (info.optimizer_shards > 1) j["optimizer_shards"] = info.optimizer_shards;
  const DataPosition& dp = info.data;
  j["data"] = {{"next_step", info.next_step}, {"next_micro_batch", 0},   {"seq_len", dp.seq_len},
               {"micro_batch", dp.micro_batch}, {"grad_accum", dp.grad_accum}, {"order", dp.order},
               {"seed", dp.seed}, {"source", dp.source}, {"tokens", dp.tokens}};
  if (!dp.fingerprint.empty()) j["data"]["fingerprint"] = dp.fingerprint;
  j["rng"] = {{"seed", info.seed}};
  j["losses"] = {{"first_step", info.losses_first_step}, {"values", info.losses}};
  j["plan"] = info.plan_json.empty() ? Json(nullptr) : Json::parse(info.plan_json);
  return j;
}

Result<CheckpointInfo> parse_manifest(const fs::path& dir) {
  const fs::path mpath = dir / kManifestFile;
  auto text = read_small_file(mpath, kMaxManifestBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound)
      return corrupt("'" + mpath.string() + "' is missing; '" + dir.string() + "' is not a complete checkpoint");
    return text.status();
  }
  const std::string& t = *text;
  const std::string where = "'" + mpath.string() + "': ";
  const size_t at = t.rfind(kTrailer);
  const std::string tail_end = "\"\n}\n";
  const size_t trailer_len = std::strlen(kTrailer);
  if (at == std::string::npos || t.size() != at + trailer_len + 16 + tail_end.size() ||
      t.compare(at + trailer_len + 16, tail_end.size(), tail_end) != 0)
    return corrupt(where + "the checksum trailer (\"manifest_xxh64\") is missing or damaged; the file is truncated or altered");
  const std::string stored = t.substr(at + trailer_len, 16);
  const std::string computed = hex64(xxh64(t.data(), at));
  if (stored != computed)
    return corrupt(where + "checksum mismatch: the content hashes to " + computed + ", the manifest says " + stored +
                   "; the file was altered or damaged");
  Json j;
  try {
    j = Json::parse(t);
  } catch (const Json::exception& e) {
    return corrupt(where + "not valid JSON (" + std::string(e.what()) + ")");
  }
  const std::string schema = j.value("schema", std::string());
  if (schema != kCheckpointSchema) {
    if (schema.rfind("megatrain.checkpoint/", 0) == 0)
      return unsupported(where + "schema '" + schema + "' is not supported; accepted: " + kCheckpointSchema);
    return corrupt(where + "schema '" + schema + "' is not " + kCheckpointSchema);
  }
  CheckpointInfo info;
  int64_t data_step = -1;
  try {
    info.next_step = j.at("step").get<int64_t>();
    info.skipped_steps = j.value("skipped_steps", int64_t{0});  // checkpoints before the key had none
    info.created = j.value("created", std::string());
    info.model_name = j.at("model").at("name").get<std::string>();
    info.parameters = j.at("model").at("parameters").get<int64_t>();
    const Json& d = j.at("data");
    data_step = d.at("next_step").get<int64_t>();
    if (d.at("next_micro_batch").get<int64_t>() != 0)
      return corrupt(where + "data.next_micro_batch is not 0; checkpoints are taken between steps");
    info.data = DataPosition{d.at("seq_len").get<int64_t>(),
                             d.at("micro_batch").get<int64_t>(), d.at("grad_accum").get<int64_t>(),
                             d.at("order").get<std::string>(), d.at("seed").get<uint64_t>(),
                             d.at("source").get<std::string>(), d.at("tokens").get<int64_t>(),
                             d.value("fingerprint", std::string())};  // checkpoints before the key have none
    info.seed = j.at("rng").at("seed").get<uint64_t>();
    if (j.contains("losses")) {
      info.losses_first_step = j["losses"].at("first_step").get<int64_t>();
      for (const Json& v : j["losses"].at("values"))
        info.losses.push_back(v.is_null() ? std::numeric_limits<double>::quiet_NaN() : v.get<double>());
    }
    if (!j.at("plan").is_null()) info.plan_json = j["plan"].dump(2);
    info.optimizer_shards = j.value("optimizer_shards", int64_t{1});  // absent: one optimizer file
    if (info.optimizer_shards < 1 || info.optimizer_shards > 65536)
      return corrupt(where + "optimizer_shards " + std::to_string(info.optimizer_shards) + " is not between 1 and 65536");
    j.at("files").at(kModelFile);  // required, with every optimizer file
    for (int64_t k = 0; k < info.optimizer_shards; ++k) j.at("files").at(optimizer_file_name(k, info.optimizer_shards));
    for (auto it = j.at("files").begin(); it != j.at("files").end(); ++it) {
      const Json& e = it.value();
      e.at("bytes").get<uint64_t>();
      const std::string h = e.at("xxh64").get<std::string>();
      if (h.size() != 16 || h.find_first_not_of("0123456789abcdef") != std::string::npos)
        return corrupt(where + "files." + it.key() + ".xxh64 is not 16 lower-case hex digits");
      if (it.key().find('/') != std::string::npos || it.key() == "." || it.key() == "..")
        return corrupt(where + "files: '" + it.key() + "' is not a file name");
    }
  } catch (const Json::exception& e) {
    return corrupt(where + "a required field is missing or has the wrong type (" + std::string(e.what()) + ")");
  }
  if (info.skipped_steps < 0 || info.skipped_steps > info.next_step)
    return corrupt(where + "skipped_steps " + std::to_string(info.skipped_steps) + " is not between 0 and the steps done (" +
                   std::to_string(info.next_step) + ")");
  if (info.next_step < 0 || data_step != info.next_step)
    return corrupt(where + "step " + std::to_string(info.next_step) + " and data.next_step " + std::to_string(data_step) +
                   " disagree");
  if (auto n = parse_step_dir_name(dir.filename().string()); n && *n != info.next_step)
    return corrupt(where + "the directory is named for step " + std::to_string(*n) + " but the manifest says step " +
                   std::to_string(info.next_step));
  // Sizes and checksums of every file the manifest lists (the weights, the optimizer states, and
  // config.json, which a resume compares with the model).
  for (auto it = j["files"].begin(); it != j["files"].end(); ++it) {
    const std::string& f = it.key();
    const fs::path p = dir / f;
    const uint64_t bytes = it.value()["bytes"].get<uint64_t>();
    const std::string want = it.value()["xxh64"].get<std::string>();
    auto dg = digest_file(p);
    if (!dg.ok()) {
      if (dg.status().code() == StatusCode::kNotFound)
        return corrupt("'" + p.string() + "' is missing; the manifest lists it");
      return dg.status();
    }
    if (dg->bytes != bytes)
      return corrupt("'" + p.string() + "' " + (dg->bytes < bytes ? "is truncated: " : "has extra bytes: ") +
                     std::to_string(dg->bytes) + " bytes, the manifest says " + std::to_string(bytes));
    if (hex64(dg->xxh64) != want)
      return corrupt("'" + p.string() + "': checksum mismatch: XXH64 " + hex64(dg->xxh64) + ", the manifest says " + want +
                     "; the file is damaged");
  }
  if (j["files"].contains(kConfigFile)) {
    MT_ASSIGN_OR_RETURN(info.hf_config_json, read_small_file(dir / kConfigFile, kMaxManifestBytes));
  }
  return info;
}

std::vector<ExpectedTensor> expected_model_tensors(const HostState& state) {
  std::vector<ExpectedTensor> out;
  for (const UnitState& us : state.units())
    for (const TensorSlot& t : us.tensors) out.push_back({t.name, "F32", t.shape});
  return out;
}

// Every tensor the state needs, present with its dtype and shape, and nothing else.
Status check_tensors(const SafetensorsFile& f, const std::vector<ExpectedTensor>& expected, const CheckpointInfo& info,
                     bool exact_count = true) {
  const std::string where = "'" + f.path().string() + "' (a checkpoint of model '" + info.model_name + "'): ";
  auto text = [](const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
  };
  for (const ExpectedTensor& x : expected) {
    const SafetensorsEntry* e = f.find(x.name);
    if (!e) return invalid_argument(where + "tensor " + x.name + " is missing; is this checkpoint of another model?");
    if (e->dtype != x.dtype) return corrupt(where + "tensor " + x.name + " is " + e->dtype + ", expected " + x.dtype);
    if (x.any_length) {
      if (e->shape.size() != 1) return corrupt(where + "tensor " + x.name + " is not one-dimensional");
      continue;
    }
    if (e->shape != x.shape)
      return invalid_argument(where + "tensor " + x.name + " has shape " + text(e->shape) + ", the model needs " +
                              text(x.shape) + "; is this checkpoint of another model?");
  }
  if (exact_count && f.entries().size() != expected.size())
    return invalid_argument(where + "it holds " + std::to_string(f.entries().size()) + " tensors, the model has " +
                            std::to_string(expected.size()) + "; is this checkpoint of another model?");
  return {};
}

// check_tensors over the optimizer files together: every expected entry in one of them, nothing else.
Status check_sharded_tensors(const OptimizerFiles& opt, const std::vector<ExpectedTensor>& expected, const CheckpointInfo& info) {
  if (opt.files.size() == 1) return check_tensors(opt.files[0], expected, info);
  for (const ExpectedTensor& x : expected) {
    const SafetensorsFile* f = opt.holder(x.name);
    if (f == nullptr)
      return invalid_argument("the optimizer shards of '" + opt.files[0].path().parent_path().string() + "' (a checkpoint of model '" +
                              info.model_name + "'): tensor " + x.name + " is in none of them; is this checkpoint of another model?");
    MT_RETURN_IF_ERROR(check_tensors(*f, {x}, info, /*exact_count=*/false));
  }
  if (opt.file_of.size() != expected.size())
    return invalid_argument("the optimizer shards of '" + opt.files[0].path().parent_path().string() + "' hold " +
                            std::to_string(opt.file_of.size()) + " tensors together, the model has " + std::to_string(expected.size()) +
                            "; is this checkpoint of another model?");
  return {};
}

}  // namespace

// The JSON without its last "}", then the trailer with the XXH64 of everything before it.
std::string manifest_text(const CheckpointInfo& info, const std::map<std::string, FileDigest>& files,
                          const std::string& created) {
  std::string body = manifest_json(info, files, created).dump(2);
  body.resize(body.size() - 2);  // drop "\n}"
  return body + kTrailer + hex64(xxh64(body.data(), body.size())) + "\"\n}\n";
}

Result<Verified> verify_step_dir(const fs::path& dir, const HostState& state) {
  Verified v;
  v.dir = dir;
  MT_ASSIGN_OR_RETURN(v.info, parse_manifest(dir));
  MT_ASSIGN_OR_RETURN(SafetensorsFile model, SafetensorsFile::open(dir / kModelFile));
  MT_RETURN_IF_ERROR(check_tensors(model, expected_model_tensors(state), v.info));
  // The optimizer file, or the shards of a job with sharded states: each in the run's formats (and
  // the same storage), every moment entry in exactly one of them, together the whole model's.
  const MomentFormats now = formats_of(state);
  std::optional<MomentFormats> first;
  for (int64_t k = 0; k < v.info.optimizer_shards; ++k) {
    MT_ASSIGN_OR_RETURN(SafetensorsFile optimizer, SafetensorsFile::open(dir / optimizer_file_name(k, v.info.optimizer_shards)));
    MT_ASSIGN_OR_RETURN(const MomentFormats saved, formats_in(optimizer));
    if (!(saved == now))
      return invalid_argument("'" + optimizer.path().string() + "': the checkpoint keeps m/v in " + saved.text() +
                              ", this run's plan says " + now.text() +
                              "; accepted: resume with the plan the checkpoint was written with (optimizer.m_format, "
                              "optimizer.v_format, optimizer.block_size)");
    if (first && first->compressed != saved.compressed)
      return corrupt("'" + optimizer.path().string() + "': its fp32 moments are stored " + (saved.compressed ? "compressed" : "plain") +
                     ", the first shard's are not; the shards were not written by one save");
    first = saved;
    for (const SafetensorsEntry& e : optimizer.entries()) {
      const auto [it, fresh] = v.optimizer.file_of.emplace(e.name, v.optimizer.files.size());
      if (!fresh)
        return corrupt("'" + optimizer.path().string() + "': tensor " + e.name + " is also in '" +
                       v.optimizer.files[it->second].path().string() + "'; each moment belongs to one shard");
    }
    v.optimizer.files.push_back(std::move(optimizer));
  }
  v.compressed = first->compressed;
  MT_ASSIGN_OR_RETURN(const std::vector<ExpectedTensor> opt_tensors, expected_optimizer_tensors(state, v.compressed));
  MT_RETURN_IF_ERROR(check_sharded_tensors(v.optimizer, opt_tensors, v.info));
  v.model.emplace(std::move(model));
  return v;
}

}  // namespace megatrain::exec::detail
