"""The window's state and logic in pure Python: no Qt, so it is tested without a screen.

* ``memory``: the window's only door to the memory estimator and fit (``studio.core.memory``), and the
  simulation in a subprocess;
* ``job_state``: one training run as the window sees it (only a ``finished`` event says completed);
* ``series``: a run's chart data and its sample prompts' answers, built from its events;
* ``run_history``: past and running runs on disk: what History lists and what the window re-attaches to;
* ``console``: what subprocesses print, split into lines, and errors made readable;
* ``data_preview``: examples rendered as the model will see them, and their token lengths;
* ``model_summary``: what the model picker shows about a model, from its files;
* ``hardware``: this machine's GPUs (NVML), and the common cards to plan for when there is none;
* ``settings``: the app's remembered choices, in the user's config directory;
* ``changes``: what a preset changed, in the window's words.
"""
