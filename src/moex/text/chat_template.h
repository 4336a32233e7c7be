// Chat templates: OpenAI `messages` -> the prompt text a chat model was trained on, by the model's own
// Jinja template (tokenizer_config.json `chat_template`, or `--chat-template FILE`), as Hugging Face's
// apply_chat_template renders it.
//
// The renderer is a small Jinja subset, enough for the HF chat templates of the Mixtral/Mistral
// ([INST]) and ChatML families; written here because no Debian C++ library renders Jinja. What it knows:
//   text, {{ expr }}, {% if/elif/else/endif %}, {% for x in expr %}...{% endfor %} (loop.index, index0,
//   first, last, length, revindex, revindex0), {% set name = expr %}, {# comments #}, the `-` whitespace
//   markers, and HF's environment settings trim_blocks + lstrip_blocks;
//   expressions: string/int/bool/none literals, lists, names, a.b, a['b'], a[i], slices a[1:], a[::-1],
//   + - * / // % ~, == != < <= > >=, and or not, in / not in, x if c else y, tests (is [not] defined,
//   undefined, none, string, number, mapping, sequence), filters (trim, length, lower, upper, string,
//   default), string methods (strip, lstrip, rstrip, startswith, endswith, upper, lower; case changes are
//   ASCII only), strings indexed, sliced and measured by code point as Python does,
//   raise_exception(msg).
// Anything else (macros, includes, other filters) is refused when the template is parsed, so an unknown
// template is a start-up error, never a wrong prompt at request time.
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace moex {

class Tokenizer;

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

namespace jinja {
struct Node;
}

class ChatTemplate {
 public:
  // Parses `source`; throws Error(kInvalidInput) naming what it does not support (and where).
  ChatTemplate(std::string source, std::string bos_token, std::string eos_token);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // The template of a --model: `chat_template_file` when non-empty, else what the model ships. A folder:
  // tokenizer_config.json's `chat_template`, a string or HF's list of named templates [{"name",
  // "template"}], of which "default" is used; bos_token / eos_token from the same file (null: none). A
  // .gguf file: its metadata's tokenizer.chat_template; bos / eos the vocabulary's tokens at its BOS / EOS
  // ids. No template is an error.
  static ChatTemplate load(const std::string& model, const std::string& chat_template_file = "");
  // Whether the model ships a template (what load() would read without a file).
  static bool model_has_template(const std::string& model);
  // The source of the template the model ships, unparsed ("" when none): what `moex convert` copies.
  static std::string shipped_source(const std::string& model);

  // The prompt text. `add_generation_prompt`: end with the assistant's turn opening (ChatML's
  // "<|im_start|>assistant\n"; the [INST] format has none). A template's raise_exception (roles that do
  // not alternate, an unsupported role) throws Error(kInvalidInput) with its message: a 400 for a server.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;

  // The prompt ids of rendered text: bos_token / eos_token written in the text become their ids (as HF
  // treats special tokens in a chat prompt); the text between them is encoded without BOS.
  std::vector<int> encode(const Tokenizer& tokenizer, const std::string& rendered) const;

  // "mixtral" ([INST] format), "chatml" (<|im_start|>), or "custom": recognised by what the template writes.
  const std::string& family() const { return family_; }
  const std::string& source() const { return source_; }

 private:
  std::string source_, bos_token_, eos_token_, family_;
  std::unique_ptr<jinja::Node> root_;
};

// The chat template Mixtral-8x7B-Instruct-v0.1 ships in its tokenizer_config.json (an optional system
// message folded into the first [INST]); what `moex gen-model` writes.
extern const char* const kMixtralChatTemplate;
// The ChatML template as ChatML models ship it.
extern const char* const kChatMLTemplate;

}  // namespace moex
