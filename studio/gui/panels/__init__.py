"""The panels the main window is made of, each a view over the config store or a run.

* ``model``: the model picker (demo, folder, Hub id, recent) and what the model is;
* ``data``: the data files, the detected format, the preview and the length histogram;
* ``techniques``: the method and the techniques, each explained, impossible choices disabled;
* ``estimate``: the live memory estimate: a bar per GPU, the verdict, Fit to my GPU;
* ``scale``: several GPUs or machines: processes, sharding, offload, layer split, the cluster bundle;
* ``samples``: the answers to the sample prompts over a run's steps, beside the base's;
* ``history``: past runs and their charts;
* ``export``: exporting a run (adapter, merged, GGUF) with ``studio export``;
* ``evaluate``: base vs fine-tuned on the held-out rows (``studio eval``): a table, bars and every row;
* ``try_it``: one prompt answered by the base and the fine-tuned model.
"""
