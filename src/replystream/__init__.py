"""replystream: stream language-model replies as they are made, and measure that they are."""

__version__ = "0.1.0"
