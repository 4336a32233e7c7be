#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <thread>

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/mapped_file.h"
#include "moex/base/small_file.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "moex/comm/selector.h"
#include "moex/model/config.h"
#include "moex/model/decoder.h"
#include "moex/model/panels_file.h"
#include "moex/model/safetensors_index.h"
#include "moex/runtime/run_memory.h"
#include "moex/text/tokenizer.h"
#include "test_util.h"

namespace moex {
namespace {

using test::expect_input_error;
using test::replace;

const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": false, "sliding_window": null,
  "hidden_act": "silu", "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.02, "output_router_logits": false,
  "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": true,
  "transformers_version": "4.36.0", "router_jitter_noise": 0.0})";

TEST(Config, ParsesMixtral8x7B) {
  const ModelConfig c = parse_model_config(kMixtral, "config.json");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  EXPECT_TRUE(c.norm_topk_prob);
  // 46.7B parameters in all, 12.9B active per token: the published Mixtral figures. The published
  // "active" count includes the whole embedding table; a decoded token reads only its own row.
  EXPECT_NEAR(c.total_params() / 1e9, 46.7, 0.05);
  const double embedding_rows_not_read = (c.vocab_size - 1.0) * c.hidden_size;
  EXPECT_NEAR((c.active_params_per_token() + embedding_rows_not_read) / 1e9, 12.9, 0.05);
}

TEST(Config, RoundTripsThroughJson) {
  ModelConfig c = parse_model_config(kMixtral, "a");
  c.norm_topk_prob = false;
  const ModelConfig back = parse_model_config(model_config_to_json(c), "b");
  EXPECT_EQ(back.hidden_size, c.hidden_size);
  EXPECT_EQ(back.norm_topk_prob, false);
  EXPECT_EQ(back.num_experts_per_tok, c.num_experts_per_tok);
}

TEST(Config, RejectsWhatItCannotRunWithOneLine) {
  const struct {
    std::string json, cause;
  } cases[] = {
      {replace(kMixtral, R"("model_type": "mixtral")", R"("model_type": "llama")"), "model_type"},
      {replace(kMixtral, R"("hidden_size": 4096)", R"("hidden_size": 4095)"), "not divisible"},
      {replace(kMixtral, R"("num_key_value_heads": 8)", R"("num_key_value_heads": 5)"), "num_key_value_heads"},
      {replace(kMixtral, R"("num_experts_per_tok": 2)", R"("num_experts_per_tok": 9)"), "num_experts_per_tok"},
      {replace(kMixtral, R"("vocab_size": 32000,)", ""), "vocab_size"},
      {replace(kMixtral, R"("vocab_size": 32000)", R"("vocab_size": "many")"), "wrong type"},
      {replace(kMixtral, R"("use_cache": true)", R"("use_cache": true, "shared_expert_size": 4)"), "unknown field"},
      {replace(kMixtral, R"("sliding_window": null)", R"("sliding_window": 4096)"), "sliding_window"},
      {replace(kMixtral, R"("hidden_act": "silu")", R"("hidden_act": "gelu")"), "hidden_act"},
      {"{", "not valid JSON"},
  };
  for (const auto& c : cases) {
    try {
      parse_model_config(c.json, "config.json");
      ADD_FAILURE() << "accepted a config with: " << c.cause;
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), 2);
      EXPECT_NE(std::string(e.what()).find(c.cause), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line: " << e.what();
    }
  }
}

TEST(Config, AcceptsOnlyExactIntegersInRange) {
  // nlohmann's get<int>() turned each of these into a number: 1.9 -> 1 layer, true -> 1, 4294967808 -> 512.
  const struct {
    std::string from, to, cause;
  } cases[] = {
      {R"("num_hidden_layers": 32)", R"("num_hidden_layers": 1.9)", "must be an integer, got 1.9"},
      {R"("num_hidden_layers": 32)", R"("num_hidden_layers": 32.0)", "must be an integer"},
      {R"("num_key_value_heads": 8)", R"("num_key_value_heads": true)", "has the wrong type (boolean), expected an integer"},
      {R"("vocab_size": 32000)", R"("vocab_size": 4294967808)", "out of range"},
      {R"("hidden_size": 4096)", R"("hidden_size": -4294967296)", "out of range"},
      {R"("num_local_experts": 8)", R"("num_local_experts": 1e1)", "must be an integer"},
      {R"("sliding_window": null)", R"("sliding_window": 18446744073709551615)", "out of range"},
      {R"("eos_token_id": 2)", R"("eos_token_id": "2")", "has the wrong type (string)"},
  };
  for (const auto& c : cases)
    expect_input_error([&] { parse_model_config(replace(kMixtral, c.from, c.to), "config.json"); }, c.cause);
  // The largest int still reads exactly (and then fails on what it means, not on its type).
  expect_input_error([&] { parse_model_config(replace(kMixtral, R"("bos_token_id": 1)", R"("bos_token_id": 2147483647)"), "c"); },
                     "bos_token_id (2147483647)");
}

TEST(Config, FloatsMustBeFinitePositiveAndFitAFloat) {
  const struct {
    std::string from, to, cause;
  } cases[] = {
      {R"("rope_theta": 1000000.0)", R"("rope_theta": 1e39)", "not a finite 32-bit float"},  // inf as a float
      {R"("rope_theta": 1000000.0)", R"("rope_theta": -1.0)", "rope_theta (-1) must be finite and positive"},
      {R"("rope_theta": 1000000.0)", R"("rope_theta": true)", "has the wrong type (boolean), expected a number"},
      {R"("rms_norm_eps": 1e-05)", R"("rms_norm_eps": 0)", "rms_norm_eps (0) must be finite and positive"},
      {R"("rms_norm_eps": 1e-05)", R"("rms_norm_eps": "1e-5")", "has the wrong type (string)"},
      {R"("router_aux_loss_coef": 0.02)", R"("router_aux_loss_coef": -1)", "router_aux_loss_coef"},
  };
  for (const auto& c : cases)
    expect_input_error([&] { parse_model_config(replace(kMixtral, c.from, c.to), "config.json"); }, c.cause);
  // Integers are fine where a float is wanted.
  EXPECT_EQ(parse_model_config(replace(kMixtral, R"("rope_theta": 1000000.0)", R"("rope_theta": 10000)"), "c").rope_theta,
            10000.0f);
}

TEST(Config, RejectsSizesWhoseProductsOverflow) {
  expect_input_error([] { parse_model_config(replace(replace(kMixtral, R"("num_attention_heads": 32)",
                                                                   R"("num_attention_heads": 65536, "head_dim": 65536)"),
                                                           R"("num_key_value_heads": 8)", R"("num_key_value_heads": 1)"),
                                                   "c"); },
                     "num_attention_heads x head_dim");
  expect_input_error([] { parse_model_config(replace(kMixtral, R"("intermediate_size": 14336)",
                                                     R"("intermediate_size": 2000000000)"), "c"); },
                     "parameters");
  expect_input_error([] { parse_model_config(replace(kMixtral, R"("eos_token_id": 2)", R"("eos_token_id": 32000)"), "c"); },
                     "eos_token_id (32000) must be token ids below vocab_size (32000)");
}

// A fresh directory under the test's temporary folder, removed at the end of the test.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("moex_config_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// Every file MoEX reads whole: a FIFO is refused at once (opening it for reading would wait for a writer
// forever), a device is refused before it is read (/dev/zero never ends), and so is a directory.
TEST(SmallFile, RefusesFifosDevicesAndDirectoriesWithoutBlocking) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  std::filesystem::create_symlink("/dev/zero", dir.file("zero"));
  std::filesystem::create_directory(dir.file("folder"));
  const auto start = std::chrono::steady_clock::now();
  const std::function<void(const std::string&)> readers[] = {
      [](const std::string& p) { read_small_file(p, kMaxJsonFileBytes); },
      [](const std::string& p) { MappedFile file(p); },
      [](const std::string& p) { load_model_config(p); },
      [](const std::string& p) { load_safetensors_index(p); },
      [](const std::string& p) { Tokenizer tokenizer(p); },
      [](const std::string& p) { comm::TuningTable::load(p); },
  };
  for (const auto& read : readers) {
    expect_input_error([&] { read(dir.file("fifo")); }, "is a FIFO (named pipe), not a regular file");
    expect_input_error([&] { read(dir.file("zero")); }, "is a character device, not a regular file");
    expect_input_error([&] { read(dir.file("folder")); }, "is a directory, not a regular file");
    expect_input_error([&] { read(dir.file("missing")); }, "No such file or directory");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(SmallFile, ReadsUpToTheLimitAndStatesItBeyond) {
  TempDir dir;
  const std::string text(1000, 'x');
  write_file(dir.file("a"), text);
  EXPECT_EQ(read_small_file(dir.file("a"), 1000), text);
  expect_input_error([&] { read_small_file(dir.file("a"), 999); }, "larger than the 999 bytes limit for this file (1000 bytes)");
  write_file(dir.file("big.json"), std::string(kMaxJsonFileBytes + 1, ' '));
  expect_input_error([&] { load_model_config(dir.file("big.json")); }, "larger than the 16 MiB limit");
  // A file whose size stat() does not know (/proc reports 0) is still read to its end.
  EXPECT_NE(read_small_file("/proc/self/status", 1 << 20).find("Pid:"), std::string::npos);
  expect_input_error([&] { read_small_file("/proc/self/status", 10); }, "larger than the 10 bytes limit");
  expect_input_error([&] { load_model_config(dir.file("missing.json")); }, "(is --model a Hugging Face model folder?)");
}

// The fuzz targets start from tests/fuzz/seeds: the valid seeds must stay valid, or the fuzzers would only
// explore error paths.
TEST(FuzzSeeds, ValidSeedsParse) {
  const std::string seeds = std::string(MOEX_SOURCE_DIR) + "/tests/fuzz/seeds";
  EXPECT_EQ(load_model_config(seeds + "/config/mixtral-8x7b.json").num_hidden_layers, 32);
  EXPECT_EQ(load_model_config(seeds + "/config/tiny.json").head_dim, 16);
  EXPECT_THROW(load_model_config(seeds + "/config/edges.json"), Error);
  EXPECT_EQ(load_safetensors_index(seeds + "/index/two-shards.json").shards.size(), 2u);
  EXPECT_THROW(load_safetensors_index(seeds + "/index/bad-names.json"), Error);
}

TEST(SafetensorsIndex, ShardNamesStayInTheModelFolder) {
  const SafetensorsIndex index = parse_safetensors_index(
      R"({"metadata": {}, "weight_map": {"b": "two.safetensors", "a": "one.safetensors", "c": "one.safetensors"}})", "i");
  EXPECT_EQ(index.shards, (std::vector<std::string>{"one.safetensors", "two.safetensors"}));
  EXPECT_EQ(index.weight_map.at("b"), "two.safetensors");
  for (const char* bad : {R"("../x.safetensors")", R"("/etc/passwd")", R"("")", R"(".")", R"("a\u0000b")"})
    expect_input_error([&] { parse_safetensors_index(std::string(R"({"weight_map": {"t": )") + bad + "}}", "i"); },
                       "must be a plain file name");
  expect_input_error([] { parse_safetensors_index(R"({"weight_map": {"t": 3}})", "i"); }, "is not a file name");
  expect_input_error([] { parse_safetensors_index("[]", "i"); }, "has no weight_map object");
  expect_input_error([] { parse_safetensors_index("{", "i"); }, "not valid JSON");
}

TEST(SystemMemory, ParsesMeminfoAndCgroupFiles) {
  EXPECT_EQ(parse_meminfo_available("MemTotal:       32768000 kB\nMemFree:  100 kB\nMemAvailable:   24032544 kB\n"),
            uint64_t{24032544} * 1024);
  EXPECT_EQ(parse_meminfo_available("MemTotal: 1 kB\n"), std::nullopt);
  EXPECT_EQ(parse_cgroup_limit("max\n"), std::nullopt);
  EXPECT_EQ(parse_cgroup_limit("9223372036854771712\n"), std::nullopt);  // cgroup v1: no limit
  EXPECT_EQ(parse_cgroup_limit("4294967296\n"), uint64_t{4294967296});
  // 4 GB limit, 3 GB charged of which 1 GB is reclaimable page cache: 2 GB left.
  EXPECT_EQ(cgroup_headroom(4000, 3000, 1000), 2000u);
  EXPECT_EQ(cgroup_headroom(4000, 5000, 0), 0u);
  const std::optional<AvailableMemory> here = available_memory();
  ASSERT_TRUE(here.has_value());  // Linux has /proc/meminfo
  EXPECT_GT(here->bytes, 0u);
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16, c.max_position_embeddings = 4096;
  return c;
}

TEST(RunMemory, KvCacheEstimateIsWhatTheCacheAllocates) {
  const ModelConfig c = tiny_config();
  for (const int batch : {1, 3}) {
    for (const int seq : {16, 1000}) {
      ModelOptions options;
      options.max_batch = batch, options.max_seq_len = seq;
      for (const KvCacheDType dtype : {KvCacheDType::kF32, KvCacheDType::kBF16}) {
        options.kv_cache_dtype = dtype;
        const PagedKvCache cache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                 DecoderModel::kv_cache_layout(c, options).num_blocks, dtype);
        EXPECT_EQ(estimate_run_memory(c, options, 2).kv_cache_bytes, static_cast<double>(cache.bytes()));
        EXPECT_GE(cache.capacity_positions(), int64_t{batch} * seq);  // every sequence its whole length
      }
    }
  }
  // --kv-cache-gb: the whole blocks that fit.
  ModelOptions sized;
  sized.kv_cache_gb = 0.001, sized.kv_cache_dtype = KvCacheDType::kBF16;
  const PagedKvCache by_gb(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 0.001, KvCacheDType::kBF16);
  EXPECT_EQ(estimate_run_memory(c, sized, 1).kv_cache_bytes, static_cast<double>(by_gb.bytes()));
  // Attention TP over 2 ranks: each caches half the KV heads.
  ModelOptions tp;
  tp.max_batch = 2, tp.max_seq_len = 64, tp.plan.world = 2, tp.plan.tp = 2;
  EXPECT_EQ(estimate_run_memory(c, tp, 1).kv_cache_bytes,
            static_cast<double>(PagedKvCache(c.num_hidden_layers, 1, c.head_dim, int64_t{2 * 4}, KvCacheDType::kF32).bytes()));
}

TEST(RunMemory, RefusesWithTheFiguresWhatDoesNotFit) {
  const ModelConfig c = tiny_config();
  ModelOptions options;
  options.max_batch = 3, options.max_seq_len = 100000000;
  const RunMemory need = estimate_run_memory(c, options, 2);
  // 2 layers x 3 sequences x 2 KV heads x 1e8 positions x 16 x 4 bytes, for K and for V.
  EXPECT_EQ(need.kv_cache_bytes, 2.0 * 2 * 3 * 2 * 1e8 * 16 * 4);
  const AvailableMemory small{uint64_t{3} << 30, "MemAvailable in /proc/meminfo"};
  expect_input_error([&] { check_run_memory(need, c, options, small); },
                     "(KV cache 153.6 GB for 3 sequence(s) x 100000000 positions x 2 layers");
  expect_input_error([&] { check_run_memory(need, c, options, small); }, "3.2 GB is available");
  expect_input_error([&] { check_run_memory(need, c, options, small); }, "lower --max-seq-len");
  EXPECT_NO_THROW(check_run_memory(need, c, options, AvailableMemory{uint64_t{1} << 40, "x"}));
  EXPECT_NO_THROW(check_run_memory(need, c, options, std::nullopt));  // unknown: not checked
}

TEST(RunMemory, WhenThePackedCopyIsMostOfItTheHintIsTheMappedCheckpoint) {
  const ModelConfig c = tiny_config();
  ModelOptions options;  // the default path: the experts and dense weights packed to bf16 at load
  options.expert_weights.packed = options.dense_weights.packed = true;
  RunMemory need = estimate_run_memory(c, options, 1);
  EXPECT_GT(need.packed_bytes, 0);
  need.packed_bytes = 1e12;  // a checkpoint far larger than the KV cache and buffers
  const AvailableMemory small{uint64_t{3} << 30, "MemAvailable in /proc/meminfo"};
  expect_input_error([&] { check_run_memory(need, c, options, small); }, "packed weights 1000.0 GB");
  expect_input_error([&] { check_run_memory(need, c, options, small); }, "--exact");
  expect_input_error([&] { check_run_memory(need, c, options, small); }, "moex pack");
}

// With panels found (moex pack), what this rank holds whole is a mapping, not a copy; a TP slice is still packed.
TEST(RunMemory, MappedPanelsAreNotCountedAsPackedCopies) {
  const ModelConfig c = tiny_config();
  ModelOptions options;
  options.expert_weights.packed = options.dense_weights.packed = true;
  EXPECT_GT(estimate_run_memory(c, options, 1, false).packed_bytes, 0);
  EXPECT_EQ(estimate_run_memory(c, options, 1, true).packed_bytes, 0);
  ModelOptions tp = options;
  tp.plan.world = 2, tp.plan.tp = 2;
  const double sliced = estimate_run_memory(c, tp, 1, true).packed_bytes;
  EXPECT_GT(sliced, 0);  // experts' and attention's halves
  EXPECT_LT(sliced, estimate_run_memory(c, tp, 1, false).packed_bytes);  // lm_head is whole: mapped
  // int8 is packed at load whatever the file holds (moex pack writes bf16 panels only).
  ModelOptions int8 = options;
  int8.expert_weights.format = kernels::WeightFormat::kInt8;
  EXPECT_GT(estimate_run_memory(c, int8, 1, true).packed_bytes, 0);
}

// panels_present reads only the file's metadata: its kind and layout version, written here by hand.
TEST(RunMemory, PanelsPresentReadsTheKindAndLayout) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("moex_panels_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& weights, int layout) {
    std::string header = R"({"__metadata__":{"moex_panels_weights":")" + weights + R"(","moex_panels_layout":")" +
                         std::to_string(layout) + R"("},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
    while ((8 + header.size()) % 8) header += ' ';
    std::ofstream out(dir / "panels.moex", std::ios::binary);
    for (int b = 0; b < 8; ++b) out.put(static_cast<char>((uint64_t{header.size()} >> (8 * b)) & 0xff));
    out << header << std::string(4, '\0');
  };
  const std::string d = dir.string();
  EXPECT_FALSE(panels_present(d, "", "bf16"));  // none yet
  write("bf16", kernels::kPackedLayoutVersion);
  EXPECT_TRUE(panels_present(d, "", "bf16"));
  EXPECT_TRUE(panels_present("/nonexistent", (dir / "panels.moex").string(), "bf16"));  // --panels PATH
  EXPECT_FALSE(panels_present(d, "none", "bf16"));                                      // --panels none
  EXPECT_FALSE(panels_present(d, "", kPanelsStored));                                  // another kind
  write("bf16", kernels::kPackedLayoutVersion + 1);
  EXPECT_FALSE(panels_present(d, "", "bf16"));  // another build's layout: packed at load
  { std::ofstream(dir / "panels.moex", std::ios::binary) << "damaged"; }
  EXPECT_FALSE(panels_present(d, "", "bf16"));  // the load reports it
  std::filesystem::remove_all(dir);
}

// The one decision of which panels kind a load wants (the load and the run-memory estimate both ask it).
TEST(RunMemory, PanelsKindIsStoredForAQuantizedCheckpointElseTheFormatItPacksTo) {
  using kernels::WeightFormat;
  const ExpertWeightFormat as_stored{}, bf16{true, WeightFormat::kBF16}, int8{true, WeightFormat::kInt8},
      fp8{true, WeightFormat::kFP8E4M3};
  EXPECT_EQ(panels_kind(true, as_stored, as_stored), kPanelsStored);  // a quantized checkpoint: its own codes
  EXPECT_EQ(panels_kind(true, bf16, bf16), kPanelsStored);
  EXPECT_EQ(panels_kind(false, bf16, bf16), "bf16");
  EXPECT_EQ(panels_kind(false, as_stored, bf16), "bf16");  // --weights as-stored --dense-weights bf16
  EXPECT_EQ(panels_kind(false, int8, bf16), "bf16");       // bf16 anywhere: the kind moex pack writes
  EXPECT_EQ(panels_kind(false, int8, as_stored), "int8");
  EXPECT_EQ(panels_kind(false, as_stored, fp8), "fp8-e4m3");
  EXPECT_EQ(panels_kind(false, as_stored, as_stored), "");  // packs nothing
  EXPECT_TRUE(panels_kind_written_beside(kPanelsStored));
  EXPECT_TRUE(panels_kind_written_beside("bf16"));
  EXPECT_FALSE(panels_kind_written_beside("int8"));
  EXPECT_FALSE(panels_kind_written_beside(""));
}

// Sets an environment variable for the scope.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    ::setenv(n, value, 1);
  }
  ~ScopedEnv() { old ? ::setenv(name.c_str(), old->c_str(), 1) : ::unsetenv(name.c_str()); }
};

TEST(Threads, CountsAndEnvironmentAreBounded) {
  const int before = num_threads();
  expect_input_error([] { set_num_threads(-1); }, "--threads -1 must be in 1..");
  expect_input_error([] { set_num_threads(max_threads() + 1); }, "this machine has");
  EXPECT_EQ(max_threads(), kMaxThreadsPerCpu * std::max<int>(cpu_count(), std::thread::hardware_concurrency()));
  {
    ScopedEnv env("MOEX_THREADS", "abc");
    expect_input_error([] { set_num_threads(0); }, "MOEX_THREADS='abc'");
    set_num_threads(1);  // a count on the command line does not read the variable
    EXPECT_EQ(num_threads(), 1);
  }
  {
    ScopedEnv env("MOEX_THREADS", "3x");
    expect_input_error([] { set_num_threads(0); }, "MOEX_THREADS='3x'");
  }
  {
    ScopedEnv env("MOEX_THREADS", "1");
    set_num_threads(0);  // 0: the variable decides
    EXPECT_EQ(num_threads(), 1);
  }
  {
    ScopedEnv env("MOEX_ISA", "bogus");
    expect_input_error([] { check_isa_env(); }, "MOEX_ISA='bogus' is not a kernel set (valid: auto, ref, avx512");
    expect_input_error([] { set_num_threads(1); }, "MOEX_ISA");
  }
  for (const char* ok : {"ref", "auto", ""}) {
    ScopedEnv env("MOEX_ISA", ok);
    EXPECT_NO_THROW(check_isa_env()) << ok;
  }
  {
    ScopedEnv env("MOEX_ISA", "avx2");
    if (cpu_features().has_avx2_kernels()) EXPECT_NO_THROW(check_isa_env());
    else expect_input_error([] { check_isa_env(); }, "MOEX_ISA=avx2, but this CPU lacks AVX2");
  }
  set_num_threads(before);
}

#ifdef MOEX_BINARY
// MOEX_ISA=avx2 runs what a CPU without AVX-512 runs: every packed format on its AVX2 kernel (read before main,
// so through a child process).
TEST(Config, IsaAvx2RunsTheAvx2Kernels) {
  if (!cpu_features().has_avx2_kernels()) GTEST_SKIP() << "no AVX2 on this CPU";
  FILE* pipe = popen(("MOEX_ISA=avx2 " + std::string(MOEX_BINARY) + " info 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, pipe)) out += buf;
  EXPECT_EQ(pclose(pipe), 0) << out;
  EXPECT_NE(out.find("bf16=avx2 int8=avx2 int8-w8a8=avx2 int4=avx2 int4-w4a8=avx2 fp8-e4m3=avx2"), std::string::npos)
      << out;
}
#endif

}  // namespace
}  // namespace moex
