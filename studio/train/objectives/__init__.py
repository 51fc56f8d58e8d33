"""What a training step minimizes.

* ``next_token``: summed next-token cross-entropy over the target tokens, full or chunked (the lean loss).
"""
