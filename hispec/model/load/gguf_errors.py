"""The errors of reading a GGUF file, each a :class:`~hispec.config.ConfigError` whose message
says what is wrong (the CLI prints it as one line)."""
from __future__ import annotations

from ...config import ConfigError


class GGUFTypeError(ConfigError):
    """A GGUF tensor of a type hispec cannot read; the message names the tensor and its type."""


class GGUFFileError(ConfigError):
    """A file that is not a readable GGUF file (no GGUF magic, cut short, corrupt); the message says which."""


class GGUFArchError(ConfigError):
    """A GGUF file of an architecture hispec does not run; the message names it and the supported ones."""
