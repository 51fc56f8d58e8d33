"""The model a run trains: loaded, quantized, adapted and prepared.

* ``build``: the tokenizer and the model, with bitsandbytes quantization, k-bit preparation, QAT,
  checkpointing, the method's adapter and the savers applied when the model is built;
* ``methods``: each method's peft config and what it adds to the training loop (``TRAINING``);
* ``layersplit``: a model split over this machine's devices (model parallel in one process).
"""
