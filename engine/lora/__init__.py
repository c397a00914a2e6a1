"""Multi-LoRA serving: PEFT adapters, batched low-rank deltas, slot management.

Nothing here is imported at package import time, so the scheduler and the simulated
mode (which need only :mod:`.manager`) do not pull in torch.
"""
