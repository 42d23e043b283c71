// fp8_kernels.cuh: everything FP8, and everything every kernel shares.
//   1. error checks          cudaCheck / cublasCheck / ncclCheck, with file, line, call and message
//   2. types and packed loads bf16, fp8 bytes, 16-byte vectors
//   3. the two FP8 formats   E4M3 (forward) and E5M2 (backward): host reference codec, device casts
//   4. the scale rule        power-of-two per-tensor scales, current or delayed (amax history)
//   5. FP8 kernels           amax, quantize, cast+transpose, dequantize (+ plain launchers)
//   6. the matmul            one cuBLASLt wrapper, D = A * B^T, FP8 or BF16 operands
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cublasLt.h>
#include <nccl.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <map>
#include <tuple>
#include <string>
#include <vector>
#include <algorithm>

// ----------------------------------------------------------------------------------------------
// 1. Error checks: every CUDA, cuBLASLt and NCCL call goes through one of these.

inline void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "CUDA error at %s:%d\n  %s\n  -> %s (%s)\n", file, line, call,
                cudaGetErrorString(err), cudaGetErrorName(err));
        exit(EXIT_FAILURE);
    }
}
inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuBLASLt error at %s:%d\n  %s\n  -> %s (set CUBLASLT_LOG_LEVEL=5 to see why)\n",
                file, line, call, cublasLtGetStatusString(status));
        exit(EXIT_FAILURE);
    }
}
inline void nccl_check(ncclResult_t result, const char* call, const char* file, int line) {
    if (result != ncclSuccess) {
        fprintf(stderr, "NCCL error at %s:%d\n  %s\n  -> %s (set NCCL_DEBUG=WARN for details)\n",
                file, line, call, ncclGetErrorString(result));
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)
#define ncclCheck(call) nccl_check((call), #call, __FILE__, __LINE__)
// After every kernel launch: catches bad launch configurations at the launch site.
#define cudaCheckLaunch() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// A clear fatal error for bad arguments: names the value and what to do.
#define fail(...) do { fprintf(stderr, "error: " __VA_ARGS__); fputc('\n', stderr); exit(EXIT_FAILURE); } while (0)

// ----------------------------------------------------------------------------------------------
// 2. Types and packed 16-byte loads/stores.

typedef __nv_bfloat16 bf16;
typedef uint8_t fp8;   // one FP8 code; the format (E4M3 or E5M2) travels beside it

inline int ceil_div(long a, long b) { return (int)((a + b - 1) / b); }

// 16 bytes of T: what one thread moves in one instruction (LDG.128 / STG.128).
template <class T>
struct alignas(16) Packed128 {
    static constexpr int size = 16 / sizeof(T);
    T v[size];
};
template <class T> __device__ inline Packed128<T> load128(const T* p) { return *reinterpret_cast<const Packed128<T>*>(p); }
template <class T> __device__ inline void store128(T* p, Packed128<T> x) { *reinterpret_cast<Packed128<T>*>(p) = x; }
inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// One named tensor inside a flat allocation (parameters, gradients, optimizer state, activations):
// the table of these is what init, the optimizer, checkpoints and TP sharding walk. 1-D: cols = 1.
struct TensorSpec {
    std::string name;
    size_t offset;     // in elements, from the start of the allocation
    size_t numel;
    int rows, cols;
    bool is_matrix() const { return rows > 1 && cols > 1; }
};

__host__ __device__ inline float to_float(float x) { return x; }
__host__ __device__ inline float to_float(bf16 x) { return __bfloat162float(x); }

// ----------------------------------------------------------------------------------------------
// 3. The two FP8 formats.
// E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinity; S.1111.111 is NaN; max 448.
// E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa; IEEE-like (inf and NaNs); max 57344.
// Every cast in this project saturates: a finite value beyond the max becomes +-max, as does +-inf;
// NaN stays NaN (a NaN anywhere must stay visible, never turn into a number).

enum Fp8Format { E4M3 = 0, E5M2 = 1 };
constexpr float E4M3_MAX = 448.0f;
constexpr float E5M2_MAX = 57344.0f;
__host__ __device__ inline float fp8_max(Fp8Format f) { return f == E4M3 ? E4M3_MAX : E5M2_MAX; }
inline const char* fp8_name(Fp8Format f) { return f == E4M3 ? "E4M3" : "E5M2"; }

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
    if (std::isnan(x)) return b.nan_code | (std::signbit(x) ? 0x80 : 0);
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

// ----------------------------------------------------------------------------------------------
// 4. The scale rule (DESIGN.md): scale = 2^(floor(log2(fp8_max / amax)) - margin), x_fp8 = cast(x * scale),
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
// the amax history gave, record this tensor's amax, and every `interval` uses recompute the scale from
// the max over the last `history_len` amaxes.
constexpr int FP8_MAX_HISTORY = 1024;
struct Fp8Meta {
    float scale;              // x_fp8 = saturate(x * scale)
    float inv_scale;          // 1/scale: the dequantizing factor the GEMM takes
    float amax;               // amax of the last tensor seen (written by fp8_amax / the casts)
    unsigned int nonfinite;   // how many times a non-finite amax kept the old scale
    unsigned int uses;        // scale updates so far (delayed scaling counts these)
    float history[FP8_MAX_HISTORY];   // ring buffer of amaxes (delayed scaling)
};
struct Fp8Recipe {
    int margin = 0;           // scale = 2^(floor(log2(max/amax)) - margin)
    int history_len = 1;      // 1 = current (just-in-time) scaling
    int interval = 1;         // recompute the scale every `interval` uses (delayed scaling)
    bool delayed() const { return history_len > 1 || interval > 1; }
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
    if ((m->uses - 1) % r.interval != 0) return;    // recompute at the first use, then every `interval`
    int n = m->uses < (unsigned)r.history_len ? (int)m->uses : r.history_len;
    float hist_max = 0.0f;
    for (int i = 0; i < n; i++) hist_max = fmaxf(hist_max, m->history[i]);
    m->scale = fp8_scale_from_amax(hist_max, fp8_max(f), r.margin, m->scale);
    m->inv_scale = 1.0f / m->scale;
}

// ----------------------------------------------------------------------------------------------
// 6. The matmul: one wrapper over cuBLASLt for every GEMM of the model.
//   D[M,N] (+)= op(A)[M,K] * op(B)[N,K]^T        (row-major; a linear layer is X * W^T with W [out,in])
// An operand is stored K-contiguous ([M,K] / [N,K], "transposed = false") or, for BF16 only, as
// [K,M] / [K,N] ("transposed = true"). Hopper FP8 GEMMs accept only the K-contiguous ("TN") form:
// the cast kernels write transposed copies instead. FP8 operands carry a device pointer to their
// dequantizing factor (inv_scale = 1/scale). Types: E4M3 x E4M3, E5M2 x E4M3, E4M3 x E5M2, BF16 x BF16;
// D is BF16 or FP32; accumulate adds into D (beta = 1).
enum DType { DT_BF16 = 0, DT_FP32 = 1, DT_E4M3 = 2, DT_E5M2 = 3 };
inline const char* dtype_name(DType t) {
    static const char* names[] = {"BF16", "FP32", "E4M3", "E5M2"};
    return names[t];
}
inline bool dtype_is_fp8(DType t) { return t == DT_E4M3 || t == DT_E5M2; }
inline size_t dtype_size(DType t) { return t == DT_FP32 ? 4 : t == DT_BF16 ? 2 : 1; }
inline cudaDataType_t dtype_cuda(DType t) {
    static const cudaDataType_t map[] = {CUDA_R_16BF, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2};
    return map[t];
}
inline DType fp8_dtype(Fp8Format f) { return f == E4M3 ? DT_E4M3 : DT_E5M2; }

struct MatmulOperand {
    const void* ptr;
    DType type;
    bool transposed = false;             // stored [K,rows] instead of [rows,K] (BF16 only)
    const float* inv_scale = nullptr;    // device pointer to 1/scale (FP8 only)
};

constexpr size_t MATMUL_WORKSPACE_BYTES = 32u << 20;   // 32 MiB, cuBLASLt's recommendation for Hopper

// A cached plan: descriptors and the heuristic's choice for one shape/type/alignment combination.
struct MatmulPlan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a_layout, b_layout, d_layout;
    cublasLtMatmulAlgo_t algo;
};
typedef std::tuple<int, int, int, int, int, int, int, int, int, int, int> MatmulKey;

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

inline void matmul(MatmulContext* ctx, void* D, DType d_type, MatmulOperand A, MatmulOperand B,
                   int M, int N, int K, bool accumulate, bool fast_accum, cudaStream_t stream) {
    bool fp8 = dtype_is_fp8(A.type) || dtype_is_fp8(B.type);
    char what[160];
    snprintf(what, sizeof(what), "matmul M=%d N=%d K=%d, A %s%s x B %s%s -> D %s", M, N, K, dtype_name(A.type),
             A.transposed ? "(transposed)" : "", dtype_name(B.type), B.transposed ? "(transposed)" : "", dtype_name(d_type));
    // ---- the rules, each a clear error
    if (M <= 0 || N <= 0 || K <= 0) fail("%s: dimensions must be positive", what);
    if (d_type != DT_BF16 && d_type != DT_FP32) fail("%s: D must be BF16 or FP32", what);
    if (fp8) {
        if (!dtype_is_fp8(A.type) || !dtype_is_fp8(B.type)) fail("%s: FP8 needs both operands FP8 (cast the other one)", what);
        if (A.type == DT_E5M2 && B.type == DT_E5M2) fail("%s: E5M2 x E5M2 is not supported by FP8 tensor cores; make one operand E4M3", what);
        if (A.transposed || B.transposed) fail("%s: FP8 GEMMs take only K-contiguous operands (the TN form); pass a transposed copy from cast_transpose", what);
        if (M % 16 || N % 16 || K % 16) fail("%s: FP8 GEMM dimensions must be multiples of 16", what);
        if (!A.inv_scale || !B.inv_scale) fail("%s: FP8 operands need their inv_scale pointers", what);
    } else {
        if (A.type != DT_BF16 || B.type != DT_BF16) fail("%s: non-FP8 operands must both be BF16", what);
        if (M % 8 || N % 8 || K % 8) fail("%s: BF16 GEMM dimensions must be multiples of 8 (16-byte rows)", what);
        if (fast_accum) fail("%s: fast accumulation is an FP8 option", what);
    }
    if (!is_aligned16(A.ptr) || !is_aligned16(B.ptr) || !is_aligned16(D))
        fail("%s: A, B and D must be 16-byte aligned (got %p, %p, %p)", what, A.ptr, B.ptr, D);

    int align_a = pointer_alignment(A.ptr), align_b = pointer_alignment(B.ptr), align_d = pointer_alignment(D);
    MatmulKey key(M, N, K, A.type | (A.transposed << 4), B.type | (B.transposed << 4), d_type, accumulate, fast_accum,
                  align_a, align_b, align_d);
    auto it = ctx->plans.find(key);
    if (it == ctx->plans.end()) {
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
        if (fp8) {
            int8_t fast = fast_accum ? 1 : 0;
            cublasCheck(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
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
        if (found == 0) fail("%s: cuBLASLt has no algorithm for this configuration (run with CUBLASLT_LOG_LEVEL=5 to see why)", what);
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
