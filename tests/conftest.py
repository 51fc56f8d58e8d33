import os

# Before anything imports Qt: render offscreen, no display needed.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
