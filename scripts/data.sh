#!/usr/bin/env bash
# data.sh: prepare the default corpus under data/, the King James Bible:
#   data/kjv.txt            the text, one verse a line ("Ge1:1 In the beginning God created ..."), 4.4 MB
#   data/kjv_train.bin      its first 90% as bytes (vocab 256), a token shard (dataloader.h describes the format)
#   data/kjv_val.bin        its last 10%
#   data/kjv8192.model      a SentencePiece BPE tokenizer of 8192 pieces trained on it (scripts/tokenizer.py)
#   data/kjv8192_train.bin  the same two parts in its tokens: what make train trains on
#   data/kjv8192_val.bin
# Needs the `bible` command (Debian/Ubuntu package bible-kjv; installed here when running as root), ./train_fp8
# (make) and, for the tokenizer, Python's sentencepiece (pip install -r scripts/requirements.txt). Run from anywhere:
# it works in the repository's folder. `make data` runs it.
set -euo pipefail
cd "$(dirname "$0")/.."   # the repository

# prepare_tokens: the tokenizer and the text in its tokens, unless they exist
prepare_tokens() {
    if [[ -f data/kjv8192.model && -f data/kjv8192_train.bin && -f data/kjv8192_val.bin ]]; then
        echo "data: data/kjv8192.model and its shards already exist (delete them to prepare them again)"
        return
    fi
    if ! ./train_fp8 prepare data/kjv.txt data/kjv8192 --vocab 8192 --force; then
        echo "error: the bytes are ready (data/kjv_train.bin), but not the 8192-piece tokenizer that make train uses" \
             "(above: its fix). Python's sentencepiece: pip install -r scripts/requirements.txt; then run $0 again" >&2
        exit 1
    fi
}

if [[ -f data/kjv_train.bin && -f data/kjv_val.bin && -f data/kjv.txt ]]; then
    echo "data: data/kjv.txt, data/kjv_train.bin and data/kjv_val.bin already exist (delete them to prepare them again)"
    prepare_tokens
    exit 0
fi

if ! command -v bible > /dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get > /dev/null; then
        echo "data: the 'bible' command is missing; installing the package bible-kjv"
        if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y bible-kjv; }; then
            echo "error: apt-get could not install bible-kjv (see above); install it by hand, then run $0 again" >&2
            exit 1
        fi
    else
        echo "error: the 'bible' command is missing. It comes with the Debian/Ubuntu package bible-kjv:" >&2
        echo "         sudo apt-get install bible-kjv" >&2
        echo "       then run $0 again." >&2
        exit 1
    fi
fi
if [[ ! -x ./train_fp8 ]]; then
    echo "error: ./train_fp8 is missing: build it first (make), then run $0 again" >&2
    exit 1
fi

# -f turns bible's pretty-printing off: one verse a line, each after its reference.
mkdir -p data
bible -f Gen1:1-Rev22:21 < /dev/null > data/kjv.txt.tmp
verses=$(wc -l < data/kjv.txt.tmp)
bytes=$(wc -c < data/kjv.txt.tmp)
if [[ $verses -ne 31102 || $bytes -lt 4300000 || $bytes -gt 4500000 ]]; then
    echo "error: 'bible -f Gen1:1-Rev22:21' gave $verses lines and $bytes bytes; the King James Bible has 31102" \
         "verses and about 4.4 MB. Is the bible-kjv package complete? (reinstall it: apt-get install --reinstall bible-kjv)" >&2
    rm -f data/kjv.txt.tmp
    exit 1
fi
mv data/kjv.txt.tmp data/kjv.txt
echo "data: data/kjv.txt: $verses verses, $bytes bytes"

# --force: one of the two shards may be left from an earlier, interrupted preparation
./train_fp8 prepare data/kjv.txt data/kjv --force
ls -l data/kjv_train.bin data/kjv_val.bin
prepare_tokens
