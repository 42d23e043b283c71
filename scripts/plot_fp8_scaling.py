#!/usr/bin/env python3
"""Why finer scales hold outliers: one activation-like tensor X [256 tokens, 512 channels] cast to E4M3 under the
three granularities of a scale - one for the whole tensor (the recipe, current or delayed), one per 1x128 tile of a
row along the GEMM's reduction dimension (X and dY under --scaling block), one per 128x128 block (W under it). Top:
the scale each element gets (log2). Bottom: where the scaled values |x s| land against E4M3's range (normal numbers
keep 3 mantissa bits; subnormals fewer; below 2^-10 a value flushes to 0), with the cast's SQNR. X has the two kinds
of outlier LLM activations show: a few channels large in every token, and one token far larger in every channel.

    python3 scripts/plot_fp8_scaling.py [OUT.png]      (default docs/fp8_scaling.png; needs matplotlib and numpy)
"""
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6   # 2^-6, the smallest normal; below it the step stays 2^-9 (subnormals)
MANTISSA_BITS = 3
TOKENS, CHANNELS, TILE = 256, 512, 128


def e4m3(v):
    """v rounded to E4M3 (round to nearest even, saturating at +-448; subnormals down to 2^-9)."""
    a = np.minimum(np.abs(v), E4M3_MAX)
    exp = np.floor(np.log2(np.maximum(a, 2.0 ** E4M3_MIN_NORMAL_EXP)))
    step = 2.0 ** (exp - MANTISSA_BITS)
    return np.sign(v) * np.minimum(np.round(a / step) * step, E4M3_MAX)


def tensor_scale(x):
    """The recipe's rule: the power of two that puts the amax at or below E4M3's max."""
    return np.full_like(x, 2.0 ** np.floor(np.log2(E4M3_MAX / np.abs(x).max())))


def tiled_scale(x, rows, cols):
    """448 / amax of each rows x cols tile, as block scaling computes it (FP32, no power of two)."""
    s = np.empty_like(x)
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], cols):
            s[r:r + rows, c:c + cols] = E4M3_MAX / np.abs(x[r:r + rows, c:c + cols]).max()
    return s


def activations(seed=0):
    rng = np.random.default_rng(seed)
    channel_size = np.exp(rng.normal(0.0, 0.5, CHANNELS))
    channel_size[[37, 300]] = 60.0                  # outlier channels, large in every token
    x = rng.normal(0.0, 1.0, (TOKENS, CHANNELS)) * channel_size
    x[90] *= 100.0                                  # a token far larger in every channel
    return x


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "docs/fp8_scaling.png"
    x = activations()
    rules = [("one scale per tensor", tensor_scale(x)), ("1 x 128 tiles along K (X, dY)", tiled_scale(x, 1, TILE)),
             ("128 x 128 blocks (W)", tiled_scale(x, TILE, TILE))]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.4), constrained_layout=True)
    bins = np.linspace(-16, 10, 105)
    for col, (title, s) in enumerate(rules):
        q = e4m3(x * s) / s
        sqnr = 10 * np.log10(np.sum(x ** 2) / np.sum((q - x) ** 2))
        subnormal, flushed = np.mean(np.abs(x * s) < 2.0 ** E4M3_MIN_NORMAL_EXP), np.mean(q == 0)
        print(f"{title}: SQNR {sqnr:.2f} dB, subnormal {subnormal:.3%}, flushed {flushed:.3%}")
        im = axes[0, col].imshow(np.log2(s), aspect="auto", cmap="viridis", vmin=-8, vmax=6, interpolation="nearest")
        axes[0, col].set_title(f"{title}\nlog2 of the scale", fontsize=12)
        axes[0, col].set_xlabel("channel (the GEMM's reduction dimension K)")
        axes[0, col].set_ylabel("token")
        ax = axes[1, col]
        ax.axvspan(bins[0], -10, color="#f4c7c3", label="flushed to 0")
        ax.axvspan(-10, E4M3_MIN_NORMAL_EXP, color="#fde3c8", label="subnormal (fewer bits)")
        ax.axvspan(E4M3_MIN_NORMAL_EXP, np.log2(E4M3_MAX), color="#d8efd2", label="normal (3 mantissa bits)")
        ax.hist(np.log2(np.abs(x * s)).ravel(), bins=bins, color="#3d78b5")
        ax.set_yscale("log")
        ax.set_xlabel("log2 |x s|, the scaled value the cast sees")
        ax.set_ylabel("elements")
        ax.set_title(f"SQNR {sqnr:.1f} dB; {subnormal:.1%} subnormal, {flushed:.2%} flushed", fontsize=12)
        if col == 0:
            ax.legend(loc="upper left", fontsize=9)
    fig.colorbar(im, ax=axes[0, :], shrink=0.9, label="log2 scale")
    fig.suptitle("One E4M3 cast of the same X [256 x 512] (two outlier channels, one outlier token) under three scale rules",
                 fontsize=14)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
