#!/usr/bin/env python3
"""Loss curves of train_fp8 runs, and the recipe lab's table and curves (study.sh).

    python3 scripts/plot_loss.py OUT.png LABEL=DIR/log.csv [LABEL=DIR/log.csv ...]   curves of single runs
    python3 scripts/plot_loss.py OUT.png STUDY_DIR     a study's configurations: mean validation loss over seeds with a
                                                       +-1 std band, and each configuration's final validation loss
    python3 scripts/plot_loss.py table STUDY_DIR       a study's table (markdown): mean +- std of the final and the best
                                                       validation loss per configuration, against the BF16 build (the
                                                       difference with its standard error, Welch); tokens/s, and the
                                                       training time at which each reaches the BF16 build's
                                                       validation loss at 60% of its run

Each log.csv is the one train_fp8 writes (columns step, loss, val_loss, ...). A study folder is what study.sh
writes: configs.tsv (NAME, BUILD, FLAGS a line), setup.txt (the flags of every run), and NAME/seed-S/ holding
log.csv, exit.txt (the run's exit status) and parallel.txt (how many runs study.sh ran at a time on the GPU) for
each run. The table needs only Python's standard library; the pictures need matplotlib (pip install matplotlib).
"""
import csv
import math
import os
import re
import statistics
import sys

# the columns of train_fp8's log.csv read here (it writes more after them)
LOG_COLUMNS = ["step", "loss", "val_loss", "lr", "grad_norm", "ms", "tokens_per_s"]

# The names study.sh gives the configurations the targets compare.
BASELINE, RECIPE, M_FP32 = "bf16", "fp8", "m-fp32"


def fail(message):
    sys.exit(f"error: {message}")


class Log:
    """A log.csv: the training rows (step, loss, the step's milliseconds on the host clock, tokens/s) and the
    evaluations (step, validation loss; step 0 is the one before training)."""
    def __init__(self):
        self.steps, self.losses, self.ms, self.tokens_per_s = [], [], [], []
        self.val_steps, self.val_losses = [], []


def read_log(path):
    log = Log()
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if (reader.fieldnames or [])[:len(LOG_COLUMNS)] != LOG_COLUMNS:
            fail(f"{path}: its columns are '{','.join(reader.fieldnames or [])}', train_fp8's log.csv starts with "
                 f"'{','.join(LOG_COLUMNS)}'")
        for line, row in enumerate(reader, 2):
            try:
                step = int(row["step"])
                if row["loss"]:
                    log.steps.append(step)
                    log.losses.append(float(row["loss"]))
                    log.ms.append(float(row["ms"]))
                    log.tokens_per_s.append(float(row["tokens_per_s"]))
                if row["val_loss"]:
                    log.val_steps.append(step)
                    log.val_losses.append(float(row["val_loss"]))
            except (TypeError, ValueError):
                fail(f"{path}, line {line}: step, loss, val_loss, ms and tokens_per_s must be numbers (ms and "
                     f"tokens_per_s in every row with a loss; val_loss may be empty), found {row}")
    return log


# ---- a study folder

class Run:
    """One seed of a configuration: ok (final, best, curve) or why it does not count; its training time at each
    evaluation (or why it has none), its median tokens/s and how many runs shared the GPU with it."""
    def __init__(self, seed, folder):
        self.seed, self.folder = seed, folder
        self.final = self.best = self.final_step = None
        self.curve = []   # (step, validation loss)
        self.seconds = None   # the training time at each evaluation of the curve
        self.tokens_per_s = self.time_problem = self.parallel = None
        self.problem = None
        parallel_path = os.path.join(folder, "parallel.txt")
        if os.path.exists(parallel_path):
            with open(parallel_path) as f:
                text = f.read().strip()
            if not re.fullmatch(r"[1-9][0-9]*", text):
                fail(f"{parallel_path}: expected the number of runs at a time on the GPU (study.sh --parallel), "
                     f"found {text!r}")
            self.parallel = int(text)
        exit_path = os.path.join(folder, "exit.txt")
        if not os.path.exists(exit_path):
            self.problem = "not finished (no exit.txt: never ran to its end)"
            return
        with open(exit_path) as f:
            status = f.read().strip()
        if status != "0":
            self.problem = f"exit {status}"
            return
        log_path = os.path.join(folder, "log.csv")
        if not os.path.exists(log_path):
            self.problem = "exit 0 but no log.csv"
            return
        log = read_log(log_path)
        last_step = max(log.steps + log.val_steps, default=None)
        if not log.val_steps or log.val_steps[-1] != last_step:
            self.problem = f"exit 0 but no validation loss at its last step ({last_step})"
            return
        if not all(math.isfinite(v) for v in log.val_losses):
            self.problem = "a non-finite validation loss"
            return
        self.curve = list(zip(log.val_steps, log.val_losses))
        self.final, self.final_step, self.best = log.val_losses[-1], log.val_steps[-1], min(log.val_losses)
        # The training time at step s is the sum of the ms of steps 1..s, so it needs a row for every step.
        if log.steps != list(range(1, last_step + 1)):
            missing = sorted(set(range(1, last_step + 1)) - set(log.steps))
            self.time_problem = (f"log.csv's training rows are not steps 1 to {last_step} once each"
                                 f"{f' (no row for step {missing[0]})' if missing else ''}: the training time needs "
                                 "every step's ms")
            return
        if not all(math.isfinite(ms) and ms >= 0 for ms in log.ms):
            self.time_problem = "log.csv has a step whose ms is not a finite number >= 0"
            return
        elapsed = [0.0]
        for ms in log.ms:
            elapsed.append(elapsed[-1] + ms / 1000.0)
        self.seconds = [elapsed[step] for step in log.val_steps]
        self.tokens_per_s = statistics.median(log.tokens_per_s)


def time_to_reach(run, target):
    """The training time (s) at which run's validation loss first reaches `target`: the first evaluation at or below
    it, interpolated linearly in the validation loss between that evaluation and the one before; None if none is."""
    previous = None
    for (_, loss), seconds in zip(run.curve, run.seconds):
        if loss <= target:
            if previous is None:   # the run's first evaluation (no step 0 without --eval-every)
                return seconds
            previous_loss, previous_seconds = previous
            return previous_seconds + (seconds - previous_seconds) * (previous_loss - target) / (previous_loss - loss)
        previous = (loss, seconds)
    return None


class Config:
    def __init__(self, name, build, flags, runs):
        self.name, self.build, self.flags, self.runs = name, build, flags, runs
        self.ok = [r for r in runs if r.problem is None]
        self.timed = [r for r in self.ok if r.time_problem is None]
        self.final = mean_std([r.final for r in self.ok])
        self.best = mean_std([r.best for r in self.ok])
        self.tokens_per_s = mean_std([r.tokens_per_s for r in self.timed])
        self.times = []   # time_to_reach of each timed run for the study's target (set by print_table)


def read_study(study_dir):
    """The configurations of a study folder in the order of its configs.tsv, each with its runs (seed order)."""
    manifest = os.path.join(study_dir, "configs.tsv")
    if not os.path.exists(manifest):
        fail(f"{manifest} is missing: {study_dir} is not a study folder (study.sh writes one; see scripts/study.sh --help)")
    configs = []
    with open(manifest) as f:
        for number, line in enumerate(f, 1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 3 or fields[1] not in ("fp8", "bf16") or not re.fullmatch(r"[A-Za-z0-9._-]+", fields[0]):
                fail(f"{manifest}, line {number}: expected NAME<tab>fp8|bf16<tab>FLAGS, found {line.strip()!r}")
            name, build, flags = fields
            folder = os.path.join(study_dir, name)
            seeds = []
            if os.path.isdir(folder):
                for entry in os.listdir(folder):
                    m = re.fullmatch(r"seed-(\d+)", entry)
                    if m:
                        seeds.append(int(m.group(1)))
            runs = [Run(s, os.path.join(folder, f"seed-{s}")) for s in sorted(seeds)]
            configs.append(Config(name, build, flags, runs))
    return configs


def mean_std(values):
    """(n, mean, sample standard deviation with n - 1) - mean None for no values, std None for fewer than 2."""
    n = len(values)
    if n == 0:
        return n, None, None
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return n, mean, std


def format_mean_std(stat, digits=4):
    n, mean, std = stat
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def percent(value, reference):
    return 100.0 * (value - reference) / reference


def welch(a, b):
    """The difference of the mean final validation losses of configurations a and b (mean a - mean b), in % of b's
    mean, with its standard error sqrt(s_a^2 / n_a + s_b^2 / n_b) (Welch's, the seeds of each independent) in the
    same unit and t = difference / standard error: (diff, se, t), se and t None when either has fewer than 2 runs."""
    (na, ma, sa), (nb, mb, sb) = a.final, b.final
    diff = percent(ma, mb)
    if sa is None or sb is None or (sa == 0 and sb == 0):
        return diff, None, None
    se = 100.0 * math.sqrt(sa * sa / na + sb * sb / nb) / mb
    return diff, se, diff / se


def format_difference(a, b):
    diff, se, t = welch(a, b)
    return f"{diff:+.2f}% (no standard error: fewer than 2 runs)" if se is None else f"{diff:+.2f}% ± {se:.2f}% (t {t:+.2f})"


def versus_baseline(config, baseline):
    """The difference of the final validation loss's mean to the baseline's, in %, with its standard error."""
    if config is baseline or config.final[1] is None or baseline is None or baseline.final[1] is None:
        return "-"
    return format_difference(config, baseline)


TARGET_FRACTION = 0.6   # the time-to-quality target: the BF16 build's validation loss at 60% of its run


def set_times(configs, baseline):
    """Each configuration's times to the target: the BF16 build's mean validation loss at its evaluation nearest to
    60% of its run, a loss every run should reach well before its end, so that neither build's final loss decides
    the time. Returns (target, step), or (None, None) when the BF16 runs share no such evaluation."""
    target, step = None, None
    if baseline is not None and baseline.ok:
        steps = [s for s, _ in baseline.ok[0].curve if s > 0]
        if steps:
            step = min(steps, key=lambda s: (abs(s - TARGET_FRACTION * baseline.ok[0].final_step), s))
            losses = [dict(r.curve).get(step) for r in baseline.ok]
            if all(v is not None for v in losses):
                target = statistics.mean(losses)
    for c in configs:
        c.times = [] if target is None else [time_to_reach(r, target) for r in c.timed]
    return (target, step) if target is not None else (None, None)


def format_time(c):
    """The time-to-target cell: mean ± std over the runs that reach it, and how many do when not all."""
    if not c.times:
        return "-"
    reached = [t for t in c.times if t is not None]
    if not reached:
        return f"not reached (0 of {len(c.times)})"
    text = format_mean_std(mean_std(reached), 1)
    return text if len(reached) == len(c.times) else text + f" ({len(reached)} of {len(c.times)} reached)"


def time_ratio(c, baseline):
    """The ratio of the mean time to the target to the BF16 build's, or None."""
    reached = [t for t in c.times if t is not None]
    base = [t for t in baseline.times if t is not None] if baseline is not None else []
    if c is baseline or not reached or not base:
        return None
    return mean_std(reached)[1] / mean_std(base)[1]


def format_tokens(c, baseline):
    mean = c.tokens_per_s[1]
    if mean is None:
        return "-"
    text = f"{mean / 1e3:.1f}k"
    if c is not baseline and baseline is not None and baseline.tokens_per_s[1]:
        text += f" ({mean / baseline.tokens_per_s[1]:.2f}x)"
    return text


def sharing_lines(configs):
    """Lines on how the counted runs shared the GPU (parallel.txt), with a warning when some did."""
    groups = {}   # runs at a time on the GPU (None: not recorded) -> [configuration name per run]
    for c in configs:
        for r in c.ok:
            groups.setdefault(r.parallel, []).append(c.name)
    if not groups:
        return []
    if list(groups) == [1]:
        return ["GPU sharing: every counted run had the GPU to itself (one run at a time)."]
    parts = []
    for p in sorted(groups, key=lambda p: (p is None, p or 0)):
        names = ", ".join(dict.fromkeys(groups[p]))
        what = "not recorded (no parallel.txt)" if p is None else "alone on the GPU" if p == 1 else f"{p} at a time"
        parts.append(f"{what}: {len(groups[p])} ({names})")
    return [f"GPU sharing of the counted runs (study.sh --parallel; each run's parallel.txt): {'; '.join(parts)}.",
            "WARNING: a run that shared the GPU waited for the other runs' turns on it: its times are inflated, and "
            "its tokens/s lowered, and they compare only with runs that shared it alike. Time with --parallel 1 (as "
            "--preset 1b does)."]


def print_table(study_dir):
    configs = read_study(study_dir)
    by_name = {c.name: c for c in configs}
    baseline = by_name.get(BASELINE)
    target, target_step = set_times(configs, baseline)
    machine_path = os.path.join(study_dir, "machine.txt")   # study.sh: GPU and driver; commit; date
    if os.path.exists(machine_path):
        with open(machine_path) as f:
            print(f"Measured on {f.read().strip()}.\n")
    setup_path = os.path.join(study_dir, "setup.txt")
    if os.path.exists(setup_path):
        with open(setup_path) as f:
            print(f"Setup of every run: `{f.read().strip()}`\n")
    print("| configuration | build | flags | n | final val loss | best val loss | final vs BF16 build | tokens/s | "
          "time to target (s) | vs BF16 time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in configs:
        not_counted = len(c.runs) - len(c.ok)
        n = f"{len(c.ok)}" + (f" + {not_counted} not counted" if not_counted else "")
        versus = "(baseline)" if c is baseline else versus_baseline(c, baseline)
        flags = f"`{c.flags}`" if c.flags else ""
        ratio = time_ratio(c, baseline)
        versus_time = "(baseline)" if c is baseline and any(t is not None for t in c.times) else \
            f"{ratio:.2f}x" if ratio is not None else "-"
        print(f"| {c.name} | {c.build.upper()} | {flags} | {n} | {format_mean_std(c.final)} | "
              f"{format_mean_std(c.best)} | {versus} | {format_tokens(c, baseline)} | {format_time(c)} | "
              f"{versus_time} |")
    print("\nmean ± sample std (n - 1) over the seeds that count; vs BF16 build: the difference of the final "
          "validation loss's mean, in % of the BF16 build's mean, ± its standard error (Welch: sqrt(s1^2/n1 + s2^2/n2)) "
          "and t = difference / standard error; |t| < 2 is no difference found.")
    print("tokens/s: the median over a run's steps, mean over its seeds (in brackets: its ratio to the BF16 build's).")
    target_text = f"{target:.4f}, " if target is not None else ""
    step_text = f" (step {target_step})" if target_step is not None else ""
    print(f"Time to target: the training time at which a run's validation loss first reaches {target_text}the BF16 "
          f"build's mean validation loss at its evaluation nearest to 60% of its run{step_text}, a loss both builds "
          "reach well before their end. The training time at step s is the sum of log.csv's ms over steps 1 to s: "
          "each step's micro-batches and update on the host clock, evaluation, sampling and checkpoints excluded. "
          "The crossing is at the first evaluation at or below the target, interpolated linearly in the validation "
          "loss between it and the evaluation before it (step 0 at time 0); a run that never reaches it is left out "
          "of the mean (k of n reached). vs BF16 time: the ratio of the mean times (0.80x: 20% sooner).")
    final_steps = sorted({r.final_step for c in configs for r in c.ok})
    if len(final_steps) > 1:
        print(f"\nWARNING: the counted runs end at different steps ({', '.join(map(str, final_steps))}): "
              "they are not comparable")
    elif final_steps:
        print(f"Every counted run ends at step {final_steps[0]}.")
    for line in sharing_lines(configs):
        print(line)
    problems = [(c.name, r) for c in configs for r in c.runs if r.problem]
    if problems:
        print("\nRuns not counted:")
        for name, r in problems:
            print(f"- {name} seed {r.seed}: {r.problem} ({r.folder})")
    untimed = [(c.name, r) for c in configs for r in c.ok if r.time_problem]
    if untimed:
        print("\nRuns without a training time (they count for the losses, not for tokens/s and the time):")
        for name, r in untimed:
            print(f"- {name} seed {r.seed}: {r.time_problem} ({r.folder})")
    paired = paired_lines(configs, by_name)
    if paired:
        print("\nFinal val loss against the run of the same seed (the same initial weights and data order), in % of its:")
        for line in paired:
            print(line)
    print("\nTargets (the FP8 recipe's claims):")
    recipe, m_fp32 = by_name.get(RECIPE), by_name.get(M_FP32)
    print(f"- FP8 recipe ({RECIPE}) vs BF16 build ({BASELINE}), final val loss: {target_recipe(recipe, baseline)}")
    print(f"- FP8 first moment ({RECIPE}) vs --m-dtype fp32 ({M_FP32}), final val loss: {target_moment(recipe, m_fp32)}")
    print(f"- FP8 recipe ({RECIPE}) reaches the target ({BASELINE}'s loss at 60% of its run) sooner in training time: "
          f"{target_time(recipe, baseline)}")


def paired_lines(configs, by_name):
    """Each configuration's final validation loss against the BF16 build's and the FP8 recipe's run of the same seed
    (the same initial weights and data order), in % of theirs: an ablation's control shows its effect seed by seed,
    below the spread over seeds."""
    lines = []
    for c in configs:
        if c.name == BASELINE:
            continue
        parts = []
        for r in c.ok:
            cells = []
            for other in (by_name.get(BASELINE), by_name.get(RECIPE)):
                twin = next((o for o in other.ok if o.seed == r.seed), None) if other is not None and other is not c else None
                if twin is not None:
                    cells.append(f"{percent(r.final, twin.final):+.2f}% vs {other.name}")
            if cells:
                parts.append(f"seed {r.seed} " + ", ".join(cells))
        if parts:
            lines.append(f"- {c.name}: " + "; ".join(parts))
    return lines


def yes_no(ok):
    return "yes" if ok else "NO"


def missing(*pairs):
    """'n/a: ...' naming the first configuration of (name, config) pairs without a counted run, or None."""
    for name, c in pairs:
        if c is None or c.final[1] is None:
            return f"n/a: no counted run of {name}"
    return None


def target_recipe(recipe, baseline):
    why = missing((RECIPE, recipe), (BASELINE, baseline))
    if why:
        return why
    diff, se, t = welch(recipe, baseline)
    text = f"{format_difference(recipe, baseline)}, within 0.5%: {yes_no(abs(diff) <= 0.5)}"
    return text if t is None else text + f", |t| < 2 (no difference found): {yes_no(abs(t) < 2)}"


def target_moment(recipe, m_fp32):
    why = missing((RECIPE, recipe), (M_FP32, m_fp32))
    if why:
        return why
    diff, _, _ = welch(recipe, m_fp32)
    return f"{format_difference(recipe, m_fp32)}, within 0.5%: {yes_no(abs(diff) <= 0.5)}"


def target_time(recipe, baseline):
    why = missing((RECIPE, recipe), (BASELINE, baseline))
    if why:
        return why
    if not any(t is not None for t in baseline.times):
        return f"n/a: no {BASELINE} run has a training time that reaches the target"
    if not recipe.times:
        return f"n/a: no {RECIPE} run has a training time"
    reached = sum(t is not None for t in recipe.times)
    runs = f"{reached} of {len(recipe.times)} {RECIPE} runs reached it"
    ratio = time_ratio(recipe, baseline)
    if ratio is None:
        return f"NO ({runs})"
    return (f"{100 * (1 - ratio):.0f}% ({ratio:.2f}x), {runs} "
            f"(every run, sooner: {yes_no(reached == len(recipe.times) and ratio < 1)})")


# ---- pictures

def import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot_loss.py needs matplotlib for pictures (pip install matplotlib); "
                 "the table (scripts/plot_loss.py table DIR) does not")
    return plt


def plot_runs(out, labelled_paths):
    plt = import_pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, path in labelled_paths:
        log = read_log(path)
        ax_train.plot(log.steps, log.losses, label=label, linewidth=0.8)
        ax_val.plot(log.val_steps, log.val_losses, label=label, marker=".", linewidth=1.2)
        if log.val_losses:
            print(f"{label}: final val loss {log.val_losses[-1]:.4f} at step {log.val_steps[-1]}, "
                  f"best {min(log.val_losses):.4f}")
    ax_train.set(title="training loss", xlabel="step", ylabel="loss", yscale="log")
    ax_val.set(title="validation loss", xlabel="step", ylabel="loss", yscale="log")
    for ax in (ax_train, ax_val):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def plot_study(out, study_dir):
    """Left: each configuration's mean validation loss over its counted seeds, +-1 std band, from a quarter of
    the run on (before that the early drop would flatten the differences). Right: each
    configuration's final validation loss (seeds as dots, mean +- std as a bar) against the BF16 build's mean
    and a band of +-0.5% around it (the recipe's target)."""
    configs = [c for c in read_study(study_dir) if c.ok]
    if not configs:
        fail(f"{study_dir}: no run counts (see: python3 scripts/plot_loss.py table {study_dir})")
    plt = import_pyplot()
    colors = plt.get_cmap("tab20").colors
    fig, (ax_curve, ax_final) = plt.subplots(1, 2, figsize=(15, 0.35 * len(configs) + 4.5))
    first_step = max(r.final_step for c in configs for r in c.ok) / 4
    for i, c in enumerate(configs):
        color = colors[i % len(colors)]
        steps = sorted(s for s in set.intersection(*(set(s for s, _ in r.curve) for r in c.ok)) if s >= first_step)
        per_step = [[dict(r.curve)[s] for r in c.ok] for s in steps]
        means = [mean_std(v)[1] for v in per_step]
        ax_curve.plot(steps, means, color=color, marker=".", linewidth=1.2, label=f"{c.name} (n={len(c.ok)})")
        if len(c.ok) > 1:
            stds = [mean_std(v)[2] for v in per_step]
            ax_curve.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                                  color=color, alpha=0.2, linewidth=0)
        y = len(configs) - 1 - i
        ax_final.scatter([r.final for r in c.ok], [y] * len(c.ok), color=color, s=14, zorder=3)
        ax_final.errorbar([c.final[1]], [y], xerr=[c.final[2] or 0], color=color, marker="|", markersize=14,
                          capsize=4, zorder=2)
    baseline = next((c for c in configs if c.name == BASELINE), None)
    if baseline:
        ax_final.axvline(baseline.final[1], color="gray", linewidth=1)
        ax_final.axvspan(baseline.final[1] * 0.995, baseline.final[1] * 1.005, color="gray", alpha=0.15,
                         label="BF16 build's mean +-0.5%")
        ax_final.legend(loc="lower right")
    ax_curve.set(title=f"validation loss from step {first_step:.0f}: mean over seeds, +-1 std band", xlabel="step",
                 ylabel="loss")
    ax_curve.grid(True, which="both", alpha=0.3)
    ax_curve.legend(fontsize=8, ncol=2)
    ax_final.set(title="final validation loss: seeds (dots), mean +- std (bar)", xlabel="loss")
    ax_final.set_yticks(range(len(configs)), [c.name for c in reversed(configs)])
    ax_final.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "table":
        print_table(args[1])
    elif len(args) == 2 and "=" not in args[1]:
        plot_study(args[0], args[1])
    elif len(args) >= 2 and all("=" in a for a in args[1:]):
        plot_runs(args[0], [a.split("=", 1) for a in args[1:]])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
