"""Model making: the named presets (random weights, built and cached locally), the project's own
tokenizers, the training recipe of the shipped model, and the shipped checkpoints (`checkpoints/`)."""
