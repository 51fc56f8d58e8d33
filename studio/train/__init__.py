"""The training worker: a plain program that trains with the real libraries and writes events.

Never imports Qt. Start it as ``studio train CONFIG`` or ``python -m studio.train CONFIG``.
"""
