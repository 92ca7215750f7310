// Every CPU op against an independent PyTorch implementation (tests/python/kernels_ref.py, written
// after the Hugging Face modeling code), in float64 and float32. This test writes inputs, dout and
// our outputs and gradients to a temporary folder; the script recomputes them with torch autograd and
// compares, with the project's venv Python (scripts/python-env.sh); a missing torch is a failure
// naming it.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "megatrain/kernels/cpu/moe.h"
#include "megatrain/kernels/cpu/ops.h"
#include "test_util.h"

namespace megatrain::cpu {
namespace {

namespace fs = std::filesystem;
using testing::random_vec;

// Collects named arrays of one case and writes them as raw little-endian files plus a JSON manifest.
class Dump {
 public:
  explicit Dump(fs::path dir) : dir_(std::move(dir)) {}

  void begin(const std::string& name, const std::string& op, const std::string& dtype, const std::string& params) {
    if (!cases_.empty()) cases_ += ",\n";
    name_ = name;
    cases_ += "{\"name\": \"" + name + "\", \"op\": \"" + op + "\", \"dtype\": \"" + dtype + "\", \"params\": {" +
              params + "}, \"arrays\": {";
    first_array_ = true;
  }
  template <typename T>
  void floats(const std::string& key, const std::vector<T>& v, const std::vector<int64_t>& shape) {
    std::vector<double> d(v.begin(), v.end());
    write(key, "f8", d.data(), d.size() * sizeof(double), shape);
  }
  void ints(const std::string& key, const std::vector<int32_t>& v, const std::vector<int64_t>& shape) {
    write(key, "i4", v.data(), v.size() * sizeof(int32_t), shape);
  }
  void end() { cases_ += "}}"; }

  void save() const {
    std::ofstream f(dir_ / "manifest.json");
    f << "{\"cases\": [\n" << cases_ << "\n]}\n";
  }

 private:
  void write(const std::string& key, const char* dtype, const void* data, size_t bytes, const std::vector<int64_t>& shape) {
    const std::string file = name_ + "." + key + ".bin";
    std::ofstream(dir_ / file, std::ios::binary).write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    std::string s;
    for (int64_t d : shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
    cases_ += std::string(first_array_ ? "" : ", ") + "\"" + key + "\": {\"file\": \"" + file + "\", \"dtype\": \"" +
              dtype + "\", \"shape\": [" + s + "]}";
    first_array_ = false;
  }

  fs::path dir_;
  std::string cases_, name_;
  bool first_array_ = true;
};

template <typename T>
std::vector<T> rv(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  const auto d = random_vec(n, seed, lo, hi);
  return {d.begin(), d.end()};
}

template <typename T>
void dump_all_ops(Dump& dump, const std::string& dtype) {
  CpuContext ctx(2);
  const std::string p = dtype + "_";
  {  // embedding
    const int64_t vocab = 11, hidden = 6, n = 9;
    const std::vector<int32_t> tok = {3, 0, 3, 10, 1, 3, 7, 2, 0};
    const auto table = rv<T>(vocab * hidden, 1), dout = rv<T>(n * hidden, 2);
    std::vector<T> out(n * hidden), dtable(vocab * hidden);
    ASSERT_TRUE(embedding_forward(ctx, tok.data(), n, table.data(), vocab, hidden, out.data()).ok());
    ASSERT_TRUE(embedding_backward(ctx, tok.data(), n, dout.data(), vocab, hidden, dtable.data()).ok());
    dump.begin(p + "embedding", "embedding", dtype, "");
    dump.ints("tokens", tok, {n});
    dump.floats("table", table, {vocab, hidden});
    dump.floats("dout", dout, {n, hidden});
    dump.floats("out", out, {n, hidden});
    dump.floats("dtable", dtable, {vocab, hidden});
    dump.end();
  }
  {  // rmsnorm
    const int64_t n = 5, dim = 40;
    const double eps = 1e-5;
    const auto x = rv<T>(n * dim, 3, -2, 2), w = rv<T>(dim, 4, 0.5, 1.5), dout = rv<T>(n * dim, 5);
    std::vector<T> y(n * dim), rstd(n), dx(n * dim), dw(dim);
    rmsnorm_forward(ctx, x.data(), w.data(), n, dim, eps, y.data(), rstd.data());
    rmsnorm_backward(ctx, dout.data(), x.data(), w.data(), rstd.data(), n, dim, dx.data(), dw.data());
    dump.begin(p + "rmsnorm", "rmsnorm", dtype, "\"eps\": 1e-05");
    dump.floats("x", x, {n, dim});
    dump.floats("w", w, {dim});
    dump.floats("dout", dout, {n, dim});
    dump.floats("y", y, {n, dim});
    dump.floats("dx", dx, {n, dim});
    dump.floats("dw", dw, {dim});
    dump.end();
  }
  // rope: default, linear and llama3 (small original context so every llama3 band is populated).
  struct RopeCase {
    const char* name;
    RopeConfig cfg;
    const char* params;
  };
  RopeConfig def{16, 10000};
  RopeConfig lin{16, 10000, RopeScaling::kLinear, 2.5};
  RopeConfig l3{16, 500000, RopeScaling::kLlama3, 8, 1, 4, 256};
  for (const RopeCase& rc :
       {RopeCase{"rope_default", def, "\"theta\": 10000, \"type\": \"default\""},
        RopeCase{"rope_linear", lin, "\"theta\": 10000, \"type\": \"linear\", \"factor\": 2.5"},
        RopeCase{"rope_llama3", l3,
                 "\"theta\": 500000, \"type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
                 "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 256"}}) {
    const int64_t n = 10, heads = 3, hd = 16;
    const std::vector<int32_t> pos = {0, 1, 2, 3, 4, 0, 1, 2, 3, 77};
    const auto x = rv<T>(n * heads * hd, 6), dout = rv<T>(n * heads * hd, 7);
    const auto inv = rope_inv_freq<T>(rc.cfg).value();
    std::vector<T> y(x.size()), dx(x.size());
    rope_forward(ctx, x.data(), y.data(), pos.data(), n, heads, hd, inv.data());
    rope_backward(ctx, dout.data(), dx.data(), pos.data(), n, heads, hd, inv.data());
    dump.begin(p + rc.name, "rope", dtype, rc.params);
    dump.ints("positions", pos, {n});
    dump.floats("x", x, {n, heads, hd});
    dump.floats("dout", dout, {n, heads, hd});
    dump.floats("y", y, {n, heads, hd});
    dump.floats("dx", dx, {n, heads, hd});
    dump.end();
  }
  for (bool bias : {true, false}) {  // linear (q/k/v projections with bias; LM head without)
    const int64_t n = 7, in = 10, out = 6;
    const auto x = rv<T>(n * in, 8), w = rv<T>(out * in, 9), b = rv<T>(out, 10), dout = rv<T>(n * out, 11);
    std::vector<T> y(n * out), dx(n * in), dw(out * in), db(out);
    linear_forward(ctx, x.data(), w.data(), bias ? b.data() : nullptr, n, in, out, y.data());
    linear_backward(ctx, dout.data(), x.data(), w.data(), n, in, out, dx.data(), false, dw.data(), db.data());
    dump.begin(p + (bias ? "linear_bias" : "linear_nobias"), "linear", dtype, bias ? "\"bias\": true" : "\"bias\": false");
    dump.floats("x", x, {n, in});
    dump.floats("w", w, {out, in});
    if (bias) dump.floats("b", b, {out});
    dump.floats("dout", dout, {n, out});
    dump.floats("y", y, {n, out});
    dump.floats("dx", dx, {n, in});
    dump.floats("dw", dw, {out, in});
    if (bias) dump.floats("db", db, {out});
    dump.end();
  }
  {  // attention with GQA
    const AttentionShape s{2, 6, 4, 2, 8};
    const size_t nq = 2 * 6 * 4 * 8, nkv = nq / 2;
    const auto q = rv<T>(nq, 12, -2, 2), k = rv<T>(nkv, 13, -2, 2), v = rv<T>(nkv, 14), dout = rv<T>(nq, 15);
    std::vector<T> out(nq), probs(static_cast<size_t>(attention_probs_elems(s))), ws(probs.size()), dq(nq), dk(nkv),
        dv(nkv);
    ASSERT_TRUE(attention_forward(ctx, s, q.data(), k.data(), v.data(), out.data(), probs.data()).ok());
    ASSERT_TRUE(attention_backward(ctx, s, q.data(), k.data(), v.data(), probs.data(), dout.data(), dq.data(),
                                   dk.data(), dv.data(), ws.data())
                    .ok());
    dump.begin(p + "attention", "attention", dtype, "");
    dump.floats("q", q, {2, 6, 4, 8});
    dump.floats("k", k, {2, 6, 2, 8});
    dump.floats("v", v, {2, 6, 2, 8});
    dump.floats("dout", dout, {2, 6, 4, 8});
    dump.floats("out", out, {2, 6, 4, 8});
    dump.floats("probs", probs, {2, 4, 6, 6});
    dump.floats("dq", dq, {2, 6, 4, 8});
    dump.floats("dk", dk, {2, 6, 2, 8});
    dump.floats("dv", dv, {2, 6, 2, 8});
    dump.end();
  }
  {  // swiglu
    const int64_t n = 5, inter = 12;
    const auto g = rv<T>(n * inter, 16, -5, 5), u = rv<T>(n * inter, 17), dout = rv<T>(n * inter, 18);
    std::vector<T> out(n * inter), dg(n * inter), du(n * inter);
    swiglu_forward(ctx, g.data(), u.data(), n * inter, out.data());
    swiglu_backward(ctx, g.data(), u.data(), dout.data(), n * inter, dg.data(), du.data());
    dump.begin(p + "swiglu", "swiglu", dtype, "");
    dump.floats("gate", g, {n, inter});
    dump.floats("up", u, {n, inter});
    dump.floats("dout", dout, {n, inter});
    dump.floats("out", out, {n, inter});
    dump.floats("dgate", dg, {n, inter});
    dump.floats("dup", du, {n, inter});
    dump.end();
  }
  // Sigmoid routing (DeepSeek-V3's router after its logits): 16 experts in 4 groups of 4, the best
  // 2 groups open, 3 chosen, renormalised and scaled; and one group (MiniMax-M2's form) unscaled
  // and without renormalisation.
  struct RouteCase {
    const char* name;
    int64_t groups, topk_group;
    bool renorm;
    double scale;
  };
  for (const RouteCase& rc : {RouteCase{"sigmoid_route_groups", 4, 2, true, 2.5}, RouteCase{"sigmoid_route_one_group", 1, 1, false, 1.0}}) {
    const int64_t n = 7, e = 16, k = 3;
    const auto z = rv<T>(n * e, 30, -3, 3), bias = rv<T>(e, 31, -0.1, 0.1), dw = rv<T>(n * k, 32);
    std::vector<int32_t> ex(n * k);
    std::vector<T> w(n * k), scores(n * e), dz(n * e);
    const SigmoidRoute r{rc.groups, rc.topk_group, rc.renorm, rc.scale};
    moe_sigmoid_route_forward(ctx, z.data(), bias.data(), n, e, k, r, ex.data(), w.data(), scores.data());
    moe_sigmoid_route_backward(ctx, scores.data(), ex.data(), dw.data(), n, e, k, r, dz.data());
    std::vector<T> sorted(n * k);  // each token's experts in increasing order, to compare as sets
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> row(ex.begin() + t * k, ex.begin() + (t + 1) * k);
      std::sort(row.begin(), row.end());
      for (int64_t j = 0; j < k; ++j) sorted[static_cast<size_t>(t * k + j)] = static_cast<T>(row[static_cast<size_t>(j)]);
    }
    dump.begin(p + rc.name, "sigmoid_route", dtype,
               "\"n_group\": " + std::to_string(rc.groups) + ", \"topk_group\": " + std::to_string(rc.topk_group) +
                   ", \"k\": " + std::to_string(k) + ", \"renorm\": " + (rc.renorm ? "true" : "false") + ", \"scale\": " + std::to_string(rc.scale));
    dump.floats("logits", z, {n, e});
    dump.floats("bias", bias, {e});
    dump.ints("expert", ex, {n, k});
    dump.floats("dweight", dw, {n, k});
    dump.floats("weight", w, {n, k});
    dump.floats("scores", scores, {n, e});
    dump.floats("expert_sorted", sorted, {n, k});
    dump.floats("dlogits", dz, {n, e});
    dump.end();
  }
  {  // cross-entropy, mean over non-ignored rows, dloss = 1
    const int64_t n = 6, vocab = 13;
    const auto x = rv<T>(n * vocab, 19, -4, 4);
    const std::vector<int32_t> t = {4, kIgnoreIndex, 0, 12, 4, 7};
    std::vector<T> lse(n), dx(n * vocab);
    CrossEntropyStats st;
    ASSERT_TRUE(cross_entropy_forward(ctx, x.data(), t.data(), n, vocab, lse.data(), static_cast<T*>(nullptr), &st).ok());
    ASSERT_TRUE(cross_entropy_backward(ctx, x.data(), t.data(), lse.data(), n, vocab,
                                       static_cast<T>(1.0 / static_cast<double>(st.count)), dx.data())
                    .ok());
    dump.begin(p + "cross_entropy", "cross_entropy", dtype, "\"ignore_index\": -1");
    dump.floats("logits", x, {n, vocab});
    dump.ints("targets", t, {n});
    dump.floats("loss", std::vector<double>{st.mean()}, {1});
    dump.floats("dlogits", dx, {n, vocab});
    dump.end();
  }
}

TEST(KernelsVsTorch, EveryOpInFloat64AndFloat32) {
  const std::string python = MEGATRAIN_TEST_PYTHON;  // the project's venv (scripts/python-env.sh)
  const fs::path script = fs::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "python" / "kernels_ref.py";
  ASSERT_TRUE(fs::exists(script)) << script;
  const fs::path dir = fs::temp_directory_path() / ("megatrain_kernels_vs_torch_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  Dump dump(dir);
  dump_all_ops<double>(dump, "float64");
  dump_all_ops<float>(dump, "float32");
  dump.save();

  const fs::path log = dir / "log.txt";
  const std::string cmd = python + " " + script.string() + " " + dir.string() + " > " + log.string() + " 2>&1";
  const int raw = std::system(cmd.c_str());
  const int rc = raw != -1 && WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::stringstream out;
  out << std::ifstream(log).rdbuf();
  std::printf("%s", out.str().c_str());
  EXPECT_EQ(rc, 0) << "kernels_ref.py found mismatches (inputs kept in " << dir << "):\n" << out.str();
  if (rc == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace megatrain::cpu
