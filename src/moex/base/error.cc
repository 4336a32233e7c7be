#include "moex/base/error.h"

namespace moex {

void throw_error(ErrorKind kind, const std::string& message) { throw Error(kind, message); }

void throw_input_error(const std::string& origin, const std::string& problem) {
  throw Error(ErrorKind::kInvalidInput, origin + ": " + problem);
}

}  // namespace moex
