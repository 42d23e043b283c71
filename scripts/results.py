#!/usr/bin/env python3
"""The tables of `make results`, and the check that the README quotes them.

    scripts/results.py make RAW_DIR OUT.md   the tables of one results.sh run (RAW_DIR: its programs' outputs, or the
                                             .raw.txt it wrote: the tables made again from a committed measurement)
    scripts/results.py check README.md       every figure of a README paragraph that cites results/NAME.md
                                             (a decimal number, or one ending in k, x or %) is in that file
    scripts/results.py test                  this script's checks on synthetic outputs (host only; make test)

Ours: each train_fp8 run's `summary |` line (the timed steps' mean ms, tokens/s at that mean, model TFLOP/s,
GPU memory in use). PyTorch: bench_torch.py's `result |` lines. A row is the median over the rounds of a
run's figure, with the rounds' min-max; a ratio is the median of the rounds' ratios (round i against round i).
"""
import os
import re
import statistics
import sys
import tempfile

DEFAULT_SECTIONS = ["step", "attention", "kernels", "long", "7b"]   # results.sh without --only
STEP_ROWS = [  # (file prefix, label) of the 1.1B step table, in order
    ("step-fp8", "ours, FP8 recipe"),
    ("step-fp8-delayed", "ours, FP8, delayed scaling (--amax-history 16)"),
    ("step-fp8-all-layers", "ours, FP8 in every layer (--fp8-all-layers)"),
    ("step-bf16", "ours, BF16 build"),
    ("torch-compile", "PyTorch, torch.compile BF16"),
    ("torch-float8-tensorwise", "PyTorch + torchao float8, tensorwise"),
    ("torch-float8-rowwise", "PyTorch + torchao float8, rowwise"),
]
PAIR_ROWS = [  # (label, FP8 prefix, BF16 prefix) of the long-context and 7B table
    ("1.1B, T 8192, B 2", "long-fp8", "long-bf16"),
    ("7B-shaped", "7b-fp8", "7b-bf16"),
]
SUMMARY = re.compile(r"^summary \| .*ms/step mean ([\d.]+) median ([\d.]+) min ([\d.]+) max ([\d.]+) \| tokens/s (\d+) \| "
                     r"model TFLOP/s ([\d.]+) \| MFU \S+ \| GPU memory ([\d.]+) GiB", re.M)
TORCH = re.compile(r"^result \| mode (\S+) \| .*ms/step mean ([\d.]+) median ([\d.]+) min ([\d.]+) max ([\d.]+) \| "
                   r"tokens/s (\d+) \| model TFLOP/s ([\d.]+) \| peak allocated \S+ GiB \| GPU memory ([\d.]+) GiB", re.M)
# a --profile row: phase, ms, %, ranges (not on the idle and span rows), then, since the floors, floor ms, x floor, basis
PROFILE_LINE = re.compile(r"^  (\S.*?)\s+(-?[\d.]+)\s+(-?[\d.]+)%(?:\s+(\d+))?(?:\s+(-|[\d.]+)\s+(-|[\d.]+x)\s+(\S.*))?$")
RATES = re.compile(r"^profile floors at the rates measured now: (.*)$", re.M)
OURS_ATTN = re.compile(r"^(\S.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+) \| (hopper|mma\.sync)(?: \(wgmma\))?\s*\|\s+([\d.]+)\s+([\d.]+) \|"
                       r"\s+([\d.]+)\s+([\d.]+) \|", re.M)
SDPA = re.compile(r"^(\S.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(cudnn|flash|efficient)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+"
                  r"([\d.]+)\s+([\d.]+)", re.M)


def fail(msg):
    sys.exit(f"results.py: {msg}")


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def kilo(x):
    return f"{x / 1000:.1f}k"


def spread(values, fmt):
    """median (min-max), or the one value"""
    med = fmt(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt(min(values))}-{fmt(max(values))})"


def load_runs(raw):
    """{prefix: {round: {ms, tokens, tflops, gib}}} from the raw folder's step, long, 7b and torch logs."""
    runs = {}
    for name in sorted(os.listdir(raw)):
        m = re.fullmatch(r"((?:step|long|7b|block)-[a-z0-9-]+?)-(\d+)\.log", name)
        if m:
            s = SUMMARY.search(read(os.path.join(raw, name)))
            if s:
                runs.setdefault(m.group(1), {})[int(m.group(2))] = {
                    "ms": float(s.group(1)), "tokens": float(s.group(5)), "tflops": float(s.group(6)), "gib": float(s.group(7))}
            continue
        m = re.fullmatch(r"torch-(\d+)\.log", name)
        if m:
            for t in TORCH.finditer(read(os.path.join(raw, name))):
                runs.setdefault("torch-" + t.group(1), {})[int(m.group(1))] = {
                    "ms": float(t.group(2)), "tokens": float(t.group(6)), "tflops": float(t.group(7)), "gib": float(t.group(8))}
    return runs


def ratio(runs, a, b):
    """tokens/s of a over b, round by round (the rounds both have): the formatted spread, or None"""
    rounds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
    if not rounds:
        return None
    return spread([runs[a][r]["tokens"] / runs[b][r]["tokens"] for r in rounds], lambda x: f"{x:.2f}x")


def run_cells(rounds):
    v = list(rounds.values())
    return [str(len(v)), spread([r["ms"] for r in v], lambda x: f"{x:.1f}"), spread([r["tokens"] for r in v], kilo),
            spread([r["tflops"] for r in v], lambda x: f"{x:.0f}"), spread([r["gib"] for r in v], lambda x: f"{x:.1f}")]


def run_rows(runs, specs, baseline, why):
    """The rows of a speed table: each (prefix, label) of specs with its cells and its ratio to baseline round by round,
    or, where it has no runs, "not run" and why(prefix) (None: no reason known)."""
    rows = []
    for prefix, label in specs:
        if prefix in runs:
            r = ratio(runs, prefix, baseline) if prefix != baseline else None
            rows.append([label] + run_cells(runs[prefix]) + [r or "-"])
        else:
            why_not = why(prefix)
            rows.append([label, "0", f"not run{': ' + why_not if why_not else ''}", "-", "-", "-", "-"])
    return rows


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def env_caption(env):
    return (f"One **{env.get('gpu', '?')}** ({env.get('gpu memory', '?')}), driver {env.get('driver', '?')}; CUDA "
            f"{env.get('cuda', '?')}, cuBLASLt {env.get('cublaslt', '?')}; PyTorch {env.get('torch', '?')}, torchao "
            f"{env.get('torchao', '?')}; commit {env.get('commit', '?')}, {env.get('date', '?')}")


def torch_reasons(raw):
    """{prefix: why} for PyTorch modes that printed a failure or a skip instead of a result line."""
    why = {}
    for name in sorted(os.listdir(raw)):
        if re.fullmatch(r"torch-\d+\.log", name):
            for line in read(os.path.join(raw, name)).splitlines():
                m = re.match(r"(compile|float8-\w+): (failed.*|skipped.*)", line)
                if m:
                    why.setdefault("torch-" + m.group(1), m.group(2)[:160])
                elif line.startswith("bench_torch.py ended with status"):
                    why.setdefault("torch-round", line)
    return why


def section_start(title, key, skipped):
    """A section's first lines: its heading, then, where results.sh skipped the section, why (the whole section)."""
    return [f"## {title}", ""] + ([f"Not measured: {skipped[key]}", ""] if key in skipped else [])


def step_section(runs, skipped, reasons):
    lines = section_start("1.1B step", "step", skipped)
    if "step" in skipped:
        return lines
    lines += ["LLaMA 1.1B (TinyLlama's shape: dim 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, vocabulary 32000), "
              "B 8, T 2048, uniformly random tokens. Ours: `train_fp8 --model 1b --batch 8 --seq 2048 --steps 10`, the "
              "summary's mean over steps 3-10 (CUDA-graph replays); PyTorch: `scripts/bench_torch.py`, 10 steps after 3 "
              "warm-up steps, FP32 master weights, BF16 autocast, fused AdamW. ms/step, tokens/s and model TFLOP/s "
              "(6 x matmul parameters + 6 x L x D x T causal attention, a token): median over the rounds (min-max). "
              "GPU memory: in use on the device (the CUDA context and, for PyTorch, its allocator's reserve included).", ""]
    rows = run_rows(runs, STEP_ROWS, "step-bf16",
                    lambda p: reasons.get(p) or (reasons.get("torch-round") if p.startswith("torch") else None))
    lines.append(table(["run", "rounds", "ms / step", "tokens/s", "model TFLOP/s", "GPU memory (GiB)", "vs ours BF16"], rows))
    lines.append("")
    for other in ("torch-compile", "torch-float8-tensorwise", "torch-float8-rowwise"):
        r = ratio(runs, "step-fp8", other)
        if r:
            lines.append(f"- ours FP8 / {dict(STEP_ROWS)[other]}: **{r}** in tokens/s, round by round.")
    lines.append("")
    return lines


def pair_section(runs, skipped, shapes, sections):
    lines = ["## Long context and a 7B shape", ""]
    lines += ["The 1.1B at T 8192 (B 2) and LLaMA-2 7B's dimensions (dim 4096, 32 heads, FFN 11008, vocabulary 32000; "
              "the layers and B in each row), the same random tokens, FP8 build against BF16 build, interleaved; "
              "columns as above.", ""]
    rows = []
    for label, fp8, bf16 in PAIR_ROWS:
        if fp8.split("-")[0] not in sections:
            continue
        for prefix, build in ((fp8, "FP8"), (bf16, "BF16")):
            what = f"{label} ({shapes[prefix]})" if prefix in shapes else label
            if prefix in runs:
                cells = run_cells(runs[prefix])
                rows.append([what, build] + cells + [ratio(runs, fp8, bf16) or "-" if build == "FP8" else ""])
            else:
                why = skipped.get(prefix.split("-")[0], "no summary line (the raw output says why)")
                rows.append([what, build, "0", f"not run: {why}", "-", "-", "-", ""])
    lines.append(table(["shape", "build", "rounds", "ms / step", "tokens/s", "model TFLOP/s", "GPU memory (GiB)", "FP8 / BF16"], rows))
    return lines + [""]


def parse_profile(text):
    """{phase: (ms, floor ms, ms over the floor)} of a run's --profile table (the floor None where the run printed none,
    the ratio None where it printed '-'), with the GPU span's row; None if the run has no table."""
    at = text.find("profile of step")
    if at < 0:
        return None
    phases = {}
    for line in text[at:].splitlines()[2:]:
        m = PROFILE_LINE.match(line)
        if not m:
            break
        floor, x = m.group(5), m.group(6)
        phases[m.group(1)] = (float(m.group(2)), None if floor in (None, "-") else float(floor), None if x in (None, "-") else x)
    return phases


def has_floors(prof):
    return any(floor is not None for _, floor, _ in prof.values())


def profile_rows(a_prof, b_prof, floors):
    """the rows of two --profile tables side by side, with a - b; floors: each build's ms followed by its floor and ms over it"""
    names = list(a_prof) + [n for n in b_prof if n not in a_prof]
    rows = []
    for n in names:
        a, b = a_prof.get(n), b_prof.get(n)
        fmt = lambda x: "-" if x is None else f"{x:.1f}"
        diff = f"{(a[0] if a else 0) - (b[0] if b else 0):+.1f}"
        bold = n.startswith("GPU span")
        cells = [n]
        for run in (a, b):
            cells.append(fmt(run and run[0]))
            if floors:
                cells += [fmt(run and run[1]), (run and run[2]) or "-"]
        cells.append(diff)
        rows.append([f"**{c}**" for c in cells] if bold else cells)
    return rows


def profile_section(raw, runs):
    lines = ["## Where the step goes", ""]
    prof = {}
    for build in ("fp8", "bf16"):
        path = os.path.join(raw, f"step-{build}-1.log")
        prof[build] = parse_profile(read(path)) if os.path.exists(path) else None
    if not prof["fp8"] or not prof["bf16"]:
        return lines + ["Not measured: no --profile table in the first round's runs.", ""]
    floors = has_floors(prof["fp8"]) or has_floors(prof["bf16"])
    lines += ["`--profile 5` in the first round's FP8 and BF16 runs: step 5, run eagerly with CUDA events around each "
              "phase (ms). A kernel that computes a layer's math counts in that layer's row in both builds, also where "
              "it writes FP8 (a cast fused into RMSNorm, SwiGLU or RoPE); the FP8-casts row holds only kernels that do "
              "nothing but quantize. The last column is what the FP8 build spends more (+) or less (-).", ""]
    if floors:
        rates = []
        for build, label in (("fp8", "FP8 build"), ("bf16", "BF16 build")):
            m = RATES.search(read(os.path.join(raw, f"step-{build}-1.log")))
            rates.append(f"{label}: {m.group(1) if m else 'no rates line'}")
        lines += ["Beside each build's time, the phase's floor (ms) and the time over it (x floor): the phase's FLOPs at the "
                  "GEMM rate of their precision (GEMM and attention rows), else the bytes it must read and write (each tensor "
                  "once) at the copy bandwidth, at the rates that the run measured at its start (" + "; ".join(rates) + "). "
                  "The span's floor is the rows' floors summed; '-': no floor (the all-reduces, the input copies).", ""]
    rows = profile_rows(prof["fp8"], prof["bf16"], floors)
    timed = [f"{statistics.median(r['ms'] for r in runs[p].values()):.1f}" if p in runs else "-" for p in ("step-fp8", "step-bf16")]
    blank = ["", ""] if floors else []
    rows.append(["a timed step (CUDA-graph replay; the table above, median)", timed[0]] + blank + [timed[1]] + blank + [""])
    build_cells = lambda b: [f"{b} build"] + (["floor", "x floor"] if floors else [])
    lines.append(table(["phase"] + build_cells("FP8") + build_cells("BF16") + ["FP8 - BF16"], rows))
    return lines + [""]


def attention_section(raw):
    lines = ["## Attention", ""]
    ours_path, sdpa_path = os.path.join(raw, "bench-attention.log"), os.path.join(raw, "sdpa.log")
    if not os.path.exists(ours_path):
        return lines + ["Not measured.", ""]
    ours = {}
    for m in OURS_ATTN.finditer(read(ours_path)):
        ours.setdefault(m.group(1).strip(), {})[m.group(7)] = (float(m.group(9)), float(m.group(11)))
    sdpa = {}
    if os.path.exists(sdpa_path):
        for m in SDPA.finditer(read(sdpa_path)):
            sdpa.setdefault(m.group(1).strip(), {})[m.group(7)] = (float(m.group(10)), float(m.group(12)))
    lines += ["Causal BF16 attention, TFLOP/s forward / backward (forward 2 B H T^2 D FLOPs, the causal half; backward "
              "2.5x that): ours (`./test_fp8 --bench attention`, the Hopper kernels and the portable `mma.sync` ones) "
              "against PyTorch's SDPA (`scripts/bench_sdpa.py`: cuDNN and FlashAttention-2, many calls between two "
              "CUDA events so that Python's dispatch stays outside the timing).", ""]
    rows = []
    fmt = lambda p: "-" if p is None else f"{p[0]:.1f} / {p[1]:.1f}"
    for shape, paths in ours.items():
        h, m, c, f = paths.get("hopper"), paths.get("mma.sync"), sdpa.get(shape, {}).get("cudnn"), sdpa.get(shape, {}).get("flash")
        vs = "-" if not (h and c) else f"{h[0] / c[0]:.2f}x / {h[1] / c[1]:.2f}x"
        hm = "-" if not (h and m) else f"{h[0] / m[0]:.2f}x / {h[1] / m[1]:.2f}x"
        rows.append([shape, fmt(h), fmt(m), fmt(c), fmt(f), vs, hm])
    lines.append(table(["shape", "ours, Hopper", "ours, mma.sync", "cuDNN", "FlashAttention-2", "Hopper / cuDNN",
                        "Hopper / mma.sync"], rows))
    lines += ["", "The whole output, with the FP8 forward's lines (`--fp8-attention`):", "", "```", read(ours_path).strip(), "```", ""]
    return lines


def kernels_section(raw):
    path = os.path.join(raw, "bench-kernels.log")
    lines = ["## GEMMs, casts, optimizer", ""]
    if not os.path.exists(path):
        return lines + ["Not measured.", ""]
    return lines + ["`./test_fp8 --bench gemm cast optimizer`, as it printed:", "", "```", read(path).strip(), "```", ""]


TOK_RUNS = [  # (file name, label) of the tokenizer table, in order
    ("bytes-600", "bytes, 600 steps"), ("4096-600", "4096 pieces, 600 steps"), ("8192-600", "8192 pieces, 600 steps"),
    ("bytes-200", "bytes, 200 steps"), ("4096-200", "4096 pieces, 200 steps"), ("8192-200", "8192 pieces, 200 steps"),
]
TOK_VAL = re.compile(r"^step\s+(\d+) \| val loss ([\d.]+) \| ([\d.]+) bits a byte$", re.M)
TOK_STEP_MS = re.compile(r"^step\s+\d+/\d+ \| loss .*? \| ([\d.]+) ms \|", re.M)


BLOCK_ROWS = [("block-tensor", "per-tensor scaling (the recipe)"), ("block-block", "block scaling (--scaling block)"),
              ("block-block-e4m3", "block scaling, E4M3 gradients (--dy-format e4m3)"),
              ("block-block-dwx", "block scaling, dW's X^T in 128x128 blocks (--block-dw-x blocks)")]


def block_section(runs, raw, skipped):
    lines = section_start("Block scaling", "block", skipped)
    if "block" in skipped:
        return lines
    lines += ["The 1.1B step as above (B 8, T 2048, the FP8 build, the recipe's first and last layers BF16) under "
              "per-tensor current scaling and under block scaling (a scale per 1x128 tile of X and dY, per 128x128 block "
              "of W; the last row: of dW's X^T too), interleaved; the ratio is to per-tensor scaling, round by round.", ""]
    rows = run_rows(runs, BLOCK_ROWS, "block-tensor", lambda p: "no summary line (the raw output says why)")
    lines.append(table(["run", "rounds", "ms / step", "tokens/s", "model TFLOP/s", "GPU memory (GiB)", "vs per-tensor"], rows))
    prof = {}
    for prefix in ("block-tensor", "block-block"):
        path = os.path.join(raw, f"{prefix}-1.log")
        prof[prefix] = parse_profile(read(path)) if os.path.exists(path) else None
    if prof["block-tensor"] and prof["block-block"]:
        lines += ["", "`--profile 5` of the first round's per-tensor and block runs (ms; the last column block minus per-tensor):", ""]
        lines.append(table(["phase", "per-tensor", "block", "block - per-tensor"],
                           [[r[0], r[2], r[1], r[3]] for r in profile_rows(prof["block-block"], prof["block-tensor"], False)]))
    bench = os.path.join(raw, "bench-block.log")
    if os.path.exists(bench):
        lines += ["", "`./test_fp8 --bench block`, as it printed:", "", "```", read(bench).strip(), "```"]
    return lines + [""]


def tokenizer_section(raw, skipped):
    lines = section_start("Tokenizers", "tokenizer", skipped)
    if "tokenizer" in skipped:
        return lines
    lines += ["The default run (d12: dim 768, 12 layers; 32 x 512 tokens a step, peak LR 6e-4, warm-up a tenth of the "
              "steps, FP8 recipe) on the King James Bible (`make data`): as bytes, and as the tokens of a SentencePiece BPE "
              "tokenizer of 4096 or 8192 pieces trained on it (`./train_fp8 prepare data/kjv.txt data/kjvN --vocab N`). "
              "Validation on the whole validation split (the same text for all three) every 100 steps, in bits a byte "
              "(nats a token / ln 2 / the bytes a validation token stands for). Training time: the sum of the steps' "
              "times (evaluation and sampling left out).", ""]
    rows, samples = [], []
    for name, label in TOK_RUNS:
        path = os.path.join(raw, f"tok-{name}.log")
        if not os.path.exists(path):
            continue
        text = read(path)
        summ, vals = SUMMARY.search(text), TOK_VAL.findall(text)
        bpt = re.search(r"^evaluation: ([\d.]+) bytes a token", text, re.M)
        vocab = re.search(r"^data: .*?, vocab (\d+)", text, re.M)
        if not (summ and vals and bpt and vocab):
            rows.append([label, "-", "-", "-", f"failed: {text.strip().splitlines()[-1][:120] if text.strip() else 'no output'}", "-", "-", "-"])
            continue
        curve = [(int(st), float(b)) for st, _, b in vals if int(st) > 0]
        best = min(curve, key=lambda c: c[1])
        train_s = sum(float(ms) for ms in TOK_STEP_MS.findall(text)) / 1000
        rows.append([label, vocab.group(1), f"{float(bpt.group(1)):.3f}", f"{train_s:.1f}", ", ".join(f"{b:.3f}" for _, b in curve),
                     f"{best[1]:.3f} ({best[0]})", f"{curve[-1][1]:.3f}", kilo(float(summ.group(5)))])
        at = text.rfind("---- sample at step")
        if at >= 0:
            head, _, body = text[at:].partition("\n")
            body = body.split("\n-------------------------")[0]
            samples += [f"{label}, {head.strip('- ')}:", "", "```", body[:400].rstrip(), "```", ""]
    lines.append(table(["run", "vocabulary", "bytes a token", "training (s)", "val bits a byte, every 100 steps",
                        "best (step)", "final", "tokens/s"], rows))
    return lines + ["", "The last sample of each run (train_fp8's own, from \"In the beginning\", temperature 0.8):", ""] + samples


def study_section(raw, name, title, command):
    path = os.path.join(raw, f"{name}-table.md")
    lines = [f"## {title}", ""]
    if not os.path.exists(path):
        log = os.path.join(raw, f"{name}.log")
        why = read(log).strip().splitlines()[-1] if os.path.exists(log) and read(log).strip() else "no table"
        return lines + [f"Not measured: {why}", ""]
    return lines + [f"`{command}`, its table as it printed it:", "", read(path).strip(), ""]


def doctor_section(raw, skipped, name):
    lines = section_start("The FP8 doctor and the probe", "doctor", skipped)
    if "doctor" in skipped:
        return lines
    train, probe = os.path.join(raw, "doctor-train.log"), os.path.join(raw, "doctor-probe.log")
    if not os.path.exists(train):
        return lines + ["Not measured: no doctor-train.log", ""]
    log = read(train)
    doctor = [l for l in log.splitlines() if re.match(r"step +\d+ \| fp8", l)]
    lines += [f"`{log.splitlines()[0]}`: a 1.1B run in the 1B study's setup, drawn by "
              f"`scripts/plot_fp8_stats.py` into `{name}-fp8_stats.png`; its first and last doctor lines and its last "
              f"warning if any:", "", "```"]
    warnings = [l for l in doctor if "warning" in l]
    stats = [l for l in doctor if "warning" not in l]
    lines += (stats[:1] + stats[-1:] if stats else ["(no doctor line: the raw output says why)"]) + warnings[-1:]
    lines += ["```", ""]
    if os.path.exists(probe):
        lines += [f"`./train_fp8 probe` on the run's last checkpoint (one validation batch of 8 x 2048), drawn into "
                  f"`{name}-probe.png`, as it printed:", "", "```", read(probe).strip(), "```", ""]
    plots = os.path.join(raw, "doctor-plots.log")
    if os.path.exists(plots) and "no pictures" in read(plots):
        lines += [read(plots).strip(), ""]
    return lines


def unpack_raw(raw_txt, into):
    """A results file's .raw.txt (results.sh: each program's output after a line `==== NAME`) back into the folder
    of files it was made from, so that the tables can be made again from what was measured."""
    name = None
    for line in read(raw_txt).splitlines(keepends=True):
        m = re.fullmatch(r"==== ([\w.-]+)\n?", line)
        if m:
            name = m.group(1)
            open(os.path.join(into, name), "w").close()
        elif name is None:
            fail(f"{raw_txt} does not start with a '==== NAME' line: not a results.sh .raw.txt")
        else:
            with open(os.path.join(into, name), "a") as f:
                f.write(line)


def make(raw, out):
    if os.path.isfile(raw):   # a committed .raw.txt: its tables made again
        with tempfile.TemporaryDirectory() as tmp:
            unpack_raw(raw, tmp)
            return make(tmp, out)
    env = {}
    env_path = os.path.join(raw, "env.txt")
    if not os.path.exists(env_path):
        fail(f"{env_path} is missing: RAW_DIR must be a results.sh run's folder")
    for line in read(env_path).splitlines():
        k, _, v = line.partition(": ")
        env[k] = v
    skipped = {}
    for name in os.listdir(raw):
        m = re.fullmatch(r"skipped-(\w+)\.log", name)
        if m:
            skipped[m.group(1)] = read(os.path.join(raw, name)).strip()
    runs = load_runs(raw)
    shapes = {}
    for prefix in ("7b-fp8", "7b-bf16"):   # the 7B rows' layers and batch, from their command lines
        first = os.path.join(raw, f"{prefix}-1.log")
        if prefix in runs and os.path.exists(first):
            cmd = read(first).splitlines()[0]
            lm, bm = re.search(r"--layers (\d+)", cmd), re.search(r"--batch (\d+)", cmd)
            if lm and bm:
                shapes[prefix] = f"{lm.group(1)} layers, B {bm.group(1)}"
    name = os.path.basename(out)
    sections = env.get("sections", ",".join(DEFAULT_SECTIONS)).split(",")
    rounds = (f" Rounds: {env.get('reps', '?')}, each row's runs interleaved with the others'."
              if {"step", "long", "7b", "block"} & set(sections) else "")
    command = ("`make results` (scripts/results.sh)" if sections == DEFAULT_SECTIONS else
               f"`scripts/results.sh --only {','.join(sections)}`")
    lines = [f"# Results: {env.get('gpu', '?')}", "", env_caption(env) + ".", "",
             f"{command} measured every table here in one run and wrote this file; "
             f"the programs' whole output is in `{name[:-3]}.raw.txt` beside it.{rounds}", ""]
    if "torch-missing" in " ".join(os.listdir(raw)):
        lines += [read(os.path.join(raw, "torch-missing.log")).strip(), ""]
    if "step" in sections:
        lines += step_section(runs, skipped, torch_reasons(raw)) + profile_section(raw, runs)
    if "long" in sections or "7b" in sections:
        lines += pair_section(runs, skipped, shapes, sections)
    if "attention" in sections:
        lines += attention_section(raw)
    if "kernels" in sections:
        lines += kernels_section(raw)
    if "tokenizer" in sections:
        lines += tokenizer_section(raw, skipped)
    if "doctor" in sections:
        lines += doctor_section(raw, skipped, name[:-3])
    if "block" in sections:
        lines += block_section(runs, raw, skipped)
    if "lab" in sections:
        lines += study_section(raw, "lab", "Recipe lab", "scripts/study.sh")
    if "study1b" in sections:
        lines += study_section(raw, "study1b", "Quality per hour at 1.1B",
                               "scripts/study.sh --preset 1b --seeds 2 --only bf16,fp8`, then `--seeds 1 --only "
                               "bf16-linears,m-fp32,fp8-all-layers")
    with open(out, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"results.py: wrote {out}")


FIGURE = re.compile(r"(?<![\w.])[+-]?\d[\d,]*(?:\.\d+[kx%]?|[kx%])(?![\w])")


def check(readme):
    """Every figure of a README paragraph that cites results/NAME.md appears in that file, and the headline's results
    paragraph (it starts with **Results**) cites one; returns the problems and the number of figures checked."""
    text = read(readme)
    base = os.path.dirname(os.path.abspath(readme))
    problems, checked, previous = [], 0, []
    for para in re.split(r"\n\s*\n", text):
        cited = re.findall(r"results/[\w.-]+\.md", para)
        if para.startswith("|") and not cited:   # a table answers to the file its caption, just above, cites
            cited = previous
        previous = cited
        if para.startswith("**Results**") and not cited:
            problems.append(f"{readme}: the headline's results paragraph cites no results/NAME.md file")
        if not cited:
            continue
        sources = []
        for c in dict.fromkeys(cited):
            path = os.path.join(base, c)
            if not os.path.exists(path):
                problems.append(f"{readme} cites {c}, which does not exist")
                continue
            sources.append(read(path))
        if not sources:
            continue
        for fig in FIGURE.findall(re.sub(r"results/[\w.-]+\.md|\]\([^)]*\)", "", para)):
            checked += 1
            bare = fig.lstrip("+")
            if not any(re.search(r"(?<![\w.])" + re.escape(bare) + r"(?![\w])", s) for s in sources):
                problems.append(f"{readme}: the figure {fig} is in no results file its paragraph cites ({', '.join(dict.fromkeys(cited))}): "
                                f"\"{' '.join(para.split())[:100]}...\"")
    return problems, checked


# A profiled run's lines, as train_fp8 prints them and test_fp8's train_profile_table_format pins them.
PROFILE_RATES = ("profile floors at the rates measured now: GEMM 8192^3 FP8 (E4M3, fast accumulation) 1500.0 TFLOP/s, BF16 800.0 "
                 "TFLOP/s; copy 3000 GB/s (1 GiB device to device, read + written)")
PROFILE_HEADER = "  phase                                             ms       %  ranges  floor ms  x floor  floor basis"
PROFILE_ROWS = [
    "  forward GEMMs (decoder linears)               30.000   75.0%      88    15.000    2.00x  15.00 TFLOP at 1500 TFLOP/s (FP8) + "
    "4.00 TFLOP at 800 TFLOP/s (BF16)",
    "  RMSNorm (+ residual add, + fused cast)         5.000   12.5%     130     2.000    2.50x  6.00 GB at 3.00 TB/s",
    "  tensor-parallel all-reduces                    1.000    2.5%      88         -        -  not modeled (NCCL's links)",
    "  weight re-quantization (W8, W8^T)              3.000    7.5%       1     0.000        -  no work",
    "  idle (GPU span - all ranges)                   1.000    2.5%",
    "  GPU span of the step                          40.000  100.0%            17.000    2.35x  the floors above, summed",
]
# a row with current scaling's amax reads beside its floor (test_fp8's train_profile_table_format pins it too)
PROFILE_REREAD_ROW = ("  SwiGLU (+ fused cast)                          6.000  100.0%      44     2.000    3.00x  6.00 GB at 3.00 TB/s; + "
                      "1.000 ms of current scaling's amax reads: 2.00x both")


def self_test():
    failures, checks = [], []

    def expect(cond, what):
        checks.append(what)
        if not cond:
            failures.append(what)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw")
        os.mkdir(raw)
        open(os.path.join(raw, "env.txt"), "w").write("gpu: NVIDIA Test GPU\ncommit: abc1234\nreps: 2\ndate: 2026-01-01\n")
        summ = ("summary | 8 of 10 steps timed (left out: 1 eager (the first, --profile, --fp8-stats), 1 capturing CUDA graphs) | "
                "ms/step mean {ms} median {ms} min {ms} max {ms} | tokens/s {tok} | model TFLOP/s {tf} | MFU 30.0% | GPU memory {gib} GiB\n")
        for r, (f8, b16) in enumerate([(100.0, 125.0), (102.0, 124.0)], 1):
            for prefix, ms in (("step-fp8", f8), ("step-bf16", b16), ("long-fp8", f8), ("long-bf16", b16)):
                text = "cmd\n" + summ.format(ms=ms, tok=round(16384 / ms * 1000), tf=600.0, gib=35.5)
                if r == 1 and prefix == "step-fp8":   # the table with floors, as test_fp8's train_profile_table_format pins it
                    text += (PROFILE_RATES + "\nprofile of step 5 (test)\n" + PROFILE_HEADER + "\n" + "\n".join(PROFILE_ROWS) + "\n"
                             "  outside GEMMs and attention: 9.000 ms busy, 10.000 ms with idle\n")
                elif r == 1 and prefix == "step-bf16":   # one from before the floors
                    text += ("profile of step 5 (PRECISION=X): 1 ms\n  phase  ms  %  ranges\n"
                             f"  forward GEMMs (decoder linears)   {ms / 2:.3f}   50.0%   88\n"
                             f"  GPU span of the step   {ms:.3f}  100.0%\n  outside GEMMs and attention: 1 ms\n")
                open(os.path.join(raw, f"{prefix}-{r}.log"), "w").write(text)
            open(os.path.join(raw, f"torch-{r}.log"), "w").write(
                "result | mode compile | B 8 T 2048 layers 22 | ms/step mean 200.00 median 200.00 min 199.00 max 201.00 | "
                "tokens/s 81920 | model TFLOP/s 500.0 | peak allocated 40.0 GiB | GPU memory 45.0 GiB\n"
                "float8-rowwise: failed at B 8, T 2048: OutOfMemoryError: CUDA out of memory\n")
        open(os.path.join(raw, "skipped-7b.log"), "w").write("skipped: 10 s of the --budget left")
        open(os.path.join(raw, "bench-attention.log"), "w").write(
            "1b          8  2048  32   4  64 | mma.sync       |    0.699    196.5 |    2.483    138.4 |    25%    18%\n"
            "1b          8  2048  32   4  64 | hopper (wgmma) |    0.320    429.6 |    1.064    322.9 |    54%    41%\n")
        open(os.path.join(raw, "sdpa.log"), "w").write(
            "1b           8  2048  32   4   64  cudnn     native      0.341       403.1     1.131       303.8\n")
        out = os.path.join(tmp, "Test-GPU.md")
        make(raw, out)
        md = read(out)
        expect("| ours, FP8 recipe | 2 | 101.0 (100.0-102.0) | 162.2k (160.6k-163.8k) | 600 (600-600) | 35.5 (35.5-35.5) | "
               "1.23x (1.22x-1.25x) |" in md, "the FP8 row: medians, min-max and its ratio to BF16 round by round")
        expect("| ours, BF16 build | 2 | 124.5 (124.0-125.0) | 131.6k (131.1k-132.1k) | 600 (600-600) | 35.5 (35.5-35.5) | - |" in md,
               "the baseline row, without a ratio to itself")
        expect("ours FP8 / PyTorch, torch.compile BF16: **1.98x (1.96x-2.00x)**" in md, "the ratio to torch.compile")
        expect("| ours, FP8 in every layer (--fp8-all-layers) | 0 | not run |" in md, "a row without runs says so")
        expect(parse_profile("profile of step 5\n" + PROFILE_HEADER + "\n" + PROFILE_REREAD_ROW + "\n") ==
               {"SwiGLU (+ fused cast)": (6.0, 2.0, "3.00x")}, "a profile row with the amax reads parses")
        expect("| PyTorch + torchao float8, rowwise | 0 | not run: failed at B 8, T 2048: OutOfMemoryError: CUDA out of memory |"
               in md, "a PyTorch mode that failed says why")
        expect("| phase | FP8 build | floor | x floor | BF16 build | floor | x floor | FP8 - BF16 |" in md and
               "| forward GEMMs (decoder linears) | 30.0 | 15.0 | 2.00x | 62.5 | - | - | -32.5 |" in md,
               "the profile's phase row: each build's ms, floor and ratio (none in the run from before the floors), the difference")
        expect("| tensor-parallel all-reduces | 1.0 | - | - | - | - | - | +1.0 |" in md and
               "| weight re-quantization (W8, W8^T) | 3.0 | 0.0 | - | - | - | - | +3.0 |" in md and
               "| **GPU span of the step** | **40.0** | **17.0** | **2.35x** | **125.0** | **-** | **-** | **-85.0** |" in md,
               "a phase without a floor, one without work, the span beside the floors' sum")
        expect("(FP8 build: GEMM 8192^3 FP8 (E4M3, fast accumulation) 1500.0 TFLOP/s, BF16 800.0 TFLOP/s; copy 3000 GB/s (1 GiB "
               "device to device, read + written); BF16 build: no rates line)" in md, "the rates each run measured, quoted")
        expect("not run: skipped: 10 s of the --budget left" in md, "a skipped section says why")
        expect("commit abc1234" in md, "the caption names the commit")
        expect("| 1b | 429.6 / 322.9 | 196.5 / 138.4 | 403.1 / 303.8 | - | 1.07x / 1.06x | 2.19x / 2.33x |" in md,
               "the attention row: both kernel paths, cuDNN, no FlashAttention line, the ratios")
        # a tokenizer-only run: its section alone, the bits a byte over the run, the best and the last sample
        tok_raw = os.path.join(tmp, "tok")
        os.mkdir(tok_raw)
        open(os.path.join(tok_raw, "env.txt"), "w").write("gpu: NVIDIA Test GPU\ncommit: abc1234\nsections: tokenizer\n")
        step = "step {n:5d}/600 | loss 1.0 | lr 1e-4 | grad norm 0.5 | {ms} ms | 700000 tok/s | 400.0 TFLOP/s | MFU 20.0%\n"
        open(os.path.join(tok_raw, "tok-8192-600.log"), "w").write(
            "data: data/kjv8192_train.bin, 1058257 tokens, vocab 8192 (header); validation data/kjv8192_val.bin, 117673 tokens\n"
            "evaluation: 3.7317 bytes a token in the 7 batches evaluated: bits per byte = val loss / ln 2 / 3.7317\n"
            "step     0 | val loss 9.1604 | 3.541503 bits a byte\n" + step.format(n=1, ms="500.0") + step.format(n=2, ms="22.5") +
            "step   100 | val loss 4.7844 | 1.849696 bits a byte\nstep   200 | val loss 4.4392 | 1.716250 bits a byte\n"
            "---- sample at step 600 ----\nIn the beginning.\nNum14:5 And the LORD spake unto Moses, saying,\n-------------------------\n"
            "step   600 | val loss 5.7199 | 2.211364 bits a byte\n" + summ.format(ms=23.59, tok=694420, tf=399.8, gib=7.4))
        tok_out = os.path.join(tmp, "Test-GPU-tokenizer.md")
        make(tok_raw, tok_out)
        md = read(tok_out)
        expect("| 8192 pieces, 600 steps | 8192 | 3.732 | 0.5 | 1.850, 1.716, 2.211 | 1.716 (200) | 2.211 | 694.4k |" in md,
               f"the tokenizer row: vocabulary, bytes a token, training time, the curve, best and final")
        expect("Num14:5 And the LORD spake unto Moses, saying," in md and "## 1.1B step" not in md and "## Attention" not in md,
               "a tokenizer-only file holds that section and the last sample, and no other section")
        # a block-scaling run: its rows against per-tensor scaling round by round, the two profiles side by side
        blk_raw = os.path.join(tmp, "blk")
        os.mkdir(blk_raw)
        open(os.path.join(blk_raw, "env.txt"), "w").write("gpu: NVIDIA Test GPU\ncommit: abc1234\nreps: 2\nsections: block\n")
        for r, (t, b) in enumerate([(100.0, 90.0), (104.0, 91.0)], 1):
            for prefix, ms in (("block-tensor", t), ("block-block", b)):
                text = "cmd\n" + summ.format(ms=ms, tok=round(16384 / ms * 1000), tf=600.0, gib=30.0)
                if r == 1:
                    text += ("profile of step 5 (PRECISION=FP8): 1 ms\n  phase  ms  %  ranges\n"
                             f"  FP8 casts alone, amax, scales   {ms / 10:.3f}   10.0%   88\n  GPU span of the step   {ms:.3f}  100.0%\n\n")
                open(os.path.join(blk_raw, f"{prefix}-{r}.log"), "w").write(text)
        make(blk_raw, os.path.join(tmp, "blk.md"))
        md_blk = read(os.path.join(tmp, "blk.md"))
        expect("| block scaling (--scaling block) | 2 | 90.5 (90.0-91.0) | 181.0k (180.0k-182.0k) | 600 (600-600) | 30.0 (30.0-30.0) | "
               "1.13x (1.11x-1.14x) |" in md_blk, "the block row: its ratio to per-tensor scaling round by round")
        expect("| FP8 casts alone, amax, scales | 10.0 | 9.0 | -1.0 |" in md_blk and "not run" in md_blk,
               f"the profiles side by side (per-tensor, block, block - per-tensor); the E4M3 row not run")
        # a doctor run: the command, the first and last doctor lines, the last warning, the summary, the probe as printed
        doc_raw = os.path.join(tmp, "doc")
        os.mkdir(doc_raw)
        open(os.path.join(doc_raw, "env.txt"), "w").write("gpu: NVIDIA Test GPU\ncommit: abc1234\nsections: doctor\n")
        open(os.path.join(doc_raw, "doctor-train.log"), "w").write(
            "./train_fp8 --model 1b --fp8-stats 5\nstep     5 | fp8: first\nstep    10 | fp8: middle\n"
            "step    10 | fp8 warning: layer 3 w_down dY flushed\nstep    15 | fp8: last\n" +
            summ.format(ms=180.0, tok=91022, tf=615.3, gib=35.5))
        open(os.path.join(doc_raw, "doctor-probe.log"), "w").write("probe: a table\nlowest: layer 1 wqkv dX 24.10 dB\n")
        make(doc_raw, os.path.join(tmp, "Test-GPU-doctor.md"))
        md_doc = read(os.path.join(tmp, "Test-GPU-doctor.md"))
        expect("`./train_fp8 --model 1b --fp8-stats 5`" in md_doc and "step     5 | fp8: first\nstep    15 | fp8: last\nstep    10 | "
               "fp8 warning" in md_doc and "middle" not in md_doc and "lowest: layer 1 wqkv dX 24.10 dB" in md_doc and
               "Test-GPU-doctor-probe.png" in md_doc, "the doctor section: command, first and last lines, last warning, probe")
        # the tables made again from the .raw.txt that results.sh writes (each file after a line ==== NAME)
        with open(os.path.join(tmp, "tok.raw.txt"), "w") as f:
            for name in sorted(os.listdir(tok_raw)):
                f.write(f"==== {name}\n" + read(os.path.join(tok_raw, name)))
        again = os.path.join(tmp, "again.md")
        make(os.path.join(tmp, "tok.raw.txt"), again)
        expect(read(again).replace("again.raw.txt", "X") == md.replace("Test-GPU-tokenizer.raw.txt", "X"),
               "the tables made from the .raw.txt equal those made from the folder")
        # the README check: figures present pass, a figure missing fails, a missing file fails
        os.mkdir(os.path.join(tmp, "results"))
        os.rename(out, os.path.join(tmp, "results", "Test-GPU.md"))
        readme = os.path.join(tmp, "README.md")
        open(readme, "w").write("# x\n\nFP8 **1.23x (1.22x-1.25x)** our BF16, 162.2k tokens/s (results/Test-GPU.md).\n\n"
                                "Unrelated 9.99x.\n")
        problems, n = check(readme)
        expect(not problems and n == 4, f"figures in the file pass ({n} checked, {problems})")
        open(readme, "w").write("The table (results/Test-GPU.md):\n\n| run | x |\n| --- | --- |\n| fp8 | 1.23x |\n| bf16 | 7.77x |\n")
        problems, n = check(readme)
        expect(len(problems) == 1 and "7.77x" in problems[0] and n == 2, f"a table answers to its caption's file: {problems}")
        open(readme, "w").write("FP8 1.24x our BF16 ([Test GPU](results/Test-GPU.md)), 162.2k.\n")
        problems, n = check(readme)
        expect(len(problems) == 1 and "1.24x" in problems[0], f"a figure not in the file fails: {problems}")
        open(readme, "w").write("**Results**: FP8 1.23x our BF16.\n")
        problems, n = check(readme)
        expect(len(problems) == 1 and "cites no results" in problems[0], f"a headline without its source fails: {problems}")
        open(readme, "w").write("FP8 1.23x (results/Other.md).\n")
        problems, n = check(readme)
        expect(len(problems) == 1 and "does not exist" in problems[0], f"a cited file that is missing fails: {problems}")
    for f in failures:
        print(f"results.py test FAILED: {f}")
    print(f"results.py test: {'passed' if not failures else 'FAILED'} ({len(checks) - len(failures)} of {len(checks)} checks)")
    return 1 if failures else 0


def main():
    args = sys.argv[1:]
    if args[:1] == ["make"] and len(args) == 3:
        make(args[1], args[2])
    elif args[:1] == ["check"] and len(args) == 2:
        problems, n = check(args[1])
        for p in problems:
            print(p)
        if problems:
            sys.exit(1)
        print(f"results.py check: {n} figures of {args[1]} found in the results files they cite")
    elif args == ["test"]:
        sys.exit(self_test())
    else:
        fail("usage: scripts/results.py make RAW_DIR OUT.md | check README.md | test")


if __name__ == "__main__":
    main()
