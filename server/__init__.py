"""qflash's SGLang plugin, launcher, model preset and offline dummy model."""
