// ChatTemplate against Python's jinja2 (tests/reference/chat_template_ref.py, set up as HF's
// apply_chat_template sets it up) rendering the same template text for the same messages.
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/text/chat_template.h"
#include "moex/text/tokenizer.h"
#include "tools/lib/tokenizer_train.h"

namespace moex {
namespace {

using json = nlohmann::json;

// Mixtral-8x7B-Instruct-v0.1's first template (no system role), as it shipped before the current one.
const char* const kMixtralV1Template =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

// ChatML that adds a default system prompt when none is given (the form of the Qwen1.5 chat models).
const char* const kQwenChatMLTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

// Exercises the rest of the subset: whitespace control with trim/lstrip_blocks, loop variables, scoping
// of set inside a loop, slices, filters, tests, methods, inline if, in, arithmetic, comments.
const char* const kFeatureTemplate = R"JINJA({# a comment line #}
{% set count = 0 %}
{% set names = [] %}
{% for m in messages %}
  {% set count = count + 1 %}
  <{{ loop.index }}/{{ loop.length }}{% if loop.first %} first{% endif %}{% if loop.last %} last{% endif %} rev={{ loop.revindex0 }}>
    {{- m.role | upper }}: {{ m['content'] | trim }} ({{ m.content | length }} chars)
  {%+ if 'x' in m.content %}has x{% elif m.content.startswith('He') %}hello-ish{% else %}plain{% endif %}
{% endfor %}
count outside the loop: {{ count }}
{{ messages[-1]['content'][::-1] }}|{{ messages[1:] | length }}|{{ messages[:1][0].role }}
{{ 'yes' if add_generation_prompt else 'no' }} {{ 7 // 2 }} {{ -7 % 3 }} {{ 2 * 3 + 1 }} {{ 'ab' ~ 3 }}
{{ undefined_name is defined }} {{ undefined_name is not defined }} {{ none is none }} {{ (messages | length) > 2 and 'many' or 'few' }}
{{ undefined_name | default('fallback') }} {{ messages[0].content.strip(' H') }} {{ 'a' not in 'bcd' }}
{%- if messages[0]['role'] == 'system' -%}
   [sys]   
{%- endif %}
end)JINJA";

std::vector<ChatMessage> msgs(std::initializer_list<std::pair<const char*, const char*>> list) {
  std::vector<ChatMessage> out;
  for (auto& [r, c] : list) out.push_back({r, c});
  return out;
}

const std::vector<std::vector<ChatMessage>>& conversations() {
  static const std::vector<std::vector<ChatMessage>> all = {
      msgs({{"user", "Hello!"}}),
      msgs({{"system", "You are terse."}, {"user", "What is an expert?"}}),
      msgs({{"user", "Hi"}, {"assistant", "Hello, how can I help?"}, {"user", "Explain MoE.\nIn two lines."}}),
      msgs({{"system", "Be kind"}, {"user", "  spaced  x "}, {"assistant", "ok"}, {"user", "caf\xC3\xA9 \xF0\x9F\x98\x80"}}),
      msgs({{"user", "a"}, {"user", "b"}}),             // roles do not alternate: the templates raise
      msgs({{"assistant", "first"}}),                   // starts with the assistant
      msgs({{"user", "hi"}, {"tool", "result"}}),       // unsupported role
  };
  return all;
}

json reference_render(const json& cases) {
  const auto in = std::filesystem::temp_directory_path() / ("moex_chat_template_cases_" + std::to_string(getpid()) + ".json");
  std::ofstream(in) << cases.dump();
  const std::string cmd = "/usr/bin/python3 " + std::string(MOEX_SOURCE_DIR) + "/tests/reference/chat_template_ref.py < " + in.string();
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while (pipe && (n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pipe ? pclose(pipe) : -1;
  std::filesystem::remove(in);
  EXPECT_EQ(status, 0) << cmd;
  return json::parse(out);
}

TEST(ChatTemplate, RendersAsJinja2DoesForTheKnownTemplates) {
  const std::vector<std::string> templates = {kMixtralChatTemplate, kMixtralV1Template, kChatMLTemplate,
                                              kQwenChatMLTemplate, kFeatureTemplate};
  json cases = json::array();
  struct Expect {
    size_t t, c;
    bool gen;
  };
  std::vector<Expect> order;
  for (size_t t = 0; t < templates.size(); ++t)
    for (size_t c = 0; c < conversations().size(); ++c)
      for (bool gen : {true, false}) {
        json messages = json::array();
        for (const auto& m : conversations()[c]) messages.push_back({{"role", m.role}, {"content", m.content}});
        cases.push_back({{"template", templates[t]}, {"messages", messages}, {"add_generation_prompt", gen},
                         {"bos_token", "<s>"}, {"eos_token", "</s>"}});
        order.push_back({t, c, gen});
      }
  const json expected = reference_render(cases);
  ASSERT_EQ(expected.size(), order.size());
  int raised = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const ChatTemplate tmpl(templates[order[i].t], "<s>", "</s>");
    SCOPED_TRACE("template " + std::to_string(order[i].t) + " conversation " + std::to_string(order[i].c));
    if (expected[i]["ok"].get<bool>()) {
      EXPECT_EQ(tmpl.render(conversations()[order[i].c], order[i].gen), expected[i]["text"].get<std::string>());
    } else {
      ++raised;
      try {
        tmpl.render(conversations()[order[i].c], order[i].gen);
        ADD_FAILURE() << "jinja2 raised '" << expected[i]["error"].get<std::string>() << "' but we rendered";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
        EXPECT_NE(std::string(e.what()).find(expected[i]["error"].get<std::string>()), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_GT(raised, 0);  // the error cases really were exercised
}

TEST(ChatTemplate, TheMixtralFormat) {
  const ChatTemplate tmpl(kMixtralChatTemplate, "<s>", "</s>");
  EXPECT_EQ(tmpl.family(), "mixtral");
  EXPECT_EQ(tmpl.render(msgs({{"system", "S"}, {"user", "U1"}, {"assistant", "A1"}, {"user", "U2"}})),
            "<s> [INST] S\n\nU1 [/INST] A1</s> [INST] U2 [/INST]");
  EXPECT_EQ(ChatTemplate(kChatMLTemplate, "<s>", "</s>").family(), "chatml");
}

TEST(ChatTemplate, UnsupportedTemplatesAreRefusedWhenParsed) {
  for (const char* bad : {"{% macro f() %}x{% endmacro %}", "{{ x | tojson }}", "{% for m in messages %}",
                          "{{ foo() }}", "{{ 'a' ", "{% if x %}a{% endfor %}", "{{ m.content.split() }}",
                          "{% include 'x' %}"}) {
    try {
      ChatTemplate t(bad, "<s>", "</s>");
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << bad;
      EXPECT_NE(std::string(e.what()).find("chat template line"), std::string::npos) << e.what();
    }
  }
}

TEST(ChatTemplate, LoadsFromTheModelOrAFileAndRefusesWhatIsMissing) {
  const auto dir = std::filesystem::temp_directory_path() / ("moex_chat_template_dir_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  EXPECT_THROW(ChatTemplate::load(dir.string()), Error);  // no tokenizer_config.json
  std::ofstream(dir / "tokenizer_config.json") << json{{"bos_token", "<s>"}, {"eos_token", {{"content", "</s>"}}}}.dump();
  try {
    ChatTemplate::load(dir.string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--chat-template"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "t.jinja") << kChatMLTemplate;
  EXPECT_EQ(ChatTemplate::load(dir.string(), (dir / "t.jinja").string()).family(), "chatml");
  std::ofstream(dir / "tokenizer_config.json") << json{{"chat_template", kMixtralChatTemplate}, {"eos_token", "</s>"}}.dump();
  const ChatTemplate t = ChatTemplate::load(dir.string());
  EXPECT_EQ(t.render(msgs({{"user", "x"}, {"assistant", "y"}})), "<s> [INST] x [/INST] y</s>");
  std::ofstream(dir / "bad.jinja") << "{% macro %}";
  EXPECT_THROW(ChatTemplate::load(dir.string(), (dir / "bad.jinja").string()), Error);
  EXPECT_THROW(ChatTemplate::load(dir.string(), (dir / "missing.jinja").string()), Error);
  EXPECT_TRUE(ChatTemplate::model_has_template(dir.string()));
  // HF's list of named templates: "default" is the one used; a list without it is refused.
  std::ofstream(dir / "tokenizer_config.json")
      << json{{"chat_template", json::array({json{{"name", "tool_use"}, {"template", "{{ x"}},
                                             json{{"name", "default"}, {"template", kChatMLTemplate}}})}}.dump();
  EXPECT_EQ(ChatTemplate::load(dir.string()).family(), "chatml");
  std::ofstream(dir / "tokenizer_config.json")
      << json{{"chat_template", json::array({json{{"name", "tool_use"}, {"template", kChatMLTemplate}}})}}.dump();
  EXPECT_THROW(ChatTemplate::load(dir.string()), Error);
  std::ofstream(dir / "tokenizer_config.json") << json{{"bos_token", "<s>"}}.dump();
  EXPECT_FALSE(ChatTemplate::model_has_template(dir.string()));
  std::filesystem::remove_all(dir);
  EXPECT_FALSE(ChatTemplate::model_has_template(dir.string()));
}

TEST(ChatTemplate, EncodeTurnsSpecialTokensIntoTheirIds) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("moex_chat_template_test_tokenizer_" + std::to_string(getpid()) + ".model");
  std::ofstream(path, std::ios::binary) << train_builtin_tokenizer(1000).model_proto;
  const Tokenizer tok(path.string());
  std::filesystem::remove(path);
  const ChatTemplate tmpl(kMixtralChatTemplate, "<s>", "</s>");
  const std::string text = tmpl.render(msgs({{"user", "the old man"}, {"assistant", "the dog"}, {"user", "a river"}}));
  const std::vector<int> ids = tmpl.encode(tok, text);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], tok.bos_id());
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.eos_id()), 1);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.bos_id()), 1);
  // Between the specials the text is the tokenizer's own encoding of that text.
  const auto eos_at = std::find(ids.begin(), ids.end(), tok.eos_id());
  const std::vector<int> first(ids.begin() + 1, eos_at);
  EXPECT_EQ(first, tok.encode(" [INST] the old man [/INST] the dog", false));
}

}  // namespace
}  // namespace moex

namespace moex {
namespace {

// Qwen2's layout (as gen-model writes it for qwen2_moe, qwen3_moe and dots1): tokenizer_config.json's
// bos_token is null, so a template's bos_token is empty and "<s>" a user writes is text, as HF renders and
// tokenizes it; eos_token is its id.
TEST(ChatTemplate, NullBosTokenIsNoToken) {
  const auto dir = std::filesystem::temp_directory_path() / ("moex_chat_template_qwen_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const TrainedByteLevelBpe trained = train_byte_level_bpe(qwen2_tokenizer_options(600));
  std::ofstream(dir / "tokenizer.json") << trained.tokenizer_json;
  std::ofstream(dir / "tokenizer_config.json") << trained.tokenizer_config_json;
  std::ofstream(dir / "t.jinja") << "{{ bos_token }}|{{ eos_token }}|{{ messages[0]['content'] }}";
  const Tokenizer tok = Tokenizer::for_model(dir.string());
  ASSERT_EQ(tok.bos_id(), -1);
  const ChatTemplate t = ChatTemplate::load(dir.string(), (dir / "t.jinja").string());
  const std::string eos = nlohmann::json::parse(trained.tokenizer_config_json)["eos_token"].get<std::string>();
  ASSERT_EQ(tok.eos_id(), trained.id_of(eos));
  const std::string text = t.render(msgs({{"user", "a <s> b"}}));
  EXPECT_EQ(text, "|" + eos + "|a <s> b");
  std::vector<int> expect = tok.encode("|", false);
  expect.push_back(tok.eos_id());
  for (int id : tok.encode("|a <s> b", false)) expect.push_back(id);
  EXPECT_EQ(t.encode(tok, text), expect);
  std::filesystem::remove_all(dir);
}

TEST(ChatTemplate, GenModelWritesMixtralsTemplate) {
  const nlohmann::json config = nlohmann::json::parse(llama_tokenizer_config_json(4096));
  ASSERT_TRUE(config.contains("chat_template"));
  EXPECT_EQ(config["chat_template"].get<std::string>(), kMixtralChatTemplate);
  const auto dir = std::filesystem::temp_directory_path() / ("moex_chat_template_gen_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  EXPECT_EQ(ChatTemplate::load(dir.string()).family(), "mixtral");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moex

namespace moex {
namespace {

// Random templates built from Jinja's pieces: each is either refused or rendered, with moex::Error as the
// only way to fail (never another exception, a crash or a hang).
TEST(ChatTemplate, RandomTemplatesFailOnlyWithError) {
  const std::vector<std::string> pieces = {
      "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", " if ", " elif ", " else ", " endif ",
      " for ", " in ", " endfor ", " set ", " = ", "messages", "message", "loop", ".index0", ".first", "[0]",
      "['role']", "['content']", "[1:]", "[::-1]", "[", "]", "(", ")", " + ", " - ", " * ", " / ", " // ", " % ",
      " ~ ", " == ", " != ", " < ", " and ", " or ", " not ", " is ", " defined ", " none ", "|length", "|trim",
      "|upper", "'x'", "\"y\"", "'", "0", "7", "-1", ",", ":", ".", "raise_exception", ".strip()", "\n", " ",
      "text", "bos_token", "add_generation_prompt", "True", "None"};
  std::mt19937 rng(17);
  int rendered = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::string source;
    for (int n = 1 + rng() % 12; n > 0; --n) source += pieces[rng() % pieces.size()];
    try {
      const ChatTemplate t(source, "<s>", "</s>");
      t.render(msgs({{"system", "s"}, {"user", "u"}, {"assistant", "a"}}));
      ++rendered;
    } catch (const Error&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a moex::Error: " << e.what() << " for template: " << source;
    }
  }
  EXPECT_GT(rendered, 100);
}

}  // namespace
}  // namespace moex
