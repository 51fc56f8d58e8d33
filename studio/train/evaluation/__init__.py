"""Asking a model: the base and the fine-tuned one side by side, and how much better the tuned one answers.

* ``generate``: ``studio generate RUN_DIR --prompt TEXT``: both answer one prompt;
* ``compare``: ``studio eval RUN_DIR``: both models' loss and scored greedy answers on held-out rows;
* ``benchmarks``: ``studio eval RUN_DIR --tasks``: lm-evaluation-harness tasks, base vs fine-tuned;
* ``samples``: while training, the model's greedy answers to a few prompts every schedule.sample_every steps;
* ``exact_match``: greedy answers to prompts (what the others generate with), and how many are exactly right.
"""
