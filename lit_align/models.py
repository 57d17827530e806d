"""Loading Hugging Face causal LMs and tokenizers, and the built-in offline models.

Anything ``from_pretrained`` accepts works: a hub name (``Qwen/Qwen2.5-0.5B-Instruct``) or a local directory. The
built-in models are spelled ``builtin:tiny`` (about 0.8M parameters) and ``builtin:small`` (about 10M): a Llama-style
network and a character-level tokenizer, built by code from a seed and written in Hugging Face format into a cache
directory, so that the very same ``from_pretrained`` path is exercised offline. A ``.gguf`` file and a named
pretrained model (``pretrained:smollm2-135m-instruct``) resolve to a plain directory too (``lit_align.pretrained``).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lit_align.errors import LitAlignError, one_line
from lit_align.pretrained import (
    PRETRAINED, PRETRAINED_PREFIX, build_once, cache_dir, gguf_path, gguf_to_hf, is_gguf, named_gguf, save_hf,
)

BUILTIN_PREFIX = "builtin:"

# name -> LlamaConfig overrides. Both share the character-level tokenizer below.
BUILTIN_MODELS = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4),
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6),
}

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
# One token per printable ASCII character (minus the form feed and vertical tab).
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c\r"]

# A minimal chat template: role marker, content, and EOS after each assistant turn (the model learns to stop there).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# ``CHAT_TEMPLATE`` plus tools (``chat_template: builtin:tools``): without tools it renders the same text. The tools are
# one line of signatures, ``<|system|>tools: add(a, b)``; an assistant turn's calls follow its content as Qwen's
# ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what ``lit_align.generation.tools`` parses), and a
# tool's result is a ``<|tool|>`` turn.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>tools: ' }}{% for tool in tools %}"
    "{% set f = tool.function if tool.function is defined else tool %}"
    "{{ f.name + '(' + (f.parameters.properties | list | join(', ')) + ')' }}{% if not loop.last %}{{ '; ' }}{% endif %}"
    "{% endfor %}{{ '\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}{% set f = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}{{ '}</tool_call>' }}"
    "{%- endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Gemma's turns (its instruction-tuned models' template: a system message leads the first user turn, the assistant is
# ``model``), for a Gemma model that has no template (the base models). An assistant turn ends with EOS after
# ``<end_of_turn>`` (not a newline), so the model learns to stop where lit_align's engines stop: the tokenizer's EOS.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{%- for message in turns %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# chat templates by name (``chat_template: builtin:tools``): for a model without one, or to replace its own
NAMED_CHAT_TEMPLATES = {
    BUILTIN_PREFIX + "chat": CHAT_TEMPLATE,  # the built-in models' own: role markers, EOS after each assistant turn
    BUILTIN_PREFIX + "tools": TOOL_CHAT_TEMPLATE,
    BUILTIN_PREFIX + "gemma": GEMMA_CHAT_TEMPLATE,
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in character-level tokenizer: one id per printable ASCII character, no merges."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_builtin(name: str, path: str | Path, seed: int = 0) -> Path:
    """Build the built-in model ``name`` with weights drawn from ``seed`` and save model + tokenizer at ``path``."""
    if name not in BUILTIN_MODELS:
        raise LitAlignError(f"unknown built-in model {BUILTIN_PREFIX}{name}: expected one of {sorted(BUILTIN_MODELS)}")
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **BUILTIN_MODELS[name],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    path = Path(path)
    save_hf(model, tokenizer, path)
    return path


def resolve(name_or_path: str) -> str:
    """Map ``builtin:<name>`` to its directory (building it once), a ``.gguf`` file or ``pretrained:<name>`` to the
    plain directory converted from it (once); leave anything else untouched."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        name = name_or_path[len(BUILTIN_PREFIX):]
        return str(build_once(cache_dir() / "builtin" / name, lambda tmp: build_builtin(name, tmp)))
    if name_or_path.startswith(PRETRAINED_PREFIX):
        return str(gguf_to_hf(named_gguf(name_or_path[len(PRETRAINED_PREFIX):])))
    if is_gguf(name_or_path):
        return str(gguf_to_hf(name_or_path))
    return name_or_path


# a local model directory has one of these (a model, a PEFT adapter, or a tokenizer alone)
MODEL_DIR_FILES = ("config.json", "adapter_config.json", "tokenizer_config.json", "tokenizer.json")


def check_loadable(name_or_path: str, what: str) -> str:
    """Resolve built-ins; reject a local-looking path that does not exist before transformers tries the hub."""
    path = resolve(name_or_path)
    local = Path(path).expanduser()
    if local.is_dir():
        if not any((local / name).is_file() for name in MODEL_DIR_FILES):
            raise LitAlignError(f"{what} {name_or_path!r}: the directory has none of {list(MODEL_DIR_FILES)} (expected "
                                "a Hugging Face model directory, as save_pretrained writes it)")
        return str(local)
    if local.is_file():  # a .gguf file is converted before this (``pretrained.gguf_path``)
        raise LitAlignError(f"{what} {name_or_path!r} is a file, not a model: give the directory that holds it (a "
                            "Hugging Face model directory), or a .gguf file")
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or local.exists():
        raise LitAlignError(
            f"{what} {name_or_path!r}: no such directory (expected a Hugging Face model directory, a .gguf file, a "
            f"hub name like 'org/name', or one of {[BUILTIN_PREFIX + n for n in BUILTIN_MODELS]} "
            f"{[PRETRAINED_PREFIX + n for n in PRETRAINED]})"
        )
    return path


def read_chat_template(chat_template: str) -> str:
    """A chat template given as a file (``.jinja``, ``.j2``, ``.txt``, or any existing file), as the template, or by
    name (``NAMED_CHAT_TEMPLATES``: ``builtin:chat``, ``builtin:tools``, ``builtin:gemma``)."""
    if chat_template in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[chat_template]
    if chat_template.startswith(BUILTIN_PREFIX):
        raise LitAlignError(f"chat_template {chat_template!r}: no such named template (expected one of "
                            f"{sorted(NAMED_CHAT_TEMPLATES)}, a Jinja template file, or the template itself)")
    path = Path(chat_template).expanduser()
    if "{" not in chat_template or path.suffix in (".jinja", ".j2"):
        if not path.is_file():
            raise LitAlignError(f"chat_template {chat_template!r}: no such file (expected a Jinja template file, or "
                                "the template itself)")
        return path.read_text(encoding="utf-8")
    return chat_template


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, chat_template: str | None = None,
                   eos_token: str | None = None):
    """Load a tokenizer; give it a pad token (EOS) if it has none, as TRL does; ``chat_template`` (a file or the
    template) replaces its own; ``eos_token`` (one of its tokens) its EOS, as TRL's ``SFTConfig.eos_token``."""
    path = check_loadable(name_or_path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; the user needs one line
        raise LitAlignError(f"could not load tokenizer {name_or_path!r}: {one_line(exc)}") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise LitAlignError(f"tokenizer {name_or_path!r} has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    if eos_token is not None:
        if eos_token not in tokenizer.get_vocab():
            raise LitAlignError(f"eos_token {eos_token!r} is not a token of tokenizer {name_or_path!r} (expected one "
                                "of its tokens, e.g. its chat template's end of turn)")
        tokenizer.eos_token = eos_token
    return tokenizer


def use_eos_token(model, tokenizer) -> None:
    """The model stops where ``tokenizer`` ends a turn: its config's EOS, and its generation config's first (the
    ones it had kept after it), as TRL's ``SFTTrainer`` sets them for an ``eos_token``."""
    eos = tokenizer.eos_token_id
    model.config.eos_token_id = eos
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        known = generation.eos_token_id
        known = [] if known is None else [known] if isinstance(known, int) else list(known)
        generation.eos_token_id = [eos, *(k for k in known if k != eos)]


DTYPES = ("float32", "bfloat16", "float16", "auto")
DEFAULT_DTYPE = "float32"  # TRL's where none is given (transformers' own default is the checkpoint's)
DTYPE_KEYS = ("dtype", "torch_dtype")  # ``model_init_kwargs``' names for it: transformers' and its older one


def check_dtype(dtype: str | None, option: str) -> str:
    """``dtype`` as one of ``DTYPES`` or another floating torch dtype's name (``float64``: the numerics tests);
    None (TRL's "not set") is ``DEFAULT_DTYPE``. ``option`` names it in errors."""
    if dtype is None:
        return DEFAULT_DTYPE
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if dtype not in DTYPES and not (isinstance(named, torch.dtype) and named.is_floating_point):
        raise LitAlignError(f"{option} {dtype!r}: expected one of {', '.join(DTYPES)} (or null: {DEFAULT_DTYPE})")
    return dtype


def init_kwargs_dtype(model_init_kwargs: dict | None, option: str = "model.model_init_kwargs") -> str | None:
    """The dtype ``model_init_kwargs`` set, TRL's way (``dtype``, or ``torch_dtype``), checked; None where it sets
    none (or null)."""
    given = {key: (model_init_kwargs or {}).get(key) for key in DTYPE_KEYS}
    given = {key: check_dtype(value, f"{option}.{key}") for key, value in given.items() if value is not None}
    if len(set(given.values())) > 1:
        raise LitAlignError(f"{option}: dtype {given['dtype']!r} and torch_dtype {given['torch_dtype']!r} disagree "
                            "(torch_dtype is the older name of dtype: give one)")
    return next(iter(given.values()), None)


def model_dtype(dtype: str | None, model_init_kwargs: dict | None) -> str:
    """The dtype a model loads in: ``model_init_kwargs``' (``dtype`` or ``torch_dtype``, TRL's place for it) where
    set, else ``dtype`` (``model.dtype``; None: float32). What a cache of the model's outputs is keyed by."""
    return init_kwargs_dtype(model_init_kwargs) or check_dtype(dtype, "model.dtype")


def from_pretrained_kwargs(model_init_kwargs: dict | None, option: str = "model.model_init_kwargs") -> dict:
    """``model_init_kwargs`` as ``from_pretrained`` takes them: a ``quantization_config`` mapping becomes a
    ``BitsAndBytesConfig``; the dtype (``dtype`` or ``torch_dtype``) is checked and left to ``load_model``; the
    settings lit_align has its own option for are refused (one place for each). ``option``: the setting they came
    from, in errors."""
    init_kwargs_dtype(model_init_kwargs, option)
    kwargs = {key: value for key, value in (model_init_kwargs or {}).items() if key not in DTYPE_KEYS}
    kwargs.pop("gguf_file", None)  # folded into the model's path (gguf_path)
    clash = sorted({"attn_implementation", "trust_remote_code"} & set(kwargs))
    if clash:
        raise LitAlignError(f"{option}: {clash} have their own options (model.attn_implementation, "
                            "model.trust_remote_code)")
    if isinstance(kwargs.get("quantization_config"), dict):
        from transformers import BitsAndBytesConfig

        try:
            kwargs["quantization_config"] = BitsAndBytesConfig(**kwargs["quantization_config"])
        except (TypeError, ValueError) as exc:
            raise LitAlignError(f"{option}.quantization_config: {one_line(exc)}") from exc
    return kwargs


def load_model(
    name_or_path: str,
    dtype: str | None = DEFAULT_DTYPE,
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    model_init_kwargs: dict | None = None,
    auto_class=AutoModelForCausalLM,
):
    """Load a causal LM (or, with ``auto_class``, another head: a reward model's sequence classifier) by hub name,
    local directory or ``builtin:<name>``.

    Args:
        name_or_path: what ``AutoModelForCausalLM.from_pretrained`` takes, ``builtin:tiny`` / ``builtin:small``, a
            ``.gguf`` file or ``pretrained:<name>`` (loaded from a plain directory converted once; float weights).
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (the checkpoint's); None:
            float32, TRL's default. ``model_init_kwargs``' ``dtype`` (or ``torch_dtype``, its older name), TRL's
            place for it, wins where it is set (null there: not set).
        attn_implementation: ``sdpa``, ``eager``, ``flash_attention_2``, ... (None: transformers' default).
        model_init_kwargs: more ``from_pretrained`` arguments (TRL's name), e.g. ``device_map``, ``revision``, config
            overrides, ``quantization_config`` (a mapping of ``BitsAndBytesConfig`` arguments, for QLoRA), or
            ``gguf_file`` (a ``.gguf`` file inside the directory ``name_or_path``, the transformers way).
            ``use_kernels`` is false unless given: transformers would otherwise fetch Hugging Face Hub kernels when
            the model first runs in train mode on a GPU (no network: the run stops there).
    """
    dtype = model_dtype(dtype, model_init_kwargs)
    path = check_loadable(gguf_path(name_or_path, model_init_kwargs), "model")
    if (model_init_kwargs or {}).get("num_labels") is not None:
        check_num_labels(path, name_or_path, model_init_kwargs["num_labels"], trust_remote_code)
    try:
        return auto_class.from_pretrained(
            path,
            dtype=dtype if dtype == "auto" else getattr(torch, dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            **{"use_kernels": False, **from_pretrained_kwargs(model_init_kwargs)},
        )
    except Exception as exc:  # noqa: BLE001
        raise LitAlignError(f"could not load model {name_or_path!r}: {one_line(exc)}") from exc


def check_num_labels(path: str, name: str, num_labels: int, trust_remote_code: bool = False) -> None:
    """Refuse a sequence classifier whose head has another number of labels than asked for (a reward model's one):
    transformers would stop with a size mismatch pointing at a log. A causal LM is fine: it gets a new head."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - from_pretrained says what is wrong with it
        return
    classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if classifier and config.num_labels != num_labels:
        raise LitAlignError(f"model {name!r} is a sequence classifier with {config.num_labels} labels, not "
                            f"{num_labels} (a reward model has one output: give a causal LM, which gets a new head, or "
                            "a classifier with one label)")


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """TRL's ``cast_lm_head_to_fp32`` (ScaleRL): the LM head's weights in fp32 and its matmul in fp32 whatever the
    model's dtype or autocast; a tied input embedding keeps returning the model's dtype. The chunked log-probs
    (``lit_align.logps``) read the head's ``fp32_matmul`` flag and run its matmul in fp32 too."""
    head = model.get_output_embeddings()
    if head is None or type(head) is not torch.nn.Linear:
        raise LitAlignError(f"model.cast_lm_head_to_fp32: {type(model).__name__}'s LM head is not a plain Linear layer "
                            "(a LoRA adapter on lm_head, or another head type): it cannot be cast")
    dtype = head.weight.dtype
    head.float()
    head.fp32_matmul = True

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.float(), head.weight, head.bias)

    head.forward = forward
    embeddings = model.get_input_embeddings()
    if embeddings is not None and embeddings.weight is head.weight and dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))
