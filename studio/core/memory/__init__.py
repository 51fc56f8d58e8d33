"""The parts of the memory estimator; ``studio.core.estimate`` puts them together.

Each module has one job, and each imports only those listed before it:

* ``parts``: the names of the memory parts and of a step's phases, with the words users read for them;
* ``results``: what an estimate says (bytes per part and device, the verdict) and byte sizes as text;
* ``regime``: a run's settings that memory depends on, resolved from its config, and the rules the
  worker applies too (the loaded weights' dtype, which loss it computes);
* ``states``: the trainable tensors, the weights as loaded, the optimizer's state: the model states;
* ``tape``: the activations, from interpreting each decoder block's recipe, and the logits and loss;
* ``sharding``: how the model states spread over GPUs (ZeRO, offload) and what CUDA adds.

``studio.core.placement`` (the layer split) builds on ``results``, ``regime`` and ``states``.
"""
