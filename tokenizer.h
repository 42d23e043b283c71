// tokenizer.h: the tokenizer of the data, for the trainer and export. Host-only C++ (no CUDA) without the sentencepiece
// library: the trainer builds and runs without it. A tokenizer is a SentencePiece BPE model file (FILE.model, which
// scripts/tokenizer.py writes and LLaMA-2 ships as tokenizer.model), read here from its protobuf encoding.
//
// API. tokenizer_load returns "" on success, else the whole error message (which file, what was found, what to do).
//   std::string tokenizer_load(Tokenizer* t, const std::string& path);
//   std::string tokenizer_decode(const Tokenizer& t, const std::vector<int>& ids);   the text, as sentencepiece's decode
//   std::vector<int> tokenizer_encode(const Tokenizer& t, const std::string& text);  the ids (no <s>), as its encode
//   int tokenizer_piece_bytes(const Tokenizer& t, int id);                          the bytes of text a token stands for
//   std::string tokenizer_llama2c_bin(const Tokenizer& t, int vocab_size);           llama2.c's tokenizer.bin
//   std::string tokenizer_hf_json(const Tokenizer& t);                               transformers' tokenizer.json
//
// The model file (sentencepiece_model.proto): a ModelProto whose field 1 repeats SentencePiece {1 piece, 2 score (float),
// 3 type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte}, field 2 the TrainerSpec {3 model_type
// (2 = BPE), 24 treat_whitespace_as_suffix, 35 byte_fallback, 40-43 unk/bos/eos/pad ids, 44 unk_surface} and field 3 the
// NormalizerSpec {1 name, 2 precompiled_charsmap, 3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces}.
// Protobuf's wire format: each field a varint key (number << 3 | wire type), then a varint (type 0), 8 bytes (1), a
// varint length and that many bytes (2: strings and messages), or 4 bytes (5: floats). Absent fields take the defaults
// of the .proto. Models normalized as LLaMA's are taken (no character map, spaces kept as they are and written as the
// prefix U+2581 "▁"): then the normalization is only that, and this file encodes as sentencepiece does.
#pragma once
#include "dataloader.h"   // strprintf
#include <functional>
#include <map>
#include <queue>
#include <unordered_map>

enum TokenPieceType { PIECE_NORMAL = 1, PIECE_UNKNOWN = 2, PIECE_CONTROL = 3, PIECE_USER_DEFINED = 4, PIECE_UNUSED = 5,
                      PIECE_BYTE = 6 };
constexpr const char* TOKEN_SPACE = "\xe2\x96\x81";   // U+2581, a space inside a piece

struct Tokenizer {
    std::string path;
    std::string file;                    // the model file's bytes (copied into a run folder and exports as they are)
    std::vector<std::string> pieces;
    std::vector<float> scores;
    std::vector<int> types;              // TokenPieceType
    int unk_id = 0, bos_id = 1, eos_id = 2;   // -1: none (bos, eos)
    bool byte_fallback = false, add_dummy_prefix = true;
    std::string unk_surface = " \xe2\x81\x87 ";   // U+2047, what <unk> decodes to
    int byte_ids[256];                   // byte_fallback: the id of <0xNN>
    std::unordered_map<std::string, int> mergeable;   // normal, user-defined and unused pieces: what merges can make
    std::unordered_map<std::string, int> reserved;    // the others (unknown, control, byte pieces)
    std::vector<std::string> user_defined;            // never split, never merged
};

// ---- the protobuf wire format

struct ProtoField {
    int number = 0, wire = 0;
    uint64_t value = 0;                  // wire types 0, 1, 5
    const uint8_t* data = nullptr;       // wire type 2
    size_t size = 0;
};
inline bool proto_varint(const uint8_t** p, const uint8_t* end, uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        const uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7F) << shift;
        if (b < 0x80) return true;
    }
    return false;
}
// The field at *p (moving *p past it); false at a malformed field.
inline bool proto_field(const uint8_t** p, const uint8_t* end, ProtoField* f) {
    uint64_t key, n;
    if (!proto_varint(p, end, &key)) return false;
    *f = ProtoField();
    f->number = (int)(key >> 3);
    f->wire = (int)(key & 7);
    if (f->wire == 0) return proto_varint(p, end, &f->value);
    if (f->wire == 1 || f->wire == 5) {
        n = f->wire == 1 ? 8 : 4;
        if ((uint64_t)(end - *p) < n) return false;
        memcpy(&f->value, *p, n);   // little-endian hosts
        *p += n;
        return true;
    }
    if (f->wire != 2 || !proto_varint(p, end, &n) || (uint64_t)(end - *p) < n) return false;
    f->data = *p;
    f->size = (size_t)n;
    *p += n;
    return true;
}
// Calls each(field) for every field of the message [data, data + size); false if a field is malformed.
template <class F>
inline bool proto_each(const uint8_t* data, size_t size, F each) {
    const uint8_t *p = data, *end = data + size;
    ProtoField f;
    while (p < end) {
        if (!proto_field(&p, end, &f)) return false;
        each(f);
    }
    return true;
}

// ---- UTF-8, as sentencepiece reads it (util.cc: DecodeUTF8): the length of the valid character at s[0..n), else 0
// (a stray continuation byte, a truncated or overlong sequence, a surrogate, past U+10FFFF).
inline int utf8_char_length(const unsigned char* s, size_t n) {
    auto trail = [&](size_t i) { return i < n && (s[i] & 0xC0) == 0x80; };
    uint32_t c;
    if (s[0] < 0x80) return 1;
    if ((s[0] & 0xE0) == 0xC0) {
        c = ((s[0] & 0x1Fu) << 6) | (trail(1) ? s[1] & 0x3Fu : 0);
        return trail(1) && c >= 0x80 ? 2 : 0;
    }
    if ((s[0] & 0xF0) == 0xE0) {
        c = ((s[0] & 0x0Fu) << 12) | (trail(1) ? (s[1] & 0x3Fu) << 6 : 0) | (trail(2) ? s[2] & 0x3Fu : 0);
        return trail(1) && trail(2) && c >= 0x800 && (c < 0xD800 || c >= 0xE000) ? 3 : 0;
    }
    if ((s[0] & 0xF8) == 0xF0) {
        c = ((s[0] & 0x07u) << 18) | (trail(1) ? (s[1] & 0x3Fu) << 12 : 0) | (trail(2) ? (s[2] & 0x3Fu) << 6 : 0) |
            (trail(3) ? s[3] & 0x3Fu : 0);
        return trail(1) && trail(2) && trail(3) && c >= 0x10000 && c <= 0x10FFFF ? 4 : 0;
    }
    return 0;
}
// `bytes` with each byte that starts no valid character replaced by U+FFFD (sentencepiece's decode of byte pieces).
inline std::string utf8_or_replacement(const std::string& bytes) {
    std::string out;
    const unsigned char* s = (const unsigned char*)bytes.data();
    for (size_t i = 0; i < bytes.size();) {
        const int n = utf8_char_length(s + i, bytes.size() - i);
        out += n > 0 ? bytes.substr(i, n) : std::string("\xef\xbf\xbd");
        i += n > 0 ? n : 1;
    }
    return out;
}

// ---- loading

inline std::string tokenizer_load(Tokenizer* t, const std::string& path) {
    *t = Tokenizer();
    t->path = path;
    const char* fix = "give the tokenizer.model of the data (scripts/tokenizer.py or ./train_fp8 prepare --vocab N writes one)";
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) return strprintf("cannot read tokenizer '%s': %s; %s", path.c_str(), strerror(errno), fix);
    char buf[1 << 16];
    size_t got;
    while ((got = fread(buf, 1, sizeof(buf), f)) > 0 && t->file.size() <= (64u << 20)) t->file.append(buf, got);
    const bool read_error = ferror(f) != 0;
    fclose(f);
    if (read_error) return strprintf("reading tokenizer '%s' failed: %s", path.c_str(), strerror(errno));
    if (t->file.size() > (64u << 20))
        return strprintf("'%s' is larger than 64 MB: not a SentencePiece model (LLaMA-2's is 0.5 MB); %s", path.c_str(), fix);
    int model_type = 1, add_dummy_prefix = 1, remove_extra_whitespaces = 1, escape_whitespaces = 1, suffix = 0;
    std::string charsmap, normalizer = "(unnamed)";
    bool ok = true;
    auto text = [](const ProtoField& g) { return std::string((const char*)g.data, g.size); };
    ok = proto_each((const uint8_t*)t->file.data(), t->file.size(), [&](const ProtoField& m) {
        if (m.wire != 2) return;
        if (m.number == 1) {   // a SentencePiece
            std::string piece;
            float score = 0.0f;
            int type = PIECE_NORMAL;
            ok &= proto_each(m.data, m.size, [&](const ProtoField& g) {
                if (g.number == 1 && g.wire == 2) piece = text(g);
                if (g.number == 2 && g.wire == 5) memcpy(&score, &g.value, 4);
                if (g.number == 3 && g.wire == 0) type = (int)g.value;
            });
            t->pieces.push_back(piece);
            t->scores.push_back(score);
            t->types.push_back(type);
        } else if (m.number == 2) {   // the TrainerSpec
            ok &= proto_each(m.data, m.size, [&](const ProtoField& g) {
                const int v = (int)(int64_t)g.value;   // int32 fields: a negative one is a 10-byte varint
                if (g.wire == 0 && g.number == 3) model_type = v;
                if (g.wire == 0 && g.number == 24) suffix = v;
                if (g.wire == 0 && g.number == 35) t->byte_fallback = v != 0;
                if (g.wire == 0 && g.number == 40) t->unk_id = v;
                if (g.wire == 0 && g.number == 41) t->bos_id = v;
                if (g.wire == 0 && g.number == 42) t->eos_id = v;
                if (g.wire == 2 && g.number == 44) t->unk_surface = text(g);
            });
        } else if (m.number == 3) {   // the NormalizerSpec
            ok &= proto_each(m.data, m.size, [&](const ProtoField& g) {
                if (g.wire == 2 && g.number == 1) normalizer = text(g);
                if (g.wire == 2 && g.number == 2) charsmap = text(g);
                if (g.wire == 0 && g.number == 3) add_dummy_prefix = (int)g.value;
                if (g.wire == 0 && g.number == 4) remove_extra_whitespaces = (int)g.value;
                if (g.wire == 0 && g.number == 5) escape_whitespaces = (int)g.value;
            });
        }
    }) && ok;
    const int n = (int)t->pieces.size();
    if (!ok || n == 0)
        return strprintf("'%s' is not a SentencePiece model (%s); %s", path.c_str(),
                         ok ? "it holds no pieces" : "its protobuf encoding is malformed", fix);
    if (n > 65536) return strprintf("tokenizer '%s' has %d pieces, more than uint16 tokens hold (65536); %s", path.c_str(), n, fix);
    if (model_type != 2)
        return strprintf("tokenizer '%s' is a SentencePiece %s model; this program encodes with BPE models (LLaMA's kind): "
                         "train one with ./train_fp8 prepare TEXT OUT_PREFIX --vocab N", path.c_str(),
                         model_type == 1 ? "unigram" : strprintf("type-%d", model_type).c_str());
    if (!charsmap.empty() || remove_extra_whitespaces || !escape_whitespaces || suffix)
        return strprintf("tokenizer '%s' normalizes its text (rule %s%s%s%s%s); this program encodes as LLaMA's tokenizer does, "
                         "text as it is with each space a \"\xe2\x96\x81\" prefix: train one with ./train_fp8 prepare TEXT "
                         "OUT_PREFIX --vocab N", path.c_str(), normalizer.c_str(), charsmap.empty() ? "" : ", a character map",
                         remove_extra_whitespaces ? ", extra spaces removed" : "", escape_whitespaces ? "" : ", spaces not escaped",
                         suffix ? ", spaces as suffixes" : "");
    auto control_or_none = [&](int id) { return id >= 0 && id < n && t->types[id] == PIECE_CONTROL ? id : -1; };
    t->bos_id = control_or_none(t->bos_id);   // named but no control piece: none
    t->eos_id = control_or_none(t->eos_id);
    if (t->unk_id < 0 || t->unk_id >= n || t->types[t->unk_id] != PIECE_UNKNOWN)
        return strprintf("tokenizer '%s': its unknown piece (id %d) is missing; not a model sentencepiece can load; %s",
                         path.c_str(), t->unk_id, fix);
    t->add_dummy_prefix = add_dummy_prefix != 0;
    std::fill(t->byte_ids, t->byte_ids + 256, -1);
    for (int i = 0; i < n; i++) {
        const std::string& p = t->pieces[i];
        const int type = t->types[i];
        unsigned byte = 0;
        if (p.empty() || type < PIECE_NORMAL || type > PIECE_BYTE)
            return strprintf("tokenizer '%s': piece %d is %s; not a model sentencepiece can load; %s", path.c_str(), i,
                             p.empty() ? "empty" : strprintf("of unknown type %d", type).c_str(), fix);
        if (type == PIECE_BYTE) {
            char tail;
            if (p.size() != 6 || sscanf(p.c_str(), "<0x%2X%c", &byte, &tail) != 2 || tail != '>')
                return strprintf("tokenizer '%s': byte piece %d is '%s', not <0xNN>; %s", path.c_str(), i, p.c_str(), fix);
            t->byte_ids[byte] = i;
        }
        const bool merge = type == PIECE_NORMAL || type == PIECE_USER_DEFINED || type == PIECE_UNUSED;
        if (!(merge ? t->mergeable : t->reserved).emplace(p, i).second)
            return strprintf("tokenizer '%s': piece '%s' is there twice (ids %d and %d); %s", path.c_str(), p.c_str(),
                             (merge ? t->mergeable : t->reserved)[p], i, fix);
        if (type == PIECE_USER_DEFINED) t->user_defined.push_back(p);
    }
    if (t->byte_fallback && std::count(t->byte_ids, t->byte_ids + 256, -1) > 0)
        return strprintf("tokenizer '%s' falls back to bytes but lacks the piece of byte 0x%02X; %s", path.c_str(),
                         (int)(std::find(t->byte_ids, t->byte_ids + 256, -1) - t->byte_ids), fix);
    return "";
}

// ---- decoding: sentencepiece's (sentencepiece_processor.cc, Decode). Control pieces (<s>, </s>) are invisible, <unk>
// is the unknown surface; a run of byte pieces is those bytes, each byte that starts no valid UTF-8 character becoming
// U+FFFD; in other pieces "▁" is a space, and the dummy prefix's space is dropped: the first piece's leading "▁" when
// nothing visible came before it. An id past the tokenizer's pieces (a model's vocabulary is padded to a multiple of 16)
// decodes as <unk> does.
inline std::string tokenizer_decode(const Tokenizer& t, const std::vector<int>& ids) {
    std::string text, bytes;
    bool is_bos_ws = true, bos_ws_seen = false;
    for (int id : ids) {
        const bool known = id >= 0 && id < (int)t.pieces.size();
        if (known && t.types[id] == PIECE_BYTE) {
            bytes += (char)strtol(t.pieces[id].c_str() + 3, nullptr, 16);
            continue;
        }
        text += utf8_or_replacement(bytes);
        bytes.clear();
        if (bos_ws_seen || !text.empty()) is_bos_ws = false;
        bos_ws_seen = false;
        if (!known || t.types[id] == PIECE_UNKNOWN) {
            text += t.unk_surface;
            continue;
        }
        if (t.types[id] == PIECE_CONTROL) continue;
        std::string piece = t.pieces[id];
        if (is_bos_ws && t.add_dummy_prefix && piece.rfind(TOKEN_SPACE, 0) == 0) {
            piece.erase(0, 3);
            bos_ws_seen = true;
        }
        for (size_t at; (at = piece.find(TOKEN_SPACE)) != std::string::npos;) piece.replace(at, 3, " ");
        text += piece;
    }
    return text + utf8_or_replacement(bytes);
}

// The bytes of text that token `id` stands for: a byte piece 1, <s> and </s> none, another piece its UTF-8 length with
// "▁" (3 bytes) the space it decodes to, <unk> (no text of the data: byte fallback spells any) and ids past the pieces none.
inline int tokenizer_piece_bytes(const Tokenizer& t, int id) {
    if (id < 0 || id >= (int)t.pieces.size() || t.types[id] == PIECE_CONTROL || t.types[id] == PIECE_UNKNOWN) return 0;
    if (t.types[id] == PIECE_BYTE) return 1;
    int n = (int)t.pieces[id].size();
    for (size_t at = t.pieces[id].find(TOKEN_SPACE); at != std::string::npos; at = t.pieces[id].find(TOKEN_SPACE, at + 3)) n -= 2;
    return n;
}

// ---- encoding: sentencepiece's BPE (bpe_model.cc, SampleEncode without dropout; sentencepiece_processor.cc, Encode).
// The text is normalized: each byte that starts no valid UTF-8 character becomes U+FFFD, each space "▁", and "▁" goes
// in front (add_dummy_prefix). It is cut into symbols: a user-defined piece where one starts (the longest), else one
// character. Then, over and over, the adjacent pair whose concatenation is a piece with the highest score is merged (of
// equal scores the leftmost); an unused piece merges too and is split back into the two it came from at the end. Each
// symbol is then its piece's id; one that is no piece is spelled by the ids of its UTF-8 bytes (byte fallback), or is
// <unk> (a run of them one <unk>).
inline std::vector<int> tokenizer_encode(const Tokenizer& t, const std::string& text) {
    if (text.empty()) return {};
    std::string s = t.add_dummy_prefix ? TOKEN_SPACE : "";
    const unsigned char* u = (const unsigned char*)text.data();
    for (size_t i = 0; i < text.size();) {
        const int n = utf8_char_length(u + i, text.size() - i);
        s += n == 0 ? std::string("\xef\xbf\xbd") : text[i] == ' ' ? std::string(TOKEN_SPACE) : text.substr(i, n);
        i += n > 0 ? n : 1;
    }
    struct Symbol { int prev, next; bool frozen; size_t begin, size; };
    std::vector<Symbol> sym;
    for (size_t at = 0; at < s.size();) {
        size_t n = 0;
        for (const std::string& p : t.user_defined)
            if (p.size() > n && s.compare(at, p.size(), p) == 0) n = p.size();
        const bool frozen = n > 0;
        if (!frozen) n = std::min(s.size() - at, (size_t)std::max(1, utf8_char_length((const unsigned char*)s.data() + at, s.size() - at)));
        sym.push_back({(int)sym.size() - 1, -1, frozen, at, n});
        at += n;
        if (at < s.size()) sym.back().next = (int)sym.size();
    }
    struct Pair { float score; int left, right; size_t size; };
    auto lower = [](const Pair& a, const Pair& b) { return a.score < b.score || (a.score == b.score && a.left > b.left); };
    std::priority_queue<Pair, std::vector<Pair>, decltype(lower)> agenda(lower);
    std::map<std::string, std::pair<std::string, std::string>> unmerge;   // an unused piece -> the two it was made of
    auto piece = [&](int i) { return s.substr(sym[i].begin, sym[i].size); };
    auto consider = [&](int left, int right) {
        if (left < 0 || right < 0 || sym[left].frozen || sym[right].frozen) return;
        const std::string joined = s.substr(sym[left].begin, sym[left].size + sym[right].size);
        const auto it = t.mergeable.find(joined);
        if (it == t.mergeable.end()) return;
        agenda.push({t.scores[it->second], left, right, joined.size()});
        if (t.types[it->second] == PIECE_UNUSED) unmerge[joined] = {piece(left), piece(right)};
    };
    for (size_t i = 1; i < sym.size(); i++) consider((int)i - 1, (int)i);
    while (!agenda.empty()) {
        const Pair top = agenda.top();
        agenda.pop();
        Symbol &l = sym[top.left], &r = sym[top.right];
        if (l.size == 0 || r.size == 0 || l.size + r.size != top.size) continue;   // stale: a side merged since
        l.size += r.size;
        r.size = 0;
        l.next = r.next;
        if (r.next >= 0) sym[r.next].prev = top.left;
        consider(l.prev, top.left);
        consider(top.left, l.next);
    }
    auto id_of = [&](const std::string& p) {
        auto it = t.reserved.find(p);
        if (it != t.reserved.end()) return it->second;
        it = t.mergeable.find(p);
        return it != t.mergeable.end() ? it->second : -1;
    };
    std::vector<int> ids;
    bool prev_unk = false;
    std::function<void(const std::string&)> emit = [&](const std::string& p) {
        const int id = id_of(p);
        if (id >= 0 && t.types[id] == PIECE_UNUSED && unmerge.count(p)) {
            emit(unmerge[p].first);
            emit(unmerge[p].second);
            return;
        }
        if (id >= 0 && id != t.unk_id) {
            ids.push_back(id);
            prev_unk = false;
        } else if (t.byte_fallback) {
            for (unsigned char b : p) ids.push_back(t.byte_ids[b]);
            prev_unk = false;
        } else {
            if (!prev_unk) ids.push_back(t.unk_id);
            prev_unk = true;
        }
    };
    for (int i = 0; i >= 0 && !sym.empty(); i = sym[i].next) emit(piece(i));
    return ids;
}

// ---- exports

// llama2.c's tokenizer.bin (its tokenizer.py export, read by run.c): the longest token's length (int32), then per token
// its score (float32), its length (int32) and its bytes: the piece with each "▁" a space, <s> and </s> as "\n<s>\n" and
// "\n</s>\n", byte pieces as their text "<0xNN>" (run.c turns them into the byte). Ids from the tokenizer's last piece
// up to vocab_size (the model's vocabulary, padded to a multiple of 16) get "<padN>" and a score that no merge beats.
inline std::string tokenizer_llama2c_bin(const Tokenizer& t, int vocab_size) {
    std::vector<std::string> tokens;
    std::vector<float> scores;
    for (int i = 0; i < std::max(vocab_size, (int)t.pieces.size()); i++) {
        std::string p = i >= (int)t.pieces.size() ? strprintf("<pad%d>", i) : i == t.bos_id ? "\n<s>\n" : i == t.eos_id ? "\n</s>\n"
                                                                                                                       : t.pieces[i];
        for (size_t at; (at = p.find(TOKEN_SPACE)) != std::string::npos;) p.replace(at, 3, " ");
        tokens.push_back(p);
        scores.push_back(i < (int)t.pieces.size() ? t.scores[i] : -1e9f);
    }
    int32_t max_len = 0;
    for (const std::string& p : tokens) max_len = std::max(max_len, (int32_t)p.size());
    std::string out((const char*)&max_len, 4);
    for (size_t i = 0; i < tokens.size(); i++) {
        const int32_t len = (int32_t)tokens[i].size();
        out.append((const char*)&scores[i], 4);
        out.append((const char*)&len, 4);
        out += tokens[i];
    }
    return out;
}

// A string as JSON: quoted, with ", \ and the control characters escaped (the rest of UTF-8 as it is).
inline std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (unsigned char ch : s) {
        if (ch == '"' || ch == '\\') out += std::string("\\") + (char)ch;
        else if (ch < 0x20) out += strprintf("\\u%04x", ch);
        else out += (char)ch;
    }
    return out + "\"";
}

// transformers' tokenizer.json for this tokenizer (the tokenizers library's format, as the Llama-2 checkpoints ship it), so
// that AutoTokenizer loads it without sentencepiece: a BPE model with byte fallback over the same pieces and ids, the
// text prefixed with "▁" and each space made "▁" (LLaMA's normalization), <s> put in front, and a decoder that undoes it.
// Its merges (the order in which pairs merge: transformers' generate_merges) are, piece by piece in id order, each
// split of a piece into two pieces, the shorter left part first; sentencepiece merges by score, which falls with the id.
inline std::string tokenizer_hf_json(const Tokenizer& t) {
    const int n = (int)t.pieces.size();
    std::string added, vocab, merges;
    for (int i = 0; i < n; i++) {
        vocab += strprintf("%s\n      %s: %d", i ? "," : "", json_string(t.pieces[i]).c_str(), i);
        if (t.types[i] == PIECE_UNKNOWN || t.types[i] == PIECE_CONTROL || t.types[i] == PIECE_USER_DEFINED)
            added += strprintf("%s\n    {\"id\": %d, \"content\": %s, \"single_word\": false, \"lstrip\": false, \"rstrip\": "
                               "false, \"normalized\": false, \"special\": %s}", added.empty() ? "" : ",", i,
                               json_string(t.pieces[i]).c_str(), t.types[i] == PIECE_USER_DEFINED ? "false" : "true");
        const std::string& p = t.pieces[i];
        for (size_t cut = 1; cut < p.size(); cut++) {
            if (((unsigned char)p[cut] & 0xC0) == 0x80) continue;   // within a character
            const std::string l = p.substr(0, cut), r = p.substr(cut);
            if ((t.mergeable.count(l) || t.reserved.count(l)) && (t.mergeable.count(r) || t.reserved.count(r)))
                merges += strprintf("%s\n      [%s, %s]", merges.empty() ? "" : ",", json_string(l).c_str(), json_string(r).c_str());
        }
    }
    const std::string bos = t.bos_id >= 0 ? json_string(t.pieces[t.bos_id]) : "";
    const std::string post = t.bos_id < 0 ? "null" : strprintf(
        "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": %s, \"type_id\": 0}}, {\"Sequence\": "
        "{\"id\": \"A\", \"type_id\": 0}}], \"pair\": [{\"SpecialToken\": {\"id\": %s, \"type_id\": 0}}, {\"Sequence\": {\"id\": "
        "\"A\", \"type_id\": 0}}, {\"SpecialToken\": {\"id\": %s, \"type_id\": 1}}, {\"Sequence\": {\"id\": \"B\", \"type_id\": "
        "1}}], \"special_tokens\": {%s: {\"id\": %s, \"ids\": [%d], \"tokens\": [%s]}}}", bos.c_str(), bos.c_str(), bos.c_str(),
        bos.c_str(), bos.c_str(), t.bos_id, bos.c_str());
    const std::string space = json_string(TOKEN_SPACE);
    return strprintf(
        "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [%s\n  ],\n"
        "  \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [%s{\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, "
        "\"content\": %s}]},\n  \"pre_tokenizer\": null,\n  \"post_processor\": %s,\n"
        "  \"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": %s}, \"content\": "
        "\" \"}, {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}%s]},\n"
        "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": %s,\n    \"continuing_subword_prefix\": "
        "null,\n    \"end_of_word_suffix\": null,\n    \"fuse_unk\": true,\n    \"byte_fallback\": %s,\n    \"ignore_merges\": false,\n"
        "    \"vocab\": {%s\n    },\n    \"merges\": [%s\n    ]\n  }\n}\n",
        added.c_str(), t.add_dummy_prefix ? strprintf("{\"type\": \"Prepend\", \"prepend\": %s}, ", space.c_str()).c_str() : "",
        space.c_str(), post.c_str(), space.c_str(),
        t.add_dummy_prefix ? ", {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}" : "",
        json_string(t.pieces[t.unk_id]).c_str(), t.byte_fallback ? "true" : "false", vocab.c_str(), merges.c_str());
}
