"""Where rollout runs (`rollout.placement`): the trainer's one view of it is a BatchSource (source.py)."""

from postrl.placement.source import BatchSource, open_source

__all__ = ["BatchSource", "open_source"]
