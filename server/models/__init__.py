"""Model classes SGLang registers from qflash (`ModelRegistry.register`, overwrite=True)."""
