"""What the engine needs from a model, asked through functions rather than methods of one model class.

Every engine path (the inner loop, held-out evaluation, a spare's warm-up, the outer optimizer's
embedding rule) goes through these functions, so the built-in ByteTransformer (islands/model.py) and a
user's ``torch.nn.Module`` take the same path. The contract is written up in docs/models.md:

- parameters are ``model.named_parameters()``: a Parameter shared by two modules (tied weights) is
  yielded once, under its first name, so it is one entry of every fragment plan and every message;
- the loss is ``loss_fn(model, batch) -> scalar tensor``, :func:`default_loss` unless the user passes one;
- embeddings are the parameters owned by ``nn.Embedding`` modules (:func:`embedding_parameter_names`);
- a model comes from a zero-argument factory, a callable or an import path (:func:`resolve_factory`).

No Ray and no project imports: torch only, so the CLI can check a factory before Ray starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""A loss: ``loss_fn(model, batch) -> scalar tensor``; the engine's batch is an ``(inputs, targets)`` pair."""

_PATH_FORM = "'package.module:function'"


class ModelError(ValueError):
    """A model, its factory or its outputs do not fit the engine; the message names what and the fix."""


def _output_field(outputs: Any, name: str) -> Any:
    """``outputs.name`` or ``outputs[name]`` (Hugging Face ModelOutput, a dict, a namedtuple), else None."""
    if isinstance(outputs, Mapping):
        return outputs.get(name)
    return getattr(outputs, name, None)


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in a model's output: the output itself if it is a tensor, else its ``logits`` field."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = _output_field(outputs, "logits")
    if not isinstance(logits, torch.Tensor):
        raise ModelError(f"the model returned a {type(outputs).__name__} without a logits tensor; return the logits "
                         "(or an object with .logits), or pass loss_fn=your_loss(model, batch)")
    return logits


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean cross-entropy loss of ``batch``, a scalar tensor: the loss used unless the user passes one.

    - ``(inputs, targets)``, the engine's batch (targets already shifted by one for a causal LM):
      cross-entropy of ``model(inputs)``'s logits (the output itself, or its ``logits`` field) against
      ``targets``, averaged over every position;
    - a mapping that carries ``"labels"`` (Hugging Face style): ``model(**batch).loss``, the model's own loss.

    For the built-in ByteTransformer this is, operation for operation, the loss it has always had.
    """
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ModelError(f"a dict batch needs 'labels' for the default loss (it has {sorted(batch)}); "
                             "add labels, or pass loss_fn=your_loss(model, batch)")
        loss = _output_field(model(**batch), "loss")
        if not isinstance(loss, torch.Tensor):
            raise ModelError("model(**batch) returned no loss tensor although the batch carries labels; "
                             "return outputs with .loss, or pass loss_fn=your_loss(model, batch)")
        return loss
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ModelError(f"the default loss takes an (inputs, targets) pair or a dict with 'labels', got a "
                         f"{type(batch).__name__}; pass loss_fn=your_loss(model, batch) for other batches")
    inputs, targets = batch
    logits = logits_of(model(inputs))  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def embedding_parameter_names(model: nn.Module) -> frozenset[str]:
    """Names, as ``named_parameters()`` gives them, of the parameters owned by ``nn.Embedding`` modules.

    Found by identity, not by name, so a weight tied between an embedding and an output head is
    named once, under whichever name ``named_parameters()`` yields it (its first registration). A bare
    ``nn.Parameter`` (a position table some models keep outside any ``nn.Embedding``) is not an
    embedding here: the outer optimizer's RDA rule treats it like every other parameter.
    """
    owned = {id(p) for module in model.modules() if isinstance(module, nn.Embedding)
             for p in module.parameters(recurse=False)}
    return frozenset(name for name, p in model.named_parameters() if id(p) in owned)


def check_model(model: Any, origin: str = "the model factory") -> nn.Module:
    """``model`` if it is an ``nn.Module`` with a trainable parameter; else a one-line ModelError naming the fix."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"{origin} returned a {type(model).__name__}, not a torch.nn.Module; "
                         "make it return the model itself")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelError(f"the model from {origin} ({type(model).__name__}) has no trainable parameters; "
                         "give it parameters with requires_grad=True (unfreeze them)")
    return model


def _import_target(path: str) -> Callable[..., Any]:
    """The callable an import path ``package.module:attr`` (attr may be dotted) names."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ModelError(f"model factory {path!r} is not an import path; write it as {_PATH_FORM}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ModelError(f"cannot import module {module_name!r} of model factory {path!r} ({err}); check the "
                         "spelling and that the package is installed or on PYTHONPATH") from err
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing: say so in one line
        raise ModelError(f"importing module {module_name!r} of model factory {path!r} failed: "
                         f"{type(err).__name__}: {err}; fix that module") from err
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ModelError(f"module {module_name!r} has no attribute {attr!r} (model factory {path!r}); "
                             f"name a function defined there, as {_PATH_FORM}")
        target = getattr(target, part)
    if not callable(target):
        raise ModelError(f"model factory {path!r} is a {type(target).__name__}, not callable; point it at a "
                         "function that takes no arguments and returns a torch.nn.Module")
    return target


@dataclass(frozen=True)
class ModelFactory:
    """A zero-argument model builder whose every call is checked (:func:`check_model`).

    ``spec`` keeps the import path it was resolved from (None for a callable): what a resumed run or a
    Ray Job resolves again in a new process. Pickles as the target callable by reference (Ray
    serializes a callable from a notebook by value).
    """

    target: Callable[[], Any]
    spec: str | None = None

    @property
    def name(self) -> str:
        """How messages name this factory: its import path, else the callable's qualified name."""
        return self.spec or getattr(self.target, "__qualname__", repr(self.target))

    def __call__(self) -> nn.Module:
        """Build a fresh model and check it."""
        return check_model(self.target(), f"model factory {self.name!r}")


def resolve_factory(spec: Any) -> ModelFactory:
    """A zero-argument, checked model builder from a callable or an import path ``"package.module:function"``.

    Resolving imports the module and finds the callable (errors: not importable, no such attribute,
    not callable); calling the result builds the model and checks it (errors: not an ``nn.Module``,
    no trainable parameters). Every error is a one-line :class:`ModelError` that names the fix.
    """
    if isinstance(spec, ModelFactory):
        return spec
    if isinstance(spec, str):
        return ModelFactory(_import_target(spec.strip()), spec.strip())
    if callable(spec):
        return ModelFactory(spec)
    raise ModelError(f"a model factory is a callable or an import path {_PATH_FORM}, got a {type(spec).__name__}")
