"""HF checkpoint folders: config.json, *.safetensors (sharded or not), tokenizer files."""
from __future__ import annotations

import glob
import json
import os

from . import Checkpoint


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def load_hf_folder(folder: str) -> Checkpoint:
    config = _read_json(os.path.join(folder, "config.json"))
    if not config:
        raise FileNotFoundError(f"{folder} has no config.json")
    files = _safetensors_files(folder)

    def weights(keep_quantized: bool = False):  # safetensors here hold dense tensors only
        from safetensors import safe_open
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    tokenizer = None
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    elif os.path.isfile(os.path.join(folder, "tokenizer.model")):
        tokenizer = os.path.join(folder, "tokenizer.model")
    tok_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    template_file = os.path.join(folder, "chat_template.jinja")
    if "chat_template" not in tok_config and os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            tok_config["chat_template"] = f.read()
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer,
                      tokenizer_config=tok_config,
                      generation_config=_read_json(os.path.join(folder, "generation_config.json")),
                      source=folder)
