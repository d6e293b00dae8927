// The split merge of an MLA call with several splits, launched after paged_mla_mma / paged_mla_wgmma
// (programmatic dependent launch: every CTA waits for the attention grid before it reads). The attention
// CTAs of a split tile wrote fp32 partial states (part_o (rows x num_splits x 512), part_ml) and its split
// 0 the tile's record (mla.cuh: MlaTileRecord; zero for tiles of one split, which wrote their rows
// directly, and for gaps between sequences). Every split below a record's count ran and wrote every
// owned row's state (finite: an empty row is (-inf, 0) with o = 0). CTA (x, y), warp w: row
// y * MLA_MERGE_WARPS + w of tile x's record. Lanes take the splits' (M, L) for the row's max, sum and
// weights (a fixed xor tree), then lane l sums channels 4 l + 128 k (k < 4) over the splits in index
// order, MLA_MERGE_BATCH splits' 16-byte loads in flight at once (the first batch's issued with the
// (m, l) loads: a call of at most MLA_MERGE_BATCH splits reads a row in one round trip), into the output
// row (times the latent V scale for fp8 caches; the same arithmetic for every row and call) and lse when
// asked. Spread over (num_tiles x rows / MLA_MERGE_WARPS) CTAs, the partials are read at the GPU's
// bandwidth, not one SM's, and the attention CTAs need no arrival counting.
// Reads: the records, part_ml, part_o (from L2, where the attention kernel just wrote them), k_scale.
// Writes: out (N, H * 512), lse (N, H). Launch: grid (num_tiles, tile rows / MLA_MERGE_WARPS), 256 threads.
#include "common.cuh"
#include "mla.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int MLA_MERGE_WARPS = 8;
constexpr int MLA_MERGE_BATCH = 8;  // splits whose partial rows are loaded together (divides 32)

template <typename T>
__global__ void __launch_bounds__(MLA_MERGE_WARPS * 32) paged_mla_merge(
    const MlaTileRecord* __restrict__ records, const float* __restrict__ part_o, const float2* __restrict__ part_ml,
    const float* __restrict__ k_scale, T* __restrict__ out, float* __restrict__ lse, int num_splits, int k_quant) {
  grid_dependency_wait();  // the records and partial states come from the attention kernel
  const MlaTileRecord rec = records[blockIdx.x];
  const int r = (int)blockIdx.y * MLA_MERGE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (rec.count < 2 || r >= rec.rows) return;  // the whole warp
  const int n = rec.count;
  const long long row = rec.row0 + (long long)r;
  const float2* ml = part_ml + row * num_splits;
  const float4* po = reinterpret_cast<const float4*>(part_o + row * num_splits * MLA_DV);
  float4 v[MLA_MERGE_BATCH][4];  // splits s0 .. s0 + MLA_MERGE_BATCH - 1: channels 4 lane + 128 k
  auto load = [&](int s0) {
#pragma unroll
    for (int j = 0; j < MLA_MERGE_BATCH; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        v[j][k] = s0 + j < n ? __ldcg(po + (long long)(s0 + j) * (MLA_DV / 4) + lane + 32 * k)
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  };
  // The first batch's partial rows and the first 32 splits' (m, l) in one round trip: the loads need no weight.
  load(0);
  const float2 mine = lane < n ? __ldcg(ml + lane) : make_float2(CUPA_NEG_INF, 0.0f);
  float M = mine.y > 0.0f ? mine.x : CUPA_NEG_INF;
  for (int i = lane + 32; i < n; i += 32) {
    const float2 t = __ldcg(ml + i);
    if (t.y > 0.0f) M = fmaxf(M, t.x);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  float L = 0.0f, O[4][4] = {};
  for (int base = 0; base < n; base += 32) {
    const float2 t = base == 0 ? mine : base + lane < n ? __ldcg(ml + base + lane) : make_float2(CUPA_NEG_INF, 0.0f);
    float c = 0.0f;  // split base + lane's weight (0: none, or no admitted key)
    if (t.y > 0.0f) {
      c = rescale(t.x, M);
      L += t.y * c;
    }
    const int count = min(32, n - base);
    for (int j0 = 0; j0 < count; j0 += MLA_MERGE_BATCH) {
      if (base + j0 > 0) load(base + j0);
#pragma unroll
      for (int j = 0; j < MLA_MERGE_BATCH; ++j) {
        const float cj = __shfl_sync(0xffffffffu, c, j0 + j);  // (0 past count: those lanes hold no split)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          O[k][0] += cj * v[j][k].x;
          O[k][1] += cj * v[j][k].y;
          O[k][2] += cj * v[j][k].z;
          O[k][3] += cj * v[j][k].w;
        }
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
  if (lse != nullptr && lane == 0) lse[row] = state_lse(M, L);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int ch = 4 * lane + 128 * k;
    T v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float vs = k_quant ? quant_scale(k_scale, k_quant, 0, MLA_DV, ch + e) : 1.0f;
      v[e] = Act<T>::from_float(finalize(M, L, O[k][e], false, 0.0f, vs));
    }
    *reinterpret_cast<uint2*>(out + row * MLA_DV + ch) = *reinterpret_cast<const uint2*>(v);
  }
}
