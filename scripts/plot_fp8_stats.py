#!/usr/bin/env python3
"""The FP8 state of a train_fp8 run, and the precision probe's SQNR, as pictures.

    scripts/plot_fp8_stats.py DIR [-o OUT.png] [--tensor "LAYER LINEAR TENSOR"]
        DIR/fp8_stats.csv (./train_fp8 --fp8-stats K --out DIR) -> DIR/fp8_stats.png. For each of a layer's 12 FP8
        tensors (X, W, dY of wqkv, wo, w_gate_up, w_down) a heatmap layer x step of the scale's exponent, of the
        fraction of codes saturated and of the fraction flushed to zero; below, one tensor's amax over the steps
        against the largest value its scale represents (the format's max / scale): the headroom. That tensor is
        --tensor (e.g. "5 w_down dY"), by default the one with the highest mean saturated fraction, or the last FP8
        layer's w_down dY if nothing saturated. A run under --scaling block has no scale per tensor (scale_log2 is
        empty: each tile has its own): its scale heatmap says so and the bottom panel draws the amax alone.
    scripts/plot_fp8_stats.py probe FILE.csv [-o OUT.png]
        the precision probe's CSV (layer, linear, gemm, sqnr_db, block_sqnr_db, block_gain_db, block_e4m3_dy_sqnr_db)
        -> FILE.png (default): the SQNR in dB of each FP8 GEMM (Y forward, dX and dW backward) against BF16 under
        per-tensor scaling, a heatmap layer x (linear, GEMM), and where the block columns are filled the same under
        block scaling and block minus per-tensor; prints the 5 worst of each scaling.
    scripts/plot_fp8_stats.py test       checks of this script on synthetic files (host only; make test runs it)

A layer without rows is one train_fp8 keeps in BF16 (drawn grey): without rows for layer 0 the first and last layers
are BF16 (train_fp8's default), so the model has one layer more than the highest in the file; with them, every layer
is FP8. A run stopped while writing fp8_stats.csv leaves a partial last step; a last line without its newline, and a
last step whose rows are a strict prefix of the step before's (train_fp8 writes them in that order), are dropped with
a note. Needs numpy and matplotlib (pip install matplotlib).
"""
import argparse
import contextlib
import io
import math
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

try:
    import numpy as np
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap, LogNorm, Normalize
    from matplotlib.ticker import MaxNLocator
    MISSING = None
except ImportError as e:
    MISSING = str(e)

LINEARS = ["wqkv", "wo", "w_gate_up", "w_down"]
TENSORS = ["X", "W", "dY"]
TENSOR_KEYS = [(linear, tensor) for linear in LINEARS for tensor in TENSORS]   # train_fp8's order in a layer
GEMMS = ["Y", "dX", "dW"]
FORMATS = {"X": ["E4M3"], "W": ["E4M3"], "dY": ["E5M2", "E4M3"]}   # dY in E4M3: --scaling block --dy-format e4m3
FORMAT_MAX = {"E4M3": 448.0, "E5M2": 57344.0}
STATS_HEADER = "step,layer,linear,tensor,format,amax,scale_log2,saturated_frac,flushed_frac"
PROBE_HEADER = "layer,linear,gemm,sqnr_db,block_sqnr_db,block_gain_db,block_e4m3_dy_sqnr_db"
STATS_SOURCE = "./train_fp8 --fp8-stats K --out DIR writes it, FP8 build"
PROBE_SOURCE = "train_fp8's precision probe writes it"
AMAX, SCALE, SATURATED, FLUSHED = range(4)   # the values of a row, in the CSV's order
GREY = "#bdbdbd"   # no rows: a layer kept in BF16


def fail(message):
    sys.exit(f"error: {message}")


def read_csv(path, header, source):
    """The rows (line number, fields) of a CSV that must start with `header`; a last line without its newline (its
    writer was stopped in the middle of it) is dropped with a note."""
    if not os.path.isfile(path):
        fail(f"{path}: no such file ({source})")
    with open(path, newline="", errors="replace") as f:
        lines = f.read().split("\n")
    if lines == [""]:
        fail(f"{path}: the file is empty, not even its header ({source})")
    if lines[0] != header:
        fail(f"{path}: its header is '{lines[0][:200]}', expected '{header}' ({source})")
    if len(lines) > 1 and lines[-1]:
        print(f"note: {path}: dropped its last line '{lines[-1]}', which has no newline (its writer was stopped)")
    rows = [(number, line.split(",")) for number, line in enumerate(lines[1:-1], 2)]
    for number, fields in rows:
        if len(fields) != header.count(",") + 1:
            fail(f"{path}, line {number}: {len(fields)} fields in '{','.join(fields)}', the header names "
                 f"{header.count(',') + 1}; move the file away, or rewrite that line")
    if not rows:
        fail(f"{path}: no rows after the header (nothing recorded yet, or no FP8 layer: {source})")
    return rows


def parse(path, number, name, text, kind, ok, expected):
    """The field `text` of column `name` as `kind`, refused unless ok(value)."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        fail(f"{path}, line {number}: {name} is '{text}', expected {expected}")
    return value


def parse_key(path, number, layer, linear, third, choices):
    """(layer, linear, third) of a row: third is a tensor of TENSORS or a GEMM of GEMMS (`choices`)."""
    return (parse(path, number, "layer", layer, int, lambda v: v >= 0, "a layer index (an integer >= 0)"),
            parse(path, number, "linear", linear, str, LINEARS.__contains__, "one of " + ", ".join(LINEARS)),
            parse(path, number, "tensor" if choices is TENSORS else "gemm", third, str, choices.__contains__,
                  "one of " + ", ".join(choices)))


def layer_count(layers):
    """The model's layer count from the layers that have rows: train_fp8 keeps the first and last in BF16 unless
    --fp8-all-layers."""
    return max(layers) + (1 if 0 in layers else 2)


def load_stats(path):
    by_step = {}   # step -> {(layer, linear, tensor): (amax, scale_log2, saturated, flushed)}, both in file order
    formats = {}   # TENSOR_KEYS' index -> the format of its rows
    for number, f in read_csv(path, STATS_HEADER, STATS_SOURCE):
        step = parse(path, number, "step", f[0], int, lambda v: v >= 0, "a step (an integer >= 0)")
        key = parse_key(path, number, f[1], f[2], f[3], TENSORS)
        k = TENSOR_KEYS.index(key[1:])
        fmt = parse(path, number, "format", f[4], str, FORMATS[key[2]].__contains__,
                    f"{' or '.join(FORMATS[key[2]])} (a format of {key[2]})")
        if formats.setdefault(k, fmt) != fmt:
            fail(f"{path}, line {number}: {key[1]} {key[2]} in {fmt}, in {formats[k]} before; move the file away")
        fraction = (float, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
        values = (parse(path, number, "amax", f[5], float, lambda v: not v < 0, "a number >= 0 (inf, nan allowed)"),
                  math.nan if f[6] == "" else   # block scaling: a scale per tile, none per tensor
                  parse(path, number, "scale_log2", f[6], int, lambda v: True, "an integer or empty"),
                  parse(path, number, "saturated_frac", f[7], *fraction),
                  parse(path, number, "flushed_frac", f[8], *fraction))
        last = next(reversed(by_step), step)
        if step < last:
            fail(f"{path}, line {number}: step {step} after step {last}: rows of two runs (a resumed run rewrites the "
                 "file from its checkpoint on); move the file away")
        if key in by_step.setdefault(step, {}):
            fail(f"{path}, line {number}: a second row for step {step} layer {' '.join(map(str, key))}; move the "
                 "file away")
        by_step[step][key] = values
    steps = list(by_step)
    if len(steps) > 1:
        last, before = list(by_step[steps[-1]]), list(by_step[steps[-2]])
        if len(last) < len(before) and last == before[:len(last)]:
            print(f"note: {path}: dropped step {steps[-1]}, whose {len(last)} rows are the first of the "
                  f"{len(before)} of step {steps[-2]} (its writer was stopped)")
            del by_step[steps.pop()]
    fp8_layers = sorted({key[0] for rows in by_step.values() for key in rows})
    values = np.full((4, len(TENSOR_KEYS), layer_count(fp8_layers), len(steps)), np.nan)   # nan: no row
    for j, step in enumerate(steps):
        for (layer, linear, tensor), v in by_step[step].items():
            values[:, TENSOR_KEYS.index((linear, tensor)), layer, j] = v
    return SimpleNamespace(path=path, steps=np.array(steps), n_layers=values.shape[2], fp8_layers=fp8_layers,
                           values=values, formats=formats)   # values [AMAX..FLUSHED, tensor, layer, step]


def default_tensor(stats):
    """(layer, tensor index, why) of the tensor with the highest mean saturated fraction, or if nothing saturated the
    last with rows in train_fp8's order (the last FP8 layer's w_down dY)."""
    total = np.nansum(stats.values[SATURATED], axis=2)   # [tensor, layer]
    if total.max() > 0:
        k, layer = np.unravel_index(np.argmax(total), total.shape)
        return int(layer), int(k), "the highest mean saturated fraction"
    has_rows = ~np.isnan(stats.values[SATURATED]).all(axis=2)   # [tensor, layer]
    layer = np.flatnonzero(has_rows.any(axis=0))[-1]
    return int(layer), int(np.flatnonzero(has_rows[:, layer])[-1]), "nothing saturated: the last FP8 tensor"


def chosen_tensor(text, stats):
    """--tensor "LAYER LINEAR TENSOR" as (layer, tensor index, why), refused unless the file has its rows."""
    f = text.split()
    if len(f) == 3 and f[0].isdigit() and int(f[0]) < stats.n_layers and (f[1], f[2]) in TENSOR_KEYS:
        k = TENSOR_KEYS.index((f[1], f[2]))
        if not np.isnan(stats.values[SATURATED, k, int(f[0])]).all():
            return int(f[0]), k, "--tensor"
    fail(f"--tensor '{text}': expected \"LAYER LINEAR TENSOR\" (LINEAR one of {', '.join(LINEARS)}, TENSOR one of "
         f"{', '.join(TENSORS)}) with rows in {stats.path} (layers {stats.fp8_layers[0]}-{stats.fp8_layers[-1]})")


def layer_ticks(ax, n_layers, fp8_layers, every):
    """Layer 0 on top; a tick every `every` layers, and one at each BF16 layer, labelled so."""
    bf16 = [l for l in range(n_layers) if l not in fp8_layers]
    ticks = sorted(bf16 + [l for l in range(0, n_layers, every) if all(abs(l - b) > every // 2 for b in bf16)])
    ax.set_yticks(ticks, [f"{l} BF16" if l in bf16 else str(l) for l in ticks])
    ax.set_ylim(n_layers - 0.5, -0.5)


def heatmap(ax, x_edges, values, cmap, norm, zero_blank):
    """values [layer, column] coloured; nan (no row) grey; with zero_blank, zeros left white."""
    present = ~np.isnan(values)
    y_edges = np.arange(values.shape[0] + 1) - 0.5
    shown = present & (values > 0) if zero_blank else present
    mesh = ax.pcolormesh(x_edges, y_edges, np.ma.masked_where(~shown, values), cmap=cmap, norm=norm)
    ax.pcolormesh(x_edges, y_edges, np.ma.masked_where(present, np.zeros(values.shape)), cmap=ListedColormap([GREY]))
    return mesh


def fraction_norm(values):
    """A log colour scale over the positive values (zeros are drawn white), and a note if there are none."""
    positive = values[values > 0]
    if positive.size == 0:
        return LogNorm(1e-6, 1), " (none above 0)"
    return LogNorm(positive.min(), max(positive.max(), positive.min() * 10)), ""


def cell_edges(steps):
    """The edges of cells centred on the steps, halfway to the next (one step: +-0.5)."""
    half = np.diff(steps) / 2 if len(steps) > 1 else np.array([0.5])
    return np.concatenate([[steps[0] - half[0]], steps[:-1] + half, [steps[-1] + half[-1]]])


def plot_stats(stats, out, choice):
    steps, n_layers, x_edges = stats.steps, stats.n_layers, cell_edges(stats.steps)
    row_height = 0.5 + 0.045 * n_layers
    fig = plt.figure(figsize=(16, 12 * row_height + 5), layout="constrained")
    grid = fig.add_gridspec(len(TENSOR_KEYS) + 1, 3, height_ratios=[row_height] * len(TENSOR_KEYS) + [3.2])
    block = np.isnan(stats.values[SCALE]).all()   # --scaling block: a scale per tile, none per tensor
    if block:   # the first column: the amax's exponent instead
        first = np.log2(np.where(stats.values[AMAX] > 0, stats.values[AMAX], np.nan))
        lo, hi = np.nanmin(first), np.nanmax(first)
        first_column = (first, "log2(amax): block scaling has a scale per tile, none per tensor", "turbo",
                        Normalize(lo, max(hi, lo + 1)), "", False)
    else:
        lo, hi = np.nanmin(stats.values[SCALE]), np.nanmax(stats.values[SCALE])
        scale_cmap = plt.get_cmap("turbo", int(hi - lo) + 1)   # one colour per exponent
        first_column = (stats.values[SCALE], "log2(scale): the exponent of the power-of-two scale", scale_cmap,
                        BoundaryNorm(np.arange(lo - 0.5, hi + 1), scale_cmap.N), "", False)
    columns = [first_column,
               (stats.values[SATURATED], "saturated fraction: x·scale rounds beyond the format's max", "viridis",
                *fraction_norm(stats.values[SATURATED]), True),
               (stats.values[FLUSHED], "flushed fraction: x ≠ 0 cast to 0", "viridis",
                *fraction_norm(stats.values[FLUSHED]), True)]
    axes = [[fig.add_subplot(grid[i, j]) for j in range(3)] for i in range(len(TENSOR_KEYS))]
    for j, (values, label, cmap, norm, empty, zero_blank) in enumerate(columns):
        for i, (linear, tensor) in enumerate(TENSOR_KEYS):
            ax = axes[i][j]
            mesh = heatmap(ax, x_edges, values[i], cmap, norm, zero_blank)
            layer_ticks(ax, n_layers, stats.fp8_layers, max(1, round(n_layers / 5)))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            ax.tick_params(labelsize=7, labelleft=j == 0, labelbottom=i == len(TENSOR_KEYS) - 1)
            if j == 0:
                ax.set_ylabel(f"{linear} {tensor}\n{stats.formats.get(i, FORMATS[tensor][0])}", rotation=0, ha="right",
                              va="center", fontsize=9)
        axes[-1][j].set_xlabel("step")
        bar = fig.colorbar(mesh, ax=[row[j] for row in axes], location="top", aspect=30, pad=0.01,
                           ticks=MaxNLocator(integer=True, min_n_ticks=1) if j == 0 else None)
        bar.set_label(label + empty, fontsize=10)
    # the chosen tensor's amax against the largest value its scale represents (block scaling: each tile's scale brings
    # the tile's amax to the max, so the amax alone)
    layer, k, why = choice
    linear, tensor = TENSOR_KEYS[k]
    fmt = stats.formats[k]
    amax, saturated = stats.values[AMAX, k, layer], stats.values[SATURATED, k, layer]
    ax = fig.add_subplot(grid[-1, :])
    ax.plot(steps, amax, marker=".", color="tab:blue", label="amax = max |x|")
    hit = saturated > 0
    ax.scatter(steps[hit], amax[hit], color="tab:red", marker="x", s=40, zorder=3, label="a step with saturated values")
    if block:
        room = "the amax (block scaling fits each tile's scale to the tile: no headroom per tensor)"
    else:
        ceiling = FORMAT_MAX[fmt] / 2.0 ** stats.values[SCALE, k, layer]
        ax.plot(steps, ceiling, marker=".", color="tab:green",
                label=f"{fmt} max / scale = {FORMAT_MAX[fmt]:g} / 2^scale_log2: the largest value the scale represents")
        ax.fill_between(steps, amax, ceiling, where=amax <= ceiling, color="tab:green", alpha=0.15, label="headroom")
        ok = np.isfinite(amax) & (amax > 0)
        headroom = np.log2(ceiling[ok] / amax[ok])
        room = "headroom log2(ceiling / amax) " + (f"min {headroom.min():.2f}, median {np.median(headroom):.2f}" if ok.any()
                                                   else "none: no amax above 0")
    ax.set(yscale="log", xlabel="step", ylabel="value", xlim=(x_edges[0], x_edges[-1]),
           title=f"layer {layer} {linear} {tensor} ({fmt}; {why}): {room}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"FP8 state of {os.path.dirname(os.path.abspath(stats.path))}: steps {steps[0]}-{steps[-1]} "
                 f"({len(steps)} recorded), {len(stats.fp8_layers)} of {n_layers} layers FP8\n"
                 "heatmaps: layer (0 on top) x step; white: 0, grey: no rows (layer kept in BF16)")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out}")


PROBE_PANELS = ["per tensor", "block", "block - per tensor"]   # the probe's pictures, from its first three dB columns


def load_probe(path):
    """The probe's CSV: for each (layer, linear, gemm) its SQNR under per-tensor scaling, block scaling, block minus
    per-tensor and block scaling with dY in E4M3 (the block ones nan where train_fp8 left them empty: no tiling)."""
    sqnr = {}   # (layer, linear, gemm) -> (per tensor, block, gain, block E4M3 dY) dB
    for number, f in read_csv(path, PROBE_HEADER, PROBE_SOURCE):
        key = parse_key(path, number, f[0], f[1], f[2], GEMMS)
        if key in sqnr:
            fail(f"{path}, line {number}: a second row for layer {' '.join(map(str, key))}; move the file away")
        db = (float, lambda v: not math.isnan(v), "dB (inf allowed)")
        block = [math.nan if text == "" else parse(path, number, name, text, *db[:2], "dB (inf allowed) or empty")
                 for name, text in zip(PROBE_HEADER.split(",")[4:], f[4:])]
        if (math.isnan(block[0]), math.isnan(block[1]), math.isnan(block[2])).count(True) not in (0, 3):
            fail(f"{path}, line {number}: block_sqnr_db, block_gain_db and block_e4m3_dy_sqnr_db are all filled or all "
                 "empty (no tiling), not some")
        sqnr[key] = (parse(path, number, "sqnr_db", f[3], *db), *block)
    fp8_layers = sorted({key[0] for key in sqnr})
    grid = np.full((len(PROBE_PANELS), layer_count(fp8_layers), len(LINEARS) * len(GEMMS)), np.nan)   # [panel, layer, (linear, gemm)]
    for (layer, linear, gemm), dbs in sqnr.items():
        grid[:, layer, LINEARS.index(linear) * len(GEMMS) + GEMMS.index(gemm)] = dbs[:len(PROBE_PANELS)]
    return SimpleNamespace(path=path, sqnr=sqnr, grid=grid, fp8_layers=fp8_layers)


def plot_probe(probe, out):
    n_layers, n_columns = probe.grid.shape[1:]
    panels = [p for p in range(len(PROBE_PANELS)) if p == 0 or not np.isnan(probe.grid[p]).all()]   # block: where it tiled
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, len(panels) * (0.32 * n_layers + 2.4)), layout="constrained",
                             squeeze=False)
    finite = probe.grid[:2][np.isfinite(probe.grid[:2])]   # both scalings on one colour scale
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    for ax, p in zip(axes[:, 0], panels):
        grid = probe.grid[p]
        if p == 2:   # the gain: blue where block scaling is better, red where worse
            span = max(1.0, np.nanmax(np.abs(np.where(np.isfinite(grid), grid, np.nan)), initial=0.0))
            norm, cmap = Normalize(-span, span), plt.get_cmap("RdBu")
        else:   # red: low SQNR, the worst
            norm, cmap = Normalize(lo, max(hi, lo + 1)), plt.get_cmap("RdYlBu")
        shown = np.clip(grid, norm.vmin, norm.vmax)   # inf: FP8 equals BF16, drawn as the best
        mesh = heatmap(ax, np.arange(n_columns + 1) - 0.5, shown, cmap, norm, False)
        for layer in range(n_layers):
            if layer not in probe.fp8_layers:
                ax.text(-0.4, layer, "kept in BF16: no FP8 GEMM", ha="left", va="center", fontsize=8)
            for c in np.flatnonzero(~np.isnan(grid[layer])):
                r, g, b, _ = cmap(norm(shown[layer, c]))   # white text on dark cells
                ax.text(c, layer, f"{grid[layer, c]:{'+' if p == 2 else ''}.1f}", ha="center", va="center", fontsize=8,
                        color="white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black")
        for c in range(len(GEMMS), n_columns, len(GEMMS)):
            ax.axvline(c - 0.5, color="black", linewidth=1.5)
        ax.set_xticks(range(n_columns), GEMMS * len(LINEARS))
        top = ax.secondary_xaxis("top")
        top.set_xticks([i * len(GEMMS) + 1 for i in range(len(LINEARS))], LINEARS)
        top.tick_params(length=0)
        layer_ticks(ax, n_layers, probe.fp8_layers, 1)
        ax.set(xlabel="GEMM: Y forward output, dX input gradient, dW weight gradient", ylabel="layer")
        fig.colorbar(mesh, ax=ax, label="dB" if p == 2 else "SQNR, dB")
        ax.set_title(["SQNR of FP8 against BF16 under per-tensor scaling, dB (higher is better)",
                      "the same under block scaling (1x128 tiles of X and dY, 128x128 blocks of W; dY in E5M2)",
                      "block minus per-tensor scaling, dB (blue: block scaling loses less)"][p]
                     + (f"\n{probe.path}" if p == 0 else ""))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out}")
    for p in panels[:2]:
        print(f"worst SQNR, {PROBE_PANELS[p]} scaling:")
        rows = [item for item in probe.sqnr.items() if not math.isnan(item[1][p])]
        for (layer, linear, gemm), dbs in sorted(rows, key=lambda item: item[1][p])[:5]:
            print(f"  layer {layer} {linear} {gemm}: {dbs[p]:.2f} dB")
    if len(panels) == 1:
        print("no block scaling columns: the probe's shapes did not tile by 128 (its output says why)")


# ---- the test: synthetic files shaped like train_fp8's

def write_stats(path, n_layers, steps, all_layers=False, saturating=(), cut=False, block=False):
    """fp8_stats.csv of a run: amax drifting up, layer 1 flushing nothing; the tensors of `saturating` ((layer,
    linear, tensor) each) under-scaled and saturating in the second half; cut: the last step stops mid-line; block:
    --scaling block --dy-format e4m3 (no scale_log2, dY in E4M3)."""
    rng = np.random.default_rng(1)
    lines = [STATS_HEADER]
    for j, step in enumerate(steps):
        first_of_step = len(lines)
        for layer in range(n_layers) if all_layers else range(1, n_layers - 1):
            for i, (linear, tensor) in enumerate(TENSOR_KEYS):
                fmt, drift = FORMATS[tensor][-1 if block else 0], 2 * j / len(steps) + 0.1 * rng.standard_normal()
                amax = {"X": 8.0, "W": 0.1, "dY": 1e-4}[tensor] * (1 + layer) * 2 ** drift
                scale_log2 = math.floor(math.log2(FORMAT_MAX[fmt] / amax))
                flushed = 0.0 if layer == 1 else 10 ** (i / 4 - 6 + layer / n_layers + 0.2 * rng.standard_normal())
                saturated = 0.0
                if (layer, linear, tensor) in saturating and j >= len(steps) // 2:
                    scale_log2, saturated = scale_log2 + 1, 10 ** rng.uniform(-6, -3)
                lines.append(f"{step},{layer},{linear},{tensor},{fmt},{amax:.6e},{'' if block else scale_log2},"
                             f"{saturated:.6e},{flushed:.6e}")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:   # cut: a third of the last step's rows, and part of the next
        f.write(text[:text.index(lines[first_of_step + (len(lines) - first_of_step) // 3]) + 10] if cut else text)


def write_probe(path, n_layers, worst, block=True):
    """probe.csv: per-tensor SQNRs around the formats' own, `worst` far below; block scaling 2-4 dB above (its worst
    GEMM's 20 dB), or with block False its columns empty (no tiling)."""
    rng = np.random.default_rng(2)
    with open(path, "w") as f:
        f.write(PROBE_HEADER + "\n")
        for layer in range(1, n_layers - 1):
            for linear in LINEARS:
                for gemm in GEMMS:
                    db = 8.0 if (layer, linear, gemm) == worst else {"Y": 31, "dX": 27, "dW": 24}[gemm] + rng.normal()
                    gain = 12.0 if (layer, linear, gemm) == worst else rng.uniform(2, 4)
                    cells = f"{db + gain:.3f},{gain:.3f},{db + gain + 1:.3f}" if block else ",,"
                    f.write(f"{layer},{linear},{gemm},{db:.3f},{cells}\n")


def run_test():
    checks = 0

    def check(ok, what):
        nonlocal checks
        if not ok:
            sys.exit(f"plot_fp8_stats test FAILED: {what}")
        checks += 1

    def quiet(call):   # call()'s result and what it printed
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            return call(), out.getvalue()

    def refused(call, name, what):   # call() must exit with an error naming `name`
        try:
            quiet(call)
        except SystemExit as e:
            check(str(e.code).startswith("error: ") and name in str(e.code), f"{what}: '{e.code}' does not name {name}")
        else:
            check(False, f"{what} was accepted")

    def picture(path):   # a PNG with a picture in it: many distinct colours
        pixels = (plt.imread(path)[:, :, :3] * 255).astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], np.uint32)
        check(len(np.unique(pixels)) > 500, f"{path} holds hardly a picture")

    with tempfile.TemporaryDirectory() as tmp:
        run, small, csv, probe = (os.path.join(tmp, name) for name in ("run", "small", "bad.csv", "probe.csv"))
        os.mkdir(run), os.mkdir(small)
        write_stats(os.path.join(run, "fp8_stats.csv"), 5, [0, 10, 20, 30, 40], saturating=[(2, "wo", "dY")], cut=True)
        stats, printed = quiet(lambda: load_stats(os.path.join(run, "fp8_stats.csv")))
        check("dropped step 40, whose 12 rows" in printed and "no newline" in printed, f"the cut step: '{printed}'")
        check(list(stats.steps) == [0, 10, 20, 30] and stats.n_layers == 5, "steps 0-30 (40 cut) of 5 layers")
        v = stats.values
        check(np.isnan(v[:, :, [0, 4]]).all() and not np.isnan(v[:, :, 1:4]).any(), "layers 0, 4 no rows, 1-3 full")
        check((v[FLUSHED, :, 1] == 0).all() and (v[FLUSHED, :, 2] > 0).all(), "zeros read as zeros")
        check(default_tensor(stats)[:2] == (2, TENSOR_KEYS.index(("wo", "dY"))), "the default: the saturating tensor")
        check(chosen_tensor("3 wqkv W", stats)[:2] == (3, 1), "--tensor '3 wqkv W'")
        edges = list(cell_edges(np.array([5]))), list(cell_edges(np.array([0, 4, 10])))
        check(edges == ([4.5, 5.5], [-2, 2, 7, 13]), f"cells centred on the steps: {edges}")
        for text in ("4 wqkv W", "9 wqkv W", "3 wqkv"):   # a BF16 layer, no such layer, no tensor
            refused(lambda: chosen_tensor(text, stats), "--tensor", f"--tensor '{text}'")
        quiet(lambda: main([run]))
        picture(os.path.join(run, "fp8_stats.png"))
        write_stats(os.path.join(small, "fp8_stats.csv"), 2, [1, 2, 3], all_layers=True)
        quiet(lambda: main([small, "-o", os.path.join(tmp, "small.png")]))
        stats, _ = quiet(lambda: load_stats(os.path.join(small, "fp8_stats.csv")))
        picture(os.path.join(tmp, "small.png"))
        check(stats.n_layers == 2 and default_tensor(stats)[:2] == (1, TENSOR_KEYS.index(("w_down", "dY"))),
              "2 FP8 layers, nothing saturated: the default is layer 1's w_down dY")
        write_probe(probe, 5, worst=(3, "w_gate_up", "dX"))
        loaded = load_probe(probe)
        check(loaded.sqnr[(3, "w_gate_up", "dX")] == (8.0, 20.0, 12.0, 21.0), "a row's four figures")
        _, printed = quiet(lambda: main(["probe", probe]))
        check(printed.split("worst SQNR, per tensor scaling:\n")[1].startswith("  layer 3 w_gate_up dX: 8.00 dB")
              and printed.split("worst SQNR, block scaling:\n")[1].startswith("  layer 3 w_gate_up dX: 20.00 dB")
              and printed.count(" dB\n") == 10, f"the 5 worst SQNR of each scaling, layer 3 w_gate_up dX first: '{printed}'")
        picture(os.path.join(tmp, "probe.png"))
        write_probe(probe, 5, worst=(2, "wo", "Y"), block=False)
        loaded, printed = quiet(lambda: (load_probe(probe), main(["probe", probe, "-o", os.path.join(tmp, "p.png")]))[0])
        check(np.isnan(loaded.grid[1:]).all() and not np.isnan(loaded.grid[0, 1:4]).any(), "empty block columns read as nan")
        check("block scaling:" not in printed and printed.count(" dB\n") == 5 and "did not tile" in printed,
              f"without block columns: per-tensor's 5 worst and why no block picture: '{printed}'")
        picture(os.path.join(tmp, "p.png"))
        block_run = os.path.join(tmp, "block")
        os.mkdir(block_run)
        write_stats(os.path.join(block_run, "fp8_stats.csv"), 4, [0, 5, 10], block=True)
        stats, _ = quiet(lambda: load_stats(os.path.join(block_run, "fp8_stats.csv")))
        check(np.isnan(stats.values[SCALE]).all() and not np.isnan(stats.values[AMAX, :, 1:3]).any()
              and stats.formats[TENSOR_KEYS.index(("wo", "dY"))] == "E4M3", "a block run: no scales, amaxes, dY in E4M3")
        check(default_tensor(stats)[:2] == (2, TENSOR_KEYS.index(("w_down", "dY"))), "a block run's default tensor")
        quiet(lambda: main([block_run]))
        picture(os.path.join(block_run, "fp8_stats.png"))
        row = "5,1,wqkv,X,E4M3,1.0e+00,8,0.0e+00,1.0e-04"
        for load, header, bad in [(load_stats, STATS_HEADER, [
                (STATS_HEADER.replace("scale_log2", "scale") + "\n" + row, "a wrong header"), ("", "an empty file"),
                (STATS_HEADER, "a header without rows"), (row.replace(",8,", ",8.5,"), "a fractional scale_log2"),
                (row.replace("1.0e+00", "1.0e+00x"), "a non-numeric amax"), (row + ",1", "10 fields"),
                (row.replace("wqkv", "w_up"), "an unknown linear"), (row.replace(",X,", ",dX,"), "an unknown tensor"),
                (row.replace("E4M3", "E5M2"), "X in E5M2"), (row.replace("1.0e-04", "2.0"), "a fraction above 1"),
                ("5,1,wqkv,dY,E5M2,1.0e+00,8,0.0e+00,1.0e-04\n6,1,wqkv,dY,E4M3,1.0e+00,8,0.0e+00,1.0e-04", "dY in two formats"),
                (row + "\n" + row, "a row twice"), (row + "\n" + row.replace("5", "4", 1), "a step going back")]),
                (load_probe, PROBE_HEADER, [("layer,linear,gemm,sqnr_db\n1,wo,dW,23.5", "the header of before the block columns"),
                ("", "an empty file"), ("1,wo,dW,high,,,", "a non-numeric sqnr_db"), ("1,wo,dW,nan,,,", "a nan sqnr_db"),
                ("1,wo,dW,23.5,25,x,26", "a non-numeric block_gain_db"), ("1,wo,dW,23.5,25,1.5,", "one block column empty"),
                ("1,wo,dW,23.5", "4 fields"), ("1,w_o,dW,23.5,,,", "an unknown linear"), ("1,wo,dY,23.5,,,", "an unknown gemm"),
                ("1,wo,dW,23.5,,,\n1,wo,dW,23.5,,,", "a row twice")])]:
            for text, what in bad:
                with open(csv, "w") as f:   # a body without a header gets the right one
                    f.write((text if text.startswith(header[:5]) or not text else header + "\n" + text) + "\n")
                refused(lambda: load(csv), csv, f"{load.__name__} of a file with {what}")
            refused(lambda: load(os.path.join(tmp, "none.csv")), os.path.join(tmp, "none.csv"), "a missing file")
        result = subprocess.run([sys.executable, __file__, "probe", csv], capture_output=True, text=True)
        check(result.returncode != 0 and csv in result.stderr, f"a bad file: exit {result.returncode}, {result.stderr}")
    print(f"plot_fp8_stats test: passed ({checks} checks)")


def main(argv):
    if argv == ["test"] and MISSING:   # make test runs on machines without them too
        print(f"plot_fp8_stats test: SKIP ({MISSING}: pip install matplotlib)")
        return
    if MISSING:
        fail(f"plot_fp8_stats.py needs numpy and matplotlib ({MISSING}): pip install matplotlib")
    if argv == ["test"]:
        return run_test()
    probe = argv[:1] == ["probe"]
    parser = argparse.ArgumentParser(prog="scripts/plot_fp8_stats.py" + " probe" * probe, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", metavar="FILE.csv" if probe else "DIR", help="the probe's CSV" if probe else
                        "a run folder holding fp8_stats.csv")
    parser.add_argument("-o", dest="out", metavar="OUT.png",
                        help="the picture (default: " + ("FILE.png)" if probe else "DIR/fp8_stats.png)"))
    if not probe:
        parser.add_argument("--tensor", metavar='"LAYER LINEAR TENSOR"', help='the amax panel\'s, e.g. "5 w_down dY"')
    args = parser.parse_args(argv[probe:])
    if args.out and not args.out.endswith(".png"):
        fail(f"-o {args.out}: the picture is a PNG; name it OUT.png")
    if probe:
        plot_probe(load_probe(args.input), args.out or os.path.splitext(args.input)[0] + ".png")
        return
    stats = load_stats(os.path.join(args.input, "fp8_stats.csv"))
    choice = chosen_tensor(args.tensor, stats) if args.tensor else default_tensor(stats)
    plot_stats(stats, args.out or os.path.join(args.input, "fp8_stats.png"), choice)


if __name__ == "__main__":
    main(sys.argv[1:])
