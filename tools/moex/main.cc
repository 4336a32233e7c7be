// moex: the single binary. Errors from any subcommand become one line on stderr and a non-zero exit.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"
#include "moex/comm/job.h"
#include "tools/moex/command.h"

extern char** environ;

namespace moex::tools {

static std::vector<CommandSetup>& registry() {
  static std::vector<CommandSetup> commands;
  return commands;
}

bool register_command(CommandSetup setup) {
  registry().push_back(setup);
  return true;
}

// Environment that may differ per rank: it changes how fast a rank runs or what it logs, never what it
// computes or which collectives it calls. Every other MOEX_* variable must match rank 0 (a different
// MOEX_COMM_ALGO or MOEX_SHM_* would run mismatched collectives).
static bool may_differ_per_rank(std::string_view name) {
  for (const char* allowed : {"MOEX_THREADS", "MOEX_PIN_THREADS", "MOEX_LOG_LEVEL", "MOEX_COMM_TIMEOUT"})
    if (name == allowed) return true;
  return false;
}

// What every rank must run alike: the command, every flag's value (given or default) and the MOEX_*
// environment. --model is left out: ModelFlags::load compares the folder's content instead, so the same
// model under different paths is fine.
comm::Description describe_invocation(const CLI::App& app) {
  comm::Description out;
  for (const CLI::App* sub : app.get_subcommands()) {
    out.emplace_back("command", sub->get_name());
    for (const CLI::Option* opt : sub->get_options()) {
      const std::string name = opt->get_name();
      if (name == "--model" || name == "--help") continue;
      std::string value;
      if (opt->count() > 0) {
        for (const std::string& r : opt->results()) value += (value.empty() ? "" : ",") + r;
      } else {
        value = opt->get_default_str().empty() ? "(not set)" : opt->get_default_str();
      }
      out.emplace_back(name, value);
    }
  }
  std::vector<std::pair<std::string, std::string>> env;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (entry.rfind("MOEX_", 0) != 0 || eq == std::string::npos || may_differ_per_rank(entry.substr(0, eq))) continue;
    env.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  std::sort(env.begin(), env.end());
  out.insert(out.end(), env.begin(), env.end());
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
  // Under mpirun every rank starts MPI first, so that every error below, on any rank, can end the job:
  // a rank that returned alone would leave its peers waiting in a collective forever.
  moex::comm::Communicator* world = nullptr;
  try {
    if (moex::comm::launched_by_mpi_launcher()) world = &moex::comm::init();
  } catch (const moex::Error& e) {
    std::fprintf(stderr, "moex: error: %s\n", e.what());
    return e.exit_code();
  }
  const bool several_ranks = world && world->size() > 1;
  // Before the command runs, every rank checks that it runs what rank 0 runs (start-up errors included).
  bool checked = false;
  const auto check_start_up = [&](const std::function<moex::comm::Description()>& describe) {
    checked = true;
    if (several_ranks) moex::comm::check_same_on_all_ranks(*world, describe);
  };
  app.parse_complete_callback([&] { check_start_up([&] { return moex::tools::describe_invocation(app); }); });
  try {
    try {
      if (argc > 1 && argv[1][0] != '-' && !is_command(argv[1])) {
        std::string names;
        for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
          names += (names.empty() ? "" : ", ") + sub->get_name();
        throw moex::Error(moex::ErrorKind::kInvalidInput,
                          "unknown command \"" + std::string(argv[1]) + "\" (valid: " + names + ")");
      }
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      const int code = e.get_exit_code() == 0 ? 0 : 2;  // usage errors exit with 2 like our input errors
      if (!checked) {
        // --help / --version: every rank must ask for it; a bad flag: one line, from rank 0.
        check_start_up([&]() -> moex::comm::Description {
          if (code == 0) return {{"command", std::string(e.get_name()) + " " + e.what()}};
          throw moex::Error(moex::ErrorKind::kInvalidInput, std::string(e.what()) + " (see --help)");
        });
      }
      if (several_ranks && world->rank() != 0) return code;
      return app.exit(e) == 0 ? 0 : 2;  // CLI11 prints one line naming the flag (or the help text)
    }
  } catch (const moex::comm::JobError& e) {
    // Found by the start-up check: every rank knows, so the job ends in order.
    for (const std::string& line : e.report_lines()) std::fprintf(stderr, "moex: error: %s\n", line.c_str());
    return e.exit_code();
  } catch (const moex::Error& e) {
    if (several_ranks && !checked) {
      try {
        check_start_up([&]() -> moex::comm::Description { throw e; });
      } catch (const moex::comm::JobError& agreed) {
        for (const std::string& line : agreed.report_lines()) std::fprintf(stderr, "moex: error: %s\n", line.c_str());
        return agreed.exit_code();
      }
    }
    if (moex::comm::in_multi_rank_job()) moex::comm::abort_job(e.exit_code(), e.what(), "moex: error: ");
    std::fprintf(stderr, "moex: error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    if (moex::comm::in_multi_rank_job()) moex::comm::abort_job(1, e.what(), "moex: internal error: ");
    std::fprintf(stderr, "moex: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
