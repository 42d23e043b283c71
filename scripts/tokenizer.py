#!/usr/bin/env python3
"""A LLaMA-style tokenizer for train_fp8's data: SentencePiece BPE, trained on the text or brought along.

    scripts/tokenizer.py TEXT OUT_PREFIX --vocab N [--force]
        trains a SentencePiece BPE tokenizer of N pieces on TEXT as LLaMA-2's was made (byte fallback, digits split,
        <unk> <s> </s> with ids 0, 1, 2, no normalization), writes it to OUT_PREFIX.model, and encodes TEXT with it
    scripts/tokenizer.py TEXT OUT_PREFIX --tokenizer FILE.model [--force]
        encodes TEXT with an existing BPE tokenizer (LLaMA-2's own tokenizer.model gives vocabulary 32000), copied
        to OUT_PREFIX.model
      Both write llm.c token shards (dataloader.h): OUT_PREFIX_train.bin (the first 90% of the tokens) and
      OUT_PREFIX_val.bin (the last 10%), each header naming the vocabulary (slot 3), all three files or none. The
      text is one document: <s>, then the tokens of the whole text, which decode back to it exactly (a character
      the vocabulary lacks is spelled by its UTF-8 bytes, <0xNN>). ./train_fp8 prepare TEXT OUT_PREFIX --vocab N
      runs this; ./train_fp8 finds OUT_PREFIX.model beside the shards.
    scripts/tokenizer.py encode FILE.model [TEXT]   the ids of TEXT's contents (else stdin) on one line, no <s>
    scripts/tokenizer.py decode FILE.model          ids (stdin, separated by white space) -> text on stdout
    scripts/tokenizer.py test                       checks of this script (make test runs it)

Needs the sentencepiece package: pip install -r scripts/requirements.txt (or pip install sentencepiece).
"""
import argparse
import array
import os
import shutil
import struct
import subprocess
import sys
import tempfile

try:
    import sentencepiece as spm
    MISSING = None
except ImportError as e:
    MISSING = str(e)

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256   # dataloader.h
CHUNK_CHARS = 1 << 20    # encoded in pieces of about this many characters, cut after a newline
# LLaMA-2's tokenizer.model holds these settings (its trainer_spec and normalizer_spec). input_sentence_size caps
# the lines the trainer reads (a random sample of them) so that a large corpus trains in bounded memory.
LLAMA_TRAINER = dict(model_type="bpe", character_coverage=0.99995, split_digits=True, byte_fallback=True,
                     allow_whitespace_only_pieces=True, max_sentencepiece_length=16, split_by_unicode_script=True,
                     split_by_whitespace=True, split_by_number=True, normalization_rule_name="identity",
                     add_dummy_prefix=True, remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                     input_sentence_size=10_000_000, shuffle_input_sentence=True)


def fail(message):
    sys.exit(f"error: {message}")


def need_sentencepiece():
    if MISSING:
        fail(f"scripts/tokenizer.py needs the sentencepiece package ({MISSING}): pip install -r scripts/requirements.txt")


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail(f"cannot read '{path}': {e.strerror}; give the path of a text file (make data prepares data/kjv.txt)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"'{path}' is not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}): a SentencePiece tokenizer reads "
             f"Unicode; convert the file (e.g. iconv -f LATIN1 -t UTF-8) or prepare it as bytes (--vocab 256)")


def load_model(path):
    """The tokenizer in `path`, a SentencePiece BPE model with byte fallback and ids that fit uint16 tokens."""
    if not os.path.isfile(path):
        fail(f"--tokenizer {path}: no such file; give a SentencePiece model (FILE.model)")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError) as e:
        fail(f"--tokenizer {path}: not a SentencePiece model ({e}); give a FILE.model that sentencepiece wrote")
    with open(path, "rb") as f:
        kind = model_type(f.read())
    if kind != 2:
        fail(f"--tokenizer {path}: a SentencePiece {'unigram' if kind == 1 else f'type-{kind}'} model; train_fp8 encodes "
             f"with BPE models (LLaMA's kind): train one with --vocab N instead")
    if sp.get_piece_size() > 65536:
        fail(f"--tokenizer {path}: {sp.get_piece_size()} pieces, more than uint16 tokens hold (65536)")
    return sp


def model_type(proto):
    """trainer_spec.model_type of a serialized ModelProto (1 unigram, 2 BPE; absent: unigram), read from the wire
    format: ModelProto field 2 is the TrainerSpec, whose field 3 is the type."""
    def fields(data):
        at = 0
        while at < len(data):
            key, at = varint(data, at)
            wire = key & 7
            if wire == 0:
                value, at = varint(data, at)
            elif wire == 2:
                n, at = varint(data, at)
                value, at = data[at:at + n], at + n
            elif wire in (1, 5):
                value, at = None, at + (8 if wire == 1 else 4)
            else:
                return
            yield key >> 3, value

    def varint(data, at):
        value = shift = 0
        while True:
            b = data[at]
            value |= (b & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if b < 0x80:
                return value, at
    kind = 1
    for field, value in fields(proto):
        if field == 2:
            kind = dict(fields(value)).get(3, 1)
    return kind


def encode(sp, text, chunk_chars=CHUNK_CHARS):
    """The ids of `text` (no <s>), exactly those of sp.encode(text), as uint16, in pieces encoded on every core. No
    piece holds a newline (the trainer reads the text line by line), so no merge crosses one: the text is cut after
    newlines, and each piece but the first is encoded behind a newline, whose ids (the dummy prefix's, then the
    newline's) are dropped; a model with a piece that holds a newline gets the whole text at once."""
    if any("\n" in sp.id_to_piece(i) for i in range(sp.get_piece_size())):
        return array.array("H", sp.encode(text))
    pieces, at = [], 0
    while at < len(text):
        end = text.find("\n", at + chunk_chars)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[at:end])
        at = end
    skip = len(sp.encode("\n"))
    ids = array.array("H")
    for i, piece_ids in enumerate(sp.encode([p if i == 0 else "\n" + p for i, p in enumerate(pieces)],
                                            num_threads=os.cpu_count() or 1)):
        ids.extend(piece_ids if i == 0 else piece_ids[skip:])
    return ids


def shard_bytes(tokens, vocab):
    header = [SHARD_MAGIC, SHARD_VERSION, len(tokens), vocab] + [0] * (HEADER_INTS - 4)
    return struct.pack(f"<{HEADER_INTS}i", *header) + tokens.tobytes()


def prepare(text_path, prefix, vocab, tokenizer, force):
    need_sentencepiece()
    if not prefix or prefix.endswith("/"):
        fail(f"OUT_PREFIX '{prefix}' has no file name: give the shards' path without its ending, e.g. data/kjv4k for "
             f"data/kjv4k_train.bin, data/kjv4k_val.bin and data/kjv4k.model")
    if (vocab is None) == (tokenizer is None):
        fail("give --vocab N (train a tokenizer of N pieces) or --tokenizer FILE.model (use that one), one of the two")
    if vocab is not None and not 260 <= vocab <= 65536:
        fail(f"--vocab {vocab}: a trained tokenizer holds <unk> <s> </s>, the 256 byte pieces and at least one more, "
             f"and tokens are uint16: give N in [260, 65536]{' (256: ./train_fp8 prepare TEXT OUT_PREFIX, bytes)' if vocab == 256 else ''}")
    outputs = [prefix + "_train.bin", prefix + "_val.bin", prefix + ".model"]
    for out in outputs:
        if not force and os.path.exists(out):
            fail(f"'{out}' exists: delete it, choose another OUT_PREFIX, or add --force to replace it")
    folder = os.path.dirname(prefix) or "."
    if not os.path.isdir(folder):
        fail(f"cannot write into '{folder}': no such folder; make it first (mkdir -p {folder})")
    text = read_text(text_path)
    if not text:
        fail(f"'{text_path}' is empty: there is nothing to tokenize")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".tokenizer-") as tmp:
        model = os.path.join(tmp, "tokenizer.model")
        if tokenizer is None:
            try:
                spm.SentencePieceTrainer.train(input=text_path, model_prefix=os.path.join(tmp, "tokenizer"),
                                               vocab_size=vocab, num_threads=os.cpu_count() or 1, minloglevel=2,
                                               **LLAMA_TRAINER)
            except RuntimeError as e:
                fail(f"sentencepiece could not train {vocab} pieces on '{text_path}': {str(e).rstrip('.')}. The pieces are <unk> <s> </s>, "
                     f"the 256 bytes, the text's characters, then merges that occur in the text: give a --vocab within "
                     f"the bounds sentencepiece names")
        else:
            shutil.copyfile(tokenizer, model)
        sp = load_model(model)
        ids = array.array("H", [sp.bos_id()]) + encode(sp, text)
        n_val = len(ids) // 10
        if n_val == 0:
            fail(f"'{text_path}' gives {len(ids)} tokens; it needs at least 10 (90% for training, 10% for validation), "
                 f"and in practice far more: a batch takes B*T+1 tokens")
        n_train, n = len(ids) - n_val, sp.get_piece_size()
        for out, data in ((outputs[0], shard_bytes(ids[:n_train], n)), (outputs[1], shard_bytes(ids[n_train:], n))):
            with open(os.path.join(tmp, os.path.basename(out)), "wb") as f:
                f.write(data)
        for out in outputs:   # all three are whole before the first one is renamed
            os.replace(os.path.join(tmp, os.path.basename(out)) if not out.endswith(".model") else model, out)
    n_bytes = len(text.encode("utf-8"))
    source = f"trained on {text_path}" if tokenizer is None else f"a copy of {tokenizer}"
    print(f"wrote {outputs[2]}: SentencePiece BPE, {n} pieces ({source})")
    print(f"wrote {outputs[0]}: {n_train} tokens, vocab {n}")
    print(f"wrote {outputs[1]}: {n_val} tokens, vocab {n}")
    print(f"{text_path}: {n_bytes} bytes in {len(ids) - 1} tokens and <s>, {n_bytes / (len(ids) - 1):.3f} bytes a token")


def run_test():
    """Round trips, the shards, the cut into pieces and the refusals, on small texts made here."""
    checks = 0

    def check(ok, what):
        nonlocal checks
        if not ok:
            sys.exit(f"tokenizer test FAILED: {what}")
        checks += 1

    def refused(args, piece, what):   # this script with `args` must exit non-zero, its message holding `piece`
        r = subprocess.run([sys.executable, __file__] + args, capture_output=True, text=True)
        check(r.returncode != 0 and r.stderr.startswith("error: ") and piece in r.stderr,
              f"{what}: exit {r.returncode}, '{r.stderr.strip()}' should name '{piece}'")

    def shard(path):
        with open(path, "rb") as f:
            data = f.read()
        header = struct.unpack(f"<{HEADER_INTS}i", data[:4 * HEADER_INTS])
        return header, array.array("H", data[4 * HEADER_INTS:])

    words = ["and", "the", "lord", "said", "unto", "him", "of", "light", "earth", "heaven", "was", "good", "in",
             "beginning", "god", "created", "waters", "day", "night", "let", "there", "be", "1:1", "2:17", "30"]
    lines = [" ".join(words[(7 * i + 3 * j) % len(words)] for j in range(4 + i % 9)).capitalize() + "."
             for i in range(3000)]
    text = "\n".join(lines) + "\n\n  two spaces, a tab\there, and ünïcödé 日本 at the end\n"
    with tempfile.TemporaryDirectory() as tmp:
        path, prefix = os.path.join(tmp, "t.txt"), os.path.join(tmp, "t")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        r = subprocess.run([sys.executable, __file__, path, prefix, "--vocab", "400"], capture_output=True, text=True)
        check(r.returncode == 0, f"prepare --vocab 400 failed: {r.stderr}")
        sp = load_model(prefix + ".model")
        check(sp.get_piece_size() == 400, f"{sp.get_piece_size()} pieces, want 400")
        check([sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"] and sp.bos_id() == 1,
              "ids 0, 1, 2 are <unk> <s> </s>")
        check([sp.id_to_piece(3 + b) for b in (0, 10, 255)] == ["<0x00>", "<0x0A>", "<0xFF>"],
              "the 256 byte pieces follow, <0x00> at id 3 (llama2.c's run.c expects them there)")
        check(sp.encode("1:17") == [sp.piece_to_id(p) for p in ["▁", "1", ":", "1", "7"]], "digits are split")
        (h_train, train), (h_val, val) = shard(prefix + "_train.bin"), shard(prefix + "_val.bin")
        for h in (h_train, h_val):
            check(h[:2] == (SHARD_MAGIC, SHARD_VERSION) and h[3] == 400 and not any(h[4:]), f"shard header {h[:5]}")
        check(h_train[2] == len(train) and h_val[2] == len(val), "the headers count the tokens")
        ids = list(train) + list(val)
        check(len(val) == len(ids) // 10, f"{len(train)} + {len(val)} tokens: the last 10% are the validation shard")
        check(ids == [1] + sp.encode(text), "the shards hold <s> and sp.encode(text), in order")
        check(sp.decode(ids) == text, "the tokens decode back to the text exactly")
        for s in ["ünïcödé 日本", "unseen: ½ ☃ 🙂 ẞ", "\ttabs\tand  spaces  ", ""]:
            ids_s = sp.encode(s)
            check(sp.decode(ids_s) == s, f"round trip of {s!r}")
        unseen = sp.encode("🙂")
        check([sp.id_to_piece(i) for i in unseen[-4:]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"],
              f"a character outside the vocabulary is its UTF-8 bytes: {[sp.id_to_piece(i) for i in unseen]}")
        check(list(encode(sp, text, chunk_chars=50)) == sp.encode(text), "cut into pieces of 50 characters: the same ids")
        # an existing tokenizer: the same tokens, the model copied byte for byte
        other = os.path.join(tmp, "u")
        r = subprocess.run([sys.executable, __file__, path, other, "--tokenizer", prefix + ".model"],
                           capture_output=True, text=True)
        check(r.returncode == 0 and shard(other + "_train.bin")[1] == train and shard(other + "_val.bin")[1] == val,
              f"--tokenizer: the same shards ({r.stderr})")
        with open(prefix + ".model", "rb") as a, open(other + ".model", "rb") as b:
            check(a.read() == b.read(), "--tokenizer: OUT_PREFIX.model is a copy")
        r = subprocess.run([sys.executable, __file__, "encode", prefix + ".model", path], capture_output=True, text=True)
        check(r.returncode == 0 and [int(w) for w in r.stdout.split()] == sp.encode(text), "encode FILE.model TEXT")
        r = subprocess.run([sys.executable, __file__, "decode", prefix + ".model"], input=" ".join(map(str, ids)),
                           capture_output=True, text=True)
        check(r.returncode == 0 and r.stdout == text, "decode FILE.model")
        # refusals, each leaving the files as they were
        before = {name: os.path.getmtime(os.path.join(tmp, name)) for name in os.listdir(tmp)}
        latin1 = os.path.join(tmp, "latin1.txt")
        with open(latin1, "wb") as f:
            f.write("caf\u00e9".encode("latin-1"))
        unigram = os.path.join(tmp, "unigram")
        spm.SentencePieceTrainer.train(input=path, model_prefix=unigram, vocab_size=60, model_type="unigram",
                                       hard_vocab_limit=False, minloglevel=2)
        for args, piece, what in [
                ([path, prefix, "--vocab", "400"], prefix + "_train.bin", "existing shards without --force"),
                ([path, os.path.join(tmp, "v"), "--vocab", "256"], "./train_fp8 prepare", "--vocab 256"),
                ([path, os.path.join(tmp, "v"), "--vocab", "70000"], "65536", "--vocab 70000"),
                ([path, os.path.join(tmp, "v")], "--vocab N", "neither --vocab nor --tokenizer"),
                ([os.path.join(tmp, "none.txt"), os.path.join(tmp, "v"), "--vocab", "400"], "none.txt", "no text"),
                ([latin1, os.path.join(tmp, "v"), "--vocab", "400"], "byte 3 is 0xe9", "a Latin-1 text"),
                ([path, os.path.join(tmp, "v"), "--vocab", "60000"], "give a --vocab", "more pieces than the text has"),
                ([path, os.path.join(tmp, "v"), "--vocab", "300"], "required_chars", "fewer pieces than the text needs"),
                ([path, os.path.join(tmp, "v"), "--tokenizer", path], "not a SentencePiece model", "a text as tokenizer"),
                ([path, os.path.join(tmp, "v"), "--tokenizer", unigram + ".model"], "unigram", "a unigram model"),
                ([path, os.path.join(tmp, "no", "v"), "--vocab", "400"], "mkdir -p", "a missing folder"),
                ([path, tmp + "/", "--vocab", "400"], "no file name", "an OUT_PREFIX without a file name")]:
            refused(args, piece, what)
        check(all(os.path.getmtime(os.path.join(tmp, name)) == t for name, t in before.items()) and
              not any(name.startswith(("v_", "v.", ".tokenizer-")) for name in os.listdir(tmp)),
              f"a refusal changed or left files: {sorted(os.listdir(tmp))}")
        r = subprocess.run([sys.executable, __file__, path, prefix, "--vocab", "360", "--force"],
                           capture_output=True, text=True)
        check(r.returncode == 0 and shard(prefix + "_val.bin")[0][3] == 360, f"--force replaces all three: {r.stderr}")
    print(f"tokenizer test: passed ({checks} checks)")


def main(argv):
    if argv == ["test"]:
        if MISSING:   # make test runs on machines without it too
            print(f"tokenizer test: SKIP ({MISSING}: pip install -r scripts/requirements.txt)")
            return
        return run_test()
    if argv[:1] in (["encode"], ["decode"]):
        need_sentencepiece()
        parser = argparse.ArgumentParser(prog=f"scripts/tokenizer.py {argv[0]}")
        parser.add_argument("model", metavar="FILE.model")
        if argv[0] == "encode":
            parser.add_argument("text", metavar="TEXT", nargs="?", help="a text file (default: stdin)")
        args = parser.parse_args(argv[1:])
        sp = load_model(args.model)
        if argv[0] == "encode":
            text = read_text(args.text) if args.text else sys.stdin.buffer.read().decode("utf-8")
            print(" ".join(map(str, encode(sp, text))))
        else:
            sys.stdout.buffer.write(sp.decode([int(w) for w in sys.stdin.read().split()]).encode("utf-8"))
        return
    parser = argparse.ArgumentParser(prog="scripts/tokenizer.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("text", metavar="TEXT")
    parser.add_argument("prefix", metavar="OUT_PREFIX")
    parser.add_argument("--vocab", type=int, metavar="N", help="train a tokenizer of N pieces on TEXT")
    parser.add_argument("--tokenizer", metavar="FILE.model", help="encode with this SentencePiece BPE model")
    parser.add_argument("--force", action="store_true", help="replace existing OUT_PREFIX files")
    args = parser.parse_args(argv)
    prepare(args.text, args.prefix, args.vocab, args.tokenizer, args.force)


if __name__ == "__main__":
    main(sys.argv[1:])
