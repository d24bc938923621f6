"""Checkpoints hostd writes itself: tiny random models for tests and the demo."""
