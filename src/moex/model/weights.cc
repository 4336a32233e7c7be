#include "moex/model/weights.h"

#include "moex/base/error.h"

namespace moex {
namespace {

TensorView expect(const WeightStore& store, const std::string& name, Shape shape) {
  const TensorView& view = store.get(name);
  MOEX_CHECK_INPUT(view.shape == shape, "tensor \"", name, "\" has shape ", view.shape.str(), " but config.json implies ",
                   shape.str());
  MOEX_CHECK_INPUT(view.dtype == DType::kBF16 || view.dtype == DType::kF32, "tensor \"", name, "\" has dtype ",
                   dtype_name(view.dtype), " (MoEX loads BF16 and F32 weights)");
  MappedFile::prefault(view.data, view.bytes());
  return view;
}

}  // namespace

MixtralWeights load_mixtral_weights(const std::string& model_dir, const ModelConfig& c) {
  MixtralWeights w;
  w.store = std::make_unique<WeightStore>(model_dir);
  const WeightStore& s = *w.store;
  const int64_t d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  w.embed = expect(s, "model.embed_tokens.weight", {V, d});
  w.final_norm = expect(s, "model.norm.weight", {d});
  if (s.contains("lm_head.weight"))
    w.lm_head = expect(s, "lm_head.weight", {V, d});
  else {
    MOEX_CHECK_INPUT(c.tie_word_embeddings, "checkpoint has no tensor \"lm_head.weight\" and tie_word_embeddings is false");
    w.lm_head = w.embed;
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.input_norm = expect(s, p + "input_layernorm.weight", {d});
    lw.wq = expect(s, p + "self_attn.q_proj.weight", {c.q_dim(), d});
    lw.wk = expect(s, p + "self_attn.k_proj.weight", {c.kv_dim(), d});
    lw.wv = expect(s, p + "self_attn.v_proj.weight", {c.kv_dim(), d});
    lw.wo = expect(s, p + "self_attn.o_proj.weight", {d, c.q_dim()});
    lw.post_norm = expect(s, p + "post_attention_layernorm.weight", {d});
    lw.gate = expect(s, p + "block_sparse_moe.gate.weight", {c.num_local_experts, d});
    for (int e = 0; e < c.num_local_experts; ++e) {
      const std::string q = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      lw.experts.push_back({expect(s, q + "w1.weight", {I, d}), expect(s, q + "w3.weight", {I, d}),
                            expect(s, q + "w2.weight", {d, I})});
    }
    w.layers.push_back(std::move(lw));
  }
  return w;
}

}  // namespace moex
