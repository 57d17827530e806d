"""TRL config files as lit_align configs: ``lit-align from-trl COMMAND --config FILE [--field value ...] [-o OUT]``,
TRL's own command line with ``trl`` replaced.

A TRL config file is what ``trl <command> --config FILE`` reads: one flat mapping of the fields of TRL's
``ScriptArguments`` (the dataset), ``ModelConfig`` (the model, LoRA) and the command's trainer config (a
``TrainingArguments``: ``DistillationConfig``, ``GRPOConfig``, ...). ``translate`` sorts each field into a
LightningCLI config for the command's module (``COMMANDS``):

- a field the module or the data module takes under the same name goes there as it is (``beta``, ``learning_rate``,
  ``num_generations``, ``max_length``, ...: lit_align's recipes take TRL's names, with TRL's meanings);
- the fields that have a place of another name are moved (``FIELDS``: ``model_name_or_path`` -> ``model.model``,
  ``per_device_train_batch_size`` -> ``data.batch_size``, ``gradient_accumulation_steps`` ->
  ``trainer.accumulate_grad_batches``, ...), a few with their value translated too (``_special``: the output
  directory, precision, evaluation, checkpoints, the logger, LoRA, quantization; ``_recipe``: what one command reads
  differently, e.g. GRPO's evaluation batch counting completions);
- fields that change nothing here are dropped (``NO_EFFECT``) while they hold a value that needs nothing;
- anything else is refused, all such fields in one ``error:`` line naming the file: a translation that silently drops
  a setting would train something else than the user's TRL run.

Where TRL's default for a field the file leaves out would differ from what lit_align does without it, the
translation writes TRL's (``TRL_DEFAULTS``, ``_recipe``): three epochs, seed 42, a log line every 10 steps, clipping
at 1.0, bf16 mixed precision (unless ``fp16``), no evaluation (and no test split read); for the online recipes a round
of ``gradient_accumulation_steps`` steps (TRL's ``steps_per_generation`` default) and uncut prompts; GRPO's and RLOO's
dropout left on. docs/trl_configs.md is the user's table of all of it.
"""

from __future__ import annotations

import argparse
import copy
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from lit_align.errors import LitAlignError
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
}

# fields that change nothing here, and the values at which dropping them loses nothing (None: any value)
NO_EFFECT = {
    "overwrite_output_dir": None, "logging_dir": None, "logging_strategy": None, "logging_first_step": None,
    "do_train": None, "do_eval": None, "remove_unused_columns": None, "save_only_model": None, "run_name": None,
    "dataloader_pin_memory": None, "log_level": None, "ignore_bias_buffers": None, "ddp_timeout": None,
    "gradient_checkpointing_kwargs": None, "hub_model_id": None, "hub_strategy": None, "hub_private_repo": None,
    "hub_token": None,  # push_to_hub: true is refused
    "ds3_gather_for_generation": None, "pad_to_multiple_of": None, "log_unique_prompts": None,
    "log_multimodal": None, "log_completions_hub_repo": None,
    "push_to_hub": (False,), "dataset_streaming": (False,), "use_bnb_nested_quant": None,
    "bnb_4bit_quant_type": None, "bnb_4bit_quant_storage": None,  # read under load_in_4bit (``_quantization``)
    "activation_offloading": (False,), "use_transformers_paged": (False,),
    "use_transformers_continuous_batching": (False,), "vllm_model_impl": ("vllm",), "loss_type": ("nll",),
    "dataset_text_field": ("text",), "adam_beta1": (0.9,), "adam_beta2": (0.999,), "adam_epsilon": (1e-8,),
    "use_liger_kernel": (False,), "eval_on_start": (False,), "load_best_model_at_end": (False,),
    "average_tokens_across_devices": (True,), "truncation_mode": ("keep_start",),
    "train_sampling_strategy": ("random",),
}
REFUSED = {"env": "set those environment variables in the shell, before lit-align fit"}  # why, where it helps
SPEED_ONLY = {"dataset_num_proc", "dataloader_num_workers"}  # dropped where the data module has no such option
LORA = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
        "lora_target_modules": "target_modules", "lora_target_parameters": "target_parameters",
        "lora_modules_to_save": "modules_to_save", "lora_task_type": "task_type", "use_rslora": "use_rslora",
        "use_dora": "use_dora"}
TRL_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}  # ModelConfig's lora_r, lora_alpha, lora_dropout
LOGGERS = {"tensorboard": "lightning.pytorch.loggers.TensorBoardLogger", "wandb": "lightning.pytorch.loggers.WandbLogger",
           "mlflow": "lightning.pytorch.loggers.MLFlowLogger", "comet_ml": "lightning.pytorch.loggers.CometLogger"}
# TrainingArguments' defaults where LightningCLI's differ, written when the file leaves them out
TRL_DEFAULTS = {"num_train_epochs": 3, "seed": 42, "logging_steps": 10, "max_grad_norm": 1.0}
GROUPED = {"grpo": 8, "rloo": 2}  # the recipes sampling groups: TRL's num_generations (num_generations_eval's too)
LIST_FIELDS = {"lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "reward_funcs",
               "reward_weights", "report_to"}  # TRL's nargs="+" fields: one value on its command line is a list
TEXT_FIELDS = {"dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "model_revision",
               "teacher_model_revision", "run_name", "output_dir", "model_name_or_path", "teacher_model_name_or_path"}
EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")  # 1e-5: YAML 1.1 reads it as text, TRL as a number
ONLINE = {"grpo", "rloo", "distillation"}  # TRL samples steps_per_generation steps at once (default: the accumulation)


def _options(class_name: str, package: str) -> set[str]:
    """Every option of ``package.class_name`` (its ``__init__``'s and its bases')."""
    return set(recipe_defaults(import_object(f"{package}.{class_name}")))


def _put(config: dict, dotted: str, value: Any, override: bool = True) -> None:
    """``config[a][b]... = value`` for ``dotted`` ``"a.b..."``, under ``init_args`` for the model and the data
    (``override`` false: only where there is no such key yet)."""
    keys = dotted.split(".")
    if keys[0] in ("model", "data"):
        keys.insert(1, "init_args")
    node = config
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if override or keys[-1] not in node:
        node[keys[-1]] = value


def _whole(fields: dict, name: str) -> int:
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise LitAlignError(f"field {name!r} is {value!r}: expected a whole number here (lit_align counts whole "
                            "epochs and steps)")
    return int(value)


def _special(fields: dict, config: dict) -> set[str]:
    """The fields whose value is translated too: written into ``config``; the names handled."""
    done = set()
    out = fields.get("output_dir")
    if out is not None:  # TRL's run directory; its final model is an HF directory inside it
        config["trainer"]["default_root_dir"] = out
        config["export"] = {"path": str(Path(out) / "hf_model")}
    done.add("output_dir")
    fields["logging_steps"] = _whole(fields, "logging_steps")
    steps = fields.get("max_steps")
    if steps is not None and steps > 0:  # TRL: max_steps overrides num_train_epochs
        config["trainer"]["max_epochs"] = -1
    else:
        config["trainer"]["max_epochs"] = _whole(fields, "num_train_epochs")
        fields.pop("max_steps", None)  # -1 (TRL's default) or none: no step limit
    done.add("num_train_epochs")
    bf16 = fields.get("bf16")
    if bf16 and fields.get("fp16"):
        raise LitAlignError("fields 'bf16' and 'fp16' are both true: expected at most one")
    if bf16 or (bf16 is None and not fields.get("fp16")):  # TRL's default (None): bf16 unless fp16
        config["trainer"]["precision"] = "bf16-mixed"
    elif fields.get("fp16"):
        config["trainer"]["precision"] = "16-mixed"
    done |= {"bf16", "fp16"}
    if fields.get("use_cpu"):
        config["trainer"]["accelerator"] = "cpu"
    done.add("use_cpu")
    if "disable_tqdm" in fields:
        config["trainer"]["enable_progress_bar"] = not fields["disable_tqdm"]
    done.add("disable_tqdm")
    if fields.get("use_vllm"):
        config["model"]["init_args"]["engine"] = "vllm"
    done.add("use_vllm")
    if fields.get("log_completions"):
        every = {"every_n_steps": fields["logging_steps"]}
        if "num_completions_to_print" in fields:
            every["num_completions_to_print"] = fields["num_completions_to_print"]
        config["trainer"].setdefault("callbacks", []).append(
            {"class_path": "lit_align.callbacks.CompletionsLogger", "init_args": every})
    done |= {"log_completions", "num_completions_to_print"}
    done |= _quantization(fields, config)
    done |= _evaluation(fields, config)
    done |= _checkpoints(fields, config)
    done |= _logger(fields, config, out)
    done |= _lora(fields, config)
    warmup = fields.get("warmup_steps")
    if isinstance(warmup, float) and 0 < warmup < 1:  # transformers: a warmup_steps below 1 is a ratio
        config["model"]["init_args"]["warmup_ratio"] = warmup
        done.add("warmup_steps")
    return done


def _lora(fields: dict, config: dict) -> set[str]:
    """``use_peft`` and the ``lora_*`` fields as ``model.peft_config``, with ``ModelConfig``'s defaults (not peft's:
    r 8, alpha 8, no dropout); without ``use_peft`` TRL reads none of them."""
    if fields.get("use_peft"):
        config["model"]["init_args"]["peft_config"] = {**TRL_LORA, **{LORA[k]: fields[k] for k in LORA if k in fields}}
    return {"use_peft", *LORA}


def _recipe(command: str, fields: dict, config: dict) -> set[str]:
    """What one command's TRL fields mean here beyond their names: the fields handled."""
    model, data, done = config["model"]["init_args"], config["data"]["init_args"], set()
    if (command in ONLINE and "steps_per_generation" not in fields and "generation_batch_size" not in fields
            and "gradient_accumulation_steps" in fields):  # one round an optimizer step, as TRL's generation batch
        model["steps_per_generation"] = fields["gradient_accumulation_steps"]
    if command == "sft":  # SFTTrainer shuffles the dataset once before training; its sampler shuffles anyway
        done.add("shuffle_dataset")
    if command in ONLINE and "max_length" not in fields:  # TRL 1.16 does not cut the prompts of online recipes
        data["max_length"] = None
    if command in GROUPED:
        if "disable_dropout" not in fields:
            model["disable_dropout"] = False  # TRL's default (lit_align's own is true)
        if fields.get("reward_model_name_or_path") is not None:  # TRL puts the reward model first
            funcs = fields.get("reward_funcs") or []
            model["reward_funcs"] = [fields["reward_model_name_or_path"], *([funcs] if isinstance(funcs, str)
                                                                            else funcs)]
            done.add("reward_funcs")
        done.add("reward_model_name_or_path")
        if fields.get("eval_strategy", "no") != "no":  # TRL samples num_generations_eval per prompt, its eval
            group = (fields.get("num_generations_eval") or fields.get("num_generations")  # batch counts them
                     or GROUPED[command])
            per_device = fields.get("per_device_eval_batch_size", 8)
            if per_device % group:
                raise LitAlignError(f"field 'per_device_eval_batch_size' is {per_device}: expected a multiple of the "
                                    f"{group} completions sampled per evaluation prompt (num_generations_eval)")
            model["num_generations_eval"], data["val_batch_size"] = group, per_device // group
            done |= {"num_generations_eval", "per_device_eval_batch_size"}
    return done


def _quantization(fields: dict, config: dict) -> set[str]:
    """``load_in_4bit`` / ``load_in_8bit``: the student loaded through bitsandbytes (``model_init_kwargs``'
    ``quantization_config``, lit_align's QLoRA), with the arguments TRL's ``get_quantization_config`` gives it."""
    if fields.get("load_in_4bit"):
        quantization = {"load_in_4bit": True, "bnb_4bit_compute_dtype": fields.get("dtype", "float32"),
                        "bnb_4bit_quant_type": fields.get("bnb_4bit_quant_type", "nf4"),
                        "bnb_4bit_use_double_quant": bool(fields.get("use_bnb_nested_quant", False))}
        if fields.get("bnb_4bit_quant_storage") is not None:
            quantization["bnb_4bit_quant_storage"] = fields["bnb_4bit_quant_storage"]
    elif fields.get("load_in_8bit"):
        quantization = {"load_in_8bit": True}
    else:
        return {"load_in_4bit", "load_in_8bit"}
    _put(config, "model.model_init_kwargs.quantization_config", quantization)
    return {"load_in_4bit", "load_in_8bit"}


def _evaluation(fields: dict, config: dict) -> set[str]:
    """``eval_strategy`` / ``eval_steps``: TRL evaluates every ``eval_steps`` optimizer steps (``steps``), each
    epoch, or never (``no``, its default); Lightning's ``val_check_interval`` counts batches, optimizer steps
    times ``accumulate_grad_batches``."""
    strategy = fields.get("eval_strategy", "no")
    trainer = config["trainer"]
    trainer["num_sanity_val_steps"] = 0  # TRL evaluates before training only with eval_on_start
    if strategy == "no":  # nor is the test split read
        trainer["limit_val_batches"] = 0
        _put(config, "data.val_split", None)
    elif strategy == "steps":
        steps = fields.get("eval_steps")
        steps = fields["logging_steps"] if steps is None else steps  # TRL: None is logging_steps
        if isinstance(steps, float) and not steps.is_integer():
            raise LitAlignError(f"field 'eval_steps' is {steps!r}: expected a whole number of steps (TRL's ratio of "
                                "the run's steps has no equivalent here)")
        trainer["val_check_interval"] = int(steps) * int(fields.get("gradient_accumulation_steps", 1))
        trainer["check_val_every_n_epoch"] = None
    elif strategy == "epoch":
        trainer["check_val_every_n_epoch"] = 1
    else:
        raise LitAlignError(f"field 'eval_strategy' is {strategy!r}: expected 'no', 'steps' or 'epoch'")
    return {"eval_strategy", "eval_steps"} | ({"dataset_test_split"} if strategy == "no" else set())


def _checkpoints(fields: dict, config: dict) -> set[str]:
    """``save_strategy`` / ``save_steps`` / ``save_total_limit`` as a ``ModelCheckpoint``; left out, Lightning's
    default checkpoint (the last one)."""
    strategy = fields.get("save_strategy")
    if strategy is None and "save_steps" not in fields and "save_total_limit" not in fields:
        return {"save_strategy"}
    strategy = strategy or "steps"
    if strategy == "no":
        config["trainer"]["enable_checkpointing"] = False
    elif strategy in ("steps", "epoch"):
        every = ({"every_n_train_steps": _whole(fields, "save_steps") if "save_steps" in fields else 500}
                 if strategy == "steps" else {"every_n_epochs": 1})
        limit = fields.get("save_total_limit")
        every["save_top_k"] = -1 if limit is None else int(limit)
        if limit is not None:
            every["monitor"] = "step"
            every["mode"] = "max"
        config["trainer"].setdefault("callbacks", []).append(
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": every})
    else:
        raise LitAlignError(f"field 'save_strategy' is {strategy!r}: expected 'no', 'steps' or 'epoch' ('best' has "
                            "no equivalent here)")
    return {"save_strategy", "save_steps", "save_total_limit"}


def _logger(fields: dict, config: dict, out: str | None) -> set[str]:
    """``report_to`` as Lightning loggers (``none``: no logger); ``run_name`` names them. Left out (TRL's default
    ``none``, its metrics on the console only), lit_align's default logger: it costs nothing and keeps them."""
    if "report_to" not in fields:
        return {"report_to"}
    names = fields["report_to"]
    names = [n for n in ([names] if isinstance(names, str) else names or []) if n != "none"]
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise LitAlignError(f"field 'report_to' names {unknown}: expected 'none' or some of {sorted(LOGGERS)}")
    loggers = []
    for name in names:
        args = {"save_dir": out or "runs"} if name == "tensorboard" else {}
        if fields.get("run_name") is not None:
            args["name" if name != "mlflow" else "run_name"] = fields["run_name"]
        loggers.append({"class_path": LOGGERS[name], "init_args": args} if args else {"class_path": LOGGERS[name]})
    config["trainer"]["logger"] = False if not loggers else loggers[0] if len(loggers) == 1 else loggers
    return {"report_to"}


def translate(command: str, fields: dict, source: str = "the TRL config") -> dict:
    """The lit_align config (``lit-align fit -c``) of the TRL config ``fields`` for ``trl <command>``."""
    if command not in COMMANDS:
        raise LitAlignError(f"unknown TRL command {command!r}: expected one of {sorted(COMMANDS)}")
    if not isinstance(fields, dict):
        got = "an empty file" if fields is None else f"a {type(fields).__name__}"
        raise LitAlignError(f"{source}: expected a mapping of TRL's fields, got {got}")
    module, data = COMMANDS[command]
    config = {"model": {"class_path": f"lit_align.modules.{module}", "init_args": {}},
              "data": {"class_path": f"lit_align.data.{data}", "init_args": {}}, "trainer": {}}
    fields = {**TRL_DEFAULTS, **{k: _number(v) for k, v in copy.deepcopy(fields).items()}}
    try:
        done = _special(fields, config) | _recipe(command, fields, config)
    except LitAlignError as exc:
        raise LitAlignError(f"{source}: {exc}") from None
    module_options, data_options = _options(module, "lit_align.modules"), _options(data, "lit_align.data")
    seed = fields.get("data_seed")
    config["data"]["init_args"]["seed"] = fields["seed"] if seed is None else seed  # TRL's seed orders the data too
    done.add("data_seed")
    refused = []
    for name, value in fields.items():
        if name in done:
            continue
        if name in FIELDS:
            place = FIELDS[name]
            if place.startswith("data.") and place[5:] not in data_options:
                if name not in SPEED_ONLY:
                    refused.append(f"{name!r} ({data} has no {place[5:]!r})")
                continue
            if name == "model_revision" and value == "main":
                continue
            _put(config, place, value, override=place.count(".") < 2)
        elif name in module_options:
            given = config["model"]["init_args"].get(name)  # model_init_kwargs over model_revision's, as TRL
            config["model"]["init_args"][name] = {**given, **value} if isinstance(given, dict) and isinstance(
                value, dict) else value
        elif name in data_options:
            config["data"]["init_args"][name] = value
        elif name in NO_EFFECT and (NO_EFFECT[name] is None or value in NO_EFFECT[name]):
            continue
        else:
            why = f" ({REFUSED[name]})" if name in REFUSED else f" (set to {value!r})" if name in NO_EFFECT else ""
            refused.append(repr(name) + why)
    if refused:
        raise LitAlignError(f"{source}: no lit_align equivalent for field(s) {', '.join(refused)} (docs/trl_configs.md "
                            "lists what translates)")
    return config


def _number(value: Any) -> Any:
    """A file's ``1e-5`` (text to YAML 1.1, a number to TRL's parser) as the number; anything else as it is."""
    return float(value) if isinstance(value, str) and EXPONENT.fullmatch(value) else value


def _value(text: str) -> Any:
    """A command-line value typed by its text (TRL's parser types it by its field): a bool, an int, a float,
    None, a YAML list or mapping (``--model_init_kwargs '{"revision": "v2"}'``), else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text in ("None", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            pass
    return text


def command_line_fields(tokens: list[str]) -> dict:
    """TRL's command-line fields: ``--name value``, ``--name=value``, ``--name a b c`` (a list, TRL's ``nargs="+"``
    fields), a bare ``--name`` (true, as TRL's boolean flags)."""
    fields, name = {}, None
    for token in tokens:
        if token.startswith("--"):
            name, _, value = token[2:].partition("=")
            fields[name] = [_value(value)] if value else []
        elif name is None:
            raise LitAlignError(f"command line: {token!r} follows no --field (TRL's fields are --name value)")
        else:
            fields[name].append(_value(token))
    typed = {}
    for name, values in fields.items():
        if name in TEXT_FIELDS:  # a dataset config "2020" stays text
            values = [str(v) if not isinstance(v, str) else v for v in values]
        typed[name] = (True if not values else values if name in LIST_FIELDS or len(values) > 1 else values[0])
    return typed


def main(argv: list[str]) -> None:
    """``lit-align from-trl COMMAND [--config FILE] [--field value ...] [-o OUT]``: TRL's command line, the fields
    given after the file overriding it (as in TRL); the config on standard output, or written to ``OUT``."""
    parser = argparse.ArgumentParser(
        prog="lit-align from-trl", usage="lit-align from-trl COMMAND [--config FILE] [--field value ...] [-o OUT]",
        description="Translate a TRL run (`trl COMMAND --config FILE --field value ...`) into a lit_align config for "
                    "`lit-align fit -c`; a field without a lit_align equivalent is refused. docs/trl_configs.md has "
                    "the table.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="the trl command")
    parser.add_argument("--config", help="the TRL config file (YAML), as `trl COMMAND --config FILE` reads it")
    parser.add_argument("-o", "--output", help="write the lit_align config here (default: standard output)")
    args, rest = parser.parse_known_args(argv)
    source = args.config or "the command line"
    try:
        fields = {}
        if args.config is not None:
            try:
                fields = yaml.safe_load(Path(args.config).read_text())
            except OSError as exc:
                raise LitAlignError(f"{args.config}: {exc.strerror or exc}") from None
            except yaml.YAMLError as exc:
                raise LitAlignError(f"{args.config}: not YAML ({' '.join(str(exc).split())})") from None
        given = command_line_fields(rest)
        if isinstance(fields, dict):
            fields = {**fields, **given}
            if given and args.config is not None:
                source = f"{args.config} with the command line"
        text = (f"# lit-align from-trl {shlex.join(argv)}\n"
                + yaml.safe_dump(translate(args.command, fields, source), sort_keys=False, default_flow_style=False))
        if args.output is None:
            sys.stdout.write(text)
            return
        if args.config is not None and Path(args.output).resolve() == Path(args.config).resolve():
            raise LitAlignError(f"-o {args.output} is the TRL config itself: write the translation to another file")
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise LitAlignError(f"{args.output}: {exc.strerror or exc}") from None
    except LitAlignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.output}: lit-align fit -c {args.output}", file=sys.stderr)
