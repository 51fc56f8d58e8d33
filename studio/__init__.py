"""Finetune Studio: fine-tune a language model on your own GPU by pointing and clicking."""

__version__ = "0.1.0"
