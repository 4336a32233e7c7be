#include "tools/lib/tokenizer_train.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cstring>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/runtime/chat_template.h"

// Exported by libsentencepiece (0.1.9x) but not declared in its public headers: silences the trainer's
// INFO log, which would otherwise print a few hundred lines per gen-model.
namespace sentencepiece::logging {
void SetMinLogLevel(int v);
}

namespace moex {
namespace {

// A tiny deterministic generator for the corpus (splitmix64); independent of any model seed.
struct CorpusRng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  template <size_t N>
  std::string_view pick(const std::string_view (&words)[N]) { return words[next() % N]; }
  bool chance(int percent) { return static_cast<int>(next() % 100) < percent; }
};

// Word lists: singular nouns (plural adds "s"), verbs as {base, third person, past, -ing, participle}.
constexpr std::string_view kNouns[] = {
    "model", "expert", "token", "router", "layer", "machine", "engine", "river", "mountain", "city", "garden",
    "window", "teacher", "student", "doctor", "farmer", "painter", "writer", "singer", "captain", "soldier",
    "friend", "brother", "sister", "mother", "father", "child", "neighbor", "stranger", "king", "queen",
    "village", "forest", "ocean", "island", "valley", "bridge", "road", "tower", "castle", "library", "school",
    "market", "harbor", "station", "kitchen", "table", "chair", "book", "letter", "story", "song", "picture",
    "dream", "question", "answer", "problem", "result", "number", "matrix", "vector", "signal", "network",
    "computer", "program", "server", "cluster", "memory", "cache", "thread", "kernel", "buffer", "message",
    "request", "system", "process", "language", "word", "sentence", "paragraph", "chapter", "season",
    "morning", "evening", "night", "winter", "summer", "spring", "autumn", "storm", "cloud", "star", "planet",
    "moon", "sun", "light", "shadow", "fire", "stone", "tree", "flower", "bird", "horse", "dog", "cat", "fox",
    "wolf", "bear", "fish", "apple", "bread", "coffee", "water", "journey", "voyage", "festival", "lesson",
    "experiment", "theory", "idea", "plan", "reason", "decision", "company", "team", "group", "family",
    "country", "government", "history", "science", "music", "painting", "market", "price", "engineer",
    "scientist", "artist", "pilot", "sailor", "merchant", "musician", "player", "coach", "judge", "lawyer"};
constexpr std::string_view kVerbs[][5] = {
    {"see", "sees", "saw", "seeing", "seen"},       {"find", "finds", "found", "finding", "found"},
    {"build", "builds", "built", "building", "built"}, {"write", "writes", "wrote", "writing", "written"},
    {"read", "reads", "read", "reading", "read"},   {"carry", "carries", "carried", "carrying", "carried"},
    {"open", "opens", "opened", "opening", "opened"}, {"close", "closes", "closed", "closing", "closed"},
    {"follow", "follows", "followed", "following", "followed"}, {"watch", "watches", "watched", "watching", "watched"},
    {"remember", "remembers", "remembered", "remembering", "remembered"}, {"forget", "forgets", "forgot", "forgetting", "forgotten"},
    {"bring", "brings", "brought", "bringing", "brought"}, {"take", "takes", "took", "taking", "taken"},
    {"give", "gives", "gave", "giving", "given"},    {"make", "makes", "made", "making", "made"},
    {"send", "sends", "sent", "sending", "sent"},   {"choose", "chooses", "chose", "choosing", "chosen"},
    {"compute", "computes", "computed", "computing", "computed"}, {"measure", "measures", "measured", "measuring", "measured"},
    {"route", "routes", "routed", "routing", "routed"}, {"load", "loads", "loaded", "loading", "loaded"},
    {"store", "stores", "stored", "storing", "stored"}, {"explain", "explains", "explained", "explaining", "explained"},
    {"describe", "describes", "described", "describing", "described"}, {"discover", "discovers", "discovered", "discovering", "discovered"},
    {"visit", "visits", "visited", "visiting", "visited"}, {"paint", "paints", "painted", "painting", "painted"},
    {"help", "helps", "helped", "helping", "helped"}, {"teach", "teaches", "taught", "teaching", "taught"},
    {"learn", "learns", "learned", "learning", "learned"}, {"answer", "answers", "answered", "answering", "answered"},
    {"ask", "asks", "asked", "asking", "asked"},     {"call", "calls", "called", "calling", "called"},
    {"leave", "leaves", "left", "leaving", "left"}, {"keep", "keeps", "kept", "keeping", "kept"},
    {"hold", "holds", "held", "holding", "held"},   {"lose", "loses", "lost", "losing", "lost"},
    {"win", "wins", "won", "winning", "won"},      {"cross", "crosses", "crossed", "crossing", "crossed"},
    {"climb", "climbs", "climbed", "climbing", "climbed"}, {"repair", "repairs", "repaired", "repairing", "repaired"},
    {"protect", "protects", "protected", "protecting", "protected"}, {"love", "loves", "loved", "loving", "loved"},
    {"study", "studies", "studied", "studying", "studied"}, {"sell", "sells", "sold", "selling", "sold"},
    {"buy", "buys", "bought", "buying", "bought"},    {"draw", "draws", "drew", "drawing", "drawn"},
    {"change", "changes", "changed", "changing", "changed"}, {"improve", "improves", "improved", "improving", "improved"}};
constexpr std::string_view kIntransitive[][5] = {
    {"sleep", "sleeps", "slept", "sleeping", "slept"}, {"run", "runs", "ran", "running", "run"},
    {"walk", "walks", "walked", "walking", "walked"},   {"arrive", "arrives", "arrived", "arriving", "arrived"},
    {"wait", "waits", "waited", "waiting", "waited"},   {"laugh", "laughs", "laughed", "laughing", "laughed"},
    {"sing", "sings", "sang", "singing", "sung"},     {"travel", "travels", "traveled", "traveling", "traveled"},
    {"work", "works", "worked", "working", "worked"},   {"rest", "rests", "rested", "resting", "rested"},
    {"grow", "grows", "grew", "growing", "grown"},     {"shine", "shines", "shone", "shining", "shone"},
    {"fall", "falls", "fell", "falling", "fallen"},     {"listen", "listens", "listened", "listening", "listened"}};
constexpr std::string_view kAdjectives[] = {
    "small", "large", "quick", "slow", "bright", "dark", "old", "young", "new", "ancient", "modern", "quiet",
    "loud", "happy", "sad", "brave", "clever", "gentle", "strong", "weak", "warm", "cold", "green", "blue",
    "red", "golden", "silver", "white", "black", "empty", "full", "heavy", "light", "simple", "complex",
    "sparse", "dense", "careful", "curious", "famous", "hidden", "distant", "nearby", "beautiful", "strange",
    "familiar", "narrow", "wide", "deep", "shallow", "patient", "honest", "wooden", "broken", "perfect"};
constexpr std::string_view kAdverbs[] = {
    "quickly", "slowly", "carefully", "quietly", "happily", "suddenly", "finally", "always", "never",
    "often", "sometimes", "easily", "gently", "bravely", "clearly", "rarely", "eventually", "together"};
constexpr std::string_view kNames[] = {
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Isabel", "James", "Karen", "Louis",
    "Maria", "Noah", "Olivia", "Peter", "Rachel", "Samuel", "Sophie", "Thomas", "Victor", "William"};
constexpr std::string_view kPlaces[] = {
    "Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Dublin", "Oslo", "Tokyo",
    "Boston", "Chicago", "Toronto", "Sydney", "Cairo", "Lima", "Athens", "Geneva", "Seattle"};
constexpr std::string_view kPrepositions[] = {"near", "behind", "under", "above", "beside", "across",
                                              "inside", "around", "through", "beyond", "toward"};
constexpr std::string_view kConnectives[] = {"because", "although", "while", "when", "after", "before",
                                             "since", "until"};
constexpr std::string_view kDays[] = {"Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                                      "Sunday"};

// "the old river", "a curious fox", "three bright stars", "Alice".
std::string noun_phrase(CorpusRng& rng, bool* plural) {
  *plural = false;
  if (rng.chance(12)) return std::string(rng.pick(kNames));
  std::string out;
  const int kind = static_cast<int>(rng.next() % 10);
  const std::string_view noun = rng.pick(kNouns);
  if (kind < 5) {
    out = "the ";
  } else if (kind < 7) {
    const bool vowel = std::string_view("aeiou").find(noun[0]) != std::string_view::npos;
    out = vowel ? "an " : "a ";
  } else if (kind < 8) {
    static constexpr std::string_view kCounts[] = {"two", "three", "four", "five", "many", "several", "some"};
    out = std::string(rng.pick(kCounts)) + " ";
    *plural = true;
  } else {
    out = "the ";
    *plural = true;
  }
  if (rng.chance(45)) {
    std::string_view adjective = rng.pick(kAdjectives);
    if (out == "a " || out == "an ") {
      out = std::string_view("aeiou").find(adjective[0]) != std::string_view::npos ? "an " : "a ";
    }
    out += adjective;
    out += ' ';
  }
  out += noun;
  if (*plural) {
    if (noun == "child") out += "ren";
    else if (noun.back() == 'y' && std::string_view("aeiou").find(noun[noun.size() - 2]) == std::string_view::npos)
      out = out.substr(0, out.size() - 1) + "ies";
    else if (noun.back() == 's' || noun.back() == 'x' || noun.ends_with("ch") || noun.ends_with("sh")) out += "es";
    else out += 's';
  }
  return out;
}

std::string capitalised(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

std::string clause(CorpusRng& rng) {
  bool plural = false;
  std::string subject = noun_phrase(rng, &plural);
  const bool transitive = rng.chance(70);
  const auto& verb = transitive ? kVerbs[rng.next() % std::size(kVerbs)] : kIntransitive[rng.next() % std::size(kIntransitive)];
  std::string out = subject + " ";
  switch (rng.next() % 5) {
    case 0: out += std::string(plural ? verb[0] : verb[1]); break;
    case 1: out += std::string(verb[2]); break;
    case 2: out += std::string(plural ? "were " : "was ") + std::string(verb[3]); break;
    case 3: out += "will " + std::string(verb[0]); break;
    default: out += std::string(plural ? "have " : "has ") + std::string(verb[4]); break;
  }
  if (transitive) {
    bool object_plural = false;
    out += " " + noun_phrase(rng, &object_plural);
  }
  if (rng.chance(30)) out += " " + std::string(rng.pick(kAdverbs));
  if (rng.chance(35)) {
    bool place_plural = false;
    out += " " + std::string(rng.pick(kPrepositions)) + " " + noun_phrase(rng, &place_plural);
  }
  if (rng.chance(10)) out += " in " + std::string(rng.pick(kPlaces));
  if (rng.chance(6)) out += " on " + std::string(rng.pick(kDays));
  return out;
}

std::string sentence(CorpusRng& rng) {
  std::string out;
  const int kind = static_cast<int>(rng.next() % 20);
  if (kind < 11) {
    out = capitalised(clause(rng)) + ".";
  } else if (kind < 14) {
    out = capitalised(clause(rng)) + ", " + std::string(rng.pick(kConnectives)) + " " + clause(rng) + ".";
  } else if (kind < 16) {
    bool plural = false;
    out = "Did " + noun_phrase(rng, &plural) + " " + std::string(kVerbs[rng.next() % std::size(kVerbs)][0]) + " " +
          noun_phrase(rng, &plural) + "?";
  } else if (kind < 17) {
    out = "\"" + capitalised(clause(rng)) + ",\" said " + std::string(rng.pick(kNames)) + ".";
  } else if (kind < 18) {
    // Numbers, so the tokenizer sees digits (split one per piece, as Llama's does).
    out = "In " + std::to_string(1800 + rng.next() % 225) + ", " + clause(rng) + " " +
          std::to_string(2 + rng.next() % 998) + " times.";
  } else if (kind < 19) {
    out = capitalised(clause(rng)) + "; " + clause(rng) + ".";
  } else if (rng.chance(60)) {
    out = "It was " + std::string(rng.pick(kAdjectives)) + " and " + std::string(rng.pick(kAdjectives)) +
          ", and " + clause(rng) + "!";
  } else {
    // A pangram now and then, so every letter (z, q, j, x, v) has merges of its own.
    static constexpr std::string_view kPangrams[] = {
        "The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs.",
        "How vexingly quick daft zebras jump!", "Jazz musicians puzzle over the bizarre quiz."};
    out = std::string(rng.pick(kPangrams));
  }
  return out;
}

class StringLines : public sentencepiece::SentenceIterator {
 public:
  explicit StringLines(const std::string& text) : text_(text) { Next(); }
  bool done() const override { return done_; }
  void Next() override {
    if (pos_ >= text_.size()) {
      done_ = true;
      return;
    }
    const size_t end = std::min(text_.find('\n', pos_), text_.size());
    line_.assign(text_, pos_, end - pos_);
    pos_ = end + 1;
  }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  const std::string& text_;
  size_t pos_ = 0;
  std::string line_;
  bool done_ = false;
};

// Appends varint / length-delimited protobuf fields: ModelProto.pieces is field 1, repeated, and a parser
// concatenates repeated fields wherever they appear, so pieces appended to the serialized model get the
// next ids (no protobuf headers needed; libsentencepiece installs none).
void append_varint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void append_normal_piece(std::string* model_proto, const std::string& piece, float score) {
  std::string message;
  message.push_back(0x0a);  // SentencePiece.piece (string)
  append_varint(&message, piece.size());
  message += piece;
  message.push_back(0x15);  // SentencePiece.score (float, little-endian); type defaults to NORMAL
  char bytes[4];
  std::memcpy(bytes, &score, 4);
  message.append(bytes, 4);
  model_proto->push_back(0x0a);  // ModelProto.pieces
  append_varint(model_proto, message.size());
  *model_proto += message;
}

// The corpus's most frequent word pairs as "▁w1▁w2" pieces, most frequent first (ties by text).
std::vector<std::string> frequent_word_pairs(const std::string& corpus, size_t count) {
  std::unordered_map<std::string, int> pairs;
  std::string previous, word;
  auto flush = [&] {
    if (!word.empty() && !previous.empty()) ++pairs["\xE2\x96\x81" + previous + "\xE2\x96\x81" + word];
    previous = word;
    word.clear();
  };
  for (char c : corpus) {
    if (c == ' ' || c == '\n') {
      flush();
      if (c == '\n') previous.clear();
    } else {
      word += c;
    }
  }
  flush();
  std::vector<std::pair<int, std::string>> ranked;
  ranked.reserve(pairs.size());
  for (auto& [text, n] : pairs) ranked.emplace_back(-n, text);
  std::sort(ranked.begin(), ranked.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < ranked.size() && out.size() < count; ++i) out.push_back(ranked[i].second);
  return out;
}

}  // namespace

std::string builtin_english_corpus() {
  CorpusRng rng{0x4d6f4558436f7270ull};  // "MoEXCorp"
  std::string text;
  text.reserve(1 << 21);
  // Lines of 1-4 sentences; ~30k sentences is enough for a few thousand merges and trains in ~1 s.
  for (int line = 0; line < 12000; ++line) {
    const int sentences = 1 + static_cast<int>(rng.next() % 4);
    for (int s = 0; s < sentences; ++s) {
      if (s) text += ' ';
      text += sentence(rng);
    }
    text += '\n';
  }
  return text;
}

TrainedTokenizer train_builtin_tokenizer(int max_vocab_size) {
  // 3 specials + 256 bytes + the corpus's characters (~70): below that BPE has nothing to merge.
  MOEX_CHECK_INPUT(max_vocab_size >= 384, "tokenizer: vocab size ", max_vocab_size,
                   " is too small for a byte-fallback tokenizer (needs at least 384; raise --vocab)");
  const std::string corpus = builtin_english_corpus();
  // Llama / Mixtral's tokenizer options (from its trainer_spec), except character coverage 1.0: our
  // corpus is small and every character in it should get a piece.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(max_vocab_size)},
      {"hard_vocab_limit", "false"},
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"remove_extra_whitespaces", "false"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "true"},
      {"character_coverage", "1.0"},
      {"max_sentence_length", "16384"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"unk_surface", " \xE2\x81\x87 "},
      {"num_threads", "1"},
  };
  sentencepiece::logging::SetMinLogLevel(2);  // warnings and errors only
  StringLines lines(corpus);
  TrainedTokenizer out;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines, &out.model_proto);
  MOEX_CHECK(status.ok(), "SentencePiece training failed: ", status.ToString());
  out.corpus_bytes = static_cast<int64_t>(corpus.size());
  sentencepiece::SentencePieceProcessor processor;
  MOEX_CHECK(processor.LoadFromSerializedProto(out.model_proto).ok(), "trained tokenizer does not load");
  out.trained_pieces = processor.GetPieceSize();
  // The corpus supports ~3200 BPE pieces; a model's vocab is larger (32000). Fill the rest with the most
  // frequent word pairs, scored below every trained merge, so that every id the model can emit decodes to
  // text and the tokenizer has exactly vocab_size pieces, as Mixtral's does.
  if (out.trained_pieces < max_vocab_size) {
    float score = processor.GetScore(out.trained_pieces - 1);
    for (const std::string& piece : frequent_word_pairs(corpus, max_vocab_size - out.trained_pieces)) {
      score -= 1.0f;
      append_normal_piece(&out.model_proto, piece, score);
    }
    MOEX_CHECK(processor.LoadFromSerializedProto(out.model_proto).ok(), "padded tokenizer does not load");
  }
  out.vocab_size = processor.GetPieceSize();
  return out;
}

std::string llama_tokenizer_config_json(int model_max_length) {
  using json = nlohmann::json;
  auto special = [](const char* content) {
    return json{{"content", content}, {"lstrip", false}, {"normalized", false}, {"rstrip", false},
                {"single_word", false}, {"special", true}};
  };
  const json config = {
      {"add_bos_token", true},
      {"add_eos_token", false},
      {"added_tokens_decoder", {{"0", special("<unk>")}, {"1", special("<s>")}, {"2", special("</s>")}}},
      {"additional_special_tokens", json::array()},
      {"bos_token", "<s>"},
      {"chat_template", kMixtralChatTemplate},  // the template Mixtral-8x7B-Instruct ships (runtime/chat_template.h)
      {"clean_up_tokenization_spaces", false},
      {"eos_token", "</s>"},
      {"legacy", true},
      {"model_max_length", model_max_length},
      {"pad_token", nullptr},
      {"sp_model_kwargs", json::object()},
      {"spaces_between_special_tokens", false},
      {"tokenizer_class", "LlamaTokenizer"},
      {"unk_token", "<unk>"},
      {"use_default_system_prompt", false},
  };
  return config.dump(2) + "\n";
}

}  // namespace moex
