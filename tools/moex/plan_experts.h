// Files of the static EPLB mode: `moex profile --record-load FILE` writes the measured load, `moex plan-experts`
// reads it and writes a placement that a run loads with --eplb --expert-placement FILE.
#pragma once
#include <string>

namespace moex::tools {

// Writes `text` to `out` through a staging file (a run cut short leaves the old file whole); an existing `out` is
// refused unless `force` (one error line naming the flag).
void write_new_text_file(const std::string& flag, const std::string& out, bool force, const std::string& text);

}  // namespace moex::tools
