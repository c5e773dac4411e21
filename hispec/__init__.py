"""hispec: lossless hierarchical self-speculative decoding on early-exit LLMs."""
from .config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from .generate import GenerationOutput, Generator
from .settings import StrategyName

__all__ = ["ConfigError", "GenerationOutput", "Generator", "ModelConfig", "SamplingParams", "SpecConfig",
           "StrategyName"]
__version__ = "0.1.0"
