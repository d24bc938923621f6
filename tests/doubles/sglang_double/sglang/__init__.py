"""TEST DOUBLE of SGLang: exists only to test hostd's orchestration. Not SGLang."""

__version__ = "0.5.23"
