"""A run on disk and the processes around it: the run directory is the unit of everything.

* ``directory``: the run directory: its config, events, log, checkpoints, exports and control files;
* ``events``: the event protocol between the worker and everything that watches it (``events.jsonl``);
* ``commands``: every subprocess studio starts (worker, torchrun, export, generate, trace, simulation,
  runtime check), its exit codes, and how its result is read;
* ``evaluation``: what `studio eval` found, base vs tuned: answer scores, summaries, ``evaluation.json``;
* ``bundle``: a launch bundle for a run on several machines: one folder to copy to every node.
"""
