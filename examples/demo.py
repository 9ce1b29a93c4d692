"""`python -m examples.demo`, what `make demo` runs: a generated kernel and generated blocks at work, on the GPU
when there is one, else on the CPU through Triton's interpreter. Each result is compared with an independent
float64 or plain-PyTorch computation."""
import time

import torch

from codagen import api, reference, runtime
from codagen.convert import LlamaShape, from_hf, to_hf
from codagen.models.llama import CodagenLlama, PlainLlama
from generated.kernels import out_proj_residual_norm

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"device: {device}" + (" (Triton interpreter)" if runtime.INTERPRETED else ""))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# 1. One GEMM-epilogue kernel: out-projection + residual + RMSNorm statistics + norm-weight scale.
m, n, k = 37, 50, 29  # ragged: no dimension is a multiple of the tile
y, w_o, x, wn = (torch.randn(*s, device=device) for s in ((m, k), (n, k), (m, n), (n,)))
start = time.perf_counter()
x_out, h, ss = out_proj_residual_norm.out_proj_residual_norm(y, w_o, x, wn)
elapsed = time.perf_counter() - start
(checked,) = api.load(["specs/out_proj_residual_norm.yaml"])
kernel = checked.kernel
config = runtime.pick_config(kernel.name, out_proj_residual_norm.FINGERPRINT, out_proj_residual_norm.TUNING, m, n, k,
                             torch.device(device))
truth = reference.run(kernel, checked.types, {"y": y, "w_o": w_o, "x": x, "wn": wn}, config.block_m, config.block_n)
print(f"\nout_proj_residual_norm {m}x{n}x{k} ({elapsed:.2f} s):")
for name, value in (("x_out", x_out), ("h", h), ("ss", ss)):
    print(f"  {name:6s} {tuple(value.shape)}  relative error vs float64: {rel(value, truth[name]):.1e}")
    assert rel(value, truth[name]) < 1e-5

# 2. A 2-layer Llama built from generated blocks: loss and gradients against plain PyTorch autograd.
torch.manual_seed(0)
shape = LlamaShape(dim=64, ffn_dim=96, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=100)
plain = PlainLlama(shape).to(device)
fused = CodagenLlama(shape).to(device)
fused.load_state_dict(from_hf(plain.state_dict(), shape))
tokens = torch.randint(0, shape.vocab, (2, 21), device=device)
targets = torch.randint(0, shape.vocab, (2, 21), device=device)
loss_plain, loss_fused = plain(tokens, targets), fused(tokens, targets)
loss_plain.backward()
loss_fused.backward()
grads = to_hf({name: p.grad for name, p in fused.named_parameters()}, shape)
worst = max(rel(grads[name], p.grad) for name, p in plain.named_parameters())
print(f"\n2-layer Llama: loss {loss_fused.item():.6f} (plain PyTorch {loss_plain.item():.6f}); "
      f"worst gradient relative error {worst:.1e}")
assert abs(loss_fused.item() - loss_plain.item()) < 1e-4 and worst < 1e-4
print("\nok: generated kernels and blocks match their references")
