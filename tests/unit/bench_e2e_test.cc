// `moex bench e2e` through the real binary on a tiny model: one row per format and test with consistent
// figures (bytes per step by format, FLOPs by batch, the roofline from the probes), and bad flags refused.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "moex/base/cpu.h"

namespace moex {
namespace {

std::string tiny_model() {
  static const std::string dir = [] {
    const std::string out = (std::filesystem::temp_directory_path() / "moex_bench_e2e_tiny").string();
    if (!std::filesystem::exists(out + "/config.json")) {
      const std::string cmd = std::string(MOEX_BINARY) + " gen-model --preset tiny --seed 5 --out " + out + " > /dev/null";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    return out;
  }();
  return dir;
}

std::string run(const std::string& args, int* status) {
  FILE* pipe = popen((std::string(MOEX_BINARY) + " bench e2e --model " + tiny_model() + " " + args + " 2>/dev/null").c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int s = pclose(pipe);
  *status = WIFEXITED(s) ? WEXITSTATUS(s) : -1;
  return out;
}

TEST(BenchE2E, OneRowPerFormatAndTestWithConsistentFigures) {
  // MOEX_ISA=ref runs no vector probe, so there is no compute peak to put a roofline on (the rows print none).
  if (!use_x86_kernels() && !use_avx2_kernels()) GTEST_SKIP() << "MOEX_ISA=ref: no dot-product probe, no roofline";
  int status = 0;
  const std::string out = run("--weights as-stored,bf16,int8-w8a8,int4 --pp 16 --tg 4 --batches 2,3 --batch-steps 2 "
                              "--repeats 1 --roofline-mb 64 --threads 2 --json", &status);
  ASSERT_EQ(status, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  const auto& rows = j.at("results");
  ASSERT_EQ(rows.size(), 4u * 4u) << out;
  std::map<std::string, std::map<std::string, nlohmann::json>> by;  // [weights][test]
  for (const auto& r : rows) {
    by[r.at("weights")][r.at("test")] = r;
    EXPECT_GT(r.at("ms").get<double>(), 0) << r;
    EXPECT_GT(r.at("tokens_per_s").get<double>(), 0) << r;
    EXPECT_GT(r.at("roofline_tokens_per_s").get<double>(), 0) << r;
    EXPECT_GT(r.at("read_gb_per_s").get<double>(), 0) << r;
    EXPECT_GT(r.at("peak_gflops").get<double>(), 0) << r;
    // %roof is the roofline time over the time taken, the roofline the slower of the read time and FLOPs:
    // the read time the replay probe's on tg and decode rows (and only there), else bytes over the DRAM probe (%dram).
    const double flops_s = r.at("flops").get<double>() / (r.at("peak_gflops").get<double>() * 1e9);
    const double dram_s = std::max(r.at("bytes").get<double>() / (r.at("read_gb_per_s").get<double>() * 1e9), flops_s);
    const std::string test = r.at("test").get<std::string>();
    const bool tg = test.rfind("tg", 0) == 0 || test.rfind("decode", 0) == 0;
    ASSERT_EQ(r.contains("replay_ms"), tg) << r;
    // the DRAM probe is the better of the probes before and after the format's rows
    EXPECT_DOUBLE_EQ(r.at("read_gb_per_s").get<double>(),
                     std::max(r.at("read_before_gb_per_s").get<double>(), r.at("read_after_gb_per_s").get<double>())) << r;
    const double roof_s = tg ? std::max(r.at("replay_ms").get<double>() * 1e-3, flops_s) : dram_s;
    EXPECT_NEAR(r.at("pct_roofline").get<double>(), 100 * roof_s / (r.at("ms").get<double>() * 1e-3),
                1e-6 * r.at("pct_roofline").get<double>()) << r;
    EXPECT_NEAR(r.at("pct_dram_roofline").get<double>(), 100 * dram_s / (r.at("ms").get<double>() * 1e-3),
                1e-6 * r.at("pct_dram_roofline").get<double>()) << r;
    // %parts: the experts' max(bytes / read rate, FLOPs / their peak) plus the rest's (dense peak), both at the
    // row's read rate; a sum of the parts' bounds, never below the bound of the step's totals (%roof).
    const double bytes_total = r.at("bytes").get<double>(), expert_bytes = r.at("expert_bytes").get<double>();
    EXPECT_GT(expert_bytes, 0) << r;
    EXPECT_LE(expert_bytes, bytes_total) << r;
    const double read_s = tg ? r.at("replay_ms").get<double>() * 1e-3 : bytes_total / (r.at("read_gb_per_s").get<double>() * 1e9);
    const double rate = bytes_total / read_s, expert_flops = r.at("expert_flops").get<double>();
    const double parts_s =
        std::max(expert_bytes / rate, expert_flops / (r.at("peak_gflops").get<double>() * 1e9)) +
        std::max((bytes_total - expert_bytes) / rate,
                 (r.at("flops").get<double>() - expert_flops) / (r.at("dense_peak_gflops").get<double>() * 1e9));
    EXPECT_NEAR(r.at("pct_parts_roofline").get<double>(), 100 * parts_s / (r.at("ms").get<double>() * 1e-3),
                1e-6 * r.at("pct_parts_roofline").get<double>()) << r;
    EXPECT_GE(r.at("pct_parts_roofline").get<double>(), r.at("pct_roofline").get<double>() * (1 - 1e-9)) << r;
    if (tg)
      EXPECT_NEAR(r.at("replay_gb_per_s").get<double>() * r.at("replay_ms").get<double>() * 1e6, r.at("bytes").get<double>(),
                  1e-6 * r.at("bytes").get<double>()) << r;
  }
  ASSERT_EQ(by.size(), 4u);
  for (const char* w : {"as-stored", "bf16", "int8-w8a8", "int4-g128"})
    for (const char* t : {"pp16", "tg4", "decode b2", "decode b3"}) ASSERT_TRUE(by[w].count(t)) << w << " " << t;
  // Bytes a batch-1 step reads: int4 < int8 < bf16 (their own codes and scales); FLOPs grow with the batch.
  const auto bytes = [&](const char* w) { return by[w]["tg4"].at("bytes").get<double>(); };
  EXPECT_LT(bytes("int4-g128"), bytes("int8-w8a8"));
  EXPECT_LT(bytes("int8-w8a8"), bytes("bf16"));
  EXPECT_NEAR(by["bf16"]["decode b3"].at("flops").get<double>() / by["bf16"]["decode b2"].at("flops").get<double>(), 1.5, 1e-9);
  // W8A8's compute roofline is the vpdpbusd peak, the others' the vdpbf16ps peak; a CPU with neither (AVX2
  // only, or AVX-512 without BF16 / VNNI) takes the f32 FMA peak for both.
  if (cpu_features().has_avx512_vnni_kernels() && cpu_features().has_avx512_bf16_kernels())
    EXPECT_GT(by["int8-w8a8"]["pp16"].at("peak_gflops").get<double>(), by["bf16"]["pp16"].at("peak_gflops").get<double>());
  // The peak is the best instruction's: AMX tiles where this process may use them, else the AVX-512 dot product.
  for (const char* w : {"bf16", "int8-w8a8"}) {
    const nlohmann::json& r = by[w]["pp16"];
    const bool int8 = std::string(w) == "int8-w8a8";
    const double vec = r.at(int8 ? "vpdpbusd_gops" : "vdpbf16ps_gflops").get<double>(),
                 amx = r.at(int8 ? "amx_int8_gops" : "amx_bf16_gflops").get<double>();
    EXPECT_EQ(amx > 0, use_amx_kernels()) << w;
    if (vec > 0 || amx > 0) EXPECT_DOUBLE_EQ(r.at("peak_gflops").get<double>(), std::max(vec, amx)) << w;
  }
}

TEST(BenchE2E, BadFlagsAreOneLineAndExit2) {
  int status = 0;
  run("--weights int3 --repeats 1", &status);
  EXPECT_EQ(status, 2);
  run("--weights bf16 --cpu-clock --threads 2 --repeats 1", &status);
  EXPECT_EQ(status, 2);
  run("--weights bf16 --group-size 64 --repeats 1", &status);
  EXPECT_EQ(status, 2);
  run("--weights bf16 --batches 0 --repeats 1", &status);
  EXPECT_EQ(status, 2);
}

}  // namespace
}  // namespace moex
