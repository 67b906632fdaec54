"""Tokenization identical to llama.cpp, built only from a GGUF file's metadata."""
from .stream import StreamDecoder
from .tokenizer import Tokenizer

__all__ = ["StreamDecoder", "Tokenizer"]
