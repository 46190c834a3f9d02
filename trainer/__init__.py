"""The bundled elastic DDP trainer (``torchrun ... -m trainer``); see ``trainer.cli``."""
