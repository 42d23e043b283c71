// common.cuh: what every file of the project shares; nothing here is FP8 (that is fp8_kernels.cuh).
//   1. error checks           cudaCheck / cublasCheck / ncclCheck, with file, line, call and message; fail
//   2. types and packed loads bf16, 16-byte vectors, ceil_div, TensorSpec, TpGroup, device attributes
//   3. the step profile       NVTX ranges, the CUDA-event timing of a step's phases (--profile) and its table beside
//                             each phase's floor; the GPU timer of the benchmarks and of the floors' rates
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <nccl.h>
#include <nvtx3/nvToolsExt.h>
#include <cub/device/device_radix_sort.cuh>   // the embedding backward's sort (before fail(): it includes <ios>)
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <algorithm>
#include <atomic>
#include <functional>

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
// 2. Types and packed 16-byte loads/stores; the tensor table, the tensor-parallel group, device attributes.

typedef __nv_bfloat16 bf16;

// ceil(a / b) as an int (a grid size, a tile count): computed in 64 bits; a result beyond int is an error, never wrapped.
inline int ceil_div(long a, long b) {
    const long q = (a + b - 1) / b;
    if (q > INT_MAX) fail("ceil_div(%ld, %ld) = %ld exceeds the int range of a grid or tile count: sizes too large", a, b, q);
    return (int)q;
}

// 16 bytes of T: what one thread moves in one instruction (LDG.128 / STG.128).
template <class T>
struct alignas(16) Packed128 {
    static constexpr int size = 16 / sizeof(T);
    T v[size];
};
template <class T> __device__ inline Packed128<T> load128(const T* p) { return *reinterpret_cast<const Packed128<T>*>(p); }
constexpr int BF16_PER_16B = Packed128<bf16>::size;   // 8
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

// A tensor-parallel group as the code that needs one sees it: this rank, the group size, and an in-place
// all-reduce on a stream with ncclAllReduce's types and ops. train_fp8.cu's is NCCL (tp_nccl_all_reduce); the
// one-GPU shard test's sums on the host. Every rank ends with the same bits (NCCL's all-reduce guarantees it).
struct TpGroup {
    int size = 1, rank = 0;
    ncclComm_t comm = nullptr;   // the NCCL group's communicator
    void* host = nullptr;        // the host simulation's shared state
    void (*all_reduce)(const TpGroup* g, void* buf, size_t count, ncclDataType_t type, ncclRedOp_t op, cudaStream_t s) = nullptr;
};
inline void tp_all_reduce(const TpGroup* g, void* buf, size_t count, ncclDataType_t type, ncclRedOp_t op, cudaStream_t s) {
    g->all_reduce(g, buf, count, type, op, s);
}

__host__ __device__ inline float to_float(float x) { return x; }
__host__ __device__ inline float to_float(bf16 x) { return __bfloat162float(x); }

// An attribute of the current device (cudaDeviceGetAttribute), queried once per device.
template <cudaDeviceAttr ATTR>
inline int device_attribute() {
    constexpr int MAX_DEVICES = 64;
    static std::atomic<int> values[MAX_DEVICES];   // 0: not yet known
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    if (dev >= MAX_DEVICES) fail("device %d: this program handles devices 0..%d", dev, MAX_DEVICES - 1);
    int v = values[dev].load();
    if (v == 0) {
        cudaCheck(cudaDeviceGetAttribute(&v, ATTR, dev));
        values[dev].store(v);
    }
    return v;
}
inline int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

// ----------------------------------------------------------------------------------------------
// 3. The step profile. Every launch site of a training step sits in a ProfileRange naming its phase. A range
// is always an NVTX range, so Nsight Systems shows the step's structure (step > micro-batch > forward or
// backward > layer > phase), and while a StepProfile records the range's stream (train_fp8 --profile N) it is
// also a pair of CUDA events. Afterwards a phase's time is the sum of its ranges: GPU time from the range's
// first launch to the end of its last, idle moments between the launches of one range included. "Idle" is
// the step's GPU span minus every range: the GPU waiting for the host between ranges (launch overhead, host
// synchronizations, host work). Ranges do not nest: one opened inside another is NVTX only and its time
// counts in the outer one's phase.
// A kernel that computes a layer's math counts in that layer's phase in both builds, also where it writes FP8
// (a cast fused into RMSNorm, SwiGLU or RoPE): the same math lands in the same row of either build, and the
// FP8 cast phase holds only kernels that do nothing but quantize (plain casts, amax passes, scale updates).

enum ProfilePhase {
    PHASE_GEMM_FWD, PHASE_GEMM_BWD, PHASE_FP8_CAST, PHASE_ATTN_FWD, PHASE_ATTN_BWD, PHASE_NORM, PHASE_ROPE,
    PHASE_SWIGLU, PHASE_EMBEDDING, PHASE_LM_HEAD, PHASE_LOSS, PHASE_TP_COMM, PHASE_DATA, PHASE_OPTIMIZER,
    PHASE_WEIGHT_QUANT, PHASE_OTHER, PHASE_COUNT
};
inline const char* profile_phase_name(ProfilePhase p) {
    static const char* names[PHASE_COUNT] = {
        "forward GEMMs (decoder linears)", "backward GEMMs (decoder linears)", "FP8 casts alone, amax, scales",
        "attention forward", "attention backward", "RMSNorm (+ residual add, + fused cast)", "RoPE (+ fused cast)",
        "SwiGLU (+ fused cast)", "embedding",
        "lm_head GEMMs", "cross-entropy, loss", "tensor-parallel all-reduces", "input copies to the GPU",
        "optimizer (zero grads, grad norm, AdamW)", "weight re-quantization (W8, W8^T)", "other (memsets)"};
    return names[p];
}

struct StepProfile {
    cudaStream_t stream = nullptr;          // the stream timed (one GPU's: rank 0's under --tp)
    cudaEvent_t step_begin = nullptr, step_end = nullptr;
    std::vector<cudaEvent_t> events;        // a pool; range i of this step recorded events[2i] and events[2i+1]
    std::vector<ProfilePhase> phases;       // the phase of range i
    size_t used = 0;                        // events recorded this step
    bool in_range = false;
};
// The profile recording now, or nullptr. Set and cleared between steps by the thread that runs the loop.
inline StepProfile* g_step_profile = nullptr;

struct NvtxRange {
    explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
    explicit NvtxRange(const std::string& name) { nvtxRangePushA(name.c_str()); }
    ~NvtxRange() { nvtxRangePop(); }
    NvtxRange(const NvtxRange&) = delete;
    NvtxRange& operator=(const NvtxRange&) = delete;
};

inline cudaEvent_t profile_next_event(StepProfile* p) {
    if (p->used == p->events.size()) {
        cudaEvent_t e;
        cudaCheck(cudaEventCreate(&e));
        p->events.push_back(e);
    }
    return p->events[p->used++];
}

// The work launched on `stream` while it lives belongs to `phase`; `name` (default: the phase's) is its NVTX name.
struct ProfileRange {
    StepProfile* profile = nullptr;
    cudaStream_t stream;
    NvtxRange nvtx;
    ProfileRange(ProfilePhase phase, cudaStream_t s, const char* name = nullptr) : stream(s), nvtx(name ? name : profile_phase_name(phase)) {
        StepProfile* p = g_step_profile;
        if (!p || p->stream != s || p->in_range) return;
        profile = p;
        p->in_range = true;
        p->phases.push_back(phase);
        cudaCheck(cudaEventRecord(profile_next_event(p), s));
    }
    ~ProfileRange() {
        if (!profile) return;
        cudaCheck(cudaEventRecord(profile_next_event(profile), stream));
        profile->in_range = false;
    }
    ProfileRange(const ProfileRange&) = delete;
    ProfileRange& operator=(const ProfileRange&) = delete;
};

// Start recording the ranges launched on `stream` (events for `expected_ranges` made beforehand, so that
// creating them does not slow the step); the current device must be the stream's.
inline void profile_begin(StepProfile* p, cudaStream_t stream, size_t expected_ranges) {
    if (!p->step_begin) {
        cudaCheck(cudaEventCreate(&p->step_begin));
        cudaCheck(cudaEventCreate(&p->step_end));
    }
    while (p->events.size() < 2 * expected_ranges) {
        cudaEvent_t e;
        cudaCheck(cudaEventCreate(&e));
        p->events.push_back(e);
    }
    p->stream = stream;
    p->used = 0;
    p->phases.clear();
    p->in_range = false;
    cudaCheck(cudaEventRecord(p->step_begin, stream));
    g_step_profile = p;
}
inline void profile_end(StepProfile* p) {
    cudaCheck(cudaEventRecord(p->step_end, p->stream));
    g_step_profile = nullptr;
}
inline void profile_destroy(StepProfile* p) {
    for (cudaEvent_t e : p->events) cudaCheck(cudaEventDestroy(e));
    if (p->step_begin) {
        cudaCheck(cudaEventDestroy(p->step_begin));
        cudaCheck(cudaEventDestroy(p->step_end));
    }
    *p = StepProfile();
}

// A phase's floor: the least time its work can take on this GPU (train_fp8.cu, phase_floor), and how it was reckoned
// ("6.40 TFLOP at 1502 TFLOP/s (FP8)"); ms < 0: none (the basis says why).
struct PhaseFloor {
    double ms = -1;
    std::string basis;
    double amax_reread_ms = 0;   // current scaling's amax pass re-reading the casts' inputs: the recipe's cost beyond the floor
};
// The recorded step, per phase: milliseconds and number of ranges; span: step_begin to step_end. floors: set by the caller.
struct ProfileReport {
    double ms[PHASE_COUNT] = {};
    int ranges[PHASE_COUNT] = {};
    double span_ms = 0, busy_ms = 0;
    PhaseFloor floors[PHASE_COUNT];
    double idle_ms() const { return span_ms - busy_ms; }
};
// Waits for the step's events.
inline ProfileReport profile_report(const StepProfile* p) {
    ProfileReport r;
    cudaCheck(cudaEventSynchronize(p->step_end));
    float span;
    cudaCheck(cudaEventElapsedTime(&span, p->step_begin, p->step_end));
    r.span_ms = span;
    for (size_t i = 0; i < p->phases.size(); i++) {
        float t0, t1;   // from step_begin: one rounding per event, none accumulated
        cudaCheck(cudaEventElapsedTime(&t0, p->step_begin, p->events[2 * i]));
        cudaCheck(cudaEventElapsedTime(&t1, p->step_begin, p->events[2 * i + 1]));
        r.ms[p->phases[i]] += t1 - t0;
        r.ranges[p->phases[i]] += 1;
        r.busy_ms += t1 - t0;
    }
    return r;
}
// The table of a recorded step: per phase with ranges its ms, share of the span, ranges, floor ms (or -), ms over the floor
// (or -: no floor, or none to divide by) and the floor's basis; then the idle time, and the span beside the sum of the
// phases' floors. scripts/results.py reads it.
inline std::string profile_table(const ProfileReport& r, const std::string& title) {
    std::string out = title + "\n";
    char line[512];
    auto floor_cells = [&](double ms, double floor_ms, const std::string& basis, double reread_ms) {
        char f[32] = "-", x[32] = "-";
        if (floor_ms >= 0) snprintf(f, sizeof f, "%.3f", floor_ms);
        if (floor_ms > 0) snprintf(x, sizeof x, "%.2fx", ms / floor_ms);
        snprintf(line, sizeof line, " %9s %8s  %s", f, x, basis.c_str());
        out += line;
        if (reread_ms > 0 && floor_ms >= 0) {
            snprintf(line, sizeof line, "; + %.3f ms of current scaling's amax reads: %.2fx both", reread_ms, ms / (floor_ms + reread_ms));
            out += line;
        }
        out += "\n";
    };
    snprintf(line, sizeof line, "  %-42s %9s %7s %7s %9s %8s  %s\n", "phase", "ms", "%", "ranges", "floor ms", "x floor", "floor basis");
    out += line;
    double floor_sum = 0;
    for (int p = 0; p < PHASE_COUNT; p++) {
        if (r.ranges[p] == 0) continue;
        snprintf(line, sizeof line, "  %-42s %9.3f %6.1f%% %7d", profile_phase_name((ProfilePhase)p), r.ms[p], 100.0 * r.ms[p] / r.span_ms,
                 r.ranges[p]);
        out += line;
        floor_cells(r.ms[p], r.floors[p].ms, r.floors[p].basis.empty() ? "-" : r.floors[p].basis, r.floors[p].amax_reread_ms);
        floor_sum += std::max(0.0, r.floors[p].ms);
    }
    snprintf(line, sizeof line, "  %-42s %9.3f %6.1f%%\n", "idle (GPU span - all ranges)", r.idle_ms(), 100.0 * r.idle_ms() / r.span_ms);
    out += line;
    snprintf(line, sizeof line, "  %-42s %9.3f %6.1f%% %7s", "GPU span of the step", r.span_ms, 100.0, "");
    out += line;
    floor_cells(r.span_ms, floor_sum, "the floors above, summed", 0);
    const double gemm_attn = r.ms[PHASE_GEMM_FWD] + r.ms[PHASE_GEMM_BWD] + r.ms[PHASE_LM_HEAD] + r.ms[PHASE_ATTN_FWD] + r.ms[PHASE_ATTN_BWD];
    snprintf(line, sizeof line, "  outside GEMMs and attention: %.3f ms busy, %.3f ms with idle\n", r.busy_ms - gemm_attn, r.span_ms - gemm_attn);
    return out + line;
}

// The median of `reps` runs of fn on the current GPU's default stream after `warmup` runs, each timed by events around
// it: the benchmarks' timer (test_fp8 --bench) and that of the floors' rates (train_fp8 --profile).
inline float bench_median_ms(const std::function<void()>& fn, int reps = 20, int warmup = 3) {
    for (int i = 0; i < warmup; i++) fn();
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    std::vector<float> ms(reps);
    for (int i = 0; i < reps; i++) {
        cudaCheck(cudaEventRecord(start));
        fn();
        cudaCheck(cudaEventRecord(stop));
        cudaCheck(cudaEventSynchronize(stop));
        cudaCheck(cudaEventElapsedTime(&ms[i], start, stop));
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    std::sort(ms.begin(), ms.end());
    return ms[reps / 2];
}

// The bandwidth of a device-to-device copy of 1 GiB in GB/s (bytes read + written): the floor of any pass over memory.
inline double bench_copy_gbs() {
    const size_t bytes = 1ull << 30;
    void *a, *b;
    cudaCheck(cudaMalloc(&a, bytes));
    cudaCheck(cudaMalloc(&b, bytes));
    cudaCheck(cudaMemset(a, 1, bytes));
    const float ms = bench_median_ms([&] { cudaCheck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
    cudaCheck(cudaFree(a));
    cudaCheck(cudaFree(b));
    return 2.0 * bytes / ms / 1e6;
}

// Values for timing only: uniform in [-amplitude, amplitude) from a hash of the index (no host init of 1B numbers).
template <class T>
__global__ void bench_fill_kernel(T* x, size_t n, float amplitude) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 31;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 29;
        x[i] = (T)(((h >> 40) / 16777216.0f - 0.5f) * 2.0f * amplitude);
    }
}
