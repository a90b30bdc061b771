// The tiled paged prefill kernel (FlashAttention-2 style), templated on dtype and head size;
// the block size is a runtime shift. Included by prefill_attention_{f32,f16,bf16}.cu, each
// of which instantiates one dtype (5 head sizes).
//
// Grid and threads: blockIdx.x = query tile, blockIdx.y = kv_head * head_chunks + chunk.
// A thread block owns kPrefillRows = 64 query rows: q_per_tile query tokens of one sequence
// times heads_per_tile query heads of one GQA group (row r = query r / heads_per_tile, head
// r % heads_per_tile), so every K/V tile read from the paged cache serves all query heads
// of the group. Sequence s owns the virtual tiles [query_start_loc[s] / q_per_tile + s, ...),
// at least ceil(query_len / q_per_tile) of them (extra ones exit at once); a block finds its
// sequence by binary search on query_start_loc. blockIdx.x runs the tiles in reverse order
// (the later query tiles of a sequence see more context, so they start first). 128 threads = 4 warps; warp w owns rows
// [16 w, 16 w + 16), and its lanes hold the tile's scores S [16 x kTile] and output
// accumulators O [16 x head_size] in the m16n8 accumulator layout of mma.sync: lane
// (g = lane / 4, t = lane % 4) holds rows g and g + 8, columns 8 j + 2 t and 8 j + 2 t + 1.
//
// Per thread block: Q [64][hs] -> shared memory once; then for each KV tile of kTile tokens
// (64; 32 for head size 256) up to the last query's causal end, from the tile holding the
// first query's first windowed key when there is a sliding window (earlier tiles lie wholly
// outside every row's window and are skipped):
//  1. K tile -> shared [kTile][hs], V tile -> shared [hs][kTile], 16-byte asynchronous copies
//     (cp.async) from the paged layout (each physical block is contiguous per kv head); V is
//     copied while the tile's scores are computed, the next tile's K while P V runs. Tokens
//     past the visible end, and those of blocks before the first query's window block (whose
//     table entries may be -1), are not loaded but zero-filled (the cache may hold anything);
//  2. S = Q K^T: fp16/bf16 with tensor cores (mma.sync m16n8k16, fp32 accumulate, fragments
//     read from shared memory by ldmatrix.x4, four 8x8 matrices per instruction); fp32 with
//     CUDA cores in the same register layout;
//  3. online softmax in fp32, base 2 (scale * log2 e folded into S, after the soft cap
//     cap * tanh(s / cap) when one is set), causal mask only on tiles that cross the first
//     query's visible end, window mask only on tiles starting before the last query's window;
//     per-row max across the 4 lanes of a row by shuffles; the running sum stays per lane
//     until the end;
//  4. O = O * alpha + P V: P is converted in registers into the A operand (fp16/bf16), or
//     staged through per-warp shared rows (fp32).
// 16-bit types need sm_80 (mma.sync m16n8k16); on older GPUs the host runs the per-row
// kernels instead and this kernel compiles to nothing there.
// Finally each row is normalised by 1 / sum and written as T (rows past the tile's valid
// queries or heads are computed on zero queries and never written).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_params.h"
#include "dtype_utils.cuh"

namespace vpage::cuda::detail {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
inline constexpr bool kPrefillHasMma = false;
#else
inline constexpr bool kPrefillHasMma = true;  // host pass and sm_80+
#endif

/// Tensor cores for 16-bit types on sm_80+; CUDA cores otherwise.
template <typename T>
inline constexpr bool kPrefillUseMma = kPrefillHasMma && sizeof(T) == 2;

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

/// c += a * b for one m16n8k16 tile (row-major A, column-major B, fp32 accumulators).
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/// Four 8x8 b16 matrices from shared memory (ldmatrix.x4): lane l gives the address of row
/// l % 8 of matrix l / 8 (16-byte aligned); r[i] gets matrix i's row lane / 4, elements
/// 2 (lane % 4) and 2 (lane % 4) + 1 -- the fragment layout of mma.sync m16n8k16.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

/// CUDA-core twin of one lane's share of an mma: the accumulators of rows g, g + 8 and
/// columns c, c + 1 (layout c0..c3 of m16n8) += (a, b) x (x0, x1).
__device__ __forceinline__ void outer_2x2(float (&acc)[4], float a, float b, float x0, float x1) {
  acc[0] = fmaf(a, x0, acc[0]);
  acc[1] = fmaf(a, x1, acc[1]);
  acc[2] = fmaf(b, x0, acc[2]);
  acc[3] = fmaf(b, x1, acc[3]);
}

/// Stores two neighbouring output elements (8-byte or 4-byte aligned when `vec`).
__device__ __forceinline__ void store2(float* dst, float a, float b, bool vec) {
  if (vec) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
    dst[0] = a;
    dst[1] = b;
  }
}
template <typename T>
__device__ __forceinline__ void store2(T* dst, float a, float b, bool vec) {
  if (vec) {
    *reinterpret_cast<uint32_t*>(dst) = pack2(a, b, T{});
  } else {
    dst[0] = from_float<T>(a);
    dst[1] = from_float<T>(b);
  }
}

/// 16 bytes global -> shared without a register stop (cp.async on sm_80+, completed by
/// cp_async_wait_all): the first `src_bytes` (0, a multiple of the element size, or 16) come
/// from `src`, the rest is zero-filled; src is not read when src_bytes is 0.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(src_bytes) : "memory");
#else
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (src_bytes == 16) {
    v = *static_cast<const uint4*>(src);
  } else {
    for (int i = 0; i < src_bytes; ++i) reinterpret_cast<unsigned char*>(&v)[i] = static_cast<const unsigned char*>(src)[i];
  }
  *static_cast<uint4*>(dst) = v;
#endif
}

/// Closes the copies issued so far into a group / waits until all of this thread's groups have
/// landed (a __syncthreads after it makes every thread's copies visible).
__device__ __forceinline__ void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

/// Issues the copies of the K tile -> k_s [kTile][hs + pad] for tokens [tile0, tile0 + kTile);
/// tokens outside [kv_begin, kv_end) are zero-filled, their table entries never read.
/// `kc` points at the kv head's slice of physical block 0.
template <typename T, int kHeadSize, int kTile>
__device__ __forceinline__ void load_k_tile(T* k_s, const T* kc, const int32_t* table, int64_t block_stride, int shift,
                                            int tile0, int kv_begin, int kv_end) {
  constexpr int kX = kPack<T>;
  constexpr int kFrags = kHeadSize / kX;
  constexpr int kKStride = kHeadSize + kX;
  const int first_block = tile0 >> shift;
  // Chunk c in (block, fragment, token) order = the cache's order within a block.
  for (int c = threadIdx.x; c < kTile * kFrags; c += kPrefillThreads) {
    const int blk = (c / kFrags) >> shift;
    const int within = c - blk * (kFrags << shift);
    const int tok = (blk << shift) + (within & ((1 << shift) - 1));
    const bool valid = tile0 + tok < kv_end && tile0 + tok >= kv_begin;
    const T* src = valid ? kc + table[first_block + blk] * block_stride + within * kX : kc;
    cp_async_16(k_s + tok * kKStride + (within >> shift) * kX, src, valid ? 16 : 0);
  }
}

/// Issues the copies of the V tile -> v_s [hs][kTile + pad], as load_k_tile (kv_begin is a
/// multiple of the block size, so a value chunk is wholly in or out of it; the chunk crossing
/// kv_end copies its valid elements only).
template <typename T, int kHeadSize, int kTile>
__device__ __forceinline__ void load_v_tile(T* v_s, const T* vc, const int32_t* table, int64_t block_stride, int shift,
                                            int tile0, int kv_begin, int kv_end) {
  constexpr int kX = kPack<T>;
  constexpr int kXShift = kX == 8 ? 3 : 2;
  constexpr int kFrags = kHeadSize / kX;
  constexpr int kVStride = kTile + kX;
  const int first_block = tile0 >> shift;
  // Chunk c in (block, head dim, token chunk) order; 1 << vshift chunks per row.
  const int vshift = shift - kXShift;
  for (int c = threadIdx.x; c < kTile * kFrags; c += kPrefillThreads) {
    const int blk = (c / kHeadSize) >> vshift;
    const int within = c - blk * (kHeadSize << vshift);
    const int tok = (blk << shift) + ((within & ((1 << vshift) - 1)) << kXShift);
    const int valid = tile0 + tok >= kv_begin ? min(kv_end - (tile0 + tok), kX) : 0;
    const T* src = valid > 0 ? vc + table[first_block + blk] * block_stride + within * kX : vc;
    cp_async_16(v_s + (within >> vshift) * kVStride + tok, src, valid > 0 ? valid * static_cast<int>(sizeof(T)) : 0);
  }
}

/// s = Q_w K^T for the warp's 16 rows (q_w: its first row in shared memory).
template <typename T, int kHeadSize, int kTile>
__device__ __forceinline__ void tile_qk(float (&s)[kTile / 8][4], const T* q_w, const T* k_s, int g, int t) {
  constexpr int kStride = kHeadSize + kPack<T>;
#pragma unroll
  for (int j = 0; j < kTile / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
  if constexpr (kPrefillUseMma<T>) {
    // ldmatrix addresses of this lane: A = Q rows 0-7 / 8-15 x dims 0-7 / 8-15 (matrices
    // a0..a3); B = two 8-token groups x dims 0-7 / 8-15 of K (b0, b1 of group j, then j + 1).
    const int lane = 4 * g + t;
    const T* qa = q_w + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kStride + 8 * (lane >> 4);
    const T* kb = k_s + (8 * (lane >> 4) + (lane & 7)) * kStride + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < kHeadSize / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, qa + kk * 16);
#pragma unroll
      for (int j = 0; j < kTile / 8; j += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, kb + 8 * j * kStride + kk * 16);
        mma_16816(s[j], a, b[0], b[1], T{});
        mma_16816(s[j + 1], a, b[2], b[3], T{});
      }
    }
  } else {
#pragma unroll 2
    for (int d = 0; d < kHeadSize; ++d) {
      const float qa = to_float(q_w[g * kStride + d]);
      const float qb = to_float(q_w[(g + 8) * kStride + d]);
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
        const float k0 = to_float(k_s[(8 * j + 2 * t) * kStride + d]);
        const float k1 = to_float(k_s[(8 * j + 2 * t + 1) * kStride + d]);
        outer_2x2(s[j], qa, qb, k0, k1);
      }
    }
  }
}

/// o += P V for the warp's 16 rows; p holds the probabilities in the layout of tile_qk;
/// p_w: the warp's P staging rows (CUDA-core path only).
template <typename T, int kHeadSize, int kTile>
__device__ __forceinline__ void tile_pv(float (&o)[kHeadSize / 8][4], const float (&p)[kTile / 8][4], const T* v_s,
                                        float* p_w, int g, int t) {
  constexpr int kStride = kTile + kPack<T>;
  if constexpr (kPrefillUseMma<T>) {
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      const uint32_t a[4] = {pack2(p[2 * kk][0], p[2 * kk][1], T{}), pack2(p[2 * kk][2], p[2 * kk][3], T{}),
                             pack2(p[2 * kk + 1][0], p[2 * kk + 1][1], T{}),
                             pack2(p[2 * kk + 1][2], p[2 * kk + 1][3], T{})};
#pragma unroll
      for (int dt = 0; dt < kHeadSize / 8; dt += 2) {
        // B = two 8-dim groups x tokens 0-7 / 8-15 of V (b0, b1 of group dt, then dt + 1).
        const int lane = 4 * g + t;
        uint32_t b[4];
        ldmatrix_x4(b, v_s + (8 * (dt + (lane >> 4)) + (lane & 7)) * kStride + kk * 16 + 8 * ((lane >> 3) & 1));
        mma_16816(o[dt], a, b[0], b[1], T{});
        mma_16816(o[dt + 1], a, b[2], b[3], T{});
      }
    }
  } else {
    // CUDA cores: the warp's P goes through its own shared rows p_w [16][kTile + 4] (the
    // +4 keeps the 8 rows read at once in distinct banks), then each lane walks the tokens.
    constexpr int kPStride = kTile + 4;
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p_w[g * kPStride + 8 * j + 2 * t + e] = p[j][e];
        p_w[(g + 8) * kPStride + 8 * j + 2 * t + e] = p[j][2 + e];
      }
    }
    __syncwarp();
#pragma unroll 1
    for (int token = 0; token < kTile; ++token) {
      const float pa = p_w[g * kPStride + token];
      const float pb = p_w[(g + 8) * kPStride + token];
#pragma unroll
      for (int dt = 0; dt < kHeadSize / 8; ++dt) {
        const float v0 = to_float(v_s[(8 * dt + 2 * t) * kStride + token]);
        const float v1 = to_float(v_s[(8 * dt + 2 * t + 1) * kStride + token]);
        outer_2x2(o[dt], pa, pb, v0, v1);
      }
    }
    __syncwarp();  // the next tile rewrites p_w
  }
}

template <typename T, int kHeadSize>
__global__ void __launch_bounds__(kPrefillThreads) prefill_attention_kernel(const PrefillParams p) {
  constexpr int kX = kPack<T>;
  constexpr int kTile = prefill_kv_tile(kHeadSize);
  constexpr int kFrags = kHeadSize / kX;
  constexpr int kQStride = kHeadSize + kX;
  constexpr int kNT = kTile / 8;
  constexpr int kDT = kHeadSize / 8;
  static_assert(kHeadSize % 16 == 0 && kTile % 32 == 0, "mma k-steps of 16; KV tiles of whole blocks (<= 32)");
  extern __shared__ __align__(16) unsigned char prefill_smem[];
  T* q_s = reinterpret_cast<T*>(prefill_smem);  // [kPrefillRows][kQStride]
  T* k_s = q_s + kPrefillRows * kQStride;        // [kTile][kQStride]
  T* v_s = k_s + kTile * kQStride;               // [kHeadSize][kTile + kX]
  // CUDA-core path only: per-warp P rows [16][kTile + 4] float after V.
  float* p_s = reinterpret_cast<float*>(v_s + kHeadSize * (kTile + kX));
  if constexpr (sizeof(T) == 2 && !kPrefillHasMma) {
    return;  // 16-bit before sm_80: never launched (the host takes the per-row kernels)
  } else {
    // The block's sequence: largest s with query_start_loc[s] / q_per_tile + s <= tile.
    // Tiles run in reverse, so the last (longest causal) query tiles start first.
    const int64_t tile = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
    const int q_per_tile = p.q_per_tile;
    int lo = 0;
    int hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.query_start_loc[mid] / q_per_tile + mid <= tile) lo = mid; else hi = mid - 1;
    }
    const int seq = lo;
    const int32_t q_begin = p.query_start_loc[seq];
    const int32_t q_len = p.query_start_loc[seq + 1] - q_begin;
    const int q0 = static_cast<int>(tile - (q_begin / q_per_tile + seq)) * q_per_tile;
    if (q0 >= q_len) return;
    const int nq = min(q_per_tile, q_len - q0);
    const int first_pos = p.context_lens[seq] - q_len;  // position of the sequence's first query
    const int kv_end = min(p.context_lens[seq], first_pos + q0 + nq);
    const int min_vis = first_pos + q0 + 1;  // visible end of the tile's first query
    // Sliding window W: row of query position p sees [p + 1 - W, p + 1). kv_begin: start of
    // the block holding the first query's first windowed key; last_win_begin: the last
    // query's window start (tiles starting before it need the window mask).
    const int window = p.sliding_window;
    const int kv_begin = window > 0 ? (max(0, min_vis - window) >> p.block_shift) << p.block_shift : 0;
    const int last_win_begin = window > 0 ? first_pos + q0 + nq - window : 0;
    const int kv_head = static_cast<int>(blockIdx.y) / p.head_chunks;
    const int chunk = static_cast<int>(blockIdx.y) % p.head_chunks;
    const int hpt = p.heads_per_tile;
    const int head0 = kv_head * p.group_size + chunk * hpt;
    const int nh = min(hpt, p.group_size - chunk * hpt);

    // Q tile; rows without a valid (query, head) stay zero.
    const T* query = static_cast<const T*>(p.query);
    const bool q_vec = (reinterpret_cast<uintptr_t>(query) % 16 == 0) && (p.query_stride % kX == 0);
    for (int c = threadIdx.x; c < kPrefillRows * kFrags; c += kPrefillThreads) {
      const int r = c / kFrags;
      const int f = c - r * kFrags;
      const int q = r / hpt;
      const int h = r - q * hpt;
      T* dst = q_s + r * kQStride + f * kX;
      if (q < nq && h < nh) {
        const T* src = query + static_cast<int64_t>(q_begin + q0 + q) * p.query_stride +
                       static_cast<int64_t>(head0 + h) * kHeadSize + f * kX;
        if (q_vec) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
          for (int j = 0; j < kX; ++j) dst[j] = src[j];
        }
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      }
    }

    const int warp = threadIdx.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    const int g = lane >> 2;
    const int t = lane & 3;
    // The two rows of this lane: valid flag, causal visible end and window start (padding
    // rows see the whole tile range).
    bool row_valid[2];
    int vis[2];
    int vis_begin[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int r = warp * 16 + g + 8 * rh;
      const int q = r / hpt;
      row_valid[rh] = q < nq && r - q * hpt < nh;
      vis[rh] = row_valid[rh] ? first_pos + q0 + q + 1 : kv_end;
      vis_begin[rh] = row_valid[rh] && window > 0 ? vis[rh] - window : 0;
    }

    float o[kDT][4];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};

    const int shift = p.block_shift;
    const int64_t head_elems = static_cast<int64_t>(kHeadSize) << shift;
    const int64_t block_stride = p.num_kv_heads * head_elems;
    const T* kc = static_cast<const T*>(p.key_cache) + kv_head * head_elems;
    const T* vc = static_cast<const T*>(p.value_cache) + kv_head * head_elems;
    const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
    const T* q_w = q_s + warp * 16 * kQStride;
    float* p_w = p_s + warp * 16 * (kTile + 4);

    // K and V tiles load asynchronously, each behind the other's use: V of a tile while its
    // scores and softmax are computed, K of the next tile while P V runs.
    const int first_tile = kv_begin / kTile * kTile;
    if (first_tile < kv_end) {
      load_k_tile<T, kHeadSize, kTile>(k_s, kc, table, block_stride, shift, first_tile, kv_begin, kv_end);
      cp_async_commit();
    }
    for (int tile0 = first_tile; tile0 < kv_end; tile0 += kTile) {
      cp_async_wait_all();
      __syncthreads();  // this tile's K (and, the first time, Q) in place; every warp done with the last V
      load_v_tile<T, kHeadSize, kTile>(v_s, vc, table, block_stride, shift, tile0, kv_begin, kv_end);
      cp_async_commit();

      float s[kNT][4];
      tile_qk<T, kHeadSize, kTile>(s, q_w, k_s, g, t);
      if (p.cap_log2 > 0.0f) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] = p.cap_log2 * tanhf(s[j][e] * p.scale_over_cap);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
        }
      }
      // Some token of the tile is hidden from some row: past its causal end or before its window.
      const bool edge = tile0 + kTile > min_vis || tile0 < last_win_begin;
      if (edge) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int token = tile0 + 8 * j + 2 * t + (e & 1);
            if (token >= vis[e >> 1] || token < vis_begin[e >> 1]) s[j][e] = -INFINITY;
          }
        }
      }
      // Online softmax, one row per half of the accumulators.
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * rh], s[j][2 * rh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float m_new = fmaxf(m[rh], mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row that sees nothing yet
        const float alpha = exp2f(m[rh] - m_use);                // 0 on the first tile
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 2 * rh; e < 2 * rh + 2; ++e) {
            s[j][e] = exp2f(s[j][e] - m_use);
            sum += s[j][e];
          }
        }
        l[rh] = fmaf(l[rh], alpha, sum);
        m[rh] = m_new;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          o[dt][2 * rh] *= alpha;
          o[dt][2 * rh + 1] *= alpha;
        }
      }
      cp_async_wait_all();
      __syncthreads();  // this tile's V in place; every warp done with its K
      if (tile0 + kTile < kv_end) {
        load_k_tile<T, kHeadSize, kTile>(k_s, kc, table, block_stride, shift, tile0 + kTile, kv_begin, kv_end);
        cp_async_commit();
      }
      tile_pv<T, kHeadSize, kTile>(o, s, v_s, p_w, g, t);
    }

    T* out = static_cast<T*>(p.out);
    const bool out_vec = reinterpret_cast<uintptr_t>(out) % 16 == 0;
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float sum = l[rh];
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      if (!row_valid[rh]) continue;
      const int r = warp * 16 + g + 8 * rh;
      const int q = r / hpt;
      const float inv = sum > 0.0f ? __fdividef(1.0f, sum) : 0.0f;
      T* dst = out + (static_cast<int64_t>(q_begin + q0 + q) * p.num_heads + head0 + (r - q * hpt)) * kHeadSize + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) store2(dst + 8 * dt, o[dt][2 * rh] * inv, o[dt][2 * rh + 1] * inv, out_vec);
    }
  }  // if constexpr
}

template <typename T, int kHeadSize>
cudaError_t launch_prefill(const PrefillParams& p, int64_t num_tiles, cudaStream_t stream) {
  const auto kernel = prefill_attention_kernel<T, kHeadSize>;
  constexpr size_t kSmem = prefill_smem_bytes(kHeadSize, sizeof(T));
  if constexpr (kSmem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(num_tiles), static_cast<unsigned>(p.num_kv_heads * p.head_chunks));
  kernel<<<grid, kPrefillThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// Definition of the launcher declared in attention_params.h.
template <typename T>
cudaError_t launch_prefill_attention_typed(const PrefillParams& p, int64_t num_tiles, cudaStream_t stream) {
  switch (p.head_size) {
    case 64: return launch_prefill<T, 64>(p, num_tiles, stream);
    case 80: return launch_prefill<T, 80>(p, num_tiles, stream);
    case 96: return launch_prefill<T, 96>(p, num_tiles, stream);
    case 128: return launch_prefill<T, 128>(p, num_tiles, stream);
    case 256: return launch_prefill<T, 256>(p, num_tiles, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace vpage::cuda::detail
