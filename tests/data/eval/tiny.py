"""The dataset of qflash_tiny.yaml: the JSON-lines file beside it, read by `datasets` without a hub."""

from pathlib import Path

import datasets


def load(**kwargs) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("qflash_tiny.jsonl"))})
