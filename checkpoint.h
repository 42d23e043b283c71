// checkpoint.h: what a run leaves on the disk. The checkpoint format and the checks that a file can continue a run;
// checkpoint files, written durably and verified before they are read; the run's CSV logs; and the export of a
// checkpoint's weights for transformers and llama2.c.
// Sections:
//   1. the checkpoint header   the format, its checksums (XXH64), checked
//   2. checkpoint files        written durably (temporary name, fsync, rename, fsync of the folder), the newest K
//                              kept, verified before they are read; the run's CSV logs
//   3. export                  HF safetensors + config.json, llama2.c model.bin + tokenizer.bin (host only)
// Part of the training program: train_fp8.cu includes it after its command line (its section 1), whose TrainOptions,
// model presets, size limits and path helpers the checks here use.
#pragma once
#include "llama2.cuh"
#include "adamw_fp8.cuh"
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <functional>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

// ----------------------------------------------------------------------------------------------
// 1. Checkpoints: the format.
// DIR/ckpt-STEP.bin (STEP in 8 digits, one file per checkpoint; DIR/latest names the newest: section 2),
// little-endian, version 2.
//   bytes 0..255   CheckpointHeader (below; offsets in the comments)
//     0  u32  magic 0x38504654 (the bytes "TFP8")        4  u32  version (2)
//     8  u32  build precision: 8 = PRECISION=FP8, 16 = PRECISION=BF16
//    12  u32  header size in bytes (256)
//    16  i32 x 8  ModelConfig: vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq_len
//    48  f32 x 2  ModelConfig: norm_eps, rope_theta
//    56  i32 x 2  batch B, sequence length T          64  i64  total batch (tokens per step)
//    72  u64  seed (init and data order)              80  i64  optimizer steps done (the run goes on at step+1)
//    88  i64  non-finite steps skipped so far         96  i64  of them, in a row at the end
//   104  u64 x 2  train data loader state: epoch, batch position within the epoch
//   120  u64  sampling RNG state (splitmix64)        128  u64  number of parameters N
//   136  i32 x 3  FP8 recipe: amax history length, quantization interval, FP8 in all layers (0/1)
//   148  u32  bytes of one Fp8Meta                   152  u64  number K of model Fp8Meta per rank (FP8 build 12 L, BF16 0)
//   160  u32  P, the tensor-parallel size that wrote the file
//   164  i32  FP8 fast accumulation in the forward GEMMs (--fp8-fast-accum)     168  i32  --tp-amax-sync (0/1)
//   172  u32  zero                                   176  u64  payload bytes S: the file is 256 + S bytes long
//   184  u64  XXH64 (seed 0) of the payload, bytes 256 .. 256+S-1
//   192  f32  --qkv-clip C (0 = off)                 196  i32  --qk-norm (0/1)
//   200  i32  --amax-warmup N                        204  i32  --wd-constant-lr (0/1)
//   208  f32  --smooth-quant ALPHA (0 = off)         212  i32  --fp8-attention (0/1)
//   216  i32  --update-clip (0/1)                    220  i32  --adam-atan2 (0/1)
//   (files from before these eight flags hold zeros in 192..223: all off)
//   224  i32  --scaling block (0 = tensor, 1 = block)  228  i32  --block-scale-pow2 (0/1)
//   232  i32  --dy-format e4m3 (0 = E5M2, 1 = E4M3)
//   (files from before these three flags hold zeros in 224..235: per-tensor scaling, E5M2 dY)
//   236  i32  --bf16-linears (0/1; files from before it hold zero: FP8 linears)
//   240  i32  --block-dw-x blocks (0 = tiles, 1 = blocks; files from before it hold zero: tiles)
//   244..247  zero
//   248  u64  XXH64 (seed 0) of the header's bytes 0..247
// The payload at P = 1:
//   256    the optimizer state as adamw_save writes it (adamw_fp8.cuh, section 6): its 40-byte header ("ADMW",
//          version, m and v types, tensor count, optimizer step, N, a hash of the tensor layout), then from byte
//          296 the FP32 master weights (N x f32, in the order of model_param_specs), m, v, and the per-tensor
//          Fp8Meta of each FP8 moment.
//   then   K x Fp8Meta: the scales of the model's FP8 linears (X, W, dY of wqkv, wo, w_gate_up, w_down of each
//          layer, llama2.cuh's ModelFp8::metas; the amax histories of delayed scaling); the file ends there.
// The payload at P > 1 (tensor parallelism):
//   256    the whole FP32 master weights, N x f32 in the order of model_param_specs (the shards put back)
//   then   P optimizer states as adamw_save writes them, rank 0 first: each rank's shard (its master weights
//          again, m, v and their per-shard FP8 scales), in model_param_specs(c, P) order
//   then   P x K Fp8Meta: each rank's FP8 scales, rank 0 first; the file ends there.
// Resuming at the same P restores every rank's state exactly (the resumed run equals the uninterrupted one).
// Resuming at another P (a P = 1 file included) reads the whole master weights and cuts them for the new
// shards, exactly; the moments and the FP8 scale records are per shard (an FP8 moment's scale belongs to the
// shard's amax, and the new shards cut across the old ones) and start over, with a warning: moments zero,
// Adam's bias correction from step 1, FP8 scales from the first casts. The alternative, whole FP32 moments in
// the file, would reshard exactly too but costs 8 more bytes per parameter in every checkpoint and still loses
// the FP8 moments' own rounding; a change of TP size is rare, so it pays the warm restart instead. The P > 1
// layout stores the master weights twice (whole for resharding, per rank for an exact same-P resume):
// 4 bytes per parameter more than P = 1.
// A resumed run must match the checkpoint in everything that decides the numbers of the next step:
// build precision, model config (--qk-norm and --qkv-clip included), B, T, total batch, seed, the FP8 recipe
// (--amax-warmup, --smooth-quant, --scaling, --block-scale-pow2, --dy-format and --block-dw-x included), fast accumulation, amax sync, the update rule (--update-clip,
// --adam-atan2) and --wd-constant-lr; --init only shaped the weights of step 0, which the checkpoint holds; --steps,
// --lr, the schedule, --weight-decay and --grad-clip are hyperparameters that may change (the schedule is a function
// of the step), though changing them breaks the equality with an uninterrupted run.
constexpr uint32_t CKPT_MAGIC = 0x38504654;   // "TFP8" as little-endian bytes
constexpr uint32_t CKPT_VERSION = 2;
constexpr uint32_t BUILD_PRECISION = BUILD_FP8 ? 8 : 16;

struct CheckpointHeader {
    uint32_t magic, version, precision, header_bytes;
    int32_t vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq_len;
    float norm_eps, rope_theta;
    int32_t batch, seq;
    int64_t total_batch;
    uint64_t seed;
    int64_t step, bad_steps, bad_in_row;
    uint64_t loader_epoch, loader_position;
    uint64_t sample_rng;
    uint64_t num_params;
    int32_t amax_history, quant_interval, fp8_all_layers;
    uint32_t fp8_meta_bytes;
    uint64_t fp8_meta_count;
    uint32_t tp_size;
    int32_t fp8_fast_accum, tp_amax_sync;
    uint32_t zero0;
    uint64_t payload_bytes, payload_xxh64;
    float qkv_clip;
    int32_t qk_norm, amax_warmup, wd_constant_lr;
    float smooth_quant;
    int32_t fp8_attention;
    int32_t update_clip, adam_atan2;
    int32_t block_scaling, block_scale_pow2, dy_e4m3;
    int32_t bf16_linears;
    int32_t block_dw_x_blocks;
    uint8_t reserved[4];
    uint64_t header_xxh64;
};
static_assert(sizeof(CheckpointHeader) == 256 && offsetof(CheckpointHeader, vocab_size) == 16 &&
              offsetof(CheckpointHeader, norm_eps) == 48 && offsetof(CheckpointHeader, batch) == 56 &&
              offsetof(CheckpointHeader, total_batch) == 64 && offsetof(CheckpointHeader, step) == 80 &&
              offsetof(CheckpointHeader, loader_epoch) == 104 && offsetof(CheckpointHeader, sample_rng) == 120 &&
              offsetof(CheckpointHeader, num_params) == 128 && offsetof(CheckpointHeader, amax_history) == 136 &&
              offsetof(CheckpointHeader, fp8_meta_bytes) == 148 && offsetof(CheckpointHeader, fp8_meta_count) == 152 &&
              offsetof(CheckpointHeader, tp_size) == 160 && offsetof(CheckpointHeader, fp8_fast_accum) == 164 &&
              offsetof(CheckpointHeader, tp_amax_sync) == 168 && offsetof(CheckpointHeader, payload_bytes) == 176 &&
              offsetof(CheckpointHeader, payload_xxh64) == 184 && offsetof(CheckpointHeader, qkv_clip) == 192 &&
              offsetof(CheckpointHeader, qk_norm) == 196 && offsetof(CheckpointHeader, amax_warmup) == 200 &&
              offsetof(CheckpointHeader, wd_constant_lr) == 204 && offsetof(CheckpointHeader, smooth_quant) == 208 &&
              offsetof(CheckpointHeader, fp8_attention) == 212 && offsetof(CheckpointHeader, update_clip) == 216 &&
              offsetof(CheckpointHeader, adam_atan2) == 220 && offsetof(CheckpointHeader, block_scaling) == 224 &&
              offsetof(CheckpointHeader, block_scale_pow2) == 228 && offsetof(CheckpointHeader, dy_e4m3) == 232 &&
              offsetof(CheckpointHeader, bf16_linears) == 236 && offsetof(CheckpointHeader, block_dw_x_blocks) == 240 &&
              offsetof(CheckpointHeader, reserved) == 244 &&
              offsetof(CheckpointHeader, header_xxh64) == 248,
              "the checkpoint header's layout is the one documented above");

// ---- XXH64, the checksum (xxHash's 64-bit hash, written from its specification): four 64-bit lanes eat 32-byte
// stripes (lane = rotl(lane + input * P2, 31) * P1), then the lanes are merged, the tail of fewer than 32 bytes
// mixed in, and the result avalanched. Streaming: update() any number of times, then digest(). A flipped bit
// anywhere changes the result; about 3 GB/s on one CPU core (a 45 GB 7B checkpoint: ~15 s).
constexpr uint64_t XXH_P1 = 0x9E3779B185EBCA87ull, XXH_P2 = 0xC2B2AE3D27D4EB4Full, XXH_P3 = 0x165667B19E3779F9ull,
                   XXH_P4 = 0x85EBCA77C2B2AE63ull, XXH_P5 = 0x27D4EB2F165667C5ull;
struct Xxh64 {
    uint64_t seed, lanes[4], total;
    unsigned char tail[32];   // bytes of a stripe not yet complete
    size_t tail_len;
};
inline uint64_t xxh64_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t xxh64_round(uint64_t lane, uint64_t input) { return xxh64_rotl(lane + input * XXH_P2, 31) * XXH_P1; }
inline uint64_t xxh64_read64(const unsigned char* p) { uint64_t v; memcpy(&v, p, 8); return v; }   // little-endian hosts
// `count` stripes from p (the lanes in registers meanwhile); returns the end.
inline const unsigned char* xxh64_stripes(Xxh64* s, const unsigned char* p, size_t count) {
    uint64_t v0 = s->lanes[0], v1 = s->lanes[1], v2 = s->lanes[2], v3 = s->lanes[3];
    for (size_t i = 0; i < count; i++, p += 32) {
        v0 = xxh64_round(v0, xxh64_read64(p));
        v1 = xxh64_round(v1, xxh64_read64(p + 8));
        v2 = xxh64_round(v2, xxh64_read64(p + 16));
        v3 = xxh64_round(v3, xxh64_read64(p + 24));
    }
    s->lanes[0] = v0; s->lanes[1] = v1; s->lanes[2] = v2; s->lanes[3] = v3;
    return p;
}
inline Xxh64 xxh64_begin(uint64_t seed = 0) {
    return Xxh64{seed, {seed + XXH_P1 + XXH_P2, seed + XXH_P2, seed, seed - XXH_P1}, 0, {}, 0};
}
inline void xxh64_update(Xxh64* s, const void* data, size_t n) {
    const unsigned char* p = (const unsigned char*)data;
    s->total += n;
    if (s->tail_len > 0) {   // complete the stripe the last call began
        size_t take = std::min(n, 32 - s->tail_len);
        memcpy(s->tail + s->tail_len, p, take);
        s->tail_len += take;
        p += take;
        n -= take;
        if (s->tail_len < 32) return;
        xxh64_stripes(s, s->tail, 1);
        s->tail_len = 0;
    }
    p = xxh64_stripes(s, p, n / 32);
    s->tail_len = n % 32;
    memcpy(s->tail, p, s->tail_len);
}
inline uint64_t xxh64_digest(const Xxh64& s) {
    uint64_t h;
    if (s.total >= 32) {
        h = xxh64_rotl(s.lanes[0], 1) + xxh64_rotl(s.lanes[1], 7) + xxh64_rotl(s.lanes[2], 12) + xxh64_rotl(s.lanes[3], 18);
        for (int i = 0; i < 4; i++) h = (h ^ xxh64_round(0, s.lanes[i])) * XXH_P1 + XXH_P4;
    } else {
        h = s.seed + XXH_P5;
    }
    h += s.total;
    const unsigned char* p = s.tail;
    size_t n = s.tail_len;
    for (; n >= 8; p += 8, n -= 8) h = xxh64_rotl(h ^ xxh64_round(0, xxh64_read64(p)), 27) * XXH_P1 + XXH_P4;
    if (n >= 4) {
        uint32_t w;
        memcpy(&w, p, 4);
        h = xxh64_rotl(h ^ (w * XXH_P1), 23) * XXH_P2 + XXH_P3;
        p += 4;
        n -= 4;
    }
    for (; n > 0; p++, n--) h = xxh64_rotl(h ^ (*p * XXH_P5), 11) * XXH_P1;
    h ^= h >> 33;
    h *= XXH_P2;
    h ^= h >> 29;
    h *= XXH_P3;
    h ^= h >> 32;
    return h;
}
inline uint64_t xxh64(const void* data, size_t n, uint64_t seed = 0) {
    Xxh64 s = xxh64_begin(seed);
    xxh64_update(&s, data, n);
    return xxh64_digest(s);
}
inline uint64_t checkpoint_header_xxh64(const CheckpointHeader& h) { return xxh64(&h, offsetof(CheckpointHeader, header_xxh64)); }

// The header this build and these options would write (run-state fields and checksums zero).
inline CheckpointHeader checkpoint_header_for(const ModelConfig& c, const TrainOptions& o) {
    CheckpointHeader h;
    memset(&h, 0, sizeof(h));
    h.magic = CKPT_MAGIC;
    h.version = CKPT_VERSION;
    h.precision = BUILD_PRECISION;
    h.header_bytes = sizeof(CheckpointHeader);
    h.vocab_size = c.vocab_size; h.dim = c.dim; h.n_layers = c.n_layers; h.n_heads = c.n_heads;
    h.n_kv_heads = c.n_kv_heads; h.head_dim = c.head_dim; h.ffn_dim = c.ffn_dim; h.max_seq_len = c.max_seq_len;
    h.norm_eps = c.norm_eps; h.rope_theta = c.rope_theta;
    h.batch = o.batch; h.seq = o.seq; h.total_batch = o.total_batch; h.seed = (uint64_t)o.seed;
    h.num_params = model_num_params(c);
    h.amax_history = o.amax_history;
    h.quant_interval = o.quant_interval;
    h.fp8_all_layers = o.fp8_all_layers ? 1 : 0;
    h.fp8_meta_bytes = sizeof(Fp8Meta);
    h.fp8_meta_count = BUILD_PRECISION == 8 ? (uint64_t)c.n_layers * 4 * 3 : 0;   // 4 linears per layer, X W dY each (per rank)
    h.tp_size = (uint32_t)std::max(1, o.tp);
    h.fp8_fast_accum = o.fp8_fast_accum;
    h.tp_amax_sync = o.tp_amax_sync ? 1 : 0;
    h.qkv_clip = c.qkv_clip;
    h.qk_norm = c.qk_norm ? 1 : 0;
    h.amax_warmup = o.amax_warmup;
    h.wd_constant_lr = o.wd_constant_lr ? 1 : 0;
    h.smooth_quant = o.smooth_quant;
    h.fp8_attention = o.fp8_attention ? 1 : 0;
    h.update_clip = o.update_clip ? 1 : 0;
    h.adam_atan2 = o.adam_atan2 ? 1 : 0;
    h.block_scaling = o.scaling == "block" ? 1 : 0;
    h.block_scale_pow2 = o.block_scale_pow2 ? 1 : 0;
    h.dy_e4m3 = o.dy_format == "e4m3" ? 1 : 0;
    h.bf16_linears = o.bf16_linears ? 1 : 0;
    h.block_dw_x_blocks = o.block_dw_x == "blocks" ? 1 : 0;
    return h;
}

inline ModelConfig checkpoint_model_config(const CheckpointHeader& h) {
    return ModelConfig{h.vocab_size, h.dim, h.n_layers, h.n_heads, h.n_kv_heads, h.head_dim, h.ffn_dim, h.max_seq_len,
                       h.norm_eps, h.rope_theta, h.qk_norm != 0, h.qkv_clip};
}

// "" if a checkpoint with header `got` (verified: section 2) can continue the run described by `want`, else the reason.
inline std::string checkpoint_header_check(const CheckpointHeader& got, const CheckpointHeader& want, const char* path) {
    auto precision_name = [](uint32_t p) { return p == 8 ? "PRECISION=FP8" : p == 16 ? "PRECISION=BF16" : "unknown"; };
    if (got.precision != want.precision)
        return strprintf("%s: written by a %s build (code %u), this is a %s build; resume with the build that wrote it",
                         path, precision_name(got.precision), got.precision, precision_name(want.precision));
    struct Field { const char* name; long long got, want; };
    const Field fields[] = {
        {"vocab_size (from the data)", got.vocab_size, want.vocab_size}, {"dim (--dim)", got.dim, want.dim},
        {"n_layers (--layers)", got.n_layers, want.n_layers}, {"n_heads (--heads)", got.n_heads, want.n_heads},
        {"n_kv_heads (--kv-heads)", got.n_kv_heads, want.n_kv_heads}, {"head_dim", got.head_dim, want.head_dim},
        {"ffn_dim (--ffn)", got.ffn_dim, want.ffn_dim}, {"max_seq_len", got.max_seq_len, want.max_seq_len},
        {"batch (--batch)", got.batch, want.batch}, {"seq (--seq)", got.seq, want.seq},
        {"total batch (--total-batch)", got.total_batch, want.total_batch}, {"seed (--seed)", (long long)got.seed, (long long)want.seed},
        {"QK normalisation (--qk-norm)", got.qk_norm, want.qk_norm},
        {"number of parameters", (long long)got.num_params, (long long)want.num_params},
        {"FP8 amax history (--amax-history)", got.amax_history, want.amax_history},
        {"FP8 quantization interval (--quant-interval)", got.quant_interval, want.quant_interval},
        {"FP8 in all layers (--fp8-all-layers)", got.fp8_all_layers, want.fp8_all_layers},
        {"FP8 attention (--fp8-attention)", got.fp8_attention, want.fp8_attention},
        {"FP8 fast accumulation (--fp8-fast-accum)", got.fp8_fast_accum, want.fp8_fast_accum},
        {"FP8 amax MAX over the TP group (--tp-amax-sync)", got.tp_amax_sync, want.tp_amax_sync},
        {"FP8 amax warm-up steps (--amax-warmup)", got.amax_warmup, want.amax_warmup},
        {"FP8 block scaling (--scaling block)", got.block_scaling, want.block_scaling},
        {"FP8 power-of-two block scales (--block-scale-pow2)", got.block_scale_pow2, want.block_scale_pow2},
        {"FP8 E4M3 output gradients (--dy-format e4m3)", got.dy_e4m3, want.dy_e4m3},
        {"FP8 dW's X^T in 128x128 blocks (--block-dw-x blocks)", got.block_dw_x_blocks, want.block_dw_x_blocks},
        {"every linear in BF16 (--bf16-linears)", got.bf16_linears, want.bf16_linears},
        {"weight decay at the peak LR (--wd-constant-lr)", got.wd_constant_lr, want.wd_constant_lr},
        {"update clipping (--update-clip)", got.update_clip, want.update_clip},
        {"the Adam-atan2 update (--adam-atan2)", got.adam_atan2, want.adam_atan2},
        {"Fp8Meta size in bytes", got.fp8_meta_bytes, want.fp8_meta_bytes},
        {"number of FP8 scale records", (long long)got.fp8_meta_count, (long long)want.fp8_meta_count},
    };
    for (const Field& f : fields)
        if (f.got != f.want)
            return strprintf("%s: the checkpoint has %s = %lld, this run has %lld; resume with the flags of the run that wrote it",
                             path, f.name, f.got, f.want);
    if (got.norm_eps != want.norm_eps || got.rope_theta != want.rope_theta)
        return strprintf("%s: the checkpoint has norm_eps %g and rope_theta %g, this model %g and %g", path,
                         got.norm_eps, got.rope_theta, want.norm_eps, want.rope_theta);
    const struct { const char* name; float got, want; } floats[] = {
        {"QKV clipping (--qkv-clip)", got.qkv_clip, want.qkv_clip}, {"SmoothQuant alpha (--smooth-quant)", got.smooth_quant, want.smooth_quant}};
    for (const auto& f : floats)
        if (f.got != f.want)
            return strprintf("%s: the checkpoint has %s = %g, this run has %g; resume with the flags of the run that wrote it", path,
                             f.name, f.got, f.want);
    return "";
}

// Reads the header of `path` into *h: "" or the reason (missing, not a checkpoint, shorter than a header).
inline std::string checkpoint_read_header(const char* path, CheckpointHeader* h) {
    FILE* f = fopen(path, "rb");
    if (!f) return strprintf("cannot open checkpoint %s: %s", path, strerror(errno));
    memset(h, 0, sizeof(*h));
    size_t got = fread(h, 1, sizeof(*h), f);
    fclose(f);
    if (got >= sizeof(h->magic) && h->magic != CKPT_MAGIC)
        return strprintf("%s: not a train_fp8 checkpoint (magic 0x%08x, expected 0x%08x \"TFP8\")", path, h->magic, CKPT_MAGIC);
    if (got != sizeof(*h)) return strprintf("%s: %zu bytes, shorter than the %zu-byte checkpoint header", path, got, sizeof(*h));
    return "";
}

// "" if the fields of a header whose checksum matched (its payload_bytes the file's) can describe a checkpoint, else
// each field at fault, its value and its bound: not a file this program wrote, or a defective writer (the checksum only
// says that the bytes are the ones written). Every number is bounded before it sizes an allocation or a loop: each size
// within the program's limits (train_fp8.cu, section 1), the floats finite, and the model's FP32 master weights (4
// bytes a parameter) within the payload, which bounds vocab_size and n_layers. The fields that stand alone are each
// named (of the integer bounds the first that fails: a bound may use the fields above it); the model, its size and the
// batch once they pass.
inline std::string checkpoint_header_problem(const CheckpointHeader& h) {
    std::vector<std::string> problems;
    if (h.header_bytes != sizeof(CheckpointHeader))
        problems.push_back(strprintf("header_bytes %u: must be %zu", h.header_bytes, sizeof(CheckpointHeader)));
    if (h.precision != 8 && h.precision != 16)
        problems.push_back(strprintf("precision %u: must be 8 (PRECISION=FP8) or 16 (PRECISION=BF16)", h.precision));
    int preset_seq = 0;   // the longest preset's max_seq_len; a run's is that of its preset, or --seq if longer
    for (const char* name : TRAIN_MODEL_PRESETS) preset_seq = std::max(preset_seq, model_config_preset(name, BYTE_VOCAB).max_seq_len);
    struct Bound { const char* field; long long value, lo, hi; std::string why; };
    const Bound bounds[] = {   // in order: a bound may use the fields above it
        {"tp_size", h.tp_size, 1, 1024, "the range of --tp"},
        {"dim", h.dim, 16, MAX_CAST_TRANSPOSE_ROWS, "the rows of a weight"},
        {"n_heads", h.n_heads, 1, std::max(1, h.dim / 64), strprintf("dim %d / 64: a head is 64 or 128 wide", h.dim)},
        {"n_kv_heads", h.n_kv_heads, 1, h.n_heads, "n_heads"},
        {"ffn_dim", h.ffn_dim, 16, MAX_CAST_TRANSPOSE_ROWS / 2, "w_gate_up has 2 x ffn_dim rows, at most the rows of a weight"},
        {"vocab_size", h.vocab_size, 16, INT_MAX, "a positive multiple of 16"},
        {"n_layers", h.n_layers, 1, INT_MAX, "at least one"},
        {"batch", h.batch, 1, INT_MAX, "at least one sequence"},
        {"seq", h.seq, 16, MAX_CAST_TRANSPOSE_ROWS, "the tokens of a micro-batch"},
        {"max_seq_len", h.max_seq_len, 1, std::max(preset_seq, h.seq), "the longest preset's or the run's --seq, whichever is longer"},
    };
    for (const Bound& b : bounds)
        if (b.value < b.lo || b.value > b.hi) {
            problems.push_back(strprintf("%s %lld: must be in [%lld, %lld] (%s)", b.field, b.value, b.lo, b.hi, b.why.c_str()));
            break;
        }
    const struct { const char* field; float value; bool ok; const char* bound; } floats[] = {
        {"norm_eps", h.norm_eps, std::isfinite(h.norm_eps) && h.norm_eps > 0.0f, "finite and > 0"},
        {"rope_theta", h.rope_theta, std::isfinite(h.rope_theta) && h.rope_theta > 0.0f, "finite and > 0"},
        {"qkv_clip", h.qkv_clip, std::isfinite(h.qkv_clip) && h.qkv_clip >= 0.0f, "finite and >= 0 (0 = off)"},
        {"smooth_quant", h.smooth_quant, h.smooth_quant >= 0.0f && h.smooth_quant <= 1.0f, "in [0, 1] (0 = off)"},
    };
    for (const auto& f : floats)
        if (!f.ok) problems.push_back(strprintf("%s %g: must be %s", f.field, f.value, f.bound));
    if (!problems.empty()) {
        std::string list;
        for (const std::string& q : problems) list += (list.empty() ? "" : "; ") + q;
        return list;
    }
    const ModelConfig c = checkpoint_model_config(h);
    std::string problem = model_config_problem(c);
    if (problem.empty()) problem = model_tp_problem(c, (int)h.tp_size);
    if (!problem.empty()) return problem;
    // Parameters per layer and per vocabulary entry, from the parameter table of one and two small models of this shape.
    ModelConfig one = c, two = c, wide = c;
    one.n_layers = 1, one.vocab_size = 16;
    two.n_layers = 2, two.vocab_size = 16;
    wide.n_layers = 1, wide.vocab_size = 32;
    const uint64_t layer = model_num_params(two) - model_num_params(one), entry = (model_num_params(wide) - model_num_params(one)) / 16;
    const uint64_t rest = model_num_params(one) - layer - 16 * entry, fits = h.payload_bytes / sizeof(float);
    if (rest + layer + 16 * entry > fits)
        return strprintf("dim %d, n_heads %d, ffn_dim %d: one layer is %llu parameters, more FP32 master weights than the "
                         "payload of %llu bytes holds", h.dim, h.n_heads, h.ffn_dim, (unsigned long long)layer,
                         (unsigned long long)h.payload_bytes);
    const uint64_t vocab_max = (fits - rest - layer) / entry, layers_max = (fits - rest - entry * std::min<uint64_t>(h.vocab_size, vocab_max)) / layer;
    if ((uint64_t)h.vocab_size > vocab_max || (uint64_t)h.n_layers > layers_max) {
        const bool vocab = (uint64_t)h.vocab_size > vocab_max;
        return strprintf("%s %d: at most %llu, the most whose FP32 master weights the payload of %llu bytes holds (4 bytes a "
                         "parameter, %llu per %s)", vocab ? "vocab_size" : "n_layers", vocab ? h.vocab_size : h.n_layers,
                         (unsigned long long)(vocab ? vocab_max : layers_max), (unsigned long long)h.payload_bytes,
                         (unsigned long long)(vocab ? entry : layer), vocab ? "vocabulary entry" : "layer");
    }
    if (h.num_params != model_num_params(c))
        return strprintf("num_params %llu: its model has %llu", (unsigned long long)h.num_params, (unsigned long long)model_num_params(c));
    const int64_t bt = (int64_t)h.batch * h.seq;
    if (h.total_batch < bt || h.total_batch % bt != 0)
        return strprintf("total_batch %lld: must be a positive multiple of batch x seq = %lld", (long long)h.total_batch, (long long)bt);
    return "";
}

// ----------------------------------------------------------------------------------------------
// 2. Checkpoint files, and the run's CSV logs.
// Every file is written durably: to NAME.tmp, flushed to the disk (fsync), renamed over NAME, then the folder
// flushed too (the rename is a change of the folder), so that a crash at any moment leaves the old file or the new
// one, whole. A checkpoint is ckpt-STEP.bin; DIR/latest, one line, names the newest; --keep-checkpoints K removes
// the older files beyond the newest K, after the new one and `latest` are on the disk. A checkpoint is read only
// after checkpoint_verify: its size is the one its header gives, and both checksums match.

constexpr size_t CKPT_IO_CHUNK = 16u << 20;

inline std::string checkpoint_file_name(long step) { return strprintf("ckpt-%08ld.bin", step); }
// The copy of the data's tokenizer that a run keeps in its folder DIR (none for bytes), for a resume and export.
inline std::string run_tokenizer_path(const std::string& dir) { return dir + "/tokenizer.model"; }
// The step of a checkpoint file's name ("ckpt-<digits>.bin"), or false.
inline bool checkpoint_file_step(const std::string& name, long* step) {
    if (name.size() < 10 || name.size() > 24 || name.compare(0, 5, "ckpt-") != 0 || name.compare(name.size() - 4, 4, ".bin") != 0)
        return false;
    for (size_t i = 5; i < name.size() - 4; i++) if (!isdigit((unsigned char)name[i])) return false;
    *step = strtol(name.c_str() + 5, nullptr, 10);
    return true;
}

// mkdir -p
inline void make_dirs(const std::string& dir) {
    for (size_t i = 1; i <= dir.size(); i++) {
        if (i < dir.size() && dir[i] != '/') continue;
        std::string part = dir.substr(0, i);
        if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) fail("cannot create folder %s: %s", part.c_str(), strerror(errno));
    }
}

inline void fsync_folder(const std::string& dir) {
    int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (fd < 0 || fsync(fd) != 0) fail("cannot flush folder %s to the disk: %s", dir.c_str(), strerror(errno));
    close(fd);
}

inline void write_bytes(FILE* f, const void* data, size_t bytes, const std::string& path) {
    if (bytes > 0 && fwrite(data, 1, bytes, f) != bytes) fail("writing %s failed: %s (disk full?)", path.c_str(), strerror(errno));
}

// The temporary file that write_file_durably is filling ("" between writes). An exit before its rename (an error:
// fail() exits from inside the writers) removes it, so that a failed write leaves no partial file, which on a full disk
// holds the space a retry needs.
inline std::string& durable_write_in_progress() {
    static std::string* tmp = new std::string();   // never destroyed: the exit handler may run after static destructors
    return *tmp;
}
inline void remove_durable_write_in_progress() {
    if (!durable_write_in_progress().empty()) remove(durable_write_in_progress().c_str());
}

// Writes `path` durably: write(f, tmp_path) fills PATH.tmp (opened for writing and reading), then fsync, rename over
// `path`, fsync of the folder. An error is fatal, leaves `path` as it was and removes PATH.tmp. Checkpoints, `latest`,
// a log cut back on resume and export's files are all written through it.
inline void write_file_durably(const std::string& path, const std::function<void(FILE*, const std::string&)>& write) {
    static const bool removed_at_exit = atexit(remove_durable_write_in_progress) == 0;
    if (!removed_at_exit) fail("atexit failed: a failed write could leave its temporary file behind");
    const std::string tmp = path + ".tmp";
    FILE* f = fopen(tmp.c_str(), "w+b");
    if (!f) fail("cannot write %s: %s", tmp.c_str(), strerror(errno));
    durable_write_in_progress() = tmp;
    write(f, tmp);
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) fail("writing %s failed: %s (disk full?)", tmp.c_str(), strerror(errno));
    if (fclose(f) != 0) fail("closing %s failed: %s", tmp.c_str(), strerror(errno));
    if (rename(tmp.c_str(), path.c_str()) != 0) fail("cannot rename %s to %s: %s", tmp.c_str(), path.c_str(), strerror(errno));
    durable_write_in_progress().clear();
    fsync_folder(path_folder(path));
}
inline void write_text_durably(const std::string& path, const std::string& text) {
    write_file_durably(path, [&](FILE* f, const std::string& tmp) { write_bytes(f, text.data(), text.size(), tmp); });
}

// XXH64 of the next `bytes` bytes of f; false if the file ends first.
inline bool xxh64_file_range(FILE* f, uint64_t bytes, uint64_t* hash) {
    Xxh64 s = xxh64_begin();
    std::vector<unsigned char> buffer(CKPT_IO_CHUNK);
    for (uint64_t done = 0; done < bytes;) {
        size_t n = (size_t)std::min<uint64_t>(buffer.size(), bytes - done);
        if (fread(buffer.data(), 1, n, f) != n) return false;
        xxh64_update(&s, buffer.data(), n);
        done += n;
    }
    *hash = xxh64_digest(s);
    return true;
}

// Removes DIR's checkpoint files beyond the newest `keep` of those up to `step`; files of later steps (left by a run
// that went on past the checkpoint this one resumed from) stay, and are replaced as this run reaches their steps.
// Returns the names removed.
inline std::vector<std::string> checkpoint_remove_old(const std::string& dir, long step, int keep) {
    std::vector<std::pair<long, std::string>> files;
    DIR* d = opendir(dir.c_str());
    if (!d) fail("cannot list folder %s: %s", dir.c_str(), strerror(errno));
    for (dirent* e = readdir(d); e; e = readdir(d)) {
        long s;
        if (checkpoint_file_step(e->d_name, &s) && s <= step) files.push_back({s, e->d_name});
    }
    closedir(d);
    std::sort(files.rbegin(), files.rend());   // newest first
    std::vector<std::string> removed;
    for (size_t i = (size_t)keep; i < files.size(); i++) {
        std::string path = dir + "/" + files[i].second;
        if (remove(path.c_str()) != 0) fail("cannot remove the old checkpoint %s: %s", path.c_str(), strerror(errno));
        removed.push_back(files[i].second);
    }
    if (!removed.empty()) fsync_folder(dir);
    return removed;
}

// Writes DIR/ckpt-STEP.bin (STEP = h.step): the header, the payload that write_payload(f, tmp_path) puts after it,
// and into the header the payload's size and checksum, read back from the file, and the header's checksum; then
// DIR/latest; then removes the checkpoints beyond the newest `keep` (0: none). Returns the checkpoint's path.
inline std::string checkpoint_write(const std::string& dir, CheckpointHeader h, int keep,
                                    const std::function<void(FILE*, const std::string&)>& write_payload) {
    const std::string name = checkpoint_file_name((long)h.step), path = dir + "/" + name;
    write_file_durably(path, [&](FILE* f, const std::string& tmp) {
        h.payload_bytes = h.payload_xxh64 = h.header_xxh64 = 0;
        write_bytes(f, &h, sizeof(h), tmp);
        write_payload(f, tmp);
        if (fflush(f) != 0) fail("writing %s failed: %s (disk full?)", tmp.c_str(), strerror(errno));
        h.payload_bytes = (uint64_t)ftello(f) - sizeof(h);
        if (fseeko(f, sizeof(h), SEEK_SET) != 0 || !xxh64_file_range(f, h.payload_bytes, &h.payload_xxh64))
            fail("%s: cannot read back the %llu bytes just written", tmp.c_str(), (unsigned long long)h.payload_bytes);
        h.header_xxh64 = checkpoint_header_xxh64(h);
        if (fseeko(f, 0, SEEK_SET) != 0) fail("%s: cannot seek to its header: %s", tmp.c_str(), strerror(errno));
        write_bytes(f, &h, sizeof(h), tmp);
    });
    write_file_durably(dir + "/latest", [&](FILE* f, const std::string& tmp) { write_bytes(f, (name + "\n").data(), name.size() + 1, tmp); });
    if (keep > 0)
        for (const std::string& old : checkpoint_remove_old(dir, (long)h.step, keep))
            printf("checkpoint: removed %s/%s (--keep-checkpoints %d)\n", dir.c_str(), old.c_str(), keep);
    return path;
}

// The checkpoint file that `where` names: a file, or a run's folder (the file its `latest` names; a folder of the
// version 1 layout has ckpt.bin instead, which checkpoint_verify then refuses by its version). "" or the reason.
inline std::string checkpoint_resolve(const std::string& where, std::string* path) {
    struct stat st;
    if (stat(where.c_str(), &st) != 0) return strprintf("%s: no such checkpoint file or run folder (%s)", where.c_str(), strerror(errno));
    if (S_ISREG(st.st_mode)) {
        *path = where;
        return "";
    }
    if (!S_ISDIR(st.st_mode)) return strprintf("%s: neither a checkpoint file nor a run folder", where.c_str());
    const std::string latest = where + "/latest";
    FILE* f = fopen(latest.c_str(), "rb");
    if (!f) {
        *path = where + "/ckpt.bin";
        if (stat(path->c_str(), &st) == 0) return "";
        return strprintf("%s holds no checkpoint (no %s): nothing to resume or export there", where.c_str(), latest.c_str());
    }
    char line[256] = {0};
    bool read = fgets(line, sizeof(line), f) != nullptr;
    fclose(f);
    std::string name = read ? std::string(line, strcspn(line, "\n")) : "";
    long step;
    if (!checkpoint_file_step(name, &step))
        return strprintf("%s does not name a checkpoint (ckpt-STEP.bin): damaged; name a checkpoint file of %s instead",
                         latest.c_str(), where.c_str());
    *path = where + "/" + name;
    if (stat(path->c_str(), &st) != 0)
        return strprintf("%s names %s, which is missing (%s): name another checkpoint file of %s", latest.c_str(), name.c_str(),
                         strerror(errno), where.c_str());
    return "";
}

// The moment types of checkpoint `path` (header h, its checksums verified), from rank 0's optimizer state, which must
// be there: at the start of the payload (P = 1) or after the whole master weights (P > 1), an AdamW state of a shard's
// parameters with known moment types. "" or the reason.
inline std::string checkpoint_moment_types(const std::string& path, const CheckpointHeader& h, DType* m, DType* v) {
    const uint64_t at = sizeof(CheckpointHeader) + (h.tp_size > 1 ? h.num_params * sizeof(float) : 0);
    const uint64_t shard = model_num_params(checkpoint_model_config(h), (int)h.tp_size);
    AdamWFileHeader a = {};
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) return strprintf("cannot open checkpoint %s: %s", path.c_str(), strerror(errno));
    const bool read = fseeko(f, (off_t)at, SEEK_SET) == 0 && fread(&a, sizeof(a), 1, f) == 1;
    fclose(f);
    if (!read || a.magic != ADAMW_MAGIC || a.num_params != shard || a.m_dtype > DT_E5M2 || a.v_dtype > DT_E5M2)
        return strprintf("%s: a payload with a valid checksum but invalid contents (no optimizer state of %llu parameters with "
                         "known moment types at byte %llu: magic 0x%08x, %llu parameters, moment types %u and %u): written "
                         "by a defective build; use another checkpoint", path.c_str(), (unsigned long long)shard,
                         (unsigned long long)at, a.magic, (unsigned long long)a.num_params, a.m_dtype, a.v_dtype);
    *m = (DType)a.m_dtype;
    *v = (DType)a.v_dtype;
    return "";
}

// The payload bytes of a checkpoint of header h (valid) with moments of types m and v, as section 1 lays it out: P
// optimizer states of a shard each (master weights, m, v, each FP8 moment's per-tensor scales; after the whole master
// weights if P > 1), then P x K FP8 scale records.
inline uint64_t checkpoint_payload_bytes(const CheckpointHeader& h, DType m, DType v) {
    const ModelConfig c = checkpoint_model_config(h);
    const int P = (int)h.tp_size;
    const uint64_t shard = model_num_params(c, P), tensors = model_param_specs(c, P).size();
    const uint64_t state = sizeof(AdamWFileHeader) + shard * (sizeof(float) + dtype_size(m) + dtype_size(v)) +
                           ((dtype_is_fp8(m) ? tensors : 0) + (dtype_is_fp8(v) ? tensors : 0)) * h.fp8_meta_bytes;
    return (P > 1 ? h.num_params * sizeof(float) : 0) + P * (state + h.fp8_meta_count * h.fp8_meta_bytes);
}

// Reads and checks checkpoint `path` whole before anything of it is used: the header (magic, version, its checksum),
// the file's size against the header's, the header's contents (checkpoint_header_problem), the payload's checksum, and
// the payload's size against the model's. "" or the reason, naming the file and the bytes or the field at fault.
inline std::string checkpoint_verify(const std::string& path, CheckpointHeader* h) {
    const char* p = path.c_str();
    std::string err = checkpoint_read_header(p, h);
    if (!err.empty()) return err;
    if (h->version == 1)
        return strprintf("%s: a version 1 checkpoint (from before checksums and step-numbered files); this build reads "
                         "version %u only: resume or export it with the train_fp8 that wrote it", p, CKPT_VERSION);
    if (h->version != CKPT_VERSION)
        return strprintf("%s: checkpoint format version %u, this build reads version %u (a newer train_fp8 wrote it?)", p,
                         h->version, CKPT_VERSION);
    const uint64_t header_sum = checkpoint_header_xxh64(*h);
    if (header_sum != h->header_xxh64)
        return strprintf("%s: bytes 0 to %zu (the header) do not match their checksum (stored %016llx, computed %016llx): the "
                         "file is damaged; use another checkpoint", p, offsetof(CheckpointHeader, header_xxh64) - 1,
                         (unsigned long long)h->header_xxh64, (unsigned long long)header_sum);
    struct stat st;
    if (stat(p, &st) != 0) return strprintf("cannot open checkpoint %s: %s", p, strerror(errno));
    const uint64_t size = (uint64_t)st.st_size, want = sizeof(CheckpointHeader) + h->payload_bytes;
    if (h->payload_bytes > size - sizeof(CheckpointHeader))
        return strprintf("%s: %llu bytes, its header says %llu (256 + %llu of payload): truncated, bytes %llu to %llu are "
                         "missing; use another checkpoint", p, (unsigned long long)size, (unsigned long long)want,
                         (unsigned long long)h->payload_bytes, (unsigned long long)size, (unsigned long long)want - 1);
    if (size > want)
        return strprintf("%s: %llu bytes, its header says %llu: bytes %llu to %llu are extra; damaged file", p,
                         (unsigned long long)size, (unsigned long long)want, (unsigned long long)want, (unsigned long long)size - 1);
    auto invalid_contents = [p](const std::string& problem) {
        return strprintf("%s: a header with a valid checksum but invalid contents (%s): not a checkpoint this program wrote, "
                         "or written by a defective build; use another checkpoint", p, problem.c_str());
    };
    const std::string problem = checkpoint_header_problem(*h);
    if (!problem.empty()) return invalid_contents(problem);
    FILE* f = fopen(p, "rb");
    if (!f) return strprintf("cannot open checkpoint %s: %s", p, strerror(errno));
    uint64_t payload_sum = 0;
    bool whole = fseeko(f, sizeof(CheckpointHeader), SEEK_SET) == 0 && xxh64_file_range(f, h->payload_bytes, &payload_sum);
    fclose(f);
    if (!whole) return strprintf("%s: cannot read bytes 256 to %llu", p, (unsigned long long)want - 1);
    if (payload_sum != h->payload_xxh64)
        return strprintf("%s: bytes 256 to %llu (the payload: weights, optimizer state, FP8 scales) do not match their "
                         "checksum (stored %016llx, computed %016llx): the file is damaged; use another checkpoint (the run "
                         "folder keeps the newest --keep-checkpoints of them)", p, (unsigned long long)want - 1,
                         (unsigned long long)h->payload_xxh64, (unsigned long long)payload_sum);
    DType m = DT_FP32, v = DT_FP32;
    err = checkpoint_moment_types(path, *h, &m, &v);
    if (!err.empty()) return err;
    const uint64_t model_bytes = checkpoint_payload_bytes(*h, m, v);
    if (h->payload_bytes != model_bytes)
        return invalid_contents(strprintf("payload_bytes %llu: its model at tp %u with moments %s and %s takes %llu",
                                          (unsigned long long)h->payload_bytes, h->tp_size, dtype_name(m), dtype_name(v),
                                          (unsigned long long)model_bytes));
    return "";
}

// "" if the optimizer state of checkpoint `path` (header h, verified) can continue a run of P ranks with moments of
// `run`'s types: at the TP size that wrote it the moments are read as they are, so their types must be the run's; at
// another they start over (train_create_ranks), in any types.
inline std::string checkpoint_moments_check(const std::string& path, const CheckpointHeader& h, const AdamWConfig& run, int P) {
    if (h.tp_size != (uint32_t)P) return "";
    DType m = DT_FP32, v = DT_FP32;
    std::string err = checkpoint_moment_types(path, h, &m, &v);
    if (!err.empty()) return err;
    if (m != run.m_dtype || v != run.v_dtype)
        return strprintf("%s: its AdamW moments are --m-dtype %s --v-dtype %s, this run has --m-dtype %s --v-dtype %s: resume "
                         "with the moment types of the run that wrote it", path.c_str(), moment_dtype_flag(m).c_str(),
                         moment_dtype_flag(v).c_str(), moment_dtype_flag(run.m_dtype).c_str(), moment_dtype_flag(run.v_dtype).c_str());
    return "";
}

// Bytes of one optimizer state as adamw_save writes it.
inline size_t adamw_saved_bytes(const AdamW* opt) {
    size_t bytes = sizeof(AdamWFileHeader);
    for (const AdamWPart& part : adamw_state_parts(opt)) bytes += part.bytes;
    return bytes;
}

// Writes checkpoint DIR/ckpt-STEP.bin of the run (header h, its step set) and keeps the newest `keep` (section 1 has
// the payload). opts[r] and models[r] are rank r's (one of each without TP), their streams idle; h.tp_size ==
// opts.size(). Returns the file's path.
inline std::string checkpoint_save(const std::string& dir, const CheckpointHeader& h, int keep,
                                   const std::vector<const AdamW*>& opts, const std::vector<Model*>& models) {
    const int P = (int)opts.size();
    if ((int)h.tp_size != P) fail("checkpoint_save: the header says tp_size %u, %d ranks given", h.tp_size, P);
    return checkpoint_write(dir, h, keep, [&](FILE* f, const std::string& tmp) {
        if (P > 1) {   // the whole master weights: every rank's shard put back in its place
            const ModelConfig& c = models[0]->config;
            std::vector<float> whole(h.num_params), shard(opts[0]->num_params);
            for (int r = 0; r < P; r++) {
                cudaCheck(cudaMemcpy(shard.data(), opts[r]->master, shard.size() * sizeof(float), cudaMemcpyDeviceToHost));
                model_copy_shard(c, P, r, whole.data(), shard.data(), false);
            }
            write_bytes(f, whole.data(), whole.size() * sizeof(float), tmp);
        }
        for (const AdamW* opt : opts) adamw_save(opt, f, tmp.c_str());
        std::vector<Fp8Meta> metas(h.fp8_meta_count);
        for (Model* model : models) {
            if (metas.empty()) break;
            cudaCheck(cudaMemcpy(metas.data(), model->fp8.metas, metas.size() * sizeof(Fp8Meta), cudaMemcpyDeviceToHost));
            write_bytes(f, metas.data(), metas.size() * sizeof(Fp8Meta), tmp);
        }
    });
}

// Resume at the TP size that wrote the file (header h, verified): rank `rank` of the model's tp_size reads its
// optimizer state into opt, sets the model's weights from its master weights, then puts its saved FP8 scales over
// the ones that rebuilding the FP8 weight copies just wrote, so that every scale, amax history and counter is the
// uninterrupted run's. Runs on the rank's thread (its GPU current).
inline void checkpoint_load_rank(const std::string& path, const CheckpointHeader& h, AdamW* opt, Model* model, int rank) {
    const int P = model->tp_size;
    const long whole = P > 1 ? (long)(h.num_params * sizeof(float)) : 0L, state = (long)adamw_saved_bytes(opt);
    const long metas_bytes = (long)(h.fp8_meta_count * sizeof(Fp8Meta)), start = (long)sizeof(CheckpointHeader) + whole;
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) fail("cannot open checkpoint %s: %s", path.c_str(), strerror(errno));
    if (fseek(f, start + rank * state, SEEK_SET) != 0) fail("%s: cannot seek to rank %d's optimizer state", path.c_str(), rank);
    adamw_load(opt, f, path.c_str());
    adamw_export_weights(opt, model->weights, model->stream);
    model_weights_changed(model);
    cudaCheck(cudaStreamSynchronize(model->stream));
    std::vector<Fp8Meta> metas(h.fp8_meta_count);
    if (fseek(f, start + P * state + rank * metas_bytes, SEEK_SET) != 0) fail("%s: cannot seek to rank %d's FP8 scales", path.c_str(), rank);
    if (!metas.empty()) {
        if (fread(metas.data(), sizeof(Fp8Meta), metas.size(), f) != metas.size())
            fail("%s: the FP8 scales end early (truncated file)", path.c_str());
        cudaCheck(cudaMemcpy(model->fp8.metas, metas.data(), metas.size() * sizeof(Fp8Meta), cudaMemcpyHostToDevice));
    }
    if (rank == P - 1 && fgetc(f) != EOF)
        fail("%s: bytes after the FP8 scales: damaged file, or written by another version", path.c_str());
    fclose(f);
}

// The byte of a checkpoint (header h, verified: its optimizer states are where checkpoint_verify found them) at which
// the whole FP32 master weights begin, whatever TP size wrote it: at P = 1 after the AdamW state's header, at P > 1
// right after the checkpoint header.
inline uint64_t checkpoint_master_offset(const CheckpointHeader& h) {
    return sizeof(CheckpointHeader) + (h.tp_size > 1 ? 0 : sizeof(AdamWFileHeader));
}

// The whole FP32 master weights of checkpoint `path` (header h, verified), for resuming at another TP size (the
// caller cuts them into the new shards). Host only.
inline std::vector<float> checkpoint_read_master(const std::string& path, const CheckpointHeader& h) {
    const uint64_t offset = checkpoint_master_offset(h);
    std::vector<float> master(h.num_params);
    const int fd = open(path.c_str(), O_RDONLY);
    const bool ok = fd >= 0 && read_exact(fd, master.data(), master.size() * sizeof(float), offset);
    if (fd >= 0) close(fd);
    if (!ok) fail("%s: the master weights end early (truncated file)", path.c_str());
    return master;
}

// A run's CSV log DIR/NAME (first line `header`, then one row per line starting with its step), opened for appending.
// A new run (keep_through_step < 0) starts it over. A resumed run keeps the rows up to its checkpoint's step and drops
// the later ones (a run that went on past that checkpoint wrote them, and this run writes those steps again) by
// rewriting the file durably, so that the log of a resumed run equals an uninterrupted run's. A last line without its
// newline (a crash in the middle of a row) is dropped too.
inline FILE* open_run_csv(const std::string& dir, const char* name, const char* header, long keep_through_step) {
    const std::string path = dir + "/" + name;
    std::string kept = std::string(header) + "\n", text;
    FILE* old = keep_through_step >= 0 ? fopen(path.c_str(), "rb") : nullptr;
    if (old) {
        char buffer[1 << 16];
        for (size_t n; (n = fread(buffer, 1, sizeof(buffer), old)) > 0;) text.append(buffer, n);
        fclose(old);
    }
    for (size_t start = 0, end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
        const std::string line = text.substr(start, end - start);
        if (start == 0) {
            if (line != header)
                fail("%s: its columns are '%s', this build writes '%s': move the file away, or resume into another --out",
                     path.c_str(), line.c_str(), header);
            continue;
        }
        char* after = nullptr;
        long step = strtol(line.c_str(), &after, 10);
        if (after != line.c_str() && *after == ',' && step <= keep_through_step) kept += line + "\n";
    }
    write_file_durably(path, [&](FILE* f, const std::string& tmp) { write_bytes(f, kept.data(), kept.size(), tmp); });
    FILE* f = fopen(path.c_str(), "a");
    if (!f) fail("cannot write %s: %s", path.c_str(), strerror(errno));
    return f;
}

// ----------------------------------------------------------------------------------------------
// 3. Export: a checkpoint's FP32 master weights, read on the host (no GPU needed), as
//   --format hf       OUT_DIR/config.json and OUT_DIR/model.safetensors (BF16 or FP32): transformers' LlamaForCausalLM;
//                     with the run's tokenizer (RUN/tokenizer.model beside the checkpoint) also its files for AutoTokenizer:
//                     tokenizer.model, tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json
//   --format llama2c  OUT_DIR/model.bin, llama2.c's run.c format (7 x int32 config, then FP32 weights in its order),
//                     and OUT_DIR/tokenizer.bin: the run's tokenizer's pieces (tokenizer_llama2c_bin), or for a
//                     byte-level model its 256 tokens, token i the byte i
// RoPE. Ours (Meta's LLaMA code, llama2.c) rotates each adjacent pair (2i, 2i+1) of a head by pos * theta^(-2i/HD);
// transformers' rotate_half rotates (i, i + HD/2) by the same angle. Putting row 2i of each head of wq and wk at row
// i and row 2i+1 at HD/2 + i turns one into the other: q and k come out in the new order, each rotated pair where
// rotate_half expects it, and q.k sums the same products. llama2.c's convention is ours: its weights are copied as
// they are. wqkv splits into q_proj, k_proj, v_proj (llama2.c: wq, wk, wv), w_gate_up into gate_proj and up_proj
// (llama2.c: w1 and w3).

// One exported tensor: row i is row rows[i] of a row-major FP32 source `cols` wide (a 1-D tensor: one row), either
// in the checkpoint file from byte `offset` on (src null: the master weights) or in host memory at src (the RoPE tables).
struct ExportTensor {
    std::string name;
    std::vector<int64_t> shape;
    uint64_t offset;
    const float* src;
    int cols;
    std::vector<int> rows;
};
inline std::vector<int> export_row_range(int first, int count) {
    std::vector<int> rows(count);
    for (int i = 0; i < count; i++) rows[i] = first + i;
    return rows;
}
// The rows first .. first + heads*HD - 1 (a Q or K block of wqkv), each head's rows from adjacent pairs to halves.
inline std::vector<int> export_rope_rows_to_halves(int first, int heads, int HD) {
    std::vector<int> rows;
    for (int h = 0; h < heads; h++)
        for (int r = 0; r < HD; r++) rows.push_back(first + h * HD + (r < HD / 2 ? 2 * r : 2 * (r - HD / 2) + 1));
    return rows;
}
// Tensor `param` of the master weights that begin at byte `master` of the checkpoint (laid out by `specs`,
// model_param_specs): a matrix, its rows `rows` (default all).
inline ExportTensor export_matrix(const std::vector<TensorSpec>& specs, uint64_t master, int param, const std::string& name,
                                  std::vector<int> rows = {}) {
    const TensorSpec& s = specs[param];
    if (rows.empty()) rows = export_row_range(0, s.rows);
    return ExportTensor{name, {(int64_t)rows.size(), s.cols}, master + s.offset * sizeof(float), nullptr, s.cols, rows};
}
inline ExportTensor export_vector(const std::vector<TensorSpec>& specs, uint64_t master, int param, const std::string& name) {
    const TensorSpec& s = specs[param];
    return ExportTensor{name, {(int64_t)s.numel}, master + s.offset * sizeof(float), nullptr, (int)s.numel, {0}};
}

// transformers' names, q_proj and k_proj in rotate_half order; the master weights at byte `master` of the checkpoint.
inline std::vector<ExportTensor> export_tensors_hf(const ModelConfig& c, uint64_t master) {
    const int HD = c.head_dim, QD = c.n_heads * HD, KVD = c.n_kv_heads * HD, F = c.ffn_dim;
    const std::vector<TensorSpec> specs = model_param_specs(c);
    std::vector<ExportTensor> t = {export_matrix(specs, master, PARAM_TOK_EMBEDDING, "model.embed_tokens.weight")};
    for (int l = 0; l < c.n_layers; l++) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        t.push_back(export_vector(specs, master, param_layer(l, ATTN_NORM), p + "input_layernorm.weight"));
        t.push_back(export_matrix(specs, master, param_layer(l, WQKV), p + "self_attn.q_proj.weight", export_rope_rows_to_halves(0, c.n_heads, HD)));
        t.push_back(export_matrix(specs, master, param_layer(l, WQKV), p + "self_attn.k_proj.weight", export_rope_rows_to_halves(QD, c.n_kv_heads, HD)));
        t.push_back(export_matrix(specs, master, param_layer(l, WQKV), p + "self_attn.v_proj.weight", export_row_range(QD + KVD, KVD)));
        t.push_back(export_matrix(specs, master, param_layer(l, WO), p + "self_attn.o_proj.weight"));
        t.push_back(export_vector(specs, master, param_layer(l, FFN_NORM), p + "post_attention_layernorm.weight"));
        t.push_back(export_matrix(specs, master, param_layer(l, W_GATE_UP), p + "mlp.gate_proj.weight", export_row_range(0, F)));
        t.push_back(export_matrix(specs, master, param_layer(l, W_GATE_UP), p + "mlp.up_proj.weight", export_row_range(F, F)));
        t.push_back(export_matrix(specs, master, param_layer(l, W_DOWN), p + "mlp.down_proj.weight"));
    }
    t.push_back(export_vector(specs, master, param_final_norm(c), "model.norm.weight"));
    t.push_back(export_matrix(specs, master, param_lm_head(c), "lm_head.weight"));
    return t;
}

// llama2.c's order (run.c, memory_map_weights): each kind of tensor for all layers in turn; the RoPE tables
// [max_seq_len, HD/2] (rope_cos, rope_sin) that older run.c versions read and newer ones skip; lm_head last (unshared).
inline std::vector<ExportTensor> export_tensors_llama2c(const ModelConfig& c, uint64_t master, const float* rope_cos,
                                                        const float* rope_sin) {
    const int QD = c.n_heads * c.head_dim, KVD = c.n_kv_heads * c.head_dim, F = c.ffn_dim;
    const std::vector<TensorSpec> specs = model_param_specs(c);
    std::vector<ExportTensor> t = {export_matrix(specs, master, PARAM_TOK_EMBEDDING, "token_embedding_table")};
    auto each_layer = [&](const char* name, const std::function<ExportTensor(int, const std::string&)>& one) {
        for (int l = 0; l < c.n_layers; l++) t.push_back(one(l, strprintf("%s[%d]", name, l)));
    };
    each_layer("rms_att_weight", [&](int l, const std::string& n) { return export_vector(specs, master, param_layer(l, ATTN_NORM), n); });
    each_layer("wq", [&](int l, const std::string& n) { return export_matrix(specs, master, param_layer(l, WQKV), n, export_row_range(0, QD)); });
    each_layer("wk", [&](int l, const std::string& n) { return export_matrix(specs, master, param_layer(l, WQKV), n, export_row_range(QD, KVD)); });
    each_layer("wv", [&](int l, const std::string& n) { return export_matrix(specs, master, param_layer(l, WQKV), n, export_row_range(QD + KVD, KVD)); });
    each_layer("wo", [&](int l, const std::string& n) { return export_matrix(specs, master, param_layer(l, WO), n); });
    each_layer("rms_ffn_weight", [&](int l, const std::string& n) { return export_vector(specs, master, param_layer(l, FFN_NORM), n); });
    each_layer("w1", [&](int l, const std::string& n) { return export_matrix(specs, master, param_layer(l, W_GATE_UP), n, export_row_range(0, F)); });
    each_layer("w2", [&](int l, const std::string& n) { return export_matrix(specs, master, param_layer(l, W_DOWN), n); });
    each_layer("w3", [&](int l, const std::string& n) { return export_matrix(specs, master, param_layer(l, W_GATE_UP), n, export_row_range(F, F)); });
    t.push_back(export_vector(specs, master, param_final_norm(c), "rms_final_weight"));
    const int table_cols = c.head_dim / 2;
    t.push_back(ExportTensor{"freq_cis_real", {c.max_seq_len, table_cols}, 0, rope_cos, table_cols, export_row_range(0, c.max_seq_len)});
    t.push_back(ExportTensor{"freq_cis_imag", {c.max_seq_len, table_cols}, 0, rope_sin, table_cols, export_row_range(0, c.max_seq_len)});
    t.push_back(export_matrix(specs, master, param_lm_head(c), "wcls"));
    return t;
}

inline uint64_t export_tensor_bytes(const ExportTensor& t, bool as_bf16) { return (uint64_t)t.rows.size() * t.cols * (as_bf16 ? 2 : 4); }

// The tensor's rows into f (the file `path`), as FP32 or as BF16 (round to nearest even, as torch's
// .to(torch.bfloat16)). Rows from the checkpoint `ckpt` (open as fd) are read a run of consecutive ones at a time, at
// most chunk_bytes (or one row): the memory of an export is that chunk, whatever the size of the model.
inline void export_write_tensor(FILE* f, const std::string& path, int fd, const std::string& ckpt, const ExportTensor& t,
                                bool as_bf16, size_t chunk_bytes = CKPT_IO_CHUNK) {
    const size_t row_bytes = (size_t)t.cols * sizeof(float);
    std::vector<float> chunk;
    std::vector<bf16> chunk16;
    for (size_t i = 0, n; i < t.rows.size(); i += n) {
        for (n = 1; i + n < t.rows.size() && t.rows[i + n] == t.rows[i] + (int)n && (n + 1) * row_bytes <= chunk_bytes;) n++;
        const float* x;
        if (t.src) {
            x = t.src + (size_t)t.rows[i] * t.cols;
        } else {
            const uint64_t at = t.offset + (uint64_t)t.rows[i] * row_bytes;
            chunk.resize(n * t.cols);
            errno = 0;
            if (!read_exact(fd, chunk.data(), n * row_bytes, at))
                fail("%s: cannot read bytes %llu to %llu (%s): %s", ckpt.c_str(), (unsigned long long)at,
                     (unsigned long long)(at + n * row_bytes - 1), t.name.c_str(), errno ? strerror(errno) : "the file ends early");
            x = chunk.data();
        }
        if (!as_bf16) {
            write_bytes(f, x, n * row_bytes, path);
            continue;
        }
        chunk16.resize(n * t.cols);
        for (size_t k = 0; k < chunk16.size(); k++) chunk16[k] = __float2bfloat16(x[k]);
        write_bytes(f, chunk16.data(), chunk16.size() * sizeof(bf16), path);
    }
}

// x as a JSON number that reads back as the same float: a whole number as such (10000.0), else the shortest
// decimal (1e-05).
inline std::string json_float(float x) {
    if (x == std::floor(x) && std::fabs(x) < 1e15f) return strprintf("%.1f", x);
    std::string s;
    for (int digits = 1; digits <= 9; digits++) {
        s = strprintf("%.*g", digits, x);
        if (strtof(s.c_str(), nullptr) == x) break;
    }
    return s;
}

// safetensors: an 8-byte little-endian length, a JSON header (each tensor's dtype, shape and [begin, end) byte offsets
// in the data that follows; "__metadata__" holds strings), padded with spaces to a multiple of 8, then the data.
inline std::string safetensors_header(const std::vector<ExportTensor>& tensors, bool as_bf16) {
    std::string json = "{\"__metadata__\":{\"format\":\"pt\"}";
    uint64_t offset = 0;
    for (const ExportTensor& t : tensors) {
        std::string shape;
        for (int64_t d : t.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
        const uint64_t bytes = export_tensor_bytes(t, as_bf16);
        json += strprintf(",\"%s\":{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%llu,%llu]}", t.name.c_str(),
                          as_bf16 ? "BF16" : "F32", shape.c_str(), (unsigned long long)offset, (unsigned long long)(offset + bytes));
        offset += bytes;
    }
    json += "}";
    json.append((8 - json.size() % 8) % 8, ' ');
    return json;
}

// A special token's id in JSON, or null: none, or no tokenizer.
inline std::string hf_token_id(const Tokenizer* tok, int id) { return tok && id >= 0 ? std::to_string(id) : "null"; }
// A special token's piece as a JSON string, or null.
inline std::string hf_token_piece(const Tokenizer& tok, int id) { return id >= 0 ? json_string(tok.pieces[id]) : "null"; }

// transformers' config.json of LlamaForCausalLM: untied embeddings, no biases, SiLU, the model's eps and theta; the BOS and
// EOS ids of the tokenizer `tok`, or none (bytes: the data has none).
inline std::string hf_config_json(const ModelConfig& c, bool as_bf16, const Tokenizer* tok) {
    return strprintf(
        "{\n"
        "  \"architectures\": [\"LlamaForCausalLM\"],\n"
        "  \"model_type\": \"llama\",\n"
        "  \"vocab_size\": %d,\n"
        "  \"hidden_size\": %d,\n"
        "  \"intermediate_size\": %d,\n"
        "  \"num_hidden_layers\": %d,\n"
        "  \"num_attention_heads\": %d,\n"
        "  \"num_key_value_heads\": %d,\n"
        "  \"head_dim\": %d,\n"
        "  \"hidden_act\": \"silu\",\n"
        "  \"max_position_embeddings\": %d,\n"
        "  \"rms_norm_eps\": %s,\n"
        "  \"rope_theta\": %s,\n"
        "  \"attention_bias\": false,\n"
        "  \"mlp_bias\": false,\n"
        "  \"tie_word_embeddings\": false,\n"
        "  \"bos_token_id\": %s,\n"
        "  \"eos_token_id\": %s,\n"
        "  \"torch_dtype\": \"%s\"\n"
        "}\n",
        c.vocab_size, c.dim, c.ffn_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.max_seq_len,
        json_float(c.norm_eps).c_str(), json_float(c.rope_theta).c_str(), hf_token_id(tok, tok ? tok->bos_id : -1).c_str(),
        hf_token_id(tok, tok ? tok->eos_id : -1).c_str(), as_bf16 ? "bfloat16" : "float32");
}

// The tokenizer's files for transformers, beside the model (AutoTokenizer.from_pretrained(OUT_DIR)): the model file as it
// is (tokenizer.model: LlamaTokenizer with sentencepiece), tokenizer.json (the tokenizers library, no sentencepiece
// needed: tokenizer_hf_json), the class and special tokens (tokenizer_config.json, special_tokens_map.json: <s> in
// front of a text, as the data has it; legacy: sentencepiece's own handling of text after a special token), and
// generation_config.json with the BOS and EOS ids (generate() stops at EOS).
inline void export_hf_tokenizer(const Tokenizer& tok, const ModelConfig& c, const std::string& out_dir) {
    const std::string bos = hf_token_piece(tok, tok.bos_id), eos = hf_token_piece(tok, tok.eos_id), unk = hf_token_piece(tok, tok.unk_id);
    write_text_durably(out_dir + "/tokenizer.model", tok.file);
    write_text_durably(out_dir + "/tokenizer.json", tokenizer_hf_json(tok));
    write_text_durably(out_dir + "/tokenizer_config.json", strprintf(
        "{\n  \"tokenizer_class\": \"LlamaTokenizer\",\n  \"bos_token\": %s,\n  \"eos_token\": %s,\n  \"unk_token\": %s,\n"
        "  \"pad_token\": null,\n  \"add_bos_token\": %s,\n  \"add_eos_token\": false,\n  \"legacy\": true,\n"
        "  \"clean_up_tokenization_spaces\": false,\n  \"model_max_length\": %d,\n  \"sp_model_kwargs\": {}\n}\n",
        bos.c_str(), eos.c_str(), unk.c_str(), tok.bos_id >= 0 ? "true" : "false", c.max_seq_len));
    write_text_durably(out_dir + "/special_tokens_map.json", strprintf(
        "{\n  \"bos_token\": %s,\n  \"eos_token\": %s,\n  \"unk_token\": %s\n}\n", bos.c_str(), eos.c_str(), unk.c_str()));
    write_text_durably(out_dir + "/generation_config.json", strprintf(
        "{\n  \"bos_token_id\": %s,\n  \"eos_token_id\": %s\n}\n", hf_token_id(&tok, tok.bos_id).c_str(),
        hf_token_id(&tok, tok.eos_id).c_str()));
}

// "" if the export may write into folder `dir`: a new folder, an empty one, or with --force (`force`) one that holds
// files already (the export's own files are replaced, the others stay); else the reason.
inline std::string export_folder_problem(const std::string& dir, bool force) {
    if (dir.empty()) return "OUT_DIR is empty: name the folder to write (it is created if missing)";
    struct stat st;
    if (stat(dir.c_str(), &st) != 0) return "";
    if (!S_ISDIR(st.st_mode)) return strprintf("%s exists and is not a folder: name a new or empty folder for OUT_DIR", dir.c_str());
    DIR* d = opendir(dir.c_str());
    if (!d) return strprintf("cannot list folder %s: %s", dir.c_str(), strerror(errno));
    std::string first;
    for (dirent* e = readdir(d); e && first.empty(); e = readdir(d))
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) first = e->d_name;
    closedir(d);
    if (first.empty() || force) return "";
    return strprintf("%s already holds files (%s, ...): export into a new or empty folder, or add --force to write the "
                     "export's files over the ones there", dir.c_str(), first.c_str());
}

// ./train_fp8 export CKPT OUT_DIR: "" or the reason it cannot (the output folder and the checkpoint are checked whole
// first; nothing is written then). format "hf" or "llama2c", dtype "bf16" or "fp32" (llama2c: fp32), as parse_args
// checked them; force: write into a folder that holds files (export_folder_problem). The weights are read from the
// file tensor by tensor, so a model larger than the host's memory exports too.
inline std::string export_checkpoint(const std::string& ckpt, const std::string& out_dir, const std::string& format,
                                     const std::string& dtype, bool force) {
    std::string path, err = export_folder_problem(out_dir, force);
    if (err.empty()) err = checkpoint_resolve(ckpt, &path);
    CheckpointHeader h;
    if (err.empty()) err = checkpoint_verify(path, &h);
    if (!err.empty()) return err;
    const ModelConfig c = checkpoint_model_config(h);
    const bool llama2c = format == "llama2c", as_bf16 = dtype == "bf16", bytes = c.vocab_size == BYTE_VOCAB;
    if (c.qk_norm)
        return strprintf("%s: trained with --qk-norm; transformers' LlamaForCausalLM and llama2.c's run.c have no normalisation "
                         "of Q and K, so the exported model would compute something else: not exported", path.c_str());
    if (c.qkv_clip > 0.0f)
        return strprintf("%s: trained with --qkv-clip %g; transformers' LlamaForCausalLM and llama2.c's run.c do not clamp the "
                         "QKV projection, so the exported model would compute something else: not exported", path.c_str(), c.qkv_clip);
    if (llama2c && (c.rope_theta != 10000.0f || c.norm_eps != 1e-5f))
        return strprintf("%s: the model has rope_theta %g and norm_eps %g; llama2.c's run.c has 10000 and 1e-5 built in: "
                         "export it with --format hf", path.c_str(), c.rope_theta, c.norm_eps);
    Tokenizer tok;   // the run's (section 2), if it has one
    const std::string tok_path = run_tokenizer_path(path_folder(path));
    const bool has_tok = access(tok_path.c_str(), F_OK) == 0;
    if (has_tok) {
        err = tokenizer_load(&tok, tok_path);
        if (!err.empty()) return err;
        if (16 * ceil_div((long)tok.pieces.size(), 16) != c.vocab_size)
            return strprintf("%s has %zu pieces, but the model of %s has vocabulary %d (the data's, padded to a multiple of 16): "
                             "it is not the tokenizer the model was trained with; put that one there (tokenizer.model)",
                             tok_path.c_str(), tok.pieces.size(), path.c_str(), c.vocab_size);
    }
    const uint64_t master = checkpoint_master_offset(h);
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) return strprintf("cannot open checkpoint %s: %s", path.c_str(), strerror(errno));
    make_dirs(out_dir);
    printf("export: %s (step %lld, %llu parameters)\n", path.c_str(), (long long)h.step, (unsigned long long)h.num_params);
    if (!llama2c) {
        const std::vector<ExportTensor> tensors = export_tensors_hf(c, master);
        const std::string header = safetensors_header(tensors, as_bf16), st = out_dir + "/model.safetensors";
        write_file_durably(st, [&](FILE* f, const std::string& tmp) {
            const uint64_t n = header.size();
            write_bytes(f, &n, 8, tmp);
            write_bytes(f, header.data(), n, tmp);
            for (const ExportTensor& t : tensors) export_write_tensor(f, tmp, fd, path, t, as_bf16);
        });
        close(fd);
        write_text_durably(out_dir + "/config.json", hf_config_json(c, as_bf16, has_tok ? &tok : nullptr));
        printf("wrote %s (%zu tensors, %s) and %s/config.json: LlamaForCausalLM.from_pretrained(\"%s\")%s\n", st.c_str(),
               tensors.size(), dtype.c_str(), out_dir.c_str(), out_dir.c_str(),
               bytes ? "; the model reads bytes: token id = byte value (README.md, Export)" : "");
        if (has_tok) {
            export_hf_tokenizer(tok, c, out_dir);
            printf("wrote the tokenizer of %s: tokenizer.model, tokenizer.json, tokenizer_config.json, special_tokens_map.json, "
                   "generation_config.json: AutoTokenizer.from_pretrained(\"%s\")\n", tok_path.c_str(), out_dir.c_str());
        } else if (!bytes) {
            printf("no tokenizer files: %s holds no tokenizer.model (a run keeps the one of its data there)\n", path_folder(path).c_str());
        }
        return "";
    }
    std::vector<float> rope_cos, rope_sin;
    rope_tables(&rope_cos, &rope_sin, c.max_seq_len, c.head_dim, c.rope_theta);
    const std::vector<ExportTensor> tensors = export_tensors_llama2c(c, master, rope_cos.data(), rope_sin.data());
    // run.c's Config; a negative vocab_size says that the classifier (lm_head) is stored, not tied to the embedding
    const int32_t config[7] = {c.dim, c.ffn_dim, c.n_layers, c.n_heads, c.n_kv_heads, -c.vocab_size, c.max_seq_len};
    const std::string bin = out_dir + "/model.bin";
    write_file_durably(bin, [&](FILE* f, const std::string& tmp) {
        write_bytes(f, config, sizeof(config), tmp);
        for (const ExportTensor& t : tensors) export_write_tensor(f, tmp, fd, path, t, false);
    });
    close(fd);
    printf("wrote %s (FP32)\n", bin.c_str());
    if (has_tok) {
        const std::string tok_bin = out_dir + "/tokenizer.bin";
        write_text_durably(tok_bin, tokenizer_llama2c_bin(tok, c.vocab_size));
        printf("wrote %s (the %zu pieces of %s): ./run %s -z %s -i \"In the beginning\"\n", tok_bin.c_str(), tok.pieces.size(),
               tok_path.c_str(), bin.c_str(), tok_bin.c_str());
        for (int b = 0; b < 256; b++)
            if (tok.byte_ids[b] != b + 3) {   // run.c spells a character outside the vocabulary as the ids byte + 3
                printf("note: %s does not hold the 256 byte pieces at ids 3-258, where run.c looks for them: a character that "
                       "is no piece encodes wrongly in run.c's prompts\n", tok_path.c_str());
                break;
            }
    } else if (bytes) {   // run.c's tokenizer.bin: max token length, then per token a score, a length and the bytes
        const std::string tok = out_dir + "/tokenizer.bin";
        write_file_durably(tok, [&](FILE* f, const std::string& tmp) {
            const int32_t max_len = 1, len = 1;
            const float score = 0.0f;
            write_bytes(f, &max_len, 4, tmp);
            for (int i = 0; i < BYTE_VOCAB; i++) {
                const unsigned char byte = (unsigned char)i;
                write_bytes(f, &score, 4, tmp);
                write_bytes(f, &len, 4, tmp);
                write_bytes(f, &byte, 1, tmp);
            }
        });
        printf("wrote %s (the 256 bytes): ./run %s -z %s -i \"In the beginning\"\n", tok.c_str(), bin.c_str(), tok.c_str());
    } else {
        printf("no tokenizer.bin: the vocabulary (%d tokens) is not bytes; give run.c the tokenizer.bin of the tokenizer that "
               "made the data (-z)\n", c.vocab_size);
    }
    return "";
}
