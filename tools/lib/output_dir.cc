#include "tools/lib/output_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "moex/base/error.h"

namespace moex {

StagingDir::StagingDir(const std::filesystem::path& out, const std::string& tag) {
  std::string pattern = out.string() + "." + tag + "-tmp-XXXXXX";
  MOEX_CHECK_INPUT(::mkdtemp(pattern.data()) != nullptr, "--out: cannot create a folder next to ", out.string(), ": ",
                   std::strerror(errno));
  path_ = pattern;
  // mkdtemp makes it private (0700); the model folder gets the old folder's mode, or the umask's.
  struct stat old {};
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::chmod(pattern.c_str(), ::stat(out.c_str(), &old) == 0 ? (old.st_mode & 07777) : (0777 & ~mask));
}

StagingDir::~StagingDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

void StagingDir::publish(const std::filesystem::path& out) {
  const int dir_fd = ::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {  // the entries must reach the disk before the rename that publishes them
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  if (::rename(path_.c_str(), out.c_str()) == 0) {  // --out missing or an empty folder
    path_.clear();
    return;
  }
  MOEX_CHECK_INPUT(errno == ENOTEMPTY || errno == EEXIST, "cannot rename ", path_.string(), " to ", out.string(), ": ",
                   std::strerror(errno));
  if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) != 0) {
    // A file system without an atomic exchange: move the old folder aside first (a moment without --out).
    const std::string aside = path_.string() + ".old";
    MOEX_CHECK_INPUT(::rename(out.c_str(), aside.c_str()) == 0, "cannot move ", out.string(), " aside: ",
                     std::strerror(errno));
    MOEX_CHECK_INPUT(::rename(path_.c_str(), out.c_str()) == 0, "cannot rename ", path_.string(), " to ", out.string(),
                     ": ", std::strerror(errno), " (the old model is in ", aside, ")");
    path_ = aside;
  }
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);  // the old model, now under the staging name
  path_.clear();
}

std::filesystem::path prepare_output_dir(const std::string& flag_value, bool force) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path out = fs::absolute(flag_value, ec).lexically_normal();
  MOEX_CHECK_INPUT(!ec, "--out '", flag_value, "': ", ec.message());
  if (!out.has_filename()) out = out.parent_path();  // "dir/"
  MOEX_CHECK_INPUT(out.has_parent_path() && out != out.root_path(), "--out: '", flag_value, "' cannot be a model folder");
  fs::create_directories(out.parent_path(), ec);
  MOEX_CHECK_INPUT(!ec && fs::is_directory(out.parent_path()), "--out: cannot create directory ",
                   out.parent_path().string(), ": ", ec ? ec.message() : "a file of that name exists");
  if (fs::is_symlink(out) && fs::is_directory(out)) out = fs::canonical(out);  // swap the folder, keep the link
  if (fs::exists(out)) {
    MOEX_CHECK_INPUT(fs::is_directory(out), "--out: ", flag_value, " exists and is not a directory");
    MOEX_CHECK_INPUT(::access(out.c_str(), W_OK) == 0, "--out: directory ", flag_value, " is not writable");
    MOEX_CHECK_INPUT(force || fs::is_empty(out), "--out: ", flag_value, " is not empty (it holds ",
                     fs::is_empty(out) ? std::string() : fs::directory_iterator(out)->path().filename().string(),
                     "...): pass --force to replace the model in it (its other files are kept), or choose an empty or "
                     "new folder");
  }
  return out;
}

}  // namespace moex
