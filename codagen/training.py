"""Training runs of a transformers LlamaForCausalLM, as it is or patched by codagen.hf, that compare the two: the
models they train (a preset's dimensions with what the model's Hugging Face config adds to them), the same initial
weights for every model of a run, a learnable synthetic token stream, the training step, and Hugging Face's own
modeling_llama kept whole around Liger-Kernel's patch. examples/convergence.py, benchmarks/train_speed.py and
benchmarks/profile_train.py are built from these.

transformers (codagen's `hf` extra) is imported inside the functions that need it, as codagen.hf does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch

from . import runtime  # noqa: F401  (before liger_kernel imports triton: the interpreter where there is no GPU)
from .presets import PRESETS, LlamaShape


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling ("rope_type": "llama3" in a Hugging Face config)."""

    factor: float
    original_max_positions: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclass(frozen=True)
class TrainedModel:
    """A transformers LlamaForCausalLM at the dimensions of a preset (codagen/presets.py: the one table of model
    dimensions), with what the model's config.json adds to them, and at most `layers` of its layers."""

    preset: str
    note: str  # what the model is, in a report
    tied_embeddings: bool
    rope_scaling: RopeScaling
    max_positions: int
    layers: int | None = None  # fewer layers than the preset's: its GEMM shapes at a size one GPU trains

    @property
    def shape(self) -> LlamaShape:
        shape = PRESETS[self.preset]
        return dataclasses.replace(shape, n_layers=self.layers) if self.layers else shape

    def config(self):
        """transformers' LlamaConfig, SDPA attention and no KV cache (training). rope_theta and rope_scaling: the
        spelling that transformers 4 and 5 read."""
        import transformers

        s, scaling = self.shape, self.rope_scaling
        if s.family != "llama":
            raise ValueError(f"preset {self.preset!r} is a {s.family} model; training runs are of Llama models")
        return transformers.LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.dim, intermediate_size=s.ffn_dim, num_hidden_layers=s.n_layers,
            num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads, head_dim=s.head_dim,
            max_position_embeddings=self.max_positions, rms_norm_eps=s.eps, tie_word_embeddings=self.tied_embeddings,
            rope_theta=s.rope_theta,
            rope_scaling={"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                          "high_freq_factor": scaling.high_freq_factor,
                          "original_max_position_embeddings": scaling.original_max_positions},
            attn_implementation="sdpa", use_cache=False)


MODELS = {
    # the tiny preset, tied and with Llama 3's RoPE scaling as Llama-3.2-1B: the CPU runs, through the same
    # paths of codagen.hf as the GPU's
    "tiny": TrainedModel("tiny", "the tiny preset (codagen/presets.py), tied embeddings: the CPU test",
                         tied_embeddings=True, rope_scaling=RopeScaling(8.0, 8), max_positions=64),
    # meta-llama/Llama-3.2-1B's config.json
    "llama3.2-1b": TrainedModel("llama3-1b", "Llama-3.2-1B's configuration (16 layers, tied embeddings)",
                                tied_embeddings=True, rope_scaling=RopeScaling(32.0, 8192), max_positions=131072),
    # meta-llama/Llama-3.1-8B's config.json, cut to 4 layers
    "llama3.1-8b-4-layers": TrainedModel(
        "llama3-8b", "Llama-3.1-8B's configuration cut to 4 layers (untied embeddings)", tied_embeddings=False,
        rope_scaling=RopeScaling(8.0, 8192), max_positions=131072, layers=4),
}


class BigramData:
    """Sequences of a random sparse bigram chain (each token has `branches` successors), drawn from the seed and
    the step: a loss that falls from ln(vocab) towards ln(branches) as a model learns it."""

    def __init__(self, vocab: int, seed: int, branches: int = 4):
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, branches), generator=g)
        self.vocab, self.seed = vocab, seed

    def batch(self, step: int, batch: int, seq: int, device) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        choices = torch.randint(0, self.successors.shape[1], (batch, seq), generator=g)
        for t in range(1, seq):
            tokens[:, t] = self.successors[tokens[:, t - 1], choices[:, t]]
        return tokens.to(device)


def initial_state(config, seed: int, device) -> dict[str, torch.Tensor]:
    """The run's weights, drawn once: on the device (Hugging Face's initialization of 1B takes minutes on the CPU),
    kept on the host, so that no model's peak memory holds them."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    state = {name: t.cpu() for name, t in model.state_dict().items()}
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return state


def make_model(config, state: dict, dtype: torch.dtype, device):
    """A fresh Hugging Face model with the run's initial weights."""
    import transformers

    with torch.device(device):  # Hugging Face's initialization on the device: seconds, not minutes, at 1B
        model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(state)
    return model.to(dtype=dtype)


def adamw(model, lr: float, fused: bool | None = None) -> torch.optim.AdamW:
    """The optimizer of every run: AdamW on the model's own parameters (made after patching)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)


def train_step(model, optimizer, tokens: torch.Tensor, amp: bool = False, cudagraphs: bool = False) -> torch.Tensor:
    """A step: the forward with labels (under torch.autocast(bfloat16) with `amp`, as Trainer(bf16=True) runs fp32
    parameters), the backward, the optimizer's step and zero_grad. Returns the loss, detached."""
    if cudagraphs:  # the last step's outputs are dead: their memory is the graphs' again
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(tokens.device.type, torch.bfloat16, enabled=amp):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().clone()  # a copy: CUDA graphs write their outputs over at the next replay


def leave_process_group() -> None:
    """End a process of a torch.distributed run (torchrun): every rank done, the process group torn down, then the
    process leaves without the interpreter's exit-time teardown. With gloo that teardown can abort a rank after its
    work is done ('terminate called without an active exception': a joinable thread destroyed), and torchrun then
    reports the run failed; a barrier before destroy_process_group alone did not prevent it (CI, several times)."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train(model, data: BigramData, steps: int, *, batch: int, seq: int, lr: float, device,
          first_step: int = 0) -> tuple[list[float], float]:
    """`steps` steps on the data's batches from `first_step` on, with a fresh AdamW: the losses, and the tokens/s of
    the steps after the first (the first compiles kernels)."""
    model.train()
    optimizer = adamw(model, lr)
    losses, start = [], None
    for step in range(first_step, first_step + steps):
        if step == first_step + 1:
            sync(device)
            start = time.perf_counter()
        losses.append(train_step(model, optimizer, data.batch(step, batch, seq, device)).item())
    sync(device)
    timed = steps - 1
    tokens_per_s = timed * batch * seq / (time.perf_counter() - start) if timed > 0 else float("nan")
    return losses, tokens_per_s


@contextlib.contextmanager
def hugging_face_kept():
    """Liger-Kernel's patch rebinds RoPE, LlamaRMSNorm and LlamaMLP in transformers' modeling_llama, for every model
    made after it too: the module's names are put back on leaving, so that the next model is Hugging Face's own."""
    from transformers.models.llama import modeling_llama

    names = dict(vars(modeling_llama))
    try:
        yield
    finally:
        vars(modeling_llama).update(names)


def liger(model):
    """Hugging Face + Liger-Kernel (optional: runs leave its row out where liger_kernel is missing or refuses)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return model
