"""Time PyTorch's scaled_dot_product_attention backends on this GPU, for the shapes of our
`./test_fp8 --bench attention`, so the README can compare our attention kernels with ratios measured on the same GPU.

Causal BF16, forward and backward timed apart, per SDPA backend (cudnn and flash by default; "efficient" if
asked). FLOPs as ours: forward 2 B H T^2 D (causal halves 4 B H T^2 D), backward 2.5x forward. GQA shapes
(KV < H) use enable_gqa=True where the backend takes it (gqa "native"), else k and v expanded to H heads once,
before timing (gqa "expanded"), so either way only the attention kernels are timed. "-": no GQA.

Run: python3 scripts/bench_sdpa.py [--backends cudnn,flash] [--reps N]   (PyTorch with CUDA and a GPU)
"""
import argparse
import statistics
import sys
import warnings

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError as err:
    sys.exit(f"bench_sdpa.py needs PyTorch (with torch.nn.attention): {err}")

SHAPES = [  # name, B, T, H, KV, D: the shapes of ./test_fp8 --bench attention
    ("1b", 8, 2048, 32, 4, 64),
    ("d128", 8, 2048, 16, 16, 128),
    ("d128 long", 4, 4096, 16, 16, 128),
    ("d12", 32, 512, 12, 12, 64),
]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
WARMUP = 3
ROW = "{:<10} {:>3} {:>5} {:>3} {:>3} {:>4}  {:<9} {:<8} {:>8} {:>11} {:>8} {:>11}"


def attention(q, k, v, gqa):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def warm_up(q, k, v, gqa, dout):
    """Run WARMUP forward + backward steps; return None if the backend ran them, else a one-line reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(WARMUP):
                out = attention(q, k, v, gqa)
                torch.autograd.grad(out, (q, k, v), dout)
            torch.cuda.synchronize()
            return None
        except RuntimeError as err:
            # SDPA gives its reasons in warnings; the error itself only says "No available kernel". Drop the
            # per-backend headers and the "runtime disabled" lines, which only restate the sdpa_kernel choice.
            reasons = [str(w.message) for w in caught]
            reasons = [r for r in reasons if not r.endswith("because:") and "runtime disabled" not in r]
            return "; ".join(" ".join(r.split()) for r in reasons + [str(err)])


def mean_ms(call, reps, rounds=3):
    """The median over `rounds` of the mean milliseconds of `reps` back-to-back calls between two CUDA events.
    A GPU sleep queued first keeps the GPU busy while Python dispatches the calls, so the GPU runs them back to
    back and the host's dispatch time is not inside the window (a single call timed alone would count it)."""
    times = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU clock cycles: ahead of the dispatch of every call
        start.record()
        for _ in range(reps):
            call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def time_forward(q, k, v, gqa, reps):
    return mean_ms(lambda: attention(q, k, v, gqa), reps)  # grad enabled: the forward as training runs it


def time_backward(q, k, v, gqa, dout, reps):
    out = attention(q, k, v, gqa)  # one forward; its graph is kept, so each call runs the backward alone
    return mean_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), reps)


def run_backend(q, configs, dout, reps):
    """Time the first config the active backend runs: (gqa label, fwd ms, bwd ms, [(label, reason) of the
    configs it refused]); the label is None if it ran none."""
    refusals = []
    for label, k, v, gqa in configs:
        reason = warm_up(q, k, v, gqa, dout)
        if reason is None:
            return label, time_forward(q, k, v, gqa, reps), time_backward(q, k, v, gqa, dout, reps), refusals
        refusals.append((label, reason))
    return None, None, None, refusals


def bench_shape(shape, backends, reps):
    name, B, T, H, KV, D = shape
    q, k, v, dout = (torch.randn(B, heads, T, D, device="cuda", dtype=torch.bfloat16) for heads in (H, KV, KV, H))
    for x in (q, k, v):
        x.requires_grad_()
    configs = [("-", k, v, False)]
    if KV < H:
        # Fallback leaves already expanded to H heads, so the repeat stays outside every timed region.
        k_full = k.detach().repeat_interleave(H // KV, dim=1).requires_grad_()
        v_full = v.detach().repeat_interleave(H // KV, dim=1).requires_grad_()
        configs = [("native", k, v, True), ("expanded", k_full, v_full, False)]
    fwd_flops = 2 * B * H * T * T * D
    for backend in backends:
        with sdpa_kernel(BACKENDS[backend]):
            label, fwd_ms, bwd_ms, refusals = run_backend(q, configs, dout, reps)
        shape_cols = (name, B, T, H, KV, D, backend)
        if label is None:
            reasons = "; ".join(f"{gqa}: {reason}" if KV < H else reason for gqa, reason in refusals)
            print(ROW.format(*shape_cols, "n/a", "n/a", "n/a", "n/a", "n/a") + "  " + reasons, flush=True)
        else:
            note = f"  (enable_gqa refused: {refusals[0][1]})" if refusals else ""
            print(ROW.format(*shape_cols, label, f"{fwd_ms:.3f}", f"{fwd_flops / fwd_ms / 1e9:.1f}",
                             f"{bwd_ms:.3f}", f"{2.5 * fwd_flops / bwd_ms / 1e9:.1f}") + note, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="cudnn,flash", help="comma list of: " + ",".join(BACKENDS))
    parser.add_argument("--reps", type=int, default=20, help="back-to-back calls per timing (their mean; median of 3)")
    args = parser.parse_args()
    backends = args.backends.split(",")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("bench_sdpa.py: no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False)")

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"GPU {torch.cuda.get_device_name()}", flush=True)
    print(f"causal BF16, scale 1/sqrt(D); TFLOP/s: forward 2 B H T^2 D per second, backward 2.5x that; "
          f"median of 3 timings, each the mean of {args.reps} back-to-back calls between two CUDA events after {WARMUP} "
          f"warm-up steps (Python's dispatch overlaps the GPU's work)", flush=True)
    print(ROW.format("shape", "B", "T", "H", "KV", "D", "backend", "gqa",
                     "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s"), flush=True)
    for shape in SHAPES:
        bench_shape(shape, backends, args.reps)


if __name__ == "__main__":
    main()
