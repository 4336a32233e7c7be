#include "moex/base/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "moex/base/error.h"

namespace moex {
namespace {

std::string mebibytes(size_t bytes) {
  return bytes % (size_t{1} << 20) == 0 ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes) + " bytes";
}

void check_regular(const std::string& path, const struct stat& st) {
  MOEX_CHECK_INPUT(S_ISREG(st.st_mode), path, " is ", file_type_name(st.st_mode), ", not a regular file");
}

}  // namespace

std::string file_type_name(unsigned mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a file";
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

int open_regular_file(const std::string& path, size_t* size) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    throw_error(ErrorKind::kInvalidInput, "cannot read " + path + ": " + std::strerror(err));
  }
  check_regular(path, st);  // before open(): opening a FIFO for reading waits for a writer
  // O_NONBLOCK: should the path be swapped for a FIFO between stat() and open(), the open still returns.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    throw_error(ErrorKind::kInvalidInput, "cannot read " + path + ": " + std::strerror(err));
  }
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    check_regular(path, st);
    throw_error(ErrorKind::kInvalidInput, "cannot read " + path + ": fstat failed");
  }
  *size = static_cast<size_t>(st.st_size);
  return fd;
}

std::string read_small_file(const std::string& path, size_t max_bytes, const std::string& missing_hint) {
  struct stat st {};
  if (!missing_hint.empty() && ::stat(path.c_str(), &st) != 0 && errno == ENOENT)
    throw_error(ErrorKind::kInvalidInput, "cannot read " + path + ": " + std::strerror(ENOENT) + " " + missing_hint);
  size_t size = 0;
  const int fd = open_regular_file(path, &size);
  const auto too_large = [&](const std::string& known_size) {
    ::close(fd);
    throw_error(ErrorKind::kInvalidInput, path + " is larger than the " + mebibytes(max_bytes) +
                                              " limit for this file" + known_size);
  };
  if (size > max_bytes) too_large(" (" + std::to_string(size) + " bytes)");
  // Read to the end rather than trusting st_size (files in /proc report 0), but never past the limit:
  // one byte more than the limit proves the file is too large, however long it keeps growing.
  std::string text(std::min(max_bytes + 1, size + 4096), '\0');
  size_t used = 0;
  while (true) {
    if (used == text.size()) {
      if (used > max_bytes) too_large("");
      text.resize(std::min(max_bytes + 1, text.size() * 2));
    }
    const ssize_t got = ::read(fd, text.data() + used, text.size() - used);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      throw_error(ErrorKind::kInvalidInput, "cannot read " + path + ": " + std::strerror(err));
    }
    if (got == 0) break;
    used += static_cast<size_t>(got);
  }
  ::close(fd);
  if (used > max_bytes) too_large("");
  text.resize(used);
  return text;
}

}  // namespace moex
