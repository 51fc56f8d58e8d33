"""What exports need that is no ML: GGUF's types, the model card, whether the Hub will take an upload.

* ``gguf``: GGUF quantization types, their verification thresholds, and the Ollama Modelfile's text;
* ``model_card``: an export's README.md from the config, the events and the export's record;
* ``publishing``: whether an export can be published to the Hugging Face Hub, asked before any work.

The worker's side, which makes the files, is ``studio.train.export``.
"""
