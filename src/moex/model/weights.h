// The Mixtral weights as views into the checkpoint mapping, every shape checked against the config, and
// sliced to what this rank computes under its ParallelPlan. Only the slices are paged in.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "moex/base/tensor.h"
#include "moex/model/config.h"
#include "moex/model/safetensors.h"
#include "moex/moe/moe_layer.h"
#include "moex/moe/parallel_plan.h"

namespace moex {

struct LayerWeights {
  TensorView input_norm;  // [d]
  TensorView wq;          // [H_local*hd, d]   this rank's query heads
  TensorView wk;          // [KV_local*hd, d]
  TensorView wv;          // [KV_local*hd, d]
  TensorView wo;          // [d, H_local*hd]   a column slice under attention TP (strided)
  TensorView bq, bk, bv;  // [H_local*hd], [KV_local*hd] q/k/v_proj biases (qwen2_moe), else empty
  TensorView q_norm, k_norm;  // per head: [hd] (qwen3_moe, dots1); whole: [H*hd], [KV*hd] (olmoe); else empty
  TensorView post_norm;   // [d]
  bool is_moe = true;     // false: a dense layer (mlp below), no router or experts
  MoELayerWeights moe;    // router [E, d] and this rank's experts / expert slices
  // Shared expert(s) of a MoE layer (qwen2_moe, dots1) or the dense MLP of a dense layer: gate/up [I_s, d],
  // down [d, I_s], whole on every rank (replicated under every plan). Empty when the layer has none.
  ExpertWeights mlp;
  TensorView shared_gate;  // [1, d] qwen2_moe's shared_expert_gate, else empty
};

struct MixtralWeights {
  std::unique_ptr<WeightStore> store;  // owns the mappings the views point into
  // Column slices under TP (w2, o_proj) copied out of the mapping: a strided slice would keep whole pages
  // of the other ranks' columns resident, so a rank's memory would not fall as 1/N.
  std::vector<std::vector<uint8_t>> owned;
  TensorView embed;       // [V, d]
  std::vector<LayerWeights> layers;
  TensorView final_norm;  // [d]
  TensorView lm_head;     // [V, d] (the embedding when tie_word_embeddings)
  int heads_local = 0, kv_heads_local = 0;
  int64_t intermediate_local = 0;
  double pack_seconds = 0.0;  // quantizing and packing the experts at load (0 when as stored)
};

// Reads every value of every floating-point tensor (`--check-weights`, a full pass over the files) and throws
// Error(kInvalidInput) naming the first tensor, in name order, that holds a NaN or an infinity, and where.
void check_weights_finite(const WeightStore& store);

// Throws Error(kInvalidInput) naming the tensor for a missing tensor, a wrong shape or an unsupported dtype.
// With a packed `experts` format, every local expert is quantized and packed once here (layers[l].moe.packed).
MixtralWeights load_mixtral_weights(const std::string& model_dir, const ModelConfig& config,
                                    const ParallelPlan& plan = ParallelPlan{},
                                    const ExpertWeightFormat& experts = ExpertWeightFormat{});

}  // namespace moex
