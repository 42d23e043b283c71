// attention.cuh: causal self-attention with grouped-query heads, flash style, on BF16 tensor cores.
//   forward   O = softmax(Q K^T / sqrt(HD) + causal mask) V, one pass over K/V tiles with an online
//             softmax (running row max and sum), and the log-sum-exp of each row for the backward.
//   backward  FlashAttention-2: recompute P = exp(S - lse) tile by tile; one kernel per K/V tile
//             accumulates dK and dV over the query heads of its group and the query tiles at or after it,
//             another per query tile accumulates dQ. No T x T matrix ever lives in device memory, and no
//             output is written by atomics: two runs give bit-identical results.
// Layouts (README.md, "Parameter layout"): qkv [B*T, (NH+2*NKV)*HD] bf16, columns Q heads, K heads, V heads; head h of a
// block occupies HD columns. out and dout [B*T, NH*HD]; lse and the backward scratch [B, NH, T] float.
// Query head h reads K/V head h / (NH/NKV).
// A block has 4 warps and works on 64-row tiles; warp w owns rows 16w..16w+15 of every tile-sized result.
// Tiles travel global -> shared memory by cp.async (the next tile loads while the current one is used);
// the products run on mma.sync m16n8k16 (BF16 in, FP32 accumulate) with operands from ldmatrix, and
// every intermediate (scores, probabilities, accumulators) stays in registers.
#pragma once
#include "fp8_kernels.cuh"

constexpr int ATTN_TILE = 64;                        // query rows / key rows per tile
constexpr int ATTN_WARPS = 4;
constexpr int ATTN_THREADS = ATTN_WARPS * 32;
constexpr int ATTN_WARP_ROWS = ATTN_TILE / ATTN_WARPS;   // 16: one mma fragment high
constexpr float ATTN_LOG2E = 1.4426950408889634f;
constexpr float ATTN_LN2 = 0.6931471805599453f;

template <int HD> struct AttnDims {
    // Row pitch of a shared [64 x HD] bf16 tile, padded by 16 bytes: the 8 rows an ldmatrix reads then
    // start 4 banks apart and the 8 x 16 bytes cover all 32 banks once.
    static constexpr int LD = HD + 8;
    static constexpr int TILE_ELEMS = ATTN_TILE * LD;
    static constexpr size_t TILE_BYTES = (size_t)TILE_ELEMS * sizeof(bf16);
    static constexpr size_t FORWARD_SMEM = 5 * TILE_BYTES;                                  // Q; K, V twice
    static constexpr size_t DKDV_SMEM = 6 * TILE_BYTES + 2 * 2 * ATTN_TILE * sizeof(float);  // K, V; Q, dO, lse, D twice
    static constexpr size_t DQ_SMEM = 6 * TILE_BYTES;                                       // Q, dO; K, V twice
};

// ----------------------------------------------------------------------------------------------
// Tensor-core primitives (PTX ISA: cp.async, ldmatrix, mma.m16n8k16). With g = lane / 4, t = lane % 4,
// the fragments of mma.m16n8k16 with BF16 inputs hold, two bf16 per 32-bit register:
//   A (16 x 16, m x k): a0 (g, 2t..2t+1), a1 (g+8, 2t..2t+1), a2 (g, 2t+8..2t+9), a3 (g+8, 2t+8..2t+9)
//   B (16 x 8,  k x n): b0 (2t..2t+1, g), b1 (2t+8..2t+9, g)
//   C (16 x 8,  float): c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
// so the C fragments of the 8-column blocks 2j and 2j+1, rounded to bf16, are exactly the A fragment of
// the 16 columns 16j..16j+15: P and dS feed the next product straight from registers (FlashAttention-2).
// A row of a C strip lives in the 4 lanes of one quad (same g): its reductions are 2 shuffles.

// Sum over the 32 lanes of a warp (every lane gets the total).
__device__ inline float attention_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ inline uint32_t attention_smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronously; valid == false writes 16 zero bytes (src is not read).
__device__ inline void attention_cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(attention_smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0) : "memory");
}
__device__ inline void attention_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ inline void attention_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

// Four 8x8 bf16 matrices; lane i gives the address of row i % 8 of matrix i / 8. Without .trans lane l
// receives (row l/4, cols 2(l%4), 2(l%4)+1) of each matrix; with .trans, (rows 2(l%4), 2(l%4)+1, col l/4).
__device__ inline void attention_ldmatrix_x4(uint32_t* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(attention_smem_addr(p)) : "memory");
}
__device__ inline void attention_ldmatrix_x4_trans(uint32_t* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(attention_smem_addr(p)) : "memory");
}
// c += a b on one m16n8k16 block.
__device__ inline void attention_mma(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline uint32_t attention_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // .x (the lower column) in the low half
    return *reinterpret_cast<uint32_t*>(&v);
}

// A fragment of the 16 x 16 block at (row0, col0) of a row-major shared tile: matrices (rows 0-7, cols
// 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) = a0, a1, a2, a3.
template <int HD>
__device__ inline void attention_load_a(uint32_t* a, const bf16* tile, int row0, int col0, int lane) {
    attention_ldmatrix_x4(a, tile + (row0 + lane % 16) * AttnDims<HD>::LD + col0 + (lane / 16) * 8);
}
// B fragments of the n blocks n0..n0+7 (b[0], b[1]) and n0+8..n0+15 (b[2], b[3]) over k0..k0+15, from a
// tile stored [n][k] (K for Q K^T): matrices (n 0-7, k 0-7) = b0, (n 0-7, k 8-15) = b1, then n 8-15.
template <int HD>
__device__ inline void attention_load_b_nk(uint32_t* b, const bf16* tile, int n0, int k0, int lane) {
    attention_ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * AttnDims<HD>::LD + k0 + ((lane / 8) % 2) * 8);
}
// The same fragments from a tile stored [k][n] (V for P V), by transposing loads: matrices (k 0-7, n 0-7)
// = b0, (k 8-15, n 0-7) = b1, then n 8-15.
template <int HD>
__device__ inline void attention_load_b_kn(uint32_t* b, const bf16* tile, int k0, int n0, int lane) {
    attention_ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * AttnDims<HD>::LD + n0 + (lane / 16) * 8);
}

// acc = rows row0..row0+15 of A [64 x HD] times B^T, B [64 x HD], both shared: a 16 x 64 strip of C
// fragments (8 blocks of 8 columns).
template <int HD>
__device__ inline void attention_strip_abt(float (*acc)[4], const bf16* a_tile, const bf16* b_tile, int row0, int lane) {
#pragma unroll
    for (int n = 0; n < ATTN_TILE / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        uint32_t a[4];
        attention_load_a<HD>(a, a_tile, row0, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < ATTN_TILE / 16; np++) {
            uint32_t b[4];
            attention_load_b_nk<HD>(b, b_tile, np * 16, kk * 16, lane);
            attention_mma(acc[2 * np], a, b);
            attention_mma(acc[2 * np + 1], a, b + 2);
        }
    }
}
// A 16 x 64 strip of C fragments rounded to bf16, as the A fragments of its four 16-column blocks.
__device__ inline void attention_pack_a(uint32_t (*pa)[4], const float (*c)[4]) {
#pragma unroll
    for (int kk = 0; kk < ATTN_TILE / 16; kk++) {
        pa[kk][0] = attention_pack_bf16(c[2 * kk][0], c[2 * kk][1]);
        pa[kk][1] = attention_pack_bf16(c[2 * kk][2], c[2 * kk][3]);
        pa[kk][2] = attention_pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        pa[kk][3] = attention_pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}
// acc (a 16 x HD strip: HD/8 blocks) += P (16 x 64, as A fragments) times X [64 x HD] in shared memory.
template <int HD>
__device__ inline void attention_strip_px(float (*acc)[4], const uint32_t (*pa)[4], const bf16* x_tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < ATTN_TILE / 16; kk++) {
#pragma unroll
        for (int dp = 0; dp < HD / 16; dp++) {
            uint32_t b[4];
            attention_load_b_kn<HD>(b, x_tile, kk * 16, dp * 16, lane);
            attention_mma(acc[2 * dp], pa[kk], b);
            attention_mma(acc[2 * dp + 1], pa[kk], b + 2);
        }
    }
}
// scale * a 16 x HD strip of C fragments, as bf16, into global rows row0.. (pitch `stride`) below T.
template <int HD>
__device__ inline void attention_store_strip(bf16* dst, int stride, int row0, int T, const float (*acc)[4], float scale, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row0 + g + 8 * half;
        if (row >= T) continue;
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
            *reinterpret_cast<__nv_bfloat162*>(dst + (size_t)row * stride + n * 8 + 2 * t) =
                __floats2bfloat162_rn(acc[n][2 * half] * scale, acc[n][2 * half + 1] * scale);
    }
}

// Rows row0..row0+63 of one head (HD columns from src, row pitch `stride`) into a shared tile, by cp.async;
// rows at or past T are zero-filled. Needs row0 < T (every tile starts inside the sequence).
template <int HD>
__device__ inline void attention_load_tile_async(bf16* tile, const bf16* src, int row0, int T, int stride) {
    constexpr int CHUNKS = HD / 8;                   // 16-byte chunks per row
    for (int i = threadIdx.x; i < ATTN_TILE * CHUNKS; i += ATTN_THREADS) {
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        bool valid = row0 + r < T;
        attention_cp_async16(tile + r * AttnDims<HD>::LD + c, src + (size_t)(valid ? row0 + r : row0) * stride + c, valid);
    }
}

// Double-buffered K/V tiles: start loading tile kt+1 into the other buffer (unless kt is the last), then
// wait until tile kt has landed (cp.async groups complete in order).
template <int HD>
__device__ inline void attention_prefetch_kv(bf16* kv_tiles, const bf16* k_src, const bf16* v_src, int kt, int last_kt, int T,
                                             int stride) {
    if (kt < last_kt) {
        bf16* next = kv_tiles + ((kt + 1) % 2) * 2 * AttnDims<HD>::TILE_ELEMS;
        attention_load_tile_async<HD>(next, k_src, (kt + 1) * ATTN_TILE, T, stride);
        attention_load_tile_async<HD>(next + AttnDims<HD>::TILE_ELEMS, v_src, (kt + 1) * ATTN_TILE, T, stride);
        attention_cp_async_commit();
        attention_cp_async_wait<1>();
    } else {
        attention_cp_async_wait<0>();
    }
}

// ----------------------------------------------------------------------------------------------
// Forward. One block per (query tile, query head, batch). Online softmax in base 2 (scores pre-multiplied
// by log2(e)/sqrt(HD)): for each K/V tile, m' = max(m, rowmax S), P = exp2(S - m'),
// l' = l * exp2(m - m') + rowsum P, O' = O * exp2(m - m') + P V; at the end O / l and
// lse = (m + log2 l) * ln 2, the natural log of the softmax denominator of the scaled scores.
// P enters the tensor cores rounded to BF16; l sums the unrounded P.
template <int HD>
__global__ void __launch_bounds__(ATTN_THREADS) attention_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T,
                                                                        int NH, int NKV) {
    typedef AttnDims<HD> Dims;
    extern __shared__ __align__(128) unsigned char attn_smem[];
    bf16* q_tile = reinterpret_cast<bf16*>(attn_smem);
    bf16* kv_tiles = q_tile + Dims::TILE_ELEMS;      // buffer i: K at kv_tiles + 2i TILE_ELEMS, V right after

    const int qt = gridDim.x - 1 - blockIdx.x;       // the longest rows (most K/V tiles) start first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (NH / NKV);
    const int C3 = (NH + 2 * NKV) * HD;
    const bf16* rows = qkv + (size_t)b * T * C3;
    const bf16* k_src = rows + (NH + kvh) * HD;
    const bf16* v_src = rows + (NH + NKV + kvh) * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int q0 = qt * ATTN_TILE, row0 = warp * ATTN_WARP_ROWS;
    const float scale_log2 = rsqrtf((float)HD) * ATTN_LOG2E;

    attention_load_tile_async<HD>(q_tile, rows + h * HD, q0, T, C3);
    attention_load_tile_async<HD>(kv_tiles, k_src, 0, T, C3);
    attention_load_tile_async<HD>(kv_tiles + Dims::TILE_ELEMS, v_src, 0, T, C3);
    attention_cp_async_commit();

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[n][i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};             // running max of rows g and g+8 (base-2 units)
    float l[2] = {0.0f, 0.0f};                       // running sum over this lane's columns of those rows

    for (int kt = 0; kt <= qt; kt++) {
        const bf16* k_tile = kv_tiles + (kt % 2) * 2 * Dims::TILE_ELEMS;
        const bf16* v_tile = k_tile + Dims::TILE_ELEMS;
        attention_prefetch_kv<HD>(kv_tiles, k_src, v_src, kt, qt, T, C3);
        __syncthreads();
        float s[ATTN_TILE / 8][4];
        attention_strip_abt<HD>(s, q_tile, k_tile, row0, lane);
        const int k0 = kt * ATTN_TILE;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < ATTN_TILE / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int qi = q0 + row0 + g + 8 * (i / 2), key = k0 + n * 8 + 2 * t + i % 2;
                s[n][i] = (key <= qi && key < T) ? s[n][i] * scale_log2 : -INFINITY;
                mx[i / 2] = fmaxf(mx[i / 2], s[n][i]);
            }
        }
        float m_use[2], alpha[2];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
            float m_new = fmaxf(m[hr], mx[hr]);
            // Every row has an unmasked key in each tile it visits (key k0 <= q0 <= qi, and k0 < T), so
            // m_new is finite; the guard would keep a fully masked row at P = 0 instead of NaN.
            m_use[hr] = m_new == -INFINITY ? 0.0f : m_new;
            alpha[hr] = exp2f(m[hr] - m_use[hr]);
            m[hr] = m_new;
            l[hr] *= alpha[hr];
        }
#pragma unroll
        for (int n = 0; n < ATTN_TILE / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                s[n][i] = exp2f(s[n][i] - m_use[i / 2]);
                l[i / 2] += s[n][i];
            }
        }
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
            o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }
        uint32_t pa[ATTN_TILE / 16][4];
        attention_pack_a(pa, s);
        attention_strip_px<HD>(o, pa, v_tile, lane);
        __syncthreads();                             // this buffer is refilled by the next iteration's prefetch
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
        float inv_l = 1.0f / l[hr];
#pragma unroll
        for (int n = 0; n < HD / 8; n++) { o[n][2 * hr] *= inv_l; o[n][2 * hr + 1] *= inv_l; }
        int qi = q0 + row0 + g + 8 * hr;
        if (t == 0 && qi < T) lse[((size_t)b * NH + h) * T + qi] = (m[hr] + log2f(l[hr])) * ATTN_LN2;
    }
    attention_store_strip<HD>(out + (size_t)b * T * NH * HD + h * HD, NH * HD, q0 + row0, T, o, 1.0f, lane);
}

// ----------------------------------------------------------------------------------------------
// Backward. With S = Q K^T / sqrt(HD), P = softmax(S) = exp(S - lse), O = P V:
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) with D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij,
//   dQ = dS K / sqrt(HD),  dK = dS^T Q / sqrt(HD).
// D is computed first, one warp per (token, head), into the scratch buffer [B, NH, T].
constexpr int ATTN_DELTA_THREADS = 256;
template <int HD>
__global__ void attention_backward_delta_kernel(float* delta, const bf16* dout, const bf16* out, int B, int T, int NH) {
    const long row = (long)blockIdx.x * (ATTN_DELTA_THREADS / 32) + threadIdx.x / 32;   // (b, t, h)
    const int lane = threadIdx.x % 32;
    if (row >= (long)B * T * NH) return;
    const bf16* o = out + row * HD;
    const bf16* d = dout + row * HD;
    float sum = 0.0f;
    for (int c = lane; c < HD; c += 32) sum += to_float(o[c]) * to_float(d[c]);
    sum = attention_warp_sum(sum);
    const int h = row % NH;
    const long bt = row / NH;
    if (lane == 0) delta[((bt / T) * NH + h) * T + bt % T] = sum;
}

// dK and dV of one K/V tile of one KV head: loops over the query heads of the group and, for each, the
// query tiles at or after the K/V tile (the others see none of its keys). Computes transposed scores
// S^T = K Q^T, so that the warp's rows are keys, the rows of dK and dV, which accumulate in registers.
template <int HD>
__global__ void __launch_bounds__(ATTN_THREADS) attention_backward_dkdv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                                              const float* lse, const float* delta,
                                                                              int T, int NH, int NKV) {
    typedef AttnDims<HD> Dims;
    extern __shared__ __align__(128) unsigned char attn_smem[];
    bf16* k_tile = reinterpret_cast<bf16*>(attn_smem);
    bf16* v_tile = k_tile + Dims::TILE_ELEMS;
    bf16* qdo_tiles = v_tile + Dims::TILE_ELEMS;     // buffer i: Q at qdo_tiles + 2i TILE_ELEMS, dO right after
    float* row_vals = reinterpret_cast<float*>(qdo_tiles + 4 * Dims::TILE_ELEMS);   // buffer i: lse*log2(e) [64], D [64]

    const int kt = blockIdx.x;                       // the first K/V tiles see the most query tiles: start them first
    const int ntiles = gridDim.x;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int group = NH / NKV;
    const int C3 = (NH + 2 * NKV) * HD;
    const bf16* rows = qkv + (size_t)b * T * C3;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int k0 = kt * ATTN_TILE, row0 = warp * ATTN_WARP_ROWS;
    const float scale = rsqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    // The (query head, query tile) pairs in order: step i is head kvh*group + i / per_head, tile kt + i % per_head.
    const int per_head = ntiles - kt, steps = group * per_head;

    // Stage step i's Q and dO tiles (cp.async) and its lse and D rows (plain loads) into buffer i % 2.
    auto stage = [&](int i) {
        const int h = kvh * group + i / per_head, q0 = (kt + i % per_head) * ATTN_TILE;
        bf16* q_dst = qdo_tiles + (i % 2) * 2 * Dims::TILE_ELEMS;
        attention_load_tile_async<HD>(q_dst, rows + h * HD, q0, T, C3);
        attention_load_tile_async<HD>(q_dst + Dims::TILE_ELEMS, dout + (size_t)b * T * NH * HD + h * HD, q0, T, NH * HD);
        attention_cp_async_commit();
        if (threadIdx.x < ATTN_TILE) {
            const int qi = q0 + threadIdx.x;
            const size_t at = ((size_t)b * NH + h) * T + qi;
            float* vals = row_vals + (i % 2) * 2 * ATTN_TILE;
            vals[threadIdx.x] = qi < T ? lse[at] * ATTN_LOG2E : 0.0f;
            vals[ATTN_TILE + threadIdx.x] = qi < T ? delta[at] : 0.0f;
        }
    };

    attention_load_tile_async<HD>(k_tile, rows + (NH + kvh) * HD, k0, T, C3);
    attention_load_tile_async<HD>(v_tile, rows + (NH + NKV + kvh) * HD, k0, T, C3);
    stage(0);                                        // one commit group: K, V and step 0
    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) { dk[n][i] = 0.0f; dv[n][i] = 0.0f; }

    for (int step = 0; step < steps; step++) {
        if (step + 1 < steps) {
            stage(step + 1);
            attention_cp_async_wait<1>();
        } else {
            attention_cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* q_tile = qdo_tiles + (step % 2) * 2 * Dims::TILE_ELEMS;
        const bf16* do_tile = q_tile + Dims::TILE_ELEMS;
        const float* lse_q = row_vals + (step % 2) * 2 * ATTN_TILE;
        const float* delta_q = lse_q + ATTN_TILE;
        const int q0 = (kt + step % per_head) * ATTN_TILE;
        float st[ATTN_TILE / 8][4], dpt[ATTN_TILE / 8][4];
        attention_strip_abt<HD>(st, k_tile, q_tile, row0, lane);     // S^T: rows keys, columns queries
        attention_strip_abt<HD>(dpt, v_tile, do_tile, row0, lane);   // dP^T = V dO^T
#pragma unroll
        for (int n = 0; n < ATTN_TILE / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int key = k0 + row0 + g + 8 * (i / 2), c = n * 8 + 2 * t + i % 2, qi = q0 + c;
                float p = (qi < T && key <= qi) ? exp2f(st[n][i] * scale_log2 - lse_q[c]) : 0.0f;
                st[n][i] = p;                                           // P^T
                dpt[n][i] = p * (dpt[n][i] - delta_q[c]);               // dS^T
            }
        }
        uint32_t pa[ATTN_TILE / 16][4], dsa[ATTN_TILE / 16][4];
        attention_pack_a(pa, st);
        attention_pack_a(dsa, dpt);
        attention_strip_px<HD>(dv, pa, do_tile, lane);                 // dV += P^T dO
        attention_strip_px<HD>(dk, dsa, q_tile, lane);                 // dK += dS^T Q (scaled at the end)
        __syncthreads();                             // this buffer is refilled by the next step's prefetch
    }
    bf16* drows = dqkv + (size_t)b * T * C3;
    attention_store_strip<HD>(drows + (NH + kvh) * HD, C3, k0 + row0, T, dk, scale, lane);
    attention_store_strip<HD>(drows + (NH + NKV + kvh) * HD, C3, k0 + row0, T, dv, 1.0f, lane);
}

// dQ of one query tile of one query head: loops over the K/V tiles at or before it.
template <int HD>
__global__ void __launch_bounds__(ATTN_THREADS) attention_backward_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                                            const float* lse, const float* delta,
                                                                            int T, int NH, int NKV) {
    typedef AttnDims<HD> Dims;
    extern __shared__ __align__(128) unsigned char attn_smem[];
    bf16* q_tile = reinterpret_cast<bf16*>(attn_smem);
    bf16* do_tile = q_tile + Dims::TILE_ELEMS;
    bf16* kv_tiles = do_tile + Dims::TILE_ELEMS;     // buffer i: K at kv_tiles + 2i TILE_ELEMS, V right after

    const int qt = gridDim.x - 1 - blockIdx.x;       // the longest rows start first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (NH / NKV);
    const int C3 = (NH + 2 * NKV) * HD;
    const bf16* rows = qkv + (size_t)b * T * C3;
    const bf16* k_src = rows + (NH + kvh) * HD;
    const bf16* v_src = rows + (NH + NKV + kvh) * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int q0 = qt * ATTN_TILE, row0 = warp * ATTN_WARP_ROWS;
    const float scale = rsqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;

    attention_load_tile_async<HD>(q_tile, rows + h * HD, q0, T, C3);
    attention_load_tile_async<HD>(do_tile, dout + (size_t)b * T * NH * HD + h * HD, q0, T, NH * HD);
    attention_load_tile_async<HD>(kv_tiles, k_src, 0, T, C3);
    attention_load_tile_async<HD>(kv_tiles + Dims::TILE_ELEMS, v_src, 0, T, C3);
    attention_cp_async_commit();
    float lse_r[2], delta_r[2];                      // rows g and g+8 (lse in base-2 units)
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int qi = q0 + row0 + g + 8 * hr;
        const size_t at = ((size_t)b * NH + h) * T + qi;
        lse_r[hr] = qi < T ? lse[at] * ATTN_LOG2E : 0.0f;
        delta_r[hr] = qi < T ? delta[at] : 0.0f;
    }
    float dq[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dq[n][i] = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        const bf16* k_tile = kv_tiles + (kt % 2) * 2 * Dims::TILE_ELEMS;
        const bf16* v_tile = k_tile + Dims::TILE_ELEMS;
        attention_prefetch_kv<HD>(kv_tiles, k_src, v_src, kt, qt, T, C3);
        __syncthreads();
        const int k0 = kt * ATTN_TILE;
        float s[ATTN_TILE / 8][4], dp[ATTN_TILE / 8][4];
        attention_strip_abt<HD>(s, q_tile, k_tile, row0, lane);       // S
        attention_strip_abt<HD>(dp, do_tile, v_tile, row0, lane);     // dP = dO V^T
#pragma unroll
        for (int n = 0; n < ATTN_TILE / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int hr = i / 2, qi = q0 + row0 + g + 8 * hr, key = k0 + n * 8 + 2 * t + i % 2;
                float p = (qi < T && key <= qi) ? exp2f(s[n][i] * scale_log2 - lse_r[hr]) : 0.0f;
                dp[n][i] = p * (dp[n][i] - delta_r[hr]);                // dS
            }
        }
        uint32_t dsa[ATTN_TILE / 16][4];
        attention_pack_a(dsa, dp);
        attention_strip_px<HD>(dq, dsa, k_tile, lane);                 // dQ += dS K (scaled at the end)
        __syncthreads();                             // this buffer is refilled by the next iteration's prefetch
    }
    attention_store_strip<HD>(dqkv + (size_t)b * T * C3 + h * HD, C3, q0 + row0, T, dq, scale, lane);
}

// ----------------------------------------------------------------------------------------------
// Launchers.

inline void attention_check(const char* who, int B, int T, int NH, int NKV, int HD, std::initializer_list<const void*> ptrs) {
    if (B < 1 || T < 1) fail("%s: B=%d and T=%d must be at least 1", who, B, T);
    if (NH < 1 || NKV < 1 || NH % NKV != 0)
        fail("%s: n_heads=%d must be a positive multiple of n_kv_heads=%d", who, NH, NKV);
    if (HD != 64 && HD != 128)
        fail("%s: head_dim=%d is not supported; the attention kernels are built for 64 and 128 (choose dim / n_heads = 64 or 128)", who, HD);
    if (NH > 65535 || B > 65535) fail("%s: n_heads=%d and B=%d must be at most 65535 (grid limits)", who, NH, B);
    for (const void* ptr : ptrs)
        if (!is_aligned16(ptr)) fail("%s: every tensor must be 16-byte aligned (got %p)", who, ptr);
}

// Kernels that need more than 48 KB of shared memory must opt in; the attribute belongs to the current
// device, so it is set at every launch (a host-side call of a microsecond).
template <class Kernel>
inline void attention_set_smem(Kernel kernel, size_t bytes) {
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

template <int HD>
inline void attention_forward_launch(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, cudaStream_t s) {
    size_t smem = AttnDims<HD>::FORWARD_SMEM;
    attention_set_smem(attention_forward_kernel<HD>, smem);
    dim3 grid(ceil_div(T, ATTN_TILE), NH, B);
    attention_forward_kernel<HD><<<grid, ATTN_THREADS, smem, s>>>(out, lse, qkv, T, NH, NKV);
    cudaCheckLaunch();
}

// qkv: [B*T, (NH+2*NKV)*HD] bf16, RoPE already applied to Q and K. out: [B*T, NH*HD] bf16. lse: [B*NH*T] float.
inline void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD, cudaStream_t s) {
    attention_check("attention_forward", B, T, NH, NKV, HD, {out, lse, qkv});
    if (HD == 64) attention_forward_launch<64>(out, lse, qkv, B, T, NH, NKV, s);
    else attention_forward_launch<128>(out, lse, qkv, B, T, NH, NKV, s);
}

template <int HD>
inline void attention_backward_launch(bf16* dqkv, float* delta, const bf16* dout, const bf16* qkv, const bf16* out,
                                      const float* lse, int B, int T, int NH, int NKV, cudaStream_t s) {
    long delta_rows = (long)B * T * NH;
    attention_backward_delta_kernel<HD><<<ceil_div(delta_rows, ATTN_DELTA_THREADS / 32), ATTN_DELTA_THREADS, 0, s>>>(
        delta, dout, out, B, T, NH);
    cudaCheckLaunch();
    int ntiles = ceil_div(T, ATTN_TILE);
    size_t smem_dkdv = AttnDims<HD>::DKDV_SMEM, smem_dq = AttnDims<HD>::DQ_SMEM;
    attention_set_smem(attention_backward_dkdv_kernel<HD>, smem_dkdv);
    attention_backward_dkdv_kernel<HD><<<dim3(ntiles, NKV, B), ATTN_THREADS, smem_dkdv, s>>>(dqkv, dout, qkv, lse, delta, T, NH, NKV);
    cudaCheckLaunch();
    attention_set_smem(attention_backward_dq_kernel<HD>, smem_dq);
    attention_backward_dq_kernel<HD><<<dim3(ntiles, NH, B), ATTN_THREADS, smem_dq, s>>>(dqkv, dout, qkv, lse, delta, T, NH, NKV);
    cudaCheckLaunch();
}

// dout: [B*T, NH*HD]. Writes (overwrites) dqkv [B*T, (NH+2NKV)*HD]. scratch: at least B*NH*T floats (holds D).
inline void attention_backward(bf16* dqkv, float* scratch, const bf16* dout, const bf16* qkv, const bf16* out,
                               const float* lse, int B, int T, int NH, int NKV, int HD, cudaStream_t s) {
    attention_check("attention_backward", B, T, NH, NKV, HD, {dqkv, scratch, dout, qkv, out, lse});
    if (HD == 64) attention_backward_launch<64>(dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, s);
    else attention_backward_launch<128>(dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, s);
}
