"""Tracking: the run's events, as they are written, also to experiment trackers.

* ``tensorboard``: TensorBoard event files in ``RUN/tensorboard`` (on by default: ``schedule.tensorboard``),
  fed from the same events as ``events.jsonl``, and ``studio track RUN`` to write them again from that file.
"""
