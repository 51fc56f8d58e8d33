"""The memory estimate: what a run needs on each device, itemized, and how to make it fit.

* ``estimate``: puts the parts together: the phases of a step, their peak on each device, the notes;
* ``results``: what an estimate says: bytes per part and device, and the verdict;
* ``regime``: a run's settings that memory depends on, resolved from its config, and the rules the
  worker applies too (the loaded weights' dtype, which loss it computes, which weights stay in CPU RAM);
* ``parts``: the parts a step's memory is itemized into, each counted by one of its modules;
* ``sharding``: how the model states spread over GPUs (ZeRO, offload) and what CUDA adds;
* ``placement``: the layer split: which device holds each part of the model; and the pipeline: its memory per
  stage (the micro-batches each holds in flight), its bubble, its cost against the layer split, ZeRO-3 and FSDP
  (memory per GPU, idle share, bytes over the links), and what it refuses;
* ``derived``: the estimate of a model no family describes, scaled from a traced step (``studio.train.measure.trace``);
* ``recount``: LoRA's rank, targets and dropout recounted from the trace's block record;
* ``run_data``: the run's own data: its longest micro-batch, for the estimate of what it will really train;
* ``savers``: the table of memory savers (``SAVER_SPECS``): what each switch saves and costs, and what it cannot
  be combined with;
* ``fit``: the fastest configuration whose estimate fits a GPU.
"""
