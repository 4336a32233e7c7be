// The Mixtral weights as views into the checkpoint mapping, every shape checked against the config.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "moex/base/tensor.h"
#include "moex/model/config.h"
#include "moex/model/safetensors.h"
#include "moex/moe/dynamic_batch.h"

namespace moex {

struct LayerWeights {
  TensorView input_norm;  // [d]
  TensorView wq;          // [H*hd, d]
  TensorView wk;          // [KV*hd, d]
  TensorView wv;          // [KV*hd, d]
  TensorView wo;          // [d, H*hd]
  TensorView post_norm;   // [d]
  TensorView gate;        // [E, d] router
  std::vector<ExpertWeights> experts;  // [E]: w1 [I, d], w3 [I, d], w2 [d, I]
};

struct MixtralWeights {
  std::unique_ptr<WeightStore> store;  // owns the mappings the views point into
  TensorView embed;     // [V, d]
  std::vector<LayerWeights> layers;
  TensorView final_norm;  // [d]
  TensorView lm_head;     // [V, d] (the embedding when tie_word_embeddings)
};

// Throws Error(kInvalidInput) naming the tensor for a missing tensor, a wrong shape or an unsupported dtype.
MixtralWeights load_mixtral_weights(const std::string& model_dir, const ModelConfig& config);

}  // namespace moex
