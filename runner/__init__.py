"""The corral runner: a per-conversation tool daemon speaking MCP over stdio.

Standard library only, and lean at import time: the runner starts once per
conversation, so only what ``initialize`` and ``ping`` need is imported up
front; the tools import their helpers when first called.
"""

__version__ = "0.1.0"
