"""lit_align's reward modelling against TRL's RewardTrainer: same tokens in the three row formats, same loss and
metrics on the same batch from the same weights, with and without a ``margin`` column and
``center_rewards_coefficient``.

Both sides start from one sequence classifier (the tiny model with a seeded score head, saved once), so the random
head TRL would draw is not a difference. TRL's numbers come from its own dataset preparation, collator and
``compute_loss``; lit_align's from ``RewardDataModule`` and ``RewardModule``. fp32 on both sides (TRL's config
defaults to bf16 autocast, turned off here). Tolerance (``tests/numerics.py``, rule 3): the same formulas on the
same batch, in an order that may differ in the network's reductions.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

from lit_align.data.preference import RewardDataModule  # noqa: E402
from lit_align.modules.reward import RewardModule  # noqa: E402
from numerics import TINY_TERMS, assert_rounding_close  # noqa: E402

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

PAIRS = 6
MARGINS = [0.5, 0.0, 1.5, -0.5, 2.0, 0.25]


def rows_of(kind: str) -> list[dict]:
    """``PAIRS`` sort-task pairs in one of the three formats, with a margin column."""
    digits = ["312", "5021", "97", "8830", "461", "2209"]
    out = []
    for d, margin in zip(digits, MARGINS):
        right, wrong = "".join(sorted(d)), "0" + d[::-1]
        if kind == "standard":
            row = {"prompt": f"sort {d}:", "chosen": right, "rejected": wrong}
        elif kind == "conversational":
            row = {"prompt": [{"role": "user", "content": f"sort {d}"}],
                   "chosen": [{"role": "assistant", "content": right}],
                   "rejected": [{"role": "assistant", "content": wrong}]}
        else:  # implicit prompt
            row = {"chosen": f"sort {d}: {right}", "rejected": f"sort {d}: {wrong}"}
        out.append({**row, "margin": margin})
    return out


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tiny_path) -> str:
    """The tiny model as a one-label sequence classifier with a seeded score head, and its tokenizer."""
    torch.manual_seed(1234)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_path, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("rm_parity") / "rm"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(path)
    return str(path)


def trl_trainer(classifier: str, rows: list[dict], tmp_path, **config) -> trl.RewardTrainer:
    from datasets import Dataset

    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=PAIRS, bf16=False,
                            use_cpu=True, report_to="none", save_strategy="no", gradient_checkpointing=False,
                            max_length=64, disable_tqdm=True, dataloader_num_workers=0, **config)
    return trl.RewardTrainer(model=classifier, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=AutoTokenizer.from_pretrained(classifier))


def lit_data(classifier: str, rows: list[dict], write_jsonl) -> RewardDataModule:
    data = RewardDataModule(path=write_jsonl(rows), tokenizer=classifier, batch_size=PAIRS, max_length=64,
                            val_split=None, shuffle=False)
    data.setup("fit")
    return data


@pytest.mark.parametrize("kind", ["standard", "conversational", "implicit"])
def test_tokenization_identical(classifier, tmp_path, write_jsonl, kind):
    rows = rows_of(kind)
    theirs = trl_trainer(classifier, rows, tmp_path).train_dataset
    ours = lit_data(classifier, rows, write_jsonl).train_data
    for side in ("chosen_ids", "rejected_ids"):
        assert [r["prompt_ids"] + r[side] for r in ours] == list(theirs[side]), side
    assert list(ours["margin"]) == list(theirs["margin"])


@pytest.mark.parametrize("margin,coef", [(False, None), (True, None), (False, 0.01), (True, 0.05)])
def test_loss_and_metrics_match_trl_on_the_same_batch(classifier, tmp_path, write_jsonl, margin, coef):
    rows = rows_of("standard") if margin else [{k: v for k, v in r.items() if k != "margin"}
                                               for r in rows_of("standard")]
    trainer = trl_trainer(classifier, rows, tmp_path, center_rewards_coefficient=coef)
    data = lit_data(classifier, rows, write_jsonl)
    batch = data.collate(list(data.train_data))
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    assert ("margin" in batch) == margin == ("margin" in trl_batch)

    trainer.model.train()
    with torch.no_grad():
        their_loss = trainer.compute_loss(trainer.model, dict(trl_batch)).item()
    theirs = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    module = RewardModule(model=classifier, center_rewards_coefficient=coef)
    module.configure_model()
    with torch.no_grad():
        losses, stats = module.pair_outputs(batch)
    scale = max(abs(theirs["min_reward"]), abs(theirs["max_reward"]))
    assert_rounding_close(losses.mean(), their_loss, scale=max(scale, 1.0), terms=TINY_TERMS, msg="loss")
    for name in ("margin", "min_reward", "mean_reward", "max_reward"):
        assert_rounding_close(stats[name], theirs[name], scale=scale, terms=TINY_TERMS, msg=name)
    assert stats["accuracy"].item() == theirs["accuracy"]
    if margin or coef:  # the options move the loss: not the plain Bradley-Terry loss of the same rewards
        chosen, rejected = module.rewards(batch)
        plain = torch.nn.functional.logsigmoid(chosen - rejected).neg().mean().item()
        assert abs(plain - their_loss) > 1e-3
