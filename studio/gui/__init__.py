"""The desktop app: thin PySide6 views over studio.core. Never imports torch.

The modules here are the window and what it runs:

* ``app``: ``studio`` with no subcommand: the application and its main window;
* ``main_window``: setup on the left (model, data, techniques, estimate), the run on the right;
* ``runs``: starting, following, stopping and resuming the training worker;
* ``process``: subprocesses for the ML side: short helpers attached by pipes, the detached worker;
* ``tasks``: slow pure-Python work (reading a dataset) off the GUI thread;
* ``log_dialog``: a run's full log and the worker's console output;
* ``errors``: unexpected exceptions as a readable dialog.

and the sub-packages (their ``__init__`` names their files):

* ``state``: what the window knows and computes, in pure Python without Qt (tested without a screen);
* ``widgets``: the building blocks: controls bound to config fields, charts, the config store;
* ``panels``: the tabs and columns the window is made of;
* ``runtime``: the training runtime's dialog and the steps that make it.
"""
