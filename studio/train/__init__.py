"""The training worker: a plain program that trains with the real libraries and writes events.

Never imports Qt. Start it as ``studio train CONFIG`` or ``python -m studio.train CONFIG``.
"""

from studio.train.quiet import quiet_library_noise

quiet_library_noise()  # before any submodule imports the ML stack
