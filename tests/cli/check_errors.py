#!/usr/bin/env python3
"""Bad input gets one clear line on stderr and a non-zero exit, never a crash or a hang.

Each case breaks one thing in a copy of a good checkpoint (or passes one bad flag) and checks the exit
code, that stderr is a single line naming the problem, and that nothing crashed (signals, sanitizer
reports).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    args.moex = os.path.abspath(args.moex)
    args.workdir = os.path.abspath(args.workdir)
    good = os.path.join(args.workdir, "good")
    if not os.path.exists(os.path.join(good, "config.json")):
        subprocess.run([args.moex, "gen-model", "--preset", "tiny", "--seed", "5", "--out", good], check=True,
                       capture_output=True)
    config = json.load(open(os.path.join(good, "config.json")))
    weights = open(os.path.join(good, "model.safetensors"), "rb").read()
    header_len = struct.unpack("<Q", weights[:8])[0]

    def variant(name, config_edit=None, weights_bytes=None, drop_weights=False):
        d = os.path.join(args.workdir, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        c = dict(config)
        if config_edit:
            config_edit(c)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
        if not drop_weights:
            with open(os.path.join(d, "model.safetensors"), "wb") as f:
                f.write(weights if weights_bytes is None else weights_bytes)
        shutil.copy(os.path.join(good, "tokenizer.model"), d)
        return d

    def replace_with(d, name, make):
        """Puts something other than a regular file at d/name: make(path) creates it."""
        path = os.path.join(d, name)
        if os.path.lexists(path):
            os.remove(path)
        make(path)
        return d

    def to_zero(path):
        os.symlink("/dev/zero", path)

    def sharded(d):
        """A one-shard index over the variant's weights: the loader reads model.safetensors.index.json."""
        h = json.loads(weights[8:8 + header_len])
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in h if k != "__metadata__"}}
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        return d

    def pop(key):
        return lambda c: c.pop(key)

    def put(key, value):
        return lambda c: c.__setitem__(key, value)

    def header_edit(fn):
        h = json.loads(weights[8:8 + header_len])
        fn(h)
        raw = json.dumps(h).encode()
        raw += b" " * ((8 - len(raw) % 8) % 8)
        return struct.pack("<Q", len(raw)) + raw + weights[8 + header_len:]

    first = sorted(k for k in json.loads(weights[8:8 + header_len]) if k != "__metadata__")[0]
    # Trained for 2e9 positions, so that only the memory check stands between a huge --max-seq-len and the
    # allocation.
    long_context = variant("lc", put("max_position_embeddings", 2000000000))
    # A directory where the default tuning table would be: an error, not a silent fallback to the cost model.
    cache_dir = os.path.join(args.workdir, "cache")
    os.makedirs(os.path.join(cache_dir, "comm-tuning.json"), exist_ok=True)
    tuning_fifo = os.path.join(args.workdir, "tuning.fifo")
    if os.path.lexists(tuning_fifo):
        os.remove(tuning_fifo)
    os.mkfifo(tuning_fifo)

    def shift_offsets(h):
        h[first]["data_offsets"] = [h[first]["data_offsets"][0] + 2, h[first]["data_offsets"][1] + 2]

    def grow_shape(h):
        h[first]["shape"] = [s * 2 for s in h[first]["shape"]]

    def bad_dtype(h):
        h[first]["dtype"] = "Q7"

    def drop_tensor(h):
        del h["model.norm.weight"]

    cases = [
        # (name, expected substring in the message, argv)
        ("model_type", "model_type", ["logits", "--model", variant("mt", put("model_type", "llama")), "--ids", "1", "--out", "x.npy"]),
        ("heads_divisibility", "not divisible", ["logits", "--model", variant("hd", lambda c: (c.update(hidden_size=65), c.pop("head_dim"))), "--ids", "1", "--out", "x.npy"]),
        ("missing_field", "hidden_size", ["logits", "--model", variant("mf", pop("hidden_size")), "--ids", "1", "--out", "x.npy"]),
        ("unknown_field", "unknown field", ["logits", "--model", variant("uf", put("moe_shared_expert", 4)), "--ids", "1", "--out", "x.npy"]),
        ("family_mla_refused", "multi-head latent attention", ["logits", "--model", variant("mla", put("model_type", "deepseek_v3")), "--ids", "1", "--out", "x.npy"]),
        ("family_fields_of_another", "unknown field \"head_dim\" for model_type \"qwen2_moe\"", ["logits", "--model", variant("qf", put("model_type", "qwen2_moe")), "--ids", "1", "--out", "x.npy"]),
        ("kv_heads", "num_key_value_heads", ["logits", "--model", variant("kv", put("num_key_value_heads", 3)), "--ids", "1", "--out", "x.npy"]),
        ("config_not_json", "not valid JSON", ["logits", "--model", variant("nj", put("x", 1)), "--ids", "1", "--out", "x.npy"]),
        ("truncated_weights", "truncated", ["logits", "--model", variant("tr", weights_bytes=weights[:len(weights) // 2]), "--ids", "1", "--out", "x.npy"]),
        ("tiny_file", "too short", ["logits", "--model", variant("ts", weights_bytes=weights[:5]), "--ids", "1", "--out", "x.npy"]),
        ("huge_header_length", "header length", ["logits", "--model", variant("hh", weights_bytes=struct.pack("<Q", 1 << 60) + weights[8:]), "--ids", "1", "--out", "x.npy"]),
        ("garbage_header", "JSON", ["logits", "--model", variant("gh", weights_bytes=weights[:8] + b"{" * header_len + weights[8 + header_len:]), "--ids", "1", "--out", "x.npy"]),
        ("overlapping_offsets", "overlap", ["logits", "--model", variant("ov", weights_bytes=header_edit(shift_offsets)), "--ids", "1", "--out", "x.npy"]),
        ("shape_vs_bytes", "bytes", ["logits", "--model", variant("sb", weights_bytes=header_edit(grow_shape)), "--ids", "1", "--out", "x.npy"]),
        ("unknown_dtype", "dtype", ["logits", "--model", variant("ud", weights_bytes=header_edit(bad_dtype)), "--ids", "1", "--out", "x.npy"]),
        ("missing_tensor", "model.norm.weight", ["logits", "--model", variant("mi", weights_bytes=header_edit(drop_tensor)), "--ids", "1", "--out", "x.npy"]),
        ("no_weights", "model.safetensors", ["logits", "--model", variant("nw", drop_weights=True), "--ids", "1", "--out", "x.npy"]),
        ("no_model_dir", "cannot read", ["logits", "--model", os.path.join(args.workdir, "nowhere"), "--ids", "1", "--out", "x.npy"]),
        ("token_out_of_vocab", "outside the vocabulary", ["logits", "--model", good, "--ids", f"1,{config['vocab_size']}", "--out", "x.npy"]),
        ("bad_ids", "--ids", ["logits", "--model", good, "--ids", "1,x,3", "--out", "x.npy"]),
        ("too_long_for_cache", "--max-seq-len", ["logits", "--model", good, "--ids", "1,2,3", "--decode", "10", "--max-seq-len", "8", "--out", "x.npy"]),
        ("unknown_flag", "--bogus", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--bogus"]),
        ("bad_router_fusion", "valid: none, topk_softmax, full", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--router-fusion", "fast"]),
        ("bad_top_p", "--top-p", ["generate", "--model", good, "--prompt", "hi", "--top-p", "1.5"]),
        ("bench_serve_bad_url", "expected http://HOST:PORT", ["bench", "serve", "--url", "localhost:8000"]),
        ("bench_serve_concurrency", "--concurrency", ["bench", "serve", "--concurrency", "0"]),
        ("bench_serve_unreachable", "initial test request failed", ["bench", "serve", "--url", "http://127.0.0.1:1", "--num-requests", "2"]),
        ("unknown_command", "frobnicate", ["frobnicate"]),
        # config.json: only exact integers within range, finite positive floats (nlohmann would truncate 1.9
        # to 1, read true as 1 and wrap 4294967808 to 512).
        ("int_given_as_float", "must be an integer", ["logits", "--model", variant("if", put("num_hidden_layers", 1.9)), "--ids", "1", "--out", "x.npy"]),
        ("int_given_as_bool", "wrong type (boolean)", ["logits", "--model", variant("ib", put("num_key_value_heads", True)), "--ids", "1", "--out", "x.npy"]),
        ("int_out_of_range", "out of range", ["logits", "--model", variant("ir", put("vocab_size", 4294967808)), "--ids", "1", "--out", "x.npy"]),
        ("rope_theta_overflows_float", "rope_theta", ["logits", "--model", variant("rf", put("rope_theta", 1e300)), "--ids", "1", "--out", "x.npy"]),
        ("eos_outside_vocab", "eos_token_id", ["logits", "--model", variant("eo", put("eos_token_id", config["vocab_size"])), "--ids", "1", "--out", "x.npy"]),
        # Files that are not regular files: refused before they are opened (a FIFO would block, /dev/zero never ends).
        ("config_fifo", "FIFO", ["logits", "--model", replace_with(variant("cf"), "config.json", os.mkfifo), "--ids", "1", "--out", "x.npy"]),
        ("config_dev_zero", "character device", ["logits", "--model", replace_with(variant("cz"), "config.json", to_zero), "--ids", "1", "--out", "x.npy"]),
        ("config_directory", "directory", ["logits", "--model", replace_with(variant("cd"), "config.json", os.mkdir), "--ids", "1", "--out", "x.npy"]),
        ("config_too_large", "16 MiB limit", ["logits", "--model", variant("cl"), "--ids", "1", "--out", "x.npy"]),
        ("index_fifo", "FIFO", ["logits", "--model", replace_with(variant("xf"), "model.safetensors.index.json", os.mkfifo), "--ids", "1", "--out", "x.npy"]),
        ("index_dev_zero", "character device", ["logits", "--model", replace_with(variant("xz"), "model.safetensors.index.json", to_zero), "--ids", "1", "--out", "x.npy"]),
        ("shard_fifo", "FIFO", ["logits", "--model", replace_with(sharded(variant("sf")), "model.safetensors", os.mkfifo), "--ids", "1", "--out", "x.npy"]),
        ("single_weights_fifo", "FIFO", ["logits", "--model", replace_with(variant("wf"), "model.safetensors", os.mkfifo), "--ids", "1", "--out", "x.npy"]),
        ("tokenizer_directory", "directory", ["generate", "--model", replace_with(variant("td"), "tokenizer.model", os.mkdir), "--prompt", "hi"]),
        ("tokenizer_fifo", "FIFO", ["generate", "--model", replace_with(variant("tf"), "tokenizer.model", os.mkfifo), "--prompt", "hi"]),
        # tokenizer.json, which a folder's tokenizer.model gives way to: the same file checks, then its contents.
        ("tokenizer_json_fifo", "FIFO", ["generate", "--model", replace_with(variant("jf"), "tokenizer.json", os.mkfifo), "--prompt", "hi"]),
        ("tokenizer_json_directory", "directory", ["generate", "--model", replace_with(variant("jd"), "tokenizer.json", os.mkdir), "--prompt", "hi"]),
        ("tokenizer_json_not_json", "tokenizer.json: not valid JSON", ["generate", "--model", replace_with(variant("jn"), "tokenizer.json", lambda p: open(p, "w").write('{"model": ')), "--prompt", "hi"]),
        ("tokenizer_json_wordpiece", 'model type "WordPiece" is not supported', ["generate", "--model", replace_with(variant("jw"), "tokenizer.json", lambda p: open(p, "w").write('{"model": {"type": "WordPiece"}}')), "--prompt", "hi"]),
        ("tuning_directory", "comm tuning table", ["generate", "--model", good, "--prompt", "hi"], {"MOEX_COMM_TUNING": args.workdir}),
        ("tuning_default_is_directory", "comm tuning table", ["generate", "--model", good, "--prompt", "hi"], {"MOEX_COMM_TUNING": "", "MOEX_CACHE_DIR": cache_dir}),
        ("tuning_flag_fifo", "comm tuning table", ["generate", "--model", good, "--prompt", "hi", "--comm-tuning", os.path.join(args.workdir, "tuning.fifo")]),
        # Sizes computed before allocating: positions past the model's, a KV cache the machine cannot hold
        # (1e9 positions x 3 sequences: 1.5 TB), steps no machine holds.
        ("seq_len_past_positions", "max_position_embeddings", ["logits", "--model", good, "--ids", "1", "--max-seq-len", "2000000", "--out", "x.npy"]),
        ("kv_cache_too_large", "lower --max-seq-len", ["generate", "--model", long_context, "--prompt", "a", "--prompt", "b", "--prompt", "c", "--max-seq-len", "1000000000"]),
        ("step_buffers_too_large", "lower --step-tokens", ["logits", "--model", good, "--ids", "1", "--step-tokens", "2000000000", "--out", "x.npy"]),
        ("roofline_buffer_too_large", "lower --buffer-mb", ["bench", "roofline", "--buffer-mb", "100000000", "--repeats", "1"]),
        # Flags and environment: bounded or rejected, in every command that takes them.
        ("capacity_factor_nan", "--capacity-factor", ["logits", "--model", good, "--ids", "1", "--capacity-factor", "nan", "--out", "x.npy"]),
        ("capacity_factor_inf", "--capacity-factor", ["generate", "--model", good, "--prompt", "hi", "--capacity-factor", "inf"]),
        ("batch_invariant_capacity", "--batch-invariant needs dropless", ["generate", "--model", good, "--prompt", "hi", "--batch-invariant", "--capacity-factor", "1"]),
        ("batch_variance_min_len", "--min-len", ["bench", "batch-variance", "--model", good, "--min-len", "0"]),
        ("bench_capacity_factor_nan", "--capacity-factor", ["bench", "moe-layer", "--hidden", "64", "--intermediate", "64", "--layers", "1", "--tokens", "1", "--capacity-factor", "nan"]),
        ("threads_too_many", "--threads 10000", ["logits", "--model", good, "--ids", "1", "--threads", "10000", "--out", "x.npy"]),
        ("threads_negative", "--threads -1", ["generate", "--model", good, "--prompt", "hi", "--threads", "-1"]),
        ("profile_threads", "--threads", ["profile", "--model", good, "--threads", "10000"]),
        ("bench_decode_threads", "--threads", ["bench", "decode", "--model", good, "--threads", "-3"]),
        ("bench_roofline_threads", "--threads", ["bench", "roofline", "--threads", "10000", "--buffer-mb", "1"]),
        ("bench_router_threads", "--threads", ["bench", "router", "--threads", "-1"]),
        ("bench_moe_layer_threads", "--threads", ["bench", "moe-layer", "--threads", "100000", "--hidden", "64", "--intermediate", "64", "--layers", "1", "--tokens", "1"]),
        ("env_threads_not_a_number", "MOEX_THREADS", ["logits", "--model", good, "--ids", "1", "--out", "x.npy"], {"MOEX_THREADS": "abc"}),
        ("env_threads_too_many", "MOEX_THREADS", ["bench", "router", "--tokens", "1"], {"MOEX_THREADS": "100000"}),
        ("env_isa_bogus", "MOEX_ISA", ["logits", "--model", good, "--ids", "1", "--out", "x.npy"], {"MOEX_ISA": "bogus"}),
        ("info_env_isa_bogus", "MOEX_ISA", ["info"], {"MOEX_ISA": "bogus"}),
        ("env_row_kernel_bogus", "MOEX_ROW_KERNEL", ["logits", "--model", good, "--ids", "1", "--weights", "bf16", "--out", "x.npy"], {"MOEX_ROW_KERNEL": "bogus"}),
        ("env_stream_prefetch_bogus", "MOEX_STREAM_PREFETCH", ["logits", "--model", good, "--ids", "1", "--weights", "bf16", "--out", "x.npy"], {"MOEX_STREAM_PREFETCH": "bogus"}),
        ("tp_zero", "--tp", ["logits", "--model", good, "--ids", "1", "--tp", "0", "--out", "x.npy"]),
        ("ep_zero", "--ep", ["logits", "--model", good, "--ids", "1", "--ep", "0", "--out", "x.npy"]),
        ("seed_negative", "--seed", ["generate", "--model", good, "--prompt", "hi", "--seed", "-1"]),
        ("seed_past_uint64", "--seed", ["generate", "--model", good, "--prompt", "hi", "--seed", "18446744073709551616"]),
        ("gen_model_seed_negative", "--seed", ["gen-model", "--preset", "tiny", "--out", "gs", "--seed", "-1"]),
        # An empty output path is a usage error in every command that writes one (tune-comm's cache kept here).
        ("gen_model_out_empty", "--out: the path is empty", ["gen-model", "--preset", "tiny", "--out", ""]),
        ("quantize_out_empty", "--out: the path is empty", ["quantize", "--model", good, "--weights", "int8", "--out", ""]),
        ("convert_out_empty", "--out: the path is empty", ["convert", "--model", good, "--out", ""]),
        ("logits_out_empty", "--out: the path is empty", ["logits", "--model", good, "--ids", "1", "--out", ""]),
        ("logits_tokens_out_empty", "--tokens-out: the path is empty", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--tokens-out", ""]),
        ("logits_stats_out_empty", "--stats-out: the path is empty", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--stats-out", ""]),
        ("generate_trace_empty", "--trace: the path is empty", ["generate", "--model", good, "--prompt", "hi", "--trace", ""]),
        ("generate_profile_json_empty", "--profile-json: the path is empty", ["generate", "--model", good, "--prompt", "hi", "--profile-json", ""]),
        ("tune_comm_out_empty", "--out: the path is empty", ["tune-comm", "--out", "", "--max-bytes", "64K", "--iters", "1"], {"MOEX_CACHE_DIR": args.workdir}),
        # One spelling of dtypes (f32, as the comm library, tuning tables and gen-model --dtype spell it).
        ("comm_dtype_fp32", "{f32,bf16,fp8}", ["logits", "--model", good, "--ids", "1", "--comm-dtype", "fp32", "--out", "x.npy"]),
        ("bench_router_skew_past_max", "--router-skew", ["bench", "moe-layer", "--hidden", "64", "--intermediate", "64", "--layers", "1", "--tokens", "1", "--router-skew", "17"]),
        # --weights: a known format, --group-size only for int4 and one of its sizes, no combination left half done.
        ("weights_unknown", "--weights: int5 not in", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--weights", "int5"]),
        ("group_size_without_int4", "--group-size applies to --weights int4 or int4-w4a8 only", ["generate", "--model", good, "--prompt", "hi", "--weights", "int8", "--group-size", "64"]),
        ("group_size_bad", "--group-size: 48 not in", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--weights", "int4", "--group-size", "48"]),
        ("weights_with_overlap", "--weights int8 is not supported with --overlap yet", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--weights", "int8", "--overlap"]),
        # --exact is --weights as-stored --dense-weights as-stored --kv-cache-dtype f32: another value given with it is refused.
        ("exact_contradicts_weights", "--exact runs the experts as stored; it contradicts --weights bf16", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--exact", "--weights", "bf16"]),
        ("exact_contradicts_dense_weights", "it contradicts --dense-weights int8", ["generate", "--model", good, "--prompt", "hi", "--dense-weights", "int8", "--exact"]),
        ("exact_contradicts_kv_cache_dtype", "it contradicts --kv-cache-dtype bf16", ["generate", "--model", good, "--prompt", "hi", "--exact", "--kv-cache-dtype", "bf16"]),
        ("bench_quality_exact", "not --exact", ["bench", "quality", "--model", good, "--exact"]),
        # Lists are parsed one way in every command: each item checked, the error naming it.
        ("bench_tokens_zero", "'0' is not a whole number in 1..", ["bench", "router", "--tokens", "1,0"]),
        ("bench_kernels_tokens_bad", "'x' is not a whole number", ["bench", "kernels", "--tokens", "x"]),
        ("bench_kernels_cycle_mb_zero", "--cycle-mb: Value 0 not in range", ["bench", "kernels", "--cycle-mb", "0"]),
        # moex plan: its inputs named, a cluster file's figure without a source refused, no file replaced.
        ("plan_without_cluster", "moex plan needs --model and --cluster", ["plan", "--model", "mixtral-8x7b"]),
        ("plan_unknown_model", "neither a checkpoint nor a preset", ["plan", "--model", "mixtral-9x9b", "--cluster", "bad_cluster.json"]),
        ("plan_cluster_not_json", "not JSON", ["plan", "--model", "mixtral-8x7b", "--cluster", "nj/config.json"]),
        ("plan_cluster_figure_without_source", "\"device.read_GBps\" has no \"source\"", ["plan", "--model", "mixtral-8x7b", "--cluster", "bad_cluster.json"]),
        ("plan_ranks_beyond_cluster", "--ranks 8", ["plan", "--model", "mixtral-8x7b", "--cluster", "one_device.json", "--ranks", "8"]),
        ("plan_calibrate_out_exists", "exists: give --force", ["plan", "calibrate", "--out", "one_device.json"]),
        ("plan_time_sharing_no_file", "does not exist", ["plan", "calibrate", "--out", "no_cluster.json", "--time-sharing"]),
        ("plan_old_wait_share", "run `moex plan calibrate --time-sharing` again", ["plan", "--model", "mixtral-8x7b", "--cluster", "old_sharing.json"]),
    ]
    # Cluster files for moex plan: one good (one device), one whose read rate has no source.
    def fig(v, src="test"):
        return {"value": v, "source": src} if src else {"value": v}
    cluster = {"hosts": 1, "devices_per_host": 1,
               "device": {"memory_GB": fig(10), "read_GBps": fig(10), "bf16_TFLOPS": fig(1), "int8_TOPS": fig(1),
                          "f32_TFLOPS": fig(1)},
               "links": {"intra_host": {"latency_us": fig(1), "bandwidth_GBps": fig(1)}}}
    with open(os.path.join(args.workdir, "one_device.json"), "w") as f:
        json.dump(cluster, f)
    # A file calibrated before the wait became a table per segment length: one share, refused with what to run.
    old = dict(cluster, time_sharing=[{"ranks_per_core": fig(1), "slowdown": fig(1), "wait_share": fig(0.1)}])
    with open(os.path.join(args.workdir, "old_sharing.json"), "w") as f:
        json.dump(old, f)
    cluster["device"]["read_GBps"] = fig(10, None)
    with open(os.path.join(args.workdir, "bad_cluster.json"), "w") as f:
        json.dump(cluster, f)
    # config_not_json: write broken JSON over the variant's config.
    with open(os.path.join(args.workdir, "nj", "config.json"), "w") as f:
        f.write('{"model_type": "mixtral", ')
    # config_too_large: a valid config padded past the 16 MiB limit for JSON files.
    with open(os.path.join(args.workdir, "cl", "config.json"), "w") as f:
        f.write(json.dumps(config) + " " * (16 << 20))

    # Runs that succeed but must say on one stderr line why they stopped short: (name, needle, argv).
    notes = [
        ("stopped_by_full_cache", "--max-seq-len 16", ["generate", "--model", good, "--prompt", "hello world", "-n", "100", "--max-seq-len", "16", "--ignore-eos"]),
    ]

    passed = failed = 0
    for name, needle, argv, *env in [(*c, 2) for c in cases] + [(*c, 0) for c in notes]:
        # The expected exit code rides last; a case may add environment variables before it.
        expected = env.pop()
        run_env = dict(os.environ, **(env[0] if env else {}))
        try:
            # Nothing here takes long; a case that blocks (a FIFO opened for reading) fails after 20 s.
            r = subprocess.run([args.moex, *argv], capture_output=True, text=True, timeout=20, cwd=args.workdir,
                               env=run_env)
        except subprocess.TimeoutExpired:
            print(f"FAIL {name}: hung for 20 s")
            failed += 1
            continue
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        problems = []
        if r.returncode != expected:
            problems.append(f"exit code {r.returncode}, expected {expected}")
        if len(lines) != 1:
            problems.append(f"stderr has {len(lines)} lines, expected 1")
        if needle not in r.stderr:
            problems.append(f"message does not mention {needle!r}")
        if problems:
            failed += 1
            print(f"FAIL {name}: {'; '.join(problems)}\n  stderr: {r.stderr.strip()[:500]}")
        else:
            passed += 1
            print(f"ok   {name}: {lines[0]}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
