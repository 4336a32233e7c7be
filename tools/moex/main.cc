// moex: the single binary. Errors from any subcommand become one line on stderr and a non-zero exit.
#include <cstdio>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "tools/moex/command.h"

namespace moex::tools {

static std::vector<CommandSetup>& registry() {
  static std::vector<CommandSetup> commands;
  return commands;
}

bool register_command(CommandSetup setup) {
  registry().push_back(setup);
  return true;
}

std::vector<int> parse_int_list(const std::string& text, const char* flag) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t used = 0;
    long value = 0;
    try {
      value = std::stol(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MOEX_CHECK_INPUT(!item.empty() && used == item.size() && value >= 0 && value <= INT32_MAX, flag,
                     ": '", item, "' is not a non-negative integer (expected a list like 1,2,3)");
    out.push_back(static_cast<int>(value));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace moex::tools

int main(int argc, char** argv) {
  CLI::App app{"MoEX: a Mixture-of-Experts inference engine (Mixtral family)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "moex 0.1");
  // One line per error, like every other MoEX error; --help stays one flag away.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "moex: error: " + std::string(e.what()) + " (see --help)\n";
  });
  for (auto setup : moex::tools::registry()) setup(app);
  const auto is_command = [&](const char* name) {
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      if (sub->get_name() == name) return true;
    return false;
  };
  if (argc > 1 && argv[1][0] != '-' && !is_command(argv[1])) {
    std::string names;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      names += (names.empty() ? "" : ", ") + sub->get_name();
    std::fprintf(stderr, "moex: error: unknown command \"%s\" (valid: %s)\n", argv[1], names.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Bad flags: CLI11 prints one line naming the flag; usage errors exit with 2 like our input errors.
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  } catch (const moex::Error& e) {
    std::fprintf(stderr, "moex: error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moex: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
