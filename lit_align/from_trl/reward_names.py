"""TRL's reward names and the ones recipe repositories' scripts register, as the functions they name."""

from __future__ import annotations

from lit_align.from_trl.sections import Work

# TRL's GRPO/RLOO scripts' reward names (their ``reward_funcs_registry``) -> what they build, from ``trl.rewards``
TRL_REWARDS = {
    "accuracy_reward": "trl.rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards.think_format_reward",
    "get_soft_overlong_punishment": {"class_path": "trl.rewards.get_soft_overlong_punishment",
                                     "init_args": {"max_completion_len": 1280, "soft_punish_cache": 256}},
}

# open-r1's GRPO script's reward names (its ``get_reward_funcs``) -> its functions, and the script arguments its
# factories take (with open-r1's defaults); with open-r1 installed where the run happens
OPEN_R1 = {
    "accuracy": "open_r1.rewards.accuracy_reward", "format": "open_r1.rewards.format_reward",
    "reasoning_steps": "open_r1.rewards.reasoning_steps_reward", "length": "open_r1.rewards.len_reward",
    "tag_count": "open_r1.rewards.tag_count_reward",
    "cosine": ("open_r1.rewards.get_cosine_scaled_reward", {
        "min_value_wrong": ("cosine_min_value_wrong", 0.0), "max_value_wrong": ("cosine_max_value_wrong", -0.5),
        "min_value_correct": ("cosine_min_value_correct", 0.5),
        "max_value_correct": ("cosine_max_value_correct", 1.0), "max_len": ("cosine_max_len", 1000)}),
    "repetition_penalty": ("open_r1.rewards.get_repetition_penalty_reward", {
        "ngram_size": ("repetition_n_grams", 3), "max_penalty": ("repetition_max_penalty", -1.0)}),
    "code_format": ("open_r1.rewards.get_code_format_reward", {"language": ("code_language", "python")}),
}
OPEN_R1_CODE = {"code", "binary_code", "ioi_code", "cf_code"}  # sandboxed: partial functions of the script's
OPEN_R1_ARGS = {"cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct",
                "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams", "repetition_max_penalty",
                "code_language", "code_eval_test_batch_size", "parallel_code_exec_per_proc", "e2b_router_url",
                "morph_router_url", "code_provider", "ioi_provider"}


def rewards(work: Work) -> set[str]:
    """``reward_model_name_or_path`` and ``reward_funcs``: TRL's scripts put the reward model first, then each name
    from their registry (``trl.rewards``' functions: TRL installed, pip install trl) or a dotted import path; the
    names open-r1's recipes use are open-r1's functions (``OPEN_R1``: open-r1 installed where the run happens)."""
    fields = work.fields
    names = fields.get("reward_funcs") or []
    names = [names] if isinstance(names, str) else list(names)
    funcs = [fields["reward_model_name_or_path"]] if fields.get("reward_model_name_or_path") else []
    for name in names:
        if name in TRL_REWARDS:
            funcs.append(TRL_REWARDS[name])
        elif isinstance(name, str) and "." in name:
            funcs.append(name)
        elif name in OPEN_R1:
            funcs.append(_open_r1(work, name))
        elif name in OPEN_R1_CODE:
            work.refuse("reward_funcs", f"names open-r1's {name!r}, a sandboxed code reward its script builds with "
                        "partial arguments: name a function of yours that calls it (my_pkg.rewards.code)")
        else:
            work.refuse("reward_funcs", f"names {name!r}: expected one of TRL's {sorted(TRL_REWARDS)}, open-r1's "
                        f"{sorted(OPEN_R1)} or a dotted import path (my_lib.rewards.my_reward)")
    if funcs:
        work.model["reward_funcs"] = funcs
    unused = sorted(OPEN_R1_ARGS & set(fields) - {a for n in names if isinstance(OPEN_R1.get(n), tuple)
                                                  for a, _ in OPEN_R1[n][1].values()})
    if unused:
        work.notes.append(f"dropped {', '.join(unused)} (open-r1's settings of reward functions this run does not "
                          "use)")
    return {"reward_funcs", "reward_model_name_or_path", *OPEN_R1_ARGS}


def _open_r1(work: Work, name: str) -> str | dict:
    """open-r1's reward ``name`` as its function, a factory built with the file's script arguments."""
    spec = OPEN_R1[name]
    if isinstance(spec, str):
        return spec
    factory, arguments = spec
    return {"class_path": factory, "init_args": {arg: work.fields.get(field, default)
                                                 for arg, (field, default) in arguments.items()}}
