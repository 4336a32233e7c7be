// Memory roofline probe: how fast this machine streams bytes from DRAM into registers, with the same
// threads and loads the matmul uses. Decode throughput is judged against it.
#pragma once
#include <cstddef>

namespace moex::kernels {

// Reads every byte of data[0, bytes) once (all threads) and returns a checksum so the reads stay.
float stream_read(const void* data, size_t bytes);

namespace x86 {
float stream_read_avx512(const void* data, size_t bytes);
}  // namespace x86

}  // namespace moex::kernels
