"""What the engine needs from a model, asked through functions rather than methods of one model class.

Every engine path (the inner loop, held-out evaluation, a spare's warm-up, the outer optimizer's
embedding rule) goes through these functions, so the built-in ByteTransformer (islands/model.py) and a
user's ``torch.nn.Module`` take the same path. The contract is written up in docs/models.md:

- parameters are ``model.named_parameters()``: a Parameter shared by two modules (tied weights) is
  yielded once, under its first name, so it is one entry of every fragment plan and every message;
- the loss is ``loss_fn(model, batch) -> scalar tensor``, :func:`default_loss` unless the user passes one;
- embeddings are the parameters owned by ``nn.Embedding`` modules (:func:`embedding_parameter_names`);
- a model comes from a zero-argument factory, a callable or an import path (:func:`resolve_factory`);
  :func:`instantiate` builds it under the run's seed, the same model in every process;
- the state the engine trains and merges is :func:`state_tensors`: the parameters plus the persistent
  floating-point buffers (BatchNorm running statistics and the like), see :func:`buffer_names`;
- the inner optimizer is ``optimizer_factory(parameters) -> torch.optim.Optimizer``, AdamW by default.

No Ray and no project imports: torch only, so the CLI can check a factory before Ray starts.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from policies.torch_optimizers import AdamW

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""A loss: ``loss_fn(model, batch) -> scalar tensor``; the engine's batch is an ``(inputs, targets)`` pair."""

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
"""An inner optimizer: ``optimizer_factory(parameters) -> torch.optim.Optimizer`` (the engine scales each
group's lr by the schedule of ``inner.lr_schedule``)."""

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


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of `err`'s message, at most `limit` characters (a user's error inside a one-line message)."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _near_misses(name: str, names: list[str]) -> list[str]:
    """Up to two of `names` close to `name`, ignoring case first (Adamw -> AdamW, not Adam)."""
    by_lower = {n.lower(): n for n in names}
    if name.lower() in by_lower:
        return [by_lower[name.lower()]]
    return [by_lower[n] for n in difflib.get_close_matches(name.lower(), list(by_lower), n=2)]


def _import_target(path: str, role: str = "model factory") -> Callable[..., Any]:
    """The callable an import path ``package.module:attr`` (attr may be dotted) names; `role` names it in errors."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ModelError(f"{role} {path!r} is not an import path; write it as {_PATH_FORM}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ModelError(f"cannot import module {module_name!r} of {role} {path!r} ({err}); check the "
                         "spelling and that the package is installed or on PYTHONPATH") from err
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing: say so in one line
        raise ModelError(f"importing module {module_name!r} of {role} {path!r} failed: "
                         f"{type(err).__name__}: {first_line(err)}; fix that module") from err
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            # A near miss (Adamw for AdamW) is the usual cause: name the closest public names.
            close = _near_misses(part, [n for n in dir(target) if not n.startswith("_")])
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? else " if close else ""
            raise ModelError(f"module {module_name!r} has no attribute {attr!r} ({role} {path!r}); "
                             f"{hint}name a function defined there, as {_PATH_FORM}")
        target = getattr(target, part)
    if not callable(target):
        raise ModelError(f"{role} {path!r} is an object of type {type(target).__name__}, not a callable; "
                         "point it at a function")
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
        if self.spec:
            return self.spec
        return getattr(self.target, "__qualname__", repr(self.target))

    def __call__(self) -> nn.Module:
        """Build a fresh model and check it; whatever the factory raises becomes a one-line ModelError."""
        try:
            model = self.target()
        except Exception as err:  # noqa: BLE001 - the user's code failed: one line naming it, the traceback chained
            raise ModelError(f"model factory {self.name!r} raised {type(err).__name__}: {first_line(err)}; fix the "
                             "factory (it is called with no arguments and returns the model)") from err
        return check_model(model, f"model factory {self.name!r}")


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


def resolve_callable(spec: Any, role: str) -> Callable[..., Any] | None:
    """None for None; else the callable `spec` is, or the one its import path ``"package.module:function"`` names.

    `role` ("loss", "optimizer factory") names it in the one-line :class:`ModelError` a bad spec raises.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        return _import_target(spec.strip(), role)
    if callable(spec):
        return spec
    raise ModelError(f"a {role} is a callable or an import path {_PATH_FORM}, got a {type(spec).__name__}")


def instantiate(model: Any, seed: int) -> nn.Module:
    """The model a factory (callable or import path) builds with torch's RNG seeded with `seed`, checked.

    Every process that builds the run's model (the driver, each island, a restarted island, the
    evaluator, a resumed run) gets the same initial weights; the caller's RNG is left as it was.
    """
    factory = resolve_factory(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def buffer_names(model: nn.Module) -> list[str]:
    """Names of the buffers the engine trains with the parameters: persistent and floating point.

    The rule (docs/models.md): a persistent floating-point buffer (BatchNorm's ``running_mean`` and
    ``running_var``) is state the data shapes, so it travels in its fragment like a parameter and the
    outer optimizer sets it to the islands' weighted mean (no outer learning rate, no momentum: running
    statistics are averages, not gradients to accelerate). An integer buffer (``num_batches_tracked``)
    and a non-persistent buffer (a causal mask, rotary tables) stay as the factory builds them in
    each process: never sent, never merged, never checkpointed.
    """
    names = []
    for module_name, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip and buf.is_floating_point():
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the engine trains, sends, merges and checkpoints, by name: parameters, then buffers.

    Parameters come from ``named_parameters()`` (a tied weight once, under its first name); buffers
    are :func:`buffer_names`. The tensors are the model's own (changing them changes the model).
    """
    state: dict[str, torch.Tensor] = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name in buffer_names(model):
        state[name] = buffers[name]
    return state


def load_state_tensors(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Copy `values` (as :func:`state_tensors` names them) into `model` in place; tied weights stay tied.

    Every state tensor of the model must be there; extra names are refused too, so a checkpoint of
    another model fails here with the names rather than training on half-loaded weights.
    """
    state = state_tensors(model)
    missing, extra = sorted(set(state) - set(values)), sorted(set(values) - set(state))
    if missing or extra:
        raise ModelError(f"the tensors do not fit this model: missing {missing[:3]}, unexpected {extra[:3]}; "
                         "load tensors saved from the same model factory")
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(values[name])


def move_batch(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (in tuples, lists, dicts, at any depth) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: move_batch(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_batch(v, device) for v in batch)
    return batch


def build_optimizer(factory: Any, model: nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float]) -> torch.optim.Optimizer:
    """The inner optimizer over `model`'s trainable parameters: `factory(parameters)`, or AdamW with these settings.

    A user's factory (callable or import path) must return a ``torch.optim.Optimizer``; its groups'
    learning rates are the peaks the engine's lr schedule scales (InnerTrainer.lr_at).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    make = resolve_callable(factory, "optimizer factory")
    if make is None:
        return AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)  # torch's, without the compiler import
    name = factory.strip() if isinstance(factory, str) else getattr(make, "__qualname__", repr(make))
    try:
        optimizer = make(params)
    except Exception as err:  # noqa: BLE001 - the user's code failed: one line naming it, the traceback chained
        raise ModelError(f"optimizer factory {name!r} raised {type(err).__name__}: {first_line(err)}; fix it "
                         "(it is called with the list of trainable parameters)") from err
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelError(f"optimizer factory {name!r} returned a "
                         f"{type(optimizer).__name__}, not a torch.optim.Optimizer; make it return "
                         "e.g. torch.optim.AdamW(parameters, lr=...)")
    return optimizer


def check_loss(value: Any, origin: str) -> torch.Tensor:
    """`value` if it is a finite-or-not scalar float tensor with a gradient; else a one-line ModelError."""
    if not isinstance(value, torch.Tensor):
        raise ModelError(f"{origin} returned a {type(value).__name__}, not a tensor; return the loss tensor itself "
                         "(no .item() or float(...): the gradient flows through it)")
    if value.numel() != 1 or not value.is_floating_point():
        what = f"shape {tuple(value.shape)}" if value.numel() != 1 else f"dtype {value.dtype}"
        raise ModelError(f"{origin} returned a tensor of {what}, not a scalar float tensor; return e.g. "
                         "loss.mean() (one number per batch)")
    if not value.requires_grad:
        raise ModelError(f"{origin} returned a tensor with no gradient; compute it from the model's outputs "
                         "without .item(), .detach() or torch.no_grad()")
    return value.reshape(())

