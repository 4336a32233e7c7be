#include "moex/base/error.h"

namespace moex {

void throw_error(ErrorKind kind, const std::string& message) { throw Error(kind, message); }

}  // namespace moex
