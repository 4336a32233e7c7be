#!/usr/bin/python3
"""Self-test of the PyTorch reference (mixtral_ref.py), independent of the C++ engine.

The reference is checked against second, deliberately literal formulations: a token-by-token
decoder with an explicit KV cache, per-pair RoPE rotations and a dense "run every expert, mask by
routing" MoE with HF's softmax-then-renormalise router; plus crafted tie, capacity and loader cases.

Usage: /usr/bin/python3 tests/reference/selftest.py    (exit status 1 if any check fails)
"""

import collections
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_test_model  # noqa: E402
import mixtral_ref  # noqa: E402

TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def assert_close(actual, expected, rel_tol, what):
    """Max abs difference, relative to the largest |expected|, must be within rel_tol."""
    scale = max(float(expected.abs().max()), 1e-30)
    err = float((actual - expected).abs().max()) / scale
    assert err <= rel_tol, f"{what}: max relative difference {err:.3g} > {rel_tol:.3g}"


def build_model(dtype=torch.float64, seed=0, **config_overrides):
    """A small random model built in memory from make_test_model's weights."""
    sizes = dict(hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2, experts=4, top_k=2,
                 vocab=64)
    config = make_test_model.make_config(**dict(sizes, **config_overrides))
    weights = make_test_model.make_weights(config, seed)
    tensors = {name: torch.from_numpy(w) for name, w in weights.items()}
    return mixtral_ref.MixtralRef(mixtral_ref.MixtralConfig.from_dict(config), tensors, dtype)


def random_ids(model, count, seed):
    return torch.randint(model.cfg.vocab_size, (count,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------
# The literal second formulation: one token at a time, vectors only, explicit cache.
# ---------------------------------------------------------------------------------------------

def naive_rms_norm(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean() + eps)


def naive_rope(vec, pos, theta):
    """Rotates each pair (i, i + hd/2) by the angle pos * theta^(-2i/hd)."""
    half = vec.numel() // 2
    angle = pos * theta ** (-2.0 * torch.arange(half, dtype=vec.dtype) / vec.numel())
    a, b = vec[:half], vec[half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()])


def naive_attention_step(x, pos, layer, cfg, cache):
    """Attention output [d] for one token x [d] at `pos`, appending its keys/values to cache."""
    hd, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q, k, v = layer["wq"] @ x, layer["wk"] @ x, layer["wv"] @ x
    cache["k"].append([naive_rope(k[j * hd:(j + 1) * hd], pos, cfg.rope_theta)
                       for j in range(kv_heads)])
    cache["v"].append([v[j * hd:(j + 1) * hd] for j in range(kv_heads)])
    head_outputs = []
    for h in range(heads):
        q_h = naive_rope(q[h * hd:(h + 1) * hd], pos, cfg.rope_theta)
        j = h // (heads // kv_heads)
        scores = torch.stack([q_h.dot(keys[j]) for keys in cache["k"]]) / math.sqrt(hd)
        p = torch.exp(scores - scores.max())
        p = p / p.sum()
        head_outputs.append(sum(p[s] * values[j] for s, values in enumerate(cache["v"])))
    return layer["wo"] @ torch.cat(head_outputs)


def naive_expert(x, layer, e):
    gate = layer["w1"][e] @ x
    return layer["w2"][e] @ (gate / (1 + torch.exp(-gate)) * (layer["w3"][e] @ x))


def naive_moe_token(x, layer, cfg):
    """Dense MoE for one token: every expert runs, routing masks the sum (HF's router)."""
    probs = torch.softmax(layer["gate"] @ x, dim=0)
    top = torch.topk(probs, cfg.num_experts_per_tok)
    weights = top.values / top.values.sum() if cfg.norm_topk_prob else top.values
    out = torch.zeros_like(x)
    for e in range(cfg.num_local_experts):
        routing_weight = weights[top.indices == e].sum()
        out += routing_weight * naive_expert(x, layer, e)
    return out


def naive_logits(model, ids):
    """Token-major decoding with a per-layer KV cache, as an incremental engine runs it."""
    cfg = model.cfg
    caches = [{"k": [], "v": []} for _ in model.layers]
    rows = []
    for pos, tok in enumerate(ids):
        x = model.embed[tok].clone()
        for layer, cache in zip(model.layers, caches):
            x = x + naive_attention_step(naive_rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps),
                                         pos, layer, cfg, cache)
            x = x + naive_moe_token(naive_rms_norm(x, layer["ffn_norm"], cfg.rms_norm_eps),
                                    layer, cfg)
        rows.append(model.lm_head @ naive_rms_norm(x, model.norm, cfg.rms_norm_eps))
    return torch.stack(rows)


def literal_keep_mask(expert_ids, capacity):
    """Capacity admission as a plain loop: 1st choices in token order, then 2nd choices, ..."""
    num_tokens, k = expert_ids.shape
    accepted = collections.Counter()
    keep = torch.zeros(num_tokens, k, dtype=torch.bool)
    for j in range(k):
        for t in range(num_tokens):
            e = int(expert_ids[t, j])
            if accepted[e] < capacity:
                accepted[e] += 1
                keep[t, j] = True
    return keep


# ---------------------------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------------------------

@test
def safetensors_reader_on_handwritten_bytes():
    # Bytes built here, not by make_test_model, so the reader is not checked against its twin;
    # the header is deliberately unpadded and carries __metadata__.
    bf16_bits = [0x3F80, 0xC000, 0x3F81, 0x0000]  # 1, -2, 1 + 2^-7, 0
    f32_values = [0.5, -3.25, 1e-3]
    f16_one = 0x3C00
    data = (struct.pack("<4H", *bf16_bits) + struct.pack("<3f", *f32_values)
            + struct.pack("<H", f16_one))
    header = json.dumps({
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]},
        "c": {"dtype": "F16", "shape": [], "data_offsets": [20, 22]},
    }).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + data)
        tensors = mixtral_ref.read_safetensors(path)
    assert sorted(tensors) == ["a", "b", "c"], sorted(tensors)
    assert tensors["a"].tolist() == [[1.0, -2.0], [1.0078125, 0.0]], tensors["a"]
    assert tensors["b"].tolist() == torch.tensor(f32_values, dtype=torch.float32).tolist()
    assert tensors["c"].shape == () and float(tensors["c"]) == 1.0, tensors["c"]


@test
def safetensors_reader_rejects_bad_files():
    cases = {
        "I8": {"x": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}},
        "data_offsets": {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for expected_word, entries in cases.items():
            path = os.path.join(tmp, "bad.safetensors")
            header = json.dumps(entries).encode()
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(header)) + header + bytes(8))
            try:
                mixtral_ref.read_safetensors(path)
            except ValueError as err:
                assert expected_word in str(err), err
            else:
                raise AssertionError(f"accepted a file with bad {expected_word}")


@test
def bf16_writer_rounds_to_nearest_even():
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.0, 1.0 + 2**-8 + 2**-20],
                      dtype=np.float32)
    bits = make_test_model.float32_to_bf16_bits(values).tolist()
    # Halfway cases go to the even mantissa; just above halfway rounds up.
    assert bits == [0x3F80, 0x3F80, 0x3F82, 0xC000, 0x3F81], [hex(b) for b in bits]


@test
def checkpoint_roundtrip_all_dtypes_sharded_and_tied():
    config = make_test_model.make_config(hidden=16, intermediate=24, layers=2, heads=2,
                                         kv_heads=1, experts=3, top_k=2, vocab=20)
    weights = make_test_model.make_weights(config, seed=1)
    stored_as = {
        "bf16": lambda w: make_test_model.float32_to_bf16_bits(w).astype(np.uint32) << 16,
        "f16": lambda w: w.astype(np.float16).astype(np.float32),
        "f32": lambda w: w,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, rounded in stored_as.items():
            for shards in (1, 3):
                out = os.path.join(tmp, f"{dtype}-{shards}")
                make_test_model.write_model(out, config, weights, dtype, shards)
                tensors = mixtral_ref.read_checkpoint(out)
                assert sorted(tensors) == sorted(weights), f"{dtype}/{shards}: tensor names differ"
                for name, w in weights.items():
                    expected = np.asarray(rounded(w)).view(np.float32)
                    assert np.array_equal(tensors[name].numpy(), expected), \
                        f"{dtype}/{shards}: {name}"
        tied_config = dict(config, tie_word_embeddings=True)
        tied_weights = make_test_model.make_weights(tied_config, seed=1)
        out = os.path.join(tmp, "tied")
        make_test_model.write_model(out, tied_config, tied_weights, "f32", shards=2)
        model = mixtral_ref.load_model(out)
        assert "lm_head.weight" not in tied_weights
        assert torch.equal(model.lm_head, model.embed), "tied lm_head is not the embedding"
        assert model.cfg.head_dim == 8 and model.cfg.norm_topk_prob is True, model.cfg


# ---------------------------------------------------------------------------------------------
# (a) Reference against the literal formulation
# ---------------------------------------------------------------------------------------------

@test
def attention_full_sequence_matches_token_by_token_cache():
    for overrides in ({}, {"kv_heads": 1, "head_dim": 6}, {"kv_heads": 4}):
        model = build_model(**overrides)
        cfg, layer = model.cfg, model.layers[1]
        x = torch.randn(9, cfg.hidden_size, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(2))
        cos, sin = mixtral_ref.rope_cos_sin(9, cfg.head_dim, cfg.rope_theta, torch.float64)
        full = mixtral_ref.attention(x, layer, cfg, cos, sin)
        cache = {"k": [], "v": []}
        stepwise = torch.stack([naive_attention_step(x[t], t, layer, cfg, cache)
                                for t in range(9)])
        assert_close(full, stepwise, 1e-12, f"attention {overrides}")


@test
def moe_dispatch_matches_dense_masked_experts():
    for overrides in ({}, {"experts": 5, "top_k": 3, "norm_topk_prob": False}, {"top_k": 1}):
        model = build_model(**overrides)
        cfg, layer = model.cfg, model.layers[0]
        x = torch.randn(40, cfg.hidden_size, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(3))
        dispatched, stats = mixtral_ref.moe(x, layer, cfg)
        dense = torch.stack([naive_moe_token(x[t], layer, cfg) for t in range(40)])
        assert_close(dispatched, dense, 1e-12, f"moe {overrides}")
        assert stats["drops"] == 0, stats
        assert sum(stats["tokens_per_expert"]) == 40 * cfg.num_experts_per_tok, stats


@test
def model_matches_naive_incremental_decoder():
    configs = ({}, {"kv_heads": 1, "head_dim": 6, "top_k": 1},
               {"kv_heads": 4, "experts": 5, "top_k": 3, "norm_topk_prob": False})
    for overrides in configs:
        model = build_model(seed=4, **overrides)
        ids = random_ids(model, 8, seed=5)
        assert_close(mixtral_ref.logits_for(model, ids), naive_logits(model, ids), 1e-10,
                     f"logits {overrides}")


# ---------------------------------------------------------------------------------------------
# (b) Ties
# ---------------------------------------------------------------------------------------------

@test
def router_ties_go_to_lower_expert_index():
    cases = [  # (logits, k, norm_topk_prob, expected ids, expected weights)
        ([1.0, 3.0, 3.0, 0.0, 3.0], 2, True, [1, 2], [0.5, 0.5]),
        ([0.0, 0.0, 0.0, 0.0], 3, True, [0, 1, 2], [1 / 3] * 3),
        ([5.0, 2.0, 2.0, 2.0], 2, True, [0, 1], [1 / (1 + math.exp(-3)), 1 / (1 + math.exp(3))]),
        ([-1.0, 7.0, -1.0, 7.0], 3, True, [1, 3, 0], None),
        ([-0.0, 0.0], 1, True, [0], [1.0]),
        ([0.0, 0.0, 0.0, 0.0], 2, False, [0, 1], [0.25, 0.25]),
    ]
    for logits, k, norm, expected_ids, expected_weights in cases:
        ids, weights = mixtral_ref.route(torch.tensor([logits], dtype=torch.float64), k, norm)
        assert ids[0].tolist() == expected_ids, f"{logits} k={k}: ids {ids[0].tolist()}"
        if expected_weights is not None:
            expected = torch.tensor(expected_weights, dtype=torch.float64)
            assert torch.allclose(weights[0], expected), f"{logits} k={k}: {weights[0].tolist()}"

    # Many ties at once, against a literal sort on (-logit, index).
    logits = torch.randint(0, 3, (200, 8), generator=torch.Generator().manual_seed(6)).double()
    ids, _ = mixtral_ref.route(logits, 3)
    for t in range(200):
        expected = sorted(range(8), key=lambda e: (-float(logits[t, e]), e))[:3]
        assert ids[t].tolist() == expected, f"row {t}: {ids[t].tolist()} != {expected}"

    # End to end: a zero gate ties every expert, so every token picks experts 0..k-1.
    model = build_model()
    for layer in model.layers:
        layer["gate"].zero_()
    for stats in mixtral_ref.moe_drop_stats(model, random_ids(model, 6, seed=7)):
        assert stats["tokens_per_expert"] == [6, 6, 0, 0], stats


# ---------------------------------------------------------------------------------------------
# (c) Capacity
# ---------------------------------------------------------------------------------------------

@test
def capacity_formula():
    cases = [((2, 10, 8, 1.0), 3), ((2, 16, 4, 1.0), 8), ((2, 16, 4, 1.25), 10),
             ((1, 1, 8, 1.0), 1), ((2, 5, 8, 0.0), None), ((2, 5, 8, -1.0), None),
             ((2, 5, 8, None), None)]
    for args, expected in cases:
        got = mixtral_ref.expert_capacity(*args)
        assert got == expected, f"expert_capacity{args} = {got}, expected {expected}"


@test
def capacity_drops_on_skewed_gate():
    model = build_model(hidden=16)
    cfg, layer = model.cfg, model.layers[0]
    gen = torch.Generator().manual_seed(8)
    # Every token has a large positive feature 0 that experts 0 and 1 weigh heavily, so nearly all
    # tokens pick them and both overflow.
    x = torch.randn(32, 16, dtype=torch.float64, generator=gen)
    x[:, 0] = x[:, 0].abs() + 2.0
    layer["gate"] = 0.1 * torch.randn(4, 16, dtype=torch.float64, generator=gen)
    layer["gate"][0, 0], layer["gate"][1, 0] = 5.0, 3.0

    capacity = mixtral_ref.expert_capacity(2, 32, 4, 1.0)
    out, stats = mixtral_ref.moe(x, layer, cfg, capacity_factor=1.0)
    expected_drops = sum(max(0, count - capacity) for count in stats["tokens_per_expert"])
    assert stats["drops"] == expected_drops > 0, (stats, capacity)

    expert_ids, weights = mixtral_ref.route(x @ layer["gate"].t(), 2)
    keep = literal_keep_mask(expert_ids, capacity)
    assert torch.equal(mixtral_ref.capacity_keep_mask(expert_ids, 4, capacity), keep)
    # Dropped assignments contribute nothing; a token with both dropped gets exactly zero.
    expected = torch.stack([
        sum((weights[t, j] * naive_expert(x[t], layer, int(expert_ids[t, j]))
             for j in range(2) if keep[t, j]), torch.zeros(16, dtype=torch.float64))
        for t in range(32)])
    assert_close(out, expected, 1e-12, "capacity-limited moe")
    fully_dropped = ~keep.any(dim=1)
    assert fully_dropped.any(), "no token lost both assignments"
    assert torch.equal(out[fully_dropped], torch.zeros_like(out[fully_dropped]))

    # The vectorised mask agrees with the loop for every capacity on random routings too.
    random_routing = torch.randint(0, 4, (20, 2), generator=gen)
    for c in range(0, 41):
        assert torch.equal(mixtral_ref.capacity_keep_mask(random_routing, 4, c),
                           literal_keep_mask(random_routing, c)), f"capacity {c}"


@test
def capacity_in_the_full_model():
    model = build_model(seed=9)
    ids = random_ids(model, 16, seed=10)
    dropless = mixtral_ref.logits_for(model, ids)
    capacity = mixtral_ref.expert_capacity(2, 16, 4, 1.0)
    layer_stats = mixtral_ref.moe_drop_stats(model, ids, 1.0)
    for stats in layer_stats:
        overflow = sum(max(0, c - capacity) for c in stats["tokens_per_expert"])
        assert stats["drops"] == overflow, stats
        assert stats["drops"] == sum(stats["drops_per_expert"]), stats
    assert sum(s["drops"] for s in layer_stats) > 0, "no drops: the test checks nothing"
    assert not torch.equal(mixtral_ref.logits_for(model, ids, 1.0), dropless), "drops had no effect"
    for factor in (0.0, -1.0, 100.0):
        assert torch.equal(mixtral_ref.logits_for(model, ids, factor), dropless), factor
        assert all(s["drops"] == 0 for s in mixtral_ref.moe_drop_stats(model, ids, factor))
    # Capacity is per forward call: one-token calls give capacity ceil(k/E) = 1 and k distinct
    # experts per token, so nothing drops.
    one_token_calls, stats = mixtral_ref.forward(model, ids, 1.0, call_lengths=[1] * 16)
    assert torch.equal(one_token_calls, dropless) and all(s["drops"] == 0 for s in stats)
    # A prompt call of 8 sees capacity ceil(2*8/4) = 4 whatever calls follow it.
    two_calls = mixtral_ref.forward(model, ids, 1.0, call_lengths=[8, 8])[0]
    first_call_alone = mixtral_ref.logits_for(model, ids[:8], 1.0)
    assert not torch.equal(first_call_alone, dropless[:8]), "no drops in the first call"
    assert_close(two_calls[:8], first_call_alone, 1e-12, "first of two calls")


# ---------------------------------------------------------------------------------------------
# (d) Precision modes
# ---------------------------------------------------------------------------------------------

@test
def float32_matches_float64():
    ids = random_ids(build_model(), 16, seed=11)
    logits64 = mixtral_ref.logits_for(build_model(torch.float64), ids)
    logits32 = mixtral_ref.logits_for(build_model(torch.float32), ids)
    assert logits32.dtype == torch.float32
    assert_close(logits32.double(), logits64, 1e-4, "float32 vs float64 logits")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(HERE, "mixtral_ref.py"), *args],
                          capture_output=True, text=True)


@test
def cli_decode_rows_tokens_and_stats():
    with tempfile.TemporaryDirectory() as tmp:
        config = make_test_model.make_config(hidden=32, intermediate=48, vocab=64)
        make_test_model.write_model(tmp, config, make_test_model.make_weights(config, 12), "bf16")
        model = mixtral_ref.load_model(tmp)
        prompt = [3, 1, 4, 1, 5]
        logits_path, tokens_path, stats_path = (os.path.join(tmp, n)
                                                for n in ("l.npy", "t.txt", "s.json"))

        result = run_cli("--model", tmp, "--ids", "3,1,4,1,5", "--decode", "4",
                         "--out", logits_path, "--tokens-out", tokens_path)
        assert result.returncode == 0, result.stderr
        logits = np.load(logits_path)
        with open(tokens_path) as f:
            tokens = [int(line) for line in f]
        assert logits.shape == (9, 64) and logits.dtype == np.float32, logits.shape
        assert len(tokens) == 4, tokens
        # Row P-1+j predicts decoded token j+1, and the rows are those of one pass over everything.
        assert [int(np.argmax(logits[4 + j])) for j in range(4)] == tokens
        expected = mixtral_ref.logits_for(model, prompt + tokens)
        assert_close(torch.from_numpy(logits).double(), expected, 1e-6, "CLI logits")

        result = run_cli("--model", tmp, "--ids", "3,1,4,1,5", "--capacity-factor", "1.0",
                         "--out", logits_path, "--stats-out", stats_path)
        assert result.returncode == 0, result.stderr
        with open(stats_path) as f:
            report = json.load(f)
        assert report["capacity"] == 3 and report["num_tokens"] == 5, report
        assert report["layers"] == mixtral_ref.moe_drop_stats(model, prompt, 1.0), report
        assert_close(torch.from_numpy(np.load(logits_path)).double(),
                     mixtral_ref.logits_for(model, prompt, 1.0), 1e-6, "CLI capacity logits")

        result = run_cli("--model", tmp, "--ids", "3,64", "--out", logits_path)
        assert result.returncode != 0 and "outside the vocabulary" in result.stderr, result.stderr


def main():
    torch.set_num_threads(2)
    failed = 0
    for fn in TESTS:
        start = time.time()
        try:
            fn()
        except Exception as err:  # a crash is a failure, reported like one
            failed += 1
            print(f"FAIL {fn.__name__}: {type(err).__name__}: {err}")
        else:
            print(f"PASS {fn.__name__} ({time.time() - start:.1f}s)")
    print(f"{len(TESTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
