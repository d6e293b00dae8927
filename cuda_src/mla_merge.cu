// The split merge of an MLA call with several splits, launched after paged_mla_mma / paged_mla_wgmma
// (programmatic dependent launch: every CTA waits for the attention grid before it reads). The attention
// CTAs of a split tile wrote fp32 partial states (part_o (rows x num_splits x 512), part_ml) and its split
// 0 the tile's record (mla.cuh: MlaTileRecord; zero for tiles of one split, which wrote their rows
// directly, and for gaps between sequences). CTA (x, y), warp w: row y * MLA_MERGE_WARPS + w of tile x's
// record, merged over its splits in split order (epilogue.cuh: merge_row, the same arithmetic for every
// row and call) into the output row (times the latent V scale for fp8 caches) and lse when asked. Spread
// over (num_tiles x rows / MLA_MERGE_WARPS) CTAs, the partials are read at the GPU's bandwidth, not one
// SM's, and the attention CTAs need no arrival counting.
// Reads: the records, part_ml, part_o (from L2, where the attention kernel just wrote them), k_scale.
// Writes: out (N, H * 512), lse (N, H). Launch: grid (num_tiles, tile rows / MLA_MERGE_WARPS), 256 threads.
#include "common.cuh"
#include "epilogue.cuh"
#include "mla.cuh"

constexpr int MLA_MERGE_WARPS = 8;

template <typename T>
__global__ void __launch_bounds__(MLA_MERGE_WARPS * 32) paged_mla_merge(
    const MlaTileRecord* __restrict__ records, const float* __restrict__ part_o, const float2* __restrict__ part_ml,
    const float* __restrict__ k_scale, T* __restrict__ out, float* __restrict__ lse, int num_splits, int k_quant) {
  grid_dependency_wait();  // the records and partial states come from the attention kernel
  const MlaTileRecord rec = records[blockIdx.x];
  const int r = (int)blockIdx.y * MLA_MERGE_WARPS + (threadIdx.x >> 5);
  if (rec.count < 2 || r >= rec.rows) return;  // the whole warp
  merge_row<T, MLA_DV / 32>(0, 0, rec.row0 + r, 0, rec.count, MLA_DV, 0, num_splits, (const T*)nullptr, k_scale,
                            k_quant, out, part_o, part_ml, lse);  // (row = global row rec.row0 + r, t = 0)
}
