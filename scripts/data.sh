#!/usr/bin/env bash
# data.sh: prepare the default corpus under data/, the King James Bible as bytes (vocab 256):
#   data/kjv.txt        the text, one verse a line ("Ge1:1 In the beginning God created ..."), 4.4 MB
#   data/kjv_train.bin  its first 90% as a token shard (dataloader.h describes the format)
#   data/kjv_val.bin    its last 10%
# Needs the `bible` command (Debian/Ubuntu package bible-kjv; installed here when running as root) and
# ./train_fp8 (make). Run from anywhere: it works in the repository's folder. `make data` runs it.
set -euo pipefail
cd "$(dirname "$0")/.."   # the repository

if [[ -f data/kjv_train.bin && -f data/kjv_val.bin ]]; then
    echo "data: data/kjv_train.bin and data/kjv_val.bin already exist (delete them to prepare them again)"
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
