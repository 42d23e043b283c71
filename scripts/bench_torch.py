"""Time PyTorch training steps on the model and batch of our `1b` speed table, so the README can compare
train_fp8 with PyTorch by ratios measured on the same GPU.

The model is a plain PyTorch LLaMA-2 of the `1b` preset's shape (TinyLlama-1.1B: dim 2048, 22 layers, 32 query
heads, 4 KV heads, FFN 5632, vocabulary 32000, no biases, RMSNorm eps 1e-5, RoPE theta 10000, untied lm_head).
One training step: forward with cross-entropy on B x T uniformly random tokens, backward, gradient-norm clip
at 1.0, fused AdamW (betas 0.9 / 0.95, weight decay 0.1 on 2-D tensors), FP32 parameters under BF16 autocast
(as our BF16 build: FP32 master weights, BF16 GEMMs). Attention is F.scaled_dot_product_attention, causal,
with enable_gqa=True. Modes:
  eager    the model as written, BF16 autocast
  compile  torch.compile of each decoder layer and of the head (final RMSNorm, lm_head, cross-entropy), the
           per-block recipe: one compiled graph serves all the layers, a short compile; --compile-scope model
           compiles the whole model as one graph instead (longer to compile)
  float8-tensorwise
           torchao's convert_to_float8_training, tensorwise scaling (dynamic, one scale per tensor), on the
           decoder layers' linears except the first and last layers (lm_head stays BF16), as our FP8 recipe;
           then compiled as `compile`. Skipped, with a line saying why, if torchao is not importable
  float8-rowwise
           the same with torchao's rowwise recipe (a scale per row of each operand, E4M3 everywhere)
The first --warmup steps (they compile) are timed apart; then --steps timed steps, each ended by a device
sync: ms per step (mean, median, min-max), tokens/s at the mean, model TFLOP/s as train_fp8 counts them (6 x
matmul parameters per token, plus 6 x L x D x T for causal attention), peak GPU memory
(torch.cuda.max_memory_allocated) and the GPU memory in use (torch.cuda.mem_get_info: the caching allocator's
reserve and the CUDA context too, as train_fp8 reports it). Each mode ends with one `result |` line for
scripts/results.py; a mode that fails (out of memory, say) prints why and the others still run.

Run: python3 scripts/bench_torch.py [--modes compile,float8-tensorwise] [--steps 10] [--warmup 3] [--batch 8] [--seq 2048]
                            [--layers 22] [--compile-scope block|model] [--device cuda|cpu]
Needs PyTorch 2.5+ (enable_gqa) with CUDA and a GPU (--device cpu: a smoke test of the code paths), and for
float8 torchao (0.17 pairs with torch 2.11; it needs nothing else) and an FP8 GPU (sm_89+). Where torchao is
not installed, its wheel can be put on the path:
  pip install --no-deps --target /tmp/site torchao-*.whl && PYTHONPATH=/tmp/site python3 scripts/bench_torch.py
"""
import argparse
import gc
import math
import statistics
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as err:
    sys.exit(f"bench_torch.py needs PyTorch: {err}")

# The `1b` preset (llama2.cuh's model_config_preset) with a 32000-token vocabulary.
DIM, N_LAYERS, N_HEADS, N_KV_HEADS, FFN_DIM, VOCAB = 2048, 22, 32, 4, 5632, 32000
NORM_EPS, ROPE_THETA = 1e-5, 10000.0
MODES = ("eager", "compile", "float8-tensorwise", "float8-rowwise")
ROW = "{:<8} {:>10} {:>17} {:>10} {:>11} {:>9} {:>10} {:>17}"


def apply_rope(x, cos, sin):
    """Rotate the two halves of each head (x: B, T, heads, head_dim; cos, sin: T, 1, head_dim / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // N_HEADS
        self.wqkv = nn.Linear(DIM, (N_HEADS + 2 * N_KV_HEADS) * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.wqkv(x).split([N_HEADS * hd, N_KV_HEADS * hd, N_KV_HEADS * hd], dim=-1)
        q = apply_rope(q.view(B, T, N_HEADS, hd), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, T, N_KV_HEADS, hd), cos, sin).transpose(1, 2)
        v = v.view(B, T, N_KV_HEADS, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, N_HEADS * hd))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN_DIM, bias=False)  # gate
        self.w3 = nn.Linear(DIM, FFN_DIM, bias=False)  # up
        self.w2 = nn.Linear(FFN_DIM, DIM, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.attn = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.ffn = FeedForward()

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Head(nn.Module):
    """Final RMSNorm, lm_head and the mean cross-entropy over all B x T positions."""
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x, targets):
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Llama(nn.Module):
    def __init__(self, n_layers, max_seq):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.head = Head()
        hd = DIM // N_HEADS
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)[:, None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x, targets)


def model_flops_per_token(model, T):
    """train_fp8's count: 6 x the matmul parameters (all but the embedding) + 6 L D T for causal attention."""
    matmul_params = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    return 6 * matmul_params + 6 * len(model.layers) * DIM * T


def convert_to_float8(model, recipe):
    """torchao's float8 training (recipe "tensorwise" or "rowwise") on the linears of decoder layers 1 .. L-2;
    None if torchao is missing (the reason is printed)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        print(f"float8-{recipe}: skipped, torchao is not importable ({err}); put a torchao wheel on PYTHONPATH "
              f"(see this file's docstring)", flush=True)
        return None
    last = len(model.layers) - 1

    def in_fp8_layer(module, fqn):  # fqn: "layers.<i>.attn.wqkv", ..., "head.lm_head"
        parts = fqn.split(".")
        return parts[0] == "layers" and 0 < int(parts[1]) < last

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, module_filter_fn=in_fp8_layer, config=config)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    print(f"float8-{recipe}: {converted} linears converted ({max(0, last - 1)} of {last + 1} layers)", flush=True)
    return model


def compile_model(model, scope):
    """Compile each decoder layer and the head in place (scope "block"), or the whole model ("model")."""
    if scope == "model":
        return torch.compile(model)
    for layer in model.layers:
        layer.compile()
    model.head.compile()
    return model


def build(mode, args, device):
    """The model of this mode on the device, or None if the mode cannot run here."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(args.layers, args.seq)
    if mode.startswith("float8-") and convert_to_float8(model, mode.split("-")[1]) is None:
        return None
    if mode != "eager":
        model = compile_model(model, args.compile_scope)
    return model


def train_step(model, optimizer, x, y, device_type):
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_mode(mode, args, device):
    """Run one mode: a dict of its measurements, or None if it was skipped."""
    model = build(mode, args, device)
    if model is None:
        return None
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), fused=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    sync(device)
    start = time.perf_counter()
    losses = [train_step(model, optimizer, x, y, device.type).item() for _ in range(args.warmup)]
    warmup_s = time.perf_counter() - start

    step_ms = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = train_step(model, optimizer, x, y, device.type)
        sync(device)
        step_ms.append(1e3 * (time.perf_counter() - start))
        losses.append(loss.item())
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        in_use_gib = (total - free) / 2**30
    else:
        in_use_gib = None

    flops_per_token = model_flops_per_token(getattr(model, "_orig_mod", model), args.seq)
    del model, optimizer
    torch._dynamo.reset()  # drop the compiled graphs, and with them the last references to this mode's memory
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ms = statistics.mean(step_ms)
    tokens_per_s = args.batch * args.seq / (ms / 1e3)
    return {"ms": ms, "median": statistics.median(step_ms), "min": min(step_ms), "max": max(step_ms),
            "tokens_per_s": tokens_per_s, "tflops": flops_per_token * tokens_per_s / 1e12, "peak_gib": peak_gib,
            "in_use_gib": in_use_gib, "warmup_s": warmup_s, "first_loss": losses[0], "last_loss": losses[-1]}


def result_line(mode, r, args):
    """The line scripts/results.py reads: one per mode that ran."""
    gib = lambda x: "-" if x is None else f"{x:.1f}"
    return (f"result | mode {mode} | B {args.batch} T {args.seq} layers {args.layers} | ms/step mean {r['ms']:.2f} "
            f"median {r['median']:.2f} min {r['min']:.2f} max {r['max']:.2f} | tokens/s {r['tokens_per_s']:.0f} | "
            f"model TFLOP/s {r['tflops']:.1f} | peak allocated {gib(r['peak_gib'])} GiB | GPU memory {gib(r['in_use_gib'])} GiB")


def row(mode, r):
    peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    return ROW.format(mode, f"{r['ms']:.2f}", f"{r['min']:.1f}-{r['max']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tflops']:.1f}", peak, f"{r['warmup_s']:.1f}",
                      f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of: " + ",".join(MODES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (they compile)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (B)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (T)")
    parser.add_argument("--layers", type=int, default=N_LAYERS, help="decoder layers (fewer: a quick run)")
    parser.add_argument("--compile-scope", choices=("block", "model"), default="block",
                        help="compile each decoder layer and the head (block) or the whole model as one graph")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test of the code")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes {args.modes}: unknown mode(s) {unknown}; choose from {','.join(MODES)}")
    args.modes = modes
    for flag in ("steps", "warmup", "batch", "seq", "layers"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False); "
                     "--device cpu runs a smoke test")
    return args


def main():
    args = parse_args()
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")
    where = f"GPU {torch.cuda.get_device_name()}" if device.type == "cuda" else "CPU"
    try:
        import torchao
        ao = f"torchao {torchao.__version__}"
    except ImportError:
        ao = "torchao not installed"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {ao}, {where}", flush=True)
    print(f"LLaMA-2 `1b` shape: dim {DIM}, {args.layers} layers, {N_HEADS} heads, {N_KV_HEADS} KV heads, "
          f"ffn {FFN_DIM}, vocab {VOCAB}; B {args.batch}, T {args.seq} ({args.batch * args.seq} tokens a step); "
          f"FP32 params, BF16 autocast, fused AdamW, clip 1.0; compile scope {args.compile_scope}; "
          f"{args.warmup} warm-up + "
          f"{args.steps} timed steps per mode", flush=True)
    header = ROW.format("mode", "ms/step", "min-max ms", "tokens/s", "TFLOP/s", "peak GiB", "warm-up s",
                        "loss first -> last")
    results = {}
    for mode in args.modes:
        try:
            r = bench_mode(mode, args, device)
        except Exception as err:  # out of memory, a recipe this torchao or GPU lacks: the other modes still run
            print(f"{mode}: failed at B {args.batch}, T {args.seq}: {type(err).__name__}: {str(err).splitlines()[0][:300]}",
                  flush=True)
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            continue
        if r is None:
            continue
        results[mode] = r
        print(header + "\n" + row(mode, r), flush=True)
        print(result_line(mode, r, args), flush=True)
        if not (math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])):
            print(f"{mode}: the loss is not finite: its timing is of a broken step", flush=True)

    print("\n" + header)
    for mode, r in results.items():
        print(row(mode, r))
    if "eager" in results:
        for mode, r in results.items():
            if mode != "eager":
                print(f"{mode} / eager speed: {r['tokens_per_s'] / results['eager']['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
