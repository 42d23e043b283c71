#!/usr/bin/env python3
"""The FP8 linear layer's data flow, as fp8_kernels.cuh and llama2.cuh run it: the forward (X in E4M3, the weight
copies rebuilt once per optimizer step) on top, the backward (dY in E5M2, the dX and dW GEMMs) below, and the
per-tensor Fp8Meta record that the casts write and cuBLASLt reads. Boxes are coloured by the format of the tensor
(BF16 / FP32, E4M3, E5M2); white boxes are kernels or cuBLASLt calls, named as in the code.

    python3 scripts/plot_fp8_linear.py [OUT.png]      (default docs/fp8_linear.png; needs matplotlib)
"""
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

# face and edge colour of each kind of box
STYLE = {"bf16": ("#d6e6f5", "#3d78b5"), "e4m3": ("#fde3c8", "#d9822b"), "e5m2": ("#d8efd2", "#4f9a3c"),
         "op": ("#ffffff", "#555555"), "meta": ("#fff3c4", "#b58900"), "saved": ("#fde3c8", "#d9822b")}
# the x range of each column, left to right (the axes are 160 x 100 units, 10 pixels a unit)
COLUMNS = [(0.8, 22.8), (26.3, 45.3), (48.8, 74.8), (78.3, 96.3), (99.8, 114.8), (120.8, 145.8), (148.8, 159)]
ELBOW, CHANNEL = 98, 117.8   # where arrows turn: between the casts and their outputs, before the GEMMs


def box(ax, col, y, h, kind, title, body="", x=None):
    """A box centred at height y in column col (or x = (left, right)): a bold title line above its body."""
    x0, x1 = x or COLUMNS[col]
    face, edge = STYLE[kind]
    ax.add_patch(FancyBboxPatch((x0, y - h / 2), x1 - x0, h, boxstyle="round,pad=0,rounding_size=0.8",
                                fc=face, ec=edge, lw=1.6, ls="--" if kind == "saved" else "-"))
    cx = (x0 + x1) / 2
    if not body:
        ax.text(cx, y, title, ha="center", va="center", fontsize=11.5, weight="bold")
        return
    top = y + h / 2 - 0.8
    ax.text(cx, top, title, ha="center", va="top", fontsize=11.5, weight="bold")
    ax.text(cx, (top - 2.1 + y - h / 2) / 2, body, ha="center", va="center", fontsize=10.5, linespacing=1.3)


def arrow(ax, points, label="", where=0, dx=0.0, dy=0.2):
    """A polyline through points with an arrowhead at the end; label above segment `where`'s midpoint."""
    xs, ys = zip(*points)
    ax.plot(xs[:-1], ys[:-1], color="#333333", lw=1.4, solid_capstyle="butt")
    ax.annotate("", xy=points[-1], xytext=points[-2],
                arrowprops=dict(arrowstyle="-|>,head_width=0.35,head_length=0.7", color="#333333", lw=1.4,
                                shrinkA=0, shrinkB=0))
    if label:
        (xa, ya), (xb, yb) = points[where], points[where + 1]
        ax.text((xa + xb) / 2 + dx, (ya + yb) / 2 + dy, label, ha="center", va="bottom", fontsize=10,
                color="#333333", style="italic")


def lane(ax, y0, y1, title):
    ax.add_patch(Rectangle((0.3, y0), 159.4, y1 - y0, fc="#f6f6f6", ec="#bbbbbb", lw=1))
    ax.text(1, y1 - 1.2, title, ha="left", va="top", fontsize=12.5, weight="bold", color="#444444")


def right(col):
    return COLUMNS[col][1]


def left(col):
    return COLUMNS[col][0]


def chain(ax, y):
    """Arrows from each of the first four columns to the next, at height y."""
    for a in range(3):
        arrow(ax, [(right(a), y), (left(a + 1), y)])


def cast_row(ax, y, t, shape, producers, fmax, fmt):
    """Tensor t (X or dY), or the kernel producing it, through its amax and scale into one cast+transpose."""
    box(ax, 0, y, 11.5, "bf16", f"{t}   BF16 {shape}", f"or the kernel making it:\n{producers}\nrecompute {t} in the cast")
    box(ax, 1, y, 11.5, "op", "amax", f"max |{t}| (atomicMax)\ninto amax_pending:\nan amax pass, or\nthe producer's kernel")
    box(ax, 2, y, 11.5, "op", "power-of-two scale",
        f"scale = 2^e, inv_scale = 1/scale\ne = ⌊log₂(max / amax)⌋ − margin\nmax = {fmax} ({fmt})")
    box(ax, 3, y, 11.5, "op", "fp8_cast_produced", "one cast+transpose\nkernel, 64×64 tiles\nx8 = sat(x · scale)")
    chain(ax, y)


def forward(ax):
    lane(ax, 57, 99.5, "Forward   Y = X Wᵀ   (every micro-batch)")
    cast_row(ax, 86, "X", "[N, in]", "RMSNorm and SwiGLU", 448, "E4M3")
    box(ax, 4, 89.5, 4.2, "e4m3", "X8  [N, in]")
    box(ax, 4, 82.2, 6, "e4m3", "X8ᵀ  [in, N]", "kept for backward")
    box(ax, 5, 85, 16.5, "op", "fp8_linear_forward",
        "cuBLASLt matmul, TN form:\nY = X8 · W8ᵀ\nA = X8, B = W8, K-contiguous\n× inv_scale of X and W,\n"
        "read from device memory\nfast accumulation")
    box(ax, 6, 85, 8, "bf16", "Y", "BF16\n[N, out]")
    arrow(ax, [(right(3), 89.5), (left(4), 89.5)])
    arrow(ax, [(right(3), 82.2), (left(4), 82.2)])
    arrow(ax, [(right(4), 89.5), (left(5), 89.5)], "A")
    arrow(ax, [(right(5), 85), (left(6), 85)])

    # the weight's FP8 copies: once per optimizer step (model_weights_changed)
    y = 64.5
    ax.add_patch(Rectangle((0.8, 58), 145.2, 17, fc="none", ec="#888888", lw=1.2, ls=(0, (4, 3))))
    ax.text(1.4, 74.4, "once per optimizer step (model_weights_changed)", ha="left", va="top", fontsize=10.5,
            style="italic", color="#555555")
    box(ax, 0, y, 9.5, "bf16", "W   FP32 master", "AdamW state [out, in]")
    box(ax, 1, y, 9.5, "op", "AdamW update", "writes BF16 W,\ngathers max |W|")
    box(ax, 2, y, 9.5, "bf16", "W   BF16 [out, in]", "its amax already in\nW's amax_pending")
    box(ax, 3, y, 9.5, "op", "fp8_weight_update", "cast+transpose, no\namax pass; current\nscaling, margin 0")
    box(ax, 4, 69, 4.2, "e4m3", "W8  [out, in]")
    box(ax, 5, 62.8, 4.2, "e4m3", "W8ᵀ  [in, out]")
    chain(ax, y)
    arrow(ax, [(right(3), 66), (ELBOW, 66), (ELBOW, 69), (left(4), 69)])
    arrow(ax, [(right(3), 62.8), (left(5), 62.8)])
    arrow(ax, [(right(4), 69), (CHANNEL, 69), (CHANNEL, 80), (left(5), 80)], "B", where=1, dx=1.3, dy=-3)


def backward(ax):
    lane(ax, 18, 55.5, "Backward   dX = dY W,  dW += dYᵀ X")
    cast_row(ax, 44, "dY", "[N, out]", "SwiGLU and RoPE backward", 57344, "E5M2")
    box(ax, 4, 46.5, 4.2, "e5m2", "dY8  [N, out]")
    box(ax, 4, 30.5, 4.2, "e5m2", "dY8ᵀ  [out, N]")
    box(ax, 4, 23.5, 6, "saved", "X8ᵀ  [in, N]", "from the forward")
    box(ax, 5, 44, 14, "op", "fp8_linear_backward: dX",
        "dX = dY8 · W8\nA = dY8 [N, out]\nB = W8ᵀ [in, out]\n× inv_scale of dY and W\nsplit accumulation")
    box(ax, 5, 27, 14, "op", "fp8_linear_backward: dW",
        "dW += dY8ᵀ · X8\nA = dY8ᵀ [out, N]\nB = X8ᵀ [in, N]\n× inv_scale of dY and X\nsplit accumulation")
    box(ax, 6, 44, 8, "bf16", "dX", "BF16\n[N, in]")
    box(ax, 6, 27, 10, "bf16", "dW", "FP32\n[out, in]\n→ AdamW")
    arrow(ax, [(right(3), 46.5), (left(4), 46.5)])
    arrow(ax, [(right(3), 41.5), (ELBOW, 41.5), (ELBOW, 30.5), (left(4), 30.5)])
    arrow(ax, [(right(4), 46.5), (left(5), 46.5)], "A")
    arrow(ax, [(133.3, 60.7), (133.3, 51)], "B", dx=1.3, dy=-2)
    arrow(ax, [(right(4), 30.5), (left(5), 30.5)], "A")
    arrow(ax, [(right(4), 23.5), (left(5), 23.5)], "B")
    arrow(ax, [(right(5), 44), (left(6), 44)])
    arrow(ax, [(right(5), 27), (left(6), 27)])
    handles = [Patch(fc=STYLE[k][0], ec=STYLE[k][1], label=t) for k, t in
               (("bf16", "BF16 / FP32"), ("e4m3", "E4M3 (max 448)"), ("e5m2", "E5M2 (max 57344)"),
                ("op", "kernel / cuBLASLt call"), ("meta", "Fp8Meta"))]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.007, 0.19), ncol=3, fontsize=11, frameon=False)


def fp8_meta(ax):
    """The Fp8Meta record as it lies in memory (byte offsets above the fields)."""
    ax.text(1, 17.1, "Fp8Meta: one per tensor (X, W, dY) of each FP8 linear (Fp8Linear::meta[3]), in device memory, "
            "16-byte aligned with inv_scale first (cuBLASLt's rule for scale pointers)", ha="left", va="top", fontsize=11.5, weight="bold")
    fields = [("inv_scale", "1/scale: cuBLASLt's\nscale pointer", 17, 0), ("scale", "x8 = sat(x · scale)", 18, 4),
              ("amax", "last amax", 11, 8), ("nonfinite, uses", "counters", 15, 12),
              ("amax_pending", "amax being gathered\n(atomicMax on bits)", 20, 20),
              ("history[1024]", "amax ring buffer: delayed scaling\n(--amax-history N) takes its max", 39, 24),
              ("blocks_done", "finished blocks\nof a cast", 17, 4120), ("warmup_amax", "--amax-warmup", 17, 4124)]
    x = 1
    for name, note, w, off in fields:
        box(ax, None, 9.5, 7.6, "meta", name, note, x=(x, x + w))
        ax.text(x + 0.2, 13.4, str(off), ha="left", va="bottom", fontsize=8, color="#7a5c00")
        x += w + 0.4
    ax.text(1, 2.9, "Current scaling: each cast derives its scale from amax_pending, and the last block of its grid writes amax, "
            "scale and inv_scale. cuBLASLt reads inv_scale through its A / B scale pointers: no host round trip.\n"
            "Delayed scaling (--amax-history N): the casts use the stored scale and gather amax_pending; "
            "fp8_update_scales records it in the history once per optimizer step.", ha="left", va="center", fontsize=10, linespacing=1.4, color="#333333")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "docs/fp8_linear.png"
    if len(sys.argv) > 2 or not out.endswith(".png"):
        sys.exit(f"error: usage: python3 scripts/plot_fp8_linear.py [OUT.png] (got {' '.join(sys.argv[1:])})")
    fig = plt.figure(figsize=(16, 10), dpi=100)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, 160)
    ax.set_ylim(0, 100)
    ax.axis("off")
    forward(ax)
    backward(ax)
    fp8_meta(ax)
    fig.savefig(out, dpi=100, facecolor="white")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
