// train_fp8.cu: the training program. LLaMA-2 pretraining on one GPU or tensor-parallel over the GPUs of one
// machine (--tp N: one host thread per GPU, NCCL), FP8 or BF16 by build.
//   ./train_fp8 prepare TEXT OUT_PREFIX     any text file -> byte-level token shards (train 90%, val 10%)
//   ./train_fp8 [flags]                      train (./train_fp8 --help lists the flags and their defaults)
// Sections:
//   1. the command line        TrainOptions, a table of flags, parse_args, print_help
//   2. the checkpoint header   the format, written and checked
//   3. checkpoint files        save (to a temporary name, then renamed) and load
//   4. evaluation, sampling
//   5. the run                 train(): data, the ranks (model and AdamW per GPU), the loop, logging, checkpoints
//   6. main
// test_fp8.cu includes this file with TESTING defined (no main), and calls parse_args, the checkpoint
// functions and train() directly.
#ifndef TRAIN_FP8_CU
#define TRAIN_FP8_CU
#include "fp8_kernels.cuh"
#include "llama2.cuh"
#include "adamw_fp8.cuh"
#include "dataloader.h"
#include <chrono>
#include <functional>
#include <thread>
#include <cctype>
#include <cerrno>
#include <sys/stat.h>
#include <unistd.h>

// ----------------------------------------------------------------------------------------------
// 1. Command line. Every flag is one row of a table (name, value name, help, target, allowed range):
// the parser, the range checks and --help all walk the same table, so a new flag is one new row.

// The flag spelling of a moment type: "e4m3", "bf16", "fp32", "e5m2".
inline std::string moment_dtype_flag(DType t) {
    std::string s = dtype_name(t);
    for (char& ch : s) ch = (char)tolower(ch);
    return s;
}

struct TrainOptions {
    std::string model = "d12";               // preset; the overrides below replace its fields when > 0
    int dim = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0;
    std::string data = "data/kjv_train.bin";  // glob of token shards
    std::string val_data = "data/kjv_val.bin";
    int batch = 32;                          // B: sequences per micro-batch
    int seq = 512;                           // T: tokens per sequence
    long total_batch = 0;                    // tokens per optimizer step; 0 = B*T (no accumulation)
    int steps = 600;
    float lr = 6e-4f;
    int warmup = 60;
    float final_lr_frac = 0.1f;
    float weight_decay = 0.1f;
    float grad_clip = 1.0f;                  // global-norm clip; 0 = off
    long seed = 1337;
    std::string out;                         // DIR: log.csv and ckpt.bin; empty = no files
    int eval_every = 100;                    // 0 = only at the last step
    int eval_batches = 20;
    int sample_every = 250;                  // 0 = never
    int sample_tokens = 256;
    float temperature = 0.8f;                // 0 = greedy
    int checkpoint_every = 500;              // 0 = only at the end (checkpoints need --out)
    std::string resume;                      // DIR holding ckpt.bin
    int stop_after = 0;                      // end after this step, keeping --steps' schedule; 0 = --steps
    int max_bad_steps = 5;                   // non-finite steps in a row that stop the run
    // optimizer storage and variants (adamw_fp8.cuh); the moment defaults are the build's recipe
    std::string m_dtype = moment_dtype_flag(AdamWConfig().m_dtype);
    std::string v_dtype = moment_dtype_flag(AdamWConfig().v_dtype);
    bool update_clip = false;
    bool adam_atan2 = false;
    // the FP8 linear layers (llama2.cuh, Fp8Options; FP8 build only)
    bool fp8_all_layers = false;
    int amax_history = 1;                    // 1 = current scaling; more: delayed scaling from this many amaxes
    int quant_interval = 1;                  // delayed scaling: recompute the scales every this many steps
    int fp8_fast_accum = 1;                  // fast accumulation in the forward FP8 GEMMs (1) or split (0)
    int fp8_stats = 0;                       // every this many steps: DIR/fp8_stats.csv and a summary line; 0 = off
    // tensor parallelism (llama2.cuh, section 7)
    int tp = 1;                              // GPUs 0..tp-1 through NCCL; 0 = one GPU without NCCL
    bool tp_amax_sync = false;               // FP8: amax of the sharded X and dY = MAX over the TP group
    int profile = 0;                         // time the phases of this step and print a table; 0 = off
    int cuda_graph = 1;                      // replay each micro-batch from a CUDA graph (0: launch kernel by kernel)
    // prepare subcommand
    bool prepare = false;
    std::string prepare_text, prepare_prefix;
    bool help = false;
};

enum TrainFlagKind { FLAG_INT, FLAG_LONG, FLAG_FLOAT, FLAG_STRING, FLAG_SWITCH /* no value: sets a bool */ };
struct TrainFlag {
    const char* name;
    const char* value_name;
    const char* help;
    TrainFlagKind kind;
    void* target;
    double min, max;   // allowed range (numbers only)
};
inline TrainFlag flag_int(const char* n, const char* v, const char* h, int* t, double lo, double hi) { return {n, v, h, FLAG_INT, t, lo, hi}; }
inline TrainFlag flag_long(const char* n, const char* v, const char* h, long* t, double lo, double hi) { return {n, v, h, FLAG_LONG, t, lo, hi}; }
inline TrainFlag flag_float(const char* n, const char* v, const char* h, float* t, double lo, double hi) { return {n, v, h, FLAG_FLOAT, t, lo, hi}; }
inline TrainFlag flag_string(const char* n, const char* v, const char* h, std::string* t) { return {n, v, h, FLAG_STRING, t, 0, 0}; }
inline TrainFlag flag_switch(const char* n, const char* h, bool* t) { return {n, "", h, FLAG_SWITCH, t, 0, 0}; }

const char* const TRAIN_MODEL_PRESETS[] = {"tiny", "d12", "110m", "1b", "7b"};

// The table, pointing into `o`. Ranges are inclusive; cross-flag rules are in parse_args.
inline std::vector<TrainFlag> train_flags(TrainOptions* o) {
    const double BIG = 2147483647.0;
    return {
        flag_string("--model", "PRESET", "model preset: tiny, d12, 110m, 1b, 7b", &o->model),
        flag_int("--dim", "D", "model width (0 = the preset's)", &o->dim, 0, BIG),
        flag_int("--layers", "L", "decoder layers (0 = the preset's)", &o->layers, 0, BIG),
        flag_int("--heads", "NH", "attention heads (0 = the preset's)", &o->heads, 0, BIG),
        flag_int("--kv-heads", "NKV", "key/value heads, divides --heads (0 = the preset's)", &o->kv_heads, 0, BIG),
        flag_int("--ffn", "F", "SwiGLU hidden width (0 = the preset's)", &o->ffn, 0, BIG),
        flag_string("--data", "GLOB", "training token shards", &o->data),
        flag_string("--val-data", "GLOB", "validation token shards", &o->val_data),
        flag_int("--batch", "B", "sequences per micro-batch", &o->batch, 1, BIG),
        flag_int("--seq", "T", "tokens per sequence", &o->seq, 1, BIG),
        flag_long("--total-batch", "TOKENS", "tokens per optimizer step, a multiple of B*T (0 = B*T)", &o->total_batch, 0, 1e15),
        flag_int("--steps", "N", "optimizer steps (the LR schedule spans them)", &o->steps, 1, BIG),
        flag_float("--lr", "LR", "peak learning rate", &o->lr, 1e-12, 10),
        flag_int("--warmup", "N", "linear warm-up steps (<= --steps)", &o->warmup, 0, BIG),
        flag_float("--final-lr-frac", "F", "cosine decay ends at F * LR", &o->final_lr_frac, 0, 1),
        flag_float("--weight-decay", "WD", "AdamW weight decay (2-D tensors only)", &o->weight_decay, 0, 10),
        flag_float("--grad-clip", "C", "clip the global gradient norm to C (0 = off)", &o->grad_clip, 0, 1e30),
        flag_long("--seed", "S", "seed of the init and the data order", &o->seed, 0, 9.2e18),
        flag_string("--out", "DIR", "write DIR/log.csv and DIR/ckpt.bin (none if empty)", &o->out),
        flag_int("--eval-every", "N", "validation loss every N steps (0 = only at the end)", &o->eval_every, 0, BIG),
        flag_int("--eval-batches", "N", "validation batches per evaluation", &o->eval_batches, 1, BIG),
        flag_int("--sample-every", "N", "print a sample every N steps (0 = never)", &o->sample_every, 0, BIG),
        flag_int("--sample-tokens", "N", "tokens per sample", &o->sample_tokens, 1, BIG),
        flag_float("--temperature", "X", "sampling temperature (0 = greedy)", &o->temperature, 0, 100),
        flag_int("--checkpoint-every", "N", "checkpoint every N steps, and at the end (0 = end only; needs --out)", &o->checkpoint_every, 0, BIG),
        flag_string("--resume", "DIR", "continue the run saved in DIR/ckpt.bin (--out defaults to DIR)", &o->resume),
        flag_int("--stop-after", "N", "stop after step N, keeping the schedule of --steps (0 = --steps)", &o->stop_after, 0, BIG),
        flag_int("--max-bad-steps", "N", "stop after N non-finite steps in a row", &o->max_bad_steps, 1, BIG),
        flag_string("--m-dtype", "TYPE", "AdamW first moment: e4m3 (per-tensor scale), bf16, fp32", &o->m_dtype),
        flag_string("--v-dtype", "TYPE", "AdamW second moment: bf16, e4m3, e5m2 (FP8 store sqrt(v)), fp32", &o->v_dtype),
        flag_switch("--update-clip", "AdamW update clipping: each tensor's update / max(1, its RMS)", &o->update_clip),
        flag_switch("--adam-atan2", "Adam-atan2 update: atan2(m, sqrt(v)), no eps", &o->adam_atan2),
        flag_switch("--fp8-all-layers", "FP8 in every decoder layer (default: first and last in BF16; FP8 build)", &o->fp8_all_layers),
        flag_int("--amax-history", "N", "FP8 scales from the max of the last N amaxes (1 = current scaling; FP8 build)", &o->amax_history, 1, FP8_MAX_HISTORY),
        flag_int("--quant-interval", "N", "FP8 delayed scaling: new scales every N steps (FP8 build)", &o->quant_interval, 1, BIG),
        flag_int("--fp8-fast-accum", "0|1", "fast accumulation in the forward FP8 GEMMs (backward: always split; FP8 build)", &o->fp8_fast_accum, 0, 1),
        flag_int("--fp8-stats", "K", "every K steps: amax, scale, saturated and flushed fractions per FP8 tensor to DIR/fp8_stats.csv (0 = off; FP8 build)", &o->fp8_stats, 0, BIG),
        flag_int("--tp", "N", "tensor parallelism over GPUs 0..N-1: NCCL, one thread per GPU, heads and FFN split (1 = one GPU through NCCL; 0 = one GPU without NCCL)", &o->tp, 0, 1024),
        flag_switch("--tp-amax-sync", "FP8 under --tp: scales of the sharded X and dY from the MAX of amax over the GPUs (default: each GPU its own; FP8 build)", &o->tp_amax_sync),
        flag_int("--profile", "N", "time the phases of step N on the GPU (CUDA events) and print a table (0 = off)", &o->profile, 0, BIG),
        flag_int("--cuda-graph", "0|1", "replay each micro-batch's forward and backward from a CUDA graph captured once (0: launch every kernel every time)", &o->cuda_graph, 0, 1),
    };
}

inline std::string flag_value_string(const TrainFlag& f) {
    switch (f.kind) {
        case FLAG_INT: return std::to_string(*(int*)f.target);
        case FLAG_LONG: return std::to_string(*(long*)f.target);
        case FLAG_FLOAT: return strprintf("%g", *(float*)f.target);
        case FLAG_STRING: return *(std::string*)f.target;
        case FLAG_SWITCH: return *(bool*)f.target ? "on" : "off";
    }
    return "";
}

inline void print_help(const char* argv0) {
    TrainOptions defaults;
    printf("usage: %s [flags]                   train (defaults: the King James Bible, bytes, preset %s)\n", argv0, defaults.model.c_str());
    printf("       %s prepare TEXT OUT_PREFIX   write OUT_PREFIX_train.bin / OUT_PREFIX_val.bin (bytes, last 10%% val)\n", argv0);
    printf("flags (default in brackets):\n");
    for (const TrainFlag& f : train_flags(&defaults)) {
        std::string lhs = f.kind == FLAG_SWITCH ? f.name : std::string(f.name) + " " + f.value_name;
        std::string def = flag_value_string(f);
        printf("  %-22s %s [%s]\n", lhs.c_str(), f.help, def.empty() ? "none" : def.c_str());
    }
    printf("  %-22s this text\n", "--help");
}

inline int grad_accum_steps(const TrainOptions& o) { return (int)(o.total_batch / ((long)o.batch * o.seq)); }

// The model of these options for data of `vocab_size` tokens: the preset with the overrides applied;
// max_seq_len grows to --seq if that is longer (RoPE has no limit; the preset's number is only a check).
// Not validated here (model_config_problem says what is wrong).
inline ModelConfig model_config_from_options(const TrainOptions& o, int vocab_size) {
    ModelConfig c = model_config_preset(o.model.c_str(), vocab_size);
    if (o.dim > 0) c.dim = o.dim;
    if (o.layers > 0) c.n_layers = o.layers;
    if (o.heads > 0) c.n_heads = o.heads;
    if (o.kv_heads > 0) c.n_kv_heads = o.kv_heads;
    if (o.ffn > 0) c.ffn_dim = o.ffn;
    c.head_dim = c.dim / c.n_heads;
    c.max_seq_len = std::max(c.max_seq_len, o.seq);
    return c;
}

// One flag's value: a non-empty string, or a number parsed strictly (the whole text, finite, in [min, max]).
inline std::string parse_flag_value(const TrainFlag& f, const char* text) {
    char* end = nullptr;
    errno = 0;
    if (f.kind == FLAG_STRING) {
        if (text[0] == '\0') return strprintf("%s needs a non-empty %s", f.name, f.value_name);
        *(std::string*)f.target = text;
        return "";
    }
    double v;
    long long iv = 0;
    if (f.kind == FLAG_FLOAT) {
        v = strtod(text, &end);
        if (end == text || *end != '\0' || errno == ERANGE || !std::isfinite(v))
            return strprintf("%s %s: not a number", f.name, text);
    } else {
        iv = strtoll(text, &end, 10);
        if (end == text || *end != '\0' || errno == ERANGE) return strprintf("%s %s: not an integer", f.name, text);
        v = (double)iv;
    }
    if (v < f.min || v > f.max) return strprintf("%s %s: must be in [%.10g, %.10g]", f.name, text, f.min, f.max);
    if (f.kind == FLAG_INT) *(int*)f.target = (int)v;
    else if (f.kind == FLAG_LONG) *(long*)f.target = (long)iv;
    else *(float*)f.target = (float)v;
    return "";
}

// Fills *o from argv; returns "" or the reason for rejecting the command line (naming the flag and value).
inline std::string parse_args(int argc, char** argv, TrainOptions* o) {
    *o = TrainOptions();
    if (argc >= 2 && strcmp(argv[1], "prepare") == 0) {
        if (argc != 4) return "usage: prepare TEXT OUT_PREFIX (two arguments)";
        o->prepare = true;
        o->prepare_text = argv[2];
        o->prepare_prefix = argv[3];
        return "";
    }
    std::vector<TrainFlag> flags = train_flags(o);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) { o->help = true; return ""; }
        const TrainFlag* f = nullptr;
        for (const TrainFlag& g : flags) if (strcmp(argv[i], g.name) == 0) f = &g;
        if (!f) return strprintf("unknown argument %s (see --help)", argv[i]);
        if (f->kind == FLAG_SWITCH) { *(bool*)f->target = true; continue; }
        if (i + 1 >= argc) return strprintf("%s needs a value (%s)", f->name, f->value_name);
        std::string err = parse_flag_value(*f, argv[++i]);
        if (!err.empty()) return err;
    }
    // cross-flag rules
    bool known = false;
    for (const char* p : TRAIN_MODEL_PRESETS) known |= o->model == p;
    if (!known) return strprintf("--model %s: unknown preset (tiny, d12, 110m, 1b, 7b)", o->model.c_str());
    const char* m_types[] = {"e4m3", "bf16", "fp32"};
    const char* v_types[] = {"bf16", "e4m3", "e5m2", "fp32"};
    bool m_ok = false, v_ok = false;
    for (const char* t : m_types) m_ok |= o->m_dtype == t;
    for (const char* t : v_types) v_ok |= o->v_dtype == t;
    if (!m_ok) return strprintf("--m-dtype %s: the first moment can be e4m3, bf16 or fp32", o->m_dtype.c_str());
    if (!v_ok) return strprintf("--v-dtype %s: the second moment can be bf16, e4m3, e5m2 or fp32", o->v_dtype.c_str());
#if !defined(PRECISION_FP8)
    if (o->fp8_all_layers || o->amax_history != 1 || o->quant_interval != 1 || o->fp8_fast_accum != 1 || o->fp8_stats != 0 ||
        o->tp_amax_sync)
        return "--fp8-all-layers, --amax-history, --quant-interval, --fp8-fast-accum, --fp8-stats and --tp-amax-sync are FP8 "
               "options; this is the PRECISION=BF16 build (build with make PRECISION=FP8)";
#endif
    long bt = (long)o->batch * o->seq;
    if (o->total_batch == 0) o->total_batch = bt;
    if (o->total_batch % bt != 0)
        return strprintf("--total-batch %ld: must be a multiple of B*T = %d*%d = %ld", o->total_batch, o->batch, o->seq, bt);
    if (o->warmup > o->steps) return strprintf("--warmup %d: exceeds --steps %d", o->warmup, o->steps);
    if (o->stop_after > o->steps) return strprintf("--stop-after %d: exceeds --steps %d", o->stop_after, o->steps);
    if (o->profile > o->steps) return strprintf("--profile %d: exceeds --steps %d (the step to profile must be run)", o->profile, o->steps);
    if (o->seq % 16 != 0) return strprintf("--seq %d: must be a multiple of 16 (the GEMM rule; sampling runs 1 x T tokens)", o->seq);
    std::string problem = model_config_problem(model_config_from_options(*o, BYTE_VOCAB));
    if (!problem.empty()) {
        std::string given = "--model " + o->model;
        const std::pair<const char*, int> overrides[] = {{"--dim", o->dim}, {"--layers", o->layers}, {"--heads", o->heads},
                                                         {"--kv-heads", o->kv_heads}, {"--ffn", o->ffn}};
        for (auto& ov : overrides) if (ov.second > 0) given += strprintf(" %s %d", ov.first, ov.second);
        return strprintf("%s: %s", given.c_str(), problem.c_str());
    }
    problem = model_tp_problem(model_config_from_options(*o, BYTE_VOCAB), std::max(1, o->tp));
    if (!problem.empty()) return strprintf("--tp %d: %s", o->tp, problem.c_str());
    if (o->tp > 1 && o->update_clip)
        return strprintf("--update-clip with --tp %d: update clipping divides by each tensor's update RMS, which a rank "
                         "sees only for its shard; drop one of the two", o->tp);
    if (o->out.empty()) o->out = o->resume;
    return "";
}

// ----------------------------------------------------------------------------------------------
// 2. Checkpoints.
// DIR/ckpt.bin, little-endian, version 1. Written whole to DIR/ckpt.bin.tmp, then renamed over ckpt.bin,
// so a crash mid-write leaves the previous checkpoint intact.
//   bytes 0..255   CheckpointHeader (below; offsets in the comments)
//     0  u32  magic 0x38504654 (the bytes "TFP8")        4  u32  version (1)
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
//   148  u32  bytes of one Fp8Meta                   152  u64  number K of model Fp8Meta (FP8 build 12 L, BF16 0)
//   160  u32  P, the tensor-parallel size that wrote the file (1 without TP; 0, from before TP existed, reads as 1)
//   164..255  zero
// P = 1:
//   256..  the optimizer state as adamw_save writes it (adamw_fp8.cuh, section 6): its 40-byte header ("ADMW",
//          version, m and v types, tensor count, optimizer step, N, a hash of the tensor layout), then the
//          FP32 master weights (N x f32, in the order of model_param_specs), m, v, and the
//          per-tensor Fp8Meta of each FP8 moment.
//   then   K x Fp8Meta: the scales of the model's FP8 linears (X, W, dY of wqkv, wo, w_gate_up, w_down of each
//          layer, llama2.cuh's ModelFp8::metas; the amax histories of delayed scaling); the file ends there.
// P > 1 (tensor parallelism):
//   256..  the whole FP32 master weights, N x f32 in the order of model_param_specs (the shards put back)
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
// build precision, model config, B, T, total batch and seed; --steps, --lr and the schedule may change
// (the schedule is a function of the step), though changing them breaks the equality with an
// uninterrupted run.
constexpr uint32_t CKPT_MAGIC = 0x38504654;   // "TFP8" as little-endian bytes
constexpr uint32_t CKPT_VERSION = 1;
#if defined(PRECISION_FP8)
constexpr uint32_t BUILD_PRECISION = 8;
#else
constexpr uint32_t BUILD_PRECISION = 16;
#endif

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
    uint8_t reserved[92];
};
static_assert(sizeof(CheckpointHeader) == 256 && offsetof(CheckpointHeader, vocab_size) == 16 &&
              offsetof(CheckpointHeader, norm_eps) == 48 && offsetof(CheckpointHeader, batch) == 56 &&
              offsetof(CheckpointHeader, total_batch) == 64 && offsetof(CheckpointHeader, step) == 80 &&
              offsetof(CheckpointHeader, loader_epoch) == 104 && offsetof(CheckpointHeader, sample_rng) == 120 &&
              offsetof(CheckpointHeader, num_params) == 128 && offsetof(CheckpointHeader, amax_history) == 136 &&
              offsetof(CheckpointHeader, fp8_meta_bytes) == 148 && offsetof(CheckpointHeader, fp8_meta_count) == 152 &&
              offsetof(CheckpointHeader, tp_size) == 160 && offsetof(CheckpointHeader, reserved) == 164,
              "the checkpoint header's layout is the one documented above");

// The header this build and these options would write (run-state fields zero).
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
    return h;
}

// "" if a checkpoint with header `got` can continue the run described by `want`, else the reason.
inline std::string checkpoint_header_check(const CheckpointHeader& got, const CheckpointHeader& want, const char* path) {
    if (got.magic != CKPT_MAGIC)
        return strprintf("%s: not a train_fp8 checkpoint (magic 0x%08x, expected 0x%08x \"TFP8\")", path, got.magic, CKPT_MAGIC);
    if (got.version != CKPT_VERSION)
        return strprintf("%s: checkpoint format version %u, this build reads version %u", path, got.version, CKPT_VERSION);
    if (got.header_bytes != sizeof(CheckpointHeader))
        return strprintf("%s: header size %u, expected %zu: damaged file", path, got.header_bytes, sizeof(CheckpointHeader));
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
        {"number of parameters", (long long)got.num_params, (long long)want.num_params},
        {"FP8 amax history (--amax-history)", got.amax_history, want.amax_history},
        {"FP8 quantization interval (--quant-interval)", got.quant_interval, want.quant_interval},
        {"FP8 in all layers (--fp8-all-layers)", got.fp8_all_layers, want.fp8_all_layers},
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
    return "";
}

// Read the header of `path` into *h; "" or the reason (missing, short).
inline std::string checkpoint_read_header(const char* path, CheckpointHeader* h) {
    FILE* f = fopen(path, "rb");
    if (!f) return strprintf("cannot open checkpoint %s: %s", path, strerror(errno));
    size_t got = fread(h, 1, sizeof(*h), f);
    fclose(f);
    if (got != sizeof(*h)) return strprintf("%s: %zu bytes, shorter than the %zu-byte checkpoint header", path, got, sizeof(*h));
    return "";
}
// ----------------------------------------------------------------------------------------------
// 3. Checkpoint files: the header above, the optimizer state (master weights first), the model's FP8 scales.

inline std::string checkpoint_path(const std::string& dir) { return dir + "/ckpt.bin"; }

// The model's FP8 scale records (FP8 build: ModelFp8::metas; none in the BF16 build).
inline Fp8Meta* model_fp8_metas(Model* m) {
#if defined(PRECISION_FP8)
    return m->fp8.metas;
#else
    (void)m;
    return nullptr;
#endif
}

// Bytes of one optimizer state as adamw_save writes it.
inline size_t adamw_saved_bytes(const AdamW* opt) {
    size_t bytes = sizeof(AdamWFileHeader);
    for (const AdamWPart& part : adamw_state_parts(opt)) bytes += part.bytes;
    return bytes;
}

// opts[r] and models[r] are rank r's (one of each without TP), their streams idle; h.tp_size == opts.size().
inline void checkpoint_save(const std::string& dir, const CheckpointHeader& h, const std::vector<const AdamW*>& opts,
                            const std::vector<Model*>& models) {
    const int P = (int)opts.size();
    if ((int)h.tp_size != P) fail("checkpoint_save: the header says tp_size %u, %d ranks given", h.tp_size, P);
    std::string path = checkpoint_path(dir), tmp = path + ".tmp";
    FILE* f = fopen(tmp.c_str(), "wb");
    if (!f) fail("cannot write checkpoint %s: %s", tmp.c_str(), strerror(errno));
    if (fwrite(&h, sizeof(h), 1, f) != 1) fail("writing %s failed: %s (disk full?)", tmp.c_str(), strerror(errno));
    if (P > 1) {   // the whole master weights: every rank's shard put back in its place
        const ModelConfig& c = models[0]->config;
        std::vector<float> whole(h.num_params), shard(opts[0]->num_params);
        for (int r = 0; r < P; r++) {
            cudaCheck(cudaMemcpy(shard.data(), opts[r]->master, shard.size() * sizeof(float), cudaMemcpyDeviceToHost));
            model_copy_shard(c, P, r, whole.data(), shard.data(), false);
        }
        if (fwrite(whole.data(), sizeof(float), whole.size(), f) != whole.size())
            fail("writing %s failed: %s (disk full?)", tmp.c_str(), strerror(errno));
    }
    for (const AdamW* opt : opts) adamw_save(opt, f);
    std::vector<Fp8Meta> metas(h.fp8_meta_count);
    for (Model* model : models) {
        if (metas.empty()) break;
        cudaCheck(cudaMemcpy(metas.data(), model_fp8_metas(model), metas.size() * sizeof(Fp8Meta), cudaMemcpyDeviceToHost));
        if (fwrite(metas.data(), sizeof(Fp8Meta), metas.size(), f) != metas.size())
            fail("writing %s failed: %s (disk full?)", tmp.c_str(), strerror(errno));
    }
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) fail("writing %s failed: %s (disk full?)", tmp.c_str(), strerror(errno));
    if (fclose(f) != 0) fail("closing %s failed: %s", tmp.c_str(), strerror(errno));
    if (rename(tmp.c_str(), path.c_str()) != 0) fail("cannot rename %s to %s: %s", tmp.c_str(), path.c_str(), strerror(errno));
}

// Resume at the TP size that wrote the file (header h, already checked): rank `rank` of the model's tp_size
// reads its optimizer state into opt, sets the model's weights from its master weights, then puts its saved
// FP8 scales over the ones that rebuilding the FP8 weight copies just wrote, so that every scale, amax history
// and counter is the uninterrupted run's. Runs on the rank's thread (its GPU current).
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
        cudaCheck(cudaMemcpy(model_fp8_metas(model), metas.data(), metas.size() * sizeof(Fp8Meta), cudaMemcpyHostToDevice));
    }
    if (rank == P - 1 && fgetc(f) != EOF)
        fail("%s: bytes after the FP8 scales: damaged file, or written by another version", path.c_str());
    fclose(f);
}

// The whole FP32 master weights of checkpoint `path` (header h, already checked), whatever TP size wrote it:
// for resuming at another TP size (the caller cuts them into the new shards).
inline std::vector<float> checkpoint_read_master(const std::string& path, const CheckpointHeader& h) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) fail("cannot open checkpoint %s: %s", path.c_str(), strerror(errno));
    if (fseek(f, sizeof(CheckpointHeader), SEEK_SET) != 0) fail("%s: cannot seek past the header", path.c_str());
    if (h.tp_size <= 1) {   // the master weights are the first part of the optimizer state
        AdamWFileHeader a;
        if (fread(&a, sizeof(a), 1, f) != 1 || a.magic != ADAMW_MAGIC || a.num_params != h.num_params)
            fail("%s: no AdamW state of %llu parameters after the header: damaged file", path.c_str(), (unsigned long long)h.num_params);
    }
    std::vector<float> master(h.num_params);
    if (fread(master.data(), sizeof(float), master.size(), f) != master.size())
        fail("%s: the master weights end early (truncated file)", path.c_str());
    fclose(f);
    return master;
}

// mkdir -p
inline void make_dirs(const std::string& dir) {
    for (size_t i = 1; i <= dir.size(); i++) {
        if (i < dir.size() && dir[i] != '/') continue;
        std::string part = dir.substr(0, i);
        if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) fail("cannot create folder %s: %s", part.c_str(), strerror(errno));
    }
}

// ----------------------------------------------------------------------------------------------
// 4. Evaluation and sampling.

// Mean loss over the first `batches` batches of the validation data (the loader starts over each time,
// so every evaluation sees the same tokens).
inline float evaluate_val_loss(Model* m, DataLoader* val, int batches, int* d_inputs, int* d_targets) {
    dataloader_reset(val);
    double sum = 0.0;
    size_t n = (size_t)val->B * val->T;
    for (int i = 0; i < batches; i++) {
        dataloader_next_batch(val);
        cudaCheck(cudaMemcpy(d_inputs, val->inputs.data(), n * sizeof(int), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_targets, val->targets.data(), n * sizeof(int), cudaMemcpyHostToDevice));
        sum += model_loss(m, d_inputs, d_targets, val->B, val->T);
    }
    return (float)(sum / batches);
}

// Uniform in [0, 1) from the top 24 bits of splitmix64 (dataloader.h).
inline float sample_uniform(uint64_t* rng) { return (float)(splitmix64(rng) >> 40) * 0x1p-24f; }

// Generates `count` tokens after `prompt`. Each token runs the model on a window of T positions: the
// context (its last T tokens) from position 0, padded with token 0 after it. Attention is causal, so the
// padding never reaches the logits at the context's last position, which give the next token.
// temperature 0: the most likely token; else a draw from softmax(logits / temperature).
inline std::vector<int> sample_text(Model* m, const std::vector<int>& prompt, int count, float temperature, uint64_t* rng,
                                    int* d_inputs, float* d_logits) {
    const int T = m->T, V = m->config.vocab_size;
    std::vector<int> tokens = prompt, window(T);
    std::vector<float> logits(V);
    std::vector<double> probs(V);
    for (int k = 0; k < count; k++) {
        int len = std::min((int)tokens.size(), T);
        std::fill(window.begin(), window.end(), 0);
        std::copy(tokens.end() - len, tokens.end(), window.begin());
        cudaCheck(cudaMemcpy(d_inputs, window.data(), T * sizeof(int), cudaMemcpyHostToDevice));
        model_logits(m, d_inputs, 1, T, d_logits);
        cudaCheck(cudaMemcpy(logits.data(), d_logits + (size_t)(len - 1) * V, V * sizeof(float), cudaMemcpyDeviceToHost));
        int next = (int)(std::max_element(logits.begin(), logits.end()) - logits.begin());
        if (temperature > 0.0f) {
            double mx = logits[next], sum = 0.0;
            for (int i = 0; i < V; i++) sum += probs[i] = exp((logits[i] - mx) / temperature);
            double u = sample_uniform(rng) * sum;
            next = V - 1;
            for (int i = 0; i < V; i++) {
                u -= probs[i];
                if (u < 0.0) { next = i; break; }
            }
        }
        tokens.push_back(next);
    }
    return std::vector<int>(tokens.begin() + prompt.size(), tokens.end());
}

// Tokens as text: with the byte vocabulary, printable ASCII and newlines as they are, other bytes as \xNN;
// other vocabularies (no tokenizer here) as ids.
inline std::string tokens_to_text(const std::vector<int>& tokens, int vocab_size) {
    std::string s;
    for (int t : tokens) {
        if (vocab_size != BYTE_VOCAB) s += strprintf("%d ", t);
        else if (t == '\n' || (t >= 32 && t < 127)) s += (char)t;
        else s += strprintf("\\x%02x", t);
    }
    return s;
}

// ----------------------------------------------------------------------------------------------
// 5. The training run.

inline AdamWConfig adamw_config_from_options(const TrainOptions& o) {
    AdamWConfig a;
    a.weight_decay = o.weight_decay;
    a.grad_clip = o.grad_clip;
    a.m_dtype = adamw_parse_moment_dtype("--m-dtype", o.m_dtype.c_str());
    a.v_dtype = adamw_parse_moment_dtype("--v-dtype", o.v_dtype.c_str());
    a.update_clip = o.update_clip;
    a.use_atan2 = o.adam_atan2;
    return a;
}

// The GPU's dense tensor-core peak for this build's GEMMs (FP8 build: FP8; BF16 build: BF16) in TFLOP/s, the
// denominator of MFU. By name from the data sheets (dense, without sparsity; the first entry whose name is part of
// the device's name). Other GPUs of a known architecture: SMs x boost clock x the architecture's dense FLOP per SM
// and clock (Hopper 4096 BF16 / 8192 FP8, B200 8192 / 16384, A100 2048 BF16), an upper bound: the data sheets
// count a lower clock (H100 SXM's 989 TFLOP/s is 132 SMs at 1.83 GHz, its boost clock 1.98). Else 0: no MFU.
struct GpuPeak {
    double tflops;
    std::string source;
};
inline GpuPeak gpu_peak(const std::string& name, int major, int minor, int sms, int clock_khz, bool fp8) {
    struct Entry { const char* name; double bf16, fp8; };
    static const Entry table[] = {   // the variants before the general names; "GH200" contains "H200"
        {"H100 PCIe", 756, 1513}, {"H100 NVL", 835, 1671}, {"H200 NVL", 835, 1671}, {"H100", 989, 1979},
        {"H200", 989, 1979},       {"B200", 2250, 4500},    {"L40S", 362, 733},      {"A100", 312, 0},
    };
    for (const Entry& e : table) {
        const double t = fp8 ? e.fp8 : e.bf16;
        if (name.find(e.name) != std::string::npos && t > 0) return {t, strprintf("data sheet of the %s", e.name)};
    }
    double per_clock = 0;
    if (major == 9) per_clock = fp8 ? 8192 : 4096;
    else if (major == 10 && minor == 0) per_clock = fp8 ? 16384 : 8192;
    else if (major == 8 && minor == 0 && !fp8) per_clock = 2048;
    if (per_clock == 0) return {0, strprintf("not known for %s (sm_%d%d)", name.c_str(), major, minor)};
    return {per_clock * sms * (clock_khz * 1e3) / 1e12,
            strprintf("estimated: %d SMs x %.2f GHz x %.0f FLOP per SM and clock", sms, clock_khz / 1e6, per_clock)};
}

// One GPU of the run (tensor parallelism: one rank of the group; --tp 0: the only one, without a group): its
// model shard and optimizer shard, its batch buffers, and its own validation loader and sampling RNG, so that
// every rank evaluates and samples exactly as the others (the logits are the same bits on every rank).
struct TrainRank {
    int device = 0;
    const TpGroup* tp = nullptr;
    Model model;
    AdamW opt;
    DataLoader val_data;
    int *d_inputs = nullptr, *d_targets = nullptr;   // one allocation: inputs, then targets
    int* h_batch[2] = {};                  // pinned staging of a micro-batch's inputs and targets, the two in turn
    cudaEvent_t batch_copied[2] = {};      // the copy out of each staging buffer has run on the GPU
    float *d_losses = nullptr, *h_losses = nullptr;   // [accum] this step's micro-batch losses, on the GPU and pinned
    float* d_logits = nullptr;
    float grad_norm = 0.0f, val_loss = 0.0f;
    uint64_t sample_rng = 0;
    std::vector<int> sample;
};

// Runs fn on every rank at once, each on a host thread of its own with its GPU current (one rank: on this
// thread); returns when all are done. Each rank issues its collectives in the same order, from its thread.
inline void on_ranks(std::vector<TrainRank>& ranks, const std::function<void(TrainRank&)>& fn) {
    if (ranks.size() == 1) {
        cudaCheck(cudaSetDevice(ranks[0].device));
        fn(ranks[0]);
        return;
    }
    std::vector<std::thread> threads;
    for (TrainRank& r : ranks)
        threads.emplace_back([&fn, &r] {
            cudaCheck(cudaSetDevice(r.device));
            fn(r);
        });
    for (std::thread& t : threads) t.join();
}

struct TrainResult {
    int first_step = 0, last_step = 0;    // the steps this call ran (1-based, inclusive)
    std::vector<float> losses, grad_norms, lrs;   // one per step run
    std::vector<std::pair<int, float>> val_losses;   // (step, loss); step 0 = before training
    long bad_steps = 0;                   // non-finite steps skipped, whole run (resumes included)
    bool stopped_on_bad_steps = false;    // --max-bad-steps non-finite steps in a row ended the run
    double tokens_per_s = 0;              // mean over the steps after the first
    long graph_launches = 0;              // micro-batches replayed from a CUDA graph
    bool profiled = false;                // --profile: the step ran in this call, and its table is `profile`
    ProfileReport profile;
};

inline TrainResult train(const TrainOptions& o) {
    TrainResult result;
    const int B = o.batch, T = o.seq, accum = grad_accum_steps(o);
    const int last_step = o.stop_after > 0 ? o.stop_after : o.steps;

    // ---- everything that can be wrong with the data or the checkpoint, before any GPU work
    DataLoader train_data, val_data;
    std::string err = dataloader_open(&train_data, o.data.c_str(), B, T, 0, 1, 0, true, (uint64_t)o.seed);
    if (!err.empty()) fail("--data %s: %s", o.data.c_str(), err.c_str());
    err = dataloader_open(&val_data, o.val_data.c_str(), B, T, 0, 1, train_data.vocab_size, false, 0);
    if (!err.empty()) fail("--val-data %s: %s", o.val_data.c_str(), err.c_str());
    const int V = train_data.vocab_size;
    printf("data: %s, %llu tokens, vocab %d (%s); validation %s, %llu tokens\n", o.data.c_str(),
           (unsigned long long)train_data.num_tokens, V, train_data.vocab_source.c_str(), o.val_data.c_str(),
           (unsigned long long)val_data.num_tokens);
    int eval_batches = o.eval_batches;
    if ((uint64_t)eval_batches > val_data.batches_per_epoch) {
        eval_batches = (int)val_data.batches_per_epoch;
        printf("evaluation: --eval-batches %d is more than the validation data holds; using %d\n", o.eval_batches, eval_batches);
    }
    ModelConfig config = model_config_from_options(o, V);
    model_config_validate(config);
    AdamWConfig adamw_config = adamw_config_from_options(o);
    adamw_config_validate(adamw_config);
    CheckpointHeader run = checkpoint_header_for(config, o);
    int first_step = 1;
    long bad_in_row = 0;
    uint64_t sample_rng = (uint64_t)o.seed;
    CheckpointHeader saved = {};   // the resumed checkpoint's header
    if (!o.resume.empty()) {
        std::string path = checkpoint_path(o.resume);
        err = checkpoint_read_header(path.c_str(), &saved);
        if (err.empty()) err = checkpoint_header_check(saved, run, path.c_str());
        if (err.empty()) err = dataloader_set_state(&train_data, {saved.loader_epoch, saved.loader_position});
        if (!err.empty()) fail("--resume %s: %s", o.resume.c_str(), err.c_str());
        first_step = (int)saved.step + 1;
        result.bad_steps = saved.bad_steps;
        bad_in_row = saved.bad_in_row;
        sample_rng = saved.sample_rng;
        printf("resuming %s at step %d (%lld non-finite steps so far)\n", path.c_str(), first_step, (long long)saved.bad_steps);
    }
    if (!o.out.empty()) make_dirs(o.out);

    // ---- the ranks: GPU r holds rank r's shard of the model and of the optimizer (--tp 0: GPU 0, no NCCL)
    const int P = std::max(1, o.tp);
    std::vector<TpGroup> groups;
    if (o.tp >= 1) groups = tp_groups_create(o.tp);   // the start-up checks: the GPUs are there, and can talk
    std::vector<TrainRank> ranks(P);
    for (int r = 0; r < P; r++) {
        ranks[r].device = r;
        ranks[r].tp = o.tp >= 1 ? &groups[r] : nullptr;
        err = dataloader_open(&ranks[r].val_data, o.val_data.c_str(), B, T, 0, 1, V, false, 0);
        if (!err.empty()) fail("--val-data %s: %s", o.val_data.c_str(), err.c_str());
    }
    for (int r = 0; r < P; r++) {
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, r));
        printf("device %d: %s (sm_%d%d), build PRECISION=%s\n", r, prop.name, prop.major, prop.minor, BUILD_PRECISION == 8 ? "FP8" : "BF16");
    }
    cudaCheck(cudaSetDevice(0));   // this thread's GPU: rank 0's
    GpuPeak peak;   // of GPU 0, taken for every GPU of the group
    {
        cudaDeviceProp prop;
        int clock_khz;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        cudaCheck(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
        peak = gpu_peak(prop.name, prop.major, prop.minor, prop.multiProcessorCount, clock_khz, BUILD_PRECISION == 8);
        const char* precision = BUILD_PRECISION == 8 ? "FP8" : "BF16";
        if (peak.tflops > 0) printf("MFU: model FLOP/s over %d x %.0f TFLOP/s, the dense %s peak (%s)\n", P, peak.tflops, precision, peak.source.c_str());
        else printf("MFU: not shown, the dense %s peak is %s\n", precision, peak.source.c_str());
    }
    printf("batch: %d x %d tokens x %d micro-batches = %ld tokens per step; steps %d (warm-up %d), lr %g -> %g\n",
           B, T, accum, o.total_batch, o.steps, o.warmup, o.lr, o.lr * o.final_lr_frac);
    if (o.tp == 0) printf("tensor parallel: off (--tp 0): one GPU, no NCCL\n");
    else printf("%s", model_tp_layout(config, P).c_str());
    Fp8Options fp8;
    fp8.recipe.history_len = o.amax_history;
    fp8.recipe.interval = o.quant_interval;
    fp8.all_layers = o.fp8_all_layers;
    fp8.fast_accum = o.fp8_fast_accum == 1;
    fp8.tp_amax_sync = o.tp_amax_sync;
    // Every rank cuts its shard out of the same whole weights: the init, or a checkpoint written at another TP size.
    const bool reshard = !o.resume.empty() && std::max(1u, saved.tp_size) != (uint32_t)P;
    std::vector<float> whole;
    if (reshard) {
        whole = checkpoint_read_master(checkpoint_path(o.resume), saved);
        printf("warning: %s was written with --tp %u and this run has --tp %d: the master weights are cut into the new "
               "shards exactly, but the AdamW moments and the FP8 scale records are per shard and start over (moments "
               "zero, bias correction from step 1, FP8 scales from the first casts), so the next steps differ from an "
               "uninterrupted run\n", checkpoint_path(o.resume).c_str(), std::max(1u, saved.tp_size), P);
    } else {
        whole = model_init_weights(config, (uint64_t)o.seed);
    }
    on_ranks(ranks, [&](TrainRank& r) {
        const int rank = r.tp ? r.tp->rank : 0;
        model_create(&r.model, config, B, T, fp8, r.tp);
        std::vector<float> shard;
        if (P > 1) {
            shard.resize(r.model.num_params);
            model_copy_shard(config, P, rank, whole.data(), shard.data(), true);
        }
        std::vector<float> norm_weights;   // replicated tensors count once in the global gradient norm
        for (size_t i = 0; i < r.model.params.size(); i++) norm_weights.push_back(model_param_sharded(config, (int)i) ? 1.0f : 1.0f / P);
        adamw_create(&r.opt, r.model.params, r.model.num_params, P > 1 ? shard.data() : whole.data(), adamw_config, norm_weights);
        if (!o.resume.empty() && !reshard) {
            checkpoint_load_rank(checkpoint_path(o.resume), saved, &r.opt, &r.model, rank);
        } else {
            adamw_export_weights(&r.opt, r.model.weights, r.model.stream);   // BF16 weights (and FP8 copies)
            model_weights_changed(&r.model);
        }
        cudaCheck(cudaMalloc(&r.d_inputs, 2 * (size_t)B * T * sizeof(int)));
        r.d_targets = r.d_inputs + (size_t)B * T;
        for (int i = 0; i < 2; i++) {
            cudaCheck(cudaMallocHost(&r.h_batch[i], 2 * (size_t)B * T * sizeof(int)));
            cudaCheck(cudaEventCreateWithFlags(&r.batch_copied[i], cudaEventDisableTiming));
        }
        cudaCheck(cudaMalloc(&r.d_losses, accum * sizeof(float)));
        cudaCheck(cudaMallocHost(&r.h_losses, accum * sizeof(float)));
        if (o.sample_every > 0) cudaCheck(cudaMalloc(&r.d_logits, (size_t)T * V * sizeof(float)));
        cudaCheck(cudaStreamSynchronize(r.model.stream));
    });
    whole = std::vector<float>();
    adamw_print_memory(&ranks[0].opt);
    {   // every buffer of a step is allocated by now (activations, workspaces): this is the step's footprint
        size_t free_b, total_b;
        cudaCheck(cudaSetDevice(0));
        cudaCheck(cudaMemGetInfo(&free_b, &total_b));
        printf("GPU 0 memory in use: %.1f GiB of %.1f GiB\n", (total_b - free_b) / 1073741824.0, total_b / 1073741824.0);
    }
    std::vector<int> prompt;
    if (V == BYTE_VOCAB) {
        for (const char* p = "In the beginning"; *p; p++) prompt.push_back((unsigned char)*p);
    } else {   // no tokenizer here: the first tokens of the validation data
        dataloader_reset(&val_data);
        dataloader_next_batch(&val_data);
        prompt.assign(val_data.inputs.begin(), val_data.inputs.begin() + std::min(T, 16));
    }

    FILE* log = nullptr;
    if (!o.out.empty()) {   // a resumed run appends; the header goes into a new file only
        std::string path = o.out + "/log.csv";
        struct stat st;
        bool fresh = o.resume.empty() || stat(path.c_str(), &st) != 0 || st.st_size == 0;
        log = fopen(path.c_str(), fresh ? "w" : "a");
        if (!log) fail("cannot write %s: %s", path.c_str(), strerror(errno));
        if (fresh) fprintf(log, "step,loss,val_loss,lr,grad_norm,ms,tokens_per_s,tflops,skipped,mfu_percent\n");
    }
#if defined(PRECISION_FP8)
    FILE* fp8_csv = nullptr;
    if (o.fp8_stats > 0 && !o.out.empty()) {
        std::string path = o.out + "/fp8_stats.csv";
        struct stat st;
        bool fresh = o.resume.empty() || stat(path.c_str(), &st) != 0 || st.st_size == 0;
        fp8_csv = fopen(path.c_str(), fresh ? "w" : "a");
        if (!fp8_csv) fail("cannot write %s: %s", path.c_str(), strerror(errno));
        if (fresh) fprintf(fp8_csv, "step,layer,linear,tensor,format,amax,scale_log2,saturated_frac,flushed_frac\n");
    }
#endif
    const double flops_per_token = model_flops_per_token(config, T);   // the whole model's: TFLOP/s of all GPUs together
    const double tokens_per_step = (double)o.total_batch;
    const float grad_scale = 1.0f / ((float)B * T * accum);
    auto evaluate = [&]() {   // the same loss on every rank
        on_ranks(ranks, [&](TrainRank& r) { r.val_loss = evaluate_val_loss(&r.model, &r.val_data, eval_batches, r.d_inputs, r.d_targets); });
        return ranks[0].val_loss;
    };
    if (first_step == 1 && o.eval_every > 0) {
        float val = evaluate();
        result.val_losses.push_back({0, val});
        printf("step %5d | val loss %.4f\n", 0, val);
        if (log) fprintf(log, "0,,%.6f,,,,,,,\n", val);
    }

    // ---- the loop
    result.first_step = first_step;
    if (first_step > last_step) printf("nothing to do: the checkpoint is at step %d and this run ends at step %d\n", first_step - 1, last_step);
    double time_sum = 0;
    int timed_steps = 0;
    StepProfile profile;
    for (int step = first_step; step <= last_step; step++) {
        NvtxRange step_range(strprintf("step %d", step));
        auto t0 = std::chrono::steady_clock::now();
        const bool profile_step = step == o.profile;   // rank 0's GPU, the stream of its model
        if (profile_step) profile_begin(&profile, ranks[0].model.stream, (size_t)accum * (40 * config.n_layers + 40) + 20);
        const bool fp8_stats_step = o.fp8_stats > 0 && step % o.fp8_stats == 0;
#if defined(PRECISION_FP8)
        if (fp8_stats_step) model_fp8_stats_begin(&ranks[0].model);   // under --tp: rank 0's shards
#endif
        for (int k = 0; k < accum; k++) {
            dataloader_next_batch(&train_data);
            // Eager: the run's first micro-batch (it loads the kernels and makes the GEMM plans the capture then
            // finds), the profiled step (its ranges time each phase) and --fp8-stats steps (their health counters).
            const bool graph = o.cuda_graph && (step > first_step || k > 0) && !profile_step && !fp8_stats_step;
            const int staging = (int)(((long)(step - first_step) * accum + k) % 2);
            on_ranks(ranks, [&](TrainRank& r) {   // every rank gets the whole batch
                NvtxRange micro_batch_range(strprintf("micro-batch %d", k));
                cudaStream_t s = r.model.stream;
                if (k == 0) {
                    ProfileRange range(PHASE_OPTIMIZER, s, "zero gradients");
                    model_zero_grads(&r.model);
                }
                {   // through pinned memory, one asynchronous copy: the host goes on while the copy waits its turn
                    ProfileRange range(PHASE_DATA, s, "input copies");
                    int* h = r.h_batch[staging];
                    cudaCheck(cudaEventSynchronize(r.batch_copied[staging]));   // its previous copy, 2 micro-batches ago, has run
                    memcpy(h, train_data.inputs.data(), (size_t)B * T * sizeof(int));
                    memcpy(h + (size_t)B * T, train_data.targets.data(), (size_t)B * T * sizeof(int));
                    cudaCheck(cudaMemcpyAsync(r.d_inputs, h, 2 * (size_t)B * T * sizeof(int), cudaMemcpyHostToDevice, s));
                    cudaCheck(cudaEventRecord(r.batch_copied[staging], s));
                }
                auto micro_batch = [&] { model_micro_batch(&r.model, r.d_inputs, r.d_targets, grad_scale); };
                if (graph) model_graph_launch(&r.model, 0, micro_batch);
                else micro_batch();
                cudaCheck(cudaMemcpyAsync(r.d_losses + k, r.model.acts.loss_mean, sizeof(float), cudaMemcpyDeviceToDevice, s));
            });
            result.graph_launches += graph;
        }
#if defined(PRECISION_FP8)
        on_ranks(ranks, [&](TrainRank& r) { model_fp8_record_amax(&r.model); });   // delayed scaling: the step's amaxes
#endif
        on_ranks(ranks, [&](TrainRank& r) {
            {
                ProfileRange range(PHASE_LOSS, r.model.stream, "losses to the host");
                cudaCheck(cudaMemcpyAsync(r.h_losses, r.d_losses, accum * sizeof(float), cudaMemcpyDeviceToHost, r.model.stream));
            }
            {
                ProfileRange range(PHASE_OPTIMIZER, r.model.stream, "gradient norm");
                r.grad_norm = adamw_grad_norm(&r.opt, r.model.grads, r.model.stream, r.tp);
            }
            cudaCheck(cudaStreamSynchronize(r.model.stream));   // the losses are on the host
        });
        double loss_sum = 0.0;
        for (int k = 0; k < accum; k++) loss_sum += ranks[0].h_losses[k];   // the same on every rank
        float loss = (float)(loss_sum / accum);
        float grad_norm = ranks[0].grad_norm;   // all-reduced: the same on every rank
        float lr = lr_schedule(step - 1, o.steps, o.warmup, o.lr, o.final_lr_frac);
        bool bad = !std::isfinite(loss) || !std::isfinite(grad_norm);
        if (bad) {   // skip the update: the weights and moments stay as they were
            result.bad_steps++;
            bad_in_row++;
        } else {
            on_ranks(ranks, [&](TrainRank& r) {
                {
                    ProfileRange range(PHASE_OPTIMIZER, r.model.stream, "AdamW");
                    adamw_step(&r.opt, r.model.grads, r.model.weights, lr, r.grad_norm, r.model.stream);
                }
                ProfileRange range(PHASE_WEIGHT_QUANT, r.model.stream, "weight re-quantization");
                model_weights_changed(&r.model);   // the FP8 build's W8 and W8^T
            });
            bad_in_row = 0;
        }
#if defined(PRECISION_FP8)
        Fp8StatsSummary fp8_summary = {0, 0, "", ""};
        if (fp8_stats_step) {   // counted over this step's casts, W after its update
            fp8_summary = model_fp8_stats_write(&ranks[0].model, step, fp8_csv);
            model_fp8_stats_end(&ranks[0].model);
        }
#endif
        if (profile_step) profile_end(&profile);
        on_ranks(ranks, [&](TrainRank& r) { cudaCheck(cudaStreamSynchronize(r.model.stream)); });
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (profile_step) {
            result.profiled = true;
            result.profile = profile_report(&profile);
            profile_print(result.profile, strprintf("profile of step %d (PRECISION=%s, %d micro-batch%s of %d x %d tokens%s): %.3f ms on "
                                                    "the host clock", step, BUILD_PRECISION == 8 ? "FP8" : "BF16", accum,
                                                    accum > 1 ? "es" : "", B, T, P > 1 ? ", GPU 0 of the tensor-parallel group" : "",
                                                    ms).c_str());
        }
        double tokens_per_s = tokens_per_step / (ms / 1000.0);
        double tflops = flops_per_token * tokens_per_s / 1e12;
        const double mfu = peak.tflops > 0 ? 100.0 * tflops / (peak.tflops * P) : NAN;   // percent; NaN: no peak known
        if (step > first_step) { time_sum += ms; timed_steps++; }
        result.losses.push_back(loss);
        result.grad_norms.push_back(grad_norm);
        result.lrs.push_back(lr);
        result.last_step = step;
        printf("step %5d/%d | loss %.4f | lr %.3e | grad norm %.4f | %.1f ms | %.0f tok/s | %.1f TFLOP/s%s%s\n", step, o.steps,
               loss, lr, grad_norm, ms, tokens_per_s, tflops, std::isnan(mfu) ? "" : strprintf(" | MFU %.1f%%", mfu).c_str(),
               bad ? strprintf(" | non-finite: update skipped (%lld in a row)", (long long)bad_in_row).c_str() : "");

#if defined(PRECISION_FP8)
        if (fp8_stats_step)
            printf("step %5d | fp8: worst saturated %.2e (%s), worst flushed to zero %.2e (%s)\n", step, fp8_summary.worst_saturated,
                   fp8_summary.saturated_at.c_str(), fp8_summary.worst_flushed, fp8_summary.flushed_at.c_str());
#endif
        bool last = step == last_step;
        float val = NAN;
        if ((o.eval_every > 0 && step % o.eval_every == 0) || last) {
            val = evaluate();
            result.val_losses.push_back({step, val});
            printf("step %5d | val loss %.4f\n", step, val);
        }
        if (log) {
            fprintf(log, "%d,%.6f,%s,%.6e,%.6f,%.3f,%.1f,%.3f,%d,%s\n", step, loss, std::isnan(val) ? "" : strprintf("%.6f", val).c_str(),
                    lr, grad_norm, ms, tokens_per_s, tflops, bad ? 1 : 0, std::isnan(mfu) ? "" : strprintf("%.2f", mfu).c_str());
            fflush(log);
        }
        if (o.sample_every > 0 && (step % o.sample_every == 0 || last)) {
            on_ranks(ranks, [&](TrainRank& r) {   // every rank draws the same tokens from its own copy of the RNG
                r.sample_rng = sample_rng;
                r.sample = sample_text(&r.model, prompt, o.sample_tokens, o.temperature, &r.sample_rng, r.d_inputs, r.d_logits);
            });
            sample_rng = ranks[0].sample_rng;
            printf("---- sample at step %d ----\n%s%s\n-------------------------\n", step, tokens_to_text(prompt, V).c_str(),
                   tokens_to_text(ranks[0].sample, V).c_str());
        }
        if (bad_in_row >= o.max_bad_steps) {
            // No checkpoint now: the last one holds the weights from before the trouble (skipped steps change
            // no weights), and resuming from it with a lower --lr is the usual fix.
            printf("stopping: %lld non-finite steps in a row (--max-bad-steps %d), %lld in the whole run.%s\n",
                   (long long)bad_in_row, o.max_bad_steps, (long long)result.bad_steps,
                   o.out.empty() ? "" : strprintf(" The last checkpoint in %s is kept as it was; resume from it with a lower --lr.",
                                                  o.out.c_str()).c_str());
            result.stopped_on_bad_steps = true;
            break;
        }
        if (!o.out.empty() && ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || last)) {
            run.step = step;
            run.bad_steps = result.bad_steps;
            run.bad_in_row = bad_in_row;
            DataLoaderState s = dataloader_get_state(&train_data);
            run.loader_epoch = s.epoch;
            run.loader_position = s.position;
            run.sample_rng = sample_rng;
            std::vector<const AdamW*> opts;
            std::vector<Model*> models;
            for (TrainRank& r : ranks) {
                opts.push_back(&r.opt);
                models.push_back(&r.model);
            }
            checkpoint_save(o.out, run, opts, models);
            printf("checkpoint: %s (step %d)\n", checkpoint_path(o.out).c_str(), step);
        }
    }
    profile_destroy(&profile);
    if (timed_steps > 0) result.tokens_per_s = tokens_per_step / (time_sum / timed_steps / 1000.0);
    if (result.bad_steps > 0) printf("non-finite steps skipped in this run so far: %ld\n", result.bad_steps);

    if (log) fclose(log);
#if defined(PRECISION_FP8)
    if (fp8_csv) fclose(fp8_csv);
#endif
    on_ranks(ranks, [&](TrainRank& r) {
        cudaCheck(cudaFree(r.d_inputs));   // and d_targets
        for (int i = 0; i < 2; i++) {
            cudaCheck(cudaFreeHost(r.h_batch[i]));
            cudaCheck(cudaEventDestroy(r.batch_copied[i]));
        }
        cudaCheck(cudaFree(r.d_losses));
        cudaCheck(cudaFreeHost(r.h_losses));
        if (r.d_logits) cudaCheck(cudaFree(r.d_logits));
        adamw_destroy(&r.opt);
        model_destroy(&r.model);
        dataloader_free(&r.val_data);
    });
    if (!groups.empty()) tp_groups_destroy(&groups);
    cudaCheck(cudaSetDevice(0));
    dataloader_free(&train_data);
    dataloader_free(&val_data);
    return result;
}

// ----------------------------------------------------------------------------------------------
// 6. main

#ifndef TESTING
int main(int argc, char** argv) {
    TrainOptions o;
    std::string err = parse_args(argc, argv, &o);
    if (!err.empty()) {
        fprintf(stderr, "error: %s\n", err.c_str());
        return EXIT_FAILURE;
    }
    if (o.help) {
        print_help(argv[0]);
        return 0;
    }
    if (o.prepare) {
        err = prepare_byte_shards(o.prepare_text.c_str(), o.prepare_prefix.c_str());
        if (!err.empty()) fail("%s", err.c_str());
        return 0;
    }
    TrainResult r = train(o);
    return r.stopped_on_bad_steps ? EXIT_FAILURE : 0;
}
#endif
#endif  // TRAIN_FP8_CU
