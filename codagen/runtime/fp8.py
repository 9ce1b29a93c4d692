"""FP8 weights for the K-group GEMMs (docs/fp8.md, "An FP8 Llama MLP"): a bfloat16 master weight quantized to
float8_e4m3fn with one scale per 128 x 128 block (DeepSeek-V3's recipe), the `b` and `gemm.scales.b` of a kernel
such as down_residual_norm_fp8, and `BlockQuantized`, which makes them once per optimizer step (or other change of
the weight), not once per call."""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (floating) as float8_e4m3fn values and float32 scales [cdiv(N, block), cdiv(K, block)], one per
    block x block block (the last ones partial), w ≈ values · scale: what `fp8_scale` and `quantize` compute for a
    group, over a block. Per block, scale = amax / 448 correctly rounded to fp32 (1 where that is 0); each value
    w / scale correctly rounded to fp32, saturated to ±448 and rounded to the nearest float8_e4m3fn, ties to even.
    A NaN in a block makes its scale and values NaN; an infinity, its scale infinite (docs/fp8.md)."""
    if w.dim() != 2 or not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"quantize_blocks takes a 2-d float32, bfloat16 or float16 weight, got {w.dim()}-d "
                         f"{w.dtype}")
    n, k = w.shape
    bn, bk = -(-n // block), -(-k // block)
    padded = torch.zeros(bn * block, bk * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    # amax with NaN kept (amax propagates NaN), then its quotient by 448 in fp32: IEEE division, correctly rounded,
    # by a tensor on the device (by a Python number, PyTorch's CUDA division multiplies by its reciprocal instead,
    # off by an ulp at times: then values round to other FP8 codes than the kernels' quantize makes)
    amax = padded.abs().reshape(bn, block, bk, block).amax(dim=(1, 3))
    scale = amax / torch.full_like(amax, E4M3_MAX)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    per_element = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    quotient = w.to(torch.float32) / per_element
    # saturation first: torch's conversion to float8_e4m3fn rounds to nearest even, and makes NaN past 448
    return quotient.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


_optimizer_steps = 0  # optimizer steps taken in this process, by any optimizer, once BlockQuantized is first made


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


class BlockQuantized:
    """The FP8 copy of a weight, made again only when the weight may have changed since: after any optimizer step
    (a global post-step hook of torch.optim counts them), or when the tensor's version counter or storage differs
    (an update in place outside an optimizer, a new tensor assigned to the parameter). The steps are counted
    because the version and the storage alone miss FSDP2: its all-gather writes each step's weights into the
    same unsharded parameter without bumping its version, often at the same address. `get()` returns (values,
    scales) of quantize_blocks. The copy is made under no_grad: the gradient goes to the master weight through
    the block's backward, which reads the weight itself."""

    _counting = False  # whether the optimizer-step hook is registered (once per process)

    def __init__(self, weight: torch.Tensor, block: int = 128):
        if not BlockQuantized._counting:
            register_optimizer_step_post_hook(_count_optimizer_step)
            BlockQuantized._counting = True
        self.weight, self.block = weight, block
        self._key: tuple | None = None
        self._copy: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weight
        key = (_optimizer_steps, w.untyped_storage().data_ptr(), w.storage_offset(), w._version, w.shape, w.stride(),
               w.dtype, w.device)
        if key != self._key:
            with torch.no_grad():
                self._copy = quantize_blocks(w.detach(), self.block)
            self._key = key
        return self._copy
