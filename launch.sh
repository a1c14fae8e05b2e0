#!/usr/bin/env bash
# Start qflash (Qwen3.5-4B + DFlash K=16 on SGLang) on 127.0.0.1:30000.
# No arguments: the offline dummy model. Real checkpoints: --model-path DIR --draft-model-path DIR.
# Any other flag goes to sglang.launch_server. All of it lives in `qflash serve` (server/launcher.py).
exec "${PYTHON:-python3}" -m qflash.server.cli serve "$@"
