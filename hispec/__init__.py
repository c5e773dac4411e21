"""hispec: lossless hierarchical self-speculative decoding on early-exit LLMs."""
from .config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from .generate import GenerationOutput, Generator

__all__ = ["ConfigError", "GenerationOutput", "Generator", "ModelConfig", "SamplingParams", "SpecConfig"]
__version__ = "0.1.0"
