"""The example Llama built from generated blocks against the same model in plain PyTorch (Hugging Face layout),
and the weight converters between the two layouts."""
import torch

from codagen import runtime  # noqa: F401  (switches Triton's interpreter on where there is no GPU)
from codagen.convert import LlamaShape, from_hf, heads_to_halves, heads_to_interleaved, interleave_rows, \
    split_rows, to_hf
from codagen.models.llama import CodagenLlama, PlainLlama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = LlamaShape(dim=64, ffn_dim=80, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=97)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_plain(shape, plain=PlainLlama):
    """Norm weights near 1, the others small (a Llama-like plain model: PlainLlama, PlainQwen3)."""
    model = plain(shape).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    return model


def test_converters_round_trip_exactly():
    sd = random_plain(SHAPE).state_dict()
    back = to_hf(from_hf(sd, SHAPE), SHAPE)
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_layout_helpers_are_inverse_and_pair_rotate_half_dims():
    w = torch.randn(3 * 8, 5)
    assert torch.equal(heads_to_halves(heads_to_interleaved(w, 8), 8), w)
    # rotate_half pairs dim j with j + 4 in a head of 8; interleaved puts them at 2j, 2j+1
    assert torch.equal(heads_to_interleaved(w, 8)[8 + 2 * 1], w[8 + 1])
    assert torch.equal(heads_to_interleaved(w, 8)[8 + 2 * 1 + 1], w[8 + 1 + 4])
    g, u = torch.randn(6, 5), torch.randn(6, 5)
    g2, u2 = split_rows(interleave_rows(g, u))
    assert torch.equal(g2, g) and torch.equal(u2, u)


def trains_like_plain(plain, fused, batches, to_plain_layout) -> None:
    """AdamW on both models from the same weights over `batches` of (tokens, targets): each step's losses within
    1e-4 of each other, and the fused model's final weights, in the plain model's layout, within 1e-4."""
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (plain, fused)]
    for step, (tokens, targets) in enumerate(batches):
        losses = []
        for model, opt in zip((plain, fused), opts):
            opt.zero_grad()
            loss = model(tokens, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 1e-4 * abs(losses[0]), (step, losses)
    final = to_plain_layout(fused.state_dict())
    for name, p in plain.state_dict().items():
        assert rel(final[name], p) < 1e-4, name


def random_batches(vocab: int, steps: int = 5):
    """Batches of 2 x 19 random tokens, drawn as they are used, the last target of each row ignored (5 AdamW steps
    at lr 1e-2 move every weight well past the tolerance of trains_like_plain)."""
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (2, 19), device=DEVICE)
        targets = torch.randint(0, vocab, (2, 19), device=DEVICE)
        targets[:, -1] = -100
        yield tokens, targets


def test_two_layer_llama_trains_like_plain_pytorch():
    torch.manual_seed(1)
    plain = random_plain(SHAPE)
    fused = CodagenLlama(SHAPE, chunk_rows=24).to(DEVICE)
    fused.load_state_dict(from_hf(plain.state_dict(), SHAPE))
    trains_like_plain(plain, fused, random_batches(SHAPE.vocab), lambda sd: to_hf(sd, SHAPE))
