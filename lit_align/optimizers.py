"""Which optimizer a run steps with: TRL's names (``model.optim``) or any class the LightningCLI way
(``model.optimizer: {class_path, init_args}``).

Either way ``model.learning_rate`` and ``model.weight_decay`` are the optimizer's ``lr`` and ``weight_decay`` (TRL's
names; one owner each). ``model.optimizer``'s ``init_args`` set everything else; an ``lr`` or ``weight_decay`` there
that differs from the class's default (so the user set it) and from the model's is a second owner, and refused, as is
``model.optim`` chosen beside ``model.optimizer`` or an argument the class rejects: one error line each.
"""

from __future__ import annotations

import inspect

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_align.errors import LitAlignError

DEFAULT_OPTIM = "adamw_torch_fused"  # TRL's (transformers' on torch >= 2.8): AdamW in one kernel


def _bitsandbytes(name: str):
    def build(params, lr: float, weight_decay: float):
        try:
            import bitsandbytes
        except ImportError:
            raise LitAlignError(f"model.optim {name!r} needs bitsandbytes: pip install 'lit_align[bnb]'") from None
        cls = {"adamw_8bit": bitsandbytes.optim.AdamW8bit, "paged_adamw_8bit": bitsandbytes.optim.PagedAdamW8bit}[name]
        return cls(params, lr=lr, weight_decay=weight_decay)

    return build


def _adafactor(params, lr: float, weight_decay: float):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=lr, weight_decay=weight_decay, scale_parameter=False, relative_step=False)


# ``model.optim``: TRL's (transformers') optimizer names -> ``(params, lr, weight_decay) -> optimizer``
OPTIMIZERS = {
    "adamw_torch": lambda params, lr, weight_decay: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
    "adamw_torch_fused": lambda params, lr, weight_decay: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                                                             fused=True),
    "sgd": lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr, weight_decay=weight_decay),
    "adafactor": _adafactor,
    "adamw_8bit": _bitsandbytes("adamw_8bit"),
    "paged_adamw_8bit": _bitsandbytes("paged_adamw_8bit"),
}


def check_optimizer_choice(optim: str, optimizer) -> None:
    """Refuse an unknown ``model.optim``, or one chosen beside ``model.optimizer``."""
    if optim not in OPTIMIZERS:
        raise LitAlignError(f"model.optim {optim!r}: expected one of {sorted(OPTIMIZERS)} (or model.optimizer: "
                            "{class_path: ..., init_args: ...} for any torch optimizer)")
    if optimizer is not None and optim != DEFAULT_OPTIM:
        raise LitAlignError(f"model.optim {optim!r} and model.optimizer both choose the optimizer: set one")


def build_optimizer(optim: str, optimizer, params, learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer over ``params``: ``model.optimizer`` (a callable ``params -> optimizer``; from the CLI a
    ``functools.partial`` holding its ``init_args``) if given, else ``OPTIMIZERS[optim]``."""
    if optimizer is None:
        return OPTIMIZERS[optim](params, lr=learning_rate, weight_decay=weight_decay)
    params = list(params)
    built = _call(optimizer, params)  # the class's own check of init_args; and which class it is
    name = type(built).__name__
    defaults = {k: p.default for k, p in inspect.signature(type(built)).parameters.items()}
    given = getattr(optimizer, "keywords", None)  # None: a plain callable (Python), which chose every argument
    wanted = {}
    for key, setting, value in (("lr", "learning_rate", learning_rate), ("weight_decay", "weight_decay", weight_decay)):
        if key not in built.defaults:
            if value:
                raise LitAlignError(f"model.{setting} is {value}, but model.optimizer ({name}) takes no {key}")
            continue
        own = built.defaults[key]
        if own != value and (given is None or own != defaults.get(key)):
            raise LitAlignError(f"model.optimizer sets {key}={own}, but model.{setting} is {value}: set it once, as "
                                f"model.{setting} (lit_align gives it to every optimizer)")
        wanted[key] = value
    if given is None:
        return built
    rank_zero_info(f"lit_align: optimizer {name} with " + ", ".join(f"{k}={v}" for k, v in wanted.items())
                   + " (model.learning_rate, model.weight_decay)")
    return _call(optimizer, params, **wanted)


def _call(optimizer, params, **kwargs) -> torch.optim.Optimizer:
    try:
        return optimizer(params, **kwargs)
    except LitAlignError:
        raise
    except (TypeError, ValueError) as exc:  # the class refused an argument
        raise LitAlignError(f"model.optimizer: {exc}") from exc
