"""Finetune Studio: fine-tune a language model on your own GPU by pointing and clicking.

Three layers over one folder on disk, the run directory (docs/architecture.md):

* ``core``: pure Python: the run config, the tables, validation, the memory estimate, data, run directories;
* ``train``: the worker, a plain program that trains with the real libraries and writes events;
* ``gui``: the desktop app, thin PySide6 views over ``core`` that start the worker as a process;
* ``cli``: the ``studio`` command and its subcommands, with the estimate's and fit's in ``cli_memory``.
"""

__version__ = "0.1.0"
