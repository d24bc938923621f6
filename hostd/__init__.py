"""hostd: keep an LLM's weights resident while its inference engine is rebuilt."""

import time

STARTED = time.monotonic()  # when this process began importing hostd (start-up phases)

__version__ = "0.1.0"
