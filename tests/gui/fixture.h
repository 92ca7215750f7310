// A small trace with known spans for the GUI tests: three lanes over [0, 1000) ns, a stall, bytes
// on the copies, a device-memory counter and one step. Written with core's TraceWriter (so the
// tests also go through the real reader) or built in memory.
#pragma once

#include <filesystem>
#include <memory>
#include <vector>

#include "megatrain/core/trace_store.h"
#include "megatrain/gui/tracedata.h"

namespace fixture {

struct Span {
  int lane;
  const char* name;
  const char* kind;
  int64_t start, end, bytes;
  double flops;
  int layer;
};

inline const std::vector<megatrain::TraceLane>& lanes() {
  static const std::vector<megatrain::TraceLane> l = {{0, "GPU compute", "gpu"}, {1, "H2D", "h2d"}, {2, "CPU optimizer", "cpu"}};
  return l;
}

// `scale` stretches the GPU spans (a second trace for comparisons).
inline std::vector<Span> spans(double scale = 1.0) {
  auto s = [scale](int64_t v) { return static_cast<int64_t>(static_cast<double>(v) * scale); };
  return {
      {0, "fwd L0 mb0", "forward", 100, 100 + s(100), 0, 2e6, 0},
      {0, "bwd L0 mb0", "backward", 300, 300 + s(100), 0, 4e6, 0},
      {0, "stall: buffer", "stall", 600, 650, 0, 0, 1},
      {1, "h2d L0", "h2d", 0, 80, 400, 0, 0},
      {1, "h2d L1", "h2d", 450, 550, 1000, 0, 1},
      {2, "adam L0", "optimizer", 700, 850, 0, 0, 0},
  };
}

inline std::map<std::string, std::string> meta() { return {{"source", "measured"}}; }

inline std::shared_ptr<const megatrain::gui::TraceData> build(double scale = 1.0) {
  megatrain::gui::TraceDataBuilder b;
  b.setPath("fixture.mtrace", scale == 1.0 ? "fixture" : "fixture (scaled)");
  b.setMeta(meta());
  for (const auto& l : lanes()) b.addLane(l);
  for (const auto& sp : spans(scale))
    b.addSpan({sp.lane, sp.name, sp.kind, 0, sp.layer, 0, sp.start, sp.end, sp.bytes, sp.flops});
  b.addCounter({"bytes.device", 0, 100});
  b.addCounter({"bytes.device", 500, 300});
  b.addCounter({"bytes.device", 1000, 0});
  b.addStep({0, 2.5, 512, 900e-9});
  return b.finish();
}

inline megatrain::Status write(const std::filesystem::path& path, int64_t extraSpans = 0) {
  auto w = megatrain::TraceWriter::create(path, meta());
  if (!w.ok()) return w.status();
  for (const auto& l : lanes()) {
    auto id = (*w)->add_lane(l.name, l.kind);
    if (!id.ok()) return id.status();
  }
  for (const auto& sp : spans())
    MT_RETURN_IF_ERROR((*w)->add_span({sp.lane, sp.name, sp.kind, 0, sp.layer, 0, sp.start, sp.end, sp.bytes, sp.flops}));
  // Filler on the CPU lane after the fixture's window, for size tests.
  for (int64_t i = 0; i < extraSpans; ++i)
    MT_RETURN_IF_ERROR((*w)->add_span({2, "adam", "optimizer", 1, 0, 0, 2000 + 10 * i, 2000 + 10 * i + 5, 0, 0}));
  MT_RETURN_IF_ERROR((*w)->add_counter({"bytes.device", 0, 100}));
  MT_RETURN_IF_ERROR((*w)->add_counter({"bytes.device", 500, 300}));
  MT_RETURN_IF_ERROR((*w)->add_counter({"bytes.device", 1000, 0}));
  MT_RETURN_IF_ERROR((*w)->add_step({0, 2.5, 512, 900e-9}));
  return (*w)->close();
}

}  // namespace fixture
