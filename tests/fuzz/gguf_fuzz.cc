// libFuzzer target for the GGUF reader: any byte string is either a valid image or a moex::Error, never a
// crash, leak, out-of-bounds read or an allocation sized by a header count. Accepted images go on through
// the metadata -> config mapping and the vocabulary -> SentencePiece proto builder, and every tensor is
// dequantized. `make fuzz` builds and runs it with clang.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "moex/base/error.h"
#include "moex/model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moex::GgufContents g = moex::parse_gguf(data, size, "fuzz");
    std::vector<float> row;
    for (const moex::GgufTensorInfo& t : g.tensors) {  // the reader promised the bytes lie inside the input
      if (t.numel() > (1 << 16)) continue;
      row.resize(static_cast<size_t>(t.numel()));
      moex::gguf_dequantize(t.type, t.data, t.numel(), row.data());
    }
    try {
      moex::gguf_model_config(g, "fuzz");
    } catch (const moex::Error&) {
    }
    moex::gguf_sentencepiece_proto(g, "fuzz");
  } catch (const moex::Error&) {
  }
  return 0;
}
