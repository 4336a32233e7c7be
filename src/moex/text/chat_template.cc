#include "moex/text/chat_template.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "moex/base/error.h"
#include "moex/base/small_file.h"
#include "moex/model/gguf.h"
#include "moex/text/tokenizer.h"

namespace moex {

// Mixtral-8x7B-Instruct-v0.1's tokenizer_config.json `chat_template`, as the model ships it.
const char* const kMixtralChatTemplate =
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n";

const char* const kChatMLTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

namespace jinja {

using json = nlohmann::json;

[[noreturn]] void fail(int line, const std::string& what) {
  throw_error(ErrorKind::kInvalidInput, "chat template line " + std::to_string(line) + ": " + what);
}

// A Jinja value: JSON data, or Undefined (a name or key that does not exist).
struct Value {
  bool undefined = false;
  json v;
  static Value undef() { return Value{true, nullptr}; }
  static Value of(json j) { return Value{false, std::move(j)}; }
};

enum class Kind {
  // expressions
  kLiteral, kName, kList, kAttr, kIndex, kSlice, kCall, kMethod, kFilter, kTest, kNot, kNeg, kBinary,
  kAnd, kOr, kCond,
  // statements
  kText, kOutput, kIf, kFor, kSet, kBody,
};

}  // namespace jinja

struct jinja::Node {
  Kind kind;
  int line = 0;
  std::string name;  // name, attribute, operator, filter, test, method, set/for target; text for kText
  json literal;
  bool negate = false;                          // `is not`
  std::vector<std::unique_ptr<Node>> children;  // operands, arguments; kIf: cond, body, cond, body, [else]
  Node(Kind k, int l) : kind(k), line(l) {}
};

namespace jinja {
namespace {

using NodePtr = std::unique_ptr<Node>;

NodePtr make(Kind k, int line, std::string name = {}) {
  auto n = std::make_unique<Node>(k, line);
  n->name = std::move(name);
  return n;
}

// ---- splitting the source into text and tags, with HF's trim_blocks + lstrip_blocks ----

enum class SegKind { kText, kExpr, kStmt };
struct Segment {
  SegKind kind;
  std::string text;
  int line;
};

int line_at(const std::string& s, size_t pos) {
  return 1 + static_cast<int>(std::count(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(pos), '\n'));
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::vector<Segment> split(const std::string& source) {
  // As Jinja's lexer: line endings become "\n" and one trailing newline is dropped (keep_trailing_newline
  // is off in HF's environment).
  std::string src;
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src += source[i];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  std::vector<Segment> out;
  size_t pos = 0;
  bool strip_next = false;     // a `-` closed the previous tag: the next text loses its leading whitespace
  bool trim_newline = false;   // trim_blocks: a block tag closed: the next text loses one leading newline
  while (pos <= src.size()) {
    size_t open = src.find('{', pos);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' &&
           src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open != std::string::npos && open + 1 >= src.size()) open = std::string::npos;
    std::string text = src.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    if (strip_next) {
      size_t i = 0;
      while (i < text.size() && is_space(text[i])) ++i;
      text.erase(0, i);
    } else if (trim_newline && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
    }
    strip_next = trim_newline = false;
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({SegKind::kText, text, line_at(src, pos)});
      break;
    }
    const char type = src[open + 1];
    const char marker = open + 2 < src.size() ? src[open + 2] : '\0';
    const int line = line_at(src, open);
    if (marker == '-') {
      while (!text.empty() && is_space(text.back())) text.pop_back();
    } else if (type != '{' && marker != '+') {  // lstrip_blocks: spaces between a line's start and a block tag
      size_t i = open;
      while (i > pos && (src[i - 1] == ' ' || src[i - 1] == '\t')) --i;
      if (i == 0 || src[i - 1] == '\n') {
        const size_t spaces = open - i;
        text.erase(text.size() - std::min(spaces, text.size()));
      }
    }
    if (!text.empty()) out.push_back({SegKind::kText, text, line_at(src, pos)});
    const std::string close = type == '{' ? "}}" : type == '%' ? "%}" : "#}";
    size_t body = open + 2 + ((marker == '-' || marker == '+') ? 1 : 0);
    // Find the close outside string literals.
    size_t end = body;
    char quote = 0;
    for (; end + 1 < src.size(); ++end) {
      const char c = src[end];
      if (type == '#') {
        if (src.compare(end, 2, close) == 0) break;
        continue;
      }
      if (quote) {
        if (c == '\\') ++end;
        else if (c == quote) quote = 0;
      } else if (c == '\'' || c == '"') {
        quote = c;
      } else if (src.compare(end, 2, close) == 0) {
        break;
      }
    }
    if (end + 1 >= src.size()) fail(line, "tag opened here is never closed (" + close + ")");
    size_t inner_end = end;
    bool close_strip = false;
    if (inner_end > body && src[inner_end - 1] == '-') {
      close_strip = true;
      --inner_end;
    }
    if (type != '#') {
      out.push_back({type == '{' ? SegKind::kExpr : SegKind::kStmt, src.substr(body, inner_end - body), line});
    }
    strip_next = close_strip;
    trim_newline = !close_strip && type != '{';
    pos = end + 2;
  }
  return out;
}

// ---- expression tokens ----

enum class Tok { kName, kString, kInt, kFloat, kOp, kEnd };
struct Token {
  Tok kind;
  std::string text;
};

std::vector<Token> lex(const std::string& s, int line) {
  std::vector<Token> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (is_space(c)) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Tok::kName, s.substr(i, j - i)});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      bool is_float = j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]));
      if (is_float) {
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      out.push_back({is_float ? Tok::kFloat : Tok::kInt, s.substr(i, j - i)});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string value;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          switch (e) {
            case 'n': value += '\n'; break;
            case 't': value += '\t'; break;
            case 'r': value += '\r'; break;
            case '\\': value += '\\'; break;
            case '\'': value += '\''; break;
            case '"': value += '"'; break;
            default: value += '\\'; value += e;
          }
        } else {
          value += s[j];
        }
      }
      if (j >= s.size()) fail(line, "unterminated string literal");
      out.push_back({Tok::kString, value});
      i = j + 1;
    } else {
      static const char* const two[] = {"==", "!=", "<=", ">=", "//", "**"};
      std::string op(1, c);
      for (const char* t : two)
        if (s.compare(i, 2, t) == 0) op = t;
      if (op.size() == 1 && std::string("()[].,:|+-*/%~<>=").find(c) == std::string::npos)
        fail(line, std::string("unexpected character '") + c + "'");
      out.push_back({Tok::kOp, op});
      i += op.size();
    }
  }
  out.push_back({Tok::kEnd, ""});
  return out;
}

// ---- expression parser (Jinja's precedence) ----

class ExprParser {
 public:
  ExprParser(std::vector<Token> tokens, int line) : t_(std::move(tokens)), line_(line) {}

  NodePtr expression() { return conditional(); }
  bool at_end() const { return t_[i_].kind == Tok::kEnd; }
  bool next_is_name(const char* name) const { return t_[i_].kind == Tok::kName && t_[i_].text == name; }
  std::string name() {
    if (t_[i_].kind != Tok::kName) fail(line_, "expected a name, got '" + t_[i_].text + "'");
    return t_[i_++].text;
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(line_, std::string("expected '") + op + "', got '" + t_[i_].text + "'");
  }
  void expect_end() {
    if (!at_end()) fail(line_, "unexpected '" + t_[i_].text + "'");
  }

 private:
  bool accept_op(const char* op) {
    if (t_[i_].kind == Tok::kOp && t_[i_].text == op) return ++i_, true;
    return false;
  }
  bool accept_name(const char* n) {
    if (next_is_name(n)) return ++i_, true;
    return false;
  }
  NodePtr binary(std::string op, NodePtr a, NodePtr b) {
    auto n = make(Kind::kBinary, line_, std::move(op));
    n->children.push_back(std::move(a));
    n->children.push_back(std::move(b));
    return n;
  }
  NodePtr conditional() {
    NodePtr value = or_expr();
    if (!accept_name("if")) return value;
    auto n = make(Kind::kCond, line_);
    n->children.push_back(or_expr());  // condition
    n->children.push_back(std::move(value));
    if (accept_name("else")) n->children.push_back(conditional());
    return n;
  }
  NodePtr or_expr() {
    NodePtr a = and_expr();
    while (accept_name("or")) {
      auto n = make(Kind::kOr, line_);
      n->children.push_back(std::move(a));
      n->children.push_back(and_expr());
      a = std::move(n);
    }
    return a;
  }
  NodePtr and_expr() {
    NodePtr a = not_expr();
    while (accept_name("and")) {
      auto n = make(Kind::kAnd, line_);
      n->children.push_back(std::move(a));
      n->children.push_back(not_expr());
      a = std::move(n);
    }
    return a;
  }
  NodePtr not_expr() {
    if (accept_name("not")) {
      auto n = make(Kind::kNot, line_);
      n->children.push_back(not_expr());
      return n;
    }
    return compare();
  }
  NodePtr compare() {
    NodePtr a = math1();
    while (true) {
      std::string op;
      if (t_[i_].kind == Tok::kOp && (t_[i_].text == "==" || t_[i_].text == "!=" || t_[i_].text == "<" ||
                                      t_[i_].text == ">" || t_[i_].text == "<=" || t_[i_].text == ">=")) {
        op = t_[i_++].text;
      } else if (accept_name("in")) {
        op = "in";
      } else if (next_is_name("not") && t_[i_ + 1].kind == Tok::kName && t_[i_ + 1].text == "in") {
        i_ += 2;
        op = "not in";
      } else {
        return a;
      }
      a = binary(op, std::move(a), math1());
    }
  }
  NodePtr math1() {
    NodePtr a = concat();
    while (true) {
      if (accept_op("+")) a = binary("+", std::move(a), concat());
      else if (accept_op("-")) a = binary("-", std::move(a), concat());
      else return a;
    }
  }
  NodePtr concat() {
    NodePtr a = math2();
    while (accept_op("~")) a = binary("~", std::move(a), math2());
    return a;
  }
  NodePtr math2() {
    NodePtr a = unary();
    while (true) {
      if (accept_op("*")) a = binary("*", std::move(a), unary());
      else if (accept_op("//")) a = binary("//", std::move(a), unary());
      else if (accept_op("/")) a = binary("/", std::move(a), unary());
      else if (accept_op("%")) a = binary("%", std::move(a), unary());
      else return a;
    }
  }
  NodePtr unary() {
    if (accept_op("-")) {
      auto n = make(Kind::kNeg, line_);
      n->children.push_back(unary());
      return n;
    }
    if (accept_op("+")) return unary();
    return filters(postfix(primary()));
  }
  NodePtr primary() {
    const Token tok = t_[i_++];
    switch (tok.kind) {
      case Tok::kString: {
        auto n = make(Kind::kLiteral, line_);
        n->literal = tok.text;
        // Adjacent string literals concatenate, as in Python.
        while (t_[i_].kind == Tok::kString) n->literal = n->literal.get<std::string>() + t_[i_++].text;
        return n;
      }
      case Tok::kInt: {
        auto n = make(Kind::kLiteral, line_);
        n->literal = std::stoll(tok.text);
        return n;
      }
      case Tok::kFloat: {
        auto n = make(Kind::kLiteral, line_);
        n->literal = std::stod(tok.text);
        return n;
      }
      case Tok::kName: {
        if (tok.text == "true" || tok.text == "True" || tok.text == "false" || tok.text == "False") {
          auto n = make(Kind::kLiteral, line_);
          n->literal = tok.text == "true" || tok.text == "True";
          return n;
        }
        if (tok.text == "none" || tok.text == "None") {
          auto n = make(Kind::kLiteral, line_);
          n->literal = nullptr;
          return n;
        }
        return make(Kind::kName, line_, tok.text);
      }
      case Tok::kOp:
        if (tok.text == "(") {
          NodePtr inner = expression();
          expect_op(")");
          return inner;
        }
        if (tok.text == "[") {
          auto n = make(Kind::kList, line_);
          while (!accept_op("]")) {
            if (!n->children.empty()) expect_op(",");
            if (accept_op("]")) break;
            n->children.push_back(expression());
          }
          return n;
        }
        break;
      case Tok::kEnd:
        fail(line_, "expression ends too early");
    }
    fail(line_, "unexpected '" + tok.text + "'");
  }
  void arguments(Node* call) {  // after '('
    while (!accept_op(")")) {
      if (!call->children.empty() && call->kind != Kind::kMethod) expect_op(",");
      else if (call->kind == Kind::kMethod && call->children.size() > 1) expect_op(",");
      if (t_[i_].kind == Tok::kName && t_[i_ + 1].kind == Tok::kOp && t_[i_ + 1].text == "=")
        fail(line_, "keyword arguments are not supported");
      call->children.push_back(expression());
    }
  }
  NodePtr postfix(NodePtr node) {
    while (true) {
      if (accept_op(".")) {
        auto n = make(Kind::kAttr, line_, name());
        n->children.push_back(std::move(node));
        if (accept_op("(")) {  // a method call: receiver first, then the arguments
          n->kind = Kind::kMethod;
          arguments(n.get());
        }
        node = std::move(n);
      } else if (accept_op("[")) {
        // a[i] or a[start:stop:step] (each part optional)
        NodePtr parts[3];
        bool slice = false;
        int part = 0;
        while (!accept_op("]")) {
          if (accept_op(":")) {
            slice = true;
            if (++part > 2) fail(line_, "bad slice");
            continue;
          }
          if (parts[part]) fail(line_, "bad subscript");
          parts[part] = expression();
        }
        if (slice) {
          auto n = make(Kind::kSlice, line_);
          n->children.push_back(std::move(node));
          for (auto& p : parts) n->children.push_back(p ? std::move(p) : nullptr);
          node = std::move(n);
        } else {
          if (!parts[0]) fail(line_, "empty subscript");
          auto n = make(Kind::kIndex, line_);
          n->children.push_back(std::move(node));
          n->children.push_back(std::move(parts[0]));
          node = std::move(n);
        }
      } else if (t_[i_].kind == Tok::kOp && t_[i_].text == "(") {
        ++i_;
        if (node->kind != Kind::kName) fail(line_, "only named functions can be called");
        auto n = make(Kind::kCall, line_, node->name);
        arguments(n.get());
        node = std::move(n);
      } else {
        return node;
      }
    }
  }
  NodePtr filters(NodePtr node) {
    while (true) {
      if (accept_op("|")) {
        auto n = make(Kind::kFilter, line_, name());
        n->children.push_back(std::move(node));
        if (accept_op("(")) {
          n->kind = Kind::kFilter;
          while (!accept_op(")")) {
            if (n->children.size() > 1) expect_op(",");
            n->children.push_back(expression());
          }
        }
        static const std::set<std::string> known = {"trim", "length", "count", "lower", "upper", "string", "default", "d"};
        if (!known.count(n->name)) fail(line_, "unsupported filter '" + n->name + "'");
        node = std::move(n);
      } else if (accept_name("is")) {
        auto n = make(Kind::kTest, line_);
        n->negate = accept_name("not");
        n->name = name();
        static const std::set<std::string> known = {"defined", "undefined", "none", "string", "number",
                                                    "mapping", "sequence", "iterable", "boolean", "integer"};
        if (!known.count(n->name)) fail(line_, "unsupported test '" + n->name + "'");
        n->children.push_back(std::move(node));
        node = std::move(n);
      } else {
        return node;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int line_;
};

// ---- statements ----

class StmtParser {
 public:
  explicit StmtParser(std::vector<Segment> segs) : segs_(std::move(segs)) {}

  NodePtr parse() {
    auto body = block({});
    if (i_ < segs_.size()) fail(segs_[i_].line, "unexpected {% " + keyword(segs_[i_]) + " %}");
    return body;
  }

 private:
  static std::string keyword(const Segment& s) {
    size_t i = 0;
    while (i < s.text.size() && is_space(s.text[i])) ++i;
    size_t j = i;
    while (j < s.text.size() && (std::isalnum(static_cast<unsigned char>(s.text[j])) || s.text[j] == '_')) ++j;
    return s.text.substr(i, j - i);
  }
  // Parses until a statement whose keyword is in `ends` (left unconsumed) or the end.
  NodePtr block(const std::set<std::string>& ends) {
    auto body = make(Kind::kBody, i_ < segs_.size() ? segs_[i_].line : 0);
    while (i_ < segs_.size()) {
      const Segment& s = segs_[i_];
      if (s.kind == SegKind::kText) {
        body->children.push_back(make(Kind::kText, s.line, s.text));
        ++i_;
        continue;
      }
      ExprParser p(lex(s.text, s.line), s.line);
      if (s.kind == SegKind::kExpr) {
        auto out = make(Kind::kOutput, s.line);
        out->children.push_back(p.expression());
        p.expect_end();
        body->children.push_back(std::move(out));
        ++i_;
        continue;
      }
      const std::string kw = keyword(s);
      if (ends.count(kw)) return body;
      ++i_;
      p.name();
      if (kw == "if") {
        auto node = make(Kind::kIf, s.line);
        node->children.push_back(p.expression());
        p.expect_end();
        node->children.push_back(block({"elif", "else", "endif"}));
        while (true) {
          if (i_ >= segs_.size()) fail(s.line, "{% if %} without {% endif %}");
          const Segment& e = segs_[i_++];
          ExprParser q(lex(e.text, e.line), e.line);
          const std::string ekw = q.name();
          if (ekw == "elif") {
            node->children.push_back(q.expression());
            q.expect_end();
            node->children.push_back(block({"elif", "else", "endif"}));
          } else if (ekw == "else") {
            q.expect_end();
            node->children.push_back(block({"endif"}));
          } else {
            q.expect_end();
            break;
          }
        }
        body->children.push_back(std::move(node));
      } else if (kw == "for") {
        auto node = make(Kind::kFor, s.line, p.name());
        if (!p.next_is_name("in")) fail(s.line, "only `for name in expression` is supported");
        p.name();
        node->children.push_back(p.expression());
        p.expect_end();
        node->children.push_back(block({"endfor", "else"}));
        if (i_ >= segs_.size()) fail(s.line, "{% for %} without {% endfor %}");
        if (keyword(segs_[i_]) == "else") fail(segs_[i_].line, "{% for %}...{% else %} is not supported");
        ExprParser q(lex(segs_[i_].text, segs_[i_].line), segs_[i_].line);
        q.name();
        q.expect_end();
        ++i_;
        body->children.push_back(std::move(node));
      } else if (kw == "set") {
        auto node = make(Kind::kSet, s.line, p.name());
        p.expect_op("=");
        node->children.push_back(p.expression());
        p.expect_end();
        body->children.push_back(std::move(node));
      } else {
        fail(s.line, "unsupported statement {% " + kw + " %}");
      }
    }
    if (!ends.empty()) fail(segs_.empty() ? 0 : segs_.back().line, "template ends inside a block");
    return body;
  }

  std::vector<Segment> segs_;
  size_t i_ = 0;
};

// ---- evaluation ----

bool truthy(const Value& x) {
  if (x.undefined || x.v.is_null()) return false;
  if (x.v.is_boolean()) return x.v.get<bool>();
  if (x.v.is_number_integer()) return x.v.get<int64_t>() != 0;
  if (x.v.is_number()) return x.v.get<double>() != 0.0;
  if (x.v.is_string()) return !x.v.get_ref<const std::string&>().empty();
  return !x.v.empty();
}

std::string to_text(const Value& x, int line) {
  if (x.undefined) return "";
  const json& v = x.v;
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "None";
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number()) {
    std::ostringstream s;
    s << v.get<double>();
    return s.str();
  }
  fail(line, "cannot print a list or mapping");
}

// A string as Python sees it: a sequence of code points (each kept as its UTF-8 bytes; a stray byte
// that is not UTF-8 counts as one).
std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    if (i + len > s.size()) len = 1;
    for (size_t j = 1; j < len; ++j)
      if ((static_cast<unsigned char>(s[i + j]) & 0xC0) != 0x80) len = 1;
    out.push_back(s.substr(i, len));
    i += len;
  }
  return out;
}

int64_t as_int(const Value& x, int line) {
  if (x.undefined || !x.v.is_number_integer()) fail(line, "expected an integer");
  return x.v.get<int64_t>();
}

class Renderer {
 public:
  explicit Renderer(std::map<std::string, Value> globals) { scopes_.push_back(std::move(globals)); }

  void run(const Node& n, std::string& out) {
    switch (n.kind) {
      case Kind::kBody:
        for (const auto& c : n.children) run(*c, out);
        return;
      case Kind::kText:
        out += n.name;
        return;
      case Kind::kOutput:
        out += to_text(eval(*n.children[0]), n.line);
        return;
      case Kind::kIf: {
        size_t i = 0;
        for (; i + 1 < n.children.size(); i += 2)
          if (truthy(eval(*n.children[i]))) return run(*n.children[i + 1], out);
        if (i < n.children.size()) run(*n.children[i], out);
        return;
      }
      case Kind::kSet:
        scopes_.back()[n.name] = eval(*n.children[0]);
        return;
      case Kind::kFor: {
        const Value seq = eval(*n.children[0]);
        if (seq.undefined) return;  // jinja2: iterating Undefined gives nothing
        std::vector<json> items;
        if (seq.v.is_array()) items.assign(seq.v.begin(), seq.v.end());
        else if (seq.v.is_object()) for (auto it = seq.v.begin(); it != seq.v.end(); ++it) items.push_back(it.key());
        else if (seq.v.is_string()) for (const std::string& c : code_points(seq.v.get<std::string>())) items.push_back(c);
        else fail(n.line, "cannot loop over this value");
        const int64_t len = static_cast<int64_t>(items.size());
        for (int64_t i = 0; i < len; ++i) {
          scopes_.emplace_back();
          scopes_.back()[n.name] = Value::of(items[i]);
          scopes_.back()["loop"] = Value::of(json{{"index", i + 1}, {"index0", i}, {"first", i == 0},
                                                  {"last", i == len - 1}, {"length", len},
                                                  {"revindex", len - i}, {"revindex0", len - i - 1}});
          run(*n.children[1], out);
          scopes_.pop_back();
        }
        return;
      }
      default:
        fail(n.line, "internal: not a statement");
    }
  }

 private:
  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::undef();
  }

  static Value item(const Value& base, const Value& key, int line) {
    if (base.undefined) fail(line, "an undefined value has no items");
    if (base.v.is_object() && !key.undefined && key.v.is_string()) {
      auto it = base.v.find(key.v.get<std::string>());
      return it == base.v.end() ? Value::undef() : Value::of(*it);
    }
    if ((base.v.is_array() || base.v.is_string()) && !key.undefined && key.v.is_number_integer()) {
      const std::vector<std::string> chars = base.v.is_string() ? code_points(base.v.get<std::string>())
                                                                : std::vector<std::string>();
      const int64_t size = base.v.is_array() ? static_cast<int64_t>(base.v.size()) : static_cast<int64_t>(chars.size());
      int64_t i = key.v.get<int64_t>();
      if (i < 0) i += size;
      if (i < 0 || i >= size) return Value::undef();
      if (base.v.is_array()) return Value::of(base.v[static_cast<size_t>(i)]);
      return Value::of(chars[static_cast<size_t>(i)]);
    }
    return Value::undef();
  }

  Value slice(const Node& n) {
    const Value base = eval(*n.children[0]);
    if (base.undefined || !(base.v.is_array() || base.v.is_string())) fail(n.line, "only lists and strings can be sliced");
    const std::vector<std::string> chars = base.v.is_string() ? code_points(base.v.get<std::string>())
                                                              : std::vector<std::string>();
    const int64_t size = base.v.is_array() ? static_cast<int64_t>(base.v.size()) : static_cast<int64_t>(chars.size());
    const int64_t step = n.children[3] ? as_int(eval(*n.children[3]), n.line) : 1;
    if (step == 0) fail(n.line, "slice step cannot be zero");
    // Python's slice.indices()
    const auto bound = [&](const NodePtr& e, int64_t dflt) {
      if (!e) return dflt;
      int64_t v = as_int(eval(*e), n.line);
      if (v < 0) v += size;
      if (step > 0) return std::clamp<int64_t>(v, 0, size);
      return std::clamp<int64_t>(v, -1, size - 1);
    };
    const int64_t start = bound(n.children[1], step > 0 ? 0 : size - 1);
    const int64_t stop = bound(n.children[2], step > 0 ? size : -1);
    json out = base.v.is_array() ? json::array() : json("");
    std::string s;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (base.v.is_array()) out.push_back(base.v[static_cast<size_t>(i)]);
      else s += chars[static_cast<size_t>(i)];
    }
    return Value::of(base.v.is_array() ? out : json(s));
  }

  static bool equal(const Value& a, const Value& b) {
    if (a.undefined || b.undefined) return a.undefined && b.undefined;
    return a.v == b.v;
  }

  Value binary(const Node& n) {
    const std::string& op = n.name;
    const Value a = eval(*n.children[0]), b = eval(*n.children[1]);
    if (op == "==") return Value::of(equal(a, b));
    if (op == "!=") return Value::of(!equal(a, b));
    if (op == "~") return Value::of(to_text(a, n.line) + to_text(b, n.line));
    if (op == "in" || op == "not in") {
      bool found = false;
      if (b.undefined) fail(n.line, "'in' an undefined value");
      if (b.v.is_string()) {
        if (a.undefined || !a.v.is_string()) fail(n.line, "'in' a string needs a string");
        found = b.v.get<std::string>().find(a.v.get<std::string>()) != std::string::npos;
      } else if (b.v.is_array()) {
        for (const json& e : b.v) found = found || (!a.undefined && e == a.v);
      } else if (b.v.is_object()) {
        found = !a.undefined && a.v.is_string() && b.v.contains(a.v.get<std::string>());
      } else {
        fail(n.line, "'in' needs a string, list or mapping");
      }
      return Value::of(op == "in" ? found : !found);
    }
    if (a.undefined || b.undefined) fail(n.line, "an undefined value in '" + op + "'");
    if (op == "+" && a.v.is_string() && b.v.is_string()) return Value::of(a.v.get<std::string>() + b.v.get<std::string>());
    if (op == "+" && a.v.is_array() && b.v.is_array()) {
      json out = a.v;
      for (const json& e : b.v) out.push_back(e);
      return Value::of(out);
    }
    if (op == "*" && a.v.is_string() && b.v.is_number_integer()) {
      std::string out;
      for (int64_t i = 0; i < b.v.get<int64_t>(); ++i) out += a.v.get<std::string>();
      return Value::of(out);
    }
    if ((op == "<" || op == ">" || op == "<=" || op == ">=") && a.v.is_string() && b.v.is_string()) {
      const int c = a.v.get<std::string>().compare(b.v.get<std::string>());
      return Value::of(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    const bool num = (a.v.is_number() || a.v.is_boolean()) && (b.v.is_number() || b.v.is_boolean());
    if (!num) fail(n.line, "unsupported operand types for '" + op + "'");
    const bool ints = !a.v.is_number_float() && !b.v.is_number_float();
    const auto i64 = [](const json& v) { return v.is_boolean() ? int64_t{v.get<bool>()} : v.get<int64_t>(); };
    const auto f64 = [](const json& v) { return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>(); };
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      const double x = f64(a.v), y = f64(b.v);
      return Value::of(op == "<" ? x < y : op == ">" ? x > y : op == "<=" ? x <= y : x >= y);
    }
    if (op == "/") {
      if (f64(b.v) == 0.0) fail(n.line, "division by zero");
      return Value::of(f64(a.v) / f64(b.v));
    }
    if (ints) {
      const int64_t x = i64(a.v), y = i64(b.v);
      if (op == "+") return Value::of(x + y);
      if (op == "-") return Value::of(x - y);
      if (op == "*") return Value::of(x * y);
      if (y == 0) fail(n.line, "division by zero");
      // Python's floor division and modulo (the sign of the divisor)
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) --q, r += y;
      return Value::of(op == "//" ? q : r);
    }
    const double x = f64(a.v), y = f64(b.v);
    if (op == "+") return Value::of(x + y);
    if (op == "-") return Value::of(x - y);
    if (op == "*") return Value::of(x * y);
    if (y == 0.0) fail(n.line, "division by zero");
    if (op == "//") return Value::of(std::floor(x / y));
    return Value::of(x - y * std::floor(x / y));
  }

  static std::string strip(const std::string& s, bool left, bool right, const std::string* chars) {
    const auto strip_char = [&](char c) { return chars ? chars->find(c) != std::string::npos : is_space(c); };
    size_t b = 0, e = s.size();
    if (left) while (b < e && strip_char(s[b])) ++b;
    if (right) while (e > b && strip_char(s[e - 1])) --e;
    return s.substr(b, e - b);
  }

  Value method(const Node& n) {
    const Value self = eval(*n.children[0]);
    std::vector<Value> args;
    for (size_t i = 1; i < n.children.size(); ++i) args.push_back(eval(*n.children[i]));
    if (self.undefined || !self.v.is_string()) fail(n.line, "method '" + n.name + "' needs a string");
    const std::string s = self.v.get<std::string>();
    const auto str_arg = [&](size_t i) -> const std::string& {
      if (i >= args.size() || args[i].undefined || !args[i].v.is_string()) fail(n.line, "'" + n.name + "' needs a string argument");
      return args[i].v.get_ref<const std::string&>();
    };
    if (n.name == "strip" || n.name == "lstrip" || n.name == "rstrip") {
      const std::string* chars = args.empty() ? nullptr : &str_arg(0);
      return Value::of(strip(s, n.name != "rstrip", n.name != "lstrip", chars));
    }
    if (n.name == "startswith") return Value::of(s.rfind(str_arg(0), 0) == 0);
    if (n.name == "endswith") {
      const std::string& x = str_arg(0);
      return Value::of(s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0);
    }
    if (n.name == "upper" || n.name == "lower") {
      std::string out = s;
      for (char& c : out) c = static_cast<char>(n.name == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                                                  : std::tolower(static_cast<unsigned char>(c)));
      return Value::of(out);
    }
    fail(n.line, "unsupported method '" + n.name + "'");
  }

  Value filter(const Node& n) {
    const Value x = eval(*n.children[0]);
    const std::string& f = n.name;
    if (f == "default" || f == "d") return x.undefined ? (n.children.size() > 1 ? eval(*n.children[1]) : Value::of("")) : x;
    if (f == "string") return Value::of(to_text(x, n.line));
    if (x.undefined) fail(n.line, "filter '" + f + "' of an undefined value");
    if (f == "length" || f == "count") {
      if (x.v.is_string()) return Value::of(static_cast<int64_t>(code_points(x.v.get<std::string>()).size()));
      if (x.v.is_array() || x.v.is_object()) return Value::of(static_cast<int64_t>(x.v.size()));
      fail(n.line, "length of a value that has none");
    }
    const std::string s = to_text(x, n.line);
    if (f == "trim") return Value::of(strip(s, true, true, nullptr));
    std::string out = s;
    for (char& c : out) c = static_cast<char>(f == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                                           : std::tolower(static_cast<unsigned char>(c)));
    return Value::of(out);
  }

  Value test(const Node& n) {
    const Value x = eval(*n.children[0]);
    const std::string& t = n.name;
    bool r;
    if (t == "defined") r = !x.undefined;
    else if (t == "undefined") r = x.undefined;
    else if (x.undefined) r = false;
    else if (t == "none") r = x.v.is_null();
    else if (t == "string") r = x.v.is_string();
    else if (t == "number") r = x.v.is_number();
    else if (t == "integer") r = x.v.is_number_integer();
    else if (t == "boolean") r = x.v.is_boolean();
    else if (t == "mapping") r = x.v.is_object();
    else r = x.v.is_array() || x.v.is_object() || x.v.is_string();  // sequence, iterable
    return Value::of(n.negate ? !r : r);
  }

  Value eval(const Node& n) {
    switch (n.kind) {
      case Kind::kLiteral: return Value::of(n.literal);
      case Kind::kName: return lookup(n.name);
      case Kind::kList: {
        json out = json::array();
        for (const auto& c : n.children) {
          const Value v = eval(*c);
          if (v.undefined) fail(n.line, "an undefined value in a list");
          out.push_back(v.v);
        }
        return Value::of(out);
      }
      case Kind::kAttr: return item(eval(*n.children[0]), Value::of(n.name), n.line);
      case Kind::kIndex: return item(eval(*n.children[0]), eval(*n.children[1]), n.line);
      case Kind::kSlice: return slice(n);
      case Kind::kMethod: return method(n);
      case Kind::kFilter: return filter(n);
      case Kind::kTest: return test(n);
      case Kind::kNot: return Value::of(!truthy(eval(*n.children[0])));
      case Kind::kNeg: {
        const Value x = eval(*n.children[0]);
        if (x.undefined || !x.v.is_number()) fail(n.line, "'-' needs a number");
        return x.v.is_number_integer() ? Value::of(-x.v.get<int64_t>()) : Value::of(-x.v.get<double>());
      }
      case Kind::kAnd: {  // Python: the deciding operand itself
        Value a = eval(*n.children[0]);
        return truthy(a) ? eval(*n.children[1]) : a;
      }
      case Kind::kOr: {
        Value a = eval(*n.children[0]);
        return truthy(a) ? a : eval(*n.children[1]);
      }
      case Kind::kCond:
        if (truthy(eval(*n.children[0]))) return eval(*n.children[1]);
        return n.children.size() > 2 ? eval(*n.children[2]) : Value::undef();
      case Kind::kBinary: return binary(n);
      case Kind::kCall: {
        if (n.name == "raise_exception") {
          const std::string msg = n.children.empty() ? "" : to_text(eval(*n.children[0]), n.line);
          throw_error(ErrorKind::kInvalidInput, "chat template: " + msg);
        }
        fail(n.line, "unsupported function '" + n.name + "'");
      }
      default:
        fail(n.line, "internal: not an expression");
    }
  }

  std::vector<std::map<std::string, Value>> scopes_;
};

// Functions are checked at parse time, so an unknown one fails at start-up.
void check_calls(const Node& n) {
  if (n.kind == Kind::kCall && n.name != "raise_exception") fail(n.line, "unsupported function '" + n.name + "'");
  if (n.kind == Kind::kMethod) {
    static const std::set<std::string> known = {"strip", "lstrip", "rstrip", "startswith", "endswith", "upper", "lower"};
    if (!known.count(n.name)) fail(n.line, "unsupported method '" + n.name + "'");
  }
  for (const auto& c : n.children)
    if (c) check_calls(*c);
}

}  // namespace
}  // namespace jinja

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token)
    : source_(std::move(source)), bos_token_(std::move(bos_token)), eos_token_(std::move(eos_token)) {
  root_ = jinja::StmtParser(jinja::split(source_)).parse();
  jinja::check_calls(*root_);
  if (source_.find("<|im_start|>") != std::string::npos) family_ = "chatml";
  else if (source_.find("[INST]") != std::string::npos) family_ = "mixtral";
  else family_ = "custom";
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  nlohmann::json list = nlohmann::json::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  std::map<std::string, jinja::Value> globals;
  globals["messages"] = jinja::Value::of(list);
  globals["bos_token"] = jinja::Value::of(bos_token_);
  globals["eos_token"] = jinja::Value::of(eos_token_);
  globals["add_generation_prompt"] = jinja::Value::of(add_generation_prompt);
  std::string out;
  jinja::Renderer(std::move(globals)).run(*root_, out);
  return out;
}

std::vector<int> ChatTemplate::encode(const Tokenizer& tokenizer, const std::string& rendered) const {
  std::vector<int> ids;
  size_t pos = 0;
  while (pos < rendered.size()) {
    // A token the tokenizer lacks (a template's "<s>" on a vocabulary without BOS) stays text.
    size_t bos = bos_token_.empty() || tokenizer.bos_id() < 0 ? std::string::npos : rendered.find(bos_token_, pos);
    size_t eos = eos_token_.empty() || tokenizer.eos_id() < 0 ? std::string::npos : rendered.find(eos_token_, pos);
    const size_t next = std::min(bos, eos);
    const std::string text = rendered.substr(pos, next == std::string::npos ? std::string::npos : next - pos);
    if (!text.empty()) {
      const std::vector<int> piece = tokenizer.encode(text, /*add_bos=*/false);
      ids.insert(ids.end(), piece.begin(), piece.end());
    }
    if (next == std::string::npos) break;
    ids.push_back(next == bos ? tokenizer.bos_id() : tokenizer.eos_id());
    pos = next + (next == bos ? bos_token_.size() : eos_token_.size());
  }
  return ids;
}

namespace {

// What a model ships for its chat: the template as stored (null: none; a string, or HF's list of named
// templates), where it is read from, and the text of its BOS / EOS tokens ("" for none), which templates
// write as bos_token / eos_token.
struct ShippedTemplate {
  nlohmann::json chat_template;
  std::string where, bos = "<s>", eos = "</s>";
};

// A folder's tokenizer_config.json. Absent bos_token / eos_token keep Mixtral's; null is no such token
// (as Qwen's bos_token).
ShippedTemplate folder_template(const std::string& model_dir) {
  ShippedTemplate t;
  t.where = model_dir + "/tokenizer_config.json";
  if (!std::filesystem::exists(t.where)) return t;
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(read_small_file(t.where, 16 << 20));
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, t.where + ": not valid JSON: " + e.what());
  }
  MOEX_CHECK_INPUT(config.is_object(), t.where, ": not a JSON object");
  for (auto [key, out] : {std::pair{"bos_token", &t.bos}, std::pair{"eos_token", &t.eos}}) {
    const auto it = config.find(key);
    if (it == config.end()) continue;
    if (it->is_null()) *out = "";
    else if (it->is_string()) *out = it->get<std::string>();
    else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) *out = (*it)["content"].get<std::string>();
  }
  if (config.contains("chat_template")) t.chat_template = config["chat_template"];
  return t;
}

// A .gguf file's metadata: tokenizer.chat_template (llama.cpp's converter copies tokenizer_config.json's
// there), and the vocabulary's tokens at the BOS / EOS ids the model's config gives.
ShippedTemplate gguf_template(const std::string& path) {
  const GgufFile file(path);
  const GgufContents& g = file.contents();
  ShippedTemplate t;
  t.where = path;
  if (const GgufValue* v = g.find("tokenizer.chat_template")) {
    MOEX_CHECK_INPUT(v->type == GgufType::kString, path, ": tokenizer.chat_template must be a string");
    t.chat_template = v->s;
  }
  const ModelConfig c = gguf_model_config(g, path);
  const GgufValue* tokens = g.find("tokenizer.ggml.tokens");  // gguf_model_config checked it
  const auto token = [&](int id) {
    return tokens && id >= 0 && static_cast<uint64_t>(id) < tokens->strings.size() ? std::string(tokens->strings[id]) : "";
  };
  t.bos = c.has_bos ? token(c.bos_token_id) : "";
  t.eos = token(c.eos_token_id);
  return t;
}

ShippedTemplate shipped_template(const std::string& model) {
  return is_gguf_path(model) ? gguf_template(model) : folder_template(model);
}

// The template's source: a string, or from HF's list of named templates the one named "default" (what
// apply_chat_template takes when none is asked for).
std::string template_source(const ShippedTemplate& shipped) {
  const nlohmann::json* t = &shipped.chat_template;
  if (t->is_array()) {
    const nlohmann::json* chosen = nullptr;
    for (const nlohmann::json& named : *t) {
      MOEX_CHECK_INPUT(named.is_object() && named.contains("name") && named["name"].is_string() &&
                           named.contains("template") && named["template"].is_string(),
                       shipped.where, ": \"chat_template\" as a list holds {\"name\": string, \"template\": string}");
      if (named["name"] == "default") chosen = &named["template"];
    }
    MOEX_CHECK_INPUT(chosen != nullptr, shipped.where,
                     ": \"chat_template\" lists named templates but none named \"default\": pass --chat-template FILE");
    t = chosen;
  }
  MOEX_CHECK_INPUT(t->is_string(), shipped.where, ": \"chat_template\" must be a string or a list of named templates");
  return t->get<std::string>();
}

}  // namespace

ChatTemplate ChatTemplate::load(const std::string& model, const std::string& chat_template_file) {
  const ShippedTemplate shipped = shipped_template(model);
  std::string source;
  std::string where;
  if (!chat_template_file.empty()) {
    source = read_small_file(chat_template_file, 1 << 20);
    where = chat_template_file;
  } else {
    MOEX_CHECK_INPUT(!shipped.chat_template.is_null(), "the model has no chat template (", shipped.where,
                     is_gguf_path(model) ? " has no tokenizer.chat_template" : " has no \"chat_template\"",
                     "): pass --chat-template FILE");
    source = template_source(shipped);
    where = shipped.where;
  }
  try {
    return ChatTemplate(source, shipped.bos, shipped.eos);
  } catch (const Error& e) {
    throw_error(ErrorKind::kInvalidInput, where + ": " + e.what());
  }
}

std::string ChatTemplate::shipped_source(const std::string& model) {
  const ShippedTemplate shipped = shipped_template(model);
  return shipped.chat_template.is_null() ? std::string() : template_source(shipped);
}

bool ChatTemplate::model_has_template(const std::string& model) { return !shipped_template(model).chat_template.is_null(); }

}  // namespace moex
