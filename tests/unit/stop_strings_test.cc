// Incremental detokenization against SentencePiece's own decode of the whole sequence, and stop strings
// against a plain find() over the whole text.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/text/stop_strings.h"
#include "moex/text/tokenizer.h"
#include "tools/lib/tokenizer_train.h"

namespace moex {
namespace {

// A trained SentencePiece tokenizer (libsentencepiece), or (json) the tokenizer.json converted from it as
// Hugging Face's Mixtral ships it (MoEX's own decoder chain).
const Tokenizer& test_tokenizer(bool json = false) {
  static const Tokenizer* tokenizers[2] = {};
  if (!tokenizers[0]) {
    // One file per process: ctest may run several of these tests at once.
    const auto path = std::filesystem::temp_directory_path() /
                      ("moex_stop_strings_test_tokenizer_" + std::to_string(getpid()));
    const TrainedTokenizer trained = train_builtin_tokenizer(2000);
    std::ofstream(path.string() + ".model", std::ios::binary) << trained.model_proto;
    std::ofstream(path.string() + ".json", std::ios::binary) << mixtral_tokenizer_json(trained.model_proto);
    tokenizers[0] = new Tokenizer(path.string() + ".model");
    tokenizers[1] = new Tokenizer(path.string() + ".json");
    std::filesystem::remove(path.string() + ".model");
    std::filesystem::remove(path.string() + ".json");
  }
  return *tokenizers[json];
}

// Streams `generated` after `prompt` and returns the text the deltas add up to (each delta valid UTF-8).
std::string stream(const Tokenizer& tok, const std::vector<int>& prompt, const std::vector<int>& generated) {
  IncrementalDetokenizer detok(tok, prompt);
  std::string streamed;
  for (int id : generated) {
    const std::string delta = detok.add(id);
    EXPECT_TRUE(is_valid_utf8(delta)) << "delta of id " << id;
    streamed += delta;
  }
  return streamed + detok.flush();
}

// Streams `generated` after `prompt` and checks every delta against the decode of the whole sequence.
void check_stream(const std::vector<int>& prompt, const std::vector<int>& generated) {
  const Tokenizer& tok = test_tokenizer();
  const std::string streamed = stream(tok, prompt, generated);
  std::vector<int> all = prompt;
  all.insert(all.end(), generated.begin(), generated.end());
  const std::string whole = tok.decode(all), prompt_text = tok.decode(prompt);
  ASSERT_EQ(whole.compare(0, prompt_text.size(), prompt_text), 0);
  EXPECT_EQ(streamed, whole.substr(prompt_text.size()));
}

TEST(IncrementalDetokenizer, MatchesTheWholeDecodeOnText) {
  const Tokenizer& tok = test_tokenizer();
  const std::vector<std::string> texts = {
      "the old man walked to the river and the dog followed him",
      " leading space, two  spaces and a tab\there",
      "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E and an emoji \xF0\x9F\x98\x80 then text",
      "\xF0\x9F\x8E\x89\xF0\x9F\x8E\x89 ends with emoji \xF0\x9F\x98\x80",
      "\n\nnew lines\n"};
  const std::vector<int> prompt = tok.encode("Once upon a time", /*add_bos=*/true);
  for (const std::string& text : texts) {
    const std::vector<int> ids = tok.encode(text, /*add_bos=*/false);
    check_stream(prompt, ids);
    check_stream({}, ids);  // no context: the first piece's space is dropped, as a decode of it alone does
  }
  // Byte-fallback ids really were exercised: the emoji is 4 byte pieces (ids 3..258).
  const std::vector<int> emoji = tok.encode("\xF0\x9F\x98\x80", false);
  int byte_pieces = 0;
  for (int id : emoji) byte_pieces += id >= 3 && id < 259;
  EXPECT_EQ(byte_pieces, 4);
}

TEST(IncrementalDetokenizer, NeverEmitsHalfACodePoint) {
  const Tokenizer& tok = test_tokenizer();
  IncrementalDetokenizer detok(tok, tok.encode("x", true));
  // U+1F600 as its four byte pieces <0xF0> <0x9F> <0x98> <0x80> (id = 3 + byte).
  EXPECT_EQ(detok.add(3 + 0xF0), "");
  EXPECT_EQ(detok.add(3 + 0x9F), "");
  EXPECT_EQ(detok.add(3 + 0x98), "");
  EXPECT_EQ(detok.add(3 + 0x80), "\xF0\x9F\x98\x80");
  // A sequence that ends broken comes out at flush as the replacement character, as decode shows it.
  EXPECT_EQ(detok.add(3 + 0xE6), "");
  EXPECT_EQ(detok.flush(), tok.decode({3 + 0xE6}));
}

TEST(IncrementalDetokenizer, IdsBeyondTheTokenizerHaveNoText) {
  const Tokenizer& tok = test_tokenizer();
  const std::vector<int> prompt = tok.encode("Once", true);
  IncrementalDetokenizer detok(tok, {prompt[0], tok.vocab_size() + 5, prompt[1]});
  const std::vector<int> ids = tok.encode("the old man", false);
  std::string out;
  for (int id : ids) {
    out += detok.add(id);
    out += detok.add(tok.vocab_size());  // a padded vocabulary's id between every real one
    out += detok.add(-1);
  }
  out += detok.flush();
  std::vector<int> all = prompt;
  all.insert(all.end(), ids.begin(), ids.end());
  EXPECT_EQ(out, tok.decode(all).substr(tok.decode(prompt).size()));
}

TEST(IncrementalDetokenizer, RandomIdsMatchTheWholeDecode) {
  const Tokenizer& tok = test_tokenizer();
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> any(3, tok.vocab_size() - 1), bytes(3 + 0x80, 3 + 0xF4);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int> ids;
    for (int i = 0; i < 40; ++i) ids.push_back(rng() % 4 == 0 ? bytes(rng) : any(rng));
    check_stream(tok.encode("prompt text", true), ids);
  }
}

// tokenizer.json's ByteFallback decoder streams the text libsentencepiece gives the whole sequence: bytes
// that form characters as text, each other byte as U+FFFD (ids 3..258 are the byte pieces <0x00>..<0xFF>).
TEST(IncrementalDetokenizer, TokenizerJsonStreamsWhatSentencePieceDecodes) {
  const Tokenizer &sp = test_tokenizer(false), &json = test_tokenizer(true);
  ASSERT_EQ(json.file().substr(json.file().size() - 5), ".json");
  const std::vector<int> prompt = sp.encode("prompt text", true);
  ASSERT_EQ(json.encode("prompt text", true), prompt);
  const auto check = [&](const std::vector<int>& ids) {
    std::vector<int> all = prompt;
    all.insert(all.end(), ids.begin(), ids.end());
    const std::string whole = sp.decode(all), prompt_text = sp.decode(prompt);
    ASSERT_EQ(whole.compare(0, prompt_text.size(), prompt_text), 0);
    EXPECT_EQ(json.decode(all), whole);
    EXPECT_EQ(stream(json, prompt, ids), whole.substr(prompt_text.size()));
  };
  // 'E' '*' form feed, then a lead byte that nothing completes; a character cut by a printable byte.
  check({3 + 0x45, 3 + 0x2A, 3 + 0x0C, 3 + 0xC3});
  check({3 + 0xE8, 3 + 0x43, 3 + 0x34, sp.encode("ght", false).back()});
  check({3 + 0xE4, 3 + 0xBD, 3 + 0x41, 3 + 0xC3, 3 + 0xA9});
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> any(3, sp.vocab_size() - 1), bytes(3, 3 + 0xFF);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<int> ids;
    for (int i = 0; i < 30; ++i) ids.push_back(rng() % 2 ? bytes(rng) : any(rng));
    check(ids);
  }
}

// The reference: the text up to the first occurrence of any stop string.
std::string reference_stop(const std::string& text, const std::vector<std::string>& stops, bool* stopped) {
  size_t first = std::string::npos;
  for (const auto& s : stops) first = std::min(first, text.find(s));
  *stopped = first != std::string::npos;
  return text.substr(0, first);
}

TEST(StopMatcher, HoldsBackPossibleStartsAndTruncatesAtTheFirstMatch) {
  StopMatcher m({"\n\nUser:", "###"});
  EXPECT_EQ(m.add("Hello"), "Hello");
  EXPECT_EQ(m.add(" world\n"), " world");  // "\n" may start "\n\nUser:"
  EXPECT_EQ(m.add("\nUs"), "");
  EXPECT_EQ(m.add("a"), "\n\nUsa");  // diverged: released
  EXPECT_EQ(m.add(" #"), " ");
  EXPECT_EQ(m.add("## tail"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "###");
  EXPECT_EQ(m.add("more"), "");
  EXPECT_EQ(m.flush(), "");

  StopMatcher none({});
  EXPECT_EQ(none.add("abc"), "abc");
  StopMatcher end({"END"});
  EXPECT_EQ(end.add("the EN"), "the ");
  EXPECT_EQ(end.flush(), "EN");  // generation ended otherwise: the held text is the client's
  EXPECT_FALSE(end.stopped());
  EXPECT_THROW(StopMatcher({"ok", ""}), Error);
}

TEST(StopMatcher, RandomChunksAgreeWithFindOnTheWholeText) {
  std::mt19937 rng(9);
  const std::string alphabet = "ab \n\xC3\xA9";
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    const int len = rng() % 60;
    for (int i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
    std::vector<std::string> stops;
    for (int s = rng() % 4; s > 0; --s) {
      std::string stop;
      for (int i = 1 + rng() % 4; i > 0; --i) stop += alphabet[rng() % alphabet.size()];
      stops.push_back(stop);
    }
    size_t longest = 0;
    for (const auto& s : stops) longest = std::max(longest, s.size());
    StopMatcher m(stops);
    std::string out;
    size_t fed = 0;
    while (fed < text.size()) {
      const size_t n = std::min<size_t>(text.size() - fed, rng() % 5);
      out += m.add(std::string_view(text).substr(fed, n));
      fed += n;
      if (!m.stopped() && longest > 0) EXPECT_GE(out.size() + longest - 1, fed);  // holds back no more than needed
    }
    if (!m.stopped()) out += m.flush();
    bool stopped = false;
    EXPECT_EQ(out, reference_stop(text, stops, &stopped)) << trial;
    EXPECT_EQ(m.stopped(), stopped) << trial;
  }
}

TEST(TextStream, StopsOnAStopStringSplitAcrossTokens) {
  const Tokenizer& tok = test_tokenizer();
  const std::vector<int> prompt = tok.encode("Once", true);
  // "▁the ▁old ...": after "Once" the first piece's space is kept.
  const std::vector<int> ids = tok.encode("the old man walked to the river", false);
  TextStream stream(tok, prompt, {"man wal"});
  std::string out;
  bool stopped = false;
  size_t used = 0;
  for (int id : ids) {
    ++used;
    const TextStream::Delta d = stream.add(id);
    out += d.text;
    if (d.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_LT(used, ids.size());
  EXPECT_EQ(out, " the old ");
  EXPECT_EQ(stream.finish(), "");

  TextStream plain(tok, prompt, {"zebra"});
  std::string all;
  for (int id : ids) all += plain.add(id).text;
  all += plain.finish();
  EXPECT_EQ(all, " the old man walked to the river");
}

}  // namespace
}  // namespace moex
