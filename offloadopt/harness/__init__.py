"""Harness around the optimizer: the GPT-2 model, the data and the training loop."""
