"""Exporting a run, each export verified against the trained model before it is kept.

* ``hf_format``: the Hugging Face format: a LoRA adapter, or a merged model (16-bit, or torchao-quantized
  after QAT);
* ``gguf``: GGUF files for llama.cpp, Ollama and LM Studio, made and checked with ``llama_cpp``;
* ``llama_cpp``: llama.cpp's converter and quantizer;
* ``modelfile``: the Ollama Modelfile of a GGUF export;
* ``chat``: the chat template and end of turn an export carries, so it is used as it was trained;
* ``card``: the export's model card (README.md; its text is ``studio.core.export.model_card``);
* ``hub_push``: publishing an export to the Hugging Face Hub.
"""
