"""The encode pool (EPD): workers that run only a vision-language model's vision tower and projector."""
