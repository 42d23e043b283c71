#!/usr/bin/env bash
# study.sh: the recipe lab (README "Recipe lab"). Trains several seeds of each configuration - the BF16 build, the
# FP8 recipe, its variants and each published ablation as one flag - on one GPU, then prints the table per
# configuration (mean +- std over seeds, against the BF16 build with the difference's standard error): the final and
# best validation loss, tokens/s, and the training time at which the validation loss first reaches the BF16 build's
# loss at 60% of its run (time to quality); and draws the curves (scripts/plot_loss.py).
#
#   scripts/study.sh [flags]       run the study (make study builds both binaries and the data first, then runs this)
#   scripts/study.sh --preset 1b   BF16 against FP8 at 1.1B's shape, one run at a time: time to quality, and the
#                                  ablation of a difference (--bf16-linears, --m-dtype fp32, --fp8-all-layers)
#   scripts/study.sh table DIR     the table of a study folder (printed at the end of a study too)
#   scripts/study.sh test          the table maker on fixed log.csv files (make test runs it; no GPU)
#   scripts/study.sh --help        the flags
#
# Two binaries: ./train_fp8 (the FP8 build, `make`) and ./train_fp8_bf16 (`make train_fp8_bf16`: the same source
# compiled with PRECISION=BF16 into another file, so that neither build overwrites the other and both can run at once).
#
# Both presets train on one epoch at most of the King James Bible (3.96M byte tokens): the default run of train_fp8
# (preset d12, 600 steps of 32 x 512 tokens) passes 2.5 times over it, and the README's 1000-step runs overfit after
# ~700 steps: their last validation losses mix memorisation into an FP8-vs-BF16 comparison. Here a run takes 240 steps
# of 16384 tokens (the corpus holds 241 such batches, at 32 x 512 as at 8 x 2048), so no training window is seen twice
# and the validation loss is still falling at the end. Warm-up 10% of the steps, then the default cosine schedule.
#
# --preset default: the ablations. The model is smaller than d12 (dim 512, 8 layers, 8 heads, FFN 1536: 27.4M
# parameters, 190 MFLOP a token against d12's 567), so that 22 configurations x 3 seeds fit in about 11 minutes of one
# GPU with both binaries built (the estimate below), 8 processes at a time. Validation on the whole validation split
# (26 batches) every steps/6 steps. Processes on one GPU without MPS take turns on it (time slices; their kernels do
# not overlap), so running several at once does not add up their speeds: it keeps the GPU busy while each process
# starts, loads its data, evaluates, writes its checkpoint and waits on the host between steps. 8 at a time should
# leave no gap; memory is no limit (a run of this model needs a few GB). But a step's time then holds the other runs'
# turns too: the table's times and tokens/s compare only runs that shared the GPU alike (the table warns).
#
# --preset 1b: quality per hour at scale. TinyLlama-1.1B's shape (dim 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632;
# 0.97B parameters with 256 byte tokens instead of its 32000), B = 8, T = 2048, 3 seeds, one run at a time (--parallel 1), so that each step's time is its own. Peak LR 3e-4, half the default 6e-4 (chosen for the small
# models): 1B-parameter LLaMA-style models train at 3e-4 to 4e-4, and 16384 tokens a step is a small, noisy batch for
# them. Validation every 10 steps (the crossing of the BF16 loss is interpolated between two of them, 1.8-2.2 s of
# training apart) on the first 4 of the 26 validation batches, so that the 25 evaluations of a run cost ~6 s: the
# evaluation is left out of the measured time, but not out of the GPU's. About 7 minutes on one H100 (404 s: bf16 runs
# ~75 s, fp8 ~59 s); --only bf16, then --only fp8 --skip-done into the same --dir, splits it into two invocations.
# Its ablation rows (bf16-linears: the FP8 build with the BF16 build's linears and first moment, which must train as
# the BF16 build; m-fp32; fp8-all-layers) compare seed by seed with the bf16 and fp8 runs of the same seed, so one
# seed of each tells a cause from the spread over seeds: --only bf16,fp8 --seeds 2, then --only
# bf16-linears,m-fp32,fp8-all-layers --seeds 1 (scripts/results.sh --only study1b does so).
set -euo pipefail
cd "$(dirname "$0")/.."   # the repository

TRAIN_DATA=data/kjv_train.bin
VAL_DATA=data/kjv_val.bin
DEADLINE_GRACE=60   # --deadline: runs still going this many seconds after it are stopped

usage() {
    cat <<EOF
usage: scripts/study.sh [flags]          run the study (binaries from make train_fp8 train_fp8_bf16, data from make data)
       scripts/study.sh table DIR        the table of study folder DIR
       scripts/study.sh test             test the table maker on fixed log.csv files (host only)
flags (default in brackets; [X | Y]: X for --preset default, Y for --preset 1b):
  --preset NAME        default: 22 configurations of a 27M model, 8 runs at a time; 1b: bf16 and fp8 at 1.1B's shape
                       and three ablation rows, one run at a time, for their time to quality [default]
  --seeds N            seeds 1..N of every configuration [3]
  --parallel P         runs at a time on the GPU; more than 1 inflates the table's times and lowers its tokens/s [8 | 1]
  --steps N            optimizer steps of every run; warm-up N/10, validation every N/6 | N/24 steps [240: one epoch]
  --only A,B,...       only these configurations (--list shows them); the runs of others already in DIR stay, and
                       the table covers them all (--only bf16, then --only fp8, into one DIR: one table)
  --skip A,B,...       all configurations but these
  --add NAME=BUILD:FLAGS  one more configuration, BUILD fp8 or bf16 (repeatable), e.g. --add 'bf16-qk-norm=bf16:--qk-norm'
  --extra "FLAGS"      flags for every run, after the setup's (they override it), e.g. --extra "--lr 1e-3"
  --dir DIR            the study folder: DIR/NAME/seed-S/ (log.csv, console.txt, cmd.txt, exit.txt, parallel.txt),
                       DIR/table.md, DIR/loss_bands.png [out/study | out/study-1b]
  --deadline S         start no run after S seconds; stop the runs still going ${DEADLINE_GRACE} s later (0 = none) [0]
  --skip-done          leave out the runs of DIR that already finished with exit status 0
  --keep-checkpoints   keep each run's end-of-run checkpoint (deleted by default: the study reads only log.csv)
  --fp8-bin PATH       the FP8 build [./train_fp8]
  --bf16-bin PATH      the BF16 build [./train_fp8_bf16]
  --dry-run            check the binaries, data and flags, print the runs and the estimate; run nothing
  --list               print the configurations and exit
FLAGS are split at spaces. Several --only/--skip/--add/--extra add up.
EOF
}

fail() { echo "error: $*" >&2; exit 1; }

# The configurations: NAME BUILD FLAGS... (the README's "Recipe lab" says why each value).
preset_configs() {
    if [[ $PRESET == 1b ]]; then
        # the recipe against the BF16 build, and the ablation of a difference between them: the FP8 build with every
        # linear and the first moment as the BF16 build has them (its control), the FP8 first moment alone, the
        # first/last-layer rule
        cat <<EOF
bf16 bf16
fp8 fp8
bf16-linears fp8 --bf16-linears --m-dtype fp32
m-fp32 fp8 --m-dtype fp32
fp8-all-layers fp8 --fp8-all-layers
EOF
        return
    fi
    cat <<EOF
bf16 bf16
fp8 fp8
fp8-all-layers fp8 --fp8-all-layers
fp8-attention fp8 --fp8-attention
v-e4m3 fp8 --v-dtype e4m3
v-e5m2 fp8 --v-dtype e5m2
m-fp32 fp8 --m-dtype fp32
delayed-16 fp8 --amax-history 16
interval-16 fp8 --amax-history 16 --quant-interval 16
amax-warmup fp8 --amax-history 16 --amax-warmup $WARMUP
smooth-quant fp8 --smooth-quant 0.5
qkv-clip fp8 --qkv-clip 8
qk-norm fp8 --qk-norm
init-trunc-normal fp8 --init trunc-normal --init-std 0.02
init-torch-default fp8 --init torch-default
wd-constant-lr fp8 --wd-constant-lr
adam-atan2 fp8 --adam-atan2
update-clip fp8 --update-clip
recipe-1 fp8 --v-dtype e4m3 --update-clip
block fp8 --scaling block
block-e4m3 fp8 --scaling block --dy-format e4m3
block-dwx fp8 --scaling block --block-dw-x blocks
EOF
}

# ---------------------------------------------------------------------------------------------------------------
# The test of the table maker: a study folder of fixed log.csv files, the table printed from it against the table
# computed by hand below; then malformed input, which must be refused naming the file.
write_run() {   # DIR EXIT MS PARALLEL VAL_AT_0 VAL_AT_50 [VAL_AT_100]: a run of 100 steps (50 without VAL_AT_100) as
                # train_fp8 writes its log.csv, validated at 0, 50, 100; every step takes MS ms but step 1, MS + 1000 ms
                # (its one-time set-up), 8192 tokens a step. EXIT -: no exit.txt; PARALLEL -: no parallel.txt
    local dir=$1 status=$2 parallel=$4
    mkdir -p "$dir"
    awk -v ms="$3" -v v0="$5" -v v50="$6" -v v100="${7:-}" -v last=$(( $# >= 7 ? 100 : 50 )) 'BEGIN {
        print "step,loss,val_loss,lr,grad_norm,ms,tokens_per_s,tflops,skipped,mfu_percent"
        printf "0,,%s,,,,,,,\n", v0
        for (step = 1; step <= last; step++) {
            t = step == 1 ? ms + 1000 : ms
            printf "%d,%.6f,%s,3.000000e-04,0.500000,%.3f,%.1f,100.000,0,10.00\n", step, step == 1 ? 5.5 : 1.7,
                   step == 50 ? v50 : step == 100 ? v100 : "", t, 8192 / (t / 1000)
        } }' > "$dir/log.csv"
    [[ $status == - ]] || echo "$status" > "$dir/exit.txt"
    [[ $parallel == - ]] || echo "$parallel" > "$dir/parallel.txt"
}
run_test() {
    TEST_TMP=$(mktemp -d)
    trap 'rm -rf "$TEST_TMP"' EXIT
    local s=$TEST_TMP/study checks=0
    mkdir -p "$s"
    printf 'bf16\tbf16\t\nfp8\tfp8\t\nm-fp32\tfp8\t--m-dtype fp32\nqk-norm\tfp8\t--qk-norm\nupdate-clip\tfp8\t--update-clip\n' > "$s/configs.tsv"
    echo "--steps 100" > "$s/setup.txt"
    # Training time at step s: the sum of the ms of steps 1..s = (s - 1) x MS + MS + 1000 ms: at MS = 400 21.0 s at
    # step 50 and 41.0 s at step 100; MS = 420: 22.0 s and 43.0 s; MS = 320: 17.0 s and 33.0 s.
    # tokens/s: a run's median over its steps is 8192 / MS: 20480.0 at 400, 19504.8 at 420, 25600.0 at 320.
    # The target: bf16's mean val loss at its evaluation nearest to 60 of its 100 steps, step 50: (1.60 + 1.58 + 1.53)
    # / 3 = 1.57. A difference of final losses: in % of bf16's mean, ± sqrt(s1^2 / n1 + s2^2 / n2) in the same unit.
    # bf16: finals 1.50, 1.52, 1.54: mean 1.52, std sqrt((0.02^2 + 0 + 0.02^2) / 2) = 0.02.
    #       bests 1.50, 1.52, 1.53 (seed 3 was lower at step 50): mean 1.516667,
    #       std sqrt((0.016667^2 + 0.003333^2 + 0.013333^2) / 2) = sqrt(4.6667e-4 / 2) = 0.015275
    #       tokens/s (20480.0 + 20480.0 + 19504.8) / 3 = 20154.93 = 20.2k
    #       time to 1.57: seed 1 crosses between step 50 (1.60, 21.0 s) and 100 (1.50, 41.0 s):
    #       21.0 + 20.0 x (1.60 - 1.57) / (1.60 - 1.50) = 27.0 s; seed 2 between 50 (1.58) and 100 (1.52): 21.0 + 20.0 x
    #       0.01 / 0.06 = 24.3333 s; seed 3 between 0 (5.5, 0 s) and 50 (1.53, 22.0 s): 22.0 x 3.93 / 3.97 = 21.7783 s.
    #       Mean 24.3706, std sqrt((2.6294^2 + 0.0372^2 + 2.5922^2) / 2) = 2.6110
    write_run "$s/bf16/seed-1" 0 400 1 5.5 1.60 1.50
    write_run "$s/bf16/seed-2" 0 400 1 5.5 1.58 1.52
    write_run "$s/bf16/seed-3" 0 420 1 5.5 1.53 1.54
    # fp8: finals 1.51, 1.53, 1.58: mean 1.54, std sqrt((0.03^2 + 0.01^2 + 0.04^2) / 2) = sqrt(0.0013) = 0.036056;
    #      bests 1.51, 1.50 (seed 2 at step 50), 1.58: mean 1.53, std sqrt((0.02^2 + 0.03^2 + 0.05^2) / 2) = 0.043589;
    #      vs bf16: 0.02 / 1.52 = +1.3158%, ± sqrt(0.02^2 / 3 + 0.036056^2 / 3) = 0.023805 / 1.52 = 1.5661%, t 0.8402;
    #      tokens/s 25600 / 20154.93 = 1.27x
    #      time to 1.57: seed 1 between step 50 (1.58, 17.0 s) and 100 (1.51, 33.0 s): 17.0 + 16.0 x 0.01 / 0.07 =
    #      19.2857 s; seed 2 between step 0 (5.5, 0 s) and 50 (1.50, 17.0 s): 17.0 x 3.93 / 4.00 = 16.7025 s; seed 10
    #      never (1.60, 1.58). Mean 17.9941, std (19.2857 - 16.7025) / sqrt(2) = 1.8266; vs bf16 17.9941 / 24.3706 = 0.74x
    write_run "$s/fp8/seed-1" 0 320 1 5.5 1.58 1.51
    write_run "$s/fp8/seed-2" 0 320 1 5.5 1.50 1.53
    write_run "$s/fp8/seed-10" 0 320 1 5.5 1.60 1.58
    # m-fp32: finals = bests 1.54, 1.55 (seed 3 exits 0 but stops at step 50 without a validation loss there):
    #         mean 1.545, std sqrt(2 * 0.005^2) = 0.0070711; vs bf16: 0.025 / 1.52 = +1.6447%, ± sqrt(0.02^2 / 3 +
    #         0.0070711^2 / 2) = 0.012583 / 1.52 = 0.8278%, t 1.9868; fp8 vs m-fp32: -0.005 / 1.545 = -0.3236%, ±
    #         sqrt(0.036056^2 / 3 + 0.0070711^2 / 2) = 0.021409 / 1.545 = 1.3857%, t -0.2335; time to 1.57 (seeds 1, 2:
    #         1.60 at 50, then 1.54 and 1.55 at 100): 17.0 + 16.0 x 0.03 / 0.06 = 25.0 s, 17.0 + 16.0 x 0.03 / 0.05 = 26.6 s:
    #         mean 25.8, std 1.6 / sqrt(2) = 1.1314; 25.8 / 24.3706 = 1.06x. Its runs shared the GPU 4 at a time.
    write_run "$s/m-fp32/seed-1" 0 320 4 5.5 1.60 1.54
    write_run "$s/m-fp32/seed-2" 0 320 4 5.5 1.60 1.55
    write_run "$s/m-fp32/seed-3" 0 320 4 5.5 ""
    # qk-norm: one run counts (1.60: vs bf16 +0.08 / 1.52 = +5.2632%, no std of its own; never at 1.57; no
    #          parallel.txt), one failed (exit 1, its log stops at step 50), one never finished (no exit.txt)
    write_run "$s/qk-norm/seed-1" 0 320 - 5.5 1.70 1.60
    write_run "$s/qk-norm/seed-2" 1 320 - 5.5 1.70
    write_run "$s/qk-norm/seed-3" - 320 - 5.5 1.70
    # paired by seed, in % of the twin's final: fp8 seed 1 (1.51 - 1.50) / 1.50 = +0.67%, seed 2 0.01 / 1.52 = +0.66%
    # (seed 10 has no twin); m-fp32 seed 1 0.04 / 1.50 = +2.67% and 0.03 / 1.51 = +1.99%, seed 2 0.03 / 1.52 = +1.97%
    # and 0.02 / 1.53 = +1.31%; qk-norm seed 1 0.10 / 1.50 = +6.67% and 0.09 / 1.51 = +5.96%
    # update-clip: its only run crashed
    write_run "$s/update-clip/seed-1" 139 320 1 5.5 1.70
    local expected actual
    expected=$(cat <<EOF
Setup of every run: \`--steps 100\`

| configuration | build | flags | n | final val loss | best val loss | final vs BF16 build | tokens/s | time to target (s) | vs BF16 time |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| bf16 | BF16 |  | 3 | 1.5200 ± 0.0200 | 1.5167 ± 0.0153 | (baseline) | 20.2k | 24.4 ± 2.6 | (baseline) |
| fp8 | FP8 |  | 3 | 1.5400 ± 0.0361 | 1.5300 ± 0.0436 | +1.32% ± 1.57% (t +0.84) | 25.6k (1.27x) | 18.0 ± 1.8 (2 of 3 reached) | 0.74x |
| m-fp32 | FP8 | \`--m-dtype fp32\` | 2 + 1 not counted | 1.5450 ± 0.0071 | 1.5450 ± 0.0071 | +1.64% ± 0.83% (t +1.99) | 25.6k (1.27x) | 25.8 ± 1.1 | 1.06x |
| qk-norm | FP8 | \`--qk-norm\` | 1 + 2 not counted | 1.6000 | 1.6000 | +5.26% (no standard error: fewer than 2 runs) | 25.6k (1.27x) | not reached (0 of 1) | - |
| update-clip | FP8 | \`--update-clip\` | 0 + 1 not counted | - | - | - | - | - | - |

mean ± sample std (n - 1) over the seeds that count; vs BF16 build: the difference of the final validation loss's mean, in % of the BF16 build's mean, ± its standard error (Welch: sqrt(s1^2/n1 + s2^2/n2)) and t = difference / standard error; |t| < 2 is no difference found.
tokens/s: the median over a run's steps, mean over its seeds (in brackets: its ratio to the BF16 build's).
Time to target: the training time at which a run's validation loss first reaches 1.5700, the BF16 build's mean validation loss at its evaluation nearest to 60% of its run (step 50), a loss both builds reach well before their end. The training time at step s is the sum of log.csv's ms over steps 1 to s: each step's micro-batches and update on the host clock, evaluation, sampling and checkpoints excluded. The crossing is at the first evaluation at or below the target, interpolated linearly in the validation loss between it and the evaluation before it (step 0 at time 0); a run that never reaches it is left out of the mean (k of n reached). vs BF16 time: the ratio of the mean times (0.80x: 20% sooner).
Every counted run ends at step 100.
GPU sharing of the counted runs (study.sh --parallel; each run's parallel.txt): alone on the GPU: 6 (bf16, fp8); 4 at a time: 2 (m-fp32); not recorded (no parallel.txt): 1 (qk-norm).
WARNING: a run that shared the GPU waited for the other runs' turns on it: its times are inflated, and its tokens/s lowered, and they compare only with runs that shared it alike. Time with --parallel 1 (as --preset 1b does).

Runs not counted:
- m-fp32 seed 3: exit 0 but no validation loss at its last step (50) ($s/m-fp32/seed-3)
- qk-norm seed 2: exit 1 ($s/qk-norm/seed-2)
- qk-norm seed 3: not finished (no exit.txt: never ran to its end) ($s/qk-norm/seed-3)
- update-clip seed 1: exit 139 ($s/update-clip/seed-1)

Final val loss against the run of the same seed (the same initial weights and data order), in % of its:
- fp8: seed 1 +0.67% vs bf16; seed 2 +0.66% vs bf16
- m-fp32: seed 1 +2.67% vs bf16, +1.99% vs fp8; seed 2 +1.97% vs bf16, +1.31% vs fp8
- qk-norm: seed 1 +6.67% vs bf16, +5.96% vs fp8

Targets (the FP8 recipe's claims):
- FP8 recipe (fp8) vs BF16 build (bf16), final val loss: +1.32% ± 1.57% (t +0.84), within 0.5%: NO, |t| < 2 (no difference found): yes
- FP8 first moment (fp8) vs --m-dtype fp32 (m-fp32), final val loss: -0.32% ± 1.39% (t -0.23), within 0.5%: yes
- FP8 recipe (fp8) reaches the target (bf16's loss at 60% of its run) sooner in training time: 26% (0.74x), 2 of 3 fp8 runs reached it (every run, sooner: NO)
EOF
)
    actual=$(python3 scripts/plot_loss.py table "$s")
    if [[ $actual != "$expected" ]]; then
        echo "study table test FAILED: the table differs from the one computed by hand (< expected, > printed):"
        diff <(echo "$expected") <(echo "$actual") || true
        exit 1
    fi
    checks=$((checks + 1))
    # the targets met: bf16 as above (final 1.52 ± 0.02, time to 1.57 24.3706 s); fp8 finals 1.51, 1.516 -> mean
    # 1.513, std 0.0042426: -0.007 / 1.52 = -0.46% of bf16 (within 0.5%), ± sqrt(0.02^2 / 3 + 0.0042426^2 / 2) =
    # 0.011930 / 1.52 = 0.7849%, t -0.5867; m-fp32 (unchanged, 1.545): fp8 is -0.032 / 1.545 = -2.07% of it (not
    # within 0.5%), ± sqrt(0.0042426^2 / 2 + 0.0070711^2 / 2) = 0.0058310 / 1.545 = 0.3774%, t -5.4879. Time to 1.57:
    # seed 1 17.0 + 16.0 x 0.03 / 0.09 = 22.3333 s, seed 2 (1.56 at step 50) 17.0 x 3.93 / 3.94 = 16.9569 s; mean
    # 19.6451 / 24.3706 = 0.8061: 19% sooner, both reached
    rm -rf "$s/fp8" "$s/qk-norm" "$s/update-clip"
    write_run "$s/fp8/seed-1" 0 320 1 5.5 1.60 1.51
    write_run "$s/fp8/seed-2" 0 320 1 5.5 1.56 1.516
    expected="- FP8 recipe (fp8) vs BF16 build (bf16), final val loss: -0.46% ± 0.78% (t -0.59), within 0.5%: yes, |t| < 2 (no difference found): yes
- FP8 first moment (fp8) vs --m-dtype fp32 (m-fp32), final val loss: -2.07% ± 0.38% (t -5.49), within 0.5%: NO
- FP8 recipe (fp8) reaches the target (bf16's loss at 60% of its run) sooner in training time: 19% (0.81x), 2 of 2 fp8 runs reached it (every run, sooner: yes)"
    actual=$(python3 scripts/plot_loss.py table "$s" | grep '^- FP8')
    [[ $actual == "$expected" ]] || { echo "study table test FAILED: targets"; diff <(echo "$expected") <(echo "$actual") || true; exit 1; }
    checks=$((checks + 1))
    # a log.csv without the row of step 30: its run counts for the losses, not for the time (fp8's time is seed 1's
    # alone, 22.3333 / 24.3706 = 0.9164: 8% sooner); with no run sharing the GPU any more, the line that says so
    sed -i '/^30,/d' "$s/fp8/seed-2/log.csv"
    rm -rf "$s/m-fp32"
    expected="GPU sharing: every counted run had the GPU to itself (one run at a time).
- fp8 seed 2: log.csv's training rows are not steps 1 to 100 once each (no row for step 30): the training time needs every step's ms ($s/fp8/seed-2)
- FP8 recipe (fp8) reaches the target (bf16's loss at 60% of its run) sooner in training time: 8% (0.92x), 1 of 1 fp8 runs reached it (every run, sooner: yes)"
    actual=$(python3 scripts/plot_loss.py table "$s" | grep -e '^- fp8 seed' -e '^GPU sharing' -e 'sooner in training time')
    [[ $actual == "$expected" ]] || { echo "study table test FAILED: a run without a training time"; diff <(echo "$expected") <(echo "$actual") || true; exit 1; }
    checks=$((checks + 1))
    # malformed input: refused, naming the file
    local out
    expect_refusal() {   # WHAT EXPECTED_TEXT: the table of $s must fail with a message holding EXPECTED_TEXT
        if out=$(python3 scripts/plot_loss.py table "$s" 2>&1); then
            echo "study table test FAILED: $1 was accepted"; exit 1
        fi
        [[ $out == *"$2"* ]] || { echo "study table test FAILED: $1: the message '$out' does not hold '$2'"; exit 1; }
        checks=$((checks + 1))
    }
    sed -i '1s/.*/step,val_loss,loss/' "$s/fp8/seed-1/log.csv"
    expect_refusal "a log.csv with other columns" "$s/fp8/seed-1/log.csv: its columns are 'step,val_loss,loss'"
    write_run "$s/fp8/seed-1" 0 320 1 5.5 1.60 1.51
    echo "101,1.5,x1.4,,,,,,," >> "$s/fp8/seed-1/log.csv"
    expect_refusal "a log.csv row that is not numbers" "$s/fp8/seed-1/log.csv, line 103: step, loss, val_loss, ms and tokens_per_s must be numbers"
    write_run "$s/fp8/seed-1" 0 320 1 5.5 1.60 1.51
    sed -i '40s/,320\.000,/,,/' "$s/fp8/seed-1/log.csv"
    expect_refusal "a log.csv row without its ms" "$s/fp8/seed-1/log.csv, line 40: step, loss, val_loss, ms and tokens_per_s must be numbers"
    write_run "$s/fp8/seed-1" 0 320 1 5.5 1.60 1.51
    echo 0 > "$s/fp8/seed-1/parallel.txt"
    expect_refusal "a parallel.txt that is not a count" "$s/fp8/seed-1/parallel.txt: expected the number of runs at a time"
    printf 'fp8 fp8 --qk-norm\n' > "$s/configs.tsv"
    expect_refusal "a configs.tsv line without tabs" "$s/configs.tsv, line 1: expected NAME<tab>fp8|bf16<tab>FLAGS"
    rm "$s/configs.tsv"
    expect_refusal "a folder without configs.tsv" "$s/configs.tsv is missing"
    echo "study table test: passed ($checks checks)"
}

if [[ ${1:-} == test ]]; then
    [[ $# -eq 1 ]] || fail "usage: scripts/study.sh test"
    run_test
    exit 0
fi
if [[ ${1:-} == table ]]; then
    [[ $# -eq 2 ]] || fail "usage: scripts/study.sh table DIR"
    exec python3 scripts/plot_loss.py table "$2"
fi

# ---------------------------------------------------------------------------------------------------------------
# The command line
PRESET=default SEEDS=3 PARALLEL="" STEPS=240 DIR="" DEADLINE=0 SKIP_DONE=0 KEEP_CKPT=0 DRY_RUN=0 LIST=0
FP8_BIN=./train_fp8 BF16_BIN=./train_fp8_bf16
ONLY=() SKIP=() ADDED=() EXTRA=()
positive() { [[ $2 =~ ^[0-9]+$ && $2 -ge 1 ]] || fail "$1 $2: must be a whole number >= 1"; }
OPTIONS=$(usage | sed -n 's/^  \(--[a-z0-9-]*\).*/\1/p' | tr '\n' ' ')
while [[ $# -gt 0 ]]; do
    flag=$1
    case $flag in
        --help|-h) usage; exit 0 ;;
        --skip-done) SKIP_DONE=1; shift; continue ;;
        --keep-checkpoints) KEEP_CKPT=1; shift; continue ;;
        --dry-run) DRY_RUN=1; shift; continue ;;
        --list) LIST=1; shift; continue ;;
        --preset|--seeds|--parallel|--steps|--deadline|--only|--skip|--add|--extra|--dir|--fp8-bin|--bf16-bin)
            [[ $# -ge 2 ]] || fail "$flag needs a value (scripts/study.sh --help)" ;;
        *) fail "unknown option $flag; the options are: ${OPTIONS% } (scripts/study.sh --help says what each does)" ;;
    esac
    value=$2
    case $flag in
        --preset) [[ $value == default || $value == 1b ]] || fail "--preset $value: the presets are default and 1b"
                  PRESET=$value ;;
        --seeds) positive "$flag" "$value"; SEEDS=$value ;;
        --parallel) positive "$flag" "$value"; PARALLEL=$value ;;
        --steps) positive "$flag" "$value"; STEPS=$value ;;
        --deadline) [[ $value =~ ^[0-9]+$ ]] || fail "--deadline $value: seconds, a whole number (0 = none)"; DEADLINE=$value ;;
        --only) IFS=, read -r -a names <<< "$value"; ONLY+=("${names[@]}") ;;
        --skip) IFS=, read -r -a names <<< "$value"; SKIP+=("${names[@]}") ;;
        --add) [[ $value =~ ^([A-Za-z0-9._-]+)=(fp8|bf16):(.*)$ ]] ||
                   fail "--add '$value': expected NAME=fp8:FLAGS or NAME=bf16:FLAGS (NAME of letters, digits, '.', '_', '-')"
               ADDED+=("${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[3]}") ;;
        --extra) read -r -a words <<< "$value"; EXTRA+=("${words[@]}") ;;
        --dir) DIR=$value ;;
        --fp8-bin) FP8_BIN=$value ;;
        --bf16-bin) BF16_BIN=$value ;;
    esac
    shift 2
done

# ---- the preset's setup (the header says why). The estimate: model TFLOP/s over all runs together, per build, and
# the seconds each run spends on the host (start-up, data, its end-of-run checkpoint), hidden by the other runs but
# for 1/PARALLEL of it.
if [[ $PRESET == default ]]; then
    # The FP8 build trains the d12 model at about 400 model TFLOP/s alone on an H200 (README, "Results"); a model of a
    # third of its FLOPs has smaller GEMMs and relatively more non-GEMM work, and turns between processes cost a
    # little, so the estimate assumes half that, for both builds together.
    MODEL=d12 DIM=512 LAYERS=8 HEADS=8 KV_HEADS=8 FFN=1536 BATCH=32 SEQ=512
    PRESET_FLAGS=() EVALS_PER_RUN=6 EVAL_BATCHES=all
    ASSUMED_TFLOPS_FP8=200 ASSUMED_TFLOPS_BF16=200 HOST_SECONDS_PER_RUN=5
    PARALLEL=${PARALLEL:-8} DIR=${DIR:-out/study}
else
    # An H100 alone trains this shape at 92.1k (FP8) and 75.1k (BF16) tokens/s (README, "Results"; 178 and 218 ms a
    # step, with TinyLlama's 32000-token vocabulary: bytes make a step a little shorter). A run's host time: ~10 s of
    # start-up, and ~10 s for its checkpoint (12 or 7 bytes a parameter in the BF16 or FP8 build, written, flushed to
    # the disk and read back for its checksum).
    MODEL=1b DIM=2048 LAYERS=22 HEADS=32 KV_HEADS=4 FFN=5632 BATCH=8 SEQ=2048
    PRESET_FLAGS=(--lr 3e-4) EVALS_PER_RUN=24 EVAL_BATCHES=4
    ASSUMED_TFLOPS_FP8=638 ASSUMED_TFLOPS_BF16=520 HOST_SECONDS_PER_RUN=20
    PARALLEL=${PARALLEL:-1} DIR=${DIR:-out/study-1b}
fi
MODEL_FLAGS=(--model "$MODEL" --dim "$DIM" --layers "$LAYERS" --heads "$HEADS" --kv-heads "$KV_HEADS" --ffn "$FFN")
WARMUP=$((STEPS / 10))
EVAL_EVERY=$(( STEPS / EVALS_PER_RUN > 0 ? STEPS / EVALS_PER_RUN : 1 ))

# ---- the configurations chosen
declare -A CONFIG_BUILD=() CONFIG_FLAGS=()
ALL_NAMES=()
while read -r name build flags; do
    [[ -n $name ]] || continue
    [[ -z ${CONFIG_BUILD[$name]+x} ]] || fail "--add $name: a configuration of that name exists already (--list)"
    ALL_NAMES+=("$name")
    CONFIG_BUILD[$name]=$build
    CONFIG_FLAGS[$name]=$flags
done < <(preset_configs; for a in "${ADDED[@]+"${ADDED[@]}"}"; do echo "$a"; done)
if [[ $LIST == 1 ]]; then
    for name in "${ALL_NAMES[@]}"; do printf '%-20s %-5s %s\n' "$name" "${CONFIG_BUILD[$name]}" "${CONFIG_FLAGS[$name]}"; done
    exit 0
fi
for name in "${ONLY[@]+"${ONLY[@]}"}" "${SKIP[@]+"${SKIP[@]}"}"; do
    [[ -n ${CONFIG_BUILD[$name]+x} ]] || fail "no configuration named '$name' in --preset $PRESET (scripts/study.sh --preset $PRESET --list shows them)"
done
NAMES=()
for name in "${ALL_NAMES[@]}"; do
    if [[ ${#ONLY[@]} -gt 0 && " ${ONLY[*]} " != *" $name "* ]]; then continue; fi
    if [[ " ${SKIP[*]+"${SKIP[*]}"} " == *" $name "* ]]; then continue; fi
    NAMES+=("$name")
done
[[ ${#NAMES[@]} -gt 0 ]] || fail "--only/--skip leave no configuration"

# ---- check everything before any GPU work: binaries and their builds, the data, every run's flags
binary_of() { [[ ${CONFIG_BUILD[$1]} == fp8 ]] && echo "$FP8_BIN" || echo "$BF16_BIN"; }
for build in fp8 bf16; do
    bin=$FP8_BIN make_target=train_fp8 want=e4m3
    [[ $build == bf16 ]] && bin=$BF16_BIN make_target=train_fp8_bf16 want=fp32
    needed=0
    for name in "${NAMES[@]}"; do [[ ${CONFIG_BUILD[$name]} == "$build" ]] && needed=1; done
    [[ $needed == 1 ]] || continue
    [[ -x $bin ]] || fail "$bin (the ${build^^} build) is missing: build it with 'make $make_target' (or make study), or name it with --$build-bin"
    help=$("$bin" --help) || fail "$bin --help failed (see above)"
    # the build shows in the default first moment: e4m3 in the FP8 build, fp32 in the BF16 build
    m_default=$(sed -n 's/^  --m-dtype TYPE .*\[\([a-z0-9]*\)\]$/\1/p' <<< "$help")
    [[ $m_default == "$want" ]] || fail "$bin is not the ${build^^} build: its --help gives --m-dtype's default as '$m_default'," \
                                        "the ${build^^} build's is $want (rebuild it: make $make_target)"
done
for f in "$TRAIN_DATA" "$VAL_DATA"; do [[ -f $f ]] || fail "$f is missing: prepare the default corpus with make data"; done
tokens_of() { echo $(( ($(stat -c %s "$1") - 1024) / 2 )); }   # llm.c shard: 256 x int32 header, uint16 tokens
batches_of() { echo $(( ($(tokens_of "$1") - 1) / SEQ / BATCH )); }   # windows of T+1 tokens with stride T, B a batch
EPOCH_BATCHES=$(batches_of "$TRAIN_DATA")
VAL_BATCHES=$(batches_of "$VAL_DATA")
[[ $VAL_BATCHES -ge 1 ]] || fail "$VAL_DATA holds less than one batch of $BATCH x $SEQ tokens"
[[ $EVAL_BATCHES != all && $EVAL_BATCHES -le $VAL_BATCHES ]] || EVAL_BATCHES=$VAL_BATCHES
COMMON=("${MODEL_FLAGS[@]}" --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --warmup "$WARMUP" --data "$TRAIN_DATA"
        --val-data "$VAL_DATA" --eval-every "$EVAL_EVERY" --eval-batches "$EVAL_BATCHES" --sample-every 0
        --checkpoint-every 0 --keep-checkpoints 1 --tp 0 "${PRESET_FLAGS[@]+"${PRESET_FLAGS[@]}"}")
# every configuration's command line through its binary's own checks (train_fp8 --dry-run: the flags, their values
# and how they go together, the data), so that a bad flag or value stops the study here and not in its runs
bad=()
for name in "${NAMES[@]}"; do
    read -r -a flags <<< "${CONFIG_FLAGS[$name]}"
    refusal=$("$(binary_of "$name")" "${COMMON[@]}" "${flags[@]+"${flags[@]}"}" "${EXTRA[@]+"${EXTRA[@]}"}" --seed 1 \
              --dry-run 2>&1 > /dev/null) || bad+=("$name: $(binary_of "$name") refuses its flags: ${refusal#error: }")
done
if [[ ${#bad[@]} -gt 0 ]]; then
    printf 'error: %s\n' "${bad[@]}" >&2
    fail "the runs above would fail at their start: mend --extra/--add, or leave those configurations out (--skip)"
fi

# ---- the study folder: configs.tsv (one line a configuration) and setup.txt (the flags of every run)
SETUP="${COMMON[*]} ${EXTRA[*]+"${EXTRA[*]}"}"
SETUP=${SETUP% }
if [[ -f $DIR/setup.txt && $(cat "$DIR/setup.txt") != "$SETUP" ]]; then
    fail "$DIR holds a study of another setup ($DIR/setup.txt: '$(cat "$DIR/setup.txt")', this one: '$SETUP'): use another --dir, or remove $DIR"
fi
for name in "${NAMES[@]}"; do
    line=$(printf '%s\t%s\t%s' "$name" "${CONFIG_BUILD[$name]}" "${CONFIG_FLAGS[$name]}")
    if [[ -f $DIR/configs.tsv ]] && grep -q "^$name	" "$DIR/configs.tsv" && ! grep -qxF "$line" "$DIR/configs.tsv"; then
        fail "$DIR holds runs of configuration $name with other flags ($(grep "^$name	" "$DIR/configs.tsv" | cut -f2,3)): use another --dir"
    fi
done

# ---- the runs: seed 1 of every configuration first, so that a study cut short has every configuration
QUEUE=()
for seed in $(seq 1 "$SEEDS"); do
    for name in "${NAMES[@]}"; do
        if [[ $SKIP_DONE == 1 && -f $DIR/$name/seed-$seed/exit.txt && $(cat "$DIR/$name/seed-$seed/exit.txt") == 0 ]]; then continue; fi
        QUEUE+=("$name/seed-$seed")
    done
done
TOTAL=${#QUEUE[@]}

# ---- the estimate: model FLOPs (6 x matmul parameters + 12 x L x D x T a token, as train_fp8 counts them); an
# evaluation batch is a forward pass, a third of a training step's FLOPs
HD=$((DIM / HEADS))
MATMUL_PARAMS=$(( LAYERS * ((HEADS + 2 * KV_HEADS) * HD * DIM + HEADS * HD * DIM + 3 * FFN * DIM) + 256 * DIM ))
FLOPS_PER_TOKEN=$(( 6 * MATMUL_PARAMS + 12 * LAYERS * DIM * SEQ ))
EVALS=$(( STEPS / EVAL_EVERY + 1 + (STEPS % EVAL_EVERY != 0) ))
RUN_TFLOP=$(awk -v steps="$STEPS" -v bt=$((BATCH * SEQ)) -v fpt="$FLOPS_PER_TOKEN" -v evals="$EVALS" -v eb="$EVAL_BATCHES" \
                'BEGIN { printf "%.0f", (steps * bt + evals * eb * bt / 3) * fpt / 1e12 }')
# one line a run to do (its configuration and build) -> the total, the GPU's part of it, and each configuration's
read -r EST_SECONDS EST_GPU EST_BY_CONFIG < <(
    for key in "${QUEUE[@]+"${QUEUE[@]}"}"; do echo "${key%/seed-*} ${CONFIG_BUILD[${key%/seed-*}]}"; done |
    awk -v tflop="$RUN_TFLOP" -v fp8="$ASSUMED_TFLOPS_FP8" -v bf16="$ASSUMED_TFLOPS_BF16" -v host="$HOST_SECONDS_PER_RUN" \
        -v p="$PARALLEL" '{ gpu = tflop / ($2 == "fp8" ? fp8 : bf16); total += gpu + host / p; all_gpu += gpu
                           if (!($1 in seconds)) names[++n] = $1
                           seconds[$1] += gpu + host / p }
                         END { printf "%.0f %.0f ", total, all_gpu
                               for (i = 1; i <= n; i++) printf "%s%s ~%.0f s", (i > 1 ? ", " : ""), names[i], seconds[names[i]]
                               print "" }')
echo "study: preset $PRESET, ${#NAMES[@]} configurations x $SEEDS seeds = $TOTAL runs to do, $PARALLEL at a time, into $DIR"
echo "setup: $MATMUL_PARAMS matmul parameters (${MODEL_FLAGS[*]}), $BATCH x $SEQ tokens a step, $STEPS steps" \
     "($(awk -v s="$STEPS" -v e="$EPOCH_BATCHES" 'BEGIN { printf "%.3f", s / e }') epoch of $TRAIN_DATA: $EPOCH_BATCHES batches)," \
     "validation every $EVAL_EVERY steps on $EVAL_BATCHES of the $VAL_BATCHES batches of $VAL_DATA"
[[ $STEPS -le $EPOCH_BATCHES ]] || echo "WARNING: $STEPS steps are more than one epoch ($EPOCH_BATCHES batches): training windows repeat," \
                                        "and the validation loss may reflect memorisation"
TFLOPS_TEXT="$ASSUMED_TFLOPS_FP8 (FP8) / $ASSUMED_TFLOPS_BF16 (BF16)"
[[ $ASSUMED_TFLOPS_FP8 != "$ASSUMED_TFLOPS_BF16" ]] || TFLOPS_TEXT=$ASSUMED_TFLOPS_FP8
echo "estimate: ~$EST_SECONDS s: $TOTAL runs of $RUN_TFLOP TFLOP at an assumed $TFLOPS_TEXT model TFLOP/s over all runs" \
     "together, ${EST_GPU} s, + $HOST_SECONDS_PER_RUN s of host work a run / $PARALLEL; the progress lines show the real pace"
# one run at a time: each configuration's part, for a study split into calls of --only
[[ $PARALLEL != 1 ]] || echo "estimate by configuration: ${EST_BY_CONFIG:-none}"
[[ $PARALLEL == 1 ]] || echo "note: $PARALLEL runs at a time share the GPU: the table's times and tokens/s hold the other runs' turns too"
[[ $DEADLINE == 0 ]] || echo "deadline: no run starts after $DEADLINE s; runs still going at $((DEADLINE + DEADLINE_GRACE)) s are stopped"
for name in "${NAMES[@]}"; do printf '  %-20s %-5s %s\n' "$name" "${CONFIG_BUILD[$name]}" "${CONFIG_FLAGS[$name]}"; done
echo "every run: BINARY ${COMMON[*]} [the configuration's flags]${EXTRA[*]+" ${EXTRA[*]}"} --seed S --out $DIR/NAME/seed-S"
if [[ $DRY_RUN == 1 ]]; then
    echo "dry run: nothing started"
    exit 0
fi

# the study folder's description, written durably (temporary name, then rename)
mkdir -p "$DIR"
echo "$SETUP" > "$DIR/setup.txt.tmp" && mv "$DIR/setup.txt.tmp" "$DIR/setup.txt"
# where and from what the runs came, for the table's caption (RESULTS_COMMIT, where set, names the commit of a copied tree)
{
    echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 | sed 's/, /, driver /')"
    echo "commit ${RESULTS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    date -u +%Y-%m-%d
} | paste -sd ';' | sed 's/;/; /g' > "$DIR/machine.txt"
{
    [[ -f $DIR/configs.tsv ]] && cat "$DIR/configs.tsv"
    for name in "${NAMES[@]}"; do
        line=$(printf '%s\t%s\t%s' "$name" "${CONFIG_BUILD[$name]}" "${CONFIG_FLAGS[$name]}")
        [[ -f $DIR/configs.tsv ]] && grep -qxF "$line" "$DIR/configs.tsv" || echo "$line"
    done
} > "$DIR/configs.tsv.tmp"
mv "$DIR/configs.tsv.tmp" "$DIR/configs.tsv"

# ---------------------------------------------------------------------------------------------------------------
# Run: at most PARALLEL at a time; a finished run gets DIR/NAME/seed-S/exit.txt, and a line here.
declare -A PID=() STARTED=() STOPPED_AT_DEADLINE=()
FAILED=() NOT_STARTED=()
DONE=0
T0=$SECONDS
elapsed() { echo $((SECONDS - T0)); }

start_run() {   # NAME/seed-S
    local key=$1 name=${1%/seed-*} seed=${1##*/seed-} dir=$DIR/$1 bin
    bin=$(binary_of "$name")
    rm -rf "$dir"
    mkdir -p "$dir"
    local flags args
    read -r -a flags <<< "${CONFIG_FLAGS[$name]}"
    args=("${COMMON[@]}" "${flags[@]+"${flags[@]}"}" "${EXTRA[@]+"${EXTRA[@]}"}" --seed "$seed" --out "$dir")
    printf '%q ' "$bin" "${args[@]}" > "$dir/cmd.txt"
    echo >> "$dir/cmd.txt"
    echo "$RUNS_AT_ONCE" > "$dir/parallel.txt"   # for the table: how many runs may have shared the GPU with this one
    "$bin" "${args[@]}" > "$dir/console.txt" 2>&1 &
    PID[$key]=$!
    STARTED[$key]=$SECONDS
    printf '[%3ds] start  %s\n' "$(elapsed)" "$key"
}

finish_run() {   # NAME/seed-S EXIT_STATUS
    local key=$1 status=$2 dir=$DIR/$1 result
    echo "$status" > "$dir/exit.txt"
    [[ $KEEP_CKPT == 1 ]] || rm -f "$dir"/ckpt-*.bin "$dir"/ckpt-*.bin.tmp "$dir/latest"
    DONE=$((DONE + 1))
    local took=$((SECONDS - ${STARTED[$key]}))
    if [[ $status == 0 ]]; then
        result=$(awk -F, 'NR > 1 && $3 != "" { final = $3; if (best == "" || $3 + 0 < best + 0) best = $3 }
                          NR > 1 { last_val = $3 } END { if (last_val == "") print "no final validation loss in log.csv"
                                                         else printf "final val %.4f, best %.4f", final, best }' \
                     "$dir/log.csv" 2>&1 || true)
        [[ $result == final* ]] || FAILED+=("$key: exit 0 but $result")
    elif [[ -n ${STOPPED_AT_DEADLINE[$key]+x} ]]; then
        result="STOPPED at the deadline (exit $status)"
        FAILED+=("$key: stopped at the deadline + $DEADLINE_GRACE s (exit $status)")
    else
        result="FAILED (exit $status): $(grep -v '^\s*$' "$dir/console.txt" 2>/dev/null | tail -n 1 | cut -c1-160 || true)"
        FAILED+=("$key: exit $status (see $dir/console.txt)")
    fi
    local left=$((TOTAL - DONE)) pace
    pace=$(awk -v e="$(elapsed)" -v d="$DONE" -v l="$left" 'BEGIN { printf "%.0f", e / d * l }')
    printf '[%3ds] %d/%d done  %-28s %s (%d s) | %d running, ~%d s left\n' "$(elapsed)" "$DONE" "$TOTAL" "$key" \
           "$result" "$took" "${#PID[@]}" "$pace"
}

RUNS_AT_ONCE=$(( PARALLEL < TOTAL ? PARALLEL : TOTAL ))
NEXT=0
LAST_BEAT=$SECONDS
STOPPED=0
while [[ $NEXT -lt $TOTAL || ${#PID[@]} -gt 0 ]]; do
    for key in "${!PID[@]}"; do
        if ! kill -0 "${PID[$key]}" 2>/dev/null; then
            wait "${PID[$key]}" && status=0 || status=$?
            unset "PID[$key]"
            finish_run "$key" "$status"
        fi
    done
    if [[ $DEADLINE -gt 0 && $(elapsed) -ge $DEADLINE && $NEXT -lt $TOTAL ]]; then
        NOT_STARTED=("${QUEUE[@]:NEXT}")
        printf '[%3ds] deadline (%d s): %d runs not started\n' "$(elapsed)" "$DEADLINE" "${#NOT_STARTED[@]}"
        TOTAL=$NEXT
    fi
    if [[ $DEADLINE -gt 0 && $(elapsed) -ge $((DEADLINE + DEADLINE_GRACE)) && $STOPPED == 0 && ${#PID[@]} -gt 0 ]]; then
        printf '[%3ds] deadline + %d s: stopping %s\n' "$(elapsed)" "$DEADLINE_GRACE" "${!PID[*]}"
        for key in "${!PID[@]}"; do
            kill -TERM "${PID[$key]}" 2>/dev/null || true
            STOPPED_AT_DEADLINE[$key]=1
        done
        STOPPED=1
    fi
    while [[ $NEXT -lt $TOTAL && ${#PID[@]} -lt $PARALLEL ]]; do
        start_run "${QUEUE[NEXT]}"
        NEXT=$((NEXT + 1))
    done
    if [[ $((SECONDS - LAST_BEAT)) -ge 30 && ${#PID[@]} -gt 0 ]]; then
        beat=""
        for key in "${!PID[@]}"; do beat+=" $key:$(tail -n 1 "$DIR/$key/log.csv" 2>/dev/null | cut -d, -f1 || true)"; done
        printf '[%3ds] running (step of %d):%s\n' "$(elapsed)" "$STEPS" "$beat"
        LAST_BEAT=$SECONDS
    fi
    [[ ${#PID[@]} -eq 0 ]] || sleep 1
done

# ---- the results
echo "study: $DONE runs finished in $(elapsed) s, ${#FAILED[@]} failed, ${#NOT_STARTED[@]} not started"
for f in "${FAILED[@]+"${FAILED[@]}"}"; do echo "  FAILED $f"; done
for f in "${NOT_STARTED[@]+"${NOT_STARTED[@]}"}"; do echo "  NOT STARTED $f (deadline)"; done
if python3 scripts/plot_loss.py table "$DIR" > "$DIR/table.md.tmp"; then
    mv "$DIR/table.md.tmp" "$DIR/table.md"
    echo
    cat "$DIR/table.md"
    echo "(the table: $DIR/table.md)"
else
    rm -f "$DIR/table.md.tmp"
    echo "error: the table of $DIR could not be made (above)"
    FAILED+=("the table")
fi
python3 scripts/plot_loss.py "$DIR/loss_bands.png" "$DIR" || echo "no picture (above); the table does not need one"
[[ ${#FAILED[@]} -eq 0 && ${#NOT_STARTED[@]} -eq 0 ]]
