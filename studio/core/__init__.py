"""Pure-Python core: what a run is, what it costs, and everything on disk around it. No Qt, no ML stack.

Imports neither Qt nor torch at import time, so the window and the command line use all of it; the worker
(``studio.train``) builds on it. The modules here are the run config and the rules over it:

* ``errors``: errors that name a field, a file or a line, with what to do;
* ``config``: the run config, frozen dataclasses with a ``Literal`` per choice, YAML in and out;
* ``choices``: the choice fields' ``Literal``s and the words users read for their values;
* ``methods``: the table of training methods (``METHOD_SPECS``);
* ``validation``: every problem of a config at once, each naming its field;
* ``presets``: the embedded demo's config;
* ``machine``: what this machine has for a run beside its GPUs (its CPU RAM);
* ``sizes``: byte sizes written and read as text (binary units);
* ``folders``: where studio keeps its files on this machine (the user's data folder);
* ``rewards``: GRPO's rewards, the built-ins and the user's trusted reward file, summed with their weights.

and the sub-packages, one concern each (their ``__init__`` names their files):

* ``model``: a model's facts from its config.json: the architecture families, its shape, a folder's check;
* ``data``: data files and their rows, Hub datasets, chat templates;
* ``memory``: the memory estimate, fit to a GPU, the layer split's placement, the table of memory savers;
* ``run``: a run on disk and the processes around it: the run directory, its events, every subprocess
  command, the cluster bundle;
* ``export``: what exports need without torch: GGUF types, the model card, whether the Hub takes it;
* ``runtime``: the desktop download's training runtime: the Python environment it makes, its check, its progress;
  and the GPU self-test's techniques, verdicts and report.
"""
