"""The model side of the trainer: building the model (`build`), attention backends that keep packed samples
apart (`attention`, `vision_attention`, `linear_attention`), LoRA and parameter groups, weight loading
and initialisation, and the token-mean loss. Nothing is imported here: each module loads what it needs."""
