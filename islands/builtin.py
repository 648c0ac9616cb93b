"""The built-in byte transformer as a model factory like any user's, and shapes as recipes.

Torch-free at import (islands.model is imported when a factory is called), so the config and the CLI
can name the built-in model without loading torch; kept apart from islands.spec, which islands.model
imports, so that no import circle forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from islands.spec import ModelConfig, ModelRecipe


@dataclass(frozen=True)
class ByteTransformerFactory:
    """The built-in model as a model factory like any user's: ``ByteTransformerFactory(cfg)()`` builds it.

    The engine calls every factory with torch's RNG seeded with the run's seed (islands.model_api.instantiate);
    this one passes that seed to islands.model.build_model, so its weights are what they have always been
    for a given seed. It pickles by value (a ModelConfig), so a restarted island or a resumed run
    builds the same shape without an import path. Torch is imported on call.
    """

    cfg: ModelConfig

    @property
    def name(self) -> str:
        """How logs name it: the class and its shape."""
        c = self.cfg
        return f"ByteTransformer(d_model={c.d_model}, n_layers={c.n_layers}, seq_len={c.seq_len}, vocab={c.vocab_size})"

    def __call__(self) -> Any:
        """A fresh ByteTransformer initialized from the seed torch's RNG was last seeded with."""
        import torch

        from islands.model import build_model

        return build_model(self.cfg, seed=torch.initial_seed() % 2**63)



def as_recipe(model: ModelRecipe | ModelConfig, *, seed: int, loss: Any = None) -> ModelRecipe:
    """`model` if it is a recipe; a built-in shape (ModelConfig) as the recipe of the byte transformer with
    `loss` (None: the default), AdamW and `seed`: the one way the engine takes a shape."""
    if isinstance(model, ModelRecipe):
        return model
    return ModelRecipe(model=ByteTransformerFactory(model), loss=loss, optimizer=None, seed=seed, seq_len=model.seq_len)
