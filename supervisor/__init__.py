"""corral: an execution-workspace supervisor for AI-agent runtimes.

This package is the Twisted daemon and its client library. Keep this module
free of imports: ``supervisor.client`` must stay usable without Twisted.
"""

__version__ = "0.1.0"
