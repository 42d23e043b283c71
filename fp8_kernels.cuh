// fp8_kernels.cuh: everything FP8 (common.cuh holds what every file shares: error checks, types, the step profile).
//   1. the two FP8 formats   E4M3 (forward) and E5M2 (backward): host reference codec, device casts
//   2. the scale rule        power-of-two per-tensor scales, current or delayed (amax history)
//   3. FP8 kernels           amax, quantize, cast+transpose, dequantize (+ plain launchers); 3b. block scaling: the casts
//                            with a scale per 1x128 tile or 128x128 block, in the GEMM's scale layouts
//   4. the matmul            one cuBLASLt wrapper, D = A * B^T, FP8 or BF16 operands
//   5. the FP8 linear layer  Fp8Linear (W8, W8^T, the scales of X, W, dY), its forward and backward GEMMs (per-tensor or
//                            block-scaled), the weight re-quantization after each optimizer step; the BF16 linear it replaces;
//                            the SQNR of an FP8 result against the BF16 one (train_fp8 probe)
#pragma once
#include "common.cuh"
#include <cuda_fp8.h>
#include <cstddef>
#include <cstring>
#include <cmath>
#include <cfloat>
#include <map>
#include <tuple>
#include <algorithm>

// The build's precision (make PRECISION=FP8, or BF16: the baseline, every layer BF16). The one place that reads the
// macro: code for both builds branches on BUILD_FP8 (if constexpr), and every FP8 type exists in both.
#if defined(PRECISION_FP8)
constexpr bool BUILD_FP8 = true;
#else
constexpr bool BUILD_FP8 = false;
#endif

// ----------------------------------------------------------------------------------------------
// 1. The two FP8 formats.
// E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinity; S.1111.111 is NaN; max 448.
// E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa; IEEE-like (inf and NaNs); max 57344.
// Every cast in this project saturates: a finite value beyond the max becomes +-max, as does +-inf;
// NaN stays NaN (a NaN anywhere must stay visible, never turn into a number).

typedef uint8_t fp8;   // one FP8 code; the format (E4M3 or E5M2) travels beside it

enum Fp8Format { E4M3 = 0, E5M2 = 1 };
constexpr float E4M3_MAX = 448.0f;
constexpr float E5M2_MAX = 57344.0f;
__host__ __device__ inline float fp8_max(Fp8Format f) { return f == E4M3 ? E4M3_MAX : E5M2_MAX; }
inline const char* fp8_name(Fp8Format f) { return f == E4M3 ? "E4M3" : "E5M2"; }
// Whether a cast of y saturates: y rounds (to nearest, ties to even) beyond the max, so the clamp, not the rounding,
// picks its code. Past E4M3's 448 = 1.110b x 2^8 the next step would be 480 (1.111b), and the tie 464 rounds to 448;
// past E5M2's 57344 = 1.11b x 2^15 comes 65536 (1.00b x 2^16), and the tie 61440 rounds to it. inf saturates, NaN not.
__host__ __device__ inline bool fp8_saturates(float y, Fp8Format f) {
    const float a = fabsf(y);
    return f == E4M3 ? a > 464.0f : a >= 61440.0f;
}
// Whether a cast of y gives a code +-0: |y| at most half the smallest subnormal (E4M3's 2^-9, E5M2's 2^-16), the tie
// rounding to the even code 0. NaN does not.
__host__ __device__ inline bool fp8_flushes_to_zero(float y, Fp8Format f) {
    return fabsf(y) <= (f == E4M3 ? 0x1p-10f : 0x1p-17f);
}

struct Fp8Bits { int exp_bits, man_bits, bias; uint8_t nan_code, max_code; };
inline Fp8Bits fp8_bits(Fp8Format f) {
    return f == E4M3 ? Fp8Bits{4, 3, 7, 0x7F, 0x7E} : Fp8Bits{5, 2, 15, 0x7F, 0x7B};
}

// Host reference decoder, straight from the bit layout.
inline float fp8_decode_ref(uint8_t code, Fp8Format f) {
    Fp8Bits b = fp8_bits(f);
    int sign = code >> 7, e = (code >> b.man_bits) & ((1 << b.exp_bits) - 1), m = code & ((1 << b.man_bits) - 1);
    float s = sign ? -1.0f : 1.0f;
    if (f == E4M3 && (code & 0x7F) == 0x7F) return NAN;
    if (f == E5M2 && e == 31) return m == 0 ? s * INFINITY : NAN;
    if (e == 0) return s * ldexpf((float)m, 1 - b.bias - b.man_bits);                        // subnormal
    return s * ldexpf((float)((1 << b.man_bits) + m), e - b.bias - b.man_bits);                // normal
}

// Host reference encoder: round to nearest, ties to even, saturating. Works on the exact value:
// x = q * 2^(emin - man_bits) on the subnormal grid, or on the normal grid of x's binade; the grid
// step is a power of two, so x / step is exact in float and rintf (ties-to-even) does the rounding.
inline uint8_t fp8_encode_ref(float x, Fp8Format f) {
    Fp8Bits b = fp8_bits(f);
    if (std::isnan(x)) return b.nan_code;   // canonical NaN 0x7F, whatever the sign (as the hardware cvt)
    uint8_t sign = std::signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (a >= fp8_max(f)) return sign | b.max_code;                       // saturate (inf too)
    int emin = 1 - b.bias;                                               // smallest normal exponent
    int e;
    frexpf(a, &e);                                                       // a = m * 2^e, m in [0.5,1)
    int ex = (a == 0.0f) ? emin : std::max(e - 1, emin);                 // binade exponent, >= emin
    float step = ldexpf(1.0f, ex - b.man_bits);
    float q = rintf(a / step);                                           // exact quotient, RNE
    // q counts steps of the binade: q in [0, 2^(m+1)]; q == 2^(m+1) carries into the next binade.
    int code;
    if (ex == emin && q < (1 << b.man_bits)) {
        code = (int)q;                                                   // subnormal (or zero)
    } else {
        if (q >= (2 << b.man_bits)) { q /= 2; ex += 1; }                 // carry
        code = ((ex + b.bias) << b.man_bits) | ((int)q - (1 << b.man_bits));
    }
    if (code > b.max_code) code = b.max_code;                            // rounded past max: saturate
    return sign | (uint8_t)code;
}

// Device casts: the hardware conversion (cvt.rn.satfinite on sm_89+), bit-exact with the reference.
template <Fp8Format F>
__device__ inline fp8 fp8_encode(float x) {
    return (fp8)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, F == E4M3 ? __NV_E4M3 : __NV_E5M2);
}
template <Fp8Format F>
__device__ inline float fp8_decode(fp8 code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, F == E4M3 ? __NV_E4M3 : __NV_E5M2);
    return __half2float(__half(h));
}
// Two at a time (cvt.rn.satfinite.e4m3x2.f32 packs a pair in one instruction).
template <Fp8Format F>
__device__ inline uint16_t fp8x2_encode(float lo, float hi) {
    return (uint16_t)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, F == E4M3 ? __NV_E4M3 : __NV_E5M2);
}
// Four into a word, the first in the lowest byte.
template <Fp8Format F>
__device__ inline uint32_t fp8x4_encode(float a, float b, float c, float d) {
    return fp8x2_encode<F>(a, b) | (uint32_t)fp8x2_encode<F>(c, d) << 16;
}

// ----------------------------------------------------------------------------------------------
// 2. The scale rule: scale = 2^(floor(log2(fp8_max / amax)) - margin), x_fp8 = cast(x * scale),
// and the GEMM dequantizes with 1/scale. Powers of two make scaling exact: it only moves the exponent.
// amax is clamped to AMAX_FLOOR so that an all-zero tensor gets a finite scale (2^108 for E4M3), and a
// non-finite amax (inf or NaN somewhere in the tensor) keeps the previous scale.
constexpr float AMAX_FLOOR = 1e-30f;

__host__ __device__ inline float fp8_scale_from_amax(float amax, float fmax, int margin, float prev_scale) {
    if (!isfinite(amax)) return prev_scale;
    amax = fmaxf(amax, AMAX_FLOOR);
    // floor(log2(fmax/amax)) exactly, without rounding in the division: with amax = ma*2^ea and
    // fmax = mf*2^ef (frexp, mantissas in [0.5,1)), fmax/amax = (mf/ma) * 2^(ef-ea) and mf/ma in (0.5, 2).
    int ea, ef;
    float ma = frexpf(amax, &ea), mf = frexpf(fmax, &ef);
    int e = ef - ea - (mf < ma ? 1 : 0) - margin;
    return ldexpf(1.0f, e);
}

// Per-tensor FP8 state, one small struct in device memory per tensor (saved in checkpoints).
// Current scaling: amax of this tensor -> scale -> cast. Delayed scaling: cast with the scale that
// the amax history gave, record this tensor's amax (once per optimizer step: the MAX over its casts), and
// every `interval` records recompute the scale from the max over the last `history_len` amaxes.
constexpr int FP8_MAX_HISTORY = 1024;
// inv_scale comes first and the struct is 16-byte aligned: cuBLASLt refuses scale pointers that are not.
struct alignas(16) Fp8Meta {
    float inv_scale;          // 1/scale: the dequantizing factor the GEMM takes
    float scale;              // x_fp8 = saturate(x * scale)
    float amax;               // amax of the last tensor seen (written by fp8_amax / the casts)
    unsigned int nonfinite;   // how many times a non-finite amax kept the old scale
    unsigned int uses;        // amaxes recorded so far (delayed scaling counts these)
    unsigned int amax_pending;   // bits of the amax being gathered by a kernel (atomicMax on |x| bits)
    float history[FP8_MAX_HISTORY];   // ring buffer of amaxes (delayed scaling)
    unsigned int blocks_done;    // blocks of a current-scaling cast that have finished (section 3); 0 between casts
    unsigned int warmup_amax;    // --amax-warmup: bits of the MAX of this step's cast amaxes, for the step's record; 0 between steps
};
// Checkpoints hold Fp8Meta as it is, so its layout is part of the checkpoint format (blocks_done and warmup_amax are 0 there).
static_assert(offsetof(Fp8Meta, history) == 24 && sizeof(Fp8Meta) == 4128, "Fp8Meta's layout is in checkpoints");
struct Fp8Recipe {
    int margin = 0;           // scale = 2^(floor(log2(max/amax)) - margin)
    int history_len = 1;      // 1 = current (just-in-time) scaling
    int interval = 1;         // recompute the scale every `interval` uses (delayed scaling)
    bool warmup = false;      // --amax-warmup: delayed scaling's warm-up: casts at current scaling, the history recorded
    // the casts use the history's scale (delayed scaling past its warm-up)
    __host__ __device__ bool delayed() const { return (history_len > 1 || interval > 1) && !warmup; }
    // the amax history is recorded once per optimizer step (delayed scaling, its warm-up included)
    __host__ __device__ bool history_per_step() const { return history_len > 1 || interval > 1; }
};
inline Fp8Meta fp8_meta_initial() {
    Fp8Meta m;
    memset(&m, 0, sizeof(m));
    m.scale = 1.0f;
    m.inv_scale = 1.0f;
    return m;
}

// Record `amax` for this use and refresh the scale when due. One function for host and device.
// Current scaling (history 1, interval 1): the scale follows this tensor's amax at every use.
// A non-finite amax is counted, keeps the scale, and enters the history as 0 so it cannot poison it.
__host__ __device__ inline void fp8_meta_update(Fp8Meta* m, float amax, Fp8Format f, Fp8Recipe r) {
    bool finite = isfinite(amax);
    m->amax = amax;
    m->history[m->uses % r.history_len] = finite ? amax : 0.0f;
    m->uses += 1;
    if (!finite) { m->nonfinite += 1; return; }
    // recompute at the first use, then every `interval`; in the warm-up at every record, so that the first delayed
    // step casts with the history's scale
    if (!r.warmup && (m->uses - 1) % r.interval != 0) return;
    int n = m->uses < (unsigned)r.history_len ? (int)m->uses : r.history_len;
    float hist_max = 0.0f;
    for (int i = 0; i < n; i++) hist_max = fmaxf(hist_max, m->history[i]);
    m->scale = fp8_scale_from_amax(hist_max, fp8_max(f), r.margin, m->scale);
    m->inv_scale = 1.0f / m->scale;
}

// --amax-warmup: the end of a cast at current scaling during the warm-up of delayed scaling. The scale follows
// this cast's amax, as current scaling's does, but the history and the use count are the step's record's
// (fp8_update_scales), which takes the MAX of the step's training casts gathered here (record: a training cast).
__host__ __device__ inline void fp8_meta_warmup_cast(Fp8Meta* m, unsigned int amax_bits, Fp8Format f, int margin, bool record) {
    float amax;
    memcpy(&amax, &amax_bits, sizeof(amax));
    m->amax = amax;
    m->scale = fp8_scale_from_amax(amax, fp8_max(f), margin, m->scale);   // a non-finite amax keeps the scale
    m->inv_scale = 1.0f / m->scale;
    if (record && amax_bits > m->warmup_amax) m->warmup_amax = amax_bits;   // NaN's bits sort above inf: a NaN is kept
}
// Delayed scaling's record of one optimizer step (fp8_update_scales_kernel): the amax the step's casts gathered
// (amax_pending; in the warm-up warmup_amax) enters the history, the scale is refreshed when due, the slots cleared.
__host__ __device__ inline void fp8_meta_record_step(Fp8Meta* m, Fp8Format f, const Fp8Recipe& r) {
    const unsigned int bits = r.warmup ? m->warmup_amax : m->amax_pending;
    float amax;
    memcpy(&amax, &bits, sizeof(amax));
    fp8_meta_update(m, amax, f, r);
    m->amax_pending = 0u;
    m->warmup_amax = 0u;
}

// ----------------------------------------------------------------------------------------------
// 3. FP8 kernels: amax, quantize, cast+transpose, dequantize.
// Each thread moves 16 elements: one 16-byte FP8 store, and 16 * sizeof(T) bytes of input in 16-byte
// loads. Tails (n not a multiple of 16, tiles at the edges) take a scalar path.
// The amax is gathered with atomicMax on the bits of |x|: for non-negative floats the unsigned order of
// the bits is the numeric order, and NaN (0x7fc00000 and up) sorts above inf, so a NaN anywhere makes
// the amax NaN. Integer max is exact and order-free: the result is deterministic.
//
// The scale bookkeeping has no launches of its own; Fp8Meta::amax_pending is 0 between casts.
//   current scaling  the tensor's amax is gathered into amax_pending just before its cast (by an amax pass, or
//                    by the kernel that produced the tensor); every block of the cast derives the scale from it
//                    as fp8_meta_update will (fp8_cast_scale), and the last block to finish records the amax and
//                    clears amax_pending and the block counter (fp8_cast_done). Two launches per cast, or one
//                    where the producer gathers the amax; no memset, no one-thread kernel.
//   delayed scaling  the cast uses Fp8Meta::scale (from the history) and gathers its amax into amax_pending,
//                    where the amaxes of a step's micro-batches accumulate (MAX) until fp8_update_scales records
//                    every tensor of the step in one launch and clears them, so the history advances once per
//                    optimizer step. One launch per cast.

constexpr int CAST_THREADS = 256;
constexpr int CAST_VEC = 16;    // elements per thread per step

__device__ inline unsigned int abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// Warp then block max of unsigned bits, one atomicMax per block.
__device__ inline void block_atomic_max(unsigned int* target, unsigned int v) {
    __shared__ unsigned int warp_max[32];
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? warp_max[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0 && v != 0u) atomicMax(target, v);
    }
}

// Load 16 consecutive elements as floats: 16-byte loads (2 for bf16, 4 for float).
template <class T>
__device__ inline void load16_as_float(float* out, const T* p) {
    constexpr int per = Packed128<T>::size;
#pragma unroll
    for (int j = 0; j < CAST_VEC / per; j++) {
        Packed128<T> v = load128(p + j * per);
#pragma unroll
        for (int k = 0; k < per; k++) out[j * per + k] = to_float(v.v[k]);
    }
}

// The scale a cast multiplies by (see above); every block reads it before it casts.
__device__ inline float fp8_cast_scale(const Fp8Meta* meta, Fp8Format f, const Fp8Recipe& r) {
    if (r.delayed()) return meta->scale;
    return fp8_scale_from_amax(__uint_as_float(meta->amax_pending), fp8_max(f), r.margin, meta->scale);
}
// Current scaling, the end of every block of a cast: the last block of the grid records the amax (which sets
// the scale all blocks used) and clears the slots for the next cast. A block counts itself done after the
// barrier, so after all its threads' reads of meta: no block reads meta after the update.
__device__ inline void fp8_cast_done(Fp8Meta* meta, Fp8Format f, const Fp8Recipe& r, bool record = true) {
    if (r.delayed()) return;
    __syncthreads();
    if (threadIdx.x != 0) return;
    __threadfence();
    if (atomicAdd(&meta->blocks_done, 1u) != gridDim.x * gridDim.y - 1) return;
    if (r.warmup) fp8_meta_warmup_cast(meta, meta->amax_pending, f, r.margin, record);
    else fp8_meta_update(meta, __uint_as_float(meta->amax_pending), f, r);
    meta->amax_pending = 0u;
    meta->blocks_done = 0u;
}

// Per-tensor FP8 health for --fp8-stats, counted by the casts with the scale they used: of the codes
// written, how many saturated (fp8_saturates(x * scale)) and how many of a non-zero x flushed to zero (code +-0,
// fp8_flushes_to_zero(x * scale)). Both are read off the value the cast converts, not off the packed codes:
// ptxas (CUDA 13.0, sm_90a) miscounts a byte-wise read of codes packed four to a register.
// A per-tensor cast writes one code a value (X8^T holds X8's codes); a block cast two (section 3b: X8 with its
// row's tile's scale, X8^T with its column's), and both count. amax: the block casts' largest |x| (the bits of a
// float; the per-tensor casts keep theirs in Fp8Meta). Integer atomics: exact and order-free.
struct Fp8Health { unsigned long long saturated, flushed, total; unsigned int amax; };
// One code's counts: x cast from y = x * scale.
template <Fp8Format F>
__device__ inline void fp8_health_count(float x, float y, unsigned long long* sat, unsigned long long* flush) {
    *sat += fp8_saturates(y, F);
    *flush += x != 0.0f && fp8_flushes_to_zero(y, F);
}
// Called by every thread of the block.
__device__ inline void fp8_health_add(Fp8Health* health, unsigned long long sat, unsigned long long flush, unsigned long long total) {
    for (int o = 16; o > 0; o >>= 1) {
        sat += __shfl_xor_sync(0xffffffffu, sat, o);
        flush += __shfl_xor_sync(0xffffffffu, flush, o);
    }
    if (threadIdx.x % 32 == 0) {
        if (sat) atomicAdd(&health->saturated, sat);
        if (flush) atomicAdd(&health->flushed, flush);
    }
    if (total) atomicAdd(&health->total, total);
}

template <class T>
__global__ void amax_kernel(unsigned int* amax_bits, const T* x, size_t n) {
    unsigned int m = 0;
    size_t n16 = n / CAST_VEC;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        float v[CAST_VEC];
        load16_as_float(v, x + i * CAST_VEC);
#pragma unroll
        for (int k = 0; k < CAST_VEC; k++) m = max(m, abs_bits(v[k]));
    }
    size_t tail = n16 * CAST_VEC + blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (tail < n) m = max(m, abs_bits(to_float(x[tail])));
    block_atomic_max(amax_bits, m);
}

// out = fp8(x * scale), scaled as above.
template <Fp8Format F, class T>
__global__ void quantize_kernel(fp8* out, const T* x, size_t n, Fp8Meta* meta, Fp8Recipe r) {
    const float scale = fp8_cast_scale(meta, F, r);
    unsigned int m = 0;
    size_t n16 = n / CAST_VEC;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        float v[CAST_VEC];
        load16_as_float(v, x + i * CAST_VEC);
        Packed128<uint16_t> packed;
#pragma unroll
        for (int k = 0; k < CAST_VEC / 2; k++) {
            packed.v[k] = fp8x2_encode<F>(v[2 * k] * scale, v[2 * k + 1] * scale);
            m = max(m, max(abs_bits(v[2 * k]), abs_bits(v[2 * k + 1])));
        }
        store128(reinterpret_cast<uint16_t*>(out + i * CAST_VEC), packed);
    }
    size_t tail = n16 * CAST_VEC + blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (tail < n) {
        float v = to_float(x[tail]);
        out[tail] = fp8_encode<F>(v * scale);
        m = max(m, abs_bits(v));
    }
    if (r.delayed()) block_atomic_max(&meta->amax_pending, m);
    fp8_cast_done(meta, F, r);
}

// What a cast reads. A producer gives the values of one row as floats, 16 consecutive columns at a time
// (load16: col a multiple of 16, cols a multiple of 16) or one column (load1), for each of its `outs`
// outputs, rounded as the kernel that would store them as a tensor rounds them. The cast of a producer with
// two outputs is [rows, 2 cols]: output o's column c is its column o * cols + c. CastPlain, a tensor as it is,
// is the producer of a plain cast; llama2.cuh casts RMSNorm, SwiGLU and RoPE outputs where they are made.
template <class T>
struct CastPlain {
    static constexpr int outs = 1;
    const T* x;   // [rows, cols]
    int cols;
    __device__ void load16(float v[][CAST_VEC], int row, int col) const { load16_as_float(v[0], x + (size_t)row * cols + col); }
    __device__ void load1(float* v, int row, int col) const { v[0] = to_float(x[(size_t)row * cols + col]); }
};

// Cast + transpose of a producer's values [rows, outs * cols]: out = fp8(v * scale) and out_t = its transpose
// [outs * cols, rows], through 64 x 64 tiles in shared memory (one block per tile row/column block, all
// outputs). A thread converts 16 consecutive elements of a row (one 16-byte store to out), then gathers 16
// consecutive rows of one column from the tile (one 16-byte store to out_t). STORE false: the amax pass of
// current scaling (the values' amax into meta->amax_pending; nothing stored). record: delayed scaling gathers
// the amax (false in evaluation); health: --fp8-stats counts, or nullptr.
constexpr int CT_TILE = 64;
template <Fp8Format F, bool STORE, class P>
__global__ void __launch_bounds__(CAST_THREADS) cast_transpose_kernel(P p, fp8* out, fp8* out_t, int rows, int cols, Fp8Meta* meta,
                                                                      Fp8Recipe r, bool record, Fp8Health* health) {
    constexpr int O = P::outs;
    // Row pitch 68 bytes (17 words): the column gathers of one warp (4 row groups, 16 rows apart) then
    // fall in 2 banks' worth of words instead of 1 (a pitch of 64 or 80 puts all 4 in one bank).
    __shared__ uint32_t tile_words[O][CT_TILE * (CT_TILE + 4) / 4];
    const float scale = STORE ? fp8_cast_scale(meta, F, r) : 0.0f;
    const int r0 = blockIdx.y * CT_TILE, c0 = blockIdx.x * CT_TILE;
    const bool vec_rows = (cols % CAST_VEC) == 0, vec_cols = (rows % CAST_VEC) == 0;
    const size_t ld = (size_t)O * cols;   // the row length of out
    unsigned int m = 0;
    unsigned long long sat = 0, flush = 0;
    {   // phase 1: rows
        const int tr = threadIdx.x / (CT_TILE / CAST_VEC), tc = (threadIdx.x % (CT_TILE / CAST_VEC)) * CAST_VEC;
        const int gr = r0 + tr, gc = c0 + tc;
        const bool full = gr < rows && vec_rows && gc + CAST_VEC <= cols;
        float v[O][CAST_VEC];
        if (full) {
            p.load16(v, gr, gc);
        } else {
#pragma unroll
            for (int k = 0; k < CAST_VEC; k++) {   // constant indices (unrolled): v stays in registers
                float e[O];
                for (int o = 0; o < O; o++) e[o] = 0.0f;   // outside the tensor: code 0, never stored
                if (gr < rows && gc + k < cols) p.load1(e, gr, gc + k);
                for (int o = 0; o < O; o++) v[o][k] = e[o];
            }
        }
#pragma unroll
        for (int o = 0; o < O; o++)
#pragma unroll
            for (int k = 0; k < CAST_VEC; k++) m = max(m, abs_bits(v[o][k]));
        if constexpr (STORE) {
#pragma unroll
            for (int o = 0; o < O; o++) {
                alignas(16) fp8 q[CAST_VEC];
#pragma unroll
                for (int k = 0; k < CAST_VEC / 2; k++) {
                    uint16_t pair = fp8x2_encode<F>(v[o][2 * k] * scale, v[o][2 * k + 1] * scale);
                    q[2 * k] = pair & 0xff;
                    q[2 * k + 1] = pair >> 8;
                }
                if (health)
#pragma unroll
                    for (int k = 0; k < CAST_VEC; k++) fp8_health_count<F>(v[o][k], v[o][k] * scale, &sat, &flush);
                if (full) {
                    *reinterpret_cast<uint4*>(out + (size_t)gr * ld + (size_t)o * cols + gc) = *reinterpret_cast<const uint4*>(q);
                } else if (gr < rows) {
#pragma unroll
                    for (int k = 0; k < CAST_VEC; k++)
                        if (gc + k < cols) out[(size_t)gr * ld + (size_t)o * cols + gc + k] = q[k];
                }
                uint32_t* tile_row = &tile_words[o][(tr * (CT_TILE + 4) + tc) / 4];
#pragma unroll
                for (int k = 0; k < CAST_VEC / 4; k++) tile_row[k] = reinterpret_cast<const uint32_t*>(q)[k];
            }
        }
    }
    if constexpr (STORE) {   // phase 2: columns
        __syncthreads();
        const int tc = threadIdx.x / (CT_TILE / CAST_VEC), tr = (threadIdx.x % (CT_TILE / CAST_VEC)) * CAST_VEC;
        const int gc = c0 + tc, gr = r0 + tr;
#pragma unroll
        for (int o = 0; o < O; o++) {
            const fp8(*tile)[CT_TILE + 4] = reinterpret_cast<const fp8(*)[CT_TILE + 4]>(tile_words[o]);
            alignas(16) fp8 q[CAST_VEC];
#pragma unroll
            for (int k = 0; k < CAST_VEC; k++) q[k] = tile[tr + k][tc];
            if (gc < cols) {
                fp8* dst = out_t + ((size_t)o * cols + gc) * rows + gr;
                if (vec_cols && gr + CAST_VEC <= rows) {
                    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(q);
                } else {
#pragma unroll
                    for (int k = 0; k < CAST_VEC; k++)
                        if (gr + k < rows) dst[k] = q[k];
                }
            }
        }
        if (health) {
            const bool first = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
            fp8_health_add(health, sat, flush, first ? (unsigned long long)rows * ld : 0ull);
        }
    }
    if (!STORE || (r.delayed() && record)) block_atomic_max(&meta->amax_pending, m);
    if constexpr (STORE) fp8_cast_done(meta, F, r, record);
}

// out = decode(code) * inv_scale
template <Fp8Format F, class T>
__global__ void dequantize_kernel(T* out, const fp8* x, size_t n, const Fp8Meta* meta) {
    const float inv_scale = meta->inv_scale;
    size_t n16 = n / CAST_VEC;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        Packed128<fp8> codes = load128(x + i * CAST_VEC);
        constexpr int per = Packed128<T>::size;
#pragma unroll
        for (int j = 0; j < CAST_VEC / per; j++) {
            Packed128<T> v;
#pragma unroll
            for (int k = 0; k < per; k++) v.v[k] = (T)(fp8_decode<F>(codes.v[j * per + k]) * inv_scale);
            store128(out + i * CAST_VEC + j * per, v);
        }
    }
    size_t tail = n16 * CAST_VEC + blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (tail < n) out[tail] = (T)(fp8_decode<F>(x[tail]) * inv_scale);
}

// Delayed scaling, once per optimizer step: record the amax gathered for each tensor metas[ids[i]] (E4M3 for
// i < n_e4m3, E5M2 after), refresh its scale when due, and clear amax_pending. All of a step's tensors at once.
// In the warm-up (--amax-warmup) the step's amax is the one its current-scaled casts gathered in warmup_amax.
__global__ void fp8_update_scales_kernel(Fp8Meta* metas, const int* ids, int n, int n_e4m3, Fp8Recipe r) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    fp8_meta_record_step(&metas[ids[i]], i < n_e4m3 ? E4M3 : E5M2, r);
}

// ---- launchers
// Grid for the element-wise kernels: enough blocks to fill the GPU several times; the loops stride.
inline int cast_grid(size_t n) {
    long max_blocks = device_sm_count() * 8L;
    long needed = ceil_div((long)(n / CAST_VEC) + 1, CAST_THREADS);
    return (int)std::max(1L, std::min(max_blocks, needed));
}
inline void check_cast_pointers(const char* what, const void* a, const void* b, const void* c = nullptr) {
    if (!is_aligned16(a) || !is_aligned16(b) || (c && !is_aligned16(c)))
        fail("%s: tensors must be 16-byte aligned (got %p, %p, %p): allocate with cudaMalloc and keep offsets multiples of 16 bytes",
             what, a, b, c);
}

// amax(|x|) gathered (MAX) into meta->amax_pending, which is 0 between casts: the first pass of a
// current-scaling fp8_quantize.
template <class T>
void fp8_amax(Fp8Meta* meta, const T* x, size_t n, cudaStream_t stream) {
    check_cast_pointers("fp8_amax", x, x);
    if (n == 0) return;
    amax_kernel<<<cast_grid(n), CAST_THREADS, 0, stream>>>(&meta->amax_pending, x, n);
    cudaCheckLaunch();
}
// See fp8_update_scales_kernel: ids (device) lists n tensors, the E4M3 ones first.
inline void fp8_update_scales(Fp8Meta* metas, const int* ids, int n, int n_e4m3, const Fp8Recipe& r, cudaStream_t stream) {
    if (n == 0) return;
    fp8_update_scales_kernel<<<ceil_div(n, 128), 128, 0, stream>>>(metas, ids, n, n_e4m3, r);
    cudaCheckLaunch();
}

// x [n] -> FP8 with the recipe's scaling: current, an amax pass and the cast (which records the amax);
// delayed, the cast with the history's scale, gathering amax(x) for fp8_update_scales.
template <class T>
void fp8_quantize(fp8* out, const T* x, size_t n, Fp8Format f, Fp8Meta* meta, const Fp8Recipe& r, cudaStream_t stream) {
    check_cast_pointers("fp8_quantize", out, x);
    if (n == 0) return;
    if (!r.delayed()) fp8_amax(meta, x, n, stream);
    if (f == E4M3) quantize_kernel<E4M3><<<cast_grid(n), CAST_THREADS, 0, stream>>>(out, x, n, meta, r);
    else           quantize_kernel<E5M2><<<cast_grid(n), CAST_THREADS, 0, stream>>>(out, x, n, meta, r);
    cudaCheckLaunch();
}

// One use of an FP8 tensor: where its cast goes and how it is scaled.
struct Fp8CastOut {
    fp8* q;                               // [rows, outs * cols] codes
    fp8* q_t;                             // [outs * cols, rows] codes: the transposed copy the TN GEMMs need
    Fp8Format format;
    Fp8Meta* meta;
    Fp8Recipe recipe;
    Fp8Health* health = nullptr;          // --fp8-stats counts, or nullptr
    const TpGroup* amax_group = nullptr;  // current scaling: the scale from the MAX of amax over this group
    bool record = true;                   // delayed scaling: gather the amax for the step's record (false: evaluation)
};

template <bool STORE, class P>
void cast_transpose_launch(const P& p, const Fp8CastOut& o, int rows, int cols, cudaStream_t stream) {
    if (ceil_div(rows, CT_TILE) > 65535) fail("FP8 cast of %d rows: more than the grid's 65535 tiles of %d rows", rows, CT_TILE);
    dim3 grid(ceil_div(cols, CT_TILE), ceil_div(rows, CT_TILE));
    if (o.format == E4M3)
        cast_transpose_kernel<E4M3, STORE><<<grid, CAST_THREADS, 0, stream>>>(p, o.q, o.q_t, rows, cols, o.meta, o.recipe, o.record, o.health);
    else
        cast_transpose_kernel<E5M2, STORE><<<grid, CAST_THREADS, 0, stream>>>(p, o.q, o.q_t, rows, cols, o.meta, o.recipe, o.record, o.health);
    cudaCheckLaunch();
}

// Producer p's values [rows, outs * cols] -> o.q and o.q_t in FP8. Current scaling: the amax pass (unless
// the producer's own kernel gathered the amax: amax_gathered), the MAX over o.amax_group, then the cast;
// delayed scaling: the cast alone. The group's MAX is an ncclMax on the amax bits as ncclUint32, exact (their
// integer order is the numeric order). (Delayed scaling syncs when it records: llama2.cuh, model_fp8_record_amax.)
template <class P>
void fp8_cast_produced(const Fp8CastOut& o, const P& p, int rows, int cols, cudaStream_t stream, bool amax_gathered = false) {
    check_cast_pointers("FP8 cast", o.q, o.q_t);
    if (rows <= 0 || cols <= 0) return;
    if (!o.recipe.delayed()) {
        if (!amax_gathered) cast_transpose_launch<false>(p, o, rows, cols, stream);
        if (o.amax_group) tp_all_reduce(o.amax_group, &o.meta->amax_pending, 1, ncclUint32, ncclMax, stream);
    }
    cast_transpose_launch<true>(p, o, rows, cols, stream);
}

// x [rows, cols] -> out [rows, cols] and out_t [cols, rows] in FP8; amax_group: fp8_cast_produced's.
template <class T>
void fp8_cast_transpose(fp8* out, fp8* out_t, const T* x, int rows, int cols, Fp8Format f, Fp8Meta* meta,
                        const Fp8Recipe& r, cudaStream_t stream, const TpGroup* amax_group = nullptr) {
    check_cast_pointers("fp8_cast_transpose", x, x);
    fp8_cast_produced(Fp8CastOut{out, out_t, f, meta, r, nullptr, amax_group}, CastPlain<T>{x, cols}, rows, cols, stream);
}
// The same, counting --fp8-stats health into *health (nullptr: none).
inline void fp8_cast_transpose_counted(fp8* q, fp8* q_t, const bf16* x, int rows, int cols, Fp8Format f, Fp8Meta* meta,
                                       Fp8Health* health, const Fp8Recipe& recipe, cudaStream_t stream,
                                       const TpGroup* amax_group = nullptr) {
    check_cast_pointers("fp8_cast_transpose", x, x);
    fp8_cast_produced(Fp8CastOut{q, q_t, f, meta, recipe, health, amax_group}, CastPlain<bf16>{x, cols}, rows, cols, stream);
}

template <class T>
void fp8_dequantize(T* out, const fp8* x, size_t n, Fp8Format f, const Fp8Meta* meta, cudaStream_t stream) {
    check_cast_pointers("fp8_dequantize", out, x);
    if (n == 0) return;
    if (f == E4M3) dequantize_kernel<E4M3><<<cast_grid(n), CAST_THREADS, 0, stream>>>(out, x, n, meta);
    else           dequantize_kernel<E5M2><<<cast_grid(n), CAST_THREADS, 0, stream>>>(out, x, n, meta);
    cudaCheckLaunch();
}

// ----------------------------------------------------------------------------------------------
// 3b. Block scaling (--scaling block, DeepSeek-V3's recipe): a scale per 1x128 tile of X and dY along the GEMM's
// reduction dimension, and per 128x128 block of W. A tile's scale comes from the tile's own amax, inside the
// kernel that casts it: no amax pass, no state kept between casts. Section 2's rule with the tile's amax,
// without the power of two unless pow2 (--block-scale-pow2):
//   scale = fmax / max(amax, AMAX_FLOOR) / 2^margin          (FP32 division; pow2: fp8_scale_from_amax's power of two)
// A tile with a non-finite amax casts with scale 1: its NaN stays NaN, an inf saturates. The GEMMs take the
// dequantizing factors 1/scale in cuBLASLt's layouts, for an operand stored [rows, K] (K-contiguous):
//   FP8_TILES_1x128     (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) inv_scale[kb * rows + r]: tile (r, kb) covers row r,
//                        columns [128 kb, 128 kb + 128); the scales of one K-block are contiguous over the rows
//   FP8_BLOCKS_128x128  (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F) inv_scale[rb * block_scale_ld(K) + kb]: block
//                        (rb, kb) covers rows [128 rb, +128) and columns [128 kb, +128); each row of blocks is padded to
//                        a multiple of 4 scales (16 bytes), the padding never written
// One read of a tensor [rows, cols] makes both its layouts: out [rows, cols] and out_t [cols, rows], each with its
// own tiles along its own rows (tiles: out's 1x128 along cols, out_t's along rows, i.e. 128x1 columns of the input),
// so that the dW GEMM's operands are tiled along the tokens. Blocks are square: out_t holds out's codes transposed and
// the same scales, in out_t's layout. The two layouts may differ: X in tiles for the forward, X^T in blocks for dW
// (--block-dw-x blocks).
enum Fp8Granularity { FP8_PER_TENSOR = 0, FP8_TILES_1x128 = 1, FP8_BLOCKS_128x128 = 2 };
inline const char* fp8_granularity_name(Fp8Granularity g) {
    return g == FP8_PER_TENSOR ? "per-tensor" : g == FP8_TILES_1x128 ? "1x128 tiles" : "128x128 blocks";
}
constexpr int SCALE_BLOCK = 128;   // the length of a tile, the side of a block, along K

// The scale rule of a block-scaled cast.
struct Fp8BlockRule {
    Fp8Format format = E4M3;
    int margin = 0;       // scale / 2^margin
    bool pow2 = false;    // --block-scale-pow2: the scale rounded down to a power of two (section 2's rule)
};
__host__ __device__ inline float fp8_block_scale(float amax, Fp8Format f, int margin, bool pow2) {
    if (!isfinite(amax)) return 1.0f;
    if (pow2) return fp8_scale_from_amax(amax, fp8_max(f), margin, 1.0f);
    return ldexpf(fp8_max(f) / fmaxf(amax, AMAX_FLOOR), -margin);
}

// The row pitch of a BLK128x128 scale tensor of an operand with K columns: ceil(K / 128) rounded up to a multiple of 4,
// which is 4 ceil(K / 512).
__host__ __device__ inline int block_scale_ld(int k) { return (k + 4 * SCALE_BLOCK - 1) / (4 * SCALE_BLOCK) * 4; }
// The number of floats of an operand's scale tensor (rows, K: the operand as the GEMM reads it, [rows, K]).
inline size_t fp8_scale_count(Fp8Granularity g, int rows, int k) {
    if (g == FP8_TILES_1x128) return (size_t)ceil_div(k, SCALE_BLOCK) * rows;
    if (g == FP8_BLOCKS_128x128) return (size_t)ceil_div(rows, SCALE_BLOCK) * block_scale_ld(k);
    return 1;
}

// Cast + transpose of a producer's values [rows, outs * cols] (rows and cols multiples of 128) with block scaling: one
// thread block per 128 x 128 tile of the values (of one output: a producer of two outputs computes both, the block keeps
// its own). A thread holds 16 consecutive columns of 4 rows (32 rows apart) in registers; the amax of a row's 128 values
// is a max over the row's 8 threads (lanes 8k..8k+7 of one warp), of a column's 128 values over its 4 lanes of each warp
// then the 8 warps through shared memory. Codes go to out with the row scales (G: tiles) or the block's (G: blocks), and
// through a shared tile (pitch 132 bytes) to out_t with the column scales (GT: tiles) or the block's (GT: blocks),
// transposed 4 x 4 bytes at a time in registers. health: --fp8-stats counts of both layouts' codes and the tiles' amax, or nullptr.
constexpr int BC_PITCH = SCALE_BLOCK + 4;
template <Fp8Format F, Fp8Granularity G, Fp8Granularity GT, class P>
__global__ void __launch_bounds__(CAST_THREADS) block_cast_transpose_kernel(P p, fp8* out, float* out_inv_scale, fp8* out_t,
                                                                            float* out_t_inv_scale, int rows, int cols, int margin,
                                                                            bool pow2, Fp8Health* health) {
    static_assert((G == FP8_TILES_1x128 || G == FP8_BLOCKS_128x128) && (GT == FP8_TILES_1x128 || GT == FP8_BLOCKS_128x128),
                  "block_cast_transpose_kernel casts tiles or blocks");
    constexpr int O = P::outs;
    constexpr int THREADS_PER_ROW = SCALE_BLOCK / CAST_VEC;               // 8
    constexpr int ROWS_PER_PASS = CAST_THREADS / THREADS_PER_ROW;         // 32
    constexpr int PASSES = SCALE_BLOCK / ROWS_PER_PASS;                   // 4
    constexpr int WARPS = CAST_THREADS / 32;
    __shared__ unsigned int col_amax_of_warp[WARPS][SCALE_BLOCK];         // [0][c]: the column's amax, after the reduction
    __shared__ uint32_t tile_words[SCALE_BLOCK * BC_PITCH / 4];
    const int width = O * cols;   // out's row length: output o's column c is column o * cols + c
    const int r0 = blockIdx.y * SCALE_BLOCK, c0 = blockIdx.x * SCALE_BLOCK;   // the tile in out
    const int o = c0 / cols, pc0 = c0 % cols;                                 // its output and its column there
    const int tr = threadIdx.x / THREADS_PER_ROW, tc = (threadIdx.x % THREADS_PER_ROW) * CAST_VEC;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float v[PASSES][CAST_VEC];
    unsigned int row_amax[PASSES], col_amax[CAST_VEC];
#pragma unroll
    for (int k = 0; k < CAST_VEC; k++) col_amax[k] = 0u;
#pragma unroll
    for (int ps = 0; ps < PASSES; ps++) {
        float w[O][CAST_VEC];
        p.load16(w, r0 + tr + ps * ROWS_PER_PASS, pc0 + tc);
        row_amax[ps] = 0u;
#pragma unroll
        for (int k = 0; k < CAST_VEC; k++) {
#pragma unroll
            for (int j = 0; j < O; j++)   // constant indices: w stays in registers
                if (j == o) v[ps][k] = w[j][k];
            row_amax[ps] = max(row_amax[ps], abs_bits(v[ps][k]));
            col_amax[k] = max(col_amax[k], abs_bits(v[ps][k]));
        }
    }
#pragma unroll
    for (int ps = 0; ps < PASSES; ps++)
        for (int d = 1; d < THREADS_PER_ROW; d <<= 1) row_amax[ps] = max(row_amax[ps], __shfl_xor_sync(0xffffffffu, row_amax[ps], d));
#pragma unroll
    for (int k = 0; k < CAST_VEC; k++)
        for (int d = THREADS_PER_ROW; d < 32; d <<= 1) col_amax[k] = max(col_amax[k], __shfl_xor_sync(0xffffffffu, col_amax[k], d));
    if (lane < THREADS_PER_ROW)
#pragma unroll
        for (int k = 0; k < CAST_VEC; k++) col_amax_of_warp[warp][tc + k] = col_amax[k];
    __syncthreads();
    if (threadIdx.x < SCALE_BLOCK) {   // thread c alone reads and writes column c
        unsigned int m = 0u;
        for (int w = 0; w < WARPS; w++) m = max(m, col_amax_of_warp[w][threadIdx.x]);
        col_amax_of_warp[0][threadIdx.x] = m;
    }
    __syncthreads();
    float row_scale[PASSES], col_scale[CAST_VEC], block_scale = 0.0f;
    if constexpr (G == FP8_BLOCKS_128x128 || GT == FP8_BLOCKS_128x128) {   // the block's amax: the largest column's
        unsigned int m = 0u;
        for (int c = 0; c < SCALE_BLOCK; c++) m = max(m, col_amax_of_warp[0][c]);
        block_scale = fp8_block_scale(__uint_as_float(m), F, margin, pow2);
    }
    if constexpr (G == FP8_BLOCKS_128x128) {
#pragma unroll
        for (int ps = 0; ps < PASSES; ps++) row_scale[ps] = block_scale;
        if (threadIdx.x == 0) out_inv_scale[(size_t)blockIdx.y * block_scale_ld(width) + blockIdx.x] = 1.0f / block_scale;
    } else {
#pragma unroll
        for (int ps = 0; ps < PASSES; ps++) {
            row_scale[ps] = fp8_block_scale(__uint_as_float(row_amax[ps]), F, margin, pow2);
            if (threadIdx.x % THREADS_PER_ROW == 0)
                out_inv_scale[(size_t)blockIdx.x * rows + r0 + tr + ps * ROWS_PER_PASS] = 1.0f / row_scale[ps];
        }
    }
    if constexpr (GT == FP8_BLOCKS_128x128) {
#pragma unroll
        for (int k = 0; k < CAST_VEC; k++) col_scale[k] = block_scale;
        if (threadIdx.x == 0) out_t_inv_scale[(size_t)blockIdx.x * block_scale_ld(rows) + blockIdx.y] = 1.0f / block_scale;
    } else {
#pragma unroll
        for (int k = 0; k < CAST_VEC; k++) col_scale[k] = fp8_block_scale(__uint_as_float(col_amax_of_warp[0][tc + k]), F, margin, pow2);
        if (threadIdx.x < SCALE_BLOCK)
            out_t_inv_scale[(size_t)blockIdx.y * width + c0 + threadIdx.x] =
                1.0f / fp8_block_scale(__uint_as_float(col_amax_of_warp[0][threadIdx.x]), F, margin, pow2);
    }
    unsigned long long sat = 0, flush = 0;
#pragma unroll
    for (int ps = 0; ps < PASSES; ps++) {
        const int tile_row = tr + ps * ROWS_PER_PASS;
        alignas(16) fp8 q[CAST_VEC];
#pragma unroll
        for (int k = 0; k < CAST_VEC / 2; k++) {
            const uint16_t pair = fp8x2_encode<F>(v[ps][2 * k] * row_scale[ps], v[ps][2 * k + 1] * row_scale[ps]);
            q[2 * k] = pair & 0xff;
            q[2 * k + 1] = pair >> 8;
        }
        if (health)
#pragma unroll
            for (int k = 0; k < CAST_VEC; k++) fp8_health_count<F>(v[ps][k], v[ps][k] * row_scale[ps], &sat, &flush);
        *reinterpret_cast<uint4*>(out + (size_t)(r0 + tile_row) * width + c0 + tc) = *reinterpret_cast<const uint4*>(q);
#pragma unroll
        for (int k = 0; k < CAST_VEC / 2; k++) {   // out_t's codes: the column scales
            const uint16_t pair = fp8x2_encode<F>(v[ps][2 * k] * col_scale[2 * k], v[ps][2 * k + 1] * col_scale[2 * k + 1]);
            q[2 * k] = pair & 0xff;
            q[2 * k + 1] = pair >> 8;
        }
        if (health)
#pragma unroll
            for (int k = 0; k < CAST_VEC; k++) fp8_health_count<F>(v[ps][k], v[ps][k] * col_scale[k], &sat, &flush);
        uint32_t* tile_row_words = &tile_words[(tile_row * BC_PITCH + tc) / 4];
#pragma unroll
        for (int k = 0; k < CAST_VEC / 4; k++) tile_row_words[k] = reinterpret_cast<const uint32_t*>(q)[k];
    }
    __syncthreads();
    {   // out_t: a thread reads a 16-row x 4-column patch of the tile (16 words), transposes it in registers, and
        // writes 16 codes to each of 4 rows of out_t. Lanes 0-15 and 16-31 of a warp take row groups 16 apart and 16
        // neighbouring words: with the pitch of 33 words their reads hit 32 distinct banks.
        static_assert(CAST_THREADS == (SCALE_BLOCK / 16) * (SCALE_BLOCK / 4), "one 16 x 4 patch a thread");
        const int word = (warp % 2) * 16 + lane % 16, rg = ((warp / 2) * 2 + lane / 16) * 16;
        uint32_t col_words[4][4];   // [column of the patch][4 rows of it]
#pragma unroll
        for (int g = 0; g < 4; g++) {
            uint32_t a[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = tile_words[(rg + 4 * g + i) * (BC_PITCH / 4) + word];
            // 4 x 4 bytes transposed: column k of the 4 rows a[0..3] as one word (byte i from row i)
            const uint32_t lo01 = __byte_perm(a[0], a[1], 0x5140), hi01 = __byte_perm(a[0], a[1], 0x7362);
            const uint32_t lo23 = __byte_perm(a[2], a[3], 0x5140), hi23 = __byte_perm(a[2], a[3], 0x7362);
            col_words[0][g] = __byte_perm(lo01, lo23, 0x5410);
            col_words[1][g] = __byte_perm(lo01, lo23, 0x7632);
            col_words[2][g] = __byte_perm(hi01, hi23, 0x5410);
            col_words[3][g] = __byte_perm(hi01, hi23, 0x7632);
        }
#pragma unroll
        for (int k = 0; k < 4; k++)
            *reinterpret_cast<uint4*>(out_t + (size_t)(c0 + 4 * word + k) * rows + r0 + rg) =
                make_uint4(col_words[k][0], col_words[k][1], col_words[k][2], col_words[k][3]);
    }
    if (health) {   // the tile's amax is the largest of its rows'; 2 codes a value
        unsigned int m = 0u;
#pragma unroll
        for (int ps = 0; ps < PASSES; ps++) m = max(m, row_amax[ps]);
        block_atomic_max(&health->amax, m);
        const bool first = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
        fp8_health_add(health, sat, flush, first ? 2ull * rows * width : 0ull);
    }
}

// Where a block-scaled cast goes: the codes and the dequantizing factors of both layouts (section 3b's layouts).
struct Fp8BlockCastOut {
    fp8* q;              // [rows, outs * cols]
    float* q_inv_scale;  // its scales, as an operand [rows, K = outs * cols]
    fp8* q_t;            // [outs * cols, rows]
    float* q_t_inv_scale;   // its scales, as an operand [outs * cols, K = rows]
    Fp8Granularity granularity;     // q's: FP8_TILES_1x128 or FP8_BLOCKS_128x128
    Fp8Granularity granularity_t;   // q_t's: the same, or blocks where q has tiles (--block-dw-x blocks)
    Fp8BlockRule rule;
    Fp8Health* health = nullptr;  // --fp8-stats counts, or nullptr
};

// "" if the block cast of [rows, cols] into o has a kernel, else what is wrong: the layouts (both 1x128 tiles, both 128x128
// blocks, or X's tiles with blocks^T, E4M3) and the shape.
inline std::string fp8_block_cast_problem(const Fp8BlockCastOut& o, int rows, int cols) {
    const Fp8Granularity g = o.granularity, gt = o.granularity_t;
    const bool same = g == gt && (g == FP8_TILES_1x128 || g == FP8_BLOCKS_128x128), tiles_blocks_t = g == FP8_TILES_1x128 && gt == FP8_BLOCKS_128x128;
    const char* rule = !same && !tiles_blocks_t ? "the layouts must be both 1x128 tiles, both 128x128 blocks, or tiles and blocks^T"
                     : tiles_blocks_t && o.rule.format != E4M3 ? "tiles with blocks^T are X's layouts (--block-dw-x blocks), E4M3 only"
                     : rows <= 0 || cols <= 0 || rows % SCALE_BLOCK || cols % SCALE_BLOCK
                         ? "both dimensions must be positive multiples of 128 (the tiles of both layouts are whole)"
                     : rows / SCALE_BLOCK > 65535 ? "more than the grid's 65535 tiles of 128 rows" : nullptr;
    if (!rule) return "";   // the common case formats nothing: a cast runs this at every launch
    char what[256];
    snprintf(what, sizeof(what), "FP8 block cast of [%d, %d] (%s, %s^T, %s): %s", rows, cols, fp8_granularity_name(g), fp8_granularity_name(gt),
             fp8_name(o.rule.format), rule);
    return what;
}

// Producer p's values [rows, outs * cols] -> o's codes and scales in one launch (one read of the values).
template <class P>
void fp8_block_cast_produced(const Fp8BlockCastOut& o, const P& p, int rows, int cols, cudaStream_t stream) {
    const std::string problem = fp8_block_cast_problem(o, rows, cols);
    if (!problem.empty()) fail("%s", problem.c_str());
    check_cast_pointers("FP8 block cast", o.q, o.q_t);
    check_cast_pointers("FP8 block cast scales", o.q_inv_scale, o.q_t_inv_scale);
    const dim3 grid(P::outs * cols / SCALE_BLOCK, rows / SCALE_BLOCK);
    const bool e4m3 = o.rule.format == E4M3, tiles = o.granularity == FP8_TILES_1x128 && o.granularity_t == FP8_TILES_1x128,
               blocks = o.granularity == FP8_BLOCKS_128x128;
    const int m = o.rule.margin;
    const bool pw = o.rule.pow2;
    constexpr Fp8Granularity TL = FP8_TILES_1x128, BL = FP8_BLOCKS_128x128;
    if (e4m3 && tiles)
        block_cast_transpose_kernel<E4M3, TL, TL><<<grid, CAST_THREADS, 0, stream>>>(p, o.q, o.q_inv_scale, o.q_t, o.q_t_inv_scale, rows, cols, m, pw, o.health);
    else if (e4m3 && blocks)
        block_cast_transpose_kernel<E4M3, BL, BL><<<grid, CAST_THREADS, 0, stream>>>(p, o.q, o.q_inv_scale, o.q_t, o.q_t_inv_scale, rows, cols, m, pw, o.health);
    else if (e4m3)
        block_cast_transpose_kernel<E4M3, TL, BL><<<grid, CAST_THREADS, 0, stream>>>(p, o.q, o.q_inv_scale, o.q_t, o.q_t_inv_scale, rows, cols, m, pw, o.health);
    else if (tiles)
        block_cast_transpose_kernel<E5M2, TL, TL><<<grid, CAST_THREADS, 0, stream>>>(p, o.q, o.q_inv_scale, o.q_t, o.q_t_inv_scale, rows, cols, m, pw, o.health);
    else if (blocks)
        block_cast_transpose_kernel<E5M2, BL, BL><<<grid, CAST_THREADS, 0, stream>>>(p, o.q, o.q_inv_scale, o.q_t, o.q_t_inv_scale, rows, cols, m, pw, o.health);
    else
        fail("FP8 block cast: no kernel for %s, %s^T in %s", fp8_granularity_name(o.granularity), fp8_granularity_name(o.granularity_t),
             fp8_name(o.rule.format));   // fp8_block_cast_problem refused it above
    cudaCheckLaunch();
}

// A producer's values into FP8 under the scaling that o's type names: one scale per tensor (fp8_cast_produced; amax_gathered
// as there) or per tile or block (fp8_block_cast_produced, which needs no amax). fp8_amax_slot: where the producer's own
// kernel should gather the amax for the cast, or nullptr where the cast needs none gathered (delayed and block scaling).
template <class P>
void fp8_cast_to(const Fp8CastOut& o, const P& p, int rows, int cols, cudaStream_t stream, bool amax_gathered) {
    fp8_cast_produced(o, p, rows, cols, stream, amax_gathered);
}
template <class P>
void fp8_cast_to(const Fp8BlockCastOut& o, const P& p, int rows, int cols, cudaStream_t stream, bool) {
    fp8_block_cast_produced(o, p, rows, cols, stream);
}
inline unsigned int* fp8_amax_slot(const Fp8CastOut& o) { return o.recipe.delayed() ? nullptr : &o.meta->amax_pending; }
inline unsigned int* fp8_amax_slot(const Fp8BlockCastOut&) { return nullptr; }

// ----------------------------------------------------------------------------------------------
// 4. The matmul: one wrapper over cuBLASLt for every GEMM of the model.
//   D[M,N] (+)= op(A)[M,K] * op(B)[N,K]^T        (row-major; a linear layer is X * W^T with W [out,in])
// An operand is stored K-contiguous ([M,K] / [N,K], "transposed = false") or, for BF16 only, as
// [K,M] / [K,N] ("transposed = true"). Hopper FP8 GEMMs accept only the K-contiguous ("TN") form:
// the cast kernels write transposed copies instead. FP8 operands carry a device pointer to their
// dequantizing factor (inv_scale = 1/scale), or under block scaling to their scale tensor (section 3b's layouts:
// 1x128 tiles x 1x128 tiles, tiles x 128x128 blocks or blocks x tiles; cuBLASLt has no blocks x blocks). Types:
// E4M3 x E4M3, E5M2 x E4M3, E4M3 x E5M2, BF16 x BF16; D is BF16 or FP32; accumulate adds into D (beta = 1).
enum DType { DT_BF16 = 0, DT_FP32 = 1, DT_E4M3 = 2, DT_E5M2 = 3 };
inline const char* dtype_name(DType t) {
    static const char* names[] = {"BF16", "FP32", "E4M3", "E5M2"};
    return names[t];
}
inline bool dtype_is_fp8(DType t) { return t == DT_E4M3 || t == DT_E5M2; }
inline size_t dtype_size(DType t) { return t == DT_FP32 ? 4 : t == DT_BF16 ? 2 : 1; }
inline DType fp8_dtype(Fp8Format f) { return f == E4M3 ? DT_E4M3 : DT_E5M2; }
inline cudaDataType_t dtype_cuda(DType t) {
    static const cudaDataType_t map[] = {CUDA_R_16BF, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2};
    return map[t];
}

struct MatmulOperand {
    const void* ptr;
    DType type;
    bool transposed = false;             // stored [K,rows] instead of [rows,K] (BF16 only)
    const float* inv_scale = nullptr;    // device pointer to 1/scale (FP8 only), or to the scale tensor of its tiles or blocks
    Fp8Granularity scaling = FP8_PER_TENSOR;   // FP8 only: one scale, or a scale per 1x128 tile or 128x128 block (section 3b)
};

// cuBLASLt's name of a scale granularity (CUBLASLT_MATMUL_DESC_A_SCALE_MODE / B_SCALE_MODE).
inline cublasLtMatmulMatrixScale_t cublas_scale_mode(Fp8Granularity g) {
    return g == FP8_TILES_1x128 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
         : g == FP8_BLOCKS_128x128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}
inline const char* matmul_scaling_tag(Fp8Granularity g) { return g == FP8_TILES_1x128 ? "[1x128]" : g == FP8_BLOCKS_128x128 ? "[128x128]" : ""; }

constexpr size_t MATMUL_WORKSPACE_BYTES = 32u << 20;   // 32 MiB, cuBLASLt's recommendation for Hopper

// A cached plan: descriptors and the heuristic's choice for one shape/type/alignment combination.
struct MatmulPlan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a_layout, b_layout, d_layout;
    cublasLtMatmulAlgo_t algo;
};
typedef std::tuple<int, int, int, int, int, int, int, int, int, int, int, int> MatmulKey;

struct MatmulContext {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    std::map<MatmulKey, MatmulPlan> plans;
    long heuristic_queries = 0;         // tests check that a training step adds none after the first
};

inline void matmul_context_create(MatmulContext* ctx) {
    cublasCheck(cublasLtCreate(&ctx->handle));
    cudaCheck(cudaMalloc(&ctx->workspace, MATMUL_WORKSPACE_BYTES));   // cudaMalloc aligns to 256 bytes
}
inline void matmul_context_destroy(MatmulContext* ctx) {
    for (auto& kv : ctx->plans) {
        cublasCheck(cublasLtMatmulDescDestroy(kv.second.desc));
        cublasCheck(cublasLtMatrixLayoutDestroy(kv.second.a_layout));
        cublasCheck(cublasLtMatrixLayoutDestroy(kv.second.b_layout));
        cublasCheck(cublasLtMatrixLayoutDestroy(kv.second.d_layout));
    }
    ctx->plans.clear();
    if (ctx->workspace) cudaCheck(cudaFree(ctx->workspace));
    if (ctx->handle) cublasCheck(cublasLtDestroy(ctx->handle));
    ctx->workspace = nullptr;
    ctx->handle = nullptr;
}

// The largest power of two (<= 256) that divides the address: the heuristic may pick faster kernels
// for better-aligned pointers, so the alignment is part of the plan's key.
inline int pointer_alignment(const void* p) {
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    int align = 256;
    while (align > 1 && (a % align) != 0) align /= 2;
    return align;
}

// The rules of a legal call: "" if legal, else a message naming the shape, the types and the rule.
inline std::string matmul_check(const void* D, DType d_type, const MatmulOperand& A, const MatmulOperand& B,
                                int M, int N, int K, bool fast_accum) {
    bool fp8 = dtype_is_fp8(A.type) || dtype_is_fp8(B.type);
    const bool block = A.scaling != FP8_PER_TENSOR || B.scaling != FP8_PER_TENSOR;
    char what[200];
    snprintf(what, sizeof(what), "matmul M=%d N=%d K=%d, A %s%s%s x B %s%s%s -> D %s", M, N, K, dtype_name(A.type),
             A.transposed ? "(transposed)" : "", matmul_scaling_tag(A.scaling), dtype_name(B.type), B.transposed ? "(transposed)" : "",
             matmul_scaling_tag(B.scaling), dtype_name(d_type));
    std::string w = what;
    if (M <= 0 || N <= 0 || K <= 0) return w + ": dimensions must be positive";
    if (d_type != DT_BF16 && d_type != DT_FP32) return w + ": D must be BF16 or FP32";
    if (fp8) {
        if (!dtype_is_fp8(A.type) || !dtype_is_fp8(B.type)) return w + ": FP8 needs both operands in FP8 (cast the other one)";
        if (A.type == DT_E5M2 && B.type == DT_E5M2) return w + ": E5M2 x E5M2 is not supported by FP8 tensor cores; make one operand E4M3";
        if (A.transposed || B.transposed) return w + ": FP8 GEMMs take only K-contiguous operands (the TN form); pass the transposed copy that fp8_cast_transpose writes";
        if (block) {   // cuBLASLt's block-scaled FP8 GEMMs (sm_90, CUDA 12.9+)
            if (A.scaling == FP8_PER_TENSOR || B.scaling == FP8_PER_TENSOR)
                return w + ": a block-scaled FP8 GEMM needs both operands block-scaled (1x128 tiles or 128x128 blocks)";
            if (A.scaling == FP8_BLOCKS_128x128 && B.scaling == FP8_BLOCKS_128x128)
                return w + ": 128x128 blocks x 128x128 blocks is not supported by cuBLASLt; make one operand 1x128 tiles";
            if (K % SCALE_BLOCK) return w + ": block-scaled FP8 GEMMs need K a multiple of 128 (one scale per 128 of K)";
            if (M % 4 || N % 4) return w + ": block-scaled FP8 GEMMs need M and N multiples of 4 (16-byte rows of scales)";
            if (fast_accum) return w + ": fast accumulation is not available with block scaling (the scales apply every 128 of K)";
        }
        if (M % 16 || N % 16 || K % 16) return w + ": FP8 GEMM dimensions must be multiples of 16";
        if (!A.inv_scale || !B.inv_scale) return w + ": FP8 operands need their inv_scale pointers";
        if (!is_aligned16(A.inv_scale) || !is_aligned16(B.inv_scale))
            return w + ": inv_scale pointers must be 16-byte aligned (cuBLASLt refuses others; pass &Fp8Meta::inv_scale)";
    } else {
        if (A.type != DT_BF16 || B.type != DT_BF16) return w + ": non-FP8 operands must both be BF16";
        if (block) return w + ": scales per tile or block are an FP8-only option";
        if (M % 8 || N % 8 || K % 8) return w + ": BF16 GEMM dimensions must be multiples of 8 (16-byte rows)";
        if (fast_accum) return w + ": fast accumulation is an FP8-only option";
    }
    if (!is_aligned16(A.ptr) || !is_aligned16(B.ptr) || !is_aligned16(D))
        return w + ": A, B and D must be 16-byte aligned (allocate with cudaMalloc, keep offsets multiples of 16 bytes)";
    return "";
}

// The rules are checked when a plan is made: everything matmul_check looks at is part of the plan's key (the
// shape, types, layouts, options, the pointers' alignments and whether the scale pointers are usable), so a
// call that finds a plan is legal, and no string is formatted on the hot path.
inline void matmul(MatmulContext* ctx, void* D, DType d_type, MatmulOperand A, MatmulOperand B,
                   int M, int N, int K, bool accumulate, bool fast_accum, cudaStream_t stream) {
    bool fp8 = dtype_is_fp8(A.type);
    int align_a = pointer_alignment(A.ptr), align_b = pointer_alignment(B.ptr), align_d = pointer_alignment(D);
    bool scales_usable = A.inv_scale && B.inv_scale && is_aligned16(A.inv_scale) && is_aligned16(B.inv_scale);
    MatmulKey key(M, N, K, A.type | (A.transposed << 4) | (A.scaling << 5), B.type | (B.transposed << 4) | (B.scaling << 5), d_type,
                  accumulate, fast_accum, align_a, align_b, align_d, scales_usable);
    auto it = ctx->plans.find(key);
    if (it == ctx->plans.end()) {
        std::string err = matmul_check(D, d_type, A, B, M, N, K, fast_accum);
        if (!err.empty()) fail("%s", err.c_str());
        // Column-major view: row-major D[M,N] is column-major D'[N,M], and
        // cuBLASLt computes D'(N x M) = Bc^T (N x K) * Ac (K x M), with Bc = our B as column-major
        // K x N (ld K) and Ac = our A as column-major K x M (ld K): the TN form. Transposed operands are
        // stored [K,rows] = column-major rows x K (ld rows) and take op = N instead.
        MatmulPlan plan;
        cublasCheck(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t op_first = B.transposed ? CUBLAS_OP_N : CUBLAS_OP_T;   // cuBLASLt's "A" is our B
        cublasOperation_t op_second = A.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's "B" is our A
        cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
        cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
        if (fp8) {   // scale pointers are set before the heuristic query: they select scaling kernels
            int8_t fast = fast_accum ? 1 : 0;
            cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
            cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &B.inv_scale, sizeof(B.inv_scale)));
            cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &A.inv_scale, sizeof(A.inv_scale)));
            if (A.scaling != FP8_PER_TENSOR) {   // block scaling (matmul_check: both operands then)
                const cublasLtMatmulMatrixScale_t mode_first = cublas_scale_mode(B.scaling), mode_second = cublas_scale_mode(A.scaling);
                cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_first, sizeof(mode_first)));
                cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_second, sizeof(mode_second)));
            }
        }
        if (B.transposed) cublasCheck(cublasLtMatrixLayoutCreate(&plan.a_layout, dtype_cuda(B.type), N, K, N));
        else              cublasCheck(cublasLtMatrixLayoutCreate(&plan.a_layout, dtype_cuda(B.type), K, N, K));
        if (A.transposed) cublasCheck(cublasLtMatrixLayoutCreate(&plan.b_layout, dtype_cuda(A.type), M, K, M));
        else              cublasCheck(cublasLtMatrixLayoutCreate(&plan.b_layout, dtype_cuda(A.type), K, M, K));
        cublasCheck(cublasLtMatrixLayoutCreate(&plan.d_layout, dtype_cuda(d_type), N, M, N));

        cublasLtMatmulPreference_t pref;
        cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
        size_t ws = MATMUL_WORKSPACE_BYTES;
        uint32_t al_first = align_b, al_second = align_a, al_d = align_d;
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_first, sizeof(al_first)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_second, sizeof(al_second)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(ctx->handle, plan.desc, plan.a_layout, plan.b_layout, plan.d_layout,
                                                   plan.d_layout, pref, 1, &result, &found));
        ctx->heuristic_queries++;
        cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
        if (found == 0) fail("matmul M=%d N=%d K=%d, A %s%s x B %s%s -> D %s: cuBLASLt has no algorithm for this configuration (run with CUBLASLT_LOG_LEVEL=5 to see why)",
                              M, N, K, dtype_name(A.type), matmul_scaling_tag(A.scaling), dtype_name(B.type), matmul_scaling_tag(B.scaling),
                              dtype_name(d_type));
        plan.algo = result.algo;
        it = ctx->plans.emplace(key, plan).first;
    }
    MatmulPlan& plan = it->second;
    if (fp8) {   // the scale pointers change per call; setting them is a host-side store
        cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &B.inv_scale, sizeof(B.inv_scale)));
        cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &A.inv_scale, sizeof(A.inv_scale)));
    }
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasCheck(cublasLtMatmul(ctx->handle, plan.desc, &alpha, B.ptr, plan.a_layout, A.ptr, plan.b_layout, &beta,
                               D, plan.d_layout, D, plan.d_layout, &plan.algo, ctx->workspace, MATMUL_WORKSPACE_BYTES, stream));
}

// ----------------------------------------------------------------------------------------------
// 5. The FP8 linear layer (PRECISION=FP8): Y[N,out] = X[N,in] W^T in E4M3; backward with dY in E5M2.
//   forward   X8, X8^T = cast_transpose(X)             (E4M3; X8^T is what backward keeps)
//             Y = X8 * W8^T                            A = X8 [N,in],     B = W8 [out,in]
//   backward  dY8, dY8^T = cast_transpose(dY)          (E5M2)
//             dX = dY8 * W8                            A = dY8 [N,out],   B = W8^T [in,out]
//             dW += dY8^T * X8                         A = dY8^T [out,N], B = X8^T [in,N], FP32 grads
// Every operand is K-contiguous (the TN form Hopper's FP8 GEMMs require): that is why the casts write
// transposed copies. W8 and W8^T are made once per optimizer step (llama2.cuh, model_weights_changed), not per micro-batch.
// The casts of X and dY are the caller's (fp8_cast_produced): the kernel that produces the tensor, or a plain cast.

// The FP8 state of one linear layer: the weight's FP8 copies and the scales of X, W and dY.
struct Fp8Linear {
    fp8* w8;            // [out, in] E4M3
    fp8* w8_t;          // [in, out] E4M3
    Fp8Meta* meta;      // [3] device: X, W, dY
    Fp8Health* health;  // [3] device, or nullptr: --fp8-stats counts for X, W, dY
    float* w8_scales = nullptr;     // block scaling: the 128x128 blocks' factors of W8 and of W8^T (section 3b's layout)
    float* w8_t_scales = nullptr;
};
enum { FP8_X = 0, FP8_W = 1, FP8_DY = 2 };
inline Fp8Format fp8_tensor_format(int tensor) { return tensor == FP8_DY ? E5M2 : E4M3; }   // forward E4M3, backward E5M2

// A producer's values times scale[col]: X / s and W s of SmoothQuant (llama2.cuh, --smooth-quant) for a cast (P has one output).
template <class P>
struct ColumnScaledCast {
    static constexpr int outs = 1;
    P p;
    const float* scale;
    __device__ void load16(float v[][CAST_VEC], int row, int col) const {
        p.load16(v, row, col);
        for (int k = 0; k < CAST_VEC; k++) v[0][k] *= scale[col + k];
    }
    __device__ void load1(float* v, int row, int col) const {
        p.load1(v, row, col);
        v[0] *= scale[col];
    }
};

// W [out, in] (BF16) -> W8 and W8^T with current scaling (the weights just changed), counting W's health when
// --fp8-stats is on. amax_gathered: W's amax is already in meta[FP8_W].amax_pending (the optimizer's update pass
// gathered it), so the cast reads W once (2 bytes a parameter) instead of twice. col_scale (--smooth-quant's s):
// W' = W s is cast instead, after an amax pass of its own.
inline void fp8_weight_update(Fp8Linear* lin, const bf16* w, int out, int in, cudaStream_t stream, bool amax_gathered = false,
                              const float* col_scale = nullptr) {
    const Fp8CastOut o{lin->w8, lin->w8_t, E4M3, &lin->meta[FP8_W], Fp8Recipe(), lin->health ? &lin->health[FP8_W] : nullptr};
    if (col_scale) fp8_cast_produced(o, ColumnScaledCast<CastPlain<bf16>>{{w, in}, col_scale}, out, in, stream);
    else fp8_cast_produced(o, CastPlain<bf16>{w, in}, out, in, stream, amax_gathered);
}

// The BF16 linear, which the FP8 one replaces (the BF16 build's and the first and last layers'): Y = X W^T;
// dX = dY W and dW += dY^T X (FP32; written when accumulate is false). X [N,in], W [out,in], dY [N,out].
inline void bf16_linear_forward(MatmulContext* mm, bf16* y, const bf16* x, const bf16* w, int N, int in, int out, cudaStream_t stream) {
    ProfileRange range(PHASE_GEMM_FWD, stream, "BF16 GEMM forward");
    matmul(mm, y, DT_BF16, {x, DT_BF16}, {w, DT_BF16}, N, out, in, false, false, stream);
}
inline void bf16_linear_backward(MatmulContext* mm, bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w, int N, int in,
                                 int out, cudaStream_t stream, bool accumulate = true) {
    ProfileRange range(PHASE_GEMM_BWD, stream, "BF16 GEMMs backward");
    matmul(mm, dx, DT_BF16, {dy, DT_BF16}, {w, DT_BF16, true}, N, in, out, false, false, stream);
    matmul(mm, dw, DT_FP32, {dy, DT_BF16, true}, {x, DT_BF16, true}, out, in, N, accumulate, false, stream);
}

// Y = X8 W8^T, X8 [N,in] cast with lin->meta[FP8_X].
inline void fp8_linear_forward(MatmulContext* mm, bf16* y, const fp8* x8, const Fp8Linear* lin, int N, int in, int out, bool fast_accum,
                               cudaStream_t stream) {
    ProfileRange range(PHASE_GEMM_FWD, stream, "FP8 GEMM forward");
    matmul(mm, y, DT_BF16, {x8, DT_E4M3, false, &lin->meta[FP8_X].inv_scale}, {lin->w8, DT_E4M3, false, &lin->meta[FP8_W].inv_scale},
           N, out, in, false, fast_accum, stream);
}

// dX = dY8 W8 and dW += dY8^T X8 (FP32, accumulating over micro-batches; written when accumulate is false):
// dY8 [N,out] and dY8^T [out,N] cast with lin->meta[FP8_DY], X8^T [in,N] kept from the forward.
inline void fp8_linear_backward(MatmulContext* mm, bf16* dx, float* dw, const fp8* dy8, const fp8* dy8_t, const fp8* x8_t,
                                const Fp8Linear* lin, int N, int in, int out, cudaStream_t stream, bool accumulate = true) {
    ProfileRange range(PHASE_GEMM_BWD, stream, "FP8 GEMMs backward");
    matmul(mm, dx, DT_BF16, {dy8, DT_E5M2, false, &lin->meta[FP8_DY].inv_scale}, {lin->w8_t, DT_E4M3, false, &lin->meta[FP8_W].inv_scale},
           N, in, out, false, false, stream);
    matmul(mm, dw, DT_FP32, {dy8_t, DT_E5M2, false, &lin->meta[FP8_DY].inv_scale}, {x8_t, DT_E4M3, false, &lin->meta[FP8_X].inv_scale},
           out, in, N, accumulate, false, stream);
}

// Block scaling (section 3b): the same GEMMs on X8 and dY8 in 1x128 tiles along in and out (the K of Y and dX), on dY8^T
// and X8^T in 1x128 tiles along the tokens (the K of dW; X8^T in 128x128 blocks under --block-dw-x blocks), and on W8 and
// W8^T in 128x128 blocks; each cast's scale tensors and granularities beside its codes (x, dy: where their casts went).
// No fast accumulation (cuBLASLt has none with block scales).
inline void fp8_block_weight_update(Fp8Linear* lin, const bf16* w, int out, int in, const Fp8BlockRule& rule, cudaStream_t stream) {
    fp8_block_cast_produced(Fp8BlockCastOut{lin->w8, lin->w8_scales, lin->w8_t, lin->w8_t_scales, FP8_BLOCKS_128x128, FP8_BLOCKS_128x128, rule,
                                            lin->health ? &lin->health[FP8_W] : nullptr},
                            CastPlain<bf16>{w, in}, out, in, stream);
}
inline void fp8_block_linear_forward(MatmulContext* mm, bf16* y, const Fp8BlockCastOut& x, const Fp8Linear* lin, int N, int in, int out,
                                     cudaStream_t stream) {
    ProfileRange range(PHASE_GEMM_FWD, stream, "FP8 GEMM forward (block scaling)");
    matmul(mm, y, DT_BF16, {x.q, DT_E4M3, false, x.q_inv_scale, x.granularity}, {lin->w8, DT_E4M3, false, lin->w8_scales, FP8_BLOCKS_128x128},
           N, out, in, false, false, stream);
}
inline void fp8_block_linear_backward(MatmulContext* mm, bf16* dx, float* dw, const Fp8BlockCastOut& dy, const Fp8BlockCastOut& x,
                                      const Fp8Linear* lin, int N, int in, int out, cudaStream_t stream, bool accumulate = true) {
    ProfileRange range(PHASE_GEMM_BWD, stream, "FP8 GEMMs backward (block scaling)");
    const DType dy_type = fp8_dtype(dy.rule.format);
    matmul(mm, dx, DT_BF16, {dy.q, dy_type, false, dy.q_inv_scale, dy.granularity},
           {lin->w8_t, DT_E4M3, false, lin->w8_t_scales, FP8_BLOCKS_128x128}, N, in, out, false, false, stream);
    matmul(mm, dw, DT_FP32, {dy.q_t, dy_type, false, dy.q_t_inv_scale, dy.granularity_t}, {x.q_t, DT_E4M3, false, x.q_t_inv_scale, x.granularity_t},
           out, in, N, accumulate, false, stream);
}

// The two sums of a signal-to-quantization-noise ratio over n values, in double: sums[0] += sum ref^2 and
// sums[1] += sum (got - ref)^2; SQNR = 10 log10(sums[0] / sums[1]) dB (train_fp8 probe: an FP8 GEMM's output
// against the BF16 GEMM's on the same operands).
template <class T>
__global__ void sqnr_sums_kernel(double* sums, const T* got, const T* ref, size_t n) {
    double signal = 0.0, noise = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const double r = to_float(ref[i]), e = (double)to_float(got[i]) - r;
        signal += r * r;
        noise += e * e;
    }
    for (int o = 16; o > 0; o >>= 1) {
        signal += __shfl_xor_sync(0xffffffffu, signal, o);
        noise += __shfl_xor_sync(0xffffffffu, noise, o);
    }
    if (threadIdx.x % 32 == 0) {
        atomicAdd(&sums[0], signal);
        atomicAdd(&sums[1], noise);
    }
}
// The SQNR in dB of got against ref (device arrays of n values); sums: 2 doubles of device scratch. Waits for the
// stream. +inf when got equals ref; NaN when ref is all zeros.
template <class T>
double sqnr_db_on_device(const T* got, const T* ref, size_t n, double* sums, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(sums, 0, 2 * sizeof(double), stream));
    const size_t threads = 256, blocks = std::max<size_t>(1, std::min<size_t>(1024, (n + threads - 1) / threads));
    sqnr_sums_kernel<<<blocks, threads, 0, stream>>>(sums, got, ref, n);
    cudaCheckLaunch();
    double h[2];
    cudaCheck(cudaMemcpyAsync(h, sums, sizeof(h), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    return h[0] == 0.0 ? NAN : 10.0 * log10(h[0] / h[1]);
}
