// Rig sizing and model sizing on top of the plan search: synthesise rigs (or model shapes), ask
// the search whether they train the model, and report the smallest rig per GPU (or the largest
// model per rig) with every assumption spelled out.
#include "megatrain/planner/size.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "megatrain/core/profiles.h"
#include "megatrain/core/units.h"
#include "megatrain/step/schedule.h"

namespace megatrain::planner {
namespace {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// Host RAM sizes tried, GiB: common DIMM populations from a workstation to a large 2-socket host.
constexpr double kRamGiB[] = {64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096};
constexpr int kMaxDrives = 8;
// Rigs whose link and drive the synthesised hosts borrow, by PCIe generation.
constexpr const char* kGen4Rig = "a100-80gb-pcie";
constexpr const char* kGen5Rig = "h200-1.5tb";
constexpr double kGiB = 1073741824.0;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string drive_model(const NvmeSpec& d) { return d.name.substr(0, d.name.find(" (")); }

Provenance estimate(std::string source) {
  Provenance p;
  p.kind = Provenance::Kind::kEstimate;
  p.source = std::move(source);
  return p;
}

// The GPU (and host CPU) of `gpu_rig`, with the link of `link_rig`, `ram` bytes of RAM and
// `drives` copies of `drive`.
HardwareProfile synthesise(const HardwareProfile& gpu_rig, const HardwareProfile& link_rig, double ram, int drives,
                           const NvmeSpec* drive) {
  HardwareProfile r = gpu_rig;
  r.links = link_rig.links;
  const std::string ram_text = format_bytes(ram);
  r.host.ram_bytes = Figure{ram, estimate("megatrain-plan size: host RAM set to " + ram_text + " (one of the sizes it tries)")};
  const double pinnable = std::floor(0.9 * ram / kGiB) * kGiB;
  r.host.pinnable_bytes = Figure{pinnable, estimate("90% of " + ram_text + " RAM, rounded down to a GiB (docs/hardware-profile.md)")};
  r.storage.clear();
  for (int i = 0; i < drives && drive; ++i) {
    NvmeSpec d = *drive;
    d.name = drive_model(*drive) + " (nvme" + std::to_string(i) + ")";
    d.path = "/mnt/nvme" + std::to_string(i);
    r.storage.push_back(d);
  }
  r.name = gpu_rig.name + "+" + link_rig.links.kind + "+" + std::to_string(static_cast<int64_t>(ram / kGiB)) + "GiB+" +
           std::to_string(drives) + "xnvme";
  r.description = "synthesised by megatrain-plan size: GPU and host CPU of " + gpu_rig.name + ".json, link (" +
                  link_rig.links.kind + ") of " + link_rig.name + ".json, " + ram_text + " RAM, " + std::to_string(drives) +
                  (drive ? " x " + drive_model(*drive) : std::string(" drives"));
  return r;
}

struct Verdict {
  bool trains = false;
  double tokens_per_s = 0;
  std::string plan;
  std::string why_not;
};

// Why a search found no plan: the closest plan's shortfall per tier, or the simulator's refusal.
std::string why_nothing_fits(const SearchResult& r) {
  std::string shorts;
  for (const TierNeed& t : r.closest_needs)
    if (t.short_by() > 0) shorts += (shorts.empty() ? "" : ", ") + t.tier + " short by " + format_bytes(t.short_by());
  if (!shorts.empty()) return "the closest plan is " + shorts;
  if (!r.refusals.empty()) return "the simulator refuses every plan that fits statically: " + r.refusals.front();
  return r.infeasible_reason;
}

Verdict try_rig(const ModelSpec& model, const HardwareProfile& rig, const SizeOptions& opt, bool full, int64_t& searches) {
  SearchRequest req;
  req.seq_len = opt.seq_len;
  req.tokens_per_step = opt.tokens_per_step;
  req.policy = opt.policy;
  req.top = 0;
  req.model_ref = ProfileRef{false, model.name()};
  req.rig_ref = ProfileRef{false, rig.name};
  SearchOptions so;
  so.relief = false;
  so.compare_orders = false;  // sizing reads only whether a plan trains and how fast
  so.feasibility_only = !full && opt.target_tokens_per_s <= 0;
  so.stop_at_tokens_per_s = full ? 0 : opt.target_tokens_per_s;
  ++searches;
  auto r = search_plan(model, rig, req, so);
  Verdict v;
  if (!r.ok()) {
    v.why_not = r.status().message();
    return v;
  }
  if (!r->feasible && r->target_missed) {
    v.why_not = "on " + rig.name + ": plans fit, but none can reach the target (at most " +
                std::to_string(static_cast<int64_t>(r->target_bound_tokens_per_s)) + " tokens/s by the lower bound)";
    return v;
  }
  if (!r->feasible) {
    v.why_not = "on " + rig.name + ": " + why_nothing_fits(*r);
    return v;
  }
  if (so.feasibility_only) {
    v.trains = true;
    return v;
  }
  v.tokens_per_s = r->best.result.tokens_per_s;
  v.plan = describe_knobs(r->best.plan);
  v.trains = opt.target_tokens_per_s <= 0 || v.tokens_per_s >= opt.target_tokens_per_s;
  if (!v.trains) v.why_not = "the fastest plan gives " + std::to_string(static_cast<int64_t>(v.tokens_per_s)) + " tokens/s";
  return v;
}

std::vector<std::string> common_assumptions(const SizeOptions& opt, int64_t seq, int64_t tokens) {
  std::vector<std::string> a;
  a.push_back("sequence length " + std::to_string(seq) + ", " + std::to_string(tokens) + " tokens per step" +
              (opt.tokens_per_step > 0 ? "" : " (64 sequences)"));
  std::string f;
  for (StateFormat x : opt.policy.state_formats) f += (f.empty() ? "" : ", ") + std::string(state_format_name(x));
  a.push_back("optimizer-state formats allowed: " + f + "; fp32 master weights; bf16 compute on GPUs");
  if (opt.target_tokens_per_s > 0)
    a.push_back("a rig trains the model when its best simulated plan reaches " +
                std::to_string(static_cast<int64_t>(opt.target_tokens_per_s)) + " tokens/s");
  else
    a.push_back("a rig trains the model when some plan fits every tier (device, pinned, RAM, NVMe) and the simulator accepts it");
  a.push_back("figures are the shipped profiles' datasheet figures and estimates (docs/hardware-profile.md), not measurements");
  return a;
}

}  // namespace

Result<SizeResult> size_rigs(const ModelSpec& model, const std::string& gpu_filter, const SizeOptions& opt) {
  const auto t0 = Clock::now();
  SizeResult res;
  res.model = model.name();
  res.seq_len = opt.seq_len > 0 ? opt.seq_len : default_seq_len(model);
  res.tokens_per_step = opt.tokens_per_step > 0 ? opt.tokens_per_step : 64 * res.seq_len;
  MT_ASSIGN_OR_RETURN(HardwareProfile gen4, HardwareProfile::load(kGen4Rig));
  MT_ASSIGN_OR_RETURN(HardwareProfile gen5, HardwareProfile::load(kGen5Rig));

  std::vector<HardwareProfile> gpus;
  std::string known;
  for (const std::string& name : list_profiles("hardware")) {
    auto r = HardwareProfile::load(name);
    if (!r.ok()) return r.status().with_context("profiles/hardware/" + name + ".json");
    if (step::backend_of_rig(*r) == step::BackendKind::kCpu) {
      res.assumptions.push_back("rig '" + name + "' is the CPU backend, not a GPU: left out of rig sizing");
      continue;
    }
    known += (known.empty() ? "" : ", ") + name + " (" + r->gpu.name + ")";
    const std::string f = lower(gpu_filter);
    if (!f.empty() && lower(name).find(f) == std::string::npos && lower(r->gpu.name).find(f) == std::string::npos) continue;
    gpus.push_back(*r);
  }
  if (gpus.empty())
    return not_found("--gpu '" + gpu_filter + "' matches no GPU in profiles/hardware/; known: " + known);
  std::stable_sort(gpus.begin(), gpus.end(), [](const HardwareProfile& a, const HardwareProfile& b) {
    return a.gpu.memory_bytes.value != b.gpu.memory_bytes.value ? a.gpu.memory_bytes.value < b.gpu.memory_bytes.value
                                                                 : a.gpu.matmul_bf16.value < b.gpu.matmul_bf16.value;
  });

  for (const HardwareProfile& g : gpus) {
    // Links: the GPU's own for a non-PCIe link; Gen4, and Gen5 where the GPU's own rig has Gen5.
    std::vector<const HardwareProfile*> links;
    if (g.links.kind == "pcie-gen5-x16") links = {&gen4, &gen5};
    else if (g.links.kind == "pcie-gen4-x16") links = {&gen4};
    else links = {&g};
    const NvmeSpec* drive = g.storage.empty() ? (gen4.storage.empty() ? nullptr : &gen4.storage.front()) : &g.storage.front();
    RigOption best;
    best.gpu_rig = g.name;
    best.gpu = g.gpu.name;
    std::string last_why;
    bool found = false;
    // Least RAM first, then fewest drives, then the older link: the first (RAM, drives) that trains.
    for (double gib : kRamGiB) {
      const double ram = gib * kGiB;
      for (const HardwareProfile* link : links) {
        auto check = [&](int d) {
          return try_rig(model, synthesise(g, *link, ram, d, drive), opt, false, res.searches);
        };
        Verdict most = check(drive ? kMaxDrives : 0);
        if (!most.trains) {
          last_why = most.why_not;
          continue;
        }
        int lo = 0, hi = drive ? kMaxDrives : 0;  // trains at hi; find the fewest
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (check(mid).trains) hi = mid;
          else lo = mid + 1;
        }
        best.link = link->links.kind;
        best.ram_bytes = ram;
        best.drives = hi;
        best.drive = drive ? drive_model(*drive) : "";
        best.rig = synthesise(g, *link, ram, hi, drive);
        found = true;
        break;
      }
      if (found) break;
    }
    if (found) {
      Verdict v = try_rig(model, best.rig, opt, true, res.searches);
      best.trains = v.trains;
      best.tokens_per_s = v.tokens_per_s;
      best.plan = v.plan;
      best.why_not = v.why_not;
    } else {
      best.why_not = "no host up to " + format_bytes(kRamGiB[std::size(kRamGiB) - 1] * kGiB) + " RAM and " +
                     std::to_string(drive ? kMaxDrives : 0) + " drives trains it: " + last_why;
    }
    res.rigs.push_back(best);
  }
  std::vector<std::string> a = common_assumptions(opt, res.seq_len, res.tokens_per_step);
  a.push_back("host RAM sizes tried (GiB): 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096; pinnable = 90% rounded down to a GiB");
  a.push_back("NVMe: 0 to 8 copies of the drive of the GPU's own shipped rig, each at its datasheet bandwidth and capacity");
  a.push_back(std::string("links: PCIe Gen4 x16 as in ") + kGen4Rig + ".json for every PCIe GPU, Gen5 x16 as in " + kGen5Rig +
              ".json for GPUs whose shipped rig is Gen5; a GPU with its own link (NVLink-C2C) keeps it");
  a.push_back("host CPU (cores, memory bandwidth, Adam throughput) of the GPU's own shipped rig, whatever the RAM size");
  a.push_back("smallest: per GPU, the least RAM, then the fewest drives, then the older PCIe generation; GPUs listed by memory");
  for (const std::string& x : res.assumptions) a.push_back(x);
  res.assumptions = a;
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

// ---- GPU counts ----------------------------------------------------------------------------------------

Result<GpuCountResult> size_gpu_count(const ModelSpec& model, const HardwareProfile& rig, const SizeOptions& opt) {
  const auto t0 = Clock::now();
  if (!rig.cluster)
    return invalid_argument("size --model with --rig answers how many of the rig's GPUs train the model (at --target-tokens-per-s); rig '" +
                            rig.name + "' has no cluster section (docs/hardware-profile.md), so it is one GPU; accepted: a rig with "
                            "one (h200x8-2tb, h200x8-2tb-4node), or size --model without --rig to size a one-GPU rig");
  GpuCountResult res;
  res.model = model.name();
  res.rig = rig.name;
  res.seq_len = opt.seq_len > 0 ? opt.seq_len : default_seq_len(model);
  res.tokens_per_step = opt.tokens_per_step > 0 ? opt.tokens_per_step : 64 * res.seq_len;
  res.target_tokens_per_s = opt.target_tokens_per_s;
  if (res.tokens_per_step % res.seq_len != 0)
    return invalid_argument("--tokens-per-step " + std::to_string(res.tokens_per_step) + " is not a multiple of --seq " +
                            std::to_string(res.seq_len) + "; accepted: whole sequences");
  const int64_t sequences = res.tokens_per_step / res.seq_len;
  const ClusterSpec& cl = *rig.cluster;
  const int64_t most = cl.gpus_per_node * cl.nodes;
  // One node's counts, then whole nodes; each must divide the step's sequences among its ranks.
  std::vector<int64_t> counts;
  for (int64_t n = 1; n <= most; ++n)
    if ((n <= cl.gpus_per_node || n % cl.gpus_per_node == 0) && sequences % n == 0) counts.push_back(n);
  std::string skipped;
  for (int64_t n = 2; n <= most; ++n)
    if ((n <= cl.gpus_per_node || n % cl.gpus_per_node == 0) && sequences % n != 0) skipped += (skipped.empty() ? "" : ", ") + std::to_string(n);
  for (int64_t n : counts) {
    SearchRequest req;
    req.seq_len = res.seq_len;
    req.tokens_per_step = res.tokens_per_step;
    req.gpus = n;
    req.policy = opt.policy;
    req.top = 0;
    req.model_ref = ProfileRef{false, model.name()};
    req.rig_ref = ProfileRef{false, rig.name};
    SearchOptions so;
    so.relief = false;
    so.compare_orders = false;
    ++res.searches;
    GpuCountOption o;
    o.gpus = n;
    o.nodes = (n + cl.gpus_per_node - 1) / cl.gpus_per_node;
    auto r = search_plan(model, rig, req, so);
    if (!r.ok()) {
      o.why_not = r.status().message();
    } else if (!r->feasible) {
      o.why_not = "nothing fits: " + why_nothing_fits(*r);
    } else {
      o.fits = true;
      o.tokens_per_s = r->best.result.tokens_per_s;
      o.mfu = r->best.result.mfu;
      o.bottleneck = r->bottleneck;
      o.host_state = n > 1 ? r->best.plan.parallel.host_state : "-";
      o.plan = describe_knobs(r->best.plan);
      o.trains = opt.target_tokens_per_s <= 0 || o.tokens_per_s >= opt.target_tokens_per_s;
      if (!o.trains) o.why_not = "its best plan reaches " + std::to_string(static_cast<int64_t>(o.tokens_per_s)) + " tokens/s";
    }
    res.counts.push_back(o);
  }
  for (size_t i = 0; i < res.counts.size(); ++i) {
    const GpuCountOption& o = res.counts[i];
    if (!o.trains) continue;
    if (opt.target_tokens_per_s > 0) {
      res.chosen = static_cast<int64_t>(i);
      break;
    }
    if (res.chosen < 0 || o.tokens_per_s > res.counts[static_cast<size_t>(res.chosen)].tokens_per_s) res.chosen = static_cast<int64_t>(i);
  }
  std::vector<std::string> a = common_assumptions(opt, res.seq_len, res.tokens_per_step);
  a.push_back("the step's tokens are the job's: each of N GPUs trains 1/N of them (one rank per GPU, docs/data-parallel.md); GPU counts "
              "tried: 1 to " + std::to_string(cl.gpus_per_node) + " on one node, then whole nodes up to " + std::to_string(most) +
              ", those that divide the step's " + std::to_string(sequences) + " sequences" +
              (skipped.empty() ? std::string() : " (not: " + skipped + ")"));
  a.push_back("each GPU count gets the plan search of megatrain-plan plan --gpus N (host state replicated, sharded or shared "
              "per node, with the other knobs), simulated with each rank's share of its node (docs/cost-model.md)");
  a.push_back(opt.target_tokens_per_s > 0 ? "the answer is the fewest GPUs whose best plan reaches the target"
                                          : "no target: the answer is the GPU count with the most tokens/s");
  res.assumptions = a;
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

std::string gpu_count_json(const GpuCountResult& r) {
  Json counts = Json::array();
  for (const GpuCountOption& o : r.counts) {
    Json j = {{"gpus", o.gpus}, {"nodes", o.nodes}, {"trains", o.trains}, {"fits", o.fits}};
    if (o.fits) {
      j["tokens_per_s"] = o.tokens_per_s;
      j["tokens_per_s_per_gpu"] = o.tokens_per_s / static_cast<double>(o.gpus);
      j["mfu"] = o.mfu;
      j["bottleneck"] = o.bottleneck;
      j["host_state"] = o.host_state;
      j["plan"] = o.plan;
    }
    if (!o.why_not.empty()) j["why_not"] = o.why_not;
    counts.push_back(j);
  }
  Json j = {{"model", r.model}, {"rig", r.rig}, {"seq_len", r.seq_len}, {"tokens_per_step", r.tokens_per_step}};
  if (r.target_tokens_per_s > 0) j["target_tokens_per_s"] = r.target_tokens_per_s;
  j["gpus"] = r.chosen >= 0 ? Json(r.counts[static_cast<size_t>(r.chosen)].gpus) : Json(nullptr);
  j["counts"] = counts;
  j["assumptions"] = r.assumptions;
  j["searches"] = r.searches;
  j["seconds"] = r.seconds;
  return j.dump(2) + "\n";
}

std::string gpu_count_table(const GpuCountResult& r) {
  std::ostringstream o;
  char line[512];
  o << "megatrain-plan size: how many GPUs of " << r.rig << " train " << r.model << " (seq " << r.seq_len << ", " << r.tokens_per_step
    << " tokens per step";
  if (r.target_tokens_per_s > 0) o << ", at " << static_cast<int64_t>(r.target_tokens_per_s) << " tokens/s or more";
  o << ")\n\n";
  std::snprintf(line, sizeof line, "  %5s %5s %12s %10s %7s  %-12s %-10s\n", "GPUs", "nodes", "tokens/s", "per GPU", "MFU", "bottleneck", "host state");
  o << line;
  for (size_t i = 0; i < r.counts.size(); ++i) {
    const GpuCountOption& x = r.counts[i];
    const char* mark = static_cast<int64_t>(i) == r.chosen ? "*" : " ";
    if (!x.fits) {
      std::snprintf(line, sizeof line, "%s %5lld %5lld  ", mark, static_cast<long long>(x.gpus), static_cast<long long>(x.nodes));
      o << line << x.why_not << "\n";
      continue;
    }
    std::snprintf(line, sizeof line, "%s %5lld %5lld %12.0f %10.0f %6.1f%%  %-12s %-10s\n", mark, static_cast<long long>(x.gpus),
                  static_cast<long long>(x.nodes), x.tokens_per_s, x.tokens_per_s / static_cast<double>(x.gpus), 100 * x.mfu,
                  x.bottleneck.c_str(), x.host_state.c_str());
    o << line;
  }
  o << "\n";
  if (r.chosen >= 0) {
    const GpuCountOption& c = r.counts[static_cast<size_t>(r.chosen)];
    std::snprintf(line, sizeof line, "%s: %lld GPU%s (%lld node%s), %.0f tokens/s\n",
                  r.target_tokens_per_s > 0 ? "fewest GPUs that reach the target" : "fastest", static_cast<long long>(c.gpus),
                  c.gpus == 1 ? "" : "s", static_cast<long long>(c.nodes), c.nodes == 1 ? "" : "s", c.tokens_per_s);
    o << line << "  plan: " << c.plan << "\n";
  } else {
    o << (r.target_tokens_per_s > 0 ? "no GPU count of this rig reaches the target\n" : "no GPU count of this rig trains the model\n");
  }
  o << "\n";
  for (const std::string& a : r.assumptions) o << "assumption: " << a << "\n";
  std::snprintf(line, sizeof line, "%lld searches, %.2f s\n", static_cast<long long>(r.searches), r.seconds);
  o << line;
  return o.str();
}

// ---- families ----------------------------------------------------------------------------------------

namespace {

struct Member {
  std::string name;
  Json config;
  ModelSpec spec;
  double params = 0;
};

Result<std::vector<Member>> family_members(const std::string& family) {
  static const std::regex pattern(R"((.+)-(\d+(\.\d+)?)b)");
  std::vector<Member> out;
  MT_ASSIGN_OR_RETURN(std::filesystem::path dir, profiles_dir());
  for (const std::string& name : list_profiles("models")) {
    std::smatch m;
    if (!std::regex_match(name, m, pattern) || m[1].str() != family) continue;
    std::ifstream in(dir / "models" / (name + ".json"));
    std::stringstream ss;
    ss << in.rdbuf();
    MT_ASSIGN_OR_RETURN(ModelSpec spec, ModelSpec::from_config_json(ss.str(), name));
    spec.set_name(name);
    Json j = Json::parse(ss.str(), nullptr, false);
    if (j.is_discarded()) return parse_error("profiles/models/" + name + ".json: not JSON");
    out.push_back(Member{name, j, spec, static_cast<double>(spec.parameter_counts().total)});
  }
  std::sort(out.begin(), out.end(), [](const Member& a, const Member& b) { return a.params < b.params; });
  return out;
}

int64_t round_to(double v, int64_t step) { return std::max<int64_t>(step, static_cast<int64_t>(std::llround(v / static_cast<double>(step))) * step); }

// The shape at `params` parameters: hidden size and layer count interpolated in log-log between the
// two published sizes around it (extrapolated beyond them), the rest from the nearest published size.
Result<FamilyPoint> scaled(const std::vector<Member>& ms, const std::string& family, double params, ModelSpec& spec_out) {
  size_t hi = 1;
  while (hi + 1 < ms.size() && ms[hi].params < params) ++hi;
  const Member& a = ms[hi - 1];
  const Member& b = ms[hi];
  const Member& near = std::fabs(std::log(params / a.params)) <= std::fabs(std::log(params / b.params)) ? a : b;
  const ModelConfig& ca = a.spec.config();
  const ModelConfig& cb = b.spec.config();
  const ModelConfig& cn = near.spec.config();
  const double t = std::log(params / a.params) / std::log(b.params / a.params);
  auto interp = [&](double x, double y) { return std::exp(std::log(x) + t * (std::log(y) - std::log(x))); };
  const int64_t head_dim = cn.head_dim;
  const int64_t kv = cn.num_kv_heads;
  int64_t heads = round_to(interp(static_cast<double>(ca.hidden_size), static_cast<double>(cb.hidden_size)) / static_cast<double>(head_dim), kv);
  const int64_t hidden = heads * head_dim;
  const double ffn_ratio = static_cast<double>(cn.intermediate_size) / static_cast<double>(cn.hidden_size);
  const int64_t inter = round_to(ffn_ratio * static_cast<double>(hidden), 256);
  const int64_t layers = std::max<int64_t>(1, std::llround(interp(static_cast<double>(ca.num_layers), static_cast<double>(cb.num_layers))));
  Json j = near.config;
  j["hidden_size"] = hidden;
  j["intermediate_size"] = inter;
  j["num_hidden_layers"] = layers;
  j["num_attention_heads"] = heads;
  j["num_key_value_heads"] = kv;
  if (j.contains("head_dim")) j["head_dim"] = head_dim;
  MT_ASSIGN_OR_RETURN(ModelSpec spec, ModelSpec::from_config_json(j.dump(), family + " (scaled)"));
  FamilyPoint p;
  p.parameters = spec.parameter_counts().total;
  char name[64];
  std::snprintf(name, sizeof name, "%s~%.1fb", family.c_str(), static_cast<double>(p.parameters) / 1e9);
  p.name = name;
  spec.set_name(p.name);
  p.layers = layers;
  p.hidden = hidden;
  p.intermediate = inter;
  p.heads = heads;
  p.kv_heads = kv;
  spec_out = std::move(spec);
  return p;
}

void fill_shape(FamilyPoint& p, const ModelSpec& s) {
  const ModelConfig& c = s.config();
  p.parameters = s.parameter_counts().total;
  p.layers = c.num_layers;
  p.hidden = c.hidden_size;
  p.intermediate = c.intermediate_size;
  p.heads = c.num_heads;
  p.kv_heads = c.num_kv_heads;
}

}  // namespace

std::vector<std::string> model_families() {
  static const std::regex pattern(R"((.+)-(\d+(\.\d+)?)b)");
  std::map<std::string, int> count;
  for (const std::string& name : list_profiles("models")) {
    std::smatch m;
    if (!std::regex_match(name, m, pattern)) continue;
    // Mixture-of-Experts sizes are not scaled (largest_model says why).
    auto spec = ModelSpec::load(name);
    if (spec.ok() && spec->config().is_moe()) continue;
    ++count[m[1].str()];
  }
  std::vector<std::string> out;
  for (const auto& [f, n] : count)
    if (n >= 2) out.push_back(f);
  return out;
}

Result<FamilyResult> largest_model(const std::string& family, const HardwareProfile& rig, const SizeOptions& opt) {
  const auto t0 = Clock::now();
  MT_ASSIGN_OR_RETURN(std::vector<Member> ms, family_members(family));
  for (const Member& m : ms)
    if (m.spec.config().is_moe())
      return unsupported("--family '" + family + "': " + m.name + " is a Mixture-of-Experts model, and MoE sizes are not "
                         "scaled: published sizes differ in expert count, expert width and experts per token as well as in "
                         "hidden size and depth, with no rule to interpolate them; size each with `size --model " + m.name + "`");
  if (ms.size() < 2) {
    std::string list;
    for (const std::string& f : model_families()) list += (list.empty() ? "" : ", ") + f;
    return invalid_argument("--family '" + family + "' has " + std::to_string(ms.size()) +
                            " published size(s) in profiles/models/ (files named <family>-<N>b.json); scaling needs two; accepted: " + list);
  }
  FamilyResult res;
  res.family = family;
  res.rig = rig.name;
  int64_t min_max_pos = ms.front().spec.config().max_position_embeddings;
  for (const Member& m : ms) min_max_pos = std::min(min_max_pos, m.spec.config().max_position_embeddings);
  SizeOptions o = opt;
  if (o.seq_len <= 0) o.seq_len = std::min<int64_t>(4096, min_max_pos);
  res.seq_len = o.seq_len;
  res.tokens_per_step = o.tokens_per_step > 0 ? o.tokens_per_step : 64 * o.seq_len;
  for (const Member& m : ms) {
    FamilyPoint p;
    p.name = m.name;
    p.published = true;
    fill_shape(p, m.spec);
    Verdict v = try_rig(m.spec, rig, o, true, res.searches);
    p.trains = v.trains;
    p.tokens_per_s = v.tokens_per_s;
    p.plan = v.trains ? v.plan : v.why_not;
    res.published.push_back(p);
  }
  // A geometric ladder from a quarter of the smallest to 8x the largest, 2^(1/4) apart; trains()
  // is monotone in size in practice, so the search bisects it.
  std::vector<double> ladder;
  for (double p = ms.front().params / 4; p <= ms.back().params * 8; p *= std::pow(2.0, 0.25)) ladder.push_back(p);
  auto trains_at = [&](size_t i, FamilyPoint& point, ModelSpec& spec) -> Result<bool> {
    MT_ASSIGN_OR_RETURN(point, scaled(ms, family, ladder[i], spec));
    Verdict v = try_rig(spec, rig, o, false, res.searches);
    point.trains = v.trains;
    if (!v.trains) point.plan = v.why_not;
    return v.trains;
  };
  FamilyPoint p0;
  ModelSpec s0;
  MT_ASSIGN_OR_RETURN(bool first, trains_at(0, p0, s0));
  if (!first) {
    res.smallest_that_does_not = p0;
    res.why_not = p0.plan;
  } else {
    size_t lo = 0, hi = ladder.size();  // trains at lo; hi is the first known not to (or past the end)
    FamilyPoint plast;
    ModelSpec slast;
    MT_ASSIGN_OR_RETURN(bool top, trains_at(ladder.size() - 1, plast, slast));
    if (top) {
      lo = ladder.size() - 1;
    } else {
      hi = ladder.size() - 1;
      res.smallest_that_does_not = plast;
      while (hi - lo > 1) {
        const size_t mid = (lo + hi) / 2;
        FamilyPoint pm;
        ModelSpec sm;
        MT_ASSIGN_OR_RETURN(bool ok, trains_at(mid, pm, sm));
        if (ok) lo = mid;
        else {
          hi = mid;
          res.smallest_that_does_not = pm;
        }
      }
    }
    FamilyPoint best;
    ModelSpec sb;
    MT_ASSIGN_OR_RETURN(best, scaled(ms, family, ladder[lo], sb));
    Verdict v = try_rig(sb, rig, o, true, res.searches);
    best.trains = v.trains;
    best.tokens_per_s = v.tokens_per_s;
    best.plan = v.plan;
    res.largest = best;
    res.any = true;
    res.why_not = res.smallest_that_does_not.plan;
  }
  std::vector<std::string> a = common_assumptions(o, res.seq_len, res.tokens_per_step);
  std::string members;
  for (const Member& m : ms) members += (members.empty() ? "" : ", ") + m.name;
  a.push_back("family " + family + " scaled through its published sizes (" + members +
              "): hidden size and layer count interpolated log-log in parameter count between the two published sizes around it "
              "(extrapolated beyond them); head_dim, KV heads, vocabulary, FFN ratio, norms and RoPE from the nearest published size; "
              "heads rounded to a multiple of the KV heads, the FFN width to a multiple of 256");
  a.push_back("sizes tried: a geometric ladder 2^(1/4) (about 19%) apart, from a quarter of the smallest published size to 8x the largest; "
              "the answer is the largest rung that trains");
  a.push_back("rig '" + rig.name + "' as its profile says; sequence length capped by the family's smallest max_position_embeddings");
  res.assumptions = a;
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

// ---- output ----------------------------------------------------------------------------------------

namespace {

Json point_json(const FamilyPoint& p) {
  return {{"name", p.name}, {"published", p.published}, {"parameters", p.parameters}, {"layers", p.layers},
          {"hidden_size", p.hidden}, {"intermediate_size", p.intermediate}, {"heads", p.heads}, {"kv_heads", p.kv_heads},
          {"trains", p.trains}, {"tokens_per_s", p.tokens_per_s}, {p.trains ? "plan" : "why_not", p.plan}};
}

}  // namespace

std::string size_json(const SizeResult& r) {
  Json rigs = Json::array();
  for (const RigOption& o : r.rigs) {
    Json j = {{"gpu_rig", o.gpu_rig}, {"gpu", o.gpu}, {"trains", o.trains}};
    if (o.trains) {
      j["link"] = o.link;
      j["ram_bytes"] = static_cast<int64_t>(o.ram_bytes);
      j["drives"] = o.drives;
      j["drive"] = o.drive;
      j["tokens_per_s"] = o.tokens_per_s;
      j["plan"] = o.plan;
      j["rig"] = Json::parse(o.rig.to_json_text());
    } else {
      j["why_not"] = o.why_not;
    }
    rigs.push_back(j);
  }
  Json j = {{"model", r.model}, {"seq_len", r.seq_len}, {"tokens_per_step", r.tokens_per_step}, {"rigs", rigs},
            {"assumptions", r.assumptions}, {"searches", r.searches}, {"seconds", r.seconds}};
  return j.dump(2) + "\n";
}

std::string size_table(const SizeResult& r) {
  std::ostringstream o;
  char line[512];
  o << "megatrain-plan size: the smallest rig per GPU that trains " << r.model << " (seq " << r.seq_len << ", "
    << r.tokens_per_step << " tokens per step)\n\n";
  std::snprintf(line, sizeof line, "  %-16s %-14s %10s %-24s %12s\n", "GPU rig", "link", "RAM", "NVMe", "tokens/s");
  o << line;
  for (const RigOption& x : r.rigs) {
    if (!x.trains) {
      std::snprintf(line, sizeof line, "  %-16s ", x.gpu_rig.c_str());
      o << line << x.why_not << "\n";
      continue;
    }
    const std::string nvme = x.drives == 0 ? "none" : std::to_string(x.drives) + " x " + x.drive;
    std::snprintf(line, sizeof line, "  %-16s %-14s %10s %-24s %12.0f\n", x.gpu_rig.c_str(), x.link.c_str(),
                  format_bytes(x.ram_bytes).c_str(), nvme.c_str(), x.tokens_per_s);
    o << line << "      plan: " << x.plan << "\n";
  }
  o << "\n";
  for (const std::string& a : r.assumptions) o << "assumption: " << a << "\n";
  std::snprintf(line, sizeof line, "%lld searches, %.2f s\n", static_cast<long long>(r.searches), r.seconds);
  o << line;
  return o.str();
}

std::string family_json(const FamilyResult& r) {
  Json pub = Json::array();
  for (const FamilyPoint& p : r.published) pub.push_back(point_json(p));
  Json j = {{"family", r.family}, {"rig", r.rig}, {"seq_len", r.seq_len}, {"tokens_per_step", r.tokens_per_step},
            {"published", pub}, {"trains_any", r.any}};
  if (r.any) j["largest"] = point_json(r.largest);
  if (r.smallest_that_does_not.parameters > 0) j["next_size_up"] = point_json(r.smallest_that_does_not);
  j["assumptions"] = r.assumptions;
  j["searches"] = r.searches;
  j["seconds"] = r.seconds;
  return j.dump(2) + "\n";
}

std::string family_table(const FamilyResult& r) {
  std::ostringstream o;
  char line[512];
  o << "megatrain-plan size: the largest " << r.family << " model that rig " << r.rig << " trains (seq " << r.seq_len
    << ", " << r.tokens_per_step << " tokens per step)\n\npublished sizes\n";
  for (const FamilyPoint& p : r.published) {
    std::snprintf(line, sizeof line, "  %-16s %9s params  ", p.name.c_str(), format_count(static_cast<double>(p.parameters)).c_str());
    o << line;
    if (p.trains) {
      std::snprintf(line, sizeof line, "trains at %.0f tokens/s", p.tokens_per_s);
      o << line << "\n";
    } else {
      o << "does not: " << p.plan << "\n";
    }
  }
  auto shape = [](const FamilyPoint& p) {
    return std::to_string(p.layers) + " layers, hidden " + std::to_string(p.hidden) + ", FFN " + std::to_string(p.intermediate) +
           ", " + std::to_string(p.heads) + " heads (" + std::to_string(p.kv_heads) + " KV)";
  };
  if (r.any) {
    std::snprintf(line, sizeof line, "\nlargest that trains: %s, %s parameters: ", r.largest.name.c_str(),
                  format_count(static_cast<double>(r.largest.parameters)).c_str());
    o << line << shape(r.largest) << "\n";
    std::snprintf(line, sizeof line, "  %.0f tokens/s with ", r.largest.tokens_per_s);
    o << line << r.largest.plan << "\n";
  } else {
    o << "\nno size of the family trains on this rig\n";
  }
  if (r.smallest_that_does_not.parameters > 0)
    o << "next size up (" << r.smallest_that_does_not.name << ", " << shape(r.smallest_that_does_not)
      << ") does not: " << r.smallest_that_does_not.plan << "\n";
  o << "\n";
  for (const std::string& a : r.assumptions) o << "assumption: " << a << "\n";
  std::snprintf(line, sizeof line, "%lld searches, %.2f s\n", static_cast<long long>(r.searches), r.seconds);
  o << line;
  return o.str();
}

int size_command(const SizeCommand& cmd) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "megatrain-plan: error: %s\n", s.to_string().c_str());
    return 1;
  };
  SizeOptions opt;
  opt.target_tokens_per_s = cmd.target_tokens_per_s;
  opt.seq_len = cmd.seq_len;
  opt.tokens_per_step = cmd.tokens_per_step;
  auto formats = parse_state_format_list(cmd.state_formats);
  if (!formats.ok()) return fail(formats.status().with_context("--state-formats"));
  opt.policy.state_formats = *formats;
  if (!cmd.family.empty()) {
    if (cmd.rig.empty()) return fail(invalid_argument("--family needs --rig: the rig to size the family for"));
    if (!cmd.model.empty()) return fail(invalid_argument("give --model (size rigs for a model) or --family with --rig (the largest model a rig trains), not both"));
    auto rig = HardwareProfile::load(cmd.rig);
    if (!rig.ok()) return fail(rig.status().with_context("--rig"));
    auto r = largest_model(cmd.family, *rig, opt);
    if (!r.ok()) return fail(r.status());
    std::fputs((cmd.json ? family_json(*r) : family_table(*r)).c_str(), stdout);
    if (!r->any) {
      std::fprintf(stderr, "megatrain-plan: no size of %s trains on %s: %s\n", cmd.family.c_str(), rig->name.c_str(), r->why_not.c_str());
      return 2;
    }
    return 0;
  }
  if (cmd.model.empty()) return fail(invalid_argument("size needs --model M (which rigs train M) or --family F --rig R (the largest model R trains)"));
  auto model = ModelSpec::load(cmd.model);
  if (!model.ok()) return fail(model.status().with_context("--model"));
  if (!cmd.rig.empty()) {  // how many of this rig's GPUs
    if (!cmd.gpu.empty()) return fail(invalid_argument("--gpu narrows the GPUs rig sizing tries; with --rig the GPU is the rig's"));
    auto rig = HardwareProfile::load(cmd.rig);
    if (!rig.ok()) return fail(rig.status().with_context("--rig"));
    auto r = size_gpu_count(*model, *rig, opt);
    if (!r.ok()) return fail(r.status());
    std::fputs((cmd.json ? gpu_count_json(*r) : gpu_count_table(*r)).c_str(), stdout);
    if (r->chosen < 0) {
      std::fprintf(stderr, "megatrain-plan: no GPU count of %s %s %s; see the reasons above\n", rig->name.c_str(),
                   r->target_tokens_per_s > 0 ? "reaches the target for" : "trains", r->model.c_str());
      return 2;
    }
    return 0;
  }
  auto r = size_rigs(*model, cmd.gpu, opt);
  if (!r.ok()) return fail(r.status());
  std::fputs((cmd.json ? size_json(*r) : size_table(*r)).c_str(), stdout);
  const bool any = std::any_of(r->rigs.begin(), r->rigs.end(), [](const RigOption& o) { return o.trains; });
  if (!any) {
    std::fprintf(stderr, "megatrain-plan: no rig tried trains %s; see the per-GPU reasons above\n", r->model.c_str());
    return 2;
  }
  return 0;
}

}  // namespace megatrain::planner
