// The search's reports: `plan --json` (search_json) and the terminal table (search_table).
#include <cmath>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "detail/explain.h"
#include "detail/relief.h"
#include "megatrain/core/units.h"
#include "megatrain/planner/search.h"

namespace megatrain::planner {

using detail::fmt_pct;
using detail::kReliefMinGain;

namespace {

using Json = nlohmann::ordered_json;

Json tiers_json(const std::vector<TierNeed>& v) {
  Json j = Json::array();
  for (const TierNeed& t : v)
    j.push_back({{"tier", t.tier}, {"need_bytes", static_cast<int64_t>(std::ceil(t.need))},
                 {"have_bytes", static_cast<int64_t>(t.have)}, {"short_bytes", static_cast<int64_t>(std::ceil(t.short_by()))}});
  return j;
}

Json stats_json(const SearchStats& s) {
  return {{"candidates", s.candidates}, {"infeasible", s.infeasible}, {"dominated", s.dominated}, {"bounded", s.bounded},
          {"simulated", s.simulated}, {"refused", s.refused}, {"table_simulations", s.table_simulations},
          {"relief_simulations", s.relief_simulations}, {"order_simulations", s.order_simulations},
          {"seconds", s.seconds}};
}

Json knobs_json(const Plan& p) {
  return {{"micro_batch", p.training.micro_batch}, {"grad_accum", p.training.grad_accum}, {"order", name(p.schedule.order)},
          {"prefetch_depth", p.schedule.prefetch_depth}, {"device_layer_buffers", p.schedule.device_layer_buffers},
          {"checkpoint_every", p.schedule.checkpoint_every}, {"checkpoint_location", name(p.schedule.checkpoint_location)},
          {"master_weights", name(p.placement.master_weights)}, {"optimizer_states", name(p.placement.optimizer_states)},
          {"m_format", state_format_name(p.optimizer.m_format)}, {"v_format", state_format_name(p.optimizer.v_format)},
          {"transfer", dtype_name(p.precision.transfer)}, {"threads", p.optimizer.threads},
          {"pinned_staging_bytes", p.placement.pinned_staging_bytes}};
}

}  // namespace

std::string search_json(const SearchResult& r) {
  Json j;
  j["feasible"] = r.feasible;
  j["model"] = r.model_name;
  j["rig"] = r.rig_name;
  j["seq_len"] = r.seq_len;
  j["tokens_per_step"] = r.tokens_per_step;
  if (!r.feasible) {
    j["reason"] = r.infeasible_reason;
    Json shortfalls = Json::array();
    for (const TierNeed& t : r.closest_needs)
      if (t.short_by() > 0) shortfalls.push_back(tiers_json({t})[0]);
    j["shortfalls"] = shortfalls;
    j["closest"] = {{"plan", r.closest_description}, {"tiers", tiers_json(r.closest_needs)}};
    j["least_needs"] = tiers_json(r.least_needs);
    j["refusals"] = r.refusals;
  } else {
    j["plan"] = Json::parse(r.best.plan.to_json_text());
    Json alts = Json::array();
    for (const Candidate& c : r.alternatives) {
      alts.push_back({{"tokens_per_s", c.result.tokens_per_s}, {"step_time_s", c.result.step_time_s},
                      {"bottleneck", c.result.bottleneck}, {"relative", c.result.tokens_per_s / r.best.result.tokens_per_s},
                      {"why", c.why}, {"knobs", knobs_json(c.plan)},
                      {"peak_bytes", {{"device", c.result.peak_bytes.device}, {"pinned", c.result.peak_bytes.pinned},
                                      {"ram", c.result.peak_bytes.ram}, {"nvme", c.result.peak_bytes.nvme}}}});
    }
    j["alternatives"] = alts;
    Json relief = Json::array();
    for (const Relief& x : r.relief)
      relief.push_back({{"change", x.change}, {"tokens_per_s", x.tokens_per_s}, {"gain", x.gain}, {"needs", x.needs},
                        {"tier", x.tier}, {"more_bytes", static_cast<int64_t>(std::ceil(x.more_bytes))}});
    j["bottleneck"] = {{"resource", r.bottleneck}, {"text", r.bottleneck_text}, {"relief", relief}};
    if (r.order.compared) {
      Json o = {{"winner", name(r.best.plan.schedule.order)},
                {"tokens_per_s", r.best.result.tokens_per_s},
                {"weight_bytes_per_step", r.best.result.weight_bytes_per_step},
                {"gradient_bytes_per_step", r.best.result.gradient_bytes_per_step},
                {"flops_per_step", r.best.result.flops_per_step}};
      if (r.order.other_fits) {
        const Candidate& c = r.order.other;
        o["other"] = {{"order", name(c.plan.schedule.order)}, {"tokens_per_s", c.result.tokens_per_s},
                      {"step_time_s", c.result.step_time_s}, {"bottleneck", c.result.bottleneck},
                      {"weight_bytes_per_step", c.result.weight_bytes_per_step},
                      {"gradient_bytes_per_step", c.result.gradient_bytes_per_step}, {"flops_per_step", c.result.flops_per_step},
                      {"knobs", knobs_json(c.plan)}};
        o["speedup"] = r.order.speedup;
      } else {
        o["other"] = nullptr;
      }
      o["text"] = r.order.text;
      j["order"] = o;
    }
  }
  if (!r.state_format_note.empty()) j["state_formats"] = r.state_format_note;
  if (!r.placement_note.empty()) j["placement_note"] = r.placement_note;
  j["search"] = stats_json(r.stats);
  j["assumptions"] = r.assumptions;
  return j.dump(2) + "\n";
}

std::string search_table(const SearchResult& r) {
  std::ostringstream o;
  char line[512];
  o << "megatrain-plan plan: " << r.model_name << " on " << r.rig_name << ", seq " << r.seq_len << ", "
    << r.tokens_per_step << " tokens per step\n\n";
  if (!r.feasible) {
    o << r.infeasible_reason << "\n\n";
    if (!r.closest_needs.empty()) {
      o << "closest plan: " << r.closest_description << "\n";
      std::snprintf(line, sizeof line, "  %-8s %14s %14s %14s\n", "tier", "needs", "has", "short by");
      o << line;
      for (const TierNeed& t : r.closest_needs) {
        std::snprintf(line, sizeof line, "  %-8s %14s %14s %14s\n", t.tier.c_str(), format_bytes(t.need).c_str(),
                      format_bytes(t.have).c_str(), t.short_by() > 0 ? format_bytes(t.short_by()).c_str() : "-");
        o << line;
      }
    }
    if (!r.least_needs.empty()) {
      o << "\nthe least any plan needs, tier by tier\n";
      for (const TierNeed& t : r.least_needs) {
        std::snprintf(line, sizeof line, "  %-8s %14s of %14s%s\n", t.tier.c_str(), format_bytes(t.need).c_str(),
                      format_bytes(t.have).c_str(), t.short_by() > 0 ? "  (short even at best)" : "");
        o << line;
      }
    }
    for (const std::string& s : r.refusals) o << "simulator refused: " << s << "\n";
  } else {
    const sim::SimResult& b = r.best.result;
    o << "best plan\n  " << describe_knobs(r.best.plan) << "\n";
    std::snprintf(line, sizeof line, "  %.0f tokens/s, step %s, %.1f TFLOP/s, MFU %.1f%%\n", b.tokens_per_s,
                  format_duration(b.step_time_s).c_str(), b.tflops, 100 * b.mfu);
    o << line;
    o << "  peak bytes: device " << format_bytes(static_cast<double>(b.peak_bytes.device)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.device)) << ", pinned "
      << format_bytes(static_cast<double>(b.peak_bytes.pinned)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.pinned)) << ", ram "
      << format_bytes(static_cast<double>(b.peak_bytes.ram)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.ram)) << ", nvme "
      << format_bytes(static_cast<double>(b.peak_bytes.nvme)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.nvme)) << "\n";
    if (!r.state_format_note.empty()) o << "\noptimizer states\n  " << r.state_format_note << "\n";
    if (!r.placement_note.empty()) o << "\nplacement\n  " << r.placement_note << "\n";
    if (r.order.compared) o << "\norder\n  " << r.order.text << "\n";
    o << "\nbottleneck\n  " << r.bottleneck_text << "\n";
    if (r.relief.empty()) o << "  no single change within reach relieves it by " << fmt_pct(kReliefMinGain) << " or more\n";
    for (const Relief& x : r.relief) {
      std::snprintf(line, sizeof line, "  relief: %s gives %.0f tokens/s (+%.1f%%) but needs %s\n", x.change.c_str(),
                    x.tokens_per_s, 100 * x.gain, x.needs.c_str());
      o << line;
    }
    if (!r.alternatives.empty()) {
      o << "\nalternatives (the best plan of each other structure)\n";
      std::snprintf(line, sizeof line, "  %3s %12s %10s  %s\n", "#", "tokens/s", "bottleneck", "why it lost");
      o << line;
      for (size_t i = 0; i < r.alternatives.size(); ++i) {
        const Candidate& c = r.alternatives[i];
        std::snprintf(line, sizeof line, "  %3zu %12.0f %10s  ", i + 1, c.result.tokens_per_s, c.result.bottleneck.c_str());
        o << line << c.why << "\n";
      }
    }
  }
  const SearchStats& s = r.stats;
  std::snprintf(line, sizeof line,
                "\nsearch: %lld candidates: %lld over a tier, %lld dominated, %lld bounded, %lld simulated (%lld refused); "
                "%lld more simulations for the table, %lld for the relief and %lld for the other order; %.3f s\n",
                static_cast<long long>(s.candidates), static_cast<long long>(s.infeasible), static_cast<long long>(s.dominated),
                static_cast<long long>(s.bounded), static_cast<long long>(s.simulated), static_cast<long long>(s.refused),
                static_cast<long long>(s.table_simulations), static_cast<long long>(s.relief_simulations),
                static_cast<long long>(s.order_simulations), s.seconds);
  o << line;
  for (const std::string& a : r.assumptions) o << "assumption: " << a << "\n";
  return o.str();
}

}  // namespace megatrain::planner
