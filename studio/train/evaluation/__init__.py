"""Asking a model: the base and the fine-tuned one side by side, and exact-match accuracy.

* ``generate``: ``studio generate RUN_DIR --prompt TEXT``: both answer one prompt;
* ``exact_match``: greedy answers to held-out prompts, and how many are exactly right (the demo's measure).
"""
