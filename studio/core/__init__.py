"""Pure-Python core: config schema, validation, estimates, datasets, run directories, events.

Imports neither Qt nor torch at import time, so the GUI can use all of it.
"""
