// adamw_fp8.cuh: the optimizer. AdamW with FP32 master weights and moments kept in FP32, BF16 or FP8,
// global-norm gradient clipping, decoupled weight decay on 2-D tensors only, the learning-rate schedule.
//
// API (one AdamW per rank; all device work on the stream passed in)
//   struct AdamWConfig               hyperparameters and moment storage; the defaults are the build's recipe
//   DType adamw_parse_moment_dtype(const char* flag, const char* value)      "fp32" | "bf16" | "e4m3" | "e5m2"
//   void  adamw_create(AdamW* opt, const std::vector<TensorSpec>& specs, size_t num_params,
//                      const float* init_master_host, const AdamWConfig& config, const std::vector<float>& norm_weights = {})
//         specs: the parameters (Model::params); init_master_host: num_params floats, the initial weights;
//         norm_weights: per tensor, the weight of its sum of squares in the gradient norm (empty: all 1)
//   float adamw_grad_norm(AdamW* opt, const float* grads, cudaStream_t stream, const TpGroup* group = nullptr)
//         global L2 norm of the FP32 gradients over all tensors; deterministic; synchronizes the stream.
//         A non-finite result (inf/NaN in a gradient) means: skip this step (do not call adamw_step).
//         With a tensor-parallel group: over the tensors of every rank (see below).
//   void  adamw_step(AdamW* opt, const float* grads, bf16* weights, float lr, float grad_norm, cudaStream_t stream)
//         one update with the gradients scaled by min(1, grad_clip / grad_norm); grad_norm is adamw_grad_norm's
//         finite result. Updates master weights and moments and writes the BF16 weights (Model::weights).
//         Unclipped, it reuses the moment statistics that adamw_grad_norm computed from the same gradients
//         (section 3): call the two in this order with the same gradients, as a training step does.
//   void  adamw_gather_weight_amax(AdamW* opt, const std::vector<unsigned int*>& slots)
//         from now on each update also writes max |new BF16 weight| of tensor i into *slots[i] (non-null ones):
//         the amax of the FP8 weight copies (llama2.cuh, model_weight_amax_slots)
//   void  adamw_export_weights(const AdamW* opt, bf16* weights, cudaStream_t stream)   BF16 weights from the
//         master weights (after adamw_load; a step writes them itself)
//   void  adamw_save(const AdamW* opt, FILE* f, const char* path)     the state, in the order documented below
//   void  adamw_load(AdamW* opt, FILE* f, const char* path)           into an AdamW created with the same
//         tensors and moment dtypes; a mismatch is a clear error naming `path`
//   size_t adamw_moment_bytes_per_param(const AdamWConfig& c);  void adamw_print_memory(const AdamW* opt)
//   void  adamw_destroy(AdamW* opt)
//   float lr_schedule(int step, int total_steps, int warmup_steps, float max_lr, float final_frac)
//         linear warm-up, then cosine decay to final_frac * max_lr at the last step (step is 0-based)
// With tensor parallelism each rank owns the shards in its specs, and the global norm is sqrt of the sum over
// ranks of their sums of squares, all-reduced (FP64) inside adamw_grad_norm. A tensor replicated on all n ranks
// (llama2.cuh keeps those identical) gets norm weight 1/n, so that it counts once; at n = 1 the weight is 1 and
// the norm is bit for bit the one without a group.
#pragma once
#include <type_traits>
#include "fp8_kernels.cuh"

// ----------------------------------------------------------------------------------------------
// 1. Configuration and the schedule.

struct AdamWConfig {
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
    float weight_decay = 0.1f;   // decoupled (w -= lr * wd * w), 2-D tensors only
    float grad_clip = 1.0f;      // clip the global gradient norm to this; 0 = off
    // The recipe: an E4M3 first moment with its own per-tensor scale and a BF16 second moment; the BF16 baseline
    // keeps both in FP32.
    DType m_dtype = BUILD_FP8 ? DT_E4M3 : DT_FP32;
    DType v_dtype = BUILD_FP8 ? DT_BF16 : DT_FP32;
    bool update_clip = false;    // divide each tensor's Adam update by max(1, RMS(update)) (Adafactor,
                                 // Shazeer & Stern 2018; the update clipping of the first FP8-LM recipe)
    bool use_atan2 = false;      // Adam-atan2: update = atan2(m_hat, sqrt(v_hat)), no eps (Everett et al. 2024,
                                 // "Scaling exponents across parameterizations and optimizers", with a = b = 1)
    float decay_lr = 0.0f;       // > 0: the weight decay term uses this learning rate at every step instead of the
                                 // step's (--wd-constant-lr: the peak LR), w -= lr u + decay_lr wd w; 0: w -= lr (u + wd w)
};

inline DType adamw_parse_moment_dtype(const char* flag, const char* value) {
    if (strcmp(value, "fp32") == 0) return DT_FP32;
    if (strcmp(value, "bf16") == 0) return DT_BF16;
    if (strcmp(value, "e4m3") == 0) return DT_E4M3;
    if (strcmp(value, "e5m2") == 0) return DT_E5M2;
    fail("%s %s: unknown moment type; use fp32, bf16, e4m3 or e5m2", flag, value);
}

inline void adamw_config_validate(const AdamWConfig& c) {
    if (c.m_dtype == DT_E5M2)
        fail("AdamW first moment E5M2 (--m-dtype e5m2) is not supported: m needs E4M3's mantissa; use e4m3, bf16 or fp32");
    if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f)) fail("AdamW beta1 = %g: must be in [0, 1)", c.beta1);
    if (!(c.beta2 >= 0.0f && c.beta2 < 1.0f)) fail("AdamW beta2 = %g: must be in [0, 1)", c.beta2);
    if (!(c.eps > 0.0f) && !c.use_atan2) fail("AdamW eps = %g: must be > 0 (only Adam-atan2 needs none)", c.eps);
    if (!(c.weight_decay >= 0.0f)) fail("AdamW weight decay = %g: must be >= 0 (--weight-decay)", c.weight_decay);
    if (!(c.grad_clip >= 0.0f)) fail("AdamW gradient clip = %g: must be >= 0, 0 = off (--grad-clip)", c.grad_clip);
    if (!(c.decay_lr >= 0.0f) || !std::isfinite(c.decay_lr)) fail("AdamW weight decay LR = %g: must be finite and >= 0, 0 = the step's LR", c.decay_lr);
}

// Learning rate at 0-based `step` of a run of `total_steps`:
//   warm-up   step < W:  max_lr * (step + 1) / W
//   decay     step >= W: min + (max_lr - min) * (1 + cos(pi * p)) / 2,  p = (step - W) / (total_steps - 1 - W),
//             min = final_frac * max_lr, so the first step after warm-up gets max_lr and the last one min.
inline float lr_schedule(int step, int total_steps, int warmup_steps, float max_lr, float final_frac) {
    if (total_steps < 1) fail("lr_schedule: total steps = %d, must be >= 1 (--steps)", total_steps);
    if (step < 0 || step >= total_steps) fail("lr_schedule: step %d is outside 0..%d (--steps %d)", step, total_steps - 1, total_steps);
    if (warmup_steps < 0) fail("lr_schedule: warm-up steps = %d, must be >= 0 (--warmup)", warmup_steps);
    if (!(max_lr >= 0.0f)) fail("lr_schedule: learning rate = %g, must be >= 0 (--lr)", max_lr);
    if (!(final_frac >= 0.0f && final_frac <= 1.0f)) fail("lr_schedule: final fraction = %g, must be in [0, 1] (--final-lr-frac)", final_frac);
    if (step < warmup_steps) return (float)((double)max_lr * (step + 1) / warmup_steps);
    int decay_steps = total_steps - 1 - warmup_steps;
    if (decay_steps <= 0) return max_lr;
    double p = (double)(step - warmup_steps) / decay_steps;
    double min_lr = (double)max_lr * final_frac;
    return (float)(min_lr + ((double)max_lr - min_lr) * 0.5 * (1.0 + cos(M_PI * p)));
}

// ----------------------------------------------------------------------------------------------
// 2. Moment storage.
// FP32 and BF16 hold m and v as they are. FP8 holds them times a per-tensor power-of-two scale (the scale
// rule of fp8_kernels.cuh, current scaling, with an Fp8Meta per tensor): the new moment is quantized with
// the scale of its own amax at every step.
//
// Choosing the scale of the new moment. Two ways: (a) a second pass: compute the new moments in FP32,
// reduce their amax per tensor, then quantize in the update pass; (b) a delayed amax: quantize with the
// scale of the previous step's amax, less a margin of a few binades for growth. We use (a), for accuracy:
// (b) saturates whenever a tensor's moment grows faster than its margin allows (a gradient spike moves
// m's amax by up to (1 - beta1) * spike, many binades), and every binade of margin pushes a binade of
// small moments into E4M3's 3-binade subnormal range and then to zero. (a) is exact current scaling:
// no saturation, and the full 17.8 binades of E4M3 below the amax. Its cost is one extra byte per
// parameter (m read by the gradient-norm pass) on steps whose gradients are not clipped, and a pass over
// g and m (5 bytes) on clipped ones (section 3). Both passes compute
// the new moments with the same instructions, so the values quantized are the values whose amax set the
// scale. The update of this step uses the FP32 moments; the FP8 codes are what the next step reads.
//
// The second moment in FP8 stores sqrt(v), not v. v >= 0 spans twice the binades of the gradients
// (gradients over 20 binades give v over 40), while E4M3 spans 17.8 and E5M2 31.8 binades: storing
// sqrt(v) halves the span, and sqrt(v) is what the update divides by, so its relative error maps
// 1:1 onto the update. Near zero: a sqrt(v) below half the smallest subnormal rounds to code 0, and
// reading that back as v = 0 is the one dangerous case: if that element's m is still nonzero (m has
// its own scale, and after a spike elsewhere in the tensor sqrt(v)'s scale drops further than m's) the
// update divides m by sqrt(1 - beta2) |g|, or by eps alone once g is 0: hundreds of learning rates. So
// code 0 reads back as half the smallest subnormal (times 1/scale): the upper end of the values that round
// to 0. Exact Adam keeps |m_hat| <= ~1.17 sqrt(v_hat) (beta1^2 < beta2), so an element whose sqrt(v)
// underflowed now gets a step within that bound times the rounding of the smallest codes (a few learning
// rates at most), never the 1/eps blow-up. Codes above 0 are unchanged. The floor is relative to the
// tensor's scale; the initial all-zero state gets the scale rule's answer for amax 0 (2^108 for E4M3),
// which makes its floor (~1e-36) vanish in FP32.
// (FP8 storage also drops EMA steps smaller than half a code step: a moment moves only when the new
// gradient term differs from it by more than about its relative code spacing divided by (1 - beta), and
// an m of 0 never leaves 0 while (1 - beta1) |g| is below half the smallest code. Gradient noise keeps
// most moments moving; this is the recipe's known cost, and why v defaults to BF16.)

// Half the smallest subnormal of an FP8 format: 2^(-bias - man_bits). E4M3 2^-10, E5M2 2^-17.
template <DType T>
__device__ constexpr float fp8_half_min_subnormal() { return T == DT_E4M3 ? 0x1p-10f : 0x1p-17f; }

// Storage to float and back, one element or 16 (from an index that is a multiple of 16, with 16-byte loads
// and stores). FP8 codes are decoded as they are: the caller applies the scale.
template <DType T>
constexpr bool moment_is_fp8 = T == DT_E4M3 || T == DT_E5M2;
template <DType T>
constexpr Fp8Format moment_fp8_format = T == DT_E5M2 ? E5M2 : E4M3;

template <DType T>
__device__ inline float moment_load(const void* base, size_t i) {
    if constexpr (T == DT_FP32) return ((const float*)base)[i];
    else if constexpr (T == DT_BF16) return __bfloat162float(((const bf16*)base)[i]);
    else return fp8_decode<moment_fp8_format<T>>(((const fp8*)base)[i]);
}
template <DType T>
__device__ inline void moment_store(void* base, size_t i, float x) {
    if constexpr (T == DT_FP32) ((float*)base)[i] = x;
    else if constexpr (T == DT_BF16) ((bf16*)base)[i] = __float2bfloat16(x);   // round to nearest even
    else ((fp8*)base)[i] = fp8_encode<moment_fp8_format<T>>(x);                 // RNE, saturating
}
// 16 floats into 16 consecutive T (float, or bf16 rounded to nearest even) with 16-byte stores.
template <class T>
__device__ inline void store16_from_float(T* p, const float* x) {
    constexpr int per = Packed128<T>::size;
#pragma unroll
    for (int j = 0; j < CAST_VEC / per; j++) {
        Packed128<T> v;
#pragma unroll
        for (int k = 0; k < per; k++) v.v[k] = (T)x[j * per + k];
        store128(p + j * per, v);
    }
}
template <DType T>
__device__ inline void moment_load16(float* out, const void* base, size_t i) {
    if constexpr (T == DT_FP32) load16_as_float(out, (const float*)base + i);
    else if constexpr (T == DT_BF16) load16_as_float(out, (const bf16*)base + i);
    else {
        Packed128<fp8> codes = load128((const fp8*)base + i);
#pragma unroll
        for (int k = 0; k < CAST_VEC; k++) out[k] = fp8_decode<moment_fp8_format<T>>(codes.v[k]);
    }
}
template <DType T>
__device__ inline void moment_store16(void* base, size_t i, const float* x) {
    if constexpr (T == DT_FP32) store16_from_float((float*)base + i, x);
    else if constexpr (T == DT_BF16) store16_from_float((bf16*)base + i, x);
    else {   // pairs through cvt.rn.satfinite.*x2: the same codes as fp8_encode one at a time
        Packed128<uint16_t> pairs;
#pragma unroll
        for (int k = 0; k < CAST_VEC / 2; k++) pairs.v[k] = fp8x2_encode<moment_fp8_format<T>>(x[2 * k], x[2 * k + 1]);
        store128(reinterpret_cast<uint16_t*>((fp8*)base + i), pairs);
    }
}
// v from what is stored; `decode` = 1/scale for FP8 (1 otherwise). FP8 holds sqrt(v) with code 0 read as
// half the smallest subnormal (see above).
template <DType V>
__device__ inline float second_moment_value(float stored, float decode) {
    if constexpr (moment_is_fp8<V>) {
        float s = fmaxf(stored, fp8_half_min_subnormal<V>()) * decode;
        return s * s;
    } else {
        return stored;
    }
}
// What to store for v; `encode` = scale for FP8 (1 otherwise).
template <DType V>
__device__ inline float second_moment_stored(float v, float encode) {
    if constexpr (moment_is_fp8<V>) return sqrtf(v) * encode;
    else return v;
}

// ----------------------------------------------------------------------------------------------
// 3. The optimizer state and its passes.
// A step needs two passes over the parameters at least, because two quantities need every element before
// any element can be updated: the clip factor min(1, grad_clip / ||g||) needs the global gradient norm (over
// all tensors, and all ranks under tensor parallelism), and an FP8 moment's new scale needs the amax of the
// tensor's new moment (current scaling, section 2). The passes, and the bytes each moves per parameter for
// the FP8 build's m E4M3 + v BF16 [the BF16 build's FP32 m and v]:
//   norm    adamw_grad_norm reads g: 4 [4]. When a moment is FP8 or update clipping is on, it also computes
//           this step's statistics (per block: the new m's amax, the new sqrt(v)'s amax, the sum of squares
//           of the update) as if the clip factor were 1: + m (1), + v (2) for an FP8 v or update clipping.
//   stats   only when the gradients are clipped (clip factor < 1): the statistics again, with the clip
//           factor: g + m, 5. Unclipped, the norm pass's statistics are this step's bit for bit: the clip
//           factor is then exactly 1.0f and both passes run the same float operations on the same inputs.
//   update  reads g, master, m, v (4 + 4 + 1 + 2 [16]) and writes master, the BF16 weight, m, v (4 + 2 + 1 + 2
//           [14]): 20 [30]. Where a tensor has an FP8 copy (adamw_gather_weight_amax) it also gathers the amax
//           of the new BF16 weights, so that the W8/W8^T rebuild (llama2.cuh) needs no amax pass of its own.
// So 25 bytes a parameter on an unclipped step, 30 on a clipped one [34, 34]. Any AdamW with global-norm
// clipping over this state moves 24 (the norm's read of g, then g, master, m, v read and master, weight, m,
// v written); the extra byte is m read for its amax. At ~4 TB/s (H200): 0.53 ms for 85M parameters and
// 6.9 ms for 1.1B (unclipped).
// Work is split into blocks of ADAMW_BLOCK_ELEMS elements inside one tensor, on the global grid of 16
// elements: a thread moves 16 consecutive elements with 16-byte loads and stores, and only a tensor that
// does not start or end on the grid has up to 15 elements at that end done one at a time. A table maps every
// block to its tensor, so one launch covers all tensors. Reductions are per block (sums in a fixed order,
// maxima of the bits) into a record per block, then per tensor or in total in a fixed order: deterministic,
// no float atomics, nothing to reset between passes. The weight amax is an integer atomicMax on the bits
// (exact and order-free) into the slot that the FP8 layer reads.
constexpr int ADAMW_THREADS = 256;
constexpr int ADAMW_VEC = CAST_VEC;         // elements a thread moves at a time (16: one 16-byte FP8 load)
constexpr int ADAMW_BLOCK_ELEMS = 8192;     // two groups of 16 per thread

struct AdamWTensor {           // one row of the device tensor table
    size_t offset, numel;      // in elements, as in TensorSpec
    float weight_decay;        // config.weight_decay for 2-D tensors, 0 for the others
    float norm_weight;         // weight of its sum of squares in the gradient norm (1; 1/n if replicated on n ranks)
    int first_block, num_blocks;
    unsigned int* weight_amax; // nullptr, or where the update pass gathers max |new BF16 weight| (as float bits)
};
struct AdamWBlockStats {       // per block; a pass rewrites the fields it computes
    float grad_sumsq;          // the gradients' sum of squares times the tensor's norm weight (norm pass)
    float update_sumsq;        // the Adam direction's sum of squares (update clipping)
    unsigned int m_amax;       // bits of max |new m| (FP8 m)
    unsigned int sqrt_v_amax;  // bits of max sqrt(new v) (FP8 v)
};
struct AdamWScales {           // per tensor, for the update pass (written by the scales kernel)
    float m_decode, m_encode;  // FP8 m: 1/scale of the stored m, scale of the new m (else 1, 1)
    float v_decode, v_encode;  // the same for FP8 v (which stores sqrt(v))
    float update;              // update clipping: 1 / max(1, RMS(update)) (else 1)
};
struct AdamWStepArgs {
    float lr, clip;                        // clip = min(1, grad_clip / grad_norm) multiplies the gradients
    float decay_lr;                        // AdamWConfig::decay_lr (0: the decay uses lr)
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
    float m_correction, v_correction;      // 1 / (1 - beta^t): Adam's bias corrections at step t
    bool use_atan2;
};

struct AdamW {
    AdamWConfig config;
    std::vector<TensorSpec> specs;
    size_t num_params = 0;
    int step = 0;               // updates applied so far; the next one is step t = step + 1
    // The state: one allocation, parts in this order, each starting 256-byte aligned. adamw_save writes a
    // header and then the parts in this order, each exactly (no padding):
    //   master  num_params x float, the FP32 master weights
    //   m       num_params x m_dtype (FP8: code of m * scale)
    //   v       num_params x v_dtype (FP8: code of sqrt(v) * scale)
    //   m_meta  one Fp8Meta per tensor, in specs order (only when m is FP8)
    //   v_meta  one Fp8Meta per tensor (only when v is FP8)
    void* state = nullptr;
    size_t state_bytes = 0;
    float* master = nullptr;
    void* m = nullptr;
    void* v = nullptr;
    Fp8Meta* m_meta = nullptr;
    Fp8Meta* v_meta = nullptr;
    // Work buffers (rebuilt by adamw_create, not saved).
    int num_blocks = 0;
    std::vector<AdamWTensor> table;     // the tensor table, as on the device
    AdamWTensor* tensors = nullptr;     // [specs.size()]
    int* block_tensor = nullptr;        // [num_blocks]
    AdamWScales* scales = nullptr;      // [specs.size()]
    AdamWBlockStats* block_stats = nullptr;   // [num_blocks]
    double* sumsq = nullptr;            // [1]: the gradients' sum of squares
    bool gathers_weight_amax = false;   // some table row has a weight_amax slot
    // The block statistics that adamw_grad_norm computed with clip factor 1: from these gradients (nullptr:
    // none), for update number stats_step + 1.
    const float* stats_grads = nullptr;
    int stats_step = -1;
};

struct AdamWPart { void* ptr; size_t bytes; const char* name; };
// The parts of the state in the documented order (FP8 meta parts only where the moment is FP8).
inline std::vector<AdamWPart> adamw_state_parts(const AdamW* opt) {
    size_t n = opt->num_params, t = opt->specs.size();
    std::vector<AdamWPart> parts = {{opt->master, n * sizeof(float), "master weights"},
                                    {opt->m, n * dtype_size(opt->config.m_dtype), "first moment"},
                                    {opt->v, n * dtype_size(opt->config.v_dtype), "second moment"}};
    if (opt->m_meta) parts.push_back({opt->m_meta, t * sizeof(Fp8Meta), "first moment scales"});
    if (opt->v_meta) parts.push_back({opt->v_meta, t * sizeof(Fp8Meta), "second moment scales"});
    return parts;
}

inline size_t adamw_moment_bytes_per_param(const AdamWConfig& c) { return dtype_size(c.m_dtype) + dtype_size(c.v_dtype); }
// Whether a step needs the statistics of its new moments: an FP8 moment's amax, or the update's RMS.
inline bool adamw_needs_stats(const AdamWConfig& c) { return dtype_is_fp8(c.m_dtype) || dtype_is_fp8(c.v_dtype) || c.update_clip; }

// ----------------------------------------------------------------------------------------------
// 4. Kernels.

// Reduce one value per thread over the block in a fixed order (warp butterflies, then warp 0): the same
// inputs give the same bits. The result is valid in thread 0. Calls may follow each other directly.
template <class T, class Op>
__device__ T adamw_block_reduce(T x, Op op) {
    __shared__ T warp_vals[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int o = 16; o > 0; o /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    __syncthreads();   // warp 0 of a previous call has read warp_vals
    if (lane == 0) warp_vals[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < (int)(blockDim.x / 32) ? warp_vals[lane] : T(0);
        for (int o = 16; o > 0; o /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    }
    return x;
}
struct AdamWSum { template <class T> __device__ T operator()(T a, T b) const { return a + b; } };
struct AdamWMax { __device__ unsigned int operator()(unsigned int a, unsigned int b) const { return max(a, b); } };

// This block's elements [begin, end) (indices into the flat arrays), of which [vbegin, vend) are whole groups
// of 16 (both multiples of 16). Tensor t's blocks tile [offset rounded down to 16, offset + numel).
struct AdamWRange { size_t begin, end, vbegin, vend; };
__device__ inline AdamWRange adamw_block_range(const AdamWTensor& t) {
    size_t start = t.offset / ADAMW_VEC * ADAMW_VEC + (size_t)(blockIdx.x - t.first_block) * ADAMW_BLOCK_ELEMS;
    AdamWRange r;
    r.begin = max(start, t.offset);
    r.end = min(start + ADAMW_BLOCK_ELEMS, t.offset + t.numel);
    r.vbegin = min((r.begin + ADAMW_VEC - 1) / ADAMW_VEC * ADAMW_VEC, r.end);
    r.vend = max(r.vbegin, r.end / ADAMW_VEC * ADAMW_VEC);
    return r;
}
// The one element outside whole groups that this thread does (fewer than 32 per block), or SIZE_MAX.
__device__ inline size_t adamw_single_element(const AdamWRange& r) {
    size_t head = r.vbegin - r.begin, tail = r.end - r.vend;
    if (threadIdx.x < head) return r.begin + threadIdx.x;
    if (threadIdx.x < head + tail) return r.vend + (threadIdx.x - head);
    return SIZE_MAX;
}
#define ADAMW_FOR_EACH_GROUP(j, r) \
    for (size_t j = (r).vbegin + (size_t)ADAMW_VEC * threadIdx.x; j < (r).vend; j += (size_t)ADAMW_VEC * blockDim.x)

// The AdamW moments of one element, in FP32 (Loshchilov & Hutter 2019, Algorithm 2):
//   g = clip * grad;  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
// Every multiply-add is an explicit fmaf, so the arithmetic is fixed (no compiler contraction) and the
// host can repeat it bit for bit.
__device__ inline void adamw_moments(float* m_new, float* v_new, float grad, float m_old, float v_old, const AdamWStepArgs& a) {
    float g = grad * a.clip;
    *m_new = fmaf(a.one_minus_beta1, g, a.beta1 * m_old);
    *v_new = fmaf(a.one_minus_beta2, g * g, a.beta2 * v_old);
}
// The Adam direction: m_hat / (sqrt(v_hat) + eps), or atan2(m_hat, sqrt(v_hat)) (bounded by pi/2, no eps).
__device__ inline float adamw_direction(float m_new, float v_new, const AdamWStepArgs& a) {
    float m_hat = m_new * a.m_correction, v_hat = v_new * a.v_correction;
    return a.use_atan2 ? atan2f(m_hat, sqrtf(v_hat)) : m_hat / (sqrtf(v_hat) + a.eps);
}

// The norm and stats passes. Per block: with grad_sumsq, the gradients' sum of squares (times the tensor's
// norm weight); with moment_stats, the statistics of the new moments under the clip factor in `a`: amax of
// the new m (FP8 m), of the new sqrt(v) (FP8 v), and with update clipping the sum of squares of the Adam
// direction. v is read only where it is needed (FP8 v, update clipping).
template <DType M, DType V>
__global__ void __launch_bounds__(ADAMW_THREADS)
adamw_stats_kernel(AdamWBlockStats* stats, const float* grads, const void* m, const void* v, const Fp8Meta* m_meta,
                   const Fp8Meta* v_meta, const AdamWTensor* tensors, const int* block_tensor, AdamWStepArgs a,
                   bool grad_sumsq, bool moment_stats, bool update_clip) {
    constexpr bool m_fp8 = moment_is_fp8<M>, v_fp8 = moment_is_fp8<V>;
    const int ti = block_tensor[blockIdx.x];
    const AdamWTensor t = tensors[ti];
    const AdamWRange r = adamw_block_range(t);
    const float m_decode = m_fp8 ? m_meta[ti].inv_scale : 1.0f, v_decode = v_fp8 ? v_meta[ti].inv_scale : 1.0f;
    const bool read_v = moment_stats && (v_fp8 || update_clip);
    float sumsq = 0.0f, update_sumsq = 0.0f;
    unsigned int m_amax = 0, sqrt_v_amax = 0;   // bits of |x|: their integer order is the numeric order
    auto element = [&](float grad, float m_stored, float v_stored) {
        if (grad_sumsq) sumsq = fmaf(grad, grad, sumsq);
        if (!moment_stats) return;
        float m_new, v_new;
        adamw_moments(&m_new, &v_new, grad, m_stored * m_decode, second_moment_value<V>(v_stored, v_decode), a);
        if constexpr (m_fp8) m_amax = max(m_amax, abs_bits(m_new));
        if constexpr (v_fp8) sqrt_v_amax = max(sqrt_v_amax, abs_bits(sqrtf(v_new)));
        if (update_clip) {
            float u = adamw_direction(m_new, v_new, a);
            update_sumsq = fmaf(u, u, update_sumsq);
        }
    };
    ADAMW_FOR_EACH_GROUP(j, r) {
        float g[ADAMW_VEC], ms[ADAMW_VEC] = {}, vs[ADAMW_VEC] = {};
        load16_as_float(g, grads + j);
        if (moment_stats) moment_load16<M>(ms, m, j);
        if (read_v) moment_load16<V>(vs, v, j);
#pragma unroll
        for (int k = 0; k < ADAMW_VEC; k++) element(g[k], ms[k], vs[k]);
    }
    const size_t j = adamw_single_element(r);
    if (j != SIZE_MAX) element(grads[j], moment_stats ? moment_load<M>(m, j) : 0.0f, read_v ? moment_load<V>(v, j) : 0.0f);

    AdamWBlockStats* out = &stats[blockIdx.x];
    if (grad_sumsq) {
        sumsq = adamw_block_reduce(sumsq, AdamWSum());
        if (threadIdx.x == 0) out->grad_sumsq = sumsq * t.norm_weight;
    }
    if (moment_stats) {
        if constexpr (m_fp8) m_amax = adamw_block_reduce(m_amax, AdamWMax());
        if constexpr (v_fp8) sqrt_v_amax = adamw_block_reduce(sqrt_v_amax, AdamWMax());
        if (update_clip) update_sumsq = adamw_block_reduce(update_sumsq, AdamWSum());
        if (threadIdx.x == 0) {
            out->m_amax = m_amax;
            out->sqrt_v_amax = sqrt_v_amax;
            out->update_sumsq = update_sumsq;
        }
    }
}
// The gradients' sum of squares: the block records summed in a fixed order (in double: one block, free); the
// caller takes sqrt.
__global__ void adamw_grad_sumsq_total_kernel(double* sumsq, const AdamWBlockStats* stats, int num_blocks) {
    double sum = 0.0;
    for (int b = threadIdx.x; b < num_blocks; b += blockDim.x) sum += stats[b].grad_sumsq;
    sum = adamw_block_reduce(sum, AdamWSum());
    if (threadIdx.x == 0) *sumsq = sum;
}

// One block per tensor, between the statistics and the update: the tensor's block records reduced in a fixed
// order; the FP8 moment scales moved to the new amax (fp8_meta_update, current scaling; a non-finite amax
// keeps the scale and is counted) keeping the old 1/scale for decoding; the update-clipping factor
// 1 / max(1, RMS); and the tensor's weight-amax slot reset for the update pass to gather into.
__global__ void adamw_scales_kernel(AdamWScales* scales, Fp8Meta* m_meta, Fp8Meta* v_meta, const AdamWBlockStats* stats,
                                    const AdamWTensor* tensors, Fp8Format m_format, Fp8Format v_format, Fp8Recipe recipe,
                                    bool update_clip) {
    const int ti = blockIdx.x;
    const AdamWTensor t = tensors[ti];
    double update_sumsq = 0.0;
    unsigned int m_amax = 0, sqrt_v_amax = 0;
    for (int b = t.first_block + threadIdx.x; b < t.first_block + t.num_blocks; b += blockDim.x) {
        update_sumsq += stats[b].update_sumsq;
        m_amax = max(m_amax, stats[b].m_amax);
        sqrt_v_amax = max(sqrt_v_amax, stats[b].sqrt_v_amax);
    }
    update_sumsq = adamw_block_reduce(update_sumsq, AdamWSum());
    m_amax = adamw_block_reduce(m_amax, AdamWMax());
    sqrt_v_amax = adamw_block_reduce(sqrt_v_amax, AdamWMax());
    if (threadIdx.x == 0) {
        AdamWScales s = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
        if (m_meta) {
            Fp8Meta* meta = &m_meta[ti];
            s.m_decode = meta->inv_scale;
            fp8_meta_update(meta, __uint_as_float(m_amax), m_format, recipe);
            s.m_encode = meta->scale;
        }
        if (v_meta) {
            Fp8Meta* meta = &v_meta[ti];
            s.v_decode = meta->inv_scale;
            fp8_meta_update(meta, __uint_as_float(sqrt_v_amax), v_format, recipe);
            s.v_encode = meta->scale;
        }
        if (update_clip) {
            float rms = (float)sqrt(update_sumsq / (double)t.numel);
            s.update = rms > 1.0f ? 1.0f / rms : 1.0f;
        }
        scales[ti] = s;
        if (t.weight_amax) *t.weight_amax = 0;
    }
}

// The update pass: reads gradient, master weight and both moments once; writes master, moments and the
// BF16 weight. Decoupled weight decay (AdamW): w = w - lr * (u + wd * w), u the (clipped) Adam direction; with a
// constant decay LR (decay_lr > 0), w = (w - decay_lr * wd * w) - lr * u.
// Where the table has a weight-amax slot, gathers max |new BF16 weight| into it.
template <DType M, DType V>
__global__ void __launch_bounds__(ADAMW_THREADS)
adamw_update_kernel(float* master, void* m, void* v, bf16* weights, const float* grads, const AdamWTensor* tensors,
                    const int* block_tensor, const AdamWScales* scales, AdamWStepArgs a) {
    const int ti = block_tensor[blockIdx.x];
    const AdamWTensor t = tensors[ti];
    const AdamWScales s = scales[ti];
    const AdamWRange r = adamw_block_range(t);
    const bool weight_amax = t.weight_amax != nullptr;
    unsigned int w_amax = 0;
    // One element: w (master) and the moments' storage values in, their new values out.
    auto element = [&](float grad, float& w, float& m_x, float& v_x) {
        float m_new, v_new;
        adamw_moments(&m_new, &v_new, grad, m_x * s.m_decode, second_moment_value<V>(v_x, s.v_decode), a);
        float u = adamw_direction(m_new, v_new, a) * s.update;
        w = a.decay_lr > 0.0f ? fmaf(-a.lr, u, fmaf(-a.decay_lr * t.weight_decay, w, w)) : fmaf(-a.lr, fmaf(t.weight_decay, w, u), w);
        if (weight_amax) w_amax = max(w_amax, abs_bits(__bfloat162float(__float2bfloat16(w))));
        m_x = m_new * s.m_encode;
        v_x = second_moment_stored<V>(v_new, s.v_encode);
    };
    ADAMW_FOR_EACH_GROUP(j, r) {
        float g[ADAMW_VEC], w[ADAMW_VEC], ms[ADAMW_VEC], vs[ADAMW_VEC];
        load16_as_float(g, grads + j);
        load16_as_float(w, master + j);
        moment_load16<M>(ms, m, j);
        moment_load16<V>(vs, v, j);
#pragma unroll
        for (int k = 0; k < ADAMW_VEC; k++) element(g[k], w[k], ms[k], vs[k]);
        store16_from_float(master + j, w);
        store16_from_float(weights + j, w);
        moment_store16<M>(m, j, ms);
        moment_store16<V>(v, j, vs);
    }
    const size_t j = adamw_single_element(r);
    if (j != SIZE_MAX) {
        float w = master[j], ms = moment_load<M>(m, j), vs = moment_load<V>(v, j);
        element(grads[j], w, ms, vs);
        master[j] = w;
        weights[j] = __float2bfloat16(w);
        moment_store<M>(m, j, ms);
        moment_store<V>(v, j, vs);
    }
    if (weight_amax) block_atomic_max(t.weight_amax, w_amax);   // the same branch in the whole block
}

__global__ void adamw_export_weights_kernel(bf16* weights, const float* master, const AdamWTensor* tensors, const int* block_tensor) {
    const AdamWRange r = adamw_block_range(tensors[block_tensor[blockIdx.x]]);
    ADAMW_FOR_EACH_GROUP(j, r) {
        float w[ADAMW_VEC];
        load16_as_float(w, master + j);
        store16_from_float(weights + j, w);
    }
    const size_t j = adamw_single_element(r);
    if (j != SIZE_MAX) weights[j] = __float2bfloat16(master[j]);
}

// ----------------------------------------------------------------------------------------------
// 5. Launchers.

inline void adamw_create(AdamW* opt, const std::vector<TensorSpec>& specs, size_t num_params, const float* init_master_host,
                         const AdamWConfig& config, const std::vector<float>& norm_weights = {}) {
    adamw_config_validate(config);
    if (specs.empty()) fail("adamw_create: no tensors to optimize");
    if (!norm_weights.empty() && norm_weights.size() != specs.size())
        fail("adamw_create: %zu norm weights for %zu tensors", norm_weights.size(), specs.size());
    // The tensor table: every tensor inside [0, num_params), rows x cols elements, no two overlapping.
    std::vector<AdamWTensor> table;
    std::vector<int> block_tensor;
    for (size_t i = 0; i < specs.size(); i++) {
        const TensorSpec& s = specs[i];
        if (s.numel == 0 || s.numel != (size_t)s.rows * (size_t)s.cols)
            fail("adamw_create: tensor %s has numel %zu but shape %d x %d", s.name.c_str(), s.numel, s.rows, s.cols);
        if (s.offset + s.numel > num_params)
            fail("adamw_create: tensor %s (offset %zu, %zu elements) ends past the %zu parameters", s.name.c_str(), s.offset, s.numel, num_params);
        // blocks tile [offset rounded down to the 16-element grid, offset + numel)
        int blocks = ceil_div((long)(s.offset % ADAMW_VEC + s.numel), ADAMW_BLOCK_ELEMS);
        table.push_back({s.offset, s.numel, s.is_matrix() ? config.weight_decay : 0.0f, norm_weights.empty() ? 1.0f : norm_weights[i],
                         (int)block_tensor.size(), blocks, nullptr});
        if (block_tensor.size() + blocks > (size_t)INT32_MAX) fail("adamw_create: more than 2^31 blocks of %d parameters", ADAMW_BLOCK_ELEMS);
        block_tensor.insert(block_tensor.end(), blocks, (int)i);
    }
    std::vector<size_t> order(specs.size());
    for (size_t i = 0; i < order.size(); i++) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return specs[a].offset < specs[b].offset; });
    for (size_t k = 1; k < order.size(); k++) {
        const TensorSpec &a = specs[order[k - 1]], &b = specs[order[k]];
        if (a.offset + a.numel > b.offset) fail("adamw_create: tensors %s and %s overlap", a.name.c_str(), b.name.c_str());
    }

    opt->config = config;
    opt->specs = specs;
    opt->num_params = num_params;
    opt->step = 0;
    opt->num_blocks = (int)block_tensor.size();
    opt->table = table;
    opt->gathers_weight_amax = false;
    opt->stats_grads = nullptr;
    bool m_fp8 = dtype_is_fp8(config.m_dtype), v_fp8 = dtype_is_fp8(config.v_dtype);
    size_t nt = specs.size();
    size_t sizes[5] = {num_params * sizeof(float), num_params * dtype_size(config.m_dtype), num_params * dtype_size(config.v_dtype),
                       m_fp8 ? nt * sizeof(Fp8Meta) : 0, v_fp8 ? nt * sizeof(Fp8Meta) : 0};
    size_t offsets[5], total = 0;
    for (int k = 0; k < 5; k++) {
        offsets[k] = total;
        total += (sizes[k] + 255) / 256 * 256;
    }
    opt->state_bytes = total;
    cudaCheck(cudaMalloc(&opt->state, total));
    char* base = (char*)opt->state;
    opt->master = (float*)(base + offsets[0]);
    opt->m = base + offsets[1];
    opt->v = base + offsets[2];
    opt->m_meta = m_fp8 ? (Fp8Meta*)(base + offsets[3]) : nullptr;
    opt->v_meta = v_fp8 ? (Fp8Meta*)(base + offsets[4]) : nullptr;
    cudaCheck(cudaMemcpy(opt->master, init_master_host, sizes[0], cudaMemcpyHostToDevice));
    cudaCheck(cudaMemset(opt->m, 0, sizes[1]));   // zero in every format (FP8 code 0 is +0)
    cudaCheck(cudaMemset(opt->v, 0, sizes[2]));
    // The moments start at exactly zero, so their scale is the rule's answer for amax 0 (see section 2).
    for (int k = 0; k < 2; k++) {
        Fp8Meta* meta = k == 0 ? opt->m_meta : opt->v_meta;
        if (!meta) continue;
        Fp8Format f = (k == 0 ? config.m_dtype : config.v_dtype) == DT_E4M3 ? E4M3 : E5M2;
        Fp8Meta initial = fp8_meta_initial();
        initial.scale = fp8_scale_from_amax(0.0f, fp8_max(f), 0, 1.0f);
        initial.inv_scale = 1.0f / initial.scale;
        std::vector<Fp8Meta> metas(nt, initial);
        cudaCheck(cudaMemcpy(meta, metas.data(), nt * sizeof(Fp8Meta), cudaMemcpyHostToDevice));
    }

    cudaCheck(cudaMalloc(&opt->tensors, nt * sizeof(AdamWTensor)));
    cudaCheck(cudaMalloc(&opt->block_tensor, block_tensor.size() * sizeof(int)));
    cudaCheck(cudaMalloc(&opt->scales, nt * sizeof(AdamWScales)));
    cudaCheck(cudaMalloc(&opt->block_stats, block_tensor.size() * sizeof(AdamWBlockStats)));
    cudaCheck(cudaMalloc(&opt->sumsq, sizeof(double)));
    cudaCheck(cudaMemset(opt->block_stats, 0, block_tensor.size() * sizeof(AdamWBlockStats)));
    cudaCheck(cudaMemcpy(opt->tensors, table.data(), nt * sizeof(AdamWTensor), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(opt->block_tensor, block_tensor.data(), block_tensor.size() * sizeof(int), cudaMemcpyHostToDevice));
    std::vector<AdamWScales> ones(nt, AdamWScales{1.0f, 1.0f, 1.0f, 1.0f, 1.0f});   // used as is when no scales kernel runs
    cudaCheck(cudaMemcpy(opt->scales, ones.data(), nt * sizeof(AdamWScales), cudaMemcpyHostToDevice));
}

inline void adamw_destroy(AdamW* opt) {
    cudaCheck(cudaFree(opt->state));
    cudaCheck(cudaFree(opt->tensors));
    cudaCheck(cudaFree(opt->block_tensor));
    cudaCheck(cudaFree(opt->scales));
    cudaCheck(cudaFree(opt->block_stats));
    cudaCheck(cudaFree(opt->sumsq));
    *opt = AdamW();
}

// From now on every update also writes max |new BF16 weight| of tensor i into *slots[i] (the bits of the
// float; set to 0 before the update pass) where slots[i] is not null: the amax that an FP8 copy of the
// weights with current scaling needs (llama2.cuh: model_weight_amax_slots, model_weights_changed).
// slots: one per tensor, in specs order.
inline void adamw_gather_weight_amax(AdamW* opt, const std::vector<unsigned int*>& slots) {
    if (slots.size() != opt->specs.size())
        fail("adamw_gather_weight_amax: %zu slots for %zu tensors (one per tensor, nullptr where none)", slots.size(), opt->specs.size());
    opt->gathers_weight_amax = false;
    for (size_t i = 0; i < slots.size(); i++) {
        opt->table[i].weight_amax = slots[i];
        opt->gathers_weight_amax |= slots[i] != nullptr;
    }
    cudaCheck(cudaMemcpy(opt->tensors, opt->table.data(), opt->table.size() * sizeof(AdamWTensor), cudaMemcpyHostToDevice));
}

// The kernels come in one instance per pair of moment types: f(M, V) gets them as std::integral_constant
// values, so that one launch line serves every pair.
template <DType M, class F>
inline void adamw_dispatch_v(DType v, F&& f) {
    switch (v) {
        case DT_FP32: f(std::integral_constant<DType, M>(), std::integral_constant<DType, DT_FP32>()); break;
        case DT_BF16: f(std::integral_constant<DType, M>(), std::integral_constant<DType, DT_BF16>()); break;
        case DT_E4M3: f(std::integral_constant<DType, M>(), std::integral_constant<DType, DT_E4M3>()); break;
        case DT_E5M2: f(std::integral_constant<DType, M>(), std::integral_constant<DType, DT_E5M2>()); break;
    }
}
template <class F>
inline void adamw_dispatch(const AdamWConfig& c, F&& f) {
    switch (c.m_dtype) {
        case DT_FP32: adamw_dispatch_v<DT_FP32>(c.v_dtype, f); break;
        case DT_BF16: adamw_dispatch_v<DT_BF16>(c.v_dtype, f); break;
        case DT_E4M3: adamw_dispatch_v<DT_E4M3>(c.v_dtype, f); break;
        case DT_E5M2: fail("AdamW: first moment E5M2 is not supported");
    }
}

// The arguments of the next update (number opt->step + 1) with clip factor `clip`.
inline AdamWStepArgs adamw_step_args(const AdamW* opt, float lr, float clip) {
    const AdamWConfig& c = opt->config;
    AdamWStepArgs a;
    a.lr = lr;
    a.clip = clip;
    a.decay_lr = c.decay_lr;
    a.beta1 = c.beta1;
    a.one_minus_beta1 = 1.0f - c.beta1;   // exact in float for beta1 in [0.5, 1) (Sterbenz)
    a.beta2 = c.beta2;
    a.one_minus_beta2 = 1.0f - c.beta2;
    a.eps = c.eps;
    a.m_correction = (float)(1.0 / (1.0 - pow((double)c.beta1, opt->step + 1)));
    a.v_correction = (float)(1.0 / (1.0 - pow((double)c.beta2, opt->step + 1)));
    a.use_atan2 = c.use_atan2;
    return a;
}

inline float adamw_grad_norm(AdamW* opt, const float* grads, cudaStream_t stream, const TpGroup* group = nullptr) {
    check_cast_pointers("adamw_grad_norm (gradients)", grads, grads);
    const AdamWConfig& c = opt->config;
    const bool stats = adamw_needs_stats(c);
    const AdamWStepArgs a = adamw_step_args(opt, 0.0f, 1.0f);   // the statistics as if unclipped (section 3)
    adamw_dispatch(c, [&](auto m_type, auto v_type) {
        constexpr DType M = decltype(m_type)::value, V = decltype(v_type)::value;
        adamw_stats_kernel<M, V><<<opt->num_blocks, ADAMW_THREADS, 0, stream>>>(opt->block_stats, grads, opt->m, opt->v, opt->m_meta,
                                                                               opt->v_meta, opt->tensors, opt->block_tensor, a, true,
                                                                               stats, c.update_clip);
        cudaCheckLaunch();
    });
    adamw_grad_sumsq_total_kernel<<<1, 1024, 0, stream>>>(opt->sumsq, opt->block_stats, opt->num_blocks);
    cudaCheckLaunch();
    opt->stats_grads = stats ? grads : nullptr;
    opt->stats_step = opt->step;
    if (group) tp_all_reduce(group, opt->sumsq, 1, ncclFloat64, ncclSum, stream);
    double sumsq = 0.0;
    cudaCheck(cudaMemcpyAsync(&sumsq, opt->sumsq, sizeof(double), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    return (float)sqrt(sumsq);
}

inline void adamw_step(AdamW* opt, const float* grads, bf16* weights, float lr, float grad_norm, cudaStream_t stream) {
    const AdamWConfig& c = opt->config;
    if (!std::isfinite(grad_norm))
        fail("adamw_step: the gradient norm is %g; skip this step instead (check adamw_grad_norm's result first)", grad_norm);
    if (!(lr >= 0.0f) || !std::isfinite(lr)) fail("adamw_step: learning rate %g, must be finite and >= 0", lr);
    check_cast_pointers("adamw_step (gradients, weights)", grads, weights);
    const float clip = (c.grad_clip > 0.0f && grad_norm > c.grad_clip) ? c.grad_clip / grad_norm : 1.0f;
    const AdamWStepArgs a = adamw_step_args(opt, lr, clip);
    const bool stats = adamw_needs_stats(c);
    // The norm pass's statistics are this update's when they came from these gradients for this update and
    // the clip factor is exactly 1 (section 3); otherwise the stats pass makes them.
    const bool stats_ready = stats && clip == 1.0f && opt->stats_grads == grads && opt->stats_step == opt->step;
    opt->stats_grads = nullptr;
    opt->step += 1;
    adamw_dispatch(c, [&](auto m_type, auto v_type) {
        constexpr DType M = decltype(m_type)::value, V = decltype(v_type)::value;
        if (stats && !stats_ready) {
            adamw_stats_kernel<M, V><<<opt->num_blocks, ADAMW_THREADS, 0, stream>>>(opt->block_stats, grads, opt->m, opt->v, opt->m_meta,
                                                                                   opt->v_meta, opt->tensors, opt->block_tensor, a,
                                                                                   false, true, c.update_clip);
            cudaCheckLaunch();
        }
        if (stats || opt->gathers_weight_amax) {
            adamw_scales_kernel<<<(int)opt->specs.size(), ADAMW_THREADS, 0, stream>>>(opt->scales, opt->m_meta, opt->v_meta, opt->block_stats,
                                                                                       opt->tensors, moment_fp8_format<M>, moment_fp8_format<V>,
                                                                                       Fp8Recipe(), c.update_clip);
            cudaCheckLaunch();
        }
        adamw_update_kernel<M, V><<<opt->num_blocks, ADAMW_THREADS, 0, stream>>>(opt->master, opt->m, opt->v, weights, grads, opt->tensors,
                                                                                 opt->block_tensor, opt->scales, a);
        cudaCheckLaunch();
    });
}

inline void adamw_export_weights(const AdamW* opt, bf16* weights, cudaStream_t stream) {
    check_cast_pointers("adamw_export_weights", weights, weights);
    adamw_export_weights_kernel<<<opt->num_blocks, ADAMW_THREADS, 0, stream>>>(weights, opt->master, opt->tensors, opt->block_tensor);
    cudaCheckLaunch();
}

// ----------------------------------------------------------------------------------------------
// 6. Save and load. The format (little-endian):
//   AdamWFileHeader (40 bytes, below), then the state parts of section 3 in order, each exactly its bytes:
//   master weights, m, v, m scales (if FP8), v scales (if FP8). Fp8Meta is saved whole (scale, inv_scale,
//   amax, counters, history), so a resumed run quantizes exactly as the uninterrupted one.
constexpr uint32_t ADAMW_MAGIC = 0x574D4441;   // the bytes "ADMW"
constexpr uint32_t ADAMW_VERSION = 1;
struct AdamWFileHeader {
    uint32_t magic, version;
    uint32_t m_dtype, v_dtype;     // DType codes
    uint32_t num_tensors;
    int32_t step;                  // updates applied
    uint64_t num_params;
    uint64_t table_hash;           // FNV-1a of the tensors' (offset, numel)
};
static_assert(sizeof(AdamWFileHeader) == 40, "the AdamW file header is 40 bytes, as documented");

inline uint64_t adamw_table_hash(const std::vector<TensorSpec>& specs) {
    uint64_t h = 14695981039346656037ull;
    for (const TensorSpec& s : specs) {
        uint64_t words[2] = {s.offset, s.numel};
        const unsigned char* p = (const unsigned char*)words;
        for (size_t i = 0; i < sizeof(words); i++) h = (h ^ p[i]) * 1099511628211ull;
    }
    return h;
}
inline AdamWFileHeader adamw_file_header(const AdamW* opt) {
    return {ADAMW_MAGIC, ADAMW_VERSION, (uint32_t)opt->config.m_dtype, (uint32_t)opt->config.v_dtype,
            (uint32_t)opt->specs.size(), opt->step, opt->num_params, adamw_table_hash(opt->specs)};
}

constexpr size_t ADAMW_IO_CHUNK = 64u << 20;   // device <-> file through a 64 MiB host buffer

inline void adamw_save(const AdamW* opt, FILE* f, const char* path) {
    cudaCheck(cudaDeviceSynchronize());
    AdamWFileHeader h = adamw_file_header(opt);
    if (fwrite(&h, sizeof(h), 1, f) != 1) fail("writing the optimizer header to %s failed: %s (disk full?)", path, strerror(errno));
    std::vector<char> buffer(ADAMW_IO_CHUNK);
    for (const AdamWPart& part : adamw_state_parts(opt)) {
        for (size_t done = 0; done < part.bytes; done += ADAMW_IO_CHUNK) {
            size_t n = std::min(ADAMW_IO_CHUNK, part.bytes - done);
            cudaCheck(cudaMemcpy(buffer.data(), (char*)part.ptr + done, n, cudaMemcpyDeviceToHost));
            if (fwrite(buffer.data(), 1, n, f) != n) fail("writing the %s to %s failed: %s (disk full?)", part.name, path, strerror(errno));
        }
    }
}

inline void adamw_load(AdamW* opt, FILE* f, const char* path) {
    AdamWFileHeader got, want = adamw_file_header(opt);
    if (fread(&got, sizeof(got), 1, f) != 1) fail("%s: the optimizer state is missing (file ends before its header)", path);
    if (got.magic != ADAMW_MAGIC || got.version != ADAMW_VERSION)
        fail("%s: no AdamW state version %u here (magic 0x%08x version %u): damaged or foreign file", path, ADAMW_VERSION, got.magic, got.version);
    if (got.m_dtype != want.m_dtype || got.v_dtype != want.v_dtype)
        fail("%s: the saved moments are m %s, v %s; this run has m %s, v %s: resume with --m-dtype/--v-dtype of the saved run",
             path, got.m_dtype < 4 ? dtype_name((DType)got.m_dtype) : "?", got.v_dtype < 4 ? dtype_name((DType)got.v_dtype) : "?",
             dtype_name(opt->config.m_dtype), dtype_name(opt->config.v_dtype));
    if (got.num_tensors != want.num_tensors || got.num_params != want.num_params || got.table_hash != want.table_hash)
        fail("%s: the saved optimizer has %u tensors and %llu parameters (layout hash %016llx), this model %u and %llu (%016llx)",
             path, got.num_tensors, (unsigned long long)got.num_params, (unsigned long long)got.table_hash, want.num_tensors,
             (unsigned long long)want.num_params, (unsigned long long)want.table_hash);
    if (got.step < 0) fail("%s: the saved optimizer step is %d: damaged file", path, got.step);
    std::vector<char> buffer(ADAMW_IO_CHUNK);
    for (const AdamWPart& part : adamw_state_parts(opt)) {
        for (size_t done = 0; done < part.bytes; done += ADAMW_IO_CHUNK) {
            size_t n = std::min(ADAMW_IO_CHUNK, part.bytes - done);
            if (fread(buffer.data(), 1, n, f) != n) fail("%s: the optimizer's %s ends early (truncated file)", path, part.name);
            cudaCheck(cudaMemcpy((char*)part.ptr + done, buffer.data(), n, cudaMemcpyHostToDevice));
        }
    }
    opt->step = got.step;
    opt->stats_grads = nullptr;   // the state changed: statistics from before are not this state's
}

inline void adamw_print_memory(const AdamW* opt) {
    const AdamWConfig& c = opt->config;
    size_t mb = dtype_size(c.m_dtype), vb = dtype_size(c.v_dtype);
    size_t meta_bytes = ((opt->m_meta ? 1 : 0) + (opt->v_meta ? 1 : 0)) * opt->specs.size() * sizeof(Fp8Meta);
    printf("optimizer: AdamW, m %s%s, v %s%s, FP32 master weights%s%s\n", dtype_name(c.m_dtype),
           dtype_is_fp8(c.m_dtype) ? " (per-tensor scale)" : "", dtype_name(c.v_dtype),
           dtype_is_fp8(c.v_dtype) ? " (sqrt(v), per-tensor scale)" : "", c.update_clip ? ", update clipping" : "",
           c.use_atan2 ? ", Adam-atan2" : "");
    printf("bytes per parameter: weights 2 (BF16) + gradients 4 (FP32) + master weights 4 (FP32) + moments %zu (m %zu + v %zu) = %zu\n",
           mb + vb, mb, vb, 2 + 4 + 4 + mb + vb);
    printf("optimizer state: %.1f MiB for %zu parameters in %zu tensors (FP8 scales %.1f KiB)\n",
           (double)opt->num_params * (4 + mb + vb) / 1048576.0, opt->num_params, opt->specs.size(), meta_bytes / 1024.0);
}
