"""One way to build an engine from model names: resolve each name (a known
model, fetched once, or a path), load the target, check that its
quantization allows the tensor-parallel size, load the draft (a model or an
EAGLE-3 head) in the dtype that goes with the target, load the target's
tokenizer, and wire them. `LLM` (and so `specpage chat` and `generate`) and
the daemon all build their engines here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specpage.core.engine_config import EngineConfig
from specpage.engine.engine import Engine
from specpage.models.config import ModelLoadError
from specpage.models.eagle3 import LoadedHead
from specpage.models.fetch import ensure_model, known_models
from specpage.models.loader import LoadedModel, draft_dtype, load_model
from specpage.models.quant_names import check_tensor_parallel


@dataclass(frozen=True)
class ModelChoice:
    """Which models an engine runs, and how."""

    target: str | Path
    draft: str | Path | None = None
    dtype: str | torch.dtype | None = None
    device: str = "cpu"
    quantization: str | None = None  # models/quant_names; None: none, the exact path


@dataclass(frozen=True)
class Models:
    target: LoadedModel
    draft: LoadedModel | LoadedHead | None
    tokenizer: Any  # the target's, or None where its folder has none


def resolve_model(name_or_path: str | Path) -> Path:
    """A known model name (fetched into the cache once) or a path."""
    if str(name_or_path) in known_models():
        return ensure_model(str(name_or_path))
    path = Path(name_or_path)
    if not path.exists():
        raise ModelLoadError(f"{name_or_path}: no such file or folder, and not a known model "
                             f"name (known: {', '.join(known_models())})")
    return path


# tokenizer_config.json's tokenizer_class for which AutoTokenizer would pick
# transformers' plain fast tokenizer over tokenizer.json anyway
PLAIN_FAST = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(folder: Path) -> Any:
    fast = (folder / "tokenizer.json").is_file()
    if not fast and not (folder / "tokenizer.model").is_file():
        return None
    if fast and _tokenizer_class(folder) in PLAIN_FAST:
        # the same class and files, without AutoTokenizer's imports of
        # transformers' model registry (about 2.5 s of a start)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _tokenizer_class(folder: Path) -> str | None:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def load_named(name: str | Path, dtype: str | torch.dtype | None, device: str,
               quantization: str | None) -> LoadedModel | LoadedHead:
    """A model by name or path; a file it cannot read (a packaged model
    missing, no permission) is a ModelLoadError that names the file."""
    try:
        return load_model(resolve_model(name), dtype, device, quantization)
    except OSError as error:
        file = f" {error.filename}" if error.filename else ""
        raise ModelLoadError(f"model {name}: cannot read{file}: "
                             f"{error.strerror or error}") from None


def load_models(choice: ModelChoice, tensor_parallel_size: int = 1,
                loading: Callable[[str, str | Path], None] | None = None) -> Models:
    """Both models and the tokenizer. loading(role, name) hears each model
    before it loads (the daemon tells systemd and its log)."""
    announce = loading or (lambda role, name: None)
    announce("target", choice.target)
    target = load_named(choice.target, choice.dtype, choice.device, choice.quantization)
    if isinstance(target, LoadedHead):
        raise ModelLoadError(f"{target.folder}: an EAGLE-3 head is a draft, not a target")
    check_tensor_parallel(target.quantization, tensor_parallel_size)
    draft = None
    if choice.draft:
        announce("draft", choice.draft)
        draft = load_named(choice.draft, draft_dtype(choice.dtype, target), choice.device,
                           choice.quantization)
    return Models(target, draft, load_tokenizer(target.folder))


def build_engine(choice: ModelChoice, config: EngineConfig | None = None,
                 loading: Callable[[str, str | Path], None] | None = None) -> tuple[Engine, Models]:
    """The engine over the chosen models, and the models it runs."""
    config = config or EngineConfig()
    models = load_models(choice, config.tensor_parallel_size, loading)
    return Engine(models.target, models.draft, models.tokenizer, config), models
