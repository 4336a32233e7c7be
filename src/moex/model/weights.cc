#include "moex/model/weights.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "moex/base/error.h"
#include "moex/base/progress.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"
#include "moex/model/gguf.h"
#include "moex/model/panels_file.h"

namespace moex {
namespace {

TensorView expect(const WeightStore& store, const std::string& name, Shape shape) {
  const TensorView& view = store.get(name);
  MOEX_CHECK_INPUT(view.shape == shape, "tensor \"", name, "\" has shape ", view.shape.str(), " but config.json implies ",
                   shape.str());
  MOEX_CHECK_INPUT(view.dtype == DType::kBF16 || view.dtype == DType::kF32, "tensor \"", name, "\" has dtype ",
                   dtype_name(view.dtype), " (MoEX loads BF16 and F32 weights)");
  return view;
}

// Pages in exactly the bytes a (possibly strided) view covers.
TensorView resident(const TensorView& view) {
  if (view.row_stride == 0 || view.shape.rank != 2) {
    MappedFile::prefault(view.data, view.bytes());
  } else {
    const size_t row_bytes = static_cast<size_t>(view.shape[1]) * dtype_size(view.dtype);
    const size_t stride_bytes = static_cast<size_t>(view.row_stride) * dtype_size(view.dtype);
    for (int64_t r = 0; r < view.shape[0]; ++r)
      MappedFile::prefault(static_cast<const char*>(view.data) + r * stride_bytes, row_bytes);
  }
  return view;
}

// A column slice as a contiguous copy; the mapping's pages it read are dropped from this process again.
TensorView owned_copy(const TensorView& slice, std::vector<std::vector<uint8_t>>& owned) {
  if (slice.row_stride == 0 || slice.row_stride == slice.shape[1]) return resident(slice);
  const size_t elem = dtype_size(slice.dtype), row_bytes = static_cast<size_t>(slice.shape[1]) * elem;
  const size_t stride_bytes = static_cast<size_t>(slice.row_stride) * elem;
  std::vector<uint8_t>& buffer = owned.emplace_back(row_bytes * slice.shape[0]);
  const auto* src = static_cast<const uint8_t*>(slice.data);
  for (int64_t r = 0; r < slice.shape[0]; ++r) std::memcpy(buffer.data() + r * row_bytes, src + r * stride_bytes, row_bytes);
  MappedFile::release(src, stride_bytes * (slice.shape[0] - 1) + row_bytes);
  TensorView copy = slice;
  copy.data = buffer.data();
  copy.row_stride = 0;
  return copy;
}

// Index of the first non-finite element of a contiguous tensor, or -1.
int64_t first_non_finite(const TensorView& view) {
  const int64_t n = view.numel();
  const uint8_t* bytes = static_cast<const uint8_t*>(view.data);
  // A value is NaN or infinite exactly when its exponent bits are all ones.
  auto scan16 = [&](uint16_t exponent_mask) -> int64_t {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t bits;
      std::memcpy(&bits, bytes + 2 * i, 2);
      if ((bits & exponent_mask) == exponent_mask) return i;
    }
    return -1;
  };
  switch (view.dtype) {
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, bytes + 4 * i, 4);
        if ((bits & 0x7f800000u) == 0x7f800000u) return i;
      }
      return -1;
    case DType::kBF16: return scan16(0x7f80);
    case DType::kF16: return scan16(0x7c00);
    case DType::kF8E4M3:  // no infinities; NaN is S.1111.111
      for (int64_t i = 0; i < n; ++i) {
        if ((bytes[i] & 0x7f) == 0x7f) return i;
      }
      return -1;
    default: return -1;  // integers are always finite
  }
}

// Elements [begin, end) of a rank-1 view.
TensorView slice1(const TensorView& v, int64_t begin, int64_t end) {
  TensorView out = v;
  out.data = static_cast<char*>(v.data) + begin * static_cast<int64_t>(dtype_size(v.dtype));
  out.shape = {end - begin};
  return out;
}


// ---- quantized checkpoints: codes and scales copied into a QuantizedMatrix (no arithmetic on the weights) ----

using kernels::QuantizedMatrix;
using kernels::WeightFormat;

const TensorView& expect_tensor(const WeightStore& s, const std::string& name, DType dtype, Shape shape) {
  MOEX_CHECK_INPUT(s.contains(name), "quantized checkpoint: tensor \"", name, "\" is missing");
  const TensorView& v = s.get(name);
  MOEX_CHECK_INPUT(v.dtype == dtype && v.shape == shape, "quantized checkpoint: tensor \"", name, "\" is ",
                   dtype_name(v.dtype), " ", v.shape.str(), ", expected ", dtype_name(dtype), " ", shape.str());
  return v;
}

// A scale tensor of any float dtype, as f32; every value finite and >= 0.
std::vector<float> read_scales(const WeightStore& s, const std::string& name, Shape shape) {
  MOEX_CHECK_INPUT(s.contains(name), "quantized checkpoint: tensor \"", name, "\" is missing");
  const TensorView& v = s.get(name);
  // [rows] is the same numbers as [rows, 1] (per-channel scales are written either way).
  const bool same = v.shape == shape || (shape.rank == 2 && shape[1] == 1 && v.shape == Shape{shape[0]});
  MOEX_CHECK_INPUT(same && (v.dtype == DType::kF32 || v.dtype == DType::kBF16 || v.dtype == DType::kF16),
                   "quantized checkpoint: tensor \"", name, "\" is ", dtype_name(v.dtype), " ", v.shape.str(),
                   ", expected F32, BF16 or F16 ", shape.str());
  std::vector<float> out(static_cast<size_t>(v.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    const float f = v.dtype == DType::kF32    ? v.as<const float>()[i]
                    : v.dtype == DType::kBF16 ? bf16_to_f32(v.as<const uint16_t>()[i])
                                              : f16_to_f32(v.as<const uint16_t>()[i]);
    MOEX_CHECK_INPUT(std::isfinite(f) && f >= 0, "quantized checkpoint: tensor \"", name, "\" holds the scale ", f,
                     " at element ", i, " (scales are finite and >= 0)");
    out[i] = f;
  }
  return out;
}

// Module `m` (e.g. "model.layers.0.self_attn.q_proj") of [rows, cols] per `scheme`, read as stored.
QuantizedMatrix read_quantized(const WeightStore& s, QuantMethod method, const QuantScheme& scheme,
                               const std::string& m, int64_t rows, int64_t cols, std::vector<TensorView>& sources) {
  QuantizedMatrix q;
  q.format = scheme.weight_format;
  q.rows = rows;
  q.cols = cols;
  q.group = scheme.group;
  const auto blocks = [](int64_t n, int64_t b) { return (n + b - 1) / b; };
  // Tensors of layouts MoEX does not read: a column permutation (act-order) or static activation scales.
  for (const char* extra : {".weight_g_idx", ".input_scale", ".input_zero_point", ".output_scale"})
    MOEX_CHECK_INPUT(!s.contains(m + extra), "quantized checkpoint: tensor \"", m, extra,
                     "\" is not supported (MoEX reads weight-only checkpoints without act-order)");
  switch (scheme.weight_format) {
    case WeightFormat::kInt8:
    case WeightFormat::kInt8W8A8: {  // int-quantized: weight I8 [rows, cols], weight_scale [rows, 1]
      const TensorView& w = expect_tensor(s, m + ".weight", DType::kI8, {rows, cols});
      const auto* codes = w.as<const uint8_t>();
      q.codes.assign(codes, codes + rows * cols);
      q.scales = read_scales(s, m + ".weight_scale", {rows, 1});
      sources.push_back(w);
      break;
    }
    case WeightFormat::kInt4: {  // pack-quantized: 8 codes (signed + 8) per int32, code i at bits 4i..4i+3
      const int64_t groups = blocks(cols, q.group), words = blocks(cols, 8);
      const TensorView& packed = expect_tensor(s, m + ".weight_packed", DType::kI32, {rows, words});
      MOEX_CHECK_INPUT(s.contains(m + ".weight_shape"), "quantized checkpoint: tensor \"", m, ".weight_shape\" is missing");
      const TensorView& shape = s.get(m + ".weight_shape");
      MOEX_CHECK_INPUT((shape.dtype == DType::kI32 || shape.dtype == DType::kI64) && shape.shape == Shape{2},
                       "quantized checkpoint: tensor \"", m, ".weight_shape\" must be I32 or I64 [2]");
      const auto dim = [&](int i) {
        return shape.dtype == DType::kI32 ? int64_t{shape.as<const int32_t>()[i]} : shape.as<const int64_t>()[i];
      };
      MOEX_CHECK_INPUT(dim(0) == rows && dim(1) == cols, "quantized checkpoint: \"", m, ".weight_shape\" is [", dim(0),
                       ", ", dim(1), "] but config.json implies [", rows, ", ", cols, "]");
      q.codes.resize(rows * cols);
      const auto* word = packed.as<const uint32_t>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) q.codes[r * cols + c] = (word[r * words + c / 8] >> (4 * (c % 8))) & 15u;
      q.scales = read_scales(s, m + ".weight_scale", {rows, groups});
      q.zeros.assign(rows * groups, 8);  // symmetric: signed code 0 is stored as 8
      if (!scheme.symmetric) {  // zero points packed along the rows: [ceil(rows/8), groups], signed + 8
        const TensorView& zp = expect_tensor(s, m + ".weight_zero_point", DType::kI32, {blocks(rows, 8), groups});
        const auto* z = zp.as<const uint32_t>();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < groups; ++g) q.zeros[r * groups + g] = (z[(r / 8) * groups + g] >> (4 * (r % 8))) & 15u;
      } else {
        MOEX_CHECK_INPUT(!s.contains(m + ".weight_zero_point"), "quantized checkpoint: \"", m,
                         ".weight_zero_point\" is present but config group ", scheme.name, " is symmetric");
      }
      sources.push_back(packed);
      break;
    }
    case WeightFormat::kFP8E4M3: {  // weight F8_E4M3 and one f32 scale per 128x128 block: w = code * scale
      const TensorView& w = expect_tensor(s, m + ".weight", DType::kF8E4M3, {rows, cols});
      const auto* codes = w.as<const uint8_t>();
      q.codes.assign(codes, codes + rows * cols);
      const std::string scale = method == QuantMethod::kFP8Blocks ? ".weight_scale_inv" : ".weight_scale";
      q.scales = read_scales(s, m + scale, {blocks(rows, 128), blocks(cols, 128)});
      sources.push_back(w);
      break;
    }
    default: MOEX_CHECK(false, "read_quantized: format");
  }
  return q;
}

// The scheme module `m` is stored in, or nullptr when it is stored as bf16/f32. fp8 blocks: a module is
// quantized exactly when its weight_scale_inv is there (DeepSeek leaves the router and lm_head in bf16).
const QuantScheme* stored_scheme(const WeightStore& s, const QuantizationConfig& qc, const std::string& m) {
  if (!qc.quantized()) return nullptr;
  const QuantScheme* scheme = qc.scheme_for(m);
  if (qc.method == QuantMethod::kFP8Blocks && scheme && !s.contains(m + ".weight_scale_inv")) {
    MOEX_CHECK_INPUT(!s.contains(m + ".weight") || s.get(m + ".weight").dtype != DType::kF8E4M3, "quantized checkpoint: \"",
                     m, ".weight\" is F8_E4M3 but \"", m, ".weight_scale_inv\" is missing");
    return nullptr;
  }
  return scheme;
}

QuantizedMatrix quantize_as(const TensorView& w, const ExpertWeightFormat& f) {
  return kernels::quantize(w, f.format, f.group);
}

// Drops this process's pages of mapped tensors that were packed (they are read again from the file if ever
// touched; nothing on the packed path does).
void release_mapped(const std::vector<TensorView>& views) {
  for (const TensorView& v : views)
    if (v.data && (v.row_stride == 0 || v.shape.rank != 2 || v.row_stride == v.shape[1]))
      MappedFile::release(v.data, v.bytes());
}

// A quantized module packed from its stored codes, then its mapped pages dropped: what a load does without a
// panels.moex, and what moex quantize writes into one (stored_panels), so both give the same bytes.
kernels::PackedWeights pack_stored(const WeightStore& s, QuantMethod method, const QuantScheme& scheme,
                                   const std::string& m, int64_t rows, int64_t cols) {
  std::vector<TensorView> sources;
  kernels::PackedWeights p = kernels::pack(read_quantized(s, method, scheme, m, rows, cols, sources));
  release_mapped(sources);
  return p;
}
// An expert's gate (w1) and up (w3) projections [rows, cols], packed together (kernels::pack_gate_up).
kernels::PackedWeights pack_stored_gate_up(const WeightStore& s, QuantMethod method, const QuantScheme& s1,
                                           const QuantScheme& s3, const std::string& gate, const std::string& up,
                                           int64_t rows, int64_t cols) {
  std::vector<TensorView> sources;
  kernels::PackedWeights p = kernels::pack_gate_up(read_quantized(s, method, s1, gate, rows, cols, sources),
                                                   read_quantized(s, method, s3, up, rows, cols, sources));
  release_mapped(sources);
  return p;
}

// Memory for packed panels, not zero-filled (pack_bf16_direct writes every byte of its buffers, so its own writes
// are the first touch). A layer's experts (`layer`), and any matrix from 4 MB: whole 2 MB pages, advised for huge
// pages before that touch (as kernels::WeightArena); a smaller matrix 64-byte aligned (a 2 MB page for it would
// be mostly waste).
constexpr size_t kHugePage = size_t{2} << 20;
std::shared_ptr<uint8_t> allocate_arena(size_t bytes, bool layer = false) {
  const bool huge = layer || bytes >= 2 * kHugePage;
  const size_t alignment = huge ? kHugePage : 64;
  bytes = (std::max<size_t>(bytes, 1) + alignment - 1) / alignment * alignment;
  std::shared_ptr<uint8_t> p(static_cast<uint8_t*>(std::aligned_alloc(alignment, bytes)), [](uint8_t* q) { std::free(q); });
  MOEX_CHECK(p, "out of memory packing ", bytes, " bytes of weights");
  if (huge) advise_huge_pages(p.get(), bytes);
  return p;
}

size_t round_up_64(size_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace

kernels::PackedWeights pack_bf16_direct(const TensorView& w, const TensorView* w3, std::shared_ptr<uint8_t> into) {
  MOEX_CHECK(w.shape.rank == 2 && (w.dtype == DType::kBF16 || w.dtype == DType::kF32), "pack_bf16_direct: a bf16 or f32 matrix");
  MOEX_CHECK(!w3 || (w3->shape == w.shape && w3->dtype == w.dtype), "pack_bf16_direct: w1 and w3 differ");
  kernels::PackedWeights p = kernels::packed_layout(kernels::WeightFormat::kBF16, w.shape[0], w.shape[1], 0, w3 != nullptr);
  p.data.ptr = into ? std::move(into) : allocate_arena(round_up_64(p.data.size));
  parallel_for(p.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) kernels::pack_bf16_panel(w, w3, p, panel);
  });
  return p;
}

namespace {

// The source bytes packing `view` reads (the progress line's unit).
double view_bytes(const TensorView& v) { return static_cast<double>(v.numel()) * dtype_size(v.dtype); }

// A format packed at load from a bf16/f32 view: bf16 straight into panels, the others through the quantizers.
kernels::PackedWeights pack_as(const TensorView& w, const ExpertWeightFormat& f) {
  if (f.format == WeightFormat::kBF16) return pack_bf16_direct(w);
  return kernels::pack(quantize_as(w, f));
}

}  // namespace

void check_weights_finite(const WeightStore& store) {
  for (const auto& [name, view] : store.tensors()) {  // std::map: name order
    const int64_t bad = first_non_finite(view);
    if (bad < 0) continue;
    std::string where = std::to_string(bad);
    if (view.shape.rank == 2) {
      // Appended piece by piece: g++ 12 warns (a false -Wstringop-overflow) on "[" + std::to_string(...) here.
      where = "[";
      where += std::to_string(bad / view.shape[1]);
      where += ", ";
      where += std::to_string(bad % view.shape[1]);
      where += "]";
    }
    throw_error(ErrorKind::kInvalidInput, "--check-weights: tensor \"" + name + "\" holds a non-finite value (NaN or " +
                                              "infinity) at element " + where + ": the checkpoint is corrupt");
  }
}

DecoderWeights load_mixtral_weights(const std::string& model_dir, const ModelConfig& c, const ParallelPlan& plan,
                                    const ExpertWeightFormat& expert_format, const ExpertWeightFormat& dense_format,
                                    const eplb::ModelPlacement* placement, const std::string& panels_path) {
  if (placement) {
    MOEX_CHECK_INPUT(plan.moe == MoEParallel::kEP && plan.tp == 1, "an expert placement (--eplb, --expert-placement) ",
                     "needs --moe-parallel ep");
    MOEX_CHECK_INPUT(placement->experts == c.num_local_experts && placement->ranks == plan.ep, "expert placement: for ",
                     placement->experts, " experts over ", placement->ranks, " ranks; the model has ", c.num_local_experts,
                     " experts over ", plan.ep, " EP ranks");
    MOEX_CHECK_INPUT(static_cast<int>(placement->layers.size()) == c.num_hidden_layers, "expert placement: ",
                     placement->layers.size(), " layers; the model has ", c.num_hidden_layers);
    for (int l = 0; l < c.num_hidden_layers; ++l)
      MOEX_CHECK_INPUT(placement->layers[l].empty() != c.moe_layer(l), "expert placement: layer ", l, " is ",
                       c.moe_layer(l) ? "a MoE layer and needs" : "dense and takes no", " slots");
  }
  DecoderWeights w;
  w.store = std::make_unique<WeightStore>(model_dir);
  const WeightStore& s = *w.store;
  const QuantizationConfig& qc = c.quantization;
  w.quantized_checkpoint = qc.quantized();
  const int64_t d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, hd = c.head_dim;
  const SliceRange heads = local_heads(plan, c.num_attention_heads);
  const SliceRange kv_heads = local_kv_heads(plan, c.num_attention_heads, c.num_key_value_heads);
  const ExpertRange experts = local_experts(plan, c.num_local_experts);
  const SliceRange inter = local_intermediate(plan, I);
  w.heads_local = static_cast<int>(heads.end - heads.begin);
  w.kv_heads_local = static_cast<int>(kv_heads.end - kv_heads.begin);
  w.intermediate_local = inter.end - inter.begin;
  const bool whole_heads = w.heads_local == c.num_attention_heads;
  const auto timed = [&](auto&& fn) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    w.pack_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // One progress line over the bytes packed at load from bf16/f32 tensors (a terminal only; base/progress.h).
  double to_pack = 0;
  {
    const std::string embed = "model.embed_tokens.weight";  // (a missing one is reported below)
    const double elem = s.contains(embed) ? dtype_size(s.get(embed).dtype) : 2;
    if (!qc.quantized() && expert_format.packed)
      for (int l = 0; l < c.num_hidden_layers; ++l)
        if (c.moe_layer(l)) to_pack += experts.count * 3.0 * static_cast<double>(w.intermediate_local) * d * elem;
    if (!qc.quantized() && dense_format.packed)
      to_pack += elem * (static_cast<double>(V) * d + c.num_hidden_layers * static_cast<double>(d) *
                                                          (2.0 * w.heads_local * hd + 2.0 * w.kv_heads_local * hd));
  }
  std::string what = "packing weights to ";
  what += expert_format.packed ? expert_format.name() : dense_format.name();
  std::unique_ptr<Progress> progress = std::make_unique<Progress>(what, to_pack);
  // panels.moex (panels_file.h): a quantized checkpoint's stored matrices, or a bf16/f16/f32 one's matrices packed to
  // bf16 as below, already packed. --panels names one (or "none"); else the one beside the checkpoint, if any.
  const std::string panels_wanted = panels_kind(qc.quantized(), expert_format, dense_format);
  const bool bf16_packed = !qc.quantized() && panels_wanted == weight_format_name(WeightFormat::kBF16);
  std::shared_ptr<const PanelsFile> panels;
  const bool given_panels = !panels_path.empty() && panels_path != "none";
  MOEX_CHECK_INPUT(!given_panels || !is_gguf_path(model_dir), "--panels: a .gguf checkpoint loads without panels");
  MOEX_CHECK_INPUT(!given_panels || qc.quantized() || expert_format.packed || dense_format.packed, "--panels ",
                   panels_path, ": this load packs nothing (--weights and --dense-weights as stored)");
  if (given_panels || (panels_path.empty() && panels_kind_written_beside(panels_wanted) && !is_gguf_path(model_dir))) {
    PanelsKey want = qc.quantized() ? panels_key(s, qc) : panels_key(s, WeightFormat::kBF16);
    want.weights = panels_wanted;
    panels = PanelsFile::open(given_panels ? panels_path : default_panels_path(model_dir), want, given_panels, model_dir);
  }
  w.panels_mapped = panels != nullptr;
  // A bf16 matrix is mapped from the panels only when it is whole on this rank (the file holds whole matrices;
  // a TP slice is packed at load, to the same bytes as the matching panels).
  const bool bf16_panels = panels && !qc.quantized();
  const auto whole = [&](bool ok, const std::string& m) {
    MOEX_CHECK_INPUT(ok, "quantized checkpoint: \"", m, "\" is stored quantized and loads only whole: run on one "
                     "rank, or with --moe-parallel ep --attn-parallel dp");
  };
  // A dense module [rows, cols]: packed from the checkpoint's codes, packed at load (--dense-weights), or as stored.
  // `slice` cuts this rank's share out of the stored view; `mapped` says whether that share stays a mapping view.
  const auto dense = [&](const std::string& m, Shape shape, const auto& slice, bool mapped) {
    DenseWeight out;
    if (const QuantScheme* scheme = stored_scheme(s, qc, m)) {
      MOEX_CHECK_INPUT(!dense_format.packed, "--dense-weights ", dense_format.name(), ": \"", m, "\" is stored quantized (",
                       scheme->format, ") already; use --dense-weights as-stored");
      whole(whole_heads, m);
      if (panels) {  // packed by moex quantize from these very codes: mapped, not packed again
        timed([&] { out.packed = panels->get(m, kernels::packed_layout(scheme->weight_format, shape[0], shape[1], scheme->group, false)); });
        return out;
      }
      timed([&] {
        out.packed = std::make_shared<kernels::PackedWeights>(pack_stored(s, qc.method, *scheme, m, shape[0], shape[1]));
      });
      return out;
    }
    if (bf16_panels && dense_format.packed && dense_format.format == WeightFormat::kBF16 && mapped) {
      const TensorView& whole_view = expect(s, m + ".weight", shape);
      if (whole_heads || m == "lm_head") {  // whole on this rank: mapped, its source never paged in
        out.view = whole_view;
        timed([&] { out.packed = panels->get(m, kernels::packed_layout(WeightFormat::kBF16, shape[0], shape[1], 0, false)); });
        progress->add(view_bytes(whole_view));
        return out;
      }
    }
    out.view = slice(expect(s, m + ".weight", shape));
    if (dense_format.packed) {
      timed([&] { out.packed = std::make_shared<kernels::PackedWeights>(pack_as(out.view, dense_format)); });
      progress->add(view_bytes(out.view));
      if (mapped) release_mapped({out.view});
    }
    return out;
  };
  const auto as_resident = [](const TensorView& v) { return resident(v); };

  w.embed = expect(s, "model.embed_tokens.weight", {V, d});  // rows are read on demand: not paged in
  w.final_norm = resident(expect(s, "model.norm.weight", {d}));
  if (s.contains("lm_head.weight") || s.contains("lm_head.weight_packed")) {
    w.lm_head = dense("lm_head", {V, d}, as_resident, true);
  } else {
    MOEX_CHECK_INPUT(c.tie_word_embeddings, "checkpoint has no tensor \"lm_head.weight\" and tie_word_embeddings is false");
    w.lm_head.view = resident(w.embed);
    if (bf16_panels && dense_format.packed && dense_format.format == WeightFormat::kBF16) {
      timed([&] { w.lm_head.packed = panels->get("lm_head", kernels::packed_layout(WeightFormat::kBF16, V, d, 0, false)); });
      progress->add(view_bytes(w.embed));
    } else if (dense_format.packed) {  // the embedding's pages stay: its rows are still looked up
      timed([&] { w.lm_head.packed = std::make_shared<kernels::PackedWeights>(pack_as(w.embed, dense_format)); });
      progress->add(view_bytes(w.embed));
    }
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.input_norm = resident(expect(s, p + "input_layernorm.weight", {d}));
    lw.wq = dense(p + "self_attn.q_proj", {c.q_dim(), d},
                  [&](const TensorView& v) { return resident(v.rows(heads.begin * hd, heads.end * hd)); }, true);
    lw.wk = dense(p + "self_attn.k_proj", {c.kv_dim(), d},
                  [&](const TensorView& v) { return resident(v.rows(kv_heads.begin * hd, kv_heads.end * hd)); }, true);
    lw.wv = dense(p + "self_attn.v_proj", {c.kv_dim(), d},
                  [&](const TensorView& v) { return resident(v.rows(kv_heads.begin * hd, kv_heads.end * hd)); }, true);
    lw.wo = dense(p + "self_attn.o_proj", {d, c.q_dim()},
                  [&](const TensorView& v) { return owned_copy(v.columns(heads.begin * hd, heads.end * hd), w.owned); },
                  whole_heads);
    lw.post_norm = resident(expect(s, p + "post_attention_layernorm.weight", {d}));
    if (c.qkv_bias) {
      lw.bq = resident(slice1(expect(s, p + "self_attn.q_proj.bias", {c.q_dim()}), heads.begin * hd, heads.end * hd));
      lw.bk = resident(slice1(expect(s, p + "self_attn.k_proj.bias", {c.kv_dim()}), kv_heads.begin * hd, kv_heads.end * hd));
      lw.bv = resident(slice1(expect(s, p + "self_attn.v_proj.bias", {c.kv_dim()}), kv_heads.begin * hd, kv_heads.end * hd));
    }
    if (c.qk_norm == QkNorm::kPerHead) {
      lw.q_norm = resident(expect(s, p + "self_attn.q_norm.weight", {hd}));
      lw.k_norm = resident(expect(s, p + "self_attn.k_norm.weight", {hd}));
    } else if (c.qk_norm == QkNorm::kWhole) {
      // Over the whole projection (olmoe): this rank's heads' slice (attention TP; mixtral.cc sums the squares).
      lw.q_norm = resident(slice1(expect(s, p + "self_attn.q_norm.weight", {c.q_dim()}), heads.begin * hd, heads.end * hd));
      lw.k_norm = resident(slice1(expect(s, p + "self_attn.k_norm.weight", {c.kv_dim()}), kv_heads.begin * hd,
                                  kv_heads.end * hd));
    }
    // Shared experts and dense MLP layers (whole on every rank): packed at load with the attention projections
    // under a packed --dense-weights (run by expert_ffn through the fused kernels), else as stored.
    const auto mlp_weights = [&](const std::string& q, int64_t width) {
      if (bf16_panels && dense_format.packed && dense_format.format == WeightFormat::kBF16) {
        ExpertWeights m{expect(s, q + "gate_proj.weight", {width, d}), expect(s, q + "up_proj.weight", {width, d}),
                        expect(s, q + "down_proj.weight", {d, width})};
        timed([&] {
          PackedExpert packed;
          packed.w13 = *panels->get(q + "gate_up", kernels::packed_layout(WeightFormat::kBF16, width, d, 0, true));
          packed.w2 = *panels->get(q + "down", kernels::packed_layout(WeightFormat::kBF16, d, width, 0, false));
          m.packed = std::make_shared<const PackedExpert>(std::move(packed));
        });
        return m;
      }
      ExpertWeights m{resident(expect(s, q + "gate_proj.weight", {width, d})),
                      resident(expect(s, q + "up_proj.weight", {width, d})),
                      resident(expect(s, q + "down_proj.weight", {d, width}))};
      if (dense_format.packed) {
        timed([&] { m.packed = std::make_shared<const PackedExpert>(pack_expert(m, dense_format)); });
        release_mapped({m.w1, m.w3, m.w2});
      }
      return m;
    };
    lw.is_moe = c.moe_layer(l);
    if (!lw.is_moe) {  // a dense layer: HF's <Family>MLP under "mlp."
      lw.mlp = mlp_weights(p + "mlp.", c.dense_intermediate_size);
      w.layers.push_back(std::move(lw));
      continue;
    }
    const FamilyInfo& info = c.info();
    const std::string moe = p + info.moe_prefix + ".";
    MOEX_CHECK_INPUT(!stored_scheme(s, qc, moe + "gate") || s.contains(moe + "gate.weight"),
                     "quantized checkpoint: the router \"", moe, "gate\" is stored quantized, which MoEX "
                     "does not load (routing must see exact logits)");
    lw.moe.gate = resident(expect(s, moe + "gate.weight", {c.num_local_experts, d}));
    if (c.scoring == RouterScoring::kSigmoidGrouped)
      lw.moe.gate_bias = resident(expect(s, moe + "gate.e_score_correction_bias", {c.num_local_experts}));
    if (c.shared_expert_intermediate_size > 0)
      lw.mlp = mlp_weights(moe + info.shared_prefix + ".", c.shared_expert_intermediate_size);
    if (c.shared_expert_gate) lw.shared_gate = resident(expect(s, moe + "shared_expert_gate.weight", {1, d}));
    lw.moe.experts = experts;
    // The experts this rank loads, ascending (under a placement: those its slots name, each once).
    std::vector<int> held;
    for (int e = experts.first; e < experts.first + experts.count; ++e) held.push_back(e);
    if (placement) {
      const eplb::Placement& p = placement->layers[l];
      const int S = p.slots_per_rank;
      held.assign(p.slot_expert.begin() + int64_t{plan.ep_rank()} * S, p.slot_expert.begin() + int64_t{plan.ep_rank() + 1} * S);
      std::sort(held.begin(), held.end());
      held.erase(std::unique(held.begin(), held.end()), held.end());
      lw.moe.placement = p;
      lw.moe.experts = ExpertRange{plan.ep_rank() * S, S};
    }
    // This layer's packed experts in one huge-page arena, in expert order (kernels::WeightArena says why): each
    // moves in as soon as it is packed, so the load holds at most one expert twice.
    kernels::WeightArena arena;
    const auto keep_packed = [&](PackedExpert packed) {
      if (!arena.base())
        arena.reserve(held.size() * (kernels::WeightArena::bytes_for(packed.w13) + kernels::WeightArena::bytes_for(packed.w2)));
      arena.adopt(packed.w13);
      arena.adopt(packed.w2);
      lw.moe.packed.push_back(std::move(packed));
    };
    int stored_quantized = 0;
    // Whole experts (one rank, EP) of a bf16 load with bf16 panels: mapped. Under TP each rank's slices are packed.
    const bool map_experts = bf16_panels && expert_format.packed && expert_format.format == WeightFormat::kBF16 &&
                             w.intermediate_local == I;
    for (int e = 0; e < c.num_local_experts; ++e) {
      const std::string q = moe + "experts." + std::to_string(e) + ".";
      const QuantScheme *s1 = stored_scheme(s, qc, q + info.expert_gate), *s3 = stored_scheme(s, qc, q + info.expert_up),
                        *s2 = stored_scheme(s, qc, q + info.expert_down);
      const bool local = std::binary_search(held.begin(), held.end(), e);
      if (s1 || s2 || s3) {
        MOEX_CHECK_INPUT(s1 && s2 && s3, "quantized checkpoint: expert ", e, " of layer ", l,
                         " has w1, w2, w3 stored differently (all three quantized, or none)");
        MOEX_CHECK_INPUT(s1->weight_format == s3->weight_format && s1->group == s3->group, "quantized checkpoint: \"", q,
                         "w1\" and \"", q, "w3\" are packed together and must share a format");
        MOEX_CHECK_INPUT(!expert_format.packed, "--weights ", expert_format.name(), ": the experts are stored quantized (",
                         s1->format, ") already; use --weights as-stored");
        whole(w.intermediate_local == I, q + info.expert_gate);
        MOEX_CHECK_INPUT(!plan.overlap, "--overlap is not supported with a quantized checkpoint yet (the experts are packed)");
        ++stored_quantized;
        if (!local) continue;
        if (panels) {  // views into the mapping: no arena copy
          timed([&] {
            PackedExpert packed;
            packed.w13 = *panels->get(q + "gate_up", kernels::packed_layout(s1->weight_format, I, d, s1->group, true));
            packed.w2 = *panels->get(q + "down", kernels::packed_layout(s2->weight_format, d, I, s2->group, false));
            lw.moe.packed.push_back(std::move(packed));
          });
          lw.moe.local.push_back({});
          continue;
        }
        timed([&] {
          PackedExpert packed;
          packed.w13 = pack_stored_gate_up(s, qc.method, *s1, *s3, q + info.expert_gate, q + info.expert_up, I, d);
          packed.w2 = pack_stored(s, qc.method, *s2, q + info.expert_down, d, I);
          keep_packed(std::move(packed));
        });
        lw.moe.local.push_back({});  // nothing as stored: the packed experts run
        continue;
      }
      // Every expert's shapes are checked, but only this rank's experts (and slices) are paged in.
      const TensorView w1 = expect(s, q + info.expert_gate + ".weight", {I, d}),
                       w3 = expect(s, q + info.expert_up + ".weight", {I, d}),
                       w2 = expect(s, q + info.expert_down + ".weight", {d, I});
      if (!local) continue;
      if (map_experts) {  // the views stay unread: the mapped panels run
        timed([&] {
          PackedExpert packed;
          packed.w13 = *panels->get(q + "gate_up", kernels::packed_layout(WeightFormat::kBF16, I, d, 0, true));
          packed.w2 = *panels->get(q + "down", kernels::packed_layout(WeightFormat::kBF16, d, I, 0, false));
          lw.moe.packed.push_back(std::move(packed));
        });
        lw.moe.local.push_back({w1, w3, w2});
        progress->add(view_bytes(w1) + view_bytes(w3) + view_bytes(w2));
        continue;
      }
      lw.moe.local.push_back({resident(w1.rows(inter.begin, inter.end)), resident(w3.rows(inter.begin, inter.end)),
                              owned_copy(w2.columns(inter.begin, inter.end), w.owned)});
    }
    MOEX_CHECK_INPUT(stored_quantized == 0 || stored_quantized == c.num_local_experts, "quantized checkpoint: layer ", l,
                     " has ", stored_quantized, " of ", c.num_local_experts,
                     " experts stored quantized; MoEX needs all of a layer's experts stored one way");
    if (map_experts) {
      // (mapped above)
    } else if (expert_format.packed && expert_format.format == WeightFormat::kBF16) {
      // One arena for the layer's experts, written in place: the panels of all of them are split over the threads
      // at once (an expert's [I, d] panels are few under TP), and nothing but the arena is allocated.
      timed([&] {
        const size_t n = lw.moe.local.size();
        std::vector<kernels::PackedWeights> layouts;
        size_t bytes = 0;
        for (const ExpertWeights& e : lw.moe.local) {
          layouts.push_back(kernels::packed_layout(WeightFormat::kBF16, e.w1.shape[0], e.w1.shape[1], 0, true));
          layouts.push_back(kernels::packed_layout(WeightFormat::kBF16, e.w2.shape[0], e.w2.shape[1], 0, false));
          bytes += round_up_64(layouts[layouts.size() - 2].data.size) + round_up_64(layouts.back().data.size);
        }
        const std::shared_ptr<uint8_t> arena = allocate_arena(bytes, /*layer=*/true);
        std::vector<int64_t> first_panel{0};  // matrix i's panels are [first_panel[i], first_panel[i + 1])
        size_t used = 0;
        for (kernels::PackedWeights& p : layouts) {
          p.data.ptr = std::shared_ptr<uint8_t>(arena, arena.get() + used);
          used += round_up_64(p.data.size);
          first_panel.push_back(first_panel.back() + p.panels);
        }
        parallel_for(first_panel.back(), 1, [&](int64_t begin, int64_t end) {
          size_t i = std::upper_bound(first_panel.begin(), first_panel.end(), begin) - first_panel.begin() - 1;
          for (int64_t panel = begin; panel < end; ++panel) {
            while (panel >= first_panel[i + 1]) ++i;
            const ExpertWeights& e = lw.moe.local[i / 2];
            const kernels::PackedWeights& p = layouts[i];
            if (i % 2 == 0) kernels::pack_bf16_panel(e.w1, &e.w3, p, panel - first_panel[i]);
            else kernels::pack_bf16_panel(e.w2, nullptr, p, panel - first_panel[i]);
            const double rows = static_cast<double>(std::min(p.rows_per_panel(), p.rows - (panel - first_panel[i]) * p.rows_per_panel()));
            progress->add(rows * p.cols * dtype_size(e.w1.dtype) * (p.gate_up ? 2 : 1));
          }
        });
        for (size_t e = 0; e < n; ++e) lw.moe.packed.push_back({std::move(layouts[2 * e]), std::move(layouts[2 * e + 1])});
      });
    } else if (expert_format.packed) {  // once per load; the quantizers and pack split rows over the threads
      timed([&] {
        for (const ExpertWeights& e : lw.moe.local) {
          keep_packed(pack_expert(e, expert_format));
          progress->add(view_bytes(e.w1) + view_bytes(e.w3) + view_bytes(e.w2));
        }
      });
    }
    if (expert_format.packed && !map_experts) {
      for (const ExpertWeights& e : lw.moe.local) {
        release_mapped({e.w1, e.w3});
        if (w.intermediate_local == I) release_mapped({e.w2});  // else w2 is an owned copy
      }
    }
    if (placement) {  // held order -> slot order; a repeated expert shares its views and packed buffers
      const eplb::Placement& p = lw.moe.placement;
      std::vector<ExpertWeights> local;
      std::vector<PackedExpert> packed;
      for (int slot = lw.moe.experts.first; slot < lw.moe.experts.first + lw.moe.experts.count; ++slot) {
        const size_t i = std::lower_bound(held.begin(), held.end(), p.slot_expert[slot]) - held.begin();
        local.push_back(lw.moe.local[i]);
        if (!lw.moe.packed.empty()) packed.push_back(lw.moe.packed[i]);
      }
      lw.moe.local = std::move(local);
      lw.moe.packed = std::move(packed);
    }
    w.layers.push_back(std::move(lw));
  }
  // Packing at load costs memory bandwidth and fresh pages every start; on a terminal, say once what the panels
  // would save (nothing is written unless asked: moex pack).
  if (bf16_packed && !panels && panels_path != "none" && plan.rank == 0 && w.pack_seconds > 0 && progress_enabled() &&
      !is_gguf_path(model_dir)) {
    progress.reset();  // its line ends first
    const double elem = dtype_size(s.get("model.embed_tokens.weight").dtype);
    std::fprintf(stderr, "moex: packing to bf16 took %.2f s of this load; `moex pack --model %s` writes the packed "
                 "panels (about %.0f MB) beside the checkpoint so that later loads map them (or --out PATH, then "
                 "--panels PATH)\n", w.pack_seconds, model_dir.c_str(), to_pack / elem * 2 / 1e6);
  }
  return w;
}

int rehome_layer_experts(DecoderWeights& w, const ModelConfig& c, const ParallelPlan& plan, int layer,
                         const eplb::Placement& placement, const ExpertWeightFormat& format) {
  LayerWeights& lw = w.layers.at(layer);
  MOEX_CHECK(lw.is_moe && !lw.moe.placement.empty() && !w.quantized_checkpoint, "rehome_layer_experts: layer ", layer);
  MOEX_CHECK(placement.slots() == lw.moe.placement.slots() && placement.experts == c.num_local_experts,
             "rehome_layer_experts: the placement's shape changed");
  const int S = placement.slots_per_rank, first = plan.ep_rank() * S;
  const int64_t d = c.hidden_size, I = c.intermediate_size;
  const FamilyInfo& info = c.info();
  const std::string q0 = "model.layers." + std::to_string(layer) + "." + info.moe_prefix + ".experts.";
  std::vector<ExpertWeights> local;
  std::vector<PackedExpert> packed;
  int reads = 0;
  for (int slot = first; slot < first + S; ++slot) {
    const int e = placement.slot_expert[slot];
    int held = -1;
    for (int i = 0; i < S && held < 0; ++i)
      if (lw.moe.placement.slot_expert[first + i] == e) held = i;
    if (held >= 0) {
      local.push_back(lw.moe.local[held]);
      if (!lw.moe.packed.empty()) packed.push_back(lw.moe.packed[held]);
      continue;
    }
    int twin = -1;  // an earlier new slot of this call with the same expert
    for (int i = 0; i < slot - first && twin < 0; ++i)
      if (placement.slot_expert[first + i] == e) twin = i;
    if (twin >= 0) {
      local.push_back(local[twin]);
      if (format.packed) packed.push_back(packed[twin]);
      continue;
    }
    const std::string q = q0 + std::to_string(e) + ".";
    ExpertWeights x{resident(expect(*w.store, q + info.expert_gate + ".weight", {I, d})),
                    resident(expect(*w.store, q + info.expert_up + ".weight", {I, d})),
                    resident(expect(*w.store, q + info.expert_down + ".weight", {d, I}))};
    if (format.packed) {
      packed.push_back(pack_expert(x, format));
      release_mapped({x.w1, x.w3, x.w2});
    }
    local.push_back(x);
    ++reads;
  }
  lw.moe.local = std::move(local);
  lw.moe.packed = std::move(packed);
  lw.moe.placement = placement;
  return reads;
}

std::vector<PanelsToWrite> bf16_panels(const WeightStore& s, const ModelConfig& c) {
  MOEX_CHECK_INPUT(!c.quantization.quantized(), "bf16 panels are a bf16/f16/f32 checkpoint's");
  const int64_t d = c.hidden_size, I = c.intermediate_size;
  std::vector<PanelsToWrite> out;
  // As load_mixtral_weights packs them on one rank (pack_bf16_direct: the bytes of every other bf16 packing).
  const auto matrix = [&](const std::string& name, const std::string& tensor, int64_t rows, int64_t cols) {
    const TensorView v = expect(s, tensor, {rows, cols});
    out.push_back({name, kernels::packed_layout(WeightFormat::kBF16, rows, cols, 0, false), [v] {
                     kernels::PackedWeights p = pack_bf16_direct(v);
                     release_mapped({v});
                     return p;
                   }});
  };
  const auto gate_up = [&](const std::string& name, const std::string& gate, const std::string& up, int64_t rows,
                           int64_t cols) {
    const TensorView v1 = expect(s, gate, {rows, cols}), v3 = expect(s, up, {rows, cols});
    out.push_back({name, kernels::packed_layout(WeightFormat::kBF16, rows, cols, 0, true), [v1, v3] {
                     kernels::PackedWeights p = pack_bf16_direct(v1, &v3);
                     release_mapped({v1, v3});
                     return p;
                   }});
  };
  const auto mlp = [&](const std::string& q, int64_t width) {
    gate_up(q + "gate_up", q + "gate_proj.weight", q + "up_proj.weight", width, d);
    matrix(q + "down", q + "down_proj.weight", d, width);
  };
  if (s.contains("lm_head.weight")) matrix("lm_head", "lm_head.weight", c.vocab_size, d);
  else matrix("lm_head", "model.embed_tokens.weight", c.vocab_size, d);  // tied (a load checks the config says so)
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    matrix(p + "self_attn.q_proj", p + "self_attn.q_proj.weight", c.q_dim(), d);
    matrix(p + "self_attn.k_proj", p + "self_attn.k_proj.weight", c.kv_dim(), d);
    matrix(p + "self_attn.v_proj", p + "self_attn.v_proj.weight", c.kv_dim(), d);
    matrix(p + "self_attn.o_proj", p + "self_attn.o_proj.weight", d, c.q_dim());
    if (!c.moe_layer(l)) {
      mlp(p + "mlp.", c.dense_intermediate_size);
      continue;
    }
    const FamilyInfo& info = c.info();
    const std::string moe = p + info.moe_prefix + ".";
    if (c.shared_expert_intermediate_size > 0) mlp(moe + info.shared_prefix + ".", c.shared_expert_intermediate_size);
    for (int e = 0; e < c.num_local_experts; ++e) {
      const std::string q = moe + "experts." + std::to_string(e) + ".";
      gate_up(q + "gate_up", q + info.expert_gate + ".weight", q + info.expert_up + ".weight", I, d);
      matrix(q + "down", q + info.expert_down + ".weight", d, I);
    }
  }
  return out;
}

std::vector<PanelsToWrite> stored_panels(const WeightStore& s, const ModelConfig& c) {
  const QuantizationConfig& qc = c.quantization;
  const int64_t d = c.hidden_size, I = c.intermediate_size;
  std::vector<PanelsToWrite> out;
  // A module as load_mixtral_weights packs it from the stored codes (one rank: every module whole).
  const auto dense = [&](const std::string& m, int64_t rows, int64_t cols) {
    const QuantScheme* scheme = stored_scheme(s, qc, m);
    if (!scheme) return;
    out.push_back({m, kernels::packed_layout(scheme->weight_format, rows, cols, scheme->group, false),
                   [&s, &qc, scheme, m, rows, cols] { return pack_stored(s, qc.method, *scheme, m, rows, cols); }});
  };
  if (s.contains("lm_head.weight") || s.contains("lm_head.weight_packed")) dense("lm_head", c.vocab_size, d);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    dense(p + "self_attn.q_proj", c.q_dim(), d);
    dense(p + "self_attn.k_proj", c.kv_dim(), d);
    dense(p + "self_attn.v_proj", c.kv_dim(), d);
    dense(p + "self_attn.o_proj", d, c.q_dim());
    if (!c.moe_layer(l)) continue;
    const FamilyInfo& info = c.info();
    for (int e = 0; e < c.num_local_experts; ++e) {
      const std::string q = p + info.moe_prefix + ".experts." + std::to_string(e) + ".";
      const QuantScheme *s1 = stored_scheme(s, qc, q + info.expert_gate), *s3 = stored_scheme(s, qc, q + info.expert_up),
                        *s2 = stored_scheme(s, qc, q + info.expert_down);
      if (!s1 || !s2 || !s3) continue;  // (a load refuses experts stored half quantized)
      const std::string gate = q + info.expert_gate, up = q + info.expert_up, down = q + info.expert_down;
      out.push_back({q + "gate_up", kernels::packed_layout(s1->weight_format, I, d, s1->group, true),
                     [&s, &qc, s1, s3, gate, up, I, d] {
                       return pack_stored_gate_up(s, qc.method, *s1, *s3, gate, up, I, d);
                     }});
      out.push_back({q + "down", kernels::packed_layout(s2->weight_format, d, I, s2->group, false),
                     [&s, &qc, s2, down, I, d] { return pack_stored(s, qc.method, *s2, down, d, I); }});
    }
  }
  return out;
}

}  // namespace moex
