// train_fp8.cu: the training program. LLaMA-2 pretraining on one GPU or tensor-parallel over the GPUs of one
// machine (--tp N: one host thread per GPU, NCCL), FP8 or BF16 by build.
//   ./train_fp8 prepare TEXT OUT_PREFIX     any text file -> byte-level token shards (train 90%, val 10%); with
//                                            --vocab N or --tokenizer FILE.model, tokens of a SentencePiece tokenizer
//                                            (scripts/tokenizer.py)
//   ./train_fp8 [flags]                      train (./train_fp8 --help lists the flags and their defaults;
//                                            --dry-run makes every check that needs no GPU, and stops there)
//   ./train_fp8 export CKPT OUT_DIR [--format hf|llama2c] [--dtype bf16|fp32]   the model for transformers / llama2.c
//   ./train_fp8 probe [CKPT] [flags]         what each FP8 GEMM loses against BF16, per layer (FP8 build)
// Sections:
//   1. the command line        TrainOptions, a table of flags, parse_args, print_help, the size limits
//   2. evaluation, sampling
//   3. the run                 the NCCL groups of tensor parallelism; the run folder and resume checks; train():
//                              data, the ranks (model and AdamW per GPU), the loop, logging, checkpoints, the stop
//                              on SIGINT or SIGTERM
//   4. the probe               the SQNR of every FP8 GEMM against BF16 on one batch (./train_fp8 probe)
//   5. main
// The checkpoint format, the checkpoint files, the run's CSV logs and export are checkpoint.h's, included after
// section 1.
// test_fp8.cu includes this file with TESTING defined (no main), and calls parse_args, the checkpoint
// functions and train() directly.
#ifndef TRAIN_FP8_CU
#define TRAIN_FP8_CU
#include "fp8_kernels.cuh"
#include "llama2.cuh"
#include "adamw_fp8.cuh"
#include "dataloader.h"
#include "tokenizer.h"
#include <chrono>
#include <numeric>
#include <functional>
#include <thread>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <csignal>
#include <set>
#include <dirent.h>
#include <fcntl.h>
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

// The FP8 doctor's default thresholds (section 3, Fp8Doctor). Saturation clips the largest values, which carry the
// most; flushing zeroes the smallest, which carry little: a 1B run's wqkv dY (E5M2) flushes up to 2.2% of its values
// while the probe measures its GEMM at E5M2's own SQNR.
constexpr double FP8_WARN_SATURATED = 1e-3, FP8_WARN_FLUSHED = 5e-2;
constexpr int FP8_WARN_AFTER = 3;

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
    float weight_decay = AdamWConfig().weight_decay;   // the optimizer's recipe (adamw_fp8.cuh), one place
    float grad_clip = AdamWConfig().grad_clip;         // global-norm clip; 0 = off
    long seed = 1337;
    std::string out;                         // DIR: log.csv and the checkpoints; empty = no files
    int eval_every = 100;                    // 0 = only at the last step
    int eval_batches = 20;
    int sample_every = 250;                  // 0 = never
    int sample_tokens = 256;
    std::string prompt = "In the beginning";   // the samples' first words (with a tokenizer or bytes)
    std::string tokenizer;                   // FILE.model; empty: beside the data, or the resumed run's copy (train_find_tokenizer)
    float temperature = 0.8f;                // 0 = greedy
    int checkpoint_every = 500;              // 0 = only at the end (checkpoints need --out)
    int keep_checkpoints = 2;                // the newest K checkpoint files stay; 0 = all
    std::string resume;                      // a run's DIR (its newest checkpoint) or one checkpoint file
    int stop_after = 0;                      // end after this step, keeping --steps' schedule; 0 = --steps
    int max_bad_steps = 5;                   // non-finite steps in a row that stop the run
    // optimizer storage and variants (adamw_fp8.cuh); the moment defaults are the build's recipe
    std::string m_dtype = moment_dtype_flag(AdamWConfig().m_dtype);
    std::string v_dtype = moment_dtype_flag(AdamWConfig().v_dtype);
    bool update_clip = false;
    bool adam_atan2 = false;
    // the FP8 linear layers (llama2.cuh, Fp8Options; FP8 build only)
    bool fp8_all_layers = false;
    bool fp8_attention = false;              // attention's forward on FP8 tensor cores (attention.cuh; Hopper builds)
    bool bf16_linears = false;               // FP8 build, every linear in BF16: the control of an ablation
    int amax_history = 1;                    // 1 = current scaling; more: delayed scaling from this many amaxes
    int quant_interval = 1;                  // delayed scaling: recompute the scales every this many steps
    int fp8_fast_accum = 1;                  // fast accumulation in the forward FP8 GEMMs (1) or split (0)
    std::string scaling = "tensor";          // FP8 scales: tensor (one per tensor, current or delayed) or block (1x128 tiles
                                             // of X and dY, 128x128 blocks of W: fp8_kernels.cuh 3b)
    bool block_scale_pow2 = false;           // --scaling block: the tiles' scales rounded down to powers of two
    std::string dy_format = "e5m2";          // dY's FP8 format: e5m2, or e4m3 (--scaling block only)
    std::string block_dw_x = "tiles";        // --scaling block: dW's X^T operand in 1x128 tiles along the tokens, or 128x128 blocks
    int fp8_stats = BUILD_FP8 ? 50 : 0;      // every this many steps: the FP8 tensors' health, to DIR/fp8_stats.csv and the
                                             // warnings below; 0 = off
    double fp8_warn_saturated = FP8_WARN_SATURATED;   // warn when a tensor's saturated fraction is above this ...
    double fp8_warn_flushed = FP8_WARN_FLUSHED;       // ... or its flushed-to-zero fraction above this ...
    int fp8_warn_after = FP8_WARN_AFTER;              // ... at this many --fp8-stats steps in a row
    // tensor parallelism (llama2.cuh, section 7)
    int tp = 1;                              // GPUs 0..tp-1 through NCCL; 0 = one GPU without NCCL
    bool tp_amax_sync = false;               // FP8: amax of the sharded X and dY = MAX over the TP group
    // the published ablations (README, "Build and flags" and "Recipe lab"): each off by default
    float smooth_quant = 0.0f;               // FP8: SmoothQuant's exponent alpha for the FP8 linears' inputs; 0 = off
    float qkv_clip = 0.0f;                   // clamp the QKV projection's output to [-C, C]; 0 = off
    bool qk_norm = false;                    // RMSNorm with a learned weight on each head of Q and K before RoPE
    std::string init = "normal";             // normal, trunc-normal or torch-default (llama2.cuh, InitKind)
    double init_std = 0.02;                  // the std of normal and trunc-normal (a double: 0.02 is the init's exact constant)
    bool wd_constant_lr = false;             // weight decay with the peak LR at every step
    int amax_warmup = 0;                     // FP8 delayed scaling: current-scaled casts for the first N steps; 0 = off
    int profile = 0;                         // time the phases of this step and print a table; 0 = off
    int cuda_graph = 1;                      // replay each micro-batch from a CUDA graph (0: launch kernel by kernel)
    // prepare subcommand
    bool prepare = false;
    std::string prepare_text, prepare_prefix;
    int vocab = BYTE_VOCAB;                  // prepare: 256 = bytes; else train a SentencePiece tokenizer of this size
    // export subcommand (checkpoint.h, section 3)
    bool do_export = false;
    std::string export_ckpt, export_dir;
    std::string export_format = "hf";        // hf or llama2c
    std::string export_dtype;                // bf16 or fp32; empty = the format's default (hf bf16, llama2c fp32)
    bool force = false;                      // export and prepare: write over existing output files
    // probe subcommand (section 4)
    bool probe = false;
    std::string probe_ckpt;                  // a checkpoint file or run folder; empty: the weights of --init and --seed
    bool help = false;                       // --help: training's flags, or the usage of prepare, export or probe
    bool dry_run = false;                    // --dry-run: every check before the GPU work, then exit
    std::vector<std::string> warnings;       // what parse_args accepted but the user should hear (main prints them)
    std::vector<std::string> command;        // the command line's words, for the line that says how to resume
};

enum TrainFlagKind { FLAG_INT, FLAG_LONG, FLAG_FLOAT, FLAG_DOUBLE, FLAG_STRING, FLAG_SWITCH /* no value: sets a bool */ };
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
inline TrainFlag flag_double(const char* n, const char* v, const char* h, double* t, double lo, double hi) { return {n, v, h, FLAG_DOUBLE, t, lo, hi}; }
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
        flag_string("--out", "DIR", "write DIR/log.csv and the checkpoints DIR/ckpt-STEP.bin (none if empty)", &o->out),
        flag_int("--eval-every", "N", "validation loss every N steps (0 = only at the end)", &o->eval_every, 0, BIG),
        flag_int("--eval-batches", "N", "validation batches per evaluation", &o->eval_batches, 1, BIG),
        flag_int("--sample-every", "N", "print a sample every N steps (0 = never)", &o->sample_every, 0, BIG),
        flag_int("--sample-tokens", "N", "tokens per sample", &o->sample_tokens, 1, BIG),
        flag_float("--temperature", "X", "sampling temperature (0 = greedy)", &o->temperature, 0, 100),
        flag_string("--prompt", "TEXT", "the samples' first words, encoded by the tokenizer (or as bytes); <s> goes first", &o->prompt),
        flag_string("--tokenizer", "FILE.model", "the data's SentencePiece tokenizer: decodes the samples, encodes --prompt, copied to DIR/tokenizer.model for resume and export (default: PREFIX.model beside the first --data shard PREFIX_train*.bin, else tokenizer.model there; a resumed run's copy). prepare: encode TEXT with it", &o->tokenizer),
        flag_int("--checkpoint-every", "N", "checkpoint every N steps, and at the end (0 = end only; needs --out)", &o->checkpoint_every, 0, BIG),
        flag_int("--keep-checkpoints", "K", "keep the newest K checkpoints (and DIR/latest naming the newest); 0 = all", &o->keep_checkpoints, 0, BIG),
        flag_string("--resume", "DIR|FILE", "continue from DIR's newest checkpoint (DIR/latest), or from a checkpoint file (--out defaults to its folder)", &o->resume),
        flag_int("--stop-after", "N", "stop after step N, keeping the schedule of --steps (0 = --steps)", &o->stop_after, 0, BIG),
        flag_int("--max-bad-steps", "N", "stop after N non-finite steps in a row", &o->max_bad_steps, 1, BIG),
        flag_string("--m-dtype", "TYPE", "AdamW first moment: e4m3 (per-tensor scale), bf16, fp32", &o->m_dtype),
        flag_string("--v-dtype", "TYPE", "AdamW second moment: bf16, e4m3, e5m2 (FP8 store sqrt(v)), fp32", &o->v_dtype),
        flag_switch("--update-clip", "AdamW update clipping: each tensor's update / max(1, its RMS)", &o->update_clip),
        flag_switch("--adam-atan2", "Adam-atan2 update: atan2(m, sqrt(v)), no eps", &o->adam_atan2),
        flag_switch("--fp8-all-layers", "FP8 in every decoder layer (default: first and last in BF16; FP8 build)", &o->fp8_all_layers),
        flag_switch("--bf16-linears", "every linear layer in BF16, as the BF16 build runs them, the rest of the FP8 build kept (its optimizer's E4M3 first moment too): an ablation's control (FP8 build)", &o->bf16_linears),
        flag_switch("--fp8-attention", "attention's forward on FP8 tensor cores: Q, K, V and P in E4M3, in the layers whose linears are FP8 (the backward stays BF16; FP8 build for GPU_ARCH=sm_90a)", &o->fp8_attention),
        flag_int("--amax-history", "N", "FP8 scales from the max of the last N amaxes (1 = current scaling; FP8 build)", &o->amax_history, 1, FP8_MAX_HISTORY),
        flag_int("--quant-interval", "N", "FP8 delayed scaling: new scales every N steps (FP8 build)", &o->quant_interval, 1, BIG),
        flag_int("--fp8-fast-accum", "0|1", "fast accumulation in the forward FP8 GEMMs (backward: always split; FP8 build)", &o->fp8_fast_accum, 0, 1),
        flag_string("--scaling", "tensor|block", "FP8 scale granularity: tensor (one scale per tensor, current or delayed) or block (DeepSeek-V3's: a scale per 1x128 tile of X and dY along each GEMM's K, per 128x128 block of W, each from its own amax; current scaling, no fast accumulation; linear widths and B*T multiples of 128; FP8 build)", &o->scaling),
        flag_switch("--block-scale-pow2", "--scaling block: each tile's and block's scale rounded down to a power of two (default: 448 or 57344 / amax in FP32; FP8 build)", &o->block_scale_pow2),
        flag_string("--dy-format", "e5m2|e4m3", "FP8 format of the output gradients dY: e5m2, or e4m3 (one more mantissa bit, the range of a tile being narrow; --scaling block only; FP8 build)", &o->dy_format),
        flag_string("--block-dw-x", "tiles|blocks", "--scaling block: the X^T that the dW GEMM reads in 1x128 tiles along the tokens (default), or in 128x128 blocks, so that dW pairs tiles with blocks as Y and dX do (FP8 build)", &o->block_dw_x),
        flag_int("--fp8-stats", "K", "every K steps: amax, scale, saturated and flushed fractions per FP8 tensor to DIR/fp8_stats.csv, a summary line, and the warnings below (--scaling block: no scale, the tiles have theirs; both layouts' codes counted; 0 = off; FP8 build)", &o->fp8_stats, 0, BIG),
        flag_double("--fp8-warn-saturated", "F", "warn when an FP8 tensor's saturated fraction is above F at --fp8-warn-after --fp8-stats steps in a row (FP8 build)", &o->fp8_warn_saturated, 0, 1),
        flag_double("--fp8-warn-flushed", "F", "warn when an FP8 tensor's fraction of non-zero values flushed to zero is above F, likewise (FP8 build)", &o->fp8_warn_flushed, 0, 1),
        flag_int("--fp8-warn-after", "N", "the --fp8-stats steps in a row that make a warning; one per tensor until it recovers (FP8 build)", &o->fp8_warn_after, 1, BIG),
        flag_int("--tp", "N", "tensor parallelism over GPUs 0..N-1: NCCL, one thread per GPU, heads and FFN split (1 = one GPU through NCCL; 0 = one GPU without NCCL)", &o->tp, 0, 1024),
        flag_switch("--tp-amax-sync", "FP8 under --tp: scales of the sharded X and dY from the MAX of amax over the GPUs (default: each GPU its own; FP8 build)", &o->tp_amax_sync),
        flag_string("--format", "hf|llama2c", "export only: transformers (config.json + model.safetensors) or llama2.c (model.bin + tokenizer.bin)", &o->export_format),
        flag_string("--dtype", "bf16|fp32", "export only: the weights' type (hf: bf16; llama2c: fp32 only)", &o->export_dtype),
        flag_switch("--force", "export and prepare only: write into an OUT_DIR that holds files, or over existing OUT_PREFIX shards", &o->force),
        flag_int("--vocab", "N", "prepare only: train a SentencePiece BPE tokenizer of N pieces on TEXT, as LLaMA-2's (scripts/tokenizer.py; 256: bytes, no tokenizer)", &o->vocab, BYTE_VOCAB, 65536),
        flag_float("--smooth-quant", "ALPHA", "SmoothQuant for the FP8 linears: X/s and W*s per input channel, s = amax(X)^ALPHA / amax(W)^(1-ALPHA) (X's of the last step) rounded to a power of two, new with the weights every step (0 = off; FP8 build)", &o->smooth_quant, 0, 1),
        flag_float("--qkv-clip", "C", "clamp the QKV projection's output to [-C, C] before RoPE; no gradient where clamped (0 = off)", &o->qkv_clip, 0, 1e30),
        flag_switch("--qk-norm", "RMSNorm with a learned weight on each head of Q and of K before RoPE (one [head_dim] weight for Q and one for K per layer; not with --tp > 1, not exportable)", &o->qk_norm),
        flag_string("--init", "KIND", "weight init: normal (N(0, S), wo and w_down x 1/sqrt(2L)), trunc-normal (the same, resampled within 2 std), torch-default (nn.Linear's U(-1/sqrt(in), 1/sqrt(in)), embedding N(0, 1))", &o->init),
        flag_double("--init-std", "S", "std S of --init normal and trunc-normal", &o->init_std, 1e-30, 100),
        flag_switch("--wd-constant-lr", "weight decay with the peak --lr at every step; the gradient step keeps the schedule", &o->wd_constant_lr),
        flag_int("--amax-warmup", "N", "FP8 delayed scaling: current scaling for the first N steps while their amaxes fill the history (0 = off; needs --amax-history > 1; FP8 build)", &o->amax_warmup, 0, BIG),
        flag_int("--profile", "N", "time the phases of step N on the GPU (CUDA events) and print a table, each phase beside its floor (its FLOPs or bytes at this GPU's GEMM and copy rates, measured at the start) (0 = off)", &o->profile, 0, BIG),
        flag_int("--cuda-graph", "0|1", "replay each micro-batch's forward and backward from a CUDA graph captured once (0: launch every kernel every time)", &o->cuda_graph, 0, 1),
    };
}

inline std::string flag_value_string(const TrainFlag& f) {
    switch (f.kind) {
        case FLAG_INT: return std::to_string(*(int*)f.target);
        case FLAG_LONG: return std::to_string(*(long*)f.target);
        case FLAG_FLOAT: return strprintf("%g", *(float*)f.target);
        case FLAG_DOUBLE: return strprintf("%g", *(double*)f.target);
        case FLAG_STRING: return *(std::string*)f.target;
        case FLAG_SWITCH: return *(bool*)f.target ? "on" : "off";
    }
    return "";
}

// --help: training's flags; prepare --help and export --help: the usage of the subcommand.
inline void print_help(const char* argv0, const TrainOptions& o) {
    TrainOptions defaults;
    auto usage = [](const TrainFlag& f) { return f.kind == FLAG_SWITCH ? std::string(f.name) : std::string(f.name) + " " + f.value_name; };
    auto print_flags = [&](std::initializer_list<const char*> names) {   // the lines of the table's flags `names`
        for (const TrainFlag& f : train_flags(&defaults))
            for (const char* name : names)
                if (strcmp(f.name, name) == 0) printf("  %-22s %s\n", usage(f).c_str(), f.help);
    };
    if (o.prepare) {
        printf("usage: %s prepare TEXT OUT_PREFIX [--vocab N | --tokenizer FILE.model] [--force]\n"
               "  TEXT as tokens: the first 90%% to OUT_PREFIX_train.bin, the last 10%% to OUT_PREFIX_val.bin (token shards for\n"
               "  --data and --val-data, their headers naming the vocabulary). By default any file as bytes (vocab 256); with\n"
               "  --vocab N or --tokenizer, UTF-8 text as <s> and the tokens of a SentencePiece BPE tokenizer, which goes to\n"
               "  OUT_PREFIX.model (training finds it there): python3 scripts/tokenizer.py does this (pip install -r\n"
               "  scripts/requirements.txt)\n", argv0);
        print_flags({"--vocab", "--tokenizer", "--force"});
        return;
    }
    if (o.probe) {
        printf("usage: %s probe [CKPT] [flags]\n"
               "  one batch (the first of --val-data) through the model in BF16; each linear's X, W and dY from that pass through\n"
               "  its FP8 GEMMs (E4M3 X and W, E5M2 dY, scales from each tensor's amax; and block scaling's, 1x128 tiles and 128x128\n"
               "  blocks with dY in E5M2 and in E4M3, where the widths and B x T are multiples of 128) and its BF16 GEMMs: the SQNR of FP8\n"
               "  against BF16 in dB for Y, dX and dW of every linear of every layer under each scaling, and what blocks gain over\n"
               "  one scale per tensor (a table; DIR/probe.csv with --out DIR, drawn by scripts/plot_fp8_stats.py probe), and the\n"
               "  loss of the FP8 recipe against all-BF16 linears on that batch. A shape that does not tile leaves the block columns\n"
               "  empty and says why.\n"
               "  CKPT: a checkpoint file or a run's folder (its newest); none: the weights of --init and --seed\n", argv0);
        print_flags({"--val-data", "--batch", "--seq", "--fp8-all-layers"});
        printf("  %-22s write the table to DIR/probe.csv (replacing one there)\n", "--out DIR");
        printf("  without CKPT also the model and its init, as in training: --model, --dim, --layers, --heads, --kv-heads, --ffn,\n"
               "  --qk-norm, --qkv-clip, --init, --init-std, --seed, --fp8-fast-accum (a checkpoint brings its own)\n");
        return;
    }
    if (o.do_export) {
        printf("usage: %s export CKPT OUT_DIR [--format hf|llama2c] [--dtype bf16|fp32] [--force]\n"
               "  the model of checkpoint CKPT (a file, or a run's folder: its newest checkpoint), into folder OUT_DIR\n", argv0);
        print_flags({"--format", "--dtype", "--force"});
        return;
    }
    printf("usage: %s [flags]                   train (defaults: the King James Bible, bytes, preset %s)\n", argv0, defaults.model.c_str());
    printf("       %s prepare TEXT OUT_PREFIX [--vocab N | --tokenizer FILE.model] [--force]\n"
           "                                        write OUT_PREFIX_train.bin / OUT_PREFIX_val.bin (last 10%% val): bytes, or\n"
           "                                        the tokens of a SentencePiece tokenizer (OUT_PREFIX.model)\n", argv0);
    printf("       %s export CKPT OUT_DIR [--format hf|llama2c] [--dtype bf16|fp32] [--force]\n"
           "                                        the model of checkpoint CKPT (a file, or a run's folder: its newest)\n"
           "                                        for transformers (hf) or llama2.c's run (llama2c), into OUT_DIR\n", argv0);
    printf("       %s probe [CKPT] [flags]\n"
           "                                        the SQNR of every FP8 GEMM against BF16 on one batch, per layer\n", argv0);
    printf("       (prepare --help, export --help, probe --help: the usage of each)\n");
    printf("flags (default in brackets):\n");
    for (const TrainFlag& f : train_flags(&defaults)) {
        std::string def = flag_value_string(f);
        printf("  %-22s %s [%s]\n", usage(f).c_str(), f.help, def.empty() ? "none" : def.c_str());
    }
    printf("  %-22s check the flags, the data, --out and --resume (all that can be checked before the GPU), then exit\n", "--dry-run");
    printf("  %-22s this text\n", "--help");
    printf("A run stops on SIGINT (Ctrl-C) or SIGTERM after its current step, writes a checkpoint (with --out) and prints\n"
           "the command that resumes it; a second signal stops it at once.\n");
    printf("Each step prints its time, tokens/s, model TFLOP/s and MFU; the run ends with a summary line over the steps that\n"
           "ran as later steps run (not the first, not CUDA-graph captures, --profile or --fp8-stats steps): mean and median\n"
           "ms, tokens/s, TFLOP/s and MFU at the mean, GPU memory. Model FLOPs per token: 6 x the matmul parameters (all\n"
           "but the embedding) + 6 x layers x dim x T for causal attention (a token attends to T/2 keys on average).\n");
}

inline int grad_accum_steps(const TrainOptions& o) { return (int)(o.total_batch / ((long)o.batch * o.seq)); }

// The folder part of a path ("." if it has none).
inline std::string path_folder(const std::string& path) {
    size_t slash = path.find_last_of('/');
    return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

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
    c.qk_norm = o.qk_norm;
    c.qkv_clip = o.qkv_clip;
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
    if (f.kind == FLAG_FLOAT || f.kind == FLAG_DOUBLE) {
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
    else if (f.kind == FLAG_DOUBLE) *(double*)f.target = v;
    else *(float*)f.target = (float)v;
    return "";
}

// ---- Sizes held in 32 bits. Tensor sizes are 64-bit throughout; the sizes that stay 32-bit are refused here, at
// start-up, naming the flags that set them and the limit, rather than wrapping around or failing at a kernel launch:
//   tokens per micro-batch N = B*T   the row count of the activation GEMMs (int), and of the FP8 cast+transpose of X and
//                                    dY, whose grid has one y-index per CT_TILE rows (CUDA allows 65535): N <= 65535 * 64
//                                    (in both builds, so that a BF16 run can always be repeated in FP8)
//   sequences per micro-batch B      the attention grids' z-dimension: B <= 65535
//   rows of a weight (QKV, 2F, D)    the FP8 cast+transpose of W: the same limit
//   shard offsets under --tp N       (N-1) x max(dim, ffn) in int (model_shard_map)
//   micro-batches per step           an int: --total-batch / (B*T) <= 2^31 - 1
// (--seq, --steps and each model width are ints by their flags' ranges.)
// The parameter count is capped too (its table is small once model_config_problem has capped the layers):
constexpr double MAX_PARAMS = 1e12;   // 4 TB of FP32 master weights alone
constexpr long MAX_GRID_YZ = 65535;
constexpr long MAX_CAST_TRANSPOSE_ROWS = MAX_GRID_YZ * CT_TILE;
inline std::string train_size_problem(const TrainOptions& o, const ModelConfig& c) {
    const long B = o.batch, N = B * o.seq;
    if (B > MAX_GRID_YZ)
        return strprintf("--batch %d: at most %ld sequences per micro-batch (the attention kernels' grid z-dimension); "
                         "put more tokens into a step with --total-batch", o.batch, MAX_GRID_YZ);
    if (N > MAX_CAST_TRANSPOSE_ROWS)
        return strprintf("--batch %d x --seq %d = %ld tokens per micro-batch: at most %ld (65535 x %d, the grid y-limit of the "
                         "FP8 cast+transpose); lower --batch and raise --total-batch", o.batch, o.seq, N,
                         MAX_CAST_TRANSPOSE_ROWS, CT_TILE);
    if (o.total_batch / N > INT_MAX)
        return strprintf("--total-batch %ld: %ld micro-batches of B*T = %ld tokens per step, at most %d", o.total_batch,
                         o.total_batch / N, N, INT_MAX);
    const long qkv = (c.n_heads + 2L * c.n_kv_heads) * c.head_dim, gate_up = 2L * c.ffn_dim;
    if (std::max({qkv, gate_up, (long)c.dim}) > MAX_CAST_TRANSPOSE_ROWS)
        return strprintf("--dim %d --heads %d --kv-heads %d --ffn %d: weights of %ld (wqkv), %ld (w_gate_up) and %d (wo, "
                         "w_down) rows; at most %ld (the grid y-limit of the FP8 cast+transpose)", c.dim, c.n_heads,
                         c.n_kv_heads, c.ffn_dim, qkv, gate_up, c.dim, MAX_CAST_TRANSPOSE_ROWS);
    if ((long)(std::max(1, o.tp) - 1) * std::max(c.dim, c.ffn_dim) > INT_MAX)
        return strprintf("--tp %d with --dim %d and --ffn %d: the shard offsets ((N-1) x max(dim, ffn) = %ld) exceed %d",
                         o.tp, c.dim, c.ffn_dim, (long)(o.tp - 1) * std::max(c.dim, c.ffn_dim), INT_MAX);
    const double params = (double)model_num_params(c);
    if (params > MAX_PARAMS)
        return strprintf("--dim %d --layers %d --ffn %d: %.3g parameters, at most %.0e (4 TB of FP32 master weights alone)", c.dim,
                         c.n_layers, c.ffn_dim, params, MAX_PARAMS);
    return "";
}

// Fills *o from argv; returns "" or the reason for rejecting the command line (naming the flag and value).
//   prepare TEXT OUT_PREFIX [--vocab N] [--tokenizer F] [--force]   two words, then only those three flags
//   export CKPT OUT_DIR [--format F] [--dtype T] [--force]   two words, then only those three flags
//   [flags]                                                  training: every flag but --format, --dtype and --force
// --help (or -h) anywhere asks for the usage: of prepare or export after their names, else of training.
// probe's flags (section 4): its batch, the FP8 layers of its FP8 loss, the folder of probe.csv; without a
// checkpoint also the model and its init. "" or what is wrong.
inline std::string probe_args_problem(const TrainOptions& o, const std::vector<std::string>& given) {
    if (!BUILD_FP8) return "probe compares the FP8 linears with BF16 ones: it needs the FP8 build (make, not make PRECISION=BF16)";
    const std::set<std::string> always = {"--val-data", "--batch", "--seq", "--out", "--fp8-all-layers"};
    const std::set<std::string> model = {"--model", "--dim", "--layers", "--heads", "--kv-heads", "--ffn", "--qk-norm", "--qkv-clip",
                                         "--init", "--init-std", "--seed", "--fp8-fast-accum"};
    for (const std::string& name : given) {
        if (model.count(name) && !o.probe_ckpt.empty())
            return strprintf("probe %s %s: the checkpoint fixes the model and its weights; drop %s", o.probe_ckpt.c_str(),
                             name.c_str(), name.c_str());
        if (!always.count(name) && !model.count(name))
            return strprintf("probe takes --val-data, --batch, --seq, --out, --fp8-all-layers and, without a checkpoint, the "
                             "model, init and --fp8-fast-accum flags; not %s (probe --help says more)", name.c_str());
    }
    return "";
}

// --scaling block against the other FP8 flags, and its shapes: "" or what is wrong. A tile's scale comes from the tile's own
// amax at every cast: no amax history (--amax-history, --quant-interval, --amax-warmup), no tensor amax to share over a TP
// group, no SmoothQuant (its channel scales are per-tensor casts'), no fast accumulation (cuBLASLt's block-scaled GEMMs have
// none). --block-scale-pow2, --dy-format e4m3 and --block-dw-x blocks need it.
inline std::string train_block_scaling_problem(TrainOptions* o, const std::vector<std::string>& given) {
    if (o->scaling != "block") {
        if (o->block_scale_pow2) return "--block-scale-pow2 rounds the scales of --scaling block's tiles: add --scaling block";
        if (o->dy_format != "e5m2")
            return strprintf("--dy-format %s needs --scaling block (one scale for a whole dY needs E5M2's range)", o->dy_format.c_str());
        if (o->block_dw_x != "tiles") return "--block-dw-x blocks chooses the scales of --scaling block's dW operand: add --scaling block";
        return "";
    }
    auto was_given = [&](const char* name) { return std::find(given.begin(), given.end(), name) != given.end(); };
    if (o->amax_history > 1 || o->quant_interval > 1 || o->amax_warmup > 0)
        return "--scaling block with --amax-history, --quant-interval or --amax-warmup: block scaling takes each tile's scale from "
               "the tile's own amax at every cast, there is no history; drop those flags";
    if (o->smooth_quant > 0.0f) return "--scaling block with --smooth-quant: SmoothQuant's channel scales go with per-tensor scaling; drop one";
    if (o->tp_amax_sync) return "--scaling block with --tp-amax-sync: a tile's scale needs no amax from the other GPUs; drop --tp-amax-sync";
    if (was_given("--fp8-fast-accum") && o->fp8_fast_accum == 1)
        return "--scaling block with --fp8-fast-accum 1: cuBLASLt's block-scaled GEMMs accumulate split only; drop --fp8-fast-accum";
    const std::string problem = model_block_scaling_problem(model_config_from_options(*o, BYTE_VOCAB), std::max(1, o->tp), (long)o->batch * o->seq);
    return problem.empty() ? "" : "--scaling block: " + problem;
}

inline std::string parse_args(int argc, char** argv, TrainOptions* o) {
    *o = TrainOptions();
    o->command.assign(argv, argv + argc);
    auto is_help = [](const char* a) { return strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0; };
    const bool help = std::any_of(argv + 1, argv + argc, is_help);
    int first = 1;
    if (argc >= 2 && strcmp(argv[1], "prepare") == 0) {
        o->prepare = true;
        o->help = help;
        if (help) return "";
        if (argc < 4 || argv[2][0] == '-' || argv[3][0] == '-')
            return "usage: prepare TEXT OUT_PREFIX [--vocab N | --tokenizer FILE.model] [--force] (a text file and the shards' "
                   "path without its ending; prepare --help says more)";
        o->prepare_text = argv[2];
        o->prepare_prefix = argv[3];
        first = 4;
    }
    if (argc >= 2 && strcmp(argv[1], "export") == 0) {
        o->do_export = true;
        o->help = help;
        if (help) return "";
        if (argc < 4 || argv[2][0] == '-' || argv[3][0] == '-')
            return "usage: export CKPT OUT_DIR [--format hf|llama2c] [--dtype bf16|fp32] [--force] (a checkpoint file or a "
                   "run's folder, and the folder to write; export --help says more)";
        o->export_ckpt = argv[2];
        o->export_dir = argv[3];
        first = 4;
    }
    if (argc >= 2 && strcmp(argv[1], "probe") == 0) {
        o->probe = true;
        first = 2;
        if (argc >= 3 && argv[2][0] != '-') o->probe_ckpt = argv[first++];
    }
    if (help) { o->help = true; return ""; }
    std::vector<TrainFlag> flags = train_flags(o);
    std::vector<std::string> given;
    for (int i = first; i < argc; i++) {
        if (strcmp(argv[i], "--dry-run") == 0 && !o->do_export && !o->probe && !o->prepare) { o->dry_run = true; continue; }
        const TrainFlag* f = nullptr;
        for (const TrainFlag& g : flags) if (strcmp(argv[i], g.name) == 0) f = &g;
        if (!f) return strprintf("unknown argument %s (see --help)", argv[i]);
        given.push_back(f->name);
        if (f->kind == FLAG_SWITCH) { *(bool*)f->target = true; continue; }
        if (i + 1 >= argc) return strprintf("%s needs a value (%s)", f->name, f->value_name);
        std::string err = parse_flag_value(*f, argv[++i]);
        if (!err.empty()) return err;
    }
    auto is_export_flag = [](const std::string& name) { return name == "--format" || name == "--dtype" || name == "--force"; };
    if (o->prepare) {
        for (const std::string& name : given)
            if (name != "--vocab" && name != "--tokenizer" && name != "--force")
                return strprintf("prepare takes only --vocab, --tokenizer and --force, not %s (prepare --help says more)", name.c_str());
        if (o->vocab != BYTE_VOCAB && !o->tokenizer.empty())
            return strprintf("prepare --vocab %d --tokenizer %s: --vocab trains a new tokenizer, --tokenizer uses one: give one "
                             "of the two", o->vocab, o->tokenizer.c_str());
        return "";
    }
    if (o->do_export) {
        for (const std::string& name : given)
            if (!is_export_flag(name)) return strprintf("export takes only --format, --dtype and --force, not %s", name.c_str());
        if (o->export_format != "hf" && o->export_format != "llama2c")
            return strprintf("--format %s: hf (transformers) or llama2c (llama2.c)", o->export_format.c_str());
        if (o->export_dtype.empty()) o->export_dtype = o->export_format == "hf" ? "bf16" : "fp32";
        if (o->export_dtype != "bf16" && o->export_dtype != "fp32")
            return strprintf("--dtype %s: bf16 or fp32", o->export_dtype.c_str());
        if (o->export_format == "llama2c" && o->export_dtype != "fp32")
            return strprintf("--dtype %s with --format llama2c: llama2.c's model.bin holds FP32 weights only",
                             o->export_dtype.c_str());
        return "";
    }
    if (o->probe) {
        std::string err = probe_args_problem(*o, given);
        if (!err.empty()) return err;
    }
    for (const std::string& name : given) {
        if (name == "--force")
            return "--force is an option of export and prepare (./train_fp8 export CKPT OUT_DIR --force, ./train_fp8 prepare "
                   "TEXT OUT_PREFIX --force), not of training";
        if (name == "--vocab")
            return "--vocab is an option of prepare (./train_fp8 prepare TEXT OUT_PREFIX --vocab N); training takes the vocabulary "
                   "from the data";
        if (is_export_flag(name))
            return strprintf("%s is an option of export (./train_fp8 export CKPT OUT_DIR %s ...), not of training",
                             name.c_str(), name.c_str());
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
    const TrainOptions defaults;
    if (o->fp8_attention && !BUILD_FP8)
        return "--fp8-attention: FP8 attention is part of the FP8 build; this is the PRECISION=BF16 build (build with make PRECISION=FP8)";
    if (o->fp8_attention && !attention_hopper_available)
        return "--fp8-attention: FP8 attention runs on the Hopper attention kernels, which this binary lacks; build for an H100 or "
               "H200 with make GPU_ARCH=sm_90a";
    if (!BUILD_FP8 && (o->fp8_all_layers || o->amax_history != 1 || o->quant_interval != 1 || o->fp8_fast_accum != 1 ||
                       o->fp8_stats != 0 || o->fp8_warn_saturated != defaults.fp8_warn_saturated ||
                       o->fp8_warn_flushed != defaults.fp8_warn_flushed || o->fp8_warn_after != defaults.fp8_warn_after ||
                       o->tp_amax_sync || o->amax_warmup != 0 || o->smooth_quant != 0.0f || o->bf16_linears))
        return "--bf16-linears, --fp8-all-layers, --amax-history, --quant-interval, --fp8-fast-accum, --fp8-stats, --fp8-warn-*, --tp-amax-sync, "
               "--amax-warmup and --smooth-quant are FP8 options; this is the PRECISION=BF16 build (build with make PRECISION=FP8)";
    if (o->scaling != "tensor" && o->scaling != "block") return strprintf("--scaling %s: tensor or block", o->scaling.c_str());
    if (o->dy_format != "e5m2" && o->dy_format != "e4m3") return strprintf("--dy-format %s: e5m2 or e4m3", o->dy_format.c_str());
    if (o->block_dw_x != "tiles" && o->block_dw_x != "blocks") return strprintf("--block-dw-x %s: tiles or blocks", o->block_dw_x.c_str());
    if (!BUILD_FP8 && (o->scaling != defaults.scaling || o->block_scale_pow2 || o->dy_format != defaults.dy_format ||
                       o->block_dw_x != defaults.block_dw_x))
        return "--scaling, --block-scale-pow2, --dy-format and --block-dw-x are FP8 options; this is the PRECISION=BF16 build (build with "
               "make PRECISION=FP8)";
    if (init_kind_from_name(o->init) < 0)
        return strprintf("--init %s: normal, trunc-normal or torch-default", o->init.c_str());
    if (o->init == "torch-default" && std::find(given.begin(), given.end(), "--init-std") != given.end())
        return "--init-std with --init torch-default: PyTorch's default init has no std to set (its bounds come from the "
               "layer widths); drop --init-std or choose --init normal or trunc-normal";
    if (o->amax_warmup > 0 && o->amax_history <= 1)
        return strprintf("--amax-warmup %d: a warm-up of delayed scaling needs a history to fill: set --amax-history N > 1 "
                         "(now %d, current scaling at every step already)", o->amax_warmup, o->amax_history);
    if (o->qk_norm && o->tp > 1)
        return strprintf("--qk-norm with --tp %d: the Q and K norm weights are replicated but each rank sees only its own "
                         "heads' gradients, which nothing sums over the group; drop one of the two", o->tp);
    long bt = (long)o->batch * o->seq;
    if (o->total_batch == 0) o->total_batch = bt;
    if (o->total_batch % bt != 0)
        return strprintf("--total-batch %ld: must be a multiple of B*T = %d*%d = %ld", o->total_batch, o->batch, o->seq, bt);
    auto was_given = [&](const char* name) { return std::find(given.begin(), given.end(), name) != given.end(); };
    if (o->warmup > o->steps)
        return strprintf("--warmup %d%s: exceeds --steps %d; give --warmup N with N at most %d", o->warmup,
                         was_given("--warmup") ? "" : " (the default)", o->steps, o->steps);
    if (o->stop_after > o->steps) return strprintf("--stop-after %d: exceeds --steps %d", o->stop_after, o->steps);
    if (o->profile > o->steps) return strprintf("--profile %d: exceeds --steps %d (the step to profile must be run)", o->profile, o->steps);
    if (o->stop_after > 0 && o->profile > o->stop_after)
        return strprintf("--profile %d: after --stop-after %d (the step to profile must be run)", o->profile, o->stop_after);
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
    problem = train_size_problem(*o, model_config_from_options(*o, BYTE_VOCAB));
    if (!problem.empty()) return problem;
    problem = train_block_scaling_problem(o, given);
    if (!problem.empty()) return problem;
    if (o->bf16_linears) {
        if (o->fp8_all_layers || o->fp8_attention || o->amax_history > 1 || o->quant_interval > 1 || o->amax_warmup > 0 ||
            o->smooth_quant > 0.0f || o->tp_amax_sync || o->scaling != "tensor" || was_given("--fp8-fast-accum"))
            return "--bf16-linears with a flag of the FP8 linears (--fp8-all-layers, --fp8-attention, --amax-*, --quant-interval, "
                   "--smooth-quant, --tp-amax-sync, --scaling, --fp8-fast-accum): no linear is FP8; drop one of the two";
        if (was_given("--fp8-stats") && o->fp8_stats > 0)
            return strprintf("--bf16-linears with --fp8-stats %d: no tensor is cast to FP8; drop --fp8-stats", o->fp8_stats);
        o->fp8_stats = 0;
    }
    if (o->tp > 1 && o->update_clip)
        return strprintf("--update-clip with --tp %d: update clipping divides by each tensor's update RMS, which a rank "
                         "sees only for its shard; drop one of the two", o->tp);
    if (o->out.empty() && o->resume.empty() && !o->probe && (was_given("--checkpoint-every") || was_given("--keep-checkpoints")))
        o->warnings.push_back(strprintf("%s without --out: this run saves no checkpoint and no log (add --out DIR)",
                                        was_given("--checkpoint-every") ? "--checkpoint-every" : "--keep-checkpoints"));
    if (o->out.empty()) {   // the resumed run's folder (that of a checkpoint file given by name)
        struct stat st;
        bool is_file = stat(o->resume.c_str(), &st) == 0 && S_ISREG(st.st_mode);
        o->out = is_file ? path_folder(o->resume) : o->resume;
    }
    return "";
}

// ----------------------------------------------------------------------------------------------
// Checkpoints, their files, the run's CSV logs and export (the checks of a checkpoint's header use the limits above).
#include "checkpoint.h"

// ----------------------------------------------------------------------------------------------
// 2. Evaluation and sampling.

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

// Tokens as text: with a tokenizer, its decoding (tokenizer.h); with the byte vocabulary, printable ASCII and newlines
// as they are, other bytes as \xNN; other vocabularies (no tokenizer) as ids.
inline std::string tokens_to_text(const std::vector<int>& tokens, int vocab_size, const Tokenizer* tokenizer) {
    if (tokenizer) return tokenizer_decode(*tokenizer, tokens);
    std::string s;
    for (int t : tokens) {
        if (vocab_size != BYTE_VOCAB) s += strprintf("%d ", t);
        else if (t == '\n' || (t >= 32 && t < 127)) s += (char)t;
        else s += strprintf("\\x%02x", t);
    }
    return s;
}

// ----------------------------------------------------------------------------------------------
// 3. The training run.

// ---- The tensor-parallel groups (--tp N): one NCCL communicator per GPU, from ncclCommInitAll; llama2.cuh, section 7,
// says where the model's all-reduces go.

inline void tp_nccl_all_reduce(const TpGroup* g, void* buf, size_t count, ncclDataType_t type, ncclRedOp_t op, cudaStream_t s) {
    ncclCheck(ncclAllReduce(buf, buf, count, type, op, g->comm, s));
}

// The number of GPUs; where CUDA finds none, a refusal that says so (rather than the runtime's own words: with no
// driver at all, "CUDA driver version is insufficient"). Called once every check that needs no GPU has passed.
inline int cuda_device_count_or_fail() {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e == cudaSuccess && count > 0) return count;
    const char* visible = getenv("CUDA_VISIBLE_DEVICES");
    const std::string hidden = visible ? strprintf(" (CUDA_VISIBLE_DEVICES=%s may hide them)", visible) : "";
    if (e == cudaSuccess || e == cudaErrorNoDevice)
        fail("no CUDA GPU found: the NVIDIA driver lists none%s. Training runs on NVIDIA GPUs; nvidia-smi shows what the "
             "driver sees", hidden.c_str());
    if (e == cudaErrorInsufficientDriver)
        fail("no CUDA GPU found: no NVIDIA driver is loaded, or it is older than the CUDA %d.%d this program was built with "
             "(%s). Training runs on NVIDIA GPUs; nvidia-smi shows the driver and its GPUs", CUDART_VERSION / 1000,
             CUDART_VERSION % 1000 / 10, cudaGetErrorName(e));
    fail("no CUDA GPU found: cudaGetDeviceCount says \"%s\" (%s)%s; nvidia-smi shows what the driver sees",
         cudaGetErrorString(e), cudaGetErrorName(e), hidden.c_str());
}

// The groups of GPUs 0..n-1 (group r on GPU r), after the start-up checks: n GPUs present; every pair able to
// reach each other directly (peer access over NVLink or PCIe). Without peer access NCCL still works, through
// host memory (its SHM transport) at a fraction of the bandwidth: a warning, not an error, because such a
// machine trains correctly, only slower, and some PCIe topologies (GPUs on two CPU sockets) have nothing better.
inline std::vector<TpGroup> tp_groups_create(int n) {
    const int count = cuda_device_count_or_fail();
    if (n > count) fail("--tp %d needs %d GPUs; this machine has %d: lower --tp (CUDA_VISIBLE_DEVICES may hide some)", n, n, count);
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++) {
            int ok = 1;
            if (a != b) cudaCheck(cudaDeviceCanAccessPeer(&ok, a, b));
            if (!ok)
                printf("warning: GPU %d cannot access GPU %d directly (no peer access): NCCL will go through host memory, "
                       "and the all-reduces of --tp %d will be slow\n", a, b, n);
        }
    std::vector<ncclComm_t> comms(n);
    std::vector<int> devices(n);
    for (int r = 0; r < n; r++) devices[r] = r;
    ncclCheck(ncclCommInitAll(comms.data(), n, devices.data()));
    std::vector<TpGroup> groups(n);
    for (int r = 0; r < n; r++) {
        groups[r].size = n;
        groups[r].rank = r;
        groups[r].comm = comms[r];
        groups[r].all_reduce = tp_nccl_all_reduce;
    }
    return groups;
}
inline void tp_groups_destroy(std::vector<TpGroup>* groups) {
    for (TpGroup& g : *groups) ncclCheck(ncclCommDestroy(g.comm));
    groups->clear();
}

// The FP8 linears' options of a run whose first step is `first_step` (a resume's is after 1).
inline Fp8Options fp8_options_from_options(const TrainOptions& o, int first_step) {
    Fp8Options fp8;
    fp8.recipe.history_len = o.amax_history;
    fp8.recipe.interval = o.quant_interval;
    fp8.all_layers = o.fp8_all_layers;
    fp8.attention = o.fp8_attention;
    fp8.enabled = !o.bf16_linears;
    fp8.fast_accum = o.fp8_fast_accum == 1;
    fp8.tp_amax_sync = o.tp_amax_sync;
    fp8.recipe.warmup = first_step <= o.amax_warmup;   // --amax-warmup: steps 1..N cast at current scaling
    fp8.smooth_quant = o.smooth_quant;
    fp8.block_scaling = o.scaling == "block";
    fp8.block_scale_pow2 = o.block_scale_pow2;
    fp8.dy_format = o.dy_format == "e4m3" ? E4M3 : E5M2;
    fp8.block_dw_x = o.block_dw_x == "blocks" ? FP8_BLOCKS_128x128 : FP8_TILES_1x128;
    return fp8;
}

inline AdamWConfig adamw_config_from_options(const TrainOptions& o) {
    AdamWConfig a;
    a.weight_decay = o.weight_decay;
    a.grad_clip = o.grad_clip;
    a.m_dtype = adamw_parse_moment_dtype("--m-dtype", o.m_dtype.c_str());
    a.v_dtype = adamw_parse_moment_dtype("--v-dtype", o.v_dtype.c_str());
    a.update_clip = o.update_clip;
    a.use_atan2 = o.adam_atan2;
    a.decay_lr = o.wd_constant_lr ? o.lr : 0.0f;
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

// ---- The floors of the profile (--profile N): beside each phase's time, the least time its work can take on this GPU.
// The work of one step on the profiled GPU (rank 0's shard under --tp), from the model's shape, B, T, the micro-batches,
// the build and the recipe (step_work):
//   GEMMs, attention  FLOPs, by the precision of the tensor cores they run on: a decoder linear [out, in] on N tokens
//                     2 N out in forward and twice that backward; lm_head 6 N V D (forward and backward); causal attention
//                     2 B H T^2 HD forward (Q K^T and P V over the causal half) and 2.5x that backward (S again, dP, dV,
//                     dQ, dK), the attention bench's convention (model_flops_per_token counts model work: 2x)
//   the others        bytes: each tensor that the phase reads or writes, once, in its dtype. A second pass over a tensor
//                     (the optimizer's moment statistics) is the kernels' cost, which the ratio shows, not the work's; the
//                     one the recipe asks for, current per-tensor scaling's amax pass over a cast's inputs before the cast
//                     reads them again, is counted beside the floor (amax_reread_bytes) and the table gives the time over
//                     both (test_fp8 --bench cast: the fused casts, current against delayed). An FP8 cast with its
//                     transpose writes 1 + 1 bytes an element where a BF16 tensor is 2, so a producer that casts (RMSNorm,
//                     SwiGLU) moves what it moves in the BF16 build. Left out: the norm weights and their gradients (D
//                     values each), the FP8 scales (a float a tensor; under block scaling one per 128 values, 1.6% of a
//                     cast's bytes), the rows of the embedding's gradient (one a distinct token: the data's, not the shape's)
// and at the rates measured when the run starts (measure_gpu_rates): FLOPs at the GEMM peak of their precision, bytes at
// the copy bandwidth. The tensor-parallel all-reduces (NCCL's links) and the input copies (the host's) have no floor.
struct PhaseWork {
    double fp8_flops = 0, bf16_flops = 0, bytes = 0;
    double amax_reread_bytes = 0;      // current per-tensor scaling's amax pass: the cast's inputs read a second time
    const char* unmodeled = nullptr;   // why the phase has no floor; nullptr: it has one
};
// The producers of an FP8 cast, and what current per-tensor scaling's amax pass reads before the cast reads the same
// inputs again, in bytes per element of the producer's output (SwiGLU's backward: per element of its input gradient
// [N, F]): a plain cast and RoPE's backward, the BF16 tensor (2); SwiGLU, gate and up (4); its backward, gate, up and the
// output's gradient (6); RMSNorm nothing (its statistics kernel gathers the amax as it writes resid_out). test_fp8's
// cast benches count their floors with it too.
enum CastProducer { CAST_PLAIN, CAST_RMSNORM, CAST_SWIGLU, CAST_SWIGLU_BACKWARD, CAST_ROPE_BACKWARD };
inline double cast_amax_reread_bytes(CastProducer p) {
    switch (p) {
        case CAST_PLAIN: case CAST_ROPE_BACKWARD: return 2;
        case CAST_SWIGLU: return 4;
        case CAST_SWIGLU_BACKWARD: return 6;
        case CAST_RMSNORM: return 0;
    }
    return 0;
}

inline std::vector<PhaseWork> step_work(const ModelConfig& c, int B, int T, int accum, int tp_size, const Fp8Options& fp8,
                                        const AdamWConfig& adamw) {
    std::vector<PhaseWork> w(PHASE_COUNT);
    const double N = (double)B * T, D = c.dim, V = c.vocab_size, HD = c.head_dim, L = c.n_layers;
    const double NH = c.n_heads / tp_size, NKV = c.n_kv_heads / tp_size, F = c.ffn_dim / tp_size;
    const double QKV = (NH + 2 * NKV) * HD, QK = (NH + NKV) * HD;   // qkv's columns, and Q's and K's (RoPE's, the QK norm's)
    auto flops = [&](ProfilePhase p, bool fp8_cores, double f) { (fp8_cores ? w[p].fp8_flops : w[p].bf16_flops) += f; };
    // 1 where X and dY get current per-tensor scaling (no amax history, no block scaling), else 0; W's amax comes from AdamW
    const double reread = !fp8.block_scaling && !fp8.recipe.delayed() ? 1 : 0;
    auto amax_reread = [&](ProfilePhase p, CastProducer k, double elements) {
        w[p].amax_reread_bytes += reread * cast_amax_reread_bytes(k) * elements;
    };
    // a micro-batch
    for (int l = 0; l < c.n_layers; l++) {
        const bool f8 = layer_fp8(fp8, c.n_layers, l);
        const struct { LayerParam kind; double out, in; } linears[] = {{WQKV, QKV, D}, {WO, D, NH * HD}, {W_GATE_UP, 2 * F, D}, {W_DOWN, D, F}};
        for (const auto& lin : linears) {
            flops(PHASE_GEMM_FWD, f8, 2 * N * lin.out * lin.in);
            flops(PHASE_GEMM_BWD, f8, 4 * N * lin.out * lin.in);
            if (!f8) continue;
            // a cast of its own: the BF16 tensor read (twice under current scaling), its codes and their transpose written
            if (!fp8_cast_fused(fp8, c, lin.kind, false)) {
                w[PHASE_FP8_CAST].bytes += 4 * N * lin.in;
                amax_reread(PHASE_FP8_CAST, CAST_PLAIN, N * lin.in);
            }
            if (!fp8_cast_fused(fp8, c, lin.kind, true)) {
                w[PHASE_FP8_CAST].bytes += 4 * N * lin.out;
                amax_reread(PHASE_FP8_CAST, CAST_PLAIN, N * lin.out);
            }
            // --smooth-quant's gradient scales: dX [N, in] (BF16) and dW [out, in] (FP32) read and written
            if (fp8.smooth_quant > 0.0f) w[PHASE_OTHER].bytes += 4 * N * lin.in + 8 * lin.out * lin.in;
        }
        const bool fp8_attention = fp8.attention && f8;
        const double attention = 2 * B * NH * (double)T * T * HD;
        flops(PHASE_ATTN_FWD, fp8_attention, attention);
        flops(PHASE_ATTN_BWD, false, 2.5 * attention);
        // RoPE forward: Q and K in place, read and written; with the FP8 attention's cast, qkv read, Q and K written back,
        // the codes of all three written. Backward: dQ and dK in place; with wqkv's dY cast, dqkv read, codes and transpose written.
        w[PHASE_ROPE].bytes += N * (fp8_attention ? 2 * QKV + 2 * QK + QKV : 4 * QK);
        w[PHASE_ROPE].bytes += N * (f8 && fp8_cast_fused(fp8, c, WQKV, true) ? 4 * QKV : 4 * QK);
        // SwiGLU: gate_up [N, 2F] read, the output [N, F] written; backward: gate_up and the output's gradient read, gate_up's written
        w[PHASE_SWIGLU].bytes += N * F * (4 + 2) + N * F * (4 + 2 + 4);
        // current scaling's amax pass in the producers that cast (RMSNorm's reads nothing again)
        if (f8 && fp8_cast_fused(fp8, c, W_DOWN, false)) amax_reread(PHASE_SWIGLU, CAST_SWIGLU, N * F);
        if (f8 && fp8_cast_fused(fp8, c, W_GATE_UP, true)) amax_reread(PHASE_SWIGLU, CAST_SWIGLU_BACKWARD, N * F);
        if (f8 && fp8_cast_fused(fp8, c, WQKV, true)) amax_reread(PHASE_ROPE, CAST_ROPE_BACKWARD, N * QKV);
        // --qk-norm, each way: Q and K read, written, and saved (forward) or read saved (backward); a float a head row
        if (c.qk_norm) w[PHASE_NORM].bytes += 2 * N * (6 * QK + 4 * (NH + NKV));
        // --qkv-clip: qkv read and written, a bit an element written; the backward reads the bits (it rewrites only clamped values)
        if (c.qkv_clip > 0.0f) w[PHASE_OTHER].bytes += N * QKV * (4 + 2.0 / 8);
    }
    // RMSNorm, 2L + 1 of them (two a layer, the final one), all but the first with the residual add. Forward: resid and
    // branch read, resid_out and y written, rstd written (a float a row); the first: resid read, y written. Backward: dy,
    // x and dresid read, dresid written, rstd read.
    const double norms = 2 * L + 1;
    w[PHASE_NORM].bytes += (norms - 1) * 8 * N * D + 4 * N * D + norms * 4 * N;
    w[PHASE_NORM].bytes += norms * (8 * N * D + 4 * N);
    // embedding: the tokens, their rows read, the output written; backward: the tokens, the output's gradient read
    w[PHASE_EMBEDDING].bytes += 4 * N + 4 * N * D + 4 * N + 2 * N * D;
    flops(PHASE_LM_HEAD, false, 6 * N * V * D);
    // cross-entropy: the FP32 logits read, the BF16 dlogits written, the targets read, the losses written and read by their mean
    w[PHASE_LOSS].bytes += N * (6 * V + 12);
    w[PHASE_OTHER].bytes += 2 * N * D;   // dresid zeroed
    for (PhaseWork& p : w) {
        p.fp8_flops *= accum;
        p.bf16_flops *= accum;
        p.bytes *= accum;
        p.amax_reread_bytes *= accum;
    }
    // the update, once a step: the embedding's gradient zeroed (V x D floats); the gradient norm reads g; AdamW reads g, the
    // master weight and the moments, writes the master weight, the BF16 weight and the moments (adamw_fp8.cuh, section 3)
    const double mv = dtype_size(adamw.m_dtype) + dtype_size(adamw.v_dtype);
    w[PHASE_OPTIMIZER].bytes = 4 * V * D + (double)model_num_params(c, tp_size) * (4 + (4 + 4 + mv) + (4 + 2 + mv));
    // the FP8 linears' W read, W8 and W8^T written
    for (int l = 0; l < c.n_layers; l++)
        if (layer_fp8(fp8, c.n_layers, l)) w[PHASE_WEIGHT_QUANT].bytes += 4 * D * (QKV + NH * HD + 2 * F + F);
    w[PHASE_TP_COMM].unmodeled = "not modeled (NCCL's links)";
    w[PHASE_DATA].unmodeled = "not modeled (the host's copies)";
    return w;
}

// The rates of the floors, measured on the current GPU when a run profiles (~0.2 s, and 2 GiB for that moment): the dense
// GEMM rate of each precision that the build runs, 8192^3 with a BF16 output (FP8: E4M3 x E4M3 with fast accumulation,
// its faster mode), and the device-to-device copy's bandwidth (bench_copy_gbs); each the median of 20 runs.
struct GpuRates {
    double fp8_tflops = 0, bf16_tflops = 0, copy_gbs = 0;
};
inline GpuRates measure_gpu_rates() {
    const int S = 8192;
    const size_t n = (size_t)S * S;
    const double flops = 2.0 * S * S * S;
    GpuRates r;
    MatmulContext ctx;
    matmul_context_create(&ctx);
    bf16 *a, *b, *d;
    cudaCheck(cudaMalloc(&a, n * sizeof(bf16)));
    cudaCheck(cudaMalloc(&b, n * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d, n * sizeof(bf16)));
    bench_fill_kernel<<<1024, 256>>>(a, n, 1.0f);
    cudaCheckLaunch();
    bench_fill_kernel<<<1024, 256>>>(b, n, 1.0f);
    cudaCheckLaunch();
    r.bf16_tflops = flops / bench_median_ms([&] { matmul(&ctx, d, DT_BF16, {a, DT_BF16}, {b, DT_BF16}, S, S, S, false, false, 0); }) / 1e9;
    if constexpr (BUILD_FP8) {   // the FP8 operands: a and b cast to E4M3 (current scaling), each with its scale record
        fp8* a8;
        Fp8Meta* metas;
        cudaCheck(cudaMalloc(&a8, 2 * n));
        cudaCheck(cudaMalloc(&metas, 2 * sizeof(Fp8Meta)));
        fp8* b8 = a8 + n;
        const Fp8Meta initial[2] = {fp8_meta_initial(), fp8_meta_initial()};
        cudaCheck(cudaMemcpy(metas, initial, sizeof(initial), cudaMemcpyHostToDevice));
        fp8_quantize(a8, a, n, E4M3, &metas[0], Fp8Recipe(), 0);
        fp8_quantize(b8, b, n, E4M3, &metas[1], Fp8Recipe(), 0);
        r.fp8_tflops = flops / bench_median_ms([&] {
            matmul(&ctx, d, DT_BF16, {a8, DT_E4M3, false, &metas[0].inv_scale}, {b8, DT_E4M3, false, &metas[1].inv_scale}, S, S, S, false,
                   true, 0);
        }) / 1e9;
        cudaCheck(cudaFree(a8));
        cudaCheck(cudaFree(metas));
    }
    for (void* p : {(void*)a, (void*)b, (void*)d}) cudaCheck(cudaFree(p));
    matmul_context_destroy(&ctx);
    r.copy_gbs = bench_copy_gbs();
    return r;
}
// The rates' line of a profiled run's start (scripts/results.py reads it).
inline std::string gpu_rates_line(const GpuRates& r) {
    return strprintf("profile floors at the rates measured now: GEMM 8192^3%s BF16 %.1f TFLOP/s; copy %.0f GB/s (1 GiB device to "
                     "device, read + written)", BUILD_FP8 ? strprintf(" FP8 (E4M3, fast accumulation) %.1f TFLOP/s,", r.fp8_tflops).c_str() : "",
                     r.bf16_tflops, r.copy_gbs);
}

// A phase's floor: its FLOPs at the GEMM rates, its bytes at the copy's, and the basis of each part.
inline PhaseFloor phase_floor(const PhaseWork& w, const GpuRates& r) {
    if (w.unmodeled) return {-1, w.unmodeled};
    PhaseFloor f{0, ""};
    auto part = [&](double ms, const std::string& basis) {
        f.ms += ms;
        f.basis += (f.basis.empty() ? "" : " + ") + basis;
    };
    if (w.fp8_flops > 0) part(w.fp8_flops / r.fp8_tflops / 1e9, strprintf("%.2f TFLOP at %.0f TFLOP/s (FP8)", w.fp8_flops / 1e12, r.fp8_tflops));
    if (w.bf16_flops > 0) part(w.bf16_flops / r.bf16_tflops / 1e9, strprintf("%.2f TFLOP at %.0f TFLOP/s (BF16)", w.bf16_flops / 1e12, r.bf16_tflops));
    if (w.bytes > 0) part(w.bytes / r.copy_gbs / 1e6, strprintf("%.2f GB at %.2f TB/s", w.bytes / 1e9, r.copy_gbs / 1e3));
    if (f.basis.empty()) f.basis = "no work";
    f.amax_reread_ms = w.amax_reread_bytes / r.copy_gbs / 1e6;
    return f;
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

// The FP8 doctor (--fp8-stats K): every K-th step, each FP8 tensor's health (llama2.cuh, model_fp8_stats_read)
// goes to OUT/fp8_stats.csv (scripts/plot_fp8_stats.py draws it) and a summary line, and a tensor whose saturated or
// flushed fraction stays above its threshold for --fp8-warn-after such steps in a row gets one warning line,
// counted in log.csv: one per tensor and kind until the fraction comes back below (the streaks start over at a resume).
// fp8_stats.csv, a row per FP8 tensor and --fp8-stats step: step, layer, linear, tensor (X, W, dY), its format; amax
// (per-tensor scaling: its last cast's; block scaling: the largest |x| of the step's casts); scale_log2, the exponent of
// its one scale (empty under block scaling: each tile has its own); the fractions of its codes saturated and flushed.
inline std::string fp8_tensor_name(const Fp8TensorStats& t) {
    return strprintf("layer %d %s %s", t.layer, LINEAR_NAMES[t.linear], FP8_TENSOR_NAMES[t.tensor]);
}
inline void fp8_stats_write_csv(FILE* csv, int step, const std::vector<Fp8TensorStats>& stats) {
    for (const Fp8TensorStats& t : stats)
        fprintf(csv, "%d,%d,%s,%s,%s,%.6e,%s,%.6e,%.6e\n", step, t.layer, LINEAR_NAMES[t.linear], FP8_TENSOR_NAMES[t.tensor],
                fp8_name(t.format), t.amax, t.block_scaled ? "" : std::to_string(t.scale_log2).c_str(), t.saturated, t.flushed);
    fflush(csv);
}
inline std::string fp8_stats_summary(const std::vector<Fp8TensorStats>& stats) {
    const Fp8TensorStats* sat = nullptr;
    const Fp8TensorStats* flush = nullptr;
    for (const Fp8TensorStats& t : stats) {
        if (t.saturated > 0 && (!sat || t.saturated > sat->saturated)) sat = &t;
        if (t.flushed > 0 && (!flush || t.flushed > flush->flushed)) flush = &t;
    }
    return strprintf("worst saturated %.2e (%s), worst flushed to zero %.2e (%s)", sat ? sat->saturated : 0.0,
                     sat ? fp8_tensor_name(*sat).c_str() : "-", flush ? flush->flushed : 0.0, flush ? fp8_tensor_name(*flush).c_str() : "-");
}

struct Fp8Doctor {
    double saturated_limit = FP8_WARN_SATURATED, flushed_limit = FP8_WARN_FLUSHED;
    int after = FP8_WARN_AFTER;    // samples in a row above a limit that make a warning
    bool delayed = false;          // the recipe scales X and dY from an amax history (--amax-history > 1)
    bool block = false;            // --scaling block: a scale per tile (no --smooth-quant)
    std::map<std::pair<int, int>, int> streak;   // (tensor: 12 layer + 3 linear + X/W/dY, kind: 0 saturated, 1 flushed) -> samples in a row above
};
// What to try, by kind and tensor. Saturation clips the largest values: the scale came from an amax smaller than
// the tensor's (delayed scaling lagging a growing amax). Flushing zeroes the smallest: the tensor (block scaling: a
// tile) spans more than the format's range below its amax (E4M3 2^-9..448, 2^17.8; E5M2 2^-16..57344, 2^31.8).
inline std::string fp8_doctor_advice(const Fp8Doctor& d, const Fp8TensorStats& t, bool saturated) {
    if (saturated)
        return d.delayed ? "its amax grows faster than delayed scaling follows: try a shorter --amax-history or --quant-interval, "
                           "or current scaling (--amax-history 1)"
                         : strprintf("%s scaling saturates only when the amax was not finite: look at the loss and grad norm",
                                     d.block ? "block" : "current");
    if (t.tensor == FP8_X && !d.block)
        return "its outliers set the scale and its small values fall below E4M3's smallest code: try --smooth-quant 0.5, "
               "and ./train_fp8 probe to see what the layer's GEMMs lose";
    return strprintf("its values span more than %s's range: ./train_fp8 probe shows what the layer's GEMMs lose; the recipe "
                     "keeps such layers in BF16 (the first and last by default)", fp8_name(t.format));
}
// One --fp8-stats step's records in; the warning lines due at this step out.
inline std::vector<std::string> fp8_doctor_check(Fp8Doctor* d, const std::vector<Fp8TensorStats>& stats, int step) {
    std::vector<std::string> warnings;
    for (const Fp8TensorStats& t : stats)
        for (int kind = 0; kind < 2; kind++) {
            const double frac = kind == 0 ? t.saturated : t.flushed, limit = kind == 0 ? d->saturated_limit : d->flushed_limit;
            int& n = d->streak[{(t.layer * LINEARS_PER_LAYER + t.linear) * 3 + t.tensor, kind}];
            n = frac > limit ? n + 1 : 0;
            if (n != d->after) continue;
            warnings.push_back(strprintf("step %5d | fp8 warning: %s (%s): %.2e of its values %s (above %.0e) at %d --fp8-stats steps "
                                         "in a row; %s", step, fp8_tensor_name(t).c_str(), fp8_name(t.format),
                                         frac, kind == 0 ? "saturated" : "flushed to zero", limit, d->after,
                                         fp8_doctor_advice(*d, t, kind == 0).c_str()));
        }
    return warnings;
}

// The end-of-run summary: the steps that ran as every later step runs, and what they measured. Left out: the
// first step of the call (it loads the kernels and makes the GEMM plans), steps that captured a CUDA graph,
// the --profile step and the --fp8-stats steps (both eager, the latter with counters).
struct RunSummary {
    int steps = 0, timed = 0, captured = 0, eager = 0;   // steps run; timed; left out for a capture; left out as eager
    double mean_ms = 0, median_ms = 0, min_ms = 0, max_ms = 0;
    double tokens_per_s = 0, tflops = 0, mfu = NAN;       // at the mean step time; MFU in percent (NaN: no peak known)
    double memory_gib = 0;                                // GPU 0's memory in use at the end (cudaMemGetInfo)
};

struct TrainResult {
    int first_step = 0, last_step = 0;    // the steps this call ran (1-based, inclusive)
    std::vector<float> losses, grad_norms, lrs;   // one per step run
    std::vector<std::pair<int, float>> val_losses;   // (step, loss); step 0 = before training
    long bad_steps = 0;                   // non-finite steps skipped, whole run (resumes included)
    bool stopped_on_bad_steps = false;    // --max-bad-steps non-finite steps in a row ended the run
    RunSummary summary;                   // the timed steps' figures, printed at the end
    long graph_launches = 0;              // micro-batches replayed from a CUDA graph
    int stop_signal = 0;                  // SIGINT or SIGTERM stopped the run after last_step (0: not stopped)
    bool profiled = false;                // --profile: the step ran in this call, and its table is `profile`
    ProfileReport profile;
    long fp8_warnings = 0;                // the FP8 doctor's warnings in this call
};

// The state of one training run, shared by the steps of train() below: the options, the data, the ranks, the
// logs and the counters a checkpoint saves.
struct TrainRun {
    const TrainOptions* o = nullptr;
    int B = 0, T = 0, accum = 0, V = 0;
    int P = 1;                            // GPUs (ranks); --tp 0: 1
    int first_step = 1, last_step = 0;    // the steps this call runs (1-based, inclusive)
    int eval_batches = 0;
    ModelConfig config;
    AdamWConfig adamw_config;
    CheckpointHeader header;              // this run's checkpoint header; step and counters set at each save
    CheckpointHeader saved = {};          // the resumed checkpoint's header
    std::string resume_path;              // its file
    DataLoader train_data, val_data;
    std::vector<TpGroup> groups;          // --tp >= 1: one NCCL communicator per rank
    std::vector<TrainRank> ranks;
    GpuPeak peak;                         // of GPU 0, taken for every GPU of the group
    GpuRates rates;                       // --profile: GPU 0's, measured at the start (the floors' rates)
    Tokenizer tokenizer;                  // the data's (train_find_tokenizer); none: path empty
    double val_bytes_per_token = 0;       // of the evaluated targets (train_val_bytes_per_token); 0: not known
    std::vector<int> prompt;              // the samples' first tokens
    FILE* log = nullptr;                  // OUT/log.csv
    FILE* fp8_csv = nullptr;              // OUT/fp8_stats.csv (FP8 build, --fp8-stats)
    Fp8Doctor doctor;
    double flops_per_token = 0, tokens_per_step = 0;
    float grad_scale = 0;                 // 1 / (tokens per step): the mean loss's gradient
    long bad_in_row = 0;
    uint64_t sample_rng = 0;
    StepProfile profile;
    std::vector<double> timed_ms;         // the summary's steps' times (RunSummary)
    bool captured = false;                // this step captured a CUDA graph
    TrainResult result;
};

// What one optimizer step measured, for the step's log line and CSV row.
struct StepStats {
    int step = 0;
    float loss = 0, grad_norm = 0, lr = 0;
    bool bad = false;                     // non-finite loss or gradient norm: the update was skipped
    bool fp8_stats_step = false;
    bool captured = false;                // a micro-batch of this step captured a CUDA graph
    double ms = 0, tokens_per_s = 0, tflops = 0, mfu = NAN;
    std::vector<Fp8TensorStats> fp8_stats;   // --fp8-stats steps: each FP8 tensor's health
    std::vector<std::string> fp8_warnings;   // and the doctor's warnings
};

// ---- The run folder (--out), and what a resumed run may still do; both checked before any GPU work.

// A word of a command line as the shell reads it back: as it is if it is plain, else in single quotes.
inline std::string shell_quote(const std::string& word) {
    const bool plain = !word.empty() && std::all_of(word.begin(), word.end(), [](char ch) {
        return isalnum((unsigned char)ch) || strchr("_-./=:,+@%", ch) != nullptr;
    });
    if (plain) return word;
    std::string q = "'";
    for (char ch : word) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return q + "'";
}

// The command that continues this run from its folder --out: this command line with --resume OUT (in place of the
// value of its --resume, else added), so that every flag stays the one the checkpoint was written with.
// steps > 0: with --steps steps instead (a finished run trained further).
inline std::string train_resume_command(const TrainOptions& o, long steps = 0) {
    std::vector<std::string> words = o.command;
    auto set = [&](const char* flag, const std::string& value) {
        bool replaced = false;
        for (size_t i = 1; i + 1 < words.size(); i++)
            if (words[i] == flag) { words[i + 1] = value; replaced = true; }
        if (!replaced) words.insert(words.end(), {flag, value});
    };
    set("--resume", o.out);
    if (steps > 0) set("--steps", std::to_string(steps));
    std::string line;
    for (const std::string& w : words) line += (line.empty() ? "" : " ") + shell_quote(w);
    return line;
}

// What of a run a folder holds: its checkpoint files (by step), DIR/latest, and the rows of trained steps in its
// log.csv (a log of only its header and the step-0 evaluation is what a run stopped during its setup leaves).
struct RunFolderContents {
    std::vector<long> checkpoint_steps;   // ascending
    bool latest = false;
    long log_last_step = 0;               // the last step of a row of log.csv; 0: none
    bool empty() const { return checkpoint_steps.empty() && !latest && log_last_step == 0; }
    std::string describe() const {
        std::vector<std::string> parts;
        if (!checkpoint_steps.empty())
            parts.push_back(strprintf("%zu checkpoint%s, the newest at step %ld", checkpoint_steps.size(),
                                      checkpoint_steps.size() > 1 ? "s" : "", checkpoint_steps.back()));
        if (latest) parts.push_back("latest");
        if (log_last_step > 0) parts.push_back(strprintf("log.csv up to step %ld", log_last_step));
        std::string d;
        for (const std::string& p : parts) d += (d.empty() ? "" : ", ") + p;
        return d;
    }
};
inline RunFolderContents run_folder_contents(const std::string& dir) {
    RunFolderContents r;
    DIR* d = opendir(dir.c_str());
    if (!d) return r;
    for (dirent* e = readdir(d); e; e = readdir(d)) {
        long step;
        if (checkpoint_file_step(e->d_name, &step)) r.checkpoint_steps.push_back(step);
    }
    closedir(d);
    std::sort(r.checkpoint_steps.begin(), r.checkpoint_steps.end());
    struct stat st;
    r.latest = stat((dir + "/latest").c_str(), &st) == 0;
    if (FILE* f = fopen((dir + "/log.csv").c_str(), "rb")) {
        char line[512];
        while (fgets(line, sizeof(line), f))
            if (isdigit((unsigned char)line[0])) r.log_last_step = std::max(r.log_last_step, strtol(line, nullptr, 10));
        fclose(f);
    }
    return r;
}

// "" if this run may write its files into --out, else the reason and the fix. The folder must be one, or one must be
// possible there, and writable. A new run must not take over a folder that holds a run (checkpoints, `latest`, logs):
// it would write over them. A resumed run (checkpoint file resume_path) writes into the folder it resumes from, or
// into a folder that holds no run.
// "" if --out DIR is a folder this process can write into, or one it can make; else why not. `what`: what goes there.
inline std::string out_folder_problem(const std::string& dir, const char* what) {
    const char* out = dir.c_str();
    struct stat st;
    if (stat(out, &st) != 0) {   // to be made: the nearest folder above that exists must be a writable folder
        std::string above = path_folder(dir);
        while (stat(above.c_str(), &st) != 0) {
            if (above == "." || above == "/") return strprintf("--out %s: cannot be made: %s", out, strerror(errno));
            above = path_folder(above);
        }
        if (!S_ISDIR(st.st_mode))
            return strprintf("--out %s: cannot be made, %s is a file, not a folder: name another --out", out, above.c_str());
        if (access(above.c_str(), W_OK | X_OK) != 0)
            return strprintf("--out %s: cannot be made in %s: %s; name another --out", out, above.c_str(), strerror(errno));
        return "";
    }
    if (!S_ISDIR(st.st_mode)) return strprintf("--out %s is a file, not a folder: name a folder for %s", out, what);
    if (access(out, W_OK | X_OK) != 0) return strprintf("--out %s: cannot write into it: %s; name another --out", out, strerror(errno));
    return "";
}

inline std::string train_out_problem(const TrainOptions& o, const std::string& resume_path) {
    if (o.out.empty()) return "";
    const char* out = o.out.c_str();
    std::string problem = out_folder_problem(o.out, "the run's log.csv and checkpoints");
    if (!problem.empty()) return problem;
    struct stat st;
    if (stat(out, &st) != 0) return "";   // to be made
    const RunFolderContents held = run_folder_contents(o.out);
    if (held.empty()) return "";
    if (o.resume.empty()) {
        const std::string start_over = strprintf("To start over, remove the folder first (rm -r %s); to keep it, give the new run "
                                                 "another --out", shell_quote(o.out).c_str());
        if (held.checkpoint_steps.empty())
            return strprintf("--out %s holds a run already (%s, no checkpoint): a new run would write over it. %s", out,
                             held.describe().c_str(), start_over.c_str());
        const long newest = held.checkpoint_steps.back();
        if (newest >= o.steps)
            return strprintf("--out %s holds a finished run (%s): it trained to --steps %d. To train it further, resume it with "
                             "more steps (the LR schedule then spans them), e.g.:\n  %s\n%s", out, held.describe().c_str(), o.steps,
                             train_resume_command(o, 2 * newest).c_str(), start_over.c_str());
        return strprintf("--out %s holds a run already (%s): a new run would write over it. To continue it from its newest "
                         "checkpoint (with the flags it was started with):\n  %s\n%s", out, held.describe().c_str(),
                         train_resume_command(o).c_str(), start_over.c_str());
    }
    char* a = realpath(out, nullptr);
    char* b = realpath(path_folder(resume_path).c_str(), nullptr);
    const bool same = a && b && strcmp(a, b) == 0;
    free(a);
    free(b);
    if (same) return "";
    return strprintf("--out %s holds another run (%s), which the run resumed from %s would write over: drop --out to go on in "
                     "the folder of the checkpoint (%s), or give an --out that holds no run", out, held.describe().c_str(),
                     resume_path.c_str(), path_folder(resume_path).c_str());
}

// "" if a run resumed from a checkpoint after step `at` has steps left to run, else the reason and the fix: --steps,
// --stop-after and --profile name steps after `at`.
inline std::string train_resume_range_problem(const TrainOptions& o, long at) {
    if (o.steps <= at)
        return strprintf("the run is already at step %ld, and --steps %d ends it there: nothing to train. Raise --steps above "
                         "%ld to train on (the LR schedule then spans the new --steps)", at, o.steps, at);
    if (o.stop_after > 0 && o.stop_after <= at)
        return strprintf("--stop-after %d: the run is already at step %ld; give a step from %ld to --steps %d, or drop "
                         "--stop-after to run to --steps", o.stop_after, at, at + 1, o.steps);
    if (o.profile > 0 && o.profile <= at)
        return strprintf("--profile %d: the run resumes at step %ld, so step %d does not run; profile a step from %ld to %d",
                         o.profile, at + 1, o.profile, at + 1, o.stop_after > 0 ? o.stop_after : o.steps);
    return "";
}

// The copy of the tokenizer that the resumed run keeps (train_keep_tokenizer), in the checkpoint's folder ("" without
// --resume).
inline std::string train_resumed_tokenizer_path(const TrainOptions& o) {
    if (o.resume.empty()) return "";
    struct stat st;
    const bool folder = stat(o.resume.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    return run_tokenizer_path(folder ? o.resume : path_folder(o.resume));
}

// The data's tokenizer (a SentencePiece model file): --tokenizer; else the resumed run's copy; else beside the first
// training shard: PREFIX.model for a shard PREFIX_train*.bin (the names prepare writes), else tokenizer.model in its
// folder. "" if there is none; *looked: the files looked for.
inline std::string train_find_tokenizer(const TrainOptions& o, const std::string& first_shard, std::string* looked) {
    if (!o.tokenizer.empty()) return o.tokenizer;
    std::vector<std::string> candidates;
    if (!o.resume.empty()) candidates.push_back(train_resumed_tokenizer_path(o));
    const size_t slash = first_shard.find_last_of('/'), cut = first_shard.rfind("_train");
    if (cut != std::string::npos && (slash == std::string::npos || cut > slash)) candidates.push_back(first_shard.substr(0, cut) + ".model");
    candidates.push_back(path_folder(first_shard) + "/tokenizer.model");
    *looked = "";
    for (const std::string& c : candidates) {
        if (access(c.c_str(), F_OK) == 0) return c;
        *looked += (looked->empty() ? "" : ", ") + c;
    }
    return "";
}

// The tokenizer of the data into run->tokenizer, checked against the training data (whose loader is open), and the
// samples' prompt: <s> and the tokenizer's ids of --prompt; without a tokenizer the bytes of --prompt, or, with a
// vocabulary that is not bytes, none (train_open_logs takes the first tokens of the validation data; an explicit
// --prompt is refused). A
// tokenizer of N pieces needs data of vocabulary N: the shards' header hint, or, without one, every token below N (the
// vocabulary is then N). A resumed run's copy is the tokenizer it was trained with: a --tokenizer must be the same file.
inline void train_check_tokenizer(TrainRun* run, const TrainOptions& o) {
    DataLoader& data = run->train_data;
    std::string looked;
    const std::string path = train_find_tokenizer(o, data.shards[0].path, &looked);
    if (!path.empty()) {
        std::string err = tokenizer_load(&run->tokenizer, path);
        if (!err.empty()) fail("%s", err.c_str());
        const int n = (int)run->tokenizer.pieces.size();
        const bool hinted = data.shards[0].vocab_hint > 0;
        int largest = -1;
        for (const DataShard& sh : data.shards) largest = std::max(largest, sh.largest_token);
        if (hinted ? data.vocab_size != n : largest >= n)
            fail("tokenizer %s has %d pieces, but --data %s %s: the data was not made with this tokenizer; give the one that "
                 "made it (--tokenizer FILE.model), or prepare the data again with this one (./train_fp8 prepare TEXT "
                 "OUT_PREFIX --tokenizer %s)", path.c_str(), n, o.data.c_str(),
                 hinted ? strprintf("names vocabulary %d in its header", data.vocab_size).c_str()
                        : strprintf("holds token %d", largest).c_str(), path.c_str());
        if (!hinted) {
            data.vocab_size = n;
            data.vocab_source = strprintf("of the tokenizer %s", path.c_str());
        }
        const std::string resumed = train_resumed_tokenizer_path(o);
        Tokenizer copy;
        if (!resumed.empty() && path != resumed && access(resumed.c_str(), F_OK) == 0 &&
            (!tokenizer_load(&copy, resumed).empty() || copy.file != run->tokenizer.file))
            fail("--tokenizer %s is not %s, the tokenizer the resumed run was trained with: drop --tokenizer", path.c_str(),
                 resumed.c_str());
        printf("tokenizer: %s, SentencePiece BPE of %d pieces%s\n", path.c_str(), n,
               run->tokenizer.byte_fallback ? ", byte fallback" : "");
        if (run->tokenizer.bos_id >= 0) run->prompt.push_back(run->tokenizer.bos_id);
        const std::vector<int> ids = tokenizer_encode(run->tokenizer, o.prompt);
        run->prompt.insert(run->prompt.end(), ids.begin(), ids.end());
    } else if (data.vocab_size == BYTE_VOCAB) {
        for (unsigned char ch : o.prompt) run->prompt.push_back(ch);
    } else {
        if (o.prompt != TrainOptions().prompt)
            fail("--prompt needs the tokenizer of the data (vocabulary %d), and none was found (looked for %s): give it with "
                 "--tokenizer FILE.model", data.vocab_size, looked.c_str());
        printf("tokenizer: none found (looked for %s): samples print token ids after the first tokens of the validation data; "
               "give one with --tokenizer FILE.model\n", looked.c_str());
    }
}

// The bytes of text a target token of the evaluated validation batches stands for, on average (1 for bytes; with a
// tokenizer, tokenizer_piece_bytes), so that a validation loss in nats a token L is L / ln 2 / this bits a byte: losses
// of different tokenizers on the same text compare. 0 without a tokenizer for a vocabulary that is not bytes.
inline double train_val_bytes_per_token(TrainRun* run) {
    const bool bytes = run->tokenizer.path.empty();
    if (bytes && run->val_data.vocab_size != BYTE_VOCAB) return 0;
    double sum = 0, count = 0;
    dataloader_reset(&run->val_data);
    for (int b = 0; b < run->eval_batches; b++) {
        dataloader_next_batch(&run->val_data);
        for (int t : run->val_data.targets) sum += bytes ? 1 : tokenizer_piece_bytes(run->tokenizer, t);
        count += (double)run->val_data.targets.size();
    }
    dataloader_reset(&run->val_data);
    return sum / count;
}

// Setup, part 1: everything that can be wrong with the data, the checkpoint and the run folder, before any GPU work.
inline void train_check_inputs(TrainRun* run, const TrainOptions& o) {
    run->o = &o;
    run->B = o.batch;
    run->T = o.seq;
    run->accum = grad_accum_steps(o);
    run->last_step = o.stop_after > 0 ? o.stop_after : o.steps;
    const int B = run->B, T = run->T;
    std::string err = dataloader_open(&run->train_data, o.data.c_str(), B, T, 0, 1, 0, true, (uint64_t)o.seed);
    if (!err.empty()) fail("--data %s: %s", o.data.c_str(), err.c_str());
    train_check_tokenizer(run, o);
    err = dataloader_open(&run->val_data, o.val_data.c_str(), B, T, 0, 1, run->train_data.vocab_size, false, 0);
    if (!err.empty())
        fail("--val-data %s: %s. The loader was given the vocab of the training data --data %s (%d, %s): the validation "
             "and training shards must come from the same tokenizer", o.val_data.c_str(), err.c_str(), o.data.c_str(),
             run->train_data.vocab_size, run->train_data.vocab_source.c_str());
    const int V = run->V = run->train_data.vocab_size;
    printf("data: %s, %llu tokens, vocab %d (%s); validation %s, %llu tokens\n", o.data.c_str(),
           (unsigned long long)run->train_data.num_tokens, V, run->train_data.vocab_source.c_str(), o.val_data.c_str(),
           (unsigned long long)run->val_data.num_tokens);
    run->eval_batches = o.eval_batches;
    if ((uint64_t)run->eval_batches > run->val_data.batches_per_epoch) {
        run->eval_batches = (int)run->val_data.batches_per_epoch;
        printf("evaluation: --eval-batches %d is more than the validation data holds; using %d\n", o.eval_batches, run->eval_batches);
    }
    run->val_bytes_per_token = train_val_bytes_per_token(run);
    if (run->val_bytes_per_token > 0)
        printf("evaluation: %.4f bytes a token in the %d batches evaluated: bits per byte = val loss / ln 2 / %.4f\n",
               run->val_bytes_per_token, run->eval_batches, run->val_bytes_per_token);
    run->config = model_config_from_options(o, V);
    model_config_validate(run->config);
    run->adamw_config = adamw_config_from_options(o);
    adamw_config_validate(run->adamw_config);
    run->header = checkpoint_header_for(run->config, o);
    run->first_step = 1;
    run->bad_in_row = 0;
    run->sample_rng = (uint64_t)o.seed;
    if (!o.resume.empty()) {   // checked whole (size, checksums, flags) before anything is written
        err = checkpoint_resolve(o.resume, &run->resume_path);
        if (err.empty()) err = checkpoint_verify(run->resume_path, &run->saved);
        if (err.empty()) err = checkpoint_header_check(run->saved, run->header, run->resume_path.c_str());
        if (err.empty()) err = checkpoint_moments_check(run->resume_path, run->saved, run->adamw_config, std::max(1, o.tp));
        if (err.empty()) err = dataloader_set_state(&run->train_data, {run->saved.loader_epoch, run->saved.loader_position});
        if (!err.empty()) fail("--resume %s: %s", o.resume.c_str(), err.c_str());
        err = train_resume_range_problem(o, run->saved.step);
        if (!err.empty()) fail("--resume %s: %s", o.resume.c_str(), err.c_str());
        run->first_step = (int)run->saved.step + 1;
        run->result.bad_steps = run->saved.bad_steps;
        run->bad_in_row = run->saved.bad_in_row;
        run->sample_rng = run->saved.sample_rng;
        printf("resuming %s at step %d (%lld non-finite steps so far)\n", run->resume_path.c_str(), run->first_step,
               (long long)run->saved.bad_steps);
    }
    err = train_out_problem(o, run->resume_path);
    if (!err.empty()) fail("%s", err.c_str());
}

// The run's copy of its tokenizer in --out (DIR/tokenizer.model), where a resume and export find it; written unless it is
// there already.
inline void train_keep_tokenizer(const TrainRun& run, const std::string& out) {
    const std::string path = run_tokenizer_path(out);
    Tokenizer there;
    if (tokenizer_load(&there, path).empty() && there.file == run.tokenizer.file) return;
    write_text_durably(path, run.tokenizer.file);
    printf("tokenizer: copied %s to %s\n", run.tokenizer.path.c_str(), path.c_str());
}

// Setup, part 2: the ranks. GPU r holds rank r's shard of the model and of the optimizer (--tp 0: GPU 0, no
// NCCL), made from the init or the resumed checkpoint, and its batch buffers.
inline void train_create_ranks(TrainRun* run) {
    const TrainOptions& o = *run->o;
    const int B = run->B, T = run->T, V = run->V, accum = run->accum;
    const ModelConfig& config = run->config;
    const int P = run->P = std::max(1, o.tp);
    cuda_device_count_or_fail();   // the first CUDA call
    if (o.tp >= 1) run->groups = tp_groups_create(o.tp);   // the start-up checks: the GPUs are there, and can talk
    std::vector<TrainRank>& ranks = run->ranks;
    ranks.resize(P);
    for (int r = 0; r < P; r++) {
        ranks[r].device = r;
        ranks[r].tp = o.tp >= 1 ? &run->groups[r] : nullptr;
        std::string err = dataloader_open(&ranks[r].val_data, o.val_data.c_str(), B, T, 0, 1, V, false, 0);
        if (!err.empty()) fail("--val-data %s: %s", o.val_data.c_str(), err.c_str());
    }
    for (int r = 0; r < P; r++) {
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, r));
        printf("device %d: %s (sm_%d%d), build PRECISION=%s\n", r, prop.name, prop.major, prop.minor, BUILD_PRECISION == 8 ? "FP8" : "BF16");
    }
    cudaCheck(cudaSetDevice(0));   // this thread's GPU: rank 0's
    {
        cudaDeviceProp prop;
        int clock_khz;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        cudaCheck(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
        run->peak = gpu_peak(prop.name, prop.major, prop.minor, prop.multiProcessorCount, clock_khz, BUILD_PRECISION == 8);
        const char* precision = BUILD_PRECISION == 8 ? "FP8" : "BF16";
        if (run->peak.tflops > 0) printf("MFU: model FLOP/s over %d x %.0f TFLOP/s, the dense %s peak (%s)\n", P, run->peak.tflops, precision, run->peak.source.c_str());
        else printf("MFU: not shown, the dense %s peak is %s\n", precision, run->peak.source.c_str());
    }
    if (o.profile > 0) {   // before the model takes the memory
        run->rates = measure_gpu_rates();
        printf("%s\n", gpu_rates_line(run->rates).c_str());
    }
    printf("batch: %d x %d tokens x %d micro-batches = %ld tokens per step; steps %d (warm-up %d), lr %g -> %g\n",
           B, T, accum, o.total_batch, o.steps, o.warmup, o.lr, o.lr * o.final_lr_frac);
    if (o.tp == 0) printf("tensor parallel: off (--tp 0): one GPU, no NCCL\n");
    else printf("%s", model_tp_layout(config, P).c_str());
    const Fp8Options fp8 = fp8_options_from_options(o, run->first_step);
    if (o.smooth_quant > 0.0f && !o.resume.empty())
        printf("warning: --smooth-quant's per-channel s are not in checkpoints: they start again at 1 for the first resumed "
               "step (then from its amaxes), so the resumed run differs from an uninterrupted one\n");
    // Every rank cuts its shard out of the same whole weights: the init, or a checkpoint written at another TP size.
    const bool reshard = !o.resume.empty() && std::max(1u, run->saved.tp_size) != (uint32_t)P;
    std::vector<float> whole;
    if (reshard) {
        whole = checkpoint_read_master(run->resume_path, run->saved);
        printf("warning: %s was written with --tp %u and this run has --tp %d: the master weights are cut into the new "
               "shards exactly, but the AdamW moments and the FP8 scale records are per shard and start over (moments "
               "zero, bias correction from step 1, FP8 scales from the first casts), so the next steps differ from an "
               "uninterrupted run\n", run->resume_path.c_str(), std::max(1u, run->saved.tp_size), P);
    } else {
        whole = model_init_weights(config, (uint64_t)o.seed, (InitKind)init_kind_from_name(o.init), o.init_std);
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
        adamw_create(&r.opt, r.model.params, r.model.num_params, P > 1 ? shard.data() : whole.data(), run->adamw_config, norm_weights);
        adamw_gather_weight_amax(&r.opt, model_weight_amax_slots(&r.model));   // W8's amax comes from the update pass
        if (!o.resume.empty() && !reshard) {
            checkpoint_load_rank(run->resume_path, run->saved, &r.opt, &r.model, rank);
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
}

// Setup, part 3: the samples' prompt, the logs (a resumed run keeps the rows up to its checkpoint's step:
// open_run_csv) and the per-step constants.
inline void train_open_logs(TrainRun* run) {
    const TrainOptions& o = *run->o;
    if (run->prompt.empty()) {   // no tokenizer (train_check_tokenizer): the first tokens of the validation data
        dataloader_reset(&run->val_data);
        dataloader_next_batch(&run->val_data);
        run->prompt.assign(run->val_data.inputs.begin(), run->val_data.inputs.begin() + std::min(run->T, 16));
    }
    const long keep_rows_through = o.resume.empty() ? -1 : run->first_step - 1;
    if (!o.out.empty())
        run->log = open_run_csv(o.out, "log.csv", "step,loss,val_loss,lr,grad_norm,ms,tokens_per_s,tflops,skipped,mfu_percent,fp8_warnings,val_bits_per_byte",
                                keep_rows_through);
    if (BUILD_FP8 && o.fp8_stats > 0 && !o.out.empty())
        run->fp8_csv = open_run_csv(o.out, "fp8_stats.csv", "step,layer,linear,tensor,format,amax,scale_log2,saturated_frac,flushed_frac",
                                    keep_rows_through);
    run->doctor.saturated_limit = o.fp8_warn_saturated;
    run->doctor.flushed_limit = o.fp8_warn_flushed;
    run->doctor.after = o.fp8_warn_after;
    run->doctor.delayed = o.amax_history > 1 || o.quant_interval > 1;
    run->doctor.block = o.scaling == "block";
    run->flops_per_token = model_flops_per_token(run->config, run->T);   // the whole model's: TFLOP/s of all GPUs together
    run->tokens_per_step = (double)o.total_batch;
    run->grad_scale = 1.0f / ((float)run->B * run->T * run->accum);
}

// One optimizer step, part 1: the micro-batches, forward and backward, the gradients accumulated. Every rank
// gets the whole batch. eager: run without the CUDA graphs (the profiled step, --fp8-stats steps).
inline void train_micro_batches(TrainRun* run, int step, bool eager) {
    const TrainOptions& o = *run->o;
    const int B = run->B, T = run->T, accum = run->accum;
    for (int k = 0; k < accum; k++) {
        dataloader_next_batch(&run->train_data);
        // Eager: the run's first micro-batch (it loads the kernels and makes the GEMM plans the capture then
        // finds), the profiled step (its ranges time each phase) and --fp8-stats steps (their health counters).
        const bool graph = o.cuda_graph && (step > run->first_step || k > 0) && !eager;
        const int staging = (int)(((long)(step - run->first_step) * accum + k) % 2);
        on_ranks(run->ranks, [&](TrainRank& r) {   // every rank gets the whole batch
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
                memcpy(h, run->train_data.inputs.data(), (size_t)B * T * sizeof(int));
                memcpy(h + (size_t)B * T, run->train_data.targets.data(), (size_t)B * T * sizeof(int));
                cudaCheck(cudaMemcpyAsync(r.d_inputs, h, 2 * (size_t)B * T * sizeof(int), cudaMemcpyHostToDevice, s));
                cudaCheck(cudaEventRecord(r.batch_copied[staging], s));
            }
            auto micro_batch = [&] { model_micro_batch(&r.model, r.d_inputs, r.d_targets, run->grad_scale); };
            // two graphs: the first micro-batch of a step writes the gradients, the others add to them
            if (graph) {   // keys 2, 3: the same in the --amax-warmup steps (their casts are current-scaled)
                const bool captured = model_graph_launch(&r.model, (k == 0 ? 0 : 1) + (r.model.fp8_options.recipe.warmup ? 2 : 0),
                                                         micro_batch);
                if (captured && &r == &run->ranks[0]) run->captured = true;   // the ranks capture alike; rank 0's thread says so
                r.model.accumulate_grads = true;   // as the micro-batch would leave it: a replay runs no host code
            } else {
                micro_batch();
            }
            cudaCheck(cudaMemcpyAsync(r.d_losses + k, r.model.acts.loss_mean, sizeof(float), cudaMemcpyDeviceToDevice, s));
        });
        run->result.graph_launches += graph;
    }
}

// One optimizer step, part 2: the FP8 amax record, the step's loss and global gradient norm, then (when both are
// finite) AdamW with clipping and the weights' re-quantization; a non-finite step changes no weights.
inline void train_update(TrainRun* run, StepStats* s) {
    const TrainOptions& o = *run->o;
    const int accum = run->accum;
    std::vector<TrainRank>& ranks = run->ranks;
    if constexpr (BUILD_FP8) {
        on_ranks(ranks, [&](TrainRank& r) { model_fp8_record_amax(&r.model); });   // delayed scaling: the step's amaxes
        // --amax-warmup N: the casts after step N's record (its evaluation, then step N + 1 on) use the history's scales
        for (TrainRank& r : ranks) r.model.fp8_options.recipe.warmup = s->step < o.amax_warmup;
    }
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
    s->loss = (float)(loss_sum / accum);
    s->grad_norm = ranks[0].grad_norm;   // all-reduced: the same on every rank
    s->lr = lr_schedule(s->step - 1, o.steps, o.warmup, o.lr, o.final_lr_frac);
    s->bad = !std::isfinite(s->loss) || !std::isfinite(s->grad_norm);
    if (s->bad) {   // skip the update: the weights and moments stay as they were
        run->result.bad_steps++;
        run->bad_in_row++;
    } else {
        const float lr = s->lr;
        on_ranks(ranks, [&](TrainRank& r) {
            {
                ProfileRange range(PHASE_OPTIMIZER, r.model.stream, "AdamW");
                adamw_step(&r.opt, r.model.grads, r.model.weights, lr, r.grad_norm, r.model.stream);
            }
            ProfileRange range(PHASE_WEIGHT_QUANT, r.model.stream, "weight re-quantization");
            model_weights_changed(&r.model, true);   // the FP8 build's W8 and W8^T (amax from the update pass)
        });
        run->bad_in_row = 0;
    }
}

// One optimizer step: the micro-batches and the update, timed on the host clock; --profile's step also by phase,
// --fp8-stats steps with the casts' health counted.
inline StepStats train_step(TrainRun* run, int step) {
    const TrainOptions& o = *run->o;
    StepStats s;
    s.step = step;
    auto t0 = std::chrono::steady_clock::now();
    const bool profile_step = step == o.profile;   // rank 0's GPU, the stream of its model
    if (profile_step) profile_begin(&run->profile, run->ranks[0].model.stream, (size_t)run->accum * (40 * run->config.n_layers + 40) + 20);
    s.fp8_stats_step = BUILD_FP8 && o.fp8_stats > 0 && step % o.fp8_stats == 0;
    if (s.fp8_stats_step) model_fp8_stats_begin(&run->ranks[0].model);   // under --tp: rank 0's shards
    run->captured = false;
    train_micro_batches(run, step, profile_step || s.fp8_stats_step);
    s.captured = run->captured;
    train_update(run, &s);
    if (s.fp8_stats_step) {   // counted over this step's casts, W after its update
        s.fp8_stats = model_fp8_stats_read(&run->ranks[0].model);
        model_fp8_stats_end(&run->ranks[0].model);
        if (run->fp8_csv) fp8_stats_write_csv(run->fp8_csv, step, s.fp8_stats);
        s.fp8_warnings = fp8_doctor_check(&run->doctor, s.fp8_stats, step);
        run->result.fp8_warnings += (long)s.fp8_warnings.size();
    }
    if (profile_step) profile_end(&run->profile);
    on_ranks(run->ranks, [&](TrainRank& r) { cudaCheck(cudaStreamSynchronize(r.model.stream)); });
    s.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (profile_step) {
        run->result.profiled = true;
        ProfileReport& report = run->result.profile;
        report = profile_report(&run->profile);
        const std::vector<PhaseWork> work = step_work(run->config, run->B, run->T, run->accum, run->P, run->ranks[0].model.fp8_options,
                                                      run->adamw_config);
        for (int p = 0; p < PHASE_COUNT; p++) report.floors[p] = phase_floor(work[p], run->rates);
        printf("%s", profile_table(report, strprintf("profile of step %d (PRECISION=%s, %d micro-batch%s of %d x %d tokens%s): %.3f ms on "
                                                     "the host clock", step, BUILD_PRECISION == 8 ? "FP8" : "BF16", run->accum,
                                                     run->accum > 1 ? "es" : "", run->B, run->T,
                                                     run->P > 1 ? ", GPU 0 of the tensor-parallel group" : "", s.ms)).c_str());
    }
    s.tokens_per_s = run->tokens_per_step / (s.ms / 1000.0);
    s.tflops = run->flops_per_token * s.tokens_per_s / 1e12;
    s.mfu = run->peak.tflops > 0 ? 100.0 * s.tflops / (run->peak.tflops * run->P) : NAN;   // percent; NaN: no peak known
    return s;
}

// The step's line on stdout, and its numbers in the result.
inline void train_print_step(TrainRun* run, const StepStats& s) {
    const TrainOptions& o = *run->o;
    RunSummary& sum = run->result.summary;
    sum.steps++;
    if (s.step == run->first_step || s.step == o.profile || s.fp8_stats_step) sum.eager++;
    else if (s.captured) sum.captured++;
    else run->timed_ms.push_back(s.ms);
    run->result.losses.push_back(s.loss);
    run->result.grad_norms.push_back(s.grad_norm);
    run->result.lrs.push_back(s.lr);
    run->result.last_step = s.step;
    printf("step %5d/%d | loss %.4f | lr %.3e | grad norm %.4f | %.1f ms | %.0f tok/s | %.1f TFLOP/s%s%s\n", s.step, o.steps,
           s.loss, s.lr, s.grad_norm, s.ms, s.tokens_per_s, s.tflops, std::isnan(s.mfu) ? "" : strprintf(" | MFU %.1f%%", s.mfu).c_str(),
           s.bad ? strprintf(" | non-finite: update skipped (%lld in a row)", (long long)run->bad_in_row).c_str() : "");
    if (s.fp8_stats_step) printf("step %5d | fp8: %s\n", s.step, fp8_stats_summary(s.fp8_stats).c_str());
    for (const std::string& w : s.fp8_warnings) printf("%s\n", w.c_str());
}

// log.csv's val_bits_per_byte of a validation loss in nats a token: empty where the step was not evaluated or the
// bytes a token are not known (train_val_bytes_per_token).
inline std::string train_bits_per_byte_field(const TrainRun* run, float val) {
    if (std::isnan(val) || run->val_bytes_per_token <= 0) return "";
    return strprintf("%.6f", val / M_LN2 / run->val_bytes_per_token);
}

// The validation loss after `step` (0: before training), the same on every rank.
inline float train_evaluate(TrainRun* run, int step) {
    on_ranks(run->ranks, [&](TrainRank& r) { r.val_loss = evaluate_val_loss(&r.model, &r.val_data, run->eval_batches, r.d_inputs, r.d_targets); });
    const float val = run->ranks[0].val_loss;
    run->result.val_losses.push_back({step, val});
    const std::string bits = train_bits_per_byte_field(run, val);
    if (!bits.empty()) printf("step %5d | val loss %.4f | %s bits a byte\n", step, val, bits.c_str());
    else printf("step %5d | val loss %.4f\n", step, val);
    return val;
}

// The step's row of OUT/log.csv; val: NaN when the step was not evaluated.
inline void train_log_row(TrainRun* run, const StepStats& s, float val) {
    fprintf(run->log, "%d,%.6f,%s,%.6e,%.6f,%.3f,%.1f,%.3f,%d,%s,%zu,%s\n", s.step, s.loss, std::isnan(val) ? "" : strprintf("%.6f", val).c_str(),
            s.lr, s.grad_norm, s.ms, s.tokens_per_s, s.tflops, s.bad ? 1 : 0, std::isnan(s.mfu) ? "" : strprintf("%.2f", s.mfu).c_str(),
            s.fp8_warnings.size(), train_bits_per_byte_field(run, val).c_str());
    fflush(run->log);
}

// A sample from the model after `step`, continuing the prompt.
inline void train_sample(TrainRun* run, int step) {
    const TrainOptions& o = *run->o;
    on_ranks(run->ranks, [&](TrainRank& r) {   // every rank draws the same tokens from its own copy of the RNG
        r.sample_rng = run->sample_rng;
        r.sample = sample_text(&r.model, run->prompt, o.sample_tokens, o.temperature, &r.sample_rng, r.d_inputs, r.d_logits);
    });
    run->sample_rng = run->ranks[0].sample_rng;
    std::vector<int> tokens = run->prompt;
    tokens.insert(tokens.end(), run->ranks[0].sample.begin(), run->ranks[0].sample.end());
    const Tokenizer* tokenizer = run->tokenizer.path.empty() ? nullptr : &run->tokenizer;
    printf("---- sample at step %d ----\n%s\n-------------------------\n", step, tokens_to_text(tokens, run->V, tokenizer).c_str());
}

// A checkpoint after `step` in OUT: every rank's shard, the loader's position, the counters and the sampling RNG.
inline void train_checkpoint(TrainRun* run, int step) {
    const TrainOptions& o = *run->o;
    CheckpointHeader& h = run->header;
    h.step = step;
    h.bad_steps = run->result.bad_steps;
    h.bad_in_row = run->bad_in_row;
    DataLoaderState s = dataloader_get_state(&run->train_data);
    h.loader_epoch = s.epoch;
    h.loader_position = s.position;
    h.sample_rng = run->sample_rng;
    std::vector<const AdamW*> opts;
    std::vector<Model*> models;
    for (TrainRank& r : run->ranks) {
        opts.push_back(&r.opt);
        models.push_back(&r.model);
    }
    std::string path = checkpoint_save(o.out, h, o.keep_checkpoints, opts, models);
    printf("checkpoint: %s (step %d)\n", path.c_str(), step);
}

// The run's summary line: the timed steps' mean and median time, and at the mean the throughput, the model
// FLOP/s (model_flops_per_token's convention) and MFU; GPU 0's memory in use now, with every buffer of the run allocated.
inline void train_summary(TrainRun* run) {
    RunSummary& sum = run->result.summary;
    {
        size_t free_b, total_b;
        cudaCheck(cudaSetDevice(run->ranks[0].device));
        cudaCheck(cudaMemGetInfo(&free_b, &total_b));
        sum.memory_gib = (total_b - free_b) / 1073741824.0;
    }
    std::vector<double> ms = run->timed_ms;
    sum.timed = (int)ms.size();
    const std::string left_out = strprintf("%d of %d steps timed (left out: %d eager (the first, --profile, --fp8-stats), %d capturing CUDA graphs)",
                                           sum.timed, sum.steps, sum.eager, sum.captured);
    if (ms.empty()) {
        printf("summary | %s | GPU memory %.1f GiB\n", left_out.c_str(), sum.memory_gib);
        return;
    }
    std::sort(ms.begin(), ms.end());
    const size_t n = ms.size();
    sum.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
    sum.mean_ms = std::accumulate(ms.begin(), ms.end(), 0.0) / n;
    sum.min_ms = ms.front();
    sum.max_ms = ms.back();
    sum.tokens_per_s = run->tokens_per_step / (sum.mean_ms / 1000.0);
    sum.tflops = run->flops_per_token * sum.tokens_per_s / 1e12;
    sum.mfu = run->peak.tflops > 0 ? 100.0 * sum.tflops / (run->peak.tflops * run->P) : NAN;
    printf("summary | %s | ms/step mean %.2f median %.2f min %.2f max %.2f | tokens/s %.0f | model TFLOP/s %.1f | MFU %s | "
           "GPU memory %.1f GiB\n", left_out.c_str(), sum.mean_ms, sum.median_ms, sum.min_ms, sum.max_ms, sum.tokens_per_s, sum.tflops,
           std::isnan(sum.mfu) ? "-" : strprintf("%.1f%%", sum.mfu).c_str(), sum.memory_gib);
}

// The end of the run: the logs closed, every GPU buffer freed, the NCCL communicators destroyed.
inline void train_close(TrainRun* run) {
    if (run->log) fclose(run->log);
    if (run->fp8_csv) fclose(run->fp8_csv);
    on_ranks(run->ranks, [&](TrainRank& r) {
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
    if (!run->groups.empty()) tp_groups_destroy(&run->groups);
    cudaCheck(cudaSetDevice(0));
    dataloader_free(&run->train_data);
    dataloader_free(&run->val_data);
}

// --dry-run: every check that train() makes before its GPU work (the flags, the data, the checkpoint, the run
// folder), then a line; nothing is written.
inline void train_dry_run(const TrainOptions& o) {
    TrainRun run;
    train_check_inputs(&run, o);
    printf("dry run: the flags, the data%s%s are good; this run would train steps %d to %d%s%s. Nothing was run or written\n",
           o.resume.empty() ? "" : ", the checkpoint", o.out.empty() ? "" : " and --out", run.first_step, run.last_step,
           o.out.empty() ? "" : " into ", o.out.c_str());
    dataloader_free(&run.train_data);
    dataloader_free(&run.val_data);
}

// ---- Stopping on a signal. SIGINT (Ctrl-C) or SIGTERM (kill, a job scheduler's stop) asks the run to stop: the
// handler only records the signal (a sig_atomic_t: all that is safe in a handler, whichever thread of the ranks or
// of NCCL it interrupts), and the loop finishes its step, writes a checkpoint, prints the command that resumes and
// returns; main then exits with 128 + the signal's number, as a shell reports a process the signal ended. The first
// signal also ignores SIGPIPE from then on: a Ctrl-C in `./train_fp8 | tee log` stops tee as well, and the step's
// line written into the closed pipe must not end the process before its checkpoint. A second signal ends the process
// at once (the signal's default action): a checkpoint being written stays NAME.tmp, which nothing reads as a
// checkpoint, and DIR/latest still names the previous one, whole (checkpoint_write writes `latest` after the rename).
inline volatile sig_atomic_t g_stop_signal = 0;

inline void train_on_stop_signal(int sig) {
    if (g_stop_signal != 0) {   // the second: now
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_stop_signal = sig;
    signal(SIGPIPE, SIG_IGN);
}

// The handlers for the time of one train() call; the dispositions before it are put back after it.
struct StopSignalHandlers {
    struct sigaction saved_int, saved_term, saved_pipe;
    StopSignalHandlers() {
        g_stop_signal = 0;
        struct sigaction a;
        memset(&a, 0, sizeof(a));
        a.sa_handler = train_on_stop_signal;
        a.sa_flags = SA_RESTART;   // the system calls it interrupts go on (file writes, NCCL's sockets)
        sigemptyset(&a.sa_mask);
        sigaction(SIGPIPE, nullptr, &saved_pipe);
        if (sigaction(SIGINT, &a, &saved_int) != 0 || sigaction(SIGTERM, &a, &saved_term) != 0)
            fail("cannot set the handlers of SIGINT and SIGTERM: %s", strerror(errno));
    }
    ~StopSignalHandlers() {
        sigaction(SIGINT, &saved_int, nullptr);
        sigaction(SIGTERM, &saved_term, nullptr);
        sigaction(SIGPIPE, &saved_pipe, nullptr);
    }
};

// The run stops on signal g_stop_signal after `step` (first_step - 1: before its first step; else the checkpoint of
// `step` is in --out, if there is one). On stderr (a Ctrl-C may have closed the pipe stdout goes into), with the command that resumes.
inline void train_report_stop(TrainRun* run, int step) {
    const TrainOptions& o = *run->o;
    const int sig = g_stop_signal;
    run->result.stop_signal = sig;
    const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
    const bool trained = step >= run->first_step, resumable = !o.out.empty() && (trained || !o.resume.empty());
    std::string what = trained ? strprintf("after step %d", step) : strprintf("before step %d", step + 1);
    if (trained && !o.out.empty()) what += strprintf(", its checkpoint %s/%s written", o.out.c_str(), checkpoint_file_name(step).c_str());
    else if (!trained && resumable) what += ", the checkpoint it resumed from kept as it was";
    else if (!trained) what += ": nothing trained, nothing written";
    else what += "; nothing saved (no --out)";
    fflush(stdout);
    fprintf(stderr, "stopped by %s %s.%s%s\n", name, what.c_str(), resumable ? " Resume with:\n  " : "",
            resumable ? train_resume_command(o).c_str() : "");
}

// The training run, step by step: each step below is a function above.
inline TrainResult train(const TrainOptions& o) {
    StopSignalHandlers stop_handlers;
    TrainRun run;
    train_check_inputs(&run, o);   // the flags, the data, the checkpoint and the run folder, before any GPU work
    if (!o.out.empty()) make_dirs(o.out);
    if (!o.out.empty() && !run.tokenizer.path.empty()) train_keep_tokenizer(run, o.out);
    train_create_ranks(&run);      // the model and optimizer shards, from the init or the checkpoint
    train_open_logs(&run);
    bool stopped = g_stop_signal != 0;   // read once a step: what the checkpoint and the report go by
    if (stopped) train_report_stop(&run, run.first_step - 1);   // during the setup
    if (run.first_step == 1 && o.eval_every > 0 && !stopped) {
        float val = train_evaluate(&run, 0);
        if (run.log) fprintf(run.log, "0,,%.6f,,,,,,,,,%s\n", val, train_bits_per_byte_field(&run, val).c_str());
    }
    run.result.first_step = run.first_step;
    for (int step = run.first_step; step <= run.last_step && !stopped; step++) {
        NvtxRange step_range(strprintf("step %d", step));
        StepStats s = train_step(&run, step);   // micro-batches, gradient norm, AdamW, W8 re-quantization
        train_print_step(&run, s);
        const bool last = step == run.last_step;
        const float val = (o.eval_every > 0 && step % o.eval_every == 0) || last ? train_evaluate(&run, step) : NAN;
        if (run.log) train_log_row(&run, s, val);
        if (o.sample_every > 0 && (step % o.sample_every == 0 || last)) train_sample(&run, step);
        if (run.bad_in_row >= o.max_bad_steps) {
            // No checkpoint now: the last one holds the weights from before the trouble (skipped steps change
            // no weights), and resuming from it with a lower --lr is the usual fix.
            printf("stopping: %lld non-finite steps in a row (--max-bad-steps %d), %lld in the whole run.%s\n",
                   (long long)run.bad_in_row, o.max_bad_steps, (long long)run.result.bad_steps,
                   o.out.empty() ? "" : strprintf(" The last checkpoint in %s is kept as it was; resume from it with a lower --lr.",
                                                  o.out.c_str()).c_str());
            run.result.stopped_on_bad_steps = true;
            break;
        }
        stopped = g_stop_signal != 0;
        const bool scheduled = (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || last;
        if (!o.out.empty() && (scheduled || stopped)) train_checkpoint(&run, step);
        if (stopped) train_report_stop(&run, step);   // and the loop ends
    }
    profile_destroy(&run.profile);
    train_summary(&run);
    if (run.result.bad_steps > 0) printf("non-finite steps skipped in this run so far: %ld\n", run.result.bad_steps);
    train_close(&run);
    return run.result;
}

// ----------------------------------------------------------------------------------------------
// 4. The precision probe: which GEMM loses how much to FP8. One batch runs forward and backward through the model
// with every linear in BF16; at each linear's backward (Model::linear_probe) its X, W and dY go through the FP8
// linear (E4M3 X and W, E5M2 dY, each scaled from its own amax: the recipe's current scaling) and through the BF16
// linear, and each FP8 result is measured against the BF16 one: SQNR = 10 log10(sum bf16^2 / sum (fp8 - bf16)^2) dB
// for Y, dX and dW. Both paths get the same operands, so a figure is that GEMM's own loss, not error carried in
// from the layers below. The loss of the FP8 forward (the recipe's layers) against the BF16 one on the batch says
// what they add up to. A freshly initialised model measures about 28 dB forward (two E4M3 operands) and 24.5 dB
// backward (E5M2 dY, 2 mantissa bits): the formats' own precision. A GEMM well below that has outliers that set its scale.
// The same operands also go through block scaling's GEMMs (fp8_kernels.cuh 3b: 1x128 tiles, 128x128 blocks; FP32 scales),
// with dY in E5M2 and then in E4M3, where the model's shape allows block scaling (model_block_scaling_problem: widths and
// tokens multiples of 128); block minus per-tensor, in dB, is what the finer scales buy that GEMM.

struct ProbeRow {
    int layer, linear;           // linear: LINEAR_NAMES' index
    double y_db, dx_db, dw_db;   // SQNR of the FP8 GEMM against the BF16 one
    bool fp8_in_recipe;          // the FP8 loss ran this layer in FP8 (Fp8Options: all but the first and last)
    // block scaling's: Y, then dX and dW with dY in E5M2 ([0]) and in E4M3 ([1]); NaN where the shapes do not tile
    double y_db_block = NAN, dx_db_block[2] = {NAN, NAN}, dw_db_block[2] = {NAN, NAN};
};
struct ProbeResult {
    std::vector<ProbeRow> rows;   // by layer, then linear
    float loss_fp8 = 0, loss_bf16 = 0;
    std::string block_problem;    // why the block columns are empty ("": they are not)
};
constexpr const char* PROBE_GEMMS[3] = {"Y", "dX", "dW"};
// A row's SQNR of GEMM g (PROBE_GEMMS' index) under per-tensor scaling, or under block scaling with dY in E5M2 (dy 0) or
// in E4M3 (dy 1); Y reads no dY.
inline double probe_db(const ProbeRow& row, int g, bool block, int dy = 0) {
    if (!block) return g == 0 ? row.y_db : g == 1 ? row.dx_db : row.dw_db;
    return g == 0 ? row.y_db_block : g == 1 ? row.dx_db_block[dy] : row.dw_db_block[dy];
}
// DIR/probe.csv: a row per GEMM of each linear; its SQNR in dB under per-tensor scaling (sqnr_db), under block scaling
// (block_sqnr_db, dY in E5M2 as per tensor), block minus per-tensor (block_gain_db), and under block scaling with dY in
// E4M3 (block_e4m3_dy_sqnr_db; Y's is block_sqnr_db). The block columns are empty where the shapes do not tile.
inline std::string probe_csv(const ProbeResult& r) {
    std::string csv = "layer,linear,gemm,sqnr_db,block_sqnr_db,block_gain_db,block_e4m3_dy_sqnr_db\n";
    auto cell = [](double v) { return std::isnan(v) ? std::string() : strprintf("%.4f", v); };
    for (const ProbeRow& row : r.rows)
        for (int g = 0; g < 3; g++) {
            const double tensor = probe_db(row, g, false), block = probe_db(row, g, true);
            csv += strprintf("%d,%s,%s,%.4f,%s,%s,%s\n", row.layer, LINEAR_NAMES[row.linear], PROBE_GEMMS[g], tensor, cell(block).c_str(),
                             cell(block - tensor).c_str(), cell(probe_db(row, g, true, 1)).c_str());
        }
    return csv;
}

// The FP8 and the BF16 linear's outputs and the FP8 operands, sized for the widest linear (in, out) of N tokens.
struct ProbeBuffers {
    bf16 *y8 = nullptr, *y16 = nullptr, *dx8 = nullptr, *dx16 = nullptr;
    float *dw8 = nullptr, *dw16 = nullptr;
    fp8 *x8 = nullptr, *x8_t = nullptr, *w8 = nullptr, *w8_t = nullptr, *dy8 = nullptr, *dy8_t = nullptr;
    float *x8_s = nullptr, *x8_t_s = nullptr, *w8_s = nullptr, *w8_t_s = nullptr, *dy8_s = nullptr, *dy8_t_s = nullptr;   // block scales
    Fp8Meta* metas = nullptr;   // [3]: X, W, dY
    double* sums = nullptr;     // [2]: sqnr_db_on_device's
};
inline ProbeBuffers probe_buffers_create(int N, size_t in, size_t out) {
    ProbeBuffers b;
    for (bf16** p : {&b.y8, &b.y16}) cudaCheck(cudaMalloc(p, N * out * sizeof(bf16)));
    for (bf16** p : {&b.dx8, &b.dx16}) cudaCheck(cudaMalloc(p, N * in * sizeof(bf16)));
    for (float** p : {&b.dw8, &b.dw16}) cudaCheck(cudaMalloc(p, out * in * sizeof(float)));
    for (fp8** p : {&b.x8, &b.x8_t}) cudaCheck(cudaMalloc(p, N * in));
    for (fp8** p : {&b.dy8, &b.dy8_t}) cudaCheck(cudaMalloc(p, N * out));
    for (fp8** p : {&b.w8, &b.w8_t}) cudaCheck(cudaMalloc(p, out * in));
    const std::pair<float**, size_t> scales[] = {
        {&b.x8_s, fp8_scale_count(FP8_TILES_1x128, N, (int)in)},        {&b.x8_t_s, fp8_scale_count(FP8_TILES_1x128, (int)in, N)},
        {&b.dy8_s, fp8_scale_count(FP8_TILES_1x128, N, (int)out)},      {&b.dy8_t_s, fp8_scale_count(FP8_TILES_1x128, (int)out, N)},
        {&b.w8_s, fp8_scale_count(FP8_BLOCKS_128x128, (int)out, (int)in)}, {&b.w8_t_s, fp8_scale_count(FP8_BLOCKS_128x128, (int)in, (int)out)}};
    for (const auto& sc : scales) {
        cudaCheck(cudaMalloc(sc.first, sc.second * sizeof(float)));
        cudaCheck(cudaMemset(*sc.first, 0, sc.second * sizeof(float)));   // the padding of the blocks' rows
    }
    cudaCheck(cudaMalloc(&b.metas, 3 * sizeof(Fp8Meta)));
    cudaCheck(cudaMalloc(&b.sums, 2 * sizeof(double)));
    return b;
}
inline void probe_buffers_destroy(ProbeBuffers* b) {
    for (void* p : std::initializer_list<void*>{b->y8, b->y16, b->dx8, b->dx16, b->dw8, b->dw16, b->x8, b->x8_t, b->w8, b->w8_t,
                                                b->dy8, b->dy8_t, b->x8_s, b->x8_t_s, b->w8_s, b->w8_t_s, b->dy8_s, b->dy8_t_s, b->metas,
                                                b->sums})
        cudaCheck(cudaFree(p));
    *b = ProbeBuffers();
}

// One linear: X [N,in], W [out,in], dY [N,out] through the FP8 GEMMs and the BF16 GEMMs; the three SQNRs, and with
// block (N, in and out multiples of 128) block scaling's five.
inline ProbeRow probe_linear(MatmulContext* mm, ProbeBuffers* b, const bf16* x, const bf16* w, const bf16* dy, int N, int in, int out,
                             bool fast_accum, bool block, cudaStream_t s) {
    const Fp8Meta fresh[3] = {fp8_meta_initial(), fp8_meta_initial(), fp8_meta_initial()};
    cudaCheck(cudaMemcpyAsync(b->metas, fresh, sizeof(fresh), cudaMemcpyHostToDevice, s));
    Fp8Linear lin{b->w8, b->w8_t, b->metas, nullptr};
    fp8_weight_update(&lin, w, out, in, s);
    fp8_cast_transpose(b->x8, b->x8_t, x, N, in, E4M3, &b->metas[FP8_X], Fp8Recipe(), s);
    fp8_cast_transpose(b->dy8, b->dy8_t, dy, N, out, E5M2, &b->metas[FP8_DY], Fp8Recipe(), s);
    fp8_linear_forward(mm, b->y8, b->x8, &lin, N, in, out, fast_accum, s);
    fp8_linear_backward(mm, b->dx8, b->dw8, b->dy8, b->dy8_t, b->x8_t, &lin, N, in, out, s, false);
    bf16_linear_forward(mm, b->y16, x, w, N, in, out, s);
    bf16_linear_backward(mm, b->dx16, b->dw16, dy, x, w, N, in, out, s, false);
    ProbeRow row;
    row.y_db = sqnr_db_on_device(b->y8, b->y16, (size_t)N * out, b->sums, s);
    row.dx_db = sqnr_db_on_device(b->dx8, b->dx16, (size_t)N * in, b->sums, s);
    row.dw_db = sqnr_db_on_device(b->dw8, b->dw16, (size_t)out * in, b->sums, s);
    if (block) {   // block scaling, the same operands
        Fp8Linear blin{b->w8, b->w8_t, nullptr, nullptr, b->w8_s, b->w8_t_s};
        fp8_block_weight_update(&blin, w, out, in, Fp8BlockRule{E4M3}, s);
        const Fp8BlockCastOut xo{b->x8, b->x8_s, b->x8_t, b->x8_t_s, FP8_TILES_1x128, FP8_TILES_1x128, {E4M3}};
        fp8_block_cast_produced(xo, CastPlain<bf16>{x, in}, N, in, s);
        fp8_block_linear_forward(mm, b->y8, xo, &blin, N, in, out, s);
        row.y_db_block = sqnr_db_on_device(b->y8, b->y16, (size_t)N * out, b->sums, s);
        for (int f = 0; f < 2; f++) {
            const Fp8BlockCastOut dyo{b->dy8, b->dy8_s, b->dy8_t, b->dy8_t_s, FP8_TILES_1x128, FP8_TILES_1x128, {f == 0 ? E5M2 : E4M3}};
            fp8_block_cast_produced(dyo, CastPlain<bf16>{dy, out}, N, out, s);
            fp8_block_linear_backward(mm, b->dx8, b->dw8, dyo, xo, &blin, N, in, out, s, false);
            row.dx_db_block[f] = sqnr_db_on_device(b->dx8, b->dx16, (size_t)N * in, b->sums, s);
            row.dw_db_block[f] = sqnr_db_on_device(b->dw8, b->dw16, (size_t)out * in, b->sums, s);
        }
    }
    return row;
}

// The probe of weights `weights` (FP32, the flat layout) on one batch of B x T tokens (host arrays). fp8: the
// layers and fast accumulation of the FP8 loss (and of the probe's FP8 forward GEMMs).
inline ProbeResult probe_model(const ModelConfig& c, const std::vector<float>& weights, const Fp8Options& fp8, int B, int T,
                               const std::vector<int>& inputs, const std::vector<int>& targets) {
    const int N = B * T;
    int* d_tokens;
    cudaCheck(cudaMalloc(&d_tokens, 2 * (size_t)N * sizeof(int)));
    cudaCheck(cudaMemcpy(d_tokens, inputs.data(), (size_t)N * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_tokens + N, targets.data(), (size_t)N * sizeof(int), cudaMemcpyHostToDevice));
    ProbeResult r;
    r.block_problem = model_block_scaling_problem(c, 1, N);
    Model m;
    model_create(&m, c, B, T, fp8);
    model_upload_weights(&m, weights.data());
    r.loss_fp8 = model_loss(&m, d_tokens, d_tokens + N, B, T);
    model_destroy(&m);
    Fp8Options bf16_only = fp8;
    bf16_only.enabled = false;
    model_create(&m, c, B, T, bf16_only);
    model_upload_weights(&m, weights.data());
    ProbeBuffers buffers = probe_buffers_create(N, std::max(c.dim, c.ffn_dim), std::max({(size_t)model_qkv_dim(c), 2 * (size_t)c.ffn_dim, (size_t)c.dim}));
    m.linear_probe = [&](const Param& p, const bf16* x, const bf16* dy, int n) {
        const TensorSpec& w = m.params[p.index];
        ProbeRow row = probe_linear(&m.matmul, &buffers, x, p.w, dy, n, w.cols, w.rows, fp8.fast_accum, r.block_problem.empty(), m.stream);
        const int i = model_linear_index(&m, p.index);
        row.layer = i / LINEARS_PER_LAYER;
        row.linear = i % LINEARS_PER_LAYER;
        row.fp8_in_recipe = fp8.all_layers || (row.layer != 0 && row.layer != c.n_layers - 1);
        r.rows.push_back(row);
    };
    model_zero_grads(&m);
    r.loss_bf16 = model_forward_backward(&m, d_tokens, d_tokens + N, 1.0f / N);
    probe_buffers_destroy(&buffers);
    model_destroy(&m);
    cudaCheck(cudaFree(d_tokens));
    std::sort(r.rows.begin(), r.rows.end(), [](const ProbeRow& a, const ProbeRow& b) {   // the backward ran from the top
        return std::make_pair(a.layer, a.linear) < std::make_pair(b.layer, b.linear);
    });
    return r;
}

// The probe's table: per layer and linear the SQNRs of both scalings and block minus per-tensor ("-" where the block
// columns are empty, and a line saying why), then the five weakest GEMMs of each scaling.
inline std::string probe_table(const ProbeResult& r) {
    std::string t = "SQNR of each FP8 GEMM against the BF16 GEMM on the same operands, dB (higher is better): per-tensor and block "
                    "scaling (dY in E5M2), what block scaling gains, and block scaling with dY in E4M3:\n";
    t += strprintf("%5s  %-9s  %-23s | %-23s | %-23s | %s\n", "", "", "per tensor", "block", "block - per tensor", "block, E4M3 dY");
    t += strprintf("%5s  %-9s  %7s %7s %7s | %7s %7s %7s | %7s %7s %7s | %7s %7s\n", "layer", "linear", "Y", "dX", "dW", "Y", "dX", "dW", "Y",
                   "dX", "dW", "dX", "dW");
    auto db = [](double v, const char* format) { return std::isnan(v) ? strprintf("%7s", "-") : strprintf(format, v); };
    for (const ProbeRow& row : r.rows) {
        std::string line = strprintf("%5d  %-9s ", row.layer, LINEAR_NAMES[row.linear]);
        for (int g = 0; g < 3; g++) line += strprintf(" %7.2f", probe_db(row, g, false));
        line += " |";
        for (int g = 0; g < 3; g++) line += " " + db(probe_db(row, g, true), "%7.2f");
        line += " |";
        for (int g = 0; g < 3; g++) line += " " + db(probe_db(row, g, true) - probe_db(row, g, false), "%+7.2f");
        line += " |";
        for (int g = 1; g < 3; g++) line += " " + db(probe_db(row, g, true, 1), "%7.2f");
        t += line + (row.fp8_in_recipe ? "" : "   (BF16 in the recipe)") + "\n";
    }
    if (!r.block_problem.empty()) t += "the block columns are empty, block scaling does not fit this shape: " + r.block_problem + "\n";
    // the five weakest GEMMs of a scaling (dy: the block columns' dY format)
    auto lowest = [&](const char* what, bool block, int dy) {
        std::vector<std::pair<double, std::string>> gemms;
        for (const ProbeRow& row : r.rows)
            for (int g = 0; g < 3; g++)
                gemms.push_back({probe_db(row, g, block, dy), strprintf("layer %d %s %s", row.layer, LINEAR_NAMES[row.linear], PROBE_GEMMS[g])});
        gemms.erase(std::remove_if(gemms.begin(), gemms.end(), [](const auto& g) { return std::isnan(g.first); }), gemms.end());
        if (gemms.empty()) return;
        std::sort(gemms.begin(), gemms.end());
        t += strprintf("lowest%s:", what);
        for (size_t i = 0; i < std::min<size_t>(5, gemms.size()); i++) t += strprintf("%s %s %.2f dB", i ? "," : "", gemms[i].second.c_str(), gemms[i].first);
        t += "\n";
    };
    lowest("", false, 0);
    lowest(" under block scaling, E5M2 dY", true, 0);
    lowest(" under block scaling, E4M3 dY", true, 1);
    return t;
}

// ./train_fp8 probe [CKPT] [flags]: the checks, then probe_model, the table, DIR/probe.csv with --out.
inline ProbeResult probe_main(const TrainOptions& o) {
    DataLoader val;   // the batch: the first window of --val-data
    std::string err = dataloader_open(&val, o.val_data.c_str(), o.batch, o.seq, 0, 1, 0, false, 0);
    if (!err.empty()) fail("probe: --val-data %s: %s", o.val_data.c_str(), err.c_str());
    ModelConfig c;
    std::vector<float> weights;
    Fp8Options fp8;
    fp8.all_layers = o.fp8_all_layers;
    fp8.fast_accum = o.fp8_fast_accum == 1;
    std::string source;
    if (!o.probe_ckpt.empty()) {
        std::string path;
        CheckpointHeader h;
        err = checkpoint_resolve(o.probe_ckpt, &path);
        if (err.empty()) err = checkpoint_verify(path, &h);
        if (!err.empty()) fail("probe: %s", err.c_str());
        c = checkpoint_model_config(h);
        if (16 * ceil_div(val.vocab_size, 16) != c.vocab_size)
            fail("probe: %s is a model of vocabulary %d and --val-data %s holds tokens of vocabulary %d (%s): give it "
                 "validation data of the tokenizer it was trained on", path.c_str(), c.vocab_size, o.val_data.c_str(),
                 val.vocab_size, val.vocab_source.c_str());
        fp8.all_layers = fp8.all_layers || h.fp8_all_layers != 0;
        fp8.fast_accum = h.fp8_fast_accum != 0;
        source = strprintf("%s (step %lld)", path.c_str(), (long long)h.step);
        weights = checkpoint_read_master(path, h);
    } else {
        c = model_config_from_options(o, val.vocab_size);
        err = model_config_problem(c);
        if (!err.empty()) fail("probe: %s", err.c_str());
        source = strprintf("the --init %s weights of seed %ld", o.init.c_str(), o.seed);
    }
    err = train_size_problem(o, c);
    if (err.empty() && o.seq > c.max_seq_len)
        err = strprintf("--seq %d is longer than the model's max_seq_len %d: lower --seq", o.seq, c.max_seq_len);
    if (err.empty() && ((long)o.batch * o.seq) % 16 != 0)
        err = strprintf("--batch %d x --seq %d must be a multiple of 16 (the GEMM rule): change --batch or --seq", o.batch, o.seq);
    if (err.empty() && !o.out.empty()) err = out_folder_problem(o.out, "probe.csv");
    if (!err.empty()) fail("probe: %s", err.c_str());
    if (!o.out.empty()) make_dirs(o.out);
    if (o.probe_ckpt.empty()) weights = model_init_weights(c, (uint64_t)o.seed, (InitKind)init_kind_from_name(o.init), o.init_std);
    dataloader_next_batch(&val);
    cuda_device_count_or_fail();
    printf("probe: %s; one batch of %d x %d tokens from %s\n", source.c_str(), o.batch, o.seq, o.val_data.c_str());
    ProbeResult r = probe_model(c, weights, fp8, o.batch, o.seq, val.inputs, val.targets);
    dataloader_free(&val);

    printf("%s", probe_table(r).c_str());
    printf("loss on this batch: FP8 recipe %.5f, BF16 linears %.5f, difference %+.5f (%+.3f%%)\n", r.loss_fp8, r.loss_bf16,
           r.loss_fp8 - r.loss_bf16, 100.0 * (r.loss_fp8 - r.loss_bf16) / r.loss_bf16);
    if (!o.out.empty()) {
        const std::string csv = probe_csv(r);
        const std::string path = o.out + "/probe.csv";
        write_file_durably(path, [&](FILE* f, const std::string& tmp) { write_bytes(f, csv.data(), csv.size(), tmp); });
        printf("wrote %s (python3 scripts/plot_fp8_stats.py probe %s draws it)\n", path.c_str(), path.c_str());
    }
    return r;
}

// ----------------------------------------------------------------------------------------------
// 5. main

// prepare --vocab N (N > 256) or --tokenizer FILE.model: python3 runs scripts/tokenizer.py, found beside this program, in
// this process's place (its messages and exit status are prepare's), so that the sentencepiece library stays out of the
// trainer. Returns only if it cannot be started: the reason and the fix.
inline std::string prepare_with_tokenizer(const TrainOptions& o) {
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    const std::string script = (n > 0 ? path_folder(std::string(exe, (size_t)n)) : std::string(".")) + "/scripts/tokenizer.py";
    if (access(script.c_str(), R_OK) != 0)
        return strprintf("prepare --vocab/--tokenizer runs %s, which is missing (%s): run the train_fp8 built in the "
                         "repository, beside its scripts/", script.c_str(), strerror(errno));
    std::vector<std::string> words = {"python3", script, o.prepare_text, o.prepare_prefix};
    if (o.tokenizer.empty()) words.insert(words.end(), {"--vocab", std::to_string(o.vocab)});
    else words.insert(words.end(), {"--tokenizer", o.tokenizer});
    if (o.force) words.push_back("--force");
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(&w[0]);
    argv.push_back(nullptr);
    fflush(stdout);
    execvp(argv[0], argv.data());
    return strprintf("cannot run python3 (%s): prepare --vocab/--tokenizer trains and applies the tokenizer with Python's "
                     "sentencepiece: install Python 3, then pip install -r scripts/requirements.txt", strerror(errno));
}

#ifndef TESTING
int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);   // each line as it comes, into a pipe too (| tee), in order with stderr's
    TrainOptions o;
    std::string err = parse_args(argc, argv, &o);
    if (!err.empty()) {
        fprintf(stderr, "error: %s\n", err.c_str());
        return EXIT_FAILURE;
    }
    if (o.help) {
        print_help(argv[0], o);
        return 0;
    }
    for (const std::string& w : o.warnings) fprintf(stderr, "warning: %s\n", w.c_str());
    if (o.prepare) {
        const bool bytes = o.vocab == BYTE_VOCAB && o.tokenizer.empty();
        err = bytes ? prepare_byte_shards(o.prepare_text.c_str(), o.prepare_prefix.c_str(), o.force) : prepare_with_tokenizer(o);
        if (!err.empty()) fail("%s", err.c_str());
        return 0;
    }
    if (o.do_export) {
        err = export_checkpoint(o.export_ckpt, o.export_dir, o.export_format, o.export_dtype, o.force);
        if (!err.empty()) fail("export: %s", err.c_str());
        return 0;
    }
    if (o.probe) {
        probe_main(o);
        return 0;
    }
    if (o.dry_run) {
        train_dry_run(o);
        return 0;
    }
    TrainResult r = train(o);
    return r.stop_signal != 0 ? 128 + r.stop_signal : r.stopped_on_bad_steps ? EXIT_FAILURE : 0;
}
#endif
#endif  // TRAIN_FP8_CU
