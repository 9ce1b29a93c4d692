"""transformers' Trainer on the CPU with a patched tiny Llama against the same Trainer run of the unpatched model
(same seed, same data, fp32): the logged training losses and the trained weights, with gradient accumulation over
batches of unequal padding (Trainer passes num_items_in_batch, the labelled tokens of the accumulated batches, and
the loss is their sum divided by it), and evaluate() with labels: the loss, and the logits that compute_metrics
gets."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it
pytest.importorskip("accelerate")  # Trainer's; the test extra installs it

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import apply_codagen  # noqa: E402
from test_hf import rel, tiny_llama  # noqa: E402

VOCAB = 97
TOL = 1e-4


def examples(n, seed):
    """n token sequences of 5 to 12 tokens (unequal: the batches have unequal padding), drawn fresh."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 13, (n,), generator=g)
    return [{"input_ids": torch.randint(1, VOCAB, (int(length),), generator=g).tolist()} for length in lengths]


def collate(features):
    """Right padding with token 0, masked out, and labels -100 there (as DataCollatorForLanguageModeling makes
    them, without a tokenizer)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def accuracy(prediction):
    """compute_metrics: next-token accuracy of the logits it is given, over the labelled positions."""
    logits, labels = prediction.predictions, prediction.label_ids
    # one array: the logits alone (Trainer leaves out the loss and the cache); an empty tuple where there are none
    assert not isinstance(logits, tuple), f"compute_metrics got {len(logits)} outputs besides the loss, not the logits"
    guessed, target = torch.as_tensor(logits)[:, :-1].argmax(-1), torch.as_tensor(labels)[:, 1:]
    kept = target != -100
    return {"accuracy": (guessed[kept] == target[kept]).float().mean().item(), "logits_shape": list(logits.shape)}


def train(model, tmp_path, name, accumulation):
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, report_to=[], seed=3, max_steps=3, learning_rate=3e-3,
        per_device_train_batch_size=2, per_device_eval_batch_size=3, gradient_accumulation_steps=accumulation,
        logging_steps=1, save_strategy="no", lr_scheduler_type="constant", dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=examples(12, 4),
                                   eval_dataset=examples(5, 5), data_collator=collate, compute_metrics=accuracy)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_trains_and_evaluates_as_the_unpatched_model(tmp_path, accumulation):
    torch.manual_seed(1)
    reference = tiny_llama(num_hidden_layers=2)
    patched = apply_codagen(copy.deepcopy(reference))
    expected_trainer, expected = train(reference, tmp_path, "reference", accumulation)
    trainer, losses = train(patched, tmp_path, "patched", accumulation)
    assert len(losses) == len(expected) == 3
    for got, want in zip(losses, expected):
        assert abs(got - want) <= TOL * abs(want), (losses, expected)
    trained = patched.state_dict()  # Hugging Face's layout
    for name, value in reference.state_dict().items():
        assert rel(trained[name], value) < TOL, name
    metrics, expected_metrics = trainer.evaluate(), expected_trainer.evaluate()
    assert abs(metrics["eval_loss"] - expected_metrics["eval_loss"]) <= TOL * expected_metrics["eval_loss"]
    # compute_metrics got the logits: [examples, longest, vocab], the unpatched model's argmax
    assert metrics["eval_logits_shape"] == expected_metrics["eval_logits_shape"] == [5, 12, VOCAB]
    assert metrics["eval_accuracy"] == expected_metrics["eval_accuracy"]
