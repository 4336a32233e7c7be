// Whole-file reads of the small files a run names (config.json, model.safetensors.index.json, the comm tuning
// table, tokenizer.model), and the open that MappedFile shares. Only regular files are read: a FIFO would
// block the open or the read forever and a device such as /dev/zero never ends, so the type is checked with
// stat() before the file is opened, the open does not block (O_NONBLOCK), and fstat() checks it again.
#pragma once
#include <cstddef>
#include <string>

namespace moex {

// JSON files MoEX reads are kilobytes (Mixtral-8x22B's shard index is ~100 KB); anything past this limit is
// not one of them.
inline constexpr size_t kMaxJsonFileBytes = size_t{16} << 20;
// A SentencePiece model is well under a megabyte for Mixtral's 32000 pieces.
inline constexpr size_t kMaxTokenizerFileBytes = size_t{64} << 20;

// The contents of `path`, at most `max_bytes` long. Throws Error(kInvalidInput) with one line naming the path
// when it is missing or unreadable (followed by `missing_hint` when it does not exist), not a regular file
// (naming what it is: a directory, a FIFO, ...), or larger than the limit (stating the limit).
std::string read_small_file(const std::string& path, size_t max_bytes, const std::string& missing_hint = "");

// Opens `path` read-only after checking that it is a regular file, as above; returns the descriptor (the
// caller closes it) and its size. Throws Error(kInvalidInput) naming the path.
int open_regular_file(const std::string& path, size_t* size);

// True when `path` names a regular file (after symlinks); nothing is opened.
bool is_regular_file(const std::string& path);

// "a directory", "a FIFO (named pipe)", ...: what a stat() mode is, for error messages.
std::string file_type_name(unsigned mode);

}  // namespace moex
