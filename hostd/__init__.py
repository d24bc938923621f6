"""hostd: keep an LLM's weights resident while its inference engine is rebuilt."""

__version__ = "0.1.0"
