"""From data files to micro-batches.

* ``prepare``: data files (and Hub datasets) to tokenized splits with loss masks, made once per machine;
* ``hub``: loading the Hub datasets a config names (``studio.core.data.hub``);
* ``images``: rows with images for vision-language models: pixel values, grids, image tokens never learned;
* ``packing``: the examples of a micro-batch end to end in one row, without padding;
* ``packed_attention``: attention for packed rows (each example attends to itself alone), and the probe
  that says whether a model keeps them apart.
"""
