// The tokenizer tests' driver (tests/tokenizer/*.js, *.py compare what it prints with Hugging Face's
// `tokenizers` and with SentencePiece):
//   tokenizer_probe write-byte-level qwen2|olmoe VOCAB DIR   tokenizer.json + tokenizer_config.json
//   tokenizer_probe write-mixtral VOCAB DIR                  tokenizer.model + its tokenizer.json + config
//   tokenizer_probe bench DIR                                 encode speed, tokenizer.json vs tokenizer.model
//   tokenizer_probe run PATH CASES.json OUT.json               encode / decode every case with moex::Tokenizer
//                                                             (PATH: a model folder, or the tokenizer file)
// CASES.json: {"texts": [{"text": "..."} or {"hex": "ff41"}], "id_lists": [[1, 2, 3], ...]}.
// OUT.json: per text "ids" (add special tokens), "ids_plain" (without), "decoded" (ids decoded, specials
// skipped), "roundtrip" (ids_plain decoded), and, for a tokenizer.json, "decoded_keep" (specials kept); per id list "decoded" likewise,
// and for a tokenizer.json "decoded_tokenizers" (JsonTokenizer with `tokenizers`' rule for byte runs that are not
// UTF-8, where moex::Tokenizer keeps SentencePiece's). Text comes back as hex so that no JSON layer changes a byte.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/text/tokenizer.h"
#include "moex/text/tokenizer_json.h"
#include "tools/lib/tokenizer_train.h"

namespace {

using json = nlohmann::json;

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string to_hex(const std::string& s) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string from_hex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

int run(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "write-byte-level" && argc == 5) {
    const std::string kind = argv[2];
    const int vocab = std::stoi(argv[3]);
    const moex::ByteLevelBpeOptions options =
        kind == "qwen2" ? moex::qwen2_tokenizer_options(vocab) : moex::olmoe_tokenizer_options(vocab);
    const moex::TrainedByteLevelBpe t = moex::train_byte_level_bpe(options);
    write(std::string(argv[4]) + "/tokenizer.json", t.tokenizer_json);
    write(std::string(argv[4]) + "/tokenizer_config.json", t.tokenizer_config_json);
    std::printf("%s: %d tokens, %d merges\n", kind.c_str(), t.vocab_size, t.merges);
    return 0;
  }
  if (mode == "write-mixtral" && argc == 4) {
    const moex::TrainedTokenizer t = moex::train_builtin_tokenizer(std::stoi(argv[2]));
    const std::string dir = argv[3];
    write(dir + "/tokenizer.model", t.model_proto);
    write(dir + "/tokenizer.json", moex::mixtral_tokenizer_json(t.model_proto));
    write(dir + "/tokenizer_config.json", moex::llama_tokenizer_config_json(4096));
    std::printf("mixtral: %d pieces (%d trained)\n", t.vocab_size, t.trained_pieces);
    return 0;
  }
  if (mode == "bench" && argc == 3) {
    // Encode throughput of the built-in corpus line by line, tokenizer.json (MoEX's BPE) against
    // tokenizer.model (libsentencepiece) of the same folder, interleaved, median of 5.
    const std::string dir = argv[2];
    const std::string corpus = moex::builtin_english_corpus();
    std::vector<std::string> lines;
    for (size_t a = 0, b; a < corpus.size(); a = b + 1) {
      b = corpus.find('\n', a);
      if (b == std::string::npos) b = corpus.size();
      lines.push_back(corpus.substr(a, b - a));
    }
    auto t0 = std::chrono::steady_clock::now();
    const moex::Tokenizer json_tok(dir + "/tokenizer.json");
    const double load_json = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t0 = std::chrono::steady_clock::now();
    const moex::Tokenizer sp_tok(dir + "/tokenizer.model");
    const double load_sp = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<double> json_s, sp_s;
    size_t tokens = 0;
    for (int rep = 0; rep < 5; ++rep) {
      for (const moex::Tokenizer* t : {&json_tok, &sp_tok}) {
        const auto start = std::chrono::steady_clock::now();
        size_t n = 0;
        for (const std::string& line : lines) n += t->encode(line, true).size();
        (t == &json_tok ? json_s : sp_s).push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        tokens = n;
      }
    }
    std::sort(json_s.begin(), json_s.end());
    std::sort(sp_s.begin(), sp_s.end());
    const double mb = corpus.size() / 1e6;
    std::printf("corpus %.2f MB, %zu lines, %zu tokens\n", mb, lines.size(), tokens);
    std::printf("load: tokenizer.json %.3f s, tokenizer.model %.3f s\n", load_json, load_sp);
    std::printf("encode (median of 5): tokenizer.json %.2f MB/s, tokenizer.model %.2f MB/s, ratio %.2f\n",
                mb / json_s[2], mb / sp_s[2], sp_s[2] / json_s[2]);
    return 0;
  }
  if (mode == "run" && argc == 5) {
    const std::string path = argv[2];
    const moex::Tokenizer tokenizer =
        std::filesystem::is_directory(path) ? moex::Tokenizer::for_model(path) : moex::Tokenizer(path);
    std::unique_ptr<moex::JsonTokenizer> json_tokenizer;
    if (tokenizer.file().ends_with(".json")) json_tokenizer = moex::JsonTokenizer::parse(read(tokenizer.file()), tokenizer.file());
    const json cases = json::parse(read(argv[3]));
    json out = {{"file", tokenizer.file()}, {"vocab_size", tokenizer.vocab_size()}, {"bos_id", tokenizer.bos_id()},
                {"eos_id", tokenizer.eos_id()}, {"texts", json::array()}, {"id_lists", json::array()}};
    for (const json& c : cases["texts"]) {
      const std::string text = c.contains("hex") ? from_hex(c["hex"]) : c["text"].get<std::string>();
      json r;
      const std::vector<int> ids = tokenizer.encode(text, true);
      r["ids"] = ids;
      const std::vector<int> plain = tokenizer.encode(text, false);
      r["ids_plain"] = plain;
      r["decoded"] = to_hex(tokenizer.decode(ids));
      r["roundtrip"] = to_hex(tokenizer.decode(plain));
      if (json_tokenizer) r["decoded_keep"] = to_hex(json_tokenizer->decode(ids, false));
      out["texts"].push_back(r);
    }
    for (const json& list : cases["id_lists"]) {
      const std::vector<int> ids = list.get<std::vector<int>>();
      json r = {{"decoded", to_hex(tokenizer.decode(ids))}};
      if (json_tokenizer) {
        r["decoded_keep"] = to_hex(json_tokenizer->decode(ids, false));
        r["decoded_tokenizers"] = to_hex(json_tokenizer->decode(ids, true));
      }
      out["id_lists"].push_back(r);
    }
    write(argv[4], out.dump() + "\n");
    return 0;
  }
  std::fprintf(stderr, "usage: tokenizer_probe write-byte-level qwen2|olmoe VOCAB DIR | write-mixtral VOCAB DIR | run PATH CASES.json OUT.json\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const moex::Error& e) {
    std::fprintf(stderr, "tokenizer_probe: error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_probe: error: %s\n", e.what());
    return 1;
  }
}
