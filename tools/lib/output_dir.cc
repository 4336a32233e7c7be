#include "tools/lib/output_dir.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "moex/base/error.h"

namespace moex {
namespace fs = std::filesystem;
namespace {

constexpr char kMarker[] = ".moex-unfinished";

// What a staging folder's marker holds: the run that made it, so that a later run can tell it is over.
std::string marker_text(long pid) {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return "an unfinished output of moex (pid " + std::to_string(pid) + " on " + host +
         "); a later run writing the same output removes it once that process is gone\n";
}

bool process_alive(long pid) { return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

// A staging folder's contents first, its marker last: a removal cut short leaves the marker, so the next run
// can still prove that the rest is a dead run's.
void remove_staging(const fs::path& folder) {
  std::error_code ec;
  std::vector<fs::path> entries;
  for (const auto& entry : fs::directory_iterator(folder, ec)) entries.push_back(entry.path());
  for (const fs::path& entry : entries)
    if (entry.filename() != kMarker) fs::remove_all(entry, ec);
  fs::remove(folder / kMarker, ec);
  fs::remove(folder, ec);
}

// The staging folders that exist now: what a signal removes. Every change to a staging folder holds the
// mutex, and the watcher takes it for good, so no folder is published or half-removed under it. Never
// destroyed: a signal may come while static destructors run.
struct Staged {
  std::mutex mutex;
  std::vector<fs::path> folders;
};

Staged& staged() {
  static Staged* const folders = new Staged;
  return *folders;
}

int wake_fd = -1;  // the write end of the watcher's pipe
volatile std::sig_atomic_t signalled = 0;

// Only async-signal-safe calls: the watcher thread does the work.
void on_signal(int sig) {
  if (signalled) {  // a second signal while the first is handled: the default action, now
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  signalled = 1;
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t written = ::write(wake_fd, &byte, 1);
  errno = saved_errno;
}

const char* signal_name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP"; }

[[noreturn]] void remove_staged_on_signal(int read_fd) {
  unsigned char sig = 0;
  while (::read(read_fd, &sig, 1) != 1) {
  }
  Staged& s = staged();
  s.mutex.lock();  // held until the process ends
  std::string removed;
  std::error_code ec;
  for (const fs::path& folder : s.folders) {
    if (!fs::exists(folder, ec)) continue;  // inside one removed before it (quantize's panels.moex)
    // The command's threads may still create files in it until the process ends.
    for (int pass = 0; pass < 100 && fs::exists(folder, ec); ++pass) remove_staging(folder);
    removed += (removed.empty() ? "; removed the unfinished " : ", ") + folder.string();
  }
  std::fprintf(stderr, "moex: interrupted by %s%s\n", signal_name(sig), removed.c_str());
  std::fflush(stderr);
  // Ended by the signal itself, as if it had not been caught: the shell sees 128 + signal, and a script
  // that ran moex stops too.
  ::signal(sig, SIG_DFL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  std::_Exit(128 + sig);
}

// Installed by the first staging folder, for the rest of the process. A signal that is ignored (nohup, a
// background job) or already handled by the command is left as it is.
void watch_signals() {
  static std::once_flag once;
  std::call_once(once, [] {
    int fds[2];
    MOEX_CHECK(::pipe2(fds, O_CLOEXEC) == 0, std::strerror(errno));
    wake_fd = fds[1];
    std::thread(remove_staged_on_signal, fds[0]).detach();
    for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) != 0 || (old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) continue;
      struct sigaction action {};
      action.sa_handler = on_signal;
      sigemptyset(&action.sa_mask);
      action.sa_flags = SA_RESTART;
      ::sigaction(sig, &action, nullptr);
    }
  });
}

// The part of a name after "<out>." that a staging folder has: "<tag>-tmp-<pid>-XXXXXX" (the pid is 0 in
// the form without it that earlier versions wrote, "<tag>-tmp-XXXXXX").
bool is_staging_name(const std::string& rest, long* pid) {
  const size_t tmp = rest.find("-tmp-");
  if (tmp == 0 || tmp == std::string::npos) return false;
  if (!std::all_of(rest.begin(), rest.begin() + tmp, [](char c) { return (c >= 'a' && c <= 'z') || c == '-'; }))
    return false;
  std::string tail = rest.substr(tmp + 5);
  *pid = 0;
  const size_t dash = tail.find('-');
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  if (dash != std::string::npos) {
    if (dash == 0 || dash > 9 || !std::all_of(tail.begin(), tail.begin() + dash, digit)) return false;
    *pid = std::stol(tail.substr(0, dash));
    tail = tail.substr(dash + 1);
  }
  return tail.size() == 6 &&
         std::all_of(tail.begin(), tail.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)); });
}

enum class Owner { kDead, kRunning, kUnknown };

// Whether the run that made a staging folder is over, as its marker proves: it names that run and this host,
// and nobody holds its lock. On kDead, `*marker` is the marker, opened and locked.
Owner staging_owner(const fs::path& folder, long pid, int* marker) {
  if (pid > 0 && process_alive(pid)) return Owner::kRunning;
  *marker = ::open((folder / kMarker).c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (*marker < 0) return Owner::kUnknown;
  if (::flock(*marker, LOCK_EX | LOCK_NB) != 0) {  // a run in another pid namespace
    ::close(*marker);
    return Owner::kRunning;
  }
  struct stat st {};
  std::string text(4096, '\0');
  const ssize_t n = ::fstat(*marker, &st) == 0 && S_ISREG(st.st_mode) ? ::read(*marker, text.data(), text.size()) : -1;
  if (pid > 0 && n >= 0 && text.substr(0, static_cast<size_t>(n)) == marker_text(pid)) return Owner::kDead;
  ::close(*marker);
  return Owner::kUnknown;
}

// Staging folders that killed runs left beside `out`: a dead run's is removed, one whose run cannot be
// proven over is named, a running one's is left alone.
void remove_stale_beside(const fs::path& out) {
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  const std::string prefix = out.filename().string() + ".";
  std::error_code ec;
  std::vector<std::pair<fs::path, long>> found;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename().string();
    long pid = 0;
    if (name.rfind(prefix, 0) == 0 && is_staging_name(name.substr(prefix.size()), &pid) && !entry.is_symlink(ec) &&
        entry.is_directory(ec))
      found.emplace_back(entry.path(), pid);
  }
  for (const auto& [folder, pid] : found) {
    int marker = -1;
    if (pid == ::getpid()) continue;
    switch (staging_owner(folder, pid, &marker)) {
      case Owner::kRunning: break;
      case Owner::kDead:
        remove_staging(folder);
        ::close(marker);
        std::fprintf(stderr, "moex: removed %s, the unfinished output of a run that was killed (pid %ld)\n",
                     folder.c_str(), pid);
        break;
      case Owner::kUnknown:
        std::fprintf(stderr,
                     "moex: note: %s looks like the unfinished output of an earlier run, but nothing proves it: "
                     "left as it is (remove it if nothing is writing it)\n",
                     folder.c_str());
        break;
    }
  }
}

// Creates the marker of `folder` and locks it until `*fd` is closed; false when it cannot.
bool make_marker(const fs::path& folder, int* fd) {
  *fd = ::open((folder / kMarker).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (*fd < 0) return false;
  const std::string text = marker_text(::getpid());
  if (::flock(*fd, LOCK_EX) == 0 && ::write(*fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()))
    return true;
  ::close(*fd);
  *fd = -1;
  return false;
}

}  // namespace

StagingDir::StagingDir(const fs::path& out, const std::string& tag, Output output) {
  watch_signals();
  std::lock_guard<std::mutex> lock(staged().mutex);
  remove_stale_beside(out);
  std::string pattern = out.string() + "." + tag + "-tmp-" + std::to_string(::getpid()) + "-XXXXXX";
  MOEX_CHECK_INPUT(::mkdtemp(pattern.data()) != nullptr, "cannot create a folder next to ", out.string(), ": ",
                   std::strerror(errno));
  if (!make_marker(pattern, &marker_fd_)) {
    const int error = errno;
    ::rmdir(pattern.c_str());
    throw_error(ErrorKind::kInvalidInput, "cannot write in " + pattern + ": " + std::strerror(error));
  }
  path_ = pattern;
  staged().folders.push_back(path_);
  if (output == Output::kFile) return;
  // mkdtemp makes it private (0700); the model folder gets the old folder's mode, or the umask's.
  struct stat old {};
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::chmod(pattern.c_str(), ::stat(out.c_str(), &old) == 0 ? (old.st_mode & 07777) : (0777 & ~mask));
}

StagingDir::~StagingDir() {
  if (path_.empty()) return;
  std::lock_guard<std::mutex> lock(staged().mutex);
  remove_locked();
}

// With the mutex held.
void StagingDir::remove_locked() {
  remove_staging(path_);
  if (marker_fd_ >= 0) ::close(marker_fd_);
  marker_fd_ = -1;
  auto& folders = staged().folders;
  folders.erase(std::remove(folders.begin(), folders.end(), path_), folders.end());
  path_.clear();
}

void StagingDir::publish(const fs::path& out) {
  std::lock_guard<std::mutex> lock(staged().mutex);
  ::unlink((path_ / kMarker).c_str());  // the marker is the staging folder's, not the model's
  ::close(marker_fd_);
  marker_fd_ = -1;
  const int dir_fd = ::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {  // the entries must reach the disk before the rename that publishes them
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  auto& folders = staged().folders;
  if (::rename(path_.c_str(), out.c_str()) == 0) {  // --out missing or an empty folder
    folders.erase(std::remove(folders.begin(), folders.end(), path_), folders.end());
    path_.clear();
    return;
  }
  MOEX_CHECK_INPUT(errno == ENOTEMPTY || errno == EEXIST, "cannot rename ", path_.string(), " to ", out.string(), ": ",
                   std::strerror(errno));
  if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) != 0) {
    // A file system without an atomic exchange: the old folder goes over an empty staging-named folder first
    // (a moment without --out).
    std::string aside = out.string() + ".old-tmp-" + std::to_string(::getpid()) + "-XXXXXX";
    const bool moved = ::mkdtemp(aside.data()) != nullptr && ::rename(out.c_str(), aside.c_str()) == 0;
    const int error = errno;
    if (!moved) ::rmdir(aside.c_str());
    MOEX_CHECK_INPUT(moved, "cannot move ", out.string(), " aside: ", std::strerror(error));
    MOEX_CHECK_INPUT(::rename(path_.c_str(), out.c_str()) == 0, "cannot rename ", path_.string(), " to ", out.string(),
                     ": ", std::strerror(errno), " (the old model is in ", aside, ")");
    std::replace(folders.begin(), folders.end(), path_, fs::path(aside));
    path_ = aside;
  }
  // path_ holds the old output now: marked, so that a run killed while removing it leaves a provable folder.
  make_marker(path_, &marker_fd_);
  remove_locked();
}

void StagingDir::publish_file(const std::string& name, const fs::path& out) {
  std::lock_guard<std::mutex> lock(staged().mutex);
  const fs::path file = path_ / name;
  MOEX_CHECK_INPUT(::rename(file.c_str(), out.c_str()) == 0, "cannot rename ", file.string(), " to ", out.string(),
                   ": ", std::strerror(errno));
  remove_locked();
}

namespace {
fs::path link_target(const fs::path& out) {
  std::error_code ec;
  return fs::is_symlink(out, ec) && fs::is_regular_file(out, ec) ? fs::canonical(out, ec) : out;
}
}  // namespace

StagingFile::StagingFile(const fs::path& out, const std::string& tag)
    : out_(link_target(out)),
      dir_(out_, tag, StagingDir::Output::kFile),
      path_((dir_.path() / out_.filename()).string()) {}

void StagingFile::publish() {
  struct stat old {};
  if (::stat(out_.c_str(), &old) == 0 && S_ISREG(old.st_mode)) ::chmod(path_.c_str(), old.st_mode & 07777);
  dir_.publish_file(out_.filename().string(), out_);
}

fs::path prepare_output_dir(const std::string& flag_value, bool force) {
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
