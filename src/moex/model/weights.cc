#include "moex/model/weights.h"

#include <chrono>
#include <cstring>

#include "moex/base/error.h"

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

}  // namespace

void check_weights_finite(const WeightStore& store) {
  for (const auto& [name, view] : store.tensors()) {  // std::map: name order
    const int64_t bad = first_non_finite(view);
    if (bad < 0) continue;
    std::string where = std::to_string(bad);
    if (view.shape.rank == 2) {
      where = "[" + std::to_string(bad / view.shape[1]) + ", " + std::to_string(bad % view.shape[1]) + "]";
    }
    throw_error(ErrorKind::kInvalidInput, "--check-weights: tensor \"" + name + "\" holds a non-finite value (NaN or " +
                                              "infinity) at element " + where + ": the checkpoint is corrupt");
  }
}

MixtralWeights load_mixtral_weights(const std::string& model_dir, const ModelConfig& c, const ParallelPlan& plan,
                                    const ExpertWeightFormat& expert_format) {
  MixtralWeights w;
  w.store = std::make_unique<WeightStore>(model_dir);
  const WeightStore& s = *w.store;
  const int64_t d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, hd = c.head_dim;
  const SliceRange heads = local_heads(plan, c.num_attention_heads);
  const SliceRange kv_heads = local_kv_heads(plan, c.num_attention_heads, c.num_key_value_heads);
  const ExpertRange experts = local_experts(plan, c.num_local_experts);
  const SliceRange inter = local_intermediate(plan, I);
  w.heads_local = static_cast<int>(heads.end - heads.begin);
  w.kv_heads_local = static_cast<int>(kv_heads.end - kv_heads.begin);
  w.intermediate_local = inter.end - inter.begin;

  w.embed = expect(s, "model.embed_tokens.weight", {V, d});  // rows are read on demand: not paged in
  w.final_norm = resident(expect(s, "model.norm.weight", {d}));
  if (s.contains("lm_head.weight")) {
    w.lm_head = resident(expect(s, "lm_head.weight", {V, d}));
  } else {
    MOEX_CHECK_INPUT(c.tie_word_embeddings, "checkpoint has no tensor \"lm_head.weight\" and tie_word_embeddings is false");
    w.lm_head = resident(w.embed);
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.input_norm = resident(expect(s, p + "input_layernorm.weight", {d}));
    lw.wq = resident(expect(s, p + "self_attn.q_proj.weight", {c.q_dim(), d}).rows(heads.begin * hd, heads.end * hd));
    lw.wk = resident(expect(s, p + "self_attn.k_proj.weight", {c.kv_dim(), d}).rows(kv_heads.begin * hd, kv_heads.end * hd));
    lw.wv = resident(expect(s, p + "self_attn.v_proj.weight", {c.kv_dim(), d}).rows(kv_heads.begin * hd, kv_heads.end * hd));
    lw.wo = owned_copy(expect(s, p + "self_attn.o_proj.weight", {d, c.q_dim()}).columns(heads.begin * hd, heads.end * hd),
                       w.owned);
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
      lw.q_norm = resident(expect(s, p + "self_attn.q_norm.weight", {c.q_dim()}));
      lw.k_norm = resident(expect(s, p + "self_attn.k_norm.weight", {c.kv_dim()}));
    }
    const auto mlp_weights = [&](const std::string& q, int64_t width) {
      return ExpertWeights{resident(expect(s, q + "gate_proj.weight", {width, d})),
                           resident(expect(s, q + "up_proj.weight", {width, d})),
                           resident(expect(s, q + "down_proj.weight", {d, width}))};
    };
    lw.is_moe = c.moe_layer(l);
    if (!lw.is_moe) {  // a dense layer: HF's <Family>MLP under "mlp."
      lw.mlp = mlp_weights(p + "mlp.", c.dense_intermediate_size);
      w.layers.push_back(std::move(lw));
      continue;
    }
    const FamilyInfo& info = c.info();
    const std::string moe = p + info.moe_prefix + ".";
    lw.moe.gate = resident(expect(s, moe + "gate.weight", {c.num_local_experts, d}));
    if (c.scoring == RouterScoring::kSigmoidGrouped)
      lw.moe.gate_bias = resident(expect(s, moe + "gate.e_score_correction_bias", {c.num_local_experts}));
    if (c.shared_expert_intermediate_size > 0)
      lw.mlp = mlp_weights(moe + info.shared_prefix + ".", c.shared_expert_intermediate_size);
    if (c.shared_expert_gate) lw.shared_gate = resident(expect(s, moe + "shared_expert_gate.weight", {1, d}));
    lw.moe.experts = experts;
    for (int e = 0; e < c.num_local_experts; ++e) {
      const std::string q = moe + "experts." + std::to_string(e) + ".";
      // Every expert's shapes are checked, but only this rank's experts (and slices) are paged in.
      const TensorView w1 = expect(s, q + info.expert_gate + ".weight", {I, d}),
                       w3 = expect(s, q + info.expert_up + ".weight", {I, d}),
                       w2 = expect(s, q + info.expert_down + ".weight", {d, I});
      if (e < experts.first || e >= experts.first + experts.count) continue;
      lw.moe.local.push_back({resident(w1.rows(inter.begin, inter.end)), resident(w3.rows(inter.begin, inter.end)),
                              owned_copy(w2.columns(inter.begin, inter.end), w.owned)});
    }
    if (expert_format.packed) {  // once per load; the quantizers and pack split rows over the threads
      const auto start = std::chrono::steady_clock::now();
      for (const ExpertWeights& e : lw.moe.local) lw.moe.packed.push_back(pack_expert(e, expert_format));
      w.pack_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    w.layers.push_back(std::move(lw));
  }
  return w;
}

}  // namespace moex
