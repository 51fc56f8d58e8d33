"""The training worker: a plain program that trains with the real libraries and writes events.

Never imports Qt. Start it as ``studio train CONFIG`` or ``python -m studio.train CONFIG``. The modules here
are the run itself:

* ``entry``: the command line (``studio train``, ``python -m studio.train``);
* ``worker``: one run, as a recipe: data, model, engine, restore, then the optimizer loop and its events;
* ``preflight``: what is checked before anything heavy loads (data files, the model folder), and safe loading;
* ``optim``: the optimizer and the learning-rate schedule;
* ``checkpoint``: checkpoints written atomically and loaded without unpickling code;
* ``control``: stop requests that work on every OS (files in the run directory, a line on stdin);
* ``quiet``: library chatter that says nothing about the run, silenced;
* ``demo``: ``studio demo``, a real fine-tune of the embedded tiny model;
* ``runtime_check``: the desktop runtime's check of the Python it runs in;
* ``doctor``: the self-test's checks (``studio doctor``): each technique trained on this device and on the CPU,
  and CUDA's overheads measured.

and the sub-packages, one concern each (their ``__init__`` names their files):

* ``data``: tokenized data, packed micro-batches and the attention that keeps packed examples apart;
* ``objectives``: what a step minimizes (next-token cross-entropy today), behind one small interface;
* ``savers``: the memory savers' worker code (tiled MLP, activation offload, weights kept in CPU RAM);
* ``model``: loading the model and applying the method, quantization, QAT and the savers;
* ``distributed``: the engines (one process, DDP, FSDP, ZeRO), the launcher and the ranks' failure watch;
* ``measure``: memory measured, simulated and traced, and what an out-of-memory error says;
* ``evaluation``: asking the model: side-by-side answers, base vs tuned on held-out rows, samples while training;
* ``tracking``: the run's events also as TensorBoard files and to the opt-in experiment trackers;
* ``export``: the Hugging Face and GGUF exports, their chat template, model card and Hub upload.
"""

from studio.train.quiet import quiet_library_noise

quiet_library_noise()  # before any submodule imports the ML stack
