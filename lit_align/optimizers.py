"""Which optimizer a run steps with, and how its gradients are clipped before the step.

The optimizer: TRL's names (``model.optim``: each of transformers' ``OptimizerNames`` that builds a torch, transformers
or bitsandbytes optimizer, with the class and fixed arguments transformers' Trainer gives it) or any class the
LightningCLI way (``model.optimizer: {class_path, init_args}``). The names that need another package (torchao,
torch_xla, torchdistx, GaLore, APOLLO, LOMO, schedule-free, ...) are refused, naming those that work.

Either way ``model.learning_rate`` and ``model.weight_decay`` are the optimizer's ``lr`` and ``weight_decay`` (TRL's
names; one owner each). ``model.optimizer``'s ``init_args`` set everything else; an ``lr`` or ``weight_decay`` there
that differs from the class's default (so the user set it) and from the model's is a second owner, and refused, as is
``model.optim`` chosen beside ``model.optimizer`` or an argument the class rejects: one error line each. TRL's
``adam_beta1``, ``adam_beta2``, ``adam_epsilon`` (``model.adam_*``, ``AdamSettings``) are the betas and eps of the
named optimizers that take them (``NamedOptimizer.adam``); a value other than the default for one that takes none,
or beside ``model.optimizer`` (whose ``init_args`` own its betas), is refused rather than ignored as TRL would.

Clipping (``trainer.gradient_clip_val``, TRL's ``max_grad_norm``) follows transformers' Trainer: the true gradients
(unscaled under fp16), their global norm over every parameter (every rank's shard under FSDP) clipped, then the step,
whatever the optimizer: ``unscale_gradients`` and ``clip_gradients``, called by ``AlignModule``'s hooks.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info

from lit_align.errors import LitAlignError

DEFAULT_OPTIM = "adamw_torch_fused"  # TRL's (transformers' on torch >= 2.8): AdamW in one kernel
ADEMAMIX_BETA3 = 0.9999  # transformers' AdEMAMix defaults (its optim_args beta3 and alpha)
ADEMAMIX_ALPHA = 5.0


@dataclass(frozen=True)
class AdamSettings:
    """TRL's ``adam_beta1``, ``adam_beta2``, ``adam_epsilon`` (``TrainingArguments``' defaults)."""

    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8


@dataclass(frozen=True)
class NamedOptimizer:
    """What one of transformers' optimizer names builds: ``module.cls`` with the ``fixed`` arguments, and TRL's Adam
    settings as ``adam`` says: ``betas_eps`` (``betas=(beta1, beta2), eps``), ``betas`` (Lion: no eps), ``ademamix``
    (AdEMAMix: a third beta), ``""`` (none)."""

    module: str
    cls: str
    fixed: dict = field(default_factory=dict)
    adam: str = ""

    def adam_kwargs(self, adam: AdamSettings) -> dict:
        betas = (adam.beta1, adam.beta2)
        return {"betas_eps": {"betas": betas, "eps": adam.epsilon}, "betas": {"betas": betas},
                "ademamix": {"betas": (*betas, ADEMAMIX_BETA3), "eps": adam.epsilon}, "": {}}[self.adam]

    def takes(self) -> tuple[str, ...]:
        """The ``model.adam_*`` settings this optimizer reads."""
        return {"betas_eps": ("adam_beta1", "adam_beta2", "adam_epsilon"), "betas": ("adam_beta1", "adam_beta2"),
                "ademamix": ("adam_beta1", "adam_beta2", "adam_epsilon"), "": ()}[self.adam]

    def load(self, name: str) -> type:
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:  # only bitsandbytes is optional
            if exc.name == "bitsandbytes":
                raise LitAlignError(f"model.optim {name!r} needs bitsandbytes: pip install 'lit_align[bnb]'") from None
            raise LitAlignError(f"model.optim {name!r}: {self.module} does not import: {exc}") from exc
        return getattr(module, self.cls)


def _bnb(cls: str, bits: int, paged: bool | None, adam: str = "betas_eps") -> NamedOptimizer:
    """A bitsandbytes optimizer as transformers builds it: ``optim_bits``, and ``is_paged`` except for RMSprop."""
    fixed = {"optim_bits": bits} if paged is None else {"optim_bits": bits, "is_paged": paged}
    if cls == "AdEMAMix":
        fixed["alpha"] = ADEMAMIX_ALPHA
    return NamedOptimizer("bitsandbytes.optim", cls, fixed, adam)


# ``model.optim``: transformers' names -> what each builds (``transformers.trainer_optimizer``'s handlers)
OPTIMIZERS = {
    "adamw_torch": NamedOptimizer("torch.optim", "AdamW", adam="betas_eps"),
    "adamw_torch_fused": NamedOptimizer("torch.optim", "AdamW", {"fused": True}, "betas_eps"),
    "adafactor": NamedOptimizer("transformers.optimization", "Adafactor",
                                {"scale_parameter": False, "relative_step": False}),
    "sgd": NamedOptimizer("torch.optim", "SGD"),
    "adagrad": NamedOptimizer("torch.optim", "Adagrad"),
    "rmsprop": NamedOptimizer("torch.optim", "RMSprop"),
    "adamw_bnb_8bit": _bnb("AdamW", 8, False),
    "adamw_8bit": _bnb("AdamW", 8, False),  # transformers: an alias of adamw_bnb_8bit
    "paged_adamw_32bit": _bnb("AdamW", 32, True),
    "paged_adamw_8bit": _bnb("AdamW", 8, True),
    "ademamix": _bnb("AdEMAMix", 32, False, "ademamix"),
    "ademamix_8bit": _bnb("AdEMAMix", 8, False, "ademamix"),
    "paged_ademamix_32bit": _bnb("AdEMAMix", 32, True, "ademamix"),
    "paged_ademamix_8bit": _bnb("AdEMAMix", 8, True, "ademamix"),
    "lion_32bit": _bnb("Lion", 32, False, "betas"),
    "lion_8bit": _bnb("Lion", 8, False, "betas"),
    "paged_lion_32bit": _bnb("Lion", 32, True, "betas"),
    "paged_lion_8bit": _bnb("Lion", 8, True, "betas"),
    "rmsprop_bnb": _bnb("RMSprop", 32, None, ""),
    "rmsprop_bnb_8bit": _bnb("RMSprop", 8, None, ""),
    "rmsprop_bnb_32bit": _bnb("RMSprop", 32, None, ""),
}


def check_optimizer_choice(optim: str, optimizer, adam: AdamSettings = AdamSettings()) -> None:
    """Refuse an unknown or unsupported ``model.optim``, one chosen beside ``model.optimizer``, and ``model.adam_*``
    out of range or set for an optimizer that does not read them."""
    if optim not in OPTIMIZERS:
        from transformers.training_args import OptimizerNames

        what = ("is one of transformers' optimizers that needs a package lit_align does not build with (torchao, "
                "torch_xla, torchdistx, GaLore, APOLLO, LOMO, schedule-free, ...)"
                if optim in {n.value for n in OptimizerNames} else "is not an optimizer name")
        raise LitAlignError(f"model.optim {optim!r} {what}: expected one of {', '.join(OPTIMIZERS)} (or "
                            "model.optimizer: {class_path: ..., init_args: ...} for any torch optimizer)")
    if optimizer is not None and optim != DEFAULT_OPTIM:
        raise LitAlignError(f"model.optim {optim!r} and model.optimizer both choose the optimizer: set one")
    _check_adam(optim, optimizer, adam)


def _check_adam(optim: str, optimizer, adam: AdamSettings) -> None:
    settings = {"adam_beta1": (adam.beta1, AdamSettings.beta1), "adam_beta2": (adam.beta2, AdamSettings.beta2),
                "adam_epsilon": (adam.epsilon, AdamSettings.epsilon)}
    for name, (value, _) in settings.items():
        if name != "adam_epsilon" and not 0 <= value < 1:
            raise LitAlignError(f"model.{name} must be in [0, 1), got {value}")
    if adam.epsilon < 0:
        raise LitAlignError(f"model.adam_epsilon must be >= 0, got {adam.epsilon}")
    takes = () if optimizer is not None else OPTIMIZERS[optim].takes()
    for name, (value, default) in settings.items():
        if value != default and name not in takes:
            where = ("model.optimizer's init_args set its own (betas, eps)" if optimizer is not None
                     else f"model.optim {optim!r} takes no {'eps' if name == 'adam_epsilon' else 'betas'}")
            raise LitAlignError(f"model.{name} is {value}, but {where}: leave model.{name} at {default}")


def named_optimizer(optim: str, adam: AdamSettings = AdamSettings()) -> tuple[type, dict]:
    """``model.optim``'s class and its arguments besides ``lr`` and ``weight_decay``, as transformers'
    ``Trainer.get_optimizer_cls_and_kwargs`` gives them."""
    spec = OPTIMIZERS[optim]
    return spec.load(optim), {**spec.fixed, **spec.adam_kwargs(adam)}


def build_optimizer(optim: str, optimizer, params, learning_rate: float, weight_decay: float,
                    adam: AdamSettings = AdamSettings(), model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer over ``params``: ``model.optimizer`` (a callable ``params -> optimizer``; from the CLI a
    ``functools.partial`` holding its ``init_args``) if given, else ``model.optim``'s (``named_optimizer``); a
    bitsandbytes 8-bit one keeps ``model``'s embeddings' states in 32 bits, as transformers' Trainer does."""
    if optimizer is None:
        cls, kwargs = named_optimizer(optim, adam)
        built = cls(params, lr=learning_rate, weight_decay=weight_decay, **kwargs)
        if model is not None and kwargs.get("optim_bits") == 8:
            _embeddings_in_32bit(model)
        return built
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


def _embeddings_in_32bit(model: torch.nn.Module) -> None:
    import bitsandbytes

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def _call(optimizer, params, **kwargs) -> torch.optim.Optimizer:
    try:
        return optimizer(params, **kwargs)
    except LitAlignError:
        raise
    except (TypeError, ValueError) as exc:  # the class refused an argument
        raise LitAlignError(f"model.optimizer: {exc}") from exc


# -- the step: TRL's max_grad_norm under mixed precision and sharding ---------------------------------------------------
def unscale_gradients(trainer, optimizer, backward_ran: bool) -> None:
    """fp16 (``16-mixed``): make the gradients that ``on_before_optimizer_step``, the numeric guard,
    ``train/grad_norm`` and the clipping see the true ones. Lightning unscales them before that hook except for an
    optimizer that unscales inside its own step (fused AdamW, the default): that one's still carry the GradScaler's
    scale there. So unscale them now, as transformers' Trainer does before it clips (accelerate's
    ``clip_grad_norm_``); the scaler's step then gives the fused kernel no scale, only its inf flag, and skips a
    non-finite step as before. Not when the batch skipped its backward (``backward_ran`` false:
    ``on_nonfinite_loss: skip``): Lightning then neither steps nor updates the scaler, and the scaler would refuse
    the next unscale. bf16 has no scaler: nothing to do."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and backward_ran and _optimizer_handles_unscaling(optimizer):
        scaler.unscale_(optimizer)


def clip_gradients(trainer, optimizer, clip_val: float | None, algorithm: str | None) -> bool:
    """Clip as TRL's ``max_grad_norm`` where Lightning would refuse; False where Lightning's own clipping is right.

    - FSDP (``norm``): the root module's ``clip_grad_norm_``, the global norm over every rank's shard (Lightning's
      ``FSDPPrecision`` refuses norm clipping: ``torch.nn.utils.clip_grad_norm_`` would see one shard's norm).
    - Mixed precision with an optimizer that unscales inside its step (fused AdamW, lit_align's and TRL's default):
      Lightning's ``MixedPrecision`` refuses, since under fp16 its gradients would still be scaled; they are not by
      now (bf16 never scales them, fp16's ``unscale_gradients`` has), so the plain clipping that check guards is right.
    """
    if not clip_val:
        return False
    algorithm = GradClipAlgorithmType(algorithm or GradClipAlgorithmType.NORM)
    plugin, strategy = trainer.precision_plugin, trainer.strategy
    if algorithm == GradClipAlgorithmType.NORM and isinstance(strategy, FSDPStrategy):
        strategy.model.clip_grad_norm_(clip_val)
        return True
    if isinstance(plugin, MixedPrecision) and _optimizer_handles_unscaling(optimizer):
        Precision.clip_gradients(plugin, optimizer, clip_val, algorithm)  # past MixedPrecision's refusal
        return True
    return False
