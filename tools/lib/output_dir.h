// Writing a model folder safely (gen-model, quantize): the new model goes into a fresh folder next to the
// output and is swapped in when complete, so an interrupted run leaves the old folder as it was, and files of
// the old model are replaced by new inodes, never truncated: a process that has them mapped keeps reading them.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

namespace moex {

class StagingDir {
 public:
  // A private folder "<out>.<tag>-tmp-XXXXXX" beside `out`, with the old folder's mode (or the umask's).
  explicit StagingDir(const std::filesystem::path& out, const std::string& tag = "gen-model");
  ~StagingDir();  // removes the folder unless published
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

  // Moves the staged model to `out`; what `out` held before is removed (after the swap, so a reader that
  // opened it keeps its files).
  void publish(const std::filesystem::path& out);

 private:
  std::filesystem::path path_;
};

// The checks before writing a model folder `flag_value` (the --out flag): its parent is created, it must be
// a writable directory or missing, and when it holds files, `force` is needed. Returns the absolute path to
// publish to (a symlink to a folder resolved, so the link is kept).
std::filesystem::path prepare_output_dir(const std::string& flag_value, bool force);

}  // namespace moex
