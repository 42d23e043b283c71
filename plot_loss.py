#!/usr/bin/env python3
"""Loss curves of train_fp8 runs, and the recipe lab's table and curves (study.sh).

    python3 plot_loss.py OUT.png LABEL=DIR/log.csv [LABEL=DIR/log.csv ...]   curves of single runs
    python3 plot_loss.py OUT.png STUDY_DIR     a study's configurations: mean validation loss over seeds with a
                                               +-1 std band, and each configuration's final validation loss
    python3 plot_loss.py table STUDY_DIR       a study's table (markdown): mean +- std of the final and the best
                                               validation loss per configuration, against the BF16 build

Each log.csv is the one train_fp8 writes (columns step, loss, val_loss, ...). A study folder is what study.sh
writes: configs.tsv (NAME, BUILD, FLAGS a line), setup.txt (the flags of every run), and NAME/seed-S/ holding
log.csv and exit.txt (the run's exit status) for each run. The table needs only Python's standard library; the
pictures need matplotlib (pip install matplotlib).
"""
import csv
import math
import os
import re
import sys

LOG_COLUMNS = ["step", "loss", "val_loss"]   # the columns of train_fp8's log.csv read here (it writes more after them)

# The names study.sh gives the configurations the targets compare.
BASELINE, RECIPE, M_FP32 = "bf16", "fp8", "m-fp32"


def fail(message):
    sys.exit(f"error: {message}")


def read_log(path):
    steps, losses, val_steps, val_losses = [], [], [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if (reader.fieldnames or [])[:3] != LOG_COLUMNS:
            fail(f"{path}: its columns are '{','.join(reader.fieldnames or [])}', train_fp8's log.csv starts with "
                 f"'{','.join(LOG_COLUMNS)}'")
        for line, row in enumerate(reader, 2):
            try:
                step = int(row["step"])
                if row["loss"]:
                    steps.append(step)
                    losses.append(float(row["loss"]))
                if row["val_loss"]:
                    val_steps.append(step)
                    val_losses.append(float(row["val_loss"]))
            except (TypeError, ValueError):
                fail(f"{path}, line {line}: step, loss and val_loss must be numbers (or empty), found {row}")
    return steps, losses, val_steps, val_losses


# ---- a study folder

class Run:
    """One seed of a configuration: ok (final, best, curve) or why it does not count."""
    def __init__(self, seed, folder):
        self.seed, self.folder = seed, folder
        self.final = self.best = self.final_step = None
        self.curve = []   # (step, validation loss)
        self.problem = None
        exit_path = os.path.join(folder, "exit.txt")
        if not os.path.exists(exit_path):
            self.problem = "not finished (no exit.txt: never ran to its end)"
            return
        with open(exit_path) as f:
            status = f.read().strip()
        if status != "0":
            self.problem = f"exit {status}"
            return
        log = os.path.join(folder, "log.csv")
        if not os.path.exists(log):
            self.problem = "exit 0 but no log.csv"
            return
        steps, _, val_steps, val_losses = read_log(log)
        last_step = max(steps + val_steps, default=None)
        if not val_steps or val_steps[-1] != last_step:
            self.problem = f"exit 0 but no validation loss at its last step ({last_step})"
            return
        if not all(math.isfinite(v) for v in val_losses):
            self.problem = "a non-finite validation loss"
            return
        self.curve = list(zip(val_steps, val_losses))
        self.final, self.final_step, self.best = val_losses[-1], val_steps[-1], min(val_losses)


class Config:
    def __init__(self, name, build, flags, runs):
        self.name, self.build, self.flags, self.runs = name, build, flags, runs
        self.ok = [r for r in runs if r.problem is None]
        self.final = mean_std([r.final for r in self.ok])
        self.best = mean_std([r.best for r in self.ok])


def read_study(study_dir):
    """The configurations of a study folder in the order of its configs.tsv, each with its runs (seed order)."""
    manifest = os.path.join(study_dir, "configs.tsv")
    if not os.path.exists(manifest):
        fail(f"{manifest} is missing: {study_dir} is not a study folder (study.sh writes one; see ./study.sh --help)")
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


def format_mean_std(stat):
    n, mean, std = stat
    if mean is None:
        return "-"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def percent(value, reference):
    return 100.0 * (value - reference) / reference


def versus_baseline(config, baseline):
    """The difference of the final validation loss's mean to the baseline's: in % and in units of its std."""
    if config is baseline or config.final[1] is None or baseline is None or baseline.final[1] is None:
        return "-"
    _, base_mean, base_std = baseline.final
    text = f"{percent(config.final[1], base_mean):+.2f}%"
    if base_std is not None and base_std > 0:
        text += f", {(config.final[1] - base_mean) / base_std:+.2f} std"
    return text


def print_table(study_dir):
    configs = read_study(study_dir)
    by_name = {c.name: c for c in configs}
    baseline = by_name.get(BASELINE)
    setup_path = os.path.join(study_dir, "setup.txt")
    if os.path.exists(setup_path):
        with open(setup_path) as f:
            print(f"Setup of every run: `{f.read().strip()}`\n")
    print("| configuration | build | flags | n | final val loss | best val loss | final vs BF16 build |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in configs:
        not_counted = len(c.runs) - len(c.ok)
        n = f"{len(c.ok)}" + (f" + {not_counted} not counted" if not_counted else "")
        versus = "(baseline)" if c is baseline else versus_baseline(c, baseline)
        flags = f"`{c.flags}`" if c.flags else ""
        print(f"| {c.name} | {c.build.upper()} | {flags} | {n} | {format_mean_std(c.final)} | "
              f"{format_mean_std(c.best)} | {versus} |")
    print("\nmean ± sample std (n - 1) over the seeds that count; vs BF16 build: the difference of the final "
          "validation loss's mean, in % of the BF16 build's mean and in units of its std.")
    final_steps = sorted({r.final_step for c in configs for r in c.ok})
    if len(final_steps) > 1:
        print(f"\nWARNING: the counted runs end at different steps ({', '.join(map(str, final_steps))}): "
              "they are not comparable")
    elif final_steps:
        print(f"Every counted run ends at step {final_steps[0]}.")
    problems = [(c.name, r) for c in configs for r in c.runs if r.problem]
    if problems:
        print("\nRuns not counted:")
        for name, r in problems:
            print(f"- {name} seed {r.seed}: {r.problem} ({r.folder})")
    print("\nTargets (the FP8 recipe's claims):")
    recipe, m_fp32 = by_name.get(RECIPE), by_name.get(M_FP32)
    print(f"- FP8 recipe ({RECIPE}) vs BF16 build ({BASELINE}), final val loss: {target_recipe(recipe, baseline)}")
    print(f"- FP8 first moment ({RECIPE}) vs --m-dtype fp32 ({M_FP32}), final val loss: {target_moment(recipe, m_fp32)}")


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
    diff = percent(recipe.final[1], baseline.final[1])
    text = f"{diff:+.2f}% (within 0.5%: {yes_no(abs(diff) <= 0.5)})"
    base_std = baseline.final[2]
    if base_std is None or base_std == 0:
        return text + ", n/a in BF16 std (fewer than 2 counted BF16 runs, or no spread)"
    sigmas = (recipe.final[1] - baseline.final[1]) / base_std
    return text + f", {sigmas:+.2f} BF16 std (within 2: {yes_no(abs(sigmas) <= 2)})"


def target_moment(recipe, m_fp32):
    why = missing((RECIPE, recipe), (M_FP32, m_fp32))
    if why:
        return why
    diff = percent(recipe.final[1], m_fp32.final[1])
    return f"{diff:+.2f}% (within 0.5%: {yes_no(abs(diff) <= 0.5)})"


# ---- pictures

def import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot_loss.py needs matplotlib for pictures (pip install matplotlib); "
                 "the table (plot_loss.py table DIR) does not")
    return plt


def plot_runs(out, labelled_paths):
    plt = import_pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, path in labelled_paths:
        steps, losses, val_steps, val_losses = read_log(path)
        ax_train.plot(steps, losses, label=label, linewidth=0.8)
        ax_val.plot(val_steps, val_losses, label=label, marker=".", linewidth=1.2)
        if val_losses:
            print(f"{label}: final val loss {val_losses[-1]:.4f} at step {val_steps[-1]}, best {min(val_losses):.4f}")
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
        fail(f"{study_dir}: no run counts (see: python3 plot_loss.py table {study_dir})")
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
