"""Asking a model: the base and the fine-tuned one side by side, and how much better the tuned one answers.

* ``generate``: ``studio generate RUN_DIR --prompt TEXT``: both answer one prompt;
* ``compare``: ``studio eval RUN_DIR``: both models' loss and scored greedy answers on held-out rows (a grpo
  run: its held-out prompts' greedy answers scored by its rewards);
* ``benchmarks``: ``studio eval RUN_DIR --tasks``: lm-evaluation-harness tasks, base vs fine-tuned;
* ``samples``: while training, the model's greedy answers to a few prompts every schedule.sample_every steps;
* ``exact_match``: greedy answers to prompts (what the others generate with), how many are exactly right, and
  grpo's answers scored by the run's rewards (its eval events and ``studio eval`` alike).
"""
