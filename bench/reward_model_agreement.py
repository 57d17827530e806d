"""How well a reward model ranks a policy's own samples, against the built-in sort task's true score.

A reward model's held-out pair accuracy measures it on the pairs it was trained like; GRPO asks something else of it:
to order the policy's samples. This samples ``--samples`` completions (temperature 1) for each of ``--prompts``
held-out sort prompts from the policy, scores them with the reward model (``lit_align.rewards.RewardModel``, as GRPO
does) and with the task (``sort_accuracy``, ``sort_exact``), and prints the fraction of same-prompt pairs the task
tells apart that the reward model orders the same way, and the exact match of the reward model's best sample.

    python bench/reward_model_agreement.py runs/learned-reward/sft/hf_model runs/learned-reward/reward/hf_model
"""

from __future__ import annotations

import argparse
import itertools

import torch
from transformers import AutoModelForCausalLM

from lit_align.data.tasks import SortTask
from lit_align.models import load_tokenizer, resolve
from lit_align.rewards import RewardModel, sort_accuracy, sort_exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="the policy: an export or builtin:<name>")
    parser.add_argument("reward_model", help="the reward model's export")
    parser.add_argument("--prompts", type=int, default=100, help="held-out sort prompts")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (temperature 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.policy)
    policy = AutoModelForCausalLM.from_pretrained(resolve(args.policy)).eval()
    rows = SortTask().prompt_rows("test").select(range(args.prompts))
    prompts, answers, g = list(rows["prompt"]), list(rows["answer"]), args.samples
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = policy.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=8,
                              num_return_sequences=g, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    prompts, answers = [p for p in prompts for _ in range(g)], [a for a in answers for _ in range(g)]
    learned = RewardModel(args.reward_model)(prompts, texts)
    true, exact = sort_accuracy(texts, answers), sort_exact(texts, answers)

    agree = told_apart = best_exact = 0
    for start in range(0, len(texts), g):
        group = range(start, start + g)
        for a, b in itertools.combinations(group, 2):
            if true[a] != true[b]:
                told_apart += 1
                agree += (learned[a] - learned[b]) * (true[a] - true[b]) > 0
        best_exact += exact[max(group, key=lambda i: learned[i])]
    print(f"samples: exact match {sum(exact) / len(exact):.3f}; the reward model orders {agree / told_apart:.3f} of "
          f"the {told_apart} same-prompt pairs the task tells apart as the task does; its best of {g} is exact on "
          f"{best_exact / args.prompts:.3f} of the prompts")


if __name__ == "__main__":
    main()
