"""Tracking: the run's events, as they are written, also to experiment trackers.

* ``figures``: what a tracker draws of each event (scalars by tag, samples as text or a table), once for every
  tracker, and the ``Tracker`` interface;
* ``tensorboard``: TensorBoard event files in ``RUN/tensorboard`` (on by default: ``schedule.tensorboard``);
* ``bridges``: the opt-in trackers of ``schedule.trackers`` (Trackio, Weights & Biases, MLflow), each an optional
  extra, with their logins their own and their files outside the run directory;
* ``writer``: the run's event writer with its trackers beside it (a failing one dropped with a warning), and
  ``studio track RUN [--to TRACKER]`` feeding them the run's ``events.jsonl`` afterwards.
"""
