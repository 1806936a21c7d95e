// AWQ W4A16 prefill on Hopper: the tile configurations' shapes, the choice of one for a call,
// and the token padding.  Plain C++ (no CUDA, no torch, no CUTLASS), so that
// tests/test_awq_sm90_choice.py compiles and checks it on a CPU.
#pragma once

#include <cstdint>

namespace quantfuse {
namespace awq_sm90 {

// Tile configurations (awq_gemm_sm90.cuh: ConfigAt lists the same tiles) and the wave cost
// model that chooses one.  A persistent kernel's time ~ (waves of tiles over the SMs) x
// (time of one wave of that tile); per-wave times measured on an H100 at K = 4096 (µs, fp16,
// group 128; each configuration's time scales alike with K).
// * Stream-K configurations (4: 128 x 128; 11: 128 x 256; 12: 128 x 192) spread the K loop of
//   the tiles over all SMs: fractional waves plus a fixed cost for the partial-tile reduction,
//   which does not grow with K.  They fill the part-empty last wave that data-parallel tiles
//   leave (4096 x 14336 at M = 1152: 160 tiles of 128 x 256 on 132 SMs).
// * A token tile reaching past M (zero-filled by TMA, or padded) costs (1 + 0.375 x the
//   wasted fraction of M): such tiles run slower than full ones.
// * Token tiles wider than 128 only above 128 tokens: below, one 128-token tile covers M and
//   a wider one only adds padding (28672 x 4096 at M = 48-128 took 66-70 µs with 128 x 160
//   tiles against 61-62 with 64 x 128).
// * Token tiles narrower than 128 only up to their width: above it each weight tile is read by
//   two CTAs (6144 x 4096 at M = 65-128: 28-30 µs with 64 x 64 tiles against 17-19 with
//   64 x 128).
// The per-wave times of configs 0-12 are fitted to a sweep of all of them forced at
// M = 128..4096 on the four Llama shapes, two repeats, fresh x per input set
// (benchmarks/dev/bench_awq_sm90_configs.py --fresh-x).  On that sweep the choice is within 5% of
// the fastest configuration at 64 of the 72 points, 0.9% slower summed and at most 15%
// (28672 x 4096 at M = 320); without configs 11 and 12 it would be 2.3% slower summed and at
// most 24%.
// * Config 13 (64 x 64, at most 64 tokens) was measured on an H200 against configs 1 and 4 at
//   M = 33..128, the four shapes, two repeats: 14.3 µs per wave (13.3-17.6).  Its 17.5 keeps
//   it where it is fastest (4096 x 4096, 6144 x 4096: 15.6 µs against 18.6 with config 1
//   padded; 28672 x 4096: 54, as stream-K) and leaves 4096 x 14336, where stream-K over
//   128 x 128 tiles takes 38 µs against 46.5, to config 4.
struct TileCost {
  int rows, tokens;
  bool k128;        // needs K % 128 == 0 and group_size % 128 == 0 (or per-channel)
  bool stream_k;    // the stream-K scheduler: fractional waves plus a fixed fixup time
  double wave_us;   // time of one wave of tiles at K = 4096
  double fixup_us;  // stream-K's partial-tile reduction (does not grow with K)
};
constexpr int kNumConfigs = 14;
constexpr double kWasteWeight = 0.375;
constexpr TileCost kCosts[kNumConfigs] = {
    {64, 128, false, false, 19.0, 0.0},  {64, 128, true, false, 16.4, 0.0},   {64, 256, false, false, 25.5, 0.0},
    {128, 256, false, false, 41.4, 0.0}, {128, 128, false, true, 32.1, 10.0}, {64, 160, true, false, 19.4, 0.0},
    {64, 192, true, false, 19.9, 0.0},   {64, 224, true, false, 24.8, 0.0},   {128, 160, false, false, 32.3, 0.0},
    {128, 192, false, false, 31.5, 0.0}, {128, 224, false, false, 40.9, 0.0}, {128, 256, false, true, 42.0, 15.0},
    {128, 192, false, true, 32.5, 15.0}, {64, 64, true, false, 17.5, 0.0},
};

// Tokens per tile of a configuration (the kernel's N tile).
constexpr int64_t token_tile(int config) { return kCosts[config].tokens; }

// The cost model's time (µs) of a call of M tokens under configuration `config`.
inline double estimated_us(int config, int64_t M, int64_t N, int64_t K, int64_t sms) {
  const TileCost& t = kCosts[config];
  const int64_t token_tiles = (M + t.tokens - 1) / t.tokens;
  const int64_t tiles = ((N + t.rows - 1) / t.rows) * token_tiles;
  const double waves = t.stream_k ? double(tiles) / double(sms) : double((tiles + sms - 1) / sms);
  const double waste = M > 0 ? double(token_tiles * t.tokens - M) / double(M) : 0.0;
  return (waves * t.wave_us * double(K) / 4096.0 + t.fixup_us) * (1.0 + kWasteWeight * waste);
}

// The configuration that runs by default (sm_count 0: an H100's 132).
inline int choose_config(int64_t M, int64_t N, int64_t K, int group_size, int sm_count) {
  const int64_t sms = sm_count > 0 ? sm_count : 132;
  const bool k128_ok = K % 128 == 0 && (group_size == K || group_size % 128 == 0);
  int best = 0;
  double best_cost = -1.0;
  for (int c = 0; c < kNumConfigs; ++c) {
    const TileCost& t = kCosts[c];
    if ((t.k128 && !k128_ok) || (M <= 128 && t.tokens > 128) || (t.tokens < 128 && M > t.tokens)) continue;
    const double cost = estimated_us(c, M, N, K, sms);
    if (best_cost < 0.0 || cost < best_cost) best = c, best_cost = cost;
  }
  return best;
}

// The token count to run a call of M tokens at.  A token tile that reaches past the last row
// of x is filled by TMA's out-of-bounds zero fill, and on the H100 such tiles cost far more
// than full ones: 28672 x 4096 took 113 us at M = 33 and 65 at M = 128 (config 1), and
// 351 us at M = 300 against 162 with x padded to 512 rows (config 2).  So when at least 45%
// of the last tile would be past the end, the op copies x into a padded buffer of whole
// tiles and returns the first M rows of the result.  Below that fraction the copy measured
// slower than the zero fill (M = 200 and 1000 on the H100).
// The copy costs the host an allocation and a cudaMemcpyAsync (on the H100 a call takes 18-20 us
// of host time padded, 13 unpadded) and the GPU a copy (1.1-1.3 us), and pays only on calls long
// enough for the zero-filled tile's cost to exceed that: on the H100, 4096 x 4096 at M = 192 ran
// in 17.9 us padded against 23.9, 6144 x 4096 at M = 65 in 17.7 against 27.6, while at
// 2048 x 2048 and below (cost model 12 us or less) every padded call was 1.1-1.3 us slower on the
// GPU and 6 us on the host.  So a call the cost model puts under kPadMinUs runs on the
// zero-filled tile.
constexpr double kPadMinUs = 15.0;
inline int64_t padded_tokens(int64_t M, int64_t N, int64_t K, int config, int sm_count,
                             double min_us = kPadMinUs) {
  const int64_t tile = token_tile(config);
  const int64_t whole = (M + tile - 1) / tile * tile;
  if ((whole - M) * 100 < tile * 45) return M;
  return estimated_us(config, M, N, K, sm_count > 0 ? sm_count : 132) >= min_us ? whole : M;
}

}  // namespace awq_sm90
}  // namespace quantfuse
