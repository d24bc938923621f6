"""Checkpoints: the tiny random models hostd writes for tests and the demo
(random_model.py, gguf.py), and the one guarded reader of a checkpoint's
config.json (config_file.py)."""
