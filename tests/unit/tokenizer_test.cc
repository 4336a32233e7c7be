// tokenizer.json: malformed files refused with one line, the pieces of the pipeline on cases worked out by
// hand from the format's definition, the model-folder choice, and the writers' files. Agreement with
// Hugging Face's and SentencePiece's own implementations is tests/tokenizer (a corpus, every id).
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/text/tokenizer.h"
#include "moex/text/tokenizer_json.h"
#include "tools/lib/tokenizer_train.h"

namespace moex {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// A small byte-level-free BPE file to mutate: vocab a b c ab bc abc + "<s>", merges a+b, b+c, ab+c.
json base_file() {
  return json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 6, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
                      "normalized": false, "special": true}],
    "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
              "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "<s>": 6},
              "merges": ["a b", "b c", "ab c"]}})");
}

std::string parse_error(const json& j) {
  try {
    JsonTokenizer::parse(j.dump(), "t/tokenizer.json");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_EQ(m.rfind("t/tokenizer.json: ", 0), 0u) << m;
    return m;
  }
  ADD_FAILURE() << "accepted: " << j.dump();
  return "";
}

#define EXPECT_REFUSED(edit, cause)                                                    \
  do {                                                                                 \
    json j = base_file();                                                              \
    edit;                                                                              \
    const std::string m = parse_error(j);                                              \
    EXPECT_NE(m.find(cause), std::string::npos) << "got: " << m;                       \
  } while (0)

TEST(TokenizerJson, RefusesMalformedFilesWithOneLine) {
  for (const char* text : {"", "not json", "{\"model\": ", "\xff\xfe"}) {
    try {
      JsonTokenizer::parse(text, "t/tokenizer.json");
      ADD_FAILURE() << "accepted " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
  EXPECT_REFUSED(j = json::array(), "expected an object");
  EXPECT_REFUSED(j.erase("model"), "\"model\" is missing");
  EXPECT_REFUSED(j["extra"] = 1, "unknown field \"extra\"");
  EXPECT_REFUSED(j["model"]["type"] = "WordPiece", "model type \"WordPiece\" is not supported");
  EXPECT_REFUSED(j["model"]["type"] = 3, "\"type\" must be a string");
  EXPECT_REFUSED(j["model"]["vocab_extra"] = 1, "unknown field \"vocab_extra\"");
  EXPECT_REFUSED(j["truncation"] = json::object(), "\"truncation\" must be null");
  EXPECT_REFUSED(j["padding"] = json::object(), "\"padding\" must be null");
  EXPECT_REFUSED(j["model"]["dropout"] = 0.1, "\"dropout\" must be null");
  EXPECT_REFUSED(j["model"]["continuing_subword_prefix"] = "##", "\"continuing_subword_prefix\" is not supported");
  EXPECT_REFUSED(j["model"]["vocab"] = json::array(), "\"vocab\" must be an object");
  EXPECT_REFUSED(j["model"]["vocab"] = json::object(), "\"vocab\" is empty");
  EXPECT_REFUSED(j["model"]["vocab"]["d"] = -1, "the id of \"d\" must be an integer");
  EXPECT_REFUSED(j["model"]["vocab"]["d"] = "7", "the id of \"d\" must be an integer");
  EXPECT_REFUSED(j["model"]["vocab"]["d"] = 1, "id 1 is given to both");
  EXPECT_REFUSED(j["model"]["unk_token"] = "<unk>", "\"unk_token\" \"<unk>\" is not in the vocab");
  EXPECT_REFUSED(j["model"]["merges"] = json::object(), "\"merges\" must be an array");
  EXPECT_REFUSED(j["model"]["merges"].push_back("a b c"), "must be two tokens separated by one space");
  EXPECT_REFUSED(j["model"]["merges"].push_back(json::array({"a"})), "must be \"a b\" or [\"a\", \"b\"]");
  EXPECT_REFUSED(j["model"]["merges"].push_back("c a"), "\"ca\" is not in the vocab");
  EXPECT_REFUSED(j["model"]["merges"].push_back("x a"), "\"x\" is not in the vocab");
  EXPECT_REFUSED(j["normalizer"] = json({{"type", "Lowercase"}}), "normalizer \"Lowercase\" is not supported");
  EXPECT_REFUSED(j["normalizer"] = json({{"type", "NFC"}, {"x", 1}}), "unknown field \"x\"");
  EXPECT_REFUSED(j["normalizer"] = json({{"type", "Replace"}, {"pattern", {{"Regex", "("}}}, {"content", ""}}),
                 "cannot compile the pattern");
  EXPECT_REFUSED(j["normalizer"] = json({{"type", "Replace"}, {"pattern", {{"Glob", "*"}}}, {"content", ""}}),
                 "a pattern is {\"String\": ...} or {\"Regex\": ...}");
  EXPECT_REFUSED(j["pre_tokenizer"] = json({{"type", "Whitespace"}}), "pre-tokenizer \"Whitespace\" is not supported");
  EXPECT_REFUSED(j["pre_tokenizer"] = json({{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"},
                                            {"invert", false}}),
                 "unknown split behavior \"Sideways\"");
  EXPECT_REFUSED(j["pre_tokenizer"] = json({{"type", "Metaspace"}, {"replacement", "ab"}, {"prepend_scheme", "first"}}),
                 "\"replacement\" must be one character");
  EXPECT_REFUSED(j["decoder"] = json({{"type", "WordPiece"}}), "decoder \"WordPiece\" is not supported");
  EXPECT_REFUSED(j["decoder"] = json({{"type", "Strip"}, {"content", " "}, {"start", -1}, {"stop", 0}}),
                 "\"start\" is -1, outside");
  EXPECT_REFUSED(j["post_processor"] = json({{"type", "BertProcessing"}}), "post-processor \"BertProcessing\" is not supported");
  EXPECT_REFUSED(j["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "pair": [], "special_tokens": {}})"),
                 "special token \"<x>\" is not in \"special_tokens\"");
  EXPECT_REFUSED(j["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}})"),
                 "has no sequence \"A\"");
  EXPECT_REFUSED(j["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [99], "tokens": ["<s>"]}}})"),
                 "token id 99 is outside the vocabulary");
  EXPECT_REFUSED(j["added_tokens"][0]["single_word"] = true, "\"single_word\": true is not supported");
  EXPECT_REFUSED(j["added_tokens"][0]["id"] = 2, "the vocab gives it 6");
  EXPECT_REFUSED(j["added_tokens"][0]["content"] = "", "\"content\" is empty");
  EXPECT_REFUSED(j["added_tokens"].push_back(j["added_tokens"][0]), "id 6 is added twice");
  EXPECT_REFUSED(j["added_tokens"] = json::object(), "\"added_tokens\" must be an array");
  json deep = {{"type", "NFC"}};
  for (int i = 0; i < 20; ++i) deep = {{"type", "Sequence"}, {"normalizers", json::array({deep})}};
  EXPECT_REFUSED(j["normalizer"] = deep, "nested too deeply");
}

TEST(TokenizerJson, MergesLowestRankFirst) {
  json j = base_file();
  auto t = JsonTokenizer::parse(j.dump(), "t");
  EXPECT_EQ(t->encode("abc", false), (std::vector<int>{5}));  // a+b (rank 0), then ab+c
  EXPECT_EQ(t->encode("bcab", false), (std::vector<int>{4, 3}));
  EXPECT_EQ(t->encode("x", false), (std::vector<int>{}));  // no unk token: dropped, as `tokenizers` does
  j["model"]["merges"] = {"b c", "a b", "ab c"};            // b+c first: "abc" stays a, bc
  t = JsonTokenizer::parse(j.dump(), "t");
  EXPECT_EQ(t->encode("abc", false), (std::vector<int>{0, 4}));
  EXPECT_EQ(t->encode("a<s>bc", false), (std::vector<int>{0, 6, 4}));  // added tokens split out first
  EXPECT_EQ(t->vocab_size(), 7);
  EXPECT_EQ(t->token_to_id("<s>"), 6);
  EXPECT_EQ(t->decode({0, 6, 4, 99}, false), "a <s> bc");  // no decoder: tokens joined by spaces; 99 skipped
  EXPECT_EQ(t->decode({0, 6, 4}, true), "a bc");
}

TEST(TokenizerJson, SentencePieceStyleNormalizerTemplateAndDecoder) {
  json j = base_file();
  j["model"]["vocab"] = {{"<unk>", 0}, {"<s>", 1}, {"\xE2\x96\x81", 2}, {"a", 3}, {"\xE2\x96\x81" "a", 4}, {"<0x0A>", 5}};
  j["model"]["merges"] = {"\xE2\x96\x81 a"};
  j["model"]["unk_token"] = "<unk>";
  j["model"]["byte_fallback"] = true;
  j["model"]["fuse_unk"] = true;
  j["added_tokens"] = json::parse(R"([{"id": 1, "content": "<s>", "single_word": false, "lstrip": false,
      "rstrip": false, "normalized": false, "special": true}])");
  j["normalizer"] = json::parse(R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})");
  j["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
      {"Sequence": {"id": "A", "type_id": 0}}], "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}})");
  j["decoder"] = json::parse(R"({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})");
  const auto t = JsonTokenizer::parse(j.dump(), "t");
  // "a a\n": "▁a▁a\n" -> ▁a ▁a <0x0A>; "zz" -> ▁ then one fused <unk>; each segment around <s> gets its "▁".
  EXPECT_EQ(t->encode("a a\n", true), (std::vector<int>{1, 4, 4, 5}));
  EXPECT_EQ(t->encode("zz", false), (std::vector<int>{2, 0}));
  EXPECT_EQ(t->encode("a<s>a", false), (std::vector<int>{4, 1, 4}));
  EXPECT_EQ(t->decode({1, 4, 4, 5}, true), "a a\n");
  EXPECT_EQ(t->decode({4, 1, 4}, false), "a<s> a");
  EXPECT_EQ(t->model_kind(), "SentencePiece-style BPE");
}

TEST(TokenizerJson, Utf8AndByteLevelMap) {
  EXPECT_EQ(sanitize_utf8("ok \xE2\x82\xAC"), "ok \xE2\x82\xAC");
  EXPECT_EQ(sanitize_utf8("\xFF\xFE" "A"), "\xEF\xBF\xBD\xEF\xBF\xBD" "A");
  EXPECT_EQ(sanitize_utf8("\xE2\x82"), "\xEF\xBF\xBD");        // a truncated sequence is one maximal subpart
  EXPECT_EQ(sanitize_utf8("\xF0\x9F\x98" "x"), "\xEF\xBF\xBDx");
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate: 3 bytes, 3 errors
  EXPECT_EQ(sanitize_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong
  EXPECT_EQ(sanitize_utf8(std::string("a\0b", 3)), std::string("a\0b", 3));
  EXPECT_EQ(byte_level_char('A'), "A");
  EXPECT_EQ(byte_level_char(' '), "\xC4\xA0");   // U+0120 'Ġ'
  EXPECT_EQ(byte_level_char('\n'), "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(byte_level_char(0xAD), "\xC5\x83");  // U+0143, the 68th byte moved
  EXPECT_EQ(byte_level_char(0xFF), "\xC3\xBF");  // printable Latin-1 keeps its code point
  // GPT-2's split: contractions, letters with one optional space, a whitespace run leaving its last space to
  // the next word.
  EXPECT_EQ(split_isolated("I'm  here 12", kGpt2SplitPattern),
            (std::vector<std::string>{"I", "'m", " ", " here", " 12"}));
  EXPECT_EQ(split_isolated("x 123", kQwen2SplitPattern), (std::vector<std::string>{"x", " ", "1", "2", "3"}));
}

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "moex-tokenizer-XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() { fs::remove_all(path); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path / name, std::ios::binary) << text; }
};

TEST(Tokenizer, FolderPrefersTokenizerJsonAndReadsBosEos) {
  TempDir dir;
  const TrainedTokenizer sp = train_builtin_tokenizer(512);
  dir.write("tokenizer.model", sp.model_proto);
  EXPECT_EQ(Tokenizer::file_in(dir.path.string()), (dir.path / "tokenizer.model").string());
  {
    const Tokenizer t = Tokenizer::for_model(dir.path.string());
    EXPECT_EQ(t.bos_id(), 1);
    EXPECT_EQ(t.eos_id(), 2);
    EXPECT_EQ(t.describe(), "tokenizer.model (SentencePiece, 512 tokens)");
  }
  dir.write("tokenizer.json", mixtral_tokenizer_json(sp.model_proto));
  EXPECT_EQ(Tokenizer::file_in(dir.path.string()), (dir.path / "tokenizer.json").string());
  const Tokenizer from_json = Tokenizer::for_model(dir.path.string());
  const Tokenizer from_model((dir.path / "tokenizer.model").string());
  for (const char* text : {"The old river", "  two  spaces\nand 42 digits", "Grüße, 東京!"}) {
    EXPECT_EQ(from_json.encode(text, true), from_model.encode(text, true)) << text;
    EXPECT_EQ(from_json.decode(from_json.encode(text, true)), text);
  }
  EXPECT_EQ(from_json.vocab_size(), 512);

  // Byte-level BPE: no BOS; EOS by name from tokenizer_config.json, else config.json's id.
  const TrainedByteLevelBpe qwen = train_byte_level_bpe(qwen2_tokenizer_options(600));
  dir.write("tokenizer.json", qwen.tokenizer_json);
  dir.write("tokenizer_config.json", qwen.tokenizer_config_json);
  const Tokenizer q = Tokenizer::for_model(dir.path.string());
  EXPECT_EQ(q.bos_id(), -1);
  EXPECT_EQ(q.eos_id(), 597);  // <|endoftext|> follows the 597 byte-level tokens and merges
  EXPECT_EQ(q.encode("hi<|im_end|>", true).back(), 599);
  EXPECT_EQ(q.decode(q.encode("Ünïcödé 東京 🎉", true)), "Ünïcödé 東京 🎉");
  dir.write("tokenizer_config.json", "{}");
  dir.write("config.json", R"({"eos_token_id": [598, 597]})");
  EXPECT_EQ(Tokenizer::for_model(dir.path.string()).eos_id(), 598);
  dir.write("tokenizer_config.json", R"({"eos_token": "<nope>"})");
  try {
    Tokenizer::for_model(dir.path.string());
    ADD_FAILURE() << "an EOS that is no token was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("eos_token \"<nope>\" is not a token of"), std::string::npos) << e.what();
  }
}

TEST(TokenizerTrain, ByteLevelBpeFilesAreDeterministicAndComplete) {
  const TrainedByteLevelBpe a = train_byte_level_bpe(qwen2_tokenizer_options(1000));
  EXPECT_EQ(a.vocab_size, 1000);
  EXPECT_EQ(a.merges, 1000 - 256 - 3);
  EXPECT_TRUE(a.tokenizer_json == train_byte_level_bpe(qwen2_tokenizer_options(1000)).tokenizer_json);
  const json j = json::parse(a.tokenizer_json);
  EXPECT_EQ(j["model"]["vocab"].size(), 1000u);
  EXPECT_EQ(j["added_tokens"][2]["content"], "<|im_end|>");
  EXPECT_EQ(j["added_tokens"][2]["id"], 999);
  const TrainedByteLevelBpe o = train_byte_level_bpe(olmoe_tokenizer_options(800));
  const auto t = JsonTokenizer::parse(o.tokenizer_json, "olmoe");
  EXPECT_EQ(t->token_to_id("<|endoftext|>"), 0);
  EXPECT_EQ(t->token_to_id("<|padding|>"), 1);
  EXPECT_EQ(t->vocab_size(), 800);
  EXPECT_EQ(t->model_kind(), "byte-level BPE");
  EXPECT_LT(t->encode("The quick brown fox", false).size(), 8u) << "merges make words";
  try {
    train_byte_level_bpe(qwen2_tokenizer_options(200));
    ADD_FAILURE() << "a vocab below the 256 bytes was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
  }
}

}  // namespace
}  // namespace moex
