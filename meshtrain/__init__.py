"""meshtrain: every strategy of distributed training, small, readable, and verified
against one-process training."""

__version__ = "0.1.0"
