#!/usr/bin/env bash
# make results: every figure of the README's Results, measured in one run on the GPU at hand, into
# results/<GPU>.md (the tables, captioned with the GPU, the software and the commit) and results/<GPU>.raw.txt
# (every program's output the tables were read from). scripts/results.py makes the tables.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'EOF'
usage: scripts/results.sh [--reps N] [--only SECTIONS] [--budget SECONDS] [--out DIR]

Builds both precisions (make train_fp8 test_fp8 train_fp8_bf16) and measures, on the GPU at hand:
  step        the 1.1B step (B 8, T 2048, random tokens): our FP8 recipe, FP8 with delayed scaling
              (--amax-history 16), FP8 in every layer, our BF16 build, and PyTorch (scripts/bench_torch.py):
              torch.compile BF16, torchao float8 tensorwise and rowwise; interleaved (ours FP8, ..., ours BF16,
              PyTorch, then again) N rounds; the first round's FP8 and BF16 runs also profile step 5 (--profile)
  attention   ./test_fp8 --bench attention and scripts/bench_sdpa.py (cuDNN, FlashAttention-2)
  kernels     ./test_fp8 --bench gemm cast optimizer
  long        the 1.1B at T = 8192 (B 2), FP8 against BF16, N rounds interleaved
  7b          LLaMA-2 7B's dimensions, FP8 against BF16, N rounds interleaved: all 32 layers where the GPU
              has 120 GiB or more, else the first 16; B 2 if it fits, else 1
and, named with --only (each takes minutes and measures quality, not speed):
  tokenizer   the default run (d12, 32 x 512 tokens a step) on the Bible as bytes and with trained 4096- and
              8192-piece tokenizers (data/kjv4096, data/kjv8192: prepared here if missing), 600 steps and 200,
              validated on the whole validation split: bits a byte over the run, and the last sample
  lab         the recipe lab (scripts/study.sh: 22 configurations x 3 seeds of a 27M model)
  study1b     quality per hour at 1.1B (scripts/study.sh --preset 1b: bf16, fp8 2 seeds; its ablation rows 1 seed)
  doctor      the FP8 doctor (--fp8-stats 5) over a 1.1B run in the 1B study's setup and the probe on its last
              checkpoint, drawn into OUT/NAME-fp8_stats.png and OUT/NAME-probe.png (needs matplotlib)
  block       the 1.1B step under per-tensor scaling against block scaling (--scaling block, with E5M2 and with
              E4M3 gradients), N rounds interleaved, the first profiled; ./test_fp8 --bench block
Each train_fp8 run ends with its summary line (the timed steps' mean ms, tokens/s, model TFLOP/s, memory);
a row's figure is the median over the rounds, with their min-max.

  --reps N         rounds of each row (3)
  --only LIST      comma list of the sections above (step,attention,kernels,long,7b)
  --budget S       seconds for the whole run (540): a section that would start later is skipped, said so
  --out DIR        where the two files go (results): GPU.md for the default sections, else GPU-SECTIONS.md
                   (e.g. H100-80GB-HBM3-7b.md for --only 7b), so that a section run alone replaces its own file
Where PyTorch or torchao is missing the PyTorch rows are skipped with a line saying how to get it; the rest
runs. The commit comes from RESULTS_COMMIT where set (a copy of the tree), else from git.
EOF
}

DEFAULT_SECTIONS=step,attention,kernels,long,7b
REPS=3 ONLY=$DEFAULT_SECTIONS BUDGET=540 OUT=results
while (($#)); do
    case $1 in
        --reps) REPS=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "results.sh: unknown option '$1' (scripts/results.sh --help lists them)" >&2; exit 2 ;;
    esac
done
[[ $REPS =~ ^[1-9][0-9]*$ ]] || { echo "results.sh: --reps $REPS: want a whole number, 1 or more" >&2; exit 2; }
[[ $BUDGET =~ ^[1-9][0-9]*$ ]] || { echo "results.sh: --budget $BUDGET: want seconds, 1 or more" >&2; exit 2; }
for s in ${ONLY//,/ }; do
    [[ ,$DEFAULT_SECTIONS,tokenizer,lab,study1b,doctor,block, == *",$s,"* ]] ||
        { echo "results.sh: --only: no section '$s' (step, attention, kernels, long, 7b, tokenizer, lab, study1b, doctor, block)" >&2; exit 2; }
done
wants() { [[ ,$ONLY, == *",$1,"* ]]; }
command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1 ||
    { echo "results.sh: no GPU here (nvidia-smi finds none): the results are measured on a GPU" >&2; exit 1; }

START=$SECONDS
RAW=$(mktemp -d "${TMPDIR:-/tmp}/results.XXXXXX")
time_left() { echo $((BUDGET - (SECONDS - START))); }
# section NAME SECONDS: true if the section may start (SECONDS: about what it takes), else a line in the raw log
section() {
    if ! wants "$1"; then return 1; fi
    if (($(time_left) < $2)); then
        echo "skipped: $(time_left) s of the --budget left, the section takes about $2 s" > "$RAW/skipped-$1.log"
        echo "== $1: skipped, $(time_left) s left of --budget $BUDGET"
        return 1
    fi
    echo "== $1 ($(time_left) s left)"
}

# ---- the software and the commit
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
NAME=$(echo "$GPU" | sed 's/^NVIDIA //; s/[^A-Za-z0-9.]\+/-/g; s/-$//')   # the files: $OUT/$NAME.md, .raw.txt, pictures
[[ $ONLY == "$DEFAULT_SECTIONS" ]] || NAME="$NAME-${ONLY//,/-}"
if [[ -n ${RESULTS_COMMIT:-} ]]; then   # a copy of the tree whose .git, if any, is not the commit's
    COMMIT=$RESULTS_COMMIT
elif git rev-parse --git-dir > /dev/null 2>&1; then
    COMMIT=$(git rev-parse --short HEAD)
    [[ -z $(git status --porcelain --untracked-files=no) ]] || COMMIT="$COMMIT with uncommitted changes"
else
    COMMIT="unknown (no .git and no RESULTS_COMMIT)"
fi
make -j"$(nproc)" train_fp8 test_fp8 train_fp8_bf16 > "$RAW/build.log" 2>&1 ||
    { tail -20 "$RAW/build.log"; echo "results.sh: the build failed (above)" >&2; exit 1; }
CUBLASLT=$(ldd ./train_fp8 | awk '/libcublasLt/ {print $3}')
{
    echo "gpu: $GPU"
    echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
    echo "gpu memory: $(nvidia-smi --query-gpu=memory.total --format=csv,noheader | head -1)"
    echo "cuda: $(nvcc --version | sed -n 's/.*release \([0-9.]*\), V\([0-9.]*\).*/\2/p')"
    echo "cublaslt: $(python3 -c "import ctypes,sys; v=ctypes.CDLL(sys.argv[1]).cublasLtGetVersion(); print(f'{v//10000}.{v//100%100}.{v%100}')" "$CUBLASLT" 2>/dev/null || echo unknown)"
    echo "torch: $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not installed')"
    echo "torchao: $(python3 -c 'import torchao; print(torchao.__version__)' 2>/dev/null || echo 'not installed')"
    echo "commit: $COMMIT"
    echo "date: $(date -u +%Y-%m-%d)"
    echo "reps: $REPS"
    echo "sections: $ONLY"
} > "$RAW/env.txt"
cat "$RAW/env.txt"

# A shard of 4M uniformly random tokens of a 32000-token vocabulary (the header names it): speed runs need no corpus.
DATA=data/random32k.bin
mkdir -p data
[[ -f $DATA ]] || python3 -c "import random,struct; n=1<<22; r=random.Random(0); open('$DATA','wb').write(struct.pack('<256i',20240520,1,n,32000,*[0]*252)+struct.pack('<%dH'%n,*(r.randrange(32000) for _ in range(n))))"
COMMON=(--data "$DATA" --val-data "$DATA" --warmup 1 --steps 10 --eval-every 0 --eval-batches 1 --sample-every 0)

# ours NAME ROUND BINARY FLAGS...: one training run, its whole output kept
ours() {
    local name=$1 round=$2 bin=$3; shift 3
    echo "$bin ${COMMON[*]} $*" > "$RAW/$name-$round.log"
    "./$bin" "${COMMON[@]}" "$@" >> "$RAW/$name-$round.log" 2>&1
    local line; line=$(grep -h '^summary' "$RAW/$name-$round.log")
    if [[ -n $line ]]; then echo "  $name round $round: ms${line#*| ms}"; else echo "  $name round $round: failed: $(tail -1 "$RAW/$name-$round.log")"; fi
}
TORCH_OK=1
python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null || {
    TORCH_OK=0
    echo "PyTorch with CUDA is not importable here: the PyTorch rows are skipped (install torch, then torchao's wheel:" \
         "pip install --no-deps torchao-*.whl)" | tee "$RAW/torch-missing.log"
}

if section step $((REPS * 110)); then
    for r in $(seq "$REPS"); do
        P=(); [[ $r == 1 ]] && P=(--profile 5)
        ours step-fp8 "$r" train_fp8 --model 1b --batch 8 --seq 2048 "${P[@]}"
        ours step-fp8-delayed "$r" train_fp8 --model 1b --batch 8 --seq 2048 --amax-history 16
        ours step-fp8-all-layers "$r" train_fp8 --model 1b --batch 8 --seq 2048 --fp8-all-layers
        ours step-bf16 "$r" train_fp8_bf16 --model 1b --batch 8 --seq 2048 "${P[@]}"
        if ((TORCH_OK)); then
            # at most 240 s a round (the first compiles; later ones find inductor's cache), and never past the budget
            cap=$(($(time_left) - 30)); ((cap > 240)) && cap=240
            timeout "$cap" python3 scripts/bench_torch.py --modes compile,float8-tensorwise,float8-rowwise --batch 8 --seq 2048 \
                > "$RAW/torch-$r.log" 2>&1 || echo "bench_torch.py ended with status $? (124: its $cap s ran out)" >> "$RAW/torch-$r.log"
            grep -h '^result\|skipped\|failed' "$RAW/torch-$r.log" | sed 's/^/  torch: /'
        fi
    done
fi

if section attention 90; then
    ./test_fp8 --bench attention > "$RAW/bench-attention.log" 2>&1
    ((TORCH_OK)) && python3 scripts/bench_sdpa.py > "$RAW/sdpa.log" 2>&1
fi

if section kernels 120; then
    ./test_fp8 --bench gemm cast optimizer > "$RAW/bench-kernels.log" 2>&1
fi

if section long $((REPS * 40)); then
    for r in $(seq "$REPS"); do
        ours long-fp8 "$r" train_fp8 --model 1b --batch 2 --seq 8192
        ours long-bf16 "$r" train_fp8_bf16 --model 1b --batch 2 --seq 8192
    done
fi

if section 7b $((REPS * 80)); then
    MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    L=16; ((MIB >= 120 * 1024)) && L=32
    B=2
    for r in $(seq "$REPS"); do   # the BF16 build needs more memory: it decides B
        ours 7b-bf16 "$r" train_fp8_bf16 --model 7b --layers $L --batch $B --seq 2048
        if [[ $r == 1 && $B == 2 ]] && ! grep -q '^summary' "$RAW/7b-bf16-1.log"; then
            mv "$RAW/7b-bf16-1.log" "$RAW/7b-bf16-b2-refused.log"
            B=1
            ours 7b-bf16 1 train_fp8_bf16 --model 7b --layers $L --batch $B --seq 2048
        fi
        ours 7b-fp8 "$r" train_fp8 --model 7b --layers $L --batch $B --seq 2048
    done
fi

# tok NAME PREFIX STEPS: the default run on PREFIX_train.bin for STEPS steps (warm-up a tenth), the whole validation split
tok() {
    local name=$1 prefix=$2 steps=$3
    echo "train_fp8 --data ${prefix}_train.bin --val-data ${prefix}_val.bin --steps $steps --warmup $((steps / 10)) --eval-batches 1000" > "$RAW/tok-$name.log"
    ./train_fp8 --data "${prefix}_train.bin" --val-data "${prefix}_val.bin" --steps "$steps" --warmup $((steps / 10)) \
        --eval-batches 1000 --out "$RAW/tok-$name.run" >> "$RAW/tok-$name.log" 2>&1
    local line; line=$(grep -h '^summary' "$RAW/tok-$name.log")
    if [[ -n $line ]]; then echo "  tok $name: $(grep 'bits a byte$' "$RAW/tok-$name.log" | tail -1)"
    else echo "  tok $name: failed: $(tail -1 "$RAW/tok-$name.log")"; fi
    rm -rf "$RAW/tok-$name.run"
}
if section tokenizer 110; then
    if [[ ! -f data/kjv_train.bin || ! -f data/kjv.txt ]]; then
        echo "skipped: data/kjv.txt and data/kjv_train.bin are missing: make data prepares them" > "$RAW/skipped-tokenizer.log"
    else
        for v in 4096 8192; do
            [[ -f data/kjv${v}_train.bin && -f data/kjv$v.model ]] ||
                ./train_fp8 prepare data/kjv.txt "data/kjv$v" --vocab $v --force > "$RAW/prepare-$v.log" 2>&1 ||
                echo "skipped: ./train_fp8 prepare data/kjv.txt data/kjv$v --vocab $v failed: $(tail -1 "$RAW/prepare-$v.log")" > "$RAW/skipped-tokenizer.log"
        done
        if [[ ! -f $RAW/skipped-tokenizer.log ]]; then
            for steps in 600 200; do
                tok "bytes-$steps" data/kjv $steps
                tok "4096-$steps" data/kjv4096 $steps
                tok "8192-$steps" data/kjv8192 $steps
            done
        fi
    fi
fi

if section lab 330; then
    scripts/study.sh --dir "$RAW/lab" --deadline $(($(time_left) - 90)) > "$RAW/lab.log" 2>&1
    cp "$RAW/lab/table.md" "$RAW/lab-table.md" 2>/dev/null
    rm -rf "$RAW/lab"
fi

if section study1b 480; then
    scripts/study.sh --preset 1b --seeds 2 --only bf16,fp8 --dir "$RAW/study1b" --deadline $(($(time_left) - 90)) > "$RAW/study1b.log" 2>&1
    scripts/study.sh --preset 1b --seeds 1 --only bf16-linears,m-fp32,fp8-all-layers --dir "$RAW/study1b" \
        --deadline $(($(time_left) - 30)) >> "$RAW/study1b.log" 2>&1
    cp "$RAW/study1b/table.md" "$RAW/study1b-table.md" 2>/dev/null
    rm -rf "$RAW/study1b"
fi

if section doctor 150; then
    # the FP8 doctor on a 1.1B run in the 1B study's setup, the probe on its last checkpoint, both drawn
    DOCTOR=(--model 1b --batch 8 --seq 2048 --steps 240 --warmup 24 --lr 3e-4 --data data/kjv_train.bin
            --val-data data/kjv_val.bin --eval-every 40 --eval-batches 4 --sample-every 0 --fp8-stats 5)
    echo "./train_fp8 ${DOCTOR[*]}" > "$RAW/doctor-train.log"
    ./train_fp8 "${DOCTOR[@]}" --out "$RAW/doctor-run" >> "$RAW/doctor-train.log" 2>&1
    ./train_fp8 probe "$RAW/doctor-run" --batch 8 --seq 2048 --val-data data/kjv_val.bin --out "$RAW/doctor-probe" \
        > "$RAW/doctor-probe.log" 2>&1
    mkdir -p "$OUT"
    if python3 -c 'import matplotlib, numpy' 2> /dev/null; then
        python3 scripts/plot_fp8_stats.py "$RAW/doctor-run" -o "$OUT/$NAME-fp8_stats.png" > "$RAW/doctor-plots.log" 2>&1
        python3 scripts/plot_fp8_stats.py probe "$RAW/doctor-probe/probe.csv" -o "$OUT/$NAME-probe.png" >> "$RAW/doctor-plots.log" 2>&1
    else
        echo "no pictures: matplotlib or numpy is missing (pip install matplotlib)" > "$RAW/doctor-plots.log"
    fi
    cp "$RAW/doctor-probe/probe.csv" "$RAW/doctor-probe.csv" 2> /dev/null
    rm -rf "$RAW/doctor-run" "$RAW/doctor-probe"
fi

if section block $((REPS * 100 + 60)); then
    for r in $(seq "$REPS"); do
        P=(); [[ $r == 1 ]] && P=(--profile 5)
        ours block-tensor "$r" train_fp8 --model 1b --batch 8 --seq 2048 "${P[@]}"
        ours block-block "$r" train_fp8 --model 1b --batch 8 --seq 2048 --scaling block "${P[@]}"
        ours block-block-e4m3 "$r" train_fp8 --model 1b --batch 8 --seq 2048 --scaling block --dy-format e4m3
        ours block-block-dwx "$r" train_fp8 --model 1b --batch 8 --seq 2048 --scaling block --block-dw-x blocks
    done
    ./test_fp8 --bench block > "$RAW/bench-block.log" 2>&1
fi

mkdir -p "$OUT"
python3 scripts/results.py make "$RAW" "$OUT/$NAME.md" || exit 1
# each file after a line "==== NAME" (results.py make reads the tables back from it), ending in a newline
for f in "$RAW"/*; do echo "==== $(basename "$f")"; cat "$f"; [[ -z $(tail -c 1 "$f") ]] || echo; done > "$OUT/$NAME.raw.txt"
echo "results: $OUT/$NAME.md and $OUT/$NAME.raw.txt, $((SECONDS - START)) s"
rm -rf "$RAW"
