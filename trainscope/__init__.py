"""trainscope: online performance troubleshooting for large-model training.

Importing this package is cheap: it pulls in neither torch nor the stream-processing stack.
"""

__version__ = "0.1.0"
