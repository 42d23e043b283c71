// test_fp8.cu: the numerics test. Host reference implementations (float64 where it matters) and every
// GPU kernel checked against them. Host-only tests always run; GPU tests are skipped (and counted) when
// there is no GPU. The last line is "N passed, N failed, N skipped"; any failure exits non-zero.
//   ./test_fp8                 all tests
//   ./test_fp8 NAME...         only the tests whose names contain one of the NAMEs
//   ./test_fp8 --bench         the benchmark tables (GPU)
#include "fp8_kernels.cuh"
#include <vector>
#include <string>
#include <random>
#include <functional>
#include <cstdarg>

// ----------------------------------------------------------------------------------------------
// The harness: named tests registered at static-init time; a test fails if any expectation fails.

struct TestCase { const char* name; bool needs_gpu; void (*fn)(); };
static std::vector<TestCase>& test_registry() { static std::vector<TestCase> r; return r; }
struct TestRegistrar { TestRegistrar(const char* n, bool gpu, void (*f)()) { test_registry().push_back({n, gpu, f}); } };
#define HOST_TEST(name) static void name(); static TestRegistrar name##_reg(#name, false, name); static void name()
#define GPU_TEST(name)  static void name(); static TestRegistrar name##_reg(#name, true, name); static void name()

static int g_test_failures = 0;   // failed expectations in the running test
static const uint64_t TEST_SEED = 1234;

// Record a failed expectation with a message; the test goes on so all its failures are shown.
static void expect(bool ok, const char* fmt, ...) {
    if (ok) return;
    g_test_failures++;
    va_list ap;
    va_start(ap, fmt);
    printf("    FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

// ||got - ref|| / ||ref|| and max |got - ref|, printed with the tolerance. NaN never passes.
struct ErrorStats { double rel_l2, max_abs; bool finite; };
template <class T>
static ErrorStats error_stats(const T* got, const double* ref, size_t n) {
    double num = 0, den = 0, max_abs = 0;
    bool finite = true;
    for (size_t i = 0; i < n; i++) {
        double g = (double)to_float(got[i]);
        if (!std::isfinite(g)) finite = false;
        double d = g - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
        max_abs = std::max(max_abs, fabs(d));
    }
    return {den > 0 ? sqrt(num / den) : sqrt(num), max_abs, finite};
}
template <class T>
static bool expect_close(const char* what, const T* got, const double* ref, size_t n, double rel_tol) {
    ErrorStats e = error_stats(got, ref, n);
    bool ok = e.finite && e.rel_l2 <= rel_tol;
    printf("    %-44s rel_l2 %.3e (tol %.1e)  max_abs %.3e%s\n", what, e.rel_l2, rel_tol, e.max_abs, ok ? "" : "  <-- FAIL");
    if (!ok) g_test_failures++;
    return ok;
}

// Random inputs: fixed seed, printed once at start; never zeros.
static std::mt19937_64& test_rng() { static std::mt19937_64 rng(TEST_SEED); return rng; }
static std::vector<float> random_normal(size_t n, float stddev) {
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(test_rng());
    return v;
}

static bool g_have_gpu = false;

// Device buffers for tests: allocated, filled from host, poisoned before kernels write them.
template <class T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) { cudaCheck(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T))); }
    DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void upload(const std::vector<T>& host) { cudaCheck(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> download() const {
        std::vector<T> host(n);
        cudaCheck(cudaDeviceSynchronize());
        cudaCheck(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
    void poison() { cudaCheck(cudaMemset(ptr, 0xFF, n * sizeof(T))); }   // NaN in every float format
};
static std::vector<bf16> to_bf16(const std::vector<float>& v) {
    std::vector<bf16> out(v.size());
    for (size_t i = 0; i < v.size(); i++) out[i] = __float2bfloat16(v[i]);
    return out;
}
template <class T>
static std::vector<double> to_double(const std::vector<T>& v) {
    std::vector<double> out(v.size());
    for (size_t i = 0; i < v.size(); i++) out[i] = (double)to_float(v[i]);
    return out;
}

// TEST-SECTIONS (each section: host references first, then the tests that use them)
// (during development each section lives in a part file; they are merged into this file at the end)
#if __has_include("part_fp8core.inc")
#include "part_fp8core.inc"
#endif
#if __has_include("part_dataloader.inc")
#include "part_dataloader.inc"
#endif
#if __has_include("part_ref_model.inc")
#include "part_ref_model.inc"
#endif
#if __has_include("part_attention.inc")
#include "part_attention.inc"
#endif
#if __has_include("part_model.inc")
#include "part_model.inc"
#endif
#if __has_include("part_fp8linear.inc")
#include "part_fp8linear.inc"
#endif
#if __has_include("part_adamw.inc")
#include "part_adamw.inc"
#endif
#if __has_include("part_train.inc")
#include "part_train.inc"
#endif
#if __has_include("part_bench.inc")
#include "part_bench.inc"
#else
static void run_benchmarks(const std::vector<std::string>&) { printf("no benchmarks built\n"); }
#endif

// ----------------------------------------------------------------------------------------------
// main

int main(int argc, char** argv) {
    std::vector<std::string> filters;
    bool bench = false;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--bench") bench = true;
        else if (a == "--help" || a == "-h") {
            printf("usage: %s [NAME...]          run the tests (only those whose names contain a NAME)\n"
                   "       %s --bench [gemm] [cast] [model]   benchmark tables (GPU): all, or those named\n", argv[0], argv[0]);
            return 0;
        } else filters.push_back(a);
    }
    int device_count = 0;
    g_have_gpu = cudaGetDeviceCount(&device_count) == cudaSuccess && device_count > 0;
    cudaGetLastError();   // clear the "no device" error, if any
    if (g_have_gpu) {
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        printf("GPU: %s (sm_%d%d, %d SMs, %.0f GiB)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
               prop.totalGlobalMem / 1073741824.0);
    } else {
        printf("GPU: none found; GPU tests will be skipped\n");
    }
#if defined(PRECISION_FP8)
    printf("build: PRECISION=FP8, seed %llu\n", (unsigned long long)TEST_SEED);
#else
    printf("build: PRECISION=BF16, seed %llu\n", (unsigned long long)TEST_SEED);
#endif
    if (bench) {
        if (!g_have_gpu) { fprintf(stderr, "error: --bench needs a GPU, and none was found\n"); return 1; }
        run_benchmarks(filters);
        return 0;
    }
    int passed = 0, failed = 0, skipped = 0;
    for (const TestCase& t : test_registry()) {
        bool selected = filters.empty();
        for (auto& f : filters) selected |= strstr(t.name, f.c_str()) != nullptr;
        if (!selected) continue;
        if (t.needs_gpu && !g_have_gpu) {
            printf("SKIP %s (no GPU)\n", t.name);
            skipped++;
            continue;
        }
        printf("TEST %s\n", t.name);
        fflush(stdout);
        g_test_failures = 0;
        test_rng().seed(TEST_SEED);
        t.fn();
        if (t.needs_gpu) cudaCheck(cudaDeviceSynchronize());
        if (g_test_failures == 0) { printf("  ok %s\n", t.name); passed++; }
        else { printf("  FAILED %s (%d expectations)\n", t.name, g_test_failures); failed++; }
        fflush(stdout);
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed == 0 ? 0 : 1;
}
