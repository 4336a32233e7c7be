// The `moex` command: one file per subcommand, each registering itself here so that adding a
// subcommand never touches main.cc.
#pragma once
#include <CLI/CLI.hpp>

#include "moex/base/error.h"

namespace moex::tools {

// Adds one subcommand (with its options and callback) to the top-level app.
using CommandSetup = void (*)(CLI::App& app);
bool register_command(CommandSetup setup);

}  // namespace moex::tools

#define MOEX_REGISTER_COMMAND(setup) \
  [[maybe_unused]] static const bool moex_command_registered_##setup = ::moex::tools::register_command(setup)
