"""The building blocks of the panels.

* ``common``: explanations, banners, colors, and the config store every control reads and writes;
* ``controls``: controls bound to one config field, which disable the choices validation refuses, saying why;
* ``rewards``: GRPO's rewards editor (the built-ins picked, weighed and set row by row) and its reward file;
* ``charts``: the live charts (loss, learning rate, tokens/s, memory per device; a GRPO run's rewards);
* ``histogram``: the token-length histogram with the max-length cut;
* ``plotting``: pyqtgraph, imported on first use.
"""
