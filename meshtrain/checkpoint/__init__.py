"""Checkpoints: the trained model's full weights for sampling (`weights.py`), and sharded,
resharding checkpoints of the whole training state on torch.distributed.checkpoint
(`sharded.py`, over `boxes.py`, `dcp.py` and `folders.py`). Importing the package loads no
torch (the command line checks folders before any rank starts)."""
