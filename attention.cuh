// attention.cuh: causal self-attention with grouped-query heads, flash style, on BF16 tensor cores.
//   forward   O = softmax(Q K^T / sqrt(HD) + causal mask) V, one pass over K/V tiles with an online
//             softmax (running row max and sum), and the log-sum-exp of each row for the backward.
//   backward  recompute P = exp(S - lse) tile by tile; dV = P^T dO, dP = dO V^T, dS = P * (dP - D),
//             dK = dS^T Q, dQ = dS K. No T x T matrix ever lives in device memory, and no output is written
//             by atomics: two runs give bit-identical results.
// Two implementations, one launcher (attention_forward / attention_backward) choosing:
//   Hopper (GPU_ARCH=sm_90a): warpgroup MMA (wgmma) on tiles brought by the TMA, producer/consumer
//             warpgroups; the backward runs the five products once per (key tile, query tile) and sums dQ
//             over key tiles in a fixed order (turn counters between blocks).
//   mma.sync (any other GPU, and tested on Hopper too): 4 warps on 64-row tiles, cp.async double
//             buffering; the backward recomputes S and dP in a separate dQ kernel (7 products) to avoid atomics.

// Layouts: qkv [B*T, (NH+2*NKV)*HD] bf16, columns Q heads, K heads, V heads; head h of a block occupies HD
// columns. out and dout [B*T, NH*HD]; lse [B, NH, T] float; the backward's scratch is sized by
// attention_backward_scratch_floats. Query head h reads K/V head h / (NH/NKV).
#pragma once
#include "common.cuh"
#include "fp8_kernels.cuh"   // the E4M3 casts and the scale rule of the FP8 forward
#include <atomic>
#include <type_traits>
#include <cuda.h>            // CUtensorMap and its enums (the encoder is fetched at run time: no -lcuda)
#include <cudaTypedefs.h>    // PFN_cuTensorMapEncodeTiled

// mma.sync kernels: a block has 4 warps and works on 64-row tiles; warp w owns rows 16w..16w+15 of every
// tile-sized result. Tiles travel global -> shared memory by cp.async (the next tile loads while the current
// one is used); the products run on mma.sync m16n8k16 (BF16 in, FP32 accumulate) with operands from ldmatrix,
// and every intermediate (scores, probabilities, accumulators) stays in registers.
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
// 2^x on the special-function unit (the softmax's exponentials; -inf gives +0).
__device__ inline float attention_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
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

// Zero a strip of NB 8-column blocks of C fragments (an accumulator before its first product).
template <int NB>
__device__ __forceinline__ void attention_zero(float (*acc)[4]) {
#pragma unroll
    for (int n = 0; n < NB; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
}

// acc = rows row0..row0+15 of A [64 x HD] times B^T, B [64 x HD], both shared: a 16 x 64 strip of C
// fragments (8 blocks of 8 columns).
template <int HD>
__device__ inline void attention_strip_abt(float (*acc)[4], const bf16* a_tile, const bf16* b_tile, int row0, int lane) {
    attention_zero<ATTN_TILE / 8>(acc);
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
// A 16 x COLS strip of C fragments rounded to bf16, as the A fragments of its 16-column blocks.
template <int COLS = ATTN_TILE>
__device__ inline void attention_pack_a(uint32_t (*pa)[4], const float (*c)[4]) {
#pragma unroll
    for (int kk = 0; kk < COLS / 16; kk++) {
        pa[kk][0] = attention_pack_bf16(c[2 * kk][0], c[2 * kk][1]);
        pa[kk][1] = attention_pack_bf16(c[2 * kk][2], c[2 * kk][3]);
        pa[kk][2] = attention_pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        pa[kk][3] = attention_pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}
// The FP8 forward (Hopper): P cast to E4M3 after a multiplication by ATTN_FP8_P_SCALE, as the A operands of
// the m64n64k32 products of P V (hattn_wgmma_rs_e4m3), one per 32 keys, taken from the C fragments as they lie:
// register 0 gets row g's keys 2t, 2t+1, 8+2t, 9+2t (blocks 4kk and 4kk+1), register 1 row g+8's, registers 2
// and 3 the same of blocks 4kk+2 and 4kk+3. Operand column 4t + i of each 16 thus holds key attention_fp8_key(4t +
// i) of those 16, and the FP8 cast stores V's keys in that order.
constexpr float ATTN_FP8_P_SCALE = 256.0f;
__host__ __device__ inline int attention_fp8_key(int p) { return 2 * (p / 4) + p % 2 + 8 * (p % 4 / 2); }
template <int COLS>
__device__ inline void attention_pack_a_e4m3(uint32_t (*pa)[4], const float (*c)[4], float scale) {
#pragma unroll
    for (int kk = 0; kk < COLS / 32; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float* lo = c[4 * kk + 2 * (r / 2)];
            const float* hi = c[4 * kk + 2 * (r / 2) + 1];
            const int i = 2 * (r % 2);
            pa[kk][r] = fp8x4_encode<E4M3>(lo[i] * scale, lo[i + 1] * scale, hi[i] * scale, hi[i + 1] * scale);
        }
}
// The FP8 forward's scale of a tile of Q, K or V from its amax (the bits of |x|, as the cast gathers it):
// the scale rule of the linear layers, E4M3, margin 0, capped at 2^64. O follows V's scale from tile to tile
// (attention_forward_hopper_kernel), and an all-zero tile's scale (2^108, from the amax floor) would carry it past
// FP32's range; with the cap O stays below 2^8 2^64 T max|V|.
constexpr float ATTN_FP8_MAX_SCALE = 0x1p64f;
__host__ __device__ inline float attention_fp8_scale(unsigned int amax_bits) {
    float amax;
    memcpy(&amax, &amax_bits, sizeof(amax));
    return fminf(fp8_scale_from_amax(amax, E4M3_MAX, 0, 1.0f), ATTN_FP8_MAX_SCALE);
}
// 1 / x for x a power of two (these scales: 2^-119 to 2^64), exact: the exponent field negated, 254 - (e + 127).
__device__ inline float attention_fp8_inverse_scale(float x) { return __int_as_float(0x7f000000 - __float_as_int(x)); }

// One step of the online softmax over a strip of NB 8-column blocks of raw scores s (masked ones -inf), rows
// g and g+8 of the warp's 16 (one quad per row): in base 2 with scores scaled by scale_log2 = log2(e)/sqrt(HD),
// m' = max(m, rowmax(s) scale_log2), alpha = 2^(m - m'), l' = l alpha + rowsum P, and s becomes
// P = 2^(s scale_log2 - m'). The caller rescales O by alpha. l sums this lane's columns only (the quad's
// partial sums are added at the end). Every row has an unmasked key in each tile it visits (key k0 <= its
// first query), so m' is finite; the guard would keep a fully masked row at P = 0 instead of NaN.
template <int NB>
__device__ inline void attention_softmax_step(float (*s)[4], float* m, float* l, float* alpha, float scale_log2) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NB; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) mx[i / 2] = fmaxf(mx[i / 2], s[n][i]);
    float m_use[2];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
        const float m_new = fmaxf(m[hr], mx[hr] * scale_log2);   // scale_log2 > 0: the max commutes with it
        m_use[hr] = m_new == -INFINITY ? 0.0f : m_new;
        alpha[hr] = attention_exp2(m[hr] - m_use[hr]);
        m[hr] = m_new;
        l[hr] *= alpha[hr];
    }
#pragma unroll
    for (int n = 0; n < NB; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s[n][i] = attention_exp2(fmaf(s[n][i], scale_log2, -m_use[i / 2]));
            l[i / 2] += s[n][i];
        }
}
// The online softmax's O' = O alpha, rows g and g+8 of a strip of NB 8-column blocks, before P V is added.
template <int NB>
__device__ __forceinline__ void attention_rescale_rows(float (*o)[4], const float* alpha) {
#pragma unroll
    for (int n = 0; n < NB; n++) {
        o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
        o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }
}
// The online softmax's end for rows g and g+8 of a 16 x HD strip of O whose first row is row0: l summed over
// the quad, O / l, and lse[row] = (m + log2 l) ln 2, the natural log of the softmax denominator of the scaled
// scores, for rows below T.
template <int HD>
__device__ __forceinline__ void attention_finish_rows(float (*o)[4], const float* m, float* l, float* lse, int row0, int T,
                                                      int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
        const float inv_l = 1.0f / l[hr];
#pragma unroll
        for (int n = 0; n < HD / 8; n++) { o[n][2 * hr] *= inv_l; o[n][2 * hr + 1] *= inv_l; }
        const int qi = row0 + g + 8 * hr;
        if (t == 0 && qi < T) lse[qi] = (m[hr] + log2f(l[hr])) * ATTN_LN2;
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
// Forward. One block per (query tile, query head, batch). For each K/V tile, the online softmax step
// (attention_softmax_step: base 2, scores scaled by log2(e)/sqrt(HD)) and O' = O * exp2(m - m') + P V; at the
// end O / l and lse = (m + log2 l) * ln 2, the natural log of the softmax denominator of the scaled scores.
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
    attention_zero<HD / 8>(o);
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
#pragma unroll
        for (int n = 0; n < ATTN_TILE / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int qi = q0 + row0 + g + 8 * (i / 2), key = k0 + n * 8 + 2 * t + i % 2;
                if (key > qi || key >= T) s[n][i] = -INFINITY;
            }
        }
        float alpha[2];
        attention_softmax_step<ATTN_TILE / 8>(s, m, l, alpha, scale_log2);
        attention_rescale_rows<HD / 8>(o, alpha);
        uint32_t pa[ATTN_TILE / 16][4];
        attention_pack_a(pa, s);
        attention_strip_px<HD>(o, pa, v_tile, lane);
        __syncthreads();                             // this buffer is refilled by the next iteration's prefetch
    }
    attention_finish_rows<HD>(o, m, l, lse + ((size_t)b * NH + h) * T, q0 + row0, T, lane);
    attention_store_strip<HD>(out + (size_t)b * T * NH * HD + h * HD, NH * HD, q0 + row0, T, o, 1.0f, lane);
}

// ----------------------------------------------------------------------------------------------
// Backward. With S = Q K^T / sqrt(HD), P = softmax(S) = exp(S - lse), O = P V:
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) with D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij,
//   dQ = dS K / sqrt(HD),  dK = dS^T Q / sqrt(HD).
// D is computed first, one warp per (batch, head, row), into the scratch buffer [B, NH, Tp]: Tp = T for the
// mma.sync kernels; the Hopper kernels pad the rows to whole query tiles (Tp = attention_padded_T(T)) and also
// take lse in base-2 units (lse2). A padded row (t >= T) gets D = 0 and lse2 = +inf, so that its P =
// exp2(s - inf) = 0 and dS = 0 without a mask.
constexpr int ATTN_DELTA_THREADS = 256;
// HD / 8 threads per row, 16 bytes of out and dout each, summed over the row's lanes by shuffles.
template <int HD>
__global__ void attention_backward_delta_kernel(float* delta, float* lse2, const float* lse, const bf16* dout, const bf16* out,
                                                int B, int T, int Tp, int NH) {
    constexpr int LANES = HD / BF16_PER_16B;   // threads per row, a power of two dividing 32
    static_assert(LANES <= 32 && (32 % LANES) == 0, "a row's threads lie in one warp");
    const long row = ((long)blockIdx.x * ATTN_DELTA_THREADS + threadIdx.x) / LANES;   // (b, h, t) with t < Tp
    const int part = threadIdx.x % LANES;
    const bool valid = row < (long)B * NH * Tp;   // not a return: every lane takes part in the shuffles
    const int t = (int)(row % Tp);
    const long bh = row / Tp;
    const int h = (int)(bh % NH), b = (int)(bh / NH);
    float sum = 0.0f;
    if (valid && t < T) {
        const size_t at = ((size_t)b * T + t) * NH * HD + (size_t)h * HD + part * BF16_PER_16B;
        Packed128<bf16> o = load128(out + at), d = load128(dout + at);
#pragma unroll
        for (int k = 0; k < BF16_PER_16B; k++) sum += to_float(o.v[k]) * to_float(d.v[k]);
    }
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (valid && part == 0) {
        delta[row] = sum;
        if (lse2) lse2[row] = t < T ? lse[bh * T + t] * ATTN_LOG2E : INFINITY;
    }
}
template <int HD>
inline void attention_backward_delta(float* delta, float* lse2, const float* lse, const bf16* dout, const bf16* out, int B, int T,
                                     int Tp, int NH, cudaStream_t s) {
    const long rows = (long)B * NH * Tp;
    attention_backward_delta_kernel<HD><<<ceil_div(rows, ATTN_DELTA_THREADS / (HD / BF16_PER_16B)), ATTN_DELTA_THREADS, 0, s>>>(
        delta, lse2, lse, dout, out, B, T, Tp, NH);
    cudaCheckLaunch();
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
    attention_zero<HD / 8>(dk);
    attention_zero<HD / 8>(dv);

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
    attention_zero<HD / 8>(dq);

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
// Hopper (sm_90a): the same attention on warpgroup MMA, with tiles brought by the tensor memory accelerator.
// PTX ISA: "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" (wgmma), "cp.async.bulk.tensor",
// "mbarrier". A block has warpgroups of 128 threads: warpgroup 0 is the producer (one thread issues the TMA
// copies; the warpgroup gives most of its registers to the others with setmaxnreg), warpgroups 1, 2 (and 3 in
// the forward at HD = 64) are consumers, each owning 64 rows of every product. Tiles wait in shared memory in
// the layout that the TMA's 128-byte swizzle writes and wgmma reads: rows of 64 bf16 (128 bytes), 16-byte
// chunk c of row r stored at chunk c ^ (r % 8), so that 8 rows x 128 bytes form one 1024-byte swizzle atom. A
// head of 128 columns is two such tiles side by side ("chunks" of 64 columns). Stages are handed over by
// mbarriers: `full` completes when the TMA bytes have landed, `empty` when every consumer thread is done reading.

// Register layouts (PTX: "Matrix fragments for wgmma .m64nNk16"): in warp w (0-3) of a warpgroup, lane with
// g = lane / 4, t = lane % 4 holds, of an accumulator D [64 x N] (floats), for every 8-column block j,
// D[16w + g][8j + 2t, +1] and D[16w + g + 8][8j + 2t, +1]: the m16n8 C fragment of mma.sync, once per
// block - so float acc[N/8][4] here is laid out exactly as the strips of the mma.sync kernels above, and the
// same helpers pack, rescale and store it. An A operand from registers (16 x 16 per warp) is the mma.sync A
// fragment: attention_pack_a<N> turns an N-column accumulator into the A operands of N / 16 k-steps.

constexpr int HATTN_CONSUMERS = 2;                               // backward: consumer warpgroups per block
constexpr int HATTN_THREADS = 128 * (1 + HATTN_CONSUMERS);
constexpr int HATTN_PRODUCER_REGS = 24;
// Registers of a consumer thread when nc consumer warpgroups share the SM's 65536 with the producer's 128 x 24
// (setmaxnreg takes multiples of 8): 2 -> 240, 3 -> 160.
constexpr int hattn_consumer_regs(int nc) { return (65536 / 128 - HATTN_PRODUCER_REGS) / nc / 8 * 8; }
// mbarrier stages of K/V (forward) and of Q/dO (backward): a third stage speeds up the forward, not the backward.
constexpr int HATTN_FWD_STAGES = 3, HATTN_BWD_STAGES = 2;
// Forward consumer warpgroups (64 query rows each): at HD = 64 three fit in registers (O 32 + S 64 + P 32 floats
// a thread under 160), so a K/V tile serves 192 rows; at HD = 128 two (O alone is 64 floats).
template <int HD> constexpr int hattn_fwd_consumers() { return HD == 64 ? 3 : 2; }
// Forward Q buffers of the persistent blocks: two at HD = 64 (the next tile's Q loads while this one's is read);
// at HD = 128 the three K/V stages leave room for one.
template <int HD> constexpr int hattn_fwd_q_bufs() { return HD == 64 ? 2 : 1; }
constexpr int HATTN_FWD_BN = 128;                                // forward: keys per K/V tile
constexpr int HATTN_BWD_BM = 64;                                 // backward: query rows per step
constexpr int HATTN_BWD_BN = 64 * HATTN_CONSUMERS;               // backward: keys per block
constexpr int HATTN_BWD_DQ_COLS = HATTN_BWD_BM / HATTN_CONSUMERS;  // backward: query columns of a consumer's dQ^T
// Backward: neighbouring key tiles of one (batch, KV head) run side by side, in groups of this many
// (hattn_bwd_block). The FP32 dQ accumulator tile of a (query tile, head) gets one add per key tile: the adds of
// one group come within a few steps of each other and find the tile in the L2, while between groups waves of
// other heads pass and the tile goes back to memory (at D = 128 a wave's accumulator and Q/dO tiles exceed the
// L2). Larger groups lose to the turns: each block of a group adds a step after the one below it, so its
// consumers wait longer for free staging tiles.
constexpr int HATTN_BWD_KEY_GROUP = 4;
// How a step's dQ (64 queries x HD) is formed, as two FP32 "dQ tiles" (the units of the accumulator and its
// writers): at HD = 64 each consumer forms dQ^T = K^T dS^T for its 32 queries, all 64 head rows (m64n32, K as
// the A operand): dQ tile w, [64 head rows x 32 queries], is consumer w's. At HD = 128 ("rows") one consumer
// forms the whole dQ = dS K, 64 queries x 128 head columns (m64n128 over the block's 128 keys, dS as the A
// operand), the two consumers taking turns by step (consumer i % 2 at step i, the other going straight on to
// the next step's scores): dQ tile j is columns 64j..64j+63. The operands all come from shared memory (~128
// bytes a clock an SM), whose reads m64n128 keeps lowest: 48 KB for a step's dQ, where two m64n64 halves (one
// a consumer) read 64 KB.
template <int HD> constexpr bool hattn_dq_rows() { return HD == 128; }

// Shared-memory plan of both kernels: byte offsets from a 1024-byte-aligned base (the swizzle atom).
// BF16 tiles are [rows x 64 columns] = rows * 128 bytes, one per 64-column chunk of the head.
// The forward's, for BF16 or FP8 operands: Q buffers (all consumers' rows), K and V stages, barriers. An FP8
// tile is one [rows x HD] byte tile (Q and K: HD bytes a row, the 128-byte swizzle at HD = 128, the 64-byte at
// HD = 64) and V arrives transposed, [HD rows x 128 keys], 128 bytes a row. FP8 halves the tiles, so every
// head dim gets two Q buffers.
template <int HD, bool FP8> struct HattnFwdSmem {
    static constexpr int BM = 64 * hattn_fwd_consumers<HD>();   // query rows per block
    static constexpr int QB = FP8 ? 2 : hattn_fwd_q_bufs<HD>();  // Q buffers
    static constexpr int ELEM = FP8 ? 1 : 2;                     // bytes an element
    static constexpr int Q_BYTES = BM * HD * ELEM;
    static constexpr int KV_BYTES = HATTN_FWD_BN * HD * ELEM;
    static constexpr int Q = 0;
    static constexpr int K = Q + QB * Q_BYTES;
    static constexpr int V = K + HATTN_FWD_STAGES * KV_BYTES;
    static constexpr int BAR = V + HATTN_FWD_STAGES * KV_BYTES;
    static constexpr int BYTES = BAR + 128 + 1024;      // barriers; slack to align the base
    static_assert(2 * QB + 4 * HATTN_FWD_STAGES <= 16, "the forward's barriers fit their 128 bytes");
    static_assert(BYTES <= 227 * 1024, "shared memory over the sm_90 limit");
};
template <int HD> struct HattnSmem {
    static constexpr int CH = HD / 64;
    static constexpr int chunk(int rows) { return rows * 128; }
    // backward: K, V of the block; Q and dO stages; dS^T twice; two dQ tiles twice (by step parity); lse and D rows of
    // each stage; barriers. Every tile starts on a 1024-byte boundary.
    static constexpr int BWD_KV_BYTES = CH * chunk(HATTN_BWD_BN);
    static constexpr int BWD_Q_BYTES = CH * chunk(HATTN_BWD_BM);
    static constexpr int BWD_STAGE_BYTES = 2 * BWD_Q_BYTES;                    // Q, dO
    static constexpr int BWD_ROWS_BYTES = 2 * HATTN_BWD_BM * 4;                // lse * log2(e) and D of the step's rows
    static constexpr int BWD_DS_BYTES = HATTN_BWD_BN * HATTN_BWD_BM * 2;       // dS^T, bf16
    static constexpr int BWD_DQ_COLS = hattn_dq_rows<HD>() ? 64 : HATTN_BWD_DQ_COLS; // a dQ tile: 64 rows x these
    static constexpr int BWD_DQ_BYTES = 64 * BWD_DQ_COLS * 4;                  // a dQ tile, FP32 (two of each)
    static constexpr int BWD_K = 0;
    static constexpr int BWD_V = BWD_K + BWD_KV_BYTES;
    static constexpr int BWD_STAGE = BWD_V + BWD_KV_BYTES;
    static constexpr int BWD_DS = BWD_STAGE + HATTN_BWD_STAGES * BWD_STAGE_BYTES;
    static constexpr int BWD_DQ = BWD_DS + 2 * BWD_DS_BYTES;
    static constexpr int BWD_ROWS = BWD_DQ + HATTN_CONSUMERS * 2 * BWD_DQ_BYTES;
    static constexpr int BWD_BAR = BWD_ROWS + HATTN_BWD_STAGES * BWD_ROWS_BYTES;
    static constexpr int BWD_BYTES = BWD_BAR + 128 + 1024;
    static_assert(BWD_BYTES <= 227 * 1024, "shared memory over the sm_90 limit");
};

// The backward's per-row values and dQ accumulator, padded to whole query tiles: Tp = ceil(T / 64) * 64.
__host__ __device__ inline int attention_padded_T(int T) { return (T + HATTN_BWD_BM - 1) / HATTN_BWD_BM * HATTN_BWD_BM; }
// The backward's FP32 dQ accumulator: per (batch, head, query tile) two dQ tiles j (hattn_dq_rows), each
// contiguous (one bulk copy): at HD = 64 dQ^T of queries 32j..32j+31, [64 head rows x 32 queries]; at HD = 128
// dQ of head columns 64j..64j+63, [64 queries x 64 columns]. Column c of row r is stored at
// c ^ attention_dq_swizzle(r): a warp's fragment stores then hit distinct shared-memory banks. One turn counter
// per tile (below).
__host__ __device__ inline size_t attention_dq_tile(int b, int h, int qt, int j, int NH, int nq) {
    return (((size_t)b * NH + h) * nq + qt) * HATTN_CONSUMERS + j;
}
__host__ __device__ inline int attention_dq_swizzle(int r) { return 8 * (r % 4); }
// Forward work tile w of ntiles * NH * B: query tile, head, batch. The query tiles go from the last (the longest
// rows) down, in groups of qg neighbours (the last group may be short); within a group the qg tiles of one (batch,
// head) are neighbours in w, so they run side by side and read each K/V tile from memory once, and the query heads
// of one KV head follow each other (GQA: the same K/V). The tiles of a group take turns by group (r + grp), so
// that no persistent block always gets a group's longest tile.
__host__ __device__ inline void hattn_fwd_tile(int w, int ntiles, int NH, int B, int qg, int* qt, int* h, int* b) {
    const int grp = w / (NH * B * qg), r = w % (NH * B * qg), n = min(qg, ntiles - grp * qg);
    *qt = ntiles - 1 - grp * qg - (r + grp) % n;
    *h = (r / n) % NH;
    *b = r / (n * NH);
}
// Backward block i of nkt * NKV * B: key tile, KV head, batch. The key tiles go from the first (the most query
// tiles) up, in groups of HATTN_BWD_KEY_GROUP neighbours; within a group the tiles of one (batch, KV head) are
// neighbours in i, so each runs a step behind the one before it (the dQ turns) and reads the same Q, dO and dQ
// accumulator tiles from L2. A lower key tile of the same (batch, KV head) always has the lower block index, so
// the block before it in the turns has started (blocks start in index order).
__host__ __device__ inline void hattn_bwd_block(int i, int nkt, int NKV, int B, int* kt, int* kvh, int* b) {
    constexpr int KG = HATTN_BWD_KEY_GROUP;
    const int grp = i / (KG * NKV * B), r = i % (KG * NKV * B), n = min(KG, nkt - grp * KG);
    *kt = grp * KG + r % n;
    *kvh = (r / n) % NKV;
    *b = r / (n * NKV);
}
// Step i of a backward block: the query tiles from the last down, and for each the query heads of the group.
__host__ __device__ inline void hattn_bwd_step(int i, int group, int kvh, int nq, int* h, int* qt) {
    *h = kvh * group + i % group;
    *qt = nq - 1 - i / group;
}

#if defined(__CUDA_ARCH__)
// mbarrier: a phase completes when `count` arrivals and all expected transaction bytes have come.
__device__ inline void hattn_bar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(attention_smem_addr(bar)), "r"(count) : "memory");
}
__device__ inline void hattn_bar_expect(uint64_t* bar, uint32_t bytes) {   // an arrival that also expects bytes
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(attention_smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ inline void hattn_bar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(attention_smem_addr(bar)) : "memory");
}
__device__ inline void hattn_bar_wait(uint64_t* bar, uint32_t parity) {   // until phase `parity` has completed
    uint32_t done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(attention_smem_addr(bar)), "r"(parity) : "memory");
    } while (!done);
}
// TMA: box (x = column, y = row, z = batch) of `map` into shared memory; completes bytes on `bar`.
__device__ inline void hattn_tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y, int z) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(attention_smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z),
                   "r"(attention_smem_addr(bar)) : "memory");
}
// TMA: shared memory into box (x = column, y = row, z = batch) of `map`, as a bulk group of the issuing thread;
// the parts of the box outside the tensor (rows past T) are not written.
__device__ inline void hattn_tma_store(const CUtensorMap* map, const void* src, int x, int y, int z) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(attention_smem_addr(src)), "r"(x), "r"(y), "r"(z) : "memory");
}
// Plain bulk copy of `bytes` (a multiple of 16) from global to shared memory; completes bytes on `bar`.
__device__ inline void hattn_bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(attention_smem_addr(dst)), "l"(src), "r"(bytes), "r"(attention_smem_addr(bar)) : "memory");
}
// The dynamic shared memory from its first 1024-byte boundary (the 128-byte swizzle repeats every 1024 bytes).
// An offset from the array, not an integer round trip: the compiler then still knows the pointer is shared
// memory and accesses through it are LDS/STS (through an integer they become generic loads and stores with
// 64-bit addresses, and the D = 64 backward spills).
__device__ inline unsigned char* hattn_smem_base(unsigned char* raw) {
    return raw + ((1024 - (attention_smem_addr(raw) & 1023)) & 1023);
}
// Named barrier `id` over `count` threads: hattn_sync arrives and waits, hattn_arrive only arrives. Id 0 is
// __syncthreads; the ids of each kernel are named in HattnFwdBarrier and HattnBwdBarrier.
__device__ inline void hattn_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
__device__ inline void hattn_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }

// Shared -> global by the TMA (async proxy), tracked as bulk groups of the issuing thread: a plain copy, or an
// element-wise FP32 add into the destination (performed in L2). `bytes` and both addresses: multiples of 16.
__device__ inline void hattn_bulk_store(void* dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(attention_smem_addr(src)), "r"(bytes) : "memory");
}
__device__ inline void hattn_bulk_add_f32(float* dst, const void* src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(attention_smem_addr(src)), "r"(bytes) : "memory");
}
__device__ inline void hattn_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Turn counters across blocks: wait (one thread) until *turn reaches `value`, with acquire semantics, so that
// the writes of the turns before are seen, also by this thread's later bulk copies.
__device__ inline void hattn_turn_wait(const int* turn, int value) {
    int seen;
    do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(turn) : "memory");
    } while (seen < value);
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// Until this thread's bulk copies have read their shared-memory sources (which may then be overwritten, or
// freed by the block's exit; the writes complete before the kernel does).
__device__ inline void hattn_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Pass the turn on once this thread's bulk copies have completed (their writes are done in global memory and
// their shared-memory sources may be overwritten).
__device__ inline void hattn_turn_pass_after_bulk(int* turn) {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(turn) : "memory");
}

// Byte offset of 16-byte unit u (0-7) of row r in a tile of 128-byte rows under the 128-byte swizzle (the
// layout the TMA writes and wgmma reads, see above): the unit moves to u ^ (r % 8).
__device__ inline int hattn_sw128(int r, int u) { return r * 128 + ((u ^ (r % 8)) * 16); }

// Shared-memory matrix descriptor (PTX: "Matrix Descriptor Format"): start address, leading and stride byte
// offsets (all >> 4), swizzle mode in bits 62-63 (1 = 128-byte, 2 = 64-byte). With a swizzle, K-major
// operands ignore the leading offset and step 8 rows by the stride offset; MN-major operands step 8 rows
// of K by the stride offset and the next 64 (or 32) MN elements by the leading offset.
constexpr uint32_t HATTN_SW128 = 1, HATTN_SW64 = 2;
__device__ inline uint64_t hattn_desc(const void* smem, uint32_t sbo_bytes, uint32_t swizzle, uint32_t lbo_bytes = 16) {
    const uint64_t addr = attention_smem_addr(smem);
    return ((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo_bytes >> 4) << 16) | ((uint64_t)(sbo_bytes >> 4) << 32) |
           ((uint64_t)swizzle << 62);
}

// The descriptor of the matrix `bytes` (a multiple of 16) further on in shared memory than base_desc's: one add
// to the start address field, which cannot carry out of it (shared addresses are below 2^18). Descriptors built
// from one base per kernel cost an add each, instead of hattn_desc's conversion, mask and shifts per wgmma.
__device__ inline uint64_t hattn_desc_at(uint64_t base_desc, uint32_t bytes) {
    return (base_desc & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)base_desc + (bytes >> 4));
}

__device__ inline void hattn_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void hattn_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void hattn_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// After a wait: the compiler must not move reads of the accumulators above it.
template <int R>
__device__ inline void hattn_fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulators d[0..N/2) as asm operands with constraint c ("+f" read and written, "=f" written only).
#define HATTN_C4(c, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3])
#define HATTN_C16(c, i) HATTN_C4(c, i), HATTN_C4(c, i + 4), HATTN_C4(c, i + 8), HATTN_C4(c, i + 12)
#define HATTN_D16(c) HATTN_C16(c, 0)
#define HATTN_D32(c) HATTN_C16(c, 0), HATTN_C16(c, 16)
#define HATTN_D64(c) HATTN_C16(c, 0), HATTN_C16(c, 16), HATTN_C16(c, 32), HATTN_C16(c, 48)
#define HATTN_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define HATTN_R32 HATTN_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define HATTN_R64 HATTN_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// One wgmma: SHAPE_TYPES its shape and input types, REGS / OUTS the accumulators, OPERANDS the operand list
// after them (p, the predicate, is scale-d: 0 overwrites d), the asm inputs after that. accumulate is a constant
// in every caller's unrolled loop: with 0 the accumulators are outputs only ("=f"), so the compiler need not keep
// their old values live up to the product that overwrites them.
#define HATTN_WGMMA(SHAPE_TYPES, REGS, OUTS, OPERANDS, ...)                                                         \
    if (accumulate)                                                                                                \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned." SHAPE_TYPES        \
                     " {" REGS "}, " OPERANDS ";\n}\n" : OUTS("+f") : __VA_ARGS__);                                    \
    else                                                                                                           \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 0, 0;\n wgmma.mma_async.sync.aligned." SHAPE_TYPES        \
                     " {" REGS "}, " OPERANDS ";\n}\n" : OUTS("=f") : __VA_ARGS__);

// d[64 x N] (+)= A[64 x 16] B[16 x N], BF16 in, FP32 accumulate; A and B from shared memory (descriptors).
// TA / TB: 0 = K-major (rows of the operand run along K), 1 = MN-major (transposed). accumulate = 0 overwrites d.
template <int N, int TA, int TB>
__device__ inline void hattn_wgmma_ss(float* d, uint64_t a, uint64_t b, int accumulate) {
    static_assert(N == 32 || N == 64 || N == 128, "wgmma widths used here");
    if constexpr (N == 32) {
        HATTN_WGMMA("m64n32k16.f32.bf16.bf16", HATTN_R16, HATTN_D16, "%16, %17, p, 1, 1, %18, %19", "l"(a), "l"(b), "n"(TA), "n"(TB))
    } else if constexpr (N == 64) {
        HATTN_WGMMA("m64n64k16.f32.bf16.bf16", HATTN_R32, HATTN_D32, "%32, %33, p, 1, 1, %34, %35", "l"(a), "l"(b), "n"(TA), "n"(TB))
    } else {
        HATTN_WGMMA("m64n128k16.f32.bf16.bf16", HATTN_R64, HATTN_D64, "%64, %65, p, 1, 1, %66, %67", "l"(a), "l"(b), "n"(TA), "n"(TB))
    }
}
// d[64 x N] (+)= A[64 x 16] B[16 x N]; A from registers (the mma.sync A fragment of each warp's 16 rows), B from
// shared memory (TB as above).
template <int N, int TB>
__device__ inline void hattn_wgmma_rs(float* d, const uint32_t* a, uint64_t b, int accumulate) {
    static_assert(N == 64 || N == 128, "wgmma widths used here");
    if constexpr (N == 64) {
        HATTN_WGMMA("m64n64k16.f32.bf16.bf16", HATTN_R32, HATTN_D32, "{%32, %33, %34, %35}, %36, p, 1, 1, %37",
                    "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB))
    } else {
        HATTN_WGMMA("m64n128k16.f32.bf16.bf16", HATTN_R64, HATTN_D64, "{%64, %65, %66, %67}, %68, p, 1, 1, %69",
                    "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB))
    }
}
// The FP8 products, E4M3 in, FP32 accumulate, k = 32 (32 bytes of each operand row): both operands K-major, the
// only layout FP8 wgmma reads. d[64 x 128] (+)= A[64 x 32] B[32 x 128], both from shared memory (S = Q K^T) ...
__device__ inline void hattn_wgmma_ss_e4m3(float* d, uint64_t a, uint64_t b, int accumulate) {
    HATTN_WGMMA("m64n128k32.f32.e4m3.e4m3", HATTN_R64, HATTN_D64, "%64, %65, p, 1, 1", "l"(a), "l"(b))
}
// ... and d[64 x 64] (+)= A[64 x 32] B[32 x 64], A from registers (O += P V): in warp w, lane (g, t) holds 4 bytes
// a register, a0 = A[16w + g][4t..4t+3], a1 = A[16w + g + 8][4t..4t+3], a2, a3 the same at columns 16 + 4t.
__device__ inline void hattn_wgmma_rs_e4m3(float* d, const uint32_t* a, uint64_t b, int accumulate) {
    HATTN_WGMMA("m64n64k32.f32.e4m3.e4m3", HATTN_R32, HATTN_D32, "{%32, %33, %34, %35}, %36, p, 1, 1",
                "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
}
#undef HATTN_WGMMA
#endif   // __CUDA_ARCH__

// The FP8 forward's inputs (attention_fp8_cast): Q, K and V of qkv in E4M3, each tile at current scaling from its
// own amax (the linear layers' scale rule), so that one pass over qkv finds the amaxes and writes the codes:
//   q8 [B, T, NH HD] and k8 [B, T, NKV HD]   Q and K times their tiles' scales, row-major as in qkv
//   vt8 [B, NKV HD, Tp]                       V^T times its tiles' scales, Tp = T rounded up to 128 (the forward's
//                                            key tiles), keys of each 16 in attention_fp8_key order, keys past T zero
//   q_scale [B, NH, Tp / 64]                  a scale per 64 query rows of a head: one consumer's rows of a work tile
//   k_scale, v_scale [B, NKV, Tp / 128]       a scale per 128-key tile of a K/V head: one K/V tile of the forward
// V is transposed because FP8 wgmma reads both operands K-major: for P V, K is the key.
__host__ __device__ inline int attention_fp8_padded_T(int T) { return (T + HATTN_FWD_BN - 1) / HATTN_FWD_BN * HATTN_FWD_BN; }
constexpr int ATTN_FP8_Q_ROWS = 64;   // query rows per Q scale
struct AttentionFp8Inputs {
    fp8 *q, *k, *vt;
    float *q_scale, *k_scale, *v_scale;
};

// ---- Hopper forward. Work tiles: (query tile of 64 NC rows, query head, batch), NC = hattn_fwd_consumers,
// numbered longest rows first, in groups of neighbouring query tiles (hattn_fwd_tile, attention_fwd_query_group)
// so that the K/V tiles come from L2. Persistent blocks, one per SM: block i takes tiles i, i + grid, i + 2 grid,
// ..., so the producer loads the next tile's Q and K/V while the consumers finish this one (no block launch, no
// pipeline fill between tiles).
// Consumer c owns query rows 64c..64c+63 of a tile. Per K/V tile: S = Q K^T (wgmma, both operands K-major),
// online softmax in registers as in the mma.sync kernel (base 2, masked only on the diagonal tile), then
// O += P V (P from registers, V MN-major); the order of issues and waits that overlaps them is below.
// FP8 (the same kernel, FP8 = true; inputs from attention_fp8_cast): Q, K and V arrive in E4M3 with a scale per
// tile (powers of two: sq per consumer's 64 rows, sk and sv per K/V tile), V transposed so that both operands of
// P V are K-major. S = Q K^T runs on FP8 tensor cores and the scales fold into the softmax's multiplier (scores =
// raw / (sq sk)). P, in [0, 1] after the online softmax, is cast to E4M3 times 256 (exact: a power of two), which
// keeps the probabilities down to 2^-14 in E4M3's normal range (its subnormals start at 2^-6); l sums the
// unrounded P, and O = acc / (256 sv l), O's units following sv from tile to tile.
// The C fragment of S holds keys 2t, 2t+1, 8+2t, 9+2t of each 16 where the FP8 A fragment wants 4t..4t+3: rather
// than shuffle bytes between lanes, the cast permutes V's keys the same way (attention_fp8_key), so that
// sum_k P[k] V[k] pairs the right key with its probability.

// Named barriers of the Hopper forward (ids for hattn_sync / hattn_arrive; 0 is __syncthreads).
enum HattnFwdBarrier : int {
    HATTN_FWD_BAR_TURN = 4,   // + c: consumer c waits for its turn at the tensor cores; consumer c - 1 (mod NC) arrives
};
static_assert(HATTN_FWD_BAR_TURN + hattn_fwd_consumers<64>() <= 16, "a block has 16 named barriers");
// Q, K and V tiles come from q_map, k_map and v_map (BF16: qkv for all three; FP8: attention_fp8_cast's q8, k8
// and vt8); fp8: the cast's tensors, of which the kernel reads the scales (FP8 only).
template <int HD, bool FP8>
__global__ void __launch_bounds__(128 * (1 + hattn_fwd_consumers<HD>()), 1)
attention_forward_hopper_kernel(bf16* out, float* lse, const __grid_constant__ CUtensorMap q_map,
                                const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                                const AttentionFp8Inputs fp8, int B, int T, int NH, int NKV, int qg) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef HattnFwdSmem<HD, FP8> S;
    // CH: BF16 tiles per head (64 columns each); FP8 has one tile of HD bytes a row. ROW: bytes a Q or K row of a tile.
    constexpr int CH = FP8 ? 1 : HD / 64, ROW = FP8 ? HD : 128;
    constexpr int BN = HATTN_FWD_BN, NC = hattn_fwd_consumers<HD>(), BM = S::BM, QB = S::QB;
    extern __shared__ unsigned char hattn_smem_raw[];
    unsigned char* smem = hattn_smem_base(hattn_smem_raw);
    // Operand tiles: the 128-byte swizzle, 8 rows = 1024 bytes; FP8 Q and K at HD = 64: the 64-byte, 8 rows = 512.
    const uint64_t sw128 = hattn_desc(smem, 1024, HATTN_SW128);
    const uint64_t qk_base = FP8 && HD == 64 ? hattn_desc(smem, 512, HATTN_SW64) : sw128;
    auto desc = [&](const unsigned char* tile) { return hattn_desc_at(sw128, (uint32_t)(tile - smem)); };
    auto qk_desc = [&](const unsigned char* tile) { return hattn_desc_at(qk_base, (uint32_t)(tile - smem)); };
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S::BAR);
    uint64_t* q_full = bars;                                  // per Q buffer: full, empty; then per stage:
    uint64_t* q_empty = q_full + QB;                          // K full, K empty, V full, V empty
    uint64_t* k_full = q_empty + QB;
    uint64_t* k_empty = k_full + HATTN_FWD_STAGES;
    uint64_t* v_full = k_empty + HATTN_FWD_STAGES;
    uint64_t* v_empty = v_full + HATTN_FWD_STAGES;

    const int ntiles = (T + BM - 1) / BM, tiles = ntiles * NH * B;
    // Work tile w (hattn_fwd_tile), and the K/V tiles holding keys <= its last row.
    auto tile_of = [&](int w, int* qt, int* h, int* b, int* nkv) {
        hattn_fwd_tile(w, ntiles, NH, B, qg, qt, h, b);
        *nkv = (min(*qt * BM + BM, T) + BN - 1) / BN;
    };
    // Through a shuffle, so that the compiler knows it is warp-uniform: the consumer's loop counts depend on it
    // (nkv_c), and its counters and barrier addresses then stay in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);

    if (threadIdx.x == 0) {
        for (int i = 0; i < QB; i++) {
            hattn_bar_init(q_full + i, 1);
            hattn_bar_init(q_empty + i, 128 * NC);
        }
        for (int s = 0; s < HATTN_FWD_STAGES; s++) {
            hattn_bar_init(k_full + s, 1);
            hattn_bar_init(v_full + s, 1);
            hattn_bar_init(k_empty + s, 128 * NC);
            hattn_bar_init(v_empty + s, 128 * NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Buffers and stages are used in turn across the block's tiles: use u of a ring of R slots is slot u % R,
    // and its full barrier completes phase (u / R) & 1; use u >= R first waits for the release of use u - R.
    // Producer: one thread loads, for each work tile, its Q into the next Q buffer, then its K/V tiles into the
    // ring of stages (K and V of a stage on barriers of their own, so that S = Q K^T can start before V lands).
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(HATTN_PRODUCER_REGS));
        if (threadIdx.x == 0) {
            int kv_use = 0;
            for (int w = blockIdx.x, it = 0; w < tiles; w += gridDim.x, it++) {
                int qt, h, b, nkv;
                tile_of(w, &qt, &h, &b, &nkv);
                const int kvh = h / (NH / NKV), qb = it % QB;
                if (it >= QB) hattn_bar_wait(q_empty + qb, ((it / QB) + 1) & 1);
                hattn_bar_expect(q_full + qb, S::Q_BYTES);
                for (int ch = 0; ch < CH; ch++)
                    hattn_tma_load(smem + S::Q + qb * S::Q_BYTES + ch * BM * 128, &q_map, q_full + qb, h * HD + 64 * ch,
                                   qt * BM, b);
                for (int j = 0; j < nkv; j++, kv_use++) {
                    const int s = kv_use % HATTN_FWD_STAGES;
                    const uint32_t empty_parity = ((kv_use / HATTN_FWD_STAGES) + 1) & 1;   // the release of use kv_use - STAGES
                    unsigned char* k_tile = smem + S::K + s * S::KV_BYTES;
                    unsigned char* v_tile = smem + S::V + s * S::KV_BYTES;
                    if (kv_use >= HATTN_FWD_STAGES) hattn_bar_wait(k_empty + s, empty_parity);
                    hattn_bar_expect(k_full + s, S::KV_BYTES);
                    if constexpr (FP8) {   // k8 [B, T, NKV HD]
                        hattn_tma_load(k_tile, &k_map, k_full + s, kvh * HD, j * BN, b);
                    } else {
                        for (int ch = 0; ch < CH; ch++)
                            hattn_tma_load(k_tile + ch * BN * 128, &k_map, k_full + s, (NH + kvh) * HD + 64 * ch, j * BN, b);
                    }
                    if (kv_use >= HATTN_FWD_STAGES) hattn_bar_wait(v_empty + s, empty_parity);
                    hattn_bar_expect(v_full + s, S::KV_BYTES);
                    if constexpr (FP8) {   // vt8 [B, NKV HD, Tp]: HD rows of 128 keys
                        hattn_tma_load(v_tile, &v_map, v_full + s, j * BN, kvh * HD, b);
                    } else {
                        for (int ch = 0; ch < CH; ch++)
                            hattn_tma_load(v_tile + ch * BN * 128, &v_map, v_full + s, (NH + NKV + kvh) * HD + 64 * ch,
                                           j * BN, b);
                    }
                }
            }
        }
        return;
    }
    // Consumers: warpgroup 1 + c owns query rows 64c..64c+63 of every work tile.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(hattn_consumer_regs(NC)));
    const int c = wg - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float scale_log2 = rsqrtf((float)HD) * ATTN_LOG2E;   // the softmax's multiplier of raw scores (base 2)
    const int Tp = attention_fp8_padded_T(T);                  // FP8: the scales' row length (below)

    float o[HD / 8][4];
    float m[2], l[2];                                         // running max (scaled, base 2) and sum of rows g, g+8
    float sc[BN / 8][4];
    float alpha[2];
    uint32_t pa[BN / (FP8 ? 32 : 16)][4];
    // BF16 at HD = 128: each warp keeps its 16 rows of Q in registers (32 a thread), the A operand of S = Q K^T:
    // the product then reads only K from shared memory, and the block's one Q buffer is released as soon as the
    // fragments are loaded, so the next work tile's Q loads under this tile's products. At HD = 64 three
    // consumers have 160 registers a thread and this spills; there, and in FP8, two Q buffers overlap the loads.
    constexpr bool Q_IN_REGS = HD == 128 && !FP8;
    uint32_t qa[Q_IN_REGS ? HD / 16 : 1][4];
    int kv_base = 0;                                          // this block's K/V tiles before the current work tile
    for (int w = blockIdx.x, it = 0; w < tiles; w += gridDim.x, it++) {
        int qt, h, b, nkv;
        tile_of(w, &qt, &h, &b, &nkv);
        const int row_base = qt * BM + 64 * c + 16 * warp;   // this warp's first query row
        // The block loads the nkv K/V tiles its last rows see; this consumer's rows see only the first nkv_c. Its
        // products and softmax stop there (the rest would be wholly masked); it still waits for each later load,
        // releases it and keeps its turns (below). At D = 64 (192 query rows against 128 keys a tile) that skips a
        // tenth or more of the products. A consumer whose rows all lie past T still scores tile 0 (nothing of it
        // is stored), so that every consumer has a first tile.
        const int row_first = qt * BM + 64 * c;
        const int nkv_c = row_first >= T ? 1 : min(row_first + 63, T - 1) / BN + 1;
        // FP8: the multiplier of tile j's raw scores is scale_log2 / (sq sk_j), with sq the scale of this consumer's
        // Q rows and sk_j, sv_j those of K/V tile j. O accumulates 256 P V in units of the last V tile's scale:
        // going from tile j to j + 1 multiplies it by sv_{j+1} / sv_j with alpha (exact: powers of two), and at the
        // end O = acc / (256 sv l). The scales are loaded here, ahead of their use: lane i of each warp holds those
        // of K/V tile 32 r + i (r: the current 32 tiles; issue_scores loads the next 32), and tile j's come by a
        // shuffle where they are used, so that no load latency sits on the softmax's path.
        const size_t kv_row = ((size_t)b * NKV + h / (NH / NKV)) * (Tp / BN);
        const size_t q_row = ((size_t)b * NH + h) * (Tp / ATTN_FP8_Q_ROWS) + row_first / ATTN_FP8_Q_ROWS;
        const float sq = FP8 && row_first < T ? fp8.q_scale[q_row] : 1.0f;
        float k_scales = 1.0f, v_scales = 1.0f, sv_acc = 1.0f;
        auto load_kv_scales = [&](int j0) {
            if constexpr (FP8) {
                const size_t at = kv_row + min(j0 + lane, nkv - 1);
                k_scales = fp8.k_scale[at];
                v_scales = fp8.v_scale[at];
            }
        };
        load_kv_scales(0);
        const int qb = it % QB;
        const unsigned char* q_tile = smem + S::Q + qb * S::Q_BYTES + 64 * c * ROW;   // this consumer's rows of chunk 0
        attention_zero<HD / 8>(o);
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.0f;

        // The phases of K/V tile j, as lambdas that the pipeline below orders: issue_scores(j) S = Q K^T,
        // softmax(j) the mask and the online softmax (P and alpha), issue_pv(j) O += P V.
        // S = Q K^T of K/V tile j into sc (issued, not awaited).
        auto issue_scores = [&](int j) {
            const int u = kv_base + j;
            const unsigned char* k_tile = smem + S::K + (u % HATTN_FWD_STAGES) * S::KV_BYTES;
            if (FP8 && j > 0 && j % 32 == 0) load_kv_scales(j);
            hattn_bar_wait(k_full + u % HATTN_FWD_STAGES, (u / HATTN_FWD_STAGES) & 1);
            hattn_wgmma_fence();
            if constexpr (FP8) {
#pragma unroll
                for (int kk = 0; kk < HD / 32; kk++)   // 32 columns of the head per step: 32 bytes into the rows
                    hattn_wgmma_ss_e4m3(&sc[0][0], qk_desc(q_tile + kk * 32), qk_desc(k_tile + kk * 32), kk > 0);
            } else {
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk++) {   // 16 columns of the head per step: 32 bytes into a chunk's rows
                    const int ch = kk / 4, off = (kk % 4) * 32;
                    if constexpr (Q_IN_REGS)
                        hattn_wgmma_rs<BN, 0>(&sc[0][0], qa[kk], desc(k_tile + ch * BN * 128 + off), kk > 0);
                    else
                        hattn_wgmma_ss<BN, 0, 0>(&sc[0][0], desc(q_tile + ch * BM * 128 + off), desc(k_tile + ch * BN * 128 + off),
                                                 kk > 0);
                }
            }
            hattn_wgmma_commit();
        };
        // Online softmax of tile j's scores (complete in sc), the diagonal tile masked.
        auto softmax = [&](int j) {
            const int k0 = j * BN;
            if (k0 + BN > row_base - 16 * warp + 1) {   // some key of the tile is past some row of the consumer
#pragma unroll
                for (int n = 0; n < BN / 8; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        if (k0 + n * 8 + 2 * t + i % 2 > row_base + g + 8 * (i / 2)) sc[n][i] = -INFINITY;
            }
            float mult = scale_log2;
            if constexpr (FP8) {   // scale_log2 / (sq sk_j), sk_j from lane j % 32
                const float sk = __shfl_sync(0xffffffffu, k_scales, j % 32);
                mult = scale_log2 * attention_fp8_inverse_scale(sq) * attention_fp8_inverse_scale(sk);
            }
            attention_softmax_step<BN / 8>(sc, m, l, alpha, mult);
        };
        // FP8: O's units follow V's scale to tile j, whose P is packed next (after softmax, before the rescale).
        auto follow_v_scale = [&](int j) {
            if constexpr (FP8) {
                const float sv = __shfl_sync(0xffffffffu, v_scales, j % 32);
                const float r = sv * attention_fp8_inverse_scale(sv_acc);
                alpha[0] *= r;
                alpha[1] *= r;
                sv_acc = sv;
            }
        };
        // O += P_j V_j (issued, not awaited), a m64n64 product per 64 columns of V (one m64n128 over both
        // halves is slower). FP8: V^T's rows 64ch.. are those columns, and a step of 32 keys is 32 bytes of its rows.
        auto issue_pv = [&](int j) {
            const int u = kv_base + j, s = u % HATTN_FWD_STAGES;
            const unsigned char* v_tile = smem + S::V + s * S::KV_BYTES;
            hattn_bar_wait(v_full + s, (u / HATTN_FWD_STAGES) & 1);
            hattn_wgmma_fence();
            if constexpr (FP8) {
#pragma unroll
                for (int kk = 0; kk < BN / 32; kk++)
#pragma unroll
                    for (int ch = 0; ch < HD / 64; ch++)
                        hattn_wgmma_rs_e4m3(&o[8 * ch][0], pa[kk], desc(v_tile + ch * 64 * 128 + kk * 32), 1);
            } else {
#pragma unroll
                for (int kk = 0; kk < BN / 16; kk++)       // 16 keys per step: 16 rows of V
#pragma unroll
                    for (int ch = 0; ch < CH; ch++)
                        hattn_wgmma_rs<64, 1>(&o[8 * ch][0], pa[kk], desc(v_tile + ch * BN * 128 + kk * 16 * 128), 1);
            }
            hattn_wgmma_commit();
        };
        // P as the A operand of P V: BF16, or E4M3 times ATTN_FP8_P_SCALE.
        auto pack_p = [&] {
            if constexpr (FP8) attention_pack_a_e4m3<BN>(pa, sc, ATTN_FP8_P_SCALE);
            else attention_pack_a<BN>(pa, sc);
        };

        // The consumers take turns at the tensor cores, in a ring (HATTN_FWD_BAR_TURN): one issues its products
        // while the others run their softmax. Each has nkv + 1 issue points in a tile; the last consumer opens the
        // tile with an arrival for consumer 0 and skips its last one, so every bar.sync (256 threads: the waiter
        // and its predecessor) meets exactly one matching arrival, tile by tile.
        int turns_left = nkv + 1;
        auto turn_begin = [&] { hattn_sync(HATTN_FWD_BAR_TURN + c, 256); };
        auto turn_end = [&] {
            if (--turns_left > 0 || c < NC - 1) hattn_arrive(HATTN_FWD_BAR_TURN + (c + 1) % NC, 256);
        };
        if (c == NC - 1) hattn_arrive(HATTN_FWD_BAR_TURN + 0, 256);

        // Load: this tile's Q (at HD = 128 into registers, and its buffer released).
        hattn_bar_wait(q_full + qb, (it / QB) & 1);
        if constexpr (Q_IN_REGS) {   // qa[kk][j]: row 16 warp + g (+ 8 for odd j), columns 16 kk + 2t (+ 8 for j >= 2)
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int r = 16 * warp + g + 8 * (j % 2), unit = (kk % 4) * 2 + j / 2;   // 16-byte unit, swizzled
                    qa[kk][j] = *reinterpret_cast<const uint32_t*>(q_tile + (kk / 4) * BM * 128 + hattn_sw128(r, unit) + 4 * t);
                }
            hattn_bar_arrive(q_empty + qb);             // Q is in registers: the next tile's may load
        }
        // Scores and softmax of K/V tile 0, the pipeline's first stage.
        turn_begin();
        issue_scores(0);
        turn_end();
        hattn_wgmma_wait<0>();
        hattn_fence_regs<BN / 2>(&sc[0][0]);
        hattn_bar_arrive(k_empty + kv_base % HATTN_FWD_STAGES);
        softmax(0);
        follow_v_scale(0);
        pack_p();
        // The pipeline keeps the tensor cores fed while the exponentials run: with P_j ready (bf16, registers),
        // S_{j+1} is issued, then O += P_j V_j behind it; once S_{j+1} has landed its softmax runs while P_j V_j
        // is still on the tensor cores. O is rescaled by alpha and P_{j+1} converted only after that product has
        // finished: ptxas serializes every wgmma when a register of an unfinished one is written (C7515).
        for (int j = 0; j + 1 < nkv_c; j++) {
            turn_begin();
            issue_scores(j + 1);
            issue_pv(j);
            turn_end();
            hattn_wgmma_wait<1>();                     // groups complete in order: the scores first
            hattn_fence_regs<BN / 2>(&sc[0][0]);
            hattn_bar_arrive(k_empty + (kv_base + j + 1) % HATTN_FWD_STAGES);
            softmax(j + 1);
            hattn_wgmma_wait<0>();
            hattn_fence_regs<HD / 2>(&o[0][0]);
            hattn_bar_arrive(v_empty + (kv_base + j) % HATTN_FWD_STAGES);
            follow_v_scale(j + 1);
            attention_rescale_rows<HD / 8>(o, alpha);
            pack_p();
        }
        if constexpr (!Q_IN_REGS) hattn_bar_arrive(q_empty + qb);   // every product reading Q has completed
        // The last product, O += P V of this consumer's last K/V tile.
        turn_begin();
        issue_pv(nkv_c - 1);
        turn_end();
        hattn_wgmma_wait<0>();
        hattn_fence_regs<HD / 2>(&o[0][0]);
        hattn_bar_arrive(v_empty + (kv_base + nkv_c - 1) % HATTN_FWD_STAGES);
        for (int j = nkv_c; j < nkv; j++) {             // the tiles past this consumer's rows: one turn each, as
            const int u = kv_base + j, s = u % HATTN_FWD_STAGES;   // the others have, and a release of the loads
            turn_begin();
            hattn_bar_wait(k_full + s, (u / HATTN_FWD_STAGES) & 1);
            hattn_bar_arrive(k_empty + s);
            hattn_bar_wait(v_full + s, (u / HATTN_FWD_STAGES) & 1);
            hattn_bar_arrive(v_empty + s);
            turn_end();
        }
        // Store: O / l and lse of the consumer's rows.
        attention_finish_rows<HD>(o, m, l, lse + ((size_t)b * NH + h) * T, row_base, T, lane);
        const float out_scale = FP8 ? 1.0f / (ATTN_FP8_P_SCALE * sv_acc) : 1.0f;
        attention_store_strip<HD>(out + (size_t)b * T * NH * HD + h * HD, NH * HD, row_base, T, o, out_scale, lane);
        kv_base += nkv;
    }
#endif
}

// ---- Hopper backward. One block per (128-key tile, KV head, batch), ordered by key tile over the whole
// grid (the first key tiles see the most query tiles: longest first). Consumer w owns keys 64w..64w+63 of
// the tile and keeps their dK, dV in registers. The block walks the query tiles at or after its keys from the
// last to the first and, for each, the query heads of its group; per (key tile, query tile) step:
//   S^T = K Q^T, dP^T = V dO^T                (both operands K-major)
//   P^T = exp2(S^T log2(e)/sqrt(HD) - lse2), dS^T = P^T * (dP^T - D)      (registers)
//   dV += P^T dO, dK += dS^T Q                (A from registers, B MN-major)
//   dS^T -> shared memory; dQ (hattn_dq_rows; both operands MN-major): at HD = 64 consumer w's
//     dQ^T = K^T dS^T for the step's queries 32w..32w+31, at HD = 128 consumer i % 2's dQ = dS K, all of it
// That is the 5-GEMM algorithm: nothing is recomputed. At HD = 64 consecutive steps overlap (below).

// dQ is summed over key tiles in a fixed order, so two runs give the same bits: the FP32 accumulator tile of
// (query tile, head, j) receives key tile 0's dQ tile j as a copy, then key tile 1's as an add, and so on.
// Each tile has a turn counter. A consumer stages the dQ tiles it formed in shared memory (two of each, by
// step parity) and goes on; the writer of tile j, one thread of the producer warpgroup, waits until the
// counter reads kt, hands the tile to the TMA (a bulk copy, or a bulk FP32 add performed in L2) and passes
// the turn on once that has completed, at its next step, so that neither the consumer nor the writer waits
// for the TMA (a writer that waits for its own add to pass the turn at once is much slower).
// attention_backward_dq_kernel_hopper then turns the accumulator into the BF16 dQ. The other deterministic
// sums cost more: a dQ slot per step summed by a later kernel moves a gigabyte more at the 1b preset, and a
// consumer waiting for the turn itself stalls its products.

// A block waits only for blocks of lower key tiles, which never wait for it and have lower block indices:
// the GPU starts blocks in index order, so those have an SM or are done. (CUDA does not document that order;
// deterministic split-K GEMMs rely on it the same way. If it changed, a block could wait for one that never
// starts.) Every block of a (batch, KV head) visits the (query tile, head) pairs in the same order, starting
// from the same pair, so a block finds its turn ready or one step away; visiting the heads in the outer loop
// instead (each block's query tiles of a head, then the next head) lets key tile kt fall 2 kt steps further
// behind at every head.

// Named barriers of the Hopper backward (ids for hattn_sync / hattn_arrive; 0 is __syncthreads).
enum HattnBwdBarrier : int {
    HATTN_BWD_BAR_DS = 1,        // HD = 64: both consumers wait until both halves of the step's dS^T are written
    HATTN_BWD_BAR_STORE = 2,     // + w: consumer w's 128 threads wait, around its TMA store of dV / dK rows
    HATTN_BWD_BAR_DS_STEP = 4,   // + i % 2, HD = 128: step i's dQ consumer waits; the other arrives, its dS^T written
};
static_assert(HATTN_BWD_BAR_STORE + HATTN_CONSUMERS <= HATTN_BWD_BAR_DS_STEP && HATTN_BWD_BAR_DS_STEP + 2 <= 16,
              "the backward's named barrier ids are distinct and below 16");
template <int HD>
__global__ void __launch_bounds__(HATTN_THREADS, 1)
attention_backward_hopper_kernel(float* dq_acc, int* dq_turn, const float* lse2, const float* delta,
                                 const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap kv_map,
                                 const __grid_constant__ CUtensorMap do_map, const __grid_constant__ CUtensorMap dkv_map,
                                 int B, int T, int NH, int NKV) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef HattnSmem<HD> S;
    constexpr int CH = S::CH, BM = HATTN_BWD_BM, BN = HATTN_BWD_BN;
    extern __shared__ unsigned char hattn_smem_raw[];
    unsigned char* smem = hattn_smem_base(hattn_smem_raw);
    const uint64_t sw128 = hattn_desc(smem, 1024, HATTN_SW128);   // every operand tile: 128-byte swizzle, 8 rows = 1024 bytes
    auto desc = [&](const unsigned char* tile) { return hattn_desc_at(sw128, (uint32_t)(tile - smem)); };
    const uint64_t sw64 = hattn_desc(smem, 512, HATTN_SW64);      // HD = 64, dS^T: 64-byte swizzle, 8 rows = 512 bytes
    // HD = 128, K as dQ's B operand (MN-major): the leading offset steps from one 64-column chunk to the next
    const uint64_t k_cols = hattn_desc(smem, 1024, HATTN_SW128, S::chunk(BN));
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S::BWD_BAR);
    uint64_t* kv_full = bars;                                 // then per stage: full, empty
    uint64_t* st_full = bars + 1;
    uint64_t* st_empty = st_full + HATTN_BWD_STAGES;
    uint64_t* dq_full = st_empty + HATTN_BWD_STAGES;           // per (consumer, staging tile): staged, then free
    uint64_t* dq_empty = dq_full + 2 * HATTN_CONSUMERS;

    const int Tp = attention_padded_T(T), nq = Tp / BM;
    int kt, kvh, b;
    hattn_bwd_block(blockIdx.x, (T + BN - 1) / BN, NKV, B, &kt, &kvh, &b);
    const int group = NH / NKV;
    const int k0 = kt * BN, first_qt = k0 / BM;              // query tiles first_qt..nq-1 see keys of this tile
    const int steps = group * (nq - first_qt);
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);   // warp-uniform to the compiler, as the forward's

    if (threadIdx.x == 0) {
        hattn_bar_init(kv_full, 1);
        for (int s = 0; s < HATTN_BWD_STAGES; s++) {
            hattn_bar_init(st_full + s, 1);
            hattn_bar_init(st_empty + s, 128 * HATTN_CONSUMERS);
        }
        for (int j = 0; j < 2 * HATTN_CONSUMERS; j++) {
            hattn_bar_init(dq_full + j, 128);
            hattn_bar_init(dq_empty + j, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Producer warpgroup: thread 0 loads K and V once, then the (Q, dO, lse2, D) stage of every step; the first
    // thread of warp 1 + w writes dQ tile w of every step into the accumulator, in its turn.
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(HATTN_PRODUCER_REGS));
        if (threadIdx.x == 0) {
            hattn_bar_expect(kv_full, 2 * S::BWD_KV_BYTES);
            for (int ch = 0; ch < CH; ch++) {
                hattn_tma_load(smem + S::BWD_K + ch * S::chunk(BN), &kv_map, kv_full, (NH + kvh) * HD + 64 * ch, k0, b);
                hattn_tma_load(smem + S::BWD_V + ch * S::chunk(BN), &kv_map, kv_full, (NH + NKV + kvh) * HD + 64 * ch, k0, b);
            }
            for (int i = 0; i < steps; i++) {
                const int s = i % HATTN_BWD_STAGES;
                int h, qt;
                hattn_bwd_step(i, group, kvh, nq, &h, &qt);
                if (i >= HATTN_BWD_STAGES) hattn_bar_wait(st_empty + s, ((i / HATTN_BWD_STAGES) + 1) & 1);
                unsigned char* stage = smem + S::BWD_STAGE + s * S::BWD_STAGE_BYTES;
                unsigned char* rows = smem + S::BWD_ROWS + s * S::BWD_ROWS_BYTES;
                hattn_bar_expect(st_full + s, S::BWD_STAGE_BYTES + S::BWD_ROWS_BYTES);
                for (int ch = 0; ch < CH; ch++) {
                    hattn_tma_load(stage + ch * S::chunk(BM), &q_map, st_full + s, h * HD + 64 * ch, qt * BM, b);
                    hattn_tma_load(stage + S::BWD_Q_BYTES + ch * S::chunk(BM), &do_map, st_full + s, h * HD + 64 * ch, qt * BM, b);
                }
                const size_t row0 = ((size_t)b * NH + h) * Tp + (size_t)qt * BM;
                hattn_bulk_load(rows, lse2 + row0, BM * 4, st_full + s);
                hattn_bulk_load(rows + BM * 4, delta + row0, BM * 4, st_full + s);
            }
        } else if (threadIdx.x % 32 == 0 && threadIdx.x / 32 <= HATTN_CONSUMERS) {   // warp 1 + w: dQ tile w's writer
            const int w = threadIdx.x / 32 - 1;
            // The turn counter of the last step's tile, or null where no later key tile adds to it (query tiles
            // 2 kt and 2 kt + 1 end with this key tile): then nobody waits, and the block's last steps are such.
            int* pass = nullptr;
            for (int i = 0; i < steps; i++) {
                const int buf = i % 2;
                int h, qt;
                hattn_bwd_step(i, group, kvh, nq, &h, &qt);
                hattn_bar_wait(dq_full + 2 * w + buf, (i / 2) & 1);
                if (i > 0) {   // the last step's add (a step ago: done by now, mostly): pass its turn on, free its tile
                    if (pass) hattn_turn_pass_after_bulk(pass);
                    else hattn_bulk_wait_read();
                    hattn_bar_arrive(dq_empty + 2 * w + 1 - buf);
                }
                const size_t tile = attention_dq_tile(b, h, qt, w, NH, nq);
                hattn_turn_wait(dq_turn + tile, kt);
                pass = qt / 2 > kt ? dq_turn + tile : nullptr;
                const unsigned char* stage = smem + S::BWD_DQ + (2 * w + buf) * S::BWD_DQ_BYTES;
                float* acc = dq_acc + tile * S::BWD_DQ_BYTES / 4;
                if (kt == 0) hattn_bulk_store(acc, stage, S::BWD_DQ_BYTES);
                else hattn_bulk_add_f32(acc, stage, S::BWD_DQ_BYTES);
                hattn_bulk_commit();
            }
            hattn_bulk_wait_read();                           // the last step's tile: query tile 2 kt, nobody waits
        }
        return;
    }
    // Consumers: warpgroup 1 + w owns keys 64w..64w+63 of the tile.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(hattn_consumer_regs(HATTN_CONSUMERS)));
    const int w = wg - 1;
    // The index math stays after the setmaxnreg: computed before it, it slows the HD = 64 kernel by 15% (cause
    // unknown: the PTX is equal up to register names).
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int key_base = k0 + 64 * w + 16 * warp;            // this warp's first key row
    const float scale = rsqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    const unsigned char* k_tile = smem + S::BWD_K;
    const unsigned char* v_tile = smem + S::BWD_V;

    float dk[HD / 8][4], dv[HD / 8][4];
    attention_zero<HD / 8>(dk);
    attention_zero<HD / 8>(dv);
    hattn_bar_wait(kv_full, 0);

    // The phases of step i, as lambdas that the two schedules below (HD = 64, HD = 128) order:
    //   issue_scores(i)      S^T = K Q^T, dP^T = V dO^T
    //   grads_of_scores(i)   P^T, dS^T = P^T * (dP^T - D); dV += P^T dO, dK += dS^T Q; dS^T to shared memory
    //   issue_dq(i)          dQ^T = K^T dS^T (HD = 64) or dQ = dS K (HD = 128), once both consumers' dS^T is in
    //   stage_dq(i)          dQ into its staging tiles, for the writers
    // Each issue_ only issues and commits its wgmmas; the schedule waits for them.

    // S^T = K Q^T and dP^T = V dO^T of step i into st, dpt (issued and committed, not waited for).
    float st[BM / 8][4], dpt[BM / 8][4];
    auto issue_scores = [&](int i) {
        const int s = i % HATTN_BWD_STAGES;
        const unsigned char* stage = smem + S::BWD_STAGE + s * S::BWD_STAGE_BYTES;
        hattn_bar_wait(st_full + s, (i / HATTN_BWD_STAGES) & 1);
        hattn_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            const int ch = kk / 4, off = (kk % 4) * 32;
            const int krow = ch * S::chunk(BN) + 64 * w * 128 + off;
            hattn_wgmma_ss<BM, 0, 0>(&st[0][0], desc(k_tile + krow),
                                     desc(stage + ch * S::chunk(BM) + off), kk > 0);
            hattn_wgmma_ss<BM, 0, 0>(&dpt[0][0], desc(v_tile + krow),
                                     desc(stage + S::BWD_Q_BYTES + ch * S::chunk(BM) + off), kk > 0);
        }
        hattn_wgmma_commit();
    };
    // Step i's dQ (complete in dq) into its staging tiles, for the writers to add in their turn (see above):
    // at HD = 64 this consumer's dQ^T, tile w; at HD = 128 the whole dQ, tiles 0 and 1 (dq[n] of n < 8, n >= 8).
    // dq[n] holds rows 16 warp + g (+ 8) and columns 8n + 2t (+ 1): 64 queries x HD head columns (rows) or 64
    // head rows x 32 queries (dQ^T, HD = 64 only).
    constexpr bool ROWS = hattn_dq_rows<HD>();
    static_assert(ROWS || HD == 64, "dQ^T tiles cover all head rows only at HD = 64");
    constexpr int DQ_COLS = S::BWD_DQ_COLS;                      // of a dQ tile
    constexpr int DQ_TILES = ROWS ? HD / DQ_COLS : 1;            // formed by a consumer at a step
    static_assert(!ROWS || DQ_TILES == HATTN_CONSUMERS, "at HD = 128 the dQ tiles of a step are one a writer");
    constexpr int DQ_FLOATS = DQ_TILES * DQ_COLS / 2;            // a thread's share
    float dq[DQ_FLOATS / 4][4];
    auto stage_dq = [&](int i) {
        const int buf = i % 2;
#pragma unroll
        for (int j = 0; j < DQ_TILES; j++) {                     // dq[DQ_COLS / 8 j ..] into dQ tile j (rows) or w
            const int tile = ROWS ? j : w;
            float* dq_stage = reinterpret_cast<float*>(smem + S::BWD_DQ + (2 * tile + buf) * S::BWD_DQ_BYTES);
            if (i >= 2) hattn_bar_wait(dq_empty + 2 * tile + buf, ((i / 2) + 1) & 1);
#pragma unroll
            for (int n = 0; n < DQ_COLS / 8; n++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int row = 16 * warp + g + 8 * half, col = 8 * n + 2 * t;
                    const float* d = dq[j * DQ_COLS / 8 + n];
                    *reinterpret_cast<float2*>(dq_stage + row * DQ_COLS + (col ^ attention_dq_swizzle(row))) =
                        make_float2(d[2 * half], d[2 * half + 1]);
                }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // make the stores visible to the TMA
#pragma unroll
        for (int j = 0; j < DQ_TILES; j++) hattn_bar_arrive(dq_full + 2 * (ROWS ? j : w) + buf);
    };

    // Step i's P^T = exp2(S^T scale_log2 - lse2) and dS^T = P^T * (dP^T - D) (its scores complete in st, dpt);
    // issues and commits dV += P^T dO, dK += dS^T Q (not waited for: pa and dsa stay untouched until then) and
    // writes dS^T to shared memory for the dQ product, under those products; or, with arrive_first (a consumer
    // that only arrives at the step's dQ barrier), first dS^T and the arrival, so that the consumer waiting
    // there goes on sooner.
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];
    auto grads_of_scores = [&](int i, auto arrive_first) {
        const int s = i % HATTN_BWD_STAGES;
        int h, qt;
        hattn_bwd_step(i, group, kvh, nq, &h, &qt);
        const unsigned char* stage = smem + S::BWD_STAGE + s * S::BWD_STAGE_BYTES;
        const unsigned char* q_tile = stage;
        const unsigned char* do_tile = stage + S::BWD_Q_BYTES;
        const float* lse_q = reinterpret_cast<const float*>(smem + S::BWD_ROWS + s * S::BWD_ROWS_BYTES);
        const float* delta_q = lse_q + BM;
        // P^T and dS^T in registers (the causal mask only where some query row of the step precedes a key), then
        // as bf16 A operands for dV and dK.
        const bool diagonal = qt * BM < key_base - 16 * warp + 64;
        float pt[BM / 8][4], dst[BM / 8][4];
#pragma unroll
        for (int n = 0; n < BM / 8; n++) {
            const float2 lse_n = *reinterpret_cast<const float2*>(lse_q + n * 8 + 2 * t);   // columns 2t, 2t + 1
            const float2 delta_n = *reinterpret_cast<const float2*>(delta_q + n * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = key_base + g + 8 * (e / 2), col = n * 8 + 2 * t + e % 2;
                const float lse_c = e % 2 ? lse_n.y : lse_n.x, delta_c = e % 2 ? delta_n.y : delta_n.x;
                const float p = (!diagonal || key <= qt * BM + col) ? attention_exp2(fmaf(st[n][e], scale_log2, -lse_c)) : 0.0f;
                pt[n][e] = p;                                    // P^T
                dst[n][e] = p * (dpt[n][e] - delta_c);           // dS^T
            }
        }
        attention_pack_a(pa, pt);
        attention_pack_a(dsa, dst);
        // dS^T (bf16) into shared memory, in the layout the dQ product reads (16-byte unit u of key row r): rows,
        // [128 keys x 128 bytes] with the 128-byte swizzle (u at u ^ (r % 8)); dQ^T, two blocks of 32 query
        // columns, each [128 keys x 64 bytes] with the 64-byte swizzle (u at u ^ ((r / 2) % 4)). The last readers
        // of this buffer, the dQ products of step i - 2, are complete: a consumer reaches the dQ barrier of step
        // i - 1 only after waiting for the ones it issued, and at least the consumer that did not issue them (at
        // HD = 64 both) waits at that barrier before going on.
        auto store_ds = [&] {
            unsigned char* ds = smem + S::BWD_DS + (i % 2) * S::BWD_DS_BYTES;
#pragma unroll
            for (int n = 0; n < BM / 8; n++) {
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int r = 64 * w + 16 * warp + g + 8 * half;                 // key row within the tile
                    // rows: n is the 16-byte unit; dQ^T: the 32-column block n / 4, its 16-byte unit n % 4
                    unsigned char* p = ROWS ? ds + hattn_sw128(r, n) + 4 * t
                                            : ds + (n / 4) * (BN * 64) + r * 64 + (((n % 4) ^ ((r >> 1) & 3)) * 16) + 4 * t;
                    *reinterpret_cast<uint32_t*>(p) = dsa[n / 2][2 * (n % 2) + half];   // the A fragment holds these bf16 pairs
                }
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // make the stores visible to wgmma
        };
        if constexpr (decltype(arrive_first)::value) {   // HD = 128, the consumer not forming this step's dQ
            store_ds();
            hattn_arrive(HATTN_BWD_BAR_DS_STEP + i % 2, 128 * HATTN_CONSUMERS);
        }
        // dV += P^T dO, dK += dS^T Q (issued and committed, not waited for).
        hattn_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) {   // 16 query rows per step
#pragma unroll
            for (int ch = 0; ch < CH; ch++) {
                const int qrow = ch * S::chunk(BM) + kk * 16 * 128;
                hattn_wgmma_rs<64, 1>(&dv[8 * ch][0], pa[kk], desc(do_tile + qrow), 1);
                hattn_wgmma_rs<64, 1>(&dk[8 * ch][0], dsa[kk], desc(q_tile + qrow), 1);
            }
        }
        hattn_wgmma_commit();

        if constexpr (!decltype(arrive_first)::value) store_ds();
    };
    // Once both consumers have written step i's dS^T: this consumer's part of the step's dQ into dq (issued and
    // committed, not waited for). Rows: A = dS (the dS^T tile read MN-major), B = K (MN-major, both 64-column
    // chunks: the leading offset steps from one to the other); dQ^T: A = K^T (K MN-major), B = its 32 columns of
    // dS^T (MN-major). Rows waits at HATTN_BWD_BAR_DS_STEP + i % 2, which the other consumer only arrives at
    // (step i's barrier has completed before either consumer comes to step i + 2's: each waits at the one between).
    auto issue_dq = [&](int i) {
        const unsigned char* ds = smem + S::BWD_DS + (i % 2) * S::BWD_DS_BYTES;
        hattn_sync(ROWS ? HATTN_BWD_BAR_DS_STEP + i % 2 : HATTN_BWD_BAR_DS, 128 * HATTN_CONSUMERS);   // all of dS^T written
        hattn_wgmma_fence();
        if constexpr (ROWS) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)                 // 16 keys per step
                hattn_wgmma_ss<HD, 1, 1>(&dq[0][0], desc(ds + kk * 16 * 128),
                                         hattn_desc_at(k_cols, (uint32_t)(k_tile + kk * 16 * 128 - smem)), kk > 0);
        } else {
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)
                hattn_wgmma_ss<32, 1, 1>(&dq[0][0], desc(k_tile + kk * 16 * 128),
                                         hattn_desc_at(sw64, (uint32_t)(ds + w * (BN * 64) + kk * 16 * 64 - smem)), kk > 0);
        }
        hattn_wgmma_commit();
    };
    auto fence_grads = [&] {
        hattn_fence_regs<HD / 2>(&dv[0][0]);
        hattn_fence_regs<HD / 2>(&dk[0][0]);
    };
    auto fence_scores = [&] {
        hattn_fence_regs<BM / 2>(&st[0][0]);
        hattn_fence_regs<BM / 2>(&dpt[0][0]);
    };

    if constexpr (HD == 64) {
        // The products of consecutive steps overlap: step i's dV and dK run while this consumer writes dS^T and
        // meets the other at the barrier; step i's dQ^T and step i + 1's S^T and dP^T queue behind them, and dQ^T
        // is staged while the scores run (dQ^T first: the next key tile's block waits for it). wait<N> waits until
        // at most the N newest committed groups are pending; ptxas tracks these counts only for groups committed
        // in the same loop iteration (a wait at the top of the loop for groups of the previous iteration makes it
        // serialize every wgmma, C7514), so an iteration begins where one group, step i's dV and dK, is pending.
        // K and V stay in shared memory: as register A operands of S^T and dP^T they leave ptxas too few
        // registers, and it serializes the wgmmas (C7512).
        fence_grads();                                           // dK, dV = 0 written before the wgmma fences
        issue_scores(0);
        hattn_wgmma_wait<0>();
        fence_scores();
        grads_of_scores(0, std::false_type());
        for (int i = 0; i < steps - 1; i++) {                    // pending: dV, dK of step i
            issue_dq(i);
            issue_scores(i + 1);
            hattn_wgmma_wait<1>();                               // dV, dK and dQ^T of step i
            fence_grads();
            hattn_fence_regs<DQ_FLOATS>(&dq[0][0]);
            hattn_bar_arrive(st_empty + i % HATTN_BWD_STAGES);   // Q and dO of step i are no longer read
            stage_dq(i);
            hattn_wgmma_wait<0>();                               // S^T, dP^T of step i + 1
            fence_scores();
            grads_of_scores(i + 1, std::false_type());
        }
        issue_dq(steps - 1);
        hattn_wgmma_wait<0>();
        fence_grads();
        hattn_fence_regs<DQ_FLOATS>(&dq[0][0]);
        hattn_bar_arrive(st_empty + (steps - 1) % HATTN_BWD_STAGES);
        stage_dq(steps - 1);
    } else {
        // HD = 128: each consumer's products in turn, and the step's dQ (all 128 keys, both dS^T halves) by
        // consumer i % 2 alone, after its dV and dK (dq's 64 registers fit beside dK and dV only once pa and dsa,
        // their A operands, are free); the other consumer arrives at the dQ barrier and goes on to step i + 1, so
        // that its scores run under this dQ. The registers do not hold the HD = 64 overlap (dK and dV alone take
        // 128 a thread); partial overlaps spill. A dQ warpgroup of its own does not fit the register file either:
        // 24 + 48 + 2 x 224 > 512 a thread slot (ptxas ignores a setmaxnreg under 48 in a region that issues
        // wgmma, C7507, and the consumers below 224 spill and serialize their wgmmas).
        auto step = [&](int i, auto with_dq) {
            issue_scores(i);
            hattn_wgmma_wait<0>();
            fence_scores();
            if constexpr (decltype(with_dq)::value) grads_of_scores(i, std::false_type());
            else grads_of_scores(i, std::true_type());   // dS^T stored and the dQ barrier arrived at first
            hattn_wgmma_wait<0>();
            fence_grads();
            hattn_bar_arrive(st_empty + i % HATTN_BWD_STAGES);   // Q and dO of step i are no longer read
            if constexpr (decltype(with_dq)::value) {
                issue_dq(i);
                hattn_wgmma_wait<0>();
                hattn_fence_regs<DQ_FLOATS>(&dq[0][0]);
                stage_dq(i);
            }
        };
        for (int i = 0; i < steps; i++) {
            if (i % 2 == w) step(i, std::true_type());
            else step(i, std::false_type());
        }
    }
    // Store: dV, then dK, out through this consumer's 64 rows of the V tile, which no product reads any more
    // (only its own dP^T read them): BF16, 128-byte swizzled as the TMA loaded them, then one TMA store a
    // 64-column chunk (rows past T are not written), cheaper for the consumers than plain 4-byte stores from
    // the fragments. One thread waits until the store has read the rows before dK.
    unsigned char* rows_out = smem + S::BWD_V + 64 * w * 128;
    auto store_rows = [&](const float (*acc)[4], float mul, int col0) {
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int r = 16 * warp + g + 8 * half, ch = n / 8, unit = n % 8;   // columns 8n + 2t, 8n + 2t + 1
                *reinterpret_cast<__nv_bfloat162*>(rows_out + ch * S::chunk(BN) + hattn_sw128(r, unit) + 4 * t) =
                    __floats2bfloat162_rn(acc[n][2 * half] * mul, acc[n][2 * half + 1] * mul);
            }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // make the stores visible to the TMA
        hattn_sync(HATTN_BWD_BAR_STORE + w, 128);
        if (threadIdx.x % 128 == 0) {
            for (int ch = 0; ch < CH; ch++) hattn_tma_store(&dkv_map, rows_out + ch * S::chunk(BN), col0 + 64 * ch, k0 + 64 * w, b);
            hattn_bulk_commit();
            hattn_bulk_wait_read();
        }
        hattn_sync(HATTN_BWD_BAR_STORE + w, 128);
    };
    store_rows(dv, 1.0f, (NH + NKV + kvh) * HD);
    store_rows(dk, scale, (NH + kvh) * HD);
#endif
}

// dQ = (the summed dQ tiles of the accumulator) / sqrt(HD) into the Q columns of dqkv: a 64 x 64 (query x head
// column) tile per block. At HD = 128 the tile is dQ tile d0 / 64, already [query][column]: each thread
// reads a float2 (the swizzle moves columns by multiples of 8, so a pair stays adjacent) and writes the BF16
// pair. At HD = 64 it is the two consumers' dQ^T tiles, transposed through shared memory so that both the reads
// and the writes are coalesced.
template <int HD>
__global__ void attention_backward_dq_kernel_hopper(bf16* dqkv, const float* dq_acc, int B, int T, int NH, int NKV) {
    constexpr int THREADS = 256, COLS = HATTN_BWD_DQ_COLS;
    const int nq = attention_padded_T(T) / HATTN_BWD_BM;
    const int qt = blockIdx.x, d0 = blockIdx.y * 64 % HD, h = blockIdx.y * 64 / HD, b = blockIdx.z;
    const float scale = rsqrtf((float)HD);
    constexpr int TILE_FLOATS = HattnSmem<HD>::BWD_DQ_BYTES / 4;
    const int C3 = (NH + 2 * NKV) * HD, q0 = qt * HATTN_BWD_BM;
    auto store_pair = [&](int q, int d, float x, float y) {   // head columns d, d + 1 of query q0 + q
        *reinterpret_cast<__nv_bfloat162*>(dqkv + ((size_t)b * T + q0 + q) * C3 + h * HD + d0 + d) =
            __floats2bfloat162_rn(x * scale, y * scale);
    };
    if constexpr (hattn_dq_rows<HD>()) {   // [query][column], dQ tile d0 / 64
        const float* src = dq_acc + attention_dq_tile(b, h, qt, d0 / 64, NH, nq) * TILE_FLOATS;
        for (int i = threadIdx.x; i < 64 * 32; i += THREADS) {
            const int q = i / 32, d = 2 * (i % 32);
            if (q0 + q < T) {
                const float2 v = __ldcs(reinterpret_cast<const float2*>(src + q * 64 + (d ^ attention_dq_swizzle(q))));
                store_pair(q, d, v.x, v.y);
            }
        }
    } else {                               // [head row][query], consumer w's queries 32w..32w+31 (d0 = 0)
        __shared__ float tile[64][65];     // [head column][query of the tile]
        for (int i = threadIdx.x; i < HATTN_CONSUMERS * 64 * COLS; i += THREADS) {
            const int w = i / (64 * COLS), d = i / COLS % 64, stored = i % COLS;
            const float* src = dq_acc + attention_dq_tile(b, h, qt, w, NH, nq) * TILE_FLOATS;
            tile[d][w * COLS + (stored ^ attention_dq_swizzle(d))] = __ldcs(src + d * COLS + stored);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < 64 * 32; i += THREADS) {
            const int q = i / 32, d = 2 * (i % 32);
            if (q0 + q < T) store_pair(q, d, tile[d][q], tile[d + 1][q]);
        }
    }
}

// ----------------------------------------------------------------------------------------------
// What the cast does to 8 columns of Q or K (row `row` of qkv, from column `col`) as it reads them: nothing here;
// llama2.cuh's RoPE rotates them and writes the rotated values back, so that the rotation and the cast are one pass.
struct AttentionFp8Plain {
    __device__ void operator()(Packed128<bf16>&, size_t, int) const {}
};
// Block (128 tokens from t0, head column block hh of qkv, batch b), 4 vectors of 8 columns a thread. The tile is
// read once into registers; its amax (for Q, one per 64 rows) sets the scale; then a Q or K head is cast row by
// row, and a V head goes through shared memory to leave as 128 keys of each of its HD rows of vt8.
template <int HD>
constexpr int attention_fp8_cast_threads() { return HATTN_FWD_BN * HD / 8 / 4; }
template <int HD, class Produce>
__global__ void __launch_bounds__(attention_fp8_cast_threads<HD>(), 2)
attention_fp8_cast_kernel(AttentionFp8Inputs in, const bf16* qkv, int T, int NH, int NKV, Produce produce) {
    constexpr int ROWS = HATTN_FWD_BN, THREADS = attention_fp8_cast_threads<HD>(), WARPS = THREADS / 32, VECS = 4;
    const int t0 = blockIdx.x * ROWS, hh = blockIdx.y, b = blockIdx.z, C3 = (NH + 2 * NKV) * HD;
    const int Tp = attention_fp8_padded_T(T), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const bf16* src = qkv + (size_t)b * T * C3 + hh * HD;
    Packed128<bf16> x[VECS];        // vectors 0 and 1 lie in rows 0-63, 2 and 3 in rows 64-127
    unsigned int m[2] = {0u, 0u};   // amax bits of rows 0-63 and 64-127
#pragma unroll
    for (int v = 0; v < VECS; v++) {
        const int i = threadIdx.x + THREADS * v, r = i / (HD / 8), c = i % (HD / 8) * 8;
        if (t0 + r < T) {
            x[v] = load128(src + (size_t)(t0 + r) * C3 + c);
            if (hh < NH + NKV) produce(x[v], (size_t)b * T + t0 + r, hh * HD + c);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) x[v].v[k] = __float2bfloat16(0.0f);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) m[v / (VECS / 2)] = max(m[v / (VECS / 2)], abs_bits(to_float(x[v].v[k])));
    }
    __shared__ unsigned int warp_max[2][WARPS];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        for (int o = 16; o > 0; o >>= 1) m[half] = max(m[half], __shfl_xor_sync(0xffffffffu, m[half], o));
        if (lane == 0) warp_max[half][warp] = m[half];
    }
    __shared__ bf16 tile[ROWS][HD + 2];   // V: [key][head column]; +2: odd rows of words for the transposed reads
    const int kvh = hh - NH - NKV;
    if (kvh >= 0) {
#pragma unroll
        for (int v = 0; v < VECS; v++) {
            const int i = threadIdx.x + THREADS * v, r = i / (HD / 8), c = i % (HD / 8) * 8;
#pragma unroll
            for (int k = 0; k < 8; k += 2)
                *reinterpret_cast<__nv_bfloat162*>(&tile[r][c + k]) = __halves2bfloat162(x[v].v[k], x[v].v[k + 1]);
        }
    }
    __syncthreads();
    float scale[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        unsigned int a = 0u;
        for (int w = 0; w < WARPS; w++) a = max(a, warp_max[half][w]);
        m[half] = a;
    }
    if (hh < NH) {   // Q: a scale per 64 rows
        scale[0] = attention_fp8_scale(m[0]);
        scale[1] = attention_fp8_scale(m[1]);
        float* dst = in.q_scale + ((size_t)b * NH + hh) * (Tp / ATTN_FP8_Q_ROWS) + 2 * blockIdx.x;
        if (threadIdx.x < 2) dst[threadIdx.x] = scale[threadIdx.x];
    } else {         // K or V: one for the tile
        scale[0] = scale[1] = attention_fp8_scale(max(m[0], m[1]));
        const int kv = kvh < 0 ? hh - NH : kvh;
        float* dst = (kvh < 0 ? in.k_scale : in.v_scale) + ((size_t)b * NKV + kv) * (Tp / ROWS);
        if (threadIdx.x == 0) dst[blockIdx.x] = scale[0];
    }
    if (kvh < 0) {
        const bool is_q = hh < NH;
        const int pitch = (is_q ? NH : NKV) * HD;
        fp8* dst = (is_q ? in.q + hh * HD : in.k + (hh - NH) * HD) + (size_t)b * T * pitch;
#pragma unroll
        for (int v = 0; v < VECS; v++) {
            const int i = threadIdx.x + THREADS * v, r = i / (HD / 8), c = i % (HD / 8) * 8;
            if (t0 + r >= T) break;
            const float sc = scale[v / (VECS / 2)];
            auto e = [&](int k) { return to_float(x[v].v[k]) * sc; };
            uint2 packed;
            packed.x = fp8x4_encode<E4M3>(e(0), e(1), e(2), e(3));
            packed.y = fp8x4_encode<E4M3>(e(4), e(5), e(6), e(7));
            *reinterpret_cast<uint2*>(dst + (size_t)(t0 + r) * pitch + c) = packed;
        }
        return;
    }
    for (int i = threadIdx.x; i < HD * ROWS / 4; i += blockDim.x) {   // 4 keys (4 bytes) a thread: row d, keys p..p+3
        const int d = i / (ROWS / 4), p = i % (ROWS / 4) * 4, group = p & ~15;
        auto e = [&](int j) { return to_float(tile[group + attention_fp8_key(p % 16 + j)][d]) * scale[0]; };
        fp8* row = in.vt + ((size_t)b * NKV * HD + kvh * HD + d) * Tp;
        *reinterpret_cast<uint32_t*>(row + t0 + p) = fp8x4_encode<E4M3>(e(0), e(1), e(2), e(3));
    }
}

// ----------------------------------------------------------------------------------------------
// Launchers. attention_forward / attention_backward take the Hopper kernels when the build has them
// (GPU_ARCH=sm_90a defines ATTENTION_HOPPER) and the GPU is compute capability 9.0, else the mma.sync
// kernels; `path` forces one (the tests and the benchmark run both).

enum AttentionPath { ATTN_PATH_AUTO, ATTN_PATH_MMA, ATTN_PATH_HOPPER };

inline void attention_check(const char* who, int B, int T, int NH, int NKV, int HD, std::initializer_list<const void*> ptrs) {
    if (B < 1 || T < 1) fail("%s: B=%d and T=%d must be at least 1", who, B, T);
    if (NH < 1 || NKV < 1 || NH % NKV != 0)
        fail("%s: n_heads=%d must be a positive multiple of n_kv_heads=%d", who, NH, NKV);
    if (HD != 64 && HD != 128)
        fail("%s: head_dim=%d is not supported; the attention kernels are built for 64 and 128 (choose dim / n_heads = 64 or 128)", who, HD);
    if ((long)ceil_div(T, ATTN_TILE) * NH * B > INT32_MAX || NH > 65535 || B > 65535)
        fail("%s: B=%d x n_heads=%d x T=%d is past the grid limits (B and n_heads at most 65535; B x n_heads x T/64 below 2^31)", who, B, NH, T);
    for (const void* ptr : ptrs)
        if (!is_aligned16(ptr)) fail("%s: every tensor must be 16-byte aligned (got %p)", who, ptr);
}

// Kernels that need more than 48 KB of shared memory must opt in, once per device: `done` holds a bit per
// device of the call site (a static of each launcher), so a launch makes no host call for it after the first.
inline void attention_set_smem(const void* kernel, size_t bytes, std::atomic<uint64_t>* done) {
    int dev = 0;
    cudaCheck(cudaGetDevice(&dev));
    const uint64_t bit = 1ull << (dev & 63);
    if (done->load(std::memory_order_relaxed) & bit) return;
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    done->fetch_or(bit);
}

// The Hopper kernels exist in builds for sm_90a (the Makefile defines ATTENTION_HOPPER), and such a binary
// runs only on compute capability 9.0, so there they always run.
#if defined(ATTENTION_HOPPER)
constexpr bool attention_hopper_available = true;
#else
constexpr bool attention_hopper_available = false;
#endif

inline bool attention_use_hopper(AttentionPath path, const char* who) {
    if (path == ATTN_PATH_MMA) return false;
    if (path == ATTN_PATH_HOPPER && !attention_hopper_available)
        fail("%s: the Hopper attention kernels need a build for GPU_ARCH=sm_90a", who);
    return attention_hopper_available;
}

// The forward's persistent grid: *blocks, one an SM, and how many neighbouring query tiles of one (batch, head)
// run side by side (qg, returned; tile_of). One wave of the blocks reads the K/V (kv_bytes a KV head) of about
// blocks / (qg * group) KV heads, since the `group` query heads of one KV head are neighbours too. Where those
// exceed the L2 (the D = 128 shapes: 132 blocks x 1 MB), every tile would bring its K/V from memory; qg is the
// smallest power of two that fits them in the L2, and 1 where they fit already (the 1b shape: 17 KV heads x
// 0.5 MB), since groups make the tiles of one wave unequal in length. Host arithmetic only: every build has it
// (the tests print it).
template <int HD, bool FP8 = false>
inline int attention_fwd_query_group(int B, int T, int NH, int NKV, int* blocks) {
    const int ntiles = ceil_div(T, HattnFwdSmem<HD, FP8>::BM), group = NH / NKV;
    *blocks = std::min(ntiles * NH * B, device_sm_count());   // persistent: one block an SM (shared memory allows one)
    const size_t kv_bytes = (size_t)T * HD * 2 * HattnFwdSmem<HD, FP8>::ELEM, l2 = (size_t)device_attribute<cudaDevAttrL2CacheSize>();
    int qg = 1;
    while (qg < ntiles && (size_t)ceil_div(*blocks, qg * group) * kv_bytes > l2) qg *= 2;
    return qg;
}

#if defined(ATTENTION_HOPPER)
// A [B, rows, cols] tensor of `elem` bytes an element (bf16, or 1: FP8 codes) for the TMA: boxes of box_cols
// columns x box_rows rows with the given swizzle; rows past `rows` are outside the tensor and arrive as zeros.
inline CUtensorMap attention_tensor_map(const void* base, int elem, int cols, int rows, int B, int box_cols, int box_rows,
                                        CUtensorMapSwizzle swizzle) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || !fn)
            fail("attention: the driver has no cuTensorMapEncodeTiled (a CUDA 12+ driver is needed for the Hopper kernels)");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    CUtensorMap map;
    cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)B};
    cuuint64_t strides[2] = {(cuuint64_t)cols * elem, (cuuint64_t)cols * elem * rows};
    cuuint32_t box[3] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows, 1};
    cuuint32_t elem_strides[3] = {1, 1, 1};
    CUresult r = encode(&map, elem == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base),
                        dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        fail("attention: cuTensorMapEncodeTiled refused a [%d, %d, %d] tensor of %d-byte elements at %p (CUresult %d)", B, rows, cols,
             elem, base, (int)r);
    return map;
}
// The BF16 tensors of the kernels: [B, T, cols], boxes of 64 columns (128 bytes) x box_rows, 128-byte swizzle.
inline CUtensorMap attention_tensor_map(const bf16* base, int cols, int T, int B, int box_rows) {
    return attention_tensor_map(base, sizeof(bf16), cols, T, B, 64, box_rows, CU_TENSOR_MAP_SWIZZLE_128B);
}

// fp8: nullptr for the BF16 forward from qkv; else the FP8 forward from attention_fp8_cast's tensors.
template <int HD, bool FP8>
inline void attention_forward_hopper(bf16* out, float* lse, const bf16* qkv, const AttentionFp8Inputs* fp8, int B, int T, int NH,
                                     int NKV, cudaStream_t s) {
    static std::atomic<uint64_t> smem_set{0};
    const size_t smem = HattnFwdSmem<HD, FP8>::BYTES;
    attention_set_smem((const void*)attention_forward_hopper_kernel<HD, FP8>, smem, &smem_set);
    const int BM = HattnFwdSmem<HD, FP8>::BM, C3 = (NH + 2 * NKV) * HD;
    CUtensorMap q_map, k_map, v_map;
    if constexpr (FP8) {
        const CUtensorMapSwizzle qk_swizzle = HD == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
        q_map = attention_tensor_map(fp8->q, 1, NH * HD, T, B, HD, BM, qk_swizzle);
        k_map = attention_tensor_map(fp8->k, 1, NKV * HD, T, B, HD, HATTN_FWD_BN, qk_swizzle);
        v_map = attention_tensor_map(fp8->vt, 1, attention_fp8_padded_T(T), NKV * HD, B, HATTN_FWD_BN, HD, CU_TENSOR_MAP_SWIZZLE_128B);
    } else {
        q_map = attention_tensor_map(qkv, C3, T, B, BM);
        k_map = v_map = attention_tensor_map(qkv, C3, T, B, HATTN_FWD_BN);
    }
    int blocks;
    const int qg = attention_fwd_query_group<HD, FP8>(B, T, NH, NKV, &blocks);
    attention_forward_hopper_kernel<HD, FP8><<<blocks, 128 * (1 + hattn_fwd_consumers<HD>()), smem, s>>>(
        out, lse, q_map, k_map, v_map, FP8 ? *fp8 : AttentionFp8Inputs{}, B, T, NH, NKV, qg);
    cudaCheckLaunch();
}

template <int HD>
inline void attention_backward_hopper(bf16* dqkv, float* scratch, const bf16* dout, const bf16* qkv, const bf16* out,
                                      const float* lse, int B, int T, int NH, int NKV, cudaStream_t s) {
    const int Tp = attention_padded_T(T), nq = Tp / HATTN_BWD_BM;
    const size_t rows = (size_t)B * NH * Tp;
    float* lse2 = scratch;
    float* delta = lse2 + rows;
    float* dq_acc = delta + rows;
    int* dq_turn = reinterpret_cast<int*>(dq_acc + rows * HD);
    cudaCheck(cudaMemsetAsync(dq_turn, 0, attention_dq_tile(B, 0, 0, 0, NH, nq) * sizeof(int), s));
    attention_backward_delta<HD>(delta, lse2, lse, dout, out, B, T, Tp, NH, s);
    static std::atomic<uint64_t> smem_set{0};
    const size_t smem = HattnSmem<HD>::BWD_BYTES;
    attention_set_smem((const void*)attention_backward_hopper_kernel<HD>, smem, &smem_set);
    const int C3 = (NH + 2 * NKV) * HD;
    const CUtensorMap q_map = attention_tensor_map(qkv, C3, T, B, HATTN_BWD_BM);
    const CUtensorMap kv_map = attention_tensor_map(qkv, C3, T, B, HATTN_BWD_BN);
    const CUtensorMap do_map = attention_tensor_map(dout, NH * HD, T, B, HATTN_BWD_BM);
    const int blocks = ceil_div(T, HATTN_BWD_BN) * NKV * B;
    const CUtensorMap dkv_map = attention_tensor_map(dqkv, C3, T, B, 64);   // dK and dV: 64 rows a consumer
    attention_backward_hopper_kernel<HD><<<blocks, HATTN_THREADS, smem, s>>>(dq_acc, dq_turn, lse2, delta, q_map, kv_map,
                                                                              do_map, dkv_map, B, T, NH, NKV);
    cudaCheckLaunch();
    attention_backward_dq_kernel_hopper<HD><<<dim3(nq, NH * HD / 64, B), 256, 0, s>>>(dqkv, dq_acc, B, T, NH, NKV);
    cudaCheckLaunch();
}
#endif

template <int HD>
inline void attention_forward_launch(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, bool hopper, cudaStream_t s) {
#if defined(ATTENTION_HOPPER)
    if (hopper) return attention_forward_hopper<HD, false>(out, lse, qkv, nullptr, B, T, NH, NKV, s);
#endif
    static std::atomic<uint64_t> smem_set{0};
    const size_t smem = AttnDims<HD>::FORWARD_SMEM;
    attention_set_smem((const void*)attention_forward_kernel<HD>, smem, &smem_set);
    dim3 grid(ceil_div(T, ATTN_TILE), NH, B);
    attention_forward_kernel<HD><<<grid, ATTN_THREADS, smem, s>>>(out, lse, qkv, T, NH, NKV);
    cudaCheckLaunch();
}

// qkv: [B*T, (NH+2*NKV)*HD] bf16, RoPE already applied to Q and K. out: [B*T, NH*HD] bf16. lse: [B*NH*T] float.
inline void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD, cudaStream_t s,
                              AttentionPath path = ATTN_PATH_AUTO) {
    attention_check("attention_forward", B, T, NH, NKV, HD, {out, lse, qkv});
    const bool hopper = attention_use_hopper(path, "attention_forward");
    if (HD == 64) attention_forward_launch<64>(out, lse, qkv, B, T, NH, NKV, hopper, s);
    else attention_forward_launch<128>(out, lse, qkv, B, T, NH, NKV, hopper, s);
}

// The FP8 forward (Hopper builds only): qkv cast to E4M3 (attention_fp8_cast) into `scratch`
// (attention_fp8_scratch_bytes), then the Hopper forward on FP8 tensor cores. Same outputs as attention_forward:
// the backward runs on them unchanged, from the BF16 qkv.
// The six parts of the scratch, each from a 256-byte boundary: q8, k8, vt8, q_scale, k_scale, v_scale.
inline void attention_fp8_parts(size_t bytes[6], int B, int T, int NH, int NKV, int HD) {
    const int Tp = attention_fp8_padded_T(T);
    const size_t sizes[6] = {(size_t)B * T * NH * HD, (size_t)B * T * NKV * HD, (size_t)B * NKV * HD * Tp,
                             (size_t)B * NH * (Tp / ATTN_FP8_Q_ROWS) * sizeof(float), (size_t)B * NKV * (Tp / HATTN_FWD_BN) * sizeof(float),
                             (size_t)B * NKV * (Tp / HATTN_FWD_BN) * sizeof(float)};
    for (int i = 0; i < 6; i++) bytes[i] = (sizes[i] + 255) / 256 * 256;
}
inline size_t attention_fp8_scratch_bytes(int B, int T, int NH, int NKV, int HD) {
    size_t bytes[6], total = 0;
    attention_fp8_parts(bytes, B, T, NH, NKV, HD);
    for (size_t b : bytes) total += b;
    return total;
}
inline AttentionFp8Inputs attention_fp8_inputs(void* scratch, int B, int T, int NH, int NKV, int HD) {
    size_t bytes[6];
    attention_fp8_parts(bytes, B, T, NH, NKV, HD);
    AttentionFp8Inputs in;
    in.q = static_cast<fp8*>(scratch);
    in.k = in.q + bytes[0];
    in.vt = in.k + bytes[1];
    in.q_scale = reinterpret_cast<float*>(in.vt + bytes[2]);
    in.k_scale = reinterpret_cast<float*>(reinterpret_cast<fp8*>(in.q_scale) + bytes[3]);
    in.v_scale = reinterpret_cast<float*>(reinterpret_cast<fp8*>(in.k_scale) + bytes[4]);
    return in;
}
// The cast alone (the forward's first half; the tests check its bytes), its Q and K read through `produce`.
template <class Produce = AttentionFp8Plain>
inline AttentionFp8Inputs attention_fp8_cast(void* scratch, const bf16* qkv, int B, int T, int NH, int NKV, int HD, cudaStream_t s,
                                             const Produce& produce = Produce()) {
    const AttentionFp8Inputs in = attention_fp8_inputs(scratch, B, T, NH, NKV, HD);
    const dim3 grid(attention_fp8_padded_T(T) / HATTN_FWD_BN, NH + 2 * NKV, B);
    if (HD == 64) attention_fp8_cast_kernel<64><<<grid, attention_fp8_cast_threads<64>(), 0, s>>>(in, qkv, T, NH, NKV, produce);
    else attention_fp8_cast_kernel<128><<<grid, attention_fp8_cast_threads<128>(), 0, s>>>(in, qkv, T, NH, NKV, produce);
    cudaCheckLaunch();
    return in;
}
inline void attention_fp8_check(const char* who) {
    if (!attention_hopper_available)
        fail("%s: FP8 attention runs on the Hopper kernels only; build with GPU_ARCH=sm_90a (an H100 or H200)", who);
}
// The forward's second half, from a cast's tensors (attention_fp8_cast, or llama2.cuh's RoPE fused with it).
inline void attention_forward_fp8_cast_done(bf16* out, float* lse, const AttentionFp8Inputs& in, int B, int T, int NH, int NKV,
                                            int HD, cudaStream_t s) {
    attention_check("attention_forward_fp8_cast_done", B, T, NH, NKV, HD, {out, lse, in.q});
    attention_fp8_check("attention_forward_fp8_cast_done");
#if defined(ATTENTION_HOPPER)
    if (HD == 64) attention_forward_hopper<64, true>(out, lse, nullptr, &in, B, T, NH, NKV, s);
    else attention_forward_hopper<128, true>(out, lse, nullptr, &in, B, T, NH, NKV, s);
#endif
}
inline void attention_forward_fp8(bf16* out, float* lse, const bf16* qkv, void* scratch, int B, int T, int NH, int NKV, int HD,
                                  cudaStream_t s) {
    attention_check("attention_forward_fp8", B, T, NH, NKV, HD, {out, lse, qkv, scratch});
    attention_fp8_check("attention_forward_fp8");
    attention_forward_fp8_cast_done(out, lse, attention_fp8_cast(scratch, qkv, B, T, NH, NKV, HD, s), B, T, NH, NKV, HD, s);
}

// Floats of scratch attention_backward needs: the mma.sync kernels use B*NH*T (D); the Hopper kernels the
// padded lse and D rows, the FP32 dQ accumulator (padded rows x HD) and its turn counters (4-byte ints).
inline size_t attention_backward_scratch_floats(int B, int T, int NH, int HD) {
    const size_t mma = (size_t)B * NH * T;
    if (!attention_hopper_available) return mma;
    const int Tp = attention_padded_T(T);
    const size_t rows = (size_t)B * NH * Tp;
    return std::max(mma, rows * (2 + HD) + attention_dq_tile(B, 0, 0, 0, NH, Tp / HATTN_BWD_BM));
}

template <int HD>
inline void attention_backward_launch(bf16* dqkv, float* scratch, const bf16* dout, const bf16* qkv, const bf16* out,
                                      const float* lse, int B, int T, int NH, int NKV, bool hopper, cudaStream_t s) {
#if defined(ATTENTION_HOPPER)
    if (hopper) return attention_backward_hopper<HD>(dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, s);
#endif
    float* delta = scratch;   // the mma.sync kernels' scratch: D of every row
    attention_backward_delta<HD>(delta, nullptr, lse, dout, out, B, T, T, NH, s);
    int ntiles = ceil_div(T, ATTN_TILE);
    static std::atomic<uint64_t> dkdv_set{0}, dq_set{0};
    const size_t smem_dkdv = AttnDims<HD>::DKDV_SMEM, smem_dq = AttnDims<HD>::DQ_SMEM;
    attention_set_smem((const void*)attention_backward_dkdv_kernel<HD>, smem_dkdv, &dkdv_set);
    attention_backward_dkdv_kernel<HD><<<dim3(ntiles, NKV, B), ATTN_THREADS, smem_dkdv, s>>>(dqkv, dout, qkv, lse, delta, T, NH, NKV);
    cudaCheckLaunch();
    attention_set_smem((const void*)attention_backward_dq_kernel<HD>, smem_dq, &dq_set);
    attention_backward_dq_kernel<HD><<<dim3(ntiles, NH, B), ATTN_THREADS, smem_dq, s>>>(dqkv, dout, qkv, lse, delta, T, NH, NKV);
    cudaCheckLaunch();
}

// dout: [B*T, NH*HD]. Writes (overwrites) dqkv [B*T, (NH+2NKV)*HD]. scratch: attention_backward_scratch_floats() floats.
inline void attention_backward(bf16* dqkv, float* scratch, const bf16* dout, const bf16* qkv, const bf16* out,
                               const float* lse, int B, int T, int NH, int NKV, int HD, cudaStream_t s,
                               AttentionPath path = ATTN_PATH_AUTO) {
    attention_check("attention_backward", B, T, NH, NKV, HD, {dqkv, scratch, dout, qkv, out, lse});
    const bool hopper = attention_use_hopper(path, "attention_backward");
    if (HD == 64) attention_backward_launch<64>(dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, hopper, s);
    else attention_backward_launch<128>(dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, hopper, s);
}
