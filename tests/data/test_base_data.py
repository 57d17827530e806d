"""lit_align.data.base: what every DataModule shares. Resuming mid-epoch and the resume check's settings walk
(through ``lit-align fit``: tests/e2e/test_resume_rules.py)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lit_align.data.base import ResumableLoader, SkippingSampler, first_difference


def test_first_difference_names_the_first_differing_leaf():
    mixture = [{"path": "a.jsonl", "weight": 1.0}, {"path": "b.jsonl", "weight": 2.0}]
    changed = [{"path": "a.jsonl", "weight": 1.0}, {"path": "b.jsonl", "weight": 3.0}]
    assert first_difference("data.mixture", mixture, changed) == ("data.mixture[1].weight", 2.0, 3.0)
    assert first_difference("data.mixture", mixture, mixture[:1]) == ("data.mixture", mixture, mixture[:1])
    assert first_difference("data.batch_size", 8, 8) is None


def test_a_resumed_loader_skips_the_trained_batches_of_its_epoch():
    """Without a trainer, the state is the start; a loaded state replays epoch 1 from its third batch (the same
    seeded order), and a finished epoch starts the next one."""
    data = TensorDataset(torch.arange(12))
    loader = lambda: ResumableLoader(data, batch_size=2, sampler=SkippingSampler(data, num_replicas=1, rank=0, seed=3))
    assert loader().state_dict() == {"epoch": 0, "batches": 0}
    full = loader()
    full.sampler.set_epoch(1)
    epoch_one = [b[0].tolist() for b in full]
    resumed = loader()
    resumed.load_state_dict({"epoch": 1, "batches": 2})
    assert [b[0].tolist() for b in resumed] == epoch_one[2:]
    assert [b[0].tolist() for b in resumed] == epoch_one  # skipping is for the first iteration only

    ended = loader()
    ended.load_state_dict({"epoch": 0, "batches": 6})
    nxt = loader()
    nxt.sampler.set_epoch(1)
    assert [b[0].tolist() for b in ended] == [b[0].tolist() for b in nxt]
