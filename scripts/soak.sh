#!/usr/bin/env bash
# soak.sh: the kill-and-resume soak. Trains the same run twice: straight through into OUT/straight, and into
# OUT/killed killed with SIGKILL at K moments and resumed with --resume OUT/killed after each until it finishes.
# The moments come from the seed: odd kills land in the middle of a step (a few steps after the start, plus a
# random delay), even kills while a checkpoint is being written (as soon as a ckpt-*.bin.tmp appears, plus a
# random delay). A resumed run equals an uninterrupted one bit for bit on the same GPU model, so the two runs
# must end with the same final checkpoint, byte for byte, and the same log.csv once its timing columns are
# dropped. Prints PASS or FAIL, with what differed; exits 0 on PASS.
#   scripts/soak.sh [--steps N] [--kills K] [--seed S] [--out DIR] [--bin PROGRAM] [-- TRAIN_FLAGS...]
#       defaults: 120 steps, 5 kills, seed 1, OUT out/soak-DATE-TIME, PROGRAM ./train_fp8; the runs are the default
#       preset on data/kjv_*.bin (make data) with --checkpoint-every 10 --eval-every 40 --sample-every 0, and
#       TRAIN_FLAGS after those. On PASS the checkpoint files are removed (the logs stay); on FAIL everything stays.
#   scripts/soak.sh test   the soak's own parts on a stand-in trainer (a bash script, no GPU): an honest one must
#       PASS, one that loses a step on resume must FAIL.
# make soak runs it (SOAK_FLAGS adds flags).
set -euo pipefail
cd "$(dirname "$0")/.."   # the repository

TIMING_COLUMNS="ms tokens_per_s tflops mfu_percent"   # log.csv's columns that depend on the clock
CHECKPOINT_EVERY=10
ATTEMPT_TIMEOUT_S=600                                 # one run of the program, killed or not

say() { echo "soak: $*"; }
die() { echo "soak: error: $*" >&2; exit 2; }

# sleep_ms MS
sleep_ms() { sleep "$(printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)))"; }

# log_without_timing FILE: log.csv without the columns of TIMING_COLUMNS, found by name in its first line.
log_without_timing() {
    awk -F, -v drop="$TIMING_COLUMNS" '
        NR == 1 {
            n = split(drop, names, " ")
            for (i = 1; i <= NF; i++) for (j = 1; j <= n; j++) if ($i == names[j]) { skip[i] = 1; found++ }
            if (found != n) { print "log.csv has columns \"" $0 "\", not all of: " drop > "/dev/stderr"; exit 1 }
        }
        { line = ""; for (i = 1; i <= NF; i++) if (!skip[i]) line = line (line == "" ? "" : ",") $i; print line }' "$1"
}

# compare STRAIGHT KILLED: 0 if the final checkpoints are byte-identical and the logs equal without timing, else 1;
# prints what differed.
compare() {
    local a=$1 b=$2 ok=0
    local last_a last_b
    last_a=$(cat "$a/latest" 2>/dev/null || true)
    last_b=$(cat "$b/latest" 2>/dev/null || true)
    if [[ -z $last_a || -z $last_b || $last_a != "$last_b" ]]; then
        say "DIFFERS: the final checkpoints: $a/latest names '${last_a}', $b/latest names '${last_b}'"
        ok=1
    elif ! cmp_out=$(cmp "$a/$last_a" "$b/$last_b" 2>&1); then
        say "DIFFERS: the final checkpoint $last_a: $cmp_out (bytes 0-255: the header; after: weights, optimizer state, FP8 scales)"
        ok=1
    else
        say "same: the final checkpoint $last_a, byte for byte ($(stat -c %s "$a/$last_a") bytes)"
    fi
    local log_a log_b
    log_a=$(log_without_timing "$a/log.csv") || return 1
    log_b=$(log_without_timing "$b/log.csv") || return 1
    if [[ $log_a != "$log_b" ]]; then
        say "DIFFERS: log.csv without $TIMING_COLUMNS (< straight, > killed; first lines of the diff):"
        diff <(echo "$log_a") <(echo "$log_b") | head -20 || true
        ok=1
    else
        say "same: log.csv without its timing columns ($(echo "$log_a" | wc -l) lines)"
    fi
    return $ok
}

# The step a run folder resumes after: that of the checkpoint its `latest` names (0 without one).
resume_step() {
    local name
    name=$(cat "$1/latest" 2>/dev/null || true)
    [[ $name =~ ^ckpt-0*([0-9]+)\.bin$ ]] && echo "${BASH_REMATCH[1]:-0}" || echo 0
}

# kill_when PID MODE RUN_DIR STDOUT MARKER: waits for the moment of MODE, then kills PID with SIGKILL. MODE step: the
# run has printed a step 1 to 12 steps past where it started (past the first checkpoint, for a fresh run), then a
# delay of up to 40 ms; checkpoint: a ckpt-*.bin.tmp newer than MARKER exists, then a delay of up to 150 ms. Sets
# KILLED_AT to what it did; returns 1 if the program ended first. (No subshell: RANDOM stays one seeded sequence.)
kill_when() {
    local pid=$1 mode=$2 dir=$3 out=$4 marker=$5 target delay waited=0 from
    from=$(resume_step "$dir")
    target=$((from + 1 + RANDOM % 12))
    ((from > 0)) || target=$((target + CHECKPOINT_EVERY))
    while kill -0 "$pid" 2> /dev/null; do
        if [[ $mode == step ]] && grep -Eq "^step +$target/" "$out"; then
            delay=$((RANDOM % 41))
            sleep_ms "$delay"
            kill -KILL "$pid" 2> /dev/null || return 1
            KILLED_AT="mid-step: ${delay} ms after step $target"
            return 0
        fi
        local tmp
        tmp=$(find "$dir" -maxdepth 1 -name 'ckpt-*.bin.tmp' -newer "$marker" -printf '%f' -quit 2> /dev/null)
        if [[ $mode == checkpoint && -n $tmp ]]; then
            delay=$((RANDOM % 151))
            sleep_ms "$delay"
            kill -KILL "$pid" 2> /dev/null || return 1
            KILLED_AT="mid-checkpoint: ${delay} ms after $tmp appeared"
            [[ -e $dir/$tmp ]] || KILLED_AT="$KILLED_AT (its write had ended: just after the checkpoint)"
            return 0
        fi
        sleep_ms 5
        waited=$((waited + 5))
        ((waited < ATTEMPT_TIMEOUT_S * 1000)) || { kill -KILL "$pid"; die "no $mode moment in ${ATTEMPT_TIMEOUT_S} s (see $out)"; }
    done
    return 1
}

# soak PROGRAM OUT STEPS KILLS SEED TRAIN_FLAGS...: the two runs and the comparison; 0 on PASS.
soak() {
    local bin=$1 out=$2 steps=$3 kills=$4 seed=$5
    shift 5
    local flags=(--steps "$steps" --checkpoint-every "$CHECKPOINT_EVERY" --eval-every 40 --sample-every 0 "$@")
    local straight=$out/straight killed=$out/killed
    mkdir -p "$out"
    RANDOM=$seed
    say "$bin ${flags[*]}"
    say "the straight run: $straight (stdout: $out/straight.txt)"
    local start=$SECONDS
    if ! timeout "$ATTEMPT_TIMEOUT_S" "$bin" "${flags[@]}" --out "$straight" > "$out/straight.txt" 2>&1; then
        tail -5 "$out/straight.txt" >&2
        die "the straight run failed (see $out/straight.txt)"
    fi
    say "  done in $((SECONDS - start)) s"
    local done_kills=0 attempt=0 rc
    while :; do
        attempt=$((attempt + 1))
        local stdout=$out/killed-$attempt.txt marker=$out/.attempt-start
        local where=(--out "$killed")
        [[ -f $killed/latest ]] && where=(--resume "$killed")
        touch "$marker"
        stdbuf -oL "$bin" "${flags[@]}" "${where[@]}" > "$stdout" 2>&1 &   # line-buffered: each step's line as it ends
        local pid=$! from
        from=$(resume_step "$killed")
        if ((done_kills < kills)); then
            local mode=step
            ((done_kills % 2 == 1)) && mode=checkpoint
            if kill_when "$pid" "$mode" "$killed" "$stdout" "$marker"; then
                wait "$pid" 2> /dev/null || true
                done_kills=$((done_kills + 1))
                say "kill $done_kills/$kills, run $attempt (from step $from, ${where[*]}): $KILLED_AT"
                continue
            fi
        fi
        rc=0
        wait "$pid" || rc=$?
        if ((rc != 0)); then
            tail -5 "$stdout" >&2
            die "run $attempt of the killed run (from step $from) exited with status $rc (see $stdout)"
        fi
        say "run $attempt (from step $from, ${where[*]}) finished"
        break
    done
    rm -f "$out/.attempt-start"
    ((done_kills == kills)) || say "note: only $done_kills of $kills kills landed before the run finished"
    local leftovers
    leftovers=$(find "$killed" -maxdepth 1 -name '*.tmp' -printf '%f ')
    [[ -z $leftovers ]] || say "note: temporary files left in $killed: $leftovers"
    if compare "$straight" "$killed"; then
        say "PASS: $done_kills kills ($attempt runs) gave the straight run's final checkpoint and log ($out)"
        rm -f "$straight"/ckpt-*.bin "$killed"/ckpt-*.bin "$killed"/ckpt-*.bin.tmp
        return 0
    fi
    say "FAIL: the killed and resumed run differs from the straight one (everything kept in $out)"
    return 1
}

# ---- scripts/soak.sh test: a stand-in for train_fp8, in bash. It takes --out DIR or --resume DIR, --steps and
# --checkpoint-every (other flags ignored); its state is one number that every step changes; it writes log.csv
# (train_fp8's columns, the timing ones random) and checkpoints the way train_fp8 does (a .tmp written slowly, then
# renamed; then `latest`; the newest two kept). SOAK_TEST_BUG=1 makes a resume lose one step.
stand_in_trainer() {
    cat << 'EOF'
#!/usr/bin/env bash
set -euo pipefail
out= resume= steps=0 every=0
while (($#)); do
    case $1 in
        --out) out=$2; shift 2 ;;
        --resume) resume=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --checkpoint-every) every=$2; shift 2 ;;
        *) shift ;;
    esac
done
[[ -n $resume ]] && out=$resume
mkdir -p "$out"
x=1 first=1
if [[ -n $resume ]]; then
    ckpt=$(cat "$out/latest")
    x=$(head -1 "$out/$ckpt")
    first=$((10#${ckpt:5:8} + 1))
    [[ ${SOAK_TEST_BUG:-0} == 1 ]] && first=$((first + 1))
    awk -F, -v s=$((first - 1)) 'NR == 1 || $1 <= s' "$out/log.csv" > "$out/log.csv.tmp" && mv "$out/log.csv.tmp" "$out/log.csv"
else
    echo "step,loss,val_loss,lr,grad_norm,ms,tokens_per_s,tflops,skipped,mfu_percent" > "$out/log.csv"
fi
for ((step = first; step <= steps; step++)); do
    sleep 0.01
    x=$(((x * 1103515245 + 12345 + step) % 2147483648))
    echo "step $(printf %5d $step)/$steps | loss $((x % 1000))"
    echo "$step,$((x % 1000)),,1e-3,0.5,$RANDOM,$RANDOM,$RANDOM,0,$RANDOM" >> "$out/log.csv"
    if ((step % every == 0 || step == steps)); then
        name=$(printf 'ckpt-%08d.bin' "$step")
        { echo "$x"; for i in 1 2 3 4 5; do seq 1 2000; sleep 0.02; done; } > "$out/$name.tmp"
        mv "$out/$name.tmp" "$out/$name"
        echo "$name" > "$out/latest.tmp" && mv "$out/latest.tmp" "$out/latest"
        ls "$out"/ckpt-*.bin | sort | head -n -2 | xargs -r rm -f
    fi
done
EOF
}

self_test() {
    local dir failures=0
    dir=$(mktemp -d /tmp/soak_test_XXXXXX)
    stand_in_trainer > "$dir/trainer"
    chmod +x "$dir/trainer"
    # the log comparison: timing columns dropped by name, any other difference seen
    printf 'step,loss,ms,tokens_per_s,tflops,mfu_percent\n1,5.0,21.0,1e5,300,40\n' > "$dir/a.csv"
    printf 'step,loss,ms,tokens_per_s,tflops,mfu_percent\n1,5.0,22.5,9e4,280,38\n' > "$dir/b.csv"
    printf 'step,loss,ms,tokens_per_s,tflops,mfu_percent\n1,5.1,21.0,1e5,300,40\n' > "$dir/c.csv"
    [[ $(log_without_timing "$dir/a.csv") == "$(log_without_timing "$dir/b.csv")" ]] || { echo "FAIL: timing columns not dropped"; failures=$((failures + 1)); }
    [[ $(log_without_timing "$dir/a.csv") != "$(log_without_timing "$dir/c.csv")" ]] || { echo "FAIL: a loss difference not seen"; failures=$((failures + 1)); }
    printf 'step,loss\n1,5.0\n' > "$dir/d.csv"
    ! log_without_timing "$dir/d.csv" > /dev/null 2>&1 || { echo "FAIL: missing timing columns not reported"; failures=$((failures + 1)); }
    # whole soaks on the stand-in: honest, then with a resume that loses a step
    local bug expect
    for bug in 0 1; do
        expect=PASS
        ((bug == 0)) || expect=FAIL
        echo "---- the stand-in trainer$( ((bug == 0)) || echo ', losing a step on resume'): want $expect"
        local got=PASS
        SOAK_TEST_BUG=$bug soak "$dir/trainer" "$dir/soak$bug" 60 5 7 || got=FAIL
        if [[ $got != "$expect" ]]; then
            echo "FAIL: the soak gave $got, want $expect"
            failures=$((failures + 1))
        fi
    done
    rm -rf "$dir"
    if ((failures == 0)); then echo "soak.sh test: all passed"; else echo "soak.sh test: $failures failed"; fi
    return $((failures > 0))
}

if [[ ${1:-} == test ]]; then
    self_test
    exit $?
fi

steps=120 kills=5 seed=1 out=out/soak-$(date +%Y%m%d-%H%M%S) bin=./train_fp8
while (($#)); do
    case $1 in
        --steps) steps=${2:?--steps needs a number}; shift 2 ;;
        --kills) kills=${2:?--kills needs a number}; shift 2 ;;
        --seed) seed=${2:?--seed needs a number}; shift 2 ;;
        --out) out=${2:?--out needs a folder}; shift 2 ;;
        --bin) bin=${2:?--bin needs a program}; shift 2 ;;
        --) shift; break ;;
        -h | --help) sed -n '2,/^set -euo/p' scripts/soak.sh | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
for n in "$steps" "$kills" "$seed"; do [[ $n =~ ^[0-9]+$ ]] || die "--steps, --kills and --seed take whole numbers, not '$n'"; done
((steps >= 20)) || die "--steps $steps: at least 20 (checkpoints every 10 steps, and kills between them)"
[[ -x $bin ]] || die "$bin is missing: build it first (make train_fp8)"
[[ ! -e $out ]] || die "$out exists: remove it, or choose another --out"
for f in data/kjv_train.bin data/kjv_val.bin; do [[ -f $f ]] || die "$f is missing: prepare the default corpus with make data"; done
soak "$bin" "$out" "$steps" "$kills" "$seed" "$@"
