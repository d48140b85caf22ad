"""Whether a model folder's weights can fill the model its ``config.json`` makes, found before
that model is built.

This file decides which folders are refused before ``transformers`` builds their model.
``from_pretrained`` builds the model ``config.json`` describes, in memory and at random, and
only then reads the weights into it: a ``config.json`` of a larger model over smaller weights
(a 1.7B's copied into the folder of its 135M, say) took memory in proportion to what it claimed
(4 bytes a parameter, and the CPU to draw each at random) before the shapes were compared, or
ran out of it first. Here the shapes come from the safetensors files' headers (no tensor is
read) and the model is built on PyTorch's meta device (shapes, no memory), so such a folder is
refused first, in words naming both:
1. ``num_hidden_layers`` against the ``layers.N.`` the weights hold (before the model is built,
   since building a million layers takes long even on the meta device);
2. each tensor the weights and the model both name, shape against shape (as the loader would
   find them after building the model, in the same words);
3. the parameters the model has against the numbers the weights hold (weights named otherwise
   than the model names them, which the loader may map).
The counts (1 and 3) refuse only a claim of over ``CLAIMED_PAST_HELD`` times what the weights
hold, a cost out of proportion to the folder: a layer or a tensor short is the loader's to
name precisely, once it has built the model at about the weights' own size. Weights in another
format (PyTorch's pickles) and quantised checkpoints (packed: fewer numbers than parameters) are
left to the loader. It must not know about serving or tokenizers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CLAIMED_PAST_HELD = 2


def layers_named(names: Iterable[str]) -> int:
    """How many decoder layers ``names`` hold (0: none): the highest ``layers.N.`` plus one."""
    found = [int(m.group(1)) for name in names if (m := _LAYER.search(name))]
    return max(found) + 1 if found else 0


def _shape(shape: Iterable[int]) -> str:
    return "x".join(str(int(n)) for n in shape)


def not_the_shapes(mismatched: Sequence[tuple[str, Iterable[int], Iterable[int]]]) -> str:
    """Tensors of another shape in the weights than config.json makes them, told by the first
    (name, shape in the weights, shape by config.json) and counted."""
    name, in_file, in_config = mismatched[0]
    more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
    return (
        f"its weights are not the shapes config.json makes them: {name} is {_shape(in_file)} "
        f"in the weights, {_shape(in_config)} by config.json{more}"
    )


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """Each tensor the folder's safetensors files hold, by name, read from their headers; None
    when its weights are in another format or cannot be read here (the loader reads them, or
    refuses them in its words)."""
    try:
        if (folder / SAFETENSORS_INDEX).is_file():
            index: Any = json.loads((folder / SAFETENSORS_INDEX).read_text(encoding="utf-8"))
            files = sorted(set(index["weight_map"].values()))
        elif (folder / SAFETENSORS).is_file():
            files = [SAFETENSORS]
        else:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            with safe_open(str(folder / name), framework="pt") as weights:
                for key in weights.keys():
                    shapes[key] = tuple(weights.get_slice(key).get_shape())
    except Exception:  # damaged or foreign: the loader says what, naming the file
        return None
    return shapes


def check_weights_fill(folder: Path, config: Any) -> None:
    """Refuse weights that cannot fill the model ``config`` (the folder's ``config.json``)
    makes, before it is built.

    Raises:
        ValueError: naming the layer counts, the first tensor of another shape, or the totals.
    """
    stored = stored_shapes(folder)
    if stored is None or getattr(config, "quantization_config", None) is not None:
        return
    layers, held = getattr(config, "num_hidden_layers", None), layers_named(stored)
    if isinstance(layers, int) and held and layers > CLAIMED_PAST_HELD * held:
        raise ValueError(f"config.json says {layers} layers; its weights hold {held}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)  # type: ignore[no-untyped-call]
    made = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    mismatched = sorted(
        (name, shape, made[name])
        for name, shape in stored.items()
        if name in made and made[name] != shape
    )
    if mismatched:
        raise ValueError(not_the_shapes(mismatched))
    needed = sum(p.numel() for p in model.parameters())  # a tied embedding counted once
    numbers = sum(math.prod(shape) for shape in stored.values())
    if needed > CLAIMED_PAST_HELD * numbers:
        raise ValueError(
            f"config.json makes a model of {needed:,} parameters; its weights hold {numbers:,}"
        )
