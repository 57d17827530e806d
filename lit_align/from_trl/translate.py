"""One TRL config (the flat mapping ``trl <command> --config FILE`` reads) as a lit_align config.

Each field is sorted into a LightningCLI config for the command's module and data module (``COMMANDS``):

- a field the module or the data module takes under the same name goes there as it is (``beta``, ``learning_rate``,
  ``num_generations``, ``max_length``, ...: lit_align's recipes take TRL's names, with TRL's meanings);
- TRL's older names are read as their new ones (``OLDER_NAMES``: ``torch_dtype``, ``max_seq_length``, ...);
- fields that have a place of another name are moved (``FIELDS``), a few with their value translated too
  (``sections``: the output directory, precision, evaluation, checkpoints, loggers, LoRA, quantization, mixtures,
  reward names, the hub; ``_recipe``: what one command reads differently);
- fields that change nothing lit_align computes (logging, the hub, speed-only settings) are dropped with a note
  (``DROPPED``; ``NO_EFFECT`` at the values that need nothing);
- everything else is refused, every such field and every bad value in one ``error:`` line naming the file: a
  translation that silently drops a setting would train something else than the user's TRL run. A field TRL does
  not have is told apart from one it has (``trl_fields``: a mistyped name, another command's field).

Where TRL's default for a field the file leaves out differs from lit_align's, the translation writes TRL's
(``TRL_DEFAULTS``, ``_recipe``). docs/trl_configs.md is the user's table of all of it.
"""

from __future__ import annotations

import copy
import difflib
import re

from lit_align.errors import LitAlignError
from lit_align.from_trl import dataset_fields, reward_names, sections
from lit_align.from_trl.trl_fields import commands_with, version
from lit_align.from_trl.trl_fields import fields as trl_fields
from lit_align.hub import recipe_defaults
from lit_align.imports import import_object

# TRL's command -> lit_align's module and data module (their short names in lit_align.modules / lit_align.data)
COMMANDS = {
    "sft": ("SFTModule", "CompletionDataModule"),
    "dpo": ("DPOModule", "PreferenceDataModule"),
    "kto": ("KTOModule", "UnpairedPreferenceDataModule"),
    "reward": ("RewardModule", "RewardDataModule"),
    "grpo": ("GRPOModule", "PromptDataModule"),
    "rloo": ("RLOOModule", "PromptDataModule"),
    "distillation": ("DistillationModule", "PromptDataModule"),
}

# TRL's field -> its place here (a dotted path into the config), for the fields whose name differs; a place inside
# a mapping option (``model_init_kwargs.revision``) yields to the same key in that option given whole, as TRL's
# scripts let ``model_init_kwargs`` override ``model_revision``
FIELDS = {
    "model_name_or_path": "model.model",
    "teacher_model_name_or_path": "model.teacher_model",
    "model_revision": "model.model_init_kwargs.revision",
    "teacher_model_revision": "model.teacher_model_init_kwargs.revision",
    "chat_template_path": "model.chat_template",
    "dataset_name": "data.path",
    "dataset_config": "data.config_name",
    "dataset_train_split": "data.train_split",
    "dataset_test_split": "data.val_split",
    "per_device_train_batch_size": "data.batch_size",
    "per_device_eval_batch_size": "data.val_batch_size",
    "dataloader_num_workers": "data.num_workers",
    "dataset_num_proc": "data.num_proc",
    "shuffle_dataset": "data.shuffle",
    "cache_implementation": "model.generation_kwargs.cache_implementation",
    "max_steps": "trainer.max_steps",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "max_grad_norm": "trainer.gradient_clip_val",
    "logging_steps": "trainer.log_every_n_steps",
    "seed": "seed_everything",
    "resume_from_checkpoint": "ckpt_path",
    "num_processes": "trainer.devices",  # accelerate's, which TRL's CLI passes on: the world, so the global batch
}
# the names older TRL and transformers releases gave a field (recipe files written for them use these)
OLDER_NAMES = {"torch_dtype": "dtype", "max_seq_length": "max_length", "evaluation_strategy": "eval_strategy",
               "per_gpu_train_batch_size": "per_device_train_batch_size",
               "per_gpu_eval_batch_size": "per_device_eval_batch_size"}

SPEED = "a speed setting: lit_align's fast paths are its defaults"
# values older TRL releases gave a field, as their current ones: (field, older, now)
OLDER_VALUES = (("packing_strategy", "ffd", "bfd"), ("scale_rewards", True, "group"), ("scale_rewards", False, "none"))
# fields that change nothing lit_align computes, dropped at any value with a note: why, for the note
DROPPED = {
    **dict.fromkeys(("overwrite_output_dir", "logging_dir", "logging_strategy", "logging_first_step",
                     "logging_nan_inf_filter", "log_level", "log_level_replica", "log_on_each_node", "run_name",
                     "include_tokens_per_second", "include_num_input_tokens_seen", "skip_memory_metrics",
                     "log_unique_prompts", "log_multimodal", "log_completions_hub_repo", "disable_tqdm_eval"),
                    "logging"),
    **dict.fromkeys(("do_train", "do_eval", "do_predict", "remove_unused_columns", "save_only_model",
                     "save_safetensors", "save_on_each_node", "ignore_bias_buffers", "ddp_timeout", "ddp_backend",
                     "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "gradient_checkpointing_kwargs",
                     "ds3_gather_for_generation", "pad_to_multiple_of", "dataloader_pin_memory",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_drop_last",
                     "eval_accumulation_steps", "eval_do_concat_batches", "eval_on_start", "eval_packing",
                     "prediction_loss_only", "label_names", "include_for_metrics", "batch_eval_metrics"),
                    "bookkeeping lit_align does its own way"),
    **dict.fromkeys(("use_liger_kernel", "liger_kernel_config", "torch_compile", "torch_compile_backend",
                     "torch_compile_mode", "tf32", "use_transformers_paged", "use_transformers_continuous_batching",
                     "vllm_model_impl", "optim_target_modules"), SPEED),
    "use_bnb_nested_quant": "read with load_in_4bit",
    "pad_token": "padding is masked out of every loss and metric here",
    # recipe repositories' own script arguments that change nothing trained
    **dict.fromkeys(("wandb_entity", "wandb_project", "wandb_run_group", "wandb_log_unique_prompts",
                     "wandb_description"), "logging"),
    **dict.fromkeys(("hub_model_revision", "push_to_hub_revision", "callbacks", "benchmarks"),
                    "the recipe script's hub uploads and evaluation jobs, after or beside training"),
    **dict.fromkeys(("use_liger", "preprocessing_num_workers"), SPEED),
    **dict.fromkeys(("vllm_device", "remote_gen_model_url"), "where generation runs: the launch and "
                    "trainer.devices decide"),
}
# fields dropped only at the values that need nothing here (any other value is refused)
NO_EFFECT = {
    "dataset_streaming": (False,), "activation_offloading": (False,), "load_best_model_at_end": (False,),
    "average_tokens_across_devices": (True,), "truncation_mode": ("keep_start",),
    "train_sampling_strategy": ("random",), "loss_type": ("nll", "chunked_nll"), "dataset_text_field": ("text",),
}
REFUSED = {"env": "set those environment variables in the shell, before lit-align fit"}  # why, where it helps
SPEED_ONLY = {"dataset_num_proc", "dataloader_num_workers"}  # dropped where the data module has no such option
# TrainingArguments' defaults where LightningCLI's differ, written when the file leaves them out
TRL_DEFAULTS = {"num_train_epochs": 3, "seed": 42, "logging_steps": 10, "max_grad_norm": 1.0}
GROUPED = {"grpo": 8, "rloo": 2}  # the recipes sampling groups: TRL's num_generations (num_generations_eval's too)
EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")  # 1e-5: YAML 1.1 reads it as text, TRL as a number
ONLINE = {"grpo", "rloo", "distillation"}  # TRL samples steps_per_generation steps at once (default: the accumulation)
SECTIONS = (sections.run_settings, sections.hub, sections.evaluation, sections.checkpoints, sections.loggers,
            sections.lora, sections.quantization, dataset_fields.mixture, dataset_fields.older_datasets)


def _options(class_name: str, package: str) -> set[str]:
    """Every option of ``package.class_name`` (its ``__init__``'s and its bases')."""
    return set(recipe_defaults(import_object(f"{package}.{class_name}")))


def _recipe(work: sections.Work) -> set[str]:
    """What one command's TRL fields mean here beyond their names: the fields handled."""
    command, fields, model, data, done = work.command, work.fields, work.model, work.data, set()
    if (command in ONLINE and "steps_per_generation" not in fields and "generation_batch_size" not in fields
            and "gradient_accumulation_steps" in fields):  # one round an optimizer step, as TRL's generation batch
        model["steps_per_generation"] = fields["gradient_accumulation_steps"]
    if command == "sft":  # SFTTrainer shuffles the dataset once before training; its sampler shuffles anyway
        done.add("shuffle_dataset")
    if command in ONLINE and "max_prompt_length" in fields:  # older TRL's prompt cut (keeping the end): lit_align's
        data["max_length"] = fields["max_prompt_length"]
        done.add("max_prompt_length")
    elif command in ONLINE and "max_length" not in fields:  # TRL 1.16 does not cut the prompts of online recipes
        data["max_length"] = None
    trl_disables = trl_fields(command).get("disable_dropout") == "bool!"  # its default; SFT's never disables
    own = recipe_defaults(import_object(f"lit_align.modules.{COMMANDS[command][0]}"))["disable_dropout"]
    if "disable_dropout" not in fields and trl_disables != own:
        model["disable_dropout"] = trl_disables
    if command in GROUPED:
        done |= reward_names.rewards(work)
        if fields.get("eval_strategy", "no") != "no":  # TRL samples num_generations_eval per prompt, its eval
            group = (fields.get("num_generations_eval") or fields.get("num_generations")  # batch counts them
                     or GROUPED[command])
            per_device = fields.get("per_device_eval_batch_size", 8)
            if per_device % group:  # TRL checks the global batch; lit_align's counts prompts per device
                work.notes.append(f"per_device_eval_batch_size {per_device} is not whole groups of {group} "
                                  f"completions: {max(per_device // group, 1)} prompt(s) per device and step instead "
                                  "(the evaluation's batching, not its result)")
            model["num_generations_eval"], data["val_batch_size"] = group, max(per_device // group, 1)
            done |= {"num_generations_eval", "per_device_eval_batch_size"}
    return done


def _check_kinds(work: sections.Work) -> None:
    """Each value against the kind TRL's parser gives its field (``trl_fields``): flags, numbers, choices."""
    known = trl_fields(work.command)
    for name, value in work.fields.items():
        kind = known.get(name)
        if value is None or kind is None:
            continue
        if kind in ("bool", "bool!") and not isinstance(value, bool):
            work.refuse(name, f"is {value!r}: expected true or false")
        elif kind in ("int", "float") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                           or (kind == "int" and not float(value).is_integer())):
            work.refuse(name, f"is {value!r}: expected {'an integer' if kind == 'int' else 'a number'}")
        elif isinstance(kind, tuple) and str(value) not in kind[1:]:
            work.refuse(name, f"is {value!r}: expected one of {list(kind[1:])}")


def _unknown(work: sections.Work, name: str, candidates: set[str]) -> str:
    """Why field ``name`` has no place: TRL's field without an equivalent, another command's, or no TRL field."""
    command = work.command
    if name in trl_fields(command):
        return "(TRL's field; lit_align has no equivalent)"
    others = commands_with(name)
    if others:
        return (f"is a field of `trl {'`, `trl '.join(others)}`, not of `trl {command}`: is this a {others[0]} "
                f"config? (lit-align from-trl {others[0]} --config FILE)")
    close = difflib.get_close_matches(name, sorted(candidates | set(trl_fields(command))), n=1, cutoff=0.75)
    return (f"is not a field of TRL {version()}'s `trl {command}`"
            + (f" (did you mean {close[0]!r}?)" if close else " (a recipe repository's own script argument?)"))


def _place(work: sections.Work, done: set[str]) -> list[str]:
    """Every field not handled yet to its place: the same name, a ``FIELDS`` rename, or dropped; the names
    dropped as changing nothing."""
    module, data = COMMANDS[work.command]
    module_options, data_options = _options(module, "lit_align.modules"), _options(data, "lit_align.data")
    dropped = []
    for name, value in work.fields.items():
        if name in done:
            continue
        if name in FIELDS:
            place = FIELDS[name]
            if place.startswith("data.") and place[5:] not in data_options:
                if name not in SPEED_ONLY:
                    work.refuse(name, f"({data} has no {place[5:]!r})")
                continue
            if name == "model_revision" and value == "main":
                continue
            work.put(place, value, override=place.count(".") < 2)
            work.origin[place] = name
        elif name in module_options:
            work.origin[f"model.{name}"] = name
            given = work.model.get(name)  # model_init_kwargs over model_revision's, as TRL
            work.model[name] = {**given, **value} if isinstance(given, dict) and isinstance(value, dict) else value
        elif name in data_options:
            work.data[name] = value
            work.origin[f"data.{name}"] = name
        elif name in DROPPED:
            dropped.append(name)
        elif name in NO_EFFECT and value in NO_EFFECT[name]:
            continue
        elif name in REFUSED:
            work.refuse(name, f"({REFUSED[name]})")
        elif name in NO_EFFECT:
            work.refuse(name, f"is {value!r}: lit_align does what TRL does at {NO_EFFECT[name][0]!r} only")
        else:
            work.refuse(name, _unknown(work, name, module_options | data_options))
    return dropped


def _check_values(work: sections.Work) -> None:
    """The module's and the data module's own checks of the translated values (their types, then their
    ``__init__``), as ``lit-align fit`` would run them; the problem names the TRL field behind the option."""
    from jsonargparse import ArgumentParser

    from lit_align.errors import condensed
    from lit_align.data import AlignDataModule
    from lit_align.modules import AlignModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(AlignModule, "model")
    parser.add_subclass_arguments(AlignDataModule, "data")
    try:
        parsed = parser.parse_object(copy.deepcopy({"model": work.config["model"], "data": work.config["data"]}))
        parser.instantiate_classes(parsed)
    except Exception as exc:  # noqa: BLE001 - jsonargparse wraps what the classes raise
        cause, depth = exc, 0
        while cause is not None and not isinstance(cause, LitAlignError) and depth < 20:
            cause, depth = cause.__cause__ or cause.__context__, depth + 1
        cause = cause if isinstance(cause, LitAlignError) else None
        message = str(cause) if cause is not None else condensed(str(exc), [])
        message = message.replace(".init_args.", ".")
        if "cannot import it" in message or "pip install" in message:  # code or a package the run's machine has,
            work.notes.append(f"not checked: {message.split(': pip install')[0]}; lit-align fit needs it")  # maybe
            return                                                                                    # not this one
        behind = [trl for place, trl in work.origin.items() if re.search(rf"\b{re.escape(place)}\b", message)]
        named = re.search(r"\b(?:model|data)\.(\w+)", message)  # an option under TRL's own name
        if not behind and named and named.group(1) in trl_fields(work.command):
            behind = [named.group(1)]
        work.problems.append(f"{behind[0]!r}: {message}" if behind else message)


def _normalized(fields: dict, notes: list[str]) -> dict:
    """The fields under TRL's current names (``OLDER_NAMES``), YAML's ``1e-5`` as the number TRL reads."""
    out = {}
    for name, value in copy.deepcopy(fields).items():
        new = OLDER_NAMES.get(name, name)
        if new != name and new in fields:
            notes.append(f"dropped {name} (TRL's older name of {new!r}, which the file sets too)")
            continue
        out[new] = float(value) if isinstance(value, str) and EXPONENT.fullmatch(value) else value
    return out


def translate(command: str, fields: dict, source: str = "the TRL config", notes: list[str] | None = None) -> dict:
    """The lit_align config (``lit-align fit -c``) of the TRL config ``fields`` for ``trl <command>``; what was
    dropped, and why, is appended to ``notes``."""
    if command not in COMMANDS:
        raise LitAlignError(f"unknown TRL command {command!r}: expected one of {sorted(COMMANDS)}")
    if not isinstance(fields, dict):
        got = "an empty file" if fields is None else f"a {type(fields).__name__}"
        raise LitAlignError(f"{source}: expected a mapping of TRL's fields, got {got}")
    module, data = COMMANDS[command]
    config = {"model": {"class_path": f"lit_align.modules.{module}", "init_args": {}},
              "data": {"class_path": f"lit_align.data.{data}", "init_args": {}}, "trainer": {}}
    said = [] if notes is None else notes
    work = sections.Work(command, {**TRL_DEFAULTS, **_normalized(fields, said)}, config)
    if work.fields.get("dtype", "") is None:  # TRL's null: transformers' default, float32 (lit_align's)
        del work.fields["dtype"]
    for name, older, now in OLDER_VALUES:
        if work.fields.get(name) == older and type(work.fields[name]) is type(older):
            work.fields[name] = now
    _check_kinds(work)
    done = set().union(*(section(work) for section in SECTIONS)) | _recipe(work)
    seed = work.fields.get("data_seed")
    work.data["seed"] = work.fields["seed"] if seed is None else seed  # TRL's seed orders the data too
    dropped = _place(work, done | {"data_seed"})
    if not work.problems:  # lit_align's own checks of the values, named by TRL's fields
        _check_values(work)
    if work.problems:
        raise LitAlignError(f"{source}: cannot translate {len(work.problems)} field(s): {'; '.join(work.problems)} "
                            "(docs/trl_configs.md lists what translates)")
    reasons: dict[str, list[str]] = {}
    for name in dropped:
        reasons.setdefault(DROPPED[name], []).append(name)
    work.notes[:0] = [f"dropped {', '.join(names)} ({why})" for why, names in reasons.items()]
    said.extend(work.notes)
    return config
