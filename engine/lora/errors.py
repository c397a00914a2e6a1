"""The error type of the LoRA package (kept free of torch imports)."""


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the file and the reason."""
