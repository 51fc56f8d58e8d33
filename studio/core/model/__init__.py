"""What the studio knows about a model before loading it, from its config.json and its folder.

* ``families``: each architecture family by hand: its config fields, linear layers, parameters and the block
  recipe the activation tape replays;
* ``info``: a model's shape (``ModelShape``) from its config.json, read from a folder or the Hub cache;
* ``check``: a local model folder checked file by file before anything loads it, and what remote code would run;
* ``vision``: the vision-language families (``VISION_FAMILIES``): which train on images, how their parts are named;
* ``stages``: what a pipeline needs of a family that its config.json says (no mixture of experts, no sliding window).
"""
