// Writing an output safely, a model folder (gen-model, quantize) or one file (convert, pack, logits, tune-comm):
// the output is written into a fresh folder beside it and moved in when complete, so an interrupted run
// leaves the old output as it was, and files of the old output are replaced by new inodes, never truncated: a
// process that has them mapped keeps reading them.
//
// Nothing unfinished is left behind. A staging folder is removed on every error; on SIGINT, SIGTERM or SIGHUP
// (a thread woken by the signal removes it, prints one line and lets the signal end the process, so the
// exit status is the conventional 128 + signal; a second signal ends it at once); and, when its run was
// killed outright (SIGKILL, a crash, a power cut), by the next run that writes the same output. That run
// removes only what it can prove is a dead run's staging folder: its name carries the pid of the run that
// made it, it holds a marker naming that pid and this host, and the marker is not locked (each run holds an
// exclusive lock on its own marker until the folder is gone, and the kernel drops the lock when the process
// dies), and the pid is not alive. A folder of that name that fails the proof is named on stderr, never
// removed.
#pragma once
#include <filesystem>
#include <string>

namespace moex {

class StagingDir {
 public:
  enum class Output { kFolder, kFile };
  // A folder "<out>.<tag>-tmp-<pid>-XXXXXX" beside `out`, after removing (or naming) what killed runs left
  // beside `out`. For a folder output it gets the old folder's mode (or the umask's); for a file output it
  // stays private (0700).
  StagingDir(const std::filesystem::path& out, const std::string& tag, Output output = Output::kFolder);
  ~StagingDir();  // removes the folder unless published
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

  // Moves the staged folder to `out`; what `out` held before is removed (after the swap, so a reader that
  // opened it keeps its files).
  void publish(const std::filesystem::path& out);
  // Moves the file `name` of the staged folder to `out` (over what was there), then removes the folder.
  void publish_file(const std::string& name, const std::filesystem::path& out);

 private:
  void lock_marker();
  void remove_locked();

  std::filesystem::path path_;
  int marker_fd_ = -1;
};

// One output file written through a StagingDir: write it at path(), then publish() renames it over `out`,
// with the old file's mode when there was one. A symlink to a regular file is kept: its target is replaced.
class StagingFile {
 public:
  StagingFile(const std::filesystem::path& out, const std::string& tag);
  const std::string& path() const { return path_; }
  void publish();

 private:
  std::filesystem::path out_;
  StagingDir dir_;
  std::string path_;
};

// The checks before writing a model folder `flag_value` (the --out flag): not empty, its parent is created,
// it must be a writable directory or missing, and when it holds files, `force` is needed. Returns the
// absolute path to publish to (a symlink to a folder resolved, so the link is kept).
std::filesystem::path prepare_output_dir(const std::string& flag_value, bool force);

}  // namespace moex
