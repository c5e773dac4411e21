"""Loading models: Hugging Face folders and GGUF files (``checkpoint``), the GGUF conversion and
native-weight readers, and the registry of known models."""
