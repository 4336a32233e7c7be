#include "moex/model/gguf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "moex/base/error.h"
#include "moex/base/small_file.h"

namespace moex {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint64_t kMaxKeyBytes = 65535;  // the spec's bound on a key
constexpr uint64_t kMaxNameBytes = 64;    // ggml's GGML_MAX_NAME, which llama.cpp enforces on tensor names
constexpr uint32_t kMaxDims = 4;          // GGML_MAX_DIMS

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: return 1;
    case GgufType::kU16: case GgufType::kI16: return 2;
    case GgufType::kU32: case GgufType::kI32: case GgufType::kF32: return 4;
    case GgufType::kU64: case GgufType::kI64: case GgufType::kF64: return 8;
    default: return 0;  // string, array: variable
  }
}

const char* type_name(GgufType t) {
  static const char* const names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array",
                                      "u64", "i64", "f64"};
  const auto k = static_cast<uint32_t>(t);
  return k < 13 ? names[k] : "unknown";
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Reads through bounds checks: every read names what it was reading when the file ends.
class Cursor {
 public:
  Cursor(const uint8_t* bytes, size_t size, const std::string& origin) : b_(bytes), size_(size), origin_(origin) {}
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }
  const uint8_t* take(uint64_t n, const std::string& what) {
    if (n > left())
      throw_input_error(origin_, what + " needs " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) + " but the file has " +
                        std::to_string(left()) + " left: truncated or not a GGUF file");
    const uint8_t* p = b_ + pos_;
    pos_ += n;
    return p;
  }
  uint32_t u32(const std::string& what) { return load<uint32_t>(take(4, what)); }
  uint64_t u64(const std::string& what) { return load<uint64_t>(take(8, what)); }
  std::string_view string(const std::string& what, uint64_t max_bytes) {
    const uint64_t n = u64(what + " length");
    if (n > max_bytes) throw_input_error(origin_, what + " is " + std::to_string(n) + " bytes long (at most " + std::to_string(max_bytes) + ")");
    const uint8_t* p = take(n, what);
    return {reinterpret_cast<const char*>(p), static_cast<size_t>(n)};
  }
  const std::string& origin() const { return origin_; }

 private:
  const uint8_t* b_;
  uint64_t size_, pos_ = 0;
  const std::string& origin_;
};

GgufType value_type(Cursor& c, const std::string& where) {
  const uint32_t t = c.u32(where + " type");
  if (t > static_cast<uint32_t>(GgufType::kF64)) throw_input_error(c.origin(), where + " has unknown value type " + std::to_string(t));
  return static_cast<GgufType>(t);
}

void read_scalar(Cursor& c, GgufType t, const std::string& where, GgufValue* v) {
  const uint8_t* p = c.take(scalar_size(t), where);
  switch (t) {
    case GgufType::kU8: v->u = p[0]; break;
    case GgufType::kI8: v->i = static_cast<int8_t>(p[0]); break;
    case GgufType::kU16: v->u = load<uint16_t>(p); break;
    case GgufType::kI16: v->i = load<int16_t>(p); break;
    case GgufType::kU32: v->u = load<uint32_t>(p); break;
    case GgufType::kI32: v->i = load<int32_t>(p); break;
    case GgufType::kU64: v->u = load<uint64_t>(p); break;
    case GgufType::kI64: v->i = load<int64_t>(p); break;
    case GgufType::kF32: v->f = load<float>(p); break;
    case GgufType::kF64: v->f = load<double>(p); break;
    case GgufType::kBool:
      if (p[0] > 1) throw_input_error(c.origin(), where + " is a bool holding " + std::to_string(p[0]) + " (must be 0 or 1)");
      v->u = p[0];
      break;
    default: MOEX_CHECK(false, "not a scalar type");
  }
}

GgufValue read_value(Cursor& c, GgufType t, const std::string& where) {
  GgufValue v;
  v.type = t;
  if (t == GgufType::kString) {
    v.s = std::string(c.string(where, c.left()));
  } else if (t == GgufType::kArray) {
    v.element = value_type(c, where + " element");
    if (v.element == GgufType::kArray) throw_input_error(c.origin(), where + " is an array of arrays, which MoEX does not read");
    v.count = c.u64(where + " count");
    // Each element takes at least its size (a string at least its 8-byte length): the count is checked
    // against the bytes left before anything is read or reserved.
    const uint64_t least = v.element == GgufType::kString ? 8 : scalar_size(v.element);
    if (v.count > c.left() / least)
      throw_input_error(c.origin(), where + " claims " + std::to_string(v.count) + " elements of " + type_name(v.element) +
                           " but the file has " + std::to_string(c.left()) + " bytes left: truncated or corrupt");
    if (v.element == GgufType::kString) {
      v.strings.reserve(v.count);
      for (uint64_t k = 0; k < v.count; ++k) v.strings.push_back(c.string(where + " element " + std::to_string(k), c.left()));
    } else {
      v.raw = c.take(v.count * least, where);
      if (v.element == GgufType::kBool) {
        for (uint64_t k = 0; k < v.count; ++k)
          if (v.raw[k] > 1) throw_input_error(c.origin(), where + " element " + std::to_string(k) + " is a bool holding " + std::to_string(v.raw[k]));
      }
    }
  } else {
    read_scalar(c, t, where, &v);
  }
  return v;
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

std::string ggml_type_name(uint32_t type) {
  switch (type) {
    case 0: return "F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 8: return "Q8_0";
    case 9: return "Q8_1";
    case 10: return "Q2_K";
    case 11: return "Q3_K";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    case 15: return "Q8_K";
    case 30: return "BF16";
    default: return "type " + std::to_string(type);
  }
}

bool ggml_block_size(uint32_t type, int64_t* block, int64_t* bytes) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: *block = 1, *bytes = 4; return true;
    case GgmlType::kF16: case GgmlType::kBF16: *block = 1, *bytes = 2; return true;
    case GgmlType::kQ8_0: *block = kQ8_0Block, *bytes = kQ8_0Bytes; return true;
    case GgmlType::kQ4_0: *block = kQ4_0Block, *bytes = kQ4_0Bytes; return true;
    case GgmlType::kQ4_K: *block = kQ4_KBlock, *bytes = kQ4_KBytes; return true;
  }
  return false;
}

bool GgufValue::integer(int64_t* out) const {
  switch (type) {
    case GgufType::kU8: case GgufType::kU16: case GgufType::kU32: case GgufType::kU64:
      if (u > static_cast<uint64_t>(INT64_MAX)) return false;
      *out = static_cast<int64_t>(u);
      return true;
    case GgufType::kI8: case GgufType::kI16: case GgufType::kI32: case GgufType::kI64: *out = i; return true;
    default: return false;
  }
}

double GgufValue::number_at(uint64_t k) const {
  MOEX_CHECK(type == GgufType::kArray && k < count && raw, "not a numeric array element");
  const uint8_t* p = raw + k * scalar_size(element);
  switch (element) {
    case GgufType::kF32: return load<float>(p);
    case GgufType::kF64: return load<double>(p);
    default: return static_cast<double>(integer_at(k));
  }
}

int64_t GgufValue::integer_at(uint64_t k) const {
  MOEX_CHECK(type == GgufType::kArray && k < count && raw, "not a numeric array element");
  const uint8_t* p = raw + k * scalar_size(element);
  switch (element) {
    case GgufType::kU8: case GgufType::kBool: return p[0];
    case GgufType::kI8: return static_cast<int8_t>(p[0]);
    case GgufType::kU16: return load<uint16_t>(p);
    case GgufType::kI16: return load<int16_t>(p);
    case GgufType::kU32: return load<uint32_t>(p);
    case GgufType::kI32: return load<int32_t>(p);
    case GgufType::kU64: return static_cast<int64_t>(load<uint64_t>(p));
    case GgufType::kI64: return load<int64_t>(p);
    default: return static_cast<int64_t>(number_at(k));
  }
}

std::string GgufValue::str() const {
  switch (type) {
    case GgufType::kString: return "\"" + s + "\"";
    case GgufType::kArray: return "array of " + std::to_string(count) + " " + type_name(element);
    case GgufType::kF32: case GgufType::kF64: return std::to_string(f);
    case GgufType::kI8: case GgufType::kI16: case GgufType::kI32: case GgufType::kI64: return std::to_string(i);
    case GgufType::kBool: return u ? "true" : "false";
    default: return std::to_string(u);
  }
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (uint64_t d : ne) n *= static_cast<int64_t>(d);
  return n;
}

const GgufValue* GgufContents::find(const std::string& key) const {
  auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufContents::tensor(const std::string& name) const {
  for (const GgufTensorInfo& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

GgufContents parse_gguf(const uint8_t* bytes, size_t size, const std::string& origin) {
  Cursor c(bytes, size, origin);
  GgufContents g;
  if (size < 4 || load<uint32_t>(bytes) != kMagic) throw_input_error(origin, "does not start with \"GGUF\": not a GGUF file");
  c.take(4, "magic");
  g.version = c.u32("version");
  if (g.version != 3)
    throw_input_error(origin, "is GGUF version " + std::to_string(g.version) + "; MoEX reads version 3 (re-convert with a current llama.cpp)");
  const uint64_t n_tensors = c.u64("tensor count"), n_kv = c.u64("metadata count");
  // A metadata entry takes at least 8 + 4 + 1 bytes, a tensor info at least 8 + 4 + 4 + 8.
  if (n_kv > c.left() / 13) throw_input_error(origin, "metadata count " + std::to_string(n_kv) + " cannot fit in the " + std::to_string(c.left()) +
                     " bytes left: truncated or corrupt");
  if (n_tensors > c.left() / 24) throw_input_error(origin, "tensor count " + std::to_string(n_tensors) + " cannot fit in the " + std::to_string(c.left()) +
                     " bytes left: truncated or corrupt");
  for (uint64_t k = 0; k < n_kv; ++k) {
    const std::string key(c.string("metadata key " + std::to_string(k), kMaxKeyBytes));
    if (key.empty()) throw_input_error(origin, "metadata key " + std::to_string(k) + " is empty");
    const std::string where = "metadata \"" + key + "\"";
    const GgufType t = value_type(c, where);
    GgufValue v = read_value(c, t, where);
    if (!g.metadata.emplace(key, std::move(v)).second) throw_input_error(origin, "metadata key \"" + key + "\" appears twice");
  }
  if (const GgufValue* a = g.find("general.alignment")) {
    int64_t align = 0;
    if (a->type != GgufType::kU32 || !a->integer(&align) || align <= 0 || (align & (align - 1)) != 0)
      throw_input_error(origin, "general.alignment must be a u32 power of two, got " + a->str());
    g.alignment = static_cast<uint64_t>(align);
  }
  std::set<std::string> names;
  g.tensors.reserve(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    t.name = std::string(c.string("tensor name " + std::to_string(k), kMaxNameBytes));
    const std::string where = "tensor \"" + t.name + "\"";
    if (t.name.empty()) throw_input_error(origin, "tensor " + std::to_string(k) + " has an empty name");
    if (!names.insert(t.name).second) throw_input_error(origin, where + " appears twice");
    const uint32_t n_dims = c.u32(where + " n_dims");
    if (n_dims == 0 || n_dims > kMaxDims)
      throw_input_error(origin, where + " has " + std::to_string(n_dims) + " dimensions (1 to " + std::to_string(kMaxDims) + ")");
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t n = c.u64(where + " dimension");
      if (n == 0 || n > (uint64_t{1} << 40) || numel > (uint64_t{1} << 50) / n)
        throw_input_error(origin, where + " has an implausible dimension " + std::to_string(n));
      numel *= n;
      t.ne.push_back(n);
    }
    t.type = c.u32(where + " type");
    int64_t block = 0, block_bytes = 0;
    if (!ggml_block_size(t.type, &block, &block_bytes))
      throw_input_error(origin, where + " has type " + ggml_type_name(t.type) +
                       ", which MoEX does not read (it reads F32, F16, BF16, Q8_0, Q4_0 and Q4_K)");
    if (t.ne[0] % static_cast<uint64_t>(block) != 0)
      throw_input_error(origin, where + " has " + std::to_string(t.ne[0]) + " weights per row, not a multiple of " +
                       ggml_type_name(t.type) + "'s block of " + std::to_string(block));
    t.bytes = numel / block * block_bytes;
    t.offset = c.u64(where + " offset");
    if (t.offset % g.alignment != 0)
      throw_input_error(origin, where + " offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                       std::to_string(g.alignment));
    g.tensors.push_back(std::move(t));
  }
  g.data_offset = align_up(c.pos(), g.alignment);
  if (g.data_offset > size && !g.tensors.empty())
    throw_input_error(origin, "the data section (at " + std::to_string(g.data_offset) + ") starts past the end of the file (" +
                     std::to_string(size) + " bytes): truncated");
  const uint64_t data_size = g.data_offset <= size ? size - g.data_offset : 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (GgufTensorInfo& t : g.tensors) {
    if (t.offset > data_size || t.bytes > data_size - t.offset)
      throw_input_error(origin, "tensor \"" + t.name + "\" data [" + std::to_string(t.offset) + ", +" + std::to_string(t.bytes) +
                       ") lies outside the data section (" + std::to_string(data_size) + " bytes): truncated file?");
    t.data = bytes + g.data_offset + t.offset;
    ranges.emplace_back(t.offset, t.offset + t.bytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k)
    if (ranges[k].first < ranges[k - 1].second) throw_input_error(origin, "two tensors' data overlap");
  return g;
}

GgufFile::GgufFile(const std::string& path) : file_(path) {
  contents_ = parse_gguf(file_.data(), file_.size(), path);
}

bool is_gguf_path(const std::string& model) {
  // A file cannot be a model folder: any regular file goes to the GGUF reader, whose error then names it.
  std::error_code ec;
  if (std::filesystem::is_regular_file(model, ec)) return true;
  const std::string ext = ".gguf";
  return model.size() > ext.size() && model.compare(model.size() - ext.size(), ext.size(), ext) == 0 &&
         !std::filesystem::is_directory(model, ec);
}

// ---- Dequantization (ggml's block definitions) ----------------------------------------------------------

namespace {

// Q4_K's eight 6-bit (scale, min) pairs in 12 bytes: pairs 0..3 are the low 6 bits of bytes 0..3 (scales)
// and 4..7 (mins); pairs 4..7 take their low 4 bits from bytes 8..11 (scale low nibble, min high nibble)
// and their top 2 bits from the top 2 bits of bytes 0..3 (scales) and 4..7 (mins).
void q4_k_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace

void gguf_dequantize(uint32_t type, const uint8_t* src, int64_t n, float* out) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: std::memcpy(out, src, n * 4); return;
    case GgmlType::kF16:
      for (int64_t k = 0; k < n; ++k) out[k] = f16_to_f32(load<uint16_t>(src + 2 * k));
      return;
    case GgmlType::kBF16:
      for (int64_t k = 0; k < n; ++k) out[k] = bf16_to_f32(load<uint16_t>(src + 2 * k));
      return;
    case GgmlType::kQ8_0:
      for (int64_t b = 0; b < n / kQ8_0Block; ++b, src += kQ8_0Bytes, out += kQ8_0Block) {
        const float d = f16_to_f32(load<uint16_t>(src));
        for (int j = 0; j < kQ8_0Block; ++j) out[j] = static_cast<int8_t>(src[2 + j]) * d;
      }
      return;
    case GgmlType::kQ4_0:
      for (int64_t b = 0; b < n / kQ4_0Block; ++b, src += kQ4_0Bytes, out += kQ4_0Block) {
        const float d = f16_to_f32(load<uint16_t>(src));
        for (int j = 0; j < kQ4_0Block / 2; ++j) {
          out[j] = ((src[2 + j] & 0xF) - 8) * d;
          out[j + kQ4_0Block / 2] = ((src[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case GgmlType::kQ4_K:
      for (int64_t b = 0; b < n / kQ4_KBlock; ++b, src += kQ4_KBytes) {
        const float d = f16_to_f32(load<uint16_t>(src)), dmin = f16_to_f32(load<uint16_t>(src + 2));
        const uint8_t* scales = src + 4;
        const uint8_t* q = src + 16;
        // Four 64-weight chunks; each byte of a chunk's 32 holds sub-block 2c (low nibble), 2c+1 (high).
        for (int chunk = 0; chunk < 4; ++chunk, q += 32) {
          uint8_t sc, m;
          q4_k_scale_min(2 * chunk, scales, &sc, &m);
          const float d1 = d * sc, m1 = dmin * m;
          q4_k_scale_min(2 * chunk + 1, scales, &sc, &m);
          const float d2 = d * sc, m2 = dmin * m;
          for (int l = 0; l < 32; ++l) *out++ = d1 * (q[l] & 0xF) - m1;
          for (int l = 0; l < 32; ++l) *out++ = d2 * (q[l] >> 4) - m2;
        }
      }
      return;
  }
  MOEX_CHECK(false, "gguf_dequantize: type ", type);
}

}  // namespace moex
