#include "moex/runtime/npy.h"

#include <cstdio>
#include <memory>

#include "moex/base/error.h"

namespace moex {

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::string dims;
  int64_t count = 1;
  for (int64_t d : shape) {
    dims += std::to_string(d) + ",";
    count *= d;
  }
  if (shape.size() > 1) dims.pop_back();  // "(3,)" for 1-D, "(3,4)" otherwise
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + length (2) + header + '\n' is padded to a multiple of 64.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "wb"), &std::fclose);
  MOEX_CHECK_INPUT(file != nullptr, "cannot write ", path);
  const unsigned char preamble[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                                      static_cast<unsigned char>(header.size() & 0xff),
                                      static_cast<unsigned char>(header.size() >> 8)};
  bool ok = std::fwrite(preamble, 1, 10, file.get()) == 10 &&
            std::fwrite(header.data(), 1, header.size(), file.get()) == header.size() &&
            std::fwrite(data, sizeof(float), count, file.get()) == static_cast<size_t>(count);
  // A full disk may only show when the buffer is flushed: fclose's result counts too.
  ok = ok && std::fflush(file.get()) == 0;
  ok = std::fclose(file.release()) == 0 && ok;
  MOEX_CHECK_INPUT(ok, "short write to ", path, " (disk full?)");
}

}  // namespace moex
