// llama2.cuh: the LLaMA-2 model on one GPU, or one tensor-parallel rank's share of it.
//   1. config       ModelConfig, the presets (tiny, d12, 110m, 1b, 7b) and their validation
//   2. parameters   the flat layout (README.md, "Parameter layout"), a reproducible init, FLOPs per token, tensor-parallel shards
//   3. layers       embedding, RMSNorm (fused with the residual add), RoPE, SwiGLU, cross-entropy fused with
//                   lm_head: each a forward/backward pair of kernels with plain launchers (attention.cuh has
//                   the attention)
//   4. the state    Model: weights, gradients and activations, one allocation each
//   5. the linear   linear_forward / linear_backward: every decoder projection, and where the FP8 linear layer
//                   (fp8_kernels.cuh) plugs in
//   6. the model    create/destroy, forward, backward, loss, logits
//   7. tensor parallelism   where the all-reduces go, the layout print (the NCCL groups: train_fp8.cu)
// One token through the forward pass:
//   x = tok_embedding[token]
//   each layer:  h = x + wo(attention(rope(wqkv(rmsnorm(x)))))   (--qkv-clip, --qk-norm: clip, then norm, before rope)
//                x = h + w_down(swiglu(w_gate_up(rmsnorm(h))))
//   loss = cross_entropy(lm_head(rmsnorm(x)), target)
// Activations and activation gradients are BF16, statistics FP32, parameter gradients FP32.
#pragma once
#include "fp8_kernels.cuh"
#include "attention.cuh"
#include "dataloader.h"   // strprintf, splitmix64
#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

// ----------------------------------------------------------------------------------------------
// 1. Config

struct ModelConfig {
    int vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq_len;
    float norm_eps, rope_theta;
    bool qk_norm = false;    // --qk-norm: RMSNorm with a learned weight on each head of Q and K before RoPE (section 3)
    float qkv_clip = 0.0f;   // --qkv-clip: wqkv's output clamped to [-qkv_clip, qkv_clip] before RoPE; 0 = off (section 3)
};

// LLaMA's FFN width: SwiGLU has three matrices instead of two, so the hidden width is 2/3 of 4*dim (the
// same parameter count), rounded up to a multiple of 256.
inline int llama_ffn_dim(int dim) {
    const int multiple_of = 256;
    return multiple_of * ceil_div(2 * (4 * dim) / 3, multiple_of);
}

// A cap that keeps a mistyped layer count from allocating the host's memory away before anything else is checked
// (the parameter table is built per layer): no model this program can train comes near it.
constexpr int MODEL_MAX_LAYERS = 1024;
// "" if the config can run, else what is wrong and what to do.
inline std::string model_config_problem(const ModelConfig& c) {
    if (c.n_layers > MODEL_MAX_LAYERS)
        return strprintf("n_layers %d: at most %d (is a digit too many?)", c.n_layers, MODEL_MAX_LAYERS);
    if (c.vocab_size < 16 || c.vocab_size % 16 != 0)
        return strprintf("vocab_size %d must be a positive multiple of 16 (the GEMM rule): pad the vocabulary "
                         "(model_config_preset does)", c.vocab_size);
    if (c.dim < 16 || c.dim % 16 != 0) return strprintf("dim %d must be a positive multiple of 16 (the GEMM rule)", c.dim);
    if (c.n_layers < 1) return strprintf("n_layers %d must be at least 1", c.n_layers);
    if (c.n_heads < 1 || c.n_kv_heads < 1 || c.n_heads % c.n_kv_heads != 0)
        return strprintf("n_heads %d must be a positive multiple of n_kv_heads %d (each KV head serves "
                         "n_heads / n_kv_heads query heads)", c.n_heads, c.n_kv_heads);
    if (c.head_dim != 64 && c.head_dim != 128)
        return strprintf("head_dim %d is not supported: the attention kernels handle 64 or 128; choose n_heads = "
                         "dim / 64 or dim / 128", c.head_dim);
    if (c.head_dim * c.n_heads != c.dim)
        return strprintf("head_dim %d x n_heads %d must equal dim %d", c.head_dim, c.n_heads, c.dim);
    if (c.ffn_dim < 16 || c.ffn_dim % 16 != 0)
        return strprintf("ffn_dim %d must be a positive multiple of 16 (the GEMM rule)", c.ffn_dim);
    if (c.max_seq_len < 1) return strprintf("max_seq_len %d must be at least 1", c.max_seq_len);
    if (!(c.norm_eps > 0.0f)) return strprintf("norm_eps %g must be positive", c.norm_eps);
    if (!(c.rope_theta > 0.0f)) return strprintf("rope_theta %g must be positive", c.rope_theta);
    if (!(c.qkv_clip >= 0.0f) || !std::isfinite(c.qkv_clip)) return strprintf("qkv_clip %g must be finite and >= 0 (0 = off)", c.qkv_clip);
    return "";
}
inline void model_config_validate(const ModelConfig& c) {
    std::string problem = model_config_problem(c);
    if (!problem.empty()) fail("model config: %s", problem.c_str());
}

// The vocabulary comes from the data; it is padded up to a multiple of 16 (the GEMM rule). Padded ids never
// occur as inputs or targets: their logits only learn to be small.
inline ModelConfig model_config_preset(const char* name, int vocab_size) {
    struct Preset { const char* name; int dim, n_layers, n_heads, n_kv_heads, ffn_dim, max_seq_len; };
    static const Preset presets[] = {   // ffn_dim 0: LLaMA's rule
        {"tiny", 128, 2, 2, 1, 0, 256},           // the tests: head_dim 64, two query heads per KV head
        {"d12", 768, 12, 12, 12, 0, 1024},        // GPT-2 small's shape
        {"110m", 768, 12, 12, 12, 0, 1024},       // llama2.c's stories110M
        {"1b", 2048, 22, 32, 4, 5632, 2048},      // TinyLlama-1.1B
        {"7b", 4096, 32, 32, 32, 11008, 4096},    // LLaMA-2 7B
    };
    if (vocab_size < 1) fail("model_config_preset: vocab_size %d must be positive (it comes from the data)", vocab_size);
    for (const Preset& p : presets) {
        if (strcmp(p.name, name) != 0) continue;
        ModelConfig c;
        c.vocab_size = 16 * ceil_div(vocab_size, 16);
        c.dim = p.dim;
        c.n_layers = p.n_layers;
        c.n_heads = p.n_heads;
        c.n_kv_heads = p.n_kv_heads;
        c.head_dim = p.dim / p.n_heads;
        c.ffn_dim = p.ffn_dim ? p.ffn_dim : llama_ffn_dim(p.dim);
        c.max_seq_len = p.max_seq_len;
        c.norm_eps = 1e-5f;
        c.rope_theta = 10000.0f;
        model_config_validate(c);
        return c;
    }
    fail("unknown model preset '%s': choose tiny, d12, 110m, 1b or 7b", name);
}

inline int model_qkv_dim(const ModelConfig& c) { return (c.n_heads + 2 * c.n_kv_heads) * c.head_dim; }

// ----------------------------------------------------------------------------------------------
// 2. Parameters: one flat allocation in the order of README.md's "Parameter layout", walked through the table of TensorSpec.
//   tok_embedding [V,D]; per layer attn_norm [D], wqkv [QKV,D], wo [D,D], ffn_norm [D], w_gate_up [2F,D],
//   w_down [D,F]; final_norm [D]; lm_head [V,D]. Index in the table: 0, then 1 + 6l + LayerParam, then 1 + 6L, 2 + 6L.
//   With --qk-norm, after them: per layer qk_norm [2 HD] (the weight of Q's heads, then K's), index 3 + 6L + l; the
//   tensors before keep their offsets.

enum LayerParam { ATTN_NORM = 0, WQKV, WO, FFN_NORM, W_GATE_UP, W_DOWN, PARAMS_PER_LAYER };
constexpr int PARAM_TOK_EMBEDDING = 0;
inline int param_layer(int l, LayerParam p) { return 1 + l * PARAMS_PER_LAYER + p; }
inline int param_final_norm(const ModelConfig& c) { return 1 + c.n_layers * PARAMS_PER_LAYER; }
inline int param_lm_head(const ModelConfig& c) { return 2 + c.n_layers * PARAMS_PER_LAYER; }
inline int param_qk_norm(const ModelConfig& c, int l) { return 3 + c.n_layers * PARAMS_PER_LAYER + l; }
// The way back, for the tables kept per parameter index (the shards, the init, the FP8 build's per-linear state):
// the layer and kind of parameter `param`, or layer -1 for the tensors outside the decoder layers.
struct ParamPlace { int layer; LayerParam kind; };
inline ParamPlace param_place(const ModelConfig& c, int param) {
    if (param < 1 || param >= param_final_norm(c)) return {-1, PARAMS_PER_LAYER};
    return {(param - 1) / PARAMS_PER_LAYER, (LayerParam)((param - 1) % PARAMS_PER_LAYER)};
}

// "" if the model splits over tp_size ranks (tensor parallelism, section 7), else what is wrong.
inline std::string model_tp_problem(const ModelConfig& c, int tp_size) {
    if (tp_size < 1) return strprintf("the tensor-parallel size %d must be at least 1", tp_size);
    if (c.n_heads % tp_size || c.n_kv_heads % tp_size)
        return strprintf("n_heads %d and n_kv_heads %d must both divide by the tensor-parallel size %d (each rank "
                         "holds whole heads): choose --tp among their common divisors", c.n_heads, c.n_kv_heads, tp_size);
    if (c.ffn_dim % (16 * tp_size))
        return strprintf("ffn_dim %d must divide by 16 x the tensor-parallel size %d (each rank's FFN slice is a "
                         "multiple of 16, the GEMM rule): change --ffn or --tp", c.ffn_dim, tp_size);
    return "";
}

// The parameter table of one rank of tp_size (tp_size 1: the whole model). Sharded tensors have the shard's
// shape (section 7): wqkv [(NH + 2 NKV) HD / tp, D], wo [D, NH HD / tp], w_gate_up [2F / tp, D],
// w_down [D, F / tp]; the others are whole (replicated on every rank).
inline std::vector<TensorSpec> model_param_specs(const ModelConfig& c, int tp_size = 1) {
    model_config_validate(c);
    std::string problem = model_tp_problem(c, tp_size);
    if (!problem.empty()) fail("model_param_specs: %s", problem.c_str());
    const int D = c.dim, V = c.vocab_size, F = c.ffn_dim / tp_size;
    std::vector<TensorSpec> specs;
    size_t offset = 0;
    auto add = [&](const std::string& name, int rows, int cols) {
        specs.push_back({name, offset, (size_t)rows * cols, rows, cols});
        offset += (size_t)rows * cols;
    };
    add("tok_embedding", V, D);
    for (int l = 0; l < c.n_layers; l++) {
        std::string p = "layers." + std::to_string(l) + ".";
        add(p + "attn_norm", D, 1);
        add(p + "wqkv", model_qkv_dim(c) / tp_size, D);
        add(p + "wo", D, c.n_heads * c.head_dim / tp_size);
        add(p + "ffn_norm", D, 1);
        add(p + "w_gate_up", 2 * F, D);
        add(p + "w_down", D, F);
    }
    add("final_norm", D, 1);
    add("lm_head", V, D);
    if (c.qk_norm)
        for (int l = 0; l < c.n_layers; l++) add("layers." + std::to_string(l) + ".qk_norm", 2 * c.head_dim, 1);
    return specs;
}

// "" if the model can run under --scaling block (fp8_kernels.cuh 3b) on each of tp_size ranks with micro-batches of
// `tokens` (B*T), else what is wrong: every tile and block whole, so the decoder linears' in and out (each rank's shard)
// and the tokens (the K of the dW GEMM) are multiples of 128.
inline std::string model_block_scaling_problem(const ModelConfig& c, int tp_size, long tokens) {
    if (tokens % SCALE_BLOCK)
        return strprintf("B*T = %ld tokens per micro-batch is not a multiple of %d (the weight gradient's GEMM tiles the tokens)", tokens, SCALE_BLOCK);
    const std::vector<TensorSpec> specs = model_param_specs(c, tp_size);
    for (int i = 0; i < (int)specs.size(); i++) {
        const LayerParam kind = param_place(c, i).kind;
        if (kind != WQKV && kind != WO && kind != W_GATE_UP && kind != W_DOWN) continue;
        if (specs[i].rows % SCALE_BLOCK || specs[i].cols % SCALE_BLOCK)
            return strprintf("%s is [%d, %d]%s: both must be multiples of %d (whole 128x128 blocks); change --dim, --heads, --kv-heads or --ffn",
                             specs[i].name.c_str(), specs[i].rows, specs[i].cols, tp_size > 1 ? " on each rank" : "", SCALE_BLOCK);
    }
    return "";
}

inline size_t model_num_params(const ModelConfig& c, int tp_size = 1) {
    std::vector<TensorSpec> specs = model_param_specs(c, tp_size);
    return specs.back().offset + specs.back().numel;
}

// ---- Tensor-parallel shards of the parameters (Megatron style). Rank r of n holds
//   wqkv       the rows of its query heads [r NH/n, (r+1) NH/n), then of its KV heads [r NKV/n, (r+1) NKV/n) in the
//              K block and in the V block: the whole tensor's Q, K, V order, so that its qkv activation has the
//              unsharded column layout for its heads and RoPE and attention run on local heads unchanged
//   w_gate_up  rows [r F/n, (r+1) F/n) of the gate half, then the same rows of the up half (SwiGLU stays local)
//   wo, w_down the matching columns: their input is this rank's heads / FFN slice (row-parallel)
//   the rest   whole, on every rank (replicated): embedding, norms, lm_head
// A shard is a list of blocks of rows of the whole tensor, and one range of its columns.
struct ShardMap {
    std::vector<std::pair<int, int>> row_blocks;   // (first row, rows) of the whole tensor, in shard order
    int col0, cols;
};
inline bool model_param_sharded(const ModelConfig& c, int param) {
    const LayerParam kind = param_place(c, param).kind;
    return kind == WQKV || kind == WO || kind == W_GATE_UP || kind == W_DOWN;
}
inline ShardMap model_shard_map(const ModelConfig& c, int param, const TensorSpec& whole, int tp_size, int rank) {
    const int q = c.n_heads * c.head_dim, kv = c.n_kv_heads * c.head_dim, F = c.ffn_dim, n = tp_size, r = rank;
    ShardMap m = {{{0, whole.rows}}, 0, whole.cols};
    if (!model_param_sharded(c, param)) return m;
    switch (param_place(c, param).kind) {
        case WQKV: m.row_blocks = {{r * q / n, q / n}, {q + r * kv / n, kv / n}, {q + kv + r * kv / n, kv / n}}; break;
        case W_GATE_UP: m.row_blocks = {{r * F / n, F / n}, {F + r * F / n, F / n}}; break;
        case WO: m.col0 = r * q / n; m.cols = q / n; break;
        case W_DOWN: m.col0 = r * F / n; m.cols = F / n; break;
        default: break;   // the norms: whole
    }
    return m;
}
// Rank `rank`'s shard <-> the whole tensors: `whole` is laid out by model_param_specs(c), `shard` by
// model_param_specs(c, tp_size). to_shard: cut the shard out; else write it back into its place.
template <class T>
void model_copy_shard(const ModelConfig& c, int tp_size, int rank, T* whole, T* shard, bool to_shard) {
    std::vector<TensorSpec> ws = model_param_specs(c), ss = model_param_specs(c, tp_size);
    for (size_t i = 0; i < ws.size(); i++) {
        ShardMap map = model_shard_map(c, (int)i, ws[i], tp_size, rank);
        size_t k = 0;   // row of the shard
        for (const std::pair<int, int>& block : map.row_blocks)
            for (int row = block.first; row < block.first + block.second; row++, k++) {
                T* a = whole + ws[i].offset + (size_t)row * ws[i].cols + map.col0;
                T* b = shard + ss[i].offset + k * ss[i].cols;
                if (to_shard) std::copy(a, a + map.cols, b);
                else std::copy(b, b + map.cols, a);
            }
    }
}

// Model FLOPs per trained token (forward + backward), the PaLM convention (also llm.c's):
//   6 * (parameters of the matmuls: all but the embedding table; the norm weights are negligible)
//   + 6 * L * D * T for causal attention: Q K^T and P V are D multiply-adds per key each, per token and layer,
//     and a token attends to T / 2 keys on average: 2 * D * T FLOPs forward, twice that backward (the backward's
//     recomputation of P is not counted, as a recomputed activation is not).
inline double model_flops_per_token(const ModelConfig& c, int T) {
    double matmul_params = (double)model_num_params(c) - (double)c.vocab_size * c.dim;
    return 6.0 * matmul_params + 6.0 * c.n_layers * (double)c.dim * T;
}

// fn(i) for every i in [0, n) on all host cores: each i once, in any order and on any thread, so fn(i) must
// depend on i alone (give each item its own random stream, not a shared one).
inline void host_parallel_for(size_t n, const std::function<void(size_t)>& fn) {
    std::atomic<size_t> next(0);
    auto worker = [&] {
        for (size_t i = next++; i < n; i = next++) fn(i);
    };
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < std::max(1u, std::thread::hardware_concurrency()); t++) threads.emplace_back(worker);
    for (std::thread& t : threads) t.join();
}

// The init's normal numbers, simple enough to re-implement anywhere: splitmix64 (dataloader.h) gives 64
// random bits; u = (top 53 bits + 0.5) / 2^53 is uniform in (0, 1) and never 0; Box-Muller turns two
// uniforms into two independent standard normals r cos(2 pi u2), r sin(2 pi u2) with r = sqrt(-2 ln u1),
// returned in that order. Tensor i of the parameter table draws from its own stream, whose state starts at
// seed + i * 2^32: a tensor's values do not depend on the tensors before it.
struct InitRng {
    uint64_t state;
    bool has_spare = false;
    double spare = 0.0;
    explicit InitRng(uint64_t s) : state(s) {}
    double uniform() { return ((double)(splitmix64(&state) >> 11) + 0.5) * 0x1.0p-53; }
    double normal() {
        if (has_spare) {
            has_spare = false;
            return spare;
        }
        const double two_pi = 6.283185307179586;
        double u1 = uniform(), u2 = uniform();
        double r = sqrt(-2.0 * log(u1));
        spare = r * sin(two_pi * u2);
        has_spare = true;
        return r * cos(two_pi * u2);
    }
};

// The weight init (--init, --init-std S); norm weights are 1 in every kind.
//   normal         N(0, S^2), wo and w_down (the projections into the residual stream) scaled by 1/sqrt(2L) more,
//                  so that the residual stream's variance does not grow with depth (S = 0.02: the default)
//   trunc-normal   the same stds, each value resampled until it lies within 2 of its tensor's std (the
//                  distribution of timm's trunc_normal_(std, a = -2 std, b = 2 std), which draws it by inverse CDF)
//   torch-default  PyTorch's defaults: nn.Linear's kaiming_uniform_(a = sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in))
//                  for every linear (lm_head included), nn.Embedding's N(0, 1)
enum InitKind { INIT_NORMAL = 0, INIT_TRUNC_NORMAL, INIT_TORCH_DEFAULT };
inline int init_kind_from_name(const std::string& name) {
    return name == "normal" ? INIT_NORMAL : name == "trunc-normal" ? INIT_TRUNC_NORMAL : name == "torch-default" ? INIT_TORCH_DEFAULT : -1;
}

// Host FP32 weights of the init `kind` with std `init_std` (above).
inline std::vector<float> model_init_weights(const ModelConfig& c, uint64_t seed, InitKind kind = INIT_NORMAL, double init_std = 0.02) {
    std::vector<TensorSpec> specs = model_param_specs(c);
    std::vector<float> w(specs.back().offset + specs.back().numel);
    const double residual_scale = 1.0 / sqrt(2.0 * c.n_layers);
    // Each tensor has its own RNG stream, so threads can take tensors in any order: same weights.
    host_parallel_for(specs.size(), [&](size_t i) {
        const TensorSpec& s = specs[i];
        float* out = w.data() + s.offset;
        if (s.cols == 1) {   // the norm weights are the only 1-D tensors
            std::fill(out, out + s.numel, 1.0f);
            return;
        }
        InitRng rng(seed + ((uint64_t)i << 32));
        if (kind == INIT_TORCH_DEFAULT) {
            if (i == PARAM_TOK_EMBEDDING) {
                for (size_t j = 0; j < s.numel; j++) out[j] = (float)rng.normal();
            } else {
                const double bound = 1.0 / sqrt((double)s.cols);   // fan_in: the columns of a [out, in] weight
                for (size_t j = 0; j < s.numel; j++) out[j] = (float)((2.0 * rng.uniform() - 1.0) * bound);
            }
            return;
        }
        const LayerParam layer_kind = param_place(c, (int)i).kind;
        double stddev = init_std * (layer_kind == WO || layer_kind == W_DOWN ? residual_scale : 1.0);
        for (size_t j = 0; j < s.numel; j++) {
            double z = rng.normal();
            while (kind == INIT_TRUNC_NORMAL && fabs(z) > 2.0) z = rng.normal();
            out[j] = (float)(z * stddev);
        }
    });
    return w;
}

// ----------------------------------------------------------------------------------------------
// 3. Layers. Rows are moved 16 bytes (8 BF16) at a time, so the launchers need the row length (the columns)
// to be a multiple of 8 and the tensors 16-byte aligned; every index is computed in size_t.

inline void check_rows(const char* who, int cols, std::initializer_list<const void*> ptrs) {
    if (cols < 1 || cols % BF16_PER_16B != 0)
        fail("%s: rows of %d elements; they must be a positive multiple of %d (16-byte loads)", who, cols, BF16_PER_16B);
    for (const void* p : ptrs)
        if (p && !is_aligned16(p)) fail("%s: tensors must be 16-byte aligned (got %p)", who, p);
}
inline int grid_for(size_t threads, int block) { return ceil_div((long)threads, block); }

// ---- Embedding: out[n,:] = tok_embedding[token[n],:]. A token id outside [0, V) gives a NaN row (and a
// NaN loss), never a read out of bounds.
// Backward: d_tok_embedding[v,:] += the sum of dout[n,:] over the n with token[n] == v, in increasing n,
// without atomics: the positions are sorted by token (cub's radix sort, which is stable: equal tokens keep their
// positions' order), then one block per run of equal tokens adds their rows of dout into FP32 registers, in that
// order, EMB_BWD_INFLIGHT loads in flight, and adds the sum to the token's row. The result is the same on every run.
// Cost: dout read once; a token that is a large share of the batch is summed by one block, one row after another.
constexpr int EMB_THREADS = 256;
constexpr int EMB_BWD_THREADS = 128;
constexpr int EMB_BWD_INFLIGHT = 8;

__global__ void embedding_forward_kernel(bf16* out, const bf16* emb, const int* tokens, int N, int V, int D) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    int chunks = D / BF16_PER_16B;
    if (i >= (size_t)N * chunks) return;
    size_t n = i / chunks;
    int c = (int)(i % chunks) * BF16_PER_16B;
    int token = tokens[n];
    Packed128<bf16> v;
    if (token >= 0 && token < V) {
        v = load128(emb + (size_t)token * D + c);
    } else {
        for (int k = 0; k < BF16_PER_16B; k++) v.v[k] = __float2bfloat16(NAN);
    }
    store128(out + n * D + c, v);
}

// Block i sums the run of sorted tokens that starts at i (other blocks return): positions[i..] in sorted order.
__global__ void __launch_bounds__(EMB_BWD_THREADS) embedding_backward_kernel(float* demb, const bf16* dout, const int* sorted_tokens,
                                                                             const int* positions, int N, int V, int D) {
    const int i = blockIdx.x, token = sorted_tokens[i];
    if ((i > 0 && sorted_tokens[i - 1] == token) || token < 0 || token >= V) return;
    int end = i + 1;
    while (end < N && sorted_tokens[end] == token) end++;
    for (int c = threadIdx.x * BF16_PER_16B; c < D; c += EMB_BWD_THREADS * BF16_PER_16B) {
        float acc[BF16_PER_16B] = {};
        for (int j0 = i; j0 < end; j0 += EMB_BWD_INFLIGHT) {
            Packed128<bf16> g[EMB_BWD_INFLIGHT];
#pragma unroll
            for (int u = 0; u < EMB_BWD_INFLIGHT; u++)
                if (j0 + u < end) g[u] = load128(dout + (size_t)positions[j0 + u] * D + c);
#pragma unroll
            for (int u = 0; u < EMB_BWD_INFLIGHT; u++)
                if (j0 + u < end)
                    for (int k = 0; k < BF16_PER_16B; k++) acc[k] += to_float(g[u].v[k]);
        }
        float* row = demb + (size_t)token * D + c;
        for (int k = 0; k < BF16_PER_16B; k++) row[k] += acc[k];
    }
}

// 0, 1, ..., N - 1: the positions, the sort's values.
__global__ void embedding_positions_kernel(int* positions, int N) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n < N) positions[n] = n;
}

// The backward's scratch for N tokens, in bytes: the sorted tokens, the positions before and after the sort, and
// cub's temporary storage.
inline size_t embedding_backward_sort_bytes(int N) {
    size_t bytes = 0;
    cudaCheck(cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const int*)nullptr, (int*)nullptr, (const int*)nullptr, (int*)nullptr, N));
    return bytes;
}
inline size_t embedding_backward_scratch_bytes(int N) { return 3 * (size_t)ceil_div(N, 64) * 64 * sizeof(int) + embedding_backward_sort_bytes(N); }

inline void embedding_forward(bf16* out, const bf16* emb, const int* tokens, int N, int V, int D, cudaStream_t s) {
    check_rows("embedding_forward", D, {out, emb});
    ProfileRange range(PHASE_EMBEDDING, s);
    size_t threads = (size_t)N * (D / BF16_PER_16B);
    embedding_forward_kernel<<<grid_for(threads, EMB_THREADS), EMB_THREADS, 0, s>>>(out, emb, tokens, N, V, D);
    cudaCheckLaunch();
}
// demb [V,D] FP32 accumulates; scratch: embedding_backward_scratch_bytes(N) bytes (256-byte aligned).
inline void embedding_backward(float* demb, const bf16* dout, const int* tokens, int N, int V, int D, void* scratch, cudaStream_t s) {
    check_rows("embedding_backward", D, {demb, dout});
    ProfileRange range(PHASE_EMBEDDING, s);
    const size_t ints = (size_t)ceil_div(N, 64) * 64;   // each array 256-byte aligned
    int* sorted_tokens = (int*)scratch;
    int* positions = sorted_tokens + ints;
    int* sorted_positions = positions + ints;
    size_t sort_bytes = embedding_backward_sort_bytes(N);
    embedding_positions_kernel<<<grid_for(N, EMB_THREADS), EMB_THREADS, 0, s>>>(positions, N);
    cudaCheckLaunch();
    cudaCheck(cub::DeviceRadixSort::SortPairs(sorted_positions + ints, sort_bytes, tokens, sorted_tokens, positions, sorted_positions, N, 0,
                                              (int)sizeof(int) * 8, s));
    embedding_backward_kernel<<<N, EMB_BWD_THREADS, 0, s>>>(demb, dout, sorted_tokens, sorted_positions, N, V, D);
    cudaCheckLaunch();
}

// ---- RMSNorm fused with the residual add that precedes it:
//   resid_out = resid + branch (rounded to BF16: that is the residual stream the next layer sees)
//   y = resid_out * rstd * w,  rstd = 1 / sqrt(mean(resid_out^2) + eps)   (kept for the backward)
// Without a branch (the first layer), y = rmsnorm(resid) and resid_out is not written.
// Forward: one warp per row. Backward, with r = rstd and g = dy * w (the float64 reference in test_fp8.cu):
//   dx_j = r g_j - (r^3 / D) x_j sum_i(g_i x_i)   added into dresid, the gradient of resid_out (which is
//          also the gradient of resid and of branch: an add passes its gradient to both inputs)
//   dw_j += sum_n dy_nj x_nj r_n                 without atomics: each block writes one row of partial sums
//          over its rows, then rmsnorm_dw_reduce_kernel adds the partial rows up in a fixed order.
// The backward is one pass over memory (dy, x, dresid read once, dresid written: the floor of 4 tensor
// passes): a block of threads holds one row at a time in registers, each thread 8 columns per 16-byte pack
// (rmsnorm_backward_launch), sums the row's dot product across the block, then computes dx and its dw terms
// from the same registers. The next row's loads are issued before this row's block-wide sum, so they are in
// flight across the barrier. Blocks stride over the rows (block b: rows b, b + G, ...), G = as many blocks
// as fit on the GPU at once but at least RMSNORM_BWD_MIN_ROWS rows each; each thread keeps the dw sums of its
// columns in registers across its block's rows. G depends on the GPU's SM count and the kernel's occupancy,
// so dw's float summation order (and its last bits) is fixed for a GPU model and a build, not across them.
// Why a block per row and not a warp: at D = 2048 a warp's thread would hold 64 columns (32 registers each of
// dy, x, dresid, twice with the next row's, and 64 dw sums: spilled), a block's 256 threads hold 8 each, so
// 4 blocks fit an SM with 2 rows of loads in flight per thread; the price is one barrier per row, which the
// next row's loads straddle. Why G blocks resident at once: one wave (no tail), and few partial dw rows (1b on
// an H200: 528 x 2048 floats, 4 MiB, read back from L2 by the reduction).
constexpr int RMSNORM_THREADS = 256;
constexpr int RMSNORM_BWD_MIN_ROWS = 16;      // per block when N is small: only a block's first row waits alone
constexpr int RMSNORM_BWD_MAX_THREADS = 256;  // a row's threads, P packs each (rmsnorm_backward_launch)

// y of one element, as the forward writes it (the one formula of both the BF16 output and the fused FP8 cast).
__device__ inline bf16 rmsnorm_value(float x, float r, float w) { return __float2bfloat16(x * r * w); }

// y may be null (an FP8 consumer: the cast recomputes y from resid_out, rstd and w); amax_bits (or null)
// gathers amax(y) for the current scaling of that cast.
__global__ void rmsnorm_forward_kernel(bf16* resid_out, bf16* y, float* rstd, const bf16* resid, const bf16* branch,
                                       const bf16* w, int N, int D, float eps, unsigned int* amax_bits) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    unsigned int m = 0;
    if (n < N) {
        const size_t row = (size_t)n * D;
        const bf16* x = resid + row;
        float sumsq = 0.0f;
        if (branch) {
            for (int c = lane * BF16_PER_16B; c < D; c += 32 * BF16_PER_16B) {
                Packed128<bf16> a = load128(resid + row + c), b = load128(branch + row + c), sum;
                for (int k = 0; k < BF16_PER_16B; k++) {
                    sum.v[k] = __float2bfloat16(to_float(a.v[k]) + to_float(b.v[k]));
                    float v = to_float(sum.v[k]);
                    sumsq += v * v;
                }
                store128(resid_out + row + c, sum);
            }
            x = resid_out + row;   // this lane reads back only what it wrote
        } else {
            for (int c = lane * BF16_PER_16B; c < D; c += 32 * BF16_PER_16B) {
                Packed128<bf16> a = load128(x + c);
                for (int k = 0; k < BF16_PER_16B; k++) sumsq += to_float(a.v[k]) * to_float(a.v[k]);
            }
        }
        sumsq = attention_warp_sum(sumsq);
        const float r = 1.0f / sqrtf(sumsq / D + eps);
        if (lane == 0) rstd[n] = r;
        if (y || amax_bits)
            for (int c = lane * BF16_PER_16B; c < D; c += 32 * BF16_PER_16B) {
                Packed128<bf16> a = load128(x + c), wv = load128(w + c), out;
                for (int k = 0; k < BF16_PER_16B; k++) {
                    out.v[k] = rmsnorm_value(to_float(a.v[k]), r, to_float(wv.v[k]));
                    m = max(m, abs_bits(to_float(out.v[k])));
                }
                if (y) store128(y + row + c, out);
            }
    }
    if (amax_bits) block_atomic_max(amax_bits, m);
}

// What a thread holds of one row in the RMSNorm backward: P 16-byte packs of dy, x and dresid (its columns
// col[p], those < D), and the row's rstd.
template <int P>
struct RmsNormBwdRow {
    Packed128<bf16> g[P], x[P], dr[P];
    float r;
    __device__ void load(const bf16* dresid, const bf16* dy, const bf16* x_in, const float* rstd, const int* col, int n, int D) {
        const size_t row = (size_t)n * D;
#pragma unroll
        for (int p = 0; p < P; p++)
            if (col[p] < D) {
                g[p] = load128(dy + row + col[p]);
                x[p] = load128(x_in + row + col[p]);
                dr[p] = load128(dresid + row + col[p]);
            }
        r = rstd[n];
    }
};

// P packs per thread, at columns 8 (threadIdx.x + p blockDim.x): every pack p of a warp is one coalesced
// 512-byte access. At most 256 threads, with the registers of 4 / P blocks per SM for P <= 4 (the loads of
// 1024 threads in flight at P = 1); P = 8 (rows over 8192 elements) spills some registers to local memory.
// The row's dot product sum_i dy_i w_i x_i is summed per thread (its packs in order), per warp (a butterfly),
// then over the warps in order: another float order than a sequential sum, within FP32 rounding of it.
template <int P>
__global__ void __launch_bounds__(RMSNORM_BWD_MAX_THREADS, P <= 4 ? 4 / P : 1)
rmsnorm_backward_kernel(bf16* dresid, float* dw_partial, const bf16* dy, const bf16* x, const float* rstd, const bf16* w, int N, int D) {
    __shared__ float warp_dots[2][RMSNORM_BWD_MAX_THREADS / 32];   // two rows' warp sums: one barrier per row
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    int col[P];
    Packed128<bf16> wv[P];
    float dw[P][BF16_PER_16B] = {};
#pragma unroll
    for (int p = 0; p < P; p++) {
        col[p] = (threadIdx.x + p * blockDim.x) * BF16_PER_16B;
        if (col[p] < D) wv[p] = load128(w + col[p]);
    }
    RmsNormBwdRow<P> cur, next;
    int n = blockIdx.x;
    if (n < N) cur.load(dresid, dy, x, rstd, col, n, D);
    for (int buf = 0; n < N; n += gridDim.x, buf ^= 1) {   // n is the same in the whole block: the barrier is safe
        if (n + (int)gridDim.x < N) next.load(dresid, dy, x, rstd, col, n + gridDim.x, D);
        float dot = 0.0f;
#pragma unroll
        for (int p = 0; p < P; p++)
            if (col[p] < D)
                for (int k = 0; k < BF16_PER_16B; k++) dot += to_float(cur.g[p].v[k]) * to_float(wv[p].v[k]) * to_float(cur.x[p].v[k]);
        dot = attention_warp_sum(dot);
        if (lane == 0) warp_dots[buf][warp] = dot;
        __syncthreads();   // warp_dots[buf] is written again two rows on, after every thread has passed the next barrier
        dot = 0.0f;
        for (int i = 0; i < warps; i++) dot += warp_dots[buf][i];
        const float rs = cur.r, coef = rs * rs * rs * dot / D;
        const size_t row = (size_t)n * D;
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (col[p] >= D) continue;
            Packed128<bf16> out;
            for (int k = 0; k < BF16_PER_16B; k++) {
                float gk = to_float(cur.g[p].v[k]), xk = to_float(cur.x[p].v[k]);
                float dx = rs * gk * to_float(wv[p].v[k]) - coef * xk;
                out.v[k] = __float2bfloat16(to_float(cur.dr[p].v[k]) + dx);
                dw[p][k] += gk * xk * rs;
            }
            store128(dresid + row + col[p], out);
        }
        cur = next;
    }
#pragma unroll
    for (int p = 0; p < P; p++)
        if (col[p] < D)
            for (int k = 0; k < BF16_PER_16B; k++) dw_partial[(size_t)blockIdx.x * D + col[p] + k] = dw[p][k];
}

// dw[j] (+)= sum over the partial rows b of dw_partial[b, j]. A block of 32 columns x 32 slices: slice t adds
// the rows b = t, t + 32, ... in order, then one thread per column adds the 32 slices in order: the same
// order on every run, and 32 short chains of dependent adds per column instead of one of `blocks` adds.
constexpr int DW_REDUCE_SLICES = 32;
__global__ void rmsnorm_dw_reduce_kernel(float* dw, const float* dw_partial, int blocks, int D, bool accumulate) {
    __shared__ float slice_sums[DW_REDUCE_SLICES][32];
    const int lane = threadIdx.x % 32, slice = threadIdx.x / 32, j = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (j < D)
        for (int b = slice; b < blocks; b += DW_REDUCE_SLICES) s += dw_partial[(size_t)b * D + j];
    slice_sums[slice][lane] = s;
    __syncthreads();
    if (slice != 0 || j >= D) return;
    s = 0.0f;
    for (int t = 0; t < DW_REDUCE_SLICES; t++) s += slice_sums[t][lane];
    dw[j] = accumulate ? dw[j] + s : s;
}
inline void rmsnorm_dw_reduce(float* dw, const float* dw_partial, int blocks, int D, bool accumulate, cudaStream_t s) {
    rmsnorm_dw_reduce_kernel<<<ceil_div(D, 32), 32 * DW_REDUCE_SLICES, 0, s>>>(dw, dw_partial, blocks, D, accumulate);
    cudaCheckLaunch();
}

// resid_out and branch: both null (y = rmsnorm(resid)) or both set (the fused residual add). y null: only
// resid_out and rstd (rmsnorm_forward_fp8's first kernel), with amax(y) into *amax_bits if that is set.
inline void rmsnorm_forward(bf16* resid_out, bf16* y, float* rstd, const bf16* resid, const bf16* branch, const bf16* w,
                            int N, int D, float eps, cudaStream_t s, unsigned int* amax_bits = nullptr) {
    check_rows("rmsnorm_forward", D, {resid_out, y, resid, branch, w});
    if ((resid_out == nullptr) != (branch == nullptr))
        fail("rmsnorm_forward: resid_out and branch go together (the fused residual add), got %p and %p", resid_out, branch);
    ProfileRange range(PHASE_NORM, s, "rmsnorm forward");
    const int rows_per_block = RMSNORM_THREADS / 32;
    rmsnorm_forward_kernel<<<ceil_div(N, rows_per_block), RMSNORM_THREADS, 0, s>>>(resid_out, y, rstd, resid, branch, w, N, D, eps,
                                                                                   amax_bits);
    cudaCheckLaunch();
}

// The RMSNorm output y [N,D] recomputed for a cast from what the forward keeps: x (resid_out, or resid without
// a residual add), rstd and w; bit for bit the y rmsnorm_forward writes (the same formula on the same floats).
struct RmsNormCast {
    static constexpr int outs = 1;
    const bf16* x;
    const float* rstd;
    const bf16* w;
    int cols;   // D
    __device__ void load16(float v[][CAST_VEC], int row, int col) const {
        const float r = rstd[row];
        for (int h = 0; h < CAST_VEC; h += BF16_PER_16B) {
            Packed128<bf16> a = load128(x + (size_t)row * cols + col + h), wv = load128(w + col + h);
            for (int k = 0; k < BF16_PER_16B; k++) v[0][h + k] = to_float(rmsnorm_value(to_float(a.v[k]), r, to_float(wv.v[k])));
        }
    }
    __device__ void load1(float* v, int row, int col) const {
        v[0] = to_float(rmsnorm_value(to_float(x[(size_t)row * cols + col]), rstd[row], to_float(w[col])));
    }
};

// rmsnorm_forward into an FP8 linear's input: X8 and X8^T as o says (Fp8CastOut or Fp8BlockCastOut), no BF16 y. Two
// kernels in every scaling: the statistics (resid_out and rstd, which the backward keeps anyway) and the cast recomputing
// y from them. The BF16 y is never written nor read back (the unfused path writes it, reads it for the amax, reads it
// again for the cast). Current scaling: the statistics kernel also computes y in registers for amax(y), so the cast
// knows its scale; delayed scaling: it skips y, and the cast gathers the amax; block scaling: the cast needs no amax.
template <class Out>
inline void rmsnorm_forward_fp8(const Out& o, bf16* resid_out, float* rstd, const bf16* resid, const bf16* branch, const bf16* w, int N,
                                int D, float eps, cudaStream_t s) {
    unsigned int* amax = fp8_amax_slot(o);
    rmsnorm_forward(resid_out, nullptr, rstd, resid, branch, w, N, D, eps, s, amax);
    ProfileRange range(PHASE_NORM, s, "rmsnorm: cast X");
    fp8_cast_to(o, RmsNormCast{branch ? resid_out : resid, rstd, w, D}, N, D, s, amax != nullptr);
}
// The RMSNorm backward's kernel and grid for rows of D: P packs of 8 columns per thread, the fewest of 1, 2, 4, 8
// with at most RMSNORM_BWD_MAX_THREADS threads a row; blocks as described above rmsnorm_backward_kernel.
struct RmsNormBwdLaunch {
    void (*kernel)(bf16*, float*, const bf16*, const bf16*, const float*, const bf16*, int, int);
    int threads, blocks;
};
inline RmsNormBwdLaunch rmsnorm_backward_launch(int N, int D) {
    check_rows("rmsnorm_backward", D, {});
    const int packs = D / BF16_PER_16B, max_d = 8 * RMSNORM_BWD_MAX_THREADS * BF16_PER_16B, T = RMSNORM_BWD_MAX_THREADS;
    if (D > max_d) fail("rmsnorm_backward: rows of %d elements, more than its %d (a row is held in registers, 8 x 16 bytes a thread, "
                        "%d threads): choose a model dim of at most %d", D, max_d, T, max_d);
    const int P = packs <= T ? 1 : packs <= 2 * T ? 2 : packs <= 4 * T ? 4 : 8;
    RmsNormBwdLaunch l;
    l.kernel = P == 1 ? rmsnorm_backward_kernel<1> : P == 2 ? rmsnorm_backward_kernel<2> : P == 4 ? rmsnorm_backward_kernel<4>
                                                                                             : rmsnorm_backward_kernel<8>;
    l.threads = 32 * ceil_div(ceil_div(packs, P), 32);
    // the blocks resident on an SM, asked once per device and row length (every launch needs it)
    static std::mutex mutex;
    static std::map<std::pair<int, int>, int> blocks_per_sm;   // (device, D) -> blocks
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lock(mutex);
    int& per_sm = blocks_per_sm[{dev, D}];
    if (per_sm == 0) {
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l.kernel, l.threads, 0));
        if (per_sm < 1) fail("rmsnorm_backward: no block of %d threads fits on an SM (rows of %d elements)", l.threads, D);
    }
    l.blocks = std::max(1, std::min(ceil_div(N, RMSNORM_BWD_MIN_ROWS), device_sm_count() * per_sm));
    return l;
}
// Floats of scratch that rmsnorm_backward needs: one partial dw row per block.
inline size_t rmsnorm_backward_scratch(int N, int D) { return (size_t)rmsnorm_backward_launch(N, D).blocks * D; }
// dresid += dx (BF16, in place); dw += dw of these rows (FP32; accumulate false: dw = that). x is the forward's
// input (resid_out when fused). scratch: rmsnorm_backward_scratch(N, D) floats, on this GPU.
inline void rmsnorm_backward(bf16* dresid, float* dw, float* scratch, const bf16* dy, const bf16* x, const float* rstd,
                             const bf16* w, int N, int D, cudaStream_t s, bool accumulate = true) {
    check_rows("rmsnorm_backward", D, {dresid, dw, scratch, dy, x, w});
    ProfileRange range(PHASE_NORM, s, "rmsnorm backward");
    const RmsNormBwdLaunch l = rmsnorm_backward_launch(N, D);
    l.kernel<<<l.blocks, l.threads, 0, s>>>(dresid, scratch, dy, x, rstd, w, N, D);
    cudaCheckLaunch();
    rmsnorm_dw_reduce(dw, scratch, l.blocks, D, accumulate, s);
}

// ---- RoPE, in place on the Q and K column blocks of qkv [N, (NH+2NKV)*HD] (Q heads then K heads are the
// first NH+NKV heads of a row). Adjacent pairs (2i, 2i+1) of each head rotate by the angle t * theta^(-2i/HD),
// t = n % T the position in the sequence:  (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos).
// The backward applies the inverse rotation (angle -t * theta^(-2i/HD)) to dq and dk: a rotation's
// transpose is its inverse. The cos/sin tables [T, HD/2] are computed once in float64 on the host.
constexpr int ROPE_THREADS = 256;

inline void rope_tables(std::vector<float>* cos_t, std::vector<float>* sin_t, int T, int HD, double theta) {
    cos_t->resize((size_t)T * HD / 2);
    sin_t->resize((size_t)T * HD / 2);
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < HD / 2; i++) {
            double angle = t * pow(theta, -2.0 * i / HD);
            (*cos_t)[(size_t)t * HD / 2 + i] = (float)cos(angle);
            (*sin_t)[(size_t)t * HD / 2 + i] = (float)sin(angle);
        }
    }
}

// One pair rotated, with s = sign * sin (sign +1: forward; -1: the inverse, the backward): the one formula of
// rope_kernel and of the fused backward cast, the products' rounding fixed by fmaf.
__device__ inline void rope_rotate(float x0, float x1, float c, float sin, float sign, bf16* y0, bf16* y1) {
    const float s = sign * sin;
    *y0 = __float2bfloat16(fmaf(x0, c, -(x1 * s)));
    *y1 = __float2bfloat16(fmaf(x0, s, x1 * c));
}

// The 4 pairs of a 16-byte vector, in place; pair0 indexes the tables at the first pair.
__device__ inline void rope_rotate_vec(Packed128<bf16>& v, const float* cos_t, const float* sin_t, size_t pair0, float sign) {
#pragma unroll
    for (int q = 0; q < BF16_PER_16B / 2; q++)
        rope_rotate(to_float(v.v[2 * q]), to_float(v.v[2 * q + 1]), cos_t[pair0 + q], sin_t[pair0 + q], sign, &v.v[2 * q],
                    &v.v[2 * q + 1]);
}

// One thread rotates 4 pairs (16 bytes).
__global__ void rope_kernel(bf16* qkv, const float* cos_t, const float* sin_t, int N, int T, int rot_heads,
                            int qkv_cols, int HD, float sign) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const int chunks = HD / BF16_PER_16B;
    if (i >= (size_t)N * rot_heads * chunks) return;
    const int chunk = (int)(i % chunks), head = (int)((i / chunks) % rot_heads);
    const size_t n = i / ((size_t)chunks * rot_heads);
    const int t = (int)(n % T);
    bf16* p = qkv + n * qkv_cols + (size_t)head * HD + chunk * BF16_PER_16B;
    Packed128<bf16> v = load128(p);
    rope_rotate_vec(v, cos_t, sin_t, (size_t)t * (HD / 2) + chunk * (BF16_PER_16B / 2), sign);
    store128(p, v);
}

inline void rope_launch(const char* who, bf16* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int NKV,
                        int HD, float sign, cudaStream_t s) {
    check_rows(who, HD, {qkv});
    ProfileRange range(PHASE_ROPE, s, who);
    size_t threads = (size_t)B * T * (NH + NKV) * (HD / BF16_PER_16B);
    rope_kernel<<<grid_for(threads, ROPE_THREADS), ROPE_THREADS, 0, s>>>(qkv, cos_t, sin_t, B * T, T, NH + NKV,
                                                                         (NH + 2 * NKV) * HD, HD, sign);
    cudaCheckLaunch();
}
inline void rope_forward(bf16* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int NKV, int HD, cudaStream_t s) {
    rope_launch("rope_forward", qkv, cos_t, sin_t, B, T, NH, NKV, HD, 1.0f, s);
}
inline void rope_backward(bf16* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int NKV, int HD, cudaStream_t s) {
    rope_launch("rope_backward", dqkv, cos_t, sin_t, B, T, NH, NKV, HD, -1.0f, s);
}

// rope_forward fused into the FP8 attention's cast (attention_fp8_cast's `produce`): each 8 columns of Q or K are
// rotated as rope_kernel rotates them and written back to qkv (the backward reads them), then cast. One pass over
// qkv instead of the rotation's read and write and the cast's read.
struct RopeAttentionFp8 {
    bf16* qkv;
    const float *cos_t, *sin_t;
    int T, HD, cols;
    __device__ void operator()(Packed128<bf16>& x, size_t row, int col) const {
        rope_rotate_vec(x, cos_t, sin_t, (size_t)(row % T) * (HD / 2) + (col % HD) / 2, 1.0f);
        store128(qkv + row * cols + col, x);
    }
};
inline AttentionFp8Inputs rope_forward_attention_fp8(bf16* qkv, const float* cos_t, const float* sin_t, void* scratch, int B, int T,
                                                     int NH, int NKV, int HD, cudaStream_t s) {
    attention_check("rope_forward_attention_fp8", B, T, NH, NKV, HD, {qkv, scratch});
    attention_fp8_check("rope_forward_attention_fp8");
    ProfileRange range(PHASE_ROPE, s, "rope forward + FP8 attention cast");
    return attention_fp8_cast(scratch, qkv, B, T, NH, NKV, HD, s, RopeAttentionFp8{qkv, cos_t, sin_t, T, HD, (NH + 2 * NKV) * HD});
}

// dqkv [N, cols] after rope_backward, for a cast, from dqkv before it: the Q and K columns (the first rot_cols)
// rotated back, V as it is; bit for bit what rope_backward writes in place. A 16-column chunk lies in one head.
struct RopeBackwardCast {
    static constexpr int outs = 1;
    const bf16* dqkv;
    const float *cos_t, *sin_t;
    int T, HD, rot_cols, cols;
    __device__ void load16(float v[][CAST_VEC], int row, int col) const {
        float x[CAST_VEC];
        load16_as_float(x, dqkv + (size_t)row * cols + col);
        if (col >= rot_cols) {
            for (int k = 0; k < CAST_VEC; k++) v[0][k] = x[k];
            return;
        }
        // The chunk's 8 pairs: 8 consecutive table entries, 32-byte aligned (pair0 is a multiple of 8 and so is
        // the sine table's offset, T * HD / 2), read 16 bytes at a time.
        const size_t pair0 = (size_t)(row % T) * (HD / 2) + (col % HD) / 2;
        float c[CAST_VEC / 2], sn[CAST_VEC / 2];
        for (int h = 0; h < CAST_VEC / 2; h += 4) {
            *reinterpret_cast<float4*>(c + h) = *reinterpret_cast<const float4*>(cos_t + pair0 + h);
            *reinterpret_cast<float4*>(sn + h) = *reinterpret_cast<const float4*>(sin_t + pair0 + h);
        }
        for (int q = 0; q < CAST_VEC / 2; q++) {
            bf16 y0, y1;
            rope_rotate(x[2 * q], x[2 * q + 1], c[q], sn[q], -1.0f, &y0, &y1);
            v[0][2 * q] = to_float(y0);
            v[0][2 * q + 1] = to_float(y1);
        }
    }
    __device__ void load1(float* v, int row, int col) const {
        const bf16* x = dqkv + (size_t)row * cols;
        if (col >= rot_cols) {
            v[0] = to_float(x[col]);
            return;
        }
        const int c0 = col & ~1;   // the pair (c0, c0 + 1)
        const size_t pair = (size_t)(row % T) * (HD / 2) + (c0 % HD) / 2;
        bf16 y0, y1;
        rope_rotate(to_float(x[c0]), to_float(x[c0 + 1]), cos_t[pair], sin_t[pair], -1.0f, &y0, &y1);
        v[0] = to_float(col & 1 ? y1 : y0);
    }
};

// rope_backward into an FP8 linear's dY (dY8 and dY8^T of wqkv, the whole row, V included), dqkv left as it is.
// Delayed scaling: one kernel (reads dqkv, writes the codes); current scaling: an amax pass that rotates too,
// then the cast: dqkv read twice and never written, against the unfused path's in-place rotation (a read and a
// write) and its two reads for the amax and the cast.
template <class Out>
inline void rope_backward_fp8(const Out& o, const bf16* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int NKV,
                              int HD, cudaStream_t s) {
    check_rows("rope_backward_fp8", HD, {dqkv});
    if (HD % CAST_VEC != 0) fail("rope_backward_fp8: head_dim %d must be a multiple of %d (a cast chunk within one head)", HD, CAST_VEC);
    if (!is_aligned16(cos_t) || !is_aligned16(sin_t)) fail("rope_backward_fp8: the cos/sin tables must be 16-byte aligned (got %p, %p)", cos_t, sin_t);
    ProfileRange range(PHASE_ROPE, s, "rope backward: cast dY");
    const int cols = (NH + 2 * NKV) * HD;
    fp8_cast_to(o, RopeBackwardCast{dqkv, cos_t, sin_t, T, HD, (NH + NKV) * HD, cols}, B * T, cols, s, false);
}

// ---- QKV clipping (--qkv-clip C), in place on wqkv's output, before the QK norm and RoPE:
//   forward   y = min(max(x, -C), C), rounded to BF16 (|y| may exceed C by BF16's rounding of C)
//   backward  dx = dy where |x| <= C, 0 where the forward clamped (|x| > C): torch.clamp's gradient
// RoPE then rotates qkv in place, so the forward keeps which elements it clamped: one bit each, a byte per 8
// elements (1/16 of qkv's bytes). One thread per 8 elements (16 bytes). NaN is not clamped (as in torch).
constexpr int QKV_CLIP_THREADS = 256;

__global__ void qkv_clip_forward_kernel(bf16* qkv, uint8_t* mask, size_t chunks, float clip) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    Packed128<bf16> v = load128(qkv + i * BF16_PER_16B);
    unsigned int bits = 0;
    for (int k = 0; k < BF16_PER_16B; k++) {
        const float x = to_float(v.v[k]);
        if (fabsf(x) > clip) {
            bits |= 1u << k;
            v.v[k] = __float2bfloat16(copysignf(clip, x));
        }
    }
    store128(qkv + i * BF16_PER_16B, v);
    mask[i] = (uint8_t)bits;
}

__global__ void qkv_clip_backward_kernel(bf16* dqkv, const uint8_t* mask, size_t chunks) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    const unsigned int bits = mask[i];
    if (bits == 0) return;
    Packed128<bf16> d = load128(dqkv + i * BF16_PER_16B);
    for (int k = 0; k < BF16_PER_16B; k++)
        if ((bits >> k) & 1u) d.v[k] = __float2bfloat16(0.0f);
    store128(dqkv + i * BF16_PER_16B, d);
}

// qkv [n] (n a multiple of 8) clamped in place; mask [n / 8] written.
inline void qkv_clip_forward(bf16* qkv, uint8_t* mask, size_t n, float clip, cudaStream_t s) {
    if (n % BF16_PER_16B != 0 || !is_aligned16(qkv)) fail("qkv_clip_forward: %zu elements at %p: a multiple of 8, 16-byte aligned", n, qkv);
    if (!(clip > 0.0f)) fail("qkv_clip_forward: the clip %g must be positive (--qkv-clip)", clip);
    ProfileRange range(PHASE_OTHER, s, "qkv clip forward");
    const size_t chunks = n / BF16_PER_16B;
    qkv_clip_forward_kernel<<<grid_for(chunks, QKV_CLIP_THREADS), QKV_CLIP_THREADS, 0, s>>>(qkv, mask, chunks, clip);
    cudaCheckLaunch();
}
// dqkv [n]: zero where the forward clamped (in place).
inline void qkv_clip_backward(bf16* dqkv, const uint8_t* mask, size_t n, cudaStream_t s) {
    if (n % BF16_PER_16B != 0 || !is_aligned16(dqkv)) fail("qkv_clip_backward: %zu elements at %p: a multiple of 8, 16-byte aligned", n, dqkv);
    ProfileRange range(PHASE_OTHER, s, "qkv clip backward");
    const size_t chunks = n / BF16_PER_16B;
    qkv_clip_backward_kernel<<<grid_for(chunks, QKV_CLIP_THREADS), QKV_CLIP_THREADS, 0, s>>>(dqkv, mask, chunks);
    cudaCheckLaunch();
}

// ---- QK normalisation (--qk-norm): RMSNorm over each head of Q and of K (the first NH + NKV heads of a qkv row),
// in place before RoPE, with a learned weight of HD values for Q's heads and another for K's (the layer's qk_norm
// parameter [2 HD], shared by the heads, as Qwen3's q_norm / k_norm): y = x r w, r = 1 / sqrt(mean over the head
// of x^2 + eps), the formula of RMSNorm above (rmsnorm_value). The backward is RMSNorm's over rows of HD; the dw
// of Q's (K's) weight sums over every token and Q (K) head. The forward keeps x (RoPE overwrites qkv) and r.
// Both kernels: a block takes QK_NORM_TOKENS tokens and all their Q and K heads with HD threads; a warp per head
// row reduces the row (sum of squares; sum of dy w x), then thread j does column j of every row in order. The
// backward writes one row of dw partial sums per block [2 HD] (Q's, then K's), added up in a fixed order by
// rmsnorm_dw_reduce_kernel: no atomics, the same bits on every run.
constexpr int QK_NORM_TOKENS = 8;

__global__ void qk_norm_forward_kernel(bf16* qkv, bf16* x_saved, float* rstd, const bf16* w, int N, int heads, int NH, int HD,
                                       int qkv_cols, float eps) {
    extern __shared__ float row_r[];   // [QK_NORM_TOKENS * heads]
    const int n0 = blockIdx.x * QK_NORM_TOKENS, rows = min(QK_NORM_TOKENS, N - n0) * heads;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int r = warp; r < rows; r += warps) {
        const bf16* x = qkv + (size_t)(n0 + r / heads) * qkv_cols + (size_t)(r % heads) * HD;
        float ss = 0.0f;
        for (int j = lane; j < HD; j += 32) ss += to_float(x[j]) * to_float(x[j]);
        ss = attention_warp_sum(ss);
        const float rs = 1.0f / sqrtf(ss / HD + eps);
        if (lane == 0) {
            row_r[r] = rs;
            rstd[(size_t)n0 * heads + r] = rs;
        }
    }
    __syncthreads();
    const int j = threadIdx.x;   // blockDim.x == HD
    const float wq = to_float(w[j]), wk = to_float(w[HD + j]);
    for (int r = 0; r < rows; r++) {
        const int h = r % heads;
        const size_t o = (size_t)(n0 + r / heads) * qkv_cols + (size_t)h * HD + j;
        const bf16 x = qkv[o];
        x_saved[((size_t)n0 * heads + r) * HD + j] = x;
        qkv[o] = rmsnorm_value(to_float(x), row_r[r], h < NH ? wq : wk);
    }
}

__global__ void qk_norm_backward_kernel(bf16* dqkv, float* dw_partial, const bf16* x_saved, const float* rstd, const bf16* w, int N,
                                        int heads, int NH, int HD, int qkv_cols) {
    extern __shared__ float row_dot[];   // [QK_NORM_TOKENS * heads]: sum_i dy_i w_i x_i of each head row
    const int n0 = blockIdx.x * QK_NORM_TOKENS, rows = min(QK_NORM_TOKENS, N - n0) * heads;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int r = warp; r < rows; r += warps) {
        const int h = r % heads;
        const bf16* dy = dqkv + (size_t)(n0 + r / heads) * qkv_cols + (size_t)h * HD;
        const bf16* x = x_saved + ((size_t)n0 * heads + r) * HD;
        const bf16* wr = w + (h < NH ? 0 : HD);
        float dot = 0.0f;
        for (int j = lane; j < HD; j += 32) dot += to_float(dy[j]) * to_float(wr[j]) * to_float(x[j]);
        dot = attention_warp_sum(dot);
        if (lane == 0) row_dot[r] = dot;
    }
    __syncthreads();   // every dy of the block's rows has been read before any is overwritten
    const int j = threadIdx.x;   // blockDim.x == HD
    const float wq = to_float(w[j]), wk = to_float(w[HD + j]);
    float dwq = 0.0f, dwk = 0.0f;
    for (int r = 0; r < rows; r++) {
        const int h = r % heads;
        const size_t o = (size_t)(n0 + r / heads) * qkv_cols + (size_t)h * HD + j;
        const float rs = rstd[(size_t)n0 * heads + r], coef = rs * rs * rs * row_dot[r] / HD;
        const float g = to_float(dqkv[o]), x = to_float(x_saved[((size_t)n0 * heads + r) * HD + j]);
        dqkv[o] = __float2bfloat16(rs * g * (h < NH ? wq : wk) - coef * x);
        if (h < NH) dwq += g * x * rs;
        else dwk += g * x * rs;
    }
    dw_partial[(size_t)blockIdx.x * 2 * HD + j] = dwq;
    dw_partial[(size_t)blockIdx.x * 2 * HD + HD + j] = dwk;
}

inline void qk_norm_check(const char* who, int heads, int HD) {
    if (HD < 32 || HD % 32 != 0 || HD > 1024) fail("%s: head_dim %d must be a multiple of 32 up to 1024 (a thread per column)", who, HD);
    if ((size_t)QK_NORM_TOKENS * heads * sizeof(float) > 48 * 1024)
        fail("%s: %d Q and K heads: more than the %zu a block's shared memory holds", who, heads, 48 * 1024 / (QK_NORM_TOKENS * sizeof(float)));
}
// qkv [N, (NH + 2 NKV) HD]: its Q and K heads normalised in place; x_saved [N, NH + NKV, HD] and rstd [N, NH + NKV]
// written; w [2 HD] (Q's weight, then K's).
inline void qk_norm_forward(bf16* qkv, bf16* x_saved, float* rstd, const bf16* w, int N, int NH, int NKV, int HD, float eps, cudaStream_t s) {
    const int heads = NH + NKV;
    qk_norm_check("qk_norm_forward", heads, HD);
    ProfileRange range(PHASE_NORM, s, "qk norm forward");
    qk_norm_forward_kernel<<<ceil_div(N, QK_NORM_TOKENS), HD, QK_NORM_TOKENS * heads * sizeof(float), s>>>(
        qkv, x_saved, rstd, w, N, heads, NH, HD, (NH + 2 * NKV) * HD, eps);
    cudaCheckLaunch();
}
// Floats of scratch that qk_norm_backward needs: one partial dw row [2 HD] per block of tokens.
inline size_t qk_norm_backward_scratch(int N, int HD) { return (size_t)ceil_div(N, QK_NORM_TOKENS) * 2 * HD; }
// dqkv's Q and K heads: the gradient of the norm's output in, of its input out (in place); dw [2 HD] += the
// weights' gradient (accumulate false: dw = that).
inline void qk_norm_backward(bf16* dqkv, float* dw, float* scratch, const bf16* x_saved, const float* rstd, const bf16* w, int N, int NH,
                             int NKV, int HD, cudaStream_t s, bool accumulate = true) {
    const int heads = NH + NKV, blocks = ceil_div(N, QK_NORM_TOKENS);
    qk_norm_check("qk_norm_backward", heads, HD);
    ProfileRange range(PHASE_NORM, s, "qk norm backward");
    qk_norm_backward_kernel<<<blocks, HD, QK_NORM_TOKENS * heads * sizeof(float), s>>>(dqkv, scratch, x_saved, rstd, w, N, heads, NH, HD,
                                                                                      (NH + 2 * NKV) * HD);
    cudaCheckLaunch();
    rmsnorm_dw_reduce(dw, scratch, blocks, 2 * HD, accumulate, s);
}

// ---- SwiGLU: out[n,j] = silu(g) * u with g = gate_up[n,j], u = gate_up[n,F+j], silu(g) = g sigmoid(g).
// Backward: du = dout silu(g); dg = dout u silu'(g), silu'(g) = sig(g) (1 + g (1 - sig(g))).
constexpr int SWIGLU_THREADS = 256;

// The formulas, shared by the kernels below and the fused casts.
__device__ inline bf16 swiglu_value(float g, float u) { return __float2bfloat16(g / (1.0f + expf(-g)) * u); }
__device__ inline void swiglu_grads(float g, float u, float dy, bf16* dg, bf16* du) {
    const float sig = 1.0f / (1.0f + expf(-g));
    *dg = __float2bfloat16(dy * u * sig * fmaf(g, 1.0f - sig, 1.0f));
    *du = __float2bfloat16(dy * g * sig);
}

__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, int N, int F) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const int chunks = F / BF16_PER_16B;
    if (i >= (size_t)N * chunks) return;
    const size_t n = i / chunks;
    const int c = (int)(i % chunks) * BF16_PER_16B;
    Packed128<bf16> g = load128(gate_up + n * 2 * F + c), u = load128(gate_up + n * 2 * F + F + c), o;
    for (int k = 0; k < BF16_PER_16B; k++) o.v[k] = swiglu_value(to_float(g.v[k]), to_float(u.v[k]));
    store128(out + n * F + c, o);
}

__global__ void swiglu_backward_kernel(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int N, int F) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const int chunks = F / BF16_PER_16B;
    if (i >= (size_t)N * chunks) return;
    const size_t n = i / chunks;
    const int c = (int)(i % chunks) * BF16_PER_16B;
    Packed128<bf16> g = load128(gate_up + n * 2 * F + c), u = load128(gate_up + n * 2 * F + F + c);
    Packed128<bf16> dy = load128(dout + n * F + c), dg, du;
    for (int k = 0; k < BF16_PER_16B; k++) swiglu_grads(to_float(g.v[k]), to_float(u.v[k]), to_float(dy.v[k]), &dg.v[k], &du.v[k]);
    store128(dgate_up + n * 2 * F + c, dg);
    store128(dgate_up + n * 2 * F + F + c, du);
}

inline void swiglu_forward(bf16* out, const bf16* gate_up, int N, int F, cudaStream_t s) {
    check_rows("swiglu_forward", F, {out, gate_up});
    ProfileRange range(PHASE_SWIGLU, s, "swiglu forward");
    size_t threads = (size_t)N * (F / BF16_PER_16B);
    swiglu_forward_kernel<<<grid_for(threads, SWIGLU_THREADS), SWIGLU_THREADS, 0, s>>>(out, gate_up, N, F);
    cudaCheckLaunch();
}
inline void swiglu_backward(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int N, int F, cudaStream_t s) {
    check_rows("swiglu_backward", F, {dgate_up, dout, gate_up});
    ProfileRange range(PHASE_SWIGLU, s, "swiglu backward");
    size_t threads = (size_t)N * (F / BF16_PER_16B);
    swiglu_backward_kernel<<<grid_for(threads, SWIGLU_THREADS), SWIGLU_THREADS, 0, s>>>(dgate_up, dout, gate_up, N, F);
    cudaCheckLaunch();
}

// The SwiGLU output [N,F] for a cast, from gate_up [N,2F]: what swiglu_forward writes.
struct SwigluCast {
    static constexpr int outs = 1;
    const bf16* gate_up;
    int cols;   // F
    __device__ void load16(float v[][CAST_VEC], int row, int col) const {
        constexpr int P = CAST_VEC / BF16_PER_16B;
        const bf16* g = gate_up + (size_t)row * 2 * cols + col;
        Packed128<bf16> gv[P], uv[P];   // all four 16-byte loads in flight before the exponentials start
        for (int p = 0; p < P; p++) {
            gv[p] = load128(g + p * BF16_PER_16B);
            uv[p] = load128(g + cols + p * BF16_PER_16B);
        }
        for (int p = 0; p < P; p++)
            for (int k = 0; k < BF16_PER_16B; k++)
                v[0][p * BF16_PER_16B + k] = to_float(swiglu_value(to_float(gv[p].v[k]), to_float(uv[p].v[k])));
    }
    __device__ void load1(float* v, int row, int col) const {
        const bf16* g = gate_up + (size_t)row * 2 * cols + col;
        v[0] = to_float(swiglu_value(to_float(g[0]), to_float(g[cols])));
    }
};
// dgate_up [N,2F] for a cast, from dout [N,F] and gate_up: what swiglu_backward writes; output 0 is the gate
// half (dg), output 1 the up half (du), each made once from one read of g, u and dout.
struct SwigluBackwardCast {
    static constexpr int outs = 2;
    const bf16* dout;
    const bf16* gate_up;
    int cols;   // F
    __device__ void load16(float v[][CAST_VEC], int row, int col) const {
        constexpr int P = CAST_VEC / BF16_PER_16B;
        const bf16* g = gate_up + (size_t)row * 2 * cols + col;
        const bf16* dy = dout + (size_t)row * cols + col;
        Packed128<bf16> gv[P], uv[P], dv[P];   // all six 16-byte loads in flight before the exponentials start
        for (int p = 0; p < P; p++) {
            gv[p] = load128(g + p * BF16_PER_16B);
            uv[p] = load128(g + cols + p * BF16_PER_16B);
            dv[p] = load128(dy + p * BF16_PER_16B);
        }
        for (int p = 0; p < P; p++)
            for (int k = 0; k < BF16_PER_16B; k++) {
                bf16 dg, du;
                swiglu_grads(to_float(gv[p].v[k]), to_float(uv[p].v[k]), to_float(dv[p].v[k]), &dg, &du);
                v[0][p * BF16_PER_16B + k] = to_float(dg);
                v[1][p * BF16_PER_16B + k] = to_float(du);
            }
    }
    __device__ void load1(float* v, int row, int col) const {
        const bf16* g = gate_up + (size_t)row * 2 * cols + col;
        bf16 dg, du;
        swiglu_grads(to_float(g[0]), to_float(g[cols]), to_float(dout[(size_t)row * cols + col]), &dg, &du);
        v[0] = to_float(dg);
        v[1] = to_float(du);
    }
};

// swiglu_forward into an FP8 linear's input (X8 and X8^T of w_down), no BF16 output. Delayed scaling: one kernel
// (reads gate_up, writes the codes); current scaling: an amax pass computing the SwiGLU, then the cast computing
// it again: gate_up read twice, nothing written but the codes, against the unfused path's BF16 write and its two
// reads back (amax, cast).
template <class Out>
inline void swiglu_forward_fp8(const Out& o, const bf16* gate_up, int N, int F, cudaStream_t s) {
    check_rows("swiglu_forward_fp8", F, {gate_up});
    ProfileRange range(PHASE_SWIGLU, s, "swiglu forward: cast X");
    fp8_cast_to(o, SwigluCast{gate_up, F}, N, F, s, false);
}
// swiglu_backward into an FP8 linear's dY (dY8 [N,2F] and dY8^T of w_gate_up), no BF16 dgate_up: costs as above,
// dout and gate_up read once per pass.
template <class Out>
inline void swiglu_backward_fp8(const Out& o, const bf16* dout, const bf16* gate_up, int N, int F, cudaStream_t s) {
    check_rows("swiglu_backward_fp8", F, {dout, gate_up});
    ProfileRange range(PHASE_SWIGLU, s, "swiglu backward: cast dY");
    fp8_cast_to(o, SwigluBackwardCast{dout, gate_up, F}, N, F, s, false);
}

// ---- Cross-entropy of FP32 logits rows [N,V], one block per row:
//   loss = lse - logits[target], lse = m + log(sum_j exp(logits_j - m)), m the row max
//   dlogits (optional, BF16) = (softmax - onehot(target)) * grad_scale = (exp(logits_j - lse) - [j == target]) * grad_scale
// First pass: each thread keeps a running (max, sum of exp(x - max)) over its elements; the pairs merge
// across the block in a fixed order. Second pass: dlogits. A target outside [0, V) gives a NaN loss.
constexpr int CE_THREADS = 256;

// (m, s) := the merge of two running (max, sum of exp(x - max)); (-inf, 0) is the empty set.
__device__ inline void softmax_merge(float& m, float& s, float m2, float s2) {
    float mx = fmaxf(m, m2);
    if (mx == -INFINITY) return;
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}

__global__ void __launch_bounds__(CE_THREADS) cross_entropy_kernel(float* losses, bf16* dlogits, const float* logits,
                                                                   const int* targets, int V, float grad_scale) {
    __shared__ float warp_m[CE_THREADS / 32], warp_s[CE_THREADS / 32];
    __shared__ float row_lse;
    const size_t n = blockIdx.x;
    const float* row = logits + n * V;
    float m = -INFINITY, s = 0.0f;
    for (int c = threadIdx.x * 8; c < V; c += CE_THREADS * 8) {
        float4 a = *reinterpret_cast<const float4*>(row + c), b = *reinterpret_cast<const float4*>(row + c + 4);
        float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float cm = v[0];
        for (int k = 1; k < 8; k++) cm = fmaxf(cm, v[k]);
        float cs = 0.0f;
        for (int k = 0; k < 8; k++) cs += expf(v[k] - cm);
        softmax_merge(m, s, cm, cs);
    }
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        softmax_merge(m, s, m2, s2);
    }
    if (threadIdx.x % 32 == 0) {
        warp_m[threadIdx.x / 32] = m;
        warp_s[threadIdx.x / 32] = s;
    }
    __syncthreads();
    const int target = targets[n];
    if (threadIdx.x == 0) {
        float bm = warp_m[0], bs = warp_s[0];
        for (int w = 1; w < CE_THREADS / 32; w++) softmax_merge(bm, bs, warp_m[w], warp_s[w]);
        float lse = bm + logf(bs);
        losses[n] = (target >= 0 && target < V) ? lse - row[target] : NAN;
        row_lse = lse;
    }
    __syncthreads();
    if (dlogits == nullptr) return;
    const float lse = row_lse;
    for (int c = threadIdx.x * 8; c < V; c += CE_THREADS * 8) {
        float4 a = *reinterpret_cast<const float4*>(row + c), b = *reinterpret_cast<const float4*>(row + c + 4);
        float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        Packed128<bf16> d;
        for (int k = 0; k < 8; k++) d.v[k] = __float2bfloat16((expf(v[k] - lse) - (c + k == target ? 1.0f : 0.0f)) * grad_scale);
        store128(dlogits + n * V + c, d);
    }
}

// losses [N]; dlogits [N,V] BF16 or null (loss only).
inline void cross_entropy_forward_backward(float* losses, bf16* dlogits, const float* logits, const int* targets, int N,
                                           int V, float grad_scale, cudaStream_t s) {
    check_rows("cross_entropy_forward_backward", V, {dlogits, logits});
    ProfileRange range(PHASE_LOSS, s, "cross-entropy");
    cross_entropy_kernel<<<N, CE_THREADS, 0, s>>>(losses, dlogits, logits, targets, V, grad_scale);
    cudaCheckLaunch();
}

// lm_head and cross-entropy over N tokens, `chunk` tokens at a time so that no [N, V] buffer exists:
//   logits [chunk,V] FP32 = x_chunk lm_head^T
//   losses, and dlogits [chunk,V] BF16 (written in the same pass that computes the loss)
//   dx_chunk = dlogits lm_head;  dlm_head += dlogits^T x_chunk
// The loss-only pass (evaluation) leaves the three gradient tensors null.
struct LmHeadLoss {
    const bf16* x = nullptr;         // [N,D]      the final norm's output
    const bf16* lm_head = nullptr;   // [V,D]
    const int* targets = nullptr;    // [N]
    float* losses = nullptr;         // [N]        out: each token's loss
    float* logits = nullptr;         // [chunk,V]  scratch, FP32
    int chunk = 0;                   // tokens per chunk: a multiple of 16, as N
    bf16* dlogits = nullptr;         // [chunk,V]  scratch (gradients only)
    bf16* dx = nullptr;              // [N,D]      out (gradients only)
    float* dlm_head = nullptr;       // [V,D]      added to; accumulate false: the first chunk writes it (gradients only)
};
inline void lm_head_cross_entropy(MatmulContext* mm, const LmHeadLoss& t, int N, int D, int V, float grad_scale, cudaStream_t s,
                                  bool accumulate = true) {
    const int chunk = t.chunk;
    if (chunk < 16 || chunk % 16 != 0 || N % 16 != 0)
        fail("lm_head_cross_entropy: chunk %d and N %d must be positive multiples of 16 (the GEMM rule)", chunk, N);
    for (int c0 = 0; c0 < N; c0 += chunk) {
        const int rows = std::min(chunk, N - c0);
        const bf16* xc = t.x + (size_t)c0 * D;
        {
            ProfileRange range(PHASE_LM_HEAD, s, "lm_head forward");
            matmul(mm, t.logits, DT_FP32, {xc, DT_BF16}, {t.lm_head, DT_BF16}, rows, V, D, false, false, s);
        }
        cross_entropy_forward_backward(t.losses + c0, t.dx ? t.dlogits : nullptr, t.logits, t.targets + c0, rows, V, grad_scale, s);
        if (!t.dx) continue;
        ProfileRange range(PHASE_LM_HEAD, s, "lm_head backward");
        // dx [rows,D] = dlogits [rows,V] lm_head [V,D]: lm_head is the [K,N] operand, stored transposed
        matmul(mm, t.dx + (size_t)c0 * D, DT_BF16, {t.dlogits, DT_BF16}, {t.lm_head, DT_BF16, true}, rows, D, V, false, false, s);
        // dlm_head [V,D] += dlogits^T x: both operands are stored [K=rows, .]
        matmul(mm, t.dlm_head, DT_FP32, {t.dlogits, DT_BF16, true}, {xc, DT_BF16, true}, V, D, rows, accumulate || c0 > 0, false, s);
    }
}

// The mean of N losses, summed in float64 in a fixed order by one block.
constexpr int LOSS_MEAN_THREADS = 256;
__global__ void loss_mean_kernel(float* mean, const float* losses, int N) {
    __shared__ double partial[LOSS_MEAN_THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < N; i += LOSS_MEAN_THREADS) s += losses[i];
    partial[threadIdx.x] = s;
    __syncthreads();
    for (int stride = LOSS_MEAN_THREADS / 2; stride > 0; stride /= 2) {
        if ((int)threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) *mean = (float)(partial[0] / N);
}

// ----------------------------------------------------------------------------------------------
// 4. The model's state. Activations: one allocation, walked through a table of named tensors.
// Per-layer tensors are [L, rows, ...] with rows = B*T of the allocation; a smaller batch uses the first rows.

struct ModelActivations {
    // saved by the forward for the backward (BF16 unless FP32 is said)
    bf16* resid_attn;      // [L,N,D]    the residual stream entering each layer (layer 0: the embedding)
    bf16* attn_norm;       // [L,N,D]    attn_norm(resid_attn)
    float* attn_rstd;      // [L,N]      FP32
    bf16* qkv;             // [L,N,QKV]  after RoPE
    uint8_t* qkv_clip_mask;   // [L,N*QKV/8] --qkv-clip: the bits of the clamped elements (else empty)
    bf16* qk_norm_x;       // [L,N,QK]   --qk-norm: the Q and K heads before the norm (QK = this rank's NH+NKV heads x HD)
    float* qk_norm_rstd;   // [L,N,NH+NKV] --qk-norm: FP32 1/rms of each head
    bf16* att;             // [L,N,A]    attention output (A = this rank's heads x HD; D without TP)
    float* lse;            // [L,B*NH*T] FP32, attention's log-sum-exp
    bf16* resid_ffn;       // [L,N,D]    resid_attn + wo(att)
    bf16* ffn_norm;        // [L,N,D]    ffn_norm(resid_ffn)
    float* ffn_rstd;       // [L,N]      FP32
    bf16* gate_up;         // [L,N,2F]
    bf16* swiglu;          // [L,N,F]
    bf16* resid_final;     // [N,D]      the residual stream after the last layer
    bf16* final_norm;      // [N,D]
    float* final_rstd;     // [N]        FP32
    // scratch
    bf16* branch;          // [N,D]      the output of wo / w_down before the residual add
    bf16* dresid;          // [N,D]      gradient of the residual stream
    bf16* dnorm;           // [N,D]      gradient of a norm's output
    bf16* datt;            // [N,A]
    bf16* dqkv;            // [N,QKV]
    bf16* dgate_up;        // [N,2F]
    bf16* dswiglu;         // [N,F]
    float* att_scratch;    // FP32, attention_backward's scratch (attention_backward_scratch_floats)
    fp8* att_fp8;          // --fp8-attention: the FP8 forward's Q, K, V^T and their scales (attention_fp8_scratch_bytes)
    float* norm_scratch;   // FP32, rmsnorm_backward's partial dw rows (rmsnorm_backward_scratch)
    float* qk_norm_scratch;   // --qk-norm: qk_norm_backward's partial dw rows
    void* emb_scratch;     // embedding_backward's sort (embedding_backward_scratch_bytes)
    float* logits;         // [chunk,V]  FP32, one chunk of lm_head's output
    bf16* dlogits;         // [chunk,V]
    float* losses;         // [N]        FP32
    float* loss_mean;      // [1]        FP32
};

struct ActivationSpec { const char* name; DType type; size_t numel; void** slot; };

// The FP8 recipe's knobs (read in both builds so that the BF16 build can refuse them clearly).
struct Fp8Options {
    bool enabled = true;        // false: every layer BF16 (the FP8 build's own baseline, for the benchmarks)
    Fp8Recipe recipe;           // scaling of X and dY; W gets current scaling after every optimizer step
    bool all_layers = false;    // FP8 in the first and last decoder layers too (the recipe keeps them BF16)
    bool fast_accum = true;     // fast accumulation in the forward GEMM (backward GEMMs always split)
    bool tp_amax_sync = false;  // tensor parallelism: the amax of a sharded X or dY is the MAX over the group
    float smooth_quant = 0.0f;  // --smooth-quant ALPHA: SmoothQuant's per-channel migration into the FP8 linears (section 5); 0 = off
    bool attention = false;     // --fp8-attention: attention's forward on FP8 tensor cores (attention_forward_fp8) in
                                // the layers whose linears are FP8; its backward stays BF16
    bool fused_casts = true;    // RMSNorm, SwiGLU and the RoPE backward cast their outputs for an FP8 linear themselves;
                                // false: they write BF16 and a plain cast follows (the unfused path: the reference of
                                // the fused casts' tests and the benchmark's baseline)
    bool block_scaling = false; // --scaling block (fp8_kernels.cuh 3b): X and dY in 1x128 tiles, W in 128x128 blocks, each
                                // scale from its tile's amax (recipe.margin; current scaling only), the casts fused as above;
                                // false: one scale per tensor (recipe)
    bool block_scale_pow2 = false;   // --block-scale-pow2: the tiles' scales rounded down to powers of two
    Fp8Format dy_format = E5M2; // --dy-format: dY's format under block scaling (per-tensor scaling: E5M2 always)
    Fp8Granularity block_dw_x = FP8_TILES_1x128;   // --block-dw-x: the saved X8^T, dW's operand, in 1x128 tiles along the
                                                   // tokens or in 128x128 blocks (dW then pairs tiles with blocks, as Y and dX do)
};

// --smooth-quant, per FP8 linear of `in` input channels (section 5): s and 1/s [in], powers of two; the bits of the
// channels' amax of X gathered over the step's training forwards, and of W's columns [in].
struct SmoothQuantState {
    float *s, *inv_s;
    unsigned int *x_amax, *w_amax;
};

// The FP8 build's state (empty in the BF16 build): per decoder linear (wqkv, wo, w_gate_up, w_down of each layer, index 4*l + k)
// its FP8 weight copies, the saved X8^T, and the scales of X, W and dY (one device array for all).
constexpr int LINEARS_PER_LAYER = 4;
struct ModelFp8 {
    std::vector<Fp8Linear> linears;   // w8 == nullptr: a BF16 layer
    std::vector<fp8*> saved_x8_t;     // X8^T [in, N] kept from forward for the weight gradient
    void* memory = nullptr;           // one allocation: FP8 weights, saved X8^T, scratch
    size_t weight_bytes = 0, saved_bytes = 0, scratch_bytes = 0;
    Fp8Meta* metas = nullptr;         // [L*4*3] device: X, W, dY of each linear (saved in checkpoints)
    Fp8Health* health = nullptr;      // [L*4*3] device: --fp8-stats counts
    fp8 *x8 = nullptr, *dy8 = nullptr, *dy8_t = nullptr;   // scratch casts
    int* delayed_ids = nullptr;       // device: meta indices of X (first n) then dY (next n) of the FP8 linears
    std::vector<SmoothQuantState> smooth;   // --smooth-quant: per linear (as `linears`; s == nullptr: none), else empty
    void* smooth_memory = nullptr;    // their one allocation
    // block scaling: the scale tensors of the saved X8^T (per linear), of the scratch casts, and (in Fp8Linear) of W8 and W8^T
    std::vector<float*> saved_x8_t_scales;
    float *x8_scales = nullptr, *dy8_scales = nullptr, *dy8_t_scales = nullptr;
    float* block_scales = nullptr;    // their one allocation (zeroed: the padding of the blocks' rows stays 0)
    int n_fp8_linears = 0;
    bool amax_from_optimizer = false; // the optimizer's update pass gathers W's amax (model_weight_amax_slots)
    bool training = false;            // in model_forward_backward: delayed scaling gathers amaxes for the step's record
};

// One parameter tensor, named: its BF16 weights and FP32 gradient (pointers into Model::weights and Model::grads,
// section 2's flat layout) and its index in the parameter table (Model::params: its shape; the FP8 build's per-linear
// state, section 5).
struct Param {
    bf16* w = nullptr;
    float* grad = nullptr;
    int index = -1;
};
// One decoder layer's tensors (qk_norm: only with --qk-norm), as LayerActs names its activations.
struct LayerParams { Param attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down, qk_norm; };

struct Model {
    ModelConfig config;
    std::vector<TensorSpec> params;
    size_t num_params = 0;
    bf16* weights = nullptr;   // [num_params] BF16, written by the optimizer after each step
    float* grads = nullptr;    // [num_params] FP32, accumulated over micro-batches
    Param tok_embedding, final_norm, lm_head;   // the tensors of the table by name (model_create)
    std::vector<LayerParams> layers;
    bool accumulate_grads = true;   // false after model_zero_grads: the next backward writes what it would add
    int B = 0, T = 0;          // the allocated batch shape
    ModelActivations acts = {};
    void* act_memory = nullptr;
    size_t act_bytes = 0;
    float* rope_cos = nullptr;   // [T,HD/2] RoPE tables (constants, one allocation with rope_sin)
    float* rope_sin = nullptr;
    int ce_chunk = 0;          // tokens per lm_head + cross-entropy chunk: a multiple of 16, at most model_create's
    MatmulContext matmul;
    cudaStream_t stream = nullptr;
    std::map<int, cudaGraphExec_t> graphs;   // model_graph_launch's, by key
    Fp8Options fp8_options;
    // Tensor parallelism (section 7): the group (nullptr: none, no collectives) and this rank's share of the
    // heads and the FFN width (the whole model's without a group).
    const TpGroup* tp = nullptr;
    int tp_size = 1, tp_rank = 0;
    int n_heads = 0, n_kv_heads = 0, ffn_dim = 0;
    ModelFp8 fp8;
    // train_fp8 probe: called by linear_backward of each BF16 linear with its X [N,in] and dY [N,out], before its GEMMs
    std::function<void(const Param& p, const bf16* x, const bf16* dy, int N)> linear_probe;
};

// Tensor `param` of the table as a Param.
inline Param model_param(const Model* m, int param) {
    return {m->weights + m->params[param].offset, m->grads + m->params[param].offset, param};
}
// Layer l's four linears, in the order of the FP8 build's per-linear tables (model_linear_index).
inline std::array<const Param*, 4> layer_linears(const LayerParams& L) { return {&L.wqkv, &L.wo, &L.w_gate_up, &L.w_down}; }
// This rank's qkv width (all of it without tensor parallelism): its query heads, then its K and V heads.
inline int model_local_qkv_dim(const Model* m) { return (m->n_heads + 2 * m->n_kv_heads) * m->config.head_dim; }

// ----------------------------------------------------------------------------------------------
// 5. The linear layer: out[N,out] = inp[N,in] W^T, W = parameter p ([out,in]: its TensorSpec's rows, cols).
// Every decoder projection (wqkv, wo, w_gate_up, w_down) calls linear_forward / linear_backward, which run
// the FP8 layer (fp8_kernels.cuh, section 5) in the FP8 build's FP8 layers and BF16 GEMMs everywhere else:
//   forward   Y = X W^T           A = X [N,in], B = W [out,in]
//   backward  dX = dY W           A = dY [N,out], B = W stored [K=out, in] (transposed)
//             dW += dY^T X        A = dY stored [K=N, out], B = X stored [K=N, in] (both transposed), FP32 grads

// ---- SmoothQuant (--smooth-quant ALPHA): each FP8 linear's input channel j moves scale from X to W,
//   X' = X / s, W' = W s (by columns), so X' W'^T = X W^T,   s_j = 2^round(ALPHA log2 amax_j(X) - (1 - ALPHA) log2 amax_j(W))
// (Xiao et al. 2023, "SmoothQuant", eq. 4, with s rounded to a power of two: X / s, W s and the gradient rescales below
// are then exact in BF16 and FP32, so only the FP8 quantization changes; the rounding moves s by at most sqrt(2)).
// amax_j(X) is the MAX over the tokens of the last optimizer step's training forwards, amax_j(W) over the rows of the
// weights just updated: s is recomputed with the weights after every optimizer step (model_weights_changed), because
// W' must be cast with the s that X' will be cast with, once per step, before this step's X exists (delayed, as
// delayed scaling's amax is). A channel whose amax is 0 or not finite gets s = 1; before the first step s = 1.
// Backward: the GEMMs give the gradients of X' and W'; dX = dX' / s and dW = dW' s by columns (linear_backward).
constexpr int SMOOTH_THREADS = 256;
constexpr int SMOOTH_AMAX_ROW_BLOCKS = 64;   // blocks along the rows of column_amax: atomics per column

__host__ __device__ inline float smooth_quant_scale(float x_amax, float w_amax, float alpha) {
    if (!(x_amax > 0.0f) || !(w_amax > 0.0f) || !isfinite(x_amax) || !isfinite(w_amax)) return 1.0f;
    const float e = rintf(alpha * log2f(x_amax) - (1.0f - alpha) * log2f(w_amax));
    return ldexpf(1.0f, (int)fminf(fmaxf(e, -64.0f), 64.0f));
}

// amax_bits[j] = MAX(amax_bits[j], max over rows of |x[r][j]|), as float bits (atomicMax: exact, order-free). A thread
// takes 8 columns (16 bytes) of every gridDim.y-th row.
__global__ void column_amax_kernel(unsigned int* amax_bits, const bf16* x, int rows, int cols) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * BF16_PER_16B;
    if (c >= cols) return;
    unsigned int m[BF16_PER_16B] = {};
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        Packed128<bf16> v = load128(x + (size_t)r * cols + c);
        for (int k = 0; k < BF16_PER_16B; k++) m[k] = max(m[k], abs_bits(to_float(v.v[k])));
    }
    for (int k = 0; k < BF16_PER_16B; k++)
        if (m[k] != 0u) atomicMax(&amax_bits[c + k], m[k]);
}
// s and 1/s of every channel from the gathered amaxes, which are cleared for the next step.
__global__ void smooth_quant_scales_kernel(SmoothQuantState q, int cols, float alpha) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    const float s = smooth_quant_scale(__uint_as_float(q.x_amax[j]), __uint_as_float(q.w_amax[j]), alpha);
    q.s[j] = s;
    q.inv_s[j] = 1.0f / s;   // exact: a power of two
    q.x_amax[j] = 0u;
    q.w_amax[j] = 0u;
}
// x [rows, cols] (FP32 or BF16) times scale[col], in place; exact for powers of two.
template <class T>
__global__ void scale_columns_kernel(T* x, const float* scale, int rows, int cols) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * cols) return;
    x[i] = (T)(to_float(x[i]) * scale[i % cols]);
}

inline void column_amax(unsigned int* amax_bits, const bf16* x, int rows, int cols, cudaStream_t s) {
    check_rows("column_amax", cols, {x});
    dim3 grid(ceil_div(cols / BF16_PER_16B, SMOOTH_THREADS), std::min(rows, SMOOTH_AMAX_ROW_BLOCKS));
    column_amax_kernel<<<grid, SMOOTH_THREADS, 0, s>>>(amax_bits, x, rows, cols);
    cudaCheckLaunch();
}
template <class T>
void scale_columns(T* x, const float* scale, int rows, int cols, cudaStream_t s) {
    scale_columns_kernel<<<grid_for((size_t)rows * cols, SMOOTH_THREADS), SMOOTH_THREADS, 0, s>>>(x, scale, rows, cols);
    cudaCheckLaunch();
}
// The new s of a linear from its X amaxes and the columns of its new weights w [out, in].
inline void smooth_quant_update(const SmoothQuantState& q, const bf16* w, int out, int in, float alpha, cudaStream_t s) {
    column_amax(q.w_amax, w, out, in, s);
    smooth_quant_scales_kernel<<<ceil_div(in, SMOOTH_THREADS), SMOOTH_THREADS, 0, s>>>(q, in, alpha);
    cudaCheckLaunch();
}

// Whether decoder layer l of n_layers runs its linears in FP8 under o: never in the BF16 build; in the FP8 build all
// layers but the first and last, or all of them with Fp8Options::all_layers.
inline bool layer_fp8(const Fp8Options& o, int n_layers, int l) {
    return BUILD_FP8 && o.enabled && (o.all_layers || (l != 0 && l != n_layers - 1));
}
inline bool model_layer_fp8(const Model* m, int l) { return layer_fp8(m->fp8_options, m->config.n_layers, l); }

// Where linear parameter `param` sits in ModelFp8's per-linear tables: 4 l + k, k its place in layer_linears
// (the one list of a layer's linears and their order).
inline int model_linear_index(const Model* m, int param) {
    const int l = param_place(m->config, param).layer;
    if (l < 0) fail("model_linear_index: parameter %d is not in a decoder layer", param);
    const auto linears = layer_linears(m->layers[l]);
    for (int k = 0; k < (int)linears.size(); k++)
        if (linears[k]->index == param) return l * LINEARS_PER_LAYER + k;
    fail("model_linear_index: parameter %d of layer %d is not one of its linears", param, l);
}
// The FP8 linear of parameter `param`, or nullptr when it is a BF16 one (every one in the BF16 build).
inline Fp8Linear* model_fp8_linear(Model* m, int param) {
    if constexpr (!BUILD_FP8) return nullptr;
    Fp8Linear* lin = &m->fp8.linears[model_linear_index(m, param)];
    return lin->w8 ? lin : nullptr;
}
// --smooth-quant's state of FP8 linear `param`, or nullptr (off, or a BF16 linear).
inline const SmoothQuantState* model_smooth(const Model* m, int param) {
    if (m->fp8.smooth.empty()) return nullptr;
    const SmoothQuantState* q = &m->fp8.smooth[model_linear_index(m, param)];
    return q->s ? q : nullptr;
}
// --tp-amax-sync: the group whose MAX of amax a cast takes, or nullptr. Only the casts of tensors that are
// this rank's slice need it: X of the row-parallel layers (wo, w_down: their input is this rank's heads or
// FFN slice) and dY of the column-parallel ones (wqkv, w_gate_up). The other X and dY (the norms' outputs,
// the residual stream's gradient) are replicated, the same bits on every rank: their amax is the group's.
inline const TpGroup* model_amax_group(const Model* m, int param, bool dy) {
    if (!m->tp || !m->fp8_options.tp_amax_sync) return nullptr;
    const LayerParam kind = param_place(m->config, param).kind;
    const bool row_parallel = kind == WO || kind == W_DOWN;
    return dy != row_parallel ? m->tp : nullptr;
}
// Where the cast of FP8 linear `param`'s X (forward) or dY (backward) goes: X8 (scratch) and X8^T (kept for the
// backward), or dY8 and dY8^T (scratch); its scale record and health counter, the recipe, the TP amax group, and
// whether delayed scaling records its amax (training passes do, evaluation does not).
inline Fp8CastOut model_fp8_cast(Model* m, int param, bool dy) {
    Fp8Linear* lin = model_fp8_linear(m, param);
    const int t = dy ? FP8_DY : FP8_X;
    Fp8CastOut o{dy ? m->fp8.dy8 : m->fp8.x8, dy ? m->fp8.dy8_t : m->fp8.saved_x8_t[model_linear_index(m, param)], dy ? E5M2 : E4M3,
                 &lin->meta[t], m->fp8_options.recipe};
    o.health = lin->health ? &lin->health[t] : nullptr;
    o.amax_group = model_amax_group(m, param, dy);
    o.record = m->fp8.training;
    return o;
}
// Block scaling: where the cast of FP8 linear `param`'s X (X8 and the saved X8^T) or dY (dY8 and dY8^T) goes, with the
// scale tensors beside the codes, its rule (E4M3 X; dY in --dy-format) and its health counter.
inline Fp8BlockCastOut model_fp8_block_cast(Model* m, int param, bool dy) {
    const Fp8Options& o = m->fp8_options;
    ModelFp8& f = m->fp8;
    const int i = model_linear_index(m, param);
    Fp8Health* health = f.linears[i].health ? &f.linears[i].health[dy ? FP8_DY : FP8_X] : nullptr;
    if (dy)
        return Fp8BlockCastOut{f.dy8, f.dy8_scales, f.dy8_t, f.dy8_t_scales, FP8_TILES_1x128, FP8_TILES_1x128,
                               {o.dy_format, o.recipe.margin, o.block_scale_pow2}, health};
    return Fp8BlockCastOut{f.x8, f.x8_scales, f.saved_x8_t[i], f.saved_x8_t_scales[i], FP8_TILES_1x128, o.block_dw_x,
                           {E4M3, o.recipe.margin, o.block_scale_pow2}, health};
}
// cast(o) with o where FP8 linear `param`'s X (dy: its dY) goes under the model's scaling: model_fp8_block_cast's
// Fp8BlockCastOut under block scaling, else model_fp8_cast's Fp8CastOut.
template <class F>
inline void model_fp8_cast_to(Model* m, int param, bool dy, const F& cast) {
    if (m->fp8_options.block_scaling) cast(model_fp8_block_cast(m, param, dy));
    else cast(model_fp8_cast(m, param, dy));
}
// Whether an FP8 linear of kind `kind` has its X (dy: its dY) cast by the kernel that produces it (section 6's
// producers: RMSNorm makes the X of wqkv and w_gate_up, SwiGLU that of w_down, the SwiGLU backward the dY of
// w_gate_up, the RoPE backward that of wqkv). The others (X of wo, attention's output; dY of wo and w_down, the
// residual stream's gradient) are cast by linear_forward / linear_backward from their BF16 tensors.
inline bool fp8_cast_fused(const Fp8Options& o, const ModelConfig& c, LayerParam kind, bool dy) {
    if (!o.fused_casts) return false;
    if (!dy && o.smooth_quant > 0.0f) return false;   // X / s: linear_forward casts it (and gathers its channel amaxes)
    // the QK norm's and the QKV clip's backward come between RoPE's backward and wqkv's dY: no fused cast there
    if (dy && kind == WQKV && (c.qk_norm || c.qkv_clip > 0.0f)) return false;
    return dy ? (kind == WQKV || kind == W_GATE_UP) : kind != WO;
}
// fp8_cast_fused for linear `param` of the model; false for a BF16 linear.
inline bool model_fp8_fused(Model* m, int param, bool dy) {
    return model_fp8_linear(m, param) && fp8_cast_fused(m->fp8_options, m->config, param_place(m->config, param).kind, dy);
}

inline void linear_forward(Model* m, bf16* out, const bf16* inp, const Param& p, int N) {
    const TensorSpec& w = m->params[p.index];
    if (Fp8Linear* lin = model_fp8_linear(m, p.index); lin && m->fp8_options.block_scaling) {
        const Fp8BlockCastOut x = model_fp8_block_cast(m, p.index, false);
        if (!model_fp8_fused(m, p.index, false)) {   // else X8 and X8^T came from the producer of inp
            ProfileRange range(PHASE_FP8_CAST, m->stream, "cast X (block scaling)");
            fp8_block_cast_produced(x, CastPlain<bf16>{inp, w.cols}, N, w.cols, m->stream);
        }
        fp8_block_linear_forward(&m->matmul, out, x, lin, N, w.cols, w.rows, m->stream);
        return;
    }
    if (Fp8Linear* lin = model_fp8_linear(m, p.index)) {
        if (const SmoothQuantState* q = model_smooth(m, p.index)) {   // X' = X / s; the channels' amax for the next s
            ProfileRange range(PHASE_FP8_CAST, m->stream, "cast X / s (smooth-quant)");
            if (m->fp8.training) column_amax(q->x_amax, inp, N, w.cols, m->stream);
            fp8_cast_produced(model_fp8_cast(m, p.index, false), ColumnScaledCast<CastPlain<bf16>>{{inp, w.cols}, q->inv_s}, N, w.cols, m->stream);
        } else if (!model_fp8_fused(m, p.index, false)) {   // else X8 and X8^T came from the producer of inp
            ProfileRange range(PHASE_FP8_CAST, m->stream, "cast X");
            fp8_cast_produced(model_fp8_cast(m, p.index, false), CastPlain<bf16>{inp, w.cols}, N, w.cols, m->stream);
        }
        fp8_linear_forward(&m->matmul, out, m->fp8.x8, lin, N, w.cols, w.rows, m->fp8_options.fast_accum, m->stream);
        return;
    }
    bf16_linear_forward(&m->matmul, out, inp, p.w, N, w.cols, w.rows, m->stream);
}
// inp is the forward's input; FP8 layers use their saved X8^T instead (inp may then be a dead buffer, and so may
// dout when its producer cast it).
inline void linear_backward(Model* m, bf16* dinp, const bf16* dout, const bf16* inp, const Param& p, int N) {
    const TensorSpec& w = m->params[p.index];
    if (Fp8Linear* lin = model_fp8_linear(m, p.index); lin && m->fp8_options.block_scaling) {
        const Fp8BlockCastOut dy = model_fp8_block_cast(m, p.index, true);
        if (!model_fp8_fused(m, p.index, true)) {   // else dY8 and dY8^T came from the producer of dout
            ProfileRange range(PHASE_FP8_CAST, m->stream, "cast dY (block scaling)");
            fp8_block_cast_produced(dy, CastPlain<bf16>{dout, w.rows}, N, w.rows, m->stream);
        }
        fp8_block_linear_backward(&m->matmul, dinp, p.grad, dy, model_fp8_block_cast(m, p.index, false), lin, N, w.cols, w.rows, m->stream,
                                  m->accumulate_grads);
        return;
    }
    if (Fp8Linear* lin = model_fp8_linear(m, p.index)) {
        if (!model_fp8_fused(m, p.index, true)) {   // else dY8 and dY8^T came from the producer of dout
            ProfileRange range(PHASE_FP8_CAST, m->stream, "cast dY");
            fp8_cast_produced(model_fp8_cast(m, p.index, true), CastPlain<bf16>{dout, w.rows}, N, w.rows, m->stream);
        }
        const SmoothQuantState* q = model_smooth(m, p.index);
        // --smooth-quant: the GEMMs give dX' and add dW' (p.grad holds dW' s so far: divided by s first; exact)
        if (q && m->accumulate_grads) scale_columns(p.grad, q->inv_s, w.rows, w.cols, m->stream);
        fp8_linear_backward(&m->matmul, dinp, p.grad, m->fp8.dy8, m->fp8.dy8_t, m->fp8.saved_x8_t[model_linear_index(m, p.index)],
                            lin, N, w.cols, w.rows, m->stream, m->accumulate_grads);
        if (q) {   // dX = dX' / s, dW = dW' s
            ProfileRange range(PHASE_OTHER, m->stream, "smooth-quant gradient scales");
            scale_columns(dinp, q->inv_s, N, w.cols, m->stream);
            scale_columns(p.grad, q->s, w.rows, w.cols, m->stream);
        }
        return;
    }
    if (m->linear_probe) m->linear_probe(p, inp, dout, N);
    bf16_linear_backward(&m->matmul, dinp, p.grad, dout, inp, p.w, N, w.cols, w.rows, m->stream, m->accumulate_grads);
}

// The producers of the linears' inputs and output gradients, which know their consumer linear: BF16 into the
// given tensor, or for an FP8 consumer that casts where it is produced (model_fp8_fused), the FP8 cast
// straight into the consumer's X8 / dY8 buffers (the BF16 tensor is then not written).
inline void model_rmsnorm_forward(Model* m, bf16* resid_out, bf16* y, float* rstd, const bf16* resid, const bf16* branch,
                                  const Param& norm, const Param& consumer, int N) {
    const ModelConfig& c = m->config;
    if (model_fp8_fused(m, consumer.index, false)) {
        model_fp8_cast_to(m, consumer.index, false, [&](const auto& o) {
            rmsnorm_forward_fp8(o, resid_out, rstd, resid, branch, norm.w, N, c.dim, c.norm_eps, m->stream);
        });
        return;
    }
    rmsnorm_forward(resid_out, y, rstd, resid, branch, norm.w, N, c.dim, c.norm_eps, m->stream);
}
inline void model_swiglu_forward(Model* m, bf16* out, const bf16* gate_up, const Param& consumer, int N) {
    if (model_fp8_fused(m, consumer.index, false)) {
        model_fp8_cast_to(m, consumer.index, false, [&](const auto& o) { swiglu_forward_fp8(o, gate_up, N, m->ffn_dim, m->stream); });
        return;
    }
    swiglu_forward(out, gate_up, N, m->ffn_dim, m->stream);
}
inline void model_swiglu_backward(Model* m, bf16* dgate_up, const bf16* dout, const bf16* gate_up, const Param& consumer, int N) {
    if (model_fp8_fused(m, consumer.index, true)) {
        model_fp8_cast_to(m, consumer.index, true, [&](const auto& o) { swiglu_backward_fp8(o, dout, gate_up, N, m->ffn_dim, m->stream); });
        return;
    }
    swiglu_backward(dgate_up, dout, gate_up, N, m->ffn_dim, m->stream);
}
inline void model_rope_backward(Model* m, bf16* dqkv, const Param& consumer, int B, int T) {
    const int HD = m->config.head_dim;
    if (model_fp8_fused(m, consumer.index, true)) {
        model_fp8_cast_to(m, consumer.index, true, [&](const auto& o) {
            rope_backward_fp8(o, dqkv, m->rope_cos, m->rope_sin, B, T, m->n_heads, m->n_kv_heads, HD, m->stream);
        });
        return;
    }
    rope_backward(dqkv, m->rope_cos, m->rope_sin, B, T, m->n_heads, m->n_kv_heads, HD, m->stream);
}

// The weights changed (optimizer step, upload, load): the FP8 build rebuilds W8 and W8^T of its FP8 layers
// with current scaling, one cast+transpose per layer (fp8_weight_update). after_step: the change was an
// optimizer step whose update pass gathered each W's amax into its meta (adamw_gather_weight_amax with
// model_weight_amax_slots), so no amax pass runs (2 bytes a parameter less); the codes and scales are the same
// bits as with the amax pass.
inline void model_weights_changed(Model* m, bool after_step = false) {
    if constexpr (!BUILD_FP8) return;   // no FP8 copies
    if (after_step && !m->fp8.amax_from_optimizer)
        fail("model_weights_changed after a step: the optimizer does not gather the weights' amax; hand it "
             "model_weight_amax_slots (adamw_gather_weight_amax) or rebuild with after_step = false");
    for (const LayerParams& L : m->layers)
        for (const Param* p : layer_linears(L))
            if (Fp8Linear* lin = model_fp8_linear(m, p->index)) {
                const TensorSpec& w = m->params[p->index];
                if (m->fp8_options.block_scaling) {   // each block's scale from its own amax: no amax from the optimizer
                    const Fp8Options& o = m->fp8_options;
                    fp8_block_weight_update(lin, p->w, w.rows, w.cols, Fp8BlockRule{E4M3, o.recipe.margin, o.block_scale_pow2}, m->stream);
                    continue;
                }
                const SmoothQuantState* q = model_smooth(m, p->index);
                if (q && after_step) smooth_quant_update(*q, p->w, w.rows, w.cols, m->fp8_options.smooth_quant, m->stream);
                fp8_weight_update(lin, p->w, w.rows, w.cols, m->stream, after_step && !q, q ? q->s : nullptr);
            }
}

// Per parameter tensor (Model::params order): where the optimizer's update pass should gather the amax of the
// new BF16 weights - W's Fp8Meta::amax_pending for the FP8 linears, nullptr for the others (all of them in the
// BF16 build, and under block scaling, whose blocks take their own amaxes). Hand it to adamw_gather_weight_amax; then
// model_weights_changed(m, true) after each step.
inline std::vector<unsigned int*> model_weight_amax_slots(Model* m) {
    std::vector<unsigned int*> slots(m->params.size(), nullptr);
    for (const LayerParams& L : m->layers)
        for (const Param* p : layer_linears(L))
            if (Fp8Linear* lin = model_fp8_linear(m, p->index))   // --smooth-quant: W' s has an amax pass of its own
                if (!model_smooth(m, p->index) && !m->fp8_options.block_scaling) slots[p->index] = &lin->meta[FP8_W].amax_pending;
    m->fp8.amax_from_optimizer = true;
    return slots;
}

// Tensor parallelism: the in-place BF16 sum over the group of a row-parallel layer's output (forward) or of a
// column-parallel layer's input gradient (backward); nothing without a group.
inline void model_tp_all_reduce(Model* m, bf16* x, size_t n) {
    if (!m->tp) return;
    ProfileRange range(PHASE_TP_COMM, m->stream, "tensor-parallel all-reduce");
    tp_all_reduce(m->tp, x, n, ncclBfloat16, ncclSum, m->stream);
}

// ----------------------------------------------------------------------------------------------
// 6. The model.

// The BF16 inputs of the linears that only their weight gradient needs (attn_norm, ffn_norm, swiglu) are
// kept per layer for BF16 layers; FP8 layers keep X8^T instead, so they share one slot, reused layer by
// layer. Slot of layer l: its own for BF16 layers, the shared last one for FP8 layers.
inline int model_num_bf16_layers(const Model* m) {
    int n = 0;
    for (int l = 0; l < m->config.n_layers; l++) n += !model_layer_fp8(m, l);
    return n;
}
inline int model_linear_input_slot(const Model* m, int l) {
    if (model_layer_fp8(m, l)) return model_num_bf16_layers(m);
    int slot = 0;
    for (int i = 0; i < l; i++) slot += !model_layer_fp8(m, i);
    return slot;
}

inline std::vector<ActivationSpec> model_activation_specs(Model* m) {
    const ModelConfig& c = m->config;
    // per rank under tensor parallelism: qkv, att, gate_up, swiglu and their gradients hold this rank's heads
    // and FFN slice (QKV, A, F, LSE); the residual stream and the norms are whole (D)
    const size_t L = c.n_layers, N = (size_t)m->B * m->T, D = c.dim, F = m->ffn_dim, V = c.vocab_size;
    const size_t S = model_num_bf16_layers(m) + (model_num_bf16_layers(m) < c.n_layers ? 1 : 0);   // input slots
    const size_t QKV = model_local_qkv_dim(m), A = (size_t)m->n_heads * c.head_dim, LSE = N * m->n_heads, chunk = m->ce_chunk;
    const size_t QKH = c.qk_norm ? (size_t)m->n_heads + m->n_kv_heads : 0;   // heads the QK norm keeps (none without it)
    ModelActivations& a = m->acts;
    return {
        {"resid_attn", DT_BF16, L * N * D, (void**)&a.resid_attn},
        {"attn_norm", DT_BF16, S * N * D, (void**)&a.attn_norm},
        {"attn_rstd", DT_FP32, L * N, (void**)&a.attn_rstd},
        {"qkv", DT_BF16, L * N * QKV, (void**)&a.qkv},
        {"qkv_clip_mask", DT_E4M3 /* bytes */, c.qkv_clip > 0.0f ? L * N * QKV / 8 : 0, (void**)&a.qkv_clip_mask},
        {"qk_norm_x", DT_BF16, L * N * QKH * c.head_dim, (void**)&a.qk_norm_x},
        {"qk_norm_rstd", DT_FP32, L * N * QKH, (void**)&a.qk_norm_rstd},
        {"att", DT_BF16, L * N * A, (void**)&a.att},
        {"lse", DT_FP32, L * LSE, (void**)&a.lse},
        {"resid_ffn", DT_BF16, L * N * D, (void**)&a.resid_ffn},
        {"ffn_norm", DT_BF16, S * N * D, (void**)&a.ffn_norm},
        {"ffn_rstd", DT_FP32, L * N, (void**)&a.ffn_rstd},
        {"gate_up", DT_BF16, L * N * 2 * F, (void**)&a.gate_up},
        {"swiglu", DT_BF16, S * N * F, (void**)&a.swiglu},
        {"resid_final", DT_BF16, N * D, (void**)&a.resid_final},
        {"final_norm", DT_BF16, N * D, (void**)&a.final_norm},
        {"final_rstd", DT_FP32, N, (void**)&a.final_rstd},
        {"branch", DT_BF16, N * D, (void**)&a.branch},
        {"dresid", DT_BF16, N * D, (void**)&a.dresid},
        {"dnorm", DT_BF16, N * D, (void**)&a.dnorm},
        {"datt", DT_BF16, N * A, (void**)&a.datt},
        {"dqkv", DT_BF16, N * QKV, (void**)&a.dqkv},
        {"dgate_up", DT_BF16, N * 2 * F, (void**)&a.dgate_up},
        {"dswiglu", DT_BF16, N * F, (void**)&a.dswiglu},
        {"att_scratch", DT_FP32, attention_backward_scratch_floats(m->B, m->T, m->n_heads, c.head_dim), (void**)&a.att_scratch},
        {"att_fp8", DT_E4M3 /* bytes */, m->fp8_options.attention ? attention_fp8_scratch_bytes(m->B, m->T, m->n_heads, m->n_kv_heads, c.head_dim) : 0,
         (void**)&a.att_fp8},
        {"norm_scratch", DT_FP32, rmsnorm_backward_scratch((int)N, (int)D), (void**)&a.norm_scratch},
        {"qk_norm_scratch", DT_FP32, c.qk_norm ? qk_norm_backward_scratch((int)N, c.head_dim) : 0, (void**)&a.qk_norm_scratch},
        {"emb_scratch", DT_E4M3 /* bytes */, embedding_backward_scratch_bytes((int)N), (void**)&a.emb_scratch},
        {"logits", DT_FP32, chunk * V, (void**)&a.logits},
        {"dlogits", DT_BF16, chunk * V, (void**)&a.dlogits},
        {"losses", DT_FP32, N, (void**)&a.losses},
        {"loss_mean", DT_FP32, 1, (void**)&a.loss_mean},
    };
}

// Tokens per lm_head + cross-entropy chunk: N split into the fewest equal chunks that keep [chunk,V] within 2^27
// elements (512 MiB of FP32 logits and 256 MiB of BF16 dlogits), a multiple of 16 and at least 16. Few chunks
// matter: each one reads and writes lm_head's whole FP32 gradient [V,D] once more, and a short chunk is a thin GEMM.
inline int model_ce_chunk(int N, int V) {
    const long fit = std::max<long>(16, ((1L << 27) / V) / 16 * 16);
    const long chunks = ceil_div((long)N, fit);
    return (int)std::min<long>(fit, ceil_div(ceil_div((long)N, chunks), 16L) * 16);
}

// Block scaling: the scale tensors of each FP8 linear's W8, W8^T and saved X8^T (tiles or blocks: --block-dw-x), and of
// the scratch casts X8, dY8 and dY8^T (max_in, max_out: the widest linear's), in one zeroed allocation.
inline void model_fp8_block_scales_create(Model* m, int max_in, int max_out) {
    ModelFp8& f = m->fp8;
    const int N = m->B * m->T;
    auto round4 = [](size_t n) { return (n + 3) / 4 * 4; };   // each tensor's start 16-byte aligned (cuBLASLt's rule)
    auto for_each_fp8_linear = [&](const std::function<void(int, const TensorSpec&)>& fn) {
        for (const LayerParams& layer : m->layers)
            for (const Param* p : layer_linears(layer))
                if (f.linears[model_linear_index(m, p->index)].w8) fn(model_linear_index(m, p->index), m->params[p->index]);
    };
    size_t total = round4(fp8_scale_count(FP8_TILES_1x128, N, max_in)) + round4(fp8_scale_count(FP8_TILES_1x128, N, max_out)) +
                   round4(fp8_scale_count(FP8_TILES_1x128, max_out, N));
    for_each_fp8_linear([&](int, const TensorSpec& w) {
        total += round4(fp8_scale_count(FP8_BLOCKS_128x128, w.rows, w.cols)) + round4(fp8_scale_count(FP8_BLOCKS_128x128, w.cols, w.rows)) +
                 round4(fp8_scale_count(m->fp8_options.block_dw_x, w.cols, N));
    });
    cudaCheck(cudaMalloc(&f.block_scales, total * sizeof(float)));
    cudaCheck(cudaMemset(f.block_scales, 0, total * sizeof(float)));
    float* at = f.block_scales;
    auto take = [&](size_t n) { float* p = at; at += round4(n); return p; };
    f.x8_scales = take(fp8_scale_count(FP8_TILES_1x128, N, max_in));
    f.dy8_scales = take(fp8_scale_count(FP8_TILES_1x128, N, max_out));
    f.dy8_t_scales = take(fp8_scale_count(FP8_TILES_1x128, max_out, N));
    f.saved_x8_t_scales.assign(f.linears.size(), nullptr);
    for_each_fp8_linear([&](int i, const TensorSpec& w) {
        f.linears[i].w8_scales = take(fp8_scale_count(FP8_BLOCKS_128x128, w.rows, w.cols));
        f.linears[i].w8_t_scales = take(fp8_scale_count(FP8_BLOCKS_128x128, w.cols, w.rows));
        f.saved_x8_t_scales[i] = take(fp8_scale_count(m->fp8_options.block_dw_x, w.cols, N));
    });
}

// FP8 state: W8 and W8^T of each FP8 linear, X8^T saved per FP8 linear, the scratch casts; Fp8Meta and
// Fp8Health arrays for all linears.
inline void model_fp8_create(Model* m) {
    const ModelConfig& c = m->config;
    const int L = c.n_layers;
    const size_t N = (size_t)m->B * m->T;
    ModelFp8& f = m->fp8;
    f.linears.assign(L * LINEARS_PER_LAYER, Fp8Linear{nullptr, nullptr, nullptr, nullptr});
    f.saved_x8_t.assign(L * LINEARS_PER_LAYER, nullptr);
    size_t max_in = 0, max_out = 0;
    std::vector<size_t> w_off(L * LINEARS_PER_LAYER), x_off(L * LINEARS_PER_LAYER);
    auto round256 = [](size_t b) { return (b + 255) / 256 * 256; };
    for (int l = 0; l < L; l++)
        for (const Param* p : layer_linears(m->layers[l])) {
            if (!model_layer_fp8(m, l)) continue;
            const TensorSpec& w = m->params[p->index];
            int i = model_linear_index(m, p->index);
            w_off[i] = f.weight_bytes;
            f.weight_bytes += 2 * round256((size_t)w.rows * w.cols);
            x_off[i] = f.saved_bytes;
            f.saved_bytes += round256(N * w.cols);
            max_in = std::max(max_in, (size_t)w.cols);
            max_out = std::max(max_out, (size_t)w.rows);
        }
    f.scratch_bytes = round256(N * max_in) + 2 * round256(N * max_out);
    cudaCheck(cudaMalloc(&f.memory, f.weight_bytes + f.saved_bytes + f.scratch_bytes));
    char* base = (char*)f.memory;
    f.x8 = (fp8*)(base + f.weight_bytes + f.saved_bytes);
    f.dy8 = f.x8 + round256(N * max_in);
    f.dy8_t = f.dy8 + round256(N * max_out);
    const size_t n_meta = (size_t)L * LINEARS_PER_LAYER * 3;
    cudaCheck(cudaMalloc(&f.metas, n_meta * sizeof(Fp8Meta)));
    cudaCheck(cudaMalloc(&f.health, n_meta * sizeof(Fp8Health)));
    std::vector<Fp8Meta> init(n_meta, fp8_meta_initial());
    cudaCheck(cudaMemcpy(f.metas, init.data(), n_meta * sizeof(Fp8Meta), cudaMemcpyHostToDevice));
    std::vector<int> x_ids, dy_ids;
    for (int l = 0; l < L; l++)
        for (const Param* p : layer_linears(m->layers[l])) {
            if (!model_layer_fp8(m, l)) continue;
            const TensorSpec& w = m->params[p->index];
            int i = model_linear_index(m, p->index);
            x_ids.push_back(3 * i + FP8_X);
            dy_ids.push_back(3 * i + FP8_DY);
            f.linears[i].w8 = (fp8*)(base + w_off[i]);
            f.linears[i].w8_t = f.linears[i].w8 + round256((size_t)w.rows * w.cols);
            f.linears[i].meta = f.metas + 3 * i;
            f.saved_x8_t[i] = (fp8*)(base + f.weight_bytes + x_off[i]);
        }
    f.n_fp8_linears = (int)x_ids.size();
    if (m->fp8_options.block_scaling && f.n_fp8_linears > 0) model_fp8_block_scales_create(m, (int)max_in, (int)max_out);
    if (m->fp8_options.smooth_quant > 0.0f) {   // s = 1 and no amax gathered yet: 4 words per input channel
        size_t words = 0;
        for (const LayerParams& layer : m->layers)
            for (const Param* p : layer_linears(layer))
                if (f.linears[model_linear_index(m, p->index)].w8) words += 4 * (size_t)m->params[p->index].cols;
        std::vector<float> init(words, 0.0f);
        cudaCheck(cudaMalloc(&f.smooth_memory, words * sizeof(float)));
        f.smooth.assign(L * LINEARS_PER_LAYER, SmoothQuantState{nullptr, nullptr, nullptr, nullptr});
        size_t at = 0;
        float* base = (float*)f.smooth_memory;
        for (const LayerParams& layer : m->layers)
            for (const Param* p : layer_linears(layer)) {
                const int i = model_linear_index(m, p->index), in = m->params[p->index].cols;
                if (!f.linears[i].w8) continue;
                f.smooth[i] = SmoothQuantState{base + at, base + at + in, (unsigned int*)(base + at + 2 * in), (unsigned int*)(base + at + 3 * in)};
                std::fill(init.begin() + at, init.begin() + at + 2 * in, 1.0f);
                at += 4 * (size_t)in;
            }
        cudaCheck(cudaMemcpy(f.smooth_memory, init.data(), words * sizeof(float), cudaMemcpyHostToDevice));
    }
    x_ids.insert(x_ids.end(), dy_ids.begin(), dy_ids.end());
    cudaCheck(cudaMalloc(&f.delayed_ids, std::max<size_t>(1, x_ids.size()) * sizeof(int)));
    cudaCheck(cudaMemcpy(f.delayed_ids, x_ids.data(), x_ids.size() * sizeof(int), cudaMemcpyHostToDevice));
}

// Delayed scaling, once per optimizer step, after the backward of its last micro-batch: every GEMM that read
// the X and dY scales has run; now the step's amaxes (the MAX over its micro-batches) enter the histories, all
// tensors in one launch, so that --amax-history and --quant-interval count optimizer steps. Evaluation passes
// gather nothing: the history is of training steps. Nothing under current scaling (each cast records its own).
// In the --amax-warmup steps the casts are current-scaled and gather the step's MAX in Fp8Meta::warmup_amax (the
// group's MAX already under --tp-amax-sync: each cast took it), which this records into the history.
inline void model_fp8_record_amax(Model* m) {
    const Fp8Recipe& r = m->fp8_options.recipe;
    if (!r.history_per_step()) return;
    ProfileRange range(PHASE_FP8_CAST, m->stream, "record amax (delayed scaling)");
    ModelFp8& f = m->fp8;
    if (m->tp && m->fp8_options.tp_amax_sync)   // the amaxes of this rank's slices (model_amax_group), one word each
        for (const LayerParams& L : m->layers)
            for (const Param* p : layer_linears(L))
                if (Fp8Linear* lin = model_fp8_linear(m, p->index)) {
                    bool dy = model_amax_group(m, p->index, true) != nullptr;
                    tp_all_reduce(m->tp, &lin->meta[dy ? FP8_DY : FP8_X].amax_pending, 1, ncclUint32, ncclMax, m->stream);
                }
    fp8_update_scales(f.metas, f.delayed_ids, 2 * f.n_fp8_linears, f.n_fp8_linears, r, m->stream);   // X (E4M3), then dY
}

// --fp8-stats: count saturation and underflow in the casts of the steps between begin and end.
inline void model_fp8_stats_begin(Model* m) {
    const size_t n = m->fp8.linears.size() * 3;
    cudaCheck(cudaMemsetAsync(m->fp8.health, 0, n * sizeof(Fp8Health), m->stream));
    for (size_t i = 0; i < m->fp8.linears.size(); i++)
        if (m->fp8.linears[i].w8) m->fp8.linears[i].health = m->fp8.health + 3 * i;
}
inline void model_fp8_stats_end(Model* m) {
    for (Fp8Linear& lin : m->fp8.linears) lin.health = nullptr;
}

// The counts since model_fp8_stats_begin: one record per FP8 tensor (X, W and dY of each FP8 linear), in the
// order of ModelFp8::linears. Saturated: x * scale rounds beyond the format's max (clipped; fp8_saturates); flushed:
// a non-zero value whose code is +-0. Fractions of the codes written (block scaling: two a value, fp8_kernels.cuh's
// Fp8Health).
constexpr const char* LINEAR_NAMES[LINEARS_PER_LAYER] = {"wqkv", "wo", "w_gate_up", "w_down"};
constexpr const char* FP8_TENSOR_NAMES[3] = {"X", "W", "dY"};
struct Fp8TensorStats {
    int layer, linear, tensor;   // linear: LINEAR_NAMES' index; tensor: FP8_X, FP8_W or FP8_DY
    Fp8Format format;
    float amax;                  // per tensor: the last cast's (Fp8Meta); block scaling: the largest |x| the counted casts saw
    bool block_scaled;           // a scale per tile or block: no scale_log2
    int scale_log2;              // per tensor: the exponent of the scale (a power of two)
    double saturated, flushed;
};
inline std::vector<Fp8TensorStats> model_fp8_stats_read(Model* m) {
    const size_t n = m->fp8.linears.size() * 3;
    std::vector<Fp8Meta> metas(n);
    std::vector<Fp8Health> health(n);
    cudaCheck(cudaMemcpyAsync(metas.data(), m->fp8.metas, n * sizeof(Fp8Meta), cudaMemcpyDeviceToHost, m->stream));
    cudaCheck(cudaMemcpyAsync(health.data(), m->fp8.health, n * sizeof(Fp8Health), cudaMemcpyDeviceToHost, m->stream));
    cudaCheck(cudaStreamSynchronize(m->stream));
    const bool block = m->fp8_options.block_scaling;
    std::vector<Fp8TensorStats> stats;
    for (size_t i = 0; i < m->fp8.linears.size(); i++) {
        if (!m->fp8.linears[i].w8) continue;
        for (int t = 0; t < 3; t++) {
            const Fp8Health& h = health[3 * i + t];
            if (h.total == 0) continue;
            const Fp8Format format = block && t == FP8_DY ? m->fp8_options.dy_format : fp8_tensor_format(t);
            float block_amax;
            memcpy(&block_amax, &h.amax, sizeof(float));
            stats.push_back({(int)(i / LINEARS_PER_LAYER), (int)(i % LINEARS_PER_LAYER), t, format, block ? block_amax : metas[3 * i + t].amax,
                             block, block ? 0 : (int)log2f(metas[3 * i + t].scale), (double)h.saturated / h.total, (double)h.flushed / h.total});
        }
    }
    return stats;
}

// tp: this rank's tensor-parallel group (nullptr: the whole model on this GPU). Only rank 0 prints.
inline void model_create(Model* m, const ModelConfig& c, int B, int T, const Fp8Options& fp8 = Fp8Options(),
                         const TpGroup* tp = nullptr) {
    model_config_validate(c);
    if (B < 1 || T < 1) fail("model_create: B=%d and T=%d must be at least 1", B, T);
    if (T > c.max_seq_len) fail("model_create: T=%d is longer than max_seq_len %d: lower T or raise max_seq_len", T, c.max_seq_len);
    if ((B * T) % 16 != 0) fail("model_create: B*T = %d*%d must be a multiple of 16 (the GEMM rule): change B or T", B, T);
    if (c.qk_norm && tp && tp->size > 1)
        fail("model_create: --qk-norm under tensor parallelism (%d ranks): the replicated Q and K norm weights would get only "
             "each rank's heads' gradients; use --tp 1", tp->size);
    if (fp8.block_scaling) {
        const std::string problem = model_block_scaling_problem(c, tp ? tp->size : 1, (long)B * T);
        if (!problem.empty()) fail("model_create: block scaling (--scaling block): %s", problem.c_str());
    }
    if (fp8.dy_format != E5M2 && !fp8.block_scaling)
        fail("model_create: dY in %s needs block scaling (one scale per tensor casts dY to E5M2)", fp8_name(fp8.dy_format));
    if (fp8.block_dw_x != FP8_TILES_1x128 && (!fp8.block_scaling || fp8.block_dw_x != FP8_BLOCKS_128x128))
        fail("model_create: dW's X^T in %s needs block scaling, and is 1x128 tiles or 128x128 blocks", fp8_granularity_name(fp8.block_dw_x));
    if (fp8.attention && (!BUILD_FP8 || !attention_hopper_available))
        fail("model_create: FP8 attention (--fp8-attention) needs the FP8 build for GPU_ARCH=sm_90a (this one: %s%s)",
             BUILD_FP8 ? "FP8" : "PRECISION=BF16", attention_hopper_available ? ", sm_90a" : ", not sm_90a");
    m->config = c;
    m->fp8_options = fp8;
    m->tp = tp;
    m->tp_size = tp ? tp->size : 1;
    m->tp_rank = tp ? tp->rank : 0;
    m->n_heads = c.n_heads / m->tp_size;
    m->n_kv_heads = c.n_kv_heads / m->tp_size;
    m->ffn_dim = c.ffn_dim / m->tp_size;
    m->params = model_param_specs(c, m->tp_size);
    m->num_params = m->params.back().offset + m->params.back().numel;
    m->B = B;
    m->T = T;
    m->ce_chunk = model_ce_chunk(B * T, c.vocab_size);
    cudaCheck(cudaStreamCreate(&m->stream));
    matmul_context_create(&m->matmul);
    cudaCheck(cudaMalloc(&m->weights, m->num_params * sizeof(bf16)));
    cudaCheck(cudaMalloc(&m->grads, m->num_params * sizeof(float)));
    cudaCheck(cudaMemset(m->grads, 0, m->num_params * sizeof(float)));
    m->tok_embedding = model_param(m, PARAM_TOK_EMBEDDING);
    m->final_norm = model_param(m, param_final_norm(c));
    m->lm_head = model_param(m, param_lm_head(c));
    m->layers.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; l++) {
        LayerParams& L = m->layers[l];
        L.attn_norm = model_param(m, param_layer(l, ATTN_NORM));
        L.wqkv = model_param(m, param_layer(l, WQKV));
        L.wo = model_param(m, param_layer(l, WO));
        L.ffn_norm = model_param(m, param_layer(l, FFN_NORM));
        L.w_gate_up = model_param(m, param_layer(l, W_GATE_UP));
        L.w_down = model_param(m, param_layer(l, W_DOWN));
        if (c.qk_norm) L.qk_norm = model_param(m, param_qk_norm(c, l));
    }
    // activations: each tensor at a 256-byte boundary of one allocation
    std::vector<ActivationSpec> specs = model_activation_specs(m);
    std::vector<size_t> offsets;
    size_t bytes = 0;
    for (const ActivationSpec& s : specs) {
        offsets.push_back(bytes);
        bytes += (s.numel * dtype_size(s.type) + 255) / 256 * 256;
    }
    cudaCheck(cudaMalloc(&m->act_memory, bytes));
    m->act_bytes = bytes;
    for (size_t i = 0; i < specs.size(); i++) *specs[i].slot = (char*)m->act_memory + offsets[i];
    std::vector<float> cos_t, sin_t;
    rope_tables(&cos_t, &sin_t, T, c.head_dim, c.rope_theta);
    cudaCheck(cudaMalloc(&m->rope_cos, 2 * cos_t.size() * sizeof(float)));
    m->rope_sin = m->rope_cos + cos_t.size();
    cudaCheck(cudaMemcpy(m->rope_cos, cos_t.data(), cos_t.size() * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(m->rope_sin, sin_t.data(), sin_t.size() * sizeof(float), cudaMemcpyHostToDevice));

    if constexpr (BUILD_FP8) model_fp8_create(m);   // W8 is made when weights arrive (model_upload_weights, model_weights_changed)
    if (m->tp_rank != 0) return;
    const double MiB = 1048576.0;
    printf("model: %zu parameters (dim %d, %d layers, %d heads, %d KV heads, ffn %d, vocab %d), B=%d T=%d\n",
           model_num_params(c), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, B, T);
    printf("model memory%s: weights %.1f MiB (BF16), gradients %.1f MiB (FP32), activations %.1f MiB\n",
           m->tp_size > 1 ? " per rank" : "", m->num_params * sizeof(bf16) / MiB, m->num_params * sizeof(float) / MiB, bytes / MiB);
    if constexpr (BUILD_FP8) {
        // What the same model keeps in the BF16 build: every layer's attn_norm, ffn_norm and swiglu, no X8^T.
        const int fp8_layers = c.n_layers - model_num_bf16_layers(m);
        const size_t bf16_build = bytes + (size_t)std::max(0, fp8_layers - 1) * B * T * (2 * c.dim + m->ffn_dim) * sizeof(bf16);
        printf("model FP8: %d of %d decoder layers in FP8 (%s; attention forward %s), FP8 weights %.1f MiB, saved X8^T %.1f MiB, "
               "scratch %.1f MiB\n", fp8_layers, c.n_layers, !fp8.enabled ? "--bf16-linears" : fp8.all_layers ? "all layers" : "first and last in BF16",
               fp8.attention ? "FP8 too" : "BF16", m->fp8.weight_bytes / MiB, m->fp8.saved_bytes / MiB, m->fp8.scratch_bytes / MiB);
        if (fp8.block_scaling)
            printf("model FP8 scales: one per 1x128 tile of X and dY (dY %s), per 128x128 block of W, per %s of dW's X^T, %s\n",
                   fp8_name(fp8.dy_format), fp8.block_dw_x == FP8_BLOCKS_128x128 ? "128x128 block" : "1x128 tile",
                   fp8.block_scale_pow2 ? "powers of two" : "fmax / amax in FP32");
        printf("model activations kept for backward: %.1f MiB in this FP8 build, %.1f MiB in the BF16 build\n",
               (bytes + m->fp8.saved_bytes) / MiB, bf16_build / MiB);
    }
    printf("model FLOPs per token: %.3f GFLOP (6 x %zu matmul parameters + 6 x L x D x T causal attention)\n",
           model_flops_per_token(c, T) / 1e9, model_num_params(c) - (size_t)c.vocab_size * c.dim);
}

inline void model_destroy(Model* m) {
    for (auto& kv : m->graphs) cudaCheck(cudaGraphExecDestroy(kv.second));
    cudaCheck(cudaFree(m->fp8.memory));   // (all nullptr in the BF16 build: cudaFree does nothing)
    cudaCheck(cudaFree(m->fp8.metas));
    cudaCheck(cudaFree(m->fp8.health));
    cudaCheck(cudaFree(m->fp8.delayed_ids));
    cudaCheck(cudaFree(m->fp8.smooth_memory));
    cudaCheck(cudaFree(m->fp8.block_scales));
    cudaCheck(cudaFree(m->rope_cos));
    cudaCheck(cudaFree(m->act_memory));
    cudaCheck(cudaFree(m->grads));
    cudaCheck(cudaFree(m->weights));
    matmul_context_destroy(&m->matmul);
    cudaCheck(cudaStreamDestroy(m->stream));
    *m = Model();
}

// host FP32 [num_params] -> BF16 weights (round to nearest even), through a bounded staging buffer.
inline void model_upload_weights(Model* m, const float* host_fp32) {
    const size_t step = 1u << 24;
    std::vector<bf16> staging(std::min(step, m->num_params));
    for (size_t i0 = 0; i0 < m->num_params; i0 += step) {
        size_t n = std::min(step, m->num_params - i0);
        for (size_t i = 0; i < n; i++) staging[i] = __float2bfloat16(host_fp32[i0 + i]);
        cudaCheck(cudaMemcpy(m->weights + i0, staging.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
    }
    model_weights_changed(m);
}

// Start a step's gradients: the next model_forward_backward writes them instead of adding to them (the first
// weight-gradient GEMM of each linear and of lm_head with beta = 0, the norms' dw reduce with "="), so only
// the embedding's gradient, which the backward scatters into, is zeroed here: V x D floats, not all of them.
inline void model_zero_grads(Model* m) {
    cudaCheck(cudaMemsetAsync(m->tok_embedding.grad, 0, m->params[m->tok_embedding.index].numel * sizeof(float), m->stream));
    m->accumulate_grads = false;
}

// Layer l's saved activations.
struct LayerActs {
    bf16 *resid_attn, *attn_norm, *qkv, *att, *resid_ffn, *ffn_norm, *gate_up, *swiglu, *qk_norm_x;
    float *attn_rstd, *lse, *ffn_rstd, *qk_norm_rstd;
    uint8_t* qkv_clip_mask;
};
inline LayerActs model_layer_acts(Model* m, int l) {
    const ModelConfig& c = m->config;
    const size_t N = (size_t)m->B * m->T, D = c.dim, F = m->ffn_dim, A = (size_t)m->n_heads * c.head_dim;
    ModelActivations& a = m->acts;
    const size_t slot = model_linear_input_slot(m, l);
    LayerActs la;
    la.resid_attn = a.resid_attn + l * N * D;
    la.attn_norm = a.attn_norm + slot * N * D;
    la.attn_rstd = a.attn_rstd + l * N;
    la.qkv = a.qkv + l * N * model_local_qkv_dim(m);
    const size_t qk_heads = c.qk_norm ? (size_t)m->n_heads + m->n_kv_heads : 0;
    la.qkv_clip_mask = a.qkv_clip_mask + (c.qkv_clip > 0.0f ? l * N * model_local_qkv_dim(m) / 8 : 0);
    la.qk_norm_x = a.qk_norm_x + l * N * qk_heads * c.head_dim;
    la.qk_norm_rstd = a.qk_norm_rstd + l * N * qk_heads;
    la.att = a.att + l * N * A;
    la.lse = a.lse + l * N * m->n_heads;
    la.resid_ffn = a.resid_ffn + l * N * D;
    la.ffn_norm = a.ffn_norm + slot * N * D;
    la.ffn_rstd = a.ffn_rstd + l * N;
    la.gate_up = a.gate_up + l * N * 2 * F;
    la.swiglu = a.swiglu + slot * N * F;
    return la;
}

inline void model_check_batch(const Model* m, int B, int T, const char* who) {
    if (B < 1 || T < 1 || B > m->B || T > m->T)
        fail("%s: B=%d T=%d must be positive and at most the allocated B=%d T=%d (model_create)", who, B, T, m->B, m->T);
    if ((B * T) % 16 != 0) fail("%s: B*T = %d*%d must be a multiple of 16 (the GEMM rule)", who, B, T);
}

// The forward pass up to the final norm (acts.final_norm), for B x T tokens.
inline void model_forward(Model* m, const int* d_inputs, int B, int T) {
    model_check_batch(m, B, T, "model_forward");
    const ModelConfig& c = m->config;
    ModelActivations& a = m->acts;
    const int N = B * T, D = c.dim, L = c.n_layers;
    cudaStream_t s = m->stream;
    NvtxRange nvtx("forward");
    LayerActs first = model_layer_acts(m, 0);
    embedding_forward(first.resid_attn, m->tok_embedding.w, d_inputs, N, c.vocab_size, D, s);
    model_rmsnorm_forward(m, nullptr, first.attn_norm, first.attn_rstd, first.resid_attn, nullptr, m->layers[0].attn_norm,
                          m->layers[0].wqkv, N);
    for (int l = 0; l < L; l++) {
        NvtxRange layer_range(strprintf("layer %d", l));
        LayerActs la = model_layer_acts(m, l);
        const LayerParams& w = m->layers[l];
        // attention block (resid_attn and attn_norm, or its FP8 cast, were written by the previous layer's last step)
        linear_forward(m, la.qkv, la.attn_norm, w.wqkv, N);
        if (c.qkv_clip > 0.0f) qkv_clip_forward(la.qkv, la.qkv_clip_mask, (size_t)N * model_local_qkv_dim(m), c.qkv_clip, s);
        if (c.qk_norm)
            qk_norm_forward(la.qkv, la.qk_norm_x, la.qk_norm_rstd, w.qk_norm.w, N, m->n_heads, m->n_kv_heads, c.head_dim,
                            c.norm_eps, s);
        // --fp8-attention in an FP8 layer: RoPE and the attention's FP8 cast in one pass, then the FP8 forward
        const bool fp8_attention = m->fp8_options.attention && model_layer_fp8(m, l);
        AttentionFp8Inputs att8{};
        if (fp8_attention)
            att8 = rope_forward_attention_fp8(la.qkv, m->rope_cos, m->rope_sin, a.att_fp8, B, T, m->n_heads, m->n_kv_heads,
                                              c.head_dim, s);
        else
            rope_forward(la.qkv, m->rope_cos, m->rope_sin, B, T, m->n_heads, m->n_kv_heads, c.head_dim, s);
        {
            ProfileRange range(PHASE_ATTN_FWD, s, "attention forward");
            if (fp8_attention)
                attention_forward_fp8_cast_done(la.att, la.lse, att8, B, T, m->n_heads, m->n_kv_heads, c.head_dim, s);
            else
                attention_forward(la.att, la.lse, la.qkv, B, T, m->n_heads, m->n_kv_heads, c.head_dim, s);
        }
        linear_forward(m, a.branch, la.att, w.wo, N);
        model_tp_all_reduce(m, a.branch, (size_t)N * D);   // row-parallel: the sum of the ranks' heads
        model_rmsnorm_forward(m, la.resid_ffn, la.ffn_norm, la.ffn_rstd, la.resid_attn, a.branch, w.ffn_norm, w.w_gate_up, N);
        // feed-forward block
        linear_forward(m, la.gate_up, la.ffn_norm, w.w_gate_up, N);
        model_swiglu_forward(m, la.swiglu, la.gate_up, w.w_down, N);
        linear_forward(m, a.branch, la.swiglu, w.w_down, N);
        model_tp_all_reduce(m, a.branch, (size_t)N * D);   // row-parallel: the sum of the ranks' FFN slices
        // the residual add, fused with the next norm: the next layer's attn_norm, or the final norm
        if (l + 1 < L) {
            LayerActs next = model_layer_acts(m, l + 1);
            model_rmsnorm_forward(m, next.resid_attn, next.attn_norm, next.attn_rstd, la.resid_ffn, a.branch,
                                  m->layers[l + 1].attn_norm, m->layers[l + 1].wqkv, N);
        } else {
            rmsnorm_forward(a.resid_final, a.final_norm, a.final_rstd, la.resid_ffn, a.branch, m->final_norm.w, N, D, c.norm_eps, s);
        }
    }
}

// lm_head_cross_entropy's tensors for the loss only: the final norm's output, lm_head, d_targets, acts.losses.
inline LmHeadLoss model_lm_head_loss(Model* m, const int* d_targets) {
    LmHeadLoss t;
    t.x = m->acts.final_norm;
    t.lm_head = m->lm_head.w;
    t.targets = d_targets;
    t.losses = m->acts.losses;
    t.logits = m->acts.logits;
    t.chunk = m->ce_chunk;
    return t;
}

// The mean of acts.losses[0..N) into acts.loss_mean (on the GPU; nothing waits).
inline void model_loss_mean(Model* m, int N) {
    ProfileRange range(PHASE_LOSS, m->stream, "loss mean");
    loss_mean_kernel<<<1, LOSS_MEAN_THREADS, 0, m->stream>>>(m->acts.loss_mean, m->acts.losses, N);
    cudaCheckLaunch();
}
// acts.loss_mean on the host (waits for the stream).
inline float model_read_loss(Model* m) {
    float mean;
    cudaCheck(cudaMemcpyAsync(&mean, m->acts.loss_mean, sizeof(float), cudaMemcpyDeviceToHost, m->stream));
    cudaCheck(cudaStreamSynchronize(m->stream));
    return mean;
}

// Forward + backward of one micro-batch of B x T tokens (device int arrays). Accumulates into m->grads
// grad_scale * d(sum of token losses)/dparam (grad_scale = 1/(B*T*accum) gives the mean), or writes them
// after model_zero_grads; the mean loss of the micro-batch goes to acts.loss_mean. Only launches on m->stream,
// never waits for the GPU: a CUDA graph can capture it (model_graph_launch; the first micro-batch of a step
// writes the gradients and the others add, so they are two graphs). Delayed FP8 scaling: after a step's last
// micro-batch, model_fp8_record_amax.
inline void model_micro_batch(Model* m, const int* d_inputs, const int* d_targets, float grad_scale) {
    const ModelConfig& c = m->config;
    ModelActivations& a = m->acts;
    const int B = m->B, T = m->T, N = B * T, D = c.dim;
    cudaStream_t s = m->stream;
    m->fp8.training = true;
    model_forward(m, d_inputs, B, T);
    LmHeadLoss ce = model_lm_head_loss(m, d_targets);
    ce.dlogits = a.dlogits;   // and the gradients: of the final norm's output, of lm_head
    ce.dx = a.dnorm;
    ce.dlm_head = m->lm_head.grad;
    lm_head_cross_entropy(&m->matmul, ce, N, D, c.vocab_size, grad_scale, s, m->accumulate_grads);
    NvtxRange nvtx("backward");
    {   // dresid: the gradient of the residual stream, from the top down
        ProfileRange range(PHASE_OTHER, s, "zero dresid");
        cudaCheck(cudaMemsetAsync(a.dresid, 0, (size_t)N * D * sizeof(bf16), s));
    }
    rmsnorm_backward(a.dresid, m->final_norm.grad, a.norm_scratch, a.dnorm, a.resid_final, a.final_rstd, m->final_norm.w, N, D, s,
                     m->accumulate_grads);
    for (int l = c.n_layers - 1; l >= 0; l--) {
        NvtxRange layer_range(strprintf("layer %d", l));
        LayerActs la = model_layer_acts(m, l);
        const LayerParams& w = m->layers[l];
        // feed-forward block: its output (w_down's) was added to the stream, so its gradient is dresid
        linear_backward(m, a.dswiglu, a.dresid, la.swiglu, w.w_down, N);
        model_swiglu_backward(m, a.dgate_up, a.dswiglu, la.gate_up, w.w_gate_up, N);
        linear_backward(m, a.dnorm, a.dgate_up, la.ffn_norm, w.w_gate_up, N);
        model_tp_all_reduce(m, a.dnorm, (size_t)N * D);   // column-parallel: every rank's slice fed this input
        rmsnorm_backward(a.dresid, w.ffn_norm.grad, a.norm_scratch, a.dnorm, la.resid_ffn, la.ffn_rstd, w.ffn_norm.w, N, D, s,
                         m->accumulate_grads);
        // attention block
        linear_backward(m, a.datt, a.dresid, la.att, w.wo, N);
        {
            ProfileRange range(PHASE_ATTN_BWD, s, "attention backward");
            attention_backward(a.dqkv, a.att_scratch, a.datt, la.qkv, la.att, la.lse, B, T, m->n_heads, m->n_kv_heads,
                               c.head_dim, s);
        }
        model_rope_backward(m, a.dqkv, w.wqkv, B, T);
        if (c.qk_norm)
            qk_norm_backward(a.dqkv, w.qk_norm.grad, a.qk_norm_scratch, la.qk_norm_x, la.qk_norm_rstd, w.qk_norm.w, N, m->n_heads,
                             m->n_kv_heads, c.head_dim, s, m->accumulate_grads);
        if (c.qkv_clip > 0.0f) qkv_clip_backward(a.dqkv, la.qkv_clip_mask, (size_t)N * model_local_qkv_dim(m), s);
        linear_backward(m, a.dnorm, a.dqkv, la.attn_norm, w.wqkv, N);
        model_tp_all_reduce(m, a.dnorm, (size_t)N * D);
        rmsnorm_backward(a.dresid, w.attn_norm.grad, a.norm_scratch, a.dnorm, la.resid_attn, la.attn_rstd, w.attn_norm.w, N, D, s,
                         m->accumulate_grads);
    }
    embedding_backward(m->tok_embedding.grad, a.dresid, d_inputs, N, c.vocab_size, D, a.emb_scratch, s);
    m->accumulate_grads = true;   // every gradient has been written: the next micro-batch adds
    m->fp8.training = false;
    model_loss_mean(m, N);
}
// model_micro_batch, then its mean loss on the host (waits for the stream).
inline float model_forward_backward(Model* m, const int* d_inputs, const int* d_targets, float grad_scale) {
    model_micro_batch(m, d_inputs, d_targets, grad_scale);
    return model_read_loss(m);
}

// A CUDA graph of a model's work: `enqueue` (launches on m->stream only, no host synchronization) is captured the
// first time `key` comes, then replayed: one launch instead of thousands, no host work per kernel. A graph keeps
// the arguments its kernels had at capture (buffers, shapes, options, scalars, the FP8 health pointers), so a key
// must always stand for the same work; train_fp8.cu's micro-batches are (it runs eagerly the first micro-batch,
// which loads every kernel and makes every GEMM plan, the profiled step and --fp8-stats steps). Thread-local
// capture: the other ranks' threads go on meanwhile.
// Returns whether this launch captured the graph (its time then includes the capture).
inline bool model_graph_launch(Model* m, int key, const std::function<void()>& enqueue) {
    auto it = m->graphs.find(key);
    const bool capture = it == m->graphs.end();
    if (capture) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        cudaCheck(cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeThreadLocal));
        enqueue();
        cudaCheck(cudaStreamEndCapture(m->stream, &graph));
        cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
        cudaCheck(cudaGraphDestroy(graph));
        it = m->graphs.emplace(key, exec).first;
    }
    cudaCheck(cudaGraphLaunch(it->second, m->stream));
    return capture;
}

// Evaluation: the mean loss over B x T tokens (B, T at most the allocated ones), no gradients.
inline float model_loss(Model* m, const int* d_inputs, const int* d_targets, int B, int T) {
    const ModelConfig& c = m->config;
    model_forward(m, d_inputs, B, T);
    lm_head_cross_entropy(&m->matmul, model_lm_head_loss(m, d_targets), B * T, c.dim, c.vocab_size, 1.0f, m->stream);
    model_loss_mean(m, B * T);
    return model_read_loss(m);
}

// All logits [B*T, V] FP32 into d_logits (sampling, tests). Waits for the stream.
inline void model_logits(Model* m, const int* d_inputs, int B, int T, float* d_logits) {
    const ModelConfig& c = m->config;
    model_forward(m, d_inputs, B, T);
    matmul(&m->matmul, d_logits, DT_FP32, {m->acts.final_norm, DT_BF16}, {m->lm_head.w, DT_BF16},
           B * T, c.vocab_size, c.dim, false, false, m->stream);
    cudaCheck(cudaStreamSynchronize(m->stream));
}

// ----------------------------------------------------------------------------------------------
// 7. Tensor parallelism over NCCL: one process, one host thread per GPU, one communicator per GPU (both made in
// train_fp8.cu, tp_groups_create). The parameters are split as section 2 says; per layer and micro-batch:
//   forward   all-reduce (sum, BF16) of the outputs of wo and w_down (row-parallel) before the residual add
//   backward  all-reduce (sum, BF16) of the input gradients of w_gate_up and wqkv (column-parallel)
// After these every rank holds the same bits of the residual stream, the norms, lm_head's logits, the loss and
// the residual stream's gradient, and so of the gradients of the replicated tensors (embedding, norms,
// lm_head): those are not all-reduced; the optimizer makes the same update of the same numbers on every rank,
// which keeps the replicated weights identical. The gradient norm counts them once (adamw_fp8.cuh).
// FP8: every rank scales its own shards (its own Fp8Meta); --tp-amax-sync takes the MAX of the sharded
// tensors' amaxes over the group instead (model_amax_group), so that every rank uses the scale the unsharded
// tensor would get.

// The layout of tp_size ranks, one line per rank, for the start-up print.
inline std::string model_tp_layout(const ModelConfig& c, int tp_size) {
    const int nh = c.n_heads / tp_size, nkv = c.n_kv_heads / tp_size, f = c.ffn_dim / tp_size;
    std::vector<TensorSpec> specs = model_param_specs(c, tp_size);
    size_t total = model_num_params(c, tp_size), replicated = 0;
    for (size_t i = 0; i < specs.size(); i++)
        if (!model_param_sharded(c, (int)i)) replicated += specs[i].numel;
    std::string s = strprintf("tensor parallel: %d rank%s through NCCL (GPU r = rank r); wqkv, w_gate_up column-parallel, wo, "
                              "w_down row-parallel; embedding, norms, lm_head replicated (%zu parameters on every rank)\n",
                              tp_size, tp_size > 1 ? "s" : "", replicated);
    for (int r = 0; r < tp_size; r++)
        s += strprintf("  rank %d: query heads [%d, %d), KV heads [%d, %d), FFN [%d, %d), %zu parameters (%zu sharded)\n", r,
                       r * nh, (r + 1) * nh, r * nkv, (r + 1) * nkv, r * f, (r + 1) * f, total, total - replicated);
    return s;
}
