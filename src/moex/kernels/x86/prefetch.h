// Software prefetch of a call's weight stream into L2, a fixed distance ahead of the reads. Baseline SSE only, so
// every x86 kernel file (AVX2, AVX-512, AMX) can include it.
//
// Why by hand: a packed matrix is read once per call at decode, sequentially, and on Intel the hardware prefetchers
// alone leave the few-row loops well short of the read probe; a short fixed lead closes most of it, where a whole
// panel ahead does not (docs/kernels.md "Prefetch distance" has the figures).
//
// Not in the bf16 and W8A8 few-row loops on AMD, but for W8A8's short one-row calls and bf16 from two rows on Zen 5
// (bf16_stream_lead below): there the hardware prefetchers alone stream those loops faster than with the software
// lead, so they run a tile without it (g_stream_prefetch, stream_prefetch_for below). MOEX_STREAM_PREFETCH=on|off|auto
// overrides the default: the A/B switch.
#pragma once
#include <xmmintrin.h>

#include <cstdint>

namespace moex::kernels::x86 {

// 8 KB: 8, 16 and 32 KB measured alike (8 by a few percent at 4 rows); the AMX kernel, whose k step reads 4 KB at
// once, keeps its own 32 KB (expert_gemm_amx.cc).
constexpr int64_t kStreamLead = 8 << 10;

// Whether the W8A8 few-row loop (and int4-w4a8's one-row calls; bf16: bf16_stream_lead) call prefetch_ahead:
// MOEX_STREAM_PREFETCH if on / off, else (auto; unset; a bad value, which validate_kernel_environment refuses at
// load) not on AMD CPUs and yes on others. Set once before main
// (formats.cc, compiled for the baseline ISA). The few-row loops read it once per call and run a tile
// instantiated with or without prefetch_ahead: tested inside the k loop, a function-local static (its guard may
// call into the runtime) made GCC 12 keep the tiles' accumulators on the stack, and a plain global made it drop
// the prefetches from the tiles altogether (both seen in the disassembly).
extern bool g_stream_prefetch;
// MOEX_STREAM_PREFETCH as read once before main (formats.cc): 1 on, 0 off, -1 auto or unset.
extern const int g_stream_prefetch_env;
// AMD Zen 5 (CPUID vendor AuthenticAMD, family 1Ah), read once before main (formats.cc).
extern const bool g_cpu_is_zen5;

// Whether a bf16 or W8A8 few-row call issues prefetch_ahead, from its shape: `rows` (tokens) and `bytes` (the weight
// bytes of its panel run). MOEX_STREAM_PREFETCH=on|off decides everywhere; otherwise, where the CPU's default
// (g_stream_prefetch) is on, yes; where it is off (AMD), only for a one-row stream of at most `short_stream` bytes,
// which starts cold and may end before the hardware prefetchers have ramped up. The W8A8 loop passes
// kPrefetchShortStream: Qwen3-30B-A3B's batch 16 runs one row per expert in calls of ~200 KB (`down`: every expert
// over a few panels) to 3 MB (gate/up: one expert), short enough that the stream would start cold, and the prefetch
// costs them nothing; Mixtral's one-row calls (batch 1) stream 7 MB and more, long enough for the hardware
// prefetchers, which then run faster alone (docs/kernels.md, "Real shapes"). The bf16 loop decides by
// bf16_stream_lead (on Zen 4 never: there the hardware prefetchers alone were faster at one row and on every
// many-row stream; docs/kernels.md, "Prefetch distance"). Read once per call, outside the k loops (see
// g_stream_prefetch).
constexpr int64_t kPrefetchShortStream = int64_t{4} << 20;
inline bool stream_prefetch_for(int64_t rows, int64_t bytes, int64_t short_stream) {
  const bool forced = g_stream_prefetch_env >= 0;
  return g_stream_prefetch || (!forced && rows <= 1 && bytes <= short_stream);
}

// The `lines` cache lines `lead` bytes (kStreamLead unless given) after `read`, those before `end` (the call's
// last weight byte: the panels after it are another call's, often another thread's).
inline void prefetch_ahead(const void* read, const void* end, int lines, int64_t lead = kStreamLead) {
  const char* p = static_cast<const char*>(read) + lead;
  for (int i = 0; i < lines && p < static_cast<const char*>(end); ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
}

// The bf16 few-row loop on Zen 5: 32 KB ahead. Its 4-row tile (16 vdpbf16ps per 256 weight bytes, each waiting
// on its load) fills the FP scheduler long before the out-of-order window reaches the lines the hardware
// prefetchers have not yet asked for, so the loop waits on the first weight load of each k pair; a lead well past
// the window pulls those lines in (docs/kernels.md, "Prefetch distance", compares the distances). On Zen 4 no lead
// was better, so there it stays off (g_stream_prefetch).
constexpr int64_t kStreamLeadZen5Bf16 = 32 << 10;

// The bf16 few-row loop's prefetch distance for a call of `rows` rows, 0 for none. MOEX_STREAM_PREFETCH=off: none;
// =on: kStreamLead, on Zen 5 kStreamLeadZen5Bf16; otherwise (auto) on Zen 5 kStreamLeadZen5Bf16 from two rows (a
// one-row tile, 4 vdpbf16ps per 256 bytes, leaves the out-of-order window free to reach ahead by itself), elsewhere
// kStreamLead where the CPU's default (g_stream_prefetch) is on and none where it is off (other AMD CPUs). Read once
// per call.
inline int64_t bf16_stream_lead(int64_t rows) {
  const int env = g_stream_prefetch_env;
  if (env == 0) return 0;
  if (g_cpu_is_zen5) return env == 1 || rows >= 2 ? kStreamLeadZen5Bf16 : 0;
  return g_stream_prefetch ? kStreamLead : 0;
}

// The many-row GEMMs compute a K block token tile by token tile from L2 while the next block comes from memory:
// `lines` lines from `from` on, spread evenly over a tile's `steps` k steps (one next() per step), so the stream
// runs during every tile's arithmetic rather than in a burst during the first (which left the later tiles'
// arithmetic outside the stream: a call took the memory time plus the arithmetic).
struct SpreadPrefetch {
  const char* from;
  int64_t lines, steps, owed = 0;
  void next() {
    for (owed += lines; owed >= steps && steps > 0; owed -= steps, from += 64) _mm_prefetch(from, _MM_HINT_T1);
  }
};

}  // namespace moex::kernels::x86
