"""Training data without a tokenizer: files, rows, Hub datasets and chat templates.

* ``row_formats``: what a record's fields say it is (instruction, chat, prompt/completion, text, preference
  pairs, unpaired preference rows), validated into an ``Example``;
* ``dataset``: reading data files (jsonl, json, csv, parquet, txt) into validated examples, each problem
  naming its file and line;
* ``hub``: ``hub:OWNER/NAME@CONFIG:SPLIT`` entries beside local files (the worker loads them,
  ``studio.train.data.hub``);
* ``templates``: the built-in chat templates, and the tokenizer's own when it has one.
"""
