#include "tools/lib/tokenizer_train.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/model/config.h"
#include "moex/text/chat_template.h"
#include "moex/text/tokenizer_json.h"

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
      {"chat_template", kMixtralChatTemplate},  // the template Mixtral-8x7B-Instruct ships (text/chat_template.h)
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

namespace {

using ojson = nlohmann::ordered_json;

ojson added_token_json(int id, const std::string& content) {
  return ojson{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
               {"rstrip", false}, {"normalized", false}, {"special", true}};
}

// Offsets of the characters of a UTF-8 string (Python's str indices, which the converter splits at).
std::vector<size_t> char_offsets(const std::string& s) {
  std::vector<size_t> out;
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) out.push_back(i);
  return out;
}

}  // namespace

std::string mixtral_tokenizer_json(const std::string& model_proto) {
  sentencepiece::SentencePieceProcessor sp;
  MOEX_CHECK(sp.LoadFromSerializedProto(model_proto).ok(), "tokenizer.model does not load");
  const int n = sp.GetPieceSize();
  std::unordered_map<std::string, int> ids;
  ojson vocab = ojson::object();
  for (int i = 0; i < n; ++i) {
    ids.emplace(sp.IdToPiece(i), i);
    vocab[sp.IdToPiece(i)] = i;
  }
  // Merges: every split of each piece into two pieces (left, right), ordered by the merged piece's score,
  // highest first (a stable sort over pieces in id order, the splits of one piece by (id left, id right));
  // the specials and the bytes score 0 as the converter gives them.
  struct Merge {
    float score;
    int left, right;
  };
  std::vector<Merge> merges;
  for (int i = 0; i < n; ++i) {
    const std::string piece = sp.IdToPiece(i);
    const float score = sp.IsControl(i) || sp.IsUnknown(i) || sp.IsByte(i) ? 0.0f : sp.GetScore(i);
    std::vector<Merge> local;
    for (size_t cut : char_offsets(piece)) {
      if (cut == 0) continue;
      auto l = ids.find(piece.substr(0, cut)), r = ids.find(piece.substr(cut));
      if (l != ids.end() && r != ids.end()) local.push_back({score, l->second, r->second});
    }
    std::sort(local.begin(), local.end(), [](const Merge& a, const Merge& b) {
      return a.left != b.left ? a.left < b.left : a.right < b.right;
    });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) { return a.score > b.score; });
  ojson merge_list = ojson::array();
  for (const Merge& m : merges) merge_list.push_back(sp.IdToPiece(m.left) + " " + sp.IdToPiece(m.right));

  const std::string bos = sp.IdToPiece(sp.bos_id()), underline = "\xE2\x96\x81";
  ojson added = ojson::array();
  for (int id : {sp.unk_id(), sp.bos_id(), sp.eos_id()}) added.push_back(added_token_json(id, sp.IdToPiece(id)));
  const ojson tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", underline}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", underline}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair",
         {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
        {"special_tokens", {{bos, {{"id", bos}, {"ids", {sp.bos_id()}}, {"tokens", {bos}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", underline}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", sp.IdToPiece(sp.unk_id())},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
  return tokenizer.dump(2) + "\n";
}

ByteLevelBpeOptions qwen2_tokenizer_options(int vocab_size) {
  ByteLevelBpeOptions o;
  o.vocab_size = vocab_size;
  o.qwen2_split = true;
  o.nfc = true;
  o.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  o.eos_token = "<|endoftext|>";
  o.pad_token = "<|endoftext|>";
  o.tokenizer_class = "Qwen2Tokenizer";
  return o;
}

ByteLevelBpeOptions olmoe_tokenizer_options(int vocab_size) {
  ByteLevelBpeOptions o;
  o.vocab_size = vocab_size;
  o.qwen2_split = false;
  o.nfc = true;
  o.special_tokens_first = true;
  o.special_tokens = {"<|endoftext|>", "<|padding|>"};
  o.eos_token = "<|endoftext|>";
  o.pad_token = "<|padding|>";
  o.tokenizer_class = "GPTNeoXTokenizer";
  return o;
}

ByteLevelBpeOptions family_tokenizer_options(const std::string& model_type, int vocab_size, int model_max_length) {
  ByteLevelBpeOptions o;
  const TokenizerKind kind = family_info(family_from_model_type(model_type, "tokenizer")).tokenizer;
  if (kind == TokenizerKind::kGpt2ByteLevel) {
    o = olmoe_tokenizer_options(vocab_size);
  } else {
    MOEX_CHECK_INPUT(kind == TokenizerKind::kQwen2ByteLevel, "tokenizer: no byte-level tokenizer layout for model_type '",
                     model_type, "'");
    o = qwen2_tokenizer_options(vocab_size);
    o.eos_token = "<|im_end|>";
    o.chat_template = kChatMLTemplate;  // text/chat_template.h, checked against jinja2
  }
  o.model_max_length = model_max_length;
  return o;
}

int TrainedByteLevelBpe::id_of(const std::string& special) const {
  for (const auto& [name, id] : special_ids)
    if (name == special) return id;
  return -1;
}

TrainedByteLevelBpe train_byte_level_bpe(const ByteLevelBpeOptions& options) {
  const int specials = static_cast<int>(options.special_tokens.size());
  MOEX_CHECK_INPUT(options.vocab_size >= 256 + specials, "tokenizer: vocab size ", options.vocab_size,
                   " cannot hold the 256 byte-level tokens and ", specials, " special tokens");
  for (const std::string* name : {&options.bos_token, &options.eos_token, &options.pad_token})
    MOEX_CHECK_INPUT(name->empty() || std::find(options.special_tokens.begin(), options.special_tokens.end(), *name) !=
                                          options.special_tokens.end(),
                     "tokenizer: \"", *name, "\" is not one of the special tokens");
  // Words: the corpus split as the tokenizer will split it, each piece as byte-level symbols.
  // The English corpus, plus a few lines in other scripts with Unicode spaces, so that merges span
  // multi-byte characters and the split regex's Unicode classes (\p{L}, \p{N}, \s) decide real tokens.
  static constexpr std::string_view kMultilingual[] = {
      "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6a21\u578b\u3002",
      "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3000\u3000\u3068\u30ab\u30bf\u30ab\u30ca",
      "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440, \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
      "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m \u00a0\u00a0 stra\u00dfe \u2003\u2003 fa\u00e7ade",
      "\U0001F600\U0001F389 \U0001F44D\U0001F3FD \u0661\u0662\u0663 \u00bd\u00b2",
  };
  std::string corpus = builtin_english_corpus();
  for (int repeat = 0; repeat < 8; ++repeat)
    for (std::string_view line : kMultilingual) (corpus += line) += '\n';
  std::unordered_map<std::string, int64_t> word_counts;
  for (const std::string& piece : split_isolated(corpus, options.qwen2_split ? kQwen2SplitPattern : kGpt2SplitPattern))
    ++word_counts[piece];
  std::vector<std::string> tokens;  // symbol -> text (byte-level characters)
  for (int b = 0; b < 256; ++b) tokens.push_back(byte_level_char(static_cast<unsigned char>(b)));
  struct Word {
    std::vector<int> symbols;
    int64_t count;
  };
  std::vector<Word> words;
  {
    std::vector<std::pair<std::string, int64_t>> sorted(word_counts.begin(), word_counts.end());
    std::sort(sorted.begin(), sorted.end());  // a fixed order, whatever the hash map's
    for (const auto& [text, count] : sorted) {
      Word w{{}, count};
      for (unsigned char c : text) w.symbols.push_back(c);
      words.push_back(std::move(w));
    }
  }
  auto key = [](int a, int b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); };
  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::vector<int>> pair_words;  // may list a word that no longer has the pair
  auto count_word = [&](int wi, int sign) {
    const Word& w = words[wi];
    for (size_t i = 0; i + 1 < w.symbols.size(); ++i) {
      const uint64_t k = key(w.symbols[i], w.symbols[i + 1]);
      pair_counts[k] += sign * w.count;
      if (sign > 0) pair_words[k].push_back(wi);
    }
  };
  for (int wi = 0; wi < static_cast<int>(words.size()); ++wi) count_word(wi, +1);
  std::vector<std::pair<int, int>> merges;
  std::unordered_map<std::string, int> token_ids;
  for (int t = 0; t < 256; ++t) token_ids.emplace(tokens[t], t);
  const int max_tokens = options.vocab_size - specials;
  while (static_cast<int>(tokens.size()) < max_tokens) {
    // The most frequent pair, ties broken by the pair's text: the same tokenizer on every machine.
    bool found = false;
    uint64_t best = 0;
    int64_t best_count = 0;
    for (const auto& [k, c] : pair_counts) {
      if (c < 2) continue;  // a pair seen once is not worth a token
      if (!found || c > best_count ||
          (c == best_count && std::pair(tokens[k >> 32], tokens[k & 0xffffffff]) <
                                  std::pair(tokens[best >> 32], tokens[best & 0xffffffff]))) {
        found = true;
        best = k;
        best_count = c;
      }
    }
    if (!found) break;
    const int a = static_cast<int>(best >> 32), b = static_cast<int>(best & 0xffffffff);
    // Two merges may make the same text ("ab"+"c", "a"+"bc"): they share its token, as in Hugging Face's trainer.
    const std::string text = tokens[a] + tokens[b];
    auto [known, fresh] = token_ids.emplace(text, static_cast<int>(tokens.size()));
    const int merged = known->second;
    if (fresh) tokens.push_back(text);
    merges.emplace_back(a, b);
    std::vector<int> affected = std::move(pair_words[best]);
    pair_words.erase(best);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    for (int wi : affected) {
      Word& w = words[wi];
      bool has = false;
      for (size_t i = 0; i + 1 < w.symbols.size() && !has; ++i) has = w.symbols[i] == a && w.symbols[i + 1] == b;
      if (!has) continue;
      count_word(wi, -1);
      std::vector<int> next;
      for (size_t i = 0; i < w.symbols.size(); ++i) {
        if (i + 1 < w.symbols.size() && w.symbols[i] == a && w.symbols[i + 1] == b) {
          next.push_back(merged);
          ++i;
        } else {
          next.push_back(w.symbols[i]);
        }
      }
      w.symbols = std::move(next);
      count_word(wi, +1);
    }
    for (auto it = pair_counts.begin(); it != pair_counts.end();) it = it->second == 0 ? pair_counts.erase(it) : std::next(it);
  }

  // Ids: specials first (GPT-NeoX) or after the merges (Qwen2).
  const int offset = options.special_tokens_first ? specials : 0;
  const int first_special = options.special_tokens_first ? 0 : static_cast<int>(tokens.size());
  ojson vocab = ojson::object(), added = ojson::array(), added_decoder = ojson::object();
  for (int i = 0; i < specials; ++i) {
    added.push_back(added_token_json(first_special + i, options.special_tokens[i]));
    ojson entry = added.back();
    entry.erase("id");
    added_decoder[std::to_string(first_special + i)] = entry;
  }
  if (options.special_tokens_first)
    for (int i = 0; i < specials; ++i) vocab[options.special_tokens[i]] = i;
  for (size_t t = 0; t < tokens.size(); ++t) vocab[tokens[t]] = static_cast<int>(t) + offset;
  if (!options.special_tokens_first)
    for (int i = 0; i < specials; ++i) vocab[options.special_tokens[i]] = first_special + i;
  ojson merge_list = ojson::array();
  for (const auto& [a, b] : merges) merge_list.push_back(ojson::array({tokens[a], tokens[b]}));
  const ojson byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  ojson pre_tokenizer;
  if (options.qwen2_split) {
    const ojson split = {{"type", "Split"}, {"pattern", {{"Regex", std::string(kQwen2SplitPattern)}}}, {"behavior", "Isolated"}, {"invert", false}};
    pre_tokenizer = ojson{{"type", "Sequence"}, {"pretokenizers", ojson::array({split, byte_level})}};
  } else {
    pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  }
  const ojson tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", options.nfc ? ojson{{"type", "NFC"}} : ojson(nullptr)},
      {"pre_tokenizer", pre_tokenizer},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
  auto name_or_null = [](const std::string& s) { return s.empty() ? ojson(nullptr) : ojson(s); };
  ojson config = {
      {"add_bos_token", false},
      {"add_prefix_space", false},
      {"added_tokens_decoder", added_decoder},
      {"bos_token", name_or_null(options.bos_token)},
      {"clean_up_tokenization_spaces", false},
      {"eos_token", name_or_null(options.eos_token)},
      {"errors", "replace"},
      {"model_max_length", options.model_max_length},
      {"pad_token", name_or_null(options.pad_token)},
      {"tokenizer_class", options.tokenizer_class.empty() ? "PreTrainedTokenizerFast" : options.tokenizer_class},
      {"unk_token", nullptr},
  };
  if (!options.chat_template.empty()) config["chat_template"] = options.chat_template;
  TrainedByteLevelBpe out;
  for (int i = 0; i < specials; ++i) out.special_ids.emplace_back(options.special_tokens[i], first_special + i);
  out.tokenizer_json = tokenizer.dump(2) + "\n";
  out.tokenizer_config_json = config.dump(2) + "\n";
  out.vocab_size = static_cast<int>(tokens.size()) + specials;
  out.merges = static_cast<int>(merges.size());
  return out;
}

}  // namespace moex
