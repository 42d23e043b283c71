// dataloader.h: the data. Host-only C++ (no CUDA): compiles with g++ and nvcc, tested without a GPU.
//
// Shard format (llm.c's): a header of 256 int32, then uint16 tokens.
//   header[0] = 20240520 (magic)   header[1] = 1 (version)   header[2] = number of tokens
//   header[3] = vocab hint: 256 in our byte shards, the tokenizer's size in prepare --vocab's (scripts/tokenizer.py),
//                0 (no hint) in llm.c's; the rest of the header is 0.
//
// API. Functions that return std::string return "" on success, else the whole error message (which file,
// what was expected, what was found, and what to do), so that tests can check each kind of failure.
//   std::string prepare_byte_shards(const char* text_path, const char* out_prefix, bool force);
//       any file as bytes (vocab 256): the first 90% -> OUT_PREFIX_train.bin, the last 10% -> OUT_PREFIX_val.bin,
//       both or neither; existing shards replaced only with force
//   std::string write_shard(const char* path, const uint16_t* tokens, size_t n, int vocab_hint);
//   int choose_vocab_size(int largest_token, int header_hint);
//   std::string dataloader_open(DataLoader* dl, const char* pattern, int B, int T, int rank, int world_size,
//                               int vocab_size /* 0: choose from the data */, bool shuffle, uint64_t seed);
//   void dataloader_init(...the same arguments...);   dataloader_open, or print its error and exit(1)
//   void dataloader_next_batch(DataLoader* dl);        fills dl->inputs and dl->targets, B*T int32 each
//   DataLoaderState dataloader_get_state(const DataLoader* dl);              for checkpoints
//   std::string dataloader_set_state(DataLoader* dl, DataLoaderState s);     a resumed run gets the same batches
//   void dataloader_reset(DataLoader* dl);             back to the first batch (the val loader, before each eval)
//   void dataloader_free(DataLoader* dl);
// Typical use: the train loader chooses the vocab (vocab_size 0, or the user's), the val loader gets
// train.vocab_size and shuffle = false, and is reset before each evaluation.
//
// Samples. Every shard matching the glob pattern (sorted by name) is checked in full when the loader
// opens: magic, version, file size, every token < vocab size, and at least one batch for each rank.
// Each shard is cut into windows of T+1 tokens with stride T (llm.c style: window k holds tokens
// k*T .. k*T+T, so its inputs never overlap the next window's; a window never spans two shards). The
// windows of all shards are numbered in shard order, and each epoch visits them in an order shuffled with
// the seed seed + epoch (Fisher-Yates driven by splitmix64, both spelled out below, so the order is the
// same on every machine and library version). Rank r of world_size takes the windows at positions
// r, r + world_size, r + 2*world_size, ... of that order; a batch is B consecutive windows of the rank's
// slice: inputs = tokens 0..T-1 of each window, targets = tokens 1..T. The last partial batch of an
// epoch is dropped, so all ranks see the same number of batches.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cerrno>
#include <cstdarg>
#include <string>
#include <vector>
#include <algorithm>
#include <glob.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>

constexpr int SHARD_MAGIC = 20240520;
constexpr int SHARD_VERSION = 1;
constexpr int SHARD_HEADER_INTS = 256;
constexpr size_t SHARD_HEADER_BYTES = SHARD_HEADER_INTS * sizeof(int32_t);   // 1024
constexpr int BYTE_VOCAB = 256;

// printf into a std::string (for error messages).
inline std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string strprintf(const char* fmt, ...) {
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(nullptr, 0, fmt, ap);
    va_end(ap);
    std::string s(n > 0 ? n : 0, '\0');
    vsnprintf(&s[0], s.size() + 1, fmt, ap2);
    va_end(ap2);
    return s;
}

// ----------------------------------------------------------------------------------------------
// Writing shards.

// One shard written to `path` + ".tmp" (removed again if the write fails).
inline std::string write_shard_tmp(const std::string& path, const uint16_t* tokens, size_t n, int vocab_hint) {
    if (n > (size_t)INT32_MAX)
        return strprintf("%s: %zu tokens do not fit one shard (the header counts them in an int32, at most %d); "
                         "split the data into several shards", path.c_str(), n, INT32_MAX);
    int32_t header[SHARD_HEADER_INTS] = {};
    header[0] = SHARD_MAGIC;
    header[1] = SHARD_VERSION;
    header[2] = (int32_t)n;
    header[3] = vocab_hint;
    const std::string tmp = path + ".tmp";
    FILE* f = fopen(tmp.c_str(), "wb");
    if (!f) return strprintf("cannot write '%s': %s; check that its folder exists and is writable", tmp.c_str(), strerror(errno));
    bool ok = fwrite(header, sizeof(int32_t), SHARD_HEADER_INTS, f) == (size_t)SHARD_HEADER_INTS &&
              fwrite(tokens, sizeof(uint16_t), n, f) == n;
    ok = (fclose(f) == 0) && ok;
    if (ok) return "";
    std::string err = strprintf("writing '%s' failed: %s; check the free disk space", tmp.c_str(), strerror(errno));
    remove(tmp.c_str());
    return err;
}

// One shard at `path`, written to path.tmp and then renamed, so a reader never sees half a file.
inline std::string write_shard(const char* path, const uint16_t* tokens, size_t n, int vocab_hint) {
    std::string err = write_shard_tmp(path, tokens, n, vocab_hint);
    const std::string tmp = std::string(path) + ".tmp";
    if (err.empty() && rename(tmp.c_str(), path) != 0) {
        err = strprintf("cannot rename '%s' to '%s': %s", tmp.c_str(), path, strerror(errno));
        remove(tmp.c_str());
    }
    return err;
}

// Any file as bytes, vocab 256: the first 90% of the bytes -> OUT_PREFIX_train.bin, the last 10% (rounded
// down) -> OUT_PREFIX_val.bin. Existing shards are replaced only with `force`. All or nothing: both shards are
// written to .tmp files first and renamed after, so that a failure leaves neither (no train shard without its val
// shard). Prints one line per shard written.
inline std::string prepare_byte_shards(const char* text_path, const char* out_prefix, bool force) {
    const std::string prefix = out_prefix, train_path = prefix + "_train.bin", val_path = prefix + "_val.bin";
    if (prefix.empty() || prefix.back() == '/')
        return strprintf("OUT_PREFIX '%s' has no file name: give the shards' path without its ending, e.g. data/kjv for "
                         "data/kjv_train.bin and data/kjv_val.bin", out_prefix);
    FILE* f = fopen(text_path, "rb");
    if (!f) return strprintf("cannot read '%s': %s; give the path of a text file (make data prepares data/kjv.txt)",
                             text_path, strerror(errno));
    for (const std::string& out : {train_path, val_path}) {
        struct stat st;
        if (!force && stat(out.c_str(), &st) == 0) {
            fclose(f);
            return strprintf("'%s' exists: delete it, choose another OUT_PREFIX, or add --force to replace it", out.c_str());
        }
    }
    std::vector<uint8_t> bytes;
    uint8_t chunk[1 << 16];
    size_t got;
    while ((got = fread(chunk, 1, sizeof(chunk), f)) > 0) bytes.insert(bytes.end(), chunk, chunk + got);
    bool read_error = ferror(f) != 0;
    fclose(f);
    if (read_error) return strprintf("reading '%s' failed: %s", text_path, strerror(errno));
    if (bytes.size() < 10)
        return strprintf("'%s' has %zu bytes; it needs at least 10 (90%% for training, 10%% for validation), and in "
                         "practice far more: a batch takes B*T+1 tokens, one per byte", text_path, bytes.size());
    size_t n_val = bytes.size() / 10, n_train = bytes.size() - n_val;
    std::vector<uint16_t> tokens(bytes.begin(), bytes.end());
    const std::string train_tmp = train_path + ".tmp", val_tmp = val_path + ".tmp";
    std::string err = write_shard_tmp(train_path, tokens.data(), n_train, BYTE_VOCAB);
    if (err.empty()) err = write_shard_tmp(val_path, tokens.data() + n_train, n_val, BYTE_VOCAB);
    for (const std::string& out : {train_path, val_path})
        if (err.empty() && rename((out + ".tmp").c_str(), out.c_str()) != 0) {
            err = strprintf("cannot rename '%s.tmp' to '%s': %s", out.c_str(), out.c_str(), strerror(errno));
            remove(train_path.c_str());   // neither shard stays (with force, the old ones were to be replaced)
            remove(val_path.c_str());
        }
    if (!err.empty()) {
        remove(train_tmp.c_str());
        remove(val_tmp.c_str());
        return err;
    }
    printf("wrote %s: %zu tokens (bytes), vocab %d\n", train_path.c_str(), n_train, BYTE_VOCAB);
    printf("wrote %s: %zu tokens (bytes), vocab %d\n", val_path.c_str(), n_val, BYTE_VOCAB);
    return "";
}

// ----------------------------------------------------------------------------------------------
// Reading and checking shards.

struct DataShard {
    std::string path;
    int fd = -1;                  // open for the loader's lifetime
    uint64_t num_tokens = 0;
    int vocab_hint = 0;           // header[3]; 0 = none
    int largest_token = -1;       // -1: no tokens
    uint64_t largest_token_pos = 0;   // where it first occurs (for the error message)
};

// Read exactly n bytes at offset; false on error or end of file.
inline bool read_exact(int fd, void* buf, size_t n, uint64_t offset) {
    char* p = (char*)buf;
    while (n > 0) {
        ssize_t r = pread(fd, p, n, (off_t)offset);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        p += r;
        n -= (size_t)r;
        offset += (uint64_t)r;
    }
    return true;
}

// Open one shard and check its header and size, then read all its tokens for the largest one.
// On success the shard stays open (sh->fd); on error it is closed.
inline std::string shard_open(DataShard* sh, const char* path) {
    const char* fix = "re-create it (./train_fp8 prepare TEXT PREFIX: bytes, or with --vocab N a tokenizer's tokens; or llm.c's dev/data scripts)";
    sh->path = path;
    sh->fd = open(path, O_RDONLY);
    if (sh->fd < 0) return strprintf("cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    std::string err;
    int32_t header[SHARD_HEADER_INTS];
    if (fstat(sh->fd, &st) != 0) {
        err = strprintf("cannot stat '%s': %s", path, strerror(errno));
    } else if (S_ISDIR(st.st_mode)) {
        std::string folder = path;
        if (folder.size() > 1 && folder.back() == '/') folder.pop_back();
        err = strprintf("'%s' is a folder, not a token shard: pass a shard file, or a glob of shard files such as "
                        "'%s/*_train.bin' (quoted, so that the shell leaves it to the loader)", path, folder.c_str());
    } else if ((uint64_t)st.st_size < SHARD_HEADER_BYTES || !read_exact(sh->fd, header, SHARD_HEADER_BYTES, 0)) {
        err = strprintf("'%s' has %lld bytes, less than the %zu-byte shard header: it is not a token shard; %s",
                        path, (long long)st.st_size, SHARD_HEADER_BYTES, fix);
    } else if (header[0] != SHARD_MAGIC) {
        err = strprintf("'%s': bad magic number: expected %d (an llm.c token shard), found %d; it is not a token "
                        "shard: %s", path, SHARD_MAGIC, header[0], fix);
    } else if (header[1] != SHARD_VERSION) {
        err = strprintf("'%s': unsupported shard version: expected %d (uint16 tokens), found %d; %s",
                        path, SHARD_VERSION, header[1], fix);
    } else if (header[2] < 0 || header[3] < 0) {
        err = strprintf("'%s': corrupt header: token count %d and vocab hint %d must not be negative; %s",
                        path, header[2], header[3], fix);
    } else if (header[3] > 65536) {
        err = strprintf("'%s': corrupt header: vocab hint %d, more than uint16 tokens can take (65536); %s", path,
                        header[3], fix);
    } else if ((uint64_t)st.st_size != SHARD_HEADER_BYTES + 2 * (uint64_t)header[2]) {
        err = strprintf("'%s': wrong file size: its header says %d tokens, so expected %llu bytes (1024 + 2 per token), "
                        "found %lld; the file is truncated or damaged: %s", path, header[2],
                        (unsigned long long)(SHARD_HEADER_BYTES + 2 * (uint64_t)header[2]), (long long)st.st_size, fix);
    }
    if (err.empty()) {
        sh->num_tokens = (uint64_t)header[2];
        sh->vocab_hint = header[3];
        std::vector<uint16_t> chunk(1 << 20);
        for (uint64_t pos = 0; pos < sh->num_tokens && err.empty(); pos += chunk.size()) {
            size_t n = (size_t)std::min<uint64_t>(chunk.size(), sh->num_tokens - pos);
            if (!read_exact(sh->fd, chunk.data(), n * sizeof(uint16_t), SHARD_HEADER_BYTES + 2 * pos)) {
                err = strprintf("reading the tokens of '%s' failed at token %llu: %s", path, (unsigned long long)pos,
                                strerror(errno));
                break;
            }
            for (size_t i = 0; i < n; i++) {
                if ((int)chunk[i] > sh->largest_token) { sh->largest_token = chunk[i]; sh->largest_token_pos = pos + i; }
            }
        }
    }
    if (!err.empty()) { close(sh->fd); sh->fd = -1; }
    return err;
}

// The vocab size the data asks for: the shards' header hint if they have one, else the smallest common
// vocab that holds the largest token: 256 (bytes), 32000 (LLaMA-2's tokenizer), 50304 (GPT-2's 50257 tokens
// padded to a multiple of 128, as llm.c does, so the lm_head GEMM dimensions stay multiples of 16); beyond
// that, largest + 1 rounded up to a multiple of 64. The caller may override it (dataloader_open's vocab_size).
inline int choose_vocab_size(int largest_token, int header_hint) {
    if (header_hint > 0) return header_hint;
    const int common[] = {BYTE_VOCAB, 32000, 50304};
    for (int v : common) if (largest_token < v) return v;
    return (largest_token + 1 + 63) / 64 * 64;
}

// ----------------------------------------------------------------------------------------------
// The loader.

// Where a loader is: the next batch is batch `position` (counted from 0) of epoch `epoch`. A POD: it goes
// into checkpoints as it is.
struct DataLoaderState {
    uint64_t epoch;
    uint64_t position;
};

struct DataLoader {
    int B = 0, T = 0, rank = 0, world_size = 1;
    int vocab_size = 0;
    std::string vocab_source;          // why this vocab size (for the start-up line)
    bool shuffle = false;
    uint64_t seed = 0;
    std::vector<DataShard> shards;
    uint64_t num_tokens = 0;           // all shards
    std::vector<uint64_t> first_window;   // shard s holds windows first_window[s] .. first_window[s+1]-1
    uint64_t num_windows = 0;          // all shards, all ranks
    uint64_t batches_per_epoch = 0;    // for each rank
    std::vector<uint32_t> order;       // this epoch's order of the windows (all ranks)
    DataLoaderState state = {0, 0};
    std::vector<uint16_t> window;      // T+1 tokens being read
    std::vector<int> inputs, targets;  // the current batch, B*T each: targets[i] = the token after inputs[i]
};

// splitmix64 (Steele, Lea, Flood 2014; the seeding generator of xoshiro): add the golden-ratio constant,
// then mix the bits with two xor-shift-multiplies.
inline uint64_t splitmix64(uint64_t* state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// Uniform in [0, n) without modulo bias: reject the top sliver of the 2^64 range that n does not divide.
inline uint64_t random_below(uint64_t* state, uint64_t n) {
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do { x = splitmix64(state); } while (x >= limit);
    return x % n;
}

// The window order of epoch dl->state.epoch: 0, 1, 2, ... or, with shuffle, a Fisher-Yates shuffle of it
// (for i from the last down to 1, swap i with a uniform j in [0, i]) seeded with seed + epoch.
inline void dataloader_build_order(DataLoader* dl) {
    dl->order.resize(dl->num_windows);
    for (uint64_t i = 0; i < dl->num_windows; i++) dl->order[i] = (uint32_t)i;
    if (!dl->shuffle) return;
    uint64_t rng = dl->seed + dl->state.epoch;
    for (uint64_t i = dl->num_windows; i-- > 1;) std::swap(dl->order[i], dl->order[random_below(&rng, i + 1)]);
}

inline void dataloader_free(DataLoader* dl) {
    for (DataShard& sh : dl->shards) if (sh.fd >= 0) close(sh.fd);
    *dl = DataLoader();
}

inline std::string dataloader_open(DataLoader* dl, const char* pattern, int B, int T, int rank, int world_size,
                                   int vocab_size, bool shuffle, uint64_t seed) {
    dataloader_free(dl);
    if (B <= 0 || T <= 0) return strprintf("data loader: batch size B=%d and sequence length T=%d must be positive", B, T);
    if (world_size <= 0 || rank < 0 || rank >= world_size)
        return strprintf("data loader: rank %d is not in 0..world_size-1 (world_size %d)", rank, world_size);
    if (vocab_size < 0 || vocab_size > 65536)
        return strprintf("data loader: vocab size %d is not in 1..65536 (tokens are uint16); pass 0 to choose it "
                         "from the data", vocab_size);
    dl->B = B; dl->T = T; dl->rank = rank; dl->world_size = world_size; dl->shuffle = shuffle; dl->seed = seed;

    // Every shard that matches, sorted by name (byte order, whatever the locale).
    glob_t g;
    int rc = glob(pattern, 0, nullptr, &g);
    std::vector<std::string> paths;
    if (rc == 0) paths.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    globfree(&g);
    if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty()))
        return strprintf("no file matches '%s'; check the path, or run `make data` to prepare the default corpus "
                         "(data/kjv_train.bin and data/kjv_val.bin)", pattern);
    if (rc != 0) return strprintf("cannot list the files matching '%s' (glob error %d); check that the folder is readable",
                                  pattern, rc);
    std::sort(paths.begin(), paths.end());

    // Check every shard in full before any training starts.
    int hint = 0, largest = -1;
    for (const std::string& p : paths) {
        DataShard sh;
        std::string err = shard_open(&sh, p.c_str());
        if (!err.empty()) { dataloader_free(dl); return err; }
        dl->shards.push_back(sh);
        if (sh.vocab_hint > 0 && hint > 0 && sh.vocab_hint != hint) {
            std::string err2 = strprintf("'%s' says vocab %d in its header but '%s' says %d: the shards of '%s' come from "
                                         "different tokenizers; keep one kind per pattern", p.c_str(), sh.vocab_hint,
                                         dl->shards[0].path.c_str(), hint, pattern);
            dataloader_free(dl);
            return err2;
        }
        if (sh.vocab_hint > 0) hint = sh.vocab_hint;
        largest = std::max(largest, sh.largest_token);
        dl->num_tokens += sh.num_tokens;
    }
    if (vocab_size > 0) {
        dl->vocab_size = vocab_size;
        dl->vocab_source = "given";
    } else {
        dl->vocab_size = choose_vocab_size(largest, hint);
        dl->vocab_source = hint > 0 ? "from the shard header" : strprintf("from the largest token, %d", largest);
    }
    for (const DataShard& sh : dl->shards) {
        if (sh.largest_token >= dl->vocab_size) {
            std::string err = strprintf("'%s': token %d at position %llu is >= the vocab size %d %s",
                                        sh.path.c_str(), sh.largest_token, (unsigned long long)sh.largest_token_pos,
                                        dl->vocab_size, vocab_size > 0
                                            ? "given to the loader: the shard comes from another tokenizer (a larger vocab), or is damaged"
                                            : "of the shard header: the shard is damaged, or the shards come from different "
                                              "tokenizers; re-create them");
            dataloader_free(dl);
            return err;
        }
    }

    // Windows of T+1 tokens, stride T, within each shard.
    dl->first_window.push_back(0);
    for (const DataShard& sh : dl->shards) {
        uint64_t n = sh.num_tokens > (uint64_t)T ? (sh.num_tokens - 1) / (uint64_t)T : 0;
        dl->first_window.push_back(dl->first_window.back() + n);
    }
    dl->num_windows = dl->first_window.back();
    if (dl->num_windows > UINT32_MAX) {
        std::string err = strprintf("'%s' holds %llu windows of T+1 tokens, more than the loader indexes (2^32); use "
                                    "a longer sequence length T", pattern, (unsigned long long)dl->num_windows);
        dataloader_free(dl);
        return err;
    }
    dl->batches_per_epoch = dl->num_windows / (uint64_t)world_size / (uint64_t)B;
    if (dl->batches_per_epoch == 0) {
        std::string err = strprintf("'%s': too few tokens: %llu tokens in %zu shard(s) give %llu windows of T+1 = %d "
                                    "tokens, but one batch of B = %d on each of %d rank(s) needs %llu windows (one shard "
                                    "needs at least B*T*ranks+1 = %llu tokens); use a smaller B or T, or more data",
                                    pattern, (unsigned long long)dl->num_tokens, dl->shards.size(),
                                    (unsigned long long)dl->num_windows, T + 1, B, world_size,
                                    (unsigned long long)B * world_size, (unsigned long long)B * T * world_size + 1);
        dataloader_free(dl);
        return err;
    }
    dl->window.resize((size_t)T + 1);
    dl->inputs.resize((size_t)B * T);
    dl->targets.resize((size_t)B * T);
    dl->state = {0, 0};
    dataloader_build_order(dl);
    return "";
}

inline void dataloader_init(DataLoader* dl, const char* pattern, int B, int T, int rank, int world_size,
                            int vocab_size, bool shuffle, uint64_t seed) {
    std::string err = dataloader_open(dl, pattern, B, T, rank, world_size, vocab_size, shuffle, seed);
    if (!err.empty()) {
        fprintf(stderr, "error: %s\n", err.c_str());
        exit(EXIT_FAILURE);
    }
    printf("data %s: %zu shard(s), %llu tokens, vocab %d (%s), %llu batches of %dx%d per epoch per rank%s\n", pattern,
           dl->shards.size(), (unsigned long long)dl->num_tokens, dl->vocab_size, dl->vocab_source.c_str(),
           (unsigned long long)dl->batches_per_epoch, B, T, shuffle ? ", shuffled" : "");
}

// The next batch into dl->inputs and dl->targets; after the last batch of an epoch comes the first of the next.
inline void dataloader_next_batch(DataLoader* dl) {
    if (dl->state.position >= dl->batches_per_epoch) {
        dl->state.epoch++;
        dl->state.position = 0;
        dataloader_build_order(dl);
    }
    const int T = dl->T;
    for (int b = 0; b < dl->B; b++) {
        uint64_t slot = (dl->state.position * (uint64_t)dl->B + (uint64_t)b) * (uint64_t)dl->world_size + (uint64_t)dl->rank;
        uint64_t w = dl->order[slot];
        size_t s = (size_t)(std::upper_bound(dl->first_window.begin(), dl->first_window.end(), w) - dl->first_window.begin()) - 1;
        const DataShard& sh = dl->shards[s];
        uint64_t start = (w - dl->first_window[s]) * (uint64_t)T;
        errno = 0;
        if (!read_exact(sh.fd, dl->window.data(), dl->window.size() * sizeof(uint16_t), SHARD_HEADER_BYTES + 2 * start)) {
            fprintf(stderr, "error: reading tokens %llu..%llu of '%s' failed (%s); was the file changed during training?\n",
                    (unsigned long long)start, (unsigned long long)(start + T), sh.path.c_str(),
                    errno ? strerror(errno) : "end of file");
            exit(EXIT_FAILURE);
        }
        for (int t = 0; t < T; t++) {
            dl->inputs[(size_t)b * T + t] = dl->window[t];
            dl->targets[(size_t)b * T + t] = dl->window[t + 1];
        }
    }
    dl->state.position++;
}

inline DataLoaderState dataloader_get_state(const DataLoader* dl) { return dl->state; }

inline std::string dataloader_set_state(DataLoader* dl, DataLoaderState s) {
    if (s.position > dl->batches_per_epoch)
        return strprintf("data loader state: batch %llu of epoch %llu, but an epoch has %llu batches here; the checkpoint "
                         "was made with other data or another B, T or number of ranks: resume with the same ones",
                         (unsigned long long)s.position, (unsigned long long)s.epoch,
                         (unsigned long long)dl->batches_per_epoch);
    dl->state = s;
    dataloader_build_order(dl);
    return "";
}

inline void dataloader_reset(DataLoader* dl) {
    dl->state = {0, 0};
    dataloader_build_order(dl);
}
