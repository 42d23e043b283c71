#!/usr/bin/env python3
"""Plot validation (and training) loss curves of train_fp8 runs on one picture.

    python3 plot_loss.py OUT.png LABEL=DIR/log.csv [LABEL=DIR/log.csv ...]

Each log.csv is the one train_fp8 writes (columns step, loss, val_loss, ...). Needs matplotlib
(pip install matplotlib).
"""
import csv
import sys


def read_log(path):
    steps, losses, val_steps, val_losses = [], [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row["loss"]:
                steps.append(step)
                losses.append(float(row["loss"]))
            if row["val_loss"]:
                val_steps.append(step)
                val_losses.append(float(row["val_loss"]))
    return steps, losses, val_steps, val_losses


def main():
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        sys.exit(__doc__)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot_loss.py needs matplotlib: pip install matplotlib")
    out = sys.argv[1]
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arg in sys.argv[2:]:
        label, path = arg.split("=", 1)
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


if __name__ == "__main__":
    main()
