// libFuzzer target for the safetensors reader: any byte string is either a valid image or a
// moex::Error, never a crash, leak or out-of-bounds read. `make fuzz` builds and runs it with clang.
#include <cstddef>
#include <cstdint>

#include "moex/base/error.h"
#include "moex/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto tensors = moex::SafetensorsFile::parse(data, size, "fuzz");
    // Touch every accepted tensor's bytes: the reader promised they lie inside the input.
    volatile uint8_t sink = 0;
    for (const auto& [name, view] : tensors) {
      const auto* bytes = static_cast<const uint8_t*>(view.data);
      for (size_t i = 0; i < view.bytes(); ++i) sink = sink ^ bytes[i];
    }
  } catch (const moex::Error&) {
  }
  return 0;
}
