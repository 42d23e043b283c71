#!/usr/bin/env bash
# mutate.sh: mutation testing. Each mutant of mutants.txt is a one-line bug a real change could make (a wrong
# sign, a swapped FP8 format, a missing term of a backward, an off-by-one in a mask, a schedule or the data
# loader). For each mutant and each build it applies to, the tree is copied to scratch-mutants/ID.BUILD, the
# mutant applied there, test_fp8 and train_fp8 built, and the tests run; the mutant is caught when a test fails
# (or the run crashes or hangs). A mutant the tests let through shows a hole in them.
#
#   scripts/mutate.sh [options]            (make mutants MUTATE_FLAGS="...")
#     --only ID,...      only these mutants (--list shows the ids)
#     --build B          fp8, bf16 or both (default): the builds to test, of those each mutant names
#     --needs N          host or gpu: only the mutants marked so (default: all)
#     --jobs N           mutant builds at once (each make -j2; default: cores / 2)
#     --parallel P       test runs at once, all on GPU 0 (default 4; they are correctness runs, not timings)
#     --host-only        run only the host tests (a machine without a GPU): mutants marked "needs: gpu" that
#                        the host tests do not catch are reported "not run"; so are they wherever no GPU is found
#     --all-failures     run the whole suite and list every failing test (default: stop at the first failure)
#     --compile-only     build each mutant, run nothing (checks that every mutant still compiles)
#     --baseline         also build and test the unmutated tree in each build: it must pass, else every catch
#                        is suspect (a test that fails anyway, or fails only when test runs share the GPU)
#     --timeout S        seconds for one test run before it counts as a hang (default 900)
#     --keep             keep the scratch trees (default: only their logs, scratch-mutants/logs/)
#     --list             the mutants: id, builds, needs, file, expected tests, the bug
#     --mutants FILE     another list (default: mutants.txt)
#     --check            check that every mutant applies (its original text occurs exactly once), build nothing
#     --help
#   GPU_ARCH, NVCC and the other Makefile variables pass through the environment (GPU_ARCH=sm_89 scripts/mutate.sh).
#
# A run: the tests named by the mutant's "expect" first (./test_fp8 --fail-fast NAME...), which makes a caught
# mutant cost seconds; if they pass, the whole suite (--fail-fast). The table gives, for each mutant and build,
# caught (yes / NO / not run) and by which tests; a catch by other tests than the expected ones is marked, since
# the "expect" line is then out of date. The last line: "mutants: N caught, M survived" (mutant x build runs).
# Exit status 1 if any mutant survived, did not apply or did not compile (a mutant that does not compile is a
# defect of the list, not a catch), 2 for bad options or a bad list.
#
# Cost: every run builds both binaries (~100 s of one core per build), so a build-bound machine sets --jobs to
# half its cores; the test runs of caught mutants take seconds, a survivor a whole suite (a GPU: 1-2 minutes).
#
# Adding a mutant: append a block to mutants.txt (its header describes the fields):
#     id: rmsnorm_backward_no_mean_term
#     build: both
#     needs: gpu
#     file: llama2.cuh
#     expect: rmsnorm_forward_backward
#     what: RMSNorm's backward without the term of d(rstd)/dx
#     - const float rs = cur.r, coef = rs * rs * rs * dot / D;
#     + const float rs = cur.r, coef = 0.0f;
# The "- " text must occur exactly once in the file (take more of the line if it does not); scripts/mutate.sh --check
# says so, then scripts/mutate.sh --only ID shows that it is caught. The builds treat warnings as errors, so a change
# that leaves a variable unused does not compile: change the line that computes it instead (as above, coef = 0
# rather than dropping "- coef * xk"). A source change that touches a mutant's line makes it stale: --check (run by
# .ci/run) refuses it, and the mutant is rewritten against the new code.
set -uo pipefail
shopt -u patsub_replacement 2>/dev/null || true   # '&' in a replacement stays '&'

ROOT=$(cd "$(dirname "$0")/.." && pwd)   # the repository
LIST="$ROOT/mutants.txt"
SCRATCH="$ROOT/scratch-mutants"
SOURCES=" common.cuh fp8_kernels.cuh llama2.cuh attention.cuh adamw_fp8.cuh dataloader.h tokenizer.h checkpoint.h train_fp8.cu "

die() { echo "mutate.sh: $*" >&2; exit 2; }

ONLY="" BUILDS="both" NEEDS="" JOBS="" PARALLEL=4 HOST_ONLY=0 ALL_FAILURES=0 COMPILE_ONLY=0 BASELINE=0 TIMEOUT=900 KEEP=0 MODE=run
while [ $# -gt 0 ]; do
    case "$1" in
        --mutants) [ $# -ge 2 ] || die "--mutants needs a file"; LIST=$(realpath "$2"); shift ;;
        --only) [ $# -ge 2 ] || die "--only needs a list of ids (scripts/mutate.sh --list)"; ONLY=$2; shift ;;
        --build) [ $# -ge 2 ] || die "--build needs fp8, bf16 or both"; BUILDS=$2; shift ;;
        --needs) [ $# -ge 2 ] || die "--needs needs host or gpu"; NEEDS=$2; shift ;;
        --jobs|-j) [ $# -ge 2 ] || die "--jobs needs a number"; JOBS=$2; shift ;;
        --parallel|-P) [ $# -ge 2 ] || die "--parallel needs a number"; PARALLEL=$2; shift ;;
        --timeout) [ $# -ge 2 ] || die "--timeout needs seconds"; TIMEOUT=$2; shift ;;
        --host-only) HOST_ONLY=1 ;;
        --all-failures) ALL_FAILURES=1 ;;
        --compile-only) COMPILE_ONLY=1 ;;
        --baseline) BASELINE=1 ;;
        --keep) KEEP=1 ;;
        --list) MODE=list ;;
        --check) MODE=check ;;
        --help|-h) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (scripts/mutate.sh --help)" ;;
    esac
    shift
done
case "$BUILDS" in fp8|bf16|both) ;; *) die "--build $BUILDS: must be fp8, bf16 or both" ;; esac
case "$NEEDS" in ""|host|gpu) ;; *) die "--needs $NEEDS: must be host or gpu" ;; esac
if [ -z "$JOBS" ]; then JOBS=$(( $(nproc 2>/dev/null || echo 2) / 2 )); [ "$JOBS" -ge 1 ] || JOBS=1; fi
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "--jobs $JOBS: must be a positive number"
[[ "$PARALLEL" =~ ^[1-9][0-9]*$ ]] || die "--parallel $PARALLEL: must be a positive number"
[[ "$TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "--timeout $TIMEOUT: must be a positive number of seconds"
[ -f "$LIST" ] || die "$LIST not found"

# ---- the list: M_* arrays, one entry per mutant, in the list's order
M_ID=() M_BUILD=() M_NEEDS=() M_FILE=() M_EXPECT=() M_WHAT=() M_ORIG=() M_REPL=() M_LINE=()
problems=()
n=-1 open=0 lineno=0 orig_set=0 repl_set=0
# Checks the block just read (mutant n).
finish_block() {
    local where="$LIST:${M_LINE[$n]} (${M_ID[$n]:-no id})" f count k
    [[ "${M_ID[$n]}" =~ ^[A-Za-z0-9_]+$ ]] || problems+=("$where: id must be letters, digits and _")
    case "${M_BUILD[$n]}" in fp8|bf16|both) ;; *) problems+=("$where: build must be fp8, bf16 or both, not '${M_BUILD[$n]}'") ;; esac
    case "${M_NEEDS[$n]}" in host|gpu) ;; *) problems+=("$where: needs must be host or gpu, not '${M_NEEDS[$n]}'") ;; esac
    [ -n "${M_WHAT[$n]}" ] || problems+=("$where: no 'what:' line")
    [ "$orig_set" = 1 ] && [ "$repl_set" = 1 ] || problems+=("$where: needs one '- ORIGINAL' and one '+ REPLACEMENT' line")
    [ "${M_ORIG[$n]}" != "${M_REPL[$n]}" ] || problems+=("$where: the replacement is the original")
    for ((k = 0; k < n; k++)); do [ "${M_ID[$k]}" != "${M_ID[$n]}" ] || problems+=("$where: id used twice"); done
    f=${M_FILE[$n]}
    if [[ "$SOURCES" != *" $f "* ]] || [ ! -f "$ROOT/$f" ]; then
        problems+=("$where: file '$f' is not one of the sources:$SOURCES")
    elif [ -n "${M_ORIG[$n]}" ]; then
        # grep counts the occurrences (bash's own pattern match over a 500 KB file takes seconds a mutant)
        count=$(grep -oF -e "${M_ORIG[$n]}" "$ROOT/$f" | wc -l)
        if [ "$count" = 0 ]; then
            problems+=("$where: its original text is not in $f (stale: the code changed; rewrite the mutant against it)")
        elif [ "$count" -gt 1 ]; then
            problems+=("$where: its original text occurs more than once in $f (ambiguous: take more of the line)")
        fi
    fi
}
while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    [[ "$line" == "#"* ]] && continue
    if [ -z "$line" ]; then
        [ "$open" = 1 ] && finish_block
        open=0
        continue
    fi
    if [ "$open" = 0 ]; then
        open=1 orig_set=0 repl_set=0 n=$((n + 1))
        M_ID[$n]="" M_BUILD[$n]="" M_NEEDS[$n]="" M_FILE[$n]="" M_EXPECT[$n]="" M_WHAT[$n]="" M_ORIG[$n]="" M_REPL[$n]="" M_LINE[$n]=$lineno
    fi
    case "$line" in
        "id: "*) M_ID[$n]=${line#id: } ;;
        "build: "*) M_BUILD[$n]=${line#build: } ;;
        "needs: "*) M_NEEDS[$n]=${line#needs: } ;;
        "file: "*) M_FILE[$n]=${line#file: } ;;
        "expect: "*) M_EXPECT[$n]=${line#expect: } ;;
        "what: "*) M_WHAT[$n]=${line#what: } ;;
        "- "*) [ "$orig_set" = 0 ] || problems+=("$LIST:$lineno: a second '- ' line (one line per mutant)"); M_ORIG[$n]=${line:2}; orig_set=1 ;;
        "+ "*|"+") [ "$repl_set" = 0 ] || problems+=("$LIST:$lineno: a second '+ ' line (one line per mutant)"); M_REPL[$n]=${line:2}; repl_set=1 ;;
        *) problems+=("$LIST:$lineno: not a field of a mutant: '$line'") ;;
    esac
done < "$LIST"
[ "$open" = 1 ] && finish_block
if [ ${#problems[@]} -gt 0 ]; then
    printf 'mutate.sh: %s\n' "${problems[@]}" >&2
    echo "mutate.sh: ${#problems[@]} problem(s) in $LIST; nothing was run" >&2
    exit 2
fi
COUNT=${#M_ID[@]}

if [ "$MODE" = list ]; then
    printf '%-38s %-5s %-5s %-16s %s\n' "mutant" "build" "needs" "file" "the bug / expected to be caught by"
    for ((i = 0; i < COUNT; i++)); do
        printf '%-38s %-5s %-5s %-16s %s\n%61s -> %s\n' "${M_ID[$i]}" "${M_BUILD[$i]}" "${M_NEEDS[$i]}" "${M_FILE[$i]}" \
               "${M_WHAT[$i]}" "" "${M_EXPECT[$i]:-(any test)}"
    done
    exit 0
fi
if [ "$MODE" = check ]; then
    echo "mutate.sh: all $COUNT mutants of $(basename "$LIST") apply (each original text occurs exactly once)"
    exit 0
fi

# ---- the runs: (mutant, build) pairs
SEL=()
if [ -n "$ONLY" ]; then
    IFS=, read -r -a wanted <<< "$ONLY"
    for w in "${wanted[@]}"; do
        found=0
        for ((i = 0; i < COUNT; i++)); do [ "${M_ID[$i]}" = "$w" ] && { SEL+=("$i"); found=1; }; done
        [ "$found" = 1 ] || die "--only: no mutant '$w' in $LIST (scripts/mutate.sh --list)"
    done
else
    for ((i = 0; i < COUNT; i++)); do SEL+=("$i"); done
fi
RUNS=()
for i in "${SEL[@]}"; do
    [ -z "$NEEDS" ] || [ "${M_NEEDS[$i]}" = "$NEEDS" ] || continue
    for b in fp8 bf16; do
        [ "$BUILDS" = both ] || [ "$BUILDS" = "$b" ] || continue
        [ "${M_BUILD[$i]}" = both ] || [ "${M_BUILD[$i]}" = "$b" ] || continue
        RUNS+=("$i.$b")
    done
done
# The baseline: one more entry, the tree as it is (no text to replace).
if [ "$BASELINE" = 1 ]; then
    M_ID[$COUNT]=baseline M_NEEDS[$COUNT]=host M_EXPECT[$COUNT]="" M_ORIG[$COUNT]="" M_REPL[$COUNT]=""
    for b in fp8 bf16; do [ "$BUILDS" = both ] || [ "$BUILDS" = "$b" ] && RUNS=("$COUNT.$b" "${RUNS[@]}"); done
fi
[ ${#RUNS[@]} -gt 0 ] || die "no mutant of the selection applies to --build $BUILDS${NEEDS:+ with --needs $NEEDS}"
# The files a scratch tree gets: those git tracks or would track (their working-tree contents), or without git every file at
# the top of the tree but the build outputs, and the scripts (the tests run some).
tree_files() {
    if git -C "$ROOT" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
        (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done)
    else
        (cd "$ROOT" && find . -maxdepth 1 -type f ! -name test_fp8 ! -name train_fp8 ! -name train_fp8_bf16 \
                                              ! -name .build-settings -printf '%P\0' && find scripts -type f -print0)
    fi
}

rm -rf "$SCRATCH"
mkdir -p "$SCRATCH/logs" "$SCRATCH/results" "$SCRATCH/slots"

# One of COUNT slots of KIND (a lock file each), held on fd 9 until slot_release.
slot_acquire() {
    local i
    while :; do
        for ((i = 0; i < $2; i++)); do
            exec 9> "$SCRATCH/slots/$1.$i"
            flock -n 9 && return 0
        done
        sleep 1
    done
}
slot_release() { exec 9>&-; }

# The verdict of one test run (its log and exit status): "pass", "usage" or the names of what failed.
verdict() {
    local log=$1 rc=$2 failed last
    [ "$rc" = 0 ] && { echo pass; return; }
    [ "$rc" = 2 ] && { echo usage; return; }
    failed=$(sed -n 's/^  FAILED \([^ ]*\).*/\1/p' "$log" | awk 'NR <= 3 { printf "%s ", $0 } NR == 4 { printf "... " }')
    last=$(sed -n 's/^TEST //p' "$log" | tail -n 1)
    if [ "$rc" = 124 ]; then echo "${failed}timeout in ${last:-start-up}"
    elif [ -n "$failed" ]; then echo "${failed% }"
    else echo "crash in ${last:-start-up} (exit $rc)"; fi
}

# One mutant in one build: copy, apply, build, test; the result is one line "STATUS<TAB>DETAIL" in results/.
run_one() {
    local i=$1 b=$2 tag="${M_ID[$1]}.$2"
    local dir="$SCRATCH/$tag" log="$SCRATCH/logs/$tag" res="$SCRATCH/results/$tag" file content rc
    mkdir -p "$dir"
    tree_files | (cd "$ROOT" && xargs -0 cp --parents -t "$dir")
    if [ "$i" != "$COUNT" ]; then
        file="$dir/${M_FILE[$i]}"
        IFS= read -r -d '' content < "$file"
        printf '%s' "${content/"${M_ORIG[$i]}"/"${M_REPL[$i]}"}" > "$file"
    fi
    slot_acquire build "$JOBS"
    (cd "$dir" && make -j2 PRECISION="${b^^}" test_fp8 train_fp8) > "$log.build.log" 2>&1
    rc=$?
    slot_release
    if [ "$rc" != 0 ]; then
        printf 'BUILD FAILED\tdoes not compile: %s\n' "${log#$ROOT/}.build.log" > "$res"
    elif [ "$COMPILE_ONLY" = 1 ]; then
        printf 'built\t\n' > "$res"
    else
        local flags=() v1="" v2="" nogpu=0
        [ "$ALL_FAILURES" = 1 ] || flags+=(--fail-fast)
        [ "$HOST_ONLY" = 1 ] && { flags+=(--host-only); nogpu=1; }
        slot_acquire suite "$PARALLEL"
        if [ -n "${M_EXPECT[$i]}" ] && [ "$ALL_FAILURES" = 0 ]; then
            # shellcheck disable=SC2086
            (cd "$dir" && timeout "$TIMEOUT" ./test_fp8 "${flags[@]}" ${M_EXPECT[$i]}) > "$log.expected.log" 2>&1
            v1=$(verdict "$log.expected.log" $?)
        fi
        if [ -z "$v1" ] || [ "$v1" = pass ]; then
            (cd "$dir" && timeout "$TIMEOUT" ./test_fp8 "${flags[@]}") > "$log.suite.log" 2>&1
            v2=$(verdict "$log.suite.log" $?)
            grep -q '^GPU: none found' "$log.suite.log" && nogpu=1
        fi
        slot_release
        if [ "$i" = "$COUNT" ]; then
            [ "$v2" = pass ] && printf 'ok\tthe unmutated tree passes\n' > "$res" ||
                printf 'BASELINE FAILED\tthe unmutated tree fails: %s\n' "$v2" > "$res"
        elif [ "$v1" = usage ] || [ "$v2" = usage ]; then
            printf 'LIST DEFECT\texpect names a test that does not exist: %s\n' "${M_EXPECT[$i]}" > "$res"
        elif [ -n "$v1" ] && [ "$v1" != pass ]; then
            printf 'yes\t%s\n' "$v1" > "$res"
        elif [ "$v2" != pass ]; then
            printf 'yes\t%s%s\n' "$v2" "${M_EXPECT[$i]:+ (not the expected: ${M_EXPECT[$i]})}" > "$res"
        elif [ "$nogpu" = 1 ] && [ "${M_NEEDS[$i]}" = gpu ]; then
            printf 'not run\tneeds the GPU tests\n' > "$res"
        else
            printf 'NO\tthe tests pass (expected: %s)\n' "${M_EXPECT[$i]:-any}" > "$res"
        fi
    fi
    [ "$KEEP" = 1 ] || rm -rf "$dir"
    printf '  %-44s %s\n' "$tag" "$(tr '\t' ' ' < "$res")"
}

trap 'pids=$(jobs -p); [ -n "$pids" ] && kill $pids 2>/dev/null; exit 130' INT TERM
echo "mutate.sh: ${#RUNS[@]} mutant runs (mutant x build); $JOBS builds and $PARALLEL test runs at once; logs in ${SCRATCH#$ROOT/}/logs/"
for r in "${RUNS[@]}"; do
    run_one "${r%.*}" "${r##*.}" &
done
wait

# ---- the table and the summary
caught=0 survived=0 notrun=0 defects=0 built=0
echo
printf '%-38s %-5s %-12s %s\n' "mutant" "build" "caught" "by"
for r in "${RUNS[@]}"; do
    i=${r%.*} b=${r##*.}
    res="$SCRATCH/results/${M_ID[$i]}.$b"
    if [ -f "$res" ]; then IFS=$'\t' read -r status detail < "$res"; else status="LOST" detail="no result (the run was interrupted)"; fi
    case "$status" in
        yes) caught=$((caught + 1)) ;;
        NO) survived=$((survived + 1)) ;;
        "not run") notrun=$((notrun + 1)) ;;
        built) built=$((built + 1)) ;;
        ok) ;;
        *) defects=$((defects + 1)) ;;
    esac
    printf '%-38s %-5s %-12s %s\n' "${M_ID[$i]}" "$b" "$status" "$detail"
done
echo
if [ "$COMPILE_ONLY" = 1 ]; then
    echo "mutants: $built built, $defects failed to build"
else
    echo "mutants: $caught caught, $survived survived, $notrun not run, $defects defects (did not build or apply)"
fi
[ "$survived" = 0 ] && [ "$defects" = 0 ]
